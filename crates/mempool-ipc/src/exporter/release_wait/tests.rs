//! The waits of `wait_released` without a GPU: a wait spins on its own slot and ends without a
//! wake-up when signalled meanwhile, parks once its spin is over (or at once with no spin) and is
//! unparked by its signal, is left alone by other buffers' releases, and never outlasts its
//! deadline.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{ReleaseWaiters, Slot, Waited};
use crate::protocol::BufferId;

/// Long enough that a test's steps all fall inside it, however slow the machine.
const LONG: Duration = Duration::from_secs(20);

/// Registers a wait for `buffer` on a new thread and runs it with `spin` (then parked until
/// `LONG`); returns the thread, which answers how it ended, once the wait is registered.
fn waiter(
    waiters: &Arc<Mutex<ReleaseWaiters>>,
    buffer: u64,
    spin: Duration,
) -> (Arc<Slot>, std::thread::JoinHandle<(Waited, Duration)>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let waiters = waiters.clone();
    let thread = std::thread::spawn(move || {
        let slot = waiters.lock().unwrap().register(BufferId(buffer));
        tx.send(slot.clone()).unwrap();
        let start = Instant::now();
        let waited = slot.wait(start + spin, start + LONG);
        (waited, start.elapsed())
    });
    (rx.recv().unwrap(), thread)
}

/// Waits (a little at a time, bounded) until `slot`'s waiter has parked.
fn until_parked(slot: &Slot) {
    let deadline = Instant::now() + LONG;
    while !slot.parked.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the waiter never parked");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_wait_signalled_while_it_spins_ends_without_parking() {
    let waiters = Arc::new(Mutex::new(ReleaseWaiters::default()));
    let (slot, thread) = waiter(&waiters, 1, LONG);
    let signals = waiters.lock().unwrap().take_released(|_| false);
    assert_eq!(signals.len(), 1);
    signals.send();
    let (waited, _) = thread.join().unwrap();
    assert_eq!(waited, Waited::Spun);
    assert!(!slot.parked.load(std::sync::atomic::Ordering::SeqCst), "it parked");
    assert_eq!(waiters.lock().unwrap().len(), 0, "the signal took it out");
}

#[test]
fn with_no_spin_a_wait_parks_at_once_and_its_signal_unparks_it() {
    let waiters = Arc::new(Mutex::new(ReleaseWaiters::default()));
    let (slot, thread) = waiter(&waiters, 1, Duration::ZERO);
    until_parked(&slot);
    waiters.lock().unwrap().take_released(|_| false).send();
    // Without the unpark it would sleep until `LONG` and say `TimedOut`.
    let (waited, _) = thread.join().unwrap();
    assert_eq!(waited, Waited::Parked);
}

#[test]
fn a_wait_whose_spin_ran_out_parks_and_its_signal_unparks_it() {
    let waiters = Arc::new(Mutex::new(ReleaseWaiters::default()));
    let (slot, thread) = waiter(&waiters, 1, Duration::from_millis(2));
    until_parked(&slot);
    waiters.lock().unwrap().take_released(|_| false).send();
    let (waited, elapsed) = thread.join().unwrap();
    assert_eq!(waited, Waited::Parked);
    assert!(
        elapsed >= Duration::from_millis(2),
        "it parked before its spin was over"
    );
}

#[test]
fn a_release_of_another_buffer_leaves_a_wait_alone() {
    let waiters = Arc::new(Mutex::new(ReleaseWaiters::default()));
    let (one, first) = waiter(&waiters, 1, LONG);
    let (two, second) = waiter(&waiters, 2, Duration::ZERO);
    until_parked(&two);
    // Buffer 1 released, buffer 2 still held: only the first wait is signalled.
    let signals = waiters.lock().unwrap().take_released(|b| b == BufferId(2));
    assert_eq!(signals.len(), 1);
    signals.send();
    assert_eq!(first.join().unwrap().0, Waited::Spun);
    assert!(one.signalled());
    assert!(
        !two.signalled(),
        "a release of buffer 1 signalled the wait for buffer 2"
    );
    assert_eq!(waiters.lock().unwrap().len(), 1);
    // A change that may take holders from any buffer signals every wait.
    let signals = waiters.lock().unwrap().take_all();
    assert_eq!(signals.len(), 1);
    signals.send();
    assert_eq!(second.join().unwrap().0, Waited::Parked);
    assert_eq!(waiters.lock().unwrap().len(), 0);
}

#[test]
fn a_wait_nobody_signals_ends_at_its_deadline_and_is_cancelled() {
    let mut waiters = ReleaseWaiters::default();
    let slot = waiters.register(BufferId(1));
    let start = Instant::now();
    // A spin longer than the wait is cut to the deadline.
    let waited = slot.wait(start + LONG, start + Duration::from_millis(20));
    assert_eq!(waited, Waited::TimedOut);
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(20), "it ended early: {elapsed:?}");
    assert!(elapsed < LONG, "the spin outlasted the deadline: {elapsed:?}");
    waiters.cancel(&slot);
    assert_eq!(waiters.len(), 0);
    // Cancelling a slot that is not registered (taken by a signal) changes nothing.
    let other = waiters.register(BufferId(2));
    waiters.cancel(&slot);
    assert_eq!(waiters.len(), 1);
    waiters.cancel(&other);
    assert_eq!(waiters.len(), 0);
}

#[test]
fn each_wait_has_a_line_of_its_own() {
    // Two waits never share a 128-byte line, whatever the allocator places next to them.
    assert_eq!(std::mem::align_of::<Slot>(), 128);
    assert_eq!(std::mem::size_of::<Slot>() % 128, 0);
}
