//! The importer's end of a connection's shared-memory rings (protocol version 3, `CAP_RING`).
//!
//! `Buffer` frames arrive in the ring to the importer; the importer's `Release` and
//! `ReleaseBatch` frames go out in the ring to the exporter, with a `RingBell` on the socket only
//! when the exporter's waiting flag says it sleeps. A frame read from the ring is decoded and
//! validated like one read from the socket; only `Buffer` is allowed there.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::connection::Received;
use crate::error::{Error, Result};
use crate::protocol::{self, BufferDescriptor, Message};
use crate::ring::{Consumer, Direction, Geometry, Producer, Region, SLOT_HEADER_WORDS};

/// The longest frame the rings carry: a `Buffer` (the shortest `ReleaseBatch`, of one id, is shorter).
const LONGEST_RING_FRAME: usize = if protocol::BUFFER_FRAME_LEN > protocol::RELEASE_BATCH_FRAME_FIXED_LEN + 8 {
    protocol::BUFFER_FRAME_LEN
} else {
    protocol::RELEASE_BATCH_FRAME_FIXED_LEN + 8
};

/// The smallest ring slot the protocol accepts, in bytes: the slot's header and the longest frame
/// the rings carry, rounded up to a multiple of 8 (208 bytes). A smaller slot would carry no
/// buffer, and under 104 bytes not even a `ReleaseBatch` of one id.
pub(crate) const MIN_RING_SLOT_BYTES: u32 = ((8 * SLOT_HEADER_WORDS + LONGEST_RING_FRAME).div_ceil(8) * 8) as u32;

/// Refuses rings whose slots cannot hold every frame the protocol puts in them
/// ([`Error::RingSlotTooSmall`]): the exporter checks the geometry it offers when it starts, the
/// importer the one it is offered at the handshake.
pub(crate) fn check_ring_geometry(geometry: Geometry) -> Result<()> {
    if geometry.slot_bytes() < MIN_RING_SLOT_BYTES {
        return Err(Error::RingSlotTooSmall {
            slot_bytes: geometry.slot_bytes(),
            min: MIN_RING_SLOT_BYTES,
        });
    }
    Ok(())
}

/// How long the importer sleeps on its doorbell before it looks at the socket by itself (the
/// exporter rings the doorbell when it writes to the socket too; this bounds how late an
/// exporter that died is noticed).
pub(crate) const SOCKET_CHECK: Duration = Duration::from_millis(20);

/// How long the importer looks at its ring before it sets its waiting flag and sleeps: a buffer that
/// arrives within it costs no doorbell and no wake-up (the producer of a round trip answers a release
/// within microseconds).
pub(crate) const SPIN: Duration = Duration::from_micros(20);

/// The importer's ends of the rings.
#[derive(Debug)]
pub(crate) struct ImporterRing {
    /// `Buffer` frames from the exporter, and the scratch slot they are copied into.
    rx: Mutex<(Consumer, Vec<u8>)>,
    /// `Release` / `ReleaseBatch` frames to the exporter.
    tx: Mutex<Producer>,
    /// A socket message read while the ring still held buffers sent before it: handed out after them.
    pub(crate) stash: Mutex<Option<Received>>,
    max_payload: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ImporterRing {
    /// Maps the region the exporter sent (checked: seals, header, length, and slots that hold
    /// every frame of the protocol).
    pub(crate) fn open(fd: OwnedFd) -> Result<ImporterRing> {
        let region = Arc::new(Region::open(fd)?);
        check_ring_geometry(region.geometry())?;
        let max_payload = region.geometry().max_payload();
        Ok(ImporterRing {
            rx: Mutex::new((
                Consumer::new(region.clone(), Direction::ToImporter),
                vec![0; max_payload],
            )),
            tx: Mutex::new(Producer::new(region, Direction::ToExporter)),
            stash: Mutex::new(None),
            max_payload,
        })
    }

    /// The next buffer in the ring, if any; its slot goes back to the exporter at once.
    pub(crate) fn pop(&self) -> Result<Option<BufferDescriptor>> {
        let mut guard = lock(&self.rx);
        let (rx, scratch) = &mut *guard;
        let Some(len) = rx.pop(scratch)? else { return Ok(None) };
        let message = protocol::decode(&scratch[..len]);
        rx.publish_and_wake();
        match message? {
            Message::Buffer(b) => Ok(Some(b)),
            other => Err(Error::UnexpectedMessage {
                expected: "Buffer in the exporter's ring",
                got: other.message_type(),
            }),
        }
    }

    /// The region (for tests that write it as a hostile peer would).
    #[cfg(test)]
    pub(crate) fn region(&self) -> Arc<Region> {
        lock(&self.rx).0.region().clone()
    }

    /// Looks at the ring for up to `limit` without sleeping; returns whether a buffer arrived (or the
    /// ring broke: the next pop says how).
    pub(crate) fn spin(&self, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        loop {
            for _ in 0..64 {
                if self.ready().unwrap_or(true) {
                    return true;
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= limit {
                return false;
            }
        }
    }

    /// Whether buffers wait in the ring.
    pub(crate) fn ready(&self) -> Result<bool> {
        Ok(lock(&self.rx).0.ready()? > 0)
    }

    /// Sleeps until the exporter rings (or `timeout` passes) if, once the waiting flag is set,
    /// the ring is still empty and `socket_ready` says nothing waits on the socket either (the
    /// exporter rings after socket frames too, but only once it sees the flag). Returns `true`
    /// when it did not sleep because `socket_ready` said a frame waits (read it).
    pub(crate) fn sleep(&self, timeout: Duration, socket_ready: impl FnOnce() -> bool) -> Result<bool> {
        let mut guard = lock(&self.rx);
        if guard.0.sleep_begin()? {
            if socket_ready() {
                guard.0.sleep_end();
                return Ok(true);
            }
            guard.0.wait(timeout)?;
        }
        Ok(false)
    }

    /// Writes `message` (a release) into the ring to the exporter, unpublished; `false` if it
    /// does not fit a slot or the ring is full (send it on the socket).
    pub(crate) fn push(&self, message: &Message) -> Result<bool> {
        let frame = protocol::encode(message)?;
        if frame.len() > self.max_payload {
            return Ok(false);
        }
        Ok(lock(&self.tx).push(&frame)?)
    }

    /// The most buffers one `ReleaseBatch` in a slot can name (at least one: `open` refused
    /// slots too small for that).
    pub(crate) fn batch_max(&self) -> usize {
        // Header, count and flags, the event handle, then 8 bytes per id.
        (self.max_payload.saturating_sub(protocol::RELEASE_BATCH_FRAME_FIXED_LEN) / 8)
            .clamp(1, protocol::MAX_RELEASE_BATCH)
    }

    /// Publishes the releases written; returns whether the exporter sleeps (send `RingBell`).
    pub(crate) fn publish(&self) -> bool {
        lock(&self.tx).publish()
    }
}
