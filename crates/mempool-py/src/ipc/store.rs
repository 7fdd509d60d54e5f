//! `mempool.ipc.Client`, `mempool.ipc.serve`: the memory store of `mempool_store` (named GPU
//! buffers held by a server process, attached by name after a crash or restart).
//!
//! - [`PyClient`] (`mempool.ipc.Client`): one connection; `create` returns a [`PyCreatedBuffer`]
//!   (`mempool.ipc.CreatedBuffer`, mapped for writing), whose `publish` returns a [`PyAttachedBuffer`]
//!   (`mempool.ipc.AttachedBuffer`), as `attach` does; `delete`, `list` ([`PyBufferInfo`]), `stats`.
//! - [`PyStoreServer`] (`mempool.ipc.MemoryStoreServer`, made by `mempool.ipc.serve`): a server in this
//!   process, for tests and notebooks (`mempool-store-server` is the production way).
//!
//! A buffer's mapping lives in a [`Holder`] shared by the buffer objects made for it (a created buffer
//! and the attached one its `publish` returns): it is unmapped, and the server told, when the last of
//! them is gone, and each of them is kept alive by every view made from it (DLPack capsules and their
//! tensors, CUDA-array-interface consumers). Errors of the service are the `mempool.ipc` classes of
//! [`store_to_py`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyType};

use mempool_core::{Context, Device, StreamRef};
use mempool_store::{self as store, Attached, BufferState, CreateOptions, Created, Quotas, ServerConfig};

use super::common::{bytes_filled, closable_pymethods, no_pickle, seconds, Closable};
use crate::buffer::host_bytes;
use crate::errors::{ipc_to_py, named, to_py, IntoPy};
use crate::stream::{self, StreamArg};
use crate::surface::device_view_pymethods;
use crate::view::{DeviceView, RawView};

// ------------------------------------------------------------------------------------------------ errors

/// The `mempool.ipc` class `name` (defined in `python/mempool/ipc.py`) carrying `msg`.
fn ipc_class(name: &str, msg: String) -> PyErr {
    Python::attach(|py| match py.import("mempool.ipc").and_then(|m| m.getattr(name)) {
        Ok(cls) => match cls.cast_into::<PyType>() {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(not_a_class) => PyErr::from(not_a_class),
        },
        Err(import_failure) => import_failure,
    })
}

/// The Python exception of a memory store error, its message starting with `context` (what was being
/// done): `NameTakenError` (a `FileExistsError`), `UnknownNameError` (a `LookupError`), `InvalidNameError`
/// (a `ValueError`), `QuotaExceededError`, `NotPermittedError` (a `PermissionError`), `WrongStateError`
/// (also for publishing a buffer another connection creates), `ServerGoneError` (a `PeerGoneError` and a
/// `ConnectionError`), all `MemoryStoreError`s; `ValueError` for a bad size, tag or argument;
/// `RefusedError` at the server's connection limits; `IpcProtocolError`; `IpcTimeoutError`;
/// `NoDeviceError` when the buffer's GPU is not visible here; a driver error by its status; and
/// `MemoryStoreError` for the rest (the server's own GPU failure, a socket path it cannot use).
pub(crate) fn store_to_py(context: &str, e: store::Error) -> PyErr {
    use store::Error as E;
    let msg = format!("{context}: {e}");
    match e {
        E::NameTaken { .. } => ipc_class("NameTakenError", msg),
        E::UnknownName { .. } => ipc_class("UnknownNameError", msg),
        E::BadName { .. } => ipc_class("InvalidNameError", msg),
        E::BadTag { .. } | E::BadSize { .. } | E::InvalidArgument(_) => PyValueError::new_err(msg),
        E::QuotaExceeded { .. } => ipc_class("QuotaExceededError", msg),
        E::NotPermitted { .. } => ipc_class("NotPermittedError", msg),
        E::WrongState { .. } | E::NotCreator { .. } => ipc_class("WrongStateError", msg),
        E::PeerGone { .. } => ipc_class("ServerGoneError", msg),
        E::Busy { .. } => named("RefusedError", msg),
        E::Protocol { .. } => named("IpcProtocolError", msg),
        E::Timeout { .. } => named("IpcTimeoutError", msg),
        E::DeviceNotVisible { .. } => named("NoDeviceError", msg),
        E::Core(c) => {
            let err = to_py(c.into());
            Python::attach(|py| {
                let m = format!("{context}: {}", err.value(py));
                PyErr::from_type(err.get_type(py), m)
            })
        }
        E::Socket(s) => ipc_to_py(context, s.into()),
        _ => ipc_class("MemoryStoreError", msg),
    }
}

