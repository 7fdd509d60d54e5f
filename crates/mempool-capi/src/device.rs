//! Devices by ordinal, their primary contexts (retained once and cached), and the calling thread's current
//! device (the device of its current CUDA context, as `cudaGetDevice` reports it to PyTorch, CuPy and Numba).

use std::sync::{Arc, OnceLock};

use mempool_core::{Context, Device};

use crate::error::{Error, Result};

struct Devices {
    devices: Vec<Device>,
    contexts: Vec<OnceLock<Arc<Context>>>,
}

static DEVICES: OnceLock<Devices> = OnceLock::new();

/// Loads the driver and lists the devices once; until that succeeds every call retries and returns the
/// driver's refusal (no driver, no device, driver too old).
fn devices() -> Result<&'static Devices> {
    if let Some(d) = DEVICES.get() {
        return Ok(d);
    }
    let all = Device::all()?;
    if all.is_empty() {
        return Err(mempool_core::Error::NoDevice.into());
    }
    let contexts = all.iter().map(|_| OnceLock::new()).collect();
    Ok(DEVICES.get_or_init(|| Devices { devices: all, contexts }))
}

/// The number of visible devices.
pub fn count() -> Result<usize> {
    Ok(devices()?.devices.len())
}

/// The device with this ordinal.
pub fn device(ordinal: usize) -> Result<Device> {
    let d = devices()?;
    d.devices.get(ordinal).copied().ok_or_else(|| {
        Error::from(mempool_core::Error::NoSuchDevice {
            ordinal,
            count: d.devices.len(),
        })
    })
}

/// The device's primary context, retained on first use and kept for the life of the process.
pub fn context(ordinal: usize) -> Result<Arc<Context>> {
    let dev = device(ordinal)?;
    let slot = &devices()?.contexts[ordinal];
    if let Some(c) = slot.get() {
        return Ok(c.clone());
    }
    let ctx = dev.context()?;
    Ok(slot.get_or_init(|| ctx).clone())
}

/// The ordinal of the calling thread's current device: the device of its current CUDA context, or 0 when
/// no context is current (what the CUDA runtime's `cudaGetDevice` reports on a fresh thread).
pub fn current() -> Result<usize> {
    let d = devices()?;
    // A failed query reads as no current context, as before: the runtime's answer on a fresh thread. The
    // device is found in the list read once (no enumeration per call: this is on every allocation path).
    let current = mempool_core::Device::raw_of_current_context().ok().flatten();
    Ok(current
        .and_then(|raw| d.devices.iter().position(|dev| dev.as_raw() == raw))
        .unwrap_or(0))
}
