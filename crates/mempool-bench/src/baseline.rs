//! The raw baselines every run measures beside the resources under test: `cuMemAlloc` / `cuMemFree`
//! and `cuMemAllocFromPoolAsync` / `cuMemFreeAsync`, with nothing of mempool-rmm in between.

use std::sync::Arc;

use mempool_core::{memory, Context, Device, DeviceAddr, MemPool, PoolProps, StreamRef};
use mempool_rmm::{MemoryResource, Result};

/// `cuMemAlloc` / `cuMemFree` straight through, as RMM's `cuda_memory_resource` does: the free does not
/// wait for the stream itself, it relies on `cuMemFree`'s implicit synchronization with the device (which
/// is what makes it the allocator that serializes streams).
#[derive(Debug)]
pub(crate) struct RawCudaResource {
    ctx: Arc<Context>,
}

impl RawCudaResource {
    /// In `device`'s primary context.
    pub(crate) fn new(device: &Device) -> Result<RawCudaResource> {
        Ok(RawCudaResource { ctx: device.context()? })
    }
}

// SAFETY: `cuMemAlloc` returns fresh device memory of at least `bytes` bytes (aligned to 256, null only for 0 bytes), which nothing else owns until `deallocate` frees it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for RawCudaResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        Ok(memory::device_alloc(&self.ctx, bytes)?)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, _bytes: usize, _stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: by the caller's obligations 1-3 `ptr` came from `allocate` here (cuMemAlloc in this context) and
        // is freed once; cuMemFree synchronizes with the device's outstanding work before releasing it.
        unsafe { memory::device_free(&self.ctx, ptr) }?;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "cuMemAlloc"
    }
}

/// `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool of its own whose release threshold keeps
/// everything (as a process that owns its GPU runs it).
#[derive(Debug)]
pub(crate) struct RawPoolResource {
    pool: MemPool,
}

impl RawPoolResource {
    /// A new pool on `device`.
    pub(crate) fn new(device: &Device) -> Result<RawPoolResource> {
        let pool = MemPool::new(device, &PoolProps::new())?;
        pool.keep_everything()?;
        Ok(RawPoolResource { pool })
    }
}

// SAFETY: the pool (owned by `self`, destroyed only when `self` drops) returns fresh stream-ordered allocations, aligned to 256 and null only for 0 bytes, that nothing else owns until `deallocate` frees them.
#[allow(unsafe_code)]
unsafe impl MemoryResource for RawPoolResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        Ok(self.pool.allocate(bytes, stream)?)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, _bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: by the caller's obligations 1-3 `ptr` came from `allocate` here (this pool), is freed once, and
        // its uses are ordered before this point of `stream`.
        unsafe { self.pool.free_async(ptr, stream) }?;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "cuMemAllocFromPoolAsync"
    }
}
