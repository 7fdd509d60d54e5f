//! [`History`]: a bounded ring of allocate, free and failed-allocation events, cheap enough to stay on.
//!
//! Writers never lock and never allocate: the ring is split into shards (a thread writes to the shard
//! of its thread number), each shard a power-of-two array of slots with one atomic index; a writer
//! takes a slot with one `fetch_add` and fills it with relaxed stores between two writes of the slot's
//! stamp (a per-slot sequence lock), so a reader copies only slots whose stamp did not change while it
//! read them. Time is the CPU's time-stamp counter on x86-64 (converted to nanoseconds when the
//! history is read), a monotonic clock elsewhere. When a shard wraps, its oldest events are
//! overwritten and counted as dropped. Imports nothing of the crate.

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// What happened.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// An allocation that succeeded.
    Allocate = 0,
    /// A free.
    Free = 1,
    /// An allocation that failed.
    Failed = 2,
}

impl Op {
    fn from_bits(b: u64) -> Op {
        match b & 0xff {
            0 => Op::Allocate,
            1 => Op::Free,
            _ => Op::Failed,
        }
    }
}

/// One recorded event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Nanoseconds since the history began.
    pub t_ns: u64,
    /// What happened.
    pub op: Op,
    /// The address (0 for a failed allocation).
    pub address: u64,
    /// The bytes asked for.
    pub size: u64,
    /// The stream's raw handle value.
    pub stream: u64,
    /// The label that was current on the thread ([`Label`]), 0 for none.
    pub tag: u16,
    /// The thread's small per-process number ([`thread_number`]).
    pub thread: u32,
    /// The resource the event happened at (its number in the recording adaptor, 0 for the top).
    pub resource: u8,
}

/// The events a [`History`] holds, oldest first, with what it saw in all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Events {
    /// The events still in the ring, sorted by time.
    pub events: Vec<Event>,
    /// How many events the ring holds at most.
    pub capacity: u64,
    /// Events ever recorded.
    pub recorded: u64,
    /// Events overwritten (or being written while read).
    pub dropped: u64,
}

/// The default number of events a history keeps.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// Shards: a thread writes to shard `thread_number % SHARDS`.
const SHARDS: usize = 8;

/// One event's storage. `stamp` is `seq + 1` once event number `seq` of the shard is complete in it,
/// and `u64::MAX` while a writer fills it.
#[derive(Default)]
#[repr(align(64))]
struct Slot {
    stamp: AtomicU64,
    t: AtomicU64,
    address: AtomicU64,
    size: AtomicU64,
    stream: AtomicU64,
    /// op (bits 0-7), resource (8-15), tag (16-31), thread (32-63).
    meta: AtomicU64,
}

#[repr(align(64))]
struct Shard {
    /// Events this shard has handed out slots for.
    next: AtomicU64,
    slots: Box<[Slot]>,
    mask: u64,
}

/// A bounded, lock-free history of allocation events (see the module docs for how it is written).
pub struct History {
    shards: Box<[Shard]>,
    start_instant: Instant,
    start_ticks: u64,
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History")
            .field("capacity", &self.capacity())
            .field("recorded", &self.recorded())
            .finish()
    }
}

impl Default for History {
    fn default() -> Self {
        History::new(DEFAULT_CAPACITY)
    }
}

