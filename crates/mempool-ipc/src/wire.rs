//! The wire protocol: message types and their exact byte layout.
//!
//! Everything here is a pure function over byte slices, so it can be fuzzed without sockets.
//! `docs/ipc-protocol.md` is the specification; this module is its implementation.
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

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// What the functions of this module return: a [`ProtocolError`] names what broke the rules.
type Result<T, E = ProtocolError> = std::result::Result<T, E>;

/// A frame or message that breaks the rules of the protocol: what decoding reports (and the
/// checks made before encoding, and a connection whose peer stopped inside a frame).
///
/// The crate's [`Error`](crate::Error) wraps it as `Error::Protocol`, with the same message.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A field breaks its rule (reserved bits, flags, sizes, offsets, UTF-8, all-zero ids), or
    /// the peer broke a rule that no more specific variant describes.
    #[error("protocol violation: {reason}")]
    Violation {
        /// What the peer did wrong.
        reason: String,
    },

    /// A frame did not start with the protocol's magic bytes: the peer does not speak this protocol.
    #[error("bad magic {got:02x?}: the peer does not speak the mempool IPC protocol")]
    BadMagic {
        /// The four bytes found where the magic should be.
        got: [u8; 4],
    },

    /// The peer speaks another version of the protocol.
    #[error("unsupported protocol version {got} (this side speaks version {supported})")]
    UnsupportedVersion {
        /// The version in the peer's frame.
        got: u16,
        /// The version this side speaks.
        supported: u16,
    },

    /// A frame carried a message type this version does not define.
    #[error("unknown message type {got}")]
    UnknownMessageType {
        /// The type code found in the frame header.
        got: u16,
    },

    /// A frame announced a body larger than any message may be.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// Input ended before the message did (in a byte slice, or the peer closed mid-message).
    #[error("truncated message: needed {needed} bytes, got {got}")]
    Truncated {
        /// How many bytes the message needs (as far as known when it ended).
        needed: usize,
        /// How many bytes there were.
        got: usize,
    },

    /// A frame's body length does not fit its message type.
    #[error("{message} message with a body of {got} bytes (allowed: {})", allowed_len(*.min, *.max))]
    BodyLength {
        /// The message type.
        message: MessageType,
        /// The smallest body the type allows.
        min: usize,
        /// The largest body the type allows.
        max: usize,
        /// The body length found.
        got: usize,
    },

    /// Bytes followed the end of a complete frame in a slice that should hold exactly one.
    #[error("{len} trailing bytes after a complete message")]
    TrailingBytes {
        /// How many bytes were left over.
        len: usize,
    },
}

fn allowed_len(min: usize, max: usize) -> String {
    if min == max {
        format!("exactly {min}")
    } else {
        format!("{min} to {max}")
    }
}

/// The four bytes every frame starts with.
pub(crate) const MAGIC: [u8; 4] = *b"MPIP";

/// The newest protocol version this crate speaks. Every frame carries the version that defines
/// its message type: the messages of version 1 travel in version-1 frames in every version, and
/// only the messages version 2 added ([`MessageType::Hello2`], [`MessageType::Welcome2`],
/// [`MessageType::ReleaseBatch`]) in version-2 frames. A version-1 peer therefore refuses a
/// version-2 `Hello2` with a clear `UnsupportedVersion` error, and a version-2 exporter answers a
/// version-1 `Hello` the version-1 way.
pub(crate) const PROTOCOL_VERSION: u16 = 2;

/// The oldest protocol version this crate speaks.
pub(crate) const MIN_PROTOCOL_VERSION: u16 = 1;

/// Capability bit (in `Hello2` and `Welcome2`): the fast release path. The importer keeps the
/// imports of blocks the exporter marks [`BUFFER_FLAG_KEEP_IMPORT`] for the connection's life,
/// and releases buffers in [`MessageType::ReleaseBatch`] messages ordered by an interprocess
/// event of its own instead of synchronizing; the exporter waits on that event (on the GPU)
/// before it frees or reuses the memory, and keeps every block such an importer imported
/// allocated until that importer's connection has ended and its process has freed its imports.
pub(crate) const CAP_FAST_RELEASE: u64 = 1;

