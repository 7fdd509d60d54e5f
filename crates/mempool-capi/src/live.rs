//! The allocations another framework's allocator (PyTorch's, CuPy's) holds through mempool: address ->
//! what its free needs (the size, the resource that made it, ...). A free of an address that is not in
//! the table is refused, so a pointer mempool did not hand out is never freed.
//!
//! Sharded by address, so that threads allocating at once rarely meet on one lock; each shard hashes its
//! addresses with one multiplication (they are 256-byte aligned device addresses, not attacker-chosen
//! keys, so the default SipHash buys nothing on this path).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

const SHARDS: usize = 16;

/// Hashes one `u64` (an address) with a folded 128-bit multiplication, so the low bits a hash table
/// indexes with depend on every bit of the address.
#[derive(Default)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        let m = u128::from(x ^ self.0) * 0x9E37_79B9_7F4A_7C15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

type Map<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// The live table (see the module documentation).
pub struct LiveTable<V> {
    shards: [Mutex<Option<Map<V>>>; SHARDS],
}

impl<V> Default for LiveTable<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> LiveTable<V> {
    /// An empty table (usable in a `static`).
    pub const fn new() -> LiveTable<V> {
        LiveTable {
            shards: [const { Mutex::new(None) }; SHARDS],
        }
    }

    fn shard(&self, addr: u64) -> std::sync::MutexGuard<'_, Option<Map<V>>> {
        // Allocations are 256-byte aligned: the bits above the alignment spread them.
        let i = ((addr >> 8) ^ (addr >> 21)) as usize % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `addr` with `value` (an address handed out again after its free replaces the old entry,
    /// which its free removed already).
    pub fn insert(&self, addr: u64, value: V) {
        self.shard(addr).get_or_insert_with(Map::default).insert(addr, value);
    }

    /// Removes `addr`'s entry if `accept` accepts it; `None` when the table does not hold `addr`,
    /// `Some(Err)` (the entry stays) when `accept` refuses it.
    pub fn remove_if<E>(&self, addr: u64, accept: impl FnOnce(&V) -> Result<(), E>) -> Option<Result<V, E>> {
        let mut g = self.shard(addr);
        let map = g.as_mut()?;
        match accept(map.get(&addr)?) {
            Ok(()) => map.remove(&addr).map(Ok),
            Err(e) => Some(Err(e)),
        }
    }

    /// `f` of `addr`'s entry, if the table holds it.
    pub fn with<R>(&self, addr: u64, f: impl FnOnce(&V) -> R) -> Option<R> {
        self.shard(addr).as_ref()?.get(&addr).map(f)
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, Map::len))
            .sum()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn entries_are_removed_once_and_only_when_accepted() {
        let t: LiveTable<usize> = LiveTable::new();
        for i in 0..1000u64 {
            t.insert(0x7f00_0000_0000 + (i << 8), i as usize);
        }
        assert_eq!(t.len(), 1000);
        let a = 0x7f00_0000_0000 + (5 << 8);
        assert_eq!(
            t.remove_if(a, |&v| if v == 6 { Ok(()) } else { Err("wrong") }),
            Some(Err("wrong"))
        );
        assert_eq!(t.len(), 1000, "a refused removal keeps the entry");
        assert_eq!(t.remove_if(a, |_| Ok::<(), ()>(())), Some(Ok(5)));
        assert_eq!(t.remove_if(a, |_| Ok::<(), ()>(())), None, "removed once");
        assert_eq!(t.remove_if(0x10, |_| Ok::<(), ()>(())), None, "never inserted");
        assert_eq!(t.len(), 999);
    }

    #[test]
    fn aligned_addresses_spread_over_the_low_bits_of_the_hash() {
        let build = BuildHasherDefault::<AddrHasher>::default();
        let mut seen = std::collections::HashSet::new();
        for i in 0..4096u64 {
            seen.insert(build.hash_one(0x7f00_0000_0000u64 + (i << 8)) & 0xfff);
        }
        // 4096 addresses over 4096 low-bit values: a hash that kept the alignment's zero bits would land on
        // at most 16 of them.
        assert!(seen.len() > 2000, "{} distinct low-bit values", seen.len());
    }
}
