//! The host simulation behind the engines' tests and benchmarks: [`SimUpstream`], a recording source
//! of address space, and [`SimStreams`], simulated streams with vector clocks. Behind the cargo feature
//! `testing` (and always in this crate's own unit tests): nothing in a program needs a simulation.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, OutOfMemoryCause};
use crate::stream_order::StreamOrder;
use crate::types::{align_up, ALIGNMENT};
use crate::upstream::Upstream;

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

/// How many streams [`SimStreams`] simulates.
pub const SIM_MAX_STREAMS: usize = 8;

/// A vector clock: entry `i` is the latest point of stream `i` that something is ordered after.
type Clock = [u64; SIM_MAX_STREAMS];

fn join(into: &mut Clock, other: &Clock) {
    for (a, b) in into.iter_mut().zip(other) {
        *a = (*a).max(*b);
    }
}

/// A simulated stream: an index below [`SIM_MAX_STREAMS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SimStream(u8);

impl SimStream {
    /// The simulated stream number `index`.
    ///
    /// # Panics
    ///
    /// If `index >= SIM_MAX_STREAMS`.
    pub const fn new(index: usize) -> Self {
        assert!(index < SIM_MAX_STREAMS, "SimStream index out of range");
        Self(index as u8)
    }

    /// The stream's number.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// A simulated event: the vector clock of the stream it was last recorded on, at that moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimEvent {
    /// `None` until first recorded; waiting on an unrecorded event orders nothing, as in CUDA.
    clock: Option<Clock>,
}

/// A point in one simulated stream's order: "the `time`-th operation issued on `stream`".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SyncPoint {
    /// The stream the operation was issued on.
    pub stream: SimStream,
    /// Its position in that stream's order (1 for the first operation).
    pub time: u64,
}

/// How many operations of each kind a [`SimStreams`] has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStreamCounts {
    /// Calls to `create_event`.
    pub events_created: u64,
    /// Calls to `record`.
    pub records: u64,
    /// Calls to `wait` (including failed ones).
    pub waits: u64,
    /// Calls to `synchronize`.
    pub synchronizes: u64,
}

/// The state behind a [`SimStreams`] handle.
#[derive(Debug, Default)]
struct SimState {
    /// Per stream, the vector clock of the last operation issued on it. Invariant: entry `s` of
    /// `streams[s]` counts the operations issued on `s`; every other entry only grows.
    streams: [Clock; SIM_MAX_STREAMS],
    /// What the host has synchronized with: every operation issued afterwards, on any stream, is
    /// ordered after it. Folded into a stream's clock whenever the stream is touched.
    host: Clock,
    counts: SimStreamCounts,
    fail_waits: bool,
}

impl SimState {
    /// The clock of `s`, with the host's synchronizations folded in.
    fn clock(&mut self, s: SimStream) -> &mut Clock {
        let host = self.host;
        let c = &mut self.streams[s.index()];
        join(c, &host);
        c
    }

    /// Issues one operation on `s` and returns its clock.
    fn issue(&mut self, s: SimStream) -> &mut Clock {
        let c = self.clock(s);
        c[s.index()] += 1;
        c
    }
}

/// Simulated streams and events for host tests: logical (vector) clocks that record which orderings
/// the engine established, so a test can assert that every block handed from one stream to another
/// was ordered after its free.
///
/// Cloning gives another handle to the same simulation, so a test can keep one while an engine owns
/// the other.
///
/// ```
/// use mempool_suballoc::{SimStream, SimStreams, StreamOrder};
///
/// let sim = SimStreams::new();
/// let (a, b) = (SimStream::new(0), SimStream::new(1));
/// let freed = sim.point(a); // say, a block was freed on `a` here
/// assert!(!sim.is_ordered_after(b, freed));
/// let mut ev = sim.create_event()?;
/// sim.record(&mut ev, a)?;
/// sim.wait(b, &ev)?;
/// assert!(sim.is_ordered_after(b, freed));
/// # Ok::<(), mempool_suballoc::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct SimStreams {
    state: Arc<Mutex<SimState>>,
}

