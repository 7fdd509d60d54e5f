//! The current resource of each device, over [`mempool_rmm::registry`] (one registry per process: the
//! C ABI, the Python package and PyTorch's pluggable allocator all see the same one).

use mempool_rmm::{registry, SharedResource};

use crate::device;
use crate::error::Result;

/// The current resource of device `ordinal` (the registry's default, an `AsyncResource` on the device's
/// default pool, until one is set).
pub fn current(ordinal: usize) -> Result<SharedResource> {
    Ok(registry::current_device_resource(&device::device(ordinal)?)?)
}

/// Makes `mr` the current resource of device `ordinal`; returns the previous one, if any was made.
/// Allocations of the previous resource keep it alive through their own reference.
pub fn set(ordinal: usize, mr: SharedResource) -> Result<Option<SharedResource>> {
    Ok(registry::set_current_device_resource(&device::device(ordinal)?, mr))
}
