//! cudarc interop (feature `cudarc`): cudarc's streams and contexts where mempool takes its own, and
//! mempool's streams handed to cudarc. docs/cudarc.md is the guide.
//!
//! The pairing rule: mempool's [`Context`] is always a device's primary context, and so is what
//! `CudaContext::new` makes. A cudarc context is mapped to mempool's context of the same device when its
//! `CUcontext` is that primary context; a non-primary cudarc context (`CudaContext::new_non_primary`,
//! `from_raw_context`) is refused with [`Error::NotPrimaryContext`] where a [`Context`] or [`Stream`] is
//! made, and gives a [`StreamRef`] that knows no context where a stream is only borrowed.
//!
//! Ownership: a cudarc stream lent to mempool is borrowed ([`StreamRef`]) or shared ([`Stream::from_cudarc`]:
//! cudarc destroys it when its last `Arc` goes, mempool never does). A mempool stream lent to cudarc is
//! either made through cudarc in the first place ([`Stream::new_cudarc`], safe: both share cudarc's
//! `Arc`) or wrapped as a borrowed cudarc stream ([`Stream::borrow_for_cudarc`], `unsafe`: cudarc cannot
//! see the mempool owner, so the caller keeps it alive).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError as CudarcError};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::raw;
use crate::stream::{Stream, StreamRef};
use crate::types::Device;

impl Error {
    /// The error of a failed cudarc driver call, in mempool's terms: [`Error::Driver`] with `call` and the
    /// `CUresult`'s name and message. (The interop's allocations go through mempool, whose
    /// [`Error::OutOfMemory`] carries the size; the cudarc calls it makes allocate no device memory.)
    pub fn from_cudarc(call: &'static str, error: CudarcError) -> Error {
        match raw::check(call, error.0) {
            Err(failure) => failure.into(),
            // cudarc only builds a `DriverError` from a failed call; keep the value if it ever does not.
            Ok(()) => Error::InvalidArgument(format!("{call} reported {:?} as an error", error.0)),
        }
    }
}

/// mempool's primary context of the device of `ctx`, when `ctx` is that primary context.
fn primary_for(ctx: &CudaContext) -> Result<&'static Arc<Context>> {
    let primary = match Context::retained_primary(ctx.ordinal()) {
        Some(primary) => primary,
        None => Context::primary_ref(Device::get(ctx.ordinal())?)?,
    };
    if primary.as_raw() == ctx.cu_ctx() {
        Ok(primary)
    } else {
        Err(Error::NotPrimaryContext { ordinal: ctx.ordinal() })
    }
}

impl Context {
    /// mempool's context for a cudarc context: the same device's primary context.
    ///
    /// Errors: [`Error::NotPrimaryContext`] for a context that is not its device's primary context (from
    /// `CudaContext::new_non_primary` or `from_raw_context`): mempool works in primary contexts only.
    pub fn from_cudarc(ctx: &Arc<CudaContext>) -> Result<Arc<Context>> {
        primary_for(ctx).map(Arc::clone)
    }

    /// A cudarc context for this one (`CudaContext::new` on the same device: the same primary context,
    /// retained once more until the cudarc `Arc` goes).
    pub fn to_cudarc(&self) -> Result<Arc<CudaContext>> {
        // cudarc's safe API panics without a driver; a `Context` exists only where the driver loaded.
        CudaContext::new(self.device().ordinal()).map_err(|e| Error::from_cudarc("CudaContext::new", e))
    }
}

impl<'a> From<&'a CudaStream> for StreamRef<'a> {
    /// Borrows a cudarc stream for as long as the `CudaStream` is borrowed (cudarc destroys it no earlier
    /// than its drop). The view carries mempool's [`Context`] when the stream's context is its device's
    /// primary context (the usual `CudaContext::new`); a stream of a non-primary context gives a view that
    /// knows no context, like [`StreamRef::from_raw`]: mempool then binds the context of whatever it is
    /// handed to (a pool's, a resource's), and APIs that need the view's context (a
    /// `mempool_rmm::containers::DeviceBuffer`) refuse it. cudarc's default stream is
    /// [`StreamRef::LEGACY`] of that context, its per-thread stream [`StreamRef::PER_THREAD`].
    fn from(stream: &'a CudaStream) -> StreamRef<'a> {
        // SAFETY: `cu_stream()` is a live stream (or the null / per-thread special handle) for as long as
        // the `CudaStream` lives, which the borrow `'a` covers (point 1); a view that knows no context is
        // only used where mempool binds the context of the object it is handed to, and cudarc's streams
        // belong to a context of that device or are special handles (point 2).
        #[allow(unsafe_code)]
        let view = unsafe { StreamRef::from_raw(stream.cu_stream()) };
        match primary_for(stream.context()) {
            Ok(ctx) => view.in_context(ctx),
            Err(_) => view,
        }
    }
}

impl<'a> From<&'a Arc<CudaStream>> for StreamRef<'a> {
    /// The same as `StreamRef::from(&**stream)`, so a `&Arc<CudaStream>` works where `impl
    /// Into<StreamRef>` is taken.
    fn from(stream: &'a Arc<CudaStream>) -> StreamRef<'a> {
        StreamRef::from(&**stream)
    }
}

