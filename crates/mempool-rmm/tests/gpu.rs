//! GPU tests of mempool-rmm's containers, registry and adaptor behaviour on real memory.
//! `cargo test -p mempool-rmm --features gpu --test gpu`.
#![cfg(feature = "gpu")]

use std::sync::Arc;

use mempool_core::kernels::CheckKernels;
use mempool_core::{Device, Stream};
use mempool_rmm::adaptors::{FailureCallbackAdaptor, StatisticsAdaptor};
use mempool_rmm::containers::{DeviceBuffer, DeviceScalar, DeviceVec, StreamPool};
use mempool_rmm::registry::{current_device_resource, reset_current_device_resource, set_current_device_resource};
use mempool_rmm::{AsyncOptions, AsyncResource, MemoryResource, SharedResource};

fn device() -> Device {
    Device::get(0).expect("GPU tests need a CUDA device")
}

#[test]
fn buffer_copies_resizes_and_shrinks_in_stream_order() {
    let dev = device();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let stats = Arc::new(StatisticsAdaptor::new(AsyncResource::default_pool(&dev).unwrap()));
    let mr: SharedResource = stats.clone();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    let mut buf = DeviceBuffer::from_host(&data, &stream, mr.clone()).unwrap();
    assert_eq!(buf.to_host().unwrap(), data);
    buf.resize(50_000).unwrap();
    assert_eq!(buf.capacity(), 50_000);
    assert_eq!(
        &buf.to_host().unwrap()[..10_000],
        &data[..],
        "growth keeps the contents"
    );
    buf.resize(100).unwrap();
    assert_eq!(buf.capacity(), 50_000);
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), 100);
    assert_eq!(buf.to_host().unwrap(), data[..100]);
    assert!(buf.copy_from_host(90, &[0u8; 11]).is_err(), "out-of-range copy refused");
    assert_eq!(stats.counters().allocations.current, 1, "old allocations were returned");
    drop(buf);
    stream.synchronize().unwrap();
    assert_eq!(stats.counters().bytes.current, 0);

    // One stream type: a special stream without a known context is refused with the reason, and works once
    // its context is attached.
    let e = DeviceBuffer::new(64, mempool_core::StreamRef::LEGACY, mr.clone()).unwrap_err();
    assert!(e.to_string().contains("context is unknown"), "{e}");
    let ctx = dev.context().unwrap();
    let legacy = DeviceBuffer::from_host(&data[..64], mempool_core::StreamRef::LEGACY.in_context(&ctx), mr).unwrap();
    assert_eq!(legacy.to_host().unwrap(), data[..64]);
    drop(legacy);
    ctx.synchronize().unwrap();
    assert_eq!(stats.counters().bytes.current, 0);
}

#[test]
fn vectors_and_scalars_hold_typed_data_kernels_can_write() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mr = current_device_resource(&dev).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let v = DeviceVec::<u32>::from_slice(&[5; 1000], &stream, mr.clone()).unwrap();
    // SAFETY: the vector holds 1000 u32s on `stream`.
    unsafe { kernels.add(v.ptr(), v.len(), 2, stream.as_ref()) }.unwrap();
    assert_eq!(v.to_vec().unwrap(), vec![7u32; 1000]);
    v.set(10, 99).unwrap();
    assert_eq!(v.get(10).unwrap(), 99);
    let s = DeviceScalar::new(1.5f64, &stream, mr).unwrap();
    assert_eq!(s.value().unwrap(), 1.5);
    s.set_value(-2.0).unwrap();
    assert_eq!(s.value().unwrap(), -2.0);
}

#[test]
fn registry_defaults_to_the_async_pool_and_swaps() {
    let dev = device();
    let first = current_device_resource(&dev).unwrap();
    // The default records its history (issue 26) over the device's default pool.
    assert_eq!(first.name(), "HistoryResource");
    assert_eq!(first.upstream_resource().map(|u| u.name()), Some("AsyncResource"));
    let mine: SharedResource = Arc::new(StatisticsAdaptor::new(AsyncResource::default_pool(&dev).unwrap()));
    let previous = set_current_device_resource(&dev, mine.clone());
    assert!(previous.is_some_and(|p| Arc::ptr_eq(&p, &first)));
    assert!(Arc::ptr_eq(&current_device_resource(&dev).unwrap(), &mine));
    assert!(reset_current_device_resource(&dev).is_some_and(|p| Arc::ptr_eq(&p, &mine)));
    assert_eq!(current_device_resource(&dev).unwrap().name(), "HistoryResource");
}

