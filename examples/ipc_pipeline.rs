//! A multi-process GPU pipeline: one producer process fills buffers on the GPU and hands them to
//! several consumer processes without copying them; each consumer checks what it received, does its
//! own GPU work on it (a copy into private memory, an in-place add), and releases it; the producer
//! checks every consumer's writes when the buffer comes back. Everything is checked end to end.
//!
//! Run: `cargo run --release --example ipc_pipeline -- [consumers] [buffers] [MiB per buffer]`
//! (defaults: 3 consumers, 240 buffers, 4 MiB). The producer re-executes this program for each
//! consumer (`ipc_pipeline consume SOCKET INDEX`); CUDA does not survive `fork`. Without a GPU it says
//! why and exits with status 2.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use mempool::core::kernels::{u32s, CheckKernels};
use mempool::core::{Device, HandleTypes, MemPool, PoolProps, Stream};
use mempool::ipc::{Error, ExportedBuffer, Exporter, ExporterOptions, Importer, ImporterOptions};

const MIB: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(60);

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    if let Err(missing) = mempool::core::require_gpus(1) {
        return missing.exit("ipc_pipeline");
    }
    let args: Vec<String> = std::env::args().collect();
    let result = if args.get(1).map(String::as_str) == Some("consume") {
        consume(PathBuf::from(&args[2]), args[3].parse().expect("consumer index"))
    } else {
        let arg = |i: usize, default: usize| args.get(i).map_or(default, |a| a.parse().expect("a number"));
        produce(arg(1, 3), arg(2, 240), arg(3, 4) * MIB)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc_pipeline: {e}");
            ExitCode::FAILURE
        }
    }
}

fn produce(consumers: usize, buffers: usize, bytes: usize) -> AnyResult<()> {
    let dev = Device::get(0)?;
    let ctx = dev.context()?;
    let pool = MemPool::new(&dev, &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR))?;
    pool.keep_everything()?; // a pipeline reuses the same sizes over and over
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let socket = dir.join(format!("mempool-pipeline-{}.sock", std::process::id()));
    let exporter = Exporter::new(&socket, pool, ExporterOptions::default())?;
    println!("producer on {} ({}), socket {}", dev, dev.name()?, socket.display());

    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for k in 0..consumers {
        children.push(
            Command::new(&exe)
                .arg("consume")
                .arg(&socket)
                .arg(k.to_string())
                .spawn()?,
        );
    }
    let importers: Vec<_> = exporter
        .wait_for_importers(consumers, WAIT)?
        .iter()
        .map(|i| i.id)
        .collect();

    let kernels = CheckKernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    let n = bytes / 4;
    let mut host = vec![0u8; n * 4];
    let mut in_flight = VecDeque::new();
    let window = 4 * consumers;
    let started = Instant::now();
    let mut check = |(buf, base, k): (ExportedBuffer<'_>, u32, usize)| check_returned(&buf, base, k, &mut host);
    for seq in 0..buffers {
        let k = seq % consumers;
        let base = (seq as u32).wrapping_mul(7919);
        let buf = exporter.alloc(bytes, stream.as_ref())?;
        // SAFETY: the buffer holds n u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), n, base, stream.as_ref()) }?;
        exporter.share(&buf, &[importers[k]])?;
        in_flight.push_back((buf, base, k));
        if in_flight.len() >= window {
            check(in_flight.pop_front().expect("the window is full"))?;
        }
    }
    while let Some(entry) = in_flight.pop_front() {
        check(entry)?;
    }
    let elapsed = started.elapsed();
    stream.synchronize()?;
    let stats = exporter.stats();
    drop(exporter); // Goodbye: consumers see the exporter leave and exit
    let mut failed = 0;
    for mut child in children {
        if !child.wait()?.success() {
            failed += 1;
        }
    }
    if failed > 0 {
        return Err(format!("{failed} consumers failed").into());
    }
    println!(
        "{buffers} buffers of {} MiB through {consumers} consumers in {:.1} ms ({:.0} buffers/s), all checked; \
         freed {} buffers",
        bytes / MIB,
        elapsed.as_secs_f64() * 1e3,
        buffers as f64 / elapsed.as_secs_f64(),
        stats.freed_buffers,
    );
    Ok(())
}

/// Waits until the consumer released `buf`, then checks its writes: `base + i + k + 1`.
fn check_returned(buf: &ExportedBuffer<'_>, base: u32, k: usize, host: &mut [u8]) -> AnyResult<()> {
    buf.wait_released(WAIT)?;
    // Work on the buffer's stream from here on (this copy) runs after the consumers' work on it.
    buf.copy_to_host(0, host)?;
    let add = k as u32 + 1;
    if let Some((i, v)) = u32s(host)
        .into_iter()
        .enumerate()
        .find(|&(i, v)| v != base.wrapping_add(i as u32).wrapping_add(add))
    {
        return Err(format!("buffer {} from consumer {k}: element {i} is {v}", buf.id()).into());
    }
    Ok(())
}

fn consume(socket: PathBuf, k: usize) -> AnyResult<()> {
    let importer = Importer::connect(&socket, ImporterOptions::default())?;
    let dev = importer.device();
    let ctx = dev.context()?;
    let kernels = CheckKernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    // The consumer's own memory, for its private copy of each buffer.
    let private = MemPool::new(&dev, &PoolProps::new())?;
    private.keep_everything()?;
    let mut received = 0usize;
    loop {
        let buf = match importer.recv(stream.as_ref()) {
            Ok(buf) => buf,
            Err(Error::ExporterGone { .. }) => break,
            Err(e) => return Err(e.into()),
        };
        let n = buf.len() / 4;
        let copy = private.alloc(buf.len(), stream.as_ref())?;
        // SAFETY: both hold n u32s; the shared buffer is ordered on `stream` after the producer's
        // event, the private one was allocated on `stream`.
        unsafe {
            kernels.copy(copy.ptr(), buf.ptr(), n, stream.as_ref())?;
            kernels.add(buf.ptr(), n, k as u32 + 1, stream.as_ref())?;
        }
        let mut sample = [0u8; 4];
        let mut base = 0;
        for i in [0, n / 2, n - 1] {
            copy.copy_to_host(4 * i, &mut sample)?;
            let v = u32::from_ne_bytes(sample);
            if i == 0 {
                base = v; // the producer filled the buffer with base + i
            }
            if v != base.wrapping_add(i as u32) {
                return Err(format!("consumer {k}: buffer {} element {i} is {v}", buf.id()).into());
            }
        }
        drop(copy);
        drop(buf); // queues the release, ordered after the add by the consumer's event
        received += 1;
    }
    println!(
        "consumer {k} (pid {}): {received} buffers received, checked and released",
        std::process::id()
    );
    Ok(())
}
