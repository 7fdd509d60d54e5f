//! RMM's allocation logs and mempool's, checked both ways on the host (issue 12):
//!
//! - [`rmm_parser`] re-states, in Rust, the rules RMM's own replay benchmark applies when it reads a log;
//! - a log that mempool-rmm's `LoggingAdaptor` writes has the exact shape RMM 26.10 writes and passes
//!   those rules, and RMM reads back what mempool meant;
//! - logs in RMM 26.10's format, `data/rmm-26.10-format.csv` (derived from RMM's sources) and
//!   `data/rmm-26.10.csv` (recorded on a GPU by `data/rmm-log/make_rmm_log.cu`),
//!   pass the same rules and replay over the host simulation.
//!
//! The sample log in the new format and in the old one is checked in `host.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;

use mempool_bench::workloads::replay;
use mempool_core::{DeviceAddr, StreamRef};
use mempool_rmm::adaptors::{parse_log, Action, LoggingAdaptor, LOG_HEADER};
use mempool_rmm::testing::SimResource;
use mempool_rmm::workload::SplitMix64;
use mempool_rmm::MemoryResource;

/// RMM's log parser, re-stated: what RMM's replay benchmark requires of a log, and what it reads from it.
///
/// Sources, in rapidsai/rmm (read at commit 5d50a37b, 2026-07; these rules have not changed since RMM
/// 22.04 added `allocate failure`):
///
/// - `cpp/benchmarks/utilities/log_parser.hpp`, `parse_csv`: reads the file with
///   `rapidcsv::Document(filename, rapidcsv::LabelParams(0, -1))` (row 0 names the columns, no column
///   names the rows), then the columns by name, in this order: `Thread` (`size_t`), `Action` (string),
///   `Pointer` (`(nil)` is 0, else `std::stoull(str, nullptr, 16)`), `Size` (`size_t`), `Stream`
///   (`uintptr_t`). Every action must be `allocate`, `allocate failure` or `free` ("Invalid action
///   string."). `Time` is not read (`parse_time` is unused).
/// - `cpp/benchmarks/utilities/rapidcsv.h`: `ParseCsv` splits rows at `\n` and cells at `,`, drops every
///   `\r`, honours `"` quotes, trims nothing and keeps empty lines (a blank line is a row of one empty
///   cell); `GetColumn` converts each data row's cell (`Converter::ToVal`: `std::stoul` for `size_t` and
///   `uintptr_t`, base 10) and throws `std::out_of_range` for a row too short.
/// - `cpp/benchmarks/replay/replay.cpp`, `parse_per_thread_events`: every stream, as read, must be the
///   null, legacy (1) or per-thread (2) default stream ("Non-default streams not currently
///   supported."); `replay_benchmark`: `allocate failure` lines are skipped, a `free` looks its pointer
///   up among the live allocations.
mod rmm_parser {
    use std::collections::HashMap;

    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    pub enum Act {
        Allocate,
        Free,
        AllocateFailure,
    }

