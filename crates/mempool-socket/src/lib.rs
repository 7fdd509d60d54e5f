//! The Unix-socket parts under mempool's two socket protocols, mempool-ipc's exporter and importer
//! and mempool-store's memory store: they know nothing of either protocol's messages.
//!
//! - [`fdpass`]: file descriptors over Unix stream sockets (`SCM_RIGHTS`, close-on-exec on arrival);
//! - [`cred`]: who is at the other end (`SO_PEERCRED`, `SO_PEERPIDFD`) and whether they may be
//!   ([`AccessPolicy`]);
//! - [`listener`]: a socket file created with its mode without a race, a stale one replaced, peers
//!   checked before a byte is read ([`ListenerOptions`], [`ConnectionOptions`]);
//! - [`frame`]: the 12-byte frame header both protocols share, and the bounds-checked
//!   [`frame::Reader`] and [`frame::Writer`] their codecs are written with;
//! - [`frame_io`]: one whole frame with its descriptors written or read under deadlines, the socket
//!   I/O of both protocols' connections (each maps what it reports into its own errors);
//! - `error`: the crate's [`Error`]; the protocols' errors convert from it;
//! - `testing` (feature `testing`): helpers for the host tests of this crate and those above.
//!
//! Layers: `error` < `fdpass`, `cred`, `frame` < `listener`, `frame_io` (over `fdpass` and `frame`). Linux only (`SCM_RIGHTS` with
//! `MSG_CMSG_CLOEXEC`, `SO_PEERCRED`).

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod cred;
mod error;
pub mod fdpass;
pub mod frame;
pub mod frame_io;
pub mod listener;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use cred::{peer_credentials, AccessPolicy, PeerCredentials};
pub use error::{Error, Result};
pub use listener::{ConnectionOptions, Listener, ListenerOptions};
