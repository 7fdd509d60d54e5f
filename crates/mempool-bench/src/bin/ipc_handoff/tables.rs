//! The producer's run: starts the consumers, prints the round-trip and sustained tables against the
//! host copy, the targets, and the diagnosis, then shuts everything down.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use mempool_core::{Device, HandleTypes, Stream};
use mempool_ipc::trace;
use mempool_ipc::{Exporter, ExporterOptions};
use mempool_rmm::suballoc::PoolOptions;
use mempool_rmm::{AsyncOptions, AsyncResource, PoolResource, ReleaseThreshold};

use crate::control::{ctl_path, send_op, OP_EXIT};
use crate::diagnosis::{diagnosis, traced_round_trip};
use crate::error::AnyResult;
use crate::measure::{counted, round_trip_copy, round_trip_ipc, sustained_copy, sustained_ipc, Probe, MANY, WINDOW};
use crate::producer::{spawn_consumers, with_spins, Make, Producer, Spins};
use crate::stats::{best_of, human, mean, median, KIB, MIB};

pub(crate) fn run(consumers: usize, diagnose: bool, sub_first: bool) -> AnyResult<()> {
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
