//! The exporter's connection layer without a GPU: the admission, queueing and back-off
//! decisions as pure logic, then the whole server over real sockets, with a memfd standing in
//! for the pool's descriptor and a test [`Handler`] that records what it is told.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::admission::{least_progressed, Admission, Backoff, Limits, Pending};
use super::exits::parse_start_time;
use super::outbox::{Outboxes, Outgoing, PushError};
use super::{Handler, Reactor};
use crate::error::{Error, Result};
use crate::lease::{ImporterId, LeaseError};
use crate::protocol::testing::{buffer, GPU, POOL};
use crate::protocol::{self, BufferId, ErrorCode, Message, ReleaseBatch};
use crate::session::{ExporterEvent, HandshakeStep, ImporterSession, PoolAnnouncement};
use crate::test_util::{memfd_with, open_fds_named, read_all, unique_name, TempDir};
use mempool_socket::cred::{AccessPolicy, PeerCredentials};
use mempool_socket::listener::{Listener, ListenerOptions};
use mempool_socket::ConnectionOptions;

const ANNOUNCEMENT: PoolAnnouncement = PoolAnnouncement {
    device_uuid: GPU,
    pool_id: POOL,
};

/// How long a test waits for something that should happen at once (generous: CI is slow).
const SOON: Duration = Duration::from_secs(10);

// ---- admission, back-off and queues, as pure logic ----

fn limits() -> Limits {
    Limits {
        max_importers: 4,
        max_handshakes: 3,
        send_queue_len: 4,
        idle_timeout: None,
        handshake_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(5),
        ring: Some(crate::ring::Geometry::default()),
    }
}

#[test]
fn admission_admits_until_the_handshake_slots_are_taken_then_evicts_the_least_progressed() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let pending = |key, step, heard, ms| Pending {
        key,
        step,
        heard,
        accepted: at(ms),
    };
    let l = limits();
    assert_eq!(l.admit::<u32>(0, &[]), Admission::Admit);
    let two = [
        pending(1, HandshakeStep::AwaitHello, false, 0),
        pending(2, HandshakeStep::AwaitHello, false, 1),
    ];
    assert_eq!(l.admit(0, &two), Admission::Admit);
    // Full: a real importer that said Hello (3) is kept; of the silent ones, the oldest goes.
    let full = [
        pending(3, HandshakeStep::AwaitReady, true, 0),
        pending(1, HandshakeStep::AwaitHello, false, 5),
        pending(2, HandshakeStep::AwaitHello, false, 3),
    ];
    assert_eq!(l.admit(0, &full), Admission::Evict(2));
    // One that began a frame made more progress than one that said nothing, whatever its age.
    let started = [
        pending(1, HandshakeStep::AwaitHello, true, 0),
        pending(2, HandshakeStep::AwaitHello, false, 9),
        pending(3, HandshakeStep::AwaitReady, true, 1),
    ];
    assert_eq!(least_progressed(&started), Some(2));
    // All past Hello: the oldest goes.
    let busy = [
        pending(1, HandshakeStep::AwaitReady, true, 4),
        pending(2, HandshakeStep::AwaitReady, true, 2),
        pending(3, HandshakeStep::AwaitReady, true, 3),
    ];
    assert_eq!(l.admit(0, &busy), Admission::Evict(2));
    // At the importer limit nobody new gets in, whatever the handshakes.
    assert_eq!(l.admit::<u32>(4, &[]), Admission::Refuse);
    assert_eq!(l.admit(4, &two), Admission::Refuse);
}

