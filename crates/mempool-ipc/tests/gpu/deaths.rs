//! Processes that die: an importer killed with SIGKILL mid-use, and the exporter killed.

use crate::harness::*;

const KILL_COUNT: usize = 8;
const KILL_LEN: usize = 16 * MIB;

#[test]
fn an_importer_killed_mid_use_loses_its_leases_and_memory_returns_to_baseline() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        let bufs: Vec<_> = (0..KILL_COUNT)
            .map(|_| importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer"))
            .collect();
        let n = KILL_LEN / 4;
        let mut told = false;
        // Keep the GPU busy on the shared memory until the parent kills this process.
        loop {
            for buf in &bufs {
                // SAFETY: each buffer holds n u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
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
    let sock = socket_path("kill");
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), ExporterOptions::default()).unwrap();
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    for k in 0..KILL_COUNT {
        let buf = exporter.alloc(KILL_LEN, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds KILL_LEN / 4 u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), KILL_LEN / 4, k as u32, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &[id]).unwrap();
        // The exporter lets go at once: only the importer holds the buffer now.
    }
    child.expect("HOLDING");
    assert_eq!(exporter.stats().live_buffers, KILL_COUNT);
    assert!(pool.usage().unwrap().used_current >= baseline + (KILL_COUNT * KILL_LEN) as u64);

    child.kill();
    exporter.wait_idle(WAIT).expect("the dead importer's buffers are freed");
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.importers,
            stats.reclaimed_buffers,
            stats.freed_buffers,
            stats.abandoned_buffers
        ),
        (0, KILL_COUNT as u64, KILL_COUNT as u64, 0),
        "{stats:?}"
    );
    wait_used(&pool, &ctx, baseline);

    // The exporter keeps serving: a new importer would be accepted, and its own memory works.
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    buf.release().unwrap();
    wait_used(&pool, &ctx, baseline);
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

// ---- The exporter dies ----

const DEATH_N: usize = 1 << 20;

#[test]
fn exporter_death_leaves_received_buffers_usable_until_dropped() {
    let test = this_test!();
    if role().is_some() {
        // The exporter, in the child: share one buffer, then wait to be killed.
        let (dev, ctx) = gpu();
        let exporter = Exporter::new(child_socket(), exportable_pool(&dev), ExporterOptions::default()).unwrap();
        tell_parent("LISTENING");
        let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
        let kernels = CheckKernels::load(&ctx).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let buf = exporter.alloc(DEATH_N * 4, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds DEATH_N u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), DEATH_N, 7000, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &[id]).unwrap();
        stream.synchronize().unwrap();
        tell_parent("SHARED");
        std::thread::sleep(Duration::from_secs(120));
        panic!("the parent should have killed this exporter");
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let sock = socket_path("death");
    let mut child = ChildProc::spawn(test, "exporter", &sock);
    child.expect("LISTENING");
    let importer = Importer::connect(&sock, ImporterOptions::default()).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).unwrap();
    child.expect("SHARED");
    assert_iota(&shared_u32s(&buf), 7000, "data before the exporter dies");

    child.kill();
    // The socket reports the exporter's death clearly.
    let err = importer.recv_timeout(stream.as_ref(), WAIT).unwrap_err();
    println!("FINDING: recv after the exporter died: {err}");
    assert!(matches!(err, Error::ExporterGone { .. }), "{err:?}");

    // What the driver does with memory imported from a dead process: it stays readable and writable.
    let after = shared_u32s(&buf);
    println!(
        "FINDING: after the exporter died, the imported buffer reads {:?}...",
        &after[..4]
    );
    assert_iota(&after, 7000, "data after the exporter died");
    // SAFETY: the buffer holds DEATH_N u32s, ordered on `stream`.
    unsafe { kernels.add(buf.ptr(), DEATH_N, 1, stream.as_ref()) }.unwrap();
    let sync = stream.synchronize();
    println!("FINDING: a kernel writing the imported buffer after the exporter died: {sync:?}");
    sync.unwrap();
    assert_iota(&shared_u32s(&buf), 7001, "writes after the exporter died");

    let released = buf.release();
    println!("FINDING: freeing the import after the exporter died: {released:?}");
    released.unwrap();
    let reconnect = Importer::connect(&sock, ImporterOptions::default());
    println!(
        "FINDING: connecting to the dead exporter's socket: {:?}",
        reconnect.as_ref().err()
    );
    assert!(reconnect.is_err());
    drop(importer);
    let errors = (mempool_ipc::take_drop_errors(), mempool_core::take_drop_errors());
    println!("FINDING: errors in drops after the exporter died: {errors:?}");
    assert!(errors.0.is_empty() && errors.1.is_empty(), "{errors:?}");
    let _ = std::fs::remove_file(&sock);
}
