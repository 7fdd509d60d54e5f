//! GPU tests of issue 26's observation layer on real resources: snapshots of pool, arena and service
//! stacks checked against the resources' own statistics, out-of-memory reports from every resource, and
//! the retry policy. `cargo test -p mempool-rmm --features gpu --test observe`.
#![cfg(feature = "gpu")]
#![allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{Device, DeviceAddr, Stream, StreamRef};
use mempool_rmm::adaptors::{OomRetryAdaptor, StatisticsAdaptor};
use mempool_rmm::observe::{snapshot, HistoryResource, Snapshot};
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::{
    ArenaResource, AsyncOptions, AsyncResource, BinningResource, CudaResource, Error, FixedSizeResource,
    MemoryResource, OutOfMemoryReport, PoolResource, ServiceOptions, ServiceResource,
};

const MIB: usize = 1 << 20;

/// The tests measure the device's memory: one at a time.
static GPU: Mutex<()> = Mutex::new(());

fn gpu() -> (MutexGuard<'static, ()>, Device) {
    let lock = GPU.lock().unwrap_or_else(PoisonError::into_inner);
    (lock, Device::get(0).expect("GPU tests need a CUDA device"))
}

/// A driver pool of its own capped at `max` bytes.
fn capped(dev: &Device, max: usize) -> AsyncResource {
    AsyncResource::new(
        dev,
        AsyncOptions {
            max_size: Some(max),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The report an out-of-memory error carries; fails the test on any other error.
fn report(e: &Error) -> &OutOfMemoryReport {
    assert!(e.is_out_of_memory(), "{e:?}");
    e.report().unwrap_or_else(|| panic!("no report: {e:?}"))
}

/// Checks what every snapshot of a suballocator promises: its chunks are its reserved bytes, their ranges
/// cover them in order, the used ranges are its live bytes and count, and the free ranges of each stream
/// add up to its free bytes. Returns the resource's index.
fn check_suballocator(snap: &Snapshot, name: &str, reserved: u64, used: u64, live: usize, free: u64) -> usize {
    let i = snap.resources.iter().position(|r| r.name == name).unwrap_or_else(|| {
        panic!(
            "{name} not in {:?}",
            snap.resources.iter().map(|r| &r.name).collect::<Vec<_>>()
        )
    });
    let r = &snap.resources[i];
    assert_eq!(r.stats.held_bytes, Some(reserved), "{name}");
    assert_eq!(r.stats.live_bytes, Some(used), "{name}");
    assert_eq!(r.stats.live_count, Some(live as u64), "{name}");
    assert_eq!(
        r.chunks.iter().map(|c| c.size).sum::<u64>(),
        reserved,
        "{name}: chunk bytes"
    );
    let mut used_ranges = (0u64, 0usize);
    for c in &r.chunks {
        let mut at = 0;
        for g in &c.ranges {
            assert_eq!(g.offset, at, "{name}: chunk {:#x} covered in order", c.address);
            at += g.size;
            if g.used {
                used_ranges.0 += g.size;
                used_ranges.1 += 1;
            } else {
                assert!(g.stream.is_some(), "{name}: a free range names its stream");
            }
        }
        assert_eq!(at, c.size, "{name}: chunk {:#x}", c.address);
    }
    assert_eq!(used_ranges, (used, live), "{name}: used ranges");
    assert_eq!(
        r.per_stream.iter().map(|s| s.free_bytes).sum::<u64>(),
        free,
        "{name}: free per stream"
    );
    i
}

#[test]
fn a_pool_stack_snapshot_matches_the_pools_stats() {
    let (_g, dev) = gpu();
    let ctx = dev.context().unwrap();
    let (a, b) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let pool = PoolResource::new(AsyncResource::default_pool(&dev).unwrap(), &dev, PoolOptions::default()).unwrap();
    let mr = HistoryResource::new(StatisticsAdaptor::new(pool));
    let sizes = [1000usize, 3 * MIB, 256, 70_000, 5 * MIB, 12_345];
    let mut live: Vec<(DeviceAddr, usize, StreamRef<'_>)> = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let s = if i % 2 == 0 { a.as_ref() } else { b.as_ref() };
        live.push((mr.allocate(n, s).unwrap(), n, s));
    }
    let (p, n, s) = live.remove(1);
    // SAFETY: `p` came from `mr.allocate(n, _)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(p, n, s) }.unwrap();
    let snap = snapshot(&mr, "rust");
    let names: Vec<&str> = snap.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["HistoryResource", "StatisticsAdaptor", "PoolResource", "AsyncResource"]
    );
    let st = mr.upstream().upstream().stats();
    check_suballocator(
        &snap,
        "PoolResource",
        st.reserved_bytes,
        st.used_bytes,
        st.live_allocations,
        st.free_bytes,
    );
    assert_eq!(
        snap.resources[1].stats.live_bytes,
        Some(live.iter().map(|l| l.1 as u64).sum::<u64>()),
        "the statistics adaptor counts bytes as asked"
    );
    // The history saw every operation; what it saw live is what the test holds.
    assert_eq!(snap.history.len(), sizes.len() + 1);
    assert_eq!(
        (snap.history.recorded, snap.history.dropped),
        (sizes.len() as u64 + 1, 0)
    );
    let mut seen: Vec<(u64, u64)> = snap
        .live
        .iter()
        .filter(|l| l.resource == 0)
        .map(|l| (l.address, l.size))
        .collect();
    let mut want: Vec<(u64, u64)> = live.iter().map(|l| (l.0 .0, l.1 as u64)).collect();
    seen.sort_unstable();
    want.sort_unstable();
    assert_eq!(seen, want);
    // Both streams appear, by handle.
    for s in [&a, &b] {
        let h = format!("{:#x}", s.as_ref().handle());
        assert!(snap.streams.iter().any(|x| x.handle == h), "{h} in {:?}", snap.streams);
    }
    // The AsyncResource reports its pool's counters: the pool's chunks are its live bytes.
    let up = &snap.resources[3];
    assert!(
        up.stats.live_bytes.is_some_and(|l| l >= st.reserved_bytes),
        "{:?}",
        up.stats
    );
    for (p, n, s) in live {
        // SAFETY: `p` came from `mr.allocate(n, _)`, is freed once, and no work uses it.
        unsafe { mr.deallocate(p, n, s) }.unwrap();
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}

#[test]
fn an_arena_snapshot_shows_each_streams_superblocks() {
    let (_g, dev) = gpu();
    let ctx = dev.context().unwrap();
    let (a, b) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let arena = ArenaResource::new(
        AsyncResource::default_pool(&dev).unwrap(),
        &dev,
        ArenaOptions::default(),
    )
    .unwrap();
    let mr = HistoryResource::new(arena);
    let mut live = Vec::new();
    for i in 0..40usize {
        let s = if i % 2 == 0 { a.as_ref() } else { b.as_ref() };
        let n = 1000 + i * 3000;
        live.push((mr.allocate(n, s).unwrap(), n, s));
    }
    live.push((mr.allocate(8 * MIB, a.as_ref()).unwrap(), 8 * MIB, a.as_ref()));
    let snap = snapshot(&mr, "rust");
    let st = mr.upstream().stats();
    let i = check_suballocator(
        &snap,
        "ArenaResource",
        st.reserved_bytes,
        st.used_bytes,
        st.live_allocations,
        st.free_bytes,
    );
    // Small blocks live in per-stream superblocks: each stream has free memory of its own there.
    for s in [&a, &b] {
        let h = format!("{:#x}", s.as_ref().handle());
        let idx = snap
            .streams
            .iter()
            .position(|x| x.handle == h)
            .expect("the stream is listed") as u32;
        assert!(
            snap.resources[i]
                .per_stream
                .iter()
                .any(|p| p.stream == idx && p.free_bytes > 0),
            "{h}: {:?}",
            snap.resources[i].per_stream
        );
    }
    for (p, n, s) in live {
        // SAFETY: `p` came from `mr.allocate(n, _)`, is freed once, and no work uses it.
        unsafe { mr.deallocate(p, n, s) }.unwrap();
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}

#[test]
fn a_service_snapshot_reports_what_it_maps() {
    let (_g, dev) = gpu();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let svc = ServiceResource::new(
        &dev,
        ServiceOptions {
            region_size: Some(256 * MIB),
            max_tags: 2,
            chunk_size: Some(2 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let mr = HistoryResource::new(svc.clone());
    let p = mr.allocate(5 * MIB, stream.as_ref()).unwrap();
    let q = mr.allocate(100_000, stream.as_ref()).unwrap();
    let snap = snapshot(&mr, "rust");
    let st = svc.stats();
    let r = &snap.resources[1];
    assert_eq!(r.name, "ServiceResource");
    assert_eq!(r.stats.held_bytes, Some(st.mapped_bytes));
    assert_eq!(r.stats.live_bytes, Some(st.used_bytes));
    assert_eq!(r.stats.live_count, Some(2));
    // Its chunks are the mapped runs, each with the region's used and free ranges in it.
    assert!(!r.chunks.is_empty());
    check_suballocator(
        &snap,
        "ServiceResource",
        st.mapped_bytes,
        st.used_bytes,
        2,
        st.mapped_bytes - st.used_bytes,
    );
    assert_eq!(
        snap.live.len(),
        2,
        "the history's allocations are the used ranges: {:?}",
        snap.live
    );
    // SAFETY: `p` and `q` came from `mr.allocate` with these sizes, are freed once, and no work uses them.
    unsafe {
        mr.deallocate(p, 5 * MIB, stream.as_ref()).unwrap();
        mr.deallocate(q, 100_000, stream.as_ref()).unwrap();
    }
    stream.synchronize().unwrap();
}

#[test]
fn the_registry_default_records_its_history() {
    let (_g, dev) = gpu();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let mr = mempool_rmm::registry::current_device_resource(&dev).unwrap();
    assert_eq!(mr.name(), "HistoryResource");
    let p = mr.allocate(4242, stream.as_ref()).unwrap();
    let snap = mempool_rmm::observe::snapshot_current(&dev).unwrap();
    assert_eq!(snap.devices.len(), 1);
    assert_eq!(snap.devices[0].ordinal, dev.ordinal() as u32);
    assert_eq!(snap.devices[0].total_bytes, dev.total_memory().unwrap() as u64);
    assert!(snap.resources.iter().all(|r| r.device == Some(dev.ordinal() as u32)));
    let names: Vec<&str> = snap.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["HistoryResource", "AsyncResource"]);
    let i = (0..snap.history.len())
        .rev()
        .find(|&i| snap.history.address[i] == p.0)
        .expect("the allocation is in the history");
    assert_eq!((snap.history.op[i], snap.history.size[i]), (0, 4242));
    assert!(snap.live.iter().any(|l| l.address == p.0 && l.size == 4242));
    // SAFETY: `p` came from `mr.allocate(4242, _)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(p, 4242, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn out_of_memory_reports_name_size_stack_held_and_largest_free_block() {
    let (_g, dev) = gpu();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let s = stream.as_ref();

    // A driver pool capped at 64 MiB.
    let a = capped(&dev, 64 * MIB);
    let e = a.allocate(128 * MIB, s).unwrap_err();
    let r = report(&e);
    println!("async: {e}");
    assert_eq!((r.requested, r.stack.as_slice()), (128 * MIB, &["AsyncResource"][..]));
    assert_eq!(r.holder, Some("AsyncResource"));
    assert!(r.held.is_some() && r.device_free.is_some(), "{r:?}");
    assert!(e.to_string().contains("could not allocate 134217728 bytes"), "{e}");

    // A pool at its maximum: 64 MiB held, 40 MiB live, one free block of 24 MiB.
    let pool = PoolResource::new(
        AsyncResource::default_pool(&dev).unwrap(),
        &dev,
        PoolOptions {
            initial_size: 64 * MIB as u64,
            maximum_size: Some(64 * MIB as u64),
            ..Default::default()
        },
    )
    .unwrap();
    let mr = StatisticsAdaptor::new(pool);
    let big = mr.allocate(40 * MIB, s).unwrap();
    let e = mr.allocate(32 * MIB, s).unwrap_err();
    println!("pool: {e}");
    let r = report(&e);
    assert_eq!(r.requested, 32 * MIB);
    assert_eq!(r.stack, ["StatisticsAdaptor", "PoolResource", "AsyncResource"]);
    assert_eq!(r.failed_at, "PoolResource");
    assert_eq!(r.holder, Some("PoolResource"));
    assert_eq!((r.held, r.live), (Some(64 * MIB as u64), Some(40 * MIB as u64)));
    assert_eq!(
        (r.free, r.largest_free, r.free_blocks),
        (Some(24 * MIB as u64), Some(24 * MIB as u64), Some(1))
    );
    assert!(!r.fragmented());
    let msg = e.to_string();
    assert!(
        msg.contains(
            "out of memory: StatisticsAdaptor > PoolResource > AsyncResource could not allocate 33554432 bytes"
        ),
        "{msg}"
    );
    assert!(
        msg.contains("PoolResource holds 67108864 bytes, 41943040 bytes live"),
        "{msg}"
    );
    assert!(msg.contains("its largest free block is 25165824 bytes"), "{msg}");
    // SAFETY: `big` came from `mr.allocate(40 MiB, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(big, 40 * MIB, s) }.unwrap();

    // Fragmented: eight 8 MiB blocks, every other one freed: 32 MiB free, no 16 MiB block.
    let blocks: Vec<DeviceAddr> = (0..8).map(|_| mr.allocate(8 * MIB, s).unwrap()).collect();
    for &p in blocks.iter().step_by(2) {
        // SAFETY: `p` came from `mr.allocate(8 MiB, s)`, is freed once, and no work uses it.
        unsafe { mr.deallocate(p, 8 * MIB, s) }.unwrap();
    }
    let e = mr.allocate(16 * MIB, s).unwrap_err();
    println!("fragmented pool: {e}");
    let r = report(&e);
    assert_eq!(
        (r.free, r.largest_free, r.free_blocks),
        (Some(32 * MIB as u64), Some(8 * MIB as u64), Some(4))
    );
    assert!(r.fragmented(), "{r:?}");
    assert_eq!(r.fragmentation_percent(), Some(75));
    assert!(
        e.to_string().contains("no free block is large enough (fragmentation)"),
        "{e}"
    );
    for &p in blocks.iter().skip(1).step_by(2) {
        // SAFETY: `p` came from `mr.allocate(8 MiB, s)`, is freed once, and no work uses it.
        unsafe { mr.deallocate(p, 8 * MIB, s) }.unwrap();
    }

    // An arena at its maximum.
    let arena = ArenaResource::new(
        AsyncResource::default_pool(&dev).unwrap(),
        &dev,
        ArenaOptions {
            initial_size: 64 * MIB as u64,
            maximum_size: Some(64 * MIB as u64),
            ..Default::default()
        },
    )
    .unwrap();
    let big = arena.allocate(48 * MIB, s).unwrap();
    let e = arena.allocate(32 * MIB, s).unwrap_err();
    println!("arena: {e}");
    let r = report(&e);
    assert_eq!((r.requested, r.holder), (32 * MIB, Some("ArenaResource")));
    assert_eq!(r.stack, ["ArenaResource", "AsyncResource"]);
    assert_eq!(r.held, Some(64 * MIB as u64));
    assert!(r.largest_free.is_some_and(|l| l < 32 * MIB as u64), "{r:?}");
    // SAFETY: `big` came from `arena.allocate(48 MiB, s)`, is freed once, and no work uses it.
    unsafe { arena.deallocate(big, 48 * MIB, s) }.unwrap();

    // Binning: a request above the bins goes to the capped upstream, which runs out.
    let binning = BinningResource::new(capped(&dev, 64 * MIB), &dev, BinningOptions::default()).unwrap();
    let e = binning.allocate(128 * MIB, s).unwrap_err();
    println!("binning: {e}");
    let r = report(&e);
    assert_eq!(r.stack, ["BinningResource", "AsyncResource"]);
    assert_eq!(
        (r.requested, r.failed_at, r.holder),
        (128 * MIB, "AsyncResource", Some("BinningResource"))
    );
    assert!(r.device_free.is_some());

    // Fixed-size: 1 MiB blocks, 8 per chunk, over a driver pool capped at 16 MiB: a later chunk does not fit
    // (the driver rounds the cap up to its own granularity: on an H200 more than 16 blocks fit).
    let fixed = FixedSizeResource::new(
        capped(&dev, 16 * MIB),
        &dev,
        FixedSizeOptions {
            block_size: MIB as u64,
            blocks_per_chunk: 8,
            ..Default::default()
        },
    )
    .unwrap();
    let mut held = Vec::new();
    let e = loop {
        match fixed.allocate(MIB, s) {
            Ok(p) => held.push(p),
            Err(e) => break e,
        }
        assert!(
            held.len() <= 256,
            "a pool capped at 16 MiB holds far fewer than 256 blocks"
        );
    };
    println!("fixed: {e}");
    let r = report(&e);
    assert_eq!(
        (r.requested, r.holder, r.failed_at),
        (MIB, Some("FixedSizeResource"), "AsyncResource")
    );
    assert_eq!(r.held, Some(held.len() as u64 * MIB as u64));
    assert_eq!(r.largest_free, Some(0), "every block is live");
    for p in held {
        // SAFETY: `p` came from `fixed.allocate(1 MiB, s)`, is freed once, and no work uses it.
        unsafe { fixed.deallocate(p, MIB, s) }.unwrap();
    }

    // Service: a request larger than its region.
    let svc = ServiceResource::new(
        &dev,
        ServiceOptions {
            region_size: Some(64 * MIB),
            max_tags: 1,
            chunk_size: Some(2 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let rec = HistoryResource::new(svc.clone());
    let e = rec.allocate(128 * MIB, s).unwrap_err();
    println!("service: {e}");
    let r = report(&e);
    assert_eq!(r.stack, ["HistoryResource", "ServiceResource"]);
    assert_eq!(
        (r.requested, r.holder, r.tag.as_deref()),
        (128 * MIB, Some("ServiceResource"), Some("default"))
    );
    assert!(
        r.held.is_some() && r.largest_free.is_some() && r.device_free.is_some(),
        "{r:?}"
    );
    assert_eq!(
        rec.history().events().events.last().map(|e| (e.op, e.size)),
        Some((mempool_rmm::observe::Op::Failed, 128 * MIB as u64))
    );

    // cuMemAlloc: more than the device has.
    let cuda = CudaResource::new(&dev).unwrap();
    let too_much = dev.total_memory().unwrap() * 2;
    let e = cuda.allocate(too_much, s).unwrap_err();
    println!("cuda: {e}");
    let r = report(&e);
    assert_eq!((r.requested, r.stack.as_slice()), (too_much, &["CudaResource"][..]));
    assert!(
        e.to_string().contains(&format!("could not allocate {too_much} bytes")),
        "{e}"
    );
    stream.synchronize().unwrap();
}

#[test]
fn retry_on_out_of_memory_trims_the_stack_and_succeeds() {
    let (_g, dev) = gpu();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let s = stream.as_ref();
    // A pool over a 64 MiB driver pool: 48 MiB freed stays in the pool's chunk, so 60 MiB does not fit
    // until the pool returns that chunk.
    let make = || Arc::new(PoolResource::new(capped(&dev, 64 * MIB), &dev, PoolOptions::default()).unwrap());
    let plain = make();
    let p = plain.allocate(48 * MIB, s).unwrap();
    // SAFETY: `p` came from `plain.allocate(48 MiB, s)`, is freed once, and no work uses it.
    unsafe { plain.deallocate(p, 48 * MIB, s) }.unwrap();
    let e = plain.allocate(60 * MIB, s).unwrap_err();
    assert!(e.is_out_of_memory(), "without the policy it fails: {e}");

    let pool = make();
    let mr = OomRetryAdaptor::new(pool.clone());
    let p = mr.allocate(48 * MIB, s).unwrap();
    // SAFETY: `p` came from `mr.allocate(48 MiB, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(p, 48 * MIB, s) }.unwrap();
    let q = mr.allocate(60 * MIB, s).expect("trim, synchronize, retry once");
    assert_eq!(pool.stats().used_bytes, 60 * MIB as u64);
    // SAFETY: `q` came from `mr.allocate(60 MiB, s)`, is freed once, and no work uses it.
    unsafe { mr.deallocate(q, 60 * MIB, s) }.unwrap();
    stream.synchronize().unwrap();
}
