//! Whole frames over a Unix stream socket, with the file descriptors that ride on them, under
//! deadlines: the socket I/O both protocols' connections are built on (mempool-ipc's and
//! mempool-store's `connection`). Each protocol keeps its messages, its limits and its errors: this
//! layer reports what happened ([`RecvError`], [`SendError`]) and the connection says it in its
//! own words.
//!
//! - [`send_frame`] writes one encoded frame with its descriptors attached to the first byte, in as
//!   many `sendmsg` calls as the socket's room takes, and fails at a deadline.
//! - [`recv_frame`] reads exactly one frame, never a byte past it, so every descriptor that arrives
//!   while it is read belongs to it. The header is handed to the protocol, which checks it (magic,
//!   version, type, the body length against its limit: hostile input, checked before the body is
//!   allocated) and says how long the body is and how many descriptors the type carries at most.
//!   Descriptors are counted as they arrive ([`FdTally`]): before the header at most the number the
//!   caller allows, after it at most the type's; one more and the read fails at once with all of
//!   them closed. The exact count, which a body may state, is the protocol's to check after decoding.
//!
//! Every call tries the system call first and polls only when the socket has no data or no room
//! (one system call per frame in the common case), so the socket's blocking mode does not matter,
//! and a thread blocked here wakes when another shuts the socket down.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};

use crate::fdpass::{self, FdTally};
use crate::frame::HEADER_LEN;

/// Writing a frame failed after `sent` of its bytes went out (more than 0: the peer's reader is out
/// of step, nothing can follow on the connection).
#[derive(Debug)]
pub struct SendError {
    /// How many bytes of the frame went out.
    pub sent: usize,
    /// What happened.
    pub kind: SendErrorKind,
}

/// What made a [`send_frame`] fail.
#[derive(Debug, PartialEq, Eq)]
pub enum SendErrorKind {
    /// The deadline passed with the socket still full.
    Timeout,
    /// The socket took no byte (the peer is gone).
    Closed,
    /// `sendmsg` or `poll` failed (`EPIPE`, `ECONNRESET`: the peer is gone).
    Io(Errno),
}

/// Writes `frame` with `fds` attached to its first byte, by `deadline` at the latest. The peer
/// receives duplicates of the descriptors; the caller keeps its own. `frame` must not be empty when
/// `fds` is not (the protocols' frames have a header).
pub fn send_frame(
    socket: BorrowedFd<'_>,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
) -> Result<(), SendError> {
    let mut sent = 0;
    while sent < frame.len() {
        let fail = |kind| Err(SendError { sent, kind });
        if Instant::now() >= deadline {
            return fail(SendErrorKind::Timeout);
        }
        // The descriptors go with the frame's first byte, once.
        let fds = if sent == 0 { fds } else { &[] };
        match fdpass::retry_intr(|| fdpass::send_raw(socket, &frame[sent..], fds, SendFlags::DONTWAIT)) {
            Ok(0) => return fail(SendErrorKind::Closed),
            Ok(n) => sent += n,
            Err(Errno::AGAIN) => match wait(socket, PollFlags::OUT, Some(deadline)) {
                Ok(()) => {}
                Err(None) => return fail(SendErrorKind::Timeout),
                Err(Some(errno)) => return fail(SendErrorKind::Io(errno)),
            },
            Err(errno) => return fail(SendErrorKind::Io(errno)),
        }
    }
    Ok(())
}

/// When a frame must arrive.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// When the frame's first byte must have arrived (`None`: wait as long as it takes).
    pub first_byte: Option<Instant>,
    /// How long the whole frame may take from its first byte (a peer that trickles is cut off).
    pub frame: Duration,
    /// When the whole frame must have arrived, whenever it began (`None`: only `frame` bounds it).
    pub end: Option<Instant>,
}

/// What a protocol says of a frame's header: its own reading of it, the body's length (checked
/// against the protocol's limit) and the most descriptors the type carries.
#[derive(Debug)]
pub struct HeaderCheck<H> {
    /// The protocol's decoded header, handed back with the frame.
    pub head: H,
    /// The body's length in bytes.
    pub body_len: usize,
    /// The most descriptors a frame of this type carries.
    pub max_fds: usize,
}

/// One frame read: the protocol's header, the body, every descriptor that came with it (close-on-exec;
/// at most the type's most, not yet checked against what the body says).
#[derive(Debug)]
pub struct ReceivedFrame<H> {
    /// The header as the protocol read it.
    pub head: H,
    /// The body's bytes.
    pub body: Vec<u8>,
    /// The descriptors.
    pub fds: Vec<OwnedFd>,
}

/// Reading a frame failed; every descriptor that came with it is closed.
#[derive(Debug)]
pub struct RecvError<E> {
    /// Whether any byte of the frame had arrived (a failure before one leaves the stream in step).
    pub started: bool,
    /// What happened.
    pub kind: RecvErrorKind<E>,
}

