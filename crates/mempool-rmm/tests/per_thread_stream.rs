//! GPU tests of issue 33, finding 2: the per-thread default stream (`CU_STREAM_PER_THREAD`, the handle 2)
//! names a different stream on every thread, so two threads' per-thread streams must never share memory
//! without one being ordered after the other.
//!
//! The scenario, for every resource: thread A allocates on its per-thread stream, launches a kernel that
//! spins for a while and then writes a pattern into the memory, and frees it on its per-thread stream
//! (or hands it to thread C, which drops it while A runs or after A ended); thread B then allocates the same size on *its* per-thread
//! stream and fills it. After everything is synchronized, B's data must be intact: had B been handed A's
//! memory without waiting for A's kernel (the handle 2 keyed as one stream: the bug), the kernel's late
//! write lands on B's data. A watchdog aborts the process, naming the test, if a case takes more than a
//! minute (the hang seen through CuPy).
//!
//! The suballocating resources keep one engine per hardware thread (threads take shard numbers in turn),
//! so for B to meet A's memory at all it must use A's engine: the cases start `shards - 1` other threads
//! that allocate once in between (the tests run one at a time, under [`GPU`]).
//!
//! `cargo test -p mempool-rmm --features gpu --test per_thread_stream` (or `scripts/gpu-tests.sh`).
#![cfg(feature = "gpu")]
#![allow(unsafe_code)] // the tests free what they allocate and launch kernels

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Context, Device, Stream, StreamRef};
use mempool_rmm::containers::DeviceBuffer;
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::{
    ArenaResource, AsyncOptions, AsyncResource, BinningResource, CudaResource, Error, ExpandableOptions,
    ExpandableResource, FixedSizeResource, HostPoolOptions, HostPoolResource, ManagedResource, MemoryResource,
    PoolResource, ServiceOptions, ServiceResource, SharedResource, VmmOptions, VmmResource,
};

/// `u32` elements per allocation: 256 KiB, 256 blocks of 256 threads, one wave of the late kernel on
/// any recent GPU; within every bin and block size of the suballocators' defaults.
const N: usize = 1 << 16;
const BYTES: usize = N * 4;
/// How long A's kernel spins before it writes.
const LATE_NS: u64 = 200_000_000;
/// What A's kernel writes; B writes `B_BASE + i`.
const A_VALUE: u32 = 0xAAAA_AAAA;
const B_BASE: u32 = 0x1000_0000;
/// Rounds per resource: the first hand-over between two streams synchronizes (the engines'
/// `EventPolicy::Adaptive`), later ones wait on an event.
const ROUNDS: usize = 3;

/// The tests measure thread numbers and the device: one at a time.
static GPU: Mutex<()> = Mutex::new(());

fn gpu() -> (MutexGuard<'static, ()>, Device) {
    let lock = GPU.lock().unwrap_or_else(PoisonError::into_inner);
    (lock, Device::get(0).expect("GPU tests need a CUDA device"))
}

/// Aborts the process with a message if not dropped within `limit`: a hung allocation fails the run
/// instead of stalling it.
struct Watchdog(Option<mpsc::Sender<()>>);

impl Watchdog {
    fn start(what: &'static str, limit: Duration) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!(
                    "per_thread_stream: {what} did not finish within {limit:?} (a hang in the allocator?); aborting"
                );
                // What every thread is doing, as the kernel sees it (its last step is in the trace above:
                // run with --nocapture).
                if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
                    for t in tasks.flatten() {
                        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                        eprintln!(
                            "  thread {} {}: wchan {} syscall {}",
                            t.file_name().to_string_lossy(),
                            read("comm").trim(),
                            read("wchan").trim(),
                            read("syscall").split(' ').next().unwrap_or("").trim()
                        );
                    }
                }
                std::process::abort();
            }
        });
        Watchdog(Some(tx))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// One step of a case, to stderr (shown with `--nocapture`): the last one printed names where a hang is.
fn step(what: &str, round: usize, msg: &str) {
    eprintln!("{what} round {round}: {msg}");
}

/// How A lets go of its memory.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Free {
    /// `deallocate` on A's per-thread stream, on thread A.
    OnA,
    /// A `DeviceBuffer` on A's per-thread stream, dropped by thread C while thread A still runs (the free
    /// goes on the legacy stream, which waits for A's per-thread stream).
    OnAnotherThread,
    /// The same after thread A has ended (the free synchronizes the context first).
    AfterItsThreadEnded,
}

