//! The conversation: the handshake, then the messages each side may receive.
//!
//! ```text
//! importer                                   exporter
//!    |  connect            ----------------->  |  accept, SO_PEERCRED check
//!    |  SO_PEERCRED check (who answered?)      |
//!    |  Hello              ----------------->  |
//!    |                     <-----------------  |  Welcome { GPU UUID, pool id }
//!    |  find the GPU locally                   |
//!    |  Ready { GPU UUID } ----------------->  |  same GPU?
//!    |                     <-----------------  |  PoolDescriptor { pool id } + pool fd
//!    |                                         |
//!    |                     <-----------------  |  Buffer { ... }   (any number, any time)
//!    |  Release { id }     ----------------->  |
//!    |  Goodbye            ----------------->  |  (or the connection closes)
//! ```
//!
//! Version 2: an importer that asks for capabilities opens with `Hello2 { capabilities }`
//! instead of `Hello`, and the exporter answers `Welcome2 { GPU UUID, pool id, capabilities
//! granted }` (a subset of those asked for); the rest of the handshake is the same. With the fast
//! release capability the importer may also send `ReleaseBatch`; with the VMM capability the
//! exporter may also send `VmmBuffer` (with one descriptor), with the VMM chunks capability
//! `VmmChunks` (with one descriptor per chunk). A version-1 exporter refuses
//! `Hello2` (`UnsupportedVersion`); the importer then connects again with `Hello`.
//!
//! The whole handshake must finish within [`ConnectionOptions::handshake_timeout`], so a peer
//! that connects and says nothing costs the exporter that long at most. Any failure sends the
//! peer an `Error` message (best effort) and closes the connection; an `Error` message from the
//! peer becomes [`Error::Remote`].
//!
//! [`ExporterSession`] and [`ImporterSession`] know nothing of the GPU: the exporter passes the
//! pool's file descriptor (from `MemPool::export_fd`) and the importer a function that finds
//! the announced GPU among its own devices. The [`lease`](crate::lease) tables keep count of
//! the buffers. The tests (`session/tests.rs`) run both sides over real sockets, with a memfd
//! for the pool and a simulated pool behind the lease tables.

#[cfg(test)]
use std::os::fd::BorrowedFd;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Instant;

pub(crate) use self::rings::check_ring_geometry;
use self::rings::ImporterRing;
use crate::connection::{Connection, Received};
use crate::error::{Error, Result};
use crate::protocol::{
    BufferDescriptor, BufferId, DeviceUuid, EventHandle, Message, PoolDescriptor, PoolId, ProtocolError, Ready,
    ReleaseBatch, VmmBufferDescriptor, VmmChunksDescriptor, Welcome, CAP_FAST_RELEASE, CAP_RING, CAP_VMM,
    CAP_VMM_CHUNKS, KNOWN_CAPABILITIES,
};
use crate::trace;
use mempool_socket::cred::{AccessPolicy, PeerCredentials};
use mempool_socket::ConnectionOptions;

/// What an exporter tells each importer in the handshake.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct PoolAnnouncement {
    /// The GPU the pool lives on (`cuDeviceGetUuid`).
    pub(crate) device_uuid: DeviceUuid,
    /// The pool's identity.
    pub(crate) pool_id: PoolId,
}

/// What an exporter's session may receive after the handshake.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum ImporterEvent {
    /// The importer freed its import of this buffer.
    Release(BufferId),
    /// The importer is done with these buffers; their use on its GPU is ordered before the
    /// event (only from an importer granted the fast release capability).
    ReleaseBatch(ReleaseBatch),
    /// The importer is done: it freed every import and closes the connection. Every buffer it
    /// still held counts as released.
    Goodbye,
    /// The importer published releases in its ring while the exporter's waiting flag was set
    /// (only from an importer granted the ring capability): drain the ring.
    RingBell,
}

