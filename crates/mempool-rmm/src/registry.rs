//! The per-device current resource, RMM's `get/set_current_device_resource`.
//!
//! Process-wide, like RMM's: libraries that allocate "on the current device resource" all see the same
//! one. The default, made on first use, is an [`AsyncResource`] on the device's default pool, not plain
//! `cuMemAlloc`, under a [`HistoryResource`] that records its recent allocations (the history is on by
//! default here: docs/observe.md, "History", has its cost). The environment variable
//! `MEMPOOL_HISTORY` sets the history's capacity in events (`0` leaves the default resource without
//! one). A resource set with [`set_current_device_resource`] is used as it is: wrap it in a
//! [`HistoryResource`] to record it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mempool_core::Device;

use crate::error::Result;
use crate::observe::adaptor::HistoryResource;
use crate::observe::history::{History, DEFAULT_CAPACITY};
use crate::resource::SharedResource;
use crate::resources::AsyncResource;

static REGISTRY: Mutex<Option<HashMap<usize, SharedResource>>> = Mutex::new(None);

/// Bumped (under the registry's lock) by every change of any device's current resource.
static GENERATION: AtomicU64 = AtomicU64::new(0);

fn with<T>(f: impl FnOnce(&mut HashMap<usize, SharedResource>) -> T) -> T {
    let mut g = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(HashMap::new))
}

/// A number that changes whenever any device's current resource is set or reset (never when the default
/// is first made: that changes no resource a caller saw). A cache of [`current_device_resource`]'s answer
/// read after loading the generation stays right for as long as the generation does not change: read it
/// first, then the resource, and compare it again on every later use.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// The history capacity of the default resource: `MEMPOOL_HISTORY` if set to a number, else
/// [`DEFAULT_CAPACITY`]; 0 means no history.
pub fn default_history_capacity() -> usize {
    std::env::var("MEMPOOL_HISTORY")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_CAPACITY)
}

/// The current resource of `device`, creating the default on first use: an [`AsyncResource`] on the
/// device's default pool, under a [`HistoryResource`] (see the module docs).
pub fn current_device_resource(device: &Device) -> Result<SharedResource> {
    if let Some(r) = with(|m| m.get(&device.ordinal()).cloned()) {
        return Ok(r);
    }
    let pool = AsyncResource::default_pool(device)?;
    let default: SharedResource = match default_history_capacity() {
        0 => Arc::new(pool),
        n => Arc::new(HistoryResource::with_history(pool, Arc::new(History::new(n)))),
    };
    Ok(with(|m| m.entry(device.ordinal()).or_insert(default).clone()))
}

/// Sets the current resource of `device` and returns the previous one (`None` if the default had not been
/// made yet). Memory allocated from the previous resource must still be freed through it: keep the
/// returned value while any of its allocations live.
pub fn set_current_device_resource(device: &Device, resource: SharedResource) -> Option<SharedResource> {
    with(|m| {
        let previous = m.insert(device.ordinal(), resource);
        GENERATION.fetch_add(1, Ordering::AcqRel);
        previous
    })
}

/// Drops the registry's reference to `device`'s current resource, so the next
/// [`current_device_resource`] makes the default again. Returns what was current.
pub fn reset_current_device_resource(device: &Device) -> Option<SharedResource> {
    with(|m| {
        let previous = m.remove(&device.ordinal());
        GENERATION.fetch_add(1, Ordering::AcqRel);
        previous
    })
}
