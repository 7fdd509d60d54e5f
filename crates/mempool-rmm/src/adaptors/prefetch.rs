//! [`PrefetchAdaptor`]: moves managed memory to the device as it is allocated.

use std::sync::Arc;

use mempool_core::{memory, Context, Device, DeviceAddr, StreamRef};

use crate::error::Result;
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// Prefetches every allocation to a device on the allocating stream (`cuMemPrefetchAsync`), RMM's
/// `prefetch_resource_adaptor`. Meant for an upstream of managed memory
/// ([`crate::ManagedResource`]); on other memory the driver refuses and the allocation fails with that
/// error (and is returned to the upstream).
#[derive(Debug)]
pub struct PrefetchAdaptor<U> {
    upstream: U,
    device: Device,
    ctx: Arc<Context>,
}

impl<U: MemoryResource> PrefetchAdaptor<U> {
    /// Wraps `upstream`, prefetching to `device`.
    pub fn new(upstream: U, device: &Device) -> Result<Self> {
        Ok(PrefetchAdaptor {
            upstream,
            device: *device,
            ctx: device.context()?,
        })
    }
    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (it only prefetches what it returns), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for PrefetchAdaptor<U> {
    #[allow(unsafe_code)]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let p = self.upstream.allocate(bytes, stream).map_err(|e| explain(e, self))?;
        if p.is_null() {
            return Ok(p);
        }
        // SAFETY: `p..p+bytes` was just allocated and stays allocated until the caller deallocates, which
        // the stream contract orders after this prefetch.
        let r = unsafe { memory::prefetch_async(&self.ctx, p, bytes, Some(self.device), stream) };
        if let Err(e) = r {
            // SAFETY: `p` was just allocated by the upstream with `bytes` and never handed to the caller;
            // the only work that names it, the prefetch, was queued on `stream`, before this free.
            let _ = unsafe { self.upstream.deallocate(p, bytes, stream) };
            return Err(e.into());
        }
        Ok(p)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        "PrefetchAdaptor"
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}
