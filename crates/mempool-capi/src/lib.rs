//! # mempool-capi
//!
//! The C ABI of mempool (`include/mempool.h`): resources (create, compose, destroy), allocation and
//! deallocation on a stream, the per-device current resource, statistics, the service resource (tags,
//! sleep and wake, trim, per-tag statistics: `mempool_service_*`), the calling thread's last error, the
//! entry points PyTorch's pluggable allocator calls ([`torch`]) and those CuPy's `CFunctionAllocator` calls
//! ([`cupy`], with the callbacks of [`cupy_param`]). Built as `libmempool_capi.so` for
//! C and C++ programs, and linked into the Python extension (crates/mempool-py), which exports the same
//! symbols, so that PyTorch, C code and Python in one process share one registry.
//!
//! No entry point lets a Rust panic unwind into its caller: each catches it and returns
//! `MEMPOOL_ERROR_PANIC`. The one exception to "returns a status" is `mempool_torch_alloc`, which reports
//! a failure to PyTorch as a C++ exception, because PyTorch ignores a null return (see [`torch`]).
//!
//! The status codes are defined once, in [`error`]'s table: [`Status`], its C names and summaries, and
//! the Python exception of each ([`Status::python_exception`]). `tests/abi.rs` checks `include/mempool.h`
//! (its status enum, every prototype against the entry points of [`ffi`] and [`torch`], and
//! `mempool_statistics_t`) and the Python package's `_errors.py` against the Rust definitions.
//!
//! The Rust side of the Python package uses [`device`], [`registry`], [`service`] and [`error`] directly.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod build;
pub mod cupy;
pub mod cupy_param;
#[cfg(test)]
mod cupy_tests;
pub mod device;
pub mod error;
pub mod ffi;
pub mod live;
pub mod registry;
pub mod service;
pub mod torch;

pub use error::{Error, Result, Status};
