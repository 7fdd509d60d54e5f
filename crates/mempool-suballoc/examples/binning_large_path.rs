//! What a binning resource costs per operation at the standard random workload's large point (sizes up
//! to 64 MiB, most above the default largest bin of 1 MiB), on the host over `SimUpstream` (a mutex and a
//! map: the stand-in for the pool under mempool-rmm's `BinningResource`):
//!
//! - `upstream`: the upstream alone (the "pool alone" of the GPU table);
//! - `engine-path`: every operation through a [`Sharded`] binning engine, as mempool-rmm's
//!   `BinningResource` sent them before it passed large sizes by: a shard lock, the bin lookup, and a
//!   record of each large allocation in the engine's map (inserted on allocate, looked up and removed on
//!   free);
//! - `size-routed`: sizes above the largest bin straight to the upstream, decided by
//!   [`BinningOptions::goes_upstream`] alone (what `BinningResource` does now), the rest through the engine.
//!
//! Host-only numbers: no driver call, no GPU. Build this crate optimized and the rest as usual:
//! `cargo run -p mempool-suballoc --example binning_large_path --config 'profile.dev.package.mempool-suballoc.opt-level=3'`
//! (`BINNING_LARGE_ROUNDS=N` for N interleaved rounds; 9 by default).

use std::hint::black_box;
use std::time::Instant;

use mempool_suballoc::workload::{random_workload, RandomOp};
use mempool_suballoc::{BinningEngine, BinningOptions, Engine, Sharded, SimStream, SimStreams, SimUpstream, Upstream};

/// The standard large point: operations, largest size, most live bytes.
const LARGE: (usize, usize, usize) = (20_000, 64 << 20, 16 << 30);

type Bins = Sharded<BinningEngine<SimUpstream, SimStreams>>;

#[derive(Clone, Copy)]
enum Route {
    Upstream,
    Engine,
    BySize,
}

/// Runs `ops` then frees what is left; returns nanoseconds per counted operation.
fn run(path: Route, ops: &[RandomOp], options: BinningOptions) -> f64 {
    let up = SimUpstream::new();
    let streams = SimStreams::new();
    let bins: Bins =
        Sharded::new(1, || BinningEngine::new(up.clone(), streams.clone(), options)).expect("valid options");
    let s = SimStream::new(0);
    let alloc = |n: u64| -> u64 {
        let r = match path {
            Route::Upstream => up.allocate(n, s),
            Route::Engine => bins.allocate(n, s),
            Route::BySize if options.goes_upstream(n) => up.allocate(n, s),
            Route::BySize => bins.allocate(n, s),
        };
        r.unwrap_or_else(|e| panic!("allocating {n} bytes: {e}"))
    };
    let free = |a: u64, n: u64| {
        let r = match path {
            Route::Upstream => up.deallocate(a, n, s),
            Route::Engine => bins.deallocate(a, n, s),
            Route::BySize if options.goes_upstream(n) => up.deallocate(a, n, s),
            Route::BySize => bins.deallocate(a, n, s),
        };
        r.unwrap_or_else(|e| panic!("freeing {a:#x} ({n} bytes): {e}"))
    };
    let mut live: Vec<(u64, u64)> = Vec::with_capacity(ops.len());
    let start = Instant::now();
    for &op in ops {
        match op {
            RandomOp::Alloc(n) => live.push((black_box(alloc(n as u64)), n as u64)),
            RandomOp::Free(i) => {
                let (a, n) = live.swap_remove(i);
                free(a, n);
            }
        }
    }
    for (a, n) in live.drain(..) {
        free(a, n);
    }
    start.elapsed().as_nanos() as f64 / ops.len() as f64
}

fn main() {
    let rounds: usize = std::env::var("BINNING_LARGE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9);
    let ops = random_workload(LARGE.0, LARGE.1, LARGE.2, 44);
    let options = BinningOptions::default();
    let above = ops
        .iter()
        .filter(|op| matches!(op, RandomOp::Alloc(n) if options.goes_upstream(*n as u64)))
        .count();
    let allocs = ops.iter().filter(|op| matches!(op, RandomOp::Alloc(_))).count();
    println!(
        "large point: {} ops, {allocs} allocations, {above} above the largest bin ({} bytes); {rounds} interleaved rounds",
        ops.len(),
        options.largest_bin()
    );
    let paths = [
        ("upstream", Route::Upstream),
        ("engine-path", Route::Engine),
        ("size-routed", Route::BySize),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    for _ in 0..rounds {
        for (t, &(_, p)) in times.iter_mut().zip(&paths) {
            t.push(run(p, &ops, options));
        }
    }
    println!(
        "{:<12} {:>10} {:>10}  (ns per operation, host only)",
        "path", "min", "median"
    );
    for (t, (name, _)) in times.iter_mut().zip(&paths) {
        t.sort_by(f64::total_cmp);
        println!("{name:<12} {:>10.1} {:>10.1}", t[0], t[t.len() / 2]);
    }
}
