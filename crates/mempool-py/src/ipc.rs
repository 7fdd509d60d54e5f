//! `mempool.ipc`: sharing device buffers between processes, over mempool-ipc.
//!
//! - [`PyExporter`] (`mempool.ipc.Exporter`) serves an exportable pool on a Unix socket and shares
//!   [`PyExportedBuffer`]s (`mempool.ipc.ExportedBuffer`) with the importers connected to it.
//! - [`PyImporter`] (`mempool.ipc.Importer`) connects to a socket path and receives
//!   [`PyImportedBuffer`]s (`mempool.ipc.ImportedBuffer`): views of the exporter's memory whose lease is
//!   released when the object and every view made from it (DLPack, CUDA array interface) are gone.
//!
//! Every blocking call (connecting, waiting for importers or buffers, shutting down, releasing a buffer)
//! runs with the GIL released. None of these objects can be pickled: what crosses to another process is
//! the socket path.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt};

use mempool_core::{Context, HandleTypes, MemPool, PoolProps, Stream, StreamRef};
use mempool_ipc::{AccessPolicy, ConnectionConfig, ExporterOptions, ImporterId, ImporterOptions, ListenerOptions};
use mempool_rmm::{AsyncResource, MemoryResource, SharedResource};

use crate::buffer::{cai, dlpack, order_streams, DeviceBuffer, RawView};
use crate::errors::{ipc_to_py, named, IntoPy, IpcIntoPy};
use crate::mr::{CudaAsyncMemoryResource, PyResource};
use crate::stream;

/// A view of `stream` that the borrow checker does not tie to it.
///
/// # Safety
/// 1. The caller keeps `stream` alive (an `Arc` held next to whatever keeps the view) for as long as the
///    view, or anything made with it, is used: the buffers of this module hold the `Arc` in a field that
///    is dropped after the buffer.
#[allow(unsafe_code)]
unsafe fn static_ref(stream: &Stream) -> StreamRef<'static> {
    // SAFETY: point 1 keeps the stream live for as long as the view is used; the stream is one of the pool's
    // (or importer's) context, which is where mempool-ipc binds it.
    unsafe { StreamRef::from_raw(stream.as_raw()) }
}

fn seconds(name: &str, v: f64, zero_ok: bool) -> PyResult<Duration> {
    if !v.is_finite() || v < 0.0 || (v == 0.0 && !zero_ok) {
        let what = if zero_ok { "a non-negative" } else { "a positive" };
        return Err(PyValueError::new_err(format!(
            "{name} must be {what} number of seconds, got {v}"
        )));
    }
    Duration::try_from_secs_f64(v).map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

fn at_least_one(name: &str, v: usize) -> PyResult<usize> {
    if v == 0 {
        return Err(PyValueError::new_err(format!("{name} must be at least 1")));
    }
    Ok(v)
}

fn policy(allow_uids: Option<Vec<u32>>) -> AccessPolicy {
    allow_uids.map_or(AccessPolicy::SameUser, AccessPolicy::allow_uids)
}

/// The error of pickling (or otherwise copying into another process) one of this module's objects.
fn no_pickle(what: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "mempool.ipc.{what} cannot be pickled or sent to another process: it is a live connection or mapping \
         of this process. Send the socket path (a str) instead, and connect a mempool.ipc.Importer to it in \
         the other process"
    ))
}

/// The bytes of a bytes-like object (C order), copied.
fn host_bytes<'py>(data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let view = data.py().import("builtins")?.getattr("memoryview")?.call1((data,))?;
    Ok(view.call_method0("tobytes")?.cast_into::<PyBytes>()?)
}

static NEXT_EXPORTER: AtomicU64 = AtomicU64::new(1);

/// What `Exporter.alloc` allocates from.
enum Source {
    /// Whole buffers from the exported pool (`Exporter::alloc`).
    Pool,
    /// Buffers suballocated from this resource, whose memory comes from the exported pool
    /// (`Exporter::adopt`).
    Resource(SharedResource),
}

