//! CuPy's allocator in C: the two functions `cupy.cuda.memory.CFunctionAllocator(param, malloc_func,
//! free_func, owner)` calls, `void* malloc(void* param, size_t size, int device)` and
//! `void free(void* param, void* ptr, int device)`, so that a CuPy allocation reaches mempool without
//! running Python code (`mempool.allocators.cupy.mempool_cupy_c_allocator` builds one).
//!
//! `param` points to a [`CupyParam`] that lives for the rest of the process (CuPy keeps only the address,
//! in every memory object it made, past the allocator's own life); the Python package builds one over
//! CuPy's C function for its current stream (`cupy_backends.cuda.stream.get_current_stream_ptr`, which
//! CuPy exports to other Cython modules), so no Python is entered per allocation on the default streams.
//!
//! - An allocation comes from the current resource of the device CuPy names, on CuPy's current stream
//!   of the calling thread (read through `param`'s `current_stream`; the legacy default stream without
//!   one), and is recorded with its size, stream and resource, so its free goes back to that resource on
//!   that stream even after the current resource or stream changed. A stream other than the default ones
//!   (0, 1: legacy; 2: per-thread) is kept alive through `param`'s `hold` until the free.
//! - A free (CuPy passes no size and no stream) returns the memory to the resource that allocated it, on
//!   the stream it was allocated on: ordered after the work queued there, as CuPy's own pools order it.
//!   The per-thread default stream (`CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`) is the allocating thread's:
//!   a free on another thread (the garbage collector's, a thread the array was handed to) goes on the
//!   legacy default stream, which waits for the work queued on every thread's per-thread stream
//!   ([`mempool_core::KeptStream`]); the handle 2 there would name the freeing thread's own stream.
//!   A pointer mempool did not hand out (or freed already) is refused, nothing is freed.
//! - A failure: the message (naming the size, the device and the cause) is left in `mempool_last_error()`
//!   and passed to `param`'s `raise` (the Python package sets a Python exception there), and the function
//!   returns `(void*)-1`; without `raise` it returns null. CuPy's `_call_malloc` is a Cython function
//!   returning `intptr_t`: built with Cython 3, which checks for a pending Python exception when such a
//!   function returns -1, it raises that exception from `cupy.cuda.alloc`. (Null would not be checked,
//!   and CuPy would build an array over address 0.)
//!
//! The functions call `param`'s callbacks, which need what their caller needs: the Python package's need
//! the GIL, which CuPy holds when it allocates and frees. Neither lets a Rust panic cross the boundary.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use mempool_core::{DeviceAddr, KeptStream, StreamRef};
use mempool_rmm::SharedResource;

use crate::cupy_param::{CupyParam, Release};
use crate::error::{self, Error, Result};
use crate::live::LiveTable;
use crate::registry;

/// What a failed allocation returns when `param` has a `raise`: `(void*)-1`, which CuPy (built with
/// Cython 3) checks for a pending exception.
pub const FAILED: usize = usize::MAX;

/// The highest special stream handle: 0 is NULL, 1 `CU_STREAM_LEGACY`, 2 `CU_STREAM_PER_THREAD`; none is
/// ever destroyed, so none is held.
const LAST_SPECIAL_STREAM: usize = 2;

/// One live allocation.
struct Entry {
    size: usize,
    /// The device's ordinal (its context is synchronized before a free on another thread than the one
    /// that allocated on its per-thread stream, once that thread has ended).
    device: usize,
    /// The stream it was allocated on, kept: its free orders after that stream's work from any thread.
    stream: KeptStream<'static>,
    /// What `hold` returned (null when nothing is held).
    token: usize,
    /// The `release` to call with `token`.
    param: usize,
    mr: SharedResource,
}

static LIVE: LiveTable<Entry> = LiveTable::new();
static ALLOC_FAILURES: AtomicU64 = AtomicU64::new(0);
static FREE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// `(live allocations, failed allocations, refused or failed frees)` of these entry points in this process.
pub fn state() -> (usize, u64, u64) {
    (
        LIVE.len(),
        ALLOC_FAILURES.load(Ordering::Relaxed),
        FREE_FAILURES.load(Ordering::Relaxed),
    )
}

/// The stream (its handle) and size `addr` was allocated with, while it is live.
pub fn allocation(addr: u64) -> Option<(usize, usize)> {
    LIVE.with(addr, |e| (e.stream.as_kept().handle(), e.size))
}

/// A stream hold: the token `param`'s `hold` returned (0: nothing held) and the `release` that ends it.
/// Dropping it releases the token, so an allocation that fails or panics, and a free whose
/// `deallocate` returns or panics, end the hold; [`StreamHold::into_token`] disarms it once a live
/// entry owns the token. A leaked hold leaks only a reference to the stream.
struct StreamHold {
    token: usize,
    release: Option<Release>,
}