/// `?` on the memory store's errors, saying what was being done.
trait StoreIntoPy<T> {
    fn or_raise(self, context: impl FnOnce() -> String) -> PyResult<T>;
}

impl<T> StoreIntoPy<T> for store::Result<T> {
    fn or_raise(self, context: impl FnOnce() -> String) -> PyResult<T> {
        self.map_err(|e| store_to_py(&context(), e))
    }
}

/// Checks `name` against the service's naming rule (what `create`, `attach` and `delete` check first):
/// `InvalidNameError` naming the rule it breaks.
#[pyfunction]
pub(crate) fn validate_name(name: &str) -> PyResult<()> {
    store::validate_name(name).or_raise(|| "checking a buffer name".into())
}

// ------------------------------------------------------------------------------------------------ buffers

/// The mapping of one buffer, shared by the Python objects made for it.
enum Slot {
    /// Created here, not yet published.
    Created(Created),
    /// Published by this process, or attached.
    Attached(Attached),
    /// Being published (by another thread).
    Publishing,
    /// Discarded (only when no view was ever made).
    Gone,
}

/// A buffer's mapping (see the module documentation): unmapped, and the server told, when dropped.
struct Holder {
    slot: Mutex<Slot>,
    ctx: Arc<Context>,
    /// Whether a view was made (`__dlpack__`, `__cuda_array_interface__`): from then on only the
    /// garbage collector may unmap it.
    exported: AtomicBool,
    /// A publish is in progress or done (a second one is refused before it reaches the server).
    published: AtomicBool,
}

impl Drop for Holder {
    fn drop(&mut self) {
        let slot = std::mem::replace(self.slot.get_mut().unwrap_or_else(|p| p.into_inner()), Slot::Gone);
        if matches!(slot, Slot::Gone) {
            return;
        }
        // Views may have queued work on any stream of this process: the release waits for the device
        // (`ctx.synchronize`), unmaps and sends the Detach, with the interpreter released. Its errors go
        // to mempool_store::take_drop_errors (a server that is gone is not one).
        Python::attach(|py| py.detach(move || drop(slot)));
    }
}

impl Holder {
    /// Runs `f` on a view of the buffer's own bytes, ordered on the legacy default stream of its
    /// context, after the context's work (PyTorch's, CuPy's streams) is done (with the interpreter
    /// released; the slot is locked only then, so that no thread waits for it holding the interpreter);
    /// `MemoryStoreError` once discarded.
    fn with_view<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mempool_core::BufferView<'_>) -> mempool_core::Result<R> + Send,
    ) -> PyResult<R> {
        let ctx = self.ctx.clone();
        let r = py.detach(|| {
            let guard = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            let stream = StreamRef::LEGACY.in_context(&ctx);
            // A member of a group views its own range of the group's mapping.
            let view = match &*guard {
                Slot::Created(c) => c.view(stream),
                Slot::Attached(a) => a.view(stream),
                Slot::Publishing => return Err("it is being published"),
                Slot::Gone => return Err("it was discarded"),
            };
            Ok(view.and_then(|v| {
                // Work queued on any stream of this process (PyTorch's, CuPy's) comes first.
                ctx.synchronize()?;
                Ok(f(&v)?)
            }))
        });
        r.map_err(|why| ipc_class("MemoryStoreError", format!("using the buffer: {why}")))?
            .or_raise(|| format!("{what} the buffer"))
    }

    fn tobytes<'py>(&self, py: Python<'py>, size: usize) -> PyResult<Bound<'py, PyBytes>> {
        bytes_filled(py, size, |dst| {
            self.with_view(py, "copying from", |v| v.copy_to_host(0, dst))
        })
    }

    fn copy_from_host(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let src = host_bytes(data)?;
        let src = src.as_bytes();
        self.with_view(py, "copying into", |v| v.copy_from_host(offset, src))
    }
}

