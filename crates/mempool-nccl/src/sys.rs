//! NCCL's C types (declared here from `nccl.h`, NCCL 2.2x) and the library, opened at run time with
//! `libloading`: every entry point is resolved once, when the library is opened; one the library lacks
//! stays absent and its call is an [`Error::MissingSymbol`] naming the NCCL version that added it.
//!
//! This is the crate's one FFI module: everything unsafe about calling NCCL is here or in `comm`, `group`
//! and `registration`. Private: what users need of it is re-exported at the crate root.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: `struct { char internal[128]; }`, passed by value.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RawUniqueId {
    /// The opaque bytes.
    pub internal: [u8; UNIQUE_ID_BYTES],
}

/// `struct ncclComm` (opaque).
#[repr(C)]
pub struct OpaqueComm {
    _private: [u8; 0],
}

/// `ncclComm_t`.
pub type RawComm = *mut OpaqueComm;
/// `ncclResult_t` (a C enum: `int`).
pub type RawResult = c_int;
/// `ncclDataType_t`.
pub type RawDataType = c_int;
/// `ncclRedOp_t`.
pub type RawRedOp = c_int;
/// `cudaStream_t`, the same handle as the driver's `CUstream` (a pointer to an opaque struct).
pub type RawStream = *mut c_void;

/// `ncclSuccess`.
pub const SUCCESS: RawResult = 0;

/// The name of an `ncclResult_t` value, as `nccl.h` spells it.
pub fn result_name(code: RawResult) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> RawResult;
type GetUniqueIdFn = unsafe extern "C" fn(*mut RawUniqueId) -> RawResult;
type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int) -> RawResult;
type CommInitAllFn = unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> RawResult;
type CommFn = unsafe extern "C" fn(RawComm) -> RawResult;
pub(crate) type CommIntFn = unsafe extern "C" fn(RawComm, *mut c_int) -> RawResult;
type GetErrorStringFn = unsafe extern "C" fn(RawResult) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
pub(crate) type CommRegisterFn = unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut *mut c_void) -> RawResult;
pub(crate) type CommDeregisterFn = unsafe extern "C" fn(RawComm, *mut c_void) -> RawResult;
type GroupFn = unsafe extern "C" fn() -> RawResult;
type AllReduceFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, RawDataType, RawRedOp, RawComm, RawStream) -> RawResult;
type ReduceScatterFn = AllReduceFn;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, RawDataType, RawComm, RawStream) -> RawResult;
type BroadcastFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, RawDataType, c_int, RawComm, RawStream) -> RawResult;

/// One entry point: the pointer if the library has it, with its name and the version that added it.
#[derive(Copy, Clone)]
pub struct Sym<F> {
    f: Option<F>,
    /// The symbol's name.
    pub name: &'static str,
    /// The NCCL version that introduced it.
    pub added_in: &'static str,
}

/// An opened NCCL library with its entry points.
pub struct Library {
    // Keeps the library mapped: every pointer below points into it.
    _lib: libloading::Library,
    path: String,
    version: i32,
    pub(crate) get_unique_id: Sym<GetUniqueIdFn>,
    pub(crate) comm_init_rank: Sym<CommInitRankFn>,
    pub(crate) comm_init_all: Sym<CommInitAllFn>,
    pub(crate) comm_destroy: Sym<CommFn>,
    pub(crate) comm_abort: Sym<CommFn>,
    pub(crate) comm_count: Sym<CommIntFn>,
    pub(crate) comm_cu_device: Sym<CommIntFn>,
    pub(crate) comm_user_rank: Sym<CommIntFn>,
    pub(crate) get_error_string: Sym<GetErrorStringFn>,
    pub(crate) get_last_error: Sym<GetLastErrorFn>,
    pub(crate) comm_register: Sym<CommRegisterFn>,
    pub(crate) comm_deregister: Sym<CommDeregisterFn>,
    pub(crate) group_start: Sym<GroupFn>,
    pub(crate) group_end: Sym<GroupFn>,
    pub(crate) all_reduce: Sym<AllReduceFn>,
    pub(crate) reduce_scatter: Sym<ReduceScatterFn>,
    pub(crate) all_gather: Sym<AllGatherFn>,
    pub(crate) broadcast: Sym<BroadcastFn>,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("version", &self.version_string())
            .finish()
    }
}

