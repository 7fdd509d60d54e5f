//! The Python half of CuPy's C allocator (`mempool.allocators.cupy.mempool_cupy_c_allocator`): the
//! [`CupyParam`] that mempool-capi's `mempool_cupy_malloc` and `mempool_cupy_free` are called with, built
//! once per process and never freed (CuPy keeps its address in every memory object it made).
//!
//! - `current_stream`: CuPy's own C function for the calling thread's current stream,
//!   `get_current_stream_ptr` of `cupy_backends.cuda.stream` (`cupy.cuda.stream` in old CuPy), taken from
//!   the module's `__pyx_capi__` (where Cython exports the functions other Cython modules `cimport`). It
//!   reads CuPy's thread-local stream without running Python code, honours `with stream:` and
//!   `CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`, and needs the GIL (CuPy holds it when it allocates).
//! - `hold` / `release`: a stream other than the default ones is kept alive while memory allocated on it
//!   lives (CuPy destroys a stream when its object is collected, and the free is ordered on that stream):
//!   `hold` takes a reference to `cupy.cuda.get_current_stream()`, checked to be the stream the C
//!   function reported, and `release` drops it. Only these allocations run Python code.
//! - `raise`: a failed allocation sets the Python exception of its status (`OutOfMemoryError` is also a
//!   `MemoryError`), unless one is pending already (the stream getter's or `hold`'s, kept as the cause).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict};

use mempool_capi::cupy_param::{CupyParam, CurrentStream};
use mempool_capi::Status;

use crate::errors;

/// `cupy.cuda.get_current_stream`, imported once (by `hold`).
static GET_CURRENT_STREAM: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The address of the process's one `CupyParam`, made by the first `_cupy_c_allocator` call.
static PARAM: PyOnceLock<usize> = PyOnceLock::new();

/// The modules, newest CuPy first, whose `__pyx_capi__` may hold `get_current_stream_ptr`.
const STREAM_MODULES: [&str; 2] = ["cupy_backends.cuda.stream", "cupy.cuda.stream"];

fn held_stream(py: Python<'_>, stream: isize) -> PyResult<Py<PyAny>> {
    let get = GET_CURRENT_STREAM.get_or_try_init(py, || {
        PyResult::Ok(py.import("cupy.cuda")?.getattr("get_current_stream")?.unbind())
    })?;
    let s = get.call0(py)?;
    let ptr: isize = s.getattr(py, "ptr")?.extract(py)?;
    if ptr != stream {
        return Err(PyRuntimeError::new_err(format!(
            "CuPy's current stream object ({ptr:#x}) is not the stream its C function reports ({stream:#x})"
        )));
    }
    Ok(s)
}

// The three callbacks are `extern "C"`: a panic may not leave them (it would abort the process), so each
// body runs under `catch_unwind`, and a panic takes the callback's failure path instead.

/// `hold`: a new reference to CuPy's current stream object (the token), or null with a Python exception set.
/// Null also after a panic (the allocation then fails with mempool-capi's message, through `raise`).
#[allow(unsafe_code)]
unsafe extern "C" fn hold(stream: isize) -> *mut c_void {
    catch_unwind(|| {
        Python::attach(|py| match held_stream(py, stream) {
            Ok(s) => s.into_ptr() as *mut c_void,
            Err(e) => {
                e.restore(py);
                std::ptr::null_mut()
            }
        })
    })
    .unwrap_or(std::ptr::null_mut())
}

/// `release`: drops the reference `hold` returned. After a panic before the drop the reference is leaked
/// (the stream object lives on), which is all a panic there can cost.
#[allow(unsafe_code)]
unsafe extern "C" fn release(token: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        Python::attach(|py| {
            // SAFETY: `token` is the strong reference `hold` made with `into_ptr`, released once
            // (mempool-capi drops the allocation's entry before calling this).
            drop(unsafe { Bound::<PyAny>::from_owned_ptr(py, token as *mut pyo3::ffi::PyObject) });
        })
    }));
}

/// `raise`: sets the exception of `status` with `message`, unless one is pending. After a panic it sets a
/// `RuntimeError` saying so, if none is pending (mempool-capi returns `(void*)-1`, which CuPy takes for a
/// failure only with an exception pending), and nothing if that panics too.
#[allow(unsafe_code)]
unsafe extern "C" fn raise(status: c_int, message: *const c_char) {
    let raised = catch_unwind(AssertUnwindSafe(|| {
        Python::attach(|py| {
            if PyErr::occurred(py) {
                return;
            }
            // SAFETY: mempool-capi passes its NUL-terminated last-error message, live for this call.
            let message = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
            let status = Status::from_code(status).unwrap_or(Status::Driver);
            errors::of_status(status, message).restore(py);
        })
    }));
    if raised.is_err() {
        let _ = catch_unwind(|| {
            Python::attach(|py| {
                if !PyErr::occurred(py) {
                    PyRuntimeError::new_err("mempool could not allocate for CuPy (and panicked reporting why)")
                        .restore(py);
                }
            })
        });
    }
}

