//! The pool-teardown gate: no `cuMemPoolDestroy` runs while a synchronize made through this crate is in
//! the driver for the same context.
//!
//! Why (issue 33; docs/architecture.md, "Pool teardown and synchronizes"): a `cuMemFreeAsync` into a pool
//! leaves a record in the driver, with a mutex of its own, tied to the stream it was freed on;
//! `cuMemPoolDestroy` destroys and frees that record. A `cuStreamSynchronize`, `cuCtxSynchronize` or
//! `cuEventSynchronize` running at that moment on another thread walks those records (holding a driver
//! lock in read mode) and can lock the freed record's mutex. On driver 580 (H200) every thread of the
//! process then waited inside the driver, or it crashed: `scripts/repro/lockwatch.c` caught the mutex
//! created in `cuMemFreeAsync` (a free on the legacy default stream), destroyed in `cuMemPoolDestroy` on
//! the same thread milliseconds later, and the synchronizing threads blocked on it in freed memory; the
//! raw-driver reproducer (`scripts/repro/pool_stall.c`, modes `plbsc` and `pltbsc`) stalls or crashes the
//! same way without any mempool code.
//!
//! One gate per context (up to [`SLOTS`] contexts; more share the last gate), so that a pool destroyed
//! on one device never waits for a synchronize on another: a thread per GPU, each waiting for a
//! collective that the other has yet to launch, must not deadlock through the gate. Each gate is a
//! reader-writer lock split into stripes, so that readers on different threads do not share a cache
//! line: a synchronize holds its thread's stripe in read mode for the driver call; a pool destroy holds
//! every stripe of its context's gate (and of the gate of synchronizes whose context could not be told)
//! in write mode.
//!
//! The rule that keeps it deadlock-free: a holder waits for nothing but its own driver call. Calls of
//! other libraries (PyTorch, CuPy) do not pass through the gate; mempool's own release paths therefore
//! also avoid leaving records on the shared default streams (mempool-rmm frees a resource's chunks on a
//! private stream, destroyed before the pool).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

const STRIPES: usize = 16;
/// Gates: slot 0 for synchronizes whose context could not be told, then one per context seen.
pub(crate) const SLOTS: usize = 64;

/// One stripe, alone on its cache lines.
#[repr(align(128))]
struct Stripe(RwLock<()>);

#[allow(clippy::declare_interior_mutable_const)] // array initializers only: each element is its own lock
const STRIPE: Stripe = Stripe(RwLock::new(()));
#[allow(clippy::declare_interior_mutable_const)]
const GATE: [Stripe; STRIPES] = [STRIPE; STRIPES];
static GATES: [[Stripe; STRIPES]; SLOTS] = [GATE; SLOTS];
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: AtomicUsize = AtomicUsize::new(0);
/// The context each slot belongs to (0: free); slot 0 is never assigned.
static KEYS: [AtomicUsize; SLOTS] = [EMPTY; SLOTS];
static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MINE: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The gate of context `key` (a `CUcontext`'s address; 0 when unknown).
fn slot(key: usize) -> usize {
    if key == 0 {
        return 0;
    }
    for (i, k) in KEYS.iter().enumerate().skip(1) {
        match k.load(Ordering::Acquire) {
            v if v == key => return i,
            0 => match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return i,
                Err(v) if v == key => return i,
                Err(_) => continue,
            },
            _ => continue,
        }
    }
    SLOTS - 1
}

fn stripe() -> usize {
    MINE.try_with(|m| {
        if m.get() == usize::MAX {
            m.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        m.get()
    })
    // A thread whose locals are being torn down still gets a stripe: any one is correct.
    .unwrap_or(0)
}

fn read(slot: usize) -> RwLockReadGuard<'static, ()> {
    // The lock guards no data: a panic while it was held leaves nothing inconsistent.
    GATES[slot][stripe()].0.read().unwrap_or_else(PoisonError::into_inner)
}

fn write_all(slot: usize, into: &mut Vec<RwLockWriteGuard<'static, ()>>) {
    into.extend(
        GATES[slot]
            .iter()
            .map(|s| s.0.write().unwrap_or_else(PoisonError::into_inner)),
    );
}

/// Held by a synchronize in context `key` (0: unknown) for the length of its driver call.
pub(crate) fn synchronize(key: usize) -> RwLockReadGuard<'static, ()> {
    read(slot(key))
}

/// Held by a pool destroy in context `key` for the length of its driver call: no synchronize made
/// through this crate in that context (or in an unknown one) is in the driver meanwhile. Gates and
/// stripes are taken in one order, so two destroys cannot deadlock.
pub(crate) fn teardown(key: usize) -> Vec<RwLockWriteGuard<'static, ()>> {
    let mut held = Vec::with_capacity(2 * STRIPES);
    write_all(0, &mut held);
    let s = slot(key);
    if s != 0 {
        write_all(s, &mut held);
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{mpsc, Barrier};
    use std::time::Duration;

    // Each test uses context keys of its own, so that tests running in parallel do not wait for each
    // other's gates.

    #[test]
    fn a_teardown_waits_for_a_synchronize_of_its_context_on_another_thread() {
        const CTX: usize = 0x1000;
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            let _g = synchronize(CTX);
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        });
        held_rx.recv().unwrap();
        let (done_tx, done_rx) = mpsc::channel();
        let writer = std::thread::spawn(move || {
            let _all = teardown(CTX);
            done_tx.send(()).unwrap();
        });
        assert!(
            done_rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "the destroy waited for the synchronize"
        );
        release_tx.send(()).unwrap();
        done_rx.recv().unwrap();
        reader.join().unwrap();
        writer.join().unwrap();
    }

    #[test]
    fn a_teardown_does_not_wait_for_a_synchronize_of_another_context() {
        let _other = synchronize(0x2000);
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _all = teardown(0x3000);
            done_tx.send(()).unwrap();
        });
        done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a destroy in one context went through while another context synchronized");
    }

    #[test]
    fn synchronizes_of_one_context_on_many_threads_hold_the_gate_together() {
        const CTX: usize = 0x4000;
        let n = 2 * STRIPES;
        let all_in = Barrier::new(n);
        std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    let _g = synchronize(CTX);
                    // Every thread holds its stripe here at once, or this barrier never opens.
                    all_in.wait();
                });
            }
        });
    }

    #[test]
    fn each_context_gets_a_slot_of_its_own_and_keeps_it() {
        let (a, b) = (slot(0x5000), slot(0x6000));
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(slot(0x5000), a);
        assert_eq!(slot(0), 0);
    }
}
