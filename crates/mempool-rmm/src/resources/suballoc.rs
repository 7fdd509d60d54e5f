//! The suballocating resources: one generic [`SuballocatingResource`] that runs any engine of
//! [`crate::suballoc`] (named by its options type) against real streams and an upstream
//! [`MemoryResource`], and the four aliases [`PoolResource`], [`FixedSizeResource`],
//! [`BinningResource`] and [`ArenaResource`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mempool_core::{Context, Device, DeviceAddr, Event, EventFlags, Stream, StreamFlags, StreamId, StreamRef};

use crate::error::{Error, OutOfMemoryReport, Result};
use crate::observe::inspect::Inspection;
use crate::observe::oom::fill_from_stack;
use crate::resource::MemoryResource;
use mempool_suballoc::{
    self as suballoc, ArenaOptions, BinningOptions, ChunkMap, Engine, EngineOptions, EngineStats, EventPolicy,
    FixedSizeOptions, MapRange, PoolOptions, Sharded, StreamOrder, Upstream,
};

/// A stream as the engines key it: its identity, the driver's id of the stream ([`StreamRef::key`]: the
/// per-thread default streams of two threads are two keys, the legacy stream's two handles one), with the
/// handle it was named by, for the driver calls made during the engine call that passed it in (on the
/// calling thread, where the handle names that stream). Equality and hashing look at the id only.
///
/// Keyed so, a free on `CU_STREAM_PER_THREAD` (0x2, one handle for every thread's own stream) needs no
/// wait of its own (issue 33, finding 2): the block goes to the free list of the freeing thread's stream,
/// and another thread's per-thread stream, a key of its own, takes it only through the engine's hand-off
/// between streams (an event wait, or a context synchronize), like any other stream. The stop-gap that
/// synchronized the calling thread's per-thread stream at each such free while the engines keyed by
/// handle (`settle_per_thread_free`, a7ed6aa) is therefore gone. A free on that handle from a thread
/// other than the one whose stream used the memory stays outside the trait's contract (the handle names
/// the freeing thread's stream); mempool's own buffers and the CuPy and PyTorch entry points free such
/// memory on the legacy stream instead (`KeptStream`).
#[derive(Copy, Clone, Debug)]
pub(crate) struct StreamKey {
    id: StreamId,
    raw: usize,
}

impl PartialEq for StreamKey {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for StreamKey {}

impl std::hash::Hash for StreamKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl StreamKey {
    /// The key of `stream` as the calling thread names it, for a resource of `ctx` (bound to resolve a
    /// special or raw handle; a driver call unless the view is an owned stream's, or a special stream this
    /// thread already resolved).
    pub(crate) fn of(stream: StreamRef<'_>, ctx: &Context) -> mempool_core::Result<StreamKey> {
        Ok(StreamKey {
            id: stream.key_in(ctx)?,
            raw: stream.handle(),
        })
    }

    /// A key made of parts, for host tests (no driver).
    #[cfg(test)]
    pub(crate) fn from_parts(id: u64, raw: usize) -> StreamKey {
        StreamKey {
            id: StreamId::from_value(id),
            raw,
        }
    }

    /// The handle the stream was named by (what snapshots and memory maps show).
    pub(crate) fn handle(self) -> usize {
        self.raw
    }

    /// The stream behind the key, for a driver call made during the engine call that passed it in.
    #[allow(unsafe_code)]
    fn stream(self) -> StreamRef<'static> {
        // SAFETY: the engines hand a key back to `CudaStreams::{record, wait}` and to
        // `ResourceUpstream::{allocate, deallocate}` only for the stream of the engine call in progress
        // (the suballoc crate's contract under `EventPolicy::Adaptive` and `RecordOnFree`, the only
        // policies these resources run with: see `safe_policy`): the stream of an `allocate` or
        // `deallocate` (also when `Sharded` runs the other engines' `release_unused` on it for an engine
        // that is out of memory), which the caller keeps alive for the call, or the private stream that
        // `release_unused` creates and keeps alive until the call returns. The two paths that replay
        // stored keys never reach here: `CudaStreams::synchronize` synchronizes the whole context instead,
        // and the release in `Drop` frees upstream on the private release stream, or the legacy stream if
        // none could be made (see `ResourceUpstream`). So the handle is used on the thread that named the
        // stream by it, where a per-thread handle names the keyed stream. The `'static` lifetime does not
        // escape: each use is a single driver call.
        unsafe { StreamRef::from_raw(self.raw as mempool_core::RawStream) }
    }
}

