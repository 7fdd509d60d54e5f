//! The crate's error type.
//!
//! Every failure a user can hit names its cause: a missing driver, a driver too old for a call, a device
//! without pool or IPC support, out of memory (with the size asked for), a peer that cannot access, or a
//! driver call that failed (with the call, the `CUresult` name and the driver's message).

use std::fmt;

use crate::pool::HandleTypes;

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

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

/// Everything that can go wrong in mempool-core.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda.so` could not be loaded: no NVIDIA driver is installed or it is not on the loader path.
    #[error(
        "no CUDA driver found: libcuda.so could not be loaded (is the NVIDIA driver installed and on the \
         library path?)"
    )]
    DriverNotFound,

    /// The installed driver lacks an entry point this call needs.
    #[error(
        "the installed CUDA driver ({driver}) does not provide `{call}`{}",
        match required { Some(v) => format!("; it needs a driver for CUDA {v} or newer"), None => String::new() }
    )]
    DriverTooOld {
        /// The driver entry point that is missing.
        call: &'static str,
        /// The installed driver's version, if it could be read.
        driver: DriverVersion,
        /// The first CUDA version whose driver has the call, where known.
        required: Option<DriverVersion>,
    },

    /// The driver is installed but sees no CUDA device.
    #[error("the CUDA driver found no device (CUDA_ERROR_NO_DEVICE): is a GPU visible to this process?")]
    NoDevice,

    /// A device ordinal past the number of devices.
    #[error("CUDA device {ordinal} does not exist: {count} device(s) are visible")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },

    /// The device does not support stream-ordered memory pools (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`).
    #[error("device {device} does not support stream-ordered memory pools")]
    PoolsNotSupported {
        /// The device ordinal.
        device: usize,
    },

    /// The device cannot create pools exportable with the requested handle types.
    #[error(
        "device {device} cannot create pools exportable as {requested:?}: it supports {supported:?} \
         (CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)"
    )]
    HandleTypeNotSupported {
        /// The device ordinal.
        device: usize,
        /// What was asked for.
        requested: HandleTypes,
        /// What the device supports.
        supported: HandleTypes,
    },

    /// A peer-access change was refused because the driver would refuse it.
    #[error("{}", match reason {
        PeerRefusal::OwningDevice => format!(
            "device {peer} owns the pool: the driver does not allow its own access to be changed"),
        PeerRefusal::NoPeerCapability => format!(
            "device {peer} cannot access memory of device {owner}: cuDeviceCanAccessPeer reports no peer capability"),
    })]
    PeerAccess {
        /// The device owning the pool.
        owner: usize,
        /// The device whose access was to change.
        peer: usize,
        /// Why it was refused.
        reason: PeerRefusal,
    },

    /// An operation the pool's kind does not allow (an imported pool allocating, the default pool exported).
    #[error("{operation} is not possible on {kind}: {why}")]
    PoolKind {
        /// What was attempted.
        operation: &'static str,
        /// The pool's kind, in words.
        kind: &'static str,
        /// The driver rule behind the refusal.
        why: &'static str,
    },

    /// The device ran out of memory. Users may trim a pool and retry.
    #[error("out of memory: {call} could not allocate {requested} bytes")]
    OutOfMemory {
        /// The allocating call.
        call: &'static str,
        /// The number of bytes asked for.
        requested: usize,
    },

    /// A driver call failed.
    #[error("{call} failed: {error}")]
    Driver {
        /// The driver entry point.
        call: &'static str,
        /// The `CUresult`, its name and its message.
        error: DriverError,
    },

    /// An argument the driver would reject, caught before the call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// True for [`Error::OutOfMemory`], the error a caller may recover from by freeing or trimming.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }

    /// The `CUresult` behind a driver failure, if this is one.
    pub fn driver_error(&self) -> Option<&DriverError> {
        match self {
            Error::Driver { error, .. } => Some(error),
            _ => None,
        }
    }
}
