//! The importing process: connects to an exporter, imports its pool once, and receives buffers
//! as [`SharedBuffer`]s that release themselves.
//!
//! [`Importer`] (with [`ImporterOptions`]) and [`SharedBuffer`] are public; their documentation
//! is the guide. Inside, the [`ImportTable`] imports each block once and says when its import
//! may be freed; the tests (`importer/tests.rs`) cover what can be checked without a GPU.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use mempool_core::{
    memory, BufferView, Context, Device, DeviceAddr, Event, EventFlags, ImportedPtr, IpcEventHandle, MemPool,
    PtrExportData, StreamRef,
};

use crate::batch::ReleaseBatcher;
use crate::error::{record_drop_error, Error, Result};
use crate::lease::ImportTable;
use crate::protocol::{
    BlockId, BufferDescriptor, BufferId, DeviceUuid, EventHandle, MessageType, PoolId, ProtocolError, CAP_FAST_RELEASE,
    CAP_RING, CAP_VMM, CAP_VMM_CHUNKS,
};
use crate::session::{ExporterEvent, ImporterSession};
use crate::trace::{self, Point};
use mempool_socket::cred::{AccessPolicy, PeerCredentials};
use mempool_socket::ConnectionOptions;

mod vmm;
mod vmm_chunks;

pub use self::vmm::SharedVmm;
use self::vmm::VmmHost;
pub use self::vmm_chunks::SharedVmmRange;

/// How an [`Importer`] connects.
#[derive(Clone, Debug)]
pub struct ImporterOptions {
    /// The connection's time limits.
    pub connection: ConnectionOptions,
    /// Which users the exporter may run as (default: this process's user).
    pub policy: AccessPolicy,
    /// Asks for the fast release path (protocol version 2; default `true`): blocks of
    /// suballocated buffers stay imported for the connection's life, and dropping a
    /// [`SharedBuffer`] neither synchronizes nor sends a message of its own: it records an
    /// interprocess event on the buffer's stream and queues the release, which goes out in a
    /// batch ordered by that event. A version-1 exporter refuses the request; the importer then
    /// connects the version-1 way. `false` speaks version 1 (each drop synchronizes its stream
    /// and sends its own `Release`).
    pub fast_release: bool,
    /// The most releases one batch carries (1 to 64; default 32).
    pub max_release_batch: usize,
    /// The longest a release waits to be sent (default 100 µs). A release that finds nothing
    /// pending and no batch sent within this delay goes out at once; a batch also goes out when it
    /// is full, and whenever [`Importer::recv`] is about to wait for the exporter. (Buffers of
    /// blocks the importer does not keep, whole allocations, are released at once the version-1
    /// way: freeing their import waits for their stream anyway.)
    pub max_release_delay: Duration,
    /// Asks for VMM physical allocations ([`SharedVmm`], from
    /// [`Exporter::share_vmm`](crate::Exporter::share_vmm)) and ranges over several of them
    /// ([`SharedVmmRange`], from [`Exporter::share_vmm_chunks`](crate::Exporter::share_vmm_chunks))
    /// as well as pool buffers: capability bits 1 and 2 of the version-2 handshake; receive them
    /// with [`Importer::recv_any`]. Default: `false` (the exporter refuses to share VMM memory with
    /// this importer). A version-1 exporter never grants them.
    pub accept_vmm: bool,
    /// How a buffer's first use is ordered after the exporter's work on it when the exporter's
    /// ready event is still pending as the buffer arrives (when it is complete, nothing is
    /// waited for either way). `false` (the default): [`Importer::recv`] queues a GPU wait on the
    /// receiving stream and returns at once. `true`: `recv` waits on the host
    /// (`cuEventSynchronize`) until the exporter's work is done, so this importer's stream never
    /// waits on the GPU for another process's event (a cross-process dependency that the GPU
    /// resolves only by switching between the two processes' contexts).
    pub wait_ready_on_host: bool,
    /// On the fast release path, how a release of a kept block's buffer is ordered. `false` (the
    /// default): dropping the [`SharedBuffer`] records the release event and returns; the exporter
    /// orders the memory's reuse after that event (a GPU wait, when it is still pending as the
    /// batch arrives). `true`: the drop waits on the host (`cuStreamSynchronize` on the buffer's
    /// stream, after recording the event) until this process's work on the buffer is done, then sends
    /// the release at once: the exporter finds the event complete and orders nothing on the GPU (unless
    /// another thread of this process re-recorded the shared release event on a busy stream meanwhile:
    /// then it waits on the GPU as without this option), so no stream of either process waits for the
    /// other's event (version 1's ordering, without its
    /// import per buffer and free). With [`wait_ready_on_host`](Self::wait_ready_on_host) too, the
    /// two processes never meet on the GPU.
    pub release_on_host: bool,
    /// Asks for the shared-memory rings (protocol version 3; default `true`; needs
    /// [`fast_release`](Self::fast_release)): after the handshake the exporter passes a sealed
    /// memfd holding one ring each way, and buffers arrive, and releases go back, through shared
    /// memory, with a doorbell only when the other side sleeps. On this path a release goes out as
    /// soon as the buffer is let go (no [`max_release_delay`](Self::max_release_delay)): writing it
    /// costs no system call while the exporter is awake. An exporter that does not offer the rings
    /// ([`ExporterOptions::rings`](crate::ExporterOptions::rings) `None`, or an older version)
    /// leaves the connection on the socket. [`Importer::rings`] says which it got.
    pub rings: bool,
}

