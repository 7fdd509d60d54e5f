//! Streams: owned ([`Stream`]) and borrowed ([`StreamRef`]), the one type APIs take to name a stream.
//! (`wait` on an event is implemented in `event`, which builds on this module.)
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::raw::{self, sys, DriverFailure, FailureKind};
use crate::types::StreamId;

bitflags::bitflags! {
    /// Flags for [`Stream::with_flags`] (`CUstream_flags`).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct StreamFlags: u32 {
        /// Work on the stream does not synchronise with the legacy default stream.
        const NON_BLOCKING = 1;
    }
}

/// An owned CUDA stream, destroyed on drop (work already queued still runs). Keeps its context alive.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{Device, Stream};
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::new(&ctx)?;
/// stream.synchronize()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Stream {
    ctx: Arc<Context>,
    raw: Handle<sys::CUstream_st>,
    // The stream's id ([`StreamRef::key`]), asked once when the value was made, so that the views of an
    // owned stream key bookkeeping without a driver call; `None` when the driver would not tell then.
    id: Option<StreamId>,
    // Some for a stream shared with cudarc (`Stream::from_cudarc`): cudarc owns the driver stream and
    // destroys it when its last `Arc` goes, so `Drop` leaves it alone.
    #[cfg(feature = "cudarc")]
    cudarc: Option<Arc<cudarc::driver::CudaStream>>,
}

