//! Sleep and wake: a tag's physical memory released with its addresses kept (its contents offloaded to
//! pinned host memory or discarded), then mapped back at the same addresses in batches with the contents
//! copied back; the cache of pinned host buffers kept between offloads.

use std::ops::Range;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resources::service::pinned::PinnedHost;
use crate::resources::service::resource::ServiceResource;
use crate::resources::service::state::{all_groups, free_chunks, Sleeping, State};
use crate::resources::service::table::{runs, wake_runs, ChunkTable};
use crate::resources::service::types::{SleepMode, SleepReport, Tag, WakeReport};

/// The most chunks one physical allocation (one mapping) spans when wake maps a tag back: the driver's
/// cost is per call (create, map), not per byte, so 64 MiB is one call where 2 MiB chunks would be 32,
/// and batches this size let the copy of one overlap the mapping of the next. Growth maps the chunks an
/// allocation needs as one physical allocation, whatever their number: a buffer that grew the pool then
/// lies in one `cuMemCreate` allocation, which NCCL's registered transports are expected to need
/// (registrations merged across several ran at unregistered speed), and a mapping is unmapped only when
/// no live allocation touches any of its chunks, which is true of the whole allocation's run once it is
/// freed.
const GROUP_CHUNKS: usize = 32;

/// Chunks restored per batch on wake (map, grant access, queue the copy), so that mapping the next batch
/// overlaps the copy of this one.
const WAKE_BATCH: usize = 64;

