//! Hash maps keyed by block address, with a hasher that costs a multiply.
//!
//! Every engine keeps its live allocations in such a map so that `deallocate` can reject double
//! frees and wrong sizes in O(1). SipHash (the std default) guards against hash flooding, which
//! cannot happen here: keys are addresses the engine itself chose.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{ensure, InvariantViolation};

/// A hasher for `u64` addresses: a multiply folded so that the low bits (the bucket index) depend on
/// every bit of the address, including when addresses are aligned to large powers of two.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold bytes so the hasher stays correct for any key.
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        let h = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map from block address to `V`.
pub(crate) type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// The end of a chain of a [`ChainTable`].
pub(crate) const CHAIN_END: u32 = u32::MAX;

/// The slab a [`ChainTable`]'s chains run through: each slot in the table has an address (its key)
/// and a link to the next slot of its chain.
pub(crate) trait ChainSlots {
    /// The address of `slot`.
    fn key(&self, slot: u32) -> u64;
    /// The slot after `slot` in its chain, or [`CHAIN_END`].
    fn link(&self, slot: u32) -> u32;
    /// Sets the slot after `slot` in its chain.
    fn set_link(&mut self, slot: u32, next: u32);
}

/// A map from block address to the slot of a slab that stores each slot's address: a hash table of
/// 4-byte chain heads whose chains are threaded through the slab itself (see [`ChainSlots`]).
///
/// The block table's live map: `deallocate` reads the freed block's slot anyway, so a chain costs
/// one slab read per slot ahead of the one looked for (at most [`MAX_LOAD`](Self::MAX_LOAD) entries
/// per bucket on average, so a successful lookup reads on average at most two slots) and the table
/// itself is only the heads, 2 to 4 bytes per entry: with ~100k live blocks, 256 KiB, which mostly
/// stays in a core's L2 cache where an open table of 8-byte entries at load one half (2 MiB) did
/// not. Inserting writes the new slot's link, on the line the caller is writing anyway. The hash is
/// a multiply of the address's granule number: addresses are ones the engine chose, so no flooding
/// defence is needed.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChainTable {
    /// Per bucket, the first slot of its chain or [`CHAIN_END`]; empty until the first insert, then
    /// a power of two of at least [`MIN_CAPACITY`](Self::MIN_CAPACITY) buckets, at least one per
    /// [`MAX_LOAD`](Self::MAX_LOAD) entries. Invariant: every entry sits in exactly one chain, that
    /// of its address's bucket.
    heads: Vec<u32>,
    len: usize,
    /// `64 - log2(heads.len())`: the hash's top bits pick the bucket.
    shift: u32,
}

impl ChainTable {
    const MIN_CAPACITY: usize = 64;
    /// Entries per bucket at most. Measured on the standard workload's small and mid points
    /// (`benches/RESULTS-host.md`): 2 misses a 2 MiB cache less often than 1 (a smaller table
    /// against longer chains) and than 4.
    const MAX_LOAD: usize = 2;