/// Serves an exportable pool on a Unix socket and shares its buffers with importer processes.
#[pyclass(module = "mempool.ipc", name = "Exporter", frozen, weakref)]
pub struct PyExporter {
    exporter: Mutex<Option<Arc<mempool_ipc::Exporter>>>,
    stream: Arc<Stream>,
    source: Source,
    device: usize,
    path: PathBuf,
    serial: u64,
    /// The Python resource shared from, kept alive with the exporter.
    mr: Option<Py<PyAny>>,
}

impl PyExporter {
    fn handle(&self) -> PyResult<Arc<mempool_ipc::Exporter>> {
        self.exporter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| named("IpcError", format!("the exporter at {} is closed", self.path.display())))
    }

    fn make_buffer(&self, size: usize) -> PyResult<PyExportedBuffer> {
        if size == 0 {
            return Err(PyValueError::new_err("a shared buffer needs at least one byte"));
        }
        let exporter = self.handle()?;
        // SAFETY: the buffer made below holds `self.stream` (dropped after the buffer), and the view is used
        // only through the buffer.
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&self.stream) };
        let buf = match &self.source {
            Source::Pool => exporter
                .alloc(size, s)
                .ipc(&format!("allocating a shared buffer of {size} bytes"))?,
            Source::Resource(mr) => {
                let ptr = mr.allocate(size, s).py()?;
                let owner = mr.clone();
                let free = move |p, n, st: StreamRef<'_>| {
                    // SAFETY: the exporter calls this once, with the allocation adopted below (`p`, `n`), after
                    // every use of it is ordered before `st`.
                    #[allow(unsafe_code)]
                    unsafe {
                        owner.deallocate(p, n, st)
                    }
                };
                // SAFETY: (1) `ptr..ptr+size` was just allocated from `mr` and nobody else has it: it is handed
                // over to the exporter here; (2) it was allocated on `s`, the buffer's stream; (3) `free` returns
                // exactly this allocation to `mr`, on the stream the exporter orders the free on, once.
                #[allow(unsafe_code)]
                let adopted = unsafe { exporter.adopt(ptr, size, s, free) };
                match adopted {
                    Ok(buf) => buf,
                    Err(e) => {
                        // SAFETY: the allocation was never handed out (adopt failed) and nothing was queued on
                        // it; it goes back to `mr` on the stream it was allocated on.
                        #[allow(unsafe_code)]
                        let _ = unsafe { mr.deallocate(ptr, size, s) };
                        return Err(ipc_to_py(&format!("sharing a suballocation of {size} bytes"), e));
                    }
                }
            }
        };
        let view = RawView {
            addr: buf.ptr().as_raw(),
            size: buf.len(),
            device: self.device,
            stream: self.stream.as_raw() as usize,
        };
        Ok(PyExportedBuffer {
            buf,
            _stream: self.stream.clone(),
            view,
            exporter: self.serial,
        })
    }
}

/// The value of an `ExporterStats` as a dict.
fn stats_dict<'py>(py: Python<'py>, s: &mempool_ipc::ExporterStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("importers", s.importers)?;
    d.set_item("live_buffers", s.live_buffers)?;
    d.set_item("deferred_buffers", s.deferred_buffers)?;
    d.set_item("blocks", s.blocks)?;
    d.set_item("freed_buffers", s.freed_buffers)?;
    d.set_item("reclaimed_buffers", s.reclaimed_buffers)?;
    d.set_item("abandoned_buffers", s.abandoned_buffers)?;
    d.set_item("handshakes", s.handshakes)?;
    d.set_item("awaiting_exit", s.awaiting_exit)?;
    d.set_item("queued_messages", s.queued_messages)?;
    d.set_item("refused_connections", s.refused_connections)?;
    d.set_item("evicted_handshakes", s.evicted_handshakes)?;
    d.set_item("stalled_importers", s.stalled_importers)?;
    d.set_item("timed_out_connections", s.timed_out_connections)?;
    d.set_item("accept_pauses", s.accept_pauses)?;
    Ok(d)
}

