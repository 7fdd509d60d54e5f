//! A memory service: GPU memory held by a server process on behalf of its clients, in named
//! buffers that outlive the processes that made them. `docs/memory-service.md` is the guide.
//!
//! - [`Server`] ([`ServerConfig`], [`Quotas`], [`Limits`], [`Access`]) owns VMM physical
//!   allocations (POSIX file-descriptor handles) on its GPUs and serves a Unix socket; the
//!   `mempool-serve` binary runs one.
//! - [`Client`] creates a buffer ([`Created`]: mapped for writing), or a group of buffers in
//!   one allocation ([`Client::create_many`]), publishes it ([`Attached`]),
//!   attaches published buffers by name (no copy, stream-ordered after the creator's writes
//!   through interprocess events), deletes and lists them ([`BufferInfo`], [`ServerStats`]).
//! - [`Error`] names every refusal and failure.
//!
//! Layers, each importing only those before it: `types`, `error` < `names`, `policy` < `proto`
//! (`messages` < `codec`) < `backend` (the GPU as a trait; a host double for the tests) < `state`
//! (the state machine) < `conn` (frames over a socket, with time limits) < `memories` (the
//! client's mapped memories by id, shared by the members of a group) < `gpu` (the GPU backend
//! and the client's import) < `server`, `client`.

mod backend;
mod client;
mod conn;
mod error;
mod gpu;
mod memories;
mod names;
mod policy;
mod proto;
mod server;
mod state;
mod types;

pub use client::{Attached, Client, ClientOptions, CreateOptions, Created, MAX_LIST_ENTRIES};
pub use error::{Error, QuotaKind, QuotaScope, Result};
pub use names::{validate_name, MAX_NAME_LEN, MAX_TAG_LEN};
pub use policy::{Access, Limits, Quotas};
pub use server::{Server, ServerConfig};
pub use types::{BufferInfo, BufferState, ServerStats};
