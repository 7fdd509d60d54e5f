//! Streams: owned ([`Stream`]) and borrowed ([`StreamRef`]).
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>

use std::marker::PhantomData;
use std::sync::Arc;

use crate::context::Context;
use crate::error::Result;
use crate::event::Event;
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
        })
    }

    /// A borrowed view of this stream, valid while `self` lives.
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef {
            raw: self.raw.get() as usize,
            _life: PhantomData,
        }
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUstream`, valid while `self` lives.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw.get()
    }

    /// Blocks until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.as_ref().synchronize()
    }

    /// Makes later work on this stream wait for what `event` captured.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.as_ref().wait(event)
    }

    /// Gives up ownership: the caller must destroy the returned handle (e.g. through [`Stream::from_raw`]).
    pub fn into_raw(self) -> (Arc<Context>, sys::CUstream) {
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
    pub unsafe fn from_raw(ctx: Arc<Context>, raw: sys::CUstream) -> Stream {
        Stream {
            ctx,
            raw: Handle::new(raw),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by `cuStreamCreate` (or handed over by `from_raw`'s contract),
        // is owned only by `self`, and no borrowed `StreamRef` outlives `self`.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::stream::destroy(self.raw.get()) } {
            crate::record_drop_error(e);
        }
    }
}

/// A borrowed stream: an owned [`Stream`]'s view, a special stream, or a raw handle from another
/// library (cudarc, PyTorch, C). `Copy`, like RMM's `cuda_stream_view`; the lifetime ties it to the
/// stream's owner where Rust can see one.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct StreamRef<'a> {
    // Stored as an integer: the value is an opaque driver handle, used as a key and passed to the driver.
    raw: usize,
    _life: PhantomData<&'a ()>,
}

impl StreamRef<'static> {
    /// The legacy default stream (`0`): synchronises with all blocking streams of its context, and uses
    /// whichever context is current on the thread that queues work.
    pub const LEGACY: StreamRef<'static> = StreamRef {
        raw: 0x0,
        _life: PhantomData,
    };
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub const PER_THREAD: StreamRef<'static> = StreamRef {
        raw: 0x2,
        _life: PhantomData,
    };
}

impl<'a> StreamRef<'a> {
    /// Borrows a raw stream handle owned elsewhere.
    ///
    /// # Safety
    /// 1. `raw` is a live stream (or a special handle) for all of `'a`.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(raw: sys::CUstream) -> StreamRef<'a> {
        StreamRef {
            raw: raw as usize,
            _life: PhantomData,
        }
    }

    /// The raw `CUstream`.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw as sys::CUstream
    }

    /// The handle's value, as a key for per-stream bookkeeping.
    pub fn id(&self) -> usize {
        self.raw
    }

    /// Blocks until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a `StreamRef` is a live stream or a special handle for its lifetime (its constructors'
        // contracts).
        #[allow(unsafe_code)]
        unsafe {
            raw::stream::synchronize(self.as_raw())
        }
    }

    /// Whether all work queued on the stream has completed.
    pub fn is_idle(&self) -> Result<bool> {
        // SAFETY: as in `synchronize`.
        #[allow(unsafe_code)]
        unsafe {
            raw::stream::query(self.as_raw())
        }
    }

    /// Makes later work on this stream wait for what `event` captured (`cuStreamWaitEvent`).
    pub fn wait(&self, event: &Event) -> Result<()> {
        // SAFETY: the stream is live (as in `synchronize`) and `event` is borrowed, hence live.
        #[allow(unsafe_code)]
        unsafe {
            raw::stream::wait_event(self.as_raw(), event.as_raw())
        }
    }
}
