//! GPU tests of virtual memory management: they need a GPU and fail without one (never skip).
//! Run: `cargo test -p mempool-core --features gpu --test vmm`.
#![cfg(feature = "gpu")]

use std::os::fd::AsFd;
use std::sync::Arc;

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{
    memory, take_drop_errors, Access, AllocationProps, Device, Error, Granularity, GrowableBuffer, GrowableOptions,
    HandleTypes, Mapping, PhysicalAllocation, Reservation, Stream, WhenFull,
};

fn gpu() -> Device {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let support = dev.vmm_support().expect("device attributes");
    assert!(support.vmm, "device 0 reports no VMM support: {support:?}");
    dev
}

fn min_granularity(dev: Device) -> usize {
    dev.vmm_granularity(&AllocationProps::new(dev), Granularity::Minimum)
        .unwrap()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn assert_no_drop_errors() {
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}

#[test]
fn vmm_support_and_granularity() {
    let dev = gpu();
    let support = dev.vmm_support().unwrap();
    println!("{}: {support:?}", dev.name().unwrap());
    assert!(
        support.posix_fd,
        "a Linux GPU exports VMM memory as file descriptors: {support:?}"
    );
    let props = AllocationProps::new(dev);
    let min = dev.vmm_granularity(&props, Granularity::Minimum).unwrap();
    let rec = dev.vmm_granularity(&props, Granularity::Recommended).unwrap();
    println!("granularity: minimum {min}, recommended {rec}");
    assert!(min > 0 && min.is_power_of_two(), "minimum granularity {min}");
    assert!(
        rec >= min && rec.is_multiple_of(min),
        "recommended {rec} vs minimum {min}"
    );
    let fd = props.handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    assert!(dev.vmm_granularity(&fd, Granularity::Minimum).unwrap() > 0);
}

#[test]
fn vmm_create_map_access_unmap_in_order() {
    let dev = gpu();
    let g = min_granularity(dev);
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let va = Reservation::new(dev, 4 * g, 0, None).unwrap();
    assert!(!va.base().is_null());
    assert_eq!(va.size(), 4 * g);
    assert!(!va.is_mapped(0, g), "a new reservation maps nothing");

    let phys = Arc::new(PhysicalAllocation::new(&AllocationProps::new(dev), 2 * g).unwrap());
    assert_eq!(phys.size(), 2 * g);
    let m = Mapping::new(&va, g, phys.clone()).unwrap();
    assert_eq!(m.addr(), va.base().offset(g));
    assert!(va.is_mapped(g, 2 * g));
    assert!(!va.is_mapped(0, 2 * g));
    assert_eq!(
        m.access(dev).unwrap(),
        Access::ReadWrite,
        "Mapping::new grants the owner read-write"
    );

    let data = pattern(2 * g, 7);
    let view = m.view(stream.as_ref()).unwrap();
    view.copy_from_host(0, &data).unwrap();
    assert_eq!(view.to_host().unwrap(), data, "the mapped bytes read back");

    // The handle behind any mapped address is the one that was mapped.
    // SAFETY: the address lies in `m`, a cuMemMap of the whole of `phys` (ours to share).
    let retained = unsafe { PhysicalAllocation::retain(&ctx, m.addr().offset(g + 100)) }.unwrap();
    assert_eq!(
        retained.as_raw(),
        phys.as_raw(),
        "cuMemRetainAllocationHandle returns the mapped handle"
    );
    println!("retained size reported: {} (mapped {})", retained.size(), phys.size());
    assert_eq!(
        retained.size(),
        phys.size(),
        "the retained allocation's size (cuMemGetAddressRange)"
    );
    assert_eq!(retained.device(), dev);
    drop(retained);

    // Teardown: the mapping holds the allocation and the reservation; dropping our handles first leaves
    // the mapping working.
    drop(phys);
    let va_weak = Arc::downgrade(&va);
    drop(va);
    assert_eq!(view.to_host().unwrap(), data, "the mapping keeps both alive");
    drop(view);
    drop(m); // unmap, then release, then free the reservation
    assert!(
        va_weak.upgrade().is_none(),
        "the reservation went with its last mapping"
    );
    assert_no_drop_errors();
}

#[test]
fn vmm_a_kernel_sees_two_allocations_as_one_range() {
    let dev = gpu();
    let g = min_granularity(dev);
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let k = CheckKernels::load(&ctx).unwrap();
    let va = Reservation::new(dev, 2 * g, 0, None).unwrap();
    let props = AllocationProps::new(dev);
    let a = Mapping::without_access(&va, 0, Arc::new(PhysicalAllocation::new(&props, g).unwrap())).unwrap();
    let b = Mapping::without_access(&va, g, Arc::new(PhysicalAllocation::new(&props, g).unwrap())).unwrap();
    assert_eq!(a.access(dev).unwrap(), Access::None, "a new mapping has no access");
    va.set_access(0, 2 * g, &[(dev, Access::ReadWrite)]).unwrap();
    assert_eq!(b.access(dev).unwrap(), Access::ReadWrite);
    let n = 2 * g / 4;
    // SAFETY: the range holds n u32s, mapped and accessible to `dev`; synchronized below before reading.
    unsafe { k.iota(va.base(), n, 5, stream.as_ref()) }.unwrap();
    let mut host = vec![0u8; 2 * g];
    // SAFETY: the range is mapped; the copy is ordered after the kernel on the same stream and waits.
    unsafe { memory::copy_to_host(&ctx, &mut host, va.base(), stream.as_ref()) }.unwrap();
    let v = u32s(&host);
    let bad = v.iter().enumerate().find(|(i, &x)| x != 5 + *i as u32);
    assert!(bad.is_none(), "first wrong element across the two mappings: {bad:?}");
    drop((a, b));
    assert_no_drop_errors();
}

#[test]
fn vmm_bad_sizes_and_ranges_are_refused() {
    let dev = gpu();
    let g = min_granularity(dev);
    let props = AllocationProps::new(dev);
    assert_eq!(
        PhysicalAllocation::new(&props, g + 1).unwrap_err(),
        Error::NotGranular {
            what: "the physical allocation's size",
            value: g + 1,
            granularity: g
        }
    );
    assert!(matches!(
        PhysicalAllocation::new(&props, 0),
        Err(Error::NotGranular { value: 0, .. })
    ));
    let e = Reservation::new(dev, g / 2, 0, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotGranular {
                what: "the reservation's size",
                ..
            }
        ),
        "{e}"
    );
    let e = Reservation::new(dev, g, 3, None).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");

    let va = Reservation::new(dev, 2 * g, 0, None).unwrap();
    let phys = Arc::new(PhysicalAllocation::new(&props, g).unwrap());
    let e = Mapping::new(&va, g / 2, phys.clone()).unwrap_err();
    assert!(matches!(e, Error::NotGranular { .. }), "{e}");
    let big = Arc::new(PhysicalAllocation::new(&props, 2 * g).unwrap());
    let e = Mapping::new(&va, g, big).unwrap_err();
    assert_eq!(
        e,
        Error::ReservationFull {
            requested: 2 * g,
            offset: g,
            capacity: 2 * g
        }
    );
    let m = Mapping::new(&va, 0, phys.clone()).unwrap();
    let e = Mapping::new(&va, 0, phys.clone()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "overlap: {e}");
    let e = va.set_access(0, 2 * g, &[(dev, Access::ReadWrite)]).unwrap_err();
    assert!(e.to_string().contains("not entirely mapped"), "{e}");
    // An address nothing is mapped at has no allocation to retain.
    let ctx = dev.context().unwrap();
    // SAFETY: nothing is mapped there, so nothing can be retained (the call is expected to fail).
    let e = unsafe { PhysicalAllocation::retain(&ctx, va.base().offset(g)) }.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Driver {
                call: "cuMemRetainAllocationHandle",
                ..
            }
        ),
        "{e}"
    );
    // Not exportable unless created so.
    let e = phys.export_fd().unwrap_err();
    assert_eq!(
        e,
        Error::AllocationNotExportable {
            device: dev.ordinal(),
            requested: HandleTypes::POSIX_FILE_DESCRIPTOR,
            created_with: HandleTypes::empty()
        }
    );
    println!("export refused: {e}");
    drop(m);
    assert_no_drop_errors();
}

