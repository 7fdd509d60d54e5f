//! `mempool.ipc.Importer`: a connection to an exporter, receiving buffers.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use mempool_core::{Context, Stream};
use mempool_ipc::{ConnectionOptions, ImporterOptions, Received};

use super::buffers::PyImportedBuffer;
use super::common::{closable_pymethods, policy, seconds, static_ref, wait_in_slices, Closable};
use super::service::PyImportedRange;
use crate::errors::{named, IntoPy, IpcIntoPy};
use crate::view::RawView;

/// A connection to an exporter, with its pool imported.
#[pyclass(module = "mempool.ipc", name = "Importer", frozen, weakref)]
pub struct PyImporter {
    importer: Mutex<Option<mempool_ipc::Importer>>,
    stream: Arc<Stream>,
    ctx: Arc<Context>,
    device: usize,
    path: PathBuf,
    /// Whether ranges of a service resource (`Exporter.share_range`) were asked for.
    accept_ranges: bool,
}

impl PyImporter {
    /// The Python object of a received pool buffer.
    fn wrap(&self, py: Python<'_>, buf: mempool_ipc::SharedBuffer<'static>) -> PyResult<Py<PyAny>> {
        let view = RawView {
            addr: buf.ptr().as_raw(),
            size: buf.len(),
            device: self.device,
            stream: self.stream.as_raw() as usize,
        };
        let buffer = PyImportedBuffer {
            id: buf.id().0,
            buf: Mutex::new(Some(buf)),
            _stream: self.stream.clone(),
            ctx: self.ctx.clone(),
            view,
        };
        Ok(Py::new(py, buffer)?.into_any())
    }

    fn close_importer(&self) {
        let taken = self.importer.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
    }

    fn handle(&self) -> PyResult<mempool_ipc::Importer> {
        self.importer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| named("IpcError", format!("the importer of {} is closed", self.path.display())))
    }
}

closable_pymethods!(PyImporter, path = "The socket path connected to.", closed = "Whether `close()` was called." {
    #[new]
    #[pyo3(signature = (
        path, *, timeout = 5.0, io_timeout = 10.0, allow_uids = None, accept_ranges = false, rings = true
    ))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        timeout: f64,
        io_timeout: f64,
        allow_uids: Option<Vec<u32>>,
        accept_ranges: bool,
        rings: bool,
    ) -> PyResult<Self> {
        let options = ImporterOptions {
            connection: ConnectionOptions {
                io_timeout: seconds("io_timeout", io_timeout, false)?,
                handshake_timeout: seconds("timeout", timeout, false)?,
            },
            policy: policy(allow_uids),
            accept_vmm: accept_ranges,
            rings,
            ..ImporterOptions::default()
        };
        let importer = py
            .detach(|| mempool_ipc::Importer::connect(&path, options))
            .ipc(&format!("connecting to the exporter at {}", path.display()))?;
        let device = importer.device().ordinal();
        let ctx = mempool_capi::device::context(device).py()?;
        let stream = Arc::new(Stream::new(&ctx).py()?);
        Ok(PyImporter {
            importer: Mutex::new(Some(importer)),
            stream,
            ctx,
            device,
            path,
            accept_ranges,
        })
    }

    /// The ordinal, in this process, of the device with the exporter's GPU.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// Whether buffers and releases travel through shared-memory rings (protocol version 3: asked for with
    /// `rings=True`, the default, and offered by the exporter); False: over the socket.
    #[getter]
    fn rings(&self) -> PyResult<bool> {
        Ok(self.handle()?.rings())
    }

    /// Waits for the next buffer (at most `timeout` seconds; None: as long as it takes, interruptible by
    /// Ctrl-C), then takes every buffer that has already arrived behind it, up to `max` in all, without
    /// waiting again: a list of `ImportedBuffer`s, in the order they arrived (one wake-up for a batch the
    /// exporter shared with `share_many`). Pool buffers only. Errors as for `recv`, for the first buffer.
    #[pyo3(signature = (max = 64, timeout = None))]
    fn recv_many(&self, py: Python<'_>, max: usize, timeout: Option<f64>) -> PyResult<Vec<Py<PyAny>>> {
        if max == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "recv_many: max must be at least 1",
            ));
        }
        let importer = self.handle()?;
        // SAFETY: every buffer received below holds `self.stream` (dropped after it), and its view is used
        // only through it.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        let bufs = wait_in_slices(py, timeout, "receiving buffers", |wait| {
            importer.recv_many(s, max, Some(wait))
        })?;
        bufs.into_iter().map(|b| self.wrap(py, b)).collect()
    }

    /// How many buffers this importer holds now.
    #[getter]
    fn held(&self) -> PyResult<usize> {
        Ok(self.handle()?.held())
    }

    /// How many of the exporter's blocks are imported now.
    #[getter]
    fn imported_blocks(&self) -> PyResult<usize> {
        Ok(self.handle()?.imported_blocks())
    }

    /// Waits for the next buffer (at most `timeout` seconds; None: as long as it takes, interruptible by
    /// Ctrl-C): an `ImportedBuffer`, or, with `accept_ranges=True`, an `ImportedRange` when the exporter
    /// shared a service resource's range (`Exporter.share_range`). `PeerGoneError` once the exporter has
    /// said Goodbye, closed the connection or died; `IpcTimeoutError` after `timeout`.
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let importer = self.handle()?;
        // SAFETY: the buffer or range received below holds `self.stream` (dropped after it), and the view is
        // used only through it.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        let accept_ranges = self.accept_ranges;
        let received = wait_in_slices(py, timeout, "receiving a buffer", |wait| {
            if accept_ranges {
                importer.recv_any_timeout(s, wait)
            } else {
                importer.recv_timeout(s, wait).map(Received::Buffer)
            }
        })?;
        match received {
            Received::Buffer(buf) => self.wrap(py, buf),
            Received::VmmRange(range) => {
                let view = RawView {
                    addr: range.ptr().as_raw(),
                    size: range.len(),
                    device: self.device,
                    stream: self.stream.as_raw() as usize,
                };
                let imported = PyImportedRange {
                    id: range.id().0,
                    chunk_sizes: range.chunk_sizes().to_vec(),
                    range: Mutex::new(Some(range)),
                    _stream: self.stream.clone(),
                    ctx: self.ctx.clone(),
                    view,
                };
                Ok(Py::new(py, imported)?.into_any())
            }
            Received::Vmm(v) => {
                // Python has no class for a lone VMM allocation: released at once, and said so.
                let id = v.id();
                py.detach(|| v.release())
                    .ipc("releasing an unexpected VMM allocation")?;
                Err(named(
                    "IpcProtocolError",
                    format!(
                        "the exporter sent VMM allocation {id} (Exporter::share_vmm), which mempool.ipc does \
                         not receive; it was released"
                    ),
                ))
            }
        }
    }

    /// Lets go of the connection: it says Goodbye once every buffer received from it is gone too.
    fn close(&self) {
        self.close_importer();
    }
});

impl Closable for PyImporter {
    const PY_NAME: &'static str = "Importer";

    fn socket_path(&self) -> &Path {
        &self.path
    }

    fn is_closed(&self) -> bool {
        self.importer.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    fn close_now(&self, _py: Python<'_>) {
        self.close_importer();
    }

    fn repr_extra(&self) -> String {
        format!(" device={}", self.device)
    }
}
