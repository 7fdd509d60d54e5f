//! Modules and kernel launches: enough to run small PTX kernels in tests, examples and benchmarks.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html>

use std::ffi::{c_void, CStr};

use super::{call, sys, Result};

/// Loads a module from NUL-terminated PTX (or cubin) in the current context.
pub(crate) fn load_data(image: &CStr) -> Result<sys::CUmodule> {
    let mut m = std::ptr::null_mut();
    // SAFETY: `image` is NUL-terminated and lives for the call; one handle is written.
    unsafe { call!(cuModuleLoadData(&mut m, image.as_ptr() as *const c_void)) }?;
    Ok(m)
}

/// # Safety
/// 1. `m` came from [`load_data`], is unloaded once, and no pending launch uses its functions.
pub(crate) unsafe fn unload(m: sys::CUmodule) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuModuleUnload(m)) }
}

/// # Safety
/// 1. `m` is a live module.
pub(crate) unsafe fn get_function(m: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction> {
    let mut f = std::ptr::null_mut();
    // SAFETY: point 1; `name` is NUL-terminated; one handle is written.
    unsafe { call!(cuModuleGetFunction(&mut f, m, name.as_ptr())) }?;
    Ok(f)
}

/// Launches `f` on `stream`.
///
/// # Safety
/// 1. `f` is a function of a live module; `stream` is live or a special handle of the same context.
/// 2. `params` holds one pointer per kernel parameter, each to a value of exactly that parameter's type,
///    all alive for this call (the driver copies them).
/// 3. Every pointer the kernel dereferences is valid for what the kernel does with it, in the order of
///    `stream`.
pub(crate) unsafe fn launch(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: points 1 to 3.
    unsafe {
        call!(cuLaunchKernel(
            f,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared_mem,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut()
        ))
    }
}
