//! The service resource's plain values: tags, options, sleep modes, statistics, chunk observers.

use mempool_core::DeviceAddr;

/// A tag: which part of a [`ServiceResource`](super::ServiceResource) an allocation belongs to. Every
/// tag has its own region of the resource's reservation, so its chunks are never shared with another
/// tag's and can sleep on their own. [`Tag::DEFAULT`] always exists; named tags come from
/// [`ServiceResource::tag`](super::ServiceResource::tag).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub(crate) u32);

impl Tag {
    /// The tag of allocations that name none (its name is `default`).
    pub const DEFAULT: Tag = Tag(0);

    /// The tag's number: its region's index in the reservation.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The tag whose number is `index` (what [`index`](Self::index) returns): for callers that carry tags
    /// as numbers (the C ABI, Python). A resource refuses a number it has no tag for.
    pub const fn from_index(index: u32) -> Tag {
        Tag(index)
    }
}

/// What [`ServiceResource::sleep`](super::ServiceResource::sleep) does with the contents of the memory
/// it releases.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum SleepMode {
    /// The contents are lost; `wake` maps fresh memory at the same addresses (a KV cache, activations).
    Discard,
    /// The contents of every chunk a live allocation touches are copied to pinned host memory first;
    /// `wake` copies them back (weights).
    Offload,
}

/// How a [`ServiceResource`](super::ServiceResource) is laid out.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ServiceOptions {
    /// Bytes of virtual address space per tag (rounded up to the chunk). `None`: twice the device's
    /// memory, so that holes left by unmapped chunks never cap what a tag can map.
    pub region_size: Option<usize>,
    /// How many tags the resource can have, [`Tag::DEFAULT`] included (at least 1). The reservation is
    /// `max_tags * region_size` bytes of address space (no memory).
    pub max_tags: usize,
    /// Bytes per physical chunk, a multiple of the minimum granularity. `None`: the recommended
    /// granularity, at least 2 MiB.
    pub chunk_size: Option<usize>,
    /// When idle chunks (mapped, touched by no live allocation) are unmapped on the resource's own,
    /// besides [`ServiceResource::trim`](super::ServiceResource::trim) and sleep.
    pub reclaim: Reclaim,
    /// Whether chunks are created exportable as POSIX file descriptors (sharing with other processes).
    /// `None`: when the device supports it.
    pub shareable: Option<bool>,
    /// Whether chunks are marked GPUDirect RDMA capable (as `ncclMemAlloc` does). `None`: when the device
    /// supports it.
    pub gpu_direct_rdma: Option<bool>,
}

impl ServiceOptions {
    /// The default watermark: the resource keeps at most 15% more mapped than the most bytes ever live.
    pub const DEFAULT_RECLAIM: Reclaim = Reclaim::Watermark { percent: 15 };
}

impl Default for ServiceOptions {
    /// Eight tags of twice the device's memory each, 2 MiB chunks, the watermark
    /// [`DEFAULT_RECLAIM`](Self::DEFAULT_RECLAIM), shareable and RDMA-capable chunks where supported.
    fn default() -> Self {
        ServiceOptions {
            region_size: None,
            max_tags: 8,
            chunk_size: None,
            reclaim: Self::DEFAULT_RECLAIM,
            shareable: None,
            gpu_direct_rdma: None,
        }
    }
}

/// The range of one physical allocation (one mapping: one or more chunks), as [`ChunkObserver`]s see it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunkRange {
    /// The tag whose region it lies in.
    pub tag: Tag,
    /// Its first address.
    pub addr: DeviceAddr,
    /// Its length in bytes (a multiple of the chunk size).
    pub len: usize,
}

impl ChunkRange {
    /// One past its last address.
    pub fn end(&self) -> u64 {
        self.addr.0 + self.len as u64
    }
}

/// Told of every physical allocation a [`ServiceResource`](super::ServiceResource) maps and, before it is
/// unmapped, of every one it unmaps: growth, trimming, reclaim, sleep and wake. One call per allocation, so
/// an observer sees the boundaries of the `cuMemCreate` allocations behind the memory (NCCL's registered
/// transports are expected to need a buffer inside one). NCCL registration that follows the pool is one
/// (`mempool_nccl`'s `attach`).
///
/// The calls are made while the resource's lock is held: an observer must not call back into the
/// resource, and should be quick. A range reported unmapping was reported mapped before, with the same
/// address and length, except after a failed growth or wake, which reports the allocations it made and
/// undoes, some perhaps never reported mapped.
pub trait ChunkObserver: Send + Sync {
    /// `range` was mapped, and its device has read-write access.
    fn mapped(&self, range: ChunkRange);
    /// `range` is about to be unmapped, and the work that may still touch it has finished: every use of
    /// memory freed in it (the resource waited for the frees into its tag still in flight) and, when its
    /// tag sleeps or the resource drops with allocations live, the work on its live allocations (the
    /// resource waited for the whole context then). Otherwise other work on the device may still run: the
    /// resource does not wait for the whole device.
    fn unmapping(&self, range: ChunkRange);
}

