//! The GPU under the memory store: the server's [`GpuBackend`] (VMM physical allocations with
//! the POSIX file-descriptor handle type, and the relay of a creator's interprocess event onto a
//! stream of the server's own), and the client's import of a granted descriptor (the
//! memMapIPCDrv sample's pattern, as the importer's `vmm` does: import, reserve addresses of this
//! process's own, map, grant this device read-write access).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mempool_core::{
    Access, AllocationProps, Context, Device, Event, EventFlags, Granularity, HandleTypes, IpcEventHandle, Mapping,
    PhysicalAllocation, Reservation, Stream, StreamRef,
};

use super::backend::{Allocation, Backend, RelayedEvent};
use super::error::{Error, Result};
use super::memories::{Mapped, Memories};
use super::protocol::messages::{EventBytes, GrantEntry};
use mempool_ipc::DeviceUuid;

/// The server's interprocess events not in use, with their handles. Events are recycled, never
/// destroyed while the server runs, so a handle a client opened once stays valid for its
/// connection's life and clients cache opened events per handle (as the exporter's importers do).
type EventPool = Arc<Mutex<Vec<(Event, EventBytes)>>>;

struct Gpu {
    props: AllocationProps,
    ctx: Arc<Context>,
    idle_events: EventPool,
}

/// The server's GPU side, on the devices it serves.
pub(crate) struct GpuBackend {
    devices: Vec<(DeviceUuid, u64)>,
    gpus: Vec<Gpu>,
    exports: Arc<ExportCache>,
}

/// How many buffers keep an exported descriptor, to hand out duplicates: exporting costs the
/// driver far more per call than a `dup` of a kept descriptor (docs/measurements.md, "Memory store:
/// exporting a buffer's descriptor once"). Each kept descriptor counts against the process's open-file
/// limit, so at most a quarter of the soft limit is kept; past it, buffers export per attach.
struct ExportCache {
    kept: AtomicUsize,
    most: usize,
}

impl ExportCache {
    fn new() -> ExportCache {
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        ExportCache {
            kept: AtomicUsize::new(0),
            most: usize::try_from(soft / 4).unwrap_or(usize::MAX),
        }
    }

    /// Takes a place for one kept descriptor, if one is free.
    fn take(&self) -> bool {
        self.kept
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| {
                (k < self.most).then_some(k + 1)
            })
            .is_ok()
    }

    fn give_back(&self) {
        self.kept.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The allocation properties both sides use: device memory of `device`, exportable as a POSIX
/// file descriptor.
fn props(device: Device) -> AllocationProps {
    AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)
}

impl GpuBackend {
    /// Opens the devices `ordinals` (their primary contexts) and a stream on each.
    pub(crate) fn new(ordinals: &[usize]) -> Result<GpuBackend> {
        if ordinals.is_empty() {
            return Err(Error::InvalidArgument("a server needs at least one device".into()));
        }
        let mut devices = Vec::new();
        let mut gpus: Vec<Gpu> = Vec::new();
        for &ordinal in ordinals {
            let device = Device::get(ordinal)?;
            let uuid = DeviceUuid(device.uuid()?.0);
            if devices.iter().any(|(u, _)| *u == uuid) {
                return Err(Error::InvalidArgument(format!("device {ordinal} is listed twice")));
            }
            if !device.supports_vmm()? {
                return Err(Error::InvalidArgument(format!(
                    "device {ordinal} does not support virtual memory management"
                )));
            }
            let props = props(device);
            let granularity = device.vmm_granularity(&props, Granularity::Minimum)? as u64;
            let ctx = device.context()?;
            devices.push((uuid, granularity));
            gpus.push(Gpu {
                props,
                ctx,
                idle_events: EventPool::default(),
            });
        }
        Ok(GpuBackend {
            devices,
            gpus,
            exports: Arc::new(ExportCache::new()),
        })
    }
}

/// A buffer's memory, with its exported descriptor when the [`ExportCache`] had room.
struct GpuAllocation {
    physical: PhysicalAllocation,
    /// Exported once; each grant gets a duplicate of it.
    exported: Option<OwnedFd>,
    cache: Arc<ExportCache>,
}

