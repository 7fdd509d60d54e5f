//! Hash maps keyed by block address, with a hasher that costs a multiply.
//!
//! Every engine keeps its live allocations in such a map so that `deallocate` can reject double
//! frees and wrong sizes in O(1). SipHash (the std default) guards against hash flooding, which
//! cannot happen here: keys are addresses the engine itself chose.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// A map from block address to the slot of a table that knows each slot's address: eight entries to a
/// cache line, half the size of an [`AddrTable`] of slots, so that with ~100k live blocks the table
/// (a few MiB as an `AddrTable`) mostly stays in a core's L2 cache. Each entry holds the slot and
/// the top 32 bits of the address's hash (the fingerprint, which also gives the entry's home
/// position); a lookup compares fingerprints and confirms a match with the slot's address, which the
/// caller reads anyway. Open addressing with linear probing and backward-shift deletion, load at
/// most one half.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotTable {
    /// `fingerprint << 32 | (slot + 1)`; 0 marks an empty entry. Invariant: every entry is reachable
    /// from its home position by probing forward without crossing an empty entry.
    entries: Vec<u64>,
    len: usize,
    /// `log2(entries.len())` (at most 32).
    bits: u32,
}

impl SlotTable {
    const MIN_CAPACITY: usize = 64;

    /// The fingerprint of `addr`: the top 32 bits of a multiplicative hash of its granule number.
    #[inline]
    fn fingerprint(addr: u64) -> u32 {
        ((addr >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
    }

    #[inline]
    fn home(&self, fp: u32) -> usize {
        (u64::from(fp) >> (32 - self.bits)) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    /// Number of entries.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Maps `addr` (not present; `addr_of(slot) == addr`) to `slot` (below `u32::MAX`).
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, slot: u32) {
        debug_assert!(slot < u32::MAX);
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow();
        }
        let fp = Self::fingerprint(addr);
        self.place(u64::from(fp) << 32 | (u64::from(slot) + 1));
        self.len += 1;
    }

    #[inline]
    fn place(&mut self, entry: u64) {
        let mask = self.mask();
        let mut i = self.home((entry >> 32) as u32);
        while self.entries[i] != 0 {
            i = (i + 1) & mask;
        }
        self.entries[i] = entry;
    }

    /// The position of `addr`'s entry; `addr_of` gives a slot's address.
    #[inline]
    fn find(&self, addr: u64, addr_of: impl Fn(u32) -> u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let fp = Self::fingerprint(addr);
        let mask = self.mask();
        let mut i = self.home(fp);
        loop {
            let e = self.entries[i];
            if e == 0 {
                return None;
            }
            if (e >> 32) as u32 == fp && addr_of((e as u32).wrapping_sub(1)) == addr {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: u64, addr_of: impl Fn(u32) -> u64) -> Option<u32> {
        self.find(addr, addr_of)
            .map(|i| (self.entries[i] as u32).wrapping_sub(1))
    }

    /// Removes `addr`, returning its slot.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, addr: u64, addr_of: impl Fn(u32) -> u64) -> Option<u32> {
        self.remove_if(addr, addr_of, |_| true)
    }

    /// Removes `addr` if `keep_out(slot)` says so, returning its slot; `None` (changing nothing)
    /// when `addr` is absent or `keep_out` refuses.
    #[inline]
    pub(crate) fn remove_if(
        &mut self,
        addr: u64,
        addr_of: impl Fn(u32) -> u64,
        keep_out: impl FnOnce(u32) -> bool,
    ) -> Option<u32> {
        let mut hole = self.find(addr, addr_of)?;
        let slot = (self.entries[hole] as u32).wrapping_sub(1);
        if !keep_out(slot) {
            return None;
        }
        self.len -= 1;
        let mask = self.mask();
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let e = self.entries[i];
            if e == 0 {
                break;
            }
            let home = self.home((e >> 32) as u32);
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.entries[hole] = e;
                hole = i;
            }
        }
        self.entries[hole] = 0;
        Some(slot)
    }

    /// Every slot, in no particular order.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries
            .iter()
            .filter(|&&e| e != 0)
            .map(|&e| (e as u32).wrapping_sub(1))
    }

    #[cold]
    fn grow(&mut self) {
        let capacity = (self.entries.len() * 2).max(Self::MIN_CAPACITY);
        // A u32 fingerprint gives the home position of tables up to 2^32 entries: 2^31 live blocks,
        // more than a slab indexed by u32 holds.
        let old = std::mem::replace(&mut self.entries, vec![0; capacity]);
        self.bits = capacity.trailing_zeros();
        for e in old {
            if e != 0 {
                self.place(e);
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

    proptest! {
        #[test]
        fn slot_table_agrees_with_a_hash_map(ops in prop::collection::vec((any::<bool>(), 1u64..400), 1..2000)) {
            // Slot k holds address `addrs[k]`, as the block table's nodes do.
            let mut addrs: Vec<u64> = Vec::new();
            let mut t = SlotTable::default();
            let mut reference: HashMap<u64, u32> = HashMap::new();
            for (insert, key) in ops {
                let addr = key << 8;
                if insert && !reference.contains_key(&addr) {
                    let slot = addrs.len() as u32;
                    addrs.push(addr);
                    t.insert(addr, slot);
                    reference.insert(addr, slot);
                } else {
                    prop_assert_eq!(t.remove(addr, |s| addrs[s as usize]), reference.remove(&addr));
                }
                prop_assert_eq!(t.len(), reference.len());
            }
            for (&a, &s) in &reference {
                prop_assert_eq!(t.get(a, |s| addrs[s as usize]), Some(s));
            }
            let mut all: Vec<u32> = t.slots().collect();
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
