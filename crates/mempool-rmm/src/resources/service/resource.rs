//! [`ServiceResource`]: one reservation per device, a region of it per tag, each region suballocated by
//! the pool engine as one segment and backed by physical chunks mapped where allocations land.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{
    Access, AllocationProps, Context, Device, DeviceAddr, Granularity, HandleTypes, Mapping, PhysicalAllocation,
    Reservation, StreamRef,
};
use mempool_suballoc::{self as suballoc, Engine, EventPolicy, PoolEngine, PoolOptions, Upstream};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::resources::service::fences::{Fences, RegionStreams};
use crate::resources::service::table::{check_tag_name, over_watermark, runs, wake_runs, ChunkTable};
use crate::resources::service::types::{
    ChunkObserver, ChunkRange, ObserverId, Reclaim, ServiceOptions, ServiceStats, SleepMode, SleepReport, Tag,
    TagStats, WakeReport,
};
use crate::resources::suballoc::{map_engine_error, StreamKey};

const NAME: &str = "ServiceResource";

/// The most chunks one physical allocation (one mapping) spans when wake maps a tag back: the driver's
/// cost is per call (create, map), not per byte, so 64 MiB is one call where 2 MiB chunks would be 32,
/// and batches this size let the copy of one overlap the mapping of the next. Growth maps the chunks an
/// allocation needs as one physical allocation, whatever their number: a buffer that grew the pool then
/// lies in one `cuMemCreate` allocation, which NCCL's registered transports are expected to need
/// (registrations merged across several ran at unregistered speed), and a mapping is unmapped only when
/// no live allocation touches any of its chunks, which is true of the whole allocation's run once it is
/// freed.
const GROUP_CHUNKS: usize = 32;

/// Chunks restored per batch on wake (map, grant access, queue the copy), so that mapping the next batch
/// overlaps the copy of this one.
const WAKE_BATCH: usize = 64;

/// A region's engine upstream: the whole region, handed out once as a single chunk (the one segment).
#[derive(Debug)]
pub(crate) struct WholeRange {
    base: u64,
    size: u64,
    taken: AtomicBool,
}

impl WholeRange {
    pub(crate) fn new(base: u64, size: u64) -> WholeRange {
        WholeRange {
            base,
            size,
            taken: AtomicBool::new(false),
        }
    }
}

impl Upstream<StreamKey> for WholeRange {
    fn allocate(&self, bytes: u64, _stream: StreamKey) -> Result<u64, suballoc::Error> {
        if bytes <= self.size && !self.taken.swap(true, Ordering::AcqRel) {
            Ok(self.base)
        } else {
            Err(suballoc::Error::OutOfMemory {
                requested: bytes,
                cause: suballoc::OutOfMemoryCause::Upstream,
            })
        }
    }

    fn deallocate(&self, _addr: u64, _bytes: u64, _stream: StreamKey) -> Result<(), suballoc::Error> {
        // Chunks are unmapped by the resource, never by the engine; address space stays.
        self.taken.store(false, Ordering::Release);
        Ok(())
    }
}

/// Page-locked host memory holding a sleeping tag's contents; freed on drop.
struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the pointer is owned memory that only this value frees; nothing in it is thread-bound.
#[allow(unsafe_code)]
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedHost> {
        let ptr = mempool_core::memory::pinned_host_alloc(ctx, len)?;
        Ok(PinnedHost {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }

    /// The unified address of byte `offset` (`offset <= len`): pinned memory is reachable by the copy
    /// engines at its host address.
    fn addr(&self, offset: usize) -> DeviceAddr {
        debug_assert!(offset <= self.len);
        DeviceAddr(self.ptr as u64 + offset as u64)
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `pinned_host_alloc` and is freed once, here; every copy into or out of it
        // was waited for before its owner let it go (sleep and wake synchronize their stream).
        #[allow(unsafe_code)]
        let r = unsafe { mempool_core::memory::pinned_host_free(&self.ctx, self.ptr) };
        if let Err(e) = r {
            mempool_core::record_drop_error(e);
        }
    }
}

/// A sleeping tag: which chunks to map back, and where their contents wait.
struct Sleeping {
    mode: SleepMode,
    /// The chunks live allocations touched when it fell asleep, in order; with `Offload`, chunk
    /// `chunks[k]` is saved at `k * chunk` of `host`.
    chunks: Vec<usize>,
    host: Option<PinnedHost>,
}

struct Region {
    name: String,
    engine: PoolEngine<WholeRange, RegionStreams>,
    /// The frees into the tag still in flight: waited for before any of its chunks is unmapped (and by
    /// the engine where it would block on a stream it stored).
    fences: Arc<Fences>,
    table: ChunkTable,
    /// The mappings, by their first chunk, in address order; each spans `len / chunk` chunks, all marked
    /// mapped in `table` (the mapping a chunk belongs to is the last one starting at or before it).
    mappings: BTreeMap<usize, Mapping>,
    asleep: Option<Sleeping>,
    used: u64,
    peak_used: u64,
    allocations: u64,
    frees: u64,
    exports: u64,
}

struct State {
    regions: Vec<Region>,
    used: u64,
    peak_used: u64,
    peak_mapped: u64,
    reclaims: u64,
    reclaimed_bytes: u64,
    observers: Vec<(ObserverId, Arc<dyn ChunkObserver>)>,
    next_observer: u64,
    /// Pinned host buffers that held offloaded tags, kept for the next offload: pinning and unpinning
    /// host memory costs far more than the copies (as PyTorch's pinned-memory cache keeps its blocks).
    host_cache: Vec<PinnedHost>,
}

impl State {
    fn mapped_chunks(&self) -> u64 {
        self.regions.iter().map(|r| r.table.mapped_count() as u64).sum()
    }
}

/// One pool for GPU services: a virtual reservation on one device, divided into a region per [`Tag`];
/// each region is suballocated, stream-ordered, by the coalescing pool engine (that of
/// [`crate::PoolResource`]) as one segment, and physical memory is mapped in chunks where allocations land.
///
/// - **Growth never moves anything**: an allocation that lands on unmapped chunks maps them
///   (`cuMemCreate` + `cuMemMap`, one access grant per run); every address stays where it was, and a
///   failure to map leaves everything as it was.
/// - **Fragmentation is bounded** by the reclaim policy ([`ServiceOptions::reclaim`]); the default
///   watermark keeps the memory mapped within 15% above the most bytes ever live: when a growth would
///   pass it, the resource first waits for the frees in flight and unmaps every idle chunk (mapped,
///   touched by no live allocation), so a request larger than any free hole reuses the memory of the holes. Under
///   the watermark nothing is unmapped, so a workload that reaches a steady state maps nothing more.
/// - **Tags**: every allocation belongs to a tag ([`tagged`](Self::tagged) gives a [`TaggedResource`] per
///   tag; this resource's own `allocate` uses [`Tag::DEFAULT`]), with statistics per tag.
/// - **Sleep and wake**: [`sleep`](Self::sleep) releases a tag's physical memory, keeping its addresses
///   (and its live allocations) reserved, after offloading the contents to pinned host memory or
///   discarding them; [`wake`](Self::wake) maps memory back at the same addresses and restores them.
/// - **Observers** ([`attach`](Self::attach)) are told of every run of chunks mapped and unmapped, so
///   that NCCL registration follows the pool.
/// - **Sharing**: [`export`](Self::export) hands the physical chunks behind a range to another process
///   (mempool-ipc), and a tag with exports cannot sleep.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{MemoryResource, ServiceOptions, ServiceResource, SleepMode};
/// let dev = Device::get(0)?;
/// let mr = ServiceResource::new(&dev, ServiceOptions::default())?;
/// let weights = mr.tagged(mr.tag("weights")?);
/// let stream = Stream::new(&dev.context()?)?;
/// let p = weights.allocate(64 << 20, stream.as_ref())?;
/// stream.synchronize()?;
/// mr.sleep(&[weights.tag()], SleepMode::Offload, stream.as_ref())?; // the memory is released
/// mr.wake(&[weights.tag()], stream.as_ref())?; // mapped back at `p`, contents restored
/// // SAFETY: `p` came from `weights.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { weights.deallocate(p, 64 << 20, stream.as_ref()) }?;
/// # Ok(()) }
/// ```
pub struct ServiceResource {
    // `Drop` unmaps every mapping after waiting for the frees in flight; the fields then drop in order, the
    // state before the reservation.
    state: Mutex<State>,
    reservation: Arc<Reservation>,
    props: AllocationProps,
    chunk: usize,
    region_size: usize,
    max_tags: usize,
    reclaim: Reclaim,
    ctx: Arc<Context>,
    /// Its name in errors and `MemoryResource::name`.
    name: &'static str,
}

impl std::fmt::Debug for ServiceResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.name)
            .field("device", &self.props.device)
            .field("base", &self.reservation.base())
            .field("chunk", &self.chunk)
            .field("region_size", &self.region_size)
            .finish()
    }
}

