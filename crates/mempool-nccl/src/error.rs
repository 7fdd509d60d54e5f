//! The crate's error type, at the bottom of the crate: it imports nothing of it.

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything loading NCCL and running it can fail with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No NCCL library could be opened.
    #[error(
        "NCCL was not found; tried {}. Install it (e.g. `pip install nvidia-nccl-cu13`, which puts \
         libnccl.so.2 in site-packages/nvidia/nccl/lib) and add its directory to LD_LIBRARY_PATH, or set \
         MEMPOOL_NCCL_LIBRARY to the library's path",
        tried.iter().map(|(name, why)| format!("{name} ({why})")).collect::<Vec<_>>().join(", ")
    )]
    LibraryNotFound {
        /// Each name or path tried, with the loader's reason.
        tried: Vec<(String, String)>,
    },
    /// A library was opened but it is not NCCL (it lacks `ncclGetVersion`).
    #[error("{path} is not an NCCL library: it has no symbol {symbol}")]
    NotNccl {
        /// What was opened.
        path: String,
        /// The symbol looked for.
        symbol: &'static str,
    },
    /// The loaded NCCL is older than the entry point a call needs.
    #[error("the loaded NCCL {version} ({path}) lacks {symbol}, which NCCL {added_in} added: install a newer NCCL")]
    MissingSymbol {
        /// The entry point.
        symbol: &'static str,
        /// The NCCL version that introduced it.
        added_in: &'static str,
        /// The loaded library's version.
        version: String,
        /// The loaded library.
        path: String,
    },
    /// An NCCL call failed.
    #[error("{call} failed: {name} ({code}): {message}{}", if last_error.is_empty() { String::new() } else { format!("; NCCL's last error: {last_error}") })]
    Nccl {
        /// The NCCL entry point.
        call: &'static str,
        /// The `ncclResult_t` value.
        code: i32,
        /// Its name (`ncclInvalidArgument`, ...).
        name: &'static str,
        /// `ncclGetErrorString`.
        message: String,
        /// `ncclGetLastError` (empty where NCCL has none or is too old to say).
        last_error: String,
    },
    /// A buffer that does not fit the collective: a length that is not a whole number of elements,
    /// counts that do not match, a buffer of another device or stream. Checked before NCCL is called.
    #[error("invalid argument to {call}: {reason}")]
    InvalidArgument {
        /// The operation.
        call: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A failure of the CUDA layer (driver missing, context binding, ...).
    #[error(transparent)]
    Core(#[from] mempool_core::Error),
}
