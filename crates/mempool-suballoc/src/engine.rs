//! The interface every engine implements, so that one resource type, one test driver and one
//! conformance suite serve all four.

use std::fmt::Debug;
use std::hash::Hash;

use crate::error::{Error, InvariantViolation};

use crate::memory_map::ChunkMap;

use crate::stream_order::StreamOrder;

use crate::types::{EngineStats, EventPolicy};

use crate::upstream::Upstream;

/// A suballocator engine: hands out aligned address ranges carved from an [`Upstream`]'s chunks,
/// and orders streams through a [`StreamOrder`] before a range moves from one stream to another
/// (the [crate docs](crate) state the rule and which streams an engine may touch).
///
/// Implemented by [`PoolEngine`](crate::pool::PoolEngine), [`FixedSizeEngine`](crate::fixed_size::FixedSizeEngine),
/// [`BinningEngine`](crate::binning::BinningEngine) and [`ArenaEngine`](crate::arena::ArenaEngine). What is common
/// to all of them:
///
/// - `allocate(0, _)` returns address 0 and `deallocate(_, 0, _)` does nothing, neither touching any
///   state; every other address is non-zero and aligned to [`ALIGNMENT`](crate::types::ALIGNMENT).
/// - Out of memory is [`Error::OutOfMemory`] with `requested` the size the caller asked for.
/// - A `deallocate` that names no live allocation (double free, foreign address, wrong size) is
///   [`Error::UnknownAllocation`] and changes nothing.
/// - Dropping an engine does what [`release`](Self::release) does, ignoring its errors (see
///   below).
///
/// ```
/// use mempool_suballoc::{Engine, EngineOptions, PoolOptions, SimStream, SimStreams, SimUpstream};
///
/// /// Allocates and frees one block with any engine.
/// fn round_trip<C: EngineOptions>(options: C) -> Result<(), mempool_suballoc::Error> {
///     let upstream = SimUpstream::new();
///     let mut engine: C::Engine<SimUpstream, SimStreams> = Engine::new(upstream.clone(), SimStreams::new(), options)?;
///     let s = SimStream::new(0);
///     let a = engine.allocate(1000, s)?;
///     engine.deallocate(a, 1000, s)?;
///     let reserved = engine.stats().reserved_bytes;
///     assert_eq!(engine.release_unused(s)?, reserved);
///     assert_eq!(upstream.stats().live_chunks, 0);
///     Ok(())
/// }
/// round_trip(PoolOptions::default())?;
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
    /// The engine's options.
    type Options: EngineOptions;
    /// A stream's identity, as the stream order names it; free lists are kept per stream.
    type Stream: Copy + Eq + Hash + Debug;
    /// Where the engine's chunks come from.
    type Upstream: Upstream<Self::Stream>;
    /// How the engine orders one stream after another.
    type Order: StreamOrder<Stream = Self::Stream>;

    /// An engine over `upstream` that orders streams through `order`. Reserves nothing yet. Fails
    /// with [`Error::InvalidOptions`] for options that cannot work.
    fn new(upstream: Self::Upstream, order: Self::Order, options: Self::Options) -> Result<Self, Error>
    where
        Self: Sized;

    /// The options, with sizes rounded as the engine uses them.
    fn options(&self) -> Self::Options;

    /// Allocates `bytes` for use on `stream`: an address aligned to
    /// [`ALIGNMENT`](crate::types::ALIGNMENT), or 0 for 0 bytes.
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

    /// Each upstream chunk with its used and free ranges, in address order: a read-only picture
    /// for snapshots and out-of-memory reports, built on each call (it walks every block: not for
    /// the allocation path).
    fn memory_map(&self) -> Vec<ChunkMap<Self::Stream>>;

    /// Checks the engine's bookkeeping: every invariant written next to its fields, and
    /// `free_bytes + used_bytes == reserved_bytes`.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;

    /// The upstream.
    fn upstream(&self) -> &Self::Upstream;

    /// The stream order.
    fn stream_order(&self) -> &Self::Order;
}

/// The options of one kind of engine, which names the engine over any upstream and stream
/// order: what lets one generic type (a memory resource, a test) build any engine from its
/// options alone.
///
/// The engine it names is `Send`, for the upstreams, stream orders and events that are: a resource
/// shared between threads keeps its engine behind a lock.
///
/// ```
/// use mempool_suballoc::{EngineOptions, EventPolicy, FixedSizeOptions, FixedSizeEngine, SimStreams, SimUpstream};
///
/// let mut options = FixedSizeOptions::default();
/// options.set_event_policy(EventPolicy::RecordOnFree);
/// let engine: <FixedSizeOptions as EngineOptions>::Engine<SimUpstream, SimStreams> =
///     mempool_suballoc::Engine::new(SimUpstream::new(), SimStreams::new(), options)?;
/// let _: &FixedSizeEngine<SimUpstream, SimStreams> = &engine;
/// # Ok::<(), mempool_suballoc::Error>(())
/// ```
pub trait EngineOptions: Clone + Debug {
    /// The engine this configures, over upstream `U` and stream order `O`.
    type Engine<U, O>: Engine<Options = Self, Stream = O::Stream, Upstream = U, Order = O> + Send
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

/// The parts of an engine that are the same for every engine: its options type names it
/// ([`EngineOptions`]), and dropping it releases everything as [`Engine::release`] does, ignoring the
/// error (see [`Engine`], "Dropping").
macro_rules! engine_common {
    ($options:ident => $engine:ident) => {
        impl $crate::engine::EngineOptions for $options {
            type Engine<U, O>
                = $engine<U, O>
            where
                O: $crate::stream_order::StreamOrder + Send,
                O::Stream: Send,
                O::Event: Send,
                U: $crate::upstream::Upstream<O::Stream> + Send;

            fn event_policy(&self) -> $crate::types::EventPolicy {
                self.event_policy
            }

            fn set_event_policy(&mut self, policy: $crate::types::EventPolicy) {
                self.event_policy = policy;
            }
        }

        impl<U, O> Drop for $engine<U, O>
        where
            U: $crate::upstream::Upstream<O::Stream>,
            O: $crate::stream_order::StreamOrder,
        {
            fn drop(&mut self) {
                let _ = $crate::engine::Engine::release(self);
            }
        }
    };
}
pub(crate) use engine_common;

/// `bytes` rounded up to [`ALIGNMENT`](crate::types::ALIGNMENT), the size an engine serves for a request, or
/// [`Error::OutOfMemory`] with
/// [`OutOfMemoryCause::AddressSpace`](crate::error::OutOfMemoryCause::AddressSpace) when the rounding
/// overflows.
#[inline]
pub(crate) fn request_size(bytes: u64) -> Result<u64, Error> {
    // `ok_or_else`: an eagerly built error would be dropped on every successful call.
    crate::types::align_up(bytes).ok_or_else(|| Error::OutOfMemory {
        requested: bytes,
        cause: crate::error::OutOfMemoryCause::AddressSpace,
    })
}
