//! `sleep` (issue 23): the sleep and wake of a [`ServiceResource`] tag against pinned host copies of the
//! same bytes, on one GPU.
//!
//! One `ServiceResource` (default options) with one named tag, `weights`, holding one allocation of
//! `size` bytes (one allocation, not many: sleep and wake work on the chunks behind the tag, whatever the
//! allocations). Each repeat, on one stream: fill the allocation on the GPU with `hash2(seed, i)` per
//! 32-bit word (a new seed per repeat) and synchronize; then, each timed on the host to completion (the
//! call returns, then the context is synchronized):
//!
//! 1. the baselines: a device-to-host copy of the allocation into pinned host memory
//!    (`cuMemcpyDtoHAsync` + synchronize) and a host-to-device copy of those bytes back
//!    (`cuMemcpyHtoDAsync` + synchronize), through mempool-core's memory functions; the host buffer is
//!    then checked word by word against `hash2` (this checks the fill and the copy);
//! 2. `sleep(Offload)`: the contents copied to pinned host memory the resource allocates, then the
//!    chunks unmapped and released;
//! 3. `wake` with restore: the chunks mapped back at the same addresses and the contents copied back;
//!    then the whole allocation is copied to the host (untimed) and checked word by word: a wrong
//!    restore is an error ([`Error::Check`]), never a number;
//! 4. `sleep(Discard)` and 5. `wake` without restore.
//!
//! Reported: the median over the timed repeats (after one warm-up repeat, checked as well) of each
//! operation's time, its bandwidth over `size` bytes, that bandwidth as a fraction of the pinned
//! host-to-device copy's (issue 23's target for wake with restore: at least
//! [`WAKE_TARGET`]), and how much the device's free memory (`cuMemGetInfo`) changed across it. A size
//! that does not fit the device's free memory, or the host's available memory (the baseline's pinned
//! buffer and the offload's), is refused before anything is allocated.

#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use mempool_core::{memory, Context, Device, DeviceAddr, Stream};
use mempool_rmm::{MemoryResource, ServiceOptions, ServiceResource, SleepMode};

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::kernels::{elementwise, hash2, launch, load, Arg, WorkKernels};
use crate::progress::Progress;
use crate::report::{median, Cell, Column, Report};
use crate::units::Size;

/// Issue 23's target: wake with restore at least this fraction of the pinned host-to-device copy's
/// bandwidth.
pub const WAKE_TARGET: f64 = 0.90;

/// Device memory left free beyond the allocation's chunks (the context, the kernels, the driver's own).
pub const DEVICE_HEADROOM: u64 = 1 << 30;

/// Host memory left available beyond the two pinned buffers.
pub const HOST_HEADROOM: u64 = 2 << 30;

/// The tag the allocation is made under.
pub const TAG: &str = "weights";

/// Parameters of the `sleep` subcommand.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SleepParams {
    /// Bytes allocated, filled, put to sleep and woken (a positive multiple of 4).
    pub size: usize,
    /// Timed repeats (median), after one warm-up repeat.
    pub repeats: usize,
}

impl Default for SleepParams {
    /// 16 GiB, 3 repeats.
    fn default() -> Self {
        SleepParams {
            size: 16 << 30,
            repeats: 3,
        }
    }
}

impl SleepParams {
    /// Refuses a size that is not a positive multiple of 4 bytes (the buffer is filled and checked as
    /// 32-bit words) and no repeats.
    pub fn check(&self) -> Result<()> {
        if self.size == 0 || !self.size.is_multiple_of(4) {
            return Err(Error::Usage(format!(
                "--size ({}) must be a positive multiple of 4 bytes: the buffer is filled and checked as 32-bit words",
                self.size
            )));
        }
        if self.repeats == 0 {
            return Err(Error::Usage("--repeats must be at least 1".into()));
        }
        Ok(())
    }
}

/// The operations measured, in the order of a repeat, with their row names.
const OPS: [&str; 6] = [
    "pinned host -> device copy (cuMemcpyHtoDAsync)",
    "device -> pinned host copy (cuMemcpyDtoHAsync)",
    "sleep(Offload)",
    "wake, restore",
    "sleep(Discard)",
    "wake, no restore",
];
const H2D: usize = 0;
const D2H: usize = 1;
const SLEEP_OFFLOAD: usize = 2;
const WAKE_RESTORE: usize = 3;
const SLEEP_DISCARD: usize = 4;
const WAKE_FRESH: usize = 5;

/// One repeat's measurements: seconds and the change of the device's free memory, per operation.
#[derive(Copy, Clone, Debug, Default)]
struct Sample {
    secs: [f64; 6],
    freed: [i64; 6],
}

