//! Resources backed directly by the driver (stream-ordered pools, `cuMemAlloc`, managed and pinned host
//! memory) and the suballocating resources that run [`crate::suballoc`]'s engines over any upstream.

mod async_resource;
mod driver;
mod host_pool;
mod suballoc;

pub use async_resource::{AsyncOptions, AsyncResource, ReleaseThreshold};
pub use driver::{CudaResource, ManagedResource, PinnedHostResource};
pub use host_pool::{HostPoolOptions, HostPoolResource};
pub use suballoc::{
    ArenaResource, BinningResource, FixedSizeResource, PoolResource, SuballocConfig, SuballocatingResource,
};