/// What an importer's session may receive after the handshake.
#[derive(Debug)]
pub(crate) enum ExporterEvent {
    /// A shared buffer.
    Buffer(BufferDescriptor),
    /// A VMM physical allocation and its file descriptor (close-on-exec); only after the
    /// exporter granted [`CAP_VMM`].
    VmmBuffer(VmmBufferDescriptor, OwnedFd),
    /// A range over several VMM physical allocations and their file descriptors, one per chunk in
    /// order (close-on-exec); only after the exporter granted [`CAP_VMM_CHUNKS`].
    VmmChunks(VmmChunksDescriptor, Vec<OwnedFd>),
    /// The exporter is shutting down and shares nothing more; release what you hold.
    Goodbye,
}

/// Where the exporter's side of a handshake stands.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum HandshakeStep {
    /// Nothing received yet: waiting for `Hello`.
    AwaitHello,
    /// `Welcome` sent: waiting for `Ready`.
    AwaitReady,
    /// `PoolDescriptor` answered: the handshake is complete.
    Done,
}

/// The exporter's side of the handshake as a state machine over messages, with no I/O: the
/// exporter's event loop feeds it each message that arrives and sends what it answers (with the
/// pool's descriptor where the answer's type carries one). The tests drive it through
/// [`ExporterSession`], over real sockets.
#[derive(Debug)]
pub(crate) struct ExporterHandshake {
    announcement: PoolAnnouncement,
    step: HandshakeStep,
    /// The capabilities this exporter offers.
    offered: u64,
    /// The capabilities granted (0 for a version-1 `Hello`).
    granted: u64,
}

impl ExporterHandshake {
    /// A handshake that waits for `Hello`.
    #[cfg(test)]
    pub(crate) fn new(announcement: PoolAnnouncement) -> ExporterHandshake {
        ExporterHandshake::offering(announcement, KNOWN_CAPABILITIES)
    }

    /// A handshake that grants at most the capabilities in `offered` to a `Hello2`.
    pub(crate) fn offering(announcement: PoolAnnouncement, offered: u64) -> ExporterHandshake {
        ExporterHandshake {
            announcement,
            step: HandshakeStep::AwaitHello,
            offered: offered & KNOWN_CAPABILITIES,
            granted: 0,
        }
    }

    /// The capabilities granted to the importer (0 until it said `Hello2`, and for `Hello`).
    pub(crate) fn capabilities(&self) -> u64 {
        self.granted
    }

    /// Where it stands.
    pub(crate) fn step(&self) -> HandshakeStep {
        self.step
    }

    /// Takes the importer's next message and returns the answer: `Welcome` to `Hello`,
    /// `PoolDescriptor` (send the pool's descriptor with it) to a `Ready` that names the
    /// announced GPU, after which the handshake is [`HandshakeStep::Done`].
    ///
    /// Errors (the connection ends; tell the peer): [`Error::WrongDevice`];
    /// [`Error::UnexpectedMessage`]; [`Error::Remote`] for the peer's `Error` message.
    pub(crate) fn on_message(&mut self, message: Message) -> Result<Message> {
        let a = self.announcement;
        match (self.step, message) {
            (HandshakeStep::AwaitHello, Message::Hello) => {
                self.step = HandshakeStep::AwaitReady;
                Ok(Message::Welcome(Welcome {
                    device_uuid: a.device_uuid,
                    pool_id: a.pool_id,
                }))
            }
            (HandshakeStep::AwaitHello, Message::Hello2 { capabilities }) => {
                self.step = HandshakeStep::AwaitReady;
                self.granted = capabilities & self.offered;
                if self.granted & CAP_FAST_RELEASE == 0 {
                    // The rings carry the fast release path's frames: not without it.
                    self.granted &= !CAP_RING;
                }
                Ok(Message::Welcome2 {
                    welcome: Welcome {
                        device_uuid: a.device_uuid,
                        pool_id: a.pool_id,
                    },
                    capabilities: self.granted,
                })
            }
            (HandshakeStep::AwaitReady, Message::Ready(Ready { device_uuid })) if device_uuid == a.device_uuid => {
                self.step = HandshakeStep::Done;
                Ok(Message::PoolDescriptor(PoolDescriptor { pool_id: a.pool_id }))
            }
            (HandshakeStep::AwaitReady, Message::Ready(Ready { device_uuid })) => Err(Error::WrongDevice {
                expected_uuid: a.device_uuid,
                got: device_uuid,
            }),
            (HandshakeStep::AwaitHello, other) => Err(unexpected("Hello", &other)),
            (HandshakeStep::AwaitReady, other) => Err(unexpected("Ready", &other)),
            (HandshakeStep::Done, _) => Err(ProtocolError::Violation {
                reason: "the handshake is over".into(),
            }
            .into()),
        }
    }
}

