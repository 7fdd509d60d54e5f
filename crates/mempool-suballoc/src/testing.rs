//! Property-test machinery shared by the engines' tests: random operation sequences over simulated
//! streams and a recording upstream, checked after every step for what a user of the memory would
//! see (no overlap, alignment, containment, stream ordering) and for the engine's own invariants.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::engine::Engine;

use crate::error::Error;

use crate::sim::{SimEvent, SimStream, SimStreams, SyncPoint};
use crate::stream_order::StreamOrder;

use crate::types::{EngineStats, EventPolicy, ALIGNMENT};

use crate::sim::SimUpstream;
use crate::upstream::Upstream;

/// The stream of the engine call in progress, shared by the checking wrappers below: `None`
/// while releasing, or between calls.
type Current = Arc<Mutex<Option<SimStream>>>;

fn check_current(current: &Current, what: &str, stream: SimStream) {
    let cur = *current.lock().unwrap();
    assert!(
        cur == Some(stream),
        "{what} on {stream:?} while serving a call on {cur:?}: engines may only touch the \
         stream of the call in progress"
    );
}

/// A [`SimUpstream`] that also notes, for every chunk, the point in its stream's order at which it
/// was allocated, so the checker can tell whether a stream was ordered after it; and that checks
/// the module's contract on which streams an engine touches.
#[derive(Clone)]
pub(crate) struct RecordingUpstream {
    pub(crate) inner: SimUpstream,
    sim: SimStreams,
    log: Arc<Mutex<Vec<(u64, u64, SyncPoint)>>>,
    current: Current,
}

impl Upstream<SimStream> for RecordingUpstream {
    fn allocate(&self, bytes: u64, stream: SimStream) -> Result<u64, Error> {
        check_current(&self.current, "upstream allocate", stream);
        let addr = self.inner.allocate(bytes, stream)?;
        let p = self.sim.point(stream);
        self.log.lock().unwrap().push((addr, bytes, p));
        Ok(addr)
    }

    fn deallocate(&self, addr: u64, bytes: u64, stream: SimStream) -> Result<(), Error> {
        // Releasing returns chunks on the streams they came from, after synchronizing.
        if self.current.lock().unwrap().is_some() {
            check_current(&self.current, "upstream deallocate", stream);
        }
        self.inner.deallocate(addr, bytes, stream)
    }
}

/// [`SimStreams`] that check the contract on which streams an engine touches: waits always on the
/// stream of the call in progress, records too unless the policy is [`EventPolicy::RecordOnDemand`];
/// `synchronize` on any stream.
#[derive(Clone)]
pub(crate) struct CheckedStreams {
    sim: SimStreams,
    current: Current,
    strict_records: bool,
}

impl StreamOrder for CheckedStreams {
    type Stream = SimStream;
    type Event = SimEvent;
    fn create_event(&self) -> Result<SimEvent, Error> {
        self.sim.create_event()
    }
    fn record(&self, event: &mut SimEvent, stream: SimStream) -> Result<(), Error> {
        if self.strict_records {
            check_current(&self.current, "record", stream);
        }
        self.sim.record(event, stream)
    }
    fn wait(&self, stream: SimStream, event: &SimEvent) -> Result<(), Error> {
        check_current(&self.current, "wait", stream);
        self.sim.wait(stream, event)
    }
    fn synchronize(&self, stream: SimStream) -> Result<(), Error> {
        self.sim.synchronize(stream)
    }
}

/// A fresh simulated world: streams, and an upstream with an optional capacity.
pub(crate) struct World {
    pub(crate) up: RecordingUpstream,
    pub(crate) order: CheckedStreams,
    pub(crate) sim: SimStreams,
    current: Current,
}

/// A fresh [`World`]; `policy` is the engine's, which decides what the contract allows.
pub(crate) fn world(capacity: Option<u64>, policy: EventPolicy) -> World {
    let sim = SimStreams::new();
    let inner = SimUpstream::new();
    inner.set_capacity(capacity);
    let current = Current::default();
    World {
        up: RecordingUpstream {
            inner,
            sim: sim.clone(),
            log: Arc::default(),
            current: current.clone(),
        },
        order: CheckedStreams {
            sim: sim.clone(),
            current: current.clone(),
            strict_records: policy != EventPolicy::RecordOnDemand,
        },
        sim,
        current,
    }
}

impl World {
    fn serving(&self, stream: Option<SimStream>) {
        *self.current.lock().unwrap() = stream;
    }
}

/// One step of a random sequence.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    /// Allocate `size` bytes on stream `stream`.
    Alloc { size: u64, stream: usize },
    /// Free the live allocation number `pick % live` on stream `stream`.
    Free { pick: usize, stream: usize },
    /// Return the chunks with no live allocation to the upstream, on stream `stream`.
    ReleaseUnused { stream: usize },
}

