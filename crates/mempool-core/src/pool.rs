//! Stream-ordered memory pools (`cuMemPool*`): creation, attributes, trimming, peer access, the device's
//! current pool (and `Device::default_pool` / `Device::current_pool`), allocation, and the raw IPC
//! primitives (pool and pointer export and import). The plain pool settings (`PoolProps`, `HandleTypes`,
//! `ReusePolicy`, `Access`, ...) are in `types`; their conversions to the driver's enums are here.
//!
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::buffer::PoolBuffer;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::raw::{self, sys};
use crate::stream::StreamRef;
use crate::types::{
    Access, AllocationType, Device, DeviceAddr, HandleTypes, PeerRefusal, PoolKind, PoolLocation, PoolProps, PoolUsage,
    PtrExportData, ReusePolicy,
};

/// Each reuse flag with the pool attribute that holds it (an `int`, 0 or 1).
const REUSE_ATTRIBUTES: [(sys::CUmemPool_attribute, ReusePolicy); 3] = [
    (
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
        ReusePolicy::FOLLOW_EVENT_DEPENDENCIES,
    ),
    (
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        ReusePolicy::ALLOW_OPPORTUNISTIC,
    ),
    (
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        ReusePolicy::ALLOW_INTERNAL_DEPENDENCIES,
    ),
];

