//! Every example of the facade, on every machine: without the GPUs it needs, it says so the same way
//! (`NAME: needs a GPU: WHY`, through `mempool_core::require_gpus`), prints nothing else and exits with
//! status 2; with them, it runs (a small configuration where it takes arguments) and succeeds.
//! `ipc_serve`, which serves until a signal, is checked with a GPU by its consumer side refusing a
//! socket nobody serves.

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
fn examples_need_their_gpus_or_run() {
    let dir = std::env::temp_dir().join(format!("mempool-examples-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nobody = dir.join("nobody-serves.sock");
    let nobody = nobody.to_str().unwrap();
    for (name, gpus, args) in [
        ("pool_report", 1, &[][..]),
        ("peer_access", 2, &[]),
        // 1 consumer, 4 buffers of 1 MiB.
        ("ipc_pipeline", 1, &["1", "4", "1"]),
        ("ipc_serve", 1, &["consume", nobody, "--count", "1"]),
        ("cudarc_kernel", 1, &[]),
    ] {
        let out = Command::new(example(name))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{name} (cargo test builds the examples): {e}"));
        let (stdout, err) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        match mempool::core::require_gpus(gpus) {
            Err(missing) => {
                assert_eq!(out.status.code(), Some(2), "{name}: {err}");
                assert_eq!(err.trim_end(), format!("{name}: {missing}"), "{name}");
                let needs = if gpus == 1 {
                    "a GPU".to_owned()
                } else {
                    format!("{gpus} GPUs")
                };
                assert!(err.starts_with(&format!("{name}: needs {needs}: ")), "{name}: {err}");
                assert!(stdout.is_empty(), "{name} prints nothing else: {stdout}");
            }
            Ok(_) if name == "ipc_serve" => {
                // Past the GPU check: the consumer cannot connect and says so, with status 1.
                assert_eq!(out.status.code(), Some(1), "{name}: {err}\n{stdout}");
                assert!(err.starts_with("ipc_serve: "), "{name}: {err}");
            }
            Ok(_) => {
                assert!(out.status.success(), "{name}: {:?}: {err}\n{stdout}", out.status);
                assert!(!stdout.is_empty(), "{name} reports what it did");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
