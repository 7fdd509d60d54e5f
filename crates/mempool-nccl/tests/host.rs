//! Host tests of loading NCCL and of the checks made before NCCL is called; no GPU, no NCCL needed.

use mempool_nccl::{probe_library, Comm, Error, UniqueId};

#[test]
fn a_missing_library_names_what_was_tried_and_the_fix() {
    let name = "/nonexistent/dir/libnccl.so.2";
    let e = probe_library(name).unwrap_err();
    let Error::LibraryNotFound { tried } = &e else {
        panic!("expected LibraryNotFound, got {e:?}")
    };
    assert_eq!(tried.len(), 1);
    assert_eq!(tried[0].0, name);
    let text = e.to_string();
    for needle in [
        name,
        "nvidia-nccl-cu13",
        "site-packages/nvidia/nccl/lib",
        "MEMPOOL_NCCL_LIBRARY",
    ] {
        assert!(text.contains(needle), "the error should mention {needle}: {text}");
    }
}

#[test]
fn a_library_that_is_not_nccl_is_refused_by_name() {
    // Any shared library without ncclGetVersion: the C library is on every Linux machine.
    let e = probe_library("libc.so.6").unwrap_err();
    assert_eq!(
        e,
        Error::NotNccl {
            path: "libc.so.6".into(),
            symbol: "ncclGetVersion"
        }
    );
    assert!(e.to_string().contains("is not an NCCL library"), "{e}");
}

#[test]
fn the_environment_variable_is_named_at_the_root() {
    assert_eq!(mempool_nccl::LIBRARY_ENV, "MEMPOOL_NCCL_LIBRARY");
    assert_eq!(mempool_nccl::UNIQUE_ID_BYTES, 128);
}

#[test]
fn arguments_are_checked_before_nccl_is_loaded() {
    let e = Comm::init_all(&[]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                call: "ncclCommInitAll",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("no devices"), "{e}");
    let id = UniqueId::from_bytes([0; 128]);
    // A device value needs a driver; the rank check comes first, so any device would do: take one if
    // there is a driver, else the check cannot be reached and the driver's absence is what is seen.
    if let Ok(dev) = mempool_core::Device::get(0) {
        let e = Comm::init_rank(dev, &id, 2, 2).unwrap_err();
        assert!(e.to_string().contains("rank 2 of 2"), "{e}");
        let e = Comm::init_rank(dev, &id, 0, 0).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
}
