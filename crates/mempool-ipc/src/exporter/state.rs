//! The exporter's shared state: the records of blocks, buffers and importers that the
//! [`Exporter`](crate::Exporter), its [`ExportedBuffer`](crate::ExportedBuffer)s and its
//! serving thread share through [`Inner`], and how the pool is reached.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mempool_core::{Context, DeviceAddr, Event, EventFlags, MemPool, Stream, StreamRef};

use super::release_wait::{ReleaseWaiters, Signals};
use crate::error::{Error, Result};
use crate::lease::{BlockPins, ImporterId, LeaseTable};
use crate::protocol::{BlockId, BufferId, EventHandle, PointerDescriptor};
use crate::reactor::Reactor;
use crate::session::PoolAnnouncement;
use crate::trace;
use mempool_socket::cred::PeerCredentials;

/// Gives a buffer back: called once, with the buffer's address and length and the stream to order
/// the free on.
pub(super) type FreeFn = Box<dyn FnOnce(DeviceAddr, usize, StreamRef<'_>) -> Result<()> + Send>;

/// How a buffer is given back once nobody holds it.
pub(super) enum Freer {
    /// `cuMemFreeAsync` into the exporter's pool ([`Exporter::alloc`](crate::Exporter::alloc)).
    Pool,
    /// The function [`Exporter::adopt`](crate::Exporter::adopt) was given.
    Custom(FreeFn),
}

/// Where the exporter's pool lives: owned, shared, or inside another object (a memory resource).
pub(super) trait PoolSource: Send + Sync {
    fn pool(&self) -> &MemPool;
}

impl PoolSource for MemPool {
    fn pool(&self) -> &MemPool {
        self
    }
}

/// A pool inside another object: `project` finds it in `owner`.
pub(super) struct Projected<T> {
    pub(super) owner: Arc<T>,
    pub(super) project: fn(&T) -> &MemPool,
}

impl<T: Send + Sync> PoolSource for Projected<T> {
    fn pool(&self) -> &MemPool {
        (self.project)(&self.owner)
    }
}

/// An interprocess event and its handle, recycled once the buffer it ordered is freed.
pub(super) struct IpcEvent {
    pub(super) event: Event,
    pub(super) handle: EventHandle,
}

/// One exported block: a pool allocation that whole or suballocated buffers live in.
pub(super) struct BlockRecord {
    pub(super) id: BlockId,
    pub(super) size: u64,
    /// `cuMemPoolExportPointer` data, made on the first share.
    pub(super) pointer: Option<PointerDescriptor>,
    /// Live buffers in the block; the record goes when it reaches 0.
    pub(super) live: usize,
}

/// One live buffer, as the lease table keeps it.
pub(super) struct Shared {
    pub(super) ptr: DeviceAddr,
    pub(super) len: usize,
    pub(super) block_base: u64,
    pub(super) free: Option<Freer>,
    /// The interprocess events recorded for its shares; they must outlive every importer's wait.
    pub(super) events: Vec<IpcEvent>,
    /// Recorded on the owner's stream when the owner let go while importers still held it.
    pub(super) last_use: Option<Event>,
    /// Events (the exporter's own, recorded on its release stream after it waited on the
    /// importers' release events) that importers' uses of the buffer are ordered before: frees
    /// and the owner's later work wait on them (fast release path).
    pub(super) release_waits: Vec<Arc<AfterEvent>>,
}

impl Shared {
    /// Whether the buffer was suballocated (adopted): its block outlives it, so importers may
    /// keep the block imported.
    pub(super) fn suballocated(&self) -> bool {
        matches!(self.free, Some(Freer::Custom(_)))
    }

    /// Orders the buffer's free (and the owner's later waits) after `event` too.
    pub(super) fn wait_also(&mut self, event: &Arc<AfterEvent>) {
        if !self.release_waits.iter().any(|e| Arc::ptr_eq(e, event)) {
            self.release_waits.push(event.clone());
        }
    }
}

/// An event of the exporter's own, recorded on its release stream after a wait on an importer's
/// release event, that frees of the released buffers wait on. Made from [`Inner::after_event`]'s
/// pool, and back there once the last buffer ordered by it let go of it: every wait on it was
/// enqueued by then (`cuStreamWaitEvent` takes the recording of the moment), so its next
/// recording orders nothing that waited on this one.
pub(super) struct AfterEvent {
    event: Option<Event>,
    pool: Arc<Mutex<Vec<Event>>>,
}

impl std::ops::Deref for AfterEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        self.event.as_ref().expect("taken only when dropped")
    }
}

