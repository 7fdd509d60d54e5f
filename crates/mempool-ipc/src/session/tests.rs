//! The handshake and the conversation after it, between real sockets, with a memfd for the
//! pool and a simulated pool for the buffers.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread;

use super::{ExporterEvent, ExporterSession, ImporterEvent, ImporterSession, PoolAnnouncement};
use crate::connection::{short_options, Connection};
use crate::error::{Error, Result};
use crate::lease::{ImportTable, ImporterId, LeaseError, LeaseTable};
use crate::protocol::testing::{buffer, expect_error_then_eof, read_frame, GPU, OTHER_GPU, POOL};
use crate::protocol::{
    self, BufferId, DeviceUuid, ErrorCode, EventHandle, Message, MessageType, PoolDescriptor, PoolId, ProtocolError,
    Ready, ReleaseBatch, Welcome, CAP_FAST_RELEASE,
};
use crate::test_util::{is_cloexec, memfd_with, open_fds_named, read_all, unique_name, TempDir};
use mempool_socket::cred::AccessPolicy;
use mempool_socket::fdpass;
use mempool_socket::listener::Listener;
use mempool_socket::ConnectionOptions;

const ANNOUNCEMENT: PoolAnnouncement = PoolAnnouncement {
    device_uuid: GPU,
    pool_id: POOL,
};

/// The importer's device lookup on a machine whose only GPU is `GPU`.
fn find_gpu(uuid: &DeviceUuid) -> Result<u32> {
    if *uuid == GPU {
        Ok(0)
    } else {
        Err(Error::DeviceNotVisible { uuid: *uuid })
    }
}

fn send_raw(raw: &mut UnixStream, message: &Message) {
    raw.write_all(&protocol::encode(message).unwrap()).unwrap();
}

/// Runs a successful handshake over a socket pair; the pool memfd holds `contents`.
fn handshake_pair(pool: &OwnedFd) -> (ExporterSession, ImporterSession, OwnedFd) {
    let (e, i) = Connection::pair(short_options()).unwrap();
    let importer = thread::spawn(move || ImporterSession::handshake(i, find_gpu));
    let exporter = ExporterSession::handshake(e, ANNOUNCEMENT, pool.as_fd()).unwrap();
    let (importer, imported) = importer.join().unwrap().unwrap();
    assert_eq!(imported.device, 0);
    (exporter, importer, imported.pool_fd)
}

