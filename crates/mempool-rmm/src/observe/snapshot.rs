//! Taking snapshots: of a resource stack ([`snapshot`]) and of an RMM-format log ([`from_log`]).

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use mempool_core::Device;

use crate::adaptors::{Action, LogEvent};
use crate::error::Result;
use crate::observe::history::{label_names, Events, Op};
use crate::observe::inspect::Inspection;
use crate::observe::model::{
    Chunk, DeviceInfo, HistoryColumns, LiveAllocation, Range, ResourceInfo, ResourceStats, Snapshot, StreamInfo,
    StreamStats, SCHEMA, VERSION,
};
use crate::observe::oom::stack_of;
use crate::registry::current_device_resource;
use crate::resource::MemoryResource;

fn now_unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Stream handles by index, in the order first seen.
#[derive(Default)]
struct Streams {
    index: HashMap<u64, u32>,
    list: Vec<StreamInfo>,
}

impl Streams {
    fn of(&mut self, handle: u64) -> u32 {
        let next = self.list.len() as u32;
        *self.index.entry(handle).or_insert_with(|| {
            self.list.push(StreamInfo {
                id: next,
                handle: format!("{handle:#x}"),
                label: if handle == 0 {
                    "default".into()
                } else {
                    format!("{handle:#x}")
                },
            });
            next
        })
    }
}

fn empty(source: &str) -> Snapshot {
    Snapshot {
        schema: SCHEMA.into(),
        version: VERSION,
        created_unix_ns: now_unix_ns(),
        source: source.into(),
        ..Snapshot::default()
    }
}

/// The history's events as columns, each event's resource offset by `resource`.
fn columns(events: &Events, resource: u32, streams: &mut Streams) -> HistoryColumns {
    let mut h = HistoryColumns {
        capacity: events.capacity,
        recorded: events.recorded,
        dropped: events.dropped,
        ..HistoryColumns::default()
    };
    for e in &events.events {
        h.t_ns.push(e.t_ns);
        h.op.push(e.op as u8);
        h.resource.push(resource + u32::from(e.resource));
        h.address.push(e.address);
        h.size.push(e.size);
        h.stream.push(streams.of(e.stream));
        h.tag.push(u32::from(e.tag));
        h.thread.push(e.thread);
    }
    h
}

/// The allocations the history's window made and did not free, in the order made.
fn live_from_history(h: &HistoryColumns) -> Vec<LiveAllocation> {
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut out: Vec<Option<LiveAllocation>> = Vec::new();
    for i in 0..h.len() {
        match h.op[i] {
            0 => {
                live.insert(h.address[i], out.len());
                out.push(Some(LiveAllocation {
                    resource: h.resource[i],
                    address: h.address[i],
                    size: h.size[i],
                    stream: Some(h.stream[i]),
                    tag: h.tag[i],
                    t_ns: Some(h.t_ns[i]),
                }));
            }
            1 => {
                if let Some(j) = live.remove(&h.address[i]) {
                    out[j] = None;
                }
            }
            _ => {}
        }
    }
    out.into_iter().flatten().collect()
}

