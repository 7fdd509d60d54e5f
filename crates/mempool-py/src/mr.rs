//! `mempool.mr`: mempool-rmm's resources and adaptors under RMM's Python names, composable as RMM's are
//! (each adaptor holds its upstream, on the Rust side by `Arc` and on the Python side by reference), and
//! the per-device current resource.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

use mempool_core::{DeviceAddr, HandleTypes, StreamRef};
use mempool_rmm::adaptors::{
    Counters, FailureCallbackAdaptor, LimitingAdaptor, LoggingAdaptor, StatisticsAdaptor, TrackingAdaptor,
};
use mempool_rmm::suballoc::{ArenaConfig, FixedSizeConfig, PoolConfig};
use mempool_rmm::{
    ArenaResource, AsyncOptions, AsyncResource, CudaResource, FixedSizeResource, ManagedResource, MemoryResource,
    PeerAccess, PoolResource, ReleaseThreshold, SharedResource, VmmOptions, VmmResource,
};

use crate::errors::IntoPy;

/// The base of every resource (RMM's `DeviceMemoryResource`; allocate from one with
/// `mempool.DeviceBuffer(size=, mr=)`): the Rust resource, the device it allocates
/// on, and the Python upstream it keeps alive.
#[pyclass(module = "mempool.mr", name = "DeviceMemoryResource", subclass, frozen, weakref)]
pub struct PyResource {
    pub(crate) inner: SharedResource,
    pub(crate) device: usize,
    pub(crate) upstream: Option<Py<PyAny>>,
}

impl PyResource {
    fn leaf(inner: SharedResource, device: usize) -> PyClassInitializer<PyResource> {
        PyClassInitializer::from(PyResource {
            inner,
            device,
            upstream: None,
        })
    }
    fn over(inner: SharedResource, upstream: &Bound<'_, PyResource>) -> PyClassInitializer<PyResource> {
        PyClassInitializer::from(PyResource {
            inner,
            device: upstream.get().device,
            upstream: Some(upstream.clone().into_any().unbind()),
        })
    }
}

#[pymethods]
impl PyResource {
    /// The upstream resource (None for a resource that allocates from the driver).
    #[getter]
    fn upstream_mr(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.upstream.as_ref().map(|u| u.clone_ref(py))
    }
    /// The upstream resource (RMM's `get_upstream()`).
    fn get_upstream(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.upstream_mr(py)
    }
    /// The ordinal of the device the resource allocates on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }
    /// mempool-rmm's name of the Rust resource (`PoolResource`, `StatisticsAdaptor`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    /// The garbage collector sees the upstream (fixed for the resource's life, so nothing to clear:
    /// cycles through it are broken by the objects that can clear, such as a failure callback).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.upstream)
    }
    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        Ok(format!(
            "<mempool.mr.{} device={} ({})>",
            slf.get_type().name()?,
            slf.get().device,
            slf.get().inner.name()
        ))
    }
}

fn device_or_current(device: Option<usize>) -> PyResult<usize> {
    match device {
        Some(d) => {
            mempool_capi::device::device(d).py()?;
            Ok(d)
        }
        None => mempool_capi::device::current().py(),
    }
}

/// Half the free memory of `device`, aligned down to 256 bytes: RMM's default initial pool size.
fn half_free(device: usize) -> PyResult<usize> {
    let ctx = mempool_capi::device::context(device).py()?;
    let info = ctx.memory_info().py()?;
    Ok((info.free / 2) & !255)
}

/// `cuMemAlloc`: RMM's `CudaMemoryResource`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct CudaMemoryResource;

#[pymethods]
impl CudaMemoryResource {
    #[new]
    #[pyo3(signature = (*, device = None))]
    fn new(device: Option<usize>) -> PyResult<PyClassInitializer<Self>> {
        let d = device_or_current(device)?;
        let mr: SharedResource = Arc::new(CudaResource::new(&mempool_capi::device::device(d).py()?).py()?);
        Ok(PyResource::leaf(mr, d).add_subclass(CudaMemoryResource))
    }
}