/// Identifies an attached [`ChunkObserver`] for [`ServiceResource::detach`](super::ServiceResource::detach).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObserverId(pub(crate) u64);

/// What one tag holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagStats {
    /// The tag.
    pub tag: Tag,
    /// Its name.
    pub name: String,
    /// Whether it sleeps, and how.
    pub asleep: Option<SleepMode>,
    /// Bytes of live allocations (rounded as the engine rounds them).
    pub used_bytes: u64,
    /// The most bytes live at once (since the last peak reset).
    pub peak_used_bytes: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// Allocations made (since the resource was made).
    pub allocations: u64,
    /// Frees made.
    pub frees: u64,
    /// Physical memory mapped now.
    pub mapped_bytes: u64,
    /// Bytes kept in pinned host memory while it sleeps offloaded.
    pub offloaded_bytes: u64,
    /// The largest free block that lies in mapped memory: the largest allocation served without mapping.
    pub largest_free_mapped: u64,
    /// Ranges of it shared with other processes now ([`ServiceResource::export`](super::ServiceResource::export)).
    pub exports: u64,
}

/// What a [`ServiceResource`](super::ServiceResource) holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceStats {
    /// Physical memory mapped now, every tag.
    pub mapped_bytes: u64,
    /// The most that was mapped at once (since the last peak reset).
    pub peak_mapped_bytes: u64,
    /// Bytes of live allocations, every tag.
    pub used_bytes: u64,
    /// The most bytes live at once (since the last peak reset): the watermark's reference.
    pub peak_used_bytes: u64,
    /// The reserved virtual range's size.
    pub reservation_bytes: u64,
    /// The chunk size.
    pub chunk_size: u64,
    /// How many times idle chunks were unmapped to stay under the watermark (or before growth).
    pub reclaims: u64,
    /// Bytes unmapped by those reclaims and by trims.
    pub reclaimed_bytes: u64,
    /// Pinned host memory kept from earlier offloads for the next one (freed by
    /// [`ServiceResource::release_host_cache`](super::ServiceResource::release_host_cache) and on drop).
    pub host_cache_bytes: u64,
    /// Per tag, in tag order.
    pub tags: Vec<TagStats>,
}

/// What [`ServiceResource::sleep`](super::ServiceResource::sleep) released.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Physical memory unmapped and released.
    pub released_bytes: u64,
    /// Bytes copied to pinned host memory (offload).
    pub offloaded_bytes: u64,
}

/// What [`ServiceResource::wake`](super::ServiceResource::wake) brought back.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Physical memory mapped again.
    pub mapped_bytes: u64,
    /// Bytes copied back from pinned host memory.
    pub restored_bytes: u64,
}

/// When an expandable or service resource ([`crate::ExpandableResource`], [`crate::ServiceResource`])
/// unmaps idle chunks (mapped chunks no live allocation touches) on its own, besides its `trim`. Either
/// way it first waits for the frees into those chunks still in flight (the events it recorded on their
/// streams), not for the whole device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reclaim {
    /// Only when creating a chunk runs out of memory, then once more (PyTorch's behaviour): idle chunks
    /// stay mapped for reuse, so allocations that land on them map nothing.
    #[default]
    OnOutOfMemory,
    /// Also before mapping any new chunk: memory held never exceeds what live allocations touch plus the
    /// new chunks, at the price of a device synchronize and unmaps whenever the resource grows while it
    /// holds idle chunks.
    BeforeGrowth,
    /// Also before mapping new chunks when the memory mapped would pass `100 + percent` percent of the
    /// most bytes ever live (this allocation included): then every idle chunk is unmapped first. Under
    /// the watermark nothing is unmapped, so a workload in a steady state pays nothing; above it, the
    /// memory of holes no request fits is reused. The default of [`crate::ServiceResource`] (15%).
    Watermark {
        /// How far above the peak of live bytes the mapped memory may go, in percent.
        percent: u32,
    },
}