#[test]
fn accept_backoff_doubles_to_a_second_and_resets_after_a_success() {
    let t0 = Instant::now();
    let mut b = Backoff::default();
    assert_eq!(b.paused_until(), None);
    let mut pauses = Vec::new();
    let mut now = t0;
    for _ in 0..10 {
        let until = b.exhausted(now);
        pauses.push(until - now);
        assert!(!b.resume(now), "resumed before the pause ended");
        now = until;
        assert!(b.resume(now));
        assert_eq!(b.paused_until(), None);
    }
    let ms: Vec<u128> = pauses.iter().map(|d| d.as_millis()).collect();
    assert_eq!(ms, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    b.succeeded();
    assert_eq!(b.exhausted(now) - now, Duration::from_millis(10));
}

#[test]
fn outbox_bounds_each_queue_and_marks_the_full_one_for_disconnection() {
    let (a, b) = (ImporterId(1), ImporterId(2));
    let mut o = Outboxes::new(2);
    let frame = |buffer: u64| Outgoing {
        buffer: Some(BufferId(buffer)),
        ..Outgoing::plain(vec![buffer as u8])
    };
    assert_eq!(o.push(a, frame(1)).unwrap_err(), PushError::Unknown);
    o.open(a, None);
    o.open(b, None);
    // The first frame wakes the loop; later ones ride on the same wake-up.
    assert_eq!(o.push(a, frame(1)), Ok(true));
    assert_eq!(o.push(b, frame(1)), Ok(false));
    assert_eq!(o.push(a, frame(2)), Ok(false));
    assert_eq!(o.push(a, frame(3)), Err(PushError::Full(2)));
    // Once full, the importer takes nothing more, and only it is doomed; the other is untouched.
    assert_eq!(o.push(a, frame(4)), Err(PushError::Closing));
    assert_eq!(o.push(b, frame(2)), Ok(false));
    assert_eq!(o.take_doomed(), [a]);
    assert_eq!(o.take_ready(), [a, b]);
    assert_eq!(o.take_ready(), []);
    assert_eq!((o.len(a), o.len(b), o.total()), (2, 2, 4));
    assert_eq!(o.pop(b).and_then(|f| f.buffer), Some(BufferId(1)));
    // Closing returns what never went out.
    assert_eq!(o.close(a), [BufferId(1), BufferId(2)]);
    assert_eq!(o.push(a, frame(5)).unwrap_err(), PushError::Unknown);
    // Goodbye goes past the limit, once, and closes the queue.
    assert!(o.push_last_to_all(|| Outgoing::plain(vec![0xff])));
    assert_eq!(o.len(b), 2);
    assert_eq!(o.push(b, frame(3)), Err(PushError::Closing));
    assert_eq!(o.close(b), [BufferId(2)]);
}

#[test]
fn start_time_is_read_after_the_last_parenthesis() {
    // Field 22; the command name (field 2) may hold spaces and parentheses.
    let stat = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
    assert_eq!(parse_start_time(stat), Some(98765));
    assert_eq!(parse_start_time("1 (init) S 0"), None);
    assert_eq!(parse_start_time("no parenthesis"), None);
    let own = std::fs::read_to_string("/proc/self/stat").unwrap();
    assert!(parse_start_time(&own).is_some(), "{own}");
}

// ---- the server over real sockets ----

#[derive(Default)]
struct Record {
    connected: Vec<ImporterId>,
    /// The capabilities granted to each, in the order connected.
    capabilities: Vec<u64>,
    released: Vec<(ImporterId, BufferId)>,
    /// The buffers of each `released_batch` call, in order.
    batches: Vec<Vec<u64>>,
    ended: Vec<(ImporterId, bool, Vec<BufferId>)>,
    exited: Vec<ImporterId>,
    abandoned: Vec<ImporterId>,
}

/// A [`Handler`] that records what it is told. `ended` reports the importer as still holding
/// buffers when it is in `holding`; `released` refuses buffer 666.
#[derive(Default)]
struct Recorder {
    record: Mutex<Record>,
    changed: Condvar,
    holding: Mutex<BTreeSet<ImporterId>>,
}

impl Recorder {
    fn wait_for(&self, what: &str, done: impl Fn(&Record) -> bool) {
        let deadline = Instant::now() + SOON;
        let mut r = self.record.lock().unwrap();
        while !done(&r) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting for {what}");
            r = self.changed.wait_timeout(r, left).unwrap().0;
        }
    }

    fn ended(&self, id: ImporterId) -> Option<(bool, Vec<BufferId>)> {
        let r = self.record.lock().unwrap();
        r.ended.iter().find(|e| e.0 == id).map(|e| (e.1, e.2.clone()))
    }

    fn connected(&self) -> Vec<ImporterId> {
        self.record.lock().unwrap().connected.clone()
    }
}

impl Handler for Recorder {
    fn connected(&self, id: ImporterId, _credentials: PeerCredentials, capabilities: u64) {
        let mut r = self.record.lock().unwrap();
        r.connected.push(id);
        r.capabilities.push(capabilities);
        drop(r);
        self.changed.notify_all();
    }

    fn released(&self, id: ImporterId, buffer: BufferId) -> Result<()> {
        if buffer == BufferId(666) {
            return Err(LeaseError::NotLeased { buffer, importer: id }.into());
        }
        self.record.lock().unwrap().released.push((id, buffer));
        self.changed.notify_all();
        Ok(())
    }

    fn released_batch(&self, id: ImporterId, batch: ReleaseBatch) -> Result<()> {
        let ids = batch.buffers.iter().map(|b| b.0).collect();
        self.record.lock().unwrap().batches.push(ids);
        for buffer in batch.buffers {
            self.released(id, buffer)?;
        }
        Ok(())
    }

    fn ended(&self, id: ImporterId, clean: bool, undelivered: Vec<BufferId>) -> bool {
        self.record.lock().unwrap().ended.push((id, clean, undelivered));
        self.changed.notify_all();
        self.holding.lock().unwrap().contains(&id)
    }

    fn exited(&self, id: ImporterId) {
        self.record.lock().unwrap().exited.push(id);
        self.changed.notify_all();
    }

    fn abandoned(&self, id: ImporterId) {
        self.record.lock().unwrap().abandoned.push(id);
        self.changed.notify_all();
    }
}

