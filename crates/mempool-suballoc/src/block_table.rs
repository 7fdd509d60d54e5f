//! The pool's blocks, free and live, in one slab: boundary tags instead of address maps.
//!
//! Every block of every upstream chunk is a node (one 64-byte cache line) linked to its neighbours
//! in address order, so a freed block finds the blocks it may coalesce with by following two links,
//! not by looking up hash maps; only the live-allocation map (which `deallocate` needs anyway, to
//! reject double frees and wrong sizes, and which gives the freed block's node) is hashed: a
//! [`ChainTable`] of 4-byte chain heads whose chains run through the live nodes themselves, small
//! enough (256 KiB with ~100k live blocks) to stay mostly in a core's L2 cache. Each free list is a
//! [`SizeIndex`] over the same slab: TLSF classes (two-level bitmaps, constant time at every size)
//! whose lists are threaded through the nodes. Each node also carries a hint about the block before
//! it (TLSF's "previous free" bit: [`Node::prev_owner`]) and its size class.
//!
//! What a free costs, in cache lines: the live map's bucket (usually cached), the block's node (and
//! on average fewer than one other live node of the same chain, usually a recent one, so cached),
//! the block after it, the block before it only when the hint says it may merge, and for each
//! neighbour merged its two class-list neighbours (and, merging with the block after, the block
//! after that, relinked); an allocation: the class head (whose node it splits), a vacant slot for
//! the allocated block, the node after it (relinked) and the live map's bucket. A split whose
//! remainder stays in its class (most splits of large blocks) touches no class list.
//!
//! This replaced, in turn, a design with per-list hash maps from block start and end (some eight
//! hash lookups per operation, almost all of them cache misses with ~100k blocks), one with exact
//! size classes as stacks below 1 MiB, an ordered set above and a 16-byte-entry live map, and one
//! with an open-addressed live map of 8-byte entries (2 MiB with ~100k live blocks, about one
//! more cache miss per free) and no hint; see `crates/mempool-suballoc/benches/RESULTS-host.md`.

use super::addr_map::{ChainSlots, ChainTable, CHAIN_END};
use crate::block::Block;
use crate::error::{ensure, InvariantViolation};
use crate::types::ALIGNMENT;

/// No neighbour (the block starts or ends its chunk), or the end of a class list.
const NIL: u32 = u32::MAX;
/// `Node::owner` of a live block.
const LIVE: u32 = u32::MAX - 1;
/// `Node::owner` of a slot that holds no block.
const VACANT: u32 = u32::MAX;

/// Second-level classes per first level: `2^SL_BITS`, one bitmap word.
const SL_BITS: u32 = 6;
/// Sizes of fewer than `2^SL_BITS` granules have exact classes (first level 0).
const SL_COUNT: u64 = 1 << SL_BITS;
/// First levels: level 0 (exact classes) and one per power of two from `2^SL_BITS` granules up to
/// `2^56` granules (2^64 bytes).
const FL_COUNT: usize = 64 - ALIGNMENT.trailing_zeros() as usize - SL_BITS as usize + 1;
/// Size classes in all.
const CLASSES: usize = FL_COUNT << SL_BITS;

/// The TLSF class of a block of `size` bytes (a non-zero multiple of [`ALIGNMENT`]): with `g = size /
/// ALIGNMENT` granules, class `g` for `g < 64`; above, first level `log2(g) - 5` and second level the
/// six bits of `g` below its leading one. Every block of a class is at least the class's lower bound
/// and less than the next class's.
#[inline]
fn class_of(size: u64) -> usize {
    class_of_granules(size / ALIGNMENT)
}

#[inline]
fn class_of_granules(g: u64) -> usize {
    if g < SL_COUNT {
        return g as usize;
    }
    let l = 63 - g.leading_zeros();
    let fl = (l - SL_BITS + 1) as usize;
    let sl = ((g >> (l - SL_BITS)) & (SL_COUNT - 1)) as usize;
    (fl << SL_BITS) | sl
}

/// The lowest class every block of which holds `size` bytes (a non-zero multiple of
/// [`ALIGNMENT`]): the class of `size` rounded up to a class boundary. May be [`CLASSES`] or more
/// (no class fits) for sizes within 1/64 of 2^64.
#[inline]
fn fitting_class(size: u64) -> usize {
    let g = size / ALIGNMENT;
    if g < SL_COUNT {
        return g as usize;
    }
    let step = 1u64 << (63 - g.leading_zeros() - SL_BITS);
    // At most 2^56 granules plus less than a step: no overflow.
    class_of_granules((g + step - 1) & !(step - 1))
}

