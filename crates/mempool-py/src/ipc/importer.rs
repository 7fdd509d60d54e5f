//! `mempool.ipc.Importer`: a connection to an exporter, receiving buffers.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use mempool_core::{Context, Stream};
use mempool_ipc::{ConnectionOptions, ImporterOptions, Received};

use super::buffers::PyImportedBuffer;
use super::common::{no_pickle, policy, seconds, static_ref};
use super::service::PyImportedRange;
use crate::errors::{ipc_to_py, named, IntoPy, IpcIntoPy};
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

    fn handle(&self) -> PyResult<mempool_ipc::Importer> {
        self.importer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| named("IpcError", format!("the importer of {} is closed", self.path.display())))
    }
}

#[pymethods]
impl PyImporter {
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

    /// The socket path connected to.
    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
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
        let deadline = match timeout {
            Some(t) => Some(Instant::now() + seconds("timeout", t, true)?),
            None => None,
        };
        let importer = self.handle()?;
        // SAFETY: every buffer received below holds `self.stream` (dropped after it), and its view is used
        // only through it.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        const SLICE: Duration = Duration::from_millis(200);
        loop {
            let wait = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
            match py.detach(|| importer.recv_many(s, max, Some(wait))) {
                Ok(bufs) => return bufs.into_iter().map(|b| self.wrap(py, b)).collect(),
                Err(mempool_ipc::Error::Timeout { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {
                    py.check_signals()?;
                }
                Err(e) => return Err(ipc_to_py("receiving buffers", e)),
            }
        }
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

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.importer.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Waits for the next buffer (at most `timeout` seconds; None: as long as it takes, interruptible by
    /// Ctrl-C): an `ImportedBuffer`, or, with `accept_ranges=True`, an `ImportedRange` when the exporter
    /// shared a service resource's range (`Exporter.share_range`). `PeerGoneError` once the exporter has
    /// said Goodbye, closed the connection or died; `IpcTimeoutError` after `timeout`.
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let deadline = match timeout {
            Some(t) => Some(Instant::now() + seconds("timeout", t, true)?),
            None => None,
        };
        let importer = self.handle()?;
        // SAFETY: the buffer or range received below holds `self.stream` (dropped after it), and the view is
        // used only through it.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        const SLICE: Duration = Duration::from_millis(200);
        loop {
            let wait = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
            let received = if self.accept_ranges {
                py.detach(|| importer.recv_any_timeout(s, wait))
            } else {
                py.detach(|| importer.recv_timeout(s, wait)).map(Received::Buffer)
            };
            match received {
                Ok(Received::Buffer(buf)) => return self.wrap(py, buf),
                Ok(Received::VmmRange(range)) => {
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
                    return Ok(Py::new(py, imported)?.into_any());
                }
                Ok(Received::Vmm(v)) => {
                    // Python has no class for a lone VMM allocation: released at once, and said so.
                    let id = v.id();
                    py.detach(|| v.release())
                        .ipc("releasing an unexpected VMM allocation")?;
                    return Err(named(
                        "IpcProtocolError",
                        format!(
                            "the exporter sent VMM allocation {id} (Exporter::share_vmm), which mempool.ipc does \
                             not receive; it was released"
                        ),
                    ));
                }
                Err(mempool_ipc::Error::Timeout { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {
                    py.check_signals()?;
                }
                Err(e) => return Err(ipc_to_py("receiving a buffer", e)),
            }
        }
    }

    /// Lets go of the connection: it says Goodbye once every buffer received from it is gone too.
    fn close(&self) {
        let taken = self.importer.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close();
        false
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("Importer"))
    }

    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.Importer path={:?} device={}{}>",
            self.path.display().to_string(),
            self.device,
            if self.closed() { " closed" } else { "" }
        )
    }
}
