//! Streams. <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>

use super::{call, sys, Result};

/// Creates a stream in the current context. `flags` is a `CUstream_flags` value.
pub(crate) fn create(flags: u32) -> Result<sys::CUstream> {
    let mut s = std::ptr::null_mut();
    // SAFETY: one handle is written; a context is current (callers bind one first).
    unsafe { call!(cuStreamCreate(&mut s, flags)) }?;
    Ok(s)
}

/// Destroys a stream; work already queued on it still runs.
///
/// # Safety
/// 1. `s` came from [`create`] and is destroyed once.
/// 2. Nothing uses `s` afterwards.
pub(crate) unsafe fn destroy(s: sys::CUstream) -> Result<()> {
    // SAFETY: points 1 and 2.
    unsafe { call!(cuStreamDestroy_v2(s)) }
}

/// Blocks until all work on `s` is done.
///
/// # Safety
/// 1. `s` is a live stream or one of the special handles (legacy default, per-thread default).
pub(crate) unsafe fn synchronize(s: sys::CUstream) -> Result<()> {
    // SAFETY: point 1.
    let _gate = super::gate::synchronize(unsafe { context_key(s) });
    // SAFETY: point 1.
    unsafe { call!(cuStreamSynchronize(s)) }
}

/// The address of the context `s` belongs to (a special handle: the current context), the key of its
/// [`super::gate`]; 0 when the driver cannot tell.
///
/// # Safety
/// 1. `s` is a live stream or one of the special handles.
unsafe fn context_key(s: sys::CUstream) -> usize {
    if (s as usize) <= 2 {
        return super::context::current_key();
    }
    let mut ctx = std::ptr::null_mut();
    // SAFETY: point 1; one handle is written.
    match unsafe { call!(cuStreamGetCtx(s, &mut ctx)) } {
        Ok(()) => ctx as usize,
        Err(_) => 0,
    }
}

/// Whether all work on `s` has completed.
///
/// # Safety
/// 1. `s` is a live stream or one of the special handles.
pub(crate) unsafe fn query(s: sys::CUstream) -> Result<bool> {
    // SAFETY: point 1.
    match unsafe { call!(cuStreamQuery(s)) } {
        Ok(()) => Ok(true),
        Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_NOT_READY as u32) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The driver's id of the stream `s` names on the calling thread (`cuStreamGetId`, CUDA 12.0): unique for the
/// life of the process, so it tells apart the per-thread default streams of different threads (one handle,
/// `CU_STREAM_PER_THREAD`) and a stream from one created later at the same address.
///
/// # Safety
/// 1. `s` is a live stream or one of the special handles (then the current context's stream).
pub(crate) unsafe fn id(s: sys::CUstream) -> Result<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: point 1; one integer is written.
    unsafe { call!(cuStreamGetId(s, &mut id)) }?;
    Ok(id)
}

/// Makes future work on `s` wait for the work captured by `e`.
///
/// # Safety
/// 1. `s` is a live stream or a special handle; `e` is a live event.
pub(crate) unsafe fn wait_event(s: sys::CUstream, e: sys::CUevent) -> Result<()> {
    // SAFETY: point 1; flags must be 0 (CU_EVENT_WAIT_DEFAULT).
    unsafe { call!(cuStreamWaitEvent(s, e, 0)) }
}

/// Whether `s` is being captured into a graph (an invalidated capture counts: the stream is still in
/// capture mode until it ends).
///
/// # Safety
/// 1. `s` is a live stream or one of the special handles.
pub(crate) unsafe fn is_capturing(s: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: point 1; one status is written.
    unsafe { call!(cuStreamIsCapturing(s, &mut status)) }?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}
