//! Framed connections over real sockets: messages with their descriptors, hostile peers,
//! timeouts.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{short_options, Connection};
use crate::error::{Error, Result};
use crate::protocol::testing::{buffer, every_message, expect_error_then_eof, read_frame, POOL};
use crate::protocol::{self, BufferId, ErrorCode, Message, MessageType, PoolDescriptor, ProtocolError, HEADER_LEN};
use crate::test_util::{is_cloexec, memfd_with, open_fds_named, read_all, unique_name};
use mempool_socket::fdpass;
use mempool_socket::ConnectionOptions;

/// A connection and a raw socket for playing a (possibly hostile) peer.
fn conn_and_raw() -> (Connection, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    (Connection::new(a, short_options()), b)
}

fn pool_descriptor() -> Message {
    Message::PoolDescriptor(PoolDescriptor { pool_id: POOL })
}

#[test]
fn every_message_travels_with_its_descriptors() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    let name = unique_name("conn-pool");
    let memfd = memfd_with(&name, b"pool contents");
    for message in every_message() {
        let fds: Vec<_> = (0..message.descriptor_count()).map(|_| memfd.as_fd()).collect();
        a.send(&message, &fds).unwrap();
        let received = b.recv().unwrap();
        assert_eq!(received.message, message);
        assert_eq!(received.fds.len(), fds.len());
        for fd in received.fds {
            assert!(is_cloexec(&fd));
            assert_eq!(read_all(fd), b"pool contents");
        }
    }
    drop(memfd);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn send_checks_the_descriptor_count_before_sending() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    let memfd = memfd_with(&unique_name("count"), b"");
    let release = Message::Release { buffer_id: BufferId(1) };
    assert!(matches!(
        a.send(&release, &[memfd.as_fd()]).unwrap_err(),
        Error::DescriptorCount { expected: 0, got: 1 }
    ));
    assert!(matches!(
        a.send(&pool_descriptor(), &[]).unwrap_err(),
        Error::DescriptorCount { expected: 1, got: 0 }
    ));
    // Nothing went out, and the connection is still good.
    assert!(!a.is_failed());
    a.send(&release, &[]).unwrap();
    assert_eq!(b.recv().unwrap().message, release);
}

#[test]
fn descriptor_on_a_message_that_carries_none_is_closed_and_fails_the_connection() {
    let (conn, mut raw) = conn_and_raw();
    let name = unique_name("stray");
    let memfd = memfd_with(&name, b"x");
    let frame = protocol::encode(&Message::Release { buffer_id: BufferId(3) }).unwrap();
    fdpass::send_with_fds(&raw, &frame, &[memfd.as_fd()]).unwrap();
    drop(memfd);

    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 0, got: 1 }), "{err}");
    assert_eq!(open_fds_named(&name), 0, "the stray descriptor leaked");
    assert!(conn.is_failed());
    assert!(matches!(conn.recv().unwrap_err(), Error::ConnectionFailed));
    assert_eq!(expect_error_then_eof(&mut raw).code, ErrorCode::Protocol);
}

#[test]
fn pool_descriptor_without_its_descriptor_is_rejected() {
    let (conn, mut raw) = conn_and_raw();
    raw.write_all(&protocol::encode(&pool_descriptor()).unwrap()).unwrap();
    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 1, got: 0 }), "{err}");
    expect_error_then_eof(&mut raw);
}

#[test]
fn pool_descriptor_with_two_descriptors_closes_both() {
    let (conn, mut raw) = conn_and_raw();
    let name = unique_name("two");
    let memfd = memfd_with(&name, b"x");
    let frame = protocol::encode(&pool_descriptor()).unwrap();
    fdpass::send_with_fds(&raw, &frame, &[memfd.as_fd(), memfd.as_fd()]).unwrap();
    drop(memfd);
    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 1, got: 2 }), "{err}");
    assert_eq!(open_fds_named(&name), 0);
    expect_error_then_eof(&mut raw);
}

