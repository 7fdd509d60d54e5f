//! cudarc's NCCL collectives over mempool memory on two GPUs: `Comm::all_reduce` and `Comm::all_gather`
//! between `CudarcBuffer`s allocated by mempool resources, one communicator per GPU in this process.
//! Needs two GPUs and NCCL: cudarc loads `libnccl.so` (or `libnccl.so.<major>`), while pip's
//! nvidia-nccl-cu13 ships only `libnccl.so.2`; point LD_LIBRARY_PATH at a directory with a
//! `libnccl.so -> .../libnccl.so.2` symlink. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
//! `cargo test --features gpu --test two_gpu_cudarc_nccl`.
#![cfg(feature = "gpu")]

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nccl, Comm, ReduceOp};
use mempool::core::Device;
use mempool::rmm::containers::CudarcBuffer;
use mempool::rmm::{AsyncOptions, AsyncResource, SharedResource};

fn setup() -> Vec<(Arc<CudaStream>, SharedResource)> {
    // Never NVLink multicast on the shared machines: set before the CUDA driver or NCCL is loaded.
    // (Edition 2021: `set_var` is safe to call, but racy with other threads' `getenv`.) The only test of
    // this binary calls this first, before any library that could start a thread is loaded, and the
    // harness's main thread only waits for it, so no other thread reads the environment now.
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let count = Device::count().expect("two-GPU tests need the CUDA driver");
    assert!(
        count >= 2,
        "this test needs 2 GPUs, found {count}: run it on the two-GPU machine"
    );
    // SAFETY: only tries to open the library (libloading), calls nothing in it.
    #[allow(unsafe_code)]
    let present = unsafe { cudarc::nccl::sys::is_culib_present() };
    assert!(
        present,
        "NCCL not found: cudarc opens libnccl.so (not libnccl.so.2, the only name pip's nvidia-nccl-cu13 \
         ships); put a libnccl.so -> libnccl.so.2 symlink in a directory on LD_LIBRARY_PATH \
         (LD_LIBRARY_PATH={:?})",
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
    );
    (0..2)
        .map(|i| {
            let dev = Device::get(i).unwrap();
            let stream = dev.context().unwrap().to_cudarc().unwrap().new_stream().unwrap();
            let mr: SharedResource = Arc::new(AsyncResource::new(&dev, AsyncOptions::default()).unwrap());
            (stream, mr)
        })
        .collect()
}

#[test]
fn two_gpu_nccl_all_reduce_and_all_gather_over_mempool_buffers() {
    let gpus = setup();
    let comms = Comm::from_devices(gpus.iter().map(|(s, _)| s.clone()).collect())
        .unwrap_or_else(|e| panic!("ncclCommInitAll over 2 GPUs: {e:?}"));
    let n = 1 << 20;

    // all_reduce(sum): rank r sends r+1 + i/n-ish values; every rank receives the sum.
    let sends: Vec<CudarcBuffer<f32>> = gpus
        .iter()
        .enumerate()
        .map(|(r, (s, mr))| {
            let data: Vec<f32> = (0..n).map(|i| (r + 1) as f32 * 1000.0 + (i % 1000) as f32).collect();
            CudarcBuffer::from_host(&data, s, mr.clone()).unwrap()
        })
        .collect();
    let mut recvs: Vec<CudarcBuffer<f32>> = gpus
        .iter()
        .map(|(s, mr)| CudarcBuffer::alloc_zeros(n, s, mr.clone()).unwrap())
        .collect();
    nccl::group_start().unwrap();
    for ((comm, send), recv) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
        comm.all_reduce(send, recv, &ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("ncclAllReduce on rank {}: {e:?}", comm.rank()));
    }
    nccl::group_end().unwrap();
    for (r, ((s, _), recv)) in gpus.iter().zip(&recvs).enumerate() {
        let got = s.clone_dtoh(recv).unwrap();
        let wrong: Vec<(usize, f32)> = (0..n)
            .filter(|&i| got[i] != 3000.0 + 2.0 * (i % 1000) as f32)
            .take(5)
            .map(|i| (i, got[i]))
            .collect();
        assert!(
            wrong.is_empty(),
            "all_reduce on rank {r}: first wrong (index, value): {wrong:?}"
        );
    }

    // all_gather: rank r contributes m copies of r+7; every rank receives both contributions in rank order.
    let m = 4096;
    let parts: Vec<CudarcBuffer<u32>> = gpus
        .iter()
        .enumerate()
        .map(|(r, (s, mr))| CudarcBuffer::from_host(&vec![r as u32 + 7; m], s, mr.clone()).unwrap())
        .collect();
    let mut gathered: Vec<CudarcBuffer<u32>> = gpus
        .iter()
        .map(|(s, mr)| CudarcBuffer::alloc_zeros(2 * m, s, mr.clone()).unwrap())
        .collect();
    nccl::group_start().unwrap();
    for ((comm, part), all) in comms.iter().zip(&parts).zip(gathered.iter_mut()) {
        comm.all_gather(part, all)
            .unwrap_or_else(|e| panic!("ncclAllGather on rank {}: {e:?}", comm.rank()));
    }
    nccl::group_end().unwrap();
    let mut expect = vec![7u32; m];
    expect.extend(vec![8u32; m]);
    for (r, ((s, _), all)) in gpus.iter().zip(&gathered).enumerate() {
        assert_eq!(s.clone_dtoh(all).unwrap(), expect, "all_gather on rank {r}");
    }
    drop((sends, recvs, parts, gathered));
    for (s, _) in &gpus {
        s.synchronize().unwrap();
    }
    drop(comms);
    let errors = mempool::core::take_drop_errors();
    assert!(errors.is_empty(), "errors recorded in drops: {errors:?}");
}
