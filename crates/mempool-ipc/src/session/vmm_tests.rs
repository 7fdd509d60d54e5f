//! The VMM additions to the conversation, over real sockets without a GPU: the VMM capability
//! (bit 1 of `Hello2`/`Welcome2`), `VmmBuffer` with its descriptor (a memfd stands in for the allocation's), and what
//! a hostile exporter or importer can do with them.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::thread;

use super::{ExporterEvent, ExporterHandshake, ExporterSession, HandshakeStep, ImporterSession, PoolAnnouncement};
use crate::connection::{short_options, Connection};
use crate::error::{Error, Result};
use crate::protocol::testing::{expect_error_then_eof, read_frame, vmm_buffer, vmm_chunks, GPU, POOL};
use crate::protocol::{
    self, ErrorCode, Message, MessageType, PoolDescriptor, ProtocolError, Ready, Welcome, CAP_FAST_RELEASE, CAP_VMM,
    CAP_VMM_CHUNKS,
};
use crate::test_util::{is_cloexec, memfd_with, open_fds_named, read_all, unique_name};
use mempool_socket::fdpass;

const ANNOUNCEMENT: PoolAnnouncement = PoolAnnouncement {
    device_uuid: GPU,
    pool_id: POOL,
};

fn find_gpu(uuid: &protocol::DeviceUuid) -> Result<u32> {
    if *uuid == GPU {
        Ok(0)
    } else {
        Err(Error::DeviceNotVisible { uuid: *uuid })
    }
}

fn pair(wanted: u64, pool: &OwnedFd) -> (ExporterSession, ImporterSession) {
    let (e, i) = Connection::pair(short_options()).unwrap();
    let importer = thread::spawn(move || ImporterSession::handshake_with(i, wanted, &mut find_gpu));
    let exporter = ExporterSession::handshake(e, ANNOUNCEMENT, pool.as_fd()).unwrap();
    let (importer, _) = importer.join().unwrap().unwrap();
    (exporter, importer)
}

#[test]
fn an_importer_that_accepts_vmm_receives_the_allocation_with_its_descriptor() {
    let pool = memfd_with(&unique_name("vmm-pool"), b"pool");
    let (exporter, importer) = pair(CAP_VMM, &pool);
    assert_eq!(importer.capabilities(), CAP_VMM);
    let name = unique_name("vmm-alloc");
    let alloc = memfd_with(&name, b"physical allocation");
    exporter
        .conn
        .send(&Message::VmmBuffer(vmm_buffer(4)), &[alloc.as_fd()])
        .unwrap();
    drop(alloc);
    match importer.recv().unwrap() {
        ExporterEvent::VmmBuffer(d, fd) => {
            assert_eq!(d, vmm_buffer(4));
            assert!(is_cloexec(&fd));
            assert_eq!(read_all(fd), b"physical allocation");
        }
        other => panic!("expected a VmmBuffer, got {other:?}"),
    }
    assert_eq!(open_fds_named(&name), 0, "the descriptor is closed once read");
}

#[test]
fn an_importer_that_did_not_ask_for_vmm_refuses_a_vmm_buffer_and_closes_its_descriptor() {
    // Both kinds that lack the bit: a version-1 `Hello`, and a `Hello2` asking for other bits.
    for wanted in [0, CAP_FAST_RELEASE] {
        refuses_a_vmm_buffer(wanted);
    }
}

fn refuses_a_vmm_buffer(wanted: u64) {
    let pool = memfd_with(&unique_name("novmm-pool"), b"pool");
    let (exporter, importer) = pair(wanted, &pool);
    assert_eq!(importer.capabilities(), wanted);
    let name = unique_name("novmm-alloc");
    let alloc = memfd_with(&name, b"x");
    exporter
        .conn
        .send(&Message::VmmBuffer(vmm_buffer(1)), &[alloc.as_fd()])
        .unwrap();
    drop(alloc);
    let err = importer.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                got: MessageType::VmmBuffer,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(open_fds_named(&name), 0, "the unwanted descriptor is not kept");
    let err = exporter.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Remote {
                code: ErrorCode::Protocol,
                ..
            }
        ),
        "{err}"
    );
}