/// A snapshot of the stack under `top`: each resource from the top down with what it knows
/// ([`MemoryResource::inspect`]: statistics, a suballocator's chunks with their used and free ranges),
/// the history of the first [`HistoryResource`](crate::observe::HistoryResource) in the stack (empty
/// when there is none), and the live allocations: those the history saw made and not freed, and every
/// used range of a suballocator's chunks that the history did not see. `source` goes into the
/// snapshot's `source` field (`rust`, `python`).
///
/// Off the allocation path: it walks every block of every suballocator under their locks (one engine
/// at a time), so allocations wait meanwhile.
pub fn snapshot(top: &dyn MemoryResource, source: &str) -> Snapshot {
    let layers = stack_of(top);
    let inspections: Vec<Inspection> = layers.iter().map(|r| r.inspect()).collect();
    let mut snap = empty(source);
    snap.tags = label_names();
    let mut streams = Streams::default();
    if let Some((i, h)) = inspections
        .iter()
        .enumerate()
        .find_map(|(i, x)| x.history.as_ref().map(|h| (i, h)))
    {
        snap.history = columns(&h.events(), i as u32, &mut streams);
        snap.live = live_from_history(&snap.history);
        // The window misses what was allocated before it, unless a suballocator below lists it.
        snap.live_truncated = snap.history.dropped > 0;
    } else {
        snap.live_truncated = true;
    }
    let mut seen: std::collections::HashSet<u64> = snap.live.iter().map(|l| l.address).collect();
    let mut any_chunks = false;
    for (id, (layer, insp)) in layers.iter().zip(&inspections).enumerate() {
        let mut per_stream: HashMap<u32, StreamStats> = HashMap::new();
        let mut chunks = Vec::with_capacity(insp.chunks.len());
        for c in &insp.chunks {
            let mut ranges = Vec::with_capacity(c.ranges.len());
            for r in &c.ranges {
                let stream = r.stream.map(|s| streams.of(s as u64));
                if let (Some(s), false) = (stream, r.used) {
                    per_stream
                        .entry(s)
                        .or_insert_with(|| StreamStats {
                            stream: s,
                            ..Default::default()
                        })
                        .free_bytes += r.size;
                }
                if r.used && seen.insert(r.addr) {
                    snap.live.push(LiveAllocation {
                        resource: id as u32,
                        address: r.addr,
                        size: r.size,
                        stream: None,
                        tag: 0,
                        t_ns: None,
                    });
                }
                ranges.push(Range {
                    offset: r.addr - c.addr,
                    size: r.size,
                    used: r.used,
                    stream,
                });
            }
            chunks.push(Chunk {
                address: c.addr,
                size: c.size,
                ranges,
            });
        }
        any_chunks |= insp.has_chunks;
        for l in snap.live.iter().filter(|l| l.resource == id as u32) {
            if let Some(s) = l.stream {
                per_stream
                    .entry(s)
                    .or_insert_with(|| StreamStats {
                        stream: s,
                        ..Default::default()
                    })
                    .live_bytes += l.size;
            }
        }
        let mut per_stream: Vec<StreamStats> = per_stream.into_values().collect();
        per_stream.sort_by_key(|s| s.stream);
        snap.resources.push(ResourceInfo {
            id: id as u32,
            parent: id.checked_sub(1).map(|p| p as u32),
            name: layer.name().into(),
            kind: layer.name().into(),
            device: None,
            stats: ResourceStats {
                live_bytes: insp.live_bytes,
                peak_live_bytes: insp.peak_live_bytes,
                held_bytes: insp.held_bytes,
                peak_held_bytes: insp.peak_held_bytes,
                allocations: insp.allocations,
                frees: insp.frees,
                live_count: insp.live_count,
            },
            per_stream,
            chunks,
        });
    }
    // A suballocator lists every allocation it holds (those older than the history's window too).
    if any_chunks {
        snap.live_truncated = false;
    }
    snap.streams = streams.list;
    snap
}

/// [`snapshot`] of `top`, a stack whose memory lives on `device`: every resource names the device and
/// `devices` lists it with its name, total and free memory (as the driver reports them when asked).
pub fn snapshot_on(top: &dyn MemoryResource, device: &Device, source: &str) -> Snapshot {
    let mut snap = snapshot(top, source);
    let ordinal = device.ordinal() as u32;
    for r in &mut snap.resources {
        r.device = Some(ordinal);
    }
    snap.devices.push(DeviceInfo {
        ordinal,
        name: device.name().unwrap_or_default(),
        total_bytes: device.total_memory().map_or(0, |t| t as u64),
        free_bytes: device
            .context()
            .ok()
            .and_then(|c| c.memory_info().ok())
            .map_or(0, |m| m.free as u64),
    });
    snap
}

/// The snapshot of `device`'s current resource ([`crate::registry::current_device_resource`]: by
/// default a recorded driver pool), with the device ([`snapshot_on`]).
pub fn snapshot_current(device: &Device) -> Result<Snapshot> {
    let top = current_device_resource(device)?;
    Ok(snapshot_on(&*top, device, "rust"))
}

