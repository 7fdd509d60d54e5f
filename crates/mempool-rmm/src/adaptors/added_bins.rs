//! [`AddedBinsAdaptor`]: bins of any size, served by any resource, added in front of an upstream (RMM's
//! `binning_memory_resource::add_bin`).

use std::sync::{Mutex, OnceLock};

use mempool_core::{DeviceAddr, StreamRef};
use mempool_suballoc::BinningOptions;

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::{align_up, MemoryResource, SharedResource};

const NAME: &str = "AddedBinsAdaptor";

/// Bins added one by one in front of an upstream, each a size and the resource that serves it: the part of
/// RMM's `binning_memory_resource` that [`BinningResource`](crate::BinningResource)'s fixed power-of-two
/// bins do not cover (`add_bin(allocation_size, bin_resource)`).
///
/// A request goes to the smallest bin that holds it: an added bin, or one of the upstream's own bins
/// when the upstream is a [`BinningResource`](crate::BinningResource) (made with
/// [`over_binning`](Self::over_binning)), whose power-of-two bins then count as bins too and which
/// takes every request above the largest bin. A free goes where its allocation went: it is routed by its
/// size, so the bins are fixed once the adaptor allocated ([`add_bin`](Self::add_bin) refuses then).
///
/// ```
/// # fn main() -> mempool_rmm::Result<()> {
/// use std::sync::Arc;
/// use mempool_core::StreamRef;
/// use mempool_rmm::adaptors::AddedBinsAdaptor;
/// use mempool_rmm::testing::SimResource;
/// use mempool_rmm::{MemoryResource, SharedResource};
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let upstream = unsafe { SimResource::new() };
/// let mr = AddedBinsAdaptor::new(&upstream);
/// // SAFETY: as above.
/// let bin = Arc::new(unsafe { SimResource::new() });
/// mr.add_bin(1000, bin.clone() as SharedResource)?; // rounded up to 1024, as RMM aligns bin sizes
/// assert_eq!(mr.bin_sizes(), [1024]);
/// let small = mr.allocate(600, StreamRef::LEGACY)?; // the 1024-byte bin
/// let large = mr.allocate(4096, StreamRef::LEGACY)?; // above every bin: the upstream
/// assert_eq!((bin.live_allocations(), upstream.live_allocations()), (1, 1));
/// assert!(mr.add_bin(2048, bin.clone() as SharedResource).is_err()); // it allocated: the bins are fixed
/// // SAFETY: both came from `mr.allocate` with these sizes and are freed once.
/// unsafe { mr.deallocate(small, 600, StreamRef::LEGACY)? };
/// // SAFETY: as above.
/// unsafe { mr.deallocate(large, 4096, StreamRef::LEGACY)? };
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AddedBinsAdaptor<U> {
    upstream: U,
    /// The upstream's own power-of-two bins, `(min_exponent, max_exponent)` (see `over_binning`).
    upstream_bins: Option<(u32, u32)>,
    // Invariant: sorted by size, sizes distinct multiples of the alignment, none equal to an upstream bin;
    // unchanged once `frozen` is set.
    bins: Mutex<Vec<(usize, SharedResource)>>,
    /// A copy of `bins`, set (under `bins`' lock) by the first allocation; `add_bin` checks it under the
    /// same lock. Allocations and frees read it without a lock.
    frozen: OnceLock<Box<[(usize, SharedResource)]>>,
}

impl<U: MemoryResource> AddedBinsAdaptor<U> {
    /// No bins yet: every request goes to `upstream` until bins are added.
    pub fn new(upstream: U) -> Self {
        AddedBinsAdaptor {
            upstream,
            upstream_bins: None,
            bins: Mutex::new(Vec::new()),
            frozen: OnceLock::new(),
        }
    }