/// An importer whose raw exporter peer completes the handshake offering VMM, then sends `frame`
/// with `fds`; returns what the importer's `recv` says.
fn importer_receiving_raw(frame: &[u8], fds: &[&OwnedFd]) -> Result<ExporterEvent> {
    let (i, mut raw) = UnixStream::pair().unwrap();
    let importer = thread::spawn(move || {
        let (session, _) =
            ImporterSession::handshake_with(Connection::new(i, short_options()), CAP_VMM, &mut find_gpu)?;
        session.recv()
    });
    assert_eq!(read_frame(&mut raw).unwrap(), Message::Hello2 { capabilities: CAP_VMM });
    let welcome = protocol::encode(&Message::Welcome2 {
        welcome: Welcome {
            device_uuid: GPU,
            pool_id: POOL,
        },
        capabilities: CAP_VMM,
    })
    .unwrap();
    raw.write_all(&welcome).unwrap();
    assert_eq!(
        read_frame(&mut raw).unwrap(),
        Message::Ready(Ready { device_uuid: GPU })
    );
    let pool = memfd_with(&unique_name("raw-pool"), b"pool");
    let descriptor = protocol::encode(&Message::PoolDescriptor(PoolDescriptor { pool_id: POOL })).unwrap();
    fdpass::send_with_fds(&raw, &descriptor, &[pool.as_fd()]).unwrap();
    let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    fdpass::send_with_fds(&raw, frame, &borrowed).unwrap();
    let got = importer.join().unwrap();
    drop(raw);
    got
}

#[test]
fn a_vmm_buffer_without_its_descriptor_or_with_two_is_refused() {
    let frame = protocol::encode(&Message::VmmBuffer(vmm_buffer(2))).unwrap();
    let name = unique_name("vmm-count");
    let a = memfd_with(&name, b"a");
    let b = memfd_with(&name, b"b");
    for (fds, got) in [(vec![], 0), (vec![&a, &b], 2)] {
        let err = importer_receiving_raw(&frame, &fds).unwrap_err();
        assert!(
            matches!(err, Error::DescriptorCount { expected: 1, got: g } if g == got),
            "{} descriptors: {err}",
            fds.len()
        );
    }
    drop((a, b));
    assert_eq!(open_fds_named(&name), 0, "descriptors of refused frames are closed");
}

