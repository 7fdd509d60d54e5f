//! Allocate and free: a tag's engine hands out the block and growth maps what it lands on; a free marks the
//! tag's fences for its stream and returns the block (also into a sleeping tag, as bookkeeping). The
//! [`MemoryResource`] impls of [`ServiceResource`] and of [`TaggedResource`], its view per tag.

use std::sync::Arc;

use mempool_core::{DeviceAddr, StreamRef};
use mempool_suballoc::{self as suballoc, Engine};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::resources::service::resource::{asleep_error, ServiceResource};
use crate::resources::service::state::{largest_free_mapped, State};
use crate::resources::service::types::Tag;
use crate::resources::suballoc::{map_engine_error, StreamKey};

impl ServiceResource {
    /// A [`MemoryResource`] that allocates under `tag` (frees go to whichever tag the address is in).
    pub fn tagged(self: &Arc<Self>, tag: Tag) -> TaggedResource {
        TaggedResource {
            inner: self.clone(),
            tag,
        }
    }

    /// Allocates `bytes` under `tag`, ordered on `stream`. Errors: a tag that is not this resource's, a
    /// sleeping tag, out of memory (naming the size, what is held and live, the largest free block and the
    /// device's free memory).
    pub fn allocate_tagged(&self, bytes: usize, tag: Tag, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let rounded = suballoc::align_up(bytes as u64).ok_or(Error::OutOfMemory {
            resource: self.name,
            requested: bytes,
        })?;
        let mut st = self.state();
        let ri = self.region_index(&st, tag)?;
        if st.regions[ri].asleep.is_some() {
            return Err(asleep_error(self.name, &st.regions[ri].name, "allocate from"));
        }
        let key = StreamKey::of(stream, &self.ctx)?;
        let addr = match st.regions[ri].engine.allocate(bytes as u64, key) {
            Ok(a) => a,
            Err(e) => {
                let e = map_engine_error(self.name, e);
                return Err(if e.is_out_of_memory() {
                    self.oom(&st, ri, bytes)
                } else {
                    e
                });
            }
        };
        let span = st.regions[ri].table.span(addr, rounded);
        if !st.regions[ri].table.all_mapped(span.clone()) {
            if let Err(e) = self.grow(&mut st, ri, span, rounded, stream) {
                let r = &mut st.regions[ri];
                // The block was never handed out: nothing used it, so it goes straight back.
                let _ = r.engine.deallocate(addr, bytes as u64, key);
                return Err(if e.is_out_of_memory() {
                    self.oom(&st, ri, bytes)
                } else {
                    e
                });
            }
        }
        st.used += rounded;
        st.peak_used = st.peak_used.max(st.used);
        let r = &mut st.regions[ri];
        r.used += rounded;
        r.peak_used = r.peak_used.max(r.used);
        r.allocations += 1;
        Ok(DeviceAddr(addr))
    }

    /// The out-of-memory error for `bytes` under region `ri`, with what the resource holds.
    fn oom(&self, st: &State, ri: usize, bytes: usize) -> Error {
        let device_free = self.ctx.memory_info().map(|m| m.free as u64).unwrap_or(0);
        let held = st.mapped_chunks() * self.chunk as u64;
        let mut r = crate::error::OutOfMemoryReport::new(bytes, self.name);
        r.stack = vec![self.name];
        r.tag = Some(st.regions[ri].name.clone());
        r.holder = Some(self.name);
        r.held = Some(held);
        r.held_as = Some("mapped");
        r.live = Some(st.used);
        r.free = Some(held.saturating_sub(st.used));
        r.largest_free = Some(largest_free_mapped(&st.regions[ri]));
        r.device_free = Some(device_free);
        Error::OutOfMemoryReport(Box::new(r))
    }

