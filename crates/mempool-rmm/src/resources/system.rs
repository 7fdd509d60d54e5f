//! Resources over system-allocated memory (SAM): plain host allocations that the GPU reaches through
//! pageable memory access. [`SystemResource`] (RMM's `system_memory_resource`) and
//! [`SamHeadroomResource`] (RMM's `sam_headroom_memory_resource`).

use std::alloc::Layout;
use std::sync::Arc;

use mempool_core::{memory, Context, Device, DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resource::{MemoryResource, ALIGNMENT};

const SYSTEM: &str = "SystemResource";
const SAM_HEADROOM: &str = "SamHeadroomResource";

/// Why a device without pageable memory access is refused, naming the attribute.
fn pageable_refusal(resource: &'static str, device: usize) -> Error {
    Error::Unsupported {
        resource,
        reason: format!(
            "device {device} reports CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 0: it cannot access pageable \
             host memory (malloc); that takes HMM (NVIDIA's open kernel modules on a Linux kernel with HMM) or \
             ATS (Grace Hopper)"
        ),
    }
}

/// Refuses a device that cannot access pageable host memory, before anything is allocated.
fn require_pageable_access(resource: &'static str, device: &Device) -> Result<()> {
    if device.pageable_memory_access()? {
        Ok(())
    } else {
        Err(pageable_refusal(resource, device.ordinal()))
    }
}

/// The layout of a system allocation of `bytes`: aligned as every resource's allocations are. `None` for
/// a size no layout can describe.
fn layout(bytes: usize) -> Option<Layout> {
    Layout::from_size_align(bytes, ALIGNMENT as usize).ok()
}

/// Allocates `bytes` of pageable host memory from the global allocator, [`ALIGNMENT`]-aligned. 0
/// bytes is the null address; a size the allocator cannot serve is out of memory.
fn host_allocate(resource: &'static str, bytes: usize) -> Result<DeviceAddr> {
    if bytes == 0 {
        return Ok(DeviceAddr::NULL);
    }
    let oom = Error::OutOfMemory {
        resource,
        requested: bytes,
    };
    let layout = layout(bytes).ok_or_else(|| oom.clone())?;
    // SAFETY: the layout's size is not zero (`bytes > 0`).
    #[allow(unsafe_code)]
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        return Err(oom);
    }
    Ok(DeviceAddr(p as u64))
}

/// Frees memory from [`host_allocate`].
///
/// # Safety
/// 1. `ptr` is not null and came from `host_allocate(_, bytes)` with this `bytes`.
/// 2. It is freed once, and nothing (host code or device work) uses it afterwards.
#[allow(unsafe_code)]
unsafe fn host_deallocate(resource: &'static str, ptr: DeviceAddr, bytes: usize) -> Result<()> {
    let Some(layout) = layout(bytes).filter(|_| bytes > 0) else {
        return Err(Error::InvalidDeallocation {
            resource,
            ptr: ptr.0,
            bytes,
            reason: "no allocation of this size is possible".into(),
        });
    };
    // SAFETY: by point 1 the global allocator returned `ptr` for exactly this layout (same size, same
    // alignment); by point 2 it is returned once and not used again.
    unsafe { std::alloc::dealloc(ptr.0 as *mut u8, layout) };
    Ok(())
}

/// Plain host memory from the global allocator (`malloc` under the default one), used by the GPU through
/// pageable memory access: RMM's `system_memory_resource`. The device must report
/// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` (heterogeneous memory management, HMM, on PCIe machines:
/// NVIDIA's open kernel modules and a recent Linux kernel; or address translation services, ATS, on Grace
/// Hopper); elsewhere [`SystemResource::new`] fails with [`Error::Unsupported`] naming the attribute, as
/// RMM's constructor refuses.
///
/// As RMM's: allocations are 256-byte aligned and ignore the stream; a free first synchronizes its
/// stream (the host's free is immediate, so work still queued must not touch the memory afterwards),
/// then returns the memory to the allocator. The memory is host-accessible too: the host may read and
/// write it through the address once the device work on it is done. The driver does not track it, so
/// pointer queries (`cuPointerGetAttribute`) do not know it.
///
/// Two instances are equal only when they are the same object. (RMM calls all its instances equal; here
/// [`MemoryResource::is_equal`] sees another resource only as a `dyn MemoryResource` and cannot tell that
/// it frees through the same allocator.)
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{MemoryResource, SystemResource};
/// let dev = Device::get(0)?;
/// let mr = SystemResource::new(&dev)?; // Error::Unsupported without pageable memory access
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(1 << 20, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SystemResource {
    device: Device,
}

impl SystemResource {
    /// A resource for `device`, which must report pageable memory access.
    pub fn new(device: &Device) -> Result<SystemResource> {
        require_pageable_access(SYSTEM, device)?;
        Ok(SystemResource { device: *device })
    }

    /// The device whose pageable memory access the resource relies on.
    pub fn device(&self) -> Device {
        self.device
    }
}

/// The free of both system resources: wait for the stream, then return the memory to the allocator.
///
/// # Safety
/// 1. As [`MemoryResource::deallocate`]'s 1-3 for a resource whose allocations come from
///    [`host_allocate`]: `ptr` is null or came from `host_allocate(_, bytes)`, is freed once, and every
///    use of it is ordered before this point of `stream`.
#[allow(unsafe_code)]
unsafe fn system_deallocate(
    resource: &'static str,
    ptr: DeviceAddr,
    bytes: usize,
    stream: StreamRef<'_>,
) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    // The host's free is immediate: wait for the stream, after which no work ordered on it uses `ptr`.
    stream.synchronize()?;
    // SAFETY: point 1 gives host_deallocate's 1 and 2: the memory came from `host_allocate` with `bytes`, is
    // freed once, and the work that used it, ordered on `stream`, has completed.
    unsafe { host_deallocate(resource, ptr, bytes) }
}