    /// `rmm::detail::event`.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Event {
        pub thread_id: u64,
        pub act: Act,
        pub size: u64,
        pub pointer: u64,
        pub stream: u64,
    }

    /// `rapidcsv::Document::ParseCsv` with the default parameters (separator `,`, quote `"`, no trim,
    /// auto-unquote, no quoted line breaks, empty and comment lines not skipped) and its UTF-8 BOM skip.
    fn rows(text: &str) -> Vec<Vec<String>> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let unquote = |cell: &str| {
            if cell.len() >= 2 && cell.starts_with('"') && cell.ends_with('"') {
                cell[1..cell.len() - 1].replace("\"\"", "\"")
            } else {
                cell.to_owned()
            }
        };
        let (mut data, mut row, mut cell, mut quoted) = (Vec::new(), Vec::new(), String::new(), false);
        for c in text.chars() {
            match c {
                '"' => {
                    if cell.is_empty() || cell.starts_with('"') {
                        quoted = !quoted;
                    }
                    cell.push(c);
                }
                ',' if !quoted => row.push(unquote(&std::mem::take(&mut cell))),
                '\r' => {}
                '\n' => {
                    row.push(unquote(&std::mem::take(&mut cell)));
                    data.push(std::mem::take(&mut row));
                    quoted = false;
                }
                _ => cell.push(c),
            }
        }
        if !(row.is_empty() && cell.is_empty()) {
            row.push(unquote(&cell));
            data.push(row);
        }
        data
    }

    /// `std::stoul` / `std::stoull` (glibc's `strtoul`): leading white space, an optional sign (a minus
    /// negates modulo 2^64), for base 16 an optional `0x` before a hex digit, then digits up to the first
    /// other character, which ends the number (the rest is ignored). No digit is `std::invalid_argument`,
    /// a value past 2^64 - 1 `std::out_of_range`.
    pub fn stoul(s: &str, base: u32) -> Result<u64, String> {
        let mut rest = s.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
        let negative = rest.starts_with('-');
        rest = rest.strip_prefix(['+', '-']).unwrap_or(rest);
        if base == 16 {
            if let Some(after) = rest.strip_prefix("0x").or_else(|| rest.strip_prefix("0X")) {
                if after.starts_with(|c: char| c.is_ascii_hexdigit()) {
                    rest = after;
                }
            }
        }
        let digits: String = rest.chars().take_while(|c| c.is_digit(base)).collect();
        if digits.is_empty() {
            return Err(format!("std::invalid_argument: stoul(\"{s}\")"));
        }
        let v = u64::from_str_radix(&digits, base).map_err(|_| format!("std::out_of_range: stoul(\"{s}\")"))?;
        Ok(if negative { v.wrapping_neg() } else { v })
    }

    /// `rmm::detail::parse_csv`: the events RMM's replay reads from `text`, or the exception it throws.
    pub fn parse_csv(text: &str) -> Result<Vec<Event>, String> {
        let data = rows(text);
        let mut names: HashMap<&str, usize> = HashMap::new();
        if let Some(header) = data.first() {
            for (i, name) in header.iter().enumerate() {
                names.insert(name, i);
            }
        }
        // `GetColumn` over the data rows (every row after row 0).
        let column = |name: &str, convert: &dyn Fn(&str) -> Result<u64, String>| -> Result<Vec<u64>, String> {
            let idx = *names.get(name).ok_or(format!("column not found: {name}"))?;
            data.iter()
                .enumerate()
                .skip(1)
                .map(|(r, row)| {
                    let cell = row.get(idx).ok_or(format!(
                        "requested column index {idx} >= {} (number of columns on row index {})",
                        row.len(),
                        r - 1
                    ))?;
                    convert(cell).map_err(|e| format!("{e} (column {name}, row index {})", r - 1))
                })
                .collect()
        };
        let tids = column("Thread", &|s| stoul(s, 10))?;
        let action_idx = *names.get("Action").ok_or("column not found: Action")?;
        let mut actions = Vec::new();
        for (r, row) in data.iter().enumerate().skip(1) {
            actions.push(
                row.get(action_idx)
                    .ok_or(format!("requested column index {action_idx} (row index {})", r - 1))?
                    .clone(),
            );
        }
        let pointers = column("Pointer", &|s| if s == "(nil)" { Ok(0) } else { stoul(s, 16) })?;
        let sizes = column("Size", &|s| stoul(s, 10))?;
        let streams = column("Stream", &|s| stoul(s, 10))?;
        let mut events = Vec::new();
        for (i, action) in actions.iter().enumerate() {
            let act = match action.as_str() {
                "allocate" => Act::Allocate,
                "free" => Act::Free,
                "allocate failure" => Act::AllocateFailure,
                _ => return Err(format!("Invalid action string. (`{action}`, row index {i})")),
            };
            events.push(Event {
                thread_id: tids[i],
                act,
                size: sizes[i],
                pointer: pointers[i],
                stream: streams[i],
            });
        }
        Ok(events)
    }

    /// `parse_per_thread_events`'s check (without `CUDA_API_PER_THREAD_DEFAULT_STREAM`): `is_default()`
    /// (null or `cudaStreamLegacy`, 1) or `is_per_thread_default()` (`cudaStreamPerThread`, 2).
    pub fn check_streams(events: &[Event]) -> Result<(), String> {
        match events.iter().position(|e| e.stream > 2) {
            Some(i) => Err(format!("Non-default streams not currently supported. (row index {i})")),
            None => Ok(()),
        }
    }
}

