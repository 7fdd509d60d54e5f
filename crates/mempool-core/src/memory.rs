//! Plain (non-pool) memory and raw copies: the building blocks of mempool-rmm's `CudaResource`,
//! `ManagedResource` and `PinnedHostResource`, of [`crate::BufferView`]'s checked copies and fills, and of
//! tests that move bytes.
//!
//! Every function binds the given context for its duration. Functions that take raw addresses are
//! `unsafe`: the caller vouches for what the addresses point to.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>

use std::ffi::c_void;

use crate::context::Context;
use crate::error::Result;
use crate::raw::{self, sys};
use crate::stream::StreamRef;
use crate::types::{Device, DeviceAddr};

/// Device memory from `cuMemAlloc` in `ctx`. 0 bytes returns null without a driver call.
pub fn device_alloc(ctx: &Context, bytes: usize) -> Result<DeviceAddr> {
    if bytes == 0 {
        return Ok(DeviceAddr::NULL);
    }
    let _g = ctx.bind()?;
    Ok(DeviceAddr(raw::memory::alloc(bytes)?))
}

/// Frees memory from [`device_alloc`] or [`managed_alloc`] (`cuMemFree`). Null is a no-op.
///
/// # Safety
/// 1. `ptr` came from [`device_alloc`] or [`managed_alloc`] in `ctx` and is freed once.
/// 2. No queued or running work uses it.
#[allow(unsafe_code)]
pub unsafe fn device_free(ctx: &Context, ptr: DeviceAddr) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    let _g = ctx.bind()?;
    // SAFETY: points 1 and 2.
    Ok(unsafe { raw::memory::free(ptr.0) }?)
}

/// Managed (unified) memory from `cuMemAllocManaged`, attached globally. 0 bytes returns null.
pub fn managed_alloc(ctx: &Context, bytes: usize) -> Result<DeviceAddr> {
    if bytes == 0 {
        return Ok(DeviceAddr::NULL);
    }
    let _g = ctx.bind()?;
    Ok(DeviceAddr(raw::memory::alloc_managed(bytes)?))
}

/// Page-locked, portable host memory from `cuMemHostAlloc`. 0 bytes returns null.
pub fn pinned_host_alloc(ctx: &Context, bytes: usize) -> Result<*mut u8> {
    if bytes == 0 {
        return Ok(std::ptr::null_mut());
    }
    let _g = ctx.bind()?;
    Ok(raw::memory::alloc_host(bytes)?.cast())
}

/// Frees memory from [`pinned_host_alloc`] (`cuMemFreeHost`). Null is a no-op.
///
/// # Safety
/// 1. `ptr` came from [`pinned_host_alloc`] and is freed once; no work or host code uses it afterwards.
#[allow(unsafe_code)]
pub unsafe fn pinned_host_free(ctx: &Context, ptr: *mut u8) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe { raw::memory::free_host(ptr.cast()) }?)
}

/// Copies host bytes to device memory, ordered on `stream`, and waits for the copy.
///
/// # Safety
/// 1. `dst..dst+src.len()` is device memory of `ctx` (or accessible from it) that work on `stream` may write.
#[allow(unsafe_code)]
pub unsafe fn copy_to_device(ctx: &Context, dst: DeviceAddr, src: &[u8], stream: StreamRef<'_>) -> Result<()> {
    let _g = ctx.bind()?;
    // SAFETY: point 1 for `dst`; `src` is borrowed until the synchronize below.
    unsafe { raw::memory::copy_htod_async(dst.0, src.as_ptr() as *const c_void, src.len(), stream.as_raw()) }?;
    stream.synchronize()
}

/// Copies device memory to host bytes, ordered on `stream`, and waits for the copy.
///
/// # Safety
/// 1. `src..src+dst.len()` is device memory that work on `stream` may read.
#[allow(unsafe_code)]
pub unsafe fn copy_to_host(ctx: &Context, dst: &mut [u8], src: DeviceAddr, stream: StreamRef<'_>) -> Result<()> {
    let _g = ctx.bind()?;
    // SAFETY: point 1 for `src`; `dst` is exclusively borrowed until the synchronize below.
    unsafe { raw::memory::copy_dtoh_async(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), stream.as_raw()) }?;
    stream.synchronize()
}

/// Copies `len` bytes between device addresses (peers included, through unified addressing), ordered on
/// `stream`; does not wait.
///
/// # Safety
/// 1. Both ranges are valid device memory for `len` bytes for work on `stream`, and stay so until the
///    copy completes.
#[allow(unsafe_code)]
pub unsafe fn copy_device_async(
    ctx: &Context,
    dst: DeviceAddr,
    src: DeviceAddr,
    len: usize,
    stream: StreamRef<'_>,
) -> Result<()> {
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe { raw::memory::copy_async(dst.0, src.0, len, stream.as_raw()) }?)
}

