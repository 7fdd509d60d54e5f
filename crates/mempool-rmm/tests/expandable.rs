//! GPU tests of [`ExpandableResource`] beyond the conformance suite: one segment that coalesces, chunks
//! mapped where allocations land, trimming. `cargo test -p mempool-rmm --features gpu --test expandable`.
#![cfg(feature = "gpu")]

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, take_drop_errors, Device, DeviceAddr, Stream};
use mempool_rmm::{ExpandableOptions, ExpandableResource, MemoryResource, Reclaim};

const MIB: usize = 1 << 20;

fn device() -> Device {
    Device::get(0).expect("GPU tests need a CUDA device")
}

fn check_kernel_round_trip(dev: Device, p: DeviceAddr, bytes: usize, base: u32) {
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let k = CheckKernels::load(&ctx).unwrap();
    let n = bytes / 4;
    // SAFETY: `p` is a live allocation of `bytes` bytes of the resource; the copy below waits.
    unsafe { k.iota(p, n, base, stream.as_ref()) }.unwrap();
    let mut host = vec![0u8; bytes];
    // SAFETY: as above; ordered after the kernel on the same stream.
    unsafe { memory::copy_to_host(&ctx, &mut host, p, stream.as_ref()) }.unwrap();
    let bad = u32s(&host)
        .iter()
        .enumerate()
        .find(|(i, &v)| v != base + *i as u32)
        .map(|(i, v)| (i, *v));
    assert!(bad.is_none(), "first wrong element at {p}: {bad:?}");
}

#[test]
fn expandable_one_segment_coalesces_maps_on_demand_and_trims() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mr = ExpandableResource::new(
        &dev,
        ExpandableOptions {
            reservation: Some(1 << 30),
            chunk_size: Some(2 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let stats = mr.stats();
    println!("{stats:?}");
    assert_eq!(stats.mapped_bytes, 0, "nothing is mapped before the first allocation");
    assert_eq!(stats.reservation_bytes, 1 << 30);

    let s = stream.as_ref();
    let a = mr.allocate(8 * MIB, s).unwrap();
    let b = mr.allocate(8 * MIB, s).unwrap();
    let c = mr.allocate(8 * MIB, s).unwrap();
    let base = mr.base().0;
    for p in [a, b, c] {
        assert!(
            p.0 >= base && p.0 + (8 * MIB) as u64 <= base + (1 << 30),
            "{p} outside the range"
        );
        check_kernel_round_trip(dev, p, 8 * MIB, 3);
    }
    let mapped = mr.stats().mapped_bytes;
    assert_eq!(
        mapped,
        24 * MIB as u64,
        "three 8 MiB blocks map twelve 2 MiB chunks: {:?}",
        mr.stats()
    );

    // SAFETY: a and b came from `mr` with these sizes, are freed once, and their kernels ran on `stream`.
    unsafe {
        mr.deallocate(a, 8 * MIB, s).unwrap();
        mr.deallocate(b, 8 * MIB, s).unwrap();
    }
    // One segment: the two freed neighbours coalesce, and a block as large as both fits where they were.
    let d = mr.allocate(16 * MIB, s).unwrap();
    assert_eq!(
        d,
        a.min(b),
        "the coalesced hole serves the 16 MiB request: {:?}",
        mr.stats()
    );
    assert_eq!(mr.stats().mapped_bytes, mapped, "nothing new was mapped");
    check_kernel_round_trip(dev, d, 16 * MIB, 11);

    // SAFETY: c came from `mr`; freed once; its kernels ran on `stream`.
    unsafe { mr.deallocate(c, 8 * MIB, s) }.unwrap();
    let released = mr.trim().unwrap();
    assert_eq!(released, 8 * MIB as u64, "c's four chunks were free: {:?}", mr.stats());
    assert_eq!(mr.stats().mapped_bytes, 16 * MIB as u64);
    check_kernel_round_trip(dev, d, 16 * MIB, 12);

    // SAFETY: d came from `mr`; freed once.
    unsafe { mr.deallocate(d, 16 * MIB, s) }.unwrap();
    assert_eq!(mr.trim().unwrap(), 16 * MIB as u64);
    let stats = mr.stats();
    assert_eq!((stats.mapped_bytes, stats.used_bytes), (0, 0), "{stats:?}");
    assert_eq!(stats.peak_mapped_bytes, 24 * MIB as u64);

    // Unmapped addresses are mapped again when an allocation lands there.
    let e = mr.allocate(30 * MIB, s).unwrap();
    check_kernel_round_trip(dev, e, 30 * MIB, 5);
    // SAFETY: e came from `mr`; freed once.
    unsafe { mr.deallocate(e, 30 * MIB, s) }.unwrap();
    drop(mr);
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}

#[test]
fn expandable_refuses_bad_chunks_and_oversized_requests_by_name() {
    let dev = device();
    let e = ExpandableResource::new(
        &dev,
        ExpandableOptions {
            chunk_size: Some(MIB + 1),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("the chunk size is 1048577 bytes"), "{e}");
    let mr = ExpandableResource::new(
        &dev,
        ExpandableOptions {
            reservation: Some(64 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let e = mr.allocate(128 * MIB, stream.as_ref()).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains(&(128 * MIB).to_string()), "{e}");
}

#[test]
fn expandable_reclaim_before_growth_unmaps_idle_chunks_first() {
    let dev = device();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let s = stream.as_ref();
    let make = |reclaim| {
        ExpandableResource::new(
            &dev,
            ExpandableOptions {
                reservation: Some(1 << 30),
                chunk_size: Some(2 * MIB),
                reclaim,
            },
        )
        .unwrap()
    };
    for (reclaim, peak) in [(Reclaim::OnOutOfMemory, 32 * MIB), (Reclaim::BeforeGrowth, 24 * MIB)] {
        let mr = make(reclaim);
        let a = mr.allocate(8 * MIB, s).unwrap();
        let b = mr.allocate(8 * MIB, s).unwrap();
        // SAFETY: `a` came from `mr` with this size and is freed once; nothing used it.
        unsafe { mr.deallocate(a, 8 * MIB, s) }.unwrap();
        // 16 MiB does not fit in a's 8 MiB hole: the range grows at its end.
        let c = mr.allocate(16 * MIB, s).unwrap();
        check_kernel_round_trip(dev, c, 16 * MIB, 2);
        check_kernel_round_trip(dev, b, 8 * MIB, 4);
        let stats = mr.stats();
        assert_eq!(stats.peak_mapped_bytes, peak as u64, "{reclaim:?}: {stats:?}");
        // SAFETY: b and c came from `mr` with these sizes; freed once; their kernels finished.
        unsafe {
            mr.deallocate(b, 8 * MIB, s).unwrap();
            mr.deallocate(c, 16 * MIB, s).unwrap();
        }
    }
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}
