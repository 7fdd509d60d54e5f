//! Single-producer single-consumer rings in pages shared by two processes, built to be written
//! by a hostile peer.
//!
//! A [`Region`] is a sealed memfd holding two rings of fixed-size slots, one each way
//! ([`Direction`]), in the layout of [`Geometry`] (`ring/layout.rs` draws it). One process
//! creates it and passes the descriptor (`SCM_RIGHTS`); the other maps it with
//! [`Region::open`], which checks the seals, the header and the length. Each ring has one
//! [`Producer`] and one [`Consumer`], in different processes:
//!
//! ```
//! use std::sync::Arc;
//! use mempool_ipc::ring::{Consumer, Direction, Geometry, Producer, Region};
//!
//! # fn main() -> Result<(), mempool_ipc::ring::RingError> {
//! let region = Arc::new(Region::create(Geometry::new(8, 64)?)?);
//! let mut tx = Producer::new(region.clone(), Direction::ToExporter);
//! let mut rx = Consumer::new(region.clone(), Direction::ToExporter);
//! assert!(tx.push(b"release 7")?);
//! assert!(tx.push(b"release 9")?);
//! if tx.publish() {
//!     tx.wake_consumer(); // only when the consumer sleeps
//! }
//! let mut buf = vec![0u8; region.geometry().max_payload()];
//! let len = rx.pop(&mut buf)?.unwrap();
//! assert_eq!(&buf[..len], b"release 7");
//! assert_eq!(rx.pop(&mut buf)?, Some(9));
//! assert_eq!(rx.pop(&mut buf)?, None);
//! rx.publish(); // the two slots are the producer's again
//! # Ok(()) }
//! ```
//!
//! **Doorbell.** Entries cost no system call while both sides are busy. A side about to sleep
//! sets its waiting flag in the shared pages and re-checks the ring ([`Consumer::sleep_begin`],
//! [`Producer::sleep_begin`]); the other side, after publishing, swaps the flag back to 0 and
//! rings only if it was set ([`Producer::publish`] returns whether to). The flags are futex
//! words: [`Consumer::wait`] sleeps on its flag with a time limit and
//! [`Producer::wake_consumer`] wakes it; a side that sleeps elsewhere (an `epoll` loop) rings its
//! own way and only uses the flag protocol.
//!
//! **Hostile peers.** Every index, sequence and length read from the shared pages is checked
//! (`ring/spsc.rs` lists the rules); a violation is [`RingError::Corrupt`] and the end stays
//! broken. No index read from the pages is used to address memory (slots are addressed from
//! this side's own index), so nothing is read out of bounds; waking never blocks and waiting
//! is bounded, so a peer cannot hold this side; a consumer that stops taking entries is found
//! by [`Producer::check_stall`]. What an entry's payload says (ids, lengths) is the caller's to
//! check.

mod error;
mod futex;
mod layout;
#[cfg(all(test, loom))]
mod loom_tests;
mod region;
mod spsc;
mod sync;
#[cfg(test)]
mod tests;

pub use self::error::{RingError, RingResult};
pub(crate) use self::layout::SLOT_HEADER_WORDS;
pub use self::layout::{
    Direction, Geometry, LAYOUT_VERSION, MAGIC, MAX_CAPACITY, MAX_SLOT_BYTES, MIN_CAPACITY, MIN_SLOT_BYTES,
};
pub use self::region::Region;
pub use self::spsc::{Consumer, Producer};
