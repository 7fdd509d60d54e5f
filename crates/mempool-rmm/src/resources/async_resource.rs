//! [`AsyncResource`]: allocation from a driver pool with `cuMemAllocFromPoolAsync`.

use mempool_core::{Device, DeviceAddr, HandleTypes, MemPool, PoolProps, StreamRef};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;

/// Options for a pool that [`AsyncResource::new`] creates.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncOptions {
    /// Bytes to reserve up front (allocated and freed once, with the release threshold raised to keep
    /// them), so the first allocations do not pay for growth. `None`: no priming.
    pub initial_size: Option<usize>,
    /// The pool's release threshold; `None` leaves the driver's default (0: give everything back at each
    /// synchronize). `Some(u64::MAX)` keeps everything, the advice for a process that owns its GPU.
    pub release_threshold: Option<u64>,
    /// Export handle types; `POSIX_FILE_DESCRIPTOR` makes the pool shareable with other processes.
    pub handle_types: HandleTypes,
    /// The pool's maximum size in bytes, if any.
    pub max_size: Option<usize>,
}

/// Allocates from a CUDA stream-ordered pool (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`), RMM's
/// `cuda_async_memory_resource`. It either owns a pool it created or views an existing one (the
/// device's default pool, or a pool the application made).
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{AsyncOptions, AsyncResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = AsyncResource::new(&dev, AsyncOptions { release_threshold: Some(u64::MAX), ..Default::default() })?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(1 << 20, stream.as_ref())?;
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AsyncResource {
    pool: MemPool,
}

impl AsyncResource {
    /// Creates a pool on `device` with `options` and allocates from it.
    pub fn new(device: &Device, options: AsyncOptions) -> Result<AsyncResource> {
        let mut props = PoolProps::new().handle_types(options.handle_types);
        props.max_size = options.max_size;
        let pool = MemPool::new(device, &props)?;
        if let Some(t) = options.release_threshold {
            pool.set_release_threshold(t)?;
        }
        if let Some(initial) = options.initial_size.filter(|&n| n > 0) {
            // Priming: the threshold must keep the primed bytes, or the next synchronize returns them.
            let threshold = pool.release_threshold()?;
            if threshold < initial as u64 {
                pool.set_release_threshold(initial as u64)?;
            }
            let stream = mempool_core::Stream::new(&device.context()?)?;
            let buf = pool.alloc(initial, stream.as_ref())?;
            drop(buf);
            stream.synchronize()?;
        }
        Ok(AsyncResource { pool })
    }

    /// Allocates from `pool`, which the resource takes over (for a borrowed pool, such as
    /// [`Device::default_pool`], it only views it).
    pub fn from_pool(pool: MemPool) -> Result<AsyncResource> {
        if pool.kind() == mempool_core::PoolKind::Imported {
            return Err(Error::Unsupported {
                resource: "AsyncResource",
                reason: "an imported pool cannot allocate".into(),
            });
        }
        Ok(AsyncResource { pool })
    }

    /// Allocates from `device`'s default pool.
    pub fn default_pool(device: &Device) -> Result<AsyncResource> {
        AsyncResource::from_pool(device.default_pool()?)
    }

    /// The pool, for its attributes, counters, trimming and peer access.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }
}

impl MemoryResource for AsyncResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        Ok(self.pool.allocate(bytes, stream)?)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        let _ = bytes;
        // SAFETY: by the caller's obligations 1-3, `ptr` came from `allocate` on this resource (hence from a
        // stream-ordered allocation of the pool, in its context), is returned once, and all its uses are
        // ordered before this point of `stream`: `free_async`'s contract.
        unsafe { self.pool.free_async(ptr, stream) }?;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "AsyncResource"
    }
}
