//! VMM sharing: the `VmmBuffer` and `VmmChunks` messages' descriptors, layouts and checks.
//!
//! The protocol's additions for VMM sharing: the `VmmBuffer` message (a version-2 frame) that
//! hands over one physical allocation (`cuMemCreate`) as a file descriptor, sent only to an
//! importer granted [`CAP_VMM`](super::messages::CAP_VMM) in the `Hello2`/`Welcome2` handshake;
//! and the `VmmChunks` message that hands over a range lying across several physical allocations
//! (the chunks of a growable reservation, each of its own size: a whole number of the message's
//! unit), one descriptor per chunk, sent only to an importer granted
//! [`CAP_VMM_CHUNKS`](super::messages::CAP_VMM_CHUNKS).
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

/// The length of a `VmmChunks` body before its sizes; the body is this plus 4 bytes per chunk.
///
/// ```text
/// VmmChunks body (120 + 4 * count bytes), `count` file descriptors attached (SCM_RIGHTS), chunk 0 first
/// offset  size       field
///      0     8       buffer id     u64, named by Release like any buffer
///      8     8       unit          u64, every chunk's size is a whole number of units: a non-zero
///                                  multiple of granularity
///     16     8       granularity   u64, the exporter's minimum granularity: a power of two
///     24     8       offset        u64, where the range starts in chunk 0: less than chunk 0's size
///     32     8       length        u64, the range's length: not 0; it ends in the last chunk
///     40     4       count         u32, how many chunks (and descriptors): 1 to 253
///     44     4       flags         u32, bit 0: the ready event is valid; other bits must be 0
///     48     4       handle type   u32, 1: a POSIX file descriptor
///     52     4       reserved      u32, 0
///     56    64       ready event   CUipcEventHandle, all zeros without flag bit 0
///    120     4*count sizes         u32 each, chunk i's size in units: not 0
/// ```
pub(crate) const VMM_CHUNKS_FIXED_LEN: usize = 5 * 8 + 4 * 4 + 64;

/// The longest `VmmChunks` body: [`MAX_VMM_CHUNKS`] sizes.
pub(crate) const VMM_CHUNKS_MAX_LEN: usize = VMM_CHUNKS_FIXED_LEN + 4 * MAX_VMM_CHUNKS;

/// A range over `sizes.len()` physical allocations (chunks) of `sizes[i] * unit` bytes each, which
/// the importer maps back to back; their file descriptors travel with the message, in order.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct VmmChunksDescriptor {
    /// The range's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// What every chunk's size is a whole number of: a non-zero multiple of `granularity`.
    pub(crate) unit: u64,
    /// The exporter's minimum granularity: a power of two. The importer refuses a value that is
    /// not its own device's.
    pub(crate) granularity: u64,
    /// Where the range starts in the first chunk: less than its size.
    pub(crate) offset: u64,
    /// The range's length: not 0, and the range ends in the last chunk (no chunk is sent that the
    /// range does not reach).
    pub(crate) len: u64,
    /// Each chunk's size in units, chunk 0 first: 1 to [`MAX_VMM_CHUNKS`] of them, none 0.
    pub(crate) sizes: Vec<u32>,
    /// The event to wait on before first use, recorded after the exporter's work on the range.
    /// `None`: the exporter synchronized before sending.
    pub(crate) ready_event: Option<EventHandle>,
}

impl VmmChunksDescriptor {
    /// How many chunks (and file descriptors).
    pub(crate) fn count(&self) -> usize {
        self.sizes.len()
    }

    /// Chunk `i`'s size in bytes (checked by [`check_vmm_chunks`] not to overflow).
    pub(crate) fn chunk_bytes(&self, i: usize) -> u64 {
        u64::from(self.sizes[i]).wrapping_mul(self.unit)
    }

    /// The bytes the chunks map, the sum of their sizes (checked by [`check_vmm_chunks`] to fit a
    /// `usize` and an `i64`).
    pub(crate) fn mapped_len(&self) -> u64 {
        (0..self.count()).fold(0u64, |sum, i| sum.wrapping_add(self.chunk_bytes(i)))
    }
}

/// The check of a `VmmChunks`' count, made by the decoder before it reads the sizes (its body must
/// hold exactly `count` of them) and by [`check_vmm_chunks`].
pub(crate) fn check_vmm_chunk_count(id: BufferId, count: usize) -> Result<()> {
    if count == 0 || count > MAX_VMM_CHUNKS {
        return Err(protocol(format!(
            "VmmChunks {id}: {count} chunks (allowed: 1 to {MAX_VMM_CHUNKS})"
        )));
    }
    Ok(())
}

/// The checks decoding (and encoding) makes on a `VmmChunks`: everything the importer relies on
/// before it maps anything.
pub(crate) fn check_vmm_chunks(c: &VmmChunksDescriptor) -> Result<()> {
    let id = c.buffer_id;
    let count = c.count();
    check_vmm_chunk_count(id, count)?;
    if c.granularity == 0 || !c.granularity.is_power_of_two() {
        return Err(protocol(format!(
            "VmmChunks {id}: granularity {} is not a power of two",
            c.granularity
        )));
    }
    if c.unit == 0 || !c.unit.is_multiple_of(c.granularity) {
        return Err(protocol(format!(
            "VmmChunks {id}: unit {} is not a non-zero multiple of the granularity {}",
            c.unit, c.granularity
        )));
    }
    if let Some(i) = c.sizes.iter().position(|&s| s == 0) {
        return Err(protocol(format!("VmmChunks {id}: chunk {i} has a size of 0 units")));
    }
    // At most 253 sizes below 2^32 times a unit below 2^64: the product fits 2^104, so u128 is exact.
    let units: u128 = c.sizes.iter().map(|&s| u128::from(s)).sum();
    let mapped = units
        .checked_mul(u128::from(c.unit))
        .and_then(|m| u64::try_from(m).ok())
        .filter(|&m| usize::try_from(m).is_ok() && m <= i64::MAX as u64)
        .ok_or_else(|| {
            protocol(format!(
                "VmmChunks {id}: {count} chunks of {units} units of {} bytes in all do not fit this machine's addresses",
                c.unit
            ))
        })?;
    // Every chunk is at most `mapped` bytes, so none of these overflows.
    let first = c.chunk_bytes(0);
    if c.offset >= first {
        return Err(protocol(format!(
            "VmmChunks {id}: offset {} is not inside the first chunk of {first} bytes",
            c.offset
        )));
    }
    if c.len == 0 {
        return Err(protocol(format!("VmmChunks {id}: length is 0")));
    }
    // `offset < first <= mapped` and `mapped` fits in 63 bits, so a length past `mapped` is refused
    // before anything overflows.
    let end = c
        .offset
        .checked_add(c.len)
        .filter(|&end| end <= mapped)
        .ok_or_else(|| {
            protocol(format!(
                "VmmChunks {id}: {} bytes at offset {} run past the {count} chunks of {mapped} bytes in all",
                c.len, c.offset
            ))
        })?;
    let last_start = mapped - c.chunk_bytes(count - 1);
    if end <= last_start {
        return Err(protocol(format!(
            "VmmChunks {id}: the range ends at byte {end}, before the last of its {count} chunks (which starts at byte {last_start})"
        )));
    }
    Ok(())
}
