//! Host tests: what mempool-core does on a machine without a GPU (CI has none).
#![cfg(not(feature = "gpu"))]

use std::collections::HashSet;

use mempool_core::{Device, Error, HandleTypes, RawStream, StreamRef};

/// Every entry point answers the same on every machine: without a driver `DriverNotFound` (never a
/// panic); with a driver whose `cuInit` fails, that same error everywhere (`NoDevice` when it sees no
/// GPU, or a failure that names `cuInit`); with a working driver, devices that can be listed and a
/// made-up address refused by name.
#[test]
fn every_entry_point_says_whether_the_driver_works() {
    let present = mempool_core::driver_present();
    let version = mempool_core::driver_version();
    let others = || {
        [
            Device::count().map(drop),
            Device::get(0).map(drop),
            Device::all().map(drop),
            mempool_core::memory::pointer_info(mempool_core::DeviceAddr(0x1000)).map(drop),
        ]
    };
    match version {
        Err(e) if !present => {
            assert_eq!(e, Error::DriverNotFound);
            assert!(e.to_string().contains("no CUDA driver found"), "{e}");
            for r in others() {
                assert_eq!(r, Err(Error::DriverNotFound));
            }
        }
        Ok(v) if !present => panic!("the driver reported version {v} though its library does not load"),
        Err(e) => {
            assert!(
                e == Error::NoDevice || e.to_string().contains("cuInit"),
                "a loadable driver whose cuInit fails reports NoDevice or names cuInit: {e}"
            );
            for r in others() {
                assert_eq!(r, Err(e.clone()), "every entry point reports cuInit's failure");
            }
        }
        Ok(v) => {
            assert!(v.major() >= 11, "{v}");
            let n = Device::count().unwrap();
            assert!(n >= 1, "cuInit succeeded with no device");
            assert_eq!(Device::all().unwrap().len(), n);
            assert_eq!(Device::get(0).unwrap().ordinal(), 0);
            assert_eq!(
                Device::get(n).unwrap_err(),
                Error::NoSuchDevice { ordinal: n, count: n }
            );
            let e = mempool_core::memory::pointer_info(mempool_core::DeviceAddr(0x1000)).unwrap_err();
            assert!(e.to_string().contains("cuPointerGetAttribute"), "{e}");
        }
    }
    // Pool creation needs a device, so it may not be reachable here; the error type still prints the cause.
    let e = Error::PoolsNotSupported { device: 3 };
    assert_eq!(e.to_string(), "device 3 does not support stream-ordered memory pools");
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

/// Stream views compare and hash by their raw handle (the legacy stream's two handles as one); only views of owned streams (or ones given a
/// context) know a context, which needs a GPU to make, so here every view knows none.
#[test]
fn stream_refs_compare_by_handle() {
    // SAFETY: the made-up handles are never passed to the driver.
    let (a, b) = unsafe {
        (
            StreamRef::from_raw(0x10 as RawStream),
            StreamRef::from_raw(0x10 as RawStream),
        )
    };
    // SAFETY: as above.
    let c = unsafe { StreamRef::from_raw(0x20 as RawStream) };
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!((a.handle(), c.handle()), (0x10, 0x20));
    let set: HashSet<StreamRef<'_>> = [a, b, c, StreamRef::LEGACY, StreamRef::PER_THREAD].into();
    assert_eq!(set.len(), 4);
    for s in [a, c, StreamRef::LEGACY, StreamRef::PER_THREAD] {
        assert!(s.context().is_none());
    }
    // SAFETY: 0 is the legacy default stream's handle.
    assert_eq!(unsafe { StreamRef::from_raw(std::ptr::null_mut()) }, StreamRef::LEGACY);
    // SAFETY: 1 is `CU_STREAM_LEGACY`, the same stream (the driver calls mempool makes read 0 as it).
    assert_eq!(unsafe { StreamRef::from_raw(1 as RawStream) }, StreamRef::LEGACY);
    assert_eq!(format!("{a:?}"), "StreamRef { raw: 16 }");
}
