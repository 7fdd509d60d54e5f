//! `allreduce` (two or more GPUs): NCCL all-reduce bandwidth over three kinds of memory, each registered
//! with `ncclCommRegister` and not, in one run: VMM memory (`VmmResource`, allocated as `ncclMemAlloc`
//! does), stream-ordered pool memory (`cuMemAllocFromPoolAsync`) and `cuMemAlloc` memory (what
//! `cudaMalloc` returns); unregistered `cuMemAlloc` memory is the baseline. A fourth kind is a
//! `ServiceResource` per GPU with its communicator attached (`mempool_nccl::attach`, registration that
//! follows the pool): its buffers are allocated after the pool grew and grow it again, and the run
//! checks that each lies in one registration, made with no registration call of the benchmark. One process, one
//! communicator per GPU (`ncclCommInitAll`), one group call per iteration; host time around a
//! synchronize of every stream. algbw = bytes / time, busbw = algbw * 2(n-1)/n, as nccl-tests define
//! them. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).

use std::sync::Arc;
use std::time::Instant;

use mempool_core::{Device, Stream};
use mempool_nccl::{Attachment, Comm, ReduceOp, Registration};
use mempool_rmm::containers::DeviceBuffer;
use mempool_rmm::{
    AsyncOptions, AsyncResource, CudaResource, ServiceOptions, ServiceResource, SharedResource, VmmOptions, VmmResource,
};

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::report::{Cell, Column, Report};
use crate::units::Size;

/// Parameters of the `allreduce` subcommand.
#[derive(Clone, Debug)]
pub struct AllReduceParams {
    /// The GPUs, one rank each (at least two).
    pub devices: Vec<Device>,
    /// Bytes per all-reduce, each a multiple of 4 (the elements are i32).
    pub sizes: Vec<usize>,
    /// Untimed iterations per case.
    pub warmup: usize,
    /// Timed iterations per case.
    pub iters: usize,
}

/// Where a kind's memory comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Memory {
    /// `VmmResource`: one `cuMemCreate` allocation per buffer, as `ncclMemAlloc` makes it.
    Vmm,
    /// `AsyncResource`: stream-ordered pool memory (`cuMemAllocFromPoolAsync`).
    Pool,
    /// `CudaResource`: `cuMemAlloc`, what `cudaMalloc` returns.
    CuMemAlloc,
    /// `ServiceResource` (default options) with a communicator attached: buffers allocated after the pool
    /// grew, registered by the attachment.
    ServiceAttached,
}

/// One memory kind compared: its report label, its memory, and whether its buffers are registered with
/// NCCL.
struct Kind {
    label: &'static str,
    memory: Memory,
    registered: bool,
}

/// The memory kinds compared, in report order; unregistered `cuMemAlloc` memory is the baseline.
const KINDS: [Kind; 7] = [
    Kind {
        label: "VMM, registered",
        memory: Memory::Vmm,
        registered: true,
    },
    Kind {
        label: ATTACHED,
        memory: Memory::ServiceAttached,
        registered: false,
    },
    Kind {
        label: "VMM, unregistered",
        memory: Memory::Vmm,
        registered: false,
    },
    Kind {
        label: "pool, registered",
        memory: Memory::Pool,
        registered: true,
    },
    Kind {
        label: "pool, unregistered",
        memory: Memory::Pool,
        registered: false,
    },
    Kind {
        label: "cuMemAlloc, registered",
        memory: Memory::CuMemAlloc,
        registered: true,
    },
    Kind {
        label: BASELINE,
        memory: Memory::CuMemAlloc,
        registered: false,
    },
];

/// The label of the baseline kind.
const BASELINE: &str = "cuMemAlloc";

/// The label of the attached service pool.
const ATTACHED: &str = "service pool, attached, after growth";

/// One measured case.
#[derive(Clone, Debug)]
pub struct AllReduceCase {
    /// Bytes per all-reduce.
    pub bytes: usize,
    /// The memory kind's label (one of `KINDS`).
    pub memory: &'static str,
    /// Seconds per all-reduce.
    pub seconds: f64,
}

impl AllReduceCase {
    /// Algorithm bandwidth, GB/s (1e9 bytes per second).
    pub fn algbw(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }

