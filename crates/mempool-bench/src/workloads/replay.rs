//! `replay FILE`: replays a log in RMM's CSV format (`Thread,Time,Action,Pointer,Size,Stream`, as RMM
//! 26.10's `logging_resource_adaptor` and mempool-rmm's `LoggingAdaptor` write it, or in an older form
//! RMM or mempool-rmm wrote: `mempool_rmm::adaptors::parse_log` lists them) against each resource: one
//! thread per logged thread, every event in the logged order (a thread waits for the events before its
//! next one), all on one stream. Reported: time, nanoseconds per event, peak live bytes, and the
//! allocations that failed.
//!
//! Logged `allocate failure` lines are not replayed (they name no pointer a later line frees); they are
//! counted in the report. Allocations the log never frees are freed at the end, timed.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use mempool_core::{DeviceAddr, Stream, StreamRef};
use mempool_rmm::adaptors::{parse_log, Action, LogEvent};
use mempool_rmm::MemoryResource;

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::report::{median, Cell, Column, Report};
use crate::spec::build;
use crate::track::Tracked;
use crate::workloads::Common;

/// One replayable step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Allocate `size` bytes into slot `slot`.
    Alloc {
        /// The slot the pointer goes to.
        slot: usize,
        /// Bytes.
        size: usize,
    },
    /// Free the allocation in slot `slot`.
    Free {
        /// The slot.
        slot: usize,
        /// Bytes (as allocated).
        size: usize,
    },
}

/// A log turned into per-thread step lists with one global order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Steps in the logged order.
    pub steps: Vec<Step>,
    /// For each step, the replaying thread (index into `threads`).
    pub thread_of: Vec<usize>,
    /// The logged thread ids, in order of first appearance.
    pub threads: Vec<u64>,
    /// Allocation slots (one per logged allocation).
    pub(crate) slots: usize,
    /// Logged `allocate failure` lines (not replayed).
    pub logged_failures: usize,
    /// Allocations the log never frees (freed at the end of a run, by the thread that made them).
    pub unfreed: Vec<(usize, usize, usize)>,
    /// The most bytes live at once in the log.
    pub logged_peak: u64,
}

fn log_err(path: &str, line: usize, reason: impl Into<String>) -> Error {
    Error::Log {
        path: path.to_owned(),
        line,
        reason: reason.into(),
    }
}

/// Parses a log (`name` names it in errors), checking that it is replayable: every freed pointer was
/// allocated by an earlier line and not freed since, with the same size; no pointer is allocated twice
/// while live. Errors name the line (the header is line 1).
pub fn parse(name: &str, reader: impl BufRead) -> Result<Plan> {
    let text = {
        let mut t = String::new();
        let mut r = reader;
        r.read_to_string(&mut t).map_err(|source| Error::Io {
            path: name.to_owned(),
            source,
        })?;
        t
    };
    let events = parse_log(text.as_bytes()).map_err(|e| log_err(name, e.line, e.reason))?;
    // parse_log skips blank lines: recover each event's line number.
    let lines: Vec<usize> = text
        .lines()
        .enumerate()
        .skip(1)
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, _)| i + 1)
        .collect();
    plan(name, &events, &lines)
}

/// Writes the snapshot of the log at `path` (`mempool_rmm::observe::from_log`) as JSON to `json`
/// and as the viewer page to `html`, whichever are given, and says so on stderr. The log need not be
/// replayable (failed allocations and frees of unknown addresses are kept in the history).
pub fn write_snapshot(path: &Path, json: Option<&Path>, html: Option<&Path>) -> Result<()> {
    let name = path.display().to_string();
    let io = |p: &Path, source| Error::Io {
        path: p.display().to_string(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let events = parse_log(text.as_bytes()).map_err(|e| log_err(&name, e.line, e.reason))?;
    let file_name = path
        .file_name()
        .map_or(name.clone(), |f| f.to_string_lossy().into_owned());
    let snapshot = mempool_rmm::observe::from_log(&events, &file_name);
    if let Some(p) = json {
        std::fs::write(p, mempool_rmm::observe::to_json(&snapshot)).map_err(|e| io(p, e))?;
        eprintln!("wrote snapshot: {} ({} events)", p.display(), snapshot.history.len());
    }
    if let Some(p) = html {
        std::fs::write(p, mempool_rmm::observe::page(&snapshot)?).map_err(|e| io(p, e))?;
        eprintln!("wrote page: {}", p.display());
    }
    Ok(())
}

/// Reads and parses the log at `path`.
pub fn load(path: &Path) -> Result<Plan> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| Error::Io {
        path: name.clone(),
        source,
    })?;
    parse(&name, std::io::BufReader::new(file))
}

