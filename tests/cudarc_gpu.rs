//! GPU tests of the cudarc interop (docs/cudarc.md): cudarc's streams and contexts in mempool, mempool's
//! streams in cudarc, cudarc's copies and a kernel over `CudarcBuffer`s, cross-stream ordering, and a
//! mempool pool as the current pool under cudarc's own allocations.
//! `cargo test --features gpu --test cudarc_gpu`.
#![cfg(feature = "gpu")]

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::core::{take_drop_errors, Context, Device, Error, MemPool, PoolProps, Stream, StreamRef};
use mempool::rmm::containers::{CudarcBuffer, DeviceBuffer};
use mempool::rmm::{AsyncResource, SharedResource};

const PTX: &str = include_str!("../examples/cudarc_kernels.ptx");
const MIB: usize = 1 << 20;

/// The tests run one at a time: one of them makes a pool the device's current pool, which is
/// process-wide and would catch the other tests' cudarc allocations.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn device() -> Device {
    Device::get(0).expect("GPU tests need a CUDA device")
}

fn cuda() -> Arc<CudaContext> {
    device()
        .context()
        .unwrap()
        .to_cudarc()
        .expect("cudarc's context of device 0")
}

/// A resource over a pool of its own, and the pool's usage can be read through `resource.pool()`.
fn resource() -> (Arc<AsyncResource>, SharedResource) {
    let r = Arc::new(AsyncResource::from_pool(MemPool::new(&device(), &PoolProps::new()).unwrap()).unwrap());
    (r.clone(), r)
}

fn assert_no_drop_errors(what: &str) {
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "{what}: errors recorded in drops: {errors:?}");
}

