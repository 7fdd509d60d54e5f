//! [`VmmResource`]: one physical allocation per request, mapped the way NCCL's `ncclMemAlloc` maps it,
//! so that NCCL can register the memory (`ncclCommRegister`) and peers can map it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{
    Access, AllocationProps, Context, Device, DeviceAddr, Granularity, HandleTypes, Mapping, PeerRefusal,
    PhysicalAllocation, Reservation, StreamRef,
};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::resources::driver::wait_before_immediate_free;

const NAME: &str = "VmmResource";

/// Which devices besides the owner get read-write access to a [`VmmResource`]'s memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PeerAccess {
    /// The owning device only.
    None,
    /// Every visible device that can access the owner's memory (`cuDeviceCanAccessPeer`), as
    /// `ncclMemAlloc` grants it. Devices without peer capability are left out silently.
    #[default]
    AllCapable,
    /// These devices (the owner may be listed or not; duplicates are ignored). A device that cannot
    /// access the owner's memory is an error when the resource is made, naming both devices.
    Devices(Vec<Device>),
}

/// How a [`VmmResource`] makes its allocations.
///
/// The default: exportable as a POSIX file descriptor, every peer-capable device granted access, not
/// marked GPUDirect RDMA capable. [`VmmResource::new`] takes the handle types as given and refuses
/// what the device lacks; to get unexportable memory on a device that cannot export instead, narrow
/// them to what it supports:
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::Device;
/// use mempool_rmm::{VmmOptions, VmmResource};
/// let dev = Device::get(0)?;
/// let defaults = VmmOptions::default();
/// let options = VmmOptions { handle_types: defaults.handle_types & dev.vmm_support()?.handle_types(), ..defaults };
/// let mr = VmmResource::new(&dev, options)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmOptions {
    /// How each allocation may be exported (`CUmemAllocationProp::requestedHandleTypes`):
    /// `POSIX_FILE_DESCRIPTOR` (what `ncclMemAlloc` always asks for, and what NCCL's intra-node
    /// transports share), `FABRIC` (multi-node NVLink; only on a device that reports fabric support),
    /// both, or none.
    pub handle_types: HandleTypes,
    /// Which devices get read-write access besides the owner.
    pub peers: PeerAccess,
    /// Marks allocations GPUDirect RDMA capable (`allocFlags.gpuDirectRDMACapable`), as `ncclMemAlloc`
    /// does where the device supports it; a device without
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` refuses it.
    pub gpu_direct_rdma: bool,
}

impl Default for VmmOptions {
    fn default() -> VmmOptions {
        VmmOptions {
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
            peers: PeerAccess::AllCapable,
            gpu_direct_rdma: false,
        }
    }
}

/// One live allocation: the mapping (which holds its physical allocation and its reservation) and the
/// size the caller asked for.
#[derive(Debug)]
struct Live {
    bytes: usize,
    mapping: Mapping,
}

/// Device memory made the way NCCL's `ncclMemAlloc` makes it: for every request, one physical
/// allocation (`cuMemCreate`, pinned device memory with the configured handle types) of the size rounded
/// up to the device's recommended granularity, a reservation of its own aligned to that granularity
/// (`cuMemAddressReserve`), the mapping (`cuMemMap`) and one `cuMemSetAccess` granting read-write access
/// to the owner and the peers [`VmmOptions::peers`] names.
///
/// That shape is what NCCL needs to register a buffer (`ncclCommRegister` looks up the physical
/// allocation behind an address with `cuMemRetainAllocationHandle` and shares it with its peers, which
/// works for `cuMemCreate` memory and not for `cuMemAlloc` or pool memory), and what another process
/// can import (export the allocation behind a mapped address as a file descriptor).
///
/// - Each allocation costs driver calls and at least one granule (2 MiB on current GPUs): put a
///   suballocator over it (`PoolResource::new(vmm, &dev, PoolOptions::default())`) for many small
///   buffers.
/// - `deallocate` is synchronous: it waits for the stream (every use of the memory is ordered before the
///   free on it, peers' work included; the legacy stream through an event recorded on it), then unmaps, releases the physical memory and frees the address
///   range; it does not wait for the whole device. Dropping the resource frees whatever is still
///   allocated, each mapping after a wait for every device granted access (nothing says which streams
///   use an allocation never freed).
/// - Never multicast: nothing here calls `cuMulticastCreate`.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{MemoryResource, VmmOptions, VmmResource};
/// let dev = Device::get(0)?;
/// let mr = VmmResource::new(&dev, VmmOptions::default())?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(3 << 20, stream.as_ref())?; // one physical allocation of 4 MiB (2 MiB granules)
/// assert_eq!(p.0 % mr.granularity() as u64, 0);
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 3 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
pub struct VmmResource {
    props: AllocationProps,
    granularity: usize,
    /// Reservation alignment: the granularity when it is a power of two, else 0 (the minimum).
    alignment: usize,
    /// The owner first, then each peer, all read-write: one `cuMemSetAccess` per allocation.
    access: Vec<(Device, Access)>,
    /// The device's memory: a larger request is out of memory without asking the driver.
    total_memory: usize,
    ctx: Arc<Context>,
    live: Mutex<HashMap<u64, Live>>,
}

impl std::fmt::Debug for VmmResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.props.device)
            .field("handle_types", &self.props.handle_types)
            .field("granularity", &self.granularity)
            .field(
                "access",
                &self.access.iter().map(|(d, _)| d.ordinal()).collect::<Vec<_>>(),
            )
            .field("live", &self.lock().len())
            .finish()
    }
}

/// The devices to grant access, owner first: `peers` (as `list` for [`PeerAccess::Devices`]) resolved
/// against `all` (every visible device), with `can_access(peer)` answering whether `peer` can access the
/// owner's memory. Generic over the device type so that host tests run it on plain ordinals.
fn resolve_peers<D: Copy + PartialEq>(
    owner: D,
    peers: &PeerAccess,
    list: &[D],
    all: impl FnOnce() -> mempool_core::Result<Vec<D>>,
    can_access: impl Fn(D) -> mempool_core::Result<bool>,
    ordinal: impl Fn(D) -> usize,
) -> Result<Vec<D>> {
    let mut out = vec![owner];
    match peers {
        PeerAccess::None => {}
        PeerAccess::AllCapable => {
            for d in all()? {
                if d != owner && can_access(d)? {
                    out.push(d);
                }
            }
        }
        PeerAccess::Devices(_) => {
            for &d in list {
                if out.contains(&d) {
                    continue;
                }
                if !can_access(d)? {
                    return Err(mempool_core::Error::PeerAccess {
                        owner: ordinal(owner),
                        peer: ordinal(d),
                        reason: PeerRefusal::NoPeerCapability,
                    }
                    .into());
                }
                out.push(d);
            }
        }
    }
    Ok(out)
}

impl VmmResource {
    /// A resource on `device` as `options` say. Checks everything it can now, before any allocation:
    /// VMM support, the handle types and the RDMA flag against the device (mempool-core's
    /// `CapabilityMissing` / `VmmHandleTypeNotSupported`), and each peer named in
    /// [`PeerAccess::Devices`] against `cuDeviceCanAccessPeer` (`PeerAccess` naming both devices).
    /// The handle types are taken as given: to fall back to unexportable memory on a device without
    /// POSIX file descriptor export, narrow them first (see [`VmmOptions`]).
    pub fn new(device: &Device, options: VmmOptions) -> Result<VmmResource> {
        let device = *device;
        let props = AllocationProps::new(device)
            .handle_types(options.handle_types)
            .gpu_direct_rdma(options.gpu_direct_rdma);
        // Checks VMM support, handle types and the RDMA flag, naming what is missing.
        let granularity = device.vmm_granularity(&props, Granularity::Recommended)?;
        let named = match &options.peers {
            PeerAccess::Devices(list) => list.as_slice(),
            _ => &[],
        };
        let peers = resolve_peers(
            device,
            &options.peers,
            named,
            Device::all,
            |d| d.can_access_peer(device),
            |d| d.ordinal(),
        )?;
        let ctx = device.context()?;
        let total_memory = device.total_memory()?;
        Ok(VmmResource {
            total_memory,
            props,
            granularity,
            alignment: if granularity.is_power_of_two() { granularity } else { 0 },
            access: peers.into_iter().map(|d| (d, Access::ReadWrite)).collect(),
            ctx,
            live: Mutex::new(HashMap::new()),
        })
    }

    /// The device whose memory it hands out.
    pub fn device(&self) -> Device {
        self.props.device
    }

    /// The recommended granularity (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`) every allocation's size is
    /// rounded up to and every address aligned to.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Physical bytes held by live allocations (each rounded up to the granularity), and how many there
    /// are.
    pub fn allocated(&self) -> (usize, usize) {
        let map = self.lock();
        (map.values().map(|l| l.mapping.len()).sum(), map.len())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Live>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn map_new(&self, size: usize) -> mempool_core::Result<Mapping> {
        let phys = Arc::new(PhysicalAllocation::new(&self.props, size)?);
        let reservation = Reservation::new(self.props.device, size, self.alignment, None)?;
        let mapping = Mapping::without_access(&reservation, 0, phys)?;
        mapping.set_access(&self.access)?;
        Ok(mapping)
    }
}

