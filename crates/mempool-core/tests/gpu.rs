//! GPU tests of mempool-core: they need a GPU and fail without one (never skip).
//! Run: `cargo test -p mempool-core --features gpu`.
#![cfg(feature = "gpu")]

use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::Command;
use std::sync::Arc;

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{
    memory, Access, BufferView, Context, Device, DeviceAddr, Error, Event, EventFlags, HandleTypes, IpcEventHandle,
    MemPool, PeerRefusal, PoolKind, PoolProps, PtrExportData, ReusePolicy, Stream, StreamRef,
};

const MIB: usize = 1 << 20;

/// Held by tests that assert on memory a pool keeps reserved, and by tests that make an allocation
/// fail: when an allocation runs out, the driver first releases the unused reserves of the device's
/// pools (seen on H100, driver 580), which would break the others' premise if they ran side by side.
static RESERVES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn reserves() -> std::sync::MutexGuard<'static, ()> {
    RESERVES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Held by tests that make a pool current or assert which pool is current: the device's current pool is
/// process-wide, and the test harness runs tests side by side.
static CURRENT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn current_lock() -> std::sync::MutexGuard<'static, ()> {
    CURRENT.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu() -> (Device, Arc<Context>) {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().expect("primary context");
    (dev, ctx)
}

fn read_u32s(ctx: &Context, ptr: mempool_core::DeviceAddr, n: usize, stream: StreamRef<'_>) -> Vec<u32> {
    let mut host = vec![0u8; n * 4];
    // SAFETY: callers pass live device memory of at least n u32s, ordered on `stream`.
    unsafe { memory::copy_to_host(ctx, &mut host, ptr, stream) }.unwrap();
    u32s(&host)
}

#[test]
fn device_properties_are_reported() {
    let (dev, _) = gpu();
    assert!(Device::count().unwrap() >= 1);
    assert!(!dev.name().unwrap().is_empty());
    assert_ne!(dev.uuid().unwrap().0, [0u8; 16]);
    assert!(dev.total_memory().unwrap() > (1 << 30));
    let (major, _) = dev.compute_capability().unwrap();
    assert!(major >= 6, "compute capability {major}");
    assert!(dev.supports_memory_pools().unwrap());
    assert!(dev
        .supported_pool_handle_types()
        .unwrap()
        .contains(HandleTypes::POSIX_FILE_DESCRIPTOR));
    assert!(dev.can_access_peer(dev).unwrap());
    let version = mempool_core::driver_version().unwrap();
    assert!(version.major() >= 11, "{version}");
    let count = Device::count().unwrap();
    assert_eq!(
        Device::get(count).unwrap_err(),
        Error::NoSuchDevice { ordinal: count, count }
    );
}

#[test]
fn pools_are_created_and_destroyed() {
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    for props in [
        PoolProps::new(),
        PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR),
        PoolProps::new().max_size(256 * MIB),
    ] {
        let pool = MemPool::new(&dev, &props).unwrap();
        assert_eq!(pool.kind(), PoolKind::Owned);
        assert_eq!(pool.handle_types(), props.handle_types);
        let buf = pool.alloc(MIB, stream.as_ref()).unwrap();
        buf.fill(1).unwrap();
        drop(buf);
        stream.synchronize().unwrap();
    }
    // A pool dropped while an allocation is outstanding is released once the allocation is freed.
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let p = pool.allocate(MIB, stream.as_ref()).unwrap();
    let other = MemPool::new(&dev, &PoolProps::new()).unwrap();
    // SAFETY: `p` came from `pool`'s allocation on this context and nothing uses it.
    unsafe { other.free_async(p, stream.as_ref()) }.unwrap();
    drop(pool);
    stream.synchronize().unwrap();
}

#[test]
fn a_host_pool_is_created_or_refused_clearly() {
    let (dev, _) = gpu();
    match MemPool::new(&dev, &PoolProps::new().location(mempool_core::PoolLocation::Host)) {
        Ok(pool) => assert_eq!(pool.location(), mempool_core::PoolLocation::Host),
        // Drivers before 13.0 lack host pools: the error must name the cause.
        Err(e) => assert!(
            matches!(
                e,
                Error::Driver {
                    call: "cuMemPoolCreate",
                    ..
                }
            ),
            "{e}"
        ),
    }
}

