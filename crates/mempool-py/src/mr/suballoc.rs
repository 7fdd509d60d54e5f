//! The suballocators, over mempool-rmm's: `PoolMemoryResource`, `FixedSizeMemoryResource`,
//! `BinningMemoryResource`, `ArenaMemoryResource`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

use mempool_rmm::adaptors::AddedBinsAdaptor;
use mempool_rmm::suballoc::{ArenaOptions, FixedSizeOptions, PoolOptions};
use mempool_rmm::{ArenaResource, FixedSizeResource, PoolResource, SharedResource};

use super::base::{half_free, upstream_device, PyResource};
use crate::errors::IntoPy;

/// A pool suballocator: RMM's `PoolMemoryResource`. `initial_pool_size` (default: half the device's free
/// memory, as RMM) is reserved from `upstream_mr` at the first allocation; the pool never holds more than
/// `maximum_pool_size` (default: no limit).
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct PoolMemoryResource {
    typed: Arc<PoolResource<SharedResource>>,
}

#[pymethods]
impl PoolMemoryResource {
    #[new]
    #[pyo3(signature = (upstream_mr, initial_pool_size = None, maximum_pool_size = None))]
    fn new(
        upstream_mr: &Bound<'_, PyResource>,
        initial_pool_size: Option<usize>,
        maximum_pool_size: Option<usize>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let dev = upstream_device(upstream_mr)?;
        let initial = match initial_pool_size {
            Some(n) => n,
            None => half_free(upstream_mr.get().device)?,
        };
        if let Some(max) = maximum_pool_size {
            if max < initial {
                return Err(PyValueError::new_err(format!(
                    "maximum_pool_size ({max}) is smaller than initial_pool_size ({initial})"
                )));
            }
        }
        let options = PoolOptions {
            initial_size: initial as u64,
            maximum_size: maximum_pool_size.map(|m| m as u64),
            ..PoolOptions::default()
        };
        let typed = Arc::new(PoolResource::new(upstream_mr.get().inner.clone(), &dev, options).py()?);
        let shared: SharedResource = typed.clone();
        Ok(PyResource::over(shared, upstream_mr).add_subclass(PoolMemoryResource { typed }))
    }
    /// Bytes the pool holds from its upstream now (RMM's `pool_size()`).
    fn pool_size(&self) -> u64 {
        self.typed.stats().reserved_bytes
    }
    /// The engine's counters: reserved, used and free bytes, free blocks, live allocations, upstream chunks.
    fn stats(&self) -> std::collections::HashMap<&'static str, u64> {
        let s = self.typed.stats();
        HashMap::from([
            ("reserved_bytes", s.reserved_bytes),
            ("used_bytes", s.used_bytes),
            ("free_bytes", s.free_bytes),
            ("free_blocks", s.free_blocks as u64),
            ("live_allocations", s.live_allocations as u64),
            ("upstream_chunks", s.upstream_chunks as u64),
        ])
    }
    /// Returns the chunks no live allocation uses to the upstream. It waits for the device (with the
    /// interpreter released: other Python threads run meanwhile).
    fn release_unused(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.typed.release_unused()).py()
    }
}

/// Blocks of one size carved from chunks of the upstream: RMM's `FixedSizeMemoryResource`. Larger requests
/// are refused (`UnsupportedError`).
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct FixedSizeMemoryResource;

fn fixed_size(upstream: &Bound<'_, PyResource>, block_size: usize, blocks: usize) -> PyResult<SharedResource> {
    let dev = upstream_device(upstream)?;
    let options = FixedSizeOptions {
        block_size: block_size as u64,
        blocks_per_chunk: blocks as u64,
        ..FixedSizeOptions::default()
    };
    Ok(Arc::new(
        FixedSizeResource::new(upstream.get().inner.clone(), &dev, options).py()?,
    ))
}

#[pymethods]
impl FixedSizeMemoryResource {
    #[new]
    #[pyo3(signature = (upstream_mr, block_size = 1 << 20, blocks_to_preallocate = 128))]
    fn new(
        upstream_mr: &Bound<'_, PyResource>,
        block_size: usize,
        blocks_to_preallocate: usize,
    ) -> PyResult<PyClassInitializer<Self>> {
        let mr = fixed_size(upstream_mr, block_size, blocks_to_preallocate)?;
        Ok(PyResource::over(mr, upstream_mr).add_subclass(FixedSizeMemoryResource))
    }
}

