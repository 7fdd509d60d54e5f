//! What waits to be sent to each connected importer: one bounded queue per importer, which
//! [`Exporter::share`](crate::Exporter::share) fills from any thread and the event loop drains
//! as the importer's socket takes it. Pure bookkeeping under one mutex (`Shared::outboxes`); the
//! tests (`server/tests.rs`) drive it directly.
//!
//! An importer with the shared-memory rings (protocol version 3) also has its ring here, under the
//! same lock: a `Buffer` frame pushed while nothing waits in its queue goes straight into the ring
//! (the sharing thread publishes it and wakes the importer if it sleeps; the event loop is not
//! woken), and the loop moves queued `Buffer` frames into the ring as it drains the queue. Once a
//! queue is closed, nothing more goes into its ring either.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::OwnedFd;

use super::ring_peer::RingSender;
use crate::lease::ImporterId;
use crate::protocol::BufferId;
use crate::ring::RingError;

/// One frame waiting to go out.
#[derive(Debug)]
pub(crate) struct Outgoing {
    /// The encoded frame.
    pub(crate) frame: Vec<u8>,
    /// The buffer a `Buffer` frame shares: if the frame never goes out, the importer never saw it.
    pub(crate) buffer: Option<BufferId>,
    /// The pool's descriptor rides on the frame's first byte (`PoolDescriptor`).
    pub(crate) with_pool_fd: bool,
    /// Close the sending direction once it is out (`Goodbye`).
    pub(crate) fin: bool,
    /// Descriptors of its own that ride on the frame's first byte (`VmmBuffer`: one,
    /// `VmmChunks`: one per chunk); closed here once sent, or with the frame if it never goes out.
    pub(crate) fds: Vec<OwnedFd>,
}

impl Outgoing {
    /// A frame with nothing attached.
    pub(crate) fn plain(frame: Vec<u8>) -> Outgoing {
        Outgoing {
            frame,
            buffer: None,
            with_pool_fd: false,
            fin: false,
            fds: Vec::new(),
        }
    }
}

/// Why a frame could not be queued.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum PushError {
    /// No such importer is connected (it never was, or it is gone).
    Unknown,
    /// Its queue holds the most it may: it does not read. It is marked to be disconnected.
    Full(usize),
    /// It is being disconnected, or the exporter shuts down and says `Goodbye`.
    Closing,
    /// Its ring broke the ring's rules: it is marked to be disconnected.
    RingBroken,
}

#[derive(Debug)]
struct Queue {
    items: VecDeque<Outgoing>,
    closing: bool,
    /// The ring to the importer (protocol version 3).
    ring: Option<RingSender>,
    /// When a frame last went into the ring (traffic, for the idle timeout).
    ring_pushed: Option<std::time::Instant>,
}

impl Queue {
    /// Whether `item` may go into the ring now: nothing rides on it, it is a `Buffer` frame that fits.
    fn ring_takes(&self, item: &Outgoing) -> bool {
        item.buffer.is_some()
            && item.fds.is_empty()
            && !item.with_pool_fd
            && !item.fin
            && self.ring.as_ref().is_some_and(|r| r.fits(&item.frame))
    }
}

/// Every connected importer's queue.
#[derive(Debug, Default)]
pub(crate) struct Outboxes {
    queues: HashMap<ImporterId, Queue>,
    capacity: usize,
    /// Importers with frames the event loop has not looked at yet.
    ready: BTreeSet<ImporterId>,
    /// Importers whose queue overflowed: the event loop disconnects them.
    doomed: BTreeSet<ImporterId>,
    /// Importers whose ring broke its rules, and how: the event loop disconnects them.
    broken: Vec<(ImporterId, RingError)>,
}

impl Outboxes {
    /// Queues of at most `capacity` frames each.
    pub(crate) fn new(capacity: usize) -> Outboxes {
        Outboxes {
            capacity: capacity.max(1),
            ..Outboxes::default()
        }
    }

    /// Opens the queue of an importer whose handshake completed.
    pub(crate) fn open(&mut self, id: ImporterId, ring: Option<RingSender>) {
        self.queues.insert(
            id,
            Queue {
                items: VecDeque::new(),
                closing: false,
                ring,
                ring_pushed: None,
            },
        );
    }

    /// Closes an importer's queue (its connection ended); returns the buffers whose frames never
    /// went out.
    pub(crate) fn close(&mut self, id: ImporterId) -> Vec<BufferId> {
        self.ready.remove(&id);
        self.doomed.remove(&id);
        self.broken.retain(|(i, _)| *i != id);
        self.queues
            .remove(&id)
            .map(|q| q.items.into_iter().filter_map(|o| o.buffer).collect())
            .unwrap_or_default()
    }

