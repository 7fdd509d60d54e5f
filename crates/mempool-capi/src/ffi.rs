//! The C entry points of `include/mempool.h`. Each returns a status (`MEMPOOL_SUCCESS` or a
//! `MEMPOOL_ERROR_*` code), leaves the message in `mempool_last_error()`, and never unwinds: a panic is
//! caught at the boundary and becomes `MEMPOOL_ERROR_PANIC`.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, Weak};

use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::adaptors::{LimitingAdaptor, StatisticsAdaptor};
use mempool_rmm::suballoc::{ArenaOptions, PoolOptions};
use mempool_rmm::{
    ArenaResource, AsyncOptions, AsyncResource, CudaResource, ManagedResource, PoolResource, ServiceResource,
    SharedResource, Tag,
};

use crate::build;
use crate::device;
use crate::error::{self, Error, Result, Status};
use crate::registry;
use crate::service;

/// `mempool_resource_t`: a counted reference to a resource, the device it allocates on, its statistics
/// when it is a statistics adaptor, and the service resource when it is one or a tag of one. Every handle a create or get call returns is released by
/// `mempool_resource_destroy`; the resource lives while any handle, adaptor over it or registry entry
/// holds it. An allocation of `mempool_allocate` is a bare pointer and does not hold it: free every such
/// allocation before the last of those references goes (PyTorch's entry points do hold the resource of
/// each allocation they made).
pub struct ResourceHandle {
    shared: SharedResource,
    stats: Option<Arc<StatisticsAdaptor<SharedResource>>>,
    service: Option<Arc<ServiceResource>>,
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

/// A new C handle to `shared`, a resource of `device` made outside the C ABI (the Python package's
/// resources, for the RMM bridge of docs/rmm.md): the caller owns it and releases it with
/// `mempool_resource_destroy`. A statistics adaptor registered with [`register_statistics`] keeps its
/// counters readable through the handle.
pub fn new_handle(shared: SharedResource, device: usize) -> *mut ResourceHandle {
    let stats = statistics_of(&shared);
    Box::into_raw(Box::new(ResourceHandle {
        shared,
        stats,
        service: None,
        device,
    }))
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
        service: None,
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

/// Power-of-two bins of fixed-size blocks over `upstream` (RMM's `binning_memory_resource`): bins of
/// `2^min_size_exponent` to `2^max_size_exponent` bytes (exponents under 8 give the 256-byte bin, as RMM
/// rounds bin sizes up to 256); a larger request goes to `upstream`. `min_size_exponent <= max_size_exponent
/// <= 40`, both non-negative, else `MEMPOOL_ERROR_INVALID_ARGUMENT`. mempool's default stack is bins 8 to 20
/// over a pool over the driver's pool.
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_binning_resource_create(
    upstream: *const ResourceHandle,
    min_size_exponent: c_int,
    max_size_exponent: c_int,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        let dev = device::device(h.device)?;
        let mr: SharedResource = Arc::new(build::rmm_binning(
            h.shared.clone(),
            &dev,
            min_size_exponent,
            max_size_exponent,
        )?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, h.device)) }
    })
}

/// A global arena of `arena_size` bytes taken from `upstream`, shared out through per-stream arenas (RMM's
/// `arena_memory_resource`); it does not grow. `arena_size` 0 is `MEMPOOL_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_arena_resource_create(
    upstream: *const ResourceHandle,
    arena_size: usize,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        if arena_size == 0 {
            return Err(Error::InvalidArgument("arena_size is 0".into()));
        }
        let options = ArenaOptions {
            initial_size: arena_size as u64,
            maximum_size: Some(arena_size as u64),
            ..ArenaOptions::default()
        };
        let dev = device::device(h.device)?;
        let mr: SharedResource = Arc::new(ArenaResource::new(h.shared.clone(), &dev, options)?);
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, h.device)) }
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
                    service: None,
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

/// On out of memory, trims the stack under it, synchronizes the request's stream and retries once
/// (`mempool_rmm::adaptors::OomRetryAdaptor`; docs/observe.md, "Out of memory").
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_oom_retry_adaptor_create(
    upstream: *const ResourceHandle,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        let mr: SharedResource = Arc::new(mempool_rmm::adaptors::OomRetryAdaptor::new(h.shared.clone()));
        // SAFETY: point 1.
        unsafe { put_handle(out, plain(mr, h.device)) }
    })
}

