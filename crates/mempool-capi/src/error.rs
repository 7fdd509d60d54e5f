//! The C ABI's status codes, the error they classify, and the thread's last error message.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};

/// What a C entry point can fail with: a resource's error, or an argument the C caller got wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// A resource, adaptor or driver call failed.
    Rmm(mempool_rmm::Error),
    /// An argument was null, out of range or otherwise unusable; the text says which and why.
    InvalidArgument(String),
    /// Rust code panicked inside an entry point; the panic was caught at the boundary.
    Panic(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Rmm(e) => write!(f, "{e}"),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::Panic(why) => write!(f, "internal error (a panic was caught at the C boundary): {why}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<mempool_rmm::Error> for Error {
    fn from(e: mempool_rmm::Error) -> Self {
        Error::Rmm(e)
    }
}

impl From<mempool_core::Error> for Error {
    fn from(e: mempool_core::Error) -> Self {
        Error::Rmm(e.into())
    }
}

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The Python exception a status becomes in the `mempool` package (`crates/mempool-py`): a class of
/// `mempool._errors`, or a built-in one.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PythonException {
    /// The module that defines the class: `"mempool._errors"` or `"builtins"`.
    pub module: &'static str,
    /// The class's name in that module.
    pub class: &'static str,
}

impl PythonException {
    /// A class of `mempool._errors`.
    const fn mempool(class: &'static str) -> PythonException {
        PythonException {
            module: "mempool._errors",
            class,
        }
    }

    /// A built-in exception class.
    const fn builtin(class: &'static str) -> PythonException {
        PythonException {
            module: "builtins",
            class,
        }
    }
}

/// The one definition of the status codes: each status's Rust name, code, C name, one-line summary and
/// Python exception. `include/mempool.h`'s `mempool_status_t` lists the same codes with the summaries as
/// comments, and the Python package's `mempool._errors` defines the classes (`tests/abi.rs` and the
/// Python package's `tests/test_errors.py` fail on any drift).
macro_rules! statuses {
    ($($variant:ident = $code:literal, $c_name:literal, $summary:literal, $python:expr;)*) => {
        /// The status codes of `include/mempool.h` (`MEMPOOL_SUCCESS`, `MEMPOOL_ERROR_*`). Every entry point
        /// that can fail returns one and leaves the message, which names the cause, in [`last_error`].
        #[repr(i32)]
        #[derive(Copy, Clone, Debug, PartialEq, Eq)]
        pub enum Status {
            $(
                #[doc = concat!("`", $c_name, "` (", stringify!($code), "): ", $summary, ".")]
                $variant = $code,
            )*
        }

        impl Status {
            /// Every status, in the order of their codes (0, 1, 2, ...).
            pub const ALL: &'static [Status] = &[$(Status::$variant),*];

            /// The C name of the status, e.g. `MEMPOOL_ERROR_OUT_OF_MEMORY`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Status::$variant => $c_name,)*
                }
            }

            /// The C name as a NUL-terminated string (what `mempool_status_name` returns).
            pub const fn c_name(self) -> &'static CStr {
                match self {
                    $(Status::$variant => {
                        const NAME: &CStr = match CStr::from_bytes_with_nul(concat!($c_name, "\0").as_bytes()) {
                            Ok(name) => name,
                            Err(_) => panic!("a status name contains a NUL byte"),
                        };
                        NAME
                    })*
                }
            }

            /// What the status means, in one line (the comment beside it in `include/mempool.h`).
            pub const fn summary(self) -> &'static str {
                match self {
                    $(Status::$variant => $summary,)*
                }
            }

            /// The Python exception the `mempool` package raises for an error of this status (`None` for
            /// [`Status::Success`]).
            pub const fn python_exception(self) -> Option<PythonException> {
                match self {
                    $(Status::$variant => $python,)*
                }
            }
        }
    };
}