/// Capability bit (in `Hello2` and `Welcome2`): VMM physical allocations (`cuMemCreate`) travel
/// as [`MessageType::VmmBuffer`] messages, one file descriptor each. An exporter sends them only
/// to an importer granted this bit.
pub(crate) const CAP_VMM: u64 = 1 << 1;

/// Every capability bit this crate knows.
pub(crate) const KNOWN_CAPABILITIES: u64 = CAP_FAST_RELEASE | CAP_VMM;

/// The most buffers one `ReleaseBatch` names.
pub(crate) const MAX_RELEASE_BATCH: usize = 64;

/// The length of a frame header.
pub(crate) const HEADER_LEN: usize = 12;

/// The longest text an `Error` message may carry, in bytes of UTF-8.
pub(crate) const MAX_ERROR_TEXT_LEN: usize = 1024;

/// The longest body any message may have (an `Error` message with the longest text).
pub(crate) const MAX_BODY_LEN: usize = ERROR_FIXED_LEN + MAX_ERROR_TEXT_LEN;

/// The longest frame, header included.
#[cfg(test)]
pub(crate) const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN;

/// The most file descriptors any message carries.
pub(crate) const MAX_FDS_PER_MESSAGE: usize = 1;

/// The value of the pool descriptor's handle-type field: the pool travels as a POSIX file
/// descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
pub(crate) const POOL_HANDLE_TYPE_POSIX_FD: u32 = 1;

/// Bit 0 of a buffer message's flags: the event handle is valid and the importer must wait on it.
pub(crate) const BUFFER_FLAG_READY_EVENT: u32 = 1;

/// Bit 1 of a buffer message's flags (only to an importer that negotiated [`CAP_FAST_RELEASE`]):
/// the importer may keep the block imported after it released the block's last buffer; the
/// exporter keeps the block allocated until this importer's connection is over.
pub(crate) const BUFFER_FLAG_KEEP_IMPORT: u32 = 2;

/// Bit 0 of a `ReleaseBatch`'s flags: the event handle is valid; the exporter orders the free or
/// reuse of every buffer in the batch after it.
pub(crate) const RELEASE_FLAG_EVENT: u32 = 1;

const UUID_LEN: usize = 16;
const WELCOME_LEN: usize = UUID_LEN + UUID_LEN;
const READY_LEN: usize = UUID_LEN;
const POOL_DESCRIPTOR_LEN: usize = UUID_LEN + 4 + 4;
const BUFFER_LEN: usize = 5 * 8 + 4 + 4 + 64 + 64;
const RELEASE_LEN: usize = 8;
const HELLO2_LEN: usize = 8;
const WELCOME2_LEN: usize = WELCOME_LEN + 8;
const RELEASE_BATCH_FIXED_LEN: usize = 4 + 4 + 64;
const ERROR_FIXED_LEN: usize = 4 + 2;

/// The UUID of a GPU (`cuDeviceGetUuid`): the same physical GPU has the same UUID in every
/// process, whatever its ordinal there.
///
/// Displayed the way `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeviceUuid(pub [u8; 16]);

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The identity of an exported pool, chosen by the exporter; never all zeros.
///
/// It lets an importer tell pools apart (and tell a restarted exporter from the one it knew).
/// It is not a secret and grants nothing: the socket is the gate.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId(pub [u8; 16]);

impl PoolId {
    /// A fresh id, unique on this host with overwhelming likelihood: the process id, the time
    /// and a per-process counter.
    pub fn generate() -> PoolId {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let pid = std::process::id() as u64;
        let hi = pid << 32 | (count & 0xffff_ffff);
        // The top bit keeps the id away from all zeros even if everything else is zero.
        let lo = nanos | 1 << 63;
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&hi.to_le_bytes());
        bytes[8..].copy_from_slice(&lo.to_le_bytes());
        PoolId(bytes)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolId({self})")
    }
}

/// The exporter's name for a shared buffer; unique per exporter.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BufferId(pub u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

impl From<u64> for BufferId {
    fn from(id: u64) -> Self {
        BufferId(id)
    }
}

/// The exporter's name for an exported block (one allocation from the pool that buffers may
/// be suballocated from); unique per exporter.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u64);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block#{}", self.0)
    }
}

impl From<u64> for BlockId {
    fn from(id: u64) -> Self {
        BlockId(id)
    }
}