/// One data line exactly as RMM 26.10 writes it: spdlog's `%t,%H:%M:%S.%f,` then `allocate,%p,%zu,%s`,
/// `allocate failure,%p,%zu,%s` or `free,%p,%zu,%s` (glibc's `%p`: `0x` and lowercase hex without leading
/// zeros, `(nil)` for null), the stream as libstdc++ writes a pointer (`0`, or `0x` and lowercase hex).
fn rmm_26_10_shape(line: &str) -> Result<(), String> {
    let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let hex = |s: &str| {
        s.strip_prefix("0x").is_some_and(|h| {
            !h.is_empty() && !h.starts_with('0') && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    };
    let time = |t: &str| {
        t.len() == 15
            && t.bytes().enumerate().all(|(i, c)| match i {
                2 | 5 => c == b':',
                8 => c == b'.',
                _ => c.is_ascii_digit(),
            })
            && t[0..2] < *"24"
            && t[3..5] < *"60"
            && t[6..8] < *"61"
    };
    let f: Vec<&str> = line.split(',').collect();
    let ok = f.len() == 6
        && decimal(f[0])
        && time(f[1])
        && ["allocate", "allocate failure", "free"].contains(&f[2])
        && (f[3] == "(nil)" || hex(f[3]))
        && decimal(f[4])
        && (f[5] == "0" || hex(f[5]))
        && (f[2] != "allocate failure" || f[3] == "(nil)");
    if ok {
        Ok(())
    } else {
        Err(format!("not RMM 26.10's shape: `{line}`"))
    }
}

/// Checks a whole log against RMM 26.10's writer and RMM's parser, and that RMM reads what mempool's parser
/// reads. Returns RMM's events.
fn check_rmm_log(name: &str, text: &str) -> Vec<rmm_parser::Event> {
    assert!(text.ends_with('\n') && !text.contains('\r'), "{name}: lines end in \\n");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOG_HEADER), "{name}: the header");
    for (i, line) in lines.enumerate() {
        rmm_26_10_shape(line).unwrap_or_else(|e| panic!("{name} line {}: {e}", i + 2));
    }
    let rmm = rmm_parser::parse_csv(text).unwrap_or_else(|e| panic!("{name}: RMM's parser: {e}"));
    rmm_parser::check_streams(&rmm).unwrap_or_else(|e| panic!("{name}: RMM's replay: {e}"));
    let ours = parse_log(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(rmm.len(), ours.len(), "{name}");
    for (i, (r, o)) in rmm.iter().zip(&ours).enumerate() {
        let act = match o.action {
            Action::Allocate => rmm_parser::Act::Allocate,
            Action::AllocateFailure => rmm_parser::Act::AllocateFailure,
            Action::Deallocate => rmm_parser::Act::Free,
        };
        assert_eq!(
            (r.thread_id, r.act, r.size, r.pointer),
            (o.thread, act, o.size as u64, o.ptr),
            "{name} line {}",
            i + 2
        );
        // RMM reads the Stream column as decimal (RMM before 0.17 wrote the handle's integer value): a
        // stream written in hex, as every RMM since 0.17 writes it, reads as 0 and passes its check.
        assert_eq!(r.stream, 0, "{name} line {}", i + 2);
    }
    // RMM's replay frees by looking the pointer up among live allocations: every free names one.
    let mut live = HashSet::new();
    for (i, e) in rmm.iter().enumerate() {
        match e.act {
            rmm_parser::Act::Allocate if e.pointer != 0 => {
                assert!(live.insert(e.pointer), "{name} line {}: allocated while live", i + 2)
            }
            rmm_parser::Act::Free if e.pointer != 0 => {
                assert!(live.remove(&e.pointer), "{name} line {}: frees what is not live", i + 2)
            }
            _ => {}
        }
    }
    rmm
}

/// Replays `text` over the host simulation; returns the plan.
fn replays(name: &str, text: &str) -> replay::Plan {
    let plan = replay::parse(name, text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let sim = unsafe { SimResource::new() };
    let stats = replay::run(&plan, &sim, None).unwrap();
    assert_eq!((stats.failures, stats.peak_bytes), (0, plan.logged_peak), "{name}");
    assert_eq!(sim.live_allocations(), 0, "{name}");
    plan
}

/// Frees by a thread other than the one that allocated.
fn cross_thread_frees(events: &[rmm_parser::Event]) -> usize {
    let mut owner: HashMap<u64, u64> = HashMap::new();
    let mut n = 0;
    for e in events {
        match e.act {
            rmm_parser::Act::Allocate => {
                owner.insert(e.pointer, e.thread_id);
            }
            rmm_parser::Act::Free => n += usize::from(owner.remove(&e.pointer).is_some_and(|t| t != e.thread_id)),
            rmm_parser::Act::AllocateFailure => {}
        }
    }
    n
}

/// The committed logs, compiled in: the test binary reads no file of the source tree, so a packed copy
/// (scripts/gpu-tests.sh) checks them on any machine, in any directory.
const DERIVED_LOG: &str = include_str!("../data/rmm-26.10-format.csv");
const RECORDED_LOG: &str = include_str!("../data/rmm-26.10.csv");

#[test]
#[allow(unsafe_code)] // frees what it allocates: `deallocate` is unsafe
fn a_log_mempool_writes_is_what_rmm_26_10_writes_and_passes_rmms_parser() {
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let mr = LoggingAdaptor::new(unsafe { SimResource::with_capacity(8 << 20) }, Vec::new()).unwrap();
    // Three threads on the legacy and per-thread streams; thread 0 hands some blocks to thread 1, which
    // frees them; some requests exceed the capacity (logged as `allocate failure`); some are 0 bytes.
    // Thread 1 frees the blocks thread 0 sends as they come, and the rest once thread 0 is done.
    let (tx, rx) = mpsc::channel::<(DeviceAddr, usize)>();
    let mut rx = Some(rx);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let mr = &mr;
            let tx = (t == 0).then(|| tx.clone());
            let rx = if t == 1 { rx.take() } else { None };
            s.spawn(move || {
                let stream = if t == 2 {
                    StreamRef::PER_THREAD
                } else {
                    StreamRef::LEGACY
                };
                let mut rng = SplitMix64(t + 1);
                let mut mine = Vec::new();
                for i in 0..200 {
                    let bytes = match i % 50 {
                        7 => 0,
                        13 => 64 << 20,
                        _ => 1 + rng.below(64 << 10) as usize,
                    };
                    match mr.allocate(bytes, stream) {
                        Ok(p) if i % 4 == 0 && tx.is_some() => tx.as_ref().unwrap().send((p, bytes)).unwrap(),
                        Ok(p) => mine.push((p, bytes)),
                        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                    }
                    if mine.len() > 8 || (i % 3 == 0 && !mine.is_empty()) {
                        let (p, n) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        // SAFETY: allocated by this thread from `mr` with `n` bytes, taken out of `mine` (freed
                        // once); SimResource addresses are never dereferenced.
                        unsafe { mr.deallocate(p, n, stream) }.unwrap();
                    }
                    if let Some(rx) = &rx {
                        while let Ok((p, n)) = rx.try_recv() {
                            // SAFETY: thread 0 allocated it from `mr` with `n` bytes and sent it here, not
                            // keeping it; freed once; never dereferenced.
                            unsafe { mr.deallocate(p, n, stream) }.unwrap();
                        }
                    }
                }
                for (p, n) in mine {
                    // SAFETY: as above, the rest of this thread's own allocations, each freed once.
                    unsafe { mr.deallocate(p, n, stream) }.unwrap();
                }
                drop(tx);
                for (p, n) in rx.iter().flatten() {
                    // SAFETY: thread 0's blocks, as above; the loop ends when thread 0 drops its sender.
                    unsafe { mr.deallocate(p, n, stream) }.unwrap();
                }
            });
        }
        drop(tx);
    });
    assert_eq!(mr.upstream().live_allocations(), 0);
    let text = String::from_utf8(mr.into_writer().unwrap()).unwrap();

    let rmm = check_rmm_log("LoggingAdaptor", &text);
    let threads: HashSet<u64> = rmm.iter().map(|e| e.thread_id).collect();
    assert_eq!(threads.len(), 3);
    assert!(cross_thread_frees(&rmm) > 10);
    let count = |a| rmm.iter().filter(|e| e.act == a).count();
    assert_eq!(count(rmm_parser::Act::AllocateFailure), 3 * 4);
    assert_eq!(count(rmm_parser::Act::Allocate), count(rmm_parser::Act::Free));
    // What mempool's own parser reads: the streams as written, `0` and `0x2`.
    let streams: HashSet<u64> = parse_log(text.as_bytes()).unwrap().iter().map(|e| e.stream).collect();
    assert_eq!(streams, HashSet::from([0, 2]));
    assert!(text.contains(",allocate,(nil),0,0\n") && text.contains(",free,(nil),0,0x2\n"));
    replays("LoggingAdaptor", &text);
}

