//! [`HistoryResource`]: the adaptor that records every allocation, free and failure of the stack under
//! it into a [`History`].

use std::sync::Arc;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::Result;
use crate::observe::history::{History, Op};
use crate::observe::inspect::Inspection;
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// Records each allocation, free and failed allocation that passes it (time, size, address, stream,
/// the thread's [`Label`](crate::observe::Label), thread) into a bounded [`History`], and forwards
/// everything to `upstream` unchanged. The registry's default resource is one of these
/// ([`crate::registry`]); [`crate::observe::snapshot`] finds its history in a stack.
///
/// Cost per operation: a clock read, a thread-local read and seven relaxed stores, and an atomic
/// increment once every [`CLAIM`](crate::observe::CLAIM) events of a thread (no lock, no allocation);
/// docs/observe.md has the measured overhead.
///
/// ```
/// use mempool_core::StreamRef;
/// use mempool_rmm::observe::{HistoryResource, Op};
/// use mempool_rmm::testing::SimResource;
/// use mempool_rmm::MemoryResource;
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let mr = HistoryResource::new(unsafe { SimResource::new() });
/// let p = mr.allocate(1000, StreamRef::LEGACY).unwrap();
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 1000, StreamRef::LEGACY) }.unwrap();
/// let ops: Vec<Op> = mr.history().events().events.iter().map(|e| e.op).collect();
/// assert_eq!(ops, [Op::Allocate, Op::Free]);
/// ```
#[derive(Debug)]
pub struct HistoryResource<U> {
    upstream: U,
    history: Arc<History>,
}

impl<U: MemoryResource> HistoryResource<U> {
    /// Records into a new history of the default capacity
    /// ([`DEFAULT_CAPACITY`](crate::observe::DEFAULT_CAPACITY) events).
    pub fn new(upstream: U) -> Self {
        Self::with_history(upstream, Arc::new(History::default()))
    }

    /// Records into `history` (which several adaptors may share).
    pub fn with_history(upstream: U, history: Arc<History>) -> Self {
        HistoryResource { upstream, history }
    }

    /// The history.
    pub fn history(&self) -> &Arc<History> {
        &self.history
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (it only records them), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource> MemoryResource for HistoryResource<U> {
    #[track_caller]
    #[inline]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        match self.upstream.allocate(bytes, stream) {
            Ok(p) => {
                if !p.is_null() {
                    self.history
                        .record(Op::Allocate, 0, p.0, bytes as u64, stream.handle() as u64);
                }
                Ok(p)
            }
            Err(e) => {
                self.history
                    .record(Op::Failed, 0, 0, bytes as u64, stream.handle() as u64);
                Err(explain(e, self))
            }
        }
    }

    #[allow(unsafe_code)]
    #[inline]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
        if !ptr.is_null() {
            self.history
                .record(Op::Free, 0, ptr.0, bytes as u64, stream.handle() as u64);
        }
        Ok(())
    }

    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource) || self.upstream.is_equal(other)
    }

    fn name(&self) -> &'static str {
        "HistoryResource"
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }

    fn inspect(&self) -> Inspection {
        Inspection {
            history: Some(self.history.clone()),
            ..Inspection::default()
        }
    }
}
