//! Primary contexts, retained while anything uses them, and scoped binding to the calling thread.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::raw::{self, sys};
use crate::types::{Device, MemoryInfo, PeerRefusal};

/// The primary contexts mempool retained, by device ordinal (see [`Context::primary_ref`]).
type PrimaryCache = Mutex<Option<HashMap<usize, &'static Arc<Context>>>>;
static PRIMARY: PrimaryCache = Mutex::new(None);

/// A device's primary context. mempool retains it once, on first use, for the life of the process (as
/// the CUDA runtime does); `Context` values are shared `Arc`s of that one retain.
///
/// Every handle in this crate (`Stream`, `Event`, `MemPool`, buffers) holds an `Arc<Context>`, so the
/// context outlives everything made in it. No call here depends on whichever context the calling
/// thread happens to have current: each one binds its own context for its duration with
/// [`Context::bind`], and restores the thread's previous context afterwards.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html>.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: Handle<sys::CUctx_st>,
}

impl Context {
    /// The primary context of `device`, retained once and shared for the life of the process.
    ///
    /// The CUDA runtime keeps primary contexts alive until the process ends, and so do we: releasing
    /// one whenever the last user drops it makes multi-threaded programs destroy and re-create the
    /// context (and everything cached in it) over and over, while raw handles of the old one may still
    /// be in flight on other threads.
    pub(crate) fn primary(device: Device) -> Result<Arc<Context>> {
        Context::primary_ref(device).map(Arc::clone)
    }

    /// [`Context::primary`] as a reference that lives as long as the process: the cache entry itself.
    /// Each device's entry is allocated once and never freed (the primary context is never released
    /// either), which lets a borrowed view such as a [`crate::StreamRef`] made from another library's
    /// stream carry the context for any lifetime.
    pub(crate) fn primary_ref(device: Device) -> Result<&'static Arc<Context>> {
        let mut cache = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
        let map = cache.get_or_insert_with(HashMap::new);
        if let Some(ctx) = map.get(&device.ordinal()) {
            return Ok(ctx);
        }
        let raw = raw::context::primary_retain(device.as_raw())?;
        let ctx: &'static Arc<Context> = Box::leak(Box::new(Arc::new(Context {
            device,
            raw: Handle::new(raw),
        })));
        map.insert(device.ordinal(), ctx);
        Ok(ctx)
    }

    /// The primary context of the device with this ordinal if mempool has already retained it: no
    /// driver call, for conversions that run per call (a cudarc stream's `StreamRef`).
    #[cfg(feature = "cudarc")]
    pub(crate) fn retained_primary(ordinal: usize) -> Option<&'static Arc<Context>> {
        let cache = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
        cache.as_ref().and_then(|map| map.get(&ordinal).copied())
    }

    /// The device this context belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`, for interop (cudarc, C). It stays valid while `self` lives.
    pub fn as_raw(&self) -> crate::types::RawContext {
        self.raw.get()
    }

    /// Makes this context current on the calling thread until the guard drops, then restores whatever
    /// was current before. Costs one `cuCtxGetCurrent` when the context is already current.
    pub fn bind(&self) -> Result<ContextGuard<'_>> {
        let pushed = if raw::context::current()? == self.as_raw() {
            false
        } else {
            // SAFETY: `self` holds a retain of the context for at least the guard's lifetime, which
            // borrows `self`; the guard pops exactly once.
            #[allow(unsafe_code)]
            let r = unsafe { raw::context::push(self.as_raw()) };
            r?;
            true
        };
        Ok(ContextGuard {
            pushed,
            _ctx: PhantomData,
        })
    }

    /// Lets this context's device access memory that `peer` allocates with `cuMemAlloc`
    /// (`cuCtxEnablePeerAccess`); access that is already enabled is fine. Pool memory ignores this: a
    /// pool grants a peer access with [`crate::MemPool::grant_access`].
    ///
    /// Errors: [`Error::InvalidArgument`] for a context of `peer`'s own device, [`Error::PeerAccess`]
    /// (`NoPeerCapability`) when `cuDeviceCanAccessPeer` says this device cannot map `peer`'s memory,
    /// both before the driver is asked; the driver's own refusal otherwise.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        let (dev, owner) = (self.device(), peer.device());
        if dev == owner {
            return Err(Error::InvalidArgument(format!(
                "cuCtxEnablePeerAccess: device {} already accesses its own memory; peer access is between two \
                 devices",
                dev.ordinal()
            )));
        }
        // `cuDeviceCanAccessPeer` itself (`Device::can_access_peer` is a layer above this module).
        if !raw::device::can_access_peer(dev.as_raw(), owner.as_raw())? {
            return Err(Error::PeerAccess {
                owner: owner.ordinal(),
                peer: dev.ordinal(),
                reason: PeerRefusal::NoPeerCapability,
            });
        }
        let _g = self.bind()?;
        // SAFETY: 1. `self` is bound (current) on this thread for the call and both contexts are retained
        // while `self` and `peer` live.
        #[allow(unsafe_code)]
        let r = unsafe { raw::context::enable_peer_access(peer.as_raw()) };
        match r {
            Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as u32) => Ok(()),
            r => Ok(r?),
        }
    }

    /// Blocks until all work in this context is done (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.bind()?;
        Ok(raw::context::synchronize()?)
    }

    /// Free and total device memory as the driver reports them (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        let _g = self.bind()?;
        let (free, total) = raw::context::mem_info()?;
        Ok(MemoryInfo { free, total })
    }
}

/// Keeps a context current on this thread; restores the previous one on drop. Not `Send`: the binding
/// belongs to the thread that made it.
#[must_use = "the context is only bound while the guard lives"]
pub struct ContextGuard<'a> {
    pushed: bool,
    _ctx: PhantomData<(&'a Context, *const ())>,
}

impl Drop for ContextGuard<'_> {
    fn drop(&mut self) {
        if self.pushed {
            if let Err(e) = raw::context::pop() {
                crate::drop_errors::record(e.into());
            }
        }
    }
}

#[cfg(test)]
impl Context {
    /// A context value that was never retained, for host tests of code that only stores or compares
    /// contexts (a `StreamRef` attached to one, a `BufferView`'s range checks). Its handle is null, so no
    /// test may queue work in it: without a driver, binding it fails with `DriverNotFound`.
    pub(crate) fn unretained_for_tests(ordinal: usize) -> Arc<Context> {
        Arc::new(Context {
            device: Device::from_parts(ordinal, ordinal as sys::CUdevice),
            raw: Handle::new(std::ptr::null_mut()),
        })
    }
}
