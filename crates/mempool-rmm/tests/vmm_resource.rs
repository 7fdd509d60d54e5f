//! GPU tests of [`VmmResource`] beyond the conformance suite: allocations shaped as `ncclMemAlloc` makes
//! them (one physical allocation each, granular, exportable), refused frees, and everything returned.
//! `cargo test -p mempool-rmm --features gpu --test vmm_resource`.
#![cfg(feature = "gpu")]

use std::sync::Arc;

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, take_drop_errors, Device, HandleTypes, PhysicalAllocation, Stream};
use mempool_rmm::containers::DeviceBuffer;
use mempool_rmm::suballoc::PoolOptions;
use mempool_rmm::{Error, MemoryResource, PeerAccess, PoolResource, SharedResource, VmmOptions, VmmResource};

const MIB: usize = 1 << 20;

fn device() -> Device {
    Device::get(0).expect("GPU tests need a CUDA device")
}

#[test]
fn vmm_allocations_are_granular_exportable_and_returned() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let support = dev.vmm_support().unwrap();
    println!("{dev}: {support:?}");
    let mr = VmmResource::new(&dev, VmmOptions::default()).unwrap();
    let g = mr.granularity();
    println!("{mr:?}");
    assert!(g > 0 && g.is_power_of_two(), "recommended granularity {g}");
    assert_eq!(mr.device(), dev);

    let sizes = [1, 3 * MIB, g, g + 1, 64 * MIB + 5];
    let mut live = Vec::new();
    for &s in &sizes {
        let p = mr.allocate(s, stream.as_ref()).unwrap();
        assert_eq!(
            p.0 % g as u64,
            0,
            "{s} bytes at {p}: not aligned to the granularity {g}"
        );
        live.push((p, s));
    }
    let expected: usize = sizes.iter().map(|&s| s.div_ceil(g) * g).sum();
    assert_eq!(
        mr.allocated(),
        (expected, sizes.len()),
        "one rounded physical allocation per request"
    );

    // A kernel writes each allocation whole (the rounded-up tail too) and the host reads it back.
    let k = CheckKernels::load(&ctx).unwrap();
    for (i, &(p, s)) in live.iter().enumerate() {
        let bytes = s.div_ceil(g) * g;
        // SAFETY: `p` is a live allocation whose physical backing holds `bytes` bytes, mapped read-write
        // for `dev`; the copy below is ordered after the kernel.
        unsafe { k.iota(p, bytes / 4, 100 * i as u32, stream.as_ref()) }.unwrap();
        let mut host = vec![0u8; bytes];
        // SAFETY: as above.
        unsafe { memory::copy_to_host(&ctx, &mut host, p, stream.as_ref()) }.unwrap();
        let bad = u32s(&host)
            .iter()
            .enumerate()
            .find(|(j, &v)| v != 100 * i as u32 + *j as u32)
            .map(|(j, v)| (j, *v));
        assert!(
            bad.is_none(),
            "allocation {i} ({s} bytes at {p}): first wrong element {bad:?}"
        );
    }

    // The memory behind each address is one whole cuMemCreate allocation, exportable as a descriptor
    // when the device offers it (what NCCL relies on to register and share it).
    for &(p, s) in &live {
        // SAFETY: `p` starts a mapping of one whole physical allocation made by the resource (its
        // documented shape); the test only exports it and drops the handle.
        let phys = unsafe { PhysicalAllocation::retain(&ctx, p) }.unwrap();
        assert_eq!(phys.size(), s.div_ceil(g) * g, "retained size for {s} bytes");
        assert_eq!(phys.device(), dev);
        if support.posix_fd {
            assert!(phys.props().handle_types.contains(HandleTypes::POSIX_FILE_DESCRIPTOR));
            let fd = phys.export_fd().unwrap();
            drop(fd);
        }
    }

    // Refused frees name the cause and leave the allocation alone.
    let (p, s) = live[1];
    // SAFETY: the size is wrong, so the resource refuses before freeing anything.
    let e = unsafe { mr.deallocate(p, s + 1, stream.as_ref()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDeallocation { .. }), "{e}");
    assert!(e.to_string().contains(&format!("has {s} bytes")), "{e}");
    // SAFETY: no allocation starts there, so the resource refuses.
    let e = unsafe { mr.deallocate(p.offset(256), s, stream.as_ref()) }.unwrap_err();
    assert!(e.to_string().contains("no live allocation"), "{e}");
    assert_eq!(mr.allocated().1, sizes.len());

    // A free right after a kernel that uses the memory: the resource waits for the stream first.
    let (p, s) = live.pop().unwrap();
    // SAFETY: `p` holds `s` bytes mapped for `dev`; the free below is ordered after it on this stream.
    unsafe { k.add(p, s / 4, 1, stream.as_ref()) }.unwrap();
    // SAFETY: `p` came from `mr.allocate(s, _)`, is freed once, and its last use is on `stream`.
    unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
    for (p, s) in live {
        // SAFETY: each came from `mr.allocate(s, _)`, freed once here, used only on `stream`.
        unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
    }
    assert_eq!(mr.allocated(), (0, 0));
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "unmaps met errors: {errors:?}");
}