/// What made a [`recv_frame`] fail.
#[derive(Debug)]
pub enum RecvErrorKind<E> {
    /// A deadline passed.
    Timeout,
    /// The peer closed the connection after `got` of the `needed` bytes (0 of [`HEADER_LEN`]: between
    /// frames).
    Closed {
        /// The bytes the frame, as far as it was known, needed (the header's, or header and body).
        needed: usize,
        /// The bytes that arrived.
        got: usize,
    },
    /// More descriptors arrived than may: `got` where at most `max` (the caller's limit before the
    /// header was in, the type's after; `header_known` says which).
    Descriptors {
        /// The most that may arrive.
        max: usize,
        /// How many arrived (more than could be counted, where the kernel dropped some: `max` + 1 or
        /// more).
        got: usize,
        /// Whether the header was in (the limit is then the type's).
        header_known: bool,
    },
    /// The protocol refused the header.
    Header(E),
    /// `recvmsg` or `poll` failed (`ECONNRESET`: the peer is gone).
    Io(Errno),
}

/// Reads exactly one frame from `socket`: the header, which `check_header` judges, then the body,
/// with at most `fds_before_header` descriptors before the header is in. See the
/// [module documentation](self).
pub fn recv_frame<H, E>(
    socket: BorrowedFd<'_>,
    deadlines: Deadlines,
    fds_before_header: usize,
    check_header: impl FnOnce(&[u8; HEADER_LEN]) -> Result<HeaderCheck<H>, E>,
) -> Result<ReceivedFrame<H>, RecvError<E>> {
    let mut reader = FrameReader {
        socket,
        deadlines,
        deadline: deadlines.first_byte,
        started: false,
        fds: FdTally::default(),
        max_fds: fds_before_header,
        header_known: false,
    };
    let fail = |reader: &FrameReader<'_>, kind| RecvError {
        started: reader.started,
        kind,
    };
    let mut header = [0u8; HEADER_LEN];
    reader
        .read_exact(&mut header, 0, HEADER_LEN)
        .map_err(|kind| fail(&reader, kind))?;
    let check = check_header(&header).map_err(|e| fail(&reader, RecvErrorKind::Header(e)))?;
    reader.max_fds = check.max_fds;
    reader.header_known = true;
    reader.check_fds().map_err(|kind| fail(&reader, kind))?;
    let mut body = vec![0u8; check.body_len];
    reader
        .read_exact(&mut body, HEADER_LEN, HEADER_LEN + check.body_len)
        .map_err(|kind| fail(&reader, kind))?;
    Ok(ReceivedFrame {
        head: check.head,
        body,
        fds: reader.fds.take(),
    })
}

/// The state of one frame being read.
struct FrameReader<'a> {
    socket: BorrowedFd<'a>,
    deadlines: Deadlines,
    /// The deadline now: the first byte's, then the frame's (and `end`).
    deadline: Option<Instant>,
    /// Whether the frame's first byte has arrived.
    started: bool,
    /// Every descriptor that arrived while this frame was read; dropped (closed) on error.
    fds: FdTally,
    /// The most descriptors that may have arrived so far.
    max_fds: usize,
    header_known: bool,
}

impl FrameReader<'_> {
    fn check_fds<E>(&self) -> Result<(), RecvErrorKind<E>> {
        match self.fds.check(self.max_fds, false) {
            Err(crate::error::Error::DescriptorCount { got, .. }) => Err(RecvErrorKind::Descriptors {
                max: self.max_fds,
                got,
                header_known: self.header_known,
            }),
            _ => Ok(()),
        }
    }

    /// Fills `buf` (bytes `done_before..` of a frame of `frame_len` bytes) without reading past it,
    /// counting descriptors. The frame's first byte starts its clock.
    fn read_exact<E>(&mut self, buf: &mut [u8], done_before: usize, frame_len: usize) -> Result<(), RecvErrorKind<E>> {
        let mut filled = 0;
        while filled < buf.len() {
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(RecvErrorKind::Timeout);
            }
            let received =
                match fdpass::retry_intr(|| fdpass::recv_raw(self.socket, &mut buf[filled..], RecvFlags::DONTWAIT)) {
                    Ok(received) => received,
                    Err(Errno::AGAIN) => {
                        wait(self.socket, PollFlags::IN, self.deadline)
                            .map_err(|e| e.map_or(RecvErrorKind::Timeout, RecvErrorKind::Io))?;
                        continue;
                    }
                    Err(errno) => return Err(RecvErrorKind::Io(errno)),
                };
            // Kept up to the limit, the rest closed at once (still counted).
            self.fds.add(received.fds, received.control_truncated, self.max_fds);
            self.check_fds()?;
            if received.bytes == 0 {
                return Err(RecvErrorKind::Closed {
                    needed: frame_len,
                    got: done_before + filled,
                });
            }
            if !self.started {
                self.started = true;
                let frame_deadline = Instant::now() + self.deadlines.frame;
                self.deadline = Some(self.deadlines.end.map_or(frame_deadline, |d| d.min(frame_deadline)));
            }
            filled += received.bytes;
        }
        Ok(())
    }
}

