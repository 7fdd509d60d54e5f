//! [`ExpandableResource`]: PyTorch's expandable segments. One reserved virtual range per device, grown
//! by mapping physical chunks where allocations land, suballocated by the coalescing pool engine as one
//! segment, so the address space never fragments across segments.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{
    AllocationProps, Context, Device, DeviceAddr, Granularity, Mapping, PhysicalAllocation, Reservation, StreamRef,
};
use mempool_suballoc::{self as suballoc, Engine, EngineStats, EventPolicy, PoolEngine, PoolOptions};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::resources::service::resource::WholeRange;
use crate::resources::service::table::{over_watermark, ChunkTable};
use crate::resources::service::types::Reclaim;
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

struct State {
    engine: PoolEngine<WholeRange, CudaStreams>,
    table: ChunkTable,
    /// The most bytes live at once (the watermark's reference).
    peak_used: u64,
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
        let upstream = WholeRange::new(base, size as u64);
        let engine =
            PoolEngine::new(upstream, CudaStreams::new(&ctx), engine_options).map_err(|e| map_engine_error(NAME, e))?;
        let table = ChunkTable::new(base, size as u64, chunk as u64);
        let chunks = (0..table.len()).map(|_| None).collect();
        Ok(ExpandableResource {
            state: Mutex::new(State {
                engine,
                table,
                peak_used: 0,
                chunks,
            }),
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
            mapped_bytes: (st.table.mapped_count() * self.chunk) as u64,
            peak_mapped_bytes: (st.table.peak_mapped() * self.chunk) as u64,
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
        let new = (st.table.unmapped(span.clone()).len() * self.chunk) as u64;
        let reclaim = new > 0
            && match self.reclaim {
                Reclaim::OnOutOfMemory => false,
                Reclaim::BeforeGrowth => true,
                Reclaim::Watermark { percent } => {
                    let used = st.engine.stats().used_bytes;
                    st.peak_used = st.peak_used.max(used);
                    over_watermark(
                        (st.table.mapped_count() * self.chunk) as u64,
                        new,
                        st.peak_used,
                        percent,
                    )
                }
            };
        if reclaim {
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