/// Runs the scenario (see the module documentation) `ROUNDS` times over `mr`; `shards` is how many engines
/// the resource keeps (1 for resources that are not suballocators). Panics naming the round when B's
/// data is not intact. Returns how many rounds B got A's address.
fn scenario(what: &'static str, dev: &Device, mr: SharedResource, shards: usize, free: Free) -> usize {
    let _watchdog = Watchdog::start(what, Duration::from_secs(60));
    let ctx = dev.context().unwrap();
    let kernels = Arc::new(CheckKernels::load(&ctx).unwrap());
    let mut reused = 0;
    for round in 0..ROUNDS {
        // Thread A: allocate, launch the late writer, let go (or hand the buffer to C, and wait until told
        // to end, or end at once).
        let (a_ctx, a_mr, a_kernels) = (ctx.clone(), mr.clone(), kernels.clone());
        let (to_main, from_a) = mpsc::channel();
        let (end_a, a_may_end) = mpsc::channel::<()>();
        let mut a = Some(std::thread::spawn(move || {
            let s = StreamRef::PER_THREAD.in_context(&a_ctx);
            let handed = match free {
                Free::OnA => {
                    step(what, round, "A allocates");
                    let p = a_mr.allocate(BYTES, s).unwrap();
                    step(what, round, "A launches the late writer");
                    // SAFETY: `p` holds BYTES bytes on `s` until the free below, which is ordered after the
                    // kernel on the same stream.
                    unsafe { a_kernels.late_fill(p, N, A_VALUE, LATE_NS, s) }.unwrap();
                    step(what, round, "A frees");
                    // SAFETY: `p` came from `allocate(BYTES)` on this resource; the only work on it (the kernel)
                    // is ordered before this point of `s`.
                    unsafe { a_mr.deallocate(p, BYTES, s) }.unwrap();
                    step(what, round, "A freed");
                    (p, None)
                }
                Free::OnAnotherThread | Free::AfterItsThreadEnded => {
                    let s = StreamRef::PER_THREAD.in_context(Box::leak(Box::new(a_ctx.clone())));
                    step(what, round, "A allocates a buffer");
                    let buf = DeviceBuffer::new(BYTES, s, a_mr.clone()).unwrap();
                    step(what, round, "A launches the late writer");
                    // SAFETY: the buffer holds BYTES bytes on `s`; its free (when C drops it) is ordered after
                    // the work queued on A's per-thread stream, the kernel among it.
                    unsafe { a_kernels.late_fill(buf.ptr(), N, A_VALUE, LATE_NS, s) }.unwrap();
                    (buf.ptr(), Some(buf))
                }
            };
            to_main.send(handed).unwrap();
            if free == Free::OnAnotherThread {
                let _ = a_may_end.recv();
            }
            step(what, round, "A ends");
        }));
        let (p, handed) = from_a.recv().unwrap();
        if free != Free::OnAnotherThread {
            a.take().unwrap().join().unwrap();
            step(what, round, "A has ended");
        }
        // Threads that take shard numbers so that B's is A's again (thread C, which frees, is one of them).
        let mut others = shards - 1;
        if let Some(buf) = handed {
            step(what, round, "C drops the buffer");
            std::thread::spawn(move || drop(buf)).join().unwrap();
            step(what, round, "C dropped it");
            others = others.saturating_sub(1);
        }
        for _ in 0..others {
            let (o_ctx, o_mr) = (ctx.clone(), mr.clone());
            std::thread::spawn(move || {
                let s = StreamRef::LEGACY.in_context(&o_ctx);
                let d = o_mr.allocate(256, s).unwrap();
                // SAFETY: nothing used `d`.
                unsafe { o_mr.deallocate(d, 256, s) }.unwrap();
            })
            .join()
            .unwrap();
        }
        // Thread B: the same size on its own per-thread stream, filled at once.
        let (b_ctx, b_mr, b_kernels) = (ctx.clone(), mr.clone(), kernels.clone());
        let q = std::thread::spawn(move || {
            let s = StreamRef::PER_THREAD.in_context(&b_ctx);
            step(what, round, "B allocates");
            let q = b_mr.allocate(BYTES, s).unwrap();
            step(what, round, "B fills and synchronizes");
            // SAFETY: `q` holds BYTES bytes on `s`, freed below after the context is synchronized.
            unsafe { b_kernels.iota(q, N, B_BASE, s) }.unwrap();
            s.synchronize().unwrap();
            q
        })
        .join()
        .unwrap();
        if let Some(a) = a.take() {
            end_a.send(()).unwrap();
            a.join().unwrap();
        }
        // A's kernel has written by now, wherever it wrote.
        step(what, round, "main synchronizes the context");
        ctx.synchronize().unwrap();
        let mut host = vec![0u8; BYTES];
        // SAFETY: `q` is live memory of BYTES bytes; the copy on the legacy stream follows the synchronize.
        unsafe { memory::copy_to_host(&ctx, &mut host, q, StreamRef::LEGACY) }.unwrap();
        let got = u32s(&host);
        let wrong = got
            .iter()
            .enumerate()
            .filter(|(i, v)| **v != B_BASE.wrapping_add(*i as u32))
            .count();
        if q == p {
            reused += 1;
        }
        eprintln!(
            "{what} round {round}: B {} A's address; {wrong} of {N} elements wrong",
            if q == p { "got" } else { "did not get" }
        );
        assert_eq!(
            wrong,
            0,
            "{what} round {round}: B's data was overwritten ({wrong} of {N} elements; first {:#x}; B got A's \
             address: {}): B was handed A's memory before A's kernel was done",
            got.iter()
                .enumerate()
                .find(|(i, v)| **v != B_BASE.wrapping_add(*i as u32))
                .map_or(0, |(_, v)| *v),
            q == p
        );
        // SAFETY: `q` came from `allocate(BYTES)`; everything that used it completed (synchronized above).
        unsafe { mr.deallocate(q, BYTES, StreamRef::LEGACY.in_context(&ctx)) }.unwrap();
        ctx.synchronize().unwrap();
    }
    reused
}