    /// Bus bandwidth for `n` ranks, GB/s.
    pub fn busbw(&self, n: usize) -> f64 {
        busbw(self.algbw(), n)
    }
}

/// nccl-tests' bus bandwidth of an all-reduce over `n` ranks.
pub fn busbw(algbw: f64, n: usize) -> f64 {
    algbw * 2.0 * (n as f64 - 1.0) / n as f64
}

/// Each device's resource for `memory`; for the attached service pool also the attachments, each owning
/// a communicator of its own (`ncclCommInitAll` again), which hold the resources weakly.
fn resources(memory: Memory, devices: &[Device]) -> Result<(Vec<SharedResource>, Vec<Attachment>)> {
    let each = |make: &dyn Fn(&Device) -> Result<SharedResource>| devices.iter().map(make).collect::<Result<Vec<_>>>();
    let mrs = match memory {
        Memory::Vmm => each(&|d| Ok(Arc::new(VmmResource::new(d, VmmOptions::default())?)))?,
        Memory::Pool => each(&|d| Ok(Arc::new(AsyncResource::new(d, AsyncOptions::default())?)))?,
        Memory::CuMemAlloc => each(&|d| Ok(Arc::new(CudaResource::new(d)?)))?,
        Memory::ServiceAttached => return services_attached(devices),
    };
    Ok((mrs, Vec::new()))
}

/// A `ServiceResource` per device, each with a new communicator attached.
fn services_attached(devices: &[Device]) -> Result<(Vec<SharedResource>, Vec<Attachment>)> {
    let services = devices
        .iter()
        // A tag per size (`measure_one`): room for 15 sizes, each 64 GiB of address space (no memory).
        .map(|d| {
            ServiceResource::new(
                d,
                ServiceOptions {
                    max_tags: 16,
                    region_size: Some(64 << 30),
                    ..ServiceOptions::default()
                },
            )
        })
        .collect::<mempool_rmm::Result<Vec<_>>>()?;
    let atts = Comm::init_all(devices)?
        .into_iter()
        .zip(&services)
        .map(|(c, s)| {
            // SAFETY: every rank attaches its communicator to the resource its buffers come from,
            // and `measure_one` checks that each buffer lies in a registration before any
            // collective.
            #[allow(unsafe_code)]
            let a = unsafe { mempool_nccl::attach(c, s) };
            a
        })
        .collect::<mempool_nccl::Result<Vec<_>>>()?;
    Ok((services.into_iter().map(|s| s as SharedResource).collect(), atts))
}

