//! Pool and pointer sharing, data checked on both sides.

use crate::harness::*;

const BASIC_N: usize = 1 << 20;

#[test]
fn pool_and_pointer_shared_with_data_checked_on_both_sides() {
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
        assert_eq!(buf.len(), BASIC_N * 4);
        assert_iota(&shared_u32s(&buf), 1000, "the importer sees the exporter's data");
        // SAFETY: the buffer holds BASIC_N u32s, ordered on `stream` after the exporter's event.
        unsafe { kernels.add(buf.ptr(), BASIC_N, 5, stream.as_ref()) }.unwrap();
        assert_eq!(importer.held(), 1);
        buf.release().expect("release the buffer");
        assert_eq!(importer.held(), 0);
        assert_eq!(importer.imported_blocks(), 0);
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let sock = socket_path("basic");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let child = ChildProc::spawn(this_test!(), "importer", &sock);
    let importers = exporter.wait_for_importers(1, WAIT).unwrap();
    assert_eq!(importers[0].credentials.pid, child.pid() as i32);

    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let buf = exporter.alloc(BASIC_N * 4, stream.as_ref()).unwrap();
    // SAFETY: the buffer holds BASIC_N u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), BASIC_N, 1000, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[importers[0].id]).unwrap();
    assert_eq!(buf.holders(), vec![importers[0].id]);
    buf.wait_released(WAIT).unwrap();
    assert_iota(
        // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
        // or synchronized) or ordered before the copy on its stream.
        &unsafe { read_u32s(&ctx, buf.ptr(), BASIC_N, stream.as_ref()) },
        1005,
        "the exporter sees the importer's writes",
    );
    child.succeeds();
    buf.release().unwrap();
    exporter.wait_idle(WAIT).unwrap();
    wait_used(exporter.pool(), &ctx, 0);
    let stats = exporter.stats();
    assert_eq!(
        (stats.freed_buffers, stats.reclaimed_buffers, stats.blocks),
        (1, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    assert!(!sock.exists(), "the socket file is removed at shutdown");
    no_drop_errors("exporter");
}