/// Sequences of up to `len` operations on `streams` streams, sizes in `[0, max_size]` (biased
/// towards small sizes and 0, so free lists fill up and split).
pub(crate) fn ops(max_size: u64, streams: usize, len: usize) -> impl Strategy<Value = Vec<Op>> {
    let size = prop_oneof![
        1 => Just(0u64),
        4 => 1..=ALIGNMENT * 2,
        5 => 1..=max_size,
    ];
    let op = prop_oneof![
        30 => (size, 0..streams).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        20 => (any::<usize>(), 0..streams).prop_map(|(pick, stream)| Op::Free { pick, stream }),
        1 => (0..streams).prop_map(|stream| Op::ReleaseUnused { stream }),
    ];
    prop::collection::vec(op, 1..len)
}

/// Runs `ops` against `engine`, checking after every step; then frees everything, merges, checks
/// that releasing the unused chunks returns every chunk (so coalescing engines restored whole
/// chunks), releases, and checks the upstream got everything back. `oom_allowed`: whether
/// allocations may fail with out-of-memory (limited configurations).
pub(crate) fn run<E: Engine<Stream = SimStream>>(
    mut engine: E,
    w: &World,
    ops: &[Op],
    oom_allowed: bool,
) -> Result<(), TestCaseError> {
    let up = &w.up;
    let mut c = Checker {
        sim: w.sim.clone(),
        up: up.clone(),
        live: BTreeMap::new(),
        freed: HashMap::new(),
        chunks: BTreeMap::new(),
    };
    for op in ops {
        match *op {
            Op::Alloc { size, stream } => {
                let s = SimStream::new(stream);
                let before = engine.stats();
                w.serving(Some(s));
                let result = engine.allocate(size, s);
                w.serving(None);
                c.drain_upstream_log();
                match result {
                    Ok(addr) => c.allocated(&engine, before, addr, size, s)?,
                    Err(Error::OutOfMemory { requested, .. }) => {
                        prop_assert!(oom_allowed, "unexpected out-of-memory for {size} bytes");
                        prop_assert_eq!(requested, size, "OOM must report the size asked for");
                        let after = engine.stats();
                        prop_assert_eq!(after.used_bytes, before.used_bytes);
                        prop_assert_eq!(after.live_allocations, before.live_allocations);
                    }
                    Err(e) => prop_assert!(false, "allocate({size}) failed: {e}"),
                }
            }
            Op::Free { pick, stream } => {
                if c.live.is_empty() {
                    continue;
                }
                let (&addr, &(size, _)) = c.live.iter().nth(pick % c.live.len()).unwrap();
                c.free(w, &mut engine, addr, size, SimStream::new(stream))?;
            }
            Op::ReleaseUnused { stream } => {
                let before = engine.stats();
                w.serving(Some(SimStream::new(stream)));
                let released = engine.release_unused(SimStream::new(stream));
                w.serving(None);
                let released = released.map_err(|e| TestCaseError::fail(format!("release_unused failed: {e}")))?;
                let after = engine.stats();
                prop_assert_eq!(released, before.reserved_bytes - after.reserved_bytes);
                prop_assert_eq!(after.used_bytes, before.used_bytes);
            }
        }
        c.check_step(&engine)?;
    }
    // Free what is left, on rotating streams.
    let left: Vec<(u64, u64)> = c.live.iter().map(|(&a, &(s, _))| (a, s)).collect();
    for (k, (addr, size)) in left.into_iter().enumerate() {
        c.free(w, &mut engine, addr, size, SimStream::new(k % 3))?;
        c.check_step(&engine)?;
    }
    let st = engine.stats();
    prop_assert_eq!(st.used_bytes, 0);
    prop_assert_eq!(st.live_allocations, 0);
    prop_assert_eq!(st.free_bytes, st.reserved_bytes);

    w.serving(Some(SimStream::new(0)));
    engine.merge_free_lists(SimStream::new(0)).unwrap();
    w.serving(None);
    c.check_step(&engine)?;
    let reserved = engine.stats().reserved_bytes;
    w.serving(Some(SimStream::new(1)));
    let released = engine.release_unused(SimStream::new(1));
    w.serving(None);
    prop_assert_eq!(
        released.unwrap(),
        reserved,
        "with nothing live, releasing the unused chunks returns every chunk (coalesced whole)"
    );
    prop_assert_eq!(up.inner.stats().live_chunks, 0, "chunks not returned upstream");
    c.check_step(&engine)?;
    engine.release().unwrap();
    prop_assert_eq!(engine.stats(), EngineStats::default());
    prop_assert_eq!(up.inner.stats().live_chunks, 0, "chunks not returned upstream");
    drop(engine);
    prop_assert_eq!(up.inner.stats().live_chunks, 0);
    Ok(())
}

