//! What the serving thread tells the exporter ([`Handler`]: an importer connected, released a
//! buffer, left, or its process is gone), and the shutdown that says `Goodbye` to every
//! importer and waits for their releases. The connections themselves are the crate's `server`,
//! one event loop for all of them.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::state::{Inner, Peer};
use crate::cred::PeerCredentials;
use crate::error::Result;
use crate::lease::ImporterId;
use crate::server::Handler;
use crate::wire::BufferId;

impl Handler for Inner {
    fn connected(&self, id: ImporterId, credentials: PeerCredentials) {
        self.lock().importers.insert(id, Peer { credentials });
        self.changed.notify_all();
    }

    fn released(&self, id: ImporterId, buffer: BufferId) -> Result<()> {
        // A release of something it does not hold is an error: the importer is broken, the loop
        // cuts it off and it is treated as gone (it may still use what it holds: see `ended`).
        let freed = self.lock().leases.release(buffer, id)?;
        self.finish_deferred(freed.map(|s| (buffer, s)).into_iter().collect());
        self.changed.notify_all();
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

/// Shuts the exporter down (dropping it, or [`Exporter::shutdown`](crate::Exporter::shutdown)):
/// no new connections, `Goodbye` queued for every importer (sent as each one's socket takes it,
/// so one that does not read holds up nobody), a wait (at most the shutdown timeout) for them to
/// release what they hold or for their processes to end, then every connection closes and the
/// serving thread ends.
pub(super) fn shut_down(inner: &Inner) {
    let Some(server) = inner.server.get() else { return };
    inner.shutting_down.store(true, Ordering::Release);
    let deadline = Instant::now() + inner.shutdown_timeout;
    server.begin_shutdown();
    {
        let mut state = inner.lock();
        while state.leases.importers().next().is_some() {
            match inner.wait(state, deadline) {
                Some(s) => state = s,
                None => break,
            }
        }
    }
    // The serving thread takes the state's lock in its last reports: not held here.
    server.finish();
}