#[test]
fn failure_callback_frees_memory_and_retries() {
    let dev = device();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    // A pool capped at 256 MiB. (Seen on H200, driver 580: a capped pool that merely *reserves* free
    // memory releases it by itself when a request needs room, so only live memory makes it run out.)
    let pool = Arc::new(
        AsyncResource::new(
            &dev,
            AsyncOptions {
                max_size: Some(256 << 20),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let hog = pool.allocate(200 << 20, stream.as_ref()).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Some(hog)));
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (p2, h2, c2) = (pool.clone(), held.clone(), calls.clone());
    let s2 = stream.as_ref().handle();
    let mr = FailureCallbackAdaptor::new(pool.clone(), move |bytes, attempt| {
        assert_eq!(bytes, 100 << 20);
        c2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // Free what we hold, then retry once.
        match h2.lock().unwrap().take() {
            #[allow(unsafe_code)]
            Some(p) if attempt == 0 => {
                // SAFETY: the stream handle is the test's live stream.
                let s = unsafe { mempool_core::StreamRef::from_raw(s2 as mempool_core::RawStream) };
                // SAFETY: `p` is the test's 200 MiB allocation from this resource, taken out of
                // `held` (freed once); nothing used it.
                unsafe { p2.deallocate(p, 200 << 20, s) }.unwrap();
                true
            }
            _ => false,
        }
    });
    let b = mr
        .allocate(100 << 20, stream.as_ref())
        .expect("the retry after the callback freed memory succeeds");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the first attempt ran out and called back once"
    );
    // SAFETY: `b` came from `mr.allocate(100 << 20, stream)` above and is freed once; nothing used it.
    #[allow(unsafe_code)]
    unsafe { mr.deallocate(b, 100 << 20, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    assert!(held.lock().unwrap().is_none());
}

#[test]
fn stream_pool_hands_out_streams_round_robin() {
    let ctx = device().context().unwrap();
    let pool = StreamPool::new(&ctx, 3).unwrap();
    let ids: Vec<usize> = (0..6).map(|_| pool.get().as_ref().handle()).collect();
    assert_eq!(ids[0], ids[3]);
    assert_ne!(ids[0], ids[1]);
    assert_ne!(ids[1], ids[2]);
    pool.synchronize().unwrap();
}

#[test]
fn a_host_pool_serves_kernels_and_the_host_or_is_refused_clearly() {
    use mempool_rmm::{Error, HostPoolOptions, HostPoolResource};
    let dev = device();
    let ctx = dev.context().unwrap();
    let mr = match HostPoolResource::new(&dev, HostPoolOptions::default()) {
        Ok(mr) => mr,
        Err(e) => {
            println!("FINDING: host pool refused: {e}");
            assert!(
                matches!(&e, Error::Unsupported { resource: "HostPoolResource", reason } if reason.contains("pool")),
                "{e:?}"
            );
            return;
        }
    };
    println!(
        "FINDING: host pool created; access from device 0: {:?}",
        mr.pool().access(&dev).unwrap()
    );
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    const N: usize = 1 << 20;
    let p = mr.allocate(N * 4, stream.as_ref()).unwrap();
    assert_eq!(p.0 % 256, 0);
    let info = mempool_core::memory::pointer_info(p).unwrap();
    println!("FINDING: host pool pointer attributes: {info:?}");
    // SAFETY: `p` holds N u32s, ordered on `stream`.
    unsafe { kernels.iota(p, N, 11, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    // The host reads the same memory through the address itself: it is host RAM.
    let host: Vec<u32> = (0..N)
        .step_by(4099)
        .map(|i| {
            // SAFETY: host-pool memory is host memory mapped at `p`; the kernel that wrote it is done
            // (synchronized above) and nothing else writes it; the index is in bounds.
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::read_volatile((p.0 as *const u32).add(i))
            }
        })
        .collect();
    let expected: Vec<u32> = (0..N).step_by(4099).map(|i| 11 + i as u32).collect();
    assert_eq!(host, expected);
    // SAFETY: `p` came from `mr.allocate(N * 4, stream)` and is freed once; the kernel that wrote it ran on
    // `stream` and the host reads above finished before this call.
    #[allow(unsafe_code)]
    unsafe { mr.deallocate(p, N * 4, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(mr.pool().usage().unwrap().used_current, 0);
}

#[test]
fn new_pools_keep_everything_unless_told_and_views_change_nothing() {
    use mempool_rmm::ReleaseThreshold;
    let dev = device();
    let threshold = |t: ReleaseThreshold| {
        let mr = AsyncResource::new(
            &dev,
            AsyncOptions {
                release_threshold: t,
                ..Default::default()
            },
        )
        .unwrap();
        mr.pool().release_threshold().unwrap()
    };
    // RMM's default: a new pool keeps everything.
    assert_eq!(
        AsyncResource::new(&dev, AsyncOptions::default())
            .unwrap()
            .pool()
            .release_threshold()
            .unwrap(),
        u64::MAX
    );
    assert_eq!(threshold(ReleaseThreshold::KeepAll), u64::MAX);
    assert_eq!(threshold(ReleaseThreshold::Bytes(64 << 20)), 64 << 20);
    assert_eq!(
        threshold(ReleaseThreshold::DriverDefault),
        0,
        "the driver's default on a new pool"
    );
    // A view of the device's default pool (process-wide) leaves its threshold as it was.
    let before = dev.default_pool().unwrap().release_threshold().unwrap();
    let view = AsyncResource::default_pool(&dev).unwrap();
    assert_eq!(view.pool().release_threshold().unwrap(), before);
    drop(view);
    assert_eq!(dev.default_pool().unwrap().release_threshold().unwrap(), before);
}

#[test]
fn managed_pool_resources_keep_everything_or_are_refused_by_capability() {
    use mempool_core::AllocationType;
    use mempool_rmm::{AsyncManagedOptions, AsyncManagedResource, Error};
    let dev = device();
    let made = AsyncManagedResource::new(&dev, AsyncManagedOptions::default());
    if !dev.supports_managed_pools().unwrap() {
        let e = made.unwrap_err();
        println!("FINDING: managed pools refused: {e}");
        assert!(
            matches!(&e, Error::Unsupported { resource: "AsyncManagedResource", reason }
                if reason.contains("CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS") || reason.contains("CUDA 13.0")),
            "{e:?}"
        );
        assert!(matches!(
            AsyncManagedResource::default_pool(&dev),
            Err(Error::Unsupported { .. })
        ));
        return;
    }
    let owned = made.unwrap();
    assert_eq!(owned.name(), "AsyncManagedResource");
    assert_eq!(owned.pool().allocation_type(), AllocationType::Managed);
    assert_eq!(
        owned.pool().release_threshold().unwrap(),
        u64::MAX,
        "a new pool keeps everything"
    );
    let default = AsyncManagedResource::default_pool(&dev).unwrap();
    assert_eq!(default.pool().kind(), mempool_core::PoolKind::Borrowed);
    let before = dev.default_managed_pool().unwrap().release_threshold().unwrap();
    drop(default);
    assert_eq!(
        dev.default_managed_pool().unwrap().release_threshold().unwrap(),
        before,
        "RMM's resource leaves the default managed pool's attributes alone"
    );
    // Managed memory: kernels write it on the stream, the host reads it through the address afterwards.
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    const N: usize = 1 << 16;
    let p = owned.allocate(N * 4, stream.as_ref()).unwrap();
    // SAFETY: `p` holds N u32s, allocated on `stream`.
    unsafe { kernels.iota(p, N, 3, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    // SAFETY: managed memory of N u32s at `p`; the kernel that wrote it completed and nothing else writes it.
    #[allow(unsafe_code)]
    let last = unsafe { std::ptr::read_volatile((p.0 as *const u32).add(N - 1)) };
    assert_eq!(last, 3 + (N - 1) as u32);
    // SAFETY: `p` came from `owned.allocate(N * 4, stream)` and is freed once; its uses are done.
    #[allow(unsafe_code)]
    unsafe { owned.deallocate(p, N * 4, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
}

/// System memory (malloc) used by a kernel where the device reports pageable memory access, and the
/// exact refusal naming `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` where it does not: never skipped.
/// The headroom resource's advice is read back from the driver.
#[test]
fn system_memory_serves_kernels_and_the_host_or_is_refused_by_attribute() {
    use mempool_core::memory::{self, PreferredLocation};
    use mempool_rmm::{Error, SamHeadroomResource, SystemResource};
    let dev = device();
    let capable = dev.pageable_memory_access().unwrap();
    println!(
        "FINDING: CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = {}",
        capable as i32
    );
    let refusal = |resource: &'static str| Error::Unsupported {
        resource,
        reason: format!(
            "device {} reports CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 0: it cannot access pageable host \
             memory (malloc); that takes HMM (NVIDIA's open kernel modules on a Linux kernel with HMM) or ATS \
             (Grace Hopper)",
            dev.ordinal()
        ),
    };
    if !capable {
        assert_eq!(SystemResource::new(&dev).unwrap_err(), refusal("SystemResource"));
        assert_eq!(
            SamHeadroomResource::new(&dev, 1 << 30).unwrap_err(),
            refusal("SamHeadroomResource")
        );
        return;
    }
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    const N: usize = 16 << 20; // 64 MiB of u32s
    let system = SystemResource::new(&dev).unwrap();
    let on_gpu = SamHeadroomResource::new(&dev, 0).unwrap();
    let on_host = SamHeadroomResource::new(&dev, usize::MAX).unwrap();
    let resources: [(&dyn MemoryResource, Option<PreferredLocation>); 3] = [
        (&system, None),
        (&on_gpu, Some(PreferredLocation::Device(dev.ordinal() as i32))),
        (&on_host, Some(PreferredLocation::Host)),
    ];
    for (mr, advised) in resources {
        let p = mr.allocate(N * 4, stream.as_ref()).unwrap();
        assert_eq!(p.0 % 256, 0);
        if let Some(advised) = advised {
            let found = memory::preferred_location(&ctx, p, N * 4).unwrap();
            println!("FINDING: {} advised {found:?}", mr.name());
            assert_eq!(found, advised, "{}", mr.name());
        }
        // The host writes, a kernel adds, the host reads back through the same address.
        // SAFETY: `p` is N u32s of fresh host memory from the global allocator; no device work uses it yet.
        #[allow(unsafe_code)]
        unsafe { std::slice::from_raw_parts_mut(p.0 as *mut u32, N) }.fill(7);
        // SAFETY: `p` holds N u32s, reachable by the device through pageable memory access.
        unsafe { kernels.add(p, N, 5, stream.as_ref()) }.unwrap();
        stream.synchronize().unwrap();
        // SAFETY: as above; the kernel completed (synchronized) and nothing else writes the memory.
        #[allow(unsafe_code)]
        let host = unsafe { std::slice::from_raw_parts(p.0 as *const u32, N) };
        assert!(
            host.iter().all(|&v| v == 12),
            "{}: the kernel's writes are seen by the host",
            mr.name()
        );
        // SAFETY: `p` came from `mr.allocate(N * 4, stream)` and is freed once; its uses are done.
        #[allow(unsafe_code)]
        unsafe { mr.deallocate(p, N * 4, stream.as_ref()) }.unwrap();
    }
}

#[test]
fn binning_passes_sizes_above_its_bins_straight_to_the_upstream_and_routes_frees_by_size() {
    use mempool_rmm::suballoc::BinningOptions;
    use mempool_rmm::BinningResource;
    let dev = device();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let s = stream.as_ref();
    let options = BinningOptions {
        min_size_exponent: 8,
        max_size_exponent: 12,
        blocks_per_chunk: 4,
        ..BinningOptions::default()
    };
    let mr = BinningResource::new(
        StatisticsAdaptor::new(AsyncResource::default_pool(&dev).unwrap()),
        &dev,
        options,
    )
    .unwrap();
    let up = || mr.upstream().counters();
    assert!(!mr.passes_through(4096) && mr.passes_through(4097));
    // Above the largest bin (4 KiB): the upstream gets the request unchanged, the engine keeps no record.
    let large = mr.allocate(10_000, s).unwrap();
    assert_eq!((up().allocations.current, up().bytes.current), (1, 10_000));
    assert_eq!((mr.stats().live_allocations, mr.stats().reserved_bytes), (0, 0));
    // In a bin: a chunk of four 512-byte blocks from the upstream, one block live in the engine.
    let small = mr.allocate(300, s).unwrap();
    assert_eq!((up().allocations.current, up().bytes.current), (2, 10_000 + 4 * 512));
    assert_eq!((mr.stats().live_allocations, mr.stats().used_bytes), (1, 512));
    // The largest bin's size is a bin; one byte more goes upstream.
    let top = mr.allocate(4096, s).unwrap();
    assert_eq!(up().allocations.current, 3);
    let above = mr.allocate(4097, s).unwrap();
    assert_eq!((up().allocations.current, mr.stats().live_allocations), (4, 2));
    // Frees in another order than the allocations, one from another thread: each goes where its size says.
    // SAFETY: `above` came from `mr.allocate(4097, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(above, 4097, s) }.unwrap();
    assert_eq!((up().allocations.current, mr.stats().live_allocations), (3, 2));
    // SAFETY: `small` came from `mr.allocate(300, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(small, 300, s) }.unwrap();
    assert_eq!(
        (up().allocations.current, mr.stats().live_allocations),
        (3, 1),
        "the chunk stays"
    );
    std::thread::scope(|t| {
        t.spawn(|| {
            // SAFETY: `large` came from `mr.allocate(10_000, s)`, is freed once, and no work uses it.
            unsafe { mr.deallocate(large, 10_000, s) }.unwrap();
        });
    });
    assert_eq!((up().allocations.current, up().bytes.current), (2, 4 * 512 + 4 * 4096));
    // SAFETY: `top` came from `mr.allocate(4096, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(top, 4096, s) }.unwrap();
    assert_eq!(mr.stats().live_allocations, 0);
    assert_eq!(
        up().allocations.total,
        4,
        "one upstream allocation per large request and per chunk"
    );
    mr.release_unused().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(up().allocations.current, 0);
}
