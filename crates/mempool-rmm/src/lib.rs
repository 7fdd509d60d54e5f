//! # mempool-rmm
//!
//! RMM-style (RAPIDS Memory Manager) composable memory resources in Rust, with the CUDA driver's
//! stream-ordered pools as the backing.
//!
//! - [`MemoryResource`]: the stream-ordered, object-safe trait every resource implements; its
//!   documentation states the stream contract.
//! - Resources over the driver ([`AsyncResource`], [`AsyncManagedResource`], [`CudaResource`],
//!   [`ManagedResource`], [`PinnedHostResource`], [`HostPoolResource`], [`VmmResource`]: one
//!   `cuMemCreate` mapping per request, as NCCL's `ncclMemAlloc` makes them), over system memory the GPU
//!   reaches through pageable memory access ([`SystemResource`], [`SamHeadroomResource`]), and over
//!   closures ([`CallbackResource`]).
//! - [`adaptors`]: statistics, tracking, logging (RMM's CSV format), limiting, aligned,
//!   failure-callback, prefetch.
//! - [`registry`]: the per-device current resource.
//! - [`observe`]: the allocation history, snapshots of a resource stack and the viewer page they open
//!   in, out-of-memory reports (docs/observe.md).
//! - The suballocating resources ([`PoolResource`], [`FixedSizeResource`], [`BinningResource`],
//!   [`ArenaResource`]: one generic [`SuballocatingResource`]), which run the engines of
//!   [`suballoc`] (the `mempool-suballoc` crate: pool, fixed-size, binning, arena, host-testable over
//!   a simulated upstream) over any upstream resource.
//! - [`workload`]: the standard random workload the benchmarks draw from.
//! - [`containers`]: RAII buffers, vectors and scalars over any resource; with the `cudarc` feature,
//!   `CudarcBuffer`, which cudarc's copies, kernel launches and NCCL collectives take (docs/cudarc.md).
//! - `testing` (cargo feature `testing`, off by default): `SimResource`, a host-only resource for
//!   tests without a GPU.
//!
//! See `docs/resources.md` for which resource suits which workload.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod adaptors;
pub mod containers;
mod error;
pub mod observe;
pub mod registry;
mod resource;
pub mod resources;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

/// The suballocator engines: the `mempool-suballoc` crate.
pub use mempool_suballoc as suballoc;
/// The standard random workload and its generator (`mempool_suballoc::workload`).
pub use mempool_suballoc::workload;

pub use error::{Error, OutOfMemoryReport, Result};
pub use resource::{align_up, MemoryResource, SharedResource, ALIGNMENT};
pub use resources::{
    ArenaResource, AsyncManagedOptions, AsyncManagedResource, AsyncOptions, AsyncResource, BinningResource,
    CallbackResource, CudaResource, ExpandableOptions, ExpandableResource, ExpandableStats, FixedSizeResource,
    HostPoolOptions, HostPoolResource, ManagedResource, PinnedHostResource, PoolResource, Reclaim, ReleaseThreshold,
    SamHeadroomResource, SuballocOptions, SuballocatingResource, SystemResource,
};
pub use resources::{
    ChunkObserver, ChunkRange, ObserverId, ServiceExport, ServiceOptions, ServiceResource, ServiceStats, SleepMode,
    SleepReport, Tag, TagStats, TaggedResource, WakeReport, MAX_TAG_NAME,
};
pub use resources::{PeerAccess, VmmOptions, VmmResource};
