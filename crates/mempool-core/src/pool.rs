//! Stream-ordered memory pools (`cuMemPool*`): creation, attributes, trimming, peer access, the device's
//! current pool, allocation, and the raw IPC primitives (pool and pointer export and import).
//!
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::buffer::{DeviceAddr, PoolBuffer};
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, PeerRefusal, Result};
use crate::handle::Handle;
use crate::raw::{self, sys};
use crate::stream::StreamRef;

bitflags::bitflags! {
    /// The handle types a pool can be exported as (`CUmemAllocationHandleType`).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct HandleTypes: u32 {
        /// A POSIX file descriptor, passed to another process over a Unix socket.
        const POSIX_FILE_DESCRIPTOR = 0x1;
        /// A Win32 NT handle.
        const WIN32 = 0x2;
        /// A Win32 KMT handle.
        const WIN32_KMT = 0x4;
        /// A fabric handle (multi-node NVLink).
        const FABRIC = 0x8;
    }
}

bitflags::bitflags! {
    /// When the pool may reuse memory freed on one stream for an allocation on another
    /// (`CU_MEMPOOL_ATTR_REUSE_*`). All three are on by default.
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct ReusePolicy: u32 {
        /// Reuse when the allocating stream already waits (through events) on the free.
        const FOLLOW_EVENT_DEPENDENCIES = 0x1;
        /// Reuse memory whose free has completed, without a dependency.
        const ALLOW_OPPORTUNISTIC = 0x2;
        /// Reuse by inserting dependencies the driver chooses.
        const ALLOW_INTERNAL_DEPENDENCIES = 0x4;
    }
}

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

/// Where a pool's memory lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PoolLocation {
    /// Memory of this device.
    Device(Device),
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST`; needs a driver for CUDA 13.0 or newer, and a device
    /// that supports host pools).
    Host,
    /// Host memory of one NUMA node (`CU_MEM_LOCATION_TYPE_HOST_NUMA`, CUDA 12.6 and newer).
    HostNuma(i32),
}

impl PoolLocation {
    fn to_raw(self) -> sys::CUmemLocation {
        use sys::CUmemLocationType::*;
        let (type_, id) = match self {
            PoolLocation::Device(d) => (CU_MEM_LOCATION_TYPE_DEVICE, d.as_raw()),
            PoolLocation::Host => (CU_MEM_LOCATION_TYPE_HOST, 0),
            PoolLocation::HostNuma(node) => (CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
        };
        sys::CUmemLocation { type_, id }
    }
}

/// Properties of a new pool (`CUmemPoolProps`).
///
/// ```
/// use mempool_core::{HandleTypes, PoolProps};
/// let props = PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).max_size(1 << 30);
/// assert_eq!(props.max_size, Some(1 << 30));
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolProps {
    /// Where the memory lives; `None` means the device the pool is created for.
    pub location: Option<PoolLocation>,
    /// How the pool may be exported; empty means not at all. Only a pool created with
    /// `POSIX_FILE_DESCRIPTOR` can be shared with another process.
    pub handle_types: HandleTypes,
    /// The most the pool may reserve, in bytes (rounded up by the driver); `None` means no limit.
    pub max_size: Option<usize>,
}

impl PoolProps {
    /// Default properties: device memory, not exportable, no size limit.
    pub fn new() -> PoolProps {
        PoolProps::default()
    }
    /// Sets the export handle types.
    pub fn handle_types(mut self, handle_types: HandleTypes) -> PoolProps {
        self.handle_types = handle_types;
        self
    }
    /// Sets the maximum size in bytes.
    pub fn max_size(mut self, bytes: usize) -> PoolProps {
        self.max_size = Some(bytes);
        self
    }
    /// Sets the location.
    pub fn location(mut self, location: PoolLocation) -> PoolProps {
        self.location = Some(location);
        self
    }
}

/// A pool's memory counters, in bytes (`CU_MEMPOOL_ATTR_{RESERVED,USED}_MEM_{CURRENT,HIGH}`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Memory the pool holds from the system now.
    pub reserved_current: u64,
    /// The most it has held since creation or the last [`MemPool::reset_peaks`].
    pub reserved_high: u64,
    /// Memory handed out to allocations now.
    pub used_current: u64,
    /// The most handed out since creation or the last reset.
    pub used_high: u64,
}

