//! Blocks of one size in O(1): RMM's `fixed_size_memory_resource` on addresses.

use std::collections::HashSet;

use super::addr_map::{AddrMap, LiveSet};
use super::chunks::{check_balance, Chunks};
use super::stream_lists::StreamLists;
use crate::engine::Engine;
use crate::error::{ensure, Error, InvariantViolation};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
use crate::upstream::Upstream;

/// The shape of a [`FixedSizeEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedSizeConfig {
    /// Size of every block, rounded up to [`ALIGNMENT`]; the largest request served.
    pub block_size: u64,
    /// Blocks carved from each upstream chunk (at least 1).
    pub blocks_per_chunk: u64,
    /// When to record the events that hand free blocks to other streams.
    pub event_policy: EventPolicy,
}

impl Default for FixedSizeConfig {
    /// RMM's defaults: 1 MiB blocks, 128 per chunk, [`EventPolicy::Adaptive`].
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            blocks_per_chunk: 128,
            event_policy: EventPolicy::Adaptive,
        }
    }
}

/// The fixed-size bookkeeping without upstream and stream order, so that the binning engine can
/// keep one per bin over a shared upstream.
pub(crate) struct FixedCore<O: StreamOrder> {
    /// Aligned to [`ALIGNMENT`], non-zero.
    block_size: u64,
    /// `block_size * blocks_per_chunk`, which does not overflow.
    chunk_size: u64,
    /// Upstream chunks, each `chunk_size` bytes.
    chunks: Chunks<O::Stream>,
    /// Free blocks per stream, as stacks of addresses (LIFO: the most recently freed block is the
    /// one most likely still in cache or not yet reused by the GPU's other work). Invariant: with
    /// `live`, exactly the blocks of all chunks, each once.
    lists: StreamLists<O, Vec<u64>>,
    /// Live blocks.
    live: LiveSet,
}

impl<O: StreamOrder> FixedCore<O> {
    pub(crate) fn new(block_size: u64, blocks_per_chunk: u64, policy: EventPolicy) -> Result<Self, Error> {
        if block_size == 0 {
            return Err(Error::InvalidConfig("block_size is 0"));
        }
        if blocks_per_chunk == 0 {
            return Err(Error::InvalidConfig("blocks_per_chunk is 0"));
        }
        let block_size = align_up(block_size).ok_or(Error::InvalidConfig("block_size is not representable"))?;
        let chunk_size = block_size
            .checked_mul(blocks_per_chunk)
            .ok_or(Error::InvalidConfig("block_size * blocks_per_chunk overflows"))?;
        Ok(Self {
            block_size,
            chunk_size,
            chunks: Chunks::default(),
            lists: StreamLists::new(policy),
            live: LiveSet::default(),
        })
    }

    pub(crate) fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Allocates one block for `stream`; `requested` is what the caller asked for (for errors).
    #[inline]
    pub(crate) fn allocate<U: Upstream<O::Stream>>(
        &mut self,
        upstream: &U,
        order: &O,
        requested: u64,
        stream: O::Stream,
    ) -> Result<u64, Error> {
        let i = self.lists.find(stream);
        let addr = match self.lists.list_mut(i).pop() {
            Some(a) => a,
            None => self.allocate_slow(upstream, order, requested, stream, i)?,
        };
        self.live.insert(addr, ());
        Ok(addr)
    }

    /// Takes a block from another stream's list (after an event wait), or carves a new chunk.
    /// Merging whole lists, the pool's third step, gains nothing here: any block fits.
    #[cold]
    fn allocate_slow<U: Upstream<O::Stream>>(
        &mut self,
        upstream: &U,
        order: &O,
        requested: u64,
        stream: O::Stream,
        i: usize,
    ) -> Result<u64, Error> {
        for j in 0..self.lists.len() {
            if j != i && !self.lists.list(j).is_empty() {
                self.lists.order_after(order, stream, j)?;
                if let Some(a) = self.lists.list_mut(j).pop() {
                    return Ok(a);
                }
            }
        }
        let addr = self
            .chunks
            .allocate(upstream, self.chunk_size, stream)
            .map_err(|e| e.with_requested(requested))?;
        let n = self.chunk_size / self.block_size;
        if n > 1 {
            // Pushed high to low, so the chunk is handed out in address order.
            let bs = self.block_size;
            self.lists.list_mut(i).extend((1..n).rev().map(|k| addr + k * bs));
            self.lists.entered(order, i);
        }
        Ok(addr)
    }

