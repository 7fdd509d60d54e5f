//! `mempool-bench cluster`: the snapshot files of several workers merged into one cluster document
//! (docs/observe.md, "Cluster snapshots"), written as JSON and as the viewer page. No GPU needed.

use std::path::{Path, PathBuf};

use mempool_rmm::observe::{self, WorkerSnapshot};

use crate::error::{Error, Result};

/// A `--worker NAME=FILE` argument: the name (before the first `=`) and the file.
pub fn parse_worker(arg: &str) -> std::result::Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => Ok((name.to_owned(), PathBuf::from(file))),
        _ => Err(format!(
            "`{arg}` is not NAME=FILE: a worker's name, `=`, and its snapshot file (e.g. worker-0=w0.json)"
        )),
    }
}

/// Reads each worker's snapshot file (a `mempool.snapshot` JSON file: `replay --snapshot`,
/// `mempool.memory.dump_snapshot`, `observe::write_json`), makes the cluster document of them in the
/// order given (each worker's device taken from its snapshot when the snapshot lists one), and writes it
/// to `json` and its page to `html`. Fails naming the file that cannot be read or is not a snapshot, and
/// refuses names given twice; writes nothing then.
pub fn merge(workers: &[(String, PathBuf)], json: Option<&Path>, html: Option<&Path>) -> Result<()> {
    if json.is_none() && html.is_none() {
        return Err(Error::Usage(
            "nothing to write: give --json FILE (the cluster document), --html FILE (its page), or both".into(),
        ));
    }
    let mut list = Vec::with_capacity(workers.len());
    for (name, path) in workers {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let snapshot = observe::read_json(&text).map_err(|e| {
            let why = match e {
                mempool_rmm::Error::Unsupported { reason, .. } => reason,
                e => e.to_string(),
            };
            Error::Usage(format!(
                "--worker {name}={}: not a mempool snapshot: {why}",
                path.display()
            ))
        })?;
        list.push(WorkerSnapshot::new(name.clone(), snapshot));
    }
    let cluster = observe::cluster("mempool-bench", list).map_err(|e| match e {
        mempool_rmm::Error::Unsupported { reason, .. } => Error::Usage(format!("--worker: {reason}")),
        e => e.into(),
    })?;
    let page = html.map(|_| observe::cluster_page(&cluster)).transpose()?;
    let write = |p: &Path, text: &str| {
        std::fs::write(p, text).map_err(|source| Error::Io {
            path: p.display().to_string(),
            source,
        })
    };
    if let Some(p) = json {
        write(p, &observe::cluster_to_json(&cluster))?;
        eprintln!(
            "wrote cluster snapshot: {} ({} workers)",
            p.display(),
            cluster.workers.len()
        );
    }
    if let (Some(p), Some(page)) = (html, page) {
        write(p, &page)?;
        eprintln!("wrote page: {}", p.display());
    }
    Ok(())
}