/// A snapshot of what an RMM-format CSV log ([`crate::adaptors::parse_log`]) describes: one resource
/// named `log`, every event in the history (nothing dropped), the allocations left live at its end,
/// and statistics computed from the events. `name` is the log's file name (`source` is
/// `replay:<name>`). Frees of addresses the log never allocated are kept in the history and ignored
/// by the statistics.
pub fn from_log(events: &[LogEvent], name: &str) -> Snapshot {
    let mut snap = empty(&format!("replay:{name}"));
    snap.tags = vec!["default".into()];
    let mut streams = Streams::default();
    let mut threads: HashMap<u64, u32> = HashMap::new();
    let t0 = events.first().map_or(0.0, |e| e.time);
    let mut h = HistoryColumns {
        capacity: events.len() as u64,
        recorded: events.len() as u64,
        ..HistoryColumns::default()
    };
    let (mut live, mut peak, mut allocations, mut frees) = (0u64, 0u64, 0u64, 0u64);
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    let mut last_t = 0u64;
    for e in events {
        let op = match e.action {
            Action::Allocate => Op::Allocate,
            Action::Deallocate => Op::Free,
            Action::AllocateFailure => Op::Failed,
        };
        // Logs from several threads may be a little out of order; the history's times never go back.
        let t = ((e.time - t0).max(0.0) * 1e9).round() as u64;
        last_t = last_t.max(t);
        let next_thread = threads.len() as u32 + 1;
        h.t_ns.push(last_t);
        h.op.push(op as u8);
        h.resource.push(0);
        h.address.push(e.ptr);
        h.size.push(e.size as u64);
        h.stream.push(streams.of(e.stream));
        h.tag.push(0);
        h.thread.push(*threads.entry(e.thread).or_insert(next_thread));
        match op {
            Op::Allocate => {
                allocations += 1;
                if let Some(old) = sizes.insert(e.ptr, e.size as u64) {
                    live -= old;
                }
                live += e.size as u64;
                peak = peak.max(live);
            }
            Op::Free => {
                if let Some(old) = sizes.remove(&e.ptr) {
                    frees += 1;
                    live -= old;
                }
            }
            Op::Failed => {}
        }
    }
    snap.live = live_from_history(&h);
    let mut per_stream: HashMap<u32, u64> = HashMap::new();
    for l in &snap.live {
        *per_stream.entry(l.stream.unwrap_or(0)).or_default() += l.size;
    }
    let mut per_stream: Vec<StreamStats> = per_stream
        .into_iter()
        .map(|(stream, live_bytes)| StreamStats {
            stream,
            live_bytes,
            free_bytes: 0,
        })
        .collect();
    per_stream.sort_by_key(|s| s.stream);
    snap.resources.push(ResourceInfo {
        id: 0,
        parent: None,
        name: "log".into(),
        kind: "RmmLog".into(),
        device: None,
        stats: ResourceStats {
            live_bytes: Some(live),
            peak_live_bytes: Some(peak),
            held_bytes: None,
            peak_held_bytes: None,
            allocations: Some(allocations),
            frees: Some(frees),
            live_count: Some(sizes.len() as u64),
        },
        per_stream,
        chunks: Vec::new(),
    });
    snap.history = h;
    snap.streams = streams.list;
    snap
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use super::*;
    use crate::adaptors::{parse_log, StatisticsAdaptor};
    use crate::observe::adaptor::HistoryResource;
    use crate::observe::page::{page, read_json, to_json, MARKER};
    use crate::testing::SimResource;
    use mempool_core::{RawStream, StreamRef};

    fn stream(n: usize) -> StreamRef<'static> {
        // SAFETY: the handle is never passed to the driver: SimResource only keys on it.
        unsafe { StreamRef::from_raw(n as RawStream) }
    }

    #[test]
    fn a_stack_snapshot_lists_its_resources_live_allocations_and_history() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        let mr = HistoryResource::new(StatisticsAdaptor::new(unsafe { SimResource::new() }));
        let a = mr.allocate(1000, stream(0)).unwrap();
        let b = {
            let _l = crate::observe::history::Label::set("observe-snapshot-test");
            mr.allocate(3000, stream(0x55)).unwrap()
        };
        // SAFETY: `a` came from `mr.allocate` with this size and is freed once.
        unsafe { mr.deallocate(a, 1000, stream(0)) }.unwrap();
        let snap = snapshot(&mr, "rust");
        assert_eq!((snap.schema.as_str(), snap.version), (SCHEMA, 1));
        let names: Vec<&str> = snap.resources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["HistoryResource", "StatisticsAdaptor", "SimResource"]);
        let parents: Vec<Option<u32>> = snap.resources.iter().map(|r| r.parent).collect();
        assert_eq!(parents, [None, Some(0), Some(1)]);
        assert_eq!(snap.resources[1].stats.live_bytes, Some(3000));
        assert_eq!(snap.resources[1].stats.allocations, Some(2));
        assert_eq!(snap.history.len(), 3);
        assert_eq!(snap.history.op, [0, 0, 1]);
        assert_eq!(snap.history.size, [1000, 3000, 1000]);
        assert_eq!((snap.history.recorded, snap.history.dropped), (3, 0));
        assert_eq!(snap.live.len(), 1);
        let l = &snap.live[0];
        assert_eq!((l.address, l.size, l.resource), (b.0, 3000, 0));
        assert_eq!(snap.tags[l.tag as usize], "observe-snapshot-test");
        let s = &snap.streams[l.stream.unwrap() as usize];
        assert_eq!(s.handle, "0x55");
        assert_eq!(snap.streams[snap.history.stream[0] as usize].label, "default");
        assert_eq!(snap.resources[0].per_stream.len(), 1);
        assert_eq!(snap.resources[0].per_stream[0].live_bytes, 3000);
        // Without chunks below it, a full history's live list is complete.
        assert!(!snap.live_truncated);
        // SAFETY: `b` came from `mr.allocate` with this size and is freed once.
        unsafe { mr.deallocate(b, 3000, stream(0x55)) }.unwrap();
    }

    #[test]
    fn the_json_follows_the_schema_and_reads_back() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        let mr = HistoryResource::new(unsafe { SimResource::new() });
        let p = mr.allocate(4096, stream(0)).unwrap();
        assert!(mr.allocate(usize::MAX - 10, stream(0)).is_err());
        let mut snap = snapshot(&mr, "rust");
        snap.resources[0].chunks.push(Chunk {
            address: 1 << 40,
            size: 2 << 20,
            ranges: vec![
                Range {
                    offset: 0,
                    size: 1024,
                    used: true,
                    stream: None,
                },
                Range {
                    offset: 1024,
                    size: (2 << 20) - 1024,
                    used: false,
                    stream: Some(0),
                },
            ],
        });
        let json = to_json(&snap);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        for key in [
            "schema",
            "version",
            "created_unix_ns",
            "source",
            "devices",
            "tags",
            "streams",
            "resources",
            "live",
            "history",
        ] {
            assert!(v.get(key).is_some(), "{key} missing from {json}");
        }
        assert_eq!(v["schema"], "mempool.snapshot");
        assert_eq!(v["version"], 1);
        let h = &v["history"];
        let n = h["t_ns"].as_array().unwrap().len();
        assert_eq!(n, 2);
        for col in ["t_ns", "op", "resource", "address", "size", "stream", "tag", "thread"] {
            assert_eq!(h[col].as_array().map(Vec::len), Some(n), "column {col}");
        }
        assert_eq!(h["op"], serde_json::json!([0, 2]));
        for key in ["capacity", "recorded", "dropped"] {
            assert!(h[key].is_u64(), "{key}");
        }
        let r = &v["resources"][0];
        for key in [
            "id",
            "parent",
            "name",
            "kind",
            "device",
            "stats",
            "per_stream",
            "chunks",
        ] {
            assert!(r.get(key).is_some(), "resource key {key}");
        }
        for key in [
            "live_bytes",
            "peak_live_bytes",
            "held_bytes",
            "peak_held_bytes",
            "allocations",
            "frees",
            "live_count",
        ] {
            assert!(r["stats"].get(key).is_some(), "stats key {key}");
        }
        assert_eq!(r["chunks"][0]["ranges"][1]["offset"], 1024);
        assert_eq!(r["chunks"][0]["ranges"][1]["used"], false);
        assert!(r["chunks"][0]["ranges"][0]["stream"].is_null());
        let live = &v["live"][0];
        for key in ["resource", "address", "size", "stream", "tag", "t_ns"] {
            assert!(live.get(key).is_some(), "live key {key}");
        }
        assert_eq!(live["address"], p.0);
        assert!(v.get("live_truncated").is_none(), "written only when true");
        assert_eq!(read_json(&json).unwrap(), snap);
        let newer = json.replacen("\"version\":1", "\"version\":2", 1);
        let e = read_json(&newer).unwrap_err().to_string();
        assert!(e.contains("version Some(2)"), "{e}");
        // the checks the viewer makes: one length for every history column, every column when there are events
        let ragged = json.replacen("\"thread\":[", "\"thread\":[7,", 1);
        let e = read_json(&ragged).unwrap_err().to_string();
        assert!(
            e.contains("history columns differ in length: `thread` has 3 entries, `t_ns` has 2"),
            "{e}"
        );
        let mut v2 = v.clone();
        v2["history"].as_object_mut().unwrap().remove("tag");
        let e = read_json(&v2.to_string()).unwrap_err().to_string();
        assert!(e.contains("history has 2 events but no `tag` column"), "{e}");
        let mut bare = snap.clone();
        bare.history = HistoryColumns::default();
        let mut v3: serde_json::Value = serde_json::from_str(&to_json(&bare)).unwrap();
        v3["history"] = serde_json::json!({"t_ns": []});
        assert_eq!(
            read_json(&v3.to_string()).unwrap(),
            bare,
            "an empty history may leave its columns out"
        );
        assert!(crate::observe::page::check(&snap).is_ok());
        let mut short = snap.clone();
        short.history.op.pop();
        let e = crate::observe::page::check(&short).unwrap_err().to_string();
        assert!(e.contains("`op` has 1 entries, `t_ns` has 2"), "{e}");
        // SAFETY: `p` came from `mr.allocate` with this size and is freed once.
        unsafe { mr.deallocate(p, 4096, stream(0)) }.unwrap();
    }

    #[test]
    fn the_page_embeds_the_snapshot_escaped() {
        let mut snap = from_log(&[], "x.csv");
        snap.source = "replay:</script><script>alert(1)</script>".into();
        snap.tags.push("<!-- a tag -->".into());
        let html = page(&snap).unwrap();
        assert!(!html.contains(MARKER));
        assert!(!html.contains("</script><script>alert"));
        assert!(!html.contains("<!-- a tag"));
        let start = html
            .find(r#"<script id="mempool-snapshot" type="application/json">"#)
            .unwrap();
        let body = &html[start..];
        let open = body.find('>').unwrap() + 1;
        let close = body.find("</script>").unwrap();
        let embedded = &body[open..close];
        // The embedded text is the snapshot's JSON, `<` escaped, which any JSON reader reads back.
        assert_eq!(embedded, to_json(&snap).replace('<', "\\u003c"));
        assert_eq!(read_json(embedded).unwrap(), snap);
        assert_eq!(html.matches(r#"id="mempool-snapshot""#).count(), 1);
    }

    #[test]
    fn a_file_that_cannot_be_written_is_named() {
        let snap = from_log(&[], "x.csv");
        let e = crate::observe::page::write_json(&snap, "/nonexistent-dir-26a/s.json").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("could not write /nonexistent-dir-26a/s.json: "),
            "{e}"
        );
    }

    #[test]
    fn a_log_becomes_a_snapshot_of_its_events() {
        let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
                   7,10:00:00.000000,allocate,0x1000,100,0x0\n\
                   7,10:00:00.000010,allocate,0x2000,200,0x5\n\
                   9,10:00:00.000020,free,0x1000,100,0x0\n\
                   9,10:00:00.000030,allocate failure,0x0,5000,0x5\n\
                   7,10:00:00.000040,allocate,0x3000,300,0x0\n";
        let events = parse_log(csv.as_bytes()).unwrap();
        let snap = from_log(&events, "small.csv");
        assert_eq!(snap.source, "replay:small.csv");
        assert_eq!(snap.history.len(), 5);
        assert_eq!(snap.history.op, [0, 0, 1, 2, 0]);
        assert_eq!(snap.history.t_ns, [0, 10_000, 20_000, 30_000, 40_000]);
        assert_eq!(snap.history.thread, [1, 1, 2, 2, 1]);
        assert_eq!(
            (snap.history.capacity, snap.history.recorded, snap.history.dropped),
            (5, 5, 0)
        );
        let st = &snap.resources[0].stats;
        assert_eq!(st.live_bytes, Some(500));
        assert_eq!(st.peak_live_bytes, Some(500));
        assert_eq!(st.allocations, Some(3));
        assert_eq!(st.frees, Some(1));
        assert_eq!(st.live_count, Some(2));
        let live: Vec<(u64, u64)> = snap.live.iter().map(|l| (l.address, l.size)).collect();
        assert_eq!(live, [(0x2000, 200), (0x3000, 300)]);
        let handles: Vec<&str> = snap.streams.iter().map(|s| s.handle.as_str()).collect();
        assert_eq!(handles, ["0x0", "0x5"]);
        let per: Vec<(u32, u64)> = snap.resources[0]
            .per_stream
            .iter()
            .map(|s| (s.stream, s.live_bytes))
            .collect();
        assert_eq!(per, [(0, 300), (1, 200)]);
    }
}
