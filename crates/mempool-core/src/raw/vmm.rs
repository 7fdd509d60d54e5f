//! Virtual memory management: physical allocations (`cuMemCreate`), address reservations
//! (`cuMemAddressReserve`), mappings (`cuMemMap`), access (`cuMemSetAccess`), and shareable handles.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
//!
//! These calls take no stream and no context argument; the safe layer binds the device's primary
//! context around them all the same, as the driver's samples run them with a context current.

use std::ffi::c_void;

use super::{call, check_alloc, sys, Result};

/// The properties of a physical allocation of pinned device memory on device ordinal `device`
/// (`CUmemAllocationProp`), exportable as `handle_types` (a `CUmemAllocationHandleType` bit set), marked
/// GPUDirect RDMA capable when `rdma` is set.
pub(crate) fn device_props(device: i32, handle_types: u32, rdma: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(handle_types),
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity`: the minimum (`recommended == false`) or recommended granularity of
/// allocations with `prop`.
pub(crate) fn granularity(prop: &sys::CUmemAllocationProp, recommended: bool) -> Result<usize> {
    use sys::CUmemAllocationGranularity_flags::*;
    let flag = if recommended {
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut g = 0;
    // SAFETY: one usize is written; `prop` is a fully initialised property struct read by the driver.
    unsafe { call!(cuMemGetAllocationGranularity(&mut g, prop, flag)) }?;
    Ok(g)
}

/// `cuMemCreate`: a physical allocation of `size` bytes (a multiple of the minimum granularity of
/// `prop`), returned as a handle the caller must [`release`] once.
pub(crate) fn create(size: usize, prop: &sys::CUmemAllocationProp) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: one handle is written; `prop` is fully initialised; flags must be 0.
    let r = unsafe { call!(cuMemCreate(&mut handle, size, prop, 0)) };
    check_alloc("cuMemCreate", r, size)?;
    Ok(handle)
}

/// `cuMemRelease`: drops one reference to a physical allocation. The memory is freed once no mapping and
/// no other handle refers to it.
///
/// # Safety
/// 1. `handle` came from [`create`], [`retain`] or [`import_fd`] / [`import_fabric`] and is released once.
pub(crate) unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemRelease(handle)) }
}

/// `cuMemAddressReserve`: `size` bytes of virtual address space aligned to `alignment` (0: the
/// default), placed at `hint` if the driver can (0: anywhere).
pub(crate) fn address_reserve(size: usize, alignment: usize, hint: sys::CUdeviceptr) -> Result<sys::CUdeviceptr> {
    let mut p = 0;
    // SAFETY: one address is written; a hint is only a request and never dereferenced; flags must be 0.
    let r = unsafe { call!(cuMemAddressReserve(&mut p, size, alignment, hint, 0)) };
    check_alloc("cuMemAddressReserve", r, size)?;
    Ok(p)
}

/// `cuMemAddressFree`: returns a reservation.
///
/// # Safety
/// 1. `ptr..ptr+size` is exactly one reservation from [`address_reserve`], freed once, with nothing of it
///    mapped any more.
pub(crate) unsafe fn address_free(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: point 1.
    unsafe { call!(cuMemAddressFree(ptr, size)) }
}

/// `cuMemMap`: maps all `size` bytes of `handle` (offset 0, the only offset the driver accepts) at `ptr`.
///
/// # Safety
/// 1. `ptr..ptr+size` lies inside a live reservation of the caller and nothing of it is mapped.
/// 2. `handle` is live and `size` is its size.
pub(crate) unsafe fn map(ptr: sys::CUdeviceptr, size: usize, handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: points 1 and 2; offset and flags must be 0.
    unsafe { call!(cuMemMap(ptr, size, 0, handle, 0)) }
}

/// `cuMemUnmap`: unmaps one whole mapping; the range becomes a reservation again.
///
/// # Safety
/// 1. `ptr..ptr+size` is exactly one mapping made by [`map`], unmapped once.
/// 2. No pending or future work touches the range through this mapping.
pub(crate) unsafe fn unmap(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: points 1 and 2.
    unsafe { call!(cuMemUnmap(ptr, size)) }
}

/// `cuMemSetAccess`: sets each descriptor's device's access to `ptr..ptr+size`.
///
/// # Safety
/// 1. `ptr..ptr+size` is a fully mapped range of the caller's mappings.
/// 2. Revoking access (`PROT_NONE`) is only done while no pending work of that device uses the range.
pub(crate) unsafe fn set_access(ptr: sys::CUdeviceptr, size: usize, descs: &[sys::CUmemAccessDesc]) -> Result<()> {
    // SAFETY: points 1 and 2; `descs` is a live slice and we pass its length.
    unsafe { call!(cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())) }
}

/// `cuMemGetAccess`: the access `location` has to the mapping containing `ptr`. The driver only looks
/// the address up; an unmapped address is an error code.
pub(crate) fn get_access(location: &sys::CUmemLocation, ptr: sys::CUdeviceptr) -> Result<u64> {
    let mut flags = 0;
    // SAFETY: one u64 is written; `location` is a valid struct read by the driver.
    unsafe { call!(cuMemGetAccess(&mut flags, location, ptr)) }?;
    Ok(flags)
}

/// `cuMemRetainAllocationHandle`: the handle of the physical allocation mapped at `ptr`, with one more
/// reference that the caller must [`release`]. An unmapped address is an error code.
pub(crate) fn retain(ptr: sys::CUdeviceptr) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: one handle is written; the driver only looks the address up (it takes it as `void*` but
    // never dereferences it on the host).
    unsafe { call!(cuMemRetainAllocationHandle(&mut handle, ptr as usize as *mut c_void)) }?;
    Ok(handle)
}

/// What `cuMemGetAllocationPropertiesFromHandle` reports of an allocation, as the integers the driver
/// wrote: a newer driver (or an allocation another process made) may report an enum value the bindings do
/// not know, which must not be read into a Rust enum.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct AllocationInfo {
    /// `CUmemAllocationHandleType` bits.
    pub(crate) handle_types: u32,
    /// `CUmemLocationType`.
    pub(crate) location_type: u32,
    /// The location's id (a device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`).
    pub(crate) location_id: i32,
    /// `allocFlags.gpuDirectRDMACapable`.
    pub(crate) gpu_direct_rdma: bool,
}

