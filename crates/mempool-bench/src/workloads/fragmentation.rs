//! `fragmentation`: how much memory each resource holds for a pattern that fragments a pool (issue 14).
//!
//! One run, on one stream: allocate `smalls` small blocks with a large one after every
//! `smalls / larges` of them (so the large blocks pin the space between the runs of small ones); free the
//! small blocks; ask for one block larger than any run of freed small blocks (any free segment) but
//! smaller than all of them together (the total free); free everything. Reported per resource: the peak
//! of the device memory in use above what it was before the run (`cuMemGetInfo`, read after every
//! operation: whatever the resource holds, reserved or mapped, shows there), the peak of the bytes live,
//! and their ratio. The device must be otherwise idle for the reading to be the resource's alone. The
//! notes say how the run stands against issue 14's target (the expandable resource) and issue 23's
//! (`service` with default settings at most [`SERVICE_TARGET`]).

use mempool_core::{DeviceAddr, Stream};
use mempool_rmm::MemoryResource;

use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::report::{Cell, Column, Report};
use crate::spec::build;
use crate::units::Size;
use crate::workloads::Common;

/// Issue 23's target for `service` with default settings: peak held over peak live at most this.
pub const SERVICE_TARGET: f64 = 1.10;

/// Parameters of the `fragmentation` subcommand.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FragmentationParams {
    /// Size of each small block.
    pub small: usize,
    /// Number of small blocks.
    pub smalls: usize,
    /// Size of each large block.
    pub large: usize,
    /// Number of large blocks (at least 1, at most `smalls`).
    pub larges: usize,
    /// The request made after the small blocks are freed; `None`: half the runs of small blocks, at
    /// least two (larger than any free segment when runs stay where they were put, smaller than the
    /// total free whenever there are at least three runs).
    pub request: Option<usize>,
}

impl Default for FragmentationParams {
    /// 1024 blocks of 1 MiB, 8 of 64 MiB, then a 512 MiB request.
    fn default() -> Self {
        FragmentationParams {
            small: 1 << 20,
            smalls: 1024,
            large: 64 << 20,
            larges: 8,
            request: None,
        }
    }
}

impl FragmentationParams {
    /// Small blocks between two large ones.
    pub fn run_length(&self) -> usize {
        self.smalls / self.larges.max(1)
    }

    /// The request after the frees.
    pub fn request(&self) -> usize {
        self.request
            .unwrap_or((self.larges / 2).max(2) * self.run_length() * self.small)
    }

    /// Refuses parameters that do not make the pattern: no large block, more large blocks than small
    /// ones, or a request that is not between one run and all small blocks.
    pub fn check(&self) -> Result<()> {
        if self.larges == 0 || self.larges > self.smalls {
            return Err(Error::Usage(format!(
                "--larges ({}) must be between 1 and --smalls ({})",
                self.larges, self.smalls
            )));
        }
        let run = self.run_length() * self.small;
        let total = self.smalls * self.small;
        let r = self.request();
        if r <= run || r >= total {
            return Err(Error::Usage(format!(
                "--request ({}) must be larger than a run of small blocks ({}) and smaller than all of them ({})",
                Size(r as u64),
                Size(run as u64),
                Size(total as u64)
            )));
        }
        Ok(())
    }
}

/// What one resource did.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct FragmentationStats {
    /// The most device memory in use above the start, bytes.
    pub peak_held: u64,
    /// The most bytes live.
    pub peak_live: u64,
    /// Device memory in use above the start after everything was freed.
    pub held_at_end: i64,
}

fn used(ctx: &mempool_core::Context) -> Result<u64> {
    let m = ctx.memory_info()?;
    Ok((m.total - m.free) as u64)
}