/// `cuMemAllocManaged`: RMM's `ManagedMemoryResource`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct ManagedMemoryResource;

#[pymethods]
impl ManagedMemoryResource {
    #[new]
    #[pyo3(signature = (*, device = None))]
    fn new(device: Option<usize>) -> PyResult<PyClassInitializer<Self>> {
        let d = device_or_current(device)?;
        let mr: SharedResource = Arc::new(ManagedResource::new(&mempool_capi::device::device(d).py()?).py()?);
        Ok(PyResource::leaf(mr, d).add_subclass(ManagedMemoryResource))
    }
}

/// A driver stream-ordered pool (`cuMemAllocFromPoolAsync`): RMM's `CudaAsyncMemoryResource`. A new pool
/// keeps what it reserves unless `release_threshold` says otherwise; `enable_ipc` makes it exportable.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct CudaAsyncMemoryResource {
    /// The resource with its pool, for `mempool.ipc.Exporter` (None for the registry's default resource,
    /// over the device's default pool, which cannot be exported).
    pub(crate) typed: Option<Arc<AsyncResource>>,
}

#[pymethods]
impl CudaAsyncMemoryResource {
    #[new]
    #[pyo3(signature = (initial_pool_size = None, release_threshold = None, enable_ipc = false, *, device = None))]
    fn new(
        initial_pool_size: Option<usize>,
        release_threshold: Option<u64>,
        enable_ipc: bool,
        device: Option<usize>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let d = device_or_current(device)?;
        let options = AsyncOptions {
            initial_size: initial_pool_size,
            release_threshold: release_threshold.map_or(ReleaseThreshold::KeepAll, ReleaseThreshold::Bytes),
            handle_types: if enable_ipc {
                HandleTypes::POSIX_FILE_DESCRIPTOR
            } else {
                HandleTypes::empty()
            },
            ..AsyncOptions::default()
        };
        let typed = Arc::new(AsyncResource::new(&mempool_capi::device::device(d).py()?, options).py()?);
        let mr: SharedResource = typed.clone();
        Ok(PyResource::leaf(mr, d).add_subclass(CudaAsyncMemoryResource { typed: Some(typed) }))
    }
}

impl CudaAsyncMemoryResource {
    /// Wraps an existing resource (the registry's default over the device's default pool).
    pub(crate) fn wrap(inner: SharedResource, device: usize) -> PyClassInitializer<Self> {
        PyResource::leaf(inner, device).add_subclass(CudaAsyncMemoryResource { typed: None })
    }
}

/// `peers=` of `VmmMemoryResource` as Python gives it: a name (`"all"` is the only one) or device ordinals.
#[derive(FromPyObject)]
enum PeersArg {
    Name(String),
    Devices(Vec<i64>),
}

/// `peers=` checked before the driver is asked anything.
enum PeersChoice {
    All,
    Owner,
    Devices(Vec<usize>),
}

fn peers_choice(peers: Option<PeersArg>) -> PyResult<PeersChoice> {
    match peers {
        None => Ok(PeersChoice::Owner),
        Some(PeersArg::Name(name)) if name == "all" => Ok(PeersChoice::All),
        Some(PeersArg::Name(name)) => Err(PyValueError::new_err(format!(
            "peers={name:?}: give \"all\" (every device that can access this one), None (the owning device \
             only) or a list of device ordinals"
        ))),
        Some(PeersArg::Devices(list)) => list
            .into_iter()
            .map(|o| {
                usize::try_from(o).map_err(|_| PyValueError::new_err(format!("peers: device ordinal {o} is negative")))
            })
            .collect::<PyResult<Vec<usize>>>()
            .map(PeersChoice::Devices),
    }
}

/// One `cuMemCreate` physical allocation, reservation and mapping per request, exportable as a POSIX file
/// descriptor where the device supports it, with every device `peers` names granted read-write access:
/// memory the way NCCL's `ncclMemAlloc` makes it, which NCCL can register (`ncclCommRegister`, PyTorch's
/// `register_mem_pool`). mempool-rmm's `VmmResource`. Each allocation takes at least one granule
/// (`granularity`, 2 MiB on current GPUs) and a free waits for its stream: put a `PoolMemoryResource` over
/// it for many small buffers.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct VmmMemoryResource {
    typed: Arc<VmmResource>,
}

