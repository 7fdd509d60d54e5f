//! One connection as the event loop serves it: a non-blocking socket, the frame being read, the
//! frame being written, the handshake while it runs, and the times that its deadlines count from.
//!
//! Reading never goes past the end of the current frame (the header first, then exactly its
//! body), so descriptors stay with their frame, as in `conn`; their number is checked against
//! the frame's type ([`FdTally`]). Writing sends what the socket takes now and keeps the rest of
//! the frame for when it is writable again: nothing here ever blocks.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags, Shutdown};

use super::exits::ProcessRef;
use super::outbox::Outgoing;
use crate::error::{Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{self, ErrorMessage, Header, Message, ProtocolError, HEADER_LEN};
use crate::session::ExporterHandshake;
use mempool_socket::cred::PeerCredentials;
use mempool_socket::fdpass::{self, FdTally};

/// The most descriptors kept while a frame's header is still arriving (the rest are closed at once,
/// still counted): no message an importer sends carries any, so one is enough to name the count in
/// the error, and a hostile importer cannot make the exporter hold more.
const KEPT_BEFORE_HEADER: usize = 1;

/// The most frames read from one connection per wake-up, so a chatty peer cannot starve others
/// (the poll is level-triggered: the rest is read on the next round).
pub(crate) const FRAMES_PER_ROUND: usize = 32;

/// One connection.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) id: ImporterId,
    pub(crate) stream: UnixStream,
    pub(crate) credentials: PeerCredentials,
    /// The importer's process, remembered when its handshake completes.
    pub(crate) process: Option<ProcessRef>,
    /// The handshake while it runs; `None` once the importer is connected.
    pub(crate) handshake: Option<ExporterHandshake>,
    pub(crate) accepted: Instant,
    /// When a byte last arrived or went out.
    pub(crate) last_traffic: Instant,
    /// Whether any byte arrived.
    pub(crate) heard: bool,
    /// Frames of the handshake waiting to go out (after it, the importer's outbox holds them).
    pub(crate) local: VecDeque<Outgoing>,
    /// Since when output waits that the socket does not take.
    pub(crate) blocked_since: Option<Instant>,
    /// Whether the loop asked to hear when the socket is writable.
    pub(crate) wants_out: bool,
    /// Whether the sending direction is closed (after the exporter's `Goodbye`).
    pub(crate) write_closed: bool,
    /// The capabilities its handshake granted (`protocol::CAP_*`; 0 for a version-1 importer).
    pub(crate) capabilities: u64,
    /// The connection's shared-memory rings (granted `CAP_RING`), from the handshake's end on.
    pub(crate) ring: Option<super::ring_peer::RingPeer>,
    /// The ring to the importer, from the handshake's end until its outbox opens with it.
    pub(crate) ring_sender: Option<super::ring_peer::RingSender>,
    reader: Reader,
    writing: Option<Writing>,
}

#[derive(Debug)]
struct Writing {
    item: Outgoing,
    sent: usize,
}

#[derive(Debug, Default)]
struct Reader {
    header: [u8; HEADER_LEN],
    header_filled: usize,
    head: Option<Header>,
    body: Vec<u8>,
    body_filled: usize,
    fds: FdTally,
    /// When the frame's first byte arrived.
    started: Option<Instant>,
}

/// What reading found.
#[derive(Debug)]
pub(crate) enum Read {
    /// Complete messages (none if the socket had only part of a frame).
    Messages(Vec<Message>),
    /// The peer closed its side between frames, after these messages.
    Closed(Vec<Message>),
}

/// What writing found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Flushed {
    /// Everything went out.
    All,
    /// The socket is full: wait for it to be writable.
    Blocked,
}

impl Peer {
    /// A connection just accepted (non-blocking from now on).
    pub(crate) fn new(
        id: ImporterId,
        stream: UnixStream,
        credentials: PeerCredentials,
        handshake: ExporterHandshake,
        now: Instant,
    ) -> std::io::Result<Peer> {
        stream.set_nonblocking(true)?;
        Ok(Peer {
            id,
            stream,
            credentials,
            process: None,
            handshake: Some(handshake),
            accepted: now,
            last_traffic: now,
            heard: false,
            local: VecDeque::new(),
            blocked_since: None,
            wants_out: false,
            write_closed: false,
            capabilities: 0,
            ring: None,
            ring_sender: None,
            reader: Reader::default(),
            writing: None,
        })
    }

