//! Test doubles, behind the cargo feature `testing` (and always in this crate's own unit tests):
//! [`SimResource`], a host-only resource over a fake address space for testing adaptors and
//! suballocators on machines without a GPU (CI has none; its addresses are never dereferenced).
//!
//! The standard random workload and its generator, which benchmarks use too, are not test doubles:
//! they are [`crate::workload`], available without the feature.

use std::collections::BTreeMap;
use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resource::{align_up, MemoryResource};

#[derive(Debug, Default)]
struct State {
    next: u64,
    // Invariant: live ranges never overlap; the sum of their aligned sizes is `used`.
    live: BTreeMap<u64, usize>,
    used: usize,
    failed: usize,
    total_allocations: usize,
}

/// A resource that hands out 256-byte aligned, non-overlapping fake addresses from a large range, with an
/// optional capacity (out-of-memory past it). It checks every deallocation against what it handed out.
#[derive(Debug)]
pub struct SimResource {
    capacity: usize,
    state: Mutex<State>,
}

impl SimResource {
    /// The base of the fake address space: far from anything a real process maps.
    pub const BASE: u64 = 0x7000_0000_0000;

    /// Unlimited capacity.
    ///
    /// # Safety
    /// As [`SimResource::with_capacity`].
    #[allow(unsafe_code)]
    pub unsafe fn new() -> Self {
        // SAFETY: the caller keeps `with_capacity`'s promise.
        unsafe { SimResource::with_capacity(usize::MAX) }
    }

    /// At most `capacity` bytes (aligned) live at once.
    ///
    /// # Safety
    /// The addresses are fake: [`MemoryResource`]'s guarantee 2 (memory the driver reaches) does not hold.
    /// 1. Nothing dereferences an address of this resource, or of an adaptor or suballocator over it: no
    ///    container ([`crate::containers::DeviceBuffer`], ...), copy, fill, kernel or driver call is given
    ///    one. Allocating, freeing and reading the statistics is all the caller does with them.
    #[allow(unsafe_code)]
    pub unsafe fn with_capacity(capacity: usize) -> Self {
        SimResource {
            capacity,
            state: Mutex::new(State {
                next: Self::BASE,
                ..State::default()
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocations live now.
    pub fn live_allocations(&self) -> usize {
        self.state().live.len()
    }

    /// Bytes live now (aligned).
    pub fn used(&self) -> usize {
        self.state().used
    }

    /// Allocations refused for capacity so far.
    pub fn failed_allocations(&self) -> usize {
        self.state().failed
    }

    /// Successful allocations so far.
    pub fn total_allocations(&self) -> usize {
        self.state().total_allocations
    }
}

// SAFETY: guarantee 1 holds (live ranges never overlap, checked in `State`); guarantee 2 (memory the driver reaches) does not, which is why its constructors are `unsafe`: their callers promise no address of it is ever dereferenced.
#[allow(unsafe_code)]
unsafe impl MemoryResource for SimResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let mut s = self.state();
        // A size that does not fit once rounded, or past the capacity or the address space, is out of
        // memory.
        let fits = align_up(bytes as u64).map(|n| n as usize).and_then(|size| {
            let next = s.next.checked_add(size as u64)?;
            (s.used.saturating_add(size) <= self.capacity).then_some((size, next))
        });
        let Some((size, next)) = fits else {
            s.failed += 1;
            return Err(Error::OutOfMemory {
                resource: "SimResource",
                requested: bytes,
            });
        };
        let addr = s.next;
        s.next = next;
        s.live.insert(addr, bytes);
        s.used += size;
        s.total_allocations += 1;
        Ok(DeviceAddr(addr))
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, _stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        let mut s = self.state();
        match s.live.get(&ptr.0) {
            Some(&b) if b == bytes => {
                s.live.remove(&ptr.0);
                // A live allocation's size rounded when it was allocated.
                s.used -= align_up(bytes as u64).map(|n| n as usize).unwrap_or(0);
                Ok(())
            }
            found => Err(Error::InvalidDeallocation {
                resource: "SimResource",
                ptr: ptr.0,
                bytes,
                reason: match found {
                    Some(b) => format!("allocated with {b} bytes"),
                    None => "not a live allocation".into(),
                },
            }),
        }
    }

    fn name(&self) -> &'static str {
        "SimResource"
    }
}
