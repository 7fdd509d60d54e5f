//! # mempool-bench
//!
//! A gpu-bdb-style harness that runs the same GPU work over several memory resources side by side and
//! reports what each costs, with the raw driver allocators (`cuMemAlloc`, `cuMemAllocFromPoolAsync`)
//! measured in the same run as baselines.
//!
//! - [`spec`]: resource specs (`pool(async,initial=1GiB)`), parsed and checked without a GPU, built
//!   into `Arc<dyn MemoryResource>` on one.
//! - [`workloads`]: `random` (the standard random workload), `multi_stream`, `replay` (RMM's CSV logs),
//!   `query` (gpu-bdb-style pipelines of columnar operators), `peer` (two GPUs).
//! - [`report`]: the aligned table, JSON, CSV and SVG chart every run writes, naming the device,
//!   driver, date, command and parameters.
//! - [`kernels`]: the CUDA C kernels under `kernels/`, committed as PTX and loaded through the driver.
//!
//! The binary is `mempool-bench`; `mempool-bench --help` lists the subcommands.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod baseline;
pub mod env;
pub mod kernels;
pub mod progress;
pub mod report;
pub mod spec;
pub mod svg;
pub mod track;
pub mod units;
pub mod workloads;

/// Everything the harness can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource spec that does not parse or names something unknown.
    #[error(transparent)]
    Spec(#[from] spec::SpecError),
    /// A driver-level failure.
    #[error(transparent)]
    Core(#[from] mempool_core::Error),
    /// A resource failure.
    #[error(transparent)]
    Rmm(#[from] mempool_rmm::Error),
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
}

/// The harness's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
