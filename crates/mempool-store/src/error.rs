//! The memory store's error type: every refusal of the server and every failure of a client
//! call, each variant naming its cause. The server's refusals travel over the wire as a code and
//! their fields (`proto`), so the client gets the same variant the server made.

use std::io;
use std::sync::Mutex;

/// A specialized [`Result`](std::result::Result) for the memory store.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which limit a [`Error::QuotaExceeded`] hit.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QuotaScope {
    /// The limit of one user (uid) of the service.
    Uid(u32),
    /// The limit of the whole service, every user together.
    Total,
}

impl std::fmt::Display for QuotaScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuotaScope::Uid(uid) => write!(f, "uid {uid}"),
            QuotaScope::Total => f.write_str("the whole service"),
        }
    }
}

/// What a [`Error::QuotaExceeded`] counts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QuotaKind {
    /// Bytes of GPU memory (sizes after rounding up to the granularity).
    Bytes,
    /// Buffers (named or being deleted but still attached).
    Buffers,
}

impl std::fmt::Display for QuotaKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuotaKind::Bytes => f.write_str("bytes"),
            QuotaKind::Buffers => f.write_str("buffers"),
        }
    }
}

/// Everything that can go wrong in the memory store, on either side.
///
/// The variants from [`Error::NameTaken`] to [`Error::Busy`] are refusals the server sends; the
/// client returns them as they were made. After [`Error::PeerGone`], [`Error::Protocol`],
/// [`Error::Timeout`] or [`Error::Io`] the connection is closed: later calls on the same
/// [`Client`](super::client::Client) return [`Error::PeerGone`] again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `create` named a buffer that exists (published, or being created by someone).
    #[error("a buffer named {name:?} exists already")]
    NameTaken {
        /// The name.
        name: String,
    },

    /// No buffer has this name (never created, deleted, expired, or its creator died before
    /// publishing it).
    #[error("no buffer is named {name:?}")]
    UnknownName {
        /// The name.
        name: String,
    },

    /// The name breaks the naming rule.
    #[error("bad buffer name {name:?}: {rule}")]
    BadName {
        /// The name (lossily decoded if it was not UTF-8).
        name: String,
        /// The rule it breaks.
        rule: &'static str,
    },

    /// The tag is longer than [`MAX_TAG_LEN`](super::names::MAX_TAG_LEN) bytes.
    #[error("buffer tag of {len} bytes is longer than the limit of {max} bytes")]
    BadTag {
        /// The tag's length.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// Creating the buffer would pass a quota.
    #[error("quota exceeded for {scope}: {in_use} {kind} in use + {requested} requested > limit {limit}")]
    QuotaExceeded {
        /// Whose limit.
        scope: QuotaScope,
        /// What it counts.
        kind: QuotaKind,
        /// The limit.
        limit: u64,
        /// What is in use now.
        in_use: u64,
        /// What the call asked for.
        requested: u64,
    },

    /// The access rules do not let this uid connect, or do this to this buffer.
    #[error("uid {uid} is not permitted to {what}")]
    NotPermitted {
        /// The uid of the client.
        uid: u32,
        /// What it tried ("connect", "delete a buffer of uid 1000", ...).
        what: String,
    },

    /// The buffer is not in a state that allows the call (publishing a published buffer,
    /// attaching one that is still being created).
    #[error("buffer {name:?} is {state}: cannot {op}")]
    WrongState {
        /// The name.
        name: String,
        /// Its state.
        state: super::types::BufferState,
        /// What was tried.
        op: &'static str,
    },

    /// Only the connection that created a buffer may publish it.
    #[error("buffer {name:?} is being created by another connection: only its creator may publish it")]
    NotCreator {
        /// The name.
        name: String,
    },

    /// The size is 0, or rounds up past the server's largest buffer.
    #[error("bad size {size}: {reason}")]
    BadSize {
        /// The size asked for.
        size: u64,
        /// Why it is refused.
        reason: String,
    },

    /// The server does not serve buffers on this GPU.
    #[error("the server serves no buffers on GPU {device}")]
    DeviceNotServed {
        /// The GPU's UUID, as `GPU-xxxxxxxx-...`.
        device: String,
    },

    /// The GPU that holds the buffer is not visible to this process (check `CUDA_VISIBLE_DEVICES`).
    #[error("buffer's GPU {device} is not visible to this process")]
    DeviceNotVisible {
        /// The GPU's UUID, as `GPU-xxxxxxxx-...`.
        device: String,
    },

    /// The server has as many connections as it allows (in all, or for this uid).
    #[error("the server turned the connection away: {reason}")]
    Busy {
        /// Which limit.
        reason: String,
    },

    /// The server failed to do something on the GPU (allocation, export, event relay); the
    /// driver's message.
    #[error("the server failed on the GPU: {message}")]
    ServerGpu {
        /// The server's description of the failure.
        message: String,
    },

    /// The other side is gone: the server died or closed the connection (or, on the server, the
    /// client did).
    #[error("the memory store peer is gone ({during}); mapped buffers stay valid until dropped")]
    PeerGone {
        /// What this side was doing.
        during: &'static str,
    },

    /// A frame broke the memory store's wire format, or arrived out of turn.
    #[error("memory store protocol violation: {reason}")]
    Protocol {
        /// What was wrong.
        reason: String,
    },

    /// The other side took longer than the connection's time limit.
    #[error("timed out during {during}")]
    Timeout {
        /// What this side was waiting for.
        during: &'static str,
    },

    /// The socket path is unusable (another server listens on it, or a non-socket is there).
    #[error("socket path {path}: {reason}")]
    SocketPath {
        /// The path.
        path: String,
        /// Why.
        reason: &'static str,
    },

    /// Mapping a granted buffer into this process, or ordering the stream after it, failed (a
    /// local driver failure, or a grant this process cannot map); `source` says how. The server's
    /// attachments of that call were ended.
    #[error("attaching buffer {name:?}: {source}")]
    Attach {
        /// The buffer.
        name: String,
        /// What failed.
        source: Box<Error>,
    },

    /// A wrong argument to a local call (a server configuration, a client option).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A CUDA driver call of this process failed.
    #[error("CUDA: {0}")]
    Core(#[from] mempool_core::Error),

    /// The operating system refused something (socket, descriptor passing).
    #[error(transparent)]
    Io(#[from] io::Error),

    /// The socket layer (mempool-socket, shared with mempool-ipc's exporter) failed (binding the
    /// socket file, reading peer credentials); its error names the cause.
    #[error(transparent)]
    Socket(#[from] mempool_socket::Error),
}

impl Error {
    pub(crate) fn protocol(reason: impl Into<String>) -> Error {
        Error::Protocol { reason: reason.into() }
    }

    /// `self` as an error about attaching the buffer `name` ([`Error::Attach`]), unless it
    /// names that buffer already.
    pub(crate) fn about_buffer(self, name: &str) -> Error {
        match self {
            Error::Core(_) | Error::Io(_) | Error::Socket(_) | Error::Protocol { .. } | Error::InvalidArgument(_) => {
                Error::Attach {
                    name: name.to_owned(),
                    source: Box::new(self),
                }
            }
            other => other,
        }
    }

    /// Whether this is one of the server's refusals, after which the connection stays usable.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Error::NameTaken { .. }
                | Error::UnknownName { .. }
                | Error::BadName { .. }
                | Error::BadTag { .. }
                | Error::QuotaExceeded { .. }
                | Error::NotPermitted { .. }
                | Error::WrongState { .. }
                | Error::NotCreator { .. }
                | Error::BadSize { .. }
                | Error::DeviceNotServed { .. }
                | Error::ServerGpu { .. }
        )
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(errno: rustix::io::Errno) -> Error {
        Error::Io(errno.into())
    }
}

static DROP_ERRORS: Mutex<Vec<Error>> = Mutex::new(Vec::new());
const MAX_DROP_ERRORS: usize = 64;

/// Keeps an error met where nobody can be told (a `Drop`), for [`take_drop_errors`].
pub(crate) fn record_drop_error(e: Error) {
    let mut errors = DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    if errors.len() < MAX_DROP_ERRORS {
        errors.push(e);
    }
}

/// Takes the errors met since the last call where no caller could receive them: a client's
/// buffer ([`Attached`](crate::Attached), [`Created`](crate::Created)) that could not be released
/// when dropped (its `release` method returns the error instead). At most 64 are kept (later ones
/// are dropped until this is called); the list is process-wide.
pub fn take_drop_errors() -> Vec<Error> {
    std::mem::take(&mut *DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner()))
}
