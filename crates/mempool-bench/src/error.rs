//! The harness's error type.

use crate::spec::lang::SpecError;

/// Everything the harness can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource spec that does not parse or names something unknown.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// A driver-level failure.
    #[error(transparent)]
    Core(#[from] mempool_core::Error),
    /// A resource failure.
    #[error(transparent)]
    Rmm(#[from] mempool_rmm::Error),
    /// An NCCL failure (library missing, a collective that failed).
    #[error(transparent)]
    Nccl(#[from] mempool_nccl::Error),
    /// A file that cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A log that cannot be replayed, with the file and line.
    #[error("{path}:{line}: {reason}")]
    Log {
        /// The file.
        path: String,
        /// The 1-based line (the header is line 1).
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A committed PTX file that is still the empty placeholder.
    #[error("kernels/{file} is empty: run kernels/build-ptx.sh on a machine with nvcc (then rebuild)")]
    EmptyPtx {
        /// The file under `kernels/`.
        file: &'static str,
    },
    /// A kernel's result that differs from what the host computed.
    #[error("wrong result: {0}")]
    Check(String),
    /// A request that cannot be served as asked.
    #[error("{0}")]
    Usage(String),
    /// The workload needs GPUs this machine does not have; shown as `WORKLOAD: needs a GPU: WHY`, then
    /// what runs without one, if anything.
    #[error("{workload}: {missing}{}", hint.as_ref().map(|h| format!("\n{h}")).unwrap_or_default())]
    NoGpu {
        /// The subcommand.
        workload: &'static str,
        /// How many GPUs it needs and why this machine cannot provide them.
        missing: mempool_core::MissingGpus,
        /// What the user can run instead (`-r sim`), or why nothing can.
        hint: Option<String>,
    },
}

/// The harness's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
