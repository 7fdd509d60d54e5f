//! The wire protocol: message types and their exact byte layout.
//!
//! Everything here is a pure function over byte slices, so it can be fuzzed without sockets.
//! `docs/ipc-protocol.md` is the specification; this module and its submodules are its
//! implementation, split by concern, each layer importing only those before it:
//!
//! - `ids`: the names the protocol gives to things ([`DeviceUuid`], [`PoolId`], [`BufferId`],
//!   [`BlockId`], exported pointers, event handles) and [`MessageType`]; imports nothing;
//! - `error`: [`ProtocolError`];
//! - `vmm`: the `VmmBuffer` descriptor (a VMM physical allocation) and the `VmmChunks` one (a
//!   range over several), their layouts and their checks;
//! - `messages`: [`Message`] and its bodies, [`ErrorCode`], the limits and capability bits, and
//!   [`Message::validate`];
//! - `codec`: the frame header, every body's bytes, [`encode`] and [`decode_header`] /
//!   [`decode_body`].
//!
//! This module re-exports what the rest of the crate uses, so callers name `crate::protocol::X`
//! whichever submodule defines it.
//!
//! A frame is a 12-byte [header](Header) followed by a body whose length the header gives:
//!
//! ```text
//! offset  size  field
//!      0     4  magic        b"MPIP"
//!      4     2  version      u16 little-endian, PROTOCOL_VERSION
//!      6     2  type         u16 little-endian, MessageType
//!      8     4  body length  u32 little-endian, at most MAX_BODY_LEN
//!     12     n  body
//! ```
//!
//! Decoding checks every field: magic, version, type, the body length against what the type
//! allows, every reserved field (zero), every flag bit, the ranges of sizes and offsets, the
//! UTF-8 of error text. A slice that holds more than one frame is an error too. Every failure
//! is a [`ProtocolError`].
//!
//! The crate root re-exports the types a user meets in errors and in the exporter's and
//! importer's API ([`DeviceUuid`], [`PoolId`], [`BufferId`], [`BlockId`], [`MessageType`],
//! [`ErrorCode`], [`ProtocolError`]); the rest is the crate's own. The tests (`wire/tests.rs`)
//! round-trip every message, try every malformed input and fuzz the decoder; `wire/testing.rs`
//! holds the fixtures the other modules' tests share.

mod codec;
mod error;
mod ids;
mod messages;
mod vmm;

pub(crate) use codec::{
    decode, decode_body, decode_header, encode, Header, BUFFER_FRAME_LEN, HEADER_LEN, MAX_FDS_PER_MESSAGE,
    RELEASE_BATCH_FRAME_FIXED_LEN,
};
pub use error::ProtocolError;
pub use ids::{BlockId, BufferId, DeviceUuid, MessageType, PoolId, MAX_VMM_CHUNKS};
pub(crate) use ids::{EventHandle, PointerDescriptor};
pub use messages::ErrorCode;
pub(crate) use messages::{
    BufferDescriptor, ErrorMessage, Message, PoolDescriptor, Ready, ReleaseBatch, Welcome, CAP_FAST_RELEASE, CAP_RING,
    CAP_VMM, CAP_VMM_CHUNKS, KNOWN_CAPABILITIES, MAX_RELEASE_BATCH,
};
pub(crate) use vmm::{check_vmm_chunks, VmmBufferDescriptor, VmmChunksDescriptor};

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod vmm_tests;
