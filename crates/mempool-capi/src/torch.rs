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
//! the allocating thread, and in [`last_failure`] (which later successful calls do not clear).
//!
//! Counters per device ([`counters`], [`reset_peaks`]): bytes and allocations PyTorch holds through these
//! entry points now and at their peak, allocations and frees made, failed allocations. They are atomics
//! updated beside the live table, so reading them takes no lock.
//!
//! The path of one call is kept short: the device's current resource comes from the calling thread's cache
//! ([`registry::current`]: no process-wide lock while the registry is unchanged), the live table hashes an
//! address with one multiplication ([`crate::live`]), and an allocation updates three counters (a peak
//! only when it is passed); frees are counted as allocations made minus allocations live.

use std::cell::RefCell;
#[cfg(mempool_cxx_shim)]
use std::ffi::c_char;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use mempool_core::{DeviceAddr, KeptStream, StreamRef};
use mempool_rmm::SharedResource;

use crate::error::{self, Error, Result};
use crate::live::LiveTable;
use crate::registry;

/// Whether [`mempool_torch_alloc`] reports a failure as a C++ exception (the C++ shim was compiled in);
/// without it, it returns null. `build.rs` leaves the shim out under `panic = "abort"`: a C++ exception
/// unwinding through `mempool_torch_alloc`'s frame would abort the process there.
pub const RAISES: bool = cfg!(mempool_cxx_shim);

