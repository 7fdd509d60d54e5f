//! VMM sharing: the `VmmBuffer` and `VmmChunks` messages' descriptors, layouts and checks.
//!
//! The protocol's additions for VMM sharing: the `VmmBuffer` message (a version-2 frame) that
//! hands over one physical allocation (`cuMemCreate`) as a file descriptor, sent only to an
//! importer granted [`CAP_VMM`](super::messages::CAP_VMM) in the `Hello2`/`Welcome2` handshake;
//! and the `VmmChunks` message that hands over a range lying across several physical allocations
//! of one size (the chunks of a growable reservation), one descriptor per chunk, sent only to an
//! importer granted [`CAP_VMM_CHUNKS`](super::messages::CAP_VMM_CHUNKS).
//! [`codec`](super::codec) writes and reads their bytes with the constants below.
//!
//! ```text
//! VmmBuffer body (96 bytes), one file descriptor attached (SCM_RIGHTS)
//! offset  size  field
//!      0     8  buffer id     u64, named by Release like any buffer
//!      8     8  size          u64, the allocation's size: a non-zero multiple of granularity
//!     16     8  granularity   u64, the exporter's minimum granularity: a power of two
//!     24     4  flags         u32, bit 0: the ready event is valid; other bits must be 0
//!     28     4  handle type   u32, 1: a POSIX file descriptor
//!     32    64  ready event   CUipcEventHandle, all zeros without flag bit 0
//! ```

use super::error::{protocol, Result};
use super::ids::{BufferId, EventHandle, MAX_VMM_CHUNKS};

/// The handle-type field's value for a POSIX file descriptor
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
pub(crate) const VMM_HANDLE_TYPE_POSIX_FD: u32 = 1;

/// Bit 0 of a `VmmBuffer`'s flags: the event handle is valid and the importer must wait on it.
pub(crate) const VMM_FLAG_READY_EVENT: u32 = 1;

/// The body length of a `VmmBuffer` message.
pub(crate) const VMM_BUFFER_LEN: usize = 3 * 8 + 4 + 4 + 64;

/// A physical allocation handed to an importer; its file descriptor travels with the message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct VmmBufferDescriptor {
    /// The buffer's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// The allocation's size in bytes: a non-zero multiple of `granularity`.
    pub(crate) size: u64,
    /// The exporter's minimum granularity for the allocation's properties: a power of two. The
    /// importer refuses a value that is not its own device's.
    pub(crate) granularity: u64,
    /// The event to wait on before first use, recorded after the exporter's work on the memory.
    /// `None`: the exporter synchronized before sending.
    pub(crate) ready_event: Option<EventHandle>,
}

/// The checks decoding (and encoding) makes on a `VmmBuffer`.
pub(crate) fn check_vmm_buffer(b: &VmmBufferDescriptor) -> Result<()> {
    let id = b.buffer_id;
    if b.granularity == 0 || !b.granularity.is_power_of_two() {
        return Err(protocol(format!(
            "VmmBuffer {id}: granularity {} is not a power of two",
            b.granularity
        )));
    }
    if b.size == 0 {
        return Err(protocol(format!("VmmBuffer {id}: size is 0")));
    }
    if !b.size.is_multiple_of(b.granularity) {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} is not a multiple of the granularity {}",
            b.size, b.granularity
        )));
    }
    if usize::try_from(b.size).is_err() {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} does not fit this machine's addresses",
            b.size
        )));
    }
    Ok(())
}

/// The body length of a `VmmChunks` message.
///
/// ```text
/// VmmChunks body (120 bytes), `count` file descriptors attached (SCM_RIGHTS), chunk 0 first
/// offset  size  field
///      0     8  buffer id     u64, named by Release like any buffer
///      8     8  chunk size    u64, every chunk's size: a non-zero multiple of granularity
///     16     8  granularity   u64, the exporter's minimum granularity: a power of two
///     24     8  offset        u64, where the range starts in chunk 0: less than the chunk size
///     32     8  length        u64, the range's length: not 0; it ends in the last chunk
///     40     4  count         u32, how many chunks (and descriptors): 1 to 253
///     44     4  flags         u32, bit 0: the ready event is valid; other bits must be 0
///     48     4  handle type   u32, 1: a POSIX file descriptor
///     52     4  reserved      u32, 0
///     56    64  ready event   CUipcEventHandle, all zeros without flag bit 0
/// ```
pub(crate) const VMM_CHUNKS_LEN: usize = 5 * 8 + 4 * 4 + 64;