    /// Frees the block at `addr` into `stream`'s list.
    #[inline]
    pub(crate) fn deallocate(&mut self, order: &O, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        if self.live.remove(addr).is_none() {
            return Err(Error::UnknownAllocation { addr, bytes });
        }
        let i = self.lists.find(stream);
        self.lists.list_mut(i).push(addr);
        self.lists.entered(order, i);
        Ok(())
    }

    pub(crate) fn merge_free_lists(&mut self, order: &O, into: O::Stream) -> Result<(), Error> {
        let i = self.lists.find(into);
        for j in 0..self.lists.len() {
            if j != i && !self.lists.list(j).is_empty() {
                self.lists.merge_into(order, i, j)?;
            }
        }
        Ok(())
    }

    /// Merges every stream's free blocks into `stream`'s list, then returns to the upstream, on
    /// `stream`, every chunk all of whose blocks are there (that is, with no live block).
    pub(crate) fn release_unused<U: Upstream<O::Stream>>(
        &mut self,
        upstream: &U,
        order: &O,
        stream: O::Stream,
    ) -> Result<u64, Error> {
        self.merge_free_lists(order, stream)?;
        let i = self.lists.find(stream);
        let per_chunk = self.chunk_size / self.block_size;
        let chunk_of = |a: u64| self.chunks.containing(a).map_or(0, |(c, _)| c);
        let mut free_in: AddrMap<u64> = AddrMap::default();
        for &a in self.lists.list(i) {
            *free_in.entry(chunk_of(a)).or_default() += 1;
        }
        let unused: HashSet<u64> = free_in
            .into_iter()
            .filter(|&(_, n)| n == per_chunk)
            .map(|(c, _)| c)
            .collect();
        if unused.is_empty() {
            return Ok(0);
        }
        let mut list = std::mem::take(self.lists.list_mut(i));
        list.retain(|&a| !unused.contains(&chunk_of(a)));
        *self.lists.list_mut(i) = list;
        let mut released = 0;
        let mut result = Ok(());
        for c in unused {
            match self.chunks.release(upstream, c, stream) {
                Ok(n) => released += n,
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| released)
    }

    /// Blocks the host until every stream seen has completed its work.
    pub(crate) fn synchronize(&self, order: &O) -> Result<(), Error> {
        self.lists.synchronize_all(order)
    }

    /// Returns every chunk to the upstream and forgets all blocks, once the caller has
    /// [synchronized](Self::synchronize); returns the first error of the upstream.
    pub(crate) fn release_synchronized<U: Upstream<O::Stream>>(&mut self, upstream: &U) -> Result<(), Error> {
        self.lists.clear();
        self.live.clear();
        self.chunks.release_all(upstream)
    }

    /// Synchronizes every stream seen, then returns every chunk to the upstream and forgets all
    /// blocks. On a synchronize error, changes nothing; an upstream error is returned after
    /// everything was returned and forgotten.
    pub(crate) fn release<U: Upstream<O::Stream>>(&mut self, upstream: &U, order: &O) -> Result<(), Error> {
        self.synchronize(order)?;
        self.release_synchronized(upstream)
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let reserved = self.chunks.reserved();
        let used = self.live.len() as u64 * self.block_size;
        EngineStats {
            reserved_bytes: reserved,
            used_bytes: used,
            free_bytes: reserved - used,
            free_blocks: self.lists.blocks(),
            live_allocations: self.live.len(),
            upstream_chunks: self.chunks.len(),
        }
    }

    pub(crate) fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.chunks.check("fixed-size")?;
        ensure!(
            self.chunks.iter().all(|(_, c)| c.size == self.chunk_size),
            "fixed-size: a chunk is not {} bytes",
            self.chunk_size
        );
        let bs = self.block_size;
        let mut seen = HashSet::with_capacity(self.live.len() + self.lists.blocks());
        let free = self.lists.iter().flat_map(|(_, l)| l.iter().map(|&a| (a, true)));
        let live = self.live.iter().map(|(a, ())| (a, false));
        for (a, is_free) in free.chain(live) {
            let what = if is_free { "free" } else { "live" };
            ensure!(
                seen.insert(a),
                "fixed-size: block {a:#x} ({bs} bytes) is listed twice (free or live)"
            );
            let chunk = self.chunks.containing(a).map(|(c, _)| c);
            ensure!(
                chunk.is_some_and(|c| a + bs <= c + self.chunk_size && (a - c) % bs == 0),
                "fixed-size: {what} block {a:#x} is not a block of an upstream chunk"
            );
            ensure!(a % ALIGNMENT == 0, "fixed-size: block {a:#x} is misaligned");
        }
        let st = self.stats();
        ensure!(
            seen.len() as u64 * bs == st.reserved_bytes,
            "fixed-size: free {} + used {} blocks of {bs} bytes do not cover the reserved {} bytes",
            st.free_blocks,
            st.live_allocations,
            st.reserved_bytes
        );
        check_balance("fixed-size", &st)
    }
}

