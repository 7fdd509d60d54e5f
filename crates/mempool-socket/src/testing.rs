//! Helpers for the host tests of this crate and the crates above it (feature `testing`): memfds
//! standing in for a pool's file descriptor, descriptor counting, temporary directories, an
//! allocation counter (a test binary installs [`CountingAllocator`] as its global allocator for
//! [`allocated_by`]), and the mutations of a frame the codecs' fuzzers apply. They import nothing
//! from the crate, so that any module's tests can use them without an import cycle.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A name no other test (or test process) uses.
pub fn unique_name(tag: &str) -> String {
    format!(
        "mempool-ipc-test-{}-{}-{tag}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

/// A memfd named `name` holding `contents`: the stand-in for a pool's file descriptor.
pub fn memfd_with(name: &str, contents: &[u8]) -> OwnedFd {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut file = File::from(fd);
    file.write_all(contents).unwrap();
    OwnedFd::from(file)
}

/// Everything readable through `fd`, from the start.
pub fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut file = File::from(fd);
    file.seek(SeekFrom::Start(0)).unwrap();
    let mut out = Vec::new();
    file.read_to_end(&mut out).unwrap();
    out
}

/// How many descriptors of this process refer to the memfd named `name`. Other tests run in
/// parallel threads, so the tests count their own memfds by name, not all descriptors.
pub fn open_fds_named(name: &str) -> usize {
    let needle = format!("memfd:{name} ");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with(&format!("/{needle}")))
        .count()
}

/// Whether `fd` has `FD_CLOEXEC`.
pub fn is_cloexec(fd: impl AsFd) -> bool {
    rustix::io::fcntl_getfd(fd)
        .unwrap()
        .contains(rustix::io::FdFlags::CLOEXEC)
}

/// A fresh directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates a directory whose name starts with `tag`.
    pub fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }

    /// The path of `name` in the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test binary's allocator: the system's, counting the bytes each thread asks for, so that the
/// decoders' fuzz tests can bound what one frame makes them allocate ([`allocated_by`]).
///
/// A test binary that calls [`allocated_by`] installs it:
/// `#[global_allocator] static ALLOCATOR: CountingAllocator = CountingAllocator;`
#[derive(Debug)]
pub struct CountingAllocator;

thread_local! {
    /// Bytes this thread asked the allocator for since it started (growth only, for `realloc`).
    static ALLOCATED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_allocation(bytes: usize) {
    // A const-initialized thread-local without a destructor: reachable at any point of a thread's
    // life, and touching it allocates nothing.
    let _ = ALLOCATED.try_with(|a| a.set(a.get().saturating_add(bytes)));
}

// SAFETY: every method forwards its arguments unchanged to `System`, whose contract is the same
// (`GlobalAlloc`'s); counting touches only a thread-local integer and never allocates.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation(layout.size());
        // SAFETY: the caller's promises for `alloc` (a non-zero size) are `System.alloc`'s.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from this allocator, so from `System`, with `layout` (the caller's
        // promise).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        count_allocation(new_size.saturating_sub(layout.size()));
        // SAFETY: `ptr` came from this allocator, so from `System`, with `layout`, and `new_size` is
        // valid for it (the caller's promises, which are `System.realloc`'s).
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Runs `f` and returns its result with the bytes it asked the allocator for on this thread
/// (what a `realloc` grew counts, what was freed is not subtracted).
pub fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(std::cell::Cell::get);
    let out = f();
    (out, ALLOCATED.with(std::cell::Cell::get) - before)
}

/// One way to damage a frame, for the decoders' fuzz tests. The header fields are where both
/// protocols (the exporter's, `MPIP`, and the memory store's, `MPMS`) put them.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// XOR a byte.
    Flip(prop::sample::Index, u8),
    /// Cut the frame at a point.
    Truncate(prop::sample::Index),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Insert bytes at a point.
    Insert(prop::sample::Index, Vec<u8>),
    /// Remove up to 16 bytes from a point.
    Remove(prop::sample::Index, u8),
    /// Overwrite the header's body length (bytes 8 to 11).
    BodyLen(u32),
    /// Overwrite the header's message type (bytes 6 and 7).
    Type(u16),
    /// Overwrite the header's version (bytes 4 and 5).
    Version(u16),
}

/// Any [`Mutation`], weighted towards flipped bytes.
pub fn arb_mutation() -> impl Strategy<Value = Mutation> {
    let index = any::<prop::sample::Index>;
    let bytes = || proptest::collection::vec(any::<u8>(), 1..64);
    prop_oneof![
        4 => (index(), 1u8..).prop_map(|(at, xor)| Mutation::Flip(at, xor)),
        1 => index().prop_map(Mutation::Truncate),
        1 => bytes().prop_map(Mutation::Extend),
        1 => (index(), bytes()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        1 => (index(), 1u8..=16).prop_map(|(at, n)| Mutation::Remove(at, n)),
        1 => prop_oneof![any::<u32>(), 0u32..=2048, 60_000u32..=70_000].prop_map(Mutation::BodyLen),
        1 => prop_oneof![any::<u16>(), 0u16..=64].prop_map(Mutation::Type),
        1 => prop_oneof![any::<u16>(), 0u16..=4].prop_map(Mutation::Version),
    ]
}

/// Applies `m` to a frame's bytes.
pub fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    let put = |bytes: &mut Vec<u8>, at: usize, value: &[u8]| {
        if bytes.len() >= at + value.len() {
            bytes[at..at + value.len()].copy_from_slice(value);
        }
    };
    match m {
        Mutation::Flip(at, xor) if !bytes.is_empty() => {
            let i = at.index(bytes.len());
            bytes[i] ^= xor;
        }
        Mutation::Flip(..) => {}
        Mutation::Truncate(at) => bytes.truncate(at.index(bytes.len() + 1)),
        Mutation::Extend(more) => bytes.extend_from_slice(more),
        Mutation::Insert(at, more) => {
            let i = at.index(bytes.len() + 1);
            bytes.splice(i..i, more.iter().copied());
        }
        Mutation::Remove(at, n) => {
            let i = at.index(bytes.len() + 1);
            let end = (i + usize::from(*n)).min(bytes.len());
            bytes.drain(i..end);
        }
        Mutation::BodyLen(len) => put(bytes, 8, &len.to_le_bytes()),
        Mutation::Type(t) => put(bytes, 6, &t.to_le_bytes()),
        Mutation::Version(v) => put(bytes, 4, &v.to_le_bytes()),
    }
}