/// Real stream ordering for the engines: CUDA events in one context.
#[derive(Debug, Clone)]
pub(crate) struct CudaStreams {
    ctx: Arc<Context>,
}

fn stream_err(op: &'static str, e: mempool_core::Error) -> suballoc::Error {
    suballoc::Error::Stream {
        op,
        source: Box::new(e),
    }
}

impl CudaStreams {
    /// Stream ordering by events in `ctx`.
    pub(crate) fn new(ctx: &Arc<Context>) -> CudaStreams {
        CudaStreams { ctx: ctx.clone() }
    }
}

impl StreamOrder for CudaStreams {
    type Stream = StreamKey;
    type Event = Event;

    fn create_event(&self) -> Result<Event, suballoc::Error> {
        Event::new(&self.ctx, EventFlags::DISABLE_TIMING).map_err(|e| stream_err("create_event", e))
    }
    fn record(&self, event: &mut Event, stream: StreamKey) -> Result<(), suballoc::Error> {
        event.record(stream.stream()).map_err(|e| stream_err("record", e))
    }
    fn wait(&self, stream: StreamKey, event: &Event) -> Result<(), suballoc::Error> {
        stream.stream().wait(event).map_err(|e| stream_err("wait", e))
    }
    /// Synchronizes the whole context rather than the stream: the engines call this with streams they
    /// stored earlier, which may have been destroyed since; the context outlives them all, and waiting for
    /// all its work orders at least as much.
    fn synchronize(&self, _stream: StreamKey) -> Result<(), suballoc::Error> {
        self.ctx.synchronize().map_err(|e| stream_err("synchronize", e))
    }
}

/// An upstream [`MemoryResource`] as the engines see it.
#[derive(Debug)]
pub(crate) struct ResourceUpstream<U> {
    /// The private stream that the release in `Drop` frees the chunks on. Declared before `upstream`
    /// so that it is destroyed first: a free into a driver pool leaves a record tied to its stream,
    /// and a pool destroyed while such a record sat on the shared legacy stream raced with other
    /// threads' synchronizes inside the driver (issue 33; docs/architecture.md, "Pool teardown and
    /// synchronizes"). Freed on a stream of its own, synchronized and destroyed before the pool, a
    /// chunk leaves no record behind.
    release_stream: std::sync::OnceLock<Stream>,
    upstream: U,
    ctx: Arc<Context>,
    /// Set when the resource is dropped: upstream frees then go on `release_stream` (the legacy stream
    /// if it could not be made), after the engine's release synchronized the context, since the streams
    /// the engine stored with its chunks may be gone.
    releasing: AtomicBool,
}

impl<U: MemoryResource> Upstream<StreamKey> for ResourceUpstream<U> {
    fn allocate(&self, bytes: u64, stream: StreamKey) -> Result<u64, suballoc::Error> {
        let bytes_usize = usize::try_from(bytes).map_err(|_| suballoc::Error::OutOfMemory {
            requested: bytes,
            cause: suballoc::OutOfMemoryCause::AddressSpace,
        })?;
        match self.upstream.allocate(bytes_usize, stream.stream()) {
            Ok(p) => Ok(p.0),
            Err(e) if e.is_out_of_memory() => Err(suballoc::Error::OutOfMemory {
                requested: bytes,
                cause: suballoc::OutOfMemoryCause::Upstream,
            }),
            Err(e) => Err(suballoc::Error::Upstream {
                op: "allocate",
                source: Box::new(e),
            }),
        }
    }

