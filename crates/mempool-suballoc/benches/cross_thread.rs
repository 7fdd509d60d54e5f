//! Frees from another thread than the one that allocated, through [`Sharded`]: a producer thread
//! allocates, a consumer thread frees, as in a pipeline handing buffers downstream.
//! `cargo bench -p mempool-suballoc --bench cross_thread -- [SHARDS] [PRODUCERS] [REPEATS]` (defaults
//! 16, 1, 5) prints ns per free. Each producer allocates 20,000 blocks of 1-64 KiB (a binning engine,
//! bins 256 B to 64 KiB, over `SimUpstream`, one no-op stream); then one consumer thread, which has
//! allocated nothing, frees them all, interleaving the producers' blocks, and that is what is timed.

use std::sync::Arc;
use std::time::Instant;

use mempool_suballoc::workload::random_workload;
use mempool_suballoc::{BinningOptions, Engine, Sharded, SimUpstream};

mod common;
use common::OneStream;

type Bins = mempool_suballoc::BinningEngine<SimUpstream, OneStream>;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .filter_map(|a| a.parse().ok())
        .collect();
    let shards = args.first().copied().unwrap_or(16);
    let producers = args.get(1).copied().unwrap_or(1);
    let repeats = args.get(2).copied().unwrap_or(5);
    const PER_PRODUCER: usize = 20_000;
    let sizes: Vec<u64> = random_workload(PER_PRODUCER * 2, 64 << 10, usize::MAX, 7)
        .into_iter()
        .filter_map(|op| match op {
            mempool_suballoc::workload::RandomOp::Alloc(n) => Some(n as u64),
            _ => None,
        })
        .take(PER_PRODUCER)
        .collect();
    let mut results = Vec::new();
    for _ in 0..repeats {
        let up = SimUpstream::new();
        let options = BinningOptions {
            min_size_exponent: 8,
            max_size_exponent: 16,
            ..Default::default()
        };
        let bins =
            Arc::new(Sharded::new(shards, || Bins::new(up.clone(), OneStream, options)).expect("engine options"));
        let made: Vec<Vec<(u64, u64)>> = (0..producers)
            .map(|_| {
                let bins = bins.clone();
                let sizes = sizes.clone();
                std::thread::spawn(move || {
                    sizes
                        .iter()
                        .map(|&n| (bins.allocate(n, ()).expect("allocate"), n))
                        .collect::<Vec<_>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("producer"))
            .collect();
        // Interleaved: block k of every producer, then block k + 1, ...
        let frees: Vec<(u64, u64)> = (0..PER_PRODUCER).flat_map(|k| made.iter().map(move |m| m[k])).collect();
        let consumer = {
            let bins = bins.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                for &(a, n) in &frees {
                    bins.deallocate(a, n, ()).expect("free");
                }
                t.elapsed().as_nanos() as f64 / frees.len() as f64
            })
        };
        results.push(consumer.join().expect("consumer"));
        assert_eq!(bins.stats().live_allocations, 0);
    }
    let mut sorted = results.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "cross-thread frees, {shards} shards, {producers} producer(s): median {:.1} ns per free (runs: {})",
        sorted[sorted.len() / 2],
        results.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(", ")
    );
}
