//! VMM physical allocations on the importer's side: [`SharedVmm`], and receiving one (the
//! memMapIPCDrv sample's pattern: import the descriptor, reserve addresses of this process's
//! own, map the allocation there, grant this device access).

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use mempool_core::{
    Access, AllocationProps, BufferView, Device, DeviceAddr, Granularity, HandleTypes, Mapping, PhysicalAllocation,
    Reservation, StreamRef,
};

use crate::error::{record_drop_error, Error, Result};
use crate::protocol::{BufferId, EventHandle, ProtocolError, VmmBufferDescriptor};

/// What a [`SharedVmm`] needs of the importer that received it (the importer's `Inner`
/// implements it; this module does not import the importer's).
pub(super) trait VmmHost: Send + Sync {
    /// The importer's device.
    fn device(&self) -> Device;
    /// Waits for the work of the importer's context.
    fn synchronize(&self) -> Result<()>;
    /// Records `id` as held; `false` if it was held already.
    fn hold(&self, id: BufferId) -> bool;
    /// Forgets `id`.
    fn forget(&self, id: BufferId);
    /// Makes `stream` wait on the exporter's interprocess event `handle`.
    fn wait_event(&self, handle: &EventHandle, stream: StreamRef<'_>) -> Result<()>;
    /// Sends `Release` for `id`.
    fn send_release(&self, id: BufferId) -> Result<()>;
    /// Tells the exporter about `err`, closes the connection, and returns `err`.
    fn reject(&self, err: Error) -> Error;
}

/// A VMM physical allocation received from the exporter ([`Importer::recv_any`](crate::Importer::recv_any)),
/// mapped into a reservation of this process with read-write access for the importer's device.
///
/// The memory is the exporter's: both processes see the same bytes. Work queued on the stream
/// given to `recv_any` runs after the exporter's work on it. Dropping it waits for the device
/// (unmapping is not stream-ordered), unmaps the allocation, releases this process's handle and
/// the reservation, and only then sends `Release`. After the exporter is gone, dropping it still
/// unmaps and releases; the release then has nowhere to go and is skipped.
pub struct SharedVmm {
    held: Held<Mapping>,
    addr: DeviceAddr,
    len: usize,
}

impl fmt::Debug for SharedVmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedVmm")
            .field("id", &self.held.id)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl SharedVmm {
    /// The exporter's id of the buffer.
    pub fn id(&self) -> BufferId {
        self.held.id
    }

    /// The first mapped address in this process.
    pub fn ptr(&self) -> DeviceAddr {
        self.addr
    }

    /// The size: the whole physical allocation, a multiple of the granularity.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a physical allocation has at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The mapping in this process (its physical allocation, reservation and access).
    pub fn mapping(&self) -> &Mapping {
        self.held.mapped()
    }

    /// A view of the bytes for host copies and fills ordered on `stream` (a stream of the
    /// importer's device); it borrows `self`, so it cannot outlive the mapping.
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        Ok(self.mapping().view(stream)?)
    }

    /// Releases the buffer (what dropping does), reporting errors instead of recording them.
    pub fn release(self) -> Result<()> {
        self.held.release()
    }
}

/// What a received VMM buffer or range holds from its receipt to its release: its id, held by the
/// importer (`host`), and this process's mappings of the exporter's memory (`M`: one [`Mapping`] or
/// several). Releasing it (or dropping it) waits for the device (unmapping is not stream-ordered),
/// drops the mappings (unmapping, releasing this process's handles and what else `M` owns), forgets
/// the id, and only then sends `Release`; after the exporter is gone, the release has nowhere to go
/// and is skipped.
pub(super) struct Held<M> {
    host: Arc<dyn VmmHost>,
    id: BufferId,
    /// `None` once released.
    mapped: Option<M>,
}

impl<M> Held<M> {
    /// The exporter's id of the buffer or range.
    pub(super) fn id(&self) -> BufferId {
        self.id
    }

    /// The importer that holds it.
    pub(super) fn host(&self) -> &dyn VmmHost {
        &*self.host
    }

