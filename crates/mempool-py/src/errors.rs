//! mempool's errors as Python exceptions, with their messages (which name the cause: no driver, no device,
//! the size that did not fit). The class of an error is the one its C ABI status has in mempool-capi's
//! status table ([`Status::python_exception`]); errors of mempool-ipc have the classes of [`IpcClass`]
//! besides. `tests/test_errors.py` checks `mempool._errors` and `include/mempool.h` against both.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use mempool_capi::error::PythonException;
use mempool_capi::{Error, Status};

/// The class of each status (indexed by its code: `Status::ALL` is in code order), imported once.
static CLASSES: [PyOnceLock<Py<PyType>>; Status::ALL.len()] = [const { PyOnceLock::new() }; Status::ALL.len()];

/// The class of an error whose status has none (only `Status::Success` has none, and no error has it).
const BASE: PythonException = PythonException {
    module: "mempool._errors",
    class: "MempoolError",
};

/// The Python exception class of `status`, as mempool-capi's status table names it.
fn class(py: Python<'_>, status: Status) -> PyResult<&Bound<'_, PyType>> {
    let exc = status.python_exception().unwrap_or(BASE);
    CLASSES[status as usize].import(py, exc.module, exc.class)
}

/// An exception of `status`'s class carrying `message`.
pub(crate) fn of_status(status: Status, message: String) -> PyErr {
    Python::attach(|py| match class(py, status) {
        Ok(cls) => PyErr::from_type(cls.clone(), message),
        Err(import_failure) => import_failure,
    })
}

/// The Python exception for `e`: the class its status has in mempool-capi's status table (a `ValueError`
/// for a bad argument, else a `mempool._errors` class; `OutOfMemoryError` is also a `MemoryError`),
/// carrying `e`'s message.
pub fn to_py(e: Error) -> PyErr {
    of_status(Status::of(&e), e.to_string())
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

/// The `mempool._errors` classes that only errors of mempool-ipc have (the others have a status's class):
/// `IpcError` and its subclasses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum IpcClass {
    /// `IpcError`: the base, and the class of the causes below have no class of their own.
    Ipc,
    /// `PeerGoneError`: the peer closed the connection, died, or nobody serves the path.
    PeerGone,
    /// `IpcProtocolError`: a malformed or unexpected message, or the peer's `Error` message.
    Protocol,
    /// `RefusedError`: turned away (limits, access policy).
    Refused,
    /// `IpcTimeoutError`: a step or a wait timed out.
    Timeout,
}

impl IpcClass {
    const ALL: [IpcClass; 5] = [
        IpcClass::Ipc,
        IpcClass::PeerGone,
        IpcClass::Protocol,
        IpcClass::Refused,
        IpcClass::Timeout,
    ];

    fn name(self) -> &'static str {
        match self {
            IpcClass::Ipc => "IpcError",
            IpcClass::PeerGone => "PeerGoneError",
            IpcClass::Protocol => "IpcProtocolError",
            IpcClass::Refused => "RefusedError",
            IpcClass::Timeout => "IpcTimeoutError",
        }
    }
}

/// The Python class of an error of mempool-ipc (see [`ipc_to_py`]): one of mempool-ipc's own, or the
/// class of a status.
enum IpcCause {
    Ipc(IpcClass),
    Status(Status),
}

fn ipc_cause(e: &mempool_ipc::Error) -> IpcCause {
    use mempool_ipc::Error as E;
    use IpcCause::Ipc;
    match e {
        E::Protocol(_) | E::UnexpectedMessage { .. } | E::DescriptorCount { .. } | E::Remote { .. } => {
            Ipc(IpcClass::Protocol)
        }
        E::Refused { .. } | E::PeerCredentials { .. } | E::ForeignPidNamespace { .. } => Ipc(IpcClass::Refused),
        E::Timeout { .. } | E::WaitTimeout { .. } => Ipc(IpcClass::Timeout),
        E::Closed | E::WriteClosed | E::ConnectionFailed | E::ExporterGone { .. } | E::Stalled { .. } => {
            Ipc(IpcClass::PeerGone)
        }
        E::UnknownImporter { .. } => Ipc(IpcClass::PeerGone),
        E::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Ipc(IpcClass::PeerGone)
        }
        E::WrongDevice { .. } | E::DeviceNotVisible { .. } => IpcCause::Status(Status::NoDevice),
        E::Share { source, .. } => ipc_cause(source),
        _ => Ipc(IpcClass::Ipc),
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
        return of_status(Status::InvalidArgument, format!("{context}: {e}"));
    }
    match ipc_cause(&e) {
        IpcCause::Ipc(class) => named(class.name(), format!("{context}: {e}")),
        IpcCause::Status(status) => of_status(status, format!("{context}: {e}")),
    }
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
    debug_assert!(
        is_table_class(name),
        "{name} is not a mempool._errors class of the exception table (a status's or an IpcClass)"
    );
    Python::attach(|py| match py.import("mempool._errors").and_then(|m| m.getattr(name)) {
        Ok(cls) => match cls.cast_into::<PyType>() {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(not_a_class) => PyErr::from(not_a_class),
        },
        Err(import_failure) => import_failure,
    })
}

/// Whether `name` is a `mempool._errors` class of the exception table.
fn is_table_class(name: &str) -> bool {
    let status = |s: &Status| {
        s.python_exception()
            .is_some_and(|e| e.module == BASE.module && e.class == name)
    };
    Status::ALL.iter().any(status) || IpcClass::ALL.iter().any(|c| c.name() == name)
}

/// `(code, C name, module, class)`: a row of [`_exception_table`].
type ExceptionRow = (
    Option<i32>,
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
);

/// The exception table as the package uses it, for its tests (`tests/test_errors.py`): a row
/// `(code, C name, module, class)` per status (`None` for the module and class of `MEMPOOL_SUCCESS`),
/// then `(None, None, "mempool._errors", class)` per class only mempool-ipc's errors have.
#[pyfunction]
fn _exception_table() -> Vec<ExceptionRow> {
    let statuses = Status::ALL.iter().map(|s| {
        let exc = s.python_exception();
        (
            Some(*s as i32),
            Some(s.name()),
            exc.map(|e| e.module),
            exc.map(|e| e.class),
        )
    });
    let ipc = IpcClass::ALL
        .iter()
        .map(|c| (None, None, Some("mempool._errors"), Some(c.name())));
    statuses.chain(ipc).collect()
}

/// The exception [`to_py`] raises for an error of status `code`, with `message` (for the tests: it goes
/// through the same lookup). A code that is no status is a `ValueError`.
#[pyfunction]
fn _exception_for_status(code: i32, message: String) -> PyErr {
    match Status::from_code(code) {
        Some(status) => of_status(status, message),
        None => pyo3::exceptions::PyValueError::new_err(format!("{code} is not a mempool status code")),
    }
}

/// Adds the test hooks above to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_exception_table, m)?)?;
    m.add_function(wrap_pyfunction!(_exception_for_status, m)?)?;
    Ok(())
}
