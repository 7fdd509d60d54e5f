//! Building checked specs into resources on a device.

use std::sync::Arc;

use mempool_core::{Context, Device};
use mempool_rmm::suballoc::{ArenaConfig, BinningConfig, FixedSizeConfig, PoolConfig};
use mempool_rmm::testing::SimResource;
use mempool_rmm::{
    ArenaResource, AsyncManagedOptions, AsyncManagedResource, AsyncOptions, AsyncResource, BinningResource,
    CudaResource, FixedSizeResource, ManagedResource, PoolResource, ReleaseThreshold, SamHeadroomResource,
    SharedResource, SystemResource,
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
        return Ok(Arc::new(SimResource::new()));
    }
    let dev = device.ok_or_else(|| Error::Usage(format!("`{spec}` needs a GPU; only `sim` runs without one")))?;
    let ctx: Arc<Context> = dev.context()?;
    let r: SharedResource = match spec {
        ResourceSpec::Sim => unreachable!("handled above"),
        ResourceSpec::Cuda => Arc::new(CudaResource::new(dev)?),
        ResourceSpec::Managed => Arc::new(ManagedResource::new(dev)?),
        ResourceSpec::RawCuda => Arc::new(RawCudaResource::new(dev)?),
        ResourceSpec::RawPool => Arc::new(RawPoolResource::new(dev)?),
        ResourceSpec::Async(a) => {
            if a.default_pool {
                let r = AsyncResource::default_pool(dev)?;
                if let Some(t) = a.threshold {
                    r.pool().set_release_threshold(t)?;
                }
                Arc::new(r)
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
                if let Some(t) = a.threshold {
                    r.pool().set_release_threshold(t)?;
                }
                Arc::new(r)
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
        ResourceSpec::SamHeadroom { headroom } => Arc::new(SamHeadroomResource::new(
            dev,
            usize::try_from(*headroom).unwrap_or(usize::MAX),
        )?),
        ResourceSpec::Pool { upstream, initial, max } => {
            let up = build_resource(upstream, device)?;
            let config = PoolConfig {
                initial_size: *initial,
                maximum_size: *max,
                ..Default::default()
            };
            Arc::new(PoolResource::new(up, &ctx, config)?)
        }
        ResourceSpec::Binning {
            upstream,
            min,
            max,
            blocks,
        } => {
            let up = build_resource(upstream, device)?;
            let config = BinningConfig {
                min_size_exponent: min.trailing_zeros(),
                max_size_exponent: max.trailing_zeros(),
                blocks_per_chunk: *blocks,
                ..Default::default()
            };
            Arc::new(BinningResource::new(up, &ctx, config)?)
        }
        ResourceSpec::Arena {
            upstream,
            superblock,
            initial,
            max,
        } => {
            let up = build_resource(upstream, device)?;
            let config = ArenaConfig {
                superblock_size: *superblock,
                initial_size: *initial,
                maximum_size: *max,
                ..Default::default()
            };
            Arc::new(ArenaResource::new(up, &ctx, config)?)
        }
        ResourceSpec::Fixed {
            upstream,
            block,
            blocks,
        } => {
            let up = build_resource(upstream, device)?;
            let config = FixedSizeConfig {
                block_size: *block,
                blocks_per_chunk: *blocks,
                ..Default::default()
            };
            Arc::new(FixedSizeResource::new(up, &ctx, config)?)
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