/// The live allocations: address -> (size, device, resource, the stream it was allocated on). Every
/// allocation PyTorch holds is in it.
static LIVE: LiveTable<(usize, usize, SharedResource, KeptStream<'static>)> = LiveTable::new();

/// Frees that failed (an unknown pointer, a size that does not match, a driver error); see
/// [`free_failures`].
static FREE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Devices whose allocations are counted ([`counters`]): ordinals `0..MAX_COUNTED_DEVICES`. Allocations on
/// a device past them work, uncounted.
pub const MAX_COUNTED_DEVICES: usize = 64;

/// One device's counters (see [`Counters`]).
struct DeviceCounters {
    bytes: AtomicU64,
    peak_bytes: AtomicU64,
    count: AtomicU64,
    peak_count: AtomicU64,
    /// Allocations made; frees made are `allocations - count`.
    allocations: AtomicU64,
    failures: AtomicU64,
}

impl DeviceCounters {
    const fn new() -> DeviceCounters {
        DeviceCounters {
            bytes: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            count: AtomicU64::new(0),
            peak_count: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    fn allocated(&self, size: usize) {
        // `count` is raised after `allocations`, so a reader never sees more live than made.
        self.allocations.fetch_add(1, Ordering::Relaxed);
        let bytes = self.bytes.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        // A peak is written only when passed (a load, not a read-modify-write, on most calls).
        if bytes > self.peak_bytes.load(Ordering::Relaxed) {
            self.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
        }
        if count > self.peak_count.load(Ordering::Relaxed) {
            self.peak_count.fetch_max(count, Ordering::Relaxed);
        }
    }

    fn freed(&self, size: usize) {
        self.bytes.fetch_sub(size as u64, Ordering::Relaxed);
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

static COUNTERS: [DeviceCounters; MAX_COUNTED_DEVICES] = [const { DeviceCounters::new() }; MAX_COUNTED_DEVICES];

fn device_counters(device: usize) -> Option<&'static DeviceCounters> {
    COUNTERS.get(device)
}

/// What PyTorch holds through these entry points on one device ([`counters`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes of live allocations (the sizes PyTorch asked for).
    pub bytes: u64,
    /// The most bytes live at once since the process started or the last [`reset_peaks`].
    pub peak_bytes: u64,
    /// Live allocations.
    pub count: u64,
    /// The most allocations live at once since the process started or the last [`reset_peaks`].
    pub peak_count: u64,
    /// Allocations made since the process started.
    pub allocations: u64,
    /// Frees made since the process started (refused frees are not counted: see [`free_failures`]).
    pub frees: u64,
    /// Allocations that failed since the process started (out of memory, no resource, a driver error).
    pub failures: u64,
}

/// The counters of `device`; all zero for a device at or past [`MAX_COUNTED_DEVICES`]. Each field is read
/// on its own: while other threads allocate, they may be from slightly different moments.
pub fn counters(device: usize) -> Counters {
    device_counters(device).map_or_else(Counters::default, |c| {
        // `count` before `allocations` (the reverse of `allocated`'s order): frees never read negative.
        let count = c.count.load(Ordering::Relaxed);
        let allocations = c.allocations.load(Ordering::Relaxed);
        Counters {
            bytes: c.bytes.load(Ordering::Relaxed),
            peak_bytes: c.peak_bytes.load(Ordering::Relaxed),
            count,
            peak_count: c.peak_count.load(Ordering::Relaxed),
            allocations,
            frees: allocations.saturating_sub(count),
            failures: c.failures.load(Ordering::Relaxed),
        }
    })
}

/// Sets `device`'s peaks (bytes and count) to their current values.
pub fn reset_peaks(device: usize) {
    if let Some(c) = device_counters(device) {
        c.peak_bytes.store(c.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        c.peak_count.store(c.count.load(Ordering::Relaxed), Ordering::Relaxed);
        // An allocation between the two loads and the stores may have raised the current values above the
        // stored peaks: raise them again.
        c.peak_bytes
            .fetch_max(c.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        c.peak_count
            .fetch_max(c.count.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

thread_local! {
    /// This thread's failed allocations so far, and the message of the last one.
    static LAST_FAILURE: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
}

/// This thread's failed allocations through these entry points so far, and the message of the last one
/// (`(0, "")` before the first). Unlike `mempool_last_error()`, a later successful call does not clear it:
/// PyTorch's caching allocator frees its cache (through [`mempool_torch_free`]) between a failed
/// allocation and the `OutOfMemoryError` it raises.
pub fn last_failure() -> (u64, String) {
    LAST_FAILURE
        .try_with(|l| l.try_borrow().map(|l| l.clone()).unwrap_or_default())
        .unwrap_or_default()
}

fn record_failure(device: c_int, message: String) {
    if let Some(c) = usize::try_from(device).ok().and_then(device_counters) {
        c.failures.fetch_add(1, Ordering::Relaxed);
    }
    let _ = LAST_FAILURE.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            l.0 += 1;
            l.1 = message;
        }
    });
}

/// How many frees PyTorch asked for that mempool refused or that failed, since the process started.
pub fn free_failures() -> u64 {
    FREE_FAILURES.load(Ordering::Relaxed)
}

/// The number of allocations PyTorch holds now.
pub fn live_allocations() -> usize {
    LIVE.len()
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
    LIVE.insert(addr.as_raw(), (size, ordinal, mr, s.kept()));
    if let Some(c) = device_counters(ordinal) {
        c.allocated(size);
    }
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
            let p = prefix(size);
            error::record_with_prefix(&e, &p);
            record_failure(device, format!("{p}: {e}"));
            None
        }
    }))
    .unwrap_or_else(|p| {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let e = Error::Panic(error::panic_message(&*p));
            let p = prefix(size);
            error::record_with_prefix(&e, &p);
            record_failure(device, format!("{p}: {e}"));
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
    let entry = LIVE.remove_if(addr, |(n, _, _, _)| {
        if *n == size {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "free of {addr:#x} with {size} bytes, but mempool allocated {n} bytes there; not freed"
            )))
        }
    });
    let Some((_, device, mr, allocated_on)) = entry.transpose()? else {
        return Err(Error::InvalidArgument(format!(
            "free of {addr:#x}, which mempool's PyTorch allocator did not hand out (or freed already); not freed"
        )));
    };
    // SAFETY: point 1 of `mempool_torch_free`: the stream is live.
    #[allow(unsafe_code)]
    let passed = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
    // PyTorch passes the stream it allocated on, as a handle: the per-thread default stream's names the
    // freeing thread's own stream, not the allocating thread's, so there the free goes on the legacy
    // stream, ordered after every thread's per-thread stream (`KeptStream::here`).
    let kept = if passed == allocated_on.as_kept() {
        allocated_on
    } else {
        passed.kept()
    };
    let context = || mempool_core::Device::get(device).and_then(|d| d.context());
    // SAFETY: the table held `addr` with this size as returned by `mr.allocate` and not freed since (the
    // entry was removed above, so this is its only free); PyTorch frees a block once no work it queued
    // uses it, ordered on `stream` (point 2), and `s` is that stream or, for another thread's per-thread
    // stream, the legacy stream, ordered after it (`KeptStream::order_here`).
    let free = |s| unsafe { mr.deallocate(DeviceAddr(addr), size, s) };
    let r = kept.order_here(context, free);
    // The entry left the table: PyTorch no longer holds the memory, whether or not the resource took it back.
    if let Some(c) = device_counters(device) {
        c.freed(size);
    }
    r?;
    Ok(())
}

