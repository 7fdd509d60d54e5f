//! The suballocator engines on the standard random workload (docs/architecture.md, "Performance"), over
//! `SimUpstream`: what the engines' own bookkeeping costs per operation, with no GPU and no driver
//! call underneath. `cargo bench -p mempool-suballoc --bench engines -- --noplot`; results in
//! `RESULTS-host.md` next to this file.
//!
//! The workload runs on one stream, so the engines never order one stream after another; the
//! stream order is `OneStream`, whose operations do nothing, so that the numbers are the engines'
//! alone. (On a GPU, one stream's frees under the default `EventPolicy::Adaptive` record no event
//! either; `EventPolicy::RecordOnFree` would add one event record per free.)
//!
//! The workload (RMM's `random_allocations` shape): `n` operations on one stream, each allocating
//! with probability 0.73 unless live bytes would pass `max_usage` (or nothing is live), otherwise
//! freeing a uniformly chosen live allocation; sizes uniform in `[1, max_size]`; everything left is
//! freed at the end. The operation sequence is generated up front from a fixed seed, so every
//! engine sees the same one and the generator is not timed.
//!
//! `SUBALLOC_BENCH_OPS=N` replaces each point's operation count for quick runs.
//! Throughput is reported per operation (the final frees are timed but not counted, as in RMM).

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkGroup, Criterion, SamplingMode, Throughput};
use mempool_suballoc::workload::{self, RandomOp as Op};
use mempool_suballoc::{
    ArenaOptions, BinningOptions, Engine, EngineOptions, FixedSizeOptions, PoolOptions, SimUpstream,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

mod common;
use common::OneStream;

/// The standard points: (operations, max_size, max_usage).
const POINTS: [(usize, u64, u64); 2] = [(200_000, 64 * KIB, 4 * GIB), (100_000, MIB, 16 * GIB)];

/// Runs `ops` on one stream, then frees what is left; failures are bugs and abort the bench.
fn run<E: Engine<Stream = ()>>(engine: &mut E, ops: &[Op]) {
    fn free<E: Engine<Stream = ()>>(engine: &mut E, addr: u64, bytes: u64) {
        if let Err(e) = engine.deallocate(addr, bytes, ()) {
            panic!("failed to free {addr:#x}: {e}");
        }
    }
    let mut live: Vec<(u64, u64)> = Vec::with_capacity(ops.len());
    for &op in ops {
        match op {
            Op::Alloc(n) => match engine.allocate(n as u64, ()) {
                Ok(a) => live.push((black_box(a), n as u64)),
                Err(e) => panic!("failed to allocate {n} bytes: {e}"),
            },
            Op::Free(i) => {
                let (a, n) = live.swap_remove(i);
                free(engine, a, n);
            }
        }
    }
    for (a, n) in live.drain(..) {
        free(engine, a, n);
    }
}

/// Benchmarks the engine `options` names, a fresh one per iteration.
fn bench_engine<C: EngineOptions>(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, ops: &[Op], options: C) {
    group.bench_function(name, |b| {
        b.iter_batched(
            || {
                let engine: C::Engine<SimUpstream, OneStream> =
                    Engine::new(SimUpstream::new(), OneStream, options.clone()).expect("engine options");
                engine
            },
            |mut engine| {
                run(&mut engine, ops);
                // Returned, so that releasing to the upstream happens outside the timing.
                engine
            },
            BatchSize::PerIteration,
        )
    });
}

/// The smallest exponent `e` with `2^e >= n`.
fn ceil_log2(n: u64) -> u32 {
    64 - (n - 1).leading_zeros()
}

fn random_workload(c: &mut Criterion) {
    let ops_override = std::env::var("SUBALLOC_BENCH_OPS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    for (n, max_size, max_usage) in POINTS {
        let n = ops_override.unwrap_or(n);
        let ops = workload::random_workload(n, max_size as usize, max_usage as usize, 0x5EED_0000 ^ max_size);
        let name = format!("random/{n}ops_{}KiB_{}GiB", max_size / KIB, max_usage / GIB);
        let mut group = c.benchmark_group(name);
        group
            .throughput(Throughput::Elements(n as u64))
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .measurement_time(Duration::from_secs(4));

        bench_engine(&mut group, "pool", &ops, PoolOptions::default());
        let fixed_size = FixedSizeOptions {
            block_size: max_size,
            ..Default::default()
        };
        bench_engine(&mut group, "fixed_size", &ops, fixed_size);
        let binning = BinningOptions {
            min_size_exponent: 8,
            max_size_exponent: ceil_log2(max_size),
            ..Default::default()
        };
        bench_engine(&mut group, "binning", &ops, binning);
        bench_engine(&mut group, "arena", &ops, ArenaOptions::default());
        group.finish();
    }
}

criterion_group!(benches, random_workload);
criterion_main!(benches);
