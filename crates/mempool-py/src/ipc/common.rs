//! What the `mempool.ipc` classes share: argument conversions and checks, the refusal to pickle, and a
//! stream view that outlives the borrow checker's reach.

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use mempool_core::{Stream, StreamRef};
use mempool_ipc::AccessPolicy;

/// A view of `stream` that the borrow checker does not tie to it.
///
/// # Safety
/// 1. The caller keeps `stream` alive (an `Arc` held next to whatever keeps the view) for as long as the
///    view, or anything made with it, is used: the buffers of this module hold the `Arc` in a field that
///    is dropped after the buffer.
#[allow(unsafe_code)]
pub(crate) unsafe fn static_ref(stream: &Stream) -> StreamRef<'static> {
    // SAFETY: point 1 keeps the stream live for as long as the view is used; the stream is one of the pool's
    // (or importer's) context, which is where mempool-ipc binds it.
    unsafe { StreamRef::from_raw(stream.as_raw()) }
}

pub(crate) fn seconds(name: &str, v: f64, zero_ok: bool) -> PyResult<Duration> {
    if !v.is_finite() || v < 0.0 || (v == 0.0 && !zero_ok) {
        let what = if zero_ok { "a non-negative" } else { "a positive" };
        return Err(PyValueError::new_err(format!(
            "{name} must be {what} number of seconds, got {v}"
        )));
    }
    Duration::try_from_secs_f64(v).map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

pub(crate) fn at_least_one(name: &str, v: usize) -> PyResult<usize> {
    if v == 0 {
        return Err(PyValueError::new_err(format!("{name} must be at least 1")));
    }
    Ok(v)
}

pub(crate) fn policy(allow_uids: Option<Vec<u32>>) -> AccessPolicy {
    allow_uids.map_or(AccessPolicy::SameUser, AccessPolicy::allow_uids)
}

/// The error of pickling (or otherwise copying into another process) one of this module's objects.
pub(crate) fn no_pickle(what: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "mempool.ipc.{what} cannot be pickled or sent to another process: it is a live connection or mapping \
         of this process. Send the socket path (a str) instead, and connect a mempool.ipc.Importer to it in \
         the other process"
    ))
}
