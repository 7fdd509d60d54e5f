//! The pool's blocks, free and live, in one slab: boundary tags instead of address maps.
//!
//! Every block of every upstream chunk is a node linked to its neighbours in address order, so a
//! freed block finds the blocks it may coalesce with by following two links, not by looking up
//! hash maps; only the live-allocation map (which `deallocate` needs anyway, to reject double frees
//! and wrong sizes) is hashed. Each free list is a [`SizeIndex`] over the same slab: size classes
//! of one [`ALIGNMENT`] step up to 1 MiB, as stacks with a two-level bitmap of the non-empty ones,
//! and an ordered set above.
//!
//! This replaced a design with per-list hash maps from block start and end (some eight hash lookups
//! per operation, almost all of them cache misses with ~100k blocks); see
//! `crates/mempool-suballoc/benches/RESULTS-host.md`.

use std::collections::BTreeSet;

use super::addr_map::SlotMap;
use super::free_list::{class_of, first_class_from, new_slot, SMALL_CLASSES, SMALL_MAX};
use crate::error::{ensure, InvariantViolation};
use crate::free_list::Block;
use crate::types::ALIGNMENT;

/// No neighbour (the block starts or ends its chunk).
const NIL: u32 = u32::MAX;
/// `Node::owner` of a live block.
const LIVE: u32 = u32::MAX - 1;
/// `Node::owner` of a slot that holds no block.
const VACANT: u32 = u32::MAX;

/// One block of an upstream chunk.
#[derive(Debug, Clone, Copy)]
struct Node {
    addr: u64,
    size: u64,
    /// Start of the upstream chunk the block belongs to.
    chunk: u64,
    /// The blocks just before and after in address order, within the same chunk.
    prev: u32,
    next: u32,
    /// The free list holding the block, [`LIVE`] or [`VACANT`].
    owner: u32,
    /// Free small blocks: the position in its size class's stack. Live blocks: the tag given to
    /// [`BlockTable::allocate_from`] (the arena engine's arena number).
    pos: u32,
}

impl Node {
    #[inline]
    fn block(&self) -> Block {
        Block {
            addr: self.addr,
            size: self.size,
            chunk: self.chunk,
        }
    }
}

/// One free list's blocks, by size: exact best fit without a search.
///
/// Among free blocks of equal small size the most recently inserted is taken (its memory is the
/// likeliest to be in cache); among equal large sizes the lowest address.
#[derive(Debug, Default)]
pub(crate) struct SizeIndex {
    /// Per size class (`size / ALIGNMENT - 1`), the slots of the small blocks of exactly that size.
    /// Empty until the first small block arrives. Invariant: `nodes[classes[c][k]].pos == k`.
    classes: Vec<Vec<u32>>,
    /// Bit `c % 64` of word `c / 64` is set iff class `c` is non-empty.
    bits: Vec<u64>,
    /// Bit `w` is set iff `bits[w] != 0`.
    summary: u64,
    /// Blocks larger than `SMALL_MAX`, as `(size, addr, slot)`.
    large: BTreeSet<(u64, u64, u32)>,
    len: usize,
    total: u64,
}

impl SizeIndex {
    /// Number of free blocks.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the list holds no block.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sum of the free blocks' sizes.
    #[inline]
    pub(crate) fn total_bytes(&self) -> u64 {
        self.total
    }

    /// The slot of the smallest block of at least `size` bytes.
    #[inline]
    pub(crate) fn find(&self, size: u64) -> Option<u32> {
        if size <= SMALL_MAX {
            if let Some(c) = first_class_from(&self.bits, self.summary, class_of(size)) {
                return self.classes[c].last().copied();
            }
        }
        self.large.range((size, 0, 0)..).next().map(|&(_, _, slot)| slot)
    }

    #[inline]
    fn insert(&mut self, nodes: &mut [Node], slot: u32) {
        let n = &mut nodes[slot as usize];
        self.len += 1;
        self.total += n.size;
        if n.size > SMALL_MAX {
            self.large.insert((n.size, n.addr, slot));
            return;
        }
        if self.classes.is_empty() {
            self.classes = vec![Vec::new(); SMALL_CLASSES];
            self.bits = vec![0; SMALL_CLASSES / 64];
        }
        let c = class_of(n.size);
        let stack = &mut self.classes[c];
        n.pos = stack.len() as u32;
        stack.push(slot);
        self.bits[c / 64] |= 1 << (c % 64);
        self.summary |= 1 << (c / 64);
    }