/// What a message from an importer granted `capabilities` means after the handshake:
/// `Release`, `ReleaseBatch` (with the fast release capability), `Goodbye`, or an error that
/// ends the connection ([`Error::UnexpectedMessage`]; [`Error::Remote`] for the peer's `Error`
/// message).
pub(crate) fn importer_event(message: Message, capabilities: u64) -> Result<ImporterEvent> {
    match message {
        Message::Release { buffer_id } => Ok(ImporterEvent::Release(buffer_id)),
        Message::ReleaseBatch(batch) if capabilities & crate::protocol::CAP_FAST_RELEASE != 0 => {
            Ok(ImporterEvent::ReleaseBatch(batch))
        }
        Message::Goodbye => Ok(ImporterEvent::Goodbye),
        Message::RingBell if capabilities & crate::protocol::CAP_RING != 0 => Ok(ImporterEvent::RingBell),
        other => Err(unexpected("Release or Goodbye", &other)),
    }
}

/// The exporter's side of one importer connection, over a blocking [`Connection`]: the peer the
/// tests run the importer's side against. The exporter itself serves its importers from an event
/// loop (`server`) over the same [`ExporterHandshake`] and [`importer_event`].
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct ExporterSession {
    conn: Connection,
    /// What the handshake announced (the tests check it).
    announcement: PoolAnnouncement,
    /// The capabilities granted.
    capabilities: u64,
}

#[cfg(test)]
impl ExporterSession {
    /// Runs the exporter's side of the handshake on an accepted (and credential-checked)
    /// connection: waits for `Hello`, announces the GPU and the pool, checks that the importer
    /// uses the same GPU, and sends the pool's file descriptor (the caller keeps its own).
    ///
    /// Errors: [`Error::Timeout`] after [`ConnectionOptions::handshake_timeout`];
    /// [`Error::WrongDevice`]; [`Error::UnexpectedMessage`]; [`Error::Remote`]; any error of
    /// [`Connection`]. The connection is closed on error.
    pub(crate) fn handshake(
        conn: Connection,
        announcement: PoolAnnouncement,
        pool_fd: BorrowedFd<'_>,
    ) -> Result<ExporterSession> {
        let deadline = Instant::now() + conn.options().handshake_timeout;
        // The rings are the event loop's (`server`): this blocking peer does not offer them.
        let mut machine = ExporterHandshake::offering(announcement, KNOWN_CAPABILITIES & !CAP_RING);
        let mut steps = || -> Result<()> {
            while machine.step() != HandshakeStep::Done {
                let received = recv_in_handshake(&conn, deadline)?;
                let answer = machine.on_message(received.message)?;
                let fds: &[BorrowedFd<'_>] = if answer.descriptor_count() == 1 {
                    &[pool_fd]
                } else {
                    &[]
                };
                conn.send_until(&answer, fds, deadline, "handshake")?;
            }
            Ok(())
        };
        match steps() {
            Ok(()) => Ok(ExporterSession {
                conn,
                announcement,
                capabilities: machine.capabilities(),
            }),
            Err(err) => {
                conn.close_with_error(&err);
                Err(err)
            }
        }
    }

