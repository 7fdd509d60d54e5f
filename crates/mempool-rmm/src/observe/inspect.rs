//! [`Inspection`]: what one resource of a stack tells a snapshot or an out-of-memory report about
//! itself ([`crate::MemoryResource::inspect`]). Plain data; imports only the history type.

use std::sync::Arc;

use mempool_suballoc::ChunkMap;

use crate::observe::history::History;

/// What a resource knows about the memory it holds, each field `None` (or empty) where it does not
/// know. Pass-through adaptors report nothing of their own.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Inspection {
    /// Bytes the resource holds from its upstream or the driver (reserved, mapped).
    pub held_bytes: Option<u64>,
    /// Bytes of its live allocations (as it counts them: rounded by suballocators).
    pub live_bytes: Option<u64>,
    /// Its live allocations.
    pub live_count: Option<u64>,
    /// Its peak of held bytes.
    pub peak_held_bytes: Option<u64>,
    /// Its peak of live bytes.
    pub peak_live_bytes: Option<u64>,
    /// Allocations it made in all.
    pub allocations: Option<u64>,
    /// Frees it took in all.
    pub frees: Option<u64>,
    /// The device's free memory now, for resources that ask the driver.
    pub device_free: Option<u64>,
    /// A suballocator's chunks with their used and free ranges (streams as raw handle values).
    pub chunks: Vec<ChunkMap<usize>>,
    /// Whether `chunks` is the resource's whole memory (a suballocator), so that its free ranges give
    /// the largest free block.
    pub has_chunks: bool,
    /// The history a recording adaptor keeps ([`crate::observe::HistoryResource`]).
    pub history: Option<Arc<History>>,
}

impl Inspection {
    /// Whether the resource reported anything about what it holds.
    pub fn knows_memory(&self) -> bool {
        self.held_bytes.is_some() || self.live_bytes.is_some()
    }
}
