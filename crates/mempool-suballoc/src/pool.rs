//! The coalescing good-fit pool (TLSF classes): RMM's `pool_memory_resource` on addresses.

use super::block_table::{BlockTable, SizeIndex};
use super::chunks::{check_disjoint, Chunks};
use super::stream_lists::StreamLists;
use crate::block::Block;
use crate::engine::Engine;
use crate::error::{ensure, Error, InvariantViolation, OutOfMemoryCause};
use crate::memory_map::{self, ChunkMap};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
use crate::upstream::Upstream;

/// How a [`PoolEngine`] (or an [`ArenaEngine`](super::ArenaEngine)'s global arena) grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// Bytes to reserve with the first growth, rounded up to [`ALIGNMENT`]. The pool reserves it on
    /// its first allocation (on that allocation's stream) rather than at construction, because
    /// reserving needs a stream. 0: the first growth is the first request.
    pub initial_size: u64,
    /// The pool never reserves more than this (rounded down to [`ALIGNMENT`]); past it, allocations
    /// fail with [`Error::OutOfMemory`]. `None`: limited only by the upstream.
    pub maximum_size: Option<u64>,
    /// When to record the events that hand free blocks to other streams.
    pub event_policy: EventPolicy,
}

impl Default for PoolOptions {
    /// No initial reservation, no maximum, [`EventPolicy::Adaptive`].
    fn default() -> Self {
        Self {
            initial_size: 0,
            maximum_size: None,
            event_policy: EventPolicy::Adaptive,
        }
    }
}

impl PoolOptions {
    /// Checks the options and rounds its sizes to [`ALIGNMENT`].
    fn normalized(self) -> Result<Self, Error> {
        let initial_size =
            align_up(self.initial_size).ok_or(Error::InvalidOptions("initial_size is not representable"))?;
        let maximum_size = match self.maximum_size {
            Some(max) => {
                let max = max & !(ALIGNMENT - 1);
                if max == 0 {
                    return Err(Error::InvalidOptions("maximum_size is below the alignment"));
                }
                if initial_size > max {
                    return Err(Error::InvalidOptions("initial_size is larger than maximum_size"));
                }
                Some(max)
            }
            None => None,
        };
        Ok(Self {
            initial_size,
            maximum_size,
            event_policy: self.event_policy,
        })
    }
}

/// A coalescing good-fit suballocator over an upstream: RMM's `pool_memory_resource`, on addresses.
///
/// - Requests are rounded up to [`ALIGNMENT`]; 0 bytes returns address 0 without touching any
///   state, and freeing 0 bytes does nothing.
/// - Free blocks live in per-stream size indexes over one table of blocks linked in address order
///   (TLSF classes: a good fit in constant time, a fit whenever the list holds a large enough
///   block, and coalescing without search: one hash lookup per operation, for the live allocation);
///   a request its stream's list cannot serve steals from another stream's list, then merges the
///   other lists into its own, each time after an event wait (see the [module docs](super)), and
///   only then grows.
/// - Growth takes a new upstream chunk of `max(request, reserved)` bytes, so the pool doubles (the
///   first time at least [`PoolOptions::initial_size`]); past [`PoolOptions::maximum_size`] an
///   allocation fails with [`Error::OutOfMemory`] naming the size asked for. When the upstream is
///   full, the attempt is halved down to the request. A request larger than the pool becomes its
///   own chunk.
/// - Blocks never coalesce across chunks, so every chunk can go back to the upstream whole.
/// - [`release`](Engine::release), and dropping the engine, return every chunk to the upstream;
///   [`release_unused`](Engine::release_unused) and [`trim`](Self::trim) the chunks with no live
///   allocation.
///
/// ```
/// use mempool_suballoc::{Engine, PoolOptions, PoolEngine, SimStream, SimStreams, SimUpstream};
///
/// let options = PoolOptions { initial_size: 1 << 20, maximum_size: Some(1 << 22), ..Default::default() };
/// let mut pool = PoolEngine::new(SimUpstream::new(), SimStreams::new(), options)?;
/// let (a, b) = (SimStream::new(0), SimStream::new(1));
/// let p = pool.allocate(3000, a)?;
/// pool.deallocate(p, 3000, a)?;
/// // Stream `b` gets the same block, but only once ordered after `a`: this first hand-off from `a`'s
/// // list synchronizes (the default `EventPolicy::Adaptive`); later ones wait on an event recorded
/// // on `a` at each free.
/// assert_eq!(pool.allocate(3000, b)?, p);
/// assert_eq!(pool.stream_order().counts().synchronizes, 1);
/// assert_eq!(pool.stats().reserved_bytes, 1 << 20);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PoolEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    upstream: U,
    order: O,
    /// Normalized (aligned) options. Invariant: `chunks.reserved() <= maximum_size`.
    options: PoolOptions,
    /// Upstream chunks.
    chunks: Chunks<O::Stream>,
    /// Free blocks, one size index per stream, over `blocks`. Invariant: list `i`'s index holds
    /// exactly the blocks `blocks` marks free in list `i`.
    lists: StreamLists<O, SizeIndex>,
    /// Every block, free and live, linked in address order within its chunk. Invariant: the blocks
    /// are disjoint, aligned, each inside the chunk it names, and together cover every chunk
    /// exactly; the live ones add up to `used`.
    blocks: BlockTable,
    used: u64,
}