/// A device's access to a pool's memory (`CUmemAccess_flags`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// No access: touching the memory faults.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Access {
    fn to_raw(self) -> sys::CUmemAccess_flags {
        use sys::CUmemAccess_flags::*;
        match self {
            Access::None => CU_MEM_ACCESS_FLAGS_PROT_NONE,
            Access::Read => CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
    fn from_raw(flags: sys::CUmemAccess_flags) -> Access {
        use sys::CUmemAccess_flags::*;
        match flags {
            CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
            _ => Access::None,
        }
    }
}

/// The 64 opaque bytes through which another process imports one allocation of an exported pool
/// (`CUmemPoolPtrExportData`). Not a capability: the socket that carries it is the gate.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PtrExportData(pub [u8; 64]);

/// What a [`MemPool`] value stands for, which decides what it may do and whether drop destroys it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Created by [`MemPool::new`]; destroyed on drop.
    Owned,
    /// A pool this value does not own: the device's default pool, or its current pool. Never destroyed.
    Borrowed,
    /// Imported from another process ([`MemPool::import_fd`]): it cannot allocate or become current, only
    /// import pointers. Destroyed (released) on drop.
    Imported,
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
    raw: Handle<sys::CUmemPoolHandle_st>,
    kind: PoolKind,
    /// The device whose context the pool's calls are made in: the pool's own device, or for a host pool
    /// the device it was created for.
    device: Device,
    location: PoolLocation,
    handle_types: HandleTypes,
}

impl MemPool {
    /// Creates a pool for `device` with `props` (`cuMemPoolCreate`).
    ///
    /// Errors: [`Error::PoolsNotSupported`] on a device without pools; [`Error::HandleTypeNotSupported`]
    /// when the device cannot export pools as asked.
    pub fn new(device: &Device, props: &PoolProps) -> Result<MemPool> {
        device.require_pools()?;
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
        raw_props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        raw_props.handleTypes = sys::CUmemAllocationHandleType(props.handle_types.bits());
        raw_props.location = location.to_raw();
        raw_props.maxSize = props.max_size.unwrap_or(0);
        let _g = ctx.bind()?;
        let raw = raw::pool::create(&raw_props)?;
        Ok(MemPool {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
            kind: PoolKind::Owned,
            device: *device,
            location,
            handle_types: props.handle_types,
        })
    }

    pub(crate) fn default_of(ctx: Arc<Context>) -> Result<MemPool> {
        let device = ctx.device();
        let raw = raw::pool::device_default(device.as_raw())?;
        Ok(MemPool::borrowed(ctx, raw))
    }

    pub(crate) fn current_of(ctx: Arc<Context>) -> Result<MemPool> {
        let device = ctx.device();
        let raw = raw::pool::device_current(device.as_raw())?;
        Ok(MemPool::borrowed(ctx, raw))
    }

