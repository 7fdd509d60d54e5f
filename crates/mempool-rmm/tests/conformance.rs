//! The conformance suite, run against every resource and adaptor (in the spirit of RMM's own
//! `mr_ref_tests`). GPU only: `cargo test -p mempool-rmm --features gpu --test conformance`. The
//! checks that need no GPU also run on the host, against every suballocator engine over a simulated
//! upstream and simulated streams: `crates/mempool-suballoc/tests/conformance.rs`.
#![cfg(feature = "gpu")]

use std::sync::{mpsc, Arc};

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Device, DeviceAddr, Event, EventFlags, Stream};
use mempool_rmm::adaptors::{
    AlignedAdaptor, FailureCallbackAdaptor, LimitingAdaptor, LoggingAdaptor, PrefetchAdaptor, StatisticsAdaptor,
    TrackingAdaptor,
};
use mempool_rmm::resources::Returned;
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::workload::SplitMix64;
use mempool_rmm::{
    ArenaResource, AsyncManagedOptions, AsyncManagedResource, AsyncOptions, AsyncResource, BinningResource,
    CallbackResource, CudaResource, Error, ExpandableOptions, ExpandableResource, FixedSizeResource, ManagedResource,
    MemoryResource, PinnedHostResource, PoolResource, Reclaim, ReleaseThreshold, SamHeadroomResource, SharedResource,
    SystemResource, VmmOptions, VmmResource, ALIGNMENT,
};

const MIB: usize = 1 << 20;

fn device() -> Device {
    Device::get(0).expect("the conformance suite needs a CUDA device")
}

/// What a resource can be asked to do.
#[derive(Copy, Clone)]
struct Caps {
    /// The largest allocation to try.
    max_size: usize,
    /// The memory is system memory (malloc) that the device reaches through pageable memory access: the
    /// driver does not track it (no pointer attributes), and the host reads it through the address.
    system_memory: bool,
    /// One allocation may span several driver allocations mapped back to back (VMM chunks): the pointer
    /// attributes' range is then the chunk's, so both ends are looked up instead of one range.
    spans_mappings: bool,
}

const FULL: Caps = Caps {
    max_size: 1 << 30,
    system_memory: false,
    spans_mappings: false,
};
/// Memory mapped in chunks (the expandable resource): any size, allocations across chunks.
const CHUNKED: Caps = Caps {
    spans_mappings: true,
    ..FULL
};
/// A fixed-size resource of 1 MiB blocks serves nothing larger.
const FIXED: Caps = Caps {
    max_size: 1 << 20,
    system_memory: false,
    spans_mappings: false,
};
/// System-allocated memory, any size.
const SYSTEM: Caps = Caps {
    max_size: 1 << 30,
    system_memory: true,
    spans_mappings: false,
};

/// Writes `base + i` into the first u32s of `ptr` with a kernel and reads them back: the memory is
/// really accessible from the device. System memory is read back by the host through the address, after
/// the kernel is done; the rest by a copy on the stream.
fn check_device_access(ptr: DeviceAddr, bytes: usize, stream: &Stream, kernels: &CheckKernels, base: u32, caps: Caps) {
    let n = (bytes / 4).min(4096);
    if n == 0 {
        return;
    }
    // SAFETY: `ptr` holds at least n u32s (n*4 <= bytes), allocated for work on `stream`.
    unsafe { kernels.iota(ptr, n, base, stream.as_ref()) }.unwrap();
    let values: Vec<u32> = if caps.system_memory {
        stream.synchronize().unwrap();
        (0..n)
            // SAFETY: system memory is host memory at `ptr`, at least n u32s long (4-byte aligned: resources
            // align to 256); the kernel that wrote it completed (synchronized above) and nothing else
            // writes it.
            .map(|i| unsafe { std::ptr::read_volatile((ptr.0 as *const u32).add(i)) })
            .collect()
    } else {
        let mut host = vec![0u8; n * 4];
        // SAFETY: as above; the kernel is ordered before the copy on `stream`.
        unsafe { memory::copy_to_host(stream.context(), &mut host, ptr, stream.as_ref()) }.unwrap();
        u32s(&host)
    };
    assert!(
        values.iter().enumerate().all(|(i, &v)| v == base + i as u32),
        "device access at {ptr}"
    );
}