struct Fixture {
    reactor: Reactor,
    handler: Arc<Recorder>,
    path: PathBuf,
    pool_name: String,
    _dir: TempDir,
}

fn serve(limits: Limits) -> Fixture {
    let dir = TempDir::new("server");
    let path = dir.join("pool.sock");
    let pool_name = unique_name("server-pool");
    let listener = Listener::bind_with(&path, ListenerOptions::default()).unwrap();
    let handler = Arc::new(Recorder::default());
    let h: Arc<dyn Handler> = handler.clone();
    let reactor = Reactor::start(listener, ANNOUNCEMENT, memfd_with(&pool_name, b"the pool"), limits, h).unwrap();
    Fixture {
        reactor,
        handler,
        path,
        pool_name,
        _dir: dir,
    }
}

fn client_options() -> ConnectionOptions {
    ConnectionOptions {
        io_timeout: SOON,
        handshake_timeout: SOON,
    }
}

/// An importer without a GPU: the whole handshake, and the pool's descriptor checked.
fn importer(path: &Path) -> Result<ImporterSession> {
    let (session, imported) = ImporterSession::connect(path, client_options(), &AccessPolicy::SameUser, 0, |uuid| {
        assert_eq!(*uuid, GPU);
        Ok(())
    })?;
    assert_eq!(read_all(imported.pool_fd), b"the pool");
    Ok(session)
}

/// Connects and waits until the server reports the importer; returns both.
fn connected_importer(f: &Fixture) -> (ImporterSession, ImporterId) {
    let before = f.handler.connected().len();
    let session = importer(&f.path).unwrap();
    f.handler
        .wait_for("the importer to be reported", |r| r.connected.len() > before);
    (session, f.handler.connected()[before])
}

fn buffer_message(id: u64) -> Message {
    Message::Buffer(buffer(id))
}

fn recv_buffer(session: &ImporterSession) -> BufferId {
    match session.recv_until(Some(Instant::now() + SOON)).unwrap() {
        ExporterEvent::Buffer(b) => b.buffer_id,
        ExporterEvent::Goodbye => panic!("Goodbye instead of a buffer"),
        ExporterEvent::VmmBuffer(b, _) => panic!("a VMM buffer instead of a buffer: {b:?}"),
        ExporterEvent::VmmChunks(c, _) => panic!("VMM chunks instead of a buffer: {c:?}"),
    }
}

fn limits_for_sockets() -> Limits {
    Limits {
        max_importers: 64,
        max_handshakes: 8,
        send_queue_len: 1024,
        idle_timeout: None,
        handshake_timeout: Duration::from_secs(30),
        io_timeout: Duration::from_secs(30),
        ring: Some(crate::ring::Geometry::default()),
    }
}

#[test]
fn a_flood_of_silent_connections_does_not_keep_a_real_importer_out() {
    let f = serve(limits_for_sockets());
    // Ten times the handshake slots, all silent, all kept open on this side; none times out
    // during the test (30 s).
    let silent: Vec<UnixStream> = (0..80).map(|_| UnixStream::connect(&f.path).unwrap()).collect();
    let (session, id) = connected_importer(&f);
    wait_stats(&f, "the flood evicted", |s| {
        s.evicted >= 80 - 8 && s.handshakes <= 8 && s.importers == 1
    });
    // The evicted ones were told why, then closed.
    let mut told = 0;
    for mut s in silent {
        s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        let mut bytes = Vec::new();
        if s.read_to_end(&mut bytes).is_ok() {
            let frame = protocol::decode(&bytes).unwrap();
            let Message::Error(e) = frame else { panic!("{frame:?}") };
            assert_eq!(e.code, ErrorCode::Internal);
            assert!(e.text.contains("least progress"), "{}", e.text);
            told += 1;
        }
    }
    assert!(told >= 80 - 8, "{told} told");
    // The importer is served.
    f.reactor.send(id, &buffer_message(1), Some(BufferId(1))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(1));
}

#[test]
fn the_importer_limit_turns_the_next_one_away_by_name() {
    let f = serve(Limits {
        max_importers: 2,
        ..limits_for_sockets()
    });
    let _a = connected_importer(&f);
    let _b = connected_importer(&f);
    let err = importer(&f.path).unwrap_err();
    assert!(
        matches!(&err, Error::Remote { code: ErrorCode::Internal, text } if text.contains("limit of 2 importers")),
        "{err}"
    );
    wait_stats(&f, "one refused", |s| s.refused == 1);
}

