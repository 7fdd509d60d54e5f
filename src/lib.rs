//! # mempool
//!
//! Safe, fast and shareable CUDA stream-ordered memory pools, with RMM-style memory resources on top.
//! This facade re-exports the workspace's crates:
//!
//! - [`core`] (`mempool-core`): devices, streams, events and [`core::MemPool`].
//! - [`rmm`] (`mempool-rmm`): RMM-style memory resources, adaptors, containers, the per-device registry;
//!   [`rmm::suballoc`] is `mempool-suballoc`, the suballocator engines (no CUDA dependency).
//! - [`ipc`] (`mempool-ipc`): sharing pools and buffers between processes ([`ipc::Exporter`],
//!   [`ipc::Importer`]) over Unix sockets.
//! - [`store`] (`mempool-store`): the memory store, named GPU buffers a server process holds for clients
//!   that come and go ([`store::Server`], [`store::Client`]; docs/memory-store.md).
//! - `nccl` (`mempool-nccl`, feature `nccl`): NCCL collectives over mempool memory, NCCL opened at run
//!   time.
//! - `cudarc` (feature `cudarc`): the cudarc crate the interop is built against; cudarc's streams and
//!   contexts work where mempool's are taken, and `rmm::containers::CudarcBuffer` is mempool memory that
//!   cudarc's copies, launches and NCCL collectives take (docs/cudarc.md).
//!
//! See the README and `docs/` for the guide, and `docs/architecture.md` for the map of the code.

#![deny(unsafe_code)]

pub use mempool_core as core;
pub use mempool_core::{Device, DeviceAddr, Error, MemPool, PoolProps, Result, Stream, StreamRef};
pub use mempool_ipc as ipc;
/// NCCL collectives over mempool memory (`mempool-nccl`, feature `nccl`).
#[cfg(feature = "nccl")]
pub use mempool_nccl as nccl;
pub use mempool_rmm as rmm;
pub use mempool_store as store;

/// The cudarc crate mempool's interop is built against (feature `cudarc`; docs/cudarc.md).
#[cfg(feature = "cudarc")]
pub use cudarc;

// The guide's snippets, compiled (and, unless marked `no_run`, run) as doctests of this crate by
// `cargo test`: one module per document. Every ```rust block of README.md and docs/*.md is a doctest;
// other blocks must name their language (an unlabeled ``` block is Rust to rustdoc).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

#[cfg(doctest)]
#[doc = include_str!("../docs/architecture.md")]
mod docs_architecture {}

#[cfg(doctest)]
#[doc = include_str!("../docs/benchmarks.md")]
mod docs_benchmarks {}

#[cfg(doctest)]
#[doc = include_str!("../docs/nccl.md")]
mod docs_nccl {}

#[cfg(doctest)]
#[doc = include_str!("../docs/core.md")]
mod docs_core {}

// Needs the interop, which the dev-dependency on mempool-rmm's `cudarc` feature turns on for every doctest
// build.
#[cfg(doctest)]
#[doc = include_str!("../docs/cudarc.md")]
mod docs_cudarc {}

#[cfg(doctest)]
#[doc = include_str!("../docs/dask.md")]
mod docs_dask {}

#[cfg(doctest)]
#[doc = include_str!("../docs/distributed.md")]
mod docs_distributed {}

#[cfg(doctest)]
#[doc = include_str!("../docs/ipc.md")]
mod docs_ipc {}

#[cfg(doctest)]
#[doc = include_str!("../docs/ipc-protocol.md")]
mod docs_ipc_protocol {}

#[cfg(doctest)]
#[doc = include_str!("../docs/measurements.md")]
mod docs_measurements {}

#[cfg(doctest)]
#[doc = include_str!("../docs/memory-store.md")]
mod docs_memory_store {}

#[cfg(doctest)]
#[doc = include_str!("../docs/observe.md")]
mod docs_observe {}

#[cfg(doctest)]
#[doc = include_str!("../docs/resources.md")]
mod docs_resources {}

#[cfg(doctest)]
#[doc = include_str!("../docs/rmm.md")]
mod docs_rmm {}

#[cfg(doctest)]
#[doc = include_str!("../docs/services.md")]
mod docs_services {}

#[cfg(doctest)]
#[doc = include_str!("../docs/testing.md")]
mod docs_testing {}

#[cfg(doctest)]
#[doc = include_str!("../docs/vmm.md")]
mod docs_vmm {}
