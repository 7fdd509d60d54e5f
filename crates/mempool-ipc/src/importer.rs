//! The importing process: connects to an exporter, imports its pool once, and receives buffers
//! as [`SharedBuffer`]s that release themselves.
//!
//! [`Importer`] (with [`ImporterOptions`]) and [`SharedBuffer`] are public; their documentation
//! is the guide. Inside, the [`ImportTable`] imports each block once and says when its import
//! may be freed; the tests (`importer/tests.rs`) cover what can be checked without a GPU.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mempool_core::{
    BufferView, Context, Device, DeviceAddr, Event, ImportedPtr, IpcEventHandle, MemPool, PtrExportData, StreamRef,
};

use crate::conn::ConnectionConfig;
use crate::cred::{AccessPolicy, PeerCredentials};
use crate::error::{record_drop_error, Error, Result};
use crate::lease::ImportTable;
use crate::session::{ExporterEvent, ImporterSession};
use crate::wire::{
    BlockId, BufferDescriptor, BufferId, Capabilities, DeviceUuid, EventHandle, MessageType, PoolId, ProtocolError,
};

mod vmm;

pub use self::vmm::SharedVmm;
use self::vmm::VmmHost;

/// How an [`Importer`] connects.
#[derive(Clone, Debug, Default)]
pub struct ImporterOptions {
    /// The connection's time limits.
    pub connection: ConnectionConfig,
    /// Which users the exporter may run as (default: this process's user).
    pub policy: AccessPolicy,
    /// Accept VMM physical allocations ([`SharedVmm`], from
    /// [`Exporter::share_vmm`](crate::Exporter::share_vmm)) as well as pool buffers: announced
    /// in the handshake, and then receive with [`Importer::recv_any`]. Default: `false` (the
    /// exporter refuses to share VMM memory with this importer).
    pub accept_vmm: bool,
}

/// What [`Importer::recv_any`] received: a pool buffer or a VMM physical allocation.
#[derive(Debug)]
pub enum Received<'s> {
    /// A buffer of the exporter's pool.
    Buffer(SharedBuffer<'s>),
    /// A VMM physical allocation, mapped here.
    Vmm(SharedVmm),
}

struct State {
    table: ImportTable<ImportedPtr>,
    /// Opened interprocess events by handle. The exporter recycles its events, so the same
    /// handles come back; each is opened once for the connection's life.
    events: HashMap<[u8; 64], Event>,
    /// The VMM buffers held ([`SharedVmm`]).
    vmm: HashSet<BufferId>,
}

struct Inner {
    // Field order is drop order: the imports go before the pool they came from.
    state: Mutex<State>,
    session: ImporterSession,
    ctx: Arc<Context>,
    device: Device,
    pool: MemPool,
}

/// A connection to an exporter, with its pool imported.
///
/// [`Importer::connect`] checks who answers (`SO_PEERCRED`), finds the exporter's GPU among this
/// process's devices by UUID (ordinals may differ between processes), and imports the pool
/// (`cuMemPoolImportFromShareableHandle`). [`Importer::recv`] then waits for a buffer, imports
/// its block (`cuMemPoolImportPointer`, once per block while any buffer of the block is held)
/// and makes the caller's stream wait on the exporter's event, so work queued on that stream
/// after `recv` sees the exporter's data.
///
/// Dropping a [`SharedBuffer`] waits for the work queued on its stream, frees the block's import
/// if it was the block's last buffer here, and only then sends `Release`: the driver's rule that
/// the importer frees before the exporter does.
///
/// ```no_run
/// # fn main() -> Result<(), mempool_ipc::Error> {
/// use mempool_core::Stream;
/// use mempool_ipc::{Importer, ImporterOptions};
///
/// let importer = Importer::connect("/run/user/1000/pool.sock", ImporterOptions::default())?;
/// let stream = Stream::new(&importer.device().context()?)?;
/// let buf = importer.recv(stream.as_ref())?;
/// // ... queue work that reads or writes `buf.ptr()` on `stream` ...
/// drop(buf); // waits for that work, frees the import, tells the exporter
/// # Ok(()) }
/// ```
///
/// One `Importer` per exporter per process: the driver imports a pool's pointers once per
/// process, so two importers of the same pool in one process would free each other's imports.
///
/// Dropping it (once every [`SharedBuffer`] it handed out is dropped too: they keep it alive)
/// says `Goodbye` and releases the imported pool.
#[derive(Clone)]
pub struct Importer {
    inner: Arc<Inner>,
}

