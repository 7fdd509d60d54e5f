//! Per-stream arenas over a global arena of superblocks: RMM's `arena_memory_resource` on
//! addresses.

use std::collections::HashMap;

use super::block_table::{BlockTable, SizeIndex};
use super::chunks::check_balance;
use crate::block::Block;
use crate::engine::Engine;
use crate::error::{ensure, Error, InvariantViolation};
use crate::memory_map::{ChunkMap, MapRange};
use crate::pool::{PoolEngine, PoolOptions};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
use crate::upstream::Upstream;

/// The tag of the global arena's allocations that are superblocks (its callers' large allocations
/// carry 0), so that a caller's free can never return a superblock to the global arena.
const SUPERBLOCK: u32 = 1;

/// The shape of an [`ArenaEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Size of the superblocks that per-stream arenas take from the global arena, rounded up to
    /// [`ALIGNMENT`]. Requests above half of it go straight to the global arena.
    pub superblock_size: u64,
    /// Bytes the global arena reserves with its first growth (see [`PoolOptions::initial_size`]).
    pub initial_size: u64,
    /// The global arena never reserves more than this (see [`PoolOptions::maximum_size`]).
    pub maximum_size: Option<u64>,
    /// When to record the events that hand free superblocks and large blocks to other streams.
    pub event_policy: EventPolicy,
}

impl Default for ArenaOptions {
    /// 1 MiB superblocks (RMM's minimum superblock size), no initial reservation, no maximum,
    /// [`EventPolicy::Adaptive`].
    fn default() -> Self {
        Self {
            superblock_size: 1 << 20,
            initial_size: 0,
            maximum_size: None,
            event_policy: EventPolicy::Adaptive,
        }
    }
}

/// One stream's arena.
#[derive(Debug)]
struct StreamArena<S> {
    stream: S,
    /// Free blocks inside this arena's superblocks, indexed by size over the engine's block table
    /// (owner: the arena's number), coalescing only within one superblock (the table never links
    /// blocks of two superblocks). Invariant: with the live blocks tagged with this arena, exactly
    /// covers the arena's superblocks.
    free: SizeIndex,
    /// Slots of the free blocks that span a whole superblock: the arena's superblocks with no live
    /// block. The arena keeps one (so that a stream hovering around a superblock boundary does not
    /// bounce superblocks through the global arena) and returns the others when it next frees on
    /// its own stream. Invariant: exactly the whole-superblock blocks of `free`.
    empty: Vec<u32>,
}

