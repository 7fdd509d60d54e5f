//! Host-only suballocator engines: the address arithmetic of RMM's pool, fixed-size, binning and
//! arena resources, with no GPU underneath. This crate depends on neither `mempool-core` nor
//! `cudarc`, so the engines cannot reach the driver; `mempool-rmm` runs them over real streams and
//! re-exports this crate as `mempool_rmm::suballoc`.
//!
//! The engines here decide *which* addresses to hand out and *which streams must wait for which*
//! before an address may be reused; they never touch the memory behind an address. All four
//! implement one trait, [`Engine`], and each configuration type names its engine through
//! [`EngineConfig`], so that generic code (a memory resource, a test) builds and drives any of them.
//! Two small traits connect them to the world:
//!
//! - [`Upstream`]: where big chunks of address space come from (on a GPU, a driver pool or another
//!   memory resource; on the host, [`SimUpstream`]).
//! - [`StreamOrder`]: how one stream is made to wait for another through an event (on a GPU,
//!   `cuEventRecord` / `cuStreamWaitEvent`; on the host, [`SimStreams`], which keeps logical clocks
//!   so tests can check that every hand-off between streams was ordered).
//!
//! Because both are traits, the same engine code runs against real streams in the resource layer
//! and against the simulations in CI, which has no GPU; that is what lets the property tests and the
//! host conformance suite (`tests/conformance.rs`) of this crate exercise the real code paths.
//!
//! # The stream contract
//!
//! Every engine follows the rule of RMM's `stream_ordered_memory_resource`: memory returned by
//! `deallocate(addr, bytes, A)` may be handed at once to another allocation on stream `A`, and to an
//! allocation on stream `B` only after `B` has been made to wait on an event that was recorded on `A`
//! after the block was freed there. Free blocks therefore live in per-stream free lists; a request
//! that its own stream's list cannot satisfy first steals a block from another stream's list (with one
//! event wait), then merges the other lists into its own (one wait per list; merged blocks coalesce),
//! and only then grows from the upstream.
//!
//! # Which streams an engine touches
//!
//! With [`EventPolicy::Adaptive`] (the default) or [`EventPolicy::RecordOnFree`], an engine passes a
//! stream to [`StreamOrder::create_event`], [`StreamOrder::record`], [`StreamOrder::wait`],
//! [`Upstream::allocate`] and [`Upstream::deallocate`] only while serving a call that was given that
//! stream (`allocate`, `deallocate`, `merge_free_lists`, `release_unused`, the pool's `trim`). Two
//! exceptions replay streams the engine stored earlier, which may have been destroyed since:
//! [`StreamOrder::synchronize`] (used to hand over blocks whose event was not recorded, and before
//! releasing), and [`Engine::release`] (and `Drop`), which returns each upstream chunk on the stream it
//! was allocated on, after synchronizing.
//! An implementation over real streams can therefore treat every stream it is handed as alive,
//! except in those two calls.
//!
//! # Engines
//!
//! | engine | RMM counterpart | cost per operation |
//! | --- | --- | --- |
//! | [`PoolEngine`] | `pool_memory_resource` | coalescing best fit: O(1) for free blocks up to 1 MiB, O(log n) above |
//! | [`FixedSizeEngine`] | `fixed_size_memory_resource` | O(1) |
//! | [`BinningEngine`] | `binning_memory_resource` | O(1) for binned sizes |
//! | [`ArenaEngine`] | `arena_memory_resource` | as the pool's, within per-stream arenas |
//!
//! Engines take `&mut self`: a resource that is shared between threads wraps its engine in a
//! `Mutex`. They are `Send` whenever their upstream, stream order and events are.
//!
//! An upstream that fails to take a chunk back ([`Upstream::deallocate`] returns an error) does not
//! stop an engine: it forgets the chunk and reports the first such error from the call that returned
//! it ([`Engine::release_unused`], [`Engine::release`], or a deallocation that goes straight to the
//! upstream). `Drop` cannot report it and ignores it.
//!
//! [`workload`] holds the standard random workload the benchmarks draw from.
//!
//! ```
//! use mempool_suballoc::{Engine, PoolConfig, PoolEngine, SimStream, SimStreams, SimUpstream};
//!
//! let upstream = SimUpstream::new();
//! let mut pool = PoolEngine::new(upstream.clone(), SimStreams::new(), PoolConfig::default())?;
//! let s = SimStream::new(0);
//! let a = pool.allocate(1000, s)?;
//! assert_eq!(a % 256, 0);
//! pool.deallocate(a, 1000, s)?;
//! pool.check_invariants()?;
//! pool.release()?;
//! assert_eq!(upstream.stats().live_chunks, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod addr_map;
mod arena;
mod binning;
mod block_table;
mod chunks;
mod engine;
mod fixed_size;
mod free_list;
mod pool;
mod stream_lists;
mod stream_order;
mod upstream;
pub mod workload;

