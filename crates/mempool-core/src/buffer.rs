//! The owning pool buffer.

use std::ops::Deref;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::event::{Event, EventFlags};
use crate::raw;
use crate::stream::StreamRef;
use crate::types::DeviceAddr;
use crate::view::BufferView;

/// Device memory from a pool, freed on its stream (`cuMemFreeAsync`) when dropped, so the memory can be
/// reused by work ordered after that stream's work. Made by [`crate::MemPool::alloc`].
///
/// It dereferences to its [`BufferView`], which gives the address ([`BufferView::ptr`]), length, stream,
/// context, host copies (`copy_from_host(offset, src)`,
/// `copy_to_host(offset, dst)`, `to_host()`), `fill` and range checks.
#[derive(Debug)]
pub struct PoolBuffer<'s> {
    view: BufferView<'s>,
}

impl<'s> PoolBuffer<'s> {
    /// Takes ownership of a pool allocation.
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is a live stream-ordered allocation (`cuMemAllocFromPoolAsync`) of `ctx`, which
    ///    nothing else frees: the buffer frees it once, on drop or in [`PoolBuffer::free_on`].
    /// 2. It was allocated on `stream`, a stream of `ctx` (or a special handle) live for `'s`.
    /// 3. A null `ptr` comes with `len == 0` (a 0-byte allocation, never freed).
    #[allow(unsafe_code)]
    pub(crate) unsafe fn from_parts(ptr: DeviceAddr, len: usize, stream: StreamRef<'s>, ctx: Arc<Context>) -> Self {
        PoolBuffer {
            // SAFETY: point 1 gives `new`'s point 1 (live memory of `ctx`, freed only by its owner); point 2
            // gives its points 2 and 3 (allocated on `stream`, so work on it is ordered there; `stream`
            // belongs to `ctx`); point 3 is its point 4.
            view: unsafe { BufferView::new(ptr, len, stream, ctx) },
        }
    }

    /// Frees the buffer on `other` instead of its own stream, after making `other` wait for the work
    /// queued on the buffer's stream so far. Use it when the last user of the memory is `other`.
    pub fn free_on(mut self, other: StreamRef<'_>) -> Result<()> {
        let ctx = self.view.context().clone();
        self.view.release_with(|ptr, _len, stream| {
            let _g = ctx.bind()?;
            let event = Event::new(&ctx, EventFlags::DISABLE_TIMING)?;
            event.record(stream)?;
            other.wait(&event)?;
            // SAFETY: owned pool memory, handed out once by `release_with` (the view is empty now, so drop
            // frees nothing); `other` waits for the buffer's stream, and the caller's later uses on `other`
            // come after the free by order.
            #[allow(unsafe_code)]
            let r = unsafe { raw::pool::free_async(ptr.0, other.as_raw()) };
            Ok::<_, Error>(r?)
        })
    }

    /// Gives up ownership: the caller frees the pointer (e.g. with [`crate::MemPool::free_async`]).
    pub fn into_raw(mut self) -> (DeviceAddr, usize) {
        self.view.take()
    }
}

impl<'s> Deref for PoolBuffer<'s> {
    type Target = BufferView<'s>;

    fn deref(&self) -> &BufferView<'s> {
        &self.view
    }
}

impl Drop for PoolBuffer<'_> {
    fn drop(&mut self) {
        let ctx = self.view.context().clone();
        let r = self.view.release_with(|ptr, _len, stream| {
            let _g = ctx.bind()?;
            // SAFETY: the buffer owns a live stream-ordered allocation, handed out once by `release_with`;
            // work that used it through the buffer was queued on its stream (or ordered before it by the
            // caller).
            #[allow(unsafe_code)]
            let r = unsafe { raw::pool::free_async(ptr.0, stream.as_raw()) };
            Ok::<_, Error>(r?)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
        }
    }
}