/// Records the allocations and frees through it in a history of `capacity` events
/// (`mempool_rmm::observe::HistoryResource`; 0 is refused).
///
/// # Safety
/// 1. `upstream` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_history_adaptor_create(
    upstream: *const ResourceHandle,
    capacity: usize,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(upstream, "upstream") }?;
        if capacity == 0 {
            return Err(Error::InvalidArgument(
                "capacity is 0: a history keeps at least one event".into(),
            ));
        }
        let history = Arc::new(mempool_rmm::observe::History::new(capacity));
        let mr: SharedResource = Arc::new(mempool_rmm::observe::HistoryResource::with_history(
            h.shared.clone(),
            history,
        ));
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

/// Writes a new handle to the same resource as `resource` to `*out` (a counted reference of its own,
/// released with `mempool_resource_destroy`; the two handles are equal by `mempool_resource_is_equal`). A
/// wrapper that keeps a handle it was lent (mempool/rmm.hpp) takes one this way.
///
/// # Safety
/// 1. `resource` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_resource_retain(
    resource: *const ResourceHandle,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        let copy = ResourceHandle {
            shared: h.shared.clone(),
            stats: h.stats.clone(),
            service: h.service.clone(),
            device: h.device,
        };
        // SAFETY: point 1.
        unsafe { put_handle(out, copy) }
    })
}

/// Writes 1 to `*out` when memory allocated through `a` may be freed through `b` (the same resource, or
/// resources that say they are equal: RMM's `is_equal`), else 0.
///
/// # Safety
/// 1. `a` and `b` are null or live handles; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_resource_is_equal(
    a: *const ResourceHandle,
    b: *const ResourceHandle,
    out: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: live handles; the references do not outlive this call.
        let a = unsafe { handle(a, "a") }?;
        // SAFETY: point 1.
        let b = unsafe { handle(b, "b") }?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        let same = Arc::ptr_eq(&a.shared, &b.shared) || a.shared.is_equal(&*b.shared);
        *out = c_int::from(a.device == b.device && same);
        Ok(())
    })
}

/// Writes the ordinal of the device `resource` allocates on to `*out`.
///
/// # Safety
/// 1. `resource` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_resource_device(resource: *const ResourceHandle, out: *mut c_int) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(resource, "resource") }?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        // Every handle's device came in as a `c_int` (an ordinal of a create call or the registry's).
        *out = c_int::try_from(h.device).unwrap_or(c_int::MAX);
        Ok(())
    })
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
                    service: None,
                    device: d,
                },
            )
        }
    })
}

/// `mempool_service_sleep_report_t`: what `mempool_service_sleep` released.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct ServiceSleepReport {
    /// Physical memory unmapped and released.
    pub released_bytes: u64,
    /// Bytes copied to pinned host memory (`MEMPOOL_SLEEP_OFFLOAD`).
    pub offloaded_bytes: u64,
}

/// `mempool_service_wake_report_t`: what `mempool_service_wake` brought back.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct ServiceWakeReport {
    /// Physical memory mapped again.
    pub mapped_bytes: u64,
    /// Bytes copied back from pinned host memory.
    pub restored_bytes: u64,
}

/// `mempool_service_stats_t`: what a service resource holds, every tag together.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct ServiceStatistics {
    /// Physical memory mapped now.
    pub mapped_bytes: u64,
    /// The most mapped at once (since the last peak reset).
    pub peak_mapped_bytes: u64,
    /// Bytes of live allocations.
    pub used_bytes: u64,
    /// The most bytes live at once (since the last peak reset).
    pub peak_used_bytes: u64,
    /// The reserved virtual range's size.
    pub reservation_bytes: u64,
    /// The chunk size.
    pub chunk_size: u64,
    /// How many times idle chunks were unmapped on the resource's own.
    pub reclaims: u64,
    /// Bytes unmapped by those reclaims and by trims.
    pub reclaimed_bytes: u64,
    /// How many tags the resource has (the default included).
    pub num_tags: usize,
}