impl Stream {
    /// A new stream in `ctx` with default flags (`cuStreamCreate`).
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        Stream::with_flags(ctx, StreamFlags::empty())
    }

    /// A new stream in `ctx` with `flags`.
    pub fn with_flags(ctx: &Arc<Context>, flags: StreamFlags) -> Result<Stream> {
        let _g = ctx.bind()?;
        let raw = raw::stream::create(flags.bits())?;
        // SAFETY: `raw` was just created in the bound context.
        #[allow(unsafe_code)]
        let id = unsafe { own_id(raw as usize) };
        Ok(Stream {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            id,
            #[cfg(feature = "cudarc")]
            cudarc: None,
        })
    }

    /// A borrowed view of this stream, valid while `self` lives, that knows the stream's context
    /// ([`StreamRef::context`] is `Some`). The same as `StreamRef::from(&stream)`.
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef {
            raw: self.raw.get() as usize,
            ctx: Some(&self.ctx),
            id: self.id,
        }
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUstream`, valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawStream {
        self.raw.get()
    }

    /// Blocks until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.as_ref().synchronize()
    }

    /// Gives up ownership: the caller must destroy the returned handle (e.g. through [`Stream::from_raw`]).
    ///
    /// A stream shared with cudarc (feature `cudarc`: `Stream::from_cudarc`) keeps cudarc's `Arc`
    /// forever (it is leaked), so cudarc never destroys the handle and the caller's obligation is the same;
    /// but other holders of that `Arc` may still queue work on the stream: destroy it only once they are
    /// done. Prefer dropping such a stream.
    pub fn into_raw(self) -> (Arc<Context>, crate::types::RawStream) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so moving the `Arc` out of it leaves exactly one owner.
        #[allow(unsafe_code)]
        let ctx = unsafe { std::ptr::read(&this.ctx) };
        (ctx, this.raw.get())
    }

    /// Takes ownership of a stream handle.
    ///
    /// # Safety
    /// 1. `raw` is a live stream of `ctx`, created by `cuStreamCreate` (not a special handle).
    /// 2. Nothing else destroys it: the returned value destroys it on drop.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(ctx: Arc<Context>, raw: crate::types::RawStream) -> Stream {
        // SAFETY: point 1: a live stream of `ctx`, which is bound for the question.
        let id = unsafe { bound_own_id(&ctx, raw as usize) };
        Stream {
            ctx,
            raw: Handle::new(raw),
            id,
            #[cfg(feature = "cudarc")]
            cudarc: None,
        }
    }

    /// A stream that shares cudarc's ownership of `stream`, whose context is `ctx`.
    ///
    /// # Safety
    /// 1. `stream`'s `CUcontext` is `ctx`'s (`Stream::from_cudarc` checks it): the stream's calls bind
    ///    `ctx`, and work queued on it runs in that context.
    #[cfg(feature = "cudarc")]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn shared_with_cudarc(ctx: Arc<Context>, stream: Arc<cudarc::driver::CudaStream>) -> Stream {
        // SAFETY: cudarc's stream is live while its `Arc` is (held below), a stream of `ctx` (point 1).
        let id = unsafe { bound_own_id(&ctx, stream.cu_stream() as usize) };
        Stream {
            ctx,
            raw: Handle::new(stream.cu_stream()),
            id,
            cudarc: Some(stream),
        }
    }

    /// The cudarc stream this stream shares ownership with: `Some` for a stream made by
    /// [`Stream::from_cudarc`] or [`Stream::new_cudarc`], `None` for one mempool created alone.
    #[cfg(feature = "cudarc")]
    pub fn cudarc_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        self.cudarc.as_ref()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        #[cfg(feature = "cudarc")]
        if self.cudarc.take().is_some() {
            // cudarc owns the driver stream: dropping our `Arc` (just done) lets it destroy the stream
            // once its last `Arc` goes.
            return;
        }
        // SAFETY: the stream was created by `cuStreamCreate` (or handed over by `from_raw`'s contract),
        // is owned only by `self`, and no borrowed `StreamRef` outlives `self`.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::stream::destroy(self.raw.get()) } {
            crate::drop_errors::record(e.into());
        }
    }
}

impl<'a> From<&'a Stream> for StreamRef<'a> {
    /// The same as [`Stream::as_ref`].
    fn from(stream: &'a Stream) -> StreamRef<'a> {
        stream.as_ref()
    }
}

/// A borrowed stream, the one type this crate's APIs take to name a stream: an owned [`Stream`]'s view,
/// a special stream, or a raw handle from another library (cudarc, PyTorch, C). `Copy`, like RMM's
/// `cuda_stream_view`; the lifetime ties it to the stream's owner where Rust can see one.
///
/// A view made from a [`Stream`] (`stream.as_ref()` or `StreamRef::from(&stream)`) also carries the
/// stream's context ([`StreamRef::context`]), so code handed only a `StreamRef` can bind the right
/// context; the special streams and [`StreamRef::from_raw`] carry none until one is attached with
/// [`StreamRef::in_context`].
///
/// **A handle is not a stream's identity.** The special handles name a stream of the calling thread's
/// current context: 0 and [`StreamRef::LEGACY`] the context's legacy default stream, [`StreamRef::PER_THREAD`]
/// (`CU_STREAM_PER_THREAD`) the *calling thread's* per-thread default stream, a different stream on each
/// thread. And a stream created after another was destroyed may get the dead one's handle. Bookkeeping
/// that is kept per stream (a suballocator's free lists, the stream an allocation was made on) is keyed
/// by [`StreamRef::key`], the driver's id of the stream, resolved on the calling thread; something kept
/// to be used later, perhaps on another thread, is a [`KeptStream`].
///
/// Equality and hashing compare handles, as handles (0 and 1 both name the legacy default stream, so they
/// are equal): two views of one stream are equal whether or not they know its context, and two
/// `PER_THREAD` views are equal, though on two threads they name two streams. Compare
/// [`StreamRef::key`]s for "the same stream".
///
/// ```
/// use mempool_core::StreamRef;
/// assert_ne!(StreamRef::LEGACY, StreamRef::PER_THREAD);
/// assert!(StreamRef::LEGACY.context().is_none());
/// ```
#[derive(Copy, Clone)]
pub struct StreamRef<'a> {
    // Stored as an integer: the value is an opaque driver handle, passed to the driver.
    raw: usize,
    ctx: Option<&'a Arc<Context>>,
    // The stream's id, when the view knows it: a view of an owned `Stream`, which asked once. Never set for
    // a special handle (the per-thread stream's id depends on the thread that asks).
    id: Option<StreamId>,
}

/// `CU_STREAM_LEGACY`: the legacy default stream of the current context, as 0 is in the driver calls
/// mempool makes (the entry points without `_ptsz`).
const LEGACY_HANDLE: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream of the current context.
const PER_THREAD_HANDLE: usize = 0x2;

/// The handle as equality and keys see it: the legacy stream's two handles as one.
fn canonical(raw: usize) -> usize {
    if raw == 0 {
        LEGACY_HANDLE
    } else {
        raw
    }
}

impl PartialEq for StreamRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        canonical(self.raw) == canonical(other.raw)
    }
}

impl Eq for StreamRef<'_> {}

impl Hash for StreamRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        canonical(self.raw).hash(state);
    }
}

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamRef").field("raw", &self.raw).finish()
    }
}

