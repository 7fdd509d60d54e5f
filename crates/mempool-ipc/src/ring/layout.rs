//! Where everything lies in a ring region, in 64-bit words from its start.
//!
//! ```text
//! words 0..16     header: magic, layout version, capacity, slot words, length in bytes
//! words 16..80    ring 0 (exporter -> importer): head, tail, consumer waiting, producer waiting,
//!                 each on its own 128-byte line
//! words 80..144   ring 1 (importer -> exporter): the same
//! words 144..     ring 0's slots, then ring 1's; `capacity` slots of `slot_words` words each
//! ```
//!
//! A slot is `[sequence, length in bytes, payload words...]`. The region's length is rounded up
//! to whole pages.

use super::error::{RingError, RingResult};

/// The region's first word: `MPRING` and the layout version.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MPRING\0\x01");
/// The layout version in the header's second word.
pub const LAYOUT_VERSION: u64 = 1;
/// Words per 128-byte line (the control words of a ring each have a line of their own, so the
/// two processes never write the same line).
pub(crate) const LINE_WORDS: usize = 16;
/// Header words.
pub(crate) const HEADER_WORDS: usize = LINE_WORDS;
/// Control words per ring: head, tail, consumer waiting, producer waiting, a line each.
pub(crate) const CONTROL_WORDS: usize = 4 * LINE_WORDS;
/// Words of a slot before its payload: the sequence and the length.
pub(crate) const SLOT_HEADER_WORDS: usize = 2;
/// Fewest slots per ring.
pub const MIN_CAPACITY: u32 = 2;
/// Most slots per ring.
pub const MAX_CAPACITY: u32 = 1 << 16;
/// Smallest slot, in bytes (header included).
pub const MIN_SLOT_BYTES: u32 = 32;
/// Largest slot, in bytes (header included).
pub const MAX_SLOT_BYTES: u32 = 4096;
/// Page size the region's length is rounded to.
pub(crate) const PAGE: usize = 4096;

/// Which way a ring carries entries.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Direction {
    /// Ring 0: the exporter produces (buffers), the importer consumes.
    ToImporter,
    /// Ring 1: the importer produces (releases), the exporter consumes.
    ToExporter,
}

impl Direction {
    /// The ring's index in the region.
    pub fn index(self) -> usize {
        match self {
            Direction::ToImporter => 0,
            Direction::ToExporter => 1,
        }
    }

    /// The ring's name in errors.
    pub fn name(self) -> &'static str {
        match self {
            Direction::ToImporter => "to importer",
            Direction::ToExporter => "to exporter",
        }
    }
}

/// The shape of a region: both rings have `capacity` slots of `slot_bytes` bytes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Geometry {
    capacity: u32,
    slot_bytes: u32,
}

impl Default for Geometry {
    /// 256 slots of 256 bytes each way (about 130 KiB).
    fn default() -> Self {
        Geometry {
            capacity: 256,
            slot_bytes: 256,
        }
    }
}

impl Geometry {
    /// `capacity` slots per ring (a power of two, 2 to 65,536) of `slot_bytes` bytes each (a
    /// multiple of 8, 32 to 4,096, of which 16 are the slot's header).
    pub fn new(capacity: u32, slot_bytes: u32) -> RingResult<Geometry> {
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(RingError::Geometry {
                reason: format!("capacity {capacity} is not a power of two from {MIN_CAPACITY} to {MAX_CAPACITY}"),
            });
        }
        if !slot_bytes.is_multiple_of(8) || !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) {
            return Err(RingError::Geometry {
                reason: format!(
                    "slot size {slot_bytes} is not a multiple of 8 from {MIN_SLOT_BYTES} to {MAX_SLOT_BYTES}"
                ),
            });
        }
        Ok(Geometry { capacity, slot_bytes })
    }

    /// Slots per ring.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes per slot, header included.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// The most payload bytes a slot holds.
    pub fn max_payload(&self) -> usize {
        self.slot_bytes as usize - 8 * SLOT_HEADER_WORDS
    }

    /// Words per slot.
    pub(crate) fn slot_words(&self) -> usize {
        self.slot_bytes as usize / 8
    }

    /// The control words of `dir`'s ring start here.
    pub(crate) fn control(&self, dir: Direction) -> usize {
        HEADER_WORDS + dir.index() * CONTROL_WORDS
    }

    /// Word of the ring's head (written by its producer only).
    pub(crate) fn head(&self, dir: Direction) -> usize {
        self.control(dir)
    }

    /// Word of the ring's tail (written by its consumer only).
    pub(crate) fn tail(&self, dir: Direction) -> usize {
        self.control(dir) + LINE_WORDS
    }

    /// Word the ring's consumer sets before it sleeps waiting for entries.
    pub(crate) fn consumer_waiting(&self, dir: Direction) -> usize {
        self.control(dir) + 2 * LINE_WORDS
    }

    /// Word the ring's producer sets before it sleeps waiting for space.
    pub(crate) fn producer_waiting(&self, dir: Direction) -> usize {
        self.control(dir) + 3 * LINE_WORDS
    }

    /// First word of slot `index` (any index: it wraps) of `dir`'s ring.
    pub(crate) fn slot(&self, dir: Direction, index: u64) -> usize {
        let rings = HEADER_WORDS + 2 * CONTROL_WORDS;
        let ring = rings + dir.index() * self.capacity as usize * self.slot_words();
        // The capacity is a power of two: the mask keeps the slot inside the ring.
        ring + (index & u64::from(self.capacity - 1)) as usize * self.slot_words()
    }

    /// Words the layout uses.
    pub(crate) fn words(&self) -> usize {
        HEADER_WORDS + 2 * CONTROL_WORDS + 2 * self.capacity as usize * self.slot_words()
    }

    /// The region's length in bytes: the layout rounded up to whole pages.
    pub fn region_bytes(&self) -> usize {
        (self.words() * 8).div_ceil(PAGE) * PAGE
    }
}
