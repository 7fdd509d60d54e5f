//! `Sharded` gives a thread that replaces one that exited the shard its predecessor grew. Alone in
//! its test binary: the thread numbers are per process, and other tests' threads would take them.

use std::sync::Arc;

use mempool_suballoc::{BinningConfig, BinningEngine, Engine, Sharded, SimStream, SimStreams, SimUpstream};

#[test]
fn successive_threads_reuse_the_first_shard() {
    let up = SimUpstream::new();
    let sim = SimStreams::new();
    let bins = Arc::new(
        Sharded::new(4, || {
            BinningEngine::new(up.clone(), sim.clone(), BinningConfig::default())
        })
        .unwrap(),
    );
    // Batches of workers, one after the other, as a benchmark's runs or a respawning thread pool.
    for batch in 0..3 {
        // Both workers of a batch are alive at once (each allocates before the barrier), so they hold
        // different numbers.
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let workers: Vec<_> = (0..2)
            .map(|t| {
                let (bins, barrier) = (bins.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let s = SimStream::new(t);
                    let a = bins.allocate(1000, s).unwrap();
                    barrier.wait();
                    bins.deallocate(a, 1000, s).unwrap();
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        // The first batch grew one chunk in each of two shards; later batches found them.
        let stats = up.stats();
        assert_eq!(
            stats.allocations, 2,
            "after batch {batch}: {} upstream allocations ({:?}); a later batch's threads got shards \
             their predecessors had not grown",
            stats.allocations, stats
        );
    }
    bins.check_invariants().unwrap();
}
