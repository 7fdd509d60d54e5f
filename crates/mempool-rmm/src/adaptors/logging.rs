//! [`LoggingAdaptor`]: every allocation and free as a CSV line in RMM's format, and the parser that
//! reads such logs back (for replay).

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resource::MemoryResource;

/// The header line RMM's `logging_resource_adaptor` writes, and this adaptor too.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// What a log line records.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `allocate`
    Allocate,
    /// `allocate failure`
    AllocateFailure,
    /// `deallocate`
    Deallocate,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::AllocateFailure => "allocate failure",
            Action::Deallocate => "deallocate",
        }
    }
}

/// One parsed log line.
#[derive(Clone, Debug, PartialEq)]
pub struct LogEvent {
    /// The thread id as logged.
    pub thread: u64,
    /// Seconds (since the epoch, or whatever origin the writer used).
    pub time: f64,
    /// What happened.
    pub action: Action,
    /// The address.
    pub ptr: u64,
    /// The size in bytes.
    pub size: usize,
    /// The stream handle value.
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

fn parse_hex(field: &str) -> Option<u64> {
    let f = field.trim();
    let digits = f.strip_prefix("0x").or_else(|| f.strip_prefix("0X"))?;
    u64::from_str_radix(digits, 16).ok()
}

/// Parses a log in RMM's CSV format (as [`LoggingAdaptor`] or RMM writes it). Pointers and streams are
/// hex with `0x`; sizes and threads decimal; time decimal seconds (RMM also writes `HH:MM:SS:micros`,
/// which is read as seconds of the day). The first line must be the header.
pub fn parse_log(reader: impl BufRead) -> std::result::Result<Vec<LogEvent>, LogParseError> {
    let mut events = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| LogParseError {
            line: n,
            reason: format!("unreadable: {e}"),
        })?;
        let line = line.trim_end_matches('\r');
        if n == 1 {
            if line.trim() != LOG_HEADER {
                return Err(LogParseError {
                    line: 1,
                    reason: format!("expected the header `{LOG_HEADER}`"),
                });
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 6 {
            return Err(LogParseError {
                line: n,
                reason: format!("expected 6 fields, found {}", f.len()),
            });
        }
        let err = |what: &str, v: &str| LogParseError {
            line: n,
            reason: format!("bad {what} `{v}`"),
        };
        let thread = f[0].trim().parse::<u64>().map_err(|_| err("thread", f[0]))?;
        let time = parse_time(f[1]).ok_or_else(|| err("time", f[1]))?;
        let action = match f[2].trim() {
            "allocate" => Action::Allocate,
            "allocate failure" => Action::AllocateFailure,
            "deallocate" => Action::Deallocate,
            other => return Err(err("action", other)),
        };
        let ptr = parse_hex(f[3]).ok_or_else(|| err("pointer", f[3]))?;
        let size = f[4].trim().parse::<usize>().map_err(|_| err("size", f[4]))?;
        let stream = parse_hex(f[5]).ok_or_else(|| err("stream", f[5]))?;
        events.push(LogEvent {
            thread,
            time,
            action,
            ptr,
            size,
            stream,
        });
    }
    Ok(events)
}

fn parse_time(field: &str) -> Option<f64> {
    let f = field.trim();
    if let Ok(v) = f.parse::<f64>() {
        return v.is_finite().then_some(v);
    }
    // HH:MM:SS:micros
    let parts: Vec<&str> = f.split(':').collect();
    if parts.len() == 4 {
        let v: Vec<u64> = parts.iter().map(|p| p.parse().ok()).collect::<Option<_>>()?;
        return Some((v[0] * 3600 + v[1] * 60 + v[2]) as f64 + v[3] as f64 / 1e6);
    }
    None
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
thread_local! {
    static THREAD_ID: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// Writes each allocation, failed allocation and free as a CSV line in RMM's format
/// (`Thread,Time,Action,Pointer,Size,Stream`), so RMM's replay tools and mempool-bench's read each
/// other's logs. Threads are numbered from 1 in the order they first log.
///
/// ```
/// use mempool_core::StreamRef;
/// use mempool_rmm::adaptors::{parse_log, LoggingAdaptor};
/// use mempool_rmm::{testing::SimResource, MemoryResource};
/// let mr = LoggingAdaptor::new(SimResource::new(), Vec::<u8>::new()).unwrap();
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
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        writeln!(
            out,
            "{thread},{}.{:06},{},{:#x},{size},{:#x}",
            now.as_secs(),
            now.subsec_micros(),
            action.as_str(),
            ptr.0,
            stream.id()
        )
        .and_then(|()| if self.auto_flush { out.flush() } else { Ok(()) })
        .map_err(|e| Error::Log(e.to_string()))
    }
}

impl<U: MemoryResource, W: Write + Send> MemoryResource for LoggingAdaptor<U, W> {
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
                Err(e)
            }
        }
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: this adaptor hands out the upstream's allocations unchanged (same address, same size), so
        // the caller's obligations 1-3 for this adaptor are the same obligations for the upstream.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
        self.log(Action::Deallocate, ptr, bytes, stream)
    }

    fn name(&self) -> &'static str {
        "LoggingAdaptor"
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use super::*;
    use crate::testing::SimResource;
    const S: StreamRef<'static> = StreamRef::LEGACY;

    #[test]
    fn writes_rmm_csv_and_reads_it_back() {
        let mr = LoggingAdaptor::new(SimResource::with_capacity(4096), Vec::new()).unwrap();
        let a = mr.allocate(1000, S).unwrap();
        assert!(mr.allocate(1 << 20, S).is_err());
        // SAFETY: allocated from `mr` above with this size and freed once; SimResource addresses are never
        // dereferenced.
        unsafe { mr.deallocate(a, 1000, S) }.unwrap();
        let log = String::from_utf8(mr.into_writer().unwrap()).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines[0], LOG_HEADER);
        assert_eq!(lines.len(), 4);
        assert!(
            lines[1].contains(&format!(",allocate,{:#x},1000,0x0", a.0)),
            "{}",
            lines[1]
        );
        assert!(lines[2].contains(",allocate failure,0x0,1048576,0x0"), "{}", lines[2]);
        let events = parse_log(log.as_bytes()).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].action, Action::Allocate);
        assert_eq!(events[0].ptr, a.0);
        assert_eq!(events[2].action, Action::Deallocate);
        assert_eq!(events[2].size, 1000);
        assert_eq!(events[0].thread, events[2].thread);
    }

    #[test]
    fn reads_rmm_written_logs() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n\
                   140573312345856,1634567890.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020\n\
                   140573312345856,12:34:56:789012,deallocate,0x7f8a40000000,1024,0x7f8a38001020\n";
        let e = parse_log(log.as_bytes()).unwrap();
        assert_eq!(e[0].thread, 140573312345856);
        assert_eq!(e[0].ptr, 0x7f8a40000000);
        assert_eq!(e[1].stream, 0x7f8a38001020);
        assert!((e[1].time - (12.0 * 3600.0 + 34.0 * 60.0 + 56.789012)).abs() < 1e-6);
    }

    #[test]
    fn malformed_lines_name_their_line() {
        let cases = [
            ("nope\n", 1, "header"),
            (
                "Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,5\n",
                2,
                "6 fields",
            ),
            (
                "Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,5,0x0\n1,2,free,0x10,5,0x0\n",
                3,
                "action",
            ),
            (
                "Thread,Time,Action,Pointer,Size,Stream\nx,2,allocate,0x10,5,0x0\n",
                2,
                "thread",
            ),
            (
                "Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,16,5,0x0\n",
                2,
                "pointer",
            ),
            (
                "Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,-5,0x0\n",
                2,
                "size",
            ),
            (
                "Thread,Time,Action,Pointer,Size,Stream\n1,nan,allocate,0x10,5,0x0\n",
                2,
                "time",
            ),
        ];
        for (text, line, what) in cases {
            let e = parse_log(text.as_bytes()).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.reason.contains(what), "{text:?}: {e}");
        }
    }
}
