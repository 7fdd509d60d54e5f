//! A revoked peer really loses access: its kernel faults. This poisons device 1's context for the rest
//! of the process, so the test has a binary of its own. Needs two peer-capable GPUs.
#![cfg(feature = "gpu")]

use mempool_core::kernels::CheckKernels;
use mempool_core::{Device, MemPool, PoolProps, Stream};

#[test]
fn two_gpu_revoked_peer_faults_on_access() {
    let count = Device::count().expect("CUDA driver");
    assert!(
        count >= 2,
        "two-GPU tests need at least two GPUs; this machine has {count}"
    );
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    assert!(
        d1.can_access_peer(d0).unwrap(),
        "device 1 cannot access device 0's memory"
    );
    let (ctx0, ctx1) = (d0.context().unwrap(), d1.context().unwrap());
    let (s0, s1) = (Stream::new(&ctx0).unwrap(), Stream::new(&ctx1).unwrap());
    let k1 = CheckKernels::load(&ctx1).unwrap();
    let pool = MemPool::new(&d0, &PoolProps::new()).unwrap();
    let n = 1 << 16;
    let src = pool.alloc(n * 4, s0.as_ref()).unwrap();
    src.fill(7).unwrap();
    s0.synchronize().unwrap();
    let dst = mempool_core::memory::device_alloc(&ctx1, n * 4).unwrap();

    pool.grant_access(&d1).unwrap();
    // SAFETY: both ranges hold n u32s; access is granted.
    unsafe { k1.copy(dst, src.ptr(), n, s1.as_ref()) }.unwrap();
    s1.synchronize().expect("a granted peer reads the pool");

    pool.revoke_access(&d1).unwrap();
    // SAFETY: the launch is sound for the host; on the device the read is expected to fault, which is
    // what this test observes.
    let launched = unsafe { k1.copy(dst, src.ptr(), n, s1.as_ref()) };
    let result = launched.and_then(|()| s1.synchronize());
    let err = result.expect_err("device 1 read device 0's pool after its access was revoked");
    eprintln!("revoked access faulted as expected: {err}");
    // The fault is sticky and, as seen on two H200s (driver 580), poisons device 0's context as well as
    // device 1's: leak everything rather than free through broken contexts.
    std::mem::forget((k1, src, pool));
    std::mem::forget((s1, s0));
}