// SAFETY: each allocation is its own physical allocation mapped into its own reservation (aligned to the granularity, a multiple of 256), kept in `self`'s live map until `deallocate` removes and unmaps it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for VmmResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let oom = || {
            crate::observe::oom::explain(
                Error::OutOfMemory {
                    resource: NAME,
                    requested: bytes,
                },
                self,
            )
        };
        let size = mempool_core::round_up(bytes, self.granularity)
            .filter(|&s| s <= self.total_memory)
            .ok_or_else(oom)?;
        // Mapping and access are synchronous: the memory is usable on any stream once this returns.
        let mapping = self.map_new(size).map_err(|e| match Error::from(e) {
            Error::OutOfMemory { .. } => oom(),
            other => other,
        })?;
        let addr = mapping.addr();
        self.lock().insert(addr.0, Live { bytes, mapping });
        Ok(addr)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        let live = {
            let mut map = self.lock();
            match map.get(&ptr.0) {
                None => {
                    return Err(Error::InvalidDeallocation {
                        resource: NAME,
                        ptr: ptr.0,
                        bytes,
                        reason: "no live allocation of this resource starts there".into(),
                    })
                }
                Some(l) if l.bytes != bytes => {
                    return Err(Error::InvalidDeallocation {
                        resource: NAME,
                        ptr: ptr.0,
                        bytes,
                        reason: format!("the allocation there has {} bytes", l.bytes),
                    })
                }
                Some(_) => map.remove(&ptr.0),
            }
        };
        // Unmapping is not stream-ordered: wait until the work ordered before this free on `stream` is
        // done. A stream without a known context is waited for in the resource's own context; the legacy
        // stream through an event recorded on it (see `wait_before_immediate_free`): the unmap below no
        // longer waits for the whole context, which covered that before.
        let waited = wait_before_immediate_free(&self.ctx, stream);
        if let Err(e) = waited {
            // Not known to be idle: keep it mapped and allocated, so that it can be freed again later.
            if let Some(l) = live {
                self.lock().insert(ptr.0, l);
            }
            return Err(e);
        }
        // Unmapping without the mapping's own wait for every device granted access (a context-wide wait
        // on each): `stream`, which every use is ordered before, was synchronized just above. Then the
        // physical allocation is released and the reservation freed (mempool-core's teardown order). A
        // failure there leaks the range on purpose and is recorded in mempool-core's `take_drop_errors`.
        if let Some(l) = live {
            // SAFETY: 1. by this function's obligations every use of the allocation, on any stream of any
            // device, is ordered before this point of `stream`, and `stream` has completed (synchronized
            // above). 2. the allocation is returned once and its caller uses it no more (obligations 1-2);
            // it left the table, so nothing here hands its addresses out again.
            #[allow(unsafe_code)]
            unsafe {
                l.mapping.unmap_waited()
            };
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        NAME
    }

    /// The bytes and number of its live mappings (each is its own physical allocation).
    fn inspect(&self) -> crate::observe::inspect::Inspection {
        let (bytes, count) = self.allocated();
        crate::observe::inspect::Inspection {
            held_bytes: Some(bytes as u64),
            live_bytes: Some(bytes as u64),
            live_count: Some(count as u64),
            ..crate::observe::inspect::Inspection::default()
        }
    }
}