#[test]
fn handshake_hands_over_the_pool() {
    let name = unique_name("session-pool");
    let pool = memfd_with(&name, b"exported pool");
    let (exporter, importer, pool_fd) = handshake_pair(&pool);
    assert!(is_cloexec(&pool_fd));
    assert_eq!(importer.device_uuid(), GPU);
    assert_eq!(importer.pool_id(), POOL);
    assert_eq!(exporter.announcement(), &ANNOUNCEMENT);
    assert_eq!(importer.exporter_credentials().unwrap().pid, std::process::id() as i32);
    assert_eq!(read_all(pool_fd), b"exported pool");
    drop(pool);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn handshake_over_a_listener() {
    let dir = TempDir::new("session-listener");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let pool = memfd_with(&unique_name("listener-pool"), b"via the listener");
    let importer =
        thread::spawn(move || ImporterSession::connect(&path, short_options(), &AccessPolicy::SameUser, 0, find_gpu));
    let (conn, peer) = crate::connection::accept(&listener).unwrap();
    assert_eq!(peer.pid, std::process::id() as i32);
    let _exporter = ExporterSession::handshake(conn, ANNOUNCEMENT, pool.as_fd()).unwrap();
    let (_importer, imported) = importer.join().unwrap().unwrap();
    assert_eq!(read_all(imported.pool_fd), b"via the listener");
}

#[test]
fn importer_refuses_an_exporter_outside_its_policy() {
    let dir = TempDir::new("session-exporter-policy");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let other_uid = rustix::process::geteuid().as_raw().wrapping_add(1);
    let err = ImporterSession::connect(
        &path,
        short_options(),
        &AccessPolicy::allow_uids([other_uid]),
        0,
        find_gpu,
    )
    .unwrap_err();
    assert!(matches!(err, Error::PeerCredentials { .. }), "{err}");
    let (conn, _) = crate::connection::accept(&listener).unwrap();
    let pool = memfd_with(&unique_name("unused"), b"");
    let err = ExporterSession::handshake(conn, ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Remote {
                code: ErrorCode::PermissionDenied,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn exporter_rejects_an_importer_on_another_gpu() {
    let name = unique_name("wrong-gpu");
    let pool = memfd_with(&name, b"x");
    let (e, mut raw) = UnixStream::pair().unwrap();
    let exporter = thread::spawn(move || {
        let result = ExporterSession::handshake(Connection::new(e, short_options()), ANNOUNCEMENT, pool.as_fd());
        result.map(|_| ())
    });
    send_raw(&mut raw, &Message::Hello);
    assert_eq!(
        read_frame(&mut raw).unwrap(),
        Message::Welcome(Welcome {
            device_uuid: GPU,
            pool_id: POOL
        })
    );
    send_raw(&mut raw, &Message::Ready(Ready { device_uuid: OTHER_GPU }));
    let err = exporter.join().unwrap().unwrap_err();
    assert!(
        matches!(err, Error::WrongDevice { expected_uuid, got } if expected_uuid == GPU && got == OTHER_GPU),
        "{err}"
    );
    // The importer is told, and never receives the pool.
    assert_eq!(expect_error_then_eof(&mut raw).code, ErrorCode::WrongDevice);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn importer_that_does_not_see_the_gpu_says_so() {
    let pool = memfd_with(&unique_name("invisible"), b"x");
    let (e, i) = Connection::pair(short_options()).unwrap();
    let importer = thread::spawn(move || {
        ImporterSession::handshake(i, |uuid| Err::<(), _>(Error::DeviceNotVisible { uuid: *uuid })).map(|_| ())
    });
    let err = ExporterSession::handshake(e, ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    match err {
        Error::Remote { code, text } => {
            assert_eq!(code, ErrorCode::WrongDevice);
            assert!(text.contains(&GPU.to_string()), "{text}");
        }
        other => panic!("expected the importer's error, got {other}"),
    }
    assert!(matches!(
        importer.join().unwrap().unwrap_err(),
        Error::DeviceNotVisible { uuid } if uuid == GPU
    ));
}

#[test]
fn silent_importer_times_out_the_handshake() {
    let pool = memfd_with(&unique_name("silent"), b"x");
    let (e, mut raw) = UnixStream::pair().unwrap();
    let err = ExporterSession::handshake(Connection::new(e, short_options()), ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    assert!(matches!(err, Error::Timeout { during: "handshake" }), "{err}");
    assert_eq!(expect_error_then_eof(&mut raw).code, ErrorCode::Timeout);
}

#[test]
fn importer_stalling_after_hello_times_out_the_handshake() {
    // Hello arrives, then nothing: the deadline covers the whole handshake, not each step.
    let pool = memfd_with(&unique_name("stall"), b"x");
    let (e, mut raw) = UnixStream::pair().unwrap();
    send_raw(&mut raw, &Message::Hello);
    let err = ExporterSession::handshake(Connection::new(e, short_options()), ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    assert!(matches!(err, Error::Timeout { during: "handshake" }), "{err}");
}

#[test]
fn silent_exporter_times_out_the_importer() {
    let (i, _raw) = UnixStream::pair().unwrap();
    let err = ImporterSession::handshake(Connection::new(i, short_options()), find_gpu).unwrap_err();
    assert!(matches!(err, Error::Timeout { during: "handshake" }), "{err}");
}

#[test]
fn out_of_order_message_in_the_handshake() {
    let pool = memfd_with(&unique_name("order"), b"x");
    let (e, mut raw) = UnixStream::pair().unwrap();
    send_raw(&mut raw, &Message::Release { buffer_id: BufferId(1) });
    let err = ExporterSession::handshake(Connection::new(e, short_options()), ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                expected: "Hello",
                got: MessageType::Release
            }
        ),
        "{err}"
    );
    let told = expect_error_then_eof(&mut raw);
    assert_eq!(told.code, ErrorCode::Protocol);
    assert!(told.text.contains("expected Hello"), "{}", told.text);
}

#[test]
fn exporter_skipping_a_step_is_rejected() {
    let (i, mut raw) = UnixStream::pair().unwrap();
    let importer =
        thread::spawn(move || ImporterSession::handshake(Connection::new(i, short_options()), find_gpu).map(|_| ()));
    assert_eq!(read_frame(&mut raw).unwrap(), Message::Hello);
    send_raw(&mut raw, &Message::Buffer(buffer(1)));
    let err = importer.join().unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                expected: "Welcome",
                got: MessageType::Buffer
            }
        ),
        "{err}"
    );
    expect_error_then_eof(&mut raw);
}

#[test]
fn pool_descriptor_must_name_the_announced_pool() {
    let name = unique_name("other-pool");
    let (i, mut raw) = UnixStream::pair().unwrap();
    let importer =
        thread::spawn(move || ImporterSession::handshake(Connection::new(i, short_options()), find_gpu).map(|_| ()));
    assert_eq!(read_frame(&mut raw).unwrap(), Message::Hello);
    send_raw(
        &mut raw,
        &Message::Welcome(Welcome {
            device_uuid: GPU,
            pool_id: POOL,
        }),
    );
    assert_eq!(
        read_frame(&mut raw).unwrap(),
        Message::Ready(Ready { device_uuid: GPU })
    );
    let other = protocol::encode(&Message::PoolDescriptor(PoolDescriptor {
        pool_id: PoolId([0x77; 16]),
    }))
    .unwrap();
    let memfd = memfd_with(&name, b"x");
    fdpass::send_with_fds(&raw, &other, &[memfd.as_fd()]).unwrap();
    drop(memfd);
    let err = importer.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Protocol(ProtocolError::Violation { .. })), "{err}");
    assert_eq!(open_fds_named(&name), 0, "the rejected pool descriptor leaked");
}

#[test]
fn importer_speaking_another_version_is_told() {
    let pool = memfd_with(&unique_name("version"), b"x");
    let (e, mut raw) = UnixStream::pair().unwrap();
    let mut hello = protocol::encode(&Message::Hello).unwrap();
    hello[4..6].copy_from_slice(&7u16.to_le_bytes());
    raw.write_all(&hello).unwrap();
    let err = ExporterSession::handshake(Connection::new(e, short_options()), ANNOUNCEMENT, pool.as_fd()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Protocol(ProtocolError::UnsupportedVersion { got: 7, supported: 2 })
        ),
        "{err}"
    );
    assert_eq!(expect_error_then_eof(&mut raw).code, ErrorCode::UnsupportedVersion);
}