/// `mempool_service_tag_stats_t`: what one tag of a service resource holds.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct ServiceTagStatistics {
    /// The tag's name, NUL-terminated (at most 64 bytes before the NUL).
    pub name: [c_char; 65],
    /// The tag's number.
    pub tag: u32,
    /// -1 while awake, else the `MEMPOOL_SLEEP_*` mode it sleeps in.
    pub asleep: c_int,
    /// Bytes of live allocations.
    pub used_bytes: u64,
    /// The most bytes live at once (since the last peak reset).
    pub peak_used_bytes: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// Allocations made.
    pub allocations: u64,
    /// Frees made.
    pub frees: u64,
    /// Physical memory mapped now.
    pub mapped_bytes: u64,
    /// Bytes kept in pinned host memory while it sleeps offloaded.
    pub offloaded_bytes: u64,
    /// The largest free block in mapped memory.
    pub largest_free_mapped: u64,
    /// Ranges of it shared with other processes now.
    pub exports: u64,
}

// A tag name and its NUL fit `ServiceTagStatistics::name`.
const _: () = assert!(mempool_rmm::MAX_TAG_NAME < 65);

/// The service resource behind a handle of `mempool_service_resource_create` or
/// `mempool_service_tagged_resource`; another resource is refused, naming what it is.
fn service_of(h: &ResourceHandle) -> Result<&Arc<ServiceResource>> {
    h.service.as_ref().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "service is a {}, not a service resource (make one with mempool_service_resource_create)",
            h.shared.name()
        ))
    })
}

/// The tags of `(tags, num_tags)`, each checked against `mr`.
///
/// # Safety
/// 1. `tags` is null or valid for reads of `num_tags` values.
#[allow(unsafe_code)]
unsafe fn tag_list(mr: &ServiceResource, tags: *const u32, num_tags: usize) -> Result<Vec<Tag>> {
    if num_tags == 0 {
        return Ok(Vec::new());
    }
    if tags.is_null() {
        return Err(Error::InvalidArgument(format!(
            "tags is null and num_tags is {num_tags}"
        )));
    }
    // SAFETY: point 1; `tags` is not null and `num_tags` is not 0.
    let list = unsafe { std::slice::from_raw_parts(tags, num_tags) };
    list.iter().map(|&t| service::tag_by_number(mr, u64::from(t))).collect()
}

/// A service resource on `device` (mempool-rmm's `ServiceResource`): one virtual reservation divided into
/// a region per tag, physical memory mapped in chunks where allocations land, whole tags put to sleep and
/// woken at the same addresses. Allocations through the handle are of the default tag;
/// `mempool_service_tagged_resource` gives a handle per tag. `max_tags` (0: 8), `chunk_size` (0: the
/// recommended granularity, at least 2 MiB) and `region_size` (0: twice the device's memory) lay it out;
/// `watermark_percent` bounds what it maps above the peak of live bytes (`MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY`,
/// -1: idle chunks are unmapped only when mapping runs out of memory); `shareable` is 1 for chunks
/// exportable as POSIX file descriptors, 0 for none, -1 where the device supports it.
///
/// # Safety
/// 1. `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_resource_create(
    device: c_int,
    max_tags: usize,
    chunk_size: usize,
    region_size: usize,
    watermark_percent: c_int,
    shareable: c_int,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        let watermark = match watermark_percent {
            -1 => None,
            p => Some(u32::try_from(p).map_err(|_| {
                Error::InvalidArgument(format!(
                    "watermark_percent {p} is negative (give a percent, or MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY)"
                ))
            })?),
        };
        let shareable = match shareable {
            -1 => None,
            0 => Some(false),
            1 => Some(true),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "shareable is {other}: give 1 (yes), 0 (no) or -1 (where the device supports it)"
                )))
            }
        };
        let nonzero = |n: usize| (n > 0).then_some(n);
        let max_tags = if max_tags == 0 {
            mempool_rmm::ServiceOptions::default().max_tags
        } else {
            max_tags
        };
        let options = service::options(
            max_tags,
            nonzero(chunk_size),
            nonzero(region_size),
            watermark,
            shareable,
        );
        let mr = service::create(d, options)?;
        let shared: SharedResource = mr.clone();
        let h = ResourceHandle {
            shared,
            stats: None,
            service: Some(mr),
            device: d,
        };
        // SAFETY: point 1.
        unsafe { put_handle(out, h) }
    })
}