impl<U, O> PoolEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    /// Finds `size` bytes for `stream`: its own list, then another stream's list (one event wait),
    /// then the other lists merged into its own (one wait each), then the upstream.
    fn take(&mut self, size: u64, requested: u64, stream: O::Stream, tag: u32) -> Result<Block, Error> {
        let i = self.lists.find(stream);
        if let Some(slot) = self.blocks.find(self.lists.list(i), size) {
            return Ok(self.blocks.allocate_from(self.lists.list_mut(i), slot, size, tag));
        }
        self.take_slow(size, requested, stream, i, tag)
    }

    #[cold]
    fn take_slow(&mut self, size: u64, requested: u64, stream: O::Stream, i: usize, tag: u32) -> Result<Block, Error> {
        // Steal one block. Its remainder stays in the other stream's list: it was never ordered
        // after anything new, so it stays covered by that list's event.
        for j in 0..self.lists.len() {
            if j != i {
                if let Some(slot) = self.blocks.find(self.lists.list(j), size) {
                    self.lists.order_after(&self.order, stream, j)?;
                    return Ok(self.blocks.allocate_from(self.lists.list_mut(j), slot, size, tag));
                }
            }
        }
        // Merge the other lists into ours, where blocks freed on different streams can coalesce.
        for j in 0..self.lists.len() {
            if j != i && !self.lists.list(j).is_empty() {
                self.merge_list(i, j)?;
                if let Some(slot) = self.blocks.find(self.lists.list(i), size) {
                    return Ok(self.blocks.allocate_from(self.lists.list_mut(i), slot, size, tag));
                }
            }
        }
        let (addr, chunk_size) = self.grow(size, requested, stream)?;
        let slot = self
            .blocks
            .add_chunk(self.lists.list_mut(i), i as u32, addr, chunk_size);
        let block = self.blocks.allocate_from(self.lists.list_mut(i), slot, size, tag);
        if chunk_size > size {
            // The remainder was allocated on `stream`; others must wait for it like for a free.
            self.lists.entered(&self.order, i);
        }
        Ok(block)
    }

    /// Moves list `src` into list `dst` (where its blocks coalesce with `dst`'s) after ordering
    /// `dst`'s stream after it.
    fn merge_list(&mut self, dst: usize, src: usize) -> Result<(), Error> {
        debug_assert_ne!(dst, src);
        let waiter = self.lists.stream(dst);
        self.lists.order_after(&self.order, waiter, src)?;
        let mut from = std::mem::take(self.lists.list_mut(src));
        self.blocks.move_all(&mut from, self.lists.list_mut(dst), dst as u32);
        // Keep the emptied index's allocations for the stream's next frees.
        *self.lists.list_mut(src) = from;
        self.lists.entered(&self.order, dst);
        Ok(())
    }

    /// Obtains a new chunk of at least `size` bytes from the upstream: as much as is reserved
    /// already (so the pool doubles), at least `initial_size` the first time, capped by the maximum;
    /// when the upstream is full, halves the attempt down to `size`. Returns `(address, size)`.
    fn grow(&mut self, size: u64, requested: u64, stream: O::Stream) -> Result<(u64, u64), Error> {
        let reserved = self.chunks.reserved();
        let mut want = size.max(reserved);
        if reserved == 0 {
            want = want.max(self.options.initial_size);
        }
        if let Some(maximum) = self.options.maximum_size {
            let remaining = maximum - reserved;
            if size > remaining {
                return Err(Error::OutOfMemory {
                    requested,
                    cause: OutOfMemoryCause::MaximumSize { maximum },
                });
            }
            want = want.min(remaining);
        }
        loop {
            match self.chunks.allocate(&self.upstream, want, stream) {
                Ok(addr) => return Ok((addr, want)),
                Err(Error::OutOfMemory { .. }) if want > size => {
                    want = ((want / 2) & !(ALIGNMENT - 1)).max(size);
                }
                Err(e) => return Err(e.with_requested(requested)),
            }
        }
    }

    /// The free blocks of `stream`'s list that span a whole chunk, removed from the list and
    /// returned to the upstream.
    fn release_whole_chunks(&mut self, stream: O::Stream) -> Result<u64, Error> {
        let i = self.lists.find(stream);
        let whole = self.blocks.take_whole_chunks(self.lists.list_mut(i));
        // Every block in `stream`'s list is ordered before `stream`'s current work (freed on it, or
        // moved here after a wait, or grown on it), so the chunk can go back on `stream` itself.
        let mut released = 0;
        let mut result = Ok(());
        for b in whole {
            debug_assert!(self.chunks.get(b.chunk).is_some_and(|c| c.size == b.size));
            match self.chunks.release(&self.upstream, b.chunk, stream) {
                Ok(n) => released += n,
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| released)
    }

    /// Blocks the host until every stream seen has completed its work.
    pub(crate) fn synchronize(&self) -> Result<(), Error> {
        self.lists.synchronize_all(&self.order)
    }

    /// Returns every chunk to the upstream and forgets all blocks, once the caller has
    /// [synchronized](Self::synchronize); returns the first error of the upstream.
    pub(crate) fn release_synchronized(&mut self) -> Result<(), Error> {
        self.lists.clear();
        self.blocks.clear();
        self.used = 0;
        self.chunks.release_all(&self.upstream)
    }

    /// Returns to the upstream, on `stream`, every chunk that is entirely free in `stream`'s list
    /// (after [`merge_free_lists`](Engine::merge_free_lists) into `stream`, that is every chunk with
    /// no live allocation: what [`release_unused`](Engine::release_unused) does in one call).
    /// Returns the bytes released.
    pub fn trim(&mut self, stream: O::Stream) -> Result<u64, Error> {
        self.release_whole_chunks(stream)
    }

    /// Every free block with the stream whose list holds it.
    pub fn free_blocks(&self) -> impl Iterator<Item = (O::Stream, Block)> + '_ {
        self.lists
            .iter()
            .flat_map(|(s, list)| self.blocks.free_blocks(list).map(move |b| (s, b)))
    }

    /// The upstream chunks the pool holds, as `(address, size)` in address order.
    pub fn chunks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks.iter().map(|(a, c)| (a, c.size))
    }

    /// Live allocations as `(address, size, chunk)`.
    pub(crate) fn live(&self) -> impl Iterator<Item = Block> + '_ {
        self.blocks.live_blocks()
    }

    /// Live allocations with the tags they were made with.
    pub(crate) fn live_tagged(&self) -> impl Iterator<Item = (Block, u32)> + '_ {
        self.blocks.live_tagged()
    }

    /// [`Engine::allocate`], the allocation marked with `tag` (0 for the engine's own callers): the
    /// arena engine marks its superblocks, so that no free of a caller's can take one back.
    #[inline]
    pub(crate) fn allocate_tagged(&mut self, bytes: u64, stream: O::Stream, tag: u32) -> Result<u64, Error> {
        if bytes == 0 {
            return Ok(0);
        }
        let size = crate::engine::request_size(bytes)?;
        let block = self.take(size, bytes, stream, tag)?;
        self.used += block.size;
        Ok(block.addr)
    }

    /// [`Engine::deallocate`] of an allocation made with `tag`: [`Error::UnknownAllocation`]
    /// (changing nothing) for one made with another tag.
    #[inline]
    pub(crate) fn deallocate_tagged(
        &mut self,
        addr: u64,
        bytes: u64,
        stream: O::Stream,
        tag: u32,
    ) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        let unknown = || Error::UnknownAllocation { addr, bytes };
        let size = align_up(bytes).ok_or_else(unknown)?;
        let slot = self.blocks.take_live_tagged(addr, size, tag).ok_or_else(unknown)?;
        self.used -= size;
        let i = self.lists.find(stream);
        self.blocks.insert_free(self.lists.list_mut(i), i as u32, slot);
        self.lists.entered(&self.order, i);
        Ok(())
    }
}