#[test]
fn descriptors_sent_mid_frame_are_counted_too() {
    // A hostile peer attaches a descriptor to a later byte of a message that carries none.
    let (conn, raw) = conn_and_raw();
    let name = unique_name("midframe");
    let memfd = memfd_with(&name, b"x");
    let frame = protocol::encode(&Message::Release { buffer_id: BufferId(3) }).unwrap();
    fdpass::send_with_fds(&raw, &frame[..HEADER_LEN + 2], &[]).unwrap();
    fdpass::send_with_fds(&raw, &frame[HEADER_LEN + 2..], &[memfd.as_fd()]).unwrap();
    drop(memfd);
    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 0, got: 1 }), "{err}");
    assert!(err.to_string().contains("expected 0, got 1"), "{err}");
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn many_descriptors_on_a_message_that_carries_none_name_the_exact_count() {
    // Three ride on the header's first byte, before the reader knows the type: it keeps at most
    // the most any message carries, closes the rest, and names the type's count (0), not that most.
    let (conn, raw) = conn_and_raw();
    let name = unique_name("three");
    let memfd = memfd_with(&name, b"x");
    let frame = protocol::encode(&Message::Hello).unwrap();
    fdpass::send_with_fds(&raw, &frame, &[memfd.as_fd(), memfd.as_fd(), memfd.as_fd()]).unwrap();
    drop(memfd);
    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 0, got: 3 }), "{err}");
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn garbage_is_rejected_and_the_peer_told() {
    let (conn, mut raw) = conn_and_raw();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let err = conn.recv().unwrap_err();
    assert!(
        matches!(err, Error::Protocol(ProtocolError::BadMagic { got }) if &got == b"GET "),
        "{err}"
    );
    let told = expect_error_then_eof(&mut raw);
    assert_eq!(told.code, ErrorCode::Protocol);
    assert!(told.text.contains("magic"), "{}", told.text);
}

#[test]
fn unknown_version_is_rejected_and_the_peer_told_in_our_version() {
    let (conn, mut raw) = conn_and_raw();
    let mut frame = protocol::encode(&Message::Hello).unwrap();
    frame[4..6].copy_from_slice(&3u16.to_le_bytes());
    raw.write_all(&frame).unwrap();
    let err = conn.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Protocol(ProtocolError::UnsupportedVersion { got: 3, supported: 2 })
        ),
        "{err}"
    );
    let told = expect_error_then_eof(&mut raw);
    assert_eq!(told.code, ErrorCode::UnsupportedVersion);
    assert!(told.text.contains("version 3"), "{}", told.text);
    // The Error message travels in a version-1 frame, which every version reads.
}

#[test]
fn unknown_message_type_is_rejected() {
    let (conn, mut raw) = conn_and_raw();
    let mut frame = protocol::encode(&Message::Goodbye).unwrap();
    frame[6..8].copy_from_slice(&99u16.to_le_bytes());
    raw.write_all(&frame).unwrap();
    assert!(matches!(
        conn.recv().unwrap_err(),
        Error::Protocol(ProtocolError::UnknownMessageType { got: 99 })
    ));
    expect_error_then_eof(&mut raw);
}

