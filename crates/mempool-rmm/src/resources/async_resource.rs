//! [`AsyncResource`]: allocation from a driver pool with `cuMemAllocFromPoolAsync`.

use mempool_core::{Device, DeviceAddr, HandleTypes, MemPool, PoolProps, StreamRef};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;

/// What a pool's release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`) is set to when a resource creates
/// the pool: how much unused memory the pool keeps reserved across synchronizations.
///
/// The default is [`ReleaseThreshold::KeepAll`], RMM's: `cuda_async_memory_resource` sets the threshold to
/// `UINT64_MAX` unless its `release_threshold` argument says otherwise. The driver's own default, 0, gives
/// every unused byte back at each synchronize and maps it again at the next allocation; it is
/// [`ReleaseThreshold::DriverDefault`] (or `Bytes(0)`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReleaseThreshold {
    /// Keep everything the pool reserves (`u64::MAX`): the advice for a process that owns its GPU, and
    /// RMM's default.
    #[default]
    KeepAll,
    /// Keep up to this many unused bytes; give the rest back at the next synchronize.
    Bytes(u64),
    /// Leave the attribute as the driver set it: 0 on a new pool, so every synchronize gives all unused
    /// memory back.
    DriverDefault,
}

impl ReleaseThreshold {
    /// The attribute's value this setting writes, or `None` for [`ReleaseThreshold::DriverDefault`],
    /// which writes nothing.
    pub fn bytes(self) -> Option<u64> {
        match self {
            ReleaseThreshold::KeepAll => Some(u64::MAX),
            ReleaseThreshold::Bytes(n) => Some(n),
            ReleaseThreshold::DriverDefault => None,
        }
    }

    /// Applies the setting to a pool the resource just created.
    pub(crate) fn apply(self, pool: &MemPool) -> Result<()> {
        if let Some(t) = self.bytes() {
            pool.set_release_threshold(t)?;
        }
        Ok(())
    }
}

/// Options for a pool that [`AsyncResource::new`] creates.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncOptions {
    /// Bytes to reserve up front (allocated and freed once, with the release threshold raised to keep
    /// them if it is lower), so the first allocations do not pay for growth. `None`: no priming.
    pub initial_size: Option<usize>,
    /// The pool's release threshold; by default [`ReleaseThreshold::KeepAll`], as RMM's
    /// `cuda_async_memory_resource`. [`ReleaseThreshold::DriverDefault`] keeps the driver's 0.
    pub release_threshold: ReleaseThreshold,
    /// Export handle types; `POSIX_FILE_DESCRIPTOR` makes the pool shareable with other processes.
    pub handle_types: HandleTypes,
    /// The pool's maximum size in bytes, if any.
    pub max_size: Option<usize>,
}

/// Allocates from a CUDA stream-ordered pool (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`), RMM's
/// `cuda_async_memory_resource`. It either owns a pool it created or views an existing one (the
/// device's default pool, or a pool the application made).
///
/// A pool it creates keeps what it reserves ([`ReleaseThreshold::KeepAll`]) unless
/// [`AsyncOptions::release_threshold`] says otherwise, as RMM's resource does. A pool it only views keeps
/// its attributes: [`AsyncResource::default_pool`] and [`AsyncResource::from_pool`] change nothing, as
/// RMM's `cuda_async_view_memory_resource` changes nothing (the device's default pool is process-wide,
/// and its threshold is the driver's 0 unless the application set it).
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{AsyncOptions, AsyncResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = AsyncResource::new(&dev, AsyncOptions::default())?; // keeps what it reserves, as RMM's
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
        prepare_new_pool(device, &pool, options.release_threshold, options.initial_size)?;
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

    /// Allocates from `device`'s default pool, leaving its attributes (the release threshold among them)
    /// as they are: the default pool is process-wide, and RMM's view resource does not change it either.
    /// Call [`MemPool::keep_everything`] on [`AsyncResource::pool`] to keep its memory.
    pub fn default_pool(device: &Device) -> Result<AsyncResource> {
        AsyncResource::from_pool(device.default_pool()?)
    }

    /// The pool, for its attributes, counters, trimming and peer access.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }
}