/// The options of `create` and `create_many`.
fn create_options(tag: Option<String>, ttl: Option<f64>, attach_uids: Option<Vec<u32>>) -> PyResult<CreateOptions> {
    let mut options = CreateOptions::new();
    if let Some(tag) = tag {
        options = options.tag(tag);
    }
    if let Some(t) = ttl {
        let t: Duration = seconds("ttl", t, false)?;
        options = options.ttl(t);
    }
    if let Some(uids) = attach_uids {
        options = options.attach_uids(uids);
    }
    Ok(options)
}

/// A `device` argument (None: the current device): its ordinal, the device and its context.
fn device_of(device: Option<usize>) -> PyResult<(usize, Device, Arc<Context>)> {
    let ordinal = match device {
        Some(d) => d,
        None => mempool_capi::device::current().py()?,
    };
    let dev = Device::get(ordinal).py()?;
    let ctx = mempool_capi::device::context(ordinal).py()?;
    Ok((ordinal, dev, ctx))
}

/// The Python object of a buffer created on device `ordinal` (its view: the buffer's own range).
fn created_buffer(created: Created, ordinal: usize, ctx: Arc<Context>) -> PyCreatedBuffer {
    let view = RawView {
        addr: created.ptr().as_raw(),
        size: created.len(),
        device: ordinal,
        stream: 0,
    };
    let name = created.name().to_owned();
    PyCreatedBuffer {
        holder: Arc::new(Holder {
            slot: Mutex::new(Slot::Created(created)),
            ctx,
            exported: AtomicBool::new(false),
            published: AtomicBool::new(false),
        }),
        view,
        name,
    }
}

/// The Python object of a buffer attached here, ordered on the stream `stream` (a raw handle) whose Python
/// object is `stream_owner`.
fn attached_buffer(
    attached: Attached,
    name: String,
    stream: usize,
    stream_owner: Option<Py<PyAny>>,
) -> PyResult<PyAttachedBuffer> {
    let ordinal = attached.device().ordinal();
    let ctx = mempool_capi::device::context(ordinal).py()?;
    let view = RawView {
        addr: attached.ptr().as_raw(),
        size: attached.len(),
        device: ordinal,
        stream,
    };
    Ok(PyAttachedBuffer {
        holder: Arc::new(Holder {
            slot: Mutex::new(Slot::Attached(attached)),
            ctx,
            exported: AtomicBool::new(false),
            published: AtomicBool::new(true),
        }),
        view,
        name,
        _stream_owner: stream_owner,
    })
}

/// A stream argument as a stream view.
///
/// # Safety
/// 1. The stream `s.handle` is live for as long as the view is used (the call it is passed to): its owner
///    is held by the caller's argument for the call, a raw integer is the caller's documented promise.
#[allow(unsafe_code)]
unsafe fn stream_ref(s: &StreamArg) -> StreamRef<'static> {
    // SAFETY: point 1; the memory store binds the buffer's context itself (a context-less view).
    unsafe { StreamRef::from_raw(s.handle as mempool_core::RawStream) }
}

/// A buffer class of the memory store (a struct with `holder`, `view` and `name`): its
/// [`DeviceView`], and `#[pymethods]` with the surface every buffer shares (`device_view_pymethods!`),
/// `name`, `tobytes`, `copy_from_host` (documented as given), no pickling and `repr`, then the class's
/// own methods.
macro_rules! store_buffer_pymethods {
    ($ty:ty, $class:literal, copy_from_host = $copy_doc:literal { $($own:tt)* }) => {
        impl DeviceView for $ty {
            const PY_NAME: &'static str = concat!("mempool.ipc.", $class);

            fn raw_view(&self) -> RawView {
                self.view
            }

            fn note_exported(&self) {
                self.holder.exported.store(true, Ordering::SeqCst);
            }
        }

        device_view_pymethods!($ty {
            /// The buffer's name.
            #[getter]
            fn name(&self) -> &str {
                &self.name
            }
            /// The contents as `bytes` (waits for the device).
            fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
                self.holder.tobytes(py, self.view.size)
            }
            #[doc = $copy_doc]
            #[pyo3(signature = (data, offset = 0))]
            fn copy_from_host(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
                self.holder.copy_from_host(py, data, offset)
            }
            fn __reduce__(&self) -> PyResult<()> {
                Err(no_pickle($class))
            }
            fn __repr__(&self) -> String {
                format!(
                    concat!("<mempool.ipc.", $class, " name={:?} size={} ptr={:#x} device={}>"),
                    self.name, self.view.size, self.view.addr, self.view.device
                )
            }
            $($own)*
        });
    };
}

