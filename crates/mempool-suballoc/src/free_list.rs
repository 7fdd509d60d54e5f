//! The free-block index: best fit by size and coalescing by address, without searching.

use std::collections::BTreeSet;

use super::addr_map::AddrMap;
use crate::error::{ensure, InvariantViolation};
use crate::types::ALIGNMENT;

/// A range of addresses `[addr, addr + size)` carved from the upstream chunk that starts at `chunk`.
///
/// The chunk is what keeps coalescing honest: two free blocks merge only when they touch *and* come
/// from the same chunk, because memory from two upstream allocations that happen to be adjacent
/// cannot be handed out (or returned upstream) as one range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    /// First address of the block.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Identifies the upstream chunk (or superblock) the block was carved from: its start address.
    pub chunk: u64,
}

impl Block {
    /// One past the last address of the block.
    #[inline]
    pub const fn end(&self) -> u64 {
        self.addr + self.size
    }
}

/// Blocks up to this size have a size class of their own (one per multiple of [`ALIGNMENT`]).
pub(super) const SMALL_MAX: u64 = SMALL_CLASSES as u64 * ALIGNMENT;
/// 64 x 64: one summary word of 64 bitmap words.
pub(super) const SMALL_CLASSES: usize = 4096;
/// The end of a class list.
const NIL: u32 = u32::MAX;

/// A free block in the slab, linked into its size class when small.
#[derive(Debug, Clone, Copy)]
struct Node {
    addr: u64,
    size: u64,
    chunk: u64,
    /// Neighbours in the size class's list (small blocks only).
    prev: u32,
    next: u32,
}

/// The size class of a small block size, or of the smallest class that fits a request.
#[inline]
pub(super) fn class_of(size: u64) -> usize {
    (size.div_ceil(ALIGNMENT) - 1) as usize
}

/// The first non-empty size class at or above `c`, from a two-level bitmap: bit `c % 64` of
/// `bits[c / 64]` marks class `c` non-empty, bit `w` of `summary` marks `bits[w] != 0`. Two bit scans.
#[inline]
pub(super) fn first_class_from(bits: &[u64], summary: u64, c: usize) -> Option<usize> {
    if summary == 0 {
        return None;
    }
    let w = c / 64;
    let here = bits[w] & (!0u64 << (c % 64));
    if here != 0 {
        return Some(w * 64 + here.trailing_zeros() as usize);
    }
    let above = summary & (!0u64).checked_shl(w as u32 + 1).unwrap_or(0);
    (above != 0).then(|| {
        let w = above.trailing_zeros() as usize;
        w * 64 + bits[w].trailing_zeros() as usize
    })
}

/// Stores `node` in a vacant slot of `nodes` (listed in `vacant`), or a new one; returns the slot.
/// (The slabs of [`FreeList`] and of the pool's block table.)
#[inline]
pub(super) fn new_slot<T>(nodes: &mut Vec<T>, vacant: &mut Vec<u32>, node: T) -> u32 {
    match vacant.pop() {
        Some(s) => {
            nodes[s as usize] = node;
            s
        }
        None => {
            // A u32 slot covers 4 billion blocks, some 160 GB of nodes: more than any slab holds.
            nodes.push(node);
            (nodes.len() - 1) as u32
        }
    }
}