#[test]
fn an_importer_that_stops_reading_holds_up_nobody_and_is_cut_off_when_its_queue_fills() {
    let f = serve(Limits {
        send_queue_len: 16,
        ..limits_for_sockets()
    });
    let (stalled, a) = connected_importer(&f);
    let (reader, b) = connected_importer(&f);
    f.handler.holding.lock().unwrap().insert(a);
    // Far more than A's socket and queue hold; B reads every one as it comes.
    let mut stalled_error = None;
    for n in 1..=5000u64 {
        if stalled_error.is_none() {
            if let Err(e) = f.reactor.send(a, &buffer_message(n), Some(BufferId(n))) {
                stalled_error = Some((n, e));
            }
        }
        f.reactor.send(b, &buffer_message(n), Some(BufferId(n))).unwrap();
        assert_eq!(recv_buffer(&reader), BufferId(n));
    }
    let (at, err) = stalled_error.expect("A's queue never filled");
    assert!(
        matches!(&err, Error::Stalled { importer, reason } if *importer == a && reason.contains("queue of 16")),
        "{err}"
    );
    f.handler
        .wait_for("A to be cut off", |r| r.ended.iter().any(|e| e.0 == a));
    let (clean, undelivered) = f.handler.ended(a).unwrap();
    assert!(!clean);
    // What was still queued (16), and the frame taken for the socket if none of it went out,
    // never reached A: the exporter revokes those leases at once.
    assert!((16..=17).contains(&undelivered.len()), "{undelivered:?}");
    assert_eq!(undelivered.last(), Some(&BufferId(at - 1)));
    wait_stats(&f, "A awaited", |s| {
        s.stalled == 1 && s.importers == 1 && s.awaiting_exit == 1
    });
    // A holds buffers and its process (this one) lives on: it is awaited until the end.
    drop(stalled);
    drop(f.reactor);
    assert_eq!(f.handler.record.lock().unwrap().abandoned, [a]);
}

#[test]
fn an_importer_whose_socket_makes_no_progress_for_the_io_timeout_is_cut_off() {
    let f = serve(Limits {
        io_timeout: Duration::from_millis(300),
        ..limits_for_sockets()
    });
    let (_stalled, a) = connected_importer(&f);
    // Fill its socket (the queue holds the rest): nothing more goes out from then on.
    for n in 1..=4000u64 {
        if f.reactor.send(a, &buffer_message(n), Some(BufferId(n))).is_err() {
            break;
        }
    }
    f.handler
        .wait_for("A to be cut off", |r| r.ended.iter().any(|e| e.0 == a));
    wait_stats(&f, "A counted as stalled", |s| s.stalled == 1 && s.importers == 0);
}

#[test]
fn shutdown_says_goodbye_to_readers_at_once_though_one_importer_does_not_read() {
    let f = serve(limits_for_sockets());
    let (_stalled, a) = connected_importer(&f);
    let (reader, _b) = connected_importer(&f);
    for n in 1..=4000u64 {
        if f.reactor.send(a, &buffer_message(n), Some(BufferId(n))).is_err() {
            break;
        }
    }
    f.reactor.begin_shutdown();
    match reader.recv_until(Some(Instant::now() + SOON)).unwrap() {
        ExporterEvent::Goodbye => {}
        other => panic!("{other:?}"),
    }
    // The socket file is gone and nobody new gets in.
    let deadline = Instant::now() + SOON;
    while f.path.exists() {
        assert!(Instant::now() < deadline, "the socket file stays");
        std::thread::sleep(Duration::from_millis(5));
    }
    let late = UnixStream::connect(&f.path);
    assert!(late.is_err(), "a connection after shutdown began: {late:?}");
    assert_eq!(f.handler.connected().len(), 2, "only A and B ever connected");
    // Releases are still taken after Goodbye, then the importer's own Goodbye ends it cleanly.
    reader.release(BufferId(7)).unwrap();
    reader.goodbye().unwrap();
    f.handler
        .wait_for("B's clean end", |r| r.ended.iter().any(|e| e.0 != a && e.1));
    assert!(f
        .handler
        .record
        .lock()
        .unwrap()
        .released
        .iter()
        .any(|r| r.1 == BufferId(7)));
    f.reactor.finish();
    let (clean, _) = f.handler.ended(a).unwrap();
    assert!(!clean);
}

#[test]
fn a_bad_release_cuts_the_importer_off_and_frees_its_socket_at_once() {
    let f = serve(limits_for_sockets());
    let (session, id) = connected_importer(&f);
    f.handler.holding.lock().unwrap().insert(id);
    session.release(BufferId(666)).unwrap();
    f.handler.wait_for("the end", |r| !r.ended.is_empty());
    assert_eq!(f.handler.ended(id), Some((false, vec![])));
    // Told why, then closed on the exporter's side: no thread and no socket kept for it, only the
    // wait for its process (this one, which lives on).
    let err = session.recv_until(Some(Instant::now() + SOON)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Remote {
                code: ErrorCode::NotLeased,
                ..
            }
        ),
        "{err}"
    );
    wait_stats(&f, "the importer awaited", |s| s.importers == 0 && s.awaiting_exit == 1);
}

