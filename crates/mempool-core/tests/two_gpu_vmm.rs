//! Two-GPU test of striping (NVIDIA's VMM post and its discussion): one contiguous virtual range whose
//! chunks live on different devices, every device granted access, a kernel on each GPU reading all of
//! it. Needs two peer-capable GPUs and fails with a clear message otherwise.
//! Run: `cargo test -p mempool-core --features gpu --test two_gpu_vmm`.
#![cfg(feature = "gpu")]

use std::sync::Arc;

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{
    memory, take_drop_errors, Access, AllocationProps, Device, Granularity, Mapping, PhysicalAllocation, Reservation,
    Stream,
};

fn two_gpus() -> (Device, Device) {
    let count = Device::count().expect("CUDA driver");
    assert!(
        count >= 2,
        "two-GPU tests need at least two GPUs; this machine has {count}: run them on a two-GPU machine"
    );
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    assert!(
        d1.can_access_peer(d0).unwrap() && d0.can_access_peer(d1).unwrap(),
        "devices 0 and 1 cannot access each other's memory (cuDeviceCanAccessPeer): striping needs peers"
    );
    (d0, d1)
}

#[test]
fn two_gpu_striped_range_is_read_whole_by_a_kernel_on_each_gpu() {
    let (d0, d1) = two_gpus();
    let devices = [d0, d1];
    // One stripe size that is a multiple of both devices' granularity.
    let g = devices
        .iter()
        .map(|d| {
            d.vmm_granularity(&AllocationProps::new(*d), Granularity::Minimum)
                .unwrap()
        })
        .max()
        .unwrap();
    let stripes = 6;
    let size = stripes * g;
    let va = Reservation::new(d0, size, 0, None).unwrap();
    let mappings: Vec<Mapping> = (0..stripes)
        .map(|i| {
            let owner = devices[i % 2];
            let phys = Arc::new(PhysicalAllocation::new(&AllocationProps::new(owner), g).unwrap());
            Mapping::without_access(&va, i * g, phys).unwrap()
        })
        .collect();
    for (i, m) in mappings.iter().enumerate() {
        assert_eq!(
            m.physical().device(),
            devices[i % 2],
            "stripe {i} lives on device {}",
            i % 2
        );
    }
    // One access call over the whole striped range, for both devices.
    va.set_access(0, size, &[(d0, Access::ReadWrite), (d1, Access::ReadWrite)])
        .unwrap();
    for (i, m) in mappings.iter().enumerate() {
        for d in devices {
            assert_eq!(m.access(d).unwrap(), Access::ReadWrite, "stripe {i}, {d}");
        }
    }

    let n = size / 4;
    let (ctx0, ctx1) = (d0.context().unwrap(), d1.context().unwrap());
    let (s0, s1) = (Stream::new(&ctx0).unwrap(), Stream::new(&ctx1).unwrap());
    let (k0, k1) = (CheckKernels::load(&ctx0).unwrap(), CheckKernels::load(&ctx1).unwrap());
    // Device 0 writes the whole range (half of it on device 1).
    // SAFETY: the range holds n u32s, mapped read-write for device 0; synchronized before anyone reads.
    unsafe { k0.iota(va.base(), n, 1000, s0.as_ref()) }.unwrap();
    s0.synchronize().unwrap();

    // A kernel on each GPU reads the whole range into that GPU's own memory.
    for (d, ctx, stream, k) in [(d0, &ctx0, &s0, &k0), (d1, &ctx1, &s1, &k1)] {
        let local = d.default_pool().unwrap().alloc(size, stream.as_ref()).unwrap();
        // SAFETY: both ranges hold n u32s; the striped range is mapped for `d` and its writer finished.
        unsafe { k.copy(local.ptr(), va.base(), n, stream.as_ref()) }.unwrap();
        let mut host = vec![0u8; size];
        local.copy_to_host(0, &mut host).unwrap();
        let v = u32s(&host);
        let bad = v.iter().enumerate().find(|(i, &x)| x != 1000 + *i as u32);
        assert!(
            bad.is_none(),
            "{d} read the striped range wrong; first bad element (index, value): {bad:?}"
        );
        let _ = ctx;
    }

    // Device 1 writes too, and device 0 sees it.
    // SAFETY: mapped read-write for device 1; device 0's work is done (synchronized above).
    unsafe { k1.add(va.base(), n, 1, s1.as_ref()) }.unwrap();
    s1.synchronize().unwrap();
    let mut host = vec![0u8; size];
    // SAFETY: the range is mapped for device 0 and device 1's write finished.
    unsafe { memory::copy_to_host(&ctx0, &mut host, va.base(), s0.as_ref()) }.unwrap();
    assert!(u32s(&host).iter().enumerate().all(|(i, &x)| x == 1001 + i as u32));

    drop(mappings);
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}
