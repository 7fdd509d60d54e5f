//! The resources that allocate from the driver: `CudaMemoryResource`, `ManagedMemoryResource`,
//! `CudaAsyncMemoryResource`, `VmmMemoryResource`.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use mempool_core::HandleTypes;
use mempool_rmm::{
    AsyncOptions, AsyncResource, CudaResource, ManagedResource, PeerAccess, ReleaseThreshold, SharedResource,
    VmmOptions, VmmResource,
};

use super::base::{device_or_current, PyResource};
use crate::errors::IntoPy;

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
        // unexportable memory on a device that cannot.
        let supported = dev.vmm_support().py()?.handle_types();
        let options = VmmOptions {
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR & supported,
            peers,
            gpu_direct_rdma,
        };
        let typed = Arc::new(VmmResource::new(&dev, options).py()?);
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