/// Pools of managed memory (CUDA 13.0): created and allocated from where the driver and the device allow
/// it, refused up front with the missing capability named where they do not. Either way the test asserts
/// something: it never skips.
#[test]
fn managed_pools_serve_kernels_and_the_host_or_are_refused_by_capability() {
    use mempool_core::AllocationType;
    let (dev, ctx) = gpu();
    let props = PoolProps::new().allocation_type(AllocationType::Managed);
    let driver = mempool_core::driver_version().unwrap();
    let concurrent = dev.concurrent_managed_access().unwrap();
    println!("FINDING: driver {driver}, concurrent managed access {concurrent}");
    if driver.major() < 13 || !concurrent {
        assert!(!dev.supports_managed_pools().unwrap());
        for e in [
            MemPool::new(&dev, &props).unwrap_err(),
            dev.default_managed_pool().unwrap_err(),
        ] {
            let Error::CapabilityMissing { device: 0, missing, .. } = &e else {
                panic!("expected CapabilityMissing, got {e:?}")
            };
            assert!(
                missing.contains(if driver.major() < 13 {
                    "CUDA 13.0"
                } else {
                    "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS"
                }),
                "{e}"
            );
        }
        return;
    }
    assert!(dev.supports_managed_pools().unwrap());
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let owned = MemPool::new(&dev, &props).unwrap();
    assert_eq!(owned.allocation_type(), AllocationType::Managed);
    let default = dev.default_managed_pool().unwrap();
    assert_eq!(default.kind(), PoolKind::Borrowed);
    assert_eq!(default.allocation_type(), AllocationType::Managed);
    assert_ne!(
        default.as_raw(),
        dev.default_pool().unwrap().as_raw(),
        "a pool of its own"
    );
    for pool in [&owned, &default] {
        const N: usize = 1 << 20;
        let p = pool.allocate(N * 4, stream.as_ref()).unwrap();
        assert_eq!(memory::pool_of(p).unwrap(), pool.as_raw());
        let info = memory::pointer_info(p).unwrap();
        println!("FINDING: managed pool pointer attributes: {info:?}");
        assert!(info.is_managed, "{info:?}");
        // SAFETY: `p` holds N u32s, allocated on `stream`.
        unsafe { kernels.iota(p, N, 5, stream.as_ref()) }.unwrap();
        assert_eq!(read_u32s(&ctx, p, 8, stream.as_ref()), (5..13).collect::<Vec<u32>>());
        stream.synchronize().unwrap();
        // Managed memory: the host reads the same address once the kernel is done.
        // SAFETY: `p` is managed memory of N u32s; the kernel that wrote it completed (synchronized) and
        // nothing else writes it; the index is in bounds.
        let last = unsafe { std::ptr::read_volatile((p.0 as *const u32).add(N - 1)) };
        assert_eq!(last, 5 + (N - 1) as u32);
        // SAFETY: `p` came from `pool.allocate` on this context and is freed once; its uses are done.
        unsafe { pool.free_async(p, stream.as_ref()) }.unwrap();
    }
    stream.synchronize().unwrap();
    // What a managed pool cannot do is refused before the driver sees it.
    assert!(matches!(owned.make_current(), Err(Error::PoolKind { .. })));
    assert!(matches!(
        MemPool::new(&dev, &props.handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        MemPool::new(&dev, &props.max_size(256 * MIB)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn release_threshold_is_honoured_at_synchronize() {
    let _reserves = reserves();
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 0);

    // Threshold 0: everything goes back at the synchronize after the free.
    drop(pool.alloc(64 * MIB, stream.as_ref()).unwrap());
    stream.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().reserved_current, 0);

    // Threshold 32 MiB: the pool keeps at most that much (rounded to its granularity).
    pool.set_release_threshold(32 * MIB as u64).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 32 * MIB as u64);
    let bufs: Vec<_> = (0..4).map(|_| pool.alloc(32 * MIB, stream.as_ref()).unwrap()).collect();
    assert!(pool.usage().unwrap().reserved_current >= 128 * MIB as u64);
    drop(bufs);
    stream.synchronize().unwrap();
    let reserved = pool.usage().unwrap().reserved_current;
    assert!(
        reserved <= 32 * MIB as u64 + 2 * MIB as u64,
        "reserved {reserved} after sync"
    );

    // Keep everything: nothing goes back.
    pool.keep_everything().unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    let bufs: Vec<_> = (0..4).map(|_| pool.alloc(32 * MIB, stream.as_ref()).unwrap()).collect();
    drop(bufs);
    stream.synchronize().unwrap();
    assert!(pool.usage().unwrap().reserved_current >= 128 * MIB as u64);
}

#[test]
fn trim_to_releases_unused_memory_only() {
    let _reserves = reserves();
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    pool.keep_everything().unwrap();
    let keep = pool.alloc(32 * MIB, stream.as_ref()).unwrap();
    let bufs: Vec<_> = (0..3).map(|_| pool.alloc(32 * MIB, stream.as_ref()).unwrap()).collect();
    drop(bufs);
    stream.synchronize().unwrap();
    assert!(pool.usage().unwrap().reserved_current >= 128 * MIB as u64);
    pool.trim_to(0).unwrap();
    let u = pool.usage().unwrap();
    assert!(u.reserved_current >= 32 * MIB as u64, "live memory must stay: {u:?}");
    assert!(u.reserved_current < 128 * MIB as u64, "unused memory must go: {u:?}");
    drop(keep);
    stream.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.usage().unwrap().reserved_current, 0);
}

#[test]
fn usage_counters_match_allocations() {
    let _reserves = reserves();
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let a = pool.alloc(2 * MIB, stream.as_ref()).unwrap();
    let b = pool.alloc(4 * MIB, stream.as_ref()).unwrap();
    let u = pool.usage().unwrap();
    assert_eq!(u.used_current, 6 * MIB as u64, "{u:?}");
    assert!(u.reserved_current >= u.used_current);
    drop(b);
    stream.synchronize().unwrap();
    let u = pool.usage().unwrap();
    assert_eq!(u.used_current, 2 * MIB as u64);
    assert_eq!(u.used_high, 6 * MIB as u64);
    pool.reset_peaks().unwrap();
    let u = pool.usage().unwrap();
    assert_eq!(u.used_high, 2 * MIB as u64, "{u:?}");
    assert_eq!(u.reserved_high, u.reserved_current);
    drop(a);
    stream.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().used_current, 0);
}