impl Allocation for GpuAllocation {
    fn export_fd(&self) -> Result<OwnedFd> {
        match &self.exported {
            Some(fd) => fd.try_clone().map_err(Error::from),
            None => Ok(self.physical.export_fd()?),
        }
    }
}

impl Drop for GpuAllocation {
    fn drop(&mut self) {
        if self.exported.take().is_some() {
            self.cache.give_back();
        }
    }
}

/// A buffer's relayed event; back to its device's pool when the buffer is freed.
struct GpuEvent {
    event: Option<Event>,
    handle: EventBytes,
    pool: EventPool,
    /// Its context, made current for the query (the server's connection threads have none).
    ctx: Arc<Context>,
}

impl RelayedEvent for GpuEvent {
    fn handle(&self) -> EventBytes {
        self.handle
    }

    fn is_done(&self) -> Result<bool> {
        let _current = self.ctx.bind()?;
        Ok(self.event.as_ref().expect("held until dropped").is_complete()?)
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((event, self.handle));
        }
    }
}

impl Backend for GpuBackend {
    fn devices(&self) -> &[(DeviceUuid, u64)] {
        &self.devices
    }

    fn allocate(&self, index: usize, size: u64) -> Result<Box<dyn Allocation>> {
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("{size} bytes do not fit this machine's addresses")))?;
        let physical = PhysicalAllocation::new(&self.gpus[index].props, size)?;
        let exported = if self.exports.take() {
            match physical.export_fd() {
                Ok(fd) => Some(fd),
                Err(e) => {
                    self.exports.give_back();
                    return Err(e.into());
                }
            }
        } else {
            None
        };
        Ok(Box::new(GpuAllocation {
            physical,
            exported,
            cache: self.exports.clone(),
        }))
    }

    fn relay_event(&self, index: usize, creator: &EventBytes) -> Result<Box<dyn RelayedEvent>> {
        let gpu = &self.gpus[index];
        let opened = Event::open_ipc(&gpu.ctx, &IpcEventHandle(*creator))?;
        // A stream of its own for each relay: on one shared stream, a creator whose work never
        // finishes would hold up every buffer published after it. Destroying it does not wait: the
        // driver releases it once its work is done.
        let stream = Stream::new(&gpu.ctx)?;
        stream.wait(&opened)?;
        let recycled = gpu.idle_events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let (own, handle) = match recycled {
            Some(pair) => pair,
            None => {
                let own = Event::new(&gpu.ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS)?;
                let handle = own.ipc_handle()?.0;
                (own, handle)
            }
        };
        let relayed = GpuEvent {
            event: Some(own),
            handle,
            pool: gpu.idle_events.clone(),
            ctx: gpu.ctx.clone(),
        };
        relayed.event.as_ref().expect("just set").record(stream.as_ref())?;
        // The wait is queued: the creator's event and the stream may go (the driver defers their
        // release until the work queued on them is done).
        drop(stream);
        drop(opened);
        Ok(Box::new(relayed))
    }
}

/// The device of this process whose UUID is `uuid`.
pub(crate) fn local_device(uuid: DeviceUuid) -> Result<Device> {
    for device in Device::all()? {
        if device.uuid()?.0 == uuid.0 {
            return Ok(device);
        }
    }
    Err(Error::DeviceNotVisible {
        device: uuid.to_string(),
    })
}

/// This process's devices a client met, by the server's UUID, with their minimum VMM
/// granularity: looked up once per connection, not once per buffer (a lookup enumerates the
/// devices and asks each its UUID).
#[derive(Default)]
pub(crate) struct LocalDevices(Mutex<Vec<(DeviceUuid, Device, u64)>>);

impl LocalDevices {
    /// The device of this process whose UUID is `uuid` ([`Error::DeviceNotVisible`] if none).
    pub(crate) fn device(&self, uuid: DeviceUuid) -> Result<Device> {
        Ok(self.entry(uuid)?.0)
    }