// SAFETY: each allocation is a fresh `std::alloc` block of at least `bytes` bytes aligned to 256 (null only for 0 bytes), which the device reaches through pageable memory access (checked in `new`); nothing else owns it until `deallocate` returns it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for SystemResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        host_allocate(SYSTEM, bytes).map_err(|e| crate::observe::oom::explain(e, self))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this resource's allocations come from `host_allocate`; the caller's obligations 1-3 are
        // system_deallocate's point 1.
        unsafe { system_deallocate(SYSTEM, ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        SYSTEM
    }
}

/// How an allocation of `bytes` is split between the GPU and the host when the device has `free` bytes
/// free and `headroom` must stay free: the first `gpu` bytes (as many as fit above the headroom, rounded
/// down to the alignment) prefer the device, the remaining `cpu` bytes prefer the host. RMM's rule.
fn split(bytes: usize, free: usize, headroom: usize) -> (usize, usize) {
    let allocatable = free.saturating_sub(headroom);
    let gpu = bytes.min(allocatable) / ALIGNMENT as usize * ALIGNMENT as usize;
    (gpu, bytes - gpu)
}

/// System-allocated memory that keeps `headroom` bytes of the GPU's memory free: RMM's
/// `sam_headroom_memory_resource`. System memory migrates to the GPU as the GPU touches it but is not
/// migrated back, so with the GPU oversubscribed other CUDA calls could run out; this resource steers
/// where each allocation's pages may live instead.
///
/// As RMM's, for each allocation (memory from [`SystemResource`]'s allocator): it reads the device's free
/// memory (`cuMemGetInfo`), and the leading part of the allocation that fits in `free - headroom`
/// (rounded down to 256 bytes) gets the device as its preferred location, the rest the host
/// (`cuMemAdvise` with `CU_MEM_ADVISE_SET_PREFERRED_LOCATION`). Nothing is prefetched: pages move when
/// they are touched, as advised. The free memory is read at allocation time, before any page has moved,
/// so allocations made in a row may together advise more than `free - headroom` to the device; RMM's
/// check has the same limit, and suggests keeping this resource for large allocations (with, say, a
/// binning resource for the small ones) since the check costs a driver call per allocation. The driver
/// rounds advice out to whole pages, so a page shared by the two parts (or with a neighbouring
/// allocation) gets the last advice given.
///
/// Frees are [`SystemResource`]'s: synchronize the stream, then free. The device must report pageable
/// memory access; elsewhere [`SamHeadroomResource::new`] fails with [`Error::Unsupported`] naming the
/// attribute.
#[derive(Debug)]
pub struct SamHeadroomResource {
    device: Device,
    ctx: Arc<Context>,
    headroom: usize,
}

impl SamHeadroomResource {
    /// A resource for `device` that keeps `headroom` bytes of its memory free.
    pub fn new(device: &Device, headroom: usize) -> Result<SamHeadroomResource> {
        require_pageable_access(SAM_HEADROOM, device)?;
        Ok(SamHeadroomResource {
            device: *device,
            ctx: device.context()?,
            headroom,
        })
    }

    /// The bytes of GPU memory the resource keeps free.
    pub fn headroom(&self) -> usize {
        self.headroom
    }

