//! The FFI layer: every call into `libcuda` goes through this module and its children, one per CUDA area.
//!
//! cudarc's `sys` bindings (dynamic loading) resolve each entry point the first time it is called and
//! *panic* if the installed driver lacks it. We never let that happen: [`call!`] first asks the loaded
//! library whether the symbol exists (cached per call site) and turns a missing one into a
//! [`DriverFailure`] of kind [`FailureKind::SymbolMissing`]; and nothing reaches the library before
//! [`init`] has checked that it loads at all ([`FailureKind::LibraryMissing`]).
//!
//! Functions here are thin: they translate arguments, check the `CUresult`, and return Rust values or a
//! [`DriverFailure`] naming the call. This layer knows nothing of the crate's public `Error` (which
//! converts a `DriverFailure` with `From`, so `?` works in the safe modules); it builds only on the plain
//! types of `crate::types`. The safe types elsewhere in the crate hold the invariants (RAII, context
//! binding) that make these calls sound.

#![allow(unsafe_code)]

pub(crate) mod context;
pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod gate;
pub(crate) mod memory;
pub(crate) mod module;
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod vmm;

use std::ffi::CStr;
use std::sync::OnceLock;

pub(crate) use cudarc::driver::sys;

use crate::types::{DriverError, DriverVersion};

/// What the raw layer's calls return: a value, or the failure of the driver call that was to make it.
pub(crate) type Result<T> = std::result::Result<T, DriverFailure>;

/// A failed driver call: which entry point, and how it failed. The public `Error` converts it (`From`),
/// keeping the call's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DriverFailure {
    /// The driver entry point (for an allocation, the name the error reports, e.g. `cuMemAlloc`).
    pub(crate) call: &'static str,
    /// How it failed.
    pub(crate) kind: FailureKind,
}

/// How a driver call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// `libcuda.so` could not be loaded, so the call was never made.
    LibraryMissing,
    /// The loaded driver does not export the call: it is older than the CUDA release that added it.
    SymbolMissing {
        /// The installed driver's version (0 if it could not be read).
        driver: DriverVersion,
        /// The first CUDA version whose driver has the call, where known.
        required: Option<DriverVersion>,
    },
    /// `cuInit` reported `CUDA_ERROR_NO_DEVICE`: the driver sees no GPU.
    NoDevice,
    /// An allocating call ran out of memory (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory {
        /// The number of bytes asked for.
        requested: usize,
    },
    /// The call returned a `CUresult` other than `CUDA_SUCCESS`.
    Driver(DriverError),
}

impl DriverFailure {
    /// The `CUresult` value, for a failure the driver returned.
    pub(crate) fn code(&self) -> Option<u32> {
        match &self.kind {
            FailureKind::Driver(e) => Some(e.code),
            _ => None,
        }
    }
}

/// Calls a driver entry point through cudarc's `sys` bindings after checking that the installed driver
/// has it, and converts the `CUresult` into a [`Result`] whose failure names the call.
///
/// The expansion calls an `unsafe fn`, so every use sits in an `unsafe` block with its own `SAFETY:` line.
/// [`init`] must have succeeded first (all safe entry points reach here through a `Device`, which only
/// exists after `init`).
macro_rules! call {
    ($name:ident ( $($arg:expr),* $(,)? )) => {{
        static PRESENT: ::std::sync::OnceLock<bool> = ::std::sync::OnceLock::new();
        match $crate::raw::ensure(stringify!($name), &PRESENT) {
            Ok(()) => $crate::raw::check(stringify!($name), $crate::raw::sys::$name($($arg),*)),
            Err(e) => Err(e),
        }
    }};
}
pub(crate) use call;

/// Whether `libcuda` can be loaded. Cheap after the first call.
pub(crate) fn library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on a fixed list of names and drops what it opened;
    // it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Loads and initialises the driver once (`cuInit(0)`), returning its version. Every safe entry point
