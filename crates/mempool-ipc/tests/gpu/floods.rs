//! Floods and stalls: the exporter stays available.
//!
//! These run the exporter in a child process of its own (`run_role`), so that its descriptor and
//! thread counts are its own and not those of the test harness's other threads. Other processes
//! play the peers: silent connections and idle importers that speak the protocol by hand
//! (`FakeImporter`: the handshake in raw frames, and the pool's descriptor discarded by reading
//! it without room for it), and a real `Importer`.

use crate::harness::*;

const FLOOD_SILENT: usize = 1000;
const FLOOD_IDLE: usize = 1000;

/// Runs `test` again in a child process in role `role`, output shown, and asserts it passed.
fn run_role(test: &str, role: &str) {
    assert_test_exists(test);
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .status()
        .expect("spawn the child process");
    assert!(status.success(), "{test}/{role} failed: {status} (its output is above)");
}

/// Raises this process's soft limit of open descriptors to `want` (or the hard limit, if lower).
fn raise_nofile(want: u64) -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let soft = want.min(hard);
    if limit.current.is_some_and(|c| c >= soft) {
        return limit.current.unwrap_or(soft);
    }
    limit.current = Some(soft);
    setrlimit(Resource::Nofile, limit).expect("raise RLIMIT_NOFILE");
    soft
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

/// The process's open descriptors and threads.
fn fds_and_threads() -> (usize, usize) {
    (count_dir("/proc/self/fd"), count_dir("/proc/self/task"))
}

/// An importer that speaks the protocol by hand, with no GPU: what an idle importer (or one that
/// stops reading) looks like to the exporter.
struct FakeImporter {
    stream: std::os::unix::net::UnixStream,
}

impl FakeImporter {
    /// Connects and completes the handshake (Hello, Welcome, Ready, PoolDescriptor).
    fn connect(path: &Path) -> std::io::Result<FakeImporter> {
        use std::io::Read;
        let mut stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_read_timeout(Some(WAIT))?;
        stream.write_all(&frame(1, &[]))?;
        let mut welcome = [0u8; 12 + 32];
        stream.read_exact(&mut welcome)?;
        assert_eq!(
            u16::from_le_bytes([welcome[6], welcome[7]]),
            2,
            "expected Welcome: {welcome:?}"
        );
        stream.write_all(&frame(3, &welcome[12..28]))?;
        // A plain read has no room for the descriptor: the kernel closes it.
        let mut pool = [0u8; 12 + 24];
        stream.read_exact(&mut pool)?;
        assert_eq!(
            u16::from_le_bytes([pool[6], pool[7]]),
            4,
            "expected PoolDescriptor: {pool:?}"
        );
        Ok(FakeImporter { stream })
    }

    /// The next message: `Some(buffer id)` for a `Buffer`, `None` for `Goodbye` or the end.
    fn next_buffer(&mut self) -> Option<u64> {
        use std::io::Read;
        let mut header = [0u8; 12];
        self.stream.read_exact(&mut header).ok()?;
        let ty = u16::from_le_bytes([header[6], header[7]]);
        let len = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).ok()?;
        (ty == 5).then(|| u64::from_le_bytes(body[..8].try_into().unwrap()))
    }

    fn release(&mut self, buffer: u64) {
        self.stream.write_all(&frame(6, &buffer.to_le_bytes())).unwrap();
    }

    fn goodbye(mut self) {
        let _ = self.stream.write_all(&frame(7, &[]));
    }
}

/// Runs one exporter through a share and a shutdown, so that what the driver and the exporter
/// set up once per process (event and export machinery, descriptors the driver keeps open) is
/// in place before a baseline is taken.
fn warm_up(pool: &Arc<MemPool>, ctx: &Arc<Context>) {
    let sock = socket_path("warm");
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), ExporterOptions::default()).unwrap();
    let mut fake = FakeImporter::connect(&sock).unwrap();
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let stream = Stream::new(ctx).unwrap();
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    exporter.share(&buf, &[id]).unwrap();
    let got = fake.next_buffer().expect("a buffer");
    fake.release(got);
    buf.wait_released(WAIT).unwrap();
    drop(buf);
    fake.goodbye();
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
}