/// Blocks of one fixed size, carved from upstream chunks of `blocks_per_chunk` blocks: RMM's
/// `fixed_size_memory_resource`, on addresses.
///
/// Allocation and deallocation are O(1) (a stack pop or push per stream, a hash-set update for
/// the live set that catches double frees). Blocks move between streams by the same event rule as
/// the pool's (see the [module docs](super)). Requests above the block size fail with
/// [`Error::TooLarge`]; 0 bytes returns address 0 without touching any state.
///
/// ```
/// use mempool_suballoc::{Engine, FixedSizeConfig, FixedSizeEngine, SimStream, SimStreams, SimUpstream};
///
/// let config = FixedSizeConfig { block_size: 4096, blocks_per_chunk: 16, ..Default::default() };
/// let mut fixed = FixedSizeEngine::new(SimUpstream::new(), SimStreams::new(), config)?;
/// let s = SimStream::new(0);
/// let a = fixed.allocate(100, s)?;
/// let b = fixed.allocate(4096, s)?;
/// assert_eq!(b, a + 4096);
/// assert!(fixed.allocate(4097, s).is_err());
/// assert_eq!(fixed.stats().reserved_bytes, 16 * 4096);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct FixedSizeEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    upstream: U,
    order: O,
    /// Normalized: `block_size` rounded up to [`ALIGNMENT`].
    config: FixedSizeConfig,
    core: FixedCore<O>,
}

impl<U, O> FixedSizeEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    /// The block size (rounded up to [`ALIGNMENT`]).
    pub fn block_size(&self) -> u64 {
        self.core.block_size()
    }
}