#[test]
fn reuse_policy_round_trips() {
    let (dev, _) = gpu();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    assert_eq!(pool.reuse_policy().unwrap(), ReusePolicy::all());
    pool.set_reuse_policy(ReusePolicy::FOLLOW_EVENT_DEPENDENCIES).unwrap();
    assert_eq!(pool.reuse_policy().unwrap(), ReusePolicy::FOLLOW_EVENT_DEPENDENCIES);
    pool.set_reuse_policy(ReusePolicy::empty()).unwrap();
    assert_eq!(pool.reuse_policy().unwrap(), ReusePolicy::empty());
}

#[test]
fn memory_is_reused_on_the_same_stream_and_handed_off_through_an_event() {
    let _reserves = reserves();
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let (s1, s2) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    pool.keep_everything().unwrap();
    // Only reuse that follows an event dependency: no opportunistic or driver-inserted reuse.
    pool.set_reuse_policy(ReusePolicy::FOLLOW_EVENT_DEPENDENCIES).unwrap();
    let n = MIB / 4;

    // Same stream: freed memory is reused at once, in stream order.
    let a = pool.alloc(MIB, s1.as_ref()).unwrap();
    let addr = a.ptr();
    // SAFETY: `a` holds n u32s on s1.
    unsafe { kernels.iota(a.ptr(), n, 100, s1.as_ref()) }.unwrap();
    drop(a);
    let b = pool.alloc(MIB, s1.as_ref()).unwrap();
    assert_eq!(b.ptr(), addr, "same-stream reuse");
    // SAFETY: as above.
    unsafe { kernels.iota(b.ptr(), n, 200, s1.as_ref()) }.unwrap();

    // Across streams: free on s1, make s2 wait for s1 through an event, and s2 may take the block.
    drop(b);
    let freed = Event::new(&ctx, EventFlags::DISABLE_TIMING).unwrap();
    freed.record(s1.as_ref()).unwrap();
    s2.wait(&freed).unwrap();
    let c = pool.alloc(MIB, s2.as_ref()).unwrap();
    assert_eq!(c.ptr(), addr, "reuse across streams following the event");
    // The memory still holds s1's last write, seen on s2 in order.
    assert_eq!(read_u32s(&ctx, c.ptr(), n, s2.as_ref())[..4], [200, 201, 202, 203]);
    // SAFETY: `c` holds n u32s on s2.
    unsafe { kernels.iota(c.ptr(), n, 300, s2.as_ref()) }.unwrap();
    let got = read_u32s(&ctx, c.ptr(), n, s2.as_ref());
    assert!(got.iter().enumerate().all(|(i, &v)| v == 300 + i as u32));

    // A buffer freed on another stream after its work.
    let d = pool.alloc(MIB, s1.as_ref()).unwrap();
    d.fill(9).unwrap();
    d.free_on(s2.as_ref()).unwrap();
    drop(c);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().used_current, 0);
}

