//! `random`: the standard random workload (docs/architecture.md, "Performance"; RMM's
//! `random_allocations` shape), the same logic and seeds as mempool-rmm's `random_workload` example, so
//! the numbers compare.
//!
//! Each run: `n` operations on one stream, each allocating with probability 0.73 (unless live bytes
//! would pass `max_usage`), otherwise freeing a random live allocation; sizes uniform in
//! `[1, max_size]`; everything left is freed at the end; one synchronize at the end. Reported:
//! nanoseconds per operation (the final frees are timed but not counted, as RMM's benchmark does),
//! the median of `repeats` runs after one warm-up run.

use std::time::Instant;

use mempool_core::{DeviceAddr, Stream};
use mempool_rmm::MemoryResource;

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::report::{median, Cell, Column, Report};
use crate::spec::{build, ResourceSpec};
use crate::units::Size;
use crate::workloads::Common;

/// Issue 23's target for the `service` resource: ns per operation at most this times `pool(async)`'s in
/// the same run.
pub const SERVICE_VS_POOL_TARGET: f64 = 1.2;

/// One point of the workload.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Point {
    /// Operations.
    pub n: usize,
    /// Largest allocation, bytes.
    pub max_size: usize,
    /// Most bytes live at once.
    pub max_usage: usize,
}

impl Point {
    /// `200k ops, <= 64KiB, 4GiB`; counts that are not whole thousands in full (`500 ops`, `2500 ops`).
    pub fn label(&self) -> String {
        let ops = if self.n >= 1000 && self.n.is_multiple_of(1000) {
            format!("{}k", self.n / 1000)
        } else {
            self.n.to_string()
        };
        format!(
            "{ops} ops, <= {}, {}",
            Size(self.max_size as u64),
            Size(self.max_usage as u64)
        )
    }
}

/// The three standard points: (200k ops, 64 KiB, 4 GiB), (100k, 1 MiB, 16 GiB), (20k, 64 MiB, 16 GiB).
pub const STANDARD_POINTS: [Point; 3] = [
    Point {
        n: 200_000,
        max_size: 64 << 10,
        max_usage: 4 << 30,
    },
    Point {
        n: 100_000,
        max_size: 1 << 20,
        max_usage: 16 << 30,
    },
    Point {
        n: 20_000,
        max_size: 64 << 20,
        max_usage: 16 << 30,
    },
];

pub use mempool_rmm::workload::RandomOp as Op;

/// The operation sequence of `p`, from `seed` (the example uses `42 + point index`): mempool-rmm's
/// [`random_workload`](mempool_rmm::workload::random_workload), the same sequence the `random_workload`
/// example and the criterion bench draw. Generated before timing, the same for every resource.
pub fn generate(p: &Point, seed: u64) -> Vec<Op> {
    mempool_rmm::workload::random_workload(p.n, p.max_size, p.max_usage, seed)
}

/// What one run measured.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RunStats {
    /// Nanoseconds per operation.
    pub(crate) ns_per_op: f64,
    /// The most allocations live at once.
    pub peak_allocations: usize,
    /// The most bytes live at once.
    pub peak_bytes: u64,
}

/// Runs `ops` on `mr` (on `stream`, or the legacy stream with no synchronize when `None`: the host
/// simulation).
#[allow(unsafe_code)] // frees the allocations it made, each once (see the SAFETY lines)
pub fn run(ops: &[Op], mr: &dyn MemoryResource, stream: Option<&Stream>) -> Result<RunStats> {
    let s = stream.map_or(mempool_core::StreamRef::LEGACY, Stream::as_ref);
    let mut live: Vec<(DeviceAddr, usize)> = Vec::with_capacity(ops.len());
    let (mut peak, mut bytes, mut peak_bytes) = (0usize, 0u64, 0u64);
    let t = Instant::now();
    let mut result = Ok(());
    for op in ops {
        match *op {
            Op::Alloc(size) => match mr.allocate(size, s) {
                Ok(p) => {
                    live.push((p, size));
                    peak = peak.max(live.len());
                    bytes += size as u64;
                    peak_bytes = peak_bytes.max(bytes);
                }
                Err(e) => {
                    result = Err(Error::from(e));
                    break;
                }
            },
            Op::Free(i) => {
                let (p, size) = live.swap_remove(i);
                bytes -= size as u64;
                // SAFETY: `(p, size)` came from `mr.allocate(size, s)` and was just removed from `live`, so it
                // is freed once; the workload never touches the memory.
                if let Err(e) = unsafe { mr.deallocate(p, size, s) } {
                    result = Err(Error::from(e));
                    break;
                }
            }
        }
    }
    // Free what is left even after a failure, so the resource is whole for the next run.
    for (p, size) in live.drain(..) {
        // SAFETY: as above: each entry of `live` is an allocation of `mr` on `s`, drained (freed) once.
        let r = unsafe { mr.deallocate(p, size, s) };
        if result.is_ok() {
            result = r.map_err(Error::from);
        }
    }
    if let Some(stream) = stream {
        stream.synchronize()?;
    }
    let ns = t.elapsed().as_nanos() as f64 / ops.len().max(1) as f64;
    result.map(|()| RunStats {
        ns_per_op: ns,
        peak_allocations: peak,
        peak_bytes,
    })
}

