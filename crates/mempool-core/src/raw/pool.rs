//! Stream-ordered memory pools.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::{call, check_alloc, sys, Result};

/// Creates a pool from properties.
pub(crate) fn create(props: &sys::CUmemPoolProps) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: `props` is a fully initialised properties struct (reserved bytes zero); one handle is written.
    unsafe { call!(cuMemPoolCreate(&mut pool, props)) }?;
    Ok(pool)
}

/// # Safety
/// 1. `pool` came from [`create`] or [`import_fd`] and is destroyed once; nothing uses it afterwards.
///    (Outstanding allocations are fine: the driver releases the pool once they are freed.)
///
/// Runs with no synchronize of this crate in the driver for `ctx`, the pool's context (see
/// [`super::gate`]).
pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool, ctx: sys::CUcontext) -> Result<()> {
    let _gate = super::gate::teardown(ctx as usize);
    // SAFETY: point 1.
    unsafe { call!(cuMemPoolDestroy(pool)) }
}

/// # Safety
/// 1. `pool` is live, and `value` points to the type the attribute takes (`int` for the reuse flags,
///    `cuuint64_t` for the thresholds and counters).
pub(crate) unsafe fn set_attribute(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: *mut c_void,
) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemPoolSetAttribute(pool, attr, value)) }
}

/// # Safety
/// 1. As for [`set_attribute`]: `value` is writable storage of the attribute's type.
pub(crate) unsafe fn get_attribute(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: *mut c_void,
) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemPoolGetAttribute(pool, attr, value)) }
}

/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemPoolTrimTo(pool, keep)) }
}

/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn set_access(pool: sys::CUmemoryPool, descs: &[sys::CUmemAccessDesc]) -> Result<()> {
    // SAFETY: point 1; the slice's pointer and length describe `descs.len()` initialised descriptors.
    unsafe { call!(cuMemPoolSetAccess(pool, descs.as_ptr(), descs.len())) }
}

/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn get_access(
    pool: sys::CUmemoryPool,
    location: &sys::CUmemLocation,
) -> Result<sys::CUmemAccess_flags> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: point 1; the location is read, one enum is written. The driver takes a mutable pointer
    // but does not write through it.
    unsafe {
        call!(cuMemPoolGetAccess(
            &mut flags,
            pool,
            location as *const _ as *mut sys::CUmemLocation
        ))
    }?;
    Ok(flags)
}

/// Allocates `bytes` from `pool`, ordered on `stream`.
///
/// # Safety
/// 1. `pool` is live and can allocate (not imported); `stream` is live or a special handle, of a context
///    whose device can access the pool.
pub(crate) unsafe fn alloc_async(
    pool: sys::CUmemoryPool,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: point 1; one pointer is written.
    let r = unsafe { call!(cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream)) };
    check_alloc("cuMemAllocFromPoolAsync", r, bytes)?;
    Ok(ptr)
}

/// Frees `ptr`, ordered on `stream`.
///
/// # Safety
/// 1. `ptr` came from a stream-ordered allocation (or an imported pointer) and is freed once.
/// 2. No work ordered after this free on `stream`, and no work not ordered before it, uses `ptr`.
pub(crate) unsafe fn free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: points 1 and 2.
    unsafe { call!(cuMemFreeAsync(ptr, stream)) }
}

/// The default pool of `dev`.
pub(crate) fn device_default(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: one handle is written.
    unsafe { call!(cuDeviceGetDefaultMemPool(&mut pool, dev)) }?;
    Ok(pool)
}

/// The default pool of a location for an allocation type (`cuMemGetDefaultMemPool`, CUDA 13.0): for
/// managed memory, the pool `cudaMallocManaged`-style stream-ordered allocations of that preferred
/// location come from.
pub(crate) fn location_default(
    location: sys::CUmemLocation,
    allocation_type: sys::CUmemAllocationType,
) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    let mut location = location;
    // SAFETY: one handle is written; the location is read (the driver takes a mutable pointer but does not
    // write through it) and is a local copy either way.
    unsafe { call!(cuMemGetDefaultMemPool(&mut pool, &mut location, allocation_type)) }?;
    Ok(pool)
}

/// The current pool of `dev` (what `cudaMallocAsync` uses).
pub(crate) fn device_current(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: one handle is written.
    unsafe { call!(cuDeviceGetMemPool(&mut pool, dev)) }?;
    Ok(pool)
}

/// # Safety
/// 1. `pool` is live, located on `dev`, and stays live while it is `dev`'s current pool.
pub(crate) unsafe fn set_device_current(dev: sys::CUdevice, pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuDeviceSetMemPool(dev, pool)) }
}

/// Exports the pool as a POSIX file descriptor, which the caller then owns.
///
/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: point 1. For CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the handle is an `int` written
    // through the pointer; flags must be 0.
    unsafe {
        call!(cuMemPoolExportToShareableHandle(
            &mut fd as *mut _ as *mut c_void,
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0
        ))
    }?;
    // SAFETY: on success the driver returns a new descriptor that the caller owns and must close.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Imports a pool from a POSIX file descriptor. The descriptor stays the caller's: the driver does not
/// take it over, so the caller closes it when done.
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: for POSIX file descriptors the handle argument is the descriptor's value cast to a pointer;
    // the descriptor is open for the duration of the call (borrowed). One handle is written.
    unsafe {
        call!(cuMemPoolImportFromShareableHandle(
            &mut pool,
            fd.as_raw_fd() as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0
        ))
    }?;
    Ok(pool)
}

/// The 64 opaque bytes that let another process import `ptr`.
///
/// # Safety
/// 1. `ptr` is a live allocation of an exportable pool.
pub(crate) unsafe fn export_pointer(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: point 1; the struct is written.
    unsafe { call!(cuMemPoolExportPointer(&mut data, ptr)) }?;
    Ok(data.reserved)
}

/// Imports a pointer exported from the pool `pool` was imported from.
///
/// # Safety
/// 1. `pool` is a live imported pool.
pub(crate) unsafe fn import_pointer(pool: sys::CUmemoryPool, data: &[u8; 64]) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    let mut d = sys::CUmemPoolPtrExportData { reserved: *data };
    // SAFETY: point 1; the 64 bytes are opaque data the driver validates; one pointer is written.
    unsafe { call!(cuMemPoolImportPointer(&mut ptr, pool, &mut d)) }?;
    Ok(ptr)
}
