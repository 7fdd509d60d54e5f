//! The owning pool buffer.

use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::event::{Event, EventFlags};
use crate::raw;
use crate::stream::StreamRef;
use crate::types::DeviceAddr;

/// Device memory from a pool, freed on its stream (`cuMemFreeAsync`) when dropped, so the memory can be
/// reused by work ordered after that stream's work. Made by [`crate::MemPool::alloc`].
#[derive(Debug)]
pub struct PoolBuffer<'s> {
    ptr: DeviceAddr,
    len: usize,
    stream: StreamRef<'s>,
    ctx: Arc<Context>,
}

impl<'s> PoolBuffer<'s> {
    pub(crate) fn from_parts(ptr: DeviceAddr, len: usize, stream: StreamRef<'s>, ctx: Arc<Context>) -> Self {
        PoolBuffer { ptr, len, stream, ctx }
    }

    /// The device address (null for an empty buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the buffer is ordered on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream
    }

    /// Copies `src` into the start of the buffer, on the buffer's stream, and waits for the copy.
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        self.check_len(src.len())?;
        let _g = self.ctx.bind()?;
        // SAFETY: the buffer holds at least `src.len()` bytes (checked) and is live; `src` stays borrowed
        // until the stream synchronize below returns, so the copy never reads freed host memory.
        #[allow(unsafe_code)]
        let r =
            unsafe { raw::memory::copy_htod_async(self.ptr.0, src.as_ptr().cast(), src.len(), self.stream.as_raw()) };
        r?;
        self.stream.synchronize()
    }

    /// Copies the start of the buffer into `dst`, on the buffer's stream, and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.check_len(dst.len())?;
        let _g = self.ctx.bind()?;
        // SAFETY: as in `copy_from_host`; `dst` is exclusively borrowed until the copy has completed.
        #[allow(unsafe_code)]
        let r = unsafe {
            raw::memory::copy_dtoh_async(dst.as_mut_ptr().cast(), self.ptr.0, dst.len(), self.stream.as_raw())
        };
        r?;
        self.stream.synchronize()
    }

    /// Fills the buffer with `value`, ordered on its stream (does not wait).
    pub fn fill(&self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the buffer is live and `len` bytes long.
        #[allow(unsafe_code)]
        let r = unsafe { raw::memory::memset_d8_async(self.ptr.0, value, self.len, self.stream.as_raw()) };
        Ok(r?)
    }

    /// Frees the buffer on `other` instead of its own stream, after making `other` wait for the work
    /// queued on the buffer's stream so far. Use it when the last user of the memory is `other`.
    pub fn free_on(mut self, other: StreamRef<'_>) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, DeviceAddr::NULL);
        if ptr.is_null() {
            return Ok(());
        }
        let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING)?;
        event.record(self.stream)?;
        other.wait(&event)?;
        let _g = self.ctx.bind()?;
        // SAFETY: owned pool memory, freed once (`self.ptr` is now null so drop skips it); `other` waits
        // for the buffer's stream, and the caller's later uses on `other` come after the free by order.
        #[allow(unsafe_code)]
        let r = unsafe { raw::pool::free_async(ptr.0, other.as_raw()) };
        Ok(r?)
    }

    /// Gives up ownership: the caller frees the pointer (e.g. with [`crate::MemPool::free_async`]).
    pub fn into_raw(mut self) -> (DeviceAddr, usize) {
        (std::mem::replace(&mut self.ptr, DeviceAddr::NULL), self.len)
    }

    fn check_len(&self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(Error::InvalidArgument(format!(
                "a copy of {n} bytes does not fit a buffer of {} bytes",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for PoolBuffer<'_> {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let r = self.ctx.bind().and_then(|_g| {
            // SAFETY: the buffer owns a live stream-ordered allocation, freed once here; work that used it
            // through the buffer was queued on its stream (or ordered before it by the caller).
            #[allow(unsafe_code)]
            let r = unsafe { raw::pool::free_async(self.ptr.0, self.stream.as_raw()) };
            Ok(r?)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
        }
    }
}
