//! Where engines get their chunks of address space, and a simulation of it for host tests.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, OutOfMemoryCause};

use crate::types::{align_up, ALIGNMENT};

/// A source of large, stream-ordered allocations that an engine carves up.
///
/// On a GPU this is a memory resource over `cuMemAllocFromPoolAsync` or another resource; on the
/// host, [`SimUpstream`]. `S` is the stream type of the engine's [`StreamOrder`](super::StreamOrder).
///
/// Contract, as for every stream-ordered resource: memory from `allocate(n, s)` may be used on `s`
/// at once and on other streams only after they are ordered after `s`; `deallocate(a, n, s)` means
/// the range may be reused by work ordered after `s`.
pub trait Upstream<S> {
    /// Allocates `bytes` (a non-zero multiple of [`ALIGNMENT`]) and returns an address aligned to
    /// [`ALIGNMENT`]. Fails with [`Error::OutOfMemory`] when full (the engine may retry smaller),
    /// with any other [`Error`] otherwise.
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error>;
    /// Returns a range obtained from [`allocate`](Self::allocate) with the same `bytes`. Fails with
    /// an [`Error`] (usually [`Error::Upstream`]) when the upstream cannot take it back; the engine
    /// then forgets the range all the same and reports the error to its caller.
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error>;
}

impl<S, T: Upstream<S> + ?Sized> Upstream<S> for &T {
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error> {
        (**self).deallocate(addr, bytes, stream)
    }
}

impl<S, T: Upstream<S> + ?Sized> Upstream<S> for Arc<T> {
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error> {
        (**self).deallocate(addr, bytes, stream)
    }
}

/// The first address [`SimUpstream`] hands out. Non-zero, so that 0 stays the null address engines
/// return for 0-byte requests.
pub const SIM_BASE_ADDRESS: u64 = 1 << 40;

/// Counters of a [`SimUpstream`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimUpstreamStats {
    /// Successful `allocate` calls.
    pub allocations: u64,
    /// Successful `deallocate` calls.
    pub deallocations: u64,
    /// `allocate` calls refused for lack of capacity.
    pub failed_allocations: u64,
    /// Chunks allocated and not yet deallocated.
    pub live_chunks: usize,
    /// Bytes in live chunks.
    pub live_bytes: u64,
    /// The largest `live_bytes` seen.
    pub peak_bytes: u64,
}

#[derive(Debug)]
struct SimUpstreamState {
    /// Next address to hand out. Only grows: a simulated address is never reused, so a stale
    /// address in an engine can never alias a new chunk. Chunks are handed out back to back with no
    /// gap, so that an engine merging blocks across chunks would be caught.
    next: u64,
    /// `None`: unlimited.
    capacity: Option<u64>,
    /// Whether `deallocate` refuses (see [`SimUpstream::set_fail_deallocations`]).
    fail_deallocations: bool,
    /// Live chunks: start address -> size. Invariant: disjoint, sizes sum to `stats.live_bytes`.
    live: BTreeMap<u64, u64>,
    stats: SimUpstreamStats,
}

impl Default for SimUpstreamState {
    fn default() -> Self {
        Self {
            next: SIM_BASE_ADDRESS,
            capacity: None,
            fail_deallocations: false,
            live: BTreeMap::new(),
            stats: SimUpstreamStats::default(),
        }
    }
}

/// A simulated upstream for host tests and benches: hands out disjoint, [`ALIGNMENT`]-aligned
/// ranges of a fake address space, tracks live chunks, and can be given a capacity to test running
/// out of memory.
///
/// Cloning gives another handle to the same upstream, so a test can inspect it while (and after) an
/// engine owns the other.
///
/// # Panics
///
/// `deallocate` panics when the range is not a live chunk of exactly that size: the simulation
/// exists to catch engines that get this wrong.
///
/// ```
/// use mempool_suballoc::{SimUpstream, Upstream, Error};
///
/// let up = SimUpstream::with_capacity(4096);
/// let a = Upstream::<()>::allocate(&up, 4096, ())?;
/// assert!(matches!(Upstream::<()>::allocate(&up, 256, ()), Err(Error::OutOfMemory { requested: 256, .. })));
/// Upstream::<()>::deallocate(&up, a, 4096, ())?;
/// assert_eq!(up.stats().live_chunks, 0);
/// # Ok::<(), Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct SimUpstream {
    state: Arc<Mutex<SimUpstreamState>>,
}

