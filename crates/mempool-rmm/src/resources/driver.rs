//! Resources over plain driver allocations: device (`cuMemAlloc`), managed and pinned host memory.
//! These are synchronous: allocation and free wait for the device as the driver calls do, so they ignore
//! the stream except to order the free after it.

use std::sync::Arc;

use mempool_core::{memory, Context, Device, DeviceAddr, Event, EventFlags, StreamRef};

use crate::error::Result;
use crate::resource::MemoryResource;

/// Blocks until the work queued on `stream` so far is done, for a resource of `ctx` that frees at once
/// (not stream-ordered) what was freed on `stream`: the plain driver resources, `VmmResource`. A stream
/// that knows no context is taken as one of `ctx`.
///
/// For the legacy stream, an event recorded on it and waited for, not a synchronize of it: work queued on
/// the blocking streams (per-thread streams included) before the record is ordered before it, which is
/// not documented of a synchronize of the legacy stream; a free on another thread of memory of a thread's
/// per-thread stream comes here as the legacy stream (`KeptStream`). No wait on the whole context:
/// non-blocking streams' work was ordered before the free by the caller, through the stream it names.
pub(crate) fn wait_before_immediate_free(ctx: &Arc<Context>, stream: StreamRef<'_>) -> Result<()> {
    let ctx = stream.context().unwrap_or(ctx);
    let stream = stream.in_context(ctx);
    if stream.is_legacy() {
        let done = Event::new(ctx, EventFlags::DISABLE_TIMING)?;
        done.record(stream)?;
        done.synchronize()?;
    } else {
        stream.synchronize()?;
    }
    Ok(())
}

macro_rules! plain_resource {
    ($(#[$doc:meta])* $name:ident, $alloc:expr, $free:expr) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            ctx: Arc<Context>,
        }

        impl $name {
            /// A resource allocating in `device`'s primary context.
            pub fn new(device: &Device) -> Result<$name> {
                Ok($name { ctx: device.context()? })
            }

            /// The context allocations are made in.
            pub fn context(&self) -> &Arc<Context> {
                &self.ctx
            }
        }

        // SAFETY: each allocation is a fresh driver allocation (`cuMemAlloc`, `cuMemAllocManaged` or `cuMemHostAlloc`: at least `bytes` bytes, aligned to at least 256, null only for 0 bytes) that nothing else owns until `deallocate` frees it.
        #[allow(unsafe_code)]
        unsafe impl MemoryResource for $name {
            fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
                let alloc: fn(&Context, usize) -> mempool_core::Result<DeviceAddr> = $alloc;
                alloc(&self.ctx, bytes).map_err(|e| crate::observe::oom::explain(e.into(), self))
            }

            #[allow(unsafe_code)]
            unsafe fn deallocate(&self, ptr: DeviceAddr, _bytes: usize, stream: StreamRef<'_>) -> Result<()> {
                if ptr.is_null() {
                    return Ok(());
                }
                // The free is immediate: wait for the stream, after which no ordered work uses `ptr`.
                wait_before_immediate_free(&self.ctx, stream)?;
                // SAFETY: by the trait's contract `ptr` came from this resource's `allocate` and is returned
                // once; its uses were ordered before this point of `stream`, which has completed.
                unsafe { ($free)(&self.ctx, ptr) }?;
                Ok(())
            }

            fn name(&self) -> &'static str {
                stringify!($name)
            }
        }
    };
}

plain_resource!(
    /// Device memory from `cuMemAlloc` / `cuMemFree`, RMM's `cuda_memory_resource`: the baseline every
    /// pool is measured against. Each call goes to the driver and the free synchronizes.
    CudaResource,
    memory::device_alloc,
    memory::device_free
);

plain_resource!(
    /// Managed (unified) memory from `cuMemAllocManaged`, RMM's `managed_memory_resource`. Pair it with
    /// [`crate::adaptors::PrefetchAdaptor`] to move pages to the device ahead of use.
    ManagedResource,
    memory::managed_alloc,
    memory::device_free
);

fn pinned_alloc(ctx: &Context, bytes: usize) -> mempool_core::Result<DeviceAddr> {
    memory::pinned_host_alloc(ctx, bytes).map(|p| DeviceAddr(p as u64))
}

/// Frees pinned host memory from [`pinned_alloc`].
///
/// # Safety
/// 1. `ptr` came from `pinned_alloc(ctx, _)` and has not been freed since.
/// 2. No work uses the memory any more (the caller synchronized the stream that used it), and nothing
///    touches it afterwards.
#[allow(unsafe_code)]
unsafe fn pinned_free(ctx: &Context, ptr: DeviceAddr) -> mempool_core::Result<()> {
    // SAFETY: the caller's contract: `ptr` came from `pinned_alloc` and is freed once.
    unsafe { memory::pinned_host_free(ctx, ptr.0 as *mut u8) }
}

plain_resource!(
    /// Page-locked host memory from `cuMemHostAlloc` (portable), RMM's `pinned_host_memory_resource`.
    /// The returned address is a host pointer, valid on the device through unified addressing.
    PinnedHostResource,
    pinned_alloc,
    pinned_free
);