/// What [`Importer::recv_any`] received: a pool buffer or a VMM physical allocation.
#[derive(Debug)]
pub enum Received<'s> {
    /// A buffer of the exporter's pool.
    Buffer(SharedBuffer<'s>),
    /// A VMM physical allocation, mapped here.
    Vmm(SharedVmm),
    /// A range over several VMM physical allocations, mapped here back to back.
    VmmRange(SharedVmmRange),
}

impl Default for ImporterOptions {
    fn default() -> Self {
        ImporterOptions {
            connection: ConnectionOptions::default(),
            policy: AccessPolicy::default(),
            fast_release: true,
            max_release_batch: 32,
            max_release_delay: Duration::from_micros(100),
            accept_vmm: false,
            wait_ready_on_host: false,
            release_on_host: false,
            rings: true,
        }
    }
}

struct State {
    table: ImportTable<ImportedPtr>,
    /// Opened interprocess events by handle. The exporter recycles its events, so the same
    /// handles come back; each is opened once for the connection's life.
    events: HashMap<[u8; 64], Arc<Event>>,
    /// The fast release path's interprocess event and its handle, made on the first release.
    release_event: Option<(Event, EventHandle)>,
    /// Whether `release_event` was recorded yet.
    recorded: bool,
    /// The VMM buffers held ([`SharedVmm`]).
    vmm: HashSet<BufferId>,
}

/// The releases waiting to go out (fast release path), shared with the flusher thread.
struct Pending {
    batch: Mutex<ReleaseBatcher>,
    /// Signalled when a batch begins, and when the importer goes away.
    changed: Condvar,
    stop: AtomicBool,
}

struct Inner {
    // Field order is drop order: the imports go before the pool they came from.
    state: Mutex<State>,
    /// [`ImporterOptions::wait_ready_on_host`].
    wait_ready_on_host: bool,
    /// [`ImporterOptions::release_on_host`].
    release_on_host: bool,
    /// `Some` on the fast release path.
    pending: Option<Arc<Pending>>,
    session: ImporterSession,
    ctx: Arc<Context>,
    device: Device,
    pool: MemPool,
}

/// A connection to an exporter, with its pool imported.
///
/// [`Importer::connect`] checks who answers (`SO_PEERCRED`), finds the exporter's GPU among this
/// process's devices by UUID (ordinals may differ between processes), and imports the pool
/// (`cuMemPoolImportFromShareableHandle`). [`Importer::recv`] then waits for a buffer, imports
/// its block (`cuMemPoolImportPointer`, once per block while any buffer of the block is held)
/// and makes the caller's stream wait on the exporter's event, so work queued on that stream
/// after `recv` sees the exporter's data.
///
/// On the version-1 path, dropping a [`SharedBuffer`] waits for the work queued on its stream,
/// frees the block's import if it was the block's last buffer here, and only then sends
/// `Release`: the driver's rule that the importer frees before the exporter does. On the fast
/// release path (protocol version 2, asked for by default: [`ImporterOptions::fast_release`]),
/// blocks of suballocated buffers stay imported for the connection's life (the exporter keeps
/// them allocated until this importer is gone), and dropping a buffer records this importer's
/// interprocess event on its stream and queues the release for a batch: it does not wait.
///
/// ```no_run
/// # fn main() -> Result<(), mempool_ipc::Error> {
/// use mempool_core::Stream;
/// use mempool_ipc::{Importer, ImporterOptions};
///
/// let importer = Importer::connect("/run/user/1000/pool.sock", ImporterOptions::default())?;
/// let stream = Stream::new(&importer.device().context()?)?;
/// let buf = importer.recv(stream.as_ref())?;
/// // ... queue work that reads or writes `buf.ptr()` on `stream` ...
/// drop(buf); // waits for that work, frees the import, tells the exporter
/// # Ok(()) }
/// ```
///
/// One `Importer` per exporter per process: the driver imports a pool's pointers once per
/// process, so two importers of the same pool in one process would free each other's imports.
///
/// Dropping it (once every [`SharedBuffer`] it handed out is dropped too: they keep it alive)
/// says `Goodbye` and releases the imported pool.
#[derive(Clone)]
pub struct Importer {
    inner: Arc<Inner>,
}

