//! Devices: enumeration, properties, pool support and peer capability.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>

use std::fmt;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::pool::{HandleTypes, MemPool};
use crate::raw::{self, sys};

/// A CUDA device, by ordinal. Cheap to copy; it holds no driver resources.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::Device;
/// for dev in Device::all()? {
///     println!("{}: {} ({} MiB), pools: {}", dev.ordinal(), dev.name()?,
///              dev.total_memory()? >> 20, dev.supports_memory_pools()?);
/// }
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
}

/// A device's 16-byte UUID, as `cuDeviceGetUuid` reports it. Displays as `nvidia-smi -L` does
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uuid(pub [u8; 16]);

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, byte) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl Device {
    /// Initialises the driver (once) and returns the number of visible devices.
    ///
    /// Errors: [`Error::DriverNotFound`] without a driver; [`Error::NoDevice`] when the driver sees none.
    pub fn count() -> Result<usize> {
        raw::init()?;
        raw::device::count()
    }

    /// The device with this ordinal. See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>.
    pub fn get(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        Ok(Device {
            ordinal,
            raw: raw::device::get(ordinal)?,
        })
    }

    /// Every visible device, in ordinal order.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn as_raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> Result<String> {
        raw::device::name(self.raw)
    }

    /// The device's UUID: the identity two processes compare to know they share a GPU.
    pub fn uuid(&self) -> Result<Uuid> {
        raw::device::uuid(self.raw).map(Uuid)
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        raw::device::total_memory(self.raw)
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

    /// Whether this device can map memory that lives on `owner` (`cuDeviceCanAccessPeer`). A device can
    /// always access its own memory.
    pub fn can_access_peer(&self, owner: Device) -> Result<bool> {
        if owner == *self {
            return Ok(true);
        }
        raw::device::can_access_peer(self.raw, owner.raw)
    }

    /// The device's primary context, retained while the `Arc` (or anything made in it) lives.
    pub fn context(&self) -> Result<Arc<Context>> {
        Context::primary(*self)
    }

    /// The device's default pool (what `cuMemAllocAsync` uses unless the current pool was changed).
    /// It cannot be exported; dropping the returned value does not destroy it.
    pub fn default_pool(&self) -> Result<MemPool> {
        self.require_pools()?;
        MemPool::default_of(self.context()?)
    }

    /// The device's current pool (`cuDeviceGetMemPool`), a process-wide setting. Dropping the returned
    /// value does not destroy it. To change it, use [`MemPool::make_current`], which restores it.
    pub fn current_pool(&self) -> Result<MemPool> {
        self.require_pools()?;
        MemPool::current_of(self.context()?)
    }

    pub(crate) fn require_pools(&self) -> Result<()> {
        if self.supports_memory_pools()? {
            Ok(())
        } else {
            Err(Error::PoolsNotSupported { device: self.ordinal })
        }
    }

    fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        raw::device::attribute(self.raw, attr)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.ordinal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_displays_like_nvidia_smi() {
        let u = Uuid([0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(u.to_string(), "GPU-12345678-9abc-def0-0102-030405060708");
    }
}