#[test]
fn default_and_current_pool() {
    let _c = current_lock();
    let (dev, ctx) = gpu();
    let default = dev.default_pool().unwrap();
    assert_eq!(default.kind(), PoolKind::Borrowed);
    assert_eq!(dev.current_pool().unwrap().as_raw(), default.as_raw());
    // The default pool allocates like any other.
    let stream = Stream::new(&ctx).unwrap();
    let buf = default.alloc(MIB, stream.as_ref()).unwrap();
    buf.fill(3).unwrap();
    drop(buf);
    // It cannot be exported.
    assert!(matches!(default.export_fd(), Err(Error::PoolKind { .. })));

    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    {
        let _guard = pool.make_current().unwrap();
        assert_eq!(dev.current_pool().unwrap().as_raw(), pool.as_raw());
    }
    assert_eq!(
        dev.current_pool().unwrap().as_raw(),
        default.as_raw(),
        "the guard restores the previous pool"
    );
    stream.synchronize().unwrap();
}

#[test]
fn current_pool_guards_end_in_any_order() {
    let _c = current_lock();
    let (dev, ctx) = gpu();
    let before = dev.current_pool().unwrap().as_raw();
    assert_eq!(before, dev.default_pool().unwrap().as_raw());
    let a = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let b = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let b_raw = b.as_raw();
    let ga = a.make_current().unwrap();
    let gb = b.make_current().unwrap();
    assert_eq!(dev.current_pool().unwrap().as_raw(), b_raw);
    // The older activation ends first: the newer one's pool stays current.
    drop(ga);
    assert_eq!(
        dev.current_pool().unwrap().as_raw(),
        b_raw,
        "ending an older activation leaves the newest one's pool current"
    );
    // `a` is no longer current anywhere, so it may go; the current pool still allocates, from `b`.
    drop(a);
    let stream = Stream::new(&ctx).unwrap();
    let current = dev.current_pool().unwrap();
    assert_eq!(current.kind(), PoolKind::Owned, "a share of `b`, not a borrowed view");
    let buf = current.alloc(MIB, stream.as_ref()).unwrap();
    buf.fill(1).unwrap();
    assert!(b.usage().unwrap().used_current >= MIB as u64);
    drop(buf);
    stream.synchronize().unwrap();
    drop(current);
    drop(gb);
    assert_eq!(
        dev.current_pool().unwrap().as_raw(),
        before,
        "the last activation to end restores the pool from before the first"
    );

    // Three nested activations (one pool twice), ended middle first, then newest, then oldest.
    let c = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let g1 = b.make_current().unwrap();
    let g2 = c.make_current().unwrap();
    let g3 = b.make_current().unwrap();
    drop(g2);
    assert_eq!(dev.current_pool().unwrap().as_raw(), b_raw);
    drop(g3);
    assert_eq!(
        dev.current_pool().unwrap().as_raw(),
        b_raw,
        "the oldest activation is `b` too"
    );
    drop(g1);
    assert_eq!(dev.current_pool().unwrap().as_raw(), before);
    drop((b, c));
    assert_eq!(dev.current_pool().unwrap().as_raw(), before);
    assert!(mempool_core::take_drop_errors().is_empty());
}

