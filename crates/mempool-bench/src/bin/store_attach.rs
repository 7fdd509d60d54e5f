//! Benchmark: attaching GPU memory held by the memory store (`mempool_store`) after a
//! client restart, against copying the same bytes from pinned host memory in the same run.
//!
//! The program runs the server in its own process, starts a creator process that creates the
//! buffers (one buffer of `--size` bytes, or `--size` split into N buffers), fills them on the GPU,
//! publishes them and exits; then, `--reps` times, a fresh attacher process (the restarted
//! client) that connects, attaches every buffer by name, and waits for its stream (the data is
//! usable from here on). Several buffers are attached two ways, each a row: with
//! `Client::attach_many` (one request per 128 names, one address reservation per request) and
//! with one `Client::attach` per buffer; the table shows the cost per buffer too. With
//! `--grouped`, each layout of several buffers is also made with `Client::create_many` in groups
//! of 125 (each group one physical allocation, which an attacher imports and maps once) and
//! attached the same two ways, in rows of its own next to the separate buffers'. `--trace` prints,
//! under each row, where its last attacher's time went (the memory store's trace points in
//! the attacher and the server, mean microseconds per request between consecutive points).
//! `--phases N` instead times each driver step of attaching N buffers in one process. In the same attacher process, after its attachments are dropped, the
//! baseline: one host-to-device copy of the same number of bytes from pinned host memory
//! (`cuMemcpyHtoDAsync` and a stream synchronize; the pinned and device allocations are not
//! timed). CUDA's initialization is outside both timings.
//!
//! Run on a GPU: `cargo run --release -p mempool-bench --bin store_attach -- [--size 16GiB]
//! [--buffers 1 --buffers 1000] [--reps 3] [--grouped] [--trace]`. Needs `--size` of free device memory twice over
//! (the store's buffers and the copy's destination) and `--size` of pinned host memory. Without a
//! GPU it says why and exits with status 2.

#![deny(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use std::os::fd::AsFd;
use std::sync::Arc;

use mempool_core::{
    memory, Access, AllocationProps, Device, Event, EventFlags, Granularity, HandleTypes, Mapping, PhysicalAllocation,
    Reservation, Stream,
};
use mempool_ipc::trace::{self, Point, Record};
use mempool_store::{Client, CreateOptions, Server, ServerConfig};

/// Attach after a client restart, against a copy from pinned host memory.
#[derive(Parser, Debug)]
#[command(name = "store_attach")]
struct Args {
    /// Bytes in all (e.g. 16GiB, 512MiB).
    #[arg(long, default_value = "16GiB", value_parser = parse_bytes)]
    size: u64,
    /// How many buffers the bytes are split into; repeat for several rows. Default: 1 and 1000.
    #[arg(long = "buffers")]
    buffers: Vec<usize>,
    /// Attacher processes per row (each a fresh process).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Instead of the table: time each driver step of attaching this many buffers of
    /// `--size / N` bytes, in this one process (create, export, duplicate a descriptor, import,
    /// reserve, map, grant access, unmap, interprocess events), to see which step bounds an attach.
    #[arg(long)]
    phases: Option<usize>,
    /// With `--phases`: also time the import and the map + access grant split over this many
    /// threads (each a run of the buffers, one access grant per run).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print where an attach's time goes (client and server points of `mempool_ipc::trace`,
    /// mean microseconds per request between consecutive points) under each row.
    #[arg(long)]
    trace: bool,
    /// Also make each layout of several buffers as groups of 125 members
    /// (`Client::create_many`: one physical allocation per group) and add rows for attaching
    /// those (the creator process, internally: create the buffers that way).
    #[arg(long)]
    grouped: bool,
    /// (internal) The part this process plays: creator or attacher.
    #[arg(long, hide = true)]
    role: Option<String>,
    /// (internal) The server's socket.
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    /// (internal) Bytes per buffer.
    #[arg(long, hide = true)]
    per: Option<u64>,
    /// (internal) Attach with one `attach_many` instead of one `attach` per buffer.
    #[arg(long, hide = true)]
    many: bool,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a number of bytes"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown unit {other:?} (B, KiB, MiB, GiB)")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

