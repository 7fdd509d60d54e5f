//! Opt-in timestamps at points of a buffer's hand-off and release, to say where a round trip's
//! time goes (mempool-bench's `ipc_handoff` binary prints them). Off by default: then each point costs one
//! relaxed atomic load. [`enable`] turns recording on in this process, [`take`] hands the records
//! over; the importer's process and the exporter's each record their own, and the times of both
//! are on one clock ([`now_ns`]: the system clock, read once, advanced by the monotonic clock), so
//! records of the same buffer id from the two processes can be put on one timeline.
//!
//! Imports nothing of the crate: every layer may record.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Where a record was taken. The importer's points come first, then the exporter's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Point {
    /// Importer: the buffer's `Buffer` frame was read.
    ImporterFrame = 0,
    /// Importer: the exporter's ready event was not complete when the buffer arrived, so the
    /// receiving stream waits for it on the GPU (when it was complete, no wait is queued).
    ImporterReadyPending = 1,
    /// Importer: `recv` returns the buffer.
    ImporterReceived = 2,
    /// Importer: the buffer's release (drop or `release`) begins.
    ImporterRelease = 3,
    /// Importer: the release event was recorded after the buffer's last use (fast release path).
    ImporterRecorded = 4,
    /// Importer: the release was queued for a batch (not sent at once).
    ImporterQueued = 5,
    /// Importer: a batch with this release was taken to be sent because the push said so (the
    /// link was idle, or the batch was full).
    ImporterSendOnPush = 6,
    /// Importer: ... because `recv` was about to wait for the exporter.
    ImporterSendOnRecv = 7,
    /// Importer: ... by the flusher thread, the batch's delay having passed.
    ImporterSendOnTimer = 8,
    /// Importer: ... for another reason (`flush_releases`, `Goodbye`, the importer's drop).
    ImporterSendOther = 9,
    /// Importer: the send of the batch with this release returned.
    ImporterSent = 10,
    /// Importer (rings): `recv` found its ring empty and began to look at it without sleeping (the
    /// spin); recorded for the buffer that ended the wait, at the time the wait began.
    ImporterRingWaitBegins = 11,
    /// Importer (rings): `recv` set its waiting flag and slept on its doorbell (a futex); recorded
    /// for the buffer that ended the wait, at the time it went to sleep.
    ImporterRingSleeps = 12,
    /// Importer (rings): `recv`'s sleep on the doorbell ended (woken, or timed out); recorded for
    /// the buffer that ended the wait, at the time it woke.
    ImporterRingWoke = 13,
    /// Importer (rings): the release was written into the ring to the exporter and published.
    ImporterReleasePushed = 14,
    /// Importer (rings): the exporter's loop slept, so this release's publish rang its doorbell (a
    /// `RingBell` frame on the socket); recorded when the frame was sent.
    ImporterBellSent = 15,
    /// Exporter: `share` queued the buffer's frames.
    ExporterShared = 32,
    /// Exporter: the serving thread wrote the buffer's `Buffer` frame completely to a socket.
    ExporterFrameOut = 33,
    /// Exporter: the serving thread read a release of the buffer (`Release` or `ReleaseBatch`).
    ExporterReleaseRead = 34,
    /// Exporter: the importer's release event was not complete when its batch was read, so the
    /// exporter's release stream waits for it on the GPU (when it was complete, none is queued).
    ExporterReleasePending = 35,
    /// Exporter: the release was recorded (the lease updated, waiters about to be woken).
    ExporterReleased = 36,
    /// Exporter: `ExportedBuffer::wait_released` saw no holder left.
    ExporterWoke = 37,
    /// Exporter: `ExportedBuffer::wait_released` returns.
    ExporterWaitDone = 38,
    /// Exporter: the buffer's free was queued (or the buffer parked for a kept block).
    ExporterFreed = 39,
    /// Exporter (rings): the importer slept on its doorbell when this buffer was published, so
    /// the sharing thread (or the serving thread) woke it (`FUTEX_WAKE`); recorded after the wake.
    ExporterBellRang = 40,
    /// Exporter (rings): the serving thread's `epoll` wait that ended before this release was
    /// drained from the ring had slept (its waiting flags set); recorded at the time it woke.
    ExporterLoopWoke = 41,
    /// Exporter (rings): this release was found by the serving thread's spin over the rings (no
    /// sleep, no doorbell); recorded at the time the spin found it.
    ExporterSpinFound = 42,
    /// Memory store client: a request is about to be sent (buffer 0: the memory store's
    /// points are of requests, put in order by their times).
    StoreClientSent = 64,
    /// Memory store server: a request was read.
    StoreServerRead = 65,
    /// Memory store server: the request's reply is ready (an attach's descriptors exported).
    StoreServerReplied = 66,
    /// Memory store server: the reply was written to the socket.
    StoreServerSent = 67,
    /// Memory store client: the reply was read, with its descriptors.
    StoreClientReply = 68,
    /// Memory store client: an attach's buffers are imported, mapped and accessible.
    StoreClientMapped = 69,
    /// Memory store client: an attach returns (its stream ordered after the creators' work).
    StoreClientDone = 70,
}