/// CuPy's `get_current_stream_ptr` from the `__pyx_capi__` of the first of [`STREAM_MODULES`] that has it.
fn current_stream_function(py: Python<'_>) -> PyResult<CurrentStream> {
    let mut looked = Vec::new();
    for module in STREAM_MODULES {
        let Ok(m) = py.import(module) else {
            looked.push(format!("{module} (not importable)"));
            continue;
        };
        let Ok(capi) = m.getattr("__pyx_capi__") else {
            looked.push(format!("{module} (no __pyx_capi__)"));
            continue;
        };
        let capi = capi
            .cast::<PyDict>()
            .map_err(|_| PyRuntimeError::new_err(format!("{module}.__pyx_capi__ is not a dict")))?;
        let Some(capsule) = capi.get_item("get_current_stream_ptr")? else {
            looked.push(format!("{module} (no get_current_stream_ptr)"));
            continue;
        };
        let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
            PyRuntimeError::new_err(format!(
                "{module}.__pyx_capi__['get_current_stream_ptr'] is not a capsule"
            ))
        })?;
        let name = capsule.name()?.ok_or_else(|| {
            PyRuntimeError::new_err(format!("{module}'s get_current_stream_ptr capsule has no signature"))
        })?;
        // SAFETY: the name is read at once, while nothing else runs (Cython's signature strings are static).
        #[allow(unsafe_code)]
        let signature = unsafe { name.as_cstr() }.to_string_lossy().into_owned();
        // Cython names the capsule by the function's C signature, `intptr_t (void)`: a function of no
        // arguments returning an integer the size of a pointer.
        let args = signature
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(args, _)| args.trim());
        let ret = signature.split('(').next().unwrap_or("").trim();
        if !matches!(args, Some("void") | Some("")) || !matches!(ret, "intptr_t" | "Py_ssize_t" | "ssize_t") {
            return Err(PyRuntimeError::new_err(format!(
                "{module}'s get_current_stream_ptr has the signature {signature:?}, not `intptr_t (void)`; \
                 use mempool_cupy_allocator (the Python hook) with this CuPy"
            )));
        }
        // SAFETY: as above, the name is the capsule's own, read now.
        #[allow(unsafe_code)]
        let pointer = capsule.pointer_checked(Some(unsafe { name.as_cstr() }))?;
        // SAFETY: Cython's export of `intptr_t get_current_stream_ptr(void)` (its signature checked above;
        // `intptr_t` and `isize` are the same type on every platform Rust and CUDA share), a function of
        // CuPy's extension module, loaded for the rest of the process.
        #[allow(unsafe_code)]
        let f = unsafe { std::mem::transmute::<*mut c_void, CurrentStream>(pointer.as_ptr()) };
        return Ok(f);
    }
    Err(PyRuntimeError::new_err(format!(
        "this CuPy exports no C function for its current stream (looked in {}); use mempool_cupy_allocator \
         (the Python hook) with this CuPy",
        looked.join(", ")
    )))
}

/// `(param, malloc, free)`: the addresses `cupy.cuda.memory.CFunctionAllocator` takes (see the module
/// documentation). Imports CuPy on the first call.
#[pyfunction]
fn _cupy_c_allocator(py: Python<'_>) -> PyResult<(usize, usize, usize)> {
    let param = *PARAM.get_or_try_init(py, || {
        let p = CupyParam {
            current_stream: Some(current_stream_function(py)?),
            hold: Some(hold),
            release: Some(release),
            raise: Some(raise),
        };
        // Leaked: CuPy's memory objects keep the address for as long as they live, past any allocator.
        PyResult::Ok(Box::leak(Box::new(p)) as *const CupyParam as usize)
    })?;
    Ok((
        param,
        mempool_capi::cupy::mempool_cupy_malloc as *const () as usize,
        mempool_capi::cupy::mempool_cupy_free as *const () as usize,
    ))
}

/// `(live allocations, failed allocations, refused or failed frees)` of CuPy's C allocator in this process.
#[pyfunction]
fn _cupy_allocator_state() -> (usize, u64, u64) {
    mempool_capi::cupy::state()
}

/// `(stream, size)` that the live allocation at `ptr` of CuPy's C allocator was made with, or `None`.
#[pyfunction]
fn _cupy_allocation(ptr: u64) -> Option<(usize, usize)> {
    mempool_capi::cupy::allocation(ptr)
}

/// Adds this module's functions to `mempool._lib`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_cupy_c_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(_cupy_allocator_state, m)?)?;
    m.add_function(wrap_pyfunction!(_cupy_allocation, m)?)?;
    Ok(())
}
