//! [`LoggingAdaptor`]: every allocation and free as a CSV line in the format RMM's
//! `logging_resource_adaptor` writes, and the parser that reads such logs back (for replay): RMM's
//! current format, RMM's older ones, and what mempool-rmm wrote before it matched RMM's.
//!
//! RMM 26.10 writes (`cpp/src/mr/detail/logging_resource_adaptor_impl.cpp`, through rapids-logger's
//! spdlog): the header `Thread,Time,Action,Pointer,Size,Stream`, then one line per event with the
//! pattern `%t,%H:%M:%S.%f,%v` and the message `allocate,%p,%zu,%s`, `allocate failure,%p,%zu,%s`
//! (pointer null) or `free,%p,%zu,%s`, the stream written by `std::ostream << cudaStream_t`:
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 48213,14:02:11.503221,allocate,0x7f3a5c000000,1024,0x55d0c8a3f2b0
//! 48213,14:02:11.503297,allocate failure,(nil),1125899906842624,0
//! 48214,14:02:11.504010,free,0x7f3a5c000000,1024,0x55d0c8a3f350
//! ```
//!
//! Thread: the OS thread id (`gettid`), decimal. Time: time of day, microseconds. Pointer: glibc's
//! `%p`, `0x` and lowercase hex, `(nil)` for null. Size: decimal. Stream: libstdc++'s pointer output,
//! `0x` and lowercase hex, `0` for the null (default) stream.

use std::io::{BufRead, Write};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::observe::oom::explain;
use crate::resource::MemoryResource;

/// The header line RMM's `logging_resource_adaptor` writes (RMM 0.14.1 and later), and this adaptor too.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// The header of RMM 0.13 and 0.14.0, whose lines have no thread column; [`parse_log`] reads such logs
/// with thread 0.
const LOG_HEADER_WITHOUT_THREAD: &str = "Time,Action,Pointer,Size,Stream";

/// What a log line records.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `allocate`
    Allocate,
    /// `allocate failure` (RMM 22.04 and later; the pointer is null)
    AllocateFailure,
    /// `free`, RMM's word (and this adaptor's); [`parse_log`] also reads `deallocate`, which mempool-rmm
    /// wrote before it matched RMM's format.
    Deallocate,
}

impl Action {
    /// The word RMM writes in the `Action` column: `allocate`, `allocate failure` or `free`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::AllocateFailure => "allocate failure",
            Action::Deallocate => "free",
        }
    }
}

/// One parsed log line.
#[derive(Clone, Debug, PartialEq)]
pub struct LogEvent {
    /// The thread id as logged (0 for RMM 0.13 and 0.14.0 logs, which have no thread column).
    pub thread: u64,
    /// Seconds: since midnight for RMM's time of day (`HH:MM:SS.ffffff`, or `HH:MM:SS:ffffff` before RMM
    /// 21.06); since the epoch for mempool-rmm's older logs (`seconds.micros`).
    pub time: f64,
    /// What happened.
    pub action: Action,
    /// The address (0 for a null pointer: `(nil)`, `0x0` or `0`).
    pub ptr: u64,
    /// The size in bytes.
    pub size: usize,
    /// The stream handle value (0 for the null stream).
    pub stream: u64,
}

/// A malformed log line, with its 1-based line number.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct LogParseError {
    /// The line number, counting the header as line 1.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn parse_hex(s: &str) -> Option<u64> {
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// A pointer as RMM has written it: `0x` and hex (glibc's `%p` since RMM 24.12, fmt's `{}` before, an
/// `ostream` before RMM 0.17), `(nil)` (glibc's `%p` of null) or `0` (an `ostream`'s null pointer).
fn parse_pointer(field: &str) -> Option<u64> {
    match field {
        "(nil)" | "0" => Some(0),
        f => parse_hex(f),
    }
}

/// A stream as RMM has written it: `0x` and hex (fmt's `ptr` from RMM 0.17, an `ostream`'s pointer since
/// RMM 24.12), or decimal (the handle's integer value before RMM 0.17; `0`, an `ostream`'s null pointer,
/// since RMM 24.12).
fn parse_stream(field: &str) -> Option<u64> {
    decimal(field).or_else(|| parse_hex(field))
}