    #[inline]
    fn remove(&mut self, nodes: &mut [Node], slot: u32) {
        let Node { addr, size, pos, .. } = nodes[slot as usize];
        self.len -= 1;
        self.total -= size;
        if size > SMALL_MAX {
            self.large.remove(&(size, addr, slot));
            return;
        }
        let c = class_of(size);
        let stack = &mut self.classes[c];
        stack.swap_remove(pos as usize);
        if let Some(&moved) = stack.get(pos as usize) {
            nodes[moved as usize].pos = pos;
        }
        if stack.is_empty() {
            self.bits[c / 64] &= !(1 << (c % 64));
            if self.bits[c / 64] == 0 {
                self.summary &= !(1 << (c / 64));
            }
        }
    }

    /// Every slot in the index, in no particular order.
    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let small = self.bits.iter().enumerate().flat_map(move |(w, &word)| {
            let mut word = word;
            std::iter::from_fn(move || {
                (word != 0).then(|| {
                    let c = w * 64 + word.trailing_zeros() as usize;
                    word &= word - 1;
                    c
                })
            })
            .flat_map(move |c| self.classes[c].iter().copied())
        });
        small.chain(self.large.iter().map(|&(_, _, slot)| slot))
    }

    /// Empties the index, returning its slots; keeps the class stacks' allocations.
    fn drain(&mut self) -> Vec<u32> {
        let slots: Vec<u32> = self.slots().collect();
        for (w, word) in self.bits.iter_mut().enumerate() {
            while *word != 0 {
                let c = w * 64 + word.trailing_zeros() as usize;
                *word &= *word - 1;
                self.classes[c].clear();
            }
        }
        self.summary = 0;
        self.large.clear();
        self.len = 0;
        self.total = 0;
        slots
    }

    /// Checks the index against the slab: every slot filed once, in the right class, owned by
    /// `owner`, with the right position; bitmaps and totals consistent.
    fn check(&self, nodes: &[Node], owner: u32) -> Result<(), InvariantViolation> {
        let mut count = 0usize;
        let mut total = 0u64;
        for (c, stack) in self.classes.iter().enumerate() {
            let bit = self.bits[c / 64] >> (c % 64) & 1 == 1;
            ensure!(
                bit != stack.is_empty(),
                "size index: class {c}'s bit disagrees with its stack"
            );
            for (k, &slot) in stack.iter().enumerate() {
                let n = nodes.get(slot as usize);
                ensure!(
                    n.is_some_and(|n| n.owner == owner
                        && n.size <= SMALL_MAX
                        && class_of(n.size) == c
                        && n.pos as usize == k),
                    "size index: slot {slot} is misfiled in class {c} of list {owner}"
                );
                count += 1;
                total += nodes[slot as usize].size;
            }
        }
        for (w, &word) in self.bits.iter().enumerate() {
            ensure!(
                (self.summary >> w & 1 == 1) == (word != 0),
                "size index: summary bit {w} is wrong"
            );
        }
        for &(size, addr, slot) in &self.large {
            let n = nodes.get(slot as usize);
            ensure!(
                size > SMALL_MAX && n.is_some_and(|n| n.owner == owner && n.addr == addr && n.size == size),
                "size index: large entry ({size}, {addr:#x}) of list {owner} does not match its slot"
            );
            count += 1;
            total += size;
        }
        ensure!(
            count == self.len && total == self.total,
            "size index: list {owner} counts {} blocks of {} bytes, holds {count} of {total}",
            self.len,
            self.total
        );
        Ok(())
    }
}

/// The slab of blocks and the live-allocation map; the free lists' [`SizeIndex`]es index into it.
///
/// Free lists are named by a `u32` owner (the engine's list number). Two free blocks coalesce only
/// when they touch, belong to the same chunk (the address links never cross chunks) and sit in the
/// same list: a block in another stream's list is not ordered after this stream's work.
#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    /// Invariants: the non-vacant nodes of a chunk form one chain through `prev`/`next` that tiles
    /// the chunk exactly, in address order; no two neighbours are free in the same list (they would
    /// have been merged); a node is in exactly one of `vacant`, `live` and a size index.
    nodes: Vec<Node>,
    vacant: Vec<u32>,
    /// Live allocations: address -> slot.
    live: SlotMap,
}

impl BlockTable {
    fn new_slot(&mut self, node: Node) -> u32 {
        new_slot(&mut self.nodes, &mut self.vacant, node)
    }