/// One block of an upstream chunk, on a cache line of its own: a free or an allocation reads one
/// line per block it touches.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
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
    /// Live blocks: the tag given to [`BlockTable::allocate_from`] (the arena engine's arena number).
    tag: u32,
    /// Free blocks: the neighbours in the size class's list. `lprev` is meaningful only when the
    /// block is not the list's head (the head's is stale, so that taking the head writes no other
    /// node).
    lprev: u32,
    lnext: u32,
    /// Live blocks: the next slot of the live map's chain (see [`ChainTable`]).
    hnext: u32,
    /// A hint about the block before (`prev`): whenever that block is free, this is its list
    /// (otherwise anything). So a free whose hint does not name its own list does not read the
    /// block before, which cannot merge (TLSF's "previous free" bit: only the block after is read
    /// on every free, and it is the one kept informed).
    prev_owner: u32,
    /// Free blocks: the size class whose list holds the block (`class_of(size)`, kept so that
    /// taking the block out of its list does not compute it again).
    class: u32,
}

// One cache line per node: a free or an allocation reads one line per block it touches.
const _: () = assert!(std::mem::size_of::<Node>() == 64);

impl ChainSlots for [Node] {
    #[inline]
    fn key(&self, slot: u32) -> u64 {
        self[slot as usize].addr
    }

    #[inline]
    fn link(&self, slot: u32) -> u32 {
        self[slot as usize].hnext
    }

    #[inline]
    fn set_link(&mut self, slot: u32, next: u32) {
        self[slot as usize].hnext = next;
    }
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

/// One free list's blocks, by size: TLSF (two-level segregated fit) classes, constant time.
///
/// The classes: one per size up to 63 granules of [`ALIGNMENT`] (16 KiB), then 64 per power of
/// two, so a class spans 1/64 of its lower bound. Each class is a doubly linked list threaded
/// through the block table's nodes (most recently freed first); a bitmap word per first level marks
/// the non-empty classes and a summary word the non-empty levels, so the first non-empty class at or
/// above a given one is two bit scans.
///
/// A request is served from the head of the request's own class when that block is large enough
/// (blocks of one class differ by less than 1/64), else from the first non-empty class whose every
/// block fits, else from any block of its own class that fits (a walk of that class, only when the
/// alternative is to report no fit): a good fit, not always the best (the head of the first fitting
/// class, which may be larger than a block of the request's own class further down its list), and
/// a fit whenever any free block of the list is large enough.
#[derive(Debug)]
pub(crate) struct SizeIndex {
    /// Per class, the first slot of its list, or [`NIL`]. Empty until the first block arrives.
    heads: Box<[u32]>,
    /// Bit `sl` of `bits[fl]` is set iff class `fl * 64 + sl` is non-empty.
    bits: [u64; FL_COUNT],
    /// Bit `fl` is set iff `bits[fl] != 0`.
    summary: u64,
    len: usize,
    total: u64,
}

impl Default for SizeIndex {
    fn default() -> Self {
        Self {
            heads: Box::default(),
            bits: [0; FL_COUNT],
            summary: 0,
            len: 0,
            total: 0,
        }
    }
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

    /// The first non-empty class at or above `c`.
    #[inline]
    fn first_class_from(&self, c: usize) -> Option<usize> {
        let fl = c >> SL_BITS;
        if fl >= FL_COUNT {
            return None;
        }
        let here = self.bits[fl] & (!0u64 << (c & (SL_COUNT as usize - 1)));
        if here != 0 {
            return Some((fl << SL_BITS) | here.trailing_zeros() as usize);
        }
        let above = self.summary & (!0u64).checked_shl(fl as u32 + 1).unwrap_or(0);
        (above != 0).then(|| {
            let fl = above.trailing_zeros() as usize;
            (fl << SL_BITS) | self.bits[fl].trailing_zeros() as usize
        })
    }

    #[inline]
    fn mark(&mut self, c: usize) {
        self.bits[c >> SL_BITS] |= 1 << (c & (SL_COUNT as usize - 1));
        self.summary |= 1 << (c >> SL_BITS);
    }

