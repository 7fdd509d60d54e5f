//! Blocks of one size in O(1): RMM's `fixed_size_memory_resource` on addresses.

use std::collections::HashSet;

use super::addr_map::{AddrMap, AddrTable};
use super::chunks::{check_balance, Chunks};
use super::stream_lists::StreamLists;
use crate::block::Block;
use crate::engine::Engine;
use crate::error::{ensure, Error, InvariantViolation};
use crate::memory_map::{self, ChunkMap};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
use crate::upstream::Upstream;

/// The shape of a [`FixedSizeEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedSizeOptions {
    /// Size of every block, rounded up to [`ALIGNMENT`]; the largest request served.
    pub block_size: u64,
    /// Blocks carved from each upstream chunk (at least 1, at most 2^32).
    pub blocks_per_chunk: u64,
    /// When to record the events that hand free blocks to other streams.
    pub event_policy: EventPolicy,
}

impl Default for FixedSizeOptions {
    /// RMM's defaults: 1 MiB blocks, 128 per chunk, [`EventPolicy::Adaptive`].
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            blocks_per_chunk: 128,
            event_policy: EventPolicy::Adaptive,
        }
    }
}

/// A slot of the chunk table with no chunk, and an empty half of a page entry.
const NO_SLOT: u32 = u32::MAX;

/// A block as the free lists keep it: the number of its live bit, `slot << stride_shift | k` for
/// block `k` of the chunk in `slot` (so a pop finds the bit and the chunk without a lookup).
type BlockId = u64;

/// The fixed-size bookkeeping without upstream and stream order, so that the binning engine can
/// keep one per bin over a shared upstream.
///
/// Everything a call touches is small: a chunk's blocks are numbered, each chunk has a slot in a
/// table (its start address and one live bit per block), free blocks are [`BlockId`]s on
/// per-stream stacks, and a free finds its chunk through a map from address pages to the (at
/// most two) chunks that overlap each page. With 128 blocks per chunk the tables are a few bytes
/// per block (a hash set of live addresses was 16 bytes per live block, and its line was the
/// operation's cache miss once it outgrew the core's caches).
pub(crate) struct FixedCore<O: StreamOrder> {
    /// Aligned to [`ALIGNMENT`], non-zero.
    block_size: u64,
    /// `log2(block_size)` when it is a power of two (every bin's), so block numbers are shifts.
    block_shift: Option<u32>,
    /// At least 1, at most `2^32`.
    blocks_per_chunk: u64,
    /// `block_size * blocks_per_chunk`, which does not overflow.
    chunk_size: u64,
    /// `log2` of the largest power of two not above `chunk_size` (at least 8): a page of `pages`.
    /// A page then overlaps at most two chunks, and a chunk at most three pages.
    page_shift: u32,
    /// Upstream chunks, each `chunk_size` bytes, with the stream each came on.
    chunks: Chunks<O::Stream>,
    /// Slot -> the start of its chunk; 0 for a slot with no chunk (listed in `free_slots`).
    bases: Vec<u64>,
    /// `2^stride_shift` bits per slot: bit [`BlockId`] is set while that block is live. Zero for
    /// slots with no chunk and past a slot's last block.
    live_bits: Vec<u64>,
    /// `log2` of the live bits per slot: `blocks_per_chunk` rounded up to a power of two, at least
    /// 64 (a whole word), so a block's bit, word and slot are shifts of its id.
    stride_shift: u32,
    free_slots: Vec<u32>,
    /// Page key (see [`page_key`](Self::page_key)) -> the slots of the chunks overlapping that page.
    pages: AddrTable<[u32; 2]>,
    /// Free blocks per stream, as stacks (LIFO: the most recently freed block is the one most
    /// likely still in cache or not yet reused by the GPU's other work). Invariant: with the live
    /// bits, exactly the blocks of all chunks, each once.
    lists: StreamLists<O, Vec<BlockId>>,
    /// Number of set live bits.
    live: usize,
}

