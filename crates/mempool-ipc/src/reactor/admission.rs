//! Who gets in, pure logic: the limits, which connection a new one may push out, and how long
//! accepting pauses when the process runs out of descriptors. The event loop asks; the tests
//! (`server/tests.rs`) check the decisions without sockets.

use std::time::{Duration, Instant};

use crate::session::HandshakeStep;

/// The exporter's connection limits (the public ones are fields of
/// [`ExporterOptions`](crate::ExporterOptions)).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Limits {
    /// Connected importers (handshake done) at most; a connection beyond is turned away.
    pub(crate) max_importers: usize,
    /// Handshakes in flight at most; a new connection beyond pushes out the one that made the
    /// least progress (the oldest of those).
    pub(crate) max_handshakes: usize,
    /// Messages queued for one importer at most; one more disconnects it.
    pub(crate) send_queue_len: usize,
    /// An importer with no traffic either way for this long is disconnected.
    pub(crate) idle_timeout: Option<Duration>,
    /// The whole handshake, from accept to the pool descriptor.
    pub(crate) handshake_timeout: Duration,
    /// One frame once begun; a send that makes no progress.
    pub(crate) io_timeout: Duration,
    /// The rings offered to importers that ask for them (`CAP_RING`); `None`: not offered.
    pub(crate) ring: Option<crate::ring::Geometry>,
}

/// What to do with a connection just accepted (its credentials passed).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Admission<K> {
    /// Start its handshake.
    Admit,
    /// Close handshake `K` to make room, then start this one's.
    Evict(K),
    /// Turn it away: as many importers as allowed are connected.
    Refuse,
}

/// A handshake in flight, as admission sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Pending<K> {
    pub(crate) key: K,
    pub(crate) step: HandshakeStep,
    /// Whether any byte of it arrived.
    pub(crate) heard: bool,
    pub(crate) accepted: Instant,
}

impl Limits {
    /// Decides on a new connection while `importers` are connected and `pending` handshakes are
    /// in flight.
    ///
    /// A flood of connections that never speak cannot starve a real importer: when every
    /// handshake slot is taken, the newcomer takes the slot of the handshake that made the least
    /// progress (silent before started, before `Hello` answered), the oldest among equals. A real
    /// importer says `Hello` at once and `Ready` a moment later, so it is always ahead of the
    /// silent ones; only `max_handshakes` newer connections that got as far as it did can push it
    /// out.
    pub(crate) fn admit<K: Copy>(&self, importers: usize, pending: &[Pending<K>]) -> Admission<K> {
        if importers >= self.max_importers {
            return Admission::Refuse;
        }
        if pending.len() < self.max_handshakes.max(1) {
            return Admission::Admit;
        }
        match least_progressed(pending) {
            Some(victim) => Admission::Evict(victim),
            None => Admission::Admit,
        }
    }
}

/// The handshake that made the least progress, the oldest among equals.
pub(crate) fn least_progressed<K: Copy>(pending: &[Pending<K>]) -> Option<K> {
    pending
        .iter()
        .min_by_key(|p| (p.step, p.heard, p.accepted))
        .map(|p| p.key)
}

/// How long accepting pauses after the process ran out of descriptors (`EMFILE`, `ENFILE`):
/// the listener stays readable while connections wait, so retrying at once would spin. The pause
/// doubles from 10 ms to 1 s while accepting keeps failing and resets after a success.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    next: Option<Duration>,
    until: Option<Instant>,
}

const BACKOFF_FIRST: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

impl Backoff {
    /// Accepting failed for lack of descriptors at `now`: pause; returns until when.
    pub(crate) fn exhausted(&mut self, now: Instant) -> Instant {
        let pause = self.next.unwrap_or(BACKOFF_FIRST);
        self.next = Some((pause * 2).min(BACKOFF_MAX));
        let until = now + pause;
        self.until = Some(until);
        until
    }

    /// An accept succeeded: the next exhaustion starts from the shortest pause again.
    pub(crate) fn succeeded(&mut self) {
        self.next = None;
    }

    /// Whether accepting failed for lack of descriptors since its last success (a streak: only
    /// its first failure is worth reporting).
    pub(crate) fn in_streak(&self) -> bool {
        self.next.is_some()
    }

    /// Until when accepting pauses, if it does.
    pub(crate) fn paused_until(&self) -> Option<Instant> {
        self.until
    }

    /// Whether the pause is over at `now` (clears it).
    pub(crate) fn resume(&mut self, now: Instant) -> bool {
        match self.until {
            Some(until) if now >= until => {
                self.until = None;
                true
            }
            _ => false,
        }
    }
}