    #[inline]
    fn unmark(&mut self, c: usize) {
        let fl = c >> SL_BITS;
        self.bits[fl] &= !(1 << (c & (SL_COUNT as usize - 1)));
        if self.bits[fl] == 0 {
            self.summary &= !(1 << fl);
        }
    }

    /// Files `slot` at the head of its class; does not count it (see [`insert`](Self::insert)).
    #[inline(always)]
    fn link(&mut self, nodes: &mut [Node], slot: u32) {
        if self.heads.is_empty() {
            self.heads = vec![NIL; CLASSES].into_boxed_slice();
        }
        let c = class_of(nodes[slot as usize].size);
        let head = self.heads[c];
        let node = &mut nodes[slot as usize];
        node.lnext = head;
        node.class = c as u32;
        if head != NIL {
            nodes[head as usize].lprev = slot;
        } else {
            self.mark(c);
        }
        self.heads[c] = slot;
    }

    /// Takes `slot` out of its class; does not uncount it.
    #[inline(always)]
    fn unlink(&mut self, nodes: &mut [Node], slot: u32) {
        let Node {
            class, lprev, lnext, ..
        } = nodes[slot as usize];
        let c = class as usize;
        if self.heads[c] == slot {
            // The new head's `lprev` goes stale, which a head's may.
            self.heads[c] = lnext;
            if lnext == NIL {
                self.unmark(c);
            }
        } else {
            nodes[lprev as usize].lnext = lnext;
            if lnext != NIL {
                nodes[lnext as usize].lprev = lprev;
            }
        }
    }

    #[inline]
    fn insert(&mut self, nodes: &mut [Node], slot: u32) {
        self.len += 1;
        self.total += nodes[slot as usize].size;
        self.link(nodes, slot);
    }

    #[inline]
    fn remove(&mut self, nodes: &mut [Node], slot: u32) {
        self.len -= 1;
        self.total -= nodes[slot as usize].size;
        self.unlink(nodes, slot);
    }

    /// Every slot in the index, in no particular order.
    fn slots<'a>(&'a self, nodes: &'a [Node]) -> impl Iterator<Item = u32> + 'a {
        self.bits.iter().enumerate().flat_map(move |(fl, &word)| {
            let mut word = word;
            std::iter::from_fn(move || {
                (word != 0).then(|| {
                    let c = (fl << SL_BITS) | word.trailing_zeros() as usize;
                    word &= word - 1;
                    c
                })
            })
            .flat_map(move |c| {
                let mut slot = self.heads[c];
                std::iter::from_fn(move || {
                    (slot != NIL).then(|| {
                        let s = slot;
                        slot = nodes[s as usize].lnext;
                        s
                    })
                })
            })
        })
    }

    /// Empties the index, returning its slots; keeps the class heads' allocation.
    fn drain(&mut self, nodes: &[Node]) -> Vec<u32> {
        let slots: Vec<u32> = self.slots(nodes).collect();
        for fl in 0..FL_COUNT {
            while self.bits[fl] != 0 {
                let c = (fl << SL_BITS) | self.bits[fl].trailing_zeros() as usize;
                self.bits[fl] &= self.bits[fl] - 1;
                self.heads[c] = NIL;
            }
        }
        self.summary = 0;
        self.len = 0;
        self.total = 0;
        slots
    }

