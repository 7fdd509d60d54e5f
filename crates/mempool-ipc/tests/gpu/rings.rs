//! The shared-memory rings (protocol version 3): batches of buffers through the rings with bytes
//! and ordering checked, every pairing of protocol versions, and an importer killed in the middle
//! of a batch.

use crate::harness::*;

/// Kernels queued on each buffer by each side before it lets go: enough that the other side's
/// work is still pending when the buffer (or its release) arrives.
const ADDS: u32 = 40;
/// Each buffer's values start at a multiple of this; the adds stay below it.
const STEP: u32 = 1000;

/// An exportable upstream with a `PoolResource` of one 64 MiB chunk over it, and an exporter of it.
fn suballocating_exporter(tag: &str) -> (Arc<AsyncResource>, Arc<PoolResource<Arc<AsyncResource>>>, Exporter) {
    let (dev, _) = gpu();
    let upstream = Arc::new(
        AsyncResource::new(
            &dev,
            AsyncOptions {
                handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
                release_threshold: ReleaseThreshold::KeepAll,
                ..AsyncOptions::default()
            },
        )
        .unwrap(),
    );
    let options = PoolOptions {
        initial_size: 64 * MIB as u64,
        ..PoolOptions::default()
    };
    let sub = Arc::new(PoolResource::new(upstream.clone(), &dev, options).unwrap());
    let exporter = Exporter::with_pool_in(
        socket_path(tag),
        upstream.clone(),
        AsyncResource::pool,
        ExporterOptions::default(),
    )
    .unwrap();
    (upstream, sub, exporter)
}

fn adopt_from<'s>(
    exporter: &Exporter,
    sub: &Arc<PoolResource<Arc<AsyncResource>>>,
    len: usize,
    stream: StreamRef<'s>,
) -> mempool_ipc::ExportedBuffer<'s> {
    let ptr = sub.allocate(len, stream).unwrap();
    let mr = sub.clone();
    // SAFETY: the exporter calls this once, after the last holder let go, with the range adopted below.
    let free = move |p: DeviceAddr, n: usize, s: StreamRef<'_>| unsafe { mr.deallocate(p, n, s) };
    // SAFETY: `ptr` is a fresh `len`-byte allocation of `sub` on `stream`, used only through the returned
    // buffer; `free` gives exactly it back.
    unsafe { exporter.adopt(ptr, len, stream, free) }.unwrap()
}

/// Checks that `got` is `base, base + 1, ...` for a `base` that is a multiple of [`STEP`] plus
/// `plus`; returns the multiple.
fn check_step(got: &[u32], plus: u32, what: &str) -> u32 {
    let first = got[0];
    assert_eq!(
        first % STEP,
        plus,
        "{what}: the first value {first} is not a multiple of {STEP} plus {plus}"
    );
    assert_iota(got, first, what);
    first - plus
}

const BATCHES: usize = 4;
const PER_BATCH: usize = 8;
const BATCH_LEN: usize = MIB;

