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
/// schema or version with a message naming it.
pub fn read_json(text: &str) -> Result<Snapshot> {
    let bad = |reason: String| Error::Unsupported {
        resource: "observe::read_json",
        reason,
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let schema = v.get("schema").and_then(|s| s.as_str()).unwrap_or("");
    let version = v.get("version").and_then(|s| s.as_u64());
    if schema != crate::observe::model::SCHEMA || version != Some(u64::from(crate::observe::model::VERSION)) {
        return Err(bad(format!(
            "schema `{schema}` version {version:?} is not `{}` version {}",
            crate::observe::model::SCHEMA,
            crate::observe::model::VERSION
        )));
    }
    serde_json::from_value(v).map_err(|e| bad(format!("not a snapshot: {e}")))
}