statuses! {
    Success = 0, "MEMPOOL_SUCCESS", "the call succeeded", None;
    InvalidArgument = 1, "MEMPOOL_ERROR_INVALID_ARGUMENT",
        "a NULL or out-of-range argument; the message names it and why",
        Some(PythonException::builtin("ValueError"));
    DriverNotFound = 2, "MEMPOOL_ERROR_DRIVER_NOT_FOUND", "no CUDA driver (libcuda.so) could be loaded",
        Some(PythonException::mempool("DriverNotFoundError"));
    DriverTooOld = 3, "MEMPOOL_ERROR_DRIVER_TOO_OLD",
        "the driver lacks a call this needs; the message names the call and the versions",
        Some(PythonException::mempool("DriverTooOldError"));
    NoDevice = 4, "MEMPOOL_ERROR_NO_DEVICE", "no device, or no device with that ordinal",
        Some(PythonException::mempool("NoDeviceError"));
    OutOfMemory = 5, "MEMPOOL_ERROR_OUT_OF_MEMORY",
        "out of memory, or over a limiting adaptor's limit; the message names the size asked for",
        Some(PythonException::mempool("OutOfMemoryError"));
    Unsupported = 6, "MEMPOOL_ERROR_UNSUPPORTED",
        "the device or resource cannot serve the request (a missing capability, a size it does not serve)",
        Some(PythonException::mempool("UnsupportedError"));
    InvalidDeallocation = 7, "MEMPOOL_ERROR_INVALID_DEALLOCATION", "a free that matched no live allocation",
        Some(PythonException::mempool("InvalidDeallocationError"));
    Driver = 8, "MEMPOOL_ERROR_DRIVER",
        "another driver call failed; the message names the call and the CUDA error",
        Some(PythonException::mempool("DriverError"));
    Panic = 9, "MEMPOOL_ERROR_PANIC", "a bug in mempool: a panic caught at the C boundary",
        Some(PythonException::mempool("MempoolError"));
    Other = 10, "MEMPOOL_ERROR_OTHER", "anything else (the logging adaptor's I/O, ...); the message names it",
        Some(PythonException::mempool("MempoolError"));
    PeerAccess = 11, "MEMPOOL_ERROR_PEER_ACCESS",
        "a device cannot access the other's memory (no peer capability); the message names both devices",
        Some(PythonException::mempool("PeerAccessError"));
}

impl Status {
    /// The status that classifies `e`.
    pub fn of(e: &Error) -> Status {
        use mempool_core::Error as C;
        use mempool_rmm::Error as R;
        match e {
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::Panic(_) => Status::Panic,
            Error::Rmm(R::OutOfMemory { .. } | R::OutOfMemoryReport(_) | R::LimitExceeded { .. }) => {
                Status::OutOfMemory
            }
            Error::Rmm(R::Unsupported { .. }) => Status::Unsupported,
            Error::Rmm(R::InvalidDeallocation { .. }) => Status::InvalidDeallocation,
            Error::Rmm(R::Core(c)) => match c {
                C::DriverNotFound => Status::DriverNotFound,
                C::DriverTooOld { .. } => Status::DriverTooOld,
                C::NoDevice | C::NoSuchDevice { .. } => Status::NoDevice,
                C::OutOfMemory { .. } => Status::OutOfMemory,
                C::PoolsNotSupported { .. }
                | C::CapabilityMissing { .. }
                | C::HandleTypeNotSupported { .. }
                | C::VmmHandleTypeNotSupported { .. } => Status::Unsupported,
                // Operations this kind of pool or this allocation cannot do.
                C::PoolKind { .. } | C::AllocationNotExportable { .. } => Status::Unsupported,
                C::InvalidArgument(_) | C::NotGranular { .. } => Status::InvalidArgument,
                C::PeerAccess { .. } => Status::PeerAccess,
                C::Driver { .. } => Status::Driver,
                // A full reservation, a leak on purpose, a context that is not primary, and variants added
                // later: their messages name the cause.
                _ => Status::Other,
            },
            Error::Rmm(_) => Status::Other,
        }
    }

    /// The status whose code is `code`, if any.
    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| *s as i32 == code)
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// What [`last_error_ptr`] returns on a thread whose thread-local storage is already destroyed (an entry
/// point called from another thread-local's destructor): the message cannot be kept there.
const NO_SLOT: &CStr = c"mempool: the error message was lost (called during thread exit)";

/// Sets this thread's last error to `c`. Never panics: after the thread's thread-local storage is
/// destroyed (a call from another thread-local's destructor) the message is dropped.
fn set(c: CString) {
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = c;
        }
    });
}

