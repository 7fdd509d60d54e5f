//! On a machine without a GPU the `random_workload` example says so as every example does
//! (`random_workload: needs a GPU: WHY`, through `mempool_core::require_gpus`) and exits with status 2. On a
//! machine with a driver this returns at once: the example then runs for real.

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
fn the_example_says_it_needs_a_gpu_and_exits_with_status_2() {
    if mempool_core::driver_present() {
        return;
    }
    let exe = example("random_workload");
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{} (cargo test builds the examples): {e}", exe.display()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("random_workload: needs a GPU: no CUDA driver found"),
        "{err}"
    );
}
