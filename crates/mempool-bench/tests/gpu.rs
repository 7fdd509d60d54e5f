//! GPU tests: every workload at a small size, its kernels' results checked against the host, and the
//! columnar operators one by one. They need a GPU and fail without one (`--features gpu`).
//! `two_gpu_*` needs two peer-capable GPUs.

#![cfg(feature = "gpu")]

use std::collections::BTreeMap;

use mempool_bench::kernels::{hash2, load, QueryKernels};
use mempool_bench::report::Cell;
use mempool_bench::spec::{build, parse, parse_list, ResourceSpec};
use mempool_bench::workloads::columns::Exec;
use mempool_bench::workloads::query::{self, reference, Query, QueryParams, Scale};
use mempool_bench::workloads::{
    fragmentation, grow, multi_stream, peer, random, replay, sleep, with_baselines, Common,
};
use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{Device, Stream, StreamRef};
use mempool_rmm::{AsyncOptions, AsyncResource};

fn device() -> Device {
    Device::get(0).expect("the GPU tests need a GPU and a driver")
}

fn common(specs: &str) -> Common {
    Common {
        specs: with_baselines(parse_list(specs).unwrap(), true),
        device: Some(device()),
        quiet: true,
    }
}

#[test]
fn every_spec_builds_and_serves_device_memory() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let k = CheckKernels::load(&ctx).unwrap();
    for text in [
        "cuda",
        "managed",
        "cuMemAlloc",
        "cuMemAllocFromPoolAsync",
        "async",
        "async(threshold=0)",
        "async(threshold=max,initial=64MiB)",
        "async(pool=default)",
        "async(max_size=1GiB)",
        "pool(async,initial=64MiB,max=1GiB)",
        "pool(cuda)",
        "binning(pool(async))",
        "binning(async,min=512B,max=64KiB,blocks=16)",
        "arena(cuda)",
        "arena(async,superblock=4MiB)",
        "fixed(async,block=1MiB)",
        "expandable",
        "expandable(chunk=2MiB,reserve=4GiB)",
        "service",
        "service(chunk=4MiB,region=8GiB,tags=2,watermark=10)",
        "service(watermark=oom)",
        "service(watermark=growth)",
        "vmm",
        "vmm(peers=none)",
        "pool(vmm)",
    ] {
        let built = build(&parse(text).unwrap(), Some(&dev)).unwrap_or_else(|e| panic!("{text}: {e}"));
        let mr = built.resource.as_ref();
        let n = 1 << 18;
        let p = mr
            .allocate(n * 4, stream.as_ref())
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        // SAFETY: `p` holds n u32s on `stream` until the deallocate below, ordered after the copy.
        unsafe { k.iota(p, n, 11, stream.as_ref()) }.unwrap();
        let mut host = vec![0u8; n * 4];
        // SAFETY: as above.
        unsafe { mempool_core::memory::copy_to_host(&ctx, &mut host, p, stream.as_ref()) }.unwrap();
        assert!(
            u32s(&host).iter().enumerate().all(|(i, &v)| v == 11 + i as u32),
            "{text}"
        );
        // SAFETY: `p` came from `mr.allocate(n * 4, stream)` and is freed once; the kernel and the copy that
        // used it were queued on `stream` and the copy has completed.
        unsafe { mr.deallocate(p, n * 4, stream.as_ref()) }.unwrap();
        stream.synchronize().unwrap();
    }
}

