//! Virtual memory management, the physical side: what a device supports ([`VmmSupport`]), allocation
//! granularity, and [`PhysicalAllocation`] (`cuMemCreate`), with export and import of shareable handles
//! (a POSIX file descriptor, or a fabric handle where the device supports one) and retaining the
//! allocation behind a mapped address (`cuMemRetainAllocationHandle`).
//!
//! Physical memory has no address until it is mapped into a [`crate::Reservation`]; see `mapping` for
//! reservations and mappings, `growable` for the buffer built on both.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::raw::{self, sys};
use crate::types::{Device, DeviceAddr, HandleTypes};

/// What a device supports of virtual memory management, from its attributes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct VmmSupport {
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (the binding's `..._VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`, 102): `cuMemCreate`, `cuMemMap` and the rest.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`: allocations exportable as file
    /// descriptors.
    pub posix_fd: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`: allocations exportable as fabric handles
    /// (multi-node NVLink systems; a driver that does not know the attribute reads as no support).
    pub fabric: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`: allocations may be marked GPUDirect
    /// RDMA capable.
    pub gpu_direct_rdma: bool,
}

impl VmmSupport {
    /// The handle types `cuMemCreate` allocations of the device can be exported as.
    pub fn handle_types(&self) -> HandleTypes {
        let mut t = HandleTypes::empty();
        if self.posix_fd {
            t |= HandleTypes::POSIX_FILE_DESCRIPTOR;
        }
        if self.fabric {
            t |= HandleTypes::FABRIC;
        }
        t
    }

    /// Refuses, naming the missing capability, properties that `device` (with this support) cannot
    /// allocate: no VMM at all, a handle type it lacks, the RDMA flag without RDMA support.
    pub(crate) fn check(&self, device: usize, props: &AllocationProps) -> Result<()> {
        if !self.vmm {
            return Err(Error::CapabilityMissing {
                device,
                operation: "use virtual memory management (cuMemCreate, cuMemMap)",
                missing: "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0".into(),
            });
        }
        let known = HandleTypes::POSIX_FILE_DESCRIPTOR | HandleTypes::FABRIC;
        let supported = self.handle_types();
        if !props.handle_types.difference(known).is_empty() || !supported.contains(props.handle_types) {
            return Err(Error::VmmHandleTypeNotSupported {
                device,
                requested: props.handle_types,
                supported,
            });
        }
        if props.gpu_direct_rdma && !self.gpu_direct_rdma {
            return Err(Error::CapabilityMissing {
                device,
                operation: "create a GPUDirect RDMA capable physical allocation",
                missing: "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0".into(),
            });
        }
        Ok(())
    }
}

/// Which granularity to ask for (`CUmemAllocationGranularity_flags`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// The minimum: every size, offset and reservation alignment must be a multiple of it.
    Minimum,
    /// The driver's recommendation for performance (a multiple of the minimum).
    Recommended,
}

/// How a physical allocation is made (`CUmemAllocationProp`): pinned memory of one device, exportable as
/// the given handle types, optionally GPUDirect RDMA capable.
///
/// Named `Props`, not `Options` (the workspace's word for a struct of settings), because it mirrors the
/// driver's `CUmemAllocationProp`.
///
/// ```
/// # fn main() -> mempool_core::Result<()> {
/// # if !mempool_core::driver_present() { return Ok(()); }
/// use mempool_core::{AllocationProps, Device, HandleTypes};
/// let dev = Device::get(0)?;
/// let props = AllocationProps::new(dev).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
/// assert_eq!(props.device, dev);
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct AllocationProps {
    /// The device whose memory it is.
    pub device: Device,
    /// How it may be exported: empty (not at all), `POSIX_FILE_DESCRIPTOR`, `FABRIC`, or both.
    pub handle_types: HandleTypes,
    /// Marks the allocation GPUDirect RDMA capable (needs [`VmmSupport::gpu_direct_rdma`]).
    pub gpu_direct_rdma: bool,
}

impl AllocationProps {
    /// Device memory of `device`, not exportable, not marked for RDMA.
    pub fn new(device: Device) -> AllocationProps {
        AllocationProps {
            device,
            handle_types: HandleTypes::empty(),
            gpu_direct_rdma: false,
        }
    }

    /// Sets the handle types it may be exported as.
    pub fn handle_types(mut self, handle_types: HandleTypes) -> AllocationProps {
        self.handle_types = handle_types;
        self
    }