impl<O: StreamOrder> FixedCore<O> {
    pub(crate) fn new(block_size: u64, blocks_per_chunk: u64, policy: EventPolicy) -> Result<Self, Error> {
        if block_size == 0 {
            return Err(Error::InvalidOptions("block_size is 0"));
        }
        if blocks_per_chunk == 0 {
            return Err(Error::InvalidOptions("blocks_per_chunk is 0"));
        }
        if blocks_per_chunk > 1 << 32 {
            return Err(Error::InvalidOptions("blocks_per_chunk is above 2^32"));
        }
        let block_size = align_up(block_size).ok_or(Error::InvalidOptions("block_size is not representable"))?;
        let chunk_size = block_size
            .checked_mul(blocks_per_chunk)
            .ok_or(Error::InvalidOptions("block_size * blocks_per_chunk overflows"))?;
        Ok(Self {
            block_size,
            block_shift: block_size.is_power_of_two().then(|| block_size.trailing_zeros()),
            blocks_per_chunk,
            chunk_size,
            // chunk_size >= ALIGNMENT = 2^8.
            page_shift: 63 - chunk_size.leading_zeros(),
            chunks: Chunks::default(),
            bases: Vec::new(),
            live_bits: Vec::new(),
            stride_shift: blocks_per_chunk.next_power_of_two().max(64).trailing_zeros(),
            free_slots: Vec::new(),
            pages: AddrTable::default(),
            lists: StreamLists::new(policy),
            live: 0,
        })
    }

    pub(crate) fn block_size(&self) -> u64 {
        self.block_size
    }

    /// The key of page `page` in `pages`: non-zero, and the page number where the table's hash
    /// looks (it hashes `key >> 8`). `page < 2^56` since pages are at least 256 bytes.
    #[inline]
    fn page_key(page: u64) -> u64 {
        page << 8 | 1
    }

    /// Live-bit words per slot.
    #[inline]
    fn words(&self) -> usize {
        1 << (self.stride_shift - 6)
    }

    /// The id of block `k` of the chunk in `slot`.
    #[inline]
    fn block_id(&self, slot: u32, k: u64) -> BlockId {
        u64::from(slot) << self.stride_shift | k
    }

    /// The slot and block number of `id`.
    #[inline]
    fn split_id(&self, id: BlockId) -> (u32, u64) {
        ((id >> self.stride_shift) as u32, id & ((1 << self.stride_shift) - 1))
    }

    /// The address of block `id`.
    #[inline]
    fn address(&self, id: BlockId) -> u64 {
        let (slot, k) = self.split_id(id);
        let offset = match self.block_shift {
            Some(shift) => k << shift,
            None => k * self.block_size,
        };
        self.bases[slot as usize] + offset
    }

    /// The word holding block `id`'s live bit, and the bit.
    #[inline]
    fn bit(id: BlockId) -> (usize, u64) {
        ((id >> 6) as usize, 1 << (id & 63))
    }

    /// The id of the block that starts at `addr`, if `addr` starts a block of a chunk (live or
    /// free).
    #[inline]
    fn block_at(&self, addr: u64) -> Option<BlockId> {
        let [first, second] = self.pages.get(Self::page_key(addr >> self.page_shift))?;
        let (slot, offset) = match self.offset_in(first, addr) {
            Some(offset) => (first, offset),
            None => (second, self.offset_in(second, addr)?),
        };
        let k = match self.block_shift {
            Some(shift) if offset & (self.block_size - 1) == 0 => offset >> shift,
            None if offset % self.block_size == 0 => offset / self.block_size,
            _ => return None,
        };
        Some(self.block_id(slot, k))
    }

    /// `addr`'s offset in the chunk in `slot`, if it lies there (`None` for [`NO_SLOT`]).
    #[inline]
    fn offset_in(&self, slot: u32, addr: u64) -> Option<u64> {
        let base = *self.bases.get(slot as usize)?;
        let offset = addr.wrapping_sub(base);
        (base != 0 && offset < self.chunk_size).then_some(offset)
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
        let id = match self.lists.list_mut(i).pop() {
            Some(id) => id,
            None => self.allocate_slow(upstream, order, requested, stream, i)?,
        };
        let (w, b) = Self::bit(id);
        debug_assert_eq!(self.live_bits[w] & b, 0, "a free block is live");
        self.live_bits[w] |= b;
        self.live += 1;
        Ok(self.address(id))
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
    ) -> Result<BlockId, Error> {
        for j in 0..self.lists.len() {
            if j != i && !self.lists.list(j).is_empty() {
                self.lists.order_after(order, stream, j)?;
                if let Some(id) = self.lists.list_mut(j).pop() {
                    return Ok(id);
                }
            }
        }
        let base = self
            .chunks
            .allocate(upstream, self.chunk_size, stream)
            .map_err(|e| e.with_requested(requested))?;
        let slot = self.add_chunk(base);
        let n = self.blocks_per_chunk;
        if n > 1 {
            // Pushed high to low, so the chunk is handed out in address order.
            let first = self.block_id(slot, 0);
            self.lists.list_mut(i).extend((1..n).rev().map(|k| first | k));
            self.lists.entered(order, i);
        }
        Ok(self.block_id(slot, 0))
    }