/// The specs of resources that need a capability: built and used where the device has it (managed pools:
/// a CUDA 13.0 driver and concurrent managed access; system memory: pageable memory access), refused with
/// `Unsupported` where it does not. Their memory is host-accessible, so the host reads the kernel's
/// writes through the address.
#[test]
fn capability_specs_build_where_capable_and_are_refused_elsewhere() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let k = CheckKernels::load(&ctx).unwrap();
    let managed = dev.supports_managed_pools().unwrap();
    let pageable = dev.pageable_memory_access().unwrap();
    println!("FINDING: managed pools {managed}, pageable memory access {pageable}");
    for (text, capable) in [
        ("async_managed", managed),
        ("async_managed(threshold=0,initial=64MiB)", managed),
        ("async_managed(pool=default)", managed),
        ("system", pageable),
        ("sam_headroom(headroom=1GiB)", pageable),
        ("binning(system)", pageable),
    ] {
        let built = match build(&parse(text).unwrap(), Some(&dev)) {
            Ok(built) => {
                assert!(capable, "{text} built without the capability");
                built
            }
            Err(e) => {
                assert!(!capable, "{text}: {e}");
                assert!(
                    matches!(e, mempool_bench::Error::Rmm(mempool_rmm::Error::Unsupported { .. })),
                    "{text}: {e:?}"
                );
                continue;
            }
        };
        let mr = built.resource.as_ref();
        let n = 1 << 18;
        let p = mr
            .allocate(n * 4, stream.as_ref())
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        // SAFETY: `p` holds n u32s on `stream` until the deallocate below.
        unsafe { k.iota(p, n, 11, stream.as_ref()) }.unwrap();
        stream.synchronize().unwrap();
        // SAFETY: managed and system memory are host-accessible at `p`; the kernel completed and nothing else
        // writes the memory.
        let host = unsafe { std::slice::from_raw_parts(p.0 as *const u32, n) };
        assert!(host.iter().enumerate().all(|(i, &v)| v == 11 + i as u32), "{text}");
        // SAFETY: `p` came from `mr.allocate(n * 4, stream)` and is freed once; the kernel completed.
        unsafe { mr.deallocate(p, n * 4, stream.as_ref()) }.unwrap();
        stream.synchronize().unwrap();
    }
}