/// [`run`], with every allocation and free logged to `path` in RMM's CSV format.
pub fn run_logged(
    ops: &[Op],
    mr: &dyn MemoryResource,
    stream: Option<&Stream>,
    path: &std::path::Path,
) -> Result<RunStats> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::create(path).map_err(io)?;
    let logged = mempool_rmm::adaptors::LoggingAdaptor::new(mr, std::io::BufWriter::new(file))?;
    let stats = run(ops, &logged, stream)?;
    logged.into_writer()?;
    Ok(stats)
}

/// Parameters of the `random` subcommand.
#[derive(Clone, Debug)]
pub struct RandomParams {
    /// The points to run.
    pub points: Vec<Point>,
    /// Timed runs per resource and point (after one warm-up); `cuMemAlloc` and `cuda` get one.
    pub repeats: usize,
    /// Seed of point `i` is `seed + i`.
    pub seed: u64,
    /// Log the first resource's warm-up run of the first point here, through mempool-rmm's
    /// `LoggingAdaptor` (RMM's CSV format), for `replay`.
    pub log: Option<std::path::PathBuf>,
    /// Interleave the timed runs: every resource of a point is built first, then each round runs every
    /// resource once (in the listed order on even rounds, reversed on odd ones), so drift over the run
    /// (clocks, the host's other load) falls on all of them alike; the report adds each resource's
    /// per-round ratio to the raw pool baseline (or the first resource), lowest, median and highest.
    pub interleave: bool,
}

/// Labels of `specs` for the report, with a repeated spec numbered by its occurrence (`async #2`), so that
/// the rows and ratios of a spec listed twice stay apart.
pub fn unique_labels(specs: &[ResourceSpec]) -> Vec<String> {
    let plain: Vec<String> = specs.iter().map(ToString::to_string).collect();
    plain
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let total = plain.iter().filter(|o| *o == l).count();
            if total == 1 {
                l.clone()
            } else {
                let nth = plain[..=i].iter().filter(|o| *o == l).count();
                format!("{l} #{nth}")
            }
        })
        .collect()
}

/// Lowest, median and highest of `v` (not empty).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, median(v).unwrap_or(f64::NAN), hi)
}

/// The interleaved runs of one point (see [`RandomParams::interleave`]): each spec's [`RunStats`] (median
/// ns/op), and its per-round ns/op.
fn run_interleaved(
    ops: &[Op],
    specs: &[ResourceSpec],
    common: &Common,
    stream: Option<&Stream>,
    repeats: usize,
) -> Result<Vec<(RunStats, Vec<f64>)>> {
    let built = specs
        .iter()
        .map(|spec| build(spec, common.device.as_ref()))
        .collect::<Result<Vec<_>>>()?;
    let mut firsts = Vec::with_capacity(built.len());
    for b in &built {
        firsts.push(run(ops, b.resource.as_ref(), stream)?); // warm-up, in order
    }
    let mut per_round: Vec<Vec<f64>> = vec![Vec::with_capacity(repeats); built.len()];
    for round in 0..repeats {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..built.len()).collect()
        } else {
            (0..built.len()).rev().collect()
        };
        for i in order {
            per_round[i].push(run(ops, built[i].resource.as_ref(), stream)?.ns_per_op);
        }
    }
    Ok(firsts
        .into_iter()
        .zip(per_round)
        .map(|(mut st, ns)| {
            st.ns_per_op = median(&ns).unwrap_or(f64::NAN);
            (st, ns)
        })
        .collect())
}