/// RMM's `BinningMemoryResource`: mempool-rmm's `BinningResource` (power-of-two bins of fixed-size blocks,
/// `2**min_size_exponent` to `2**max_size_exponent`; none when either is -1; exponents under 8 give the one
/// 256-byte bin, as RMM rounds bin sizes up to 256) with bins of any size added by `add_bin` in front of it
/// (mempool-rmm's `AddedBinsAdaptor`). A request goes to the smallest bin that holds it, a larger one to
/// `upstream_mr`. Bins are fixed once it allocated.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct BinningMemoryResource {
    typed: Arc<AddedBinsAdaptor<SharedResource>>,
    /// The Python resources given to `add_bin`, kept alive with this one.
    bin_objects: Mutex<Vec<Py<PyAny>>>,
}

#[pymethods]
impl BinningMemoryResource {
    #[new]
    #[pyo3(signature = (upstream_mr, min_size_exponent = -1, max_size_exponent = -1))]
    fn new(
        upstream_mr: &Bound<'_, PyResource>,
        min_size_exponent: i32,
        max_size_exponent: i32,
    ) -> PyResult<PyClassInitializer<Self>> {
        let upstream = upstream_mr.get().inner.clone();
        let typed = if min_size_exponent >= 0 && max_size_exponent >= 0 {
            let dev = upstream_device(upstream_mr)?;
            mempool_capi::build::rmm_binning(upstream, &dev, min_size_exponent, max_size_exponent).py()?
        } else {
            AddedBinsAdaptor::new(upstream)
        };
        let typed = Arc::new(typed);
        let shared: SharedResource = typed.clone();
        Ok(
            PyResource::over(shared, upstream_mr).add_subclass(BinningMemoryResource {
                typed,
                bin_objects: Mutex::new(Vec::new()),
            }),
        )
    }

    /// Adds a bin serving the requests up to `allocation_size` bytes (rounded up to 256) that no smaller
    /// bin holds: from `bin_resource`, or from a new `FixedSizeMemoryResource` of that block size over the
    /// upstream (as RMM). `ValueError` naming the cause for a size that has a bin already, a resource on
    /// another device, and any call once the resource allocated.
    #[pyo3(signature = (allocation_size, bin_resource = None))]
    fn add_bin(
        slf: &Bound<'_, Self>,
        allocation_size: usize,
        bin_resource: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<()> {
        let this = slf.get();
        let base = slf.as_super();
        let resource = match bin_resource {
            Some(r) => {
                if r.get().device != base.get().device {
                    return Err(PyValueError::new_err(format!(
                        "add_bin: the bin resource is on device {}, the binning resource on device {}",
                        r.get().device,
                        base.get().device
                    )));
                }
                r.get().inner.clone()
            }
            None => {
                let up = base
                    .get()
                    .upstream
                    .as_ref()
                    .expect("a binning resource has an upstream");
                let up = up.bind(slf.py()).cast::<PyResource>()?;
                let block = allocation_size.checked_next_multiple_of(256).unwrap_or(allocation_size);
                fixed_size(up, block, 128)?
            }
        };
        match this.typed.add_bin(allocation_size, resource) {
            Ok(()) => {}
            Err(mempool_rmm::Error::Unsupported { reason, .. }) => return Err(PyValueError::new_err(reason)),
            Err(e) => return Err(e).py(),
        }
        if let Some(r) = bin_resource {
            this.bin_objects
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(r.clone().into_any().unbind());
        }
        Ok(())
    }

    /// The garbage collector sees the bin resources given to `add_bin` (kept for the resource's life).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(bins) = self.bin_objects.try_lock() {
            for b in bins.iter() {
                visit.call(b)?;
            }
        }
        Ok(())
    }

    /// The block sizes of the bins, ascending.
    #[getter]
    fn bin_sizes(&self) -> Vec<usize> {
        self.typed.bin_sizes()
    }
}

/// Per-stream arenas over a global arena: RMM's `ArenaMemoryResource`. The global arena holds
/// `arena_size` bytes (default: half the device's free memory, as RMM) and does not grow.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct ArenaMemoryResource;

#[pymethods]
impl ArenaMemoryResource {
    #[new]
    #[pyo3(signature = (upstream_mr, arena_size = None, dump_log_on_failure = false))]
    fn new(
        upstream_mr: &Bound<'_, PyResource>,
        arena_size: Option<usize>,
        dump_log_on_failure: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let _ = dump_log_on_failure; // RMM's debugging aid; errors here already name the size.
        let dev = upstream_device(upstream_mr)?;
        let size = match arena_size {
            Some(n) => n,
            None => half_free(upstream_mr.get().device)?,
        } as u64;
        let options = ArenaOptions {
            initial_size: size,
            maximum_size: Some(size),
            ..ArenaOptions::default()
        };
        let mr: SharedResource = Arc::new(ArenaResource::new(upstream_mr.get().inner.clone(), &dev, options).py()?);
        Ok(PyResource::over(mr, upstream_mr).add_subclass(ArenaMemoryResource))
    }
}