    fn deallocate(&self, addr: u64, bytes: u64, stream: StreamKey) -> Result<(), suballoc::Error> {
        let r = if self.releasing.load(Ordering::Acquire) {
            // The engine synchronized the context before it began returning chunks, so nothing uses them.
            let on = self.release_stream.get().map_or(StreamRef::LEGACY, Stream::as_ref);
            self.ctx.bind().map_err(Error::from).and_then(|_g| {
                // SAFETY: the engine returns each chunk it got from `allocate` once, with its size; it
                // synchronized the context before it began returning chunks, so no work uses the chunk,
                // and it hands out nothing of it afterwards. `on` is the private release stream (alive
                // until this value drops) or the legacy stream.
                #[allow(unsafe_code)]
                unsafe {
                    self.upstream.deallocate(DeviceAddr(addr), bytes as usize, on)
                }
            })
        } else {
            // SAFETY: the engine returns each chunk it got from `allocate` once, with its size, and never hands
            // it out again: either a chunk with no live block, after ordering `stream` after every free into
            // it (the engines' stream contract), or an allocation it passed straight through (binning's sizes
            // above its bins), from the caller's own `deallocate` on `stream`, whose obligations 1-3 then
            // hold for the chunk.
            #[allow(unsafe_code)]
            unsafe {
                self.upstream
                    .deallocate(DeviceAddr(addr), bytes as usize, stream.stream())
            }
        };
        // The engine forgets the chunk and reports the error to its caller (`release_unused`, or a
        // deallocation that returns memory straight to the upstream, or the release in `Drop`, which
        // ignores it); `map_engine_error` unwraps it.
        r.map_err(|e| suballoc::Error::Upstream {
            op: "deallocate",
            source: Box::new(e),
        })
    }
}

/// The engine policy a resource over real streams runs with: `RecordOnDemand` would record on
/// streams the engine stored earlier, which may have been destroyed since, so it becomes `Adaptive`.
fn safe_policy(policy: EventPolicy) -> EventPolicy {
    match policy {
        EventPolicy::RecordOnDemand => EventPolicy::Adaptive,
        other => other,
    }
}

pub(crate) fn map_engine_error(resource: &'static str, e: suballoc::Error) -> Error {
    match e {
        suballoc::Error::OutOfMemory { requested, .. } => Error::OutOfMemory {
            resource,
            requested: requested.try_into().unwrap_or(usize::MAX),
        },
        suballoc::Error::TooLarge { requested, limit } => Error::Unsupported {
            resource,
            reason: format!("{requested} bytes is more than the largest block it serves ({limit} bytes)"),
        },
        suballoc::Error::UnknownAllocation { addr, bytes } => Error::InvalidDeallocation {
            resource,
            ptr: addr,
            bytes: bytes as usize,
            reason: "not a live allocation of this resource".into(),
        },
        suballoc::Error::InvalidOptions(why) => Error::Unsupported {
            resource,
            reason: why.into(),
        },
        suballoc::Error::Stream { source, .. } | suballoc::Error::Upstream { source, .. } => {
            match source.downcast::<Error>() {
                Ok(e) => *e,
                Err(source) => match source.downcast::<mempool_core::Error>() {
                    Ok(e) => Error::from(*e),
                    Err(other) => Error::Unsupported {
                        resource,
                        reason: other.to_string(),
                    },
                },
            }
        }
        // The engines' error is non-exhaustive; a kind added later reads as its message until it is
        // mapped here.
        other => Error::Unsupported {
            resource,
            reason: other.to_string(),
        },
    }
}

/// Engine options that a [`SuballocatingResource`] runs: the options type names the
/// engine (through [`EngineOptions`]) and the resource's name.
///
/// Implemented by [`PoolOptions`], [`FixedSizeOptions`], [`BinningOptions`] and [`ArenaOptions`].
pub trait SuballocOptions: EngineOptions {
    /// The resource's name, as [`MemoryResource::name`] reports it and its errors name it
    /// (`PoolResource`, ...).
    const RESOURCE_NAME: &'static str;

    /// Whether the resource may split the options over several engines, one per thread (see
    /// [`SuballocatingResource`]): not when it sets a limit on the whole, which each engine would
    /// apply on its own, nor when it asks for an initial reservation, which users expect to be one
    /// block that serves every thread (as in RMM). Yes by default.
    fn shardable(&self) -> bool {
        true
    }