impl ServiceResource {
    /// Releases the physical memory of `tags`, keeping their addresses (and their live allocations)
    /// reserved: with [`SleepMode::Offload`] the chunks live allocations touch are first copied to pinned
    /// host memory (a buffer kept from an earlier offload when one is large enough, else a new one), ordered
    /// on `stream`; with [`SleepMode::Discard`] their contents are lost. Observers are told.
    ///
    /// Before it unmaps anything it waits for the frees into the tags still in flight, whatever stream
    /// each was made on (the events the resource recorded at each free, host-synchronized: a block freed
    /// on a stream whose kernel still runs is unmapped only once that kernel is done), and for its own
    /// offload copies. Where a tag still has live allocations it also waits for the whole context: the
    /// resource hands out their addresses and never sees the streams that use them, so that is the only
    /// wait that covers work still using them. A sleep of tags with nothing live does not wait for the
    /// whole device: other tags', resources' and libraries' work goes on. `stream` must be idle (checked).
    ///
    /// Refused, with nothing changed: a tag that is not this resource's, or already sleeps; a tag with
    /// ranges shared with another process ([`export`](Self::export)); `stream` with work still pending.
    /// Tags sleep one after the other: when one fails later (out of pinned host memory for its offload, a
    /// copy the driver refuses), the tags before it in `tags` are asleep, it and those after it are awake
    /// with their memory as it was, and [`stats`](Self::stats) says which.
    ///
    /// While a tag sleeps, allocating from it and exporting from it are refused; freeing into it is
    /// taken as bookkeeping (the block returns to the tag's free list as address space, and its chunks
    /// that no live allocation touches are not mapped back by `wake`).
    pub fn sleep(&self, tags: &[Tag], mode: SleepMode, stream: StreamRef<'_>) -> Result<SleepReport> {
        let stream = self.own_context(stream);
        let mut st = self.state();
        let mut idx = Vec::with_capacity(tags.len());
        for &t in tags {
            let ri = self.region_index(&st, t)?;
            let r = &st.regions[ri];
            if r.asleep.is_some() {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: format!("tag `{}` is already asleep", r.name),
                });
            }
            if r.exports > 0 {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: format!(
                        "tag `{}` cannot sleep: {} of its ranges are shared with another process (each is \
                         released when its importers let go)",
                        r.name, r.exports
                    ),
                });
            }
            if !idx.contains(&ri) {
                idx.push(ri);
            }
        }
        self.check_idle(stream)?;
        // The frees in flight into these tags, on any stream (their fences): every use of their free
        // blocks. Waited for before any tag changes, so a failure here leaves them all awake.
        for &ri in &idx {
            st.regions[ri].fences.wait()?;
        }
        // Live allocations of these tags may still be used by work on streams the resource never saw (an
        // event recorded when they were allocated covers nothing queued after it): where any is live, the
        // only wait that covers that work is the context's. A tag with nothing live needs none.
        let live = idx.iter().any(|&ri| {
            let free = free_chunks(&st.regions[ri]);
            st.regions[ri].table.mapped_chunks().into_iter().any(|i| !free[i])
        });
        if live {
            self.ctx.synchronize()?;
        }
        let mut report = SleepReport::default();
        for &ri in &idx {
            let free = free_chunks(&st.regions[ri]);
            let touched: Vec<usize> = st.regions[ri]
                .table
                .mapped_chunks()
                .into_iter()
                .filter(|&i| !free[i])
                .collect();
            let host = match mode {
                SleepMode::Discard => None,
                SleepMode::Offload if touched.is_empty() => None,
                SleepMode::Offload => {
                    let want = touched.len() * self.chunk;
                    // The smallest cached buffer that fits, else a new one.
                    let fit = (0..st.host_cache.len())
                        .filter(|&i| st.host_cache[i].len >= want)
                        .min_by_key(|&i| st.host_cache[i].len);
                    let host = match fit {
                        Some(i) => st.host_cache.swap_remove(i),
                        None => PinnedHost::new(&self.ctx, want)?,
                    };
                    let queued = self.copy_at(&st.regions[ri].table, &touched, &host, 0, Direction::Save, stream);
                    // Wait even when a copy could not be queued: those queued before it write into `host`,
                    // which the error return frees.
                    let waited = stream.synchronize();
                    queued?;
                    waited?;
                    report.offloaded_bytes += want as u64;
                    Some(host)
                }
            };
            let groups = all_groups(&st.regions[ri]);
            // Waited: the fences (frees in flight), the offload's copies (`stream`, synchronized), and the
            // live allocations' work (the context, above, where anything is live).
            report.released_bytes += self.unmap_groups(&mut st, ri, &groups, true);
            st.regions[ri].asleep = Some(Sleeping {
                mode,
                chunks: touched,
                host,
            });
        }
        Ok(report)
    }

    /// Maps the memory of sleeping `tags` back at the same addresses (the chunks live allocations touch:
    /// those they touched when the tags fell asleep, less the ones only allocations freed since touched)
    /// and, for offloaded tags, copies the contents back, ordered on `stream`; waits
    /// for `stream` before it returns. Observers are told. Tags that are awake are skipped. The pinned host
    /// buffers of offloaded tags are kept for the next offload
    /// ([`release_host_cache`](Self::release_host_cache) frees them).
    ///
    /// On a failure (out of memory), what this call mapped for the failing tag is unmapped again and the
    /// tag stays asleep with its saved contents: nothing is lost, and `wake` can be called again.
    pub fn wake(&self, tags: &[Tag], stream: StreamRef<'_>) -> Result<WakeReport> {
        let stream = self.own_context(stream);
        let mut st = self.state();
        for &t in tags {
            self.region_index(&st, t)?;
        }
        let mut report = WakeReport::default();
        for &t in tags {
            let ri = t.index();
            let Some(sleeping) = st.regions[ri].asleep.take() else {
                continue;
            };
            // Frees taken while asleep may have left saved chunks that no live allocation touches: those
            // stay unmapped.
            let plan = wake_runs(&sleeping.chunks, &free_chunks(&st.regions[ri]));
            let bytes = (plan.iter().map(|(run, _)| run.len()).sum::<usize>() * self.chunk) as u64;
            match self.restore(&mut st, ri, &plan, sleeping.host.as_ref(), stream) {
                Ok(()) => {
                    report.mapped_bytes += bytes;
                    if let Some(host) = sleeping.host {
                        report.restored_bytes += bytes;
                        // The copies were waited for: the buffer is free for the next offload.
                        st.host_cache.push(host);
                    }
                }
                Err(e) => {
                    st.regions[ri].asleep = Some(sleeping);
                    return Err(e);
                }
            }
        }
        Ok(report)
    }

    /// Maps the runs of `plan` (each with the index of its first chunk's saved copy in `host`, as
    /// [`wake_runs`] gives them) of region `ri` back in batches, queuing each batch's copy from `host`
    /// (an offload's) before mapping the next, then waits for `stream`.
    fn restore(
        &self,
        st: &mut State,
        ri: usize,
        plan: &[(Range<usize>, usize)],
        host: Option<&PinnedHost>,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        let result = (|| -> Result<()> {
            for (run, first) in plan {
                let mut start = run.start;
                while start < run.end {
                    let end = (start + WAKE_BATCH).min(run.end);
                    self.map_run(st, ri, start..end, GROUP_CHUNKS, &mut done)?;
                    if let Some(host) = host {
                        let chunks: Vec<usize> = (start..end).collect();
                        let k = first + (start - run.start);
                        self.copy_at(&st.regions[ri].table, &chunks, host, k, Direction::Restore, stream)?;
                    }
                    start = end;
                }
            }
            stream.synchronize()?;
            Ok(())
        })();
        if let Err(e) = result {
            // Copies already queued read the host memory and write chunks about to be unmapped: wait for
            // them. They are all on `stream` (the tag sleeps: nothing else uses its chunks). When the
            // stream's wait fails it cannot tell that they ended; the context's wait can, and is kept as
            // that fallback alone (and when it fails too, each mapping's drop waits and keeps what it
            // cannot unmap).
            let waited = stream.synchronize().is_ok() || self.ctx.synchronize().is_ok();
            self.undo_maps(st, ri, &mut done, waited);
            return Err(e);
        }
        Ok(())
    }

    /// Queues copies between `chunks` (sorted, mapped) and `host`, one per run of chunks: chunk `chunks[k]`
    /// is saved at `(first + k) * chunk` of `host`.
    fn copy_at(
        &self,
        table: &ChunkTable,
        chunks: &[usize],
        host: &PinnedHost,
        first: usize,
        dir: Direction,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let mut k = first;
        for run in runs(chunks.iter().copied()) {
            let dev = DeviceAddr(table.addr(run.start));
            let len = run.len() * self.chunk;
            let at = host.addr(k * self.chunk);
            if (k + run.len()) * self.chunk > host.len {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: "internal: a copy would run past the host buffer".into(),
                });
            }
            let (dst, src) = match dir {
                Direction::Save => (at, dev),
                Direction::Restore => (dev, at),
            };
            // SAFETY: 1. `dev..dev+len` is mapped (the chunks are mapped, with read-write access for the
            // device) and stays mapped until the copy completes: sleep and wake wait for `stream` before
            // anything is unmapped or the host memory freed. `at..at+len` lies inside `host` (checked
            // above), page-locked memory the copy engines reach at its unified address, alive until the
            // same wait.
            #[allow(unsafe_code)]
            unsafe { mempool_core::memory::copy_device_async(&self.ctx, dst, src, len, stream) }?;
            k += run.len();
        }
        Ok(())
    }

    /// Refuses when `stream` has work still queued. `cuStreamQuery`, not an event recorded now: an event
    /// recorded on an idle stream completes only once the device has processed the record, so a query right
    /// after it can read "not ready" with nothing queued.
    fn check_idle(&self, stream: StreamRef<'_>) -> Result<()> {
        if !self.own_context(stream).is_idle()? {
            return Err(Error::Unsupported {
                resource: self.name,
                reason: "cannot sleep while the stream given has work still queued (it may use the memory \
                         being released): synchronize it first"
                    .into(),
            });
        }
        Ok(())
    }

    /// Frees the pinned host buffers kept from earlier offloads (see
    /// [`ServiceStats::host_cache_bytes`](super::ServiceStats::host_cache_bytes)). Returns the bytes freed.
    pub fn release_host_cache(&self) -> u64 {
        let cache = std::mem::take(&mut self.state().host_cache);
        cache.iter().map(|h| h.len as u64).sum()
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Direction {
    Save,
    Restore,
}
