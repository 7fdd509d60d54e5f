//! The rings (protocol version 3) through the whole server, over real sockets and a real ring
//! region: negotiation with every kind of peer, buffers and releases through shared memory, a
//! full ring falling back to the socket, and importers that write their ring as a hostile peer
//! would, each cut off with a named error and reported as an unclean end (its leases reclaimed by
//! the exporter as for one that died).

use super::*;
use crate::protocol::{CAP_FAST_RELEASE, CAP_RING};
use crate::ring::{Direction, Geometry, Region};

const V3: u64 = CAP_FAST_RELEASE | CAP_RING;

fn importer_asking(path: &Path, capabilities: u64) -> Result<ImporterSession> {
    let (session, imported) =
        ImporterSession::connect(path, client_options(), &AccessPolicy::SameUser, capabilities, |uuid| {
            assert_eq!(*uuid, GPU);
            Ok(())
        })?;
    assert_eq!(read_all(imported.pool_fd), b"the pool");
    Ok(session)
}

/// Connects asking for `capabilities`; returns the session, its id and what the server granted.
fn connected_asking(f: &Fixture, capabilities: u64) -> (ImporterSession, ImporterId, u64) {
    let before = f.handler.connected().len();
    let session = importer_asking(&f.path, capabilities).unwrap();
    f.handler
        .wait_for("the importer to be reported", |r| r.connected.len() > before);
    let r = f.handler.record.lock().unwrap();
    (session, r.connected[before], r.capabilities[before])
}

fn limits_with_ring(ring: Option<Geometry>) -> Limits {
    Limits {
        ring,
        ..limits_for_sockets()
    }
}

fn released_by(f: &Fixture, id: ImporterId) -> BTreeSet<u64> {
    let r = f.handler.record.lock().unwrap();
    r.released.iter().filter(|(i, _)| *i == id).map(|(_, b)| b.0).collect()
}

#[test]
fn a_version_3_importer_gets_buffers_and_gives_releases_through_the_rings() {
    let f = serve(limits_with_ring(Some(Geometry::new(16, 256).unwrap())));
    let (session, id, granted) = connected_asking(&f, V3);
    assert_eq!(granted, V3);
    assert!(session.rings());
    let region = session.ring_region().unwrap();
    let head = |dir| {
        region
            .word(region.geometry().head(dir))
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    // More buffers than the ring holds, queued at once: the ring takes what fits, the socket the
    // rest; every one arrives, once.
    const N: u64 = 100;
    for n in 1..=N {
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
    }
    let mut got = BTreeSet::new();
    for _ in 1..=N {
        assert!(got.insert(recv_buffer(&session).0));
    }
    assert_eq!(got, (1..=N).collect());
    assert!(head(Direction::ToImporter) >= 16, "the ring carried buffers");
    // Releases go back through the ring, in batches of what a slot holds.
    let ids: Vec<BufferId> = (1..=N).map(BufferId).collect();
    session.release_batch(None, ids[..60].to_vec()).unwrap();
    for id in &ids[60..] {
        session.release(*id).unwrap();
    }
    f.handler.wait_for("every release", |r| {
        r.released.iter().filter(|(i, _)| *i == id).count() == N as usize
    });
    assert_eq!(released_by(&f, id), (1..=N).collect());
    assert!(head(Direction::ToExporter) >= 4, "the ring carried releases");
    assert_eq!(f.reactor.stats().peer_errors, 0);
    session.goodbye().unwrap();
    f.handler.wait_for("the end", |r| r.ended.iter().any(|e| e.0 == id));
    assert_eq!(f.handler.ended(id), Some((true, vec![])));
}

#[test]
fn releases_written_while_the_exporter_sleeps_ring_its_doorbell() {
    let f = serve(limits_with_ring(Some(Geometry::default())));
    let (session, id, _) = connected_asking(&f, V3);
    for n in 1..=3 {
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(n));
    }
    // One at a time, with the loop idle in between: each release needs the doorbell to be seen.
    for n in 1..=3 {
        std::thread::sleep(Duration::from_millis(20));
        session.release(BufferId(n)).unwrap();
        f.handler
            .wait_for("the release", |r| r.released.contains(&(id, BufferId(n))));
    }
    assert_eq!(f.reactor.stats().peer_errors, 0);
}