#[test]
fn vmm_fd_export_import_round_trip_in_one_process() {
    let dev = gpu();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let props = AllocationProps::new(dev).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let g = dev.vmm_granularity(&props, Granularity::Minimum).unwrap();
    let size = 2 * g;
    let exporter = Arc::new(PhysicalAllocation::new(&props, size).unwrap());
    let va_a = Reservation::new(dev, size, 0, None).unwrap();
    let a = Mapping::new(&va_a, 0, exporter.clone()).unwrap();
    let data = pattern(size, 3);
    a.view(stream.as_ref()).unwrap().copy_from_host(0, &data).unwrap();

    let fd = exporter.export_fd().unwrap();
    let imported = Arc::new(PhysicalAllocation::import_fd(fd.as_fd(), size).unwrap());
    drop(fd); // the importer keeps nothing of the descriptor
    assert_eq!(imported.device(), dev);
    // What the driver reports for an imported handle's requested types varies (on driver 580 it
    // leaves POSIX_FILE_DESCRIPTOR out), so only its size and device are checked.
    println!("imported handle types as reported: {:?}", imported.props().handle_types);
    let va_b = Reservation::new(dev, size, 0, None).unwrap();
    let b = Mapping::new(&va_b, 0, imported).unwrap();
    assert_ne!(a.addr(), b.addr());
    let vb = b.view(stream.as_ref()).unwrap();
    assert_eq!(vb.to_host().unwrap(), data, "the import maps the same memory");
    vb.copy_from_host(0, &[0xab; 64]).unwrap();
    let back = a.view(stream.as_ref()).unwrap().to_host().unwrap();
    assert_eq!(
        &back[..64],
        &[0xab; 64],
        "a write through one mapping shows through the other"
    );
    assert_eq!(&back[64..], &data[64..]);
    drop(vb);
    drop((a, b, exporter));
    assert_no_drop_errors();
}