/// Sets up a pool a resource just created: its release threshold, then the priming allocation of
/// `initial` bytes (allocated and freed on a stream of its own, synchronized), with the threshold raised
/// to keep them if it is lower.
pub(crate) fn prepare_new_pool(
    device: &Device,
    pool: &MemPool,
    threshold: ReleaseThreshold,
    initial: Option<usize>,
) -> Result<()> {
    threshold.apply(pool)?;
    if let Some(initial) = initial.filter(|&n| n > 0) {
        // Priming: the threshold must keep the primed bytes, or the next synchronize returns them.
        if pool.release_threshold()? < initial as u64 {
            pool.set_release_threshold(initial as u64)?;
        }
        let stream = mempool_core::Stream::new(&device.context()?)?;
        let buf = pool.alloc(initial, stream.as_ref())?;
        drop(buf);
        stream.synchronize()?;
    }
    Ok(())
}

/// A resource that is an [`AsyncResource`] over a pool of another kind (managed memory, host memory): the
/// struct with the given documentation, holding the `AsyncResource` in `inner`, its `pool()` accessor, and
/// the [`MemoryResource`] impl that forwards to it under its own `name` (so an out-of-memory report names
/// the outer resource and its upstream). Each such resource writes only its constructors.
macro_rules! over_async_resource {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug)]
        pub struct $name {
            inner: $crate::resources::async_resource::AsyncResource,
        }

        impl $name {
            /// The pool, for its attributes, counters and trimming.
            pub fn pool(&self) -> &mempool_core::MemPool {
                self.inner.pool()
            }
        }

        // SAFETY: each allocation is a fresh stream-ordered allocation from the pool `self` holds (memory the driver reaches: device, managed or pinned host memory; aligned to 256, null only for 0 bytes), which nothing else owns until `deallocate` frees it.
        #[allow(unsafe_code)]
        unsafe impl $crate::resource::MemoryResource for $name {
            fn allocate(
                &self,
                bytes: usize,
                stream: mempool_core::StreamRef<'_>,
            ) -> $crate::error::Result<mempool_core::DeviceAddr> {
                self.inner
                    .allocate(bytes, stream)
                    .map_err(|e| $crate::observe::oom::explain(e, self))
            }

            #[allow(unsafe_code)]
            unsafe fn deallocate(
                &self,
                ptr: mempool_core::DeviceAddr,
                bytes: usize,
                stream: mempool_core::StreamRef<'_>,
            ) -> $crate::error::Result<()> {
                // SAFETY: the resource is its inner `AsyncResource` (its `allocate` forwards unchanged), so
                // the caller's obligations 1-3 for it are the same obligations for the inner resource.
                unsafe { self.inner.deallocate(ptr, bytes, stream) }
            }

            fn name(&self) -> &'static str {
                stringify!($name)
            }

            fn upstream_resource(&self) -> Option<&dyn $crate::resource::MemoryResource> {
                Some(&self.inner)
            }
        }
    };
}

pub(crate) use over_async_resource;

// SAFETY: each allocation is a fresh stream-ordered allocation from the pool `self` holds (aligned to 256, null only for 0 bytes), which nothing else owns until `deallocate` frees it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for AsyncResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.pool
            .allocate(bytes, stream)
            .map_err(|e| crate::observe::oom::explain(e.into(), self))
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

    /// The pool's counters (reserved and used, with their peaks) and the device's free memory.
    fn inspect(&self) -> crate::observe::inspect::Inspection {
        let mut i = crate::observe::inspect::Inspection::default();
        if let Ok(u) = self.pool.usage() {
            i.held_bytes = Some(u.reserved_current);
            i.peak_held_bytes = Some(u.reserved_high);
            i.live_bytes = Some(u.used_current);
            i.peak_live_bytes = Some(u.used_high);
        }
        i.device_free = self.pool.context().memory_info().ok().map(|m| m.free as u64);
        i
    }

    /// Releases the pool's unused reserve (`cuMemPoolTrimTo(0)`).
    fn trim_unused(&self, _stream: StreamRef<'_>) -> Result<()> {
        Ok(self.pool.trim_to(0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_pools_keep_everything_by_default_as_rmm_does() {
        assert_eq!(AsyncOptions::default().release_threshold, ReleaseThreshold::KeepAll);
        assert_eq!(ReleaseThreshold::default().bytes(), Some(u64::MAX));
        assert_eq!(ReleaseThreshold::Bytes(0).bytes(), Some(0));
        assert_eq!(ReleaseThreshold::Bytes(1 << 30).bytes(), Some(1 << 30));
        assert_eq!(
            ReleaseThreshold::DriverDefault.bytes(),
            None,
            "the driver's value is left alone"
        );
    }
}