/// Waits until `fd` is ready for `events` (hang-ups and errors count as ready: the next call reports
/// them); `Err(None)` once `deadline` passes, `Err(Some(errno))` if `poll` fails.
fn wait(fd: BorrowedFd<'_>, events: PollFlags, deadline: Option<Instant>) -> Result<(), Option<Errno>> {
    loop {
        let timeout = match deadline {
            None => None,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(None);
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: i64::MAX,
                    tv_nsec: 0,
                }))
            }
        };
        let mut fds = [PollFd::from_borrowed_fd(fd, events)];
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(0) | Err(Errno::INTR) => continue,
            Ok(_) => return Ok(()),
            Err(errno) => return Err(Some(errno)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::frame::{Header, Writer};

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut w = Writer::frame_into(&mut bytes, *b"TEST", 1, 7);
        w.bytes(body);
        w.end();
        bytes
    }

    fn soon(ms: u64) -> Deadlines {
        Deadlines {
            first_byte: Some(Instant::now() + Duration::from_millis(ms)),
            frame: Duration::from_millis(ms),
            end: None,
        }
    }

    /// The header check of a protocol whose every type carries `max_fds`, with a body limit of 64.
    fn check(max_fds: usize) -> impl FnOnce(&[u8; HEADER_LEN]) -> Result<HeaderCheck<Header>, &'static str> {
        move |bytes| {
            let head = Header::parse(bytes).map_err(|_| "truncated")?;
            if head.body_len > 64 {
                return Err("body too long");
            }
            Ok(HeaderCheck {
                body_len: head.body_len as usize,
                max_fds,
                head,
            })
        }
    }

    #[test]
    fn a_frame_and_its_descriptor_arrive_whole_and_nothing_past_it_is_read() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut two = frame(b"hello");
        two.extend(frame(b"next"));
        send_frame(a.as_fd(), &two, &[a.as_fd()], Instant::now() + Duration::from_secs(5)).unwrap();
        let got = recv_frame(b.as_fd(), soon(5000), 1, check(1)).unwrap();
        assert_eq!(
            (got.body.as_slice(), got.fds.len(), got.head.kind),
            (&b"hello"[..], 1, 7)
        );
        let next = recv_frame(b.as_fd(), soon(5000), 0, check(0)).unwrap();
        assert_eq!(next.body, b"next");
    }

    #[test]
    fn descriptors_past_the_limit_fail_the_read_before_or_after_the_header() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = frame(b"x");
        let fds = [a.as_fd(), a.as_fd(), a.as_fd()];
        send_frame(a.as_fd(), &f, &fds, Instant::now() + Duration::from_secs(5)).unwrap();
        let err = recv_frame(b.as_fd(), soon(5000), 2, check(3)).unwrap_err();
        assert!(matches!(
            err.kind,
            RecvErrorKind::Descriptors {
                max: 2,
                got: 3,
                header_known: false
            }
        ));
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), &f, &fds[..2], Instant::now() + Duration::from_secs(5)).unwrap();
        let err = recv_frame(b.as_fd(), soon(5000), 3, check(1)).unwrap_err();
        assert!(matches!(
            err.kind,
            RecvErrorKind::Descriptors {
                max: 1,
                got: 2,
                header_known: true
            }
        ));
    }

    #[test]
    fn timeouts_closes_and_refused_headers_say_whether_the_frame_had_begun() {
        let (a, b) = UnixStream::pair().unwrap();
        let err = recv_frame(b.as_fd(), soon(20), 0, check(0)).unwrap_err();
        assert!(!err.started && matches!(err.kind, RecvErrorKind::Timeout));
        let f = frame(b"abc");
        send_frame(a.as_fd(), &f[..5], &[], Instant::now() + Duration::from_secs(5)).unwrap();
        let err = recv_frame(b.as_fd(), soon(20), 0, check(0)).unwrap_err();
        assert!(err.started && matches!(err.kind, RecvErrorKind::Timeout));
        let long = frame(&[0; 65]);
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), &long, &[], Instant::now() + Duration::from_secs(5)).unwrap();
        let err = recv_frame(b.as_fd(), soon(5000), 0, check(0)).unwrap_err();
        assert!(matches!(err.kind, RecvErrorKind::Header("body too long")));
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(
            a.as_fd(),
            &f[..HEADER_LEN + 1],
            &[],
            Instant::now() + Duration::from_secs(5),
        )
        .unwrap();
        drop(a);
        let err = recv_frame(b.as_fd(), soon(5000), 0, check(0)).unwrap_err();
        assert!(matches!(err.kind, RecvErrorKind::Closed { needed: 15, got: 13 }));
        let err = recv_frame(b.as_fd(), soon(5000), 0, check(0)).unwrap_err();
        assert!(!err.started && matches!(err.kind, RecvErrorKind::Closed { got: 0, .. }));
    }
}
