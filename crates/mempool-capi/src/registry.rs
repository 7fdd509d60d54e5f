//! The current resource of each device, over [`mempool_rmm::registry`] (one registry per process: the
//! C ABI, the Python package and PyTorch's pluggable allocator all see the same one).
//!
//! [`current`] is on the path of every allocation PyTorch and CuPy make through mempool, so each thread
//! keeps the answer it last got per device, with the registry's [`generation`](registry::generation) it
//! read before asking: while the generation is unchanged, the answer is the registry's, and the lookup
//! is a thread-local read instead of the registry's process-wide lock. The cache holds a weak reference:
//! a resource the registry let go of is not kept alive by a thread that once allocated from it.

use std::cell::RefCell;
use std::sync::Weak;

use mempool_rmm::{registry, MemoryResource, SharedResource};

use crate::device;
use crate::error::Result;

/// Devices whose answer a thread caches (ordinals `0..CACHED_DEVICES`); others ask the registry each time.
const CACHED_DEVICES: usize = 16;

/// One device's cached answer: the generation read before the lookup, and the resource.
type Slot = Option<(u64, Weak<dyn MemoryResource>)>;

thread_local! {
    static CACHE: RefCell<[Slot; CACHED_DEVICES]> = const { RefCell::new([const { None }; CACHED_DEVICES]) };
}

/// The cached resource of `ordinal` if the registry has not changed since it was cached.
fn cached(ordinal: usize, generation: u64) -> Option<SharedResource> {
    CACHE
        .try_with(|c| {
            let c = c.try_borrow().ok()?;
            match c.get(ordinal)? {
                Some((g, weak)) if *g == generation => weak.upgrade(),
                _ => None,
            }
        })
        .ok()
        .flatten()
}

fn remember(ordinal: usize, generation: u64, mr: &SharedResource) {
    let _ = CACHE.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            if let Some(slot) = c.get_mut(ordinal) {
                *slot = Some((generation, std::sync::Arc::downgrade(mr)));
            }
        }
    });
}

/// The current resource of device `ordinal` (the registry's default, an `AsyncResource` on the device's
/// default pool, until one is set).
pub fn current(ordinal: usize) -> Result<SharedResource> {
    // The generation is read before the resource: a change between the two leaves an entry whose
    // generation is already stale, so the next call asks again.
    let generation = registry::generation();
    if let Some(mr) = cached(ordinal, generation) {
        return Ok(mr);
    }
    let mr = registry::current_device_resource(&device::device(ordinal)?)?;
    remember(ordinal, generation, &mr);
    Ok(mr)
}

/// Makes `mr` the current resource of device `ordinal`; returns the previous one, if any was made.
/// Allocations of the previous resource keep it alive through their own reference.
pub fn set(ordinal: usize, mr: SharedResource) -> Result<Option<SharedResource>> {
    Ok(registry::set_current_device_resource(&device::device(ordinal)?, mr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mempool_core::{DeviceAddr, StreamRef};

    /// A resource that hands out nothing (every allocation is refused).
    #[derive(Debug)]
    struct Refuses;

    // SAFETY: it never returns memory, so it makes no promise it could break.
    #[allow(unsafe_code)]
    unsafe impl MemoryResource for Refuses {
        fn allocate(&self, _bytes: usize, _stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
            Err(mempool_rmm::Error::Unsupported {
                resource: "Refuses",
                reason: "a test double that allocates nothing".into(),
            })
        }

        #[allow(unsafe_code)]
        unsafe fn deallocate(&self, _p: DeviceAddr, _n: usize, _s: StreamRef<'_>) -> mempool_rmm::Result<()> {
            Ok(())
        }

        fn name(&self) -> &'static str {
            "Refuses"
        }
    }

    #[test]
    fn a_cached_answer_is_used_only_at_its_generation_and_while_the_resource_lives() {
        let mr: SharedResource = std::sync::Arc::new(Refuses);
        let dev = CACHED_DEVICES - 1;
        remember(dev, 7, &mr);
        assert!(cached(dev, 7).is_some_and(|c| std::sync::Arc::ptr_eq(&c, &mr)));
        assert!(cached(dev, 8).is_none(), "another generation");
        assert!(cached(CACHED_DEVICES, 7).is_none(), "past the cached devices");
        drop(mr);
        assert!(cached(dev, 7).is_none(), "the cache does not keep the resource alive");
    }
}