#[test]
fn current_pool_activations_of_two_threads_end_in_any_order() {
    use std::sync::mpsc::channel;
    let _c = current_lock();
    let (dev, ctx) = gpu();
    let before = dev.current_pool().unwrap().as_raw();
    let a = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let b = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let b_raw = b.as_raw();
    let (a_active, wait_a_active) = channel();
    let (b_active, wait_b_active) = channel();
    let (a_ended, wait_a_ended) = channel();
    // Thread 1 makes `a` current, thread 2 then makes `b` current, thread 1 ends its activation first.
    let (pa, pb, d) = (&a, &b, &dev);
    let shared = std::thread::scope(|s| {
        s.spawn(move || {
            let guard = pa.make_current().unwrap();
            a_active.send(()).unwrap();
            wait_b_active.recv().unwrap();
            drop(guard);
            a_ended.send(()).unwrap();
        });
        let second = s.spawn(move || {
            wait_a_active.recv().unwrap();
            let guard = pb.make_current().unwrap();
            b_active.send(()).unwrap();
            wait_a_ended.recv().unwrap();
            let current = d.current_pool().unwrap();
            assert_eq!(
                current.as_raw(),
                pb.as_raw(),
                "another thread's older activation ended: this thread's pool stays current"
            );
            drop(guard);
            current
        });
        second.join().unwrap()
    });
    assert_eq!(dev.current_pool().unwrap().as_raw(), before);
    // The value thread 2 took from `Device::current_pool` shares `b`: dropping `b` does not destroy it.
    drop((a, b));
    assert_eq!(shared.as_raw(), b_raw);
    let stream = Stream::new(&ctx).unwrap();
    let buf = shared.alloc(MIB, stream.as_ref()).unwrap();
    buf.fill(5).unwrap();
    let mut host = vec![0u8; 16];
    buf.copy_to_host(0, &mut host).unwrap();
    assert_eq!(host, [5u8; 16]);
    assert!(shared.usage().unwrap().used_current >= MIB as u64);
    drop(buf);
    stream.synchronize().unwrap();
    drop(shared);
    assert!(mempool_core::take_drop_errors().is_empty());
}

#[test]
fn zero_bytes_and_out_of_memory() {
    let _reserves = reserves();
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let empty = pool.alloc(0, stream.as_ref()).unwrap();
    assert!(empty.ptr().is_null() && empty.is_empty());
    drop(empty);

    let huge = 1usize << 52;
    let err = pool.allocate(huge, stream.as_ref()).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfMemory {
            call: "cuMemAllocFromPoolAsync",
            requested: huge
        }
    );
    assert!(err.to_string().contains(&huge.to_string()));

    // A pool with a maximum size refuses past it.
    let small = MemPool::new(&dev, &PoolProps::new().max_size(64 * MIB)).unwrap();
    let a = small.alloc(32 * MIB, stream.as_ref()).unwrap();
    let err = small.allocate(64 * MIB, stream.as_ref()).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    drop(a);
    stream.synchronize().unwrap();

    let plain = memory::device_alloc(&ctx, huge).unwrap_err();
    assert_eq!(
        plain,
        Error::OutOfMemory {
            call: "cuMemAlloc",
            requested: huge
        }
    );
}

