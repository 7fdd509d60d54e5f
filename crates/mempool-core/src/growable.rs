//! [`GrowableBuffer`]: the resizing vector of NVIDIA's virtual memory management post. It reserves a
//! large virtual range once and, at each growth, maps one physical allocation at its end for the bytes
//! the growth needs, so growing never copies and the address never changes;
//! [`GrowableBuffer::shrink_to_fit`] unmaps and releases the allocations past the length.

use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::mapping::{Mapping, Reservation};
use crate::stream::StreamRef;
use crate::types::{Device, DeviceAddr};
use crate::view::BufferView;
use crate::vmm::{round_up, AllocationProps, Granularity, PhysicalAllocation};

/// What a [`GrowableBuffer`] does when its reservation is full.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum WhenFull {
    /// Fail with [`Error::ReservationFull`] (the default): the address never changes.
    #[default]
    Fail,
    /// Reserve a larger range (at least twice as large) and map the same physical chunks into it: a
    /// remap, never a copy. The buffer's address changes, as a `Vec`'s does when it reallocates.
    Remap,
}

/// How a [`GrowableBuffer`] grows. The default: each growth rounded up to the device's recommended
/// granularity, and [`WhenFull::Fail`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct GrowableOptions {
    /// The granule each growth is rounded up to, a multiple of the minimum granularity. `None`: the
    /// recommended granularity.
    pub chunk: Option<usize>,
    /// What to do when the reservation is full.
    pub when_full: WhenFull,
}

/// The bytes a growth from `mapped` bytes to hold `len` bytes maps: `len - mapped` rounded up to the
/// granule `chunk` (0 when `len` already fits); `None` on overflow.
pub(crate) fn growth_for(mapped: usize, len: usize, chunk: usize) -> Option<usize> {
    if len <= mapped {
        return Some(0);
    }
    round_up(len - mapped, chunk)
}

/// The alignment to reserve with: the largest power of two that divides `chunk` (the chunk itself when
/// it is a power of two, so that large pages can back it), at least `granularity` (the reservation's
/// minimum, a power of two). As `chunk` is a multiple of the allocations' granularity, a power of two,
/// every chunk boundary is then granular for them too.
fn alignment_for(chunk: usize, granularity: usize) -> usize {
    if chunk == 0 {
        return granularity;
    }
    (1usize << chunk.trailing_zeros()).max(granularity)
}

/// The minimum granularity a [`Reservation`] of `device` is checked against.
fn reservation_granularity(device: Device) -> Result<usize> {
    device.vmm_granularity(&AllocationProps::new(device), Granularity::Minimum)
}

/// The size of the reservation to remap into when `needed` bytes do not fit in `current`: at least
/// twice `current`, at least `needed`, a multiple of `chunk`. `None` on overflow.
pub(crate) fn remap_size(current: usize, needed: usize, chunk: usize) -> Option<usize> {
    round_up(current.checked_mul(2)?.max(needed), chunk)
}

/// A device buffer that grows without copying: one reservation of virtual address space, and at each
/// growth one physical allocation mapped at its end (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`)
/// for the bytes the growth needs, rounded up to the buffer's granule ([`chunk_size`](Self::chunk_size)).
/// A growth costs the same three driver calls whatever its size, so a buffer that doubles maps as few
/// allocations as it has growths.
///
/// - [`resize`](Self::resize) to a larger length maps what it needs; the bytes already there stay
///   where they are, at the same address. The new bytes are uninitialised (whatever the new physical
///   memory holds).
/// - [`shrink_to_fit`](Self::shrink_to_fit) unmaps and releases the allocations that lie wholly past the
///   length (after waiting for the device's work); one that the length reaches into stays whole.
/// - When the reservation is full, [`WhenFull`] decides: fail with [`Error::ReservationFull`], or
///   reserve a larger range and remap the allocations into it.
/// - Only the buffer's device has access (read-write); the reservation and mappings are not handed
///   out, so nothing outside changes that while a [`view`](Self::view) may be alive.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{Device, GrowableBuffer, GrowableOptions, Stream};
/// let dev = Device::get(0)?;
/// let stream = Stream::new(&dev.context()?)?;
/// let mut buf = GrowableBuffer::new(&dev, 1 << 30, GrowableOptions::default())?; // reserves 1 GiB of addresses, maps nothing
/// buf.resize(4096)?;
/// buf.view(stream.as_ref())?.copy_from_host(0, &[1, 2, 3, 4])?;
/// let addr = buf.ptr();
/// buf.resize(64 << 20)?; // maps one more allocation; nothing is copied
/// assert_eq!(buf.ptr(), addr);
/// assert_eq!(buf.view(stream.as_ref())?.to_host()?[..4], [1, 2, 3, 4]);
/// buf.resize(4096)?;
/// buf.shrink_to_fit()?; // unmaps the 64 MiB growth, keeps the first allocation
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct GrowableBuffer {
    // Invariants: `chunks` map `reservation` back to back from offset 0, `mapped` bytes in all, each
    // a multiple of `chunk`; `len <= mapped`. The drop waits for the device once and unmaps the
    // mappings; the reservation is freed after them (fields drop in order).
    chunks: Vec<Mapping>,
    mapped: usize,
    reservation: Arc<Reservation>,
    props: AllocationProps,
    chunk: usize,
    len: usize,
    when_full: WhenFull,
    ctx: Arc<Context>,
}

