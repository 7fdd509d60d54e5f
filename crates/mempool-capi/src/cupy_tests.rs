//! Tests of [`crate::cupy`]'s entry points without a GPU (failures and refusals), in a module of their own:
//! their callbacks are C functions that are not entry points. A resource that panics shows that the
//! stream hold ends with the panic.

use std::ffi::{c_int, c_void};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::{MemoryResource, SharedResource};

use crate::cupy::{alloc_on, allocation, free, mempool_cupy_free, mempool_cupy_malloc, state, FAILED};
use crate::cupy_param::CupyParam;
use crate::error::{self, Status};
use std::ffi::c_char;
use std::sync::Mutex;

/// What `raise` was last called with.
static RAISED: Mutex<Option<(c_int, String)>> = Mutex::new(None);

/// A `raise` that records its arguments (it must not panic: it is called across a C boundary).
#[allow(unsafe_code)]
unsafe extern "C" fn raise(status: c_int, message: *const c_char) {
    // SAFETY: the entry point passes a NUL-terminated message, live for the call.
    let m = unsafe { std::ffi::CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    if let Ok(mut r) = RAISED.lock() {
        *r = Some((status, m));
    }
}

#[test]
#[allow(unsafe_code)]
fn a_failed_allocation_raises_and_returns_minus_one_or_null_without_raise() {
    let param = Box::leak(Box::new(CupyParam {
        raise: Some(raise),
        ..CupyParam::default()
    }));
    let before = state().1;
    // SAFETY: the param lives for the process; the call fails before any stream is used (negative device).
    let p = unsafe { mempool_cupy_malloc(param as *mut CupyParam as *mut c_void, 4096, -2) };
    assert_eq!(p as usize, FAILED);
    let (status, message) = RAISED.lock().unwrap().clone().expect("raise was not called");
    assert_eq!(status, Status::InvalidArgument as c_int);
    assert!(message.contains("4096") && message.contains("device -2"), "{message}");
    assert!(error::last_error().contains("4096 bytes on device -2"));
    // SAFETY: a null param: no callbacks; the call fails as above.
    let p = unsafe { mempool_cupy_malloc(std::ptr::null_mut(), 4096, -2) };
    assert!(p.is_null());
    assert_eq!(state().1, before + 2);
}

#[test]
#[allow(unsafe_code)]
fn a_pointer_mempool_did_not_hand_out_is_refused_and_counted() {
    let before = state().2;
    // SAFETY: the table does not hold this address, so nothing is freed and no callback is called.
    unsafe { mempool_cupy_free(std::ptr::null_mut(), 0x7abc_0000_0100 as *mut c_void, 0) };
    assert_eq!(state().2, before + 1);
    assert!(
        error::last_error().contains("did not hand out"),
        "{}",
        error::last_error()
    );
    // SAFETY: a null pointer frees nothing.
    unsafe { mempool_cupy_free(std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    assert_eq!(state().2, before + 1, "null is not a failure");
    assert_eq!(allocation(0x7abc_0000_0100), None);
}

/// Stream holds taken and not yet released by [`hold`] and [`release`].
static HELD: AtomicIsize = AtomicIsize::new(0);

/// A `hold` that counts (the token is a fresh non-null box's address).
#[allow(unsafe_code)]
unsafe extern "C" fn hold(_stream: isize) -> *mut c_void {
    HELD.fetch_add(1, Ordering::SeqCst);
    Box::into_raw(Box::new(0u8)).cast()
}

/// A `release` that counts and frees the token.
#[allow(unsafe_code)]
unsafe extern "C" fn release(token: *mut c_void) {
    // SAFETY: `hold` made the token with `Box::into_raw`, and the entry points release it once.
    drop(unsafe { Box::from_raw(token.cast::<u8>()) });
    HELD.fetch_sub(1, Ordering::SeqCst);
}

/// A resource that panics when asked for 1 byte, hands out a made-up address for 2 bytes and panics
/// when that address is freed.
#[derive(Debug)]
struct Panics;

/// The address [`Panics`] hands out; nothing ever reads or writes it.
const MADE_UP: u64 = 0x7abc_0000_0200;

// SAFETY: the one address it hands out is never accessed by anyone (these tests only record it in the
// live table and free it through the entry point's `free`, which passes it back here), so no use of
// memory depends on its promises.
#[allow(unsafe_code)]
unsafe impl MemoryResource for Panics {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
        assert_eq!(bytes, 2, "a test double that panics on 1 byte");
        Ok(DeviceAddr(MADE_UP))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, _p: DeviceAddr, _n: usize, _s: StreamRef<'_>) -> mempool_rmm::Result<()> {
        panic!("a test double that panics on free");
    }

    fn name(&self) -> &'static str {
        "Panics"
    }
}

#[test]
#[allow(unsafe_code)]
fn a_panic_in_the_resource_ends_the_stream_hold() {
    let param: &'static CupyParam = Box::leak(Box::new(CupyParam {
        hold: Some(hold),
        release: Some(release),
        ..CupyParam::default()
    }));
    let addr = param as *const CupyParam as usize;
    // Not a special stream, so it is held; the resource never uses it.
    let stream = 0x1000;
    let mr: SharedResource = Arc::new(Panics);
    let held_before = HELD.load(Ordering::SeqCst);
    // SAFETY: the param lives for the process and its callbacks may run now; the stream is never used
    // (the resource panics, or records a made-up address, without touching it).
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        alloc_on(param, addr, 1, stream, 0, mr.clone())
    }));
    assert!(r.is_err(), "the resource panicked");
    assert_eq!(
        HELD.load(Ordering::SeqCst),
        held_before,
        "the hold ended with the panic"
    );
    // SAFETY: as above.
    let p = unsafe { alloc_on(param, addr, 2, stream, 0, mr) }.unwrap();
    assert_eq!(p as u64, MADE_UP);
    assert_eq!(
        HELD.load(Ordering::SeqCst),
        held_before + 1,
        "the live entry holds the stream"
    );
    assert_eq!(allocation(MADE_UP), Some((stream, 2)));
    // SAFETY: nothing uses the made-up address; the param's `release` may run now.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { free(MADE_UP) }));
    assert!(r.is_err(), "the resource panicked");
    assert_eq!(
        HELD.load(Ordering::SeqCst),
        held_before,
        "the hold ended with the panic"
    );
    assert_eq!(allocation(MADE_UP), None, "the entry is gone: no second free");
}

