//! The [`MemoryResource`] trait: stream-ordered allocation, as RMM's `device_memory_resource`.

use std::fmt::Debug;
use std::sync::Arc;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::Result;
use crate::observe::inspect::Inspection;

/// The one alignment of the workspace, defined by the suballocator engines: every allocation a
/// resource in this crate returns is aligned to it (as RMM's `CUDA_ALLOCATION_ALIGNMENT`).
pub use mempool_suballoc::{align_up, ALIGNMENT};

// Sizes are `usize` here and `u64` in the engines: the two convert losslessly (CUDA is 64-bit only).
const _: () = assert!(usize::BITS == u64::BITS);

/// A stream-ordered memory resource.
///
/// # Safety
/// The trait is `unsafe` to implement, as [`std::alloc::GlobalAlloc`] and [`std::alloc::Allocator`] are:
/// the safe owners built on it ([`crate::containers::DeviceBuffer`], [`crate::containers::DeviceVec`],
/// `CudarcBuffer`, the suballocating resources, mempool-ipc's exporter) copy into, hand out and free what
/// `allocate` returns without checking it. An implementation promises:
/// 1. A successful `allocate(bytes, stream)` returns null only when `bytes` is 0, and otherwise the start
///    of a range of at least `bytes` bytes, aligned to [`ALIGNMENT`], that nothing else owns: no live
///    allocation of this or any other resource overlaps it, and the resource neither uses it nor hands it
///    out again until it is passed back to `deallocate`. The caller owns it.
/// 2. The range is memory of this process that the CUDA driver reaches by unified addressing (device,
///    pinned host, managed, or pageable memory on a device with pageable memory access), usable by work
///    ordered on `stream` once `allocate` returns, and it stays valid until it is deallocated or the
///    resource is dropped.
/// 3. `is_equal(other)` returns `true` only when each of the two resources may deallocate what the other
///    allocated (callers rely on it to pick the resource that frees).
///
/// In return, `deallocate` may assume its own `# Safety` list.
///
/// A resource that hands out another buffer's address cannot be written without `unsafe`: a safe `impl`
/// does not compile.
///
/// ```compile_fail,E0200
/// use mempool_core::{DeviceAddr, StreamRef};
/// use mempool_rmm::{MemoryResource, Result};
///
/// #[derive(Debug)]
/// struct Aliasing(DeviceAddr);
///
/// impl MemoryResource for Aliasing {
///     fn allocate(&self, _bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
///         Ok(self.0) // the same address for every caller
///     }
///     unsafe fn deallocate(&self, _p: DeviceAddr, _n: usize, _s: StreamRef<'_>) -> Result<()> {
///         Ok(())
///     }
///     fn name(&self) -> &'static str {
///         "Aliasing"
///     }
/// }
/// ```
///
/// # The stream contract
/// - Memory from `allocate(n, A)` may be used by work on stream `A` at once, and by work on another
///   stream `B` only after `B` is ordered after `A` (an event recorded on `A` that `B` waits on, or a
///   synchronize).
/// - `deallocate(p, n, S)` means: `p` may be reused by work ordered after the work queued on `S` so far.
///   All work that uses `p` must already be ordered before that point of `S`.
/// - `deallocate` is `unsafe`: it takes a raw address, and freeing memory the caller does not own, or
///   freeing it twice, hands memory that is still in use to someone else (the driver's answer to a double
///   free is undefined behaviour). Its `# Safety` list is the whole contract; the RAII containers
///   ([`crate::containers::DeviceBuffer`], [`crate::containers::DeviceVec`], ...) are the safe way in and
///   out. Resources still detect the mismatches they can see and return
///   [`crate::Error::InvalidDeallocation`] rather than touch the memory.
///
/// # Other guarantees
/// - `allocate(0, _)` succeeds cheaply with a null pointer, and `deallocate` of a null pointer is a no-op.
/// - Running out of memory is [`crate::Error::OutOfMemory`] with the size asked for.
/// - Resources are `Send + Sync`; `Arc<dyn MemoryResource>` is the type-erased form
///   ([`SharedResource`]).
///
/// [`is_equal`]: MemoryResource::is_equal
#[allow(unsafe_code)]
pub unsafe trait MemoryResource: Send + Sync + Debug {
    /// Allocates `bytes`, ordered on `stream`.
    ///
    /// `#[track_caller]`: implementations see the user's call site through any stack of adaptors (the
    /// [`crate::adaptors::TrackingAdaptor`] records it).
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr>;

    /// Returns `ptr` to the resource, ordered on `stream`: the memory may be reused by work ordered after
    /// the work queued on `stream` so far. A null `ptr` is a no-op.
    ///
    /// # Safety
    /// 1. `ptr` is null, or was returned by `allocate(bytes, _)` of this resource or of one
    ///    [`is_equal`](MemoryResource::is_equal) to it, with this same `bytes`.
    /// 2. `ptr` has not been deallocated since it was allocated.
    /// 3. No use of the memory is ordered after this point of `stream`: every kernel, copy or other
    ///    access that touches it is queued on `stream` before this call or ordered before it (through an
    ///    event or a synchronize), and the caller does not touch the memory afterwards.
    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()>;

    /// Whether memory allocated by `self` may be deallocated by `other` and vice versa. The default is
    /// identity of the two objects.
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource)
    }

    /// A short name for reports and errors, e.g. `PoolResource`.
    fn name(&self) -> &'static str;

    /// The resource this one allocates from, for walking a stack from the top down (snapshots,
    /// out-of-memory reports, [`trim_unused`](Self::trim_unused)). `None` (the default) for a resource at the bottom.
    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        None
    }

    /// What the resource knows about the memory it holds, for snapshots and out-of-memory reports
    /// (off the allocation path: a suballocator walks its blocks). The default knows nothing.
    fn inspect(&self) -> Inspection {
        Inspection::default()
    }

    /// Returns memory the resource holds but no allocation uses to where it came from, then asks its
    /// upstream to do the same: what [`crate::adaptors::OomRetryAdaptor`] runs before it retries. The
    /// default asks only the upstream. `stream` orders the returns (suballocators return chunks on the
    /// legacy stream after ordering it after every free, as their `release_unused` does).
    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        match self.upstream_resource() {
            Some(u) => u.trim_unused(stream),
            None => Ok(()),
        }
    }
}

/// The type-erased, shareable form of a resource.
pub type SharedResource = Arc<dyn MemoryResource>;

// SAFETY: forwards every call to the shared resource unchanged.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource + ?Sized> MemoryResource for Arc<R> {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        (**self).allocate(bytes, stream)
    }
    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: forwarded with the caller's contract unchanged; `self` and `**self` are the same resource.
        unsafe { (**self).deallocate(ptr, bytes, stream) }
    }
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        (**self).is_equal(other)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        (**self).upstream_resource()
    }
    fn inspect(&self) -> Inspection {
        (**self).inspect()
    }
    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        (**self).trim_unused(stream)
    }
}

// SAFETY: forwards every call to the borrowed resource unchanged.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource + ?Sized> MemoryResource for &R {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        (**self).allocate(bytes, stream)
    }
    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: forwarded with the caller's contract unchanged; `self` and `**self` are the same resource.
        unsafe { (**self).deallocate(ptr, bytes, stream) }
    }
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        (**self).is_equal(other)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        (**self).upstream_resource()
    }
    fn inspect(&self) -> Inspection {
        (**self).inspect()
    }
    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        (**self).trim_unused(stream)
    }
}
