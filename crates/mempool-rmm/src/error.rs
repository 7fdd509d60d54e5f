//! The crate's error type.

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a memory resource can fail with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not enough memory for the request. Callers may free, trim and retry (see
    /// [`crate::adaptors::FailureCallbackAdaptor`]).
    #[error("out of memory: {resource} could not allocate {requested} bytes")]
    OutOfMemory {
        /// The resource that failed, by type name.
        resource: &'static str,
        /// The bytes asked for.
        requested: usize,
    },
    /// Out of memory, with what the resource holds ([`crate::ServiceResource`]).
    #[error(
        "out of memory: {resource} could not allocate {requested} bytes for tag `{tag}`: it holds {held} bytes \
         mapped, {live} bytes live, its largest free block in mapped memory is {largest_free} bytes, and the \
         device has {device_free} bytes free"
    )]
    OutOfMemoryHeld {
        /// The resource.
        resource: &'static str,
        /// The size asked for.
        requested: usize,
        /// The tag asked for.
        tag: String,
        /// Physical memory the resource holds (every tag).
        held: u64,
        /// Bytes of live allocations (every tag).
        live: u64,
        /// The largest free block of the tag that needs no mapping.
        largest_free: u64,
        /// The device's free memory (`cuMemGetInfo`) when the request failed.
        device_free: u64,
    },
    /// A [`crate::adaptors::LimitingAdaptor`] refused an allocation over its limit.
    #[error("allocation of {requested} bytes refused: {used} of the limit of {limit} bytes are in use")]
    LimitExceeded {
        /// The bytes asked for.
        requested: usize,
        /// Bytes allocated through the adaptor now.
        used: usize,
        /// The adaptor's limit.
        limit: usize,
    },
    /// A request the resource cannot serve by construction (too large for a fixed-size resource, an
    /// alignment that is not a power of two, ...).
    #[error("{resource} cannot serve this request: {reason}")]
    Unsupported {
        /// The resource, by type name.
        resource: &'static str,
        /// Why.
        reason: String,
    },
    /// A deallocation that does not match a live allocation (wrong pointer or size).
    #[error("{resource}: invalid deallocation of {ptr:#x} ({bytes} bytes): {reason}")]
    InvalidDeallocation {
        /// The resource, by type name.
        resource: &'static str,
        /// The address given.
        ptr: u64,
        /// The size given.
        bytes: usize,
        /// What did not match.
        reason: String,
    },
    /// An I/O error of the logging adaptor.
    #[error("log I/O failed: {0}")]
    Log(String),
    /// A failure of the CUDA layer (driver missing or too old, a driver call that failed, ...).
    #[error(transparent)]
    Core(mempool_core::Error),
}

impl Error {
    /// True for [`Error::OutOfMemory`], whichever layer ran out, and for [`Error::LimitExceeded`]: as in
    /// RMM, whose limiting adaptor throws `rmm::out_of_memory`, a limit is memory running out, so a
    /// [`crate::adaptors::FailureCallbackAdaptor`] above a [`crate::adaptors::LimitingAdaptor`] gets its
    /// callback and an engine over one reports out-of-memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory { .. } | Error::OutOfMemoryHeld { .. } | Error::LimitExceeded { .. }
        )
    }
}

impl From<mempool_core::Error> for Error {
    /// Out-of-memory from the driver stays out-of-memory, so callers test one variant.
    fn from(e: mempool_core::Error) -> Self {
        match e {
            mempool_core::Error::OutOfMemory { call, requested } => Error::OutOfMemory {
                resource: call,
                requested,
            },
            other => Error::Core(other),
        }
    }
}
