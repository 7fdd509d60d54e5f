//! The interface every engine implements, so that one resource type, one test driver and one
//! conformance suite serve all four.

use std::fmt::Debug;
use std::hash::Hash;

use super::{EngineStats, Error, EventPolicy, InvariantViolation, StreamOrder, Upstream};

/// A suballocator engine: hands out aligned address ranges carved from an [`Upstream`]'s chunks,
/// and orders streams through a [`StreamOrder`] before a range moves from one stream to another
/// (the [crate docs](crate) state the rule and which streams an engine may touch).
///
/// Implemented by [`PoolEngine`](crate::PoolEngine), [`FixedSizeEngine`](crate::FixedSizeEngine),
/// [`BinningEngine`](crate::BinningEngine) and [`ArenaEngine`](crate::ArenaEngine). What is common
/// to all of them:
///
/// - `allocate(0, _)` returns address 0 and `deallocate(_, 0, _)` does nothing, neither touching any
///   state; every other address is non-zero and aligned to [`ALIGNMENT`](crate::ALIGNMENT).
/// - Out of memory is [`Error::OutOfMemory`] with `requested` the size the caller asked for.
/// - A `deallocate` that names no live allocation (double free, foreign address, wrong size) is
///   [`Error::UnknownAllocation`] and changes nothing.
/// - Dropping an engine does what [`release`](Self::release) does, ignoring its errors (see
///   below).
///
/// ```
/// use mempool_suballoc::{Engine, EngineConfig, PoolConfig, SimStream, SimStreams, SimUpstream};
///
/// /// Allocates and frees one block with any engine.
/// fn round_trip<C: EngineConfig>(config: C) -> Result<(), mempool_suballoc::Error> {
///     let upstream = SimUpstream::new();
///     let mut engine: C::Engine<SimUpstream, SimStreams> = Engine::new(upstream.clone(), SimStreams::new(), config)?;
///     let s = SimStream::new(0);
///     let a = engine.allocate(1000, s)?;
///     engine.deallocate(a, 1000, s)?;
///     let reserved = engine.stats().reserved_bytes;
///     assert_eq!(engine.release_unused(s)?, reserved);
///     assert_eq!(upstream.stats().live_chunks, 0);
///     Ok(())
/// }
/// round_trip(PoolConfig::default())?;
/// # Ok::<(), mempool_suballoc::Error>(())
/// ```
///
/// # Dropping
///
/// `drop` cannot return `release`'s error, so it ignores it: after a synchronize error the chunks
/// are leaked rather than returned while the GPU may still use them; a chunk the upstream fails to
/// take back is forgotten. A caller that needs to see those errors calls `release` (or, once nothing
/// is live, `release_unused`) before dropping the engine, which then has nothing left to return.
pub trait Engine {
    /// The engine's configuration.
    type Config: EngineConfig;
    /// A stream's identity, as the stream order names it; free lists are kept per stream.
    type Stream: Copy + Eq + Hash + Debug;
    /// Where the engine's chunks come from.
    type Upstream: Upstream<Self::Stream>;
    /// How the engine orders one stream after another.
    type Order: StreamOrder<Stream = Self::Stream>;

    /// An engine over `upstream` that orders streams through `order`. Reserves nothing yet. Fails
    /// with [`Error::InvalidConfig`] for a configuration that cannot work.
    fn new(upstream: Self::Upstream, order: Self::Order, config: Self::Config) -> Result<Self, Error>
    where
        Self: Sized;

    /// The configuration, with sizes rounded as the engine uses them.
    fn config(&self) -> Self::Config;

    /// Allocates `bytes` for use on `stream`: an address aligned to
    /// [`ALIGNMENT`](crate::ALIGNMENT), or 0 for 0 bytes.
    ///
    /// Fails with [`Error::OutOfMemory`] (with `requested == bytes`) when neither the free lists nor
    /// the upstream can serve it, [`Error::TooLarge`] above what the engine serves at all, or
    /// [`Error::Stream`] when an event wait needed to take another stream's memory fails (the memory
    /// then stays where it was).
    fn allocate(&mut self, bytes: u64, stream: Self::Stream) -> Result<u64, Error>;

    /// Frees an allocation: `addr` as returned by [`allocate`](Self::allocate) for `bytes`. The
    /// memory may be reused at once by work on `stream`, and by other streams once ordered after it.
    /// Freeing 0 bytes does nothing.
    ///
    /// Fails with [`Error::UnknownAllocation`] (changing nothing) when `addr` is not a live
    /// allocation of `bytes`; with another error when a stream operation or, for memory that goes
    /// straight back to the upstream, the upstream fails.
    fn deallocate(&mut self, addr: u64, bytes: u64, stream: Self::Stream) -> Result<(), Error>;

    /// Moves every stream's free memory into `into`'s free list, after ordering `into` after each
    /// stream (an event wait, or a synchronize), where it coalesces if the engine coalesces.
    fn merge_free_lists(&mut self, into: Self::Stream) -> Result<(), Error>;

    /// Returns to the upstream, on `stream`, every chunk that holds no live allocation, after
    /// merging every stream's free memory into `stream`'s list (as
    /// [`merge_free_lists`](Self::merge_free_lists)). Live allocations stay valid. Returns the bytes
    /// released.
    ///
    /// A chunk whose return the upstream refuses is forgotten all the same (the engine never hands
    /// out its memory again); the first such error is returned after every other chunk was
    /// returned.
    fn release_unused(&mut self, stream: Self::Stream) -> Result<u64, Error>;