#[test]
fn columnar_operators_agree_with_the_host() {
    let dev = device();
    let ctx = dev.context().unwrap();
    let module = load(&ctx, "query.ptx").unwrap();
    let k = QueryKernels::new(&module).unwrap();
    let mr = AsyncResource::new(&dev, AsyncOptions::default()).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    // A stream that knows no context is refused: the kernels would be launched on it.
    let refused = Exec::new(&mr, StreamRef::LEGACY, &k)
        .err()
        .expect("a stream without a context is refused");
    assert!(
        matches!(&refused, mempool_bench::Error::Usage(m) if m.contains("knows no context")),
        "{refused}"
    );
    let x = Exec::new(&mr, stream.as_ref(), &k).unwrap();

    // Scan over three levels of tiles (2 Mi + 333 elements), and the selection it serves.
    let n = (2 << 20) + 333;
    let vals = x.gen(n, 9, 0, 4).unwrap();
    let host: Vec<u32> = vals.download().unwrap();
    assert!(host.iter().enumerate().all(|(i, &v)| v == hash2(9, i as u64) % 4));
    let scanned = x.scan(&vals).unwrap().download().unwrap();
    let mut acc = 0u32;
    for (i, &v) in host.iter().enumerate() {
        assert_eq!(scanned[i], acc, "exclusive scan at {i}");
        acc += v;
    }
    let flags = x.flags_range(&vals, 2, 4).unwrap();
    let sel = x.select(&flags).unwrap();
    let kept: Vec<u32> = host.iter().copied().filter(|v| (2..4).contains(v)).collect();
    assert_eq!(sel.count, kept.len());
    assert_eq!(x.compact(&vals, &sel).unwrap().download().unwrap(), kept);
    let idx = x.compact_index(&sel).unwrap().download().unwrap();
    assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx.iter().all(|&i| (2..4).contains(&host[i as usize])));
    drop(sel);
    drop((vals, flags));

    // Radix sort: full 32-bit keys, stable (equal keys keep their row order).
    let m = 300_001;
    let keys = x.gen(m, 4, 0, 50_000).unwrap();
    let rows = x.iota(m, 0).unwrap();
    let host_keys = keys.download().unwrap();
    let (sk, sv) = x.sort_pairs(keys, Some(rows), 1 << 32).unwrap();
    let (sk, sv) = (sk.download().unwrap(), sv.unwrap().download().unwrap());
    let mut want: Vec<(u32, u32)> = host_keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
    want.sort_by_key(|&(k, _)| k);
    assert_eq!(sk, want.iter().map(|w| w.0).collect::<Vec<_>>());
    assert_eq!(sv, want.iter().map(|w| w.1).collect::<Vec<_>>(), "stable");

    // Group-by: sums and counts per key.
    let g_keys = x.gen(100_000, 5, 0, 1000).unwrap();
    let g_vals = x.gen(100_000, 6, 0, 100).unwrap();
    let (hk, hv) = (g_keys.download().unwrap(), g_vals.download().unwrap());
    let g = x.groupby(&g_keys, &g_vals, 1000).unwrap();
    let (dk, ds, dc) = (
        g.keys.download().unwrap(),
        g.sums.download().unwrap(),
        g.counts.download().unwrap(),
    );
    let mut want: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
    for (k, v) in hk.iter().zip(&hv) {
        let e = want.entry(*k).or_default();
        e.0 += u64::from(*v);
        e.1 += 1;
    }
    let got: BTreeMap<u32, (u64, u32)> = dk
        .iter()
        .zip(ds.iter().zip(&dc))
        .map(|(k, (s, c))| (*k, (*s, *c)))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        x.sum_u64(&g.sums).unwrap(),
        hv.iter().map(|&v| u64::from(v)).sum::<u64>()
    );
    drop((g, g_keys, g_vals));

    // Hash join: build on 1000 unique keys (the even numbers), probe with keys below 2000.
    let base = x.iota(1000, 0).unwrap();
    let two = x.gen(1000, 0, 2, 1).unwrap(); // all 2s
    let build_keys = x.mul(&base, &two).unwrap();
    let table = x.hash_build(&build_keys).unwrap();
    let probe = x.gen(50_000, 8, 0, 2000).unwrap();
    let (rows, found) = x.probe(&table, &probe).unwrap();
    let (hp, hr, hf) = (
        probe.download().unwrap(),
        rows.download().unwrap(),
        found.download().unwrap(),
    );
    for i in 0..hp.len() {
        assert_eq!(hf[i], u32::from(hp[i] % 2 == 0), "probe {i}");
        if hf[i] == 1 {
            assert_eq!(hr[i] * 2, hp[i], "build row of probe {i}");
        }
    }
    drop((base, two, build_keys, table, probe, rows, found));
    assert!(x.take_drop_error().is_none());
    stream.synchronize().unwrap();
}

#[test]
fn every_query_is_checked_on_every_kind_of_resource() {
    let dev = device();
    let params = QueryParams {
        scale: 0.005,
        workers: 3,
        rounds: 1,
        queries: Query::ALL.to_vec(),
    };
    let scale = Scale::new(params.scale);
    let expected: Vec<_> = Query::ALL.iter().map(|&q| reference(q, &scale)).collect();
    for spec in [
        ResourceSpec::RawCuda,
        ResourceSpec::Cuda,
        parse("async").unwrap(),
        parse("pool(async)").unwrap(),
        parse("binning(async)").unwrap(),
        parse("arena(async)").unwrap(),
    ] {
        let built = build(&spec, Some(&dev)).unwrap();
        // run_suite compares every query's result with the host's.
        let (times, rounds, allocations) = query::run_suite(&dev, built.resource.as_ref(), &params, &expected, || {})
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert!(times.iter().all(|t| t.len() == params.workers), "{spec}");
        assert_eq!(rounds.len(), 1);
        assert!(
            allocations > 100 * params.workers as u64,
            "{spec}: only {allocations} allocations"
        );
    }
}

