//! The importer's pending releases on the fast release path (protocol version 2): buffers it is
//! done with, waiting to go to the exporter together in one `ReleaseBatch`. Pure bookkeeping, no
//! GPU, no sockets; the importer records its release event before it adds a buffer here and
//! sends what [`ReleaseBatcher::take`] returns.
//!
//! Like Nagle's algorithm: a release that finds nothing pending and no batch sent within the last
//! [`ReleaseBatcher::max_delay`] goes out at once (an isolated release waits for nobody, so a
//! round trip pays no batching delay); releases that follow a recent send gather into a batch,
//! which goes out when it holds [`ReleaseBatcher::max_count`] buffers (both are what
//! [`ReleaseBatcher::push`] says), when its oldest release is `max_delay` old (the importer's
//! flusher thread waits for [`ReleaseBatcher::deadline`]), and whenever the importer is about to
//! wait for the exporter (the exporter may be waiting for these releases). The tests are in
//! `batch/tests.rs`.

use std::time::{Duration, Instant};

use crate::protocol::{BufferId, MAX_RELEASE_BATCH};

/// Releases waiting to be sent together. See the [module documentation](self).
#[derive(Debug)]
pub(crate) struct ReleaseBatcher {
    pending: Vec<BufferId>,
    /// When the oldest pending release was added.
    since: Option<Instant>,
    /// When the last batch was taken to be sent.
    last_sent: Option<Instant>,
    max_count: usize,
    max_delay: Duration,
}

impl ReleaseBatcher {
    /// An empty batcher that sends at most `max_count` releases at once (1 to
    /// [`MAX_RELEASE_BATCH`]; other values are clamped) and holds none longer than `max_delay`.
    pub(crate) fn new(max_count: usize, max_delay: Duration) -> ReleaseBatcher {
        ReleaseBatcher {
            pending: Vec::new(),
            since: None,
            last_sent: None,
            max_count: max_count.clamp(1, MAX_RELEASE_BATCH),
            max_delay,
        }
    }

    /// The most releases one batch holds.
    #[cfg(test)]
    pub(crate) fn max_count(&self) -> usize {
        self.max_count
    }

    /// The longest a release waits.
    #[cfg(test)]
    pub(crate) fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// Adds a release made at `now`. Returns `true` when the batch should go now: it is full, or
    /// this release found nothing pending and no batch was taken within `max_delay` before `now`
    /// (the link is idle: batching would only delay it).
    pub(crate) fn push(&mut self, buffer: BufferId, now: Instant) -> bool {
        let idle = self.pending.is_empty()
            && self
                .last_sent
                .is_none_or(|sent| now.saturating_duration_since(sent) >= self.max_delay);
        if self.pending.is_empty() {
            self.since = Some(now);
        }
        self.pending.push(buffer);
        idle || self.pending.len() >= self.max_count
    }

    /// When the oldest pending release must be sent; `None` when nothing is pending.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.since.map(|since| since + self.max_delay)
    }

    /// Whether the oldest pending release has waited `max_delay` at `now`.
    #[cfg(test)]
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|deadline| now >= deadline)
    }

    /// Takes the pending releases at `now`, to be sent: oldest first, at most `max_count` (what a
    /// push that said "send" left is always at most that); the rest stay, as a batch begun now.
    /// A take of at least one release counts as a send for [`ReleaseBatcher::push`].
    pub(crate) fn take(&mut self, now: Instant) -> Vec<BufferId> {
        if !self.pending.is_empty() {
            self.last_sent = Some(now);
        }
        if self.pending.len() <= self.max_count {
            self.since = None;
            return std::mem::take(&mut self.pending);
        }
        let rest = self.pending.split_off(self.max_count);
        std::mem::replace(&mut self.pending, rest)
    }

    /// How many releases are pending.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is pending.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests;