    /// Synchronizes every stream the engine has seen, then returns every chunk to the upstream on
    /// the stream it was allocated on, live allocations included (their addresses become invalid),
    /// as RMM does when a resource is destroyed, and forgets everything. On a synchronize error
    /// nothing is released. A chunk whose return the upstream refuses is forgotten all the same;
    /// the first such error is returned after every other chunk was returned.
    fn release(&mut self) -> Result<(), Error>;

    /// Bytes reserved, used and free, and block counts.
    fn stats(&self) -> EngineStats;

    /// Checks the engine's bookkeeping: every invariant written next to its fields, and
    /// `free_bytes + used_bytes == reserved_bytes`.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;

    /// The upstream.
    fn upstream(&self) -> &Self::Upstream;

    /// The stream order.
    fn stream_order(&self) -> &Self::Order;
}

/// The configuration of one kind of engine, which names the engine over any upstream and stream
/// order: what lets one generic type (a memory resource, a test) build any engine from its
/// configuration alone.
///
/// The engine it names is `Send`, for the upstreams, stream orders and events that are: a resource
/// shared between threads keeps its engine behind a lock.
///
/// ```
/// use mempool_suballoc::{EngineConfig, EventPolicy, FixedSizeConfig, FixedSizeEngine, SimStreams, SimUpstream};
///
/// let mut config = FixedSizeConfig::default();
/// config.set_event_policy(EventPolicy::RecordOnFree);
/// let engine: <FixedSizeConfig as EngineConfig>::Engine<SimUpstream, SimStreams> =
///     mempool_suballoc::Engine::new(SimUpstream::new(), SimStreams::new(), config)?;
/// let _: &FixedSizeEngine<SimUpstream, SimStreams> = &engine;
/// # Ok::<(), mempool_suballoc::Error>(())
/// ```
pub trait EngineConfig: Clone + Debug {
    /// The engine this configures, over upstream `U` and stream order `O`.
    type Engine<U, O>: Engine<Config = Self, Stream = O::Stream, Upstream = U, Order = O> + Send
    where
        O: StreamOrder + Send,
        O::Stream: Send,
        O::Event: Send,
        U: Upstream<O::Stream> + Send;

    /// When the engine records the events that hand free memory to other streams.
    fn event_policy(&self) -> EventPolicy;

    /// Sets [`event_policy`](Self::event_policy).
    fn set_event_policy(&mut self, policy: EventPolicy);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArenaConfig, BinningConfig, FixedSizeConfig, PoolConfig, SimStream, SimStreams, SimUpstream};

    const A: SimStream = SimStream::new(0);

    /// An upstream that refuses to take chunks back: `release_unused`, `release` and `drop` forget
    /// them all the same (the engine stays consistent) and the first two report the error.
    fn upstream_errors_are_reported_and_leave_the_engine_consistent<C: EngineConfig>(config: C) {
        let up = SimUpstream::new();
        let mut e: C::Engine<SimUpstream, SimStreams> = Engine::new(up.clone(), SimStreams::new(), config).unwrap();
        let x = e.allocate(1000, A).unwrap();
        e.deallocate(x, 1000, A).unwrap();
        up.set_fail_deallocations(true);
        let err = e.release_unused(A).unwrap_err();
        assert!(matches!(err, Error::Upstream { op: "deallocate", .. }), "{err:?}");
        assert_eq!(e.stats().reserved_bytes, 0, "the refused chunks are forgotten");
        e.check_invariants().unwrap();
        assert!(up.stats().live_chunks > 0, "and leaked upstream");

        up.set_fail_deallocations(false);
        e.allocate(1000, A).unwrap();
        up.set_fail_deallocations(true);
        let err = e.release().unwrap_err();
        assert!(matches!(err, Error::Upstream { op: "deallocate", .. }), "{err:?}");
        assert_eq!(e.stats(), EngineStats::default());
        e.check_invariants().unwrap();

        e.allocate(1000, A).unwrap();
        drop(e);
        up.set_fail_deallocations(false);
    }

    #[test]
    fn upstream_errors_are_reported_by_every_engine() {
        upstream_errors_are_reported_and_leave_the_engine_consistent(PoolConfig::default());
        upstream_errors_are_reported_and_leave_the_engine_consistent(FixedSizeConfig {
            block_size: 1024,
            blocks_per_chunk: 4,
            ..Default::default()
        });
        upstream_errors_are_reported_and_leave_the_engine_consistent(BinningConfig::default());
        upstream_errors_are_reported_and_leave_the_engine_consistent(ArenaConfig::default());
    }

    #[test]
    fn a_large_binning_allocation_the_upstream_refuses_is_forgotten() {
        let up = SimUpstream::new();
        let config = BinningConfig {
            max_size_exponent: 12,
            ..Default::default()
        };
        let mut e: crate::BinningEngine<_, _> = Engine::new(up.clone(), SimStreams::new(), config).unwrap();
        let x = e.allocate(10_000, A).unwrap();
        up.set_fail_deallocations(true);
        assert!(matches!(
            e.deallocate(x, 10_000, A),
            Err(Error::Upstream { op: "deallocate", .. })
        ));
        assert!(matches!(
            e.deallocate(x, 10_000, A),
            Err(Error::UnknownAllocation { .. })
        ));
        assert_eq!(e.stats(), EngineStats::default());
        e.check_invariants().unwrap();
        up.set_fail_deallocations(false);
    }
}
