//! Resources backed directly by the driver (stream-ordered pools of device and of managed memory,
//! `cuMemAlloc`, managed and pinned host memory, one VMM mapping per request), over system memory the GPU reaches through pageable
//! memory access, over callbacks, and the suballocating resources that run [`crate::suballoc`]'s engines
//! over any upstream.

mod async_managed;
mod async_resource;
mod callback;
mod driver;
mod expandable;
mod host_pool;
mod service;
mod suballoc;
mod system;
mod vmm;

pub use async_managed::{AsyncManagedOptions, AsyncManagedResource};
pub use async_resource::{AsyncOptions, AsyncResource, ReleaseThreshold};
pub use callback::{CallbackResource, Returned};
pub use driver::{CudaResource, ManagedResource, PinnedHostResource};
pub use expandable::{ExpandableOptions, ExpandableResource, ExpandableStats};
pub use host_pool::{HostPoolOptions, HostPoolResource};
pub use service::{
    ChunkObserver, ChunkRange, ObserverId, Reclaim, ServiceExport, ServiceOptions, ServiceResource, ServiceStats,
    SleepMode, SleepReport, Tag, TagStats, TaggedResource, WakeReport, MAX_TAG_NAME,
};
pub use suballoc::{
    ArenaResource, BinningResource, FixedSizeResource, PoolResource, SuballocOptions, SuballocatingResource,
};
pub use system::{SamHeadroomResource, SystemResource};
pub use vmm::{PeerAccess, VmmOptions, VmmResource};