impl<U, O> Engine for FixedSizeEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    type Config = FixedSizeConfig;
    type Stream = O::Stream;
    type Upstream = U;
    type Order = O;

    /// An engine over `upstream` that orders streams through `order`. Reserves nothing yet. Fails
    /// with [`Error::InvalidConfig`] for a zero block size or count, or a chunk size that overflows.
    fn new(upstream: U, order: O, config: FixedSizeConfig) -> Result<Self, Error> {
        let core = FixedCore::new(config.block_size, config.blocks_per_chunk, config.event_policy)?;
        Ok(Self {
            upstream,
            order,
            config: FixedSizeConfig {
                block_size: core.block_size(),
                ..config
            },
            core,
        })
    }

    fn config(&self) -> FixedSizeConfig {
        self.config
    }

    /// Allocates one block for `bytes <= block_size` on `stream`; 0 for 0 bytes.
    ///
    /// Fails with [`Error::TooLarge`] above the block size, [`Error::OutOfMemory`] (with
    /// `requested == bytes`) when the upstream is full, [`Error::Stream`] when the event wait to
    /// take another stream's block fails.
    #[inline]
    fn allocate(&mut self, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        if bytes == 0 {
            return Ok(0);
        }
        if bytes > self.core.block_size() {
            return Err(Error::TooLarge {
                requested: bytes,
                limit: self.core.block_size(),
            });
        }
        self.core.allocate(&self.upstream, &self.order, bytes, stream)
    }

    /// Frees a block allocated with `bytes`; reusable at once on `stream`, by other streams after
    /// an event wait. Freeing 0 bytes does nothing. Fails with [`Error::UnknownAllocation`]
    /// (changing nothing) when `addr` is not a live block or `bytes` exceeds the block size.
    #[inline]
    fn deallocate(&mut self, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        if bytes > self.core.block_size() {
            return Err(Error::UnknownAllocation { addr, bytes });
        }
        self.core.deallocate(&self.order, addr, bytes, stream)
    }

    fn merge_free_lists(&mut self, into: O::Stream) -> Result<(), Error> {
        self.core.merge_free_lists(&self.order, into)
    }

    fn release_unused(&mut self, stream: O::Stream) -> Result<u64, Error> {
        self.core.release_unused(&self.upstream, &self.order, stream)
    }

    fn release(&mut self) -> Result<(), Error> {
        self.core.release(&self.upstream, &self.order)
    }

    fn stats(&self) -> EngineStats {
        self.core.stats()
    }

    /// Checks that every block, free or live, appears once, is a block of an upstream chunk and is
    /// aligned, and that free + used = reserved.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.core.check_invariants()
    }

    fn upstream(&self) -> &U {
        &self.upstream
    }

    fn stream_order(&self) -> &O {
        &self.order
    }
}

