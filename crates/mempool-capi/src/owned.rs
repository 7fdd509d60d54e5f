//! [`Allocation`]: memory from a resource, owned, freed once on drop on the stream it was allocated on.

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::SharedResource;

use crate::error::Result;

/// Bytes allocated from a resource on a stream, returned to that resource on that stream when dropped.
/// It keeps the resource alive (an `Arc`), so the memory outlives any change of the current resource.
///
/// The stream is kept by its raw handle: the [`Allocation::new`] contract is that it stays live until
/// the allocation is dropped, and that every use of the memory is ordered before the free the drop
/// queues on it.
#[derive(Debug)]
pub struct Allocation {
    addr: DeviceAddr,
    size: usize,
    stream: usize,
    mr: SharedResource,
}

impl Allocation {
    /// Allocates `size` bytes from `mr`, ordered on the stream `stream` (a raw `CUstream` value; 0 is the
    /// legacy default stream).
    ///
    /// # Safety
    /// 1. `stream` is a live stream of the resource's device (or a special handle: 0, 1 or 2), and stays
    ///    live until the allocation is dropped, where the memory is freed on it.
    /// 2. Every use of the memory is ordered before the point of `stream` where the drop queues the free:
    ///    work queued on `stream` before the drop is, and work on any other stream must be made to
    ///    complete first (synchronized, or `stream` made to wait on it with an event) before the
    ///    allocation is dropped; otherwise the memory can be reused while that work still runs.
    #[allow(unsafe_code)]
    pub unsafe fn new(mr: SharedResource, size: usize, stream: usize) -> Result<Allocation> {
        // SAFETY: point 1.
        let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
        let addr = mr.allocate(size, s)?;
        Ok(Allocation { addr, size, stream, mr })
    }

    /// The device address (0 for 0 bytes).
    pub fn addr(&self) -> u64 {
        self.addr.as_raw()
    }

    /// The size in bytes, as asked for.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The raw handle of the stream the memory was allocated on and will be freed on.
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// The resource the memory came from.
    pub fn resource(&self) -> &SharedResource {
        &self.mr
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `new`'s point 1 keeps the stream live until now.
        #[allow(unsafe_code)]
        let s = unsafe { StreamRef::from_raw(self.stream as mempool_core::RawStream) };
        // SAFETY: `addr` came from `mr.allocate(size, _)` in `new` and is freed only here, once; point 2 of
        // `new` orders every use of the memory before this point of the stream (as RMM's device_buffer,
        // whose destructor frees on its stream).
        #[allow(unsafe_code)]
        let r = unsafe { self.mr.deallocate(self.addr, self.size, s) };
        if let Err(e) = r {
            crate::error::record(&e.into());
        }
    }
}