/// A buffer this process created with `Client.create`, mapped for writing, not yet attachable by others.
/// Write it (`torch.from_dlpack(buf)`, CuPy, `copy_from_host`), then `publish(stream)`. Unpublished, it
/// is deleted when this object and every view of it are gone (or by `discard()`), or when this process
/// dies.
#[pyclass(module = "mempool.ipc", name = "CreatedBuffer", frozen, weakref)]
pub struct PyCreatedBuffer {
    holder: Arc<Holder>,
    view: RawView,
    name: String,
}

store_buffer_pymethods!(PyCreatedBuffer, "CreatedBuffer",
    copy_from_host = "Copies `data` (bytes-like) into the buffer at `offset` (after the device's queued work); waits." {
    /// Publishes the buffer: an interprocess event recorded on `stream` (the stream the writes were queued
    /// on: None is the legacy default stream; a PyTorch, CuPy or Numba stream, an object with
    /// `__cuda_stream__`, or a raw handle) orders every later attacher after them, with no host wait. From
    /// here on the server keeps it, by name, until deleted or expired, whether this process lives or not.
    /// Returns this process's mapping as an `AttachedBuffer` (the same memory and address; views of this
    /// object stay valid). On error the buffer stays unpublished (deleted when this object and its views
    /// are gone).
    #[pyo3(signature = (stream = None))]
    fn publish(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyAttachedBuffer> {
        let s = stream::extract(stream)?;
        if self.holder.published.swap(true, Ordering::SeqCst) {
            return Err(ipc_class(
                "WrongStateError",
                format!("publishing buffer {:?}: it was published already (or is being)", self.name),
            ));
        }
        // Locks are short and never held while the interpreter is released (no thread may wait for one
        // holding the interpreter while its holder waits for the interpreter).
        let taken = {
            let mut guard = self.holder.slot.lock().unwrap_or_else(|p| p.into_inner());
            match std::mem::replace(&mut *guard, Slot::Publishing) {
                Slot::Created(c) => Ok(c),
                other => Err(std::mem::replace(&mut *guard, other)),
            }
        };
        let Ok(created) = taken else {
            self.holder.published.store(false, Ordering::SeqCst);
            return Err(ipc_class(
                "WrongStateError",
                format!("publishing buffer {:?}: it was discarded", self.name),
            ));
        };
        // SAFETY: `s` (with its owner) lives until this call returns; the publish uses the stream only
        // during it (it records an event there).
        #[allow(unsafe_code)]
        let sref = unsafe { stream_ref(&s) };
        // The error hands the buffer back (large, and returned once).
        #[allow(clippy::result_large_err)]
        let result = py.detach(|| created.try_publish(sref));
        let mut guard = self.holder.slot.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(attached) => {
                *guard = Slot::Attached(attached);
                drop(guard);
                Ok(PyAttachedBuffer {
                    holder: self.holder.clone(),
                    view: RawView {
                        stream: s.handle,
                        ..self.view
                    },
                    name: self.name.clone(),
                    _stream_owner: s.owner,
                })
            }
            Err((e, created)) => {
                *guard = Slot::Created(created);
                drop(guard);
                self.holder.published.store(false, Ordering::SeqCst);
                Err(store_to_py(&format!("publishing buffer {:?}", self.name), e))
            }
        }
    }
    /// Unmaps and deletes the unpublished buffer now. Refused (`BufferError`) once a view was made
    /// (`__dlpack__`, `__cuda_array_interface__`): the buffer is then deleted when this object and every
    /// view of it are gone.
    fn discard(&self, py: Python<'_>) -> PyResult<()> {
        if self.holder.exported.load(Ordering::SeqCst) {
            return Err(PyBufferError::new_err(format!(
                "discarding buffer {:?}: views of it were made (DLPack or the CUDA array interface), which \
                 may still use its memory; it is deleted when this object and every view are gone",
                self.name
            )));
        }
        let mut guard = self.holder.slot.lock().unwrap_or_else(|p| p.into_inner());
        match std::mem::replace(&mut *guard, Slot::Gone) {
            Slot::Created(c) => {
                drop(guard);
                py.detach(|| c.discard())
                    .or_raise(|| format!("discarding buffer {:?}", self.name))
            }
            other => {
                *guard = other;
                Err(ipc_class(
                    "WrongStateError",
                    format!("discarding buffer {:?}: it was published or discarded already", self.name),
                ))
            }
        }
    }
});

