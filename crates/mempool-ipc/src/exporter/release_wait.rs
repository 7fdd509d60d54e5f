//! How [`ExportedBuffer::wait_released`](crate::ExportedBuffer::wait_released) waits for its
//! buffer's release: each wait has a [`Slot`] of its own (a cache line written once, by the
//! thread that finds the buffer released), registered in [`ReleaseWaiters`] under the exporter's
//! state lock. The waiting thread first spins on its slot (loads of its own line: no lock, no
//! system call, and no line that other threads write at every release), then parks; the thread
//! that takes the release sets the slot and unparks the waiter only if it parked. A release of
//! another buffer touches neither this slot nor this thread.
//!
//! The slot is a hint, never the answer: the waiter looks at the lease table again, under the
//! lock, once its slot is set (or its time is up).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::Instant;

use crate::protocol::BufferId;
use crate::trace;

/// Loads of the slot between two looks at the clock while spinning.
const LOADS_PER_CLOCK: usize = 64;

/// One thread's wait for one buffer. Aligned to 128 bytes (two 64-byte lines, as the adjacent-line
/// prefetcher pairs them), so that no other data shares its line: while the waiter spins, only the
/// thread that signals it writes there, once.
#[repr(align(128))]
#[derive(Debug)]
pub(super) struct Slot {
    /// Set when the buffer may have lost its last holder (or every waiter is told to look again).
    signalled: AtomicBool,
    /// Set by the waiter before it parks: the signalling thread then unparks it.
    parked: AtomicBool,
    thread: Thread,
}

/// How [`Slot::wait`] ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Waited {
    /// Signalled while it spun: no wake-up.
    Spun,
    /// Signalled after it parked (it was unparked).
    Parked,
    /// The deadline passed first.
    TimedOut,
}

impl Slot {
    /// A slot for the calling thread.
    fn new() -> Slot {
        Slot {
            signalled: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            thread: std::thread::current(),
        }
    }

    /// Whether the slot was signalled.
    #[cfg(test)]
    pub(super) fn signalled(&self) -> bool {
        self.signalled.load(Ordering::SeqCst)
    }

    /// Waits for the slot to be signalled: spins (loads of the slot, a look at the clock every
    /// [`LOADS_PER_CLOCK`]) until `spin_until`, then parks until `deadline`. Call it from the
    /// thread that registered the slot, without the state lock.
    pub(super) fn wait(&self, spin_until: Instant, deadline: Instant) -> Waited {
        let spin_until = spin_until.min(deadline);
        loop {
            for _ in 0..LOADS_PER_CLOCK {
                if self.signalled.load(Ordering::Acquire) {
                    return Waited::Spun;
                }
                std::hint::spin_loop();
            }
            if Instant::now() >= spin_until {
                break;
            }
        }
        // Pairs with `signal`: either this sees `signalled`, or `signal` sees `parked` and unparks
        // this thread (an unpark before the park makes the park return at once).
        self.parked.store(true, Ordering::SeqCst);
        loop {
            if self.signalled.load(Ordering::SeqCst) {
                return Waited::Parked;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Waited::TimedOut;
            }
            std::thread::park_timeout(left);
        }
    }

    /// Tells the waiter to look again; unparks it if it parked (a system call only then).
    fn signal(&self) {
        self.signalled.store(true, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            trace::count(trace::Counter::ReleaseWake);
            self.thread.unpark();
        }
    }
}

/// The waits in progress, by buffer; kept under the exporter's state lock.
#[derive(Debug, Default)]
pub(super) struct ReleaseWaiters {
    waits: Vec<(BufferId, Arc<Slot>)>,
}

/// Slots taken from [`ReleaseWaiters`], to be signalled ([`Signals::send`]) once the state lock
/// is released (so that the waiter, which takes the lock next, does not find it held).
#[must_use = "the waiters are signalled only by `send`"]
#[derive(Debug, Default)]
pub(super) struct Signals(Vec<Arc<Slot>>);

impl Signals {
    /// Signals every slot taken.
    pub(super) fn send(self) {
        for slot in self.0 {
            slot.signal();
        }
    }

    /// How many slots were taken.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

impl ReleaseWaiters {
    /// Registers a wait of the calling thread for `buffer`.
    pub(super) fn register(&mut self, buffer: BufferId) -> Arc<Slot> {
        let slot = Arc::new(Slot::new());
        self.waits.push((buffer, slot.clone()));
        slot
    }

    /// Removes `slot` if it is still registered (a wait that timed out, or that found its buffer
    /// released by looking).
    pub(super) fn cancel(&mut self, slot: &Arc<Slot>) {
        if let Some(i) = self.waits.iter().position(|(_, s)| Arc::ptr_eq(s, slot)) {
            self.waits.swap_remove(i);
        }
    }

    /// Takes the waits whose buffer nobody holds any more (`held` says who still does).
    pub(super) fn take_released(&mut self, held: impl Fn(BufferId) -> bool) -> Signals {
        let mut taken = Vec::new();
        let mut i = 0;
        while i < self.waits.len() {
            if held(self.waits[i].0) {
                i += 1;
            } else {
                taken.push(self.waits.swap_remove(i).1);
            }
        }
        Signals(taken)
    }

    /// Takes every wait (after changes that may take holders away from any buffer).
    pub(super) fn take_all(&mut self) -> Signals {
        Signals(self.waits.drain(..).map(|(_, s)| s).collect())
    }

    /// Waits registered now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.waits.len()
    }
}

#[cfg(test)]
mod tests;
