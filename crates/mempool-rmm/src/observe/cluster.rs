//! Cluster snapshots (docs/observe.md, "Cluster snapshots"): one document holding the snapshots of
//! several workers (processes, each with its own resource stack and device), each with the worker's
//! identity, in a versioned schema of its own (`mempool.cluster-snapshot`, version 1). Reading one
//! checks every worker's snapshot as [`read_json`](crate::observe::read_json) checks a single one and
//! names the worker at fault; the viewer page shows the whole cluster on one page.

use std::collections::HashMap;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::observe::model::{Snapshot, SCHEMA};
use crate::observe::page::{page_from_json, problem, snapshot_from_value};

/// The value of [`ClusterSnapshot::schema`].
pub const CLUSTER_SCHEMA: &str = "mempool.cluster-snapshot";
/// The cluster schema's version this crate writes and reads.
pub const CLUSTER_VERSION: u32 = 1;

/// The snapshots of a cluster's workers, one per worker, each unchanged (schema `mempool.snapshot`,
/// version 1) beside the worker's identity.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterSnapshot {
    /// Always [`CLUSTER_SCHEMA`].
    pub schema: String,
    /// [`CLUSTER_VERSION`].
    pub version: u32,
    /// When the cluster document was made, nanoseconds since the Unix epoch (each worker's snapshot
    /// has its own `created_unix_ns`).
    pub created_unix_ns: u64,
    /// What made it: `rust`, `python`, `mempool-bench`.
    pub source: String,
    /// The workers, in the order given; names are unique.
    pub workers: Vec<WorkerSnapshot>,
}

/// Who a worker is. Everything but the name may be unknown (`None`, JSON `null`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerIdentity {
    /// Its name, unique in the cluster (a Dask worker's address or name, a rank, a host name).
    pub name: String,
    /// Its address (e.g. `tcp://10.0.0.5:40123`).
    #[serde(default)]
    pub address: Option<String>,
    /// The host it runs on.
    #[serde(default)]
    pub host: Option<String>,
    /// Its process id.
    #[serde(default)]
    pub pid: Option<u32>,
    /// The ordinal of its device.
    #[serde(default)]
    pub device: Option<u32>,
    /// The name of its device.
    #[serde(default)]
    pub device_name: Option<String>,
}

/// One worker: its identity (the fields sit beside `snapshot` in the JSON) and its snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerSnapshot {
    /// Who the worker is.
    #[serde(flatten)]
    pub identity: WorkerIdentity,
    /// Its snapshot, schema `mempool.snapshot` version 1.
    pub snapshot: Snapshot,
}

impl WorkerSnapshot {
    /// The worker `name` with `snapshot`; its device (ordinal and name) is the snapshot's when the
    /// snapshot lists exactly one device, else unknown, as are its address, host and pid.
    pub fn new(name: impl Into<String>, snapshot: Snapshot) -> Self {
        let (device, device_name) = match snapshot.devices.as_slice() {
            [d] => (Some(d.ordinal), Some(d.name.clone()).filter(|n| !n.is_empty())),
            _ => (None, None),
        };
        WorkerSnapshot {
            identity: WorkerIdentity {
                name: name.into(),
                device,
                device_name,
                ..WorkerIdentity::default()
            },
            snapshot,
        }
    }
}

fn bad(resource: &'static str, reason: String) -> Error {
    Error::Unsupported { resource, reason }
}

/// Why the workers cannot make a cluster document, or `None`: no worker, a worker with an empty name,
/// two workers of one name, a worker whose snapshot is not one ([`check`](crate::observe::check)).
fn workers_problem(workers: &[WorkerSnapshot]) -> Option<String> {
    if workers.is_empty() {
        return Some("a cluster snapshot needs at least one worker; `workers` is empty".into());
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, w) in workers.iter().enumerate() {
        let name = w.identity.name.as_str();
        if name.is_empty() {
            return Some(format!(
                "workers[{i}] has an empty name; every worker needs a unique name"
            ));
        }
        if let Some(j) = seen.insert(name, i) {
            return Some(format!(
                "workers[{j}] and workers[{i}] are both named `{name}`: worker names must be unique"
            ));
        }
        if let Some(why) = problem(&w.snapshot) {
            return Some(format!("worker `{name}` (workers[{i}]): {why}"));
        }
    }
    None
}

