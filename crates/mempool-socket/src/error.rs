//! The crate's error type: what the socket parts below a protocol can meet. It knows nothing of the
//! protocols above; mempool-ipc's and mempool-store's errors convert from it.

use std::io;
use std::path::PathBuf;

/// A specialized [`Result`](std::result::Result) for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong on a Unix socket: passing descriptors, reading a peer's credentials, binding
/// or accepting on a listener, reading a frame.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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

    /// The peer runs in another pid namespace (`SO_PEERCRED` reports pid 0): its process cannot
    /// be named, so nobody could tell when it is gone; such peers are refused.
    #[error(
        "peer process of uid {uid} runs in another pid namespace (SO_PEERCRED reports pid 0); share the pid \
         namespace with the exporter"
    )]
    ForeignPidNamespace {
        /// The peer's effective user id.
        uid: u32,
    },

    /// The peer did not complete a step in time.
    #[error("timed out during {during}")]
    Timeout {
        /// The step that timed out.
        during: &'static str,
    },

    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,

    /// The socket path cannot be used.
    #[error("socket path {}: {reason}", path.display())]
    SocketPath {
        /// The path.
        path: PathBuf,
        /// Why it cannot be used.
        reason: &'static str,
    },

    /// A call broke a rule of the socket layer (descriptors without a byte to carry them).
    #[error("protocol violation: {reason}")]
    Violation {
        /// What was wrong.
        reason: String,
    },

    /// An operating-system call failed.
    #[error(transparent)]
    Io(#[from] io::Error),
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
