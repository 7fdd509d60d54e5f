//! Sharing a service resource's memory: how `mempool.ipc` finds the `ServiceResource` behind a
//! `mempool.mr.ServiceMemoryResource` (or a `TaggedMemoryResource` of one), and
//! `mempool.ipc.ImportedRange`, the importer's view of a range shared with `Exporter.share_range`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use mempool_core::{Context, Stream};
use mempool_rmm::ServiceResource;

use super::common::{bytes_filled, no_pickle};
use crate::errors::{named, IpcIntoPy};
use crate::surface::device_view_pymethods;
use crate::view::{DeviceView, RawView};

/// The `ServiceResource` behind `mr`, or a `TypeError` naming what was given.
pub(crate) fn service_of(mr: &Bound<'_, PyAny>) -> PyResult<Arc<ServiceResource>> {
    crate::mr::service::service_of(mr).ok_or_else(|| {
        let given = mr.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        pyo3::exceptions::PyTypeError::new_err(format!(
            "share_range: mr must be a mempool.mr.ServiceMemoryResource or a TaggedMemoryResource of one, got {given}"
        ))
    })
}

/// A range of another process's service resource (`Exporter.share_range`), mapped here at addresses of
/// this process: chunk after chunk of the owner's physical memory, back to back. It has `ptr`, `size`,
/// `__cuda_array_interface__` and DLPack, so `torch.from_dlpack` views it without a copy. Its lease is
/// released (the range unmapped here, the owner told) when this object and every view made from it are
/// gone; until then the owner's tag cannot sleep.
#[pyclass(module = "mempool.ipc", name = "ImportedRange", frozen, weakref)]
pub struct PyImportedRange {
    // Field order is drop order: the range before the stream it is ordered on.
    pub(super) range: Mutex<Option<mempool_ipc::SharedVmmRange>>,
    pub(super) _stream: Arc<Stream>,
    pub(super) ctx: Arc<Context>,
    pub(super) view: RawView,
    pub(super) id: u64,
    pub(super) chunk_sizes: Vec<usize>,
}

impl Drop for PyImportedRange {
    fn drop(&mut self) {
        let taken = self.range.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(range) = taken {
            let ctx = self.ctx.clone();
            let release = move || {
                // Views may have queued work on any stream of this process (a PyTorch or CuPy stream): wait
                // for all of it before the owner may put the memory to sleep. The range's own drop then
                // waits for the device, unmaps every chunk and sends the release.
                let _ = ctx.synchronize();
                drop(range);
            };
            Python::attach(|py| py.detach(release));
        }
    }
}

impl DeviceView for PyImportedRange {
    const PY_NAME: &'static str = "mempool.ipc.ImportedRange";

    fn raw_view(&self) -> RawView {
        self.view
    }
}

device_view_pymethods!(PyImportedRange {
    /// The owner's id of the range.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// How many physical chunks (allocations of the owner's) the range lies across.
    #[getter]
    fn chunks(&self) -> usize {
        self.chunk_sizes.len()
    }
    /// Each chunk's size in bytes, in address order (a list; the sizes may differ, each a multiple of
    /// the device's VMM granularity). The range starts inside the first and ends inside the last.
    #[getter]
    fn chunk_sizes(&self) -> Vec<usize> {
        self.chunk_sizes.clone()
    }
    /// The contents as `bytes` (waits for the work queued on the range's stream).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let guard = self.range.lock().unwrap_or_else(|p| p.into_inner());
        let range = guard
            .as_ref()
            .ok_or_else(|| named("IpcError", "the range was released".into()))?;
        let stream = self.stream_ref();
        bytes_filled(py, self.view.size, |dst| {
            py.detach(|| range.view(stream).and_then(|v| v.copy_to_host(0, dst).map_err(Into::into)))
                .ipc("copying an imported range to the host")
        })
    }
    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("ImportedRange"))
    }
    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.ImportedRange id={} size={} ptr={:#x} device={} chunks={}>",
            self.id,
            self.view.size,
            self.view.addr,
            self.view.device,
            self.chunk_sizes.len()
        )
    }
});

impl PyImportedRange {
    /// The range's stream, borrowed from `_stream`, which `self` holds.
    fn stream_ref(&self) -> mempool_core::StreamRef<'_> {
        Stream::as_ref(&self._stream)
    }
}