/// The cluster document of `workers` (in that order), made now by `source`. Fails, naming the worker,
/// when there is no worker, a name is empty or used twice, or a worker's snapshot does not pass
/// [`check`](crate::observe::check).
pub fn cluster(source: &str, workers: Vec<WorkerSnapshot>) -> Result<ClusterSnapshot> {
    let c = ClusterSnapshot {
        schema: CLUSTER_SCHEMA.into(),
        version: CLUSTER_VERSION,
        created_unix_ns: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        source: source.into(),
        workers,
    };
    check_cluster(&c)?;
    Ok(c)
}

/// Checks a cluster document as [`read_cluster_json`] does: its schema and version, then its workers
/// (see [`cluster`]).
pub fn check_cluster(c: &ClusterSnapshot) -> Result<()> {
    if c.schema != CLUSTER_SCHEMA || c.version != CLUSTER_VERSION {
        return Err(bad(
            "observe::check_cluster",
            format!(
                "schema `{}` version {} is not `{CLUSTER_SCHEMA}` version {CLUSTER_VERSION}",
                c.schema, c.version
            ),
        ));
    }
    workers_problem(&c.workers).map_or(Ok(()), |why| Err(bad("observe::check_cluster", why)))
}

/// The cluster document's JSON text.
pub fn cluster_to_json(c: &ClusterSnapshot) -> String {
    serde_json::to_string(c).expect("a cluster snapshot serializes: no maps with non-string keys, no floats")
}

/// The top level's fields besides `workers`.
#[derive(Deserialize)]
struct Head {
    #[serde(default)]
    created_unix_ns: u64,
    #[serde(default)]
    source: String,
}

/// The cluster document `v` holds, or why it is none (see [`read_cluster_json`]).
fn cluster_from_value(mut v: serde_json::Value) -> std::result::Result<ClusterSnapshot, String> {
    if !v.is_object() {
        return Err("not a cluster snapshot: its top level is not a JSON object".into());
    }
    let schema = v.get("schema").and_then(|s| s.as_str()).unwrap_or("").to_owned();
    let version = v.get("version").and_then(|s| s.as_u64());
    if schema == SCHEMA {
        return Err(format!(
            "this is a single snapshot (schema `{SCHEMA}`), not a cluster snapshot (`{CLUSTER_SCHEMA}`): \
             make one of several with observe::cluster, mempool.memory.cluster_snapshot or \
             mempool-bench cluster --worker NAME=FILE"
        ));
    }
    if schema != CLUSTER_SCHEMA || version != Some(u64::from(CLUSTER_VERSION)) {
        return Err(format!(
            "schema `{schema}` version {version:?} is not `{CLUSTER_SCHEMA}` version {CLUSTER_VERSION}"
        ));
    }
    let head: Head = serde_json::from_value(v.clone()).map_err(|e| format!("not a cluster snapshot: {e}"))?;
    let Some(list) = v.get_mut("workers").and_then(|w| w.as_array_mut()) else {
        return Err("not a cluster snapshot: it has no `workers` array".into());
    };
    let mut workers = Vec::with_capacity(list.len());
    for (i, w) in list.iter_mut().enumerate() {
        if !w.is_object() {
            return Err(format!("workers[{i}] is not a JSON object"));
        }
        let name = match w.get("name") {
            Some(serde_json::Value::String(n)) if !n.is_empty() => n.clone(),
            _ => return Err(format!("workers[{i}] has no name (a non-empty string)")),
        };
        let snap = w
            .as_object_mut()
            .and_then(|o| o.remove("snapshot"))
            .ok_or_else(|| format!("worker `{name}` (workers[{i}]) has no `snapshot`"))?;
        let identity: WorkerIdentity =
            serde_json::from_value(w.take()).map_err(|e| format!("worker `{name}` (workers[{i}]): {e}"))?;
        let snapshot = snapshot_from_value(snap).map_err(|e| format!("worker `{name}` (workers[{i}]): {e}"))?;
        workers.push(WorkerSnapshot { identity, snapshot });
    }
    if let Some(why) = workers_problem(&workers) {
        return Err(why);
    }
    Ok(ClusterSnapshot {
        schema,
        version: CLUSTER_VERSION,
        created_unix_ns: head.created_unix_ns,
        source: head.source,
        workers,
    })
}

/// Reads a cluster document. Refuses, with a message that says why: text that is not JSON, a single
/// snapshot, another schema or version (named), no `workers` array or an empty one, a worker without a
/// name or snapshot, two workers of one name, and a worker whose snapshot
/// [`read_json`](crate::observe::read_json) would refuse (the message names the worker and gives that
/// reason).
pub fn read_cluster_json(text: &str) -> Result<ClusterSnapshot> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad("observe::read_cluster_json", format!("not JSON: {e}")))?;
    cluster_from_value(v).map_err(|why| bad("observe::read_cluster_json", why))
}

