//! [`Tracked`]: the peak of live bytes and the failed allocations of a resource under test, kept with
//! two relaxed atomics per call (cheap next to the kernels of the GPU workloads; the random workload,
//! whose numbers are nanoseconds per call, counts on its own thread instead).

use std::sync::atomic::{AtomicU64, Ordering};

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::{MemoryResource, Result};

/// Wraps a resource and counts what passes through.
#[derive(Debug)]
pub(crate) struct Tracked<R> {
    inner: R,
    live: AtomicU64,
    peak: AtomicU64,
    allocations: AtomicU64,
    failures: AtomicU64,
}

/// What [`Tracked`] counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TrackedStats {
    /// Bytes live now (as requested).
    pub(crate) live: u64,
    /// The most bytes live at once.
    pub(crate) peak: u64,
    /// Successful allocations.
    pub(crate) allocations: u64,
    /// Failed allocations.
    pub(crate) failures: u64,
}

impl<R: MemoryResource> Tracked<R> {
    /// Wraps `inner`.
    pub(crate) fn new(inner: R) -> Self {
        Tracked {
            inner,
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// The counters.
    pub(crate) fn stats(&self) -> TrackedStats {
        TrackedStats {
            live: self.live.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    /// Restarts the peak at the live bytes, and zeroes the counts.
    pub(crate) fn reset(&self) {
        self.peak.store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
        self.allocations.store(0, Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
    }
}

// SAFETY: forwards every allocation and free to `inner` unchanged (it only counts them), so `inner`'s `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for Tracked<R> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        match self.inner.allocate(bytes, stream) {
            Ok(p) => {
                let now = self.live.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
                self.peak.fetch_max(now, Ordering::Relaxed);
                self.allocations.fetch_add(1, Ordering::Relaxed);
                Ok(p)
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this wrapper hands out the inner resource's allocations unchanged, so the caller's
        // obligations 1-3 for it are the same obligations for the inner resource.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
        self.live.fetch_sub(bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        self.inner.is_equal(other)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
