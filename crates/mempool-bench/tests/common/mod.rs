//! Finding the crate's committed data (`crates/mempool-bench/data/`) from wherever a test binary runs:
//! built by Cargo in place, or packed into a GPU bundle (`.gpu/tests/`) and run on another machine, in
//! another directory, where the build machine's path does not exist.

use std::path::{Path, PathBuf};

/// The environment variable naming the repository root (the directory holding `crates/`); the GPU suite
/// (`scripts/gpu-suite.sh`) sets it to the root it runs from.
pub const SOURCE_ROOT_VAR: &str = "MEMPOOL_SOURCE_ROOT";

/// This crate's directory, relative to the repository root.
const CRATE_DIR: &str = "crates/mempool-bench";

/// `data/{file}` of this crate: under `$MEMPOOL_SOURCE_ROOT` when that is set (and then only there);
/// otherwise the first that exists of the crate's directory at build time, the repository around a
/// packed test binary (`ROOT/.gpu/tests/NAME`) and the current directory's `crates/mempool-bench`.
/// Panics naming every place it looked when none holds the file.
pub fn data(file: &str) -> PathBuf {
    let rel = Path::new("data").join(file);
    if let Some(root) = std::env::var_os(SOURCE_ROOT_VAR) {
        let p = Path::new(&root).join(CRATE_DIR).join(&rel);
        assert!(
            p.exists(),
            "{SOURCE_ROOT_VAR}={}: there is no {} (it names the repository root, the directory holding crates/)",
            Path::new(&root).display(),
            p.display()
        );
        return p;
    }
    let mut places = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR"))];
    if let Some(root) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf()))
    {
        places.push(root.join(CRATE_DIR));
    }
    if let Ok(cwd) = std::env::current_dir() {
        places.push(cwd.join(CRATE_DIR));
    }
    for dir in &places {
        let p = dir.join(&rel);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{}: not found in {}; set {SOURCE_ROOT_VAR} to the repository root",
        rel.display(),
        places
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
}