/// Fills `len` bytes with `value`, ordered on `stream`; does not wait.
///
/// # Safety
/// 1. `dst..dst+len` is device memory that work on `stream` may write, until the fill completes.
#[allow(unsafe_code)]
pub unsafe fn fill_async(ctx: &Context, dst: DeviceAddr, value: u8, len: usize, stream: StreamRef<'_>) -> Result<()> {
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe { raw::memory::memset_d8_async(dst.0, value, len, stream.as_raw()) }?)
}

/// Fills `count` 32-bit words with `value`, ordered on `stream`; does not wait.
///
/// # Safety
/// 1. `dst` is 4-byte aligned and `dst..dst+4*count` is device memory that work on `stream` may write.
#[allow(unsafe_code)]
pub unsafe fn fill_u32_async(
    ctx: &Context,
    dst: DeviceAddr,
    value: u32,
    count: usize,
    stream: StreamRef<'_>,
) -> Result<()> {
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe { raw::memory::memset_d32_async(dst.0, value, count, stream.as_raw()) }?)
}

/// Prefetches managed memory to `device` (or to the host with `None`), ordered on `stream`.
///
/// # Safety
/// 1. `ptr..ptr+len` is managed memory that stays allocated until the prefetch completes.
#[allow(unsafe_code)]
pub unsafe fn prefetch_async(
    ctx: &Context,
    ptr: DeviceAddr,
    len: usize,
    device: Option<Device>,
    stream: StreamRef<'_>,
) -> Result<()> {
    let location = location_of(device);
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe { raw::memory::prefetch_async(ptr.0, len, location, stream.as_raw()) }?)
}

/// Where the driver prefers a range of managed or system-allocated memory to live
/// (`CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE` and `_ID`): the advice of
/// [`advise_preferred_location`] as the driver reports it back.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PreferredLocation {
    /// No preferred location was set (or the range's pages disagree).
    Unset,
    /// The device with this ordinal.
    Device(i32),
    /// Host memory.
    Host,
    /// Host memory of this NUMA node.
    HostNuma(i32),
}

/// Sets the preferred location of a range of managed memory, or of system-allocated memory on a device
/// with pageable memory access (`cuMemAdvise` with `CU_MEM_ADVISE_SET_PREFERRED_LOCATION`): `Some(device)`
/// for the device's memory, `None` for the host's. The driver rounds the range out to whole pages; the
/// advice steers where pages migrate to and stay, it moves nothing by itself.
///
/// # Safety
/// 1. `ptr..ptr+len` is managed memory, or system-allocated memory on a device that reports pageable
///    memory access, that the caller owns and that stays allocated during the call. The advice moves no
///    data: it applies to every page the range touches (a page shared with neighbouring memory
///    included) and changes only where those pages migrate to.
#[allow(unsafe_code)]
pub unsafe fn advise_preferred_location(
    ctx: &Context,
    ptr: DeviceAddr,
    len: usize,
    device: Option<Device>,
) -> Result<()> {
    let location = location_of(device);
    let _g = ctx.bind()?;
    // SAFETY: point 1.
    Ok(unsafe {
        raw::memory::advise(
            ptr.0,
            len,
            sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            location,
        )
    }?)
}

/// The preferred location of a range of managed or system-allocated memory (`cuMemRangeGetAttribute`);
/// [`PreferredLocation::Unset`] where none was set. Fails for an address the driver does not know.
pub fn preferred_location(ctx: &Context, ptr: DeviceAddr, len: usize) -> Result<PreferredLocation> {
    use sys::CUmem_range_attribute::*;
    let _g = ctx.bind()?;
    // SAFETY: both attributes are answered with one 32-bit integer; the range is only looked up.
    #[allow(unsafe_code)]
    let (kind, id) = unsafe {
        (
            raw::memory::range_attribute_i32(ptr.0, len, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE)?,
            raw::memory::range_attribute_i32(ptr.0, len, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID)?,
        )
    };
    Ok(preferred_location_from_raw(kind, id))
}

/// The driver's form of a location for advice and prefetches: a device, or the host.
fn location_of(device: Option<Device>) -> sys::CUmemLocation {
    use sys::CUmemLocationType::*;
    match device {
        Some(d) => sys::CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: d.as_raw(),
        },
        None => sys::CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

/// A preferred location from the driver's `CUmemLocationType` value and id.
fn preferred_location_from_raw(kind: i32, id: i32) -> PreferredLocation {
    use sys::CUmemLocationType::*;
    match kind {
        k if k == CU_MEM_LOCATION_TYPE_DEVICE as i32 => PreferredLocation::Device(id),
        k if k == CU_MEM_LOCATION_TYPE_HOST as i32 => PreferredLocation::Host,
        k if k == CU_MEM_LOCATION_TYPE_HOST_NUMA as i32 => PreferredLocation::HostNuma(id),
        _ => PreferredLocation::Unset,
    }
}

/// What kind of memory an address is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Host memory known to the driver (pinned or registered).
    Host,
    /// Device memory.
    Device,
    /// An array.
    Array,
    /// Unified memory.
    Unified,
}