    /// The size above which every request goes straight to the upstream, by its size alone, so that the
    /// resource sends it there without asking (or locking) an engine: binning's largest bin. `None`
    /// (the default) when the engine serves every size itself.
    fn passes_through_above(&self) -> Option<u64> {
        None
    }
}

impl SuballocOptions for PoolOptions {
    const RESOURCE_NAME: &'static str = "PoolResource";

    fn shardable(&self) -> bool {
        self.maximum_size.is_none() && self.initial_size == 0
    }
}

impl SuballocOptions for FixedSizeOptions {
    const RESOURCE_NAME: &'static str = "FixedSizeResource";
}

impl SuballocOptions for BinningOptions {
    const RESOURCE_NAME: &'static str = "BinningResource";

    /// The largest bin: the engine would pass every larger request to the upstream anyway
    /// ([`BinningOptions::goes_upstream`]).
    fn passes_through_above(&self) -> Option<u64> {
        Some(self.largest_bin())
    }
}

impl SuballocOptions for ArenaOptions {
    const RESOURCE_NAME: &'static str = "ArenaResource";

    fn shardable(&self) -> bool {
        self.maximum_size.is_none() && self.initial_size == 0
    }
}

/// The most engines a shardable resource keeps: one per hardware thread, up to this.
const MAX_SHARDS: usize = 16;

/// How many engines a resource with `options` keeps.
fn shard_count<C: SuballocOptions>(options: &C) -> usize {
    if !options.shardable() {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_SHARDS))
}

/// The engine a resource runs: the one `C` names, over the upstream resource and CUDA events.
type ResourceEngine<C, U> = <C as EngineOptions>::Engine<Arc<ResourceUpstream<U>>, CudaStreams>;

/// A suballocator over any upstream [`MemoryResource`]: the engine that the options type `C` names
/// (see [`SuballocOptions`]), run against real streams.
///
/// - Threads do not share one lock: the resource keeps one engine per hardware thread (up to 16; a
///   [`mempool_suballoc::Sharded`]), each behind its own lock, and a thread allocates from its own.
///   A free goes to the engine that made the allocation (the calling thread's is tried first); an
///   engine that runs out of memory first has the others return their unused chunks upstream. A
///   resource with a maximum size ([`PoolOptions::maximum_size`], [`ArenaOptions::maximum_size`])
///   keeps one engine, since each engine would apply the limit on its own, and so does one with an
///   initial size ([`PoolOptions::initial_size`], [`ArenaOptions::initial_size`]): the reservation
///   asked for is one block that serves every thread, as in RMM. Each engine grows on its own, so a
///   sharded resource may hold up to one engine's growth per thread more than a single engine would.
///
/// - A request above the size where the options pass everything to the upstream
///   ([`SuballocOptions::passes_through_above`]: a [`BinningResource`]'s largest bin) goes straight to
///   the upstream, unchanged, and so does its free, routed by its size alone (the size a free passes is
///   the size allocated, the [`MemoryResource`] contract): no engine lock, no record of the allocation,
///   as in RMM's `binning_memory_resource`. Such allocations are the upstream's: the resource's
///   [`stats`](Self::stats) and memory map do not count them, dropping the resource does not free
///   them, and their frees are checked only by the upstream (a pool refuses an address it did not hand
///   out; the driver's pools check what the driver checks).
/// - Other `allocate` and `deallocate` calls go to the engine, keyed by the stream's id
///   ([`StreamRef::key`], resolved on the calling thread: each thread's per-thread default stream is a
///   stream of its own); a stream reuses its own freed memory at once, and memory moves to another
///   stream after a CUDA event wait (or a context synchronize), as the [`crate::suballoc`] crate docs
///   describe. 0 bytes is the null address.
/// - The engine runs with [`EventPolicy::Adaptive`] when the options ask for
///   [`EventPolicy::RecordOnDemand`], which would record on streams that may have been destroyed
///   since.
/// - Engine errors map to [`Error`]: out of memory to [`Error::OutOfMemory`] (naming the size asked
///   for), a request above what the engine serves to [`Error::Unsupported`], an unknown
///   deallocation to [`Error::InvalidDeallocation`], the upstream's and the driver's errors to
///   themselves.
///
/// Use it through its aliases: [`PoolResource`], [`FixedSizeResource`], [`BinningResource`],
/// [`ArenaResource`].
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::suballoc::ArenaOptions;
/// use mempool_rmm::{AsyncResource, MemoryResource, SuballocatingResource};
/// let dev = Device::get(0)?;
/// let ctx = dev.context()?;
/// let mr: SuballocatingResource<ArenaOptions, _> =
///     SuballocatingResource::new(AsyncResource::default_pool(&dev)?, &dev, ArenaOptions::default())?;
/// assert_eq!(mr.name(), "ArenaResource");
/// let stream = Stream::new(&ctx)?;
/// let p = mr.allocate(4096, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 4096, stream.as_ref()) }?;
/// mr.release_unused()?; // every chunk goes back to the driver pool
/// # Ok(()) }
/// ```
pub struct SuballocatingResource<C: SuballocOptions, U: MemoryResource> {
    engines: Sharded<ResourceEngine<C, U>>,
    adapter: Arc<ResourceUpstream<U>>,
    /// Requests of more bytes go straight to the upstream ([`SuballocOptions::passes_through_above`];
    /// `u64::MAX`: none do).
    direct_above: u64,
}