impl GrowableBuffer {
    /// A buffer of `device`'s memory (not exportable) that may grow to `max_capacity` bytes, rounded up
    /// to the granule, as `options` say; with [`WhenFull::Fail`] it fails past that.
    pub fn new(device: &Device, max_capacity: usize, options: GrowableOptions) -> Result<GrowableBuffer> {
        GrowableBuffer::with_props(AllocationProps::new(*device), max_capacity, options)
    }

    /// A buffer of physical allocations made with `props` (which name the device, and how the memory
    /// may be exported), each growth rounded up to the granule `options.chunk` (`None`: the
    /// recommended granularity; otherwise a multiple of the minimum one), in a reservation of
    /// `max_capacity` bytes rounded up to the granule, doing `options.when_full` when that is not
    /// enough.
    pub fn with_props(props: AllocationProps, max_capacity: usize, options: GrowableOptions) -> Result<GrowableBuffer> {
        let GrowableOptions { chunk, when_full } = options;
        let device = props.device;
        let min = device.vmm_granularity(&props, Granularity::Minimum)?;
        let chunk = match chunk {
            Some(c) => {
                crate::vmm::check_granular("the chunk size", c, min)?;
                c
            }
            None => device.vmm_granularity(&props, Granularity::Recommended)?,
        };
        let size = round_up(max_capacity.max(1), chunk).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a maximum capacity of {max_capacity} bytes, rounded up to the granule of {chunk} bytes, \
                 does not fit in the address space"
            ))
        })?;
        let reservation = Reservation::new(
            device,
            size,
            alignment_for(chunk, reservation_granularity(device)?),
            None,
        )?;
        Ok(GrowableBuffer {
            chunks: Vec::new(),
            mapped: 0,
            reservation,
            props,
            chunk,
            len: 0,
            when_full,
            ctx: device.context()?,
        })
    }

    /// The first address; it stays the same as the buffer grows, unless [`WhenFull::Remap`] remapped it.
    pub fn ptr(&self) -> DeviceAddr {
        self.reservation.base()
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Mapped bytes: at least the length, rounded up to the granule, more after a shrink of the length
    /// that [`shrink_to_fit`](Self::shrink_to_fit) has not released.
    pub fn capacity(&self) -> usize {
        self.mapped
    }

    /// The reserved address range's size: how far it grows without a remap.
    pub fn max_capacity(&self) -> usize {
        self.reservation.size()
    }

    /// The granule: every growth maps a multiple of it.
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// The physical allocations, one per growth, in address order, each with its offset from
    /// [`ptr`](Self::ptr) (its length is its [`size`](PhysicalAllocation::size)).
    ///
    /// The mappings and the reservation themselves stay private, so that nothing outside changes the
    /// buffer's access while a view of it may be alive. The buffer grants its own device read-write
    /// access only (a peer that should read it maps an allocation into a reservation of its own).
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = (usize, &Arc<PhysicalAllocation>)> + '_ {
        self.chunks.iter().map(|m| (m.offset(), m.physical()))
    }

    /// Sets the length, mapping one allocation when it grows past the capacity (the bytes already there
    /// keep their values and address; new bytes are uninitialised). Shrinking only changes the length:
    /// see [`shrink_to_fit`](Self::shrink_to_fit). A length past the reservation fails with
    /// [`Error::ReservationFull`] or remaps, as the buffer's [`WhenFull`] says.
    ///
    /// On an error the length and the contents are as they were. The new physical allocation is made
    /// before any remap, so running out of memory ([`Error::OutOfMemory`]) also leaves the address as
    /// it was; only a driver failure after a successful remap (mapping the new allocation into the new
    /// range, or granting access to it) leaves the buffer at its new, larger address.
    pub fn resize(&mut self, len: usize) -> Result<()> {
        self.reserve_total(len)?;
        self.len = len;
        Ok(())
    }

    /// Maps one allocation so that `len() + additional` bytes fit, without changing the length (errors
    /// as [`resize`](Self::resize)).
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let total = self.len.checked_add(additional).ok_or(Error::ReservationFull {
            requested: additional,
            offset: self.len,
            capacity: self.reservation.size(),
        })?;
        self.reserve_total(total)
    }

    fn reserve_total(&mut self, total: usize) -> Result<()> {
        let full = Error::ReservationFull {
            requested: total,
            offset: 0,
            capacity: self.reservation.size(),
        };
        let grow = growth_for(self.mapped, total, self.chunk).ok_or(full.clone())?;
        if grow == 0 {
            return Ok(());
        }
        let bytes = self.mapped.checked_add(grow).ok_or(full.clone())?;
        let must_remap = bytes > self.reservation.size();
        if must_remap && self.when_full == WhenFull::Fail {
            return Err(full);
        }
        // The memory first: running out of it leaves the buffer where it is, remapped or not.
        let phys = Arc::new(PhysicalAllocation::new(&self.props, grow)?);
        if must_remap {
            self.remap(bytes)?;
        }
        // Map the new allocation, then grant access to it. On an error the new mapping drops (unmapped)
        // and the buffer keeps its length and contents.
        let fresh = Mapping::without_access(&self.reservation, self.mapped, phys)?;
        fresh.set_access(&[(self.props.device, crate::types::Access::ReadWrite)])?;
        self.chunks.push(fresh);
        self.mapped = bytes;
        Ok(())
    }

    /// Moves the allocations into a new reservation of at least `needed` bytes, by mapping the same physical
    /// memory there (read-write for the buffer's device, as before), then unmapping the old range (after
    /// the device's work). On an error the buffer stays in the old range.
    fn remap(&mut self, needed: usize) -> Result<()> {
        let size = remap_size(self.reservation.size(), needed, self.chunk).ok_or(Error::ReservationFull {
            requested: needed,
            offset: 0,
            capacity: self.reservation.size(),
        })?;
        let device = self.props.device;
        let align = alignment_for(self.chunk, reservation_granularity(device)?);
        let fresh = Reservation::new(device, size, align, None)?;
        let mut moved = Vec::with_capacity(self.chunks.len());
        for m in &self.chunks {
            moved.push(Mapping::new(&fresh, m.offset(), m.physical().clone())?);
        }
        // Work queued through the old range must end before it is unmapped (the memory stays, mapped in
        // `fresh`): one wait for all the old mappings, where each mapping's drop would wait once more.
        wait_for_users(&self.ctx)?;
        let old = std::mem::replace(&mut self.chunks, moved);
        self.reservation = fresh;
        for m in old {
            // SAFETY: 1. every piece of work on the buffer's device was waited for just above, and the
            // buffer's device is the only one granted access to its reservations. 2. nothing borrows the
            // buffer (this takes it mutably, and views borrow it), and its address is now `fresh`'s: only
            // code that kept a raw pointer of the old range could still queue work through it, which the
            // remap's documentation rules out as it does for a `Vec` that reallocates.
            #[allow(unsafe_code)]
            unsafe {
                m.unmap_waited()
            };
        }
        Ok(())
    }

    /// Unmaps and releases the allocations that lie wholly past the length (waiting for the device's
    /// work first); one the length reaches into stays. The address does not change.
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        let keep = self.chunks.iter().take_while(|m| m.offset() < self.len).count();
        if keep < self.chunks.len() {
            wait_for_users(&self.ctx)?;
            for m in self.chunks.drain(keep..) {
                // SAFETY: 1. every piece of work on the buffer's device was waited for just above (the only
                // device granted access). 2. nothing borrows the buffer (views do; this takes it mutably),
                // and the bytes past the length are not the buffer's any more: work queued through them
                // after this call would be past the buffer's end.
                #[allow(unsafe_code)]
                unsafe {
                    m.unmap_waited()
                };
            }
            self.mapped = self.chunks.last().map_or(0, |m| m.offset() + m.len());
        }
        Ok(())
    }

    /// A view of the first `len()` bytes for host copies and fills ordered on `stream` (a stream of the
    /// buffer's device). Borrows the buffer, so nothing is unmapped while it lives.
    pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        let addr = if self.len == 0 { DeviceAddr::NULL } else { self.ptr() };
        // SAFETY: 1. `addr..addr+len` is mapped (the invariant: `len <= mapped`, the mappings back to
        // back from the base) and stays mapped while the borrow of `self` lives; the view frees
        // nothing. 2. mappings carry no stream order: map and access are synchronous. 3. the stream is
        // one of the device's context, or taken as such. 4. a null address comes with length 0.
        #[allow(unsafe_code)]
        Ok(unsafe { BufferView::new(addr, self.len, stream, self.ctx.clone()) })
    }
}

