//! The torture test: every device at once, threads x every resource x pools created and destroyed x
//! frees on other streams and other threads, with every byte of every block checked before it is freed
//! and a watchdog that fails the run (with what each thread was doing) instead of letting it hang.
//!
//! GPU only: `cargo test -p mempool-rmm --features gpu --release --test torture`. It runs for
//! `MEMPOOL_TORTURE_SECS` seconds (default 20; the release check runs it for 600 on two GPUs, see
//! docs/testing.md), with `MEMPOOL_TORTURE_THREADS` workers per device (default 6). A worker that makes
//! no step for `MEMPOOL_TORTURE_STALL_SECS` (default 120) aborts the run after naming where every worker
//! is, `MEMPOOL_TORTURE_STALL_WAIT_SECS` later (default 0: time for a debugger to take the stacks).
//!
//! What each worker does, until the time is up, on the devices in turn:
//! - takes a fresh resource of a kind picked at random (so pools, arenas, mappings and reservations are
//!   created and destroyed all the time, beside other threads' work), or one of the device's shared
//!   resources, which every worker of the device allocates from and frees to;
//! - allocates blocks of random sizes on one of its two streams and writes a pattern of its own over
//!   every byte with a kernel;
//! - checks every byte of each block (a copy back to the host) before it frees it, so that a block handed
//!   to two owners at once, or reused while a kernel still wrote it, is seen;
//! - frees some blocks on its other stream (ordered by an event) and sends others, with an event, to
//!   another worker of the same device, which checks and frees them on its own stream;
//! - drops the fresh resource with its frees still queued on the streams.
#![cfg(feature = "gpu")]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Context, Device, DeviceAddr, Event, EventFlags, Stream};
use mempool_rmm::adaptors::{AlignedAdaptor, LimitingAdaptor, StatisticsAdaptor, TrackingAdaptor};
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::workload::SplitMix64;
use mempool_rmm::{
    ArenaResource, AsyncManagedOptions, AsyncManagedResource, AsyncOptions, AsyncResource, BinningResource,
    CudaResource, ExpandableOptions, ExpandableResource, FixedSizeResource, ManagedResource, MemoryResource,
    PoolResource, ReleaseThreshold, SharedResource, VmmOptions, VmmResource,
};

const MIB: usize = 1 << 20;

/// A resource kind: its name, the largest block it serves, and how to make one (None: the device lacks
/// what it needs, which `make` has already checked is the reason).
struct Kind {
    name: &'static str,
    max: usize,
    make: fn(&Device) -> Option<SharedResource>,
}

fn async_keep_all(d: &Device) -> AsyncResource {
    AsyncResource::new(
        d,
        AsyncOptions {
            release_threshold: ReleaseThreshold::KeepAll,
            ..Default::default()
        },
    )
    .unwrap()
}

