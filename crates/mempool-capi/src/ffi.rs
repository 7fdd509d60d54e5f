//! The C entry points of `include/mempool.h`. Each returns a status (`MEMPOOL_SUCCESS` or a
//! `MEMPOOL_ERROR_*` code), leaves the message in `mempool_last_error()`, and never unwinds: a panic is
//! caught at the boundary and becomes `MEMPOOL_ERROR_PANIC`.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, Weak};

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::adaptors::{LimitingAdaptor, StatisticsAdaptor};
use mempool_rmm::suballoc::PoolOptions;
use mempool_rmm::{AsyncOptions, AsyncResource, CudaResource, ManagedResource, PoolResource, SharedResource};

use crate::device;
use crate::error::{self, Error, Result, Status};
use crate::registry;

/// `mempool_resource_t`: a counted reference to a resource, the device it allocates on, and its
/// statistics when it is a statistics adaptor. Every handle a create or get call returns is released by
/// `mempool_resource_destroy`; the resource lives while any handle, adaptor over it or registry entry
/// holds it. An allocation of `mempool_allocate` is a bare pointer and does not hold it: free every such
/// allocation before the last of those references goes (PyTorch's entry points do hold the resource of
/// each allocation they made).
pub struct ResourceHandle {
    shared: SharedResource,
    stats: Option<Arc<StatisticsAdaptor<SharedResource>>>,
    device: usize,
}

/// Statistics adaptors made through the C ABI or the Python package, by the address of the resource, so
/// that a handle to the current resource (`mempool_get_current_device_resource`) can read the counters
/// of a statistics adaptor set as current.
static STATISTICS: Mutex<Vec<(usize, Weak<StatisticsAdaptor<SharedResource>>)>> = Mutex::new(Vec::new());

fn address(r: &SharedResource) -> usize {
    Arc::as_ptr(r) as *const () as usize
}

/// Makes `stats` known to [`mempool_get_current_device_resource`]: a handle to the current resource reads
/// its counters while it is current (the Python package registers its `StatisticsResourceAdaptor`s).
pub fn register_statistics(stats: &Arc<StatisticsAdaptor<SharedResource>>) {
    let shared: SharedResource = stats.clone();
    let key = address(&shared);
    let mut table = STATISTICS.lock().unwrap_or_else(|p| p.into_inner());
    table.retain(|(k, w)| w.strong_count() > 0 && *k != key);
    table.push((key, Arc::downgrade(stats)));
}

/// The statistics adaptor that `shared` is, if one was registered and is alive.
fn statistics_of(shared: &SharedResource) -> Option<Arc<StatisticsAdaptor<SharedResource>>> {
    let key = address(shared);
    let table = STATISTICS.lock().unwrap_or_else(|p| p.into_inner());
    table.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade())
}

/// `mempool_statistics_t`: current, peak and total bytes and allocation counts.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct Statistics {
    /// Bytes allocated now (as requested).
    pub current_bytes: i64,
    /// The most bytes allocated at once.
    pub peak_bytes: i64,
    /// Bytes allocated in all.
    pub total_bytes: i64,
    /// Allocations live now.
    pub current_count: i64,
    /// The most allocations live at once.
    pub peak_count: i64,
    /// Allocations made in all.
    pub total_count: i64,
}

/// Runs an entry point's body: its status, with the thread's last error recorded (or cleared) inside the
/// caught closure, so that nothing after `catch_unwind` can panic. A panic becomes `MEMPOOL_ERROR_PANIC`
/// (its message recorded under a second guard; recording never panics, see [`error::record`]).
pub(crate) fn guard(f: impl FnOnce() -> Result<()>) -> c_int {
    let run = AssertUnwindSafe(move || match f() {
        Ok(()) => {
            error::clear();
            Status::Success as c_int
        }
        Err(e) => error::record(&e) as c_int,
    });
    catch_unwind(run).unwrap_or_else(|p| {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            error::record(&Error::Panic(error::panic_message(&*p)));
        }));
        Status::Panic as c_int
    })
}

fn ordinal(device: c_int) -> Result<usize> {
    usize::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device} is negative")))
}

/// Writes a new handle owning `h` to `*out` (released by `mempool_resource_destroy`); refuses a null `out`.
///
/// # Safety
/// 1. `out` is null or valid for a write of a pointer.
#[allow(unsafe_code)]
unsafe fn put_handle(out: *mut *mut ResourceHandle, h: ResourceHandle) -> Result<()> {
    // SAFETY: point 1; `as_mut` checks for null.
    let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
    *out = Box::into_raw(Box::new(h));
    Ok(())
}

/// The handle `h` points to; a null `h` is refused, with `what` naming the argument.
///
/// # Safety
/// 1. `h` is null or a live handle from this library (made by `put_handle`, not yet destroyed).
/// 2. The handle stays live, and is not destroyed, for the lifetime `'a` the caller picks.
#[allow(unsafe_code)]
unsafe fn handle<'a>(h: *const ResourceHandle, what: &str) -> Result<&'a ResourceHandle> {
    // SAFETY: points 1 and 2; `as_ref` checks for null.
    unsafe { h.as_ref() }.ok_or_else(|| Error::InvalidArgument(format!("{what} is null")))
}