#[test]
fn goodbye_from_an_importer_ends_it_cleanly_and_a_silent_connection_times_out() {
    let f = serve(Limits {
        handshake_timeout: Duration::from_millis(200),
        ..limits_for_sockets()
    });
    let mut silent = UnixStream::connect(&f.path).unwrap();
    let (session, id) = connected_importer(&f);
    session.goodbye().unwrap();
    f.handler.wait_for("the end", |r| !r.ended.is_empty());
    assert_eq!(f.handler.ended(id), Some((true, vec![])));
    let told = crate::protocol::testing::expect_error_then_eof(&mut silent);
    assert_eq!(told.code, ErrorCode::Timeout);
    wait_stats(&f, "one timed out", |s| s.timed_out == 1);
}

#[test]
fn an_idle_importer_is_cut_off_after_the_idle_timeout_when_one_is_set() {
    let f = serve(Limits {
        idle_timeout: Some(Duration::from_millis(200)),
        ..limits_for_sockets()
    });
    let (session, id) = connected_importer(&f);
    f.handler.wait_for("the end", |r| !r.ended.is_empty());
    assert_eq!(f.handler.ended(id), Some((false, vec![])));
    let err = session.recv_until(Some(Instant::now() + SOON)).unwrap_err();
    assert!(
        matches!(&err, Error::Remote { code: ErrorCode::Timeout, text } if text.contains("idle")),
        "{err}"
    );
}

#[test]
fn the_server_closes_every_descriptor_it_opened() {
    // Other tests open descriptors in parallel threads, so the count is exact only in a process
    // of its own: the test runs itself again, alone, in a child.
    const CHILD: &str = "MEMPOOL_IPC_FD_TEST_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "reactor::tests::the_server_closes_every_descriptor_it_opened",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the child run failed:\n{text}"
        );
        return;
    }
    let before = count_fds();
    let f = serve(limits_for_sockets());
    let sessions: Vec<_> = (0..5).map(|_| connected_importer(&f).0).collect();
    let silent: Vec<_> = (0..5).map(|_| UnixStream::connect(&f.path).unwrap()).collect();
    // The pool's memfd: the server's own copy only (the importers read and closed theirs).
    assert_eq!(open_fds_named(&f.pool_name), 1);
    let pool_name = f.pool_name.clone();
    drop(f);
    drop(sessions);
    drop(silent);
    assert_eq!(open_fds_named(&pool_name), 0);
    // Nothing of this server is left: its 10 connections, its epoll, its eventfd, its listener
    // and the fixture's pool descriptor.
    let deadline = Instant::now() + SOON;
    while count_fds() != before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(count_fds(), before, "descriptors now vs before the server started");
}