#[test]
fn buffers_and_releases_after_the_handshake() {
    let pool = memfd_with(&unique_name("steady"), b"x");
    let (exporter, importer, _pool_fd) = handshake_pair(&pool);
    for id in 0..3 {
        exporter.share(&buffer(id)).unwrap();
    }
    for id in 0..3 {
        let got = importer.recv().unwrap();
        assert!(matches!(got, ExporterEvent::Buffer(b) if b == buffer(id)), "{got:?}");
    }
    importer.release(BufferId(1)).unwrap();
    assert_eq!(exporter.recv().unwrap(), ImporterEvent::Release(BufferId(1)));
    // The exporter shuts down: it shares nothing more, but still hears the releases.
    exporter.goodbye().unwrap();
    assert!(matches!(exporter.share(&buffer(3)).unwrap_err(), Error::WriteClosed));
    let got = importer.recv().unwrap();
    assert!(matches!(got, ExporterEvent::Goodbye), "{got:?}");
    assert!(matches!(importer.recv().unwrap_err(), Error::Closed));
    for id in [0, 2] {
        importer.release(BufferId(id)).unwrap();
        assert_eq!(exporter.recv().unwrap(), ImporterEvent::Release(BufferId(id)));
    }
    importer.goodbye().unwrap();
    assert_eq!(exporter.recv().unwrap(), ImporterEvent::Goodbye);
    assert!(matches!(exporter.recv().unwrap_err(), Error::ConnectionFailed));
}