fn importer_dicts<'py>(py: Python<'py>, infos: &[mempool_ipc::ImporterInfo]) -> PyResult<Vec<Bound<'py, PyDict>>> {
    infos
        .iter()
        .map(|i| {
            let d = PyDict::new(py);
            d.set_item("id", i.id.0)?;
            d.set_item("pid", i.credentials.pid)?;
            d.set_item("uid", i.credentials.uid)?;
            d.set_item("gid", i.credentials.gid)?;
            Ok(d)
        })
        .collect()
}

/// The CUDA pool inside `mr` or its upstreams that can be exported, and whether it is `mr` itself.
fn exportable_pool(mr: &Bound<'_, PyResource>) -> PyResult<(Arc<AsyncResource>, bool)> {
    let py = mr.py();
    let mut current = mr.clone();
    let mut top = true;
    loop {
        if let Ok(a) = current.as_any().cast::<CudaAsyncMemoryResource>() {
            return match &a.get().typed {
                Some(t) if t.pool().handle_types().contains(HandleTypes::POSIX_FILE_DESCRIPTOR) => Ok((t.clone(), top)),
                _ => Err(named(
                    "UnsupportedError",
                    "mempool.ipc.Exporter: the resource's pool cannot be exported (it was not made with \
                     enable_ipc=True, or it is the device's default pool); share from \
                     mempool.mr.CudaAsyncMemoryResource(enable_ipc=True) or a resource over one"
                        .into(),
                )),
            };
        }
        let next = match &current.get().upstream {
            Some(u) => u.bind(py).cast::<PyResource>()?.clone(),
            None => break,
        };
        current = next;
        top = false;
    }
    Err(named(
        "UnsupportedError",
        format!(
            "mempool.ipc.Exporter: {} does not allocate from a CUDA pool that can be exported; share from \
             mempool.mr.CudaAsyncMemoryResource(enable_ipc=True) or a resource over one",
            mr.get().inner.name()
        ),
    ))
}

