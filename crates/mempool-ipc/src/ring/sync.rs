//! The rings' atomics: loom's under `cfg(loom)`, for the model checks of `ring/loom_tests.rs`
//! (docs/testing.md, "Concurrency models and fuzzing"), std's otherwise. Everything the producer and the consumer
//! share goes through these; under loom the region keeps its words in the model (`region.rs`) and the
//! futex calls return at once (`futex.rs`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