#[test]
fn oversized_length_is_rejected_without_waiting_for_the_body() {
    let (conn, mut raw) = conn_and_raw();
    let mut header = protocol::encode(&Message::Goodbye).unwrap();
    header[6..8].copy_from_slice(&MessageType::Error.to_wire().to_le_bytes());
    header[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    raw.write_all(&header).unwrap();
    // The peer keeps the socket open and sends no body: the header alone must be enough.
    let err = conn.recv().unwrap_err();
    assert!(
        matches!(err, Error::Protocol(ProtocolError::MessageTooLarge { .. })),
        "{err}"
    );
    expect_error_then_eof(&mut raw);
}

#[test]
fn wrong_body_length_for_the_type_is_rejected() {
    let (conn, mut raw) = conn_and_raw();
    let mut frame = protocol::encode(&Message::Release { buffer_id: BufferId(1) }).unwrap();
    frame[8..12].copy_from_slice(&4u32.to_le_bytes());
    frame.truncate(HEADER_LEN + 4);
    raw.write_all(&frame).unwrap();
    assert!(matches!(
        conn.recv().unwrap_err(),
        Error::Protocol(ProtocolError::BodyLength {
            message: MessageType::Release,
            got: 4,
            ..
        })
    ));
    expect_error_then_eof(&mut raw);
}

#[test]
fn peer_closing_between_and_within_messages() {
    let (conn, raw) = conn_and_raw();
    drop(raw);
    assert!(matches!(conn.recv().unwrap_err(), Error::Closed));

    let (conn, mut raw) = conn_and_raw();
    let frame = protocol::encode(&Message::Buffer(buffer(1))).unwrap();
    raw.write_all(&frame[..HEADER_LEN + 10]).unwrap();
    drop(raw);
    let err = conn.recv().unwrap_err();
    assert!(
        matches!(err, Error::Protocol(ProtocolError::Truncated { needed, got }) if needed == frame.len() && got == HEADER_LEN + 10),
        "{err}"
    );

    // Closed inside the header.
    let (conn, mut raw) = conn_and_raw();
    raw.write_all(&frame[..5]).unwrap();
    drop(raw);
    assert!(matches!(
        conn.recv().unwrap_err(),
        Error::Protocol(ProtocolError::Truncated {
            needed: HEADER_LEN,
            got: 5
        })
    ));
}

#[test]
fn idle_timeout_leaves_the_connection_usable() {
    let (conn, mut raw) = conn_and_raw();
    let err = conn
        .recv_timeout(Duration::from_millis(20), "waiting in a test")
        .unwrap_err();
    assert!(matches!(
        err,
        Error::Timeout {
            during: "waiting in a test"
        }
    ));
    assert!(!conn.is_failed());
    raw.write_all(&protocol::encode(&Message::Hello).unwrap()).unwrap();
    assert_eq!(conn.recv().unwrap().message, Message::Hello);
}

#[test]
fn peer_stalling_mid_message_times_out_and_fails_the_connection() {
    let (conn, mut raw) = conn_and_raw();
    let frame = protocol::encode(&Message::Buffer(buffer(1))).unwrap();
    raw.write_all(&frame[..HEADER_LEN + 1]).unwrap();
    // `recv` waits forever for a message to begin, but not for one to end.
    let err = conn.recv().unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(conn.is_failed());
    let told = expect_error_then_eof(&mut raw);
    assert_eq!(told.code, ErrorCode::Timeout);
}

/// The other side of the test above: the same pause, the rest of the frame sent while `recv`
/// waits, and an `io_timeout` far longer than the pause: the message arrives whole.
#[test]
fn peer_pausing_mid_message_within_the_io_timeout_is_received() {
    let (a, mut raw) = UnixStream::pair().unwrap();
    let options = ConnectionOptions {
        io_timeout: Duration::from_secs(60),
        ..short_options()
    };
    let conn = Connection::new(a, options);
    let frame = protocol::encode(&Message::Buffer(buffer(1))).unwrap();
    raw.write_all(&frame[..HEADER_LEN + 1]).unwrap();
    let rest = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        raw.write_all(&frame[HEADER_LEN + 1..]).unwrap();
        raw
    });
    assert_eq!(conn.recv().unwrap().message, Message::Buffer(buffer(1)));
    assert!(!conn.is_failed());
    drop(rest.join().unwrap());
}

#[test]
fn peer_that_does_not_read_cannot_block_a_sender() {
    let (conn, _raw) = conn_and_raw();
    let message = Message::Buffer(buffer(1));
    let mut sent = 0;
    let err = loop {
        match conn.send(&message, &[]) {
            Ok(()) => sent += 1,
            Err(err) => break err,
        }
        assert!(sent < 1_000_000, "the socket buffer never filled");
    };
    assert!(matches!(err, Error::Timeout { during: "send" }), "{err}");
    assert!(sent > 0);
}