#[test]
fn vmm_options_are_checked_against_the_device() {
    let dev = device();
    let support = dev.vmm_support().unwrap();
    // Fabric handles only where the device reports them.
    let fabric = VmmResource::new(
        &dev,
        VmmOptions {
            handle_types: HandleTypes::FABRIC,
            ..Default::default()
        },
    );
    println!("fabric handles: {support:?} -> {:?}", fabric.as_ref().map(|_| ()));
    match (support.fabric, fabric) {
        (true, r) => assert!(r.is_ok(), "{r:?}"),
        (false, Err(e)) => assert!(
            e.to_string().contains("FABRIC") || e.to_string().contains("Fabric"),
            "{e}"
        ),
        (false, Ok(_)) => panic!("fabric handles accepted on a device that does not report them"),
    }
    let rdma = VmmResource::new(
        &dev,
        VmmOptions {
            gpu_direct_rdma: true,
            ..Default::default()
        },
    );
    match (support.gpu_direct_rdma, rdma) {
        (true, r) => assert!(r.is_ok(), "{r:?}"),
        (false, Err(e)) => assert!(e.to_string().contains("GPU_DIRECT_RDMA"), "{e}"),
        (false, Ok(_)) => panic!("RDMA flag accepted on a device without support"),
    }
    // The owner alone, named or not.
    for peers in [PeerAccess::None, PeerAccess::Devices(vec![dev])] {
        let mr = VmmResource::new(
            &dev,
            VmmOptions {
                peers,
                handle_types: HandleTypes::empty(),
                ..Default::default()
            },
        )
        .unwrap();
        let stream = Stream::new(&dev.context().unwrap()).unwrap();
        let buf = DeviceBuffer::from_host(&[7u8; 4096], &stream, Arc::new(mr) as SharedResource).unwrap();
        assert_eq!(buf.to_host().unwrap(), vec![7u8; 4096]);
    }
    // Out of memory names the size, without asking the driver for more than the device has.
    let mr = VmmResource::new(&dev, VmmOptions::default()).unwrap();
    let huge = dev.total_memory().unwrap() + 1;
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let e = mr.allocate(huge, stream.as_ref()).unwrap_err();
    assert!(e.is_out_of_memory() && e.to_string().contains(&huge.to_string()), "{e}");
}

#[test]
fn vmm_pool_over_vmm_suballocates_and_drops_cleanly() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let vmm = VmmResource::new(&dev, VmmOptions::default()).unwrap();
    let pool = PoolResource::new(vmm, &dev, PoolOptions::default()).unwrap();
    let mr: SharedResource = Arc::new(pool);
    let bufs: Vec<DeviceBuffer> = (0..64u8)
        .map(|i| DeviceBuffer::from_host(&[i; 1000], &stream, mr.clone()).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b.to_host().unwrap(), vec![i as u8; 1000]);
    }
    drop(bufs);
    drop(mr);
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}