    /// What the handshake announced.
    pub(crate) fn announcement(&self) -> &PoolAnnouncement {
        &self.announcement
    }

    /// Shares a buffer with the importer.
    pub(crate) fn share(&self, buffer: &BufferDescriptor) -> Result<()> {
        self.conn.send(&Message::Buffer(*buffer), &[])
    }

    /// Waits for the importer's next message. On [`ImporterEvent::Goodbye`] and on any error
    /// (including [`Error::Closed`]), the connection is over.
    pub(crate) fn recv(&self) -> Result<ImporterEvent> {
        let received = self.conn.recv()?;
        match importer_event(received.message, self.capabilities) {
            Ok(ImporterEvent::Goodbye) => {
                self.conn.shutdown();
                Ok(ImporterEvent::Goodbye)
            }
            Ok(event) => Ok(event),
            Err(e) => Err(self.reject(e)),
        }
    }

    /// Tells the importer the exporter shares nothing more and closes the sending direction.
    pub(crate) fn goodbye(&self) -> Result<()> {
        let result = self.conn.send(&Message::Goodbye, &[]);
        self.conn.close_write();
        result
    }

    /// Tells the importer about `err` and closes the connection; returns `err`.
    pub(crate) fn reject(&self, err: Error) -> Error {
        self.conn.close_with_error(&err);
        err
    }
}

/// What an importer receives from a successful handshake.
#[derive(Debug)]
pub(crate) struct ImportedPool<D> {
    /// What the device check returned: the local device that has the exporter's GPU.
    pub(crate) device: D,
    /// The pool's file descriptor (close-on-exec), for `MemPool::import_fd`.
    pub(crate) pool_fd: OwnedFd,
}

/// The importer's side of a connection to an exporter.
#[derive(Debug)]
pub(crate) struct ImporterSession {
    conn: Connection,
    welcome: Welcome,
    /// The capabilities the exporter granted (0 after a version-1 handshake).
    capabilities: u64,
    /// The shared-memory rings, when [`CAP_RING`] was granted.
    ring: Option<ImporterRing>,
}

impl ImporterSession {
    /// Connects to the exporter at `path`, checks that the process that answers runs as a
    /// user `policy` allows, and runs the handshake (see [`ImporterSession::handshake`]).
    ///
    /// With `capabilities` other than 0 it opens with `Hello2` (version 2); a version-1 exporter
    /// refuses that with `UnsupportedVersion`, and this connects again with `Hello` (no
    /// capabilities).
    pub(crate) fn connect<D>(
        path: impl AsRef<Path>,
        options: ConnectionOptions,
        policy: &AccessPolicy,
        capabilities: u64,
        mut find_device: impl FnMut(&DeviceUuid) -> Result<D>,
    ) -> Result<(ImporterSession, ImportedPool<D>)> {
        let path = path.as_ref();
        let attempt = |capabilities: u64, find_device: &mut dyn FnMut(&DeviceUuid) -> Result<D>| {
            let conn = Connection::connect(path, options)?;
            if let Err(err) = policy.check_socket(&conn) {
                let err = Error::from(err);
                conn.close_with_error(&err);
                return Err(err);
            }
            ImporterSession::handshake_with(conn, capabilities, find_device)
        };
        match attempt(capabilities, &mut find_device) {
            Err(Error::Remote {
                code: crate::protocol::ErrorCode::UnsupportedVersion,
                ..
            }) if capabilities != 0 => attempt(0, &mut find_device),
            other => other,
        }
    }

