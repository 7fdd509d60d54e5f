//! The [`MemoryResource`] trait: stream-ordered allocation, as RMM's `device_memory_resource`.

use std::fmt::Debug;
use std::sync::Arc;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::Result;

/// Alignment of every allocation a resource in this crate returns, in bytes (as RMM's
/// `CUDA_ALLOCATION_ALIGNMENT`).
pub const ALIGNMENT: usize = 256;

/// Rounds `bytes` up to a multiple of [`ALIGNMENT`].
pub fn align_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// A stream-ordered memory resource.
///
/// # The stream contract
/// - Memory from `allocate(n, A)` may be used by work on stream `A` at once, and by work on another
///   stream `B` only after `B` is ordered after `A` (an event recorded on `A` that `B` waits on, or a
///   synchronize).
/// - `deallocate(p, n, S)` means: `p` may be reused by work ordered after the work queued on `S` so far.
///   All work that uses `p` must already be ordered before that point of `S`.
/// - `deallocate` takes the pointer and the size `allocate` was called with (`bytes`, not the rounded
///   size), and must be called on a resource equal to the one that allocated ([`is_equal`]).
///   Mismatches are logic errors: resources detect what they can and return
///   [`crate::Error::InvalidDeallocation`]; none touches the memory itself.
///
/// # Other guarantees
/// - Allocations are aligned to [`ALIGNMENT`] bytes.
/// - `allocate(0, _)` succeeds cheaply with a null pointer, and `deallocate` of a null pointer is a no-op.
/// - Running out of memory is [`crate::Error::OutOfMemory`] with the size asked for.
/// - Resources are `Send + Sync`; `Arc<dyn MemoryResource>` is the type-erased form
///   ([`SharedResource`]).
///
/// [`is_equal`]: MemoryResource::is_equal
pub trait MemoryResource: Send + Sync + Debug {
    /// Allocates `bytes`, ordered on `stream`.
    ///
    /// `#[track_caller]`: implementations see the user's call site through any stack of adaptors (the
    /// [`crate::adaptors::TrackingAdaptor`] records it).
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr>;

    /// Returns `ptr` (from `allocate(bytes, _)` of an equal resource), ordered on `stream`.
    fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()>;

    /// Whether memory allocated by `self` may be deallocated by `other` and vice versa. The default is
    /// identity of the two objects.
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource)
    }

    /// A short name for reports and errors, e.g. `PoolResource`.
    fn name(&self) -> &'static str;
}

/// The type-erased, shareable form of a resource.
pub type SharedResource = Arc<dyn MemoryResource>;

impl<R: MemoryResource + ?Sized> MemoryResource for Arc<R> {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        (**self).deallocate(ptr, bytes, stream)
    }
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        (**self).is_equal(other)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

impl<R: MemoryResource + ?Sized> MemoryResource for &R {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        (**self).deallocate(ptr, bytes, stream)
    }
    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        (**self).is_equal(other)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_rounds_up() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), 256);
        assert_eq!(align_up(256), 256);
        assert_eq!(align_up(257), 512);
    }
}
