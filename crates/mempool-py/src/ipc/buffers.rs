//! `mempool.ipc.ExportedBuffer` and `mempool.ipc.ImportedBuffer`: their own methods here; `ptr`, `size`,
//! `nbytes`, `device`, `stream`, `len()`, the CUDA array interface and DLPack are [`crate::view`]'s, shared
//! with `mempool.DeviceBuffer`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use mempool_core::{Context, Stream};

use super::common::{bytes_filled, no_pickle, seconds};
use crate::buffer::host_bytes;
use crate::errors::{named, IntoPy, IpcIntoPy};
use crate::surface::device_view_pymethods;
use crate::view::{DeviceView, RawView};

/// A buffer of the exporter's pool that can be shared; freed when this object (and every view of it) is
/// gone and every importer has released it.
#[pyclass(module = "mempool.ipc", name = "ExportedBuffer", frozen, weakref)]
pub struct PyExportedBuffer {
    // Field order is drop order: the buffer before the stream it is ordered on.
    pub(super) buf: mempool_ipc::ExportedBuffer<'static>,
    pub(super) _stream: Arc<Stream>,
    pub(super) view: RawView,
    /// The serial of the `PyExporter` that made it.
    pub(super) exporter: u64,
}

impl PyExportedBuffer {
    pub(super) fn write(&self, py: Python<'_>, offset: usize, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.buf.copy_from_host(offset, data)).py()
    }
}

impl DeviceView for PyExportedBuffer {
    const PY_NAME: &'static str = "mempool.ipc.ExportedBuffer";

    fn raw_view(&self) -> RawView {
        self.view
    }
}

device_view_pymethods!(PyExportedBuffer {
    /// The exporter's id of the buffer (what importers see as `ImportedBuffer.id`).
    #[getter]
    fn id(&self) -> u64 {
        self.buf.id().0
    }
    /// The ids of the importers holding the buffer now.
    fn holders(&self) -> Vec<u64> {
        self.buf.holders().into_iter().map(|i| i.0).collect()
    }
    /// Waits until no importer holds the buffer; `IpcTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_released(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout, true)?;
        py.detach(|| self.buf.wait_released(timeout))
            .ipc(&format!("waiting for importers to release buffer {}", self.buf.id()))
    }
    /// Copies `data` (bytes-like) into the buffer at `offset`; waits for the copy.
    #[pyo3(signature = (data, offset = 0))]
    fn copy_from_host(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let src = host_bytes(data)?;
        self.write(py, offset, src.as_bytes())
    }
    /// The contents as `bytes` (waits for the work queued on the buffer's stream).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        bytes_filled(py, self.view.size, |dst| py.detach(|| self.buf.copy_to_host(0, dst)).py())
    }
    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("ExportedBuffer"))
    }
    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.ExportedBuffer id={} size={} ptr={:#x} device={}>",
            self.buf.id(),
            self.view.size,
            self.view.addr,
            self.view.device
        )
    }
});

/// A buffer received from an exporter. Its lease is released when this object and every view made from it
/// (DLPack capsules and the tensors built from them, CUDA-array-interface consumers that keep it) are gone.
#[pyclass(module = "mempool.ipc", name = "ImportedBuffer", frozen, weakref)]
pub struct PyImportedBuffer {
    // Field order is drop order: the buffer before the stream it is ordered on.
    pub(super) buf: Mutex<Option<mempool_ipc::SharedBuffer<'static>>>,
    pub(super) _stream: Arc<Stream>,
    pub(super) ctx: Arc<Context>,
    pub(super) view: RawView,
    pub(super) id: u64,
}

impl Drop for PyImportedBuffer {
    fn drop(&mut self) {
        let taken = self.buf.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(buf) = taken {
            let ctx = self.ctx.clone();
            let release = move || {
                // Views may have queued work on any stream of this process (a PyTorch or CuPy stream): wait for
                // all of it before the exporter may reuse the memory. The buffer's own drop then waits for its
                // stream, frees the import and sends the release. Errors of a broken context are left to it.
                let _ = ctx.synchronize();
                drop(buf);
            };
            Python::attach(|py| py.detach(release));
        }
    }
}

impl PyImportedBuffer {
    /// Runs `f` on the imported buffer (with the interpreter released); `IpcError` once it was released.
    fn with_buf<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mempool_ipc::SharedBuffer<'static>) -> R + Send,
    ) -> PyResult<R> {
        let guard = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let buf = guard
            .as_ref()
            .ok_or_else(|| named("IpcError", "the buffer was released".into()))?;
        Ok(py.detach(|| f(buf)))
    }
}

impl DeviceView for PyImportedBuffer {
    const PY_NAME: &'static str = "mempool.ipc.ImportedBuffer";

    fn raw_view(&self) -> RawView {
        self.view
    }
}

device_view_pymethods!(PyImportedBuffer {
    /// The exporter's id of the buffer.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// The contents as `bytes` (waits for the work queued on the buffer's stream).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        bytes_filled(py, self.view.size, |dst| {
            self.with_buf(py, |buf| buf.copy_to_host(0, dst)).and_then(|r| r.py())
        })
    }
    /// Copies `data` (bytes-like) into the buffer at `offset` (the memory is the exporter's: it sees the
    /// write); waits for the copy.
    #[pyo3(signature = (data, offset = 0))]
    fn copy_from_host(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let src = host_bytes(data)?;
        let src = src.as_bytes();
        self.with_buf(py, |buf| buf.copy_from_host(offset, src))?.py()
    }
    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("ImportedBuffer"))
    }
    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.ImportedBuffer id={} size={} ptr={:#x} device={}>",
            self.id, self.view.size, self.view.addr, self.view.device
        )
    }
});