impl fmt::Debug for Importer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Importer")
            .field("device", &self.inner.device)
            .field("pool_id", &self.inner.session.pool_id())
            .field("held", &self.held())
            .finish()
    }
}

impl Importer {
    /// Connects to the exporter at `path`, checks its credentials against `options.policy`,
    /// runs the handshake, and imports the pool.
    ///
    /// Errors: [`Error::DeviceNotVisible`] if this process does not see the exporter's GPU;
    /// [`Error::PeerCredentials`]; [`Error::Core`] if the pool cannot be imported; any error of
    /// the handshake: [`Error::Timeout`], [`Error::UnexpectedMessage`], [`Error::Remote`], ...
    pub fn connect(path: impl AsRef<Path>, options: ImporterOptions) -> Result<Importer> {
        let wanted = if options.accept_vmm {
            Capabilities::VMM
        } else {
            Capabilities::NONE
        };
        let (session, imported) =
            ImporterSession::connect_with(path, options.connection, &options.policy, wanted, find_device)?;
        let device = imported.device;
        let setup = || -> Result<(Arc<Context>, MemPool)> {
            let ctx = device.context()?;
            let pool = MemPool::import_fd(&device, std::os::fd::AsFd::as_fd(&imported.pool_fd))?;
            Ok((ctx, pool))
        };
        let (ctx, pool) = match setup() {
            Ok(parts) => parts,
            Err(e) => return Err(session.reject(e)),
        };
        Ok(Importer {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    table: ImportTable::new(),
                    events: HashMap::new(),
                    vmm: HashSet::new(),
                }),
                session,
                ctx,
                device,
                pool,
            }),
        })
    }

    /// The local device that has the exporter's GPU.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The exporter's GPU.
    pub fn device_uuid(&self) -> DeviceUuid {
        self.inner.session.device_uuid()
    }

    /// The exporter's pool.
    pub fn pool_id(&self) -> PoolId {
        self.inner.session.pool_id()
    }

    /// The imported pool.
    pub fn pool(&self) -> &MemPool {
        &self.inner.pool
    }

    /// The exporter's credentials.
    pub fn exporter_credentials(&self) -> Result<PeerCredentials> {
        self.inner.session.exporter_credentials()
    }

    /// How many buffers this importer holds (pool buffers and VMM allocations).
    pub fn held(&self) -> usize {
        let state = self.inner.lock();
        state.table.len() + state.vmm.len()
    }

    /// Whether the exporter agreed to send VMM allocations ([`ImporterOptions::accept_vmm`], and
    /// an exporter that offers them).
    pub fn accepts_vmm(&self) -> bool {
        self.inner.session.accepted().contains(Capabilities::VMM)
    }

    /// How many blocks are imported now (buffers suballocated from one block share it).
    pub fn imported_blocks(&self) -> usize {
        self.inner.lock().table.block_count()
    }

    /// Waits for the next buffer. Work queued on `stream` after this returns runs after the
    /// exporter's work on the buffer; on another stream, order it after `stream` first.
    ///
    /// Errors: [`Error::ExporterGone`] once the exporter has said `Goodbye`, closed the
    /// connection or died (what was received stays usable); [`Error::Core`] if the buffer could
    /// not be imported (it is released at once).
    pub fn recv<'s>(&self, stream: StreamRef<'s>) -> Result<SharedBuffer<'s>> {
        self.recv_until(stream, None)
    }

    /// Like [`Importer::recv`], but fails with [`Error::Timeout`] if no buffer begins to arrive
    /// within `timeout` (the connection stays usable).
    pub fn recv_timeout<'s>(&self, stream: StreamRef<'s>, timeout: Duration) -> Result<SharedBuffer<'s>> {
        self.recv_until(stream, Some(Instant::now() + timeout))
    }

    /// Waits for the next buffer of either kind: with [`ImporterOptions::accept_vmm`], the
    /// exporter may send VMM allocations too ([`Received::Vmm`]). Ordering and errors as for
    /// [`Importer::recv`]; a VMM allocation that cannot be imported or mapped is released at once.
    pub fn recv_any<'s>(&self, stream: StreamRef<'s>) -> Result<Received<'s>> {
        self.recv_any_until(stream, None)
    }

    /// Like [`Importer::recv_any`], but fails with [`Error::Timeout`] if nothing begins to
    /// arrive within `timeout` (the connection stays usable).
    pub fn recv_any_timeout<'s>(&self, stream: StreamRef<'s>, timeout: Duration) -> Result<Received<'s>> {
        self.recv_any_until(stream, Some(Instant::now() + timeout))
    }

    fn recv_until<'s>(&self, stream: StreamRef<'s>, deadline: Option<Instant>) -> Result<SharedBuffer<'s>> {
        match self.recv_any_until(stream, deadline)? {
            Received::Buffer(buffer) => Ok(buffer),
            Received::Vmm(vmm) => {
                // Released here: `recv` hands out pool buffers only.
                vmm.release()?;
                Err(Error::UnexpectedMessage {
                    expected: "Buffer (a VmmBuffer arrived and was released: receive with Importer::recv_any)",
                    got: MessageType::VmmBuffer,
                })
            }
        }
    }

    fn recv_any_until<'s>(&self, stream: StreamRef<'s>, deadline: Option<Instant>) -> Result<Received<'s>> {
        let inner = &self.inner;
        let descriptor = match inner.session.recv_until(deadline) {
            Ok(ExporterEvent::Buffer(descriptor)) => descriptor,
            Ok(ExporterEvent::VmmBuffer(descriptor, fd)) => {
                let host: Arc<dyn VmmHost> = inner.clone();
                return vmm::receive(host, descriptor, fd, stream).map(Received::Vmm);
            }
            Ok(ExporterEvent::Goodbye) => return Err(Error::ExporterGone { how: "said Goodbye" }),
            Err(Error::Closed) => {
                return Err(Error::ExporterGone {
                    how: "closed the connection",
                })
            }
            Err(Error::Protocol(ProtocolError::Truncated { .. })) => {
                return Err(Error::ExporterGone {
                    how: "closed the connection in the middle of a message",
                })
            }
            Err(Error::ConnectionFailed) => {
                return Err(Error::ExporterGone {
                    how: "is no longer connected (an earlier error closed the connection)",
                })
            }
            Err(e) => return Err(e),
        };
        let id = descriptor.buffer_id;
        let received = (|| -> Result<DeviceAddr> {
            let mut state = inner.lock();
            let base = state
                .table
                .add(&descriptor, |d: &BufferDescriptor| -> Result<ImportedPtr> {
                    Ok(inner.pool.import_pointer(&PtrExportData(d.pointer.0))?)
                })?
                .ptr();
            let ptr = base.offset(descriptor.offset as usize);
            if let Some(handle) = descriptor.ready_event {
                let event = match state.events.entry(handle.0) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(Event::open_ipc(&inner.ctx, &IpcEventHandle(handle.0))?)
                    }
                };
                if let Err(e) = stream.wait(event) {
                    drop(state);
                    let _ = inner.forget(id, stream);
                    return Err(e.into());
                }
            }
            Ok(ptr)
        })();
        match received {
            Ok(ptr) => {
                // SAFETY: `ptr..ptr+size` lies inside the block imported into `inner.ctx` (the decoder checked
                // `offset + size <= block_size`), which the import table keeps imported until this buffer is
                // released, and reached by unified addressing; `stream` waits on the exporter's ready event (or
                // the exporter synchronized), so work on it is ordered on `stream` from here on; a stream that
                // carries no context is one of the importer's context by `StreamRef::from_raw`'s contract.
                #[allow(unsafe_code)]
                let view = unsafe { BufferView::new(ptr, descriptor.size as usize, stream, inner.ctx.clone()) };
                Ok(Received::Buffer(SharedBuffer {
                    inner: self.inner.clone(),
                    id,
                    block: descriptor.block_id,
                    view,
                }))
            }
            Err(e) => {
                // Not held: tell the exporter so it does not wait for this buffer.
                let _ = inner.session.release(id);
                Err(e)
            }
        }
    }
}

