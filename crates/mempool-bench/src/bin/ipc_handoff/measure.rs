//! One measurement: a round trip or a sustained run, through mempool-ipc or through the host
//! (the baseline), and the system calls counted over a run.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use mempool_core::{Context, Stream};
use mempool_ipc::trace;
use mempool_ipc::{ExportedBuffer, Exporter};

use crate::control::{ack, send_op, OP_COPY, OP_COUNTERS, OP_IPC, OP_IPC_MANY, WAIT};
use crate::error::AnyResult;
use crate::pinned::Pinned;
use crate::producer::{Consumer, Make, Producer};
use crate::stats::{human, mean, median};

/// Buffers in flight per consumer in the sustained runs.
pub(crate) const WINDOW: usize = 4;
/// Buffers per `share_many` in the batched sustained column.
pub(crate) const MANY: usize = 8;

/// Runs `f` over `set` with `mempool_ipc::trace`'s counters zeroed before in this process and in
/// the consumers of `set`; returns its result and the counters of every process added up.
pub(crate) fn counted<T>(
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

/// What a round trip records besides its times (the diagnosis).
pub(crate) enum Probe {
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
pub(crate) fn round_trip_ipc(
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

pub(crate) fn round_trip_copy(
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
pub(crate) fn sustained_ipc(
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
pub(crate) fn sustained_copy(
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
