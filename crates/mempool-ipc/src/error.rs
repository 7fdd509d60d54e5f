//! The crate's one error type.

use std::io;
use std::path::PathBuf;

use crate::lease::ImporterId;
use crate::wire::{BufferId, DeviceUuid, ErrorCode, MessageType};

/// A specialized [`Result`](std::result::Result) for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while sharing pools and buffers between processes.
///
/// Every variant names its cause. After any error that [`Connection`](crate::Connection) reports
/// while a message was half read or half written, or that reports a malformed or unexpected
/// message, the connection is closed: later calls on it return [`Error::ConnectionFailed`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer broke a rule of the protocol that no more specific variant describes.
    #[error("protocol violation: {reason}")]
    Protocol {
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

    /// The exporter's pool lives on another GPU than the importer uses.
    #[error("wrong device: expected GPU {expected_uuid}, the peer uses GPU {got}")]
    WrongDevice {
        /// The UUID this side expected.
        expected_uuid: DeviceUuid,
        /// The UUID the peer announced.
        got: DeviceUuid,
    },

    /// The exporter's GPU is not visible to this process (check `CUDA_VISIBLE_DEVICES`).
    #[error("GPU {uuid} of the exporter is not visible to this process")]
    DeviceNotVisible {
        /// The UUID the exporter announced.
        uuid: DeviceUuid,
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

    /// A valid message arrived at a point of the conversation where it is not allowed.
    #[error("unexpected message: expected {expected}, got {got}")]
    UnexpectedMessage {
        /// What the protocol allows at this point.
        expected: &'static str,
        /// What arrived.
        got: MessageType,
    },

    /// A message came with the wrong number of file descriptors (they have all been closed).
    #[error("wrong number of file descriptors: expected {expected}, got {got}")]
    DescriptorCount {
        /// How many the message type carries.
        expected: usize,
        /// How many arrived or were supplied.
        got: usize,
    },

    /// The connecting process runs as a user the access policy does not allow.
    #[error("peer process {pid} runs as uid {uid}, which the access policy does not allow")]
    PeerCredentials {
        /// The peer's effective user id (`SO_PEERCRED`).
        uid: u32,
        /// The peer's process id.
        pid: i32,
    },

    /// The peer did not complete a step in time.
    #[error("timed out during {during}")]
    Timeout {
        /// The step that timed out.
        during: &'static str,
    },

    /// The peer sent an `Error` message; it closes the connection after that.
    #[error("the peer reported an error ({code}): {text}")]
    Remote {
        /// The peer's error code.
        code: ErrorCode,
        /// The peer's explanation.
        text: String,
    },

    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,

    /// This side already closed its sending direction (it said `Goodbye`).
    #[error("this side already said Goodbye and sends nothing more")]
    WriteClosed,

    /// The connection was closed after an earlier error; open a new one.
    #[error("the connection was closed after an earlier error")]
    ConnectionFailed,

    /// The socket path cannot be used.
    #[error("socket path {}: {reason}", path.display())]
    SocketPath {
        /// The path.
        path: PathBuf,
        /// Why it cannot be used.
        reason: &'static str,
    },

    /// A buffer id was registered twice.
    #[error("buffer {buffer} is already registered")]
    DuplicateBuffer {
        /// The buffer.
        buffer: BufferId,
    },

    /// A buffer id that is not registered (never was, or was already freed).
    #[error("unknown buffer {buffer}")]
    UnknownBuffer {
        /// The buffer.
        buffer: BufferId,
    },

    /// The buffer was already shared with this importer.
    #[error("buffer {buffer} is already leased to importer {importer}")]
    AlreadyLeased {
        /// The buffer.
        buffer: BufferId,
        /// The importer.
        importer: ImporterId,
    },

    /// Release of a buffer the importer does not hold (for example a double release).
    #[error("importer {importer} does not hold buffer {buffer}")]
    NotLeased {
        /// The buffer.
        buffer: BufferId,
        /// The importer.
        importer: ImporterId,
    },

    /// The exporter already gave the buffer up: it may not be shared or given up again.
    #[error("buffer {buffer} was already released by its owner")]
    BufferRetired {
        /// The buffer.
        buffer: BufferId,
    },

    /// A CUDA driver call failed (importing or exporting the pool or a pointer, an event, a copy).
    #[error("CUDA: {0}")]
    Core(#[from] mempool_core::Error),

    /// The exporter is gone: it said `Goodbye` (it is shutting down), closed the connection, or its
    /// process died. Nothing more will arrive on this connection; buffers already received stay
    /// usable until they are dropped (see `docs/ipc.md` for what the driver does when the exporting
    /// process dies).
    #[error("the exporter is gone: it {how}; buffers already received stay usable until dropped")]
    ExporterGone {
        /// What happened: `"said Goodbye"`, `"closed the connection"`, ...
        how: &'static str,
    },

    /// No importer with this id is connected (it never was, or its connection closed).
    #[error("importer {importer} is not connected")]
    UnknownImporter {
        /// The importer.
        importer: ImporterId,
    },

    /// Sharing a buffer with one importer failed; the lease was revoked, so the buffer does not
    /// count as held by it.
    #[error("sharing buffer {buffer} with importer {importer} failed: {source}")]
    Share {
        /// The buffer.
        buffer: BufferId,
        /// The importer.
        importer: ImporterId,
        /// Why.
        source: Box<Error>,
    },

    /// A pointer cannot be shared: it is not inside a live allocation of the exporter's pool, or
    /// its range does not fit in that allocation.
    #[error("address {ptr:#x} (+{len} bytes) cannot be shared: {reason}")]
    NotShareable {
        /// The address.
        ptr: u64,
        /// The length.
        len: usize,
        /// Why.
        reason: String,
    },

    /// The function that gives a suballocated buffer back to its resource failed.
    #[error("freeing buffer {buffer} failed: {source}")]
    Free {
        /// The buffer.
        buffer: BufferId,
        /// The resource's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A wait for importers or for releases did not finish in time.
    #[error("timed out waiting for {what}")]
    WaitTimeout {
        /// What was awaited.
        what: String,
    },

    /// An operating-system call failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

fn allowed_len(min: usize, max: usize) -> String {
    if min == max {
        format!("exactly {min}")
    } else {
        format!("{min} to {max}")
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(errno: rustix::io::Errno) -> Self {
        use rustix::io::Errno;
        match errno {
            Errno::PIPE | Errno::CONNRESET => Error::Closed,
            other => Error::Io(other.into()),
        }
    }
}

impl Error {
    /// The code that tells a peer about this error in an `Error` message.
    pub fn wire_code(&self) -> ErrorCode {
        match self {
            Error::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            Error::WrongDevice { .. } | Error::DeviceNotVisible { .. } => ErrorCode::WrongDevice,
            Error::PeerCredentials { .. } => ErrorCode::PermissionDenied,
            Error::Timeout { .. } => ErrorCode::Timeout,
            Error::UnknownBuffer { .. } => ErrorCode::UnknownBuffer,
            Error::NotLeased { .. } => ErrorCode::NotLeased,
            Error::Io(_) | Error::SocketPath { .. } | Error::Core(_) | Error::Free { .. } => ErrorCode::Internal,
            _ => ErrorCode::Protocol,
        }
    }

    /// Whether the peer should hear about this error before the connection closes: errors
    /// that the peer caused or that end the conversation on this side, not the peer's own
    /// `Error` message or a connection that is already gone.
    pub(crate) fn worth_telling_peer(&self) -> bool {
        !matches!(
            self,
            Error::Remote { .. } | Error::Closed | Error::ConnectionFailed | Error::WriteClosed | Error::Io(_)
        )
    }
}