impl Drop for VmmResource {
    fn drop(&mut self) {
        // Whatever is still allocated: the mappings wait for the devices before they unmap.
        let _ = self.ctx.synchronize();
        self.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_options_are_ncclmemalloc_shaped() {
        let o = VmmOptions::default();
        assert_eq!(o.handle_types, HandleTypes::POSIX_FILE_DESCRIPTOR);
        assert_eq!(o.peers, PeerAccess::AllCapable);
        assert!(!o.gpu_direct_rdma);
    }

    /// `resolve_peers` on plain ordinals: device 2 cannot reach the owner's memory.
    fn resolve(owner: usize, peers: &PeerAccess, list: &[usize]) -> Result<Vec<usize>> {
        resolve_peers(owner, peers, list, || Ok((0..4).collect()), |d| Ok(d != 2), |d| d)
    }

    #[test]
    fn peers_resolve_owner_first_and_skip_incapable_devices() {
        assert_eq!(resolve(1, &PeerAccess::AllCapable, &[]).unwrap(), vec![1, 0, 3]);
        assert_eq!(resolve(1, &PeerAccess::None, &[]).unwrap(), vec![1]);
        let named = PeerAccess::Devices(Vec::new());
        assert_eq!(
            resolve(1, &named, &[3, 1, 3, 0]).unwrap(),
            vec![1, 3, 0],
            "owner and duplicates once"
        );
    }

    #[test]
    fn a_named_peer_without_capability_is_an_error_naming_both() {
        let e = resolve(1, &PeerAccess::Devices(Vec::new()), &[0, 2]).unwrap_err();
        assert_eq!(
            e,
            Error::Core(mempool_core::Error::PeerAccess {
                owner: 1,
                peer: 2,
                reason: PeerRefusal::NoPeerCapability
            })
        );
        assert!(
            e.to_string().contains("device 2 cannot access memory of device 1"),
            "{e}"
        );
    }

    #[test]
    fn driver_errors_of_the_peer_query_pass_through() {
        let e = resolve_peers(
            0usize,
            &PeerAccess::AllCapable,
            &[],
            || Err(mempool_core::Error::DriverNotFound),
            |_| Ok(true),
            |d| d,
        )
        .unwrap_err();
        assert_eq!(e, Error::Core(mempool_core::Error::DriverNotFound));
    }

    #[test]
    fn without_a_driver_the_resource_names_the_cause() {
        if mempool_core::driver_present() {
            return; // the GPU tests cover a machine with a driver
        }
        let e = Device::get(0)
            .map_err(Error::from)
            .and_then(|d| VmmResource::new(&d, VmmOptions::default()))
            .unwrap_err();
        assert_eq!(e, Error::Core(mempool_core::Error::DriverNotFound));
    }
}
