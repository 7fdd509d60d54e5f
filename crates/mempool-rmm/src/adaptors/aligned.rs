//! [`AlignedAdaptor`]: allocations aligned beyond 256 bytes.

use std::collections::HashMap;
use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::{MemoryResource, ALIGNMENT};

/// Aligns allocations of at least `threshold` bytes to `alignment` (a power of two above 256), by
/// over-allocating from the upstream, RMM's `aligned_resource_adaptor`. Smaller requests pass through
/// (already 256-byte aligned).
#[derive(Debug)]
pub struct AlignedAdaptor<U> {
    upstream: U,
    alignment: usize,
    threshold: usize,
    // aligned address -> (upstream address, upstream size) for over-allocated blocks.
    shifted: Mutex<HashMap<u64, (DeviceAddr, usize)>>,
}

impl<U: MemoryResource> AlignedAdaptor<U> {
    /// Wraps `upstream`. `alignment` must be a power of two.
    pub fn new(upstream: U, alignment: usize, threshold: usize) -> Result<Self> {
        if !alignment.is_power_of_two() {
            return Err(Error::Unsupported {
                resource: "AlignedAdaptor",
                reason: format!("alignment {alignment} is not a power of two"),
            });
        }
        Ok(AlignedAdaptor {
            upstream,
            alignment: alignment.max(ALIGNMENT as usize),
            threshold,
            shifted: Mutex::default(),
        })
    }
    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
    fn applies(&self, bytes: usize) -> bool {
        self.alignment > ALIGNMENT as usize && bytes >= self.threshold && bytes > 0
    }
}

// SAFETY: each allocation lies inside one upstream allocation that this adaptor owns until the matching `deallocate` returns it (the upstream's guarantees 1 and 2 hold for the whole block, hence for the aligned part); `is_equal` is the default identity.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for AlignedAdaptor<U> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if !self.applies(bytes) {
            return self.upstream.allocate(bytes, stream).map_err(|e| explain(e, self));
        }
        let upstream_bytes = bytes + self.alignment - ALIGNMENT as usize;
        let raw = self
            .upstream
            .allocate(upstream_bytes, stream)
            .map_err(|e| match e {
                // Report the size the caller asked for, not the padded one.
                Error::OutOfMemory { resource, .. } => Error::OutOfMemory {
                    resource,
                    requested: bytes,
                },
                other => other,
            })
            .map_err(|e| match explain(e, self) {
                Error::OutOfMemoryReport(mut r) => {
                    r.requested = bytes;
                    Error::OutOfMemoryReport(r)
                }
                other => other,
            })?;
        let aligned = DeviceAddr(raw.0.next_multiple_of(self.alignment as u64));
        // Keep the upstream address and size (also when no shift was needed) so deallocate frees exactly
        // what was allocated.
        self.shifted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(aligned.0, (raw, upstream_bytes));
        Ok(aligned)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if !self.applies(bytes) {
            // SAFETY: allocations this size are the upstream's, unchanged (see `allocate`), so the caller's
            // obligations 1-3 carry over to the upstream.
            return unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        }
        let entry = self.shifted.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr.0);
        let (raw, upstream_bytes) = entry.ok_or_else(|| Error::InvalidDeallocation {
            resource: "AlignedAdaptor",
            ptr: ptr.0,
            bytes,
            reason: "not an aligned allocation of this adaptor".into(),
        })?;
        // SAFETY: `raw`/`upstream_bytes` is the upstream allocation `allocate` made for `ptr`, taken out of
        // the table above so it is returned once; the caller's obligation 3 covers the whole upstream range
        // because the aligned range lies inside it and nothing else of it was handed out.
        unsafe { self.upstream.deallocate(raw, upstream_bytes, stream) }
    }

    fn name(&self) -> &'static str {
        "AlignedAdaptor"
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
    fn out_of_memory_names_the_size_asked_for() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = AlignedAdaptor::new(unsafe { SimResource::with_capacity(1 << 20) }, 4096, 1024).unwrap();
        let e = mr.allocate(2 << 20, S).unwrap_err();
        // The report names the size the caller asked for, not the padded one, and the stack.
        let r = e.report().expect("a report");
        assert_eq!(r.requested, 2 << 20);
        assert_eq!(r.failed_at, "SimResource");
        assert_eq!(r.stack, ["AlignedAdaptor", "SimResource"]);
        assert_eq!(e.requested(), Some(2 << 20));
    }

    #[test]
    fn aligns_large_requests_and_frees_what_it_took() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = AlignedAdaptor::new(unsafe { SimResource::new() }, 4096, 1024).unwrap();
        let small = mr.allocate(100, S).unwrap();
        let mut big = Vec::new();
        for _ in 0..8 {
            let p = mr.allocate(5000, S).unwrap();
            assert_eq!(p.0 % 4096, 0);
            big.push(p);
        }
        for p in big {
            // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
            // dereferenced.
            unsafe { mr.deallocate(p, 5000, S) }.unwrap();
        }
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(small, 100, S) }.unwrap();
        assert_eq!(mr.upstream().live_allocations(), 0);
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        assert!(AlignedAdaptor::new(unsafe { SimResource::new() }, 3000, 0).is_err());
    }
}
