//! Plain value types every engine shares: the alignment, engine statistics, the event policy.
//! Imports nothing of the crate.

/// Alignment of every address and block size the engines hand out, in bytes, and of every
/// allocation a `mempool-rmm` resource returns (it re-exports this constant as
/// `mempool_rmm::ALIGNMENT`, and [`align_up`] with it: the workspace's one alignment).
///
/// 256 bytes is what `cudaMalloc` guarantees and what RMM's `CUDA_ALLOCATION_ALIGNMENT` promises;
/// callers may rely on it for vectorized loads.
pub const ALIGNMENT: u64 = 256;

/// Rounds `bytes` up to a multiple of [`ALIGNMENT`], or `None` when that overflows `u64`.
///
/// ```
/// use mempool_suballoc::align_up;
/// assert_eq!(align_up(1), Some(256));
/// assert_eq!(align_up(512), Some(512));
/// assert_eq!(align_up(u64::MAX), None);
/// ```
#[inline]
pub const fn align_up(bytes: u64) -> Option<u64> {
    match bytes.checked_add(ALIGNMENT - 1) {
        Some(b) => Some(b & !(ALIGNMENT - 1)),
        None => None,
    }
}

/// A snapshot of an engine's bookkeeping.
///
/// Invariant (checked by every `check_invariants`): `free_bytes + used_bytes == reserved_bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Bytes obtained from the upstream and not yet returned to it.
    pub reserved_bytes: u64,
    /// Bytes held by live allocations, each counted with its rounding (to [`ALIGNMENT`], to a fixed
    /// block size, to a bin size).
    pub used_bytes: u64,
    /// Reserved bytes not held by a live allocation.
    pub free_bytes: u64,
    /// Free blocks across all free lists (per stream, per bin, per arena, global).
    pub free_blocks: usize,
    /// Live allocations.
    pub live_allocations: usize,
    /// Chunks obtained from the upstream and not yet returned to it.
    pub upstream_chunks: usize,
}

/// When an engine records the event that lets other streams take its free blocks.
///
/// Whichever is chosen, an event handed to a waiting stream is always recorded after every block in
/// the list it guards entered that list, so a stream that waits on it is ordered after all of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EventPolicy {
    /// Record on the freeing stream right after each block enters a stream's free list (RMM's
    /// behaviour). Costs one event record per deallocation, and in exchange the engine only ever
    /// records or waits on the stream of the call in progress (see "Which streams an engine
    /// touches" in the [crate docs](crate)), so streams may be destroyed while their freed blocks
    /// sit in the engine.
    RecordOnFree,
    /// Like [`RecordOnFree`](Self::RecordOnFree), but a stream's list records on free only once
    /// another stream has needed its blocks. The first hand-off from a list synchronizes (on a GPU:
    /// the context) instead of waiting on an event; from then on frees into that list record. So a
    /// stream whose blocks no other stream takes (the common case: one stream per thread or per
    /// pipeline) pays no event record at all, and the engine still only records or waits on the
    /// stream of the call in progress.
    #[default]
    Adaptive,
    /// Record on the owning stream only when another stream is about to take a block from its list.
    /// Saves the per-deallocation record, but records on streams the engine stored earlier, so every
    /// stream with free blocks in the engine must stay valid until the engine is released.
    RecordOnDemand,
}
