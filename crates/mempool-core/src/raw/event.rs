//! Events, including interprocess events.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html>

use super::{call, sys, Result};

/// Creates an event in the current context. `flags` is a `CUevent_flags` value.
pub(crate) fn create(flags: u32) -> Result<sys::CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: one handle is written; a context is current (callers bind one first).
    unsafe { call!(cuEventCreate(&mut e, flags)) }?;
    Ok(e)
}

/// # Safety
/// 1. `e` came from [`create`] or [`ipc_open`] and is destroyed once; nothing uses it afterwards.
pub(crate) unsafe fn destroy(e: sys::CUevent) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuEventDestroy_v2(e)) }
}

/// # Safety
/// 1. `e` is a live event and `s` a live stream (or a special handle) of the same context.
pub(crate) unsafe fn record(e: sys::CUevent, s: sys::CUstream) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuEventRecord(e, s)) }
}

/// `ctx` is the event's context (the key of its [`super::gate`]).
///
/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn synchronize(e: sys::CUevent, ctx: sys::CUcontext) -> Result<()> {
    let _gate = super::gate::synchronize(ctx as usize);
    // SAFETY: point 1.
    unsafe { call!(cuEventSynchronize(e)) }
}

/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn query(e: sys::CUevent) -> Result<bool> {
    // SAFETY: point 1.
    match unsafe { call!(cuEventQuery(e)) } {
        Ok(()) => Ok(true),
        Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_NOT_READY as u32) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Milliseconds between two recorded events.
///
/// # Safety
/// 1. Both are live events created without `CU_EVENT_DISABLE_TIMING`.
pub(crate) unsafe fn elapsed_ms(start: sys::CUevent, end: sys::CUevent) -> Result<f32> {
    let mut ms = 0.0f32;
    // SAFETY: point 1; one float is written.
    unsafe { call!(cuEventElapsedTime_v2(&mut ms, start, end)) }?;
    Ok(ms)
}

/// The 64-byte interprocess handle of an event created with `CU_EVENT_INTERPROCESS`.
///
/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn ipc_handle(e: sys::CUevent) -> Result<[u8; 64]> {
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    // SAFETY: point 1; the handle struct is written.
    unsafe { call!(cuIpcGetEventHandle(&mut h, e)) }?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Opens another process's interprocess event in the current context.
pub(crate) fn ipc_open(handle: &[u8; 64]) -> Result<sys::CUevent> {
    let mut e = std::ptr::null_mut();
    let h = sys::CUipcEventHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    // SAFETY: one handle is written; the 64 bytes are opaque data the driver validates.
    unsafe { call!(cuIpcOpenEventHandle(&mut e, h)) }?;
    Ok(e)
}