/// What the driver knows of an address (`cuPointerGetAttribute`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    /// The memory type.
    pub memory_type: MemoryType,
    /// The ordinal of the device the memory belongs to (for managed or host memory, the driver's answer).
    pub device_ordinal: i32,
    /// Whether the memory is managed.
    pub is_managed: bool,
    /// Start of the allocation that contains the address.
    pub range_start: DeviceAddr,
    /// Size of that allocation in bytes.
    pub range_size: usize,
}

/// Looks an address up. Fails (`CUDA_ERROR_INVALID_VALUE`) for an address the driver does not know,
/// which is how tests check that memory is really device-accessible.
pub fn pointer_info(ptr: DeviceAddr) -> Result<PointerInfo> {
    use sys::CUpointer_attribute::*;
    raw::init()?;
    // SAFETY: each of the five attributes is read into the type the driver writes for it (`unsigned int`
    // for the memory type, `int` for the ordinal, `unsigned int` (a bool) for IS_MANAGED, `CUdeviceptr`
    // for the range start, `size_t` for the range size).
    #[allow(unsafe_code)]
    let (mt, ordinal, managed, start, size) = unsafe {
        (
            raw::memory::pointer_attribute::<u32>(ptr.0, CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?,
            raw::memory::pointer_attribute::<i32>(ptr.0, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?,
            raw::memory::pointer_attribute::<u32>(ptr.0, CU_POINTER_ATTRIBUTE_IS_MANAGED)?,
            raw::memory::pointer_attribute::<u64>(ptr.0, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)?,
            raw::memory::pointer_attribute::<usize>(ptr.0, CU_POINTER_ATTRIBUTE_RANGE_SIZE)?,
        )
    };
    let memory_type = match mt {
        1 => MemoryType::Host,
        3 => MemoryType::Array,
        4 => MemoryType::Unified,
        _ => MemoryType::Device,
    };
    Ok(PointerInfo {
        memory_type,
        device_ordinal: ordinal,
        is_managed: managed != 0,
        range_start: DeviceAddr(start),
        range_size: size,
    })
}

/// The allocation that contains `ptr`: its base address and size in bytes (`cuMemGetAddressRange`).
///
/// For memory from a stream-ordered pool this is the allocation `cuMemAllocFromPoolAsync` returned, which
/// is what `cuMemPoolExportPointer` accepts; mempool-ipc uses it to share a buffer suballocated from a
/// larger pool allocation as that allocation plus an offset. Fails (`CUDA_ERROR_INVALID_VALUE` or
/// `CUDA_ERROR_NOT_FOUND`) for an address the driver does not know.
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
pub fn address_range(ctx: &Context, ptr: DeviceAddr) -> Result<(DeviceAddr, usize)> {
    let _g = ctx.bind()?;
    // SAFETY: a context is bound; the driver only looks the address up.
    #[allow(unsafe_code)]
    let (base, size) = unsafe { raw::memory::address_range(ptr.0) }?;
    Ok((DeviceAddr(base), size))
}

/// The stream-ordered pool an address was allocated from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`), as a
/// raw handle to compare with [`crate::MemPool::as_raw`]; null for memory that no pool allocated.
pub fn pool_of(ptr: DeviceAddr) -> Result<crate::types::RawPool> {
    raw::init()?;
    // SAFETY: the driver writes the pool handle, a pointer-sized value, which a `usize` holds.
    #[allow(unsafe_code)]
    let handle = unsafe {
        raw::memory::pointer_attribute::<usize>(ptr.0, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)
    }?;
    Ok(handle as sys::CUmemoryPool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preferred_locations_read_from_the_driver_form() {
        use sys::CUmemLocationType::*;
        assert_eq!(
            preferred_location_from_raw(CU_MEM_LOCATION_TYPE_DEVICE as i32, 1),
            PreferredLocation::Device(1)
        );
        assert_eq!(
            preferred_location_from_raw(CU_MEM_LOCATION_TYPE_HOST as i32, 0),
            PreferredLocation::Host
        );
        assert_eq!(
            preferred_location_from_raw(CU_MEM_LOCATION_TYPE_HOST_NUMA as i32, 2),
            PreferredLocation::HostNuma(2)
        );
        assert_eq!(preferred_location_from_raw(0, -2), PreferredLocation::Unset);
        assert_eq!(location_of(None).type_, CU_MEM_LOCATION_TYPE_HOST);
    }
}
