//! On a machine without a GPU every example of the facade says so the same way
//! (`NAME: needs a GPU: WHY`, through `mempool_core::require_gpus`) and exits with status 2. On a
//! machine with a driver this returns at once: the examples then run for real.

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
fn examples_say_they_need_a_gpu_and_exit_with_status_2() {
    if mempool::core::driver_present() {
        return;
    }
    for (name, needs) in [
        ("pool_report", "a GPU"),
        ("peer_access", "2 GPUs"),
        ("ipc_pipeline", "a GPU"),
        ("ipc_serve", "a GPU"),
        ("cudarc_kernel", "a GPU"),
    ] {
        let out = Command::new(example(name))
            .output()
            .unwrap_or_else(|e| panic!("{name} (cargo test builds the examples): {e}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(
            err.starts_with(&format!("{name}: needs {needs}: no CUDA driver found")),
            "{name}: {err}"
        );
        assert!(out.stdout.is_empty(), "{name} prints nothing else");
    }
}
