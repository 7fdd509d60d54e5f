//! A framed connection: whole protocol messages, with their file descriptors, over a Unix
//! stream socket, under timeouts.
//!
//! Framing keeps descriptors with their message: a frame goes out in one `sendmsg` with its
//! descriptors attached to its first byte, and the receiver never reads past the end of the
//! current frame, so every descriptor that arrives while a frame is read belongs to that frame.
//! Their number must be exactly what the message type carries; if not, all are closed and the
//! connection fails.
//!
//! Time limits: a frame that has begun to arrive must be complete within
//! [`ConnectionOptions::io_timeout`], and a send must finish within it, so a peer that stalls
//! or trickles cannot hold a thread forever. Waiting for the *next* frame is unbounded with
//! [`Connection::recv`] (an idle importer is legitimate) and bounded with
//! [`Connection::recv_timeout`] / [`Connection::recv_until`] (the handshake uses these).
//!
//! After a malformed or unexpected frame, a wrong descriptor count, a timeout in the middle of
//! a frame or an I/O error, the connection is *failed*: this side tells the peer with a
//! best-effort `Error` message, shuts the socket down, and every later call returns
//! [`Error::ConnectionFailed`].
//!
//! `send` and `recv` take `&self` and may run at the same time from two threads (each
//! direction has its own lock), so a reader thread can wait for releases while another thread
//! shares buffers.
//!
//! Only [`ConnectionOptions`] is public (re-exported at the crate root): the exporter's
//! [`ListenerOptions`](crate::ListenerOptions) and the [`ImporterOptions`](crate::ImporterOptions)
//! take it. The socket I/O (a whole frame with its descriptors under a deadline) is mempool-socket's
//! `frame_io`, shared with the memory store; this file keeps the protocol's rules and errors. The tests
//! (`connection/tests.rs`) play hostile peers over real sockets.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use rustix::net::{SendFlags, Shutdown};

use crate::error::{Error, Result};
use crate::protocol::{self, ErrorMessage, Message, ProtocolError, MAX_FDS_PER_MESSAGE};
use mempool_socket::cred::{self, PeerCredentials};
use mempool_socket::fdpass;
use mempool_socket::frame_io::{self, RecvErrorKind, SendErrorKind};
use mempool_socket::ConnectionOptions;

/// A message and the file descriptors that came with it (exactly
/// `message.descriptor_count()` of them, close-on-exec).
#[derive(Debug)]
pub(crate) struct Received {
    /// The message.
    pub(crate) message: Message,
    /// Its descriptors, owned: those not kept are closed when dropped.
    pub(crate) fds: Vec<OwnedFd>,
}

/// Whole protocol messages over a Unix stream socket. See the [module documentation](self).
#[derive(Debug)]
pub(crate) struct Connection {
    stream: UnixStream,
    options: ConnectionOptions,
    send_lock: Mutex<()>,
    recv_lock: Mutex<()>,
    failed: AtomicBool,
    write_closed: AtomicBool,
}

impl Connection {
    /// Wraps a connected stream. The stream's blocking mode does not matter: every call waits
    /// with `poll` and its own deadline.
    pub(crate) fn new(stream: UnixStream, options: ConnectionOptions) -> Connection {
        Connection {
            stream,
            options,
            send_lock: Mutex::new(()),
            recv_lock: Mutex::new(()),
            failed: AtomicBool::new(false),
            write_closed: AtomicBool::new(false),
        }
    }

    /// Connects to a listening socket at `path`. Check who answered with
    /// [`Connection::peer_credentials`] (the importer's session does).
    pub(crate) fn connect(path: impl AsRef<Path>, options: ConnectionOptions) -> Result<Connection> {
        Ok(Connection::new(UnixStream::connect(path)?, options))
    }

    /// Two connected ends, for tests and for threads of one process.
    #[cfg(test)]
    pub(crate) fn pair(options: ConnectionOptions) -> Result<(Connection, Connection)> {
        let (a, b) = UnixStream::pair()?;
        Ok((Connection::new(a, options), Connection::new(b, options)))
    }

    /// The time limits.
    pub(crate) fn options(&self) -> &ConnectionOptions {
        &self.options
    }

    /// The credentials of the process at the other end (`SO_PEERCRED`).
    pub(crate) fn peer_credentials(&self) -> Result<PeerCredentials> {
        Ok(cred::peer_credentials(&self.stream)?)
    }

