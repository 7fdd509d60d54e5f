//! Property tests of concurrent use: several threads, each on its own simulated stream, run random
//! allocate/free sequences against one [`Sharded`] engine (every engine kind, one to four shards),
//! handing some allocations to other threads to free. Checked: no two live allocations overlap at
//! any moment (a shared model of live ranges, updated before a free and after an allocation), the
//! engines' invariants at a quiescent point, and conservation of bytes: the live count matches the
//! model, free + used = reserved = what the upstream has out, and everything goes back to the
//! upstream at the end.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};

use mempool_suballoc::workload::SplitMix64;
use mempool_suballoc::{
    align_up, ArenaOptions, BinningOptions, Engine, EngineOptions, Error, FixedSizeOptions, PoolOptions, Sharded,
    SimStream, SimStreams, SimUpstream,
};
use proptest::prelude::*;

type Live = Mutex<BTreeMap<u64, u64>>;

/// Records `[addr, addr + size)` as live; fails if it overlaps a live range.
fn claim(live: &Live, addr: u64, size: u64) -> Result<(), String> {
    let mut m = live.lock().unwrap();
    if let Some((&a, &s)) = m.range(..=addr).next_back() {
        if a + s > addr {
            return Err(format!("[{addr:#x}, +{size}) overlaps live [{a:#x}, +{s})"));
        }
    }
    if let Some((&a, &s)) = m.range(addr..).next() {
        if addr + size > a {
            return Err(format!("[{addr:#x}, +{size}) overlaps live [{a:#x}, +{s})"));
        }
    }
    m.insert(addr, size);
    Ok(())
}

struct Params {
    threads: usize,
    shards: usize,
    ops: usize,
    max_size: u64,
    seed: u64,
}

