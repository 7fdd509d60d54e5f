//! Share CUDA stream-ordered memory pools and their buffers between processes.
//!
//! An *exporter* process owns a pool (created with the POSIX file-descriptor handle type) and
//! listens on a Unix socket; *importers* connect, receive the pool's file descriptor once, then
//! receive buffers as 64-byte pointer descriptors, each with an IPC event handle that orders
//! their first use after the exporter's work. Importers release buffers when done; the
//! exporter frees a buffer only after every importer has released it (or died).
//! `docs/ipc-protocol.md` specifies the protocol.
//!
//! The GPU layer:
//!
//! - [`exporter`]: [`Exporter`] serves a pool on a socket path, shares [`ExportedBuffer`]s
//!   (whole allocations, or buffers suballocated from a larger allocation, sent as block plus
//!   offset) and frees each one only when every holder has let go, dead importers included;
//! - [`importer`]: [`Importer`] connects, imports the pool once, and receives [`SharedBuffer`]s
//!   that wait for their last use, free their import and send the release when dropped.
//!
//! `docs/ipc.md` is the guide. The host layers below need no GPU and are tested without one:
//!
//! - [`fdpass`]: file descriptors over Unix stream sockets (`SCM_RIGHTS`);
//! - [`wire`]: the versioned, length-prefixed messages, as pure functions over bytes;
//! - [`conn`]: whole messages with their descriptors over a socket, under timeouts;
//! - [`cred`]: who is at the other end (`SO_PEERCRED`) and whether they may be;
//! - [`listener`]: the exporter's socket file, created 0600 without a race;
//! - [`session`]: the handshake and what each side may receive after it;
//! - [`lease`]: which importer holds which buffer, and when a buffer may be freed.
//!
//! Linux only (`SCM_RIGHTS` with `MSG_CMSG_CLOEXEC`, `SO_PEERCRED`), like CUDA's pool IPC.
//!
//! ```
//! use std::os::fd::AsFd;
//! use mempool_ipc::session::{ExporterSession, ImporterSession, PoolAnnouncement};
//! use mempool_ipc::wire::{DeviceUuid, PoolId};
//! use mempool_ipc::{Connection, ConnectionConfig};
//!
//! // A memfd stands in for the pool's file descriptor (`MemPool::export_fd`).
//! let pool_fd = rustix::fs::memfd_create("pool", rustix::fs::MemfdFlags::CLOEXEC)?;
//! let gpu = DeviceUuid([7; 16]);
//! let (exporter_end, importer_end) = Connection::pair(ConnectionConfig::default())?;
//!
//! let importer = std::thread::spawn(move || {
//!     ImporterSession::handshake(importer_end, |uuid| Ok(*uuid))
//! });
//! let announcement = PoolAnnouncement { device_uuid: gpu, pool_id: PoolId::generate() };
//! let _exporter = ExporterSession::handshake(exporter_end, announcement, pool_fd.as_fd())?;
//! let (_importer, imported) = importer.join().unwrap()?;
//! assert_eq!(imported.device, gpu);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod conn;
pub mod cred;
mod error;
pub mod exporter;
pub mod fdpass;
pub mod importer;
pub mod lease;
pub mod listener;
pub mod session;
pub mod wire;

pub use conn::{Connection, ConnectionConfig, Received};
pub use cred::{AccessPolicy, PeerCredentials};
pub use error::{take_drop_errors, Error, Result};
pub use exporter::{ExportedBuffer, Exporter, ExporterOptions, ExporterStats, ImporterInfo};
pub use importer::{Importer, ImporterOptions, SharedBuffer};
pub use lease::LeaseError;
pub use listener::{Listener, ListenerOptions};
pub use wire::ProtocolError;
