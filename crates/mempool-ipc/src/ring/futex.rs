//! The doorbell: a futex on a waiting flag in the shared pages.
//!
//! The sleeper sets its flag to 1, re-checks the ring, and waits (`FUTEX_WAIT` while the flag is
//! 1); the other side, after publishing, swaps the flag to 0 and, if it was set, wakes it
//! (`FUTEX_WAKE`). Waking never blocks, whatever the peer wrote, and a wait always has a time
//! limit, so neither side can be held by the other. The futexes are shared (no
//! `FUTEX_PRIVATE_FLAG`): the word lives in pages mapped by two processes.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Waits while `flag` holds `expected`, for at most `timeout` (or until woken, or spuriously).
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
pub(crate) fn wake(flag: &AtomicU32) {
    crate::trace::count(crate::trace::Counter::FutexWake);
    // SAFETY: `flag` is a live, aligned 32-bit word; FUTEX_WAKE does not touch memory.
    #[allow(unsafe_code)]
    unsafe {
        libc::syscall(libc::SYS_futex, flag.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
