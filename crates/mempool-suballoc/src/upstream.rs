//! Where engines get their chunks of address space (the host simulation is `crate::sim`).

use std::sync::Arc;

use crate::error::Error;

/// A source of large, stream-ordered allocations that an engine carves up.
///
/// On a GPU this is a memory resource over `cuMemAllocFromPoolAsync` or another resource; on the
/// host, `SimUpstream` (feature `testing`). `S` is the stream type of the engine's [`StreamOrder`](super::StreamOrder).
///
/// Contract, as for every stream-ordered resource: memory from `allocate(n, s)` may be used on `s`
/// at once and on other streams only after they are ordered after `s`; `deallocate(a, n, s)` means
/// the range may be reused by work ordered after `s`.
pub trait Upstream<S> {
    /// Allocates `bytes` (a non-zero multiple of [`ALIGNMENT`](crate::ALIGNMENT)) and returns an address aligned to
    /// [`ALIGNMENT`](crate::ALIGNMENT). Fails with [`Error::OutOfMemory`] when full (the engine may retry smaller),
    /// with any other [`Error`] otherwise.
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error>;
    /// Returns a range obtained from [`allocate`](Self::allocate) with the same `bytes`. Fails with
    /// an [`Error`] (usually [`Error::Upstream`]) when the upstream cannot take it back; the engine
    /// then forgets the range all the same and reports the error to its caller.
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error>;
}

impl<S, T: Upstream<S> + ?Sized> Upstream<S> for &T {
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error> {
        (**self).deallocate(addr, bytes, stream)
    }
}

impl<S, T: Upstream<S> + ?Sized> Upstream<S> for Arc<T> {
    fn allocate(&self, bytes: u64, stream: S) -> Result<u64, Error> {
        (**self).allocate(bytes, stream)
    }
    fn deallocate(&self, addr: u64, bytes: u64, stream: S) -> Result<(), Error> {
        (**self).deallocate(addr, bytes, stream)
    }
}
