//! [`History`]: a bounded ring of allocate, free and failed-allocation events, cheap enough to stay on.
//!
//! Writers never lock and never allocate. The ring is a power-of-two array of slots with one atomic
//! index; a thread claims [`CLAIM`] consecutive slots at a time with one `fetch_add` and keeps the rest of
//! its claim in a thread-local cache, so most events cost no atomic read-modify-write at all (a thread
//! holds one claim: while it holds an unused claim of one history, its events in another take one slot
//! at a time, so no claim is given up half-used). The slots left of a claim when its thread stops
//! recording are not events; once the ring overwrites them they count as dropped (at most
//! `CLAIM - 1` per thread). A writer takes its slot with a compare-and-swap of the slot's stamp, and only
//! when the slot holds an older event: an event from a claim its thread kept while other threads went
//! round the whole ring is dropped, never written over a newer one, and no two writers share a slot: a
//! writer that finds an older event still being written into its slot does not wait for it (that would be
//! a lock) but drops its event and marks the stamp so, and readers count it as dropped. A
//! slot is filled with relaxed stores between two writes of its stamp (a per-slot sequence lock), so a
//! reader copies only slots whose stamp did not change while it read them. Time is the CPU's time-stamp counter
//! on x86-64 (converted to nanoseconds when the history is read), a monotonic clock elsewhere, read once
//! per claim: the other events of a claim carry the time of the claim's first event (a thread's events
//! stay in order; an event's time is at most [`CLAIM`]` - 1` of its thread's events late, which matters
//! only for a thread that records rarely; reading the clock for every event cost more than the rest of a
//! record together: docs/measurements.md, "mempool-rmm history"). When the
//! ring wraps, its oldest events are overwritten and counted as dropped; slots a thread claimed and has
//! not written yet are neither events nor dropped. Imports nothing of the crate.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use self::sync::{fence, AtomicU64};

/// The ring's atomics: loom's under `cfg(loom)`, for the model checks of `loom_tests` (docs/testing.md,
/// "Concurrency models and fuzzing"), std's otherwise. The process-wide counters (history and thread numbers) stay
/// std's: they only hand out unique numbers.
mod sync {
    #[cfg(loom)]
    pub(super) use loom::sync::atomic::{fence, AtomicU64};
    #[cfg(not(loom))]
    pub(super) use std::sync::atomic::{fence, AtomicU64};
}

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
    /// Events ever recorded (slots claimed and not written yet are not events).
    pub recorded: u64,
    /// Events no longer held: overwritten by later ones (before or while the ring was read), or never
    /// written because an older event was still being written into their slot. `events.len() + dropped
    /// == recorded`, always.
    pub dropped: u64,
}

/// The default number of events a history keeps.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// Slots a thread claims at once.
pub const CLAIM: u64 = 16;

/// A stamp's bit for "a writer is filling the slot".
const STAMP_WRITING: u64 = 1 << 63;
/// A stamp's bit for "the event of the stamp's number was dropped: an older event was being written
/// into its slot".
const STAMP_DROPPED: u64 = 1 << 62;
/// A stamp's event number plus one (62 bits: events are numbered for 146 years at one a nanosecond).
const STAMP_SEQ: u64 = STAMP_DROPPED - 1;

/// One event's storage. Its `stamp` is `seq + 1` once event number `seq` is complete in it; with
/// [`STAMP_WRITING`] while a writer fills it (with event `seq`, or, with [`STAMP_DROPPED`] too, while an
/// older event is still written into it and event `seq` was dropped for it); with [`STAMP_DROPPED`] alone
/// once that older writer is done. 0: never written.
#[derive(Default)]
struct Slot {
    stamp: AtomicU64,
    t: AtomicU64,
    address: AtomicU64,
    size: AtomicU64,
    stream: AtomicU64,
    /// op (bits 0-7), resource (8-15), tag (16-31), thread (32-63).
    meta: AtomicU64,
}