#[pymethods]
impl VmmMemoryResource {
    #[new]
    #[pyo3(signature = (*, device = None, peers = Some(PeersArg::Name(String::from("all"))), gpu_direct_rdma = false))]
    fn new(
        device: Option<usize>,
        peers: Option<PeersArg>,
        gpu_direct_rdma: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let choice = peers_choice(peers)?;
        let d = device_or_current(device)?;
        let dev = mempool_capi::device::device(d).py()?;
        let peers = match choice {
            PeersChoice::All => PeerAccess::AllCapable,
            PeersChoice::Owner => PeerAccess::None,
            PeersChoice::Devices(list) => PeerAccess::Devices(
                list.into_iter()
                    .map(mempool_capi::device::device)
                    .collect::<Result<Vec<_>, _>>()
                    .py()?,
            ),
        };
        // POSIX file descriptors where the device can export them (what NCCL shares between processes);
        // unexportable memory on a device that cannot, as `VmmResource::new` does.
        let supported = dev.vmm_support().py()?.handle_types();
        let options = VmmOptions {
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR & supported,
            peers,
            gpu_direct_rdma,
        };
        let typed = Arc::new(VmmResource::with_options(dev, options).py()?);
        let mr: SharedResource = typed.clone();
        Ok(PyResource::leaf(mr, d).add_subclass(VmmMemoryResource { typed }))
    }
    /// The granularity (bytes) every allocation's size is rounded up to and its address aligned to.
    #[getter]
    fn granularity(&self) -> usize {
        self.typed.granularity()
    }
    /// `(bytes, count)`: the physical bytes of the live allocations (each a whole number of granules) and
    /// how many there are.
    fn allocated(&self) -> (usize, usize) {
        self.typed.allocated()
    }
}

fn upstream_device(upstream: &Bound<'_, PyResource>) -> PyResult<Arc<mempool_core::Context>> {
    mempool_capi::device::context(upstream.get().device).py()
}

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
        let ctx = upstream_device(upstream_mr)?;
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
        let config = PoolConfig {
            initial_size: initial as u64,
            maximum_size: maximum_pool_size.map(|m| m as u64),
            ..PoolConfig::default()
        };
        let typed = Arc::new(PoolResource::new(upstream_mr.get().inner.clone(), &ctx, config).py()?);
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
    let ctx = upstream_device(upstream)?;
    let config = FixedSizeConfig {
        block_size: block_size as u64,
        blocks_per_chunk: blocks as u64,
        ..FixedSizeConfig::default()
    };
    Ok(Arc::new(
        FixedSizeResource::new(upstream.get().inner.clone(), &ctx, config).py()?,
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

/// Routes each request to the smallest bin that fits, larger ones to the upstream: RMM's
/// `binning_memory_resource`. Bins are fixed once it allocated (a free is routed by its size, so a bin
/// added later would take frees of memory it never gave out).
#[derive(Debug)]
struct BinRouter {
    upstream: SharedResource,
    // Sorted by size; each bin serves requests up to its size.
    bins: RwLock<Vec<(usize, SharedResource)>>,
    used: AtomicBool,
}

impl BinRouter {
    fn route(&self, bytes: usize) -> SharedResource {
        let bins = self.bins.read().unwrap_or_else(|p| p.into_inner());
        bins.iter()
            .find(|(size, _)| bytes <= *size)
            .map_or_else(|| self.upstream.clone(), |(_, r)| r.clone())
    }
}

// SAFETY: every allocation and free goes unchanged to the one resource (a bin's or the fallback) that
// the size selects, and the same size selects the same resource for the free, so that resource's
// `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl MemoryResource for BinRouter {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
        let target = {
            // `used` is set under the read lock, and `add_bin` checks it under the write lock: a bin is
            // either added before this allocation routes, or refused.
            let bins = self.bins.read().unwrap_or_else(|p| p.into_inner());
            self.used.store(true, Ordering::Release);
            bins.iter()
                .find(|(size, _)| bytes <= *size)
                .map_or_else(|| self.upstream.clone(), |(_, r)| r.clone())
        };
        target.allocate(bytes, stream)
    }
    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> mempool_rmm::Result<()> {
        // SAFETY: the caller's contract; `bytes` routes to the resource `allocate` used for it, since the
        // bins cannot change once anything was allocated.
        unsafe { self.route(bytes).deallocate(ptr, bytes, stream) }
    }
    fn name(&self) -> &'static str {
        "BinningResource"
    }
}