/// Waits until the server's published counters satisfy `done` (they are published after each
/// round of its loop).
fn wait_stats(f: &Fixture, what: &str, done: impl Fn(&super::ReactorStats) -> bool) {
    let deadline = Instant::now() + SOON;
    loop {
        let stats = f.reactor.stats();
        if done(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {stats:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn descriptors_on_a_message_that_carries_none_are_counted_exactly() {
    let f = serve(limits_for_sockets());
    let name = unique_name("stray-on-hello");
    let memfd = memfd_with(&name, b"x");
    let mut raw = UnixStream::connect(&f.path).unwrap();
    let frame = protocol::encode(&Message::Hello).unwrap();
    use std::os::fd::AsFd;
    mempool_socket::fdpass::send_with_fds(&raw, &frame, &[memfd.as_fd(), memfd.as_fd()]).unwrap();
    drop(memfd);
    let told = crate::protocol::testing::expect_error_then_eof(&mut raw);
    assert!(told.text.contains("expected 0, got 2"), "{}", told.text);
    // The server closes the one it kept (it keeps at most one before it knows the type) as it
    // drops the connection, a moment after the peer saw it close.
    let deadline = Instant::now() + SOON;
    while open_fds_named(&name) != 0 {
        assert!(Instant::now() < deadline, "a stray descriptor stays open");
        std::thread::sleep(Duration::from_millis(5));
    }
    raw.write_all(b"x").ok();
}

const CHILD_SOCKET: &str = "MEMPOOL_IPC_SERVER_TEST_SOCKET";

/// The importer process of the next test: connects and completes the handshake; on a line from
/// its parent closes its socket without `Goodbye` and says `closed`, and stays alive until its
/// stdin closes. Does nothing when run as a test of its own.
#[test]
fn child_importer_exits_without_goodbye() {
    use std::io::BufRead;
    let Ok(path) = std::env::var(CHILD_SOCKET) else { return };
    let session = importer(Path::new(&path)).unwrap();
    println!("connected");
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).unwrap();
    drop(session); // closes the socket; no Goodbye
    println!("closed");
    let mut rest = Vec::new();
    let _ = stdin.read_to_end(&mut rest);
    std::process::exit(0);
}

#[test]
fn an_importer_that_held_buffers_is_reported_gone_once_its_process_exits() {
    let f = serve(limits_for_sockets());
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "reactor::tests::child_importer_exits_without_goodbye",
            "--nocapture",
        ])
        .env(CHILD_SOCKET, &f.path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    f.handler.wait_for("the child to connect", |r| !r.connected.is_empty());
    let id = f.handler.connected()[0];
    f.handler.holding.lock().unwrap().insert(id);
    // The child closes its connection uncleanly and stays alive.
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"close\n").unwrap();
    f.handler
        .wait_for("the unclean end", |r| r.ended.iter().any(|e| e.0 == id));
    assert_eq!(f.handler.ended(id), Some((false, vec![])));
    // The end and the start of the watch happen in one step of the loop, before it publishes its
    // counters: once the importer is counted as awaited, a watch that found the process gone at
    // once would have reported it already.
    wait_stats(&f, "the child's process watched", |s| {
        s.awaiting_exit == 1 && s.watched_processes == 1
    });
    assert!(
        f.handler.record.lock().unwrap().exited.is_empty(),
        "reported gone while its process lives"
    );
    assert_eq!(child.try_wait().unwrap(), None, "the child is still running");
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    f.handler
        .wait_for("the child's process to be reported gone", |r| r.exited.contains(&id));
    assert_eq!(f.handler.record.lock().unwrap().exited, [id]);
    wait_stats(&f, "no process awaited", |s| {
        s.awaiting_exit == 0 && s.watched_processes == 0
    });
}

#[test]
fn many_unclean_disconnects_from_one_live_process_cost_one_watch() {
    let f = serve(limits_for_sockets());
    const ROUNDS: usize = 40;
    let mut ids = Vec::new();
    for k in 0..ROUNDS as u64 {
        // Connect, receive a share, close without Goodbye; this process lives on.
        let (session, id) = connected_importer(&f);
        f.handler.holding.lock().unwrap().insert(id);
        f.reactor.send(id, &buffer_message(k), Some(BufferId(k))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(k));
        drop(session);
        f.handler
            .wait_for("the unclean end", |r| r.ended.iter().any(|e| e.0 == id));
        ids.push(id);
    }
    wait_stats(&f, "every importer awaited", |s| {
        s.importers == 0 && s.awaiting_exit == ROUNDS
    });
    let stats = f.reactor.stats();
    assert_eq!(stats.watched_processes, 1, "{stats:?}");
    assert!(f.handler.record.lock().unwrap().exited.is_empty());
    // At shutdown, every one of them is still awaited and is abandoned, never reported gone.
    drop(f.reactor);
    let r = f.handler.record.lock().unwrap();
    assert_eq!(r.abandoned, ids);
    assert!(r.exited.is_empty());
}

#[test]
fn errors_peers_cause_are_counted_not_kept_as_drop_errors() {
    let f = serve(limits_for_sockets());
    const BAD: u64 = 80; // more than the 64 slots of take_drop_errors
    for _ in 0..BAD {
        let (session, _) = connected_importer(&f);
        session.release(BufferId(666)).unwrap();
        let err = session.recv_until(Some(Instant::now() + SOON)).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Remote {
                    code: ErrorCode::NotLeased,
                    ..
                }
            ),
            "{err}"
        );
        // And a handshake that breaks the protocol.
        let mut raw = UnixStream::connect(&f.path).unwrap();
        raw.write_all(&protocol::encode(&Message::Goodbye).unwrap()).unwrap();
        let told = crate::protocol::testing::expect_error_then_eof(&mut raw);
        assert_eq!(told.code, ErrorCode::Protocol);
    }
    wait_stats(&f, "every peer error counted", |s| s.peer_errors == 2 * BAD);
    // Other tests of this binary share the process-wide list; none of theirs names this server's
    // peers' errors, so look for those only.
    let kept: Vec<String> = crate::error::take_drop_errors()
        .iter()
        .map(|e| e.to_string())
        .filter(|e| e.contains("666") || e.contains("Goodbye"))
        .collect();
    assert!(kept.is_empty(), "{kept:?}");
}

const CHILD_DIR: &str = "MEMPOOL_IPC_SERVER_TEST_DIR";

/// The server process of the next test: serves in `CHILD_DIR` with two descriptors to spare,
/// says `ready`, and on a line from its parent prints its counters and stops.
#[test]
fn child_server_runs_out_of_descriptors() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    use std::io::BufRead;
    let Ok(dir) = std::env::var(CHILD_DIR) else { return };
    let path = Path::new(&dir).join("pool.sock");
    let listener = Listener::bind_with(&path, ListenerOptions::default()).unwrap();
    let handler: Arc<dyn Handler> = Arc::new(Recorder::default());
    let reactor = Reactor::start(
        listener,
        ANNOUNCEMENT,
        memfd_with("pool", b"the pool"),
        limits_for_sockets(),
        handler,
    )
    .unwrap();
    let saved = getrlimit(Resource::Nofile);
    let mut low = saved;
    low.current = Some(256);
    setrlimit(Resource::Nofile, low).unwrap();
    // Take every descriptor left, then give two back: room for two connections, then EMFILE.
    let mut filler = Vec::new();
    while let Ok(fd) = rustix::io::dup(std::io::stdout()) {
        filler.push(fd);
    }
    filler.truncate(filler.len().saturating_sub(2));
    println!("ready");
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let s = reactor.stats();
    let errors = crate::error::take_drop_errors();
    drop(filler);
    println!(
        "stats {} {} {} {}",
        s.importers,
        s.accept_pauses,
        s.evicted,
        errors.len()
    );
    setrlimit(Resource::Nofile, saved).unwrap();
}