    /// Runs the importer's side of the handshake: says `Hello`, hears which GPU and pool the
    /// exporter has, calls `find_device` to find that GPU here (return
    /// [`Error::DeviceNotVisible`] or [`Error::WrongDevice`] if it is not there: the exporter
    /// is told), confirms, and receives the pool's file descriptor.
    ///
    /// The connection is closed on error.
    #[cfg(test)]
    pub(crate) fn handshake<D>(
        conn: Connection,
        mut find_device: impl FnMut(&DeviceUuid) -> Result<D>,
    ) -> Result<(ImporterSession, ImportedPool<D>)> {
        ImporterSession::handshake_with(conn, 0, &mut find_device)
    }

    /// [`ImporterSession::handshake`], asking for `capabilities` (0: the version-1 `Hello`).
    pub(crate) fn handshake_with<D>(
        conn: Connection,
        capabilities: u64,
        find_device: &mut dyn FnMut(&DeviceUuid) -> Result<D>,
    ) -> Result<(ImporterSession, ImportedPool<D>)> {
        let deadline = Instant::now() + conn.options().handshake_timeout;
        let mut steps = || -> Result<(Welcome, u64, ImportedPool<D>, Option<ImporterRing>)> {
            let hello = if capabilities == 0 {
                Message::Hello
            } else {
                Message::Hello2 { capabilities }
            };
            conn.send_until(&hello, &[], deadline, "handshake")
                .map_err(|e| why_closed(&conn, e, deadline))?;
            let (welcome, granted) = match recv_in_handshake(&conn, deadline)?.message {
                Message::Welcome(welcome) if capabilities == 0 => (welcome, 0),
                Message::Welcome2 {
                    welcome,
                    capabilities: granted,
                } if capabilities != 0 => {
                    if granted & !capabilities != 0 {
                        return Err(ProtocolError::Violation {
                            reason: format!(
                                "the exporter granted capabilities {granted:#x}, more than the {capabilities:#x} asked for"
                            ),
                        }
                        .into());
                    }
                    (welcome, granted)
                }
                other if capabilities == 0 => return Err(unexpected("Welcome", &other)),
                other => return Err(unexpected("Welcome2", &other)),
            };
            let device = find_device(&welcome.device_uuid)?;
            conn.send_until(
                &Message::Ready(Ready {
                    device_uuid: welcome.device_uuid,
                }),
                &[],
                deadline,
                "handshake",
            )
            .map_err(|e| why_closed(&conn, e, deadline))?;
            let Received { message, mut fds } = recv_in_handshake(&conn, deadline)?;
            match message {
                Message::PoolDescriptor(PoolDescriptor { pool_id }) if pool_id == welcome.pool_id => {}
                Message::PoolDescriptor(PoolDescriptor { pool_id }) => {
                    return Err(ProtocolError::Violation {
                        reason: format!(
                            "the pool descriptor names pool {pool_id}, the welcome named {}",
                            welcome.pool_id
                        ),
                    }
                    .into())
                }
                other => return Err(unexpected("PoolDescriptor", &other)),
            }
            // The connection checked that exactly one descriptor came with the message.
            let pool_fd = fds.pop().ok_or(Error::DescriptorCount { expected: 1, got: 0 })?;
            if granted & CAP_RING != 0 && granted & CAP_FAST_RELEASE == 0 {
                return Err(ProtocolError::Violation {
                    reason: format!("the exporter granted the rings without the fast release path ({granted:#x})"),
                }
                .into());
            }
            let ring = if granted & CAP_RING != 0 {
                let Received { message, mut fds } = recv_in_handshake(&conn, deadline)?;
                match message {
                    Message::RingSetup => {}
                    other => return Err(unexpected("RingSetup", &other)),
                }
                let fd = fds.pop().ok_or(Error::DescriptorCount { expected: 1, got: 0 })?;
                Some(ImporterRing::open(fd)?)
            } else {
                None
            };
            Ok((welcome, granted, ImportedPool { device, pool_fd }, ring))
        };
        match steps() {
            Ok((welcome, capabilities, imported, ring)) => Ok((
                ImporterSession {
                    conn,
                    welcome,
                    capabilities,
                    ring,
                },
                imported,
            )),
            Err(err) => {
                conn.close_with_error(&err);
                Err(err)
            }
        }
    }

