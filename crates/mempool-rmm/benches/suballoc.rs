//! The suballocator engines on the standard random workload (DESIGN.md, "Performance"), over
//! `SimUpstream`: what the engines' own bookkeeping costs per operation, with no GPU and no driver
//! call underneath.
//!
//! The workload runs on one stream, so the engines never order one stream after another; the
//! stream order is `OneStream`, whose operations do nothing, so that the numbers are the engines'
//! alone. (On a GPU, the default `EventPolicy::RecordOnFree` adds one event record per free.)
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
use mempool_rmm::suballoc::{
    ArenaConfig, ArenaEngine, BinningConfig, BinningEngine, Engine as _, Error, FixedSizeConfig, FixedSizeEngine,
    PoolConfig, PoolEngine, SimUpstream, StreamOrder,
};
use mempool_rmm::testing::{self, RandomOp as Op};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A single stream whose events cost nothing (see the crate-level note above).
#[derive(Debug, Clone, Copy, Default)]
struct OneStream;

impl StreamOrder for OneStream {
    type Stream = ();
    type Event = ();
    fn create_event(&self) -> Result<(), Error> {
        Ok(())
    }
    fn record(&self, _event: &mut (), _stream: ()) -> Result<(), Error> {
        Ok(())
    }
    fn wait(&self, _stream: (), _event: &()) -> Result<(), Error> {
        Ok(())
    }
    fn synchronize(&self, _stream: ()) -> Result<(), Error> {
        Ok(())
    }
}

/// The standard points: (operations, max_size, max_usage).
const POINTS: [(usize, u64, u64); 2] = [(200_000, 64 * KIB, 4 * GIB), (100_000, MIB, 16 * GIB)];

/// What the bench needs from an engine; failures are bugs and abort the bench.
trait Engine {
    fn alloc(&mut self, bytes: u64) -> u64;
    fn free(&mut self, addr: u64, bytes: u64);
}

macro_rules! impl_engine {
    ($ty:ident) => {
        impl Engine for $ty<SimUpstream, OneStream> {
            #[inline]
            fn alloc(&mut self, bytes: u64) -> u64 {
                match self.allocate(bytes, ()) {
                    Ok(a) => a,
                    Err(e) => panic!("{} failed to allocate {bytes} bytes: {e}", stringify!($ty)),
                }
            }
            #[inline]
            fn free(&mut self, addr: u64, bytes: u64) {
                if let Err(e) = self.deallocate(addr, bytes, ()) {
                    panic!("{} failed to free {addr:#x}: {e}", stringify!($ty));
                }
            }
        }
    };
}

impl_engine!(PoolEngine);
impl_engine!(FixedSizeEngine);
impl_engine!(BinningEngine);
impl_engine!(ArenaEngine);

fn run<E: Engine>(engine: &mut E, ops: &[Op]) {
    let mut live: Vec<(u64, u64)> = Vec::with_capacity(ops.len());
    for &op in ops {
        match op {
            Op::Alloc(n) => live.push((black_box(engine.alloc(n as u64)), n as u64)),
            Op::Free(i) => {
                let (a, n) = live.swap_remove(i);
                engine.free(a, n);
            }
        }
    }
    for (a, n) in live.drain(..) {
        engine.free(a, n);
    }
}

fn bench_engine<E: Engine>(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, ops: &[Op], make: impl Fn() -> E) {
    group.bench_function(name, |b| {
        b.iter_batched(
            &make,
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
        let ops = testing::random_workload(n, max_size as usize, max_usage as usize, 0x5EED_0000 ^ max_size);
        let name = format!("random/{n}ops_{}KiB_{}GiB", max_size / KIB, max_usage / GIB);
        let mut group = c.benchmark_group(name);
        group
            .throughput(Throughput::Elements(n as u64))
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .measurement_time(Duration::from_secs(4));

        bench_engine(&mut group, "pool", &ops, || {
            PoolEngine::new(SimUpstream::new(), OneStream, PoolConfig::default()).expect("pool config")
        });
        bench_engine(&mut group, "fixed_size", &ops, || {
            let config = FixedSizeConfig {
                block_size: max_size,
                ..Default::default()
            };
            FixedSizeEngine::new(SimUpstream::new(), OneStream, config).expect("fixed-size config")
        });
        bench_engine(&mut group, "binning", &ops, || {
            let config = BinningConfig {
                min_size_exponent: 8,
                max_size_exponent: ceil_log2(max_size),
                ..Default::default()
            };
            BinningEngine::new(SimUpstream::new(), OneStream, config).expect("binning config")
        });
        bench_engine(&mut group, "arena", &ops, || {
            ArenaEngine::new(SimUpstream::new(), OneStream, ArenaConfig::default()).expect("arena config")
        });
        group.finish();
    }
}

criterion_group!(benches, random_workload);
criterion_main!(benches);
