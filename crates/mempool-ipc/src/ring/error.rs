//! What the rings refuse: a caller's mistake, a failed system call, or a peer that broke the
//! ring's rules.

use std::time::Duration;

/// Why a ring operation failed. `Corrupt` and `Stalled` mean the process at the other end broke
/// the ring's rules (or is frozen): cut it off. `Io` is this process's system call failing.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// A system call on the region or a doorbell failed.
    #[error("shared-memory ring: {during}: {source}")]
    Io {
        /// What was being done.
        during: &'static str,
        /// The failure.
        source: std::io::Error,
    },
    /// The geometry asked for is outside the ring's limits.
    #[error("shared-memory ring: bad geometry: {reason}")]
    Geometry {
        /// Which limit.
        reason: String,
    },
    /// A region received from a peer is not a valid ring region (checked once, when mapped).
    #[error("shared-memory ring: the peer's region is not a ring region: {reason}")]
    BadRegion {
        /// What is wrong with it.
        reason: String,
    },
    /// A payload longer than a slot holds (this process's mistake; nothing was written).
    #[error("shared-memory ring: a payload of {len} bytes does not fit a slot of {max} payload bytes")]
    PayloadTooLarge {
        /// The payload's length.
        len: usize,
        /// The most a slot holds.
        max: usize,
    },
    /// The peer wrote the ring's shared words against the rules: an index out of range or moving
    /// backwards, a slot whose sequence or length is wrong. The ring is unusable from then on.
    #[error("shared-memory ring {ring}: the peer corrupted the ring: {reason}")]
    Corrupt {
        /// Which ring (`"to importer"` or `"to exporter"`).
        ring: &'static str,
        /// What it broke.
        reason: String,
    },
    /// The ring stayed full, the consumer taking nothing, for longer than allowed.
    #[error("shared-memory ring {ring}: full for {waited:?} with the peer taking nothing (limit {limit:?})")]
    Stalled {
        /// Which ring.
        ring: &'static str,
        /// How long it has been full.
        waited: Duration,
        /// The limit.
        limit: Duration,
    },
}

impl RingError {
    /// Whether the error is the peer's fault (corrupt ring, stalled consumer, bad region): the
    /// connection must end and the peer's leases be reclaimed.
    pub fn is_peer_fault(&self) -> bool {
        matches!(
            self,
            RingError::Corrupt { .. } | RingError::Stalled { .. } | RingError::BadRegion { .. }
        )
    }

    pub(crate) fn io(during: &'static str, source: impl Into<std::io::Error>) -> RingError {
        RingError::Io {
            during,
            source: source.into(),
        }
    }
}

/// What the ring operations return.
pub type RingResult<T> = std::result::Result<T, RingError>;
