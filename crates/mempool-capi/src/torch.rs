//! PyTorch's pluggable-allocator entry points: `void* alloc(size_t, int device, cudaStream_t)` and
//! `void free(void*, size_t, int device, cudaStream_t)` (`torch.cuda.memory.CUDAPluggableAllocator`).
//!
//! Allocations come from the current resource of the device PyTorch names, and each is recorded with the
//! resource that made it, so a free goes back to that resource even after the current resource changed,
//! and a pointer mempool did not hand out is never freed.
//!
//! Out of memory: PyTorch 2.11's `CUDAPluggableAllocator::malloc` does not check what `alloc` returns (a
//! null pointer becomes a tensor whose data pointer is null, and the first kernel that touches it faults).
//! Its caching allocator, which `torch.cuda.MemPool` runs over a pluggable allocator, does check:
//! `allocPrimitive` turns null into `cudaErrorMemoryAllocation`, frees its cache, retries, and raises
//! `torch.OutOfMemoryError`. So there are two allocation entry points:
//! - [`mempool_torch_alloc`] reports a failure as a C++ exception (`std::runtime_error` whose message names
//!   the size, thrown by the C++ shim `src/torch_shim.cpp`), which PyTorch turns into a Python
//!   `RuntimeError`: for `change_current_allocator`.
//! - [`mempool_torch_alloc_nullable`] returns null: for `torch.cuda.MemPool`, whose caching allocator
//!   retries and raises `torch.OutOfMemoryError`.
//!
//! Neither lets a Rust panic cross the boundary; the failure is also left in `mempool_last_error()` of
//! the allocating thread.

use std::collections::HashMap;
#[cfg(mempool_cxx_shim)]
use std::ffi::c_char;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::SharedResource;

use crate::error::{self, Error, Result};
use crate::registry;

/// Whether [`mempool_torch_alloc`] reports a failure as a C++ exception (the C++ shim was compiled in);
/// without it, it returns null. `build.rs` leaves the shim out under `panic = "abort"`: a C++ exception
/// unwinding through `mempool_torch_alloc`'s frame would abort the process there.
pub const RAISES: bool = cfg!(mempool_cxx_shim);

const SHARDS: usize = 16;

/// Every live allocation PyTorch holds: address -> (size, resource). Sharded by address so that threads
/// allocating at once rarely meet on one lock.
/// One shard of the live allocations: address -> (size, resource).
type Shard = Mutex<Option<HashMap<u64, (usize, SharedResource)>>>;

static LIVE: [Shard; SHARDS] = [const { Mutex::new(None) }; SHARDS];

/// Frees that failed (an unknown pointer, a size that does not match, a driver error); see
/// [`free_failures`].
static FREE_FAILURES: AtomicU64 = AtomicU64::new(0);

fn shard(addr: u64) -> &'static Shard {
    // Allocations are 256-byte aligned: the bits above the alignment spread them.
    &LIVE[((addr >> 8) as usize) % SHARDS]
}

/// How many frees PyTorch asked for that mempool refused or that failed, since the process started.
pub fn free_failures() -> u64 {
    FREE_FAILURES.load(Ordering::Relaxed)
}

/// The number of allocations PyTorch holds now.
pub fn live_allocations() -> usize {
    LIVE.iter()
        .map(|s| {
            s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map_or(0, |m| m.len())
        })
        .sum()
}

/// `size` bytes from `device`'s current resource on `stream`, recorded in the live table.
///
/// # Safety
/// 1. `stream` is a live stream of `device` (or a special handle) for the duration of the call.
#[allow(unsafe_code)]
unsafe fn alloc(size: usize, device: c_int, stream: *mut c_void) -> Result<*mut c_void> {
    if size == 0 {
        return Ok(std::ptr::null_mut());
    }
    let ordinal =
        usize::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device} is negative")))?;
    let mr = registry::current(ordinal)?;
    // SAFETY: PyTorch passes its current stream of `device`, live for this call; the stream is only
    // used for this allocation here.
    #[allow(unsafe_code)]
    let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
    let addr = mr.allocate(size, s)?;
    shard(addr.as_raw())
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(addr.as_raw(), (size, mr));
    Ok(addr.as_raw() as *mut c_void)
}

/// [`alloc`] with the thread's last error recorded or cleared, and a panic caught: `None` on failure.
///
/// # Safety
/// 1. As point 1 of [`alloc`].
#[allow(unsafe_code)]
unsafe fn alloc_guarded(size: usize, device: c_int, stream: *mut c_void) -> Option<*mut c_void> {
    // The last error is recorded or cleared inside the caught closure (recording never panics, see
    // `error::record`), so nothing after `catch_unwind` can panic.
    let prefix = |size: usize| format!("mempool could not allocate {size} bytes on device {device}");
    // SAFETY: point 1.
    catch_unwind(AssertUnwindSafe(|| match unsafe { alloc(size, device, stream) } {
        Ok(p) => {
            error::clear();
            Some(p)
        }
        Err(e) => {
            // The message names what was asked whichever layer failed (a missing driver says nothing of
            // the size on its own).
            error::record_with_prefix(&e, &prefix(size));
            None
        }
    }))
    .unwrap_or_else(|p| {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            error::record_with_prefix(&Error::Panic(error::panic_message(&*p)), &prefix(size));
        }));
        None
    })
}

