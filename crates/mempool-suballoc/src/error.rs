//! The crate's errors: what engines, upstreams and stream orders fail with, and the invariant
//! violations `check_invariants` reports. Imports nothing of the crate.

use std::fmt;

/// A boxed error from an upstream or a stream implementation, kept as the `source` of [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything an engine, an [`Upstream`](crate::Upstream) or a [`StreamOrder`](crate::StreamOrder) can fail
/// with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No memory for the request. `requested` is the size the caller asked for, not the size of the
    /// upstream chunk the engine tried to grow by, so a caller can retry or report it as is.
    #[error("out of memory: {requested} bytes requested ({cause})")]
    OutOfMemory {
        /// The size the caller asked for, in bytes.
        requested: u64,
        /// Which limit was hit.
        cause: OutOfMemoryCause,
    },
    /// The request is larger than anything this engine serves (a fixed-size engine's block size).
    #[error("{requested} bytes requested, more than the largest block this engine serves ({limit} bytes)")]
    TooLarge {
        /// The size the caller asked for, in bytes.
        requested: u64,
        /// The largest request the engine serves, in bytes.
        limit: u64,
    },
    /// `deallocate` named an address and size that is not a live allocation of this engine: a double
    /// free, a foreign pointer or a wrong size. The engine's state is left unchanged.
    #[error("deallocation of {bytes} bytes at {addr:#x} does not match a live allocation")]
    UnknownAllocation {
        /// The address passed to `deallocate`.
        addr: u64,
        /// The size passed to `deallocate`.
        bytes: u64,
    },
    /// Options that cannot work (say, a maximum size below the initial size).
    #[error("invalid options: {0}")]
    InvalidOptions(&'static str),
    /// A stream or event operation failed.
    #[error("stream operation `{op}` failed")]
    Stream {
        /// The operation: `create_event`, `record`, `wait` or `synchronize`.
        op: &'static str,
        /// The implementation's error.
        #[source]
        source: BoxError,
    },
    /// The upstream failed in a way other than running out of memory, or broke its contract (say,
    /// returned a misaligned address).
    #[error("upstream `{op}` failed")]
    Upstream {
        /// The operation, usually `allocate`.
        op: &'static str,
        /// The upstream's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Names `requested` in an out-of-memory error (the caller's request, where the engine asked
    /// its upstream or global arena for a chunk or superblock); other errors pass unchanged.
    pub(crate) fn with_requested(self, requested: u64) -> Self {
        match self {
            Self::OutOfMemory { cause, .. } => Self::OutOfMemory { requested, cause },
            e => e,
        }
    }
}

/// Which limit an [`Error::OutOfMemory`] hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutOfMemoryCause {
    /// Growing would take the engine past its configured maximum size.
    MaximumSize {
        /// The configured maximum, in bytes.
        maximum: u64,
    },
    /// The upstream refused to allocate (it is full).
    Upstream,
    /// The size cannot be represented once rounded up to [`ALIGNMENT`](crate::ALIGNMENT), or the address
    /// space ran out.
    AddressSpace,
}

impl fmt::Display for OutOfMemoryCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MaximumSize { maximum } => write!(f, "maximum size of {maximum} bytes reached"),
            Self::Upstream => f.write_str("upstream exhausted"),
            Self::AddressSpace => f.write_str("size not representable"),
        }
    }
}

/// A broken internal invariant found by an engine's `check_invariants`: always a bug in the engine
/// (or misuse of a `&mut` API that bypassed its checks), never a condition to handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("suballocator invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// Returns `Err(InvariantViolation)` with a formatted message when `cond` is false.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::InvariantViolation(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
