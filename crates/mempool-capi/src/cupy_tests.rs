//! Tests of [`crate::cupy`]'s entry points without a GPU (failures and refusals), in a module of their own:
//! their `raise` callback is a C function that is not an entry point.

use std::ffi::{c_int, c_void};

use crate::cupy::{allocation, mempool_cupy_free, mempool_cupy_malloc, state, FAILED};
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