fn plain(shared: SharedResource, device: usize) -> ResourceHandle {
    ResourceHandle {
        shared,
        stats: None,
        device,
    }
}

/// Refuses a resource of another device than `device`.
fn same_device(h: &ResourceHandle, device: usize, what: &str) -> Result<()> {
    if h.device != device {
        return Err(Error::InvalidArgument(format!(
            "{what} allocates on device {}, not on device {device}",
            h.device
        )));
    }
    Ok(())
}

/// This thread's last error message (empty after a success); valid until the thread's next call.
#[no_mangle]
#[allow(unsafe_code)]
pub extern "C" fn mempool_last_error() -> *const c_char {
    catch_unwind(error::last_error_ptr).unwrap_or(c"a panic was caught reading the last error".as_ptr())
}

/// The C name of a status code (`"MEMPOOL_ERROR_OUT_OF_MEMORY"`, ...), or `"MEMPOOL_UNKNOWN_STATUS"`.
#[no_mangle]
#[allow(unsafe_code)]
pub extern "C" fn mempool_status_name(status: c_int) -> *const c_char {
    catch_unwind(|| {
        Status::from_code(status)
            .map_or(c"MEMPOOL_UNKNOWN_STATUS", Status::c_name)
            .as_ptr()
    })
    .unwrap_or(c"MEMPOOL_UNKNOWN_STATUS".as_ptr())
}

/// Writes the number of visible devices to `*out`.
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_device_count(out: *mut c_int) -> c_int {
    guard(|| {
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        let n = device::count()?;
        *out = c_int::try_from(n).unwrap_or(c_int::MAX);
        Ok(())
    })
}

/// `cuMemAlloc` on `device` (RMM's `cuda_memory_resource`).
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_cuda_resource_create(device: c_int, out: *mut *mut ResourceHandle) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        let mr: SharedResource = Arc::new(CudaResource::new(&device::device(d)?)?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, d)) }
    })
}

/// `cuMemAllocManaged` on `device` (RMM's `managed_memory_resource`).
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_managed_resource_create(device: c_int, out: *mut *mut ResourceHandle) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        let mr: SharedResource = Arc::new(ManagedResource::new(&device::device(d)?)?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, d)) }
    })
}

/// A new stream-ordered pool on `device` that keeps what it reserves, primed with `initial_pool_size`
/// bytes (0: none) (RMM's `cuda_async_memory_resource`).
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_async_resource_create(
    device: c_int,
    initial_pool_size: usize,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        let options = AsyncOptions {
            initial_size: (initial_pool_size > 0).then_some(initial_pool_size),
            ..AsyncOptions::default()
        };
        let d = ordinal(device)?;
        let mr: SharedResource = Arc::new(AsyncResource::new(&device::device(d)?, options)?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, d)) }
    })
}

/// A pool suballocator over `upstream` on `device` (RMM's `pool_memory_resource`): reserves
/// `initial_pool_size` bytes at its first allocation and never more than `maximum_pool_size` (0: no
/// maximum). `device` must be the upstream's device (`MEMPOOL_ERROR_INVALID_ARGUMENT` otherwise).
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_pool_resource_create(
    upstream: *const ResourceHandle,
    device: c_int,
    initial_pool_size: usize,
    maximum_pool_size: usize,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        let d = ordinal(device)?;
        same_device(h, d, "upstream")?;
        let up = h.shared.clone();
        let dev = device::device(d)?;
        let options = PoolOptions {
            initial_size: initial_pool_size as u64,
            maximum_size: (maximum_pool_size > 0).then_some(maximum_pool_size as u64),
            ..PoolOptions::default()
        };
        let mr: SharedResource = Arc::new(PoolResource::new(up, &dev, options)?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, d)) }
    })
}

/// Counts what passes through to `upstream` (RMM's `statistics_resource_adaptor`); read it with
/// `mempool_statistics_get`.
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_statistics_adaptor_create(
    upstream: *const ResourceHandle,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        let stats = Arc::new(StatisticsAdaptor::new(h.shared.clone()));
        register_statistics(&stats);
        let shared: SharedResource = stats.clone();
        // SAFETY: point 1.
        unsafe {
            put_handle(
                out,
                ResourceHandle {
                    shared,
                    stats: Some(stats),
                    device: h.device,
                },
            )
        }
    })
}

/// Refuses allocations that would take more than `limit` bytes through it (RMM's
/// `limiting_resource_adaptor`; a refusal is `MEMPOOL_ERROR_OUT_OF_MEMORY`).
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_limiting_adaptor_create(
    upstream: *const ResourceHandle,
    limit: usize,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        let mr: SharedResource = Arc::new(LimitingAdaptor::new(h.shared.clone(), limit));
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, h.device)) }
    })
}

