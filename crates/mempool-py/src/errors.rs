//! mempool's errors as Python exceptions: the classes of `mempool._errors`, chosen by the C ABI's status of
//! the error, with its message (which names the cause: no driver, no device, the size that did not fit).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use mempool_capi::{Error, Status};

static CLASSES: [PyOnceLock<Py<PyType>>; 8] = [const { PyOnceLock::new() }; 8];
const NAMES: [&str; 8] = [
    "MempoolError",
    "DriverNotFoundError",
    "DriverTooOldError",
    "NoDeviceError",
    "OutOfMemoryError",
    "UnsupportedError",
    "InvalidDeallocationError",
    "DriverError",
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
