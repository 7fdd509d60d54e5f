//! [`PyResource`] (`mempool.mr.DeviceMemoryResource`), the base class every resource class extends, and
//! the helpers the resource classes share.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

use mempool_rmm::SharedResource;

use crate::errors::IntoPy;
/// The base of every resource (RMM's `DeviceMemoryResource`; allocate from one with
/// `mempool.DeviceBuffer(size=, mr=)`): the Rust resource, the device it allocates
/// on, and the Python upstream it keeps alive.
#[pyclass(module = "mempool.mr", name = "DeviceMemoryResource", subclass, frozen, weakref)]
pub struct PyResource {
    pub(crate) inner: SharedResource,
    pub(crate) device: usize,
    pub(crate) upstream: Option<Py<PyAny>>,
}

impl PyResource {
    pub(crate) fn leaf(inner: SharedResource, device: usize) -> PyClassInitializer<PyResource> {
        PyClassInitializer::from(PyResource {
            inner,
            device,
            upstream: None,
        })
    }
    pub(crate) fn over(inner: SharedResource, upstream: &Bound<'_, PyResource>) -> PyClassInitializer<PyResource> {
        PyClassInitializer::from(PyResource {
            inner,
            device: upstream.get().device,
            upstream: Some(upstream.clone().into_any().unbind()),
        })
    }
}

#[pymethods]
impl PyResource {
    /// The upstream resource (None for a resource that allocates from the driver).
    #[getter]
    fn upstream_mr(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.upstream.as_ref().map(|u| u.clone_ref(py))
    }
    /// The upstream resource (RMM's `get_upstream()`).
    fn get_upstream(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.upstream_mr(py)
    }
    /// The ordinal of the device the resource allocates on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }
    /// mempool-rmm's name of the Rust resource (`PoolResource`, `StatisticsAdaptor`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    /// A new handle of mempool's C ABI (`mempool_resource_t*`, as an address) to this resource, for the RMM
    /// bridge (docs/rmm.md): whoever takes it releases it with `mempool_resource_destroy` (an address from
    /// `mempool._lib._capi_functions()`). The resource lives while the handle does.
    fn _capi_handle(&self) -> usize {
        mempool_capi::ffi::new_handle(self.inner.clone(), self.device) as usize
    }
    /// The garbage collector sees the upstream (fixed for the resource's life, so nothing to clear:
    /// cycles through it are broken by the objects that can clear, such as a failure callback).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.upstream)
    }
    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        Ok(format!(
            "<mempool.mr.{} device={} ({})>",
            slf.get_type().name()?,
            slf.get().device,
            slf.get().inner.name()
        ))
    }
}

pub(crate) fn device_or_current(device: Option<usize>) -> PyResult<usize> {
    match device {
        Some(d) => {
            mempool_capi::device::device(d).py()?;
            Ok(d)
        }
        None => mempool_capi::device::current().py(),
    }
}

/// Half the free memory of `device`, aligned down to 256 bytes: RMM's default initial pool size.
pub(crate) fn half_free(device: usize) -> PyResult<usize> {
    let ctx = mempool_capi::device::context(device).py()?;
    let info = ctx.memory_info().py()?;
    Ok((info.free / 2) & !255)
}

/// The device whose memory `upstream` hands out.
pub(crate) fn upstream_device(upstream: &Bound<'_, PyResource>) -> PyResult<mempool_core::Device> {
    mempool_capi::device::device(upstream.get().device).py()
}
