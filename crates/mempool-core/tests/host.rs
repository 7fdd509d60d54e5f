//! Host tests: what mempool-core does on a machine without a GPU (CI has none).
#![cfg(not(feature = "gpu"))]

use std::collections::HashSet;

use mempool_core::{sys, Device, Error, HandleTypes, StreamRef};

/// Without a driver, every entry point returns `DriverNotFound` (never a panic). On a machine that does
/// have a driver the same calls must still not panic, and their errors must not claim a missing driver.
#[test]
fn without_a_driver_every_entry_point_says_so() {
    let present = mempool_core::driver_present();
    let results = [
        mempool_core::driver_version().map(|_| ()),
        Device::count().map(|_| ()),
        Device::get(0).map(|_| ()),
        Device::all().map(|_| ()),
        mempool_core::memory::pointer_info(mempool_core::DeviceAddr(0x1000)).map(|_| ()),
    ];
    for r in results {
        match (present, r) {
            (false, Err(e)) => {
                assert_eq!(e, Error::DriverNotFound);
                assert!(e.to_string().contains("no CUDA driver found"), "{e}");
            }
            (false, Ok(())) => panic!("an entry point succeeded without a driver"),
            (true, Err(e)) => assert_ne!(e, Error::DriverNotFound, "a loadable driver reported as missing"),
            (true, Ok(())) => {}
        }
    }
    if !present {
        // Pool creation needs a device, so it cannot be reached; the error type still prints the cause.
        let e = Error::PoolsNotSupported { device: 3 };
        assert_eq!(e.to_string(), "device 3 does not support stream-ordered memory pools");
    }
}

#[test]
fn errors_name_their_cause() {
    let e = Error::HandleTypeNotSupported {
        device: 1,
        requested: HandleTypes::POSIX_FILE_DESCRIPTOR,
        supported: HandleTypes::empty(),
    };
    let text = e.to_string();
    assert!(
        text.contains("device 1") && text.contains("POSIX_FILE_DESCRIPTOR"),
        "{text}"
    );
    let e = Error::NoSuchDevice { ordinal: 4, count: 2 };
    assert_eq!(e.to_string(), "CUDA device 4 does not exist: 2 device(s) are visible");
    let e = Error::PeerAccess {
        owner: 0,
        peer: 1,
        reason: mempool_core::PeerRefusal::NoPeerCapability,
    };
    assert!(
        e.to_string().contains("device 1 cannot access memory of device 0"),
        "{e}"
    );
}

/// Stream views compare and hash by their raw handle; only views of owned streams (or ones given a
/// context) know a context, which needs a GPU to make, so here every view knows none.
#[test]
fn stream_refs_compare_by_handle() {
    // SAFETY: the made-up handles are never passed to the driver.
    let (a, b) = unsafe {
        (
            StreamRef::from_raw(0x10 as sys::CUstream),
            StreamRef::from_raw(0x10 as sys::CUstream),
        )
    };
    // SAFETY: as above.
    let c = unsafe { StreamRef::from_raw(0x20 as sys::CUstream) };
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!((a.id(), c.id()), (0x10, 0x20));
    let set: HashSet<StreamRef<'_>> = [a, b, c, StreamRef::LEGACY, StreamRef::PER_THREAD].into();
    assert_eq!(set.len(), 4);
    for s in [a, c, StreamRef::LEGACY, StreamRef::PER_THREAD] {
        assert!(s.context().is_none());
    }
    // SAFETY: 0 is the legacy default stream's handle.
    assert_eq!(unsafe { StreamRef::from_raw(std::ptr::null_mut()) }, StreamRef::LEGACY);
    assert_eq!(format!("{a:?}"), "StreamRef { raw: 16 }");
}