    /// Checks the index against the slab: every slot filed once, in the right class, owned by
    /// `owner`, linked both ways; bitmaps and totals consistent.
    fn check(&self, nodes: &[Node], owner: u32) -> Result<(), InvariantViolation> {
        let mut count = 0usize;
        let mut total = 0u64;
        for (c, &head) in self.heads.iter().enumerate() {
            let bit = self.bits[c >> SL_BITS] >> (c & (SL_COUNT as usize - 1)) & 1 == 1;
            ensure!(
                bit == (head != NIL),
                "size index: class {c}'s bit disagrees with its list"
            );
            let (mut prev, mut slot) = (NIL, head);
            while slot != NIL {
                let n = nodes.get(slot as usize);
                ensure!(
                    n.is_some_and(|n| n.owner == owner
                        && class_of(n.size) == c
                        && n.class as usize == c
                        && (prev == NIL || n.lprev == prev)),
                    "size index: slot {slot} is misfiled or mislinked in class {c} of list {owner}"
                );
                ensure!(count <= nodes.len(), "size index: class {c} of list {owner} loops");
                count += 1;
                total += nodes[slot as usize].size;
                prev = slot;
                slot = nodes[slot as usize].lnext;
            }
        }
        ensure!(
            !self.heads.is_empty() || self.bits.iter().all(|&w| w == 0),
            "size index: list {owner} marks classes but has none"
        );
        for (fl, &word) in self.bits.iter().enumerate() {
            ensure!(
                (self.summary >> fl & 1 == 1) == (word != 0),
                "size index: summary bit {fl} is wrong"
            );
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
    /// Live allocations: address -> slot, chained through the live nodes' `hnext`.
    live: ChainTable,
}

impl BlockTable {
    fn new_slot(&mut self, node: Node) -> u32 {
        new_slot_in(&mut self.nodes, &mut self.vacant, node)
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

    /// The slot of a free block of `index` that holds `size` bytes (a non-zero multiple of
    /// [`ALIGNMENT`]): the head of the request's own class when it is large enough, else the head
    /// of the first non-empty class whose every block fits, else (before giving up) any block of
    /// the request's own class that fits (see [`SizeIndex`]). `None` only when no block of `index`
    /// holds `size` bytes.
    #[inline(always)]
    pub(crate) fn find(&self, index: &SizeIndex, size: u64) -> Option<u32> {
        if index.is_empty() {
            return None;
        }
        let own = class_of(size);
        let fit = fitting_class(size);
        if own != fit {
            let head = index.heads[own];
            if head != NIL && self.nodes[head as usize].size >= size {
                return Some(head);
            }
        }
        match index.first_class_from(fit) {
            Some(c) => Some(index.heads[c]),
            None if own != fit => self.scan_class(index, own, size),
            None => None,
        }
    }

    /// The first block of class `c` of `index` that holds `size` bytes: a walk of the class, taken
    /// only when no higher class has a block (the alternative is growing from the upstream).
    #[cold]
    fn scan_class(&self, index: &SizeIndex, c: usize, size: u64) -> Option<u32> {
        let mut slot = index.heads[c];
        while slot != NIL {
            let n = &self.nodes[slot as usize];
            if n.size >= size {
                return Some(slot);
            }
            slot = n.lnext;
        }
        None
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
            tag: 0,
            lprev: NIL,
            lnext: NIL,
            hnext: CHAIN_END,
            prev_owner: LIVE,
            class: 0,
        });
        index.insert(&mut self.nodes, slot);
        slot
    }

    /// Allocates `size` bytes (aligned, at most the block's size) from the high end of free block
    /// `slot` of `index`; the rest stays free in `index` at the same address (and in the same slot).
    /// The live block keeps `tag` (see [`tag`](Self::tag)).
    #[inline(always)]
    pub(crate) fn allocate_from(&mut self, index: &mut SizeIndex, slot: u32, size: u64, tag: u32) -> Block {
        let n = self.nodes[slot as usize];
        debug_assert!(size <= n.size && n.owner != LIVE && n.owner != VACANT);
        let taken = if n.size == size {
            index.remove(&mut self.nodes, slot);
            let node = &mut self.nodes[slot as usize];
            node.owner = LIVE;
            node.tag = tag;
            slot
        } else {
            let rest = n.size - size;
            index.total -= size;
            if class_of(rest) == n.class as usize {
                // Still in its class: the list stays as it is.
                self.nodes[slot as usize].size = rest;
            } else {
                index.unlink(&mut self.nodes, slot);
                self.nodes[slot as usize].size = rest;
                index.link(&mut self.nodes, slot);
            }
            let taken = self.new_slot(Node {
                addr: n.addr + rest,
                size,
                chunk: n.chunk,
                prev: slot,
                next: n.next,
                owner: LIVE,
                tag,
                lprev: NIL,
                lnext: NIL,
                hnext: CHAIN_END,
                // The remainder before it is free in the list.
                prev_owner: n.owner,
                class: 0,
            });
            if n.next != NIL {
                let after = &mut self.nodes[n.next as usize];
                after.prev = taken;
                after.prev_owner = LIVE;
            }
            self.nodes[slot as usize].next = taken;
            taken
        };
        let b = self.nodes[taken as usize].block();
        self.live.insert(&mut self.nodes[..], b.addr, taken);
        b
    }

    /// The slot of the live allocation of `size` bytes at `addr`, if there is one.
    #[inline]
    pub(crate) fn live_slot(&self, addr: u64, size: u64) -> Option<u32> {
        self.live
            .get(&self.nodes[..], addr)
            .filter(|&slot| self.nodes[slot as usize].size == size)
    }

    /// The tag a live block was allocated with.
    #[inline]
    pub(crate) fn tag(&self, slot: u32) -> u32 {
        self.nodes[slot as usize].tag
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
        self.live
            .remove_if(&mut self.nodes[..], addr, |nodes, s| nodes[s as usize].size == size)
    }

    /// [`take_live`](Self::take_live) for an allocation made with `tag` only: `None` (changing
    /// nothing) for one made with another tag.
    #[inline]
    pub(crate) fn take_live_tagged(&mut self, addr: u64, size: u64, tag: u32) -> Option<u32> {
        self.live.remove_if(&mut self.nodes[..], addr, |nodes, s| {
            let n = &nodes[s as usize];
            n.size == size && n.tag == tag
        })
    }

    /// Live allocations with their tags.
    pub(crate) fn live_tagged(&self) -> impl Iterator<Item = (Block, u32)> + '_ {
        self.live
            .slots(&self.nodes[..])
            .map(|s| (self.nodes[s as usize].block(), self.nodes[s as usize].tag))
    }