    /// Whether the peer has sent anything: read already, or waiting in the socket (looked at
    /// without reading it, and remembered). A real importer speaks as soon as it connects, so a
    /// connection accepted in the same round as a flood is told from the silent ones by this.
    pub(crate) fn spoke(&mut self) -> bool {
        if !self.heard {
            let mut byte = [0u8; 1];
            let peeked = rustix::net::recv(&self.stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT);
            self.heard = matches!(peeked, Ok((n, _)) if n > 0);
        }
        self.heard
    }

    /// When the frame being read began, if one is.
    pub(crate) fn frame_started(&self) -> Option<Instant> {
        self.reader.started
    }

    /// Whether part of a frame is still to be written.
    pub(crate) fn writing(&self) -> bool {
        self.writing.is_some()
    }

    /// Reads what the socket has, at most [`FRAMES_PER_ROUND`] frames.
    ///
    /// Errors (the connection ends): a frame that breaks the wire format, the wrong number of
    /// descriptors, the peer closing inside a frame, a socket error.
    pub(crate) fn read(&mut self, now: Instant) -> Result<Read> {
        let mut messages = Vec::new();
        while messages.len() < FRAMES_PER_ROUND {
            match self.read_frame(now)? {
                Some(Some(message)) => messages.push(message),
                Some(None) => return Ok(Read::Closed(messages)),
                None => break,
            }
        }
        Ok(Read::Messages(messages))
    }

    /// One frame: `Some(Some(m))` complete, `Some(None)` closed between frames, `None` not yet.
    fn read_frame(&mut self, now: Instant) -> Result<Option<Option<Message>>> {
        let r = &mut self.reader;
        loop {
            let (buf, limit, frame_len, done_before) = match r.head {
                None => (
                    &mut r.header[r.header_filled..],
                    KEPT_BEFORE_HEADER,
                    HEADER_LEN,
                    r.header_filled,
                ),
                Some(head) => (
                    &mut r.body[r.body_filled..],
                    head.message_type.max_descriptors().min(KEPT_BEFORE_HEADER),
                    HEADER_LEN + head.body_len,
                    HEADER_LEN + r.body_filled,
                ),
            };
            if !buf.is_empty() {
                let received =
                    match fdpass::retry_intr(|| fdpass::recv_raw(self.stream.as_fd(), buf, RecvFlags::DONTWAIT)) {
                        Ok(received) => received,
                        Err(Errno::AGAIN) => return Ok(None),
                        Err(errno) => return Err(errno.into()),
                    };
                let n = received.bytes;
                r.fds.add(received.fds, received.control_truncated, limit);
                if let Some(head) = r.head {
                    r.fds.check(head.message_type.max_descriptors(), false)?;
                }
                if n == 0 {
                    if r.started.is_none() && r.fds.count() == 0 {
                        return Ok(Some(None));
                    }
                    return Err(ProtocolError::Truncated {
                        needed: frame_len,
                        got: done_before,
                    }
                    .into());
                }
                self.heard = true;
                self.last_traffic = now;
                r.started.get_or_insert(now);
                match r.head {
                    None => r.header_filled += n,
                    Some(_) => r.body_filled += n,
                }
            }
            match r.head {
                None if r.header_filled == HEADER_LEN => {
                    let head = protocol::decode_header(&r.header)?;
                    r.fds.check(head.message_type.max_descriptors(), false)?;
                    r.head = Some(head);
                    r.body = vec![0; head.body_len];
                    r.body_filled = 0;
                }
                Some(head) if r.body_filled == head.body_len => {
                    r.fds.check(head.message_type.max_descriptors(), false)?;
                    let message = protocol::decode_body(head.message_type, &r.body)?;
                    r.fds.check(message.descriptor_count(), true)?;
                    // Every message an exporter accepts carries none; `check` saw to that.
                    drop(r.fds.take());
                    *r = Reader::default();
                    return Ok(Some(Some(message)));
                }
                _ => {}
            }
        }
    }

