//! `mempool-bench`: swaps memory resources under real GPU work and reports what each costs. See
//! `mempool-bench --help`, the crate documentation and docs/benchmarks.md.

#![deny(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use mempool_bench::cluster;
use mempool_bench::report::Report;
use mempool_bench::spec::{self, ResourceSpec};
use mempool_bench::units::{parse_size, Size};
use mempool_bench::workloads::{
    self, allreduce, fragmentation, grow, multi_stream, peer, query, random, replay, sleep, Common,
};
use mempool_bench::{Error, Result};
use mempool_core::Device;

#[derive(Parser, Debug)]
#[command(
    name = "mempool-bench",
    version,
    about = "Compare memory resources side by side under real GPU work (a gpu-bdb-style harness)",
    after_help = "Start with:  mempool-bench query --scale 0.25\n\
                  Without a GPU (host simulation):  mempool-bench random -r sim\n\
                  Resource specs: mempool-bench resources"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug, Clone)]
struct CommonArgs {
    /// Resources to compare: comma-separated specs (see `mempool-bench resources`), e.g.
    /// 'async,pool(async,initial=1GiB),binning(pool(async))'. May be given several times.
    #[arg(short, long = "resources", value_name = "SPECS")]
    resources: Vec<String>,
    /// Leave out the raw baselines (cuMemAlloc, cuMemAllocFromPoolAsync) measured by default.
    #[arg(long)]
    no_baselines: bool,
    /// The GPU to run on.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = ordinal_arg)]
    device: usize,
    #[command(flatten)]
    output: OutputArgs,
}