    /// Advises where the parts of a fresh allocation `ptr..ptr+bytes` should live.
    fn place(&self, ptr: DeviceAddr, bytes: usize) -> Result<()> {
        let free = self.ctx.memory_info()?.free;
        let (gpu, cpu) = split(bytes, free, self.headroom);
        if gpu > 0 {
            // SAFETY: `ptr..ptr+gpu` lies in system memory this resource just allocated and still owns, on a
            // device that reports pageable memory access (checked in `new`).
            #[allow(unsafe_code)]
            unsafe { memory::advise_preferred_location(&self.ctx, ptr, gpu, Some(self.device)) }?;
        }
        if cpu > 0 {
            // SAFETY: as above, for the rest of the allocation, `ptr+gpu..ptr+bytes`.
            #[allow(unsafe_code)]
            unsafe { memory::advise_preferred_location(&self.ctx, ptr.offset(gpu), cpu, None) }?;
        }
        Ok(())
    }
}

// SAFETY: each allocation is a fresh `std::alloc` block of at least `bytes` bytes aligned to 256 (null only for 0 bytes), which the device reaches through pageable memory access (checked in `new`); nothing else owns it until `deallocate` returns it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for SamHeadroomResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let ptr = host_allocate(SAM_HEADROOM, bytes).map_err(|e| crate::observe::oom::explain(e, self))?;
        if ptr.is_null() {
            return Ok(ptr);
        }
        if let Err(e) = self.place(ptr, bytes) {
            // SAFETY: `ptr` came from `host_allocate(_, bytes)` just above and was never handed out; only the
            // advice calls named it, and they have returned. Freed once, here.
            #[allow(unsafe_code)]
            let _ = unsafe { host_deallocate(SAM_HEADROOM, ptr, bytes) };
            return Err(e);
        }
        Ok(ptr)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this resource's allocations come from `host_allocate` (the advice changes where pages live,
        // not who owns them); the caller's obligations 1-3 are system_deallocate's point 1.
        unsafe { system_deallocate(SAM_HEADROOM, ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        SAM_HEADROOM
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate
mod tests {
    use super::*;

    #[test]
    fn host_allocations_are_aligned_writable_and_freed_by_size() {
        for bytes in [1, 255, 256, 257, 4096, 3 << 20] {
            let p = host_allocate(SYSTEM, bytes).unwrap();
            assert!(!p.is_null());
            assert_eq!(p.0 % ALIGNMENT, 0, "{bytes} bytes at {p}");
            // SAFETY: `p` is `bytes` bytes of fresh host memory from the global allocator.
            unsafe { std::ptr::write_bytes(p.0 as *mut u8, 0xab, bytes) };
            // SAFETY: `p` came from `host_allocate(_, bytes)` and is freed once; nothing uses it after.
            unsafe { host_deallocate(SYSTEM, p, bytes) }.unwrap();
        }
        assert_eq!(host_allocate(SYSTEM, 0).unwrap(), DeviceAddr::NULL);
    }

    #[test]
    fn impossible_sizes_are_out_of_memory() {
        for bytes in [usize::MAX, 1 << 60] {
            assert_eq!(
                host_allocate(SAM_HEADROOM, bytes).unwrap_err(),
                Error::OutOfMemory {
                    resource: SAM_HEADROOM,
                    requested: bytes
                }
            );
        }
    }

    #[test]
    fn a_size_no_allocation_has_is_refused_before_the_allocator_sees_it() {
        // SAFETY: refused before anything is freed (no layout has this size).
        let e = unsafe { host_deallocate(SYSTEM, DeviceAddr(0x1000), usize::MAX) }.unwrap_err();
        assert!(matches!(e, Error::InvalidDeallocation { resource: SYSTEM, .. }), "{e}");
    }

    #[test]
    fn the_refusal_names_the_attribute() {
        assert_eq!(
            pageable_refusal(SYSTEM, 0).to_string(),
            "SystemResource cannot serve this request: device 0 reports CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS \
             = 0: it cannot access pageable host memory (malloc); that takes HMM (NVIDIA's open kernel modules on \
             a Linux kernel with HMM) or ATS (Grace Hopper)"
        );
    }

    #[test]
    fn allocations_split_at_the_headroom_as_rmm_splits_them() {
        const MIB: usize = 1 << 20;
        // Plenty free: all on the GPU.
        assert_eq!(split(10 * MIB, 100 * MIB, 10 * MIB), (10 * MIB, 0));
        // Part fits above the headroom: that part on the GPU, the rest on the host.
        assert_eq!(split(10 * MIB, 14 * MIB, 10 * MIB), (4 * MIB, 6 * MIB));
        // Free below the headroom: all on the host.
        assert_eq!(split(10 * MIB, 5 * MIB, 10 * MIB), (0, 10 * MIB));
        assert_eq!(split(10 * MIB, 10 * MIB, 10 * MIB), (0, 10 * MIB));
        // The GPU part is rounded down to the alignment.
        assert_eq!(split(1000, 10 * MIB + 300, 10 * MIB), (256, 744));
        assert_eq!(split(100, 100 * MIB, 0), (0, 100));
    }
}
