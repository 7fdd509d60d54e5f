//! The exporting process: serves a pool on a socket, shares buffers with importers, and frees
//! each buffer only when every holder has let go.
//!
//! [`Exporter`] (with [`ExporterOptions`], [`ImporterInfo`], [`ExporterStats`]) and
//! [`ExportedBuffer`] are public; their documentation is the guide. Inside, by concern:
//!
//! - `state`: what the exporter, its buffers and its threads share ([`Inner`](state::Inner));
//! - `release_wait`: how `wait_released` waits for its buffer's release (a slot of its own, spun
//!   on, then parked on), and the registry of those waits that the state keeps;
//! - `buffers`: [`ExportedBuffer`], and making (`alloc`, `adopt`) and sharing (`share`) buffers;
//! - `serve`: what the serving thread (the crate's `reactor`, one event loop for every
//!   connection) reports to the exporter, and the shutdown;
//! - `reclaim`: freeing, at once, deferred to the last release, or reclaimed from an importer
//!   that is gone (the lease table decides when);
//! - `vmm`: [`ExportedVmm`], VMM physical allocations (`alloc_vmm`) sent as descriptors
//!   (`share_vmm`), in the same lease table;
//! - `vmm_chunks`: ranges over several VMM physical allocations the caller owns (a service
//!   resource's chunks), sent as one descriptor per chunk (`share_vmm_chunks`), in the same lease
//!   table with no owner's reference.
//!
//! This file holds the public types and calls into those. `release_wait` imports none of
//! them; `buffers`, `serve` and `reclaim` import only `state` and `release_wait` (`reclaim` adds
//! the freeing methods to `Inner` that the other two call),
//! `vmm` imports `state` and `buffers`, `vmm_chunks` imports `state`, and none of them imports
//! this module.

mod buffers;
mod reclaim;
mod release_wait;
mod serve;
mod state;
mod vmm;
mod vmm_chunks;

use std::fmt;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use mempool_core::{DeviceAddr, MemPool, PhysicalAllocation, Stream, StreamRef};

