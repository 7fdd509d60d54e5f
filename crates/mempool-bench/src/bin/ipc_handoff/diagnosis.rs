//! The diagnosis (skipped with `--no-trace`): the suballocated paths again with `mempool_ipc::trace`
//! on in the producer and its consumers, and each step of a buffer's way with its median.

use std::collections::BTreeMap;
use std::io::Read;

use mempool_ipc::trace::{self, Record};

use crate::control::{ack, send_op, OP_TRACE};
use crate::error::AnyResult;
use crate::measure::{counted, round_trip_ipc, sustained_ipc, Probe};
use crate::producer::{Consumer, Make, Producer};
use crate::stats::{human, mean, median, percentile, KIB};
use mempool_core::Stream;

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
pub(crate) fn traced_round_trip(
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
pub(crate) fn diagnosis(
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
