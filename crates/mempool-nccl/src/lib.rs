//! # mempool-nccl
//!
//! NCCL collectives over mempool memory, with NCCL opened at run time: building needs neither CUDA nor
//! NCCL, and a machine without NCCL gets [`Error::LibraryNotFound`] naming what was tried.
//!
//! - Loading: `$MEMPOOL_NCCL_LIBRARY` (a path) when set, else `libnccl.so.2`, then `libnccl.so`, once
//!   per process ([`library_version`] reports `ncclGetVersion`). Every entry point is resolved once;
//!   one the loaded NCCL lacks is [`Error::MissingSymbol`] naming the NCCL version that added it.
//!   Opening a library runs its initializers, as linking it would: name only a library you trust.
//! - [`Comm`]: a communicator (`init_all` for several GPUs of this process, `init_rank` with a
//!   [`UniqueId`] for one rank per thread or process), destroyed on drop.
//! - Collectives on mempool buffers ([`mempool_core::BufferView`], what `DeviceBuffer`, `PoolBuffer`
//!   and the rest deref to), typed by [`NcclType`], with lengths, devices and streams checked before
//!   NCCL is called.
//! - [`group()`]: `ncclGroupStart`, a closure that enqueues collectives through a [`Group`], then
//!   `ncclGroupEnd`, always (also when the closure fails or panics), before the borrows handed to the
//!   group end: how one thread drives several communicators.
//! - [`Registration`]: `ncclCommRegister` for as long as the buffer and the communicator live; one
//!   dropped inside a group is deregistered when the group ends, before [`group()`] returns.
//! - [`attach`]: registration that follows a `mempool_rmm::ServiceResource`: every physical allocation
//!   it maps is registered with the communicator, one registration each, and deregistered before it is
//!   unmapped (growth, trim, reclaim, sleep, wake), with no call from the user; the [`Attachment`]
//!   owns the communicator and lends it ([`Attachment::comm`]) for collectives.
//! - Raw handles and constants re-exported from the private FFI module: [`RawComm`] (what
//!   [`Comm::as_raw`] returns), [`UNIQUE_ID_BYTES`], [`LIBRARY_ENV`]; [`probe_library`] opens a
//!   candidate library and reports its version, without making it the process's NCCL.
//!
//! What safe code cannot do, shown by compile-fail examples on [`group()`] and [`Registration`]: drop,
//! move or mutate a buffer the group uses before `ncclGroupEnd`, or keep a registration past its
//! buffer.
//!
//! NVLink multicast (NVLS) is NCCL's to enable: on shared machines set `NCCL_NVLS_ENABLE=0` before the
//! first communicator (the crate's tests and `mempool-bench allreduce` do). Nothing here calls
//! `cuMulticastCreate`. See docs/nccl.md.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod comm;
mod error;
mod follow;
mod group;
mod ranges;
mod registration;
mod scope;
mod sys;
mod types;

pub use comm::{Comm, UniqueId};
pub use error::{Error, Result};
pub use follow::{attach, Attachment, CommGuard, RegisteredRange};
pub use group::{group, Group};
pub use registration::Registration;
pub use sys::{OpaqueComm, RawComm, LIBRARY_ENV, UNIQUE_ID_BYTES};
pub use types::{DataType, NcclType, ReduceOp};

/// The loaded NCCL's version (`ncclGetVersion`) as `major.minor.patch`, loading it if needed.
pub fn library_version() -> Result<String> {
    Ok(sys::library()?.version_string())
}

/// Where the loaded NCCL came from (the path or name that opened), loading it if needed.
pub fn library_path() -> Result<String> {
    Ok(sys::library()?.path().to_owned())
}

/// Opens `name` (a path, or a name the dynamic loader searches) the way the process's NCCL is opened,
/// returns its version as `major.minor.patch`, and closes it again: it does not become the library
/// this crate uses (that is chosen once, by [`LIBRARY_ENV`] or the search [`library_version`]
/// describes). For checking a candidate before setting [`LIBRARY_ENV`]. Fails as the search does:
/// [`Error::LibraryNotFound`] with the loader's reason, [`Error::NotNccl`] for a library without
/// `ncclGetVersion`. Opening a library runs its initializers: name only a library you trust.
pub fn probe_library(name: &str) -> Result<String> {
    Ok(sys::open_first(&[name.to_owned()])?.version_string())
}

/// Checks that NVLink multicast is off for the communicators this process makes: `Ok` when
/// `NCCL_NVLS_ENABLE` is `0`, an error naming the variable and the fix otherwise (unset included: NCCL
/// then turns NVLS on where the system supports it). Reads the environment only.
pub fn nvls_disabled() -> Result<()> {
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v.trim() == "0" => Ok(()),
        other => Err(Error::InvalidArgument {
            call: "nvls_disabled",
            reason: format!(
                "NCCL_NVLS_ENABLE is {}: NVLink multicast must stay off on these machines; set it to 0 before the \
                 program starts (or call the unsafe disable_nvls before any other thread runs)",
                match other {
                    Ok(v) => format!("{v:?}"),
                    Err(_) => "unset".into(),
                }
            ),
        }),
    }
}

/// Sets `NCCL_NVLS_ENABLE=0` unless the variable is already set, and refuses a setting other than `0`:
/// what the tests and the benchmark call before the first communicator, on machines where NVLink
/// multicast must stay off. (Setting the variable in the environment the program starts with does the
/// same without this call.)
///
/// # Safety
///
/// It writes the process environment (`std::env::set_var`), which is undefined behaviour on Linux
/// while another thread reads or writes the environment (NCCL, the CUDA driver and libc read it with
/// `getenv`). Call it while no other thread of the process can do so: at the start of `main`, before
/// any thread is started, or under a `std::sync::Once` that every thread passes before its first
/// NCCL or CUDA call.
#[allow(unsafe_code)]
pub unsafe fn disable_nvls() -> Result<()> {
    if std::env::var("NCCL_NVLS_ENABLE").is_err() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    nvls_disabled()
}
