//! [`ExpandableResource`]: PyTorch's expandable segments. One reserved virtual range per device, grown
//! by mapping physical chunks where allocations land, suballocated by the coalescing pool engine as one
//! segment, so the address space never fragments across segments.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{
    AllocationProps, Context, Device, DeviceAddr, Granularity, Mapping, PhysicalAllocation, Reservation, StreamRef,
};
use mempool_suballoc::{self as suballoc, Engine, EngineStats, EventPolicy, PoolEngine, PoolOptions, Upstream};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::resources::suballoc::{map_engine_error, CudaStreams, StreamKey};

const NAME: &str = "ExpandableResource";

/// How an [`ExpandableResource`] is laid out.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpandableOptions {
    /// Bytes of virtual address space to reserve (rounded up to the chunk). `None`: twice the device's
    /// memory, so that holes left by unmapped chunks never cap what can be mapped.
    pub reservation: Option<usize>,
    /// Bytes per physical chunk, a multiple of the minimum granularity. `None`: the recommended
    /// granularity, at least 2 MiB (PyTorch's small segment size).
    pub chunk_size: Option<usize>,
    /// When idle chunks (mapped, touched by no live allocation) are unmapped besides
    /// [`ExpandableResource::trim`].
    pub reclaim: Reclaim,
}

/// When an [`ExpandableResource`] unmaps idle chunks (mapped chunks no live allocation touches) on its
/// own, besides [`ExpandableResource::trim`]. Either way it first waits for the device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reclaim {
    /// Only when creating a chunk runs out of memory, then once more (PyTorch's behaviour): idle chunks
    /// stay mapped for reuse, so allocations that land on them map nothing.
    #[default]
    OnOutOfMemory,
    /// Also before mapping any new chunk: memory held never exceeds what live allocations touch plus the
    /// new chunks, at the price of a device synchronize and unmaps whenever the resource grows while it
    /// holds idle chunks.
    BeforeGrowth,
}

/// What an [`ExpandableResource`] holds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpandableStats {
    /// Physical memory mapped now (chunks times the chunk size).
    pub mapped_bytes: u64,
    /// The most that was mapped at once.
    pub peak_mapped_bytes: u64,
    /// Bytes of live allocations (rounded as the engine rounds them).
    pub used_bytes: u64,
    /// The reserved virtual range's size.
    pub reservation_bytes: u64,
    /// The chunk size.
    pub chunk_size: u64,
}

/// Which chunks of the range live allocations touch, and which are mapped: the resource's bookkeeping,
/// free of CUDA so that host tests check it.
#[derive(Debug)]
pub(crate) struct ChunkTable {
    base: u64,
    chunk: u64,
    /// Per chunk: how many live allocations overlap it.
    live: Vec<u32>,
    /// Per chunk: whether it is mapped.
    mapped: Vec<bool>,
    mapped_count: usize,
    peak_mapped: usize,
}

impl ChunkTable {
    pub(crate) fn new(base: u64, size: u64, chunk: u64) -> ChunkTable {
        let n = size.div_ceil(chunk) as usize;
        ChunkTable {
            base,
            chunk,
            live: vec![0; n],
            mapped: vec![false; n],
            mapped_count: 0,
            peak_mapped: 0,
        }
    }

    /// The chunks `addr..addr+bytes` overlaps (`bytes > 0`, inside the range).
    pub(crate) fn span(&self, addr: u64, bytes: u64) -> Range<usize> {
        let first = (addr - self.base) / self.chunk;
        let last = (addr - self.base + bytes - 1) / self.chunk;
        first as usize..last as usize + 1
    }

    /// The chunks of `span` that are not mapped.
    pub(crate) fn unmapped(&self, span: Range<usize>) -> Vec<usize> {
        span.filter(|&i| !self.mapped[i]).collect()
    }

    pub(crate) fn set_mapped(&mut self, i: usize, mapped: bool) {
        if self.mapped[i] != mapped {
            self.mapped[i] = mapped;
            if mapped {
                self.mapped_count += 1;
                self.peak_mapped = self.peak_mapped.max(self.mapped_count);
            } else {
                self.mapped_count -= 1;
            }
        }
    }

    pub(crate) fn acquire(&mut self, span: Range<usize>) {
        for i in span {
            self.live[i] += 1;
        }
    }