/// Parses a log in RMM's CSV format, as [`LoggingAdaptor`] or RMM's `logging_resource_adaptor` writes it,
/// in any of the forms RMM has written:
///
/// - the header `Thread,Time,Action,Pointer,Size,Stream`, or RMM 0.13-0.14.0's
///   `Time,Action,Pointer,Size,Stream` (no thread column: thread 0);
/// - time `HH:MM:SS.ffffff` (RMM 21.06 and later), `HH:MM:SS:ffffff` (before) or decimal seconds
///   (mempool-rmm's own logs before it wrote RMM's format);
/// - action `allocate`, `allocate failure`, `free`, or `deallocate` (mempool-rmm's older logs);
/// - pointer `0x`-prefixed hex, `(nil)` or `0`; size decimal; stream `0x`-prefixed hex or decimal.
///
/// Fields may be padded with spaces; blank lines are skipped; a `\r` before the newline is ignored.
/// Errors name the line (the header is line 1).
pub fn parse_log(reader: impl BufRead) -> std::result::Result<Vec<LogEvent>, LogParseError> {
    let mut events = Vec::new();
    let mut with_thread = true;
    let mut header_seen = false;
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| LogParseError {
            line: n,
            reason: format!("unreadable: {e}"),
        })?;
        let line = line.trim_end_matches('\r');
        if n == 1 {
            header_seen = true;
            // A byte-order mark before the header is skipped, as RMM's CSV reader does.
            match line.trim_start_matches('\u{feff}').trim() {
                LOG_HEADER => with_thread = true,
                LOG_HEADER_WITHOUT_THREAD => with_thread = false,
                _ => {
                    return Err(LogParseError {
                        line: 1,
                        reason: format!(
                            "expected the header `{LOG_HEADER}` (or RMM 0.14's `{LOG_HEADER_WITHOUT_THREAD}`)"
                        ),
                    })
                }
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let mut f: Vec<&str> = line.split(',').map(str::trim).collect();
        let expected = if with_thread { 6 } else { 5 };
        if f.len() != expected {
            return Err(LogParseError {
                line: n,
                reason: format!("expected {expected} fields, found {}", f.len()),
            });
        }
        let err = |what: &str, v: &str| LogParseError {
            line: n,
            reason: format!("bad {what} `{v}`"),
        };
        let thread = if with_thread {
            let t = f.remove(0);
            decimal(t).ok_or_else(|| err("thread", t))?
        } else {
            0
        };
        let time = parse_time(f[0]).ok_or_else(|| err("time", f[0]))?;
        let action = match f[1] {
            "allocate" => Action::Allocate,
            "allocate failure" => Action::AllocateFailure,
            "free" | "deallocate" => Action::Deallocate,
            other => return Err(err("action", other)),
        };
        let ptr = parse_pointer(f[2]).ok_or_else(|| err("pointer", f[2]))?;
        let size = decimal(f[3]).ok_or_else(|| err("size", f[3]))?;
        let stream = parse_stream(f[4]).ok_or_else(|| err("stream", f[4]))?;
        events.push(LogEvent {
            thread,
            time,
            action,
            ptr,
            size,
            stream,
        });
    }
    if !header_seen {
        return Err(LogParseError {
            line: 1,
            reason: format!("the log is empty: expected the header `{LOG_HEADER}`"),
        });
    }
    Ok(events)
}

/// `HH:MM:SS` then `.` or `:` then the fraction of the second (RMM), or decimal seconds (mempool-rmm's
/// older logs). Returns seconds.
fn parse_time(field: &str) -> Option<f64> {
    let parts: Vec<&str> = field.split(':').collect();
    let (h, m, s, frac) = match parts[..] {
        [secs] => {
            let (whole, frac) = secs.split_once('.').unwrap_or((secs, "0"));
            return Some(decimal::<u64>(whole)? as f64 + fraction(frac)?);
        }
        [h, m, s_frac] => {
            let (s, frac) = s_frac.split_once('.')?;
            (h, m, s, frac)
        }
        [h, m, s, frac] => (h, m, s, frac),
        _ => return None,
    };
    let field = |v: &str, below: u64| decimal::<u64>(v).filter(|&x| v.len() <= 2 && x < below);
    let (h, m, s) = (field(h, 24)?, field(m, 60)?, field(s, 61)?);
    Some((h * 3600 + m * 60 + s) as f64 + fraction(frac)?)
}

/// Digits after the point (at most 9), as a fraction.
fn fraction(digits: &str) -> Option<f64> {
    let v = decimal::<u64>(digits).filter(|_| digits.len() <= 9)?;
    Some(v as f64 / 10f64.powi(digits.len() as i32))
}

