//! [`LimitingAdaptor`]: refuses allocations past a byte limit.

use std::sync::atomic::{AtomicUsize, Ordering};

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::{align_up, MemoryResource};

/// Refuses allocations that would take the bytes allocated through it past a limit, RMM's
/// `limiting_resource_adaptor`. Sizes count as rounded up to [`crate::ALIGNMENT`], as they occupy.
#[derive(Debug)]
pub struct LimitingAdaptor<U> {
    upstream: U,
    limit: usize,
    // Invariant: the sum of align_up(bytes) over live allocations made through this adaptor.
    used: AtomicUsize,
}

impl<U: MemoryResource> LimitingAdaptor<U> {
    /// Wraps `upstream` with a limit of `limit` bytes.
    pub fn new(upstream: U, limit: usize) -> Self {
        LimitingAdaptor {
            upstream,
            limit,
            used: AtomicUsize::new(0),
        }
    }
    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }
    /// Bytes allocated through the adaptor now (aligned).
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

// SAFETY: forwards every allocation it allows and every free to the upstream unchanged, so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for LimitingAdaptor<U> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let Some(need) = align_up(bytes as u64).map(|n| n as usize) else {
            return Err(Error::LimitExceeded {
                requested: bytes,
                used: self.used(),
                limit: self.limit,
            });
        };
        // Reserve first so concurrent callers cannot overshoot together.
        let prev = self.used.fetch_add(need, Ordering::AcqRel);
        if prev.saturating_add(need) > self.limit {
            self.used.fetch_sub(need, Ordering::AcqRel);
            return Err(Error::LimitExceeded {
                requested: bytes,
                used: prev,
                limit: self.limit,
            });
        }
        self.upstream
            .allocate(bytes, stream)
            .inspect_err(|_| {
                self.used.fetch_sub(need, Ordering::AcqRel);
            })
            .map_err(|e| explain(e, self))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
        // `bytes` is the size of a live allocation made through this adaptor, so it rounded then.
        self.used.fetch_sub(
            align_up(bytes as u64).map(|n| n as usize).unwrap_or(0),
            Ordering::AcqRel,
        );
        Ok(())
    }

    fn name(&self) -> &'static str {
        "LimitingAdaptor"
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
    const S: StreamRef<'static> = StreamRef::LEGACY;

    #[test]
    fn refuses_past_the_limit_and_recovers() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = LimitingAdaptor::new(unsafe { SimResource::new() }, 1024);
        let a = mr.allocate(500, S).unwrap(); // 512 counted
        let b = mr.allocate(512, S).unwrap();
        assert_eq!(mr.used(), 1024);
        let e = mr.allocate(1, S).unwrap_err();
        assert_eq!(
            e,
            Error::LimitExceeded {
                requested: 1,
                used: 1024,
                limit: 1024
            }
        );
        assert!(e.to_string().contains("limit of 1024 bytes"));
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 500, S) }.unwrap();
        let c = mr.allocate(256, S).unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(b, 512, S) }.unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(c, 256, S) }.unwrap();
        assert_eq!(mr.used(), 0);
    }

    #[test]
    fn upstream_failure_releases_the_reservation() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = LimitingAdaptor::new(unsafe { SimResource::with_capacity(256) }, 4096);
        assert!(mr.allocate(1024, S).unwrap_err().is_out_of_memory());
        assert_eq!(mr.used(), 0);
    }
}