impl fmt::Debug for Importer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Importer")
            .field("device", &self.inner.device)
            .field("pool_id", &self.inner.session.pool_id())
            .field("held", &self.held())
            .finish()
    }
}

impl Importer {
    /// Connects to the exporter at `path`, checks its credentials against `options.policy`,
    /// runs the handshake, and imports the pool.
    ///
    /// Errors: [`Error::DeviceNotVisible`] if this process does not see the exporter's GPU;
    /// [`Error::PeerCredentials`]; [`Error::Core`] if the pool cannot be imported; any error of
    /// the handshake: [`Error::Timeout`], [`Error::UnexpectedMessage`], [`Error::Remote`], ...
    pub fn connect(path: impl AsRef<Path>, options: ImporterOptions) -> Result<Importer> {
        let mut capabilities = if options.fast_release { CAP_FAST_RELEASE } else { 0 };
        if options.accept_vmm {
            capabilities |= CAP_VMM | CAP_VMM_CHUNKS;
        }
        if options.fast_release && options.rings {
            capabilities |= CAP_RING;
        }
        let (session, imported) =
            ImporterSession::connect(path, options.connection, &options.policy, capabilities, find_device)?;
        let device = imported.device;
        let setup = || -> Result<(Arc<Context>, MemPool)> {
            let ctx = device.context()?;
            let pool = MemPool::import_fd(&device, std::os::fd::AsFd::as_fd(&imported.pool_fd))?;
            Ok((ctx, pool))
        };
        let (ctx, pool) = match setup() {
            Ok(parts) => parts,
            Err(e) => return Err(session.reject(e)),
        };
        let pending = (session.capabilities() & CAP_FAST_RELEASE != 0).then(|| {
            Arc::new(Pending {
                batch: Mutex::new(ReleaseBatcher::new(
                    options.max_release_batch,
                    options.max_release_delay,
                )),
                changed: Condvar::new(),
                stop: AtomicBool::new(false),
            })
        });
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                table: ImportTable::new(),
                events: HashMap::new(),
                release_event: None,
                recorded: false,
                vmm: HashSet::new(),
            }),
            wait_ready_on_host: options.wait_ready_on_host,
            release_on_host: options.release_on_host,
            pending: pending.clone(),
            session,
            ctx,
            device,
            pool,
        });
        if let Some(pending) = pending {
            let weak = Arc::downgrade(&inner);
            let spawned = std::thread::Builder::new()
                .name("mempool-ipc-release".into())
                .spawn(move || flush_when_due(&pending, &weak));
            if let Err(e) = spawned {
                return Err(Error::Io(e));
            }
        }
        Ok(Importer { inner })
    }

    /// Whether this connection uses the fast release path (the importer asked for it and the
    /// exporter speaks protocol version 2).
    pub fn fast_release(&self) -> bool {
        self.inner.pending.is_some()
    }

    /// Whether buffers and releases travel through the shared-memory rings (protocol version 3:
    /// [`ImporterOptions::rings`], and an exporter that offers them).
    pub fn rings(&self) -> bool {
        self.inner.session.capabilities() & CAP_RING != 0
    }

    /// Waits for the next buffer, then takes every buffer that has already arrived behind it,
    /// up to `max` in all (at least one; `max` 0 counts as 1), without waiting again: one wake-up
    /// for a batch the exporter shared together ([`Exporter::share_many`](crate::Exporter::share_many)).
    /// `timeout` bounds the wait for the first ([`Error::Timeout`]; `None`: no limit). Ordering as for
    /// [`Importer::recv`]: work queued on `stream` after this returns runs after the exporter's
    /// work on every buffer returned.
    ///
    /// Errors: those of [`Importer::recv`], for the first buffer. A failure after the first (a
    /// buffer that could not be imported, the exporter gone) ends the batch early; it is kept for
    /// [`take_drop_errors`](crate::take_drop_errors) unless it is [`Error::ExporterGone`], which the
    /// next call reports.
    pub fn recv_many<'s>(
        &self,
        stream: StreamRef<'s>,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<SharedBuffer<'s>>> {
        let first = self.recv_until(stream, timeout.map(|t| Instant::now() + t))?;
        let mut out = vec![first];
        while out.len() < max && self.inner.session.readable() {
            match self.recv_until(stream, Some(Instant::now())) {
                Ok(buffer) => out.push(buffer),
                Err(Error::ExporterGone { .. } | Error::Timeout { .. }) => break,
                Err(e) => {
                    record_drop_error(e);
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Sends the releases waiting to go out now (fast release path; nothing otherwise). They go
    /// out by themselves within [`ImporterOptions::max_release_delay`], when a batch is full, and
    /// before [`Importer::recv`] waits.
    pub fn flush_releases(&self) -> Result<()> {
        self.inner.flush_releases(Point::ImporterSendOther)
    }

    /// The local device that has the exporter's GPU.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The exporter's GPU.
    pub fn device_uuid(&self) -> DeviceUuid {
        self.inner.session.device_uuid()
    }

    /// The exporter's pool.
    pub fn pool_id(&self) -> PoolId {
        self.inner.session.pool_id()
    }

    /// The imported pool.
    pub fn pool(&self) -> &MemPool {
        &self.inner.pool
    }

    /// The exporter's credentials.
    pub fn exporter_credentials(&self) -> Result<PeerCredentials> {
        self.inner.session.exporter_credentials()
    }

    /// How many buffers this importer holds (pool buffers and VMM allocations).
    pub fn held(&self) -> usize {
        let state = self.inner.lock();
        state.table.len() + state.vmm.len()
    }

    /// Whether the exporter agreed to send VMM allocations ([`ImporterOptions::accept_vmm`], and
    /// an exporter that offers them).
    pub fn accepts_vmm(&self) -> bool {
        self.inner.session.capabilities() & CAP_VMM != 0
    }

    /// Whether the exporter agreed to send ranges over several VMM allocations
    /// ([`ImporterOptions::accept_vmm`], and an exporter that offers them).
    pub fn accepts_vmm_chunks(&self) -> bool {
        self.inner.session.capabilities() & CAP_VMM_CHUNKS != 0
    }

    /// How many blocks are imported now (buffers suballocated from one block share it; on the
    /// fast release path, blocks the exporter let this importer keep stay imported with no
    /// buffer held).
    pub fn imported_blocks(&self) -> usize {
        self.inner.lock().table.block_count()
    }

    /// How many imported blocks are kept for the connection's life (fast release path).
    pub fn kept_blocks(&self) -> usize {
        self.inner.lock().table.kept_count()
    }

    /// Waits for the next buffer. Work queued on `stream` after this returns runs after the
    /// exporter's work on the buffer; on another stream, order it after `stream` first.
    ///
    /// Errors: [`Error::ExporterGone`] once the exporter has said `Goodbye`, closed the
    /// connection or died (what was received stays usable); [`Error::Core`] if the buffer could
    /// not be imported (it is released at once).
    pub fn recv<'s>(&self, stream: StreamRef<'s>) -> Result<SharedBuffer<'s>> {
        self.recv_until(stream, None)
    }

    /// Like [`Importer::recv`], but fails with [`Error::Timeout`] if no buffer begins to arrive
    /// within `timeout` (the connection stays usable).
    pub fn recv_timeout<'s>(&self, stream: StreamRef<'s>, timeout: Duration) -> Result<SharedBuffer<'s>> {
        self.recv_until(stream, Some(Instant::now() + timeout))
    }

    /// Waits for the next buffer of either kind: with [`ImporterOptions::accept_vmm`], the
    /// exporter may send VMM allocations too ([`Received::Vmm`]). Ordering and errors as for
    /// [`Importer::recv`]; a VMM allocation that cannot be imported or mapped is released at once.
    pub fn recv_any<'s>(&self, stream: StreamRef<'s>) -> Result<Received<'s>> {
        self.recv_any_until(stream, None)
    }

    /// Like [`Importer::recv_any`], but fails with [`Error::Timeout`] if nothing begins to
    /// arrive within `timeout` (the connection stays usable).
    pub fn recv_any_timeout<'s>(&self, stream: StreamRef<'s>, timeout: Duration) -> Result<Received<'s>> {
        self.recv_any_until(stream, Some(Instant::now() + timeout))
    }

    fn recv_until<'s>(&self, stream: StreamRef<'s>, deadline: Option<Instant>) -> Result<SharedBuffer<'s>> {
        match self.recv_any_until(stream, deadline)? {
            Received::Buffer(buffer) => Ok(buffer),
            Received::Vmm(vmm) => {
                // Released here: `recv` hands out pool buffers only.
                vmm.release()?;
                Err(Error::UnexpectedMessage {
                    expected: "Buffer (a VmmBuffer arrived and was released: receive with Importer::recv_any)",
                    got: MessageType::VmmBuffer,
                })
            }
            Received::VmmRange(range) => {
                range.release()?;
                Err(Error::UnexpectedMessage {
                    expected: "Buffer (a VmmChunks arrived and was released: receive with Importer::recv_any)",
                    got: MessageType::VmmChunks,
                })
            }
        }
    }

    fn recv_any_until<'s>(&self, stream: StreamRef<'s>, deadline: Option<Instant>) -> Result<Received<'s>> {
        let inner = &self.inner;
        // The exporter may be waiting for these releases before it sends more: send them unless
        // a message is already here (on the rings none wait: each goes out as it is made). Asking
        // the socket costs a system call: only when releases wait.
        if let Some(pending) = &inner.pending {
            let waiting = !lock_plain(&pending.batch).is_empty();
            if waiting && !inner.session.readable() {
                inner.flush_releases(Point::ImporterSendOnRecv)?;
            }
        }
        let descriptor = match inner.session.recv_until(deadline) {
            Ok(ExporterEvent::Buffer(descriptor)) => descriptor,
            Ok(ExporterEvent::VmmBuffer(descriptor, fd)) => {
                let host: Arc<dyn VmmHost> = inner.clone();
                return vmm::receive(host, descriptor, fd, stream).map(Received::Vmm);
            }
            Ok(ExporterEvent::VmmChunks(descriptor, fds)) => {
                let host: Arc<dyn VmmHost> = inner.clone();
                return vmm_chunks::receive(host, descriptor, fds, stream).map(Received::VmmRange);
            }
            Ok(ExporterEvent::Goodbye) => {
                inner.exporter_said_goodbye();
                return Err(Error::ExporterGone { how: "said Goodbye" });
            }
            Err(Error::Closed) => {
                return Err(Error::ExporterGone {
                    how: "closed the connection",
                })
            }
            Err(Error::Protocol(ProtocolError::Truncated { .. })) => {
                return Err(Error::ExporterGone {
                    how: "closed the connection in the middle of a message",
                })
            }
            Err(Error::ConnectionFailed) => {
                return Err(Error::ExporterGone {
                    how: "is no longer connected (an earlier error closed the connection)",
                })
            }
            Err(e) => return Err(e),
        };
        let id = descriptor.buffer_id;
        trace::mark(Point::ImporterFrame, id.0);
        let received = (|| -> Result<DeviceAddr> {
            let mut state = inner.lock();
            let base = state
                .table
                .add(&descriptor, |d: &BufferDescriptor| -> Result<ImportedPtr> {
                    let imported = inner.pool.import_pointer(&PtrExportData(d.pointer.0))?;
                    // The block's size is the exporter's word; the views below reach `block_size` bytes
                    // from the imported pointer, so they must lie in the allocation the driver imported.
                    // On error `imported` is dropped, which frees the import.
                    let (base, size) = memory::address_range(&inner.ctx, imported.ptr())?;
                    check_block_in_allocation(d, imported.ptr(), base, size)?;
                    Ok(imported)
                })?
                .ptr();
            let ptr = base.offset(descriptor.offset as usize);
            if let Some(handle) = descriptor.ready_event {
                let event = match state.events.entry(handle.0) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut().clone(),
                    std::collections::hash_map::Entry::Vacant(e) => e
                        .insert(Arc::new(Event::open_ipc(&inner.ctx, &IpcEventHandle(handle.0))?))
                        .clone(),
                };
                // The exporter records the event before it sends the buffer and records it again only
                // after the buffer is freed, which this importer's release comes before: complete
                // now, the exporter's work on the buffer is done, and no GPU wait (on another
                // process's event) is needed.
                if !event.is_complete().unwrap_or(false) {
                    trace::mark(Point::ImporterReadyPending, id.0);
                    // A wait on the host does not hold up other threads' releases meanwhile.
                    let waited = if inner.wait_ready_on_host {
                        drop(state);
                        event.synchronize()
                    } else {
                        let waited = stream.wait(&event);
                        drop(state);
                        waited
                    };
                    if let Err(e) = waited {
                        let _ = inner.forget(id, stream);
                        return Err(e.into());
                    }
                }
            }
            Ok(ptr)
        })();
        match received {
            Ok(ptr) => {
                trace::mark(Point::ImporterReceived, id.0);
                // SAFETY: `ptr..ptr+size` lies inside the block imported into `inner.ctx` (the decoder checked
                // `offset + size <= block_size`, and the import checked that the block's `block_size` bytes lie in
                // the allocation the driver imported: `check_block_in_allocation`), which the import table keeps imported until this buffer is
                // released, and reached by unified addressing; the exporter's work on it is done (its ready
                // event was complete, or waited for on the host, or the exporter synchronized) or `stream` waits
                // on that event, so work on it is ordered on `stream` from here on; a stream that carries no
                // context is one of the importer's context by `StreamRef::from_raw`'s contract.
                #[allow(unsafe_code)]
                let view = unsafe { BufferView::new(ptr, descriptor.size as usize, stream, inner.ctx.clone()) };
                Ok(Received::Buffer(SharedBuffer {
                    inner: self.inner.clone(),
                    id,
                    block: descriptor.block_id,
                    view,
                }))
            }
            Err(e) => {
                // Not held: tell the exporter so it does not wait for this buffer.
                let _ = inner.session.release(id);
                Err(e)
            }
        }
    }
}