impl Drop for AfterEvent {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let mut pool = lock_plain(&self.pool);
            if pool.len() < MAX_POOLED_AFTER_EVENTS {
                pool.push(event);
            }
        }
    }
}

/// The most events [`AfterEvent`]s go back to; beyond, they are destroyed.
const MAX_POOLED_AFTER_EVENTS: usize = 64;

/// The most distinct release events one importer may use (it needs one).
pub(super) const MAX_RELEASE_EVENTS: usize = 8;

/// A connected importer (handshake done).
pub(super) struct Peer {
    pub(super) credentials: PeerCredentials,
    /// The capabilities its handshake granted (`protocol::CAP_*`).
    pub(super) capabilities: u64,
    /// Its release events, opened (`cuIpcOpenEventHandle`) on first use, by handle.
    pub(super) release_events: Vec<(EventHandle, Event)>,
}

/// Everything the exporter's threads share, under [`Inner::state`].
#[derive(Default)]
pub(super) struct State {
    pub(super) leases: LeaseTable<Shared>,
    pub(super) importers: BTreeMap<ImporterId, Peer>,
    /// Exported blocks by base address.
    pub(super) blocks: BTreeMap<u64, BlockRecord>,
    pub(super) idle_events: Vec<IpcEvent>,
    pub(super) next_buffer: u64,
    pub(super) next_block: u64,
    pub(super) deferred: usize,
    pub(super) freed: u64,
    pub(super) reclaimed: u64,
    pub(super) abandoned: u64,
    /// Buffers that could not be freed safely at shutdown; kept so their events stay alive.
    pub(super) leaked: Vec<Shared>,
    /// Blocks (by base address) that importers keep imported, and the last buffer of each,
    /// parked until they are gone.
    pub(super) pins: BlockPins<u64, (BufferId, Shared)>,
    /// Threads in [`ExportedBuffer::wait_released`](crate::ExportedBuffer::wait_released), and the
    /// buffer each waits for: signalled one by one ([`Inner::released_waiters`]), each through a
    /// slot of its own, not all at every change.
    pub(super) release_waiters: ReleaseWaiters,
}

impl State {
    /// Grants `id` to every importer of `to`, or to none: when a grant fails, the grants made before
    /// it are revoked and its error returned.
    pub(super) fn grant_all(&mut self, id: BufferId, to: &[ImporterId]) -> Result<()> {
        for (i, importer) in to.iter().enumerate() {
            if let Err(e) = self.leases.grant(id, *importer) {
                for granted in &to[..i] {
                    let _ = self.leases.revoke(id, *granted);
                }
                return Err(e.into());
            }
        }
        Ok(())
    }
}

/// The exporter's shared core: the [`Exporter`](crate::Exporter), every
/// [`ExportedBuffer`](crate::ExportedBuffer) and the serving thread (through the
/// [`Handler`](crate::reactor::Handler) it reports to) hold it.
pub(super) struct Inner {
    // Field order is drop order: everything that frees into the pool or waits on it goes first.
    /// The connections; set once the serving thread runs (it holds this `Inner`, so the
    /// exporter's shutdown stops it, which breaks the cycle).
    pub(super) reactor: OnceLock<Reactor>,
    pub(super) state: Mutex<State>,
    /// Signalled when the state changes ([`Inner::notify`]: not directly), for the threads in
    /// [`Inner::wait`].
    pub(super) changed: Condvar,
    /// Threads in [`Inner::wait`] now: a change with none costs no system call.
    pub(super) waiters: AtomicUsize,
    /// [`Exporter::set_wait_spin`](crate::Exporter::set_wait_spin): how long `wait_released` spins
    /// before it parks, in nanoseconds (read once per wait; a line of its own).
    pub(super) wait_spin_ns: Padded<AtomicU64>,
    /// Events for [`AfterEvent`]s, to be recorded again (no `cuEventCreate` per release batch).
    pub(super) after_events: Arc<Mutex<Vec<Event>>>,
    pub(super) free_stream: Stream,
    /// Where the exporter waits on importers' release events as they arrive (so that it never
    /// touches an importer's event later, when that importer may have destroyed it), recording
    /// its own event after each wait.
    pub(super) release_stream: Stream,
    pub(super) shutting_down: AtomicBool,
    pub(super) shutdown_timeout: Duration,
    pub(super) announcement: PoolAnnouncement,
    pub(super) path: PathBuf,
    pub(super) ctx: Arc<Context>,
    pub(super) source: Box<dyn PoolSource>,
}

