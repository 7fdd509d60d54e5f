//! `mempool-store-server`: runs a memory store (`mempool_store::Server`) until SIGTERM or SIGINT.
//! `docs/memory-store.md` is the guide.
//!
//! ```text
//! mempool-store-server --socket /run/user/1000/mempool.sock --device 0 --device 1 \
//!     --uid-bytes 64GiB --total-bytes 120GiB --allow-uid 1001 --ttl 3600
//! ```

#![deny(unsafe_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use mempool_store::{Limits, Quotas, Server, ServerConfig};

/// Serve named GPU buffers that outlive the processes that made them.
#[derive(Parser, Debug)]
#[command(name = "mempool-store-server", version)]
struct Args {
    /// The Unix socket to listen on (a stale socket file there is replaced; a live one is not).
    #[arg(long, short = 's')]
    socket: std::path::PathBuf,
    /// A GPU to serve (ordinal as this process sees it); repeat for several. Default: 0.
    #[arg(long = "device", short = 'd')]
    devices: Vec<usize>,
    /// Bytes one uid may hold (e.g. 64GiB, 512MiB, 1000000).
    #[arg(long, value_parser = parse_bytes)]
    uid_bytes: Option<u64>,
    /// Buffers one uid may hold.
    #[arg(long)]
    uid_buffers: Option<u64>,
    /// Bytes all buffers together may hold.
    #[arg(long, value_parser = parse_bytes)]
    total_bytes: Option<u64>,
    /// Buffers all together.
    #[arg(long)]
    total_buffers: Option<u64>,
    /// Another uid allowed to connect (besides this process's own); repeat for several. Widen
    /// --mode too.
    #[arg(long = "allow-uid")]
    allow_uids: Vec<u32>,
    /// The socket file's permission bits, in octal.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    mode: u32,
    /// Default time-to-live of buffers created without one, in seconds (none: until deleted).
    #[arg(long)]
    ttl: Option<u64>,
    /// Open connections at most.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// Open connections of one uid at most.
    #[arg(long, default_value_t = Limits::default().max_connections_per_uid)]
    max_connections_per_uid: usize,
    /// Ended connections of one uid whose processes still run (and so still hold their
    /// attachments) at most; past it, that uid's new connections are turned away.
    #[arg(long, default_value_t = Limits::default().max_ended_connections_per_uid)]
    max_ended_connections_per_uid: usize,
    /// Attachments one connection may hold at once.
    #[arg(long, default_value_t = Limits::default().max_attachments_per_connection)]
    max_attachments_per_connection: usize,
    /// How long a connection that holds nothing and sends nothing is kept (a duration: 300,
    /// 300s, 5m, 1500ms; a bare number is seconds). Default: 300 s.
    #[arg(long, value_parser = parse_duration)]
    idle_timeout: Option<Duration>,
    /// How long after connecting a client's Hello must have arrived. Default: 5 s.
    #[arg(long, value_parser = parse_duration)]
    handshake_timeout: Option<Duration>,
    /// How long a frame may take to arrive once its first byte did (slowloris). Default: 5 s.
    #[arg(long, value_parser = parse_duration)]
    frame_timeout: Option<Duration>,
    /// How long writing a reply may take (a client that does not read is dropped). Default: 5 s.
    #[arg(long, value_parser = parse_duration)]
    write_timeout: Option<Duration>,
}

/// A duration: a number with a unit (`ms`, `s`, `m`, `h`), or a bare number of seconds. Zero is
/// refused: every time limit must let something through.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 300, 300s, 5m, 1500ms)"))?;
    let d = match unit.trim() {
        "ms" => Some(Duration::from_millis(n)),
        "" | "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        other => return Err(format!("unknown unit {other:?} in {s:?} (ms, s, m, h)")),
    }
    .ok_or_else(|| format!("{s:?} overflows"))?;
    if d.is_zero() {
        return Err(format!("{s:?}: a time limit must be longer than zero"));
    }
    Ok(d)
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a number of bytes"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        "TiB" | "T" => 1 << 40,
        other => return Err(format!("unknown unit {other:?} (B, KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| m & !0o777 == 0)
        .ok_or_else(|| format!("{s:?} is not an octal mode of permission bits (e.g. 600, 660)"))
}

/// Raises this process's soft limit of open files to the hard limit: the server keeps one
/// exported descriptor per buffer (up to a quarter of the soft limit) to answer attaches with a
/// `dup` instead of a driver export, and one descriptor per connection.
fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            eprintln!("mempool-store-server: cannot raise the open-file limit ({e}); keeping the current one");
        }
    }
}

