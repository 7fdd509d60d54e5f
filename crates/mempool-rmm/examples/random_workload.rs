//! The standard random workload (RMM's `random_allocations` shape, see docs/architecture.md, "Performance") over
//! several resources, with the driver pool itself (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync` through
//! `MemPool::allocate` and `free_async`, mempool-core's thinnest path) as the baseline measured in the same run. A benchmark, not a test: it prints nanoseconds per operation.
//!
//! `cargo run --release -p mempool-rmm --example random_workload [-- --quick] [-- --only NAME,...]`
//!
//! Each run: `n` operations on one stream, each allocating with probability 0.73 (unless live bytes would
//! pass `max_usage`), otherwise freeing a random live allocation; sizes uniform in `[1, max_size]`;
//! everything left is freed at the end; one synchronize at the end. Each resource runs each point
//! `REPEATS` times after one warm-up run, each timed run right after a run of the raw baseline, so
//! that both see the same machine state; the medians are reported, and the ratio of the medians.
//! The device's primary context is made current for the whole run, as in an application that uses
//! the GPU from this thread. Without a GPU it says why and exits with status 2.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use mempool_core::{Device, DeviceAddr, MemPool, PoolProps, Stream, StreamRef};
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, PoolOptions};
use mempool_rmm::workload::{random_workload, RandomOp as Op};
use mempool_rmm::{
    ArenaResource, AsyncOptions, AsyncResource, BinningResource, CudaResource, MemoryResource, PoolResource,
    ReleaseThreshold, SharedResource,
};

const REPEATS: usize = 9;

struct Point {
    n: usize,
    max_size: usize,
    max_usage: usize,
}