/// Waits for all work of the buffer's context before mappings are unmapped. A context-wide wait
/// (`cuCtxSynchronize`), kept on purpose: the buffer records no streams, and what may still use its memory
/// can be on any of them (a view's `fill` is asynchronous on the view's stream, and the raw address goes
/// to kernels on streams the buffer never sees). It is one wait per shrink, remap or drop, where each
/// mapping's own drop would wait again.
fn wait_for_users(ctx: &Context) -> Result<()> {
    ctx.synchronize()
}

impl Drop for GrowableBuffer {
    fn drop(&mut self) {
        if self.chunks.is_empty() {
            return;
        }
        if wait_for_users(&self.ctx).is_err() {
            // Each mapping's drop waits on its own, and keeps (leaks) what it could not unmap.
            return;
        }
        for m in self.chunks.drain(..) {
            // SAFETY: 1. every piece of work on the buffer's device (the only one granted access) was waited
            // for just above. 2. the buffer is going away: nothing borrows it, and its addresses are not
            // its own after this.
            #[allow(unsafe_code)]
            unsafe {
                m.unmap_waited()
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn growth_arithmetic() {
        assert_eq!(growth_for(0, 0, 2 * MIB), Some(0));
        assert_eq!(growth_for(0, 1, 2 * MIB), Some(2 * MIB));
        assert_eq!(growth_for(2 * MIB, 2 * MIB, 2 * MIB), Some(0));
        assert_eq!(growth_for(2 * MIB, 2 * MIB + 1, 2 * MIB), Some(2 * MIB));
        assert_eq!(growth_for(2 * MIB, 40 * MIB, 2 * MIB), Some(38 * MIB));
        assert_eq!(growth_for(0, usize::MAX, 2 * MIB), None);
    }

    #[test]
    fn doubling_maps_one_allocation_per_growth() {
        // A 1 MiB -> 16 GiB doubling sequence, as `reserve_total` computes it: one allocation per step
        // that grows past the capacity, and the capacity ends at the length.
        let chunk = 2 * MIB;
        let (mut mapped, mut allocations) = (0, 0);
        let mut len = MIB;
        while len <= 16 << 30 {
            let grow = growth_for(mapped, len, chunk).unwrap();
            if grow > 0 {
                allocations += 1;
                mapped += grow;
            }
            len *= 2;
        }
        assert_eq!(mapped, 16 << 30);
        assert_eq!(allocations, 14, "1 MiB and 2 MiB share the first allocation");
    }

    #[test]
    fn reservations_align_to_a_granular_power_of_two() {
        assert_eq!(alignment_for(2 * MIB, 2 * MIB), 2 * MIB);
        assert_eq!(
            alignment_for(8 * MIB, 2 * MIB),
            8 * MIB,
            "a power-of-two chunk aligns to itself"
        );
        assert_eq!(
            alignment_for(6 * MIB, 2 * MIB),
            2 * MIB,
            "6 MiB: the largest power of two dividing it"
        );
        assert_eq!(alignment_for(12 * MIB, 2 * MIB), 4 * MIB);
        assert_eq!(
            alignment_for(6 * MIB, 4 * MIB),
            4 * MIB,
            "never below the reservation's granularity"
        );
        for chunk in [2 * MIB, 6 * MIB, 10 * MIB, 24 * MIB, 1 << 30] {
            let a = alignment_for(chunk, 2 * MIB);
            assert!(a.is_power_of_two() && a.is_multiple_of(2 * MIB), "{chunk}: {a}");
            assert!(
                chunk.is_multiple_of(a),
                "every chunk boundary stays aligned: {chunk}: {a}"
            );
        }
    }

    #[test]
    fn remap_sizes_double_or_fit() {
        assert_eq!(remap_size(8 * MIB, 10 * MIB, 2 * MIB), Some(16 * MIB));
        assert_eq!(remap_size(8 * MIB, 40 * MIB, 2 * MIB), Some(40 * MIB));
        assert_eq!(remap_size(8 * MIB, 41 * MIB, 2 * MIB), Some(42 * MIB));
        assert_eq!(remap_size(usize::MAX / 2 + 1, 1, 2 * MIB), None);
    }

    #[test]
    fn without_a_driver_nothing_is_reserved() {
        if crate::raw::library_present() {
            return;
        }
        let e = GrowableBuffer::new(&Device::from_parts(0, 0), 1 << 30, GrowableOptions::default()).unwrap_err();
        assert_eq!(e, Error::DriverNotFound);
    }
}