/// A buffer received from the exporter, ordered on the stream given to [`Importer::recv`].
///
/// Dropping it waits for the work queued on that stream, frees the import (if it was its
/// block's last buffer here) and sends `Release`. After the exporter is gone, dropping it still
/// frees the import; the release then has nowhere to go and is skipped.
///
/// On the fast release path ([`Importer::fast_release`]) dropping it does not wait: it records
/// the importer's interprocess event on the buffer's stream and queues the release; the
/// exporter orders every reuse of the memory after that event, on the GPU. (It still waits if
/// it frees a block's import, which the exporter allows only for blocks it did not let this
/// importer keep.) The importer's stream also waits for the previous release's event first
/// (unless that recording is already complete), so that each recording of the event covers every
/// release before it.
pub struct SharedBuffer<'s> {
    inner: Arc<Inner>,
    id: BufferId,
    block: BlockId,
    /// The range in this process; empty once released (by `release` or drop).
    view: BufferView<'s>,
}

impl fmt::Debug for SharedBuffer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("id", &self.id)
            .field("block", &self.block)
            .field("view", &self.view)
            .finish()
    }
}

impl<'s> std::ops::Deref for SharedBuffer<'s> {
    type Target = BufferView<'s>;

    /// The buffer's range in this process: address, size, stream, context, host copies and fills.
    fn deref(&self) -> &BufferView<'s> {
        &self.view
    }
}

