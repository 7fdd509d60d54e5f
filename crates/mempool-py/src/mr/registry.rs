//! The per-device current resource: `set_per_device_resource` and `get_per_device_resource` over
//! mempool-capi's registry (shared with the C ABI and PyTorch's allocator).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use mempool_rmm::SharedResource;

use super::base::PyResource;
use super::resources::CudaAsyncMemoryResource;
use crate::errors::IntoPy;

/// The Python objects set as each device's resource, so that `get_per_device_resource` returns the object
/// that was set (RMM's behaviour), as long as the registry still holds its resource.
static CURRENT: Mutex<Option<HashMap<usize, Py<PyAny>>>> = Mutex::new(None);

fn same(a: &SharedResource, b: &SharedResource) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Makes `mr` the current resource of `device`. Refuses a resource made for another device.
#[pyfunction]
pub fn set_per_device_resource(device: usize, mr: &Bound<'_, PyResource>) -> PyResult<()> {
    let r = mr.get();
    if r.device != device {
        return Err(PyValueError::new_err(format!(
            "the resource allocates on device {}, not on device {device}",
            r.device
        )));
    }
    let previous = mempool_capi::registry::set(device, r.inner.clone()).py()?;
    let replaced = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(device, mr.clone().into_any().unbind());
    // Dropped after the lock is released: the last reference to a resource can run Python code (a
    // failure callback's finalizer, a logging adaptor's flush).
    drop((replaced, previous));
    Ok(())
}

/// The current resource of `device`: the object set, or (the registry's default, or a resource set from
/// C) an object over it: a `CudaAsyncMemoryResource` for the default, a `DeviceMemoryResource` otherwise.
#[pyfunction]
pub fn get_per_device_resource(py: Python<'_>, device: usize) -> PyResult<Py<PyAny>> {
    let shared = mempool_capi::registry::current(device).py()?;
    let set = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&device)
        .map(|o| o.clone_ref(py));
    if let Some(obj) = &set {
        if let Ok(r) = obj.bind(py).cast::<PyResource>() {
            if same(&r.get().inner, &shared) {
                return Ok(obj.clone_ref(py));
            }
        }
    }
    // Built with the lock released (making a Python object can run Python code).
    // The registry's default is an `AsyncResource`, under the `HistoryResource` that records it.
    let is_async = |r: &dyn mempool_rmm::MemoryResource| r.name() == "AsyncResource";
    let obj = if is_async(&*shared)
        || (shared.name() == "HistoryResource" && shared.upstream_resource().is_some_and(is_async))
    {
        Bound::new(py, CudaAsyncMemoryResource::wrap(shared, device))?
            .into_any()
            .unbind()
    } else {
        Bound::new(py, PyResource::leaf(shared, device))?.into_any().unbind()
    };
    let replaced = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(device, obj.clone_ref(py));
    drop((replaced, set)); // after the lock is released
    Ok(obj)
}