/// The handles [`Records`] was asked to free on, in order.
static FREED_ON: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());

/// A resource that hands out made-up addresses (`0x7abc_0001_0000` plus the size) and records the stream
/// of each free.
#[derive(Debug)]
struct Records;

// SAFETY: the addresses it hands out are never accessed by anyone (these tests record them in the live
// table and free them through the entry point's `free`, which passes them back here).
#[allow(unsafe_code)]
unsafe impl MemoryResource for Records {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
        Ok(DeviceAddr(0x7abc_0001_0000 + bytes as u64))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, p: DeviceAddr, _n: usize, s: StreamRef<'_>) -> mempool_rmm::Result<()> {
        FREED_ON.lock().unwrap().push((p.0, s.handle()));
        Ok(())
    }

    fn name(&self) -> &'static str {
        "Records"
    }
}

fn freed_on(addr: u64) -> Option<usize> {
    FREED_ON
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|(a, _)| *a == addr)
        .map(|(_, s)| *s)
}

/// Issue 33, finding 2: memory CuPy allocated on thread A's per-thread default stream and frees on thread
/// B (a collector, a thread the array was handed to) is freed on the legacy stream, which is ordered after
/// A's per-thread stream; the handle 2 on thread B would name B's own stream, ordered after nothing of A's.
/// Freed on A, it goes back on 2 (A's stream). Other streams are the same on every thread.
#[test]
#[allow(unsafe_code)]
fn a_per_thread_allocation_freed_on_another_thread_is_freed_on_the_legacy_stream() {
    let param: &'static CupyParam = Box::leak(Box::new(CupyParam::default()));
    let addr = param as *const CupyParam as usize;
    let mr: SharedResource = Arc::new(Records);
    // SAFETY: no callbacks; the streams are never used (the resource records made-up addresses).
    let alloc =
        |size: usize, stream: usize| unsafe { alloc_on(param, addr, size, stream, 0, mr.clone()) }.unwrap() as u64;
    let (mine, moved, legacy, created) = (alloc(16, 2), alloc(32, 2), alloc(48, 0), alloc(64, 0x5000));
    assert_eq!(allocation(moved), Some((2, 32)), "the handle is reported as given");
    // SAFETY: nothing uses the made-up addresses; the param has no callbacks.
    unsafe { free(mine) }.unwrap();
    assert_eq!(
        freed_on(mine),
        Some(2),
        "freed by the allocating thread: its own per-thread stream"
    );
    std::thread::spawn(move || {
        // SAFETY: as above.
        unsafe { free(moved) }.unwrap();
        // SAFETY: as above.
        unsafe { free(legacy) }.unwrap();
        // SAFETY: as above.
        unsafe { free(created) }.unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(
        freed_on(moved),
        Some(0),
        "another thread's per-thread stream: the legacy stream"
    );
    assert_eq!(freed_on(legacy), Some(0));
    assert_eq!(freed_on(created), Some(0x5000));
}

/// A per-thread allocation whose thread has ended before the free: the legacy stream's ordering after that
/// thread's per-thread stream is not documented then, so the free first synchronizes the device's context.
/// Without a driver that fails: the free is refused (the memory leaks) and never made on the freeing
/// thread's own per-thread stream.
#[test]
#[allow(unsafe_code)]
fn a_per_thread_allocation_whose_thread_ended_waits_for_the_context_before_its_free() {
    let param: &'static CupyParam = Box::leak(Box::new(CupyParam::default()));
    let addr = param as *const CupyParam as usize;
    let mr: SharedResource = Arc::new(Records);
    let ended = std::thread::spawn(move || {
        // SAFETY: no callbacks; the stream is never used (the resource records a made-up address).
        unsafe { alloc_on(param, addr, 80, 2, 0, mr) }.unwrap() as u64
    })
    .join()
    .unwrap();
    // SAFETY: nothing uses the made-up address; the param has no callbacks.
    let r = unsafe { free(ended) };
    match r {
        Err(e) => assert_eq!(freed_on(ended), None, "refused ({e}), not freed"),
        Ok(()) => assert_eq!(
            freed_on(ended),
            Some(0),
            "with a driver: after the synchronize, on the legacy stream"
        ),
    }
    assert_eq!(allocation(ended), None, "the entry is gone either way");
}
