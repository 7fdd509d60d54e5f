//! [`CudarcBuffer`] (feature `cudarc`): typed device memory from a resource that cudarc's copies,
//! kernel launches and NCCL collectives take, freed by mempool.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop, ValidAsZeroBits,
};
use mempool_core::{DeviceAddr, Event, EventFlags, StreamRef};

use crate::containers::buffer::DeviceBuffer;
use crate::error::{Error, Result};
use crate::resource::SharedResource;

fn cudarc_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    mempool_core::Error::from_cudarc(call, e).into()
}

/// `len` elements of `T` in device memory from a mempool resource, ordered on a cudarc stream: cudarc's
/// `CudaSlice`, with the memory coming from (and going back to) mempool.
///
/// It implements cudarc's [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`], so cudarc's copies
/// (`memcpy_htod`, `memcpy_dtoh`, `memcpy_dtod`, `clone_dtoh`, `memset_zeros`) and its NCCL collectives
/// (`Comm::all_reduce`, ...) take it as they take a `CudaSlice`. Kernel launches take its address:
/// cudarc's `PushKernelArg` is implemented for its own slice types only (its fields are private), so
/// pass the address that [`DevicePtr::device_ptr`] / [`DevicePtrMut::device_ptr_mut`] return and keep
/// their guard alive until the launch is queued (docs/cudarc.md shows it).
///
/// Ordering follows cudarc's contract for `CudaSlice`: the buffer holds a read and a write event;
/// `device_ptr(s)` makes `s` wait for earlier writes (and, unlike `CudaSlice`, for the last recorded
/// read, so that the one read event covers every read on any stream: reads on two streams are then
/// ordered one after the other) and records a read after the use,
/// `device_ptr_mut(s)` waits for earlier reads and writes and records a write (cudarc records them
/// while its context tracks events across streams, i.e. once a second stream was made with
/// `new_stream`). The buffer is freed by mempool, never by cudarc: `Drop` makes the buffer's stream wait
/// on both events and returns the memory to the resource on that stream, so the free is ordered after
/// every recorded use on any stream.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use cudarc::driver::CudaContext;
/// use mempool_core::Device;
/// use mempool_rmm::{containers::CudarcBuffer, registry::current_device_resource};
/// let cuda = CudaContext::new(0).unwrap();
/// let stream = cuda.default_stream();
/// let mr = current_device_resource(&Device::get(0)?)?;
/// let src = CudarcBuffer::from_host(&[1.0f32, 2.0, 3.0], &stream, mr.clone())?;
/// let mut dst = CudarcBuffer::<f32>::alloc_zeros(3, &stream, mr)?;
/// stream.memcpy_dtod(&src, &mut dst).unwrap();
/// assert_eq!(stream.clone_dtoh(&dst).unwrap(), [1.0, 2.0, 3.0]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CudarcBuffer<T> {
    // Invariants: `addr` came from `mr.allocate(bytes, _)` (null only when `bytes == 0`), is owned by this
    // value alone and returned to `mr` exactly once, in `Drop`; `len * size_of::<T>() <= bytes`; every use
    // handed out through the cudarc traits waits on / records `read` and `write` as cudarc's `CudaSlice`
    // does.
    addr: sys::CUdeviceptr,
    len: usize,
    bytes: usize,
    mr: SharedResource,
    stream: Arc<CudaStream>,
    read: Option<CudaEvent>,
    write: Option<CudaEvent>,
    _elem: PhantomData<fn() -> T>,
}