impl<C: SuballocOptions, U: MemoryResource> std::fmt::Debug for SuballocatingResource<C, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(C::RESOURCE_NAME)
            .field("upstream", &self.adapter.upstream)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<C: SuballocOptions, U: MemoryResource> SuballocatingResource<C, U> {
    /// Suballocates from `upstream`, whose memory lives on `device` (the streams used with it are
    /// streams of the device's primary context). Reserves nothing yet. Fails with
    /// [`Error::Unsupported`] for options the engine rejects, and with the driver's error when the
    /// primary context cannot be retained.
    pub fn new(upstream: U, device: &Device, options: C) -> Result<Self> {
        let ctx = &device.context()?;
        let mut options = options;
        options.set_event_policy(safe_policy(options.event_policy()));
        let adapter = Arc::new(ResourceUpstream {
            release_stream: std::sync::OnceLock::new(),
            upstream,
            ctx: ctx.clone(),
            releasing: AtomicBool::new(false),
        });
        let engines = Sharded::new(shard_count(&options), || {
            ResourceEngine::<C, U>::new(adapter.clone(), CudaStreams { ctx: ctx.clone() }, options.clone())
        })
        .map_err(|e| map_engine_error(C::RESOURCE_NAME, e))?;
        // After the engines accepted the options (binning's exponents are in range).
        let direct_above = options.passes_through_above().unwrap_or(u64::MAX);
        Ok(SuballocatingResource {
            engines,
            adapter,
            direct_above,
        })
    }

    /// How many engines the resource keeps: one per hardware thread up to 16, or one (see the type's
    /// documentation). A thread allocates from engine `n % shards`, `n` being the number the thread took
    /// on its first allocation from any such resource (threads take numbers in turn).
    pub fn shards(&self) -> usize {
        self.engines.shard_count()
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.adapter.upstream
    }

    /// The engine's options, with sizes rounded as it uses them and the event policy it runs
    /// with (the first engine's, which keeps the initial size).
    pub fn options(&self) -> C {
        self.engines.lock(0).options()
    }

    /// The engines' bookkeeping, added up: reserved, used and free bytes, blocks, upstream chunks.
    pub fn stats(&self) -> EngineStats {
        self.engines.stats()
    }

    /// The engine's error as the resource reports it: out of memory as a report of the stack under
    /// the resource, with its chunks' free bytes and largest free block (the error path only).
    fn out_of_memory_report(&self, e: suballoc::Error) -> Error {
        let failed_at = match &e {
            suballoc::Error::OutOfMemory {
                cause: suballoc::OutOfMemoryCause::Upstream,
                ..
            } => self.adapter.upstream.name(),
            _ => C::RESOURCE_NAME,
        };
        match map_engine_error(C::RESOURCE_NAME, e) {
            Error::OutOfMemory { requested, .. } => {
                let mut r = OutOfMemoryReport::new(requested, failed_at);
                fill_from_stack(&mut r, self);
                Error::OutOfMemoryReport(Box::new(r))
            }
            other => other,
        }
    }

    /// Whether a request (or free) of `bytes` goes straight to the upstream (see the type's docs).
    #[inline]
    pub fn passes_through(&self, bytes: usize) -> bool {
        bytes as u64 > self.direct_above
    }

    /// An allocation above the engines' sizes, straight from the upstream. Out of memory is reported as
    /// the engine would have (a report of the stack from this resource down, naming the upstream).
    #[inline]
    fn allocate_direct(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.adapter.upstream.allocate(bytes, stream).map_err(|e| {
            if e.is_out_of_memory() {
                self.out_of_memory_report(suballoc::Error::OutOfMemory {
                    requested: bytes as u64,
                    cause: suballoc::OutOfMemoryCause::Upstream,
                })
            } else {
                e
            }
        })
    }

    /// Returns to the upstream every chunk that holds no live allocation; live allocations stay
    /// valid. The chunks are freed on a private stream, which the engine first orders after every
    /// free into them (an event wait, or a context synchronize), and which is synchronized and
    /// destroyed before this returns (so a driver pool upstream keeps no record of the frees on a
    /// shared stream: see `ResourceUpstream::release_stream`).
    ///
    /// Reports the upstream's error when it fails to take a chunk back (the chunk is forgotten all
    /// the same). Once nothing is live this returns every chunk, so calling it before dropping the
    /// resource is how to see errors that `Drop` cannot report.
    pub fn release_unused(&self) -> Result<()> {
        let _bound = self.adapter.ctx.bind()?;
        let stream = Stream::with_flags(&self.adapter.ctx, StreamFlags::NON_BLOCKING)?;
        let released = self
            .engines
            .release_unused(StreamKey::of(stream.as_ref(), &self.adapter.ctx)?)
            .map(drop)
            .map_err(|e| map_engine_error(C::RESOURCE_NAME, e));
        stream.synchronize()?;
        released
    }
}

