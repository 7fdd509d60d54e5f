//! Benchmark: handing a GPU buffer from a producer process to consumer processes and back, with
//! mempool-ipc (the pool's descriptor once, then 176-byte buffer messages and an IPC event),
//! against a baseline measured in the same run: copying the same bytes through the host
//! (device -> pinned host -> Unix socket -> pinned host -> device, acknowledged).
//!
//! Ways through mempool-ipc, measured in the same run with separate consumer processes:
//!
//! - `v1 alloc`: protocol version 1 (`ImporterOptions::fast_release = false`), a whole pool
//!   allocation per buffer: the importer imports each buffer, and its release frees the import
//!   and synchronizes its stream (the path measured before the fast release path existed);
//! - `v2 alloc`: the fast release path, a whole pool allocation per buffer (still one import per
//!   buffer, but releases are ordered by the importer's event and batched);
//! - `v2 sub`: the fast release path over the socket (`ImporterOptions::rings = false`: the path
//!   before protocol version 3) with buffers suballocated (a `PoolResource` over the exporter's
//!   pool, `Exporter::adopt`) from blocks the importer keeps imported: after the first buffer, no
//!   import, no synchronize, and releases ordered by an event;
//! - `v3 alloc` and `v3 sub`: the same through the connection's shared-memory rings (protocol
//!   version 3, the default): buffers and releases cost no system call while both sides are
//!   awake, and a release goes out as soon as the buffer is let go;
//! - the exporter's two spins, in the same run (`v3 sub` runs with both, the default): `loop spin
//!   only` (`Exporter::set_wait_spin(0)`: `wait_released` parks at once), `wait spin only`
//!   (`Exporter::set_spin(0)`: the serving thread sleeps as soon as the rings are empty, so every
//!   release that finds it asleep rings its doorbell) and `no spin` (both 0), each `v3 sub` otherwise;
//! - `v3 sub x8` (sustained only): `v3 sub` with the producer sharing 8 buffers per
//!   `Exporter::share_many` and the consumer taking them with `Importer::recv_many`.
//!
//! - Round trip, one consumer: the producer makes a buffer, shares it, and waits until the
//!   consumer has received it (waiting on the producer's event) and released it.
//!   Baseline: device-to-host copy, the bytes over the socket, host-to-device copy in the
//!   consumer, one byte back.
//! - Sustained, several consumers: one producer thread per consumer keeps 4 buffers in flight,
//!   each freshly made and filled on the GPU (the baseline fills and copies it out); buffers
//!   per second over all consumers. For 64 KiB it also prints the system calls and wake-ups per
//!   buffer of `v2 sub`, `v3 sub` and each setting of the spins (`mempool_ipc::trace::counters`, added up
//!   over the producer and the consumers).
//!
//! A diagnosis comes with it (skipped with `--no-trace`): a 4 KiB `v3 sub` round trip before the
//! tables, then after them, for `v3 sub` (the rings), `v2 sub` (the socket) and `v3 sub host`, the
//! 4 KiB and 64 KiB round trips and the sustained 64 KiB run again, untraced and with
//! `mempool_ipc::trace` recording in the producer and the consumers. Each step of a buffer's way
//! (producer share, ring push or socket write, the consumer's spin, sleep on the doorbell and wake,
//! its event wait, view and release, the release's push into the ring and any `RingBell`, the
//! exporter's loop waking or its spin finding the release, the lease released, `wait_released`
//! woken) is printed with its median, 90th percentile and count, joined across the processes by
//! buffer id (steps fewer than a tenth of the buffers took are left out; step tables for the rings'
//! runs and the socket's sustained run only, summaries for the rest); also how often a ready or
//! release event was still pending on the GPU, how often the producer's stream was still busy when
//! the release arrived, the round trip when the producer synchronizes its stream each time, and the
//! system calls per buffer of the sustained run. The third set of consumers waits on the host for
//! pending ready events (`ImporterOptions::wait_ready_on_host`) and for its own work before each
//! release (`ImporterOptions::release_on_host`), so that no stream waits for another process's event.
//!
//! Run on a GPU: `cargo run --release -p mempool-bench --bin ipc_handoff -- [consumers]
//! [--no-trace] [--sub-first]` (default 4 consumers; `--sub-first` measures each row's sub columns
//! before its alloc columns). The producer re-executes this program for each consumer (a
//! version-1, a version-2 and a version-3 set, and the diagnosis' set). It prints the device, the
//! host CPU, whether CUDA MPS is in use (`CUDA_MPS_PIPE_DIRECTORY`; `scripts/ipc-mps-bench.sh`
//! runs it with and without), every baseline and the ratios the targets of issue 25 name.
//! Without a GPU it says why and exits with status 2.
//!
//! One of mempool-bench's workloads, as its own binary rather than a `mempool-bench` subcommand: it
//! runs several processes (the producer re-executes itself as each consumer) and prints its own
//! tables, not a report of resources side by side.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mempool_core::{memory, Context, Device, DeviceAddr, HandleTypes, Stream, StreamRef};
use mempool_ipc::trace::{self, Record};
use mempool_ipc::{Error, ExportedBuffer, Exporter, ExporterOptions, Importer, ImporterId, ImporterOptions};
use mempool_rmm::suballoc::PoolOptions;
use mempool_rmm::{AsyncOptions, AsyncResource, MemoryResource, PoolResource, ReleaseThreshold};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(60);
const WINDOW: usize = 4;
/// Buffers per `share_many` in the batched sustained column.
const MANY: usize = 8;

/// Control messages from the producer to a consumer: an op byte and a little-endian u64.
const OP_EXIT: u8 = 0;
/// Receive and release this many buffers through mempool-ipc, then answer one byte.
const OP_IPC: u8 = 1;
/// Receive and release this many buffers with `Importer::recv_many`, then answer one byte.
const OP_IPC_MANY: u8 = 4;
/// Receive this many bytes, copy them to the device, answer one byte.
const OP_COPY: u8 = 2;
/// 1: start recording `mempool_ipc::trace`; 0: stop, and answer the records (a little-endian u64
/// count, then each record's bytes).
const OP_TRACE: u8 = 3;
/// 1: zero `mempool_ipc::trace`'s counters; 0: answer them (`Counters::WORDS` little-endian u64s).
const OP_COUNTERS: u8 = 5;

type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What the command line asks for.
enum Role {
    /// `[consumers] [--no-trace] [--sub-first]`: the producer, which starts the consumers.
    Producer {
        consumers: usize,
        diagnose: bool,
        sub_first: bool,
    },
    /// `consumer SOCKET [--v1 | --v2 | --host-ready]`: one consumer, started by the producer.
    Consumer {
        socket: PathBuf,
        v1: bool,
        /// `--v2`: the fast release path over the socket (no rings).
        socket_only: bool,
        host_ready: bool,
    },
}

