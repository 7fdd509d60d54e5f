//! # mempool
//!
//! Safe, fast and shareable CUDA stream-ordered memory pools, with RMM-style memory resources on top.
//! This facade re-exports the workspace's crates:
//!
//! - [`core`] (`mempool-core`): devices, streams, events and [`core::MemPool`].
//! - [`rmm`] (`mempool-rmm`): RMM-style memory resources, adaptors, containers, the per-device registry.
//! - [`ipc`] (`mempool-ipc`): descriptor passing, the wire protocol, sessions and leases for sharing pools
//!   between processes.
//!
//! See the README and `docs/` for the guide.

pub use mempool_core as core;
pub use mempool_core::{Device, DeviceAddr, Error, MemPool, PoolProps, Result, Stream, StreamRef};
pub use mempool_ipc as ipc;
pub use mempool_rmm as rmm;