#[test]
fn importer_sending_exporter_messages_is_cut_off() {
    let pool = memfd_with(&unique_name("hostile"), b"x");
    let (exporter, importer, _pool_fd) = handshake_pair(&pool);
    importer.connection().send(&Message::Buffer(buffer(9)), &[]).unwrap();
    let err = exporter.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                got: MessageType::Buffer,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        importer.recv().unwrap_err(),
        Error::Remote {
            code: ErrorCode::Protocol,
            ..
        }
    ));
}

/// A simulated pool: allocations are numbers, frees are recorded.
#[derive(Default)]
struct SimPool {
    freed: Vec<u64>,
}

#[derive(Debug, PartialEq, Eq)]
struct SimAlloc(u64);

/// The exporter's loop for one importer, as the GPU exporter will run it: releases and the
/// end of the connection go through the lease table, and whatever it hands back is freed.
fn serve_importer(
    session: ExporterSession,
    id: ImporterId,
    leases: Arc<Mutex<LeaseTable<SimAlloc>>>,
    pool: Arc<Mutex<SimPool>>,
) -> Error {
    let free = |allocs: Vec<SimAlloc>| pool.lock().unwrap().freed.extend(allocs.into_iter().map(|a| a.0));
    loop {
        match session.recv() {
            Ok(ImporterEvent::Release(buffer)) => {
                let released = leases.lock().unwrap().release(buffer, id);
                match released {
                    Ok(freed) => free(freed.into_iter().collect()),
                    Err(err) => {
                        free(disconnect(&leases, id));
                        return session.reject(err.into());
                    }
                }
            }
            Ok(ImporterEvent::ReleaseBatch(batch)) => {
                for buffer in batch.buffers {
                    let released = leases.lock().unwrap().release(buffer, id);
                    match released {
                        Ok(freed) => free(freed.into_iter().collect()),
                        Err(err) => {
                            free(disconnect(&leases, id));
                            return session.reject(err.into());
                        }
                    }
                }
            }
            Ok(ImporterEvent::Goodbye) => {
                free(disconnect(&leases, id));
                return Error::Closed;
            }
            Ok(ImporterEvent::RingBell) => unreachable!("this exporter does not grant the rings"),
            Err(err) => {
                free(disconnect(&leases, id));
                return err;
            }
        }
    }
}

fn disconnect(leases: &Mutex<LeaseTable<SimAlloc>>, id: ImporterId) -> Vec<SimAlloc> {
    leases
        .lock()
        .unwrap()
        .disconnect(id)
        .into_iter()
        .map(|(_, a)| a)
        .collect()
}