/// The 64 opaque bytes `cuMemPoolExportPointer` writes for an allocation
/// (`CUmemPoolPtrExportData`); `cuMemPoolImportPointer` turns them back into a pointer in a
/// process that imported the pool.
///
/// They are not a capability: whoever holds the pool's file descriptor could guess them.
/// The socket, which hands out the pool, is the gate.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PointerDescriptor(pub(crate) [u8; 64]);

/// An interprocess event handle (`CUipcEventHandle`, from `cuIpcGetEventHandle`): the importer
/// opens it with `cuIpcOpenEventHandle` and makes its stream wait on it before first use.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct EventHandle(pub(crate) [u8; 64]);

/// The type of a message, as the frame header names it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u16)]
pub enum MessageType {
    /// Importer -> exporter: opens the conversation.
    Hello = 1,
    /// Exporter -> importer: the GPU and the pool.
    Welcome = 2,
    /// Importer -> exporter: the importer sees the GPU.
    Ready = 3,
    /// Exporter -> importer: the pool's file descriptor (one descriptor attached).
    PoolDescriptor = 4,
    /// Exporter -> importer: a shared buffer.
    Buffer = 5,
    /// Importer -> exporter: the importer is done with a buffer.
    Release = 6,
    /// Either way: the sender is done and closes the connection.
    Goodbye = 7,
    /// Either way: something went wrong; the sender closes the connection.
    Error = 8,
    /// Importer -> exporter (version 2): opens the conversation with the capabilities it asks for.
    Hello2 = 9,
    /// Exporter -> importer (version 2): the GPU, the pool and the capabilities granted.
    Welcome2 = 10,
    /// Importer -> exporter (version 2, with the fast release capability): several releases,
    /// ordered by one interprocess event.
    ReleaseBatch = 11,
    /// Exporter -> importer (version 2, only to an importer granted [`CAP_VMM`]): a VMM physical
    /// allocation (one descriptor attached). Codes 32 to 47 are kept for VMM messages.
    VmmBuffer = 32,
}

impl MessageType {
    /// Every message type, in wire order.
    pub(crate) const ALL: [MessageType; 12] = [
        MessageType::Hello,
        MessageType::Welcome,
        MessageType::Ready,
        MessageType::PoolDescriptor,
        MessageType::Buffer,
        MessageType::Release,
        MessageType::Goodbye,
        MessageType::Error,
        MessageType::Hello2,
        MessageType::Welcome2,
        MessageType::ReleaseBatch,
        MessageType::VmmBuffer,
    ];

    /// The type with this wire code, if the protocol defines one.
    pub fn from_wire(code: u16) -> Option<MessageType> {
        MessageType::ALL.into_iter().find(|t| t.to_wire() == code)
    }

    /// This type's wire code.
    pub fn to_wire(self) -> u16 {
        self as u16
    }