/// PyTorch's `free`: returns `ptr` (of `size` bytes, allocated by [`mempool_torch_alloc`] or
/// [`mempool_torch_alloc_nullable`]) to the resource that allocated it, ordered on `stream` (the
/// per-thread default stream, when the allocation was made on another thread's, through the legacy
/// stream, which is ordered after it). A pointer
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_follow_allocations_and_frees_and_peaks_reset_to_current() {
        // A device ordinal no other test touches.
        let dev = MAX_COUNTED_DEVICES - 1;
        let c = device_counters(dev).unwrap();
        c.allocated(1000);
        c.allocated(24);
        c.freed(1000);
        let got = counters(dev);
        assert_eq!((got.bytes, got.count), (24, 1));
        assert_eq!((got.peak_bytes, got.peak_count), (1024, 2));
        assert_eq!((got.allocations, got.frees), (2, 1));
        reset_peaks(dev);
        let got = counters(dev);
        assert_eq!((got.peak_bytes, got.peak_count), (24, 1));
        c.freed(24);
        assert_eq!(counters(dev).bytes, 0);
        assert_eq!(
            counters(MAX_COUNTED_DEVICES),
            Counters::default(),
            "past the counted devices"
        );
    }

    #[test]
    #[allow(unsafe_code)]
    fn a_failed_allocation_is_counted_and_its_message_kept_past_later_calls() {
        let (before, _) = last_failure();
        // SAFETY: a null stream is the legacy default stream; the call fails before using it (a negative
        // device).
        let p = unsafe { mempool_torch_alloc_nullable(4096, -3, std::ptr::null_mut()) };
        assert!(p.is_null());
        let (n, message) = last_failure();
        assert_eq!(n, before + 1);
        assert!(message.contains("4096") && message.contains("-3"), "{message}");
        // A free of nothing succeeds and clears the last error, not the last failure.
        // SAFETY: a null pointer frees nothing; the stream is not used.
        unsafe { mempool_torch_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut()) };
        assert_eq!(error::last_error(), "");
        assert_eq!(last_failure(), (n, message));
    }

    /// A resource that records the stream of each free of its made-up addresses.
    #[derive(Debug)]
    struct Records(std::sync::Mutex<Vec<(u64, usize)>>);

    // SAFETY: it hands out nothing (the test puts made-up addresses in the live table itself), so no use of
    // memory depends on its promises.
    #[allow(unsafe_code)]
    unsafe impl mempool_rmm::MemoryResource for Records {
        fn allocate(&self, _bytes: usize, _stream: StreamRef<'_>) -> mempool_rmm::Result<DeviceAddr> {
            Err(mempool_rmm::Error::Unsupported {
                resource: "Records",
                reason: "a test double that only records frees".into(),
            })
        }

        #[allow(unsafe_code)]
        unsafe fn deallocate(&self, p: DeviceAddr, _n: usize, s: StreamRef<'_>) -> mempool_rmm::Result<()> {
            self.0.lock().unwrap().push((p.0, s.handle()));
            Ok(())
        }

        fn name(&self) -> &'static str {
            "Records"
        }
    }

    /// Issue 33, finding 2: PyTorch frees with the handle it allocated on; for the per-thread default
    /// stream (`torch.cuda.ExternalStream(2)`), a free on another thread (autograd's, a collector's) is
    /// made on the legacy stream, ordered after the allocating thread's per-thread stream, not on the
    /// freeing thread's own.
    #[test]
    #[allow(unsafe_code)]
    fn a_per_thread_allocation_freed_on_another_thread_is_freed_on_the_legacy_stream() {
        let records = std::sync::Arc::new(Records(std::sync::Mutex::new(Vec::new())));
        let mr: SharedResource = records.clone();
        let dev = MAX_COUNTED_DEVICES + 1; // uncounted: no other test's counters move
        let (here, there, other) = (0x7abc_0002_0000u64, 0x7abc_0002_1000u64, 0x7abc_0002_2000u64);
        for a in [here, there] {
            LIVE.insert(a, (256, dev, mr.clone(), StreamRef::PER_THREAD.kept()));
        }
        // SAFETY: a made-up handle, never used by the recording resource.
        let created = unsafe { StreamRef::from_raw(0x5000 as mempool_core::RawStream) };
        LIVE.insert(other, (256, dev, mr.clone(), created.kept()));
        // SAFETY: nothing uses the made-up addresses; the streams are only recorded.
        unsafe { free(here as *mut c_void, 256, 2 as *mut c_void) }.unwrap();
        std::thread::spawn(move || {
            // SAFETY: as above.
            unsafe { free(there as *mut c_void, 256, 2 as *mut c_void) }.unwrap();
            // SAFETY: as above.
            unsafe { free(other as *mut c_void, 256, 0x5000 as *mut c_void) }.unwrap();
        })
        .join()
        .unwrap();
        let freed = records.0.lock().unwrap().clone();
        assert_eq!(freed, vec![(here, 2), (there, 0), (other, 0x5000)]);
    }
}