/// Runs the workload over every resource of `common` and reports ns/op and the ratio to the raw pool
/// baseline (to the first resource when the baseline is not in the run).
pub fn bench(common: &Common, params: &RandomParams) -> Result<Report> {
    let env = crate::env::Environment::detect(common.device.as_ref());
    let mut report = Report::new(
        "random",
        "the standard random workload: allocate (p = 0.73) or free a random live allocation, one stream",
        env,
    );
    let points: Vec<String> = params
        .points
        .iter()
        .map(|p| {
            format!(
                "(n={}, max_size={}, max_usage={})",
                p.n,
                Size(p.max_size as u64),
                Size(p.max_usage as u64)
            )
        })
        .collect();
    report.param("points", points.join(" "));
    report.param("repeats", params.repeats);
    report.param("seed", params.seed);
    report.param("p_allocate", 0.73);
    report.param("streams", 1);
    // A ratio column for each baseline in the run (none in a host simulation).
    let baselines: Vec<ResourceSpec> = [ResourceSpec::RawPool, ResourceSpec::RawCuda]
        .into_iter()
        .filter(|b| common.specs.contains(b))
        .collect();
    report.columns = [
        Column::new("point", 0),
        Column::new("resource", 0),
        Column::new("ns/op", 1),
    ]
    .into_iter()
    .chain(baselines.iter().map(|b| Column::new(&format!("vs {b}"), 3)))
    .chain([
        Column::new("peak live allocations", 0),
        Column::new("peak live bytes", 0),
    ])
    .collect();
    let stream = match &common.device {
        Some(d) => Some(Stream::new(&d.context()?)?),
        None => None,
    };
    let total = (params.points.len() * common.specs.len()) as u64;
    let mut progress = Progress::new(total, common.quiet);
    let mut results: Vec<Vec<Option<f64>>> = vec![vec![None; params.points.len()]; common.specs.len()];
    let pool_async = crate::spec::parse("pool(async)")?;
    let mut service_vs_pool: Vec<String> = Vec::new();
    let labels = unique_labels(&common.specs);
    // The reference of the interleaved ratios: the raw pool baseline if in the run, else the first spec.
    let reference = common
        .specs
        .iter()
        .position(|s| *s == ResourceSpec::RawPool)
        .unwrap_or(0);
    let mut interleaved_notes: Vec<String> = Vec::new();
    for (pi, p) in params.points.iter().enumerate() {
        let ops = generate(p, params.seed + pi as u64);
        let mut rows: Vec<(String, RunStats)> = Vec::new();
        if params.interleave {
            progress.set_label(format!("{} resources interleaved on {}", common.specs.len(), p.label()));
            let measured = run_interleaved(&ops, &common.specs, common, stream.as_ref(), params.repeats.max(1))?;
            let base_rounds = measured[reference].1.clone();
            for (si, (st, rounds)) in measured.into_iter().enumerate() {
                results[si][pi] = Some(st.ns_per_op);
                if si != reference {
                    let ratios: Vec<f64> = rounds.iter().zip(&base_rounds).map(|(a, b)| a / b).collect();
                    let (lo, mid, hi) = spread(&ratios);
                    interleaved_notes.push(format!(
                        "{} at {}: per-round ratio to {} {lo:.3} / {mid:.3} / {hi:.3} (lowest / median / highest of \
                         {} rounds)",
                        labels[si],
                        p.label(),
                        labels[reference],
                        ratios.len()
                    ));
                }
                rows.push((labels[si].clone(), st));
                progress.inc();
            }
        }
        for (si, spec) in common.specs.iter().enumerate() {
            if params.interleave {
                break;
            }
            progress.set_label(format!("{} on {}", spec, p.label()));
            let built = build(spec, common.device.as_ref())?;
            let mr = built.resource.as_ref();
            match (&params.log, pi, si) {
                (Some(path), 0, 0) => run_logged(&ops, mr, stream.as_ref(), path)?,
                _ => run(&ops, mr, stream.as_ref())?,
            };
            let repeats = if matches!(spec, ResourceSpec::RawCuda | ResourceSpec::Cuda) {
                1
            } else {
                params.repeats.max(1)
            };
            let mut stats = Vec::new();
            for _ in 0..repeats {
                stats.push(run(&ops, mr, stream.as_ref())?);
            }
            let ns: Vec<f64> = stats.iter().map(|s| s.ns_per_op).collect();
            let mut st = stats[0];
            st.ns_per_op = median(&ns).unwrap_or(f64::NAN);
            results[si][pi] = Some(st.ns_per_op);
            rows.push((labels[si].clone(), st));
            drop(built);
            progress.inc();
        }
        // A baseline's row: its first occurrence in the run (rows are in spec order).
        let base = |spec: &ResourceSpec| {
            common
                .specs
                .iter()
                .position(|s| s == spec)
                .and_then(|i| rows.get(i))
                .map(|(_, s)| s.ns_per_op)
        };
        let bases: Vec<Option<f64>> = baselines.iter().map(base).collect();
        // Issue 23: each `service` spec against `pool(async)` in the same run.
        if let Some(pool) = base(&pool_async) {
            for (si, (label, st)) in rows.iter().enumerate() {
                if matches!(common.specs[si], ResourceSpec::Service { .. }) {
                    service_vs_pool.push(format!("{label} at {}: {:.3}", p.label(), st.ns_per_op / pool));
                }
            }
        }
        for (label, st) in &rows {
            let mut cells = vec![
                Cell::from(p.label()),
                Cell::from(label.as_str()),
                Cell::from(st.ns_per_op),
            ];
            cells.extend(bases.iter().map(|b| Cell::from(b.map(|b| st.ns_per_op / b))));
            cells.extend([Cell::from(st.peak_allocations), Cell::from(st.peak_bytes)]);
            report.row(cells);
        }
    }
    progress.finish();
    let single: Vec<String> = common
        .specs
        .iter()
        .filter(|s| matches!(s, ResourceSpec::RawCuda | ResourceSpec::Cuda))
        .map(ToString::to_string)
        .collect();
    report.notes.push(format!(
        "ns/op: wall time of the run ({}) over its operation count; median of the timed runs after a warm-up \
         run{}.",
        if common.device.is_some() {
            "final frees and one synchronize included"
        } else {
            "final frees included; host simulation, no GPU"
        },
        if single.is_empty() {
            String::new()
        } else {
            format!(" ({}: one timed run)", single.join(" and "))
        }
    ));
    if params.interleave {
        report.notes.push(format!(
            "interleaved: every resource of a point built first; one warm-up run each, then {} rounds, each \
             running every resource once (listed order on even rounds, reversed on odd ones); ns/op is the \
             median of a resource's rounds.",
            params.repeats.max(1)
        ));
        report.notes.extend(interleaved_notes);
    }
    if !service_vs_pool.is_empty() {
        report.notes.push(format!(
            "target (issue 23): `service` per operation within {SERVICE_VS_POOL_TARGET}x of `pool(async)` in the \
             same run; ns/op over pool(async)'s: {}.",
            service_vs_pool.join("; ")
        ));
    }
    report.chart = Some(Chart {
        title: "Random workload: nanoseconds per operation (lower is better)".into(),
        kind: ChartKind::Bars,
        x_label: "point".into(),
        y_label: "ns per operation".into(),
        categories: params.points.iter().map(Point::label).collect(),
        series: common
            .specs
            .iter()
            .zip(results)
            .enumerate()
            .map(|(i, (_, values))| Series {
                name: labels[i].clone(),
                values,
            })
            .collect(),
        log_y: false,
    });
    Ok(report)
}

