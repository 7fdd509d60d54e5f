//! `mempool.ipc.Exporter`: serves an exportable pool and shares buffers of it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt};

use mempool_core::{DeviceAddr, HandleTypes, MemPool, PoolProps, Stream, StreamRef};
use mempool_ipc::{ConnectionOptions, ExporterOptions, ImporterId, ListenerOptions};
use mempool_rmm::{AsyncResource, MemoryResource, SharedResource};

use super::buffers::PyExportedBuffer;
use super::common::{at_least_one, closable_pymethods, policy, seconds, static_ref, Closable};
use super::service::service_of;
use crate::buffer::{host_bytes, DeviceBuffer};
use crate::errors::{ipc_to_py, named, IntoPy, IpcIntoPy};
use crate::mr::{CudaAsyncMemoryResource, PyResource};
use crate::stream;
use crate::view::{order_streams, RawView};

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

    /// What `share` and `share_many` take, as an `ExportedBuffer` of this exporter: one from `alloc`, a new
    /// one of an int's size, or a new one holding a copy of a bytes-like object; `verb` names the caller in
    /// errors.
    fn to_buffer<'py>(
        &self,
        py: Python<'py>,
        buffer: &Bound<'py, PyAny>,
        verb: &str,
    ) -> PyResult<Bound<'py, PyExportedBuffer>> {
        if let Ok(b) = buffer.cast::<PyExportedBuffer>() {
            if b.get().exporter != self.serial {
                return Err(PyValueError::new_err(format!(
                    "{verb}: the buffer belongs to another Exporter (allocate it with this one's alloc())"
                )));
            }
            Ok(b.clone())
        } else if buffer.is_instance_of::<PyInt>() {
            Bound::new(py, self.make_buffer(buffer.extract()?)?)
        } else if buffer.is_instance_of::<DeviceBuffer>() {
            Err(PyTypeError::new_err(format!(
                "{verb}: a mempool.DeviceBuffer cannot be shared (its memory is not from the exporter's pool); \
                 allocate with Exporter.alloc(size) and fill that buffer"
            )))
        } else {
            let data = host_bytes(buffer).map_err(|_| {
                PyTypeError::new_err(format!(
                    "{verb}: expected an ExportedBuffer, an int or a bytes-like object, got {}",
                    buffer.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ))
            })?;
            let b = Bound::new(py, self.make_buffer(data.as_bytes().len())?)?;
            b.get().write(py, 0, data.as_bytes())?;
            Ok(b)
        }
    }
}