fn kinds() -> Vec<Kind> {
    fn k(name: &'static str, max: usize, make: fn(&Device) -> Option<SharedResource>) -> Kind {
        Kind { name, max, make }
    }
    vec![
        k("async_resource", 8 * MIB, |d| Some(Arc::new(async_keep_all(d)))),
        k("async_default_pool", 8 * MIB, |d| {
            Some(Arc::new(AsyncResource::default_pool(d).unwrap()))
        }),
        k("async_driver_threshold", 8 * MIB, |d| {
            Some(Arc::new(
                AsyncResource::new(
                    d,
                    AsyncOptions {
                        release_threshold: ReleaseThreshold::DriverDefault,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ))
        }),
        k("async_primed", 8 * MIB, |d| {
            Some(Arc::new(
                AsyncResource::new(
                    d,
                    AsyncOptions {
                        initial_size: Some(16 * MIB),
                        ..Default::default()
                    },
                )
                .unwrap(),
            ))
        }),
        k("cuda_resource", 8 * MIB, |d| {
            Some(Arc::new(CudaResource::new(d).unwrap()))
        }),
        k("managed_resource", 4 * MIB, |d| {
            Some(Arc::new(ManagedResource::new(d).unwrap()))
        }),
        k("async_managed_resource", 4 * MIB, |d| {
            d.supports_managed_pools().unwrap().then(|| {
                Arc::new(AsyncManagedResource::new(d, AsyncManagedOptions::default()).unwrap()) as SharedResource
            })
        }),
        k("statistics_adaptor", 8 * MIB, |d| {
            Some(Arc::new(StatisticsAdaptor::new(async_keep_all(d))))
        }),
        k("tracking_adaptor", 8 * MIB, |d| {
            Some(Arc::new(TrackingAdaptor::new(async_keep_all(d))))
        }),
        k("limiting_adaptor", 8 * MIB, |d| {
            Some(Arc::new(LimitingAdaptor::new(async_keep_all(d), 8 << 30)))
        }),
        k("aligned_adaptor", 8 * MIB, |d| {
            Some(Arc::new(
                AlignedAdaptor::new(async_keep_all(d), 4096, 64 * 1024).unwrap(),
            ))
        }),
        k("pool_resource", 8 * MIB, |d| {
            Some(Arc::new(
                PoolResource::new(async_keep_all(d), d, PoolOptions::default()).unwrap(),
            ))
        }),
        k("fixed_size_resource", MIB, |d| {
            Some(Arc::new(
                FixedSizeResource::new(async_keep_all(d), d, FixedSizeOptions::default()).unwrap(),
            ))
        }),
        k("binning_resource", 8 * MIB, |d| {
            Some(Arc::new(
                BinningResource::new(async_keep_all(d), d, BinningOptions::default()).unwrap(),
            ))
        }),
        k("arena_resource", 8 * MIB, |d| {
            Some(Arc::new(
                ArenaResource::new(async_keep_all(d), d, ArenaOptions::default()).unwrap(),
            ))
        }),
        k("expandable_resource", 8 * MIB, |d| {
            Some(Arc::new(
                ExpandableResource::new(d, ExpandableOptions::default()).unwrap(),
            ))
        }),
        k("expandable_small_chunks", 8 * MIB, |d| {
            Some(Arc::new(
                ExpandableResource::new(
                    d,
                    ExpandableOptions {
                        chunk_size: Some(2 * MIB),
                        reservation: Some(4 << 30),
                        ..Default::default()
                    },
                )
                .unwrap(),
            ))
        }),
        k("vmm_resource", 8 * MIB, |d| {
            Some(Arc::new(VmmResource::new(d, VmmOptions::default()).unwrap()))
        }),
        k("pool_over_vmm", 8 * MIB, |d| {
            Some(Arc::new(
                PoolResource::new(
                    VmmResource::new(d, VmmOptions::default()).unwrap(),
                    d,
                    PoolOptions::default(),
                )
                .unwrap(),
            ))
        }),
    ]
}

/// A block on its way to another worker: checked and freed there, after `done`.
struct Handed {
    mr: SharedResource,
    ptr: DeviceAddr,
    bytes: usize,
    base: u32,
    done: Event,
}

/// What the run did, for its last line.
#[derive(Default)]
struct Counts {
    resources_made: AtomicU64,
    blocks: AtomicU64,
    bytes_checked: AtomicU64,
    handed: AtomicU64,
    freed_on_other_stream: AtomicU64,
}

/// One worker's place, for the watchdog's report.
struct Progress {
    steps: AtomicU64,
    doing: Mutex<String>,
}

impl Progress {
    fn at(&self, what: impl Into<String>) {
        *self.doing.lock().unwrap() = what.into();
        self.steps.fetch_add(1, Ordering::Relaxed);
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Checks that every u32 of the block is `base + i`: a copy of the whole block, ordered on `stream`.
fn check_block(ctx: &Arc<Context>, stream: &Stream, ptr: DeviceAddr, bytes: usize, base: u32, who: &str) {
    let mut host = vec![0u8; bytes];
    // SAFETY: `ptr` is a live block of `bytes` bytes of the calling worker, written on (or ordered before)
    // `stream`; the copy is waited for before `host` is read.
    unsafe { memory::copy_to_host(ctx, &mut host, ptr, stream.as_ref()) }.unwrap();
    if let Some((i, v)) = u32s(&host)
        .into_iter()
        .enumerate()
        .find(|&(i, v)| v != base.wrapping_add(i as u32))
    {
        panic!(
            "{who}: the block at {ptr} ({bytes} bytes) holds {v:#x} at word {i}, not {:#x}: another owner wrote it",
            base.wrapping_add(i as u32)
        );
    }
}

/// Frees `ptr` to `mr` on `stream`.
fn free(mr: &SharedResource, ptr: DeviceAddr, bytes: usize, stream: &Stream) {
    // SAFETY: every caller passes a block it allocated from `mr` with `bytes` (or was handed, with the
    // event of its last use waited on by `stream`), freed once; its uses are ordered before this point of
    // `stream`.
    unsafe { mr.deallocate(ptr, bytes, stream.as_ref()) }.unwrap();
}

#[allow(clippy::too_many_arguments)]
fn worker(
    id: usize,
    dev: Device,
    kinds: &[Kind],
    shared: &[(usize, SharedResource)],
    inbox: Receiver<Handed>,
    peers: Vec<Sender<Handed>>,
    deadline: Instant,
    counts: &Counts,
    progress: &Progress,
) {
    let ctx = dev.context().unwrap();
    let (a, b) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let kernels = CheckKernels::load(&ctx).unwrap();
    let mut rng = SplitMix64(0x5eed ^ id as u64);
    let who = format!("worker {id} on device {}", dev.ordinal());
    let mut round = 0u64;
    while Instant::now() < deadline {
        round += 1;
        // Blocks other workers sent: check every byte, then free here.
        while let Ok(h) = inbox.try_recv() {
            progress.at(format!("checking a block handed by another worker ({})", h.mr.name()));
            b.wait(&h.done).unwrap();
            check_block(&ctx, &b, h.ptr, h.bytes, h.base, &who);
            free(&h.mr, h.ptr, h.bytes, &b);
            counts.bytes_checked.fetch_add(h.bytes as u64, Ordering::Relaxed);
        }
        // A fresh resource two rounds of three, a shared one otherwise.
        let (mr, max, fresh) = if rng.below(3) < 2 {
            let kind = &kinds[rng.below(kinds.len() as u64) as usize];
            progress.at(format!("making a {}", kind.name));
            match (kind.make)(&dev) {
                Some(mr) => {
                    counts.resources_made.fetch_add(1, Ordering::Relaxed);
                    (mr, kind.max, true)
                }
                None => continue,
            }
        } else {
            let (max, mr) = &shared[rng.below(shared.len() as u64) as usize];
            (mr.clone(), *max, false)
        };
        let mut live = Vec::new();
        for _ in 0..1 + rng.below(6) {
            let bytes = 4 * (1 + rng.below((max / 4) as u64) as usize);
            let stream = if rng.below(2) == 0 { &a } else { &b };
            progress.at(format!("allocating {bytes} bytes from {}", mr.name()));
            let ptr = mr
                .allocate(bytes, stream.as_ref())
                .unwrap_or_else(|e| panic!("{who}: {} refused {bytes} bytes: {e}", mr.name()));
            let base = (id as u32) << 24 | (round as u32 & 0xfff) << 12 | live.len() as u32;
            // SAFETY: `ptr` holds `bytes / 4` u32s for work on `stream`.
            unsafe { kernels.iota(ptr, bytes / 4, base, stream.as_ref()) }.unwrap();
            counts.blocks.fetch_add(1, Ordering::Relaxed);
            live.push((ptr, bytes, base, stream));
        }
        for (ptr, bytes, base, stream) in live {
            progress.at(format!("checking and freeing a block of {}", mr.name()));
            match rng.below(3) {
                // Checked and freed on the stream that wrote it.
                0 => {
                    check_block(&ctx, stream, ptr, bytes, base, &who);
                    counts.bytes_checked.fetch_add(bytes as u64, Ordering::Relaxed);
                    free(&mr, ptr, bytes, stream);
                }
                // Checked, then freed on the other stream, ordered by an event.
                1 => {
                    check_block(&ctx, stream, ptr, bytes, base, &who);
                    counts.bytes_checked.fetch_add(bytes as u64, Ordering::Relaxed);
                    let other = if std::ptr::eq(stream, &a) { &b } else { &a };
                    let done = Event::new(&ctx, EventFlags::DISABLE_TIMING).unwrap();
                    done.record(stream.as_ref()).unwrap();
                    other.wait(&done).unwrap();
                    free(&mr, ptr, bytes, other);
                    counts.freed_on_other_stream.fetch_add(1, Ordering::Relaxed);
                }
                // Sent to another worker of this device, which checks and frees it.
                _ => {
                    let done = Event::new(&ctx, EventFlags::DISABLE_TIMING).unwrap();
                    done.record(stream.as_ref()).unwrap();
                    let to = &peers[rng.below(peers.len() as u64) as usize];
                    let h = Handed {
                        mr: mr.clone(),
                        ptr,
                        bytes,
                        base,
                        done,
                    };
                    if let Err(mpsc::SendError(h)) = to.send(h) {
                        // That worker has finished: check and free it here.
                        a.wait(&h.done).unwrap();
                        check_block(&ctx, &a, h.ptr, h.bytes, h.base, &who);
                        free(&h.mr, h.ptr, h.bytes, &a);
                    } else {
                        counts.handed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        if fresh {
            progress.at(format!("dropping a {}", mr.name()));
        }
        // A fresh resource drops here unless a block of it is on its way to another worker.
        drop(mr);
    }
    progress.at("finishing: waiting for the last handed blocks");
    // Peers send until their own deadline: drain until every sender is gone.
    drop(peers);
    for h in inbox {
        b.wait(&h.done).unwrap();
        check_block(&ctx, &b, h.ptr, h.bytes, h.base, &who);
        free(&h.mr, h.ptr, h.bytes, &b);
        counts.bytes_checked.fetch_add(h.bytes as u64, Ordering::Relaxed);
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    progress.at("done");
}

#[test]
fn every_resource_on_every_device_from_many_threads_with_every_byte_checked() {
    let secs = env_or("MEMPOOL_TORTURE_SECS", 20);
    let per_device = env_or("MEMPOOL_TORTURE_THREADS", 6).max(2) as usize;
    let stall = Duration::from_secs(env_or("MEMPOOL_TORTURE_STALL_SECS", 120));
    let stall_wait = Duration::from_secs(env_or("MEMPOOL_TORTURE_STALL_WAIT_SECS", 0));
    let devices: Vec<Device> = (0..Device::count().expect("the torture test needs a CUDA driver"))
        .map(|i| Device::get(i).unwrap())
        .collect();
    assert!(!devices.is_empty(), "the torture test needs a CUDA device");
    let kinds = kinds();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let counts = Counts::default();
    let threads = devices.len() * per_device;
    let progress: Vec<Progress> = (0..threads)
        .map(|_| Progress {
            steps: AtomicU64::new(0),
            doing: Mutex::new("starting".into()),
        })
        .collect();
    // The resources every worker of a device shares, made before the workers start and dropped after.
    let shared: Vec<Vec<(usize, SharedResource)>> = devices
        .iter()
        .map(|d| {
            [
                "async_resource",
                "pool_resource",
                "arena_resource",
                "binning_resource",
                "expandable_resource",
                "vmm_resource",
                "fixed_size_resource",
            ]
            .iter()
            .map(|n| {
                let k = kinds.iter().find(|k| k.name == *n).unwrap();
                (k.max, (k.make)(d).unwrap())
            })
            .collect()
        })
        .collect();
    let finished = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for (di, dev) in devices.iter().enumerate() {
            let (senders, receivers): (Vec<_>, Vec<_>) = (0..per_device).map(|_| mpsc::channel()).unzip();
            for (w, inbox) in receivers.into_iter().enumerate() {
                let id = di * per_device + w;
                let peers: Vec<_> = senders
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != w)
                    .map(|(_, s)| s.clone())
                    .collect();
                let (kinds, shared, counts, progress, finished, dev) =
                    (&kinds, &shared[di], &counts, &progress[id], &finished, *dev);
                std::thread::Builder::new()
                    .name(format!("torture-{id}"))
                    .spawn_scoped(scope, move || {
                        worker(id, dev, kinds, shared, inbox, peers, deadline, counts, progress);
                        finished.fetch_add(1, Ordering::Release);
                    })
                    .unwrap();
            }
        }
        // The watchdog: a worker that makes no step for `stall` fails the run, naming where each waits.
        let mut last: Vec<(u64, Instant)> = progress.iter().map(|_| (0, Instant::now())).collect();
        while finished.load(Ordering::Acquire) < threads {
            std::thread::sleep(Duration::from_millis(500));
            for (i, p) in progress.iter().enumerate() {
                let steps = p.steps.load(Ordering::Relaxed);
                let doing = p.doing.lock().unwrap().clone();
                if steps != last[i].0 || doing == "done" {
                    last[i] = (steps, Instant::now());
                } else if last[i].1.elapsed() > stall {
                    for (j, q) in progress.iter().enumerate() {
                        eprintln!("STALL: worker {j}: {}", q.doing.lock().unwrap());
                    }
                    eprintln!(
                        "STALL: worker {i} made no step for {} s (pid {}; aborting in {} s)",
                        stall.as_secs(),
                        std::process::id(),
                        stall_wait.as_secs()
                    );
                    // Time for a debugger to take every thread's stack (scripts/issue33-gpu.sh does).
                    std::thread::sleep(stall_wait);
                    std::process::abort();
                }
            }
        }
    });
    drop(shared);
    let c = &counts;
    println!(
        "torture: {secs} s on {} device(s), {threads} workers: {} resources made and dropped, {} blocks, {} MiB checked byte for byte, {} blocks freed by another thread, {} on another stream",
        devices.len(),
        c.resources_made.load(Ordering::Relaxed),
        c.blocks.load(Ordering::Relaxed),
        c.bytes_checked.load(Ordering::Relaxed) >> 20,
        c.handed.load(Ordering::Relaxed),
        c.freed_on_other_stream.load(Ordering::Relaxed),
    );
    assert!(c.resources_made.load(Ordering::Relaxed) > 0 && c.handed.load(Ordering::Relaxed) > 0);
}