    pub(crate) fn release(&mut self, span: Range<usize>) {
        for i in span {
            self.live[i] = self.live[i].saturating_sub(1);
        }
    }

    /// Mapped chunks no live allocation touches: what trimming unmaps.
    pub(crate) fn idle(&self) -> Vec<usize> {
        (0..self.live.len())
            .filter(|&i| self.mapped[i] && self.live[i] == 0)
            .collect()
    }

    /// The offset of chunk `i` in the range.
    pub(crate) fn offset(&self, i: usize) -> usize {
        (i as u64 * self.chunk) as usize
    }
}

/// The engine's upstream: the whole reservation, handed out once as a single chunk (the one segment).
#[derive(Debug)]
struct WholeRange {
    base: u64,
    size: u64,
    taken: AtomicBool,
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
        // Chunks are unmapped by the resource (trim, drop), never by the engine; address space stays.
        self.taken.store(false, Ordering::Release);
        Ok(())
    }
}

struct State {
    engine: PoolEngine<WholeRange, CudaStreams>,
    table: ChunkTable,
    /// `chunks[i]` maps chunk `i` when `table` says it is mapped.
    chunks: Vec<Option<Mapping>>,
}

/// PyTorch's expandable segments as a memory resource: one reserved virtual range on one device,
/// suballocated by the coalescing best-fit pool engine (the engine of [`crate::PoolResource`]) as a
/// single segment; physical memory is mapped in chunks where allocations land.
///
/// - `allocate` asks the engine for a block of the range, then maps (`cuMemCreate` + `cuMemMap` +
///   `cuMemSetAccess` for the device) every chunk the block touches that is not mapped yet. Stream
///   semantics are the pool engine's (a stream reuses its own frees at once, other streams after an
///   event wait).
/// - Because there is one segment, free neighbours always coalesce: there is no per-segment
///   fragmentation of the address space, as there is when a pool grows by separate allocations.
/// - [`trim`](Self::trim) waits for the device, then unmaps and releases every chunk that no live
///   allocation touches: whole free chunks at the end of what is in use, and whole free chunks in holes.
///   The addresses stay reserved; an allocation that lands there maps a chunk again.
/// - When a chunk cannot be created for lack of memory, the resource trims and tries once more before
///   reporting out-of-memory (as PyTorch frees cached blocks and retries). With
///   [`Reclaim::BeforeGrowth`] it also trims before every growth, so that it never holds idle chunks
///   while it maps new ones.
///
/// ```no_run
/// # fn main() -> mempool_rmm::Result<()> {
/// use mempool_core::{Device, Stream};
/// use mempool_rmm::{ExpandableOptions, ExpandableResource, MemoryResource};
/// let dev = Device::get(0)?;
/// let mr = ExpandableResource::new(&dev, ExpandableOptions::default())?;
/// let stream = Stream::new(&dev.context()?)?;
/// let p = mr.allocate(64 << 20, stream.as_ref())?;
/// assert!(mr.stats().mapped_bytes >= 64 << 20);
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 64 << 20, stream.as_ref()) }?;
/// mr.trim()?; // unmaps the chunks
/// assert_eq!(mr.stats().mapped_bytes, 0);
/// # Ok(()) }
/// ```
pub struct ExpandableResource {
    // Fields drop in order: the state (the engine, then the mappings, each unmapped after waiting for
    // the device) before the reservation.
    state: Mutex<State>,
    reservation: Arc<Reservation>,
    props: AllocationProps,
    chunk: usize,
    reclaim: Reclaim,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for ExpandableResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.props.device)
            .field("base", &self.reservation.base())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ExpandableResource {
    /// An expandable resource on `device` laid out as `options` says ([`ExpandableOptions::default`]:
    /// PyTorch's layout). Reserves the address range now and maps nothing. Errors name the cause: a
    /// device without VMM support, a chunk size that is not a multiple of the granularity.
    pub fn new(device: &Device, options: ExpandableOptions) -> Result<ExpandableResource> {
        let device = *device;
        let props = AllocationProps::new(device);
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
        let want = match options.reservation {
            Some(r) => r,
            None => device.total_memory()?.saturating_mul(2),
        };
        let size = mempool_core::round_up(want.max(chunk), chunk).ok_or_else(|| Error::Unsupported {
            resource: NAME,
            reason: format!("a reservation of {want} bytes is not representable"),
        })?;
        let align = if chunk.is_power_of_two() { chunk } else { 0 };
        let reservation = Reservation::new(device, size, align, None)?;
        let ctx = device.context()?;
        let base = reservation.base().0;
        let engine_options = PoolOptions {
            initial_size: size as u64,
            maximum_size: Some(size as u64),
            event_policy: EventPolicy::Adaptive,
        };
        let upstream = WholeRange {
            base,
            size: size as u64,
            taken: AtomicBool::new(false),
        };
        let engine =
            PoolEngine::new(upstream, CudaStreams::new(&ctx), engine_options).map_err(|e| map_engine_error(NAME, e))?;
        let table = ChunkTable::new(base, size as u64, chunk as u64);
        let chunks = (0..table.live.len()).map(|_| None).collect();
        Ok(ExpandableResource {
            state: Mutex::new(State { engine, table, chunks }),
            reservation,
            props,
            chunk,
            reclaim: options.reclaim,
            ctx,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device whose memory it hands out.
    pub fn device(&self) -> Device {
        self.props.device
    }

    /// The reserved range's first address.
    pub fn base(&self) -> DeviceAddr {
        self.reservation.base()
    }

    /// What it holds now.
    pub fn stats(&self) -> ExpandableStats {
        let st = self.state();
        let engine: EngineStats = st.engine.stats();
        ExpandableStats {
            mapped_bytes: (st.table.mapped_count * self.chunk) as u64,
            peak_mapped_bytes: (st.table.peak_mapped * self.chunk) as u64,
            used_bytes: engine.used_bytes,
            reservation_bytes: self.reservation.size() as u64,
            chunk_size: self.chunk as u64,
        }
    }

    /// Waits for the device, then unmaps and releases every chunk no live allocation touches. Returns the
    /// bytes released.
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.state();
        self.trim_locked(&mut st)
    }

    fn trim_locked(&self, st: &mut State) -> Result<u64> {
        let idle = st.table.idle();
        if idle.is_empty() {
            return Ok(0);
        }
        // Frees were stream-ordered; unmapping is not: wait until no work can touch the chunks.
        self.ctx.synchronize()?;
        for &i in &idle {
            st.chunks[i] = None; // unmaps (the mapping waits for the device again: cheap once idle)
            st.table.set_mapped(i, false);
        }
        Ok((idle.len() * self.chunk) as u64)
    }

    /// Maps the chunks of `span` that are not mapped. On failure the chunks mapped so far stay mapped
    /// (idle, for a later trim or allocation).
    fn map_span(&self, st: &mut State, span: Range<usize>) -> Result<()> {
        for i in st.table.unmapped(span) {
            let phys = Arc::new(PhysicalAllocation::new(&self.props, self.chunk)?);
            let m = Mapping::new(&self.reservation, st.table.offset(i), phys)?;
            st.chunks[i] = Some(m);
            st.table.set_mapped(i, true);
        }
        Ok(())
    }
}

// SAFETY: the engine hands out disjoint, aligned ranges of the mapped segment (its invariants, tested on the host), which stays mapped while `self` lives; a range is handed out again only after `deallocate` returned it.
#[allow(unsafe_code)]
unsafe impl MemoryResource for ExpandableResource {
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let rounded = suballoc::align_up(bytes as u64).ok_or(Error::OutOfMemory {
            resource: NAME,
            requested: bytes,
        })?;
        let mut st = self.state();
        let addr = st
            .engine
            .allocate(bytes as u64, StreamKey::of(stream))
            .map_err(|e| map_engine_error(NAME, e))?;
        let span = st.table.span(addr, rounded);
        st.table.acquire(span.clone());
        if self.reclaim == Reclaim::BeforeGrowth && !st.table.unmapped(span.clone()).is_empty() {
            // The span's chunks are acquired, so they are not idle: only others are unmapped.
            if let Err(e) = self.trim_locked(&mut st) {
                st.table.release(span);
                let _ = st.engine.deallocate(addr, bytes as u64, StreamKey::of(stream));
                return Err(e);
            }
        }
        let mut result = self.map_span(&mut st, span.clone());
        if matches!(&result, Err(e) if e.is_out_of_memory()) {
            // Give back what no live allocation touches, then try once more.
            result = self
                .trim_locked(&mut st)
                .and_then(|_| self.map_span(&mut st, span.clone()));
        }
        match result {
            Ok(()) => Ok(DeviceAddr(addr)),
            Err(e) => {
                st.table.release(span);
                // The block was never handed out: nothing used it, so it goes straight back.
                let _ = st.engine.deallocate(addr, bytes as u64, StreamKey::of(stream));
                Err(match e {
                    Error::OutOfMemory { .. } => Error::OutOfMemory {
                        resource: NAME,
                        requested: bytes,
                    },
                    other => other,
                })
            }
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        let mut st = self.state();
        // The engine refuses an address or size that is not a live allocation, before the table changes.
        st.engine
            .deallocate(ptr.0, bytes as u64, StreamKey::of(stream))
            .map_err(|e| map_engine_error(NAME, e))?;
        let rounded = suballoc::align_up(bytes as u64).unwrap_or(bytes as u64);
        let span = st.table.span(ptr.0, rounded);
        st.table.release(span);
        Ok(())
    }

    fn name(&self) -> &'static str {
        NAME
    }
}

impl Drop for ExpandableResource {
    /// Returns everything, live allocations included, as RMM's resources do when destroyed: the engine
    /// synchronizes the context; then every mapping is unmapped (each after waiting for the device) and
    /// released, then the range is freed. Errors go to `mempool_core::take_drop_errors`.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = st.engine.release();
        let _ = self.ctx.synchronize();
        st.chunks.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn spans_cover_the_chunks_a_block_touches() {
        let t = ChunkTable::new(1 << 40, 64 * MIB, 2 * MIB);
        assert_eq!(t.live.len(), 32);
        let b = 1u64 << 40;
        assert_eq!(t.span(b, 1), 0..1);
        assert_eq!(t.span(b, 2 * MIB), 0..1);
        assert_eq!(t.span(b, 2 * MIB + 1), 0..2);
        assert_eq!(t.span(b + 2 * MIB - 256, 512), 0..2, "a block across a chunk boundary");
        assert_eq!(t.span(b + 62 * MIB, 2 * MIB), 31..32);
        assert_eq!(t.offset(3), (6 * MIB) as usize);
    }

    #[test]
    fn idle_chunks_are_mapped_ones_no_block_touches() {
        let mut t = ChunkTable::new(0, 16 * MIB, 2 * MIB);
        let a = t.span(0, 3 * MIB); // chunks 0, 1
        let b = t.span(3 * MIB, 4 * MIB); // chunks 1, 2, 3
        t.acquire(a.clone());
        t.acquire(b.clone());
        assert_eq!(t.unmapped(0..4), vec![0, 1, 2, 3]);
        for i in 0..4 {
            t.set_mapped(i, true);
        }
        assert_eq!(t.unmapped(0..4), Vec::<usize>::new());
        assert!(t.idle().is_empty());
        t.release(a);
        assert_eq!(t.idle(), vec![0], "chunk 1 is still touched by b");
        t.release(b);
        assert_eq!(t.idle(), vec![0, 1, 2, 3]);
        t.set_mapped(0, false);
        t.set_mapped(0, false); // idempotent
        assert_eq!(t.mapped_count, 3);
        assert_eq!(t.peak_mapped, 4);
    }

    #[test]
    fn the_engine_sees_one_segment_and_never_more() {
        let up = WholeRange {
            base: 1 << 40,
            size: 64 * MIB,
            taken: AtomicBool::new(false),
        };
        let key = StreamKey::of(StreamRef::LEGACY);
        assert_eq!(up.allocate(64 * MIB, key).unwrap(), 1 << 40);
        assert!(
            matches!(up.allocate(MIB, key), Err(suballoc::Error::OutOfMemory { requested, .. }) if requested == MIB)
        );
        up.deallocate(1 << 40, 64 * MIB, key).unwrap();
        assert!(up.allocate(65 * MIB, key).is_err(), "more than the range");
        assert_eq!(up.allocate(MIB, key).unwrap(), 1 << 40);
    }
}
