//! Several engines behind one `&self` interface, one per thread, so that threads sharing a
//! resource do not queue on one lock.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::engine::Engine;
use crate::error::{Error, InvariantViolation};
use crate::memory_map::ChunkMap;
use crate::types::EngineStats;

/// Numbers handed to threads on their first allocation, so that the threads of a process spread
/// over the shards round-robin.
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's number (`usize::MAX` until its first use).
    static THREAD: Cell<usize> = const { Cell::new(usize::MAX) };
    /// Where this thread's frees of blocks its own shard did not have went: per 1 MiB region of
    /// addresses (a small direct-mapped cache, `region << 16 | shard`), the shard that took the last
    /// such free in that region. A thread that frees what others allocated (a pipeline's consumer)
    /// frees many blocks of each producer's chunks, so the region names the shard to ask second.
    /// A hint only: any `Sharded` the thread uses writes it, shard numbers are kept modulo 2^16, and
    /// a wrong one costs one more lookup.
    static FOREIGN: [Cell<u64>; FOREIGN_SLOTS] = const { [const { Cell::new(u64::MAX) }; FOREIGN_SLOTS] };
}

/// Entries of the [`FOREIGN`] cache.
const FOREIGN_SLOTS: usize = 64;

/// `log2` of the address regions [`FOREIGN`] remembers.
const FOREIGN_REGION_SHIFT: u32 = 20;

/// The [`FOREIGN`] entry of `addr`'s region, and the region.
#[inline]
fn foreign_slot(addr: u64) -> (usize, u64) {
    let region = addr >> FOREIGN_REGION_SHIFT;
    let slot = (region.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - FOREIGN_SLOTS.trailing_zeros())) as usize;
    (slot, region)
}

/// The calling thread's number: distinct for the first `usize::MAX` threads to ask.
#[inline]
fn thread_number() -> usize {
    THREAD.with(|t| {
        let n = t.get();
        if n != usize::MAX {
            return n;
        }
        let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        t.set(n);
        n
    })
}

/// One shard on its own cache lines, so that two threads locking neighbouring shards do not
/// share a line.
#[repr(align(128))]
struct Shard<E>(Mutex<E>);

/// Engines shared between threads: `n` independent engines ("shards"), each behind its own lock;
/// a thread allocates from the shard its thread number picks (threads take numbers round-robin on
/// their first call), so up to `n` threads allocate at once without touching each other's lock or
/// data. Each shard takes its own chunks from the (shared) upstream and keeps its own per-stream
/// free lists, so every stream rule of the [crate docs](crate) holds shard by shard.
///
/// - `deallocate` tries the calling thread's shard first and, when that shard does not know the
///   address ([`Error::UnknownAllocation`], which changes nothing), the others in turn, starting with
///   the one that took this thread's last such free in the same 1 MiB of addresses: a block freed by
///   another thread than the one that allocated it costs another lock round trip once the thread
///   has freed a block of the same region before, and a walk over the shards the first time.
/// - When a shard runs out of memory, the calling thread first asks every other shard to return
///   its unused chunks to the upstream (as [`Engine::release_unused`] on the caller's stream), then
///   retries once: memory freed into one shard is not lost to the others. (Errors of those
///   releases are not reported: the retry's outcome is.)
/// - With one shard this is the engine behind one mutex, which is what an engine with a global
///   limit (a pool's `maximum_size`) needs: shards would each apply it.
///
/// ```
/// use std::sync::Arc;
/// use mempool_suballoc::{Engine, PoolOptions, PoolEngine, Sharded, SimStream, SimStreams, SimUpstream};
///
/// let up = SimUpstream::new();
/// let sim = SimStreams::new();
/// let pool = Arc::new(Sharded::new(4, || PoolEngine::new(up.clone(), sim.clone(), PoolOptions::default()))?);
/// let threads: Vec<_> = (0..4)
///     .map(|t| {
///         let pool = pool.clone();
///         std::thread::spawn(move || {
///             let s = SimStream::new(t);
///             let a = pool.allocate(1000, s)?;
///             pool.deallocate(a, 1000, s)
///         })
///     })
///     .collect();
/// for t in threads {
///     t.join().unwrap()?;
/// }
/// assert_eq!(pool.stats().used_bytes, 0);
/// pool.check_invariants()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Sharded<E> {
    /// Invariant: at least one. The shards' engines share one upstream and hold disjoint chunks of
    /// it, so no address is live in two shards.
    shards: Box<[Shard<E>]>,
}

