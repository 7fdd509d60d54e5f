//! `mempool-bench`: swaps memory resources under real GPU work and reports what each costs. See
//! `mempool-bench --help`, the crate documentation and docs/benchmarks.md.

#![deny(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use mempool_bench::report::Report;
use mempool_bench::spec::{self, ResourceSpec};
use mempool_bench::units::parse_size;
use mempool_bench::workloads::{self, multi_stream, peer, query, random, replay, Common};
use mempool_bench::{Error, Result};
use mempool_core::Device;

#[derive(Parser, Debug)]
#[command(
    name = "mempool-bench",
    version,
    about = "Compare memory resources side by side under real GPU work (a gpu-bdb-style harness)",
    after_help = "Start with:  mempool-bench query --scale 0.25\n\
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
    #[arg(long, default_value_t = 0)]
    device: usize,
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
        #[arg(long)]
        n: Option<usize>,
        /// Largest allocation, e.g. 64KiB.
        #[arg(long, value_parser = size_arg)]
        max_size: Option<u64>,
        /// Most bytes live at once, e.g. 4GiB.
        #[arg(long, value_parser = size_arg)]
        max_usage: Option<u64>,
        /// Timed runs per resource and point (median), after one warm-up run.
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Seed of the first point (point i uses seed + i).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Log the first resource's warm-up run of the first point to FILE (RMM's CSV format, for `replay`).
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
    },
    /// Several streams allocating, computing on and freeing small buffers at once; sweeps the stream count.
    MultiStream {
        #[command(flatten)]
        common: CommonArgs,
        /// Stream counts to sweep.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
        streams: Vec<usize>,
        /// Iterations per stream.
        #[arg(long, default_value_t = 2000)]
        iterations: usize,
        /// 32-bit elements per buffer.
        #[arg(long, default_value_t = 16384)]
        elements: usize,
        /// Dependent hash mixes per element per iteration (the work).
        #[arg(long, default_value_t = 64)]
        rounds: u32,
        /// Timed runs per point (median), after one warm-up run.
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// Replay an allocation log in RMM's CSV format, one thread per logged thread, in the logged order.
    Replay {
        #[command(flatten)]
        common: CommonArgs,
        /// The log (Thread,Time,Action,Pointer,Size,Stream).
        file: PathBuf,
        /// Timed replays per resource (median), after one warm-up replay.
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// gpu-bdb-style queries (filter, join, group-by, sort) on several workers; speed-up over cuMemAlloc.
    Query {
        #[command(flatten)]
        common: CommonArgs,
        /// Scale factor: 1 is 4M sales rows.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Workers (a thread and a stream each) running queries at once.
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Timed rounds (every worker runs every query once per round), after one warm-up round.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Queries to run.
        #[arg(long, value_delimiter = ',', default_value = "q1,q2,q3,q4,q5")]
        queries: Vec<String>,
    },
    /// Two GPUs: device 1 reading device 0's pool memory (access granted) vs cuMemAlloc memory (peer access).
    Peer {
        #[command(flatten)]
        common: CommonArgs,
        /// Bytes per transfer.
        #[arg(long, default_value = "256MiB", value_parser = size_arg)]
        bytes: u64,
        /// Timed transfers per case (median), after one warm-up.
        #[arg(long, default_value_t = 10)]
        repeats: usize,
    },
    /// List the resource specs that -r accepts.
    Resources,
}

fn size_arg(s: &str) -> std::result::Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

// `async` keeps what it reserves (RMM's default); `async(threshold=0)` is the driver's default, which gives
// unused memory back at every synchronize.
const DEFAULT_RESOURCES: &str = "async,async(threshold=0),pool(async),binning(async),arena(async)";

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

fn common(args: &CommonArgs, default: &str, needs_gpu: bool) -> Result<Common> {
    let specs = specs(args, default)?;
    let host_only = specs.iter().all(ResourceSpec::is_host_only);
    let device = if host_only && !needs_gpu {
        None
    } else {
        Some(Device::get(args.device)?)
    };
    Ok(Common {
        specs,
        device,
        quiet: args.quiet,
    })
}

fn finish(report: Report, args: &CommonArgs) -> Result<()> {
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
        Command::Random {
            common: args,
            n,
            max_size,
            max_usage,
            repeats,
            seed,
            log,
        } => {
            let c = common(&args, "async,pool(async),binning(async),arena(async)", false)?;
            let points = if n.is_none() && max_size.is_none() && max_usage.is_none() {
                random::STANDARD_POINTS.to_vec()
            } else {
                let d = random::STANDARD_POINTS[0];
                vec![random::Point {
                    n: n.unwrap_or(d.n),
                    max_size: max_size.map_or(d.max_size, |v| v as usize),
                    max_usage: max_usage.map_or(d.max_usage, |v| v as usize),
                }]
            };
            if points.iter().any(|p| p.max_size == 0) {
                return Err(Error::Usage("--max-size must be at least 1 byte".into()));
            }
            let report = random::bench(
                &c,
                &random::RandomParams {
                    points,
                    repeats,
                    seed,
                    log,
                },
            )?;
            finish(report, &args)
        }
        Command::MultiStream {
            common: args,
            streams,
            iterations,
            elements,
            rounds,
            repeats,
        } => {
            let c = common(&args, DEFAULT_RESOURCES, true)?;
            if streams.contains(&0) || elements == 0 {
                return Err(Error::Usage("--streams and --elements must be positive".into()));
            }
            let params = multi_stream::MultiStreamParams {
                streams,
                iterations,
                elements,
                rounds,
                repeats,
            };
            finish(multi_stream::bench(&c, &params)?, &args)
        }
        Command::Replay {
            common: args,
            file,
            repeats,
        } => {
            let c = common(&args, "async,pool(async),binning(async),arena(async)", false)?;
            finish(replay::bench(&c, &file, repeats)?, &args)
        }
        Command::Query {
            common: args,
            scale,
            workers,
            rounds,
            queries,
        } => {
            let c = common(&args, DEFAULT_RESOURCES, true)?;
            let queries = queries
                .iter()
                .map(|q| {
                    query::Query::parse(q)
                        .ok_or_else(|| Error::Usage(format!("unknown query `{q}`: the suite has q1, q2, q3, q4, q5")))
                })
                .collect::<Result<Vec<_>>>()?;
            if !(scale > 0.0 && scale.is_finite()) || workers == 0 || queries.is_empty() {
                return Err(Error::Usage("--scale, --workers and --queries must be positive".into()));
            }
            let params = query::QueryParams {
                scale,
                workers,
                rounds,
                queries,
            };
            finish(query::bench(&c, &params)?, &args)
        }
        Command::Peer {
            common: args,
            bytes,
            repeats,
        } => {
            let c = Common {
                specs: Vec::new(),
                device: Some(Device::get(args.device)?),
                quiet: args.quiet,
            };
            let params = peer::PeerParams {
                bytes: bytes as usize,
                repeats,
            };
            finish(peer::bench(&c, &params)?, &args)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mempool-bench: {e}");
            match e {
                Error::Spec(_) | Error::Usage(_) => ExitCode::from(2),
                Error::Core(mempool_core::Error::DriverNotFound) => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