    /// Queues a frame for `id`. Returns whether the event loop must be woken (nothing else was
    /// waiting for it to look at; after a [`PushError::Full`], always wake it).
    ///
    /// A full queue marks the importer to be disconnected ([`Outboxes::take_doomed`]): an
    /// importer that does not read must not hold frames for others, nor memory, forever.
    pub(crate) fn push(&mut self, id: ImporterId, item: Outgoing) -> Result<bool, PushError> {
        let queue = self.queues.get_mut(&id).ok_or(PushError::Unknown)?;
        if queue.closing {
            return Err(PushError::Closing);
        }
        if queue.items.len() >= self.capacity {
            queue.closing = true;
            self.doomed.insert(id);
            return Err(PushError::Full(self.capacity));
        }
        if queue.items.is_empty() && queue.ring_takes(&item) {
            let ring = queue.ring.as_mut().expect("ring_takes checked it");
            match ring.push(&item.frame) {
                Ok(true) => {
                    let woke = ring.publish_and_wake();
                    queue.ring_pushed = Some(std::time::Instant::now());
                    if let Some(buffer) = item.buffer {
                        crate::trace::mark(crate::trace::Point::ExporterFrameOut, buffer.0);
                        if woke {
                            crate::trace::mark(crate::trace::Point::ExporterBellRang, buffer.0);
                        }
                    }
                    return Ok(false);
                }
                Ok(false) => {} // full: queued, the loop sends it
                Err(e) => {
                    queue.closing = true;
                    self.broken.push((id, e));
                    return Err(PushError::RingBroken);
                }
            }
        }
        queue.items.push_back(item);
        // The loop takes the whole set when woken: one wake per batch is enough.
        let wake = self.ready.is_empty();
        self.ready.insert(id);
        Ok(wake)
    }

    /// Queues a last frame for every importer past any limit (the exporter's `Goodbye`) and
    /// refuses further frames; returns whether the event loop must be woken.
    pub(crate) fn push_last_to_all(&mut self, make: impl Fn() -> Outgoing) -> bool {
        for (id, queue) in &mut self.queues {
            if !queue.closing {
                queue.items.push_back(make());
                queue.closing = true;
                self.ready.insert(*id);
            }
        }
        !self.ready.is_empty()
    }

    /// The next frame for `id`.
    #[cfg(test)]
    pub(crate) fn pop(&mut self, id: ImporterId) -> Option<Outgoing> {
        self.queues.get_mut(&id)?.items.pop_front()
    }

    /// The next frame for `id`'s socket: first moves the `Buffer` frames at the front of its queue
    /// into its ring while the ring has room (unpublished: [`Outboxes::publish`]). A ring that breaks
    /// its rules marks the importer to be disconnected ([`Outboxes::take_broken`]) and gives nothing.
    pub(crate) fn pop_for_socket(&mut self, id: ImporterId) -> Option<Outgoing> {
        let queue = self.queues.get_mut(&id)?;
        while queue.items.front().is_some_and(|item| queue.ring_takes(item)) {
            let ring = queue.ring.as_mut().expect("ring_takes checked it");
            let front = queue.items.front().expect("checked above");
            match ring.push(&front.frame) {
                Ok(true) => {
                    queue.ring_pushed = Some(std::time::Instant::now());
                    let item = queue.items.pop_front().expect("checked above");
                    if let Some(buffer) = item.buffer {
                        crate::trace::mark(crate::trace::Point::ExporterFrameOut, buffer.0);
                    }
                }
                Ok(false) => break, // full: the socket takes it
                Err(e) => {
                    queue.closing = true;
                    self.broken.push((id, e));
                    return None;
                }
            }
        }
        queue.items.pop_front()
    }

    /// Publishes what went into `id`'s ring and wakes the importer if it sleeps (also after its
    /// socket took frames: a sleeping importer then looks at its socket).
    pub(crate) fn publish(&mut self, id: ImporterId) {
        if let Some(ring) = self.queues.get_mut(&id).and_then(|q| q.ring.as_mut()) {
            let _ = ring.publish_and_wake();
        }
    }

    /// When a frame last went into `id`'s ring.
    pub(crate) fn ring_pushed(&self, id: ImporterId) -> Option<std::time::Instant> {
        self.queues.get(&id)?.ring_pushed
    }

    /// The importers whose ring broke its rules, and how (the event loop disconnects them now).
    pub(crate) fn take_broken(&mut self) -> Vec<(ImporterId, RingError)> {
        std::mem::take(&mut self.broken)
    }

    /// The importers with frames the event loop has not looked at yet (it looks now).
    pub(crate) fn take_ready(&mut self) -> Vec<ImporterId> {
        std::mem::take(&mut self.ready).into_iter().collect()
    }

    /// The importers whose queue overflowed (the event loop disconnects them now).
    pub(crate) fn take_doomed(&mut self) -> Vec<ImporterId> {
        std::mem::take(&mut self.doomed).into_iter().collect()
    }

    /// How many frames wait for `id`.
    pub(crate) fn len(&self, id: ImporterId) -> usize {
        self.queues.get(&id).map_or(0, |q| q.items.len())
    }

    /// How many frames wait, for everyone.
    pub(crate) fn total(&self) -> usize {
        self.queues.values().map(|q| q.items.len()).sum()
    }
}