#[test]
fn buffers_are_freed_after_the_last_importer_lets_go() {
    let pool_fd = memfd_with(&unique_name("e2e"), b"x");
    let leases = Arc::new(Mutex::new(LeaseTable::new()));
    let pool = Arc::new(Mutex::new(SimPool::default()));

    // Two importers; the exporter allocates four buffers and shares all with both.
    let (ea, ia, _) = handshake_pair(&pool_fd);
    let (eb, ib, _) = handshake_pair(&pool_fd);
    let (a, b) = (ImporterId(1), ImporterId(2));
    for id in 0..4 {
        let mut table = leases.lock().unwrap();
        table.insert(BufferId(id), SimAlloc(id)).unwrap();
        table.grant(BufferId(id), a).unwrap();
        table.grant(BufferId(id), b).unwrap();
        drop(table);
        ea.share(&buffer(id)).unwrap();
        eb.share(&buffer(id)).unwrap();
    }
    // The exporter is done with all of them itself; nothing may be freed yet.
    for id in 0..4 {
        assert_eq!(leases.lock().unwrap().release_owner(BufferId(id)).unwrap(), None);
    }

    let serve = |session, id| {
        let (leases, pool) = (leases.clone(), pool.clone());
        thread::spawn(move || serve_importer(session, id, leases, pool))
    };
    let server_a = serve(ea, a);
    let server_b = serve(eb, b);

    // Importer A: imports blocks once, releases everything the protocol way, says goodbye.
    let mut imports_a = ImportTable::new();
    for _ in 0..4 {
        let ExporterEvent::Buffer(descriptor) = ia.recv().unwrap() else {
            panic!("expected a buffer")
        };
        imports_a
            .add(&descriptor, |d| Ok::<_, Error>(format!("import of {}", d.block_id)))
            .unwrap();
    }
    // buffer(id) puts ids 0..4 in one block: imported once.
    assert_eq!(imports_a.block_count(), 1);
    for id in 0..4 {
        let freed_block = imports_a.release(BufferId(id)).unwrap();
        // The block import is freed with the last buffer, before its Release goes out.
        assert_eq!(freed_block.is_some(), id == 3);
        ia.release(BufferId(id)).unwrap();
    }
    ia.goodbye().unwrap();
    assert!(matches!(server_a.join().unwrap(), Error::Closed));
    assert!(
        pool.lock().unwrap().freed.is_empty(),
        "freed while importer B still holds the buffers"
    );

    // Importer B releases one buffer, then dies without a word.
    for _ in 0..4 {
        ib.recv().unwrap();
    }
    ib.release(BufferId(2)).unwrap();
    drop(ib);
    let err = server_b.join().unwrap();
    assert!(matches!(err, Error::Closed), "{err}");

    let mut freed = pool.lock().unwrap().freed.clone();
    freed.sort_unstable();
    assert_eq!(freed, vec![0, 1, 2, 3], "every buffer freed exactly once");
    assert!(leases.lock().unwrap().is_empty());
}

#[test]
fn double_release_cuts_the_importer_off() {
    let pool_fd = memfd_with(&unique_name("double"), b"x");
    let leases = Arc::new(Mutex::new(LeaseTable::new()));
    let pool = Arc::new(Mutex::new(SimPool::default()));
    let (exporter, importer, _) = handshake_pair(&pool_fd);
    let id = ImporterId(7);
    {
        let mut table = leases.lock().unwrap();
        table.insert(BufferId(1), SimAlloc(1)).unwrap();
        table.grant(BufferId(1), id).unwrap();
    }
    exporter.share(&buffer(1)).unwrap();
    let server = {
        let (leases, pool) = (leases.clone(), pool.clone());
        thread::spawn(move || serve_importer(exporter, id, leases, pool))
    };
    importer.recv().unwrap();
    importer.release(BufferId(1)).unwrap();
    importer.release(BufferId(1)).unwrap();
    let err = server.join().unwrap();
    assert!(matches!(err, Error::Lease(LeaseError::NotLeased { .. })), "{err}");
    assert!(matches!(
        importer.recv().unwrap_err(),
        Error::Remote {
            code: ErrorCode::NotLeased,
            ..
        }
    ));
    // The exporter still holds the buffer itself: not freed.
    assert!(pool.lock().unwrap().freed.is_empty());
    assert_eq!(
        leases.lock().unwrap().release_owner(BufferId(1)).unwrap(),
        Some(SimAlloc(1))
    );
}