/// One kind at one size: allocate, register (the kinds that say so; with `atts`, allocate from a new tag
/// of each service pool, so that the buffers grow it, and check that each buffer lies in one registration
/// of the attachment), check one all-reduce's result, then time.
fn measure_one(
    kind: &Kind,
    bytes: usize,
    comms: &[&Comm],
    atts: Option<&[Attachment]>,
    streams: &[Stream],
    mrs: &[SharedResource],
    p: &AllReduceParams,
) -> Result<AllReduceCase> {
    let n = comms.len();
    // For the attached service pools, each size's buffers come from a tag of their own, which nothing
    // used before: the buffers grow the pool, each mapping the chunks it needs as one physical
    // allocation (registered alone), rather than landing partly on chunks mapped for earlier sizes.
    let tagged: Vec<SharedResource> = match atts {
        Some(atts) => atts
            .iter()
            .map(|att| -> Result<SharedResource> {
                let svc = att
                    .resource()
                    .ok_or_else(|| Error::Usage(format!("{}: the service pool is gone", kind.label)))?;
                let tag = svc.tag(&format!("allreduce-{bytes}"))?;
                Ok(Arc::new(svc.tagged(tag)))
            })
            .collect::<Result<Vec<_>>>()?,
        None => mrs.to_vec(),
    };
    let sends = streams
        .iter()
        .zip(&tagged)
        .map(|(s, mr)| DeviceBuffer::new(bytes, s, mr.clone()))
        .collect::<mempool_rmm::Result<Vec<_>>>()?;
    let recvs = streams
        .iter()
        .zip(&tagged)
        .map(|(s, mr)| DeviceBuffer::new(bytes, s, mr.clone()))
        .collect::<mempool_rmm::Result<Vec<_>>>()?;
    if let Some(atts) = atts {
        for (i, att) in atts.iter().enumerate() {
            if let Some(e) = att.errors().first() {
                return Err(Error::Usage(format!(
                    "{}: rank {i}: a registration failed: {e}",
                    kind.label
                )));
            }
            let regs = att.registered();
            for (what, b) in [("send", &sends[i]), ("receive", &recvs[i])] {
                if !regs.iter().any(|r| r.contains(b.ptr(), b.len())) {
                    return Err(Error::Usage(format!(
                        "{}, {bytes} bytes: rank {i}'s {what} buffer at {} lies in no single registration \
                         ({regs:?})",
                        kind.label,
                        b.ptr()
                    )));
                }
            }
        }
    }
    let mut regs: Vec<Registration> = Vec::new();
    if kind.registered {
        for (i, c) in comms.iter().enumerate() {
            // SAFETY: every rank registers both of its buffers before any collective runs (a failure
            // returns before the collectives, dropping the registrations made); `regs` is dropped, not
            // leaked, before the buffers.
            #[allow(unsafe_code)]
            let pair = unsafe { (c.register(&sends[i])?, c.register(&recvs[i])?) };
            regs.push(pair.0);
            regs.push(pair.1);
        }
    }
    for b in &sends {
        b.fill(1)?; // every i32 is 0x01010101: the sum over n <= 255 ranks carries nothing
    }
    let round = || -> Result<()> {
        mempool_nccl::group(|g| {
            for (i, c) in comms.iter().enumerate() {
                g.all_reduce::<i32>(c, &sends[i], &recvs[i], ReduceOp::Sum, streams[i].as_ref())?;
            }
            Ok(())
        })?;
        Ok(())
    };
    let sync = || -> Result<()> {
        for s in streams {
            s.synchronize()?;
        }
        Ok(())
    };
    round()?;
    sync()?;
    let want = (n as u8).to_ne_bytes()[0];
    for (i, r) in recvs.iter().enumerate() {
        let mut head = [0u8; 4];
        r.copy_to_host(0, &mut head)?;
        let mut tail = [0u8; 4];
        r.copy_to_host(bytes - 4, &mut tail)?;
        if head != [want; 4] || tail != [want; 4] {
            return Err(Error::Usage(format!(
                "all-reduce of {} memory, {bytes} bytes: rank {i} holds {head:?}..{tail:?}, expected bytes of {want}",
                kind.label
            )));
        }
    }
    for _ in 0..p.warmup {
        round()?;
    }
    sync()?;
    let t = Instant::now();
    for _ in 0..p.iters {
        round()?;
    }
    sync()?;
    let seconds = t.elapsed().as_secs_f64() / p.iters as f64;
    drop(regs);
    Ok(AllReduceCase {
        bytes,
        memory: kind.label,
        seconds,
    })
}

/// Runs every kind at every size.
pub fn measure(p: &AllReduceParams, quiet: bool) -> Result<Vec<AllReduceCase>> {
    if p.devices.len() < 2 {
        return Err(Error::Usage(format!(
            "allreduce needs at least two GPUs, {} given",
            p.devices.len()
        )));
    }
    // The binary sets NCCL_NVLS_ENABLE=0 at the start of `main` (see `disable_nvls_for_allreduce`); a
    // library caller must have set it.
    mempool_nccl::nvls_disabled()?;
    let comms = Comm::init_all(&p.devices)?;
    let comm_refs: Vec<&Comm> = comms.iter().collect();
    let streams = p
        .devices
        .iter()
        .map(|d| Stream::new(&d.context()?))
        .collect::<mempool_core::Result<Vec<_>>>()?;
    let mut cases = Vec::new();
    for kind in &KINDS {
        let (mrs, atts) = resources(kind.memory, &p.devices)?;
        for &bytes in &p.sizes {
            let guards: Vec<_> = atts.iter().map(|a| a.comm()).collect();
            let refs: Vec<&Comm> = if atts.is_empty() {
                comm_refs.clone()
            } else {
                guards.iter().map(|g| &**g).collect()
            };
            // The pool grows first (a buffer that stays while the case runs), so that the measured
            // buffers are allocated after growth, and grow it again next to it.
            let warm = if atts.is_empty() {
                Vec::new()
            } else {
                streams
                    .iter()
                    .zip(&mrs)
                    .map(|(s, mr)| DeviceBuffer::new(1 << 20, s, mr.clone()))
                    .collect::<mempool_rmm::Result<Vec<_>>>()?
            };
            let atts_arg = (!atts.is_empty()).then_some(atts.as_slice());
            let c = measure_one(kind, bytes, &refs, atts_arg, &streams, &mrs, p)?;
            drop(warm);
            drop(refs);
            drop(guards);
            if !quiet {
                eprintln!(
                    "allreduce: {}, {}: {:.1} GB/s busbw",
                    kind.label,
                    Size(bytes as u64),
                    c.busbw(p.devices.len())
                );
            }
            cases.push(c);
        }
        drop(mrs);
        for a in atts {
            a.detach()?.destroy()?;
        }
    }
    drop(streams);
    for c in comms {
        c.destroy()?;
    }
    Ok(cases)
}

