//! The crate's error type, and where errors go that nobody can be told about.
//!
//! [`Error`] wraps the errors of the two layers below it, [`ProtocolError`] (the wire format)
//! and [`LeaseError`] (the lease bookkeeping), which know nothing of it.

use std::io;
use std::path::PathBuf;

use std::sync::Mutex;

use crate::lease::{ImporterId, LeaseError};
use crate::protocol::{BufferId, DeviceUuid, ErrorCode, MessageType, ProtocolError};

/// A specialized [`Result`](std::result::Result) for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while sharing pools and buffers between processes.
///
/// Every variant names its cause. After any error that a connection reports while a message
/// was half read or half written, or that reports a malformed or unexpected message, the
/// connection is closed: later calls on it return [`Error::ConnectionFailed`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A frame or message broke the rules of the wire format (a malformed or oversized frame,
    /// another protocol version, a field out of range, a frame cut short). The message is the
    /// [`ProtocolError`]'s.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),

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

    /// The peer runs in another pid namespace (`SO_PEERCRED` reports pid 0): the exporter could
    /// not tell when its process is gone, so it refuses such peers.
    #[error(
        "peer process of uid {uid} runs in another pid namespace (SO_PEERCRED reports pid 0); share the pid \
         namespace with the exporter"
    )]
    ForeignPidNamespace {
        /// The peer's effective user id.
        uid: u32,
    },

    /// The exporter turned the connection away: it serves as many importers as
    /// [`ExporterOptions::max_importers`](crate::ExporterOptions::max_importers) allows, or it
    /// closed a handshake to make room for newer ones
    /// ([`ExporterOptions::max_handshakes`](crate::ExporterOptions::max_handshakes)), or it is
    /// shutting down.
    #[error("the exporter turned the connection away: {reason}")]
    Refused {
        /// Why.
        reason: String,
    },

    /// An importer did not drain what the exporter sent it: its send queue was full, or nothing
    /// of it went out for the I/O timeout. The exporter disconnects it and reclaims its leases as
    /// for an importer that died.
    #[error("importer {importer} does not read what it is sent: {reason}")]
    Stalled {
        /// The importer.
        importer: ImporterId,
        /// What happened (queue full, no progress within the timeout).
        reason: String,
    },

    /// The connection's shared-memory rings (protocol version 3): the peer wrote them against
    /// their rules (an index out of range or moving backwards, a ring that claims more entries
    /// than it holds, a garbled slot), its region is not a valid ring region, or a system call on
    /// them failed. The connection ends; an importer's buffers are reclaimed as for one that died.
    #[error(transparent)]
    Ring(#[from] crate::ring::RingError),

    /// The shared-memory rings' slots are too small for the frames the protocol puts in them (a
    /// `Buffer` frame and the slot's header): refused when the exporter starts with such
    /// [`ExporterOptions::rings`](crate::ExporterOptions::rings), and by an importer whose
    /// exporter offers such rings at the handshake (the exporter is told).
    #[error(
        "shared-memory rings of {slot_bytes}-byte slots: the protocol needs slots of at least {min} bytes (a \
         Buffer frame and the slot's header)"
    )]
    RingSlotTooSmall {
        /// The slot size of the rings, in bytes (header included).
        slot_bytes: u32,
        /// The smallest slot the protocol accepts, in bytes.
        min: u32,
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

    /// The lease bookkeeping refused an operation (a buffer registered twice, unknown or
    /// already given up; a lease granted twice; a release of a buffer not held; a block
    /// announced again with another size). The message is the [`LeaseError`]'s.
    #[error(transparent)]
    Lease(#[from] LeaseError),

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

    /// A VMM allocation cannot go to this importer: its handshake did not ask for the VMM
    /// capability (`ImporterOptions::accept_vmm` unset, a version-1 importer, or a build
    /// without it). Nothing was sent.
    #[error("importer {importer} does not accept VMM allocations (its handshake did not ask for the VMM capability: ImporterOptions::accept_vmm unset, or a version-1 importer)")]
    VmmNotAccepted {
        /// The importer.
        importer: ImporterId,
    },
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

impl From<mempool_socket::Error> for Error {
    /// The socket layer's errors as this crate's variants of the same names (a rule of the
    /// socket layer broken is a [`ProtocolError::Violation`]).
    fn from(e: mempool_socket::Error) -> Self {
        use mempool_socket::Error as S;
        match e {
            S::DescriptorCount { expected, got } => Error::DescriptorCount { expected, got },
            S::PeerCredentials { uid, pid } => Error::PeerCredentials { uid, pid },
            S::ForeignPidNamespace { uid } => Error::ForeignPidNamespace { uid },
            S::Timeout { during } => Error::Timeout { during },
            S::Closed => Error::Closed,
            S::SocketPath { path, reason } => Error::SocketPath { path, reason },
            S::Violation { reason } => Error::Protocol(ProtocolError::Violation { reason }),
            S::Io(e) => Error::Io(e),
            other => Error::Io(std::io::Error::other(other)),
        }
    }
}

impl From<mempool_socket::listener::Refused> for Error {
    fn from(refused: mempool_socket::listener::Refused) -> Self {
        refused.error.into()
    }
}

impl Error {
    /// The code that tells a peer about this error in an `Error` message.
    pub fn wire_code(&self) -> ErrorCode {
        match self {
            Error::Protocol(ProtocolError::UnsupportedVersion { .. }) => ErrorCode::UnsupportedVersion,
            Error::WrongDevice { .. } | Error::DeviceNotVisible { .. } => ErrorCode::WrongDevice,
            Error::PeerCredentials { .. } | Error::ForeignPidNamespace { .. } => ErrorCode::PermissionDenied,
            Error::Refused { .. } | Error::Stalled { .. } => ErrorCode::Internal,
            Error::Timeout { .. } => ErrorCode::Timeout,
            Error::Lease(LeaseError::UnknownBuffer { .. }) => ErrorCode::UnknownBuffer,
            Error::Lease(LeaseError::NotLeased { .. }) => ErrorCode::NotLeased,
            Error::Io(_) | Error::SocketPath { .. } | Error::Core(_) | Error::Free { .. } => ErrorCode::Internal,
            Error::Ring(e) if !e.is_peer_fault() => ErrorCode::Internal,
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

static DROP_ERRORS: Mutex<Vec<Error>> = Mutex::new(Vec::new());
const MAX_DROP_ERRORS: usize = 64;

/// Keeps an error met where nobody can be told (a `Drop`, the exporter's serving thread), for
/// [`take_drop_errors`].
pub(crate) fn record_drop_error(e: Error) {
    let mut errors = DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    if errors.len() < MAX_DROP_ERRORS {
        errors.push(e);
    }
}

/// Takes the errors met since the last call where no caller could receive them. At most 64 are
/// kept (later ones are dropped until this is called); the list is process-wide.
///
/// They come from:
/// - `Drop` of an [`ExportedBuffer`](crate::ExportedBuffer) or a
///   [`SharedBuffer`](crate::SharedBuffer) (their `release` methods return the error instead),
///   and of an [`Importer`](crate::Importer) whose buffers could not all be released;
/// - the [`Exporter`](crate::Exporter)'s own failures on its serving thread: accepting
///   connections (the first failure of a streak), watching an importer's process, the driver
///   (opening a release event), frees deferred to an importer's release
///   ([`Exporter::shutdown`](crate::Exporter::shutdown) returns these along with the rest).
///   What peers cause (broken protocol, reset sockets, time limits, stalls, refusals) is only
///   counted, in [`ExporterStats`](crate::ExporterStats) (`peer_errors` and the others), so a
///   hostile peer cannot fill these slots.
pub fn take_drop_errors() -> Vec<Error> {
    std::mem::take(&mut *DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner()))
}
