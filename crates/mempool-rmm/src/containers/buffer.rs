//! [`DeviceBuffer`]: untyped, uninitialised device memory from a resource.

#[cfg(feature = "cudarc")]
use mempool_core::DeviceAddr;
use mempool_core::{memory, BufferView, StreamRef};

use crate::error::{Error, Result};
use crate::resource::SharedResource;

/// Untyped, uninitialised device memory from a resource, RMM's `device_buffer`: allocated on a stream,
/// freed there when dropped, resizable in stream order.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{containers::DeviceBuffer, registry::current_device_resource};
/// let dev = Device::get(0)?;
/// let stream = Stream::new(&dev.context()?)?;
/// let mr = current_device_resource(&dev)?;
/// let mut buf = DeviceBuffer::from_host(b"hello", &stream, mr)?;
/// buf.resize(4096)?; // the first 5 bytes are kept
/// assert_eq!(&buf.to_host()?[..5], b"hello");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<'s> {
    // Invariants: `view.ptr()` is null iff `capacity == 0`; `view.len() <= capacity`; the address came
    // from `mr.allocate(capacity, view.stream())` and is returned with exactly that size, once.
    view: BufferView<'s>,
    capacity: usize,
    mr: SharedResource,
}

impl<'s> DeviceBuffer<'s> {
    /// `size` uninitialised bytes from `mr`, ordered on `stream` (a `&Stream`, or a [`StreamRef`] whose
    /// context is known: see [`StreamRef::in_context`]).
    ///
    /// Errors: [`Error::Unsupported`] for a stream whose context is unknown (a special or raw handle
    /// without [`StreamRef::in_context`]); the resource's errors.
    pub fn new(size: usize, stream: impl Into<StreamRef<'s>>, mr: SharedResource) -> Result<Self> {
        let stream = stream.into();
        let ctx = stream.context().cloned().ok_or_else(|| Error::Unsupported {
            resource: "DeviceBuffer",
            reason: "the stream's context is unknown (a special or raw stream handle): attach it with \
                     StreamRef::in_context"
                .into(),
        })?;
        let ptr = mr.allocate(size, stream)?;
        // SAFETY: `ptr` is a fresh allocation of `size` bytes from `mr` on `stream` (null only for 0 bytes):
        // device, pinned or managed memory of this process, which the driver reaches by unified addressing
        // from any context (point 1); the buffer owns it until it frees it through `mr` (Drop or
        // `reallocate`), so it outlives the view; it was allocated on `stream` (point 2), whose context is
        // known and is the one the view binds (point 3); a null `ptr` only for 0 bytes (point 4).
        #[allow(unsafe_code)]
        let view = unsafe { BufferView::new(ptr, size, stream, ctx) };
        Ok(DeviceBuffer {
            view,
            capacity: size,
            mr,
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_host(data: &[u8], stream: impl Into<StreamRef<'s>>, mr: SharedResource) -> Result<Self> {
        let buf = DeviceBuffer::new(data.len(), stream, mr)?;
        buf.copy_from_host(0, data)?;
        Ok(buf)
    }

    /// The allocated bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The resource it allocates from.
    pub fn resource(&self) -> &SharedResource {
        &self.mr
    }

    /// Makes the capacity at least `capacity`, keeping the contents (a new allocation and a copy, in
    /// stream order, when it grows).
    pub fn reserve(&mut self, capacity: usize) -> Result<()> {
        if capacity > self.capacity {
            self.reallocate(capacity)?;
        }
        Ok(())
    }

    /// Sets the size; grows the capacity if needed (contents up to the old size are kept; new bytes are
    /// uninitialised). Shrinking keeps the capacity: see [`DeviceBuffer::shrink_to_fit`].
    pub fn resize(&mut self, size: usize) -> Result<()> {
        self.reserve(size)?;
        // SAFETY: `size <= capacity` after `reserve`, so the range lies inside the allocation the buffer
        // holds; a null address only comes with capacity 0, hence size 0.
        #[allow(unsafe_code)]
        unsafe {
            self.view.set_len(size)
        };
        Ok(())
    }

    /// Makes the capacity equal to the size.
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        if self.capacity != self.view.len() {
            self.reallocate(self.view.len())?;
        }
        Ok(())
    }

    /// Gives the allocation up without freeing it: (address, length, capacity, resource). The caller owns
    /// the memory from here on and returns it to the resource (`capacity` bytes) once; work queued on the
    /// buffer's stream so far may still use it.
    #[cfg(feature = "cudarc")]
    pub(crate) fn into_allocation(mut self) -> (DeviceAddr, usize, usize, SharedResource) {
        let (addr, len) = self.view.take();
        // `self` drops with an empty view: nothing is freed.
        (addr, len, self.capacity, self.mr.clone())
    }

    fn reallocate(&mut self, capacity: usize) -> Result<()> {
        let stream = self.view.stream();
        let ctx = self.view.context().clone();
        let new = self.mr.allocate(capacity, stream)?;
        let keep = self.view.len().min(capacity);
        if keep > 0 {
            // SAFETY: both allocations are live and at least `keep` bytes; the copy is ordered on the
            // stream both were allocated on, before the old one's free below.
            #[allow(unsafe_code)]
            let r = unsafe { memory::copy_device_async(&ctx, new, self.view.ptr(), keep, stream) };
            if let Err(e) = r {
                // SAFETY: `new` came from `self.mr.allocate(capacity, stream)` just above, is freed once
                // here, and the only work naming it (the failed copy) was queued on `stream`.
                #[allow(unsafe_code)]
                let _ = unsafe { self.mr.deallocate(new, capacity, stream) };
                return Err(e.into());
            }
        }
        // SAFETY: `new` is a fresh allocation of `capacity >= keep` bytes of `mr` on `stream`, in `ctx`; the
        // buffer owns it from here on (the old view is released just below).
        #[allow(unsafe_code)]
        let mut old = std::mem::replace(&mut self.view, unsafe { BufferView::new(new, keep, stream, ctx) });
        let old_capacity = std::mem::replace(&mut self.capacity, capacity);
        let mr = &self.mr;
        old.release_with(|addr, _, stream| {
            // SAFETY: `addr`/`old_capacity` were this buffer's allocation from `mr` on `stream` (the struct
            // invariant), handed out once by `release_with`; the copy out of it and every use made through
            // the buffer were queued on `stream`, before this free.
            #[allow(unsafe_code)]
            unsafe {
                mr.deallocate(addr, old_capacity, stream)
            }
        })
    }
}

impl<'s> std::ops::Deref for DeviceBuffer<'s> {
    type Target = BufferView<'s>;

    /// The bytes `0..len()`: address, size, stream, context, host copies and fills.
    fn deref(&self) -> &BufferView<'s> {
        &self.view
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        let (mr, capacity) = (&self.mr, self.capacity);
        // Errors cannot leave a destructor; the resource has reported what it can.
        let _ = self.view.release_with(|addr, _, stream| {
            // SAFETY: the buffer owns `addr` (from `mr.allocate(capacity, stream)`, the struct invariant),
            // handed out once by `release_with`; every use made through the buffer was queued on `stream`,
            // and the borrow of `self` has ended, so nothing uses it after this point of the stream.
            #[allow(unsafe_code)]
            unsafe {
                mr.deallocate(addr, capacity, stream)
            }
        });
    }
}
