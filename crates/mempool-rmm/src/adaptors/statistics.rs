//! [`StatisticsAdaptor`]: counts bytes and allocations, with scoped counters.

use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::Result;
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// A current value with its peak and running total.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// The value now.
    pub current: i64,
    /// The highest value seen.
    pub peak: i64,
    /// The sum of all increments.
    pub total: i64,
}

impl Counter {
    fn add(&mut self, n: i64) {
        self.current += n;
        self.total += n;
        self.peak = self.peak.max(self.current);
    }
    fn sub(&mut self, n: i64) {
        self.current -= n;
    }
}

/// Bytes and allocation counts.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes, as requested (not rounded).
    pub bytes: Counter,
    /// Number of allocations.
    pub allocations: Counter,
}

/// Counts what passes through to the upstream: current, peak and total bytes and allocations, RMM's
/// `statistics_resource_adaptor`. [`push_counters`](Self::push_counters) starts a nested scope whose
/// counters start at zero; [`pop_counters`](Self::pop_counters) ends it and folds it into the outer scope.
///
/// ```
/// use mempool_core::StreamRef;
/// use mempool_rmm::adaptors::StatisticsAdaptor;
/// use mempool_rmm::testing::SimResource;
/// use mempool_rmm::MemoryResource;
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let mr = StatisticsAdaptor::new(unsafe { SimResource::new() });
/// let p = mr.allocate(1000, StreamRef::LEGACY).unwrap();
/// assert_eq!(mr.counters().bytes.current, 1000);
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1000, StreamRef::LEGACY) }.unwrap();
/// assert_eq!(mr.counters().bytes.peak, 1000);
/// ```
#[derive(Debug)]
pub struct StatisticsAdaptor<U> {
    upstream: U,
    // Invariant: never empty; the last entry is the innermost scope.
    stack: Mutex<Vec<Counters>>,
}

impl<U: MemoryResource> StatisticsAdaptor<U> {
    /// Wraps `upstream`.
    pub fn new(upstream: U) -> Self {
        StatisticsAdaptor {
            upstream,
            stack: Mutex::new(vec![Counters::default()]),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    fn stack(&self) -> std::sync::MutexGuard<'_, Vec<Counters>> {
        self.stack.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The innermost scope's counters.
    pub fn counters(&self) -> Counters {
        *self.stack().last().expect("the counter stack is never empty")
    }

    /// Starts a nested scope with zeroed counters; returns the outer scope's counters.
    pub fn push_counters(&self) -> Counters {
        let mut s = self.stack();
        let outer = *s.last().expect("never empty");
        s.push(Counters::default());
        outer
    }

    /// Ends the innermost scope and returns its counters; the outer scope absorbs its totals, its
    /// current values, and a peak of (outer current before + inner peak). The outermost scope cannot be
    /// popped: `None`.
    pub fn pop_counters(&self) -> Option<Counters> {
        let mut s = self.stack();
        if s.len() == 1 {
            return None;
        }
        let inner = s.pop().expect("checked");
        let outer = s.last_mut().expect("checked");
        for (o, i) in [
            (&mut outer.bytes, inner.bytes),
            (&mut outer.allocations, inner.allocations),
        ] {
            o.peak = o.peak.max(o.current + i.peak);
            o.current += i.current;
            o.total += i.total;
        }
        Some(inner)
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (it only counts them), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for StatisticsAdaptor<U> {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        let p = self.upstream.allocate(bytes, stream).map_err(|e| explain(e, self))?;
        let mut s = self.stack();
        let top = s.last_mut().expect("never empty");
        top.bytes.add(bytes as i64);
        top.allocations.add(1);
        Ok(p)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
        let mut s = self.stack();
        let top = s.last_mut().expect("never empty");
        top.bytes.sub(bytes as i64);
        top.allocations.sub(1);
        Ok(())
    }

    fn name(&self) -> &'static str {
        "StatisticsAdaptor"
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }

    fn inspect(&self) -> crate::observe::inspect::Inspection {
        let c = self.counters();
        crate::observe::inspect::Inspection {
            live_bytes: Some(c.bytes.current.max(0) as u64),
            peak_live_bytes: Some(c.bytes.peak.max(0) as u64),
            live_count: Some(c.allocations.current.max(0) as u64),
            allocations: Some(c.allocations.total.max(0) as u64),
            ..crate::observe::inspect::Inspection::default()
        }
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use super::*;
    use crate::testing::SimResource;
    const S: StreamRef<'static> = StreamRef::LEGACY;

    #[test]
    fn counts_bytes_and_allocations() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = StatisticsAdaptor::new(unsafe { SimResource::new() });
        let a = mr.allocate(100, S).unwrap();
        let b = mr.allocate(200, S).unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 100, S) }.unwrap();
        let c = mr.counters();
        assert_eq!(
            c.bytes,
            Counter {
                current: 200,
                peak: 300,
                total: 300
            }
        );
        assert_eq!(
            c.allocations,
            Counter {
                current: 1,
                peak: 2,
                total: 2
            }
        );
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(b, 200, S) }.unwrap();
        assert_eq!(mr.counters().bytes.current, 0);
    }

    #[test]
    fn failed_allocations_are_not_counted() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = StatisticsAdaptor::new(unsafe { SimResource::with_capacity(1024) });
        assert!(mr.allocate(4096, S).unwrap_err().is_out_of_memory());
        assert_eq!(mr.counters(), Counters::default());
    }

    #[test]
    fn scopes_nest() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = StatisticsAdaptor::new(unsafe { SimResource::new() });
        let a = mr.allocate(1000, S).unwrap();
        mr.push_counters();
        let b = mr.allocate(10, S).unwrap();
        let c = mr.allocate(20, S).unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(c, 20, S) }.unwrap();
        let inner = mr.pop_counters().unwrap();
        assert_eq!(
            inner.bytes,
            Counter {
                current: 10,
                peak: 30,
                total: 30
            }
        );
        let outer = mr.counters();
        assert_eq!(
            outer.bytes,
            Counter {
                current: 1010,
                peak: 1030,
                total: 1030
            }
        );
        assert_eq!(mr.pop_counters(), None);
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(b, 10, S) }.unwrap();
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 1000, S) }.unwrap();
    }
}
