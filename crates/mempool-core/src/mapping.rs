//! Virtual memory management, the address side: [`Reservation`] (`cuMemAddressReserve`), [`Mapping`]
//! (`cuMemMap` / `cuMemUnmap`) and access (`cuMemSetAccess` / `cuMemGetAccess`).
//!
//! Teardown order is what the driver requires, by construction: a [`Mapping`] holds an `Arc` of its
//! [`PhysicalAllocation`] and of its [`Reservation`], and its `Drop` unmaps before those fields drop; so
//! the unmap comes before the release of the physical handle, and the release before the reservation is
//! freed (the reservation is freed when the last mapping into it and its last `Arc` are gone).
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::raw::{self, sys};
use crate::stream::StreamRef;
use crate::types::{Access, Device, DeviceAddr};
use crate::view::BufferView;
use crate::vmm::{check_granular, AllocationProps, Granularity, PhysicalAllocation};

/// The driver's form of an access.
fn access_to_raw(access: Access) -> sys::CUmemAccess_flags {
    use sys::CUmemAccess_flags::*;
    match access {
        Access::None => CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn device_location(device: Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device.as_raw(),
    }
}

/// What a reservation knows of its mappings and of the devices given access to them.
#[derive(Debug, Default)]
struct MapState {
    /// Mapped ranges: offset -> length. Invariant: disjoint, inside the reservation.
    mapped: BTreeMap<usize, usize>,
    /// Every device ever granted access to a range of the reservation: the devices whose work may touch
    /// it, synchronized before anything is unmapped.
    accessors: Vec<Device>,
}

/// Whether `offset..offset+len` is covered by the mapped ranges, back to back.
fn fully_mapped(mapped: &BTreeMap<usize, usize>, offset: usize, len: usize) -> bool {
    let Some(end) = offset.checked_add(len) else {
        return false;
    };
    let mut at = offset;
    // The mapping that contains `offset` starts at or before it.
    let first = mapped.range(..=offset).next_back().map(|(o, _)| *o).unwrap_or(offset);
    for (&o, &l) in mapped.range(first..) {
        if at >= end {
            break;
        }
        if o > at {
            return false;
        }
        at = at.max(o + l);
    }
    at >= end && len > 0
}

/// Whether `offset..offset+len` overlaps a mapped range.
fn overlaps(mapped: &BTreeMap<usize, usize>, offset: usize, len: usize) -> bool {
    let end = offset + len;
    if let Some((&o, &l)) = mapped.range(..end).next_back() {
        return o + l > offset;
    }
    false
}

/// The alignment a reservation is made with: `alignment`, or the granularity `g` for 0; refused unless a
/// power of two and a multiple of `g` (every address `cuMemMap` maps at must be granular).
fn reservation_alignment(alignment: usize, g: usize) -> Result<usize> {
    let a = if alignment == 0 { g } else { alignment };
    if !a.is_power_of_two() || g == 0 || !a.is_multiple_of(g) {
        return Err(Error::InvalidArgument(format!(
            "the reservation's alignment is {alignment} bytes: it must be 0 (the granularity) or a power of \
             two that is a multiple of the minimum granularity, {g} bytes"
        )));
    }
    Ok(a)
}

/// A range of virtual address space (`cuMemAddressReserve`), freed (`cuMemAddressFree`) when the last
/// `Arc` of it drops, which is after every [`Mapping`] into it is unmapped.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use std::sync::Arc;
/// use mempool_core::{AllocationProps, Device, Granularity, Mapping, PhysicalAllocation, Reservation};
/// let dev = Device::get(0)?;
/// let props = AllocationProps::new(dev);
/// let g = dev.vmm_granularity(&props, Granularity::Minimum)?;
/// let va = Reservation::new(dev, 4 * g, 0, None)?;
/// let phys = Arc::new(PhysicalAllocation::new(&props, 2 * g)?);
/// let m = Mapping::new(&va, g, phys)?; // maps it at va.base() + g and grants dev read-write access
/// assert_eq!(m.addr(), va.base().offset(g));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Reservation {
    // Invariant: `base..base+size` is one live reservation this value frees once, on drop, when nothing
    // of it is mapped (mappings hold an `Arc` of it).
    base: DeviceAddr,
    size: usize,
    granularity: usize,
    device: Device,
    ctx: Arc<Context>,
    state: Mutex<MapState>,
}

