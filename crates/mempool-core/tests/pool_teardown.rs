//! Issue 33: pools destroyed while other threads synchronize. A free into a pool on the legacy default
//! stream leaves a record in the driver that `cuMemPoolDestroy` frees; on driver 580 a synchronize on
//! another thread at that moment locked the freed record and every thread of the process then waited
//! inside the driver (docs/architecture.md, "Pool teardown and synchronizes"). mempool-core holds pool
//! destroys apart from its synchronizes; this test runs the pattern that stalled the conformance suite
//! (free on the legacy stream, context synchronize, destroy) beside threads that synchronize streams,
//! events and the context, and fails if no thread makes progress for a minute. Its own binary: a stall
//! ends the process (`abort`), as no thread stuck in the driver can be unwound.
//!
//! MEMPOOL_TEARDOWN_SECS (default 10) sets how long it runs.
#![cfg(feature = "gpu")]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mempool_core::{Device, Event, EventFlags, MemPool, PoolProps, Stream, StreamRef};

#[test]
fn pools_destroyed_beside_synchronizing_threads_never_stall() {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().unwrap();
    let secs: u64 = std::env::var("MEMPOOL_TEARDOWN_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let progress = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    {
        let (progress, done) = (progress.clone(), done.clone());
        std::thread::spawn(move || {
            let mut last = (0, Instant::now());
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = progress.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > Duration::from_secs(60) {
                    eprintln!("pool_teardown: no thread finished an operation for 60 s: stalled in the driver");
                    std::process::abort();
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (churned, synced) = std::thread::scope(|s| {
        let churners: Vec<_> = (0..8)
            .map(|t| {
                let (dev, progress) = (&dev, &progress);
                s.spawn(move || {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        let pool = MemPool::new(dev, &PoolProps::new()).unwrap();
                        let bytes = 4096usize << ((n as usize + t) % 12);
                        let p = pool.allocate(bytes, StreamRef::LEGACY).unwrap();
                        // SAFETY: `p` came from this pool with no work using it; freed once.
                        unsafe { pool.free_async(p, StreamRef::LEGACY) }.unwrap();
                        drop(pool); // synchronizes the context, then destroys the pool
                        n += 1;
                        progress.fetch_add(1, Ordering::Relaxed);
                    }
                    n
                })
            })
            .collect();
        let syncers: Vec<_> = (0..8)
            .map(|t| {
                let (dev, ctx, progress) = (&dev, &ctx, &progress);
                s.spawn(move || {
                    let stream = Stream::new(ctx).unwrap();
                    let event = Event::new(ctx, EventFlags::DISABLE_TIMING).unwrap();
                    let pool = dev.default_pool().unwrap();
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        let buf = pool.alloc(1 << 16, stream.as_ref()).unwrap();
                        buf.fill(t as u8).unwrap();
                        drop(buf);
                        match n % 3 {
                            0 => stream.synchronize().unwrap(),
                            1 => {
                                event.record(stream.as_ref()).unwrap();
                                event.synchronize().unwrap();
                            }
                            _ => ctx.synchronize().unwrap(),
                        }
                        n += 1;
                        progress.fetch_add(1, Ordering::Relaxed);
                    }
                    n
                })
            })
            .collect();
        (
            churners.into_iter().map(|h| h.join().unwrap()).sum::<u64>(),
            syncers.into_iter().map(|h| h.join().unwrap()).sum::<u64>(),
        )
    });
    done.store(true, Ordering::Relaxed);
    eprintln!("pool_teardown: {churned} pools destroyed, {synced} synchronizes in {secs} s");
    assert!(churned > 0 && synced > 0);
    assert!(mempool_core::take_drop_errors().is_empty());
}
