//! The extension module `mempool._lib` of the `mempool` Python package (the package's Python half is
//! `python/mempool/`). It imports without a GPU or driver: the first call that needs the driver raises a
//! `mempool.MempoolError` subclass naming the cause.
//!
//! The module's shared object also exports mempool-capi's C entry points (`include/mempool.h`), which is
//! how PyTorch's pluggable allocator (`mempool.allocators.torch`) finds `mempool_torch_alloc` and
//! `mempool_torch_free`: they share this module's per-device registry.

#![deny(unsafe_code)]

mod buffer;
mod cupy;
mod dlpack;
mod errors;
mod ipc;
mod memory;
mod mr;
mod stream;
mod surface;
mod view;

use pyo3::prelude::*;

use crate::errors::IntoPy;

// The C ABI is linked in for its exported symbols; naming the crate keeps the linker from dropping it.
use mempool_capi as _;

/// The ordinal of the calling thread's current device (its current CUDA context's, else 0).
#[pyfunction]
fn get_current_device() -> PyResult<usize> {
    mempool_capi::device::current().py()
}

/// The number of visible devices.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    mempool_capi::device::count().py()
}

/// The path of this extension module's shared object (PyTorch's allocator loads its entry points from it).
#[pyfunction]
fn _shared_object_path(py: Python<'_>) -> PyResult<String> {
    py.import("mempool._lib")?.getattr("__file__")?.extract()
}

/// Whether `mempool_torch_alloc` reports a failure as a C++ exception (the C++ shim was compiled in).
#[pyfunction]
fn _torch_alloc_raises() -> bool {
    mempool_capi::torch::RAISES
}

/// `(live allocations, refused or failed frees)` of PyTorch's allocator entry points in this process.
#[pyfunction]
fn _torch_allocator_state() -> (usize, u64) {
    (
        mempool_capi::torch::live_allocations(),
        mempool_capi::torch::free_failures(),
    )
}

/// Device `device`'s counters of PyTorch's allocator entry points, `(bytes, peak_bytes, count, peak_count,
/// allocations, frees, failures)`; with `reset_peaks`, the peaks are set to the current values first.
#[pyfunction]
#[pyo3(signature = (device, reset_peaks = false))]
fn _torch_counters(device: usize, reset_peaks: bool) -> (u64, u64, u64, u64, u64, u64, u64) {
    if reset_peaks {
        mempool_capi::torch::reset_peaks(device);
    }
    let c = mempool_capi::torch::counters(device);
    (
        c.bytes,
        c.peak_bytes,
        c.count,
        c.peak_count,
        c.allocations,
        c.frees,
        c.failures,
    )
}

/// `(failures so far, last message)` of the calling thread's allocations through PyTorch's entry points.
#[pyfunction]
fn _torch_last_failure() -> (u64, String) {
    mempool_capi::torch::last_failure()
}

/// The calling thread's last error of the C entry points ("" when the last call succeeded).
#[pyfunction]
fn _last_error() -> String {
    mempool_capi::error::last_error()
}

/// The C entry points the RMM bridge (`mempool_rmm_bridge`, docs/rmm.md) calls, by name, as addresses in this
/// module's shared object: it calls them directly, never entering Python per allocation, and shares this
/// module's registry. A bridge built for a later mempool names the entry point it misses.
///
/// The first pair is `("abi", N)`: N counts changes to these entry points' signatures or meaning (1: as
/// `include/mempool.h` declares them now); a bridge built for another N refuses to load.
#[pyfunction]
fn _capi_functions() -> Vec<(&'static str, usize)> {
    use mempool_capi::ffi;
    vec![
        ("abi", 1),
        ("mempool_allocate", ffi::mempool_allocate as *const () as usize),
        ("mempool_deallocate", ffi::mempool_deallocate as *const () as usize),
        (
            "mempool_resource_destroy",
            ffi::mempool_resource_destroy as *const () as usize,
        ),
        (
            "mempool_resource_retain",
            ffi::mempool_resource_retain as *const () as usize,
        ),
        (
            "mempool_resource_is_equal",
            ffi::mempool_resource_is_equal as *const () as usize,
        ),
        (
            "mempool_resource_device",
            ffi::mempool_resource_device as *const () as usize,
        ),
        (
            "mempool_get_current_device_resource",
            ffi::mempool_get_current_device_resource as *const () as usize,
        ),
        ("mempool_status_name", ffi::mempool_status_name as *const () as usize),
        ("mempool_last_error", ffi::mempool_last_error as *const () as usize),
    ]
}

#[pymodule]
#[pyo3(name = "_lib")]
fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<buffer::DeviceBuffer>()?;
    m.add_class::<mr::PyResource>()?;
    m.add_class::<mr::CudaMemoryResource>()?;
    m.add_class::<mr::ManagedMemoryResource>()?;
    m.add_class::<mr::CudaAsyncMemoryResource>()?;
    m.add_class::<mr::PoolMemoryResource>()?;
    m.add_class::<mr::FixedSizeMemoryResource>()?;
    m.add_class::<mr::BinningMemoryResource>()?;
    m.add_class::<mr::ArenaMemoryResource>()?;
    m.add_class::<mr::VmmMemoryResource>()?;
    m.add_class::<mr::ServiceMemoryResource>()?;
    m.add_class::<mr::TaggedMemoryResource>()?;
    m.add_class::<mr::Statistics>()?;
    m.add_class::<mr::StatisticsResourceAdaptor>()?;
    m.add_class::<mr::TrackingResourceAdaptor>()?;
    m.add_class::<mr::LoggingResourceAdaptor>()?;
    m.add_class::<mr::LimitingResourceAdaptor>()?;
    m.add_class::<mr::FailureCallbackResourceAdaptor>()?;
    m.add_class::<ipc::PyExporter>()?;
    m.add_class::<ipc::PyExportedBuffer>()?;
    m.add_class::<ipc::PyImporter>()?;
    m.add_class::<ipc::PyImportedBuffer>()?;
    m.add_class::<ipc::PyImportedRange>()?;
    m.add_class::<ipc::PyClient>()?;
    m.add_class::<ipc::PyCreatedBuffer>()?;
    m.add_class::<ipc::PyAttachedBuffer>()?;
    m.add_class::<ipc::PyBufferInfo>()?;
    m.add_class::<ipc::PyStoreServer>()?;
    m.add_function(wrap_pyfunction!(ipc::serve, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::validate_name, m)?)?;
    m.add_function(wrap_pyfunction!(mr::set_per_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(mr::get_per_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(get_current_device, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_shared_object_path, m)?)?;
    m.add_function(wrap_pyfunction!(_capi_functions, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_alloc_raises, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_allocator_state, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_counters, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_last_failure, m)?)?;
    m.add_function(wrap_pyfunction!(_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(mr::_flush_logs, m)?)?;
    cupy::register(m)?;
    m.add_function(wrap_pyfunction!(memory::_memory_snapshot_json, m)?)?;
    m.add_function(wrap_pyfunction!(memory::_memory_page, m)?)?;
    m.add_function(wrap_pyfunction!(memory::_memory_cluster_check, m)?)?;
    m.add_function(wrap_pyfunction!(memory::_memory_record, m)?)?;
    m.add_function(wrap_pyfunction!(memory::_memory_oom_retry, m)?)?;
    errors::register(m)?;
    Ok(())
}