/// Decimal digits only (no sign, no spaces).
fn decimal<T: std::str::FromStr>(field: &str) -> Option<T> {
    is_digits(field).then(|| field.parse().ok()).flatten()
}

/// The OS thread id, as spdlog's `%t` writes it (Linux: `gettid`).
#[cfg(target_os = "linux")]
fn os_thread_id() -> u64 {
    rustix::thread::gettid().as_raw_nonzero().get() as u64
}

/// Elsewhere: threads numbered from 1 in the order they first log.
#[cfg(not(target_os = "linux"))]
fn os_thread_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
    NEXT_THREAD.fetch_add(1, Ordering::Relaxed)
}

thread_local! {
    static THREAD_ID: u64 = os_thread_id();
}

/// A pointer as glibc's `%p` writes it.
struct Pointer(u64);

impl std::fmt::Display for Pointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => f.write_str("(nil)"),
            p => write!(f, "{p:#x}"),
        }
    }
}

/// A stream handle as libstdc++'s `ostream << const void*` writes it (RMM's `format_stream`).
struct StreamHandle(usize);

impl std::fmt::Display for StreamHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => f.write_str("0"),
            s => write!(f, "{s:#x}"),
        }
    }
}

/// Writes each allocation, failed allocation and free as a CSV line in the format RMM 26.10's
/// `logging_resource_adaptor` writes (the module documentation shows it), so RMM's replay benchmark and
/// mempool-bench's `replay` read each other's logs: the header, then
/// `thread,HH:MM:SS.ffffff,allocate|allocate failure|free,pointer,size,stream`.
///
/// The one difference: the time of day is UTC, where RMM (spdlog) writes local time; Rust's standard
/// library has no time zones, and `localtime_r` reads the environment, which safe code may be changing on
/// another thread. On a machine whose zone is UTC the two agree; RMM's parser ignores the column.
///
/// As RMM does, a free is logged before the upstream frees the block: another thread that gets the same
/// address from the upstream logs its `allocate` after this `free`, so the log replays. A free whose log
/// write fails still frees (and returns the log error).
///
/// ```
/// use mempool_core::StreamRef;
/// use mempool_rmm::adaptors::{parse_log, LoggingAdaptor};
/// use mempool_rmm::{testing::SimResource, MemoryResource};
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let mr = LoggingAdaptor::new(unsafe { SimResource::new() }, Vec::<u8>::new()).unwrap();
/// let p = mr.allocate(512, StreamRef::LEGACY).unwrap();
/// // SAFETY: `p` came from `mr.allocate` with this size, is freed once, and nothing uses it after.
/// unsafe { mr.deallocate(p, 512, StreamRef::LEGACY) }.unwrap();
/// let log = mr.into_writer().unwrap();
/// assert_eq!(parse_log(&log[..]).unwrap().len(), 2);
/// ```
pub struct LoggingAdaptor<U, W: Write + Send> {
    upstream: U,
    out: Mutex<W>,
    auto_flush: bool,
}

impl<U: std::fmt::Debug, W: Write + Send> std::fmt::Debug for LoggingAdaptor<U, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoggingAdaptor")
            .field("upstream", &self.upstream)
            .field("auto_flush", &self.auto_flush)
            .finish()
    }
}

impl<U: MemoryResource, W: Write + Send> LoggingAdaptor<U, W> {
    /// Wraps `upstream`, logging to `out` (the header is written at once).
    pub fn new(upstream: U, mut out: W) -> Result<Self> {
        writeln!(out, "{LOG_HEADER}").map_err(|e| Error::Log(e.to_string()))?;
        Ok(LoggingAdaptor {
            upstream,
            out: Mutex::new(out),
            auto_flush: false,
        })
    }

