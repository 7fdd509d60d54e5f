//! [`PinnedHost`]: the page-locked host memory an offloaded tag's contents wait in while it sleeps (and the
//! resource's cache of such buffers keeps for the next offload).

use std::sync::Arc;

use mempool_core::{Context, DeviceAddr};

use crate::error::Result;

/// Page-locked host memory holding a sleeping tag's contents; freed on drop.
pub(super) struct PinnedHost {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) ctx: Arc<Context>,
}

// SAFETY: the pointer is owned memory that only this value frees; nothing in it is thread-bound.
#[allow(unsafe_code)]
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    pub(super) fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedHost> {
        let ptr = mempool_core::memory::pinned_host_alloc(ctx, len)?;
        Ok(PinnedHost {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }

    /// The unified address of byte `offset` (`offset <= len`): pinned memory is reachable by the copy
    /// engines at its host address.
    pub(super) fn addr(&self, offset: usize) -> DeviceAddr {
        debug_assert!(offset <= self.len);
        DeviceAddr(self.ptr as u64 + offset as u64)
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `pinned_host_alloc` and is freed once, here; every copy into or out of it
        // was waited for before its owner let it go (sleep and wake synchronize their stream).
        #[allow(unsafe_code)]
        let r = unsafe { mempool_core::memory::pinned_host_free(&self.ctx, self.ptr) };
        if let Err(e) = r {
            mempool_core::record_drop_error(e);
        }
    }
}