/// Writes a line to standard output, ignoring a closed or broken output: whoever started the
/// server may have stopped reading it, and that must not make the server fail.
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
}

fn main() -> ExitCode {
    let args = Args::parse();
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(signal, stop.clone()) {
            eprintln!("mempool-store-server: cannot handle signal {signal}: {e}");
            return ExitCode::FAILURE;
        }
    }
    raise_open_file_limit();
    let devices = if args.devices.is_empty() {
        vec![0]
    } else {
        args.devices.clone()
    };
    let defaults = Limits::default();
    let config = ServerConfig::new(&args.socket)
        .devices(devices.clone())
        .quotas(Quotas {
            per_uid_bytes: args.uid_bytes,
            per_uid_buffers: args.uid_buffers,
            total_bytes: args.total_bytes,
            total_buffers: args.total_buffers,
        })
        .allow_uids(args.allow_uids.clone())
        .socket_mode(args.mode)
        .default_ttl(args.ttl.map(Duration::from_secs))
        .limits(Limits {
            max_connections: args.max_connections,
            max_connections_per_uid: args.max_connections_per_uid,
            max_ended_connections_per_uid: args.max_ended_connections_per_uid,
            max_attachments_per_connection: args.max_attachments_per_connection,
            idle_timeout: args.idle_timeout.unwrap_or(defaults.idle_timeout),
            handshake_timeout: args.handshake_timeout.unwrap_or(defaults.handshake_timeout),
            frame_timeout: args.frame_timeout.unwrap_or(defaults.frame_timeout),
            write_timeout: args.write_timeout.unwrap_or(defaults.write_timeout),
        });
    let server = match Server::serve(config) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("mempool-store-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    say(format_args!(
        "mempool-store-server: listening on {} (pid {}, devices {devices:?})",
        server.path().display(),
        std::process::id()
    ));
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = server.stats();
    server.shutdown();
    say(format_args!(
        "mempool-store-server: stopped ({} buffers, {} bytes released; {} freed before)",
        stats.buffers, stats.bytes, stats.freed
    ));
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_and_modes_parse() {
        assert_eq!(parse_bytes("64GiB"), Ok(64 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("1PiB").is_err());
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert!(parse_mode("1777").is_err());
        assert!(parse_mode("9").is_err());
        assert_eq!(parse_duration("300"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("0s").unwrap_err().contains("longer than zero"));
        assert!(parse_duration("2d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("99999999999999999999h").is_err());
    }

    #[test]
    fn flags_parse() {
        let args = Args::try_parse_from([
            "mempool-store-server",
            "--socket",
            "/tmp/s",
            "-d",
            "0",
            "-d",
            "1",
            "--uid-bytes",
            "1GiB",
            "--allow-uid",
            "7",
            "--ttl",
            "60",
        ])
        .unwrap();
        assert_eq!(args.devices, [0, 1]);
        assert_eq!(args.uid_bytes, Some(1 << 30));
        assert_eq!(args.allow_uids, [7]);
        assert_eq!(args.mode, 0o600);
        assert_eq!((args.idle_timeout, args.frame_timeout), (None, None));
        let args = Args::try_parse_from([
            "mempool-store-server",
            "--socket",
            "/tmp/s",
            "--idle-timeout",
            "3",
            "--handshake-timeout",
            "1s",
            "--frame-timeout",
            "500ms",
            "--write-timeout",
            "2s",
        ])
        .unwrap();
        assert_eq!(
            (
                args.idle_timeout,
                args.handshake_timeout,
                args.frame_timeout,
                args.write_timeout
            ),
            (
                Some(Duration::from_secs(3)),
                Some(Duration::from_secs(1)),
                Some(Duration::from_millis(500)),
                Some(Duration::from_secs(2))
            )
        );
        assert!(Args::try_parse_from(["mempool-store-server", "--socket", "/tmp/s", "--frame-timeout", "0"]).is_err());
        assert!(
            Args::try_parse_from(["mempool-store-server"]).is_err(),
            "the socket is required"
        );
    }
}