impl Reservation {
    /// Reserves `size` bytes of address space (a non-zero multiple of `device`'s minimum granularity),
    /// aligned to `alignment` (0: the granularity; otherwise a power of two that is a multiple of the
    /// granularity, since `cuMemMap` needs every mapped address granular), at `hint` if the driver can
    /// place it there (a request, not a promise: see [`Reservation::base`]).
    ///
    /// Address space is shared by every device of the process (unified addressing); `device` names
    /// the granularity and the context the calls run in. Errors: [`Error::CapabilityMissing`] without
    /// VMM support, [`Error::NotGranular`] for a size or hint, [`Error::InvalidArgument`] for an
    /// alignment below the granularity or not a power of two, [`Error::OutOfMemory`] when no such range
    /// is free.
    pub fn new(device: Device, size: usize, alignment: usize, hint: Option<DeviceAddr>) -> Result<Arc<Reservation>> {
        let g = device.vmm_granularity(&AllocationProps::new(device), Granularity::Minimum)?;
        check_granular("the reservation's size", size, g)?;
        let alignment = reservation_alignment(alignment, g)?;
        if let Some(h) = hint {
            if !h.0.is_multiple_of(g as u64) {
                return Err(Error::NotGranular {
                    what: "the reservation's address hint",
                    value: h.0 as usize,
                    granularity: g,
                });
            }
        }
        let ctx = device.context()?;
        let base = {
            let _g = ctx.bind()?;
            raw::vmm::address_reserve(size, alignment, hint.map_or(0, |h| h.0))?
        };
        let reservation = Arc::new(Reservation {
            base: DeviceAddr(base),
            size,
            granularity: g,
            device,
            ctx,
            state: Mutex::new(MapState::default()),
        });
        if !base.is_multiple_of(alignment as u64) {
            // Not what was asked for: give it back (dropping the value frees it) and say so.
            return Err(Error::InvalidArgument(format!(
                "cuMemAddressReserve returned {} for an alignment of {alignment} bytes",
                DeviceAddr(base)
            )));
        }
        Ok(reservation)
    }