impl Point {
    /// Every point, in code order.
    pub const ALL: [Point; 34] = [
        Point::ImporterFrame,
        Point::ImporterReadyPending,
        Point::ImporterReceived,
        Point::ImporterRelease,
        Point::ImporterRecorded,
        Point::ImporterQueued,
        Point::ImporterSendOnPush,
        Point::ImporterSendOnRecv,
        Point::ImporterSendOnTimer,
        Point::ImporterSendOther,
        Point::ImporterSent,
        Point::ImporterRingWaitBegins,
        Point::ImporterRingSleeps,
        Point::ImporterRingWoke,
        Point::ImporterReleasePushed,
        Point::ImporterBellSent,
        Point::ExporterShared,
        Point::ExporterFrameOut,
        Point::ExporterReleaseRead,
        Point::ExporterReleasePending,
        Point::ExporterReleased,
        Point::ExporterWoke,
        Point::ExporterWaitDone,
        Point::ExporterFreed,
        Point::ExporterBellRang,
        Point::ExporterLoopWoke,
        Point::ExporterSpinFound,
        Point::StoreClientSent,
        Point::StoreServerRead,
        Point::StoreServerReplied,
        Point::StoreServerSent,
        Point::StoreClientReply,
        Point::StoreClientMapped,
        Point::StoreClientDone,
    ];

    /// The point's code (what [`Record::to_bytes`] writes).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The point with `code`; `None` for a code no point has.
    pub fn from_code(code: u8) -> Option<Point> {
        Point::ALL.into_iter().find(|p| p.code() == code)
    }
}

/// One timestamp: where, for which buffer (the exporter's buffer id), and when ([`now_ns`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// Where it was taken.
    pub point: Point,
    /// The buffer's id (`BufferId`'s number), the same in both processes.
    pub buffer: u64,
    /// Nanoseconds since the Unix epoch, by [`now_ns`].
    pub at_ns: u64,
}

impl Record {
    /// The size of [`Record::to_bytes`].
    pub const BYTES: usize = 17;

    /// The record as bytes (the point's code, then the buffer and the time, little-endian), to
    /// send it to another process.
    pub fn to_bytes(&self) -> [u8; Record::BYTES] {
        let mut out = [0u8; Record::BYTES];
        out[0] = self.point.code();
        out[1..9].copy_from_slice(&self.buffer.to_le_bytes());
        out[9..17].copy_from_slice(&self.at_ns.to_le_bytes());
        out
    }

    /// The record [`Record::to_bytes`] wrote; `None` for an unknown point code.
    pub fn from_bytes(bytes: &[u8; Record::BYTES]) -> Option<Record> {
        let mut buffer = [0u8; 8];
        let mut at = [0u8; 8];
        buffer.copy_from_slice(&bytes[1..9]);
        at.copy_from_slice(&bytes[9..17]);
        Some(Record {
            point: Point::from_code(bytes[0])?,
            buffer: u64::from_le_bytes(buffer),
            at_ns: u64::from_le_bytes(at),
        })
    }
}

/// The most records kept between two [`take`]s; later ones are dropped (and counted: [`dropped`]).
pub const CAPACITY: usize = 1 << 20;

static ENABLED: AtomicBool = AtomicBool::new(false);
static RECORDS: Mutex<Log> = Mutex::new(Log {
    records: Vec::new(),
    dropped: 0,
});
static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();

struct Log {
    records: Vec<Record>,
    dropped: u64,
}

fn log() -> MutexGuard<'static, Log> {
    RECORDS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts recording in this process.
pub fn enable() {
    let _ = now_ns(); // anchors the clock before the first record
    ENABLED.store(true, Ordering::Release);
}

/// Stops recording (what was recorded stays until [`take`]).
pub fn disable() {
    ENABLED.store(false, Ordering::Release);
}

/// Whether this process records.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The records taken since the last call, in the order they were added.
pub fn take() -> Vec<Record> {
    let mut log = log();
    log.dropped = 0;
    std::mem::take(&mut log.records)
}

/// How many records were dropped since the last [`take`] because [`CAPACITY`] were kept.
pub fn dropped() -> u64 {
    log().dropped
}

/// Nanoseconds since the Unix epoch: the system clock read once per process, advanced by the
/// monotonic clock from then on (so it never steps back within a process; two processes on one
/// host agree to within how far their system-clock reads were apart, normally well under a
/// microsecond).
pub fn now_ns() -> u64 {
    let (start, start_ns) = *ANCHOR.get_or_init(|| {
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        (Instant::now(), since_epoch.as_nanos() as u64)
    });
    start_ns.saturating_add(start.elapsed().as_nanos() as u64)
}