/// A range over `count` physical allocations of `chunk_size` bytes each, which the importer maps
/// back to back; their file descriptors travel with the message, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct VmmChunksDescriptor {
    /// The range's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// Every chunk's size: a non-zero multiple of `granularity`.
    pub(crate) chunk_size: u64,
    /// The exporter's minimum granularity: a power of two. The importer refuses a value that is
    /// not its own device's.
    pub(crate) granularity: u64,
    /// Where the range starts in the first chunk: less than `chunk_size`.
    pub(crate) offset: u64,
    /// The range's length: not 0, and the range ends in the last chunk (no chunk is sent that the
    /// range does not reach).
    pub(crate) len: u64,
    /// How many chunks: 1 to [`MAX_VMM_CHUNKS`].
    pub(crate) count: u32,
    /// The event to wait on before first use, recorded after the exporter's work on the range.
    /// `None`: the exporter synchronized before sending.
    pub(crate) ready_event: Option<EventHandle>,
}

impl VmmChunksDescriptor {
    /// The bytes the chunks map, `count * chunk_size` (checked by [`check_vmm_chunks`] to fit a
    /// `usize`).
    pub(crate) fn mapped_len(&self) -> u64 {
        self.count as u64 * self.chunk_size
    }
}

/// The checks decoding (and encoding) makes on a `VmmChunks`: everything the importer relies on
/// before it maps anything.
pub(crate) fn check_vmm_chunks(c: &VmmChunksDescriptor) -> Result<()> {
    let id = c.buffer_id;
    if c.count == 0 || c.count as usize > MAX_VMM_CHUNKS {
        return Err(protocol(format!(
            "VmmChunks {id}: {} chunks (allowed: 1 to {MAX_VMM_CHUNKS})",
            c.count
        )));
    }
    if c.granularity == 0 || !c.granularity.is_power_of_two() {
        return Err(protocol(format!(
            "VmmChunks {id}: granularity {} is not a power of two",
            c.granularity
        )));
    }
    if c.chunk_size == 0 || !c.chunk_size.is_multiple_of(c.granularity) {
        return Err(protocol(format!(
            "VmmChunks {id}: chunk size {} is not a non-zero multiple of the granularity {}",
            c.chunk_size, c.granularity
        )));
    }
    let mapped = (c.count as u64)
        .checked_mul(c.chunk_size)
        .filter(|&m| usize::try_from(m).is_ok() && m <= i64::MAX as u64)
        .ok_or_else(|| {
            protocol(format!(
                "VmmChunks {id}: {} chunks of {} bytes do not fit this machine's addresses",
                c.count, c.chunk_size
            ))
        })?;
    if c.offset >= c.chunk_size {
        return Err(protocol(format!(
            "VmmChunks {id}: offset {} is not inside the first chunk of {} bytes",
            c.offset, c.chunk_size
        )));
    }
    if c.len == 0 {
        return Err(protocol(format!("VmmChunks {id}: length is 0")));
    }
    // `offset < chunk_size` and `mapped` fits in 63 bits, so a length past `mapped` is refused
    // before anything overflows.
    let end = c
        .offset
        .checked_add(c.len)
        .filter(|&end| end <= mapped)
        .ok_or_else(|| {
            protocol(format!(
                "VmmChunks {id}: {} bytes at offset {} run past the {} chunks of {} bytes",
                c.len, c.offset, c.count, c.chunk_size
            ))
        })?;
    if end <= mapped - c.chunk_size {
        return Err(protocol(format!(
            "VmmChunks {id}: the range ends at byte {end}, before the last of its {} chunks of {} bytes",
            c.count, c.chunk_size
        )));
    }
    Ok(())
}