#[test]
fn vmm_fabric_is_requested_only_where_supported() {
    let dev = gpu();
    let support = dev.vmm_support().unwrap();
    let props = AllocationProps::new(dev).handle_types(HandleTypes::FABRIC);
    println!("fabric support: {}", support.fabric);
    if !support.fabric {
        let e = PhysicalAllocation::new(&props, 2 << 20).unwrap_err();
        assert_eq!(
            e,
            Error::VmmHandleTypeNotSupported {
                device: 0,
                requested: HandleTypes::FABRIC,
                supported: support.handle_types()
            }
        );
        println!("refused as expected: {e}");
        let e = dev.vmm_granularity(&props, Granularity::Minimum).unwrap_err();
        assert!(matches!(e, Error::VmmHandleTypeNotSupported { .. }), "{e}");
        return;
    }
    // The device reports fabric support: the allocation either works (an IMEX channel is open to this
    // process) and exports a fabric handle that imports back, or the driver refuses it by name.
    let g = dev.vmm_granularity(&props, Granularity::Minimum).unwrap();
    match PhysicalAllocation::new(&props, g) {
        Ok(phys) => {
            let handle = phys.export_fabric().unwrap();
            let back = PhysicalAllocation::import_fabric(&handle, g).unwrap();
            assert_eq!(back.device(), dev);
        }
        Err(e) => {
            println!("fabric allocation refused by the driver: {e}");
            assert!(
                matches!(
                    e,
                    Error::Driver {
                        call: "cuMemCreate",
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}

#[test]
fn vmm_rdma_flag_follows_the_attribute() {
    let dev = gpu();
    let support = dev.vmm_support().unwrap();
    let props = AllocationProps::new(dev).gpu_direct_rdma(true);
    let g = min_granularity(dev);
    match PhysicalAllocation::new(&props, g) {
        Ok(p) => assert!(support.gpu_direct_rdma && p.props().gpu_direct_rdma),
        Err(e) => {
            assert!(!support.gpu_direct_rdma, "supported, yet refused: {e}");
            assert!(matches!(e, Error::CapabilityMissing { .. }), "{e}");
        }
    }
}

#[test]
fn vmm_growable_grows_without_moving_and_shrinks() {
    let dev = gpu();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut buf = GrowableBuffer::new(&dev, 64 << 20, GrowableOptions::default()).unwrap();
    let chunk = buf.chunk_size();
    assert_eq!(buf.capacity(), 0, "nothing is mapped before the first resize");
    assert!(buf.max_capacity() >= 64 << 20);
    buf.resize(1 << 20).unwrap();
    let head = pattern(1 << 20, 9);
    buf.view(stream.as_ref()).unwrap().copy_from_host(0, &head).unwrap();
    let addr = buf.ptr();

    buf.resize(40 << 20).unwrap();
    assert_eq!(buf.ptr(), addr, "growing never moves the buffer");
    assert_eq!(buf.capacity(), (40usize << 20).div_ceil(chunk) * chunk);
    let view = buf.view(stream.as_ref()).unwrap();
    let mut got = vec![0u8; 1 << 20];
    view.copy_to_host(0, &mut got).unwrap();
    assert_eq!(got, head, "the first bytes survive growth");
    view.copy_from_host((40 << 20) - 4, &[1, 2, 3, 4]).unwrap();
    drop(view);

    let max = buf.max_capacity();
    let e = buf.resize(max + 1).unwrap_err();
    assert!(matches!(e, Error::ReservationFull { .. }), "{e}");
    assert_eq!(buf.len(), 40 << 20, "a failed resize changes nothing");

    buf.resize(1 << 20).unwrap();
    assert_eq!(
        buf.capacity(),
        (40usize << 20).div_ceil(chunk) * chunk,
        "resize alone keeps the chunks"
    );
    buf.shrink_to_fit().unwrap();
    assert_eq!(
        buf.capacity(),
        chunk.max(1 << 20),
        "shrink_to_fit unmaps the growth past the length"
    );
    buf.view(stream.as_ref()).unwrap().copy_to_host(0, &mut got).unwrap();
    assert_eq!(got, head, "the kept bytes survive the shrink");
    buf.resize(8 << 20).unwrap();
    assert_eq!(buf.ptr(), addr, "growing again maps at the same place");
    drop(buf);
    assert_no_drop_errors();
}

#[test]
fn vmm_growable_remaps_when_the_reservation_is_full() {
    let dev = gpu();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let g = min_granularity(dev);
    let mut buf = GrowableBuffer::new(
        &dev,
        2 * g,
        GrowableOptions {
            chunk: Some(g),
            when_full: WhenFull::Remap,
        },
    )
    .unwrap();
    buf.resize(2 * g).unwrap();
    let data = pattern(2 * g, 1);
    buf.view(stream.as_ref()).unwrap().copy_from_host(0, &data).unwrap();
    let physical: Vec<_> = buf.chunks().map(|(_, p)| p.as_raw()).collect();
    buf.resize(5 * g).unwrap();
    assert!(buf.max_capacity() >= 5 * g);
    assert_eq!(buf.ptr().0 % g as u64, 0, "the new range is granular");
    let moved: Vec<_> = buf.chunks().take(physical.len()).map(|(_, p)| p.as_raw()).collect();
    assert_eq!(moved, physical, "the same physical chunks, remapped, not copies");
    let mut got = vec![0u8; 2 * g];
    buf.view(stream.as_ref()).unwrap().copy_to_host(0, &mut got).unwrap();
    assert_eq!(got, data, "the data survives the remap");
    drop(buf);
    assert_no_drop_errors();
}

#[test]
fn vmm_reservation_alignment_rules() {
    let dev = gpu();
    let g = min_granularity(dev);
    for (alignment, want) in [(0, g), (g, g), (4 * g, 4 * g)] {
        let va = Reservation::new(dev, 4 * g, alignment, None).unwrap();
        println!("alignment {alignment}: base {}", va.base());
        assert_eq!(
            va.base().0 % want as u64,
            0,
            "alignment {alignment} gives a base aligned to {want}"
        );
    }
    for bad in [g / 2, 4096, 3 * g] {
        let e = Reservation::new(dev, 4 * g, bad, None).unwrap_err();
        println!("alignment {bad} refused: {e}");
        assert!(
            matches!(&e, Error::InvalidArgument(t) if t.contains("multiple of the minimum granularity")),
            "{e}"
        );
    }
    assert_no_drop_errors();
}

#[test]
fn vmm_a_view_needs_the_owners_access_and_safe_calls_only_grant() {
    let dev = gpu();
    let g = min_granularity(dev);
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let va = Reservation::new(dev, g, 0, None).unwrap();
    let phys = Arc::new(PhysicalAllocation::new(&AllocationProps::new(dev), g).unwrap());
    let m = Mapping::without_access(&va, 0, phys).unwrap();
    let e = m.view(stream.as_ref()).unwrap_err();
    println!("view without access: {e}");
    assert!(
        matches!(&e, Error::InvalidArgument(t) if t.contains("None access")),
        "{e}"
    );

    m.set_access(&[(dev, Access::ReadWrite)]).unwrap();
    let view = m.view(stream.as_ref()).unwrap();
    view.copy_from_host(0, &[5; 16]).unwrap();
    // The safe calls refuse to revoke (a view may be alive, as here).
    let e = m.set_access(&[(dev, Access::None)]).unwrap_err();
    println!("revocation refused: {e}");
    assert!(
        matches!(&e, Error::InvalidArgument(t) if t.contains("set_access_unchecked")),
        "{e}"
    );
    let e = va.set_access(0, g, &[(dev, Access::Read)]).unwrap_err();
    println!("lowering to read refused: {e}");
    assert!(
        matches!(&e, Error::InvalidArgument(t) if t.contains("set_access_unchecked")),
        "{e}"
    );
    assert_eq!(m.access(dev).unwrap(), Access::ReadWrite, "unchanged by the refusals");
    assert_eq!(view.to_host().unwrap()[..16], [5; 16]);
    drop(view);

    // SAFETY: no view of the mapping is alive and nothing uses it until access is granted again.
    unsafe { m.set_access_unchecked(&[(dev, Access::None)]) }.unwrap();
    assert_eq!(m.access(dev).unwrap(), Access::None);
    assert!(m.view(stream.as_ref()).is_err(), "no view once revoked");
    m.set_access(&[(dev, Access::ReadWrite)]).unwrap();
    assert_eq!(m.view(stream.as_ref()).unwrap().to_host().unwrap()[..16], [5; 16]);
    let e = va.access(dev, g).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)),
        "an offset past the reservation: {e}"
    );
    drop(m);
    assert_no_drop_errors();
}

#[test]
fn vmm_growable_out_of_memory_neither_moves_nor_changes_the_buffer() {
    let dev = gpu();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let g = min_granularity(dev);
    let mut buf = GrowableBuffer::new(
        &dev,
        2 * g,
        GrowableOptions {
            chunk: Some(g),
            when_full: WhenFull::Remap,
        },
    )
    .unwrap();
    buf.resize(g).unwrap();
    let data = pattern(g, 4);
    buf.view(stream.as_ref()).unwrap().copy_from_host(0, &data).unwrap();
    let (addr, max, cap) = (buf.ptr(), buf.max_capacity(), buf.capacity());
    // Twice the device's memory cannot be created; the growth also needs a remap (past 2g).
    let huge = (dev.total_memory().unwrap() * 2).div_ceil(g) * g;
    let e = buf.resize(huge).unwrap_err();
    println!("growth to {huge} bytes: {e}");
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(
        (buf.ptr(), buf.max_capacity(), buf.capacity(), buf.len()),
        (addr, max, cap, g),
        "out of memory leaves the buffer unmoved and unchanged"
    );
    let mut got = vec![0u8; g];
    buf.view(stream.as_ref()).unwrap().copy_to_host(0, &mut got).unwrap();
    assert_eq!(got, data);
    let e = buf.reserve(usize::MAX).unwrap_err();
    assert_eq!(
        e,
        Error::ReservationFull {
            requested: usize::MAX,
            offset: g,
            capacity: max
        },
        "the overflow names the real request"
    );
    drop(buf);
    assert_no_drop_errors();
}