impl<'s> SharedBuffer<'s> {
    /// The exporter's id of the buffer.
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The block the buffer lives in.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// Releases the buffer (what dropping does), reporting errors instead of recording them.
    pub fn release(mut self) -> Result<()> {
        self.release_once()
    }

    /// Releases once: the view is empty afterwards, so a later drop has nothing to release.
    fn release_once(&mut self) -> Result<()> {
        let (inner, id) = (&self.inner, self.id);
        self.view.release_with(|_, _, stream| inner.release(id, stream))
    }
}

impl Drop for SharedBuffer<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release_once() {
            record_drop_error(e);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `id` here: waits for the work on `stream`, and frees the block's import if this
    /// was its last buffer. The lock is held throughout, so a buffer of the same block that
    /// arrives meanwhile imports the block afresh only after this import is freed.
    fn forget(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        let mut state = self.lock();
        match state.table.release(id)? {
            Some(import) => import.free(stream)?,
            None => stream.synchronize()?,
        }
        Ok(())
    }

    /// Forgets `id` on the fast release path. If the exporter did not let this importer keep the
    /// block (a whole allocation), frees the block's import, which waits for `stream`: the release
    /// is then complete, as on the version-1 path, and `None` is returned (send a plain `Release`;
    /// an event would only add an interprocess wait on the exporter's side). Otherwise records the
    /// release event on `stream` after making `stream` wait for its previous recording (unless that
    /// one is complete already), so the recording covers this release and every earlier one
    /// whatever stream they were on.
    fn forget_fast(&self, id: BufferId, stream: StreamRef<'_>) -> Result<Option<EventHandle>> {
        let mut state = self.lock();
        if let Some(import) = state.table.release(id)? {
            import.free(stream)?;
            return Ok(None);
        }
        if state.release_event.is_none() {
            let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS)?;
            let handle = EventHandle(event.ipc_handle()?.0);
            state.release_event = Some((event, handle));
        }
        let recorded = state.recorded;
        let Some((event, handle)) = state.release_event.as_ref() else {
            unreachable!("made above")
        };
        // Only this importer records the event: complete now, every use its earlier recordings
        // covered is done, and the new recording needs no wait to cover them too.
        if recorded && !event.is_complete().unwrap_or(false) {
            stream.wait(event)?;
        }
        event.record(stream)?;
        let handle = *handle;
        state.recorded = true;
        Ok(Some(handle))
    }

    fn release(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        trace::mark(Point::ImporterRelease, id.0);
        if let Some(pending) = &self.pending {
            match self.forget_fast(id, stream) {
                Err(e) => {
                    // Not ordered by the event: fall back to waiting, and release it on its own.
                    stream.synchronize()?;
                    let _ = self.session.release(id);
                    return Err(e);
                }
                // The import was freed after `stream` was synchronized: complete, release it now.
                Ok(None) => return ignore_gone(self.session.release(id)),
                Ok(Some(handle)) => {
                    trace::mark(Point::ImporterRecorded, id.0);
                    if self.session.rings() && !self.release_on_host {
                        // On the rings a release goes out at once, past the batcher (whose flusher
                        // thread would be woken for each release, a system call and a wake-up for
                        // nothing): writing it costs no system call while the exporter is awake.
                        // Releases still in the batcher (none on the rings) would go out later
                        // under the event's newer recording, which covers them too.
                        trace::mark(Point::ImporterSendOnPush, id.0);
                        let sent = ignore_gone(self.session.release_batch(Some(handle), vec![id]));
                        trace::mark(Point::ImporterSent, id.0);
                        return sent;
                    }
                }
            }
            if self.release_on_host {
                // The event was recorded on `stream` (after any chained wait): once the stream is done,
                // the event is complete, so the exporter orders nothing after it on the GPU.
                if let Err(e) = stream.synchronize() {
                    // Not known to be done: the release still goes out, ordered by its event as usual.
                    record_drop_error(e.into());
                } else {
                    lock_plain(&pending.batch).push(id, Instant::now());
                    return self.flush_releases(Point::ImporterSendOnPush);
                }
            }
            let send = {
                let mut batch = lock_plain(&pending.batch);
                let was_empty = batch.is_empty();
                let send = batch.push(id, Instant::now());
                if was_empty && !send {
                    pending.changed.notify_all();
                }
                send
            };
            // On the rings a release goes out at once (above; here only when `release_on_host`
            // could not synchronize).
            if !send && !self.session.rings() {
                trace::mark(Point::ImporterQueued, id.0);
                return Ok(());
            }
            return self.flush_releases(Point::ImporterSendOnPush);
        }
        self.forget(id, stream)?;
        ignore_gone(self.session.release(id))
    }

    /// The exporter said `Goodbye` (it shares nothing more). On the fast release path, an importer
    /// that holds no buffer frees the imports it kept and says `Goodbye` now, so the exporter's
    /// shutdown can free those blocks instead of waiting for this importer to be dropped.
    fn exporter_said_goodbye(&self) {
        if self.pending.is_none() {
            return;
        }
        if let Err(e) = self.flush_releases(Point::ImporterSendOther) {
            record_drop_error(e);
        }
        let kept = {
            let mut state = self.lock();
            if !state.table.is_empty() {
                return;
            }
            state.table.drain()
        };
        if let Err(e) = self.ctx.synchronize() {
            record_drop_error(e.into());
            return;
        }
        drop(kept);
        let deadline = Instant::now() + self.session.io_timeout();
        let _ = self.session.goodbye_and_wait(deadline);
    }

    /// Sends the pending releases (fast release path), in batches; `why` says who asked, for
    /// [`trace`].
    fn flush_releases(&self, why: Point) -> Result<()> {
        let Some(pending) = &self.pending else { return Ok(()) };
        loop {
            let buffers = lock_plain(&pending.batch).take(Instant::now());
            if buffers.is_empty() {
                return Ok(());
            }
            let traced = trace::is_enabled().then(|| buffers.clone());
            for id in traced.iter().flatten() {
                trace::mark(why, id.0);
            }
            // Every buffer taken was released after the event's handle was known.
            let handle = self.lock().release_event.as_ref().map(|(_, h)| *h);
            let sent = ignore_gone(self.session.release_batch(handle, buffers));
            for id in traced.iter().flatten() {
                trace::mark(Point::ImporterSent, id.0);
            }
            sent?;
        }
    }
}