    /// The first address (where the driver placed it; compare with a hint to see if it was honoured).
    pub fn base(&self) -> DeviceAddr {
        self.base
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The minimum granularity that offsets into it are checked against.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The device it was reserved for (its granularity and context).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether `offset..offset+len` is entirely mapped (by one mapping or several back to back).
    pub fn is_mapped(&self, offset: usize, len: usize) -> bool {
        fully_mapped(&self.lock().mapped, offset, len)
    }

    /// Sets each device's access to `offset..offset+len`, which must be fully mapped (by one or more
    /// mappings back to back, possibly of different devices' memory: a striped range), in one
    /// `cuMemSetAccess`. A device other than a mapping's owner needs peer capability
    /// (`cuDeviceCanAccessPeer`).
    ///
    /// This safe form only grants: it refuses ([`Error::InvalidArgument`]) `Access::None`, and
    /// `Access::Read` for a device that has read-write access to part of the range, since a
    /// [`BufferView`] of a mapping may be copying through that access. Lowering access is
    /// [`set_access_unchecked`](Self::set_access_unchecked).
    pub fn set_access(&self, offset: usize, len: usize, access: &[(Device, Access)]) -> Result<()> {
        // SAFETY: 1. `may_lower` is false: what would lower access is refused before the driver is asked.
        #[allow(unsafe_code)]
        unsafe {
            self.set_access_inner(offset, len, access, false)
        }
    }

    /// As [`set_access`](Self::set_access), and may also lower or revoke access: it first waits for all
    /// work of every device ever granted access to the reservation, then sets the access.
    ///
    /// # Safety
    /// 1. Nothing on the host relies on the access this lowers while it is lowered: no [`BufferView`] of
    ///    the range is alive ([`Mapping::view`], `GrowableBuffer::view`), and no code that was handed the
    ///    range's addresses will copy through them before access is granted again.
    /// 2. No device work that touches the range through a lowered access is queued after this call
    ///    (work queued before it is waited for).
    #[allow(unsafe_code)]
    pub unsafe fn set_access_unchecked(&self, offset: usize, len: usize, access: &[(Device, Access)]) -> Result<()> {
        // SAFETY: 1. points 1 and 2 are the caller's.
        unsafe { self.set_access_inner(offset, len, access, true) }
    }

    /// The checks and the call behind [`set_access`](Self::set_access) (`may_lower` false: lowering is
    /// refused) and [`set_access_unchecked`](Self::set_access_unchecked) (`may_lower` true).
    ///
    /// # Safety
    /// 1. With `may_lower` true, points 1 and 2 of [`Reservation::set_access_unchecked`]'s `# Safety` hold
    ///    for the range and the access.
    #[allow(unsafe_code)]
    unsafe fn set_access_inner(
        &self,
        offset: usize,
        len: usize,
        access: &[(Device, Access)],
        may_lower: bool,
    ) -> Result<()> {
        let not_mapped = || {
            Error::InvalidArgument(format!(
                "cannot set access to {len} bytes at offset {offset} of a reservation of {} bytes: the \
                 range is not entirely mapped (cuMemSetAccess needs a fully mapped range)",
                self.size
            ))
        };
        let mut st = self.lock();
        if !fully_mapped(&st.mapped, offset, len) {
            return Err(not_mapped());
        }
        let _g = self.ctx.bind()?;
        if !may_lower {
            for (d, a) in access {
                match a {
                    Access::ReadWrite => {}
                    Access::None => {
                        return Err(Error::InvalidArgument(format!(
                            "Reservation::set_access does not revoke access (device {} to Access::None): a \
                             live view may be using it; revoking is the unsafe set_access_unchecked",
                            d.ordinal()
                        )))
                    }
                    Access::Read => {
                        // The mappings the range covers; each has one access setting per device.
                        let first = st.mapped.range(..=offset).next_back().map_or(offset, |(o, _)| *o);
                        let end = offset + len;
                        for (&o, _) in st.mapped.range(first..end) {
                            let now = self.access_at(*d, o)?;
                            if now == Access::ReadWrite {
                                return Err(Error::InvalidArgument(format!(
                                    "Reservation::set_access does not lower device {}'s read-write access to \
                                     the mapping at offset {o} to read-only: a live view may be writing \
                                     through it; lowering is the unsafe set_access_unchecked",
                                    d.ordinal()
                                )));
                            }
                        }
                    }
                }
            }
        }
        if may_lower && access.iter().any(|(_, a)| *a != Access::ReadWrite) {
            // Unmapping (Mapping::drop) is not stream-ordered and neither is this: wait for the devices'
            // work without holding the lock, then retake it and check the range again, since a mapping
            // may have been unmapped meanwhile.
            drop(_g);
            drop(st);
            self.synchronize_accessors()?;
            st = self.lock();
            if !fully_mapped(&st.mapped, offset, len) {
                return Err(not_mapped());
            }
            // SAFETY: 1. `st` is `self.state`'s lock, retaken, and the range was checked fully mapped under
            // it just now. 2. lowering is vouched for by point 1 of this function (`may_lower`), and the
            // accessors' work was waited for above.
            return unsafe { self.apply_access(&mut st, offset, len, access) };
        }
        drop(_g);
        // SAFETY: 1. `st` is `self.state`'s lock, held since the range was checked fully mapped. 2. nothing
        // is lowered: without `may_lower` the checks above refused it, and with it lowering went through the
        // branch above.
        unsafe { self.apply_access(&mut st, offset, len, access) }
    }

    /// The `cuMemSetAccess` itself, under the lock `st` (taken from `self.state`) after the checks.
    ///
    /// # Safety
    /// 1. `st` is the state behind `self.state`'s lock, held by the caller since it checked that
    ///    `offset..offset + len` is fully mapped (so no mapping of the range is unmapped meanwhile).
    /// 2. Any access this lowers is vouched for as [`Reservation::set_access_unchecked`]'s `# Safety`
    ///    asks, and the work of the devices that had it was waited for.
    #[allow(unsafe_code)]
    unsafe fn apply_access(
        &self,
        st: &mut MapState,
        offset: usize,
        len: usize,
        access: &[(Device, Access)],
    ) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|(d, a)| sys::CUmemAccessDesc {
                location: device_location(*d),
                flags: access_to_raw(*a),
            })
            .collect();
        let _g = self.ctx.bind()?;
        // SAFETY: the range is fully mapped by mappings into this reservation (point 1: checked by the
        // caller under the lock it still holds, which keeps them from being unmapped meanwhile); anything
        // that lowers access is vouched for and was waited for (point 2).
        unsafe { raw::vmm::set_access(self.base.0 + offset as u64, len, &descs) }?;
        for (d, a) in access {
            if *a != Access::None && !st.accessors.contains(d) {
                st.accessors.push(*d);
            }
        }
        Ok(())
    }

    /// `device`'s access to the mapping at `offset` (`cuMemGetAccess`). An offset past the reservation
    /// is refused ([`Error::InvalidArgument`]); an unmapped one is the driver's error.
    pub fn access(&self, device: Device, offset: usize) -> Result<Access> {
        let _g = self.ctx.bind()?;
        self.access_at(device, offset)
    }

    /// [`access`](Self::access) with a context already bound.
    fn access_at(&self, device: Device, offset: usize) -> Result<Access> {
        if offset >= self.size {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} lies outside the reservation of {} bytes",
                self.size
            )));
        }
        let addr =
            self.base.0.checked_add(offset as u64).ok_or_else(|| {
                Error::InvalidArgument(format!("offset {offset} past the reservation at {}", self.base))
            })?;
        let flags = raw::vmm::get_access(&device_location(device), addr)?;
        use sys::CUmemAccess_flags::*;
        Ok(match flags {
            f if f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64 => Access::ReadWrite,
            f if f == CU_MEM_ACCESS_FLAGS_PROT_READ as u64 => Access::Read,
            _ => Access::None,
        })
    }

    /// Waits for all work of every device that was granted access to the reservation: before an
    /// unmap, nothing may still use the range.
    ///
    /// A context-wide wait (`cuCtxSynchronize` per device), kept on purpose for the two callers that
    /// know nothing narrower: a mapping's safe drop and [`Reservation::set_access_unchecked`]. A
    /// reservation records no streams, and its addresses reach code that records none either (views
    /// whose `fill` is asynchronous, raw pointers passed to kernels, peers granted access), so the work
    /// still touching a range can be on any stream of any device granted access. Owners that track the
    /// streams that used a range wait for those and unmap with [`Mapping::unmap_waited`] instead.
    fn synchronize_accessors(&self) -> Result<()> {
        let devices = self.lock().accessors.clone();
        for d in devices {
            d.context()?.synchronize()?;
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, MapState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if !st.mapped.is_empty() {
            // A mapping that could not be unmapped left its range recorded (Mapping::drop): freeing the
            // address range under it would let the driver hand the addresses out again while mapped.
            crate::drop_errors::record(Error::Leaked {
                what: format!("the reservation of {} bytes at {}", self.size, self.base),
                cause: format!(
                    "{} range(s) of it are still mapped (a mapping could not be unmapped; its error was \
                     reported before this one)",
                    st.mapped.len()
                ),
            });
            return;
        }
        let r = self.ctx.bind().and_then(|_g| {
            // SAFETY: the type's invariant: one reservation, freed once; every mapping holds an `Arc`
            // of `self`, so none is alive, and each unmapped its range (it removes its range from
            // `mapped` only once the unmap succeeded, and `mapped` is empty).
            #[allow(unsafe_code)]
            let r = unsafe { raw::vmm::address_free(self.base.0, self.size) };
            r.map_err(Error::from)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
        }
    }
}

/// A physical allocation mapped at an offset of a reservation (`cuMemMap`), unmapped (`cuMemUnmap`) on
/// drop after waiting for the work of every device granted access to the reservation. It holds both
/// the allocation and the reservation, so they outlive it.
///
/// An owner that knows what used the range (it recorded an event on every stream that did, say) waits for
/// that itself and unmaps with [`unmap_waited`](Self::unmap_waited), which skips the wait for whole devices.
#[derive(Debug)]
pub struct Mapping {
    // Invariant: `reservation.base + offset .. + physical.size()` is mapped to `physical`, recorded in the
    // reservation's state; this value unmaps it once, on drop, before its fields drop.
    offset: usize,
    physical: Arc<PhysicalAllocation>,
    reservation: Arc<Reservation>,
    /// Whether the drop waits for every device granted access before it unmaps: true but after
    /// `unmap_waited`, whose caller waited for what used the range.
    wait_on_drop: bool,
}

impl Mapping {
    /// Maps all of `physical` at `offset` of `reservation` and grants its own device read-write access
    /// (a new mapping has no access at all until `cuMemSetAccess`).
    ///
    /// Errors: [`Error::NotGranular`] for an offset that is not a multiple of the allocation's
    /// granularity, [`Error::ReservationFull`] when it does not fit, [`Error::InvalidArgument`] when the
    /// range overlaps another mapping; the driver's error otherwise (e.g. an imported allocation smaller
    /// than the size its importer gave).
    pub fn new(reservation: &Arc<Reservation>, offset: usize, physical: Arc<PhysicalAllocation>) -> Result<Mapping> {
        let owner = physical.device();
        let m = Mapping::without_access(reservation, offset, physical)?;
        m.set_access(&[(owner, Access::ReadWrite)])?;
        Ok(m)
    }

    /// Maps all of `physical` at `offset` of `reservation` and grants nobody access: the caller sets it,
    /// for example once over several mappings with [`Reservation::set_access`].
    pub fn without_access(
        reservation: &Arc<Reservation>,
        offset: usize,
        physical: Arc<PhysicalAllocation>,
    ) -> Result<Mapping> {
        let size = physical.size();
        let g = raw::vmm::granularity(&physical.props().to_raw(), false)?.max(reservation.granularity);
        if !offset.is_multiple_of(g) {
            return Err(Error::NotGranular {
                what: "the mapping's offset into its reservation",
                value: offset,
                granularity: g,
            });
        }
        if offset.checked_add(size).is_none_or(|end| end > reservation.size) {
            return Err(Error::ReservationFull {
                requested: size,
                offset,
                capacity: reservation.size,
            });
        }
        // The reservation's base is aligned to its own device's granularity; an allocation with a coarser
        // one (other properties) needs the address itself granular.
        let addr = reservation.base.0 + offset as u64;
        if !addr.is_multiple_of(g as u64) {
            return Err(Error::NotGranular {
                what: "the mapping's address (the reservation's base plus the offset)",
                value: addr as usize,
                granularity: g,
            });
        }
        let mut st = reservation.lock();
        if overlaps(&st.mapped, offset, size) {
            return Err(Error::InvalidArgument(format!(
                "cannot map {size} bytes at offset {offset}: the range overlaps a mapping of the reservation"
            )));
        }
        let _g = reservation.ctx.bind()?;
        // SAFETY: the range lies inside the live reservation (checked) and overlaps no mapping (checked
        // under the lock, which is held until the range is recorded); `physical` is live, held by the
        // `Mapping` built below, and `size` is its size.
        #[allow(unsafe_code)]
        unsafe { raw::vmm::map(addr, size, physical.as_raw()) }?;
        st.mapped.insert(offset, size);
        drop(st);
        Ok(Mapping {
            offset,
            physical,
            reservation: reservation.clone(),
            wait_on_drop: true,
        })
    }

    /// Sets each device's access to this mapping (see [`Reservation::set_access`]: it grants, never
    /// lowers).
    pub fn set_access(&self, access: &[(Device, Access)]) -> Result<()> {
        self.reservation.set_access(self.offset, self.len(), access)
    }

    /// Sets each device's access to this mapping, lowering or revoking it too (see
    /// [`Reservation::set_access_unchecked`]).
    ///
    /// # Safety
    /// 1. As [`Reservation::set_access_unchecked`]: no live view of the mapping, nor any other host or
    ///    device use of it, relies on the access this lowers.
    #[allow(unsafe_code)]
    pub unsafe fn set_access_unchecked(&self, access: &[(Device, Access)]) -> Result<()> {
        // SAFETY: point 1 is the caller's, for this mapping's range.
        unsafe { self.reservation.set_access_unchecked(self.offset, self.len(), access) }
    }

    /// `device`'s access to this mapping.
    pub fn access(&self, device: Device) -> Result<Access> {
        self.reservation.access(device, self.offset)
    }

    /// The first mapped address.
    pub fn addr(&self) -> DeviceAddr {
        self.reservation.base.offset(self.offset)
    }

    /// The mapped length: the physical allocation's size.
    pub fn len(&self) -> usize {
        self.physical.size()
    }

    /// Never true: a physical allocation has at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Where it starts in its reservation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The physical allocation it maps (map it elsewhere too by cloning the `Arc`).
    pub fn physical(&self) -> &Arc<PhysicalAllocation> {
        &self.physical
    }

    /// The reservation it lies in.
    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }

    /// A view of the mapped bytes for host copies and fills ordered on `stream` (a stream of the physical
    /// allocation's device, or a special handle). The view borrows the mapping, so it cannot outlive it.
    ///
    /// The view copies through the owning device's context, so that device needs read-write access:
    /// a mapping made with [`without_access`](Self::without_access) and not yet granted it is refused
    /// ([`Error::InvalidArgument`] naming the access it has).
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        let owner = self.physical.device();
        let ctx = owner.context()?;
        let has = self.access(owner)?;
        if has != Access::ReadWrite {
            return Err(Error::InvalidArgument(format!(
                "cannot view the mapping of {} bytes at {}: its device {} has {has:?} access to it, and a \
                 view copies through that device, which needs read-write (grant it with set_access)",
                self.len(),
                self.addr(),
                owner.ordinal()
            )));
        }
        // SAFETY: 1. the range is mapped memory the driver reaches by unified addressing, and stays
        // mapped while `self` lives, which the view borrows; nothing frees it through the view (dropping a
        // view frees nothing). The owner has read-write access (checked above) and no safe call lowers
        // it (`set_access` only grants; lowering is `unsafe`, its caller vouching that no view is alive).
        // 2. a mapping carries no stream order: the map and the access grant are
        // synchronous, so any stream may use it from now on. 3. a stream without a context is taken as a
        // stream of the device's context (the documented requirement). 4. the address is not null.
        #[allow(unsafe_code)]
        Ok(unsafe { BufferView::new(self.addr(), self.len(), stream, ctx) })
    }
}

