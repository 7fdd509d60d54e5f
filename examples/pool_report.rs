//! Creates a stream-ordered pool on every GPU, exercises it, and reports the device and the pool's
//! state. On a machine without a GPU it says why and exits with status 2.
//!
//! Run: `cargo run --release --example pool_report`

use std::process::ExitCode;

use mempool::core::kernels::{u32s, CheckKernels};
use mempool::core::{Device, HandleTypes, MemPool, PoolProps, Stream};

const MIB: usize = 1 << 20;

fn report(dev: Device) -> mempool::Result<()> {
    let (major, minor) = dev.compute_capability()?;
    println!(
        "{dev}: {} (sm_{major}{minor}), {} MiB, UUID {}",
        dev.name()?,
        dev.total_memory()? / MIB,
        dev.uuid()?
    );
    println!("  memory pools supported: {}", dev.supports_memory_pools()?);
    println!("  pool export handle types: {:?}", dev.supported_pool_handle_types()?);
    if !dev.supports_memory_pools()? {
        return Ok(());
    }
    let ctx = dev.context()?;
    let stream = Stream::new(&ctx)?;
    let exportable = dev
        .supported_pool_handle_types()?
        .contains(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let props = if exportable {
        PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)
    } else {
        PoolProps::new()
    };
    let pool = MemPool::new(&dev, &props)?;
    pool.set_release_threshold(64 * MIB as u64)?;

    // Real work: fill 16 buffers of 4 MiB with a kernel, check one, free them on the stream.
    let kernels = CheckKernels::load(&ctx)?;
    let n = 4 * MIB / 4;
    let bufs = (0..16)
        .map(|_| pool.alloc(4 * MIB, stream.as_ref()))
        .collect::<mempool::Result<Vec<_>>>()?;
    for (i, b) in bufs.iter().enumerate() {
        // SAFETY: each buffer holds n u32s and lives until the synchronize below.
        unsafe { kernels.iota(b.ptr(), n, i as u32 * 1000, stream.as_ref())? };
    }
    let mut host = vec![0u8; 4 * MIB];
    bufs[3].copy_to_host(0, &mut host)?;
    let ok = u32s(&host).iter().enumerate().all(|(i, &v)| v == 3000 + i as u32);
    let live = pool.usage()?;
    drop(bufs);
    stream.synchronize()?;
    let after = pool.usage()?;
    println!(
        "  pool: exportable {exportable}, release threshold {} MiB",
        pool.release_threshold()? / MIB as u64
    );
    println!(
        "  with 16 x 4 MiB live: used {} MiB, reserved {} MiB; kernel check {}",
        live.used_current / MIB as u64,
        live.reserved_current / MIB as u64,
        if ok { "passed" } else { "FAILED" }
    );
    println!(
        "  after free + synchronize: used {} MiB, reserved {} MiB (kept up to the threshold), peak used {} MiB",
        after.used_current / MIB as u64,
        after.reserved_current / MIB as u64,
        after.used_high / MIB as u64
    );
    pool.trim_to(0)?;
    println!(
        "  after trim_to(0): reserved {} MiB",
        pool.usage()?.reserved_current / MIB as u64
    );
    if !ok {
        return Err(mempool::Error::InvalidArgument("kernel check failed".into()));
    }
    Ok(())
}

fn main() -> ExitCode {
    let devices = match mempool::core::require_gpus(1) {
        Ok(devices) => devices,
        Err(missing) => return missing.exit("pool_report"),
    };
    match mempool::core::driver_version() {
        Ok(v) => println!("CUDA driver {v}; {} device(s)", devices.len()),
        Err(e) => {
            eprintln!("pool_report: {e}");
            return ExitCode::FAILURE;
        }
    }
    for dev in devices {
        if let Err(e) = report(dev) {
            eprintln!("pool_report: {dev}: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
