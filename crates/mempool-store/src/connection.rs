//! Whole memory-service frames over a Unix stream socket, with their descriptors, under time
//! limits: the first byte of a frame may be waited for as long as the caller says, the rest must
//! come within the frame limit (a client that trickles bytes is cut off). Descriptors are counted
//! against what the frame's type carries; any extra are closed at once and the frame refused.
//! Frames are of the connection's protocol version (a Refused of any version this build speaks
//! is accepted: see `protocol::messages`). Used by both the server and the client.

use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};

use super::error::{Error, Result};
use super::protocol::codec;
use super::protocol::messages::{Message, MessageKind, HEADER_LEN, MAX_ATTACH_MANY, MIN_VERSION};
use mempool_socket::fdpass;

/// One end of a memory-service connection.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: UnixStream,
    /// Which side reads here: a server reads only client messages, a client only server ones.
    server_side: bool,
    /// The connection's protocol version: a client's from the start, a server's once the Hello
    /// came (`None` before: frames of any version are read, and sent in [`MIN_VERSION`]).
    version: Option<u16>,
}

fn is_timeout(errno: Errno) -> bool {
    errno == Errno::AGAIN || errno == Errno::WOULDBLOCK || errno == Errno::TIMEDOUT
}

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
        stream.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1))))?;
        Ok(Connection {
            stream,
            server_side,
            version,
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
        let mut sent = 0;
        while sent < frame.len() {
            let fds: &[BorrowedFd<'_>] = if sent == 0 { fds } else { &[] };
            match fdpass::send_raw(self.stream.as_fd(), &frame[sent..], fds, SendFlags::empty()) {
                Ok(n) => sent += n,
                Err(Errno::INTR) => {}
                Err(e) if is_timeout(e) => {
                    return Err(Error::Timeout {
                        during: "writing a frame",
                    })
                }
                Err(e) if is_gone(e) => {
                    return Err(Error::PeerGone {
                        during: "writing a frame",
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn set_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        // A zero timeout means "none" to the kernel: never pass one.
        Ok(self
            .stream
            .set_read_timeout(timeout.map(|t| t.max(Duration::from_millis(1))))?)
    }

    /// Reads into `buf` until full. `deadline` None: wait for the first byte as long as
    /// `first` allows (None: forever), then set the frame's deadline from `frame_timeout`.
    fn fill(
        &self,
        buf: &mut [u8],
        deadline: &mut Option<Instant>,
        first: Option<Duration>,
        frame_timeout: Duration,
        fds: &mut Vec<OwnedFd>,
        fd_limit: &mut usize,
    ) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            match *deadline {
                None => self.set_timeout(first)?,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout {
                            during: "reading a frame",
                        });
                    }
                    self.set_timeout(Some(left))?;
                }
            }
            match fdpass::recv_raw(self.stream.as_fd(), &mut buf[got..], RecvFlags::empty()) {
                Ok(r) => {
                    let count = r.fds.len();
                    if r.control_truncated || count > *fd_limit {
                        return Err(Error::protocol(format!(
                            "{} file descriptors arrived where at most {} may",
                            count.max(*fd_limit + 1),
                            *fd_limit
                        )));
                    }
                    *fd_limit -= count;
                    fds.extend(r.fds);
                    if r.bytes == 0 {
                        return Err(Error::PeerGone {
                            during: if deadline.is_none() {
                                "waiting for a frame"
                            } else {
                                "reading a frame"
                            },
                        });
                    }
                    if deadline.is_none() {
                        *deadline = Some(Instant::now() + frame_timeout);
                    }
                    got += r.bytes;
                }
                Err(Errno::INTR) => {}
                Err(e) if is_timeout(e) => {
                    return Err(Error::Timeout {
                        during: if deadline.is_none() {
                            "waiting for a frame"
                        } else {
                            "reading a frame"
                        },
                    })
                }
                Err(e) if is_gone(e) => {
                    return Err(Error::PeerGone {
                        during: "reading a frame",
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
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
        let mut deadline = None;
        let mut fds = Vec::new();
        // Before the header is in, at most what any message this side receives carries is kept
        // (a server receives none: one is let in to be refused with the header's reason).
        let mut fd_limit = if self.server_side { 1 } else { MAX_ATTACH_MANY };
        let mut header = [0u8; HEADER_LEN];
        self.fill(
            &mut header,
            &mut deadline,
            first,
            frame_timeout,
            &mut fds,
            &mut fd_limit,
        )?;
        let h = codec::decode_header(&header)?;
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
        let most = h.kind.max_fds();
        if fds.len() > most {
            return Err(Error::protocol(format!(
                "{:?} carries at most {most} file descriptors, {} arrived",
                h.kind,
                fds.len()
            )));
        }
        fd_limit = most - fds.len();
        let mut body = vec![0u8; h.body_len];
        self.fill(&mut body, &mut deadline, first, frame_timeout, &mut fds, &mut fd_limit)?;
        let message = codec::decode_body_as(h.kind, h.version, &body)?;
        let expected = message.fd_count();
        if fds.len() != expected {
            return Err(Error::protocol(format!(
                "{:?} carries {expected} file descriptors, {} arrived",
                h.kind,
                fds.len()
            )));
        }
        Ok((message, fds, h.version))
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