/// Per-stream arenas over a global arena of superblocks: RMM's `arena_memory_resource`, on
/// addresses.
///
/// - The global arena is a [`PoolEngine`] (coalescing good fit) over the upstream; its
///   allocations are superblocks and large blocks.
/// - Each stream has an arena of superblocks taken from the global arena. Small requests (at most
///   half a superblock) are good fits (the pool's TLSF classes) within the stream's arena,
///   coalescing within a superblock;
///   no other stream touches them, so no event is needed to reuse them. The blocks of every arena
///   sit in one table linked in address order within their superblock (as the pool's do), so a
///   free finds its neighbours, its arena and whether its superblock became empty without a hash
///   lookup beyond the one for the live allocation (which also takes it out of the live map). No
///   map of superblocks is kept: a block's arena is its free list's number or, live, its tag, and
///   the superblocks are the table's chunks, so moving a superblock between an arena and the
///   global arena touches no hash map beyond the global arena's own live map.
/// - A superblock whose last block is freed goes back to the global arena (one empty superblock per
///   arena is kept), where the pool's event rule hands it to other streams; large requests go
///   straight to the global arena under the same rule.
/// - A block freed on a stream other than its arena's goes back to its arena after the freeing
///   stream is synchronized (as RMM does), so the arena's stream needs no event to reuse it.
///
/// Per-thread arenas, RMM's other mode, are what a shared resource adds on top: a
/// [`SuballocatingResource`](../../mempool_rmm/struct.SuballocatingResource.html) keeps several
/// engines and gives each thread its own (see [`crate::Sharded`]).
///
/// ```
/// use mempool_suballoc::{ArenaOptions, ArenaEngine, Engine, SimStream, SimStreams, SimUpstream};
///
/// let options = ArenaOptions { superblock_size: 1 << 16, ..Default::default() };
/// let mut arena = ArenaEngine::new(SimUpstream::new(), SimStreams::new(), options)?;
/// let s = SimStream::new(0);
/// let small = arena.allocate(1000, s)?; // in a 64 KiB superblock of stream 0's arena
/// let large = arena.allocate(1 << 17, s)?; // straight from the global arena
/// arena.deallocate(small, 1000, s)?;
/// arena.deallocate(large, 1 << 17, s)?;
/// arena.check_invariants()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ArenaEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    /// Normalized: `superblock_size` rounded up to [`ALIGNMENT`], the global arena's sizes as its
    /// [`PoolOptions`] normalizes them.
    options: ArenaOptions,
    /// `options.superblock_size`.
    superblock_size: u64,
    /// Largest request served by a per-stream arena: `superblock_size / 2`, aligned.
    small_max: u64,
    /// The global arena, which owns the upstream and the stream order. Its live allocations are the
    /// superblocks (the chunks of `blocks`) plus the large allocations.
    global: PoolEngine<U, O>,
    /// Per-stream arenas. Invariant: `arena_index[&arenas[i].stream] == i`.
    arenas: Vec<StreamArena<O::Stream>>,
    arena_index: HashMap<O::Stream, usize>,
    /// The arena found by the last lookup.
    last: usize,
    /// Superblocks held by arenas. Invariant: the number of distinct chunks of `blocks`; each is a
    /// live `superblock_size`-byte allocation of the global arena, and all its blocks belong to
    /// one arena. No map from superblock to arena is needed: a block's arena is its free list's
    /// owner number or, live, its tag.
    superblock_count: usize,
    /// Every block of every superblock, free (in its arena's `free`) or live (tagged with its
    /// arena's number), with the live map of small allocations; the superblocks are its chunks.
    /// Invariant: the live blocks add up to `small_used`.
    blocks: BlockTable,
    small_used: u64,
}