impl SimStreams {
    /// A fresh simulation: no stream is ordered after any other.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic elsewhere cannot leave the clocks half-updated in a way that matters to a test.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Issues an operation on `stream` (say, the free of a block) and returns its point in the
    /// stream's order.
    pub fn point(&self, stream: SimStream) -> SyncPoint {
        let mut st = self.lock();
        let time = st.issue(stream)[stream.index()];
        SyncPoint { stream, time }
    }

    /// Whether work issued on `stream` now would be ordered after `point`: trivially when `point`
    /// is on `stream`, otherwise only through waits on events and host synchronizations.
    pub fn is_ordered_after(&self, stream: SimStream, point: SyncPoint) -> bool {
        let mut st = self.lock();
        st.clock(stream)[point.stream.index()] >= point.time
    }

    /// How many operations of each kind were issued so far.
    pub fn counts(&self) -> SimStreamCounts {
        self.lock().counts
    }

    /// Makes every later `wait` fail with [`Error::Stream`] (or succeed again), to test error paths.
    pub fn set_fail_waits(&self, fail: bool) {
        self.lock().fail_waits = fail;
    }
}

impl StreamOrder for SimStreams {
    type Stream = SimStream;
    type Event = SimEvent;

    fn create_event(&self) -> Result<SimEvent, Error> {
        self.lock().counts.events_created += 1;
        Ok(SimEvent::default())
    }

    fn record(&self, event: &mut SimEvent, stream: SimStream) -> Result<(), Error> {
        let mut st = self.lock();
        st.counts.records += 1;
        event.clock = Some(*st.issue(stream));
        Ok(())
    }

    fn wait(&self, stream: SimStream, event: &SimEvent) -> Result<(), Error> {
        let mut st = self.lock();
        st.counts.waits += 1;
        if st.fail_waits {
            return Err(Error::Stream {
                op: "wait",
                source: "SimStreams: waits were set to fail".into(),
            });
        }
        let c = st.issue(stream);
        if let Some(e) = &event.clock {
            join(c, e);
        }
        Ok(())
    }

    fn synchronize(&self, stream: SimStream) -> Result<(), Error> {
        let mut st = self.lock();
        st.counts.synchronizes += 1;
        let c = *st.clock(stream);
        join(&mut st.host, &c);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orderings_are_transitive_and_host_synchronize_orders_everything() {
        let sim = SimStreams::new();
        let [a, b, c] = [0, 1, 2].map(SimStream::new);
        let p = sim.point(a);
        assert!(sim.is_ordered_after(a, p));
        assert!(!sim.is_ordered_after(b, p));

        let mut ev = sim.create_event().unwrap();
        // Waiting on an unrecorded event orders nothing.
        sim.wait(b, &ev).unwrap();
        assert!(!sim.is_ordered_after(b, p));
        sim.record(&mut ev, a).unwrap();
        let later = sim.point(a);
        sim.wait(b, &ev).unwrap();
        assert!(sim.is_ordered_after(b, p));
        assert!(!sim.is_ordered_after(b, later), "the event predates `later`");

        // c after b after a.
        let mut ev_b = sim.create_event().unwrap();
        sim.record(&mut ev_b, b).unwrap();
        sim.wait(c, &ev_b).unwrap();
        assert!(sim.is_ordered_after(c, p));
        assert!(!sim.is_ordered_after(c, later));

        sim.synchronize(a).unwrap();
        assert!(sim.is_ordered_after(c, later));
        assert_eq!(
            sim.counts(),
            SimStreamCounts {
                events_created: 2,
                records: 2,
                waits: 3,
                synchronizes: 1
            }
        );
    }

    #[test]
    fn failing_waits_establish_no_order() {
        let sim = SimStreams::new();
        let [a, b] = [0, 1].map(SimStream::new);
        let p = sim.point(a);
        let mut ev = sim.create_event().unwrap();
        sim.record(&mut ev, a).unwrap();
        sim.set_fail_waits(true);
        assert!(matches!(sim.wait(b, &ev), Err(Error::Stream { op: "wait", .. })));
        assert!(!sim.is_ordered_after(b, p));
    }
}
