//! When shared buffers are freed: at once when the exporter lets go of a buffer nobody else
//! holds; deferred to the internal stream when the last importer releases it; reclaimed when an
//! importer's connection ends without releasing, once its process is gone; abandoned when the
//! exporter shuts down while an importer that outlived the timeout still holds it.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mempool_core::{Event, EventFlags, StreamRef};
use rustix::event::{PollFd, PollFlags, Timespec};

use super::state::{lock_plain, Freer, Inner, Shared};
use crate::error::{record_drop_error, Error, Result};
use crate::lease::ImporterId;
use crate::wire::BufferId;

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

    /// Frees a buffer nobody holds any more, ordered on `stream`.
    pub(super) fn finish(&self, id: BufferId, mut shared: Shared, stream: StreamRef<'_>, deferred: bool) -> Result<()> {
        let mut result = Ok(());
        if let Some(last_use) = shared.last_use.take() {
            result = stream.wait(&last_use).map_err(Error::from);
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
        let mut state = self.lock();
        if let Some(block) = state.blocks.get_mut(&shared.block_base) {
            block.live -= 1;
            if block.live == 0 {
                state.blocks.remove(&shared.block_base);
            }
        }
        if deferred {
            state.deferred = state.deferred.saturating_sub(1);
        }
        state.freed += 1;
        // Every importer that waited on these events has released (or is gone), and the free is
        // queued: they can order the next buffer.
        state.idle_events.append(&mut shared.events);
        drop(state);
        self.changed.notify_all();
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
    /// (closed, broke the protocol). Every buffer it held counts as released; those nobody
    /// holds any more are freed, but after an unclean end only once the importer's process is
    /// gone (it may still run GPU work on them). If the exporter shuts down first and its
    /// deadline passes, they are abandoned instead. Counts the connection's thread out.
    pub(super) fn importer_gone(&self, id: ImporterId, clean: bool, pid: i32, pidfd: Option<&OwnedFd>) {
        let holds = self.lock().leases.leases_of(id).next().is_some();
        // After `Goodbye` the importer has freed every import. Otherwise its process may still run
        // GPU work on the memory until it is gone: wait for that before freeing.
        let safe = clean || !holds || wait_for_exit(self, pid, pidfd);
        let mut state = self.lock();
        if safe {
            let freed = state.leases.disconnect(id);
            if !clean {
                state.reclaimed += freed.len() as u64;
            }
            drop(state);
            self.finish_deferred(freed);
            state = self.lock();
        } else {
            // Shutting down and the importer outlived the timeout: its buffers are not freed.
            let kept = state.leases.disconnect(id);
            state.abandoned += kept.len() as u64;
            state.leaked.extend(kept.into_iter().map(|(_, s)| s));
        }
        state.serving -= 1;
        drop(state);
        self.changed.notify_all();
    }
}

/// Waits until the process `pid` is gone. `false` if the exporter shuts down and its deadline
/// passes first.
fn wait_for_exit(inner: &Inner, pid: i32, pidfd: Option<&OwnedFd>) -> bool {
    let tick = Duration::from_millis(50);
    loop {
        let gone = match pidfd {
            Some(fd) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                let timeout = Timespec::try_from(tick).unwrap_or(Timespec { tv_sec: 0, tv_nsec: 0 });
                matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
            }
            // No pidfd (kernels before 5.3): poll for the pid's existence.
            None => match rustix::process::Pid::from_raw(pid) {
                Some(p) => {
                    let gone = rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH);
                    if !gone {
                        std::thread::sleep(tick);
                    }
                    gone
                }
                None => true,
            },
        };
        if gone {
            return true;
        }
        if inner.shutting_down.load(Ordering::Acquire) {
            let deadline = *lock_plain(&inner.shutdown_deadline);
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
        }
    }
}
