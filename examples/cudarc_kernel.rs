//! A cudarc kernel over mempool memory: SAXPY (`y = a*x + y`) launched through cudarc on buffers that a
//! mempool resource allocated (`CudarcBuffer`), copied in and out with cudarc's copies; then a mempool pool
//! made the device's current pool, which reroutes cudarc's own `stream.alloc_zeros` through it. On a machine
//! without a GPU it says why and exits with status 2.
//!
//! Run: `cargo run --release --example cudarc_kernel`

use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::core::{Context, Device, MemPool, PoolProps};
use mempool::rmm::containers::CudarcBuffer;
use mempool::rmm::{AsyncResource, SharedResource};

const PTX: &str = include_str!("cudarc_kernels.ptx");
const MIB: usize = 1 << 20;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn run(dev: Device) -> AnyResult<()> {
    // cudarc's context for the device is the primary context mempool uses too.
    let ctx = dev.context()?;
    let cuda = ctx.to_cudarc()?;
    assert!(Arc::ptr_eq(&Context::from_cudarc(&cuda)?, &ctx));
    let stream = cuda.new_stream()?;

    // Memory from a mempool resource (a pool of its own), in cudarc's clothes.
    let resource = Arc::new(AsyncResource::from_pool(MemPool::new(&dev, &PoolProps::new())?)?);
    let pool = resource.pool();
    let mr: SharedResource = resource.clone();
    let n = 1 << 20;
    let x_host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = CudarcBuffer::from_host(&x_host, &stream, mr.clone())?;
    let mut y = CudarcBuffer::from_host(&vec![1.0f32; n], &stream, mr.clone())?;

    // cudarc's `PushKernelArg` takes its own slice types only, so the kernel gets the buffers' addresses:
    // `device_ptr` / `device_ptr_mut` order the launch after earlier uses of the buffers and record this
    // one when their guards drop, after the launch is queued.
    let module = cuda.load_module(Ptx::from_src(PTX))?;
    let saxpy = module.load_function("saxpy")?;
    {
        let (x_ptr, _x_read) = x.device_ptr(&stream);
        let (y_ptr, _y_write) = y.device_ptr_mut(&stream);
        let (a, len) = (2.0f32, n as u64);
        let mut launch = stream.launch_builder(&saxpy);
        launch.arg(&a).arg(&x_ptr).arg(&y_ptr).arg(&len);
        // SAFETY: `saxpy(f32 a, u64 x, u64 y, u64 n)` matches the four arguments; `x` and `y` hold `n`
        // f32 each and stay alive until the kernel is done (their drops are ordered after it).
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
    }
    let y_host = stream.clone_dtoh(&y)?;
    let wrong = (0..n).filter(|&i| y_host[i] != 2.0 * i as f32 + 1.0).count();
    println!(
        "saxpy over {n} f32 in mempool memory: {wrong} wrong element(s), y[12345] = {}",
        y_host[12345]
    );
    if wrong != 0 {
        return Err(format!("saxpy: {wrong} element(s) differ from 2*i+1").into());
    }
    drop((x, y));
    stream.synchronize()?;

    // A mempool pool as the device's current pool: cudarc's own allocations (cuMemAllocAsync) come from it
    // until the guard restores the previous one.
    let before = pool.usage()?;
    {
        let _current = pool.make_current()?;
        let slice = stream.alloc_zeros::<u8>(64 * MIB)?;
        let during = pool.usage()?;
        println!(
            "cudarc alloc_zeros(64 MiB) with the pool current: pool used {} -> {} MiB",
            before.used_current / MIB as u64,
            during.used_current / MIB as u64
        );
        if during.used_current < before.used_current + 64 * MIB as u64 {
            return Err("cudarc's allocation did not come from the current pool".into());
        }
        drop(slice);
        stream.synchronize()?;
    }
    let after = pool.usage()?;
    println!(
        "after the slice is dropped: pool used {} MiB",
        after.used_current / MIB as u64
    );
    if after.used_current != before.used_current {
        return Err("cudarc's free did not return the memory to the pool".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let devices = match mempool::core::require_gpus(1) {
        Ok(devices) => devices,
        Err(missing) => return missing.exit("cudarc_kernel"),
    };
    match run(devices[0]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cudarc_kernel: {e}");
            ExitCode::FAILURE
        }
    }
}