    /// The type's name, as the specification spells it.
    pub fn name(self) -> &'static str {
        match self {
            MessageType::Hello => "Hello",
            MessageType::Welcome => "Welcome",
            MessageType::Ready => "Ready",
            MessageType::PoolDescriptor => "PoolDescriptor",
            MessageType::Buffer => "Buffer",
            MessageType::Release => "Release",
            MessageType::Goodbye => "Goodbye",
            MessageType::Error => "Error",
            MessageType::Hello2 => "Hello2",
            MessageType::Welcome2 => "Welcome2",
            MessageType::ReleaseBatch => "ReleaseBatch",
            MessageType::VmmBuffer => "VmmBuffer",
        }
    }

    /// The protocol version that defines this type: frames of this type carry it, and a frame
    /// of this type with another version is refused.
    pub(crate) fn version(self) -> u16 {
        match self {
            MessageType::Hello2 | MessageType::Welcome2 | MessageType::ReleaseBatch | MessageType::VmmBuffer => 2,
            _ => 1,
        }
    }

    /// How many file descriptors travel with a message of this type (exactly that many).
    pub(crate) fn descriptor_count(self) -> usize {
        match self {
            MessageType::PoolDescriptor | MessageType::VmmBuffer => 1,
            _ => 0,
        }
    }

    /// The smallest and the largest body a message of this type may have.
    pub(crate) fn body_len_bounds(self) -> (usize, usize) {
        let exact = |n| (n, n);
        match self {
            MessageType::Hello | MessageType::Goodbye => exact(0),
            MessageType::Welcome => exact(WELCOME_LEN),
            MessageType::Ready => exact(READY_LEN),
            MessageType::PoolDescriptor => exact(POOL_DESCRIPTOR_LEN),
            MessageType::Buffer => exact(BUFFER_LEN),
            MessageType::Release => exact(RELEASE_LEN),
            MessageType::Error => (ERROR_FIXED_LEN, MAX_BODY_LEN),
            MessageType::Hello2 => exact(HELLO2_LEN),
            MessageType::Welcome2 => exact(WELCOME2_LEN),
            MessageType::ReleaseBatch => (
                RELEASE_BATCH_FIXED_LEN + 8,
                RELEASE_BATCH_FIXED_LEN + 8 * MAX_RELEASE_BATCH,
            ),
            MessageType::VmmBuffer => exact(VMM_BUFFER_LEN),
        }
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// ([`BUFFER_FLAG_KEEP_IMPORT`]; only with [`CAP_FAST_RELEASE`]).
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
        }
    }

    /// Checks every field against the rules of the protocol, the same checks decoding makes.
    pub(crate) fn validate(&self) -> Result<()> {
        match self {
            Message::Hello | Message::Goodbye | Message::Release { .. } | Message::Hello2 { .. } => Ok(()),
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
            Message::Error(e) => {
                if e.text.len() > MAX_ERROR_TEXT_LEN {
                    return Err(ProtocolError::MessageTooLarge {
                        len: ERROR_FIXED_LEN + e.text.len(),
                        max: MAX_BODY_LEN,
                    });
                }
                Ok(())
            }
        }
    }
}

fn protocol(reason: impl Into<String>) -> ProtocolError {
    ProtocolError::Violation { reason: reason.into() }
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

/// A decoded frame header.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Header {
    /// The frame's protocol version (the one its message type is defined in).
    pub(crate) version: u16,
    /// The message type.
    pub(crate) message_type: MessageType,
    /// The body's length, already checked against what the type allows.
    pub(crate) body_len: usize,
}

