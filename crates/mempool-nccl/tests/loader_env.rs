//! `MEMPOOL_NCCL_LIBRARY` pointing at a path that does not exist: every entry point reports the same
//! cause, and nothing else is searched. One test per binary, since the library is opened once per
//! process and the variable must be set before that.

use mempool_nccl::{disable_nvls, group, library_version, nvls_disabled, Error, UniqueId};

#[test]
fn a_wrong_library_path_is_reported_by_every_entry_point() {
    std::env::set_var("MEMPOOL_NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
    let e = library_version().unwrap_err();
    let Error::LibraryNotFound { tried } = &e else {
        panic!("expected LibraryNotFound, got {e:?}")
    };
    assert_eq!(tried.len(), 1, "only the named path is tried: {tried:?}");
    assert_eq!(tried[0].0, "/nonexistent/libnccl.so.2");
    assert_eq!(UniqueId::new().unwrap_err(), e);
    let mut ran = false;
    let out = group(|_| {
        ran = true;
        Ok(())
    });
    assert_eq!(out, Err(e.clone()));
    assert!(!ran, "the closure does not run without a group");

    // The NVLS guard: unset becomes 0, 0 stays, anything else is refused; the check only reads.
    std::env::remove_var("NCCL_NVLS_ENABLE");
    let e = nvls_disabled().unwrap_err();
    assert!(e.to_string().contains("NCCL_NVLS_ENABLE is unset"), "{e}");
    // SAFETY: the only test of this binary; no NCCL or CUDA library is loaded (the named NCCL path does
    // not exist) and nothing else runs, so no other thread touches the environment.
    unsafe { disable_nvls() }.unwrap();
    assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
    nvls_disabled().unwrap();
    // SAFETY: as above: this thread is the only one.
    unsafe { disable_nvls() }.unwrap();
    std::env::set_var("NCCL_NVLS_ENABLE", "1");
    // SAFETY: as above: this thread is the only one.
    let e = unsafe { disable_nvls() }.unwrap_err();
    assert!(e.to_string().contains("NVLink multicast must stay off"), "{e}");
    let e = nvls_disabled().unwrap_err();
    assert!(e.to_string().contains("\"1\""), "{e}");
}