    /// Puts the live allocation in `slot` back into the live map: for a caller that took it out
    /// with [`take_live`](Self::take_live) and then could not complete the free (nothing else may
    /// have touched the block in between).
    #[cold]
    pub(crate) fn restore_live(&mut self, slot: u32) {
        debug_assert_eq!(self.nodes[slot as usize].owner, LIVE);
        let addr = self.nodes[slot as usize].addr;
        self.live.insert(&mut self.nodes[..], addr, slot);
    }

    /// Puts the block in `slot` (just taken from the live map, or drained from another list) into
    /// list `owner`, merging it with its neighbours that are free in the same list. Returns the slot
    /// of the merged free block.
    #[inline(always)]
    pub(crate) fn insert_free(&mut self, index: &mut SizeIndex, owner: u32, slot: u32) -> u32 {
        let mut slot = slot;
        let Node {
            prev, next, prev_owner, ..
        } = self.nodes[slot as usize];
        // The block before is read only when its hint says it may be free in `owner` (see
        // `Node::prev_owner`); the block after always, and told that its predecessor is now free.
        if prev != NIL && prev_owner == owner && self.nodes[prev as usize].owner == owner {
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
        if next != NIL {
            if self.nodes[next as usize].owner == owner {
                index.remove(&mut self.nodes, next);
                let Node { size, next: after, .. } = self.nodes[next as usize];
                let n = &mut self.nodes[slot as usize];
                n.size += size;
                n.next = after;
                if after != NIL {
                    // Its `prev_owner` already names `owner`: the block before it was free there.
                    self.nodes[after as usize].prev = slot;
                }
                self.vacate(next);
            } else {
                self.nodes[next as usize].prev_owner = owner;
            }
        }
        self.nodes[slot as usize].owner = owner;
        index.insert(&mut self.nodes, slot);
        slot
    }

    /// Moves every block of `from` into `into` (list `owner`), coalescing.
    pub(crate) fn move_all(&mut self, from: &mut SizeIndex, into: &mut SizeIndex, owner: u32) {
        // Every drained slot keeps its old owner until its turn, so no merge below can absorb a slot
        // that is still waiting to be moved.
        for slot in from.drain(&self.nodes) {
            self.insert_free(into, owner, slot);
        }
    }

    /// Removes from `index` the free blocks that span a whole chunk and returns them.
    pub(crate) fn take_whole_chunks(&mut self, index: &mut SizeIndex) -> Vec<Block> {
        let whole: Vec<u32> = index
            .slots(&self.nodes)
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
        index.slots(&self.nodes).map(|s| self.nodes[s as usize].block())
    }

    /// The live allocations.
    pub(crate) fn live_blocks(&self) -> impl Iterator<Item = Block> + '_ {
        self.live_tagged().map(|(b, _)| b)
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
        self.live.check(&self.nodes[..], self.nodes.len())?;
        for slot in self.live.slots(&self.nodes[..]) {
            ensure!(
                self.nodes[slot as usize].owner == LIVE,
                "block table: the live map names slot {slot}, which is not live"
            );
            let addr = self.nodes[slot as usize].addr;
            let found = self.live.get(&self.nodes[..], addr);
            ensure!(
                found == Some(slot),
                "block table: the live map finds {found:?} for {addr:#x}, the address of its slot {slot}"
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
            match n.next {
                NIL => ensure!(
                    chunk_size(n.chunk).is_some_and(|size| n.addr + n.size == n.chunk + size),
                    "block table: {:?} ends its chain before its chunk ends",
                    n.block()
                ),
                // (The block after is checked to link back when its turn comes.)
                a => ensure!(
                    n.owner == LIVE || self.nodes.get(a as usize).is_some_and(|a| a.prev_owner == n.owner),
                    "block table: {:?} is free in list {} but the block after it does not say so",
                    n.block(),
                    n.owner
                ),
            }
        }
        Ok(())
    }
}

/// Stores `node` in a vacant slot of `nodes` (listed in `vacant`), or a new one; returns the slot.
#[inline]
fn new_slot_in<T>(nodes: &mut Vec<T>, vacant: &mut Vec<u32>, node: T) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;
    /// `(start, size)`: two chunks back to back (blocks must not merge across them) and one far away.
    const CHUNKS: [(u64, u64); 3] = [(16 * MIB, 4 * MIB), (20 * MIB, MIB), (1 << 40, 256 * MIB)];
    const LISTS: usize = 3;