#[test]
fn peer_error_message_is_delivered() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    let message = Message::Error(protocol::ErrorMessage::new(ErrorCode::ShuttingDown, "bye"));
    a.send(&message, &[]).unwrap();
    assert_eq!(b.recv().unwrap().message, message);
}

#[test]
fn shutdown_closes_both_ways() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    a.shutdown();
    assert!(matches!(
        a.send(&Message::Hello, &[]).unwrap_err(),
        Error::ConnectionFailed
    ));
    assert!(matches!(b.recv().unwrap_err(), Error::Closed));
}

#[test]
fn send_and_recv_run_concurrently() {
    const N: u64 = 500;
    let (a, b) = Connection::pair(short_options()).unwrap();
    let (a, b) = (Arc::new(a), Arc::new(b));
    let spawn_sender = |conn: Arc<Connection>| {
        std::thread::spawn(move || {
            for id in 0..N {
                conn.send(
                    &Message::Release {
                        buffer_id: BufferId(id),
                    },
                    &[],
                )
                .unwrap();
            }
        })
    };
    let spawn_receiver = |conn: Arc<Connection>| {
        std::thread::spawn(move || {
            for id in 0..N {
                assert_eq!(
                    conn.recv().unwrap().message,
                    Message::Release {
                        buffer_id: BufferId(id)
                    }
                );
            }
        })
    };
    let threads = [
        spawn_sender(a.clone()),
        spawn_sender(b.clone()),
        spawn_receiver(a),
        spawn_receiver(b),
    ];
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn read_frame_helper_sees_what_connection_sends() {
    // The raw helpers the other tests rely on agree with `Connection`.
    let (conn, mut raw) = conn_and_raw();
    conn.send(&Message::Goodbye, &[]).unwrap();
    assert_eq!(read_frame(&mut raw).unwrap(), Message::Goodbye);
}

/// The module documentation's example (a doctest until the module became private): a message over a
/// pair of connections.
#[test]
fn hello_over_a_pair() -> Result<()> {
    let (a, b) = Connection::pair(ConnectionOptions::default())?;
    a.send(&Message::Hello, &[])?;
    assert_eq!(b.recv()?.message, Message::Hello);
    Ok(())
}

/// Receives and sends try the socket before polling it; the time limits stay what they were: a
/// deadline already past is a timeout even with a whole frame waiting (which a later receive still
/// gets, the connection in step), and a send with a deadline already past sends nothing.
#[test]
fn a_past_deadline_times_out_even_when_the_socket_is_ready() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    let past = Instant::now();
    std::thread::sleep(Duration::from_millis(1));
    a.send(&Message::Hello, &[]).unwrap();
    let err = b.recv_until(Some(past), "a test").unwrap_err();
    assert!(matches!(err, Error::Timeout { during: "a test" }), "{err}");
    assert!(!b.is_failed());
    assert_eq!(b.recv().unwrap().message, Message::Hello);

    let err = a.send_until(&Message::Goodbye, &[], past, "a test").unwrap_err();
    assert!(matches!(err, Error::Timeout { during: "a test" }), "{err}");
    assert!(!a.is_failed());
    let err = b
        .recv_timeout(Duration::from_millis(20), "nothing was sent")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
}