impl StreamRef<'static> {
    /// The legacy default stream (`0`): synchronises with all blocking streams of its context, and uses
    /// whichever context is current on the thread that queues work. Knows no context; attach one with
    /// [`StreamRef::in_context`].
    pub const LEGACY: StreamRef<'static> = StreamRef {
        raw: 0x0,
        ctx: None,
        id: None,
    };
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`): on each thread, that thread's own stream of
    /// the current context (see [`StreamRef::key`] and [`KeptStream`]). Knows no context.
    pub const PER_THREAD: StreamRef<'static> = StreamRef {
        raw: PER_THREAD_HANDLE,
        ctx: None,
        id: None,
    };
}

impl<'a> StreamRef<'a> {
    /// Borrows a raw stream handle owned elsewhere. The view knows no context; attach one with
    /// [`StreamRef::in_context`].
    ///
    /// # Safety
    /// 1. `raw` is a live stream (or a special handle) for all of `'a`.
    /// 2. Until a context is attached ([`StreamRef::in_context`]), it is used where mempool binds the
    ///    context of the object it is given to (a pool's, a resource's, a buffer's): it is a stream of
    ///    that context, or a special handle.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(raw: crate::types::RawStream) -> StreamRef<'a> {
        StreamRef {
            raw: raw as usize,
            ctx: None,
            id: None,
        }
    }

    /// The context the stream belongs to, where the view knows it: `Some` for a view of a [`Stream`] or
    /// one given a context with [`StreamRef::in_context`]; `None` for [`StreamRef::LEGACY`],
    /// [`StreamRef::PER_THREAD`] and [`StreamRef::from_raw`].
    pub fn context(&self) -> Option<&'a Arc<Context>> {
        self.ctx
    }

    /// The same stream, known to belong to `ctx` (for instance `StreamRef::LEGACY.in_context(&ctx)`: the
    /// legacy stream of `ctx`). Replaces any context the view knew. Nothing checks that the stream
    /// belongs to `ctx`; APIs that rely on the pairing say so in their contract (e.g.
    /// [`crate::BufferView::new`]).
    pub fn in_context<'b>(self, ctx: &'b Arc<Context>) -> StreamRef<'b>
    where
        'a: 'b,
    {
        StreamRef {
            raw: self.raw,
            ctx: Some(ctx),
            id: self.id,
        }
    }

    /// The raw `CUstream`.
    pub fn as_raw(&self) -> crate::types::RawStream {
        self.raw as sys::CUstream
    }

    /// The handle's value (for logs, and for handing the handle on as an integer). Not the stream's
    /// identity: see [`StreamRef::key`].
    pub fn handle(&self) -> usize {
        self.raw
    }

    /// Whether this is a handle of the legacy default stream (0 or `CU_STREAM_LEGACY`).
    pub fn is_legacy(&self) -> bool {
        canonical(self.raw) == LEGACY_HANDLE
    }

    /// Whether this is the per-thread default stream's handle (`CU_STREAM_PER_THREAD`), which names the
    /// calling thread's own stream.
    pub fn is_per_thread(&self) -> bool {
        self.raw == PER_THREAD_HANDLE
    }

    /// The stream's identity, what per-stream bookkeeping is keyed by: the driver's id of the stream the
    /// handle names *on the calling thread* (`cuStreamGetId`), with the view's context bound when it knows
    /// one, else in the thread's current context. So the per-thread default stream has a different key on
    /// every thread, the legacy stream one key per context whichever of its handles names it, and a
    /// stream created at a dead stream's address a key of its own.
    ///
    /// A view of an owned [`Stream`] answers without a driver call (the stream asked once); the special
    /// streams' ids are kept per thread and context after the first call; a raw handle is asked each time
    /// (its address may be a new stream's). On a driver without `cuStreamGetId` (before CUDA 12.0) the
    /// key is mempool's own (see [`StreamId`]); while the driver refuses the question for a stream being
    /// captured into a graph, the key this thread last saw for the handle, else mempool's own.
    pub fn key(&self) -> Result<StreamId> {
        match self.id {
            Some(id) => Ok(id),
            None => resolve(self.raw, self.ctx.map(|c| &**c)),
        }
    }

    /// [`StreamRef::key`] with `ctx` bound when the view knows no context (a special or raw handle used with
    /// an object of `ctx`: a resource, a pool).
    pub fn key_in(&self, ctx: &Context) -> Result<StreamId> {
        match self.id {
            Some(id) => Ok(id),
            None => resolve(self.raw, Some(self.ctx.map_or(ctx, |c| &**c))),
        }
    }

    /// This stream, kept to be used later, perhaps on another thread (see [`KeptStream`]).
    pub fn kept(self) -> KeptStream<'a> {
        KeptStream::new(self)
    }

    /// Blocks until all work queued on the stream is done, with the view's context bound when it knows one.
    pub fn synchronize(&self) -> Result<()> {
        // A special handle (the legacy or per-thread stream) means the stream of the current context: bind
        // the context this view knows, so that a thread with no current context synchronizes the right one.
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: a `StreamRef` is a live stream or a special handle for its lifetime (its constructors'
        // contracts).
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::synchronize(self.as_raw()) };
        Ok(r?)
    }

    /// Whether all work queued on the stream has completed.
    pub fn is_idle(&self) -> Result<bool> {
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: as in `synchronize`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::query(self.as_raw()) };
        Ok(r?)
    }

    /// Whether the stream is being captured into a CUDA graph (`cuStreamIsCapturing`): while it is, work
    /// that synchronizes the device or the stream is illegal and would invalidate the capture.
    pub fn is_capturing(&self) -> Result<bool> {
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: as in `synchronize`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::is_capturing(self.as_raw()) };
        Ok(r?)
    }
}