impl ServiceResource {
    /// A service resource on `device` laid out as `options` says. Reserves the address space now and
    /// maps nothing. Errors name the cause: a device without VMM support, a chunk size that is not a
    /// multiple of the granularity, no tags, a reservation the driver refuses.
    pub fn new(device: &Device, options: ServiceOptions) -> Result<Arc<ServiceResource>> {
        Self::with_name(device, options, NAME)
    }

    /// [`new`](Self::new), naming itself `name` in errors (the expandable resource is one of these).
    pub(crate) fn with_name(
        device: &Device,
        options: ServiceOptions,
        name: &'static str,
    ) -> Result<Arc<ServiceResource>> {
        let device = *device;
        let support = device.vmm_support()?;
        if !support.vmm {
            return Err(Error::Unsupported {
                resource: name,
                reason: format!("device {} does not support virtual memory management", device.ordinal()),
            });
        }
        if options.max_tags == 0 || options.max_tags > u32::MAX as usize {
            return Err(Error::Unsupported {
                resource: name,
                reason: format!("max_tags must be at least 1 (got {})", options.max_tags),
            });
        }
        if let Reclaim::Watermark { percent } = options.reclaim {
            if percent > 10_000 {
                return Err(Error::Unsupported {
                    resource: name,
                    reason: format!("a watermark of {percent}% is above the most allowed (10000%)"),
                });
            }
        }
        let shareable = match options.shareable {
            Some(true) if !support.posix_fd => {
                return Err(Error::Unsupported {
                    resource: name,
                    reason: format!(
                        "device {} cannot export VMM allocations as POSIX file descriptors (shareable = true)",
                        device.ordinal()
                    ),
                })
            }
            Some(s) => s,
            None => support.posix_fd,
        };
        let rdma = match options.gpu_direct_rdma {
            Some(true) if !support.gpu_direct_rdma => {
                return Err(Error::Unsupported {
                    resource: name,
                    reason: format!(
                        "device {} does not support GPUDirect RDMA with VMM allocations",
                        device.ordinal()
                    ),
                })
            }
            Some(r) => r,
            None => support.gpu_direct_rdma,
        };
        let mut props = AllocationProps::new(device).gpu_direct_rdma(rdma);
        if shareable {
            props = props.handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
        }
        let min = device.vmm_granularity(&props, Granularity::Minimum)?;
        let chunk = match options.chunk_size {
            Some(c) => {
                if c == 0 || !c.is_multiple_of(min) {
                    return Err(mempool_core::Error::NotGranular {
                        what: "the chunk size",
                        value: c,
                        granularity: min,
                    }
                    .into());
                }
                c
            }
            None => {
                let rec = device.vmm_granularity(&props, Granularity::Recommended)?;
                mempool_core::round_up(2 << 20, rec).unwrap_or(rec)
            }
        };
        let want = match options.region_size {
            Some(r) => r,
            None => device.total_memory()?.saturating_mul(2),
        };
        let too_big = |what: String| Error::Unsupported {
            resource: name,
            reason: format!("{what} is not representable"),
        };
        let region_size = mempool_core::round_up(want.max(chunk), chunk)
            .ok_or_else(|| too_big(format!("a region of {want} bytes")))?;
        let total = region_size
            .checked_mul(options.max_tags)
            .ok_or_else(|| too_big(format!("{} regions of {region_size} bytes", options.max_tags)))?;
        let align = if chunk.is_power_of_two() { chunk } else { 0 };
        let reservation = Reservation::new(device, total, align, None).map_err(|e| match e {
            mempool_core::Error::OutOfMemory { .. } | mempool_core::Error::Driver { .. } => Error::Unsupported {
                resource: name,
                reason: format!(
                    "the driver refused to reserve {total} bytes of address space ({} tags of {region_size} \
                     bytes): {e}; ask for fewer tags or smaller regions",
                    options.max_tags
                ),
            },
            other => other.into(),
        })?;
        let ctx = device.context()?;
        let mr = ServiceResource {
            state: Mutex::new(State {
                regions: Vec::new(),
                used: 0,
                peak_used: 0,
                peak_mapped: 0,
                reclaims: 0,
                reclaimed_bytes: 0,
                observers: Vec::new(),
                next_observer: 0,
                host_cache: Vec::new(),
            }),
            reservation,
            props,
            chunk,
            region_size,
            max_tags: options.max_tags,
            reclaim: options.reclaim,
            ctx,
            name,
        };
        {
            let mut st = mr.state();
            mr.add_region(&mut st, "default".to_owned())?;
        }
        Ok(Arc::new(mr))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add_region(&self, st: &mut State, name: String) -> Result<Tag> {
        let index = st.regions.len();
        let base = self.reservation.base().0 + (index * self.region_size) as u64;
        let fences = Arc::new(Fences::new(&self.ctx));
        let engine = PoolEngine::new(
            WholeRange::new(base, self.region_size as u64),
            RegionStreams::new(&self.ctx, fences.clone()),
            PoolOptions {
                initial_size: self.region_size as u64,
                maximum_size: Some(self.region_size as u64),
                event_policy: EventPolicy::Adaptive,
            },
        )
        .map_err(|e| map_engine_error(self.name, e))?;
        let table = ChunkTable::new(base, self.region_size as u64, self.chunk as u64);
        st.regions.push(Region {
            name,
            engine,
            fences,
            table,
            mappings: BTreeMap::new(),
            asleep: None,
            used: 0,
            peak_used: 0,
            allocations: 0,
            frees: 0,
            exports: 0,
        });
        Ok(Tag(index as u32))
    }

    /// The tag named `name`, made now if there is none (its region is empty until something is allocated
    /// under it). Errors: a name that is not 1 to 64 ASCII letters, digits, `_`, `-`, `.` or `:`; more
    /// tags than [`ServiceOptions::max_tags`].
    pub fn tag(&self, name: &str) -> Result<Tag> {
        check_tag_name(name).map_err(|reason| Error::Unsupported {
            resource: self.name,
            reason,
        })?;
        let mut st = self.state();
        if let Some(i) = st.regions.iter().position(|r| r.name == name) {
            return Ok(Tag(i as u32));
        }
        if st.regions.len() >= self.max_tags {
            let names: Vec<&str> = st.regions.iter().map(|r| r.name.as_str()).collect();
            return Err(Error::Unsupported {
                resource: self.name,
                reason: format!(
                    "cannot add tag `{name}`: the resource has room for {} tags and has {names:?} (raise \
                     ServiceOptions::max_tags)",
                    self.max_tags
                ),
            });
        }
        self.add_region(&mut st, name.to_owned())
    }

    /// The tag named `name`, if there is one.
    pub fn find_tag(&self, name: &str) -> Option<Tag> {
        self.state()
            .regions
            .iter()
            .position(|r| r.name == name)
            .map(|i| Tag(i as u32))
    }

    /// The name of `tag`, if it is one of this resource's.
    pub fn tag_name(&self, tag: Tag) -> Option<String> {
        self.state().regions.get(tag.index()).map(|r| r.name.clone())
    }

    /// A [`MemoryResource`] that allocates under `tag` (frees go to whichever tag the address is in).
    pub fn tagged(self: &Arc<Self>, tag: Tag) -> TaggedResource {
        TaggedResource {
            inner: self.clone(),
            tag,
        }
    }

    /// The device whose memory it hands out.
    pub fn device(&self) -> Device {
        self.props.device
    }

    /// The reserved range's first address.
    pub fn base(&self) -> DeviceAddr {
        self.reservation.base()
    }

    /// Bytes per chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// Bytes of address space per tag.
    pub fn region_size(&self) -> usize {
        self.region_size
    }

    /// The tag whose region holds `addr`, if it lies in the reservation.
    pub fn tag_of(&self, addr: DeviceAddr) -> Option<Tag> {
        let i = self.region_slot(addr)?;
        (i < self.state().regions.len()).then_some(Tag(i as u32))
    }

    /// Which region of the reservation holds `addr` (made into a tag or not), if the reservation does.
    fn region_slot(&self, addr: DeviceAddr) -> Option<usize> {
        addr.0
            .checked_sub(self.reservation.base().0)
            .filter(|&off| off < self.reservation.size() as u64)
            .map(|off| (off / self.region_size as u64) as usize)
    }

    fn region_index(&self, st: &State, tag: Tag) -> Result<usize> {
        if tag.index() < st.regions.len() {
            Ok(tag.index())
        } else {
            Err(Error::Unsupported {
                resource: self.name,
                reason: format!(
                    "tag {} is not one of this resource's ({} tags)",
                    tag.0,
                    st.regions.len()
                ),
            })
        }
    }

    /// What it holds now, in total and per tag.
    pub fn stats(&self) -> ServiceStats {
        let st = self.state();
        let chunk = self.chunk as u64;
        let tags = st
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| TagStats {
                tag: Tag(i as u32),
                name: r.name.clone(),
                asleep: r.asleep.as_ref().map(|s| s.mode),
                used_bytes: r.used,
                peak_used_bytes: r.peak_used,
                live_allocations: r.allocations - r.frees,
                allocations: r.allocations,
                frees: r.frees,
                mapped_bytes: r.table.mapped_count() as u64 * chunk,
                offloaded_bytes: r
                    .asleep
                    .as_ref()
                    .filter(|s| s.host.is_some())
                    .map_or(0, |s| (s.chunks.len() * self.chunk) as u64),
                largest_free_mapped: largest_free_mapped(r),
                exports: r.exports,
            })
            .collect();
        ServiceStats {
            mapped_bytes: st.mapped_chunks() * chunk,
            peak_mapped_bytes: st.peak_mapped,
            used_bytes: st.used,
            peak_used_bytes: st.peak_used,
            reservation_bytes: self.reservation.size() as u64,
            chunk_size: chunk,
            reclaims: st.reclaims,
            reclaimed_bytes: st.reclaimed_bytes,
            host_cache_bytes: st.host_cache.iter().map(|h| h.len as u64).sum(),
            tags,
        }
    }

