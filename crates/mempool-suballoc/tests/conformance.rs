//! The host half of the conformance suite: the checks of mempool-rmm's GPU suite
//! (`crates/mempool-rmm/tests/conformance.rs`) that need no GPU, run against every engine, each in
//! several configurations, over `SimUpstream` and `SimStreams`, through the `Engine` trait.
//!
//! What a GPU would check by touching the memory is checked here on a shadow of the callers' view:
//! every address is aligned and inside a live upstream chunk, no two live allocations overlap, and
//! memory freed on one stream reaches another stream only once the simulated streams say that stream
//! is ordered after the free (an event wait or a synchronize the engine issued).

use std::collections::BTreeMap;
use std::sync::{mpsc, Mutex, MutexGuard, PoisonError};

use mempool_suballoc::workload::SplitMix64;
use mempool_suballoc::{
    ArenaOptions, BinningOptions, Engine, EngineOptions, Error, EventPolicy, FixedSizeOptions, PoolOptions, SimStream,
    SimStreams, SimUpstream, StreamOrder, SyncPoint, ALIGNMENT,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The callers' view of an engine's memory.
#[derive(Default)]
struct Shadow {
    /// Live allocations: address -> (bytes asked, stream).
    live: BTreeMap<u64, (u64, SimStream)>,
    /// Freed memory not handed out since: start -> (end, point of the free). Disjoint.
    freed: BTreeMap<u64, (u64, SyncPoint)>,
}

/// One engine over a simulated upstream and simulated streams, shared by the threads of a check.
struct World<C: EngineOptions> {
    /// The configuration, for failure messages.
    name: String,
    up: SimUpstream,
    sim: SimStreams,
    /// The largest request to make.
    max_size: u64,
    /// The engine and the shadow, behind one lock so that the shadow sees the engine's order.
    state: Mutex<(C::Engine<SimUpstream, SimStreams>, Shadow)>,
}

impl<C: EngineOptions> World<C> {
    fn new(options: C, max_size: u64) -> Self {
        let up = SimUpstream::new();
        let sim = SimStreams::new();
        let name = format!("{options:?}");
        let engine =
            Engine::new(up.clone(), sim.clone(), options).unwrap_or_else(|e| panic!("{name}: engine not built: {e}"));
        World {
            name,
            up,
            sim,
            max_size,
            state: Mutex::new((engine, Shadow::default())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (C::Engine<SimUpstream, SimStreams>, Shadow)> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Allocates `bytes` on `s` and checks the result against the shadow.
    fn allocate(&self, bytes: u64, s: SimStream) -> u64 {
        let mut guard = self.lock();
        let (engine, shadow) = &mut *guard;
        let name = &self.name;
        let before = engine.stats();
        let addr = engine
            .allocate(bytes, s)
            .unwrap_or_else(|e| panic!("{name}: allocate({bytes}) on {s:?}: {e}"));
        if bytes == 0 {
            assert_eq!(addr, 0, "{name}: 0 bytes is the null address");
            assert_eq!(engine.stats(), before, "{name}: 0 bytes touches no state");
            return 0;
        }
        assert!(
            addr != 0 && addr % ALIGNMENT == 0,
            "{name}: {bytes} bytes at {addr:#x}, not aligned"
        );
        let end = addr + bytes;
        assert!(
            self.up.contains(addr, bytes),
            "{name}: [{addr:#x}, +{bytes}) is not inside one live upstream chunk"
        );
        if let Some((&a, &(n, _))) = shadow.live.range(..addr).next_back() {
            assert!(
                a + n <= addr,
                "{name}: [{addr:#x}, +{bytes}) overlaps live [{a:#x}, +{n})"
            );
        }
        if let Some((&a, &(n, _))) = shadow.live.range(addr..).next() {
            assert!(end <= a, "{name}: [{addr:#x}, +{bytes}) overlaps live [{a:#x}, +{n})");
        }
        // Every free of this memory must be ordered before its use on `s`. Carve the allocation out
        // of the freed ranges, keeping what is left of them.
        let overlapping: Vec<(u64, u64, SyncPoint)> = shadow
            .freed
            .range(..end)
            .rev()
            .take_while(|(_, &(e, _))| e > addr)
            .map(|(&a, &(e, p))| (a, e, p))
            .collect();
        for (a, e, p) in overlapping {
            assert!(
                self.sim.is_ordered_after(s, p),
                "{name}: memory freed on {:?} handed to {s:?} at {addr:#x} without ordering",
                p.stream
            );
            shadow.freed.remove(&a);
            if a < addr {
                shadow.freed.insert(a, (addr, p));
            }
            if end < e {
                shadow.freed.insert(end, (e, p));
            }
        }
        shadow.live.insert(addr, (bytes, s));
        addr
    }

    /// Frees `addr` (allocated with `bytes`) on `s`, after the caller's last use of it on `s`.
    fn deallocate(&self, addr: u64, bytes: u64, s: SimStream) {
        let mut guard = self.lock();
        let (engine, shadow) = &mut *guard;
        let name = &self.name;
        let used_until = self.sim.point(s);
        engine
            .deallocate(addr, bytes, s)
            .unwrap_or_else(|e| panic!("{name}: deallocate({addr:#x}, {bytes}) on {s:?}: {e}"));
        if bytes == 0 {
            return;
        }
        shadow.live.remove(&addr);
        shadow.freed.insert(addr, (addr + bytes, used_until));
    }

    /// The engine's memory map against its statistics and the shadow: its chunks are the reserved bytes,
    /// each chunk's ranges cover it in address order, the used ranges are exactly the live allocations
    /// (same start, at least the size asked for) and add up to the used bytes, free ranges name a stream.
    fn check_map(&self) {
        let guard = self.lock();
        let (engine, shadow) = &*guard;
        let name = &self.name;
        let st = engine.stats();
        let maps = engine.memory_map();
        let sum = mempool_suballoc::summarize(&maps);
        assert_eq!(
            (sum.reserved_bytes, sum.free_bytes),
            (st.reserved_bytes, st.free_bytes),
            "{name}"
        );
        let mut used: BTreeMap<u64, u64> = BTreeMap::new();
        for m in &maps {
            let mut at = m.addr;
            for r in &m.ranges {
                assert_eq!(r.addr, at, "{name}: chunk {:#x} not covered in order", m.addr);
                at += r.size;
                if r.used {
                    used.insert(r.addr, r.size);
                } else {
                    assert!(r.stream.is_some(), "{name}: free range {r:?} names no stream");
                }
            }
            assert_eq!(at, m.addr + m.size, "{name}: chunk {:#x}", m.addr);
        }
        assert_eq!(used.values().sum::<u64>(), st.used_bytes, "{name}");
        assert_eq!(used.len(), shadow.live.len(), "{name}: used ranges vs live allocations");
        for (&p, &(bytes, _)) in &shadow.live {
            assert!(
                used.get(&p).is_some_and(|&n| n >= bytes),
                "{name}: live [{p:#x}, +{bytes}) is no used range"
            );
        }
    }

    /// After a check has freed everything: the engine's books balance, nothing is used, and
    /// `release_unused` returns every chunk to the upstream.
    fn finish(self) {
        let name = self.name;
        let (mut engine, shadow) = self.state.into_inner().unwrap_or_else(PoisonError::into_inner);
        assert!(shadow.live.is_empty(), "{name}: the check left allocations live");
        engine.check_invariants().unwrap_or_else(|v| panic!("{name}: {v}"));
        let st = engine.stats();
        assert_eq!((st.used_bytes, st.live_allocations), (0, 0), "{name}: {st:?}");
        assert_eq!(st.reserved_bytes, self.up.stats().live_bytes, "{name}");
        let released = engine.release_unused(SimStream::new(0)).unwrap();
        assert_eq!(
            released, st.reserved_bytes,
            "{name}: release_unused returns every chunk"
        );
        assert_eq!(self.up.stats().live_chunks, 0, "{name}");
        engine.release().unwrap();
        drop(engine);
        assert_eq!(self.up.stats().live_chunks, 0, "{name}");
    }
}

/// The checks, each run by [`each_engine`] for every engine and configuration.
#[derive(Clone, Copy, Debug)]
enum Check {
    ZeroBytes,
    SizesAreAligned,
    ImpossibleSizeIsOutOfMemory,
    RandomAllocations,
    MixedAllocateAndFree,
    FourThreads,
    AllocateAndFreeOnDifferentThreads,
    AllocateAndFreeOnDifferentStreams,
    ReleaseUnusedKeepsLiveAllocations,
}

/// Every engine, in several configurations, with the largest request each serves here.
fn each_engine(check: Check) {
    let pools = [
        (PoolOptions::default(), GIB),
        (
            PoolOptions {
                initial_size: MIB,
                maximum_size: Some(2 * GIB),
                event_policy: EventPolicy::RecordOnFree,
            },
            64 * MIB,
        ),
        (
            PoolOptions {
                event_policy: EventPolicy::RecordOnDemand,
                ..Default::default()
            },
            GIB,
        ),
    ];
    for (options, max_size) in pools {
        run(check, options, max_size);
    }
    let fixed = [
        (FixedSizeOptions::default(), MIB),
        (
            FixedSizeOptions {
                block_size: 64 * KIB,
                blocks_per_chunk: 4,
                event_policy: EventPolicy::RecordOnFree,
            },
            64 * KIB,
        ),
    ];
    for (options, max_size) in fixed {
        run(check, options, max_size);
    }
    let binning = [
        (BinningOptions::default(), GIB),
        (
            BinningOptions {
                min_size_exponent: 8,
                max_size_exponent: 12,
                blocks_per_chunk: 2,
                event_policy: EventPolicy::RecordOnDemand,
            },
            GIB,
        ),
    ];
    for (options, max_size) in binning {
        run(check, options, max_size);
    }
    let arenas = [
        (ArenaOptions::default(), GIB),
        (
            ArenaOptions {
                superblock_size: 64 * KIB,
                initial_size: MIB,
                maximum_size: None,
                event_policy: EventPolicy::RecordOnFree,
            },
            GIB,
        ),
    ];
    for (options, max_size) in arenas {
        run(check, options, max_size);
    }
}

fn run<C: EngineOptions>(check: Check, options: C, max_size: u64) {
    let w = World::new(options, max_size);
    match check {
        Check::ZeroBytes => zero_bytes(&w),
        Check::SizesAreAligned => sizes_are_aligned(&w),
        Check::ImpossibleSizeIsOutOfMemory => impossible_size_is_out_of_memory(&w),
        Check::RandomAllocations => random_allocations(&w),
        Check::MixedAllocateAndFree => mixed_allocate_and_free(&w),
        Check::FourThreads => four_threads(&w),
        Check::AllocateAndFreeOnDifferentThreads => allocate_and_free_on_different_threads(&w),
        Check::AllocateAndFreeOnDifferentStreams => allocate_and_free_on_different_streams(&w),
        Check::ReleaseUnusedKeepsLiveAllocations => release_unused_keeps_live_allocations(&w),
    }
    w.finish();
}

fn zero_bytes<C: EngineOptions>(w: &World<C>) {
    let s = SimStream::new(0);
    let p = w.allocate(0, s);
    w.deallocate(p, 0, s);
    // Freeing 0 bytes is a no-op whatever the address.
    let q = w.allocate(100, s);
    w.deallocate(q, 0, s);
    w.deallocate(q, 100, s);
}

fn sizes_are_aligned<C: EngineOptions>(w: &World<C>) {
    let s = SimStream::new(0);
    let mut size = 4;
    while size <= w.max_size {
        let p = w.allocate(size, s);
        w.deallocate(p, size, s);
        size *= 4;
    }
}

fn impossible_size_is_out_of_memory<C: EngineOptions>(w: &World<C>) {
    let s = SimStream::new(0);
    w.up.set_capacity(Some(1 << 40));
    let huge = 1u64 << 52;
    let e = w.lock().0.allocate(huge, s).unwrap_err();
    match e {
        Error::OutOfMemory { requested, .. } => {
            assert_eq!(requested, huge, "{}", w.name);
            assert!(
                e.to_string().contains(&huge.to_string()),
                "the error names the size: {e}"
            );
        }
        Error::TooLarge { requested, .. } => assert_eq!(requested, huge, "{}", w.name),
        e => panic!("{}: {e}", w.name),
    }
    w.up.set_capacity(None);
}

fn random_allocations<C: EngineOptions>(w: &World<C>) {
    let s = SimStream::new(0);
    let mut rng = SplitMix64(1);
    let max = w.max_size.min(MIB);
    let mut live: Vec<(u64, u64)> = (0..1000)
        .map(|_| {
            let size = 1 + rng.below(max);
            (w.allocate(size, s), size)
        })
        .collect();
    while !live.is_empty() {
        let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
        w.deallocate(p, size, s);
    }
}

fn mixed_allocate_and_free<C: EngineOptions>(w: &World<C>) {
    let s = SimStream::new(0);
    let mut rng = SplitMix64(2);
    let max = w.max_size.min(MIB);
    let mut live = Vec::new();
    for _ in 0..4000 {
        if live.is_empty() || rng.below(100) < 60 {
            let size = 1 + rng.below(max);
            live.push((w.allocate(size, s), size));
        } else {
            let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
            w.deallocate(p, size, s);
        }
    }
    w.check_map();
    for (p, size) in live {
        w.deallocate(p, size, s);
    }
    w.check_map();
}

/// Four threads, each on a stream of its own: memory moves between them only through the engine.
fn four_threads<C: EngineOptions>(w: &World<C>) {
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let s = SimStream::new(t as usize);
                let mut rng = SplitMix64(10 + t);
                let max = w.max_size.min(256 * KIB);
                let mut live = Vec::new();
                for _ in 0..500 {
                    if live.is_empty() || rng.below(100) < 60 {
                        let size = 4 + rng.below(max - 4);
                        live.push((w.allocate(size, s), size));
                    } else {
                        let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        w.deallocate(p, size, s);
                    }
                }
                for (p, size) in live {
                    w.deallocate(p, size, s);
                }
            });
        }
    });
}

