//! Power-of-two bins of fixed-size blocks: RMM's `binning_memory_resource` on addresses.

use super::chunks::{check_balance, Chunks};
use super::fixed_size::FixedCore;
use crate::engine::Engine;
use crate::error::{Error, InvariantViolation};
use crate::memory_map::{ChunkMap, MapRange};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, EngineStats, EventPolicy, ALIGNMENT};
use crate::upstream::Upstream;

/// The bins of a [`BinningEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BinningOptions {
    /// The smallest bin is `2^min_size_exponent` bytes; at least 8 (256 bytes, the alignment).
    pub min_size_exponent: u32,
    /// The largest bin is `2^max_size_exponent` bytes; larger requests go straight to the upstream.
    /// At most 40.
    pub max_size_exponent: u32,
    /// Blocks carved from each upstream chunk, in every bin (at least 1, at most 2^32).
    pub blocks_per_chunk: u64,
    /// When to record the events that hand free blocks to other streams.
    pub event_policy: EventPolicy,
}

impl BinningOptions {
    /// The largest bin's block size, `2^max_size_exponent` bytes (`u64::MAX` for an exponent of 64
    /// or more, which [`BinningEngine::new`] refuses).
    #[inline]
    pub fn largest_bin(&self) -> u64 {
        1u64.checked_shl(self.max_size_exponent).unwrap_or(u64::MAX)
    }

    /// Whether a request of `bytes` is above the largest bin, so that the engine passes it straight to
    /// its upstream (and keeps no block of any bin for it). Decided by the size alone: a free of `bytes`
    /// goes where an allocation of `bytes` went, so a resource in front of the engine may send both
    /// straight to the upstream without asking the engine (as mempool-rmm's `BinningResource` does).
    #[inline]
    pub fn goes_upstream(&self, bytes: u64) -> bool {
        bytes > self.largest_bin()
    }
}

impl Default for BinningOptions {
    /// Bins of 256 B to 1 MiB, 128 blocks per chunk (RMM's fixed-size default),
    /// [`EventPolicy::Adaptive`].
    fn default() -> Self {
        Self {
            min_size_exponent: 8,
            max_size_exponent: 20,
            blocks_per_chunk: 128,
            event_policy: EventPolicy::Adaptive,
        }
    }
}

/// Power-of-two bins of fixed-size blocks: RMM's `binning_memory_resource`, on addresses.
///
/// A request of `n` bytes goes to the smallest bin of at least `n` bytes (O(1): a bit count picks
/// the bin, the bin pops a stack); requests above the largest bin get their own upstream
/// allocation, returned to the upstream when freed. Each bin follows the per-stream event rule of
/// the [module docs](super). 0 bytes returns address 0 without touching any state.
///
/// ```
/// use mempool_suballoc::{BinningOptions, BinningEngine, Engine, SimStream, SimStreams, SimUpstream};
///
/// let options = BinningOptions { min_size_exponent: 8, max_size_exponent: 12, ..Default::default() };
/// let mut bins = BinningEngine::new(SimUpstream::new(), SimStreams::new(), options)?;
/// let s = SimStream::new(0);
/// let small = bins.allocate(300, s)?; // the 512-byte bin
/// let large = bins.allocate(10_000, s)?; // above 4 KiB: straight from the upstream
/// assert_eq!(bins.stats().used_bytes, 512 + 10_240);
/// bins.deallocate(large, 10_000, s)?;
/// bins.deallocate(small, 300, s)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BinningEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    upstream: U,
    order: O,
    options: BinningOptions,
    /// `bins[k]` serves sizes in `(2^(min+k-1), 2^(min+k)]` (the first bin everything up to its size).
    bins: Vec<FixedCore<O>>,
    /// Allocations above the largest bin (rounded to [`ALIGNMENT`]), each its own upstream
    /// allocation.
    large: Chunks<O::Stream>,
}