impl StreamHold {
    /// A hold of nothing.
    fn none() -> StreamHold {
        StreamHold {
            token: 0,
            release: None,
        }
    }

    /// Takes charge of `token`.
    ///
    /// # Safety
    /// 1. `token` is 0 or came from the `hold` of the param whose `release` this is, and nothing else
    ///    releases it.
    /// 2. `release` may be called whenever this value drops (within the entry point's call: its
    ///    caller holds what the callbacks need).
    #[allow(unsafe_code)]
    unsafe fn new(token: usize, release: Option<Release>) -> StreamHold {
        StreamHold { token, release }
    }

    /// The token, now owned by the caller (a live entry); nothing is released.
    fn into_token(mut self) -> usize {
        std::mem::replace(&mut self.token, 0)
    }
}

impl Drop for StreamHold {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if let (Some(release), true) = (self.release, self.token != 0) {
            // SAFETY: points 1 and 2 of `StreamHold::new`; the token is released once (it is zeroed
            // when handed on, and this value drops once).
            unsafe { release(self.token as *mut c_void) };
        }
    }
}

/// The calling thread's current stream, through `param`.
///
/// # Safety
/// 1. `param`'s callbacks may be called now (for the Python package's: the GIL is held).
#[allow(unsafe_code)]
unsafe fn current_stream(param: &CupyParam) -> Result<usize> {
    let Some(get) = param.current_stream else {
        return Ok(0);
    };
    // SAFETY: point 1.
    let s = unsafe { get() };
    usize::try_from(s).map_err(|_| {
        Error::InvalidArgument(format!(
            "CuPy's current stream could not be read (its getter returned {s})"
        ))
    })
}

/// `size` bytes from `device`'s current resource on `param`'s current stream, recorded in the live table.
///
/// # Safety
/// 1. `param`'s callbacks may be called now.
/// 2. The stream they name is a live stream of `device` (or a special handle) for the duration of the
///    call; `hold` keeps any other alive until its `release`.
#[allow(unsafe_code)]
unsafe fn alloc(param: &CupyParam, param_addr: usize, size: usize, device: c_int) -> Result<*mut c_void> {
    if size == 0 {
        return Ok(std::ptr::null_mut());
    }
    let ordinal =
        usize::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device} is negative")))?;
    // SAFETY: point 1.
    let stream = unsafe { current_stream(param) }?;
    let mr = registry::current(ordinal)?;
    // SAFETY: points 1 and 2.
    unsafe { alloc_on(param, param_addr, size, stream, ordinal, mr) }
}

/// `size` bytes from `mr` on `stream`, held through `param` when not special, recorded in the live table.
/// The hold ends if the allocation fails or panics.
///
/// # Safety
/// 1. `param`'s callbacks may be called now; `param_addr` is the address of a [`CupyParam`] equal to
///    `param` that lives for the rest of the process.
/// 2. `stream` is a live stream of `mr`'s device (or a special handle) for the duration of the call;
///    `hold` keeps any other alive until its `release`.
/// 3. `device` is the ordinal of `mr`'s device.
#[allow(unsafe_code)]
pub(crate) unsafe fn alloc_on(
    param: &CupyParam,
    param_addr: usize,
    size: usize,
    stream: usize,
    device: usize,
    mr: SharedResource,
) -> Result<*mut c_void> {
    let hold = match param.hold {
        Some(hold) if stream > LAST_SPECIAL_STREAM => {
            // SAFETY: point 1.
            let t = unsafe { hold(stream as isize) };
            if t.is_null() {
                return Err(Error::InvalidArgument(format!(
                    "CuPy's current stream {stream:#x} could not be kept alive for the allocation"
                )));
            }
            // SAFETY: the token came from this param's `hold` and only this value releases it; its
            // `release` may be called during this call (point 1), where the value drops or is disarmed.
            unsafe { StreamHold::new(t as usize, param.release) }
        }
        _ => StreamHold::none(),
    };
    // SAFETY: point 2: the stream is live for this call (and held until the free, when not special).
    let s = unsafe { StreamRef::from_raw(stream as *mut c_void as mempool_core::RawStream) };
    // A failure or a panic in `allocate` drops `hold`, which releases it.
    let addr = mr.allocate(size, s)?;
    LIVE.insert(
        addr.as_raw(),
        Entry {
            size,
            device,
            stream: s.kept(),
            token: hold.into_token(),
            param: param_addr,
            mr,
        },
    );
    Ok(addr.as_raw() as *mut c_void)
}