/// Decodes and checks the header at the start of `bytes` (which may go on past it).
pub(crate) fn decode_header(bytes: &[u8]) -> Result<Header> {
    let Some(header) = bytes.get(..HEADER_LEN) else {
        return Err(ProtocolError::Truncated {
            needed: HEADER_LEN,
            got: bytes.len(),
        });
    };
    let mut r = Reader::new(header);
    let magic: [u8; 4] = r.array()?;
    if magic != MAGIC {
        return Err(ProtocolError::BadMagic { got: magic });
    }
    let version = r.u16()?;
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
        return Err(ProtocolError::UnsupportedVersion {
            got: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let code = r.u16()?;
    // A type is known only in the frames of the version that defines it.
    let message_type = MessageType::from_wire(code)
        .filter(|t| t.version() == version)
        .ok_or(ProtocolError::UnknownMessageType { got: code })?;
    let body_len = r.u32()? as usize;
    if body_len > MAX_BODY_LEN {
        return Err(ProtocolError::MessageTooLarge {
            len: body_len,
            max: MAX_BODY_LEN,
        });
    }
    let (min, max) = message_type.body_len_bounds();
    if body_len < min || body_len > max {
        return Err(ProtocolError::BodyLength {
            message: message_type,
            min,
            max,
            got: body_len,
        });
    }
    Ok(Header {
        version,
        message_type,
        body_len,
    })
}

/// Decodes the body of a message of type `message_type`; `body` must be exactly the body.
pub(crate) fn decode_body(message_type: MessageType, body: &[u8]) -> Result<Message> {
    let (min, max) = message_type.body_len_bounds();
    if body.len() < min || body.len() > max {
        return Err(ProtocolError::BodyLength {
            message: message_type,
            min,
            max,
            got: body.len(),
        });
    }
    let mut r = Reader::new(body);
    let message = match message_type {
        MessageType::Hello => Message::Hello,
        MessageType::Goodbye => Message::Goodbye,
        MessageType::Welcome => Message::Welcome(Welcome {
            device_uuid: DeviceUuid(r.array()?),
            pool_id: PoolId(r.array()?),
        }),
        MessageType::Ready => Message::Ready(Ready {
            device_uuid: DeviceUuid(r.array()?),
        }),
        MessageType::PoolDescriptor => {
            let pool_id = PoolId(r.array()?);
            let handle_type = r.u32()?;
            if handle_type != POOL_HANDLE_TYPE_POSIX_FD {
                return Err(protocol(format!(
                    "pool handle type {handle_type} is not supported (only {POOL_HANDLE_TYPE_POSIX_FD}, a POSIX file descriptor)"
                )));
            }
            check_reserved(r.u32()?, "PoolDescriptor")?;
            Message::PoolDescriptor(PoolDescriptor { pool_id })
        }
        MessageType::Buffer => {
            let buffer_id = BufferId(r.u64()?);
            let block_id = BlockId(r.u64()?);
            let block_size = r.u64()?;
            let offset = r.u64()?;
            let size = r.u64()?;
            let flags = r.u32()?;
            check_reserved(r.u32()?, "Buffer")?;
            let pointer = PointerDescriptor(r.array()?);
            let event = r.array::<64>()?;
            if flags & !(BUFFER_FLAG_READY_EVENT | BUFFER_FLAG_KEEP_IMPORT) != 0 {
                return Err(protocol(format!("Buffer: unknown flag bits {flags:#x}")));
            }
            let ready_event = if flags & BUFFER_FLAG_READY_EVENT != 0 {
                Some(EventHandle(event))
            } else if event != [0; 64] {
                return Err(protocol("Buffer: event handle bytes without the ready-event flag"));
            } else {
                None
            };
            Message::Buffer(BufferDescriptor {
                buffer_id,
                block_id,
                block_size,
                offset,
                size,
                pointer,
                ready_event,
                keep_import: flags & BUFFER_FLAG_KEEP_IMPORT != 0,
            })
        }
        MessageType::Release => Message::Release {
            buffer_id: BufferId(r.u64()?),
        },
        MessageType::Hello2 => Message::Hello2 { capabilities: r.u64()? },
        MessageType::VmmBuffer => Message::VmmBuffer(decode_vmm_buffer(&mut r)?),
        MessageType::Welcome2 => Message::Welcome2 {
            welcome: Welcome {
                device_uuid: DeviceUuid(r.array()?),
                pool_id: PoolId(r.array()?),
            },
            capabilities: r.u64()?,
        },
        MessageType::ReleaseBatch => {
            let count = r.u32()? as usize;
            let flags = r.u32()?;
            let event = r.array::<64>()?;
            if flags & !RELEASE_FLAG_EVENT != 0 {
                return Err(protocol(format!("ReleaseBatch: unknown flag bits {flags:#x}")));
            }
            let event = if flags & RELEASE_FLAG_EVENT != 0 {
                Some(EventHandle(event))
            } else if event != [0; 64] {
                return Err(protocol("ReleaseBatch: event handle bytes without the event flag"));
            } else {
                None
            };
            if count.checked_mul(8) != Some(r.remaining()) {
                return Err(protocol(format!(
                    "ReleaseBatch: count field says {count} buffers, the body holds {} bytes of ids",
                    r.remaining()
                )));
            }
            let mut buffers = Vec::with_capacity(count);
            for _ in 0..count {
                buffers.push(BufferId(r.u64()?));
            }
            Message::ReleaseBatch(ReleaseBatch { event, buffers })
        }
        MessageType::Error => {
            let code = ErrorCode::from_wire(r.u32()?);
            let text_len = r.u16()? as usize;
            if text_len != r.remaining() {
                return Err(protocol(format!(
                    "Error: text length field says {text_len} bytes, the body holds {}",
                    r.remaining()
                )));
            }
            let text = std::str::from_utf8(r.bytes(text_len)?).map_err(|_| protocol("Error: text is not UTF-8"))?;
            Message::Error(ErrorMessage {
                code,
                text: text.to_owned(),
            })
        }
    };
    if r.remaining() != 0 {
        return Err(ProtocolError::TrailingBytes { len: r.remaining() });
    }
    message.validate()?;
    Ok(message)
}

fn check_reserved(value: u32, message: &str) -> Result<()> {
    if value != 0 {
        return Err(protocol(format!("{message}: reserved field is {value:#x}, must be 0")));
    }
    Ok(())
}

/// Decodes exactly one frame: `frame` must hold a whole frame and nothing after it.
#[cfg(test)]
pub(crate) fn decode(frame: &[u8]) -> Result<Message> {
    let header = decode_header(frame)?;
    let total = HEADER_LEN + header.body_len;
    if frame.len() < total {
        return Err(ProtocolError::Truncated {
            needed: total,
            got: frame.len(),
        });
    }
    if frame.len() > total {
        return Err(ProtocolError::TrailingBytes {
            len: frame.len() - total,
        });
    }
    decode_body(header.message_type, &frame[HEADER_LEN..])
}

/// Encodes `message` as one frame, after checking it with [`Message::validate`].
pub(crate) fn encode(message: &Message) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(HEADER_LEN + 64);
    encode_into(message, &mut out)?;
    Ok(out)
}

/// Appends the frame of `message` to `out`, after checking it with [`Message::validate`];
/// on error `out` is unchanged.
pub(crate) fn encode_into(message: &Message, out: &mut Vec<u8>) -> Result<()> {
    message.validate()?;
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&message.message_type().version().to_le_bytes());
    out.extend_from_slice(&message.message_type().to_wire().to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    let body_start = out.len();
    match message {
        Message::Hello | Message::Goodbye => {}
        Message::Welcome(w) => {
            out.extend_from_slice(&w.device_uuid.0);
            out.extend_from_slice(&w.pool_id.0);
        }
        Message::Ready(r) => out.extend_from_slice(&r.device_uuid.0),
        Message::PoolDescriptor(p) => {
            out.extend_from_slice(&p.pool_id.0);
            out.extend_from_slice(&POOL_HANDLE_TYPE_POSIX_FD.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        Message::Buffer(b) => {
            for field in [b.buffer_id.0, b.block_id.0, b.block_size, b.offset, b.size] {
                out.extend_from_slice(&field.to_le_bytes());
            }
            let mut flags = if b.ready_event.is_some() {
                BUFFER_FLAG_READY_EVENT
            } else {
                0
            };
            if b.keep_import {
                flags |= BUFFER_FLAG_KEEP_IMPORT;
            }
            out.extend_from_slice(&flags.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&b.pointer.0);
            out.extend_from_slice(&b.ready_event.map_or([0; 64], |e| e.0));
        }
        Message::Release { buffer_id } => out.extend_from_slice(&buffer_id.0.to_le_bytes()),
        Message::Hello2 { capabilities } => out.extend_from_slice(&capabilities.to_le_bytes()),
        Message::VmmBuffer(b) => encode_vmm_buffer(b, out),
        Message::Welcome2 { welcome, capabilities } => {
            out.extend_from_slice(&welcome.device_uuid.0);
            out.extend_from_slice(&welcome.pool_id.0);
            out.extend_from_slice(&capabilities.to_le_bytes());
        }
        Message::ReleaseBatch(b) => {
            // `validate` bounded the count.
            out.extend_from_slice(&(b.buffers.len() as u32).to_le_bytes());
            let flags = if b.event.is_some() { RELEASE_FLAG_EVENT } else { 0 };
            out.extend_from_slice(&flags.to_le_bytes());
            out.extend_from_slice(&b.event.map_or([0; 64], |e| e.0));
            for id in &b.buffers {
                out.extend_from_slice(&id.0.to_le_bytes());
            }
        }
        Message::Error(e) => {
            out.extend_from_slice(&e.code.to_wire().to_le_bytes());
            // `validate` bounded the text, so the length fits in u16.
            out.extend_from_slice(&(e.text.len() as u16).to_le_bytes());
            out.extend_from_slice(e.text.as_bytes());
        }
    }
    let body_len = out.len() - body_start;
    debug_assert!(body_len <= MAX_BODY_LEN);
    out[start + 8..start + 12].copy_from_slice(&(body_len as u32).to_le_bytes());
    Ok(())
}

/// A cursor over a byte slice whose reads fail (never panic) past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(ProtocolError::Truncated {
                needed: self.pos.saturating_add(n),
                got: self.bytes.len(),
            });
        };
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

