//! The exporting process: serves a pool on a socket, shares buffers with importers, and frees
//! each buffer only when every holder has let go.
//!
//! [`Exporter`] (with [`ExporterOptions`], [`ImporterInfo`], [`ExporterStats`]) and
//! [`ExportedBuffer`] are public; their documentation is the guide. Inside, one thread accepts
//! importers (`accept_loop`) and one thread per importer runs the handshake and then takes its
//! `Release` messages (`serve`); the [`LeaseTable`] decides when a buffer is freed, and
//! [`Inner::finish`] frees it.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mempool_core::{memory, Context, DeviceAddr, Event, EventFlags, MemPool, Stream, StreamRef};
use rustix::event::{PollFd, PollFlags, Timespec};

use crate::conn::Connection;
use crate::cred::PeerCredentials;
use crate::error::{record_drop_error, take_drop_errors, Error, Result};
use crate::lease::{ImporterId, LeaseError, LeaseTable};
use crate::listener::{Listener, ListenerOptions};
use crate::session::{ExporterSession, ImporterEvent, PoolAnnouncement};
use crate::wire::{BlockId, BufferDescriptor, BufferId, DeviceUuid, EventHandle, PointerDescriptor, PoolId};

/// How an [`Exporter`] listens and shuts down.
#[derive(Clone, Debug)]
pub struct ExporterOptions {
    /// The socket file's mode, who may connect, and the connections' time limits.
    pub listener: ListenerOptions,
    /// How long shutting down (dropping the [`Exporter`]) waits for importers to release what
    /// they hold after the exporter said `Goodbye`. Buffers still held after it are not freed
    /// (an importer may still use them); the driver reclaims them when the pool is destroyed
    /// and the processes exit. Default: 10 s.
    pub shutdown_timeout: Duration,
}