fn plan(name: &str, events: &[LogEvent], lines: &[usize]) -> Result<Plan> {
    let mut threads: Vec<u64> = Vec::new();
    let mut thread_index: HashMap<u64, usize> = HashMap::new();
    // Live pointer -> (slot, size, thread).
    let mut live: HashMap<u64, (usize, usize, usize)> = HashMap::new();
    let mut steps = Vec::with_capacity(events.len());
    let mut thread_of = Vec::with_capacity(events.len());
    let (mut slots, mut logged_failures) = (0usize, 0usize);
    let (mut bytes, mut peak) = (0u64, 0u64);
    for (i, e) in events.iter().enumerate() {
        let line = lines.get(i).copied().unwrap_or(i + 2);
        let t = *thread_index.entry(e.thread).or_insert_with(|| {
            threads.push(e.thread);
            threads.len() - 1
        });
        match e.action {
            Action::AllocateFailure => logged_failures += 1,
            Action::Allocate => {
                if e.size > 0 && e.ptr == 0 {
                    return Err(log_err(
                        name,
                        line,
                        format!("allocate of {} bytes at a null pointer", e.size),
                    ));
                }
                if e.ptr == 0 {
                    // A 0-byte allocation: replay it, nothing frees it by address.
                    steps.push(Step::Alloc { slot: slots, size: 0 });
                    thread_of.push(t);
                    slots += 1;
                    continue;
                }
                if live.contains_key(&e.ptr) {
                    return Err(log_err(
                        name,
                        line,
                        format!("pointer {:#x} allocated again while still live", e.ptr),
                    ));
                }
                live.insert(e.ptr, (slots, e.size, t));
                steps.push(Step::Alloc {
                    slot: slots,
                    size: e.size,
                });
                thread_of.push(t);
                slots += 1;
                bytes += e.size as u64;
                peak = peak.max(bytes);
            }
            Action::Deallocate => {
                if e.ptr == 0 {
                    continue;
                }
                let Some((slot, size, _)) = live.remove(&e.ptr) else {
                    return Err(log_err(
                        name,
                        line,
                        format!(
                            "free of {:#x}, which no earlier line allocated (or it was freed already)",
                            e.ptr
                        ),
                    ));
                };
                if size != e.size {
                    return Err(log_err(
                        name,
                        line,
                        format!(
                            "free of {:#x} with {} bytes; it was allocated with {size}",
                            e.ptr, e.size
                        ),
                    ));
                }
                steps.push(Step::Free { slot, size });
                thread_of.push(t);
                bytes -= size as u64;
            }
        }
    }
    let mut unfreed: Vec<(usize, usize, usize)> = live.into_values().collect();
    unfreed.sort_unstable();
    Ok(Plan {
        steps,
        thread_of,
        threads,
        slots,
        logged_failures,
        unfreed,
        logged_peak: peak,
    })
}

/// What one replay measured.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ReplayStats {
    /// Wall time, seconds.
    pub(crate) seconds: f64,
    /// Allocations that failed.
    pub failures: u64,
    /// The most bytes live at once.
    pub peak_bytes: u64,
}

/// Replays `plan` on `mr`, one thread per logged thread, in the logged order, on `stream` (the legacy
/// stream and no synchronize when `None`: the host simulation).
#[allow(unsafe_code)] // frees the allocations it made, each once (see the SAFETY lines)
pub fn run(plan: &Plan, mr: &dyn MemoryResource, stream: Option<&Stream>) -> Result<ReplayStats> {
    let tracked = Tracked::new(mr);
    let s = stream.map_or(StreamRef::LEGACY, Stream::as_ref);
    let ptrs: Vec<AtomicU64> = (0..plan.slots).map(|_| AtomicU64::new(0)).collect();
    let next = AtomicUsize::new(0);
    let per_thread: Vec<Vec<usize>> = (0..plan.threads.len())
        .map(|t| (0..plan.steps.len()).filter(|&i| plan.thread_of[i] == t).collect())
        .collect();
    let error: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (t, mine) in per_thread.iter().enumerate() {
            let (tracked, ptrs, next, error) = (&tracked, &ptrs, &next, &error);
            let _ = t;
            scope.spawn(move || {
                for &i in mine {
                    let mut spins = 0u32;
                    while next.load(Ordering::Acquire) != i {
                        spins += 1;
                        if spins < 64 {
                            std::hint::spin_loop();
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    let r = match plan.steps[i] {
                        Step::Alloc { slot, size } => match tracked.allocate(size, s) {
                            Ok(p) => {
                                ptrs[slot].store(p.0, Ordering::Relaxed);
                                Ok(())
                            }
                            Err(e) if e.is_out_of_memory() => Ok(()),
                            Err(e) => Err(e),
                        },
                        Step::Free { slot, size } => {
                            let p = ptrs[slot].swap(0, Ordering::Relaxed);
                            if p == 0 && size > 0 {
                                Ok(()) // its allocation failed
                            } else {
                                // SAFETY: `p` is the allocation this slot got from `tracked.allocate(size, _)`;
                                // the swap to 0 takes it out of the slot, so it is freed once. The plan frees
                                // a slot only after its allocation (the `next` counter orders the steps) on
                                // the stream of the log's free, and nothing uses replayed memory.
                                unsafe { tracked.deallocate(DeviceAddr(p), size, s) }
                            }
                        }
                    };
                    if let Err(e) = r {
                        error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e.into());
                    }
                    next.store(i + 1, Ordering::Release);
                }
            });
        }
    });
    for &(slot, size, _) in &plan.unfreed {
        let p = ptrs[slot].swap(0, Ordering::Relaxed);
        if p != 0 {
            // SAFETY: the slot's allocation from `tracked`, taken out of the slot by the swap (freed once);
            // every worker has finished, and nothing uses replayed memory.
            unsafe { tracked.deallocate(DeviceAddr(p), size, s) }?;
        }
    }
    if let Some(stream) = stream {
        stream.synchronize()?;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let st = tracked.stats();
    Ok(ReplayStats {
        seconds,
        failures: st.failures,
        peak_bytes: st.peak,
    })
}