fn pool_over_async(dev: &Device, options: PoolOptions) -> (SharedResource, usize) {
    let mr = PoolResource::new(AsyncResource::default_pool(dev).unwrap(), dev, options).unwrap();
    let shards = mr.shards();
    (Arc::new(mr), shards)
}

macro_rules! every_resource {
    ($free:expr, $($name:ident: $make:expr;)*) => {
        $(
            #[test]
            fn $name() {
                let (_lock, dev) = gpu();
                let make: fn(&Device) -> Option<(SharedResource, usize)> = $make;
                match make(&dev) {
                    Some((mr, shards)) => {
                        let reused = scenario(stringify!($name), &dev, mr, shards, $free);
                        eprintln!("{}: B got A's address in {reused} of {ROUNDS} rounds", stringify!($name));
                    }
                    None => eprintln!("{}: the resource is not supported here; skipped", stringify!($name)),
                }
                assert!(mempool_core::take_drop_errors().is_empty());
            }
        )*
    };
}

every_resource! {
    Free::OnA,
    per_thread_streams_async: |dev| {
        let mr = AsyncResource::new(dev, AsyncOptions::default()).unwrap();
        Some((Arc::new(mr), 1))
    };
    per_thread_streams_pool: |dev| Some(pool_over_async(dev, PoolOptions { initial_size: 64 << 20, ..Default::default() }));
    per_thread_streams_pool_sharded: |dev| Some(pool_over_async(dev, PoolOptions::default()));
    per_thread_streams_arena: |dev| {
        let options = ArenaOptions { initial_size: 64 << 20, ..Default::default() };
        let mr = ArenaResource::new(AsyncResource::default_pool(dev).unwrap(), dev, options).unwrap();
        let shards = mr.shards();
        Some((Arc::new(mr), shards))
    };
    per_thread_streams_arena_sharded: |dev| {
        let mr = ArenaResource::new(AsyncResource::default_pool(dev).unwrap(), dev, ArenaOptions::default()).unwrap();
        let shards = mr.shards();
        Some((Arc::new(mr), shards))
    };
    per_thread_streams_binning: |dev| {
        let mr = BinningResource::new(AsyncResource::default_pool(dev).unwrap(), dev, BinningOptions::default()).unwrap();
        let shards = mr.shards();
        Some((Arc::new(mr), shards))
    };
    per_thread_streams_fixed_size: |dev| {
        let mr = FixedSizeResource::new(AsyncResource::default_pool(dev).unwrap(), dev, FixedSizeOptions::default()).unwrap();
        let shards = mr.shards();
        Some((Arc::new(mr), shards))
    };
    per_thread_streams_service: |dev| {
        let options = ServiceOptions { region_size: Some(256 << 20), max_tags: 2, ..Default::default() };
        let mr: SharedResource = ServiceResource::new(dev, options).unwrap();
        Some((mr, 1))
    };
    per_thread_streams_expandable: |dev| {
        let options = ExpandableOptions { reservation: Some(256 << 20), ..Default::default() };
        Some((Arc::new(ExpandableResource::new(dev, options).unwrap()), 1))
    };
    per_thread_streams_cuda: |dev| Some((Arc::new(CudaResource::new(dev).unwrap()), 1));
    per_thread_streams_managed: |dev| Some((Arc::new(ManagedResource::new(dev).unwrap()), 1));
    per_thread_streams_vmm: |dev| Some((Arc::new(VmmResource::new(dev, VmmOptions::default()).unwrap()), 1));
    per_thread_streams_host_pool: |dev| match HostPoolResource::new(dev, HostPoolOptions::default()) {
        Ok(mr) => Some((Arc::new(mr), 1)),
        Err(Error::Unsupported { .. }) => None,
        Err(e) => panic!("{e}"),
    };
}

