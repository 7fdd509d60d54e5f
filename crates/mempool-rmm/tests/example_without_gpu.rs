//! On a machine without a GPU the `random_workload` example says so as every example does
//! (`random_workload: needs a GPU: WHY`, through `mempool_core::require_gpus`) and exits with status 2. On a
//! machine with a driver this returns at once: the example then runs for real.

use std::process::Command;

#[test]
fn the_example_says_it_needs_a_gpu_and_exits_with_status_2() {
    if mempool_core::driver_present() {
        return;
    }
    // Cargo builds the examples next to the test binaries' folder: target/<profile>/examples/.
    let exe = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/random_workload");
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