impl Default for ExporterOptions {
    fn default() -> Self {
        ExporterOptions {
            listener: ListenerOptions::default(),
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

/// A connected importer, as [`Exporter::importers`] lists it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ImporterInfo {
    /// The exporter's name for the connection; pass it to [`Exporter::share`].
    pub id: ImporterId,
    /// The importer process's credentials (`SO_PEERCRED`).
    pub credentials: PeerCredentials,
}

/// A snapshot of an exporter's bookkeeping, for tests and monitoring.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ExporterStats {
    /// Connected importers (handshake done, connection open).
    pub importers: usize,
    /// Buffers not freed yet (held by the exporter or by an importer).
    pub live_buffers: usize,
    /// Buffers the exporter let go of that importers still hold (their free is deferred).
    pub deferred_buffers: usize,
    /// Exported blocks with at least one live buffer.
    pub blocks: usize,
    /// Buffers freed so far.
    pub freed_buffers: u64,
    /// Buffers freed because their last holder's connection ended without a release (an
    /// importer that died or broke the protocol).
    pub reclaimed_buffers: u64,
    /// Buffers left unfreed at shutdown because an importer still held them.
    pub abandoned_buffers: u64,
}

/// Gives a buffer back: called once, with the buffer's address and length and the stream to order
/// the free on.
type FreeFn = Box<dyn FnOnce(DeviceAddr, usize, StreamRef<'_>) -> Result<()> + Send>;

/// How a buffer is given back once nobody holds it.
enum Freer {
    /// `cuMemFreeAsync` into the exporter's pool ([`Exporter::alloc`]).
    Pool,
    /// The function [`Exporter::adopt`] was given.
    Custom(FreeFn),
}

/// Where the exporter's pool lives: owned, shared, or inside another object (a memory resource).
trait PoolSource: Send + Sync {
    fn pool(&self) -> &MemPool;
}

impl PoolSource for MemPool {
    fn pool(&self) -> &MemPool {
        self
    }
}

struct Projected<T> {
    owner: Arc<T>,
    project: fn(&T) -> &MemPool,
}

impl<T: Send + Sync> PoolSource for Projected<T> {
    fn pool(&self) -> &MemPool {
        (self.project)(&self.owner)
    }
}

/// An interprocess event and its handle, recycled once the buffer it ordered is freed.
struct IpcEvent {
    event: Event,
    handle: EventHandle,
}

/// One exported block: a pool allocation that whole or suballocated buffers live in.
struct BlockRecord {
    id: BlockId,
    size: u64,
    /// `cuMemPoolExportPointer` data, made on the first share.
    pointer: Option<PointerDescriptor>,
    /// Live buffers in the block; the record goes when it reaches 0.
    live: usize,
}

/// One live buffer, as the lease table keeps it.
struct Shared {
    ptr: DeviceAddr,
    len: usize,
    block_base: u64,
    free: Option<Freer>,
    /// The interprocess events recorded for its shares; they must outlive every importer's wait.
    events: Vec<IpcEvent>,
    /// Recorded on the owner's stream when the owner let go while importers still held it.
    last_use: Option<Event>,
}

struct Peer {
    session: Arc<ExporterSession>,
    credentials: PeerCredentials,
}

#[derive(Default)]
struct State {
    leases: LeaseTable<Shared>,
    importers: BTreeMap<ImporterId, Peer>,
    /// Exported blocks by base address.
    blocks: BTreeMap<u64, BlockRecord>,
    idle_events: Vec<IpcEvent>,
    /// Connection threads that have not finished (they may still free buffers).
    serving: usize,
    next_buffer: u64,
    next_block: u64,
    next_importer: u64,
    deferred: usize,
    freed: u64,
    reclaimed: u64,
    abandoned: u64,
    /// Buffers that could not be freed safely at shutdown; kept so their events stay alive.
    leaked: Vec<Shared>,
}

struct Inner {
    // Field order is drop order: everything that frees into the pool or waits on it goes first.
    state: Mutex<State>,
    changed: Condvar,
    free_stream: Stream,
    threads: Mutex<Vec<JoinHandle<()>>>,
    shutting_down: AtomicBool,
    shutdown_deadline: Mutex<Option<Instant>>,
    shutdown_timeout: Duration,
    announcement: PoolAnnouncement,
    path: PathBuf,
    ctx: Arc<Context>,
    pool_fd: OwnedFd,
    source: Box<dyn PoolSource>,
}

/// Serves an exportable pool on a Unix socket and shares its buffers with importer processes.
///
/// An `Exporter` owns (or shares) a [`MemPool`] created with
/// [`HandleTypes::POSIX_FILE_DESCRIPTOR`](mempool_core::HandleTypes), listens on a Unix socket
/// path, and runs one thread that accepts importers and one thread per importer that runs the
/// handshake and then takes its `Release` messages. Buffers are [`ExportedBuffer`]s:
///
/// - [`Exporter::alloc`] allocates a whole buffer from the pool (a block of its own);
/// - [`Exporter::adopt`] takes over a buffer suballocated from a larger pool allocation (by a
///   `PoolResource` or `BinningResource` of mempool-rmm over the exporter's pool), with the
///   function that gives it back: the allocation that contains it is exported once and the
///   buffer travels as that block plus an offset.
///
/// [`Exporter::share`] records an interprocess event on the buffer's stream (so importers use
/// the memory only after the work queued so far) and sends the buffer to the importers named.
/// Dropping the [`ExportedBuffer`] is the exporter's own release; the memory is freed when the
/// last holder lets go: the exporter, or the last importer to release it, say `Goodbye`, or die
/// (the exporter then waits for the importer's process to be gone before it frees, so that no
/// GPU work of the dead process can still touch the memory).
///
/// ```no_run
/// # fn main() -> Result<(), mempool_ipc::Error> {
/// use std::time::Duration;
/// use mempool_core::{Device, HandleTypes, MemPool, PoolProps, Stream};
/// use mempool_ipc::{Exporter, ExporterOptions};
///
/// let dev = Device::get(0)?;
/// let pool = MemPool::new(&dev, &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR))?;
/// let exporter = Exporter::new("/run/user/1000/pool.sock", pool, ExporterOptions::default())?;
/// let importers = exporter.wait_for_importers(1, Duration::from_secs(30))?;
/// let stream = Stream::new(&dev.context()?)?;
/// let buf = exporter.alloc(1 << 20, stream.as_ref())?;
/// // ... queue work that fills `buf` on `stream` ...
/// exporter.share(&buf, &[importers[0].id])?;
/// drop(buf); // freed once the importer has released it too
/// # Ok(()) }
/// ```
///
/// Dropping it shuts down: no new connections, `Goodbye` to every importer, a wait (at most
/// [`ExporterOptions::shutdown_timeout`]) for importers to release what they hold, then the
/// connections close. [`ExportedBuffer`]s keep working after that (they free on drop).
pub struct Exporter {
    inner: Arc<Inner>,
    accept: Option<JoinHandle<()>>,
}

impl fmt::Debug for Exporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exporter")
            .field("path", &self.inner.path)
            .field("pool_id", &self.inner.announcement.pool_id)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Exporter {
    /// Serves `pool` (created with `HandleTypes::POSIX_FILE_DESCRIPTOR`) at `path`.
    ///
    /// Errors: [`Error::Core`] if the pool cannot be exported (created without the handle type,
    /// imported or default pool); [`Error::SocketPath`] or [`Error::Io`] if the socket cannot be
    /// bound (see [`ListenerOptions`]).
    pub fn new(path: impl AsRef<Path>, pool: MemPool, options: ExporterOptions) -> Result<Exporter> {
        Exporter::start(path.as_ref(), Box::new(pool), options)
    }

    /// Like [`Exporter::new`], for a pool that other code also uses through an `Arc`.
    pub fn with_shared_pool(path: impl AsRef<Path>, pool: Arc<MemPool>, options: ExporterOptions) -> Result<Exporter> {
        Exporter::with_pool_in(path, pool, |p| p, options)
    }

    /// Like [`Exporter::new`], for a pool that lives inside another object, such as a
    /// `mempool_rmm::AsyncResource` that a `PoolResource` suballocates from:
    /// `Exporter::with_pool_in(path, async_resource.clone(), AsyncResource::pool, options)`.
    pub fn with_pool_in<T: Send + Sync + 'static>(
        path: impl AsRef<Path>,
        owner: Arc<T>,
        project: fn(&T) -> &MemPool,
        options: ExporterOptions,
    ) -> Result<Exporter> {
        Exporter::start(path.as_ref(), Box::new(Projected { owner, project }), options)
    }

    fn start(path: &Path, source: Box<dyn PoolSource>, options: ExporterOptions) -> Result<Exporter> {
        let pool = source.pool();
        let pool_fd = pool.export_fd()?;
        let ctx = pool.context().clone();
        let uuid = pool.device().uuid()?;
        let announcement = PoolAnnouncement {
            device_uuid: DeviceUuid(uuid.0),
            pool_id: PoolId::generate(),
        };
        let free_stream = Stream::new(&ctx)?;
        let listener = Listener::bind_with(path, options.listener)?;
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            free_stream,
            threads: Mutex::new(Vec::new()),
            shutting_down: AtomicBool::new(false),
            shutdown_deadline: Mutex::new(None),
            shutdown_timeout: options.shutdown_timeout,
            announcement,
            path: path.to_owned(),
            ctx,
            pool_fd,
            source,
        });
        let accept_inner = inner.clone();
        let accept = std::thread::Builder::new()
            .name("mempool-ipc-accept".into())
            .spawn(move || accept_loop(accept_inner, listener))?;
        Ok(Exporter {
            inner,
            accept: Some(accept),
        })
    }

    /// The pool being served.
    pub fn pool(&self) -> &MemPool {
        self.inner.source.pool()
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The pool's identity, as importers see it.
    pub fn pool_id(&self) -> PoolId {
        self.inner.announcement.pool_id
    }

    /// The importers connected now (handshake done), in id order.
    pub fn importers(&self) -> Vec<ImporterInfo> {
        let state = self.inner.lock();
        importer_infos(&state)
    }

    /// Waits until at least `count` importers are connected; returns them all.
    /// [`Error::WaitTimeout`] if they are not there within `timeout`.
    pub fn wait_for_importers(&self, count: usize, timeout: Duration) -> Result<Vec<ImporterInfo>> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        while state.importers.len() < count {
            state = self.inner.wait(state, deadline).ok_or_else(|| Error::WaitTimeout {
                what: format!("{count} importers to connect"),
            })?;
        }
        Ok(importer_infos(&state))
    }

    /// Allocates `bytes` from the pool, ordered on `stream`, as a buffer that can be shared.
    /// The buffer is a block of its own; it is freed on `stream` when dropped, or later on the
    /// exporter's internal stream if importers still hold it.
    pub fn alloc<'s>(&self, bytes: usize, stream: StreamRef<'s>) -> Result<ExportedBuffer<'s>> {
        if bytes == 0 {
            return Err(mempool_core::Error::InvalidArgument("a shared buffer cannot be empty".into()).into());
        }
        let ptr = self.pool().allocate(bytes, stream)?;
        let mut state = self.inner.lock();
        let block_base = ptr.as_raw();
        let id = BlockId(state.next_block);
        state.next_block += 1;
        state.blocks.insert(
            block_base,
            BlockRecord {
                id,
                size: bytes as u64,
                pointer: None,
                live: 1,
            },
        );
        self.register(state, ptr, bytes, block_base, Freer::Pool, stream)
    }

    /// Takes over a buffer suballocated from a larger allocation of the pool, for sharing:
    /// `ptr..ptr+len` must lie inside one live allocation of this exporter's pool (the driver
    /// finds it, `cuMemGetAddressRange`). That allocation is exported once, and the buffer
    /// travels as the allocation plus an offset, so small buffers need no driver allocation of
    /// their own.
    ///
    /// `free` gives the buffer back to whatever allocated it (for a mempool-rmm resource `mr`:
    /// `move |p, n, s| mr.deallocate(p, n, s)`); the exporter calls it once, when the last
    /// holder lets go, with the stream to order the free on. Until then the buffer (and so its
    /// block) stays allocated.
    ///
    /// Errors: [`Error::NotShareable`] if the range is not inside an allocation of this pool.
    pub fn adopt<'s, F, E>(
        &self,
        ptr: DeviceAddr,
        len: usize,
        stream: StreamRef<'s>,
        free: F,
    ) -> Result<ExportedBuffer<'s>>
    where
        F: FnOnce(DeviceAddr, usize, StreamRef<'_>) -> std::result::Result<(), E> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let not_shareable = |reason: String| Error::NotShareable {
            ptr: ptr.as_raw(),
            len,
            reason,
        };
        if ptr.is_null() || len == 0 {
            return Err(not_shareable(
                "a shared buffer needs an address and at least one byte".into(),
            ));
        }
        let end = ptr
            .as_raw()
            .checked_add(len as u64)
            .ok_or_else(|| not_shareable("the range overflows".into()))?;
        let known = {
            let state = self.inner.lock();
            find_block(&state, ptr.as_raw(), end)
        };
        let (base, size) = match known {
            Some(block) => block,
            None => {
                let (base, size) = memory::address_range(&self.inner.ctx, ptr)
                    .map_err(|e| not_shareable(format!("the driver does not know the address: {e}")))?;
                let owner = memory::pool_of(base)?;
                if owner != self.pool().as_raw() {
                    return Err(not_shareable(
                        "the allocation that contains it does not come from the exporter's pool".into(),
                    ));
                }
                if end > base.as_raw() + size as u64 {
                    return Err(not_shareable(format!(
                        "it runs past the end of its allocation ({base} + {size} bytes)"
                    )));
                }
                (base.as_raw(), size as u64)
            }
        };
        let free: FreeFn = Box::new(move |ptr, len, stream| {
            free(ptr, len, stream).map_err(|e| Error::Free {
                buffer: BufferId(0),
                source: Box::new(e),
            })
        });
        let mut state = self.inner.lock();
        // Another thread may have registered (or retired) the block meanwhile.
        match state.blocks.get_mut(&base) {
            Some(block) if block.size == size => block.live += 1,
            Some(_) => {
                return Err(not_shareable(
                    "its allocation changed while it was being looked up; retry".into(),
                ))
            }
            None => {
                let id = BlockId(state.next_block);
                state.next_block += 1;
                state.blocks.insert(
                    base,
                    BlockRecord {
                        id,
                        size,
                        pointer: None,
                        live: 1,
                    },
                );
            }
        }
        self.register(state, ptr, len, base, Freer::Custom(free), stream)
    }

    fn register<'s>(
        &self,
        mut state: MutexGuard<'_, State>,
        ptr: DeviceAddr,
        len: usize,
        block_base: u64,
        free: Freer,
        stream: StreamRef<'s>,
    ) -> Result<ExportedBuffer<'s>> {
        let id = BufferId(state.next_buffer);
        state.next_buffer += 1;
        state.leases.insert(
            id,
            Shared {
                ptr,
                len,
                block_base,
                free: Some(free),
                events: Vec::new(),
                last_use: None,
            },
        )?;
        Ok(ExportedBuffer {
            inner: self.inner.clone(),
            id,
            ptr,
            len,
            stream,
            released: false,
        })
    }

    /// Shares `buffer` with each importer in `to`: records an interprocess event on the
    /// buffer's stream (importers wait on it before they touch the memory, so queue the work
    /// that fills the buffer first), records the leases, and sends the buffer. A buffer can be
    /// shared again later with other importers (not with one that holds it already).
    ///
    /// Errors: [`Error::UnknownImporter`] (nothing is sent to anyone); [`LeaseError::AlreadyLeased`];
    /// [`Error::Share`] if sending to one importer failed (its lease is revoked; the others
    /// received the buffer).
    pub fn share(&self, buffer: &ExportedBuffer<'_>, to: &[ImporterId]) -> Result<()> {
        if to.is_empty() {
            return Ok(());
        }
        let event = self.inner.take_event()?;
        event.event.record(buffer.stream)?;
        let handle = event.handle;
        let mut state = self.inner.lock();
        let mut sessions = Vec::with_capacity(to.len());
        for importer in to {
            match state.importers.get(importer) {
                Some(peer) => sessions.push((*importer, peer.session.clone())),
                None => {
                    state.idle_events.push(event);
                    return Err(Error::UnknownImporter { importer: *importer });
                }
            }
        }
        for (i, importer) in to.iter().enumerate() {
            if let Err(e) = state.leases.grant(buffer.id, *importer) {
                for granted in &to[..i] {
                    let _ = state.leases.revoke(buffer.id, *granted);
                }
                state.idle_events.push(event);
                return Err(e.into());
            }
        }
        let descriptor = match self.inner.describe(&mut state, buffer, handle) {
            Ok(descriptor) => descriptor,
            Err(e) => {
                for importer in to {
                    let _ = state.leases.revoke(buffer.id, *importer);
                }
                state.idle_events.push(event);
                return Err(e);
            }
        };
        if let Some(shared) = state.leases.get_mut(buffer.id) {
            shared.events.push(event);
        }
        drop(state);

        let mut first_error = None;
        for (importer, session) in sessions {
            if let Err(e) = session.share(&descriptor) {
                // The owner still holds the buffer, so revoking frees nothing. The connection's
                // thread may have counted the importer out already (NotLeased): nothing to undo.
                let _ = self.inner.lock().leases.revoke(buffer.id, importer);
                first_error.get_or_insert(Error::Share {
                    buffer: buffer.id,
                    importer,
                    source: Box::new(e),
                });
            }
        }
        self.inner.changed.notify_all();
        first_error.map_or(Ok(()), Err)
    }

    /// Shares `buffer` with every importer connected now; returns who got it.
    pub fn share_with_all(&self, buffer: &ExportedBuffer<'_>) -> Result<Vec<ImporterId>> {
        let to: Vec<ImporterId> = self.importers().iter().map(|i| i.id).collect();
        self.share(buffer, &to)?;
        Ok(to)
    }

    /// A snapshot of the bookkeeping.
    pub fn stats(&self) -> ExporterStats {
        let state = self.inner.lock();
        ExporterStats {
            importers: state.importers.len(),
            live_buffers: state.leases.len(),
            deferred_buffers: state.deferred,
            blocks: state.blocks.len(),
            freed_buffers: state.freed,
            reclaimed_buffers: state.reclaimed,
            abandoned_buffers: state.abandoned,
        }
    }

    /// Waits until no buffer is live any more (every buffer freed), for tests and orderly
    /// shutdowns. [`Error::WaitTimeout`] after `timeout`.
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        // A deferred buffer leaves the lease table before its free is queued: wait for both.
        while !state.leases.is_empty() || state.deferred > 0 {
            let live = state.leases.len() + state.deferred;
            state = self.inner.wait(state, deadline).ok_or_else(|| Error::WaitTimeout {
                what: format!("{live} live buffers to be freed"),
            })?;
        }
        Ok(())
    }

    /// Shuts down now (what dropping does), so that errors are not silent: returns the errors
    /// met while freeing buffers and serving connections since the last
    /// [`take_drop_errors`].
    pub fn shutdown(mut self) -> Vec<Error> {
        self.shutdown_inner();
        take_drop_errors()
    }

    fn shutdown_inner(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        let inner = &self.inner;
        *lock_plain(&inner.shutdown_deadline) = Some(Instant::now() + inner.shutdown_timeout);
        inner.shutting_down.store(true, Ordering::Release);
        let _ = accept.join();
        let deadline = Instant::now() + inner.shutdown_timeout;
        let sessions: Vec<_> = inner.lock().importers.values().map(|p| p.session.clone()).collect();
        for session in &sessions {
            let _ = session.goodbye();
        }
        // Importers release what they hold (or disconnect); wait for that, bounded.
        let mut state = inner.lock();
        while state.leases.importers().next().is_some() {
            match inner.wait(state, deadline) {
                Some(s) => state = s,
                None => {
                    state = inner.lock();
                    break;
                }
            }
        }
        let sessions: Vec<_> = state.importers.values().map(|p| p.session.clone()).collect();
        drop(state);
        for session in sessions {
            session.connection().shutdown();
        }
        let threads = std::mem::take(&mut *lock_plain(&inner.threads));
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.shutdown_inner();
    }
}

