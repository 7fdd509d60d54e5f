//! `mempool.mr`: mempool-rmm's resources and adaptors under RMM's Python names, composable as RMM's are
//! (each adaptor holds its upstream, on the Rust side by `Arc` and on the Python side by reference), and
//! the per-device current resource.
//!
//! Files: `base.rs` (the base class, `DeviceMemoryResource`, and shared helpers), `resources.rs` (resources over the driver),
//! `suballoc.rs` (the suballocators), `service.rs` (the service resource and its tags), `adaptors.rs`,
//! `registry.rs` (the per-device current resource).

mod adaptors;
mod base;
mod registry;
mod resources;
pub(crate) mod service;
mod suballoc;

pub(crate) use adaptors::{
    _flush_logs, calls_python, FailureCallbackResourceAdaptor, LimitingResourceAdaptor, LoggingResourceAdaptor,
    Statistics, StatisticsResourceAdaptor, TrackingResourceAdaptor,
};
pub(crate) use base::PyResource;
pub(crate) use registry::{get_per_device_resource, set_per_device_resource};
pub(crate) use resources::{CudaAsyncMemoryResource, CudaMemoryResource, ManagedMemoryResource, VmmMemoryResource};
pub(crate) use service::{ServiceMemoryResource, TaggedMemoryResource};
pub(crate) use suballoc::{ArenaMemoryResource, BinningMemoryResource, FixedSizeMemoryResource, PoolMemoryResource};