#[test]
fn owner_access_is_read_write_and_cannot_change() {
    let (dev, _) = gpu();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    assert_eq!(pool.access(&dev).unwrap(), Access::ReadWrite);
    let err = pool.revoke_access(&dev).unwrap_err();
    assert_eq!(
        err,
        Error::PeerAccess {
            owner: 0,
            peer: 0,
            reason: PeerRefusal::OwningDevice
        }
    );
    assert!(err.to_string().contains("owns the pool"), "{err}");
}

#[test]
fn buffers_round_trip_through_kernels_and_pointer_attributes() {
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let n = 1000;
    let buf = pool.alloc(n * 4, stream.as_ref()).unwrap();
    let input: Vec<u8> = (0..n as u32).flat_map(|v| (v * 3).to_ne_bytes()).collect();
    buf.copy_from_host(0, &input).unwrap();
    // SAFETY: `buf` holds n u32s on `stream`.
    unsafe { kernels.add(buf.ptr(), n, 11, stream.as_ref()) }.unwrap();
    let mut out = vec![0u8; n * 4];
    buf.copy_to_host(0, &mut out).unwrap();
    assert!(u32s(&out).iter().enumerate().all(|(i, &v)| v == 3 * i as u32 + 11));

    let info = memory::pointer_info(buf.ptr()).unwrap();
    assert_eq!(info.memory_type, memory::MemoryType::Device);
    assert_eq!(info.device_ordinal, 0);
    assert!(!info.is_managed);
    assert!(info.range_start <= buf.ptr() && info.range_size >= n * 4);

    let too_long = vec![0u8; n * 4 + 1];
    assert!(matches!(
        buf.copy_from_host(0, &too_long),
        Err(Error::InvalidArgument(_))
    ));
    drop(buf);
    stream.synchronize().unwrap();
    assert!(mempool_core::take_drop_errors().is_empty());
}