/// A published buffer mapped into this process (`Client.attach`, `CreatedBuffer.publish`): the server's
/// memory, no copy. Unmapped (after the device's work) when this object and every view of it are gone;
/// the server keeps the buffer itself until it is deleted.
#[pyclass(module = "mempool.ipc", name = "AttachedBuffer", frozen, weakref)]
pub struct PyAttachedBuffer {
    holder: Arc<Holder>,
    view: RawView,
    name: String,
    /// The Python object of the stream it is ordered on (CuPy and Numba destroy a stream with it).
    _stream_owner: Option<Py<PyAny>>,
}

store_buffer_pymethods!(PyAttachedBuffer, "AttachedBuffer",
    copy_from_host = "Copies `data` (bytes-like) into the buffer at `offset` (every attacher sees it); waits." {});

// ------------------------------------------------------------------------------------------------ client

/// One named buffer as `Client.list()` reports it.
#[pyclass(module = "mempool.ipc", name = "BufferInfo", frozen, get_all)]
pub struct PyBufferInfo {
    /// The name.
    name: String,
    /// The size in bytes (rounded up to the GPU's granularity).
    size: u64,
    /// The UUID of the GPU holding it (`GPU-xxxxxxxx-...`, as nvidia-smi prints it).
    device_uuid: String,
    /// The tag given at creation ("" if none).
    tag: String,
    /// `"creating"` or `"published"`.
    state: &'static str,
    /// The uid of its creator.
    owner_uid: u32,
    /// The pid of its creator (who may be gone).
    owner_pid: i32,
    /// How many attachments it has now.
    attachments: u32,
    /// Seconds left before it expires, or None.
    expires_in: Option<f64>,
}

#[pymethods]
impl PyBufferInfo {
    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.BufferInfo name={:?} size={} device_uuid={} state={} tag={:?} owner_uid={} \
             owner_pid={} attachments={} expires_in={:?}>",
            self.name,
            self.size,
            self.device_uuid,
            self.state,
            self.tag,
            self.owner_uid,
            self.owner_pid,
            self.attachments,
            self.expires_in
        )
    }
}

fn state_name(s: BufferState) -> &'static str {
    match s {
        BufferState::Creating => "creating",
        BufferState::Published => "published",
        BufferState::Deleting => "deleting",
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &store::ServerStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("buffers", s.buffers)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("named", s.named)?;
    d.set_item("attachments", s.attachments)?;
    d.set_item("connections", s.connections)?;
    d.set_item("freed", s.freed)?;
    d.set_item("rejected", s.rejected)?;
    d.set_item("lingering_buffers", s.lingering_buffers)?;
    d.set_item("lingering_bytes", s.lingering_bytes)?;
    Ok(d)
}

/// A connection to a memory server (`mempool-store-server`, or `mempool.ipc.serve`). Calls block (with the
/// interpreter released); buffers keep the connection open until they are gone.
#[pyclass(module = "mempool.ipc", name = "Client", frozen, weakref)]
pub struct PyClient {
    client: store::Client,
    path: PathBuf,
}