impl<T: DeviceRepr> CudarcBuffer<T> {
    /// `len` elements from `mr`, allocated on `stream`, contents unset.
    ///
    /// Errors: [`Error::Unsupported`] when `len * size_of::<T>()` overflows; the resource's errors
    /// ([`Error::OutOfMemory`] with the bytes asked for); a failed event creation.
    ///
    /// # Safety
    /// 1. The contents are whatever the memory held: write them (a copy, `memset_zeros`, a kernel) before
    ///    reading them back as `T` on the host, unless every bit pattern is a valid `T`.
    #[allow(unsafe_code)]
    pub unsafe fn alloc(len: usize, stream: &Arc<CudaStream>, mr: SharedResource) -> Result<Self> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| Error::Unsupported {
            resource: "CudarcBuffer",
            reason: format!("{len} elements of {} bytes overflow usize", size_of::<T>()),
        })?;
        let target = primary_stream(stream)?;
        let (read, write) = Self::events(stream)?;
        let addr = mr.allocate(bytes, target)?;
        Ok(CudarcBuffer {
            addr: addr.0,
            len,
            bytes,
            mr,
            stream: stream.clone(),
            read,
            write,
            _elem: PhantomData,
        })
    }

    /// `len` zeroed elements from `mr`, ordered on `stream` (allocation and `cuMemsetD8Async`).
    pub fn alloc_zeros(len: usize, stream: &Arc<CudaStream>, mr: SharedResource) -> Result<Self>
    where
        T: ValidAsZeroBits,
    {
        // SAFETY: the contents are zeroed just below, before anyone can read them (point 1).
        #[allow(unsafe_code)]
        let mut buf = unsafe { Self::alloc(len, stream, mr)? };
        stream
            .memset_zeros(&mut buf)
            .map_err(|e| cudarc_error("cuMemsetD8Async", e))?;
        Ok(buf)
    }

    /// A copy of `data` in memory from `mr`, ordered on `stream` (`cuMemcpyHtoDAsync`).
    pub fn from_host(data: &[T], stream: &Arc<CudaStream>, mr: SharedResource) -> Result<Self> {
        // SAFETY: every element is written by the copy just below, queued before any other use (point 1).
        #[allow(unsafe_code)]
        let mut buf = unsafe { Self::alloc(data.len(), stream, mr)? };
        stream
            .memcpy_htod(data, &mut buf)
            .map_err(|e| cudarc_error("cuMemcpyHtoDAsync", e))?;
        Ok(buf)
    }

    /// Takes over a [`DeviceBuffer`]'s allocation (no copy) as `buf.len() / size_of::<T>()` elements
    /// ordered on `stream`: `stream` is made to wait for the work queued on the buffer's own stream so far
    /// (an event), and the memory goes back to the buffer's resource when the `CudarcBuffer` drops.
    ///
    /// Errors: [`Error::Unsupported`] when the length is not a whole number of `T` (the buffer is freed
    /// as usual); event failures.
    pub fn from_device_buffer(buf: DeviceBuffer<'_>, stream: &Arc<CudaStream>) -> Result<Self>
    where
        T: bytemuck::Pod,
    {
        let size = size_of::<T>();
        if size == 0 || buf.len() % size != 0 {
            return Err(Error::Unsupported {
                resource: "CudarcBuffer",
                reason: format!("{} bytes are not a whole number of {size}-byte elements", buf.len()),
            });
        }
        let target = primary_stream(stream)?;
        if target.context().map(|c| c.as_raw()) != Some(buf.context().as_raw()) {
            return Err(Error::Unsupported {
                resource: "CudarcBuffer",
                reason: format!(
                    "the cudarc stream is a stream of device {}, the buffer's memory was allocated in the \
                     context of {}",
                    stream.context().ordinal(),
                    buf.context().device()
                ),
            });
        }
        let (read, write) = Self::events(stream)?;
        if buf.stream() != target {
            let event = Event::new(buf.context(), EventFlags::DISABLE_TIMING)?;
            event.record(buf.stream())?;
            target.wait(&event)?;
        }
        let (addr, len, capacity, mr) = buf.into_allocation();
        Ok(CudarcBuffer {
            addr: addr.0,
            len: len / size,
            bytes: capacity,
            mr,
            stream: stream.clone(),
            read,
            write,
            _elem: PhantomData,
        })
    }

    fn events(stream: &Arc<CudaStream>) -> Result<(Option<CudaEvent>, Option<CudaEvent>)> {
        // Made whether or not cudarc tracks events now: cudarc turns tracking on with its first
        // `new_stream`, which may come after this buffer was allocated.
        let event = || {
            stream
                .context()
                .new_event(None)
                .map_err(|e| cudarc_error("cuEventCreate", e))
        };
        Ok((Some(event()?), Some(event()?)))
    }
}

