//! `mempool.memory`'s functions: snapshots of a resource stack as JSON text, the viewer page around a
//! snapshot, the check of a cluster document, and the two stack settings of issue 26 (a recorded history, retry once on out of memory).
//! The Python module (`python/mempool/memory.py`) wraps them.

use pyo3::prelude::*;

use mempool_rmm::observe::{self, History, HistoryResource};
use mempool_rmm::{adaptors::OomRetryAdaptor, SharedResource};
use std::sync::Arc;

use crate::errors::IntoPy;
use crate::mr::PyResource;

/// The snapshot of `mr`'s stack (or, with `mr` None, of the current resource of `device`) as JSON text,
/// with the device's name and memory.
#[pyfunction]
#[pyo3(signature = (mr=None, device=0))]
pub fn _memory_snapshot_json(py: Python<'_>, mr: Option<&Bound<'_, PyResource>>, device: usize) -> PyResult<String> {
    let (shared, device): (SharedResource, usize) = match mr {
        Some(r) => (r.get().inner.clone(), r.get().device),
        None => (mempool_capi::registry::current(device).py()?, device),
    };
    let dev = mempool_capi::device::device(device).py()?;
    let snap = py.detach(|| observe::snapshot_on(&*shared, &dev, "python"));
    Ok(observe::to_json(&snap))
}

/// The viewer page with the snapshot JSON `json` embedded (every `<` escaped).
#[pyfunction]
pub fn _memory_page(json: &str) -> PyResult<String> {
    observe::page_from_json(json).py()
}

/// Checks the cluster document `json` as `observe::read_cluster_json` does (the schema and version, unique
/// worker names, every worker's snapshot); a `ValueError` says why it is not one, naming the worker at fault.
#[pyfunction]
pub fn _memory_cluster_check(py: Python<'_>, json: &str) -> PyResult<()> {
    match py.detach(|| observe::read_cluster_json(json)) {
        Ok(_) => Ok(()),
        Err(mempool_rmm::Error::Unsupported { reason, .. }) => Err(pyo3::exceptions::PyValueError::new_err(reason)),
        Err(e) => Err(pyo3::exceptions::PyValueError::new_err(e.to_string())),
    }
}

/// A resource over `mr` that records its allocations and frees in a history of `capacity` events.
#[pyfunction]
#[pyo3(signature = (mr, capacity=observe::DEFAULT_CAPACITY))]
pub fn _memory_record(py: Python<'_>, mr: &Bound<'_, PyResource>, capacity: usize) -> PyResult<Py<PyResource>> {
    if capacity == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "capacity is 0: a history keeps at least one event",
        ));
    }
    let inner: SharedResource = Arc::new(HistoryResource::with_history(
        mr.get().inner.clone(),
        Arc::new(History::new(capacity)),
    ));
    Py::new(py, PyResource::over(inner, mr))
}

/// A resource over `mr` that, on out of memory, trims the stack, synchronizes the stream and retries once.
#[pyfunction]
pub fn _memory_oom_retry(py: Python<'_>, mr: &Bound<'_, PyResource>) -> PyResult<Py<PyResource>> {
    let inner: SharedResource = Arc::new(OomRetryAdaptor::new(mr.get().inner.clone()));
    Py::new(py, PyResource::over(inner, mr))
}