#[cfg(test)]
mod testing;

use std::fmt;

pub use arena::{ArenaConfig, ArenaEngine};
pub use binning::{BinningConfig, BinningEngine};
pub use engine::{Engine, EngineConfig};
pub use fixed_size::{FixedSizeConfig, FixedSizeEngine};
pub use free_list::{Block, FreeList};
pub use pool::{PoolConfig, PoolEngine};
pub use stream_order::{SimEvent, SimStream, SimStreamCounts, SimStreams, StreamOrder, SyncPoint, SIM_MAX_STREAMS};
pub use upstream::{SimUpstream, SimUpstreamStats, Upstream, SIM_BASE_ADDRESS};

/// Alignment of every address and block size the engines hand out, in bytes, and of every
/// allocation a `mempool-rmm` resource returns (it re-exports this constant as
/// `mempool_rmm::ALIGNMENT`, and [`align_up`] with it: the workspace's one alignment).
///
/// 256 bytes is what `cudaMalloc` guarantees and what RMM's `CUDA_ALLOCATION_ALIGNMENT` promises;
/// callers may rely on it for vectorized loads.
pub const ALIGNMENT: u64 = 256;

/// Rounds `bytes` up to a multiple of [`ALIGNMENT`], or `None` when that overflows `u64`.
///
/// ```
/// use mempool_suballoc::align_up;
/// assert_eq!(align_up(1), Some(256));
/// assert_eq!(align_up(512), Some(512));
/// assert_eq!(align_up(u64::MAX), None);
/// ```
#[inline]
pub const fn align_up(bytes: u64) -> Option<u64> {
    match bytes.checked_add(ALIGNMENT - 1) {
        Some(b) => Some(b & !(ALIGNMENT - 1)),
        None => None,
    }
}

/// A boxed error from an upstream or a stream implementation, kept as the `source` of [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything an engine, an [`Upstream`] or a [`StreamOrder`] can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No memory for the request. `requested` is the size the caller asked for, not the size of the
    /// upstream chunk the engine tried to grow by, so a caller can retry or report it as is.
    #[error("out of memory: {requested} bytes requested ({cause})")]
    OutOfMemory {
        /// The size the caller asked for, in bytes.
        requested: u64,
        /// Which limit was hit.
        cause: OutOfMemoryCause,
    },
    /// The request is larger than anything this engine serves (a fixed-size engine's block size).
    #[error("{requested} bytes requested, more than the largest block this engine serves ({limit} bytes)")]
    TooLarge {
        /// The size the caller asked for, in bytes.
        requested: u64,
        /// The largest request the engine serves, in bytes.
        limit: u64,
    },
    /// `deallocate` named an address and size that is not a live allocation of this engine: a double
    /// free, a foreign pointer or a wrong size. The engine's state is left unchanged.
    #[error("deallocation of {bytes} bytes at {addr:#x} does not match a live allocation")]
    UnknownAllocation {
        /// The address passed to `deallocate`.
        addr: u64,
        /// The size passed to `deallocate`.
        bytes: u64,
    },
    /// A configuration that cannot work (say, a maximum size below the initial size).
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
    /// A stream or event operation failed.
    #[error("stream operation `{op}` failed")]
    Stream {
        /// The operation: `create_event`, `record`, `wait` or `synchronize`.
        op: &'static str,
        /// The implementation's error.
        #[source]
        source: BoxError,
    },
    /// The upstream failed in a way other than running out of memory, or broke its contract (say,
    /// returned a misaligned address).
    #[error("upstream `{op}` failed")]
    Upstream {
        /// The operation, usually `allocate`.
        op: &'static str,
        /// The upstream's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Names `requested` in an out-of-memory error (the caller's request, where the engine asked
    /// its upstream or global arena for a chunk or superblock); other errors pass unchanged.
    pub(crate) fn with_requested(self, requested: u64) -> Self {
        match self {
            Self::OutOfMemory { cause, .. } => Self::OutOfMemory { requested, cause },
            e => e,
        }
    }
}

