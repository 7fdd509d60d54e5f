//! Share CUDA stream-ordered memory pools and their buffers between processes.
//!
//! An *exporter* process owns a pool (created with the POSIX file-descriptor handle type) and
//! listens on a Unix socket; *importers* connect, receive the pool's file descriptor once, then
//! receive buffers as 64-byte pointer descriptors, each with an IPC event handle that orders
//! their first use after the exporter's work. Importers release buffers when done; the
//! exporter frees a buffer only after every importer has released it (or died).
//! `docs/ipc.md` is the guide; `docs/ipc-protocol.md` specifies the protocol.
//!
//! - [`Exporter`] serves a pool on a socket path ([`ExporterOptions`], with the socket's
//!   [`ListenerOptions`], who may connect ([`AccessPolicy`]) and the [`ConnectionOptions`] time
//!   limits), lists the connected importers ([`ImporterInfo`]: an [`ImporterId`] and the
//!   process's [`PeerCredentials`]), shares [`ExportedBuffer`]s (whole allocations, or buffers
//!   suballocated from a larger allocation, sent as block plus offset) and frees each one only
//!   when every holder has let go, dead importers included ([`ExporterStats`] counts them).
//! - [`Importer`] connects ([`ImporterOptions`]), imports the pool once, and receives
//!   [`SharedBuffer`]s that release themselves when dropped: on the fast release path (protocol
//!   version 2, the default) by recording an interprocess event and queueing the release for a
//!   batch, with the imports of suballocated blocks kept for the connection's life; on the
//!   version-1 path by waiting for their last use, freeing their import and sending the release.
//! - [`Error`] says what went wrong; it wraps a [`ProtocolError`] for frames that break the
//!   wire format and a [`LeaseError`] for what the lease bookkeeping refuses. Errors met where
//!   nobody can be told (in a `Drop`, on the exporter's serving thread) are kept for
//!   [`take_drop_errors`].
//!
//! Below the exporter and the importer, host layers that need no GPU and are tested without
//! one (private modules; `src/` holds them), over mempool-socket's descriptor passing
//! (`fdpass`), peer credentials (`cred`), listener and framing (`frame`):
//!
//! - `protocol`: the versioned, length-prefixed messages, as pure functions over bytes;
//! - `connection`: whole messages with their descriptors over a socket, under timeouts;
//! - `session`: the handshake and what each side may receive after it;
//! - `reactor`: the exporter's connections without the GPU: admission within its limits, one
//!   bounded send queue per importer, the wait for a dead importer's process, all served by one
//!   `epoll` thread;
//! - `lease`: which importer holds which buffer, and when a buffer may be freed; which blocks
//!   importers keep imported (protocol version 2);
//! - `batch`: the importer's releases waiting to go out together (protocol version 2);
//! - `error`: the error types above, and the sink of [`take_drop_errors`];
//! - [`trace`] (public): opt-in timestamps along a buffer's hand-off and release, for diagnosis;
//! - [`ring`] (public): single-producer single-consumer rings in a sealed memfd shared by two
//!   processes, with a futex doorbell, every shared word checked as written by a hostile peer.
//!
//! Each module imports only modules below it: `protocol` imports none of the crate, `lease` and `batch` import `protocol`,
//! `error` imports both, `trace` and `ring` import none (every layer records into it), and nothing imports the
//! crate root.
//!
//! Linux only (`SCM_RIGHTS` with `MSG_CMSG_CLOEXEC`, `SO_PEERCRED`), like CUDA's pool IPC.

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod batch;
mod connection;
mod error;
mod exporter;
mod importer;
mod lease;
mod protocol;
mod reactor;
pub mod ring;
mod session;
#[cfg(test)]
mod test_util;
pub mod trace;

pub use error::{take_drop_errors, Error, Result};
pub use exporter::{ExportedBuffer, ExportedVmm, Exporter, ExporterOptions, ExporterStats, ImporterInfo};
pub use importer::{Importer, ImporterOptions, Received, SharedBuffer, SharedVmm, SharedVmmRange};
pub use lease::{ImporterId, LeaseError};
pub use mempool_socket::{peer_credentials, AccessPolicy, ConnectionOptions, ListenerOptions, PeerCredentials};
pub use protocol::{BlockId, BufferId, DeviceUuid, ErrorCode, MessageType, PoolId, ProtocolError, MAX_VMM_CHUNKS};