/// Writes the number of the tag named `name` of `service` to `*out`, making the tag if there is none (a
/// name is 1 to 64 ASCII letters, digits, `_`, `-`, `.` or `:`; more tags than `max_tags` is refused).
/// The default tag is 0, named "default".
///
/// # Safety
/// 1. `service` is null or a live handle; `name` is null or a NUL-terminated string; `out` is null or valid
///    for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_tag(
    service: *const ResourceHandle,
    name: *const c_char,
    out: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let mr = service_of(unsafe { handle(service, "service") }?)?;
        if name.is_null() {
            return Err(Error::InvalidArgument("name is null".into()));
        }
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        // SAFETY: point 1: a NUL-terminated string, not null.
        let name = unsafe { std::ffi::CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| Error::InvalidArgument("name is not UTF-8".into()))?;
        let tag = service::tag_or_new(mr, name)?;
        *out = tag.index() as u32;
        Ok(())
    })
}

/// Writes a new handle that allocates from `service` under `tag` to `*out` (usable wherever a resource
/// is: `mempool_allocate`, adaptors, `mempool_set_current_device_resource`); frees through it go to
/// whichever tag the address lies in. Release it with `mempool_resource_destroy`; it holds the resource.
///
/// # Safety
/// 1. `service` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_tagged_resource(
    service: *const ResourceHandle,
    tag: u32,
    out: *mut *mut ResourceHandle,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(service, "service") }?;
        let mr = service_of(h)?;
        let tag = service::tag_by_number(mr, u64::from(tag))?;
        let shared: SharedResource = Arc::new(mr.tagged(tag));
        let t = ResourceHandle {
            shared,
            stats: None,
            service: Some(mr.clone()),
            device: h.device,
        };
        // SAFETY: point 1.
        unsafe { put_handle(out, t) }
    })
}

/// Releases the physical memory of the `num_tags` tags at `tags`, keeping their addresses and live
/// allocations: `MEMPOOL_SLEEP_OFFLOAD` copies the contents to pinned host memory first (ordered on
/// `stream`), `MEMPOOL_SLEEP_DISCARD` loses them. It waits for the frees into the tags still in flight
/// (on any stream) and, where a tag still has live allocations (whose users' streams it never sees), for
/// the whole device; a tag with nothing live does not wait for the device. Refused with nothing changed:
/// an unknown tag, a tag already asleep or with ranges shared with another process, `stream` with work
/// still queued.
/// Allocating from a sleeping tag is refused until `mempool_service_wake`; a free into it is taken (the
/// block's chunks that nothing live touches are not mapped back).
///
/// # Safety
/// 1. `service` is null or a live handle; `tags` is null or valid for reads of `num_tags` values; `out` is
///    null or valid for a write.
/// 2. `stream` is a live stream of the resource's device, or a special handle.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_sleep(
    service: *const ResourceHandle,
    tags: *const u32,
    num_tags: usize,
    mode: c_int,
    stream: *mut c_void,
    out: *mut ServiceSleepReport,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(service, "service") }?;
        let mr = service_of(h)?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        // SAFETY: point 1.
        let tags = unsafe { tag_list(mr, tags, num_tags) }?;
        let mode = service::mode_of_code(mode)?;
        let ctx = device::context(h.device)?;
        // SAFETY: point 2; the view does not outlive this call.
        let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) }.in_context(&ctx);
        let r = mr.sleep(&tags, mode, s)?;
        *out = ServiceSleepReport {
            released_bytes: r.released_bytes,
            offloaded_bytes: r.offloaded_bytes,
        };
        Ok(())
    })
}

