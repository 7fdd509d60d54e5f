//! `mempool.ipc.Importer`: a connection to an exporter, receiving buffers.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use mempool_core::{Context, Stream};
use mempool_ipc::{ConnectionOptions, ImporterOptions};

use super::buffers::PyImportedBuffer;
use super::common::{no_pickle, policy, seconds, static_ref};
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
}

impl PyImporter {
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
    #[pyo3(signature = (path, *, timeout = 5.0, io_timeout = 10.0, allow_uids = None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        timeout: f64,
        io_timeout: f64,
        allow_uids: Option<Vec<u32>>,
    ) -> PyResult<Self> {
        let options = ImporterOptions {
            connection: ConnectionOptions {
                io_timeout: seconds("io_timeout", io_timeout, false)?,
                handshake_timeout: seconds("timeout", timeout, false)?,
            },
            policy: policy(allow_uids),
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
    /// Ctrl-C). `PeerGoneError` once the exporter has said Goodbye, closed the connection or died;
    /// `IpcTimeoutError` after `timeout`.
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyImportedBuffer> {
        let deadline = match timeout {
            Some(t) => Some(Instant::now() + seconds("timeout", t, true)?),
            None => None,
        };
        let importer = self.handle()?;
        // SAFETY: the buffer received below holds `self.stream` (dropped after the buffer), and the view is
        // used only through the buffer.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        const SLICE: Duration = Duration::from_millis(200);
        loop {
            let wait = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
            match py.detach(|| importer.recv_timeout(s, wait)) {
                Ok(buf) => {
                    let view = RawView {
                        addr: buf.ptr().as_raw(),
                        size: buf.len(),
                        device: self.device,
                        stream: self.stream.as_raw() as usize,
                    };
                    return Ok(PyImportedBuffer {
                        id: buf.id().0,
                        buf: Mutex::new(Some(buf)),
                        _stream: self.stream.clone(),
                        ctx: self.ctx.clone(),
                        view,
                    });
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
