//! The crate's plain value types: addresses, devices by ordinal, driver versions and failures, and the
//! pool settings. Plain data only: nothing here calls the driver or imports another module of the crate,
//! so every other module (the raw layer, the errors, the safe types) can build on it without a cycle.
//! Conversions to the driver's enums live next to the calls that need them (in `pool`).

use std::fmt;

use cudarc::driver::sys;

/// The driver's stream handle (`CUstream`), as [`Stream::as_raw`](crate::Stream::as_raw) returns and [`StreamRef::from_raw`](crate::StreamRef::from_raw)
/// takes it: a C API's `cudaStream_t`, PyTorch's `cuda_stream`, an integer cast with `as RawStream`.
pub type RawStream = cudarc::driver::sys::CUstream;
/// The driver's context handle (`CUcontext`), as [`Context::as_raw`](crate::Context::as_raw) returns it.
pub type RawContext = cudarc::driver::sys::CUcontext;
/// The driver's event handle (`CUevent`), as [`Event::as_raw`](crate::Event::as_raw) returns it.
pub type RawEvent = cudarc::driver::sys::CUevent;
/// The driver's pool handle (`CUmemoryPool`, the runtime's `cudaMemPool_t`), as [`MemPool::as_raw`](crate::MemPool::as_raw) and
/// [`memory::pool_of`](crate::memory::pool_of) return it.
pub type RawPool = cudarc::driver::sys::CUmemoryPool;
/// The driver's device handle (`CUdevice`, an `int`), as [`Device::as_raw`](crate::Device::as_raw) returns it.
pub type RawDevice = cudarc::driver::sys::CUdevice;
/// The driver's physical allocation handle (`CUmemGenericAllocationHandle`), as
/// [`PhysicalAllocation::as_raw`](crate::PhysicalAllocation::as_raw) returns it.
pub type RawAllocationHandle = cudarc::driver::sys::CUmemGenericAllocationHandle;

/// A stream's identity: what per-stream bookkeeping is keyed by (a suballocator's free lists, the stream an
/// allocation was made on), as [`StreamRef::key`](crate::StreamRef::key) resolves it. Two ids are equal
/// exactly when they name the same stream.
///
/// It is the driver's id of the stream (`cuStreamGetId`, CUDA 12.0), unique for the life of the process,
/// not the handle: the per-thread default stream has one handle (`CU_STREAM_PER_THREAD`, 2) that names a
/// different stream on each thread, and a stream created after another was destroyed may get the dead
/// one's handle. On a driver without `cuStreamGetId`, mempool makes its own ids (the values with the top
/// bit set, which no driver id reaches): the handle of a created stream, one per thread for the per-thread
/// default stream, one for the legacy default stream.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

impl StreamId {
    /// The id as a number (for logs and displays; compare ids, not numbers).
    pub const fn get(self) -> u64 {
        self.0
    }

    /// An id with this value: for tests and simulations that run without a driver. Equal values are the
    /// same stream, so a value must stand for one stream only.
    pub const fn from_value(value: u64) -> StreamId {
        StreamId(value)
    }
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamId({:#x})", self.0)
    }
}

/// A device address (`CUdeviceptr`). Plain data: holding one grants nothing; the types that own memory
/// ([`crate::PoolBuffer`], resources in mempool-rmm) decide when it is valid, and freeing one is `unsafe`.
///
/// Named `DeviceAddr`, not `DevicePtr`, so that it never collides with cudarc's `DevicePtr` trait in code
/// that uses both crates.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DeviceAddr(pub u64);

impl DeviceAddr {
    /// The null address, returned for 0-byte allocations.
    pub const NULL: DeviceAddr = DeviceAddr(0);

    /// Whether this is the null address.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DeviceAddr {
        DeviceAddr(self.0 + bytes as u64)
    }

    /// The raw value.
    pub fn as_raw(self) -> u64 {
        self.0
    }
}

impl fmt::Display for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A CUDA device, by ordinal. Cheap to copy; it holds no driver resources.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::Device;
/// for dev in Device::all()? {
///     println!("{}: {} ({} MiB), pools: {}", dev.ordinal(), dev.name()?,
///              dev.total_memory()? >> 20, dev.supports_memory_pools()?);
/// }
/// # Ok(()) }
/// ```
// The queries (`Device::get`, `name`, `context`, ...) are implemented in `device`, the pool accessors
// (`default_pool`, `current_pool`) in `pool`: this module stays plain data.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
}

impl Device {
    /// A device value from its ordinal and the handle `cuDeviceGet` returned for it. Only `Device::get`
    /// (in `device`) makes one, after checking the ordinal.
    pub(crate) fn from_parts(ordinal: usize, raw: sys::CUdevice) -> Device {
        Device { ordinal, raw }
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn as_raw(&self) -> RawDevice {
        self.raw
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.ordinal)
    }
}