#[test]
fn every_pairing_of_versions_interoperates() {
    // Exporter offering the rings: version 1, version 2 and version 3 importers.
    let f = serve(limits_with_ring(Some(Geometry::default())));
    // Exporter without them: a version-3 importer stays on the socket (version 2).
    let g = serve(limits_with_ring(None));
    let cases: [(&Fixture, u64, u64); 5] = [
        (&f, 0, 0),
        (&f, CAP_FAST_RELEASE, CAP_FAST_RELEASE),
        (&f, V3, V3),
        (&g, V3, CAP_FAST_RELEASE),
        // The rings carry the fast release path's frames: not granted alone.
        (&f, CAP_RING, 0),
    ];
    for (i, (fx, asked, want)) in cases.into_iter().enumerate() {
        let (session, id, granted) = connected_asking(fx, asked);
        assert_eq!(granted, want, "case {i}");
        assert_eq!(session.rings(), want & CAP_RING != 0, "case {i}");
        let n = 10 + i as u64;
        fx.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(n), "case {i}");
        if want & CAP_FAST_RELEASE != 0 {
            session.release_batch(None, vec![BufferId(n)]).unwrap();
        } else {
            session.release(BufferId(n)).unwrap();
        }
        fx.handler
            .wait_for("the release", |r| r.released.contains(&(id, BufferId(n))));
        session.goodbye().unwrap();
        fx.handler.wait_for("the end", |r| r.ended.iter().any(|e| e.0 == id));
        assert_eq!(fx.handler.ended(id), Some((true, vec![])), "case {i}");
    }
    assert_eq!(f.reactor.stats().peer_errors + g.reactor.stats().peer_errors, 0);
}

#[test]
fn an_importer_that_never_reads_its_ring_gets_the_rest_on_the_socket() {
    // The frozen consumer: the ring fills, the exporter never waits on it.
    let f = serve(limits_with_ring(Some(Geometry::new(4, 256).unwrap())));
    let (session, id, _) = connected_asking(&f, V3);
    for n in 1..=20 {
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
    }
    let region = session.ring_region().unwrap();
    let head = region.word(region.geometry().head(Direction::ToImporter));
    let deadline = Instant::now() + SOON;
    while head.load(std::sync::atomic::Ordering::SeqCst) < 4 {
        assert!(Instant::now() < deadline, "the ring never filled");
        std::thread::sleep(Duration::from_millis(1));
    }
    wait_stats(&f, "everything written", |s| s.queued == 0);
    assert_eq!(
        head.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "no more than the ring holds"
    );
    let got: BTreeSet<u64> = (1..=20).map(|_| recv_buffer(&session).0).collect();
    assert_eq!(got, (1..=20).collect());
}

/// Connects a version-3 importer, shares buffers 1 and 2 with it (received), lets `scribble`
/// write its region as a hostile importer would, wakes the loop, and checks the importer is cut
/// off with an error whose text has `says`, reported as an unclean end.
fn cut_off_after(says: &str, scribble: impl FnOnce(&ImporterSession, &Region)) {
    let f = serve(limits_with_ring(Some(Geometry::new(8, 256).unwrap())));
    let (session, id, _) = connected_asking(&f, V3);
    for n in 1..=2 {
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(n));
    }
    let region = session.ring_region().unwrap();
    scribble(&session, &region);
    // A hostile importer need not ring the doorbell: whatever it wrote is found at the loop's next
    // round, whatever wakes it. Share a buffer (a push into the ring to the importer, which checks
    // its tail), then wake the loop.
    let _ = f.reactor.send(id, &buffer_message(3), Some(BufferId(3)));
    f.reactor.wake();
    f.handler
        .wait_for("the importer cut off", |r| r.ended.iter().any(|e| e.0 == id));
    let (clean, _) = f.handler.ended(id).unwrap();
    assert!(
        !clean,
        "a hostile importer's end is unclean (its buffers wait for its process)"
    );
    wait_stats(&f, "the peer error counted", |s| s.peer_errors == 1 && s.importers == 0);
    // What the importer was told: drain what arrived until the error.
    let told = loop {
        match session.recv_until(Some(Instant::now() + SOON)) {
            Ok(ExporterEvent::Buffer(_)) => continue,
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        told.to_string().contains(says),
        "told {told}, expected it to say {says:?}"
    );
}

