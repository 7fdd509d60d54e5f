//! Frames over a socket pair: whole messages with their descriptor, a peer that closes, a frame
//! cut short by the frame limit.

use std::os::fd::AsFd;

use super::*;

fn pair() -> (Framed, Framed) {
    let (a, b) = UnixStream::pair().unwrap();
    let w = Duration::from_secs(5);
    (Framed::new(a, false, w).unwrap(), Framed::new(b, true, w).unwrap())
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
    let granted = Message::Granted {
        attachment: 1,
        size: 4096,
        granularity: 4096,
        device: crate::wire::DeviceUuid([1; 16]),
        event: None,
    };
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
    let granted = Message::Granted {
        attachment: 1,
        size: 4096,
        granularity: 4096,
        device: crate::wire::DeviceUuid([1; 16]),
        event: None,
    };
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