    fn entry(&self, uuid: DeviceUuid) -> Result<(Device, u64)> {
        let mut known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(_, device, granularity)) = known.iter().find(|(u, _, _)| *u == uuid) {
            return Ok((device, granularity));
        }
        let device = local_device(uuid)?;
        let granularity = device.vmm_granularity(&props(device), Granularity::Minimum)? as u64;
        known.push((uuid, device, granularity));
        Ok((device, granularity))
    }

    /// Maps the memories `grants` name (a descriptor each, in `fds`), for a create or an attach:
    /// returns, per grant, the mapping of its whole memory, which the caller's buffer shares
    /// with every other buffer of that memory mapped through this client. A memory already
    /// mapped here (in `memories`) is reused, its descriptors closed unused; each other memory
    /// is imported once (from its first grant's descriptor) and mapped whole, all of a device's
    /// new memories back to back in one reservation, with one `cuMemSetAccess` per device. The
    /// grants of one memory must agree on its size and device, and a granularity that is not
    /// this process's own for the device is refused (the two sides would disagree about the
    /// layout). On failure returns the index of the grant it is about; nothing new stays mapped.
    pub(crate) fn import_grants(
        &self,
        memories: &MappedMemories,
        grants: &[GrantEntry],
        fds: Vec<OwnedFd>,
    ) -> std::result::Result<Vec<Arc<MemoryMap>>, (usize, Error)> {
        debug_assert_eq!(grants.len(), fds.len());
        let mut devices: Vec<Device> = Vec::new();
        let mut of: Vec<usize> = Vec::with_capacity(grants.len());
        for (i, g) in grants.iter().enumerate() {
            let (device, own) = self.entry(g.device).map_err(|e| (i, e))?;
            if g.granularity != own {
                return Err((
                    i,
                    Error::protocol(format!(
                        "the server's granularity {} is not this GPU's minimum granularity, {own} bytes",
                        g.granularity
                    )),
                ));
            }
            let d = match devices.iter().position(|&d| d == device) {
                Some(d) => d,
                None => {
                    devices.push(device);
                    devices.len() - 1
                }
            };
            of.push(d);
        }
        let mut cache = memories.lock();
        // Per memory id: the mapping found, or the first grant naming it (to import).
        let mut found: HashMap<u64, Arc<MemoryMap>> = HashMap::new();
        let mut first: HashMap<u64, usize> = HashMap::new();
        let mut to_map: Vec<usize> = Vec::new();
        for (i, g) in grants.iter().enumerate() {
            if let Some(&f) = first.get(&g.memory) {
                let e = &grants[f];
                if e.memory_size != g.memory_size || e.device != g.device {
                    return Err((
                        i,
                        Error::protocol(format!(
                            "the server granted memory {} as {} bytes on GPU {} and as {} bytes on GPU {} in \
                             one reply: a broken or hostile server",
                            g.memory, e.memory_size, e.device, g.memory_size, g.device
                        )),
                    ));
                }
                continue;
            }
            first.insert(g.memory, i);
            match cache.get(g.memory, g.memory_size, g.device.0).map_err(|e| (i, e))? {
                Some(mapped) => {
                    found.insert(g.memory, mapped);
                }
                None => to_map.push(i),
            }
        }
        let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
        for (d, &device) in devices.iter().enumerate() {
            let mine: Vec<usize> = to_map.iter().copied().filter(|&i| of[i] == d).collect();
            if mine.is_empty() {
                continue;
            }
            // The decoder checked that each memory size is a non-zero multiple of the
            // granularity and fits a usize.
            let total = mine
                .iter()
                .try_fold(0usize, |t, &i| t.checked_add(grants[i].memory_size as usize))
                .ok_or_else(|| (mine[0], Error::protocol("the granted sizes overflow the address space")))?;
            let reservation = Reservation::new(device, total, 0, None).map_err(|e| (mine[0], e.into()))?;
            let mut offset = 0;
            let mut jobs: Vec<Job> = Vec::with_capacity(mine.len());
            for &i in &mine {
                let size = grants[i].memory_size as usize;
                jobs.push(Job {
                    index: i,
                    fd: fds[i].take().expect("each memory is imported once"),
                    size,
                    offset,
                });
                offset += size;
            }
            // One run per device: imports side by side on several threads were measured slower
            // (the driver serializes them; docs/measurements.md, "Memory store: imports on one
            // thread"). On an error the mappings made so far drop here (unmapped).
            for (i, mapping) in map_run(device, &reservation, jobs)? {
                let g = &grants[i];
                let mapped = Arc::new(MemoryMap {
                    mapping,
                    device: g.device,
                    size: g.memory_size,
                });
                cache.insert(g.memory, &mapped);
                found.insert(g.memory, mapped);
            }
        }
        // The descriptors not imported (other members of a memory, memories mapped already)
        // close here.
        drop(fds);
        Ok(grants.iter().map(|g| found[&g.memory].clone()).collect())
    }
}