    #[inline]
    fn bucket(&self, addr: u64) -> usize {
        ((addr >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Number of entries.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Maps `addr` (not present; `slots.key(slot) == addr`) to `slot` (below [`CHAIN_END`]);
    /// overwrites `slot`'s link.
    #[inline]
    pub(crate) fn insert(&mut self, slots: &mut (impl ChainSlots + ?Sized), addr: u64, slot: u32) {
        debug_assert!(slot != CHAIN_END);
        if self.len >= Self::MAX_LOAD * self.heads.len() {
            self.grow(slots);
        }
        let b = self.bucket(addr);
        slots.set_link(slot, self.heads[b]);
        self.heads[b] = slot;
        self.len += 1;
    }

    /// The slot of `addr`.
    #[inline]
    pub(crate) fn get(&self, slots: &(impl ChainSlots + ?Sized), addr: u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let mut slot = self.heads[self.bucket(addr)];
        while slot != CHAIN_END {
            if slots.key(slot) == addr {
                return Some(slot);
            }
            slot = slots.link(slot);
        }
        None
    }

    /// Removes `addr` if `keep_out(slots, slot)` says so, returning its slot; `None` (changing
    /// nothing) when `addr` is absent or `keep_out` refuses. The removed slot's link is left as it
    /// was.
    #[inline]
    pub(crate) fn remove_if<S: ChainSlots + ?Sized>(
        &mut self,
        slots: &mut S,
        addr: u64,
        keep_out: impl FnOnce(&S, u32) -> bool,
    ) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let b = self.bucket(addr);
        let (mut before, mut slot) = (CHAIN_END, self.heads[b]);
        while slot != CHAIN_END {
            if slots.key(slot) == addr {
                if !keep_out(slots, slot) {
                    return None;
                }
                let after = slots.link(slot);
                if before == CHAIN_END {
                    self.heads[b] = after;
                } else {
                    slots.set_link(before, after);
                }
                self.len -= 1;
                return Some(slot);
            }
            before = slot;
            slot = slots.link(slot);
        }
        None
    }

    /// Every slot, in no particular order.
    pub(crate) fn slots<'a, S: ChainSlots + ?Sized>(&'a self, slots: &'a S) -> impl Iterator<Item = u32> + 'a {
        self.heads.iter().flat_map(move |&head| {
            let mut slot = head;
            std::iter::from_fn(move || {
                (slot != CHAIN_END).then(|| {
                    let s = slot;
                    slot = slots.link(s);
                    s
                })
            })
        })
    }

    /// Checks that every chain holds only slots whose address hashes to its bucket, that the chains
    /// hold `len` slots in all and that none loops (`limit`: the number of slots in the slab).
    pub(crate) fn check(&self, slots: &(impl ChainSlots + ?Sized), limit: usize) -> Result<(), InvariantViolation> {
        let mut count = 0usize;
        for (b, &head) in self.heads.iter().enumerate() {
            let mut slot = head;
            while slot != CHAIN_END {
                ensure!(
                    (slot as usize) < limit && count < limit,
                    "live map: bucket {b}'s chain leaves the slab or loops at slot {slot}"
                );
                ensure!(
                    self.bucket(slots.key(slot)) == b,
                    "live map: slot {slot} ({:#x}) is chained in bucket {b}, not its own",
                    slots.key(slot)
                );
                count += 1;
                slot = slots.link(slot);
            }
        }
        ensure!(
            count == self.len && (self.heads.is_empty() || self.len <= Self::MAX_LOAD * self.heads.len()),
            "live map: counts {} entries, its chains hold {count} in {} buckets",
            self.len,
            self.heads.len()
        );
        Ok(())
    }

    /// Doubles the buckets (to [`MIN_CAPACITY`](Self::MIN_CAPACITY) the first time) and rechains
    /// every entry.
    #[cold]
    fn grow(&mut self, slots: &mut (impl ChainSlots + ?Sized)) {
        let capacity = (self.heads.len() * 2).max(Self::MIN_CAPACITY);
        let old = std::mem::replace(&mut self.heads, vec![CHAIN_END; capacity]);
        self.shift = 64 - capacity.trailing_zeros();
        for head in old {
            let mut slot = head;
            while slot != CHAIN_END {
                let next = slots.link(slot);
                let b = self.bucket(slots.key(slot));
                slots.set_link(slot, self.heads[b]);
                self.heads[b] = slot;
                slot = next;
            }
        }
    }
}

/// A map from non-zero block address to a small `Copy` value: open addressing with linear probing,
/// so a lookup reads one cache line (the key and the value sit side by side) where a
/// general-purpose table reads its control bytes and its buckets from two places. The engines do
/// one lookup per operation on tables of ~100k live allocations, where that line is the
/// operation's first cache miss. The hash is a multiply of the address's granule number: addresses
/// are ones the engine chose, so no flooding defence is needed.
#[derive(Debug, Clone)]
pub(crate) struct AddrTable<V> {
    /// `(address, value)`; address 0 marks an empty entry. Invariant: every entry is reachable from
    /// its home position `hash(addr)` by probing forward without crossing an empty entry.
    entries: Vec<(u64, V)>,
    len: usize,
    /// `64 - log2(entries.len())`: the hash's top bits pick the home position.
    shift: u32,
}

impl<V> Default for AddrTable<V> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            len: 0,
            shift: 0,
        }
    }
}

impl<V: Copy + Default> AddrTable<V> {
    const MIN_CAPACITY: usize = 64;

    #[inline]
    fn home(&self, addr: u64) -> usize {
        ((addr >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    /// Number of entries.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Maps `addr` (non-zero, not present) to `value`.
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, value: V) {
        debug_assert_ne!(addr, 0, "address 0 marks empty entries");
        // Keep the load at most one half: probes stay within a line or two.
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        while self.entries[i].0 != 0 {
            debug_assert_ne!(self.entries[i].0, addr, "address {addr:#x} inserted twice");
            i = (i + 1) & mask;
        }
        self.entries[i] = (addr, value);
        self.len += 1;
    }

    #[inline]
    fn find(&self, addr: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            match self.entries[i].0 {
                0 => return None,
                a if a == addr => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// The value of `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: u64) -> Option<V> {
        self.find(addr).map(|i| self.entries[i].1)
    }

    /// The value of `addr`, to change in place.
    #[inline]
    pub(crate) fn get_mut(&mut self, addr: u64) -> Option<&mut V> {
        self.find(addr).map(|i| &mut self.entries[i].1)
    }

    /// Removes `addr`, returning its value.
    #[inline]
    pub(crate) fn remove(&mut self, addr: u64) -> Option<V> {
        let mut hole = self.find(addr)?;
        let value = self.entries[hole].1;
        self.len -= 1;
        // Backward-shift deletion: pull later entries of the probe run into the hole when the hole
        // lies between their home and where they sit, so no tombstones are needed.
        let mask = self.mask();
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let a = self.entries[i].0;
            if a == 0 {
                break;
            }
            let home = self.home(a);
            // Distance from home to the entry's place, and from home to the hole, going forward.
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.entries[hole] = self.entries[i];
                hole = i;
            }
        }
        self.entries[hole] = (0, V::default());
        Some(value)
    }

    /// Every `(address, value)`, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.entries.iter().copied().filter(|&(a, _)| a != 0)
    }