#[test]
fn buffer_views_copy_fill_and_release_once() {
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();

    // A PoolBuffer is its view: address, length, stream (with its context) and context.
    let buf = pool.alloc(4096, (&stream).into()).unwrap();
    assert_eq!((buf.len(), buf.is_empty()), (4096, false));
    assert_eq!(buf.stream(), stream.as_ref());
    assert!(Arc::ptr_eq(buf.stream().context().unwrap(), &ctx));
    assert!(Arc::ptr_eq(buf.context(), &ctx));

    // Fill (ordered on the stream), then copies at offsets, which wait.
    buf.fill(0xab).unwrap();
    buf.copy_from_host(100, &[1, 2, 3, 4]).unwrap();
    let all = buf.to_host().unwrap();
    assert_eq!(all.len(), 4096);
    assert_eq!(
        all[96..108],
        [0xab, 0xab, 0xab, 0xab, 1, 2, 3, 4, 0xab, 0xab, 0xab, 0xab]
    );
    let mut tail = [0u8; 6];
    buf.copy_to_host(98, &mut tail).unwrap();
    assert_eq!(tail, [0xab, 0xab, 1, 2, 3, 4]);
    assert!(matches!(
        buf.copy_to_host(4095, &mut tail),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(buf.check_range(4096, 1), Err(Error::InvalidArgument(_))));
    assert_eq!(buf.check_range(4090, 6), Ok(()));
    drop(buf);

    // A view over memory owned by hand, on the legacy stream given the context: the release helper
    // hands the address out once, and a second call frees nothing.
    let legacy = StreamRef::LEGACY.in_context(&ctx);
    let addr = pool.allocate(1024, legacy).unwrap();
    // SAFETY: `addr` is a fresh 1024-byte allocation of the pool, in `ctx`, made on the legacy stream of
    // `ctx`; only the view's release below frees it.
    let mut view = unsafe { BufferView::new(addr, 1024, legacy, ctx.clone()) };
    view.fill(7).unwrap();
    assert!(view.to_host().unwrap().iter().all(|&b| b == 7));
    let mut freed = Vec::new();
    let mut free = |p: DeviceAddr, n: usize, s: StreamRef<'_>| -> mempool_core::Result<()> {
        freed.push((p, n));
        // SAFETY: handed out once by `release_with`; all work on it was queued on `s`, the view's stream.
        unsafe { pool.free_async(p, s) }
    };
    view.release_with(&mut free).unwrap();
    view.release_with(&mut free).unwrap();
    assert_eq!(freed, [(addr, 1024)]);
    assert!(view.ptr().is_null() && view.is_empty());

    // `into_raw` takes the address out of the view; the buffer's drop then frees nothing.
    let buf = pool.alloc(512, stream.as_ref()).unwrap();
    let (p, n) = buf.into_raw();
    assert_eq!(n, 512);
    // SAFETY: `p` came from the pool on `stream` and is freed once, here.
    unsafe { pool.free_async(p, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    ctx.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().used_current, 0);
    assert!(mempool_core::take_drop_errors().is_empty());
}

// ---- Two processes: pool and pointer export and import ----

const ROLE: &str = "MEMPOOL_TEST_IPC_ROLE";
const N: usize = 1 << 18;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const L: usize>(s: &str) -> [u8; L] {
    let mut out = [0u8; L];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

/// The importer's side, run in a child process that re-executes this test binary.
fn importer(fd: i32, ptr_data: PtrExportData, event: IpcEventHandle) {
    let (dev, ctx) = gpu();
    // SAFETY: the parent cleared close-on-exec on this descriptor and passed its number; it is open here.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let pool = MemPool::import_fd(&dev, fd).expect("import the pool");
    assert_eq!(pool.kind(), PoolKind::Imported);
    let stream = Stream::new(&ctx).unwrap();
    // An imported pool can only import pointers.
    assert!(matches!(
        pool.allocate(MIB, stream.as_ref()),
        Err(Error::PoolKind { .. })
    ));
    assert!(matches!(pool.make_current(), Err(Error::PoolKind { .. })));
    assert!(matches!(pool.export_fd(), Err(Error::PoolKind { .. })));

    let ready = Event::open_ipc(&ctx, &event).expect("open the IPC event");
    stream.wait(&ready).unwrap(); // first use after the exporter's writes
    let imported = pool.import_pointer(&ptr_data).expect("import the pointer");
    let got = read_u32s(&ctx, imported.ptr(), N, stream.as_ref());
    assert!(
        got.iter().enumerate().all(|(i, &v)| v == 1000 + i as u32),
        "importer sees the exporter's data"
    );
    let kernels = CheckKernels::load(&ctx).unwrap();
    // SAFETY: the imported range holds N u32s; ordered on `stream` after the IPC event.
    unsafe { kernels.add(imported.ptr(), N, 5, stream.as_ref()) }.unwrap();
    imported.free(stream.as_ref()).unwrap(); // frees before the exporter frees
}

#[test]
fn pool_and_pointer_shared_across_processes() {
    if let Ok(role) = std::env::var(ROLE) {
        let parts: Vec<&str> = role.split(':').collect();
        importer(
            parts[0].parse().unwrap(),
            PtrExportData(unhex(parts[1])),
            IpcEventHandle(unhex(parts[2])),
        );
        return;
    }
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)).unwrap();
    let buf = pool.alloc(N * 4, stream.as_ref()).unwrap();
    // SAFETY: `buf` holds N u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), N, 1000, stream.as_ref()) }.unwrap();
    let ready = Event::new(&ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS).unwrap();
    ready.record(stream.as_ref()).unwrap();

    let fd = pool.export_fd().unwrap();
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty()).unwrap(); // inherited by the child
    let data = pool.export_pointer(buf.ptr()).unwrap();
    let handle = ready.ipc_handle().unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "pool_and_pointer_shared_across_processes",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, format!("{}:{}:{}", fd.as_raw_fd(), hex(&data.0), hex(&handle.0)))
        .status()
        .unwrap();
    assert!(status.success(), "the importer process failed: {status}");

    // The importer's kernel ran on the shared memory.
    let got = read_u32s(&ctx, buf.ptr(), N, stream.as_ref());
    assert!(
        got.iter().enumerate().all(|(i, &v)| v == 1005 + i as u32),
        "exporter sees the importer's writes"
    );
    drop(buf);
    stream.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().used_current, 0);
}