/// A buffer the exporter can share, ordered on a stream like a
/// [`PoolBuffer`](mempool_core::PoolBuffer). Made by [`Exporter::alloc`] and [`Exporter::adopt`].
///
/// Dropping it is the exporter's own release: the memory is freed on its stream at once if no
/// importer holds it, otherwise after the last importer releases it (on the exporter's internal
/// stream, ordered after the work queued on this buffer's stream before the drop).
pub struct ExportedBuffer<'s> {
    inner: Arc<Inner>,
    id: BufferId,
    ptr: DeviceAddr,
    len: usize,
    stream: StreamRef<'s>,
    released: bool,
}

impl fmt::Debug for ExportedBuffer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedBuffer")
            .field("id", &self.id)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<'s> ExportedBuffer<'s> {
    /// The buffer's id (what importers release).
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The device address.
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: shared buffers are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the buffer is ordered on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream
    }

    /// The importers holding the buffer now, in id order.
    pub fn holders(&self) -> Vec<ImporterId> {
        self.inner.lock().leases.holders(self.id).collect()
    }

    /// Waits until no importer holds the buffer (each released it, said `Goodbye` or died).
    /// Their work on it is complete then: importers synchronize before they release, and a dead
    /// importer's process is gone. [`Error::WaitTimeout`] after `timeout`.
    pub fn wait_released(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        while state.leases.holders(self.id).next().is_some() {
            let id = self.id;
            state = self.inner.wait(state, deadline).ok_or_else(|| Error::WaitTimeout {
                what: format!("importers to release buffer {id}"),
            })?;
        }
        Ok(())
    }

    /// Lets go of the buffer (what dropping does) and reports errors instead of recording them.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.inner.release_owner(self.id, self.stream)
    }
}