/// Resolves `name` (NUL-terminated) in `lib`; absent is `None`.
///
/// # Safety
/// 1. `F` is the C signature the symbol has in every NCCL version that exports it.
unsafe fn resolve<F: Copy>(lib: &libloading::Library, name: &'static str, added_in: &'static str) -> Sym<F> {
    // SAFETY: point 1 is the caller's; the pointer is copied out and used only while `lib` (kept in the
    // same `Library`) is loaded.
    let f = unsafe { lib.get::<F>(name) }.ok().map(|s| *s);
    Sym { f, name, added_in }
}

/// `NCCL_VERSION_CODE` as text: `X*10000 + Y*100 + Z` since 2.9, `X*1000 + Y*100 + Z` before.
pub fn version_text(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

impl Library {
    /// Opens the library at `path` (a path or a name the dynamic loader searches) and resolves its entry
    /// points. Refuses a library without `ncclGetVersion` ([`Error::NotNccl`]).
    pub fn open(path: &str) -> std::result::Result<Library, OpenError> {
        // SAFETY: opening a library runs its initializers; NCCL's (and any library a user names as NCCL)
        // are the ones an application linking it would run. Documented in the crate root.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| OpenError::Load(e.to_string()))?;
        // SAFETY: every type below is the signature nccl.h declares for the name, unchanged since the
        // version named.
        let get_version: Sym<GetVersionFn> = unsafe { resolve(&lib, "ncclGetVersion", "2.3") };
        let Some(gv) = get_version.f else {
            return Err(OpenError::NotNccl);
        };
        let mut version = 0;
        // SAFETY: `ncclGetVersion(int*)` writes one int.
        let r = unsafe { gv(&mut version) };
        if r != SUCCESS {
            return Err(OpenError::Load(format!("ncclGetVersion returned {}", result_name(r))));
        }
        // SAFETY: each `resolve` below names the signature nccl.h declares for that name.
        unsafe {
            Ok(Library {
                get_unique_id: resolve(&lib, "ncclGetUniqueId", "2.0"),
                comm_init_rank: resolve(&lib, "ncclCommInitRank", "2.0"),
                comm_init_all: resolve(&lib, "ncclCommInitAll", "2.0"),
                comm_destroy: resolve(&lib, "ncclCommDestroy", "2.0"),
                comm_abort: resolve(&lib, "ncclCommAbort", "2.4"),
                comm_count: resolve(&lib, "ncclCommCount", "2.0"),
                comm_cu_device: resolve(&lib, "ncclCommCuDevice", "2.0"),
                comm_user_rank: resolve(&lib, "ncclCommUserRank", "2.0"),
                get_error_string: resolve(&lib, "ncclGetErrorString", "2.0"),
                get_last_error: resolve(&lib, "ncclGetLastError", "2.13"),
                comm_register: resolve(&lib, "ncclCommRegister", "2.19"),
                comm_deregister: resolve(&lib, "ncclCommDeregister", "2.19"),
                group_start: resolve(&lib, "ncclGroupStart", "2.0"),
                group_end: resolve(&lib, "ncclGroupEnd", "2.0"),
                all_reduce: resolve(&lib, "ncclAllReduce", "2.0"),
                reduce_scatter: resolve(&lib, "ncclReduceScatter", "2.0"),
                all_gather: resolve(&lib, "ncclAllGather", "2.0"),
                broadcast: resolve(&lib, "ncclBroadcast", "2.2"),
                _lib: lib,
                path: path.to_owned(),
                version,
            })
        }
    }

    /// What was opened.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `ncclGetVersion`'s code.
    pub fn version_code(&self) -> i32 {
        self.version
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        version_text(self.version)
    }

    /// The entry point, or [`Error::MissingSymbol`].
    pub(crate) fn get<F: Copy>(&self, sym: &Sym<F>) -> Result<F> {
        sym.f.ok_or_else(|| Error::MissingSymbol {
            symbol: sym.name,
            added_in: sym.added_in,
            version: self.version_string(),
            path: self.path.clone(),
        })
    }

    /// Turns a result code into `Ok` or an [`Error::Nccl`] with NCCL's message and, given a
    /// communicator, its last error text.
    pub(crate) fn check(&self, call: &'static str, code: RawResult, comm: RawComm) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated strings that stay allocated for the process's
                // life: `ncclGetErrorString`'s are static; `ncclGetLastError`'s is a process-wide
                // 1024-byte buffer whose last byte is always NUL, so the read stays in bounds even
                // when another NCCL thread rewrites it meanwhile (the text can then be torn).
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let message = match self.get_error_string.f {
            // SAFETY: `ncclGetErrorString` takes any result value.
            Some(f) => text(unsafe { f(code) }),
            None => String::new(),
        };
        let last_error = match self.get_last_error.f {
            // SAFETY: `ncclGetLastError` accepts a live communicator or NULL; callers pass one of those.
            // It reports the process's last error, which may be another thread's.
            Some(f) => text(unsafe { f(comm) }),
            None => String::new(),
        };
        Err(Error::Nccl {
            call,
            code,
            name: result_name(code),
            message,
            last_error,
        })
    }
}

/// Why one candidate could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// The loader's message.
    Load(String),
    /// Opened, but without `ncclGetVersion`.
    NotNccl,
}

