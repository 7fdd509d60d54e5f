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

/// A map from non-zero block address to a `u32` slot (see [`AddrTable`]).
pub(crate) type SlotMap = AddrTable<u32>;

/// A set of non-zero block addresses, eight to a cache line (see [`AddrTable`]).
pub(crate) type LiveSet = AddrTable<()>;

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
    #[inline]
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
        fn slot_map_agrees_with_a_hash_map(ops in prop::collection::vec((any::<bool>(), 1u64..400), 1..2000)) {
            let mut m = SlotMap::default();
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