    /// The mappings.
    pub(super) fn mapped(&self) -> &M {
        // Only `release_once` takes them, which consumes or drops `self`.
        self.mapped
            .as_ref()
            .expect("a received VMM buffer holds its mappings until released")
    }

    /// Releases it (what dropping does), reporting errors instead of recording them.
    pub(super) fn release(mut self) -> Result<()> {
        self.release_once()
    }

    fn release_once(&mut self) -> Result<()> {
        let Some(mapped) = self.mapped.take() else {
            return Ok(());
        };
        // Unmapping waits for the device too, but reports failures only as drop errors: wait
        // here first so that `release` returns them.
        let synced = self.host.synchronize();
        drop(mapped); // unmaps, releases this process's handles (and a reservation it owns)
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

impl<M> Drop for Held<M> {
    fn drop(&mut self) {
        if let Err(e) = self.release_once() {
            record_drop_error(e);
        }
    }
}

/// Holds `id` for the importer `host` while `map` imports and maps what a `kind` message (named in
/// errors) sent: a [`Held`] when it succeeds. An id already held ends the connection (releasing it
/// would release the other); on any other failure the id is not held and `Release` is sent at once,
/// so the exporter does not wait for it.
pub(super) fn hold<M>(
    host: Arc<dyn VmmHost>,
    kind: &str,
    id: BufferId,
    map: impl FnOnce(&dyn VmmHost) -> Result<M>,
) -> Result<Held<M>> {
    if !host.hold(id) {
        let err = ProtocolError::Violation {
            reason: format!("{kind} {id}: this importer already holds a buffer with that id"),
        };
        return Err(host.reject(err.into()));
    }
    match map(&*host) {
        Ok(mapped) => Ok(Held {
            host,
            id,
            mapped: Some(mapped),
        }),
        Err(e) => {
            host.forget(id);
            // Not held: tell the exporter so it does not wait for this buffer.
            let _ = host.send_release(id);
            Err(e)
        }
    }
}

/// The importer's device, after checking that `claimed` (what the exporter's `what` says) is its
/// minimum VMM granularity for allocations shared as POSIX file descriptors.
pub(super) fn check_granularity(host: &dyn VmmHost, claimed: u64, what: fmt::Arguments<'_>) -> Result<Device> {
    let device = host.device();
    let props = AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let granularity = device.vmm_granularity(&props, Granularity::Minimum)?;
    if claimed != granularity as u64 {
        return Err(ProtocolError::Violation {
            reason: format!(
                "{what}: granularity {claimed} is not the minimum granularity of this GPU, {granularity} bytes"
            ),
        }
        .into());
    }
    Ok(device)
}

/// Imports the allocation `d` names from `fd`, maps it into a reservation of this process,
/// grants the importer's device read-write access and makes `stream` wait on the exporter's
/// event. On failure the buffer is not held ([`hold`]).
pub(super) fn receive(
    host: Arc<dyn VmmHost>,
    d: VmmBufferDescriptor,
    fd: OwnedFd,
    stream: StreamRef<'_>,
) -> Result<SharedVmm> {
    let id = d.buffer_id;
    let held = hold(host, "VmmBuffer", id, |host| {
        let device = check_granularity(host, d.granularity, format_args!("VmmBuffer {id}"))?;
        // The decoder checked that the size is a non-zero multiple of the granularity and fits a usize.
        let size = d.size as usize;
        let physical = PhysicalAllocation::import_fd(fd.as_fd(), size)?;
        drop(fd); // imported: the handle holds the memory now
        let reservation = Reservation::new(device, size, 0, None)?;
        let mapping = Mapping::without_access(&reservation, 0, Arc::new(physical))?;
        mapping.set_access(&[(device, Access::ReadWrite)])?;
        if let Some(handle) = d.ready_event {
            host.wait_event(&handle, stream)?;
        }
        Ok(mapping)
    })?;
    Ok(SharedVmm {
        addr: held.mapped().addr(),
        len: held.mapped().len(),
        held,
    })
}