mod freed_on_another_thread {
    use super::*;

    every_resource! {
        Free::OnAnotherThread,
        per_thread_buffer_freed_on_another_thread_async: |dev| {
            let mr = AsyncResource::new(dev, AsyncOptions::default()).unwrap();
            Some((Arc::new(mr), 1))
        };
        per_thread_buffer_freed_on_another_thread_pool: |dev| {
            Some(pool_over_async(dev, PoolOptions { initial_size: 64 << 20, ..Default::default() }))
        };
        per_thread_buffer_freed_on_another_thread_pool_sharded: |dev| Some(pool_over_async(dev, PoolOptions::default()));
        per_thread_buffer_freed_on_another_thread_service: |dev| {
            let options = ServiceOptions { region_size: Some(256 << 20), max_tags: 2, ..Default::default() };
            let mr: SharedResource = ServiceResource::new(dev, options).unwrap();
            Some((mr, 1))
        };
        per_thread_buffer_freed_on_another_thread_cuda: |dev| Some((Arc::new(CudaResource::new(dev).unwrap()), 1));
    }
}

mod freed_after_its_thread_ended {
    use super::*;

    every_resource! {
        Free::AfterItsThreadEnded,
        per_thread_buffer_freed_after_its_thread_ended_async: |dev| {
            let mr = AsyncResource::new(dev, AsyncOptions::default()).unwrap();
            Some((Arc::new(mr), 1))
        };
        per_thread_buffer_freed_after_its_thread_ended_pool: |dev| {
            Some(pool_over_async(dev, PoolOptions { initial_size: 64 << 20, ..Default::default() }))
        };
        per_thread_buffer_freed_after_its_thread_ended_service: |dev| {
            let options = ServiceOptions { region_size: Some(256 << 20), max_tags: 2, ..Default::default() };
            let mr: SharedResource = ServiceResource::new(dev, options).unwrap();
            Some((mr, 1))
        };
    }
}

/// The keys themselves: each thread's per-thread stream has its own, stable on that thread; the legacy
/// stream's two handles have one; an owned stream's view answers as the driver does for its handle; a
/// per-thread buffer's stream, seen from another thread, is the legacy stream.
#[test]
fn stream_keys_tell_per_thread_streams_apart() {
    let (_lock, dev) = gpu();
    let _watchdog = Watchdog::start("stream_keys_tell_per_thread_streams_apart", Duration::from_secs(60));
    let ctx: Arc<Context> = dev.context().unwrap();
    let key_here = |ctx: &Arc<Context>| {
        let a = StreamRef::PER_THREAD.key_in(ctx).unwrap();
        assert_eq!(a, StreamRef::PER_THREAD.key_in(ctx).unwrap(), "stable on one thread");
        assert_eq!(
            a,
            StreamRef::PER_THREAD.in_context(ctx).key().unwrap(),
            "with the view's context"
        );
        a
    };
    let mine = key_here(&ctx);
    let c2 = ctx.clone();
    let theirs = std::thread::spawn(move || key_here(&c2)).join().unwrap();
    assert_ne!(mine, theirs, "two threads' per-thread streams are two streams");
    // SAFETY: 1 is CU_STREAM_LEGACY.
    let legacy1 = unsafe { StreamRef::from_raw(1 as mempool_core::RawStream) };
    let legacy = StreamRef::LEGACY.key_in(&ctx).unwrap();
    assert_eq!(legacy, legacy1.key_in(&ctx).unwrap());
    assert_ne!(legacy, mine);
    let s = Stream::new(&ctx).unwrap();
    let owned = s.as_ref().key().unwrap();
    // SAFETY: the handle is `s`'s, live for this view.
    let raw = unsafe { StreamRef::from_raw(s.as_raw()) };
    assert_eq!(owned, raw.key_in(&ctx).unwrap(), "the cached id is the driver's");
    assert!(owned != legacy && owned != mine);
    let t = Stream::new(&ctx).unwrap();
    assert_ne!(t.as_ref().key().unwrap(), owned);
}
