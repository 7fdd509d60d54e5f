//! [`ServiceResource`]: one pool for GPU services (tags, growth that never moves, a bounded footprint,
//! sleep and wake, observers of its chunks, sharing). `table` is its bookkeeping (no CUDA), `types` its
//! plain values, `fences` the frees in flight it waits for before unmapping, `pinned` the host memory an
//! offload waits in, `state` what its lock guards; `resource` the type, its construction and tags, and one
//! file per concern over it: `growth` (map, unmap idle chunks, the drop), `allocate` (allocate, free, the
//! `MemoryResource` impls and `TaggedResource`), `sleep` (sleep and wake), `export` (`ServiceExport`) and
//! `observers` (observers, statistics, the snapshot's chunks).

pub(crate) mod allocate;
pub(crate) mod export;
pub(crate) mod fences;
pub(crate) mod growth;
pub(crate) mod observers;
pub(crate) mod pinned;
pub(crate) mod resource;
pub(crate) mod sleep;
pub(crate) mod state;
pub(crate) mod table;
pub(crate) mod types;

pub use allocate::TaggedResource;
pub use export::ServiceExport;
pub use resource::ServiceResource;
pub use table::MAX_TAG_NAME;
pub use types::{
    ChunkObserver, ChunkRange, ObserverId, Reclaim, ServiceOptions, ServiceStats, SleepMode, SleepReport, Tag,
    TagStats, WakeReport,
};