/// The driver's form of a location.
fn location_to_raw(location: PoolLocation) -> sys::CUmemLocation {
    use sys::CUmemLocationType::*;
    let (type_, id) = match location {
        PoolLocation::Device(d) => (CU_MEM_LOCATION_TYPE_DEVICE, d.as_raw()),
        PoolLocation::Host => (CU_MEM_LOCATION_TYPE_HOST, 0),
        PoolLocation::HostNuma(node) => (CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
    };
    sys::CUmemLocation { type_, id }
}

/// The driver's form of an allocation type.
fn allocation_type_to_raw(allocation_type: AllocationType) -> sys::CUmemAllocationType {
    use sys::CUmemAllocationType::*;
    match allocation_type {
        AllocationType::Pinned => CU_MEM_ALLOCATION_TYPE_PINNED,
        AllocationType::Managed => CU_MEM_ALLOCATION_TYPE_MANAGED,
    }
}

/// The driver's form of an access.
fn access_to_raw(access: Access) -> sys::CUmemAccess_flags {
    use sys::CUmemAccess_flags::*;
    match access {
        Access::None => CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// An access from the driver's flags (anything unknown reads as no access).
fn access_from_raw(flags: sys::CUmemAccess_flags) -> Access {
    use sys::CUmemAccess_flags::*;
    match flags {
        CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
        _ => Access::None,
    }
}

/// A stream-ordered memory pool on one device.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{Device, MemPool, PoolProps, Stream};
/// let dev = Device::get(0)?;
/// let pool = MemPool::new(&dev, &PoolProps::new())?;
/// pool.set_release_threshold(64 << 20)?; // keep up to 64 MiB cached across synchronizations
/// let stream = Stream::new(&dev.context()?)?;
/// let buf = pool.alloc(1 << 20, stream.as_ref())?; // freed on `stream` when dropped
/// buf.fill(0)?;
/// drop(buf);
/// stream.synchronize()?;
/// println!("{:?}", pool.usage()?);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct MemPool {
    ctx: Arc<Context>,
    handle: Arc<PoolHandle>,
    kind: PoolKind,
    /// The device whose context the pool's calls are made in: the pool's own device, or for a host pool
    /// the device it was created for.
    device: Device,
    location: PoolLocation,
    handle_types: HandleTypes,
    allocation_type: AllocationType,
}

impl MemPool {
    /// Creates a pool for `device` with `props` (`cuMemPoolCreate`).
    ///
    /// Errors: [`Error::PoolsNotSupported`] on a device without pools; [`Error::HandleTypeNotSupported`]
    /// when the device cannot export pools as asked. A pool of managed memory
    /// ([`AllocationType::Managed`]) is checked up front: [`Error::CapabilityMissing`] without a driver for
    /// CUDA 13.0 or without `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`, [`Error::InvalidArgument`]
    /// with handle types or a maximum size (managed pools cannot be exported and take no maximum).
    pub fn new(device: &Device, props: &PoolProps) -> Result<MemPool> {
        device.require_pools()?;
        if props.allocation_type == AllocationType::Managed {
            device.require_managed_pools()?;
            if !props.handle_types.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "a pool of managed memory cannot be exported: handle types {:?} were asked for",
                    props.handle_types
                )));
            }
            if props.max_size.is_some() {
                return Err(Error::InvalidArgument(
                    "a pool of managed memory takes no maximum size (CUmemPoolProps.maxSize must be 0)".into(),
                ));
            }
        }
        if !props.handle_types.is_empty() {
            let supported = device.supported_pool_handle_types()?;
            if !supported.contains(props.handle_types) {
                return Err(Error::HandleTypeNotSupported {
                    device: device.ordinal(),
                    requested: props.handle_types,
                    supported,
                });
            }
        }
        let location = props.location.unwrap_or(PoolLocation::Device(*device));
        let ctx = device.context()?;
        // SAFETY: all-zero is a valid value of this plain C struct (integers, enums whose zero is a valid
        // enumerator, a null pointer, reserved bytes that must be zero).
        #[allow(unsafe_code)]
        let mut raw_props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        raw_props.allocType = allocation_type_to_raw(props.allocation_type);
        raw_props.handleTypes = sys::CUmemAllocationHandleType(props.handle_types.bits());
        raw_props.location = location_to_raw(location);
        raw_props.maxSize = props.max_size.unwrap_or(0);
        let _g = ctx.bind()?;
        let raw = raw::pool::create(&raw_props)?;
        Ok(MemPool {
            ctx: ctx.clone(),
            handle: PoolHandle::destroyed_on_drop(&ctx, raw),
            kind: PoolKind::Owned,
            device: *device,
            location,
            handle_types: props.handle_types,
            allocation_type: props.allocation_type,
        })
    }

    pub(crate) fn default_of(ctx: Arc<Context>) -> Result<MemPool> {
        let device = ctx.device();
        let raw = raw::pool::device_default(device.as_raw())?;
        // SAFETY: a device's default pool is never destroyed (point 1).
        #[allow(unsafe_code)]
        Ok(unsafe { MemPool::borrowed(ctx, raw, AllocationType::Pinned) })
    }

    fn default_managed_of(ctx: Arc<Context>) -> Result<MemPool> {
        let device = ctx.device();
        let location = location_to_raw(PoolLocation::Device(device));
        let raw = raw::pool::location_default(location, allocation_type_to_raw(AllocationType::Managed))?;
        // SAFETY: a location's default pool is never destroyed (point 1).
        #[allow(unsafe_code)]
        Ok(unsafe { MemPool::borrowed(ctx, raw, AllocationType::Managed) })
    }

    /// A view of a pool this value does not own: dropping it destroys nothing.
    ///
    /// # Safety
    /// 1. `raw` is a live pool of `ctx`'s device that is never destroyed (a default pool).
    /// 2. Its memory is of `allocation_type`.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn borrowed(
        ctx: Arc<Context>,
        raw: sys::CUmemoryPool,
        allocation_type: AllocationType,
    ) -> MemPool {
        let device = ctx.device();
        MemPool {
            handle: Arc::new(PoolHandle {
                ctx: ctx.clone(),
                raw: Handle::new(raw),
                destroy: false,
            }),
            ctx,
            kind: PoolKind::Borrowed,
            device,
            location: PoolLocation::Device(device),
            handle_types: HandleTypes::empty(),
            allocation_type,
        }
    }

    /// Another value for the same pool, sharing its handle: the pool is destroyed when the last value
    /// that shares it drops (an activation as the device's current pool holds one).
    pub(crate) fn share(&self) -> MemPool {
        MemPool {
            ctx: self.ctx.clone(),
            handle: self.handle.clone(),
            kind: self.kind,
            device: self.device,
            location: self.location,
            handle_types: self.handle_types,
            allocation_type: self.allocation_type,
        }
    }

    /// Imports a pool another process exported as a POSIX file descriptor
    /// (`cuMemPoolImportFromShareableHandle`). The descriptor stays the caller's to close.
    ///
    /// The imported pool can only import pointers ([`MemPool::import_pointer`]); it cannot allocate.
    pub fn import_fd(device: &Device, fd: BorrowedFd<'_>) -> Result<MemPool> {
        device.require_pools()?;
        let ctx = device.context()?;
        let _g = ctx.bind()?;
        let raw = raw::pool::import_fd(fd)?;
        Ok(MemPool {
            ctx: ctx.clone(),
            handle: PoolHandle::destroyed_on_drop(&ctx, raw),
            kind: PoolKind::Imported,
            device: *device,
            location: PoolLocation::Device(*device),
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
            allocation_type: AllocationType::Pinned,
        })
    }

    /// What this value stands for.
    pub fn kind(&self) -> PoolKind {
        self.kind
    }

    /// The device the pool was created or imported for.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Where the pool's memory lives.
    pub fn location(&self) -> PoolLocation {
        self.location
    }

    /// The kind of memory the pool hands out.
    pub fn allocation_type(&self) -> AllocationType {
        self.allocation_type
    }

    /// The handle types the pool was created with (empty for borrowed pools: unknown to this value).
    pub fn handle_types(&self) -> HandleTypes {
        self.handle_types
    }

    /// The context the pool's calls are made in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUmemoryPool`, valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawPool {
        self.handle.raw.get()
    }

    fn get_u64(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: the pool is live (owned or borrowed by `self`); the thresholds and counters are
        // `cuuint64_t`, which `v` is.
        #[allow(unsafe_code)]
        unsafe { raw::pool::get_attribute(self.as_raw(), attr, &mut v as *mut u64 as *mut c_void) }?;
        Ok(v)
    }

    fn set_u64(&self, attr: sys::CUmemPool_attribute, mut v: u64) -> Result<()> {
        // SAFETY: as in `get_u64`.
        #[allow(unsafe_code)]
        let r = unsafe { raw::pool::set_attribute(self.as_raw(), attr, &mut v as *mut u64 as *mut c_void) };
        Ok(r?)
    }

    /// Bytes the pool keeps reserved across synchronizations; memory above it goes back to the system at
    /// the next synchronize (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`). Default 0.
    pub fn release_threshold(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// Sets the release threshold. See the guide (docs/core.md) for which value suits which deployment.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes)
    }

    /// Never give memory back on synchronize (threshold `u64::MAX`): the right setting for a process
    /// that has the GPU to itself.
    pub fn keep_everything(&self) -> Result<()> {
        self.set_release_threshold(u64::MAX)
    }

    /// The reuse policy.
    pub fn reuse_policy(&self) -> Result<ReusePolicy> {
        let mut policy = ReusePolicy::empty();
        for (attr, flag) in REUSE_ATTRIBUTES {
            let mut v: i32 = 0;
            // SAFETY: the pool is live; the reuse attributes are `int`, which `v` is.
            #[allow(unsafe_code)]
            unsafe { raw::pool::get_attribute(self.as_raw(), attr, &mut v as *mut i32 as *mut c_void) }?;
            if v != 0 {
                policy |= flag;
            }
        }
        Ok(policy)
    }

    /// Sets the reuse policy: each flag on or off.
    pub fn set_reuse_policy(&self, policy: ReusePolicy) -> Result<()> {
        for (attr, flag) in REUSE_ATTRIBUTES {
            let mut v: i32 = policy.contains(flag) as i32;
            // SAFETY: as in `reuse_policy`.
            #[allow(unsafe_code)]
            unsafe { raw::pool::set_attribute(self.as_raw(), attr, &mut v as *mut i32 as *mut c_void) }?;
        }
        Ok(())
    }

    /// The pool's memory counters.
    pub fn usage(&self) -> Result<PoolUsage> {
        use sys::CUmemPool_attribute::*;
        Ok(PoolUsage {
            reserved_current: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Resets both high-water marks to the current values (the driver accepts only 0, which means that).
    pub fn reset_peaks(&self) -> Result<()> {
        use sys::CUmemPool_attribute::*;
        self.set_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        self.set_u64(CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// Releases reserved memory back to the system until at most `keep` bytes stay reserved, as far as
    /// unused memory allows (`cuMemPoolTrimTo`). Memory held by live allocations is never released.
    pub fn trim_to(&self, keep: usize) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live.
        #[allow(unsafe_code)]
        let r = unsafe { raw::pool::trim_to(self.as_raw(), keep) };
        Ok(r?)
    }

    /// `device`'s access to this pool's memory (`cuMemPoolGetAccess`).
    pub fn access(&self, device: &Device) -> Result<Access> {
        let loc = location_to_raw(PoolLocation::Device(*device));
        // SAFETY: the pool is live.
        #[allow(unsafe_code)]
        let flags = unsafe { raw::pool::get_access(self.as_raw(), &loc) }?;
        Ok(access_from_raw(flags))
    }

    /// Sets a peer device's access to the whole pool (`cuMemPoolSetAccess`). Pool memory ignores
    /// `cuCtxEnablePeerAccess`: this is the only way a peer gets at it.
    ///
    /// Refused with [`Error::PeerAccess`] before reaching the driver: changing the owning device's own
    /// access, and granting access to a device that cannot access the owner's memory.
    pub fn set_access(&self, peer: &Device, access: Access) -> Result<()> {
        if let PoolLocation::Device(owner) = self.location {
            if owner == *peer {
                return Err(Error::PeerAccess {
                    owner: owner.ordinal(),
                    peer: peer.ordinal(),
                    reason: PeerRefusal::OwningDevice,
                });
            }
            if access != Access::None && !peer.can_access_peer(owner)? {
                return Err(Error::PeerAccess {
                    owner: owner.ordinal(),
                    peer: peer.ordinal(),
                    reason: PeerRefusal::NoPeerCapability,
                });
            }
        }
        let desc = sys::CUmemAccessDesc {
            location: location_to_raw(PoolLocation::Device(*peer)),
            flags: access_to_raw(access),
        };
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live; one initialised descriptor.
        #[allow(unsafe_code)]
        let r = unsafe { raw::pool::set_access(self.as_raw(), &[desc]) };
        Ok(r?)
    }

    /// Grants `peer` read-write access to the pool.
    pub fn grant_access(&self, peer: &Device) -> Result<()> {
        self.set_access(peer, Access::ReadWrite)
    }

    /// Revokes `peer`'s access. Allocations already mapped for the peer become inaccessible to it.
    pub fn revoke_access(&self, peer: &Device) -> Result<()> {
        self.set_access(peer, Access::None)
    }

    pub(crate) fn require_allocating(&self, operation: &'static str) -> Result<()> {
        if self.kind == PoolKind::Imported {
            return Err(Error::PoolKind {
                operation,
                kind: "an imported pool",
                why: "the driver only lets an imported pool import pointers; allocate in the exporting process",
            });
        }
        Ok(())
    }

    /// Allocates `bytes` ordered on `stream` (`cuMemAllocFromPoolAsync`) and returns the raw pointer,
    /// which the caller frees with [`MemPool::free_async`]. 0 bytes returns a null pointer without a
    /// driver call. Prefer [`MemPool::alloc`], which frees on drop.
    ///
    /// Memory from `allocate(n, A)` may be used on `A` at once, and on another stream only after it is
    /// ordered after `A` (an event).
    pub fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        self.require_allocating("allocating")?;
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live and not imported (checked); the stream is live for its lifetime.
        #[allow(unsafe_code)]
        let ptr = unsafe { raw::pool::alloc_async(self.as_raw(), bytes, stream.as_raw()) }?;
        Ok(DeviceAddr(ptr))
    }

    /// Frees a pointer from [`MemPool::allocate`] (or any stream-ordered allocation) on `stream`
    /// (`cuMemFreeAsync`): the memory may be reused by work ordered after `stream`'s work so far. A null
    /// pointer is a no-op.
    ///
    /// # Safety
    /// 1. `ptr` came from a stream-ordered allocation of this pool's context and is freed once.
    /// 2. All work that uses `ptr` is ordered before this point of `stream` (same stream, or an event).
    #[allow(unsafe_code)]
    pub unsafe fn free_async(&self, ptr: DeviceAddr, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        let _g = self.ctx.bind()?;
        // SAFETY: points 1 and 2 are the caller's.
        let r = unsafe { raw::pool::free_async(ptr.0, stream.as_raw()) };
        Ok(r?)
    }

    /// Allocates an owning buffer ordered on `stream`; it is freed on `stream` when dropped.
    pub fn alloc<'s>(&self, bytes: usize, stream: StreamRef<'s>) -> Result<PoolBuffer<'s>> {
        let ptr = self.allocate(bytes, stream)?;
        // SAFETY: `ptr` is a fresh allocation of `bytes` bytes from this pool (device memory, reached by
        // unified addressing; null for 0 bytes), made on `stream`, and nothing else frees it: the buffer owns
        // it. A `stream` that carries no context is a stream of the pool's context or a special handle, by
        // `StreamRef::from_raw`'s contract (`allocate` itself binds the pool's context for it).
        #[allow(unsafe_code)]
        let buf = unsafe { PoolBuffer::from_parts(ptr, bytes, stream, self.ctx.clone()) };
        Ok(buf)
    }

    /// Exports the pool as a POSIX file descriptor for another process
    /// (`cuMemPoolExportToShareableHandle`). Send it over a Unix socket (mempool-ipc does).
    ///
    /// Only a pool created here with [`HandleTypes::POSIX_FILE_DESCRIPTOR`] can be exported; the default
    /// pool never can.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if self.kind != PoolKind::Owned || !self.handle_types.contains(HandleTypes::POSIX_FILE_DESCRIPTOR) {
            return Err(Error::PoolKind {
                operation: "exporting as a file descriptor",
                kind: match self.kind {
                    PoolKind::Owned => "a pool created without HandleTypes::POSIX_FILE_DESCRIPTOR",
                    PoolKind::Borrowed => "a default or current pool",
                    PoolKind::Imported => "an imported pool",
                },
                why: "only pools created with the POSIX file-descriptor handle type can be exported",
            });
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live.
        #[allow(unsafe_code)]
        let fd = unsafe { raw::pool::export_fd(self.as_raw()) }?;
        Ok(fd)
    }

    /// The 64 bytes through which another process that imported this pool imports `ptr`
    /// (`cuMemPoolExportPointer`). `ptr` must be the start of a live allocation of this pool; the driver
    /// rejects anything else.
    pub fn export_pointer(&self, ptr: DeviceAddr) -> Result<PtrExportData> {
        if self.kind != PoolKind::Owned {
            return Err(Error::PoolKind {
                operation: "exporting a pointer",
                kind: "a pool this process did not create",
                why: "pointers can only be exported from an exportable pool of this process",
            });
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the driver looks the address up and fails for one that is not a live allocation of an
        // exportable pool; nothing is dereferenced.
        #[allow(unsafe_code)]
        let data = unsafe { raw::pool::export_pointer(ptr.0) }?;
        Ok(PtrExportData(data))
    }

    /// Imports a pointer exported by the process this pool was imported from
    /// (`cuMemPoolImportPointer`).
    ///
    /// The driver's rules, which the caller (or mempool-ipc) must keep: do not touch the memory before the
    /// allocation has completed in the exporter (order it with an IPC event or a synchronize), and free
    /// it here (drop the [`ImportedPtr`]) before the exporter frees it.
    pub fn import_pointer(&self, data: &PtrExportData) -> Result<ImportedPtr> {
        if self.kind != PoolKind::Imported {
            return Err(Error::PoolKind {
                operation: "importing a pointer",
                kind: "a pool that was not imported",
                why: "pointers are imported through the pool imported from the exporting process",
            });
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live and imported; the data is opaque bytes the driver validates.
        #[allow(unsafe_code)]
        let ptr = unsafe { raw::pool::import_pointer(self.as_raw(), &data.0) }?;
        Ok(ImportedPtr {
            ptr: DeviceAddr(ptr),
            ctx: self.ctx.clone(),
        })
    }
}

/// The pool handle every value for one pool shares ([`MemPool::share`]): the last one to drop destroys an
/// owned or imported pool.
#[derive(Debug)]
struct PoolHandle {
    ctx: Arc<Context>,
    raw: Handle<sys::CUmemPoolHandle_st>,
    /// False for a default pool, which is never destroyed.
    destroy: bool,
}

impl PoolHandle {
    /// The handle of a pool this process created or imported, destroyed when the last share drops.
    fn destroyed_on_drop(ctx: &Arc<Context>, raw: sys::CUmemoryPool) -> Arc<PoolHandle> {
        Arc::new(PoolHandle {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            destroy: true,
        })
    }
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        if !self.destroy {
            return;
        }
        // Let queued frees complete first. The driver allows destroying a pool with frees pending, but
        // on H100/H200 with driver 580 doing so while other threads kept streams busy crashed or hung the
        // driver (seen through mempool-rmm's conformance suite); a pool's drop is rare enough to wait.
        if let Err(e) = self.ctx.synchronize() {
            crate::drop_errors::record(e);
        }
        // SAFETY: owned or imported pools are destroyed exactly once, here, when the last value sharing
        // the handle drops. None of them is a device's current pool through mempool: every activation
        // (`crate::current`) holds a share until another pool has been made current in its place.
        // Outstanding allocations are allowed: the driver releases the pool once they are freed.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::pool::destroy(self.raw.get(), self.ctx.as_raw() as _) } {
            crate::drop_errors::record(e.into());
        }
    }
}