#[test]
fn rmms_parser_rules_reject_what_rmm_rejects() {
    use rmm_parser::{check_streams, parse_csv, stoul};
    const H: &str = "Thread,Time,Action,Pointer,Size,Stream\n";
    let rejects = |text: String, what: &str| {
        let e = parse_csv(&text).and_then(|ev| check_streams(&ev)).unwrap_err();
        assert!(e.contains(what), "{text:?}: {e}");
    };
    // What mempool-rmm wrote before it matched RMM: `deallocate`.
    rejects(
        format!("{H}1,1795318196.826743,deallocate,0x7000,16,0x0\n"),
        "Invalid action",
    );
    rejects(format!("{H}1,12:00:00.000000, free,0x7000,16,0\n"), "Invalid action");
    // RMM 0.14's header has no Thread column.
    rejects(
        "Time,Action,Pointer,Size,Stream\n12:00:00:000000,allocate,0x10,5,0\n".into(),
        "column not found: Thread",
    );
    // A blank line is a row of one empty cell.
    rejects(
        format!("{H}1,t,allocate,0x10,5,0\n\n1,t,free,0x10,5,0\n"),
        "invalid_argument",
    );
    rejects(format!("{H}1,t,allocate,0x10,5\n"), "requested column index 5");
    rejects(format!("{H}1,t,allocate,zz,5,0\n"), "invalid_argument");
    rejects(format!("{H}1,t,allocate,0x10,99999999999999999999,0\n"), "out_of_range");
    // RMM 0.14.1 to 0.16 wrote streams in decimal: a real stream handle is not a default stream.
    rejects(format!("{H}1,t,allocate,0x10,5,94234234234\n"), "Non-default streams");
    // And what it accepts, as the C++ does.
    let e = parse_csv(&format!(
        "{H}-1,t,allocate failure,(nil),5,0x55d0c8a3f2b0\r\n7,t,free,0x10junk,+5,2\n"
    ))
    .unwrap();
    assert_eq!((e[0].thread_id, e[0].pointer, e[0].stream), (u64::MAX, 0, 0));
    assert_eq!((e[1].pointer, e[1].size, e[1].stream), (0x10, 5, 2));
    assert_eq!(stoul("0x", 16), Ok(0));
    assert_eq!(stoul(" 0XfF", 16), Ok(255));
    assert!(stoul("", 10).is_err());
}