impl Mapping {
    /// Unmaps the range now, without the wait for every device granted access that dropping a mapping
    /// does (`cuCtxSynchronize` of each: it stalls every thread's work on those devices, and every other
    /// thread's driver calls behind the driver's locks). For an owner that knows which streams used the
    /// range and has waited for them (the events it recorded on each). Like a drop, a failure to unmap
    /// keeps the range recorded and the physical allocation alive, and is reported through
    /// [`crate::take_drop_errors`].
    ///
    /// # Safety
    /// 1. No work that touches the range (a kernel, a copy, a memset, on any stream of any device) is
    ///    still queued or running: the caller has waited for all of it.
    /// 2. None will be queued after this call (nothing that was handed the range's addresses uses them
    ///    until something is mapped there again).
    #[allow(unsafe_code)]
    pub unsafe fn unmap_waited(mut self) {
        // The drop below unmaps at once: points 1 and 2 are the wait it skips.
        self.wait_on_drop = false;
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let res = &self.reservation;
        let len = self.physical.size();
        // The safe path knows nothing of what used the range (its address is handed out: views, raw
        // pointers, peers granted access), so only a wait for everything on the devices that may reach
        // it covers the work still touching it. `unmap_waited`'s caller did the narrower wait itself.
        let waited = if self.wait_on_drop {
            res.synchronize_accessors()
        } else {
            Ok(())
        };
        let r = waited.and_then(|()| {
            let mut st = res.lock();
            let _g = res.ctx.bind()?;
            // SAFETY: the type's invariant: this exact range was mapped by `new` and is unmapped once,
            // here; every device granted access has finished its work (synchronized above), or, after
            // `unmap_waited`, its caller waited for every piece of work that touches the range (its
            // points 1 and 2); the address is not handed out again by this value.
            #[allow(unsafe_code)]
            unsafe { raw::vmm::unmap(res.base.0 + self.offset as u64, len) }?;
            // Only a range that is really unmapped leaves the record: the reservation frees its
            // addresses only when nothing is recorded.
            st.mapped.remove(&self.offset);
            Ok(())
        });
        if let Err(e) = r {
            // Not unmapped (or not known to be): keep everything the mapping may still use. The range
            // stays recorded, so the reservation's `Drop` does not free the addresses; the physical
            // allocation is kept by an `Arc` that is never dropped, so its handle is not released.
            std::mem::forget(self.physical.clone());
            crate::drop_errors::record(Error::Leaked {
                what: format!(
                    "the mapping of {len} bytes at {} (with its physical allocation and address range)",
                    self.addr()
                ),
                cause: format!("it could not be unmapped: {e}"),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(ranges: &[(usize, usize)]) -> BTreeMap<usize, usize> {
        ranges.iter().copied().collect()
    }

    #[test]
    fn fully_mapped_needs_back_to_back_cover() {
        let m = map(&[(0, 4), (4, 4), (12, 4)]);
        assert!(fully_mapped(&m, 0, 8));
        assert!(fully_mapped(&m, 2, 6), "starting inside a mapping");
        assert!(!fully_mapped(&m, 0, 9), "8..12 is a hole");
        assert!(!fully_mapped(&m, 8, 4));
        assert!(fully_mapped(&m, 12, 4));
        assert!(!fully_mapped(&m, 12, 5), "past the last mapping");
        assert!(!fully_mapped(&m, 0, 0), "an empty range is not a mapped range");
        assert!(!fully_mapped(&m, usize::MAX, 2));
        assert!(!fully_mapped(&BTreeMap::new(), 0, 1));
    }

    #[test]
    fn overlap_detection() {
        let m = map(&[(4, 4), (12, 4)]);
        assert!(!overlaps(&m, 0, 4));
        assert!(overlaps(&m, 0, 5));
        assert!(!overlaps(&m, 8, 4));
        assert!(overlaps(&m, 7, 1));
        assert!(overlaps(&m, 15, 8));
        assert!(!overlaps(&m, 16, 8));
        assert!(!overlaps(&BTreeMap::new(), 0, 8));
    }

    #[test]
    fn alignment_is_the_granularity_or_a_power_of_two_multiple() {
        let g = 2 << 20;
        assert_eq!(
            reservation_alignment(0, g),
            Ok(g),
            "0 is the granularity, not the driver's default"
        );
        assert_eq!(reservation_alignment(g, g), Ok(g));
        assert_eq!(reservation_alignment(4 * g, g), Ok(4 * g));
        let e = reservation_alignment(4096, g).unwrap_err();
        assert!(
            e.to_string()
                .contains("multiple of the minimum granularity, 2097152 bytes"),
            "{e}"
        );
        assert!(reservation_alignment(3 * g, g).is_err(), "not a power of two");
        assert!(reservation_alignment(3, g).is_err());
        assert!(reservation_alignment(0, 0).is_err(), "no granularity");
    }

    /// A reservation value of a made-up range in a context that was never retained: its `Drop` runs the
    /// real code, which without a driver cannot reach the driver.
    fn fake_reservation(base: u64, mapped: &[(usize, usize)]) -> Arc<Reservation> {
        Arc::new(Reservation {
            base: DeviceAddr(base),
            size: 8 << 20,
            granularity: 2 << 20,
            device: Device::from_parts(0, 0),
            ctx: Context::unretained_for_tests(0),
            state: Mutex::new(MapState {
                mapped: map(mapped),
                accessors: Vec::new(),
            }),
        })
    }

    /// The drop-error list is global: the tests that take it run one at a time.
    static DROP_ERRORS_TESTS: Mutex<()> = Mutex::new(());

    fn leaks_of(errors: &[Error], what: &str) -> usize {
        errors
            .iter()
            .filter(|e| matches!(e, Error::Leaked { what: w, .. } if w.contains(what)))
            .count()
    }

    #[test]
    fn a_reservation_with_a_mapped_range_is_not_freed() {
        if crate::raw::library_present() {
            return; // only without a driver is the made-up range never handed to it
        }
        let _serial = DROP_ERRORS_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        drop(fake_reservation(0x7100_0000_0000, &[(2 << 20, 2 << 20)]));
        let errors = crate::drop_errors::take_drop_errors();
        assert_eq!(
            leaks_of(&errors, "the reservation of 8388608 bytes at 0x710000000000"),
            1,
            "the address free is skipped and reported: {errors:?}"
        );
    }

    #[test]
    fn a_mapping_that_cannot_unmap_keeps_its_range_and_memory() {
        if crate::raw::library_present() {
            return; // without a driver, binding the context fails before the unmap
        }
        let _serial = DROP_ERRORS_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let res = fake_reservation(0x7200_0000_0000, &[(0, 2 << 20)]);
        let physical = Arc::new(PhysicalAllocation::fake_for_tests(2 << 20));
        let m = Mapping {
            offset: 0,
            physical: physical.clone(),
            reservation: res.clone(),
            wait_on_drop: true,
        };
        drop(m);
        assert!(res.is_mapped(0, 2 << 20), "a failed unmap leaves the range recorded");
        assert_eq!(
            Arc::strong_count(&physical),
            2,
            "the mapping's reference to the physical allocation is kept, never released"
        );
        drop(res);
        let errors = crate::drop_errors::take_drop_errors();
        assert_eq!(
            leaks_of(&errors, "the mapping of 2097152 bytes at 0x720000000000"),
            1,
            "{errors:?}"
        );
        assert_eq!(
            leaks_of(&errors, "the reservation of 8388608 bytes at 0x720000000000"),
            1,
            "{errors:?}"
        );
        // Our own reference is leaked on purpose too: its release would fail without a driver anyway.
        std::mem::forget(physical);
    }

    #[test]
    fn without_a_driver_nothing_is_reserved() {
        if crate::raw::library_present() {
            return;
        }
        let e = Reservation::new(Device::from_parts(0, 0), 2 << 20, 0, None).unwrap_err();
        assert_eq!(e, Error::DriverNotFound);
    }
}
