//! The exporter's ends of one connection's shared-memory rings (protocol version 3, `CAP_RING`).
//!
//! The exporter creates the region when the handshake completes and sends its memfd with
//! `RingSetup`. The ring to the importer's end, a [`RingSender`], lives in the importer's outbox
//! (`outbox.rs`), under the outbox's lock: `Buffer` frames that carry no descriptor go into the
//! ring while it has room, straight from the thread that shares them when nothing waits in the
//! outbox, else as the serving thread drains the outbox; the socket takes the rest. The ring from
//! the importer, a [`RingPeer`], stays with the connection in the event loop, which drains it at
//! every round: the importer's `Release` and `ReleaseBatch` frames. Every frame read from the ring
//! is decoded and validated like one read from the socket, and only those two types are accepted
//! there. Nothing here blocks: a full ring falls back to the socket, an empty one is left for the
//! next round, and waking the importer is a futex wake.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::protocol::{self, Message, MessageType};
use crate::ring::{Consumer, Direction, Geometry, Producer, Region, RingResult};

/// The exporter's end of the ring from the importer, and the region.
#[derive(Debug)]
pub(crate) struct RingPeer {
    region: Arc<Region>,
    /// `Release` / `ReleaseBatch` frames from the importer.
    rx: Consumer,
    scratch: Vec<u8>,
}

/// The exporter's end of the ring to the importer: `Buffer` frames.
#[derive(Debug)]
pub(crate) struct RingSender {
    tx: Producer,
    max_payload: usize,
}

impl RingPeer {
    /// Fresh rings of `geometry`: the loop's end and the outbox's end.
    pub(crate) fn new(geometry: Geometry) -> Result<(RingPeer, RingSender)> {
        let region = Arc::new(Region::create(geometry)?);
        let sender = RingSender {
            tx: Producer::new(region.clone(), Direction::ToImporter),
            max_payload: geometry.max_payload(),
        };
        let peer = RingPeer {
            rx: Consumer::new(region.clone(), Direction::ToExporter),
            scratch: vec![0; geometry.max_payload()],
            region,
        };
        Ok((peer, sender))
    }

    /// The `RingSetup` frame and a copy of the region's memfd to send with it.
    pub(crate) fn setup(&self) -> Result<(Vec<u8>, OwnedFd)> {
        Ok((
            protocol::encode(&Message::RingSetup)?,
            self.region.fd().try_clone_to_owned()?,
        ))
    }

    /// Reads up to `max` frames from the importer's ring, decoded and checked; gives their slots
    /// back. Only `Release` and `ReleaseBatch` are allowed there. Consecutive `ReleaseBatch` frames
    /// that name the same release event come out as one batch (the importer's latest recording of
    /// its event covers every release it sent before, so one look at the event, and at most one
    /// GPU wait on it, serves them all): releases that piled up while the exporter was busy cost
    /// it one handling, not one each.
    pub(crate) fn drain(&mut self, max: usize) -> Result<Vec<Message>> {
        let mut out: Vec<Message> = Vec::new();
        let mut taken = 0;
        while taken < max {
            let Some(len) = self.rx.pop(&mut self.scratch)? else {
                break;
            };
            taken += 1;
            let message = protocol::decode(&self.scratch[..len])?;
            match message {
                Message::ReleaseBatch(batch) => match out.last_mut() {
                    Some(Message::ReleaseBatch(last)) if last.event == batch.event => {
                        last.buffers.extend(batch.buffers);
                    }
                    _ => out.push(Message::ReleaseBatch(batch)),
                },
                Message::Release { .. } => out.push(message),
                other => {
                    return Err(Error::UnexpectedMessage {
                        expected: "Release or ReleaseBatch in the importer's ring",
                        got: other.message_type(),
                    })
                }
            }
        }
        if taken > 0 {
            self.rx.publish_and_wake();
        }
        Ok(out)
    }

    /// Whether entries wait in the importer's ring (one load of its head, checked; a ring that
    /// broke its rules says `true`: the next drain reports how).
    pub(crate) fn ready(&mut self) -> bool {
        self.rx.ready().map_or(true, |n| n > 0)
    }

    /// Sets the exporter's waiting flag before the loop sleeps; `false` if entries arrived
    /// meanwhile (do not sleep).
    pub(crate) fn sleep_begin(&mut self) -> Result<bool> {
        Ok(self.rx.sleep_begin()?)
    }

    /// Clears the waiting flag after the loop woke.
    pub(crate) fn sleep_end(&self) {
        self.rx.sleep_end();
    }
}

impl RingSender {
    /// Whether `frame` may travel in the ring: a `Buffer` frame that fits a slot (the caller checks
    /// that nothing rides on it).
    pub(crate) fn fits(&self, frame: &[u8]) -> bool {
        frame.len() <= self.max_payload
            && protocol::decode_header(frame).is_ok_and(|h| h.message_type == MessageType::Buffer)
    }

    /// Writes a frame into the ring to the importer, unpublished; `false` when it is full.
    /// Errors: the importer's tail broke the ring's rules ([`RingError::Corrupt`](crate::ring::RingError)).
    pub(crate) fn push(&mut self, frame: &[u8]) -> RingResult<bool> {
        self.tx.push(frame)
    }

    /// Publishes what was pushed and wakes the importer if it sleeps (also after frames went out
    /// on the socket: a sleeping importer then looks at its socket); returns whether it woke it.
    pub(crate) fn publish_and_wake(&mut self) -> bool {
        let asleep = self.tx.publish();
        if asleep {
            self.tx.wake_consumer();
        }
        asleep
    }
}
