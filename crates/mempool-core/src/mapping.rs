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
    /// aligned to `alignment` (0: the granularity; otherwise a power of two), at `hint` if the driver
    /// can place it there (a request, not a promise: see [`Reservation::base`]).
    ///
    /// Address space is shared by every device of the process (unified addressing); `device` names
    /// the granularity and the context the calls run in. Errors: [`Error::CapabilityMissing`] without
    /// VMM support, [`Error::NotGranular`], [`Error::OutOfMemory`] when no such range is free.
    pub fn new(device: Device, size: usize, alignment: usize, hint: Option<DeviceAddr>) -> Result<Arc<Reservation>> {
        let g = device.vmm_granularity(&AllocationProps::new(device), Granularity::Minimum)?;
        check_granular("the reservation's size", size, g)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "the reservation's alignment is {alignment} bytes: it must be 0 or a power of two"
            )));
        }
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
        Ok(Arc::new(Reservation {
            base: DeviceAddr(base),
            size,
            granularity: g,
            device,
            ctx,
            state: Mutex::new(MapState::default()),
        }))
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
    /// (`cuDeviceCanAccessPeer`); revoking access waits for the devices' work first.
    pub fn set_access(&self, offset: usize, len: usize, access: &[(Device, Access)]) -> Result<()> {
        let mut st = self.lock();
        if !fully_mapped(&st.mapped, offset, len) {
            return Err(Error::InvalidArgument(format!(
                "cannot set access to {len} bytes at offset {offset} of a reservation of {} bytes: the \
                 range is not entirely mapped (cuMemSetAccess needs a fully mapped range)",
                self.size
            )));
        }
        if access.iter().any(|(_, a)| *a == Access::None) {
            drop(st);
            self.synchronize_accessors()?;
            st = self.lock();
        }
        let descs: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|(d, a)| sys::CUmemAccessDesc {
                location: device_location(*d),
                flags: access_to_raw(*a),
            })
            .collect();
        let _g = self.ctx.bind()?;
        // SAFETY: the range is fully mapped by mappings into this reservation (checked under the lock,
        // which keeps them from being unmapped meanwhile); any revocation waited for the accessors' work.
        #[allow(unsafe_code)]
        unsafe { raw::vmm::set_access(self.base.0 + offset as u64, len, &descs) }?;
        for (d, a) in access {
            if *a != Access::None && !st.accessors.contains(d) {
                st.accessors.push(*d);
            }
        }
        Ok(())
    }

    /// `device`'s access to the mapping at `offset` (`cuMemGetAccess`).
    pub fn access(&self, device: Device, offset: usize) -> Result<Access> {
        let _g = self.ctx.bind()?;
        let flags = raw::vmm::get_access(&device_location(device), self.base.0 + offset as u64)?;
        use sys::CUmemAccess_flags::*;
        Ok(match flags {
            f if f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64 => Access::ReadWrite,
            f if f == CU_MEM_ACCESS_FLAGS_PROT_READ as u64 => Access::Read,
            _ => Access::None,
        })
    }

    /// Waits for all work of every device that was granted access to the reservation: before an
    /// unmap, nothing may still use the range.
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
        let r = self.ctx.bind().and_then(|_g| {
            // SAFETY: the type's invariant: one reservation, freed once; every mapping holds an `Arc`
            // of `self`, so none is left.
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
#[derive(Debug)]
pub struct Mapping {
    // Invariant: `reservation.base + offset .. + physical.size()` is mapped to `physical`, recorded in the
    // reservation's state; this value unmaps it once, on drop, before its fields drop.
    offset: usize,
    physical: Arc<PhysicalAllocation>,
    reservation: Arc<Reservation>,
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
        unsafe { raw::vmm::map(reservation.base.0 + offset as u64, size, physical.as_raw()) }?;
        st.mapped.insert(offset, size);
        drop(st);
        Ok(Mapping {
            offset,
            physical,
            reservation: reservation.clone(),
        })
    }

    /// Sets each device's access to this mapping (see [`Reservation::set_access`]).
    pub fn set_access(&self, access: &[(Device, Access)]) -> Result<()> {
        self.reservation.set_access(self.offset, self.len(), access)
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
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        let ctx = self.physical.device().context()?;
        // SAFETY: 1. the range is mapped memory the driver reaches by unified addressing, and stays
        // mapped while `self` lives, which the view borrows; nothing frees it through the view (dropping a
        // view frees nothing). 2. a mapping carries no stream order: the map and the access grant are
        // synchronous, so any stream may use it from now on. 3. a stream without a context is taken as a
        // stream of the device's context (the documented requirement). 4. the address is not null.
        #[allow(unsafe_code)]
        Ok(unsafe { BufferView::new(self.addr(), self.len(), stream, ctx) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let res = &self.reservation;
        let r = res.synchronize_accessors().and_then(|()| {
            let mut st = res.lock();
            let _g = res.ctx.bind()?;
            // SAFETY: the type's invariant: this exact range was mapped by `new` and is unmapped once,
            // here; every device granted access has finished its work (synchronized above), and the
            // address is not handed out again by this value.
            #[allow(unsafe_code)]
            let r = unsafe { raw::vmm::unmap(res.base.0 + self.offset as u64, self.physical.size()) };
            st.mapped.remove(&self.offset);
            r.map_err(Error::from)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
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
    fn without_a_driver_nothing_is_reserved() {
        if crate::raw::library_present() {
            return;
        }
        let e = Reservation::new(Device::from_parts(0, 0), 2 << 20, 0, None).unwrap_err();
        assert_eq!(e, Error::DriverNotFound);
    }
}
