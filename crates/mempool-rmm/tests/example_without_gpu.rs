//! The `random_workload` example on every machine: without a GPU it says so as every example does
//! (`random_workload: needs a GPU: WHY`, through `mempool_core::require_gpus`), prints nothing else and
//! exits with status 2; with one, its quick run (`--quick`) succeeds and prints its table.

use std::path::PathBuf;
use std::process::Command;

/// An example's binary: where Cargo builds it (`target/<profile>/examples/`, beside the test binaries'
/// `deps/`), or in a bundle of scripts/gpu-tests.sh (`bin/`, beside `tests/`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let built = dir.join("examples").join(name);
    if built.exists() {
        built
    } else {
        dir.join("bin").join(name)
    }
}

#[test]
fn the_example_needs_a_gpu_or_runs() {
    let exe = example("random_workload");
    let out = Command::new(&exe)
        .arg("--quick")
        .output()
        .unwrap_or_else(|e| panic!("{} (cargo test builds the examples): {e}", exe.display()));
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    match mempool_core::require_gpus(1) {
        Err(missing) => {
            assert_eq!(out.status.code(), Some(2), "{err}");
            assert_eq!(err.trim_end(), format!("random_workload: {missing}"));
            assert!(err.starts_with("random_workload: needs a GPU: "), "{err}");
            assert!(stdout.is_empty(), "{stdout}");
        }
        Ok(_) => {
            assert!(out.status.success(), "{:?}: {err}\n{stdout}", out.status);
            assert!(!stdout.is_empty(), "the example prints its table");
        }
    }
}