    /// Frees an allocation (of any tag) on `stream`. A tag that sleeps takes the free too, as bookkeeping:
    /// the block returns to its free list as address space, and the chunks only it touched are not
    /// mapped back when the tag wakes.
    fn deallocate_inner(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        let rounded = suballoc::align_up(bytes as u64).unwrap_or(bytes as u64);
        let mut st = self.state();
        let invalid = |reason: String| Error::InvalidDeallocation {
            resource: self.name,
            ptr: ptr.0,
            bytes,
            reason,
        };
        let ri = self
            .region_slot(ptr)
            .ok_or_else(|| invalid("the address is not in the resource's reservation".into()))?;
        if ri >= st.regions.len() {
            return Err(invalid(format!(
                "the address lies in the region of tag {ri}, which the resource has not made (it has {} tags)",
                st.regions.len()
            )));
        }
        if !st.regions[ri].table.contains(ptr.0, rounded.max(1)) {
            return Err(invalid(format!(
                "the range runs past the end of tag `{}`'s region",
                st.regions[ri].name
            )));
        }
        let r = &mut st.regions[ri];
        // Work queued on `stream` before this free may still use the block (the stream contract): the
        // tag's fences wait for it before any of the tag's chunks is unmapped. Marked before the engine
        // puts the block in a free list, so that whatever waits for the fences covers every free block.
        r.fences.freed_on(stream);
        // The engine refuses an address or size that is not a live allocation, before the table changes.
        r.engine
            .deallocate(ptr.0, bytes as u64, StreamKey::of(stream, &self.ctx)?)
            .map_err(|e| map_engine_error(self.name, e))?;
        r.used -= rounded;
        r.frees += 1;
        st.used -= rounded;
        Ok(())
    }
}

// SAFETY: 1. each region's engine hands out disjoint, aligned ranges of its region (its invariants, tested on
// the host), and regions are disjoint; a range is handed out again only after `deallocate` returned it.
// 2. `allocate` maps every chunk of the range before returning it. A chunk is unmapped only when no live
// allocation touches it (trim, the watermark's reclaim), by `sleep`, or by the drop, and each of them first
// waits for the frees in flight into its tag (the fences `deallocate` marks): no work ordered before a free
// runs on memory unmapped under it, or mapped again for someone else. The drop also waits for the whole
// context while allocations are live. `sleep` is the one way a live allocation's chunks are unmapped while
// `self` lives, and only its owner asks for it: the addresses stay reserved for that allocation (nothing
// else is mapped there, no other allocation is handed them), so work that still touches them, against
// `sleep`'s documentation, fails with the driver's error instead of reaching other memory, and `wake` maps
// them back for the same allocation. 3. `is_equal` is identity; the tagged views are equal to nothing else.
#[allow(unsafe_code)]
unsafe impl MemoryResource for ServiceResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.allocate_tagged(bytes, Tag::DEFAULT, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.deallocate_inner(ptr, bytes, stream)
    }

    fn name(&self) -> &'static str {
        self.name
    }

    /// Its mapped and live bytes with their peaks, and as chunks the mapped runs of the awake tags (adjacent
    /// mappings as one run), each with the used and free ranges of its region's engine.
    fn inspect(&self) -> crate::observe::inspect::Inspection {
        let chunks = self.mapped_runs();
        let st = self.stats();
        crate::observe::inspect::Inspection {
            held_bytes: Some(st.mapped_bytes),
            peak_held_bytes: Some(st.peak_mapped_bytes),
            live_bytes: Some(st.used_bytes),
            peak_live_bytes: Some(st.peak_used_bytes),
            live_count: Some(st.tags.iter().map(|t| t.live_allocations).sum()),
            allocations: Some(st.tags.iter().map(|t| t.allocations).sum()),
            device_free: self.ctx.memory_info().ok().map(|m| m.free as u64),
            chunks,
            has_chunks: true,
            ..crate::observe::inspect::Inspection::default()
        }
    }

    /// [`ServiceResource::trim`]: unmaps every idle chunk after waiting for the frees in flight.
    fn trim_unused(&self, _stream: StreamRef<'_>) -> Result<()> {
        self.trim().map(drop)
    }
}

/// A [`ServiceResource`] seen as a [`MemoryResource`] that allocates under one tag
/// ([`ServiceResource::tagged`]). Frees go to whichever tag the address lies in.
#[derive(Clone, Debug)]
pub struct TaggedResource {
    inner: Arc<ServiceResource>,
    tag: Tag,
}

impl TaggedResource {
    /// Its tag.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// The resource it allocates from.
    pub fn resource(&self) -> &Arc<ServiceResource> {
        &self.inner
    }
}

// SAFETY: forwards to the `ServiceResource`, whose impl upholds the contract; `is_equal` holds only for
// views of the same resource, which free each other's memory (a free finds the tag by address).
#[allow(unsafe_code)]
unsafe impl MemoryResource for TaggedResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.inner.allocate_tagged(bytes, self.tag, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.inner.deallocate_inner(ptr, bytes, stream)
    }

    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource)
    }

    fn name(&self) -> &'static str {
        self.inner.name
    }

    fn inspect(&self) -> crate::observe::inspect::Inspection {
        self.inner.inspect()
    }

    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        self.inner.trim_unused(stream)
    }
}
