//! What a caller of CuPy's C allocator entry points ([`crate::cupy`]) passes as their `param`: the C
//! functions through which mempool reads CuPy's current stream, keeps a stream alive while memory
//! allocated on it lives, and reports a failure to the caller's language (a Python exception).
//!
//! Kept apart from the entry points: these are the types of function pointers mempool calls, not functions
//! it exports.

use std::ffi::{c_char, c_int, c_void};

/// Returns the calling thread's current stream (a `CUstream`, 0 for the legacy default stream), or a
/// negative value when it cannot be read (with the reason left where [`Raise`] finds it).
pub type CurrentStream = unsafe extern "C" fn() -> isize;

/// Keeps `stream` alive until [`Release`] is called with the token it returns. Null means it failed
/// (with the reason left where [`Raise`] finds it).
pub type Hold = unsafe extern "C" fn(stream: isize) -> *mut c_void;

/// Ends a [`Hold`].
pub type Release = unsafe extern "C" fn(token: *mut c_void);

/// Reports a failed allocation (its [`crate::Status`] code and message) to the caller's language,
/// unless a failure is already pending there (which then stays, as the first cause).
pub type Raise = unsafe extern "C" fn(status: c_int, message: *const c_char);

/// `param` of `mempool_cupy_malloc` and `mempool_cupy_free` (C: `mempool_cupy_param_t`). Every field may be
/// absent: without `current_stream` allocations are on the legacy default stream; without `hold` and
/// `release` nothing keeps a stream alive (the caller promises its streams outlive their memory); without
/// `raise` a failed allocation returns null.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CupyParam {
    /// CuPy's current stream of the calling thread.
    pub current_stream: Option<CurrentStream>,
    /// Keeps a stream other than the legacy (0, 1) and per-thread (2) default streams alive.
    pub hold: Option<Hold>,
    /// Ends a `hold`.
    pub release: Option<Release>,
    /// Reports a failure.
    pub raise: Option<Raise>,
}