fn zero_bytes(mr: SharedResource) {
    let stream = Stream::new(&device().context().unwrap()).unwrap();
    let p = mr.allocate(0, stream.as_ref()).unwrap();
    // SAFETY: `p` came from `mr.allocate(0, stream)` just above and is freed once; nothing used it.
    unsafe { mr.deallocate(p, 0, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
}

fn sizes_are_aligned_and_device_accessible(mr: SharedResource, caps: Caps) {
    let ctx = device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let mut size = 4;
    while size <= caps.max_size {
        let p = mr
            .allocate(size, stream.as_ref())
            .unwrap_or_else(|e| panic!("{}: {size} bytes: {e}", mr.name()));
        assert!(!p.is_null());
        assert_eq!(p.0 % ALIGNMENT, 0, "{}: {size} bytes at {p} not aligned", mr.name());
        if !caps.system_memory {
            let info =
                memory::pointer_info(p).unwrap_or_else(|e| panic!("{}: {p} unknown to the driver: {e}", mr.name()));
            if caps.spans_mappings {
                let last = DeviceAddr(p.0 + size as u64 - 1);
                let end = memory::pointer_info(last)
                    .unwrap_or_else(|e| panic!("{}: {last}, the last byte, unknown to the driver: {e}", mr.name()));
                assert!(info.range_start <= p && end.range_start.0 + end.range_size as u64 > last.0);
                assert_eq!(end.device_ordinal, info.device_ordinal);
            } else {
                assert!(info.range_start <= p && p.0 + size as u64 <= info.range_start.0 + info.range_size as u64);
            }
        }
        check_device_access(p, size, &stream, &kernels, size as u32, caps);
        // SAFETY: `p` came from `mr.allocate(size, stream)` above and is freed once; the check kernel and copy that
        // used it were queued on `stream`.
        unsafe { mr.deallocate(p, size, stream.as_ref()) }.unwrap();
        size *= 4;
    }
    stream.synchronize().unwrap();
}

fn impossible_size_is_out_of_memory(mr: SharedResource) {
    let stream = Stream::new(&device().context().unwrap()).unwrap();
    let huge = 1usize << 52;
    let e = mr.allocate(huge, stream.as_ref()).unwrap_err();
    assert!(
        e.is_out_of_memory() || matches!(e, Error::LimitExceeded { .. } | Error::Unsupported { .. }),
        "{}: {e}",
        mr.name()
    );
    if e.is_out_of_memory() {
        assert!(
            e.to_string().contains(&huge.to_string()),
            "the error names the size: {e}"
        );
    }
}

fn random_allocations(mr: SharedResource, caps: Caps) {
    let stream = Stream::new(&device().context().unwrap()).unwrap();
    let mut rng = SplitMix64(1);
    let max = caps.max_size.min(MIB) as u64;
    let mut live = Vec::new();
    for _ in 0..1000 {
        let size = 1 + rng.below(max) as usize;
        live.push((mr.allocate(size, stream.as_ref()).unwrap(), size));
    }
    let mut sorted: Vec<_> = live.iter().map(|&(p, s)| (p.0, s)).collect();
    sorted.sort();
    for w in sorted.windows(2) {
        assert!(
            w[0].0 + w[0].1 as u64 <= w[1].0,
            "{}: live allocations overlap",
            mr.name()
        );
    }
    while !live.is_empty() {
        let (p, s) = live.swap_remove(rng.below(live.len() as u64) as usize);
        // SAFETY: `p` came from `mr.allocate(s, _)` with this size and just left `live`, so it is freed once; its
        // uses (kernels) were queued on this stream.
        unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
    }
    stream.synchronize().unwrap();
}

fn mixed_allocate_and_free(mr: SharedResource, caps: Caps) {
    let stream = Stream::new(&device().context().unwrap()).unwrap();
    let mut rng = SplitMix64(2);
    let max = caps.max_size.min(MIB) as u64;
    let mut live = Vec::new();
    for _ in 0..4000 {
        if live.is_empty() || rng.below(100) < 60 {
            let size = 1 + rng.below(max) as usize;
            live.push((mr.allocate(size, stream.as_ref()).unwrap(), size));
        } else {
            let (p, s) = live.swap_remove(rng.below(live.len() as u64) as usize);
            // SAFETY: `p` came from `mr.allocate(s, _)` with this size and just left `live`, so it is freed once; its
            // uses (kernels) were queued on this stream.
            unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
        }
    }
    for (p, s) in live {
        // SAFETY: each `(p, s)` left in `live` is an allocation of `mr` on `stream`, freed once here.
        unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
    }
    stream.synchronize().unwrap();
}

fn four_threads(mr: SharedResource, caps: Caps) {
    let ctx = device().context().unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (mr, ctx) = (mr.clone(), ctx.clone());
            scope.spawn(move || {
                let stream = Stream::new(&ctx).unwrap();
                let kernels = CheckKernels::load(&ctx).unwrap();
                let mut rng = SplitMix64(10 + t);
                let max = caps.max_size.min(256 * 1024) as u64;
                let mut live = Vec::new();
                for i in 0..500 {
                    if live.is_empty() || rng.below(100) < 60 {
                        let size = 4 + rng.below(max - 4) as usize;
                        let p = mr.allocate(size, stream.as_ref()).unwrap();
                        if i % 50 == 0 {
                            check_device_access(p, size, &stream, &kernels, (t as u32) << 20, caps);
                        }
                        live.push((p, size));
                    } else {
                        let (p, s) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        // SAFETY: `p` came from `mr.allocate(s, _)` with this size and just left `live`, so it is freed once; its
                        // uses (kernels) were queued on this stream.
                        unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
                    }
                }
                for (p, s) in live {
                    // SAFETY: each `(p, s)` left in `live` is an allocation of `mr` on this thread's stream, freed once here;
                    // its uses were queued on that stream.
                    unsafe { mr.deallocate(p, s, stream.as_ref()) }.unwrap();
                }
                stream.synchronize().unwrap();
            });
        }
    });
}