crate::engine::engine_common!(FixedSizeConfig => FixedSizeEngine);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OutOfMemoryCause;
    use crate::stream_order::{SimStream, SimStreams};
    use crate::testing::{self, ops, world};
    use crate::upstream::SimUpstream;
    use proptest::prelude::*;

    const A: SimStream = SimStream::new(0);
    const B: SimStream = SimStream::new(1);
    const C: SimStream = SimStream::new(2);

    fn fixed(block_size: u64, blocks_per_chunk: u64, up: SimUpstream) -> FixedSizeEngine<SimUpstream, SimStreams> {
        let config = FixedSizeConfig {
            block_size,
            blocks_per_chunk,
            ..Default::default()
        };
        FixedSizeEngine::new(up, SimStreams::new(), config).unwrap()
    }

    #[test]
    fn carves_chunks_in_order_and_reuses_lifo() {
        let up = SimUpstream::new();
        let mut f = fixed(1000, 4, up.clone());
        assert_eq!(f.block_size(), 1024);
        let a: Vec<u64> = (0..5).map(|_| f.allocate(1000, A).unwrap()).collect();
        assert_eq!(up.stats().allocations, 2);
        assert_eq!(a[1..4], [a[0] + 1024, a[0] + 2048, a[0] + 3072]);
        f.deallocate(a[2], 1, A).unwrap();
        f.deallocate(a[0], 1024, A).unwrap();
        assert_eq!(f.allocate(5, A).unwrap(), a[0]);
        assert_eq!(f.allocate(5, A).unwrap(), a[2]);
        let st = f.stats();
        assert_eq!(st.reserved_bytes, 8 * 1024);
        assert_eq!(st.used_bytes, 5 * 1024);
        assert_eq!(st.free_blocks, 3);
        f.check_invariants().unwrap();
    }

    #[test]
    fn rejects_oversized_zero_and_unknown() {
        let mut f = fixed(512, 2, SimUpstream::new());
        assert!(matches!(
            f.allocate(513, A),
            Err(Error::TooLarge {
                requested: 513,
                limit: 512
            })
        ));
        assert_eq!(f.allocate(0, A).unwrap(), 0);
        f.deallocate(0, 0, A).unwrap();
        assert_eq!(f.stats(), EngineStats::default());
        let a = f.allocate(512, A).unwrap();
        assert!(matches!(
            f.deallocate(a + 256, 10, A),
            Err(Error::UnknownAllocation { .. })
        ));
        assert!(matches!(f.deallocate(a, 513, A), Err(Error::UnknownAllocation { .. })));
        f.deallocate(a, 512, A).unwrap();
        assert!(matches!(f.deallocate(a, 512, A), Err(Error::UnknownAllocation { .. })));
        f.check_invariants().unwrap();
        for (block_size, blocks_per_chunk) in [(0, 1), (256, 0), (u64::MAX / 2, 4)] {
            let config = FixedSizeConfig {
                block_size,
                blocks_per_chunk,
                ..Default::default()
            };
            assert!(matches!(
                FixedSizeEngine::new(SimUpstream::new(), SimStreams::new(), config),
                Err(Error::InvalidConfig(_))
            ));
        }
    }

    #[test]
    fn upstream_exhaustion_reports_the_requested_size() {
        let mut f = fixed(1024, 4, SimUpstream::with_capacity(4096));
        for _ in 0..4 {
            f.allocate(1024, A).unwrap();
        }
        assert!(matches!(
            f.allocate(700, A),
            Err(Error::OutOfMemory {
                requested: 700,
                cause: OutOfMemoryCause::Upstream
            })
        ));
    }

    #[test]
    fn blocks_cross_streams_only_after_a_wait() {
        let sim = SimStreams::new();
        let config = FixedSizeConfig {
            block_size: 256,
            blocks_per_chunk: 1,
            event_policy: EventPolicy::RecordOnDemand,
        };
        let mut f = FixedSizeEngine::new(SimUpstream::new(), sim.clone(), config).unwrap();
        let a = f.allocate(256, A).unwrap();
        let freed = sim.point(A);
        f.deallocate(a, 256, A).unwrap();
        assert_eq!(sim.counts().records, 0);
        assert_eq!(f.allocate(256, B).unwrap(), a);
        assert_eq!(sim.counts().waits, 1);
        assert!(sim.is_ordered_after(B, freed));
        assert_eq!(f.stats().upstream_chunks, 1);
    }

    #[test]
    fn release_unused_returns_only_chunks_without_live_blocks() {
        let up = SimUpstream::new();
        let mut f = fixed(256, 2, up.clone());
        let a: Vec<u64> = (0..4).map(|_| f.allocate(256, A).unwrap()).collect();
        assert_eq!(up.stats().live_chunks, 2);
        // The first chunk's blocks are free in two streams' lists; the second chunk has a live block.
        f.deallocate(a[0], 256, A).unwrap();
        f.deallocate(a[1], 256, B).unwrap();
        f.deallocate(a[2], 256, A).unwrap();
        assert_eq!(f.release_unused(C).unwrap(), 512);
        assert_eq!(up.stats().live_chunks, 1);
        assert!(up.contains(a[3], 256));
        f.check_invariants().unwrap();
        f.deallocate(a[3], 256, A).unwrap();
        assert_eq!(f.release_unused(A).unwrap(), 512);
        assert_eq!(f.stats(), EngineStats::default());
        assert_eq!(up.stats().live_chunks, 0);
    }

    #[test]
    fn release_and_drop_return_chunks() {
        let up = SimUpstream::new();
        let mut f = fixed(256, 3, up.clone());
        for _ in 0..7 {
            f.allocate(1, A).unwrap();
        }
        f.release().unwrap();
        assert_eq!(up.stats().live_chunks, 0);
        f.allocate(1, B).unwrap();
        drop(f);
        assert_eq!(up.stats().live_chunks, 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn random_sequences(ops in ops(1024, 3, 150), per_chunk in 1u64..6) {
            let w = world(None, EventPolicy::RecordOnFree);
            let config = FixedSizeConfig { block_size: 1024, blocks_per_chunk: per_chunk, ..Default::default() };
            let f = FixedSizeEngine::new(w.up.clone(), w.order.clone(), config).unwrap();
            testing::run(f, &w, &ops, false)?;
        }

        #[test]
        fn random_sequences_with_a_small_upstream(ops in ops(1024, 3, 150)) {
            let w = world(Some(24 * 1024), EventPolicy::RecordOnDemand);
            let config = FixedSizeConfig { block_size: 1024, blocks_per_chunk: 4, event_policy: EventPolicy::RecordOnDemand };
            let f = FixedSizeEngine::new(w.up.clone(), w.order.clone(), config).unwrap();
            testing::run(f, &w, &ops, true)?;
        }
    }
}
