//! [`ExpandableResource`]: PyTorch's expandable segments. One reserved virtual range per device, grown
//! by mapping physical chunks where allocations land, suballocated by the coalescing pool engine as one
//! segment, so the address space never fragments across segments: a [`ServiceResource`] with one tag,
//! chunks that are not exportable, and PyTorch's reclaim policy by default.

use std::sync::Arc;

use mempool_core::{Device, DeviceAddr, StreamRef};

use crate::error::Result;
use crate::resource::MemoryResource;
use crate::resources::service::resource::ServiceResource;
use crate::resources::service::types::{Reclaim, ServiceOptions};

const NAME: &str = "ExpandableResource";

/// How an [`ExpandableResource`] is laid out.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpandableOptions {
    /// Bytes of virtual address space to reserve (rounded up to the chunk). `None`: twice the device's
    /// memory, so that holes left by unmapped chunks never cap what can be mapped.
    pub reservation: Option<usize>,
    /// Bytes per physical chunk, a multiple of the minimum granularity. `None`: the recommended
    /// granularity, at least 2 MiB (PyTorch's small segment size).
    pub chunk_size: Option<usize>,
    /// When idle chunks (mapped, touched by no live allocation) are unmapped besides
    /// [`ExpandableResource::trim`].
    pub reclaim: Reclaim,
}

/// What an [`ExpandableResource`] holds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpandableStats {
    /// Physical memory mapped now (chunks times the chunk size).
    pub mapped_bytes: u64,
    /// The most that was mapped at once.
    pub peak_mapped_bytes: u64,
    /// Bytes of live allocations (rounded as the engine rounds them).
    pub used_bytes: u64,
    /// The reserved virtual range's size.
    pub reservation_bytes: u64,
    /// The chunk size.
    pub chunk_size: u64,
}

/// PyTorch's expandable segments as a memory resource: one reserved virtual range on one device,
/// suballocated by the coalescing best-fit pool engine (the engine of [`crate::PoolResource`]) as a
/// single segment; physical memory is mapped in chunks where allocations land.
///
/// - `allocate` asks the engine for a block of the range, then maps (`cuMemCreate` + `cuMemMap` +
///   `cuMemSetAccess` for the device) every chunk the block touches that is not mapped yet, a run of
///   chunks as one physical allocation. Stream
///   semantics are the pool engine's (a stream reuses its own frees at once, other streams after an
///   event wait).
/// - Because there is one segment, free neighbours always coalesce: there is no per-segment
///   fragmentation of the address space, as there is when a pool grows by separate allocations.
/// - [`trim`](Self::trim) waits for the frees still in flight, then unmaps and releases every physical allocation
///   none of whose chunks a live allocation touches: free chunks at the end of what is in use, and in holes.
///   The addresses stay reserved; an allocation that lands there maps a chunk again.
/// - When a chunk cannot be created for lack of memory, the resource trims and tries once more before
///   reporting out-of-memory (as PyTorch frees cached blocks and retries). With
///   [`Reclaim::BeforeGrowth`] it also trims before every growth, so that it never holds idle chunks
///   while it maps new ones.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{ExpandableOptions, ExpandableResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = ExpandableResource::new(&dev, ExpandableOptions::default())?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(64 << 20, stream.as_ref())?;
/// assert!(mr.stats().mapped_bytes >= 64 << 20);
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 64 << 20, stream.as_ref()) }?;
/// mr.trim()?; // unmaps the chunks
/// assert_eq!(mr.stats().mapped_bytes, 0);
/// # Ok(()) }
/// ```
pub struct ExpandableResource {
    inner: Arc<ServiceResource>,
}

impl std::fmt::Debug for ExpandableResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.inner.device())
            .field("base", &self.inner.base())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ExpandableResource {
    /// An expandable resource on `device` laid out as `options` says ([`ExpandableOptions::default`]:
    /// PyTorch's layout). Reserves the address range now and maps nothing. Errors name the cause: a
    /// device without VMM support, a chunk size that is not a multiple of the granularity.
    pub fn new(device: &Device, options: ExpandableOptions) -> Result<ExpandableResource> {
        let inner = ServiceResource::with_name(
            device,
            ServiceOptions {
                region_size: options.reservation,
                max_tags: 1,
                chunk_size: options.chunk_size,
                reclaim: options.reclaim,
                shareable: Some(false),
                gpu_direct_rdma: Some(false),
            },
            NAME,
        )?;
        Ok(ExpandableResource { inner })
    }

    /// The device whose memory it hands out.
    pub fn device(&self) -> Device {
        self.inner.device()
    }

    /// The reserved range's first address.
    pub fn base(&self) -> DeviceAddr {
        self.inner.base()
    }

    /// What it holds now.
    pub fn stats(&self) -> ExpandableStats {
        let st = self.inner.stats();
        ExpandableStats {
            mapped_bytes: st.mapped_bytes,
            peak_mapped_bytes: st.peak_mapped_bytes,
            used_bytes: st.used_bytes,
            reservation_bytes: st.reservation_bytes,
            chunk_size: st.chunk_size,
        }
    }

    /// Waits for the frees still in flight (the events recorded on their streams), then unmaps and
    /// releases every physical allocation no live allocation touches. Returns the bytes released.
    pub fn trim(&self) -> Result<u64> {
        self.inner.trim()
    }
}

// SAFETY: forwards to its `ServiceResource`, whose impl upholds the contract.
#[allow(unsafe_code)]
unsafe impl MemoryResource for ExpandableResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.inner.allocate(bytes, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: the caller's contract for `self` is the inner resource's: it made every allocation.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn inspect(&self) -> crate::observe::inspect::Inspection {
        self.inner.inspect()
    }

    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        self.inner.trim_unused(stream)
    }
}