    /// The pages the chunk at `base` overlaps.
    fn pages_of(&self, base: u64) -> std::ops::RangeInclusive<u64> {
        (base >> self.page_shift)..=((base + (self.chunk_size - 1)) >> self.page_shift)
    }

    /// Gives the chunk at `base` (just allocated) a slot and its pages; returns the slot.
    fn add_chunk(&mut self, base: u64) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.bases[slot as usize] = base;
                slot
            }
            None => {
                // A chunk of 256 bytes or more per slot: 2^32 slots would be 2^40 bytes of chunks
                // at the least, which the u32 slot numbers cover for any real upstream.
                let slot = u32::try_from(self.bases.len())
                    .ok()
                    .filter(|&s| s != NO_SLOT)
                    .expect("more than 2^32 - 1 chunks in one fixed-size core");
                self.bases.push(base);
                self.live_bits.resize(self.live_bits.len() + self.words(), 0);
                slot
            }
        };
        for page in self.pages_of(base) {
            let key = Self::page_key(page);
            match self.pages.get_mut(key) {
                Some(entry) => {
                    // Chunks are disjoint and a page is at most one chunk long, so a page has at
                    // most two chunks: the other half is free.
                    debug_assert!(entry.contains(&NO_SLOT), "a page overlaps three chunks");
                    let free = if entry[0] == NO_SLOT { 0 } else { 1 };
                    entry[free] = slot;
                }
                None => self.pages.insert(key, [slot, NO_SLOT]),
            }
        }
        slot
    }

    /// Forgets the chunk in `slot` (none of its blocks live or listed) and frees the slot.
    fn remove_chunk(&mut self, slot: u32) {
        let base = self.bases[slot as usize];
        for page in self.pages_of(base) {
            let key = Self::page_key(page);
            if let Some(entry) = self.pages.get_mut(key) {
                for s in entry.iter_mut() {
                    if *s == slot {
                        *s = NO_SLOT;
                    }
                }
                if *entry == [NO_SLOT, NO_SLOT] {
                    self.pages.remove(key);
                }
            }
        }
        self.bases[slot as usize] = 0;
        self.free_slots.push(slot);
    }

    /// Frees the block at `addr` into `stream`'s list.
    #[inline]
    pub(crate) fn deallocate(&mut self, order: &O, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        let Some(id) = self.block_at(addr) else {
            return Err(Error::UnknownAllocation { addr, bytes });
        };
        let (w, b) = Self::bit(id);
        if self.live_bits[w] & b == 0 {
            return Err(Error::UnknownAllocation { addr, bytes });
        }
        self.live_bits[w] &= !b;
        self.live -= 1;
        let i = self.lists.find(stream);
        self.lists.list_mut(i).push(id);
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

    /// Whether any block of the chunk in `slot` is live.
    fn has_live(&self, slot: u32) -> bool {
        let start = slot as usize * self.words();
        self.live_bits[start..start + self.words()].iter().any(|&w| w != 0)
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
        let unused: Vec<u32> = (0..self.bases.len() as u32)
            .filter(|&s| self.bases[s as usize] != 0 && !self.has_live(s))
            .collect();
        if unused.is_empty() {
            return Ok(0);
        }
        let i = self.lists.find(stream);
        let mut is_unused = vec![false; self.bases.len()];
        for &s in &unused {
            is_unused[s as usize] = true;
        }
        self.lists
            .list_mut(i)
            .retain(|&id| !is_unused[(id >> self.stride_shift) as usize]);
        let mut released = 0;
        let mut result = Ok(());
        for s in unused {
            let base = self.bases[s as usize];
            self.remove_chunk(s);
            match self.chunks.release(upstream, base, stream) {
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
        self.bases.clear();
        self.live_bits.clear();
        self.free_slots.clear();
        self.pages.clear();
        self.live = 0;
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
        let used = self.live as u64 * self.block_size;
        EngineStats {
            reserved_bytes: reserved,
            used_bytes: used,
            free_bytes: reserved - used,
            free_blocks: self.lists.blocks(),
            live_allocations: self.live,
            upstream_chunks: self.chunks.len(),
        }
    }

    /// The chunks with their blocks: live ones used, free ones with the stream whose stack holds
    /// them ([`Engine::memory_map`]).
    pub(crate) fn memory_map(&self) -> Vec<ChunkMap<O::Stream>> {
        let bs = self.block_size;
        let block = |id: BlockId| {
            let (slot, _) = self.split_id(id);
            Block {
                addr: self.address(id),
                size: bs,
                chunk: self.bases[slot as usize],
            }
        };
        let mut ranges = Vec::with_capacity(self.lists.blocks() + self.live);
        for (stream, list) in self.lists.iter() {
            ranges.extend(list.iter().map(|&id| (block(id), false, Some(stream))));
        }
        for (slot, &base) in self.bases.iter().enumerate() {
            if base == 0 {
                continue;
            }
            for k in 0..self.blocks_per_chunk {
                let id = self.block_id(slot as u32, k);
                let (w, b) = Self::bit(id);
                if self.live_bits[w] & b != 0 {
                    ranges.push((block(id), true, None));
                }
            }
        }
        memory_map::build(self.chunks.iter().map(|(a, c)| (a, c.size)), ranges)
    }

    pub(crate) fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.chunks.check("fixed-size")?;
        ensure!(
            self.chunks.iter().all(|(_, c)| c.size == self.chunk_size),
            "fixed-size: a chunk is not {} bytes",
            self.chunk_size
        );
        // The slot table names exactly the chunks; free slots have no base and no live bit.
        ensure!(
            self.live_bits.len() == self.bases.len() * self.words(),
            "fixed-size: {} live-bit words for {} slots",
            self.live_bits.len(),
            self.bases.len()
        );
        let mut slot_of: AddrMap<u32> = AddrMap::default();
        for (s, &base) in self.bases.iter().enumerate() {
            if base == 0 {
                ensure!(
                    !self.has_live(s as u32),
                    "fixed-size: slot {s} has no chunk but live bits"
                );
            } else {
                ensure!(
                    self.chunks.get(base).is_some(),
                    "fixed-size: slot {s} names {base:#x}, not a chunk"
                );
                ensure!(
                    slot_of.insert(base, s as u32).is_none(),
                    "fixed-size: chunk {base:#x} has two slots"
                );
            }
        }
        let mut free_slots: Vec<u32> = self.free_slots.clone();
        free_slots.sort_unstable();
        free_slots.dedup();
        ensure!(
            free_slots.len() == self.free_slots.len()
                && free_slots.iter().all(|&s| self.bases.get(s as usize) == Some(&0))
                && free_slots.len() + slot_of.len() == self.bases.len(),
            "fixed-size: the free slots are not exactly the slots without a chunk"
        );
        ensure!(
            slot_of.len() == self.chunks.len(),
            "fixed-size: {} chunks, {} with a slot",
            self.chunks.len(),
            slot_of.len()
        );
        // Every chunk's pages name it, and every page names only chunks that overlap it.
        let mut page_entries = 0;
        for (&base, &slot) in &slot_of {
            for page in self.pages_of(base) {
                ensure!(
                    self.pages.get(Self::page_key(page)).is_some_and(|e| e.contains(&slot)),
                    "fixed-size: page {page:#x} does not name chunk {base:#x}"
                );
                page_entries += 1;
            }
        }
        let mut named = 0;
        for (key, entry) in self.pages.iter() {
            let page = key >> 8;
            ensure!(entry != [NO_SLOT, NO_SLOT], "fixed-size: page {page:#x} names no chunk");
            for s in entry.into_iter().filter(|&s| s != NO_SLOT) {
                let base = self.bases.get(s as usize).copied().unwrap_or(0);
                ensure!(
                    base != 0 && self.pages_of(base).contains(&page),
                    "fixed-size: page {page:#x} names slot {s}, whose chunk does not overlap it"
                );
                named += 1;
            }
        }
        ensure!(
            named == page_entries,
            "fixed-size: the page map names {named} chunk pages, the chunks have {page_entries}"
        );
        // Live bits only for blocks that exist, and as many as `live` says.
        let mut live = 0;
        for s in 0..self.bases.len() {
            let words = self.words();
            for (j, &w) in self.live_bits[s * words..(s + 1) * words].iter().enumerate() {
                let valid = self.blocks_per_chunk.saturating_sub(j as u64 * 64).min(64);
                let mask = if valid == 64 { u64::MAX } else { (1 << valid) - 1 };
                ensure!(w & !mask == 0, "fixed-size: slot {s} has live bits past its last block");
                live += w.count_ones() as usize;
            }
        }
        ensure!(
            live == self.live,
            "fixed-size: {live} live bits, {} live blocks counted",
            self.live
        );
        // Every free block is a block of a chunk, not live, and listed once.
        let bs = self.block_size;
        let mut seen = HashSet::with_capacity(self.lists.blocks());
        for (_, list) in self.lists.iter() {
            for &id in list {
                let (slot, k) = self.split_id(id);
                let base = self.bases.get(slot as usize).copied().unwrap_or(0);
                ensure!(
                    base != 0 && k < self.blocks_per_chunk,
                    "fixed-size: free block {id:#x} (slot {slot}, block {k}) is not a block of a chunk"
                );
                let (w, b) = Self::bit(id);
                let addr = self.address(id);
                ensure!(
                    self.live_bits[w] & b == 0,
                    "fixed-size: block {addr:#x} ({bs} bytes) is free and live"
                );
                ensure!(
                    seen.insert(id),
                    "fixed-size: block {addr:#x} ({bs} bytes) is listed twice"
                );
                ensure!(
                    self.block_at(addr) == Some(id),
                    "fixed-size: block {addr:#x} is not found by its address"
                );
                ensure!(
                    addr.is_multiple_of(ALIGNMENT),
                    "fixed-size: block {addr:#x} is misaligned"
                );
            }
        }
        let st = self.stats();
        ensure!(
            (seen.len() + self.live) as u64 * bs == st.reserved_bytes,
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
/// Allocation and deallocation are O(1): a stack pop or push per stream and a live bit per block
/// (which catches double frees), with a free finding its chunk through a small map of address
/// pages. Blocks move between streams by the same event rule as
/// the pool's (see the [module docs](super)). Requests above the block size fail with
/// [`Error::TooLarge`]; 0 bytes returns address 0 without touching any state.
///
/// ```
/// use mempool_suballoc::{Engine, FixedSizeOptions, FixedSizeEngine, SimStream, SimStreams, SimUpstream};
///
/// let options = FixedSizeOptions { block_size: 4096, blocks_per_chunk: 16, ..Default::default() };
/// let mut fixed = FixedSizeEngine::new(SimUpstream::new(), SimStreams::new(), options)?;
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
    options: FixedSizeOptions,
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
    type Options = FixedSizeOptions;
    type Stream = O::Stream;
    type Upstream = U;
    type Order = O;

    /// An engine over `upstream` that orders streams through `order`. Reserves nothing yet. Fails
    /// with [`Error::InvalidOptions`] for a zero block size or count, a count above 2^32, or a chunk
    /// size that overflows.
    fn new(upstream: U, order: O, options: FixedSizeOptions) -> Result<Self, Error> {
        let core = FixedCore::new(options.block_size, options.blocks_per_chunk, options.event_policy)?;
        Ok(Self {
            upstream,
            order,
            options: FixedSizeOptions {
                block_size: core.block_size(),
                ..options
            },
            core,
        })
    }

    fn options(&self) -> FixedSizeOptions {
        self.options
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

    fn memory_map(&self) -> Vec<ChunkMap<O::Stream>> {
        self.core.memory_map()
    }

    fn upstream(&self) -> &U {
        &self.upstream
    }

    fn stream_order(&self) -> &O {
        &self.order
    }
}

crate::engine::engine_common!(FixedSizeOptions => FixedSizeEngine);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OutOfMemoryCause;
    use crate::sim::SimUpstream;
    use crate::sim::{SimStream, SimStreams};
    use crate::testing::{self, ops, world};
    use proptest::prelude::*;

    const A: SimStream = SimStream::new(0);
    const B: SimStream = SimStream::new(1);
    const C: SimStream = SimStream::new(2);

    fn fixed(block_size: u64, blocks_per_chunk: u64, up: SimUpstream) -> FixedSizeEngine<SimUpstream, SimStreams> {
        let options = FixedSizeOptions {
            block_size,
            blocks_per_chunk,
            ..Default::default()
        };
        FixedSizeEngine::new(up, SimStreams::new(), options).unwrap()
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
        for (block_size, blocks_per_chunk) in [(0, 1), (256, 0), (u64::MAX / 2, 4), (256, (1 << 32) + 1)] {
            let options = FixedSizeOptions {
                block_size,
                blocks_per_chunk,
                ..Default::default()
            };
            assert!(matches!(
                FixedSizeEngine::new(SimUpstream::new(), SimStreams::new(), options),
                Err(Error::InvalidOptions(_))
            ));
        }
    }

    #[test]
    fn frees_find_their_chunk_by_address_across_shared_pages_gaps_and_reused_slots() {
        // 768-byte blocks, 3 per chunk: 2,304-byte chunks over 2,048-byte pages, so chunks straddle
        // pages and neighbouring chunks share one; upstream ranges between them leave gaps.
        let up = SimUpstream::new();
        let mut f = fixed(768, 3, up.clone());
        let mut live = Vec::new();
        for round in 0..4u64 {
            for _ in 0..3 {
                live.push(f.allocate(700, A).unwrap());
            }
            // A range of the upstream's that is no chunk of this engine.
            Upstream::<SimStream>::allocate(&up, 256 * (round + 1), A).unwrap();
        }
        f.check_invariants().unwrap();
        let chunks: Vec<(u64, u64)> = up.live_chunks().into_iter().filter(|&(_, size)| size == 2304).collect();
        assert_eq!(chunks.len(), 4);
        let first = chunks[0].0;
        let last = chunks[3].0 + 2304;
        // Every 256-byte step from below the first chunk to past the last: only block starts of live
        // blocks are accepted, and a refused free changes nothing.
        let before = f.stats();
        for addr in (first.saturating_sub(4096)..last + 4096).step_by(256) {
            if live.contains(&addr) {
                continue;
            }
            assert!(
                matches!(f.deallocate(addr, 768, A), Err(Error::UnknownAllocation { .. })),
                "{addr:#x} is not a live block"
            );
        }
        assert_eq!(f.stats(), before);
        f.check_invariants().unwrap();
        // Free the middle chunks' blocks and give them back; the freed slots serve new chunks.
        let (keep, give): (Vec<u64>, Vec<u64>) = live.iter().partition(|&&a| a < chunks[1].0 || a >= chunks[3].0);
        for &a in &give {
            f.deallocate(a, 768, B).unwrap();
        }
        assert_eq!(f.release_unused(A).unwrap(), 2 * 2304);
        f.check_invariants().unwrap();
        for &a in &give {
            assert!(matches!(f.deallocate(a, 768, A), Err(Error::UnknownAllocation { .. })));
        }
        let again: Vec<u64> = (0..6).map(|_| f.allocate(1, A).unwrap()).collect();
        assert_eq!(f.stats().upstream_chunks, 4);
        f.check_invariants().unwrap();
        for a in keep.into_iter().chain(again) {
            f.deallocate(a, 768, A).unwrap();
        }
        assert_eq!(f.stats().live_allocations, 0);
        f.check_invariants().unwrap();
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
        let options = FixedSizeOptions {
            block_size: 256,
            blocks_per_chunk: 1,
            event_policy: EventPolicy::RecordOnDemand,
        };
        let mut f = FixedSizeEngine::new(SimUpstream::new(), sim.clone(), options).unwrap();
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
            let options = FixedSizeOptions { block_size: 1024, blocks_per_chunk: per_chunk, ..Default::default() };
            let f = FixedSizeEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(f, &w, &ops, false)?;
        }

        #[test]
        fn random_sequences_with_a_small_upstream(ops in ops(1024, 3, 150)) {
            let w = world(Some(24 * 1024), EventPolicy::RecordOnDemand);
            let options = FixedSizeOptions { block_size: 1024, blocks_per_chunk: 4, event_policy: EventPolicy::RecordOnDemand };
            let f = FixedSizeEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(f, &w, &ops, true)?;
        }
    }
}