/// The per-thread point of `random --threads` unless given: 50k operations, sizes to 64 KiB, at most
/// 256 MiB live per thread.
pub const THREADS_POINT: Point = Point {
    n: 50_000,
    max_size: 64 << 10,
    max_usage: 256 << 20,
};

/// Parameters of `random --threads`.
#[derive(Clone, Debug)]
pub struct ThreadsParams {
    /// Each thread's point (its own sequence: seed `seed + thread`).
    pub point: Point,
    /// Thread counts to sweep.
    pub threads: Vec<usize>,
    /// Timed runs per resource and thread count (median), after one warm-up run.
    pub repeats: usize,
    /// Seed of thread 0.
    pub seed: u64,
}

/// One run of `threads` threads, each on its own stream (the legacy stream in the host simulation)
/// running its own sequence against `mr`, started together; returns the wall time from the start to
/// the last thread's end (its final frees and synchronize included), in seconds.
fn run_threads(seqs: &[Vec<Op>], mr: &dyn MemoryResource, device: Option<&mempool_core::Device>) -> Result<f64> {
    let ctx = device.map(|d| d.context()).transpose()?;
    let streams: Vec<Option<Stream>> = match &ctx {
        Some(ctx) => seqs
            .iter()
            .map(|_| Stream::new(ctx).map(Some))
            .collect::<Result<_, _>>()?,
        None => seqs.iter().map(|_| None).collect(),
    };
    let barrier = std::sync::Barrier::new(seqs.len() + 1);
    let (start, results) = std::thread::scope(|scope| {
        let handles: Vec<_> = seqs
            .iter()
            .zip(&streams)
            .map(|(ops, stream)| {
                let (barrier, ctx) = (&barrier, &ctx);
                scope.spawn(move || -> Result<Instant> {
                    let _bound = ctx.as_ref().map(|c| c.bind()).transpose()?;
                    barrier.wait();
                    run(ops, mr, stream.as_ref())?;
                    Ok(Instant::now())
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<Result<Instant>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a benchmark thread panicked".into())))
            })
            .collect();
        (start, results)
    });
    let mut end = start;
    for r in results {
        end = end.max(r?);
    }
    Ok(end.duration_since(start).as_secs_f64())
}

/// `random --threads`: for each thread count, that many threads, each on its own stream, each running
/// the random workload (its own sequence) against one shared resource; reports the aggregate operations
/// per second and the scaling against the smallest thread count of the sweep.
pub fn bench_threads(common: &Common, params: &ThreadsParams) -> Result<Report> {
    let env = crate::env::Environment::detect(common.device.as_ref());
    let mut report = Report::new(
        "random-threads",
        "the random workload on N threads at once, each on its own stream, against one shared resource",
        env,
    );
    let p = params.point;
    report.param(
        "per thread",
        format!(
            "(n={}, max_size={}, max_usage={})",
            p.n,
            Size(p.max_size as u64),
            Size(p.max_usage as u64)
        ),
    );
    report.param(
        "threads",
        params
            .threads
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    );
    report.param("repeats", params.repeats);
    report.param("seed", params.seed);
    report.param("p_allocate", 0.73);
    report.columns = vec![
        Column::new("threads", 0),
        Column::new("resource", 0),
        Column::new("Mops/s (all threads)", 3),
        Column::new("Mops/s per thread", 3),
        Column::new(&format!("scaling vs {} thread(s)", params.threads[0]), 2),
    ];
    let max_threads = params.threads.iter().copied().max().unwrap_or(1);
    let seqs: Vec<Vec<Op>> = (0..max_threads).map(|t| generate(&p, params.seed + t as u64)).collect();
    let total = (params.threads.len() * common.specs.len()) as u64;
    let mut progress = Progress::new(total, common.quiet);
    let mut series: Vec<Vec<Option<f64>>> = vec![vec![None; params.threads.len()]; common.specs.len()];
    for (si, spec) in common.specs.iter().enumerate() {
        let mut first: Option<f64> = None;
        for (ti, &threads) in params.threads.iter().enumerate() {
            progress.set_label(format!("{spec} on {threads} thread(s)"));
            let built = build(spec, common.device.as_ref())?;
            let mr = built.resource.as_ref();
            let seqs = &seqs[..threads];
            run_threads(seqs, mr, common.device.as_ref())?;
            let mut rates = Vec::new();
            for _ in 0..params.repeats.max(1) {
                let secs = run_threads(seqs, mr, common.device.as_ref())?;
                rates.push((threads * p.n) as f64 / secs / 1e6);
            }
            let rate = median(&rates).unwrap_or(f64::NAN);
            let base = *first.get_or_insert(rate);
            series[si][ti] = Some(rate);
            report.row(vec![
                Cell::from(threads),
                Cell::from(built.label.as_str()),
                Cell::from(rate),
                Cell::from(rate / threads as f64),
                Cell::from(rate / base),
            ]);
            drop(built);
            progress.inc();
        }
    }
    progress.finish();
    report.notes.push(format!(
        "Mops/s: millions of operations (all threads' counted operations) per second of wall time from the \
         common start to the last thread's end ({}); median of the timed runs after a warm-up run; a fresh \
         resource per thread count.",
        if common.device.is_some() {
            "each thread's final frees and stream synchronize included"
        } else {
            "final frees included; host simulation, no GPU: on a host with few cores, scaling says little"
        }
    ));
    report.chart = Some(Chart {
        title: "Random workload on N threads: aggregate Mops/s (higher is better)".into(),
        kind: ChartKind::Bars,
        x_label: "threads".into(),
        y_label: "million operations per second".into(),
        categories: params.threads.iter().map(ToString::to_string).collect(),
        series: common
            .specs
            .iter()
            .zip(series)
            .map(|(s, values)| Series {
                name: s.to_string(),
                values,
            })
            .collect(),
        log_y: false,
    });
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_spec_is_numbered_and_a_single_one_is_not() {
        let specs =
            crate::spec::parse_list("cuMemAllocFromPoolAsync,async(threshold=0),cuMemAllocFromPoolAsync").unwrap();
        assert_eq!(
            unique_labels(&specs),
            vec![
                "cuMemAllocFromPoolAsync #1".to_string(),
                specs[1].to_string(),
                "cuMemAllocFromPoolAsync #2".to_string()
            ]
        );
    }

    #[test]
    fn spread_is_lowest_median_highest() {
        assert_eq!(spread(&[1.2, 0.9, 1.0]), (0.9, 1.0, 1.2));
    }
}
