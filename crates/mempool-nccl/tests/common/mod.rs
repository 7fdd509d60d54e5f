//! What the GPU tests share: NVLS off, NCCL found (in the nvidia-nccl-cu13 Python package when nothing
//! else names it), buffers with exact integer contents.
#![allow(dead_code)]

use std::process::Command;

use mempool_core::{Device, Stream};
use mempool_rmm::containers::DeviceBuffer;
use mempool_rmm::SharedResource;

/// Turns NVLink multicast off (before any communicator) and makes NCCL findable: when neither
/// `MEMPOOL_NCCL_LIBRARY` is set nor `libnccl.so.2` is on the loader's path, asks python3 where the
/// `nvidia.nccl` package keeps it. Prints the NCCL that was loaded.
pub fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(setup_once);
}

/// [`setup`]'s work, done once per test binary: every test calls `setup` before its first CUDA or NCCL
/// call, so while this writes the environment the other test threads wait in `call_once` and read
/// nothing.
fn setup_once() {
    // SAFETY: see above: no other thread of this test binary reads or writes the environment until
    // `call_once` returns (the harness read its own variables before starting the tests).
    unsafe { mempool_nccl::disable_nvls() }.expect("NCCL_NVLS_ENABLE must be unset or 0 on these machines");
    if std::env::var_os("MEMPOOL_NCCL_LIBRARY").is_none() && mempool_nccl::probe_library("libnccl.so.2").is_err() {
        let out = Command::new("python3")
            .args([
                "-c",
                "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))",
            ])
            .output();
        if let Ok(out) = out {
            let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if out.status.success() && std::path::Path::new(&path).exists() {
                std::env::set_var("MEMPOOL_NCCL_LIBRARY", &path);
            }
        }
    }
    let version = mempool_nccl::library_version().unwrap_or_else(|e| panic!("NCCL could not be loaded: {e}"));
    println!(
        "NCCL {version} from {}; NCCL_NVLS_ENABLE={:?}",
        mempool_nccl::library_path().unwrap(),
        std::env::var("NCCL_NVLS_ENABLE").ok()
    );
}

/// Two peer-capable GPUs, or a clear failure.
pub fn two_gpus() -> (Device, Device) {
    let count = Device::count().expect("CUDA driver");
    assert!(
        count >= 2,
        "two-GPU tests need at least two GPUs; this machine has {count}: run them on a two-GPU machine"
    );
    (Device::get(0).unwrap(), Device::get(1).unwrap())
}

/// `n` i32s: `(rank + 1) * (j % 1000)`.
pub fn pattern(rank: usize, n: usize) -> Vec<i32> {
    (0..n).map(|j| (rank as i32 + 1) * (j % 1000) as i32).collect()
}

pub fn to_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

pub fn from_bytes(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// A buffer of `mr` holding `values`, ordered on `stream`.
pub fn buffer<'s>(values: &[i32], stream: &'s Stream, mr: SharedResource) -> DeviceBuffer<'s> {
    DeviceBuffer::from_host(&to_bytes(values), stream, mr).unwrap()
}

/// Asserts `got` equals `want`, naming the first difference.
pub fn check(what: &str, got: &[i32], want: &[i32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad = got.iter().zip(want).enumerate().find(|(_, (g, w))| g != w);
    assert!(
        bad.is_none(),
        "{what}: first wrong element (index, (got, want)): {bad:?}"
    );
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One test at a time in a binary: NCCL kernels of independent communicators on the same GPUs may wait
/// on each other and deadlock when they run concurrently.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