/// Records `point` for `buffer` now, if recording is on (the memory store, mempool-store, records
/// its points through this).
#[inline]
pub fn mark(point: Point, buffer: u64) {
    if is_enabled() {
        push(point, buffer);
    }
}

/// Records `point` for `buffer` at `at_ns` (a [`now_ns`] taken earlier), if recording is on: for
/// waits whose buffer is known only once they end.
#[inline]
pub(crate) fn mark_at(point: Point, buffer: u64, at_ns: u64) {
    if is_enabled() {
        push_at(point, buffer, at_ns);
    }
}

/// [`now_ns`] if recording is on, else 0 (no clock read when off).
#[inline]
pub(crate) fn stamp() -> u64 {
    if is_enabled() {
        now_ns()
    } else {
        0
    }
}

#[cold]
fn push(point: Point, buffer: u64) {
    push_at(point, buffer, now_ns());
}

#[cold]
fn push_at(point: Point, buffer: u64, at_ns: u64) {
    let mut log = log();
    if log.records.len() < CAPACITY {
        log.records.push(Record { point, buffer, at_ns });
    } else {
        log.dropped += 1;
    }
}

/// What a process counts at each system call of the rings' data path, always (one relaxed atomic
/// add next to a system call that costs far more). [`counters`] reads them, [`reset_counters`]
/// zeroes them; divided by the buffers handed off between the two, they say how many system calls
/// and wake-ups a buffer cost.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Counters {
    /// `FUTEX_WAKE` calls on a ring's waiting flag: a doorbell rung to a side that slept.
    pub futex_wakes: u64,
    /// `FUTEX_WAIT` calls on a ring's waiting flag: this process slept on its doorbell.
    pub futex_waits: u64,
    /// `RingBell` frames sent (importer): the exporter's loop slept when releases were published.
    pub bells_sent: u64,
    /// `poll` calls of the importer on its socket (is a frame there?).
    pub socket_polls: u64,
    /// Exporter: rounds of the serving thread that could sleep in `epoll` (its waiting flags set).
    pub loop_sleeps: u64,
    /// Exporter: rounds of the serving thread that found ring entries by spinning instead.
    pub loop_spin_hits: u64,
    /// Exporter: notifications of the exporter's waiters that made a system call (a thread waited).
    pub notifies: u64,
    /// Exporter: buffers a notification of `wait_released` woke a thread for.
    pub release_wakes: u64,
}

impl Counters {
    /// How many `u64`s [`Counters::to_words`] gives.
    pub const WORDS: usize = 8;

    /// The counters as words, in field order (to send them to another process).
    pub fn to_words(&self) -> [u64; Counters::WORDS] {
        [
            self.futex_wakes,
            self.futex_waits,
            self.bells_sent,
            self.socket_polls,
            self.loop_sleeps,
            self.loop_spin_hits,
            self.notifies,
            self.release_wakes,
        ]
    }

    /// The counters [`Counters::to_words`] gave.
    pub fn from_words(w: [u64; Counters::WORDS]) -> Counters {
        Counters {
            futex_wakes: w[0],
            futex_waits: w[1],
            bells_sent: w[2],
            socket_polls: w[3],
            loop_sleeps: w[4],
            loop_spin_hits: w[5],
            notifies: w[6],
            release_wakes: w[7],
        }
    }

    /// The sum of two processes' counters.
    pub fn add(&self, other: &Counters) -> Counters {
        let (a, b) = (self.to_words(), other.to_words());
        Counters::from_words(std::array::from_fn(|i| a[i].saturating_add(b[i])))
    }
}

/// Which counter of [`Counters`] to add to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    FutexWake = 0,
    FutexWait = 1,
    BellSent = 2,
    SocketPoll = 3,
    LoopSleep = 4,
    LoopSpinHit = 5,
    Notify = 6,
    ReleaseWake = 7,
}

static COUNTERS: [std::sync::atomic::AtomicU64; Counters::WORDS] =
    [const { std::sync::atomic::AtomicU64::new(0) }; Counters::WORDS];

/// Adds one to `counter`.
#[inline]
pub(crate) fn count(counter: Counter) {
    COUNTERS[counter as usize].fetch_add(1, Ordering::Relaxed);
}

/// This process's counters since the last [`reset_counters`].
pub fn counters() -> Counters {
    Counters::from_words(std::array::from_fn(|i| COUNTERS[i].load(Ordering::Relaxed)))
}

/// Zeroes this process's counters.
pub fn reset_counters() {
    for c in &COUNTERS {
        c.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