/// A device's 16-byte UUID, as `cuDeviceGetUuid` reports it. Displays as `nvidia-smi -L` does
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uuid(pub [u8; 16]);

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, byte) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// Free and total memory of a device, in bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free.
    pub free: usize,
    /// Bytes in total.
    pub total: usize,
}

/// A CUDA driver version as `cuDriverGetVersion` reports it: `1000 * major + 10 * minor`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// The major version (13 for CUDA 13.0).
    pub fn major(self) -> i32 {
        self.0 / 1000
    }
    /// The minor version (0 for CUDA 13.0).
    pub fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// A `CUresult` other than `CUDA_SUCCESS`, with its name and the driver's description.
///
/// A newtype rather than the raw enum so that the name and message travel with the error even after the
/// driver is gone, and so that equality and display do not need the driver.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DriverError {
    /// The raw `CUresult` value.
    pub code: u32,
    /// The enumerator's name, e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub name: String,
    /// The driver's description (`cuGetErrorString`), or a short fallback where the driver gave none.
    pub message: String,
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.message)
    }
}

/// Why a peer-access request was refused before reaching the driver.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PeerRefusal {
    /// The device owns the pool: the driver does not let its access be changed.
    OwningDevice,
    /// `cuDeviceCanAccessPeer` says the peer cannot map the owner's memory.
    NoPeerCapability,
}

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

/// What kind of memory a pool hands out (`CUmemAllocationType`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum AllocationType {
    /// Page-locked memory at the pool's location (`CU_MEM_ALLOCATION_TYPE_PINNED`): device memory for a
    /// device pool, pinned host memory for a host pool. What every pool held before CUDA 13.0.
    #[default]
    Pinned,
    /// Managed (unified) memory, migrated between host and devices on demand
    /// (`CU_MEM_ALLOCATION_TYPE_MANAGED`); the pool's location is the memory's preferred location. Needs a
    /// driver for CUDA 13.0 or newer and a device with concurrent managed access
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`); such a pool cannot be exported and takes no
    /// maximum size.
    Managed,
}

/// Properties of a new pool (`CUmemPoolProps`).
///
/// Named `Props`, not `Options` (the workspace's word for a struct of settings), because it mirrors the
/// driver's `CUmemPoolProps` field for field.
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
    /// The kind of memory: pinned (the default) or managed.
    pub allocation_type: AllocationType,
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
    /// Sets the kind of memory.
    pub fn allocation_type(mut self, allocation_type: AllocationType) -> PoolProps {
        self.allocation_type = allocation_type;
        self
    }
}

/// A pool's memory counters, in bytes (`CU_MEMPOOL_ATTR_{RESERVED,USED}_MEM_{CURRENT,HIGH}`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Memory the pool holds from the system now.
    pub reserved_current: u64,
    /// The most it has held since creation or the last [`crate::MemPool::reset_peaks`].
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

/// The 64 opaque bytes through which another process imports one allocation of an exported pool
/// (`CUmemPoolPtrExportData`). Not a capability: the socket that carries it is the gate.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PtrExportData(pub [u8; 64]);

/// What a [`crate::MemPool`] value stands for, which decides what it may do and whether drop destroys it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Created by [`crate::MemPool::new`]; destroyed on drop.
    Owned,
    /// A pool this value does not own: the device's default pool, or its current pool. Never destroyed.
    Borrowed,
    /// Imported from another process ([`crate::MemPool::import_fd`]): it cannot allocate or become
    /// current, only import pointers. Destroyed (released) on drop.
    Imported,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_displays_like_nvidia_smi() {
        let u = Uuid([0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(u.to_string(), "GPU-12345678-9abc-def0-0102-030405060708");
    }

    #[test]
    fn props_builder() {
        let p = PoolProps::new()
            .handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)
            .max_size(4096);
        assert_eq!(p.handle_types, HandleTypes::POSIX_FILE_DESCRIPTOR);
        assert_eq!(p.max_size, Some(4096));
        assert_eq!(p.location, None);
        assert_eq!(p.allocation_type, AllocationType::Pinned, "pinned unless asked");
        assert_eq!(
            PoolProps::new()
                .allocation_type(AllocationType::Managed)
                .allocation_type,
            AllocationType::Managed
        );
    }

    #[test]
    fn addresses_and_versions_display() {
        assert_eq!(DeviceAddr(0x1000).offset(16).to_string(), "0x1010");
        assert!(DeviceAddr::NULL.is_null());
        assert_eq!(DriverVersion(12080).to_string(), "12.8");
        assert_eq!(Device::from_parts(2, 2).to_string(), "device 2");
    }
}