    /// The connection, for its credentials, its descriptor (to poll it) or to close it.
    #[cfg(test)]
    pub(crate) fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The exporter's GPU.
    pub(crate) fn device_uuid(&self) -> DeviceUuid {
        self.welcome.device_uuid
    }

    /// The connection's I/O time limit.
    pub(crate) fn io_timeout(&self) -> std::time::Duration {
        self.conn.options().io_timeout
    }

    /// The capabilities the exporter granted (0 after a version-1 handshake).
    pub(crate) fn capabilities(&self) -> u64 {
        self.capabilities
    }

    /// The rings' region (for tests that write it as a hostile peer would).
    #[cfg(test)]
    pub(crate) fn ring_region(&self) -> Option<std::sync::Arc<crate::ring::Region>> {
        self.ring.as_ref().map(|r| r.region())
    }

    /// Whether the connection uses the shared-memory rings (protocol version 3).
    pub(crate) fn rings(&self) -> bool {
        self.ring.is_some()
    }

    /// Whether a buffer waits in the ring, or a frame (or the end of the connection) on the
    /// socket, without waiting.
    pub(crate) fn readable(&self) -> bool {
        if let Some(ring) = &self.ring {
            if ring.ready().unwrap_or(true) || lock_stash(ring).is_some() {
                return true;
            }
        }
        self.socket_readable()
    }

    fn socket_readable(&self) -> bool {
        trace::count(trace::Counter::SocketPoll);
        let mut fds = [rustix::event::PollFd::from_borrowed_fd(
            std::os::fd::AsFd::as_fd(&self.conn),
            rustix::event::PollFlags::IN,
        )];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }

    /// Tells the exporter this importer is done with `buffers`: every use of them on the GPU is
    /// ordered before `event` (the importer's interprocess event, recorded after that use), or
    /// complete when `event` is `None`. Only with the fast release capability.
    pub(crate) fn release_batch(&self, event: Option<EventHandle>, buffers: Vec<BufferId>) -> Result<()> {
        let Some(ring) = &self.ring else {
            return self
                .conn
                .send(&Message::ReleaseBatch(ReleaseBatch { event, buffers }), &[]);
        };
        for chunk in buffers.chunks(ring.batch_max()) {
            let message = Message::ReleaseBatch(ReleaseBatch {
                event,
                buffers: chunk.to_vec(),
            });
            self.ring_send(ring, &message)?;
        }
        let rang = self.ring_publish(ring)?;
        if trace::is_enabled() {
            for id in &buffers {
                trace::mark(trace::Point::ImporterReleasePushed, id.0);
                if rang {
                    trace::mark(trace::Point::ImporterBellSent, id.0);
                }
            }
        }
        Ok(())
    }

    /// Writes a release into the ring, or sends it on the socket when the ring is full (after
    /// publishing what the ring holds).
    fn ring_send(&self, ring: &ImporterRing, message: &Message) -> Result<()> {
        if ring.push(message)? {
            return Ok(());
        }
        self.ring_publish(ring)?;
        self.conn.send(message, &[])
    }

    /// Publishes the releases written into the ring, and rings the exporter's doorbell (a
    /// `RingBell` frame) if it sleeps; returns whether it rang.
    fn ring_publish(&self, ring: &ImporterRing) -> Result<bool> {
        if ring.publish() {
            trace::count(trace::Counter::BellSent);
            self.conn.send(&Message::RingBell, &[])?;
            return Ok(true);
        }
        Ok(false)
    }

    /// The exporter's pool.
    pub(crate) fn pool_id(&self) -> PoolId {
        self.welcome.pool_id
    }

    /// The exporter's credentials (`SO_PEERCRED`).
    pub(crate) fn exporter_credentials(&self) -> Result<PeerCredentials> {
        self.conn.peer_credentials()
    }

