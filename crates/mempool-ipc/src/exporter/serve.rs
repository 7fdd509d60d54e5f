//! What the serving thread tells the exporter ([`Handler`]: an importer connected, released a
//! buffer, left, or its process is gone), and the shutdown that says `Goodbye` to every
//! importer and waits for their releases. The connections themselves are the crate's `reactor`,
//! one event loop for all of them.

use std::sync::atomic::Ordering;
use std::time::Instant;

use std::sync::Arc;

use mempool_core::{Event, IpcEventHandle};

use super::state::{AfterEvent, Inner, Peer, MAX_RELEASE_EVENTS};
use crate::error::Result;
use crate::lease::ImporterId;
use crate::protocol::{BufferId, EventHandle, ProtocolError, ReleaseBatch};
use crate::reactor::Handler;
use crate::trace::{self, Point};
use mempool_socket::cred::PeerCredentials;

impl Handler for Inner {
    fn connected(&self, id: ImporterId, credentials: PeerCredentials, capabilities: u64) {
        self.lock().importers.insert(
            id,
            Peer {
                credentials,
                capabilities,
                release_events: Vec::new(),
            },
        );
        self.notify();
    }

    fn released_batch(&self, id: ImporterId, batch: ReleaseBatch) -> Result<()> {
        // The importer's uses of these buffers are ordered before its event: wait on it now,
        // while the importer is surely there (it just sent it), and keep an event of our own;
        // nothing to wait for if the event is complete already.
        let after = match batch.event {
            Some(handle) => {
                let after = self.after_release_event(id, handle)?;
                if after.is_some() {
                    for buffer in &batch.buffers {
                        trace::mark(Point::ExporterReleasePending, buffer.0);
                    }
                }
                after
            }
            None => None,
        };
        let mut state = self.lock();
        let mut freed = Vec::new();
        let mut result = Ok(());
        for buffer in batch.buffers {
            let released = state.leases.release(buffer, id);
            if released.is_ok() {
                trace::mark(Point::ExporterReleased, buffer.0);
            }
            match released {
                Ok(Some(mut shared)) => {
                    if let Some(after) = &after {
                        shared.wait_also(after);
                    }
                    freed.push((buffer, shared));
                }
                Ok(None) => {
                    if let (Some(after), Some(shared)) = (&after, state.leases.get_mut(buffer)) {
                        shared.wait_also(after);
                    }
                }
                // The importer is broken: the loop cuts it off, and what it still holds is
                // reclaimed once its process is gone.
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
        }
        let signals = self.released_waiters(&mut state);
        drop(state);
        signals.send();
        self.finish_deferred(freed);
        self.notify();
        result
    }

    fn released(&self, id: ImporterId, buffer: BufferId) -> Result<()> {
        // A release of something it does not hold is an error: the importer is broken, the loop
        // cuts it off and it is treated as gone (it may still use what it holds: see `ended`).
        let mut state = self.lock();
        let freed = state.leases.release(buffer, id)?;
        trace::mark(Point::ExporterReleased, buffer.0);
        let signals = self.released_waiters(&mut state);
        drop(state);
        signals.send();
        self.finish_deferred(freed.map(|s| (buffer, s)).into_iter().collect());
        self.notify();
        Ok(())
    }

    fn ended(&self, id: ImporterId, clean: bool, undelivered: Vec<BufferId>) -> bool {
        self.importer_ended(id, clean, undelivered)
    }

    fn exited(&self, id: ImporterId) {
        self.reclaim(id);
    }

    fn abandoned(&self, id: ImporterId) {
        self.abandon(id);
    }
}

impl Inner {
    /// Makes the release stream wait on importer `id`'s release event `handle` (opened once per
    /// handle, at most [`MAX_RELEASE_EVENTS`] per importer) and returns an event of the
    /// exporter's own recorded after that wait: what frees of the released buffers wait on.
    /// Returns `None` (nothing to wait for) if the importer's event is complete: its latest
    /// recording, which covers this batch's uses and every earlier one (the importer orders each
    /// recording after the previous), is done.
    fn after_release_event(&self, id: ImporterId, handle: EventHandle) -> Result<Option<Arc<AfterEvent>>> {
        let mut state = self.lock();
        let peer = state.importers.get_mut(&id).ok_or(ProtocolError::Violation {
            reason: format!("importer {id} is not connected"),
        })?;
        let index = match peer.release_events.iter().position(|(h, _)| *h == handle) {
            Some(i) => i,
            None => {
                if peer.release_events.len() >= MAX_RELEASE_EVENTS {
                    return Err(ProtocolError::Violation {
                        reason: format!("more than {MAX_RELEASE_EVENTS} distinct release events"),
                    }
                    .into());
                }
                peer.release_events
                    .push((handle, Event::open_ipc(&self.ctx, &IpcEventHandle(handle.0))?));
                peer.release_events.len() - 1
            }
        };
        let event = &peer.release_events[index].1;
        if event.is_complete().unwrap_or(false) {
            return Ok(None);
        }
        let stream = self.release_stream.as_ref();
        stream.wait(event)?;
        let after = self.after_event()?;
        after.record(stream)?;
        Ok(Some(Arc::new(after)))
    }
}

/// Shuts the exporter down (dropping it, or [`Exporter::shutdown`](crate::Exporter::shutdown)):
/// no new connections, `Goodbye` queued for every importer (sent as each one's socket takes it,
/// so one that does not read holds up nobody), a wait (at most the shutdown timeout) for them to
/// release what they hold or for their processes to end, then every connection closes and the
/// serving thread ends.
pub(super) fn shut_down(inner: &Inner) {
    let Some(reactor) = inner.reactor.get() else { return };
    inner.shutting_down.store(true, Ordering::Release);
    let deadline = Instant::now() + inner.shutdown_timeout;
    reactor.begin_shutdown();
    {
        let mut state = inner.lock();
        // Importers that keep blocks imported say Goodbye (freeing those imports) once they hold
        // nothing: wait for that too, so the blocks can be freed rather than abandoned.
        while state.leases.importers().next().is_some() || state.pins.len() > 0 {
            match inner.wait(state, deadline) {
                Some(s) => state = s,
                None => break,
            }
        }
    }
    // The serving thread takes the state's lock in its last reports: not held here.
    reactor.finish();
}