/// Free blocks, indexed by size for best fit and by both ends for coalescing.
///
/// Every operation is O(1) for blocks of up to 1 MiB and O(log n) above, in the number of free
/// blocks; nothing searches linearly. The arena engine keeps each stream arena's free blocks in one.
/// (The pool engine keeps its blocks in a table linked by address instead, where freeing a block finds
/// its neighbours without a hash lookup.)
///
/// - Best fit by size: blocks up to 1 MiB sit in exact size classes (one per multiple of
///   [`ALIGNMENT`]) with a two-level bitmap of the non-empty ones, so the smallest class that fits
///   a request is found with two bit scans; larger blocks sit in an ordered set of `(size, addr)`.
///   The result is an exact best fit: the smallest free block that is large enough (among equal
///   small sizes, the most recently inserted; among equal large sizes, the lowest address).
/// - Coalescing: hash maps from each free block's start and end find the neighbours of a freed
///   block without a search.
///
/// A request is carved from the *high* end of its block, so the remainder keeps its address.
/// Sizes and addresses must be multiples of [`ALIGNMENT`] (as every engine's are).
///
/// ```
/// use mempool_suballoc::{Block, FreeList};
///
/// let mut free = FreeList::new();
/// free.insert(Block { addr: 0x1000, size: 0x400, chunk: 0x1000 });
/// free.insert(Block { addr: 0x1400, size: 0x400, chunk: 0x1000 }); // coalesces with the first
/// assert_eq!(free.len(), 1);
/// let b = free.take_best_fit(0x100).unwrap();
/// assert_eq!((b.addr, b.size), (0x1700, 0x100));
/// assert_eq!(free.total_bytes(), 0x700);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FreeList {
    /// The free blocks, by slot. Invariant: a slot is either in `vacant` or named by exactly one
    /// `by_start` entry.
    nodes: Vec<Node>,
    /// Unused slots of `nodes`.
    vacant: Vec<u32>,
    /// Slot of the free block starting at each key. Invariants: blocks never overlap; no two are
    /// adjacent within one chunk (such a pair is merged on insert); sizes are non-zero.
    by_start: AddrMap<u32>,
    /// Slot of the free block ending at each key: the same blocks, keyed by `addr + size`.
    by_end: AddrMap<u32>,
    /// Per size class (`size / ALIGNMENT - 1`), the first slot of a doubly linked list of the small
    /// blocks of exactly that size. Empty until the first small block arrives.
    heads: Vec<u32>,
    /// Bit `c % 64` of word `c / 64` is set iff class `c`'s list is non-empty.
    bits: Vec<u64>,
    /// Bit `w` is set iff `bits[w] != 0`.
    summary: u64,
    /// Blocks larger than `SMALL_MAX`, as `(size, addr, slot)`.
    large: BTreeSet<(u64, u64, u32)>,
    /// Sum of the sizes of all free blocks.
    total: u64,
}

