//! A device's current pool (`cuDeviceSetMemPool` / `cuDeviceGetMemPool`): what `cudaMallocAsync` and
//! `cuMemAllocAsync` allocate from, a process-wide setting that mempool changes only through
//! [`MemPool::make_current`]'s scoped activations.
//!
//! Every activation of every thread is recorded in one process-wide registry, per device, in the order
//! they were made, each with a token of its own and a share of its pool's handle ([`MemPool::share`]).
//! The device's current pool is always the newest remaining activation's pool, or, once none remains,
//! the pool that was current before the first one. So:
//!
//! - guards may drop in any order, on any thread: a guard removes its own activation wherever it is,
//!   and makes the newest remaining one current again (or the pool from before);
//! - a pool stays alive while it is current: its activation holds a share, released only after another
//!   pool has been made current in its place. A guard passed to `mem::forget` leaks its activation, so
//!   its pool stays alive and current for the rest of the process (leaked, never destroyed);
//! - [`Device::current_pool`] reads the driver's current pool under the registry's lock and hands out
//!   a share of the activation's pool, so the pool lives as long as that value too.
//!
//! The registry's lock is held across each `cuDeviceGetMemPool` / `cuDeviceSetMemPool`, so no two
//! changes interleave, and never while a pool is destroyed (a share taken out of the registry drops
//! after the lock is released).

use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::pool::MemPool;
use crate::raw::{self, sys};
use crate::types::{AllocationType, Device, PoolLocation};

/// The activations of all devices.
static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next_token: 0,
    devices: Vec::new(),
});

struct Registry {
    /// The token of the next activation (unique for the process's life).
    next_token: u64,
    /// One entry per device that has had an activation.
    devices: Vec<DeviceActivations>,
}

struct DeviceActivations {
    device: sys::CUdevice,
    /// The pool that was current before the oldest remaining activation; `None` while there is none.
    before: Option<Handle<sys::CUmemPoolHandle_st>>,
    /// The activations, oldest first; the last one's pool is the device's current pool.
    stack: Vec<Activation>,
}

struct Activation {
    token: u64,
    /// A share of the pool's handle: the pool lives while it is current.
    pool: MemPool,
}

fn registry() -> MutexGuard<'static, Registry> {
    // Nothing panics while the lock is held with the registry half changed (each change is one push or
    // one remove after the driver call), so a poisoned lock still guards a consistent registry.
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Registry {
    fn device(&mut self, device: sys::CUdevice) -> &mut DeviceActivations {
        let i = match self.devices.iter().position(|d| d.device == device) {
            Some(i) => i,
            None => {
                self.devices.push(DeviceActivations {
                    device,
                    before: None,
                    stack: Vec::new(),
                });
                self.devices.len() - 1
            }
        };
        &mut self.devices[i]
    }

    /// The activation of `device` whose pool is `raw`, if any.
    fn active(&self, device: sys::CUdevice, raw: sys::CUmemoryPool) -> Option<&MemPool> {
        let d = self.devices.iter().find(|d| d.device == device)?;
        d.stack.iter().rev().map(|a| &a.pool).find(|p| p.as_raw() == raw)
    }
}

impl MemPool {
    /// Makes this pool the device's current pool (what `cudaMallocAsync` and `cuMemAllocAsync` use) until
    /// the guard drops. The current pool is process-wide: this is the explicit, scoped way to change it.
    ///
    /// Activations nest and may end in any order, on any thread: while any remain, the device's current
    /// pool is the newest remaining one's; once none remains, the pool that was current before the first
    /// one is restored. The pool stays alive while it is current, even if this value drops first (a
    /// guard passed to `mem::forget` leaves the pool current, and alive, for the rest of the process).
    ///
    /// The guard borrows the pool, so the pool's value outlives it:
    ///
    /// ```no_run
    /// # fn main() -> mempool_core::Result<()> {
    /// use mempool_core::{Device, MemPool, PoolProps};
    /// let dev = Device::get(0)?;
    /// let pool = MemPool::new(&dev, &PoolProps::new())?;
    /// let guard = pool.make_current()?;
    /// assert_eq!(dev.current_pool()?.as_raw(), pool.as_raw());
    /// drop(guard);
    /// drop(pool);
    /// # Ok(()) }
    /// ```
    ///
    /// Dropping the pool while its guard lives does not compile:
    ///
    /// ```compile_fail,E0505
    /// # fn main() -> mempool_core::Result<()> {
    /// use mempool_core::{Device, MemPool, PoolProps};
    /// let dev = Device::get(0)?;
    /// let pool = MemPool::new(&dev, &PoolProps::new())?;
    /// let guard = pool.make_current()?;
    /// drop(pool); // the guard still borrows it
    /// drop(guard);
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: [`Error::PoolKind`] for an imported pool, a pool of managed memory and a host pool, which
    /// cannot be a device's current pool.
    pub fn make_current(&self) -> Result<CurrentPoolGuard<'_>> {
        self.require_allocating("making current")?;
        if self.allocation_type() == AllocationType::Managed {
            return Err(Error::PoolKind {
                operation: "making current",
                kind: "a pool of managed memory",
                why: "cuDeviceSetMemPool sets the device's pool of pinned device memory; allocate from a managed \
                      pool by name (MemPool::allocate)",
            });
        }
        let PoolLocation::Device(device) = self.location() else {
            return Err(Error::PoolKind {
                operation: "making current",
                kind: "a host pool",
                why: "a device's current pool must be located on that device",
            });
        };
        let mut reg = registry();
        let token = reg.next_token;
        reg.next_token += 1;
        let entry = reg.device(device.as_raw());
        if entry.stack.is_empty() {
            entry.before = Some(Handle::new(raw::pool::device_current(device.as_raw())?));
        }
        // SAFETY: 1. the pool is live and located on `device` (checked above), and stays live while it
        // is current: the activation pushed below holds a share of its handle, which is released only
        // after another pool has been made current in its place (`CurrentPoolGuard::drop`).
        #[allow(unsafe_code)]
        let set = unsafe { raw::pool::set_device_current(device.as_raw(), self.as_raw()) };
        if let Err(e) = set {
            if entry.stack.is_empty() {
                entry.before = None;
            }
            return Err(e.into());
        }
        entry.stack.push(Activation {
            token,
            pool: self.share(),
        });
        Ok(CurrentPoolGuard {
            device,
            token,
            _pool: PhantomData,
        })
    }
}

