//! Whole memory-store frames over a Unix stream socket, with their descriptors, under time limits,
//! through mempool-socket's `frame_io` (the socket I/O the exporter protocol's connection uses too):
//! the first byte of a frame may be waited for as long as the caller says, the rest must come within
//! the frame limit (a client that trickles bytes is cut off), a send within the write limit.
//! Descriptors are counted against what the frame's type carries; any extra are closed at once and
//! the frame refused. This file keeps the store's own rules and words: which side reads which
//! messages, the protocol version, the limits, and its errors (`Timeout`, `PeerGone`, `Protocol`).
//! Frames are of the connection's protocol version (a Refused of any version this build speaks
//! is accepted: see `protocol::messages`). Used by both the server and the client.

use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::io::Errno;

use super::error::{Error, Result};
use super::protocol::codec;
use super::protocol::messages::{Message, MessageKind, MAX_ATTACH_MANY, MIN_VERSION};
use mempool_socket::frame_io::{self, RecvErrorKind, SendErrorKind};

/// One end of a memory-service connection.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: UnixStream,
    /// Which side reads here: a server reads only client messages, a client only server ones.
    server_side: bool,
    /// The connection's protocol version: a client's from the start, a server's once the Hello
    /// came (`None` before: frames of any version are read, and sent in [`MIN_VERSION`]).
    version: Option<u16>,
    /// How long a send may take.
    write_timeout: Duration,
}

/// Whether `errno` says the peer is gone.
fn is_gone(errno: Errno) -> bool {
    matches!(errno, Errno::PIPE | Errno::CONNRESET | Errno::NOTCONN)
}

impl Connection {
    /// Wraps a connected socket; `write_timeout` bounds every send. `version`: the protocol
    /// version the connection speaks (a client's), or `None` until [`Connection::set_version`] (a
    /// server's, once it read the Hello).
    pub(crate) fn new(
        stream: UnixStream,
        server_side: bool,
        version: Option<u16>,
        write_timeout: Duration,
    ) -> Result<Connection> {
        Ok(Connection {
            stream,
            server_side,
            version,
            write_timeout,
        })
    }

    /// The connection's protocol version, once known.
    pub(crate) fn version(&self) -> Option<u16> {
        self.version
    }

    /// The connection speaks `version` from now on (the server, after the Hello).
    pub(crate) fn set_version(&mut self, version: u16) {
        self.version = Some(version);
    }

    pub(crate) fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends one message, with `fd` attached to its first byte.
    pub(crate) fn send(&self, message: &Message, fd: Option<BorrowedFd<'_>>) -> Result<()> {
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        self.send_fds(message, &fds)
    }

    /// Sends one message, with `fds` (as many as the message carries: the receiver checks)
    /// attached to its first byte, in one `SCM_RIGHTS` message.
    pub(crate) fn send_fds(&self, message: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let frame = codec::encode_as(message, self.version.unwrap_or(MIN_VERSION))?;
        let deadline = Instant::now() + self.write_timeout;
        frame_io::send_frame(self.stream.as_fd(), &frame, fds, deadline).map_err(|e| match e.kind {
            SendErrorKind::Timeout => Error::Timeout {
                during: "writing a frame",
            },
            SendErrorKind::Closed => Error::PeerGone {
                during: "writing a frame",
            },
            SendErrorKind::Io(errno) if is_gone(errno) => Error::PeerGone {
                during: "writing a frame",
            },
            SendErrorKind::Io(errno) => errno.into(),
        })
    }

    /// Receives one message and its descriptors. Waits up to `first` for its first byte (None:
    /// forever); the whole frame must then arrive within `frame_timeout`.
    pub(crate) fn recv(&self, first: Option<Duration>, frame_timeout: Duration) -> Result<(Message, Vec<OwnedFd>)> {
        self.recv_versioned(first, frame_timeout)
            .map(|(message, fds, _)| (message, fds))
    }

    /// [`Connection::recv`], with the protocol version of the frame: the connection's, or any this
    /// build speaks for a Refused, or for anything before the connection's version is known.
    pub(crate) fn recv_versioned(
        &self,
        first: Option<Duration>,
        frame_timeout: Duration,
    ) -> Result<(Message, Vec<OwnedFd>, u16)> {
        let deadlines = frame_io::Deadlines {
            first_byte: first.map(|t| Instant::now() + t),
            frame: frame_timeout,
            end: None,
        };
        // Before the header is in, at most what any message this side receives carries is kept
        // (a server receives none: one is let in to be refused with the header's reason).
        let fds_before_header = if self.server_side { 1 } else { MAX_ATTACH_MANY };
        let read = frame_io::recv_frame(self.stream.as_fd(), deadlines, fds_before_header, |header| {
            let h = codec::decode_header(header)?;
            if let Some(version) = self.version {
                if h.version != version && h.kind != MessageKind::Refused {
                    return Err(Error::protocol(format!(
                        "a {:?} frame of protocol version {} on a connection of version {version}",
                        h.kind, h.version
                    )));
                }
            }
            if h.kind.is_from_client() != self.server_side {
                return Err(Error::protocol(format!(
                    "{:?} is not a message this side receives",
                    h.kind
                )));
            }
            Ok(frame_io::HeaderCheck {
                max_fds: h.kind.max_fds(),
                body_len: h.body_len,
                head: h,
            })
        });
        let frame = read.map_err(|e| {
            let during = if e.started {
                "reading a frame"
            } else {
                "waiting for a frame"
            };
            match e.kind {
                RecvErrorKind::Timeout => Error::Timeout { during },
                RecvErrorKind::Closed { .. } => Error::PeerGone { during },
                RecvErrorKind::Descriptors {
                    max,
                    got,
                    header_known: false,
                } => Error::protocol(format!("{got} file descriptors arrived where at most {max} may")),
                RecvErrorKind::Descriptors { max, got, .. } => Error::protocol(format!(
                    "the frame carries at most {max} file descriptors, {got} arrived"
                )),
                RecvErrorKind::Header(e) => e,
                RecvErrorKind::Io(errno) if is_gone(errno) => Error::PeerGone {
                    during: "reading a frame",
                },
                RecvErrorKind::Io(errno) => errno.into(),
            }
        })?;
        let h = frame.head;
        let message = codec::decode_body_as(h.kind, h.version, &frame.body)?;
        let expected = message.fd_count();
        if frame.fds.len() != expected {
            return Err(Error::protocol(format!(
                "{:?} carries {expected} file descriptors, {} arrived",
                h.kind,
                frame.fds.len()
            )));
        }
        Ok((message, frame.fds, h.version))
    }

    /// Shuts the socket down both ways (wakes a thread blocked reading it).
    pub(crate) fn shutdown(stream: &UnixStream) {
        if let Err(e) = stream.shutdown(std::net::Shutdown::Both) {
            debug_assert!(e.kind() == ErrorKind::NotConnected, "{e}");
        }
    }
}

#[cfg(test)]
mod tests;
