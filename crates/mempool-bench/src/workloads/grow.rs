//! `grow`: a buffer grown from `start` to `end` bytes, multiplying its size by `factor` at each step
//! (issue 14). Compared: mempool-core's [`GrowableBuffer`] (one reservation, one allocation mapped at the end per growth,
//! nothing copied) against allocate-copy-free through each resource given (allocate the new size, copy
//! the old contents on the device, free the old buffer), as a vector without virtual memory grows.
//!
//! Reported per method: the total time of all steps (each step's work completed: a synchronize at the
//! end of each step), and the time of the last step; the median of `repeats` runs after a warm-up run.

use std::time::Instant;

use mempool_core::{memory, Device, DeviceAddr, GrowableBuffer, GrowableOptions, Stream, WhenFull};
use mempool_rmm::MemoryResource;

use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::report::{median, Cell, Column, Report};
use crate::spec::build;
use crate::units::Size;
use crate::workloads::Common;

/// Parameters of the `grow` subcommand.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GrowParams {
    /// The first size.
    pub start: usize,
    /// The last size (the steps stop at the first size at or past it, clamped to it).
    pub end: usize,
    /// Growth factor per step (> 1).
    pub factor: f64,
    /// Timed runs per method (median), after one warm-up run.
    pub repeats: usize,
    /// The GrowableBuffer's granule (each growth maps a multiple of it); `None`: the recommended granularity.
    pub chunk: Option<usize>,
}

impl Default for GrowParams {
    /// 1 MiB to 16 GiB, doubling; 3 repeats.
    fn default() -> Self {
        GrowParams {
            start: 1 << 20,
            end: 16 << 30,
            factor: 2.0,
            repeats: 3,
            chunk: None,
        }
    }
}

/// The sizes a run goes through: `start`, then times `factor` (rounded up to 256 bytes) until `end`.
pub fn steps(p: &GrowParams) -> Result<Vec<usize>> {
    if !(p.factor > 1.0 && p.factor.is_finite()) || p.start == 0 || p.end < p.start {
        return Err(Error::Usage(format!(
            "grow needs 0 < --start <= --end and --factor > 1 (got start {}, end {}, factor {})",
            Size(p.start as u64),
            Size(p.end as u64),
            p.factor
        )));
    }
    let mut out = vec![p.start];
    let mut s = p.start;
    while s < p.end {
        let next = ((s as f64 * p.factor).ceil() as usize).max(s + 1).div_ceil(256) * 256;
        s = next.min(p.end);
        out.push(s);
    }
    Ok(out)
}

/// Times of one run: total, last step, in seconds.
type Times = (f64, f64);

/// Grows a [`GrowableBuffer`] through `sizes`.
fn run_growable(dev: Device, sizes: &[usize], chunk: Option<usize>) -> Result<Times> {
    let ctx = dev.context()?;
    let last = *sizes.last().unwrap_or(&0);
    let t = Instant::now();
    let mut buf = GrowableBuffer::new(
        &dev,
        last,
        GrowableOptions {
            chunk,
            when_full: WhenFull::Fail,
        },
    )?;
    let mut last_step = 0.0;
    for &n in sizes {
        let ts = Instant::now();
        buf.resize(n)?;
        ctx.synchronize()?;
        last_step = ts.elapsed().as_secs_f64();
    }
    let total = t.elapsed().as_secs_f64();
    drop(buf);
    Ok((total, last_step))
}

/// Grows by allocate-copy-free through `mr`.
#[allow(unsafe_code)] // frees what it allocated, once; copies between its own live allocations
fn run_copying(mr: &dyn MemoryResource, stream: &Stream, sizes: &[usize]) -> Result<Times> {
    let s = stream.as_ref();
    let ctx = stream.context().clone();
    let t = Instant::now();
    let mut cur: Option<(DeviceAddr, usize)> = None;
    let mut last_step = 0.0;
    let mut result = Ok(());
    for &n in sizes {
        let ts = Instant::now();
        let next = match mr.allocate(n, s) {
            Ok(p) => p,
            Err(e) => {
                result = Err(Error::from(e));
                break;
            }
        };
        if let Some((old, len)) = cur.take() {
            // SAFETY: both are live allocations of `mr` ordered on `s` (allocated on it); `old` holds `len`
            // bytes and `next` at least `len` (sizes only grow); the copy is queued before the free below,
            // on the same stream.
            let r = unsafe { memory::copy_device_async(&ctx, next, old, len, s) };
            // SAFETY: `old` came from `mr.allocate(len, s)` and was taken out of `cur`, so freed once; its
            // last use (the copy) is ordered before the free on `s`.
            let f = unsafe { mr.deallocate(old, len, s) };
            if let Err(e) = r.map_err(Error::from).and(f.map_err(Error::from)) {
                cur = Some((next, n));
                result = Err(e);
                break;
            }
        }
        cur = Some((next, n));
        if let Err(e) = stream.synchronize() {
            result = Err(e.into());
            break;
        }
        last_step = ts.elapsed().as_secs_f64();
    }
    let total = t.elapsed().as_secs_f64();
    if let Some((p, n)) = cur {
        // SAFETY: the one allocation left, freed once; the stream was synchronized or its last use is
        // ordered before this free on `s`.
        let r = unsafe { mr.deallocate(p, n, s) };
        if result.is_ok() {
            result = r.map_err(Error::from);
        }
    }
    stream.synchronize()?;
    result.map(|()| (total, last_step))
}

