//! A long-running exporter, and the consumer to go with it: the place to start for a service
//! that shares GPU buffers with whoever connects, and a server that stays up for fault tests.
//!
//! ```text
//! ipc_serve [SOCKET] [--every-ms N] [--kib N] [--max-importers N]      serve
//! ipc_serve consume SOCKET [--count N]                                consume
//! ```
//!
//! Serving: every `--every-ms` (default 100) it fills a fresh buffer of `--kib` KiB (default
//! 1024) on the GPU with consecutive numbers and shares it with every importer connected then.
//! It prints its state (importers, handshakes in flight, buffers, queued messages, refusals...)
//! on `SIGUSR1` or when a line is typed on its standard input, and serves until `SIGINT` or
//! `SIGTERM`; then it says `Goodbye` to everyone, waits for their releases, checks that every
//! buffer was freed and that the socket file is gone, and exits 0. The socket defaults to
//! `$XDG_RUNTIME_DIR/mempool-ipc-serve.sock` (the temp dir without it).
//!
//! Consuming: connects, checks every buffer it receives (consecutive numbers from the first),
//! releases it, and exits 0 after `--count` buffers or when the server says `Goodbye`.
//!
//! Without a GPU it says why and exits with status 2, like every example.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mempool::core::kernels::{u32s, CheckKernels};
use mempool::core::{Device, HandleTypes, MemPool, PoolProps, Stream};
use mempool::ipc::{Error, Exporter, ExporterOptions, ExporterStats, Importer, ImporterOptions};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Buffers the server lets live at once: a consumer that holds what it gets does not make it
/// allocate without end; sharing pauses instead.
const MAX_LIVE: usize = 256;

