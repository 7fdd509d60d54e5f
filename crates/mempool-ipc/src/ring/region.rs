//! The shared pages: a sealed memfd mapped in both processes, seen as 64-bit atomic words.
//!
//! The exporter creates the region ([`Region::create`]): a memfd of the geometry's length, sealed
//! against shrinking and growing (a peer that could shrink it would make this process fault on
//! its next access) and against further seals, with the header written. The importer receives the
//! descriptor and maps it ([`Region::open`]) after checking the seals, the length and the header.
//! Each side reads the geometry once, when it creates or maps the region, and never again: the
//! header stays in the shared pages, where the other process can overwrite it, but nobody reads it
//! after that.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};

use super::error::{RingError, RingResult};
use super::layout::{Geometry, LAYOUT_VERSION, MAGIC};
use super::sync::{AtomicU32, AtomicU64, Ordering};

/// A word of the mapping: always std's atomic (it lives in the shared pages), whatever `super::sync`
/// hands the rings.
type MappedWord = std::sync::atomic::AtomicU64;

/// The seals every ring region carries.
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// A ring region mapped into this process.
pub struct Region {
    /// The mapping: `len_words` words, page-aligned, shared with the peer.
    words: NonNull<MappedWord>,
    len_words: usize,
    geometry: Geometry,
    fd: OwnedFd,
    /// Under `cfg(loom)`, the words the rings use instead of the mapping's: loom's atomics live in the
    /// model, not in shared pages. The mapping and the memfd stay (for `fd` and the header checks).
    #[cfg(loom)]
    model: Model,
}

/// The model's words and flags, as many as the mapping has (a flag word is only ever used as a flag).
#[cfg(loom)]
struct Model {
    words: Box<[AtomicU64]>,
    flags: Box<[AtomicU32]>,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics; the pointer is owned
// by the region and unmapped only in its drop.
#[allow(unsafe_code)]
unsafe impl Send for Region {}
// SAFETY: as above: every access through `&Region` is an atomic operation on a word.
#[allow(unsafe_code)]
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("geometry", &self.geometry)
            .field("bytes", &(self.len_words * 8))
            .finish()
    }
}