/// What every subcommand writes, `peer` included.
#[derive(Args, Debug, Clone)]
struct OutputArgs {
    /// Also write the report as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the table as CSV.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Also draw the report's chart as SVG.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// No progress bar (it is drawn only when stderr is a terminal anyway).
    #[arg(short, long)]
    quiet: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The standard random workload (docs/architecture.md, "Performance"): ns per allocate/free on one
    /// stream.
    Random {
        #[command(flatten)]
        common: CommonArgs,
        /// Operations (with --max-size and --max-usage: one custom point instead of the three standard ones).
        #[arg(long, allow_hyphen_values = true, value_parser = count_arg)]
        n: Option<usize>,
        /// Largest allocation, e.g. 64KiB.
        #[arg(long, allow_hyphen_values = true, value_parser = positive_size_arg)]
        max_size: Option<u64>,
        /// Most bytes live at once, e.g. 4GiB (at least --max-size).
        #[arg(long, allow_hyphen_values = true, value_parser = positive_size_arg)]
        max_usage: Option<u64>,
        /// Timed runs per resource and point (median), after one warm-up run.
        #[arg(long, default_value_t = 5, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
        /// Seed of the first point (point i uses seed + i).
        #[arg(long, default_value_t = 42, allow_hyphen_values = true, value_parser = seed_arg)]
        seed: u64,
        /// Log the first resource's warm-up run of the first point to FILE (RMM's CSV format, for `replay`).
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
        /// Thread counts to sweep (e.g. 1,2,4,8): that many threads, each on its own stream, each running
        /// the workload against one shared resource; reports aggregate operations per second and scaling.
        /// Each thread's point defaults to 50k ops, sizes to 64KiB, 256MiB live.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = count_arg)]
        threads: Vec<usize>,
        /// Interleave the timed runs: build every resource of a point first, then run each once per round
        /// (reversed order on odd rounds), and report each one's per-round ratio to the raw pool baseline
        /// (or the first resource). A spec may be listed twice (`-r 'cuMemAllocFromPoolAsync,async,
        /// cuMemAllocFromPoolAsync'`): its rows are numbered. Every resource holds its memory until the
        /// point ends.
        #[arg(long)]
        interleave: bool,
    },
    /// Several streams allocating, computing on and freeing small buffers at once; sweeps the stream count.
    MultiStream {
        #[command(flatten)]
        common: CommonArgs,
        /// Stream counts to sweep.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16", allow_hyphen_values = true, value_parser = count_arg)]
        streams: Vec<usize>,
        /// Iterations per stream.
        #[arg(long, default_value_t = 2000, allow_hyphen_values = true, value_parser = count_arg)]
        iterations: usize,
        /// 32-bit elements per buffer.
        #[arg(long, default_value_t = 16384, allow_hyphen_values = true, value_parser = count_arg)]
        elements: usize,
        /// Dependent hash mixes per element per iteration (the work; 0: allocation and launch only).
        #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = work_rounds_arg)]
        rounds: u32,
        /// Timed runs per point (median), after one warm-up run.
        #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
    },
    /// Replay an allocation log in RMM's CSV format, one thread per logged thread, in the logged order.
    Replay {
        #[command(flatten)]
        common: CommonArgs,
        /// The log (Thread,Time,Action,Pointer,Size,Stream).
        file: PathBuf,
        /// Timed replays per resource (median), after one warm-up replay.
        #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
        /// Write the log's snapshot (docs/observe.md, "Schema") to FILE. With --snapshot or --html and
        /// no -r, nothing is replayed (no GPU needed).
        #[arg(long, value_name = "FILE")]
        snapshot: Option<PathBuf>,
        /// Write the viewer page showing the log's snapshot to FILE.
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
    },
    /// gpu-bdb-style queries (filter, join, group-by, sort) on several workers; speed-up over cuMemAlloc.
    Query {
        #[command(flatten)]
        common: CommonArgs,
        /// Scale factor: 1 is 4M sales rows.
        #[arg(long, default_value_t = 1.0, allow_hyphen_values = true, value_parser = scale_arg)]
        scale: f64,
        /// Workers (a thread and a stream each) running queries at once.
        #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = count_arg)]
        workers: usize,
        /// Timed rounds (every worker runs every query once per round), after one warm-up round.
        #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = count_arg)]
        rounds: usize,
        /// Queries to run.
        #[arg(long, value_delimiter = ',', default_value = "q1,q2,q3,q4,q5")]
        queries: Vec<String>,
    },
    /// Two or more GPUs: NCCL all-reduce bandwidth over VMM, pool and cuMemAlloc memory, each registered
    /// with NCCL and not (NCCL opened at run time: MEMPOOL_NCCL_LIBRARY or libnccl.so.2).
    Allreduce {
        #[command(flatten)]
        output: OutputArgs,
        /// GPUs to use, one rank each (default: every visible GPU; at least two).
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<usize>,
        /// Smallest all-reduce.
        #[arg(long, default_value = "1MiB", value_parser = positive_size_arg)]
        min: u64,
        /// Largest all-reduce.
        #[arg(long, default_value = "1GiB", value_parser = positive_size_arg)]
        max: u64,
        /// Each size is the previous one times this (2 or more).
        #[arg(long, default_value_t = 4, value_parser = count_arg)]
        factor: usize,
        /// Untimed iterations per case.
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Timed iterations per case.
        #[arg(long, default_value_t = 20, value_parser = count_arg)]
        iters: usize,
    },
    /// Two GPUs: device 1 reading device 0's pool memory (access granted) vs cuMemAlloc memory (peer access).
    Peer {
        #[command(flatten)]
        output: OutputArgs,
        /// Bytes per transfer (a multiple of 16).
        #[arg(long, default_value = "256MiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        bytes: u64,
        /// Timed transfers per case (median), after one warm-up.
        #[arg(long, default_value_t = 10, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
        // The other subcommands' flags, accepted here only to be refused with the reason.
        #[arg(short, long = "resources", hide = true)]
        resources: Vec<String>,
        #[arg(long, hide = true)]
        no_baselines: bool,
        #[arg(long, hide = true)]
        device: Option<String>,
    },
    /// Many small and a few large blocks, the small ones freed, then one block larger than any free segment:
    /// peak device memory held over peak bytes live, per resource.
    Fragmentation {
        #[command(flatten)]
        common: CommonArgs,
        /// Size of each small block.
        #[arg(long, default_value = "1MiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        small: u64,
        /// Number of small blocks.
        #[arg(long, default_value_t = 1024, allow_hyphen_values = true, value_parser = count_arg)]
        smalls: usize,
        /// Size of each large block.
        #[arg(long, default_value = "64MiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        large: u64,
        /// Number of large blocks, one after every smalls/larges small blocks.
        #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = count_arg)]
        larges: usize,
        /// The request after the frees (default: half the runs of small blocks, at least two).
        #[arg(long, allow_hyphen_values = true, value_parser = positive_size_arg)]
        request: Option<u64>,
    },
    /// A buffer grown from --start to --end by --factor per step: GrowableBuffer (VMM, no copy) against
    /// allocate-copy-free through each resource.
    Grow {
        #[command(flatten)]
        common: CommonArgs,
        /// The first size.
        #[arg(long, default_value = "1MiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        start: u64,
        /// The last size.
        #[arg(long, default_value = "16GiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        end: u64,
        /// Growth factor per step (> 1).
        #[arg(long, default_value_t = 2.0, allow_hyphen_values = true, value_parser = scale_arg)]
        factor: f64,
        /// The GrowableBuffer's granule: each growth maps a multiple of it (a multiple of the granularity; default: the recommended one).
        #[arg(long, allow_hyphen_values = true, value_parser = positive_size_arg)]
        chunk: Option<u64>,
        /// Timed runs per method (median), after one warm-up run.
        #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
    },
    /// Issue 23: sleep and wake (offload and discard) of a ServiceResource tag holding one allocation of
    /// --size, each timed to completion, against pinned host<->device copies of the same bytes; the
    /// restored contents are checked.
    Sleep {
        #[command(flatten)]
        output: OutputArgs,
        /// Bytes allocated (one allocation), filled, put to sleep and woken; a multiple of 4.
        #[arg(long, default_value = "16GiB", allow_hyphen_values = true, value_parser = positive_size_arg)]
        size: u64,
        /// Timed repeats (median), after one warm-up repeat.
        #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = count_arg)]
        repeats: usize,
        /// The GPU to run on.
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = ordinal_arg)]
        device: usize,
    },
    /// Merge the snapshot files of several workers (`replay --snapshot`, mempool.memory.dump_snapshot) into
    /// one cluster document and its viewer page (docs/observe.md, "Cluster snapshots"). No GPU needed.
    Cluster {
        /// A worker: its name, `=`, its snapshot file (JSON). Once per worker, in the order to show them.
        #[arg(long = "worker", value_name = "NAME=FILE", required = true, value_parser = cluster::parse_worker)]
        workers: Vec<(String, PathBuf)>,
        /// Write the cluster document (JSON) to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Write the viewer page showing the cluster to FILE.
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
    },
    /// List the resource specs that -r accepts.
    Resources,
}

