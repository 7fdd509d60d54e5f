//! Ranges over several VMM physical allocations on the importer's side: [`SharedVmmRange`], and
//! receiving one (import every chunk's descriptor, reserve one range of this process's own
//! addresses, map the chunks back to back in order, grant this device access to all of them).

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use mempool_core::{
    Access, AllocationProps, BufferView, DeviceAddr, Granularity, HandleTypes, Mapping, PhysicalAllocation,
    Reservation, StreamRef,
};

use super::vmm::VmmHost;
use crate::error::{record_drop_error, Error, Result};
use crate::wire::{BufferId, ProtocolError, VmmChunksDescriptor};

/// A range of the exporter's memory that lies across several VMM physical allocations of one size
/// (the chunks of a growable reservation, such as a service resource's), received with
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
    host: Arc<dyn VmmHost>,
    id: BufferId,
    /// Empty once released.
    mappings: Vec<Mapping>,
    reservation: Arc<Reservation>,
    chunk_size: usize,
    offset: usize,
    len: usize,
}

impl fmt::Debug for SharedVmmRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedVmmRange")
            .field("id", &self.id)
            .field("ptr", &self.ptr())
            .field("len", &self.len)
            .field("chunks", &self.mappings.len())
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

impl SharedVmmRange {
    /// The exporter's id of the range.
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The range's first address in this process.
    pub fn ptr(&self) -> DeviceAddr {
        self.reservation.base().offset(self.offset)
    }

    /// The range's length in bytes, as the exporter shared it.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a shared range has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How many chunks are mapped.
    pub fn chunks(&self) -> usize {
        self.mappings.len()
    }

    /// Each chunk's size.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// Where the range starts in the first chunk (and in the reservation).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The reservation the chunks are mapped into, from its base: the first chunk starts there.
    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }

    /// A view of the range's bytes for host copies and fills ordered on `stream` (a stream of the
    /// importer's device); it borrows `self`, so it cannot outlive the mappings.
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        let ctx = self.host.device().context()?;
        // SAFETY: 1. `ptr..ptr+len` lies in the chunks mapped back to back from the reservation's base
        // (`receive` mapped `count` chunks and the decoder checked `offset + len <= count * chunk_size`),
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
    pub fn release(mut self) -> Result<()> {
        self.release_once()
    }

    fn release_once(&mut self) -> Result<()> {
        if self.mappings.is_empty() {
            return Ok(());
        }
        // Unmapping waits for the device too, but reports failures only as drop errors: wait
        // here first so that `release` returns them.
        let synced = self.host.synchronize();
        // Each drop unmaps its chunk and releases this process's handle of it.
        self.mappings.clear();
        self.host.forget(self.id);
        synced?;
        match self.host.send_release(self.id) {
            Ok(()) => Ok(()),
            // The exporter is gone (or said Goodbye and closed): nobody to tell.
            Err(Error::Closed | Error::ConnectionFailed | Error::WriteClosed) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for SharedVmmRange {
    fn drop(&mut self) {
        if let Err(e) = self.release_once() {
            record_drop_error(e);
        }
    }
}

/// Imports each chunk `d` names from `fds` (in order), maps them back to back into one reservation
/// of this process, grants the importer's device read-write access to all of it and makes `stream`
/// wait on the exporter's event. On failure the range is not held: `Release` is sent at once
/// (except for a buffer id already held, which ends the connection instead: releasing it would
/// release the other).
pub(super) fn receive(
    host: Arc<dyn VmmHost>,
    d: VmmChunksDescriptor,
    fds: Vec<OwnedFd>,
    stream: StreamRef<'_>,
) -> Result<SharedVmmRange> {
    let id = d.buffer_id;
    if !host.hold(id) {
        let err = ProtocolError::Violation {
            reason: format!("VmmChunks {id}: this importer already holds a buffer with that id"),
        };
        return Err(host.reject(err.into()));
    }
    let mapped = (|| -> Result<(Arc<Reservation>, Vec<Mapping>)> {
        let violation = |reason: String| -> Error { ProtocolError::Violation { reason }.into() };
        // The connection counted the descriptors against the body; a mismatch here is a bug, not
        // the peer's word, but nothing is mapped on it either way.
        if fds.len() != d.count as usize {
            return Err(Error::DescriptorCount {
                expected: d.count as usize,
                got: fds.len(),
            });
        }
        let device = host.device();
        let props = AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
        let granularity = device.vmm_granularity(&props, Granularity::Minimum)?;
        if d.granularity != granularity as u64 {
            return Err(violation(format!(
                "VmmChunks {id}: granularity {} is not the minimum granularity of this GPU, {granularity} bytes",
                d.granularity
            )));
        }
        // The decoder checked: chunk_size a non-zero multiple of the granularity, count * chunk_size
        // fits a usize, offset + len inside the chunks, the last chunk reached.
        let chunk = d.chunk_size as usize;
        let reservation = Reservation::new(device, d.mapped_len() as usize, 0, None)?;
        let mut mappings = Vec::with_capacity(fds.len());
        for (i, fd) in fds.into_iter().enumerate() {
            let physical = PhysicalAllocation::import_fd(fd.as_fd(), chunk)?;
            drop(fd); // imported: the handle holds the memory now
            if physical.device() != device {
                return Err(violation(format!(
                    "VmmChunks {id}: chunk {i} lives on device {}, not on this importer's device {}",
                    physical.device().ordinal(),
                    device.ordinal()
                )));
            }
            // On error the mappings made so far are dropped: unmapped, handles released.
            mappings.push(Mapping::without_access(&reservation, i * chunk, Arc::new(physical))?);
        }
        reservation.set_access(0, d.mapped_len() as usize, &[(device, Access::ReadWrite)])?;
        if let Some(handle) = d.ready_event {
            host.wait_event(&handle, stream)?;
        }
        Ok((reservation, mappings))
    })();
    match mapped {
        Ok((reservation, mappings)) => Ok(SharedVmmRange {
            host,
            id,
            mappings,
            reservation,
            chunk_size: d.chunk_size as usize,
            offset: d.offset as usize,
            len: d.len as usize,
        }),
        Err(e) => {
            host.forget(id);
            // Not held: tell the exporter so it does not wait for this range.
            let _ = host.send_release(id);
            Err(e)
        }
    }
}