impl<U, O> BinningEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    /// The bin serving `bytes > 0`, or `None` above the largest bin.
    #[inline]
    fn bin(&self, bytes: u64) -> Option<usize> {
        let size = bytes.max(1 << self.options.min_size_exponent);
        // ceil(log2(size)), for size >= 2.
        let exp = 64 - (size - 1).leading_zeros();
        (exp <= self.options.max_size_exponent).then(|| (exp - self.options.min_size_exponent) as usize)
    }

    /// The block size that serves a request of `bytes`, or `None` when it goes to the upstream.
    pub fn bin_size(&self, bytes: u64) -> Option<u64> {
        self.bin(bytes.max(1)).map(|k| self.bins[k].block_size())
    }

    #[cold]
    fn allocate_large(&mut self, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        let size = crate::engine::request_size(bytes)?;
        self.large
            .allocate(&self.upstream, size, stream)
            .map_err(|e| e.with_requested(bytes))
    }

    #[cold]
    fn deallocate_large(&mut self, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        match self.large.get(addr) {
            Some(c) if Some(c.size) == align_up(bytes) => self.large.release(&self.upstream, addr, stream).map(drop),
            _ => Err(Error::UnknownAllocation { addr, bytes }),
        }
    }

    /// Per bin, `(block size, stats)`.
    pub fn bin_stats(&self) -> impl Iterator<Item = (u64, EngineStats)> + '_ {
        self.bins.iter().map(|b| (b.block_size(), b.stats()))
    }
}

impl<U, O> Engine for BinningEngine<U, O>
where
    U: Upstream<O::Stream>,
    O: StreamOrder,
{
    type Options = BinningOptions;
    type Stream = O::Stream;
    type Upstream = U;
    type Order = O;

    /// An engine with one bin per power of two from `2^min_size_exponent` to
    /// `2^max_size_exponent`. Reserves nothing yet. Fails with [`Error::InvalidOptions`] when the
    /// exponents are out of range or out of order, or `blocks_per_chunk` is 0 or too large.
    fn new(upstream: U, order: O, options: BinningOptions) -> Result<Self, Error> {
        let (min, max) = (options.min_size_exponent, options.max_size_exponent);
        if min < ALIGNMENT.trailing_zeros() {
            return Err(Error::InvalidOptions(
                "min_size_exponent is below 8 (bins smaller than the alignment)",
            ));
        }
        if max > 40 || min > max {
            return Err(Error::InvalidOptions(
                "need min_size_exponent <= max_size_exponent <= 40",
            ));
        }
        let bins = (min..=max)
            .map(|e| FixedCore::new(1 << e, options.blocks_per_chunk, options.event_policy))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            upstream,
            order,
            options,
            bins,
            large: Chunks::default(),
        })
    }

    fn options(&self) -> BinningOptions {
        self.options
    }

    /// Allocates `bytes` for use on `stream`: from its bin, or from the upstream above the largest
    /// bin; 0 for 0 bytes.
    ///
    /// Fails with [`Error::OutOfMemory`] (with `requested == bytes`) when the upstream is full,
    /// [`Error::Stream`] when the event wait to take another stream's block fails.
    #[inline]
    fn allocate(&mut self, bytes: u64, stream: O::Stream) -> Result<u64, Error> {
        if bytes == 0 {
            return Ok(0);
        }
        match self.bin(bytes) {
            Some(k) => self.bins[k].allocate(&self.upstream, &self.order, bytes, stream),
            None => self.allocate_large(bytes, stream),
        }
    }

    /// Frees an allocation of `bytes` made by [`allocate`](Engine::allocate). A binned block may be
    /// reused at once on `stream` and by other streams after an event wait; a large one goes back to
    /// the upstream on `stream`. Freeing 0 bytes does nothing. Fails with
    /// [`Error::UnknownAllocation`] (changing nothing) when `addr` is not a live allocation of that
    /// size, and with the upstream's error when it fails to take a large allocation back (which is
    /// forgotten all the same).
    #[inline]
    fn deallocate(&mut self, addr: u64, bytes: u64, stream: O::Stream) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        match self.bin(bytes) {
            Some(k) => self.bins[k].deallocate(&self.order, addr, bytes, stream),
            None => self.deallocate_large(addr, bytes, stream),
        }
    }

    /// In every bin, moves every stream's free blocks into `into`'s list after making `into` wait
    /// on each.
    fn merge_free_lists(&mut self, into: O::Stream) -> Result<(), Error> {
        self.bins
            .iter_mut()
            .try_for_each(|b| b.merge_free_lists(&self.order, into))
    }

    /// In every bin, as [`FixedSizeEngine`](crate::fixed_size::FixedSizeEngine)'s. Large allocations are
    /// returned when freed, so none is unused.
    fn release_unused(&mut self, stream: O::Stream) -> Result<u64, Error> {
        let mut released = 0;
        for bin in &mut self.bins {
            released += bin.release_unused(&self.upstream, &self.order, stream)?;
        }
        Ok(released)
    }

    /// Synchronizes every stream seen (by any bin, and by large allocations), then returns every
    /// chunk of every bin, and every large allocation, to the upstream; live blocks become invalid.
    /// On a synchronize error nothing is released; an upstream error is returned after everything
    /// was returned and forgotten.
    fn release(&mut self) -> Result<(), Error> {
        self.large.synchronize(&self.order)?;
        for bin in &self.bins {
            bin.synchronize(&self.order)?;
        }
        let mut result = Ok(());
        for bin in &mut self.bins {
            result = result.and(bin.release_synchronized(&self.upstream));
        }
        result.and(self.large.release_all(&self.upstream))
    }

    /// Bytes reserved, used and free, and block counts, over all bins and large allocations.
    fn stats(&self) -> EngineStats {
        let large_bytes = self.large.reserved();
        let mut st = EngineStats {
            reserved_bytes: large_bytes,
            used_bytes: large_bytes,
            free_bytes: 0,
            free_blocks: 0,
            live_allocations: self.large.len(),
            upstream_chunks: self.large.len(),
        };
        for bin in &self.bins {
            let b = bin.stats();
            st.reserved_bytes += b.reserved_bytes;
            st.used_bytes += b.used_bytes;
            st.free_bytes += b.free_bytes;
            st.free_blocks += b.free_blocks;
            st.live_allocations += b.live_allocations;
            st.upstream_chunks += b.upstream_chunks;
        }
        st
    }

    /// Checks every bin's invariants, that large allocations are aligned and disjoint from each
    /// other, and that free + used = reserved overall. (Bins and large allocations cannot overlap:
    /// each is a distinct upstream allocation.)
    /// Every bin's chunks, then each allocation above the bins as a chunk of one used range.
    fn memory_map(&self) -> Vec<ChunkMap<O::Stream>> {
        let mut maps: Vec<ChunkMap<O::Stream>> = self.bins.iter().flat_map(|b| b.memory_map()).collect();
        maps.extend(self.large.iter().map(|(addr, c)| ChunkMap {
            addr,
            size: c.size,
            ranges: vec![MapRange {
                addr,
                size: c.size,
                used: true,
                stream: None,
            }],
        }));
        maps.sort_unstable_by_key(|m| m.addr);
        maps
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for bin in &self.bins {
            bin.check_invariants()?;
        }
        self.large.check("binning (large allocations)")?;
        check_balance("binning", &self.stats())
    }

    fn upstream(&self) -> &U {
        &self.upstream
    }

    fn stream_order(&self) -> &O {
        &self.order
    }
}

