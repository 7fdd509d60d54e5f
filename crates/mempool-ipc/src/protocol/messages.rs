//! The messages of the protocol as values ([`Message`] and its bodies), the limits and
//! capability bits they obey, and [`Message::validate`], the checks decoding and encoding share.

use std::fmt;

use super::error::{protocol, ProtocolError, Result};
use super::ids::{BlockId, BufferId, DeviceUuid, EventHandle, MessageType, PointerDescriptor, PoolId};
use super::vmm::{check_vmm_buffer, check_vmm_chunks, VmmBufferDescriptor, VmmChunksDescriptor, VMM_CHUNKS_MAX_LEN};

/// Capability bit (in `Hello2` and `Welcome2`): the fast release path. The importer keeps the
/// imports of blocks the exporter marks
/// [`BUFFER_FLAG_KEEP_IMPORT`](super::codec::BUFFER_FLAG_KEEP_IMPORT) for the connection's life,
/// and releases buffers in [`MessageType::ReleaseBatch`] messages ordered by an interprocess
/// event of its own instead of synchronizing; the exporter waits on that event (on the GPU)
/// before it frees or reuses the memory, and keeps every block such an importer imported
/// allocated until that importer's connection has ended and its process has freed its imports.
pub(crate) const CAP_FAST_RELEASE: u64 = 1;

/// Capability bit (in `Hello2` and `Welcome2`): VMM physical allocations (`cuMemCreate`) travel
/// as [`MessageType::VmmBuffer`] messages, one file descriptor each. An exporter sends them only
/// to an importer granted this bit.
pub(crate) const CAP_VMM: u64 = 1 << 1;

/// Capability bit (in `Hello2` and `Welcome2`): ranges over several VMM physical allocations
/// (the chunks of a growable reservation, such as a service resource's) travel as
/// [`MessageType::VmmChunks`] messages, one file descriptor per chunk. An exporter sends them
/// only to an importer granted this bit.
pub(crate) const CAP_VMM_CHUNKS: u64 = 1 << 2;

/// Capability bit (in `Hello2` and `Welcome2`), "protocol version 3": after the handshake the
/// exporter sends [`MessageType::RingSetup`] with a sealed memfd holding one shared-memory ring
/// each way (`mempool_ipc::ring`), and from then on `Buffer` frames may travel in the ring to
/// the importer and `Release`/`ReleaseBatch` frames in the ring to the exporter, the socket
/// keeping everything else. Granted only with [`CAP_FAST_RELEASE`].
pub(crate) const CAP_RING: u64 = 1 << 3;

/// Every capability bit this crate knows.
pub(crate) const KNOWN_CAPABILITIES: u64 = CAP_FAST_RELEASE | CAP_VMM | CAP_VMM_CHUNKS | CAP_RING;

/// The most buffers one `ReleaseBatch` names.
pub(crate) const MAX_RELEASE_BATCH: usize = 64;

/// The longest text an `Error` message may carry, in bytes of UTF-8.
pub(crate) const MAX_ERROR_TEXT_LEN: usize = 1024;

/// The longest body any message may have: a `VmmChunks` over the most chunks (1132 bytes), longer
/// than an `Error` with the longest text ([`ERROR_MAX_LEN`]).
pub(crate) const MAX_BODY_LEN: usize = if VMM_CHUNKS_MAX_LEN > ERROR_MAX_LEN {
    VMM_CHUNKS_MAX_LEN
} else {
    ERROR_MAX_LEN
};

/// The longest `Error` body: one with the longest text.
pub(crate) const ERROR_MAX_LEN: usize = ERROR_FIXED_LEN + MAX_ERROR_TEXT_LEN;

/// The fixed part of an `Error` body: the code (u32) and the text's length (u16).
pub(crate) const ERROR_FIXED_LEN: usize = 4 + 2;

/// What the exporter announces after `Hello`: its GPU and its pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Welcome {
    /// The GPU the pool lives on; the importer must see it too.
    pub(crate) device_uuid: DeviceUuid,
    /// The pool's identity.
    pub(crate) pool_id: PoolId,
}

/// The importer's answer to `Welcome`: it found the GPU.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Ready {
    /// The GPU the importer will import on; must equal the `Welcome`'s.
    pub(crate) device_uuid: DeviceUuid,
}

/// The pool itself; its file descriptor travels with this message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct PoolDescriptor {
    /// The pool's identity; must equal the `Welcome`'s.
    pub(crate) pool_id: PoolId,
}

