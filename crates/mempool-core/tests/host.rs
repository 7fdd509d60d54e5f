//! Host tests: what mempool-core does on a machine without a GPU (CI has none).
#![cfg(not(feature = "gpu"))]

use mempool_core::{Device, Error, HandleTypes};

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