impl Region {
    /// A fresh region of `geometry`: a sealed memfd, mapped, its header written and every other
    /// word zero.
    pub fn create(geometry: Geometry) -> RingResult<Region> {
        let fd = rustix::fs::memfd_create("mempool-ipc-ring", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| RingError::io("memfd_create", e))?;
        let bytes = geometry.region_bytes();
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(|e| RingError::io("ftruncate of the ring memfd", e))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| RingError::io("sealing the ring memfd", e))?;
        let region = Region::map(fd, geometry)?;
        region.word(0).store(MAGIC, Ordering::Relaxed);
        region.word(1).store(LAYOUT_VERSION, Ordering::Relaxed);
        region.word(2).store(u64::from(geometry.capacity()), Ordering::Relaxed);
        region
            .word(3)
            .store(u64::from(geometry.slot_bytes()), Ordering::Relaxed);
        region.word(4).store(bytes as u64, Ordering::Release);
        Ok(region)
    }

    /// Maps a region received from the peer, after checking that its memfd is sealed against
    /// shrinking, growing and further seals, that its header is a ring header of a geometry
    /// within the limits, and that its length is that geometry's.
    pub fn open(fd: OwnedFd) -> RingResult<Region> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| bad(format!("no seals to read ({e})")))?;
        if !seals.contains(SEALS) {
            return Err(bad(format!(
                "the memfd is not sealed against shrinking, growing and new seals (seals {seals:?})"
            )));
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| RingError::io("fstat of the ring memfd", e))?;
        let size = u64::try_from(stat.st_size).map_err(|_| bad(format!("negative size {}", stat.st_size)))?;
        if !(4096..=1 << 30).contains(&size) {
            return Err(bad(format!("{size} bytes is no ring region's length")));
        }
        // Read the header through a one-page mapping first: the geometry decides the full length.
        let header = Region::map_words(&fd, 4096)?;
        let words: Vec<u64> = (0..5).map(|i| header.load(i)).collect();
        drop(header);
        if words[0] != MAGIC {
            return Err(bad(format!("magic {:#018x}, expected {MAGIC:#018x}", words[0])));
        }
        if words[1] != LAYOUT_VERSION {
            return Err(bad(format!(
                "layout version {}, this process speaks {LAYOUT_VERSION}",
                words[1]
            )));
        }
        let capacity = u32::try_from(words[2]).map_err(|_| bad(format!("capacity {}", words[2])))?;
        let slot_bytes = u32::try_from(words[3]).map_err(|_| bad(format!("slot size {}", words[3])))?;
        let geometry = Geometry::new(capacity, slot_bytes).map_err(|e| bad(e.to_string()))?;
        if words[4] != geometry.region_bytes() as u64 || size != words[4] {
            return Err(bad(format!(
                "length {} in the header and {size} in the memfd, where the geometry needs {}",
                words[4],
                geometry.region_bytes()
            )));
        }
        Region::map(fd, geometry)
    }

    fn map(fd: OwnedFd, geometry: Geometry) -> RingResult<Region> {
        let bytes = geometry.region_bytes();
        let raw = Region::map_words(&fd, bytes)?;
        let region = Region {
            words: raw.ptr,
            len_words: raw.len_words,
            geometry,
            fd,
            #[cfg(loom)]
            model: Model {
                words: (0..raw.len_words).map(|_| AtomicU64::new(0)).collect(),
                flags: (0..raw.len_words).map(|_| AtomicU32::new(0)).collect(),
            },
        };
        std::mem::forget(raw); // the region unmaps it now
        Ok(region)
    }

    fn map_words(fd: &OwnedFd, bytes: usize) -> RingResult<RawMap> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of `bytes` bytes of the memfd at an address the kernel
        // picks; nothing else in this process refers to that range. The memfd is sealed against
        // shrinking (checked or set by the callers), so no access within `bytes` can fault.
        #[allow(unsafe_code)]
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(RingError::io("mmap of the ring memfd", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<MappedWord>())
            .ok_or_else(|| RingError::io("mmap of the ring memfd", std::io::Error::other("null mapping")))?;
        Ok(RawMap {
            ptr,
            len_words: bytes / 8,
        })
    }

    /// The region's shape.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The memfd, to pass to the peer (`SCM_RIGHTS`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Word `i` of the region. Panics if `i` is outside it (indices come from the geometry, never
    /// from the shared words).
    #[cfg(not(loom))]
    pub(crate) fn word(&self, i: usize) -> &AtomicU64 {
        assert!(
            i < self.len_words,
            "ring word {i} outside the region's {} words",
            self.len_words
        );
        // SAFETY: `i` is inside the mapping (checked above), which lives as long as `self`; the
        // word is 8-byte aligned (the mapping is page-aligned) and only ever accessed atomically.
        #[allow(unsafe_code)]
        unsafe {
            &*self.words.as_ptr().add(i)
        }
    }

    /// The 32-bit flag at the start of word `i` (the waiting flags, which are also futex words).
    /// Panics if `i` is outside the region.
    #[cfg(not(loom))]
    pub(crate) fn flag(&self, i: usize) -> &AtomicU32 {
        assert!(
            i < self.len_words,
            "ring word {i} outside the region's {} words",
            self.len_words
        );
        // SAFETY: `i` is inside the mapping (checked above), which lives as long as `self`; the
        // word's first 4 bytes are 4-byte aligned, and a flag word is only ever accessed as this
        // `AtomicU32` (never as an `AtomicU64`).
        #[allow(unsafe_code)]
        unsafe {
            &*self.words.as_ptr().add(i).cast::<AtomicU32>()
        }
    }

    /// Word `i` of the model (under loom). Panics if `i` is outside the region.
    #[cfg(loom)]
    pub(crate) fn word(&self, i: usize) -> &AtomicU64 {
        &self.model.words[i]
    }

    /// Flag `i` of the model (under loom). Panics if `i` is outside the region.
    #[cfg(loom)]
    pub(crate) fn flag(&self, i: usize) -> &AtomicU32 {
        &self.model.flags[i]
    }

    /// Writes word `i` as the peer would: for the tests of hostile peers.
    #[cfg(test)]
    pub(crate) fn scribble(&self, i: usize, value: u64) {
        self.word(i).store(value, Ordering::SeqCst);
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        drop(RawMap {
            ptr: self.words,
            len_words: self.len_words,
        });
    }
}

/// A mapping that unmaps itself.
struct RawMap {
    ptr: NonNull<MappedWord>,
    len_words: usize,
}

impl RawMap {
    fn load(&self, i: usize) -> u64 {
        assert!(i < self.len_words);
        // SAFETY: `i` is inside the mapping (checked above), aligned, accessed atomically only.
        #[allow(unsafe_code)]
        let word = unsafe { &*self.ptr.as_ptr().add(i) };
        word.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for RawMap {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `map_words` with this length and is unmapped once,
        // here; no reference into it outlives its owner.
        #[allow(unsafe_code)]
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len_words * 8);
        }
    }
}

fn bad(reason: String) -> RingError {
    RingError::BadRegion { reason }
}