/// RMM's `BinningMemoryResource`: bins of `FixedSizeMemoryResource` for the powers of two from
/// `2**min_size_exponent` to `2**max_size_exponent` (none when either is -1), more with `add_bin`, and
/// everything larger from `upstream_mr`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct BinningMemoryResource {
    router: Arc<BinRouter>,
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
        let mut bins = Vec::new();
        if min_size_exponent >= 0 && max_size_exponent >= 0 {
            if min_size_exponent > max_size_exponent || max_size_exponent > 40 {
                return Err(PyValueError::new_err(format!(
                    "bin exponents {min_size_exponent}..={max_size_exponent}: need min <= max <= 40"
                )));
            }
            for e in min_size_exponent..=max_size_exponent {
                let size = 1usize << e;
                bins.push((size, fixed_size(upstream_mr, size, 128)?));
            }
        }
        let router = Arc::new(BinRouter {
            upstream: upstream_mr.get().inner.clone(),
            bins: RwLock::new(bins),
            used: AtomicBool::new(false),
        });
        let shared: SharedResource = router.clone();
        Ok(
            PyResource::over(shared, upstream_mr).add_subclass(BinningMemoryResource {
                router,
                bin_objects: Mutex::new(Vec::new()),
            }),
        )
    }

    /// Adds a bin serving requests up to `allocation_size`: `bin_resource`, or a new
    /// `FixedSizeMemoryResource` of that block size over the upstream. Refused once the resource allocated.
    #[pyo3(signature = (allocation_size, bin_resource = None))]
    fn add_bin(
        slf: &Bound<'_, Self>,
        allocation_size: usize,
        bin_resource: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<()> {
        let this = slf.get();
        let refused = || {
            PyValueError::new_err(
                "add_bin after the resource allocated: frees are routed by size, so a new bin would take frees \
                 of memory it never gave out; add every bin before the first allocation",
            )
        };
        // A quick refusal; the check that counts is repeated under the write lock below.
        if this.router.used.load(Ordering::Acquire) {
            return Err(refused());
        }
        if allocation_size == 0 {
            return Err(PyValueError::new_err("add_bin: allocation_size must be positive"));
        }
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
                fixed_size(up, allocation_size, 128)?
            }
        };
        // Allocations set `used` under the read lock: checked under the write lock, no allocation has
        // routed yet, and none routes until the bin is in.
        let mut bins = this.router.bins.write().unwrap_or_else(|p| p.into_inner());
        if this.router.used.load(Ordering::Acquire) {
            drop(bins);
            return Err(refused());
        }
        bins.retain(|(size, _)| *size != allocation_size);
        bins.push((allocation_size, resource));
        bins.sort_by_key(|(size, _)| *size);
        drop(bins);
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

    /// The sizes of the bins, ascending.
    #[getter]
    fn bin_sizes(&self) -> Vec<usize> {
        self.router
            .bins
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(s, _)| *s)
            .collect()
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
        let ctx = upstream_device(upstream_mr)?;
        let size = match arena_size {
            Some(n) => n,
            None => half_free(upstream_mr.get().device)?,
        } as u64;
        let config = ArenaConfig {
            initial_size: size,
            maximum_size: Some(size),
            ..ArenaConfig::default()
        };
        let mr: SharedResource = Arc::new(ArenaResource::new(upstream_mr.get().inner.clone(), &ctx, config).py()?);
        Ok(PyResource::over(mr, upstream_mr).add_subclass(ArenaMemoryResource))
    }
}

