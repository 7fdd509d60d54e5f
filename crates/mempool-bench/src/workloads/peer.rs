//! `peer` (two GPUs): the bandwidth of device 1 reading a buffer that lives on device 0, by a kernel
//! (16-byte loads through the mapping) and by a copy (`cuMemcpyAsync`), for memory from a device-0 pool
//! that granted device 1 access (`cuMemPoolSetAccess`) against `cuMemAlloc` memory with peer access
//! enabled (`cuCtxEnablePeerAccess`), and device 1 reading its own memory as the local reference.
//! Timed with CUDA events on device 1's stream; every read is checked by summing what arrived.

#![allow(unsafe_code)]

use std::sync::Arc;

use mempool_core::{memory, Context, Device, DeviceAddr, Event, EventFlags, MemPool, PoolProps, Stream};

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::kernels::{elementwise, hash2, launch, load, strided, Arg, WorkKernels};
use crate::report::{median, Cell, Column, Report};
use crate::workloads::Common;

/// Parameters of the `peer` subcommand.
#[derive(Clone, Debug)]
pub struct PeerParams {
    /// Bytes per transfer (a multiple of 16).
    pub bytes: usize,
    /// Timed transfers per case (median), after one warm-up.
    pub repeats: usize,
}

/// Lets `ctx`'s device access `peer`'s `cuMemAlloc` memory (`cuCtxEnablePeerAccess`); already enabled
/// is fine.
fn enable_peer_access(ctx: &Arc<Context>, peer: &Arc<Context>) -> Result<()> {
    Ok(ctx.enable_peer_access(peer)?)
}

/// One measured case.
#[derive(Clone, Debug)]
pub struct PeerCase {
    /// Where the source lives.
    pub(crate) memory: &'static str,
    /// Kernel or copy.
    pub(crate) method: &'static str,
    /// GB/s (1e9 bytes per second).
    pub gbps: f64,
}

struct Reader<'a> {
    ctx1: &'a Arc<Context>,
    s1: &'a Stream,
    k1: &'a WorkKernels<'a>,
    dst: DeviceAddr,
    acc: DeviceAddr,
    bytes: usize,
    repeats: usize,
    expected: u64,
}

impl Reader<'_> {
    /// Times `repeats` reads of `src` into `dst` on device 1; checks the last one.
    fn measure(&self, src: DeviceAddr, by_kernel: bool) -> Result<f64> {
        let s = self.s1.as_ref();
        let n16 = self.bytes / 16;
        let read = || -> Result<()> {
            if by_kernel {
                // SAFETY: `dst` (device 1) and `src` (device 0, mapped for device 1 by the caller) hold
                // `bytes` = 16 * n16 bytes for the whole measurement.
                unsafe {
                    launch(
                        &self.k1.copy,
                        strided(n16),
                        s,
                        &[Arg::from(self.dst), Arg::from(src), Arg::U64(n16 as u64)],
                    )
                }
            } else {
                // SAFETY: as above; the copy engine reads through unified addressing.
                unsafe { memory::copy_device_async(self.ctx1, self.dst, src, self.bytes, s) }.map_err(Error::from)
            }
        };
        read()?;
        let (start, end) = (
            Event::new(self.ctx1, EventFlags::empty())?,
            Event::new(self.ctx1, EventFlags::empty())?,
        );
        let mut times = Vec::new();
        for _ in 0..self.repeats.max(1) {
            start.record(s)?;
            read()?;
            end.record(s)?;
            end.synchronize()?;
            times.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
        }
        // Check what arrived.
        // SAFETY: `acc` holds one u64 on device 1; `dst` holds bytes/4 u32s.
        unsafe {
            memory::fill_async(self.ctx1, self.acc, 0, 8, s)?;
            let n = self.bytes / 4;
            launch(
                &self.k1.sum,
                strided(n),
                s,
                &[Arg::from(self.dst), Arg::U64(n as u64), Arg::from(self.acc)],
            )?;
        }
        let mut host = [0u8; 8];
        // SAFETY: 8 bytes of `acc`.
        unsafe { memory::copy_to_host(self.ctx1, &mut host, self.acc, s) }?;
        let got = u64::from_ne_bytes(host);
        if got != self.expected {
            return Err(Error::Check(format!(
                "device 1 read a sum of {got}, expected {}",
                self.expected
            )));
        }
        // SAFETY: `dst` holds `bytes`; clear it so the next case cannot pass on stale data.
        unsafe { memory::fill_async(self.ctx1, self.dst, 0, self.bytes, s) }?;
        let secs = median(&times).unwrap_or(f64::NAN);
        Ok(self.bytes as f64 / secs / 1e9)
    }
}