    /// Sets the GPUDirect RDMA flag.
    pub fn gpu_direct_rdma(mut self, on: bool) -> AllocationProps {
        self.gpu_direct_rdma = on;
        self
    }

    pub(crate) fn to_raw(self) -> sys::CUmemAllocationProp {
        raw::vmm::device_props(self.device.as_raw(), self.handle_types.bits(), self.gpu_direct_rdma)
    }
}

/// Whether `value` is a non-zero multiple of `granularity`; the error names `what`.
pub(crate) fn check_granular(what: &'static str, value: usize, granularity: usize) -> Result<()> {
    if value == 0 || granularity == 0 || !value.is_multiple_of(granularity) {
        return Err(Error::NotGranular {
            what,
            value,
            granularity,
        });
    }
    Ok(())
}

/// `value` rounded up to a multiple of `granularity` (a non-zero value), or `None` on overflow.
pub fn round_up(value: usize, granularity: usize) -> Option<usize> {
    if granularity == 0 {
        return None;
    }
    value.div_ceil(granularity).checked_mul(granularity)
}

impl Device {
    /// What the device supports of virtual memory management.
    pub fn vmm_support(&self) -> Result<VmmSupport> {
        use sys::CUdevice_attribute::*;
        let attr = |a| -> Result<bool> { Ok(raw::device::attribute(self.as_raw(), a)? != 0) };
        Ok(VmmSupport {
            vmm: attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?,
            posix_fd: attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
            // An older driver does not know attribute 128 and answers CUDA_ERROR_INVALID_VALUE: no support.
            fabric: attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(false),
            gpu_direct_rdma: attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?,
        })
    }

    /// Whether the device supports virtual memory management at all.
    pub fn supports_vmm(&self) -> Result<bool> {
        Ok(self.vmm_support()?.vmm)
    }

    /// The granularity of physical allocations made with `props` on this device
    /// (`cuMemGetAllocationGranularity`). Refuses, naming the cause, properties the device cannot
    /// allocate (see [`PhysicalAllocation::new`]).
    pub fn vmm_granularity(&self, props: &AllocationProps, which: Granularity) -> Result<usize> {
        let props = AllocationProps {
            device: *self,
            ..*props
        };
        self.vmm_support()?.check(self.ordinal(), &props)?;
        Ok(raw::vmm::granularity(
            &props.to_raw(),
            which == Granularity::Recommended,
        )?)
    }
}

/// The 64 bytes of a fabric handle (`CUmemFabricHandle`): what an exporter on one node of a multi-node
/// NVLink system hands to an importer on another (see docs/vmm.md). Not a capability by itself: the
/// driver checks the importer's IMEX channel.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct FabricHandle(pub [u8; 64]);

/// Physical device memory made with `cuMemCreate` (or imported, or retained from a mapped address): no
/// address until it is mapped ([`crate::Mapping`]). Released (`cuMemRelease`) on drop; the memory itself
/// is freed once no mapping uses it either.
///
/// Share it between mappings with an `Arc`: each [`crate::Mapping`] holds one, so the handle is released
/// only after every mapping of it is unmapped.
#[derive(Debug)]
pub struct PhysicalAllocation {
    // Invariant: `handle` is a live allocation handle this value holds one reference to, of `size`
    // bytes (as created; as the importer or retainer was told, for the other two), with `props`.
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    props: AllocationProps,
    ctx: Arc<Context>,
}

impl PhysicalAllocation {
    /// `size` bytes of physical memory with `props` (`cuMemCreate`).
    ///
    /// Errors, before the driver is asked: [`Error::CapabilityMissing`] on a device without VMM (or
    /// without RDMA support when the flag is set), [`Error::VmmHandleTypeNotSupported`] for a handle type
    /// the device lacks (fabric on most machines), [`Error::NotGranular`] for a size that is not a
    /// non-zero multiple of the minimum granularity. Then [`Error::OutOfMemory`] with the size.
    pub fn new(props: &AllocationProps, size: usize) -> Result<PhysicalAllocation> {
        let g = props.device.vmm_granularity(props, Granularity::Minimum)?;
        check_granular("the physical allocation's size", size, g)?;
        let ctx = props.device.context()?;
        let _g = ctx.bind()?;
        let handle = raw::vmm::create(size, &props.to_raw())?;
        Ok(PhysicalAllocation {
            handle,
            size,
            props: *props,
            ctx: ctx.clone(),
        })
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device whose memory it is.
    pub fn device(&self) -> Device {
        self.props.device
    }

    /// Its properties (for an imported or retained allocation: as the driver reports them).
    pub fn props(&self) -> &AllocationProps {
        &self.props
    }

    /// The raw handle (`CUmemGenericAllocationHandle`), valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawAllocationHandle {
        self.handle
    }