/// Checks that the exporter's process is back to its baseline: descriptors, threads, pool.
fn assert_back_to_baseline(what: &str, baseline: (usize, usize), pool: &MemPool, ctx: &Context, used: u64) {
    wait_used(pool, ctx, used);
    // The serving thread was joined by the shutdown; a moment for the kernel's bookkeeping.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = fds_and_threads();
        if now == baseline {
            println!(
                "{what}: back to baseline: {} descriptors, {} threads, {used} bytes used",
                now.0, now.1
            );
            return;
        }
        if Instant::now() > deadline {
            let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|p| p.display().to_string())
                .collect();
            panic!("{what}: (descriptors, threads) = {now:?}, baseline {baseline:?}; open descriptors: {fds:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn flood_of_silent_connections_and_idle_importers_does_not_keep_a_real_importer_out() {
    let test = this_test!();
    match role().as_deref() {
        None => {
            let _serial = serial();
            return run_role(test, "exporter");
        }
        Some("exporter") => {}
        Some("clients") => return flood_clients(),
        Some("importer") => return flood_importer(),
        Some(other) => panic!("unknown role {other}"),
    }
    let limit = raise_nofile(16384);
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    warm_up(&pool, &ctx);
    let baseline = fds_and_threads();
    let used = pool.usage().unwrap().used_current;
    println!("exporter: RLIMIT_NOFILE soft limit {limit}; baseline {baseline:?} (descriptors, threads)");

    let sock = socket_path("flood");
    let options = ExporterOptions {
        max_importers: FLOOD_IDLE + 100,
        ..ExporterOptions::default()
    };
    let max_handshakes = options.max_handshakes;
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), options).unwrap();
    let mut clients = ChildProc::spawn(test, "clients", &sock);
    clients.expect("HELD");
    let idle = exporter
        .wait_for_importers(FLOOD_IDLE, WAIT)
        .unwrap_or_else(|e| panic!("{e}: {:?}", exporter.stats()));
    let stats = exporter.stats();
    let (fds, threads) = fds_and_threads();
    println!("exporter: holding {FLOOD_IDLE} idle importers under a flood of silent connections: {stats:?}");
    println!("exporter: {fds} descriptors, {threads} threads");
    assert!(stats.handshakes <= max_handshakes, "{stats:?}");
    assert!(
        stats.evicted_handshakes as usize >= FLOOD_SILENT - max_handshakes,
        "{stats:?}"
    );
    // One serving thread, whatever the number of importers (a few more allowed for the driver).
    assert!(
        threads <= baseline.1 + 4,
        "{threads} threads while serving {FLOOD_IDLE} importers, {} before",
        baseline.1
    );

    // A real importer connects during the flood (the clients keep replacing silent connections),
    // when every handshake slot is held by a silent connection: it gets in because the exporter
    // evicts the silent ones first, whatever their age.
    let mut importer = ChildProc::spawn(test, "importer", &sock);
    importer.expect("READY");
    let deadline = Instant::now() + WAIT;
    while exporter.stats().handshakes < max_handshakes {
        assert!(
            Instant::now() < deadline,
            "the handshake slots never filled: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let at_go = exporter.stats();
    importer.say("GO");
    let all = exporter.wait_for_importers(FLOOD_IDLE + 1, WAIT).unwrap();
    let new = all.iter().find(|i| !idle.contains(i)).expect("the new importer").id;
    // Admitted beside every idle importer: nobody that completed a handshake was cut off to make room.
    assert!(idle.iter().all(|i| all.contains(i)), "an idle importer was dropped");
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    // SAFETY: the buffer holds MIB / 4 u32s, ordered on `stream`.
    unsafe { kernels.iota(buf.ptr(), MIB / 4, 4242, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[new]).unwrap();
    drop(buf);
    importer.expect("DONE");
    importer.succeeds();
    println!(
        "exporter: when the importer connected: {at_go:?}; when it was done: {:?}",
        exporter.stats()
    );

    clients.say("STOP");
    clients.succeeds();
    exporter.wait_idle(WAIT).unwrap();
    let deadline = Instant::now() + WAIT;
    while exporter.stats().importers + exporter.stats().handshakes > 0 {
        assert!(Instant::now() < deadline, "connections stay: {:?}", exporter.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats = exporter.stats();
    println!("exporter: after the flood: {stats:?}");
    assert_eq!(
        stats.accept_pauses, 0,
        "ran out of descriptors at a soft limit of {limit}"
    );
    let errors = exporter.shutdown();
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!sock.exists(), "the socket file stays after the shutdown");
    drop((kernels, stream));
    assert_back_to_baseline("exporter", baseline, &pool, &ctx, used);
    no_drop_errors("exporter");
}

/// Holds FLOOD_SILENT connections that never say a word and FLOOD_IDLE importers that complete
/// the handshake and then say nothing, and keeps flooding (a new silent connection every
/// millisecond, the oldest one closed) until the parent says STOP.
fn flood_clients() {
    raise_nofile(16384);
    let sock = child_socket();
    let mut silent: std::collections::VecDeque<_> = (0..FLOOD_SILENT)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).expect("a silent connection"))
        .collect();
    let idle: Vec<FakeImporter> = (0..FLOOD_IDLE)
        .map(|i| FakeImporter::connect(&sock).unwrap_or_else(|e| panic!("idle importer {i}: {e}")))
        .collect();
    tell_parent("HELD");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            hear_parent("STOP");
            stop.store(true, std::sync::atomic::Ordering::Release);
        })
    };
    let mut made = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) {
            silent.pop_front();
            silent.push_back(s);
            made += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stopper.join().unwrap();
    println!("clients: {made} more silent connections during the test");
    drop(idle);
    drop(silent);
}

