//! [`FailureCallbackAdaptor`]: a chance to free memory and retry when an allocation runs out.

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::Result;
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// On out-of-memory, calls `callback(bytes, attempt)`; if it returns `true` the allocation is retried,
/// otherwise the error is returned. RMM's `failure_callback_resource_adaptor`. Typical callbacks trim a
/// pool, drop caches, or wait for other work to free memory. Other errors are returned at once.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use std::sync::Arc;
/// use mempool_core::Device;
/// use mempool_rmm::{adaptors::FailureCallbackAdaptor, AsyncOptions, AsyncResource};
/// let dev = Device::get(0)?;
/// let pool = Arc::new(AsyncResource::new(&dev, AsyncOptions::default())?);
/// let trimmed = pool.clone();
/// // Trim the pool to what is live and retry once.
/// let mr = FailureCallbackAdaptor::new(pool, move |_bytes, attempt| {
///     attempt == 0 && trimmed.pool().trim_to(0).is_ok()
/// });
/// # Ok(()) }
/// ```
pub struct FailureCallbackAdaptor<U, F> {
    upstream: U,
    callback: F,
}

impl<U, F> std::fmt::Debug for FailureCallbackAdaptor<U, F>
where
    U: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureCallbackAdaptor")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl<U, F> FailureCallbackAdaptor<U, F>
where
    U: MemoryResource,
    F: Fn(usize, u32) -> bool + Send + Sync,
{
    /// Wraps `upstream`; `callback(bytes, attempt)` decides whether to retry (attempt counts from 0).
    pub fn new(upstream: U, callback: F) -> Self {
        FailureCallbackAdaptor { upstream, callback }
    }
    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (a failure only runs the callback before retrying the upstream), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U, F> MemoryResource for FailureCallbackAdaptor<U, F>
where
    U: MemoryResource,
    F: Fn(usize, u32) -> bool + Send + Sync,
{
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let mut attempt = 0;
        loop {
            match self.upstream.allocate(bytes, stream) {
                Err(e) if e.is_out_of_memory() && (self.callback)(bytes, attempt) => attempt += 1,
                other => return other.map_err(|e| explain(e, self)),
            }
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        "FailureCallbackAdaptor"
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
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    const S: StreamRef<'static> = StreamRef::LEGACY;

    #[test]
    fn retries_while_the_callback_frees_memory() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let sim = Arc::new(unsafe { SimResource::with_capacity(1024) });
        let hog = sim.allocate(1024, S).unwrap();
        let calls = Arc::new(AtomicU32::new(0));
        let (s2, c2) = (sim.clone(), calls.clone());
        let mr = FailureCallbackAdaptor::new(sim.clone(), move |bytes, attempt| {
            assert_eq!(bytes, 512);
            c2.fetch_add(1, Ordering::SeqCst);
            if attempt == 0 {
                // SAFETY: `hog` is the test's allocation from the upstream (1024 bytes), freed once here; SimResource
                // addresses are never dereferenced.
                unsafe { s2.deallocate(hog, 1024, S) }.unwrap(); // free something, then retry
                true
            } else {
                false
            }
        });
        let p = mr.allocate(512, S).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(p, 512, S) }.unwrap();
    }

    #[test]
    fn gives_up_when_the_callback_says_so() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = FailureCallbackAdaptor::new(unsafe { SimResource::with_capacity(256) }, |_, attempt| attempt < 3);
        let e = mr.allocate(1024, S).unwrap_err();
        assert!(e.is_out_of_memory());
        assert_eq!(mr.upstream().failed_allocations(), 4);
    }

    #[test]
    fn a_limit_counts_as_out_of_memory_as_in_rmm() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let limited =
            super::super::limiting::LimitingAdaptor::new(unsafe { SimResource::with_capacity(1 << 20) }, 1000);
        let calls = Arc::new(AtomicU32::new(0));
        let c2 = calls.clone();
        let mr = FailureCallbackAdaptor::new(limited, move |bytes, attempt| {
            assert_eq!(bytes, 5000);
            c2.fetch_add(1, Ordering::SeqCst);
            attempt < 2
        });
        let e = mr.allocate(5000, S).unwrap_err();
        assert!(
            matches!(e, crate::error::Error::LimitExceeded { requested: 5000, .. }),
            "{e}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