    /// In front of a [`BinningResource`](crate::BinningResource) (or any resource that serves the same
    /// bins) made with `options`: its power-of-two bins count as bins when picking the smallest bin that
    /// holds a request, and it takes everything no bin holds.
    pub fn over_binning(upstream: U, options: &BinningOptions) -> Self {
        AddedBinsAdaptor {
            upstream_bins: Some((options.min_size_exponent, options.max_size_exponent)),
            ..AddedBinsAdaptor::new(upstream)
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Adds a bin serving the requests up to `allocation_size` bytes (rounded up to
    /// [`crate::ALIGNMENT`]) that no smaller bin holds, from `resource`.
    ///
    /// Errors ([`Error::Unsupported`], naming the cause): a size of 0 or one that overflows when rounded;
    /// a size that already has a bin (added, or one of the upstream's); any call once the adaptor
    /// allocated (frees are routed by size, so a new bin would take frees of memory it never gave out).
    pub fn add_bin(&self, allocation_size: usize, resource: SharedResource) -> Result<()> {
        let refuse = |reason: String| Error::Unsupported { resource: NAME, reason };
        let size = match align_up(allocation_size as u64).map(|n| n as usize) {
            Some(s) if s > 0 => s,
            _ => {
                return Err(refuse(format!(
                    "add_bin({allocation_size}): a bin size must be 1 to {} bytes",
                    usize::MAX - 255
                )))
            }
        };
        if self.upstream_bin_sizes().any(|s| s == size) {
            return Err(refuse(format!(
                "add_bin({allocation_size}): the upstream already has a bin of {size} bytes"
            )));
        }
        let mut bins = self.bins.lock().unwrap_or_else(|p| p.into_inner());
        if self.frozen.get().is_some() {
            return Err(refuse(format!(
                "add_bin after the first allocation (a bin of {allocation_size} bytes): frees are routed by size, \
                 so a new bin would take frees of memory it never gave out; add every bin before allocating"
            )));
        }
        match bins.binary_search_by_key(&size, |(s, _)| *s) {
            Ok(_) => Err(refuse(format!(
                "add_bin({allocation_size}): there is a bin of {size} bytes already"
            ))),
            Err(at) => {
                bins.insert(at, (size, resource));
                Ok(())
            }
        }
    }

    /// The block sizes of every bin, the upstream's and the added ones, ascending.
    pub fn bin_sizes(&self) -> Vec<usize> {
        let bins = self.bins.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<usize> = self.upstream_bin_sizes().chain(bins.iter().map(|(s, _)| *s)).collect();
        all.sort_unstable();
        all
    }

    fn upstream_bin_sizes(&self) -> impl Iterator<Item = usize> {
        let (min, max) = self.upstream_bins.map_or((1, 0), |(min, max)| (min, max));
        (min..=max).map(|e| 1usize << e)
    }

    /// The upstream's bin for `bytes > 0`, if one holds it (as `BinningResource` picks it).
    fn upstream_bin(&self, bytes: usize) -> Option<usize> {
        let (min, max) = self.upstream_bins?;
        let size = bytes.max(1 << min).checked_next_power_of_two()?;
        (size <= 1usize << max).then_some(size)
    }

    /// The bins, fixed: the first call copies them (under the lock `add_bin` takes), later calls read the
    /// copy without a lock.
    #[inline]
    fn fixed_bins(&self) -> &[(usize, SharedResource)] {
        match self.frozen.get() {
            Some(bins) => bins,
            None => self.freeze(),
        }
    }

    #[cold]
    fn freeze(&self) -> &[(usize, SharedResource)] {
        let bins = self.bins.lock().unwrap_or_else(|p| p.into_inner());
        // Set while the lock is held, so an `add_bin` either finished before or sees `frozen` set.
        let fixed = self.frozen.get_or_init(|| bins.clone().into_boxed_slice());
        drop(bins);
        fixed
    }

    /// The added bin that serves `bytes`, or `None` for the upstream.
    fn route(bins: &[(usize, SharedResource)], upstream_bin: Option<usize>, bytes: usize) -> Option<&SharedResource> {
        let (size, r) = bins.get(bins.partition_point(|(s, _)| *s < bytes))?;
        match upstream_bin {
            Some(u) if u < *size => None,
            _ => Some(r),
        }
    }
}

// SAFETY: every allocation and free goes unchanged to the one resource (an added bin or the upstream)
// that its size selects; the bins are fixed before the first allocation (`add_bin` refuses after it), so
// a free's size selects the resource that made the allocation, whose `unsafe impl` guarantees are ours.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for AddedBinsAdaptor<U> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let upstream_bin = self.upstream_bin(bytes);
        match Self::route(self.fixed_bins(), upstream_bin, bytes) {
            Some(r) => r.allocate(bytes, stream),
            None => self.upstream.allocate(bytes, stream),
        }
        .map_err(|e| explain(e, self))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        let upstream_bin = self.upstream_bin(bytes);
        // The bins were fixed before the allocation of `ptr` (the caller's obligations: it came from
        // `allocate` with `bytes`), so `bytes` routes to the resource that made it.
        match Self::route(self.fixed_bins(), upstream_bin, bytes) {
            // SAFETY: the caller's obligations, passed on to the resource that made the allocation.
            Some(r) => unsafe { r.deallocate(ptr, bytes, stream) },
            // SAFETY: as above.
            None => unsafe { self.upstream.deallocate(ptr, bytes, stream) },
        }
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::testing::SimResource;

    #[allow(unsafe_code)]
    fn sim() -> Arc<SimResource> {
        // SAFETY: the simulation's addresses are never dereferenced in these tests.
        Arc::new(unsafe { SimResource::new() })
    }

    #[test]
    fn the_smallest_bin_that_holds_a_request_serves_it() {
        let upstream = sim();
        let options = BinningOptions {
            min_size_exponent: 8,
            max_size_exponent: 10,
            ..BinningOptions::default()
        };
        let mr = AddedBinsAdaptor::over_binning(upstream.clone(), &options);
        let (b768, b4k) = (sim(), sim());
        mr.add_bin(300, b768.clone()).unwrap_err(); // 512: one of the upstream's bins
        mr.add_bin(600, b768.clone()).unwrap(); // rounded up to 768
        mr.add_bin(700, b768.clone()).unwrap_err(); // 768 again
        mr.add_bin(4000, b4k.clone()).unwrap(); // 4096
        assert_eq!(mr.bin_sizes(), [256, 512, 768, 1024, 4096]);
        let s = StreamRef::LEGACY;
        // (request, then live allocations of the upstream, the 768-byte bin and the 4096-byte bin)
        for (bytes, counts) in [
            (200, (1, 0, 0)),  // the upstream's 256
            (600, (1, 1, 0)),  // 768 beats the upstream's 1024
            (700, (1, 2, 0)),  // 768
            (1000, (2, 2, 0)), // the upstream's 1024
            (2000, (2, 2, 1)), // 4096: the upstream has no bin that holds it
            (5000, (3, 2, 1)), // no bin: the upstream
        ] {
            mr.allocate(bytes, s).unwrap();
            assert_eq!(
                (
                    upstream.live_allocations(),
                    b768.live_allocations(),
                    b4k.live_allocations()
                ),
                counts,
                "after allocating {bytes} bytes"
            );
        }
        assert!(matches!(mr.add_bin(8192, sim()), Err(Error::Unsupported { .. })));
    }

    #[test]
    fn frees_go_where_their_allocation_went() {
        let (upstream, bin) = (sim(), sim());
        let mr = AddedBinsAdaptor::new(upstream.clone());
        mr.add_bin(1024, bin.clone()).unwrap();
        assert_eq!(
            mr.add_bin(1000, sim()).unwrap_err().to_string(),
            "AddedBinsAdaptor cannot serve this request: add_bin(1000): there is a bin of 1024 bytes already"
        );
        mr.add_bin(0, sim()).unwrap_err();
        let s = StreamRef::LEGACY;
        let (a, b) = (mr.allocate(1024, s).unwrap(), mr.allocate(1025, s).unwrap());
        // SAFETY: both came from `mr.allocate` with these sizes, freed once; the addresses are fake.
        #[allow(unsafe_code)]
        unsafe {
            mr.deallocate(a, 1024, s).unwrap();
            mr.deallocate(b, 1025, s).unwrap();
        }
        assert_eq!((upstream.live_allocations(), bin.live_allocations()), (0, 0));
        assert_eq!((upstream.total_allocations(), bin.total_allocations()), (1, 1));
    }

    #[test]
    fn mixed_frees_in_any_order_go_where_their_allocations_went() {
        let upstream = sim();
        let options = BinningOptions {
            min_size_exponent: 8,
            max_size_exponent: 12,
            ..BinningOptions::default()
        };
        let mr = AddedBinsAdaptor::over_binning(upstream.clone(), &options);
        let (b3k, b64k) = (sim(), sim());
        mr.add_bin(3000, b3k.clone()).unwrap(); // 3072, between the upstream's 2048 and 4096
        mr.add_bin(65_536, b64k.clone()).unwrap(); // above the upstream's largest bin (4096)
        let s = StreamRef::LEGACY;
        // (size, which resource serves it: 0 the upstream, 1 the 3072-byte bin, 2 the 64 KiB bin)
        let sizes = [
            (100, 0),
            (2049, 1),
            (3072, 1),
            (3073, 0), // the upstream's 4096 bin is smaller than 64 KiB
            (4096, 0),
            (4097, 2),
            (65_536, 2),
            (65_537, 0), // above every bin: the upstream, as a large allocation
            (1 << 26, 0),
        ];
        let counts = || {
            [
                upstream.live_allocations(),
                b3k.live_allocations(),
                b64k.live_allocations(),
            ]
        };
        let mut want = [0usize; 3];
        let mut live = Vec::new();
        for round in 0..3 {
            for &(bytes, at) in &sizes {
                live.push((mr.allocate(bytes, s).unwrap(), bytes, at));
                want[at] += 1;
                assert_eq!(counts(), want, "round {round}, after allocating {bytes} bytes");
            }
        }
        // Free in an order unlike the allocations' (a fixed permutation: stride 7 over 27, coprime).
        let n = live.len();
        for i in 0..n {
            let (p, bytes, at) = live[(i * 7) % n];
            // SAFETY: each came from `mr.allocate` with this size and is freed once (the stride visits every
            // index once); the addresses are fake.
            #[allow(unsafe_code)]
            unsafe {
                mr.deallocate(p, bytes, s).unwrap()
            };
            want[at] -= 1;
            assert_eq!(counts(), want, "after freeing {bytes} bytes");
        }
        assert_eq!(counts(), [0, 0, 0]);
        assert_eq!(
            [
                upstream.total_allocations(),
                b3k.total_allocations(),
                b64k.total_allocations()
            ],
            [15, 6, 6]
        );
    }

    #[test]
    fn a_bin_added_while_another_thread_allocates_is_used_or_refused() {
        for _ in 0..20 {
            let upstream = sim();
            let mr = Arc::new(AddedBinsAdaptor::new(upstream.clone()));
            let bins: Vec<Arc<SimResource>> = (0..64).map(|_| sim()).collect();
            let adder = {
                let (mr, bins) = (mr.clone(), bins.clone());
                std::thread::spawn(move || {
                    bins.iter()
                        .enumerate()
                        .filter(|(k, b)| mr.add_bin((k + 1) * 1024, (*b).clone() as SharedResource).is_ok())
                        .count()
                })
            };
            std::thread::yield_now();
            let p = mr.allocate(64 * 1024, StreamRef::LEGACY).unwrap();
            let added = adder.join().unwrap();
            // Every bin that `add_bin` accepted is one the adaptor routes to, and no other.
            assert_eq!(mr.fixed_bins().len(), added);
            assert_eq!(mr.bin_sizes().len(), added);
            assert_eq!(mr.bin_sizes(), (1..=added).map(|k| k * 1024).collect::<Vec<_>>());
            // The 64 KiB request went to the 64th bin if it was added in time, else to the upstream.
            let served_by_bin = bins[63].live_allocations();
            assert_eq!(served_by_bin + upstream.live_allocations(), 1);
            assert_eq!(served_by_bin == 1, added == 64);
            // SAFETY: `p` came from `mr.allocate` with this size and is freed once; the address is fake.
            #[allow(unsafe_code)]
            unsafe {
                mr.deallocate(p, 64 * 1024, StreamRef::LEGACY).unwrap()
            };
            assert_eq!(bins[63].live_allocations() + upstream.live_allocations(), 0);
        }
    }
}