impl SimUpstream {
    /// An upstream with unlimited capacity.
    pub fn new() -> Self {
        Self::default()
    }

    /// An upstream that refuses allocations that would take its live bytes past `capacity`.
    pub fn with_capacity(capacity: u64) -> Self {
        let up = Self::new();
        up.set_capacity(Some(capacity));
        up
    }

    fn lock(&self) -> MutexGuard<'_, SimUpstreamState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes the capacity (`None`: unlimited). Live chunks above it stay live.
    pub fn set_capacity(&self, capacity: Option<u64>) {
        self.lock().capacity = capacity;
    }

    /// Makes every later `deallocate` fail with [`Error::Upstream`], leaving the chunk live (or
    /// succeed again), to test error paths.
    pub fn set_fail_deallocations(&self, fail: bool) {
        self.lock().fail_deallocations = fail;
    }

    /// The counters so far.
    pub fn stats(&self) -> SimUpstreamStats {
        self.lock().stats
    }

    /// The live chunks, as `(address, size)` in address order.
    pub fn live_chunks(&self) -> Vec<(u64, u64)> {
        self.lock().live.iter().map(|(&a, &s)| (a, s)).collect()
    }

    /// Whether `[addr, addr + bytes)` lies inside one live chunk.
    pub fn contains(&self, addr: u64, bytes: u64) -> bool {
        let st = self.lock();
        match st.live.range(..=addr).next_back() {
            Some((&start, &size)) => addr.checked_add(bytes).is_some_and(|end| end <= start + size),
            None => false,
        }
    }
}

impl<S> Upstream<S> for SimUpstream {
    fn allocate(&self, bytes: u64, _stream: S) -> Result<u64, Error> {
        let oom = |cause| Error::OutOfMemory {
            requested: bytes,
            cause,
        };
        let size = align_up(bytes.max(1)).ok_or(oom(OutOfMemoryCause::AddressSpace))?;
        let mut st = self.lock();
        if st
            .capacity
            .is_some_and(|cap| st.stats.live_bytes.saturating_add(size) > cap)
        {
            st.stats.failed_allocations += 1;
            return Err(oom(OutOfMemoryCause::Upstream));
        }
        let addr = st.next;
        st.next = addr.checked_add(size).ok_or(oom(OutOfMemoryCause::AddressSpace))?;
        debug_assert_eq!(addr % ALIGNMENT, 0);
        st.live.insert(addr, size);
        st.stats.allocations += 1;
        st.stats.live_chunks += 1;
        st.stats.live_bytes += size;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.live_bytes);
        Ok(addr)
    }

    fn deallocate(&self, addr: u64, bytes: u64, _stream: S) -> Result<(), Error> {
        let mut st = self.lock();
        if st.fail_deallocations {
            return Err(Error::Upstream {
                op: "deallocate",
                source: "SimUpstream: deallocations were set to fail".into(),
            });
        }
        let size = st.live.remove(&addr);
        let expected = align_up(bytes.max(1));
        assert!(
            size.is_some() && size == expected,
            "SimUpstream: deallocate({addr:#x}, {bytes}) matches no live chunk (found {size:?})"
        );
        let size = size.unwrap_or(0);
        st.stats.deallocations += 1;
        st.stats.live_chunks -= 1;
        st.stats.live_bytes -= size;
        Ok(())
    }
}
