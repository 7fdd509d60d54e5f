//! Growth and reclaim: mapping chunks where an allocation lands (one physical allocation per run, one
//! access grant per run, observers told), unmapping the idle ones (after the tag's fences) when the reclaim
//! policy, an out-of-memory or [`ServiceResource::trim`] says so, and the drop that unmaps everything.

use std::ops::Range;
use std::sync::Arc;

use mempool_core::{Access, Mapping, PhysicalAllocation, StreamRef};
use mempool_suballoc::Engine;

use crate::error::Result;
use crate::resources::service::resource::ServiceResource;
use crate::resources::service::state::{all_groups, free_chunks, group_ranges, State};
use crate::resources::service::table::{over_watermark, runs};
use crate::resources::service::types::Reclaim;

impl ServiceResource {
    /// Waits for the frees still in flight into the tags it unmaps from (the events their streams
    /// recorded), then unmaps and releases every chunk no live allocation touches (every tag that is
    /// awake). Returns the bytes released.
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.state();
        self.unmap_idle(&mut st)
    }

    /// Unmaps every idle mapping of the awake tags (one no live allocation touches), after waiting for the
    /// frees in flight into those tags.
    fn unmap_idle(&self, st: &mut State) -> Result<u64> {
        let mut plan: Vec<(usize, Vec<usize>)> = Vec::new();
        for (ri, r) in st.regions.iter().enumerate() {
            if r.asleep.is_some() || r.mappings.is_empty() {
                continue;
            }
            let free = free_chunks(r);
            let chunk = self.chunk;
            let idle: Vec<usize> = r
                .mappings
                .iter()
                .filter(|(&start, m)| (start..start + m.len() / chunk).all(|i| free[i]))
                .map(|(&start, _)| start)
                .collect();
            if !idle.is_empty() {
                plan.push((ri, idle));
            }
        }
        if plan.is_empty() {
            return Ok(0);
        }
        // Frees were stream-ordered; unmapping is not: wait until no work can touch the chunks. An idle
        // chunk lies wholly in free blocks, and every use of a free block was queued before its free, on
        // the free's stream: the tag's fences. Not the whole context: other tags' work, and other users'
        // of the device, go on.
        for (ri, _) in &plan {
            st.regions[*ri].fences.wait()?;
        }
        let mut released = 0u64;
        for (ri, idle) in plan {
            // Waited: the fences above, and no live allocation touches an idle chunk.
            released += self.unmap_groups(st, ri, &idle, true);
        }
        st.reclaimed_bytes += released;
        Ok(released)
    }

    /// Tells the observers, then unmaps and releases the mappings that start at `starts` (sorted) in
    /// region `ri`. Returns the bytes released.
    ///
    /// `waited`: the caller waited for every piece of work that may touch these mappings (the frees in
    /// flight into the tag: its fences; and what the resource itself queued on them), so they are unmapped
    /// at once; otherwise each mapping's drop waits for the whole device first (the fallback where such a
    /// wait failed).
    pub(super) fn unmap_groups(&self, st: &mut State, ri: usize, starts: &[usize], waited: bool) -> u64 {
        for range in group_ranges(ri, &st.regions[ri], starts) {
            for (_, o) in &st.observers {
                o.unmapping(range);
            }
        }
        let r = &mut st.regions[ri];
        let mut released = 0u64;
        for &g in starts {
            if let Some(m) = r.mappings.remove(&g) {
                let n = m.len() / self.chunk;
                released += m.len() as u64;
                if waited {
                    // SAFETY: 1. the caller waited for all work that touches the mapping (`waited`, this
                    // function's contract: the tag's fences cover every use of freed memory, the
                    // resource's own copies were waited for, and live allocations' work is their owners'
                    // to have finished, which `sleep` states). 2. the range goes back to the resource:
                    // nothing is handed it until it is mapped again.
                    #[allow(unsafe_code)]
                    unsafe {
                        m.unmap_waited()
                    };
                } else {
                    // Unmapping waits for the device first (the mapping's drop).
                    drop(m);
                }
                for i in g..g + n {
                    r.table.set_mapped(i, false);
                }
            }
        }
        released
    }

    /// Maps `chunks` (sorted, unmapped) of region `ri`, a run at a time, one access grant per run, and
    /// tells the observers. On failure, what this call mapped is unmapped again.
    fn map_chunks(&self, st: &mut State, ri: usize, chunks: &[usize]) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        let result = (|| -> Result<()> {
            for run in runs(chunks.iter().copied()) {
                self.map_run(st, ri, run, usize::MAX, &mut done)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            // Nothing used the new mappings: they were never handed out.
            self.undo_maps(st, ri, &mut done, true);
            return Err(e);
        }
        Ok(())
    }

    /// Maps one run of unmapped chunks of region `ri` as physical allocations of at most `max_group`
    /// chunks, grants access once over the run, and tells the observers; `done` collects the first chunk
    /// of every mapping recorded (for an undo).
    pub(super) fn map_run(
        &self,
        st: &mut State,
        ri: usize,
        run: Range<usize>,
        max_group: usize,
        done: &mut Vec<usize>,
    ) -> Result<()> {
        let first_done = done.len();
        let mut start = run.start;
        while start < run.end {
            let n = (run.end - start).min(max_group);
            let phys = Arc::new(PhysicalAllocation::new(&self.props, n * self.chunk)?);
            let offset = ri * self.region_size + st.regions[ri].table.offset(start);
            let m = Mapping::without_access(&self.reservation, offset, phys)?;
            let r = &mut st.regions[ri];
            r.mappings.insert(start, m);
            for i in start..start + n {
                r.table.set_mapped(i, true);
            }
            done.push(start);
            start += n;
        }
        let offset = ri * self.region_size + st.regions[ri].table.offset(run.start);
        self.reservation.set_access(
            offset,
            run.len() * self.chunk,
            &[(self.props.device, Access::ReadWrite)],
        )?;
        for range in group_ranges(ri, &st.regions[ri], &done[first_done..]) {
            for (_, o) in &st.observers {
                o.mapped(range);
            }
        }
        let mapped = st.mapped_chunks() * self.chunk as u64;
        st.peak_mapped = st.peak_mapped.max(mapped);
        Ok(())
    }

    /// Unmaps the mappings a failed call made (`done` holds their first chunks). The observers see them
    /// unmapping (they may have been told of them). `waited`: as [`unmap_groups`](Self::unmap_groups)'s,
    /// true when nothing used them or what did was waited for.
    pub(super) fn undo_maps(&self, st: &mut State, ri: usize, done: &mut [usize], waited: bool) {
        if done.is_empty() {
            return;
        }
        done.sort_unstable();
        self.unmap_groups(st, ri, done, waited);
    }

    /// Maps the unmapped chunks of `span` in region `ri` for an allocation of `rounded` bytes, reclaiming
    /// idle chunks first when the policy says so, and once more after running out of memory.
    pub(super) fn grow(
        &self,
        st: &mut State,
        ri: usize,
        span: Range<usize>,
        rounded: u64,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let need = st.regions[ri].table.unmapped(span.clone());
        let new = (need.len() * self.chunk) as u64;
        // Reclaiming waits for the frees in flight (host-synchronizes events, and the whole context when
        // one cannot be waited for), which a stream being captured into a graph forbids (it would
        // invalidate the capture): then the resource only maps, and an out-of-memory is not retried.
        let capturing = self.own_context(stream).is_capturing()?;
        let reclaim = !capturing
            && match self.reclaim {
                Reclaim::OnOutOfMemory => false,
                Reclaim::BeforeGrowth => true,
                Reclaim::Watermark { percent } => {
                    let mapped = st.mapped_chunks() * self.chunk as u64;
                    over_watermark(mapped, new, st.peak_used.max(st.used + rounded), percent)
                }
            };
        if reclaim {
            // The new block is live in the engine, so its chunks are not idle: only others are unmapped.
            if self.unmap_idle(st)? > 0 {
                st.reclaims += 1;
            }
        }
        let mut result = self.map_chunks(st, ri, &need);
        if !capturing && matches!(&result, Err(e) if e.is_out_of_memory()) {
            // Give back what no live allocation touches, then try once more.
            result = self.unmap_idle(st).and_then(|_| self.map_chunks(st, ri, &need));
        }
        result
    }
}