    fn borrowed(ctx: Arc<Context>, raw: sys::CUmemoryPool) -> MemPool {
        let device = ctx.device();
        MemPool {
            ctx,
            raw: Handle::new(raw),
            kind: PoolKind::Borrowed,
            device,
            location: PoolLocation::Device(device),
            handle_types: HandleTypes::empty(),
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
            raw: Handle::new(raw),
            kind: PoolKind::Imported,
            device: *device,
            location: PoolLocation::Device(*device),
            handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
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

    /// The handle types the pool was created with (empty for borrowed pools: unknown to this value).
    pub fn handle_types(&self) -> HandleTypes {
        self.handle_types
    }

    /// The context the pool's calls are made in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUmemoryPool`, valid while `self` lives.
    pub fn as_raw(&self) -> sys::CUmemoryPool {
        self.raw.get()
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
        unsafe {
            raw::pool::set_attribute(self.as_raw(), attr, &mut v as *mut u64 as *mut c_void)
        }
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
        unsafe {
            raw::pool::trim_to(self.as_raw(), keep)
        }
    }

    /// `device`'s access to this pool's memory (`cuMemPoolGetAccess`).
    pub fn access(&self, device: &Device) -> Result<Access> {
        let loc = PoolLocation::Device(*device).to_raw();
        // SAFETY: the pool is live.
        #[allow(unsafe_code)]
        unsafe { raw::pool::get_access(self.as_raw(), &loc) }.map(Access::from_raw)
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
            location: PoolLocation::Device(*peer).to_raw(),
            flags: access.to_raw(),
        };
        let _g = self.ctx.bind()?;
        // SAFETY: the pool is live; one initialised descriptor.
        #[allow(unsafe_code)]
        unsafe {
            raw::pool::set_access(self.as_raw(), &[desc])
        }
    }

    /// Grants `peer` read-write access to the pool.
    pub fn grant_access(&self, peer: &Device) -> Result<()> {
        self.set_access(peer, Access::ReadWrite)
    }

    /// Revokes `peer`'s access. Allocations already mapped for the peer become inaccessible to it.
    pub fn revoke_access(&self, peer: &Device) -> Result<()> {
        self.set_access(peer, Access::None)
    }

    fn require_allocating(&self, operation: &'static str) -> Result<()> {
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
        unsafe { raw::pool::alloc_async(self.as_raw(), bytes, stream.as_raw()) }.map(DeviceAddr)
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
        unsafe { raw::pool::free_async(ptr.0, stream.as_raw()) }
    }

    /// Allocates an owning buffer ordered on `stream`; it is freed on `stream` when dropped.
    pub fn alloc<'s>(&self, bytes: usize, stream: StreamRef<'s>) -> Result<PoolBuffer<'s>> {
        let ptr = self.allocate(bytes, stream)?;
        Ok(PoolBuffer::from_parts(ptr, bytes, stream, self.ctx.clone()))
    }

    /// Makes this pool the device's current pool (what `cudaMallocAsync` and `cuMemAllocAsync` use) until
    /// the guard drops, which restores the previous one. The current pool is process-wide: this is the
    /// explicit, scoped way to change it.
    pub fn make_current(&self) -> Result<CurrentPoolGuard<'_>> {
        self.require_allocating("making current")?;
        let PoolLocation::Device(device) = self.location else {
            return Err(Error::PoolKind {
                operation: "making current",
                kind: "a host pool",
                why: "a device's current pool must be located on that device",
            });
        };
        let previous = raw::pool::device_current(device.as_raw())?;
        // SAFETY: the pool is live and located on `device`; the guard borrows `self`, so it stays live
        // until the guard restores the previous pool.
        #[allow(unsafe_code)]
        unsafe { raw::pool::set_device_current(device.as_raw(), self.as_raw()) }?;
        Ok(CurrentPoolGuard {
            device,
            previous: Handle::new(previous),
            _pool: self,
        })
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
        unsafe {
            raw::pool::export_fd(self.as_raw())
        }
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
        unsafe { raw::pool::export_pointer(ptr.0) }.map(PtrExportData)
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

impl Drop for MemPool {
    fn drop(&mut self) {
        if self.kind == PoolKind::Borrowed {
            return;
        }
        // Let queued frees complete first. The driver allows destroying a pool with frees pending, but
        // on H100/H200 with driver 580 doing so while other threads kept streams busy crashed or hung the
        // driver (seen through mempool-rmm's conformance suite); a pool's drop is rare enough to wait.
        if let Err(e) = self.ctx.synchronize() {
            crate::record_drop_error(e);
        }
        // SAFETY: owned or imported pools are destroyed exactly once, here. Outstanding allocations are
        // allowed: the driver releases the pool once they are freed.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::pool::destroy(self.as_raw()) } {
            crate::record_drop_error(e);
        }
    }
}

/// Restores a device's previous current pool when dropped. See [`MemPool::make_current`].
#[must_use = "the pool is only current while the guard lives"]
#[derive(Debug)]
pub struct CurrentPoolGuard<'p> {
    device: Device,
    previous: Handle<sys::CUmemPoolHandle_st>,
    _pool: &'p MemPool,
}

impl Drop for CurrentPoolGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `previous` was the device's current pool, which the application keeps alive (the
        // default pool always is); restoring it undoes our change.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { raw::pool::set_device_current(self.device.as_raw(), self.previous.get()) } {
            crate::record_drop_error(e);
        }
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
            unsafe {
                raw::memory::free(self.ptr.0)
            }
        });
        if let Err(e) = r {
            crate::record_drop_error(e);
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
            assert_eq!(Access::from_raw(a.to_raw()), a);
        }
    }

    #[test]
    fn props_builder() {
        let p = PoolProps::new()
            .handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)
            .max_size(4096);
        assert_eq!(p.handle_types, HandleTypes::POSIX_FILE_DESCRIPTOR);
        assert_eq!(p.max_size, Some(4096));
        assert_eq!(p.location, None);
        assert_eq!(
            PoolLocation::Host.to_raw().type_,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        );
    }
}