/// A shared buffer: `size` bytes at `offset` inside an exported block.
///
/// A buffer that is a whole allocation is a block of its own at offset 0. Buffers suballocated
/// from one larger allocation name the same block, whose pointer was exported once; the
/// importer imports each block once and adds the offset.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct BufferDescriptor {
    /// The buffer's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// The block the buffer lives in.
    pub(crate) block_id: BlockId,
    /// The block's size in bytes; never 0.
    pub(crate) block_size: u64,
    /// Where the buffer starts in the block.
    pub(crate) offset: u64,
    /// The buffer's size in bytes; never 0, and `offset + size <= block_size`.
    pub(crate) size: u64,
    /// The block's exported pointer.
    pub(crate) pointer: PointerDescriptor,
    /// The event to wait on before first use, recorded after the exporter's allocation and
    /// work on the buffer. `None`: the exporter synchronized before sending, no wait is needed.
    pub(crate) ready_event: Option<EventHandle>,
    /// The importer may keep the block imported after its last buffer here is released
    /// ([`BUFFER_FLAG_KEEP_IMPORT`](super::codec::BUFFER_FLAG_KEEP_IMPORT); only with
    /// [`CAP_FAST_RELEASE`]).
    pub(crate) keep_import: bool,
}

/// The code of an `Error` message.
///
/// Codes this version does not know decode as [`ErrorCode::Other`], so that a newer peer's
/// explanation still reaches the user.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ErrorCode {
    /// A malformed, unexpected or out-of-order message.
    Protocol,
    /// The peer speaks another version.
    UnsupportedVersion,
    /// The importer does not see the exporter's GPU.
    WrongDevice,
    /// The connecting user is not allowed.
    PermissionDenied,
    /// A step of the conversation took too long.
    Timeout,
    /// A release named a buffer the exporter does not know.
    UnknownBuffer,
    /// A release named a buffer this importer does not hold (a double release).
    NotLeased,
    /// The sender failed for a reason of its own.
    Internal,
    /// The exporter is shutting down.
    ShuttingDown,
    /// A code this version does not define.
    Other(u32),
}

impl ErrorCode {
    /// The code's wire value.
    pub fn to_wire(self) -> u32 {
        match self {
            ErrorCode::Protocol => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::WrongDevice => 3,
            ErrorCode::PermissionDenied => 4,
            ErrorCode::Timeout => 5,
            ErrorCode::UnknownBuffer => 6,
            ErrorCode::NotLeased => 7,
            ErrorCode::Internal => 8,
            ErrorCode::ShuttingDown => 9,
            ErrorCode::Other(code) => code,
        }
    }

    /// The code with this wire value.
    pub fn from_wire(code: u32) -> ErrorCode {
        match code {
            1 => ErrorCode::Protocol,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::WrongDevice,
            4 => ErrorCode::PermissionDenied,
            5 => ErrorCode::Timeout,
            6 => ErrorCode::UnknownBuffer,
            7 => ErrorCode::NotLeased,
            8 => ErrorCode::Internal,
            9 => ErrorCode::ShuttingDown,
            other => ErrorCode::Other(other),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::Other(code) => write!(f, "code {code}"),
            known => write!(f, "{known:?}"),
        }
    }
}

/// The body of an `Error` message.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct ErrorMessage {
    /// What kind of error.
    pub(crate) code: ErrorCode,
    /// A human-readable explanation, at most [`MAX_ERROR_TEXT_LEN`] bytes.
    pub(crate) text: String,
}

impl ErrorMessage {
    /// An error message; text longer than [`MAX_ERROR_TEXT_LEN`] bytes is cut at a character
    /// boundary.
    pub(crate) fn new(code: ErrorCode, text: impl Into<String>) -> ErrorMessage {
        let mut text = text.into();
        if text.len() > MAX_ERROR_TEXT_LEN {
            let mut end = MAX_ERROR_TEXT_LEN;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        ErrorMessage { code, text }
    }
}

/// One message of the protocol.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum Message {
    /// Importer -> exporter, first message.
    Hello,
    /// Exporter -> importer, answer to `Hello`.
    Welcome(Welcome),
    /// Importer -> exporter, answer to `Welcome`.
    Ready(Ready),
    /// Exporter -> importer, answer to `Ready`; carries the pool's file descriptor.
    PoolDescriptor(PoolDescriptor),
    /// Exporter -> importer: a shared buffer.
    Buffer(BufferDescriptor),
    /// Importer -> exporter: the importer has freed its import of this buffer.
    Release {
        /// The buffer released.
        buffer_id: BufferId,
    },
    /// Either way: the sender is done; from the importer it also means every buffer it held
    /// is released.
    Goodbye,
    /// Either way: an error; the sender closes the connection.
    Error(ErrorMessage),
    /// Importer -> exporter (version 2), first message: `Hello` with the capabilities asked for.
    Hello2 {
        /// Capability bits (`CAP_*`); unknown bits are allowed (a newer importer) and not granted.
        capabilities: u64,
    },
    /// Exporter -> importer (version 2), answer to `Hello2`.
    Welcome2 {
        /// The GPU and the pool, as in `Welcome`.
        welcome: Welcome,
        /// The capabilities granted: a subset of those asked for.
        capabilities: u64,
    },
    /// Importer -> exporter (version 2, [`CAP_FAST_RELEASE`]): the importer is done with these
    /// buffers; their use on its GPU is ordered before `event` (if any).
    ReleaseBatch(ReleaseBatch),
    /// Exporter -> importer (version 2, [`CAP_VMM`]): a VMM physical allocation; carries its
    /// file descriptor.
    VmmBuffer(VmmBufferDescriptor),
    /// Exporter -> importer (version 2, [`CAP_VMM_CHUNKS`]): a range over several VMM physical
    /// allocations of the sizes it gives; carries one file descriptor per chunk.
    VmmChunks(VmmChunksDescriptor),
    /// Exporter -> importer (version 2, [`CAP_RING`]): the rings; carries their memfd.
    RingSetup,
    /// Importer -> exporter (version 2, [`CAP_RING`]): the doorbell of the exporter's ring.
    RingBell,
}