    /// Writes what waits, as far as the socket takes it: the rest of the frame begun, then the
    /// handshake's frames, then those `next` hands out (the importer's outbox). `pool_fd` rides
    /// on frames that carry it.
    pub(crate) fn flush(
        &mut self,
        pool_fd: BorrowedFd<'_>,
        now: Instant,
        mut next: impl FnMut() -> Option<Outgoing>,
    ) -> Result<Flushed> {
        loop {
            if self.writing.is_none() {
                let item = match self.local.pop_front() {
                    Some(item) => Some(item),
                    None if self.write_closed => None,
                    None => next(),
                };
                match item {
                    Some(item) => self.writing = Some(Writing { item, sent: 0 }),
                    None => {
                        self.blocked_since = None;
                        return Ok(Flushed::All);
                    }
                }
            }
            let Some(w) = self.writing.as_mut() else {
                continue;
            };
            let own_fds: Vec<BorrowedFd<'_>>;
            let fds: &[BorrowedFd<'_>] = if w.sent == 0 && w.item.with_pool_fd {
                &[pool_fd]
            } else if w.sent == 0 && !w.item.fds.is_empty() {
                own_fds = w.item.fds.iter().map(AsFd::as_fd).collect();
                &own_fds
            } else {
                &[]
            };
            match fdpass::retry_intr(|| {
                fdpass::send_raw(self.stream.as_fd(), &w.item.frame[w.sent..], fds, SendFlags::DONTWAIT)
            }) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => {
                    w.sent += n;
                    self.last_traffic = now;
                    if self.blocked_since.is_some() {
                        self.blocked_since = Some(now);
                    }
                    // The descriptors went with the first byte: close this side's copies.
                    w.item.fds.clear();
                    if w.sent == w.item.frame.len() {
                        if let Some(buffer) = w.item.buffer {
                            crate::trace::mark(crate::trace::Point::ExporterFrameOut, buffer.0);
                        }
                        let fin = w.item.fin;
                        self.writing = None;
                        if fin {
                            self.close_write();
                        }
                    }
                }
                Err(Errno::AGAIN) => {
                    self.blocked_since.get_or_insert(now);
                    return Ok(Flushed::Blocked);
                }
                Err(errno) => return Err(errno.into()),
            }
        }
    }

    /// Closes the sending direction: the peer reads the end of the stream after the last frame.
    pub(crate) fn close_write(&mut self) {
        if !self.write_closed {
            self.write_closed = true;
            let _ = rustix::net::shutdown(&self.stream, Shutdown::Write);
        }
    }

    /// The buffers of frames that never began to go out: the importer never saw them. A frame
    /// cut short counts as delivered, to be safe (its lease is then reclaimed like the others).
    pub(crate) fn undelivered_local(&mut self) -> Vec<crate::protocol::BufferId> {
        let mut out: Vec<_> = self.local.drain(..).filter_map(|o| o.buffer).collect();
        if let Some(w) = self.writing.take() {
            if w.sent == 0 {
                out.extend(w.item.buffer);
            }
        }
        out
    }

    /// Tells the peer about `err` with one `Error` frame that never blocks (best effort: a
    /// frame half written, or a full socket, means the peer only sees the connection close), and
    /// shuts the socket down.
    pub(crate) fn close_with(&mut self, err: Option<&Error>, code: Option<crate::protocol::ErrorCode>) {
        if let Some(err) = err.filter(|e| e.worth_telling_peer()) {
            if self.writing.is_none() && !self.write_closed {
                let code = code.unwrap_or_else(|| err.wire_code());
                if let Ok(frame) = protocol::encode(&Message::Error(ErrorMessage::new(code, err.to_string()))) {
                    let _ = fdpass::send_raw(self.stream.as_fd(), &frame, &[], SendFlags::DONTWAIT);
                }
            }
        }
        let _ = rustix::net::shutdown(&self.stream, Shutdown::Both);
    }
}
