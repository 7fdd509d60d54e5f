//! Events, including interprocess events for ordering work across processes, and the stream side of an
//! event (`Stream::wait`, `StreamRef::wait`), which lives here so that `stream` need not know events.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html>

use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::raw::{self, sys};
use crate::stream::{Stream, StreamRef};

bitflags::bitflags! {
    /// Flags for [`Event::new`] (`CUevent_flags`).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct EventFlags: u32 {
        /// `synchronize` blocks the thread instead of spinning.
        const BLOCKING_SYNC = 0x1;
        /// No timing data: cheaper to record and wait on. Required by `INTERPROCESS`.
        const DISABLE_TIMING = 0x2;
        /// The event can be shared with another process through [`Event::ipc_handle`].
        const INTERPROCESS = 0x4;
    }
}

/// The 64-byte handle through which another process opens an interprocess event
/// (`cuIpcGetEventHandle`). Plain data: safe to send over a socket.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; 64]);

/// An owned CUDA event, destroyed on drop. Keeps its context alive.
#[derive(Debug)]
pub struct Event {
    ctx: Arc<Context>,
    raw: Handle<sys::CUevent_st>,
    flags: EventFlags,
}

impl Event {
    /// A new event in `ctx`. `INTERPROCESS` requires `DISABLE_TIMING`, as the driver does.
    ///
    /// ```no_run
    /// # fn main() -> mempool_core::Result<()> {
    /// use mempool_core::{Device, Event, EventFlags, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::new(&ctx)?, Stream::new(&ctx)?);
    /// let done = Event::new(&ctx, EventFlags::DISABLE_TIMING)?;
    /// done.record(a.as_ref())?;
    /// b.wait(&done)?; // work queued on b from now on runs after a's work so far
    /// # Ok(()) }
    /// ```
    pub fn new(ctx: &Arc<Context>, flags: EventFlags) -> Result<Event> {
        if flags.contains(EventFlags::INTERPROCESS) && !flags.contains(EventFlags::DISABLE_TIMING) {
            return Err(Error::InvalidArgument(
                "an INTERPROCESS event must also have DISABLE_TIMING (the driver requires it)".into(),
            ));
        }
        let _g = ctx.bind()?;
        let raw = raw::event::create(flags.bits())?;
        Ok(Event {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            flags,
        })
    }

    /// Opens an interprocess event another process created, in `ctx` (`cuIpcOpenEventHandle`). The
    /// returned event can be waited on and synchronised, not recorded with timing.
    pub fn open_ipc(ctx: &Arc<Context>, handle: &IpcEventHandle) -> Result<Event> {
        let _g = ctx.bind()?;
        let raw = raw::event::ipc_open(&handle.0)?;
        Ok(Event {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            flags: EventFlags::INTERPROCESS | EventFlags::DISABLE_TIMING,
        })
    }

    /// Captures the work queued on `stream` so far.
    pub fn record(&self, stream: StreamRef<'_>) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the event is owned by `self`; a `StreamRef` is live for its lifetime.
        #[allow(unsafe_code)]
        let r = unsafe { raw::event::record(self.raw.get(), stream.as_raw()) };
        Ok(r?)
    }

    /// Blocks until the captured work is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is owned by `self`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::event::synchronize(self.raw.get(), self.ctx.as_raw() as _) };
        Ok(r?)
    }

    /// Whether the captured work is done.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: the event is owned by `self`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::event::query(self.raw.get()) };
        Ok(r?)
    }

    /// Milliseconds from `self` to `end`, both recorded and complete, neither with `DISABLE_TIMING`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if self.flags.contains(EventFlags::DISABLE_TIMING) || end.flags.contains(EventFlags::DISABLE_TIMING) {
            return Err(Error::InvalidArgument(
                "elapsed time needs events without DISABLE_TIMING".into(),
            ));
        }
        // SAFETY: both events are owned by live values and were created with timing.
        #[allow(unsafe_code)]
        let r = unsafe { raw::event::elapsed_ms(self.raw.get(), end.raw.get()) };
        Ok(r?)
    }

    /// The handle another process opens with [`Event::open_ipc`]. Needs `INTERPROCESS`.
    pub fn ipc_handle(&self) -> Result<IpcEventHandle> {
        if !self.flags.contains(EventFlags::INTERPROCESS) {
            return Err(Error::InvalidArgument(
                "only an event created with INTERPROCESS has an IPC handle".into(),
            ));
        }
        // The driver needs the event's context current (CUDA_ERROR_INVALID_CONTEXT otherwise).
        let _g = self.ctx.bind()?;
        // SAFETY: the event is owned by `self`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::event::ipc_handle(self.raw.get()) };
        Ok(IpcEventHandle(r?))
    }

    /// The flags the event was created with.
    pub fn flags(&self) -> EventFlags {
        self.flags
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUevent`, valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawEvent {
        self.raw.get()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: owned by `self` and destroyed once; the driver defers the release of an event that
        // recorded work still pending.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::event::destroy(self.raw.get()) } {
            crate::drop_errors::record(e.into());
        }
    }
}

impl Stream {
    /// Makes later work on this stream wait for what `event` captured (`cuStreamWaitEvent`).
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.as_ref().wait(event)
    }
}

impl StreamRef<'_> {
    /// Makes later work on this stream wait for what `event` captured (`cuStreamWaitEvent`).
    pub fn wait(&self, event: &Event) -> Result<()> {
        // SAFETY: a `StreamRef` is a live stream or a special handle for its lifetime (its constructors'
        // contracts), and `event` is borrowed, hence live.
        #[allow(unsafe_code)]
        let r = unsafe { raw::stream::wait_event(self.as_raw(), event.as_raw()) };
        Ok(r?)
    }
}
