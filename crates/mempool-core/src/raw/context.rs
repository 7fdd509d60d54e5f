//! Primary contexts and the calling thread's context stack.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html>

use super::{call, sys, Result};

/// Retains the device's primary context (creating it if needed). mempool retains it once per process
/// and never releases it, as the CUDA runtime does.
pub(crate) fn primary_retain(dev: sys::CUdevice) -> Result<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: one handle is written; `dev` came from `cuDeviceGet`.
    unsafe { call!(cuDevicePrimaryCtxRetain(&mut ctx, dev)) }?;
    Ok(ctx)
}

/// The calling thread's current context (null if none).
pub(crate) fn current() -> Result<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: one handle is written.
    unsafe { call!(cuCtxGetCurrent(&mut ctx)) }?;
    Ok(ctx)
}

/// The device of the calling thread's current context.
pub(crate) fn device() -> Result<sys::CUdevice> {
    let mut dev = 0;
    // SAFETY: one int is written; without a current context (or with a destroyed one) this is an error
    // code.
    unsafe { call!(cuCtxGetDevice(&mut dev)) }?;
    Ok(dev)
}

/// Lets the calling thread's current context access memory of `peer`'s device allocated in `peer`
/// (`cuMemAlloc` memory; pool memory ignores it). Flags must be 0.
///
/// # Safety
/// 1. A live context is current on the calling thread, and `peer` is a live context (held by a retain
///    for the duration of the call).
pub(crate) unsafe fn enable_peer_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: point 1; flags are 0.
    unsafe { call!(cuCtxEnablePeerAccess(peer, 0)) }
}

/// Pushes `ctx` on the calling thread's context stack.
///
/// # Safety
/// 1. `ctx` must be a live context (held by a retain) until the matching [`pop`].
pub(crate) unsafe fn push(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: `ctx` is live (point 1).
    unsafe { call!(cuCtxPushCurrent_v2(ctx)) }
}

/// Pops the calling thread's current context.
pub(crate) fn pop() -> Result<()> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: one handle is written; popping an empty stack is an error code, not UB.
    unsafe { call!(cuCtxPopCurrent_v2(&mut ctx)) }
}

/// Free and total memory of the current context's device.
pub(crate) fn mem_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: two usizes are written; without a current context this is an error code.
    unsafe { call!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
    Ok((free, total))
}

/// Waits for all work of the current context.
pub(crate) fn synchronize() -> Result<()> {
    let _gate = super::gate::synchronize(current_key());
    // SAFETY: no arguments; without a current context this is an error code.
    unsafe { call!(cuCtxSynchronize()) }
}

/// The current context's address, the key of its [`super::gate`]; 0 when none is current or the
/// driver cannot tell.
pub(crate) fn current_key() -> usize {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: one handle is written; with no current context it stays null.
    match unsafe { call!(cuCtxGetCurrent(&mut ctx)) } {
        Ok(()) => ctx as usize,
        Err(_) => 0,
    }
}