/// Which limit an [`Error::OutOfMemory`] hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutOfMemoryCause {
    /// Growing would take the engine past its configured maximum size.
    MaximumSize {
        /// The configured maximum, in bytes.
        maximum: u64,
    },
    /// The upstream refused to allocate (it is full).
    Upstream,
    /// The size cannot be represented once rounded up to [`ALIGNMENT`], or the address space ran out.
    AddressSpace,
}

impl fmt::Display for OutOfMemoryCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MaximumSize { maximum } => write!(f, "maximum size of {maximum} bytes reached"),
            Self::Upstream => f.write_str("upstream exhausted"),
            Self::AddressSpace => f.write_str("size not representable"),
        }
    }
}

/// A broken internal invariant found by an engine's `check_invariants`: always a bug in the engine
/// (or misuse of a `&mut` API that bypassed its checks), never a condition to handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("suballocator invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// Returns `Err(InvariantViolation)` with a formatted message when `cond` is false.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::InvariantViolation(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;

/// A snapshot of an engine's bookkeeping.
///
/// Invariant (checked by every `check_invariants`): `free_bytes + used_bytes == reserved_bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Bytes obtained from the upstream and not yet returned to it.
    pub reserved_bytes: u64,
    /// Bytes held by live allocations, each counted with its rounding (to [`ALIGNMENT`], to a fixed
    /// block size, to a bin size).
    pub used_bytes: u64,
    /// Reserved bytes not held by a live allocation.
    pub free_bytes: u64,
    /// Free blocks across all free lists (per stream, per bin, per arena, global).
    pub free_blocks: usize,
    /// Live allocations.
    pub live_allocations: usize,
    /// Chunks obtained from the upstream and not yet returned to it.
    pub upstream_chunks: usize,
}

/// When an engine records the event that lets other streams take its free blocks.
///
/// Whichever is chosen, an event handed to a waiting stream is always recorded after every block in
/// the list it guards entered that list, so a stream that waits on it is ordered after all of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EventPolicy {
    /// Record on the freeing stream right after each block enters a stream's free list (RMM's
    /// behaviour). Costs one event record per deallocation, and in exchange the engine only ever
    /// records or waits on the stream of the call in progress (see "Which streams an engine
    /// touches" in the [module docs](self)), so streams may be destroyed while their freed blocks
    /// sit in the engine.
    RecordOnFree,
    /// Like [`RecordOnFree`](Self::RecordOnFree), but a stream's list records on free only once
    /// another stream has needed its blocks. The first hand-off from a list synchronizes (on a GPU:
    /// the context) instead of waiting on an event; from then on frees into that list record. So a
    /// stream whose blocks no other stream takes (the common case: one stream per thread or per
    /// pipeline) pays no event record at all, and the engine still only records or waits on the
    /// stream of the call in progress.
    #[default]
    Adaptive,
    /// Record on the owning stream only when another stream is about to take a block from its list.
    /// Saves the per-deallocation record, but records on streams the engine stored earlier, so every
    /// stream with free blocks in the engine must stay valid until the engine is released.
    RecordOnDemand,
}