/// A stream kept to be used again later, perhaps on another thread: a buffer's stream (its copies and its
/// free), the stream an allocation was made on (its free, when a framework frees without naming one).
///
/// The per-thread default stream's handle names the calling thread's stream: kept by thread A, it names
/// another stream on thread B, which would order nothing after A's work. So a `KeptStream` remembers
/// which thread kept the per-thread stream, and [`KeptStream::here`] gives, on another thread, the
/// legacy default stream instead: work queued on the legacy stream waits for the work already queued on
/// every blocking stream of its context, and the per-thread default streams are blocking streams (the
/// driver's "Stream synchronization behavior"). Nothing can name thread A's per-thread stream from thread
/// B, so this is the one stream ordered after it there. Every other stream is the same stream on every
/// thread, and is kept as it is.
///
/// What becomes of a per-thread stream's queued work for the legacy stream's ordering once its thread has
/// ended is not documented: [`KeptStream::order_here`] (what the frees and copies of mempool's buffers and
/// of the CuPy and PyTorch entry points use) therefore keeps the keeping thread from ending while it
/// queues work on the legacy stream on that thread's behalf, and once the thread has ended, synchronizes
/// the context first.
#[derive(Copy, Clone, Debug)]
pub struct KeptStream<'a> {
    stream: StreamRef<'a>,
    // The serial of the thread that kept a per-thread stream (`NO_THREAD` for any other stream; `ANY`
    // when the thread could not be told, so that no thread takes it for its own).
    thread: u64,
}

/// [`KeptStream::thread`] of a stream that is the same on every thread.
const NO_THREAD: u64 = 0;
/// [`KeptStream::thread`] of a per-thread stream kept by a thread that could not be told (it was ending).
const UNKNOWN_THREAD: u64 = u64::MAX;

impl<'a> KeptStream<'a> {
    /// Keeps `stream`, remembering the calling thread when it is the per-thread default stream.
    pub fn new(stream: StreamRef<'a>) -> KeptStream<'a> {
        let thread = if stream.is_per_thread() {
            // The thread is registered as a keeper (until it ends) the first time it keeps its stream.
            KEEPER.try_with(|k| k.serial).unwrap_or(UNKNOWN_THREAD)
        } else {
            NO_THREAD
        };
        KeptStream { stream, thread }
    }

    /// The stream as it was given. On another thread than the one that kept it, a per-thread stream's
    /// handle names that thread's stream: use [`KeptStream::here`] to order work.
    pub fn as_kept(&self) -> StreamRef<'a> {
        self.stream
    }

    /// Whether the kept stream is the stream its handle names on the calling thread: always, but for a
    /// per-thread default stream kept by another thread.
    pub fn is_here(&self) -> bool {
        self.thread == NO_THREAD || (self.thread != UNKNOWN_THREAD && thread_serial() == Some(self.thread))
    }