impl Drop for ExportedBuffer<'_> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if let Err(e) = self.inner.release_owner(self.id, self.stream) {
            record_drop_error(e);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock_plain(&self.state)
    }

    /// Waits for a change of the state until `deadline`; `None` once it has passed.
    fn wait<'a>(&self, state: MutexGuard<'a, State>, deadline: Instant) -> Option<MutexGuard<'a, State>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let (state, _) = self
            .changed
            .wait_timeout(state, left)
            .unwrap_or_else(|p| p.into_inner());
        Some(state)
    }

    fn take_event(&self) -> Result<IpcEvent> {
        if let Some(event) = self.lock().idle_events.pop() {
            return Ok(event);
        }
        let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS)?;
        let handle = EventHandle(event.ipc_handle()?.0);
        Ok(IpcEvent { event, handle })
    }

    /// The `Buffer` message for `buffer`, exporting its block's pointer on first use.
    fn describe(&self, state: &mut State, buffer: &ExportedBuffer<'_>, event: EventHandle) -> Result<BufferDescriptor> {
        let base = state
            .leases
            .get(buffer.id)
            .map(|s| s.block_base)
            .ok_or(LeaseError::UnknownBuffer { buffer: buffer.id })?;
        let block = state
            .blocks
            .get_mut(&base)
            .ok_or(LeaseError::UnknownBuffer { buffer: buffer.id })?;
        let pointer = match block.pointer {
            Some(pointer) => pointer,
            None => {
                let data = self.source.pool().export_pointer(DeviceAddr(base))?;
                let pointer = PointerDescriptor(data.0);
                block.pointer = Some(pointer);
                pointer
            }
        };
        Ok(BufferDescriptor {
            buffer_id: buffer.id,
            block_id: block.id,
            block_size: block.size,
            offset: buffer.ptr.as_raw() - base,
            size: buffer.len as u64,
            pointer,
            ready_event: Some(event),
        })
    }

    fn release_owner(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        let held = self.lock().leases.holders(id).next().is_some();
        // Importers hold it: the deferred free must come after the owner's last use, which is on
        // `stream`. Record that before letting go, so a release that arrives meanwhile sees it.
        let last_use = if held {
            let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING)?;
            event.record(stream)?;
            Some(event)
        } else {
            None
        };
        let mut state = self.lock();
        let freed = state.leases.release_owner(id)?;
        match freed {
            Some(shared) => {
                drop(state);
                self.finish(id, shared, stream, false)
            }
            None => {
                if let Some(shared) = state.leases.get_mut(id) {
                    shared.last_use = last_use;
                }
                state.deferred += 1;
                Ok(())
            }
        }
    }

    /// Frees a buffer nobody holds any more, ordered on `stream`.
    fn finish(&self, id: BufferId, mut shared: Shared, stream: StreamRef<'_>, deferred: bool) -> Result<()> {
        let mut result = Ok(());
        if let Some(last_use) = shared.last_use.take() {
            result = stream.wait(&last_use).map_err(Error::from);
        }
        if result.is_ok() {
            result = match shared.free.take() {
                Some(Freer::Custom(free)) => free(shared.ptr, shared.len, stream).map_err(|e| match e {
                    Error::Free { source, .. } => Error::Free { buffer: id, source },
                    other => other,
                }),
                // SAFETY: the pointer came from `allocate` on this pool (`Exporter::alloc`) and is
                // freed once: the lease table hands each record out once and `take` empties it.
                // Every holder is done: the owner's last use is on `stream` (or `stream` waits for
                // it, above), importers synchronized before releasing or are gone.
                #[allow(unsafe_code)]
                Some(Freer::Pool) => unsafe { self.source.pool().free_async(shared.ptr, stream) }.map_err(Error::from),
                None => Ok(()),
            };
        }
        let mut state = self.lock();
        if let Some(block) = state.blocks.get_mut(&shared.block_base) {
            block.live -= 1;
            if block.live == 0 {
                state.blocks.remove(&shared.block_base);
            }
        }
        if deferred {
            state.deferred = state.deferred.saturating_sub(1);
        }
        state.freed += 1;
        // Every importer that waited on these events has released (or is gone), and the free is
        // queued: they can order the next buffer.
        state.idle_events.append(&mut shared.events);
        drop(state);
        self.changed.notify_all();
        result
    }

    /// Frees buffers whose last holder was an importer, on the internal stream.
    fn finish_deferred(&self, freed: Vec<(BufferId, Shared)>) {
        for (id, shared) in freed {
            if let Err(e) = self.finish(id, shared, self.free_stream.as_ref(), true) {
                record_drop_error(e);
            }
        }
    }
}