    #[inline]
    fn vacate(&mut self, slot: u32) {
        self.nodes[slot as usize].owner = VACANT;
        self.vacant.push(slot);
    }

    /// Live allocations.
    #[inline]
    pub(crate) fn live_len(&self) -> usize {
        self.live.len()
    }

    /// Adds a fresh upstream chunk as one free block of list `owner`; returns its slot.
    pub(crate) fn add_chunk(&mut self, index: &mut SizeIndex, owner: u32, addr: u64, size: u64) -> u32 {
        let slot = self.new_slot(Node {
            addr,
            size,
            chunk: addr,
            prev: NIL,
            next: NIL,
            owner,
            pos: 0,
        });
        index.insert(&mut self.nodes, slot);
        slot
    }

    /// Allocates `size` bytes (aligned, at most the block's size) from the high end of free block
    /// `slot` of `index`; the rest stays free in `index` at the same address. The live block keeps
    /// `tag` (see [`tag`](Self::tag)).
    #[inline]
    pub(crate) fn allocate_from(&mut self, index: &mut SizeIndex, slot: u32, size: u64, tag: u32) -> Block {
        index.remove(&mut self.nodes, slot);
        let n = self.nodes[slot as usize];
        debug_assert!(size <= n.size && n.owner != LIVE && n.owner != VACANT);
        let taken = if n.size == size {
            let node = &mut self.nodes[slot as usize];
            node.owner = LIVE;
            node.pos = tag;
            slot
        } else {
            let rest = n.size - size;
            let taken = self.new_slot(Node {
                addr: n.addr + rest,
                size,
                chunk: n.chunk,
                prev: slot,
                next: n.next,
                owner: LIVE,
                pos: tag,
            });
            if n.next != NIL {
                self.nodes[n.next as usize].prev = taken;
            }
            let rest_node = &mut self.nodes[slot as usize];
            rest_node.next = taken;
            rest_node.size = rest;
            index.insert(&mut self.nodes, slot);
            taken
        };
        let b = self.nodes[taken as usize].block();
        self.live.insert(b.addr, taken);
        b
    }

    /// The slot of the live allocation of `size` bytes at `addr`, if there is one.
    #[inline]
    pub(crate) fn live_slot(&self, addr: u64, size: u64) -> Option<u32> {
        self.live
            .get(addr)
            .filter(|&slot| self.nodes[slot as usize].size == size)
    }

    /// The tag a live block was allocated with.
    #[inline]
    pub(crate) fn tag(&self, slot: u32) -> u32 {
        self.nodes[slot as usize].pos
    }

    /// Whether the block in `slot` spans its whole chunk.
    #[inline]
    pub(crate) fn is_whole(&self, slot: u32) -> bool {
        let n = &self.nodes[slot as usize];
        n.prev == NIL && n.next == NIL
    }

    /// Removes the free block in `slot` (of `index`), which spans its whole chunk, and returns it.
    pub(crate) fn remove_whole(&mut self, index: &mut SizeIndex, slot: u32) -> Block {
        debug_assert!(self.is_whole(slot));
        index.remove(&mut self.nodes, slot);
        let b = self.nodes[slot as usize].block();
        self.vacate(slot);
        b
    }

    /// Removes the live allocation of `size` bytes at `addr` from the live map, returning its slot;
    /// `None` (changing nothing) when there is no such allocation.
    #[inline]
    pub(crate) fn take_live(&mut self, addr: u64, size: u64) -> Option<u32> {
        let slot = self.live.remove(addr)?;
        if self.nodes[slot as usize].size != size {
            self.live.insert(addr, slot);
            return None;
        }
        Some(slot)
    }

    /// Puts the block in `slot` (just taken from the live map, or drained from another list) into
    /// list `owner`, merging it with its neighbours that are free in the same list. Returns the slot
    /// of the merged free block.
    #[inline]
    pub(crate) fn insert_free(&mut self, index: &mut SizeIndex, owner: u32, slot: u32) -> u32 {
        let mut slot = slot;
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev != NIL && self.nodes[prev as usize].owner == owner {
            index.remove(&mut self.nodes, prev);
            let size = self.nodes[slot as usize].size;
            let p = &mut self.nodes[prev as usize];
            p.size += size;
            p.next = next;
            if next != NIL {
                self.nodes[next as usize].prev = prev;
            }
            self.vacate(slot);
            slot = prev;
        }
        if next != NIL && self.nodes[next as usize].owner == owner {
            index.remove(&mut self.nodes, next);
            let Node { size, next: after, .. } = self.nodes[next as usize];
            let n = &mut self.nodes[slot as usize];
            n.size += size;
            n.next = after;
            if after != NIL {
                self.nodes[after as usize].prev = slot;
            }
            self.vacate(next);
        }
        self.nodes[slot as usize].owner = owner;
        index.insert(&mut self.nodes, slot);
        slot
    }