#[test]
fn the_query_report_has_speedups_and_targets() {
    let report = query::bench(
        &common("async,pool(async)"),
        &QueryParams {
            scale: 0.002,
            workers: 2,
            rounds: 1,
            queries: vec![Query::Q1, Query::Q4],
        },
    )
    .unwrap();
    // 4 resources x (2 queries + geomean + round).
    assert_eq!(report.rows.len(), 16);
    assert!(
        report.notes.iter().any(|n| n.starts_with("target `async`")),
        "{:?}",
        report.notes
    );
    assert!(report.to_svg().unwrap().contains("pool(async)"));
}

#[test]
fn multi_stream_sums_are_checked() {
    let params = multi_stream::MultiStreamParams {
        streams: vec![1, 3],
        iterations: 20,
        elements: 5000,
        rounds: 8,
        repeats: 1,
    };
    let report = multi_stream::bench(&common("async,pool(async),arena(async),cuda"), &params).unwrap();
    assert_eq!(report.rows.len(), 6 * 2);
}

#[test]
fn the_random_workload_runs_on_every_resource() {
    let params = random::RandomParams {
        points: vec![random::Point {
            n: 3000,
            max_size: 256 << 10,
            max_usage: 64 << 20,
        }],
        repeats: 1,
        seed: 42,
        log: None,
        interleave: false,
    };
    let report = random::bench(
        &common("cuda,async,pool(async),binning(async),arena(async),service,service(watermark=10)"),
        &params,
    )
    .unwrap();
    assert_eq!(report.rows.len(), 9);
}

#[test]
fn interleaved_runs_keep_a_repeated_spec_apart_and_report_each_rounds_ratio() {
    let params = random::RandomParams {
        points: vec![random::Point {
            n: 2000,
            max_size: 64 << 10,
            max_usage: 64 << 20,
        }],
        repeats: 3,
        seed: 42,
        log: None,
        interleave: true,
    };
    let specs = parse_list("cuMemAllocFromPoolAsync,async(threshold=max),cuMemAllocFromPoolAsync").unwrap();
    let c = Common {
        specs: with_baselines(specs, false),
        device: Some(device()),
        quiet: true,
    };
    let report = random::bench(&c, &params).unwrap();
    let text = report.render_text();
    println!("{text}");
    assert_eq!(report.rows.len(), 3, "one row per listed spec, the repeated one twice");
    let async_label = parse("async(threshold=max)").unwrap().to_string();
    for label in [
        "cuMemAllocFromPoolAsync #1",
        "cuMemAllocFromPoolAsync #2",
        async_label.as_str(),
    ] {
        assert!(text.contains(label), "{label} is missing:\n{text}");
    }
    let ratios: Vec<&String> = report.notes.iter().filter(|n| n.contains("per-round ratio")).collect();
    assert_eq!(
        ratios.len(),
        2,
        "a ratio note for each spec but the reference: {:?}",
        report.notes
    );
    assert!(ratios
        .iter()
        .all(|n| n.contains("to cuMemAllocFromPoolAsync #1") && n.contains("of 3 rounds")));
}

#[test]
fn the_fragmentation_and_grow_workloads_run_on_vmm_and_pools() {
    let p = fragmentation::FragmentationParams {
        small: 2 << 20,
        smalls: 64,
        large: 16 << 20,
        larges: 4,
        request: None,
    };
    let report = fragmentation::bench(
        &common("expandable,expandable(reclaim=growth),pool(async),service,service(watermark=growth)"),
        &p,
    )
    .unwrap();
    println!("{}", report.render_text());
    assert_eq!(report.rows.len(), 7, "five resources and the two baselines");
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("issue 23") && n.contains("`service`")),
        "the report says how `service` stands against issue 23's target: {:?}",
        report.notes
    );
    let g = grow::GrowParams {
        start: 1 << 20,
        end: 64 << 20,
        factor: 2.0,
        repeats: 1,
        chunk: None,
    };
    let report = grow::bench(&common("async"), &g).unwrap();
    println!("{}", report.render_text());
    assert_eq!(report.rows.len(), 4, "the growable buffer, async and the two baselines");
}