/// The command line, or why it cannot be run (checked before the driver is loaded).
fn parse_args(args: &[String]) -> Result<Role, String> {
    if args.first().map(String::as_str) == Some("consumer") {
        let socket = args.get(1).ok_or("consumer: the exporter's socket path is missing")?;
        let flag = args.get(2).map(String::as_str);
        if let Some(extra) = args.get(if flag.is_some() { 3 } else { 2 }) {
            return Err(format!("consumer: unexpected argument `{extra}`"));
        }
        return match flag {
            None | Some("--v1") | Some("--v2") | Some("--host-ready") => Ok(Role::Consumer {
                socket: PathBuf::from(socket),
                v1: flag == Some("--v1"),
                socket_only: flag == Some("--v2"),
                host_ready: flag == Some("--host-ready"),
            }),
            Some(other) => Err(format!("consumer: unknown flag `{other}` (--v1, --v2, --host-ready)")),
        };
    }
    let (mut consumers, mut diagnose, mut sub_first) = (None, true, false);
    for a in args {
        match a.as_str() {
            "--no-trace" => diagnose = false,
            "--sub-first" => sub_first = true,
            flag if flag.starts_with("--") => {
                return Err(format!(
                    "unknown flag `{flag}`: usage: ipc_handoff [consumers] [--no-trace] [--sub-first]"
                ))
            }
            n if consumers.is_none() => match n.parse::<usize>() {
                Ok(c) if c > 0 => consumers = Some(c),
                _ => return Err(format!("`{n}` is not a consumer count (a whole number, 1 or more)")),
            },
            extra => return Err(format!("unexpected argument `{extra}`: one consumer count at most")),
        }
    }
    Ok(Role::Producer {
        consumers: consumers.unwrap_or(4),
        diagnose,
        sub_first,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = match parse_args(&args) {
        Ok(role) => role,
        Err(e) => {
            eprintln!("ipc_handoff: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(missing) = mempool_core::require_gpus(1) {
        return missing.exit("ipc_handoff");
    }
    let result = match role {
        Role::Consumer {
            socket,
            v1,
            socket_only,
            host_ready,
        } => consumer(&socket, v1, socket_only, host_ready),
        Role::Producer {
            consumers,
            diagnose,
            sub_first,
        } => producer(consumers, diagnose, sub_first),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc_handoff: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Pinned host memory, freed on drop.
struct Pinned {
    ctx: Arc<Context>,
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(ctx: &Arc<Context>, len: usize) -> AnyResult<Pinned> {
        Ok(Pinned {
            ctx: ctx.clone(),
            ptr: memory::pinned_host_alloc(ctx, len)?,
            len,
        })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live pinned allocation of `len` bytes owned by `self`; the borrow of
        // `self` keeps it alive and unaliased for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `pinned_host_alloc` and freed once; every copy that used it was
        // synchronized before the copy functions returned.
        let _ = unsafe { memory::pinned_host_free(&self.ctx, self.ptr) };
    }
}

fn send_op(ctl: &mut UnixStream, op: u8, arg: u64) -> AnyResult<()> {
    let mut msg = [0u8; 9];
    msg[0] = op;
    msg[1..].copy_from_slice(&arg.to_le_bytes());
    ctl.write_all(&msg)?;
    Ok(())
}

fn recv_op(ctl: &mut UnixStream) -> AnyResult<(u8, u64)> {
    let mut msg = [0u8; 9];
    ctl.read_exact(&mut msg)?;
    Ok((msg[0], u64::from_le_bytes(msg[1..].try_into()?)))
}

fn ack(ctl: &mut UnixStream) -> AnyResult<()> {
    let mut b = [0u8; 1];
    ctl.read_exact(&mut b)?;
    Ok(())
}

// ---------------------------------------------------------------- consumer

fn consumer(socket: &Path, v1: bool, socket_only: bool, host_ready: bool) -> AnyResult<()> {
    let options = ImporterOptions {
        fast_release: !v1,
        rings: !socket_only,
        wait_ready_on_host: host_ready,
        release_on_host: host_ready,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(socket, options)?;
    if importer.fast_release() == v1 || importer.rings() != (!v1 && !socket_only) {
        return Err(format!(
            "asked for the fast release path: {}, got it: {}; asked for the rings: {}, got them: {}",
            !v1,
            importer.fast_release(),
            !v1 && !socket_only,
            importer.rings()
        )
        .into());
    }
    let dev = importer.device();
    let ctx = dev.context()?;
    let stream = Stream::new(&ctx)?;
    let mut ctl = UnixStream::connect(ctl_path(socket))?;
    let mut pinned: Option<Pinned> = None;
    let mut device: Option<(DeviceAddr, usize)> = None;
    loop {
        let (op, arg) = recv_op(&mut ctl)?;
        match op {
            OP_IPC => {
                for _ in 0..arg {
                    let buf = match importer.recv_timeout(stream.as_ref(), WAIT) {
                        Ok(buf) => buf,
                        Err(Error::ExporterGone { .. }) => return Ok(()),
                        Err(e) => return Err(e.into()),
                    };
                    buf.release()?;
                }
                ctl.write_all(&[1])?;
            }
            OP_IPC_MANY => {
                let mut left = arg as usize;
                while left > 0 {
                    let bufs = match importer.recv_many(stream.as_ref(), left.min(64), Some(WAIT)) {
                        Ok(bufs) => bufs,
                        Err(Error::ExporterGone { .. }) => return Ok(()),
                        Err(e) => return Err(e.into()),
                    };
                    left -= bufs.len();
                    for buf in bufs {
                        buf.release()?;
                    }
                }
                ctl.write_all(&[1])?;
            }
            OP_COPY => {
                let len = arg as usize;
                if pinned.as_ref().is_none_or(|p| p.len < len) {
                    pinned = Some(Pinned::new(&ctx, len)?);
                    if let Some((ptr, _)) = device.take() {
                        // SAFETY: allocated below with `device_alloc`, no work pending (every copy
                        // synchronized).
                        unsafe { memory::device_free(&ctx, ptr) }?;
                    }
                    device = Some((memory::device_alloc(&ctx, len)?, len));
                }
                let host = pinned.as_mut().expect("allocated above");
                let (dptr, _) = device.expect("allocated above");
                ctl.read_exact(&mut host.bytes()[..len])?;
                // SAFETY: `dptr` holds at least `len` bytes of device memory of `ctx`.
                unsafe { memory::copy_to_device(&ctx, dptr, &host.bytes()[..len], stream.as_ref()) }?;
                ctl.write_all(&[1])?;
            }
            OP_COUNTERS if arg == 1 => {
                trace::reset_counters();
                ctl.write_all(&[1])?;
            }
            OP_COUNTERS => {
                let mut out = Vec::with_capacity(8 * trace::Counters::WORDS);
                for w in trace::counters().to_words() {
                    out.extend_from_slice(&w.to_le_bytes());
                }
                ctl.write_all(&out)?;
            }
            OP_TRACE if arg == 1 => {
                trace::enable();
                ctl.write_all(&[1])?;
            }
            OP_TRACE => {
                trace::disable();
                let records = trace::take();
                let mut out = Vec::with_capacity(8 + records.len() * Record::BYTES);
                out.extend_from_slice(&(records.len() as u64).to_le_bytes());
                for r in &records {
                    out.extend_from_slice(&r.to_bytes());
                }
                ctl.write_all(&out)?;
            }
            _ => break,
        }
    }
    if let Some((ptr, _)) = device {
        // SAFETY: as above.
        unsafe { memory::device_free(&ctx, ptr) }?;
    }
    Ok(())
}

fn ctl_path(socket: &Path) -> PathBuf {
    socket.with_extension("ctl")
}

// ---------------------------------------------------------------- producer

struct Consumer {
    child: Child,
    ctl: UnixStream,
    importer: ImporterId,
    /// Whether it asked for the fast release path.
    fast: bool,
}

/// How the producer makes buffers: whole pool allocations, or suballocations from a
/// `PoolResource` over the exporter's pool (adopted by the exporter).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Make {
    Alloc,
    Sub,
}

struct Producer {
    exporter: Exporter,
    sub: Arc<PoolResource<Arc<AsyncResource>>>,
}

impl Producer {
    fn make<'s>(&self, make: Make, size: usize, stream: StreamRef<'s>) -> AnyResult<ExportedBuffer<'s>> {
        match make {
            Make::Alloc => Ok(self.exporter.alloc(size, stream)?),
            Make::Sub => {
                let ptr = self.sub.allocate(size, stream)?;
                let mr = self.sub.clone();
                // SAFETY: the exporter calls this once, after the last holder let go, with the range
                // adopted below (an allocation of `mr` on `stream`).
                let free = move |p: DeviceAddr, n: usize, s: StreamRef<'_>| unsafe { mr.deallocate(p, n, s) };
                // SAFETY: `ptr` is a fresh `size`-byte allocation of `self.sub` on `stream`, used only
                // through the returned buffer; `free` gives exactly it back.
                Ok(unsafe { self.exporter.adopt(ptr, size, stream, free) }?)
            }
        }
    }
}

fn spawn_consumers(
    exporter: &Exporter,
    ctl_listener: &UnixListener,
    socket: &Path,
    count: usize,
    flag: Option<&str>,
    all: &mut Vec<Consumer>,
) -> AnyResult<()> {
    let exe = std::env::current_exe()?;
    for _ in 0..count {
        let mut command = Command::new(&exe);
        command.arg("consumer").arg(socket);
        command.args(flag);
        let child = command.spawn()?;
        let (ctl, _) = ctl_listener.accept()?;
        let pid = mempool_ipc::peer_credentials(&ctl)?.pid;
        let importers = exporter.wait_for_importers(all.len() + 1, WAIT)?;
        let importer = importers
            .iter()
            .find(|i| i.credentials.pid == pid)
            .ok_or("the consumer's importer connection is missing")?
            .id;
        all.push(Consumer {
            child,
            ctl,
            importer,
            fast: flag != Some("--v1"),
        });
    }
    Ok(())
}

fn producer(consumers: usize, diagnose: bool, sub_first: bool) -> AnyResult<()> {
    let dev = Device::get(0)?;
    let ctx = dev.context()?;
    let upstream = Arc::new(AsyncResource::new(
        &dev,
        AsyncOptions {
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
            release_threshold: ReleaseThreshold::KeepAll,
            ..AsyncOptions::default()
        },
    )?);
    let sub = Arc::new(PoolResource::new(
        upstream.clone(),
        &dev,
        PoolOptions {
            initial_size: 1 << 30,
            ..PoolOptions::default()
        },
    )?);
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let socket = dir.join(format!("mempool-handoff-{}.sock", std::process::id()));
    let exporter = Exporter::with_pool_in(
        &socket,
        upstream.clone(),
        AsyncResource::pool,
        ExporterOptions::default(),
    )?;
    let _ = std::fs::remove_file(ctl_path(&socket));
    let ctl_listener = UnixListener::bind(ctl_path(&socket))?;
    // `spawn_consumers` counts the importers connected so far by the length of the list.
    let mut v3 = Vec::new();
    spawn_consumers(&exporter, &ctl_listener, &socket, consumers, None, &mut v3)?;
    spawn_consumers(&exporter, &ctl_listener, &socket, consumers, Some("--v1"), &mut v3)?;
    spawn_consumers(&exporter, &ctl_listener, &socket, consumers, Some("--v2"), &mut v3)?;
    if diagnose {
        // Fast-path consumers that wait for pending ready events, and for their own work before each
        // release, on the host (the diagnosis, and the sustained column `v3 sub host`).
        spawn_consumers(
            &exporter,
            &ctl_listener,
            &socket,
            consumers,
            Some("--host-ready"),
            &mut v3,
        )?;
    }
    let mut host_ready = v3.split_off(3 * consumers);
    let mut v2 = v3.split_off(2 * consumers);
    let mut v1 = v3.split_off(consumers);
    let all_ids = v1.len() + v2.len() + v3.len() + host_ready.len();
    let _ = std::fs::remove_file(ctl_path(&socket));
    let producer = Producer { exporter, sub };

    println!(
        "device: {} ({}), driver CUDA {}",
        dev.name()?,
        dev.uuid()?,
        mempool_core::driver_version()?
    );
    println!("host CPU: {}", host_cpu());
    println!(
        "CUDA MPS: {}",
        match std::env::var("CUDA_MPS_PIPE_DIRECTORY") {
            Ok(dir) => format!("CUDA_MPS_PIPE_DIRECTORY={dir} (the run of scripts/ipc-mps-bench.sh with the daemon)"),
            Err(_) =>
                "CUDA_MPS_PIPE_DIRECTORY not set (the default pipe directory is used if a daemon runs there)".into(),
        }
    );
    println!(
        "({all_ids} consumer processes: {consumers} version-1, {consumers} with the fast release path over the socket (version 2), {consumers} with the shared-memory rings (version 3){})",
        if host_ready.is_empty() {
            String::new()
        } else {
            format!(", {consumers} with the rings waiting for ready and release events on the host (the diagnosis)")
        }
    );
    println!();
    let stream = Stream::new(&ctx)?;
    if diagnose {
        // Before anything else: the sub rows measured first were the slow ones.
        traced_round_trip(
            &producer,
            &mut v3,
            &stream,
            4 * KIB,
            false,
            true,
            "v3 sub",
            "early, before the tables",
        )?;
        println!();
    }
    println!("Round trip, 1 consumer: producer -> consumer -> producer (microseconds per buffer, median / mean)");
    println!("{SPIN_LEGEND}");
    println!("| size | iterations | v1 alloc | v2 sub | v3 alloc | v3 sub | loop spin only | wait spin only | no spin | host copy | v2 sub / v3 sub | host copy / v3 sub (median) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut round_v3_sub = Vec::new();
    for size in [4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB] {
        let iters = (512 * MIB / size).clamp(30, 1000);
        // `--sub-first`: the sub columns are measured before the others of their row, to see whether what
        // the rows before them leave behind (whole-allocation hand-offs to the same consumer) slows them.
        let mut early = None;
        if sub_first {
            early = Some((
                round_trip_ipc(&producer, Make::Sub, &mut v2[0], &stream, size, iters, &mut Probe::Off)?,
                round_trip_ipc(&producer, Make::Sub, &mut v3[0], &stream, size, iters, &mut Probe::Off)?,
            ));
        }
        let old = round_trip_ipc(
            &producer,
            Make::Alloc,
            &mut v1[0],
            &stream,
            size,
            iters,
            &mut Probe::Off,
        )?;
        let alloc = round_trip_ipc(
            &producer,
            Make::Alloc,
            &mut v3[0],
            &stream,
            size,
            iters,
            &mut Probe::Off,
        )?;
        let (sub2, sub3) = match early {
            Some(subs) => subs,
            None => (
                round_trip_ipc(&producer, Make::Sub, &mut v2[0], &stream, size, iters, &mut Probe::Off)?,
                round_trip_ipc(&producer, Make::Sub, &mut v3[0], &stream, size, iters, &mut Probe::Off)?,
            ),
        };
        // `v3 sub` above ran with both spins (the default); the other settings of the spins.
        let mut spins = vec![(Spins::Both, sub3.clone())];
        for which in [Spins::Loop, Spins::Wait, Spins::Neither] {
            let times = with_spins(&producer, which, || {
                round_trip_ipc(&producer, Make::Sub, &mut v3[0], &stream, size, iters, &mut Probe::Off)
            })?;
            spins.push((which, times));
        }
        let copy = round_trip_copy(&producer.exporter, &ctx, &mut v3[0], &stream, size, iters)?;
        let cell = |t: &[f64]| format!("{:.1} / {:.1}", median(t), mean(t));
        let spin_cells: Vec<String> = spins[1..].iter().map(|(_, t)| cell(t)).collect();
        println!(
            "| {} | {iters} | {} | {} | {} | {} | {} | {} | {:.1}x | {:.1}x |",
            human(size),
            cell(&old),
            cell(&sub2),
            cell(&alloc),
            cell(&sub3),
            spin_cells.join(" | "),
            cell(&copy),
            median(&sub2) / median(&sub3),
            median(&copy) / median(&sub3),
        );
        // A kept block's round trip (the target up to 64 KiB): the `v3 sub` columns; beyond, against
        // the host copy, `v3 alloc` too.
        let kept = spins.iter().map(|(w, t)| (w.column(), median(t)));
        let best = if size <= 64 * KIB {
            best_of(kept, f64::min)
        } else {
            best_of(kept.chain([("v3 alloc", median(&alloc))]), f64::min)
        };
        round_v3_sub.push((size, median(&sub3), best, median(&copy)));
    }

    println!();
    println!("Sustained, {consumers} consumers, {WINDOW} buffers in flight per consumer, fresh buffer filled on the GPU each time (buffers per second)");
    println!("{SPIN_LEGEND}");
    println!(
        "| size | buffers | v1 alloc | v2 sub | v3 sub | loop spin only | wait spin only | no spin | v3 sub x{MANY} | v3 sub host | host copy | v3 sub / v2 sub | best v3 / host copy (which) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut sustained_best = Vec::new();
    let mut per_buffer = Vec::new();
    for size in [64 * KIB, MIB, 16 * MIB] {
        let per_consumer = (1024 * MIB / size / consumers).clamp(50, 2000);
        let buffers = (per_consumer * consumers) as f64;
        let old = sustained_ipc(&producer, Make::Alloc, &mut v1, size, per_consumer, false)?;
        let (sub2, c2) = counted(&mut v2, |set| {
            sustained_ipc(&producer, Make::Sub, set, size, per_consumer, false)
        })?;
        let (sub3, c3) = counted(&mut v3, |set| {
            sustained_ipc(&producer, Make::Sub, set, size, per_consumer, false)
        })?;
        // `v3 sub` above ran with both spins (the default); the other settings of the spins.
        let mut spins = vec![(Spins::Both, sub3, c3)];
        for which in [Spins::Loop, Spins::Wait, Spins::Neither] {
            let (rate, c) = counted(&mut v3, |set| {
                with_spins(&producer, which, || {
                    sustained_ipc(&producer, Make::Sub, set, size, per_consumer, false)
                })
            })?;
            spins.push((which, rate, c));
        }
        if size == 64 * KIB {
            per_buffer = vec![("v2 sub", c2, buffers)];
            per_buffer.extend(spins.iter().map(|(w, _, c)| (w.column(), *c, buffers)));
        }
        let many = sustained_ipc(&producer, Make::Sub, &mut v3, size, per_consumer, true)?;
        let host = if host_ready.is_empty() {
            f64::NAN
        } else {
            sustained_ipc(&producer, Make::Sub, &mut host_ready, size, per_consumer, false)?
        };
        let copy = sustained_copy(&producer.exporter, &ctx, &mut v3, size, per_consumer)?;
        let many_name = format!("v3 sub x{MANY}");
        let v3_columns = spins
            .iter()
            .map(|(w, rate, _)| (w.column(), *rate))
            .chain([(many_name.as_str(), many), ("v3 sub host", host)]);
        let (best_name, best) = best_of(v3_columns, f64::max);
        let spin_cells: Vec<String> = spins[1..].iter().map(|(_, rate, _)| format!("{rate:.0}")).collect();
        println!(
            "| {} | {} | {old:.0} | {sub2:.0} | {sub3:.0} | {} | {many:.0} | {host:.0} | {copy:.0} | {:.1}x | {:.1}x ({best_name}) |",
            human(size),
            per_consumer * consumers,
            spin_cells.join(" | "),
            sub3 / sub2,
            best / copy
        );
        sustained_best.push((size, best_name.to_string(), best, copy));
    }
    print_per_buffer(&per_buffer);
    println!();
    println!("Targets (issue 25; one run, baselines above):");
    for (size, sub3, (best_name, best), copy) in &round_v3_sub {
        if *size <= 64 * KIB {
            println!(
                "- round trip of a kept block at {}: best v3 {best:.1} us median ({best_name}; v3 sub {sub3:.1}) (target <= 20 us): {}",
                human(*size),
                verdict(*best <= 20.0)
            );
        } else {
            println!(
                "- round trip at {}: best v3 {best:.1} us ({best_name}; v3 sub {sub3:.1}), host copy {copy:.1} us: {}",
                human(*size),
                verdict(best < copy)
            );
        }
    }
    for (size, best_name, best, copy) in &sustained_best {
        if *size == 64 * KIB {
            println!(
                "- sustained 64 KiB to {consumers} consumers: best v3 {best:.0} buffers/s ({best_name}) (target >= 100,000): {}; {:.2}x the host copy (target >= 1.5x): {}",
                verdict(*best >= 100_000.0),
                best / copy,
                verdict(*best >= 1.5 * copy)
            );
        } else {
            println!(
                "- sustained {}: best v3 {best:.0} buffers/s ({best_name}), host copy {copy:.0}: {}",
                human(*size),
                verdict(*best > *copy)
            );
        }
    }
    if diagnose {
        diagnosis(&producer, &mut v3, &mut v2, &mut host_ready, &stream)?;
    }
    let stats = producer.exporter.stats();
    println!();
    println!(
        "exporter: {} buffers freed, {} blocks kept imported by consumers, {} parked",
        stats.freed_buffers, stats.kept_blocks, stats.parked_buffers
    );

    for c in v1
        .iter_mut()
        .chain(v2.iter_mut())
        .chain(v3.iter_mut())
        .chain(host_ready.iter_mut())
    {
        send_op(&mut c.ctl, OP_EXIT, 0)?;
    }
    let Producer { exporter, sub } = producer;
    let errors = exporter.shutdown();
    if !errors.is_empty() {
        return Err(format!("the exporter met errors: {errors:?}").into());
    }
    drop(sub);
    for mut c in v1.into_iter().chain(v2).chain(v3).chain(host_ready) {
        let status = c.child.wait()?;
        if !status.success() {
            return Err(format!("a consumer failed: {status}").into());
        }
    }
    Ok(())
}

/// What the spin columns mean, printed above each table.
const SPIN_LEGEND: &str = "(v3 sub: both spins, the default; loop spin only: `Exporter::set_wait_spin(0)`, the serving thread \
spins over the rings and `wait_released` parks at once; wait spin only: `Exporter::set_spin(0)`, `wait_released` spins and \
the serving thread sleeps as soon as the rings are empty; no spin: both 0)";

/// Which of the exporter's spins run (`Exporter::set_spin`: the serving thread's over the rings;
/// `Exporter::set_wait_spin`: `wait_released`'s), each at its default or off.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Spins {
    Both,
    Loop,
    Wait,
    Neither,
}

impl Spins {
    /// The column's name in the tables.
    fn column(self) -> &'static str {
        match self {
            Spins::Both => "v3 sub",
            Spins::Loop => "loop spin only",
            Spins::Wait => "wait spin only",
            Spins::Neither => "no spin",
        }
    }
}

/// Runs `f` with the spins `which` names at their defaults and the others off, then puts the
/// settings back as they were.
fn with_spins<T>(producer: &Producer, which: Spins, f: impl FnOnce() -> AnyResult<T>) -> AnyResult<T> {
    let e = &producer.exporter;
    let (spin, wait_spin) = (e.spin(), e.wait_spin());
    let on = |yes: bool, default: Duration| if yes { default } else { Duration::ZERO };
    e.set_spin(on(matches!(which, Spins::Both | Spins::Loop), Exporter::DEFAULT_SPIN));
    e.set_wait_spin(on(
        matches!(which, Spins::Both | Spins::Wait),
        Exporter::DEFAULT_WAIT_SPIN,
    ));
    let result = f();
    e.set_spin(spin);
    e.set_wait_spin(wait_spin);
    result
}

/// The best of `columns` (name, value) by `pick` (`f64::max` for rates, `f64::min` for times),
/// leaving out those not measured (NaN).
fn best_of<'a>(columns: impl IntoIterator<Item = (&'a str, f64)>, pick: fn(f64, f64) -> f64) -> (&'a str, f64) {
    columns
        .into_iter()
        .filter(|(_, v)| v.is_finite())
        .reduce(|a, b| if pick(a.1, b.1) == b.1 && b.1 != a.1 { b } else { a })
        .unwrap_or(("none", f64::NAN))
}

/// Runs `f` over `set` with `mempool_ipc::trace`'s counters zeroed before in this process and in
/// the consumers of `set`; returns its result and the counters of every process added up.
fn counted<T>(
    set: &mut [Consumer],
    f: impl FnOnce(&mut [Consumer]) -> AnyResult<T>,
) -> AnyResult<(T, trace::Counters)> {
    for c in set.iter_mut() {
        send_op(&mut c.ctl, OP_COUNTERS, 1)?;
        ack(&mut c.ctl)?;
    }
    trace::reset_counters();
    let result = f(set)?;
    let mut all = trace::counters();
    for c in set.iter_mut() {
        send_op(&mut c.ctl, OP_COUNTERS, 0)?;
        let mut words = [0u64; trace::Counters::WORDS];
        for w in &mut words {
            let mut bytes = [0u8; 8];
            c.ctl.read_exact(&mut bytes)?;
            *w = u64::from_le_bytes(bytes);
        }
        all = all.add(&trace::Counters::from_words(words));
    }
    Ok((result, all))
}

/// The system calls and wake-ups per buffer of sustained runs (all processes added up).
fn print_per_buffer(rows: &[(&str, trace::Counters, f64)]) {
    if rows.is_empty() {
        return;
    }
    println!();
    println!("Per buffer, sustained 64 KiB (all processes; futex: ring doorbells; bell: RingBell frames; poll: the consumer's socket; loop: the exporter's serving thread; notify / wake: the exporter's waiters)");
    println!(
        "| column | futex wake | futex wait | bell | poll | loop sleeps | loop spin hits | notify | release wake |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, c, n) in rows {
        let w = c.to_words();
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            w[0] as f64 / n,
            w[1] as f64 / n,
            w[2] as f64 / n,
            w[3] as f64 / n,
            w[4] as f64 / n,
            w[5] as f64 / n,
            w[6] as f64 / n,
            w[7] as f64 / n
        );
    }
}

/// What a round trip records besides its times (the diagnosis).
enum Probe {
    Off,
    /// The producer's own points of each buffer on `trace::now_ns`'s clock, whether its stream
    /// was still busy when the release arrived, and whether to synchronize it each round trip.
    On {
        points: Vec<(u64, &'static str, u64)>,
        busy: usize,
        sync: bool,
    },
}

#[allow(clippy::too_many_arguments)]
fn round_trip_ipc(
    producer: &Producer,
    make: Make,
    consumer: &mut Consumer,
    stream: &Stream,
    size: usize,
    iters: usize,
    probe: &mut Probe,
) -> AnyResult<Vec<f64>> {
    let warmup = 10;
    send_op(&mut consumer.ctl, OP_IPC, (iters + warmup) as u64)?;
    let mut times = Vec::with_capacity(iters);
    // Per phase (make, share, wait_released, release), to say where a slow row spends its time.
    let mut phases: [Vec<f64>; 4] = Default::default();
    for i in 0..iters + warmup {
        let n0 = trace::now_ns();
        let t0 = Instant::now();
        let buf = producer.make(make, size, stream.as_ref())?;
        let t1 = Instant::now();
        let n1 = trace::now_ns();
        producer.exporter.share(&buf, &[consumer.importer])?;
        let t2 = Instant::now();
        buf.wait_released(WAIT)?;
        let t3 = Instant::now();
        let n3 = trace::now_ns();
        let id = buf.id().0;
        buf.release()?;
        let n4 = trace::now_ns();
        if let Probe::On { points, busy, sync } = probe {
            if !stream.as_ref().is_idle()? {
                *busy += 1;
            }
            if *sync {
                stream.synchronize()?;
            }
            if i >= warmup {
                points.extend([
                    (id, "producer: make begins", n0),
                    (id, "producer: made", n1),
                    (id, "producer: wait_released returned", n3),
                    (id, "producer: released", n4),
                ]);
            }
        }
        let t4 = Instant::now();
        if i >= warmup {
            times.push((t4 - t0).as_secs_f64() * 1e6);
            for (phase, (a, b)) in phases.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4)]) {
                phase.push((b - a).as_secs_f64() * 1e6);
            }
        }
    }
    ack(&mut consumer.ctl)?;
    let kind = match make {
        Make::Alloc => "alloc",
        Make::Sub => "sub",
    };
    let fast = if consumer.fast { "v2" } else { "v1" };
    eprintln!(
        "  phases {fast} {kind} {}: make {:.1} / {:.1}, share {:.1} / {:.1}, wait_released {:.1} / {:.1}, release {:.1} / {:.1} (µs median / mean)",
        human(size),
        median(&phases[0]),
        mean(&phases[0]),
        median(&phases[1]),
        mean(&phases[1]),
        median(&phases[2]),
        mean(&phases[2]),
        median(&phases[3]),
        mean(&phases[3]),
    );
    Ok(times)
}

