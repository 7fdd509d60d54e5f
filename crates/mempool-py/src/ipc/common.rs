//! What the `mempool.ipc` classes share: argument conversions and checks, the refusal to pickle, a
//! stream view that outlives the borrow checker's reach, `tobytes`' copy, the sliced interruptible wait
//! of `recv`, and the surface of the classes that own a socket ([`Closable`], `closable_pymethods!`).

use std::path::Path;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

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

/// A new `bytes` of `size` bytes filled by `copy`, or `copy`'s error (the bytes are then dropped): what
/// every `tobytes` of this module returns.
pub(crate) fn bytes_filled<'py>(
    py: Python<'py>,
    size: usize,
    copy: impl FnOnce(&mut [u8]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut result = Ok(());
    let b = PyBytes::new_with(py, size, |dst| {
        result = copy(dst);
        Ok(())
    })?;
    result.map(|()| b)
}

/// Runs `attempt` (with the interpreter released) in slices of at most 200 ms until it returns something
/// other than a timeout, checking for Ctrl-C between slices, for at most `timeout` seconds (None: as long
/// as it takes); the last timeout, or any other error, is raised saying it happened while `what`.
pub(crate) fn wait_in_slices<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    what: &str,
    mut attempt: impl FnMut(Duration) -> mempool_ipc::Result<T> + Send,
) -> PyResult<T> {
    const SLICE: Duration = Duration::from_millis(200);
    let deadline = match timeout {
        Some(t) => Some(Instant::now() + seconds("timeout", t, true)?),
        None => None,
    };
    loop {
        let wait = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
        match py.detach(|| attempt(wait)) {
            Ok(v) => return Ok(v),
            Err(mempool_ipc::Error::Timeout { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {
                py.check_signals()?;
            }
            Err(e) => return Err(crate::errors::ipc_to_py(what, e)),
        }
    }
}

/// The Python surface of a `mempool.ipc` object that owns a socket and can be closed: `Exporter`
/// (`shutdown()`), `Importer` (`close()`), `MemoryStoreServer` (`shutdown()`).
pub(crate) trait Closable {
    /// The class's name in `mempool.ipc`.
    const PY_NAME: &'static str;
    /// The socket path.
    fn socket_path(&self) -> &Path;
    /// Whether it was closed.
    fn is_closed(&self) -> bool;
    /// Closes it (what leaving a `with` block does).
    fn close_now(&self, py: Python<'_>);
    /// What `repr` shows after the path (" device=0").
    fn repr_extra(&self) -> String {
        String::new()
    }
}

/// `#[pymethods]` of a [`Closable`] class: `path` and `closed` (with the documentation given), the
/// context manager (`__exit__` closes), the refusal to pickle and `repr`, then the class's own methods.
macro_rules! closable_pymethods {
    ($ty:ty, path = $path_doc:literal, closed = $closed_doc:literal { $($own:tt)* }) => {
        #[pymethods]
        impl $ty {
            #[doc = $path_doc]
            #[getter]
            fn path(&self) -> String {
                $crate::ipc::common::Closable::socket_path(self).to_string_lossy().into_owned()
            }

            #[doc = $closed_doc]
            #[getter]
            fn closed(&self) -> bool {
                $crate::ipc::common::Closable::is_closed(self)
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            #[pyo3(signature = (*_args))]
            fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
                $crate::ipc::common::Closable::close_now(self, py);
                false
            }

            fn __reduce__(&self) -> PyResult<()> {
                Err($crate::ipc::common::no_pickle(<$ty as $crate::ipc::common::Closable>::PY_NAME))
            }

            fn __repr__(&self) -> String {
                use $crate::ipc::common::Closable;
                format!(
                    "<mempool.ipc.{} path={:?}{}{}>",
                    <$ty as Closable>::PY_NAME,
                    self.socket_path().display().to_string(),
                    self.repr_extra(),
                    if self.is_closed() { " closed" } else { "" }
                )
            }

            $($own)*
        }
    };
}

pub(crate) use closable_pymethods;