fn lock_plain<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn importer_infos(state: &State) -> Vec<ImporterInfo> {
    state
        .importers
        .iter()
        .map(|(id, peer)| ImporterInfo {
            id: *id,
            credentials: peer.credentials,
        })
        .collect()
}

/// The known block that contains `start..end`, as (base, size).
fn find_block(state: &State, start: u64, end: u64) -> Option<(u64, u64)> {
    let (&base, block) = state.blocks.range(..=start).next_back()?;
    (end <= base + block.size).then_some((base, block.size))
}

fn accept_loop(inner: Arc<Inner>, listener: Listener) {
    while !inner.shutting_down.load(Ordering::Acquire) {
        let (conn, credentials) = match listener.accept_timeout(Duration::from_millis(100)) {
            Ok(accepted) => accepted,
            Err(Error::Timeout { .. }) | Err(Error::PeerCredentials { .. }) => continue,
            Err(e) => {
                record_drop_error(e);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = {
            let mut state = inner.lock();
            let id = ImporterId(state.next_importer);
            state.next_importer += 1;
            state.serving += 1;
            id
        };
        // Opened now, while the peer is surely alive, so a recycled pid cannot fool the wait.
        let pidfd = rustix::process::Pid::from_raw(credentials.pid)
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        let serve_inner = inner.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("mempool-ipc-importer-{}", id.0))
            .spawn(move || serve(serve_inner, id, conn, credentials, pidfd));
        match spawned {
            Ok(thread) => {
                let mut threads = lock_plain(&inner.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(thread);
            }
            Err(e) => {
                inner.lock().serving -= 1;
                record_drop_error(e.into());
            }
        }
    }
}

/// Serves one importer: the handshake, then its releases until it leaves.
fn serve(inner: Arc<Inner>, id: ImporterId, conn: Connection, credentials: PeerCredentials, pidfd: Option<OwnedFd>) {
    let session = match ExporterSession::handshake(conn, inner.announcement, inner.pool_fd.as_fd()) {
        Ok(session) => Arc::new(session),
        Err(e) => {
            inner.lock().serving -= 1;
            inner.changed.notify_all();
            if !matches!(e, Error::Closed) {
                record_drop_error(e);
            }
            return;
        }
    };
    {
        let mut state = inner.lock();
        state.importers.insert(
            id,
            Peer {
                session: session.clone(),
                credentials,
            },
        );
    }
    inner.changed.notify_all();
    if inner.shutting_down.load(Ordering::Acquire) {
        let _ = session.goodbye();
    }

    let clean = loop {
        match session.recv() {
            Ok(ImporterEvent::Release(buffer)) => {
                let released = inner.lock().leases.release(buffer, id);
                match released {
                    Ok(freed) => {
                        inner.finish_deferred(freed.map(|s| (buffer, s)).into_iter().collect());
                        inner.changed.notify_all();
                    }
                    Err(e) => {
                        // A release of something it does not hold: the importer is broken.
                        // Treat it as gone, but it may still use what it holds: wait for it.
                        record_drop_error(session.reject(e.into()));
                        break false;
                    }
                }
            }
            Ok(ImporterEvent::Goodbye) => break true,
            Err(_) => break false,
        }
    };
    inner.lock().importers.remove(&id);
    inner.changed.notify_all();
    session.connection().shutdown();

    let holds = inner.lock().leases.leases_of(id).next().is_some();
    // After `Goodbye` the importer has freed every import. Otherwise its process may still run
    // GPU work on the memory until it is gone: wait for that before freeing.
    let safe = clean || !holds || wait_for_exit(&inner, credentials.pid, pidfd.as_ref());
    let mut state = inner.lock();
    if safe {
        let freed = state.leases.disconnect(id);
        if !clean {
            state.reclaimed += freed.len() as u64;
        }
        drop(state);
        inner.finish_deferred(freed);
        state = inner.lock();
    } else {
        // Shutting down and the importer outlived the timeout: its buffers are not freed.
        let kept = state.leases.disconnect(id);
        state.abandoned += kept.len() as u64;
        state.leaked.extend(kept.into_iter().map(|(_, s)| s));
    }
    state.serving -= 1;
    drop(state);
    inner.changed.notify_all();
}

/// Waits until the process `pid` is gone. `false` if the exporter shuts down and its deadline
/// passes first.
fn wait_for_exit(inner: &Inner, pid: i32, pidfd: Option<&OwnedFd>) -> bool {
    let tick = Duration::from_millis(50);
    loop {
        let gone = match pidfd {
            Some(fd) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                let timeout = Timespec::try_from(tick).unwrap_or(Timespec { tv_sec: 0, tv_nsec: 0 });
                matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
            }
            // No pidfd (kernels before 5.3): poll for the pid's existence.
            None => match rustix::process::Pid::from_raw(pid) {
                Some(p) => {
                    let gone = rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH);
                    if !gone {
                        std::thread::sleep(tick);
                    }
                    gone
                }
                None => true,
            },
        };
        if gone {
            return true;
        }
        if inner.shutting_down.load(Ordering::Acquire) {
            let deadline = *lock_plain(&inner.shutdown_deadline);
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
        }
    }
}