    /// Sets every peak (the resource's and each tag's) to the current value. The watermark's reference is
    /// the peak of live bytes, so this also lets the resource hold less from now on.
    pub fn reset_peaks(&self) {
        let mut st = self.state();
        st.peak_used = st.used;
        st.peak_mapped = st.mapped_chunks() * self.chunk as u64;
        for r in &mut st.regions {
            r.peak_used = r.used;
        }
    }

    /// Frees the pinned host buffers kept from earlier offloads (see [`ServiceStats::host_cache_bytes`]).
    /// Returns the bytes freed.
    pub fn release_host_cache(&self) -> u64 {
        let cache = std::mem::take(&mut self.state().host_cache);
        cache.iter().map(|h| h.len as u64).sum()
    }

    /// Waits for the frees still in flight into the tags it unmaps from (the events their streams
    /// recorded), then unmaps and releases every chunk no live allocation touches (every tag that is
    /// awake). Returns the bytes released.
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.state();
        self.unmap_idle(&mut st)
    }

    /// Unmaps every idle mapping of the awake tags (one no live allocation touches), after waiting for the
    /// frees in flight into those tags.
    fn unmap_idle(&self, st: &mut State) -> Result<u64> {
        let mut plan: Vec<(usize, Vec<usize>)> = Vec::new();
        for (ri, r) in st.regions.iter().enumerate() {
            if r.asleep.is_some() || r.mappings.is_empty() {
                continue;
            }
            let free = free_chunks(r);
            let chunk = self.chunk;
            let idle: Vec<usize> = r
                .mappings
                .iter()
                .filter(|(&start, m)| (start..start + m.len() / chunk).all(|i| free[i]))
                .map(|(&start, _)| start)
                .collect();
            if !idle.is_empty() {
                plan.push((ri, idle));
            }
        }
        if plan.is_empty() {
            return Ok(0);
        }
        // Frees were stream-ordered; unmapping is not: wait until no work can touch the chunks. An idle
        // chunk lies wholly in free blocks, and every use of a free block was queued before its free, on
        // the free's stream: the tag's fences. Not the whole context: other tags' work, and other users'
        // of the device, go on.
        for (ri, _) in &plan {
            st.regions[*ri].fences.wait()?;
        }
        let mut released = 0u64;
        for (ri, idle) in plan {
            // Waited: the fences above, and no live allocation touches an idle chunk.
            released += self.unmap_groups(st, ri, &idle, true);
        }
        st.reclaimed_bytes += released;
        Ok(released)
    }

    /// Tells the observers, then unmaps and releases the mappings that start at `starts` (sorted) in
    /// region `ri`. Returns the bytes released.
    ///
    /// `waited`: the caller waited for every piece of work that may touch these mappings (the frees in
    /// flight into the tag: its fences; and what the resource itself queued on them), so they are unmapped
    /// at once; otherwise each mapping's drop waits for the whole device first (the fallback where such a
    /// wait failed).
    fn unmap_groups(&self, st: &mut State, ri: usize, starts: &[usize], waited: bool) -> u64 {
        for range in group_ranges(ri, &st.regions[ri], starts) {
            for (_, o) in &st.observers {
                o.unmapping(range);
            }
        }
        let r = &mut st.regions[ri];
        let mut released = 0u64;
        for &g in starts {
            if let Some(m) = r.mappings.remove(&g) {
                let n = m.len() / self.chunk;
                released += m.len() as u64;
                if waited {
                    // SAFETY: 1. the caller waited for all work that touches the mapping (`waited`, this
                    // function's contract: the tag's fences cover every use of freed memory, the
                    // resource's own copies were waited for, and live allocations' work is their owners'
                    // to have finished, which `sleep` states). 2. the range goes back to the resource:
                    // nothing is handed it until it is mapped again.
                    #[allow(unsafe_code)]
                    unsafe {
                        m.unmap_waited()
                    };
                } else {
                    // Unmapping waits for the device first (the mapping's drop).
                    drop(m);
                }
                for i in g..g + n {
                    r.table.set_mapped(i, false);
                }
            }
        }
        released
    }

    /// The first chunks of every mapping of region `ri`, sorted.
    fn all_groups(r: &Region) -> Vec<usize> {
        r.mappings.keys().copied().collect()
    }

    /// Maps `chunks` (sorted, unmapped) of region `ri`, a run at a time, one access grant per run, and
    /// tells the observers. On failure, what this call mapped is unmapped again.
    fn map_chunks(&self, st: &mut State, ri: usize, chunks: &[usize]) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        let result = (|| -> Result<()> {
            for run in runs(chunks.iter().copied()) {
                self.map_run(st, ri, run, usize::MAX, &mut done)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            // Nothing used the new mappings: they were never handed out.
            self.undo_maps(st, ri, &mut done, true);
            return Err(e);
        }
        Ok(())
    }

    /// Maps one run of unmapped chunks of region `ri` as physical allocations of at most `max_group`
    /// chunks, grants access once over the run, and tells the observers; `done` collects the first chunk
    /// of every mapping recorded (for an undo).
    fn map_run(
        &self,
        st: &mut State,
        ri: usize,
        run: Range<usize>,
        max_group: usize,
        done: &mut Vec<usize>,
    ) -> Result<()> {
        let first_done = done.len();
        let mut start = run.start;
        while start < run.end {
            let n = (run.end - start).min(max_group);
            let phys = Arc::new(PhysicalAllocation::new(&self.props, n * self.chunk)?);
            let offset = ri * self.region_size + st.regions[ri].table.offset(start);
            let m = Mapping::without_access(&self.reservation, offset, phys)?;
            let r = &mut st.regions[ri];
            r.mappings.insert(start, m);
            for i in start..start + n {
                r.table.set_mapped(i, true);
            }
            done.push(start);
            start += n;
        }
        let offset = ri * self.region_size + st.regions[ri].table.offset(run.start);
        self.reservation.set_access(
            offset,
            run.len() * self.chunk,
            &[(self.props.device, Access::ReadWrite)],
        )?;
        for range in group_ranges(ri, &st.regions[ri], &done[first_done..]) {
            for (_, o) in &st.observers {
                o.mapped(range);
            }
        }
        let mapped = st.mapped_chunks() * self.chunk as u64;
        st.peak_mapped = st.peak_mapped.max(mapped);
        Ok(())
    }

    /// Unmaps the mappings a failed call made (`done` holds their first chunks). The observers see them
    /// unmapping (they may have been told of them). `waited`: as [`unmap_groups`](Self::unmap_groups)'s,
    /// true when nothing used them or what did was waited for.
    fn undo_maps(&self, st: &mut State, ri: usize, done: &mut [usize], waited: bool) {
        if done.is_empty() {
            return;
        }
        done.sort_unstable();
        self.unmap_groups(st, ri, done, waited);
    }

    /// Allocates `bytes` under `tag`, ordered on `stream`. Errors: a tag that is not this resource's, a
    /// sleeping tag, out of memory (naming the size, what is held and live, the largest free block and the
    /// device's free memory).
    pub fn allocate_tagged(&self, bytes: usize, tag: Tag, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let rounded = suballoc::align_up(bytes as u64).ok_or(Error::OutOfMemory {
            resource: self.name,
            requested: bytes,
        })?;
        let mut st = self.state();
        let ri = self.region_index(&st, tag)?;
        if st.regions[ri].asleep.is_some() {
            return Err(asleep_error(self.name, &st.regions[ri].name, "allocate from"));
        }
        let key = StreamKey::of(stream, &self.ctx)?;
        let addr = match st.regions[ri].engine.allocate(bytes as u64, key) {
            Ok(a) => a,
            Err(e) => {
                let e = map_engine_error(self.name, e);
                return Err(if e.is_out_of_memory() {
                    self.oom(&st, ri, bytes)
                } else {
                    e
                });
            }
        };
        let span = st.regions[ri].table.span(addr, rounded);
        if !st.regions[ri].table.all_mapped(span.clone()) {
            if let Err(e) = self.grow(&mut st, ri, span, rounded, stream) {
                let r = &mut st.regions[ri];
                // The block was never handed out: nothing used it, so it goes straight back.
                let _ = r.engine.deallocate(addr, bytes as u64, key);
                return Err(if e.is_out_of_memory() {
                    self.oom(&st, ri, bytes)
                } else {
                    e
                });
            }
        }
        st.used += rounded;
        st.peak_used = st.peak_used.max(st.used);
        let r = &mut st.regions[ri];
        r.used += rounded;
        r.peak_used = r.peak_used.max(r.used);
        r.allocations += 1;
        Ok(DeviceAddr(addr))
    }

    /// Maps the unmapped chunks of `span` in region `ri` for an allocation of `rounded` bytes, reclaiming
    /// idle chunks first when the policy says so, and once more after running out of memory.
    fn grow(&self, st: &mut State, ri: usize, span: Range<usize>, rounded: u64, stream: StreamRef<'_>) -> Result<()> {
        let need = st.regions[ri].table.unmapped(span.clone());
        let new = (need.len() * self.chunk) as u64;
        // Reclaiming waits for the frees in flight (host-synchronizes events, and the whole context when
        // one cannot be waited for), which a stream being captured into a graph forbids (it would
        // invalidate the capture): then the resource only maps, and an out-of-memory is not retried.
        let capturing = self.own_context(stream).is_capturing()?;
        let reclaim = !capturing
            && match self.reclaim {
                Reclaim::OnOutOfMemory => false,
                Reclaim::BeforeGrowth => true,
                Reclaim::Watermark { percent } => {
                    let mapped = st.mapped_chunks() * self.chunk as u64;
                    over_watermark(mapped, new, st.peak_used.max(st.used + rounded), percent)
                }
            };
        if reclaim {
            // The new block is live in the engine, so its chunks are not idle: only others are unmapped.
            if self.unmap_idle(st)? > 0 {
                st.reclaims += 1;
            }
        }
        let mut result = self.map_chunks(st, ri, &need);
        if !capturing && matches!(&result, Err(e) if e.is_out_of_memory()) {
            // Give back what no live allocation touches, then try once more.
            result = self.unmap_idle(st).and_then(|_| self.map_chunks(st, ri, &need));
        }
        result
    }

    /// The mapped runs of the awake tags (adjacent mappings joined), each with its region engine's ranges
    /// clipped to it: what a snapshot shows as this resource's chunks. A live allocation lies in mapped
    /// memory, so no used range is cut; free ranges end where the mapping does.
    fn mapped_runs(&self) -> Vec<suballoc::ChunkMap<usize>> {
        let st = self.state();
        let mut out = Vec::new();
        for r in st.regions.iter().filter(|r| r.asleep.is_none()) {
            let ranges: Vec<suballoc::MapRange<StreamKey>> =
                r.engine.memory_map().into_iter().flat_map(|m| m.ranges).collect();
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for m in r.mappings.values() {
                let (a, e) = (m.addr().0, m.addr().0 + m.len() as u64);
                match runs.last_mut() {
                    Some(last) if last.1 == a => last.1 = e,
                    _ => runs.push((a, e)),
                }
            }
            for (a, e) in runs {
                let clipped = ranges
                    .iter()
                    .filter(|g| g.addr < e && g.addr + g.size > a)
                    .map(|g| {
                        let (s, t) = (g.addr.max(a), (g.addr + g.size).min(e));
                        suballoc::MapRange {
                            addr: s,
                            size: t - s,
                            used: g.used,
                            stream: g.stream.map(StreamKey::handle),
                        }
                    })
                    .collect();
                out.push(suballoc::ChunkMap {
                    addr: a,
                    size: e - a,
                    ranges: clipped,
                });
            }
        }
        out
    }

    /// The out-of-memory error for `bytes` under region `ri`, with what the resource holds.
    fn oom(&self, st: &State, ri: usize, bytes: usize) -> Error {
        let device_free = self.ctx.memory_info().map(|m| m.free as u64).unwrap_or(0);
        let held = st.mapped_chunks() * self.chunk as u64;
        let mut r = crate::error::OutOfMemoryReport::new(bytes, self.name);
        r.stack = vec![self.name];
        r.tag = Some(st.regions[ri].name.clone());
        r.holder = Some(self.name);
        r.held = Some(held);
        r.held_as = Some("mapped");
        r.live = Some(st.used);
        r.free = Some(held.saturating_sub(st.used));
        r.largest_free = Some(largest_free_mapped(&st.regions[ri]));
        r.device_free = Some(device_free);
        Error::OutOfMemoryReport(Box::new(r))
    }

    /// Frees an allocation (of any tag) on `stream`. A tag that sleeps takes the free too, as bookkeeping:
    /// the block returns to its free list as address space, and the chunks only it touched are not
    /// mapped back when the tag wakes.
    fn deallocate_inner(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        let rounded = suballoc::align_up(bytes as u64).unwrap_or(bytes as u64);
        let mut st = self.state();
        let invalid = |reason: String| Error::InvalidDeallocation {
            resource: self.name,
            ptr: ptr.0,
            bytes,
            reason,
        };
        let ri = self
            .region_slot(ptr)
            .ok_or_else(|| invalid("the address is not in the resource's reservation".into()))?;
        if ri >= st.regions.len() {
            return Err(invalid(format!(
                "the address lies in the region of tag {ri}, which the resource has not made (it has {} tags)",
                st.regions.len()
            )));
        }
        if !st.regions[ri].table.contains(ptr.0, rounded.max(1)) {
            return Err(invalid(format!(
                "the range runs past the end of tag `{}`'s region",
                st.regions[ri].name
            )));
        }
        let r = &mut st.regions[ri];
        // Work queued on `stream` before this free may still use the block (the stream contract): the
        // tag's fences wait for it before any of the tag's chunks is unmapped. Marked before the engine
        // puts the block in a free list, so that whatever waits for the fences covers every free block.
        r.fences.freed_on(stream);
        // The engine refuses an address or size that is not a live allocation, before the table changes.
        r.engine
            .deallocate(ptr.0, bytes as u64, StreamKey::of(stream, &self.ctx)?)
            .map_err(|e| map_engine_error(self.name, e))?;
        r.used -= rounded;
        r.frees += 1;
        st.used -= rounded;
        Ok(())
    }

    /// Releases the physical memory of `tags`, keeping their addresses (and their live allocations)
    /// reserved: with [`SleepMode::Offload`] the chunks live allocations touch are first copied to pinned
    /// host memory (a buffer kept from an earlier offload when one is large enough, else a new one), ordered
    /// on `stream`; with [`SleepMode::Discard`] their contents are lost. Observers are told.
    ///
    /// Before it unmaps anything it waits for the frees into the tags still in flight, whatever stream
    /// each was made on (the events the resource recorded at each free, host-synchronized: a block freed
    /// on a stream whose kernel still runs is unmapped only once that kernel is done), and for its own
    /// offload copies. Where a tag still has live allocations it also waits for the whole context: the
    /// resource hands out their addresses and never sees the streams that use them, so that is the only
    /// wait that covers work still using them. A sleep of tags with nothing live does not wait for the
    /// whole device: other tags', resources' and libraries' work goes on. `stream` must be idle (checked).
    ///
    /// Refused, with nothing changed: a tag that is not this resource's, or already sleeps; a tag with
    /// ranges shared with another process ([`export`](Self::export)); `stream` with work still pending.
    /// Tags sleep one after the other: when one fails later (out of pinned host memory for its offload, a
    /// copy the driver refuses), the tags before it in `tags` are asleep, it and those after it are awake
    /// with their memory as it was, and [`stats`](Self::stats) says which.
    ///
    /// While a tag sleeps, allocating from it and exporting from it are refused; freeing into it is
    /// taken as bookkeeping (the block returns to the tag's free list as address space, and its chunks
    /// that no live allocation touches are not mapped back by `wake`).
    pub fn sleep(&self, tags: &[Tag], mode: SleepMode, stream: StreamRef<'_>) -> Result<SleepReport> {
        let stream = self.own_context(stream);
        let mut st = self.state();
        let mut idx = Vec::with_capacity(tags.len());
        for &t in tags {
            let ri = self.region_index(&st, t)?;
            let r = &st.regions[ri];
            if r.asleep.is_some() {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: format!("tag `{}` is already asleep", r.name),
                });
            }
            if r.exports > 0 {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: format!(
                        "tag `{}` cannot sleep: {} of its ranges are shared with another process (each is \
                         released when its importers let go)",
                        r.name, r.exports
                    ),
                });
            }
            if !idx.contains(&ri) {
                idx.push(ri);
            }
        }
        self.check_idle(stream)?;
        // The frees in flight into these tags, on any stream (their fences): every use of their free
        // blocks. Waited for before any tag changes, so a failure here leaves them all awake.
        for &ri in &idx {
            st.regions[ri].fences.wait()?;
        }
        // Live allocations of these tags may still be used by work on streams the resource never saw (an
        // event recorded when they were allocated covers nothing queued after it): where any is live, the
        // only wait that covers that work is the context's. A tag with nothing live needs none.
        let live = idx.iter().any(|&ri| {
            let free = free_chunks(&st.regions[ri]);
            st.regions[ri].table.mapped_chunks().into_iter().any(|i| !free[i])
        });
        if live {
            self.ctx.synchronize()?;
        }
        let mut report = SleepReport::default();
        for &ri in &idx {
            let free = free_chunks(&st.regions[ri]);
            let touched: Vec<usize> = st.regions[ri]
                .table
                .mapped_chunks()
                .into_iter()
                .filter(|&i| !free[i])
                .collect();
            let host = match mode {
                SleepMode::Discard => None,
                SleepMode::Offload if touched.is_empty() => None,
                SleepMode::Offload => {
                    let want = touched.len() * self.chunk;
                    // The smallest cached buffer that fits, else a new one.
                    let fit = (0..st.host_cache.len())
                        .filter(|&i| st.host_cache[i].len >= want)
                        .min_by_key(|&i| st.host_cache[i].len);
                    let host = match fit {
                        Some(i) => st.host_cache.swap_remove(i),
                        None => PinnedHost::new(&self.ctx, want)?,
                    };
                    let queued = self.copy_at(&st.regions[ri].table, &touched, &host, 0, Direction::Save, stream);
                    // Wait even when a copy could not be queued: those queued before it write into `host`,
                    // which the error return frees.
                    let waited = stream.synchronize();
                    queued?;
                    waited?;
                    report.offloaded_bytes += want as u64;
                    Some(host)
                }
            };
            let groups = Self::all_groups(&st.regions[ri]);
            // Waited: the fences (frees in flight), the offload's copies (`stream`, synchronized), and the
            // live allocations' work (the context, above, where anything is live).
            report.released_bytes += self.unmap_groups(&mut st, ri, &groups, true);
            st.regions[ri].asleep = Some(Sleeping {
                mode,
                chunks: touched,
                host,
            });
        }
        Ok(report)
    }

    /// Maps the memory of sleeping `tags` back at the same addresses (the chunks live allocations touch:
    /// those they touched when the tags fell asleep, less the ones only allocations freed since touched)
    /// and, for offloaded tags, copies the contents back, ordered on `stream`; waits
    /// for `stream` before it returns. Observers are told. Tags that are awake are skipped. The pinned host
    /// buffers of offloaded tags are kept for the next offload
    /// ([`release_host_cache`](Self::release_host_cache) frees them).
    ///
    /// On a failure (out of memory), what this call mapped for the failing tag is unmapped again and the
    /// tag stays asleep with its saved contents: nothing is lost, and `wake` can be called again.
    pub fn wake(&self, tags: &[Tag], stream: StreamRef<'_>) -> Result<WakeReport> {
        let stream = self.own_context(stream);
        let mut st = self.state();
        for &t in tags {
            self.region_index(&st, t)?;
        }
        let mut report = WakeReport::default();
        for &t in tags {
            let ri = t.index();
            let Some(sleeping) = st.regions[ri].asleep.take() else {
                continue;
            };
            // Frees taken while asleep may have left saved chunks that no live allocation touches: those
            // stay unmapped.
            let plan = wake_runs(&sleeping.chunks, &free_chunks(&st.regions[ri]));
            let bytes = (plan.iter().map(|(run, _)| run.len()).sum::<usize>() * self.chunk) as u64;
            match self.restore(&mut st, ri, &plan, sleeping.host.as_ref(), stream) {
                Ok(()) => {
                    report.mapped_bytes += bytes;
                    if let Some(host) = sleeping.host {
                        report.restored_bytes += bytes;
                        // The copies were waited for: the buffer is free for the next offload.
                        st.host_cache.push(host);
                    }
                }
                Err(e) => {
                    st.regions[ri].asleep = Some(sleeping);
                    return Err(e);
                }
            }
        }
        Ok(report)
    }

    /// Maps the runs of `plan` (each with the index of its first chunk's saved copy in `host`, as
    /// [`wake_runs`] gives them) of region `ri` back in batches, queuing each batch's copy from `host`
    /// (an offload's) before mapping the next, then waits for `stream`.
    fn restore(
        &self,
        st: &mut State,
        ri: usize,
        plan: &[(Range<usize>, usize)],
        host: Option<&PinnedHost>,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        let result = (|| -> Result<()> {
            for (run, first) in plan {
                let mut start = run.start;
                while start < run.end {
                    let end = (start + WAKE_BATCH).min(run.end);
                    self.map_run(st, ri, start..end, GROUP_CHUNKS, &mut done)?;
                    if let Some(host) = host {
                        let chunks: Vec<usize> = (start..end).collect();
                        let k = first + (start - run.start);
                        self.copy_at(&st.regions[ri].table, &chunks, host, k, Direction::Restore, stream)?;
                    }
                    start = end;
                }
            }
            stream.synchronize()?;
            Ok(())
        })();
        if let Err(e) = result {
            // Copies already queued read the host memory and write chunks about to be unmapped: wait for
            // them. They are all on `stream` (the tag sleeps: nothing else uses its chunks). When the
            // stream's wait fails it cannot tell that they ended; the context's wait can, and is kept as
            // that fallback alone (and when it fails too, each mapping's drop waits and keeps what it
            // cannot unmap).
            let waited = stream.synchronize().is_ok() || self.ctx.synchronize().is_ok();
            self.undo_maps(st, ri, &mut done, waited);
            return Err(e);
        }
        Ok(())
    }

    /// Queues copies between `chunks` (sorted, mapped) and `host`, one per run of chunks: chunk `chunks[k]`
    /// is saved at `(first + k) * chunk` of `host`.
    fn copy_at(
        &self,
        table: &ChunkTable,
        chunks: &[usize],
        host: &PinnedHost,
        first: usize,
        dir: Direction,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let mut k = first;
        for run in runs(chunks.iter().copied()) {
            let dev = DeviceAddr(table.addr(run.start));
            let len = run.len() * self.chunk;
            let at = host.addr(k * self.chunk);
            if (k + run.len()) * self.chunk > host.len {
                return Err(Error::Unsupported {
                    resource: self.name,
                    reason: "internal: a copy would run past the host buffer".into(),
                });
            }
            let (dst, src) = match dir {
                Direction::Save => (at, dev),
                Direction::Restore => (dev, at),
            };
            // SAFETY: 1. `dev..dev+len` is mapped (the chunks are mapped, with read-write access for the
            // device) and stays mapped until the copy completes: sleep and wake wait for `stream` before
            // anything is unmapped or the host memory freed. `at..at+len` lies inside `host` (checked
            // above), page-locked memory the copy engines reach at its unified address, alive until the
            // same wait.
            #[allow(unsafe_code)]
            unsafe { mempool_core::memory::copy_device_async(&self.ctx, dst, src, len, stream) }?;
            k += run.len();
        }
        Ok(())
    }

    /// `stream` bound to the resource's context when it knows none (the legacy or per-thread stream, a raw
    /// handle): its synchronize and query then work from a thread with no current context.
    fn own_context<'s>(&'s self, stream: StreamRef<'s>) -> StreamRef<'s> {
        match stream.context() {
            Some(_) => stream,
            None => stream.in_context(&self.ctx),
        }
    }

    /// Refuses when `stream` has work still queued. `cuStreamQuery`, not an event recorded now: an event
    /// recorded on an idle stream completes only once the device has processed the record, so a query right
    /// after it can read "not ready" with nothing queued.
    fn check_idle(&self, stream: StreamRef<'_>) -> Result<()> {
        if !self.own_context(stream).is_idle()? {
            return Err(Error::Unsupported {
                resource: self.name,
                reason: "cannot sleep while the stream given has work still queued (it may use the memory \
                         being released): synchronize it first"
                    .into(),
            });
        }
        Ok(())
    }

    /// Attaches `observer`: it is told of every run mapped now, at once, and of every later map and unmap
    /// until [`detach`](Self::detach).
    pub fn attach(&self, observer: Arc<dyn ChunkObserver>) -> ObserverId {
        let mut st = self.state();
        for (ri, r) in st.regions.iter().enumerate() {
            for range in group_ranges(ri, r, &Self::all_groups(r)) {
                observer.mapped(range);
            }
        }
        let id = ObserverId(st.next_observer);
        st.next_observer += 1;
        st.observers.push((id, observer));
        id
    }

    /// Detaches an observer: it is told that every run mapped now is unmapping (so that it lets go of
    /// what it holds), then never called again. Returns whether it was attached.
    pub fn detach(&self, id: ObserverId) -> bool {
        let mut st = self.state();
        let Some(pos) = st.observers.iter().position(|(i, _)| *i == id) else {
            return false;
        };
        let (_, observer) = st.observers.remove(pos);
        for (ri, r) in st.regions.iter().enumerate() {
            for range in group_ranges(ri, r, &Self::all_groups(r)) {
                observer.unmapping(range);
            }
        }
        true
    }

    /// The physical allocations behind `addr..addr+len` (inside one tag's region, every chunk touched by a
    /// live allocation), for sharing with another process, and a hold that keeps the tag from sleeping
    /// until it is dropped. Each allocation spans one or more chunks; the first starts
    /// [`ServiceExport::offset`] bytes before `addr`.
    ///
    /// Errors: an empty range, a range outside the reservation or across two tags, a sleeping tag, a range
    /// with a chunk no live allocation touches.
    pub fn export(self: &Arc<Self>, addr: DeviceAddr, len: usize) -> Result<ServiceExport> {
        let mut st = self.state();
        let bad = |reason: String| Error::Unsupported {
            resource: self.name,
            reason,
        };
        if len == 0 {
            return Err(bad("cannot export an empty range".into()));
        }
        let ri = self
            .region_slot(addr)
            .filter(|&i| i < st.regions.len())
            .ok_or_else(|| bad(format!("{addr} is not in the resource's reservation")))?;
        let r = &st.regions[ri];
        if !r.table.contains(addr.0, len as u64) {
            return Err(bad(format!(
                "{len} bytes at {addr} run past the end of tag `{}`'s region",
                r.name
            )));
        }
        if r.asleep.is_some() {
            return Err(asleep_error(self.name, &r.name, "export from"));
        }
        let span = r.table.span(addr.0, len as u64);
        let free = free_chunks(r);
        if let Some(i) = span.clone().find(|&i| free[i] || !r.table.is_mapped(i)) {
            return Err(bad(format!(
                "{len} bytes at {addr} include the chunk at {} that no live allocation of tag `{}` touches",
                DeviceAddr(r.table.addr(i)),
                r.name
            )));
        }
        // Every chunk of the span is mapped (checked above): the mappings over it are the one holding its
        // first chunk and those starting after that chunk inside it.
        let first = r
            .mappings
            .range(..=span.start)
            .next_back()
            .map_or(span.start, |(&g, _)| g);
        let chunks: Vec<Arc<PhysicalAllocation>> = r
            .mappings
            .range(first..span.end)
            .map(|(_, m)| m.physical().clone())
            .collect();
        let first = r.table.addr(first);
        st.regions[ri].exports += 1;
        Ok(ServiceExport {
            owner: self.clone(),
            tag: Tag(ri as u32),
            chunks,
            offset: (addr.0 - first) as usize,
            len,
        })
    }

    fn end_export(&self, tag: Tag) {
        let mut st = self.state();
        if let Some(r) = st.regions.get_mut(tag.index()) {
            r.exports = r.exports.saturating_sub(1);
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Direction {
    Save,
    Restore,
}

fn asleep_error(resource: &'static str, name: &str, what: &str) -> Error {
    Error::Unsupported {
        resource,
        reason: format!("cannot {what} tag `{name}`: it is asleep (wake it first)"),
    }
}

/// The address ranges of region `ri`'s mappings that start at chunks `starts` (one physical allocation
/// each), as observers are told of them.
fn group_ranges(ri: usize, r: &Region, starts: &[usize]) -> Vec<ChunkRange> {
    starts
        .iter()
        .filter_map(|&g| {
            r.mappings.get(&g).map(|m| ChunkRange {
                tag: Tag(ri as u32),
                addr: DeviceAddr(r.table.addr(g)),
                len: m.len(),
            })
        })
        .collect()
}

/// Per chunk of region `r`: whether it lies wholly in free space (no live allocation touches it).
fn free_chunks(r: &Region) -> Vec<bool> {
    r.table
        .free_chunks(r.engine.free_blocks().map(|(_, b)| (b.addr, b.addr + b.size)))
}

/// The largest free block of region `r`'s engine that lies in mapped memory.
fn largest_free_mapped(r: &Region) -> u64 {
    r.engine
        .free_blocks()
        .map(|(_, b)| r.table.largest_mapped_piece(b.addr, b.addr + b.size))
        .max()
        .unwrap_or(0)
}

/// Physical chunks of a [`ServiceResource`] handed out for sharing ([`ServiceResource::export`]): while it
/// lives, the tag cannot sleep. It holds the chunks (so they outlive any unmapping here) and the resource.
pub struct ServiceExport {
    owner: Arc<ServiceResource>,
    tag: Tag,
    chunks: Vec<Arc<PhysicalAllocation>>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for ServiceExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceExport")
            .field("tag", &self.tag)
            .field("chunks", &self.chunks.len())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl ServiceExport {
    /// The physical allocations behind the range, in address order, contiguous: each spans one or more
    /// chunks ([`PhysicalAllocation::size`] says how many bytes), the first starting [`offset`](Self::offset)
    /// bytes before the range.
    pub fn chunks(&self) -> &[Arc<PhysicalAllocation>] {
        &self.chunks
    }

    /// Where the range starts in the first chunk.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The range's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: an export has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The tag it belongs to.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// The resource it came from.
    pub fn resource(&self) -> &Arc<ServiceResource> {
        &self.owner
    }
}

impl Drop for ServiceExport {
    fn drop(&mut self) {
        self.owner.end_export(self.tag);
    }
}

// SAFETY: 1. each region's engine hands out disjoint, aligned ranges of its region (its invariants, tested on
// the host), and regions are disjoint; a range is handed out again only after `deallocate` returned it.
// 2. `allocate` maps every chunk of the range before returning it. A chunk is unmapped only when no live
// allocation touches it (trim, the watermark's reclaim), by `sleep`, or by the drop, and each of them first
// waits for the frees in flight into its tag (the fences `deallocate` marks): no work ordered before a free
// runs on memory unmapped under it, or mapped again for someone else. The drop also waits for the whole
// context while allocations are live. `sleep` is the one way a live allocation's chunks are unmapped while
// `self` lives, and only its owner asks for it: the addresses stay reserved for that allocation (nothing
// else is mapped there, no other allocation is handed them), so work that still touches them, against
// `sleep`'s documentation, fails with the driver's error instead of reaching other memory, and `wake` maps
// them back for the same allocation. 3. `is_equal` is identity; the tagged views are equal to nothing else.
#[allow(unsafe_code)]
unsafe impl MemoryResource for ServiceResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.allocate_tagged(bytes, Tag::DEFAULT, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.deallocate_inner(ptr, bytes, stream)
    }

    fn name(&self) -> &'static str {
        self.name
    }

    /// Its mapped and live bytes with their peaks, and as chunks the mapped runs of the awake tags (adjacent
    /// mappings as one run), each with the used and free ranges of its region's engine.
    fn inspect(&self) -> crate::observe::inspect::Inspection {
        let chunks = self.mapped_runs();
        let st = self.stats();
        crate::observe::inspect::Inspection {
            held_bytes: Some(st.mapped_bytes),
            peak_held_bytes: Some(st.peak_mapped_bytes),
            live_bytes: Some(st.used_bytes),
            peak_live_bytes: Some(st.peak_used_bytes),
            live_count: Some(st.tags.iter().map(|t| t.live_allocations).sum()),
            allocations: Some(st.tags.iter().map(|t| t.allocations).sum()),
            device_free: self.ctx.memory_info().ok().map(|m| m.free as u64),
            chunks,
            has_chunks: true,
            ..crate::observe::inspect::Inspection::default()
        }
    }

    /// [`ServiceResource::trim`]: unmaps every idle chunk after waiting for the frees in flight.
    fn trim_unused(&self, _stream: StreamRef<'_>) -> Result<()> {
        self.trim().map(drop)
    }
}

impl Drop for ServiceResource {
    /// Returns everything, live allocations included, as RMM's resources do when destroyed: waits for the
    /// frees still in flight (each tag's fences), tells the observers, unmaps and releases every chunk,
    /// then frees the range. Errors go to `mempool_core::take_drop_errors`.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        // Every use of freed memory is behind the fences. Allocations never freed are another matter: no
        // fence covers the work their owners queued, and the range goes back to the driver below (to be
        // handed to anyone after), so while any is live (awake or asleep) the whole context is waited
        // for: the one case where a context-wide wait stays on this path.
        let fenced = st.regions.iter().all(|r| r.fences.wait().is_ok());
        let waited = fenced && (st.used == 0 || self.ctx.synchronize().is_ok());
        for r in &mut st.regions {
            // Forgets the blocks; its wait for stored streams is the fences' (waited for above: a no-op).
            let _ = r.engine.release();
        }
        for ri in 0..st.regions.len() {
            let groups = Self::all_groups(&st.regions[ri]);
            for range in group_ranges(ri, &st.regions[ri], &groups) {
                for (_, o) in &st.observers {
                    o.unmapping(range);
                }
            }
            let mappings = std::mem::take(&mut st.regions[ri].mappings);
            for (_, m) in mappings {
                if waited {
                    // SAFETY: 1. every use of freed memory was waited for (the fences), and with allocations
                    // still live, all of the context's work too (above); the resource's own copies were
                    // waited for by the calls that queued them. 2. the resource is going away: nothing is
                    // handed these addresses again through it.
                    #[allow(unsafe_code)]
                    unsafe {
                        m.unmap_waited()
                    };
                } else {
                    // A wait failed: the mapping's drop waits for the device itself, and keeps (leaks) what
                    // it cannot unmap.
                    drop(m);
                }
            }
        }
    }
}