#[pymethods]
impl PyExporter {
    /// The garbage collector sees the resource the exporter keeps (fixed for its life).
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.mr)
    }

    #[new]
    #[pyo3(signature = (
        path, mr = None, *, device = None, max_importers = 256, max_handshakes = 64, send_queue_len = 1024,
        idle_timeout = None, shutdown_timeout = 10.0, io_timeout = 10.0, handshake_timeout = 5.0, mode = 0o600,
        allow_uids = None, replace_stale = true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        mr: Option<&Bound<'_, PyResource>>,
        device: Option<usize>,
        max_importers: usize,
        max_handshakes: usize,
        send_queue_len: usize,
        idle_timeout: Option<f64>,
        shutdown_timeout: f64,
        io_timeout: f64,
        handshake_timeout: f64,
        mode: u32,
        allow_uids: Option<Vec<u32>>,
        replace_stale: bool,
    ) -> PyResult<Self> {
        if mode & !0o777 != 0 {
            return Err(PyValueError::new_err(format!(
                "mode {mode:#o} has bits other than the permission bits 0o777"
            )));
        }
        let options = ExporterOptions {
            listener: ListenerOptions {
                mode,
                policy: policy(allow_uids),
                replace_stale,
                connection: ConnectionConfig {
                    io_timeout: seconds("io_timeout", io_timeout, false)?,
                    handshake_timeout: seconds("handshake_timeout", handshake_timeout, false)?,
                },
            },
            shutdown_timeout: seconds("shutdown_timeout", shutdown_timeout, true)?,
            max_importers: at_least_one("max_importers", max_importers)?,
            max_handshakes: at_least_one("max_handshakes", max_handshakes)?,
            send_queue_len: at_least_one("send_queue_len", send_queue_len)?,
            idle_timeout: idle_timeout.map(|t| seconds("idle_timeout", t, false)).transpose()?,
        };
        let serving = format!("serving a pool at {}", path.display());
        let (exporter, source, device, stream) = match mr {
            None => {
                let d = match device {
                    Some(d) => d,
                    None => mempool_capi::device::current().py()?,
                };
                let dev = mempool_capi::device::device(d).py()?;
                let types = dev.supported_pool_handle_types().py()?;
                if !types.contains(HandleTypes::POSIX_FILE_DESCRIPTOR) {
                    return Err(named(
                        "UnsupportedError",
                        format!("device {d} cannot export pools as POSIX file descriptors (supported: {types:?})"),
                    ));
                }
                let props = PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
                let pool = MemPool::new(&dev, &props).py()?;
                let stream = Arc::new(Stream::new(pool.context()).py()?);
                let exporter = py
                    .detach(|| mempool_ipc::Exporter::new(&path, pool, options))
                    .ipc(&serving)?;
                (exporter, Source::Pool, d, stream)
            }
            Some(mr) => {
                let d = mr.get().device;
                if device.is_some_and(|want| want != d) {
                    return Err(PyValueError::new_err(format!(
                        "device={} but the resource allocates on device {d}",
                        device.unwrap_or_default()
                    )));
                }
                let (typed, top) = exportable_pool(mr)?;
                let stream = Arc::new(Stream::new(typed.pool().context()).py()?);
                let exporter = py
                    .detach(|| mempool_ipc::Exporter::with_pool_in(&path, typed, AsyncResource::pool, options))
                    .ipc(&serving)?;
                let source = if top {
                    Source::Pool
                } else {
                    Source::Resource(mr.get().inner.clone())
                };
                (exporter, source, d, stream)
            }
        };
        Ok(PyExporter {
            exporter: Mutex::new(Some(Arc::new(exporter))),
            stream,
            source,
            device,
            path,
            serial: NEXT_EXPORTER.fetch_add(1, Ordering::Relaxed),
            mr: mr.map(|m| m.clone().into_any().unbind()),
        })
    }

    /// The socket path importers connect to (what to send to another process).
    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    /// The ordinal of the device the pool is on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The resource buffers are allocated from (None: a pool of the exporter's own).
    #[getter]
    fn mr(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.mr.as_ref().map(|m| m.clone_ref(py))
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.exporter.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// A new buffer of `size` bytes (uninitialised) that can be shared: fill it (through DLPack, the CUDA
    /// array interface or `copy_from_host`), then pass it to `share`.
    fn alloc(&self, size: usize) -> PyResult<PyExportedBuffer> {
        self.make_buffer(size)
    }

    /// Shares a buffer with importers and returns it: an `ExportedBuffer` from `alloc`, an int (a new
    /// buffer of that many bytes, uninitialised) or a bytes-like object (a new buffer holding a copy).
    /// `to` is a list of importer ids (default: every importer connected now; none connected: nobody).
    /// `stream` is the stream the work that filled the buffer was queued on (default: the legacy default
    /// stream): importers use the memory only after that work.
    #[pyo3(signature = (buffer, to = None, *, stream = None))]
    fn share<'py>(
        slf: &Bound<'py, Self>,
        buffer: &Bound<'py, PyAny>,
        to: Option<Vec<u64>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyExportedBuffer>> {
        let py = slf.py();
        let this = slf.get();
        let user_stream = stream::extract(stream)?;
        let buf: Bound<'py, PyExportedBuffer> = if let Ok(b) = buffer.cast::<PyExportedBuffer>() {
            if b.get().exporter != this.serial {
                return Err(PyValueError::new_err(
                    "share: the buffer belongs to another Exporter (allocate it with this one's alloc())",
                ));
            }
            b.clone()
        } else if buffer.is_instance_of::<PyInt>() {
            Bound::new(py, this.make_buffer(buffer.extract()?)?)?
        } else if buffer.is_instance_of::<DeviceBuffer>() {
            return Err(PyTypeError::new_err(
                "share: a mempool.DeviceBuffer cannot be shared (its memory is not from the exporter's pool); \
                 allocate with Exporter.alloc(size) and fill that buffer",
            ));
        } else {
            let data = py
                .import("builtins")?
                .getattr("memoryview")?
                .call1((buffer,))
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "share: expected an ExportedBuffer, an int or a bytes-like object, got {}",
                        buffer.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ))
                })?
                .call_method0("tobytes")?
                .cast_into::<PyBytes>()?;
            let b = Bound::new(py, this.make_buffer(data.as_bytes().len())?)?;
            b.get().write(py, 0, data.as_bytes())?;
            b
        };
        order_streams(this.device, user_stream.handle, this.stream.as_raw() as usize)?;
        let exporter = this.handle()?;
        let ids: Vec<ImporterId> = match to {
            Some(ids) => ids.into_iter().map(ImporterId).collect(),
            None => exporter.importers().iter().map(|i| i.id).collect(),
        };
        let shared = buf.get();
        py.detach(|| exporter.share(&shared.buf, &ids))
            .ipc(&format!("sharing buffer {}", shared.buf.id()))?;
        Ok(buf)
    }

    /// The importers connected now: a list of dicts with `id`, `pid`, `uid`, `gid`.
    fn importers<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let infos = self.handle()?.importers();
        importer_dicts(py, &infos)
    }

    /// Waits until at least `count` importers are connected and returns them all (as `importers()`);
    /// `IpcTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (count = 1, timeout = 30.0))]
    fn wait_for_importers<'py>(
        &self,
        py: Python<'py>,
        count: usize,
        timeout: f64,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = seconds("timeout", timeout, true)?;
        let exporter = self.handle()?;
        let infos = py
            .detach(|| exporter.wait_for_importers(count, timeout))
            .ipc("waiting for importers")?;
        importer_dicts(py, &infos)
    }

    /// Waits until every buffer is freed (the exporter and every importer let go, or importers died and
    /// their leases were reclaimed); `IpcTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_idle(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout, true)?;
        let exporter = self.handle()?;
        py.detach(|| exporter.wait_idle(timeout))
            .ipc("waiting for every shared buffer to be freed")
    }

    /// The exporter's bookkeeping: importers, live/deferred/freed/reclaimed buffers, refused connections, ...
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.handle()?.stats())
    }

    /// The exported pool's memory counters: `reserved_current`, `reserved_high`, `used_current`, `used_high`.
    fn pool_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let u = self.handle()?.pool().usage().py()?;
        let d = PyDict::new(py);
        d.set_item("reserved_current", u.reserved_current)?;
        d.set_item("reserved_high", u.reserved_high)?;
        d.set_item("used_current", u.used_current)?;
        d.set_item("used_high", u.used_high)?;
        Ok(d)
    }

    /// Shuts down: removes the socket file, says Goodbye to every importer and waits (at most
    /// `shutdown_timeout`) for them to release what they hold. Returns the messages of the errors met while
    /// freeing buffers and serving connections. Buffers still alive keep working. A second call does
    /// nothing (and returns []).
    fn close(&self, py: Python<'_>) -> Vec<String> {
        let taken = self.exporter.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(exporter) = taken else {
            return Vec::new();
        };
        py.detach(|| match Arc::try_unwrap(exporter) {
            Ok(exporter) => exporter.shutdown().iter().map(ToString::to_string).collect(),
            // Another thread is in a call on it; the shutdown happens when that call returns.
            Err(shared) => {
                drop(shared);
                Vec::new()
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("Exporter"))
    }

    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.Exporter path={:?} device={}{}>",
            self.path.display().to_string(),
            self.device,
            if self.closed() { " closed" } else { "" }
        )
    }
}

