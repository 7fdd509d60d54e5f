//! GPU tests of mempool-ipc: an exporter and importers in separate processes. They need a GPU and
//! fail without one (never skip). Run: `cargo test -p mempool-ipc --features gpu --test gpu`.
//!
//! One test binary (`gpu`), one module per scenario over one re-exec harness (`harness`): each
//! test that needs a second process re-executes this binary, filtered to the same test, with
//! `MEMPOOL_IPC_TEST_ROLE` naming the child's part (CUDA does not survive `fork`). No test asserts
//! how long something took: they check data, counts and the order of events, with deadlines only
//! as a safety net against hangs.
#![cfg(feature = "gpu")]

#[macro_use]
mod harness;

mod deaths;
mod fast_release;
mod floods;
mod hostile;
mod many_importers;
mod pools;
mod rings;
mod service;
mod suballocated;
mod vmm;
