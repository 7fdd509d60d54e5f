//! [`HostPoolResource`]: a stream-ordered pool whose memory lives in host RAM.

use mempool_core::{Device, MemPool, PoolLocation, PoolProps};

use crate::error::{Error, Result};
use crate::resources::async_resource::{over_async_resource, AsyncResource, ReleaseThreshold};

/// Options for [`HostPoolResource::new`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPoolOptions {
    /// Take the memory from this host NUMA node (`CU_MEM_LOCATION_TYPE_HOST_NUMA`, CUDA 12.6 and newer)
    /// rather than from anywhere in host RAM (`CU_MEM_LOCATION_TYPE_HOST`, CUDA 13.0 and newer).
    pub numa_node: Option<i32>,
    /// The pool's release threshold; by default [`ReleaseThreshold::KeepAll`], as for
    /// [`AsyncOptions`](crate::AsyncOptions) (and CCCL's `pinned_memory_pool`, whose default threshold is
    /// the maximum too). [`ReleaseThreshold::DriverDefault`] keeps the driver's 0.
    pub release_threshold: ReleaseThreshold,
    /// The pool's maximum size in bytes, if any.
    pub max_size: Option<usize>,
}

over_async_resource! {
/// Allocates page-locked host memory from a stream-ordered pool (`cuMemPoolCreate` with a host
/// location, then `cuMemAllocFromPoolAsync` / `cuMemFreeAsync`): staging buffers and spill space that
/// get the driver pool's stream-ordered reuse, where [`PinnedHostResource`](crate::PinnedHostResource)
/// pays a `cuMemHostAlloc` per allocation. The device the resource is created for is granted read-write
/// access to the pool (`cuMemPoolSetAccess`), so its kernels and copies use the memory directly; the
/// host reads and writes it through the returned address once the stream's work is done.
///
/// Host pools need a driver for CUDA 13.0 or newer (12.6 for a NUMA node) and a system that supports
/// them; elsewhere [`new`](Self::new) fails with [`Error::Unsupported`] saying so.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{HostPoolOptions, HostPoolResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = HostPoolResource::new(&dev, HostPoolOptions::default())?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(1 << 20, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
HostPoolResource
}

impl HostPoolResource {
    /// Creates a host-located pool usable by `device` and allocates from it.
    pub fn new(device: &Device, options: HostPoolOptions) -> Result<HostPoolResource> {
        let (location, needs) = match options.numa_node {
            None => (PoolLocation::Host, (13, 0)),
            Some(node) => (PoolLocation::HostNuma(node), (12, 6)),
        };
        let driver = mempool_core::driver_version()?;
        let unsupported = |why: String| Error::Unsupported {
            resource: "HostPoolResource",
            reason: why,
        };
        if (driver.major(), driver.minor()) < needs {
            return Err(unsupported(format!(
                "a {location:?} pool needs a driver for CUDA {}.{} or newer; this one is for CUDA {}.{}",
                needs.0,
                needs.1,
                driver.major(),
                driver.minor()
            )));
        }
        let mut props = PoolProps::new().location(location);
        props.max_size = options.max_size;
        let pool = match MemPool::new(device, &props) {
            Ok(pool) => pool,
            Err(e @ mempool_core::Error::Driver { .. }) => {
                return Err(unsupported(format!(
                    "the driver (CUDA {}.{}) refused a {location:?} pool for device {}: {e}",
                    driver.major(),
                    driver.minor(),
                    device.ordinal()
                )))
            }
            Err(e) => return Err(e.into()),
        };
        pool.grant_access(device)?;
        options.release_threshold.apply(&pool)?;
        Ok(HostPoolResource {
            inner: AsyncResource::from_pool(pool)?,
        })
    }
}