/// A buffer received from the exporter, ordered on the stream given to [`Importer::recv`].
///
/// Dropping it waits for the work queued on that stream, frees the import (if it was its
/// block's last buffer here) and sends `Release`. After the exporter is gone, dropping it still
/// frees the import; the release then has nowhere to go and is skipped.
pub struct SharedBuffer<'s> {
    inner: Arc<Inner>,
    id: BufferId,
    block: BlockId,
    /// The range in this process; empty once released (by `release` or drop).
    view: BufferView<'s>,
}

impl fmt::Debug for SharedBuffer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("id", &self.id)
            .field("block", &self.block)
            .field("view", &self.view)
            .finish()
    }
}

impl<'s> std::ops::Deref for SharedBuffer<'s> {
    type Target = BufferView<'s>;

    /// The buffer's range in this process: address, size, stream, context, host copies and fills.
    fn deref(&self) -> &BufferView<'s> {
        &self.view
    }
}

impl<'s> SharedBuffer<'s> {
    /// The exporter's id of the buffer.
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The block the buffer lives in.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// Releases the buffer (what dropping does), reporting errors instead of recording them.
    pub fn release(mut self) -> Result<()> {
        self.release_once()
    }

    /// Releases once: the view is empty afterwards, so a later drop has nothing to release.
    fn release_once(&mut self) -> Result<()> {
        let (inner, id) = (&self.inner, self.id);
        self.view.release_with(|_, _, stream| inner.release(id, stream))
    }
}

