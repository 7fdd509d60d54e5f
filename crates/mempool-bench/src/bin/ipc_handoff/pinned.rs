//! Pinned host memory: the baseline's staging buffers.

use std::sync::Arc;

use mempool_core::{memory, Context};

use crate::error::AnyResult;

/// Pinned host memory, freed on drop.
pub(crate) struct Pinned {
    ctx: Arc<Context>,
    ptr: *mut u8,
    pub(crate) len: usize,
}

impl Pinned {
    pub(crate) fn new(ctx: &Arc<Context>, len: usize) -> AnyResult<Pinned> {
        Ok(Pinned {
            ctx: ctx.clone(),
            ptr: memory::pinned_host_alloc(ctx, len)?,
            len,
        })
    }

    #[allow(unsafe_code)]
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live pinned allocation of `len` bytes owned by `self`; the borrow of
        // `self` keeps it alive and unaliased for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: allocated by `pinned_host_alloc` and freed once; every copy that used it was
        // synchronized before the copy functions returned.
        let _ = unsafe { memory::pinned_host_free(&self.ctx, self.ptr) };
    }
}
