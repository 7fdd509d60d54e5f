//! Tests of the [`Engine`](crate::engine::Engine) trait over every engine. A module of its own so that
//! `engine` imports none of the engines that implement it.

use crate::arena::ArenaOptions;
use crate::binning::BinningOptions;
use crate::engine::{Engine, EngineOptions};
use crate::error::Error;
use crate::fixed_size::FixedSizeOptions;
use crate::pool::PoolOptions;
use crate::sim::SimUpstream;
use crate::sim::{SimStream, SimStreams};
use crate::types::EngineStats;

const A: SimStream = SimStream::new(0);

/// An upstream that refuses to take chunks back: `release_unused`, `release` and `drop` forget
/// them all the same (the engine stays consistent) and the first two report the error.
fn upstream_errors_are_reported_and_leave_the_engine_consistent<C: EngineOptions>(options: C) {
    let up = SimUpstream::new();
    let mut e: C::Engine<SimUpstream, SimStreams> = Engine::new(up.clone(), SimStreams::new(), options).unwrap();
    let x = e.allocate(1000, A).unwrap();
    e.deallocate(x, 1000, A).unwrap();
    up.set_fail_deallocations(true);
    let err = e.release_unused(A).unwrap_err();
    assert!(matches!(err, Error::Upstream { op: "deallocate", .. }), "{err:?}");
    assert_eq!(e.stats().reserved_bytes, 0, "the refused chunks are forgotten");
    e.check_invariants().unwrap();
    assert!(up.stats().live_chunks > 0, "and leaked upstream");

    up.set_fail_deallocations(false);
    e.allocate(1000, A).unwrap();
    up.set_fail_deallocations(true);
    let err = e.release().unwrap_err();
    assert!(matches!(err, Error::Upstream { op: "deallocate", .. }), "{err:?}");
    assert_eq!(e.stats(), EngineStats::default());
    e.check_invariants().unwrap();

    e.allocate(1000, A).unwrap();
    drop(e);
    up.set_fail_deallocations(false);
}

#[test]
fn upstream_errors_are_reported_by_every_engine() {
    upstream_errors_are_reported_and_leave_the_engine_consistent(PoolOptions::default());
    upstream_errors_are_reported_and_leave_the_engine_consistent(FixedSizeOptions {
        block_size: 1024,
        blocks_per_chunk: 4,
        ..Default::default()
    });
    upstream_errors_are_reported_and_leave_the_engine_consistent(BinningOptions::default());
    upstream_errors_are_reported_and_leave_the_engine_consistent(ArenaOptions::default());
}

#[test]
fn a_large_binning_allocation_the_upstream_refuses_is_forgotten() {
    let up = SimUpstream::new();
    let options = BinningOptions {
        max_size_exponent: 12,
        ..Default::default()
    };
    let mut e: crate::binning::BinningEngine<_, _> = Engine::new(up.clone(), SimStreams::new(), options).unwrap();
    let x = e.allocate(10_000, A).unwrap();
    up.set_fail_deallocations(true);
    assert!(matches!(
        e.deallocate(x, 10_000, A),
        Err(Error::Upstream { op: "deallocate", .. })
    ));
    assert!(matches!(
        e.deallocate(x, 10_000, A),
        Err(Error::UnknownAllocation { .. })
    ));
    assert_eq!(e.stats(), EngineStats::default());
    e.check_invariants().unwrap();
    up.set_fail_deallocations(false);
}

/// After a mixed workload on two streams, the memory map agrees with the engine's statistics: its
/// chunks are the reserved bytes, its ranges cover each chunk exactly in address order, its used
/// ranges are the live allocations (each at least the size asked for), and free ranges name a stream.
fn memory_map_matches_the_stats<C: EngineOptions>(options: C) {
    use crate::memory_map::summarize;
    const B: SimStream = SimStream::new(1);
    let mut e: C::Engine<SimUpstream, SimStreams> =
        Engine::new(SimUpstream::new(), SimStreams::new(), options).unwrap();
    let sizes = [1000u64, 300, 70_000, 256, 5000, 2_000_000, 4096, 100];
    let mut live = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let s = if i % 2 == 0 { A } else { B };
        live.push((e.allocate(n, s).unwrap(), n, s));
    }
    for (addr, n, s) in live.drain(..).step_by(2).collect::<Vec<_>>() {
        e.deallocate(addr, n, s).unwrap();
    }
    let st = e.stats();
    let maps = e.memory_map();
    let sum = summarize(&maps);
    assert_eq!(sum.reserved_bytes, st.reserved_bytes);
    assert_eq!(sum.free_bytes, st.free_bytes);
    assert_eq!(sum.chunks, maps.len());
    let mut used = 0;
    let mut used_ranges = 0;
    for m in &maps {
        let mut at = m.addr;
        for r in &m.ranges {
            assert_eq!(r.addr, at, "ranges cover the chunk {:#x} in order", m.addr);
            at += r.size;
            if r.used {
                used += r.size;
                used_ranges += 1;
            } else {
                assert!(r.stream == Some(A) || r.stream == Some(B), "{r:?}");
            }
        }
        assert_eq!(at, m.addr + m.size);
    }
    assert_eq!(used, st.used_bytes);
    assert_eq!(used_ranges, st.live_allocations);
    assert_eq!(
        used_ranges,
        sizes.len() / 2,
        "the allocations at odd positions are live"
    );
    assert!(sum.largest_free <= sum.free_bytes);
}

#[test]
fn every_engine_draws_a_memory_map_that_matches_its_stats() {
    memory_map_matches_the_stats(PoolOptions::default());
    memory_map_matches_the_stats(FixedSizeOptions {
        block_size: 4 << 20,
        blocks_per_chunk: 4,
        ..Default::default()
    });
    memory_map_matches_the_stats(BinningOptions::default());
    memory_map_matches_the_stats(ArenaOptions::default());
}