crate::engine::engine_common!(BinningOptions => BinningEngine);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OutOfMemoryCause;
    use crate::sim::SimUpstream;
    use crate::sim::{SimStream, SimStreams};
    use crate::testing::{self, ops, world};
    use proptest::prelude::*;

    const A: SimStream = SimStream::new(0);
    const B: SimStream = SimStream::new(1);

    fn options(min: u32, max: u32, per_chunk: u64) -> BinningOptions {
        BinningOptions {
            min_size_exponent: min,
            max_size_exponent: max,
            blocks_per_chunk: per_chunk,
            ..Default::default()
        }
    }

    #[test]
    fn picks_the_smallest_bin_that_fits() {
        let b = BinningEngine::new(SimUpstream::new(), SimStreams::new(), options(8, 12, 4)).unwrap();
        let cases = [
            (1, Some(256)),
            (256, Some(256)),
            (257, Some(512)),
            (512, Some(512)),
            (3000, Some(4096)),
            (4096, Some(4096)),
            (4097, None),
            (u64::MAX, None),
        ];
        for (bytes, bin) in cases {
            assert_eq!(b.bin_size(bytes), bin, "{bytes} bytes");
        }
    }

    #[test]
    fn goes_upstream_exactly_when_no_bin_holds_the_request() {
        for (min, max) in [(8, 8), (8, 12), (8, 20), (10, 40)] {
            let o = options(min, max, 4);
            let b = BinningEngine::new(SimUpstream::new(), SimStreams::new(), o).unwrap();
            let top = 1u64 << max;
            assert_eq!(o.largest_bin(), top);
            for bytes in [
                1,
                255,
                256,
                257,
                top / 2 + 1,
                top - 1,
                top,
                top + 1,
                top + 256,
                3 * top,
                u64::MAX,
            ] {
                assert_eq!(
                    o.goes_upstream(bytes),
                    b.bin_size(bytes).is_none(),
                    "{bytes} bytes, bins 2^{min}..2^{max}"
                );
            }
        }
        assert_eq!(options(8, 64, 4).largest_bin(), u64::MAX);
    }

    #[test]
    fn release_synchronizes_each_stream_once_however_many_large_allocations_it_holds() {
        let up = SimUpstream::new();
        let sim = SimStreams::new();
        let mut b = BinningEngine::new(up.clone(), sim.clone(), options(8, 12, 4)).unwrap();
        for _ in 0..50 {
            b.allocate(10_000, A).unwrap();
        }
        b.allocate(20_000, B).unwrap();
        b.allocate(300, A).unwrap();
        let before = sim.counts().synchronizes;
        b.release().unwrap();
        // Streams A and B for the large allocations, and A again for the bin that saw it.
        assert_eq!(sim.counts().synchronizes - before, 3);
        assert_eq!(up.stats().live_chunks, 0);
    }

    #[test]
    fn bins_and_large_allocations() {
        let up = SimUpstream::new();
        let mut b = BinningEngine::new(up.clone(), SimStreams::new(), options(8, 12, 4)).unwrap();
        let small = b.allocate(300, A).unwrap();
        let small2 = b.allocate(400, A).unwrap();
        assert_eq!(small2, small + 512);
        let large = b.allocate(10_000, A).unwrap();
        let st = b.stats();
        assert_eq!(st.reserved_bytes, 4 * 512 + 10_240);
        assert_eq!(st.used_bytes, 2 * 512 + 10_240);
        assert_eq!(st.upstream_chunks, 2);
        assert_eq!(b.bin_stats().nth(1).unwrap().1.live_allocations, 2);
        b.check_invariants().unwrap();
        // A large allocation goes back upstream at once; a wrong size is rejected.
        assert!(matches!(
            b.deallocate(large, 20_000, A),
            Err(Error::UnknownAllocation { .. })
        ));
        b.deallocate(large, 10_000, A).unwrap();
        assert_eq!(up.stats().live_chunks, 1);
        // Freed with a size of another bin: rejected, nothing changes.
        assert!(matches!(
            b.deallocate(small, 1000, A),
            Err(Error::UnknownAllocation { .. })
        ));
        b.deallocate(small, 300, A).unwrap();
        assert_eq!(b.allocate(0, A).unwrap(), 0);
        b.deallocate(small2, 0, A).unwrap();
        assert_eq!(b.stats().live_allocations, 1);
        b.check_invariants().unwrap();
        drop(b);
        assert_eq!(up.stats().live_chunks, 0);
    }

    #[test]
    fn out_of_memory_reports_the_requested_size() {
        let up = SimUpstream::with_capacity(2048);
        let mut b = BinningEngine::new(up, SimStreams::new(), options(8, 10, 2)).unwrap();
        b.allocate(1024, A).unwrap();
        b.allocate(1024, A).unwrap();
        for bytes in [1000, 5000] {
            assert!(matches!(
                b.allocate(bytes, A),
                Err(Error::OutOfMemory { requested, cause: OutOfMemoryCause::Upstream }) if requested == bytes
            ));
        }
    }

    #[test]
    fn stream_hand_off_in_a_bin() {
        let sim = SimStreams::new();
        let mut b = BinningEngine::new(SimUpstream::new(), sim.clone(), options(8, 10, 1)).unwrap();
        let x = b.allocate(600, A).unwrap();
        let freed = sim.point(A);
        b.deallocate(x, 600, A).unwrap();
        assert_eq!(b.allocate(1024, B).unwrap(), x);
        assert!(sim.is_ordered_after(B, freed));
    }

    #[test]
    fn invalid_configurations_are_rejected() {
        for c in [
            options(7, 10, 4),
            options(12, 10, 4),
            options(8, 41, 4),
            options(8, 10, 0),
        ] {
            assert!(matches!(
                BinningEngine::new(SimUpstream::new(), SimStreams::new(), c),
                Err(Error::InvalidOptions(_))
            ));
        }
    }

    #[test]
    fn engine_is_send() {
        fn send<T: Send>() {}
        send::<BinningEngine<SimUpstream, SimStreams>>();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn random_sequences(ops in ops(4096, 3, 150), per_chunk in 1u64..5) {
            let w = world(None, EventPolicy::RecordOnFree);
            let b = BinningEngine::new(w.up.clone(), w.order.clone(), options(8, 11, per_chunk)).unwrap();
            testing::run(b, &w, &ops, false)?;
        }

        #[test]
        fn random_sequences_with_a_small_upstream(ops in ops(4096, 3, 150)) {
            let w = world(Some(32 * 1024), EventPolicy::RecordOnDemand);
            let options = BinningOptions { event_policy: EventPolicy::RecordOnDemand, ..options(8, 11, 4) };
            let b = BinningEngine::new(w.up.clone(), w.order.clone(), options).unwrap();
            testing::run(b, &w, &ops, true)?;
        }
    }
}