#[test]
fn batches_through_the_rings_arrive_complete_and_ordered_both_ways() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(
            importer.fast_release() && importer.rings(),
            "the default importer uses the rings"
        );
        let mut got = 0;
        let mut batches = 0;
        while got < BATCHES * PER_BATCH {
            let bufs = importer
                .recv_many(stream.as_ref(), PER_BATCH, Some(WAIT))
                .expect("buffers");
            batches += 1;
            for buf in &bufs {
                // Read on the receiving stream: ordered after the exporter's kernels by its ready event.
                check_step(
                    &shared_u32s(buf),
                    ADDS,
                    "the importer sees every kernel queued before the share",
                );
                for _ in 0..ADDS {
                    // SAFETY: the buffer holds len / 4 u32s, ordered on `stream`.
                    unsafe { kernels.add(buf.ptr(), buf.len() / 4, 1, stream.as_ref()) }.unwrap();
                }
            }
            got += bufs.len();
            // Released while the kernels run: ordered by the release event, through the ring.
            drop(bufs);
        }
        println!("FINDING: {got} buffers arrived in {batches} calls of recv_many");
        tell_parent("DONE");
        hear_parent("BYE");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("ring-batches");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = BATCH_LEN / 4;
    // An anchor keeps the chunk's block alive, so suballocated buffers are freed, not parked.
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let mut all = Vec::new();
    for b in 0..BATCHES {
        let mut batch = Vec::new();
        for k in 0..PER_BATCH {
            let index = (b * PER_BATCH + k) as u32;
            // Half suballocated (a kept block: `ReleaseBatch` with the release event), half whole
            // allocations (the import is freed: a plain `Release`).
            let buf = if k % 2 == 0 {
                adopt_from(&exporter, &sub, BATCH_LEN, stream.as_ref())
            } else {
                exporter.alloc(BATCH_LEN, stream.as_ref()).unwrap()
            };
            // SAFETY: the buffer holds n u32s on `stream`.
            unsafe { kernels.iota(buf.ptr(), n, (index + 1) * STEP, stream.as_ref()) }.unwrap();
            for _ in 0..ADDS {
                // SAFETY: as above.
                unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
            }
            batch.push(buf);
        }
        let refs: Vec<&mempool_ipc::ExportedBuffer<'_>> = batch.iter().collect();
        exporter.share_many(&refs, &[id]).unwrap();
        all.extend(batch);
    }
    child.expect("DONE");
    let mut bases = Vec::new();
    for buf in &all {
        buf.wait_released(WAIT).unwrap();
        // SAFETY: the buffer is live (held here) and holds n u32s; the importer's kernels are ordered
        // before work on its stream after `wait_released`.
        let got = unsafe { read_u32s(&ctx, buf.ptr(), n, stream.as_ref()) };
        bases.push(check_step(
            &got,
            2 * ADDS,
            "after wait_released the exporter sees every kernel the importer queued before its release",
        ));
    }
    let want: Vec<u32> = (1..=(BATCHES * PER_BATCH) as u32).map(|i| i * STEP).collect();
    assert_eq!(bases, want, "every buffer, with its own bytes");
    drop(all);
    child.say("BYE");
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.live_buffers,
            stats.reclaimed_buffers,
            stats.abandoned_buffers,
            stats.peer_errors
        ),
        (0, 0, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

const PAIR_LEN: usize = 4 * MIB;

/// The importer of the pairing test: `v1` (no fast release), `v2` (fast release, no rings), `v3`
/// (the default) and `v3-unoffered` (the default, against an exporter that offers no rings).
fn pairing_child(role: &str) {
    let options = match role {
        "v1" => ImporterOptions {
            fast_release: false,
            ..ImporterOptions::default()
        },
        "v2" => ImporterOptions {
            rings: false,
            ..ImporterOptions::default()
        },
        _ => ImporterOptions::default(),
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    let want = match role {
        "v1" => (false, false),
        "v2" | "v3-unoffered" => (true, false),
        _ => (true, true),
    };
    assert_eq!((importer.fast_release(), importer.rings()), want, "{role}");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
    check_step(&shared_u32s(&buf), ADDS, role);
    for _ in 0..ADDS {
        // SAFETY: the buffer holds len / 4 u32s, ordered on `stream`.
        unsafe { kernels.add(buf.ptr(), buf.len() / 4, 1, stream.as_ref()) }.unwrap();
    }
    drop(buf);
    importer.flush_releases().unwrap();
    drop(importer);
    no_drop_errors(role);
}

#[test]
fn every_pairing_of_protocol_versions_hands_buffers_over() {
    let test = this_test!();
    if let Some(role) = role() {
        return pairing_child(&role);
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = PAIR_LEN / 4;
    for (i, (offer, role)) in [(true, "v1"), (true, "v2"), (true, "v3"), (false, "v3-unoffered")]
        .into_iter()
        .enumerate()
    {
        let pool = Arc::new(exportable_pool(&dev));
        let options = ExporterOptions {
            rings: offer.then(mempool_ipc::ring::Geometry::default),
            ..ExporterOptions::default()
        };
        let exporter = Exporter::with_shared_pool(socket_path(&format!("pair-{role}")), pool.clone(), options).unwrap();
        let child = ChildProc::spawn(test, role, exporter.path());
        let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
        let buf = exporter.alloc(PAIR_LEN, stream.as_ref()).unwrap();
        let base = (i as u32 + 1) * STEP;
        // SAFETY: the buffer holds n u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), n, base, stream.as_ref()) }.unwrap();
        for _ in 0..ADDS {
            // SAFETY: as above.
            unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
        }
        exporter.share(&buf, &[id]).unwrap();
        buf.wait_released(WAIT).unwrap();
        // SAFETY: the buffer is live (held here) and holds n u32s; the importer's kernels are ordered
        // before work on its stream after `wait_released`.
        let got = unsafe { read_u32s(&ctx, buf.ptr(), n, stream.as_ref()) };
        assert_eq!(check_step(&got, 2 * ADDS, role), base, "{role}");
        drop(buf);
        child.succeeds();
        wait_no_importers(&exporter);
        exporter.wait_idle(WAIT).unwrap();
        assert_eq!(exporter.stats().peer_errors, 0, "{role}");
        assert!(exporter.shutdown().is_empty(), "{role}");
        wait_used(&pool, &ctx, 0);
    }
    no_drop_errors("exporter");
}

const KILL_BATCH: usize = 16;
const KILL_LEN: usize = 4 * MIB;

#[test]
fn an_importer_killed_in_the_middle_of_a_batch_leaves_the_exporter_at_its_baseline() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.rings());
        // Part of the batch only: the rest stays in the ring or on its way.
        let bufs = importer
            .recv_many(stream.as_ref(), KILL_BATCH / 4, Some(WAIT))
            .expect("buffers");
        let mut told = false;
        loop {
            for buf in &bufs {
                // SAFETY: each buffer holds len / 4 u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), buf.len() / 4, 1, stream.as_ref()) }.unwrap();
            }
            if !told {
                tell_parent("HOLDING");
                told = true;
            }
        }
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    let baseline = pool.usage().unwrap().used_current;
    let sock = socket_path("ring-kill");
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), ExporterOptions::default()).unwrap();
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let batch: Vec<_> = (0..KILL_BATCH)
        .map(|k| {
            let buf = exporter.alloc(KILL_LEN, stream.as_ref()).unwrap();
            // SAFETY: the buffer holds KILL_LEN / 4 u32s on `stream`.
            unsafe { kernels.iota(buf.ptr(), KILL_LEN / 4, k as u32, stream.as_ref()) }.unwrap();
            buf
        })
        .collect();
    let refs: Vec<&mempool_ipc::ExportedBuffer<'_>> = batch.iter().collect();
    exporter.share_many(&refs, &[id]).unwrap();
    drop(refs);
    // The exporter lets go at once: only the importer holds the buffers now.
    drop(batch);
    child.expect("HOLDING");
    assert_eq!(exporter.stats().live_buffers, KILL_BATCH);
    assert!(pool.usage().unwrap().used_current >= baseline + (KILL_BATCH * KILL_LEN) as u64);

    child.kill();
    exporter.wait_idle(WAIT).expect("the dead importer's buffers are freed");
    let stats = exporter.stats();
    println!("FINDING: after the kill: {stats:?}");
    assert_eq!(
        (
            stats.importers,
            stats.live_buffers,
            stats.freed_buffers,
            stats.abandoned_buffers
        ),
        (0, 0, KILL_BATCH as u64, 0),
        "{stats:?}"
    );
    // At least the buffers it received (the rest were in its ring or on their way).
    assert!(stats.reclaimed_buffers >= 1, "{stats:?}");
    wait_used(&pool, &ctx, baseline);
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