/// Counters of bytes and allocations: current, peak and total (RMM's `Statistics`).
#[pyclass(module = "mempool.mr", frozen, get_all, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct Statistics {
    current_bytes: i64,
    current_count: i64,
    peak_bytes: i64,
    peak_count: i64,
    total_bytes: i64,
    total_count: i64,
}

impl From<Counters> for Statistics {
    fn from(c: Counters) -> Self {
        Statistics {
            current_bytes: c.bytes.current,
            current_count: c.allocations.current,
            peak_bytes: c.bytes.peak,
            peak_count: c.allocations.peak,
            total_bytes: c.bytes.total,
            total_count: c.allocations.total,
        }
    }
}

#[pymethods]
impl Statistics {
    fn __repr__(&self) -> String {
        format!(
            "Statistics(current_bytes={}, current_count={}, peak_bytes={}, peak_count={}, total_bytes={}, \
             total_count={})",
            self.current_bytes,
            self.current_count,
            self.peak_bytes,
            self.peak_count,
            self.total_bytes,
            self.total_count
        )
    }
}

/// Counts what passes through to the upstream: RMM's `StatisticsResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct StatisticsResourceAdaptor {
    typed: Arc<StatisticsAdaptor<SharedResource>>,
}

#[pymethods]
impl StatisticsResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>) -> PyClassInitializer<Self> {
        let typed = Arc::new(StatisticsAdaptor::new(upstream_mr.get().inner.clone()));
        // C code's handle to the current resource reads these counters when this adaptor is current.
        mempool_capi::ffi::register_statistics(&typed);
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(StatisticsResourceAdaptor { typed })
    }
    /// The counters of the innermost scope.
    #[getter]
    fn allocation_counts(&self) -> Statistics {
        self.typed.counters().into()
    }
    /// Starts a scope with zeroed counters; returns the counters before it.
    fn push_counters(&self) -> Statistics {
        self.typed.push_counters().into()
    }
    /// Ends the innermost scope and returns its counters (the outer scope absorbs them).
    fn pop_counters(&self) -> PyResult<Statistics> {
        self.typed
            .pop_counters()
            .map(Statistics::from)
            .ok_or_else(|| PyValueError::new_err("pop_counters: the outermost scope cannot be popped"))
    }
}

/// Records every outstanding allocation: RMM's `TrackingResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct TrackingResourceAdaptor {
    typed: Arc<TrackingAdaptor<SharedResource>>,
}

#[pymethods]
impl TrackingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, capture_stacks = false))]
    fn new(upstream_mr: &Bound<'_, PyResource>, capture_stacks: bool) -> PyClassInitializer<Self> {
        let _ = capture_stacks; // the Rust adaptor records each allocation's call site and thread always
        let typed = Arc::new(TrackingAdaptor::new(upstream_mr.get().inner.clone()));
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(TrackingResourceAdaptor { typed })
    }
    /// Bytes outstanding.
    fn get_allocated_bytes(&self) -> usize {
        self.typed.outstanding_bytes()
    }
    /// One line per outstanding allocation.
    fn get_outstanding_allocations_str(&self) -> String {
        self.typed.leak_report()
    }
    /// Prints the outstanding allocations.
    fn log_outstanding_allocations(&self) {
        println!("{}", self.typed.leak_report());
    }
}

type FileLogger = LoggingAdaptor<SharedResource, BufWriter<File>>;

/// Every logging adaptor alive, flushed by `_flush_logs` (which `mempool.mr` registers with `atexit`, as RMM
/// flushes its logs at exit: an adaptor kept as the current resource is never dropped).
static LOGGERS: Mutex<Vec<std::sync::Weak<FileLogger>>> = Mutex::new(Vec::new());

