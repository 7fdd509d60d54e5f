//! A memory store: GPU memory held by a server process on behalf of its clients, in named
//! buffers that outlive the processes that made them. `docs/memory-store.md` is the guide.
//!
//! - [`Server`] ([`ServerConfig`], [`Quotas`], [`Limits`], [`Access`]) owns VMM physical
//!   allocations (POSIX file-descriptor handles) on its GPUs and serves a Unix socket; the
//!   `mempool-store-server` binary runs one.
//! - [`Client`] creates a buffer ([`Created`]: mapped for writing), or a group of buffers in
//!   one allocation ([`Client::create_many`]), publishes it ([`Attached`]),
//!   attaches published buffers by name (no copy, stream-ordered after the creator's writes
//!   through interprocess events), deletes and lists them ([`BufferInfo`], [`ServerStats`]).
//! - [`Error`] names every refusal and failure; errors met in a `Drop` are kept for
//!   [`take_drop_errors`].
//!
//! Layers, each importing only those before it: `types`, `error` < `names`, `policy` <
//! `protocol` (`messages` < `codec`, over mempool-socket's `frame`) < `backend` (the GPU as a
//! trait; a host double for the tests) < `state` (the state machine, and the `Store` that holds it
//! under one lock) < `connection` (frames over a socket, with time limits) < `memories` (the
//! client's mapped memories by id, shared by the members of a group) < `gpu` (the GPU backend
//! and the client's import) < `server`, `client`. Below the crate: mempool-socket (descriptor
//! passing, peer credentials, the listener, the framing) and mempool-ipc (`DeviceUuid`, and the
//! `trace` timeline every hand-off records into).
//!
//! Linux only, like CUDA's VMM IPC.

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod backend;
mod client;
mod connection;
mod error;
mod gpu;
mod memories;
mod names;
mod policy;
mod protocol;
mod server;
mod state;
#[cfg(test)]
mod test_util;
mod types;

pub use client::{Attached, Client, ClientOptions, CreateOptions, Created, MAX_LIST_ENTRIES};
pub use error::{take_drop_errors, Error, QuotaKind, QuotaScope, Result};
pub use names::{validate_name, MAX_NAME_LEN, MAX_TAG_LEN};
pub use policy::{Access, Limits, Quotas};
pub use server::{Server, ServerConfig};
pub use types::{BufferInfo, BufferState, ServerStats};
