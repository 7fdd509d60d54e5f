//! The exporter's end of one connection's shared-memory rings (protocol version 3, `CAP_RING`).
//!
//! The exporter creates the region when the handshake completes and sends its memfd with
//! `RingSetup`. From then on `Buffer` frames that carry no descriptor go into the ring to the
//! importer while it has room (the socket takes them when it is full), and the importer's
//! `Release` and `ReleaseBatch` frames come back in the other ring, drained by the event loop at
//! every round. Every frame read from the ring is decoded and validated like one read from the
//! socket, and only those two types are accepted there. Nothing here blocks: a full ring falls
//! back to the socket, an empty one is left for the next round.

use std::sync::Arc;

use super::outbox::Outgoing;
use crate::error::{Error, Result};
use crate::ring::{Consumer, Direction, Geometry, Producer, Region};
use crate::wire::{self, Message, MessageType};

/// One connection's rings, the exporter's ends.
#[derive(Debug)]
pub(crate) struct RingPeer {
    region: Arc<Region>,
    /// `Buffer` frames to the importer.
    tx: Producer,
    /// `Release` / `ReleaseBatch` frames from the importer.
    rx: Consumer,
    scratch: Vec<u8>,
}

impl RingPeer {
    /// Fresh rings of `geometry`.
    pub(crate) fn new(geometry: Geometry) -> Result<RingPeer> {
        let region = Arc::new(Region::create(geometry)?);
        Ok(RingPeer {
            tx: Producer::new(region.clone(), Direction::ToImporter),
            rx: Consumer::new(region.clone(), Direction::ToExporter),
            scratch: vec![0; geometry.max_payload()],
            region,
        })
    }

    /// The `RingSetup` frame, with a copy of the region's memfd.
    pub(crate) fn setup(&self) -> Result<Outgoing> {
        let mut item = Outgoing::plain(wire::encode(&Message::RingSetup)?);
        item.fds.push(self.region.fd().try_clone_to_owned()?);
        Ok(item)
    }

    /// Whether `item` may travel in the ring: a `Buffer` frame (it names a buffer and carries no
    /// descriptor) that fits a slot.
    pub(crate) fn fits(&self, item: &Outgoing) -> bool {
        item.buffer.is_some()
            && item.fds.is_empty()
            && !item.with_pool_fd
            && !item.fin
            && item.frame.len() <= self.region.geometry().max_payload()
            && wire::decode_header(&item.frame).is_ok_and(|h| h.message_type == MessageType::Buffer)
    }

    /// Writes a frame into the ring to the importer; `false` when it is full.
    pub(crate) fn push(&mut self, frame: &[u8]) -> Result<bool> {
        Ok(self.tx.push(frame)?)
    }

    /// Publishes what was pushed and wakes the importer if it sleeps (also after a frame went
    /// out on the socket: a sleeping importer then looks at its socket).
    pub(crate) fn publish_and_wake(&mut self) {
        self.tx.publish_and_wake();
    }

    /// Reads up to `max` frames from the importer's ring, decoded and checked; gives their slots
    /// back. Only `Release` and `ReleaseBatch` are allowed there.
    pub(crate) fn drain(&mut self, max: usize) -> Result<Vec<Message>> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(len) = self.rx.pop(&mut self.scratch)? else {
                break;
            };
            let message = wire::decode(&self.scratch[..len])?;
            match message {
                Message::Release { .. } | Message::ReleaseBatch(_) => out.push(message),
                other => {
                    return Err(Error::UnexpectedMessage {
                        expected: "Release or ReleaseBatch in the importer's ring",
                        got: other.message_type(),
                    })
                }
            }
        }
        if !out.is_empty() {
            self.rx.publish_and_wake();
        }
        Ok(out)
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