/// Flushes every live `LoggingResourceAdaptor`'s buffered lines to its file (registered with `atexit` by
/// `mempool.mr`). A failure to write is reported as a warning, not raised.
#[pyfunction]
pub fn _flush_logs(py: Python<'_>) -> PyResult<()> {
    let live: Vec<Arc<FileLogger>> = {
        let mut all = LOGGERS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(|w| w.upgrade()).collect()
    };
    for logger in live {
        if let Err(e) = py.detach(|| logger.flush()) {
            let warnings = py.import("warnings")?;
            warnings.call_method1("warn", (format!("mempool: could not flush a log file: {e}"),))?;
        }
    }
    Ok(())
}

/// `name` with `.dev{device}` before its extension (`log.csv` -> `log.dev0.csv`), as RMM's `_append_id`
/// (`os.path.splitext`: a leading dot is not an extension, and only the last dot of the file name counts).
fn append_device(name: &str, device: usize) -> String {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let file = &name[file_start..];
    let stem_len = file.len() - file.trim_start_matches('.').len();
    match file[stem_len..].rfind('.') {
        Some(dot) => {
            let at = file_start + stem_len + dot;
            format!("{}.dev{device}{}", &name[..at], &name[at..])
        }
        None => format!("{name}.dev{device}"),
    }
}

/// Writes every allocation and free as a CSV line (RMM's format): RMM's `LoggingResourceAdaptor`. The file
/// is `log_file_name`, else the environment variable `RMM_LOG_FILE`, with `.dev{N}` inserted before its
/// extension (N: the device the adaptor allocates on) and made absolute, as RMM names it; `get_file_name()`
/// returns the name used.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct LoggingResourceAdaptor {
    typed: Arc<FileLogger>,
    file_name: String,
}

#[pymethods]
impl LoggingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, log_file_name = None))]
    fn new(upstream_mr: &Bound<'_, PyResource>, log_file_name: Option<String>) -> PyResult<PyClassInitializer<Self>> {
        let given = log_file_name.or_else(|| std::env::var("RMM_LOG_FILE").ok().filter(|f| !f.is_empty()));
        let Some(given) = given else {
            return Err(PyValueError::new_err(
                "LoggingResourceAdaptor needs log_file_name or the RMM_LOG_FILE environment variable",
            ));
        };
        let named = append_device(&given, upstream_mr.get().device);
        let file_name = std::path::absolute(&named)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or(named);
        let file = File::create(&file_name)
            .map_err(|e| PyErr::new::<pyo3::exceptions::PyOSError, _>(format!("cannot create {file_name}: {e}")))?;
        let typed = Arc::new(LoggingAdaptor::new(upstream_mr.get().inner.clone(), BufWriter::new(file)).py()?);
        LOGGERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&typed));
        let shared: SharedResource = typed.clone();
        Ok(PyResource::over(shared, upstream_mr).add_subclass(LoggingResourceAdaptor { typed, file_name }))
    }
    /// The log file's name.
    fn get_file_name(&self) -> String {
        self.file_name.clone()
    }
    /// Writes buffered lines to the file.
    fn flush(&self) -> PyResult<()> {
        self.typed.flush().py()
    }
}

/// Refuses allocations that would take more than `allocation_limit` bytes through it (an
/// `OutOfMemoryError` naming the size): RMM's `LimitingResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct LimitingResourceAdaptor {
    typed: Arc<LimitingAdaptor<SharedResource>>,
}

#[pymethods]
impl LimitingResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>, allocation_limit: usize) -> PyClassInitializer<Self> {
        let typed = Arc::new(LimitingAdaptor::new(upstream_mr.get().inner.clone(), allocation_limit));
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(LimitingResourceAdaptor { typed })
    }
    /// Bytes allocated through the adaptor now.
    fn get_allocated_bytes(&self) -> usize {
        self.typed.used()
    }
    /// The limit.
    fn get_allocation_limit(&self) -> usize {
        self.typed.limit()
    }
}

/// On out-of-memory calls `callback(nbytes)`; a true result retries the allocation: RMM's
/// `FailureCallbackResourceAdaptor`. An exception in the callback is reported as unraisable and counts as
/// false.
///
/// The callback is held once, shared by this object and the Rust adaptor, and the garbage collector sees
/// it: a callback that refers to the adaptor forms a cycle the collector frees (clearing the callback;
/// the adaptor then refuses like its upstream).
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct FailureCallbackResourceAdaptor {
    callback: Arc<Mutex<Option<Py<PyAny>>>>,
}