fn median_times(runs: &[Times]) -> Times {
    let a: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let b: Vec<f64> = runs.iter().map(|r| r.1).collect();
    (median(&a).unwrap_or(f64::NAN), median(&b).unwrap_or(f64::NAN))
}

/// Runs the growable buffer and allocate-copy-free through every resource of `common`.
pub fn bench(common: &Common, p: &GrowParams) -> Result<Report> {
    let sizes = steps(p)?;
    let dev = common
        .device
        .ok_or_else(|| Error::Usage("the grow workload needs a GPU".into()))?;
    let env = crate::env::Environment::detect(Some(&dev));
    let mut report = Report::new(
        "grow",
        "a buffer grown step by step: GrowableBuffer (map one allocation per growth, no copy) vs allocate-copy-free",
        env,
    );
    report.param("start", Size(p.start as u64));
    report.param("end", Size(p.end as u64));
    report.param("factor", p.factor);
    report.param("steps", sizes.len());
    report.param("repeats", p.repeats);
    report.param(
        "chunk",
        p.chunk
            .map_or("recommended granularity".to_owned(), |c| Size(c as u64).to_string()),
    );
    report.columns = vec![
        Column::new("method", 0),
        Column::new("total ms", 3),
        Column::new("last step ms", 3),
        Column::new("vs GrowableBuffer", 3),
    ];
    let stream = Stream::new(&dev.context()?)?;
    let repeats = p.repeats.max(1);
    let mut progress = Progress::new(1 + common.specs.len() as u64, common.quiet);
    progress.set_label("GrowableBuffer");
    run_growable(dev, &sizes, p.chunk)?;
    let runs = (0..repeats)
        .map(|_| run_growable(dev, &sizes, p.chunk))
        .collect::<Result<Vec<_>>>()?;
    let base = median_times(&runs);
    progress.inc();
    let mut rows = vec![("GrowableBuffer (VMM, no copy)".to_owned(), base)];
    for spec in &common.specs {
        progress.set_label(spec.to_string());
        let built = build(spec, Some(&dev))?;
        let mr = built.resource.as_ref();
        run_copying(mr, &stream, &sizes)?;
        let runs = (0..repeats)
            .map(|_| run_copying(mr, &stream, &sizes))
            .collect::<Result<Vec<_>>>()?;
        rows.push((format!("allocate-copy-free: {spec}"), median_times(&runs)));
        drop(built);
        progress.inc();
    }
    progress.finish();
    for (name, (total, last)) in rows {
        report.row(vec![
            Cell::from(name),
            Cell::from(total * 1e3),
            Cell::from(last * 1e3),
            Cell::from(total / base.0),
        ]);
    }
    report.notes.push(
        "total: wall time of all steps, each ended by a synchronize; GrowableBuffer's includes reserving its \
         range and dropping it; allocate-copy-free copies the old contents on the device at each step."
            .into(),
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_double_up_to_the_end() {
        let s = steps(&GrowParams::default()).unwrap();
        assert_eq!(s.first(), Some(&(1 << 20)));
        assert_eq!(s.last(), Some(&(16 << 30)));
        assert_eq!(s.len(), 15);
        let s = steps(&GrowParams {
            start: 1000,
            end: 5000,
            factor: 1.5,
            repeats: 1,
            chunk: None,
        })
        .unwrap();
        assert_eq!(
            s,
            vec![1000, 1536, 2304, 3584, 5000],
            "each step rounded up to 256 bytes"
        );
        assert!(steps(&GrowParams {
            factor: 1.0,
            ..GrowParams::default()
        })
        .is_err());
    }
}