/// Reads a statistics adaptor's counters (`MEMPOOL_ERROR_INVALID_ARGUMENT` for another resource).
///
/// # Safety
/// 1. `resource` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_statistics_get(resource: *const ResourceHandle, out: *mut Statistics) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        let stats = h.stats.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "resource is a {}, not a statistics adaptor (make one with mempool_statistics_adaptor_create)",
                h.shared.name()
            ))
        })?;
        let c = stats.counters();
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        *out = Statistics {
            current_bytes: c.bytes.current,
            peak_bytes: c.bytes.peak,
            total_bytes: c.bytes.total,
            current_count: c.allocations.current,
            peak_count: c.allocations.peak,
            total_count: c.allocations.total,
        };
        Ok(())
    })
}

/// Releases a handle (null is a no-op). The resource itself lives on while other handles, adaptors over it
/// or the registry hold it. Allocations of `mempool_allocate` do not hold it: free them before the last
/// reference goes.
///
/// # Safety
/// 1. `resource` is null or a live handle from this library, released once.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_resource_destroy(resource: *mut ResourceHandle) {
    if resource.is_null() {
        return;
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: point 1: it came from `Box::into_raw` in `put_handle` and is released once. A panic while
        // dropping is caught here (resources' drops record their errors rather than panic).
        drop(unsafe { Box::from_raw(resource) })
    }));
    if let Err(p) = r {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            error::record(&Error::Panic(error::panic_message(&*p)));
        }));
    }
}

/// Allocates `bytes` from `resource`, ordered on `stream` (a `CUstream`/`cudaStream_t`; NULL is the legacy
/// default stream), and writes the address to `*out` (NULL for 0 bytes).
///
/// # Safety
/// 1. `resource` is null or a live handle; `out` is null or valid for a write.
/// 2. `stream` is a live stream of the resource's device, or a special handle.
/// 3. The returned pointer does not keep the resource alive: it is freed with `mempool_deallocate` while
///    the resource is still held (by a handle, an adaptor over it or the registry).
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_allocate(
    resource: *const ResourceHandle,
    bytes: usize,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        // SAFETY: point 2.
        let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
        *out = h.shared.allocate(bytes, s)?.as_raw() as *mut c_void;
        Ok(())
    })
}

/// Returns `ptr` (of `bytes`) to `resource`, ordered on `stream`. NULL is a no-op.
///
/// # Safety
/// 1. `resource` is null or a live handle.
/// 2. `ptr` is null or was returned by `mempool_allocate` of this resource (or an equal one) with this
///    `bytes`, and has not been freed since.
/// 3. No work uses the memory after this point of `stream`, a live stream of the resource's device.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_deallocate(
    resource: *const ResourceHandle,
    ptr: *mut c_void,
    bytes: usize,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        // SAFETY: point 3.
        let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) };
        // SAFETY: points 2 and 3 are the resource's `deallocate` contract.
        unsafe { h.shared.deallocate(DeviceAddr(ptr as u64), bytes, s) }?;
        Ok(())
    })
}

/// Makes `resource` the current resource of `device` (the registry keeps its own reference: the handle
/// may be destroyed afterwards). A resource of another device is refused (`MEMPOOL_ERROR_INVALID_ARGUMENT`).
/// Allocations of `mempool_allocate` from the previous resource must be freed while something else still
/// holds it; PyTorch's allocations hold their resource.
///
/// # Safety
/// 1. `resource` is null or a live handle.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_set_current_device_resource(device: c_int, resource: *const ResourceHandle) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        let d = ordinal(device)?;
        same_device(h, d, "resource")?;
        registry::set(d, h.shared.clone())?;
        Ok(())
    })
}

/// Writes a new handle to the current resource of `device` (made on first use: a resource over the
/// device's default pool) to `*out`; release it with `mempool_resource_destroy`. When the current resource
/// is a statistics adaptor (made by `mempool_statistics_adaptor_create` or the Python package's
/// `StatisticsResourceAdaptor`), `mempool_statistics_get` reads it through the new handle.
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_get_current_device_resource(device: c_int, out: *mut *mut ResourceHandle) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        let mr = registry::current(d)?;
        let stats = statistics_of(&mr);
        // SAFETY: point 1.
        unsafe {
            put_handle(
                out,
                ResourceHandle {
                    shared: mr,
                    stats,
                    device: d,
                },
            )
        }
    })
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_in_an_entry_point_is_caught_and_named() {
        let status = guard(|| panic!("the table was empty"));
        assert_eq!(status, Status::Panic as c_int);
        let text = error::last_error();
        assert!(text.contains("panic") && text.contains("the table was empty"), "{text}");
        assert_eq!(guard(|| Ok(())), Status::Success as c_int);
        assert_eq!(error::last_error(), "");
    }

    #[test]
    fn a_null_out_is_refused_before_the_driver_is_asked() {
        // SAFETY: a null `out` is allowed (point 1).
        let status = unsafe { mempool_device_count(std::ptr::null_mut()) };
        assert_eq!(status, Status::InvalidArgument as c_int);
        assert_eq!(error::last_error(), "invalid argument: out is null");
    }
}
