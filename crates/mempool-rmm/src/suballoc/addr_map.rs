//! Hash maps keyed by block address, with a hasher that costs a multiply.
//!
//! Every engine keeps its live allocations in such a map so that `deallocate` can reject double
//! frees and wrong sizes in O(1). SipHash (the std default) guards against hash flooding, which
//! cannot happen here: keys are addresses the engine itself chose.

use std::collections::{HashMap, HashSet};
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

/// A set of block addresses.
pub(crate) type AddrSet = HashSet<u64, BuildHasherDefault<AddrHasher>>;
