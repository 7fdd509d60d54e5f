//! Streams: owned ([`Stream`]) and borrowed ([`StreamRef`]), the one type APIs take to name a stream.
//! (`wait` on an event is implemented in `event`, which builds on this module.)
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::context::Context;
use crate::error::Result;
use crate::handle::Handle;
use crate::raw::{self, sys};

bitflags::bitflags! {
    /// Flags for [`Stream::with_flags`] (`CUstream_flags`).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct StreamFlags: u32 {
        /// Work on the stream does not synchronise with the legacy default stream.
        const NON_BLOCKING = 1;
    }
}

/// An owned CUDA stream, destroyed on drop (work already queued still runs). Keeps its context alive.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{Device, Stream};
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::new(&ctx)?;
/// stream.synchronize()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Stream {
    ctx: Arc<Context>,
    raw: Handle<sys::CUstream_st>,
    // Some for a stream shared with cudarc (`Stream::from_cudarc`): cudarc owns the driver stream and
    // destroys it when its last `Arc` goes, so `Drop` leaves it alone.
    #[cfg(feature = "cudarc")]
    cudarc: Option<Arc<cudarc::driver::CudaStream>>,
}

impl Stream {
    /// A new stream in `ctx` with default flags (`cuStreamCreate`).
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        Stream::with_flags(ctx, StreamFlags::empty())
    }

    /// A new stream in `ctx` with `flags`.
    pub fn with_flags(ctx: &Arc<Context>, flags: StreamFlags) -> Result<Stream> {
        let _g = ctx.bind()?;
        let raw = raw::stream::create(flags.bits())?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            #[cfg(feature = "cudarc")]
            cudarc: None,
        })
    }

    /// A borrowed view of this stream, valid while `self` lives, that knows the stream's context
    /// ([`StreamRef::context`] is `Some`). The same as `StreamRef::from(&stream)`.
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef {
            raw: self.raw.get() as usize,
            ctx: Some(&self.ctx),
        }
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUstream`, valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawStream {
        self.raw.get()
    }

    /// Blocks until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.as_ref().synchronize()
    }

    /// Gives up ownership: the caller must destroy the returned handle (e.g. through [`Stream::from_raw`]).
    ///
    /// A stream shared with cudarc (feature `cudarc`: `Stream::from_cudarc`) keeps cudarc's `Arc`
    /// forever (it is leaked), so cudarc never destroys the handle and the caller's obligation is the same;
    /// but other holders of that `Arc` may still queue work on the stream: destroy it only once they are
    /// done. Prefer dropping such a stream.
    pub fn into_raw(self) -> (Arc<Context>, crate::types::RawStream) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so moving the `Arc` out of it leaves exactly one owner.
        #[allow(unsafe_code)]
        let ctx = unsafe { std::ptr::read(&this.ctx) };
        (ctx, this.raw.get())
    }

    /// Takes ownership of a stream handle.
    ///
    /// # Safety
    /// 1. `raw` is a live stream of `ctx`, created by `cuStreamCreate` (not a special handle).
    /// 2. Nothing else destroys it: the returned value destroys it on drop.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(ctx: Arc<Context>, raw: crate::types::RawStream) -> Stream {
        Stream {
            ctx,
            raw: Handle::new(raw),
            #[cfg(feature = "cudarc")]
            cudarc: None,
        }
    }

    /// A stream that shares cudarc's ownership of `stream`, whose context is `ctx`.
    ///
    /// # Safety
    /// 1. `stream`'s `CUcontext` is `ctx`'s (`Stream::from_cudarc` checks it): the stream's calls bind
    ///    `ctx`, and work queued on it runs in that context.
    #[cfg(feature = "cudarc")]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn shared_with_cudarc(ctx: Arc<Context>, stream: Arc<cudarc::driver::CudaStream>) -> Stream {
        Stream {
            ctx,
            raw: Handle::new(stream.cu_stream()),
            cudarc: Some(stream),
        }
    }

    /// The cudarc stream this stream shares ownership with: `Some` for a stream made by
    /// [`Stream::from_cudarc`] or [`Stream::new_cudarc`], `None` for one mempool created alone.
    #[cfg(feature = "cudarc")]
    pub fn cudarc_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        self.cudarc.as_ref()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        #[cfg(feature = "cudarc")]
        if self.cudarc.take().is_some() {
            // cudarc owns the driver stream: dropping our `Arc` (just done) lets it destroy the stream
            // once its last `Arc` goes.
            return;
        }
        // SAFETY: the stream was created by `cuStreamCreate` (or handed over by `from_raw`'s contract),
        // is owned only by `self`, and no borrowed `StreamRef` outlives `self`.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::stream::destroy(self.raw.get()) } {
            crate::drop_errors::record(e.into());
        }
    }
}

impl<'a> From<&'a Stream> for StreamRef<'a> {
    /// The same as [`Stream::as_ref`].
    fn from(stream: &'a Stream) -> StreamRef<'a> {
        stream.as_ref()
    }
}

/// A borrowed stream, the one type this crate's APIs take to name a stream: an owned [`Stream`]'s view,
/// a special stream, or a raw handle from another library (cudarc, PyTorch, C). `Copy`, like RMM's
/// `cuda_stream_view`; the lifetime ties it to the stream's owner where Rust can see one.
///
/// A view made from a [`Stream`] (`stream.as_ref()` or `StreamRef::from(&stream)`) also carries the
/// stream's context ([`StreamRef::context`]), so code handed only a `StreamRef` can bind the right
/// context; the special streams and [`StreamRef::from_raw`] carry none until one is attached with
/// [`StreamRef::in_context`]. Equality and hashing look at the raw handle only: two views of one stream
/// are equal whether or not they know its context.
///
/// ```
/// use mempool_core::StreamRef;
/// assert_ne!(StreamRef::LEGACY, StreamRef::PER_THREAD);
/// assert!(StreamRef::LEGACY.context().is_none());
/// ```
#[derive(Copy, Clone)]
pub struct StreamRef<'a> {
    // Stored as an integer: the value is an opaque driver handle, used as a key and passed to the driver.
    raw: usize,
    ctx: Option<&'a Arc<Context>>,
}

