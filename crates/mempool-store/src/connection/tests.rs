//! Frames over a socket pair: whole messages with their descriptor, a peer that closes, a frame
//! cut short by the frame limit.

use std::os::fd::AsFd;

use super::*;

fn pair() -> (Connection, Connection) {
    let (a, b) = UnixStream::pair().unwrap();
    let w = Duration::from_secs(5);
    let v = Some(crate::protocol::messages::VERSION);
    (
        Connection::new(a, false, v, w).unwrap(),
        Connection::new(b, true, v, w).unwrap(),
    )
}

#[test]
fn frames_are_of_the_connections_version_but_a_refusal_of_any() {
    use crate::protocol::messages::{Refusal, MIN_VERSION, VERSION};
    let wait = Duration::from_secs(5);
    let (a, b) = UnixStream::pair().unwrap();
    let client = Connection::new(a, false, Some(VERSION), wait).unwrap();
    let mut server = Connection::new(b, true, None, wait).unwrap();
    // Before its Hello, the server reads any version, and says which it was.
    let hello2 = codec::encode_as(&Message::Hello, MIN_VERSION).unwrap();
    rustix::net::send(client.stream(), &hello2, rustix::net::SendFlags::empty()).unwrap();
    let (m, _, version) = server.recv_versioned(Some(wait), wait).unwrap();
    assert_eq!((m, version), (Message::Hello, MIN_VERSION));
    // Until it knows the peer's version it sends the oldest: a refusal every client reads.
    let refused = Message::Refused(Refusal {
        code: 11,
        text: "busy".into(),
        ..Refusal::default()
    });
    server.send(&refused, None).unwrap();
    let (m, _, version) = client.recv_versioned(Some(wait), wait).unwrap();
    assert_eq!((m, version), (refused.clone(), MIN_VERSION));
    // Anything else of another version than the connection's is a protocol error.
    server.send(&Message::Done, None).unwrap();
    let err = client.recv(Some(wait), wait).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "Done frame of protocol version {MIN_VERSION} on a connection of version {VERSION}"
        )),
        "{err}"
    );
    server.set_version(VERSION);
    assert_eq!(server.version(), Some(VERSION));
    server.send(&Message::Done, None).unwrap();
    assert_eq!(client.recv(Some(wait), wait).unwrap().0, Message::Done);
    let (a, b) = UnixStream::pair().unwrap();
    let client = Connection::new(a, false, Some(VERSION), wait).unwrap();
    let server = Connection::new(b, true, Some(MIN_VERSION), wait).unwrap();
    client.send(&Message::Stats, None).unwrap();
    let err = server.recv(Some(wait), wait).unwrap_err();
    assert!(err.to_string().contains("Stats frame of protocol version"), "{err}");
}

#[test]
fn messages_and_descriptors_arrive_whole() {
    let (client, server) = pair();
    client.send(&Message::Attach { name: "a".into() }, None).unwrap();
    let (m, fds) = server
        .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
        .unwrap();
    assert_eq!(m, Message::Attach { name: "a".into() });
    assert!(fds.is_empty());
    let memfd = crate::test_util::memfd_with(&crate::test_util::unique_name("conn"), b"abc");
    let granted = Message::Granted(crate::protocol::messages::GrantEntry {
        attachment: 1,
        size: 4096,
        granularity: 4096,
        device: mempool_ipc::DeviceUuid([1; 16]),
        event: None,
        memory: 1,
        offset: 0,
        memory_size: 4096,
    });
    server.send(&granted, Some(memfd.as_fd())).unwrap();
    let (m, fds) = client
        .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
        .unwrap();
    assert_eq!(m, granted);
    assert_eq!(crate::test_util::read_all(fds.into_iter().next().unwrap()), b"abc");
}