/// A frame that arrives in pieces, with pauses, is read whole: each read that finds nothing yet
/// waits for more.
#[test]
fn a_frame_in_pieces_is_read_whole() {
    let (conn, mut raw) = conn_and_raw();
    let frame = protocol::encode(&Message::Buffer(buffer(7))).unwrap();
    let writer = std::thread::spawn(move || {
        for piece in frame.chunks(5) {
            raw.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        raw
    });
    assert_eq!(conn.recv().unwrap().message, Message::Buffer(buffer(7)));
    drop(writer.join().unwrap());
}

fn vmm_chunks(count: u32) -> Message {
    Message::VmmChunks(protocol::testing::vmm_chunks(21, count))
}

#[test]
fn vmm_chunks_arrive_with_one_descriptor_per_chunk_in_order() {
    let (a, b) = Connection::pair(short_options()).unwrap();
    let name = unique_name("chunks");
    let memfds: Vec<_> = (0..4u8).map(|i| memfd_with(&name, &[b'0' + i])).collect();
    let fds: Vec<_> = memfds.iter().map(|m| m.as_fd()).collect();
    // The count is the body's: a wrong number is refused before anything is sent.
    assert!(matches!(
        a.send(&vmm_chunks(4), &fds[..3]).unwrap_err(),
        Error::DescriptorCount { expected: 4, got: 3 }
    ));
    a.send(&vmm_chunks(4), &fds).unwrap();
    let received = b.recv().unwrap();
    assert_eq!(received.message, vmm_chunks(4));
    let contents: Vec<Vec<u8>> = received.fds.into_iter().map(read_all).collect();
    assert_eq!(
        contents,
        vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec(), b"3".to_vec()]
    );
    drop(memfds);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn vmm_chunks_with_fewer_or_more_descriptors_than_their_count_are_refused_and_closed() {
    for sent in [0, 2, 4] {
        let (conn, mut raw) = conn_and_raw();
        let name = unique_name("chunk-count");
        let memfd = memfd_with(&name, b"x");
        let fds = vec![memfd.as_fd(); sent];
        let frame = protocol::encode(&vmm_chunks(3)).unwrap();
        fdpass::send_with_fds(&raw, &frame, &fds).unwrap();
        drop(memfd);
        let err = conn.recv().unwrap_err();
        assert!(
            matches!(err, Error::DescriptorCount { expected: 3, got } if got == sent),
            "{sent} descriptors: {err}"
        );
        assert_eq!(open_fds_named(&name), 0, "{sent} descriptors");
        expect_error_then_eof(&mut raw);
    }
}

#[test]
fn more_descriptors_than_any_message_carries_are_closed_as_they_arrive() {
    // A hostile exporter sends 130 descriptors with the header and 130 more with the body of a
    // `VmmChunks`: past the 253 any message may carry, the reader fails without keeping them.
    let (conn, raw) = conn_and_raw();
    let name = unique_name("chunk-flood");
    let memfd = memfd_with(&name, b"x");
    let fds = vec![memfd.as_fd(); 130];
    let frame = protocol::encode(&vmm_chunks(253)).unwrap();
    fdpass::send_with_fds(&raw, &frame[..HEADER_LEN], &fds).unwrap();
    fdpass::send_with_fds(&raw, &frame[HEADER_LEN..], &fds).unwrap();
    drop(memfd);
    let err = conn.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::DescriptorCount {
                expected: 253,
                got: 260
            }
        ),
        "{err}"
    );
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn a_peer_outside_the_allow_list_is_told_why() {
    use mempool_socket::{AccessPolicy, Listener, ListenerOptions};
    let dir = crate::test_util::TempDir::new("reject");
    let path = dir.join("pool.sock");
    let own_uid = rustix::process::geteuid().as_raw();
    let options = ListenerOptions {
        policy: AccessPolicy::allow_uids([own_uid.wrapping_add(1)]),
        ..ListenerOptions::default()
    };
    let listener = Listener::bind_with(&path, options).unwrap();
    let mut client = UnixStream::connect(&path).unwrap();
    let err = super::accept(&listener).unwrap_err();
    assert!(
        matches!(err, Error::PeerCredentials { uid, .. } if uid == own_uid),
        "{err}"
    );
    assert_eq!(expect_error_then_eof(&mut client).code, ErrorCode::PermissionDenied);
}