impl PartialEq for StreamRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

impl Eq for StreamRef<'_> {}

impl Hash for StreamRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.raw.hash(state);
    }
}

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamRef").field("raw", &self.raw).finish()
    }
}

impl StreamRef<'static> {
    /// The legacy default stream (`0`): synchronises with all blocking streams of its context, and uses
    /// whichever context is current on the thread that queues work. Knows no context; attach one with
    /// [`StreamRef::in_context`].
    pub const LEGACY: StreamRef<'static> = StreamRef { raw: 0x0, ctx: None };
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`). Knows no context.
    pub const PER_THREAD: StreamRef<'static> = StreamRef { raw: 0x2, ctx: None };
}

impl<'a> StreamRef<'a> {
    /// Borrows a raw stream handle owned elsewhere. The view knows no context; attach one with
    /// [`StreamRef::in_context`].
    ///
    /// # Safety
    /// 1. `raw` is a live stream (or a special handle) for all of `'a`.
    /// 2. Until a context is attached ([`StreamRef::in_context`]), it is used where mempool binds the
    ///    context of the object it is given to (a pool's, a resource's, a buffer's): it is a stream of
    ///    that context, or a special handle.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(raw: crate::types::RawStream) -> StreamRef<'a> {
        StreamRef {
            raw: raw as usize,
            ctx: None,
        }
    }

    /// The context the stream belongs to, where the view knows it: `Some` for a view of a [`Stream`] or
    /// one given a context with [`StreamRef::in_context`]; `None` for [`StreamRef::LEGACY`],
    /// [`StreamRef::PER_THREAD`] and [`StreamRef::from_raw`].
    pub fn context(&self) -> Option<&'a Arc<Context>> {
        self.ctx
    }

    /// The same stream, known to belong to `ctx` (for instance `StreamRef::LEGACY.in_context(&ctx)`: the
    /// legacy stream of `ctx`). Replaces any context the view knew. Nothing checks that the stream
    /// belongs to `ctx`; APIs that rely on the pairing say so in their contract (e.g.
    /// [`crate::BufferView::new`]).
    pub fn in_context<'b>(self, ctx: &'b Arc<Context>) -> StreamRef<'b>
    where
        'a: 'b,
    {
        StreamRef {
            raw: self.raw,
            ctx: Some(ctx),
        }
    }

    /// The raw `CUstream`.
    pub fn as_raw(&self) -> crate::types::RawStream {
        self.raw as sys::CUstream
    }

    /// The handle's value, as a key for per-stream bookkeeping.
    pub fn id(&self) -> usize {
        self.raw
    }

    /// Blocks until all work queued on the stream is done, with the view's context bound when it knows one.
    pub fn synchronize(&self) -> Result<()> {
        // A special handle (the legacy or per-thread stream) means the stream of the current context: bind
        // the context this view knows, so that a thread with no current context synchronizes the right one.
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: a `StreamRef` is a live stream or a special handle for its lifetime (its constructors'
        // contracts).
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::synchronize(self.as_raw()) };
        Ok(r?)
    }

    /// Whether all work queued on the stream has completed.
    pub fn is_idle(&self) -> Result<bool> {
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: as in `synchronize`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::query(self.as_raw()) };
        Ok(r?)
    }

    /// Whether the stream is being captured into a CUDA graph (`cuStreamIsCapturing`): while it is, work
    /// that synchronizes the device or the stream is illegal and would invalidate the capture.
    pub fn is_capturing(&self) -> Result<bool> {
        let _bound = self.ctx.map(|c| c.bind()).transpose()?;
        // SAFETY: as in `synchronize`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::is_capturing(self.as_raw()) };
        Ok(r?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn views_compare_and_hash_by_handle_only() {
        let ctx = Context::unretained_for_tests(0);
        let other = Context::unretained_for_tests(1);
        let plain = StreamRef::LEGACY;
        let attached = StreamRef::LEGACY.in_context(&ctx);
        assert_eq!(plain, attached);
        assert_eq!(attached, StreamRef::LEGACY.in_context(&other));
        assert_ne!(attached, StreamRef::PER_THREAD.in_context(&ctx));
        let set: HashSet<StreamRef<'_>> = [plain, attached, StreamRef::LEGACY.in_context(&other)].into();
        assert_eq!(set.len(), 1);
        assert_eq!(format!("{attached:?}"), "StreamRef { raw: 0 }");
    }

    #[test]
    fn in_context_attaches_and_replaces_the_context() {
        let ctx = Context::unretained_for_tests(0);
        let other = Context::unretained_for_tests(1);
        assert!(StreamRef::LEGACY.context().is_none());
        assert!(StreamRef::PER_THREAD.context().is_none());
        let s = StreamRef::PER_THREAD.in_context(&ctx);
        assert!(Arc::ptr_eq(s.context().unwrap(), &ctx));
        assert_eq!(s.id(), StreamRef::PER_THREAD.id());
        let t = s.in_context(&other);
        assert!(Arc::ptr_eq(t.context().unwrap(), &other));
        // SAFETY: the view is never used to reach the driver.
        #[allow(unsafe_code)]
        let raw = unsafe { StreamRef::from_raw(0x1234 as sys::CUstream) };
        assert!(raw.context().is_none());
        assert_eq!(raw.id(), 0x1234);
        assert_eq!(raw.as_raw() as usize, 0x1234);
    }
}
