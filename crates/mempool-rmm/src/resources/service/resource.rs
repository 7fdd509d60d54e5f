//! [`ServiceResource`]: one reservation per device, a region of it per tag, each region suballocated by
//! the pool engine as one segment and backed by physical chunks mapped where allocations land. This file
//! holds the type, its construction, its tags and the lookups every other concern uses (a tag's region, the
//! region an address lies in, a stream bound to the resource's context); allocation, growth and reclaim,
//! sleep and wake, export and the observers are the other files of `service/`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mempool_core::{AllocationProps, Context, Device, DeviceAddr, Granularity, HandleTypes, Reservation, StreamRef};
use mempool_suballoc::{Engine, EventPolicy, PoolEngine, PoolOptions};

use crate::error::{Error, Result};
use crate::resources::service::fences::{Fences, RegionStreams};
use crate::resources::service::state::{Region, State, WholeRange};
use crate::resources::service::table::{check_tag_name, ChunkTable};
use crate::resources::service::types::{Reclaim, ServiceOptions, Tag};
use crate::resources::suballoc::map_engine_error;

const NAME: &str = "ServiceResource";

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
/// - **Tags**: every allocation belongs to a tag ([`tagged`](Self::tagged) gives a
///   [`TaggedResource`](super::TaggedResource) per tag; this resource's own `allocate` uses
///   [`Tag::DEFAULT`]), with statistics per tag.
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
    pub(super) state: Mutex<State>,
    pub(super) reservation: Arc<Reservation>,
    pub(super) props: AllocationProps,
    pub(super) chunk: usize,
    pub(super) region_size: usize,
    pub(super) max_tags: usize,
    pub(super) reclaim: Reclaim,
    pub(super) ctx: Arc<Context>,
    /// Its name in errors and `MemoryResource::name`.
    pub(super) name: &'static str,
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

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
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
    pub(super) fn region_slot(&self, addr: DeviceAddr) -> Option<usize> {
        addr.0
            .checked_sub(self.reservation.base().0)
            .filter(|&off| off < self.reservation.size() as u64)
            .map(|off| (off / self.region_size as u64) as usize)
    }

    pub(super) fn region_index(&self, st: &State, tag: Tag) -> Result<usize> {
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

    /// `stream` bound to the resource's context when it knows none (the legacy or per-thread stream, a raw
    /// handle): its synchronize and query then work from a thread with no current context.
    pub(super) fn own_context<'s>(&'s self, stream: StreamRef<'s>) -> StreamRef<'s> {
        match stream.context() {
            Some(_) => stream,
            None => stream.in_context(&self.ctx),
        }
    }
}

pub(super) fn asleep_error(resource: &'static str, name: &str, what: &str) -> Error {
    Error::Unsupported {
        resource,
        reason: format!("cannot {what} tag `{name}`: it is asleep (wake it first)"),
    }
}