#[test]
fn a_missing_descriptor_is_refused() {
    let (client, server) = pair();
    let granted = Message::Granted(crate::protocol::messages::GrantEntry {
        attachment: 1,
        size: 4096,
        granularity: 4096,
        device: mempool_ipc::DeviceUuid([1; 16]),
        event: None,
        memory: 1,
        offset: 0,
        memory_size: 4096,
    });
    server.send(&granted, None).unwrap();
    let err = client
        .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
        .unwrap_err();
    assert!(err.to_string().contains("descriptors"), "{err}");
}

#[test]
fn closed_peer_and_cut_frames() {
    let (client, server) = pair();
    let frame = codec::encode(&Message::Hello).unwrap();
    rustix::net::send(client.stream(), &frame[..3], rustix::net::SendFlags::empty()).unwrap();
    let err = server.recv(None, Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                during: "reading a frame"
            }
        ),
        "{err}"
    );
    let err = server
        .recv(Some(Duration::from_millis(50)), Duration::from_millis(100))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                during: "waiting for a frame"
            }
        ),
        "{err}"
    );
    drop(client);
    assert!(matches!(
        server.recv(None, Duration::from_secs(1)),
        Err(Error::PeerGone { .. })
    ));
}

fn grants(n: usize) -> Message {
    Message::GrantedMany {
        grants: (0..n as u64)
            .map(|i| crate::protocol::messages::GrantEntry {
                attachment: i,
                size: 4096,
                granularity: 4096,
                device: mempool_ipc::DeviceUuid([1; 16]),
                event: None,
                memory: i,
                offset: 0,
                memory_size: 4096,
            })
            .collect(),
    }
}

#[test]
fn granted_many_carries_one_descriptor_per_grant_in_order() {
    use crate::protocol::messages::MAX_ATTACH_MANY;
    let (client, server) = pair();
    let memfds: Vec<_> = (0..MAX_ATTACH_MANY)
        .map(|i| crate::test_util::memfd_with(&crate::test_util::unique_name("many"), format!("fd{i}").as_bytes()))
        .collect();
    let borrowed: Vec<_> = memfds.iter().map(|f| f.as_fd()).collect();
    let m = grants(MAX_ATTACH_MANY);
    server.send_fds(&m, &borrowed).unwrap();
    let (got, fds) = client
        .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
        .unwrap();
    assert_eq!(got, m);
    assert_eq!(fds.len(), MAX_ATTACH_MANY);
    for (i, fd) in fds.into_iter().enumerate() {
        assert_eq!(crate::test_util::read_all(fd), format!("fd{i}").as_bytes());
    }
}

#[test]
fn granted_many_with_the_wrong_descriptor_count_is_refused() {
    for (grant_count, fd_count) in [(3, 2), (2, 3), (1, 0)] {
        let (client, server) = pair();
        let memfds: Vec<_> = (0..fd_count)
            .map(|_| crate::test_util::memfd_with(&crate::test_util::unique_name("few"), b"x"))
            .collect();
        let borrowed: Vec<_> = memfds.iter().map(|f| f.as_fd()).collect();
        server.send_fds(&grants(grant_count), &borrowed).unwrap();
        let err = client
            .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
            .unwrap_err();
        assert!(
            err.to_string().contains("file descriptors"),
            "{grant_count} grants, {fd_count} descriptors: {err}"
        );
    }
    // A server receives no descriptors: a client message with many is refused.
    let (client, server) = pair();
    let memfds: Vec<_> = (0..4)
        .map(|_| crate::test_util::memfd_with(&crate::test_util::unique_name("tocli"), b"x"))
        .collect();
    let borrowed: Vec<_> = memfds.iter().map(|f| f.as_fd()).collect();
    client
        .send_fds(
            &Message::AttachMany {
                names: vec!["a".into()],
            },
            &borrowed,
        )
        .unwrap();
    let err = server
        .recv(Some(Duration::from_secs(5)), Duration::from_secs(5))
        .unwrap_err();
    assert!(err.to_string().contains("descriptors"), "{err}");
}