/// The crate documentation's example (a doctest until the modules became private): a handshake over
/// a pair of connections, with a memfd for the pool's file descriptor (`MemPool::export_fd`).
#[test]
fn handshake_over_a_connection_pair() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let pool_fd = rustix::fs::memfd_create("pool", rustix::fs::MemfdFlags::CLOEXEC)?;
    let gpu = DeviceUuid([7; 16]);
    let (exporter_end, importer_end) = Connection::pair(ConnectionOptions::default())?;

    let importer = std::thread::spawn(move || ImporterSession::handshake(importer_end, |uuid| Ok(*uuid)));
    let announcement = PoolAnnouncement {
        device_uuid: gpu,
        pool_id: PoolId::generate(),
    };
    let _exporter = ExporterSession::handshake(exporter_end, announcement, pool_fd.as_fd())?;
    let (_importer, imported) = importer.join().unwrap()?;
    assert_eq!(imported.device, gpu);
    Ok(())
}

/// `handshake_pair` with the importer asking for `capabilities`.
fn handshake_pair_asking(pool: &OwnedFd, capabilities: u64) -> (ExporterSession, ImporterSession) {
    let (e, i) = Connection::pair(short_options()).unwrap();
    let importer = thread::spawn(move || ImporterSession::handshake_with(i, capabilities, &mut find_gpu));
    let exporter = ExporterSession::handshake(e, ANNOUNCEMENT, pool.as_fd()).unwrap();
    let (importer, _) = importer.join().unwrap().unwrap();
    (exporter, importer)
}

#[test]
fn version_2_handshake_grants_the_fast_release_path_and_carries_batches() {
    let pool = memfd_with(&unique_name("v2"), b"x");
    // Unknown bits are asked for by a newer importer and not granted.
    let (exporter, importer) = handshake_pair_asking(&pool, CAP_FAST_RELEASE | 1 << 40);
    assert_eq!(exporter.capabilities, CAP_FAST_RELEASE);
    assert_eq!(importer.capabilities(), CAP_FAST_RELEASE);
    assert_eq!(importer.pool_id(), POOL);
    let event = Some(EventHandle([0x42; 64]));
    importer.release_batch(event, vec![BufferId(4), BufferId(2)]).unwrap();
    importer.release(BufferId(9)).unwrap();
    assert_eq!(
        exporter.recv().unwrap(),
        ImporterEvent::ReleaseBatch(ReleaseBatch {
            event,
            buffers: vec![BufferId(4), BufferId(2)],
        })
    );
    assert_eq!(exporter.recv().unwrap(), ImporterEvent::Release(BufferId(9)));
}