/// `sleep` at a small size that is not a whole number of chunks: every operation measured, the restore
/// checked (a wrong one fails the run), and a size larger than the device refused before anything runs.
#[test]
fn sleep_and_wake_are_measured_and_the_restore_checked() {
    let p = sleep::SleepParams {
        size: (256 << 20) + 4096 + 4,
        repeats: 2,
    };
    let report = sleep::bench(device(), &p, true).unwrap_or_else(|e| panic!("{e}"));
    println!("{}", report.render_text());
    assert_eq!(report.rows.len(), 6, "two copies, two sleeps, two wakes");
    for row in &report.rows {
        assert!(
            matches!(row[1], Cell::Float(ms) if ms > 0.0),
            "every operation has a time: {row:?}"
        );
    }
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.starts_with("target (issue 23): wake with restore")),
        "{:?}",
        report.notes
    );
    // Sleep gives the chunks back: the device's free memory grows by most of the allocation. The driver's
    // own bookkeeping moves `cuMemGetInfo` by several MiB between readings (docs/measurements.md,
    // "ServiceResource: `cuMemGetInfo`'s noise"), so this 256 MiB run checks 90% for
    // sleep and the sign for wake; issue 23's 99% criterion is checked at sizes where the noise is small
    // (mempool-rmm's tests/service.rs, the PyTorch test).
    for (row, sign) in [(2, 1), (4, 1)] {
        assert!(
            matches!(report.rows[row][6], Cell::Int(d) if d * sign >= (p.size as i64) / 100 * 90),
            "row {row}: {:?}",
            report.rows[row]
        );
    }
    for row in [3, 5] {
        assert!(
            matches!(report.rows[row][6], Cell::Int(d) if d < 0),
            "row {row}: {:?}",
            report.rows[row]
        );
    }
    let total = device().total_memory().unwrap();
    let too_big = sleep::SleepParams {
        size: 2 * total,
        repeats: 1,
    };
    let e = sleep::bench(device(), &too_big, true).unwrap_err().to_string();
    assert!(e.contains("does not fit device 0"), "{e}");
}

#[test]
fn the_sample_log_and_a_gpu_made_log_replay() {
    let dev = device();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let plan = replay::parse(
        "sample-random.csv",
        include_str!("../data/sample-random.csv").as_bytes(),
    )
    .unwrap();
    for text in ["async", "pool(async)", "binning(async)", "cuMemAlloc"] {
        let built = build(&parse(text).unwrap(), Some(&dev)).unwrap();
        let st = replay::run(&plan, built.resource.as_ref(), Some(&stream)).unwrap();
        assert_eq!((st.failures, st.peak_bytes), (0, plan.logged_peak), "{text}");
    }
    // A log written on the GPU (real addresses and stream) replays too.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpu.csv");
    let ops = random::generate(
        &random::Point {
            n: 2000,
            max_size: 64 << 10,
            max_usage: 16 << 20,
        },
        1,
    );
    let mr = build(&parse("async").unwrap(), Some(&dev)).unwrap();
    random::run_logged(&ops, mr.resource.as_ref(), Some(&stream), &path).unwrap();
    let plan = replay::load(&path).unwrap();
    assert!(plan.steps.len() >= ops.len());
    let st = replay::run(&plan, mr.resource.as_ref(), Some(&stream)).unwrap();
    assert_eq!(st.failures, 0);
}

#[test]
fn two_gpu_peer_reads_are_checked() {
    let count = Device::count().unwrap();
    assert!(
        count >= 2,
        "two_gpu_peer_reads_are_checked needs two GPUs; this machine has {count}"
    );
    let cases = peer::measure(&peer::PeerParams {
        bytes: 16 << 20,
        repeats: 2,
    })
    .unwrap();
    assert_eq!(cases.len(), 6);
    assert!(cases.iter().all(|c| c.gbps > 0.0), "{cases:?}");
}
