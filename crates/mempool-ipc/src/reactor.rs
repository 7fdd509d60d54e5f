//! The exporter's connections, without the GPU: admission, the handshake, per-importer send
//! queues and the end of each connection, served by one event-loop thread however many
//! importers there are.
//!
//! - `admission`: the limits ([`Limits`]), who gets in and whom a newcomer pushes out, and the
//!   pause of accepting when descriptors run out; pure logic;
//! - `outbox`: one bounded queue per connected importer, filled by [`Reactor::send`] from any
//!   thread and drained by the loop; pure bookkeeping;
//! - `peer`: one non-blocking connection (frames in, frames out, its clocks);
//! - `exits`: whether an importer's process is gone (start time, `pidfd`, `kill`);
//! - `event_loop`: the `epoll` loop over all of them, and the [`Handler`] it reports to.
//!
//! The exporter implements [`Handler`] (leases, frees); the tests (`server/tests.rs`) implement
//! it over a lease table of simulated buffers and drive the whole server over real sockets,
//! with a memfd standing in for the pool's descriptor.
//!
//! Layers: `admission`, `outbox` and `exits` import none of the others; `peer` imports `exits`
//! and `outbox`; `event_loop` imports the four; this file imports `event_loop`, `admission`
//! and `outbox`, and nothing imports it but the tests.

mod admission;
mod event_loop;
mod exits;
mod outbox;
mod peer;
mod ring_peer;

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub(crate) use self::admission::Limits;
use self::event_loop::{lock, Setup, Shared};
pub(crate) use self::event_loop::{Handler, ReactorStats, DEFAULT_RING_SPIN};
use self::outbox::{Outgoing, PushError};
use crate::error::{Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{BufferId, Message};
use crate::session::PoolAnnouncement;
use mempool_socket::listener::Listener;

/// The exporter's connections, served by one thread. See the [module documentation](self).
#[derive(Debug)]
pub(crate) struct Reactor {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Reactor {
    /// Serves `listener`: every connection that passes its access policy and admission runs the
    /// handshake (announcing `announcement`, handing out `pool_fd`), then the importer is
    /// reported to `handler` and may be sent frames.
    ///
    /// Errors: [`Error::RingSlotTooSmall`] when `limits` offers rings whose slots cannot hold
    /// every frame of the protocol; the event loop's setup failing.
    pub(crate) fn start(
        listener: Listener,
        announcement: PoolAnnouncement,
        pool_fd: OwnedFd,
        limits: Limits,
        handler: Arc<dyn Handler>,
    ) -> Result<Reactor> {
        if let Some(geometry) = limits.ring {
            crate::session::check_ring_geometry(geometry)?;
        }
        let shared = Arc::new(Shared::new(limits.send_queue_len)?);
        let setup = Setup {
            shared: shared.clone(),
            listener,
            announcement,
            pool_fd,
            limits,
            handler,
        };
        let ready = event_loop::Ready::new(setup)?;
        let thread = std::thread::Builder::new()
            .name("mempool-ipc-serve".into())
            .spawn(move || ready.run())?;
        Ok(Reactor {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `message` for importer `id` and returns at once: the loop sends it as the
    /// importer's socket takes it, never delaying other importers. `buffer` names the buffer a
    /// `Buffer` message shares, so that it counts as never delivered if the connection ends
    /// before it went out.
    ///
    /// Errors: [`Error::UnknownImporter`] if `id` is not connected;
    /// [`Error::Stalled`] if its queue is full (it is disconnected: it does not read);
    /// [`Error::Refused`] while it is being disconnected or the exporter shuts down.
    pub(crate) fn send(&self, id: ImporterId, message: &Message, buffer: Option<BufferId>) -> Result<()> {
        self.send_with_fds(id, message, buffer, Vec::new())
    }

    /// [`Reactor::send`] with descriptors of the frame's own (`VmmBuffer`: one, `VmmChunks`: one
    /// per chunk), which the loop sends with the frame's first byte and then closes (or closes
    /// unsent if the connection ends first). Their number must be what the message carries
    /// ([`Error::DescriptorCount`] otherwise, and nothing is queued).
    pub(crate) fn send_with_fds(
        &self,
        id: ImporterId,
        message: &Message,
        buffer: Option<BufferId>,
        fds: Vec<OwnedFd>,
    ) -> Result<()> {
        if fds.len() != message.descriptor_count() {
            return Err(Error::DescriptorCount {
                expected: message.descriptor_count(),
                got: fds.len(),
            });
        }
        let frame = crate::protocol::encode(message)?;
        let item = Outgoing {
            buffer,
            fds,
            ..Outgoing::plain(frame)
        };
        let pushed = lock(&self.shared.outboxes).push(id, item);
        match pushed {
            Ok(wake) => {
                if wake {
                    self.shared.wake();
                }
                Ok(())
            }
            Err(PushError::Unknown) => Err(Error::UnknownImporter { importer: id }),
            Err(PushError::Full(capacity)) => {
                self.shared.wake();
                Err(Error::Stalled {
                    importer: id,
                    reason: format!("its send queue of {capacity} messages is full"),
                })
            }
            Err(PushError::RingBroken) => {
                self.shared.wake();
                Err(Error::Refused {
                    reason: format!("importer {id}'s shared-memory ring broke its rules; it is being disconnected"),
                })
            }
            Err(PushError::Closing) => Err(Error::Refused {
                reason: format!("importer {id} is being disconnected, or the exporter is shutting down"),
            }),
        }
    }

    /// How long the serving thread spins over the rings after ring traffic before it sleeps
    /// (zero: never); read at every round.
    pub(crate) fn set_ring_spin(&self, spin: std::time::Duration) {
        let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
        self.shared
            .ring_spin_ns
            .0
            .store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    /// What [`Reactor::set_ring_spin`] set.
    pub(crate) fn ring_spin(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.shared.ring_spin_ns.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The loop's counters, as of its last round.
    pub(crate) fn stats(&self) -> ReactorStats {
        *lock(&self.shared.stats)
    }

    /// Wakes the serving thread for a round (the tests of hostile rings: what an importer writes
    /// into its ring without ringing the doorbell is found at the loop's next round).
    #[cfg(test)]
    pub(crate) fn wake(&self) {
        self.shared.wake();
    }

    /// Stops accepting (the socket file is removed), closes the handshakes in flight and queues
    /// `Goodbye` for every importer; releases are still taken. Returns at once.
    pub(crate) fn begin_shutdown(&self) {
        lock(&self.shared.control).closing = true;
        self.shared.wake();
    }

    /// Closes every connection (their importers' buffers are abandoned, see
    /// [`Handler::abandoned`]) and waits for the loop's thread to end.
    pub(crate) fn finish(&self) {
        {
            let mut control = lock(&self.shared.control);
            control.closing = true;
            control.finish = true;
        }
        self.shared.wake();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests;