impl<T> CudarcBuffer<T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len() * size_of::<T>()`.
    pub fn num_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address of the first element. Using it directly bypasses the ordering of
    /// [`DevicePtr::device_ptr`]; prefer those.
    pub fn addr(&self) -> DeviceAddr {
        DeviceAddr(self.addr)
    }

    /// The stream it was allocated on and is freed on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The resource the memory came from and goes back to.
    pub fn resource(&self) -> &SharedResource {
        &self.mr
    }

    /// Elements `range`, read-only, with the buffer's ordering events; `None` when the range is out of
    /// bounds.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Option<CudarcView<'_, T>> {
        let (start, len) = bounds(range, self.len)?;
        Some(CudarcView {
            ptr: self.addr + (start * size_of::<T>()) as u64,
            len,
            stream: &self.stream,
            read: &self.read,
            write: &self.write,
            _elem: PhantomData,
        })
    }

    /// Elements `range`, writable, with the buffer's ordering events; `None` when the range is out of
    /// bounds.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CudarcViewMut<'_, T>> {
        let (start, len) = bounds(range, self.len)?;
        Some(CudarcViewMut {
            ptr: self.addr + (start * size_of::<T>()) as u64,
            len,
            stream: &self.stream,
            read: &self.read,
            write: &self.write,
            _elem: PhantomData,
        })
    }
}

/// `range` inside `0..len` as (start, length).
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then(|| (start, end - start))
}

/// Makes `stream` wait for the events cudarc recorded (only while cudarc tracks events, as cudarc does).
fn wait_for(stream: &CudaStream, owner: &CudaStream, events: &[&Option<CudaEvent>]) {
    if owner.context().is_managing_stream_synchronization() {
        for event in events.iter().copied().flatten() {
            stream.context().record_err(stream.wait(event));
        }
    }
}

impl<T> DeviceSlice<T> for CudarcBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CudarcBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // The read event is re-recorded below: waiting on its last recording first makes the new one
        // cover every earlier read, on any stream (one event, so the free can follow them all).
        wait_for(stream, &self.stream, &[&self.write, &self.read]);
        (self.addr, SyncOnDrop::record_event(&self.read, stream))
    }
}

impl<T> DevicePtrMut<T> for CudarcBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        wait_for(stream, &self.stream, &[&self.read, &self.write]);
        (self.addr, SyncOnDrop::record_event(&self.write, stream))
    }
}

impl<T> Drop for CudarcBuffer<T> {
    fn drop(&mut self) {
        let ctx = self.stream.context();
        // Every recorded use, on any stream, before the free. Waiting on an event never recorded is a
        // no-op, so this does not depend on cudarc's tracking being on now.
        let mut ordered = true;
        for event in [&self.read, &self.write].into_iter().flatten() {
            ordered &= self.stream.wait(event).is_ok();
        }
        if !ordered && ctx.synchronize().is_err() {
            // Neither an event wait nor a synchronize worked: the memory may still be in use, so it is
            // leaked rather than handed back.
            return;
        }
        let stream = StreamRef::from(&*self.stream);
        // SAFETY: `addr`/`bytes` came from `mr.allocate(bytes, _)` and are returned once, here (the
        // struct invariant; points 1 and 2); the stream waited above for every use cudarc recorded on any
        // stream, uses on this stream are queued before this point, and `&mut self` ends every borrow
        // (views, `SyncOnDrop` guards), so nothing uses the memory after this point of the stream (point 3).
        // Errors cannot leave a destructor; the resource has reported what it can.
        #[allow(unsafe_code)]
        let _ = unsafe { self.mr.deallocate(DeviceAddr(self.addr), self.bytes, stream) };
    }
}

/// Elements of a [`CudarcBuffer`], read-only: cudarc's `CudaView`. Implements [`DevicePtr`] with the
/// buffer's ordering.
#[derive(Debug)]
pub struct CudarcView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    read: &'a Option<CudaEvent>,
    write: &'a Option<CudaEvent>,
    _elem: PhantomData<fn() -> T>,
}

/// Elements of a [`CudarcBuffer`], writable: cudarc's `CudaViewMut`. Implements [`DevicePtr`] and
/// [`DevicePtrMut`] with the buffer's ordering.
#[derive(Debug)]
pub struct CudarcViewMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    read: &'a Option<CudaEvent>,
    write: &'a Option<CudaEvent>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> CudarcView<'_, T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> DeviceSlice<T> for CudarcView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for CudarcView<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        wait_for(stream, self.stream, &[self.write, self.read]);
        (self.ptr, SyncOnDrop::record_event(self.read, stream))
    }
}

impl<T> CudarcViewMut<'_, T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> DeviceSlice<T> for CudarcViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for CudarcViewMut<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        wait_for(stream, self.stream, &[self.write, self.read]);
        (self.ptr, SyncOnDrop::record_event(self.read, stream))
    }
}

impl<T> DevicePtrMut<T> for CudarcViewMut<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        wait_for(stream, self.stream, &[self.read, self.write]);
        (self.ptr, SyncOnDrop::record_event(self.write, stream))
    }
}

/// mempool's view of a cudarc stream, which must be a stream of a device's primary context: resources
/// allocate and free in the primary context, where a stream of another context (above all its legacy
/// stream, whose raw handle 0 names the primary context's legacy stream there) would order nothing.
fn primary_stream(stream: &CudaStream) -> Result<StreamRef<'_>> {
    let s = StreamRef::from(stream);
    if s.context().is_none() {
        return Err(Error::Unsupported {
            resource: "CudarcBuffer",
            reason: format!(
                "the cudarc stream belongs to a non-primary context of device {}: mempool's resources \
                 allocate and free in the device's primary context (use CudaContext::new)",
                stream.context().ordinal()
            ),
        });
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_without_panics() {
        assert_eq!(bounds(.., 10), Some((0, 10)));
        assert_eq!(bounds(2..5, 10), Some((2, 3)));
        assert_eq!(bounds(2..=5, 10), Some((2, 4)));
        assert_eq!(bounds(10.., 10), Some((10, 0)));
        assert_eq!(bounds(..=10, 10), None);
        assert_eq!(bounds((Bound::Included(5), Bound::Excluded(2)), 10), None);
        assert_eq!(bounds(0..usize::MAX, 10), None);
        assert_eq!(bounds(..=usize::MAX, 10), None);
        assert_eq!(bounds((Bound::Excluded(usize::MAX), Bound::Unbounded), 10), None);
    }

    /// The buffer is usable wherever cudarc takes its slices: the trait bounds of cudarc's copies and
    /// collectives, checked at compile time.
    #[test]
    fn buffers_and_views_implement_cudarcs_traits() {
        fn reads<T, S: DevicePtr<T>>() {}
        fn writes<T, S: DevicePtrMut<T>>() {}
        fn send_sync<S: Send + Sync>() {}
        reads::<f32, CudarcBuffer<f32>>();
        writes::<f32, CudarcBuffer<f32>>();
        reads::<u8, CudarcView<'static, u8>>();
        reads::<u8, CudarcViewMut<'static, u8>>();
        writes::<u8, CudarcViewMut<'static, u8>>();
        send_sync::<CudarcBuffer<f64>>();
    }
}
