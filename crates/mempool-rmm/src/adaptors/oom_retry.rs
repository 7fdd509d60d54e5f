//! [`OomRetryAdaptor`]: the policy "on out of memory: trim, synchronize, retry once".

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// On out of memory, trims the whole stack under it ([`MemoryResource::trim_unused`]: suballocators return
/// their unused chunks, a driver pool its unused reserve), synchronizes the stream of the request
/// (so that memory freed on it, and the frees the trim queued, have happened; see below for a stream
/// without a known context), and retries the allocation once. RMM's failure-callback idea as a setting, for any stack; the C ABI
/// (`mempool_oom_retry_adaptor_create`) and Python (`mempool.mr.oom_retry(mr)`) make it too.
///
/// A second failure is returned as the out-of-memory report of the retry, marked as retried. Other
/// errors, and errors of the trim or the synchronize, are returned at once.
///
/// ```
/// use mempool_core::StreamRef;
/// use mempool_rmm::adaptors::OomRetryAdaptor;
/// use mempool_rmm::testing::SimResource;
/// use mempool_rmm::MemoryResource;
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let mr = OomRetryAdaptor::new(unsafe { SimResource::with_capacity(1024) });
/// let e = mr.allocate(4096, StreamRef::LEGACY).unwrap_err();
/// assert!(e.report().is_some_and(|r| r.retried), "{e}");
/// ```
#[derive(Debug)]
pub struct OomRetryAdaptor<U> {
    upstream: U,
}

impl<U: MemoryResource> OomRetryAdaptor<U> {
    /// Wraps `upstream`.
    pub fn new(upstream: U) -> Self {
        OomRetryAdaptor { upstream }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
}

/// Waits for the stream. A stream whose context the view does not know (a raw handle, the legacy
/// stream as C and Python pass it) is synchronized in the calling thread's current context; where the
/// thread has none (or there is no driver: the host test doubles) nothing is waited for, and the retry
/// relies on the ordering the trim itself applied.
fn synchronize(stream: StreamRef<'_>) -> Result<()> {
    match stream.synchronize() {
        Ok(()) => Ok(()),
        Err(_) if stream.context().is_none() => Ok(()),
        Err(e) => Err(Error::from(e)),
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (a failure only trims the stack and synchronizes before retrying the upstream), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for OomRetryAdaptor<U> {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        match self.upstream.allocate(bytes, stream) {
            Err(e) if e.is_out_of_memory() => {
                self.upstream.trim_unused(stream)?;
                synchronize(stream)?;
                self.upstream
                    .allocate(bytes, stream)
                    .map_err(|e| match explain(e, self) {
                        Error::OutOfMemoryReport(mut r) => {
                            r.retried = true;
                            Error::OutOfMemoryReport(r)
                        }
                        other => other,
                    })
            }
            other => other,
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }
    }

    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource) || self.upstream.is_equal(other)
    }

    fn name(&self) -> &'static str {
        "OomRetryAdaptor"
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use super::*;
    use crate::testing::SimResource;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Holds memory it does not use until trimmed: `hog` bytes of the simulation, returned by `trim_unused`.
    #[derive(Debug)]
    struct Cache {
        sim: SimResource,
        hog: std::sync::Mutex<Option<DeviceAddr>>,
        trims: AtomicUsize,
    }

    // SAFETY: forwards to the simulation (the test's own resource, whose addresses are never dereferenced).
    unsafe impl MemoryResource for Cache {
        fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
            self.sim.allocate(bytes, stream)
        }
        unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
            // SAFETY: the caller's obligations for this resource are the simulation's: it made every allocation.
            unsafe { self.sim.deallocate(ptr, bytes, stream) }
        }
        fn name(&self) -> &'static str {
            "Cache"
        }
        fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
            self.trims.fetch_add(1, Ordering::SeqCst);
            if let Some(p) = self.hog.lock().unwrap().take() {
                // SAFETY: `p` is the cache's own 3072-byte allocation of the simulation, freed once here.
                unsafe { self.sim.deallocate(p, 3072, stream) }?;
            }
            Ok(())
        }
    }

    #[test]
    fn trims_the_stack_and_retries_once() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        let sim = unsafe { SimResource::with_capacity(4096) };
        let hog = sim.allocate(3072, StreamRef::LEGACY).unwrap();
        let cache = Cache {
            sim,
            hog: std::sync::Mutex::new(Some(hog)),
            trims: AtomicUsize::new(0),
        };
        let mr = OomRetryAdaptor::new(super::super::statistics::StatisticsAdaptor::new(cache));
        let p = mr.allocate(2048, StreamRef::LEGACY).unwrap();
        let cache = mr.upstream().upstream();
        assert_eq!(
            cache.trims.load(Ordering::SeqCst),
            1,
            "trimmed through the statistics adaptor"
        );
        assert_eq!(cache.sim.failed_allocations(), 1);
        // A second failure after the trim is reported, marked as retried, naming the stack.
        let e = mr.allocate(4096, StreamRef::LEGACY).unwrap_err();
        let r = e.report().expect("a report");
        assert!(r.retried);
        assert_eq!(r.stack, ["OomRetryAdaptor", "StatisticsAdaptor", "Cache"]);
        assert_eq!(cache.trims.load(Ordering::SeqCst), 2);
        assert!(
            e.to_string()
                .contains("failed again after trimming, synchronizing and retrying once"),
            "{e}"
        );
        // SAFETY: `p` came from `mr.allocate` with this size and is freed once.
        unsafe { mr.deallocate(p, 2048, StreamRef::LEGACY) }.unwrap();
    }
}