#[test]
fn out_of_descriptors_the_server_pauses_accepting_instead_of_spinning() {
    use std::io::BufRead;
    let dir = TempDir::new("emfile");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "reactor::tests::child_server_runs_out_of_descriptors",
            "--nocapture",
        ])
        .env(CHILD_DIR, &dir.0)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.trim_end().ends_with("ready") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child server exited early");
    }
    // Six importers; the server has descriptors for two. The others wait in the backlog until
    // their handshake times out.
    let path = dir.join("pool.sock");
    let tries: Vec<_> = (0..6)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || {
                let options = ConnectionOptions {
                    io_timeout: Duration::from_secs(1),
                    handshake_timeout: Duration::from_secs(1),
                };
                ImporterSession::connect(&path, options, &AccessPolicy::SameUser, 0, |_| Ok(())).map(|(s, _)| s)
            })
        })
        .collect();
    let results: Vec<_> = tries.into_iter().map(|t| t.join().unwrap()).collect();
    let served = results.iter().filter(|r| r.is_ok()).count();
    writeln!(child.stdin.as_mut().unwrap()).unwrap();
    let mut stats = String::new();
    while !stats.contains("stats ") {
        stats.clear();
        assert!(out.read_line(&mut stats).unwrap() > 0, "the child server exited early");
    }
    let n: Vec<u64> = stats[stats.find("stats ").unwrap() + 6..]
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let (importers, pauses, evicted, reported) = (n[0], n[1], n[2], n[3]);
    assert!(child.wait().unwrap().success());
    assert_eq!((served, importers), (2, 2), "{stats} {results:?}");
    // Those two spoke: nobody was shed for the newcomers. Accepting paused, at 10 ms doubling to
    // 1 s, for the second or so the others waited: a handful of pauses where a spinning loop
    // would have retried without end, and one error reported for the streak.
    assert_eq!(evicted, 0, "{stats}");
    assert!((1..=30).contains(&pauses), "{pauses} pauses");
    assert_eq!(reported, 1, "{stats}");
}

/// An importer asking for the fast release path, connected and reported.
fn connected_fast_importer(f: &Fixture) -> (ImporterSession, ImporterId) {
    let before = f.handler.connected().len();
    let (session, _) = ImporterSession::connect(
        &f.path,
        client_options(),
        &AccessPolicy::SameUser,
        protocol::CAP_FAST_RELEASE,
        |_| Ok(()),
    )
    .unwrap();
    f.handler
        .wait_for("the importer to be reported", |r| r.connected.len() > before);
    (session, f.handler.connected()[before])
}

#[test]
fn a_release_batch_from_a_fast_importer_reaches_the_exporter_in_one_go() {
    let f = serve(limits_for_sockets());
    let (session, id) = connected_fast_importer(&f);
    assert_eq!(session.capabilities(), protocol::CAP_FAST_RELEASE);
    for k in 1..=3 {
        f.reactor.send(id, &buffer_message(k), Some(BufferId(k))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(k));
    }
    session
        .release_batch(None, vec![BufferId(3), BufferId(1), BufferId(2)])
        .unwrap();
    f.handler.wait_for("three releases", |r| r.released.len() == 3);
    assert_eq!(
        f.handler.record.lock().unwrap().released,
        vec![(id, BufferId(3)), (id, BufferId(1)), (id, BufferId(2))]
    );
    // A bad id in a batch cuts the importer off like a bad release.
    session.release_batch(None, vec![BufferId(666)]).unwrap();
    f.handler.wait_for("the end", |r| !r.ended.is_empty());
    assert_eq!(f.handler.ended(id).map(|e| e.0), Some(false));
}

#[test]
fn a_release_batch_from_a_version_1_importer_is_refused() {
    let f = serve(limits_for_sockets());
    let (session, id) = connected_importer(&f);
    assert_eq!(session.capabilities(), 0);
    session.release_batch(None, vec![BufferId(1)]).unwrap();
    f.handler.wait_for("the end", |r| !r.ended.is_empty());
    assert_eq!(f.handler.ended(id).map(|e| e.0), Some(false));
    let err = session.recv_until(Some(Instant::now() + SOON)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Remote {
                code: ErrorCode::Protocol,
                ..
            }
        ),
        "{err}"
    );
    assert!(f.handler.record.lock().unwrap().released.is_empty());
}

