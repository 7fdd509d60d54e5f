//! `multi-stream`: several streams, each on its own thread, each iteration allocating a small buffer,
//! filling it (a hash per element), grinding on it (`rounds` dependent mixes per element, real ALU
//! work), summing it into an accumulator and freeing it, with no synchronize between iterations. The
//! stream count is swept; reported: iterations per second per resource. A resource whose allocation or
//! free serializes streams (cuMemAlloc's free synchronizes the device) stops scaling here.
//!
//! Every stream's sum is checked against the host's computation of the same kernels.

#![allow(unsafe_code)]

use std::sync::{Barrier, Mutex};
use std::time::Instant;

use mempool_core::{memory, Stream};
use mempool_rmm::MemoryResource;

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::kernels::{elementwise, hash2, launch, load, strided, work, Arg, WorkKernels};
use crate::progress::Progress;
use crate::report::{median, Cell, Column, Report};
use crate::spec::{build, ResourceSpec};
use crate::track::Tracked;
use crate::workloads::Common;

/// Seeds cycle through this many values, so the host computes few expected sums.
const SEEDS: u32 = 4;

/// Parameters of the `multi-stream` subcommand.
#[derive(Clone, Debug)]
pub struct MultiStreamParams {
    /// Stream counts to sweep.
    pub streams: Vec<usize>,
    /// Iterations per stream.
    pub iterations: usize,
    /// 32-bit elements per buffer.
    pub elements: usize,
    /// Mixes per element per iteration.
    pub rounds: u32,
    /// Timed runs per point (median), after one warm-up run.
    pub repeats: usize,
}

/// The sum `bench_sum_u32` computes over a buffer filled with `seed` and worked `rounds` times.
pub(crate) fn expected_sum(seed: u32, elements: usize, rounds: u32) -> u64 {
    (0..elements as u64)
        .map(|i| u64::from(work(hash2(seed, i), rounds)))
        .sum()
}