impl Inner {
    /// Locks the state.
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        lock_plain(&self.state)
    }

    /// Waits for a change of the state ([`Inner::notify`]) until `deadline`; `None` once it has passed.
    pub(super) fn wait<'a>(&self, state: MutexGuard<'a, State>, deadline: Instant) -> Option<MutexGuard<'a, State>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        // Counted under the lock, before the wait releases it: a change made after this thread
        // looked at the state is made under the lock too, so its `notify` sees the count.
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let (state, _) = self
            .changed
            .wait_timeout(state, left)
            .unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        Some(state)
    }

    /// Tells the threads in [`Inner::wait`] that the state changed (call it after the change,
    /// with or without the lock). No system call when none waits.
    pub(super) fn notify(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            trace::count(trace::Counter::Notify);
            self.changed.notify_all();
        }
    }

    /// Tells every thread waiting for the state to change, including those waiting for a buffer's
    /// release: after changes that may take holders away from any buffer (an importer gone, a
    /// share undone).
    pub(super) fn notify_all_waiters(&self) {
        self.notify();
        let signals = self.lock().release_waiters.take_all();
        signals.send();
    }

    /// An event for an [`AfterEvent`], from the pool (or made: `DISABLE_TIMING`), not recorded yet.
    pub(super) fn after_event(&self) -> Result<AfterEvent> {
        let pooled = lock_plain(&self.after_events).pop();
        let event = match pooled {
            Some(event) => event,
            None => Event::new(&self.ctx, EventFlags::DISABLE_TIMING)?,
        };
        Ok(AfterEvent {
            event: Some(event),
            pool: self.after_events.clone(),
        })
    }

    /// How long `wait_released` spins before it parks.
    pub(super) fn wait_spin(&self) -> Duration {
        Duration::from_nanos(self.wait_spin_ns.0.load(Ordering::Relaxed))
    }

    /// Sets [`Inner::wait_spin`].
    pub(super) fn set_wait_spin(&self, spin: Duration) {
        let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
        self.wait_spin_ns.0.store(ns, Ordering::Relaxed);
    }

    /// Takes the waits for buffers that no importer holds any more, to be signalled
    /// ([`Signals::send`]) once the lock is released.
    pub(super) fn released_waiters(&self, state: &mut State) -> Signals {
        let State {
            leases,
            release_waiters,
            ..
        } = state;
        release_waiters.take_released(|id| leases.holders(id).next().is_some())
    }

    /// The connections.
    pub(super) fn reactor(&self) -> Result<&Reactor> {
        self.reactor.get().ok_or(Error::Refused {
            reason: "the exporter is not serving".into(),
        })
    }

    /// An interprocess event to order a share: a recycled one, or a new one.
    pub(super) fn take_event(&self) -> Result<IpcEvent> {
        if let Some(event) = self.lock().idle_events.pop() {
            return Ok(event);
        }
        let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS)?;
        let handle = EventHandle(event.ipc_handle()?.0);
        Ok(IpcEvent { event, handle })
    }
}

/// A value on a 128-byte line of its own (two 64-byte lines, as the adjacent-line prefetcher pairs
/// them): a setting read by spinning threads, kept away from the lines that locks and counters
/// other threads write make hot.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(super) struct Padded<T>(pub(super) T);

/// Locks `mutex`, whether or not a thread panicked while holding it.
pub(super) fn lock_plain<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