/// The importers a share goes to: those of `to`, or by default every importer connected now.
fn recipients(exporter: &mempool_ipc::Exporter, to: Option<Vec<u64>>) -> Vec<ImporterId> {
    match to {
        Some(ids) => ids.into_iter().map(ImporterId).collect(),
        None => exporter.importers().iter().map(|i| i.id).collect(),
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

closable_pymethods!(PyExporter,
    path = "The socket path importers connect to (what to send to another process).",
    closed = "Whether `shutdown()` was called." {
    /// The garbage collector sees the resource the exporter keeps (fixed for its life).
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.mr)
    }

    #[new]
    #[pyo3(signature = (
        path, mr = None, *, device = None, max_importers = 256, max_handshakes = 64, send_queue_len = 1024,
        idle_timeout = None, shutdown_timeout = 10.0, io_timeout = 10.0, handshake_timeout = 5.0, mode = 0o600,
        allow_uids = None, replace_stale = true, rings = true
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
        rings: bool,
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
                connection: ConnectionOptions {
                    io_timeout: seconds("io_timeout", io_timeout, false)?,
                    handshake_timeout: seconds("handshake_timeout", handshake_timeout, false)?,
                },
            },
            shutdown_timeout: seconds("shutdown_timeout", shutdown_timeout, true)?,
            max_importers: at_least_one("max_importers", max_importers)?,
            max_handshakes: at_least_one("max_handshakes", max_handshakes)?,
            send_queue_len: at_least_one("send_queue_len", send_queue_len)?,
            idle_timeout: idle_timeout.map(|t| seconds("idle_timeout", t, false)).transpose()?,
            rings: rings.then(mempool_ipc::ring::Geometry::default),
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

    /// Seconds the exporter's serving thread keeps looking at the importers' rings after traffic
    /// before it sleeps (a release found meanwhile costs no wake-up; the thread uses a CPU while it
    /// looks). Default 50 µs; 0 turns it off.
    #[getter]
    fn spin(&self) -> PyResult<f64> {
        Ok(self.handle()?.spin().as_secs_f64())
    }

    #[setter]
    fn set_spin(&self, seconds_: f64) -> PyResult<()> {
        let spin = seconds("spin", seconds_, true)?;
        self.handle()?.set_spin(spin);
        Ok(())
    }

    /// Seconds `ExportedBuffer.wait_released` looks for its buffer's release before it sleeps.
    /// Default 50 µs; 0 turns it off.
    #[getter]
    fn wait_spin(&self) -> PyResult<f64> {
        Ok(self.handle()?.wait_spin().as_secs_f64())
    }

    #[setter]
    fn set_wait_spin(&self, seconds_: f64) -> PyResult<()> {
        let spin = seconds("wait_spin", seconds_, true)?;
        self.handle()?.set_wait_spin(spin);
        Ok(())
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
        let buf = this.to_buffer(py, buffer, "share")?;
        order_streams(this.device, user_stream.handle, this.stream.as_raw() as usize)?;
        let exporter = this.handle()?;
        let ids = recipients(&exporter, to);
        let shared = buf.get();
        py.detach(|| exporter.share(&shared.buf, &ids))
            .ipc(&format!("sharing buffer {}", shared.buf.id()))?;
        Ok(buf)
    }

    /// Shares several buffers with importers at once and returns them, in order: each item as `share`
    /// takes it (an `ExportedBuffer`, an int or a bytes-like object). The buffers go out together (in one
    /// go through each importer's shared-memory ring, where the importer has one), so an importer waiting
    /// in `recv_many` wakes once for the lot. `to` and `stream` as for `share`: every buffer's use by the
    /// importers is ordered after the work queued on `stream` before this call. A failure names the buffer;
    /// those before it were shared.
    #[pyo3(signature = (buffers, to = None, *, stream = None))]
    fn share_many<'py>(
        slf: &Bound<'py, Self>,
        buffers: Vec<Bound<'py, PyAny>>,
        to: Option<Vec<u64>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyExportedBuffer>>> {
        let py = slf.py();
        let this = slf.get();
        let user_stream = stream::extract(stream)?;
        let bufs = buffers
            .iter()
            .map(|b| this.to_buffer(py, b, "share_many"))
            .collect::<PyResult<Vec<_>>>()?;
        order_streams(this.device, user_stream.handle, this.stream.as_raw() as usize)?;
        let exporter = this.handle()?;
        let ids = recipients(&exporter, to);
        {
            let refs: Vec<_> = bufs.iter().map(|b| b.get()).collect();
            let shared: Vec<&mempool_ipc::ExportedBuffer<'static>> = refs.iter().map(|b| &b.buf).collect();
            py.detach(|| exporter.share_many(&shared, &ids))
                .ipc(&format!("sharing {} buffers", shared.len()))?;
        }
        Ok(bufs)
    }

    /// Shares the memory of `buffer` (a `mempool.DeviceBuffer`
    /// Shares the memory of `buffer` (a `mempool.DeviceBuffer`, or any object with `ptr` and `size`)
    /// allocated from `mr`, a `mempool.mr.ServiceMemoryResource` (or a `TaggedMemoryResource` of one) on
    /// this exporter's device, with importers that passed `accept_ranges=True`: they receive an
    /// `ImportedRange` mapping the same physical memory at addresses of their own. `to` is a list of
    /// importer ids (default: every importer connected now). `stream` is the stream the work that filled
    /// the buffer was queued on (default: the legacy default stream): importers use the memory only after
    /// that work. Returns the range's id.
    ///
    /// Until every importer has let go of it (released it, or died), the buffer is kept alive and its
    /// tag cannot sleep (`sleep` raises, naming why); then both are let go. Errors: a resource that is not a
    /// service resource, a buffer outside it or across two tags, a sleeping tag, an importer that did not
    /// accept ranges or is not connected.
    #[pyo3(signature = (mr, buffer, to = None, *, stream = None))]
    fn share_range<'py>(
        slf: &Bound<'py, Self>,
        mr: &Bound<'py, PyAny>,
        buffer: &Bound<'py, PyAny>,
        to: Option<Vec<u64>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<u64> {
        let py = slf.py();
        let this = slf.get();
        let service = service_of(mr)?;
        let user_stream = stream::extract(stream)?;
        let ptr: u64 = buffer.getattr("ptr")?.extract()?;
        let size: usize = buffer.getattr("size")?.extract()?;
        let export = service.export(DeviceAddr(ptr), size).py()?;
        order_streams(this.device, user_stream.handle, this.stream.as_raw() as usize)?;
        let exporter = this.handle()?;
        let ids = recipients(&exporter, to);
        let chunks = export.chunks().to_vec();
        let offset = export.offset();
        // The exporter keeps both until the last importer let go: the export keeps the tag awake, the
        // buffer object keeps the allocation from being freed and handed out again meanwhile.
        let hold: Box<dyn Send + Sync> = Box::new((export, buffer.clone().unbind()));
        // SAFETY: `self.stream` outlives the call, the only use of the view (the exporter records an event
        // on it and, when no importer took the range, queues the hold's release after it).
        #[allow(unsafe_code)]
        let s = unsafe { static_ref(&this.stream) };
        let id = py
            .detach(|| exporter.share_vmm_chunks(&chunks, offset, size, hold, s, &ids))
            .ipc(&format!("sharing {size} bytes at {ptr:#x} of a service resource"))?;
        Ok(id.0)
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
    /// nothing (and returns []). mempool-ipc's `Exporter::shutdown`; leaving a `with` block calls it.
    fn shutdown(&self, py: Python<'_>) -> Vec<String> {
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
});

impl Closable for PyExporter {
    const PY_NAME: &'static str = "Exporter";

    fn socket_path(&self) -> &Path {
        &self.path
    }

    fn is_closed(&self) -> bool {
        self.exporter.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    fn close_now(&self, py: Python<'_>) {
        self.shutdown(py);
    }

    fn repr_extra(&self) -> String {
        format!(" device={}", self.device)
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