    /// Moves every block of `from` into `into` (list `owner`), coalescing.
    pub(crate) fn move_all(&mut self, from: &mut SizeIndex, into: &mut SizeIndex, owner: u32) {
        // Every drained slot keeps its old owner until its turn, so no merge below can absorb a slot
        // that is still waiting to be moved.
        for slot in from.drain() {
            self.insert_free(into, owner, slot);
        }
    }

    /// Removes from `index` the free blocks that span a whole chunk and returns them.
    pub(crate) fn take_whole_chunks(&mut self, index: &mut SizeIndex) -> Vec<Block> {
        let whole: Vec<u32> = index
            .slots()
            .filter(|&s| {
                let n = &self.nodes[s as usize];
                n.prev == NIL && n.next == NIL
            })
            .collect();
        whole
            .into_iter()
            .map(|s| {
                index.remove(&mut self.nodes, s);
                let b = self.nodes[s as usize].block();
                self.vacate(s);
                b
            })
            .collect()
    }

    /// The blocks of `index`.
    pub(crate) fn free_blocks<'a>(&'a self, index: &'a SizeIndex) -> impl Iterator<Item = Block> + 'a {
        index.slots().map(|s| self.nodes[s as usize].block())
    }

    /// The live allocations.
    pub(crate) fn live_blocks(&self) -> impl Iterator<Item = Block> + '_ {
        self.live.iter().map(|(_, s)| self.nodes[s as usize].block())
    }

    /// Forgets every block.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Checks the slab against `lists` (each list's index with its owner number) and the chunks
    /// (start -> size): see the invariants on the fields.
    pub(crate) fn check<'a>(
        &self,
        lists: impl Iterator<Item = (u32, &'a SizeIndex)>,
        chunk_size: impl Fn(u64) -> Option<u64>,
    ) -> Result<(), InvariantViolation> {
        let mut free = 0usize;
        for (owner, index) in lists {
            index.check(&self.nodes, owner)?;
            free += index.len();
        }
        for (addr, slot) in self.live.iter() {
            ensure!(
                self.nodes
                    .get(slot as usize)
                    .is_some_and(|n| n.owner == LIVE && n.addr == addr),
                "block table: live entry {addr:#x} names slot {slot}, which is not that live block"
            );
        }
        let live_nodes = self.nodes.iter().filter(|n| n.owner == LIVE).count();
        let vacant_nodes = self.nodes.iter().filter(|n| n.owner == VACANT).count();
        ensure!(
            live_nodes == self.live.len()
                && vacant_nodes == self.vacant.len()
                && free + live_nodes + vacant_nodes == self.nodes.len(),
            "block table: {} slots: {live_nodes} live ({} in the map), {vacant_nodes} vacant ({} listed), {free} \
             indexed free",
            self.nodes.len(),
            self.live.len(),
            self.vacant.len()
        );
        for (i, n) in self.nodes.iter().enumerate() {
            if n.owner == VACANT {
                continue;
            }
            let slot = i as u32;
            ensure!(
                n.size > 0 && n.addr % ALIGNMENT == 0 && n.size % ALIGNMENT == 0,
                "block table: block {:?} is empty or unaligned",
                n.block()
            );
            match n.prev {
                NIL => ensure!(n.addr == n.chunk, "block table: {:?} has no predecessor", n.block()),
                p => {
                    let pn = self.nodes.get(p as usize);
                    ensure!(
                        pn.is_some_and(|pn| pn.owner != VACANT
                            && pn.next == slot
                            && pn.chunk == n.chunk
                            && pn.addr + pn.size == n.addr),
                        "block table: {:?} and its predecessor are not linked back to back",
                        n.block()
                    );
                    ensure!(
                        n.owner == LIVE || pn.is_some_and(|pn| pn.owner != n.owner),
                        "block table: {:?} and its predecessor are free in the same list but not merged",
                        n.block()
                    );
                }
            }
            if n.next == NIL {
                ensure!(
                    chunk_size(n.chunk).is_some_and(|size| n.addr + n.size == n.chunk + size),
                    "block table: {:?} ends its chain before its chunk ends",
                    n.block()
                );
            }
        }
        Ok(())
    }
}