/// The `allreduce` report.
pub fn bench(p: &AllReduceParams, quiet: bool) -> Result<Report> {
    let cases = measure(p, quiet)?;
    let n = p.devices.len();
    let env = crate::env::Environment::detect(p.devices.first());
    let mut report = Report::new(
        "allreduce",
        "NCCL all-reduce bandwidth: VMM, pool and cuMemAlloc memory, registered with NCCL and not, and a \
         service pool with its communicator attached (registration that follows the pool)",
        env,
    );
    let names = p
        .devices
        .iter()
        .map(|d| format!("{} ({})", d.ordinal(), d.name().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(", ");
    report.param("devices", names);
    report.param("ranks", n);
    report.param("nccl", mempool_nccl::library_version()?);
    report.param("nccl_library", mempool_nccl::library_path()?);
    report.param(
        "NCCL_NVLS_ENABLE",
        std::env::var("NCCL_NVLS_ENABLE").unwrap_or_default(),
    );
    report.param("dtype", "i32, sum, out of place");
    report.param("warmup", p.warmup);
    report.param("iters", p.iters);
    report.columns = vec![
        Column::new("size", 0),
        Column::new("memory", 0),
        Column::new("time us", 1),
        Column::new("algbw GB/s", 2),
        Column::new("busbw GB/s", 2),
        Column::new("busbw vs cuMemAlloc", 3),
    ];
    let base = |bytes: usize| {
        cases
            .iter()
            .find(|c| c.bytes == bytes && c.memory == BASELINE)
            .map(|c| c.busbw(n))
    };
    for &bytes in &p.sizes {
        for c in cases.iter().filter(|c| c.bytes == bytes) {
            report.row(vec![
                Cell::from(Size(bytes as u64).to_string()),
                Cell::from(c.memory),
                Cell::from(c.seconds * 1e6),
                Cell::from(c.algbw()),
                Cell::from(c.busbw(n)),
                Cell::from(base(bytes).map(|b| c.busbw(n) / b)),
            ]);
        }
    }
    report.notes.push(format!(
        "one process, {n} ranks (ncclCommInitAll), one ncclGroupStart/End per iteration; host time around a \
         synchronize of every stream, divided by the iterations; busbw = algbw * 2(n-1)/n (nccl-tests)"
    ));
    report.chart = Some(Chart {
        title: "all-reduce bus bandwidth".into(),
        kind: ChartKind::Lines,
        x_label: "bytes".into(),
        y_label: "busbw GB/s".into(),
        categories: p.sizes.iter().map(|&b| Size(b as u64).to_string()).collect(),
        series: KINDS
            .iter()
            .map(|k| Series {
                name: k.label.to_string(),
                values: p
                    .sizes
                    .iter()
                    .map(|&b| {
                        cases
                            .iter()
                            .find(|c| c.bytes == b && c.memory == k.label)
                            .map(|c| c.busbw(n))
                    })
                    .collect(),
            })
            .collect(),
        log_y: false,
    });
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bandwidth_is_nccl_tests_factor() {
        assert_eq!(busbw(100.0, 2), 100.0);
        assert_eq!(busbw(100.0, 4), 150.0);
        assert_eq!(busbw(100.0, 8), 175.0);
        let c = AllReduceCase {
            bytes: 1 << 30,
            memory: "cuMemAlloc",
            seconds: 0.01,
        };
        assert!((c.algbw() - 107.374_182_4).abs() < 1e-6);
    }
}