/// Runs the pattern once on `mr`.
#[allow(unsafe_code)] // frees the allocations it made, each once (see the SAFETY lines)
pub fn run(mr: &dyn MemoryResource, stream: &Stream, p: &FragmentationParams) -> Result<FragmentationStats> {
    let ctx = stream.context().clone();
    let s = stream.as_ref();
    ctx.synchronize()?;
    let start = used(&ctx)?;
    let (mut live, mut peak_live, mut peak_used) = (0u64, 0u64, start);
    let mut smalls: Vec<DeviceAddr> = Vec::with_capacity(p.smalls);
    let mut larges: Vec<DeviceAddr> = Vec::with_capacity(p.larges);
    let mut sample = |live: u64, peak_live: &mut u64| -> Result<()> {
        *peak_live = (*peak_live).max(live);
        peak_used = peak_used.max(used(&ctx)?);
        Ok(())
    };
    let mut result = (|| -> Result<Option<DeviceAddr>> {
        for i in 0..p.smalls {
            smalls.push(mr.allocate(p.small, s)?);
            live += p.small as u64;
            sample(live, &mut peak_live)?;
            if (i + 1) % p.run_length() == 0 && larges.len() < p.larges {
                larges.push(mr.allocate(p.large, s)?);
                live += p.large as u64;
                sample(live, &mut peak_live)?;
            }
        }
        for a in smalls.drain(..) {
            // SAFETY: `a` came from `mr.allocate(p.small, s)` and is drained from `smalls`, so freed once; the
            // workload never touches the memory.
            unsafe { mr.deallocate(a, p.small, s) }?;
            live -= p.small as u64;
        }
        stream.synchronize()?;
        sample(live, &mut peak_live)?;
        let big = mr.allocate(p.request(), s)?;
        live += p.request() as u64;
        sample(live, &mut peak_live)?;
        Ok(Some(big))
    })();
    // Free what is left, even after a failure.
    let mut frees: Vec<(DeviceAddr, usize)> = smalls.drain(..).map(|a| (a, p.small)).collect();
    frees.extend(larges.drain(..).map(|a| (a, p.large)));
    if let Ok(Some(big)) = result {
        frees.push((big, p.request()));
    }
    for (a, n) in frees {
        // SAFETY: each entry is an allocation of `mr` with its size, listed once (drained above).
        let r = unsafe { mr.deallocate(a, n, s) };
        if result.is_ok() {
            result = r.map(|()| None).map_err(Error::from);
        }
    }
    result?;
    ctx.synchronize()?;
    let end = used(&ctx)?;
    Ok(FragmentationStats {
        peak_held: peak_used - start,
        peak_live,
        held_at_end: end as i64 - start as i64,
    })
}

/// Runs the pattern once per resource (a fresh resource each) and reports peak held over peak live.
pub fn bench(common: &Common, p: &FragmentationParams) -> Result<Report> {
    p.check()?;
    let dev = common
        .device
        .ok_or_else(|| Error::Usage("the fragmentation workload needs a GPU".into()))?;
    let env = crate::env::Environment::detect(Some(&dev));
    let mut report = Report::new(
        "fragmentation",
        "many small and a few large blocks, the small ones freed, then a block larger than any free segment",
        env,
    );
    report.param("small", Size(p.small as u64));
    report.param("smalls", p.smalls);
    report.param("large", Size(p.large as u64));
    report.param("larges", p.larges);
    report.param("request", Size(p.request() as u64));
    report.columns = vec![
        Column::new("resource", 0),
        Column::new("peak held", 0),
        Column::new("peak live", 0),
        Column::new("held / live", 3),
        Column::new("held after freeing all", 0),
    ];
    let stream = Stream::new(&dev.context()?)?;
    let mut progress = Progress::new(common.specs.len() as u64, common.quiet);
    // Held / live of the `service` spec with default settings, for issue 23's target.
    let default_service = crate::spec::parse("service")?;
    let mut service_ratio = None;
    for spec in &common.specs {
        progress.set_label(spec.to_string());
        let built = build(spec, Some(&dev))?;
        let st = run(built.resource.as_ref(), &stream, p)?;
        drop(built);
        let ratio = st.peak_held as f64 / st.peak_live.max(1) as f64;
        if *spec == default_service {
            service_ratio = Some(ratio);
        }
        report.row(vec![
            Cell::from(spec.to_string()),
            Cell::from(st.peak_held),
            Cell::from(st.peak_live),
            Cell::from(ratio),
            Cell::Int(st.held_at_end),
        ]);
        progress.inc();
    }
    progress.finish();
    report.notes.push(
        "held: device memory in use (cuMemGetInfo) above its level before the run, read after every operation; \
         live: bytes of allocations live; a fresh resource per row; the device must be otherwise idle."
            .into(),
    );
    report
        .notes
        .push("target (issue 14): held / live at most 1.1 for the expandable resource; the others as measured.".into());
    report.notes.push(format!(
        "target (issue 23): held / live at most 1.10 for `service` with default settings: {}",
        match service_ratio {
            Some(r) if r <= SERVICE_TARGET => format!("{r:.3}, met"),
            Some(r) => format!("{r:.3}, missed"),
            None => "not measured in this run (add `-r service`)".to_owned(),
        }
    ));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_request_sits_between_a_run_and_the_total() {
        let p = FragmentationParams::default();
        assert_eq!(p.run_length(), 128);
        assert_eq!(p.request(), 512 << 20);
        p.check().unwrap();
        let bad = FragmentationParams {
            request: Some(128 << 20),
            ..p
        };
        assert!(bad.check().unwrap_err().to_string().contains("larger than a run"));
        let bad = FragmentationParams { larges: 0, ..p };
        assert!(bad.check().is_err());
        let bad = FragmentationParams {
            request: Some(1 << 30),
            ..p
        };
        assert!(bad.check().is_err(), "equal to the total free is not smaller");
    }
}
