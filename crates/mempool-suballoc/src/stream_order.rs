//! How engines order one stream after another, and a simulation of it for host tests.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::Error;

/// The stream operations an engine needs to hand free blocks from one stream to another.
///
/// The shape is CUDA's: an event is created once, re-recorded on a stream whenever the engine needs
/// a fresh point in that stream's order, and waited on by other streams. For real streams these are
/// [`cuEventCreate`], [`cuEventRecord`], [`cuStreamWaitEvent`] and [`cuStreamSynchronize`].
///
/// [`cuEventCreate`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html
/// [`cuEventRecord`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html
/// [`cuStreamWaitEvent`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html
/// [`cuStreamSynchronize`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html
///
/// Implementations report failures as [`Error::Stream`].
pub trait StreamOrder {
    /// A stream's identity: the engine keys its per-stream free lists by it. Two values compare equal
    /// exactly when they name the same stream.
    type Stream: Copy + Eq + Hash + Debug;
    /// An event: a point in one stream's order that other streams can wait for.
    type Event;

    /// Creates an event that has not been recorded yet (waiting on it orders nothing).
    fn create_event(&self) -> Result<Self::Event, Error>;
    /// Makes `event` stand for everything issued on `stream` so far, replacing what it stood for.
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error>;
    /// Orders all work issued on `stream` after this call after the point `event` stands for,
    /// without blocking the host.
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error>;
    /// Blocks the host until everything issued on `stream` has completed. Work issued on any stream
    /// afterwards is thereby ordered after it.
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error>;
}

impl<T: StreamOrder + ?Sized> StreamOrder for &T {
    type Stream = T::Stream;
    type Event = T::Event;
    fn create_event(&self) -> Result<Self::Event, Error> {
        (**self).create_event()
    }
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error> {
        (**self).record(event, stream)
    }
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error> {
        (**self).wait(stream, event)
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error> {
        (**self).synchronize(stream)
    }
}

impl<T: StreamOrder + ?Sized> StreamOrder for Arc<T> {
    type Stream = T::Stream;
    type Event = T::Event;
    fn create_event(&self) -> Result<Self::Event, Error> {
        (**self).create_event()
    }
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error> {
        (**self).record(event, stream)
    }
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error> {
        (**self).wait(stream, event)
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error> {
        (**self).synchronize(stream)
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
