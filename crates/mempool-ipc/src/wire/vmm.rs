//! VMM sharing: the `VmmBuffer` message's descriptor, layout and checks.
//!
//! The protocol's addition for VMM sharing: the `VmmBuffer` message (a version-2 frame) that
//! hands over one physical allocation (`cuMemCreate`) as a file descriptor, sent only to an
//! importer granted [`CAP_VMM`](super::messages::CAP_VMM) in the `Hello2`/`Welcome2` handshake.
//! [`codec`](super::codec) writes and reads its bytes with the constants below.
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
use super::ids::{BufferId, EventHandle};

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