/// Several releases in one message: 1 to [`MAX_RELEASE_BATCH`] buffers, and the interprocess
/// event (of the importer) recorded after every use of them.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct ReleaseBatch {
    /// The event to order the frees after; `None`: the importer synchronized.
    pub(crate) event: Option<EventHandle>,
    /// The buffers released.
    pub(crate) buffers: Vec<BufferId>,
}

impl Message {
    /// The message's type.
    pub(crate) fn message_type(&self) -> MessageType {
        match self {
            Message::Hello => MessageType::Hello,
            Message::Welcome(_) => MessageType::Welcome,
            Message::Ready(_) => MessageType::Ready,
            Message::PoolDescriptor(_) => MessageType::PoolDescriptor,
            Message::Buffer(_) => MessageType::Buffer,
            Message::Release { .. } => MessageType::Release,
            Message::Goodbye => MessageType::Goodbye,
            Message::Error(_) => MessageType::Error,
            Message::Hello2 { .. } => MessageType::Hello2,
            Message::Welcome2 { .. } => MessageType::Welcome2,
            Message::ReleaseBatch(_) => MessageType::ReleaseBatch,
            Message::VmmBuffer(_) => MessageType::VmmBuffer,
            Message::VmmChunks(_) => MessageType::VmmChunks,
            Message::RingSetup => MessageType::RingSetup,
            Message::RingBell => MessageType::RingBell,
        }
    }

    /// How many file descriptors travel with this message (exactly that many): the type's
    /// [`max_descriptors`](MessageType::max_descriptors), except for `VmmChunks`, which carries
    /// one per chunk.
    pub(crate) fn descriptor_count(&self) -> usize {
        match self {
            Message::VmmChunks(c) => c.count(),
            other => other.message_type().max_descriptors(),
        }
    }

    /// Checks every field against the rules of the protocol, the same checks decoding makes.
    pub(crate) fn validate(&self) -> Result<()> {
        match self {
            Message::Hello
            | Message::Goodbye
            | Message::Release { .. }
            | Message::Hello2 { .. }
            | Message::RingSetup
            | Message::RingBell => Ok(()),
            Message::Welcome(w) | Message::Welcome2 { welcome: w, .. } => {
                check_uuid(&w.device_uuid)?;
                check_pool_id(&w.pool_id)
            }
            Message::ReleaseBatch(b) => {
                if b.buffers.is_empty() || b.buffers.len() > MAX_RELEASE_BATCH {
                    return Err(protocol(format!(
                        "ReleaseBatch: {} buffers (allowed: 1 to {MAX_RELEASE_BATCH})",
                        b.buffers.len()
                    )));
                }
                Ok(())
            }
            Message::Ready(r) => check_uuid(&r.device_uuid),
            Message::PoolDescriptor(p) => check_pool_id(&p.pool_id),
            Message::Buffer(b) => check_buffer(b),
            Message::VmmBuffer(b) => check_vmm_buffer(b),
            Message::VmmChunks(c) => check_vmm_chunks(c),
            Message::Error(e) => {
                if e.text.len() > MAX_ERROR_TEXT_LEN {
                    return Err(ProtocolError::MessageTooLarge {
                        len: ERROR_FIXED_LEN + e.text.len(),
                        max: ERROR_MAX_LEN,
                    });
                }
                Ok(())
            }
        }
    }
}

fn check_uuid(uuid: &DeviceUuid) -> Result<()> {
    if uuid.0 == [0; 16] {
        return Err(protocol("device UUID is all zeros"));
    }
    Ok(())
}

fn check_pool_id(id: &PoolId) -> Result<()> {
    if id.0 == [0; 16] {
        return Err(protocol("pool id is all zeros"));
    }
    Ok(())
}

fn check_buffer(b: &BufferDescriptor) -> Result<()> {
    if b.block_size == 0 {
        return Err(protocol(format!("buffer {}: block size is 0", b.buffer_id)));
    }
    if b.size == 0 {
        return Err(protocol(format!("buffer {}: size is 0", b.buffer_id)));
    }
    match b.offset.checked_add(b.size) {
        Some(end) if end <= b.block_size => Ok(()),
        _ => Err(protocol(format!(
            "buffer {}: {} bytes at offset {} do not fit in a block of {} bytes",
            b.buffer_id, b.size, b.offset, b.block_size
        ))),
    }
}