/// The viewer page showing the cluster: an overview of every worker and each worker's own panels.
/// Fails as [`check_cluster`] does.
pub fn cluster_page(c: &ClusterSnapshot) -> Result<String> {
    check_cluster(c)?;
    page_from_json(&cluster_to_json(c))
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("could not write {}: {e}", path.display()))
}

/// Writes the cluster document's JSON to `path` (after [`check_cluster`]).
pub fn write_cluster_json(c: &ClusterSnapshot, path: impl AsRef<Path>) -> Result<()> {
    check_cluster(c)?;
    let path = path.as_ref();
    std::fs::write(path, cluster_to_json(c)).map_err(|e| io(path, e))
}

/// Writes the viewer page showing the cluster to `path`.
pub fn write_cluster_html(c: &ClusterSnapshot, path: impl AsRef<Path>) -> Result<()> {
    let page = cluster_page(c)?;
    let path = path.as_ref();
    std::fs::write(path, page).map_err(|e| io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptors::parse_log;
    use crate::observe::model::DeviceInfo;
    use crate::observe::page::{to_json, MARKER};
    use crate::observe::snapshot::from_log;

    fn worker_snapshot(ptr: u64, size: u64) -> Snapshot {
        let csv = format!(
            "Thread,Time,Action,Pointer,Size,Stream\n\
             1,10:00:00.000000,allocate,{ptr:#x},{size},0x0\n\
             1,10:00:00.000010,allocate,{:#x},100,0x0\n\
             1,10:00:00.000020,free,{:#x},100,0x0\n",
            ptr + size,
            ptr + size
        );
        from_log(&parse_log(csv.as_bytes()).unwrap(), "w.csv")
    }

    fn two() -> ClusterSnapshot {
        let mut a = worker_snapshot(0x1000, 4096);
        a.devices.push(DeviceInfo {
            ordinal: 1,
            name: "Simulated GPU".into(),
            total_bytes: 1 << 30,
            free_bytes: 1 << 29,
        });
        let mut wa = WorkerSnapshot::new("tcp://10.0.0.5:40123", a);
        wa.identity.host = Some("node-a".into());
        wa.identity.pid = Some(4242);
        cluster(
            "rust",
            vec![wa, WorkerSnapshot::new("worker-b", worker_snapshot(0x9000, 8192))],
        )
        .unwrap()
    }

    #[test]
    fn a_cluster_holds_each_worker_with_its_identity_and_snapshot() {
        let c = two();
        assert_eq!((c.schema.as_str(), c.version), (CLUSTER_SCHEMA, 1));
        let a = &c.workers[0].identity;
        assert_eq!(
            (a.device, a.device_name.as_deref(), a.host.as_deref(), a.pid),
            (Some(1), Some("Simulated GPU"), Some("node-a"), Some(4242))
        );
        // a snapshot that lists no device leaves the worker's device unknown
        assert_eq!(c.workers[1].identity.device, None);
        let json = cluster_to_json(&c);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["schema"], CLUSTER_SCHEMA);
        let w = &v["workers"][0];
        for key in ["name", "address", "host", "pid", "device", "device_name", "snapshot"] {
            assert!(w.get(key).is_some(), "worker key {key} missing from {w}");
        }
        assert!(w["address"].is_null());
        // each worker's snapshot is the single snapshot's JSON, as it is
        let single: serde_json::Value = serde_json::from_str(&to_json(&c.workers[1].snapshot)).unwrap();
        assert_eq!(v["workers"][1]["snapshot"], single);
        assert_eq!(v["workers"][1]["snapshot"]["resources"][0]["stats"]["live_bytes"], 8192);
        assert_eq!(read_cluster_json(&json).unwrap(), c);
        let page = cluster_page(&c).unwrap();
        assert!(!page.contains(MARKER));
        assert!(page.contains(&json.replace('<', "\\u003c")));
        let dir = std::env::temp_dir().join(format!("mempool-cluster-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_cluster_json(&c, dir.join("c.json")).unwrap();
        write_cluster_html(&c, dir.join("c.html")).unwrap();
        let back = std::fs::read_to_string(dir.join("c.json")).unwrap();
        assert_eq!(read_cluster_json(&back).unwrap(), c);
        assert_eq!(std::fs::read_to_string(dir.join("c.html")).unwrap(), page);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn reason(text: &str) -> String {
        read_cluster_json(text).unwrap_err().to_string()
    }

    #[test]
    fn bad_cluster_documents_say_why() {
        let c = two();
        let good: serde_json::Value = serde_json::from_str(&cluster_to_json(&c)).unwrap();
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            v.to_string()
        };
        let cases: Vec<(String, &str)> = vec![
            ("{\"schema\": ".into(), "not JSON: "),
            ("[1]".into(), "its top level is not a JSON object"),
            (
                to_json(&c.workers[0].snapshot),
                "this is a single snapshot (schema `mempool.snapshot`), not a cluster snapshot",
            ),
            (
                with(&|v| v["version"] = 2.into()),
                "schema `mempool.cluster-snapshot` version Some(2) is not `mempool.cluster-snapshot` version 1",
            ),
            (
                with(&|v| v["schema"] = "torch.memory".into()),
                "schema `torch.memory` version Some(1) is not",
            ),
            (
                with(&|v| {
                    v.as_object_mut().unwrap().remove("workers");
                }),
                "it has no `workers` array",
            ),
            (
                with(&|v| v["workers"] = serde_json::json!([])),
                "needs at least one worker; `workers` is empty",
            ),
            (
                with(&|v| v["workers"][1]["name"] = "tcp://10.0.0.5:40123".into()),
                "workers[0] and workers[1] are both named `tcp://10.0.0.5:40123`: worker names must be unique",
            ),
            (
                with(&|v| v["workers"][1]["name"] = serde_json::Value::Null),
                "workers[1] has no name (a non-empty string)",
            ),
            (
                with(&|v| {
                    v["workers"][1].as_object_mut().unwrap().remove("snapshot");
                }),
                "worker `worker-b` (workers[1]) has no `snapshot`",
            ),
            (
                with(&|v| v["workers"][1]["snapshot"]["version"] = 2.into()),
                "worker `worker-b` (workers[1]): schema `mempool.snapshot` version Some(2) is not `mempool.snapshot` version 1",
            ),
            (
                with(&|v| v["workers"][1]["snapshot"]["history"]["size"] = serde_json::json!([1])),
                "worker `worker-b` (workers[1]): history columns differ in length: `size` has 1 entries, `t_ns` has 3",
            ),
            (
                with(&|v| {
                    v["workers"][0]["snapshot"]["history"].as_object_mut().unwrap().remove("thread");
                }),
                "worker `tcp://10.0.0.5:40123` (workers[0]): history has 3 events but no `thread` column",
            ),
            (
                with(&|v| v["workers"][0]["snapshot"]["resources"] = "none".into()),
                "worker `tcp://10.0.0.5:40123` (workers[0]): not a snapshot: invalid type: string \"none\"",
            ),
            (
                with(&|v| v["workers"][0]["pid"] = "4242".into()),
                "worker `tcp://10.0.0.5:40123` (workers[0]): invalid type: string \"4242\", expected u32",
            ),
        ];
        for (text, expected) in cases {
            let e = reason(&text);
            assert!(e.contains(expected), "expected `{expected}` in `{e}`");
            assert!(e.starts_with("observe::read_cluster_json"), "{e}");
        }
    }

    #[test]
    fn cluster_refuses_bad_workers() {
        let s = || worker_snapshot(0x1000, 64);
        let e = cluster("rust", vec![]).unwrap_err().to_string();
        assert!(e.contains("needs at least one worker"), "{e}");
        let e = cluster(
            "rust",
            vec![WorkerSnapshot::new("a", s()), WorkerSnapshot::new("a", s())],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("workers[0] and workers[1] are both named `a`"), "{e}");
        let e = cluster("rust", vec![WorkerSnapshot::new("", s())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("workers[0] has an empty name"), "{e}");
        let mut ragged = s();
        ragged.history.tag.pop();
        let e = cluster(
            "rust",
            vec![WorkerSnapshot::new("a", s()), WorkerSnapshot::new("b", ragged)],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("worker `b` (workers[1]): history columns differ in length: `tag` has 2 entries, `t_ns` has 3"),
            "{e}"
        );
        let mut other = s();
        other.version = 7;
        let e = cluster("rust", vec![WorkerSnapshot::new("a", other)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("worker `a` (workers[0]): schema `mempool.snapshot` version Some(7)"),
            "{e}"
        );
        let mut c = two();
        c.version = 3;
        assert!(cluster_page(&c).unwrap_err().to_string().contains("version 3 is not"));
        assert!(write_cluster_json(&c, std::env::temp_dir().join("never-written.json")).is_err());
    }
}
