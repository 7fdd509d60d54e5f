//! Adaptors: resources that wrap an upstream resource and add one concern each, composed the way RMM's
//! are. Every adaptor owns its upstream (any `U: MemoryResource`, including `Arc<dyn MemoryResource>`)
//! and exposes it through `upstream()`.

mod added_bins;
mod aligned;
mod failure_callback;
mod limiting;
mod logging;
mod oom_retry;
mod prefetch;
mod statistics;
mod tracking;

pub use added_bins::AddedBinsAdaptor;
pub use aligned::AlignedAdaptor;
pub use failure_callback::FailureCallbackAdaptor;
pub use limiting::LimitingAdaptor;
pub use logging::{parse_log, Action, LogEvent, LogParseError, LoggingAdaptor, LOG_HEADER};
pub use oom_retry::OomRetryAdaptor;
pub use prefetch::PrefetchAdaptor;
pub use statistics::{Counter, Counters, StatisticsAdaptor};
pub use tracking::{AllocationRecord, TrackingAdaptor};
