//! [`TrackingAdaptor`]: every outstanding allocation with the call site that made it.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::panic::Location;
use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// One outstanding allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationRecord {
    /// The address.
    pub ptr: DeviceAddr,
    /// The bytes asked for.
    pub bytes: usize,
    /// The stream it was allocated on (its handle value).
    pub stream: usize,
    /// Where `allocate` was called from: the first caller outside `#[track_caller]` functions, so through
    /// adaptors and wrappers it names the user's line.
    pub location: &'static Location<'static>,
    /// The allocating thread's name, if it has one.
    pub thread: Option<String>,
}

/// Tracks outstanding allocations and where they were made, RMM's `tracking_resource_adaptor`: a
/// leak report names the lines that allocated what was never freed. Deallocating an address it does not
/// track, or with the wrong size, is an [`Error::InvalidDeallocation`] and is not passed upstream.
#[derive(Debug)]
pub struct TrackingAdaptor<U> {
    upstream: U,
    live: Mutex<HashMap<u64, AllocationRecord>>,
}

impl<U: MemoryResource> TrackingAdaptor<U> {
    /// Wraps `upstream`.
    pub fn new(upstream: U) -> Self {
        TrackingAdaptor {
            upstream,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, AllocationRecord>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The outstanding allocations, oldest address first.
    pub fn outstanding(&self) -> Vec<AllocationRecord> {
        let mut v: Vec<_> = self.live().values().cloned().collect();
        v.sort_by_key(|r| r.ptr);
        v
    }

    /// Bytes outstanding.
    pub fn outstanding_bytes(&self) -> usize {
        self.live().values().map(|r| r.bytes).sum()
    }

    /// A human-readable leak report: one line per outstanding allocation, grouped by call site.
    pub fn leak_report(&self) -> String {
        let mut by_site: HashMap<String, (usize, usize)> = HashMap::new();
        for r in self.live().values() {
            let e = by_site.entry(r.location.to_string()).or_default();
            e.0 += 1;
            e.1 += r.bytes;
        }
        let mut sites: Vec<_> = by_site.into_iter().collect();
        sites.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(&b.0)));
        let mut out = String::new();
        let total: usize = sites.iter().map(|s| s.1 .1).sum();
        let count: usize = sites.iter().map(|s| s.1 .0).sum();
        let _ = writeln!(out, "{count} outstanding allocation(s), {total} bytes");
        for (site, (n, bytes)) in sites {
            let _ = writeln!(out, "  {bytes} bytes in {n} allocation(s) from {site}");
        }
        out
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (it only records them), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for TrackingAdaptor<U> {
    #[track_caller]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let location = Location::caller();
        let ptr = self.upstream.allocate(bytes, stream).map_err(|e| explain(e, self))?;
        if !ptr.is_null() {
            let thread = std::thread::current().name().map(str::to_owned);
            self.live().insert(
                ptr.0,
                AllocationRecord {
                    ptr,
                    bytes,
                    stream: stream.handle(),
                    location,
                    thread,
                },
            );
        }
        Ok(ptr)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        {
            let mut live = self.live();
            match live.get(&ptr.0) {
                None => {
                    return Err(Error::InvalidDeallocation {
                        resource: "TrackingAdaptor",
                        ptr: ptr.0,
                        bytes,
                        reason: "not an outstanding allocation".into(),
                    })
                }
                Some(r) if r.bytes != bytes => {
                    return Err(Error::InvalidDeallocation {
                        resource: "TrackingAdaptor",
                        ptr: ptr.0,
                        bytes,
                        reason: format!("allocated with {} bytes at {}", r.bytes, r.location),
                    })
                }
                Some(_) => {
                    live.remove(&ptr.0);
                }
            }
        }
        // SAFETY: this adaptor hands out the upstream's allocations unchanged; the entry just removed from
        // the live table shows `ptr` was allocated here with `bytes` and not freed since (obligations 1-2
        // are also checked, not only assumed), and the caller's obligation 3 carries over.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }
    }

    fn name(&self) -> &'static str {
        "TrackingAdaptor"
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
    fn reports_leaks_with_call_sites() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = TrackingAdaptor::new(unsafe { SimResource::new() });
        let a = mr.allocate(100, S).unwrap();
        let line_b = line!() + 1;
        let b = mr.allocate(200, S).unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 100, S) }.unwrap();
        let out = mr.outstanding();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].ptr, b);
        assert_eq!(out[0].location.line(), line_b);
        assert!(out[0].location.file().ends_with("tracking.rs"));
        let report = mr.leak_report();
        assert!(report.starts_with("1 outstanding allocation(s), 200 bytes"), "{report}");
        assert!(report.contains(&format!("tracking.rs:{line_b}")), "{report}");
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(b, 200, S) }.unwrap();
        assert_eq!(mr.outstanding_bytes(), 0);
    }

    #[test]
    fn call_site_survives_type_erasure_and_outer_adaptors() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr =
            crate::adaptors::statistics::StatisticsAdaptor::new(TrackingAdaptor::new(unsafe { SimResource::new() }));
        let dynamic: &dyn MemoryResource = &mr;
        let line = line!() + 1;
        let p = dynamic.allocate(64, S).unwrap();
        assert_eq!(mr.upstream().outstanding()[0].location.line(), line);
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { dynamic.deallocate(p, 64, S) }.unwrap();
    }

    #[test]
    fn refuses_unknown_and_mismatched_frees() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = TrackingAdaptor::new(unsafe { SimResource::new() });
        let a = mr.allocate(100, S).unwrap();
        assert!(matches!(
            // SAFETY: breaks obligation 1 on purpose (wrong size): the adaptor checks its live table before
            // forwarding and refuses, and SimResource never dereferences addresses.
            unsafe { mr.deallocate(a, 99, S) },
            Err(Error::InvalidDeallocation { .. })
        ));
        assert!(matches!(
            // SAFETY: breaks obligation 1 on purpose (not an allocation): refused by the adaptor's check, as above.
            unsafe { mr.deallocate(a.offset(256), 100, S) },
            Err(Error::InvalidDeallocation { .. })
        ));
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 100, S) }.unwrap();
        assert_eq!(mr.upstream().live_allocations(), 0);
    }
}