    /// Waits for the exporter's next message. On [`ExporterEvent::Goodbye`] the exporter shares
    /// nothing more, but it still takes releases: release what you hold, then say
    /// [`ImporterSession::goodbye`].
    #[cfg(test)]
    pub(crate) fn recv(&self) -> Result<ExporterEvent> {
        self.recv_until(None)
    }

    /// Like [`ImporterSession::recv`], but fails with [`Error::Timeout`] if no message has
    /// begun to arrive by `deadline` (`None`: wait as long as it takes). A timeout before the
    /// first byte leaves the connection usable.
    pub(crate) fn recv_until(&self, deadline: Option<Instant>) -> Result<ExporterEvent> {
        let Some(ring) = &self.ring else {
            let received = self.conn.recv_until(deadline, "receive")?;
            return self.exporter_event(received);
        };
        // When the wait for this buffer began, when it slept on the doorbell and woke (for `trace`).
        let mut waited: Option<u64> = None;
        let mut slept: Option<(u64, u64)> = None;
        loop {
            // Buffers in the ring were published before any frame read from the socket after
            // this look: they come first.
            match ring.pop() {
                Ok(Some(buffer)) => {
                    if let Some(at) = waited {
                        trace::mark_at(trace::Point::ImporterRingWaitBegins, buffer.buffer_id.0, at);
                    }
                    if let Some((asleep, woke)) = slept {
                        trace::mark_at(trace::Point::ImporterRingSleeps, buffer.buffer_id.0, asleep);
                        trace::mark_at(trace::Point::ImporterRingWoke, buffer.buffer_id.0, woke);
                    }
                    return Ok(ExporterEvent::Buffer(buffer));
                }
                Ok(None) => {}
                Err(e) => return Err(self.reject(e)),
            }
            if let Some(received) = lock_stash(ring).take() {
                return self.exporter_event(received);
            }
            let now = Instant::now();
            let wait = match deadline {
                Some(d) if d <= now => {
                    // Out of time: the socket once more (`recv_many` asks with a deadline of now
                    // when `readable` saw a frame there), then the timeout.
                    if self.socket_readable() {
                        if let Some(event) = self.recv_socket(ring, deadline)? {
                            return Ok(event);
                        }
                        continue;
                    }
                    return Err(Error::Timeout { during: "receive" });
                }
                Some(d) => (d - now).min(rings::SOCKET_CHECK),
                None => rings::SOCKET_CHECK,
            };
            // The ring first, with no system call: a buffer that arrives within the spin costs no
            // doorbell and no wake-up; a frame on the socket waits for the spin at most.
            if waited.is_none() {
                waited = Some(trace::stamp());
            }
            if ring.spin(rings::SPIN.min(wait)) {
                continue;
            }
            // One look at the socket, after the waiting flag is set (the exporter rings after
            // socket frames too, but only once it sees the flag): a frame there is read, else sleep.
            let asleep = trace::stamp();
            let socket = ring
                .sleep(wait, || self.socket_readable())
                .map_err(|e| self.reject(e))?;
            if socket {
                if let Some(event) = self.recv_socket(ring, deadline)? {
                    return Ok(event);
                }
                continue;
            }
            slept = Some((asleep, trace::stamp()));
        }
    }

    /// Reads the frame waiting on the socket. If buffers arrived in the ring meanwhile (sent
    /// before it), keeps the frame for after them and returns `None`.
    fn recv_socket(&self, ring: &ImporterRing, deadline: Option<Instant>) -> Result<Option<ExporterEvent>> {
        let received = self.conn.recv_until(deadline, "receive")?;
        if ring.ready().map_err(|e| self.reject(e))? {
            *lock_stash(ring) = Some(received);
            return Ok(None);
        }
        self.exporter_event(received).map(Some)
    }