/// The raw clock: the time-stamp counter on x86-64, nanoseconds of a monotonic clock elsewhere.
#[inline]
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC exists on every x86-64 CPU and only reads a counter (no memory is touched).
        #[allow(unsafe_code)]
        unsafe {
            core::arch::x86_64::_rdtsc()
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

static NEXT_THREAD: AtomicU32 = AtomicU32::new(1);

thread_local! {
    static THREAD: Cell<u32> = const { Cell::new(0) };
    static LABEL: Cell<u16> = const { Cell::new(0) };
}

/// This thread's small per-process number (1, 2, ... in the order threads first record or ask).
#[inline]
pub fn thread_number() -> u32 {
    THREAD.with(|t| {
        let n = t.get();
        if n != 0 {
            return n;
        }
        let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        t.set(n);
        n
    })
}

/// Label names by number; 0 is `default`. At most 65535 labels in a process.
static LABELS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static LABEL_COUNT: AtomicU16 = AtomicU16::new(1);

/// Every label by number: index 0 is `default`.
pub fn label_names() -> Vec<String> {
    let l = LABELS.lock().unwrap_or_else(|p| p.into_inner());
    std::iter::once("default".to_string())
        .chain(l.iter().cloned())
        .collect()
}

/// A label for the allocations a thread makes while it is set: the `tag` of their events.
///
/// ```
/// use mempool_rmm::observe::Label;
/// let _weights = Label::set("weights"); // this thread's events carry `weights` until the guard drops
/// ```
#[derive(Debug)]
#[must_use = "the label is unset when the guard drops"]
pub struct Label {
    previous: u16,
}

impl Label {
    /// Labels this thread's events `name` until the guard drops (then the previous label is back).
    /// Names are interned once; past 65535 distinct names, new ones share the last number.
    pub fn set(name: &str) -> Label {
        let n = Self::number(name);
        Label {
            previous: LABEL.with(|l| l.replace(n)),
        }
    }

    fn number(name: &str) -> u16 {
        if name == "default" {
            return 0;
        }
        let mut l = LABELS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = l.iter().position(|x| x == name) {
            return (i + 1) as u16;
        }
        if l.len() + 1 >= u16::MAX as usize {
            return u16::MAX - 1;
        }
        l.push(name.to_string());
        LABEL_COUNT.store((l.len() + 1) as u16, Ordering::Relaxed);
        l.len() as u16
    }

    /// The number of this thread's current label (0: `default`).
    #[inline]
    pub fn current() -> u16 {
        LABEL.with(Cell::get)
    }
}

impl Drop for Label {
    fn drop(&mut self) {
        LABEL.with(|l| l.set(self.previous));
    }
}

impl History {
    /// A history that keeps about the last `capacity` events (rounded up so that each of its shards
    /// is a power of two, at least 64 events per shard).
    pub fn new(capacity: usize) -> History {
        let per_shard = capacity.div_ceil(SHARDS).max(64).next_power_of_two();
        let shards = (0..SHARDS)
            .map(|_| Shard {
                next: AtomicU64::new(0),
                slots: (0..per_shard).map(|_| Slot::default()).collect(),
                mask: per_shard as u64 - 1,
            })
            .collect();
        History {
            shards,
            start_instant: Instant::now(),
            start_ticks: ticks(),
        }
    }

    /// How many events the ring holds at most.
    pub fn capacity(&self) -> u64 {
        self.shards.iter().map(|s| s.mask + 1).sum()
    }

    /// Events recorded so far.
    pub fn recorded(&self) -> u64 {
        self.shards.iter().map(|s| s.next.load(Ordering::Relaxed)).sum()
    }

    /// Records an event of this thread, with its current [`Label`].
    #[inline]
    pub fn record(&self, op: Op, resource: u8, address: u64, size: u64, stream: u64) {
        let thread = thread_number();
        let tag = Label::current();
        let t = ticks();
        let shard = &self.shards[thread as usize % SHARDS];
        let seq = shard.next.fetch_add(1, Ordering::Relaxed);
        let slot = &shard.slots[(seq & shard.mask) as usize];
        slot.stamp.store(u64::MAX, Ordering::Relaxed);
        // Orders the stamp's "being written" before the fields (a reader that sees a new field also
        // sees the stamp change).
        fence(Ordering::Release);
        slot.t.store(t, Ordering::Relaxed);
        slot.address.store(address, Ordering::Relaxed);
        slot.size.store(size, Ordering::Relaxed);
        slot.stream.store(stream, Ordering::Relaxed);
        slot.meta.store(
            op as u64 | u64::from(resource) << 8 | u64::from(tag) << 16 | u64::from(thread) << 32,
            Ordering::Relaxed,
        );
        slot.stamp.store(seq + 1, Ordering::Release);
    }

    /// Nanoseconds per tick of the raw clock, measured over the history's life so far.
    fn ns_per_tick(&self) -> f64 {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        let (ns, ticks) = (
            self.start_instant.elapsed().as_nanos() as f64,
            ticks() - self.start_ticks,
        );
        if ticks == 0 || ns < 1.0 {
            1.0
        } else {
            ns / ticks as f64
        }
    }

    /// A copy of the events the ring holds now, oldest first. Writers go on meanwhile; a slot
    /// overwritten while it was read is left out and counted as dropped.
    pub fn events(&self) -> Events {
        let scale = self.ns_per_tick();
        let mut out = Events {
            capacity: self.capacity(),
            ..Events::default()
        };
        for shard in self.shards.iter() {
            let end = shard.next.load(Ordering::Acquire);
            let size = shard.mask + 1;
            let first = end.saturating_sub(size);
            out.recorded += end;
            out.dropped += first;
            for seq in first..end {
                let slot = &shard.slots[(seq & shard.mask) as usize];
                let before = slot.stamp.load(Ordering::Acquire);
                let (t, address, bytes, stream, meta) = (
                    slot.t.load(Ordering::Relaxed),
                    slot.address.load(Ordering::Relaxed),
                    slot.size.load(Ordering::Relaxed),
                    slot.stream.load(Ordering::Relaxed),
                    slot.meta.load(Ordering::Relaxed),
                );
                fence(Ordering::Acquire);
                let after = slot.stamp.load(Ordering::Relaxed);
                if before != seq + 1 || after != seq + 1 {
                    // Not yet complete, or overwritten while read.
                    out.dropped += 1;
                    continue;
                }
                out.events.push(Event {
                    t_ns: (t.wrapping_sub(self.start_ticks) as f64 * scale) as u64,
                    op: Op::from_bits(meta),
                    resource: (meta >> 8) as u8,
                    tag: (meta >> 16) as u16,
                    thread: (meta >> 32) as u32,
                    address,
                    size: bytes,
                    stream,
                });
            }
        }
        // Ticks of one thread never go backwards; across shards, sort (stable: a shard's order stays).
        out.events.sort_by_key(|e| e.t_ns);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn keeps_the_last_events_and_counts_the_dropped() {
        let h = History::new(64 * SHARDS);
        let per_shard = 64;
        // One thread writes to one shard: 100 events wrap its 64 slots.
        for i in 0..100u64 {
            h.record(Op::Allocate, 0, 0x1000 + i * 256, i + 1, 7);
        }
        let e = h.events();
        assert_eq!(e.recorded, 100);
        assert_eq!(e.dropped, 100 - per_shard);
        assert_eq!(e.events.len() as u64, per_shard);
        assert_eq!(e.capacity, (64 * SHARDS) as u64);
        let sizes: Vec<u64> = e.events.iter().map(|e| e.size).collect();
        assert_eq!(sizes, (37..=100).collect::<Vec<_>>(), "the newest 64, oldest first");
        assert!(e.events.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
        assert!(e
            .events
            .iter()
            .all(|e| e.stream == 7 && e.op == Op::Allocate && e.thread == thread_number()));
    }

    #[test]
    fn concurrent_writers_lose_nothing_within_capacity() {
        let h = Arc::new(History::new(1 << 14));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..500u64 {
                        h.record(if i % 2 == 0 { Op::Allocate } else { Op::Free }, 0, t << 32 | i, i, t);
                    }
                    thread_number()
                })
            })
            .collect();
        let numbers: Vec<u32> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let e = h.events();
        assert_eq!(e.recorded, 2000);
        assert_eq!(e.dropped, 0);
        assert_eq!(e.events.len(), 2000);
        for (t, n) in numbers.iter().enumerate() {
            let mine: Vec<&Event> = e.events.iter().filter(|e| e.thread == *n).collect();
            assert_eq!(mine.len(), 500, "thread {t}");
            // A thread's events keep their order (its clock does not go backwards).
            let idx: Vec<u64> = mine.iter().map(|e| e.address & 0xffff_ffff).collect();
            assert_eq!(idx, (0..500).collect::<Vec<_>>());
            assert!(mine.iter().all(|e| e.stream == t as u64));
        }
    }

    #[test]
    fn concurrent_readers_see_only_complete_events() {
        let h = Arc::new(History::new(64 * SHARDS));
        let w = {
            let h = h.clone();
            std::thread::spawn(move || {
                for i in 0..200_000u64 {
                    // size == address == stream: a torn read would break the equality.
                    h.record(Op::Allocate, 0, i, i, i);
                }
            })
        };
        let mut reads = 0;
        while !w.is_finished() || reads == 0 {
            let e = h.events();
            assert!(e.events.iter().all(|e| e.address == e.size && e.size == e.stream));
            assert_eq!(e.events.len() as u64 + e.dropped, e.recorded);
            reads += 1;
        }
        w.join().unwrap();
    }

    #[test]
    fn labels_tag_this_threads_events_and_nest() {
        let h = History::new(1024);
        h.record(Op::Allocate, 0, 1, 1, 0);
        {
            let _a = Label::set("observe-test-weights");
            h.record(Op::Allocate, 0, 2, 2, 0);
            {
                let _b = Label::set("observe-test-kv");
                h.record(Op::Free, 0, 3, 3, 0);
            }
            h.record(Op::Failed, 0, 0, 4, 0);
        }
        h.record(Op::Free, 0, 5, 5, 0);
        let names = label_names();
        let tags: Vec<&str> = h
            .events()
            .events
            .iter()
            .map(|e| names[e.tag as usize].as_str())
            .collect();
        assert_eq!(
            tags,
            [
                "default",
                "observe-test-weights",
                "observe-test-kv",
                "observe-test-weights",
                "default"
            ]
        );
        let ops: Vec<Op> = h.events().events.iter().map(|e| e.op).collect();
        assert_eq!(ops, [Op::Allocate, Op::Allocate, Op::Free, Op::Failed, Op::Free]);
    }
}