impl<U, O> Engine for PoolEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    type Options = PoolOptions;
    type Stream = O::Stream;
    type Upstream = U;
    type Order = O;

    /// A pool over `upstream` that orders streams through `order`. Reserves nothing yet (see
    /// [`PoolOptions::initial_size`]). Fails with [`Error::InvalidOptions`] when the initial size
    /// exceeds the maximum or the maximum is below [`ALIGNMENT`].
    fn new(upstream: U, order: O, options: PoolOptions) -> Result<Self, Error> {
        let options = options.normalized()?;
        Ok(Self {
            upstream,
            order,
            options,
            chunks: Chunks::default(),
            lists: StreamLists::new(options.event_policy),
            blocks: BlockTable::default(),
            used: 0,
        })
    }

    fn options(&self) -> PoolOptions {
        self.options
    }

    #[inline]
    fn allocate(&mut self, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        self.allocate_tagged(bytes, stream, 0)
    }

    /// Frees an allocation into `stream`'s list, where it coalesces with its free neighbours.
    /// `bytes` is rounded up as `allocate` rounds, so any size that rounds alike names the same
    /// allocation.
    #[inline]
    fn deallocate(&mut self, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        self.deallocate_tagged(addr, bytes, stream, 0)
    }

    /// Moves every stream's free blocks into `into`'s list, after making `into` wait on each
    /// stream's event. There they coalesce: once everything is freed, this leaves exactly one free
    /// block per upstream chunk.
    fn merge_free_lists(&mut self, into: O::Stream) -> Result<(), Error> {
        let i = self.lists.find(into);
        for j in 0..self.lists.len() {
            if j != i && !self.lists.list(j).is_empty() {
                self.merge_list(i, j)?;
            }
        }
        Ok(())
    }

    /// Merges every stream's free blocks into `stream`'s list, then returns the chunks that are
    /// entirely free there: every chunk with no live block.
    fn release_unused(&mut self, stream: O::Stream) -> Result<u64, Error> {
        self.merge_free_lists(stream)?;
        self.release_whole_chunks(stream)
    }

    /// Returns every chunk to the upstream after synchronizing every stream seen, and forgets all
    /// blocks, live ones included. On a synchronize error, changes nothing; an upstream error is
    /// returned after everything was returned and forgotten.
    fn release(&mut self) -> Result<(), Error> {
        self.synchronize()?;
        self.release_synchronized()
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            reserved_bytes: self.chunks.reserved(),
            used_bytes: self.used,
            free_bytes: self.chunks.reserved() - self.used,
            free_blocks: self.lists.blocks(),
            live_allocations: self.blocks.live_len(),
            upstream_chunks: self.chunks.len(),
        }
    }

    /// Checks every invariant written next to the pool's fields, in O(n log n): free lists intact,
    /// no two blocks (free or live) overlap, every block aligned and inside its upstream chunk,
    /// free + used = reserved, reserved within the maximum.
    fn memory_map(&self) -> Vec<ChunkMap<O::Stream>> {
        let mut ranges = Vec::with_capacity(self.blocks.live_len() + self.lists.blocks());
        for (stream, list) in self.lists.iter() {
            ranges.extend(self.blocks.free_blocks(list).map(|b| (b, false, Some(stream))));
        }
        ranges.extend(self.live().map(|b| (b, true, None)));
        memory_map::build(self.chunks.iter().map(|(a, c)| (a, c.size)), ranges)
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.chunks.check("pool")?;
        self.blocks.check(
            self.lists.iter().enumerate().map(|(i, (_, list))| (i as u32, list)),
            |chunk| self.chunks.get(chunk).map(|c| c.size),
        )?;
        let mut blocks: Vec<(Block, &str)> = Vec::with_capacity(self.blocks.live_len());
        let mut free = 0u64;
        for (_, list) in self.lists.iter() {
            free += list.total_bytes();
            blocks.extend(self.blocks.free_blocks(list).map(|b| (b, "free")));
        }
        blocks.extend(self.live().map(|b| (b, "live")));
        let used: u64 = self.live().map(|b| b.size).sum();
        ensure!(
            used == self.used,
            "pool: live allocations add up to {used} bytes, `used` says {}",
            self.used
        );
        let reserved = self.chunks.reserved();
        ensure!(
            free + used == reserved,
            "pool: free {free} + used {used} != reserved {reserved}"
        );
        if let Some(max) = self.options.maximum_size {
            ensure!(reserved <= max, "pool: reserved {reserved} exceeds the maximum {max}");
        }
        check_disjoint("pool", &mut blocks, |b| {
            self.chunks
                .get(b.chunk)
                .is_some_and(|c| b.chunk <= b.addr && b.end() <= b.chunk + c.size)
        })
    }

    fn upstream(&self) -> &U {
        &self.upstream
    }

    fn stream_order(&self) -> &O {
        &self.order
    }
}

