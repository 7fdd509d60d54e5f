//! The exporter's one serving thread: an `epoll` loop over the listening socket, every
//! connection (handshaking or connected), a wake-up `eventfd` that [`Shared::wake`] writes when
//! frames are queued or the exporter shuts down, and the `pidfd`s of importers whose end the
//! exporter waits for. Nothing in it blocks: sockets are non-blocking, and every time limit is a
//! deadline the loop's wait is bounded by.
//!
//! What it tells the exporter goes through [`Handler`], called on this thread with none of the
//! loop's locks held.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::buffer::spare_capacity;
use rustix::event::{epoll, EventfdFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{SendFlags, Shutdown};

use super::admission::{Admission, Backoff, Limits, Pending};
use super::exits::{Liveness, ProcessKey, ProcessRef, Watch};
use super::outbox::{Outboxes, Outgoing};
use super::peer::{Flushed, Peer, Read};
use super::ring_peer::RingPeer;
use crate::error::{record_drop_error, Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{self, BufferId, ErrorCode, ErrorMessage, Message, ReleaseBatch};
use crate::session::{importer_event, ExporterHandshake, ImporterEvent, PoolAnnouncement};
use mempool_socket::cred::{self, PeerCredentials};
use mempool_socket::fdpass;
use mempool_socket::listener::Listener;

/// What the event loop tells the exporter, on the loop's thread.
pub(crate) trait Handler: Send + Sync {
    /// The handshake of `id` completed, granting it `capabilities` (`protocol::CAP_*`): it may be
    /// sent buffers from now on.
    fn connected(&self, id: ImporterId, credentials: PeerCredentials, capabilities: u64);

    /// `id` released `buffer`. An error ends the connection (the importer is told, and the end is
    /// unclean).
    fn released(&self, id: ImporterId, buffer: BufferId) -> Result<()>;

    /// `id` released every buffer of `batch`, all at once (an importer granted the fast release
    /// capability). An error ends the connection as for [`Handler::released`].
    fn released_batch(&self, id: ImporterId, batch: ReleaseBatch) -> Result<()>;

    /// The connection of `id` ended: `clean` after its `Goodbye`. `undelivered` lists buffers
    /// whose frames never went out (the importer never saw them). Returns whether the importer
    /// may still use buffers it held: then the loop watches its process and calls
    /// [`Handler::exited`] once it is gone (or [`Handler::abandoned`] at shutdown).
    fn ended(&self, id: ImporterId, clean: bool, undelivered: Vec<BufferId>) -> bool;

    /// The process of `id`, whose end [`Handler::ended`] asked to wait for, is gone.
    fn exited(&self, id: ImporterId);

    /// The loop stops while the process of `id` (or its connection) is still there.
    fn abandoned(&self, id: ImporterId);
}

/// Counters of the loop, published after each round.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct ReactorStats {
    pub(crate) handshakes: usize,
    pub(crate) importers: usize,
    pub(crate) awaiting_exit: usize,
    pub(crate) watched_processes: usize,
    pub(crate) queued: usize,
    pub(crate) refused: u64,
    pub(crate) evicted: u64,
    pub(crate) stalled: u64,
    pub(crate) timed_out: u64,
    pub(crate) accept_pauses: u64,
    pub(crate) peer_errors: u64,
}

/// Where the shutdown stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct Control {
    /// Stop accepting, say `Goodbye` to everyone, keep taking releases.
    pub(crate) closing: bool,
    /// Close everything and stop.
    pub(crate) finish: bool,
}

/// What the loop shares with the threads that send through it.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) outboxes: Mutex<Outboxes>,
    pub(crate) control: Mutex<Control>,
    pub(crate) stats: Mutex<ReactorStats>,
    /// How long the loop looks at the rings (no system call, waiting flags clear) before it sleeps,
    /// after a round that found ring entries, in nanoseconds; 0: it never spins. On a line of its
    /// own: the spinning loop reads it every [`SPIN_EPOLL_EVERY`], and the locks beside it are
    /// taken by every thread that shares.
    pub(crate) ring_spin_ns: SpinSetting,
    wake: OwnedFd,
}

