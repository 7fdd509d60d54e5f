//! Plain allocations, copies, fills and pointer attributes.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>

use std::ffi::c_void;

use super::{call, check_alloc, sys, Result};

/// `cuMemAlloc`: device memory in the current context.
pub(crate) fn alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut p = 0;
    // SAFETY: one pointer is written; a context is current (callers bind one).
    let r = unsafe { call!(cuMemAlloc_v2(&mut p, bytes)) };
    check_alloc("cuMemAlloc", r, bytes)?;
    Ok(p)
}

/// # Safety
/// 1. `p` came from [`alloc`] or [`alloc_managed`], is freed once, and no pending work uses it.
pub(crate) unsafe fn free(p: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemFree_v2(p)) }
}

/// `cuMemAllocManaged` with `CU_MEM_ATTACH_GLOBAL`.
pub(crate) fn alloc_managed(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut p = 0;
    // SAFETY: one pointer is written; flag 1 is CU_MEM_ATTACH_GLOBAL.
    let r = unsafe { call!(cuMemAllocManaged(&mut p, bytes, 1)) };
    check_alloc("cuMemAllocManaged", r, bytes)?;
    Ok(p)
}

/// `cuMemHostAlloc`: page-locked host memory, portable across contexts.
pub(crate) fn alloc_host(bytes: usize) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: one pointer is written; flag 1 is CU_MEMHOSTALLOC_PORTABLE.
    let r = unsafe { call!(cuMemHostAlloc(&mut p, bytes, 1)) };
    check_alloc("cuMemHostAlloc", r, bytes)?;
    Ok(p)
}

/// # Safety
/// 1. `p` came from [`alloc_host`], is freed once, and no pending work uses it.
pub(crate) unsafe fn free_host(p: *mut c_void) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemFreeHost(p)) }
}

/// Copies `len` bytes host to device, ordered on `stream`.
///
/// # Safety
/// 1. `src` is readable for `len` bytes until the copy completes (synchronize before reusing it).
/// 2. `dst` is device memory writable for `len` bytes by work on `stream`.
pub(crate) unsafe fn copy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: points 1 and 2.
    unsafe { call!(cuMemcpyHtoDAsync_v2(dst, src, len, stream)) }
}

/// Copies `len` bytes device to host, ordered on `stream`.
///
/// # Safety
/// 1. `dst` is writable for `len` bytes and not read until the copy completes.
/// 2. `src` is device memory readable for `len` bytes by work on `stream`.
pub(crate) unsafe fn copy_dtoh_async(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: points 1 and 2.
    unsafe { call!(cuMemcpyDtoHAsync_v2(dst, src, len, stream)) }
}

/// Copies `len` bytes between device addresses (unified addressing resolves peers), ordered on `stream`.
///
/// # Safety
/// 1. Both ranges are valid for `len` bytes for work on `stream`.
pub(crate) unsafe fn copy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemcpyAsync(dst, src, len, stream)) }
}

/// Fills `len` bytes with `value`, ordered on `stream`.
///
/// # Safety
/// 1. `dst` is device memory writable for `len` bytes by work on `stream`.
pub(crate) unsafe fn memset_d8_async(
    dst: sys::CUdeviceptr,
    value: u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemsetD8Async(dst, value, len, stream)) }
}

/// Fills `count` 32-bit words with `value`, ordered on `stream`.
///
/// # Safety
/// 1. `dst` is 4-byte aligned device memory writable for `4 * count` bytes by work on `stream`.
pub(crate) unsafe fn memset_d32_async(
    dst: sys::CUdeviceptr,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemsetD32Async(dst, value, count, stream)) }
}

/// Reads one pointer attribute into a value of type `T`.
///
/// # Safety
/// 1. `T` is the type the driver writes for `attr` (see `CUpointer_attribute`).
pub(crate) unsafe fn pointer_attribute<T: Default>(ptr: sys::CUdeviceptr, attr: sys::CUpointer_attribute) -> Result<T> {
    let mut v = T::default();
    // SAFETY: point 1: `v` is storage of the attribute's type.
    unsafe { call!(cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, ptr)) }?;
    Ok(v)
}

/// Prefetches managed memory to a location, ordered on `stream`.
///
/// # Safety
/// 1. `ptr..ptr+len` is managed memory; `stream` is live or a special handle.
pub(crate) unsafe fn prefetch_async(
    ptr: sys::CUdeviceptr,
    len: usize,
    location: sys::CUmemLocation,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: point 1; flags must be 0.
    unsafe { call!(cuMemPrefetchAsync_v2(ptr, len, location, 0, stream)) }
}

/// Gives the driver advice about a range of managed or system-allocated memory (`cuMemAdvise`), such as
/// its preferred location.
///
/// # Safety
/// 1. `ptr..ptr+len` is managed memory, or system-allocated memory on a device with pageable memory
///    access, that the caller owns: the advice changes where its pages live and who maps them.
pub(crate) unsafe fn advise(
    ptr: sys::CUdeviceptr,
    len: usize,
    advice: sys::CUmem_advise,
    location: sys::CUmemLocation,
) -> Result<()> {
    // SAFETY: point 1; the driver rounds the range out to whole pages and reads nothing through it.
    unsafe { call!(cuMemAdvise_v2(ptr, len, advice, location)) }
}

/// Reads a 4-byte attribute of a range of managed or system-allocated memory (`cuMemRangeGetAttribute`).
///
/// # Safety
/// 1. `attr` is an attribute the driver answers with one 32-bit integer (`PREFERRED_LOCATION_TYPE`,
///    `PREFERRED_LOCATION_ID`, `READ_MOSTLY`, ...). The range is only looked up: an address the driver
///    does not know is an error, not undefined behaviour.
pub(crate) unsafe fn range_attribute_i32(
    ptr: sys::CUdeviceptr,
    len: usize,
    attr: sys::CUmem_range_attribute,
) -> Result<i32> {
    let mut v: i32 = 0;
    // SAFETY: point 1: four writable bytes, and their size passed along.
    unsafe {
        call!(cuMemRangeGetAttribute(
            &mut v as *mut i32 as *mut c_void,
            std::mem::size_of::<i32>(),
            attr,
            ptr,
            len
        ))
    }?;
    Ok(v)
}

/// `cuMemGetAddressRange`: the base and size of the allocation that contains `ptr`.
///
/// # Safety
/// 1. A context is current (callers bind one). The driver only looks the address up; nothing is
///    dereferenced, and an unknown address is an error, not undefined behaviour.
pub(crate) unsafe fn address_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: point 1; one base and one size are written.
    unsafe { call!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) }?;
    Ok((base, size))
}
