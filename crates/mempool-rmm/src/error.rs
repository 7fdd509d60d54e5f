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
    /// Out of memory, explained: the size asked, the resource stack, what the resource that ran out
    /// holds, and how fragmented its free memory is ([`OutOfMemoryReport`]). Every resource of the
    /// crate reports this when an allocation runs out (the suballocators, the service resource, and
    /// every adaptor over a resource that ran out); [`Error::OutOfMemory`] remains what a leaf
    /// resource returns before an adaptor or suballocator above it explains it.
    #[error("{0}")]
    OutOfMemoryReport(Box<OutOfMemoryReport>),
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
    /// A file of `observe` (a snapshot, a page) that could not be written, naming the file and the cause.
    #[error("{0}")]
    Io(String),
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
            Error::OutOfMemory { .. } | Error::OutOfMemoryReport(_) | Error::LimitExceeded { .. }
        )
    }
}

impl Error {
    /// The out-of-memory report, when this is [`Error::OutOfMemoryReport`].
    pub fn report(&self) -> Option<&OutOfMemoryReport> {
        match self {
            Error::OutOfMemoryReport(r) => Some(r),
            _ => None,
        }
    }

    /// The bytes asked for, for every out-of-memory error ([`Error::is_out_of_memory`]).
    pub fn requested(&self) -> Option<usize> {
        match self {
            Error::OutOfMemory { requested, .. } | Error::LimitExceeded { requested, .. } => Some(*requested),
            Error::OutOfMemoryReport(r) => Some(r.requested),
            _ => None,
        }
    }
}

/// What an out-of-memory error explains ([`Error::OutOfMemoryReport`]): built by the resource that ran
/// out, or by the first adaptor or suballocator above a resource that reported only the size, and
/// extended by every adaptor it passes on the way up (each puts its name in front of `stack`).
///
/// The numbers are those of `holder`, the resource nearest to the failure that knows what it holds (a
/// suballocator, the service resource, a driver pool); `None` where no resource of the stack knows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutOfMemoryReport {
    /// The bytes asked for.
    pub requested: usize,
    /// The resource stack by name, from the top resource down to the bottom one.
    pub stack: Vec<&'static str>,
    /// The resource or driver call that ran out (`cuMemAllocFromPoolAsync`, `PoolResource`, ...).
    pub failed_at: &'static str,
    /// The tag asked for (the service resource's).
    pub tag: Option<String>,
    /// The resource whose numbers follow.
    pub holder: Option<&'static str>,
    /// Bytes `holder` holds (reserved from its upstream, or mapped).
    pub held: Option<u64>,
    /// How it holds them, where the message should say (`mapped`: the service resource's chunks).
    pub held_as: Option<&'static str>,
    /// Bytes of its live allocations.
    pub live: Option<u64>,
    /// Bytes it holds that no live allocation uses.
    pub free: Option<u64>,
    /// Its largest free block.
    pub largest_free: Option<u64>,
    /// How many free blocks `free` is made of.
    pub free_blocks: Option<usize>,
    /// The device's free memory (`cuMemGetInfo`) when the request failed.
    pub device_free: Option<u64>,
    /// Whether the allocation was retried once after trimming and synchronizing
    /// ([`crate::adaptors::OomRetryAdaptor`]) and failed again.
    pub retried: bool,
}

impl OutOfMemoryReport {
    /// A report of `requested` bytes that `failed_at` could not serve, with nothing else known yet.
    pub fn new(requested: usize, failed_at: &'static str) -> Self {
        OutOfMemoryReport {
            requested,
            failed_at,
            ..Default::default()
        }
    }

    /// Fragmentation of the holder's free memory, in percent: `100 * (1 - largest_free / free)`; 0 when
    /// its free memory is one block, near 100 when it is scattered in many small ones. `None` when
    /// unknown or nothing is free.
    pub fn fragmentation_percent(&self) -> Option<u64> {
        match (self.free, self.largest_free) {
            (Some(free), Some(largest)) if free > 0 => {
                Some(100 - (largest.min(free) as u128 * 100 / free as u128) as u64)
            }
            _ => None,
        }
    }

    /// Whether the holder has as many free bytes as asked for, yet no free block large enough: the
    /// request failed for fragmentation, not for lack of memory.
    pub fn fragmented(&self) -> bool {
        matches!((self.free, self.largest_free), (Some(free), Some(largest))
            if free >= self.requested as u64 && largest < self.requested as u64)
    }
}

impl std::fmt::Display for OutOfMemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory: ")?;
        if self.stack.is_empty() {
            write!(f, "{}", self.failed_at)?;
        } else {
            write!(f, "{}", self.stack.join(" > "))?;
        }
        write!(f, " could not allocate {} bytes", self.requested)?;
        if let Some(tag) = &self.tag {
            write!(f, " for tag `{tag}`")?;
        }
        if self.stack.last() != Some(&self.failed_at) {
            write!(f, " ({} ran out)", self.failed_at)?;
        }
        if let Some(holder) = self.holder {
            write!(f, "; {holder} holds {} bytes", opt(self.held))?;
            if let Some(how) = self.held_as {
                write!(f, " {how}")?;
            }
            write!(f, ", {} bytes live", opt(self.live))?;
            if let Some(free) = self.free {
                write!(f, ", {free} bytes free")?;
                if let Some(n) = self.free_blocks {
                    write!(f, " in {n} blocks")?;
                }
            }
            write!(f, ", its largest free block is {} bytes", opt(self.largest_free))?;
            if let Some(p) = self.fragmentation_percent() {
                write!(f, " (free memory {p}% fragmented)")?;
            }
            if self.fragmented() {
                write!(
                    f,
                    ": enough bytes are free, but no free block is large enough (fragmentation)"
                )?;
            }
        }
        if let Some(d) = self.device_free {
            write!(f, "; the device has {d} bytes free")?;
        }
        if self.retried {
            write!(f, "; failed again after trimming, synchronizing and retrying once")?;
        }
        Ok(())
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "an unknown number of".to_string(), |v| v.to_string())
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