#[test]
fn the_server_grants_vmm_to_an_importer_that_asks_and_sends_it_vmm_buffers_with_their_descriptor() {
    let f = serve(limits_for_sockets());
    let connect = |asked: u64| {
        let before = f.handler.connected().len();
        let (session, _) =
            ImporterSession::connect(&f.path, client_options(), &AccessPolicy::SameUser, asked, |_| Ok(())).unwrap();
        f.handler
            .wait_for("the importer to be reported", |r| r.connected.len() > before);
        let r = f.handler.record.lock().unwrap();
        (session, r.connected[before], r.capabilities[before])
    };
    // Version 1, fast release only, VMM only, and VMM with bits nobody knows.
    let (v1, _, granted) = connect(0);
    assert_eq!((v1.capabilities(), granted), (0, 0));
    let (fast, _, granted) = connect(protocol::CAP_FAST_RELEASE);
    assert_eq!(
        (fast.capabilities(), granted),
        (protocol::CAP_FAST_RELEASE, protocol::CAP_FAST_RELEASE)
    );
    let (vmm, vmm_id, granted) = connect(protocol::CAP_VMM);
    assert_eq!((vmm.capabilities(), granted), (protocol::CAP_VMM, protocol::CAP_VMM));
    let (both, _, granted) = connect(protocol::CAP_VMM | protocol::CAP_FAST_RELEASE | 1 << 40);
    assert_eq!(granted, protocol::CAP_VMM | protocol::CAP_FAST_RELEASE);
    assert_eq!(both.capabilities(), granted);
    let (chunks, _, granted) = connect(protocol::CAP_VMM_CHUNKS | protocol::CAP_VMM);
    assert_eq!(granted, protocol::CAP_VMM_CHUNKS | protocol::CAP_VMM);
    assert_eq!(chunks.capabilities(), granted);

    // A VmmBuffer queued with a descriptor arrives with it; the server closes its copy once sent.
    let name = unique_name("server-vmm");
    let alloc = memfd_with(&name, b"physical");
    let message = Message::VmmBuffer(protocol::testing::vmm_buffer(9));
    f.reactor
        .send_with_fds(vmm_id, &message, Some(BufferId(9)), vec![alloc])
        .unwrap();
    match vmm.recv_until(Some(Instant::now() + SOON)).unwrap() {
        ExporterEvent::VmmBuffer(d, fd) => {
            assert_eq!(d, protocol::testing::vmm_buffer(9));
            assert_eq!(read_all(fd), b"physical");
        }
        other => panic!("expected a VmmBuffer, got {other:?}"),
    }
    // The server closes its copy right after `sendmsg` returns, which can be a moment after the
    // importer has already read the frame: wait for it rather than race it.
    let deadline = Instant::now() + SOON;
    while open_fds_named(&name) != 0 {
        assert!(Instant::now() < deadline, "a copy of the descriptor stays open");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_server_sends_vmm_chunks_with_one_descriptor_per_chunk_in_order_and_refuses_a_wrong_count() {
    let f = serve(limits_for_sockets());
    let before = f.handler.connected().len();
    let asked = protocol::CAP_VMM | protocol::CAP_VMM_CHUNKS;
    let (session, _) =
        ImporterSession::connect(&f.path, client_options(), &AccessPolicy::SameUser, asked, |_| Ok(())).unwrap();
    f.handler
        .wait_for("the importer to be reported", |r| r.connected.len() > before);
    let id = f.handler.connected()[before];
    let name = unique_name("server-chunks");
    let chunks: Vec<_> = (0..3u8).map(|i| memfd_with(&name, &[b'a' + i; 4])).collect();
    let descriptor = protocol::testing::vmm_chunks(11, 3);
    let message = Message::VmmChunks(descriptor.clone());

    // A count that is not the message's is refused before anything is queued (and the descriptors
    // handed over are closed).
    let two: Vec<_> = (0..2).map(|_| memfd_with(&name, b"xx")).collect();
    match f.reactor.send_with_fds(id, &message, Some(BufferId(11)), two) {
        Err(Error::DescriptorCount { expected: 3, got: 2 }) => {}
        other => panic!("expected a descriptor count error, got {other:?}"),
    }

    f.reactor
        .send_with_fds(id, &message, Some(BufferId(11)), chunks)
        .unwrap();
    match session.recv_until(Some(Instant::now() + SOON)).unwrap() {
        ExporterEvent::VmmChunks(d, fds) => {
            assert_eq!(d, descriptor);
            let contents: Vec<Vec<u8>> = fds.into_iter().map(read_all).collect();
            assert_eq!(contents, vec![b"aaaa".to_vec(), b"bbbb".to_vec(), b"cccc".to_vec()]);
        }
        other => panic!("expected VmmChunks, got {other:?}"),
    }
    let deadline = Instant::now() + SOON;
    while open_fds_named(&name) != 0 {
        assert!(Instant::now() < deadline, "a copy of a chunk's descriptor stays open");
        std::thread::sleep(Duration::from_millis(5));
    }
}

mod rings;
