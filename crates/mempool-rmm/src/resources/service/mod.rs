//! [`ServiceResource`]: one pool for GPU services (tags, growth that never moves, a bounded footprint,
//! sleep and wake, observers of its chunks, sharing). `table` is its bookkeeping (no CUDA), `types` its
//! plain values, `fences` the frees in flight it waits for before unmapping, `resource` the resource.

pub(crate) mod fences;
pub(crate) mod resource;
pub(crate) mod table;
pub(crate) mod types;

pub use resource::{ServiceExport, ServiceResource, TaggedResource};
pub use table::MAX_TAG_NAME;
pub use types::{
    ChunkObserver, ChunkRange, ObserverId, Reclaim, ServiceOptions, ServiceStats, SleepMode, SleepReport, Tag,
    TagStats, WakeReport,
};