/// Replays `plan`, loaded from the log at `path` ([`load`]), over every resource of `common`, `repeats`
/// timed runs each after one warm-up; reports the median.
pub fn bench(common: &Common, path: &Path, plan: &Plan, repeats: usize) -> Result<Report> {
    let env = crate::env::Environment::detect(common.device.as_ref());
    let mut report = Report::new(
        "replay",
        "a logged allocation trace replayed in its order, one thread per logged thread",
        env,
    );
    report.param("log", path.display());
    report.param("events", plan.steps.len());
    report.param("threads", plan.threads.len());
    report.param("logged_peak_bytes", plan.logged_peak);
    report.param("logged_failures", plan.logged_failures);
    report.param("repeats", repeats);
    report.columns = vec![
        Column::new("resource", 0),
        Column::new("seconds", 4),
        Column::new("ns/event", 1),
        Column::new("vs cuMemAlloc", 3),
        Column::new("failed allocations", 0),
        Column::new("peak live bytes", 0),
    ];
    let stream = match &common.device {
        Some(d) => Some(Stream::new(&d.context()?)?),
        None => None,
    };
    let mut progress = Progress::new(common.specs.len() as u64, common.quiet);
    let mut rows = Vec::new();
    for spec in &common.specs {
        progress.set_label(spec.to_string());
        let built = build(spec, common.device.as_ref())?;
        run(plan, built.resource.as_ref(), stream.as_ref())?;
        let mut runs = Vec::new();
        for _ in 0..repeats.max(1) {
            runs.push(run(plan, built.resource.as_ref(), stream.as_ref())?);
        }
        let secs: Vec<f64> = runs.iter().map(|r| r.seconds).collect();
        let mut st = runs[0];
        st.seconds = median(&secs).unwrap_or(f64::NAN);
        st.failures = runs.iter().map(|r| r.failures).max().unwrap_or(0);
        rows.push((built.label, st));
        progress.inc();
    }
    progress.finish();
    let cuda = rows.iter().find(|(l, _)| l == "cuMemAlloc").map(|(_, s)| s.seconds);
    for (label, st) in &rows {
        report.row(vec![
            Cell::from(label.as_str()),
            Cell::from(st.seconds),
            Cell::from(st.seconds * 1e9 / plan.steps.len().max(1) as f64),
            Cell::from(cuda.map(|c| st.seconds / c)),
            Cell::from(st.failures),
            Cell::from(st.peak_bytes),
        ]);
    }
    report.notes.push(
        "time: the whole replay (threads wait for their turn in the logged order; unfreed allocations freed at \
         the end; one synchronize), median of the timed runs after a warm-up run."
            .into(),
    );
    if plan.logged_failures > 0 {
        report.notes.push(format!(
            "{} logged allocation failures were not replayed.",
            plan.logged_failures
        ));
    }
    report.chart = Some(Chart {
        title: "Replay: nanoseconds per logged event (lower is better)".into(),
        kind: ChartKind::Bars,
        x_label: path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        y_label: "ns per event".into(),
        categories: vec!["replay".into()],
        series: rows
            .iter()
            .map(|(l, st)| Series {
                name: l.clone(),
                values: vec![Some(st.seconds * 1e9 / plan.steps.len().max(1) as f64)],
            })
            .collect(),
        log_y: false,
    });
    Ok(report)
}
