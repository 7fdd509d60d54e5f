//! Resources backed directly by the driver: stream-ordered pools, `cuMemAlloc`, managed and pinned host
//! memory.

mod async_resource;
mod driver;

pub use async_resource::{AsyncOptions, AsyncResource};
pub use driver::{CudaResource, ManagedResource, PinnedHostResource};