#[test]
fn a_malformed_vmm_buffer_is_refused_with_the_reason_and_its_descriptor_closed() {
    let name = unique_name("vmm-malformed");
    let alloc = memfd_with(&name, b"x");
    let mut frame = protocol::encode(&Message::VmmBuffer(vmm_buffer(2))).unwrap();
    // Size 3 MiB with a granularity of 2 MiB.
    frame[protocol::HEADER_LEN + 8..protocol::HEADER_LEN + 16].copy_from_slice(&(3u64 << 20).to_le_bytes());
    let err = importer_receiving_raw(&frame, &[&alloc]).unwrap_err();
    match err {
        Error::Protocol(ProtocolError::Violation { reason }) => assert_eq!(
            reason,
            "VmmBuffer #2: size 3145728 is not a multiple of the granularity 2097152"
        ),
        other => panic!("{other}"),
    }
    drop(alloc);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn the_exporter_grants_vmm_only_to_a_hello2_that_asks_for_it() {
    let granted = |hello: Message, offered: u64| {
        let mut machine = ExporterHandshake::offering(ANNOUNCEMENT, offered);
        let answer = machine.on_message(hello).unwrap();
        let answer_caps = match answer {
            Message::Welcome(_) => None,
            Message::Welcome2 { capabilities, .. } => Some(capabilities),
            other => panic!("expected Welcome or Welcome2, got {other:?}"),
        };
        machine.on_message(Message::Ready(Ready { device_uuid: GPU })).unwrap();
        assert_eq!(machine.step(), HandshakeStep::Done);
        assert_eq!(answer_caps.unwrap_or(0), machine.capabilities());
        answer_caps
    };
    let all = protocol::KNOWN_CAPABILITIES;
    // A version-1 importer gets the version-1 Welcome and nothing else.
    assert_eq!(granted(Message::Hello, all), None);
    assert_eq!(granted(Message::Hello2 { capabilities: CAP_VMM }, all), Some(CAP_VMM));
    // Unknown bits are not granted.
    assert_eq!(
        granted(
            Message::Hello2 {
                capabilities: CAP_VMM | 1 << 40
            },
            all
        ),
        Some(CAP_VMM)
    );
    assert_eq!(
        granted(
            Message::Hello2 {
                capabilities: CAP_FAST_RELEASE
            },
            all
        ),
        Some(CAP_FAST_RELEASE)
    );
    // An exporter that does not offer VMM does not grant it.
    assert_eq!(
        granted(
            Message::Hello2 {
                capabilities: CAP_VMM | CAP_FAST_RELEASE
            },
            CAP_FAST_RELEASE
        ),
        Some(CAP_FAST_RELEASE)
    );
}

#[test]
fn an_importer_refuses_a_vmm_grant_it_did_not_ask_for() {
    let (i, mut raw) = UnixStream::pair().unwrap();
    let importer = thread::spawn(move || {
        ImporterSession::handshake_with(Connection::new(i, short_options()), CAP_FAST_RELEASE, &mut find_gpu)
    });
    assert_eq!(
        read_frame(&mut raw).unwrap(),
        Message::Hello2 {
            capabilities: CAP_FAST_RELEASE
        }
    );
    let welcome = Message::Welcome2 {
        welcome: Welcome {
            device_uuid: GPU,
            pool_id: POOL,
        },
        capabilities: CAP_FAST_RELEASE | CAP_VMM,
    };
    raw.write_all(&protocol::encode(&welcome).unwrap()).unwrap();
    let err = importer.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("more than the"), "{err}");
    let told = expect_error_then_eof(&mut raw);
    assert_eq!(told.code, ErrorCode::Protocol);
}

#[test]
fn an_importer_that_accepts_vmm_chunks_receives_every_chunk_in_order() {
    let pool = memfd_with(&unique_name("chunks-pool"), b"pool");
    let (exporter, importer) = pair(CAP_VMM | CAP_VMM_CHUNKS, &pool);
    assert_eq!(importer.capabilities(), CAP_VMM | CAP_VMM_CHUNKS);
    let name = unique_name("chunks-alloc");
    let chunks: Vec<OwnedFd> = (0..3u8).map(|i| memfd_with(&name, &[b'x' + i])).collect();
    let fds: Vec<_> = chunks.iter().map(|c| c.as_fd()).collect();
    exporter.conn.send(&Message::VmmChunks(vmm_chunks(4, 3)), &fds).unwrap();
    drop(fds);
    drop(chunks);
    match importer.recv().unwrap() {
        ExporterEvent::VmmChunks(d, fds) => {
            assert_eq!(d, vmm_chunks(4, 3));
            assert!(fds.iter().all(is_cloexec));
            let got: Vec<Vec<u8>> = fds.into_iter().map(read_all).collect();
            assert_eq!(got, vec![b"x".to_vec(), b"y".to_vec(), b"z".to_vec()]);
        }
        other => panic!("expected VmmChunks, got {other:?}"),
    }
    assert_eq!(open_fds_named(&name), 0, "the descriptors are closed once read");
}

#[test]
fn an_importer_granted_only_single_vmm_buffers_refuses_vmm_chunks_and_closes_their_descriptors() {
    let pool = memfd_with(&unique_name("nochunks-pool"), b"pool");
    let (exporter, importer) = pair(CAP_VMM, &pool);
    let name = unique_name("nochunks-alloc");
    let alloc = memfd_with(&name, b"x");
    exporter
        .conn
        .send(&Message::VmmChunks(vmm_chunks(1, 2)), &[alloc.as_fd(), alloc.as_fd()])
        .unwrap();
    drop(alloc);
    let err = importer.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnexpectedMessage {
                got: MessageType::VmmChunks,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(open_fds_named(&name), 0, "the unwanted descriptors are not kept");
    let err = exporter.recv().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Remote {
                code: ErrorCode::Protocol,
                ..
            }
        ),
        "{err}"
    );
}