impl Stream {
    /// A mempool stream that shares ownership of a cudarc stream: the driver stream is destroyed once,
    /// by cudarc, when the last `Arc` goes (this `Stream` holds one). Work queued through either is on
    /// the same stream.
    ///
    /// Errors: [`Error::NotPrimaryContext`] for a stream of a non-primary context.
    pub fn from_cudarc(stream: Arc<CudaStream>) -> Result<Stream> {
        let ctx = Context::from_cudarc(stream.context())?;
        // SAFETY: 1. `ctx` is the mempool value of the stream's own context (`from_cudarc` of
        // `stream.context()`).
        #[allow(unsafe_code)]
        Ok(unsafe { Stream::shared_with_cudarc(ctx, stream) })
    }

    /// A new stream of `ctx` made by cudarc (`CudaContext::new_stream`: non-blocking), shared by both
    /// sides: [`Stream::cudarc_stream`] is the cudarc `Arc`, usable with cudarc's safe API for as long as
    /// anyone holds it. The safe way to give a mempool stream to cudarc. As every cudarc `new_stream`,
    /// the first one in a context turns on cudarc's cross-stream event tracking (after a
    /// `cuCtxSynchronize`).
    pub fn new_cudarc(ctx: &Arc<Context>) -> Result<Stream> {
        let cuda = ctx.to_cudarc()?;
        let stream = cuda
            .new_stream()
            .map_err(|e| Error::from_cudarc("CudaContext::new_stream", e))?;
        // SAFETY: 1. cudarc made the stream in `ctx.to_cudarc()`, the cudarc value of `ctx`'s context.
        #[allow(unsafe_code)]
        Ok(unsafe { Stream::shared_with_cudarc(ctx.clone(), stream) })
    }

    /// This stream as a cudarc stream in `ctx`: a clone of the shared `Arc` for a stream made by
    /// [`Stream::from_cudarc`] or [`Stream::new_cudarc`], otherwise a borrowed cudarc wrapper
    /// (`CudaContext::wrap_borrowed_stream`) that never destroys the stream.
    ///
    /// # Safety
    /// For a stream mempool created alone (where [`Stream::cudarc_stream`] is `None`):
    /// 1. The returned `Arc` and everything that holds a clone of it (cudarc slices allocated on it,
    ///    `mempool_rmm::CudarcBuffer`s, NCCL communicators, ...) are dropped before `self`, or at least
    ///    never used after `self` is dropped (the driver stream is destroyed then).
    /// 2. cudarc does not count a borrowed stream as one of its own, so its cross-stream event tracking
    ///    does not turn on because of it: work queued through the wrapper on this stream and work on other
    ///    streams that touches the same memory is ordered by the caller (events, synchronize).
    ///
    /// Errors: [`Error::InvalidArgument`] when `ctx` is not this stream's context (another device's, or a
    /// non-primary one).
    #[allow(unsafe_code)]
    pub unsafe fn borrow_for_cudarc(&self, ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
        if ctx.cu_ctx() != self.context().as_raw() {
            return Err(Error::InvalidArgument(format!(
                "the cudarc context (device {}) is not this stream's context (the primary context of device {})",
                ctx.ordinal(),
                self.context().device().ordinal()
            )));
        }
        if let Some(shared) = self.cudarc_stream() {
            return Ok(shared.clone());
        }
        // SAFETY: `as_raw()` is a live stream of `ctx` (its `CUcontext` was checked above); the caller keeps
        // `self` alive while the wrapper is used (point 1) and orders cross-stream work (point 2), which is
        // `wrap_borrowed_stream`'s contract.
        Ok(unsafe { ctx.wrap_borrowed_stream(self.as_raw()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::sys;

    #[test]
    fn cudarc_errors_keep_the_call_and_the_cuda_result() {
        let e = Error::from_cudarc(
            "CudaContext::new_stream",
            CudarcError(sys::CUresult::CUDA_ERROR_INVALID_CONTEXT),
        );
        match &e {
            Error::Driver { call, error } => {
                assert_eq!(*call, "CudaContext::new_stream");
                assert_eq!(error.name, "CUDA_ERROR_INVALID_CONTEXT");
                assert_eq!(error.code, sys::CUresult::CUDA_ERROR_INVALID_CONTEXT as u32);
            }
            other => panic!("expected a driver error, got {other:?}"),
        }
        assert!(
            e.to_string()
                .starts_with("CudaContext::new_stream failed: CUDA_ERROR_INVALID_CONTEXT"),
            "{e}"
        );
        // cuInit's "no device" is reported as mempool reports it everywhere (DriverFailure's mapping applies
        // to the raw call only; through a named cudarc call it stays a driver error).
        let missing = Error::from_cudarc("cuInit", CudarcError(sys::CUresult::CUDA_ERROR_NO_DEVICE));
        assert!(matches!(missing, Error::Driver { .. } | Error::NoDevice), "{missing:?}");
    }

    #[test]
    fn a_non_primary_context_is_named_as_the_cause() {
        let e = Error::NotPrimaryContext { ordinal: 3 };
        let text = e.to_string();
        assert!(
            text.contains("device 3") && text.contains("not the device's primary context"),
            "{text}"
        );
        assert!(
            text.contains("CudaContext::new"),
            "says how to make one that works: {text}"
        );
    }
}
