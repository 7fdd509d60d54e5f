//! Test and benchmark helpers: [`SimResource`], a host-only resource over a fake address space for
//! testing adaptors and suballocators on machines without a GPU (CI has none; its addresses are never
//! dereferenced), and [`SplitMix64`], the fixed-seed generator the workloads draw from.

use std::collections::BTreeMap;
use std::sync::Mutex;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resource::{align_up_usize, MemoryResource};

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

impl Default for SimResource {
    fn default() -> Self {
        SimResource::new()
    }
}

impl SimResource {
    /// The base of the fake address space: far from anything a real process maps.
    pub const BASE: u64 = 0x7000_0000_0000;

    /// Unlimited capacity.
    pub fn new() -> Self {
        SimResource::with_capacity(usize::MAX)
    }

    /// At most `capacity` bytes (aligned) live at once.
    pub fn with_capacity(capacity: usize) -> Self {
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

impl MemoryResource for SimResource {
    fn allocate(&self, bytes: usize, _stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let mut s = self.state();
        // A size that does not fit once rounded, or past the capacity or the address space, is out of
        // memory.
        let fits = align_up_usize(bytes).and_then(|size| {
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
                s.used -= align_up_usize(bytes).unwrap_or(0);
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

/// SplitMix64: a tiny fixed-seed generator, so workloads need no `rand` dependency and draw the same
/// sequence on every machine.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, n)` (`n > 0`; the modulo bias is far below what a workload can notice).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// One operation of the standard random workload (see [`random_workload`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RandomOp {
    /// Allocate this many bytes.
    Alloc(usize),
    /// Free the live allocation at this index of the live list, which then `swap_remove`s it.
    Free(usize),
}

/// The standard random workload (RMM's `random_allocations` shape; `DESIGN.md`, "Performance"): `n`
/// draws, each an allocation of a size uniform in `[1, max_size]` with probability 0.73 (dropped when it
/// would take live bytes past `max_usage`), otherwise the free of a uniformly chosen live allocation;
/// an allocation whenever nothing is live. The same `seed` gives the same sequence everywhere: the
/// criterion bench, the `random_workload` example and `mempool-bench random` all draw from here.
///
/// ```
/// use mempool_rmm::testing::{random_workload, RandomOp};
/// let ops = random_workload(1000, 4096, 1 << 20, 42);
/// assert!(matches!(ops[0], RandomOp::Alloc(n) if (1..=4096).contains(&n)));
/// assert_eq!(ops, random_workload(1000, 4096, 1 << 20, 42));
/// ```
pub fn random_workload(n: usize, max_size: usize, max_usage: usize, seed: u64) -> Vec<RandomOp> {
    let mut rng = SplitMix64(seed);
    let mut live: Vec<usize> = Vec::new();
    let mut live_bytes = 0usize;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        let size = 1 + rng.below(max_size as u64) as usize;
        let alloc = rng.below(100) < 73;
        if (alloc && live_bytes + size <= max_usage) || live.is_empty() {
            if live_bytes + size > max_usage {
                continue;
            }
            live.push(size);
            live_bytes += size;
            ops.push(RandomOp::Alloc(size));
        } else {
            let i = rng.below(live.len() as u64) as usize;
            live_bytes -= live.swap_remove(i);
            ops.push(RandomOp::Free(i));
        }
    }
    ops
}