/// One thread allocates on its stream and "uses" the memory there; another frees it on its own
/// stream after waiting on an event recorded after that use.
fn allocate_and_free_on_different_threads<C: EngineOptions>(w: &World<C>) {
    let (tx, rx) = mpsc::channel();
    let size = w.max_size.min(MIB);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let a = SimStream::new(0);
            for _ in 0..50 {
                let p = w.allocate(size, a);
                w.sim.point(a); // the kernel that uses it
                let mut done = w.sim.create_event().unwrap();
                w.sim.record(&mut done, a).unwrap();
                tx.send((p, done)).unwrap();
            }
        });
        scope.spawn(move || {
            let b = SimStream::new(1);
            for (p, done) in rx {
                w.sim.wait(b, &done).unwrap();
                w.deallocate(p, size, b);
            }
        });
    });
    // Memory freed on the second thread's stream is reused on the first one's only once ordered.
    let a = SimStream::new(0);
    let p = w.allocate(size, a);
    w.deallocate(p, size, a);
}

fn allocate_and_free_on_different_streams<C: EngineOptions>(w: &World<C>) {
    let (a, b) = (SimStream::new(0), SimStream::new(1));
    let size = w.max_size.min(MIB);
    for _ in 0..100 {
        let p = w.allocate(size, a);
        w.sim.point(a); // the kernel that uses it
        let mut done = w.sim.create_event().unwrap();
        w.sim.record(&mut done, a).unwrap();
        w.sim.wait(b, &done).unwrap();
        w.deallocate(p, size, b);
        // The next allocation on `a` may get the memory freed on `b`: the engine must order it.
        let q = w.allocate(size, a);
        w.deallocate(q, size, a);
    }
}

