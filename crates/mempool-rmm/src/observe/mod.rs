//! Seeing the memory: a bounded [`History`] of allocation events (on by default for the registry's
//! default resource, through [`HistoryResource`]), [`snapshot`]s of a resource stack (its resources,
//! a suballocator's chunks with their used and free ranges, the live allocations, the history) in a
//! versioned JSON schema ([`Snapshot`]), the self-contained viewer page they embed into
//! ([`write_html`]), cluster documents that hold the snapshots of several workers ([`cluster`],
//! [`ClusterSnapshot`]) and the page that shows them ([`cluster_page`]), and out-of-memory errors that
//! explain themselves ([`explain`]). docs/observe.md is the guide.

pub(crate) mod adaptor;
mod cluster;
pub(crate) mod history;
pub(crate) mod inspect;
mod model;
pub(crate) mod oom;
#[cfg(test)]
mod oom_tests;
mod page;
mod snapshot;

pub use adaptor::HistoryResource;
pub use cluster::{
    check_cluster, cluster, cluster_page, cluster_to_json, read_cluster_json, write_cluster_html, write_cluster_json,
    ClusterSnapshot, WorkerIdentity, WorkerSnapshot, CLUSTER_SCHEMA, CLUSTER_VERSION,
};
pub use history::{label_names, thread_number, Event, Events, History, Label, Op, CLAIM, DEFAULT_CAPACITY};
pub use inspect::Inspection;
pub use model::{
    Chunk, DeviceInfo, HistoryColumns, LiveAllocation, Range, ResourceInfo, ResourceStats, Snapshot, StreamInfo,
    StreamStats, SCHEMA, VERSION,
};
pub use oom::{explain, stack_of};
pub use page::{
    check, escape_for_script, page, page_from_json, read_json, to_json, write_html, write_json, MARKER, VIEWER_HTML,
};
pub use snapshot::{from_log, snapshot, snapshot_current, snapshot_on};