/// Page-locked host memory of the baseline copies, initialized (zeroed) on creation; freed on drop.
struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

impl PinnedBuf {
    fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedBuf> {
        let ptr = memory::pinned_host_alloc(ctx, len)?;
        let buf = PinnedBuf {
            ptr,
            len,
            ctx: ctx.clone(),
        };
        let base = ptr as usize;
        parallel(len, 4096, |r| {
            // SAFETY: `r` lies inside the `len` bytes `pinned_host_alloc` returned at `base`, each range
            // given to one thread only; nothing else uses the memory yet.
            unsafe { std::ptr::write_bytes((base + r.start) as *mut u8, 0, r.len()) };
        });
        Ok(buf)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialized bytes (zeroed in `new`, then written only through `&mut self`
        // or by copies that completed), alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `bytes_mut`; `cuMemHostAlloc` returns page-aligned memory, so 4-byte aligned, and
        // `len` is a multiple of 4 (`SleepParams::check`); every bit pattern is a valid u32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u32>(), self.len / 4) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `pinned_host_alloc` and is freed once, here; every copy that used it was
        // synchronized before the call that queued it returned (`copy_to_device`, `copy_to_host`).
        if let Err(e) = unsafe { memory::pinned_host_free(&self.ctx, self.ptr) } {
            mempool_core::record_drop_error(e);
        }
    }
}

/// Runs `f` over `0..len` cut into one range per available core (each a multiple of `align`), in
/// parallel.
fn parallel(len: usize, align: usize, f: impl Fn(Range<usize>) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = len.div_ceil(threads).div_ceil(align).max(1) * align;
    std::thread::scope(|s| {
        for start in (0..len).step_by(per) {
            let f = &f;
            s.spawn(move || f(start..(start + per).min(len)));
        }
    });
}

/// Where the words of a buffer first differ from `hash2(seed, i)`, and how many do.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The first word that differs.
    pub index: u64,
    /// Its value.
    pub found: u32,
    /// What it should be.
    pub expected: u32,
    /// How many words differ.
    pub count: u64,
}