fn allocate_and_free_on_different_threads(mr: SharedResource, caps: Caps) {
    let ctx = device().context().unwrap();
    let (tx, rx) = mpsc::channel::<(DeviceAddr, usize, Event)>();
    let size = caps.max_size.min(MIB);
    std::thread::scope(|scope| {
        let (mr_a, ctx_a) = (mr.clone(), ctx.clone());
        scope.spawn(move || {
            let stream = Stream::new(&ctx_a).unwrap();
            let kernels = CheckKernels::load(&ctx_a).unwrap();
            for i in 0..50 {
                let p = mr_a.allocate(size, stream.as_ref()).unwrap();
                // SAFETY: `p` holds size/4 u32s on `stream`.
                unsafe { kernels.iota(p, size / 4, i, stream.as_ref()) }.unwrap();
                let done = Event::new(&ctx_a, EventFlags::DISABLE_TIMING).unwrap();
                done.record(stream.as_ref()).unwrap();
                tx.send((p, size, done)).unwrap();
            }
            stream.synchronize().unwrap();
        });
        let (mr_b, ctx_b) = (mr.clone(), ctx.clone());
        scope.spawn(move || {
            let stream = Stream::new(&ctx_b).unwrap();
            for (p, size, done) in rx {
                stream.wait(&done).unwrap();
                // SAFETY: `p` was allocated by the other thread from an equal resource (a clone of the same `Arc`) with
                // `size` and sent here once; `stream` waits on the event recorded after its last use.
                unsafe { mr_b.deallocate(p, size, stream.as_ref()) }.unwrap();
            }
            stream.synchronize().unwrap();
        });
    });
}