/// CuPy's `malloc`: `size` bytes on `device`'s current mempool resource, on CuPy's current stream (see
/// the module documentation). A failure returns `(void*)-1` after calling `param`'s `raise`, or null
/// without one; its message is in `mempool_last_error()`. Never unwinds.
///
/// # Safety
/// 1. `param` is null or points to a [`CupyParam`] that lives for the rest of the process.
/// 2. Its callbacks may be called now (the Python package's need the GIL: CuPy holds it).
/// 3. The stream `current_stream` names is a live stream of `device` (or a special handle), kept alive by
///    `hold` when `hold` is given, else for as long as memory allocated on it lives.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_cupy_malloc(param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    // SAFETY: point 1: null or a live `CupyParam`.
    let p = unsafe { (param as *const CupyParam).as_ref() }
        .copied()
        .unwrap_or_default();
    let failed = |e: &Error| {
        ALLOC_FAILURES.fetch_add(1, Ordering::Relaxed);
        let status = error::record_with_prefix(
            e,
            &format!("mempool could not allocate {size} bytes on device {device} for CuPy"),
        );
        match p.raise {
            Some(raise) => {
                // SAFETY: point 2; the message is this thread's last-error string, live until its next call
                // into mempool, after `raise` copied it.
                unsafe { raise(status as c_int, error::last_error_ptr()) };
                FAILED as *mut c_void
            }
            None => std::ptr::null_mut(),
        }
    };
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: points 2 and 3.
        let allocated = unsafe { alloc(&p, param as usize, size, device) };
        match allocated {
            Ok(ptr) => {
                error::clear();
                ptr
            }
            Err(e) => failed(&e),
        }
    }));
    r.unwrap_or_else(|panic| {
        catch_unwind(AssertUnwindSafe(|| {
            failed(&Error::Panic(error::panic_message(&*panic)))
        }))
        .unwrap_or(std::ptr::null_mut())
    })
}

/// Returns `addr` to the resource that allocated it, on the stream it was allocated on (for the per-thread
/// stream of another thread, the legacy stream, ordered after it), and ends the hold of that stream.
///
/// # Safety
/// 1. No work uses the memory at `addr` after the work queued so far on the stream it was allocated on.
/// 2. The `release` of the param it was allocated with may be called now.
#[allow(unsafe_code)]
pub(crate) unsafe fn free(addr: u64) -> Result<()> {
    let Some(Ok(e)) = LIVE.remove_if(addr, |_| Ok::<(), ()>(())) else {
        return Err(Error::InvalidArgument(format!(
            "free of {addr:#x}, which mempool's CuPy allocator did not hand out (or freed already); not freed"
        )));
    };
    let release = if e.token != 0 {
        // SAFETY: the entry's `param` is the live `CupyParam` (point 1 of `mempool_cupy_malloc`) whose
        // `hold` returned the token.
        unsafe { (e.param as *const CupyParam).as_ref() }.and_then(|p| p.release)
    } else {
        None
    };
    // Released when this drops: after `deallocate` returns, or while it unwinds from a panic.
    // SAFETY: the token came from that param's `hold` and is released only here (the entry is gone);
    // point 2.
    let _hold = unsafe { StreamHold::new(e.token, release) };
    // The stream was live at the allocation and is held (or special) until `_hold` drops; on another thread
    // than the allocating one, its per-thread stream is ordered after through the legacy stream
    // (`KeptStream::order_here`).
    let device = e.device;
    let context = || mempool_core::Device::get(device).and_then(|d| d.context());
    // SAFETY: the table held `addr` with this size as returned by `e.mr.allocate` and not freed since (the
    // entry was removed above, so this is its only free); point 1 orders its uses before the point of the
    // allocation's stream where the free is made, and `s` is that stream or one ordered after it.
    let free = |s| unsafe { e.mr.deallocate(DeviceAddr(addr), e.size, s) };
    Ok(e.stream.order_here(context, free)?)
}

/// CuPy's `free`: returns `ptr` (from [`mempool_cupy_malloc`]) to the resource that allocated it, ordered
/// on the stream it was allocated on. A pointer mempool did not hand out is refused (nothing is freed; the
/// failure is counted and left in `mempool_last_error()`). `param` and `device` are not needed: the live
/// table knows the allocation. Never unwinds.
///
/// # Safety
/// 1. No work uses the memory after the work queued so far on the stream it was allocated on (CuPy frees an
///    array's memory when the last reference goes; work on other streams is the user's to order, as with
///    CuPy's own pools).
/// 2. The callbacks of the param it was allocated with may be called now (CuPy holds the GIL).
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_cupy_free(_param: *mut c_void, ptr: *mut c_void, _device: c_int) {
    if ptr.is_null() {
        return;
    }
    let failed = |e: &Error| {
        FREE_FAILURES.fetch_add(1, Ordering::Relaxed);
        error::record(e);
    };
    // SAFETY: points 1 and 2.
    let r = catch_unwind(AssertUnwindSafe(|| match unsafe { free(ptr as u64) } {
        Ok(()) => error::clear(),
        Err(e) => failed(&e),
    }));
    if let Err(p) = r {
        let _ = catch_unwind(AssertUnwindSafe(|| failed(&Error::Panic(error::panic_message(&*p)))));
    }
}