impl FreeList {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of free blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.by_start.len()
    }

    /// Whether the list holds no block.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }

    /// Sum of the sizes of all free blocks, in bytes.
    #[inline]
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    #[inline]
    fn block(&self, slot: u32) -> Block {
        let n = &self.nodes[slot as usize];
        Block {
            addr: n.addr,
            size: n.size,
            chunk: n.chunk,
        }
    }

    fn new_slot(&mut self, b: Block) -> u32 {
        let node = Node {
            addr: b.addr,
            size: b.size,
            chunk: b.chunk,
            prev: NIL,
            next: NIL,
        };
        new_slot(&mut self.nodes, &mut self.vacant, node)
    }

    /// Adds `slot` to the size index.
    #[inline]
    fn link(&mut self, slot: u32) {
        let Node { addr, size, .. } = self.nodes[slot as usize];
        if size > SMALL_MAX {
            self.large.insert((size, addr, slot));
            return;
        }
        if self.heads.is_empty() {
            self.heads = vec![NIL; SMALL_CLASSES];
            self.bits = vec![0; SMALL_CLASSES / 64];
        }
        let c = class_of(size);
        let head = self.heads[c];
        let n = &mut self.nodes[slot as usize];
        n.prev = NIL;
        n.next = head;
        if head != NIL {
            self.nodes[head as usize].prev = slot;
        }
        self.heads[c] = slot;
        self.bits[c / 64] |= 1 << (c % 64);
        self.summary |= 1 << (c / 64);
    }

    /// Removes `slot` from the size index.
    #[inline]
    fn unlink(&mut self, slot: u32) {
        let Node {
            addr, size, prev, next, ..
        } = self.nodes[slot as usize];
        if size > SMALL_MAX {
            self.large.remove(&(size, addr, slot));
            return;
        }
        let c = class_of(size);
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.heads[c] = next;
            if next == NIL {
                self.bits[c / 64] &= !(1 << (c % 64));
                if self.bits[c / 64] == 0 {
                    self.summary &= !(1 << (c / 64));
                }
            }
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// The slot of the best fit for `size`.
    #[inline]
    fn find(&self, size: u64) -> Option<u32> {
        if size <= SMALL_MAX {
            if let Some(c) = first_class_from(&self.bits, self.summary, class_of(size)) {
                return Some(self.heads[c]);
            }
        }
        self.large.range((size, 0, 0)..).next().map(|&(_, _, slot)| slot)
    }

    /// Adds a free block, merging it with the free block just before and just after it when they
    /// touch it and belong to the same chunk. Returns the block as it ends up in the list.
    ///
    /// The block must not overlap a block already in the list; the engines guarantee it by checking
    /// every deallocation against their live allocations, and
    /// [`check_invariants`](Self::check_invariants) verifies it.
    pub fn insert(&mut self, block: Block) -> Block {
        debug_assert!(block.size > 0, "inserting an empty block");
        debug_assert!(
            block.addr.is_multiple_of(ALIGNMENT) && block.size.is_multiple_of(ALIGNMENT),
            "inserting unaligned {block:?}"
        );
        debug_assert!(
            !self.by_start.contains_key(&block.addr),
            "inserting {block:?}, which is already free"
        );
        self.total += block.size;
        let mut size = block.size;
        let end = block.end();
        if let Some(&next) = self.by_start.get(&end) {
            let n = self.nodes[next as usize];
            if n.chunk == block.chunk {
                self.unlink(next);
                self.by_start.remove(&end);
                self.by_end.remove(&(end + n.size));
                self.vacant.push(next);
                size += n.size;
            }
        }
        if let Some(&prev) = self.by_end.get(&block.addr) {
            if self.nodes[prev as usize].chunk == block.chunk {
                self.unlink(prev);
                self.by_end.remove(&block.addr);
                let p = &mut self.nodes[prev as usize];
                p.size += size;
                let (addr, new_end) = (p.addr, p.addr + p.size);
                self.by_end.insert(new_end, prev);
                self.link(prev);
                return Block {
                    addr,
                    size: new_end - addr,
                    chunk: block.chunk,
                };
            }
        }
        let merged = Block {
            addr: block.addr,
            size,
            chunk: block.chunk,
        };
        let slot = self.new_slot(merged);
        self.by_start.insert(merged.addr, slot);
        self.by_end.insert(merged.end(), slot);
        self.link(slot);
        merged
    }

    /// The block that [`take_best_fit`](Self::take_best_fit) would carve `size` bytes from, without
    /// removing it.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<Block> {
        self.find(size).map(|s| self.block(s))
    }

    /// Removes `size` bytes from the smallest block that holds them, leaving the rest of that block
    /// in the list. Returns the bytes taken, which are the high end of the chosen block, or `None`
    /// when no block is large enough.
    pub fn take_best_fit(&mut self, size: u64) -> Option<Block> {
        debug_assert!(size > 0, "taking an empty block");
        let slot = self.find(size)?;
        self.unlink(slot);
        let b = self.block(slot);
        self.total -= size;
        self.by_end.remove(&b.end());
        if b.size == size {
            self.by_start.remove(&b.addr);
            self.vacant.push(slot);
            return Some(b);
        }
        let rest = b.size - size;
        self.nodes[slot as usize].size = rest;
        self.by_end.insert(b.addr + rest, slot);
        self.link(slot);
        Some(Block {
            addr: b.addr + rest,
            size,
            chunk: b.chunk,
        })
    }

    /// Removes and returns the free block that starts exactly at `addr`, if there is one.
    pub fn remove(&mut self, addr: u64) -> Option<Block> {
        let slot = self.by_start.remove(&addr)?;
        self.unlink(slot);
        let b = self.block(slot);
        self.by_end.remove(&b.end());
        self.vacant.push(slot);
        self.total -= b.size;
        Some(b)
    }

    /// The free block that starts exactly at `addr`, if there is one.
    pub fn get(&self, addr: u64) -> Option<Block> {
        self.by_start.get(&addr).map(|&s| self.block(s))
    }

    /// The free blocks, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = Block> + '_ {
        self.by_start.values().map(|&s| self.block(s))
    }

    /// Moves every block of `other` into `self`, coalescing as [`insert`](Self::insert) does.
    /// `other` is left empty. Costs O(m) (O(m log n) for large blocks) for the smaller list's m
    /// blocks.
    pub fn append(&mut self, other: &mut FreeList) {
        if other.len() > self.len() {
            std::mem::swap(self, other);
        }
        let moved = std::mem::take(other);
        for block in moved.iter() {
            self.insert(block);
        }
    }

    /// Removes every block.
    pub fn clear(&mut self) {
        *self = Self::new();
    }

    /// Checks the invariants written next to the fields, in O(n log n).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let n = self.by_start.len();
        ensure!(
            self.by_end.len() == n && n + self.vacant.len() == self.nodes.len(),
            "free list: {n} blocks by start, {} by end, {} slots with {} vacant",
            self.by_end.len(),
            self.nodes.len(),
            self.vacant.len()
        );
        // The size index holds every block exactly once, each in the right place. Walking only the
        // classes whose bit is set is enough: a block linked under a clear bit, or not linked at
        // all, makes the count fall short.
        let mut indexed = 0usize;
        for (w, &word) in self.bits.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let c = w * 64 + word.trailing_zeros() as usize;
                word &= word - 1;
                let mut prev = NIL;
                let mut slot = self.heads[c];
                ensure!(slot != NIL, "free list: class {c} is marked but empty");
                while slot != NIL {
                    let node = self.nodes[slot as usize];
                    ensure!(
                        node.size <= SMALL_MAX && class_of(node.size) == c && node.prev == prev,
                        "free list: slot {slot} ({} bytes) is misfiled in class {c}",
                        node.size
                    );
                    indexed += 1;
                    ensure!(indexed <= n, "free list: class {c} loops");
                    prev = slot;
                    slot = node.next;
                }
            }
        }
        for w in 0..self.bits.len() {
            ensure!(
                (self.summary >> w & 1 == 1) == (self.bits[w] != 0),
                "free list: summary bit {w} is wrong"
            );
        }
        for &(size, addr, slot) in &self.large {
            let node = self.nodes.get(slot as usize);
            ensure!(
                size > SMALL_MAX && node.is_some_and(|b| b.addr == addr && b.size == size),
                "free list: large entry ({size}, {addr:#x}) does not match its slot"
            );
        }
        indexed += self.large.len();
        ensure!(
            indexed == n,
            "free list: {indexed} blocks in the size index, {n} in the address index"
        );

        let mut blocks = Vec::with_capacity(n);
        for (&addr, &slot) in &self.by_start {
            let b = self.block(slot);
            ensure!(b.addr == addr, "free list: slot {slot} is not at {addr:#x}");
            ensure!(
                self.by_end.get(&b.end()) == Some(&slot),
                "free list: block {b:?} missing from the end index"
            );
            ensure!(
                b.size > 0 && b.size.is_multiple_of(ALIGNMENT) && b.addr.is_multiple_of(ALIGNMENT),
                "free list: block {b:?} is empty or unaligned"
            );
            blocks.push(b);
        }
        blocks.sort_unstable_by_key(|b| b.addr);
        let mut total = 0u64;
        let mut prev: Option<Block> = None;
        for b in blocks {
            if let Some(p) = prev {
                ensure!(p.end() <= b.addr, "free list: blocks {p:?} and {b:?} overlap");
                ensure!(
                    !(p.end() == b.addr && p.chunk == b.chunk),
                    "free list: adjacent blocks {p:?} and {b:?} of one chunk were not coalesced"
                );
            }
            total += b.size;
            prev = Some(b);
        }
        ensure!(
            total == self.total,
            "free list: blocks add up to {total} bytes but the total says {}",
            self.total
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(addr: u64, size: u64, chunk: u64) -> Block {
        Block { addr, size, chunk }
    }

    fn by_addr(f: &FreeList) -> Vec<Block> {
        let mut v: Vec<Block> = f.iter().collect();
        v.sort_by_key(|b| b.addr);
        v
    }

    #[test]
    fn coalesces_with_previous_next_and_both() {
        let mut f = FreeList::new();
        f.insert(b(0, 256, 0));
        f.insert(b(512, 256, 0));
        assert_eq!(f.len(), 2);
        let m = f.insert(b(256, 256, 0));
        assert_eq!(m, b(0, 768, 0));
        assert_eq!(f.len(), 1);
        f.insert(b(768, 256, 0));
        assert_eq!(by_addr(&f), vec![b(0, 1024, 0)]);
        let m = f.insert(b(1280, 256, 0));
        assert_eq!(m, b(1280, 256, 0));
        let m = f.insert(b(1024, 256, 0));
        assert_eq!(m, b(0, 1536, 0));
        f.check_invariants().unwrap();
    }

    #[test]
    fn never_merges_across_chunks() {
        let mut f = FreeList::new();
        f.insert(b(0, 256, 0));
        f.insert(b(256, 256, 256));
        f.insert(b(512, 256, 256));
        assert_eq!(by_addr(&f), vec![b(0, 256, 0), b(256, 512, 256)]);
        f.check_invariants().unwrap();
        // Best fit may not return a range spanning both chunks.
        assert_eq!(f.take_best_fit(768), None);
    }

    #[test]
    fn best_fit_picks_the_smallest_block() {
        let mut f = FreeList::new();
        f.insert(b(0, 4096, 0));
        f.insert(b(8192, 1024, 8192));
        f.insert(b(16384, 1024, 16384));
        f.insert(b(32768, 2048, 32768));
        assert_eq!(f.best_fit(1000), Some(b(16384, 1024, 16384)));
        // Among equal small sizes, the most recently inserted goes first.
        assert_eq!(f.take_best_fit(1024), Some(b(16384, 1024, 16384)));
        assert_eq!(f.take_best_fit(1024), Some(b(8192, 1024, 8192)));
        // Split from the high end; the remainder keeps its address.
        assert_eq!(f.take_best_fit(512), Some(b(32768 + 1536, 512, 32768)));
        assert_eq!(f.get(32768), Some(b(32768, 1536, 32768)));
        assert_eq!(f.take_best_fit(8192), None);
        assert_eq!(f.total_bytes(), 4096 + 1536);
        f.check_invariants().unwrap();
    }

    #[test]
    fn small_and_large_blocks_mix() {
        const MIB: u64 = 1 << 20;
        let mut f = FreeList::new();
        f.insert(b(0, 3 * MIB, 0));
        f.insert(b(8 * MIB, MIB + 256, 8 * MIB));
        f.insert(b(16 * MIB, MIB, 16 * MIB));
        f.insert(b(32 * MIB, 2 * MIB, 32 * MIB));
        f.insert(b(40 * MIB, 2 * MIB, 40 * MIB));
        f.check_invariants().unwrap();
        // The largest small class, then the smallest large block, then ties by address.
        assert_eq!(f.best_fit(1000), Some(b(16 * MIB, MIB, 16 * MIB)));
        assert_eq!(f.take_best_fit(MIB), Some(b(16 * MIB, MIB, 16 * MIB)));
        assert_eq!(f.best_fit(1000), Some(b(8 * MIB, MIB + 256, 8 * MIB)));
        assert_eq!(f.take_best_fit(MIB + 256), Some(b(8 * MIB, MIB + 256, 8 * MIB)));
        assert_eq!(f.take_best_fit(2 * MIB), Some(b(32 * MIB, 2 * MIB, 32 * MIB)));
        // A large block split down into the small classes.
        assert_eq!(f.take_best_fit(3 * MIB - 512), Some(b(512, 3 * MIB - 512, 0)));
        assert_eq!(f.best_fit(256), Some(b(0, 512, 0)));
        assert_eq!(f.take_best_fit(MIB), Some(b(40 * MIB + MIB, MIB, 40 * MIB)));
        // And merged back up into the large set.
        f.insert(b(40 * MIB + MIB, MIB, 40 * MIB));
        assert_eq!(f.get(40 * MIB), Some(b(40 * MIB, 2 * MIB, 40 * MIB)));
        assert_eq!(f.len(), 2);
        f.check_invariants().unwrap();
    }

    #[test]
    fn remove_and_append() {
        let mut f = FreeList::new();
        let mut g = FreeList::new();
        f.insert(b(0, 256, 0));
        f.insert(b(1024, 256, 0));
        g.insert(b(256, 768, 0));
        g.insert(b(4096, 256, 4096));
        g.insert(b(8192, 256, 4096));
        f.append(&mut g);
        assert!(g.is_empty());
        assert_eq!(by_addr(&f), vec![b(0, 1280, 0), b(4096, 256, 4096), b(8192, 256, 4096)]);
        assert_eq!(f.remove(4096), Some(b(4096, 256, 4096)));
        assert_eq!(f.remove(4096), None);
        assert_eq!(f.total_bytes(), 1280 + 256);
        f.check_invariants().unwrap();
    }

    #[test]
    fn stays_logarithmic_with_many_blocks() {
        // 50k separate blocks (every other granule), then fill the holes: each fill merges with both
        // neighbours. A linear list would take ~10^9 steps here.
        let n = 50_000u64;
        let mut f = FreeList::new();
        for i in 0..n {
            f.insert(b(i * 512, 256, 0));
        }
        assert_eq!(f.len(), n as usize);
        for i in 0..n - 1 {
            f.insert(b(i * 512 + 256, 256, 0));
        }
        assert_eq!(f.len(), 1);
        assert_eq!(f.total_bytes(), (2 * n - 1) * 256);
        f.check_invariants().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random inserts of disjoint granules and best-fit takes: the list always equals a naive
        /// model (a set of granules), and every take is a best fit. With 512 KiB granules, blocks
        /// move between the small classes and the large set.
        #[test]
        fn matches_a_granule_model(
            ops in prop::collection::vec((any::<bool>(), 0u64..64, 1u64..6), 1..200),
            granule in prop_oneof![Just(256u64), Just(512 * 1024)],
        ) {
            #[allow(non_snake_case)]
            let G = granule;
            // Four chunks of 16 granules each.
            let chunk_of = |g: u64| (g / 16) * 16 * G;
            let mut free = FreeList::new();
            let mut model = [false; 64];
            for (insert, g, n) in ops {
                if insert {
                    if !model[g as usize] {
                        model[g as usize] = true;
                        free.insert(b(g * G, G, chunk_of(g)));
                    }
                } else {
                    let want = n * G;
                    // Model: maximal runs of free granules within a chunk.
                    let mut runs = Vec::new();
                    let mut i = 0;
                    while i < 64 {
                        if model[i] {
                            let start = i;
                            while i < 64 && model[i] && chunk_of(i as u64) == chunk_of(start as u64) {
                                i += 1;
                            }
                            runs.push((start as u64, (i - start) as u64));
                        } else {
                            i += 1;
                        }
                    }
                    let fitting = runs.iter().filter(|r| r.1 * G >= want);
                    let best_len = fitting.clone().map(|r| r.1).min();
                    let got = free.take_best_fit(want);
                    match (best_len, got) {
                        (None, None) => {}
                        (Some(len), Some(blk)) => {
                            // Carved from the high end of some run of the best-fitting length.
                            let run = runs.iter().find(|r| (r.0 + r.1) * G == blk.end());
                            prop_assert!(run.is_some_and(|r| r.1 == len), "{:?} is not a best fit ({} granules)", blk, len);
                            prop_assert_eq!(blk.size, want);
                            for k in blk.addr / G..blk.end() / G {
                                model[k as usize] = false;
                            }
                        }
                        (m, g) => prop_assert!(false, "model {:?} vs list {:?}", m, g),
                    }
                }
                free.check_invariants().unwrap();
                prop_assert_eq!(free.total_bytes(), model.iter().filter(|&&x| x).count() as u64 * G);
            }
        }
    }
}
