//! One engine on one point of the standard random workload, timed with `Instant`, for profilers:
//! `cargo bench -p mempool-suballoc --bench ops -- ENGINE POINT [REPEATS]` prints ns per operation,
//! and under `valgrind --tool=callgrind --toggle-collect='*ops::run_ops*'` the instructions of the
//! timed operations alone (divide by the operation count it prints). ENGINE is `pool`, `arena`,
//! `binning` (bins 256 B up to the point's largest size), `binning_gpu` (bins 256 KiB to 4 MiB, the
//! configuration of issue 17's GPU table: `binning(pool(async),min=256KiB,max=4MiB)`) or
//! `fixed_size`; POINT `small` (200k ops, 64 KiB, 4 GiB), `mid` (100k, 1 MiB, 16 GiB)
//! or `large` (20k, 64 MiB, 16 GiB). `SUBALLOC_BENCH_OPS=N` replaces the operation count. The
//! engines and the stream order are the criterion bench's (`engines.rs`): `SimUpstream`, one no-op
//! stream. `SUBALLOC_BENCH_WARM=1` runs the workload once on each fresh engine before the timed run
//! (as `mempool-bench random` does), so that the timed run finds the engine's tables grown.
//! `SUBALLOC_BENCH_SHARDS=N` runs the engine inside a [`Sharded`] of `N` shards, as a resource of
//! mempool-rmm does (one per hardware thread up to 16), so the lock and the shard choice are
//! counted too. Results: `RESULTS-host.md`.

use std::hint::black_box;
use std::time::Instant;

