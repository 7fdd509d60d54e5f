//! The doorbell: a futex on a waiting flag in the shared pages.
//!
//! The sleeper sets its flag to 1, re-checks the ring, and waits (`FUTEX_WAIT` while the flag is
//! 1); the other side, after publishing, swaps the flag to 0 and, if it was set, wakes it
//! (`FUTEX_WAKE`). Waking never blocks, whatever the peer wrote, and a wait always has a time
//! limit, so neither side can be held by the other. The futexes are shared (no
//! `FUTEX_PRIVATE_FLAG`): the word lives in pages mapped by two processes.

use std::time::Duration;

use super::sync::AtomicU32;

/// Waits while `flag` holds `expected`, for at most `timeout` (or until woken, or spuriously).
#[cfg(not(loom))]
pub(crate) fn wait(flag: &AtomicU32, expected: u32, timeout: Duration) {
    crate::trace::count(crate::trace::Counter::FutexWait);
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `flag` is a live, aligned 32-bit word for the duration of the call (the region
    // outlives it); FUTEX_WAIT only reads it and `ts` is a valid relative timeout. The result
    // (woken, timed out, interrupted, or the value changed) needs no handling: callers re-check.
    #[allow(unsafe_code)]
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            flag.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every waiter on `flag`. Never blocks.
#[cfg(not(loom))]
pub(crate) fn wake(flag: &AtomicU32) {
    crate::trace::count(crate::trace::Counter::FutexWake);
    // SAFETY: `flag` is a live, aligned 32-bit word; FUTEX_WAKE does not touch memory.
    #[allow(unsafe_code)]
    unsafe {
        libc::syscall(libc::SYS_futex, flag.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Under loom there is no futex: a wait returns at once, as a timeout or a spurious wake-up may (every
/// caller re-checks the ring after it), and lets the model run the other threads.
#[cfg(loom)]
pub(crate) fn wait(_flag: &AtomicU32, _expected: u32, _timeout: Duration) {
    crate::trace::count(crate::trace::Counter::FutexWait);
    loom::thread::yield_now();
}

/// Under loom a wake has nobody to wake: a waiter's wait returned at once.
#[cfg(loom)]
pub(crate) fn wake(_flag: &AtomicU32) {
    crate::trace::count(crate::trace::Counter::FutexWake);
}