fn name(count: usize, i: usize) -> String {
    format!("bench/{count}/{i}")
}

/// Members per group with `--grouped` (1,000 buffers: 8 groups).
const GROUP: usize = 125;

/// Creates `count` buffers of `per` bytes (each alone in its allocation, or, if `grouped`, in
/// groups of [`GROUP`] made with `create_many`), fills buffer `i` with the u32 `i + 1`,
/// publishes them.
#[allow(unsafe_code)] // device fills of its own buffers; each block says why it holds
fn creator(socket: &Path, count: usize, per: u64, grouped: bool) -> Fallible<()> {
    let device = Device::get(0)?;
    let ctx = device.context()?;
    let stream = Stream::new(&ctx)?;
    let client = Client::connect(socket)?;
    let options = CreateOptions::new().tag("bench");
    let chunk = if grouped { GROUP } else { 1 };
    let indices: Vec<usize> = (0..count).collect();
    for group in indices.chunks(chunk) {
        let created = if grouped {
            let members: Vec<(String, usize)> = group.iter().map(|&i| (name(count, i), per as usize)).collect();
            client.create_many(&members, device, &options)?
        } else {
            vec![client.create(&name(count, group[0]), per as usize, device, &options)?]
        };
        for (&i, created) in group.iter().zip(&created) {
            // SAFETY: 1. `created` maps `per` bytes (a multiple of 4) at `ptr` read-write for the
            // device until it is released below, after a synchronize of the context.
            #[allow(unsafe_code)]
            unsafe { memory::fill_u32_async(&ctx, created.ptr(), i as u32 + 1, created.len() / 4, stream.as_ref()) }?;
        }
        // Published once all are written: a member is attachable once its whole group is.
        let published = created
            .into_iter()
            .map(|c| c.publish(stream.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        for p in published {
            p.release()?;
        }
    }
    println!("PUBLISHED");
    Ok(())
}

/// Attaches every buffer (timed; with one `attach_many` if `many`, else one `attach` each),
/// checks their first words, then copies as many bytes from pinned host memory (timed). Prints
/// `RESULT <attach seconds> <copy seconds>`.
#[allow(unsafe_code)] // reads of attached buffers and pinned host memory; each block says why it holds
fn attacher(socket: &Path, count: usize, per: u64, many: bool, traced: bool) -> Fallible<()> {
    let device = Device::get(0)?;
    let ctx = device.context()?;
    let stream = Stream::new(&ctx)?;
    let total = per as usize * count;

    if traced {
        trace::enable();
    }
    let start = Instant::now();
    let client = Client::connect(socket)?;
    let attached = if many {
        let names: Vec<String> = (0..count).map(|i| name(count, i)).collect();
        client.attach_many(&names, stream.as_ref())?
    } else {
        let mut attached = Vec::with_capacity(count);
        for i in 0..count {
            attached.push(client.attach(&name(count, i), stream.as_ref())?);
        }
        attached
    };
    stream.synchronize()?;
    let attach = start.elapsed();
    if traced {
        trace::disable();
        for r in trace::take() {
            println!("TRACE {} {}", r.point.code(), r.at_ns);
        }
    }
    for i in [0, count - 1] {
        let mut word = [0u8; 4];
        // SAFETY: 1. buffer `i` maps at least 4 readable bytes until `attached` is dropped below.
        #[allow(unsafe_code)]
        unsafe { memory::copy_to_host(&ctx, &mut word, attached[i].ptr(), stream.as_ref()) }?;
        let got = u32::from_le_bytes(word);
        if got != i as u32 + 1 {
            return Err(format!("buffer {i} starts with {got}, expected {}", i + 1).into());
        }
    }
    drop(attached);
    drop(client);

    let host = memory::pinned_host_alloc(&ctx, total)?;
    // SAFETY: `host` is a fresh pinned allocation of `total` bytes that nothing else uses.
    #[allow(unsafe_code)]
    unsafe {
        std::ptr::write_bytes(host, 0x5a, total)
    };
    // SAFETY: `host..host+total` is that allocation, initialized just above, and lives until freed
    // below; nothing writes it meanwhile.
    #[allow(unsafe_code)]
    let src = unsafe { std::slice::from_raw_parts(host, total) };
    let dst = memory::device_alloc(&ctx, total)?;
    let start = Instant::now();
    // SAFETY: 1. `dst` is `total` bytes of device memory of `ctx`, written only by this copy.
    #[allow(unsafe_code)]
    unsafe { memory::copy_to_device(&ctx, dst, src, stream.as_ref()) }?;
    let copy = start.elapsed();
    // SAFETY: 1. `dst` came from `device_alloc` in `ctx` and the copy (synchronized) is its last use.
    #[allow(unsafe_code)]
    unsafe { memory::device_free(&ctx, dst) }?;
    // SAFETY: `host` came from `pinned_host_alloc` in `ctx`; `src` (its last use) is not used again.
    #[allow(unsafe_code)]
    unsafe { memory::pinned_host_free(&ctx, host) }?;
    println!("RESULT {} {}", attach.as_secs_f64(), copy.as_secs_f64());
    Ok(())
}

/// What an attacher process printed: its attach and copy times, and its trace records.
type ChildResult = (Option<(f64, f64)>, Vec<Record>);

fn run_child(
    role: &str,
    socket: &Path,
    count: usize,
    per: u64,
    many: bool,
    traced: bool,
    grouped: bool,
) -> Fallible<ChildResult> {
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["--role", role, "--socket"]).arg(socket).args([
        "--buffers",
        &count.to_string(),
        "--per",
        &per.to_string(),
    ]);
    if many {
        command.arg("--many");
    }
    if traced {
        command.arg("--trace");
    }
    if grouped {
        command.arg("--grouped");
    }
    let mut child = command.stdout(Stdio::piped()).spawn()?;
    let mut result = None;
    let mut records = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        if let Some(rest) = line.strip_prefix("TRACE ") {
            let mut it = rest.split_whitespace().map(str::parse::<u64>);
            if let (Some(Ok(code)), Some(Ok(at_ns))) = (it.next(), it.next()) {
                if let Some(point) = u8::try_from(code).ok().and_then(Point::from_code) {
                    records.push(Record {
                        point,
                        buffer: 0,
                        at_ns,
                    });
                }
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("RESULT ") {
            let mut it = rest.split_whitespace().map(str::parse::<f64>);
            match (it.next(), it.next()) {
                (Some(Ok(a)), Some(Ok(c))) => result = Some((a, c)),
                _ => return Err(format!("a malformed result line {line:?}").into()),
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the {role} process failed: {status}").into());
    }
    Ok((result, records))
}

fn point_name(p: Point) -> &'static str {
    match p {
        Point::StoreClientSent => "client sent",
        Point::StoreServerRead => "server read",
        Point::StoreServerReplied => "server replied",
        Point::StoreServerSent => "server sent",
        Point::StoreClientReply => "client reply",
        Point::StoreClientMapped => "client mapped",
        Point::StoreClientDone => "client done",
        _ => "other",
    }
}

/// The attacher's and the server's records on one timeline: mean microseconds per request from
/// each point to the next (the first request, the handshake's, left out).
fn print_trace(mut records: Vec<Record>) {
    records.retain(|r| r.point.code() >= Point::StoreClientSent.code());
    records.sort_by_key(|r| r.at_ns);
    let mut steps: Vec<((Point, Point), u64, u64)> = Vec::new();
    for w in records.windows(2) {
        let key = (w[0].point, w[1].point);
        let d = w[1].at_ns.saturating_sub(w[0].at_ns);
        match steps.iter_mut().find(|(k, _, _)| *k == key) {
            Some((_, n, total)) => {
                *n += 1;
                *total += d;
            }
            None => steps.push((key, 1, d)),
        }
    }
    for ((a, b), n, total) in steps {
        println!(
            "    {:>15} -> {:<15} {:>6} times {:>10.1} us mean",
            point_name(a),
            point_name(b),
            n,
            total as f64 / n as f64 / 1e3
        );
    }
}

fn host_cpu() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: f64) -> String {
    format!("{:.2} ms", d * 1e3)
}

fn main_process(args: &Args) -> Fallible<()> {
    let rows = if args.buffers.is_empty() {
        vec![1, 1000]
    } else {
        args.buffers.clone()
    };
    if args.reps == 0 || rows.contains(&0) {
        return Err("--reps and --buffers must be at least 1".into());
    }
    let device = Device::get(0)?;
    let socket = std::env::temp_dir().join(format!("store-attach-{}.sock", std::process::id()));
    let server = Server::serve(ServerConfig::new(&socket).devices([0]))?;
    let admin = Client::connect(&socket)?;
    let granularity = admin.devices()[0].1;
    println!("store_attach: attach after a client restart vs a copy from pinned host memory");
    println!(
        "device: {} ({}), host CPU: {}, {} attacher processes per row, median shown",
        device.name()?,
        device.uuid()?,
        host_cpu(),
        args.reps
    );
    println!("command: {}", std::env::args().collect::<Vec<_>>().join(" "));
    println!();
    println!(
        "{:<46} {:>11} {:>14} {:>13} {:>14} {:>11} {:>15}",
        "layout", "bytes", "attach", "per buffer", "copy", "copy GB/s", "attach speedup"
    );
    for &count in &rows {
        let per = (args.size / count as u64) / granularity * granularity;
        if per == 0 {
            return Err(format!(
                "{} split into {count} buffers is less than the granularity, {granularity} bytes",
                human(args.size)
            )
            .into());
        }
        // Separate buffers; with --grouped, then the same layout in groups.
        let layouts: &[bool] = if args.grouped && count > 1 {
            &[false, true]
        } else {
            &[false]
        };
        for &grouped in layouts {
            run_child("creator", &socket, count, per, false, false, grouped)?;
            row(args, &socket, count, per, grouped)?;
            for i in 0..count {
                admin.delete(&name(count, i))?;
            }
            // The next layout reuses the names: wait until these buffers' memory is released.
            let deadline = Instant::now() + Duration::from_secs(30);
            while server.stats().buffers > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    drop(admin);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.stats().buffers > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    server.shutdown();
    Ok(())
}

/// The rows of one layout: `count` buffers of `per` bytes, published (grouped or not); one
/// buffer: one attach; several: attach_many, then one attach per buffer.
fn row(args: &Args, socket: &Path, count: usize, per: u64, grouped: bool) -> Fallible<()> {
    let ways: &[(bool, &str)] = if count == 1 {
        &[(false, "")]
    } else if grouped {
        &[(true, ", grouped, attach_many"), (false, ", grouped, attach each")]
    } else {
        &[(true, ", attach_many"), (false, ", attach each")]
    };
    for &(many, how) in ways {
        let mut attach = Vec::new();
        let mut copy = Vec::new();
        let mut records = Vec::new();
        for rep in 0..args.reps {
            // The last attacher of a row is traced, if asked (the others are not slowed).
            let traced = args.trace && rep + 1 == args.reps;
            if traced {
                trace::enable();
            }
            let (result, child) = run_child("attacher", socket, count, per, many, traced, false)?;
            if traced {
                trace::disable();
                records = trace::take();
                records.extend(child);
            }
            let (a, c) = result.ok_or("the attacher printed no result")?;
            attach.push(a);
            copy.push(c);
        }
        let total = per * count as u64;
        let (a, c) = (median(attach), median(copy));
        println!(
            "{:<46} {:>11} {:>14} {:>13} {:>14} {:>11.1} {:>14.1}x",
            format!("{count} x {}{how}", human(per)),
            human(total),
            ms(a),
            format!("{:.1} us", a / count as f64 * 1e6),
            ms(c),
            total as f64 / c / 1e9,
            c / a
        );
        if args.trace {
            print_trace(records);
        }
    }
    Ok(())
}

/// `--phases N`: each driver step of an attach of N buffers, timed over all N (one process: the
/// import is of this process's own export, which the driver allows for POSIX descriptors).
fn phases(total: u64, count: usize, threads: usize) -> Fallible<()> {
    if count == 0 {
        return Err("--phases needs at least 1 buffer".into());
    }
    let device = Device::get(0)?;
    let ctx = device.context()?;
    let props = AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let granularity = device.vmm_granularity(&props, Granularity::Minimum)? as u64;
    let per = (total / count as u64) / granularity * granularity;
    if per == 0 {
        return Err(format!("{} bytes split {count} ways is under the granularity", total).into());
    }
    let per = per as usize;
    println!(
        "store_attach --phases: {count} x {} on {} (host CPU: {})",
        human(per as u64),
        device.name()?,
        host_cpu()
    );
    let step = |what: &str, t: Duration, n: usize| {
        println!(
            "{what:<44} {:>10.2} ms {:>9.2} us each",
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() * 1e6 / n as f64
        );
    };
    let t = Instant::now();
    let allocations: Vec<PhysicalAllocation> = (0..count)
        .map(|_| PhysicalAllocation::new(&props, per))
        .collect::<Result<_, _>>()?;
    step("cuMemCreate", t.elapsed(), count);
    let t = Instant::now();
    let fds: Vec<std::os::fd::OwnedFd> = allocations.iter().map(|a| a.export_fd()).collect::<Result<_, _>>()?;
    step("cuMemExportToShareableHandle", t.elapsed(), count);
    let t = Instant::now();
    let dups: Vec<std::os::fd::OwnedFd> = fds.iter().map(|f| f.try_clone()).collect::<Result<_, _>>()?;
    step("dup of an exported descriptor", t.elapsed(), count);
    drop(dups);
    let t = Instant::now();
    let imported: Vec<Arc<PhysicalAllocation>> = fds
        .iter()
        .map(|f| PhysicalAllocation::import_fd(f.as_fd(), per).map(Arc::new))
        .collect::<Result<_, _>>()?;
    step("cuMemImportFromShareableHandle", t.elapsed(), count);
    if threads > 1 {
        let per_thread = count.div_ceil(threads);
        let t = Instant::now();
        let again: Vec<Arc<PhysicalAllocation>> = std::thread::scope(|scope| {
            let handles: Vec<_> = fds
                .chunks(per_thread)
                .map(|c| {
                    scope.spawn(move || {
                        c.iter()
                            .map(|f| PhysicalAllocation::import_fd(f.as_fd(), per).map(Arc::new))
                            .collect::<Result<Vec<_>, _>>()
                    })
                })
                .collect();
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.join().expect("no panic")?);
            }
            Ok::<_, mempool_core::Error>(all)
        })?;
        step(
            &format!("cuMemImportFromShareableHandle, {threads} threads"),
            t.elapsed(),
            count,
        );
        let reservation = Reservation::new(device, per * count, 0, None)?;
        let t = Instant::now();
        let mappings = std::thread::scope(|scope| {
            let handles: Vec<_> = again
                .chunks(per_thread)
                .enumerate()
                .map(|(k, c)| {
                    let reservation = &reservation;
                    scope.spawn(move || {
                        let base = k * per_thread * per;
                        let mut out = Vec::with_capacity(c.len());
                        for (i, p) in c.iter().enumerate() {
                            out.push(Mapping::without_access(reservation, base + i * per, p.clone())?);
                        }
                        reservation.set_access(base, c.len() * per, &[(device, Access::ReadWrite)])?;
                        Ok::<_, mempool_core::Error>(out)
                    })
                })
                .collect();
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.join().expect("no panic")?);
            }
            Ok::<_, mempool_core::Error>(all)
        })?;
        step(
            &format!("cuMemMap + cuMemSetAccess, {threads} threads"),
            t.elapsed(),
            count,
        );
        let t = Instant::now();
        drop(mappings);
        drop(reservation);
        drop(again);
        step("unmap + release of those", t.elapsed(), count);
    }
    drop(fds);
    for chunk in [count, 128.min(count)] {
        let t = Instant::now();
        let reservations: Vec<Arc<Reservation>> = imported
            .chunks(chunk)
            .map(|c| Reservation::new(device, per * c.len(), 0, None))
            .collect::<Result<_, _>>()?;
        step(&format!("cuMemAddressReserve (per {chunk})"), t.elapsed(), count);
        let t = Instant::now();
        let mut mappings = Vec::with_capacity(count);
        for (r, c) in reservations.iter().zip(imported.chunks(chunk)) {
            for (i, p) in c.iter().enumerate() {
                mappings.push(Mapping::without_access(r, i * per, p.clone())?);
            }
        }
        step(&format!("cuMemMap (per {chunk})"), t.elapsed(), count);
        let t = Instant::now();
        for (r, c) in reservations.iter().zip(imported.chunks(chunk)) {
            r.set_access(0, per * c.len(), &[(device, Access::ReadWrite)])?;
        }
        step(&format!("cuMemSetAccess, one per {chunk}"), t.elapsed(), count);
        let t = Instant::now();
        drop(mappings);
        drop(reservations);
        step(&format!("cuMemUnmap + address free (per {chunk})"), t.elapsed(), count);
    }
    let t = Instant::now();
    let mut mappings = Vec::with_capacity(count);
    for p in &imported {
        let r = Reservation::new(device, per, 0, None)?;
        let m = Mapping::without_access(&r, 0, p.clone())?;
        m.set_access(&[(device, Access::ReadWrite)])?;
        mappings.push(m);
    }
    step("reserve + map + access, each its own", t.elapsed(), count);
    drop(mappings);
    let t = Instant::now();
    let events: Vec<Event> = (0..count)
        .map(|_| Event::new(&ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS))
        .collect::<Result<_, _>>()?;
    step("interprocess event create", t.elapsed(), count);
    let t = Instant::now();
    for e in &events {
        e.ipc_handle()?;
    }
    step("cuIpcGetEventHandle", t.elapsed(), count);
    let t = Instant::now();
    for e in &events {
        e.is_complete()?;
    }
    step("cuEventQuery", t.elapsed(), count);
    drop(imported);
    let t = Instant::now();
    drop(allocations);
    step("cuMemRelease (the creator's handles)", t.elapsed(), count);
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(missing) = mempool_core::require_gpus(1) {
        return missing.exit("store_attach");
    }
    let result = match (args.role.as_deref(), &args.socket, args.per, args.buffers.first()) {
        (None, _, _, _) if args.phases.is_some() => phases(args.size, args.phases.unwrap_or(1), args.threads.max(1)),
        (None, _, _, _) => main_process(&args),
        (Some("creator"), Some(socket), Some(per), Some(&count)) => creator(socket, count, per, args.grouped),
        (Some("attacher"), Some(socket), Some(per), Some(&count)) => {
            attacher(socket, count, per, args.many, args.trace)
        }
        (Some(role), ..) => Err(format!("unknown role {role:?} or missing --socket/--per/--buffers").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("store_attach: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("16GiB"), Ok(16 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert!(parse_bytes("16GB").is_err());
        let args =
            Args::try_parse_from(["store_attach", "--size", "1GiB", "--buffers", "1", "--buffers", "10"]).unwrap();
        assert_eq!((args.size, args.buffers, args.reps), (1 << 30, vec![1, 10], 3));
    }
}
