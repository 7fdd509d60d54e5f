//! The free-block index: best fit by size and coalescing by address, both in O(log n).

use std::collections::{BTreeMap, BTreeSet};

use super::{ensure, InvariantViolation};

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

/// What [`FreeList::by_addr`] stores for the block starting at its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    size: u64,
    chunk: u64,
}

/// Free blocks, indexed by `(size, addr)` for best fit and by `addr` for coalescing.
///
/// Every operation is O(log n) in the number of free blocks: pools in the standard random workload
/// hold tens of thousands of them, where a linearly searched list falls apart.
///
/// Allocation takes the best fit (the smallest block that is large enough, the lowest address among
/// equals) and carves the request from its *high* end, so the remainder keeps its address and its
/// entry in the address index is updated in place rather than removed and reinserted.
///
/// ```
/// use mempool_rmm::suballoc::{Block, FreeList};
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
    /// Free blocks by start address. Invariants: no two overlap; no two are adjacent within the same
    /// chunk (such a pair is always merged on insert); sizes are non-zero.
    by_addr: BTreeMap<u64, Entry>,
    /// The same blocks as `(size, addr)`. Invariant: exactly the entries of `by_addr`.
    by_size: BTreeSet<(u64, u64)>,
    /// Sum of the sizes in `by_addr`.
    total: u64,
}

impl FreeList {
    /// An empty list.
    pub const fn new() -> Self {
        Self {
            by_addr: BTreeMap::new(),
            by_size: BTreeSet::new(),
            total: 0,
        }
    }

    /// Number of free blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether the list holds no block.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// Sum of the sizes of all free blocks, in bytes.
    #[inline]
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Adds a free block, merging it with the free block just before and just after it when they
    /// touch it and belong to the same chunk. Returns the block as it ends up in the list.
    ///
    /// The block must not overlap a block already in the list (checked in debug builds and by
    /// [`check_invariants`](Self::check_invariants)).
    pub fn insert(&mut self, block: Block) -> Block {
        debug_assert!(block.size > 0, "inserting an empty block");
        let mut merged = block;
        self.total += block.size;

        if let Some(next) = self.by_addr.get(&block.end()).copied() {
            if next.chunk == block.chunk {
                self.by_addr.remove(&block.end());
                self.by_size.remove(&(next.size, block.end()));
                merged.size += next.size;
            }
        }
        debug_assert!(
            self.by_addr
                .range(block.addr..)
                .next()
                .map_or(true, |(&a, _)| a >= merged.end()),
            "inserted block {block:?} overlaps the next free block"
        );

        if let Some((&prev_addr, prev)) = self.by_addr.range_mut(..block.addr).next_back() {
            debug_assert!(
                prev_addr + prev.size <= block.addr,
                "inserted block {block:?} overlaps the previous free block at {prev_addr:#x}"
            );
            if prev_addr + prev.size == block.addr && prev.chunk == block.chunk {
                self.by_size.remove(&(prev.size, prev_addr));
                prev.size += merged.size;
                self.by_size.insert((prev.size, prev_addr));
                return Block {
                    addr: prev_addr,
                    size: prev.size,
                    chunk: prev.chunk,
                };
            }
        }

        self.by_addr.insert(
            merged.addr,
            Entry {
                size: merged.size,
                chunk: merged.chunk,
            },
        );
        self.by_size.insert((merged.size, merged.addr));
        merged
    }