impl Shared {
    pub(crate) fn new(send_queue_len: usize) -> Result<Shared> {
        Ok(Shared {
            outboxes: Mutex::new(Outboxes::new(send_queue_len)),
            control: Mutex::new(Control::default()),
            stats: Mutex::new(ReactorStats::default()),
            ring_spin_ns: SpinSetting(AtomicU64::new(DEFAULT_RING_SPIN.as_nanos() as u64)),
            wake: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    /// Wakes the loop (queued frames, a shutdown step).
    pub(crate) fn wake(&self) {
        // A full counter (2^64 - 2 wake-ups unread) is still a pending wake-up.
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

/// A spin setting in nanoseconds, on a 128-byte line of its own (two 64-byte lines, as the
/// adjacent-line prefetcher pairs them).
#[repr(align(128))]
#[derive(Debug)]
pub(crate) struct SpinSetting(pub(crate) AtomicU64);

impl SpinSetting {
    fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

/// Locks `mutex`, whether or not a thread panicked while holding it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

const LISTENER: u64 = 0;
const WAKE: u64 = 1;
/// How often an importer's process is looked for when no pidfd tells.
const POLL_EXIT: Duration = Duration::from_millis(100);
/// How long a connection must have said nothing before it is shed for lack of descriptors.
const SHED_AFTER: Duration = Duration::from_millis(100);
/// Connections accepted per round at most, so a flood cannot keep the loop from the others.
const ACCEPTS_PER_ROUND: usize = 256;
/// How long the loop spins over the rings after ring traffic, by default (see [`Shared::ring_spin_ns`]).
pub(crate) const DEFAULT_RING_SPIN: Duration = Duration::from_micros(50);
/// How often a spinning loop asks `epoll` (without waiting) whether a socket, the wake-up or a
/// process needs it: the spin delays those by about this much at most.
const SPIN_EPOLL_EVERY: Duration = Duration::from_micros(5);
/// How long one spin handles ring traffic at most before the loop goes round (its timers, its
/// counters), while releases keep coming.
const SPIN_ROUND_EVERY: Duration = Duration::from_millis(1);

/// How the round that drains the rings began (for `trace`): after a sleep in `epoll` (its waiting
/// flags set), or after a spin that found ring entries; the time in [`trace::now_ns`](crate::trace::now_ns).
#[derive(Clone, Copy, Debug)]
enum RoundStart {
    Busy,
    Woke(u64),
    Spun(u64),
}

/// What the loop needs to start.
pub(crate) struct Setup {
    pub(crate) shared: Arc<Shared>,
    pub(crate) listener: Listener,
    pub(crate) announcement: PoolAnnouncement,
    pub(crate) pool_fd: OwnedFd,
    pub(crate) limits: Limits,
    pub(crate) handler: Arc<dyn Handler>,
}

struct Loop {
    shared: Arc<Shared>,
    handler: Arc<dyn Handler>,
    limits: Limits,
    announcement: PoolAnnouncement,
    pool_fd: OwnedFd,
    epoll: OwnedFd,
    listener: Option<Listener>,
    listening: bool,
    backoff: Backoff,
    peers: HashMap<u64, Peer>,
    tokens: HashMap<ImporterId, u64>,
    /// Processes awaited through a pidfd, by the pidfd's epoll token: one watch per process,
    /// however many of its connections ended uncleanly, with the importers that wait on it.
    exits: HashMap<u64, ExitWatch>,
    /// The token of `exits` that watches each process (by pid and start time).
    exit_tokens: HashMap<ProcessKey, u64>,
    /// Processes polled for their end (no pidfd), one entry per process, with their importers.
    polled: Vec<(Vec<ImporterId>, ProcessRef)>,
    next_poll: Option<Instant>,
    next_token: u64,
    next_id: u64,
    closing: bool,
    stats: ReactorStats,
    /// When ring entries were last drained.
    ring_traffic: Option<Instant>,
    round_start: RoundStart,
}

/// The loop, set up (the epoll set made, the listener and the wake-up registered) in the
/// caller's thread, so that a failure there is the caller's error; [`Loop::run`] then serves on
/// the thread it is moved to.
pub(crate) struct Ready(Loop);

impl Ready {
    /// Sets the loop up.
    pub(crate) fn new(setup: Setup) -> Result<Ready> {
        setup.listener.set_nonblocking()?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(
            &ep,
            &setup.listener,
            epoll::EventData::new_u64(LISTENER),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &ep,
            &setup.shared.wake,
            epoll::EventData::new_u64(WAKE),
            epoll::EventFlags::IN,
        )?;
        Ok(Ready(Loop {
            shared: setup.shared,
            handler: setup.handler,
            limits: setup.limits,
            announcement: setup.announcement,
            pool_fd: setup.pool_fd,
            epoll: ep,
            listener: Some(setup.listener),
            listening: true,
            backoff: Backoff::default(),
            peers: HashMap::new(),
            tokens: HashMap::new(),
            exits: HashMap::new(),
            exit_tokens: HashMap::new(),
            polled: Vec::new(),
            next_poll: None,
            next_token: 2,
            next_id: 0,
            closing: false,
            stats: ReactorStats::default(),
            ring_traffic: None,
            round_start: RoundStart::Busy,
        }))
    }

    /// Runs the loop until [`Control::finish`]; then every connection is closed, the importers
    /// still there and the processes still awaited are reported [`Handler::abandoned`], and every
    /// descriptor of the loop is closed.
    pub(crate) fn run(self) {
        let mut l = self.0;
        l.serve();
        l.finish();
    }
}

impl Loop {
    fn serve(&mut self) {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
        // Whether a ring had entries when the loop last set its waiting flags: then it must not sleep.
        let mut rings_busy = false;
        loop {
            let now = Instant::now();
            let timeout = if rings_busy {
                Some(Timespec { tv_sec: 0, tv_nsec: 0 })
            } else {
                self.next_deadline(now).map(|d| {
                    let left = d.saturating_duration_since(now) + Duration::from_micros(100);
                    Timespec::try_from(left).unwrap_or(Timespec { tv_sec: 1, tv_nsec: 0 })
                })
            };
            events.clear();
            let waited = epoll::wait(&self.epoll, spare_capacity(&mut events), timeout.as_ref());
            if !rings_busy {
                crate::trace::count(crate::trace::Counter::LoopSleep);
                self.round_start = RoundStart::Woke(crate::trace::stamp());
            }
            // Awake: every flag clear, also those set before a ring further on kept the loop from
            // sleeping (left set, they would make those importers ring for nothing).
            for peer in self.peers.values() {
                if let Some(ring) = &peer.ring {
                    ring.sleep_end();
                }
            }
            match waited {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    // Nothing sensible is left to do but wait a little and try again.
                    record_drop_error(e.into());
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let now = Instant::now();
            for event in &events {
                let flags = event.flags;
                match event.data.u64() {
                    LISTENER => self.accept_all(now),
                    WAKE => {
                        let mut buf = [0u8; 8];
                        let _ = rustix::io::read(&self.shared.wake, &mut buf);
                    }
                    token if self.exits.contains_key(&token) => {
                        if let Some(watch) = self.exits.remove(&token) {
                            let _ = epoll::delete(&self.epoll, &watch.pidfd);
                            if let Some(key) = watch.key {
                                self.exit_tokens.remove(&key);
                            }
                            for id in watch.importers {
                                self.handler.exited(id);
                            }
                        }
                    }
                    token => self.on_peer(token, flags, now),
                }
            }
            self.mailbox(now);
            let control = *lock(&self.shared.control);
            if control.closing && !self.closing {
                self.start_closing(now);
            }
            self.timers(Instant::now());
            // The rings to the exporter are drained last, right before the waiting flags are set,
            // and before the counters are published (a peer cut off here is counted this round).
            rings_busy = self.rings(Instant::now());
            self.publish();
            if control.finish {
                return;
            }
        }
    }

    // ---- accepting ----

    fn accept_all(&mut self, now: Instant) {
        for _ in 0..ACCEPTS_PER_ROUND {
            let Some(listener) = &self.listener else { return };
            match listener.accept_stream() {
                Ok(stream) => {
                    self.backoff.succeeded();
                    self.admit(stream, now);
                }
                Err(e) => match Errno::from_io_error(&e) {
                    Some(Errno::AGAIN) => return,
                    Some(Errno::INTR) | Some(Errno::CONNABORTED) => continue,
                    errno => {
                        // Out of descriptors: first shed a handshake that has said nothing (its
                        // descriptor goes back).
                        let exhausted =
                            matches!(errno, Some(Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM));
                        if exhausted {
                            if let Some(token) = self.silent_to_shed(now) {
                                self.end_handshake(token, Some(refused("it ran out of file descriptors")));
                                self.stats.evicted += 1;
                                continue;
                            }
                        }
                        // Then, or for any other failure, stop watching the listener for a while
                        // instead of spinning on it (it stays readable while connections wait).
                        let first = !self.backoff.in_streak();
                        self.backoff.exhausted(now);
                        self.stats.accept_pauses += 1;
                        self.unlisten();
                        if first {
                            record_drop_error(Error::Io(e));
                        }
                        return;
                    }
                },
            }
        }
    }

    fn admit(&mut self, stream: UnixStream, now: Instant) {
        let credentials = match cred::peer_credentials(&stream) {
            Ok(c) => c,
            Err(e) => {
                self.stats.refused += 1;
                return tell_and_close(&stream, &e.into(), None);
            }
        };
        let allowed = self.listener.as_ref().map(|l| l.policy().check(&credentials));
        match allowed {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                self.stats.refused += 1;
                return tell_and_close(&stream, &e.into(), None);
            }
            None => return,
        }
        let pending = self.pending();
        match self.limits.admit(self.tokens.len(), &pending) {
            Admission::Admit => {}
            Admission::Evict(victim) => {
                self.end_handshake(
                    victim,
                    Some(refused(
                        "too many handshakes were in flight and this one had made the least progress",
                    )),
                );
                self.stats.evicted += 1;
            }
            Admission::Refuse => {
                self.stats.refused += 1;
                let e = refused(&format!(
                    "it serves its limit of {} importers",
                    self.limits.max_importers
                ));
                return tell_and_close(&stream, &e, None);
            }
        }
        let id = ImporterId(self.next_id);
        self.next_id += 1;
        let token = self.next_token;
        self.next_token += 1;
        let offered = match self.limits.ring {
            Some(_) => protocol::KNOWN_CAPABILITIES,
            None => protocol::KNOWN_CAPABILITIES & !protocol::CAP_RING,
        };
        let handshake = ExporterHandshake::offering(self.announcement, offered);
        let peer = match Peer::new(id, stream, credentials, handshake, now) {
            Ok(peer) => peer,
            Err(e) => return record_drop_error(e.into()),
        };
        if let Err(e) = epoll::add(
            &self.epoll,
            &peer.stream,
            epoll::EventData::new_u64(token),
            epoll::EventFlags::IN,
        ) {
            return record_drop_error(e.into());
        }
        self.peers.insert(token, peer);
    }

    fn pending(&mut self) -> Vec<Pending<u64>> {
        self.peers
            .iter_mut()
            .filter_map(|(token, p)| {
                let step = p.handshake.as_ref()?.step();
                Some(Pending {
                    key: *token,
                    step,
                    heard: p.spoke(),
                    accepted: p.accepted,
                })
            })
            .collect()
    }

    /// The handshake to shed when descriptors run out: one that has said nothing for
    /// [`SHED_AFTER`] (the oldest). A connection that spoke, or that is too fresh to have had the
    /// time, is not shed for a newcomer nobody knows: accepting pauses instead.
    fn silent_to_shed(&mut self, now: Instant) -> Option<u64> {
        let silent: Vec<_> = self
            .pending()
            .into_iter()
            .filter(|p| !p.heard && now.saturating_duration_since(p.accepted) >= SHED_AFTER)
            .collect();
        super::admission::least_progressed(&silent)
    }

    fn unlisten(&mut self) {
        if let (true, Some(listener)) = (self.listening, &self.listener) {
            let _ = epoll::delete(&self.epoll, listener);
            self.listening = false;
        }
    }

    // ---- connections ----

    fn on_peer(&mut self, token: u64, flags: epoll::EventFlags, now: Instant) {
        if !self.peers.contains_key(&token) {
            return; // ended earlier in this round
        }
        if flags.intersects(epoll::EventFlags::IN | epoll::EventFlags::HUP | epoll::EventFlags::ERR) {
            let read = match self.peers.get_mut(&token) {
                Some(peer) => peer.read(now),
                None => return,
            };
            let (messages, closed) = match read {
                Ok(Read::Messages(m)) => (m, false),
                Ok(Read::Closed(m)) => (m, true),
                Err(e) => return self.end(token, false, Some(e)),
            };
            if !messages.is_empty() {
                // Releases the importer put in its ring before these frames come first.
                self.drain_ring(token, now);
            }
            for message in messages {
                if !self.peers.contains_key(&token) {
                    return;
                }
                self.on_message(token, message, now);
            }
            if closed && self.peers.contains_key(&token) {
                return self.end(token, false, None);
            }
        }
        if self.peers.contains_key(&token) {
            self.flush(token, now);
        }
    }

    fn on_message(&mut self, token: u64, message: Message, now: Instant) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        if let Some(handshake) = peer.handshake.as_mut() {
            match handshake.on_message(message) {
                Ok(answer) => {
                    let done = handshake.step() == crate::session::HandshakeStep::Done;
                    peer.capabilities = handshake.capabilities();
                    match protocol::encode(&answer) {
                        Ok(frame) => peer.local.push_back(Outgoing {
                            frame,
                            buffer: None,
                            with_pool_fd: answer.descriptor_count() == 1,
                            fin: false,
                            fds: Vec::new(),
                        }),
                        Err(e) => return self.end_handshake(token, Some(e.into())),
                    }
                    if done && peer.capabilities & protocol::CAP_RING != 0 {
                        let geometry = self.limits.ring.unwrap_or_default();
                        let ring = RingPeer::new(geometry).and_then(|(ring, sender)| Ok((ring.setup()?, ring, sender)));
                        match ring {
                            Ok(((frame, fd), ring, sender)) => {
                                peer.local.push_back(Outgoing {
                                    fds: vec![fd],
                                    ..Outgoing::plain(frame)
                                });
                                peer.ring = Some(ring);
                                peer.ring_sender = Some(sender);
                            }
                            Err(e) => {
                                record_drop_error(Error::Io(std::io::Error::other(format!(
                                    "the shared-memory rings of importer {}: {e}",
                                    peer.id
                                ))));
                                return self.end_handshake(token, Some(e));
                            }
                        }
                    }
                    if done {
                        self.connect(token, now);
                    }
                }
                Err(e) => self.end_handshake(token, Some(e)),
            }
            return;
        }
        let id = peer.id;
        match importer_event(message, peer.capabilities) {
            Ok(ImporterEvent::Release(buffer)) => {
                crate::trace::mark(crate::trace::Point::ExporterReleaseRead, buffer.0);
                if let Err(e) = self.handler.released(id, buffer) {
                    self.end(token, false, Some(e));
                }
            }
            Ok(ImporterEvent::ReleaseBatch(batch)) => {
                for buffer in &batch.buffers {
                    crate::trace::mark(crate::trace::Point::ExporterReleaseRead, buffer.0);
                }
                if let Err(e) = self.handler.released_batch(id, batch) {
                    self.end(token, false, Some(e));
                }
            }
            Ok(ImporterEvent::Goodbye) => self.end(token, true, None),
            // Drained before the socket's frames are handled (`on_peer`).
            Ok(ImporterEvent::RingBell) => {}
            Err(e) => self.end(token, false, Some(e)),
        }
    }

    /// The handshake of `token` completed.
    fn connect(&mut self, token: u64, _now: Instant) {
        if self.tokens.len() >= self.limits.max_importers || self.closing {
            let e = if self.closing {
                refused("it is shutting down")
            } else {
                refused(&format!(
                    "it serves its limit of {} importers",
                    self.limits.max_importers
                ))
            };
            self.stats.refused += 1;
            return self.end_handshake(token, Some(e));
        }
        let Some(peer) = self.peers.get_mut(&token) else { return };
        peer.handshake = None;
        // Remembered now: the peer spoke a moment ago, so the pid names it.
        peer.process = Some(ProcessRef::remember(peer.credentials.pid, peer.credentials.uid));
        let (id, credentials, capabilities) = (peer.id, peer.credentials, peer.capabilities);
        self.tokens.insert(id, token);
        let sender = peer.ring_sender.take();
        lock(&self.shared.outboxes).open(id, sender);
        self.handler.connected(id, credentials, capabilities);
    }

    /// Writes what waits for `token`, as far as its socket takes it.
    fn flush(&mut self, token: u64, now: Instant) {
        let shared = self.shared.clone();
        let Some(peer) = self.peers.get_mut(&token) else { return };
        let id = peer.id;
        let connected = peer.handshake.is_none();
        // `Buffer` frames go into the ring while it has room (`pop_for_socket`); the socket takes the
        // rest, and every frame with a descriptor.
        let result = peer.flush(self.pool_fd.as_fd(), now, || {
            if connected {
                lock(&shared.outboxes).pop_for_socket(id)
            } else {
                None
            }
        });
        let broken = if peer.ring.is_some() && connected {
            let mut outboxes = lock(&shared.outboxes);
            // A sleeping importer wakes to read the ring, or the socket's frames.
            outboxes.publish(id);
            outboxes.take_broken()
        } else {
            Vec::new()
        };
        match result {
            Ok(flushed) => {
                let want = flushed == Flushed::Blocked;
                if want != peer.wants_out {
                    let mut flags = epoll::EventFlags::IN;
                    if want {
                        flags |= epoll::EventFlags::OUT;
                    }
                    if epoll::modify(&self.epoll, &peer.stream, epoll::EventData::new_u64(token), flags).is_ok() {
                        peer.wants_out = want;
                    }
                }
            }
            Err(e) => self.end(token, false, Some(e)),
        }
        self.end_broken(broken);
    }

    /// Drains every connection's ring to the exporter; then, after ring traffic, spins over the
    /// rings for up to the spin time ([`Shared::ring_spin_ns`]) while its waiting flags stay clear
    /// (importers that publish meanwhile ring nobody: no `RingBell`, no wake-up of this thread),
    /// handling what it finds there as it finds it; then sets the exporter's waiting flags before
    /// the loop sleeps. Returns whether a ring had entries when its flag was set, or the spin
    /// ended early (`epoll` ready, a connection ended, [`SPIN_ROUND_EVERY`] passed: then the loop
    /// must not sleep).
    fn rings(&mut self, now: Instant) -> bool {
        let tokens: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| p.ring.is_some() && p.handshake.is_none())
            .map(|(t, _)| *t)
            .collect();
        for &token in &tokens {
            self.drain_ring(token, now);
        }
        // What the next round drains was found by nobody in particular.
        self.round_start = RoundStart::Busy;
        let spin = self.shared.ring_spin_ns.get();
        // A spin too long to add to an instant never ends by itself.
        let within = |last: Instant| last.checked_add(spin).is_none_or(|end| now < end);
        if self.ring_traffic.is_some_and(|last| !spin.is_zero() && within(last)) && self.spin(&tokens) {
            return true;
        }
        let mut busy = false;
        for token in tokens {
            let Some(ring) = self.peers.get_mut(&token).and_then(|p| p.ring.as_mut()) else {
                continue;
            };
            match ring.sleep_begin() {
                Ok(true) => {}
                Ok(false) => busy = true,
                Err(e) => self.end(token, false, Some(e)),
            }
        }
        busy
    }

    /// Looks at the rings of `tokens` (a load of each one's head, no lock, no system call) and
    /// drains each one that has entries, handling them at once, until the spin time (read again
    /// at each look at `epoll`, so a new setting takes effect at once) has passed since the last
    /// ring traffic (`false`: the loop may sleep), or the loop must go round: `epoll` has
    /// something ready (asked every [`SPIN_EPOLL_EVERY`], without waiting), a connection ended
    /// (its counters and peers are the round's to publish), or the spin has run for
    /// [`SPIN_ROUND_EVERY`] (the round's timers are due) (`true`).
    fn spin(&mut self, tokens: &[u64]) -> bool {
        let started = Instant::now();
        let mut asked = started;
        let mut spin = self.shared.ring_spin_ns.get();
        loop {
            let mut found = false;
            for &token in tokens {
                let Some(ring) = self.peers.get_mut(&token).and_then(|p| p.ring.as_mut()) else {
                    // Ended during this spin.
                    return true;
                };
                if ring.ready() {
                    crate::trace::count(crate::trace::Counter::LoopSpinHit);
                    self.round_start = RoundStart::Spun(crate::trace::stamp());
                    self.drain_ring(token, Instant::now());
                    self.round_start = RoundStart::Busy;
                    found = true;
                }
            }
            if found && tokens.iter().any(|t| !self.peers.contains_key(t)) {
                return true;
            }
            std::hint::spin_loop();
            let now = Instant::now();
            if now >= asked + SPIN_EPOLL_EVERY {
                asked = now;
                spin = self.shared.ring_spin_ns.get();
                let mut fds = [rustix::event::PollFd::new(&self.epoll, rustix::event::PollFlags::IN)];
                let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
                if matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0) {
                    return true;
                }
                if now >= started + SPIN_ROUND_EVERY {
                    return true;
                }
            }
            let last = self.ring_traffic.unwrap_or(started);
            if last.checked_add(spin).is_some_and(|end| now >= end) {
                return false;
            }
        }
    }

    /// Handles what waits in the ring of `token` (at most one ring's worth per call, so a peer
    /// that keeps writing cannot hold the loop).
    fn drain_ring(&mut self, token: u64, now: Instant) {
        let Some(ring) = self.peers.get_mut(&token).and_then(|p| p.ring.as_mut()) else {
            return;
        };
        let max = self.limits.ring.unwrap_or_default().capacity() as usize;
        match ring.drain(max) {
            Ok(messages) => {
                if messages.is_empty() {
                    return;
                }
                if let Some(peer) = self.peers.get_mut(&token) {
                    peer.last_traffic = now;
                }
                // Also when drained after a `RingBell` (`on_peer`): the spin follows any traffic.
                self.ring_traffic = Some(now);
                if crate::trace::is_enabled() {
                    self.mark_round_start(&messages);
                }
                for message in messages {
                    if !self.peers.contains_key(&token) {
                        break;
                    }
                    self.on_message(token, message, now);
                }
            }
            Err(e) => self.end(token, false, Some(e)),
        }
    }

    /// Records how the round that drained these releases began (`trace`).
    fn mark_round_start(&self, messages: &[Message]) {
        let (point, at) = match self.round_start {
            RoundStart::Busy => return,
            RoundStart::Woke(at) => (crate::trace::Point::ExporterLoopWoke, at),
            RoundStart::Spun(at) => (crate::trace::Point::ExporterSpinFound, at),
        };
        for message in messages {
            match message {
                Message::Release { buffer_id } => crate::trace::mark_at(point, buffer_id.0, at),
                Message::ReleaseBatch(batch) => {
                    for id in &batch.buffers {
                        crate::trace::mark_at(point, id.0, at);
                    }
                }
                _ => {}
            }
        }
    }

    /// Ends a connection. For a connected importer: its queue is dropped (those buffers never
    /// went out), the exporter is told, and if the importer may still use what it holds, its
    /// process is watched.
    fn end(&mut self, token: u64, clean: bool, err: Option<Error>) {
        let Some(peer) = self.peers.get(&token) else { return };
        if peer.handshake.is_some() {
            return self.end_handshake(token, err);
        }
        let Some(mut peer) = self.peers.remove(&token) else {
            return;
        };
        let _ = epoll::delete(&self.epoll, &peer.stream);
        peer.close_with(err.as_ref(), None);
        if let Some(e) = err {
            self.peer_error(e);
        }
        let mut undelivered = peer.undelivered_local();
        undelivered.extend(lock(&self.shared.outboxes).close(peer.id));
        self.tokens.remove(&peer.id);
        let id = peer.id;
        let process = peer.process.take();
        drop(peer); // the socket closes now
        let holds = self.handler.ended(id, clean, undelivered);
        if !holds {
            return;
        }
        if self.finishing() {
            return self.handler.abandoned(id);
        }
        let Some(process) = process else {
            return self.handler.exited(id);
        };
        // A process already watched (an earlier connection of it ended uncleanly too) costs
        // nothing more: the importer joins its watch.
        let key = process.key();
        if let Some(key) = key {
            if let Some(watch) = self.exit_tokens.get(&key).and_then(|t| self.exits.get_mut(t)) {
                return watch.importers.push(id);
            }
            if let Some((ids, _)) = self.polled.iter_mut().find(|(_, p)| p.key() == Some(key)) {
                return ids.push(id);
            }
        }
        match process.watch() {
            Watch::Gone => self.handler.exited(id),
            Watch::Pidfd(fd) => {
                let token = self.next_token;
                self.next_token += 1;
                match epoll::add(
                    &self.epoll,
                    &fd,
                    epoll::EventData::new_u64(token),
                    epoll::EventFlags::IN,
                ) {
                    Ok(()) => {
                        self.exits.insert(
                            token,
                            ExitWatch {
                                pidfd: fd,
                                key,
                                importers: vec![id],
                            },
                        );
                        if let Some(key) = key {
                            self.exit_tokens.insert(key, token);
                        }
                    }
                    Err(e) => {
                        record_drop_error(e.into());
                        self.handler.abandoned(id);
                    }
                }
            }
            Watch::Poll(process) => {
                self.polled.push((vec![id], process));
                self.next_poll.get_or_insert(Instant::now() + POLL_EXIT);
            }
        }
    }

    /// Counts an error that ended a connection. Peers cause these (a broken protocol, a reset
    /// socket, a time limit): they are counted ([`ReactorStats`]), not kept for
    /// `take_drop_errors`, whose few slots a hostile peer could otherwise fill and so hide the
    /// exporter's own failures. Failures of this side (the driver, freeing) are kept.
    fn peer_error(&mut self, e: Error) {
        match e {
            Error::Closed => {}
            // Counted where they are found.
            Error::Timeout { .. } | Error::Stalled { .. } | Error::Refused { .. } => {}
            Error::Core(_) | Error::Free { .. } => record_drop_error(e),
            _ => self.stats.peer_errors += 1,
        }
    }

    fn finishing(&self) -> bool {
        lock(&self.shared.control).finish
    }

    /// Ends a connection whose handshake did not complete (nothing to tell the exporter).
    fn end_handshake(&mut self, token: u64, err: Option<Error>) {
        let Some(peer) = self.peers.remove(&token) else { return };
        let _ = epoll::delete(&self.epoll, &peer.stream);
        let code = match &err {
            Some(Error::Refused { .. }) if self.closing => Some(ErrorCode::ShuttingDown),
            _ => None,
        };
        let mut peer = peer;
        peer.close_with(err.as_ref(), code);
        // Time limits and refusals are counted where found; a handshake that broke the protocol
        // is counted too.
        if let Some(e) = err {
            self.peer_error(e);
        }
    }

    // ---- the queues, the shutdown, the clocks ----

    /// When anything last went either way to or from `peer`: its socket, or its ring to the
    /// importer (its ring to the exporter counts in `last_traffic` when drained).
    fn last_traffic(&self, peer: &Peer) -> Instant {
        let pushed = lock(&self.shared.outboxes).ring_pushed(peer.id);
        pushed.map_or(peer.last_traffic, |p| p.max(peer.last_traffic))
    }

    /// Ends the connections whose ring broke its rules (found by a push into it).
    fn end_broken(&mut self, broken: Vec<(ImporterId, crate::ring::RingError)>) {
        for (id, e) in broken {
            if let Some(&token) = self.tokens.get(&id) {
                self.end(token, false, Some(e.into()));
            }
        }
    }

    fn mailbox(&mut self, now: Instant) {
        let (ready, doomed, broken) = {
            let mut outboxes = lock(&self.shared.outboxes);
            (outboxes.take_ready(), outboxes.take_doomed(), outboxes.take_broken())
        };
        self.end_broken(broken);
        for id in doomed {
            if let Some(&token) = self.tokens.get(&id) {
                self.stats.stalled += 1;
                let capacity = self.limits.send_queue_len;
                self.end(
                    token,
                    false,
                    Some(Error::Stalled {
                        importer: id,
                        reason: format!("its send queue of {capacity} messages is full"),
                    }),
                );
            }
        }
        for id in ready {
            if let Some(&token) = self.tokens.get(&id) {
                self.flush(token, now);
            }
        }
    }

    fn start_closing(&mut self, now: Instant) {
        self.closing = true;
        self.unlisten();
        // Dropping the listener removes the socket file: nobody new can connect.
        self.listener = None;
        let handshakes: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| p.handshake.is_some())
            .map(|(t, _)| *t)
            .collect();
        for token in handshakes {
            self.end_handshake(token, Some(refused("it is shutting down")));
        }
        let goodbye = protocol::encode(&Message::Goodbye).unwrap_or_default();
        lock(&self.shared.outboxes).push_last_to_all(|| Outgoing {
            frame: goodbye.clone(),
            buffer: None,
            with_pool_fd: false,
            fin: true,
            fds: Vec::new(),
        });
        self.mailbox(now);
    }

    fn timers(&mut self, now: Instant) {
        let limits = self.limits;
        let mut ends: Vec<(u64, Error)> = Vec::new();
        for (token, peer) in &self.peers {
            let e = if peer.handshake.is_some() && now >= peer.accepted + limits.handshake_timeout {
                Some(Error::Timeout { during: "handshake" })
            } else if peer.frame_started().is_some_and(|t| now >= t + limits.io_timeout) {
                Some(Error::Timeout { during: "receive" })
            } else if peer.blocked_since.is_some_and(|t| now >= t + limits.io_timeout) {
                Some(Error::Stalled {
                    importer: peer.id,
                    reason: format!("nothing it was sent went out for {:?}", limits.io_timeout),
                })
            } else if peer.handshake.is_none()
                && !peer.writing()
                && limits.idle_timeout.is_some_and(|t| now >= self.last_traffic(peer) + t)
                && lock(&self.shared.outboxes).len(peer.id) == 0
            {
                Some(Error::Timeout { during: "idle" })
            } else {
                None
            };
            if let Some(e) = e {
                ends.push((*token, e));
            }
        }
        for (token, e) in ends {
            match e {
                Error::Stalled { .. } => self.stats.stalled += 1,
                _ => self.stats.timed_out += 1,
            }
            self.end(token, false, Some(e));
        }
        if self.next_poll.is_some_and(|t| now >= t) {
            let polled = std::mem::take(&mut self.polled);
            for (ids, process) in polled {
                match process.alive() {
                    Liveness::Gone => {
                        for id in ids {
                            self.handler.exited(id);
                        }
                    }
                    Liveness::Alive | Liveness::CannotTell => self.polled.push((ids, process)),
                }
            }
            self.next_poll = (!self.polled.is_empty()).then(|| now + POLL_EXIT);
        }
        if self.backoff.resume(now) {
            if let Some(listener) = &self.listener {
                match epoll::add(
                    &self.epoll,
                    listener,
                    epoll::EventData::new_u64(LISTENER),
                    epoll::EventFlags::IN,
                ) {
                    Ok(()) => self.listening = true,
                    // Out of memory for the epoll entry, say: pause again and retry later,
                    // rather than never accepting again.
                    Err(e) => {
                        let first = !self.backoff.in_streak();
                        self.backoff.exhausted(now);
                        self.stats.accept_pauses += 1;
                        if first {
                            record_drop_error(e.into());
                        }
                    }
                }
            }
        }
    }

    fn next_deadline(&self, _now: Instant) -> Option<Instant> {
        let limits = self.limits;
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        let outboxes = lock(&self.shared.outboxes);
        for peer in self.peers.values() {
            if peer.handshake.is_some() {
                at(peer.accepted + limits.handshake_timeout);
            }
            if let Some(t) = peer.frame_started() {
                at(t + limits.io_timeout);
            }
            if let Some(t) = peer.blocked_since {
                at(t + limits.io_timeout);
            }
            // Only under the conditions `timers` ends an idle connection under: a past deadline
            // that `timers` would not act on would make the loop spin.
            if let (None, false, Some(idle)) = (&peer.handshake, peer.writing(), limits.idle_timeout) {
                if outboxes.len(peer.id) == 0 {
                    // `outboxes` is locked here: not `self.last_traffic`, which locks it.
                    let last = outboxes
                        .ring_pushed(peer.id)
                        .map_or(peer.last_traffic, |p| p.max(peer.last_traffic));
                    at(last + idle);
                }
            }
        }
        drop(outboxes);
        if let Some(t) = self.next_poll {
            at(t);
        }
        if let Some(t) = self.backoff.paused_until() {
            at(t);
        }
        next
    }

    fn publish(&mut self) {
        self.stats.importers = self.tokens.len();
        self.stats.handshakes = self.peers.len() - self.tokens.len();
        self.stats.awaiting_exit = self.exits.values().map(|w| w.importers.len()).sum::<usize>()
            + self.polled.iter().map(|(ids, _)| ids.len()).sum::<usize>();
        self.stats.watched_processes = self.exits.len() + self.polled.len();
        self.stats.queued = lock(&self.shared.outboxes).total();
        *lock(&self.shared.stats) = self.stats;
    }

    /// Closes everything: handshakes, connections (their importers' ends are unclean; what they
    /// still hold is abandoned), and the watches of processes that outlived the shutdown.
    fn finish(&mut self) {
        let tokens: Vec<u64> = self.peers.keys().copied().collect();
        for token in tokens {
            self.end(token, false, None);
        }
        self.exit_tokens.clear();
        for (_, watch) in std::mem::take(&mut self.exits) {
            let _ = epoll::delete(&self.epoll, &watch.pidfd);
            for id in watch.importers {
                self.handler.abandoned(id);
            }
        }
        for (ids, _) in std::mem::take(&mut self.polled) {
            for id in ids {
                self.handler.abandoned(id);
            }
        }
        self.listener = None;
        self.publish();
    }
}

/// A process awaited through its pidfd.
struct ExitWatch {
    pidfd: OwnedFd,
    /// Its pid and start time, if known (without them it is never shared).
    key: Option<ProcessKey>,
    /// The importers whose connections from this process ended uncleanly while they held
    /// buffers: each is reported [`Handler::exited`] when the process is gone.
    importers: Vec<ImporterId>,
}

/// The error that turns a connection away.
fn refused(reason: &str) -> Error {
    Error::Refused {
        reason: reason.to_owned(),
    }
}

/// Tells a peer that is not served why (one `Error` frame that never blocks) and closes.
fn tell_and_close(stream: &UnixStream, err: &Error, code: Option<ErrorCode>) {
    let code = code.unwrap_or_else(|| err.wire_code());
    if let Ok(frame) = protocol::encode(&Message::Error(ErrorMessage::new(code, err.to_string()))) {
        let _ = fdpass::send_raw(stream.as_fd(), &frame, &[], SendFlags::DONTWAIT);
    }
    let _ = rustix::net::shutdown(stream, Shutdown::Both);
}