// SAFETY: the engine hands out disjoint, aligned ranges of blocks it took from the upstream (its invariants, tested on the host by mempool-suballoc's conformance and property tests), which the resource holds until it drops; a range is handed out again only after `deallocate` returned it. The upstream's `unsafe impl` guarantees 2 for those blocks, and for the allocations passed straight through (sizes above `direct_above`, freed to the upstream with the same size), which are disjoint from the engines' chunks since the one upstream hands out both.
#[allow(unsafe_code)]
unsafe impl<C: SuballocOptions, U: MemoryResource> MemoryResource for SuballocatingResource<C, U> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        if self.passes_through(bytes) {
            return self.allocate_direct(bytes, stream);
        }
        let key = StreamKey::of(stream, &self.adapter.ctx)?;
        self.engines
            .allocate(bytes as u64, key)
            .map(DeviceAddr)
            .map_err(|e| self.out_of_memory_report(e))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        if self.passes_through(bytes) {
            // SAFETY: the caller's obligations (`ptr` came from `allocate` with `bytes`, freed once, no
            // work after `stream` uses it) hold for the upstream: an allocation of `bytes` above
            // `direct_above` was passed straight to the upstream with the same size (`allocate`).
            return unsafe { self.adapter.upstream.deallocate(ptr, bytes, stream) };
        }
        // The engine checks `ptr` and `bytes` against its live allocations and refuses a mismatch; the
        // caller's obligation 3 is what lets it hand the memory to work ordered after `stream`.
        let key = StreamKey::of(stream, &self.adapter.ctx)?;
        self.engines
            .deallocate(ptr.0, bytes as u64, key)
            .map_err(|e| map_engine_error(C::RESOURCE_NAME, e))
    }

    fn name(&self) -> &'static str {
        C::RESOURCE_NAME
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.adapter.upstream)
    }

    /// The engines' statistics and memory map (every block, under each engine's lock in turn).
    fn inspect(&self) -> Inspection {
        let st = self.stats();
        Inspection {
            held_bytes: Some(st.reserved_bytes),
            live_bytes: Some(st.used_bytes),
            live_count: Some(st.live_allocations as u64),
            chunks: self
                .engines
                .memory_map()
                .into_iter()
                .map(|c| ChunkMap {
                    addr: c.addr,
                    size: c.size,
                    ranges: c
                        .ranges
                        .into_iter()
                        .map(|r| MapRange {
                            addr: r.addr,
                            size: r.size,
                            used: r.used,
                            stream: r.stream.map(StreamKey::handle),
                        })
                        .collect(),
                })
                .collect(),
            has_chunks: true,
            ..Inspection::default()
        }
    }

    /// [`release_unused`](SuballocatingResource::release_unused), a synchronize of the context (so that
    /// the chunks' frees, queued on the legacy stream, have happened), then the upstream's trim.
    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        self.release_unused()?;
        self.adapter.ctx.synchronize()?;
        self.adapter.upstream.trim_unused(stream)
    }
}