#[test]
fn a_version_1_importer_sending_a_batch_is_cut_off() {
    let pool = memfd_with(&unique_name("v1-batch"), b"x");
    let (exporter, importer, _pool_fd) = handshake_pair(&pool);
    assert_eq!(importer.capabilities(), 0);
    importer.release_batch(None, vec![BufferId(1)]).unwrap();
    let err = exporter.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                got: MessageType::ReleaseBatch,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_exporter_grants_only_what_it_offers_and_answers_hello_the_version_1_way() {
    let mut none = super::ExporterHandshake::offering(ANNOUNCEMENT, 0);
    let answer = none.on_message(Message::Hello2 { capabilities: u64::MAX }).unwrap();
    assert!(
        matches!(answer, Message::Welcome2 { capabilities: 0, .. }),
        "{answer:?}"
    );
    assert_eq!(none.capabilities(), 0);
    let mut v1 = super::ExporterHandshake::new(ANNOUNCEMENT);
    assert!(matches!(v1.on_message(Message::Hello).unwrap(), Message::Welcome(_)));
    assert_eq!(v1.capabilities(), 0);
    // Hello2 after Hello is out of order.
    assert!(v1.on_message(Message::Hello2 { capabilities: 1 }).is_err());
}

#[test]
fn an_importer_refused_by_a_version_1_exporter_connects_again_the_version_1_way() {
    let dir = TempDir::new("session-v1-exporter");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let pool = memfd_with(&unique_name("v1-exporter"), b"old");
    let importer = thread::spawn(move || {
        ImporterSession::connect(
            &path,
            short_options(),
            &AccessPolicy::SameUser,
            CAP_FAST_RELEASE,
            find_gpu,
        )
    });
    // What a version-1 exporter does with `Hello2`: its header's version is refused.
    let mut raw = listener.accept_stream().unwrap();
    let mut header = [0u8; protocol::HEADER_LEN];
    std::io::Read::read_exact(&mut raw, &mut header).unwrap();
    assert_eq!(u16::from_le_bytes([header[4], header[5]]), 2);
    let refusal = protocol::encode(&Message::Error(protocol::ErrorMessage::new(
        ErrorCode::UnsupportedVersion,
        "unsupported protocol version 2 (this side speaks version 1)",
    )))
    .unwrap();
    raw.write_all(&refusal).unwrap();
    drop(raw);
    // The second connection says `Hello`.
    let (second, _) = crate::connection::accept(&listener).unwrap();
    let _exporter = ExporterSession::handshake(second, ANNOUNCEMENT, pool.as_fd()).unwrap();
    let (importer, imported) = importer.join().unwrap().unwrap();
    assert_eq!(importer.capabilities(), 0);
    assert_eq!(read_all(imported.pool_fd), b"old");
}

#[test]
fn an_importer_refuses_rings_whose_slots_cannot_hold_a_buffer_frame() {
    // Issue 33, finding 6: an exporter that offers rings of 96-byte slots (a `ReleaseBatch` of one
    // id does not fit; the importer's batch size underflowed) is refused at the handshake, the
    // slot size and the minimum named, and told why.
    use crate::protocol::CAP_RING;
    use crate::ring::{Geometry, Region};
    let asked = CAP_FAST_RELEASE | CAP_RING;
    let (i, mut raw) = UnixStream::pair().unwrap();
    let importer = thread::spawn(move || {
        ImporterSession::handshake_with(Connection::new(i, short_options()), asked, &mut find_gpu).map(|_| ())
    });
    assert_eq!(read_frame(&mut raw).unwrap(), Message::Hello2 { capabilities: asked });
    send_raw(
        &mut raw,
        &Message::Welcome2 {
            welcome: Welcome {
                device_uuid: GPU,
                pool_id: POOL,
            },
            capabilities: asked,
        },
    );
    assert_eq!(
        read_frame(&mut raw).unwrap(),
        Message::Ready(Ready { device_uuid: GPU })
    );
    let pool = memfd_with(&unique_name("small-slots"), b"x");
    let descriptor = protocol::encode(&Message::PoolDescriptor(PoolDescriptor { pool_id: POOL })).unwrap();
    fdpass::send_with_fds(&raw, &descriptor, &[pool.as_fd()]).unwrap();
    let region = Region::create(Geometry::new(4, 96).unwrap()).unwrap();
    let setup = protocol::encode(&Message::RingSetup).unwrap();
    fdpass::send_with_fds(&raw, &setup, &[region.fd()]).unwrap();
    let err = match importer.join().unwrap() {
        Ok(()) => panic!("the importer accepted rings of 96-byte slots"),
        Err(e) => e,
    };
    assert!(
        matches!(
            err,
            Error::RingSlotTooSmall {
                slot_bytes: 96,
                min: 208
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("96-byte slots") && text.contains("at least 208 bytes"),
        "{text}"
    );
    let told = expect_error_then_eof(&mut raw);
    assert!(
        told.text.contains("96-byte slots") && told.text.contains("at least 208 bytes"),
        "{}",
        told.text
    );
}