/// Checks that `words[i] == hash2(seed, i)` for every `i`, then overwrites every word with its
/// complement (so a later copy that writes nothing cannot pass the next check). In parallel.
pub fn check_and_poison(words: &mut [u32], seed: u32) -> Option<Mismatch> {
    const PIECE: usize = 1 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = words.len().div_ceil(threads).div_ceil(PIECE).max(1) * PIECE;
    let found: Vec<Option<Mismatch>> = std::thread::scope(|s| {
        let handles: Vec<_> = words
            .chunks_mut(per)
            .enumerate()
            .map(|(k, part)| {
                s.spawn(move || {
                    let base = (k * per) as u64;
                    let mut first: Option<Mismatch> = None;
                    for (j, w) in part.iter_mut().enumerate() {
                        let i = base + j as u64;
                        let expected = hash2(seed, i);
                        if *w != expected {
                            match &mut first {
                                Some(m) => m.count += 1,
                                None => {
                                    first = Some(Mismatch {
                                        index: i,
                                        found: *w,
                                        expected,
                                        count: 1,
                                    })
                                }
                            }
                        }
                        *w = !expected;
                    }
                    first
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a checking thread panicked"))
            .collect()
    });
    found.into_iter().flatten().reduce(|a, b| Mismatch {
        count: a.count + b.count,
        ..a
    })
}

/// The host's available memory (`MemAvailable` of /proc/meminfo), where it can be read.
fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What one run needs, checked against the device's free memory and the host's available memory.
fn check_fits(ctx: &Context, device: Device, size: u64, mapped: u64) -> Result<()> {
    let m = ctx.memory_info()?;
    let need = mapped + DEVICE_HEADROOM;
    if need > m.free as u64 {
        return Err(Error::Usage(format!(
            "--size {}: does not fit device {}: it needs {} of device memory ({} of chunks and {} left for the \
             context and kernels), and {} of its {} is free; give a smaller --size",
            Size(size),
            device.ordinal(),
            Size(need),
            Size(mapped),
            Size(DEVICE_HEADROOM),
            Size(m.free as u64),
            Size(m.total as u64)
        )));
    }
    if let Some(avail) = host_available() {
        let need = size + mapped + HOST_HEADROOM;
        if need > avail {
            return Err(Error::Usage(format!(
                "--size {}: does not fit the host: it needs {} of pinned host memory ({} for the baseline copies, \
                 {} for the offload) and {} to spare, and {} is available; give a smaller --size",
                Size(size),
                Size(size + mapped),
                Size(size),
                Size(mapped),
                Size(HOST_HEADROOM),
                Size(avail)
            )));
        }
    }
    Ok(())
}

/// Everything one repeat works with.
struct Bench<'a> {
    ctx: &'a Arc<Context>,
    stream: &'a Stream,
    kernels: &'a WorkKernels<'a>,
    service: &'a ServiceResource,
    tag: mempool_rmm::Tag,
    ptr: DeviceAddr,
    size: usize,
    host: PinnedBuf,
}

impl Bench<'_> {
    fn free(&self) -> Result<i64> {
        Ok(self.ctx.memory_info()?.free as i64)
    }

    /// Runs `op`, then synchronizes the context; returns the seconds and the change of free memory.
    fn timed<T>(&self, op: impl FnOnce(&Self) -> Result<T>) -> Result<(f64, i64, T)> {
        let before = self.free()?;
        let t = Instant::now();
        let out = op(self)?;
        self.ctx.synchronize()?;
        let secs = t.elapsed().as_secs_f64();
        Ok((secs, self.free()? - before, out))
    }

    fn fill(&self, seed: u32) -> Result<()> {
        let n = self.size / 4;
        // SAFETY: `ptr` is the live allocation of `size` = 4n bytes, its tag awake (mapped, read-write for
        // the device); the kernel writes `out[i]` for `i < n` only, and is waited for below.
        unsafe {
            launch(
                &self.kernels.fill_hash,
                elementwise(n),
                self.stream.as_ref(),
                &[Arg::from(self.ptr), Arg::U64(n as u64), Arg::U32(seed)],
            )
        }?;
        self.stream.synchronize()?;
        Ok(())
    }

    fn copy_out(&mut self) -> Result<()> {
        let (ctx, ptr, s) = (self.ctx.clone(), self.ptr, self.stream.as_ref());
        // SAFETY: `ptr..ptr+size` is the live allocation, its tag awake; `copy_to_host` waits for the copy.
        unsafe { memory::copy_to_host(&ctx, self.host.bytes_mut(), ptr, s) }?;
        Ok(())
    }

    fn copy_in(&self) -> Result<()> {
        // SAFETY: as in `copy_out`, written instead of read; `copy_to_device` waits for the copy.
        unsafe { memory::copy_to_device(self.ctx, self.ptr, self.host.bytes(), self.stream.as_ref()) }?;
        Ok(())
    }

    /// Checks the host buffer against `hash2(seed, i)` (and poisons it); `what` names what was checked.
    fn check(&mut self, seed: u32, what: &str) -> Result<()> {
        match check_and_poison(self.host.words_mut(), seed) {
            None => Ok(()),
            Some(m) => Err(Error::Check(format!(
                "{what}: word {} (byte {}) of the {} allocation is {:#010x}, expected {:#010x}; {} of {} words differ",
                m.index,
                m.index * 4,
                Size(self.size as u64),
                m.found,
                m.expected,
                m.count,
                self.size / 4
            ))),
        }
    }

    /// One repeat with `seed`.
    fn repeat(&mut self, seed: u32) -> Result<Sample> {
        let mut out = Sample::default();
        let tags = [self.tag];
        self.fill(seed)?;
        // Timed as `timed` does; `copy_out` needs the buffer mutably.
        let before = self.free()?;
        let t = Instant::now();
        self.copy_out()?;
        self.ctx.synchronize()?;
        (out.secs[D2H], out.freed[D2H]) = (t.elapsed().as_secs_f64(), self.free()? - before);
        (out.secs[H2D], out.freed[H2D], _) = self.timed(|b| b.copy_in())?;
        // The host buffer still holds what the device-to-host copy brought: the fill, checked.
        self.check(seed, "the fill, read by the device-to-host copy")?;
        let (secs, freed, slept) =
            self.timed(|b| Ok(b.service.sleep(&tags, SleepMode::Offload, b.stream.as_ref())?))?;
        (out.secs[SLEEP_OFFLOAD], out.freed[SLEEP_OFFLOAD]) = (secs, freed);
        if slept.offloaded_bytes < self.size as u64 {
            return Err(Error::Check(format!(
                "sleep(Offload) saved {} of the {} allocation",
                Size(slept.offloaded_bytes),
                Size(self.size as u64)
            )));
        }
        let (secs, freed, woke) = self.timed(|b| Ok(b.service.wake(&tags, b.stream.as_ref())?))?;
        (out.secs[WAKE_RESTORE], out.freed[WAKE_RESTORE]) = (secs, freed);
        if woke.restored_bytes != slept.offloaded_bytes {
            return Err(Error::Check(format!(
                "wake restored {} of the {} that sleep(Offload) saved",
                Size(woke.restored_bytes),
                Size(slept.offloaded_bytes)
            )));
        }
        self.copy_out()?;
        self.check(seed, "after sleep(Offload) and wake, the restored contents")?;
        (out.secs[SLEEP_DISCARD], out.freed[SLEEP_DISCARD], _) =
            self.timed(|b| Ok(b.service.sleep(&tags, SleepMode::Discard, b.stream.as_ref())?))?;
        (out.secs[WAKE_FRESH], out.freed[WAKE_FRESH], _) =
            self.timed(|b| Ok(b.service.wake(&tags, b.stream.as_ref())?))?;
        Ok(out)
    }
}

/// Runs the benchmark on `device`.
pub fn bench(device: Device, p: &SleepParams, quiet: bool) -> Result<Report> {
    p.check()?;
    let ctx = device.context()?;
    let stream = Stream::new(&ctx)?;
    let service = ServiceResource::new(&device, ServiceOptions::default())?;
    let chunk = service.chunk_size() as u64;
    let mapped = (p.size as u64).div_ceil(chunk) * chunk;
    check_fits(&ctx, device, p.size as u64, mapped)?;
    let tag = service.tag(TAG)?;
    let module = load(&ctx, "work.ptx")?;
    let kernels = WorkKernels::new(&module)?;
    let env = crate::env::Environment::detect(Some(&device));
    let mut report = Report::new(
        "sleep",
        "sleep and wake of a ServiceResource tag against pinned host copies of the same bytes",
        env,
    );
    report.param("size", Size(p.size as u64));
    report.param(
        "allocation",
        format!("one of {} under tag `{TAG}`", Size(p.size as u64)),
    );
    report.param("chunk", Size(chunk));
    report.param("repeats", p.repeats);

    let host = PinnedBuf::new(&ctx, p.size)?;
    let ptr = service.allocate_tagged(p.size, tag, stream.as_ref())?;
    let mut b = Bench {
        ctx: &ctx,
        stream: &stream,
        kernels: &kernels,
        service: &service,
        tag,
        ptr,
        size: p.size,
        host,
    };
    let mut progress = Progress::new(p.repeats as u64 + 1, quiet);
    let mut samples = Vec::with_capacity(p.repeats);
    let result = (|| -> Result<()> {
        for r in 0..=p.repeats {
            progress.set_label(if r == 0 {
                "warm-up".to_owned()
            } else {
                format!("repeat {r}")
            });
            let s = b.repeat(0x5eed_0000 + r as u32)?;
            if r > 0 {
                samples.push(s);
            }
            progress.inc();
        }
        // The memory woken without restore is mapped and writable.
        let seed = 0x5eed_ffff;
        b.fill(seed)?;
        b.copy_out()?;
        b.check(seed, "after sleep(Discard) and wake, a fill read back")
    })();
    progress.finish();
    // Free the allocation whatever happened (awake after any failure but one inside sleep or wake; a
    // sleeping tag is refused and the resource's drop returns it).
    let _ = service.wake(&[tag], stream.as_ref());
    // SAFETY: `ptr` came from `allocate_tagged(p.size, ..)` on `stream` and is freed once, here; every
    // kernel and copy that used it was synchronized.
    let freed = unsafe { service.deallocate(ptr, p.size, stream.as_ref()) };
    result?;
    freed?;
    drop(b);

    report.columns = vec![
        Column::new("operation", 0),
        Column::new("median ms", 1),
        Column::new("min ms", 1),
        Column::new("max ms", 1),
        Column::new("GB/s", 2),
        Column::new("vs pinned H2D", 3),
        Column::new("device free change", 0),
    ];
    let bytes = p.size as f64;
    let med = |op: usize| median(&samples.iter().map(|s| s.secs[op]).collect::<Vec<_>>()).unwrap_or(f64::NAN);
    let h2d_gbps = bytes / med(H2D) / 1e9;
    report.chart = Some(Chart {
        title: format!(
            "Sleep and wake of {} against pinned copies: GB/s (higher is better)",
            Size(p.size as u64)
        ),
        kind: ChartKind::Bars,
        x_label: "operation".into(),
        y_label: "GB/s".into(),
        categories: OPS.iter().map(|s| (*s).to_owned()).collect(),
        series: vec![Series {
            name: "median".into(),
            values: (0..OPS.len()).map(|op| Some(bytes / med(op) / 1e9)).collect(),
        }],
        log_y: false,
    });
    for (op, name) in OPS.iter().enumerate() {
        let secs: Vec<f64> = samples.iter().map(|s| s.secs[op]).collect();
        let freed: Vec<f64> = samples.iter().map(|s| s.freed[op] as f64).collect();
        let gbps = bytes / med(op) / 1e9;
        report.row(vec![
            Cell::from(*name),
            Cell::from(med(op) * 1e3),
            Cell::from(secs.iter().copied().fold(f64::INFINITY, f64::min) * 1e3),
            Cell::from(secs.iter().copied().fold(0.0, f64::max) * 1e3),
            Cell::from(gbps),
            Cell::from(gbps / h2d_gbps),
            Cell::Int(median(&freed).unwrap_or(0.0) as i64),
        ]);
    }
    let ratio = med(H2D) / med(WAKE_RESTORE);
    report.notes.push(format!(
        "ms: host wall time of the call, then a context synchronize (each to completion); median of {} repeats \
         after a warm-up; GB/s: the {} allocation's bytes over that time (1 GB = 1e9 bytes); device free change: \
         cuMemGetInfo's free memory after minus before (median).",
        p.repeats,
        Size(p.size as u64)
    ));
    report.notes.push(
        "sleep(Offload) includes the copy out and the unmapping; the pinned host buffer it copies into is \
         allocated (cuMemHostAlloc) by the warm-up's sleep and kept by the resource for the next offload, so \
         the timed ones reuse it. Wake with restore includes mapping the chunks and the copy back (the buffer \
         stays cached). The baselines copy between the same device memory and one pinned buffer allocated \
         beforehand."
            .into(),
    );
    report.notes.push(format!(
        "checked: the fill (read by the device-to-host copy) and, after every wake with restore, the whole \
         allocation copied back, word by word against the host's hash2; sleep(Offload) released {} of {} mapped \
         ({:.1}%).",
        Size(
            median(
                &samples
                    .iter()
                    .map(|s| s.freed[SLEEP_OFFLOAD] as f64)
                    .collect::<Vec<_>>()
            )
            .unwrap_or(0.0) as u64
        ),
        Size(mapped),
        100.0
            * median(
                &samples
                    .iter()
                    .map(|s| s.freed[SLEEP_OFFLOAD] as f64)
                    .collect::<Vec<_>>()
            )
            .unwrap_or(0.0)
            / mapped as f64
    ));
    report.notes.push(format!(
        "target (issue 23): wake with restore at least {WAKE_TARGET:.2} of the pinned host-to-device copy's \
         bandwidth: {ratio:.3}, {}",
        if ratio >= WAKE_TARGET { "met" } else { "missed" }
    ));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_finds_the_first_wrong_word_and_counts_them_all() {
        let n = (3 << 20) + 17; // more than one piece per thread, and a ragged end
        let mut words: Vec<u32> = (0..n as u64).map(|i| hash2(9, i)).collect();
        assert_eq!(check_and_poison(&mut words, 9), None);
        // Poisoned: the same check fails everywhere now.
        let m = check_and_poison(&mut words, 9).unwrap();
        assert_eq!((m.index, m.count), (0, n as u64));
        let mut words: Vec<u32> = (0..n as u64).map(|i| hash2(9, i)).collect();
        words[n - 1] ^= 1;
        words[(2 << 20) + 5] = 0;
        let m = check_and_poison(&mut words, 9).unwrap();
        assert_eq!(m.index, (2 << 20) + 5);
        assert_eq!((m.found, m.expected, m.count), (0, hash2(9, (2 << 20) + 5), 2));
        // Two chunks swapped: every word in them is in the wrong place.
        let mut words: Vec<u32> = (0..n as u64).map(|i| hash2(9, i)).collect();
        let (a, b) = words.split_at_mut(1 << 20);
        a[..1024].swap_with_slice(&mut b[..1024]);
        assert_eq!(check_and_poison(&mut words, 9).unwrap().count, 2048);
    }

    #[test]
    fn sizes_must_be_whole_words() {
        SleepParams::default().check().unwrap();
        for size in [0, 6, (1 << 30) + 2] {
            let e = SleepParams { size, repeats: 1 }.check().unwrap_err();
            assert!(e.to_string().contains("multiple of 4"), "{e}");
        }
        assert!(SleepParams { size: 4, repeats: 0 }.check().is_err());
    }

    #[test]
    fn parallel_covers_every_byte_once() {
        for len in [0, 1, 4095, 4096, 1 << 20, (1 << 20) + 3] {
            let hits: Vec<std::sync::atomic::AtomicU8> = (0..len).map(|_| Default::default()).collect();
            parallel(len, 4096, |r| {
                for i in r {
                    hits[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(std::sync::atomic::Ordering::Relaxed) == 1),
                "{len}"
            );
        }
    }
}
