//! When shared buffers are freed: at once when the exporter lets go of a buffer nobody else
//! holds; deferred to the internal stream when the last importer releases it; reclaimed when an
//! importer's connection ends without releasing, once its process is gone; abandoned when the
//! exporter shuts down while an importer that outlived the timeout still holds it.
//!
//! Two rules of the fast release path (protocol version 2) come in here: a free waits (on the
//! GPU) for the release events importers sent with their releases, and the last buffer of a
//! block that an importer keeps imported is parked, not freed, until every such importer is
//! gone, so the block's allocation never goes back to the driver under a kept import.

use mempool_core::{Event, EventFlags, StreamRef};

use super::state::{Freer, Inner, Shared};
use crate::error::{record_drop_error, Error, Result};
use crate::lease::ImporterId;
use crate::protocol::BufferId;
use crate::trace::{self, Point};

impl Inner {
    /// The exporter lets go of buffer `id`, whose last use is on `stream`: frees it there if no
    /// importer holds it, otherwise defers the free to the last importer's release.
    pub(super) fn release_owner(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        let held = self.lock().leases.holders(id).next().is_some();
        // Importers hold it: the deferred free must come after the owner's last use, which is on
        // `stream`. Record that before letting go, so a release that arrives meanwhile sees it.
        let last_use = if held {
            let event = Event::new(&self.ctx, EventFlags::DISABLE_TIMING)?;
            event.record(stream)?;
            Some(event)
        } else {
            None
        };
        let mut state = self.lock();
        let freed = state.leases.release_owner(id)?;
        match freed {
            Some(shared) => {
                drop(state);
                self.finish(id, shared, stream, false)
            }
            None => {
                if let Some(shared) = state.leases.get_mut(id) {
                    shared.last_use = last_use;
                }
                state.deferred += 1;
                Ok(())
            }
        }
    }

    /// Frees a buffer nobody holds any more, ordered on `stream`; parks it instead if it is the
    /// last buffer of a block that an importer keeps imported.
    pub(super) fn finish(&self, id: BufferId, shared: Shared, stream: StreamRef<'_>, deferred: bool) -> Result<()> {
        let result = self.finish_counted(id, shared, stream);
        if deferred {
            // Only now, with the free queued (or the buffer parked) and counted, does a deferred
            // buffer stop counting for `wait_idle`: a waiter woken earlier would read `freed` short.
            let mut state = self.lock();
            state.deferred = state.deferred.saturating_sub(1);
            drop(state);
            self.notify();
        }
        result
    }

    fn finish_counted(&self, id: BufferId, shared: Shared, stream: StreamRef<'_>) -> Result<()> {
        let mut state = self.lock();
        let base = shared.block_base;
        let last = state.blocks.get(&base).is_none_or(|b| b.live <= 1);
        let shared = if last {
            match state.pins.park(base, (id, shared)) {
                None => {
                    // Parked: the block stays recorded (and allocated) with this buffer live.
                    drop(state);
                    trace::mark(Point::ExporterFreed, id.0);
                    self.notify();
                    return Ok(());
                }
                Some((_, shared)) => shared,
            }
        } else {
            shared
        };
        // The block's record goes before the memory does, so that a buffer adopted meanwhile
        // from a new allocation at the same address gets a new block id.
        if let Some(block) = state.blocks.get_mut(&base) {
            block.live -= 1;
            if block.live == 0 {
                state.blocks.remove(&base);
            }
        }
        drop(state);
        self.free_now(id, shared, stream)
    }

    /// Frees a buffer whose block record is already accounted for, ordered on `stream` after its
    /// owner's last use and every importer's release event.
    fn free_now(&self, id: BufferId, mut shared: Shared, stream: StreamRef<'_>) -> Result<()> {
        let mut result = Ok(());
        if let Some(last_use) = shared.last_use.take() {
            result = stream.wait(&last_use).map_err(Error::from);
        }
        for event in std::mem::take(&mut shared.release_waits) {
            if result.is_ok() {
                result = stream.wait(&event).map_err(Error::from);
            }
        }
        if result.is_ok() {
            result = match shared.free.take() {
                Some(Freer::Custom(free)) => free(shared.ptr, shared.len, stream).map_err(|e| match e {
                    Error::Free { source, .. } => Error::Free { buffer: id, source },
                    other => other,
                }),
                // SAFETY: the pointer came from `allocate` on this pool (`Exporter::alloc`) and is
                // freed once: the lease table hands each record out once and `take` empties it.
                // Every holder is done: the owner's last use is on `stream` (or `stream` waits for
                // it, above), importers synchronized before releasing or are gone.
                #[allow(unsafe_code)]
                Some(Freer::Pool) => unsafe { self.source.pool().free_async(shared.ptr, stream) }.map_err(Error::from),
                None => Ok(()),
            };
        }
        trace::mark(Point::ExporterFreed, id.0);
        let mut state = self.lock();
        state.freed += 1;
        // Every importer that waited on these events has released (or is gone), and the free is
        // queued: they can order the next buffer.
        state.idle_events.append(&mut shared.events);
        drop(state);
        self.notify();
        result
    }