/// A memory of the server mapped here whole (one reservation range, one physical allocation):
/// shared by every buffer attached or created through it, unmapped when the last lets go.
pub(crate) struct MemoryMap {
    mapping: Mapping,
    device: DeviceUuid,
    size: u64,
}

impl MemoryMap {
    /// The mapping of the whole memory.
    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }
}

impl Mapped for MemoryMap {
    fn memory_size(&self) -> u64 {
        self.size
    }
    fn device_uuid(&self) -> [u8; 16] {
        self.device.0
    }
}

/// The memories a client has mapped, by the server's memory id.
pub(crate) type MappedMemories = Memories<MemoryMap>;

/// One memory of [`LocalDevices::import_grants`]: the index of its first grant, its descriptor,
/// size, and offset in its device's reservation.
struct Job {
    index: usize,
    fd: OwnedFd,
    size: usize,
    offset: usize,
}

/// What a run of [`map_run`] mapped (index, mapping), or the failing buffer's index and error.
type RunResult = std::result::Result<Vec<(usize, Mapping)>, (usize, Error)>;

/// Imports and maps each memory of `run` (consecutive offsets of `reservation`) and grants
/// `device` read-write access over the run's range in one call. On an error the run's mappings
/// drop (unmapped) and its remaining descriptors close.
fn map_run(device: Device, reservation: &Arc<Reservation>, run: Vec<Job>) -> RunResult {
    let (first, start) = (run[0].index, run[0].offset);
    let mut end = start;
    let mut done = Vec::with_capacity(run.len());
    for job in run {
        let physical = PhysicalAllocation::import_fd(job.fd.as_fd(), job.size).map_err(|e| (job.index, e.into()))?;
        drop(job.fd); // imported: the handle holds the memory now
        let mapping =
            Mapping::without_access(reservation, job.offset, Arc::new(physical)).map_err(|e| (job.index, e.into()))?;
        end = job.offset + job.size;
        done.push((job.index, mapping));
    }
    reservation
        .set_access(start, end - start, &[(device, Access::ReadWrite)])
        .map_err(|e| (first, e.into()))?;
    Ok(done)
}

/// The server's events this client opened, by handle: each is opened once for the connection's
/// life (the server recycles its events and never destroys one while it runs).
pub(crate) type OpenedEvents = Mutex<HashMap<EventBytes, Arc<Event>>>;

/// Makes `stream` wait on the server's interprocess event `handle` (no host wait), opening it
/// in `ctx` on first use.
pub(crate) fn wait_event(
    opened: &OpenedEvents,
    ctx: &Arc<Context>,
    handle: &EventBytes,
    stream: StreamRef<'_>,
) -> Result<()> {
    let event = {
        let mut opened = opened.lock().unwrap_or_else(|p| p.into_inner());
        match opened.entry(*handle) {
            std::collections::hash_map::Entry::Occupied(e) => e.get().clone(),
            std::collections::hash_map::Entry::Vacant(e) => e
                .insert(Arc::new(Event::open_ipc(ctx, &IpcEventHandle(*handle))?))
                .clone(),
        }
    };
    stream.wait(&event)?;
    Ok(())
}

/// Records an interprocess event on `stream`, for `publish`.
pub(crate) fn record_event(ctx: &Arc<Context>, stream: StreamRef<'_>) -> Result<(Event, EventBytes)> {
    let event = Event::new(ctx, EventFlags::DISABLE_TIMING | EventFlags::INTERPROCESS)?;
    event.record(stream)?;
    let handle = event.ipc_handle()?.0;
    Ok((event, handle))
}
