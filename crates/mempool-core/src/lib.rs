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
//! buf.copy_from_host(&[7u8; 4096])?;
//! # Ok(()) }
//! ```
//!
//! Handles are RAII and keep their context alive. `Drop` cannot return errors; a failure there is kept
//! for [`take_drop_errors`] rather than lost or panicked on.
//!
//! Unsafe code lives in the `raw` module (one file per CUDA area, each function with a `# Safety` list)
//! and in the few `unsafe` blocks of the RAII types that call it, each with a `SAFETY:` line.

#![warn(missing_docs)]

mod buffer;
mod context;
mod device;
mod error;
mod event;
mod handle;
pub mod kernels;
pub mod memory;
mod module;
mod pool;
mod raw;
mod stream;

use std::sync::Mutex;

pub use buffer::{DeviceAddr, PoolBuffer};
pub use context::{Context, ContextGuard, MemoryInfo};
pub use device::{Device, Uuid};
pub use error::{DriverError, DriverVersion, Error, PeerRefusal, Result};
pub use event::{Event, EventFlags, IpcEventHandle};
pub use module::{Function, LaunchConfig, Module};
pub use pool::{
    Access, CurrentPoolGuard, HandleTypes, ImportedPtr, MemPool, PoolKind, PoolLocation, PoolProps, PoolUsage,
    PtrExportData, ReusePolicy,
};
pub use stream::{Stream, StreamFlags, StreamRef};

/// The raw driver types (`CUstream`, `CUdeviceptr`, ...), for interop through `into_raw` / `from_raw`.
pub use cudarc::driver::sys;

/// Loads and initialises the driver (once) and returns its version (`cuDriverGetVersion`).
///
/// Errors: [`Error::DriverNotFound`] when `libcuda.so` cannot be loaded, [`Error::NoDevice`] when the
/// driver sees no GPU.
pub fn driver_version() -> Result<DriverVersion> {
    raw::init()
}

/// Whether the CUDA driver library can be loaded on this machine, without initialising it.
pub fn driver_present() -> bool {
    raw::library_present()
}

static DROP_ERRORS: Mutex<Vec<Error>> = Mutex::new(Vec::new());
const MAX_DROP_ERRORS: usize = 64;

pub(crate) fn record_drop_error(e: Error) {
    let mut errors = DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    if errors.len() < MAX_DROP_ERRORS {
        errors.push(e);
    }
}

/// Takes the errors that `Drop` implementations met since the last call (at most 64 are kept).
/// Destructors cannot return errors; this is where they go instead of a panic.
pub fn take_drop_errors() -> Vec<Error> {
    std::mem::take(&mut *DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner()))
}