impl Drop for ServiceResource {
    /// Returns everything, live allocations included, as RMM's resources do when destroyed: waits for the
    /// frees still in flight (each tag's fences), tells the observers, unmaps and releases every chunk,
    /// then frees the range. Errors go to `mempool_core::take_drop_errors`.
    fn drop(&mut self) {
        let mut st = self.state();
        // Every use of freed memory is behind the fences. Allocations never freed are another matter: no
        // fence covers the work their owners queued, and the range goes back to the driver below (to be
        // handed to anyone after), so while any is live (awake or asleep) the whole context is waited
        // for: the one case where a context-wide wait stays on this path.
        let fenced = st.regions.iter().all(|r| r.fences.wait().is_ok());
        let waited = fenced && (st.used == 0 || self.ctx.synchronize().is_ok());
        for r in &mut st.regions {
            // Forgets the blocks; its wait for stored streams is the fences' (waited for above: a no-op).
            let _ = r.engine.release();
        }
        for ri in 0..st.regions.len() {
            let groups = all_groups(&st.regions[ri]);
            // `waited` (`unmap_groups`'s contract): 1. every use of freed memory was waited for (the fences),
            // and with allocations still live, all of the context's work too (above); the resource's own
            // copies were waited for by the calls that queued them. 2. the resource is going away: nothing
            // is handed these addresses again through it. Where a wait failed, each mapping's drop waits for
            // the device itself, and keeps (leaks) what it cannot unmap.
            self.unmap_groups(&mut st, ri, &groups, waited);
        }
    }
}
