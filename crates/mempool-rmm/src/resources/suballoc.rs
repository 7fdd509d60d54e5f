//! The suballocating resources: the engines of [`crate::suballoc`] run against real streams and an
//! upstream [`MemoryResource`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use mempool_core::{Context, DeviceAddr, Event, EventFlags, StreamRef};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::suballoc::{
    self, ArenaConfig, ArenaEngine, BinningConfig, BinningEngine, Engine, EngineStats, EventPolicy, FixedSizeConfig,
    FixedSizeEngine, PoolConfig, PoolEngine, StreamOrder, Upstream,
};

/// A stream as the engines key it: the raw handle's value.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StreamKey(usize);

impl StreamKey {
    fn of(stream: StreamRef<'_>) -> StreamKey {
        StreamKey(stream.id())
    }

    /// The stream behind the key, for a driver call made during the `allocate` or `deallocate` call that
    /// passed it in.
    #[allow(unsafe_code)]
    fn stream(self) -> StreamRef<'static> {
        // SAFETY: the engines hand a key back to `CudaStreams::{record, wait}` and to
        // `ResourceUpstream::{allocate, deallocate}` only for the stream of the allocate/deallocate call
        // in progress (the suballoc module's contract under `EventPolicy::Adaptive` and `RecordOnFree`, the
        // only policies these resources run with: see `safe_policy`), and the caller keeps that stream
        // alive for the call. The two paths that
        // replay stored keys never reach here: `CudaStreams::synchronize` synchronizes the whole context
        // instead, and release frees upstream on the legacy stream (see `ResourceUpstream`). The
        // `'static` lifetime does not escape: each use is a single driver call.
        unsafe { StreamRef::from_raw(self.0 as mempool_core::sys::CUstream) }
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
    upstream: Arc<U>,
    ctx: Arc<Context>,
    /// Set while the resource is being released, after a context synchronize: upstream frees then go
    /// on the legacy stream, since the streams the engine stored with its chunks may be gone.
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
            // The context was synchronized before release began, so nothing uses the chunk.
            self.ctx.bind().map_err(Error::from).and_then(|_g| {
                // SAFETY: the engine returns each chunk it got from `allocate` once, with its size; the
                // context was synchronized before release began, so no work uses the chunk, and the engine
                // hands out nothing of it afterwards.
                #[allow(unsafe_code)]
                unsafe {
                    self.upstream
                        .deallocate(DeviceAddr(addr), bytes as usize, StreamRef::LEGACY)
                }
            })
        } else {
            // SAFETY: the engine returns each chunk it got from `allocate` once, with its size, only when no
            // block of it is live, after every block freed into it was freed on a stream the engine ordered
            // `stream` after (the engines' stream contract), and never hands it out again.
            #[allow(unsafe_code)]
            unsafe {
                self.upstream
                    .deallocate(DeviceAddr(addr), bytes as usize, stream.stream())
            }
        };
        // The engine forgets the chunk and reports the error to its caller (`release_unused`, or a
        // deallocation that returns memory straight to the upstream); `map_engine_error` unwraps it.
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