impl Device {
    /// The device's default pool (what `cuMemAllocAsync` uses unless the current pool was changed).
    /// It cannot be exported; dropping the returned value does not destroy it.
    pub fn default_pool(&self) -> Result<MemPool> {
        self.require_pools()?;
        MemPool::default_of(self.context()?)
    }

    /// The device's default pool of managed memory (`cuMemGetDefaultMemPool` with a device location and
    /// `CU_MEM_ALLOCATION_TYPE_MANAGED`, CUDA 13.0): managed memory whose preferred location is this
    /// device, allocated in stream order. Process-wide, like the default pool: dropping the returned value
    /// does not destroy it, and nothing here changes its attributes.
    ///
    /// Errors: [`Error::CapabilityMissing`] without a driver for CUDA 13.0 or without concurrent managed
    /// access, checked before the driver is asked.
    pub fn default_managed_pool(&self) -> Result<MemPool> {
        self.require_managed_pools()?;
        MemPool::default_managed_of(self.context()?)
    }
}

/// A pointer imported from another process. Dropping it waits for all work in its context and frees it
/// (`cuMemFree`), so the importer's free completes before the exporter may free; [`ImportedPtr::free`]
/// does the same for one stream only.
#[derive(Debug)]
pub struct ImportedPtr {
    ptr: DeviceAddr,
    ctx: Arc<Context>,
}

