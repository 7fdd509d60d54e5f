//! Streams from Python: `None` (the legacy default stream), a raw integer handle, an object with the
//! `__cuda_stream__` protocol (returns `(version, handle)`), a PyTorch stream (`.cuda_stream`), a CuPy
//! stream (`.ptr`) or a Numba stream (`.handle`).
//!
//! mempool borrows the stream and never destroys it. A buffer keeps the Python object it was given alive
//! (CuPy and Numba destroy a stream when its object is collected); a raw integer is the caller's promise
//! that the stream outlives the buffer.
//!
//! A raw integer (and the handle any of these objects reports) is an unchecked escape hatch: mempool
//! cannot tell a live stream of the right device from any other number, and passes it to the driver as
//! it is. It exists because DLPack and the CUDA array interface exchange streams as integers.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

/// A stream handle, with the Python object that owns it (kept alive while the handle is used).
pub struct StreamArg {
    /// The raw `CUstream` value; 0 is the legacy default stream.
    pub handle: usize,
    /// The object the handle came from, when it was not `None` or a plain integer.
    pub owner: Option<Py<PyAny>>,
    /// Whether the caller passed a stream other than `None` for a call whose default is not the legacy
    /// stream (set by [`StreamArg::given_if`]; `extract` leaves it false).
    pub given: bool,
}

impl StreamArg {
    /// This stream argument, marked as given when `given`.
    pub fn given_if(self, given: bool) -> StreamArg {
        StreamArg { given, ..self }
    }
}

fn int_handle(v: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if v.is_none() {
        return Ok(0);
    }
    // ctypes.c_void_p (Numba's handle without the NVIDIA binding): its value, None for NULL. One level
    // only: a `.value` that itself has a `.value` is refused, not followed.
    if !v.is_instance_of::<PyInt>() {
        if let Ok(value) = v.getattr("value") {
            if value.is_none() {
                return Ok(0);
            }
            if !value.is_instance_of::<PyInt>() && value.hasattr("value")? {
                return Err(PyTypeError::new_err(format!(
                    "{what}: its .value is a {}, not an integer handle",
                    value.get_type().name()?
                )));
            }
            return int_value(&value, what);
        }
    }
    int_value(v, what)
}

fn int_value(v: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let i: i128 = match v.extract() {
        Ok(i) => i,
        Err(_) => v
            .call_method0("__int__")
            .and_then(|i| i.extract())
            .map_err(|_| PyTypeError::new_err(format!("{what} is not an integer handle")))?,
    };
    usize::try_from(i).map_err(|_| PyValueError::new_err(format!("{what} {i} is not a valid stream handle")))
}

/// Reads a stream argument (see the module documentation).
pub fn extract(obj: Option<&Bound<'_, PyAny>>) -> PyResult<StreamArg> {
    let Some(obj) = obj else {
        return Ok(StreamArg {
            handle: 0,
            owner: None,
            given: false,
        });
    };
    if obj.is_none() {
        return Ok(StreamArg {
            handle: 0,
            owner: None,
            given: false,
        });
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(StreamArg {
            handle: int_handle(obj, "stream")?,
            owner: None,
            given: false,
        });
    }
    let owner = Some(obj.clone().unbind());
    if obj.hasattr("__cuda_stream__")? {
        let t = obj.call_method0("__cuda_stream__")?;
        let t = t
            .cast::<PyTuple>()
            .map_err(|_| PyTypeError::new_err("__cuda_stream__ must return a (version, handle) tuple"))?;
        if t.len() != 2 {
            return Err(PyTypeError::new_err(
                "__cuda_stream__ must return a (version, handle) tuple",
            ));
        }
        return Ok(StreamArg {
            handle: int_handle(&t.get_item(1)?, "__cuda_stream__ handle")?,
            owner,
            given: false,
        });
    }
    for (attr, what) in [
        ("cuda_stream", "torch stream's cuda_stream"),
        ("ptr", "CuPy stream's ptr"),
        ("handle", "Numba stream's handle"),
    ] {
        if let Ok(v) = obj.getattr(attr) {
            return Ok(StreamArg {
                handle: int_handle(&v, what)?,
                owner,
                given: false,
            });
        }
    }
    Err(PyTypeError::new_err(format!(
        "stream must be None, an integer handle, an object with __cuda_stream__, or a PyTorch, CuPy or Numba \
         stream; got {}",
        obj.get_type().name()?
    )))
}
