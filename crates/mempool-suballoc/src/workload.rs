//! The standard random workload (RMM's `random_allocations` shape) and the fixed-seed generator it
//! draws from. Not a test double: the criterion bench of the engines, mempool-rmm's
//! `random_workload` example and `mempool-bench random` all draw their sequences from here
//! (`mempool_rmm::workload` re-exports this module), and the published benchmark numbers depend on
//! the sequence staying bit-identical.

/// SplitMix64: a tiny fixed-seed generator, so workloads need no `rand` dependency and draw the same
/// sequence on every machine.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, n)` (`n > 0`; the modulo bias is far below what a workload can notice).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// One operation of the standard random workload (see [`random_workload`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RandomOp {
    /// Allocate this many bytes.
    Alloc(usize),
    /// Free the live allocation at this index of the live list, which then `swap_remove`s it.
    Free(usize),
}

/// The standard random workload (RMM's `random_allocations` shape; `docs/architecture.md`, "Performance"): `n`
/// draws, each an allocation of a size uniform in `[1, max_size]` with probability 0.73 (dropped when it
/// would take live bytes past `max_usage`), otherwise the free of a uniformly chosen live allocation;
/// an allocation whenever nothing is live. The same `seed` gives the same sequence everywhere: the
/// criterion bench, the `random_workload` example and `mempool-bench random` all draw from here.
///
/// ```
/// use mempool_suballoc::workload::{random_workload, RandomOp};
/// let ops = random_workload(1000, 4096, 1 << 20, 42);
/// assert!(matches!(ops[0], RandomOp::Alloc(n) if (1..=4096).contains(&n)));
/// assert_eq!(ops, random_workload(1000, 4096, 1 << 20, 42));
/// ```
pub fn random_workload(n: usize, max_size: usize, max_usage: usize, seed: u64) -> Vec<RandomOp> {
    let mut rng = SplitMix64(seed);
    let mut live: Vec<usize> = Vec::new();
    let mut live_bytes = 0usize;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        let size = 1 + rng.below(max_size as u64) as usize;
        let alloc = rng.below(100) < 73;
        if (alloc && live_bytes + size <= max_usage) || live.is_empty() {
            if live_bytes + size > max_usage {
                continue;
            }
            live.push(size);
            live_bytes += size;
            ops.push(RandomOp::Alloc(size));
        } else {
            let i = rng.below(live.len() as u64) as usize;
            live_bytes -= live.swap_remove(i);
            ops.push(RandomOp::Free(i));
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published benchmark numbers depend on these sequences: they must not change.
    #[test]
    fn the_sequences_are_pinned() {
        // SplitMix64's reference outputs for seed 0.
        let mut r = SplitMix64(0);
        assert_eq!(
            [r.next_u64(), r.next_u64(), r.next_u64()],
            [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f]
        );
        use RandomOp::{Alloc, Free};
        assert_eq!(
            random_workload(12, 4096, 10_000, 42),
            [
                Alloc(3734),
                Alloc(3923),
                Alloc(1011),
                Free(1),
                Alloc(1967),
                Free(1),
                Alloc(3805),
                Free(0),
                Alloc(2145),
                Free(1),
                Free(1),
                Alloc(2336)
            ]
        );
        // The criterion bench's first point, hashed (FNV-1a over (kind, value) pairs).
        let ops = random_workload(200_000, 64 << 10, 4 << 30, 0x5EED_0000 ^ (64 << 10));
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for op in &ops {
            let (kind, v) = match *op {
                Alloc(n) => (1, n as u64),
                Free(i) => (2, i as u64),
            };
            for x in [kind, v] {
                h = (h ^ x).wrapping_mul(0x100_0000_01b3);
            }
        }
        assert_eq!((ops.len(), h), (200_000, 0x25c8_e67a_c19f_a184));
    }
}
