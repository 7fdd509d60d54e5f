//! The crate's error type.
//!
//! Every failure a user can hit names its cause: a missing driver, a driver too old for a call, a device
//! without pool or IPC support, out of memory (with the size asked for), a peer that cannot access, or a
//! driver call that failed (with the call, the `CUresult` name and the driver's message).
//!
//! The raw layer reports its own `DriverFailure`; [`Error`] converts it with `From`, so `?` on a raw call
//! gives the variant below that names the cause.

use crate::raw::{DriverFailure, FailureKind};
use crate::types::{DriverError, DriverVersion, HandleTypes, PeerRefusal};

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

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

    /// The device or the driver lacks a capability the operation needs. Checked up front, from device
    /// attributes and the driver's version, before the driver is asked.
    #[error("device {device} cannot {operation}: {missing}")]
    CapabilityMissing {
        /// The device ordinal.
        device: usize,
        /// What was attempted, e.g. `create a pool of managed memory`.
        operation: &'static str,
        /// The capability that is missing, naming the device attribute or driver version that says so.
        missing: String,
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

    /// The device cannot make physical allocations (`cuMemCreate`) exportable as the requested handle
    /// types. Fabric handles in particular exist only on devices of a multi-node NVLink system.
    #[error(
        "device {device} cannot create physical allocations exportable as {requested:?}: it supports \
         {supported:?} (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, \
         CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)"
    )]
    VmmHandleTypeNotSupported {
        /// The device ordinal.
        device: usize,
        /// What was asked for.
        requested: HandleTypes,
        /// What the device supports for `cuMemCreate` allocations.
        supported: HandleTypes,
    },

    /// A physical allocation asked to export itself as a handle type it was not created with (for an
    /// imported or retained handle: that the driver does not report for it; driver 580 reports none for
    /// an imported handle). Not a device limitation: create the allocation with
    /// `AllocationProps::handle_types` including the type.
    #[error(
        "this physical allocation of device {device} cannot be exported as {requested:?}: it was created \
         with (or, imported or retained, the driver reports for it) handle types {created_with:?}; create \
         it with AllocationProps::handle_types including {requested:?}"
    )]
    AllocationNotExportable {
        /// The device ordinal.
        device: usize,
        /// The handle type asked for.
        requested: HandleTypes,
        /// The handle types the allocation has.
        created_with: HandleTypes,
    },

    /// A destructor could not undo a virtual memory step safely and kept the resource instead (on
    /// purpose: e.g. a mapping whose unmap failed stays mapped, with its physical memory and its address
    /// range, rather than have the range freed or reused under it). Reported by [`crate::take_drop_errors`].
    #[error("{what} was leaked on purpose: {cause}")]
    Leaked {
        /// What was kept, e.g. `the mapping of 2097152 bytes at 0x7f0000000000`.
        what: String,
        /// Why it could not be released.
        cause: String,
    },

    /// A size, offset or alignment of a virtual memory call that is not a multiple of the allocation
    /// granularity (`cuMemGetAllocationGranularity`), or is zero where the driver needs bytes.
    #[error(
        "{what} is {value} bytes: it must be a non-zero multiple of the allocation granularity, {granularity} bytes"
    )]
    NotGranular {
        /// What the value is, e.g. `the physical allocation's size`.
        what: &'static str,
        /// The value given.
        value: usize,
        /// The granularity it must be a multiple of.
        granularity: usize,
    },

    /// A virtual address reservation has no room for what was asked.
    #[error("the reservation of {capacity} bytes cannot hold {requested} bytes{}", if *offset > 0 { format!(" at offset {offset}") } else { String::new() })]
    ReservationFull {
        /// Bytes asked for.
        requested: usize,
        /// Where in the reservation they would start.
        offset: usize,
        /// The reservation's size.
        capacity: usize,
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

    /// A cudarc context (feature `cudarc`) that is not its device's primary context: mempool's
    /// [`crate::Context`] is the primary context, so a stream or context of another one cannot become a
    /// mempool [`crate::Stream`] or [`crate::Context`].
    #[error(
        "the cudarc context on device {ordinal} is not the device's primary context: mempool works in \
         primary contexts only (make the context with CudaContext::new)"
    )]
    NotPrimaryContext {
        /// The device ordinal of the cudarc context.
        ordinal: usize,
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

impl From<DriverFailure> for Error {
    /// The public form of a failed driver call: a missing library is [`Error::DriverNotFound`], a missing
    /// entry point [`Error::DriverTooOld`], `cuInit`'s `CUDA_ERROR_NO_DEVICE` [`Error::NoDevice`], an
    /// allocation out of memory [`Error::OutOfMemory`], and any other `CUresult` [`Error::Driver`].
    fn from(failure: DriverFailure) -> Error {
        let DriverFailure { call, kind } = failure;
        match kind {
            FailureKind::LibraryMissing => Error::DriverNotFound,
            FailureKind::SymbolMissing { driver, required } => Error::DriverTooOld { call, driver, required },
            FailureKind::NoDevice => Error::NoDevice,
            FailureKind::OutOfMemory { requested } => Error::OutOfMemory { call, requested },
            FailureKind::Driver(error) => Error::Driver { call, error },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::{check, check_alloc, first_driver_with, sys};

    fn failure(call: &'static str, kind: FailureKind) -> Error {
        Error::from(DriverFailure { call, kind })
    }

    #[test]
    fn a_missing_library_is_driver_not_found() {
        let e = failure("cuInit", FailureKind::LibraryMissing);
        assert_eq!(e, Error::DriverNotFound);
        assert_eq!(
            e.to_string(),
            "no CUDA driver found: libcuda.so could not be loaded (is the NVIDIA driver installed and on the \
             library path?)"
        );
    }

    #[test]
    fn a_missing_symbol_is_driver_too_old() {
        let e = failure(
            "cuMemGetDefaultMemPool",
            FailureKind::SymbolMissing {
                driver: DriverVersion(12080),
                required: first_driver_with("cuMemGetDefaultMemPool"),
            },
        );
        assert_eq!(
            e,
            Error::DriverTooOld {
                call: "cuMemGetDefaultMemPool",
                driver: DriverVersion(12080),
                required: Some(DriverVersion(13000)),
            }
        );
        assert_eq!(
            e.to_string(),
            "the installed CUDA driver (12.8) does not provide `cuMemGetDefaultMemPool`; it needs a driver \
             for CUDA 13.0 or newer"
        );
        let e = failure(
            "cuSomethingNew",
            FailureKind::SymbolMissing {
                driver: DriverVersion(12080),
                required: None,
            },
        );
        assert_eq!(
            e.to_string(),
            "the installed CUDA driver (12.8) does not provide `cuSomethingNew`"
        );
    }

    #[test]
    fn a_missing_capability_names_the_attribute() {
        let e = Error::CapabilityMissing {
            device: 1,
            operation: "create a pool of managed memory",
            missing: "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0".into(),
        };
        assert_eq!(
            e.to_string(),
            "device 1 cannot create a pool of managed memory: CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0"
        );
    }

    #[test]
    fn vmm_errors_name_their_cause() {
        let e = Error::VmmHandleTypeNotSupported {
            device: 0,
            requested: HandleTypes::FABRIC,
            supported: HandleTypes::POSIX_FILE_DESCRIPTOR,
        };
        let text = e.to_string();
        assert!(
            text.starts_with("device 0 cannot create physical allocations exportable as"),
            "{text}"
        );
        assert!(
            text.contains("FABRIC") && text.contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"),
            "{text}"
        );
        let e = Error::AllocationNotExportable {
            device: 0,
            requested: HandleTypes::POSIX_FILE_DESCRIPTOR,
            created_with: HandleTypes::empty(),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("this physical allocation of device 0 cannot be exported as")
                && text.contains("AllocationProps::handle_types")
                && !text.contains("CU_DEVICE_ATTRIBUTE"),
            "names the allocation's handle types, not the device's: {text}"
        );
        let e = Error::Leaked {
            what: "the reservation of 8 bytes at 0x10".into(),
            cause: "1 range(s) of it are still mapped".into(),
        };
        assert_eq!(
            e.to_string(),
            "the reservation of 8 bytes at 0x10 was leaked on purpose: 1 range(s) of it are still mapped"
        );
        let e = Error::NotGranular {
            what: "the physical allocation's size",
            value: 4096,
            granularity: 2 << 20,
        };
        assert_eq!(
            e.to_string(),
            "the physical allocation's size is 4096 bytes: it must be a non-zero multiple of the allocation \
             granularity, 2097152 bytes"
        );
        let e = Error::ReservationFull {
            requested: 8,
            offset: 4,
            capacity: 8,
        };
        assert_eq!(
            e.to_string(),
            "the reservation of 8 bytes cannot hold 8 bytes at offset 4"
        );
    }

    #[test]
    fn no_device_keeps_its_message() {
        let e = failure("cuInit", FailureKind::NoDevice);
        assert_eq!(e, Error::NoDevice);
        assert_eq!(
            e.to_string(),
            "the CUDA driver found no device (CUDA_ERROR_NO_DEVICE): is a GPU visible to this process?"
        );
    }

    #[test]
    fn out_of_memory_keeps_the_call_and_size() {
        let r = check("cuMemAllocFromPoolAsync", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let err = Error::from(check_alloc("cuMemAllocFromPoolAsync", r, 1 << 40).unwrap_err());
        assert_eq!(
            err,
            Error::OutOfMemory {
                call: "cuMemAllocFromPoolAsync",
                requested: 1 << 40
            }
        );
        assert!(err.is_out_of_memory());
        assert_eq!(
            err.to_string(),
            "out of memory: cuMemAllocFromPoolAsync could not allocate 1099511627776 bytes"
        );
    }

    #[test]
    fn driver_failures_name_the_call_and_result() {
        let err = Error::from(check("cuMemPoolCreate", sys::CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err());
        let text = err.to_string();
        assert!(
            text.starts_with("cuMemPoolCreate failed: CUDA_ERROR_INVALID_VALUE ("),
            "{text}"
        );
        assert_eq!(err.driver_error().map(|e| e.code), Some(1));
        assert!(!err.is_out_of_memory());
        let err = failure(
            "cuStreamQuery",
            FailureKind::Driver(DriverError {
                code: 700,
                name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                message: "an illegal memory access was encountered".into(),
            }),
        );
        assert_eq!(
            err.to_string(),
            "cuStreamQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"
        );
    }
}