    /// The block that [`take_best_fit`](Self::take_best_fit) would carve `size` bytes from, without
    /// removing it.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<Block> {
        let &(bsize, addr) = self.by_size.range((size, 0)..).next()?;
        let chunk = self.by_addr[&addr].chunk;
        Some(Block {
            addr,
            size: bsize,
            chunk,
        })
    }

    /// Removes `size` bytes from the smallest block that holds them (the lowest address among
    /// equals), leaving the rest of that block in the list. Returns the bytes taken, which are the
    /// high end of the chosen block, or `None` when no block is large enough.
    pub fn take_best_fit(&mut self, size: u64) -> Option<Block> {
        debug_assert!(size > 0, "taking an empty block");
        let &(bsize, addr) = self.by_size.range((size, 0)..).next()?;
        self.by_size.remove(&(bsize, addr));
        self.total -= size;
        if bsize == size {
            let entry = self.by_addr.remove(&addr)?;
            return Some(Block {
                addr,
                size,
                chunk: entry.chunk,
            });
        }
        let rest = bsize - size;
        let entry = self.by_addr.get_mut(&addr)?;
        entry.size = rest;
        let chunk = entry.chunk;
        self.by_size.insert((rest, addr));
        Some(Block {
            addr: addr + rest,
            size,
            chunk,
        })
    }

    /// Removes and returns the free block that starts exactly at `addr`, if there is one.
    pub fn remove(&mut self, addr: u64) -> Option<Block> {
        let entry = self.by_addr.remove(&addr)?;
        self.by_size.remove(&(entry.size, addr));
        self.total -= entry.size;
        Some(Block {
            addr,
            size: entry.size,
            chunk: entry.chunk,
        })
    }

    /// The free block that starts exactly at `addr`, if there is one.
    pub fn get(&self, addr: u64) -> Option<Block> {
        self.by_addr.get(&addr).map(|e| Block {
            addr,
            size: e.size,
            chunk: e.chunk,
        })
    }

    /// The free blocks in address order.
    pub fn iter(&self) -> impl Iterator<Item = Block> + '_ {
        self.by_addr.iter().map(|(&addr, e)| Block {
            addr,
            size: e.size,
            chunk: e.chunk,
        })
    }

    /// Moves every block of `other` into `self`, coalescing as [`insert`](Self::insert) does.
    /// `other` is left empty. Costs O(m log(n + m)) for the smaller list's m blocks.
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
        ensure!(
            self.by_addr.len() == self.by_size.len(),
            "free list: {} blocks by address but {} by size",
            self.by_addr.len(),
            self.by_size.len()
        );
        let mut total = 0u64;
        let mut prev: Option<Block> = None;
        for b in self.iter() {
            ensure!(b.size > 0, "free list: empty block at {:#x}", b.addr);
            ensure!(
                self.by_size.contains(&(b.size, b.addr)),
                "free list: block {b:?} missing from the size index"
            );
            if let Some(p) = prev {
                ensure!(
                    p.end() <= b.addr,
                    "free list: blocks {p:?} and {b:?} overlap"
                );
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
        assert_eq!(f.iter().collect::<Vec<_>>(), vec![b(0, 1024, 0)]);
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
        assert_eq!(
            f.iter().collect::<Vec<_>>(),
            vec![b(0, 256, 0), b(256, 512, 256)]
        );
        f.check_invariants().unwrap();
        // Best fit may not return a range spanning both chunks.
        assert_eq!(f.take_best_fit(768), None);
    }

    #[test]
    fn best_fit_picks_smallest_then_lowest_address() {
        let mut f = FreeList::new();
        f.insert(b(0, 4096, 0));
        f.insert(b(8192, 1024, 8192));
        f.insert(b(16384, 1024, 16384));
        f.insert(b(32768, 2048, 32768));
        assert_eq!(f.best_fit(1000), Some(b(8192, 1024, 8192)));
        assert_eq!(f.take_best_fit(1024), Some(b(8192, 1024, 8192)));
        assert_eq!(f.take_best_fit(1024), Some(b(16384, 1024, 16384)));
        // Split from the high end; the remainder keeps its address.
        assert_eq!(f.take_best_fit(512), Some(b(32768 + 1536, 512, 32768)));
        assert_eq!(f.get(32768), Some(b(32768, 1536, 32768)));
        assert_eq!(f.take_best_fit(8192), None);
        assert_eq!(f.total_bytes(), 4096 + 1536);
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
        assert_eq!(
            f.iter().collect::<Vec<_>>(),
            vec![b(0, 1280, 0), b(4096, 256, 4096), b(8192, 256, 4096)]
        );
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
        /// model (a set of granules), and every take is a best fit.
        #[test]
        fn matches_a_granule_model(ops in prop::collection::vec((any::<bool>(), 0u64..64, 1u64..6), 1..200)) {
            const G: u64 = 256;
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
                    let best = runs.iter().filter(|r| r.1 * G >= want).min_by_key(|r| (r.1, r.0)).copied();
                    let got = free.take_best_fit(want);
                    match (best, got) {
                        (None, None) => {}
                        (Some((start, len)), Some(blk)) => {
                            prop_assert_eq!(blk.addr, (start + len) * G - want);
                            prop_assert_eq!(blk.size, want);
                            for k in 0..n {
                                model[(start + len - n + k) as usize] = false;
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
