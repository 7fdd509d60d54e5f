//! The fast release path: reuse ordered by the importer's event, ready events, kept imports.

use crate::harness::*;

/// An exportable upstream and a `PoolResource` over it with one 64 MiB chunk, and an exporter of it.
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

/// Allocates `len` bytes from `sub` on `stream` and hands them to the exporter.
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

const ORDER_LEN: usize = 16 * MIB;
const ORDER_ADDS: u32 = 400;

#[test]
fn fast_release_orders_the_exporters_reads_and_reuse_after_the_importers_last_kernel() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.fast_release());
        for round in ["RELEASED", "RELEASED-AGAIN"] {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            // Hundreds of kernels still queued when the buffer is released: the release must not
            // wait for them, and the exporter must not touch the memory before they are done.
            for _ in 0..ORDER_ADDS {
                // SAFETY: the buffer holds ORDER_LEN / 4 u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), ORDER_LEN / 4, 1, stream.as_ref()) }.unwrap();
            }
            drop(buf);
            importer.flush_releases().unwrap();
            tell_parent(round);
        }
        hear_parent("DONE");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("order");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    // An anchor keeps the block live, so the buffer below is freed (not parked) when let go.
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[id]).unwrap();
    child.expect("RELEASED");
    buf.wait_released(WAIT).unwrap();
    assert_iota(
        // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
        // or synchronized) or ordered before the copy on its stream.
        &unsafe { read_u32s(&ctx, buf.ptr(), n, stream.as_ref()) },
        ORDER_ADDS,
        "after wait_released, work on the buffer's stream sees every kernel the importer queued before its release",
    );

    drop(buf);

    // Reuse: the exporter lets go at once, the importer releases while its kernels still run, the
    // exporter frees the buffer (ordered after the importer's event) and the memory is allocated
    // again on the exporter's stream and overwritten at once. Had the free not waited for the
    // importer's kernels, they would add to what the exporter writes.
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[id]).unwrap();
    let second = buf.ptr();
    drop(buf);
    child.expect("RELEASED-AGAIN");
    let deadline = Instant::now() + WAIT;
    while exporter.stats().freed_buffers < 2 {
        assert!(
            Instant::now() < deadline,
            "the second buffer was never freed: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let again = sub.allocate(ORDER_LEN, stream.as_ref()).unwrap();
    println!(
        "FINDING: the freed buffer's memory was handed out again at the same address: {}",
        again == second
    );
    // SAFETY: `again` is this test's ORDER_LEN allocation of `sub`, on `stream`.
    unsafe { kernels.iota(again, n, 5, stream.as_ref()) }.unwrap();
    assert_iota(
        // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
        // or synchronized) or ordered before the copy on its stream.
        &unsafe { read_u32s(&ctx, again, n, stream.as_ref()) },
        5,
        "memory reused after the importer's release",
    );
    // SAFETY: allocated above on `stream`, freed once.
    unsafe { sub.deallocate(again, ORDER_LEN, stream.as_ref()) }.unwrap();
    child.say("DONE");
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (stats.kept_blocks, stats.parked_buffers, stats.freed_buffers),
        (0, 0, 3),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

/// The importer's side of the ready-event tests: receives one buffer whose exporter still has
/// ORDER_ADDS kernels queued on it, and checks it sees the last one. With `on_host` the exporter's
/// work is done when `recv` returns, so the buffer is read on a stream of its own that nothing
/// orders; otherwise on the receiving stream, which waits on the exporter's event.
fn ready_child(on_host: bool) {
    let options = ImporterOptions {
        wait_ready_on_host: on_host,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    hear_parent("QUEUED");
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
    let n = buf.len() / 4;
    let got = if on_host {
        let unordered = Stream::new(&ctx).unwrap();
        // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
        // or synchronized) or ordered before the copy on its stream.
        unsafe { read_u32s(&ctx, buf.ptr(), n, unordered.as_ref()) }
    } else {
        shared_u32s(&buf)
    };
    assert_iota(
        &got,
        ORDER_ADDS,
        "the importer sees every kernel the exporter queued before the share",
    );
    drop(buf);
    importer.flush_releases().unwrap();
    drop(importer);
    no_drop_errors("importer");
}

fn ready_parent(test: &str, child_role: &str) {
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter(&format!("ready-{child_role}"));
    let mut child = ChildProc::spawn(test, child_role, exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    for _ in 0..ORDER_ADDS {
        // SAFETY: as above.
        unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
    }
    exporter.share(&buf, &[id]).unwrap();
    child.say("QUEUED");
    buf.wait_released(WAIT).unwrap();
    drop(buf);
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

#[test]
fn a_pending_ready_event_orders_the_importers_stream_after_the_exporters_kernels() {
    let test = this_test!();
    if role().is_some() {
        return ready_child(false);
    }
    ready_parent(test, "importer");
}

#[test]
fn wait_ready_on_host_returns_from_recv_after_the_exporters_kernels() {
    let test = this_test!();
    if role().is_some() {
        return ready_child(true);
    }
    ready_parent(test, "importer-host-ready");
}

/// `ImporterOptions::release_on_host`: the importer queues ORDER_ADDS kernels on a buffer and drops it;
/// when the exporter hears the release, those kernels are done, so the exporter reads the buffer on a
/// stream nothing orders and sees every one of them.
#[test]
fn release_on_host_finishes_the_importers_kernels_before_the_exporter_hears_the_release() {
    let test = this_test!();
    if role().is_some() {
        let options = ImporterOptions {
            release_on_host: true,
            ..ImporterOptions::default()
        };
        let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
        assert!(importer.fast_release());
        let ctx = importer.device().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let kernels = CheckKernels::load(&ctx).unwrap();
        let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
        let n = buf.len() / 4;
        for _ in 0..ORDER_ADDS {
            // SAFETY: the buffer holds n u32s, ordered on `stream` (recv's stream).
            unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
        }
        drop(buf);
        importer.flush_releases().unwrap();
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("rel-host");
    let child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    exporter.share(&buf, &[id]).unwrap();
    buf.wait_released(WAIT).unwrap();
    let unordered = Stream::new(&ctx).unwrap();
    // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
    // or synchronized) or ordered before the copy on its stream.
    let got = unsafe { read_u32s(&ctx, buf.ptr(), n, unordered.as_ref()) };
    assert_iota(
        &got,
        ORDER_ADDS,
        "after the release, the exporter sees every kernel the importer queued before dropping the buffer",
    );
    drop(buf);
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

const KEPT_COUNT: usize = 8;

#[test]
fn a_consumer_killed_with_kept_imports_keeps_the_block_allocated_until_its_process_is_gone() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.fast_release());
        for _ in 0..KEPT_COUNT {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            // SAFETY: the buffer holds 1024 u32s, ordered on `stream`.
            unsafe { kernels.add(buf.ptr(), 1024, 1, stream.as_ref()) }.unwrap();
        }
        importer.flush_releases().unwrap();
        assert_eq!(
            importer.kept_blocks(),
            1,
            "the block stays imported with no buffer held"
        );
        tell_parent("KEEPING");
        // Wait to be killed, with the block still imported.
        hear_parent("NEVER");
        unreachable!("the parent kills this process");
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("kept-kill");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let stream = Stream::new(&ctx).unwrap();
    for _ in 0..KEPT_COUNT {
        let buf = adopt_from(&exporter, &sub, 4096, stream.as_ref());
        buf.fill(0).unwrap();
        exporter.share(&buf, &[id]).unwrap();
        // Only the importer holds it now.
    }
    child.expect("KEEPING");
    let deadline = Instant::now() + WAIT;
    // A release ends the lease first, and the deferred free (or the parking) follows once the
    // importer's release event is seen complete: wait for both.
    while exporter.stats().live_buffers > 0 || exporter.stats().deferred_buffers > 0 {
        assert!(Instant::now() < deadline, "releases never came: {:?}", exporter.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = exporter.stats();
    // Every buffer was released, but the block's last one is parked: the importer keeps the block
    // imported, so its allocation must not go back to the driver.
    assert_eq!(
        (
            stats.kept_blocks,
            stats.parked_buffers,
            stats.freed_buffers,
            stats.blocks
        ),
        (1, 1, KEPT_COUNT as u64 - 1, 1),
        "{stats:?}"
    );
    child.kill();
    let deadline = Instant::now() + WAIT;
    while exporter.stats().parked_buffers > 0 {
        assert!(
            Instant::now() < deadline,
            "the parked buffer was never freed: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.kept_blocks,
            stats.parked_buffers,
            stats.freed_buffers,
            stats.blocks,
            stats.importers
        ),
        (0, 0, KEPT_COUNT as u64, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}
