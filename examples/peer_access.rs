//! Multi-GPU: a pool on device 0 is granted to device 1; a buffer written on device 0 is read on
//! device 1 by a kernel through the pool's mapping (no host copy), then access is revoked.
//!
//! Needs two peer-capable GPUs; with fewer it says why and exits with status 2.
//! Run: `cargo run --release --example peer_access`

use std::process::ExitCode;

use mempool::core::kernels::{u32s, CheckKernels};
use mempool::core::{Access, Device, MemPool, MissingGpus, PoolProps, Stream};

fn run(d0: Device, d1: Device) -> mempool::Result<bool> {
    let (ctx0, ctx1) = (d0.context()?, d1.context()?);
    let (s0, s1) = (Stream::new(&ctx0)?, Stream::new(&ctx1)?);
    let (k0, k1) = (CheckKernels::load(&ctx0)?, CheckKernels::load(&ctx1)?);

    let pool = MemPool::new(&d0, &PoolProps::new())?;
    let n = 1 << 24; // 64 MiB of u32
    let src = pool.alloc(n * 4, s0.as_ref())?;
    // SAFETY: `src` holds n u32s on s0.
    unsafe { k0.iota(src.ptr(), n, 7, s0.as_ref())? };
    s0.synchronize()?;

    println!("device 1's access before the grant: {:?}", pool.access(&d1)?);
    pool.grant_access(&d1)?;
    println!("device 1's access after the grant:  {:?}", pool.access(&d1)?);

    let dst = d1.default_pool()?.alloc(n * 4, s1.as_ref())?;
    // SAFETY: both hold n u32s; `src` is complete and mapped for device 1.
    unsafe { k1.copy(dst.ptr(), src.ptr(), n, s1.as_ref())? };
    let mut host = vec![0u8; n * 4];
    dst.copy_to_host(0, &mut host)?;
    let ok = u32s(&host).iter().enumerate().all(|(i, &v)| v == 7 + i as u32);
    println!(
        "device 1 read {} MiB of device 0's pool through the mapping: {}",
        (n * 4) >> 20,
        if ok { "intact" } else { "CORRUPT" }
    );

    pool.revoke_access(&d1)?;
    assert_eq!(pool.access(&d1)?, Access::None);
    println!("device 1's access after the revoke: {:?}", pool.access(&d1)?);
    drop(dst);
    drop(src);
    s1.synchronize()?;
    s0.synchronize()?;
    Ok(ok)
}

fn main() -> ExitCode {
    let (d0, d1) = match mempool::core::require_gpus(2) {
        Ok(devices) => (devices[0], devices[1]),
        Err(missing) => return missing.exit("peer_access"),
    };
    match d1.can_access_peer(d0) {
        Ok(true) => {}
        Ok(false) => {
            return MissingGpus::new(2, "device 1 cannot access device 0's memory (no peer capability)")
                .exit("peer_access")
        }
        Err(e) => {
            eprintln!("peer_access: {e}");
            return ExitCode::FAILURE;
        }
    }
    match run(d0, d1) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("peer_access: device 1 read corrupt data");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("peer_access: {e}");
            ExitCode::FAILURE
        }
    }
}