/// The waiting test's phases: (`Exporter::set_spin`, `Exporter::set_wait_spin`), both on (the
/// defaults), each alone, neither.
const SPIN_PHASES: [(Duration, Duration); 4] = [
    (Exporter::DEFAULT_SPIN, Exporter::DEFAULT_WAIT_SPIN),
    (Exporter::DEFAULT_SPIN, Duration::ZERO),
    (Duration::ZERO, Exporter::DEFAULT_WAIT_SPIN),
    (Duration::ZERO, Duration::ZERO),
];

/// Threads of the waiting test, buffers each shares (one at a time) per phase, and their size.
const WAITERS: usize = 4;
const PER_WAITER: usize = 40;
const WAITER_LEN: usize = 64 << 10;

#[test]
fn threads_waiting_for_their_own_buffers_are_each_woken_by_its_release_with_and_without_each_spin() {
    let test = this_test!();
    let total = SPIN_PHASES.len() * WAITERS * PER_WAITER;
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.rings(), "the default importer uses the rings");
        for _ in 0..total {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            check_step(
                &shared_u32s(&buf),
                ADDS,
                "the importer sees every kernel queued before the share",
            );
            for _ in 0..ADDS {
                // SAFETY: the buffer holds len / 4 u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), buf.len() / 4, 1, stream.as_ref()) }.unwrap();
            }
            // Released while the kernels run: ordered by the release event.
            drop(buf);
        }
        tell_parent("DONE");
        hear_parent("BYE");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("ring-waiters");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let stream = Stream::new(&ctx).unwrap();
    // An anchor keeps the chunk's block alive, so suballocated buffers are freed, not parked.
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let n = WAITER_LEN / 4;
    for (phase, (spin, wait_spin)) in SPIN_PHASES.into_iter().enumerate() {
        exporter.set_spin(spin);
        exporter.set_wait_spin(wait_spin);
        // Each setting is its own: neither moves the other.
        assert_eq!((exporter.spin(), exporter.wait_spin()), (spin, wait_spin));
        mempool_ipc::trace::reset_counters();
        std::thread::scope(|scope| {
            for t in 0..WAITERS {
                let (exporter, sub, ctx) = (&exporter, &sub, ctx.clone());
                scope.spawn(move || {
                    let stream = Stream::new(&ctx).unwrap();
                    let kernels = CheckKernels::load(&ctx).unwrap();
                    for i in 0..PER_WAITER {
                        let index = ((phase * WAITERS + t) * PER_WAITER + i) as u32;
                        let buf = adopt_from(exporter, sub, WAITER_LEN, stream.as_ref());
                        // SAFETY: the buffer holds n u32s on `stream`.
                        unsafe { kernels.iota(buf.ptr(), n, (index + 1) * STEP, stream.as_ref()) }.unwrap();
                        for _ in 0..ADDS {
                            // SAFETY: as above.
                            unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
                        }
                        exporter.share(&buf, &[id]).unwrap();
                        // Every other thread waits for a buffer of its own meanwhile: this one
                        // must be woken for this buffer's release, whoever else is released.
                        buf.wait_released(WAIT).unwrap();
                        assert!(buf.holders().is_empty(), "wait_released returned with a holder left");
                        // SAFETY: the buffer is live (held here) and holds n u32s; the importer's
                        // kernels are ordered before work on `stream` after `wait_released`.
                        let got = unsafe { read_u32s(&ctx, buf.ptr(), n, stream.as_ref()) };
                        let base = check_step(
                            &got,
                            2 * ADDS,
                            "after wait_released the exporter sees every kernel the importer queued",
                        );
                        assert_eq!(base, (index + 1) * STEP, "thread {t}, buffer {i}: its own bytes");
                        drop(buf);
                    }
                    stream.synchronize().unwrap();
                });
            }
        });
        let c = mempool_ipc::trace::counters();
        let per = |v: u64| v as f64 / (WAITERS * PER_WAITER) as f64;
        println!(
            "FINDING: spin {spin:?}, wait spin {wait_spin:?}: per buffer, in the exporter's process: release wakes {:.2}, notifies {:.2}, \
             loop sleeps {:.2}, loop spin hits {:.2}, futex wakes {:.2}",
            per(c.release_wakes),
            per(c.notifies),
            per(c.loop_sleeps),
            per(c.loop_spin_hits),
            per(c.futex_wakes)
        );
    }
    child.expect("DONE");
    child.say("BYE");
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.live_buffers,
            stats.reclaimed_buffers,
            stats.abandoned_buffers,
            stats.peer_errors
        ),
        (0, 0, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}