/// Runs the sequence with `alloc`/`free`; returns ns per operation (frees at the end included in the time,
/// not in the count, as RMM's benchmark does) and the peak live allocation count.
fn run(
    ops: &[Op],
    stream: StreamRef<'_>,
    alloc: &dyn Fn(usize) -> DeviceAddr,
    free: &dyn Fn(DeviceAddr, usize),
) -> (f64, usize) {
    let mut live: Vec<(DeviceAddr, usize)> = Vec::with_capacity(ops.len());
    let mut peak = 0;
    let t = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc(size) => {
                live.push((alloc(size), size));
                peak = peak.max(live.len());
            }
            Op::Free(i) => {
                let (p, s) = live.swap_remove(i);
                free(p, s);
            }
        }
    }
    for (p, s) in live.drain(..) {
        free(p, s);
    }
    stream.synchronize().expect("synchronize");
    (t.elapsed().as_nanos() as f64 / ops.len() as f64, peak)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> ExitCode {
    let dev = match mempool_core::require_gpus(1) {
        Ok(devices) => devices[0],
        Err(missing) => return missing.exit("random_workload"),
    };
    match run_all(dev) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("random_workload: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_all(dev: Device) -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_owned).collect());
    let ctx = dev.context()?;
    let _bound = ctx.bind()?;
    let stream = Stream::new(&ctx)?;
    let s = stream.as_ref();
    println!(
        "device: {} ({}), driver {}",
        dev.name()?,
        dev.uuid()?,
        mempool_core::driver_version()?
    );
    let gib = 1usize << 30;
    let mut points = vec![
        Point {
            n: 200_000,
            max_size: 64 << 10,
            max_usage: 4 * gib,
        },
        Point {
            n: 100_000,
            max_size: 1 << 20,
            max_usage: 16 * gib,
        },
        Point {
            n: 20_000,
            max_size: 64 << 20,
            max_usage: 16 * gib,
        },
    ];
    if quick {
        for p in &mut points {
            p.n /= 10;
        }
    }

    // Every pool keeps what it reserves (threshold max), as a process owning its GPU would run.
    let raw_pool = MemPool::new(&dev, &PoolProps::new())?;
    raw_pool.keep_everything()?;
    let keep = AsyncOptions {
        release_threshold: ReleaseThreshold::KeepAll,
        ..Default::default()
    };
    // Each resource is made fresh for each point and dropped after it, so that only the baseline's
    // pool and one resource hold memory at a time.
    type Make<'a> = Box<dyn Fn() -> mempool_rmm::Result<SharedResource> + 'a>;
    let upstream = || AsyncResource::new(&dev, keep).map(Arc::new);
    let resources: Vec<(&str, Make<'_>)> = vec![
        (
            "async",
            Box::new(|| Ok(Arc::new(AsyncResource::new(&dev, keep)?) as SharedResource)),
        ),
        (
            "pool(async)",
            Box::new(|| Ok(Arc::new(PoolResource::new(upstream()?, &dev, PoolOptions::default())?) as SharedResource)),
        ),
        (
            "binning(async)",
            Box::new(|| {
                Ok(Arc::new(BinningResource::new(upstream()?, &dev, BinningOptions::default())?) as SharedResource)
            }),
        ),
        (
            "arena(async)",
            Box::new(|| {
                Ok(Arc::new(ArenaResource::new(upstream()?, &dev, ArenaOptions::default())?) as SharedResource)
            }),
        ),
        (
            "cuda",
            Box::new(|| Ok(Arc::new(CudaResource::new(&dev)?) as SharedResource)),
        ),
    ];

    println!(
        "{:<16} {:>9} {:>9} {:>7} {:>12} {:>10} {:>8}",
        "resource", "ops", "max_size", "max_GiB", "ns/op", "vs raw", "peak"
    );
    for (pi, p) in points.iter().enumerate() {
        // Generated once per point, not timed, the same for every resource.
        let ops = random_workload(p.n, p.max_size, p.max_usage, 42 + pi as u64);
        // The baseline is the driver pool itself through mempool-core's thinnest path (`MemPool::allocate`
        // and `free_async`: one driver call each, after a check that the context is current), as
        // mempool-bench's `raw-pool` baseline; every driver call goes through mempool-core's `raw/`.
        let raw_alloc = |size: usize| {
            raw_pool
                .allocate(size, s)
                .unwrap_or_else(|e| panic!("raw pool: allocate({size}): {e}"))
        };
        let raw_free = |ptr: DeviceAddr, _size: usize| {
            // SAFETY: `ptr` came from `raw_pool.allocate` above on this stream, `run` frees it once and never
            // touches the memory.
            #[allow(unsafe_code)]
            let r = unsafe { raw_pool.free_async(ptr, s) };
            r.unwrap_or_else(|e| panic!("raw pool: free: {e}"));
        };
        run(&ops, s, &raw_alloc, &raw_free);
        let raw = median((0..REPEATS).map(|_| run(&ops, s, &raw_alloc, &raw_free).0).collect());
        // Every resource's ratio is taken against raw runs interleaved with its own.
        let kib = |b: usize| {
            if b >= 1 << 20 {
                format!("{}MiB", b >> 20)
            } else {
                format!("{}KiB", b >> 10)
            }
        };
        println!(
            "{:<16} {:>9} {:>9} {:>7} {:>12.1} {:>10} {:>8}",
            "raw pool",
            ops.len(),
            kib(p.max_size),
            p.max_usage >> 30,
            raw,
            "1.000",
            "-"
        );
        for (name, make) in &resources {
            if only.as_ref().is_some_and(|o| !o.iter().any(|x| x == name)) {
                continue;
            }
            let mr = make()?;
            let alloc = |size: usize| mr.allocate(size, s).unwrap_or_else(|e| panic!("{name}: {e}"));
            let free = |ptr: DeviceAddr, size: usize| {
                // SAFETY: `run` frees each allocation it got from `alloc` exactly once, with its size, on `s`,
                // and never touches the memory.
                unsafe { mr.deallocate(ptr, size, s) }.unwrap_or_else(|e| panic!("{name}: {e}"))
            };
            run(&ops, s, &alloc, &free);
            // cuMemAlloc/cuMemFree synchronize: one timed run keeps the baseline resource's run short.
            let repeats = if *name == "cuda" { 1 } else { REPEATS };
            let mut peak = 0;
            let mut raw_times = Vec::with_capacity(repeats);
            // Alternate which of the pair runs first, so neither always follows the other.
            let times: Vec<f64> = (0..repeats)
                .map(|k| {
                    if k % 2 == 0 {
                        raw_times.push(run(&ops, s, &raw_alloc, &raw_free).0);
                    }
                    let (t, pk) = run(&ops, s, &alloc, &free);
                    if k % 2 == 1 {
                        raw_times.push(run(&ops, s, &raw_alloc, &raw_free).0);
                    }
                    peak = pk;
                    t
                })
                .collect();
            let t = median(times);
            let raw_here = median(raw_times);
            println!(
                "{:<16} {:>9} {:>9} {:>7} {:>12.1} {:>10.3} {:>8}",
                name,
                ops.len(),
                kib(p.max_size),
                p.max_usage >> 30,
                t,
                t / raw_here,
                peak
            );
            drop(mr);
            raw_pool.trim_to(0)?;
        }
    }
    Ok(())
}