    /// Frees buffers whose last holder was an importer, on the internal stream.
    pub(super) fn finish_deferred(&self, freed: Vec<(BufferId, Shared)>) {
        for (id, shared) in freed {
            if let Err(e) = self.finish(id, shared, self.free_stream.as_ref(), true) {
                record_drop_error(e);
            }
        }
    }

    /// The connection of importer `id` ended: cleanly (`Goodbye`, every import freed) or not
    /// (closed, broke the protocol, stalled, timed out). Buffers whose frames never went out
    /// (`undelivered`) are revoked at once: the importer never saw them. After a clean end, or
    /// if it holds nothing else, every buffer it held counts as released now. Otherwise its
    /// process may still run GPU work on them: returns `true`, and the serving thread calls
    /// [`Inner::reclaim`] once the process is gone (or [`Inner::abandon`] at shutdown).
    pub(super) fn importer_ended(&self, id: ImporterId, clean: bool, undelivered: Vec<BufferId>) -> bool {
        let mut state = self.lock();
        state.importers.remove(&id);
        let mut freed = Vec::new();
        for buffer in undelivered {
            if let Ok(Some(shared)) = state.leases.revoke(buffer, id) {
                freed.push((buffer, shared));
            }
        }
        let holds = state.leases.leases_of(id).next().is_some() || state.pins.keeps_any(id);
        let wait = !clean && holds;
        let mut unparked = Vec::new();
        if !wait {
            freed.extend(state.leases.disconnect(id));
            unparked = state.pins.importer_gone(id);
            // Counted as deferred until `free_unparked` has freed them, so `wait_idle` waits.
            state.deferred += unparked.len();
        }
        drop(state);
        self.finish_deferred(freed);
        self.free_unparked(unparked);
        self.notify_all_waiters();
        wait
    }

    /// The process of importer `id`, whose connection ended uncleanly, is gone: every buffer it
    /// held counts as released, and those nobody holds any more are freed.
    pub(super) fn reclaim(&self, id: ImporterId) {
        let (freed, unparked) = {
            let mut state = self.lock();
            let freed = state.leases.disconnect(id);
            state.reclaimed += freed.len() as u64;
            let unparked = state.pins.importer_gone(id);
            // Counted as deferred until `free_unparked` has freed them, so `wait_idle` waits.
            state.deferred += unparked.len();
            (freed, unparked)
        };
        self.finish_deferred(freed);
        self.free_unparked(unparked);
        self.notify_all_waiters();
    }

    /// The exporter shuts down while importer `id` (or its process) is still there: what only
    /// it holds is not freed (it may still use it) but kept, so its events stay alive, until the
    /// exporter's last reference goes.
    pub(super) fn abandon(&self, id: ImporterId) {
        let mut state = self.lock();
        let kept = state.leases.disconnect(id);
        state.abandoned += kept.len() as u64;
        state.leaked.extend(kept.into_iter().map(|(_, s)| s));
        // Blocks it may still have imported stay allocated: their parked buffers are kept too.
        let parked: Vec<_> = state.pins.importer_gone(id).into_iter().map(|(_, (_, s))| s).collect();
        state.abandoned += parked.len() as u64;
        state.leaked.extend(parked);
        drop(state);
        self.notify_all_waiters();
    }

    /// Frees the parked buffers of blocks that no importer keeps imported any more, on the
    /// internal stream.
    /// Frees buffers that were parked for a block an importer kept, once no importer keeps it; the
    /// caller counted each in `deferred`, under the lock it unparked them with.
    fn free_unparked(&self, unparked: Vec<(u64, (BufferId, Shared))>) {
        for (base, (id, shared)) in unparked {
            {
                let mut state = self.lock();
                if let Some(block) = state.blocks.get_mut(&base) {
                    block.live -= 1;
                    if block.live == 0 {
                        state.blocks.remove(&base);
                    }
                }
            }
            if let Err(e) = self.free_now(id, shared, self.free_stream.as_ref()) {
                record_drop_error(e);
            }
            // The free is queued and counted: it stops counting for `wait_idle` (see the callers).
            let mut state = self.lock();
            state.deferred = state.deferred.saturating_sub(1);
            drop(state);
            self.notify();
        }
    }
}