crate::engine::engine_common!(PoolOptions => PoolEngine);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimUpstream;
    use crate::sim::{SimStream, SimStreams};
    use crate::testing::{self, ops, world};
    use proptest::prelude::*;

    const A: SimStream = SimStream::new(0);
    const B: SimStream = SimStream::new(1);
    const C: SimStream = SimStream::new(2);
    const KIB: u64 = 1024;

    fn pool(options: PoolOptions) -> (PoolEngine<SimUpstream, SimStreams>, SimUpstream, SimStreams) {
        let up = SimUpstream::new();
        let sim = SimStreams::new();
        let p = PoolEngine::new(up.clone(), sim.clone(), options).unwrap();
        (p, up, sim)
    }

    fn with_initial(initial_size: u64) -> PoolOptions {
        PoolOptions {
            initial_size,
            ..Default::default()
        }
    }

    #[test]
    fn zero_bytes_is_null_and_touches_nothing() {
        let (mut p, up, sim) = pool(with_initial(4 * KIB));
        assert_eq!(p.allocate(0, A).unwrap(), 0);
        p.deallocate(0, 0, A).unwrap();
        let a = p.allocate(100, A).unwrap();
        let st = p.stats();
        let counts = sim.counts();
        assert_eq!(p.allocate(0, B).unwrap(), 0);
        // Freeing 0 bytes is a no-op whatever the address.
        p.deallocate(a, 0, B).unwrap();
        assert_eq!(p.stats(), st);
        assert_eq!(sim.counts(), counts);
        assert_eq!(up.stats().allocations, 1);
    }

    #[test]
    fn rounds_aligns_and_grows_by_doubling() {
        let (mut p, up, _) = pool(with_initial(4 * KIB));
        let a = p.allocate(1, A).unwrap();
        assert_eq!(a % ALIGNMENT, 0);
        assert_eq!(p.stats().used_bytes, 256);
        assert_eq!(p.stats().reserved_bytes, 4 * KIB);
        // 4 KiB free minus 256: a 4 KiB request needs a new chunk of max(4 KiB, reserved 4 KiB).
        p.allocate(4 * KIB, A).unwrap();
        assert_eq!(p.stats().reserved_bytes, 8 * KIB);
        // A request above the pool's size becomes its own chunk.
        p.allocate(100 * KIB, A).unwrap();
        assert_eq!(up.live_chunks().last().unwrap().1, 100 * KIB);
        assert_eq!(p.stats().upstream_chunks, 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn coalescing_restores_whole_chunks_on_one_stream() {
        let (mut p, _, _) = pool(with_initial(64 * KIB));
        let sizes = [1000, 3000, 256, 5000, 7, 12_000, 999, 4096];
        let addrs: Vec<u64> = sizes.iter().map(|&n| p.allocate(n, A).unwrap()).collect();
        assert_eq!(p.stats().upstream_chunks, 1);
        // Free in an order that exercises merging with the previous, the next and both.
        for &k in &[3, 0, 6, 1, 7, 2, 5, 4] {
            p.deallocate(addrs[k], sizes[k], A).unwrap();
            p.check_invariants().unwrap();
        }
        assert_eq!(p.stats().free_blocks, 1);
        assert_eq!(p.free_blocks().map(|(_, b)| b.size).collect::<Vec<_>>(), vec![64 * KIB]);
    }

    #[test]
    fn never_coalesces_across_upstream_chunks() {
        let (mut p, up, _) = pool(with_initial(4 * KIB));
        let a = p.allocate(4 * KIB, A).unwrap();
        let b = p.allocate(4 * KIB, A).unwrap();
        // SimUpstream hands out chunks back to back.
        let chunks = up.live_chunks();
        assert_eq!(chunks[0].0 + chunks[0].1, chunks[1].0);
        p.deallocate(a, 4 * KIB, A).unwrap();
        p.deallocate(b, 4 * KIB, A).unwrap();
        assert_eq!(p.stats().free_blocks, 2);
        // 8 KiB is free, but not as one range: the pool must grow.
        p.allocate(8 * KIB, A).unwrap();
        assert_eq!(p.stats().upstream_chunks, 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn maximum_size_fails_with_the_requested_size() {
        let options = PoolOptions {
            initial_size: 4 * KIB,
            maximum_size: Some(10 * KIB + 5),
            ..Default::default()
        };
        let (mut p, _, _) = pool(options);
        assert_eq!(p.options().maximum_size, Some(10 * KIB));
        p.allocate(4 * KIB, A).unwrap();
        p.allocate(5 * KIB, A).unwrap();
        assert_eq!(p.stats().reserved_bytes, 9 * KIB);
        // Doubling would want 9 KiB; growth is capped at the 1 KiB left, which still fits.
        p.allocate(1000, A).unwrap();
        assert_eq!(p.stats().reserved_bytes, 10 * KIB);
        let err = p.allocate(1000, A).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfMemory {
                    requested: 1000,
                    cause: OutOfMemoryCause::MaximumSize { maximum }
                } if maximum == 10 * KIB
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("1000 bytes requested"));
        p.check_invariants().unwrap();
    }

    #[test]
    fn upstream_exhaustion_backs_off_then_fails_with_the_requested_size() {
        let up = SimUpstream::with_capacity(7 * KIB);
        let mut p = PoolEngine::new(up.clone(), SimStreams::new(), with_initial(4 * KIB)).unwrap();
        p.allocate(4 * KIB, A).unwrap();
        // Wants max(1 KiB, 4 KiB reserved) = 4 KiB; only 3 KiB left: halves to 2 KiB.
        p.allocate(KIB, A).unwrap();
        assert_eq!(up.live_chunks()[1].1, 2 * KIB);
        assert_eq!(up.stats().failed_allocations, 1);
        let err = p.allocate(2 * KIB, A).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfMemory {
                    requested: 2048,
                    cause: OutOfMemoryCause::Upstream
                }
            ),
            "{err:?}"
        );
        let err = p.allocate(u64::MAX - 3, A).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfMemory {
                requested,
                cause: OutOfMemoryCause::AddressSpace
            } if requested == u64::MAX - 3
        ));
        p.check_invariants().unwrap();
    }

    #[test]
    fn invalid_configurations_are_rejected() {
        let bad = [
            PoolOptions {
                initial_size: 8 * KIB,
                maximum_size: Some(4 * KIB),
                ..Default::default()
            },
            PoolOptions {
                maximum_size: Some(100),
                ..Default::default()
            },
        ];
        for options in bad {
            assert!(matches!(
                PoolEngine::new(SimUpstream::new(), SimStreams::new(), options),
                Err(Error::InvalidOptions(_))
            ));
        }
    }

    #[test]
    fn a_block_freed_on_one_stream_reaches_another_only_after_a_wait() {
        for policy in [
            EventPolicy::RecordOnFree,
            EventPolicy::RecordOnDemand,
            EventPolicy::Adaptive,
        ] {
            let (mut p, _, sim) = pool(PoolOptions {
                initial_size: 64 * KIB,
                event_policy: policy,
                ..Default::default()
            });
            let x = p.allocate(64 * KIB, A).unwrap();
            let freed = sim.point(A);
            p.deallocate(x, 64 * KIB, A).unwrap();
            let records_after_free = sim.counts().records;
            match policy {
                EventPolicy::RecordOnFree => assert_eq!(records_after_free, 1),
                EventPolicy::RecordOnDemand | EventPolicy::Adaptive => assert_eq!(records_after_free, 0),
            }
            assert!(!sim.is_ordered_after(B, freed));
            // Stream A reuses its own block with no event at all.
            let y = p.allocate(KIB, A).unwrap();
            p.deallocate(y, KIB, A).unwrap();
            assert_eq!(sim.counts().waits, 0);
            // Stream B takes it (no upstream growth) after waiting on A's event; under Adaptive,
            // whose list has no event yet, after a synchronize.
            let z = p.allocate(64 * KIB, B).unwrap();
            assert_eq!(z, x);
            assert_eq!(p.stats().upstream_chunks, 1);
            match policy {
                EventPolicy::Adaptive => {
                    assert_eq!(sim.counts().waits, 0);
                    assert_eq!(sim.counts().synchronizes, 1);
                }
                _ => assert_eq!(sim.counts().waits, 1),
            }
            assert!(sim.is_ordered_after(B, freed), "{policy:?}");
            p.check_invariants().unwrap();
        }
    }

    #[test]
    fn adaptive_records_only_into_lists_other_streams_took_from() {
        let (mut p, _, sim) = pool(PoolOptions {
            initial_size: 64 * KIB,
            ..Default::default()
        });
        assert_eq!(p.options().event_policy, EventPolicy::Adaptive);
        // One stream on its own: no record, no wait, no synchronize, however many frees.
        for _ in 0..10 {
            let x = p.allocate(4 * KIB, A).unwrap();
            p.deallocate(x, 4 * KIB, A).unwrap();
        }
        assert_eq!(sim.counts().records + sim.counts().waits + sim.counts().synchronizes, 0);
        // B needs A's blocks: one synchronize, and A's list is shared from then on.
        let x = p.allocate(64 * KIB, B).unwrap();
        assert_eq!(sim.counts().synchronizes, 1);
        p.deallocate(x, 64 * KIB, B).unwrap();
        assert_eq!(sim.counts().records, 0, "B's own list was never taken from");
        let y = p.allocate(64 * KIB, A).unwrap();
        assert_eq!(sim.counts().synchronizes, 2, "A takes B's block: B's first hand-off");
        let freed = sim.point(A);
        p.deallocate(y, 64 * KIB, A).unwrap();
        assert_eq!(sim.counts().records, 1, "A's list is shared: its frees record");
        let z = p.allocate(64 * KIB, B).unwrap();
        assert_eq!(
            (sim.counts().waits, sim.counts().synchronizes),
            (1, 2),
            "an event wait this time"
        );
        assert!(sim.is_ordered_after(B, freed));
        p.deallocate(z, 64 * KIB, B).unwrap();
        p.check_invariants().unwrap();
    }

    #[test]
    fn blocks_merged_from_a_third_stream_carry_their_ordering() {
        for policy in [
            EventPolicy::RecordOnFree,
            EventPolicy::RecordOnDemand,
            EventPolicy::Adaptive,
        ] {
            let (mut p, _, sim) = pool(PoolOptions {
                initial_size: 4 * KIB,
                event_policy: policy,
                ..Default::default()
            });
            // B frees something first, so its event (under RecordOnFree) predates the merge below.
            let early = p.allocate(4 * KIB, B).unwrap();
            p.deallocate(early, 4 * KIB, B).unwrap();
            let early_chunk = p.allocate(4 * KIB, B).unwrap();
            assert_eq!(early_chunk, early);

            let x = p.allocate(4 * KIB, A).unwrap();
            let freed_on_a = sim.point(A);
            p.deallocate(x, 4 * KIB, A).unwrap();
            // B needs more than any single free block: it merges A's list into its own (waiting on
            // A), then grows. A's block now sits in B's list.
            p.allocate(16 * KIB, B).unwrap();
            assert!(p.free_blocks().any(|(s, b)| s == B && b.addr == x));
            // C steals A's block from B's list: it must end up ordered after the free on A, which
            // only holds if B's event was recorded after B waited on A.
            let y = p.allocate(4 * KIB, C).unwrap();
            assert_eq!(y, x);
            assert!(sim.is_ordered_after(C, freed_on_a), "{policy:?}");
            p.check_invariants().unwrap();
        }
    }

    #[test]
    fn a_failed_wait_hands_nothing_over() {
        let (mut p, _, sim) = pool(PoolOptions {
            event_policy: EventPolicy::RecordOnFree,
            ..with_initial(4 * KIB)
        });
        let x = p.allocate(4 * KIB, A).unwrap();
        p.deallocate(x, 4 * KIB, A).unwrap();
        sim.set_fail_waits(true);
        assert!(matches!(p.allocate(4 * KIB, B), Err(Error::Stream { op: "wait", .. })));
        assert_eq!(p.free_blocks().collect::<Vec<_>>().len(), 1);
        assert_eq!(p.stats().live_allocations, 0);
        p.check_invariants().unwrap();
        sim.set_fail_waits(false);
        assert_eq!(p.allocate(4 * KIB, B).unwrap(), x);
    }

    #[test]
    fn unknown_double_and_wrong_size_frees_are_rejected() {
        let (mut p, _, _) = pool(with_initial(4 * KIB));
        let x = p.allocate(1000, A).unwrap();
        let st = p.stats();
        for (addr, bytes) in [(x + 256, 1000), (x, 2000), (12345, 1), (x, u64::MAX)] {
            assert!(matches!(
                p.deallocate(addr, bytes, A),
                Err(Error::UnknownAllocation { .. })
            ));
        }
        assert_eq!(p.stats(), st);
        // 1000 and 1024 round alike, so the latter names the same allocation.
        p.deallocate(x, 1024, A).unwrap();
        assert!(matches!(
            p.deallocate(x, 1000, A),
            Err(Error::UnknownAllocation { addr, bytes: 1000 }) if addr == x
        ));
        p.check_invariants().unwrap();
    }

    #[test]
    fn release_trim_and_drop_return_chunks_upstream() {
        let (mut p, up, sim) = pool(with_initial(4 * KIB));
        let a = p.allocate(4 * KIB, A).unwrap();
        let b = p.allocate(4 * KIB, B).unwrap();
        let _live = p.allocate(4 * KIB, B).unwrap();
        p.deallocate(a, 4 * KIB, A).unwrap();
        p.deallocate(b, 4 * KIB, B).unwrap();
        // A's chunk is free in A's list; B's first chunk is free in B's list.
        assert_eq!(p.trim(A).unwrap(), 4 * KIB);
        p.merge_free_lists(C).unwrap();
        assert_eq!(p.trim(C).unwrap(), 4 * KIB);
        assert_eq!(up.stats().live_chunks, 1);
        p.check_invariants().unwrap();
        p.release().unwrap();
        assert_eq!(up.stats().live_chunks, 0);
        assert!(sim.counts().synchronizes >= 2);
        assert_eq!(p.stats(), EngineStats::default());

        let (mut p, up, _) = pool(with_initial(4 * KIB));
        p.allocate(100, A).unwrap();
        drop(p);
        assert_eq!(up.stats().live_chunks, 0);
    }

    #[test]
    fn release_unused_merges_then_returns_the_chunks_without_live_blocks() {
        let (mut p, up, _) = pool(with_initial(4 * KIB));
        let a = p.allocate(2 * KIB, A).unwrap();
        let b = p.allocate(2 * KIB, A).unwrap();
        let live = p.allocate(4 * KIB, A).unwrap();
        // The first chunk's halves are free in two streams' lists: only merged do they make it whole.
        p.deallocate(a, 2 * KIB, A).unwrap();
        p.deallocate(b, 2 * KIB, B).unwrap();
        assert_eq!(p.trim(C).unwrap(), 0);
        assert_eq!(p.release_unused(C).unwrap(), 4 * KIB);
        assert_eq!(up.stats().live_chunks, 1);
        assert!(up.contains(live, 4 * KIB));
        p.check_invariants().unwrap();
        p.deallocate(live, 4 * KIB, B).unwrap();
        assert_eq!(p.release_unused(A).unwrap(), 4 * KIB);
        assert_eq!(p.stats(), EngineStats::default());
    }

    #[test]
    fn tens_of_thousands_of_live_blocks() {
        // Quadratic free-list work would make this test take minutes.
        let (mut p, _, _) = pool(with_initial(1 << 20));
        let mut live = Vec::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..60_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + x % 8192;
            live.push((p.allocate(n, A).unwrap(), n));
            if x.is_multiple_of(4) {
                let (a, n) = live.swap_remove((x >> 8) as usize % live.len());
                p.deallocate(a, n, A).unwrap();
            }
        }
        assert!(p.stats().free_blocks > 1000);
        p.check_invariants().unwrap();
        for (a, n) in live {
            p.deallocate(a, n, A).unwrap();
        }
        let st = p.stats();
        assert_eq!(st.free_blocks, st.upstream_chunks);
    }

    #[test]
    fn engine_is_send() {
        fn send<T: Send>() {}
        send::<PoolEngine<SimUpstream, SimStreams>>();
    }

    fn policy() -> impl Strategy<Value = EventPolicy> {
        prop_oneof![
            Just(EventPolicy::RecordOnFree),
            Just(EventPolicy::RecordOnDemand),
            Just(EventPolicy::Adaptive)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn random_sequences(ops in ops(6000, 3, 150), policy in policy(), initial in 0u64..16_384) {
            let w = world(None, policy);
            let options = PoolOptions { initial_size: initial, event_policy: policy, ..Default::default() };
            let p = PoolEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(p, &w, &ops, false)?;
        }

        #[test]
        fn random_sequences_with_a_maximum(ops in ops(6000, 3, 150), policy in policy()) {
            let w = world(None, policy);
            let options = PoolOptions { initial_size: 4096, maximum_size: Some(40_000), event_policy: policy };
            let p = PoolEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(p, &w, &ops, true)?;
        }

        #[test]
        fn random_sequences_with_a_small_upstream(ops in ops(6000, 3, 150)) {
            let w = world(Some(48 * 1024), EventPolicy::RecordOnFree);
            let p = PoolEngine::new(w.up.clone(), w.order.clone(), PoolOptions::default()).unwrap();
            testing::run(p, &w, &ops, true)?;
        }
    }
}