impl<U, O> ArenaEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    /// The superblock size (rounded up to [`ALIGNMENT`]).
    pub fn superblock_size(&self) -> u64 {
        self.superblock_size
    }

    #[inline]
    fn arena(&mut self, stream: O::Stream) -> usize {
        if let Some(a) = self.arenas.get(self.last) {
            if a.stream == stream {
                return self.last;
            }
        }
        self.arena_slow(stream)
    }

    #[cold]
    fn arena_slow(&mut self, stream: O::Stream) -> usize {
        let arenas = &mut self.arenas;
        let i = *self.arena_index.entry(stream).or_insert_with(|| {
            arenas.push(StreamArena {
                stream,
                free: SizeIndex::default(),
                empty: Vec::new(),
            });
            arenas.len() - 1
        });
        self.last = i;
        i
    }

    /// Takes a superblock from the global arena into arena `i` and carves `size` bytes from it.
    /// When the global arena is full, first returns every arena's empty superblocks to it.
    #[cold]
    fn new_superblock(&mut self, bytes: u64, size: u64, stream: O::Stream, i: usize) -> Result<Block, Error> {
        let sb_size = self.superblock_size;
        let addr = match self.global.allocate_tagged(sb_size, stream, SUPERBLOCK) {
            Ok(a) => a,
            Err(Error::OutOfMemory { .. }) if self.return_empty_superblocks(stream)? > 0 => self
                .global
                .allocate_tagged(sb_size, stream, SUPERBLOCK)
                .map_err(|e| e.with_requested(bytes))?,
            Err(e) => return Err(e.with_requested(bytes)),
        };
        self.superblock_count += 1;
        let free = &mut self.arenas[i].free;
        let slot = self.blocks.add_chunk(free, i as u32, addr, sb_size);
        Ok(self.blocks.allocate_from(free, slot, size, i as u32))
    }

    /// Returns every arena's empty superblocks to the global arena, into `stream`'s list (the
    /// stream of the call in progress); returns how many. Another arena's stream is synchronized
    /// first, since `stream` is not ordered after the frees made on it.
    fn return_empty_superblocks(&mut self, stream: O::Stream) -> Result<usize, Error> {
        let mut n = 0;
        for i in 0..self.arenas.len() {
            if self.arenas[i].empty.is_empty() {
                continue;
            }
            if self.arenas[i].stream != stream {
                self.global.stream_order().synchronize(self.arenas[i].stream)?;
            }
            while let Some(slot) = self.arenas[i].empty.pop() {
                self.return_superblock(i, slot, stream)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Moves the empty superblock whose free block is in `slot` from arena `i` to the global arena,
    /// freed on `stream`, which must be ordered after every free into it. The caller has taken
    /// `slot` off the arena's `empty` list.
    fn return_superblock(&mut self, i: usize, slot: u32, stream: O::Stream) -> Result<(), Error> {
        let sb = self.blocks.remove_whole(&mut self.arenas[i].free, slot);
        self.superblock_count -= 1;
        self.global
            .deallocate_tagged(sb.addr, self.superblock_size, stream, SUPERBLOCK)
    }

    /// Superblocks currently held by per-stream arenas.
    pub fn superblocks_in_arenas(&self) -> usize {
        self.superblock_count
    }

    /// [`allocate`](Engine::allocate) of `size` bytes (`bytes` rounded, at most `small_max`) from
    /// `stream`'s arena. Kept out of line so that `allocate`, with its large-request branch to the
    /// global arena, stays small enough to inline into its caller.
    #[inline(never)]
    fn allocate_small(&mut self, size: u64, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        let i = self.arena(stream);
        let arena = &mut self.arenas[i];
        let Some(slot) = self.blocks.find(&arena.free, size) else {
            let block = self.new_superblock(bytes, size, stream, i)?;
            self.small_used += size;
            return Ok(block.addr);
        };
        // Only a whole superblock can be on `empty`, and only when the list is not empty.
        if !arena.empty.is_empty() && self.blocks.is_whole(slot) {
            // An empty superblock comes back into use.
            if let Some(k) = arena.empty.iter().position(|&e| e == slot) {
                arena.empty.swap_remove(k);
            }
        }
        let block = self.blocks.allocate_from(&mut arena.free, slot, size, i as u32);
        self.small_used += size;
        Ok(block.addr)
    }

    /// [`deallocate`](Engine::deallocate) of a small allocation of `size` bytes (`bytes` rounded):
    /// one live-map lookup, which takes the block out of the map. A free on a stream other than
    /// the block's arena's first synchronizes `stream`; when that fails, the block goes back into
    /// the live map and the free changes nothing.
    #[inline(never)]
    fn deallocate_small(&mut self, addr: u64, size: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        let Some(slot) = self.blocks.take_live(addr, size) else {
            return Err(Error::UnknownAllocation { addr, bytes });
        };
        let i = self.blocks.tag(slot) as usize;
        let own = self.arenas[i].stream == stream;
        if !own {
            self.synchronize_foreign_free(slot, stream)?;
        }
        self.small_used -= size;
        let merged = self.blocks.insert_free(&mut self.arenas[i].free, i as u32, slot);
        if self.blocks.is_whole(merged) {
            self.superblock_emptied(i, merged, own, stream)?;
        }
        Ok(())
    }

    /// Synchronizes `stream`, on which a block of another stream's arena is being freed (the block
    /// in `slot`, already out of the live map), so that the arena's stream may reuse it without an
    /// event. On failure puts the block back into the live map.
    #[cold]
    fn synchronize_foreign_free(&mut self, slot: u32, stream: O::Stream) -> Result<(), Error> {
        let synced = self.global.stream_order().synchronize(stream);
        if synced.is_err() {
            self.blocks.restore_live(slot);
        }
        synced
    }

    /// Arena `i`'s superblock whose free block is in `slot` just became empty, by a free on
    /// `stream` (`own`: the arena's stream): lists it on `empty`, and on the arena's own stream
    /// returns the arena's other empty superblocks to the global arena (into that stream's list).
    #[cold]
    fn superblock_emptied(&mut self, i: usize, slot: u32, own: bool, stream: O::Stream) -> Result<(), Error> {
        self.arenas[i].empty.push(slot);
        if own {
            while self.arenas[i].empty.len() > 1 {
                let sb = self.arenas[i].empty.swap_remove(0);
                self.return_superblock(i, sb, stream)?;
            }
        }
        Ok(())
    }
}

impl<U, O> Engine for ArenaEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    type Options = ArenaOptions;
    type Stream = O::Stream;
    type Upstream = U;
    type Order = O;

    /// An arena engine over `upstream` that orders streams through `order`. Reserves nothing yet.
    /// Fails with [`Error::InvalidOptions`] for a superblock below 512 bytes (it must hold two
    /// aligned blocks) or global options [`PoolEngine`]'s `new` would reject.
    fn new(upstream: U, order: O, options: ArenaOptions) -> Result<Self, Error> {
        let superblock_size =
            align_up(options.superblock_size).ok_or(Error::InvalidOptions("superblock_size is not representable"))?;
        if superblock_size < 2 * ALIGNMENT {
            return Err(Error::InvalidOptions("superblock_size must be at least 512 bytes"));
        }
        let global_options = PoolOptions {
            initial_size: options.initial_size,
            maximum_size: options.maximum_size,
            event_policy: options.event_policy,
        };
        let global = PoolEngine::new(upstream, order, global_options)?;
        let global_options = global.options();
        Ok(Self {
            options: ArenaOptions {
                superblock_size,
                initial_size: global_options.initial_size,
                maximum_size: global_options.maximum_size,
                event_policy: options.event_policy,
            },
            superblock_size,
            small_max: (superblock_size / 2) & !(ALIGNMENT - 1),
            global,
            arenas: Vec::new(),
            arena_index: HashMap::new(),
            last: 0,
            superblock_count: 0,
            blocks: BlockTable::default(),
            small_used: 0,
        })
    }

    fn options(&self) -> ArenaOptions {
        self.options
    }

    /// Allocates `bytes` for use on `stream`: from the stream's arena up to half a superblock,
    /// from the global arena above; 0 for 0 bytes.
    ///
    /// Fails with [`Error::OutOfMemory`] (with `requested == bytes`) when the global arena cannot
    /// grow, [`Error::Stream`] when an event wait needed to take another stream's memory fails.
    #[inline]
    fn allocate(&mut self, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        if bytes == 0 {
            return Ok(0);
        }
        let size = crate::engine::request_size(bytes)?;
        if size > self.small_max {
            return self.global.allocate(bytes, stream);
        }
        self.allocate_small(size, bytes, stream)
    }

    /// Frees an allocation of `bytes` made by [`allocate`](Engine::allocate). Freeing 0 bytes does
    /// nothing. A small block freed on a stream other than its arena's first synchronizes `stream`
    /// (as RMM's arena does), so that the arena's stream may reuse it without an event.
    ///
    /// Fails with [`Error::UnknownAllocation`] when `addr` is not a live allocation of that size,
    /// or with [`Error::Stream`] when that synchronize fails; either way changing nothing.
    #[inline]
    fn deallocate(&mut self, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        let Some(size) = align_up(bytes) else {
            return Err(Error::UnknownAllocation { addr, bytes });
        };
        if size > self.small_max {
            return self.global.deallocate(addr, bytes, stream);
        }
        self.deallocate_small(addr, size, bytes, stream)
    }

    /// Returns every arena's empty superblocks to the global arena (synchronizing the arenas'
    /// streams other than `into`), then merges the global arena's free lists into `into`'s (after
    /// waits), where they coalesce: once everything is freed, this leaves one free block per
    /// upstream chunk.
    fn merge_free_lists(&mut self, into: O::Stream) -> Result<(), Error> {
        self.return_empty_superblocks(into)?;
        self.global.merge_free_lists(into)
    }

    /// Returns every arena's empty superblocks to the global arena, merges the global arena's free
    /// lists into `stream`'s, and returns the global arena's chunks that are then entirely free.
    fn release_unused(&mut self, stream: O::Stream) -> Result<u64, Error> {
        self.return_empty_superblocks(stream)?;
        self.global.release_unused(stream)
    }

    /// Synchronizes every stream seen, then returns every upstream chunk, live allocations
    /// included, to the upstream. On a synchronize error nothing is released; an upstream error is
    /// returned after everything was returned and forgotten.
    fn release(&mut self) -> Result<(), Error> {
        for a in &self.arenas {
            self.global.stream_order().synchronize(a.stream)?;
        }
        self.global.synchronize()?;
        self.arenas.clear();
        self.arena_index.clear();
        self.last = 0;
        self.superblock_count = 0;
        self.blocks.clear();
        self.small_used = 0;
        self.global.release_synchronized()
    }

    /// Bytes reserved, used (by live allocations, small and large) and free (in arenas and in the
    /// global arena), and block counts.
    fn stats(&self) -> EngineStats {
        let g = self.global.stats();
        let sb_bytes = self.superblock_count as u64 * self.superblock_size;
        let large_used = g.used_bytes - sb_bytes;
        let used = self.small_used + large_used;
        EngineStats {
            reserved_bytes: g.reserved_bytes,
            used_bytes: used,
            free_bytes: g.reserved_bytes - used,
            free_blocks: g.free_blocks + self.arenas.iter().map(|a| a.free.len()).sum::<usize>(),
            live_allocations: self.blocks.live_len() + g.live_allocations - self.superblock_count,
            upstream_chunks: g.upstream_chunks,
        }
    }

    /// Checks the global arena's invariants (as a pool's), that every chunk of the block table (a
    /// superblock) is a live `superblock_size`-byte global allocation whose blocks all belong to one
    /// existing arena (free ones in that arena's index, live ones tagged with it) and which they
    /// tile, that there are `superblocks_in_arenas()` of them, that the arenas' `empty` lists hold
    /// exactly their whole-superblock free blocks, and that free + used = reserved.
    /// The global arena's chunks, each superblock an arena holds shown as its blocks (free ones with
    /// the arena's stream).
    fn memory_map(&self) -> Vec<ChunkMap<O::Stream>> {
        let mut inner: HashMap<u64, Vec<MapRange<O::Stream>>> = HashMap::new();
        let range = |b: Block, used, stream| MapRange {
            addr: b.addr,
            size: b.size,
            used,
            stream,
        };
        for arena in &self.arenas {
            for b in self.blocks.free_blocks(&arena.free) {
                inner
                    .entry(b.chunk)
                    .or_default()
                    .push(range(b, false, Some(arena.stream)));
            }
        }
        for b in self.blocks.live_blocks() {
            inner.entry(b.chunk).or_default().push(range(b, true, None));
        }
        let mut maps = self.global.memory_map();
        for m in &mut maps {
            let mut ranges = Vec::with_capacity(m.ranges.len());
            for r in m.ranges.drain(..) {
                match inner.remove(&r.addr) {
                    Some(mut blocks) if r.used => {
                        blocks.sort_unstable_by_key(|b| b.addr);
                        ranges.extend(blocks);
                    }
                    _ => ranges.push(r),
                }
            }
            m.ranges = ranges;
        }
        maps
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.global.check_invariants()?;
        let sb_size = self.superblock_size;
        let global_live: HashMap<u64, (u64, u32)> = self
            .global
            .live_tagged()
            .map(|(b, tag)| (b.addr, (b.size, tag)))
            .collect();
        let is_superblock = |chunk: u64| global_live.get(&chunk) == Some(&(sb_size, SUPERBLOCK));
        self.blocks.check(
            self.arenas.iter().enumerate().map(|(i, a)| (i as u32, &a.free)),
            |chunk| is_superblock(chunk).then_some(sb_size),
        )?;
        // Superblock -> the arena of the first of its blocks seen; every other block must agree.
        let mut arena_of: HashMap<u64, u32> = HashMap::new();
        let mut claim = |b: &Block, arena: u32, what: &str| -> Result<(), InvariantViolation> {
            ensure!(
                (arena as usize) < self.arenas.len(),
                "arena: {what} block {b:?} belongs to arena {arena}, which does not exist"
            );
            ensure!(
                is_superblock(b.chunk),
                "arena: {what} block {b:?} is in {:#x}, not a live {sb_size}-byte global allocation",
                b.chunk
            );
            let first = *arena_of.entry(b.chunk).or_insert(arena);
            ensure!(
                first == arena,
                "arena: {what} block {b:?} belongs to arena {arena}, other blocks of its superblock to {first}"
            );
            Ok(())
        };
        for (i, arena) in self.arenas.iter().enumerate() {
            ensure!(
                self.arena_index.get(&arena.stream) == Some(&i),
                "arena: index of stream {:?} is wrong",
                arena.stream
            );
            let mut whole = 0;
            for b in self.blocks.free_blocks(&arena.free) {
                claim(&b, i as u32, "free")?;
                if b.size == sb_size {
                    whole += 1;
                }
            }
            let mut sorted = arena.empty.clone();
            sorted.sort_unstable();
            sorted.dedup();
            ensure!(
                sorted.len() == arena.empty.len()
                    && whole == arena.empty.len()
                    && arena.empty.iter().all(|&s| self.blocks.is_whole(s)),
                "arena: {:?} lists {} empty superblocks, {whole} are",
                arena.stream,
                arena.empty.len()
            );
        }
        let mut small_used = 0;
        for b in self.blocks.live_blocks() {
            let slot = self.blocks.live_slot(b.addr, b.size);
            ensure!(
                slot.is_some(),
                "arena: live block {b:?} is not found by its address and size"
            );
            claim(&b, slot.map_or(u32::MAX, |s| self.blocks.tag(s)), "live")?;
            small_used += b.size;
        }
        ensure!(
            small_used == self.small_used,
            "arena: live small blocks add up to {small_used}, `small_used` says {}",
            self.small_used
        );
        ensure!(
            arena_of.len() == self.superblock_count,
            "arena: {} superblocks counted, {} hold blocks",
            self.superblock_count,
            arena_of.len()
        );
        let tagged = global_live.values().filter(|&&(_, tag)| tag == SUPERBLOCK).count();
        ensure!(
            tagged == self.superblock_count,
            "arena: the global arena holds {tagged} superblocks, the arenas {}",
            self.superblock_count
        );
        check_balance("arena", &self.stats())
    }

    fn upstream(&self) -> &U {
        self.global.upstream()
    }

    fn stream_order(&self) -> &O {
        self.global.stream_order()
    }
}

crate::engine::engine_common!(ArenaOptions => ArenaEngine);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_superblock_cannot_be_freed_as_a_large_allocation() {
        // 8 KiB superblocks: a 1 KiB block is carved from the high end of one; the superblock is a
        // live 8 KiB allocation of the global arena, but none of the caller's.
        let options = ArenaOptions {
            superblock_size: 8 * 1024,
            ..Default::default()
        };
        let mut a = ArenaEngine::new(SimUpstream::new(), SimStreams::new(), options).unwrap();
        let s = SimStream::new(0);
        let small = a.allocate(1024, s).unwrap();
        let superblock = small + 1024 - 8 * 1024;
        assert!(matches!(
            a.deallocate(superblock, 8 * 1024, s),
            Err(Error::UnknownAllocation { .. })
        ));
        a.check_invariants().unwrap();
        // So a large allocation of that size cannot land on the live small block.
        let big = a.allocate(8 * 1024, s).unwrap();
        assert!(
            big + 8 * 1024 <= small || small + 1024 <= big,
            "{big:#x} overlaps {small:#x}"
        );
        // A caller's own large allocation of a superblock's size is freed as usual.
        a.deallocate(big, 8 * 1024, s).unwrap();
        a.deallocate(small, 1024, s).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().used_bytes, 0);
    }
    use crate::error::OutOfMemoryCause;
    use crate::sim::SimUpstream;
    use crate::sim::{SimStream, SimStreams};
    use crate::testing::{self, ops, world};
    use proptest::prelude::*;

    const A: SimStream = SimStream::new(0);
    const B: SimStream = SimStream::new(1);
    const KIB: u64 = 1024;

    fn arena(superblock_size: u64, up: SimUpstream, sim: SimStreams) -> ArenaEngine<SimUpstream, SimStreams> {
        let options = ArenaOptions {
            superblock_size,
            ..Default::default()
        };
        ArenaEngine::new(up, sim, options).unwrap()
    }

    #[test]
    fn small_blocks_in_superblocks_large_from_global() {
        let up = SimUpstream::new();
        let mut a = arena(8 * KIB, up.clone(), SimStreams::new());
        let x = a.allocate(1000, A).unwrap();
        let y = a.allocate(4 * KIB, A).unwrap();
        assert_eq!(a.superblocks_in_arenas(), 1);
        let big = a.allocate(4 * KIB + 1, A).unwrap();
        assert_eq!(a.superblocks_in_arenas(), 1);
        let st = a.stats();
        assert_eq!(st.used_bytes, 1024 + 4096 + 4352);
        assert_eq!(st.live_allocations, 3);
        a.check_invariants().unwrap();
        a.deallocate(big, 4 * KIB + 1, A).unwrap();
        a.deallocate(x, 1000, A).unwrap();
        a.deallocate(y, 4 * KIB, A).unwrap();
        // The one empty superblock stays in the arena.
        assert_eq!(a.superblocks_in_arenas(), 1);
        a.check_invariants().unwrap();
        a.merge_free_lists(A).unwrap();
        assert_eq!(a.superblocks_in_arenas(), 0);
        let st = a.stats();
        assert_eq!(st.free_blocks, st.upstream_chunks);
        drop(a);
        assert_eq!(up.stats().live_chunks, 0);
    }

    #[test]
    fn empty_superblocks_beyond_one_go_back_to_global() {
        let mut a = arena(4 * KIB, SimUpstream::new(), SimStreams::new());
        let blocks: Vec<u64> = (0..6).map(|_| a.allocate(2 * KIB, A).unwrap()).collect();
        assert_eq!(a.superblocks_in_arenas(), 3);
        for &b in &blocks {
            a.deallocate(b, 2 * KIB, A).unwrap();
            a.check_invariants().unwrap();
        }
        assert_eq!(a.superblocks_in_arenas(), 1);
    }

    #[test]
    fn superblocks_cross_streams_only_after_a_wait() {
        let sim = SimStreams::new();
        let mut a = arena(4 * KIB, SimUpstream::new(), sim.clone());
        let x = a.allocate(2 * KIB, A).unwrap();
        let y = a.allocate(2 * KIB, A).unwrap();
        let z = a.allocate(2 * KIB, A).unwrap();
        let freed = sim.point(A);
        for b in [x, y, z] {
            a.deallocate(b, 2 * KIB, A).unwrap();
        }
        // One superblock went back to the global arena on A; B's arena takes it after a wait.
        assert_eq!(a.superblocks_in_arenas(), 1);
        let reserved = a.stats().reserved_bytes;
        let w = a.allocate(256, B).unwrap();
        assert_eq!(a.stats().reserved_bytes, reserved);
        // Under the default Adaptive policy the global list's first hand-off is a synchronize.
        assert!(sim.counts().waits + sim.counts().synchronizes >= 1);
        assert!(sim.is_ordered_after(B, freed), "{w:#x}");
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_cross_stream_free_orders_the_owning_arena() {
        let sim = SimStreams::new();
        let mut a = arena(8 * KIB, SimUpstream::new(), sim.clone());
        let x = a.allocate(KIB, A).unwrap();
        let used_on_b = sim.point(B);
        a.deallocate(x, KIB, B).unwrap();
        // A's arena will reuse the block for work on A: A must be ordered after the free on B,
        // here through a synchronize of B (the call's own stream).
        assert_eq!(sim.counts().synchronizes, 1);
        assert!(sim.is_ordered_after(A, used_on_b));
        assert_eq!(a.allocate(KIB, A).unwrap(), x);
        a.check_invariants().unwrap();
    }

    #[test]
    fn out_of_memory_reports_the_requested_size_after_reclaiming_empty_superblocks() {
        let options = ArenaOptions {
            superblock_size: 4 * KIB,
            initial_size: 8 * KIB,
            maximum_size: Some(8 * KIB),
            ..Default::default()
        };
        let mut a = ArenaEngine::new(SimUpstream::new(), SimStreams::new(), options).unwrap();
        let x = a.allocate(2 * KIB, A).unwrap();
        let y = a.allocate(2 * KIB, B).unwrap();
        a.deallocate(y, 2 * KIB, B).unwrap();
        // B keeps its empty superblock. A fills its first superblock, then needs a second one: the
        // global arena is at its maximum, so B's empty superblock is reclaimed (after a synchronize
        // of B).
        a.allocate(2 * KIB, A).unwrap();
        a.allocate(2 * KIB, A).unwrap();
        a.allocate(2 * KIB, A).unwrap();
        assert_eq!(a.superblocks_in_arenas(), 2);
        for bytes in [100, 5000] {
            let err = a.allocate(bytes, A).unwrap_err();
            assert!(
                matches!(err, Error::OutOfMemory { requested, cause: OutOfMemoryCause::MaximumSize { .. } } if requested == bytes),
                "{err:?}"
            );
        }
        a.deallocate(x, 2 * KIB, A).unwrap();
        a.check_invariants().unwrap();
        assert!(matches!(
            ArenaEngine::new(
                SimUpstream::new(),
                SimStreams::new(),
                ArenaOptions {
                    superblock_size: 256,
                    ..Default::default()
                }
            ),
            Err(Error::InvalidOptions(_))
        ));
    }

    #[test]
    fn zero_and_unknown() {
        let mut a = arena(8 * KIB, SimUpstream::new(), SimStreams::new());
        assert_eq!(a.allocate(0, A).unwrap(), 0);
        a.deallocate(0, 0, A).unwrap();
        assert_eq!(a.stats(), EngineStats::default());
        let x = a.allocate(100, A).unwrap();
        for (addr, bytes) in [(x, 1000), (x + 256, 100), (x, 5000)] {
            assert!(matches!(
                a.deallocate(addr, bytes, A),
                Err(Error::UnknownAllocation { .. })
            ));
        }
        a.deallocate(x, 100, A).unwrap();
        assert!(a.deallocate(x, 100, A).is_err());
        a.check_invariants().unwrap();
    }

    /// [`SimStreams`] whose `synchronize` fails while `fail` is set.
    struct FailingSync {
        sim: SimStreams,
        fail: std::sync::atomic::AtomicBool,
    }

    impl StreamOrder for FailingSync {
        type Stream = SimStream;
        type Event = <SimStreams as StreamOrder>::Event;
        fn create_event(&self) -> Result<Self::Event, Error> {
            self.sim.create_event()
        }
        fn record(&self, event: &mut Self::Event, stream: SimStream) -> Result<(), Error> {
            self.sim.record(event, stream)
        }
        fn wait(&self, stream: SimStream, event: &Self::Event) -> Result<(), Error> {
            self.sim.wait(stream, event)
        }
        fn synchronize(&self, stream: SimStream) -> Result<(), Error> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::Stream {
                    op: "synchronize",
                    source: "FailingSync: set to fail".into(),
                });
            }
            self.sim.synchronize(stream)
        }
    }

    #[test]
    fn a_cross_stream_free_whose_synchronize_fails_changes_nothing() {
        let order = std::sync::Arc::new(FailingSync {
            sim: SimStreams::new(),
            fail: std::sync::atomic::AtomicBool::new(true),
        });
        let options = ArenaOptions {
            superblock_size: 8 * KIB,
            ..Default::default()
        };
        let mut a = ArenaEngine::new(SimUpstream::new(), order.clone(), options).unwrap();
        // Several live blocks, so that the failed one shares a live-map chain with others (or not).
        let blocks: Vec<u64> = (0..20).map(|_| a.allocate(KIB, A).unwrap()).collect();
        let before = a.stats();
        for &x in &blocks[..10] {
            let err = a.deallocate(x, KIB, B).unwrap_err();
            assert!(matches!(err, Error::Stream { .. }), "{err:?}");
            assert_eq!(a.stats(), before);
            a.check_invariants().unwrap();
        }
        // Still live: freed normally once the synchronize works, on either stream, exactly once.
        order.fail.store(false, std::sync::atomic::Ordering::Relaxed);
        for (k, &x) in blocks.iter().enumerate() {
            a.deallocate(x, KIB, if k % 2 == 0 { A } else { B }).unwrap();
            assert!(matches!(a.deallocate(x, KIB, A), Err(Error::UnknownAllocation { .. })));
        }
        a.check_invariants().unwrap();
        assert_eq!(a.stats().used_bytes, 0);
    }

    #[test]
    fn engine_is_send() {
        fn send<T: Send>() {}
        send::<ArenaEngine<SimUpstream, SimStreams>>();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn random_sequences(ops in ops(6000, 3, 150), on_demand in any::<bool>()) {
            let policy = if on_demand { EventPolicy::RecordOnDemand } else { EventPolicy::RecordOnFree };
            let w = world(None, policy);
            let options = ArenaOptions { superblock_size: 8 * 1024, event_policy: policy, ..Default::default() };
            let a = ArenaEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(a, &w, &ops, false)?;
        }

        #[test]
        fn random_sequences_with_a_maximum(ops in ops(6000, 3, 150)) {
            let w = world(None, EventPolicy::RecordOnFree);
            let options = ArenaOptions {
                superblock_size: 4 * 1024,
                initial_size: 8 * 1024,
                maximum_size: Some(48 * 1024),
                ..Default::default()
            };
            let a = ArenaEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(a, &w, &ops, true)?;
        }
    }
}
