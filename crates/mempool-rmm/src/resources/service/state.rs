//! The resource's state under its lock, with no CUDA calls of its own: each tag's [`Region`] (its pool
//! engine over [`WholeRange`], its chunk table and mappings, its fences, whether it sleeps) and the totals
//! of [`State`]; and the helpers every concern reads a region with (its mappings' ranges as observers see
//! them, its free chunks, its largest free mapped block).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mempool_core::{DeviceAddr, Mapping};
use mempool_suballoc::{self as suballoc, PoolEngine, Upstream};

use crate::error::Result;
use crate::resources::service::fences::{Fences, RegionStreams};
use crate::resources::service::pinned::PinnedHost;
use crate::resources::service::table::ChunkTable;
use crate::resources::service::types::{ChunkObserver, ChunkRange, ObserverId, SleepMode, Tag};
use crate::resources::suballoc::StreamKey;

/// A region's engine upstream: the whole region, handed out once as a single chunk (the one segment).
#[derive(Debug)]
pub(crate) struct WholeRange {
    base: u64,
    size: u64,
    taken: AtomicBool,
}

impl WholeRange {
    pub(crate) fn new(base: u64, size: u64) -> WholeRange {
        WholeRange {
            base,
            size,
            taken: AtomicBool::new(false),
        }
    }
}

impl Upstream<StreamKey> for WholeRange {
    fn allocate(&self, bytes: u64, _stream: StreamKey) -> Result<u64, suballoc::Error> {
        if bytes <= self.size && !self.taken.swap(true, Ordering::AcqRel) {
            Ok(self.base)
        } else {
            Err(suballoc::Error::OutOfMemory {
                requested: bytes,
                cause: suballoc::OutOfMemoryCause::Upstream,
            })
        }
    }

    fn deallocate(&self, _addr: u64, _bytes: u64, _stream: StreamKey) -> Result<(), suballoc::Error> {
        // Chunks are unmapped by the resource, never by the engine; address space stays.
        self.taken.store(false, Ordering::Release);
        Ok(())
    }
}

/// A sleeping tag: which chunks to map back, and where their contents wait.
pub(super) struct Sleeping {
    pub(super) mode: SleepMode,
    /// The chunks live allocations touched when it fell asleep, in order; with `Offload`, chunk
    /// `chunks[k]` is saved at `k * chunk` of `host`.
    pub(super) chunks: Vec<usize>,
    pub(super) host: Option<PinnedHost>,
}

pub(super) struct Region {
    pub(super) name: String,
    pub(super) engine: PoolEngine<WholeRange, RegionStreams>,
    /// The frees into the tag still in flight: waited for before any of its chunks is unmapped (and by
    /// the engine where it would block on a stream it stored).
    pub(super) fences: Arc<Fences>,
    pub(super) table: ChunkTable,
    /// The mappings, by their first chunk, in address order; each spans `len / chunk` chunks, all marked
    /// mapped in `table` (the mapping a chunk belongs to is the last one starting at or before it).
    pub(super) mappings: BTreeMap<usize, Mapping>,
    pub(super) asleep: Option<Sleeping>,
    pub(super) used: u64,
    pub(super) peak_used: u64,
    pub(super) allocations: u64,
    pub(super) frees: u64,
    pub(super) exports: u64,
}

pub(super) struct State {
    pub(super) regions: Vec<Region>,
    pub(super) used: u64,
    pub(super) peak_used: u64,
    pub(super) peak_mapped: u64,
    pub(super) reclaims: u64,
    pub(super) reclaimed_bytes: u64,
    pub(super) observers: Vec<(ObserverId, Arc<dyn ChunkObserver>)>,
    pub(super) next_observer: u64,
    /// Pinned host buffers that held offloaded tags, kept for the next offload: pinning and unpinning
    /// host memory costs far more than the copies (as PyTorch's pinned-memory cache keeps its blocks).
    pub(super) host_cache: Vec<PinnedHost>,
}

impl State {
    pub(super) fn mapped_chunks(&self) -> u64 {
        self.regions.iter().map(|r| r.table.mapped_count() as u64).sum()
    }
}

/// The address ranges of region `ri`'s mappings that start at chunks `starts` (one physical allocation
/// each), as observers are told of them.
pub(super) fn group_ranges(ri: usize, r: &Region, starts: &[usize]) -> Vec<ChunkRange> {
    starts
        .iter()
        .filter_map(|&g| {
            r.mappings.get(&g).map(|m| ChunkRange {
                tag: Tag(ri as u32),
                addr: DeviceAddr(r.table.addr(g)),
                len: m.len(),
            })
        })
        .collect()
}

/// The first chunks of every mapping of region `r`, sorted.
pub(super) fn all_groups(r: &Region) -> Vec<usize> {
    r.mappings.keys().copied().collect()
}

/// Per chunk of region `r`: whether it lies wholly in free space (no live allocation touches it).
pub(super) fn free_chunks(r: &Region) -> Vec<bool> {
    r.table
        .free_chunks(r.engine.free_blocks().map(|(_, b)| (b.addr, b.addr + b.size)))
}

/// The largest free block of region `r`'s engine that lies in mapped memory.
pub(super) fn largest_free_mapped(r: &Region) -> u64 {
    r.engine
        .free_blocks()
        .map(|(_, b)| r.table.largest_mapped_piece(b.addr, b.addr + b.size))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_engine_sees_one_segment_and_never_more() {
        let up = WholeRange::new(1 << 40, 64 * MIB);
        let key = StreamKey::from_parts(1, 0);
        assert_eq!(up.allocate(64 * MIB, key).unwrap(), 1 << 40);
        assert!(
            matches!(up.allocate(MIB, key), Err(suballoc::Error::OutOfMemory { requested, .. }) if requested == MIB)
        );
        up.deallocate(1 << 40, 64 * MIB, key).unwrap();
        assert!(up.allocate(65 * MIB, key).is_err(), "more than the range");
        assert_eq!(up.allocate(MIB, key).unwrap(), 1 << 40);
    }
}
