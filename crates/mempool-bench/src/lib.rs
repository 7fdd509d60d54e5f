//! # mempool-bench
//!
//! A gpu-bdb-style harness that runs the same GPU work over several memory resources side by side and
//! reports what each costs, with the raw driver allocators (`cuMemAlloc`, `cuMemAllocFromPoolAsync`)
//! measured in the same run as baselines.
//!
//! - [`spec`]: resource specs (`pool(async,initial=1GiB)`), parsed and checked without a GPU, built
//!   into `Arc<dyn MemoryResource>` on one.
//! - [`workloads`]: `random` (the standard random workload), `multi_stream`, `replay` (RMM's CSV logs),
//!   `query` (gpu-bdb-style pipelines of columnar operators), `peer` (two GPUs), `fragmentation` and
//!   `grow` (virtual memory), `sleep` (a `ServiceResource` tag's sleep and wake against pinned copies),
//!   `allreduce` (NCCL).
//! - [`report`]: the aligned table, JSON, CSV and SVG chart every run writes, naming the device,
//!   driver, date, command and parameters.
//! - [`kernels`]: the CUDA C kernels under `kernels/`, committed as PTX and loaded through the driver.
//! - [`cluster`]: several workers' snapshot files merged into one cluster document and its page.
//!
//! The binary is `mempool-bench`; `mempool-bench --help` lists the subcommands.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub(crate) mod baseline;
pub(crate) mod chart;
pub mod cluster;
pub mod env;
pub(crate) mod error;
pub mod kernels;
pub(crate) mod progress;
pub mod report;
pub mod spec;
pub(crate) mod svg;
pub(crate) mod track;
pub mod units;
pub mod workloads;

pub use error::{Error, Result};