/// A [`ServiceResource`] seen as a [`MemoryResource`] that allocates under one tag
/// ([`ServiceResource::tagged`]). Frees go to whichever tag the address lies in.
#[derive(Clone, Debug)]
pub struct TaggedResource {
    inner: Arc<ServiceResource>,
    tag: Tag,
}

impl TaggedResource {
    /// Its tag.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// The resource it allocates from.
    pub fn resource(&self) -> &Arc<ServiceResource> {
        &self.inner
    }
}

// SAFETY: forwards to the `ServiceResource`, whose impl upholds the contract; `is_equal` holds only for
// views of the same resource, which free each other's memory (a free finds the tag by address).
#[allow(unsafe_code)]
unsafe impl MemoryResource for TaggedResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        self.inner.allocate_tagged(bytes, self.tag, stream)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.inner.deallocate_inner(ptr, bytes, stream)
    }

    fn is_equal(&self, other: &dyn MemoryResource) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn MemoryResource)
    }

    fn name(&self) -> &'static str {
        self.inner.name
    }

    fn inspect(&self) -> crate::observe::inspect::Inspection {
        self.inner.inspect()
    }

    fn trim_unused(&self, stream: StreamRef<'_>) -> Result<()> {
        self.inner.trim_unused(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_engine_sees_one_segment_and_never_more() {
        let up = WholeRange::new(1 << 40, 64 * MIB);
        let key = StreamKey::from_parts(1, 0);
        assert_eq!(up.allocate(64 * MIB, key).unwrap(), 1 << 40);
        assert!(
            matches!(up.allocate(MIB, key), Err(suballoc::Error::OutOfMemory { requested, .. }) if requested == MIB)
        );
        up.deallocate(1 << 40, 64 * MIB, key).unwrap();
        assert!(up.allocate(65 * MIB, key).is_err(), "more than the range");
        assert_eq!(up.allocate(MIB, key).unwrap(), 1 << 40);
    }
}
