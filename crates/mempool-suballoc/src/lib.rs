//! Host-only suballocator engines: the address arithmetic of RMM's pool, fixed-size, binning and
//! arena resources, with no GPU underneath. This crate depends on neither `mempool-core` nor
//! `cudarc`, so the engines cannot reach the driver; `mempool-rmm` runs them over real streams and
//! re-exports this crate as `mempool_rmm::suballoc`.
//!
//! The engines here decide *which* addresses to hand out and *which streams must wait for which*
//! before an address may be reused; they never touch the memory behind an address. All four
//! implement one trait, [`Engine`], and each options type names its engine through
//! [`EngineOptions`], so that generic code (a memory resource, a test) builds and drives any of them.
//! Two small traits connect them to the world:
//!
//! - [`Upstream`]: where big chunks of address space come from (on a GPU, a driver pool or another
//!   memory resource; on the host, `SimUpstream`, behind the `testing` feature).
//! - [`StreamOrder`]: how one stream is made to wait for another through an event (on a GPU,
//!   `cuEventRecord` / `cuStreamWaitEvent`; on the host, `SimStreams` (feature `testing`), which keeps logical clocks
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
//! | [`PoolEngine`] | `pool_memory_resource` | coalescing good fit (TLSF classes): O(1) |
//! | [`FixedSizeEngine`] | `fixed_size_memory_resource` | O(1) |
//! | [`BinningEngine`] | `binning_memory_resource` | O(1) for binned sizes |
//! | [`ArenaEngine`] | `arena_memory_resource` | as the pool's, within per-stream arenas |
//!
//! Engines take `&mut self`. Threads share them through [`Sharded`]: several engines over one
//! upstream, each behind its own lock, one per thread, so that threads do not queue on one lock
//! (what `mempool-rmm`'s `SuballocatingResource` does). Engines are `Send` whenever their
//! upstream, stream order and events are.
//!
//! An upstream that fails to take a chunk back ([`Upstream::deallocate`] returns an error) does not
//! stop an engine: it forgets the chunk and reports the first such error from the call that returned
//! it ([`Engine::release_unused`], [`Engine::release`], or a deallocation that goes straight to the
//! upstream). `Drop` cannot report it and ignores it.
//!
//! [`workload`] holds the standard random workload the benchmarks draw from.
//!
//! ```
//! use mempool_suballoc::{Engine, PoolOptions, PoolEngine, SimStream, SimStreams, SimUpstream};
//!
//! let upstream = SimUpstream::new();
//! let mut pool = PoolEngine::new(upstream.clone(), SimStreams::new(), PoolOptions::default())?;
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
mod block;
mod block_table;
mod chunks;
mod engine;
#[cfg(test)]
mod engine_tests;
mod error;
mod fixed_size;
mod memory_map;
mod pool;
mod sharded;
#[cfg(any(test, feature = "testing"))]
mod sim;
mod stream_lists;
mod stream_order;
mod types;
mod upstream;
pub mod workload;

#[cfg(test)]
mod testing;

pub use arena::{ArenaEngine, ArenaOptions};
pub use binning::{BinningEngine, BinningOptions};
pub use block::Block;
pub use engine::{Engine, EngineOptions};
pub use error::{BoxError, Error, InvariantViolation, OutOfMemoryCause};
pub use fixed_size::{FixedSizeEngine, FixedSizeOptions};
pub use memory_map::{summarize, ChunkMap, MapRange, MapSummary};
pub use pool::{PoolEngine, PoolOptions};
pub use sharded::Sharded;
#[cfg(any(test, feature = "testing"))]
pub use sim::{
    SimEvent, SimStream, SimStreamCounts, SimStreams, SimUpstream, SimUpstreamStats, SyncPoint, SIM_BASE_ADDRESS,
    SIM_MAX_STREAMS,
};
pub use stream_order::StreamOrder;
pub use types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
pub use upstream::Upstream;