impl ImportedPtr {
    /// The device address.
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Frees the pointer after the work queued on `stream`, and waits for that free to complete, so the
    /// exporter may free its allocation once this returns. All use of the pointer must be ordered before
    /// this point of `stream`.
    pub fn free(mut self, stream: StreamRef<'_>) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, DeviceAddr::NULL);
        let _g = self.ctx.bind()?;
        // SAFETY: the pointer was imported and is freed once: `self.ptr` is now null, so drop skips it.
        // The caller orders all uses before this point of `stream`.
        #[allow(unsafe_code)]
        unsafe { raw::pool::free_async(ptr.0, stream.as_raw()) }?;
        stream.synchronize()
    }
}

impl Drop for ImportedPtr {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let r = self.ctx.bind().and_then(|_g| {
            raw::context::synchronize()?;
            // SAFETY: all work in the context is complete, so nothing uses the pointer; freed once.
            #[allow(unsafe_code)]
            let r = unsafe { raw::memory::free(self.ptr.0) };
            Ok(r?)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_match_the_driver_enums() {
        assert_eq!(
            HandleTypes::POSIX_FILE_DESCRIPTOR.bits(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0
        );
        assert_eq!(
            HandleTypes::FABRIC.bits(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0
        );
        assert_eq!(
            HandleTypes::WIN32_KMT.bits(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32_KMT.0
        );
        for a in [Access::None, Access::Read, Access::ReadWrite] {
            assert_eq!(access_from_raw(access_to_raw(a)), a);
        }
    }

    #[test]
    fn allocation_types_convert_to_the_driver_form() {
        assert_eq!(
            allocation_type_to_raw(AllocationType::Pinned),
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        );
        assert_eq!(
            allocation_type_to_raw(AllocationType::Managed),
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED
        );
        assert_eq!(allocation_type_to_raw(AllocationType::Managed) as u32, 2);
    }

    #[test]
    fn locations_convert_to_the_driver_form() {
        assert_eq!(
            location_to_raw(PoolLocation::Host).type_,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        );
        let numa = location_to_raw(PoolLocation::HostNuma(3));
        assert_eq!(numa.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA);
        assert_eq!(numa.id, 3);
        let dev = location_to_raw(PoolLocation::Device(Device::from_parts(1, 1)));
        assert_eq!(dev.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(dev.id, 1);
    }
}