/// The environment variable naming the library to open instead of searching.
pub const LIBRARY_ENV: &str = "MEMPOOL_NCCL_LIBRARY";

/// The names tried, in order: `MEMPOOL_NCCL_LIBRARY` alone when it is set (a path the user chose is not
/// silently replaced by another NCCL), else `libnccl.so.2`, then `libnccl.so`.
pub fn candidates(env: Option<&str>) -> Vec<String> {
    match env {
        Some(p) if !p.is_empty() => vec![p.to_owned()],
        _ => vec!["libnccl.so.2".to_owned(), "libnccl.so".to_owned()],
    }
}

/// Opens the first of `names` that is an NCCL library.
pub fn open_first(names: &[String]) -> Result<Library> {
    let mut tried = Vec::new();
    for n in names {
        match Library::open(n) {
            Ok(lib) => return Ok(lib),
            Err(OpenError::NotNccl) => {
                return Err(Error::NotNccl {
                    path: n.clone(),
                    symbol: "ncclGetVersion",
                })
            }
            Err(OpenError::Load(why)) => tried.push((n.clone(), why)),
        }
    }
    Err(Error::LibraryNotFound { tried })
}

static LIBRARY: OnceLock<Result<Library>> = OnceLock::new();

/// The process's NCCL, opened on first use from [`candidates`] (reading `MEMPOOL_NCCL_LIBRARY` then) and
/// kept for the life of the process; a failure is kept too, so every later call reports the same cause.
pub fn library() -> Result<&'static Library> {
    LIBRARY
        .get_or_init(|| {
            let env = std::env::var(LIBRARY_ENV).ok();
            open_first(&candidates(env.as_deref()))
        })
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_types_have_nccl_h_sizes() {
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
        assert_eq!(std::mem::align_of::<RawUniqueId>(), 1);
        assert_eq!(std::mem::size_of::<RawComm>(), std::mem::size_of::<*mut c_void>());
        assert_eq!(std::mem::size_of::<RawResult>(), 4);
        assert_eq!(std::mem::size_of::<RawStream>(), std::mem::size_of::<*mut c_void>());
    }

    #[test]
    fn result_codes_are_named_as_in_nccl_h() {
        assert_eq!(result_name(0), "ncclSuccess");
        assert_eq!(result_name(4), "ncclInvalidArgument");
        assert_eq!(result_name(8), "ncclTimeout");
        assert_eq!(result_name(42), "unknown ncclResult_t");
    }

    #[test]
    fn versions_print_in_both_encodings() {
        assert_eq!(version_text(22703), "2.27.3");
        assert_eq!(version_text(2804), "2.8.4");
        assert_eq!(version_text(21903), "2.19.3");
    }

    #[test]
    fn a_failed_search_lists_every_name_tried_with_the_reason() {
        let names = vec![
            "/nonexistent/dir/libnccl.so.2".to_owned(),
            "libnccl-not-here.so".to_owned(),
        ];
        let e = open_first(&names).unwrap_err();
        let Error::LibraryNotFound { tried } = &e else {
            panic!("expected LibraryNotFound, got {e:?}")
        };
        let tried_names: Vec<&str> = tried.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(tried_names, names);
        assert!(tried.iter().all(|(_, why)| !why.is_empty()), "{tried:?}");
        let text = e.to_string();
        assert!(text.contains(&names[0]) && text.contains(&names[1]), "{text}");
    }

    #[test]
    fn the_search_stops_at_a_library_that_is_not_nccl() {
        let names = vec!["libc.so.6".to_owned(), "libnccl-not-here.so".to_owned()];
        assert_eq!(
            open_first(&names).unwrap_err(),
            Error::NotNccl {
                path: "libc.so.6".into(),
                symbol: "ncclGetVersion"
            }
        );
    }

    #[test]
    fn the_search_order_is_env_then_soname_then_dev_link() {
        assert_eq!(candidates(None), ["libnccl.so.2", "libnccl.so"]);
        assert_eq!(candidates(Some("")), ["libnccl.so.2", "libnccl.so"]);
        assert_eq!(candidates(Some("/opt/nccl/libnccl.so.2")), ["/opt/nccl/libnccl.so.2"]);
    }
}