#[pymethods]
impl PyClient {
    /// Connects to the server at `path`. `timeout`: seconds a reply may take (None: 60). `trust_uids`:
    /// server uids trusted besides this process's own.
    #[new]
    #[pyo3(signature = (path, timeout = None, trust_uids = Vec::new()))]
    fn new(py: Python<'_>, path: PathBuf, timeout: Option<f64>, trust_uids: Vec<u32>) -> PyResult<Self> {
        let mut options = store::ClientOptions {
            trust_uids,
            ..store::ClientOptions::default()
        };
        if let Some(t) = timeout {
            options.timeout = seconds("timeout", t, false)?;
        }
        let client = py
            .detach(|| store::Client::connect_with(&path, options))
            .or_raise(|| format!("connecting to the memory server at {}", path.display()))?;
        Ok(PyClient { client, path })
    }

    /// The socket path connected to.
    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    /// The server's process id.
    #[getter]
    fn server_pid(&self) -> u32 {
        self.client.server_pid()
    }

    /// The UUIDs of the GPUs the server serves.
    #[getter]
    fn devices(&self) -> Vec<String> {
        self.client.devices().iter().map(|(u, _)| u.to_string()).collect()
    }

    /// The protocol version the connection speaks: 3, or 2 with a server of version 2 (which has no
    /// attach lists).
    #[getter]
    fn protocol_version(&self) -> u16 {
        self.client.protocol_version()
    }