fn put(region: &Region, word: usize, value: u64) {
    region.word(word).store(value, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn a_head_claiming_more_than_the_ring_holds_cuts_the_importer_off() {
    cut_off_after("the ring holds 8", |_, r| {
        put(r, r.geometry().head(Direction::ToExporter), 1 << 40);
    });
}

#[test]
fn a_head_that_moves_backwards_cuts_the_importer_off() {
    cut_off_after("backwards", |s, r| {
        s.release(BufferId(1)).unwrap();
        s.release(BufferId(2)).unwrap();
        // Wait until the exporter took both (its tail moved), then move the head back.
        let tail = r.geometry().tail(Direction::ToExporter);
        while r.word(tail).load(std::sync::atomic::Ordering::SeqCst) < 2 {
            std::thread::yield_now();
        }
        put(r, r.geometry().head(Direction::ToExporter), 1);
    });
}

#[test]
fn garbage_in_a_slot_cuts_the_importer_off() {
    cut_off_after("holds sequence", |_, r| {
        let g = r.geometry();
        for i in 0..g.slot_words() {
            put(r, g.slot(Direction::ToExporter, 0) + i, 0xdead_beef_0bad_f00d);
        }
        put(r, g.head(Direction::ToExporter), 1);
    });
}

#[test]
fn a_slot_length_beyond_the_slot_cuts_the_importer_off() {
    cut_off_after("bytes long", |_, r| {
        let g = r.geometry();
        put(r, g.slot(Direction::ToExporter, 0), 0);
        put(r, g.slot(Direction::ToExporter, 0) + 1, 1 << 20);
        put(r, g.head(Direction::ToExporter), 1);
    });
}

#[test]
fn a_well_formed_slot_holding_no_valid_frame_cuts_the_importer_off() {
    cut_off_after("magic", |_, r| {
        let g = r.geometry();
        put(r, g.slot(Direction::ToExporter, 0), 0);
        put(r, g.slot(Direction::ToExporter, 0) + 1, 20);
        put(r, g.slot(Direction::ToExporter, 0) + 2, 0x4141_4141_4141_4141);
        put(r, g.head(Direction::ToExporter), 1);
    });
}

#[test]
fn a_frame_other_than_a_release_in_the_ring_cuts_the_importer_off() {
    cut_off_after("in the importer's ring", |_, r| {
        let g = r.geometry();
        let frame = protocol::encode(&buffer_message(7)).unwrap();
        put(r, g.slot(Direction::ToExporter, 0), 0);
        put(r, g.slot(Direction::ToExporter, 0) + 1, frame.len() as u64);
        for (i, chunk) in frame.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            put(r, g.slot(Direction::ToExporter, 0) + 2 + i, u64::from_le_bytes(word));
        }
        put(r, g.head(Direction::ToExporter), 1);
    });
}

#[test]
fn a_release_the_exporter_refuses_in_the_ring_cuts_the_importer_off() {
    // The recorder refuses buffer 666 (as the lease table refuses one not held).
    cut_off_after("666", |s, _| {
        s.release(BufferId(666)).unwrap();
    });
}

#[test]
fn a_tail_past_the_head_of_the_exporters_ring_cuts_the_importer_off() {
    cut_off_after("past the head", |_, r| {
        put(r, r.geometry().tail(Direction::ToImporter), 1 << 30);
    });
}

#[test]
fn a_region_that_is_not_a_ring_region_is_refused_by_the_importer() {
    // The importer checks what the exporter sends too: an unsealed memfd is refused at the
    // handshake (`Region::open`), with the reason.
    let unsealed = memfd_with(&unique_name("not-a-ring"), &[0u8; 8192]);
    let e = Region::open(unsealed).unwrap_err();
    assert!(e.to_string().contains("sealed"), "{e}");
}

#[test]
fn buffers_in_the_ring_come_before_the_exporters_goodbye_and_releases_in_the_ring_before_the_importers() {
    let f = serve(limits_with_ring(Some(Geometry::new(64, 256).unwrap())));
    let (session, id, _) = connected_asking(&f, V3);
    for n in 1..=40 {
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
    }
    // Goodbye goes on the socket, after the buffers went into the ring: the importer hands out every
    // buffer first, whenever it happens to look at its socket.
    f.reactor.begin_shutdown();
    let mut got = Vec::new();
    loop {
        match session.recv_until(Some(Instant::now() + SOON)).unwrap() {
            ExporterEvent::Buffer(b) => got.push(b.buffer_id.0),
            ExporterEvent::Goodbye => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, (1..=40).collect::<Vec<_>>());
    // Releases written into the ring just before the importer's Goodbye are handled before it.
    for n in 1..=40 {
        session.release(BufferId(n)).unwrap();
    }
    session.goodbye().unwrap();
    f.handler.wait_for("the end", |r| r.ended.iter().any(|e| e.0 == id));
    assert_eq!(released_by(&f, id), (1..=40).collect());
    assert_eq!(f.handler.ended(id), Some((true, vec![])));
}

#[test]
fn traffic_through_the_rings_counts_against_the_idle_timeout() {
    let f = serve(Limits {
        idle_timeout: Some(Duration::from_secs(2)),
        ..limits_with_ring(Some(Geometry::default()))
    });
    let (session, id, _) = connected_asking(&f, V3);
    // Buffers only through the ring for more than twice the idle timeout: no byte on the socket.
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < Duration::from_millis(4500) {
        n += 1;
        f.reactor.send(id, &buffer_message(n), Some(BufferId(n))).unwrap();
        assert_eq!(recv_buffer(&session), BufferId(n));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        f.handler.ended(id).is_none(),
        "cut off as idle while buffers flowed through its ring"
    );
    // Then nothing either way: cut off as idle.
    f.handler
        .wait_for("the idle end", |r| r.ended.iter().any(|e| e.0 == id));
    let err = session.recv_until(Some(Instant::now() + SOON)).unwrap_err();
    assert!(
        matches!(&err, Error::Remote { code: ErrorCode::Timeout, text } if text.contains("idle")),
        "{err}"
    );
}

// ---- the loop's spin over the rings, and batches merged as they are drained ----

/// Writes `messages` into the ring to the exporter as the importer would, and publishes them at
/// once (one store of the head: the loop sees them together), ringing no doorbell.
fn write_releases(region: &Arc<Region>, messages: &[Message]) {
    let mut tx = crate::ring::Producer::new(region.clone(), Direction::ToExporter);
    for m in messages {
        assert!(tx.push(&protocol::encode(m).unwrap()).unwrap(), "the ring has room");
    }
    let _ = tx.publish();
}

fn batch(event: Option<u8>, ids: &[u64]) -> Message {
    Message::ReleaseBatch(ReleaseBatch {
        event: event.map(|e| crate::protocol::EventHandle([e; 64])),
        buffers: ids.iter().copied().map(BufferId).collect(),
    })
}

#[test]
fn consecutive_release_batches_with_one_event_are_handled_as_one_batch() {
    let f = serve(limits_with_ring(Some(Geometry::new(16, 256).unwrap())));
    let (session, id, _) = connected_asking(&f, V3);
    let region = session.ring_region().unwrap();
    // The importer's own producer end never wrote: this one starts where it would.
    write_releases(
        &region,
        &[
            batch(None, &[1, 2]),
            batch(None, &[3]),
            batch(Some(7), &[4]),
            batch(Some(7), &[5, 6]),
            Message::Release { buffer_id: BufferId(9) },
            batch(Some(7), &[10]),
            batch(Some(8), &[11]),
        ],
    );
    f.reactor.wake();
    f.handler.wait_for("every release", |r| {
        r.released.iter().filter(|(i, _)| *i == id).count() == 9
    });
    let batches = f.handler.record.lock().unwrap().batches.clone();
    // Same event, one after the other: one handling each run; a plain Release or another event
    // ends a run.
    assert_eq!(
        batches,
        vec![vec![1, 2, 3], vec![4, 5, 6], vec![10], vec![11]],
        "batches as the exporter handled them"
    );
    let order: Vec<u64> = f
        .handler
        .record
        .lock()
        .unwrap()
        .released
        .iter()
        .filter(|(i, _)| *i == id)
        .map(|(_, b)| b.0)
        .collect();
    assert_eq!(order, vec![1, 2, 3, 4, 5, 6, 9, 10, 11], "in the order written");
    assert_eq!(f.reactor.stats().peer_errors, 0);
}

/// The exporter's waiting flag in the ring from the importer (1 while its loop may sleep).
fn exporter_waiting(region: &Region) -> u32 {
    region
        .flag(region.geometry().consumer_waiting(Direction::ToExporter))
        .load(std::sync::atomic::Ordering::SeqCst)
}

#[test]
fn after_ring_traffic_the_loop_spins_with_its_flag_clear_and_sleeps_with_it_set_once_the_spin_is_off() {
    let f = serve(limits_with_ring(Some(Geometry::default())));
    // Long enough that the test's steps all fall inside it, however slow the machine.
    f.reactor.set_ring_spin(Duration::from_secs(5));
    let (session, id, _) = connected_asking(&f, V3);
    let region = session.ring_region().unwrap();
    f.reactor.send(id, &buffer_message(1), Some(BufferId(1))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(1));
    session.release(BufferId(1)).unwrap();
    f.handler
        .wait_for("the first release", |r| r.released.contains(&(id, BufferId(1))));
    // Spinning after that traffic: the flag stays clear, so the next release rings no doorbell and
    // is still found.
    for _ in 0..20 {
        assert_eq!(exporter_waiting(&region), 0, "the spinning loop set its waiting flag");
        std::thread::sleep(Duration::from_millis(1));
    }
    f.reactor.send(id, &buffer_message(2), Some(BufferId(2))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(2));
    session.release(BufferId(2)).unwrap();
    f.handler
        .wait_for("the second release", |r| r.released.contains(&(id, BufferId(2))));
    // Spin off: the loop stops spinning at once, sets its flag and sleeps; a release then rings.
    f.reactor.set_ring_spin(Duration::ZERO);
    let deadline = Instant::now() + SOON;
    while exporter_waiting(&region) == 0 {
        assert!(Instant::now() < deadline, "the loop never set its waiting flag");
        std::thread::sleep(Duration::from_millis(1));
    }
    f.reactor.send(id, &buffer_message(3), Some(BufferId(3))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(3));
    session.release(BufferId(3)).unwrap();
    f.handler.wait_for("the third release, by the doorbell", |r| {
        r.released.contains(&(id, BufferId(3)))
    });
    assert_eq!(f.reactor.stats().peer_errors, 0);
}

#[test]
fn a_spinning_loop_still_serves_sockets_and_new_importers() {
    let f = serve(limits_with_ring(Some(Geometry::default())));
    f.reactor.set_ring_spin(Duration::from_secs(5));
    let (session, id, _) = connected_asking(&f, V3);
    f.reactor.send(id, &buffer_message(1), Some(BufferId(1))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(1));
    session.release(BufferId(1)).unwrap();
    f.handler
        .wait_for("the release", |r| r.released.contains(&(id, BufferId(1))));
    // The loop spins now: a new importer's handshake (socket traffic only) still completes, and a
    // version-2 importer's socket releases are still read.
    let (other, other_id, granted) = connected_asking(&f, CAP_FAST_RELEASE);
    assert_eq!(granted, CAP_FAST_RELEASE);
    f.reactor.send(other_id, &buffer_message(2), Some(BufferId(2))).unwrap();
    assert_eq!(recv_buffer(&other), BufferId(2));
    other.release_batch(None, vec![BufferId(2)]).unwrap();
    f.handler
        .wait_for("the socket release", |r| r.released.contains(&(other_id, BufferId(2))));
    assert_eq!(f.reactor.stats().peer_errors, 0);
}

#[test]
fn a_ring_scribbled_over_while_the_loop_spins_cuts_the_importer_off() {
    let f = serve(limits_with_ring(Some(Geometry::new(8, 256).unwrap())));
    f.reactor.set_ring_spin(Duration::from_secs(5));
    let (session, id, _) = connected_asking(&f, V3);
    f.reactor.send(id, &buffer_message(1), Some(BufferId(1))).unwrap();
    assert_eq!(recv_buffer(&session), BufferId(1));
    session.release(BufferId(1)).unwrap();
    f.handler
        .wait_for("the release", |r| r.released.contains(&(id, BufferId(1))));
    // No doorbell, no wake-up: the spin itself finds the broken head.
    let region = session.ring_region().unwrap();
    put(&region, region.geometry().head(Direction::ToExporter), 1 << 40);
    f.handler
        .wait_for("the importer cut off", |r| r.ended.iter().any(|e| e.0 == id));
    let (clean, _) = f.handler.ended(id).unwrap();
    assert!(!clean);
    wait_stats(&f, "the peer error counted", |s| s.peer_errors == 1);
}

#[test]
fn a_loop_spinning_through_a_stream_of_releases_handles_each_and_still_runs_its_timers() {
    // Past the ids the test handler refuses.
    const FIRST: u64 = 1 << 20;
    let f = serve(Limits {
        handshake_timeout: Duration::from_millis(500),
        ..limits_with_ring(Some(Geometry::new(16, 256).unwrap()))
    });
    f.reactor.set_ring_spin(Duration::from_secs(5));
    let (session, id, _) = connected_asking(&f, V3);
    let region = session.ring_region().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let written = std::thread::scope(|scope| {
        // Releases keep coming (the importer's own producer end never wrote: this one starts where
        // it would), ringing the doorbell only while the loop sleeps: the spin handles them as it
        // finds them, and its window never closes.
        let writer = scope.spawn(|| {
            let mut tx = crate::ring::Producer::new(region.clone(), Direction::ToExporter);
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let frame = protocol::encode(&batch(None, &[FIRST + n])).unwrap();
                if tx.push(&frame).unwrap() {
                    n += 1;
                    if tx.publish() {
                        // The loop sleeps (before the first release): the doorbell, as the
                        // importer rings it.
                        f.reactor.wake();
                    }
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            n
        });
        // Stops the writer however this thread leaves the scope (a failed wait included).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _stop = Stop(&stop);
        f.handler
            .wait_for("releases handled by the spin", |r| r.released.len() >= 20);
        // A connection that never speaks: only the loop's timers end it, so the spin must let the
        // loop go round while the releases keep coming.
        let silent = UnixStream::connect(&f.path).unwrap();
        wait_stats(&f, "the silent handshake timed out", |s| s.timed_out == 1);
        drop(silent);
        drop(_stop);
        writer.join().unwrap()
    });
    f.handler
        .wait_for("every release", |r| r.released.len() as u64 == written);
    let order: Vec<u64> = released_in_order(&f, id);
    assert_eq!(
        order,
        (FIRST..FIRST + written).collect::<Vec<u64>>(),
        "each release once, in the order written"
    );
    assert_eq!(f.reactor.stats().peer_errors, 0);
}

fn released_in_order(f: &Fixture, id: ImporterId) -> Vec<u64> {
    let r = f.handler.record.lock().unwrap();
    r.released.iter().filter(|(i, _)| *i == id).map(|(_, b)| b.0).collect()
}

/// Not a test: a host-only measurement of the ring path's system calls and wake-ups per buffer
/// (the counters of `trace::counters`, this process being both sides), with the loop's spin and
/// without. Four importers, each with a thread that shares with a window of 4 buffers and one that
/// receives and releases each buffer as it comes (the sustained shape of `ipc_handoff`, without
/// the GPU). Run alone, so no other test adds to the counters:
/// `cargo test -p mempool-ipc --lib ring_handoff_counts -- --ignored --nocapture`.
#[test]
#[ignore]
fn ring_handoff_counts() {
    const IMPORTERS: usize = 4;
    const PER: u64 = 5000;
    const WINDOW: u64 = 4;
    for spin in [Duration::ZERO, super::super::DEFAULT_RING_SPIN] {
        let f = serve(limits_with_ring(Some(Geometry::default())));
        f.reactor.set_ring_spin(spin);
        let sessions: Vec<(ImporterSession, ImporterId)> = (0..IMPORTERS)
            .map(|_| {
                let (s, id, _) = connected_asking(&f, V3);
                (s, id)
            })
            .collect();
        crate::trace::reset_counters();
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (k, (session, id)) in sessions.iter().enumerate() {
                let base = (k as u64 + 1) << 32;
                scope.spawn(move || {
                    for _ in 0..PER {
                        let b = recv_buffer(session);
                        session.release_batch(None, vec![b]).unwrap();
                    }
                });
                let f = &f;
                let id = *id;
                scope.spawn(move || {
                    for n in 0..PER {
                        if n >= WINDOW {
                            let want = (n - WINDOW + 1) as usize;
                            f.handler.wait_for("the window", |r| {
                                r.released.iter().filter(|(i, _)| *i == id).count() >= want
                            });
                        }
                        f.reactor
                            .send(id, &buffer_message(base + n), Some(BufferId(base + n)))
                            .unwrap();
                    }
                });
            }
        });
        f.handler
            .wait_for("every release", |r| r.released.len() == IMPORTERS * PER as usize);
        let elapsed = start.elapsed();
        let c = crate::trace::counters();
        let n = (IMPORTERS as u64 * PER) as f64;
        println!(
            "spin {spin:?}: {:.0} buffers/s; per buffer: futex wake {:.2}, futex wait {:.2}, RingBell {:.2}, \
             socket poll {:.2}, loop sleep {:.2}, loop spin hit {:.2}",
            n / elapsed.as_secs_f64(),
            c.futex_wakes as f64 / n,
            c.futex_waits as f64 / n,
            c.bells_sent as f64 / n,
            c.socket_polls as f64 / n,
            c.loop_sleeps as f64 / n,
            c.loop_spin_hits as f64 / n,
        );
        assert_eq!(f.reactor.stats().peer_errors, 0);
    }
}

#[test]
fn the_server_refuses_rings_whose_slots_cannot_hold_a_buffer_frame() {
    // Issue 33, finding 6: with slots under 104 bytes the importer's batch size underflowed (a
    // panic in debug builds, releases silently on the socket in release builds), and slots under
    // 208 bytes hold no `Buffer` frame at all. Such rings are refused when the server starts, with
    // the slot size and the minimum named.
    for slot in [32, 64, 96, 104, 200] {
        let dir = TempDir::new("server-small-slots");
        let listener = Listener::bind_with(dir.join("pool.sock"), ListenerOptions::default()).unwrap();
        let handler: Arc<dyn Handler> = Arc::new(Recorder::default());
        let limits = limits_with_ring(Some(Geometry::new(4, slot).unwrap()));
        let pool = memfd_with(&unique_name("server-small-slots"), b"the pool");
        let err = match Reactor::start(listener, ANNOUNCEMENT, pool, limits, handler) {
            Ok(_) => panic!("the server accepted rings of {slot}-byte slots"),
            Err(e) => e,
        };
        assert!(
            matches!(err, Error::RingSlotTooSmall { slot_bytes, min: 208 } if slot_bytes == slot),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("{slot}-byte slots")) && text.contains("at least 208 bytes"),
            "{text}"
        );
    }
    // The smallest slot that holds a `Buffer` frame serves buffers through the ring.
    let f = serve(limits_with_ring(Some(Geometry::new(4, 208).unwrap())));
    let (session, id, granted) = connected_asking(&f, V3);
    assert_eq!(granted, V3);
    f.reactor
        .send(id, &Message::Buffer(buffer(7)), Some(BufferId(7)))
        .unwrap();
    match session.recv_until(Some(Instant::now() + SOON)).unwrap() {
        ExporterEvent::Buffer(b) => assert_eq!(b.buffer_id, BufferId(7)),
        other => panic!("expected the buffer, got {other:?}"),
    }
    let region = session.ring_region().unwrap();
    assert_eq!(
        region
            .word(region.geometry().head(Direction::ToImporter))
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the buffer came through the ring"
    );
    // A batch longer than a 208-byte slot holds (13 ids) is split across slots.
    session.release_batch(None, (1..=20).map(BufferId).collect()).unwrap();
    f.handler.wait_for("the releases", |r| {
        r.released.iter().filter(|(i, _)| *i == id).count() == 20
    });
    assert_eq!(released_by(&f, id), (1..=20).collect());
}