fn map_engine_error(resource: &'static str, e: suballoc::Error) -> Error {
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
        suballoc::Error::InvalidConfig(why) => Error::Unsupported {
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

macro_rules! suballocating_resource {
    ($(#[$doc:meta])* $name:ident, $engine:ident, $config:ident, $fix_policy:expr) => {
        $(#[$doc])*
        pub struct $name<U: MemoryResource> {
            upstream: Arc<U>,
            ctx: Arc<Context>,
            engine: Mutex<$engine<Arc<ResourceUpstream<U>>, CudaStreams>>,
            adapter: Arc<ResourceUpstream<U>>,
        }

        impl<U: MemoryResource> std::fmt::Debug for $name<U> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("upstream", &self.upstream)
                    .field("stats", &self.stats())
                    .finish()
            }
        }

        impl<U: MemoryResource> $name<U> {
            /// Suballocates from `upstream`, whose memory lives in `ctx` (the context whose streams are
            /// used with it).
            pub fn new(upstream: U, ctx: &Arc<Context>, config: $config) -> Result<Self> {
                let fix: fn($config) -> $config = $fix_policy;
                let upstream = Arc::new(upstream);
                let adapter = Arc::new(ResourceUpstream {
                    upstream: upstream.clone(),
                    ctx: ctx.clone(),
                    releasing: AtomicBool::new(false),
                });
                let engine = $engine::new(adapter.clone(), CudaStreams { ctx: ctx.clone() }, fix(config))
                    .map_err(|e| map_engine_error(stringify!($name), e))?;
                Ok($name { upstream, ctx: ctx.clone(), engine: Mutex::new(engine), adapter })
            }

            /// The upstream resource.
            pub fn upstream(&self) -> &U {
                &self.upstream
            }

            fn engine(&self) -> MutexGuard<'_, $engine<Arc<ResourceUpstream<U>>, CudaStreams>> {
                self.engine.lock().unwrap_or_else(|p| p.into_inner())
            }

            /// The engine's bookkeeping: reserved, used and free bytes, blocks, upstream chunks.
            pub fn stats(&self) -> EngineStats {
                self.engine().stats()
            }

            /// Returns every upstream chunk that holds no live allocation, after waiting for all work in
            /// the context.
            pub fn release_unused(&self) -> Result<()> {
                self.ctx.synchronize()?;
                let mut engine = self.engine();
                self.adapter.releasing.store(true, Ordering::Release);
                let r = engine.release();
                self.adapter.releasing.store(false, Ordering::Release);
                r.map_err(|e| map_engine_error(stringify!($name), e))
            }
        }

        impl<U: MemoryResource> MemoryResource for $name<U> {
            fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
                if bytes == 0 {
                    return Ok(DeviceAddr::NULL);
                }
                self.engine()
                    .allocate(bytes as u64, StreamKey::of(stream))
                    .map(DeviceAddr)
                    .map_err(|e| map_engine_error(stringify!($name), e))
            }

            #[allow(unsafe_code)]
            unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
                if ptr.is_null() {
                    return Ok(());
                }
                self.engine()
                    .deallocate(ptr.0, bytes as u64, StreamKey::of(stream))
                    .map_err(|e| map_engine_error(stringify!($name), e))
            }

            fn name(&self) -> &'static str {
                stringify!($name)
            }
        }

        impl<U: MemoryResource> Drop for $name<U> {
            fn drop(&mut self) {
                // Wait for the context, then return everything upstream on the legacy stream; the engine's
                // own drop then finds nothing left.
                let _ = self.release_unused();
            }
        }
    };
}

suballocating_resource!(
    /// A coalescing best-fit suballocator over any upstream, RMM's `pool_memory_resource`: it grows
    /// from the upstream (up to an optional maximum), keeps per-stream free lists, and hands blocks
    /// between streams through events. Free blocks are indexed by size and by address: operations stay
    /// logarithmic with tens of thousands of live allocations.
    ///
    /// ```no_run
    /// # fn main() -> mempool_rmm::Result<()> {
    /// use mempool_core::{Device, Stream};
    /// use mempool_rmm::{suballoc::PoolConfig, AsyncResource, MemoryResource, PoolResource};
    /// let dev = Device::get(0)?;
    /// let ctx = dev.context()?;
    /// let config = PoolConfig { initial_size: 1 << 30, ..Default::default() };
    /// let mr = PoolResource::new(AsyncResource::default_pool(&dev)?, &ctx, config)?;
    /// let stream = Stream::new(&ctx)?;
    /// let p = mr.allocate(4096, stream.as_ref())?;
    /// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
    /// unsafe { mr.deallocate(p, 4096, stream.as_ref()) }?;
    /// # Ok(()) }
    /// ```
    PoolResource,
    PoolEngine,
    PoolConfig,
    |c| PoolConfig { event_policy: safe_policy(c.event_policy), ..c }
);

suballocating_resource!(
    /// Fixed-size blocks carved from upstream chunks, O(1) per operation, RMM's
    /// `fixed_size_memory_resource`. Larger requests are refused with [`Error::Unsupported`].
    FixedSizeResource,
    FixedSizeEngine,
    FixedSizeConfig,
    |c| FixedSizeConfig { event_policy: safe_policy(c.event_policy), ..c }
);

suballocating_resource!(
    /// Power-of-two bins of fixed-size blocks, larger requests straight to the upstream, RMM's
    /// `binning_memory_resource`: the fastest choice for many small allocations.
    BinningResource,
    BinningEngine,
    BinningConfig,
    |c| BinningConfig { event_policy: safe_policy(c.event_policy), ..c }
);

suballocating_resource!(
    /// Per-stream arenas of superblocks over a global arena, RMM's `arena_memory_resource`: little
    /// contention between streams, large allocations straight from the global arena.
    ArenaResource,
    ArenaEngine,
    ArenaConfig,
    |c| ArenaConfig { event_policy: safe_policy(c.event_policy), ..c }
);