/// A count: a whole number of at least 1.
fn count_arg(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("must be a positive whole number (1, 2, ...)".into()),
    }
}

/// Work rounds of the multi-stream kernel: 0 or more.
fn work_rounds_arg(s: &str) -> std::result::Result<u32, String> {
    s.trim()
        .parse()
        .map_err(|_| "must be a whole number of rounds (0 or more)".into())
}

/// A seed: any u64.
fn seed_arg(s: &str) -> std::result::Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("must be a whole number from 0 to {}", u64::MAX))
}

/// A device ordinal: 0 or more.
fn ordinal_arg(s: &str) -> std::result::Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| "must be a device ordinal (0, 1, ...)".into())
}

/// A positive byte count (`64KiB`, `1.5GiB`).
fn positive_size_arg(s: &str) -> std::result::Result<u64, String> {
    const WHAT: &str = "must be a positive size: a byte count with an optional unit, e.g. 4096, 64KiB, 1.5GiB";
    if s.trim().starts_with('-') {
        return Err(WHAT.into());
    }
    match parse_size(s) {
        Ok(0) => Err(WHAT.into()),
        Ok(u64::MAX) => Err(format!("{WHAT} (`max`, unlimited, is not a size here)")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A positive, finite scale factor.
fn scale_arg(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err("must be a positive number, e.g. 0.25 or 1".into()),
    }
}

// `async` keeps what it reserves (RMM's default); `async(threshold=0)` is the driver's default, which gives
// unused memory back at every synchronize.
const DEFAULT_RESOURCES: &str = "async,async(threshold=0),pool(async),binning(async),arena(async)";
const FRAGMENTATION_RESOURCES: &str = "expandable,expandable(reclaim=growth),service,async,pool(async)";
const GROW_RESOURCES: &str = "cuda,async";
const HOST_RESOURCES: &str = "async,pool(async),binning(async),arena(async)";

/// The specs to compare (`-r`, or `default`), with the baselines unless left out or the run is
/// host-only. Parsing needs no driver.
fn specs(args: &CommonArgs, default: &str) -> Result<Vec<ResourceSpec>> {
    let mut out = Vec::new();
    if args.resources.is_empty() {
        out = spec::parse_list(default)?;
    }
    for r in &args.resources {
        out.extend(spec::parse_list(r)?);
    }
    let host_only = !out.is_empty() && out.iter().all(ResourceSpec::is_host_only);
    Ok(workloads::with_baselines(out, !args.no_baselines && !host_only))
}

/// Refuses `sim` for a workload that has no host simulation, before the driver is loaded.
fn no_sim(workload: &str, specs: &[ResourceSpec]) -> Result<()> {
    if specs.iter().any(ResourceSpec::is_host_only) {
        return Err(Error::Usage(format!(
            "`sim` cannot run the {workload} workload: its kernels need GPU memory (`sim` runs `random` and `replay`)"
        )));
    }
    Ok(())
}

/// The first `needed` GPUs, or why this machine has too few, with what runs instead (`hint`). This is
/// where the driver is first loaded: every argument is checked before it.
fn gpus(workload: &'static str, needed: usize, hint: Option<&str>) -> Result<Vec<Device>> {
    mempool_core::require_gpus(needed).map_err(|missing| Error::NoGpu {
        workload,
        missing,
        hint: hint.map(str::to_owned),
    })
}

/// The device of `--device`, unless every spec runs on the host (`sim`).
fn device(workload: &'static str, args: &CommonArgs, specs: &[ResourceSpec]) -> Result<Option<Device>> {
    if specs.iter().all(ResourceSpec::is_host_only) {
        return Ok(None);
    }
    let hint = match workload {
        "random" | "replay" => format!(
            "Without a GPU, `-r sim` runs the {workload} workload on a host simulation: mempool-bench {workload} -r sim{}",
            if workload == "replay" { " FILE" } else { "" }
        ),
        _ => format!("The {workload} workload runs kernels on the GPU; there is no host simulation of it."),
    };
    let devices = gpus(workload, 1, Some(&hint))?;
    match devices.get(args.device) {
        Some(d) => Ok(Some(*d)),
        None => Err(Error::Usage(format!(
            "--device {}: there is no such GPU ({} visible, numbered from 0)",
            args.device,
            devices.len()
        ))),
    }
}

fn common(specs: Vec<ResourceSpec>, device: Option<Device>, args: &CommonArgs) -> Common {
    Common {
        specs,
        device,
        quiet: args.output.quiet,
    }
}

fn finish(report: Report, args: &OutputArgs) -> Result<()> {
    print!("{}", report.render_text());
    report.write_files(args.json.as_deref(), args.csv.as_deref(), args.plot.as_deref())?;
    for (what, path) in [("json", &args.json), ("csv", &args.csv), ("plot", &args.plot)] {
        if let Some(p) = path {
            eprintln!("wrote {what}: {}", p.display());
        }
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Resources => {
            println!("{}", spec::ACCEPTED);
            Ok(())
        }
        Command::Cluster { workers, json, html } => cluster::merge(&workers, json.as_deref(), html.as_deref()),
        Command::Random {
            common: args,
            n,
            max_size,
            max_usage,
            repeats,
            seed,
            log,
            threads,
            interleave,
        } => {
            let specs = specs(&args, HOST_RESOURCES)?;
            if !threads.is_empty() {
                let d = random::THREADS_POINT;
                let point = random::Point {
                    n: n.unwrap_or(d.n),
                    max_size: max_size.map_or(d.max_size, |v| v as usize),
                    max_usage: max_usage.map_or(d.max_usage, |v| v as usize),
                };
                if point.max_usage < point.max_size {
                    return Err(Error::Usage(format!(
                        "--max-usage ({}) is smaller than --max-size ({})",
                        Size(point.max_usage as u64),
                        Size(point.max_size as u64)
                    )));
                }
                if log.is_some() {
                    return Err(Error::Usage(
                        "--log records one thread's run; it does not go with --threads".into(),
                    ));
                }
                if interleave {
                    return Err(Error::Usage(
                        "--interleave interleaves the resources of the one-stream workload; it does not go with --threads"
                            .into(),
                    ));
                }
                let device = device("random", &args, &specs)?;
                let params = random::ThreadsParams {
                    point,
                    threads,
                    repeats,
                    seed,
                };
                return finish(
                    random::bench_threads(&common(specs, device, &args), &params)?,
                    &args.output,
                );
            }
            let points = if n.is_none() && max_size.is_none() && max_usage.is_none() {
                random::STANDARD_POINTS.to_vec()
            } else {
                let d = random::STANDARD_POINTS[0];
                let p = random::Point {
                    n: n.unwrap_or(d.n),
                    max_size: max_size.map_or(d.max_size, |v| v as usize),
                    max_usage: max_usage.map_or(d.max_usage, |v| v as usize),
                };
                if p.max_usage < p.max_size {
                    return Err(Error::Usage(format!(
                        "--max-usage ({}) is smaller than --max-size ({}): allocations above it could never be made",
                        Size(p.max_usage as u64),
                        Size(p.max_size as u64)
                    )));
                }
                vec![p]
            };
            let device = device("random", &args, &specs)?;
            let params = random::RandomParams {
                points,
                repeats,
                seed,
                log,
                interleave,
            };
            finish(random::bench(&common(specs, device, &args), &params)?, &args.output)
        }
        Command::MultiStream {
            common: args,
            streams,
            iterations,
            elements,
            rounds,
            repeats,
        } => {
            let specs = specs(&args, DEFAULT_RESOURCES)?;
            no_sim("multi-stream", &specs)?;
            let device = device("multi-stream", &args, &specs)?;
            let params = multi_stream::MultiStreamParams {
                streams,
                iterations,
                elements,
                rounds,
                repeats,
            };
            finish(
                multi_stream::bench(&common(specs, device, &args), &params)?,
                &args.output,
            )
        }
        Command::Replay {
            common: args,
            file,
            repeats,
            snapshot,
            html,
        } => {
            if snapshot.is_some() || html.is_some() {
                replay::write_snapshot(&file, snapshot.as_deref(), html.as_deref())?;
                if args.resources.is_empty() {
                    return Ok(());
                }
            }
            let specs = specs(&args, HOST_RESOURCES)?;
            // The file is an argument: it is read (and refused) before the driver is loaded.
            let plan = replay::load(&file).map_err(|e| Error::Usage(e.to_string()))?;
            if plan.steps.is_empty() {
                return Err(Error::Usage(format!(
                    "{}: no allocation to replay: {}",
                    file.display(),
                    match plan.logged_failures {
                        0 => "the log has no event after its header".to_owned(),
                        n => format!("its {n} event(s) are all failed allocations, which are not replayed"),
                    }
                )));
            }
            let device = device("replay", &args, &specs)?;
            finish(
                replay::bench(&common(specs, device, &args), &file, &plan, repeats)?,
                &args.output,
            )
        }
        Command::Query {
            common: args,
            scale,
            workers,
            rounds,
            queries,
        } => {
            let specs = specs(&args, DEFAULT_RESOURCES)?;
            no_sim("query", &specs)?;
            let queries = queries
                .iter()
                .map(|q| {
                    query::Query::parse(q)
                        .ok_or_else(|| Error::Usage(format!("unknown query `{q}`: the suite has q1, q2, q3, q4, q5")))
                })
                .collect::<Result<Vec<_>>>()?;
            let device = device("query", &args, &specs)?;
            let params = query::QueryParams {
                scale,
                workers,
                rounds,
                queries,
            };
            finish(query::bench(&common(specs, device, &args), &params)?, &args.output)
        }
        Command::Fragmentation {
            common: args,
            small,
            smalls,
            large,
            larges,
            request,
        } => {
            let specs = specs(&args, FRAGMENTATION_RESOURCES)?;
            no_sim("fragmentation", &specs)?;
            let params = fragmentation::FragmentationParams {
                small: small as usize,
                smalls,
                large: large as usize,
                larges,
                request: request.map(|r| r as usize),
            };
            params.check()?;
            let device = device("fragmentation", &args, &specs)?;
            finish(
                fragmentation::bench(&common(specs, device, &args), &params)?,
                &args.output,
            )
        }
        Command::Grow {
            common: args,
            start,
            end,
            factor,
            chunk,
            repeats,
        } => {
            let specs = specs(&args, GROW_RESOURCES)?;
            no_sim("grow", &specs)?;
            let params = grow::GrowParams {
                start: start as usize,
                end: end as usize,
                factor,
                repeats,
                chunk: chunk.map(|c| c as usize),
            };
            grow::steps(&params)?;
            let device = device("grow", &args, &specs)?;
            finish(grow::bench(&common(specs, device, &args), &params)?, &args.output)
        }
        Command::Sleep {
            output,
            size,
            repeats,
            device,
        } => {
            let params = sleep::SleepParams {
                size: usize::try_from(size)
                    .map_err(|_| Error::Usage(format!("--size {}: too large for this machine", Size(size))))?,
                repeats,
            };
            params.check()?;
            let hint =
                "The sleep workload needs a GPU with virtual memory management; there is no host simulation of it.";
            let devices = gpus("sleep", 1, Some(hint))?;
            let dev = *devices.get(device).ok_or_else(|| {
                Error::Usage(format!(
                    "--device {device}: there is no such GPU ({} visible, numbered from 0)",
                    devices.len()
                ))
            })?;
            finish(sleep::bench(dev, &params, output.quiet)?, &output)
        }
        Command::Allreduce {
            output,
            gpus: chosen,
            min,
            max,
            factor,
            warmup,
            iters,
        } => {
            if factor < 2 || min > max || !min.is_multiple_of(4) {
                return Err(Error::Usage(format!(
                    "sizes from --min {} to --max {} by --factor {factor}: need min <= max, min a multiple of 4 \
                     bytes (i32 elements) and a factor of at least 2",
                    Size(min),
                    Size(max)
                )));
            }
            let mut sizes = Vec::new();
            let mut b = min;
            while b <= max {
                sizes.push(b as usize);
                b = match b.checked_mul(factor as u64) {
                    Some(next) => next,
                    None => break,
                };
            }
            let visible = gpus("allreduce", 2, None)?;
            let devices = if chosen.is_empty() {
                visible
            } else {
                let mut ds = Vec::new();
                for i in chosen {
                    let d = visible.get(i).copied().ok_or_else(|| {
                        Error::Usage(format!(
                            "--gpus: there is no GPU {i} ({} visible, numbered from 0)",
                            visible.len()
                        ))
                    })?;
                    ds.push(d);
                }
                ds
            };
            let params = allreduce::AllReduceParams {
                devices,
                sizes,
                warmup,
                iters,
            };
            finish(allreduce::bench(&params, output.quiet)?, &output)
        }
        Command::Peer {
            output,
            bytes,
            repeats,
            resources,
            no_baselines,
            device,
        } => {
            let kinds = "peer compares two kinds of memory (a device-0 pool with access granted, cuMemAlloc \
                         memory with peer access)";
            for (given, flag, why) in [
                (
                    !resources.is_empty(),
                    "-r/--resources",
                    format!("{kinds}, not resources"),
                ),
                (
                    no_baselines,
                    "--no-baselines",
                    format!("{kinds}; there is no baseline to leave out"),
                ),
                (
                    device.is_some(),
                    "--device",
                    "peer always reads device 0's memory from device 1".to_owned(),
                ),
            ] {
                if given {
                    return Err(Error::Usage(format!("{flag} does not apply to peer: {why}")));
                }
            }
            if !bytes.is_multiple_of(16) {
                return Err(Error::Usage(format!(
                    "--bytes ({bytes}) must be a multiple of 16 (the kernel reads 16 bytes at a time)"
                )));
            }
            let devices = gpus("peer", 2, None)?;
            let c = Common {
                specs: Vec::new(),
                device: Some(devices[0]),
                quiet: output.quiet,
            };
            let params = peer::PeerParams {
                bytes: bytes as usize,
                repeats,
            };
            finish(peer::bench(&c, &params)?, &output)
        }
    }
}

/// For `allreduce`: turns NCCL's NVLink multicast off (`NCCL_NVLS_ENABLE=0` unless set; another value is
/// refused later by the workload's check), before the driver or NCCL is loaded.
#[allow(unsafe_code)]
fn disable_nvls_for_allreduce(cli: &Cli) -> Result<()> {
    if matches!(cli.command, Command::Allreduce { .. }) {
        // SAFETY: called first thing in `main`, after parsing the arguments and before any thread is
        // started or any library that could start one (the CUDA driver, NCCL) is loaded, so no other
        // thread reads or writes the environment.
        unsafe { mempool_nccl::disable_nvls() }?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match disable_nvls_for_allreduce(&cli).and_then(|()| run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match e {
                // `mempool-bench random: needs a GPU: ...`, as every program of the workspace says it.
                Error::NoGpu { .. } => eprintln!("mempool-bench {e}"),
                _ => eprintln!("mempool-bench: {e}"),
            }
            match e {
                Error::Spec(_) | Error::Usage(_) => ExitCode::from(2),
                Error::NoGpu { .. } | Error::Core(mempool_core::Error::DriverNotFound) => {
                    ExitCode::from(mempool_core::NO_GPU_EXIT_STATUS)
                }
                _ => ExitCode::FAILURE,
            }
        }
    }
}
