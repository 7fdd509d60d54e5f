//! Devices: enumeration, properties, pool support and peer capability. The [`Device`] value itself is
//! plain data (in `types`); its pool accessors are implemented next to `MemPool`: `default_pool` in `pool`,
//! `current_pool` in `current`.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>

use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::raw::{self, sys};
use crate::types::{Device, DriverVersion, HandleTypes, Uuid};

impl Device {
    /// Initialises the driver (once) and returns the number of visible devices.
    ///
    /// Errors: [`Error::DriverNotFound`] without a driver; [`Error::NoDevice`] when the driver sees none.
    pub fn count() -> Result<usize> {
        raw::init()?;
        Ok(raw::device::count()?)
    }

    /// The device with this ordinal. See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>.
    pub fn get(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        Ok(Device::from_parts(ordinal, raw::device::get(ordinal)?))
    }

    /// Every visible device, in ordinal order.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// The driver's handle of the device of the calling thread's current CUDA context (`cuCtxGetCurrent`,
    /// `cuCtxGetDevice`), `None` when no context is current: what [`Device::of_current_context`] looks up,
    /// for a caller that keeps its own list of devices (two driver calls, no enumeration).
    pub fn raw_of_current_context() -> Result<Option<crate::types::RawDevice>> {
        raw::init()?;
        if raw::context::current()?.is_null() {
            return Ok(None);
        }
        Ok(Some(raw::context::device()?))
    }

    /// The device of the calling thread's current CUDA context (`cuCtxGetCurrent`, `cuCtxGetDevice`):
    /// what the CUDA runtime's `cudaGetDevice` reports on a thread that has used a device. `None` when
    /// no context is current on the thread. mempool's own calls bind their context only for their
    /// duration, so this is the context the application (or another library) made current.
    pub fn of_current_context() -> Result<Option<Device>> {
        let Some(raw) = Device::raw_of_current_context()? else {
            return Ok(None);
        };
        let count = Device::count()?;
        for ordinal in 0..count {
            let device = Device::get(ordinal)?;
            if device.as_raw() == raw {
                return Ok(Some(device));
            }
        }
        Err(Error::NoSuchDevice {
            ordinal: raw.max(0) as usize,
            count,
        })
    }

    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> Result<String> {
        Ok(raw::device::name(self.as_raw())?)
    }

    /// The device's UUID: the identity two processes compare to know they share a GPU.
    pub fn uuid(&self) -> Result<Uuid> {
        Ok(Uuid(raw::device::uuid(self.as_raw())?))
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        Ok(raw::device::total_memory(self.as_raw())?)
    }

    /// Compute capability as (major, minor), e.g. (9, 0) for Hopper.
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        use sys::CUdevice_attribute::*;
        let major = self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok((major as u32, minor as u32))
    }

    /// Whether the device supports stream-ordered memory pools (`cuMemAllocAsync` and `cuMemPool*`).
    pub fn supports_memory_pools(&self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// The handle types pools on this device can be exported as (empty: no IPC support).
    pub fn supported_pool_handle_types(&self) -> Result<HandleTypes> {
        let bits = self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
        Ok(HandleTypes::from_bits_truncate(bits as u32))
    }

    /// Whether the device can access managed memory concurrently with the host
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`): what pools of managed memory need, and what
    /// prefetching managed memory needs to have an effect.
    pub fn concurrent_managed_access(&self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)? != 0)
    }

    /// Whether the device can access pageable host memory, memory from plain `malloc` or `mmap`, without
    /// registering it (`CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`): heterogeneous memory management (HMM,
    /// the open kernel module on a recent Linux kernel) or address translation services (ATS, as on Grace
    /// Hopper).
    pub fn pageable_memory_access(&self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)? != 0)
    }

    /// Whether the device can allocate from pools of managed memory: a driver for CUDA 13.0 or newer and
    /// concurrent managed access ([`Device::concurrent_managed_access`]), RMM's test for
    /// `cuda_async_managed_memory_resource`.
    pub fn supports_managed_pools(&self) -> Result<bool> {
        match self.require_managed_pools() {
            Ok(()) => Ok(true),
            Err(Error::CapabilityMissing { .. } | Error::PoolsNotSupported { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether this device can map memory that lives on `owner` (`cuDeviceCanAccessPeer`). A device can
    /// always access its own memory.
    pub fn can_access_peer(&self, owner: Device) -> Result<bool> {
        if owner == *self {
            return Ok(true);
        }
        Ok(raw::device::can_access_peer(self.as_raw(), owner.as_raw())?)
    }

    /// The device's primary context, retained while the `Arc` (or anything made in it) lives.
    pub fn context(&self) -> Result<Arc<Context>> {
        Context::primary(*self)
    }

    pub(crate) fn require_pools(&self) -> Result<()> {
        if self.supports_memory_pools()? {
            Ok(())
        } else {
            Err(Error::PoolsNotSupported { device: self.ordinal() })
        }
    }

    /// Refuses, with the capability that is missing, on a device or driver that cannot allocate from pools
    /// of managed memory (see [`Device::supports_managed_pools`]).
    pub(crate) fn require_managed_pools(&self) -> Result<()> {
        const OPERATION: &str = "allocate from a pool of managed memory";
        self.require_pools()?;
        let driver = raw::init()?;
        if driver < DriverVersion(13000) {
            return Err(Error::CapabilityMissing {
                device: self.ordinal(),
                operation: OPERATION,
                missing: format!(
                    "pools of managed memory (CU_MEM_ALLOCATION_TYPE_MANAGED) need a driver for CUDA 13.0 or \
                     newer; this one is for CUDA {driver}"
                ),
            });
        }
        if !self.concurrent_managed_access()? {
            return Err(Error::CapabilityMissing {
                device: self.ordinal(),
                operation: OPERATION,
                missing: "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0: the device cannot access managed \
                          memory concurrently with the host"
                    .into(),
            });
        }
        Ok(())
    }

    fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        Ok(raw::device::attribute(self.as_raw(), attr)?)
    }
}