    /// Whether the connection failed (or was shut down) and accepts no more calls.
    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Sends `message` with `fds` attached; their number must be what the message type
    /// carries ([`Error::DescriptorCount`] otherwise, and nothing is sent). The peer receives
    /// duplicates of the descriptors; the caller keeps its own.
    ///
    /// Fails with [`Error::Timeout`] if the peer does not make room within
    /// [`ConnectionOptions::io_timeout`]; if part of the frame had gone out, the connection fails.
    pub(crate) fn send(&self, message: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.send_inner(message, fds, None, "send")
    }

    /// Like [`Connection::send`], but also fails with [`Error::Timeout`] naming `during` if the
    /// send has not finished by `deadline`.
    pub(crate) fn send_until(
        &self,
        message: &Message,
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
        during: &'static str,
    ) -> Result<()> {
        self.send_inner(message, fds, Some(deadline), during)
    }

    fn send_inner(
        &self,
        message: &Message,
        fds: &[BorrowedFd<'_>],
        deadline: Option<Instant>,
        during: &'static str,
    ) -> Result<()> {
        let expected = message.descriptor_count();
        if fds.len() != expected {
            return Err(Error::DescriptorCount {
                expected,
                got: fds.len(),
            });
        }
        let frame = protocol::encode(message)?;
        let _guard = lock(&self.send_lock);
        self.check_usable()?;
        if self.write_closed.load(Ordering::Acquire) {
            return Err(Error::WriteClosed);
        }
        let io_deadline = Instant::now() + self.options.io_timeout;
        let deadline = deadline.map_or(io_deadline, |d| d.min(io_deadline));
        let result = frame_io::send_frame(self.stream.as_fd(), &frame, fds, deadline);
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                let err = match e.kind {
                    SendErrorKind::Timeout => Error::Timeout { during },
                    SendErrorKind::Closed => Error::Closed,
                    SendErrorKind::Io(errno) => errno.into(),
                };
                // A frame cut short leaves the peer's reader out of step: nothing can follow it.
                // Nothing sent (a timeout, or a peer that closed its side) leaves the stream in step:
                // what the peer said before it closed can still be read.
                if e.sent > 0 || !matches!(err, Error::Timeout { .. } | Error::Closed) {
                    self.fail_locked_send(None);
                }
                Err(err)
            }
        }
    }

    /// Receives the next message, waiting as long as it takes for it to begin; once it has,
    /// it must be complete within [`ConnectionOptions::io_timeout`].
    ///
    /// [`Error::Closed`] if the peer closed the connection between messages,
    /// [`ProtocolError::Truncated`] if it closed in the middle of one. A peer's `Error` message is
    /// returned as a message; the session layer turns it into [`Error::Remote`].
    #[cfg(test)]
    pub(crate) fn recv(&self) -> Result<Received> {
        self.recv_until(None, "receive")
    }

    /// Like [`Connection::recv`], but fails with [`Error::Timeout`] naming `during` if the
    /// message is not complete within `timeout`. A timeout before the first byte leaves the
    /// connection usable; one in the middle of a message fails it.
    #[cfg(test)]
    pub(crate) fn recv_timeout(&self, timeout: Duration, during: &'static str) -> Result<Received> {
        self.recv_until(Some(Instant::now() + timeout), during)
    }

    /// Like [`Connection::recv_timeout`], with an absolute deadline (`None`: no deadline).
    pub(crate) fn recv_until(&self, deadline: Option<Instant>, during: &'static str) -> Result<Received> {
        let _guard = lock(&self.recv_lock);
        self.check_usable()?;
        let deadlines = frame_io::Deadlines {
            first_byte: deadline,
            frame: self.options.io_timeout,
            end: deadline,
        };
        // Before the header is in, at most the most any message carries; then the type's most (a
        // `VmmChunks` says its exact count in its body, checked once it is decoded).
        let read = frame_io::recv_frame(self.stream.as_fd(), deadlines, MAX_FDS_PER_MESSAGE, |header| {
            let head = protocol::decode_header(header)?;
            Ok::<_, Error>(frame_io::HeaderCheck {
                max_fds: head.message_type.max_descriptors(),
                body_len: head.body_len,
                head,
            })
        });
        let result = match read {
            Ok(frame) => protocol::decode_body(frame.head.message_type, &frame.body)
                .map_err(Error::from)
                .and_then(|message| {
                    let expected = message.descriptor_count();
                    if frame.fds.len() != expected {
                        return Err(Error::DescriptorCount {
                            expected,
                            got: frame.fds.len(),
                        });
                    }
                    Ok(Received {
                        message,
                        fds: frame.fds,
                    })
                }),
            Err(e) => {
                let err = match e.kind {
                    RecvErrorKind::Timeout => Error::Timeout { during },
                    RecvErrorKind::Closed { got: 0, .. } => Error::Closed,
                    RecvErrorKind::Closed { needed, got } => ProtocolError::Truncated { needed, got }.into(),
                    RecvErrorKind::Descriptors { max, got, .. } => Error::DescriptorCount { expected: max, got },
                    RecvErrorKind::Header(e) => e,
                    RecvErrorKind::Io(errno) => errno.into(),
                };
                // Between messages, a timeout or the end of the peer's stream (it may have only
                // closed its sending side, after a `Goodbye`) leaves the stream in step.
                if e.started || !matches!(err, Error::Timeout { .. } | Error::Closed) {
                    self.fail(Some(&err));
                }
                return Err(err);
            }
        };
        if let Err(err) = &result {
            self.fail(Some(err));
        }
        result
    }

    /// Tells the peer about `err` with a best-effort `Error` message (if it is the kind the
    /// peer should hear about), then shuts the connection down.
    pub(crate) fn close_with_error(&self, err: &Error) {
        self.fail(Some(err));
    }

    /// Closes this side's sending direction (after a `Goodbye`): the peer reads the end of the
    /// stream after the last message, this side can still receive, and later sends fail with
    /// [`Error::WriteClosed`].
    pub(crate) fn close_write(&self) {
        let _guard = lock(&self.send_lock);
        if !self.write_closed.swap(true, Ordering::AcqRel) {
            let _ = rustix::net::shutdown(&self.stream, Shutdown::Write);
        }
    }

    /// Shuts the connection down: the peer sees it closed, and later calls on this side fail
    /// with [`Error::ConnectionFailed`].
    pub(crate) fn shutdown(&self) {
        self.fail(None);
    }

    fn check_usable(&self) -> Result<()> {
        if self.is_failed() {
            Err(Error::ConnectionFailed)
        } else {
            Ok(())
        }
    }

    fn fail(&self, err: Option<&Error>) {
        // Another thread may be blocked in `send` holding the lock; then the peer misses the
        // error message but still sees the connection close.
        match self.send_lock.try_lock() {
            Ok(_guard) => self.fail_locked_send(err),
            Err(_) => self.fail_locked_send(None),
        }
    }

    /// Fails the connection; the caller holds the send lock, or passes no error to send.
    fn fail_locked_send(&self, err: Option<&Error>) {
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(err) = err.filter(|e| e.worth_telling_peer()) {
            let message = Message::Error(ErrorMessage::new(err.wire_code(), err.to_string()));
            if let Ok(frame) = protocol::encode(&message) {
                // One attempt that never blocks: the socket buffer of a fresh or idle
                // connection has room, and a stalled peer does not deserve a wait.
                let _ = fdpass::send_raw(self.stream.as_fd(), &frame, &[], SendFlags::DONTWAIT);
            }
        }
        let _ = rustix::net::shutdown(&self.stream, Shutdown::Both);
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

impl AsRawFd for Connection {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

fn lock(mutex: &Mutex<()>) -> MutexGuard<'_, ()> {
    // The mutex guards no data, only turn-taking: a panic while it was held leaves nothing
    // inconsistent behind.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Short limits for the tests: a stalled peer costs a test 200 ms.
#[cfg(test)]
pub(crate) fn short_options() -> ConnectionOptions {
    ConnectionOptions {
        io_timeout: Duration::from_millis(200),
        handshake_timeout: Duration::from_millis(200),
    }
}

#[cfg(test)]
mod tests;

/// Accepts a connection on `listener` as the exporter's protocol does (the tests; the exporter's
/// reactor admits its own): a peer the access policy refuses is told why (`PermissionDenied`)
/// before its connection closes, and this returns the refusal.
#[cfg(test)]
pub(crate) fn accept(listener: &mempool_socket::Listener) -> Result<(Connection, PeerCredentials)> {
    match listener.accept() {
        Ok((stream, peer)) => Ok((Connection::new(stream, listener.connection_options()), peer)),
        Err(refused) => {
            let err = Error::from(refused.error);
            if let Some(stream) = refused.stream {
                Connection::new(stream, listener.connection_options()).close_with_error(&err);
            }
            Err(err)
        }
    }
}