impl Drop for PyExporter {
    fn drop(&mut self) {
        let taken = self.exporter.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(exporter) = taken {
            // The shutdown waits for importers: without the GIL.
            Python::attach(|py| py.detach(move || drop(exporter)));
        }
    }
}

/// A buffer of the exporter's pool that can be shared; freed when this object (and every view of it) is
/// gone and every importer has released it.
#[pyclass(module = "mempool.ipc", name = "ExportedBuffer", frozen, weakref)]
pub struct PyExportedBuffer {
    // Field order is drop order: the buffer before the stream it is ordered on.
    buf: mempool_ipc::ExportedBuffer<'static>,
    _stream: Arc<Stream>,
    view: RawView,
    /// The serial of the `PyExporter` that made it.
    exporter: u64,
}

impl PyExportedBuffer {
    fn write(&self, py: Python<'_>, offset: usize, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.buf.copy_from_host(offset, data)).py()
    }
}

#[pymethods]
impl PyExportedBuffer {
    /// The exporter's id of the buffer (what importers see as `ImportedBuffer.id`).
    #[getter]
    fn id(&self) -> u64 {
        self.buf.id().0
    }
    /// The device address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.view.addr
    }
    /// The size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.view.size
    }
    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.view.size
    }
    /// The ordinal of the device.
    #[getter]
    fn device(&self) -> usize {
        self.view.device
    }
    /// The raw handle of the exporter's stream the buffer is ordered on.
    #[getter]
    fn stream(&self) -> usize {
        self.view.stream
    }
    fn __len__(&self) -> usize {
        self.view.size
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
        let v = py.detach(|| self.buf.to_host()).py()?;
        Ok(PyBytes::new(py, &v))
    }
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cai(py, self.view.addr, self.view.size, self.view.stream)
    }
    fn __dlpack_device__(&self) -> (i32, i32) {
        (2, self.view.device as i32)
    }
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let view = slf.get().view;
        let owner = slf.clone().into_any().unbind();
        dlpack(
            slf.py(),
            "mempool.ipc.ExportedBuffer",
            view,
            owner,
            stream,
            max_version,
            dl_device,
            copy,
        )
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
}

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
            connection: ConnectionConfig {
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
    fn receive(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyImportedBuffer> {
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

/// A buffer received from an exporter. Its lease is released when this object and every view made from it
/// (DLPack capsules and the tensors built from them, CUDA-array-interface consumers that keep it) are gone.
#[pyclass(module = "mempool.ipc", name = "ImportedBuffer", frozen, weakref)]
pub struct PyImportedBuffer {
    // Field order is drop order: the buffer before the stream it is ordered on.
    buf: Mutex<Option<mempool_ipc::SharedBuffer<'static>>>,
    _stream: Arc<Stream>,
    ctx: Arc<Context>,
    view: RawView,
    id: u64,
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

#[pymethods]
impl PyImportedBuffer {
    /// The exporter's id of the buffer.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// The device address in this process.
    #[getter]
    fn ptr(&self) -> u64 {
        self.view.addr
    }
    /// The size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.view.size
    }
    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.view.size
    }
    /// The ordinal of the device in this process.
    #[getter]
    fn device(&self) -> usize {
        self.view.device
    }
    /// The raw handle of the importer's stream, which waits for the exporter's work on the buffer.
    #[getter]
    fn stream(&self) -> usize {
        self.view.stream
    }
    fn __len__(&self) -> usize {
        self.view.size
    }
    /// The contents as `bytes` (waits for the work queued on the buffer's stream).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let guard = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let buf = guard
            .as_ref()
            .ok_or_else(|| named("IpcError", "the buffer was released".into()))?;
        let v = py.detach(|| buf.to_host()).py()?;
        Ok(PyBytes::new(py, &v))
    }
    /// Copies `data` (bytes-like) into the buffer at `offset` (the memory is the exporter's: it sees the
    /// write); waits for the copy.
    #[pyo3(signature = (data, offset = 0))]
    fn copy_from_host(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let src = host_bytes(data)?;
        let guard = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let buf = guard
            .as_ref()
            .ok_or_else(|| named("IpcError", "the buffer was released".into()))?;
        let src = src.as_bytes();
        py.detach(|| buf.copy_from_host(offset, src)).py()
    }
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cai(py, self.view.addr, self.view.size, self.view.stream)
    }
    fn __dlpack_device__(&self) -> (i32, i32) {
        (2, self.view.device as i32)
    }
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let view = slf.get().view;
        let owner = slf.clone().into_any().unbind();
        dlpack(
            slf.py(),
            "mempool.ipc.ImportedBuffer",
            view,
            owner,
            stream,
            max_version,
            dl_device,
            copy,
        )
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
}