struct Checker {
    sim: SimStreams,
    up: RecordingUpstream,
    /// The caller's view: live allocations, address -> (bytes asked, stream).
    live: BTreeMap<u64, (u64, SimStream)>,
    /// Per 256-byte granule, the point its last user freed it at.
    freed: HashMap<u64, SyncPoint>,
    /// Upstream chunks ever allocated: address -> (size, point of allocation). SimUpstream never
    /// reuses addresses, so entries never go stale.
    chunks: BTreeMap<u64, (u64, SyncPoint)>,
}

impl Checker {
    fn drain_upstream_log(&mut self) {
        for (a, n, p) in self.up.log.lock().unwrap().drain(..) {
            self.chunks.insert(a, (n, p));
        }
    }

    fn allocated<E: Engine>(
        &mut self,
        engine: &E,
        before: EngineStats,
        addr: u64,
        size: u64,
        s: SimStream,
    ) -> Result<(), TestCaseError> {
        if size == 0 {
            prop_assert_eq!(addr, 0, "0 bytes must give the null address");
            prop_assert_eq!(engine.stats(), before, "0 bytes must not touch any state");
            return Ok(());
        }
        prop_assert!(addr != 0 && addr.is_multiple_of(ALIGNMENT), "bad address {addr:#x}");
        let end = addr + size;
        if let Some((&pa, &(ps, _))) = self.live.range(..addr).next_back() {
            prop_assert!(pa + ps <= addr, "[{addr:#x}, +{size}) overlaps live [{pa:#x}, +{ps})");
        }
        if let Some((&na, &(ns, _))) = self.live.range(addr..).next() {
            prop_assert!(end <= na, "[{addr:#x}, +{size}) overlaps live [{na:#x}, +{ns})");
        }
        prop_assert!(
            self.up.inner.contains(addr, size),
            "[{addr:#x}, +{size}) is not inside one live upstream chunk"
        );
        // Stream ordering: after the chunk's allocation, and after every previous free.
        let (&ca, &(cn, cp)) = self.chunks.range(..=addr).next_back().unwrap();
        prop_assert!(addr + size <= ca + cn);
        prop_assert!(
            self.sim.is_ordered_after(s, cp),
            "memory allocated upstream on {:?} handed to {s:?} without ordering",
            cp.stream
        );
        for g in addr / ALIGNMENT..end.div_ceil(ALIGNMENT) {
            if let Some(p) = self.freed.get(&g) {
                prop_assert!(
                    self.sim.is_ordered_after(s, *p),
                    "block freed on {:?} handed to {s:?} at {addr:#x} without waiting for the free",
                    p.stream
                );
            }
        }
        self.live.insert(addr, (size, s));
        Ok(())
    }

    fn free<E: Engine<Stream = SimStream>>(
        &mut self,
        w: &World,
        engine: &mut E,
        addr: u64,
        size: u64,
        s: SimStream,
    ) -> Result<(), TestCaseError> {
        // A well-behaved caller that uses (here: frees) a block on a stream other than the one it
        // was allocated on first orders that stream after the allocation.
        let allocated_on = self.live[&addr].1;
        if allocated_on != s {
            let mut ev = self.sim.create_event().unwrap();
            self.sim.record(&mut ev, allocated_on).unwrap();
            self.sim.wait(s, &ev).unwrap();
        }
        // The caller's last use of the block on `s` comes before the free.
        let p = self.sim.point(s);
        w.serving(Some(s));
        let result = engine.deallocate(addr, size, s);
        w.serving(None);
        if let Err(e) = result {
            return Err(TestCaseError::fail(format!(
                "deallocate({addr:#x}, {size}) failed: {e}"
            )));
        }
        for g in addr / ALIGNMENT..(addr + size).div_ceil(ALIGNMENT) {
            self.freed.insert(g, p);
        }
        self.live.remove(&addr);
        Ok(())
    }

    fn check_step<E: Engine>(&self, engine: &E) -> Result<(), TestCaseError> {
        if let Err(v) = engine.check_invariants() {
            return Err(TestCaseError::fail(v.to_string()));
        }
        let st = engine.stats();
        prop_assert_eq!(st.free_bytes + st.used_bytes, st.reserved_bytes);
        prop_assert_eq!(
            st.reserved_bytes,
            self.up.inner.stats().live_bytes,
            "reserved bytes disagree with the upstream"
        );
        prop_assert_eq!(st.upstream_chunks, self.up.inner.stats().live_chunks);
        prop_assert_eq!(st.live_allocations, self.live.len());
        let asked: u64 = self.live.values().map(|&(n, _)| n).sum();
        prop_assert!(st.used_bytes >= asked);
        for (&addr, &(size, _)) in &self.live {
            prop_assert!(
                self.up.inner.contains(addr, size),
                "live [{addr:#x}, +{size}) is no longer inside a live upstream chunk"
            );
        }
        Ok(())
    }
}
