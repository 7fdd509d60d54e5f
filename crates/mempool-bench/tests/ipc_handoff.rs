//! The `ipc_handoff` benchmark binary on every machine: a command line it cannot run is refused with
//! status 2 and the reason before the driver is loaded; then, without a GPU, it says so as every program
//! of the workspace does (`ipc_handoff: needs a GPU: WHY`, through `mempool_core::require_gpus`) and
//! exits with status 2; with one, a run with one consumer per set and no diagnosis completes and prints
//! its tables.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The binary: where Cargo built it, or in a bundle of the GPU tests (`bin/`, beside `tests/`).
fn handoff() -> Command {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ipc_handoff"));
    if built.exists() {
        return Command::new(built);
    }
    let exe = std::env::current_exe().unwrap();
    let packed = exe.parent().and_then(|d| d.parent()).map(|d| d.join("bin/ipc_handoff"));
    Command::new(packed.filter(|p| p.exists()).unwrap_or(built))
}

fn run(args: &[&str]) -> Output {
    handoff()
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ipc_handoff {args:?}: {e}"))
}

#[test]
fn a_command_line_it_cannot_run_is_refused_with_the_reason_on_every_machine() {
    for (args, why) in [
        (
            &["0"][..],
            "ipc_handoff: `0` is not a consumer count (a whole number, 1 or more)",
        ),
        (&["four"], "ipc_handoff: `four` is not a consumer count"),
        (
            &["2", "3"],
            "ipc_handoff: unexpected argument `3`: one consumer count at most",
        ),
        (
            &["--fast"],
            "ipc_handoff: unknown flag `--fast`: usage: ipc_handoff [consumers] [--no-trace] [--sub-first]",
        ),
        (
            &["consumer"],
            "ipc_handoff: consumer: the exporter's socket path is missing",
        ),
        (
            &["consumer", "/tmp/x.sock", "--v3"],
            "ipc_handoff: consumer: unknown flag `--v3` (--v1, --v2, --host-ready)",
        ),
    ] {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with(why), "{args:?}: {err}");
        assert!(
            out.stdout.is_empty(),
            "{args:?} ran: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn without_a_gpu_it_says_so_and_with_one_it_runs() {
    let out = run(&["1", "--no-trace"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    match mempool_core::require_gpus(1) {
        Err(missing) => {
            assert_eq!(out.status.code(), Some(2), "{stderr}");
            assert_eq!(stderr.trim_end(), format!("ipc_handoff: {missing}"));
            assert!(stderr.starts_with("ipc_handoff: needs a GPU: "), "{stderr}");
            assert!(stdout.is_empty(), "{stdout}");
        }
        Ok(_) => {
            assert!(out.status.success(), "{:?}: {stderr}\n{stdout}", out.status);
            for line in [
                "(3 consumer processes: 1 version-1, 1 with the fast release path over the socket (version 2), 1 with the shared-memory rings (version 3))",
                "host CPU: ",
                "CUDA MPS: ",
                "Targets (issue 25",
                "Round trip, 1 consumer: producer -> consumer -> producer",
                "Sustained, 1 consumers, 4 buffers in flight per consumer",
                "exporter: ",
            ] {
                assert!(stdout.contains(line), "missing `{line}`:\n{stdout}");
            }
            // One row per size of each table.
            for size in ["| 4 KiB |", "| 64 MiB |", "| 16 MiB |"] {
                assert!(stdout.contains(size), "missing the row `{size}`:\n{stdout}");
            }
        }
    }
}