impl Drop for SharedBuffer<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release_once() {
            record_drop_error(e);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `id` here: waits for the work on `stream`, and frees the block's import if this
    /// was its last buffer. The lock is held throughout, so a buffer of the same block that
    /// arrives meanwhile imports the block afresh only after this import is freed.
    fn forget(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        let mut state = self.lock();
        match state.table.release(id)? {
            Some(import) => import.free(stream)?,
            None => stream.synchronize()?,
        }
        Ok(())
    }

    fn release(&self, id: BufferId, stream: StreamRef<'_>) -> Result<()> {
        self.forget(id, stream)?;
        match self.session.release(id) {
            Ok(()) => Ok(()),
            // The exporter is gone (or said Goodbye and closed): nobody to tell.
            Err(Error::Closed | Error::ConnectionFailed | Error::WriteClosed) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl VmmHost for Inner {
    fn device(&self) -> Device {
        self.device
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.synchronize()?)
    }

    fn hold(&self, id: BufferId) -> bool {
        self.lock().vmm.insert(id)
    }

    fn forget(&self, id: BufferId) {
        self.lock().vmm.remove(&id);
    }

    fn wait_event(&self, handle: &EventHandle, stream: StreamRef<'_>) -> Result<()> {
        let mut state = self.lock();
        let event = match state.events.entry(handle.0) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Event::open_ipc(&self.ctx, &IpcEventHandle(handle.0))?)
            }
        };
        Ok(stream.wait(event)?)
    }

    fn send_release(&self, id: BufferId) -> Result<()> {
        self.session.release(id)
    }

    fn reject(&self, err: Error) -> Error {
        self.session.reject(err)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every SharedBuffer holds an Arc of this, so the table is empty unless a release failed
        // half-way; free what is left before saying Goodbye.
        let leftovers = self.lock().table.drain();
        if !leftovers.is_empty() {
            if let Err(e) = self.ctx.synchronize() {
                record_drop_error(e.into());
            }
            drop(leftovers);
        }
        let _ = self.session.goodbye();
    }
}

/// Finds the local device with the exporter's GPU, by UUID.
fn find_device(uuid: &DeviceUuid) -> Result<Device> {
    for device in Device::all()? {
        if device.uuid()?.0 == uuid.0 {
            return Ok(device);
        }
    }
    Err(Error::DeviceNotVisible { uuid: *uuid })
}

#[cfg(test)]
mod tests;
