//! VMM physical allocations on the exporter's side: [`ExportedVmm`], made by
//! [`alloc_vmm`] (`cuMemCreate` with the POSIX file-descriptor handle type, mapped here for the
//! exporter's own use) and sent by [`share_vmm`] as a `VmmBuffer` message with the allocation's
//! descriptor. They live in the same lease table as pool buffers: released, reclaimed from dead
//! importers and abandoned at shutdown by the same rules.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use mempool_core::{
    round_up, AllocationProps, BufferView, Granularity, HandleTypes, Mapping, PhysicalAllocation, Reservation,
    StreamRef,
};

use super::buffers::{self, ExportedBuffer};
use super::state::{FreeFn, Freer, Inner, State};
use crate::error::{Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{BufferId, Message, VmmBufferDescriptor, CAP_VMM};
use crate::reactor::Reactor;

/// A VMM physical allocation the exporter can share with importers that accepted VMM sharing,
/// mapped in the exporter with read-write access for its device. Made by
/// [`Exporter::alloc_vmm`](crate::Exporter::alloc_vmm), shared by
/// [`Exporter::share_vmm`](crate::Exporter::share_vmm).
///
/// It dereferences to the mapped range ([`BufferView`]: address, size, host copies and fills),
/// ordered on the stream it was allocated with. Dropping it is the exporter's own release, as for
/// an [`ExportedBuffer`]: the exporter unmaps it and releases its handle (`cuMemUnmap`,
/// `cuMemRelease`, after a synchronize of the stream it is freed on) once every importer has
/// released it, said `Goodbye`, or died and its process is gone.
pub struct ExportedVmm<'s> {
    buffer: ExportedBuffer<'s>,
    physical: Arc<PhysicalAllocation>,
    granularity: usize,
}

impl fmt::Debug for ExportedVmm<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedVmm")
            .field("buffer", &self.buffer)
            .field("granularity", &self.granularity)
            .finish()
    }
}

impl<'s> std::ops::Deref for ExportedVmm<'s> {
    type Target = BufferView<'s>;

    /// The mapped range in the exporter: address, size, stream, context, host copies and fills.
    fn deref(&self) -> &BufferView<'s> {
        &self.buffer
    }
}

impl ExportedVmm<'_> {
    /// The buffer's id (what importers release).
    pub fn id(&self) -> BufferId {
        self.buffer.id()
    }

    /// The physical allocation (its size is a multiple of [`granularity`](Self::granularity)).
    pub fn physical(&self) -> &Arc<PhysicalAllocation> {
        &self.physical
    }

    /// The minimum granularity the size was rounded up to.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The importers holding it now, in id order.
    pub fn holders(&self) -> Vec<ImporterId> {
        self.buffer.holders()
    }

    /// Waits until no importer holds it (see [`ExportedBuffer::wait_released`]).
    pub fn wait_released(&self, timeout: Duration) -> Result<()> {
        self.buffer.wait_released(timeout)
    }

    /// Lets go of it (what dropping does) and reports errors instead of recording them.
    pub fn release(self) -> Result<()> {
        self.buffer.release()
    }
}

/// [`Exporter::alloc_vmm`](crate::Exporter::alloc_vmm).
pub(super) fn alloc_vmm<'s>(inner: &Arc<Inner>, bytes: usize, stream: StreamRef<'s>) -> Result<ExportedVmm<'s>> {
    if bytes == 0 {
        return Err(mempool_core::Error::InvalidArgument("a shared VMM allocation cannot be empty".into()).into());
    }
    let device = inner.source.pool().device();
    let props = AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let granularity = device.vmm_granularity(&props, Granularity::Minimum)?;
    let size = round_up(bytes, granularity).ok_or_else(|| {
        mempool_core::Error::InvalidArgument(format!(
            "{bytes} bytes rounded up to the granularity of {granularity} bytes overflow"
        ))
    })?;
    let physical = Arc::new(PhysicalAllocation::new(&props, size)?);
    let reservation = Reservation::new(device, size, 0, None)?;
    let mapping = Mapping::new(&reservation, 0, physical.clone())?;
    let addr = mapping.addr();
    // Called once, when the last holder let go: the owner's last use is ordered before `stream`
    // (`finish` makes it wait), importers synchronized before releasing or are gone.
    let free: FreeFn = Box::new(move |_, _, stream| {
        let synced = stream.synchronize();
        drop(mapping); // waits for the device, unmaps, releases the handle and the reservation
        synced.map_err(Error::from)
    });
    let state = inner.lock();
    // SAFETY: (1) `addr..addr+size` is the mapping just made in a fresh reservation of the exporter's
    // device, with read-write access, and nothing else holds it; (2) `free` drops that mapping (and
    // nothing else); (3) nothing was queued on it yet, so any stream orders the work on it.
    #[allow(unsafe_code)]
    let buffer = unsafe { buffers::register(inner, state, addr, size, addr.as_raw(), Freer::Custom(free), stream) }?;
    Ok(ExportedVmm {
        buffer,
        physical,
        granularity,
    })
}