#[pymethods]
impl FailureCallbackResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>, callback: Bound<'_, PyAny>) -> PyResult<PyClassInitializer<Self>> {
        if !callback.is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "callback must be callable: callback(nbytes) -> bool",
            ));
        }
        let slot = Arc::new(Mutex::new(Some(callback.unbind())));
        let cb = slot.clone();
        // The closure takes the GIL to call the callback (allocations run with the GIL released, so an
        // allocating Python thread does not hold it here); the slot's lock is not held during the call.
        let f = move |bytes: usize, _attempt: u32| {
            Python::attach(|py| {
                let callback = cb
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|c| c.clone_ref(py));
                let Some(callback) = callback else {
                    return false; // cleared by the garbage collector
                };
                match callback.call1(py, (bytes,)).and_then(|r| r.bind(py).is_truthy()) {
                    Ok(retry) => retry,
                    Err(e) => {
                        e.write_unraisable(py, None);
                        false
                    }
                }
            })
        };
        let mr: SharedResource = Arc::new(FailureCallbackAdaptor::new(upstream_mr.get().inner.clone(), f));
        Ok(PyResource::over(mr, upstream_mr).add_subclass(FailureCallbackResourceAdaptor { callback: slot }))
    }
    /// The callback (None once the garbage collector cleared it).
    #[getter]
    fn callback(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.callback
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|c| c.clone_ref(py))
    }
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(cb) = self.callback.try_lock() {
            visit.call(&*cb)?;
        }
        Ok(())
    }
    fn __clear__(&self) {
        let taken = self.callback.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken); // after the lock is released: dropping may run Python code
    }
}

/// The Python objects set as each device's resource, so that `get_per_device_resource` returns the object
/// that was set (RMM's behaviour), as long as the registry still holds its resource.
static CURRENT: Mutex<Option<HashMap<usize, Py<PyAny>>>> = Mutex::new(None);

fn same(a: &SharedResource, b: &SharedResource) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Makes `mr` the current resource of `device`. Refuses a resource made for another device.
#[pyfunction]
pub fn set_per_device_resource(device: usize, mr: &Bound<'_, PyResource>) -> PyResult<()> {
    let r = mr.get();
    if r.device != device {
        return Err(PyValueError::new_err(format!(
            "the resource allocates on device {}, not on device {device}",
            r.device
        )));
    }
    let previous = mempool_capi::registry::set(device, r.inner.clone()).py()?;
    let replaced = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(device, mr.clone().into_any().unbind());
    // Dropped after the lock is released: the last reference to a resource can run Python code (a
    // failure callback's finalizer, a logging adaptor's flush).
    drop((replaced, previous));
    Ok(())
}

/// The current resource of `device`: the object set, or (the registry's default, or a resource set from
/// C) an object over it: a `CudaAsyncMemoryResource` for the default, a `DeviceMemoryResource` otherwise.
#[pyfunction]
pub fn get_per_device_resource(py: Python<'_>, device: usize) -> PyResult<Py<PyAny>> {
    let shared = mempool_capi::registry::current(device).py()?;
    let set = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&device)
        .map(|o| o.clone_ref(py));
    if let Some(obj) = &set {
        if let Ok(r) = obj.bind(py).cast::<PyResource>() {
            if same(&r.get().inner, &shared) {
                return Ok(obj.clone_ref(py));
            }
        }
    }
    // Built with the lock released (making a Python object can run Python code).
    let obj = if shared.name() == "AsyncResource" {
        Bound::new(py, CudaAsyncMemoryResource::wrap(shared, device))?
            .into_any()
            .unbind()
    } else {
        Bound::new(py, PyResource::leaf(shared, device))?.into_any().unbind()
    };
    let replaced = CURRENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(device, obj.clone_ref(py));
    drop((replaced, set)); // after the lock is released
    Ok(obj)
}