    #[derive(Debug, Clone)]
    enum Op {
        /// Allocate this many granules from list `usize`.
        Alloc(usize, u64),
        /// Free the live block at this index (modulo the count) into list `usize`.
        Free(usize, usize),
        /// Move every block of the first list into the second.
        Move(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let granules = prop_oneof![1u64..64, 64u64..4096, 4096u64..(1 << 20)];
        prop_oneof![
            5 => (0..LISTS, granules).prop_map(|(l, g)| Op::Alloc(l, g)),
            4 => (0..LISTS, any::<usize>()).prop_map(|(l, k)| Op::Free(l, k)),
            1 => (0..LISTS, 0..LISTS).prop_map(|(a, b)| Op::Move(a, b)),
        ]
    }

    #[test]
    fn classes_bound_their_blocks() {
        // Every size's class lies between the fitting classes of its neighbours' sizes, and every
        // block of the fitting class of a size holds it.
        for g in (1u64..5000).chain([(1 << 20) - 1, 1 << 20, (1 << 20) + 1, 1 << 55, (1 << 56) - 1]) {
            let size = g * ALIGNMENT;
            let (c, f) = (class_of(size), fitting_class(size));
            assert!(c <= f && f <= c + 1, "{g} granules: class {c}, fitting class {f}");
            if let Some(next) = size.checked_add(ALIGNMENT) {
                assert!(class_of(next) >= c, "classes are monotonic at {g} granules");
            }
            // The lowest size in class `f` holds `size` (classes span at most 1/64 of their start).
            if g < 1 << 20 {
                let lowest =
                    (g.saturating_sub(g / 32 + 1).max(1)..=g + g / 32 + 1).find(|&h| class_of(h * ALIGNMENT) == f);
                assert!(
                    lowest.is_some_and(|h| h >= g),
                    "{g} granules: class {f} starts at {lowest:?}"
                );
            }
        }
        assert!(class_of(!(ALIGNMENT - 1)) < CLASSES);
    }

