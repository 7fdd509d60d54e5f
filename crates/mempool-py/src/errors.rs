//! mempool's errors as Python exceptions: the classes of `mempool._errors`, chosen by the C ABI's status of
//! the error, with its message (which names the cause: no driver, no device, the size that did not fit).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use mempool_capi::{Error, Status};

static CLASSES: [PyOnceLock<Py<PyType>>; 9] = [const { PyOnceLock::new() }; 9];
const NAMES: [&str; 9] = [
    "MempoolError",
    "DriverNotFoundError",
    "DriverTooOldError",
    "NoDeviceError",
    "OutOfMemoryError",
    "UnsupportedError",
    "InvalidDeallocationError",
    "DriverError",
    "PeerAccessError",
];

fn class(py: Python<'_>, status: Status) -> PyResult<&Bound<'_, PyType>> {
    let i = match status {
        Status::DriverNotFound => 1,
        Status::DriverTooOld => 2,
        Status::NoDevice => 3,
        Status::OutOfMemory => 4,
        Status::Unsupported => 5,
        Status::InvalidDeallocation => 6,
        Status::Driver => 7,
        Status::PeerAccess => 8,
        _ => 0,
    };
    CLASSES[i].import(py, "mempool._errors", NAMES[i])
}

/// The Python exception for `e`: a `ValueError` for a bad argument, else the `mempool._errors` class of
/// its status (`OutOfMemoryError` is also a `MemoryError`), carrying `e`'s message.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let status = Status::of(&e);
        if status == Status::InvalidArgument {
            return pyo3::exceptions::PyValueError::new_err(e.to_string());
        }
        match class(py, status) {
            Ok(cls) => PyErr::from_type(cls.clone(), e.to_string()),
            Err(import_failure) => import_failure,
        }
    })
}

/// `?` on mempool's errors in functions that return `PyResult`.
pub trait IntoPy<T> {
    /// The value, or the error as a Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T, E: Into<Error>> IntoPy<T> for Result<T, E> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| to_py(e.into()))
    }
}

/// The `mempool._errors` class for an error of mempool-ipc (see [`ipc_to_py`]).
fn ipc_class_name(e: &mempool_ipc::Error) -> &'static str {
    use mempool_ipc::Error as E;
    match e {
        E::Protocol(_) | E::UnexpectedMessage { .. } | E::DescriptorCount { .. } | E::Remote { .. } => {
            "IpcProtocolError"
        }
        E::Refused { .. } | E::PeerCredentials { .. } | E::ForeignPidNamespace { .. } => "RefusedError",
        E::Timeout { .. } | E::WaitTimeout { .. } => "IpcTimeoutError",
        E::Closed | E::WriteClosed | E::ConnectionFailed | E::ExporterGone { .. } | E::Stalled { .. } => {
            "PeerGoneError"
        }
        E::UnknownImporter { .. } => "PeerGoneError",
        E::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            "PeerGoneError"
        }
        E::WrongDevice { .. } | E::DeviceNotVisible { .. } => "NoDeviceError",
        E::Share { source, .. } => ipc_class_name(source),
        _ => "IpcError",
    }
}

/// The Python exception for an error of mempool-ipc, with `context` (what was being done) before its
/// message: a driver error by its status as [`to_py`] does; a range that cannot be shared is a
/// `ValueError`; otherwise the `mempool._errors` class of its cause: `PeerGoneError` (the peer closed the
/// connection, died, or nobody serves the path), `IpcProtocolError` (a malformed or unexpected message, or
/// the peer's `Error` message), `RefusedError` (turned away: limits, access policy), `IpcTimeoutError`,
/// `NoDeviceError` (the exporter's GPU is not visible here), and `IpcError` for the rest.
pub fn ipc_to_py(context: &str, e: mempool_ipc::Error) -> PyErr {
    let e = match e {
        mempool_ipc::Error::Core(c) => {
            let err = to_py(Error::from(c));
            return Python::attach(|py| {
                let msg = format!("{context}: {}", err.value(py));
                PyErr::from_type(err.get_type(py), msg)
            });
        }
        other => other,
    };
    if matches!(e, mempool_ipc::Error::NotShareable { .. }) {
        return pyo3::exceptions::PyValueError::new_err(format!("{context}: {e}"));
    }
    named(ipc_class_name(&e), format!("{context}: {e}"))
}

/// `?` on mempool-ipc's errors, saying what was being done.
pub trait IpcIntoPy<T> {
    /// The value, or the error as a Python exception whose message starts with `context`.
    fn ipc(self, context: &str) -> PyResult<T>;
}

impl<T> IpcIntoPy<T> for Result<T, mempool_ipc::Error> {
    fn ipc(self, context: &str) -> PyResult<T> {
        self.map_err(|e| ipc_to_py(context, e))
    }
}

/// An exception of the `mempool._errors` class `name` with message `msg` (an `ImportError` if the package
/// is broken).
pub fn named(name: &str, msg: String) -> PyErr {
    Python::attach(|py| match py.import("mempool._errors").and_then(|m| m.getattr(name)) {
        Ok(cls) => match cls.cast_into::<PyType>() {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(not_a_class) => PyErr::from(not_a_class),
        },
        Err(import_failure) => import_failure,
    })
}