pub use self::buffers::ExportedBuffer;
use self::state::{Inner, PoolSource, Projected, State};
pub use self::vmm::ExportedVmm;
use crate::error::{take_drop_errors, Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{BufferId, DeviceUuid, PoolId};
use crate::reactor::{Handler, Limits, Reactor};
use crate::session::PoolAnnouncement;
use mempool_socket::cred::PeerCredentials;
use mempool_socket::listener::{Listener, ListenerOptions};

/// How an [`Exporter`] listens, how many connections it serves, and how it shuts down.
///
/// One thread serves every connection (an `epoll` loop), so idle importers cost a socket each
/// and no thread. That thread also frees what an importer let go of last (a buffer released,
/// an importer gone): the pool's stream-ordered free, the `free` function given to
/// [`Exporter::adopt`] (which must not block), and for [`Exporter::alloc_vmm`] memory the
/// unmap, which waits for the device; no importer is served meanwhile. The limits bound what careless or hostile peers can take; `docs/ipc.md`
/// (*Limits and floods*) says what each one does under a flood.
#[derive(Clone, Debug)]
pub struct ExporterOptions {
    /// The socket file's mode, who may connect, and the connections' time limits.
    pub listener: ListenerOptions,
    /// How long shutting down (dropping the [`Exporter`]) waits for importers to release what
    /// they hold after the exporter said `Goodbye`. Buffers still held after it are not freed
    /// (an importer may still use them); the driver reclaims them when the pool is destroyed
    /// and the processes exit. Default: 10 s.
    pub shutdown_timeout: Duration,
    /// Connected importers at most. A connection beyond it is turned away with an `Error`
    /// message ([`Error::Refused`] at the importer). Default: 256, which with
    /// [`max_handshakes`](Self::max_handshakes) stays well inside the usual limit of 1,024 open
    /// descriptors (each connection costs the exporter one).
    pub max_importers: usize,
    /// Handshakes in flight at most. When all are taken, a new connection takes the place of
    /// the one that made the least progress (one that said nothing, the oldest first), which is
    /// closed: connections that never speak cannot keep a real importer out. Default: 64.
    pub max_handshakes: usize,
    /// Messages queued for one importer at most (beyond what its socket holds). An importer
    /// whose queue is full, or whose queue makes no progress for
    /// [`ConnectionOptions::io_timeout`](crate::ConnectionOptions::io_timeout), does not read: it
    /// is disconnected and its leases reclaimed as for one that died. Default: 1,024.
    pub send_queue_len: usize,
    /// Disconnects an importer when no message went either way for this long (its leases are
    /// then reclaimed as for one that died). Default: `None`, no limit (an importer may hold
    /// buffers for as long as it likes).
    pub idle_timeout: Option<Duration>,
    /// The shared-memory rings offered to importers that ask for them (protocol version 3,
    /// [`ImporterOptions::rings`](crate::ImporterOptions::rings)): one ring each way of this
    /// geometry per connection, in a sealed memfd passed at the handshake; `Buffer` frames then
    /// travel to the importer through shared memory and its releases come back the same way.
    /// Default: `Some` of [`Geometry::default`](crate::ring::Geometry) (256 slots of 256 bytes
    /// each way, about 130 KiB per connection). Slots must hold a `Buffer` frame: at least 208
    /// bytes ([`Exporter::new`] refuses smaller ones with [`Error::RingSlotTooSmall`]). `None`:
    /// not offered; such importers use the socket (version 2).
    pub rings: Option<crate::ring::Geometry>,
}

impl Default for ExporterOptions {
    fn default() -> Self {
        ExporterOptions {
            listener: ListenerOptions::default(),
            shutdown_timeout: Duration::from_secs(10),
            max_importers: 256,
            max_handshakes: 64,
            send_queue_len: 1024,
            idle_timeout: None,
            rings: Some(crate::ring::Geometry::default()),
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
    /// Buffers left unfreed at shutdown because an importer still held them (or kept their
    /// block imported).
    pub abandoned_buffers: u64,
    /// Blocks that importers keep imported (protocol version 2's fast release path): the
    /// exporter keeps each allocated until every importer that keeps it is gone.
    pub kept_blocks: usize,
    /// Buffers nobody holds whose free waits until no importer keeps their block imported (the
    /// last buffer of a kept block: it keeps the block allocated).
    pub parked_buffers: usize,
    /// Connections whose handshake is in flight.
    pub handshakes: usize,
    /// Importers whose connection ended uncleanly while they held buffers, whose processes the
    /// exporter waits to be gone before it frees those.
    pub awaiting_exit: usize,
    /// Processes the exporter watches for their end: one watch (a `pidfd`, or a poll) per
    /// process, however many of its importers it waits for.
    pub watched_processes: usize,
    /// Messages queued for importers and not yet taken by their sockets.
    pub queued_messages: usize,
    /// Connections turned away: access policy, another pid namespace, at
    /// [`ExporterOptions::max_importers`], or shutting down.
    pub refused_connections: u64,
    /// Handshakes closed to make room for newer connections
    /// ([`ExporterOptions::max_handshakes`]) or for lack of descriptors.
    pub evicted_handshakes: u64,
    /// Importers disconnected because they did not read what they were sent.
    pub stalled_importers: u64,
    /// Connections closed for a time limit (handshake, a frame begun, idle).
    pub timed_out_connections: u64,
    /// Times accepting paused because the process ran out of descriptors.
    pub accept_pauses: u64,
    /// Connections ended by an error of the peer's (a broken protocol, a release of what it does
    /// not hold, a failed socket). Counted here rather than kept for [`take_drop_errors`], so a
    /// hostile peer cannot crowd out the exporter's own failures there.
    pub peer_errors: u64,
}

/// Serves an exportable pool on a Unix socket and shares its buffers with importer processes.
///
/// An `Exporter` owns (or shares) a [`MemPool`] created with
/// [`HandleTypes::POSIX_FILE_DESCRIPTOR`](mempool_core::HandleTypes), listens on a Unix socket
/// path, and runs one thread that serves every connection: it accepts importers (within the
/// limits of [`ExporterOptions`]), runs their handshakes, sends what is queued for each as its
/// socket takes it, and takes their `Release` messages. Buffers are [`ExportedBuffer`]s:
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
/// Dropping it shuts down: no new connections (the socket file is removed), `Goodbye` to every
/// importer, a wait (at most [`ExporterOptions::shutdown_timeout`]) for importers to release what
/// they hold, then the connections close and the serving thread ends. [`ExportedBuffer`]s keep
/// working after that (they free on drop).
pub struct Exporter {
    inner: Arc<Inner>,
    shut: bool,
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
    /// The serving thread's spin over the rings after ring traffic, by default
    /// ([`Exporter::set_spin`]): 50 µs, a few round trips' worth of a release's way back
    /// (docs/measurements.md, "IPC exporter: the default spins"), so that releases that keep coming find the thread awake and ring no
    /// doorbell, while an exporter whose traffic stopped goes to sleep within 50 µs.
    pub const DEFAULT_SPIN: Duration = crate::reactor::DEFAULT_RING_SPIN;

    /// [`ExportedBuffer::wait_released`]'s spin before it parks, by default
    /// ([`Exporter::set_wait_spin`]): 50 µs. In a round trip the release comes well within that after
    /// the share (docs/measurements.md, "IPC exporter: the default spins"); with a window of buffers in flight per producer thread, the wait for the oldest lasts
    /// about one buffer's period per consumer (40 µs at 100,000 buffers per second over 4
    /// consumers). Within the spin a release costs the serving thread (which takes every
    /// importer's releases) no `FUTEX_WAKE`, and the waiter no wake-up; a wait spins on a slot of
    /// its own, so its cost is the waiting thread's CPU.
    pub const DEFAULT_WAIT_SPIN: Duration = Duration::from_micros(50);

    /// Serves `pool` (created with `HandleTypes::POSIX_FILE_DESCRIPTOR`) at `path`.
    ///
    /// Errors: [`Error::Core`] if the pool cannot be exported (created without the handle type,
    /// imported or default pool); [`Error::SocketPath`] or [`Error::Io`] if the socket cannot be
    /// bound (see [`ListenerOptions`]); [`Error::RingSlotTooSmall`] if
    /// [`ExporterOptions::rings`] has slots under 208 bytes.
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
        let release_stream = Stream::new(&ctx)?;
        let listener = Listener::bind_with(path, options.listener.clone())?;
        let connection = listener.connection_options();
        let limits = Limits {
            max_importers: options.max_importers,
            max_handshakes: options.max_handshakes,
            send_queue_len: options.send_queue_len,
            idle_timeout: options.idle_timeout,
            handshake_timeout: connection.handshake_timeout,
            io_timeout: connection.io_timeout,
            ring: options.rings,
        };
        let inner = Arc::new(Inner {
            reactor: OnceLock::new(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            waiters: std::sync::atomic::AtomicUsize::new(0),
            wait_spin_ns: state::Padded(std::sync::atomic::AtomicU64::new(
                Exporter::DEFAULT_WAIT_SPIN.as_nanos() as u64,
            )),
            after_events: Arc::new(Mutex::new(Vec::new())),
            free_stream,
            release_stream,
            shutting_down: AtomicBool::new(false),
            shutdown_timeout: options.shutdown_timeout,
            announcement,
            path: path.to_owned(),
            ctx,
            source,
        });
        let handler: Arc<dyn Handler> = inner.clone();
        let reactor = Reactor::start(listener, announcement, pool_fd, limits, handler)?;
        // Only this function sets it, once.
        let _ = inner.reactor.set(reactor);
        Ok(Exporter { inner, shut: false })
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
        buffers::alloc(&self.inner, bytes, stream)
    }

    /// Takes over a buffer suballocated from a larger allocation of the pool, for sharing:
    /// `ptr..ptr+len` must lie inside one live allocation of this exporter's pool (the driver
    /// finds it, `cuMemGetAddressRange`). That allocation is exported once, and the buffer
    /// travels as the allocation plus an offset, so small buffers need no driver allocation of
    /// their own.
    ///
    /// `free` gives the buffer back to whatever allocated it (for a mempool-rmm resource `mr`:
    /// `move |p, n, s| unsafe { mr.deallocate(p, n, s) }`); the exporter calls it once, when the
    /// last holder lets go, with the stream to order the free on. Until then the buffer (and so
    /// its block) stays allocated.
    ///
    /// When the last holder is an importer (its release, its `Goodbye`, its process's end),
    /// `free` runs on the exporter's serving thread, the one thread that serves every
    /// connection: while it runs no importer is served. It must not block: queue the free on
    /// the stream it is given (as a stream-ordered `deallocate` does) rather than synchronize,
    /// and take no lock that a thread waiting on this exporter may hold.
    ///
    /// Errors: [`Error::NotShareable`] if the range is not inside an allocation of this pool.
    ///
    /// # Safety
    /// The exporter checks that the range lies in a live allocation of its pool, but not who owns
    /// it, and the returned buffer reads and writes it from safe code (here and in importers):
    /// 1. `ptr..ptr+len` is memory the caller owns (for example a suballocation from a resource
    ///    over this exporter's pool) and hands over: from now on the caller neither uses nor frees
    ///    it except through the returned buffer and through `free`.
    /// 2. Work on it is ordered on `stream` (work queued there before this call may still use it).
    /// 3. `free(ptr, len, s)`, called once, returns exactly this memory to its owner, ordered on `s`.
    #[allow(unsafe_code)]
    pub unsafe fn adopt<'s, F, E>(
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
        // SAFETY: this function's caller keeps the same contract (points 1 to 3 above).
        unsafe { buffers::adopt(&self.inner, ptr, len, stream, free) }
    }

    /// Shares `buffer` with each importer in `to`: records an interprocess event on the
    /// buffer's stream (importers wait on it before they touch the memory, so queue the work
    /// that fills the buffer first), records the leases, and sends the buffer. A buffer can be
    /// shared again later with other importers (not with one that holds it already).
    ///
    /// The buffer is queued for each importer and this returns at once: the serving thread sends
    /// it as each importer's socket takes it, so an importer that does not read delays nobody.
    /// If an importer's connection ends before its copy went out, its lease is revoked then.
    ///
    /// Errors: [`Error::UnknownImporter`] (nothing is sent to anyone);
    /// [`LeaseError::AlreadyLeased`](crate::LeaseError::AlreadyLeased) (inside [`Error::Lease`]);
    /// [`Error::Share`] if one importer could not take it (its lease is revoked; the others
    /// got the buffer): its queue was full ([`Error::Stalled`] inside, and it is disconnected),
    /// or it is being disconnected.
    pub fn share(&self, buffer: &ExportedBuffer<'_>, to: &[ImporterId]) -> Result<()> {
        buffers::share(&self.inner, buffer, to)
    }

    /// Shares every buffer of `buffers` with each importer in `to`, in order, as [`Exporter::share`]
    /// does for one: each buffer's ready event (from the exporter's pool of interprocess events)
    /// is recorded on its stream, and the buffers are queued together, so the serving thread
    /// writes them in one go (into an importer's ring while it has room, protocol version 3) and an
    /// importer sleeping on [`Importer::recv_many`](crate::Importer::recv_many) is woken once for
    /// the lot.
    ///
    /// Errors: those of [`Exporter::share`], for the first buffer that fails; the buffers before it
    /// were shared, those after it were not.
    pub fn share_many(&self, buffers: &[&ExportedBuffer<'_>], to: &[ImporterId]) -> Result<()> {
        for buffer in buffers {
            buffers::share(&self.inner, buffer, to)?;
        }
        Ok(())
    }

    /// Allocates VMM physical memory for sharing as a file descriptor: `bytes` rounded up to the
    /// device's minimum granularity, created with `cuMemCreate` and the POSIX file-descriptor
    /// handle type on the pool's device, and mapped here with read-write access for that device
    /// (the exporter's own view of it). Work on it is ordered on `stream`, as for
    /// [`Exporter::alloc`]; it is freed (unmapped and released) when the last holder lets go.
    /// Unmapping is not stream-ordered: the free synchronizes the stream it is ordered on first,
    /// and when an importer let go last it runs on the serving thread, which serves no importer
    /// until it is done.
    ///
    /// Errors ([`Error::Core`]): the device lacks VMM or POSIX file-descriptor handles
    /// (`CapabilityMissing`, `VmmHandleTypeNotSupported`), out of memory (with the size), an
    /// empty size.
    pub fn alloc_vmm<'s>(&self, bytes: usize, stream: StreamRef<'s>) -> Result<ExportedVmm<'s>> {
        vmm::alloc_vmm(&self.inner, bytes, stream)
    }

    /// Shares a VMM allocation with each importer in `to`: records an interprocess event on its
    /// stream (importers wait on it before they touch the memory), records the leases, and sends
    /// each importer the allocation's file descriptor with its size and granularity. The importer
    /// maps it into addresses of its own ([`SharedVmm`](crate::SharedVmm)). Leases, releases,
    /// dead importers and shutdown work as for [`Exporter::share`].
    ///
    /// Errors, before anything is sent: [`Error::UnknownImporter`]; [`Error::VmmNotAccepted`] if
    /// an importer did not accept VMM sharing ([`ImporterOptions::accept_vmm`](crate::ImporterOptions::accept_vmm));
    /// [`Error::Core`] if the allocation cannot be exported;
    /// [`LeaseError::AlreadyLeased`](crate::LeaseError::AlreadyLeased). Then [`Error::Share`] for
    /// an importer that could not take it, as for [`Exporter::share`].
    pub fn share_vmm(&self, buffer: &ExportedVmm<'_>, to: &[ImporterId]) -> Result<()> {
        vmm::share_vmm(&self.inner, buffer, to)
    }

    /// Shares the range `offset..offset+len` of the physical `chunks` mapped back to back (the
    /// chunks of a growable reservation, such as those `mempool_rmm::ServiceResource::export` hands
    /// out; each may have its own size, a multiple of the device's minimum VMM granularity) with
    /// each importer in `to`, which maps them, in order and back to back, into addresses of its own
    /// ([`SharedVmmRange`](crate::SharedVmmRange)). Records an interprocess event on `stream`
    /// (importers wait on it before they touch the memory: queue the work that fills the range on
    /// `stream` first), records the leases, and sends each importer one `VmmChunks` message with a
    /// file descriptor and a size per chunk. Returns the range's id.
    ///
    /// The exporter keeps no reference of its own: `hold` (with the chunks) is kept until the last
    /// importer released the range, said `Goodbye`, or died and its process is gone, and then
    /// dropped after a synchronize of the stream the exporter frees on. A
    /// `mempool_rmm::ServiceExport` as the hold keeps its tag awake exactly that long. At shutdown,
    /// a range an importer still holds is abandoned: its hold is kept until the exporter itself is
    /// dropped (the importer's own handles keep the physical memory alive in its process).
    ///
    /// Errors, before anything is sent (`hold` is dropped at once): no importer, no chunks, more than
    /// [`MAX_VMM_CHUNKS`](crate::MAX_VMM_CHUNKS) of them, chunks of another device than the
    /// exporter's, not exportable as POSIX file descriptors, or whose size is not a multiple of the
    /// device's granularity, a range that is empty, does not start in the first chunk, runs past
    /// the last or does not reach it
    /// ([`Error::Core`] naming which); [`Error::UnknownImporter`]; [`Error::VmmNotAccepted`] if an
    /// importer did not accept VMM sharing ([`ImporterOptions::accept_vmm`](crate::ImporterOptions::accept_vmm),
    /// or an exporter too old for ranges); [`Error::Core`] if a chunk cannot be exported. Then
    /// [`Error::Share`] for an importer that could not take it, as for [`Exporter::share`] (the
    /// others hold it).
    pub fn share_vmm_chunks(
        &self,
        chunks: &[Arc<PhysicalAllocation>],
        offset: usize,
        len: usize,
        hold: Box<dyn Send + Sync>,
        stream: StreamRef<'_>,
        to: &[ImporterId],
    ) -> Result<BufferId> {
        vmm_chunks::share_vmm_chunks(&self.inner, chunks, offset, len, hold, stream, to)
    }

    /// Shares `buffer` with every importer connected now; returns who got it.
    pub fn share_with_all(&self, buffer: &ExportedBuffer<'_>) -> Result<Vec<ImporterId>> {
        let to: Vec<ImporterId> = self.importers().iter().map(|i| i.id).collect();
        self.share(buffer, &to)?;
        Ok(to)
    }

    /// Sets how long the exporter's serving thread keeps looking at the shared-memory rings after
    /// it drained releases from them, before it sleeps in `epoll` (default 50 µs,
    /// [`Exporter::DEFAULT_SPIN`]; `Duration::ZERO`: it sleeps at once, the behaviour before this setting
    /// existed). While it spins it reads each ring's head (the line the importer writes when it
    /// publishes: no lock, no system call), handles what it finds there, and keeps its waiting
    /// flags clear, so an importer that publishes a release rings no doorbell (no `RingBell`
    /// frame, no wake-up of the serving thread). It spins only within this time of the last ring
    /// traffic, so an idle exporter costs no CPU; while it spins it still asks `epoll` (without
    /// waiting) every few microseconds, so sockets and shares are not held up. It costs one CPU
    /// while it spins. Takes effect at once.
    ///
    /// [`ExportedBuffer::wait_released`]'s spin is set apart: [`Exporter::set_wait_spin`].
    pub fn set_spin(&self, spin: Duration) {
        if let Some(reactor) = self.inner.reactor.get() {
            reactor.set_ring_spin(spin);
        }
    }

    /// What [`Exporter::set_spin`] set.
    pub fn spin(&self) -> Duration {
        self.inner.reactor.get().map_or(Duration::ZERO, Reactor::ring_spin)
    }

    /// Sets how long [`ExportedBuffer::wait_released`] looks for its buffer's release before it
    /// parks its thread (default 50 µs,
    /// [`Exporter::DEFAULT_WAIT_SPIN`]; `Duration::ZERO`: it parks at once).
    /// Each wait spins on a slot of its own (a 128-byte line that only the thread taking the
    /// release writes, once): no lock, no system call, and no line that other threads write at
    /// every release, so threads waiting for different buffers do not disturb each other or the
    /// serving thread. A release that comes within the spin costs no wake-up (no `FUTEX_WAKE` on
    /// the serving thread, no thread woken); one that comes later unparks the waiter alone. Every
    /// waiting thread costs a CPU while it spins. Takes effect at the next wait.
    pub fn set_wait_spin(&self, spin: Duration) {
        self.inner.set_wait_spin(spin);
    }

    /// What [`Exporter::set_wait_spin`] set.
    pub fn wait_spin(&self) -> Duration {
        self.inner.wait_spin()
    }

    /// A snapshot of the bookkeeping.
    pub fn stats(&self) -> ExporterStats {
        let served = self.inner.reactor.get().map(Reactor::stats).unwrap_or_default();
        let state = self.inner.lock();
        ExporterStats {
            handshakes: served.handshakes,
            awaiting_exit: served.awaiting_exit,
            queued_messages: served.queued,
            refused_connections: served.refused,
            evicted_handshakes: served.evicted,
            stalled_importers: served.stalled,
            timed_out_connections: served.timed_out,
            accept_pauses: served.accept_pauses,
            watched_processes: served.watched_processes,
            peer_errors: served.peer_errors,
            importers: state.importers.len(),
            live_buffers: state.leases.len(),
            deferred_buffers: state.deferred,
            blocks: state.blocks.len(),
            freed_buffers: state.freed,
            reclaimed_buffers: state.reclaimed,
            abandoned_buffers: state.abandoned,
            kept_blocks: state.pins.len(),
            parked_buffers: state.pins.parked(),
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
    /// met while freeing buffers and in the serving thread's own work since the last
    /// [`take_drop_errors`].
    pub fn shutdown(mut self) -> Vec<Error> {
        self.shutdown_inner();
        take_drop_errors()
    }

    fn shutdown_inner(&mut self) {
        if !std::mem::replace(&mut self.shut, true) {
            serve::shut_down(&self.inner);
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.shutdown_inner();
    }
}

/// The connected importers, in id order.
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