    /// Creates a buffer of `size` bytes (rounded up to the GPU's granularity) named `name` on `device`
    /// (an ordinal of this process; None: the current device), held by the server, and maps it here for
    /// writing. `tag`: a free-form string `list()` shows; `ttl`: seconds until its name expires (None: the
    /// server's default); `attach_uids`: the uids besides this one that may attach it (a list of at most 64;
    /// None: this uid only). Publish it once written.
    #[pyo3(signature = (name, size, device = None, tag = None, ttl = None, attach_uids = None))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        &self,
        py: Python<'_>,
        name: &str,
        size: usize,
        device: Option<usize>,
        tag: Option<String>,
        ttl: Option<f64>,
        attach_uids: Option<Vec<u32>>,
    ) -> PyResult<PyCreatedBuffer> {
        let context = || format!("creating buffer {name:?}");
        store::validate_name(name).or_raise(context)?;
        if size == 0 {
            return Err(PyValueError::new_err(format!(
                "{}: size must be at least 1 byte",
                context()
            )));
        }
        let options = create_options(tag, ttl, attach_uids)?;
        self.client.check_create_options(&options).or_raise(context)?;
        let (ordinal, dev, ctx) = device_of(device)?;
        let created = py
            .detach(|| self.client.create(name, size, dev, &options))
            .or_raise(context)?;
        Ok(created_buffer(created, ordinal, ctx))
    }

    /// Creates the buffers `names` (a list of str) of `sizes` (a list of int, one per name; each rounded
    /// up to the GPU's granularity) as one group: one allocation on the server, the members back to back
    /// in it, at most 128. Each is an ordinary buffer (publish, attach, delete, list), except that a member
    /// is attachable only once every member of its group is published, that the group's memory is freed
    /// only when every member is, and that whoever may attach one member maps the whole group's memory (the
    /// members share one access boundary). Attaching many members of a group imports and maps its memory
    /// once. All or nothing: a bad or taken name refuses the whole group. `device`, `tag`, `ttl`,
    /// `attach_uids` (one list for the whole group): as `create`. Returns one `CreatedBuffer` per name, in
    /// order.
    #[pyo3(signature = (names, sizes, device = None, tag = None, ttl = None, attach_uids = None))]
    #[allow(clippy::too_many_arguments)]
    fn create_many(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        sizes: Vec<usize>,
        device: Option<usize>,
        tag: Option<String>,
        ttl: Option<f64>,
        attach_uids: Option<Vec<u32>>,
    ) -> PyResult<Vec<PyCreatedBuffer>> {
        let count = names.len();
        let context = || format!("creating a group of {count} buffers");
        if names.is_empty() || names.len() > store::Client::MAX_ATTACH_MANY {
            return Err(PyValueError::new_err(format!(
                "{}: a group has 1 to {} members",
                context(),
                store::Client::MAX_ATTACH_MANY
            )));
        }
        for name in &names {
            store::validate_name(name).or_raise(context)?;
        }
        if names.len() != sizes.len() {
            return Err(PyValueError::new_err(format!(
                "{}: {} names and {} sizes (one size per name)",
                context(),
                names.len(),
                sizes.len()
            )));
        }
        if let Some(i) = sizes.iter().position(|&s| s == 0) {
            return Err(PyValueError::new_err(format!(
                "{}: the size of {:?} must be at least 1 byte",
                context(),
                names[i]
            )));
        }
        let options = create_options(tag, ttl, attach_uids)?;
        self.client.check_create_options(&options).or_raise(context)?;
        let (ordinal, dev, ctx) = device_of(device)?;
        let members: Vec<(String, usize)> = names.into_iter().zip(sizes).collect();
        let created = py
            .detach(|| self.client.create_many(&members, dev, &options))
            .or_raise(context)?;
        Ok(created
            .into_iter()
            .map(|c| created_buffer(c, ordinal, ctx.clone()))
            .collect())
    }

    /// Attaches the published buffer `name`: maps the server's memory here (no copy) and makes `stream`
    /// (None: the legacy default stream; a PyTorch, CuPy or Numba stream, `__cuda_stream__`, a raw handle:
    /// a stream of the buffer's GPU) wait for its creator's writes, without a host wait. The stream is the
    /// buffer's: DLPack and CUDA-array-interface consumers are ordered after it.
    #[pyo3(signature = (name, stream = None))]
    fn attach(&self, py: Python<'_>, name: &str, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyAttachedBuffer> {
        let s = stream::extract(stream)?;
        // SAFETY: `s` (with its owner) lives until this call returns, and its owner is then kept by the
        // buffer, whose view (`__dlpack__` ordering) uses the handle later.
        #[allow(unsafe_code)]
        let sref = unsafe { stream_ref(&s) };
        let attached = py
            .detach(|| self.client.attach(name, sref))
            .or_raise(|| format!("attaching buffer {name:?}"))?;
        attached_buffer(attached, name.to_owned(), s.handle, s.owner)
    }

    /// Attaches every buffer of `names` (a list of str) as `attach` does each, in few requests to the
    /// server (one per 128 names), and returns one `AttachedBuffer` per name, in order. All or nothing: on
    /// any error nothing stays attached and the exception names the buffer.
    #[pyo3(signature = (names, stream = None))]
    fn attach_many(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<PyAttachedBuffer>> {
        let s = stream::extract(stream)?;
        // SAFETY: `s` (with its owner) lives until this call returns, and its owner is then kept by every
        // buffer, whose view (`__dlpack__` ordering) uses the handle later.
        #[allow(unsafe_code)]
        let sref = unsafe { stream_ref(&s) };
        let attached = py
            .detach(|| self.client.attach_many(&names, sref))
            .or_raise(|| format!("attaching {} buffers", names.len()))?;
        let mut out = Vec::with_capacity(attached.len());
        for (attached, name) in attached.into_iter().zip(names) {
            let owner = s.owner.as_ref().map(|o| o.clone_ref(py));
            out.push(attached_buffer(attached, name, s.handle, owner)?);
        }
        Ok(out)
    }

    /// Deletes the buffer `name`: the name goes at once; the memory when the last attachment lets go.
    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.client.delete(name))
            .or_raise(|| format!("deleting buffer {name:?}"))
    }

    /// Every named buffer (being created or published), in name order, as `BufferInfo`s.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<PyBufferInfo>> {
        let infos = py
            .detach(|| self.client.list())
            .or_raise(|| "listing the memory server's buffers".into())?;
        Ok(infos
            .into_iter()
            .map(|i| PyBufferInfo {
                name: i.name,
                size: i.size,
                device_uuid: i.device.to_string(),
                tag: i.tag,
                state: state_name(i.state),
                owner_uid: i.owner_uid,
                owner_pid: i.owner_pid,
                attachments: i.attachments,
                expires_in: i.expires_in.map(|d| d.as_secs_f64()),
            })
            .collect())
    }

    /// The server's counters: `buffers`, `bytes`, `named`, `attachments`, `connections`, `freed`,
    /// `rejected`, `lingering_buffers` and `lingering_bytes` (deleted buffers still attached, and the bytes
    /// of memories no name holds any more, charged to the uids still attached; 0 from a server of protocol
    /// version 2) (a dict).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py
            .detach(|| self.client.stats())
            .or_raise(|| "reading the memory server's counters".into())?;
        stats_dict(py, &s)
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(no_pickle("Client"))
    }

    fn __repr__(&self) -> String {
        format!(
            "<mempool.ipc.Client path={:?} server_pid={}>",
            self.path.display().to_string(),
            self.client.server_pid()
        )
    }
}