    /// Removes every entry (keeping the table's memory).
    pub(crate) fn clear(&mut self) {
        self.entries.fill((0, V::default()));
        self.len = 0;
    }

    #[cold]
    fn grow(&mut self) {
        let capacity = (self.entries.len() * 2).max(Self::MIN_CAPACITY);
        let old = std::mem::replace(&mut self.entries, vec![(0, V::default()); capacity]);
        self.shift = 64 - capacity.trailing_zeros();
        self.len = 0;
        for (a, v) in old {
            if a != 0 {
                self.insert(a, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// `(address, link)` per slot.
    struct Slab(Vec<(u64, u32)>);

    impl ChainSlots for Slab {
        fn key(&self, slot: u32) -> u64 {
            self.0[slot as usize].0
        }
        fn link(&self, slot: u32) -> u32 {
            self.0[slot as usize].1
        }
        fn set_link(&mut self, slot: u32, next: u32) {
            self.0[slot as usize].1 = next;
        }
    }

    #[test]
    fn chain_table_check_finds_a_misfiled_slot() {
        let mut slab = Slab(Vec::new());
        let mut t = ChainTable::default();
        for k in 1..=100u64 {
            slab.0.push((k << 8, CHAIN_END));
            t.insert(&mut slab, k << 8, (k - 1) as u32);
        }
        assert!(t.check(&slab, slab.0.len()).is_ok());
        // Moving a slot's address makes it hash elsewhere (for some of the 100 addresses).
        let moved = (0..100).find(|&s| t.bucket(slab.0[s].0) != t.bucket(slab.0[s].0 + (1 << 20)));
        slab.0[moved.unwrap()].0 += 1 << 20;
        assert!(t.check(&slab, slab.0.len()).is_err());
    }

    proptest! {
        #[test]
        fn chain_table_agrees_with_a_hash_map(ops in prop::collection::vec((0u8..4, 1u64..400), 1..2000)) {
            // Slot k holds address `slab[k].0` and its chain link `slab[k].1`, as the block table's
            // nodes do; removed slots keep their address, so stale slots are in the slab too.
            let mut slab = Slab(Vec::new());
            let mut t = ChainTable::default();
            let mut reference: HashMap<u64, u32> = HashMap::new();
            for (op, key) in ops {
                let addr = key << 8;
                match op {
                    0 | 1 if !reference.contains_key(&addr) => {
                        let slot = slab.0.len() as u32;
                        slab.0.push((addr, 7));
                        t.insert(&mut slab, addr, slot);
                        reference.insert(addr, slot);
                    }
                    2 => {
                        // A refusal changes nothing.
                        prop_assert_eq!(t.remove_if(&mut slab, addr, |_, _| false), None);
                        prop_assert_eq!(t.get(&slab, addr), reference.get(&addr).copied());
                    }
                    _ => {
                        let removed = t.remove_if(&mut slab, addr, |s, slot| s.key(slot) == addr);
                        prop_assert_eq!(removed, reference.remove(&addr));
                    }
                }
                prop_assert_eq!(t.len(), reference.len());
                let checked = t.check(&slab, slab.0.len());
                prop_assert!(checked.is_ok(), "{checked:?}");
            }
            for (&a, &s) in &reference {
                prop_assert_eq!(t.get(&slab, a), Some(s));
            }
            prop_assert_eq!(t.get(&slab, 401 << 8), None);
            let mut all: Vec<u32> = t.slots(&slab).collect();
            all.sort_unstable();
            let mut expected: Vec<u32> = reference.into_values().collect();
            expected.sort_unstable();
            prop_assert_eq!(all, expected);
        }

        #[test]
        fn slot_map_agrees_with_a_hash_map(ops in prop::collection::vec((any::<bool>(), 1u64..400), 1..2000)) {
            let mut m = AddrTable::<u32>::default();
            let mut reference: HashMap<u64, u32> = HashMap::new();
            for (k, (insert, key)) in ops.into_iter().enumerate() {
                // Aligned keys that collide often: a small range, as block addresses in one chunk.
                let addr = key << 8;
                if insert && !reference.contains_key(&addr) {
                    m.insert(addr, k as u32);
                    reference.insert(addr, k as u32);
                } else {
                    prop_assert_eq!(m.remove(addr), reference.remove(&addr));
                }
                prop_assert_eq!(m.len(), reference.len());
            }
            for (&a, &s) in &reference {
                prop_assert_eq!(m.get(a), Some(s));
            }
            let mut all: Vec<(u64, u32)> = m.iter().collect();
            all.sort_unstable();
            let mut expected: Vec<(u64, u32)> = reference.into_iter().collect();
            expected.sort_unstable();
            prop_assert_eq!(all, expected);
        }
    }
}
