//! [`AsyncManagedResource`]: managed memory from a stream-ordered pool (CUDA 13.0).

use mempool_core::{AllocationType, Device, MemPool, PoolProps};

use crate::error::{Error, Result};
use crate::resources::async_resource::{over_async_resource, prepare_new_pool, AsyncResource, ReleaseThreshold};

/// Options for a pool of managed memory that [`AsyncManagedResource::new`] creates.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncManagedOptions {
    /// Bytes to reserve up front (allocated and freed once, with the release threshold raised to keep
    /// them if it is lower). `None`: no priming.
    pub initial_size: Option<usize>,
    /// The pool's release threshold; by default [`ReleaseThreshold::KeepAll`], as for
    /// [`AsyncOptions`](crate::AsyncOptions) (CCCL's `managed_memory_pool` defaults to the maximum too).
    pub release_threshold: ReleaseThreshold,
}

over_async_resource! {
/// Allocates managed (unified) memory in stream order from a pool of managed memory
/// (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool of `CU_MEM_ALLOCATION_TYPE_MANAGED`, CUDA
/// 13.0), RMM's `cuda_async_managed_memory_resource`. The memory is usable by the host and by every
/// device with concurrent managed access, and migrates on demand; its preferred location is the device
/// the pool was made for. Beside [`ManagedResource`](crate::ManagedResource) (a `cuMemAllocManaged` per
/// allocation, and a free that waits for its stream), this one allocates and frees in stream order and
/// reuses freed memory without going back to the driver.
///
/// Two ways to get one:
/// - [`AsyncManagedResource::default_pool`] is RMM's resource exactly: it allocates from the device's
///   default pool of managed memory (`cuMemGetDefaultMemPool` with the device's location), a process-wide
///   pool whose attributes it leaves alone, as RMM does ("pool properties such as the release threshold
///   are not modified").
/// - [`AsyncManagedResource::new`] creates a pool of its own (`cuMemPoolCreate`), destroyed with the
///   resource, which keeps what it reserves unless [`AsyncManagedOptions::release_threshold`] says
///   otherwise.
///
/// Both need a driver for CUDA 13.0 or newer and a device with concurrent managed access
/// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`), what RMM checks; elsewhere they fail up front with
/// [`Error::Unsupported`] naming what is missing.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{AsyncManagedResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = AsyncManagedResource::default_pool(&dev)?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(1 << 20, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
AsyncManagedResource
}

/// The resource's form of a capability the core layer found missing (managed pools, or pools at all):
/// [`Error::Unsupported`] with the core's sentence, which names the device attribute or the driver
/// version.
fn unsupported(e: mempool_core::Error) -> Error {
    match e {
        e @ (mempool_core::Error::CapabilityMissing { .. } | mempool_core::Error::PoolsNotSupported { .. }) => {
            Error::Unsupported {
                resource: "AsyncManagedResource",
                reason: e.to_string(),
            }
        }
        other => other.into(),
    }
}

impl AsyncManagedResource {
    /// Creates a pool of managed memory whose preferred location is `device`, and allocates from it.
    pub fn new(device: &Device, options: AsyncManagedOptions) -> Result<AsyncManagedResource> {
        let props = PoolProps::new().allocation_type(AllocationType::Managed);
        let pool = MemPool::new(device, &props).map_err(unsupported)?;
        prepare_new_pool(device, &pool, options.release_threshold, options.initial_size)?;
        Ok(AsyncManagedResource {
            inner: AsyncResource::from_pool(pool)?,
        })
    }

    /// Allocates from `device`'s default pool of managed memory, as RMM's
    /// `cuda_async_managed_memory_resource` does, leaving its attributes as they are.
    pub fn default_pool(device: &Device) -> Result<AsyncManagedResource> {
        let pool = device.default_managed_pool().map_err(unsupported)?;
        Ok(AsyncManagedResource {
            inner: AsyncResource::from_pool(pool)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_capability_is_unsupported_with_the_core_sentence() {
        let e = unsupported(mempool_core::Error::CapabilityMissing {
            device: 0,
            operation: "allocate from a pool of managed memory",
            missing: "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0".into(),
        });
        assert_eq!(
            e,
            Error::Unsupported {
                resource: "AsyncManagedResource",
                reason: "device 0 cannot allocate from a pool of managed memory: \
                         CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0"
                    .into()
            }
        );
        // Other failures keep their own variant.
        assert!(matches!(
            unsupported(mempool_core::Error::NoDevice),
            Error::Core(mempool_core::Error::NoDevice)
        ));
        assert_eq!(
            AsyncManagedOptions::default().release_threshold,
            ReleaseThreshold::KeepAll
        );
    }
}