/// Maps the memory of the sleeping tags among the `num_tags` at `tags` back at the same addresses and
/// restores the contents of offloaded ones, ordered on `stream`; returns once `stream` is done. Awake tags
/// are skipped. On out of memory the failing tag stays asleep with its contents: call again later.
///
/// # Safety
/// 1. `service` is null or a live handle; `tags` is null or valid for reads of `num_tags` values; `out` is
///    null or valid for a write.
/// 2. `stream` is a live stream of the resource's device, or a special handle.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_wake(
    service: *const ResourceHandle,
    tags: *const u32,
    num_tags: usize,
    stream: *mut c_void,
    out: *mut ServiceWakeReport,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let h = unsafe { handle(service, "service") }?;
        let mr = service_of(h)?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        // SAFETY: point 1.
        let tags = unsafe { tag_list(mr, tags, num_tags) }?;
        let ctx = device::context(h.device)?;
        // SAFETY: point 2; the view does not outlive this call.
        let s = unsafe { StreamRef::from_raw(stream as mempool_core::RawStream) }.in_context(&ctx);
        let r = mr.wake(&tags, s)?;
        *out = ServiceWakeReport {
            mapped_bytes: r.mapped_bytes,
            restored_bytes: r.restored_bytes,
        };
        Ok(())
    })
}

/// Waits for the frees still in flight, unmaps every chunk of an awake tag that no live allocation
/// touches, and writes the bytes released to `*out`.
///
/// # Safety
/// 1. `service` is null or a live handle; `out` is null or valid for a write.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_trim(service: *const ResourceHandle, out: *mut u64) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let mr = service_of(unsafe { handle(service, "service") }?)?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        *out = mr.trim()?;
        Ok(())
    })
}

/// Sets every peak of `service` (its own and each tag's) to the current value; the watermark follows the
/// peak of live bytes, so the resource may hold less from now on.
///
/// # Safety
/// 1. `service` is null or a live handle.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_reset_peaks(service: *const ResourceHandle) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let mr = service_of(unsafe { handle(service, "service") }?)?;
        mr.reset_peaks();
        Ok(())
    })
}

/// Writes what `service` holds to `*out` and, per tag in tag order, to `tags[0..min(num_tags,
/// tags_capacity)]` (`tags` may be NULL when `tags_capacity` is 0; `out->num_tags` says how many there are).
///
/// # Safety
/// 1. `service` is null or a live handle; `out` is null or valid for a write; `tags` is null or valid for
///    writes of `tags_capacity` values.
#[no_mangle]
#[allow(unsafe_code)]
pub unsafe extern "C" fn mempool_service_stats(
    service: *const ResourceHandle,
    out: *mut ServiceStatistics,
    tags: *mut ServiceTagStatistics,
    tags_capacity: usize,
) -> c_int {
    guard(|| {
        // SAFETY: point 1: a live handle; the reference does not outlive this call.
        let mr = service_of(unsafe { handle(service, "service") }?)?;
        // SAFETY: point 1 (checked for null).
        let out = unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument("out is null".into()))?;
        if tags.is_null() && tags_capacity > 0 {
            return Err(Error::InvalidArgument(format!(
                "tags is null and tags_capacity is {tags_capacity}"
            )));
        }
        let s = mr.stats();
        *out = ServiceStatistics {
            mapped_bytes: s.mapped_bytes,
            peak_mapped_bytes: s.peak_mapped_bytes,
            used_bytes: s.used_bytes,
            peak_used_bytes: s.peak_used_bytes,
            reservation_bytes: s.reservation_bytes,
            chunk_size: s.chunk_size,
            reclaims: s.reclaims,
            reclaimed_bytes: s.reclaimed_bytes,
            num_tags: s.tags.len(),
        };
        for (i, t) in s.tags.iter().take(tags_capacity).enumerate() {
            let mut name: [c_char; 65] = [0; 65];
            for (dst, b) in name.iter_mut().zip(t.name.bytes().take(64)) {
                *dst = b as c_char;
            }
            let row = ServiceTagStatistics {
                name,
                tag: t.tag.index() as u32,
                asleep: t.asleep.map_or(-1, service::mode_code),
                used_bytes: t.used_bytes,
                peak_used_bytes: t.peak_used_bytes,
                live_allocations: t.live_allocations,
                allocations: t.allocations,
                frees: t.frees,
                mapped_bytes: t.mapped_bytes,
                offloaded_bytes: t.offloaded_bytes,
                largest_free_mapped: t.largest_free_mapped,
                exports: t.exports,
            };
            // SAFETY: point 1: `tags` is not null (checked above, `tags_capacity > i`) and valid for writes
            // of `tags_capacity` values; `i < tags_capacity`.
            unsafe { tags.add(i).write(row) };
        }
        Ok(())
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