    #[test]
    fn finds_a_fitting_block_below_the_head_of_its_class() {
        // 200 and 201 granules share a class (two granules wide); the head (the last inserted) is
        // the smaller. A request of 201 granules fits only the other one, and no higher class holds
        // a block: `find` must still find it rather than report no fit.
        let mut table = BlockTable::default();
        let mut list = SizeIndex::default();
        let (g200, g201) = (200 * ALIGNMENT, 201 * ALIGNMENT);
        assert_eq!(class_of(g200), class_of(g201));
        let big = table.add_chunk(&mut list, 0, 1 << 30, g201);
        table.add_chunk(&mut list, 0, 1 << 31, g200);
        assert_eq!(table.find(&list, g201), Some(big));
        assert_eq!(table.find(&list, 202 * ALIGNMENT), None);
        // The head serves what it holds.
        assert_ne!(table.find(&list, g200), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Random allocations, frees and list moves on the block table against a model of the live
        /// blocks: the table's invariants hold (blocks tile the chunks, class lists intact, no two
        /// free neighbours of one list unmerged); live blocks never overlap and fit their requests;
        /// `find` fails only when no free block of the list is large enough; free blocks of one list
        /// never touch within a chunk (coalescing complete).
        #[test]
        fn matches_a_model(ops in prop::collection::vec(op(), 1..300)) {
            let mut table = BlockTable::default();
            let mut lists: Vec<SizeIndex> = (0..LISTS).map(|_| SizeIndex::default()).collect();
            for (k, &(addr, size)) in CHUNKS.iter().enumerate() {
                table.add_chunk(&mut lists[k % LISTS], (k % LISTS) as u32, addr, size);
            }
            let chunk_size = |c: u64| CHUNKS.iter().find(|&&(a, _)| a == c).map(|&(_, s)| s);
            // (addr, size, tag) of every live block.
            let mut live: Vec<(u64, u64, u32)> = Vec::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Alloc(l, g) => {
                        let size = g * ALIGNMENT;
                        let largest = table.free_blocks(&lists[l]).map(|b| b.size).max().unwrap_or(0);
                        match table.find(&lists[l], size) {
                            None => prop_assert!(largest < size, "step {step}: no fit for {size} in list {l}, which holds {largest}"),
                            Some(slot) => {
                                let from = table.nodes[slot as usize].block();
                                prop_assert!(from.size >= size && table.nodes[slot as usize].owner == l as u32);
                                let b = table.allocate_from(&mut lists[l], slot, size, step as u32);
                                prop_assert_eq!((b.addr, b.size, b.chunk), (from.end() - size, size, from.chunk));
                                for &(a, s, _) in &live {
                                    prop_assert!(b.end() <= a || a + s <= b.addr, "step {step}: {b:?} overlaps live {a:#x}+{s}");
                                }
                                live.push((b.addr, b.size, step as u32));
                            }
                        }
                    }
                    Op::Free(l, k) => {
                        if live.is_empty() {
                            continue;
                        }
                        let (addr, size, tag) = live.swap_remove(k % live.len());
                        // The wrong size names no allocation and changes nothing.
                        prop_assert_eq!(table.take_live(addr, size + ALIGNMENT), None);
                        prop_assert_eq!(table.live_slot(addr, size).map(|s| table.tag(s)), Some(tag));
                        let slot = table.take_live(addr, size);
                        prop_assert!(slot.is_some(), "step {step}: live block {addr:#x}+{size} not found");
                        table.insert_free(&mut lists[l], l as u32, slot.unwrap());
                        prop_assert_eq!(table.take_live(addr, size), None);
                    }
                    Op::Move(a, b) => {
                        if a != b {
                            let mut from = std::mem::take(&mut lists[a]);
                            table.move_all(&mut from, &mut lists[b], b as u32);
                            prop_assert!(from.is_empty());
                            lists[a] = from;
                        }
                    }
                }
                let checked = table.check(lists.iter().enumerate().map(|(i, l)| (i as u32, l)), chunk_size);
                prop_assert!(checked.is_ok(), "step {step}: {checked:?}");
                prop_assert_eq!(table.live_len(), live.len());
                let mut in_table: Vec<(u64, u64)> = table.live_blocks().map(|b| (b.addr, b.size)).collect();
                let mut in_model: Vec<(u64, u64)> = live.iter().map(|&(a, s, _)| (a, s)).collect();
                in_table.sort_unstable();
                in_model.sort_unstable();
                prop_assert_eq!(in_table, in_model);
                for (i, list) in lists.iter().enumerate() {
                    let mut free: Vec<Block> = table.free_blocks(list).collect();
                    free.sort_unstable_by_key(|b| b.addr);
                    prop_assert_eq!(free.iter().map(|b| b.size).sum::<u64>(), list.total_bytes());
                    for w in free.windows(2) {
                        prop_assert!(
                            !(w[0].end() == w[1].addr && w[0].chunk == w[1].chunk),
                            "step {step}: free blocks {:?} and {:?} of list {i} touch", w[0], w[1]
                        );
                    }
                }
            }
        }
    }
}