#[cfg(mempool_cxx_shim)]
#[allow(unsafe_code)]
extern "C-unwind" {
    /// Throws `std::runtime_error(message)` (`src/torch_shim.cpp`); never returns.
    fn mempool_cxx_throw(message: *const c_char) -> !;
}

/// PyTorch's `alloc`: `size` bytes on `device`'s current mempool resource, ordered on `stream`. 0 bytes is
/// null. On failure it throws a C++ `std::runtime_error` naming the size and the cause, which PyTorch
/// reports as a Python `RuntimeError` (see the module documentation); a build without the C++ shim returns
/// null instead.
///
/// # Safety
/// 1. `stream` is a live stream of `device` (or a special handle) for the duration of the call, and stays
///    live until the matching [`mempool_torch_free`], which frees on the stream given there.
/// 2. Called by C++ code that can take a C++ exception (PyTorch's allocator); the exception is the only
///    thing that unwinds out of this function.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C-unwind" fn mempool_torch_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    // SAFETY: point 1.
    match unsafe { alloc_guarded(size, device, stream) } {
        Some(p) => p,
        None => {
            #[cfg(mempool_cxx_shim)]
            // SAFETY: the message is this thread's last-error string, live until its next call into mempool,
            // which is after the shim copied it into the exception; this frame holds nothing to drop.
            unsafe {
                mempool_cxx_throw(error::last_error_ptr())
            }
            #[cfg(not(mempool_cxx_shim))]
            std::ptr::null_mut()
        }
    }
}

/// PyTorch's `alloc` for `torch.cuda.MemPool`: as [`mempool_torch_alloc`], but a failure returns null
/// (the caching allocator then frees its cache, retries, and raises `torch.OutOfMemoryError`). Never
/// unwinds.
///
/// # Safety
/// 1. As point 1 of [`mempool_torch_alloc`].
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_torch_alloc_nullable(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    // SAFETY: point 1.
    unsafe { alloc_guarded(size, device, stream) }.unwrap_or(std::ptr::null_mut())
}

/// Returns `ptr` (of `size` bytes) to the resource that allocated it, if the live table holds it with that
/// size; refuses it otherwise (nothing is freed).
///
/// # Safety
/// 1. `stream` is live for the duration of the call.
/// 2. No work uses the memory at `ptr` after this point of `stream`.
#[allow(unsafe_code)]
unsafe fn free(ptr: *mut c_void, size: usize, stream: *mut c_void) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    let addr = ptr as u64;
    let entry = {
        let mut g = shard(addr).lock().unwrap_or_else(|p| p.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        match map.get(&addr) {
            Some((n, _)) if *n == size => map.remove(&addr),
            Some((n, _)) => {
                return Err(Error::InvalidArgument(format!(
                    "free of {addr:#x} with {size} bytes, but mempool allocated {n} bytes there; not freed"
                )))
            }
            None => None,
        }
    };
    let Some((_, mr)) = entry else {
        return Err(Error::InvalidArgument(format!(
            "free of {addr:#x}, which mempool's PyTorch allocator did not hand out (or freed already); not freed"
        )));
    };
    // SAFETY: point 1 of `mempool_torch_free`: the stream is live.
    #[allow(unsafe_code)]
    let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
    // SAFETY: the table held `addr` with this size as returned by `mr.allocate` and not freed since (the
    // entry was removed above, so this is its only free); PyTorch frees a block once no work it queued
    // uses it, ordered on `stream` (point 2).
    unsafe { mr.deallocate(DeviceAddr(addr), size, s) }?;
    Ok(())
}

/// PyTorch's `free`: returns `ptr` (of `size` bytes, allocated by [`mempool_torch_alloc`] or
/// [`mempool_torch_alloc_nullable`]) to the resource that allocated it, ordered on `stream`. A pointer
/// mempool did not hand out, or a size that does not match, is refused (nothing is freed; the failure is
/// counted and left in `mempool_last_error()`). Never unwinds.
///
/// # Safety
/// 1. `stream` is live for the duration of the call.
/// 2. No work uses the memory after this point of `stream`.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_torch_free(ptr: *mut c_void, size: usize, _device: c_int, stream: *mut c_void) {
    let failed = |e: &Error| {
        FREE_FAILURES.fetch_add(1, Ordering::Relaxed);
        error::record(e);
    };
    // SAFETY: points 1 and 2.
    let r = catch_unwind(AssertUnwindSafe(|| match unsafe { free(ptr, size, stream) } {
        Ok(()) => error::clear(),
        Err(e) => failed(&e),
    }));
    if let Err(p) = r {
        let _ = catch_unwind(AssertUnwindSafe(|| failed(&Error::Panic(error::panic_message(&*p)))));
    }
}