impl<C: SuballocOptions, U: MemoryResource> Drop for SuballocatingResource<C, U> {
    /// Returns every chunk to the upstream, live allocations included, as RMM's resources do when
    /// destroyed: the engine synchronizes the context, then frees each chunk on a private stream (the
    /// streams it stored may be gone), which is synchronized and destroyed before the upstream drops
    /// (the legacy default stream if the private one cannot be made). Allocations passed straight to the upstream (above
    /// [`SuballocOptions::passes_through_above`]) are the upstream's and are not freed here. The error
    /// cannot be returned from `drop` and is ignored: after a synchronize error the chunks are leaked rather than returned while the GPU may
    /// still use them, and a chunk the upstream refuses is forgotten. Call
    /// [`release_unused`](Self::release_unused) first, once nothing is live, to see those errors.
    fn drop(&mut self) {
        if let Ok(_bound) = self.adapter.ctx.bind() {
            if let Ok(stream) = Stream::with_flags(&self.adapter.ctx, StreamFlags::NON_BLOCKING) {
                let _ = self.adapter.release_stream.set(stream);
            }
        }
        self.adapter.releasing.store(true, Ordering::Release);
        let _ = self.engines.release();
        // The frees complete before the stream, then the upstream, are dropped with the adapter. After
        // an error here the stream's destroy still lets queued work finish; the error cannot be
        // reported from `drop`.
        if let Some(stream) = self.adapter.release_stream.get() {
            let _ = stream.synchronize();
        }
        // The engines' own drops then find nothing left (or retry, on the same private stream).
    }
}

/// A coalescing good-fit suballocator over any upstream, RMM's `pool_memory_resource`: it grows
/// from the upstream (up to an optional maximum), keeps per-stream free lists, and hands blocks
/// between streams through events. Free blocks are indexed by size (TLSF classes) and linked by
/// address: operations take constant time with tens of thousands of live allocations. See [`SuballocatingResource`].
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{suballoc::PoolOptions, AsyncResource, MemoryResource, PoolResource};
/// let dev = Device::get(0)?;
/// let ctx = dev.context()?;
/// let options = PoolOptions { initial_size: 1 << 30, ..Default::default() };
/// let mr = PoolResource::new(AsyncResource::default_pool(&dev)?, &dev, options)?;
/// let stream = Stream::new(&ctx)?;
/// let p = mr.allocate(4096, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 4096, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
pub type PoolResource<U> = SuballocatingResource<PoolOptions, U>;

/// Fixed-size blocks carved from upstream chunks, O(1) per operation, RMM's
/// `fixed_size_memory_resource`. Larger requests are refused with [`Error::Unsupported`]. See
/// [`SuballocatingResource`].
pub type FixedSizeResource<U> = SuballocatingResource<FixedSizeOptions, U>;

/// Power-of-two bins of fixed-size blocks, larger requests straight to the upstream (no lock, no record:
/// [`SuballocatingResource::passes_through`]), RMM's `binning_memory_resource`: the fastest choice for
/// many small allocations. See
/// [`SuballocatingResource`].
pub type BinningResource<U> = SuballocatingResource<BinningOptions, U>;