/// [`Exporter::share_vmm`](crate::Exporter::share_vmm).
pub(super) fn share_vmm(inner: &Inner, vmm: &ExportedVmm<'_>, to: &[ImporterId]) -> Result<()> {
    if to.is_empty() {
        return Ok(());
    }
    let reactor = inner.reactor()?;
    check_granted(&inner.lock(), to, CAP_VMM)?;
    let id = vmm.id();
    let fd = vmm.physical.export_fd()?;
    let event = inner.take_event()?;
    event.event.record(vmm.stream())?;
    let handle = event.handle;
    let mut state = inner.lock();
    // Checked again: an importer may have gone meanwhile.
    if let Err(e) = check_granted(&state, to, CAP_VMM).and_then(|()| state.grant_all(id, to)) {
        state.idle_events.push(event);
        return Err(e);
    }
    if let Some(shared) = state.leases.get_mut(id) {
        shared.events.push(event);
    }
    drop(state);

    let message = Message::VmmBuffer(VmmBufferDescriptor {
        buffer_id: id,
        size: vmm.physical.size() as u64,
        granularity: vmm.granularity as u64,
        ready_event: Some(handle),
    });
    // The owner still holds the buffer, so revoking frees nothing.
    let first_error = send_to_each(inner, reactor, &message, id, &[fd], to);
    inner.notify_all_waiters();
    first_error.map_or(Ok(()), Err)
}

/// Whether every importer of `to` is connected and was granted `capability` in its handshake
/// (`Hello2`/`Welcome2`; a version-1 importer never is): [`CAP_VMM`] (bit 1) for a VMM allocation,
/// [`CAP_VMM_CHUNKS`](crate::protocol::CAP_VMM_CHUNKS) (bit 2) for a range over several.
pub(super) fn check_granted(state: &State, to: &[ImporterId], capability: u64) -> Result<()> {
    for importer in to {
        match state.importers.get(importer) {
            None => return Err(Error::UnknownImporter { importer: *importer }),
            Some(peer) if peer.capabilities & capability == 0 => {
                return Err(Error::VmmNotAccepted { importer: *importer })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Sends `message`, about the shared buffer or range `id`, to every importer of `to`, each frame
/// with copies of its own of `fds` (closed once sent). An importer that could not take it loses its
/// lease; the caller's own reference must still hold `id`, so that revoking frees nothing. Returns
/// the first failure, as [`Error::Share`].
pub(super) fn send_to_each(
    inner: &Inner,
    reactor: &Reactor,
    message: &Message,
    id: BufferId,
    fds: &[OwnedFd],
    to: &[ImporterId],
) -> Option<Error> {
    let mut first_error = None;
    for importer in to {
        let sent = fds
            .iter()
            .map(|fd| fd.try_clone())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(Error::from)
            .and_then(|fds| reactor.send_with_fds(*importer, message, Some(id), fds));
        if let Err(e) = sent {
            let _ = inner.lock().leases.revoke(id, *importer);
            first_error.get_or_insert(Error::Share {
                buffer: id,
                importer: *importer,
                source: Box::new(e),
            });
        }
    }
    first_error
}