    /// Flushes after every line (slower; nothing lost if the process dies).
    pub fn auto_flush(mut self, on: bool) -> Self {
        self.auto_flush = on;
        self
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Flushes the writer.
    pub fn flush(&self) -> Result<()> {
        self.out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush()
            .map_err(|e| Error::Log(e.to_string()))
    }

    /// Unwraps the writer (flushed).
    pub fn into_writer(self) -> Result<W> {
        let mut w = self.out.into_inner().unwrap_or_else(|p| p.into_inner());
        w.flush().map_err(|e| Error::Log(e.to_string()))?;
        Ok(w)
    }

    fn log(&self, action: Action, ptr: DeviceAddr, size: usize, stream: StreamRef<'_>) -> Result<()> {
        let thread = THREAD_ID.with(|t| *t);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let day = now.as_secs() % 86_400;
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        writeln!(
            out,
            "{thread},{:02}:{:02}:{:02}.{:06},{},{},{size},{}",
            day / 3600,
            day / 60 % 60,
            day % 60,
            now.subsec_micros(),
            action.as_str(),
            Pointer(ptr.0),
            StreamHandle(stream.handle())
        )
        .and_then(|()| if self.auto_flush { out.flush() } else { Ok(()) })
        .map_err(|e| Error::Log(e.to_string()))
    }
}

// SAFETY: forwards every allocation and free to the upstream unchanged (it only logs them), so the upstream's `unsafe impl` guarantees are this one's.
#[allow(unsafe_code)]
unsafe impl<U: MemoryResource, W: Write + Send> MemoryResource for LoggingAdaptor<U, W> {
    #[allow(unsafe_code)]
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        match self.upstream.allocate(bytes, stream) {
            Ok(p) => {
                if let Err(e) = self.log(Action::Allocate, p, bytes, stream) {
                    // The caller gets the error; the memory must not leak because of a log failure.
                    // SAFETY: `p` was just allocated by the upstream with `bytes`, is freed once here and was
                    // never handed to the caller, so nothing uses it.
                    let _ = unsafe { self.upstream.deallocate(p, bytes, stream) };
                    return Err(e);
                }
                Ok(p)
            }
            Err(e) => {
                let _ = self.log(Action::AllocateFailure, DeviceAddr::NULL, bytes, stream);
                Err(explain(e, self))
            }
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // Logged first, as RMM does: once the upstream has the block back, another thread may get it and
        // log its allocation, which must come after this line.
        let logged = self.log(Action::Deallocate, ptr, bytes, stream);
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
        logged
    }

    fn name(&self) -> &'static str {
        "LoggingAdaptor"
    }