fn allocate_and_free_on_different_streams(mr: SharedResource, caps: Caps) {
    let ctx = device().context().unwrap();
    let (a, b) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let kernels = CheckKernels::load(&ctx).unwrap();
    let size = caps.max_size.min(MIB);
    for i in 0..100 {
        let p = mr.allocate(size, a.as_ref()).unwrap();
        // SAFETY: `p` holds size/4 u32s on `a`.
        unsafe { kernels.iota(p, size / 4, i, a.as_ref()) }.unwrap();
        let done = Event::new(&ctx, EventFlags::DISABLE_TIMING).unwrap();
        done.record(a.as_ref()).unwrap();
        b.wait(&done).unwrap();
        // SAFETY: `p` came from `mr.allocate(size, a)` and is freed once; `b` waits on the event recorded on `a`
        // after the kernel that used it, so every use is ordered before this free on `b`.
        unsafe { mr.deallocate(p, size, b.as_ref()) }.unwrap();
        // The next allocation on `a` may get memory freed on `b`: the resource must order it.
        let q = mr.allocate(size, a.as_ref()).unwrap();
        check_device_access(q, size, &a, &kernels, 1000 + i, caps);
        // SAFETY: `q` came from `mr.allocate(size, a)` just above and is freed once; the check kernel that used it
        // was queued on `a`.
        unsafe { mr.deallocate(q, size, a.as_ref()) }.unwrap();
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}

/// One module of the suite's tests per resource: `name => constructor, caps;`. The constructor returns the
/// resource; under `conformance_where_capable!` it returns `Option<SharedResource>`, `None` once it has
/// asserted that a device lacking the capability refuses the resource as it should (the test then passes
/// on that assertion: nothing is skipped).
macro_rules! conformance {
    ($($name:ident => $make:expr, $caps:expr;)*) => {$(
        mod $name {
            use super::*;
            fn mr() -> Option<SharedResource> {
                let dev = device();
                let _ = &dev;
                Some($make(&dev))
            }
            conformance!(@tests $caps);
        }
    )*};
    (@tests $caps:expr) => {
        #[test] fn zero_bytes() { if let Some(mr) = mr() { super::zero_bytes(mr) } }
        #[test] fn sizes_are_aligned_and_device_accessible() { if let Some(mr) = mr() { super::sizes_are_aligned_and_device_accessible(mr, $caps) } }
        #[test] fn random_allocations() { if let Some(mr) = mr() { super::random_allocations(mr, $caps) } }
        #[test] fn mixed_allocate_and_free() { if let Some(mr) = mr() { super::mixed_allocate_and_free(mr, $caps) } }
        #[test] fn four_threads() { if let Some(mr) = mr() { super::four_threads(mr, $caps) } }
        #[test] fn allocate_and_free_on_different_threads() { if let Some(mr) = mr() { super::allocate_and_free_on_different_threads(mr, $caps) } }
        #[test] fn allocate_and_free_on_different_streams() { if let Some(mr) = mr() { super::allocate_and_free_on_different_streams(mr, $caps) } }
    };
}

macro_rules! conformance_where_capable {
    ($($name:ident => $make:expr, $caps:expr;)*) => {$(
        mod $name {
            use super::*;
            fn mr() -> Option<SharedResource> {
                let dev = device();
                $make(&dev)
            }
            conformance!(@tests $caps);
        }
    )*};
}

fn async_new(dev: &Device) -> AsyncResource {
    AsyncResource::new(
        dev,
        AsyncOptions {
            release_threshold: ReleaseThreshold::KeepAll,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A callback resource whose callbacks allocate from and free to `upstream`.
fn callback_over<U: MemoryResource + 'static>(upstream: U) -> impl MemoryResource {
    let upstream = Arc::new(upstream);
    let (a, f) = (upstream.clone(), upstream);
    // SAFETY: a `Returned` names an address this resource's allocate callback returned, hence one of
    // `upstream.allocate(bytes, _)`, handed back once, every use ordered before this point of its stream.
    let free = move |r: Returned<'_>| unsafe { f.deallocate(r.ptr(), r.bytes(), r.stream()) };
    // SAFETY: `free` gives back to `upstream` exactly what the allocate callback took from it, with its size.
    unsafe { CallbackResource::new(move |bytes, stream| a.allocate(bytes, stream), free) }
}

/// `made` where the device can allocate from pools of managed memory (a driver for CUDA 13.0 and
/// concurrent managed access); elsewhere asserts that it was refused up front with
/// `Error::Unsupported` naming what is missing, and returns `None`.
fn where_managed_pools<R: MemoryResource + 'static>(
    dev: &Device,
    made: mempool_rmm::Result<R>,
) -> Option<SharedResource> {
    let capable = dev.supports_managed_pools().unwrap();
    match made {
        Ok(mr) => {
            assert!(
                capable,
                "{} was built on a device that cannot allocate from managed pools",
                mr.name()
            );
            Some(Arc::new(mr))
        }
        Err(e) => {
            println!("FINDING: managed pools refused: {e}");
            assert!(!capable, "refused on a device that supports managed pools: {e}");
            let Error::Unsupported {
                resource: "AsyncManagedResource",
                reason,
            } = &e
            else {
                panic!("expected Error::Unsupported from AsyncManagedResource, got {e:?}")
            };
            let prefix = format!(
                "device {} cannot allocate from a pool of managed memory: ",
                dev.ordinal()
            );
            assert!(reason.starts_with(&prefix), "{reason}");
            let driver = mempool_core::driver_version().unwrap();
            let missing = if driver.major() < 13 {
                "need a driver for CUDA 13.0 or newer"
            } else {
                "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0"
            };
            assert!(reason.contains(missing), "{reason}");
            None
        }
    }
}

/// `made` where the device reports pageable memory access; elsewhere asserts the exact refusal, naming
/// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`, and returns `None`.
fn where_pageable<R: MemoryResource + 'static>(
    dev: &Device,
    resource: &'static str,
    made: mempool_rmm::Result<R>,
) -> Option<SharedResource> {
    let capable = dev.pageable_memory_access().unwrap();
    match made {
        Ok(mr) => {
            assert!(
                capable,
                "{resource} was built on a device without pageable memory access"
            );
            Some(Arc::new(mr))
        }
        Err(e) => {
            println!("FINDING: {resource} refused: {e}");
            assert!(
                !capable,
                "{resource} refused on a device with pageable memory access: {e}"
            );
            assert_eq!(
                e,
                Error::Unsupported {
                    resource,
                    reason: format!(
                        "device {} reports CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 0: it cannot access pageable \
                         host memory (malloc); that takes HMM (NVIDIA's open kernel modules on a Linux kernel with \
                         HMM) or ATS (Grace Hopper)",
                        dev.ordinal()
                    )
                }
            );
            None
        }
    }
}

conformance! {
    async_resource => |d: &Device| Arc::new(async_new(d)) as SharedResource, FULL;
    async_default_pool => |d: &Device| Arc::new(AsyncResource::default_pool(d).unwrap()) as SharedResource, FULL;
    async_driver_threshold => |d: &Device| Arc::new(AsyncResource::new(d, AsyncOptions { release_threshold: ReleaseThreshold::DriverDefault, ..Default::default() }).unwrap()) as SharedResource, FULL;
    async_primed => |d: &Device| Arc::new(AsyncResource::new(d, AsyncOptions { initial_size: Some(64 * MIB), ..Default::default() }).unwrap()) as SharedResource, FULL;
    cuda_resource => |d: &Device| Arc::new(CudaResource::new(d).unwrap()) as SharedResource, FULL;
    managed_resource => |d: &Device| Arc::new(ManagedResource::new(d).unwrap()) as SharedResource, FULL;
    pinned_host_resource => |d: &Device| Arc::new(PinnedHostResource::new(d).unwrap()) as SharedResource, FULL;
    statistics_adaptor => |d: &Device| Arc::new(StatisticsAdaptor::new(async_new(d))) as SharedResource, FULL;
    tracking_adaptor => |d: &Device| Arc::new(TrackingAdaptor::new(async_new(d))) as SharedResource, FULL;
    logging_adaptor => |d: &Device| Arc::new(LoggingAdaptor::new(async_new(d), std::io::sink()).unwrap()) as SharedResource, FULL;
    limiting_adaptor => |d: &Device| Arc::new(LimitingAdaptor::new(async_new(d), 8 << 30)) as SharedResource, FULL;
    aligned_adaptor => |d: &Device| Arc::new(AlignedAdaptor::new(async_new(d), 4096, 64 * 1024).unwrap()) as SharedResource, FULL;
    failure_callback_adaptor => |d: &Device| Arc::new(FailureCallbackAdaptor::new(async_new(d), |_, attempt| attempt == 0)) as SharedResource, FULL;
    prefetch_adaptor => |d: &Device| Arc::new(PrefetchAdaptor::new(ManagedResource::new(d).unwrap(), d).unwrap()) as SharedResource, FULL;
    pool_resource => |d: &Device| Arc::new(PoolResource::new(async_new(d), d, PoolOptions::default()).unwrap()) as SharedResource, FULL;
    pool_resource_over_cuda => |d: &Device| Arc::new(PoolResource::new(CudaResource::new(d).unwrap(), d, PoolOptions { initial_size: 256 * MIB as u64, ..Default::default() }).unwrap()) as SharedResource, FULL;
    fixed_size_resource => |d: &Device| Arc::new(FixedSizeResource::new(async_new(d), d, FixedSizeOptions::default()).unwrap()) as SharedResource, FIXED;
    binning_resource => |d: &Device| Arc::new(BinningResource::new(async_new(d), d, BinningOptions::default()).unwrap()) as SharedResource, FULL;
    arena_resource => |d: &Device| Arc::new(ArenaResource::new(async_new(d), d, ArenaOptions::default()).unwrap()) as SharedResource, FULL;
    statistics_over_binning => |d: &Device| Arc::new(StatisticsAdaptor::new(BinningResource::new(async_new(d), d, BinningOptions::default()).unwrap())) as SharedResource, FULL;
    callback_resource => |d: &Device| Arc::new(callback_over(async_new(d))) as SharedResource, FULL;
    expandable_resource => |d: &Device| Arc::new(ExpandableResource::new(d, ExpandableOptions::default()).unwrap()) as SharedResource, CHUNKED;
    // Small chunks: every allocation maps and spans chunk boundaries.
    expandable_reclaim_before_growth => |d: &Device| Arc::new(ExpandableResource::new(d, ExpandableOptions { reclaim: Reclaim::BeforeGrowth, ..Default::default() }).unwrap()) as SharedResource, CHUNKED;
    expandable_small_chunks => |d: &Device| Arc::new(ExpandableResource::new(d, ExpandableOptions { chunk_size: Some(2 * MIB), reservation: Some(16 << 30), ..Default::default() }).unwrap()) as SharedResource, CHUNKED;
    // One physical allocation per request (ncclMemAlloc's shape), and the pool engine over it.
    vmm_resource => |d: &Device| Arc::new(VmmResource::new(d, VmmOptions::default()).unwrap()) as SharedResource, FULL;
    pool_over_vmm => |d: &Device| Arc::new(PoolResource::new(VmmResource::new(d, VmmOptions::default()).unwrap(), d, PoolOptions::default()).unwrap()) as SharedResource, FULL;
    binning_over_callback => |d: &Device| Arc::new(BinningResource::new(callback_over(async_new(d)), d, BinningOptions::default()).unwrap()) as SharedResource, FULL;
}

// The resources that need a capability of the driver or device: where it is there they run the suite,
// where it is not every test asserts the refusal (the `FINDING:` line says which happened).
conformance_where_capable! {
    async_managed_resource => |d: &Device| where_managed_pools(d, AsyncManagedResource::new(d, AsyncManagedOptions::default())), FULL;
    async_managed_default_pool => |d: &Device| where_managed_pools(d, AsyncManagedResource::default_pool(d)), FULL;
    system_resource => |d: &Device| where_pageable(d, "SystemResource", SystemResource::new(d)), SYSTEM;
    // 1 GiB kept free: on an 80 GiB device with the suite's small live set, placed on the GPU.
    sam_headroom_resource => |d: &Device| where_pageable(d, "SamHeadroomResource", SamHeadroomResource::new(d, 1 << 30)), SYSTEM;
    // Everything kept free: every allocation is advised to the host.
    sam_headroom_all_on_host => |d: &Device| where_pageable(d, "SamHeadroomResource", SamHeadroomResource::new(d, usize::MAX)), SYSTEM;
}

/// The out-of-memory check, for every resource except the managed, pinned-host and system-memory ones:
/// asking the driver for petabytes of managed memory can hang a GPU (the managed pools are left out for
/// the same reason), and asking it to pin petabytes of host memory is as hostile to the host (on the GPU
/// machines used here, whose memory grows on demand, a run that did so went on to hang). The system
/// resources' out-of-memory path is the global allocator's null, tested on the host.
macro_rules! out_of_memory {
    ($($name:ident => $make:expr;)*) => {$(
        #[test]
        fn $name() {
            let dev = device();
            impossible_size_is_out_of_memory($make(&dev));
        }
    )*};
}

out_of_memory! {
    oom_async_resource => |d: &Device| Arc::new(async_new(d)) as SharedResource;
    oom_async_default_pool => |d: &Device| Arc::new(AsyncResource::default_pool(d).unwrap()) as SharedResource;
    oom_cuda_resource => |d: &Device| Arc::new(CudaResource::new(d).unwrap()) as SharedResource;
    oom_statistics_adaptor => |d: &Device| Arc::new(StatisticsAdaptor::new(async_new(d))) as SharedResource;
    oom_tracking_adaptor => |d: &Device| Arc::new(TrackingAdaptor::new(async_new(d))) as SharedResource;
    oom_logging_adaptor => |d: &Device| Arc::new(LoggingAdaptor::new(async_new(d), std::io::sink()).unwrap()) as SharedResource;
    oom_limiting_adaptor => |d: &Device| Arc::new(LimitingAdaptor::new(async_new(d), 8 << 30)) as SharedResource;
    oom_aligned_adaptor => |d: &Device| Arc::new(AlignedAdaptor::new(async_new(d), 4096, 64 * 1024).unwrap()) as SharedResource;
    oom_failure_callback_adaptor => |d: &Device| Arc::new(FailureCallbackAdaptor::new(async_new(d), |_, attempt| attempt == 0)) as SharedResource;
    oom_pool_resource => |d: &Device| Arc::new(PoolResource::new(async_new(d), d, PoolOptions::default()).unwrap()) as SharedResource;
    oom_fixed_size_resource => |d: &Device| Arc::new(FixedSizeResource::new(async_new(d), d, FixedSizeOptions::default()).unwrap()) as SharedResource;
    oom_binning_resource => |d: &Device| Arc::new(BinningResource::new(async_new(d), d, BinningOptions::default()).unwrap()) as SharedResource;
    oom_arena_resource => |d: &Device| Arc::new(ArenaResource::new(async_new(d), d, ArenaOptions::default()).unwrap()) as SharedResource;
    oom_expandable_resource => |d: &Device| Arc::new(ExpandableResource::new(d, ExpandableOptions::default()).unwrap()) as SharedResource;
    oom_vmm_resource => |d: &Device| Arc::new(VmmResource::new(d, VmmOptions::default()).unwrap()) as SharedResource;
    oom_callback_resource => |d: &Device| Arc::new(callback_over(async_new(d))) as SharedResource;
}