/// that does not already hold a [`crate::Device`] calls this first.
///
/// Fails with [`FailureKind::LibraryMissing`] when `libcuda.so` cannot be loaded and with
/// [`FailureKind::NoDevice`] when the driver sees no GPU.
pub(crate) fn init() -> Result<DriverVersion> {
    static INIT: OnceLock<Result<DriverVersion>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !library_present() {
            return Err(DriverFailure {
                call: "cuInit",
                kind: FailureKind::LibraryMissing,
            });
        }
        let mut version = 0;
        // SAFETY: the library loads (checked above); `cuDriverGetVersion` writes one int and is legal
        // before `cuInit`.
        unsafe { call!(cuDriverGetVersion(&mut version)) }?;
        DRIVER_VERSION.get_or_init(|| DriverVersion(version));
        // SAFETY: the library loads; `cuInit` takes flags that must be 0.
        match unsafe { call!(cuInit(0)) } {
            Ok(()) => Ok(DriverVersion(version)),
            Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_NO_DEVICE as u32) => Err(DriverFailure {
                call: e.call,
                kind: FailureKind::NoDevice,
            }),
            Err(e) => Err(e),
        }
    })
    .clone()
}

static DRIVER_VERSION: OnceLock<DriverVersion> = OnceLock::new();

/// The installed driver's version, once the library has been loaded.
pub(crate) fn driver_version() -> Option<DriverVersion> {
    DRIVER_VERSION.get().copied()
}

/// Checks (once per call site, cached in `present`) that the loaded driver exports `name`.
pub(crate) fn ensure(name: &'static str, present: &OnceLock<bool>) -> Result<()> {
    let ok = *present.get_or_init(|| {
        if !library_present() {
            return false;
        }
        // SAFETY: the library loads (checked above), so `culib` returns it rather than panicking; we
        // only look the symbol up and never call it through this pointer.
        unsafe { sys::culib().get::<*const std::ffi::c_void>(name.as_bytes()).is_ok() }
    });
    if ok {
        Ok(())
    } else if !library_present() {
        Err(DriverFailure {
            call: name,
            kind: FailureKind::LibraryMissing,
        })
    } else {
        Err(DriverFailure {
            call: name,
            kind: FailureKind::SymbolMissing {
                driver: driver_version().unwrap_or(DriverVersion(0)),
                required: first_driver_with(name),
            },
        })
    }
}

/// The first CUDA release whose driver exports the calls this crate may use that are newer than 11.2
/// (the release that introduced memory pools). Unknown names get `None`.
pub(crate) fn first_driver_with(name: &str) -> Option<DriverVersion> {
    let v = match name {
        "cuMemGetDefaultMemPool" | "cuMemGetMemPool" | "cuMemSetMemPool" | "cuEventElapsedTime_v2" => 13000,
        "cuMemPrefetchAsync_v2" | "cuMemAdvise_v2" => 12020,
        "cuStreamGetId" => 12000,
        "cuDeviceGetUuid_v2" => 11040,
        "cuMemCreate"
        | "cuMemRelease"
        | "cuMemAddressReserve"
        | "cuMemAddressFree"
        | "cuMemMap"
        | "cuMemUnmap"
        | "cuMemSetAccess"
        | "cuMemGetAccess"
        | "cuMemGetAllocationGranularity"
        | "cuMemGetAllocationPropertiesFromHandle"
        | "cuMemRetainAllocationHandle"
        | "cuMemExportToShareableHandle"
        | "cuMemImportFromShareableHandle" => 10020,
        n if n.starts_with("cuMemPool")
            || n == "cuMemAllocFromPoolAsync"
            || n == "cuMemFreeAsync"
            || n == "cuDeviceGetMemPool"
            || n == "cuDeviceSetMemPool"
            || n == "cuDeviceGetDefaultMemPool" =>
        {
            11020
        }
        _ => return None,
    };
    Some(DriverVersion(v))
}

/// Converts a `CUresult` into a `Result`, naming the call on failure.
pub(crate) fn check(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverFailure {
            call,
            kind: FailureKind::Driver(driver_error(result)),
        })
    }
}