/// A send that failed because the exporter is gone (or said Goodbye and closed) succeeds:
/// nobody is left to tell.
fn ignore_gone(result: Result<()>) -> Result<()> {
    match result {
        Err(Error::Closed | Error::ConnectionFailed | Error::WriteClosed) => Ok(()),
        other => other,
    }
}

fn lock_plain<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The flusher thread (fast release path): sends a batch once its oldest release has waited
/// the longest delay allowed, until the importer goes away.
fn flush_when_due(pending: &Pending, inner: &Weak<Inner>) {
    let mut batch = lock_plain(&pending.batch);
    while !pending.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        match batch.deadline() {
            None => {
                batch = pending.changed.wait(batch).unwrap_or_else(|p| p.into_inner());
            }
            Some(deadline) if deadline > now => {
                batch = pending
                    .changed
                    .wait_timeout(batch, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            Some(_) => {
                drop(batch);
                // Gone: its drop flushed what was left.
                let Some(inner) = inner.upgrade() else { return };
                if let Err(e) = inner.flush_releases(Point::ImporterSendOnTimer) {
                    record_drop_error(e);
                }
                drop(inner);
                batch = lock_plain(&pending.batch);
            }
        }
    }
}

impl VmmHost for Inner {
    fn device(&self) -> Device {
        self.device
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.synchronize()?)
    }

    fn hold(&self, id: BufferId) -> bool {
        self.lock().vmm.insert(id)
    }

    fn forget(&self, id: BufferId) {
        self.lock().vmm.remove(&id);
    }

    fn wait_event(&self, handle: &EventHandle, stream: StreamRef<'_>) -> Result<()> {
        let mut state = self.lock();
        let event = match state.events.entry(handle.0) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Arc::new(Event::open_ipc(&self.ctx, &IpcEventHandle(handle.0))?))
            }
        };
        Ok(stream.wait(event)?)
    }

    fn send_release(&self, id: BufferId) -> Result<()> {
        self.session.release(id)
    }

    fn reject(&self, err: Error) -> Error {
        self.session.reject(err)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(pending) = &self.pending {
            pending.stop.store(true, Ordering::Release);
            pending.changed.notify_all();
            // The releases still pending go out (with their event) before the Goodbye.
            if let Err(e) = self.flush_releases(Point::ImporterSendOther) {
                record_drop_error(e);
            }
        }
        // Every SharedBuffer holds an Arc of this, so the table holds no buffer unless a release
        // failed half-way; it holds the blocks this importer kept. Free them before saying
        // Goodbye (`ImportedPtr`'s drop synchronizes the context first).
        let leftovers = self.lock().table.drain();
        if !leftovers.is_empty() {
            if let Err(e) = self.ctx.synchronize() {
                record_drop_error(e.into());
            }
            drop(leftovers);
        }
        let mut released_all = true;
        if let Some((event, _)) = &self.lock().release_event {
            // Every use of what was released here is complete before the event goes.
            if let Err(e) = event.synchronize() {
                released_all = false;
                record_drop_error(e.into());
            }
        }
        if self.pending.is_some() && released_all {
            // The exporter waits on the release event when it reads a batch: keep the event (it
            // is destroyed with this) until the exporter has read everything and closed.
            let deadline = Instant::now() + self.session.io_timeout();
            let _ = self.session.goodbye_and_wait(deadline);
        } else {
            let _ = self.session.goodbye();
        }
    }
}