/// Measures every case; needs two GPUs with peer capability.
pub fn measure(params: &PeerParams) -> Result<Vec<PeerCase>> {
    let count = Device::count()?;
    if count < 2 {
        return Err(Error::Usage(format!(
            "the peer workload needs two GPUs; this machine has {count}"
        )));
    }
    if !params.bytes.is_multiple_of(16) || params.bytes == 0 {
        return Err(Error::Usage("--bytes must be a positive multiple of 16".into()));
    }
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    if !d1.can_access_peer(d0)? {
        return Err(Error::Usage(
            "device 1 cannot access device 0's memory (no peer capability)".into(),
        ));
    }
    let (ctx0, ctx1) = (d0.context()?, d1.context()?);
    let (s0, s1) = (Stream::new(&ctx0)?, Stream::new(&ctx1)?);
    let (m0, m1) = (load(&ctx0, "work.ptx")?, load(&ctx1, "work.ptx")?);
    let (k0, k1) = (WorkKernels::new(&m0)?, WorkKernels::new(&m1)?);
    let bytes = params.bytes;
    let n = bytes / 4;
    let expected: u64 = (0..n as u64).map(|i| u64::from(hash2(7, i))).sum();
    let fill = |ctx: &Arc<Context>, k: &WorkKernels<'_>, s: &Stream, p: DeviceAddr| -> Result<()> {
        let _ = ctx;
        // SAFETY: `p` holds `bytes` = 4n bytes on the stream's device.
        unsafe {
            launch(
                &k.fill_hash,
                elementwise(n),
                s.as_ref(),
                &[Arg::from(p), Arg::U64(n as u64), Arg::U32(7)],
            )
        }?;
        s.synchronize()?;
        Ok(())
    };

    // Sources: a device-0 pool granted to device 1, cuMemAlloc memory on device 0, and device 1's own.
    let pool = MemPool::new(&d0, &PoolProps::new())?;
    pool.grant_access(&d1)?;
    let pool_src = pool.alloc(bytes, s0.as_ref())?;
    fill(&ctx0, &k0, &s0, pool_src.ptr())?;
    let plain_src = memory::device_alloc(&ctx0, bytes)?;
    fill(&ctx0, &k0, &s0, plain_src)?;
    enable_peer_access(&ctx1, &ctx0)?;
    let local_src = memory::device_alloc(&ctx1, bytes)?;
    fill(&ctx1, &k1, &s1, local_src)?;
    let dst = memory::device_alloc(&ctx1, bytes)?;
    let acc = memory::device_alloc(&ctx1, 8)?;

    let reader = Reader {
        ctx1: &ctx1,
        s1: &s1,
        k1: &k1,
        dst,
        acc,
        bytes,
        repeats: params.repeats,
        expected,
    };
    let mut cases = Vec::new();
    let result = (|| -> Result<()> {
        for (memory_name, src) in [
            ("device 0 pool, access granted", pool_src.ptr()),
            ("device 0 cuMemAlloc, peer access", plain_src),
            ("device 1 local (reference)", local_src),
        ] {
            for (method, by_kernel) in [("kernel", true), ("copy", false)] {
                let gbps = reader.measure(src, by_kernel)?;
                cases.push(PeerCase {
                    memory: memory_name,
                    method,
                    gbps,
                });
            }
        }
        Ok(())
    })();
    s1.synchronize()?;
    // SAFETY: every allocation below came from device_alloc in its context, is freed once, and the
    // streams that used them were synchronized.
    unsafe {
        memory::device_free(&ctx1, acc)?;
        memory::device_free(&ctx1, dst)?;
        memory::device_free(&ctx1, local_src)?;
        memory::device_free(&ctx0, plain_src)?;
    }
    drop(pool_src);
    s0.synchronize()?;
    result?;
    Ok(cases)
}

/// The `peer` report.
pub fn bench(common: &Common, params: &PeerParams) -> Result<Report> {
    let cases = measure(params)?;
    let env = crate::env::Environment::detect(common.device.as_ref());
    let mut report = Report::new(
        "peer",
        "device 1 reading device 0's memory: pool access grant vs cuMemAlloc with peer access",
        env,
    );
    report.param("bytes", params.bytes);
    report.param("repeats", params.repeats);
    report.param("reader", "device 1");
    report.param("owner", "device 0");
    report.columns = vec![
        Column::new("memory", 0),
        Column::new("method", 0),
        Column::new("GB/s", 1),
        Column::new("vs cuMemAlloc + peer access", 3),
    ];
    let base = |method: &str| {
        cases
            .iter()
            .find(|c| c.method == method && c.memory.contains("cuMemAlloc"))
            .map(|c| c.gbps)
    };
    for c in &cases {
        report.row(vec![
            Cell::from(c.memory),
            Cell::from(c.method),
            Cell::from(c.gbps),
            Cell::from(base(c.method).map(|b| c.gbps / b)),
        ]);
    }
    report.notes.push(
        "GB/s: bytes / median transfer time (CUDA events on device 1's stream), 1 GB = 1e9 bytes; every transfer's \
         data was checked on device 1."
            .into(),
    );
    let memories = [
        "device 0 pool, access granted",
        "device 0 cuMemAlloc, peer access",
        "device 1 local (reference)",
    ];
    report.chart = Some(Chart {
        title: "Peer reads: GB/s (higher is better)".into(),
        kind: ChartKind::Bars,
        x_label: "method".into(),
        y_label: "GB/s".into(),
        categories: vec!["kernel".into(), "copy".into()],
        series: memories
            .iter()
            .map(|m| Series {
                name: (*m).to_owned(),
                values: ["kernel", "copy"]
                    .iter()
                    .map(|meth| {
                        cases
                            .iter()
                            .find(|c| c.memory == *m && c.method == *meth)
                            .map(|c| c.gbps)
                    })
                    .collect(),
            })
            .collect(),
        log_y: false,
    });
    Ok(report)
}