/// Like [`check`], but an out-of-memory result becomes [`FailureKind::OutOfMemory`] with the size asked
/// for, reported under `call` (the allocation's name without the `_v2` suffix, e.g. `cuMemAlloc`).
pub(crate) fn check_alloc(call: &'static str, result: Result<()>, requested: usize) -> Result<()> {
    match result {
        Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32) => Err(DriverFailure {
            call,
            kind: FailureKind::OutOfMemory { requested },
        }),
        other => other,
    }
}

/// The name and message of a `CUresult`. The name comes from the binding's enumerator, so it needs no
/// driver; the message asks the driver when it is loaded.
pub(crate) fn driver_error(result: sys::CUresult) -> DriverError {
    let name = format!("{result:?}");
    let mut message = None;
    if library_present() {
        let mut text: *const std::ffi::c_char = std::ptr::null();
        static PRESENT: OnceLock<bool> = OnceLock::new();
        if ensure("cuGetErrorString", &PRESENT).is_ok() {
            // SAFETY: the library loads and has the symbol; the driver writes a pointer to a static,
            // NUL-terminated string (or leaves it null and fails for unknown codes).
            let rc = unsafe { sys::cuGetErrorString(result, &mut text) };
            if rc == sys::CUresult::CUDA_SUCCESS && !text.is_null() {
                // SAFETY: non-null, NUL-terminated, static per the driver's documentation.
                message = Some(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned());
            }
        }
    }
    DriverError {
        code: result as u32,
        name,
        message: message.unwrap_or_else(|| "no description from the driver".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_names_come_from_the_binding() {
        let e = driver_error(sys::CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(e.name, "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(e.code, 1);
        let failure = check("cuMemPoolCreate", sys::CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(failure.call, "cuMemPoolCreate");
        assert_eq!(failure.code(), Some(1));
        assert!(matches!(&failure.kind, FailureKind::Driver(e) if e.name == "CUDA_ERROR_INVALID_VALUE"));
    }

    #[test]
    fn out_of_memory_keeps_the_size() {
        let r = check("cuMemAllocFromPoolAsync", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let failure = check_alloc("cuMemAllocFromPoolAsync", r, 1 << 40).unwrap_err();
        assert_eq!(
            failure,
            DriverFailure {
                call: "cuMemAllocFromPoolAsync",
                kind: FailureKind::OutOfMemory { requested: 1 << 40 }
            }
        );
        assert_eq!(failure.code(), None);
        // Other failures pass through unchanged, under the name of the call that failed.
        let r = check("cuMemAllocFromPoolAsync", sys::CUresult::CUDA_ERROR_INVALID_VALUE);
        let failure = check_alloc("x", r, 1).unwrap_err();
        assert_eq!(failure.call, "cuMemAllocFromPoolAsync");
        assert!(matches!(failure.kind, FailureKind::Driver(_)));
    }

    #[test]
    fn success_is_ok() {
        assert_eq!(check("cuInit", sys::CUresult::CUDA_SUCCESS), Ok(()));
        assert_eq!(check_alloc("cuMemAlloc", Ok(()), 1), Ok(()));
    }

    #[test]
    fn pool_calls_need_cuda_11_2() {
        assert_eq!(first_driver_with("cuMemPoolCreate"), Some(DriverVersion(11020)));
        assert_eq!(first_driver_with("cuMemGetDefaultMemPool"), Some(DriverVersion(13000)));
        assert_eq!(first_driver_with("cuInit"), None);
        assert_eq!(first_driver_with("cuMemCreate"), Some(DriverVersion(10020)));
    }

    #[test]
    fn without_a_library_calls_fail_as_missing() {
        if library_present() {
            return; // the case is only reachable on a machine without the driver
        }
        static PRESENT: OnceLock<bool> = OnceLock::new();
        let failure = ensure("cuMemPoolCreate", &PRESENT).unwrap_err();
        assert_eq!(failure.call, "cuMemPoolCreate");
        assert_eq!(failure.kind, FailureKind::LibraryMissing);
        assert_eq!(init().unwrap_err().kind, FailureKind::LibraryMissing);
    }
}
