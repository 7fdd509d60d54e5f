//! Ranges over several VMM physical allocations on the importer's side: [`SharedVmmRange`], and
//! receiving one (import every chunk's descriptor with its size, reserve one range of this process's
//! own addresses, map the chunks back to back in order, each at the sum of the sizes before it, grant
//! this device access to all of them at once).

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use mempool_core::{Access, BufferView, DeviceAddr, Mapping, PhysicalAllocation, Reservation, StreamRef};

use super::vmm::{check_granularity, hold, Held, VmmHost};
use crate::error::{Error, Result};
use crate::protocol::{BufferId, ProtocolError, VmmChunksDescriptor};

/// A range of the exporter's memory that lies across several VMM physical allocations, each of its
/// own size (the chunks of a growable reservation, such as a service resource's mappings of 1 to 32
/// of its chunks), received with
/// [`Importer::recv_any`](crate::Importer::recv_any) from
/// [`Exporter::share_vmm_chunks`](crate::Exporter::share_vmm_chunks). The chunks are mapped back
/// to back into one reservation of this process with read-write access for the importer's device;
/// the range starts [`offset`](Self::offset) bytes into the first.
///
/// The memory is the exporter's: both processes see the same bytes. Work queued on the stream
/// given to `recv_any` runs after the exporter's work on it. Dropping it waits for the device
/// (unmapping is not stream-ordered), unmaps every chunk, releases this process's handles and the
/// reservation, and only then sends `Release`; the exporter lets go of the range (its owner may
/// then, for example, put the memory to sleep). After the exporter is gone, dropping it still
/// unmaps and releases; the release then has nowhere to go and is skipped.
pub struct SharedVmmRange {
    /// The reservation and the chunks' mappings in it, in order.
    held: Held<(Arc<Reservation>, Vec<Mapping>)>,
    /// Each chunk's size in bytes, in mapping order.
    chunk_sizes: Vec<usize>,
    offset: usize,
    len: usize,
}

impl fmt::Debug for SharedVmmRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedVmmRange")
            .field("id", &self.held.id())
            .field("ptr", &self.ptr())
            .field("len", &self.len)
            .field("chunk_sizes", &self.chunk_sizes)
            .finish()
    }
}

impl SharedVmmRange {
    /// The exporter's id of the range.
    pub fn id(&self) -> BufferId {
        self.held.id()
    }

    /// The range's first address in this process.
    pub fn ptr(&self) -> DeviceAddr {
        self.reservation().base().offset(self.offset)
    }

    /// The range's length in bytes, as the exporter shared it.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a shared range has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How many chunks (physical allocations) the range lies across.
    pub fn chunks(&self) -> usize {
        self.chunk_sizes.len()
    }

    /// Each chunk's size in bytes, in address order: chunk `i` is mapped at the sum of the sizes
    /// before it from the reservation's base. Every size is a multiple of the device's minimum VMM
    /// granularity; they need not be equal.
    pub fn chunk_sizes(&self) -> &[usize] {
        &self.chunk_sizes
    }

    /// Where the range starts in the first chunk (and in the reservation).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The reservation the chunks are mapped into, from its base, back to back: the first chunk
    /// starts there, and the reservation is exactly as long as the chunks' sizes together.
    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.held.mapped().0
    }

    /// A view of the range's bytes for host copies and fills ordered on `stream` (a stream of the
    /// importer's device); it borrows `self`, so it cannot outlive the mappings.
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        let ctx = self.held.host().device().context()?;
        // SAFETY: 1. `ptr..ptr+len` lies in the chunks mapped back to back from the reservation's base
        // (`receive` mapped every chunk, of the sizes the message gave, and the decoder checked
        // `offset + len` <= the sum of those sizes),
        // with read-write access for the importer's device, which owns every chunk (checked on import);
        // they stay mapped while `self` lives, which the view borrows, and no safe call lowers the access.
        // Dropping a view frees nothing. 2. the maps and the access grant are synchronous, and the
        // stream given to `recv_any` waited on the exporter's event; a caller on another stream orders
        // it after that one (documented on `recv_any`). 3. a stream without a context is taken as one
        // of the importer's device. 4. the address is not null (a reservation's base never is).
        #[allow(unsafe_code)]
        Ok(unsafe { BufferView::new(self.ptr(), self.len, stream, ctx) })
    }

    /// Releases the range (what dropping does), reporting errors instead of recording them.
    pub fn release(self) -> Result<()> {
        self.held.release()
    }
}

/// Imports each chunk `d` names from `fds` (in order, with the size `d` gives it), maps them back to
/// back into one reservation of this process (chunk `i` at the sum of the sizes before it), grants
/// the importer's device read-write access to all of it at once and makes `stream` wait on the
/// exporter's event. On any failure what was mapped is unmapped, every handle and descriptor
/// released, and the range is not held ([`hold`](super::vmm::hold)).
pub(super) fn receive(
    host: Arc<dyn VmmHost>,
    d: VmmChunksDescriptor,
    fds: Vec<OwnedFd>,
    stream: StreamRef<'_>,
) -> Result<SharedVmmRange> {
    let id = d.buffer_id;
    let held = hold(host, "VmmChunks", id, |host| {
        let violation = |reason: String| -> Error { ProtocolError::Violation { reason }.into() };
        // The connection counted the descriptors against the body; a mismatch here is a bug, not
        // the peer's word, but nothing is mapped on it either way.
        if fds.len() != d.count() {
            return Err(Error::DescriptorCount {
                expected: d.count(),
                got: fds.len(),
            });
        }
        let device = check_granularity(host, d.granularity, format_args!("VmmChunks {id}"))?;
        // The decoder checked: the unit a non-zero multiple of the granularity (so is every size), no
        // size 0, their sum fits a usize, offset + len inside the chunks, the last chunk reached.
        let reservation = Reservation::new(device, d.mapped_len() as usize, 0, None)?;
        let mut mappings = Vec::with_capacity(fds.len());
        let mut at = 0usize;
        for (i, fd) in fds.into_iter().enumerate() {
            let size = d.chunk_bytes(i) as usize;
            let physical = PhysicalAllocation::import_fd(fd.as_fd(), size)?;
            drop(fd); // imported: the handle holds the memory now
            if physical.device() != device {
                return Err(violation(format!(
                    "VmmChunks {id}: chunk {i} lives on device {}, not on this importer's device {}",
                    physical.device().ordinal(),
                    device.ordinal()
                )));
            }
            // On error the mappings made so far are dropped: unmapped, handles released.
            mappings.push(Mapping::without_access(&reservation, at, Arc::new(physical))?);
            at += size;
        }
        reservation.set_access(0, d.mapped_len() as usize, &[(device, Access::ReadWrite)])?;
        if let Some(handle) = d.ready_event {
            host.wait_event(&handle, stream)?;
        }
        Ok((reservation, mappings))
    })?;
    Ok(SharedVmmRange {
        held,
        chunk_sizes: (0..d.count()).map(|i| d.chunk_bytes(i) as usize).collect(),
        offset: d.offset as usize,
        len: d.len as usize,
    })
}