/// Connects when the parent says GO (CUDA is initialized first), during the flood, and checks the
/// buffer it is sent. The connection's own timeouts are the safety net: a handshake the flood kept
/// from completing fails the test.
fn flood_importer() {
    let (_dev, _ctx) = gpu();
    let _ = Device::all().unwrap();
    tell_parent("READY");
    hear_parent("GO");
    let importer = Importer::connect(child_socket(), ImporterOptions::default()).expect("connect during the flood");
    let stream = Stream::new(&importer.device().context().unwrap()).unwrap();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).unwrap();
    stream.synchronize().unwrap();
    assert_iota(&shared_u32s(&buf), 4242, "the buffer shared during the flood");
    drop(buf);
    drop(importer);
    tell_parent("DONE");
}

const STALL_BUFFERS: usize = 4000;
const STALL_QUEUE: usize = 64;

#[test]
/// One importer stops reading; another receives every share. The exporter never waits for the
/// stalled one: each share reaches the reader before the next is made (the loop below waits for it,
/// with a deadline only as a safety net), and the stalled importer is cut off when its send queue is
/// full, not by a clock.
fn a_stalled_importer_is_cut_off_by_its_full_queue_while_another_receives_every_share_in_order() {
    let test = this_test!();
    match role().as_deref() {
        None => {
            let _serial = serial();
            return run_role(test, "exporter");
        }
        Some("exporter") => {}
        Some("stalled") => {
            // Completes the handshake, then never reads again.
            let _fake = FakeImporter::connect(&child_socket()).unwrap();
            tell_parent("CONNECTED");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Some(other) => panic!("unknown role {other}"),
    }
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    warm_up(&pool, &ctx);
    let baseline = fds_and_threads();
    let used = pool.usage().unwrap().used_current;

    let sock = socket_path("stall");
    let mut options = ExporterOptions {
        send_queue_len: STALL_QUEUE,
        ..ExporterOptions::default()
    };
    // Long enough that the stalled importer is cut off by its full queue, not by the clock.
    options.listener.connection.io_timeout = Duration::from_secs(60);
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), options).unwrap();
    let mut stalled = ChildProc::spawn(test, "stalled", &sock);
    stalled.expect("CONNECTED");
    let s = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    // The reader: receives every buffer and releases it at once.
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let reader = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            let mut fake = FakeImporter::connect(&sock).unwrap();
            while let Some(id) = fake.next_buffer() {
                fake.release(id);
                if tx.send(id).is_err() {
                    break;
                }
            }
            fake.goodbye();
        })
    };
    let b = exporter
        .wait_for_importers(2, WAIT)
        .unwrap()
        .into_iter()
        .find(|i| i.id != s)
        .unwrap()
        .id;

    let stream = Stream::new(&ctx).unwrap();
    let mut stalled_at = None;
    for k in 0..STALL_BUFFERS {
        let buf = exporter.alloc(4096, stream.as_ref()).unwrap();
        let to: &[_] = if stalled_at.is_none() { &[s, b] } else { &[b] };
        match exporter.share(&buf, to) {
            Ok(()) => {}
            Err(Error::Share { importer, source, .. }) if importer == s => {
                assert!(
                    matches!(
                        *source,
                        Error::Stalled { .. } | Error::Refused { .. } | Error::UnknownImporter { .. }
                    ),
                    "{source}"
                );
                stalled_at.get_or_insert(k);
            }
            Err(Error::UnknownImporter { importer }) if importer == s => {
                stalled_at.get_or_insert(k);
                exporter.share(&buf, &[b]).unwrap();
            }
            Err(e) => panic!("share {k}: {e}"),
        }
        // The reader has this share before the next one is made, before and after the cut-off.
        let id = rx.recv_timeout(WAIT).expect("the reader receives every buffer");
        assert_eq!(id, buf.id().0, "share {k}: the reader got another buffer first");
        drop(buf);
    }
    let stalled_at = stalled_at.expect("the stalled importer's queue never filled");
    println!("the stalled importer was cut off at share {stalled_at} of {STALL_BUFFERS}");
    // Before the cut-off the stalled importer took every share too: its socket buffer and then its
    // whole send queue filled first.
    assert!(
        stalled_at >= STALL_QUEUE,
        "cut off at share {stalled_at}, before its queue of {STALL_QUEUE} filled"
    );
    let stats = exporter.stats();
    println!("exporter: {stats:?}");
    assert_eq!(stats.stalled_importers, 1, "{stats:?}");
    // The stalled importer holds what reached its socket: reclaimed once its process is gone.
    assert_eq!(stats.awaiting_exit, 1, "{stats:?}");
    stalled.kill();
    exporter
        .wait_idle(WAIT)
        .unwrap_or_else(|e| panic!("{e}: {:?}", exporter.stats()));
    let stats = exporter.stats();
    assert!(stats.reclaimed_buffers > 0 && stats.abandoned_buffers == 0, "{stats:?}");
    let errors = exporter.shutdown();
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, Error::Stalled { importer, reason } if *importer == s && reason.contains("queue"))),
        "{errors:?}"
    );
    reader.join().unwrap();
    // The stalled child's stdin and stdout pipes are the test's, not the exporter's: closed before the count.
    drop((rx, stream, stalled));
    assert_back_to_baseline("exporter", baseline, &pool, &ctx, used);
    no_drop_errors("exporter");
}
