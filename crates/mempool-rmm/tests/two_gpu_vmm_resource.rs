//! Two-GPU tests of [`VmmResource`]'s peer access: what `ncclMemAlloc` grants (every device that can
//! access the owner), a named peer, and the owner alone. Needs two peer-capable GPUs and fails with a
//! clear message otherwise. `cargo test -p mempool-rmm --features gpu --test two_gpu_vmm_resource`.
#![cfg(feature = "gpu")]

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, take_drop_errors, Device, Stream};
use mempool_rmm::{MemoryResource, PeerAccess, VmmOptions, VmmResource};

fn two_gpus() -> (Device, Device) {
    let count = Device::count().expect("CUDA driver");
    assert!(
        count >= 2,
        "two-GPU tests need at least two GPUs; this machine has {count}: run them on a two-GPU machine"
    );
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    assert!(
        d1.can_access_peer(d0).unwrap() && d0.can_access_peer(d1).unwrap(),
        "devices 0 and 1 cannot access each other's memory (cuDeviceCanAccessPeer): the test needs peers"
    );
    (d0, d1)
}

/// Device 0's memory from `mr`, written by device 0, then read and incremented by a kernel on device 1.
fn peer_reads_and_writes(mr: &VmmResource, d0: Device, d1: Device) {
    let (ctx0, ctx1) = (d0.context().unwrap(), d1.context().unwrap());
    let (s0, s1) = (Stream::new(&ctx0).unwrap(), Stream::new(&ctx1).unwrap());
    let (k0, k1) = (CheckKernels::load(&ctx0).unwrap(), CheckKernels::load(&ctx1).unwrap());
    let bytes = 8 << 20;
    let n = bytes / 4;
    let p = mr.allocate(bytes, s0.as_ref()).unwrap();
    // SAFETY: `p` holds `bytes` bytes mapped read-write for d0; synchronized before d1 uses it.
    unsafe { k0.iota(p, n, 5, s0.as_ref()) }.unwrap();
    s0.synchronize().unwrap();
    // SAFETY: mapped read-write for d1 (granted by the resource); d0's writer finished.
    unsafe { k1.add(p, n, 1, s1.as_ref()) }.unwrap();
    s1.synchronize().unwrap();
    let mut host = vec![0u8; bytes];
    // SAFETY: `p` is mapped for d0 and d1's kernel finished.
    unsafe { memory::copy_to_host(&ctx0, &mut host, p, s0.as_ref()) }.unwrap();
    let bad = u32s(&host)
        .iter()
        .enumerate()
        .find(|(i, &v)| v != 6 + *i as u32)
        .map(|(i, v)| (i, *v));
    assert!(
        bad.is_none(),
        "{mr:?}: first wrong element after d1's increment: {bad:?}"
    );
    // SAFETY: `p` came from `mr.allocate(bytes, _)`, freed once; its last use (d1's kernel) finished.
    unsafe { mr.deallocate(p, bytes, s1.as_ref()) }.unwrap();
}

#[test]
fn two_gpu_vmm_resource_grants_every_capable_peer() {
    let (d0, d1) = two_gpus();
    let mr = VmmResource::new(&d0, VmmOptions::default()).unwrap();
    peer_reads_and_writes(&mr, d0, d1);
    let named = VmmResource::new(
        &d0,
        VmmOptions {
            peers: PeerAccess::Devices(vec![d1]),
            ..Default::default()
        },
    )
    .unwrap();
    peer_reads_and_writes(&named, d0, d1);
    // Memory of device 1 granted to device 0, too.
    let back = VmmResource::new(&d1, VmmOptions::default()).unwrap();
    peer_reads_and_writes(&back, d1, d0);
    drop((mr, named, back));
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}