/// `CUmemAllocationProp` with every enum field as the `unsigned int` C stores it: the storage the driver
/// writes into. Its layout is checked against the bindings' struct below.
#[repr(C)]
struct RawAllocationProp {
    alloc_type: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32_meta: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma: u8,
    usage: u16,
    reserved: [u8; 4],
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    type P = sys::CUmemAllocationProp;
    assert!(size_of::<RawAllocationProp>() == size_of::<P>());
    assert!(align_of::<RawAllocationProp>() == align_of::<P>());
    assert!(offset_of!(RawAllocationProp, alloc_type) == offset_of!(P, type_));
    assert!(offset_of!(RawAllocationProp, handle_types) == offset_of!(P, requestedHandleTypes));
    assert!(
        offset_of!(RawAllocationProp, location_type) == offset_of!(P, location) + offset_of!(sys::CUmemLocation, type_)
    );
    assert!(offset_of!(RawAllocationProp, location_id) == offset_of!(P, location) + offset_of!(sys::CUmemLocation, id));
    assert!(offset_of!(RawAllocationProp, win32_meta) == offset_of!(P, win32HandleMetaData));
    assert!(
        offset_of!(RawAllocationProp, gpu_direct_rdma)
            == offset_of!(P, allocFlags) + offset_of!(sys::CUmemAllocationProp_st__bindgen_ty_1, gpuDirectRDMACapable)
    );
};

/// `cuMemGetAllocationPropertiesFromHandle`.
pub(crate) fn properties(handle: sys::CUmemGenericAllocationHandle) -> Result<AllocationInfo> {
    let mut raw = RawAllocationProp {
        alloc_type: 0,
        handle_types: 0,
        location_type: 0,
        location_id: 0,
        win32_meta: std::ptr::null_mut(),
        compression_type: 0,
        gpu_direct_rdma: 0,
        usage: 0,
        reserved: [0; 4],
    };
    // SAFETY: the driver writes one `CUmemAllocationProp` into storage of the same size, alignment and
    // field offsets (checked at compile time above) whose fields accept any bit pattern the driver writes
    // (integers, and a pointer that is never dereferenced); an unknown handle is an error code.
    unsafe {
        call!(cuMemGetAllocationPropertiesFromHandle(
            &mut raw as *mut RawAllocationProp as *mut sys::CUmemAllocationProp,
            handle
        ))
    }?;
    Ok(AllocationInfo {
        handle_types: raw.handle_types,
        location_type: raw.location_type,
        location_id: raw.location_id,
        gpu_direct_rdma: raw.gpu_direct_rdma != 0,
    })
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, which the caller then owns.
pub(crate) fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: i32 = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for this handle type the driver writes one `int`; flags must be 0.
    unsafe {
        call!(cuMemExportToShareableHandle(
            &mut fd as *mut i32 as *mut c_void,
            handle,
            kind,
            0
        ))
    }?;
    Ok(fd)
}

/// `cuMemExportToShareableHandle` as a fabric handle (`CUmemFabricHandle`, 64 bytes).
pub(crate) fn export_fabric(handle: sys::CUmemGenericAllocationHandle) -> Result<[u8; 64]> {
    let mut out = sys::CUmemFabricHandle_st { data: [0; 64] };
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: for this handle type the driver writes one `CUmemFabricHandle`; flags must be 0.
    unsafe {
        call!(cuMemExportToShareableHandle(
            &mut out as *mut sys::CUmemFabricHandle_st as *mut c_void,
            handle,
            kind,
            0
        ))
    }?;
    Ok(out.data)
}

/// `cuMemImportFromShareableHandle` from a POSIX file descriptor. The descriptor stays the caller's (the
/// driver does not close it). Returns a handle the caller must [`release`].
pub(crate) fn import_fd(fd: i32) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for a POSIX descriptor the driver takes the descriptor's value in the pointer argument
    // (as the memMapIPCDrv sample passes `(void *)(uintptr_t)fd`) and reads nothing through it; a
    // descriptor that is not an exported allocation is an error code.
    unsafe {
        call!(cuMemImportFromShareableHandle(
            &mut handle,
            fd as isize as *mut c_void,
            kind
        ))
    }?;
    Ok(handle)
}

/// `cuMemImportFromShareableHandle` from a fabric handle. Returns a handle the caller must [`release`].
pub(crate) fn import_fabric(data: &[u8; 64]) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    let mut fabric = sys::CUmemFabricHandle_st { data: *data };
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: for a fabric handle the driver reads one `CUmemFabricHandle` through the pointer, which
    // points at a live local copy; bytes that name no allocation are an error code.
    unsafe {
        call!(cuMemImportFromShareableHandle(
            &mut handle,
            &mut fabric as *mut sys::CUmemFabricHandle_st as *mut c_void,
            kind
        ))
    }?;
    Ok(handle)
}
