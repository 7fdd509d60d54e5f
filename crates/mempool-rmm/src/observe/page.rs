//! The viewer page: `viewer.html` (one self-contained file) with a snapshot embedded in its one
//! `<script id="mempool-snapshot" type="application/json">` element.

use std::path::Path;

use crate::error::{Error, Result};
use crate::observe::model::Snapshot;

/// The viewer, as built into the crate.
pub const VIEWER_HTML: &str = include_str!("viewer.html");

/// The text in the viewer that a snapshot replaces.
pub const MARKER: &str = "/*MEMPOOL_SNAPSHOT*/";

/// `json` made safe inside a `<script>` element: every `<` written as `\u003c` (the same string to a
/// JSON reader), so no `</script>` or `<!--` can end or change the element.
pub fn escape_for_script(json: &str) -> String {
    json.replace('<', "\\u003c")
}

/// The viewer page with the snapshot JSON `json` embedded (escaped by [`escape_for_script`]). Fails
/// when the viewer does not hold the marker exactly once.
pub fn page_from_json(json: &str) -> Result<String> {
    let n = VIEWER_HTML.matches(MARKER).count();
    if n != 1 {
        return Err(Error::Unsupported {
            resource: "observe::page",
            reason: format!("the viewer holds the snapshot marker {MARKER} {n} times, not once"),
        });
    }
    Ok(VIEWER_HTML.replacen(MARKER, &escape_for_script(json), 1))
}

/// The snapshot's JSON text.
pub fn to_json(snapshot: &Snapshot) -> String {
    serde_json::to_string(snapshot).expect("a snapshot serializes: no maps with non-string keys, no floats")
}

/// The viewer page showing `snapshot`.
pub fn page(snapshot: &Snapshot) -> Result<String> {
    page_from_json(&to_json(snapshot))
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("could not write {}: {e}", path.display()))
}

/// Writes the snapshot's JSON to `path`.
pub fn write_json(snapshot: &Snapshot, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    std::fs::write(path, to_json(snapshot)).map_err(|e| io(path, e))
}

/// Writes the viewer page showing `snapshot` to `path`.
pub fn write_html(snapshot: &Snapshot, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    std::fs::write(path, page(snapshot)?).map_err(|e| io(path, e))
}

/// Reads a snapshot written by [`write_json`] (or any producer of the schema). Refuses another
/// schema or version with a message naming it, and history columns of different lengths (or a history
/// with events that lacks a column) naming the column.
pub fn read_json(text: &str) -> Result<Snapshot> {
    let bad = |reason: String| Error::Unsupported {
        resource: "observe::read_json",
        reason,
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    snapshot_from_value(v).map_err(bad)
}

/// Checks a snapshot as [`read_json`] checks what it reads: the schema and version, and history
/// columns of one length (a failure names the column).
pub fn check(snapshot: &Snapshot) -> Result<()> {
    problem(snapshot).map_or(Ok(()), |reason| {
        Err(Error::Unsupported {
            resource: "observe::check",
            reason,
        })
    })
}

/// Why `s` is not a snapshot of the schema [`check`] accepts, or `None`.
pub(crate) fn problem(s: &Snapshot) -> Option<String> {
    if s.schema != crate::observe::model::SCHEMA || s.version != crate::observe::model::VERSION {
        return Some(format!(
            "schema `{}` version Some({}) is not `{}` version {}",
            s.schema,
            s.version,
            crate::observe::model::SCHEMA,
            crate::observe::model::VERSION
        ));
    }
    let h = &s.history;
    let lengths = [
        h.t_ns.len(),
        h.op.len(),
        h.resource.len(),
        h.address.len(),
        h.size.len(),
        h.stream.len(),
        h.tag.len(),
        h.thread.len(),
    ];
    COLUMNS
        .iter()
        .zip(lengths)
        .find(|&(_, n)| n != lengths[0])
        .map(|(c, n)| {
            format!(
                "history columns differ in length: `{c}` has {n} entries, `t_ns` has {}",
                lengths[0]
            )
        })
}

/// The history's columns, in the order of docs/observe.md.
const COLUMNS: [&str; 8] = ["t_ns", "op", "resource", "address", "size", "stream", "tag", "thread"];

/// The snapshot `v` holds, or why it is none: another schema or version (named), history columns of
/// different lengths or a missing column (the checks the viewer makes), or a field of the wrong type.
pub(crate) fn snapshot_from_value(v: serde_json::Value) -> std::result::Result<Snapshot, String> {
    if !v.is_object() {
        return Err("not a snapshot: its top level is not a JSON object".into());
    }
    let schema = v.get("schema").and_then(|s| s.as_str()).unwrap_or("");
    let version = v.get("version").and_then(|s| s.as_u64());
    if schema != crate::observe::model::SCHEMA || version != Some(u64::from(crate::observe::model::VERSION)) {
        return Err(format!(
            "schema `{schema}` version {version:?} is not `{}` version {}",
            crate::observe::model::SCHEMA,
            crate::observe::model::VERSION
        ));
    }
    if let Some(h) = v.get("history").filter(|h| h.is_object()) {
        let mut first: Option<(&str, usize)> = None;
        for c in COLUMNS {
            let Some(col) = h.get(c) else { continue };
            let n = col
                .as_array()
                .ok_or_else(|| format!("history.{c} is not an array"))?
                .len();
            match first {
                None => first = Some((c, n)),
                Some((f, m)) if m != n => {
                    return Err(format!(
                        "history columns differ in length: `{c}` has {n} entries, `{f}` has {m}"
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some((_, n)) = first.filter(|&(_, n)| n > 0) {
            if let Some(c) = COLUMNS.iter().find(|c| h.get(**c).is_none()) {
                return Err(format!("history has {n} events but no `{c}` column"));
            }
        }
    }
    serde_json::from_value(v).map_err(|e| format!("not a snapshot: {e}"))
}