impl<E: Engine> Sharded<E> {
    /// `n` shards (at least one), each engine made by `make`; fails with `make`'s first error.
    pub fn new(n: usize, mut make: impl FnMut() -> Result<E, Error>) -> Result<Self, Error> {
        let shards = (0..n.max(1))
            .map(|_| make().map(|e| Shard(Mutex::new(e))))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            shards: shards.into_boxed_slice(),
        })
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Shard `i`'s engine, locked. A panic while a shard was locked leaves it usable: every engine
    /// operation either completes or changes nothing a later call relies on.
    ///
    /// # Panics
    ///
    /// If `i >= shard_count()`.
    pub fn lock(&self, i: usize) -> MutexGuard<'_, E> {
        self.shards[i].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every shard's engine, mutably (no locking: `&mut self` excludes other users).
    pub fn engines_mut(&mut self) -> impl Iterator<Item = &mut E> + '_ {
        self.shards
            .iter_mut()
            .map(|s| s.0.get_mut().unwrap_or_else(PoisonError::into_inner))
    }

    /// The calling thread's shard.
    #[inline]
    fn home(&self) -> usize {
        // A mask rather than a division when the count is a power of two (as the resources' are).
        match self.shards.len() {
            1 => 0,
            n if n.is_power_of_two() => thread_number() & (n - 1),
            n => thread_number() % n,
        }
    }

    /// [`Engine::allocate`] on the calling thread's shard (see the type's docs for running out of
    /// memory).
    #[inline]
    pub fn allocate(&self, bytes: u64, stream: E::Stream) -> Result<u64, Error> {
        let home = self.home();
        let first = self.lock(home).allocate(bytes, stream);
        match first {
            Err(Error::OutOfMemory { .. }) if self.shards.len() > 1 => {
                self.allocate_after_reclaiming(home, bytes, stream)
            }
            r => r,
        }
    }

    #[cold]
    fn allocate_after_reclaiming(&self, home: usize, bytes: u64, stream: E::Stream) -> Result<u64, Error> {
        for j in (0..self.shards.len()).filter(|&j| j != home) {
            // A shard that fails to hand chunks back (an upstream or stream error) keeps them; the
            // allocation's own outcome below is what the caller asked about.
            let _ = self.lock(j).release_unused(stream);
        }
        self.lock(home).allocate(bytes, stream)
    }

    /// [`Engine::deallocate`] on the shard that holds `addr`: the calling thread's first, then the
    /// others. [`Error::UnknownAllocation`] (changing nothing) when no shard holds it.
    #[inline]
    pub fn deallocate(&self, addr: u64, bytes: u64, stream: E::Stream) -> Result<(), Error> {
        let home = self.home();
        // The home shard's lock is released before any other is taken (a guard in the `match`
        // scrutinee would live through the arms): holding one while taking another could deadlock
        // with a thread doing the same the other way round.
        let first = self.lock(home).deallocate(addr, bytes, stream);
        match first {
            Err(Error::UnknownAllocation { .. }) if self.shards.len() > 1 => {
                self.deallocate_elsewhere(home, addr, bytes, stream)
            }
            r => r,
        }
    }

    #[cold]
    fn deallocate_elsewhere(&self, home: usize, addr: u64, bytes: u64, stream: E::Stream) -> Result<(), Error> {
        let n = self.shards.len();
        let (slot, region) = foreign_slot(addr);
        let entry = FOREIGN.with(|f| f[slot].get());
        // The shard that took this thread's last free in the region, if it remembers one, first;
        // then the others in order; each shard is asked once.
        let hint = (entry >> 16 == region).then_some((entry & 0xFFFF) as usize % n);
        let order = hint.into_iter().chain((0..n).filter(|&j| Some(j) != hint));
        for j in order.filter(|&j| j != home) {
            let r = self.lock(j).deallocate(addr, bytes, stream);
            match r {
                Err(Error::UnknownAllocation { .. }) => {}
                r => {
                    FOREIGN.with(|f| f[slot].set(region << 16 | (j as u64 & 0xFFFF)));
                    return r;
                }
            }
        }
        Err(Error::UnknownAllocation { addr, bytes })
    }

    /// [`Engine::merge_free_lists`] in every shard (free blocks never move between shards).
    pub fn merge_free_lists(&self, into: E::Stream) -> Result<(), Error> {
        (0..self.shards.len()).try_for_each(|i| self.lock(i).merge_free_lists(into))
    }

    /// [`Engine::release_unused`] in every shard; the bytes released in all. Every shard is asked
    /// even after one fails; the first error is returned.
    pub fn release_unused(&self, stream: E::Stream) -> Result<u64, Error> {
        let mut released = 0;
        let mut result = Ok(());
        for i in 0..self.shards.len() {
            match self.lock(i).release_unused(stream) {
                Ok(n) => released += n,
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| released)
    }

    /// [`Engine::release`] in every shard; every shard is released even after one fails, and the
    /// first error is returned.
    pub fn release(&mut self) -> Result<(), Error> {
        let mut result = Ok(());
        for e in self.engines_mut() {
            result = result.and(e.release());
        }
        result
    }

    /// The shards' [`Engine::stats`], added up.
    pub fn stats(&self) -> EngineStats {
        let mut total = EngineStats::default();
        for i in 0..self.shards.len() {
            let s = self.lock(i).stats();
            total.reserved_bytes += s.reserved_bytes;
            total.used_bytes += s.used_bytes;
            total.free_bytes += s.free_bytes;
            total.free_blocks += s.free_blocks;
            total.live_allocations += s.live_allocations;
            total.upstream_chunks += s.upstream_chunks;
        }
        total
    }

    /// Every shard's [`Engine::memory_map`], chunks in address order.
    pub fn memory_map(&self) -> Vec<ChunkMap<E::Stream>> {
        let mut maps: Vec<ChunkMap<E::Stream>> =
            (0..self.shards.len()).flat_map(|i| self.lock(i).memory_map()).collect();
        maps.sort_unstable_by_key(|m| m.addr);
        maps
    }

    /// Every shard's [`Engine::check_invariants`].
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        (0..self.shards.len()).try_for_each(|i| self.lock(i).check_invariants())
    }
}

impl<E> std::fmt::Debug for Sharded<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded").field("shards", &self.shards.len()).finish()
    }
}