// ------------------------------------------------------------------------------------------------ server

/// A memory server running in this process (`mempool.ipc.serve`). `shutdown()` (or leaving its `with`
/// block) closes every connection, releases every buffer and removes the socket file.
#[pyclass(module = "mempool.ipc", name = "MemoryStoreServer", frozen, weakref)]
pub struct PyStoreServer {
    server: Mutex<Option<store::Server>>,
    path: PathBuf,
}

impl Drop for PyStoreServer {
    fn drop(&mut self) {
        let taken = self.server.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(server) = taken {
            Python::attach(|py| py.detach(move || server.shutdown()));
        }
    }
}

closable_pymethods!(PyStoreServer, path = "The socket path it serves.", closed = "Whether `shutdown()` was called." {
    /// The server's counters (as `Client.stats()`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self
            .server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|s| s.stats())
            .ok_or_else(|| {
                ipc_class(
                    "MemoryStoreError",
                    format!("the server of {} is shut down", self.path.display()),
                )
            })?;
        stats_dict(py, &s)
    }

    /// Stops serving: closes the connections, releases every buffer, removes the socket file. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        let taken = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(server) = taken {
            py.detach(move || server.shutdown());
        }
    }
});

impl Closable for PyStoreServer {
    const PY_NAME: &'static str = "MemoryStoreServer";

    fn socket_path(&self) -> &Path {
        &self.path
    }

    fn is_closed(&self) -> bool {
        self.server.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    fn close_now(&self, py: Python<'_>) {
        self.shutdown(py);
    }
}

/// Starts a memory server in this process on `path` (see `mempool.ipc.serve`'s documentation).
#[pyfunction]
#[pyo3(signature = (
    path, *, devices = None, per_uid_bytes = None, per_uid_buffers = None, total_bytes = None,
    total_buffers = None, allow_uids = Vec::new(), default_ttl = None, max_buffer_bytes = None,
    socket_mode = None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve(
    py: Python<'_>,
    path: PathBuf,
    devices: Option<Vec<usize>>,
    per_uid_bytes: Option<u64>,
    per_uid_buffers: Option<u64>,
    total_bytes: Option<u64>,
    total_buffers: Option<u64>,
    allow_uids: Vec<u32>,
    default_ttl: Option<f64>,
    max_buffer_bytes: Option<u64>,
    socket_mode: Option<u32>,
) -> PyResult<PyStoreServer> {
    let devices = match devices {
        Some(d) if d.is_empty() => return Err(PyValueError::new_err("serve: devices must name at least one GPU")),
        Some(d) => d,
        None => vec![0],
    };
    let mut config = ServerConfig::new(&path)
        .devices(devices)
        .quotas(Quotas {
            per_uid_bytes,
            per_uid_buffers,
            total_bytes,
            total_buffers,
        })
        .allow_uids(allow_uids);
    if let Some(t) = default_ttl {
        config = config.default_ttl(Some(seconds("default_ttl", t, false)?));
    }
    if let Some(b) = max_buffer_bytes {
        config = config.max_buffer_bytes(b);
    }
    if let Some(m) = socket_mode {
        if m > 0o777 {
            return Err(PyValueError::new_err(format!(
                "serve: socket_mode {m:#o} is not a permission mode"
            )));
        }
        config = config.socket_mode(m);
    }
    let server = py
        .detach(|| store::Server::serve(config))
        .or_raise(|| format!("starting a memory server at {}", path.display()))?;
    Ok(PyStoreServer {
        server: Mutex::new(Some(server)),
        path,
    })
}