    fn exporter_event(&self, received: Received) -> Result<ExporterEvent> {
        let Received { message, mut fds } = received;
        match message {
            Message::Buffer(buffer) => Ok(ExporterEvent::Buffer(buffer)),
            Message::Goodbye => Ok(ExporterEvent::Goodbye),
            Message::VmmBuffer(buffer) if self.capabilities & CAP_VMM != 0 => {
                // The connection checked that exactly one descriptor came with the message.
                let fd = fds.pop().ok_or(Error::DescriptorCount { expected: 1, got: 0 })?;
                Ok(ExporterEvent::VmmBuffer(buffer, fd))
            }
            // The connection checked that exactly `count` descriptors came with it, in order.
            Message::VmmChunks(chunks) if self.capabilities & CAP_VMM_CHUNKS != 0 => {
                Ok(ExporterEvent::VmmChunks(chunks, fds))
            }
            other => Err(self.reject(unexpected("Buffer or Goodbye", &other))),
        }
    }

    /// Tells the exporter this importer is done with `buffer`. Free the import first (and let
    /// the work that used it finish): the exporter may free the memory as soon as this arrives.
    pub(crate) fn release(&self, buffer: BufferId) -> Result<()> {
        let message = Message::Release { buffer_id: buffer };
        match &self.ring {
            Some(ring) => {
                self.ring_send(ring, &message)?;
                self.ring_publish(ring).map(|_| ())
            }
            None => self.conn.send(&message, &[]),
        }
    }

    /// Says `Goodbye` (every import is freed), then waits (until `deadline`) for the exporter to
    /// close the connection, which it does once it has read everything sent before, and closes
    /// it. Whatever arrives meanwhile is dropped. The fast release path uses this, so that its
    /// release event outlives the exporter's use of it.
    pub(crate) fn goodbye_and_wait(&self, deadline: Instant) -> Result<()> {
        let result = self.conn.send(&Message::Goodbye, &[]);
        self.conn.close_write();
        if result.is_ok() {
            while self.conn.recv_until(Some(deadline), "goodbye").is_ok() {}
        }
        self.conn.shutdown();
        result
    }

    /// Says `Goodbye` (every import is freed) and closes the connection.
    pub(crate) fn goodbye(&self) -> Result<()> {
        let result = self.conn.send(&Message::Goodbye, &[]);
        self.conn.shutdown();
        result
    }

    /// Tells the exporter about `err` and closes the connection; returns `err`.
    pub(crate) fn reject(&self, err: Error) -> Error {
        self.conn.close_with_error(&err);
        err
    }
}

fn lock_stash(ring: &ImporterRing) -> std::sync::MutexGuard<'_, Option<Received>> {
    ring.stash.lock().unwrap_or_else(|p| p.into_inner())
}

/// A send failed because the peer closed its side (an exporter that turned this importer away
/// does that right after its `Error` message): what it said before is the better error.
fn why_closed(conn: &Connection, err: Error, deadline: Instant) -> Error {
    if matches!(err, Error::Closed) {
        if let Err(remote @ Error::Remote { .. }) = recv_in_handshake(conn, deadline) {
            return remote;
        }
    }
    err
}

fn recv_in_handshake(conn: &Connection, deadline: Instant) -> Result<Received> {
    let received = conn.recv_until(Some(deadline), "handshake")?;
    if let Message::Error(e) = received.message {
        conn.shutdown();
        return Err(Error::Remote {
            code: e.code,
            text: e.text,
        });
    }
    Ok(received)
}

/// The error for a message that is not allowed here; a peer's `Error` message becomes
/// [`Error::Remote`] instead.
fn unexpected(expected: &'static str, got: &Message) -> Error {
    match got {
        Message::Error(e) => Error::Remote {
            code: e.code,
            text: e.text.clone(),
        },
        other => Error::UnexpectedMessage {
            expected,
            got: other.message_type(),
        },
    }
}

mod rings;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod vmm_tests;