fn round_trip_copy(
    exporter: &Exporter,
    ctx: &Arc<Context>,
    consumer: &mut Consumer,
    stream: &Stream,
    size: usize,
    iters: usize,
) -> AnyResult<Vec<f64>> {
    let warmup = 3;
    let mut host = Pinned::new(ctx, size)?;
    let src = exporter.alloc(size, stream.as_ref())?;
    src.fill(0)?; // real GPU work on the buffer before the hand-off
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + warmup {
        let t0 = Instant::now();
        src.copy_to_host(0, host.bytes())?;
        send_op(&mut consumer.ctl, OP_COPY, size as u64)?;
        consumer.ctl.write_all(host.bytes())?;
        ack(&mut consumer.ctl)?;
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    src.release()?;
    Ok(times)
}

/// Buffers per second with one producer thread per consumer. `batched`: each thread shares
/// [`MANY`] buffers at a time with `Exporter::share_many` (up to two batches in flight), and the
/// consumer takes them with `Importer::recv_many`.
fn sustained_ipc(
    producer: &Producer,
    make: Make,
    all: &mut [Consumer],
    size: usize,
    per_consumer: usize,
    batched: bool,
) -> AnyResult<f64> {
    let per_consumer = if batched {
        per_consumer.div_ceil(MANY) * MANY
    } else {
        per_consumer
    };
    for c in all.iter_mut() {
        send_op(
            &mut c.ctl,
            if batched { OP_IPC_MANY } else { OP_IPC },
            per_consumer as u64,
        )?;
    }
    let ctx = producer.exporter.pool().context().clone();
    let t0 = Instant::now();
    std::thread::scope(|scope| -> AnyResult<()> {
        let workers: Vec<_> = all
            .iter()
            .map(|c| {
                let importer = c.importer;
                let ctx = ctx.clone();
                scope.spawn(move || -> AnyResult<()> {
                    let stream = Stream::new(&ctx)?;
                    let mut in_flight = VecDeque::new();
                    if batched {
                        let mut batches: VecDeque<Vec<ExportedBuffer<'_>>> = VecDeque::new();
                        for _ in 0..per_consumer / MANY {
                            let mut batch = Vec::with_capacity(MANY);
                            for _ in 0..MANY {
                                let buf = producer.make(make, size, stream.as_ref())?;
                                buf.fill(0)?; // real GPU work on the buffer before the hand-off
                                batch.push(buf);
                            }
                            let refs: Vec<&ExportedBuffer<'_>> = batch.iter().collect();
                            producer.exporter.share_many(&refs, &[importer])?;
                            batches.push_back(batch);
                            if batches.len() >= 2 {
                                for done in batches.pop_front().expect("two batches in flight") {
                                    done.wait_released(WAIT)?;
                                    done.release()?;
                                }
                            }
                        }
                        for done in batches.into_iter().flatten() {
                            done.wait_released(WAIT)?;
                            done.release()?;
                        }
                        stream.synchronize()?;
                        return Ok(());
                    }
                    for _ in 0..per_consumer {
                        let buf = producer.make(make, size, stream.as_ref())?;
                        buf.fill(0)?; // real GPU work on the buffer before the hand-off
                        producer.exporter.share(&buf, &[importer])?;
                        in_flight.push_back(buf);
                        if in_flight.len() >= WINDOW {
                            let done = in_flight.pop_front().expect("window is full");
                            done.wait_released(WAIT)?;
                            done.release()?;
                        }
                    }
                    for done in in_flight {
                        done.wait_released(WAIT)?;
                        done.release()?;
                    }
                    stream.synchronize()?;
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| "a producer thread panicked")??;
        }
        Ok(())
    })?;
    let elapsed = t0.elapsed().as_secs_f64();
    for c in all.iter_mut() {
        ack(&mut c.ctl)?;
    }
    Ok((per_consumer * all.len()) as f64 / elapsed)
}

/// The baseline: each buffer is filled on the GPU, copied to pinned host memory, sent over the
/// socket, copied to the consumer's device memory and acknowledged; up to WINDOW unacknowledged.
fn sustained_copy(
    exporter: &Exporter,
    ctx: &Arc<Context>,
    all: &mut [Consumer],
    size: usize,
    per_consumer: usize,
) -> AnyResult<f64> {
    let t0 = Instant::now();
    std::thread::scope(|scope| -> AnyResult<()> {
        let workers: Vec<_> = all
            .iter_mut()
            .map(|c| {
                let ctx = ctx.clone();
                scope.spawn(move || -> AnyResult<()> {
                    let stream = Stream::new(&ctx)?;
                    let mut host = Pinned::new(&ctx, size)?;
                    let mut unacked = 0;
                    for _ in 0..per_consumer {
                        let buf = exporter.alloc(size, stream.as_ref())?;
                        buf.fill(0)?; // real GPU work on the buffer before the hand-off
                        buf.copy_to_host(0, host.bytes())?;
                        buf.release()?;
                        send_op(&mut c.ctl, OP_COPY, size as u64)?;
                        c.ctl.write_all(host.bytes())?;
                        unacked += 1;
                        if unacked >= WINDOW {
                            ack(&mut c.ctl)?;
                            unacked -= 1;
                        }
                    }
                    for _ in 0..unacked {
                        ack(&mut c.ctl)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| "a producer thread panicked")??;
        }
        Ok(())
    })?;
    Ok((per_consumer * all.len()) as f64 / t0.elapsed().as_secs_f64())
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

/// The host's CPU model and count (`/proc/cpuinfo`).
fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cpus} CPUs available to this process")
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn human(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

// ---------------------------------------------------------------- diagnosis

/// Turns `mempool_ipc::trace` on in this process and in `consumers`.
fn trace_on(consumers: &mut [Consumer]) -> AnyResult<()> {
    let _ = trace::take();
    trace::enable();
    for c in consumers.iter_mut() {
        send_op(&mut c.ctl, OP_TRACE, 1)?;
        ack(&mut c.ctl)?;
    }
    Ok(())
}

/// Turns the trace off everywhere and returns every record: this process's, then the consumers'.
fn trace_off(consumers: &mut [Consumer]) -> AnyResult<Vec<Record>> {
    trace::disable();
    let mut all = trace::take();
    for c in consumers.iter_mut() {
        send_op(&mut c.ctl, OP_TRACE, 0)?;
        let mut count = [0u8; 8];
        c.ctl.read_exact(&mut count)?;
        for _ in 0..u64::from_le_bytes(count) {
            let mut bytes = [0u8; Record::BYTES];
            c.ctl.read_exact(&mut bytes)?;
            all.push(Record::from_bytes(&bytes).ok_or("a consumer sent a record of an unknown point")?);
        }
    }
    Ok(all)
}

/// The name of a point in the printed steps: which side, and what happened.
fn point_name(point: trace::Point) -> &'static str {
    use trace::Point as P;
    match point {
        P::ImporterFrame => "consumer: Buffer frame read",
        P::ImporterReadyPending => "consumer: ready event pending, GPU wait queued",
        P::ImporterReceived => "consumer: recv returns",
        P::ImporterRelease => "consumer: release begins",
        P::ImporterRecorded => "consumer: release event recorded",
        P::ImporterQueued => "consumer: release queued in batch",
        P::ImporterSendOnPush => "consumer: batch sent (push: idle link or full)",
        P::ImporterSendOnRecv => "consumer: batch sent (recv about to wait)",
        P::ImporterSendOnTimer => "consumer: batch sent (flusher timer)",
        P::ImporterSendOther => "consumer: batch sent (other)",
        P::ImporterSent => "consumer: batch send returned",
        P::ImporterRingWaitBegins => "consumer: ring empty, spin begins",
        P::ImporterRingSleeps => "consumer: asleep on the doorbell",
        P::ImporterRingWoke => "consumer: woke from the doorbell",
        P::ImporterReleasePushed => "consumer: release pushed into the ring",
        P::ImporterBellSent => "consumer: RingBell sent (exporter asleep)",
        P::ExporterShared => "exporter: share queued",
        P::ExporterFrameOut => "exporter: Buffer frame written",
        P::ExporterReleaseRead => "exporter: release read",
        P::ExporterReleasePending => "exporter: release event pending, GPU wait queued",
        P::ExporterReleased => "exporter: release recorded",
        P::ExporterWoke => "exporter: wait_released woke",
        P::ExporterWaitDone => "exporter: wait_released done",
        P::ExporterFreed => "exporter: free queued (or parked)",
        P::ExporterBellRang => "exporter: consumer's doorbell rung (futex wake)",
        P::ExporterLoopWoke => "exporter: loop woke from epoll",
        P::ExporterSpinFound => "exporter: loop's spin found the release",
        // The memory store's points (store_attach prints them).
        P::StoreClientSent
        | P::StoreServerRead
        | P::StoreServerReplied
        | P::StoreServerSent
        | P::StoreClientReply
        | P::StoreClientMapped
        | P::StoreClientDone => "memory store",
    }
}

/// Prints, for every pair of points that follow each other in some buffer's timeline (both
/// processes' records and the producer's own points, ordered by time), how long the step took:
/// median, 90th percentile, mean (µs) and in how many buffers it occurred; the steps in the order
/// of their median start within a buffer's life.
fn print_steps(title: &str, records: &[Record], own: &[(u64, &'static str, u64)]) {
    let mut by_buffer: BTreeMap<u64, Vec<(u64, &'static str)>> = BTreeMap::new();
    for r in records {
        by_buffer
            .entry(r.buffer)
            .or_default()
            .push((r.at_ns, point_name(r.point)));
    }
    for &(id, name, at) in own {
        by_buffer.entry(id).or_default().push((at, name));
    }
    // (from, to) -> (durations, start offsets within the buffer's life), µs.
    type Samples = (Vec<f64>, Vec<f64>);
    type Step<'a> = ((&'a str, &'a str), Samples);
    let mut steps: BTreeMap<(&str, &str), Samples> = BTreeMap::new();
    for timeline in by_buffer.values_mut() {
        timeline.sort_by_key(|&(at, _)| at);
        let start = timeline[0].0;
        for w in timeline.windows(2) {
            let (a, b) = (w[0], w[1]);
            let entry = steps.entry((a.1, b.1)).or_default();
            entry.0.push(b.0.saturating_sub(a.0) as f64 / 1e3);
            entry.1.push(a.0.saturating_sub(start) as f64 / 1e3);
        }
    }
    // Short: only the steps at least a tenth of the buffers took.
    let floor = by_buffer.len().div_ceil(10);
    let mut rows: Vec<Step<'_>> = steps.into_iter().filter(|(_, (d, _))| d.len() >= floor).collect();
    rows.sort_by(|x, y| median(&x.1 .1).total_cmp(&median(&y.1 .1)));
    println!();
    println!(
        "{title} ({} buffers traced; µs; steps taken by fewer than {floor} left out)",
        by_buffer.len()
    );
    println!("| step | count | median | p90 | starts at |");
    println!("|---|---:|---:|---:|---:|");
    for ((a, b), (durations, starts)) in rows {
        println!(
            "| {a} → {b} | {} | {:.1} | {:.1} | {:.1} |",
            durations.len(),
            median(&durations),
            percentile(&durations, 0.9),
            median(&starts)
        );
    }
}

/// One traced round trip of 300 suballocated buffers of `size` with the first consumer of `set`
/// (`path` names it); prints its summary and, with `steps` (and not `sync`), its steps.
#[allow(clippy::too_many_arguments)]
fn traced_round_trip(
    producer: &Producer,
    set: &mut [Consumer],
    stream: &Stream,
    size: usize,
    sync: bool,
    steps: bool,
    path: &str,
    when: &str,
) -> AnyResult<()> {
    let iters = 300;
    let v2 = set;
    trace_on(&mut v2[..1])?;
    let mut probe = Probe::On {
        points: Vec::new(),
        busy: 0,
        sync,
    };
    let times = round_trip_ipc(producer, Make::Sub, &mut v2[0], stream, size, iters, &mut probe)?;
    let dropped = trace::dropped();
    let records = trace_off(&mut v2[..1])?;
    let Probe::On { points, busy, .. } = probe else {
        unreachable!("made above")
    };
    let count = |p: trace::Point| records.iter().filter(|r| r.point == p).count();
    println!();
    println!(
        "traced round trip {path} {} ({when}){}: {:.1} / {:.1} µs median / mean over {iters}; producer stream still \
         busy after the release in {busy} of {} round trips; ready event pending at the consumer {} times, release \
         event pending at the exporter {} times; trace records dropped here: {dropped}",
        human(size),
        if sync {
            ", producer stream synchronized each time"
        } else {
            ""
        },
        median(&times),
        mean(&times),
        iters + 10,
        count(trace::Point::ImporterReadyPending),
        count(trace::Point::ExporterReleasePending),
    );
    if steps && !sync {
        print_steps(
            &format!("Steps of a round trip, {path} {} ({when})", human(size)),
            &records,
            &points,
        );
    }
    Ok(())
}

/// The suballocated paths again after the tables, each with `mempool_ipc::trace` on in the
/// producer and its consumers: the rings (`v3 sub`), the socket (`v2 sub`), and the rings with
/// consumers that wait for pending ready events and for their own work before releasing on the host
/// (`ImporterOptions::wait_ready_on_host`, `release_on_host`). For each: round trips at 4 KiB and
/// 64 KiB untraced, traced, and traced with the producer's stream synchronized each time; sustained
/// at 64 KiB untraced and traced, with the system calls per buffer.
fn diagnosis(
    producer: &Producer,
    v3: &mut [Consumer],
    v2: &mut [Consumer],
    host_ready: &mut [Consumer],
    stream: &Stream,
) -> AnyResult<()> {
    println!();
    println!("Diagnosis (mempool_ipc::trace on in the producer and the consumers)");
    // Step tables (to keep the log short): every one for the rings, the sustained one for the socket,
    // none for the host-waiting set (its summary lines only).
    /// A consumer set, its column name, how it waits, and whether to print the round trips' and the
    /// sustained run's step tables.
    type Set<'a> = (&'a mut [Consumer], &'a str, &'a str, (bool, bool));
    let sets: [Set<'_>; 3] = [
        (
            v3,
            "v3 sub",
            "the rings, ready events waited for on the GPU",
            (true, true),
        ),
        (
            v2,
            "v2 sub",
            "the socket, ready events waited for on the GPU",
            (false, true),
        ),
        (
            host_ready,
            "v3 sub host",
            "the rings, ready and release events waited for on the host",
            (false, false),
        ),
    ];
    for (set, path, how, (round_steps, sustained_steps)) in sets {
        if set.is_empty() {
            continue;
        }
        println!();
        println!("### {path}: {how}");
        for size in [4 * KIB, 64 * KIB] {
            let plain = round_trip_ipc(producer, Make::Sub, &mut set[0], stream, size, 300, &mut Probe::Off)?;
            println!();
            println!(
                "round trip {path} {} after the tables, untraced: {:.1} / {:.1} µs median / mean over 300",
                human(size),
                median(&plain),
                mean(&plain)
            );
            for sync in [false, true] {
                traced_round_trip(producer, set, stream, size, sync, round_steps, path, "after the tables")?;
            }
        }
        let size = 64 * KIB;
        let per_consumer = 1000;
        let (plain, counters) = counted(set, |set| {
            sustained_ipc(producer, Make::Sub, set, size, per_consumer, false)
        })?;
        trace_on(set)?;
        let rate = sustained_ipc(producer, Make::Sub, set, size, per_consumer, false)?;
        let records = trace_off(set)?;
        let count = |p: trace::Point| records.iter().filter(|r| r.point == p).count();
        let n = (per_consumer * set.len()) as f64;
        let w = counters.to_words();
        println!();
        println!(
            "sustained {path} 64 KiB, {} consumers: {plain:.0} buffers/s untraced, {rate:.0} traced; per buffer \
             (untraced run): futex wake {:.2}, futex wait {:.2}, RingBell {:.2}, socket poll {:.2}, loop sleep {:.2}, \
             loop spin hit {:.2}, notify {:.2}, release wake {:.2}; traced run: releases queued {}, sent on push {}, \
             on recv {}, on timer {}; ready events pending {}, release events pending {}",
            set.len(),
            w[0] as f64 / n,
            w[1] as f64 / n,
            w[2] as f64 / n,
            w[3] as f64 / n,
            w[4] as f64 / n,
            w[5] as f64 / n,
            w[6] as f64 / n,
            w[7] as f64 / n,
            count(trace::Point::ImporterQueued),
            count(trace::Point::ImporterSendOnPush),
            count(trace::Point::ImporterSendOnRecv),
            count(trace::Point::ImporterSendOnTimer),
            count(trace::Point::ImporterReadyPending),
            count(trace::Point::ExporterReleasePending),
        );
        if sustained_steps {
            print_steps(&format!("Steps of a buffer, sustained {path} 64 KiB"), &records, &[]);
        }
    }
    Ok(())
}

fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * q).round() as usize]
}
