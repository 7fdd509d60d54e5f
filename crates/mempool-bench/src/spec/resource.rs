//! Building checked specs into resources on a device.

use std::sync::Arc;

use mempool_core::{Device, DeviceAddr, MemPool, StreamRef};
use mempool_rmm::observe::{History, HistoryResource};
use mempool_rmm::suballoc::{ArenaOptions, BinningOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::testing::SimResource;
use mempool_rmm::{
    ArenaResource, AsyncManagedOptions, AsyncManagedResource, AsyncOptions, AsyncResource, BinningResource,
    CudaResource, ExpandableOptions, ExpandableResource, FixedSizeResource, ManagedResource, MemoryResource,
    PeerAccess, PoolResource, Reclaim, ReleaseThreshold, SamHeadroomResource, ServiceOptions, ServiceResource,
    SharedResource, SystemResource, VmmOptions, VmmResource,
};

use crate::baseline::{RawCudaResource, RawPoolResource};
use crate::error::{Error, Result};
use crate::spec::lang::ResourceSpec;

/// A spec built into a resource, with the label reports use (the canonical spec).
#[derive(Clone, Debug)]
pub struct Built {
    /// The canonical spec.
    pub label: String,
    /// The resource.
    pub resource: SharedResource,
}

/// Builds `spec` on `device` (`None`: no GPU, only `sim` can be built).
pub fn build(spec: &ResourceSpec, device: Option<&Device>) -> Result<Built> {
    let resource = build_resource(spec, device)?;
    Ok(Built {
        label: spec.to_string(),
        resource,
    })
}

fn build_resource(spec: &ResourceSpec, device: Option<&Device>) -> Result<SharedResource> {
    if let ResourceSpec::Sim = spec {
        // SAFETY: `sim` is a host-only spec (`ResourceSpec::is_host_only`): the workloads that touch memory
        // (query, multi-stream, and main.rs's checks before any GPU workload) refuse host-only specs, so its
        // addresses are only allocated, freed and counted by the allocation replays.
        #[allow(unsafe_code)]
        return Ok(Arc::new(unsafe { SimResource::new() }));
    }
    if let ResourceSpec::History { upstream, capacity } = spec {
        let up = build_resource(upstream, device)?;
        let history = Arc::new(History::new(usize::try_from(*capacity).unwrap_or(usize::MAX)));
        return Ok(Arc::new(HistoryResource::with_history(up, history)));
    }
    let dev = device.ok_or_else(|| Error::Usage(format!("`{spec}` needs a GPU; only `sim` runs without one")))?;
    let r: SharedResource = match spec {
        ResourceSpec::Sim | ResourceSpec::History { .. } => unreachable!("handled above"),
        ResourceSpec::Cuda => Arc::new(CudaResource::new(dev)?),
        ResourceSpec::Managed => Arc::new(ManagedResource::new(dev)?),
        ResourceSpec::RawCuda => Arc::new(RawCudaResource::new(dev)?),
        ResourceSpec::RawPool => Arc::new(RawPoolResource::new(dev)?),
        ResourceSpec::Async(a) => {
            if a.default_pool {
                let r = AsyncResource::default_pool(dev)?;
                match a.threshold {
                    Some(t) => Arc::new(ThresholdRestored::set(r, AsyncResource::pool, t)?),
                    None => Arc::new(r),
                }
            } else {
                Arc::new(AsyncResource::new(
                    dev,
                    AsyncOptions {
                        initial_size: a.initial.map(|v| v as usize),
                        release_threshold: threshold(a.threshold),
                        max_size: a.max_size.map(|v| v as usize),
                        ..Default::default()
                    },
                )?)
            }
        }
        ResourceSpec::AsyncManaged(a) => {
            if a.default_pool {
                let r = AsyncManagedResource::default_pool(dev)?;
                match a.threshold {
                    Some(t) => Arc::new(ThresholdRestored::set(r, AsyncManagedResource::pool, t)?),
                    None => Arc::new(r),
                }
            } else {
                Arc::new(AsyncManagedResource::new(
                    dev,
                    AsyncManagedOptions {
                        initial_size: a.initial.map(|v| v as usize),
                        release_threshold: threshold(a.threshold),
                    },
                )?)
            }
        }
        ResourceSpec::System => Arc::new(SystemResource::new(dev)?),
        ResourceSpec::Vmm { owner_only } => Arc::new(VmmResource::new(
            dev,
            VmmOptions {
                peers: if *owner_only {
                    PeerAccess::None
                } else {
                    PeerAccess::AllCapable
                },
                // POSIX descriptors where the device offers them, unexportable memory where it does not.
                handle_types: VmmOptions::default().handle_types & dev.vmm_support()?.handle_types(),
                ..VmmOptions::default()
            },
        )?),
        ResourceSpec::Expandable {
            chunk,
            reserve,
            reclaim_before_growth,
        } => Arc::new(ExpandableResource::new(
            dev,
            ExpandableOptions {
                chunk_size: chunk.map(|c| c as usize),
                reservation: reserve.map(|r| r as usize),
                reclaim: if *reclaim_before_growth {
                    Reclaim::BeforeGrowth
                } else {
                    Reclaim::OnOutOfMemory
                },
            },
        )?),
        ResourceSpec::Service {
            chunk,
            region,
            tags,
            reclaim,
        } => {
            let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
            // `new` returns an `Arc`; its `MemoryResource` impl allocates under the default tag.
            ServiceResource::new(
                dev,
                ServiceOptions {
                    chunk_size: chunk.map(size),
                    region_size: region.map(size),
                    max_tags: size(*tags),
                    reclaim: *reclaim,
                    ..ServiceOptions::default()
                },
            )?
        }
        ResourceSpec::SamHeadroom { headroom } => Arc::new(SamHeadroomResource::new(
            dev,
            usize::try_from(*headroom).unwrap_or(usize::MAX),
        )?),
        ResourceSpec::Pool { upstream, initial, max } => {
            let up = build_resource(upstream, device)?;
            let options = PoolOptions {
                initial_size: *initial,
                maximum_size: *max,
                ..Default::default()
            };
            Arc::new(PoolResource::new(up, dev, options)?)
        }
        ResourceSpec::Binning {
            upstream,
            min,
            max,
            blocks,
        } => {
            let up = build_resource(upstream, device)?;
            let options = BinningOptions {
                min_size_exponent: min.trailing_zeros(),
                max_size_exponent: max.trailing_zeros(),
                blocks_per_chunk: *blocks,
                ..Default::default()
            };
            Arc::new(BinningResource::new(up, dev, options)?)
        }
        ResourceSpec::Arena {
            upstream,
            superblock,
            initial,
            max,
        } => {
            let up = build_resource(upstream, device)?;
            let options = ArenaOptions {
                superblock_size: *superblock,
                initial_size: *initial,
                maximum_size: *max,
                ..Default::default()
            };
            Arc::new(ArenaResource::new(up, dev, options)?)
        }
        ResourceSpec::Fixed {
            upstream,
            block,
            blocks,
        } => {
            let up = build_resource(upstream, device)?;
            let options = FixedSizeOptions {
                block_size: *block,
                blocks_per_chunk: *blocks,
                ..Default::default()
            };
            Arc::new(FixedSizeResource::new(up, dev, options)?)
        }
    };
    Ok(r)
}

/// A new pool's release threshold from a spec's `threshold`: not given (or `max`) keeps everything, as
/// RMM's resources do; a size keeps that much (`0`: the driver's default).
fn threshold(given: Option<u64>) -> ReleaseThreshold {
    match given {
        None | Some(u64::MAX) => ReleaseThreshold::KeepAll,
        Some(n) => ReleaseThreshold::Bytes(n),
    }
}

/// A view of a device's default pool (process-wide) whose release threshold a spec set: the threshold it had
/// is put back when the resource is dropped, so the next spec, and the rest of the process, find the pool as
/// it was.
struct ThresholdRestored<R> {
    inner: R,
    pool: fn(&R) -> &MemPool,
    old: u64,
}

impl<R> ThresholdRestored<R> {
    fn set(inner: R, pool: fn(&R) -> &MemPool, threshold: u64) -> Result<Self> {
        let old = pool(&inner).release_threshold()?;
        pool(&inner).set_release_threshold(threshold)?;
        Ok(ThresholdRestored { inner, pool, old })
    }
}

impl<R> Drop for ThresholdRestored<R> {
    fn drop(&mut self) {
        // Nothing to report to from a destructor; the pool keeps the spec's threshold if this fails.
        let _ = (self.pool)(&self.inner).set_release_threshold(self.old);
    }
}

impl<R: std::fmt::Debug> std::fmt::Debug for ThresholdRestored<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThresholdRestored")
            .field("inner", &self.inner)
            .field("old", &self.old)
            .finish()
    }
}

// SAFETY: forwards every call to `inner` unchanged, so `inner`'s `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for ThresholdRestored<R> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
        self.inner.allocate(bytes, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> mempool_rmm::Result<()> {
        // SAFETY: this wrapper hands out the inner resource's allocations unchanged, so the caller's
        // obligations 1-3 for it are the same obligations for the inner resource.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
