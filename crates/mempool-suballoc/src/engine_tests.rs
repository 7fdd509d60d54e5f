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