impl Device {
    /// The device's current pool (`cuDeviceGetMemPool`), a process-wide setting: the device's default
    /// pool (a view that is never destroyed), or a pool made current with [`MemPool::make_current`],
    /// returned as a value that shares the pool, so the pool lives at least as long as the value (even
    /// after its guard and its other values drop). To change the current pool, use
    /// [`MemPool::make_current`].
    ///
    /// Errors: [`Error::PoolKind`] when other code (C, the CUDA runtime's `cudaDeviceSetMemPool`) made a
    /// pool current that is neither of these: mempool cannot keep such a pool alive while the value is
    /// used.
    pub fn current_pool(&self) -> Result<MemPool> {
        self.require_pools()?;
        let ctx = self.context()?;
        let reg = registry();
        let raw = raw::pool::device_current(self.as_raw())?;
        if let Some(pool) = reg.active(self.as_raw(), raw) {
            return Ok(pool.share());
        }
        drop(reg);
        let default = MemPool::default_of(ctx)?;
        if default.as_raw() == raw {
            return Ok(default);
        }
        Err(Error::PoolKind {
            operation: "viewing the device's current pool",
            kind: "a pool made current outside mempool (neither the device's default pool nor a pool made \
                   current with MemPool::make_current)",
            why: "mempool cannot keep such a pool alive while the value is used; ask the code that made it \
                  current",
        })
    }
}

/// One activation of a pool as its device's current pool; dropping it ends the activation. See
/// [`MemPool::make_current`].
///
/// It may drop in any order relative to other guards, and on any thread.
#[must_use = "the pool is only current while the guard lives"]
#[derive(Debug)]
pub struct CurrentPoolGuard<'p> {
    device: Device,
    token: u64,
    /// The guard ends before the pool's value drops (the registry keeps the pool alive either way).
    _pool: PhantomData<&'p MemPool>,
}

impl Drop for CurrentPoolGuard<'_> {
    fn drop(&mut self) {
        let released = {
            let mut reg = registry();
            end_activation(reg.device(self.device.as_raw()), self.token)
        };
        // The pool's share drops here, after the lock: it may be the last one, which destroys the pool.
        drop(released);
    }
}

/// Removes the activation `token` of `entry` and, when it was the newest, makes the newest remaining
/// activation's pool current, or the pool from before the first activation once none remains. Returns
/// the removed activation's pool share, to drop after the lock; keeps it (leaks it) when the driver
/// refused to make another pool current, since it is then still current.
fn end_activation(entry: &mut DeviceActivations, token: u64) -> Option<MemPool> {
    let i = entry.stack.iter().position(|a| a.token == token)?;
    let newest = i + 1 == entry.stack.len();
    let ended = entry.stack.remove(i);
    if !newest {
        // The device's current pool is a newer activation's: nothing changes in the driver.
        return Some(ended.pool);
    }
    let next = match entry.stack.last() {
        Some(a) => a.pool.as_raw(),
        None => match entry.before.take() {
            Some(before) => before.get(),
            None => return Some(ended.pool),
        },
    };
    // SAFETY: 1. `next` is live and located on the device: the pool of a remaining activation (whose share
    // in the registry keeps it alive while it is current), or the pool that was current before the first
    // activation (the device's default pool, never destroyed, or a pool that the code which made it
    // current keeps alive while it is current).
    #[allow(unsafe_code)]
    let set = unsafe { raw::pool::set_device_current(entry.device, next) };
    match set {
        Ok(()) => Some(ended.pool),
        Err(e) => {
            crate::drop_errors::record(Error::from(e));
            // The ended pool is still current: it must never be destroyed.
            std::mem::forget(ended.pool);
            None
        }
    }
}
