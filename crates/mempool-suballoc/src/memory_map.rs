//! A read-only picture of an engine's memory for snapshots and out-of-memory reports: each upstream
//! chunk with its used and free ranges in address order ([`Engine::memory_map`](crate::Engine::memory_map)).
//! Built on demand, off the allocation path. Imports nothing of the crate but [`Block`].

use crate::block::Block;

/// One range of a chunk: a live allocation (`used`) or a free block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapRange<S> {
    /// First address.
    pub addr: u64,
    /// Length in bytes (an allocation's rounded size, or a free block's size).
    pub size: u64,
    /// A live allocation (`true`) or free memory (`false`).
    pub used: bool,
    /// The stream whose free list holds a free range; `None` for live allocations (the engines do
    /// not keep their stream) and for free memory of no stream.
    pub stream: Option<S>,
}

/// One upstream chunk and its ranges, which cover it exactly, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMap<S> {
    /// Start of the chunk.
    pub addr: u64,
    /// Its size.
    pub size: u64,
    /// Its ranges, in address order, together covering `[addr, addr + size)`.
    pub ranges: Vec<MapRange<S>>,
}

impl<S> ChunkMap<S> {
    /// Bytes of the free ranges.
    pub fn free_bytes(&self) -> u64 {
        self.ranges.iter().filter(|r| !r.used).map(|r| r.size).sum()
    }

    /// The largest free range, 0 when none.
    pub fn largest_free(&self) -> u64 {
        self.ranges
            .iter()
            .filter(|r| !r.used)
            .map(|r| r.size)
            .max()
            .unwrap_or(0)
    }
}

/// What a memory map says in a few numbers: the reserved, free bytes and the largest free range of
/// every chunk together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapSummary {
    /// Bytes of all chunks.
    pub reserved_bytes: u64,
    /// Bytes of all free ranges.
    pub free_bytes: u64,
    /// The largest free range of any chunk.
    pub largest_free: u64,
    /// Free ranges.
    pub free_ranges: usize,
    /// Chunks.
    pub chunks: usize,
}

/// Sums up `maps`.
pub fn summarize<S>(maps: &[ChunkMap<S>]) -> MapSummary {
    let mut s = MapSummary {
        chunks: maps.len(),
        ..MapSummary::default()
    };
    for m in maps {
        s.reserved_bytes += m.size;
        for r in m.ranges.iter().filter(|r| !r.used) {
            s.free_bytes += r.size;
            s.free_ranges += 1;
            s.largest_free = s.largest_free.max(r.size);
        }
    }
    s
}

/// Builds chunk maps from `chunks` (start, size) and `ranges` (blocks inside them, disjoint, with
/// whether they are used and their stream): each range goes to the chunk the block names (its
/// `chunk` field), ranges are sorted by address, and a chunk's gaps (none in a consistent engine)
/// are left out. Chunks come out in address order.
pub(crate) fn build<S: Copy>(
    chunks: impl IntoIterator<Item = (u64, u64)>,
    ranges: impl IntoIterator<Item = (Block, bool, Option<S>)>,
) -> Vec<ChunkMap<S>> {
    let mut maps: Vec<ChunkMap<S>> = chunks
        .into_iter()
        .map(|(addr, size)| ChunkMap {
            addr,
            size,
            ranges: Vec::new(),
        })
        .collect();
    maps.sort_unstable_by_key(|m| m.addr);
    for (b, used, stream) in ranges {
        if let Ok(i) = maps.binary_search_by_key(&b.chunk, |m| m.addr) {
            maps[i].ranges.push(MapRange {
                addr: b.addr,
                size: b.size,
                used,
                stream,
            });
        }
    }
    for m in &mut maps {
        m.ranges.sort_unstable_by_key(|r| r.addr);
    }
    maps
}