/// Runs `iterations` per stream on `streams` streams of the kernels' context; returns the wall time
/// (seconds). Checks every stream's sum against `sums` (the expected sum per seed).
pub(crate) fn run(
    kernels: &WorkKernels<'_>,
    mr: &dyn MemoryResource,
    streams: usize,
    params: &MultiStreamParams,
    sums: &[u64],
) -> Result<f64> {
    // The streams are made in the kernels' context, so every launch below is on a stream of it.
    let ctx = kernels.context();
    let owned: Vec<Stream> = (0..streams).map(|_| Stream::new(ctx)).collect::<Result<_, _>>()?;
    let barrier = Barrier::new(streams);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let spans: Mutex<Vec<(Instant, Instant)>> = Mutex::new(Vec::new());
    let n = params.elements;
    let bytes = n * 4;
    std::thread::scope(|scope| {
        for (si, stream) in owned.iter().enumerate() {
            let (barrier, first_error, spans, ctx) = (&barrier, &first_error, &spans, &ctx);
            scope.spawn(move || {
                let s = stream.as_ref();
                let body = || -> Result<u64> {
                    let acc = mr.allocate(8, s)?;
                    // SAFETY: 8 bytes just allocated on `s`.
                    unsafe { memory::fill_async(ctx, acc, 0, 8, s) }?;
                    barrier.wait();
                    let start = Instant::now();
                    for it in 0..params.iterations {
                        let buf = mr.allocate(bytes, s)?;
                        let seed = (it as u32 + si as u32) % SEEDS;
                        // SAFETY: for each launch, 1: the arguments match work.cu's signatures
                        // (`bench_fill_hash_u32(out, n, seed)`, `bench_work_u32(buf, n, rounds)`,
                        // `bench_sum_u32(buf, n, out)`); 2: the kernels touch `buf[0..n)` (`n` u32s) and the
                        // one u64 of `acc`, both allocated on `s`, which orders the kernels before the free
                        // below; 3: `s` is a stream of `ctx`, the kernels' context.
                        unsafe {
                            launch(
                                &kernels.fill_hash,
                                elementwise(n),
                                s,
                                &[Arg::from(buf), Arg::U64(n as u64), Arg::U32(seed)],
                            )?;
                            launch(
                                &kernels.work,
                                elementwise(n),
                                s,
                                &[Arg::from(buf), Arg::U64(n as u64), Arg::U32(params.rounds)],
                            )?;
                            launch(
                                &kernels.sum,
                                strided(n),
                                s,
                                &[Arg::from(buf), Arg::U64(n as u64), Arg::from(acc)],
                            )?;
                        }
                        // SAFETY: `buf` came from `mr.allocate(bytes, s)` in this iteration and is freed once;
                        // the kernels that used it were launched on `s`, before this free.
                        unsafe { mr.deallocate(buf, bytes, s) }?;
                    }
                    s.synchronize()?;
                    spans
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((start, Instant::now()));
                    let mut host = [0u8; 8];
                    // SAFETY: `acc` holds 8 bytes, complete after the synchronize.
                    unsafe { memory::copy_to_host(ctx, &mut host, acc, s) }?;
                    // SAFETY: `acc` came from `mr.allocate(8, s)` above and is freed once; its last use, the
                    // copy, completed before this call.
                    unsafe { mr.deallocate(acc, 8, s) }?;
                    Ok(u64::from_ne_bytes(host))
                };
                let r = body().and_then(|got| {
                    let want = (0..params.iterations)
                        .map(|it| sums[((it as u32 + si as u32) % SEEDS) as usize])
                        .fold(0u64, u64::wrapping_add);
                    if got == want {
                        Ok(())
                    } else {
                        Err(Error::Check(format!(
                            "stream {si}: the kernels summed {got}, the host {want}"
                        )))
                    }
                });
                if let Err(e) = r {
                    first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let spans = spans.into_inner().unwrap_or_else(|p| p.into_inner());
    let start = spans.iter().map(|s| s.0).min().expect("one span per stream");
    let end = spans.iter().map(|s| s.1).max().expect("one span per stream");
    Ok((end - start).as_secs_f64())
}

/// Sweeps the stream counts over every resource of `common`.
pub fn bench(common: &Common, params: &MultiStreamParams) -> Result<Report> {
    let device = common
        .device
        .ok_or_else(|| Error::Usage("the multi-stream workload needs a GPU".into()))?;
    if common.specs.iter().any(ResourceSpec::is_host_only) {
        return Err(Error::Usage("`sim` cannot run the multi-stream workload".into()));
    }
    let ctx = device.context()?;
    let module = load(&ctx, "work.ptx")?;
    let kernels = WorkKernels::new(&module)?;
    let sums: Vec<u64> = (0..SEEDS)
        .map(|s| expected_sum(s, params.elements, params.rounds))
        .collect();
    let env = crate::env::Environment::detect(Some(&device));
    let mut report = Report::new(
        "multi-stream",
        "streams each allocating a buffer, running kernels on it and freeing it, no synchronize in between",
        env,
    );
    report.param(
        "streams",
        params
            .streams
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
    report.param("iterations_per_stream", params.iterations);
    report.param("elements", params.elements);
    report.param("buffer_bytes", params.elements * 4);
    report.param("rounds", params.rounds);
    report.param("kernels_per_iteration", 3);
    report.param("repeats", params.repeats);
    report.columns = vec![
        Column::new("resource", 0),
        Column::new("streams", 0),
        Column::new("seconds", 4),
        Column::new("iterations/s", 0),
        Column::new("vs cuMemAlloc", 2),
        Column::new("peak live bytes", 0),
    ];
    let mut progress = Progress::new((common.specs.len() * params.streams.len()) as u64, common.quiet);
    // results[spec][stream point] = (seconds, peak)
    let mut results: Vec<Vec<(f64, u64)>> = Vec::new();
    let mut labels = Vec::new();
    for spec in &common.specs {
        let built = build(spec, Some(&device))?;
        let tracked = Tracked::new(built.resource.clone());
        let mut row = Vec::new();
        for &streams in &params.streams {
            progress.set_label(format!("{spec}, {streams} streams"));
            run(&kernels, &tracked, streams, params, &sums)?;
            tracked.reset();
            let mut secs = Vec::new();
            for _ in 0..params.repeats.max(1) {
                secs.push(run(&kernels, &tracked, streams, params, &sums)?);
            }
            row.push((median(&secs).unwrap_or(f64::NAN), tracked.stats().peak));
            progress.inc();
        }
        results.push(row);
        labels.push(built.label);
    }
    progress.finish();
    let base = labels
        .iter()
        .position(|l| *l == ResourceSpec::RawCuda.to_string())
        .map(|i| results[i].clone());
    let mut series = Vec::new();
    for (label, row) in labels.iter().zip(&results) {
        let mut values = Vec::new();
        for (pi, (&streams, &(secs, peak))) in params.streams.iter().zip(row).enumerate() {
            let rate = (streams * params.iterations) as f64 / secs;
            values.push(Some(rate));
            report.row(vec![
                Cell::from(label.as_str()),
                Cell::from(streams),
                Cell::from(secs),
                Cell::from(rate),
                Cell::from(base.as_ref().map(|b| b[pi].0 / secs)),
                Cell::from(peak),
            ]);
        }
        series.push(Series {
            name: label.clone(),
            values,
        });
    }
    report.notes.push(
        "iterations/s: all streams' iterations over the wall time from the first stream's start to the last one's \
         end (median of the timed runs after a warm-up run); every stream's sum was checked against the host."
            .into(),
    );
    report.chart = Some(Chart {
        title: "Multi-stream: iterations per second (higher is better)".into(),
        kind: ChartKind::Lines,
        x_label: "streams (one thread each)".into(),
        y_label: "iterations per second".into(),
        categories: params.streams.iter().map(|s| s.to_string()).collect(),
        series,
        log_y: false,
    });
    Ok(report)
}