    /// A stream on which work queued from the calling thread is ordered after the work queued on the kept
    /// stream so far: the kept stream itself, or, for a per-thread default stream kept by another thread,
    /// the legacy default stream (with the kept view's context, if it knew one). See the type's
    /// documentation.
    pub fn here(&self) -> StreamRef<'a> {
        if self.is_here() {
            self.stream
        } else {
            StreamRef {
                raw: 0,
                ctx: self.stream.ctx,
                id: None,
            }
        }
    }

    /// Calls `f` with a stream on which the work `f` queues is ordered after the work queued so far on the
    /// kept stream, and returns what `f` returns: the kept stream itself ([`KeptStream::is_here`]); for a
    /// per-thread default stream kept by another thread that is still running, the legacy stream
    /// ([`KeptStream::here`]), that thread being kept from ending until `f` returns; for one whose thread
    /// has ended, the legacy stream after the context `ctx` gives is synchronized (the error of that, and
    /// `f` not called, if it fails). `ctx` is asked only then.
    ///
    /// `f` must not itself call `order_here` for a stream kept by the same other thread.
    pub fn order_here<R, E: From<Error>>(
        &self,
        ctx: impl FnOnce() -> Result<Arc<Context>>,
        f: impl FnOnce(StreamRef<'a>) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        if self.is_here() {
            return f(self.stream);
        }
        let keeper = KEEPERS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&self.thread)
            .cloned();
        if let Some(keeper) = keeper {
            let running = keeper.running.read().unwrap_or_else(PoisonError::into_inner);
            if *running {
                // The thread cannot end (its `Keeper` waits for this guard) until `f` has queued its work.
                let r = f(self.here());
                drop(running);
                return r;
            }
        }
        ctx()?.synchronize()?;
        f(self.here())
    }
}

/// A thread that kept its per-thread stream ([`KeptStream::new`]), while it runs.
struct Keeper {
    /// True until the thread ends. Read-held by other threads while they queue work on the legacy stream
    /// on behalf of this thread's per-thread stream ([`KeptStream::order_here`]); the thread's end takes
    /// it for writing, so its per-thread stream outlives what they queue.
    running: RwLock<bool>,
}

/// The running keepers, by thread serial.
static KEEPERS: Mutex<BTreeMap<u64, Arc<Keeper>>> = Mutex::new(BTreeMap::new());

/// A thread's entry in [`KEEPERS`], made the first time it keeps its per-thread stream and dropped when
/// the thread ends.
struct KeeperEntry {
    serial: u64,
    keeper: Arc<Keeper>,
}

impl KeeperEntry {
    fn register() -> KeeperEntry {
        let serial = thread_serial().unwrap_or(UNKNOWN_THREAD);
        let keeper = Arc::new(Keeper {
            running: RwLock::new(true),
        });
        if serial != UNKNOWN_THREAD {
            KEEPERS
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(serial, keeper.clone());
        }
        KeeperEntry { serial, keeper }
    }
}

impl Drop for KeeperEntry {
    fn drop(&mut self) {
        *self.keeper.running.write().unwrap_or_else(PoisonError::into_inner) = false;
        KEEPERS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.serial);
    }
}

/// The source of thread serials: 0 and `u64::MAX` are never handed out.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's serial, taken on first use: unlike the OS thread id, never reused in the process.
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    /// This thread as a keeper of its per-thread stream, once it kept it.
    static KEEPER: KeeperEntry = KeeperEntry::register();
    /// The stream ids this thread resolved ([`resolve`]), newest last.
    static RESOLVED: RefCell<Vec<Resolved>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's serial; `None` while the thread's locals are being destroyed.
fn thread_serial() -> Option<u64> {
    THREAD.try_with(|t| *t).ok()
}

/// An id this thread got from the driver: for a special handle, the stream it names on this thread in the
/// context `ctx` (authoritative: that stream lives as long as the thread and the context); for a raw
/// handle (`ctx` 0), what the handle named when last asked, used only while the driver refuses to answer
/// (a stream being captured).
#[derive(Copy, Clone)]
struct Resolved {
    ctx: usize,
    handle: usize,
    id: StreamId,
}

/// The most ids [`RESOLVED`] keeps per thread (the oldest goes first).
const RESOLVED_KEPT: usize = 32;

fn cached(ctx: usize, handle: usize) -> Option<StreamId> {
    RESOLVED
        .try_with(|r| {
            r.try_borrow()
                .ok()?
                .iter()
                .rev()
                .find(|e| e.ctx == ctx && e.handle == handle)
                .map(|e| e.id)
        })
        .ok()
        .flatten()
}