    fn upstream_resource(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::testing::SimResource;
    const S: StreamRef<'static> = StreamRef::LEGACY;

    /// `HH:MM:SS.ffffff`, as spdlog's `%H:%M:%S.%f` writes it.
    fn is_time_of_day(t: &str) -> bool {
        let b = t.as_bytes();
        b.len() == 15
            && b.iter().enumerate().all(|(i, c)| match i {
                2 | 5 => *c == b':',
                8 => *c == b'.',
                _ => c.is_ascii_digit(),
            })
    }

    #[test]
    fn writes_what_rmm_26_10_writes_and_reads_it_back() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = LoggingAdaptor::new(unsafe { SimResource::with_capacity(4096) }, Vec::new()).unwrap();
        let a = mr.allocate(1000, S).unwrap();
        assert!(mr.allocate(1 << 20, StreamRef::PER_THREAD).is_err());
        let z = mr.allocate(0, S).unwrap();
        // SAFETY: allocated from `mr` above with these sizes and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 1000, StreamRef::PER_THREAD) }.unwrap();
        // SAFETY: as above (the 0-byte allocation is the null address).
        unsafe { mr.deallocate(z, 0, S) }.unwrap();
        let log = String::from_utf8(mr.into_writer().unwrap()).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines[0], LOG_HEADER);
        assert!(log.ends_with('\n'));
        let tid = THREAD_ID.with(|t| *t);
        let expected = [
            format!("allocate,{:#x},1000,0", a.0),
            "allocate failure,(nil),1048576,0x2".to_owned(),
            "allocate,(nil),0,0".to_owned(),
            format!("free,{:#x},1000,0x2", a.0),
            "free,(nil),0,0".to_owned(),
        ];
        assert_eq!(lines.len(), 1 + expected.len(), "{log}");
        for (line, rest) in lines[1..].iter().zip(&expected) {
            let (thread, tail) = line.split_once(',').unwrap();
            let (time, tail) = tail.split_once(',').unwrap();
            assert_eq!(thread, tid.to_string(), "{line}");
            assert!(is_time_of_day(time), "{line}");
            assert_eq!(tail, rest);
        }
        let events = parse_log(log.as_bytes()).unwrap();
        assert_eq!(events.len(), 5);
        assert_eq!(events[0].action, Action::Allocate);
        assert_eq!(events[0].ptr, a.0);
        assert_eq!(
            (events[1].action, events[1].ptr, events[1].stream),
            (Action::AllocateFailure, 0, 2)
        );
        assert_eq!(events[3].action, Action::Deallocate);
        assert_eq!(events[3].size, 1000);
        assert!(events.iter().all(|e| e.thread == tid && e.time < 86_400.0));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn threads_are_os_thread_ids() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let mr = LoggingAdaptor::new(unsafe { SimResource::new() }, Vec::new()).unwrap();
        let ids: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let p = mr.allocate(64, S).unwrap();
                        // SAFETY: allocated just above with this size, freed once, never dereferenced.
                        unsafe { mr.deallocate(p, 64, S) }.unwrap();
                        rustix::thread::gettid().as_raw_nonzero().get() as u64
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let events = parse_log(&mr.into_writer().unwrap()[..]).unwrap();
        for id in &ids {
            assert_eq!(events.iter().filter(|e| e.thread == *id).count(), 2);
        }
        assert_ne!(ids[0], ids[1]);
    }

    /// A writer and an upstream sharing one buffer, so that the upstream sees what was logged before it.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl std::fmt::Debug for Shared {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Shared")
        }
    }

    #[derive(Debug)]
    struct SeesLog {
        sim: SimResource,
        log: Arc<Mutex<Vec<u8>>>,
    }

    // SAFETY: a test double that forwards to the simulation, which was constructed under `SimResource::new`'s contract (its addresses are never dereferenced in this test).
    #[allow(unsafe_code)]
    unsafe impl MemoryResource for SeesLog {
        fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
            self.sim.allocate(bytes, stream)
        }
        unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
            let log = String::from_utf8(self.log.lock().unwrap().clone()).unwrap();
            let last = log.lines().last().unwrap();
            assert!(last.ends_with(&format!(",free,{:#x},{bytes},0", ptr.0)), "{last}");
            // SAFETY: the caller's obligations for this resource are the simulation's: it handed `ptr` out.
            unsafe { self.sim.deallocate(ptr, bytes, stream) }
        }
        fn name(&self) -> &'static str {
            "SeesLog"
        }
    }

    #[test]
    fn a_free_is_logged_before_the_upstream_frees() {
        let out = Shared::default();
        let up = SeesLog {
            // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
            #[allow(unsafe_code)]
            sim: unsafe { SimResource::new() },
            log: out.0.clone(),
        };
        let mr = LoggingAdaptor::new(up, out.clone()).unwrap();
        let p = mr.allocate(256, S).unwrap();
        // SAFETY: allocated just above with this size, freed once, never dereferenced.
        unsafe { mr.deallocate(p, 256, S) }.unwrap();
        assert_eq!(mr.upstream().sim.live_allocations(), 0);
    }

    #[test]
    fn reads_every_form_rmm_has_written() {
        // RMM 24.12 to 26.10: glibc's %p (`(nil)`), streams through an ostream (`0` for null).
        let rmm_26 = "Thread,Time,Action,Pointer,Size,Stream\n\
                      48213,14:02:11.503221,allocate,0x7f3a5c000000,1024,0x55d0c8a3f2b0\n\
                      48213,14:02:11.503297,allocate failure,(nil),1125899906842624,0\n\
                      48214,14:02:11.504010,free,0x7f3a5c000000,1024,0x55d0c8a3f350\n";
        let e = parse_log(rmm_26.as_bytes()).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(
            (e[0].thread, e[0].ptr, e[0].size, e[0].stream),
            (48213, 0x7f3a5c000000, 1024, 0x55d0c8a3f2b0)
        );
        assert!((e[0].time - (14.0 * 3600.0 + 2.0 * 60.0 + 11.503221)).abs() < 1e-6);
        assert_eq!((e[1].action, e[1].ptr, e[1].stream), (Action::AllocateFailure, 0, 0));
        assert_eq!((e[2].thread, e[2].action), (48214, Action::Deallocate));
        // RMM 21.06 to 24.10: fmt (`0x0` for null), and 0.17 to 21.04 with a colon before the micros.
        let fmt_era = "Thread,Time,Action,Pointer,Size,Stream\r\n\
                       140573312345856,12:34:56:789012,allocate,0x7f8a40000000,1024,0x7f8a38001020\r\n\
                       140573312345856,12:34:57.000001,allocate failure,0x0,99,0x0\r\n\
                       140573312345856,12:34:58:000000,free,0x7f8a40000000,1024,0x7f8a38001020\r\n";
        let e = parse_log(fmt_era.as_bytes()).unwrap();
        assert!((e[0].time - (12.0 * 3600.0 + 34.0 * 60.0 + 56.789012)).abs() < 1e-6);
        assert_eq!((e[1].ptr, e[1].stream), (0, 0));
        assert_eq!((e[2].action, e[2].stream), (Action::Deallocate, 0x7f8a38001020));
        // RMM 0.14.1 to 0.16: an ostream's pointer (`0` for null), the stream as a decimal integer.
        let v015 = "Thread,Time,Action,Pointer,Size,Stream\n\
                    7,09:00:00:000001,allocate,0x7f8a40000000,8,94234234234\n\
                    7,09:00:00:000002,free,0,0,0\n";
        let e = parse_log(v015.as_bytes()).unwrap();
        assert_eq!((e[0].stream, e[1].ptr), (94234234234, 0));
        // RMM 0.13 and 0.14.0: no thread column.
        let v013 = "Time,Action,Pointer,Size,Stream\n23:59:59:999999,allocate,0x10,5,0\n";
        let e = parse_log(v013.as_bytes()).unwrap();
        assert_eq!((e[0].thread, e[0].ptr, e[0].size), (0, 0x10, 5));
        assert!((e[0].time - 86_399.999999).abs() < 1e-6);
        // mempool-rmm before it matched RMM: seconds since the epoch, `deallocate`, `0x0` streams.
        let old = "Thread,Time,Action,Pointer,Size,Stream\n\
                   1,1795318196.826729,allocate,0x700000000000,224918,0x0\n\
                   1,1795318196.826743,deallocate,0x700000000000,224918,0x0\n";
        let e = parse_log(old.as_bytes()).unwrap();
        assert!((e[0].time - 1795318196.826729).abs() < 1e-5);
        assert_eq!(e[1].action, Action::Deallocate);
    }

    #[test]
    fn an_empty_log_is_refused_and_a_byte_order_mark_is_skipped() {
        let e = parse_log(&b""[..]).unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.reason.contains("the log is empty"), "{e}");
        let with_bom = format!("\u{feff}{LOG_HEADER}\n7,12:00:00.000001,allocate,0x7000,256,0\n");
        let events = parse_log(with_bom.as_bytes()).unwrap();
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn malformed_lines_name_their_line() {
        const H: &str = "Thread,Time,Action,Pointer,Size,Stream\n";
        let cases = [
            ("nope\n".to_owned(), 1, "header"),
            (format!("{H}1,2,allocate,0x10,5\n"), 2, "6 fields"),
            (
                format!("{H}1,2,allocate,0x10,5,0x0\n1,2,release,0x10,5,0x0\n"),
                3,
                "action",
            ),
            (format!("{H}x,2,allocate,0x10,5,0x0\n"), 2, "thread"),
            (format!("{H}-1,2,allocate,0x10,5,0x0\n"), 2, "thread"),
            (format!("{H}1,2,allocate,16,5,0x0\n"), 2, "pointer"),
            (format!("{H}1,2,allocate,0x,5,0x0\n"), 2, "pointer"),
            (format!("{H}1,2,allocate,nil,5,0x0\n"), 2, "pointer"),
            (format!("{H}1,2,allocate,0x10,-5,0x0\n"), 2, "size"),
            (format!("{H}1,2,allocate,0x10,5,stream\n"), 2, "stream"),
            (format!("{H}1,nan,allocate,0x10,5,0x0\n"), 2, "time"),
            (format!("{H}1,24:00:00.000000,allocate,0x10,5,0x0\n"), 2, "time"),
            (format!("{H}1,12:60:00.000000,allocate,0x10,5,0x0\n"), 2, "time"),
            (format!("{H}1,12:00:00,allocate,0x10,5,0x0\n"), 2, "time"),
            (format!("{H}1,12:00:00.,allocate,0x10,5,0x0\n"), 2, "time"),
            (
                format!("{H}\n1,2,allocate,0x10,5,0x0\n1,2,free,0x10,5\n"),
                4,
                "6 fields",
            ),
            (
                "Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,5,0\n".to_owned(),
                2,
                "5 fields",
            ),
        ];
        for (text, line, what) in cases {
            let e = parse_log(text.as_bytes()).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.reason.contains(what), "{text:?}: {e}");
        }
    }
}
