//! [`DeviceBuffer`]: untyped, uninitialised device memory from a resource.

use mempool_core::{memory, DeviceAddr, Stream};

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
    // Invariants: `ptr` is null iff `capacity == 0`; `size <= capacity`; `ptr` came from
    // `mr.allocate(capacity, stream)` and is returned with exactly that size.
    ptr: DeviceAddr,
    size: usize,
    capacity: usize,
    stream: &'s Stream,
    mr: SharedResource,
}

impl<'s> DeviceBuffer<'s> {
    /// `size` uninitialised bytes from `mr`, ordered on `stream`.
    pub fn new(size: usize, stream: &'s Stream, mr: SharedResource) -> Result<Self> {
        let ptr = mr.allocate(size, stream.as_ref())?;
        Ok(DeviceBuffer {
            ptr,
            size,
            capacity: size,
            stream,
            mr,
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_host(data: &[u8], stream: &'s Stream, mr: SharedResource) -> Result<Self> {
        let buf = DeviceBuffer::new(data.len(), stream, mr)?;
        buf.copy_from_host(0, data)?;
        Ok(buf)
    }

    /// The device address (null when the capacity is 0).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }
    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.size
    }
    /// Whether the size is 0.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    /// The allocated bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The stream the buffer is ordered on.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }
    /// The resource it allocates from.
    pub fn resource(&self) -> &SharedResource {
        &self.mr
    }

    /// Copies `src` to `offset..offset+src.len()` and waits for the copy.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside this live allocation (checked); the copy is ordered on the
        // buffer's stream, which allocated it.
        #[allow(unsafe_code)]
        unsafe {
            memory::copy_to_device(
                self.stream.context(),
                self.ptr.offset(offset),
                src,
                self.stream.as_ref(),
            )
        }?;
        Ok(())
    }

    /// Copies `offset..offset+dst.len()` into `dst` and waits for the copy.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `copy_from_host`.
        #[allow(unsafe_code)]
        unsafe {
            memory::copy_to_host(
                self.stream.context(),
                dst,
                self.ptr.offset(offset),
                self.stream.as_ref(),
            )
        }?;
        Ok(())
    }

    /// The whole buffer, copied to the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.size];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// Fills the buffer with `value`, ordered on its stream (does not wait).
    pub fn fill(&self, value: u8) -> Result<()> {
        if self.size == 0 {
            return Ok(());
        }
        // SAFETY: the whole size lies in this live allocation, written in the buffer's stream order.
        #[allow(unsafe_code)]
        unsafe { memory::fill_async(self.stream.context(), self.ptr, value, self.size, self.stream.as_ref()) }?;
        Ok(())
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
        self.size = size;
        Ok(())
    }

    /// Makes the capacity equal to the size.
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        if self.capacity != self.size {
            self.reallocate(self.size)?;
        }
        Ok(())
    }

    fn reallocate(&mut self, capacity: usize) -> Result<()> {
        let new = self.mr.allocate(capacity, self.stream.as_ref())?;
        let keep = self.size.min(capacity);
        if keep > 0 {
            // SAFETY: both allocations are live and at least `keep` bytes; the copy is ordered on the
            // stream both were allocated on, before the old one's free below.
            #[allow(unsafe_code)]
            let r =
                unsafe { memory::copy_device_async(self.stream.context(), new, self.ptr, keep, self.stream.as_ref()) };
            if let Err(e) = r {
                // SAFETY: `new` came from `self.mr.allocate(capacity, stream)` just above, is freed once
                // here, and the only work naming it (the failed copy) was queued on `stream`.
                #[allow(unsafe_code)]
                let _ = unsafe { self.mr.deallocate(new, capacity, self.stream.as_ref()) };
                return Err(e.into());
            }
        }
        let old = std::mem::replace(&mut self.ptr, new);
        let old_capacity = std::mem::replace(&mut self.capacity, capacity);
        self.size = keep;
        // SAFETY: `old`/`old_capacity` were this buffer's allocation from `self.mr` on `self.stream` (the
        // struct invariant) and the buffer no longer holds them, so they are freed once; the copy out of
        // it and every use made through the buffer were queued on `self.stream`, before this free.
        #[allow(unsafe_code)]
        unsafe {
            self.mr.deallocate(old, old_capacity, self.stream.as_ref())
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::Unsupported {
                resource: "DeviceBuffer",
                reason: format!(
                    "range {offset}..{offset}+{len} is outside a buffer of {} bytes",
                    self.size
                ),
            }),
        }
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // Errors cannot leave a destructor; the resource has reported what it can.
        // SAFETY: the buffer owns `ptr` (from `self.mr.allocate(capacity, stream)`, the struct invariant)
        // and frees it exactly once, here; every use made through the buffer was queued on `self.stream`,
        // and the borrow of `self` has ended, so nothing uses it after this point of the stream.
        #[allow(unsafe_code)]
        let _ = unsafe { self.mr.deallocate(self.ptr, self.capacity, self.stream.as_ref()) };
    }
}