fn remember(ctx: usize, handle: usize, id: StreamId) {
    let _ = RESOLVED.try_with(|r| {
        if let Ok(mut r) = r.try_borrow_mut() {
            r.retain(|e| !(e.ctx == ctx && e.handle == handle));
            if r.len() >= RESOLVED_KEPT {
                r.remove(0);
            }
            r.push(Resolved { ctx, handle, id });
        }
    });
}

/// The top bit marks the ids mempool makes itself ([`fallback`]): the driver's ids count up from small
/// numbers and never reach it.
const OWN_IDS: u64 = 1 << 63;
/// Below [`OWN_IDS`], marks mempool's ids of per-thread streams (the rest is a thread serial); a created
/// stream's own id is its handle (an address, far below this bit).
const OWN_PER_THREAD_IDS: u64 = 1 << 62;

/// mempool's own id of the stream `raw` names on the calling thread, where the driver gives none: the
/// legacy stream one id, the per-thread stream one per thread, a created stream its handle.
fn fallback(raw: usize) -> StreamId {
    match canonical(raw) {
        LEGACY_HANDLE => StreamId::from_value(OWN_IDS),
        PER_THREAD_HANDLE => {
            // A thread being torn down gets a serial no thread has: its stream then shares no key.
            let serial = thread_serial().unwrap_or_else(|| NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
            StreamId::from_value(OWN_IDS | OWN_PER_THREAD_IDS | (serial & (OWN_PER_THREAD_IDS - 1)))
        }
        h => StreamId::from_value(OWN_IDS | (h as u64 & (OWN_PER_THREAD_IDS - 1))),
    }
}

/// What the driver said when asked for a stream's id.
enum Asked {
    Id(StreamId),
    /// The driver has no `cuStreamGetId` (before CUDA 12.0).
    NoSymbol,
    /// A stream-capture error: the driver would not answer while a capture is under way.
    Refused,
}

/// Asks the driver for the id of the stream `handle` names on this thread, in the current context.
///
/// # Safety
/// 1. `handle` is a live stream or a special handle.
#[allow(unsafe_code)]
unsafe fn ask(handle: usize) -> std::result::Result<Asked, DriverFailure> {
    // SAFETY: point 1.
    match unsafe { raw::stream::id(handle as sys::CUstream) } {
        Ok(v) => Ok(Asked::Id(StreamId::from_value(v))),
        Err(e) if matches!(e.kind, FailureKind::SymbolMissing { .. }) => Ok(Asked::NoSymbol),
        Err(e)
            if e.code().is_some_and(|c| {
                (sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as u32
                    ..=sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD as u32)
                    .contains(&c)
            }) =>
        {
            Ok(Asked::Refused)
        }
        Err(e) => Err(e),
    }
}

/// The id of the stream `raw` names on the calling thread, with `ctx` bound when given (else in the
/// current context): [`StreamRef::key`].
fn resolve(raw: usize, ctx: Option<&Context>) -> Result<StreamId> {
    let handle = canonical(raw);
    let special = handle == LEGACY_HANDLE || handle == PER_THREAD_HANDLE;
    // Special handles are cached per context; raw handles are not (an address may be a new stream's).
    let ctx_key = if special {
        match ctx {
            Some(c) => c.as_raw() as usize,
            None => raw::context::current()? as usize,
        }
    } else {
        0
    };
    if special {
        if let Some(id) = cached(ctx_key, handle) {
            return Ok(id);
        }
    }
    let _bound = ctx.map(Context::bind).transpose()?;
    // SAFETY: a `StreamRef` is a live stream or a special handle for its lifetime (its constructors'
    // contracts), and `handle` is its handle (the legacy stream's named as `CU_STREAM_LEGACY`).
    #[allow(unsafe_code)]
    let asked = unsafe { ask(handle) }?;
    Ok(match asked {
        Asked::Id(id) => {
            remember(ctx_key, handle, id);
            id
        }
        Asked::NoSymbol => fallback(raw),
        Asked::Refused => cached(ctx_key, handle).unwrap_or_else(|| fallback(raw)),
    })
}

/// The id of a stream just made or handed over, in the current context: `None` when the driver would not
/// answer now (asked again at each [`StreamRef::key`]) or failed.
///
/// # Safety
/// 1. `raw` is a live stream (not a special handle) of the current context.
#[allow(unsafe_code)]
unsafe fn own_id(raw: usize) -> Option<StreamId> {
    // SAFETY: point 1.
    match unsafe { ask(raw) } {
        Ok(Asked::Id(id)) => Some(id),
        Ok(Asked::NoSymbol) => Some(fallback(raw)),
        Ok(Asked::Refused) | Err(_) => None,
    }
}

/// [`own_id`] with `ctx` bound.
///
/// # Safety
/// 1. `raw` is a live stream of `ctx` (not a special handle).
#[allow(unsafe_code)]
unsafe fn bound_own_id(ctx: &Context, raw: usize) -> Option<StreamId> {
    let _bound = ctx.bind().ok()?;
    // SAFETY: point 1, with `ctx` current.
    unsafe { own_id(raw) }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn views_compare_and_hash_by_handle_only() {
        let ctx = Context::unretained_for_tests(0);
        let other = Context::unretained_for_tests(1);
        let plain = StreamRef::LEGACY;
        let attached = StreamRef::LEGACY.in_context(&ctx);
        assert_eq!(plain, attached);
        assert_eq!(attached, StreamRef::LEGACY.in_context(&other));
        assert_ne!(attached, StreamRef::PER_THREAD.in_context(&ctx));
        let set: HashSet<StreamRef<'_>> = [plain, attached, StreamRef::LEGACY.in_context(&other)].into();
        assert_eq!(set.len(), 1);
        assert_eq!(format!("{attached:?}"), "StreamRef { raw: 0 }");
    }

    #[test]
    fn in_context_attaches_and_replaces_the_context() {
        let ctx = Context::unretained_for_tests(0);
        let other = Context::unretained_for_tests(1);
        assert!(StreamRef::LEGACY.context().is_none());
        assert!(StreamRef::PER_THREAD.context().is_none());
        let s = StreamRef::PER_THREAD.in_context(&ctx);
        assert!(Arc::ptr_eq(s.context().unwrap(), &ctx));
        assert_eq!(s.handle(), StreamRef::PER_THREAD.handle());
        let t = s.in_context(&other);
        assert!(Arc::ptr_eq(t.context().unwrap(), &other));
        // SAFETY: the view is never used to reach the driver.
        #[allow(unsafe_code)]
        let raw = unsafe { StreamRef::from_raw(0x1234 as sys::CUstream) };
        assert!(raw.context().is_none());
        assert_eq!(raw.handle(), 0x1234);
        assert_eq!(raw.as_raw() as usize, 0x1234);
    }

    #[test]
    fn the_legacy_streams_two_handles_are_one_stream_and_the_per_thread_handle_another() {
        // SAFETY: the views are never passed to the driver.
        #[allow(unsafe_code)]
        let legacy = unsafe { StreamRef::from_raw(LEGACY_HANDLE as sys::CUstream) };
        assert_eq!(legacy, StreamRef::LEGACY);
        assert!(legacy.is_legacy() && StreamRef::LEGACY.is_legacy());
        assert!(!legacy.is_per_thread() && StreamRef::PER_THREAD.is_per_thread());
        assert_ne!(legacy, StreamRef::PER_THREAD);
        let set: HashSet<StreamRef<'_>> = [legacy, StreamRef::LEGACY, StreamRef::PER_THREAD].into();
        assert_eq!(set.len(), 2);
        assert_eq!(
            (legacy.handle(), StreamRef::LEGACY.handle()),
            (1, 0),
            "the handle is kept as given"
        );
    }

    #[test]
    fn a_per_thread_stream_kept_by_one_thread_is_the_legacy_stream_on_another() {
        let ctx = Context::unretained_for_tests(0);
        let kept = StreamRef::PER_THREAD.in_context(&ctx).kept();
        assert!(kept.is_here());
        assert_eq!(kept.here(), StreamRef::PER_THREAD);
        assert_eq!(kept.as_kept(), StreamRef::PER_THREAD);
        // SAFETY: the view is never passed to the driver.
        #[allow(unsafe_code)]
        let created = unsafe { StreamRef::from_raw(0x5000 as sys::CUstream) }.kept();
        let legacy = StreamRef::LEGACY.kept();
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(!kept.is_here());
                let here = kept.here();
                assert!(here.is_legacy(), "{here:?}");
                assert!(Arc::ptr_eq(here.context().unwrap(), &ctx), "the context is kept");
                assert_eq!(kept.as_kept(), StreamRef::PER_THREAD);
                // Streams that are the same on every thread are kept as they are.
                assert!(created.is_here() && legacy.is_here());
                assert_eq!(created.here().handle(), 0x5000);
                assert_eq!(legacy.here(), StreamRef::LEGACY);
                // A per-thread stream this thread keeps is its own.
                assert_eq!(StreamRef::PER_THREAD.kept().here(), StreamRef::PER_THREAD);
            });
        });
        assert!(kept.is_here(), "still the keeping thread's own");
    }

    #[test]
    fn mempools_own_ids_tell_threads_per_thread_streams_apart() {
        let mine = fallback(PER_THREAD_HANDLE);
        assert_eq!(mine, fallback(PER_THREAD_HANDLE), "one id per thread");
        let theirs = std::thread::spawn(|| fallback(PER_THREAD_HANDLE)).join().unwrap();
        assert_ne!(mine, theirs);
        assert_eq!(fallback(0), fallback(LEGACY_HANDLE), "the legacy stream's two handles");
        let created = fallback(0x7f00_1234_5000);
        assert_ne!(created, fallback(0x7f00_1234_6000));
        for id in [mine, theirs, fallback(0), created] {
            assert!(id.get() >= OWN_IDS, "{id:?} is above every driver id");
        }
        assert_ne!(created, mine);
        assert_ne!(fallback(0), mine);
    }

    #[test]
    fn a_thread_remembers_ids_by_context_and_handle() {
        let (a, b) = (StreamId::from_value(7), StreamId::from_value(8));
        std::thread::spawn(move || {
            assert_eq!(cached(0x10, PER_THREAD_HANDLE), None);
            remember(0x10, PER_THREAD_HANDLE, a);
            remember(0x20, PER_THREAD_HANDLE, b);
            assert_eq!(cached(0x10, PER_THREAD_HANDLE), Some(a));
            assert_eq!(cached(0x20, PER_THREAD_HANDLE), Some(b));
            assert_eq!(cached(0x10, LEGACY_HANDLE), None);
            remember(0x10, PER_THREAD_HANDLE, b);
            assert_eq!(cached(0x10, PER_THREAD_HANDLE), Some(b), "replaced");
            for i in 0..RESOLVED_KEPT {
                remember(0x100 + i, LEGACY_HANDLE, a);
            }
            assert_eq!(cached(0x10, PER_THREAD_HANDLE), None, "the oldest went first");
            assert_eq!(cached(0x100, LEGACY_HANDLE), Some(a));
        })
        .join()
        .unwrap();
        assert_eq!(cached(0x10, PER_THREAD_HANDLE), None, "per thread");
    }

    #[test]
    fn ordering_after_another_threads_per_thread_stream_holds_it_running_or_waits_for_the_context() {
        let asked = std::cell::Cell::new(0);
        let ctx = || {
            asked.set(asked.get() + 1);
            Ok(Context::unretained_for_tests(0))
        };
        // Kept here: the stream itself, no context asked.
        let mine = StreamRef::PER_THREAD.kept();
        let got: Result<StreamRef<'_>> = mine.order_here(ctx, Ok);
        assert_eq!(got.unwrap(), StreamRef::PER_THREAD);
        // Kept by this (running) thread, used on another: the legacy stream, no context asked there.
        let on_other = std::thread::scope(|s| {
            s.spawn(|| {
                let asked = std::cell::Cell::new(0);
                let got: Result<StreamRef<'_>> = mine.order_here(
                    || {
                        asked.set(1);
                        Ok(Context::unretained_for_tests(0))
                    },
                    Ok,
                );
                (got.unwrap(), asked.get())
            })
            .join()
            .unwrap()
        });
        assert!(on_other.0.is_legacy() && on_other.1 == 0, "{on_other:?}");
        // Kept by a thread that has ended: the context is synchronized first (which fails without a driver,
        // and then `f` is not called).
        let ended = std::thread::spawn(|| StreamRef::PER_THREAD.kept()).join().unwrap();
        let mut called = false;
        let r: Result<()> = ended.order_here(ctx, |s| {
            called = true;
            assert!(s.is_legacy());
            Ok(())
        });
        assert_eq!(asked.get(), 1, "the context was asked for");
        assert_eq!(r.is_ok(), called);
        // Streams that are the same everywhere never ask.
        let legacy = StreamRef::LEGACY.kept();
        let r: Result<StreamRef<'_>> = std::thread::spawn(move || legacy.order_here(|| unreachable!(), Ok))
            .join()
            .unwrap();
        assert_eq!(r.unwrap(), StreamRef::LEGACY);
    }
}
