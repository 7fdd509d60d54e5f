//! The snapshot's JSON model, version 1 (docs/observe.md, "Schema"): plain serde types, nothing else.

use serde::{Deserialize, Serialize};

/// The value of [`Snapshot::schema`].
pub const SCHEMA: &str = "mempool.snapshot";
/// The schema version this crate writes.
pub const VERSION: u32 = 1;

/// A snapshot of a resource stack: its resources with their statistics and chunks, the live
/// allocations, and the recent history (columnar). See docs/observe.md for every field. A reader takes
/// a missing `devices`, `tags`, `streams`, `live` or `history` as empty, as the viewer does.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// [`VERSION`].
    pub version: u32,
    /// When it was taken, nanoseconds since the Unix epoch.
    pub created_unix_ns: u64,
    /// `rust`, `python`, or `replay:<file name>`.
    pub source: String,
    /// The devices of the stack (may be empty).
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    /// Tag (label) names by index.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Streams by index.
    #[serde(default)]
    pub streams: Vec<StreamInfo>,
    /// The resources of the stack, top first.
    pub resources: Vec<ResourceInfo>,
    /// Live allocations.
    #[serde(default)]
    pub live: Vec<LiveAllocation>,
    /// Whether `live` may miss allocations (made before the history's window, in a stack with no
    /// suballocator that lists them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub live_truncated: bool,
    /// The recent history.
    #[serde(default)]
    pub history: HistoryColumns,
}

/// A device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Its ordinal.
    pub ordinal: u32,
    /// Its name.
    pub name: String,
    /// Its memory.
    pub total_bytes: u64,
    /// Its free memory when the snapshot was taken.
    pub free_bytes: u64,
}

/// A stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInfo {
    /// Its index (the position in [`Snapshot::streams`]).
    pub id: u32,
    /// The raw handle, in hexadecimal.
    pub handle: String,
    /// `default` for the legacy stream (handle 0), else the handle.
    pub label: String,
}

/// One resource of the stack.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ResourceInfo {
    /// Its index (the position in [`Snapshot::resources`]).
    pub id: u32,
    /// The resource above it (that allocates from it); `None` for the top.
    pub parent: Option<u32>,
    /// Its name.
    pub name: String,
    /// Its type.
    pub kind: String,
    /// Its device, where known.
    pub device: Option<u32>,
    /// Its statistics; each `None` where the resource does not know.
    pub stats: ResourceStats,
    /// Per stream: live bytes and free bytes in its free lists.
    pub per_stream: Vec<StreamStats>,
    /// A suballocator's chunks; empty for pass-through resources.
    pub chunks: Vec<Chunk>,
}

/// A resource's statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStats {
    /// Bytes of live allocations.
    pub live_bytes: Option<u64>,
    /// The peak of `live_bytes`.
    pub peak_live_bytes: Option<u64>,
    /// Bytes held from the upstream or the driver.
    pub held_bytes: Option<u64>,
    /// The peak of `held_bytes`.
    pub peak_held_bytes: Option<u64>,
    /// Allocations made in all.
    pub allocations: Option<u64>,
    /// Frees in all.
    pub frees: Option<u64>,
    /// Live allocations.
    pub live_count: Option<u64>,
}

/// One stream's share of a resource.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamStats {
    /// The stream's index.
    pub stream: u32,
    /// Bytes of the resource's live allocations made on the stream (as far as the snapshot knows).
    pub live_bytes: u64,
    /// Bytes in the stream's free lists.
    pub free_bytes: u64,
}

/// An upstream chunk of a suballocator.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Its start.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// Its ranges in address order, covering it.
    pub ranges: Vec<Range>,
}

/// A used or free range of a chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Range {
    /// Offset from the chunk's start.
    pub offset: u64,
    /// Length.
    pub size: u64,
    /// A live allocation, or free.
    pub used: bool,
    /// The stream whose free list holds a free range; `None` where unknown (live ranges).
    pub stream: Option<u32>,
}

/// A live allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveAllocation {
    /// The resource that knows it.
    pub resource: u32,
    /// Its address.
    pub address: u64,
    /// Its size (as asked for where the history saw it, else as the suballocator rounded it).
    pub size: u64,
    /// Its stream, where known.
    pub stream: Option<u32>,
    /// Its tag.
    pub tag: u32,
    /// When it was made (nanoseconds since the history's start), where known.
    pub t_ns: Option<u64>,
}

/// The history, one array per field, all of the same length, oldest event first. A reader takes a
/// missing field as empty (or 0): an empty history may leave its columns out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HistoryColumns {
    /// Events the ring holds at most.
    pub capacity: u64,
    /// Events ever recorded.
    pub recorded: u64,
    /// Events overwritten.
    pub dropped: u64,
    /// Nanoseconds since the history's start, non-decreasing.
    pub t_ns: Vec<u64>,
    /// 0 allocate, 1 free, 2 allocation failed.
    pub op: Vec<u8>,
    /// The resource's index.
    pub resource: Vec<u32>,
    /// The address (0 for a failure).
    pub address: Vec<u64>,
    /// The bytes asked for.
    pub size: Vec<u64>,
    /// The stream's index.
    pub stream: Vec<u32>,
    /// The tag's index.
    pub tag: Vec<u32>,
    /// The thread's small number.
    pub thread: Vec<u32>,
}

impl HistoryColumns {
    /// Events held.
    pub fn len(&self) -> usize {
        self.t_ns.len()
    }

    /// Whether no event is held.
    pub fn is_empty(&self) -> bool {
        self.t_ns.is_empty()
    }
}