/// Runs the concurrent sequence against the engines `options` names; returns the first failure.
fn run<C: EngineOptions>(options: C, p: &Params) -> Result<(), String> {
    let up = SimUpstream::new();
    let sim = SimStreams::new();
    let engines: Sharded<C::Engine<SimUpstream, SimStreams>> =
        Sharded::new(p.shards, || Engine::new(up.clone(), sim.clone(), options.clone())).map_err(|e| e.to_string())?;
    let live: Live = Live::default();
    // Allocations handed from one thread to another, which frees them on its own stream.
    let handed: Mutex<Vec<(u64, u64)>> = Mutex::default();
    let barrier = Barrier::new(p.threads);
    let (ops, max_size, seed) = (p.ops, p.max_size, p.seed);
    let (engines, live, handed, barrier, up_ref) = (&engines, &live, &handed, &barrier, &up);
    std::thread::scope(|scope| -> Result<(), String> {
        let handles: Vec<_> = (0..p.threads)
            .map(|t| {
                let up = up_ref;
                scope.spawn(move || -> Result<(), String> {
                    let s = SimStream::new(t);
                    let mut rng = SplitMix64(seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    let mut mine: Vec<(u64, u64)> = Vec::new();
                    let free = |addr: u64, bytes: u64| -> Result<(), String> {
                        // Out of the model before the engine may hand it out again.
                        live.lock().unwrap().remove(&addr);
                        engines
                            .deallocate(addr, bytes, s)
                            .map_err(|e| format!("thread {t}: free of {addr:#x} ({bytes} bytes): {e}"))
                    };
                    for _ in 0..ops {
                        let r = rng.below(100);
                        if r < 55 || mine.is_empty() {
                            let bytes = 1 + rng.below(max_size);
                            let addr = engines
                                .allocate(bytes, s)
                                .map_err(|e| format!("thread {t}: allocate {bytes}: {e}"))?;
                            if addr % 256 != 0 || !up.contains(addr, bytes) {
                                return Err(format!("thread {t}: {addr:#x} is misaligned or outside the upstream"));
                            }
                            claim(live, addr, align_up(bytes).unwrap())?;
                            mine.push((addr, bytes));
                        } else if r < 60 {
                            let k = rng.below(mine.len() as u64) as usize;
                            handed.lock().unwrap().push(mine.swap_remove(k));
                        } else if r < 70 {
                            let other = handed.lock().unwrap().pop();
                            if let Some((a, n)) = other {
                                free(a, n)?;
                            }
                        } else {
                            let k = rng.below(mine.len() as u64) as usize;
                            let (a, n) = mine.swap_remove(k);
                            free(a, n)?;
                        }
                    }
                    // A quiescent point: every thread stopped; the books must balance.
                    barrier.wait();
                    if t == 0 {
                        engines.check_invariants().map_err(|e| e.to_string())?;
                        let st = engines.stats();
                        let model = live.lock().unwrap();
                        let model_bytes: u64 = model.values().sum();
                        if st.live_allocations != model.len()
                            || st.used_bytes < model_bytes
                            || st.free_bytes + st.used_bytes != st.reserved_bytes
                            || st.reserved_bytes != up.stats().live_bytes
                        {
                            return Err(format!(
                            "books do not balance: {st:?}; model: {} allocations of {model_bytes} bytes; upstream {:?}",
                            model.len(),
                            up.stats()
                        ));
                        }
                    }
                    barrier.wait();
                    for (a, n) in std::mem::take(&mut mine) {
                        free(a, n)?;
                    }
                    loop {
                        let other = handed.lock().unwrap().pop();
                        match other {
                            Some((a, n)) => free(a, n)?,
                            None => break,
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a thread panicked".to_string())??;
        }
        Ok(())
    })?;
    engines.check_invariants().map_err(|e| e.to_string())?;
    let st = engines.stats();
    if st.used_bytes != 0 || st.live_allocations != 0 || st.free_bytes != st.reserved_bytes {
        return Err(format!("after every free: {st:?}"));
    }
    let released = engines.release_unused(SimStream::new(0)).map_err(|e| e.to_string())?;
    if released != st.reserved_bytes || up.stats().live_chunks != 0 {
        return Err(format!(
            "release_unused returned {released} of {} reserved bytes; upstream {:?}",
            st.reserved_bytes,
            up.stats()
        ));
    }
    Ok(())
}

#[test]
fn a_foreign_free_is_refused_by_every_shard() {
    let up = SimUpstream::new();
    let engines = Sharded::new(3, || {
        mempool_suballoc::PoolEngine::new(up.clone(), SimStreams::new(), PoolOptions::default())
    })
    .unwrap();
    let s = SimStream::new(0);
    let a = engines.allocate(1000, s).unwrap();
    assert!(matches!(
        engines.deallocate(a + 256, 1000, s),
        Err(Error::UnknownAllocation { .. })
    ));
    assert!(matches!(
        engines.deallocate(a, 5000, s),
        Err(Error::UnknownAllocation { .. })
    ));
    engines.deallocate(a, 1000, s).unwrap();
    assert!(matches!(
        engines.deallocate(a, 1000, s),
        Err(Error::UnknownAllocation { .. })
    ));
}

#[test]
fn frees_from_a_thread_that_allocated_nothing_reach_the_right_shard_whatever_its_hints_say() {
    // Blocks of two shards whose first chunks (32 KiB each, adjacent in the upstream) share one 1 MiB
    // region, so the consumer's hint for the region names the wrong shard half the time (and its own
    // shard, whichever it is, knows half of them).
    let up = SimUpstream::new();
    let options = mempool_suballoc::BinningOptions {
        min_size_exponent: 8,
        max_size_exponent: 10,
        ..Default::default()
    };
    let engines = Arc::new(
        Sharded::new(2, || {
            mempool_suballoc::BinningEngine::new(up.clone(), SimStreams::new(), options)
        })
        .unwrap(),
    );
    let s = SimStream::new(0);
    // Each shard allocates its blocks directly (as two producer threads with those shards would).
    let produce = |shard: usize| {
        (0..50)
            .map(|_| engines.lock(shard).allocate(256, s).unwrap())
            .collect::<Vec<u64>>()
    };
    let a = produce(0);
    let b = produce(1);
    assert_eq!(engines.stats().upstream_chunks, 2, "one chunk per shard");
    let consumer = {
        let engines = engines.clone();
        std::thread::spawn(move || {
            for (x, y) in a.iter().zip(&b) {
                engines.deallocate(*x, 256, s).unwrap();
                engines.deallocate(*y, 256, s).unwrap();
                // Freed once: a second free is refused by every shard.
                assert!(matches!(
                    engines.deallocate(*y, 256, s),
                    Err(Error::UnknownAllocation { .. })
                ));
            }
        })
    };
    consumer.join().unwrap();
    let st = engines.stats();
    assert_eq!((st.live_allocations, st.used_bytes), (0, 0));
    engines.check_invariants().unwrap();
}

#[test]
fn a_full_shard_takes_back_what_other_shards_hold_unused() {
    // 64 KiB of upstream: one thread's shard fills it and frees everything; another thread's shard
    // can only allocate once the first shard's unused chunks went back upstream.
    let up = SimUpstream::with_capacity(64 * 1024);
    let engines = Arc::new(
        Sharded::new(2, || {
            mempool_suballoc::PoolEngine::new(up.clone(), SimStreams::new(), PoolOptions::default())
        })
        .unwrap(),
    );
    let run_on_new_thread = |stream: usize| {
        let engines = engines.clone();
        std::thread::spawn(move || {
            let s = SimStream::new(stream);
            let a = engines.allocate(64 * 1024, s)?;
            engines.deallocate(a, 64 * 1024, s)
        })
        .join()
        .unwrap()
    };
    run_on_new_thread(0).unwrap();
    run_on_new_thread(1).unwrap();
    assert_eq!(engines.stats().used_bytes, 0);
    engines.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn concurrent_sequences(
        kind in 0..4usize,
        threads in 2..=4usize,
        shards in 1..=4usize,
        seed in any::<u64>(),
    ) {
        let p = Params { threads, shards, ops: 1500, max_size: 20_000, seed };
        let r = match kind {
            0 => run(PoolOptions::default(), &p),
            1 => run(BinningOptions { max_size_exponent: 14, blocks_per_chunk: 8, ..Default::default() }, &p),
            2 => run(ArenaOptions { superblock_size: 32 * 1024, ..Default::default() }, &p),
            _ => run(FixedSizeOptions { block_size: 20_000, blocks_per_chunk: 8, ..Default::default() }, &p),
        };
        prop_assert!(r.is_ok(), "kind {}, {} threads, {} shards, seed {}: {}", kind, threads, shards, seed, r.unwrap_err());
    }
}