fn main() -> ExitCode {
    if let Err(missing) = mempool::core::require_gpus(1) {
        return missing.exit("ipc_serve");
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("consume") => consume(&args[1..]),
        _ => serve(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc_serve: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--name VALUE` among `args`, parsed; `default` without it.
fn option<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> AnyResult<T> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let value = args.get(i + 1).ok_or_else(|| format!("{name} needs a value"))?;
            value
                .parse()
                .map_err(|_| format!("{name}: not a number: {value}").into())
        }
    }
}

/// The first argument that is neither an option nor an option's value.
fn positional(args: &[String]) -> Option<PathBuf> {
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        if a.starts_with("--") {
            skip = true;
            continue;
        }
        return Some(PathBuf::from(a));
    }
    None
}

fn default_socket() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map_or_else(std::env::temp_dir, PathBuf::from)
        .join("mempool-ipc-serve.sock")
}

fn serve(args: &[String]) -> AnyResult<()> {
    let socket = positional(args).unwrap_or_else(default_socket);
    let every = Duration::from_millis(option(args, "--every-ms", 100)?);
    let bytes = option::<usize>(args, "--kib", 1024)? * 1024;
    let max_importers = option(args, "--max-importers", ExporterOptions::default().max_importers)?;
    if bytes == 0 {
        return Err("--kib must be at least 1".into());
    }

    // SIGINT and SIGTERM end the service; SIGUSR1, or a line on stdin, asks for the state.
    let stop = Arc::new(AtomicBool::new(false));
    let report = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, report.clone())?;
    {
        let report = report.clone();
        std::thread::spawn(move || {
            for _ in std::io::stdin().lock().lines().map_while(Result::ok) {
                report.store(true, Ordering::Release);
            }
        });
    }

    let dev = Device::get(0)?;
    let ctx = dev.context()?;
    let pool = Arc::new(MemPool::new(
        &dev,
        &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR),
    )?);
    let baseline = pool.usage()?.used_current;
    let options = ExporterOptions {
        max_importers,
        ..ExporterOptions::default()
    };
    let exporter = Exporter::with_shared_pool(&socket, pool.clone(), options)?;
    let kernels = CheckKernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    println!(
        "ipc_serve: serving {} ({}) on {}: a {} KiB buffer every {:?} to every importer; pid {}: \
         SIGUSR1 or a line on stdin prints the state, SIGINT or SIGTERM stops",
        dev,
        dev.name()?,
        socket.display(),
        bytes / 1024,
        every,
        std::process::id()
    );

    let started = Instant::now();
    let mut seq: u32 = 0;
    let mut shared = 0u64;
    let mut paused = false;
    let mut next = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if report.swap(false, Ordering::AcqRel) {
            print_state(&exporter.stats(), shared, started.elapsed());
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        next = now + every;
        let importers: Vec<_> = exporter.importers().iter().map(|i| i.id).collect();
        if importers.is_empty() {
            continue;
        }
        let live = exporter.stats().live_buffers;
        if live >= MAX_LIVE {
            if !std::mem::replace(&mut paused, true) {
                println!("ipc_serve: {live} buffers are held by importers: sharing pauses until they release some");
            }
            continue;
        }
        paused = false;
        let buf = exporter.alloc(bytes, stream.as_ref())?;
        let base = seq.wrapping_mul(1_000_003);
        // SAFETY: the buffer holds bytes / 4 u32s, ordered on `stream`.
        unsafe { kernels.iota(buf.ptr(), bytes / 4, base, stream.as_ref()) }?;
        match exporter.share(&buf, &importers) {
            Ok(()) => {}
            // One importer does not read (it is cut off): the others got it; say so and go on.
            Err(e @ Error::Share { .. }) => println!("ipc_serve: {e}"),
            // One left since the list was taken: nothing was sent; share with those there now.
            Err(Error::UnknownImporter { .. }) => {
                if let Err(e) = exporter.share_with_all(&buf) {
                    println!("ipc_serve: {e}");
                }
            }
            Err(e) => return Err(e.into()),
        }
        shared += 1;
        seq = seq.wrapping_add(1);
        // The server's own release: the buffer is freed once every importer released it.
        drop(buf);
    }

    println!("ipc_serve: stopping: Goodbye to every importer");
    let stats_before = exporter.stats();
    let errors = exporter.shutdown();
    for e in &errors {
        println!("ipc_serve: met while serving: {e}");
    }
    stream.synchronize()?;
    ctx.synchronize()?;
    let used = pool.usage()?.used_current;
    let gone = !socket.exists();
    println!(
        "ipc_serve: shared {shared} buffers with up to {} importers; {} bytes of the pool in use after the \
         shutdown (baseline {baseline}); socket file removed: {gone}",
        stats_before.importers, used
    );
    if used != baseline {
        return Err(format!(
            "{} bytes of the pool are still in use after the shutdown",
            used - baseline
        )
        .into());
    }
    if !gone {
        return Err(format!("the socket file {} is still there", socket.display()).into());
    }
    Ok(())
}

fn print_state(s: &ExporterStats, shared: u64, up: Duration) {
    println!(
        "ipc_serve: up {:.1} s, shared {shared} buffers | importers {} (handshakes in flight {}, awaited to exit {}) \
         | live buffers {} (deferred {}), blocks {}, queued messages {} | freed {}, reclaimed {}, abandoned {} \
         | refused {}, evicted {}, stalled {}, timed out {}, accept pauses {}",
        up.as_secs_f64(),
        s.importers,
        s.handshakes,
        s.awaiting_exit,
        s.live_buffers,
        s.deferred_buffers,
        s.blocks,
        s.queued_messages,
        s.freed_buffers,
        s.reclaimed_buffers,
        s.abandoned_buffers,
        s.refused_connections,
        s.evicted_handshakes,
        s.stalled_importers,
        s.timed_out_connections,
        s.accept_pauses,
    );
}

fn consume(args: &[String]) -> AnyResult<()> {
    let socket = positional(args).unwrap_or_else(default_socket);
    let count = option(args, "--count", u64::MAX)?;
    let importer = Importer::connect(&socket, ImporterOptions::default())?;
    let stream = Stream::new(&importer.device().context()?)?;
    println!(
        "ipc_serve consume: connected to {} (pool {})",
        socket.display(),
        importer.pool_id()
    );
    let mut host = Vec::new();
    let mut received = 0u64;
    while received < count {
        let buf = match importer.recv(stream.as_ref()) {
            Ok(buf) => buf,
            Err(Error::ExporterGone { how }) => {
                println!("ipc_serve consume: the server {how}");
                break;
            }
            Err(e) => return Err(e.into()),
        };
        host.resize(buf.len(), 0);
        buf.copy_to_host(0, &mut host)?;
        let values = u32s(&host);
        let first = values.first().copied().unwrap_or(0);
        if let Some((i, v)) = values
            .iter()
            .enumerate()
            .find(|&(i, &v)| v != first.wrapping_add(i as u32))
        {
            return Err(format!(
                "buffer {}: element {i} is {v}, expected {}",
                buf.id(),
                first.wrapping_add(i as u32)
            )
            .into());
        }
        drop(buf); // frees the import (whole allocations are not kept) and tells the server, ordered after the copy
        received += 1;
    }
    println!("ipc_serve consume: {received} buffers received and checked");
    Ok(())
}
