//! Many buffers in flight, two importers, frees deferred until both released.

use crate::harness::*;

const MANY: usize = 64;
const MANY_LEN: usize = 256 << 10;

#[test]
fn many_buffers_in_flight_with_two_importers_are_freed_only_after_both_release() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, _kernels) = connect();
        let mut bufs = Vec::new();
        for k in 0..MANY {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            assert_iota(&shared_u32s(&buf), (k * 1_000_000) as u32, "buffer data");
            bufs.push(buf);
        }
        assert_eq!(importer.held(), MANY);
        tell_parent("HOLDING");
        hear_parent("go");
        drop(bufs);
        assert_eq!(importer.held(), 0);
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let sock = socket_path("many");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let mut children = [
        ChildProc::spawn(test, "importer", &sock),
        ChildProc::spawn(test, "importer", &sock),
    ];
    let importers: Vec<_> = exporter
        .wait_for_importers(2, WAIT)
        .unwrap()
        .iter()
        .map(|i| i.id)
        .collect();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut bufs = Vec::new();
    for k in 0..MANY {
        let buf = exporter.alloc(MANY_LEN, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds MANY_LEN / 4 u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), MANY_LEN / 4, (k * 1_000_000) as u32, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &importers).unwrap();
        bufs.push(buf);
    }
    for child in &mut children {
        child.expect("HOLDING");
    }
    // The exporter lets go first: nothing may be freed while the importers hold the buffers.
    drop(bufs);
    ctx.synchronize().unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (stats.live_buffers, stats.deferred_buffers, stats.freed_buffers),
        (MANY, MANY, 0),
        "{stats:?}"
    );
    assert!(exporter.pool().usage().unwrap().used_current >= (MANY * MANY_LEN) as u64);

    children[0].say("go");
    // One importer released everything; the other still holds it all.
    let deadline = Instant::now() + WAIT;
    while exporter.stats().importers > 1 {
        assert!(Instant::now() < deadline, "the first importer did not leave");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        exporter.stats().live_buffers,
        MANY,
        "freed before the second importer released"
    );
    children[1].say("go");
    exporter.wait_idle(WAIT).unwrap();
    wait_used(exporter.pool(), &ctx, 0);
    let [a, b] = children;
    a.succeeds();
    b.succeeds();
    let stats = exporter.stats();
    assert_eq!(
        (stats.freed_buffers, stats.reclaimed_buffers),
        (MANY as u64, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}