/// The logs in RMM 26.10's format under `data/`: the derived one and the recorded one.
#[test]
fn rmm_26_10_logs_pass_rmms_parser_and_replay() {
    let rmm = check_rmm_log("rmm-26.10-format.csv", DERIVED_LOG);
    let plan = replays("rmm-26.10-format.csv", DERIVED_LOG);
    assert_eq!((plan.threads.len(), plan.logged_failures), (3, 1));
    assert!(cross_thread_frees(&rmm) >= 4);
    check_recorded_rmm_26_10_log("data/rmm-26.10.csv", RECORDED_LOG);
}

/// The log `data/rmm-log/make_rmm_log.cu` writes: the main thread's allocation and free on the default
/// stream, 24 allocations by thread A and 16 by thread B on their own streams, 16 of A's freed by B, and
/// the main thread's failed 1 PiB allocation. Point `MEMPOOL_RMM_LOG` at a freshly made log to check it
/// before committing it (`cargo test -p mempool-bench --test rmm_logs recorded`); without it, the
/// committed one (`data/rmm-26.10.csv`) is checked.
#[test]
fn recorded_rmm_log_from_env_matches_make_rmm_log() {
    match std::env::var_os("MEMPOOL_RMM_LOG") {
        Some(path) => {
            let name = std::path::Path::new(&path).display().to_string();
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("MEMPOOL_RMM_LOG={name}: {e}"));
            check_recorded_rmm_26_10_log(&name, &text);
        }
        None => check_recorded_rmm_26_10_log("data/rmm-26.10.csv", RECORDED_LOG),
    }
}

fn check_recorded_rmm_26_10_log(name: &str, text: &str) {
    let rmm = check_rmm_log(name, text);
    let plan = replays(name, text);
    let count = |a| rmm.iter().filter(|e| e.act == a).count();
    assert_eq!(
        (
            count(rmm_parser::Act::Allocate),
            count(rmm_parser::Act::Free),
            count(rmm_parser::Act::AllocateFailure)
        ),
        (41, 41, 1),
        "{name}"
    );
    assert_eq!((plan.threads.len(), plan.unfreed.len()), (3, 0), "{name}");
    assert_eq!(cross_thread_frees(&rmm), 16, "{name}");
    let last = text.lines().last().unwrap();
    assert!(
        last.ends_with(",allocate failure,(nil),1125899906842624,0"),
        "{name}: {last}"
    );
    // The workers' streams are real handles; the main thread's is the null stream.
    let ours = parse_log(text.as_bytes()).unwrap();
    let streams: HashSet<u64> = ours.iter().map(|e| e.stream).collect();
    assert!(streams.contains(&0) && streams.len() == 3, "{name}: {streams:?}");
}