// ---- VMM sharing: the VmmBuffer message ----
//
// The protocol's addition for VMM sharing: the `VmmBuffer` message (a version-2 frame) that
// hands over one physical allocation (`cuMemCreate`) as a file descriptor, sent only to an
// importer granted [`CAP_VMM`] in the `Hello2`/`Welcome2` handshake.
//
// ```text
// VmmBuffer body (96 bytes), one file descriptor attached (SCM_RIGHTS)
// offset  size  field
//      0     8  buffer id     u64, named by Release like any buffer
//      8     8  size          u64, the allocation's size: a non-zero multiple of granularity
//     16     8  granularity   u64, the exporter's minimum granularity: a power of two
//     24     4  flags         u32, bit 0: the ready event is valid; other bits must be 0
//     28     4  handle type   u32, 1: a POSIX file descriptor
//     32    64  ready event   CUipcEventHandle, all zeros without flag bit 0
// ```

/// The handle-type field's value for a POSIX file descriptor
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
pub(crate) const VMM_HANDLE_TYPE_POSIX_FD: u32 = 1;

/// Bit 0 of a `VmmBuffer`'s flags: the event handle is valid and the importer must wait on it.
pub(crate) const VMM_FLAG_READY_EVENT: u32 = 1;

/// The body length of a `VmmBuffer` message.
pub(crate) const VMM_BUFFER_LEN: usize = 3 * 8 + 4 + 4 + 64;

