//! # mempool-core
//!
//! A safe Rust layer over the CUDA driver's stream-ordered memory pools (`cuMemPool*`, the machinery
//! behind `cudaMallocAsync`): devices, primary contexts, streams, events, and [`MemPool`] with its
//! attributes, trimming, peer access, the device's current pool, and the raw IPC primitives.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so this crate builds on machines without
//! CUDA. On a machine without a driver every entry point returns [`Error::DriverNotFound`]; a call the
//! installed driver lacks returns [`Error::DriverTooOld`]. Nothing panics for either.
//!
//! ```no_run
//! # fn main() -> mempool_core::Result<()> {
//! use mempool_core::{Device, MemPool, PoolProps, Stream};
//! let dev = Device::get(0)?;
//! let pool = MemPool::new(&dev, &PoolProps::new())?;
//! let stream = Stream::new(&dev.context()?)?;
//! let buf = pool.alloc(4096, stream.as_ref())?;
//! buf.copy_from_host(0, &[7u8; 4096])?;
//! # Ok(()) }
//! ```
//!
//! Virtual memory management (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, shareable
//! handles) is here too, as RAII types: [`PhysicalAllocation`], [`Reservation`], [`Mapping`], and the
//! [`GrowableBuffer`] built on them (docs/vmm.md).
//!
//! Handles are RAII and keep their context alive. `Drop` cannot return errors; a failure there is kept
//! for [`take_drop_errors`] rather than lost or panicked on.
//!
//! With the `cudarc` feature, cudarc's streams and contexts work where mempool's are taken
//! (`StreamRef::from(&cuda_stream)`, `Context::from_cudarc`, `Stream::from_cudarc`) and mempool's
//! streams are handed to cudarc (`Stream::new_cudarc`, `unsafe` `Stream::borrow_for_cudarc`);
//! docs/cudarc.md is the guide.
//!
//! A program that needs GPUs checks for them with [`require_gpus`]: on a machine with too few it says
//! why ([`MissingGpus`]) and exits with [`NO_GPU_EXIT_STATUS`], as every example of the workspace does.
//!
//! Unsafe code is denied crate-wide (`#![deny(unsafe_code)]`). The `raw` module opts in as a whole (one
//! file per CUDA area, each `unsafe fn` with a `# Safety` list); elsewhere each `unsafe` block or
//! function opts in on its own (`#[allow(unsafe_code)]`), every block with a `SAFETY:` line and every
//! `unsafe fn` with a numbered `# Safety` list, which clippy enforces (`undocumented_unsafe_blocks`,
//! `missing_safety_doc`).
//!
//! The modules build on each other without cycles: plain value types (`types`) at the bottom, then the
//! raw driver calls (`raw`, which report their own failure type), the public [`Error`] (which converts
//! it), and the safe RAII types on top.

#![warn(missing_docs)]
#![deny(unsafe_code)]

mod buffer;
mod context;
#[cfg(feature = "cudarc")]
mod cudarc_interop;
mod current;
mod device;
mod drop_errors;
mod error;
mod event;
mod growable;
mod handle;
#[cfg(feature = "testing")]
pub mod kernels;
mod mapping;
pub mod memory;
mod module;
mod pool;
mod raw;
mod require;
mod stream;
mod types;
mod view;
mod vmm;

pub use buffer::PoolBuffer;
pub use context::{Context, ContextGuard};
pub use current::CurrentPoolGuard;
pub use drop_errors::{record as record_drop_error, take_drop_errors};
pub use error::{Error, Result};
pub use event::{Event, EventFlags, IpcEventHandle};
pub use growable::{GrowableBuffer, GrowableOptions, WhenFull};
pub use mapping::{Mapping, Reservation};
pub use module::{Function, LaunchConfig, Module};
pub use pool::{ImportedPtr, MemPool};
pub use require::{require_gpus, MissingGpus, NO_GPU_EXIT_STATUS};
pub use stream::{KeptStream, Stream, StreamFlags, StreamRef};
pub use types::{
    Access, AllocationType, Device, DeviceAddr, DriverError, DriverVersion, HandleTypes, MemoryInfo, PeerRefusal,
    PoolKind, PoolLocation, PoolProps, PoolUsage, PtrExportData, ReusePolicy, StreamId, Uuid,
};
pub use view::BufferView;
pub use vmm::{round_up, AllocationProps, FabricHandle, Granularity, PhysicalAllocation, VmmSupport};

pub use types::{RawAllocationHandle, RawContext, RawDevice, RawEvent, RawPool, RawStream};

/// Loads and initialises the driver (once) and returns its version (`cuDriverGetVersion`).
///
/// Errors: [`Error::DriverNotFound`] when `libcuda.so` cannot be loaded, [`Error::NoDevice`] when the
/// driver sees no GPU.
pub fn driver_version() -> Result<DriverVersion> {
    Ok(raw::init()?)
}

/// Whether the CUDA driver library can be loaded on this machine, without initialising it.
pub fn driver_present() -> bool {
    raw::library_present()
}