/// Records `e` as this thread's last error and returns its status. Never panics: once the thread's
/// thread-local storage is destroyed, the message is dropped.
pub fn record(e: &Error) -> Status {
    let text = e.to_string().replace('\0', " ");
    set(CString::new(text).unwrap_or_default());
    Status::of(e)
}

/// Records `e` as this thread's last error, its message led by `prefix` (`"{prefix}: {e}"`), and returns
/// its status. Never panics.
pub fn record_with_prefix(e: &Error, prefix: &str) -> Status {
    let text = format!("{prefix}: {e}").replace('\0', " ");
    set(CString::new(text).unwrap_or_default());
    Status::of(e)
}

/// Clears this thread's last error (a successful call). Never panics.
pub fn clear() {
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            if !l.as_bytes().is_empty() {
                *l = CString::default();
            }
        }
    });
}

/// This thread's last error message, empty after a success. The pointer stays valid until the thread's
/// next call into mempool (a static message once the thread's storage is destroyed). Never panics.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.try_borrow().map_or(NO_SLOT.as_ptr(), |l| l.as_ptr()))
        .unwrap_or(NO_SLOT.as_ptr())
}

/// This thread's last error message, as Rust text.
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|l| {
            l.try_borrow()
                .map(|l| l.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .unwrap_or_else(|_| NO_SLOT.to_string_lossy().into_owned())
}

/// The message of a caught panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;
    use mempool_core::{DriverError, DriverVersion, HandleTypes, PeerRefusal};

    #[test]
    fn missing_capabilities_are_unsupported() {
        let vmm = Error::from(mempool_core::Error::VmmHandleTypeNotSupported {
            device: 0,
            requested: HandleTypes::FABRIC,
            supported: HandleTypes::POSIX_FILE_DESCRIPTOR,
        });
        assert_eq!(Status::of(&vmm), Status::Unsupported);
        assert_eq!(
            Status::of(&Error::from(mempool_core::Error::DriverNotFound)),
            Status::DriverNotFound
        );
    }

    #[test]
    fn a_refused_peer_grant_has_its_own_status_naming_both_devices() {
        let e = Error::from(mempool_core::Error::PeerAccess {
            owner: 0,
            peer: 1,
            reason: PeerRefusal::NoPeerCapability,
        });
        assert_eq!(Status::of(&e), Status::PeerAccess);
        assert_eq!(Status::PeerAccess.name(), "MEMPOOL_ERROR_PEER_ACCESS");
        let text = e.to_string();
        assert!(text.contains("device 1") && text.contains("device 0"), "{text}");
    }

    /// For every status but success: an error of that status, as the C ABI records it, and what its
    /// last-error message must name.
    fn one_error_per_status() -> Vec<(Error, &'static [&'static str])> {
        use mempool_core::Error as C;
        use mempool_rmm::Error as R;
        vec![
            (
                Error::InvalidArgument("upstream is null".into()),
                &["invalid argument", "upstream is null"],
            ),
            (C::DriverNotFound.into(), &["no CUDA driver", "libcuda.so"]),
            (
                C::DriverTooOld {
                    call: "cuMemPoolCreate",
                    driver: DriverVersion(11000),
                    required: Some(DriverVersion(11020)),
                }
                .into(),
                &["cuMemPoolCreate", "11.0", "11.2"],
            ),
            (
                C::NoSuchDevice { ordinal: 3, count: 1 }.into(),
                &["device 3", "1 device"],
            ),
            (
                R::OutOfMemory {
                    resource: "PoolResource",
                    requested: 1 << 30,
                }
                .into(),
                &["out of memory", "PoolResource", "1073741824 bytes"],
            ),
            (
                R::Unsupported {
                    resource: "FixedSizeResource",
                    reason: "it serves blocks of at most 1048576 bytes".into(),
                }
                .into(),
                &["FixedSizeResource", "at most 1048576 bytes"],
            ),
            (
                R::InvalidDeallocation {
                    resource: "PoolResource",
                    ptr: 0x7f00_0000_1000,
                    bytes: 256,
                    reason: "no live allocation starts there".into(),
                }
                .into(),
                &[
                    "invalid deallocation",
                    "0x7f0000001000",
                    "256 bytes",
                    "no live allocation",
                ],
            ),
            (
                C::Driver {
                    call: "cuMemAllocAsync",
                    error: DriverError {
                        code: 700,
                        name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                        message: "an illegal memory access was encountered".into(),
                    },
                }
                .into(),
                &["cuMemAllocAsync", "CUDA_ERROR_ILLEGAL_ADDRESS", "illegal memory access"],
            ),
            (
                Error::Panic("index out of bounds".into()),
                &["panic", "index out of bounds"],
            ),
            (
                R::Log("No space left on device".into()).into(),
                &["log", "No space left on device"],
            ),
            (
                C::PeerAccess {
                    owner: 0,
                    peer: 1,
                    reason: PeerRefusal::NoPeerCapability,
                }
                .into(),
                &["device 0", "device 1"],
            ),
        ]
    }

    #[test]
    fn every_status_has_a_last_error_message_that_names_its_cause() {
        let cases = one_error_per_status();
        let mut covered: Vec<Status> = cases.iter().map(|(e, _)| Status::of(e)).collect();
        covered.sort_by_key(|s| *s as i32);
        let expected: Vec<Status> = Status::ALL.iter().copied().filter(|s| *s != Status::Success).collect();
        assert_eq!(
            covered, expected,
            "one case per status, each classified as its own status"
        );
        for (e, names) in &cases {
            let status = record(e);
            assert_eq!(status, Status::of(e));
            // SAFETY: `last_error_ptr` returns this thread's NUL-terminated message, live until the next
            // call into mempool on this thread (none happens before the copy).
            let text = unsafe { CStr::from_ptr(last_error_ptr()) }
                .to_string_lossy()
                .into_owned();
            assert_eq!(text, last_error());
            for name in *names {
                assert!(
                    text.contains(name),
                    "{}: the message {text:?} does not name {name:?}",
                    status.name()
                );
            }
            clear();
            assert_eq!(last_error(), "");
        }
    }

    #[test]
    fn errors_of_the_core_are_classified_by_their_cause_not_as_driver_failures() {
        use mempool_core::Error as C;
        let not_granular = C::NotGranular {
            what: "the physical allocation's size",
            value: 1000,
            granularity: 2 << 20,
        };
        assert_eq!(Status::of(&not_granular.into()), Status::InvalidArgument);
        let kind = C::PoolKind {
            operation: "trimming",
            kind: "an imported pool",
            why: "only the exporting process can trim it",
        };
        assert_eq!(Status::of(&kind.into()), Status::Unsupported);
        let leaked = C::Leaked {
            what: "a mapping".into(),
            cause: "cuMemUnmap failed".into(),
        };
        assert_eq!(Status::of(&leaked.into()), Status::Other);
    }

    #[test]
    fn a_service_out_of_memory_is_out_of_memory_and_says_what_is_held() {
        let mut r = mempool_rmm::OutOfMemoryReport::new(3 << 30, "ServiceResource");
        r.stack = vec!["HistoryResource", "ServiceResource"];
        r.tag = Some("kv-cache".into());
        r.holder = Some("ServiceResource");
        r.held = Some(7 << 30);
        r.held_as = Some("mapped");
        r.live = Some(6 << 30);
        r.free = Some(1 << 30);
        r.largest_free = Some(1 << 29);
        r.device_free = Some(1 << 20);
        let e = Error::from(mempool_rmm::Error::OutOfMemoryReport(Box::new(r)));
        assert_eq!(record(&e), Status::OutOfMemory);
        let text = last_error();
        for name in [
            "out of memory",
            "3221225472 bytes",
            "`kv-cache`",
            "HistoryResource > ServiceResource could not allocate",
            "ServiceResource holds 7516192768 bytes mapped",
            "6442450944 bytes live",
            "its largest free block is 536870912 bytes",
            "50% fragmented",
            "device has 1048576 bytes free",
        ] {
            assert!(text.contains(name), "{text:?} does not name {name:?}");
        }
        clear();
    }

    #[test]
    fn a_message_with_a_nul_byte_is_kept_with_the_nul_replaced() {
        record(&Error::InvalidArgument("a\0b".into()));
        assert_eq!(last_error(), "invalid argument: a b");
        record_with_prefix(
            &Error::InvalidArgument("x".into()),
            "mempool could not allocate 16 bytes",
        );
        assert_eq!(last_error(), "mempool could not allocate 16 bytes: invalid argument: x");
    }
}