/// A physical allocation handed to an importer; its file descriptor travels with the message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct VmmBufferDescriptor {
    /// The buffer's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// The allocation's size in bytes: a non-zero multiple of `granularity`.
    pub(crate) size: u64,
    /// The exporter's minimum granularity for the allocation's properties: a power of two. The
    /// importer refuses a value that is not its own device's.
    pub(crate) granularity: u64,
    /// The event to wait on before first use, recorded after the exporter's work on the memory.
    /// `None`: the exporter synchronized before sending.
    pub(crate) ready_event: Option<EventHandle>,
}

/// The checks decoding (and encoding) makes on a `VmmBuffer`.
pub(crate) fn check_vmm_buffer(b: &VmmBufferDescriptor) -> Result<()> {
    let id = b.buffer_id;
    if b.granularity == 0 || !b.granularity.is_power_of_two() {
        return Err(protocol(format!(
            "VmmBuffer {id}: granularity {} is not a power of two",
            b.granularity
        )));
    }
    if b.size == 0 {
        return Err(protocol(format!("VmmBuffer {id}: size is 0")));
    }
    if !b.size.is_multiple_of(b.granularity) {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} is not a multiple of the granularity {}",
            b.size, b.granularity
        )));
    }
    if usize::try_from(b.size).is_err() {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} does not fit this machine's addresses",
            b.size
        )));
    }
    Ok(())
}

/// Decodes a `VmmBuffer` body from `r` (its length already checked).
fn decode_vmm_buffer(r: &mut Reader<'_>) -> Result<VmmBufferDescriptor> {
    let buffer_id = BufferId(r.u64()?);
    let size = r.u64()?;
    let granularity = r.u64()?;
    let flags = r.u32()?;
    let handle_type = r.u32()?;
    let event = r.array::<64>()?;
    if flags & !VMM_FLAG_READY_EVENT != 0 {
        return Err(protocol(format!("VmmBuffer: unknown flag bits {flags:#x}")));
    }
    if handle_type != VMM_HANDLE_TYPE_POSIX_FD {
        return Err(protocol(format!(
            "VmmBuffer: handle type {handle_type} is not supported (only {VMM_HANDLE_TYPE_POSIX_FD}, a POSIX file descriptor)"
        )));
    }
    let ready_event = if flags & VMM_FLAG_READY_EVENT != 0 {
        Some(EventHandle(event))
    } else if event != [0; 64] {
        return Err(protocol("VmmBuffer: event handle bytes without the ready-event flag"));
    } else {
        None
    };
    Ok(VmmBufferDescriptor {
        buffer_id,
        size,
        granularity,
        ready_event,
    })
}

/// Appends a `VmmBuffer` body to `out`.
fn encode_vmm_buffer(b: &VmmBufferDescriptor, out: &mut Vec<u8>) {
    for field in [b.buffer_id.0, b.size, b.granularity] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    let flags = if b.ready_event.is_some() {
        VMM_FLAG_READY_EVENT
    } else {
        0
    };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&VMM_HANDLE_TYPE_POSIX_FD.to_le_bytes());
    out.extend_from_slice(&b.ready_event.map_or([0; 64], |e| e.0));
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod vmm_tests;