use mempool_suballoc::workload::{self, RandomOp as Op};
use mempool_suballoc::{
    ArenaOptions, BinningOptions, Engine, EngineOptions, Error, FixedSizeOptions, PoolOptions, Sharded, SimUpstream,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

mod common;
use common::OneStream;

/// What the timed loop calls: an engine, or engines behind [`Sharded`]'s locks.
trait Target {
    fn allocate(&mut self, bytes: u64) -> Result<u64, Error>;
    fn deallocate(&mut self, addr: u64, bytes: u64) -> Result<(), Error>;
    fn touch(&self);
}

/// One engine, called directly.
struct Direct<E>(E);

impl<E: Engine<Stream = ()>> Target for Direct<E> {
    #[inline(always)]
    fn allocate(&mut self, bytes: u64) -> Result<u64, Error> {
        self.0.allocate(bytes, ())
    }
    #[inline(always)]
    fn deallocate(&mut self, addr: u64, bytes: u64) -> Result<(), Error> {
        self.0.deallocate(addr, bytes, ())
    }
    fn touch(&self) {
        black_box(self.0.stats());
    }
}

impl<E: Engine<Stream = ()>> Target for Sharded<E> {
    #[inline(always)]
    fn allocate(&mut self, bytes: u64) -> Result<u64, Error> {
        Sharded::allocate(self, bytes, ())
    }
    #[inline(always)]
    fn deallocate(&mut self, addr: u64, bytes: u64) -> Result<(), Error> {
        Sharded::deallocate(self, addr, bytes, ())
    }
    fn touch(&self) {
        black_box(self.stats());
    }
}

/// Runs `ops`, then frees what is left (the timed run, which callgrind's `--toggle-collect` counts).
#[inline(never)]
fn run_ops<T: Target>(target: &mut T, ops: &[Op], live: &mut Vec<(u64, u64)>) {
    apply_ops(target, ops, live);
}

/// The same as [`run_ops`] under another name, so that profilers do not count it: the warm-up run.
#[inline(never)]
fn warm_up<T: Target>(target: &mut T, ops: &[Op], live: &mut Vec<(u64, u64)>) {
    apply_ops(target, ops, live);
    // Not the same machine code as `run_ops`, which the compiler could otherwise fold into one.
    target.touch();
}

#[inline(always)]
fn apply_ops<T: Target>(target: &mut T, ops: &[Op], live: &mut Vec<(u64, u64)>) {
    for &op in ops {
        match op {
            Op::Alloc(n) => match target.allocate(n as u64) {
                Ok(a) => live.push((black_box(a), n as u64)),
                Err(e) => panic!("failed to allocate {n} bytes: {e}"),
            },
            Op::Free(i) => {
                let (a, n) = live.swap_remove(i);
                if let Err(e) = target.deallocate(a, n) {
                    panic!("failed to free {a:#x}: {e}");
                }
            }
        }
    }
    for (a, n) in live.drain(..) {
        if let Err(e) = target.deallocate(a, n) {
            panic!("failed to free {a:#x}: {e}");
        }
    }
}

fn measure<C: EngineOptions>(options: C, ops: &[Op], repeats: usize, warm: bool, shards: usize) -> Vec<f64> {
    let make = || -> C::Engine<SimUpstream, OneStream> {
        Engine::new(SimUpstream::new(), OneStream, options.clone()).expect("engine options")
    };
    (0..repeats)
        .map(|_| {
            if shards == 0 {
                time(&mut Direct(make()), ops, warm)
            } else {
                let mut sharded = Sharded::new(shards, || Ok(make())).expect("engine options");
                time(&mut sharded, ops, warm)
            }
        })
        .collect()
}

/// ns per operation of one timed run on `target` (after a warm-up run when `warm`).
fn time<T: Target>(target: &mut T, ops: &[Op], warm: bool) -> f64 {
    let mut live = Vec::with_capacity(ops.len());
    if warm {
        warm_up(target, ops, &mut live);
    }
    let t = Instant::now();
    run_ops(target, ops, &mut live);
    t.elapsed().as_nanos() as f64 / ops.len() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let usage = "usage: ops ENGINE(pool|arena|binning|binning_gpu|fixed_size) POINT(small|mid|large) [REPEATS]";
    let (engine, point) = match (args.first(), args.get(1)) {
        (Some(e), Some(p)) => (e.as_str(), p.as_str()),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let repeats: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(5);
    let (n, max_size, max_usage) = match point {
        "small" => (200_000, 64 * KIB, 4 * GIB),
        "mid" => (100_000, MIB, 16 * GIB),
        "large" => (20_000, 64 * MIB, 16 * GIB),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let n = std::env::var("SUBALLOC_BENCH_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    let warm = std::env::var_os("SUBALLOC_BENCH_WARM").is_some_and(|v| v == "1");
    let shards: usize = std::env::var("SUBALLOC_BENCH_SHARDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let ops = workload::random_workload(n, max_size as usize, max_usage as usize, 0x5EED_0000 ^ max_size);
    let ns = match engine {
        "pool" => measure(PoolOptions::default(), &ops, repeats, warm, shards),
        "arena" => measure(ArenaOptions::default(), &ops, repeats, warm, shards),
        "binning" => {
            let options = BinningOptions {
                min_size_exponent: 8,
                max_size_exponent: 64 - (max_size - 1).leading_zeros(),
                ..Default::default()
            };
            measure(options, &ops, repeats, warm, shards)
        }
        "binning_gpu" => {
            let options = BinningOptions {
                min_size_exponent: 18,
                max_size_exponent: 22,
                ..Default::default()
            };
            measure(options, &ops, repeats, warm, shards)
        }
        "fixed_size" => {
            let options = FixedSizeOptions {
                block_size: max_size,
                ..Default::default()
            };
            measure(options, &ops, repeats, warm, shards)
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let mut sorted = ns.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "{engine} {point}{}{}: {n} ops, median {:.1} ns/op (runs: {})",
        if warm { " (warm)" } else { "" },
        if shards > 0 {
            format!(" ({shards} shards)")
        } else {
            String::new()
        },
        sorted[sorted.len() / 2],
        ns.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(", ")
    );
}
