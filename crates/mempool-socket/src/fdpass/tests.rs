//! Descriptor passing over real Unix sockets, with memfds standing in for pool descriptors.

use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;

use super::SCM_MAX_FD;
use crate::error::Error;
use crate::fdpass;
use crate::testing::{is_cloexec, memfd_with, open_fds_named, read_all, unique_name};

#[test]
fn memfd_arrives_intact_and_close_on_exec() {
    let (a, b) = UnixStream::pair().unwrap();
    let name = unique_name("intact");
    let contents = b"the pool's bytes, as the exporter wrote them";
    let memfd = memfd_with(&name, contents);

    assert_eq!(fdpass::send_with_fds(&a, b"P", &[memfd.as_fd()]).unwrap(), 1);
    // The sender keeps its own descriptor; close it to prove the received one stands alone.
    drop(memfd);

    let mut byte = [0u8; 8];
    let (n, mut fds) = fdpass::recv_with_fds(&b, &mut byte, 1).unwrap();
    assert_eq!((n, &byte[..1], fds.len()), (1, &b"P"[..], 1));
    let fd = fds.pop().unwrap();
    assert!(is_cloexec(&fd), "received descriptors must be close-on-exec");
    assert_eq!(open_fds_named(&name), 1);
    assert_eq!(read_all(fd), contents);
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn several_descriptors_in_one_message() {
    let (a, b) = UnixStream::pair().unwrap();
    let names: Vec<String> = (0..3).map(|i| unique_name(&format!("multi{i}"))).collect();
    let memfds: Vec<_> = names.iter().map(|n| memfd_with(n, n.as_bytes())).collect();
    let borrowed: Vec<BorrowedFd<'_>> = memfds.iter().map(|f| f.as_fd()).collect();
    fdpass::send_with_fds(&a, b"xyz", &borrowed).unwrap();
    drop(borrowed);
    drop(memfds);

    let mut buf = [0u8; 3];
    let (n, fds) = fdpass::recv_with_fds(&b, &mut buf, 3).unwrap();
    assert_eq!(n, 3);
    // They arrive in the order they were sent.
    for (fd, name) in fds.into_iter().zip(&names) {
        assert!(is_cloexec(&fd));
        assert_eq!(read_all(fd), name.as_bytes());
    }
}

#[test]
fn bytes_without_descriptors() {
    let (a, b) = UnixStream::pair().unwrap();
    fdpass::send_with_fds(&a, b"plain", &[]).unwrap();
    let mut buf = [0u8; 16];
    let (n, fds) = fdpass::recv_with_fds(&b, &mut buf, 0).unwrap();
    assert_eq!((&buf[..n], fds.len()), (&b"plain"[..], 0));
}

#[test]
fn more_descriptors_than_allowed_are_all_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let name = unique_name("extra");
    let memfd = memfd_with(&name, b"x");
    let fd = memfd.as_fd();
    fdpass::send_with_fds(&a, b"!", &[fd, fd, fd]).unwrap();
    drop(memfd);
    // Three duplicates are in flight, owned by the socket buffer, not by any descriptor here.
    assert_eq!(open_fds_named(&name), 0);

    let mut byte = [0u8; 1];
    let err = fdpass::recv_with_fds(&b, &mut byte, 1).unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 1, got: 3 }), "{err}");
    assert_eq!(open_fds_named(&name), 0, "rejected descriptors were leaked");
}

#[test]
fn unexpected_descriptors_are_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let name = unique_name("unexpected");
    let memfd = memfd_with(&name, b"x");
    fdpass::send_with_fds(&a, b"!", &[memfd.as_fd()]).unwrap();
    drop(memfd);
    let mut byte = [0u8; 1];
    let err = fdpass::recv_with_fds(&b, &mut byte, 0).unwrap_err();
    assert!(matches!(err, Error::DescriptorCount { expected: 0, got: 1 }), "{err}");
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn unread_descriptors_die_with_the_socket() {
    let name = unique_name("unread");
    {
        let (a, b) = UnixStream::pair().unwrap();
        let memfd = memfd_with(&name, b"x");
        fdpass::send_with_fds(&a, b"!", &[memfd.as_fd()]).unwrap();
        drop(b);
    }
    assert_eq!(open_fds_named(&name), 0);
}

#[test]
fn send_limits() {
    let (a, _b) = UnixStream::pair().unwrap();
    let memfd = memfd_with(&unique_name("limits"), b"x");
    let too_many = vec![memfd.as_fd(); SCM_MAX_FD + 1];
    assert!(matches!(
        fdpass::send_with_fds(&a, b"x", &too_many).unwrap_err(),
        Error::DescriptorCount { .. }
    ));
    // Descriptors need a byte to ride on.
    assert!(matches!(
        fdpass::send_with_fds(&a, b"", &[memfd.as_fd()]).unwrap_err(),
        Error::Violation { .. }
    ));
}

#[test]
fn closed_peer() {
    let (a, b) = UnixStream::pair().unwrap();
    drop(b);
    let err = fdpass::send_with_fds(&a, b"x", &[]).unwrap_err();
    assert!(matches!(err, Error::Closed), "{err}");

    let (a, b) = UnixStream::pair().unwrap();
    drop(a);
    let mut buf = [0u8; 4];
    let (n, fds) = fdpass::recv_with_fds(&b, &mut buf, 1).unwrap();
    assert_eq!((n, fds.len()), (0, 0));
    assert!(b.as_raw_fd() >= 0);
}

/// The module documentation's example (a doctest until the module became private): a memfd's
/// contents read back through the received descriptor.
#[test]
fn memfd_travels_with_a_byte() -> Result<(), Box<dyn std::error::Error>> {
    let (a, b) = UnixStream::pair()?;
    let memfd = rustix::fs::memfd_create("example", rustix::fs::MemfdFlags::CLOEXEC)?;
    std::fs::File::from(memfd.try_clone()?).write_all(b"pool")?;

    fdpass::send_with_fds(&a, b"x", &[memfd.as_fd()])?;
    let mut byte = [0u8; 1];
    let (n, fds) = fdpass::recv_with_fds(&b, &mut byte, 1)?;
    assert_eq!((n, fds.len()), (1, 1));

    let mut file = std::fs::File::from(fds.into_iter().next().unwrap());
    let mut text = String::new();
    file.rewind()?;
    file.read_to_string(&mut text)?;
    assert_eq!(text, "pool");
    Ok(())
}
