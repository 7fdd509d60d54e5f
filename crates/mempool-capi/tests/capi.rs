//! The C ABI as a C program uses it: `tests/capi_test.c` compiled with gcc against `include/mempool.h`
//! and linked with `libmempool_capi.so`, then run. The host test checks the argument checks every
//! machine gives the same answer to, and, where no driver is installed (CI), every refusal's status and
//! message; the GPU test (`gpu` feature) allocates through a pool and a statistics adaptor and PyTorch's
//! entry points. gcc is required: without it the tests fail (CI machines have it).

use std::path::{Path, PathBuf};
use std::process::Command;

const HEADER: &str = include_str!("../include/mempool.h");
const PROGRAM: &str = include_str!("capi_test.c");

fn require_gcc() {
    let ok = Command::new("gcc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "gcc is not installed: the C program of this test cannot be compiled (install gcc)"
    );
}

/// `libmempool_capi.so`: cargo puts it next to the test binary's `deps/` folder (and in it).
fn library(exe: &Path) -> Option<PathBuf> {
    let deps = exe.parent()?;
    [
        deps.join("libmempool_capi.so"),
        deps.parent()?.join("libmempool_capi.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

fn driver_present() -> bool {
    !matches!(mempool_core::Device::count(), Err(mempool_core::Error::DriverNotFound))
}

fn run_c_program(mode: &str) {
    require_gcc();
    let exe = std::env::current_exe().unwrap();
    let Some(lib) = library(&exe) else {
        // A test binary copied out of cargo's target folder (scripts/gpu-tests.sh, gpu-pack) has no library
        // beside it; inside a target folder the library is always built, so its absence is a failure.
        assert!(
            exe.parent().and_then(|d| d.file_name()) != Some("deps".as_ref()),
            "libmempool_capi.so is missing beside {}",
            exe.display()
        );
        println!(
            "SKIPPED: no libmempool_capi.so beside {} (a bundled test binary)",
            exe.display()
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("mempool-capi-test-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(dir.join("include")).unwrap();
    std::fs::write(dir.join("include/mempool.h"), HEADER).unwrap();
    std::fs::write(dir.join("capi_test.c"), PROGRAM).unwrap();
    let libdir = lib.parent().unwrap();
    let out = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(dir.join("capi_test"))
        .arg(dir.join("capi_test.c"))
        .arg(format!("-I{}", dir.join("include").display()))
        .arg(format!("-L{}", libdir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-lmempool_capi")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gcc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(dir.join("capi_test")).arg(mode).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "capi_test {mode} failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
}

/// Without the `gpu` feature: the no-driver checks where no driver is installed, and the checks that hold
/// on any machine (null arguments, negative devices, PyTorch's refusals) where one is.
#[test]
fn c_program_host_checks() {
    run_c_program(if driver_present() { "host" } else { "nodriver" });
}

#[cfg(feature = "gpu")]
#[test]
fn gpu_c_program_allocates() {
    assert!(driver_present(), "this GPU test needs a CUDA driver and a GPU");
    run_c_program("gpu");
}