/// Not in the GPU suite: `release_unused` returns the chunks nothing lives in, and only those.
fn release_unused_keeps_live_allocations<C: EngineOptions>(w: &World<C>) {
    let streams = [0, 1, 2].map(SimStream::new);
    let mut rng = SplitMix64(3);
    let max = w.max_size.min(256 * KIB);
    let mut live = Vec::new();
    for k in 0..600 {
        let s = streams[k % 3];
        let size = 1 + rng.below(max);
        live.push((w.allocate(size, s), size, s));
    }
    for (round, &stream) in streams.iter().enumerate() {
        // Free two thirds, each on the stream it was allocated on, then release what is unused.
        let mut kept = Vec::new();
        for (k, (p, size, s)) in live.into_iter().enumerate() {
            if k % 3 == round {
                kept.push((p, size, s));
            } else {
                w.deallocate(p, size, s);
            }
        }
        live = kept;
        w.check_map();
        let mut guard = w.lock();
        let (engine, shadow) = &mut *guard;
        let before = engine.stats();
        let released = engine.release_unused(stream).unwrap();
        let after = engine.stats();
        assert_eq!(released, before.reserved_bytes - after.reserved_bytes, "{}", w.name);
        assert_eq!(after.used_bytes, before.used_bytes, "{}", w.name);
        engine.check_invariants().unwrap_or_else(|v| panic!("{}: {v}", w.name));
        for (&p, &(size, _)) in &shadow.live {
            assert!(
                w.up.contains(p, size),
                "{}: live [{p:#x}, +{size}) was released",
                w.name
            );
        }
    }
    for (p, size, s) in live {
        w.deallocate(p, size, s);
    }
}

/// One test per check, named as in the GPU suite, each over every engine and configuration.
mod every_engine {
    use super::{each_engine, Check};

    #[test]
    fn zero_bytes() {
        each_engine(Check::ZeroBytes);
    }

    #[test]
    fn sizes_are_aligned() {
        each_engine(Check::SizesAreAligned);
    }

    #[test]
    fn impossible_size_is_out_of_memory() {
        each_engine(Check::ImpossibleSizeIsOutOfMemory);
    }

    #[test]
    fn random_allocations() {
        each_engine(Check::RandomAllocations);
    }

    #[test]
    fn mixed_allocate_and_free() {
        each_engine(Check::MixedAllocateAndFree);
    }

    #[test]
    fn four_threads() {
        each_engine(Check::FourThreads);
    }

    #[test]
    fn allocate_and_free_on_different_threads() {
        each_engine(Check::AllocateAndFreeOnDifferentThreads);
    }

    #[test]
    fn allocate_and_free_on_different_streams() {
        each_engine(Check::AllocateAndFreeOnDifferentStreams);
    }

    #[test]
    fn release_unused_keeps_live_allocations() {
        each_engine(Check::ReleaseUnusedKeepsLiveAllocations);
    }
}