#[test]
fn cudarc_contexts_map_to_the_primary_context_and_non_primary_ones_are_refused() {
    let _s = serial();
    let ctx = device().context().unwrap();
    let cuda = CudaContext::new(0).unwrap();
    assert_eq!(
        cuda.cu_ctx(),
        ctx.as_raw(),
        "cudarc's CudaContext::new is the primary context"
    );
    assert!(Arc::ptr_eq(&Context::from_cudarc(&cuda).unwrap(), &ctx));

    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let err = Context::from_cudarc(&other).unwrap_err();
    assert_eq!(err, Error::NotPrimaryContext { ordinal: 0 }, "{err}");
    let stream = other.new_stream().unwrap();
    let view = StreamRef::from(&stream);
    assert!(view.context().is_none(), "a non-primary stream's view knows no context");
    assert_eq!(view.as_raw(), stream.cu_stream());
    let err = Stream::from_cudarc(stream.clone()).unwrap_err();
    assert_eq!(err, Error::NotPrimaryContext { ordinal: 0 }, "{err}");
    let mine = Stream::new(&ctx).unwrap();
    // SAFETY: the call fails (wrong context) before anything is wrapped.
    #[allow(unsafe_code)]
    let err = unsafe { mine.borrow_for_cudarc(&other) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // A CudarcBuffer on a non-primary stream is refused: its frees would be ordered on nothing.
    let (_pool, mr) = resource();
    let err = CudarcBuffer::<u32>::alloc_zeros(16, &stream, mr).unwrap_err();
    assert!(err.to_string().contains("non-primary"), "{err}");
    drop(stream);
    drop(other);
    assert_no_drop_errors("non-primary context");
}

#[test]
fn a_cudarc_stream_is_a_stream_ref_for_pool_allocations() {
    let _s = serial();
    let dev = device();
    let ctx = dev.context().unwrap();
    let cuda = cuda();
    let stream = cuda.new_stream().unwrap();
    let view: StreamRef<'_> = (&stream).into();
    assert_eq!(view.as_raw(), stream.cu_stream());
    assert!(Arc::ptr_eq(
        view.context().expect("a primary stream's view knows its context"),
        &ctx
    ));
    assert_eq!(StreamRef::from(&*cuda.default_stream()), StreamRef::LEGACY);
    assert_eq!(StreamRef::from(&*cuda.per_thread_stream()), StreamRef::PER_THREAD);

    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    let buf = pool.alloc(data.len(), (&stream).into()).unwrap();
    buf.copy_from_host(0, &data).unwrap();
    assert_eq!(buf.to_host().unwrap(), data);
    drop(buf);
    // A DeviceBuffer needs the view's context: a cudarc stream of the primary context has it.
    let (_, mr) = resource();
    let dbuf = DeviceBuffer::from_host(&data, &stream, mr).unwrap();
    assert_eq!(dbuf.to_host().unwrap(), data);
    drop(dbuf);
    stream.synchronize().unwrap();
    assert_no_drop_errors("cudarc stream as StreamRef");
}

#[test]
fn a_mempool_stream_can_share_a_cudarc_stream_which_cudarc_destroys() {
    let _s = serial();
    let cuda = cuda();
    let cu_stream = cuda.new_stream().unwrap();
    let stream = Stream::from_cudarc(cu_stream.clone()).unwrap();
    assert_eq!(stream.as_raw(), cu_stream.cu_stream());
    assert!(Arc::ptr_eq(stream.cudarc_stream().unwrap(), &cu_stream));
    drop(cu_stream);
    // The mempool side keeps cudarc's stream alive on its own.
    let (_, mr) = resource();
    let data = vec![0x5au8; 1 << 16];
    let buf = DeviceBuffer::from_host(&data, &stream, mr).unwrap();
    assert_eq!(buf.to_host().unwrap(), data);
    drop(buf);
    stream.synchronize().unwrap();
    drop(stream);
    assert_no_drop_errors("cudarc-backed Stream");
    cuda.check_err()
        .expect("cudarc recorded no error destroying the stream");
}

#[test]
fn mempool_streams_work_in_cudarc() {
    let _s = serial();
    let ctx = device().context().unwrap();
    let (_, mr) = resource();
    let data: Vec<u32> = (0..10_000).collect();

    // Made through cudarc: both sides share it, safely.
    let shared = Stream::new_cudarc(&ctx).unwrap();
    let cu = shared
        .cudarc_stream()
        .expect("new_cudarc shares cudarc's stream")
        .clone();
    assert_eq!(cu.cu_stream(), shared.as_raw());
    let buf = CudarcBuffer::from_host(&data, &cu, mr.clone()).unwrap();
    assert_eq!(cu.clone_dtoh(&buf).unwrap(), data);
    drop(buf);
    drop(cu);
    shared.synchronize().unwrap();
    drop(shared);

    // A stream mempool made alone, lent to cudarc (unsafe: the wrapper must not outlive it).
    let cuda = ctx.to_cudarc().unwrap();
    let mine = Stream::new(&ctx).unwrap();
    {
        // SAFETY: the wrapper and the buffer on it are dropped at the end of this block, before `mine`;
        // everything here runs on that one stream.
        #[allow(unsafe_code)]
        let lent = unsafe { mine.borrow_for_cudarc(&cuda) }.unwrap();
        assert_eq!(lent.cu_stream(), mine.as_raw());
        let buf = CudarcBuffer::from_host(&data, &lent, mr.clone()).unwrap();
        assert_eq!(lent.clone_dtoh(&buf).unwrap(), data);
    }
    mine.synchronize().unwrap();
    drop(mine);
    assert_no_drop_errors("mempool streams in cudarc");
}

#[test]
fn cudarc_copies_work_on_mempool_buffers() {
    let _s = serial();
    let cuda = cuda();
    let stream = cuda.new_stream().unwrap();
    let (resource, mr) = resource();
    let n = 100_000usize;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();

    let src = CudarcBuffer::from_host(&data, &stream, mr.clone()).unwrap();
    assert_eq!((src.len(), src.num_bytes()), (n, n * 4));
    let mut dst = CudarcBuffer::<f32>::alloc_zeros(n, &stream, mr.clone()).unwrap();
    assert_eq!(stream.clone_dtoh(&dst).unwrap(), vec![0.0; n], "alloc_zeros");
    assert!(
        resource.pool().usage().unwrap().used_current >= 2 * (n * 4) as u64,
        "the buffers are the pool's memory"
    );
    stream.memcpy_dtod(&src, &mut dst).unwrap();
    let mut back = vec![0.0f32; n];
    stream.memcpy_dtoh(&dst, &mut back).unwrap();
    assert_eq!(back, data, "htod, dtod, dtoh");

    // Slices: overwrite 10..20 of dst, read 5..25 back.
    let patch = vec![-1.0f32; 10];
    stream.memcpy_htod(&patch, &mut dst.slice_mut(10..20).unwrap()).unwrap();
    let mid = stream.clone_dtoh(&dst.slice(5..25).unwrap()).unwrap();
    let mut expect = data[5..25].to_vec();
    expect[5..15].fill(-1.0);
    assert_eq!(mid, expect, "views");
    assert!(dst.slice(0..n + 1).is_none() && dst.slice_mut(n..).unwrap().is_empty());

    // A DeviceBuffer (allocated on a mempool stream) taken over without a copy.
    let ctx = device().context().unwrap();
    let other = Stream::new(&ctx).unwrap();
    let words: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let dbuf = DeviceBuffer::from_host(&bytes, &other, mr.clone()).unwrap();
    let addr = dbuf.ptr();
    let typed = CudarcBuffer::<u32>::from_device_buffer(dbuf, &stream).unwrap();
    assert_eq!((typed.addr(), typed.len()), (addr, words.len()), "no copy");
    assert_eq!(stream.clone_dtoh(&typed).unwrap(), words);
    let odd = DeviceBuffer::from_host(&[1u8; 7], &other, mr.clone()).unwrap();
    let err = CudarcBuffer::<u32>::from_device_buffer(odd, &stream).unwrap_err();
    assert!(err.to_string().contains("7 bytes"), "{err}");

    drop((src, dst, typed));
    stream.synchronize().unwrap();
    other.synchronize().unwrap();
    assert_eq!(
        resource.pool().usage().unwrap().used_current,
        0,
        "every buffer went back to the pool"
    );
    assert_no_drop_errors("copies");
}

#[test]
fn a_cudarc_kernel_runs_over_mempool_buffers() {
    let _s = serial();
    let cuda = cuda();
    let stream = cuda.new_stream().unwrap();
    let (_, mr) = resource();
    let n = 1 << 20;
    let x = CudarcBuffer::from_host(&(0..n).map(|i| i as f32).collect::<Vec<_>>(), &stream, mr.clone()).unwrap();
    let mut y = CudarcBuffer::from_host(&vec![1.0f32; n], &stream, mr).unwrap();
    let module = cuda.load_module(Ptx::from_src(PTX)).unwrap();
    let saxpy = module.load_function("saxpy").unwrap();
    {
        let (xp, _x_read) = x.device_ptr(&stream);
        let (yp, _y_write) = y.device_ptr_mut(&stream);
        let (a, len) = (3.0f32, n as u64);
        let mut launch = stream.launch_builder(&saxpy);
        launch.arg(&a).arg(&xp).arg(&yp).arg(&len);
        // SAFETY: saxpy(f32, u64, u64, u64) over `n` f32 each; the buffers outlive the kernel.
        #[allow(unsafe_code)]
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }
    let y = stream.clone_dtoh(&y).unwrap();
    let wrong: Vec<usize> = (0..n).filter(|&i| y[i] != 3.0 * i as f32 + 1.0).take(5).collect();
    assert!(
        wrong.is_empty(),
        "first wrong elements {wrong:?}: {:?}",
        wrong.iter().map(|&i| y[i]).collect::<Vec<_>>()
    );
}

/// Launches `spin_ns(ns)` on `stream`: the stream is busy for about `ns` nanoseconds.
fn spin(stream: &Arc<CudaStream>, module: &Arc<cudarc::driver::CudaModule>, ns: u64) {
    let f = module.load_function("spin_ns").unwrap();
    let mut launch = stream.launch_builder(&f);
    launch.arg(&ns);
    // SAFETY: spin_ns(u64) touches no memory.
    #[allow(unsafe_code)]
    unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
}

#[test]
fn uses_on_other_streams_are_ordered_and_the_free_waits_for_them() {
    let _s = serial();
    let cuda = cuda();
    let (s1, s2) = (cuda.new_stream().unwrap(), cuda.new_stream().unwrap());
    assert!(
        cuda.is_managing_stream_synchronization(),
        "cudarc tracks events once it made a stream"
    );
    let module = cuda.load_module(Ptx::from_src(PTX)).unwrap();
    let (resource, mr) = resource();
    let n = 4 * MIB / 4;
    let first: Vec<u32> = (0..n as u32).collect();

    // A read on s2 waits for a write queued on s1 behind 200 ms of work. The write is a device-to-device
    // copy: a copy from pageable host memory may block the host until the stream reaches it, which would
    // order the read without any event.
    let src = CudarcBuffer::from_host(&first, &s1, mr.clone()).unwrap();
    let mut buf = CudarcBuffer::<u32>::alloc_zeros(n, &s1, mr.clone()).unwrap();
    s1.synchronize().unwrap();
    spin(&s1, &module, 200_000_000);
    s1.memcpy_dtod(&src, &mut buf).unwrap();
    assert_eq!(s2.clone_dtoh(&buf).unwrap(), first, "s2 read before s1's write landed");
    drop(src);

    // The free waits for a read on s2 queued behind 200 ms of work: memory the pool hands out again on
    // s1 right after the drop and overwrites there must not reach that read.
    let mut copy = CudarcBuffer::<u32>::alloc_zeros(n, &s2, mr.clone()).unwrap();
    s2.synchronize().unwrap();
    spin(&s2, &module, 200_000_000);
    s2.memcpy_dtod(&buf, &mut copy).unwrap();
    let freed = buf.addr();
    drop(buf);
    let reuse = CudarcBuffer::<u32>::alloc_zeros(n, &s1, mr.clone()).unwrap();
    let reused = reuse.addr() == freed;
    s1.synchronize().unwrap();
    assert_eq!(
        s2.clone_dtoh(&copy).unwrap(),
        first,
        "the read on s2 saw memory freed under it (reused at once: {reused})"
    );
    drop((copy, reuse));
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(resource.pool().usage().unwrap().used_current, 0);
    assert_no_drop_errors("cross-stream ordering");
}

#[test]
fn a_current_mempool_pool_serves_cudarcs_own_allocations() {
    let _s = serial();
    let dev = device();
    let cuda = cuda();
    assert!(
        cuda.has_async_alloc(),
        "cudarc allocates with cuMemAllocAsync on this device"
    );
    let stream = cuda.new_stream().unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let before = pool.usage().unwrap();
    let size = 32 * MIB;
    {
        let _current = pool.make_current().unwrap();
        assert_eq!(dev.current_pool().unwrap().as_raw(), pool.as_raw());
        let slice = stream.alloc_zeros::<u8>(size).unwrap();
        let during = pool.usage().unwrap();
        assert!(
            during.used_current >= before.used_current + size as u64,
            "cudarc's alloc_zeros({size}) is not in the current pool: before {before:?}, during {during:?}"
        );
        drop(slice);
        stream.synchronize().unwrap();
        let after = pool.usage().unwrap();
        assert_eq!(
            after.used_current, before.used_current,
            "cudarc's free returned the memory to the pool: before {before:?}, after {after:?}"
        );
    }
    assert_ne!(
        dev.current_pool().unwrap().as_raw(),
        pool.as_raw(),
        "the guard restored the previous pool"
    );
    // With the previous pool current again, cudarc's allocations leave this pool alone.
    let slice = stream.alloc_zeros::<u8>(size).unwrap();
    assert_eq!(pool.usage().unwrap().used_current, before.used_current);
    drop(slice);
    stream.synchronize().unwrap();
    cuda.check_err().unwrap();
}
