//! Two-GPU tests of pool peer access. They need two GPUs that can access each other and fail with a
//! clear message otherwise. Run: `cargo test -p mempool-core --features gpu --test two_gpu`.
#![cfg(feature = "gpu")]

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Access, Device, Error, MemPool, PeerRefusal, PoolProps, Stream};

fn two_gpus() -> (Device, Device) {
    let count = Device::count().expect("CUDA driver");
    assert!(
        count >= 2,
        "two-GPU tests need at least two GPUs; this machine has {count}: run them on a two-GPU machine"
    );
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    assert!(
        d1.can_access_peer(d0).unwrap(),
        "device 1 cannot access device 0's memory (cuDeviceCanAccessPeer): these tests need peer-capable GPUs"
    );
    (d0, d1)
}

#[test]
fn two_gpu_grant_read_query_revoke() {
    let (d0, d1) = two_gpus();
    let (ctx0, ctx1) = (d0.context().unwrap(), d1.context().unwrap());
    let (s0, s1) = (Stream::new(&ctx0).unwrap(), Stream::new(&ctx1).unwrap());
    let (k0, k1) = (CheckKernels::load(&ctx0).unwrap(), CheckKernels::load(&ctx1).unwrap());

    let pool = MemPool::new(&d0, &PoolProps::new()).unwrap();
    assert_eq!(
        pool.access(&d1).unwrap(),
        Access::None,
        "a new pool is private to its device"
    );
    let n = 1 << 20;
    let src = pool.alloc(n * 4, s0.as_ref()).unwrap();
    // SAFETY: `src` holds n u32s on s0.
    unsafe { k0.iota(src.ptr(), n, 42, s0.as_ref()) }.unwrap();
    s0.synchronize().unwrap();

    pool.grant_access(&d1).unwrap();
    assert_eq!(pool.access(&d1).unwrap(), Access::ReadWrite);
    // Device 1 reads device 0's pool memory with its own kernel, through the mapping.
    let dst = d1.default_pool().unwrap().alloc(n * 4, s1.as_ref()).unwrap();
    // SAFETY: both ranges hold n u32s; `src` is complete (s0 synchronized) and mapped for device 1.
    unsafe { k1.copy(dst.ptr(), src.ptr(), n, s1.as_ref()) }.unwrap();
    let mut host = vec![0u8; n * 4];
    dst.copy_to_host(0, &mut host).unwrap();
    assert!(
        u32s(&host).iter().enumerate().all(|(i, &v)| v == 42 + i as u32),
        "device 1 read device 0's data"
    );

    // Device 1 writes into the pool too (read-write access).
    // SAFETY: `src` holds n u32s, mapped read-write for device 1; s1 is ordered after s0's work above.
    unsafe { k1.add(src.ptr(), n, 1, s1.as_ref()) }.unwrap();
    s1.synchronize().unwrap();
    let mut back = vec![0u8; n * 4];
    // SAFETY: `src` holds n u32s; the write above completed.
    unsafe { memory::copy_to_host(&ctx0, &mut back, src.ptr(), s0.as_ref()) }.unwrap();
    assert!(u32s(&back).iter().enumerate().all(|(i, &v)| v == 43 + i as u32));

    // Read-only peer access: H200s with driver 580 refuse it (CUDA_ERROR_NOT_SUPPORTED); where it is
    // refused, the grant in force must stay as it was.
    match pool.set_access(&d1, Access::Read) {
        Ok(()) => assert_eq!(pool.access(&d1).unwrap(), Access::Read),
        Err(e) => {
            assert_eq!(
                e.driver_error().map(|d| d.name.as_str()),
                Some("CUDA_ERROR_NOT_SUPPORTED"),
                "{e}"
            );
            assert_eq!(pool.access(&d1).unwrap(), Access::ReadWrite);
        }
    }
    pool.revoke_access(&d1).unwrap();
    assert_eq!(pool.access(&d1).unwrap(), Access::None);
    // The owner's access cannot change.
    assert_eq!(
        pool.revoke_access(&d0).unwrap_err(),
        Error::PeerAccess {
            owner: 0,
            peer: 0,
            reason: PeerRefusal::OwningDevice
        }
    );
    drop(dst);
    drop(src);
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
}

#[test]
fn two_gpu_pools_on_each_device_grant_each_other() {
    let (d0, d1) = two_gpus();
    let p0 = MemPool::new(&d0, &PoolProps::new()).unwrap();
    let p1 = MemPool::new(&d1, &PoolProps::new()).unwrap();
    p0.grant_access(&d1).unwrap();
    p1.grant_access(&d0).unwrap();
    assert_eq!(p0.access(&d1).unwrap(), Access::ReadWrite);
    assert_eq!(p1.access(&d0).unwrap(), Access::ReadWrite);
    assert_eq!(p0.access(&d0).unwrap(), Access::ReadWrite);
    p0.revoke_access(&d1).unwrap();
    p1.revoke_access(&d0).unwrap();
    assert_eq!(p0.access(&d1).unwrap(), Access::None);
    assert_eq!(p1.access(&d0).unwrap(), Access::None);
}