/// Per-stream arenas of superblocks over a global arena, RMM's `arena_memory_resource`: little
/// contention between streams, large allocations straight from the global arena. See
/// [`SuballocatingResource`].
pub type ArenaResource<U> = SuballocatingResource<ArenaOptions, U>;

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashSet;

    use super::*;
    use mempool_suballoc::PoolEngine;

    #[test]
    fn keys_are_equal_by_the_streams_id_not_its_handle() {
        // Two threads' per-thread default streams: one handle, two streams.
        let (a, b) = (StreamKey::from_parts(10, 2), StreamKey::from_parts(11, 2));
        assert_ne!(a, b);
        // The legacy stream's two handles: one stream.
        let (l0, l1) = (StreamKey::from_parts(3, 0), StreamKey::from_parts(3, 1));
        assert_eq!(l0, l1);
        let set: HashSet<StreamKey> = [a, b, l0, l1].into();
        assert_eq!(set.len(), 3);
        assert_eq!(
            (a.handle(), l1.handle()),
            (2, 1),
            "the handle is kept for driver calls and displays"
        );
    }

    /// Stream ordering that records what the engine asked of it.
    #[derive(Default)]
    struct Recorded {
        ops: RefCell<Vec<(&'static str, StreamKey)>>,
    }

    impl StreamOrder for &Recorded {
        type Stream = StreamKey;
        type Event = ();
        fn create_event(&self) -> Result<(), suballoc::Error> {
            Ok(())
        }
        fn record(&self, _: &mut (), stream: StreamKey) -> Result<(), suballoc::Error> {
            self.ops.borrow_mut().push(("record", stream));
            Ok(())
        }
        fn wait(&self, stream: StreamKey, _: &()) -> Result<(), suballoc::Error> {
            self.ops.borrow_mut().push(("wait", stream));
            Ok(())
        }
        fn synchronize(&self, stream: StreamKey) -> Result<(), suballoc::Error> {
            self.ops.borrow_mut().push(("synchronize", stream));
            Ok(())
        }
    }

    /// One 1 MiB chunk at a made-up address.
    struct OneChunk;

    impl Upstream<StreamKey> for OneChunk {
        fn allocate(&self, bytes: u64, _: StreamKey) -> Result<u64, suballoc::Error> {
            assert!(bytes <= 1 << 20);
            Ok(1 << 40)
        }
        fn deallocate(&self, _: u64, _: u64, _: StreamKey) -> Result<(), suballoc::Error> {
            Ok(())
        }
    }

    /// Issue 33's finding 2, as the engine sees it: thread A's per-thread stream frees a block that thread
    /// B's per-thread stream then asks for. With keys by handle (both 2) B took the block from "its own"
    /// list with no ordering; keyed by id, the block is another stream's, handed over only after B is
    /// ordered after A (a synchronize of A's list, the first time under `Adaptive`).
    #[test]
    fn a_block_freed_on_one_threads_per_thread_stream_reaches_anothers_only_after_ordering() {
        let order = Recorded::default();
        let options = PoolOptions {
            initial_size: 1 << 20,
            ..PoolOptions::default()
        };
        let mut engine = PoolEngine::new(OneChunk, &order, options).unwrap();
        let (a, b) = (StreamKey::from_parts(10, 2), StreamKey::from_parts(11, 2));
        let p = engine.allocate(4096, a).unwrap();
        engine.deallocate(p, 4096, a).unwrap();
        order.ops.borrow_mut().clear();
        let q = engine.allocate(1 << 20, b).unwrap();
        assert!(
            q <= p && p < q + (1 << 20),
            "the whole chunk, A's block among it: {q:#x}, {p:#x}"
        );
        let ops = order.ops.borrow().clone();
        assert!(
            ops.iter()
                .any(|(op, s)| (*op == "synchronize" && *s == a) || (*op == "wait" && *s == b)),
            "B got A's memory without being ordered after A: {ops:?}"
        );
    }
}
