//! Helpers for the unit tests that need no GPU: memfds standing in for a pool's file descriptor,
//! descriptor counting, temporary directories. They import nothing from the crate, so that any
//! module's tests can use them without an import cycle.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A name no other test (or test process) uses.
pub(crate) fn unique_name(tag: &str) -> String {
    format!(
        "mempool-ipc-test-{}-{}-{tag}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

/// A memfd named `name` holding `contents`: the stand-in for a pool's file descriptor.
pub(crate) fn memfd_with(name: &str, contents: &[u8]) -> OwnedFd {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut file = File::from(fd);
    file.write_all(contents).unwrap();
    OwnedFd::from(file)
}

/// Everything readable through `fd`, from the start.
pub(crate) fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut file = File::from(fd);
    file.seek(SeekFrom::Start(0)).unwrap();
    let mut out = Vec::new();
    file.read_to_end(&mut out).unwrap();
    out
}

/// How many descriptors of this process refer to the memfd named `name`. Other tests run in
/// parallel threads, so the tests count their own memfds by name, not all descriptors.
pub(crate) fn open_fds_named(name: &str) -> usize {
    let needle = format!("memfd:{name} ");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with(&format!("/{needle}")))
        .count()
}

/// Whether `fd` has `FD_CLOEXEC`.
pub(crate) fn is_cloexec(fd: impl AsFd) -> bool {
    rustix::io::fcntl_getfd(fd)
        .unwrap()
        .contains(rustix::io::FdFlags::CLOEXEC)
}

/// A fresh directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }

    pub(crate) fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