    /// Exports it as a POSIX file descriptor (`cuMemExportToShareableHandle`), which another process
    /// imports with [`PhysicalAllocation::import_fd`] after receiving it over a Unix socket. The
    /// descriptor is the caller's to pass on or close.
    ///
    /// Refuses ([`Error::AllocationNotExportable`]) an allocation not created with
    /// `POSIX_FILE_DESCRIPTOR` among its handle types.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.require_handle_type(HandleTypes::POSIX_FILE_DESCRIPTOR)?;
        let _g = self.ctx.bind()?;
        let fd = raw::vmm::export_fd(self.handle)?;
        if fd < 0 {
            return Err(Error::InvalidArgument(format!(
                "cuMemExportToShareableHandle reported success but returned descriptor {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for the caller (the export's documented
        // contract: the application owns and closes it); nothing else holds it.
        #[allow(unsafe_code)]
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports it as a fabric handle. Refuses ([`Error::AllocationNotExportable`]) an allocation not
    /// created with `FABRIC` among its handle types, which only a device with fabric support allows.
    pub fn export_fabric(&self) -> Result<FabricHandle> {
        self.require_handle_type(HandleTypes::FABRIC)?;
        let _g = self.ctx.bind()?;
        Ok(FabricHandle(raw::vmm::export_fabric(self.handle)?))
    }

    /// Imports an allocation another process (or this one) exported as a file descriptor, of `size`
    /// bytes (which the exporter says; the driver does not). The descriptor stays the caller's: close it
    /// once imported. The device and handle types are the driver's (`cuMemGetAllocationPropertiesFromHandle`);
    /// an allocation not located on a device is refused ([`Error::InvalidArgument`] naming its location type).
    ///
    /// A `size` larger than the allocation makes mapping it fail ([`Error::Driver`] from `cuMemMap`).
    pub fn import_fd(fd: BorrowedFd<'_>, size: usize) -> Result<PhysicalAllocation> {
        raw::init()?;
        let handle = raw::vmm::import_fd(fd.as_raw_fd())?;
        // SAFETY: 1. the import just returned a live handle with one reference, handed over here.
        #[allow(unsafe_code)]
        unsafe {
            PhysicalAllocation::adopt(handle, size, "the imported allocation's size")
        }
    }

    /// Imports an allocation exported as a fabric handle, of `size` bytes.
    pub fn import_fabric(fabric: &FabricHandle, size: usize) -> Result<PhysicalAllocation> {
        raw::init()?;
        let handle = raw::vmm::import_fabric(&fabric.0)?;
        // SAFETY: 1. the import just returned a live handle with one reference, handed over here.
        #[allow(unsafe_code)]
        unsafe {
            PhysicalAllocation::adopt(handle, size, "the imported allocation's size")
        }
    }

    /// The physical allocation mapped at `addr` (`cuMemRetainAllocationHandle`): another reference to the
    /// same handle the mapping used, released on drop. Its size is that of the mapped range around
    /// `addr` (`cuMemGetAddressRange`). An address that is not mapped is an error; so is a handle whose
    /// memory is not device memory.
    ///
    /// The driver cannot say whether the handle stands for exactly the bytes of that range: a
    /// stream-ordered pool or `cuMemAlloc` allocation lives inside physical memory the driver may share
    /// between allocations, and mapping or exporting the returned value would reach all of it. Hence
    /// `unsafe`.
    ///
    /// # Safety
    /// 1. `addr` lies in a range mapped with `cuMemMap` (a [`crate::Mapping`], or another VMM user's
    ///    mapping) of one whole physical allocation, from the allocation's offset 0, and
    ///    `cuMemGetAddressRange` of `addr` reports exactly that mapped range; not memory of a
    ///    stream-ordered pool, `cuMemAlloc` or any other allocator whose backing memory may hold other
    ///    allocations.
    /// 2. The caller may share that whole allocation: whatever it does with the result (map it at
    ///    another address, export it) reaches every byte of it.
    #[allow(unsafe_code)]
    pub unsafe fn retain(ctx: &Arc<Context>, addr: DeviceAddr) -> Result<PhysicalAllocation> {
        let _g = ctx.bind()?;
        let handle = raw::vmm::retain(addr.0)?;
        // SAFETY: a context is bound; the driver only looks the address up.
        let range = unsafe { raw::memory::address_range(addr.0) };
        match range {
            // SAFETY: 1. the retain just returned a live handle with one reference, handed over here.
            Ok((_, size)) => unsafe { PhysicalAllocation::adopt(handle, size, "the retained allocation's size") },
            Err(e) => {
                // SAFETY: `handle` holds the reference `retain` just took; it is released once, here.
                let _ = unsafe { raw::vmm::release(handle) };
                Err(e.into())
            }
        }
    }

    /// Wraps a handle this value now holds one reference to, reading its properties from the driver;
    /// releases it again when anything fails.
    ///
    /// # Safety
    /// 1. `handle` is a live physical allocation handle, and the caller gives its one reference (from an
    ///    import or a retain) up to this function: the returned value releases it on drop, or this function
    ///    releases it on failure; nothing else releases it.
    #[allow(unsafe_code)]
    unsafe fn adopt(
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        what: &'static str,
    ) -> Result<PhysicalAllocation> {
        let built = (|| {
            let info = raw::vmm::properties(handle)?;
            let device = Device::get(device_ordinal_of(&info)?)?;
            let props = AllocationProps {
                device,
                handle_types: HandleTypes::from_bits_truncate(info.handle_types),
                gpu_direct_rdma: info.gpu_direct_rdma,
            };
            let g = raw::vmm::granularity(&props.to_raw(), false)?;
            check_granular(what, size, g)?;
            Ok::<_, Error>((props, device.context()?))
        })();
        match built {
            Ok((props, ctx)) => Ok(PhysicalAllocation {
                handle,
                size,
                props,
                ctx,
            }),
            Err(e) => {
                // SAFETY: this function holds the one reference the caller passed in (point 1); released once.
                let _ = unsafe { raw::vmm::release(handle) };
                Err(e)
            }
        }
    }

    fn require_handle_type(&self, t: HandleTypes) -> Result<()> {
        if self.props.handle_types.contains(t) {
            Ok(())
        } else {
            Err(Error::AllocationNotExportable {
                device: self.props.device.ordinal(),
                requested: t,
                created_with: self.props.handle_types,
            })
        }
    }
}

/// The device ordinal of an allocation's properties, refusing any location but a device
/// (`PhysicalAllocation` holds device memory only: a host or host-NUMA allocation has no device
/// context to bind, nor a device granularity).
fn device_ordinal_of(info: &raw::vmm::AllocationInfo) -> Result<usize> {
    const DEVICE: u32 = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
    if info.location_type != DEVICE {
        let name = match info.location_type {
            0 => "CU_MEM_LOCATION_TYPE_INVALID",
            2 => "CU_MEM_LOCATION_TYPE_HOST",
            3 => "CU_MEM_LOCATION_TYPE_HOST_NUMA",
            4 => "CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT",
            5 => "CU_MEM_LOCATION_TYPE_INVISIBLE",
            6 => "CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN",
            _ => "a location type this build does not know",
        };
        return Err(Error::InvalidArgument(format!(
            "the allocation behind the handle is located at {name} ({}, id {}), not on a device: a \
             PhysicalAllocation holds device memory only (CU_MEM_LOCATION_TYPE_DEVICE)",
            info.location_type, info.location_id
        )));
    }
    usize::try_from(info.location_id).map_err(|_| {
        Error::InvalidArgument(format!(
            "the driver reports device ordinal {} for the allocation behind the handle",
            info.location_id
        ))
    })
}

#[cfg(test)]
impl PhysicalAllocation {
    /// A value with a made-up handle in a context never retained, for host tests of code that only
    /// holds it. Dropping it tries a release (which fails without a driver): tests forget it instead.
    pub(crate) fn fake_for_tests(size: usize) -> PhysicalAllocation {
        PhysicalAllocation {
            handle: 0,
            size,
            props: AllocationProps::new(Device::from_parts(0, 0)),
            ctx: Context::unretained_for_tests(0),
        }
    }
}

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        // SAFETY: `self` holds one reference to `handle` (the type's invariant) and gives it up once. A
        // mapping still using the memory keeps it alive (every `Mapping` holds an `Arc` of this value, so
        // this runs only after they are unmapped, for allocations this crate maps).
        #[allow(unsafe_code)]
        let r = unsafe { raw::vmm::release(self.handle) };
        if let Err(e) = r {
            crate::drop_errors::record(e.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(t: HandleTypes) -> AllocationProps {
        AllocationProps::new(Device::from_parts(0, 0)).handle_types(t)
    }

    #[test]
    fn granularity_checks() {
        assert!(check_granular("x", 4 << 20, 2 << 20).is_ok());
        assert_eq!(
            check_granular("x", 3 << 20, 2 << 20),
            Err(Error::NotGranular {
                what: "x",
                value: 3 << 20,
                granularity: 2 << 20
            })
        );
        assert!(
            check_granular("x", 0, 2 << 20).is_err(),
            "zero bytes is not an allocation"
        );
        assert!(check_granular("x", 1, 0).is_err(), "a zero granularity never divides");
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(usize::MAX, 4096), None);
        assert_eq!(round_up(5, 0), None);
    }

    #[test]
    fn support_refuses_what_the_device_lacks() {
        let none = VmmSupport::default();
        let e = none.check(3, &props(HandleTypes::empty())).unwrap_err();
        assert!(
            e.to_string().contains("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0"),
            "{e}"
        );
        let fd_only = VmmSupport {
            vmm: true,
            posix_fd: true,
            ..VmmSupport::default()
        };
        assert_eq!(fd_only.handle_types(), HandleTypes::POSIX_FILE_DESCRIPTOR);
        assert!(fd_only.check(0, &props(HandleTypes::POSIX_FILE_DESCRIPTOR)).is_ok());
        assert_eq!(
            fd_only.check(0, &props(HandleTypes::FABRIC)),
            Err(Error::VmmHandleTypeNotSupported {
                device: 0,
                requested: HandleTypes::FABRIC,
                supported: HandleTypes::POSIX_FILE_DESCRIPTOR
            })
        );
        assert!(
            fd_only.check(0, &props(HandleTypes::WIN32)).is_err(),
            "Win32 handles are not offered on this platform"
        );
        let e = fd_only
            .check(0, &props(HandleTypes::empty()).gpu_direct_rdma(true))
            .unwrap_err();
        assert!(
            e.to_string().contains("GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0"),
            "{e}"
        );
        let all = VmmSupport {
            vmm: true,
            posix_fd: true,
            fabric: true,
            gpu_direct_rdma: true,
        };
        assert!(all
            .check(
                0,
                &props(HandleTypes::FABRIC | HandleTypes::POSIX_FILE_DESCRIPTOR).gpu_direct_rdma(true)
            )
            .is_ok());
    }

    #[test]
    fn props_reach_the_driver_struct() {
        let p = props(HandleTypes::POSIX_FILE_DESCRIPTOR).gpu_direct_rdma(true).to_raw();
        assert_eq!(p.requestedHandleTypes.0, 1);
        assert_eq!(p.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(p.allocFlags.gpuDirectRDMACapable, 1);
        assert_eq!(p.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
    }

    #[test]
    fn only_device_locations_are_adopted() {
        let mut p = raw::vmm::AllocationInfo {
            handle_types: 0,
            location_type: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32,
            location_id: 3,
            gpu_direct_rdma: false,
        };
        assert_eq!(device_ordinal_of(&p), Ok(3));
        p.location_type = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST as u32;
        let e = device_ordinal_of(&p).unwrap_err();
        assert!(
            e.to_string().contains("CU_MEM_LOCATION_TYPE_HOST") && e.to_string().contains("device memory only"),
            "{e}"
        );
        // A value no binding knows is reported, not read into an enum.
        p.location_type = 0x7fff_0000;
        let e = device_ordinal_of(&p).unwrap_err();
        assert!(
            e.to_string().contains("does not know") && e.to_string().contains("2147418112"),
            "{e}"
        );
        p.location_type = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
        p.location_id = -1;
        assert!(matches!(device_ordinal_of(&p), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn without_a_driver_nothing_is_created() {
        if crate::raw::library_present() {
            return; // the GPU tests cover a machine with a driver
        }
        assert_eq!(Device::get(0).unwrap_err(), Error::DriverNotFound);
        let e = Device::from_parts(0, 0).vmm_support().unwrap_err();
        assert_eq!(e, Error::DriverNotFound);
    }
}