/// Finds the local device with the exporter's GPU, by UUID.
fn find_device(uuid: &DeviceUuid) -> Result<Device> {
    for device in Device::all()? {
        if device.uuid()?.0 == uuid.0 {
            return Ok(device);
        }
    }
    Err(Error::DeviceNotVisible { uuid: *uuid })
}

/// Checks that a block's `block_size` bytes from `imported` (the pointer the driver imported for
/// it) lie inside the allocation the driver reports for that pointer, `base..base+size`
/// (`cuMemGetAddressRange`). The block size comes from the exporter, another process: without
/// this check a block size larger than the allocation would give views over memory that the
/// import does not keep allocated.
fn check_block_in_allocation(
    d: &BufferDescriptor,
    imported: DeviceAddr,
    base: DeviceAddr,
    size: usize,
) -> std::result::Result<(), ProtocolError> {
    let start = imported.as_raw().checked_sub(base.as_raw());
    let end = start.and_then(|start| start.checked_add(d.block_size));
    match end {
        Some(end) if end <= size as u64 => Ok(()),
        _ => Err(ProtocolError::Violation {
            reason: format!(
                "buffer {}: {} claims {} bytes, but the allocation the driver imported for it holds {size} bytes \
                 at {base} (the block's pointer is {imported})",
                d.buffer_id, d.block_id, d.block_size
            ),
        }),
    }
}

#[cfg(test)]
mod tests;
