//! What the server's state machine needs of the GPU, as a trait: allocate exportable physical
//! memory on a served device, export it as a file descriptor, and relay a creator's interprocess
//! event into an event of the server's own. The GPU implementation is `gpu::GpuBackend`; the
//! host double here (`HostBackend`, tests only) allocates `memfd`s, so the state machine and a
//! running server are tested without a GPU, with real descriptors passed and counted.
//!
//! Everything here is `Send + Sync` and takes `&self`: the server calls the backend, and queries
//! and exports what it returned, with its state lock released (`state::Service`), so one
//! client's large allocation does not hold up the others.

use std::os::fd::OwnedFd;

use super::error::Result;
use super::protocol::messages::EventBytes;
use mempool_ipc::DeviceUuid;

/// Memory the server holds for one buffer; released when dropped.
pub(crate) trait Allocation: Send + Sync {
    /// A new descriptor for the memory (the client imports it; the server keeps its own).
    fn export_fd(&self) -> Result<OwnedFd>;
}

/// The server's own event, recorded after the creator's work; attachers wait on it.
pub(crate) trait RelayedEvent: Send + Sync {
    /// Its interprocess handle.
    fn handle(&self) -> EventBytes;
    /// Whether the work it follows (the creator's, relayed) is done (`cuEventQuery`): then an
    /// attacher has nothing to wait for. Once true it stays true (the event is not recorded
    /// again while its buffer holds it).
    fn is_done(&self) -> Result<bool>;
}

/// The GPU side of the server.
pub(crate) trait Backend: Send + Sync {
    /// The served devices: UUID and VMM granularity, in the order the state machine indexes them.
    fn devices(&self) -> &[(DeviceUuid, u64)];
    /// Allocates `size` bytes (a multiple of the device's granularity) on device `index`.
    fn allocate(&self, index: usize, size: u64) -> Result<Box<dyn Allocation>>;
    /// Opens the creator's event `creator` on device `index`, makes a stream of the server's wait
    /// on it and records an event of the server's own after it (a stream per relay, so that one
    /// creator's unfinished work holds up only its own buffer's attachers).
    fn relay_event(&self, index: usize, creator: &EventBytes) -> Result<Box<dyn RelayedEvent>>;
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn devices(&self) -> &[(DeviceUuid, u64)] {
        (**self).devices()
    }
    fn allocate(&self, index: usize, size: u64) -> Result<Box<dyn Allocation>> {
        (**self).allocate(index, size)
    }
    fn relay_event(&self, index: usize, creator: &EventBytes) -> Result<Box<dyn RelayedEvent>> {
        (**self).relay_event(index, creator)
    }
}

#[cfg(test)]
pub(crate) use host::{Gate, HostBackend};

#[cfg(test)]
mod host {
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Barrier, Mutex};

    use super::{Allocation, Backend, RelayedEvent};
    use crate::error::{Error, Result};
    use crate::protocol::messages::EventBytes;
    use mempool_ipc::DeviceUuid;

    /// A host double: "device memory" is a `memfd` of the size asked for; events are handles
    /// derived from the creator's. Counts what is live, and can be told to fail allocations.
    /// Relayed events are pending until `relays_done` is set (the GPU finished the creator's work).
    /// An allocation can be held inside the backend ([`HostBackend::block_next`]) to show what
    /// the server does meanwhile. A clone shares everything (counters, capacity, gate) with the
    /// original, so a test keeps one after handing the other to a server.
    #[derive(Clone, Debug)]
    pub(crate) struct HostBackend {
        devices: Vec<(DeviceUuid, u64)>,
        pub(crate) live: Arc<AtomicU64>,
        pub(crate) live_bytes: Arc<AtomicU64>,
        /// Allocations past this many bytes in all fail (a full GPU); read after a held
        /// allocation is let go, so a test can make a held allocation fail.
        pub(crate) capacity: Arc<AtomicU64>,
        /// What every relayed event's query answers (shared: set it to finish them all).
        pub(crate) relays_done: Arc<AtomicBool>,
        /// The gate the next allocation stops at (taken by that allocation).
        gate: Arc<Mutex<Option<Arc<Gate>>>>,
    }

    /// Where a held allocation stops: it meets the test at `entered` (it is inside the backend
    /// now), then waits at `release` until the test lets it go.
    #[derive(Debug)]
    pub(crate) struct Gate {
        pub(crate) entered: Barrier,
        pub(crate) release: Barrier,
    }

    impl HostBackend {
        pub(crate) fn new(devices: usize, granularity: u64) -> HostBackend {
            HostBackend {
                devices: (0..devices)
                    .map(|i| (DeviceUuid([i as u8 + 1; 16]), granularity))
                    .collect(),
                live: Arc::default(),
                live_bytes: Arc::default(),
                capacity: Arc::new(AtomicU64::new(u64::MAX)),
                relays_done: Arc::default(),
                gate: Arc::default(),
            }
        }

        /// Holds the next allocation at a gate: it waits at `entered` for the test, then at
        /// `release` (each a two-party barrier), then allocates, or fails as `capacity` says.
        pub(crate) fn block_next(&self) -> Arc<Gate> {
            let gate = Arc::new(Gate {
                entered: Barrier::new(2),
                release: Barrier::new(2),
            });
            *self.gate.lock().unwrap() = Some(gate.clone());
            gate
        }
    }

    struct MemFd {
        fd: OwnedFd,
        size: u64,
        live: Arc<AtomicU64>,
        live_bytes: Arc<AtomicU64>,
    }

    impl Allocation for MemFd {
        fn export_fd(&self) -> Result<OwnedFd> {
            Ok(self.fd.try_clone()?)
        }
    }

    impl Drop for MemFd {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
            self.live_bytes.fetch_sub(self.size, Ordering::SeqCst);
        }
    }

    struct HostEvent(EventBytes, Arc<AtomicBool>);

    impl RelayedEvent for HostEvent {
        fn handle(&self) -> EventBytes {
            self.0
        }
        fn is_done(&self) -> Result<bool> {
            Ok(self.1.load(Ordering::SeqCst))
        }
    }

    impl Backend for HostBackend {
        fn devices(&self) -> &[(DeviceUuid, u64)] {
            &self.devices
        }

        fn allocate(&self, _index: usize, size: u64) -> Result<Box<dyn Allocation>> {
            let gate = self.gate.lock().unwrap().take();
            if let Some(gate) = gate {
                gate.entered.wait();
                gate.release.wait();
            }
            let used = self.live_bytes.load(Ordering::SeqCst);
            let capacity = self.capacity.load(Ordering::SeqCst);
            if used.saturating_add(size) > capacity {
                return Err(Error::ServerGpu {
                    message: format!("out of memory: {used} of {capacity} bytes in use, {size} asked"),
                });
            }
            let fd = rustix::fs::memfd_create("store-test", rustix::fs::MemfdFlags::CLOEXEC)?;
            rustix::fs::ftruncate(&fd, size)?;
            self.live.fetch_add(1, Ordering::SeqCst);
            self.live_bytes.fetch_add(size, Ordering::SeqCst);
            Ok(Box::new(MemFd {
                fd,
                size,
                live: self.live.clone(),
                live_bytes: self.live_bytes.clone(),
            }))
        }

        fn relay_event(&self, _index: usize, creator: &EventBytes) -> Result<Box<dyn RelayedEvent>> {
            let mut own = *creator;
            own[0] ^= 0xff;
            Ok(Box::new(HostEvent(own, self.relays_done.clone())))
        }
    }
}
