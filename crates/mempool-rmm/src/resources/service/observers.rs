//! What the resource tells and reports: chunk observers attached and detached (told of every run mapped
//! and unmapped), its statistics and peaks, and the mapped runs a snapshot shows as its chunks.

use std::sync::Arc;

use mempool_suballoc::{self as suballoc, Engine};

use crate::resources::service::resource::ServiceResource;
use crate::resources::service::state::{all_groups, group_ranges, largest_free_mapped};
use crate::resources::service::types::{ChunkObserver, ObserverId, ServiceStats, Tag, TagStats};
use crate::resources::suballoc::StreamKey;

impl ServiceResource {
    /// Attaches `observer`: it is told of every run mapped now, at once, and of every later map and unmap
    /// until [`detach`](Self::detach).
    pub fn attach(&self, observer: Arc<dyn ChunkObserver>) -> ObserverId {
        let mut st = self.state();
        for (ri, r) in st.regions.iter().enumerate() {
            for range in group_ranges(ri, r, &all_groups(r)) {
                observer.mapped(range);
            }
        }
        let id = ObserverId(st.next_observer);
        st.next_observer += 1;
        st.observers.push((id, observer));
        id
    }

    /// Detaches an observer: it is told that every run mapped now is unmapping (so that it lets go of
    /// what it holds), then never called again. Returns whether it was attached.
    pub fn detach(&self, id: ObserverId) -> bool {
        let mut st = self.state();
        let Some(pos) = st.observers.iter().position(|(i, _)| *i == id) else {
            return false;
        };
        let (_, observer) = st.observers.remove(pos);
        for (ri, r) in st.regions.iter().enumerate() {
            for range in group_ranges(ri, r, &all_groups(r)) {
                observer.unmapping(range);
            }
        }
        true
    }

    /// What it holds now, in total and per tag.
    pub fn stats(&self) -> ServiceStats {
        let st = self.state();
        let chunk = self.chunk as u64;
        let tags = st
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| TagStats {
                tag: Tag(i as u32),
                name: r.name.clone(),
                asleep: r.asleep.as_ref().map(|s| s.mode),
                used_bytes: r.used,
                peak_used_bytes: r.peak_used,
                live_allocations: r.allocations - r.frees,
                allocations: r.allocations,
                frees: r.frees,
                mapped_bytes: r.table.mapped_count() as u64 * chunk,
                offloaded_bytes: r
                    .asleep
                    .as_ref()
                    .filter(|s| s.host.is_some())
                    .map_or(0, |s| (s.chunks.len() * self.chunk) as u64),
                largest_free_mapped: largest_free_mapped(r),
                exports: r.exports,
            })
            .collect();
        ServiceStats {
            mapped_bytes: st.mapped_chunks() * chunk,
            peak_mapped_bytes: st.peak_mapped,
            used_bytes: st.used,
            peak_used_bytes: st.peak_used,
            reservation_bytes: self.reservation.size() as u64,
            chunk_size: chunk,
            reclaims: st.reclaims,
            reclaimed_bytes: st.reclaimed_bytes,
            host_cache_bytes: st.host_cache.iter().map(|h| h.len as u64).sum(),
            tags,
        }
    }

    /// Sets every peak (the resource's and each tag's) to the current value. The watermark's reference is
    /// the peak of live bytes, so this also lets the resource hold less from now on.
    pub fn reset_peaks(&self) {
        let mut st = self.state();
        st.peak_used = st.used;
        st.peak_mapped = st.mapped_chunks() * self.chunk as u64;
        for r in &mut st.regions {
            r.peak_used = r.used;
        }
    }

    /// The mapped runs of the awake tags (adjacent mappings joined), each with its region engine's ranges
    /// clipped to it: what a snapshot shows as this resource's chunks. A live allocation lies in mapped
    /// memory, so no used range is cut; free ranges end where the mapping does.
    pub(super) fn mapped_runs(&self) -> Vec<suballoc::ChunkMap<usize>> {
        let st = self.state();
        let mut out = Vec::new();
        for r in st.regions.iter().filter(|r| r.asleep.is_none()) {
            let ranges: Vec<suballoc::MapRange<StreamKey>> =
                r.engine.memory_map().into_iter().flat_map(|m| m.ranges).collect();
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for m in r.mappings.values() {
                let (a, e) = (m.addr().0, m.addr().0 + m.len() as u64);
                match runs.last_mut() {
                    Some(last) if last.1 == a => last.1 = e,
                    _ => runs.push((a, e)),
                }
            }
            for (a, e) in runs {
                let clipped = ranges
                    .iter()
                    .filter(|g| g.addr < e && g.addr + g.size > a)
                    .map(|g| {
                        let (s, t) = (g.addr.max(a), (g.addr + g.size).min(e));
                        suballoc::MapRange {
                            addr: s,
                            size: t - s,
                            used: g.used,
                            stream: g.stream.map(StreamKey::handle),
                        }
                    })
                    .collect();
                out.push(suballoc::ChunkMap {
                    addr: a,
                    size: e - a,
                    ranges: clipped,
                });
            }
        }
        out
    }
}