/// What a writer puts in a slot.
struct Fields {
    t: u64,
    address: u64,
    size: u64,
    stream: u64,
    meta: u64,
}

impl Slot {
    /// Stores an event's fields (relaxed: the stamp around them orders them for readers).
    #[inline]
    fn fill(&self, f: &Fields) {
        self.t.store(f.t, Ordering::Relaxed);
        self.address.store(f.address, Ordering::Relaxed);
        self.size.store(f.size, Ordering::Relaxed);
        self.stream.store(f.stream, Ordering::Relaxed);
        self.meta.store(f.meta, Ordering::Relaxed);
    }
}

/// A bounded, lock-free history of allocation events (see the module docs for how it is written).
pub struct History {
    /// Unique in the process: what a thread's cached claim names.
    id: u64,
    /// Slots claimed so far (the next claim starts here).
    next: AtomicU64,
    slots: Box<[Slot]>,
    mask: u64,
    start_instant: Instant,
    start_ticks: u64,
}

static NEXT_HISTORY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History")
            .field("capacity", &self.capacity())
            .field("claimed", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for History {
    fn default() -> Self {
        History::new(DEFAULT_CAPACITY)
    }
}

/// Nanoseconds per tick from `ns` elapsed while the raw clock went from `start` to `now`; 1 while
/// there is no scale yet (no tick or no nanosecond elapsed, or `now` behind `start`: the counter
/// of the core `events()` runs on can be behind the one `History::new` read where the cores'
/// time-stamp counters are not synchronized, seen on some VMs and multi-socket hosts).
fn scale(ns: f64, start: u64, now: u64) -> f64 {
    let ticks = now.saturating_sub(start);
    if ticks == 0 || ns < 1.0 {
        1.0
    } else {
        ns / ticks as f64
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

/// What a thread keeps: its number and label, and the rest of its last claim of slots.
struct Local {
    /// 0 until the thread is first numbered.
    thread: Cell<u32>,
    label: Cell<u16>,
    /// The [`History::id`] of the claim (0: none).
    history: Cell<u64>,
    /// The next slot of the claim, and one past its last.
    next: Cell<u64>,
    end: Cell<u64>,
    /// The clock when the claim was made: the time of every event of the claim.
    t: Cell<u64>,
}

#[cfg(not(loom))]
thread_local! {
    static LOCAL: Local = const { Local::new() };
}

// Loom runs a model's threads on one OS thread: its own thread-locals keep each their claim.
#[cfg(loom)]
loom::thread_local! {
    static LOCAL: Local = Local::new();
}

impl Local {
    const fn new() -> Local {
        Local {
            thread: Cell::new(0),
            label: Cell::new(0),
            history: Cell::new(0),
            next: Cell::new(0),
            end: Cell::new(0),
            t: Cell::new(0),
        }
    }

    #[inline]
    fn thread(&self) -> u32 {
        let n = self.thread.get();
        if n != 0 {
            return n;
        }
        let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        self.thread.set(n);
        n
    }
}

/// This thread's small per-process number (1, 2, ... in the order threads first record or ask).
#[inline]
pub fn thread_number() -> u32 {
    LOCAL.with(Local::thread)
}

/// Label names by number; 0 is `default`. At most 65535 labels in a process.
static LABELS: Mutex<Vec<String>> = Mutex::new(Vec::new());

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
    /// Names are interned once; past 65534 distinct names, new ones share the last one's number.
    pub fn set(name: &str) -> Label {
        let n = Self::number(name);
        Label {
            previous: LOCAL.with(|l| l.label.replace(n)),
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
            // Full: the newest name's number.
            return l.len() as u16;
        }
        l.push(name.to_string());
        l.len() as u16
    }

    /// The number of this thread's current label (0: `default`).
    #[inline]
    pub fn current() -> u16 {
        LOCAL.with(|l| l.label.get())
    }
}

impl Drop for Label {
    fn drop(&mut self) {
        LOCAL.with(|l| l.label.set(self.previous));
    }
}

impl History {
    /// A history that keeps the last `capacity` events (rounded up to a power of two, at least 64).
    pub fn new(capacity: usize) -> History {
        History::with_slots(capacity.max(64).next_power_of_two())
    }

    /// A history of exactly `size` slots (a power of two); the tests' models use fewer than 64.
    fn with_slots(size: usize) -> History {
        debug_assert!(size.is_power_of_two());
        History {
            id: NEXT_HISTORY.fetch_add(1, Ordering::Relaxed),
            next: AtomicU64::new(0),
            slots: (0..size).map(|_| Slot::default()).collect(),
            mask: size as u64 - 1,
            start_instant: Instant::now(),
            start_ticks: ticks(),
        }
    }

    /// How many events the ring holds at most.
    pub fn capacity(&self) -> u64 {
        self.mask + 1
    }

    /// Records an event of this thread, with its current [`Label`].
    #[inline]
    pub fn record(&self, op: Op, resource: u8, address: u64, size: u64, stream: u64) {
        let (thread, tag, seq, t) = LOCAL.with(|l| {
            let (next, end) = (l.next.get(), l.end.get());
            let (seq, t) = if l.history.get() == self.id && next < end {
                l.next.set(next + 1);
                (next, l.t.get())
            } else if l.history.get() == self.id || next == end {
                // This history's claim is used up, or the thread's claim (of another history) is: claim
                // anew for this one, and read the clock for it.
                let seq = self.next.fetch_add(CLAIM, Ordering::Relaxed);
                let t = ticks();
                self.prefetch(seq);
                l.history.set(self.id);
                l.next.set(seq + 1);
                l.end.set(seq + CLAIM);
                l.t.set(t);
                (seq, t)
            } else {
                // The thread holds an unused claim of another history: one slot here, wasting nothing.
                (self.next.fetch_add(1, Ordering::Relaxed), ticks())
            };
            (l.thread(), l.label.get(), seq, t)
        });
        let meta = op as u64 | u64::from(resource) << 8 | u64::from(tag) << 16 | u64::from(thread) << 32;
        self.write(
            seq,
            &Fields {
                t,
                address,
                size,
                stream,
                meta,
            },
        );
    }

    /// Writes event `seq` into its slot, if the slot is this writer's (see [`History::begin`]).
    #[inline]
    fn write(&self, seq: u64, fields: &Fields) {
        if let Some(slot) = self.begin(seq) {
            slot.fill(fields);
            History::finish(slot, seq);
        }
    }

    /// Takes event `seq`'s slot for writing; `None` when the event is not to be written: the slot
    /// holds a newer event (this one belongs before the window, counted dropped there), or an older
    /// event is being written into it (this one is marked dropped in the stamp).
    #[inline]
    fn begin(&self, seq: u64) -> Option<&Slot> {
        let slot = &self.slots[(seq & self.mask) as usize];
        let mine = seq + 1;
        let mut current = slot.stamp.load(Ordering::Relaxed);
        loop {
            // The slot is this writer's only if it holds an older event than this one: a claim a thread
            // kept while other threads went round the whole ring is older than the slot's newest event
            // (or than one being written, or marked dropped), and its event is dropped rather than
            // written over a newer one.
            if current & STAMP_SEQ >= mine {
                return None;
            }
            // An older event is being written: two writers must not share a slot (a reader could accept
            // an event mixed from two), and waiting for the other would be a lock. This event is
            // dropped, and says so in the stamp (still marked as being written: the older writer clears
            // that when it is done), so that readers count it.
            let next = if current & STAMP_WRITING != 0 {
                STAMP_WRITING | STAMP_DROPPED | mine
            } else {
                STAMP_WRITING | mine
            };
            // Acquire: the fields the slot's last writer stored happen before this writer's, so they
            // cannot land after them.
            match slot
                .stamp
                .compare_exchange_weak(current, next, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) if next & STAMP_DROPPED != 0 => return None,
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        // Orders the stamp's "being written" before the fields (a reader that sees a new field also
        // sees the stamp change).
        fence(Ordering::Release);
        Some(slot)
    }

    /// Publishes event `seq`, whose fields are in `slot` (taken by [`History::begin`]).
    #[inline]
    fn finish(slot: &Slot, seq: u64) {
        if slot
            .stamp
            .compare_exchange(STAMP_WRITING | (seq + 1), seq + 1, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            // Newer events came while this one was written and were dropped; the newest one's mark
            // stays (this event, older, is before the window now), and the slot is free for the next.
            slot.stamp.fetch_and(!STAMP_WRITING, Ordering::Release);
        }
    }

    /// Asks the CPU to bring the slots of a new claim, and of the claim after it (this thread's next one
    /// when it records alone), into its cache for writing. Without it, each record's stores missed the
    /// cache (the ring is 3 MiB, each slot last written an entire ring ago), and the next locked
    /// instruction of the recorded resource (its mutex) waited for those misses, several times what a
    /// record alone costs (docs/measurements.md, "mempool-rmm history").
    #[inline]
    fn prefetch(&self, seq: u64) {
        #[cfg(target_arch = "x86_64")]
        for i in 0..2 * CLAIM {
            let slot: *const Slot = &self.slots[((seq + i) & self.mask) as usize];
            // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults; the address
            // is a slot of this history's own array.
            #[allow(unsafe_code)]
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_ET0 }>(slot.cast::<i8>())
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = seq;
    }

    /// Nanoseconds per tick of the raw clock, measured over the history's life so far.
    fn ns_per_tick(&self) -> f64 {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        scale(
            self.start_instant.elapsed().as_nanos() as f64,
            self.start_ticks,
            ticks(),
        )
    }

    /// A copy of the events the ring holds now, oldest first. Writers go on meanwhile: a slot
    /// overwritten while it was read is left out and counted as dropped; a slot claimed but not yet
    /// written is left out and not counted as recorded.
    pub fn events(&self) -> Events {
        let scale = self.ns_per_tick();
        let end = self.next.load(Ordering::Acquire);
        let first = end.saturating_sub(self.capacity());
        let mut out = Events {
            capacity: self.capacity(),
            recorded: end,
            dropped: first,
            events: Vec::with_capacity((end - first) as usize),
        };
        for seq in first..end {
            let slot = &self.slots[(seq & self.mask) as usize];
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
                let newer = |s: u64| s & STAMP_SEQ > seq + 1;
                let lost = |s: u64| s & STAMP_SEQ == seq + 1 && s & STAMP_DROPPED != 0;
                if newer(before) || newer(after) {
                    // Overwritten by a later event (before or while it was read).
                    out.dropped += 1;
                } else if lost(before) || lost(after) {
                    // Dropped while an older event was written into its slot.
                    out.dropped += 1;
                } else {
                    // Claimed and not written yet, or being written (or never written: the rest of a
                    // claim whose thread moved on to another history or ended).
                    out.recorded -= 1;
                }
                continue;
            }
            out.events.push(Event {
                // An event stamped by a core whose counter is behind the start one: 0, not a wrap.
                t_ns: (t.saturating_sub(self.start_ticks) as f64 * scale) as u64,
                op: Op::from_bits(meta),
                resource: (meta >> 8) as u8,
                tag: (meta >> 16) as u16,
                thread: (meta >> 32) as u32,
                address,
                size: bytes,
                stream,
            });
        }
        // A thread's events are in its claims' order; across threads, sort by time (stable).
        out.events.sort_by_key(|e| e.t_ns);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_clock_behind_its_start_gives_no_scale_rather_than_underflowing() {
        // `now` behind `start`: a core whose time-stamp counter lags the one read at the start.
        assert_eq!(scale(5_000.0, 1_000_000, 999_000), 1.0);
        assert_eq!(scale(5_000.0, 1_000_000, 1_000_000), 1.0, "no tick yet");
        assert_eq!(scale(0.5, 1_000_000, 1_000_100), 1.0, "no nanosecond yet");
        assert_eq!(scale(5_000.0, 1_000_000, 1_002_000), 2.5);
        assert_eq!(
            scale(5_000.0, u64::MAX - 10, 2),
            1.0,
            "a counter before the start, not a wrap"
        );
    }

    #[test]
    fn keeps_the_last_events_and_counts_the_dropped() {
        let h = History::new(64);
        assert_eq!(h.capacity(), 64);
        // One thread: 100 events, claimed 16 at a time (112 slots), wrap the 64 slots.
        for i in 0..100u64 {
            h.record(Op::Allocate, 0, 0x1000 + i * 256, i + 1, 7);
        }
        let e = h.events();
        assert_eq!(e.recorded, 100, "the rest of the last claim is not an event");
        assert_eq!(e.dropped, 112 - 64, "the slots before the window were overwritten");
        assert_eq!(e.events.len() as u64, e.recorded - e.dropped);
        let sizes: Vec<u64> = e.events.iter().map(|e| e.size).collect();
        assert_eq!(sizes, (49..=100).collect::<Vec<_>>(), "the newest, oldest first");
        assert!(e.events.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
        assert!(e
            .events
            .iter()
            .all(|e| e.stream == 7 && e.op == Op::Allocate && e.thread == thread_number()));
        // Within capacity, a single thread loses nothing.
        let h = History::new(1024);
        for i in 0..1000u64 {
            h.record(Op::Free, 0, i, i, 0);
        }
        let e = h.events();
        assert_eq!((e.recorded, e.dropped, e.events.len()), (1000, 0, 1000));
    }

    #[test]
    fn a_claim_older_than_the_ring_never_overwrites_a_newer_event() {
        // A thread records once (claiming 16 slots) and keeps the rest of its claim while another
        // thread goes round the ring; its next events belong before the window and are dropped, and
        // every event the other thread recorded in the window stays.
        let h = Arc::new(History::new(64));
        h.record(Op::Allocate, 0, 1, 1, 0);
        let other = Arc::clone(&h);
        std::thread::spawn(move || {
            for i in 0..200u64 {
                other.record(Op::Allocate, 0, 0x1000 + i, 1000 + i, 1);
            }
        })
        .join()
        .unwrap();
        let before = h.events();
        for i in 0..3u64 {
            h.record(Op::Free, 0, 2 + i, 2 + i, 0); // from the stale claim: seq 1, 2, 3
        }
        let after = h.events();
        // (The times are converted with the clock rate measured at each read: compare the rest.)
        let key = |e: &Event| (e.op, e.address, e.size, e.stream, e.thread);
        assert_eq!(
            after.events.iter().map(key).collect::<Vec<_>>(),
            before.events.iter().map(key).collect::<Vec<_>>(),
            "no newer event was overwritten"
        );
        assert!(after.events.iter().all(|e| e.stream == 1));
        assert_eq!(after.events.len() as u64, after.recorded - after.dropped);
        // Once the stale claim is used up the thread claims anew and its events are kept.
        for i in 0..13u64 {
            h.record(Op::Free, 0, 5 + i, 5 + i, 0);
        }
        h.record(Op::Free, 0, 99, 99, 0);
        let last = h.events();
        assert_eq!(last.events.last().map(|e| (e.size, e.stream)), Some((99, 0)));
    }

    /// Event `seq`'s fields as the tests write them: its number in every field.
    fn fields(seq: u64) -> Fields {
        Fields {
            t: seq,
            address: seq,
            size: seq,
            stream: seq,
            meta: 0,
        }
    }

    #[test]
    fn an_event_whose_slot_an_older_claim_is_writing_is_counted_as_dropped() {
        // Issue 33, finding 8. Events 0 to 64 are claimed (the claims are played out by hand here, in
        // the order threads could make them). Event 0's writer has taken slot 0 and not finished when
        // event 64, whose slot is slot 0 too, is recorded: event 64 cannot be written (it would mix
        // with event 0's fields), and must count as recorded and dropped.
        let h = History::new(64);
        h.next.store(65, Ordering::Relaxed);
        let old = h.begin(0).expect("slot 0 holds no event yet");
        h.write(64, &fields(64));
        old.fill(&fields(0));
        History::finish(old, 0);
        for seq in 1..64 {
            h.write(seq, &fields(seq));
        }
        let e = h.events();
        assert_eq!(e.recorded, 65, "event 64 was recorded");
        assert_eq!(
            e.dropped, 2,
            "event 0 (before the window) and event 64 (lost) are dropped"
        );
        assert_eq!(
            e.events.iter().map(|e| e.size).collect::<Vec<_>>(),
            (1..64).collect::<Vec<_>>()
        );
        // Two newer events of slot 1 (129 and 193) come while an older one (65) is written: both are
        // dropped, and 193, the one in the window, counts as such.
        h.next.store(194, Ordering::Relaxed);
        let old = h.begin(65).expect("slot 1 holds an older event");
        h.write(129, &fields(129));
        h.write(193, &fields(193));
        old.fill(&fields(65));
        History::finish(old, 65);
        for seq in 130..193 {
            h.write(seq, &fields(seq));
        }
        let e = h.events();
        assert_eq!(
            (e.recorded, e.dropped),
            (194, 131),
            "130 before the window, and event 193"
        );
        assert_eq!(
            e.events.iter().map(|e| e.size).collect::<Vec<_>>(),
            (130..193).collect::<Vec<_>>()
        );
        // The slot is free again for the next event: it is written and kept.
        h.next.store(258, Ordering::Relaxed);
        for seq in 194..258 {
            h.write(seq, &fields(seq));
        }
        let e = h.events();
        assert_eq!((e.recorded, e.dropped), (258, 194));
        assert_eq!(
            e.events.iter().map(|e| e.size).collect::<Vec<_>>(),
            (194..258).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_thread_recording_into_two_histories_keeps_both_in_order() {
        let (a, b) = (History::new(256), History::new(256));
        for i in 0..50u64 {
            a.record(Op::Allocate, 0, i, i, 0);
            b.record(Op::Free, 1, i, i, 0);
        }
        for h in [&a, &b] {
            let e = h.events();
            assert_eq!((e.recorded, e.dropped), (50, 0));
            assert_eq!(
                e.events.iter().map(|e| e.size).collect::<Vec<_>>(),
                (0..50).collect::<Vec<_>>()
            );
        }
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
        let h = Arc::new(History::new(64));
        let writers: Vec<_> = (0..2)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..100_000u64 {
                        // size == address == stream: a torn read would break the equality.
                        h.record(Op::Allocate, 0, i, i, i);
                    }
                })
            })
            .collect();
        let mut reads = 0;
        while writers.iter().any(|w| !w.is_finished()) || reads == 0 {
            let e = h.events();
            assert!(e.events.iter().all(|e| e.address == e.size && e.size == e.stream));
            assert_eq!(e.events.len() as u64 + e.dropped, e.recorded);
            reads += 1;
        }
        for w in writers {
            w.join().unwrap();
        }
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

/// Model checks of the claims (loom explores every interleaving of the threads, and every value a
/// relaxed load may read): `RUSTFLAGS="--cfg loom" cargo test -p mempool-rmm --release --lib loom`
/// (docs/testing.md, "Concurrency models and fuzzing").
#[cfg(all(test, loom))]
mod loom_tests {
    use std::sync::Arc;

    use super::*;

    /// Event `seq` as the models write it: its number in every field but the time.
    fn fields(seq: u64) -> Fields {
        Fields {
            t: 0,
            address: seq,
            size: seq,
            stream: seq,
            meta: 0,
        }
    }

    /// What holds for every read: only whole events, and each event recorded is held or dropped.
    fn check(e: &Events) {
        assert!(
            e.events.iter().all(|e| e.address == e.size && e.size == e.stream),
            "an event mixed from two writes: {:?}",
            e.events
        );
        assert_eq!(e.events.len() as u64 + e.dropped, e.recorded, "{e:?}");
    }

    fn sizes(e: &Events) -> Vec<u64> {
        e.events.iter().map(|e| e.size).collect()
    }

    /// Bounded models: every interleaving with at most this many preemptions (switches away from a
    /// thread that could go on), which finds the usual ordering bugs and keeps each model to seconds.
    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    #[test]
    fn loom_a_newer_event_is_kept_or_counted_while_an_older_one_is_written() {
        // Two slots; events 0 and 2 share slot 0 and are written at once, while the ring is read.
        model(|| {
            let h = Arc::new(History::with_slots(2));
            h.next.store(3, Ordering::Relaxed);
            h.write(1, &fields(1));
            let writers: Vec<_> = [0u64, 2]
                .into_iter()
                .map(|seq| {
                    let h = h.clone();
                    loom::thread::spawn(move || h.write(seq, &fields(seq)))
                })
                .collect();
            check(&h.events());
            for w in writers {
                w.join().unwrap();
            }
            let e = h.events();
            check(&e);
            assert_eq!(e.recorded, 3);
            // Event 0 is before the window (dropped); event 2 is held, or was lost to event 0's write
            // and is counted dropped.
            match sizes(&e)[..] {
                [1, 2] => assert_eq!(e.dropped, 1),
                [1] => assert_eq!(e.dropped, 2),
                _ => panic!("{e:?}"),
            }
        });
    }

    #[test]
    fn loom_three_writers_of_one_slot_leave_it_free_and_the_newest_counted() {
        model(|| {
            let h = Arc::new(History::with_slots(2));
            h.next.store(5, Ordering::Relaxed);
            h.write(1, &fields(1));
            h.write(3, &fields(3));
            let writers: Vec<_> = [0u64, 2, 4]
                .into_iter()
                .map(|seq| {
                    let h = h.clone();
                    loom::thread::spawn(move || h.write(seq, &fields(seq)))
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            let e = h.events();
            check(&e);
            assert_eq!(e.recorded, 5);
            match sizes(&e)[..] {
                [3, 4] => assert_eq!(e.dropped, 3),
                [3] => assert_eq!(e.dropped, 4),
                _ => panic!("{e:?}"),
            }
            // Whoever wrote last, the slot takes the next event.
            h.next.store(7, Ordering::Relaxed);
            h.write(5, &fields(5));
            h.write(6, &fields(6));
            let e = h.events();
            assert_eq!((sizes(&e), e.recorded, e.dropped), (vec![5, 6], 7, 5));
        });
    }

    #[test]
    fn loom_two_threads_recording_claim_apart_and_lose_nothing_uncounted() {
        // 16 slots: the two threads' claims (0..16 and 16..32) cover the same slots, so their first
        // events race for slot 0 and their second for slot 1, through `record`'s own claims.
        model(|| {
            let h = Arc::new(History::with_slots(16));
            let threads: Vec<_> = (0..2u64)
                .map(|t| {
                    let h = h.clone();
                    loom::thread::spawn(move || {
                        for i in 0..2u64 {
                            h.record(Op::Allocate, 0, t, 10 * t + i, t);
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let e = h.events();
            assert_eq!(e.events.len() as u64 + e.dropped, e.recorded, "{e:?}");
            // 32 slots claimed, 4 events written: the window (16..32) holds the second claim's two,
            // each kept or counted dropped, and 14 slots claimed and never written.
            assert_eq!(e.recorded, 18, "{e:?}");
            assert_eq!(e.dropped, 16 + (2 - e.events.len() as u64), "{e:?}");
            // The events held are one thread's (the second claim's), in its order.
            assert!(e.events.iter().all(|x| x.stream == e.events[0].stream), "{e:?}");
            assert!(e.events.windows(2).all(|w| w[0].size < w[1].size), "{e:?}");
        });
    }
}
