//! A guard of `MemPool::make_current` passed to `mem::forget`, then the pool's value dropped: the pool
//! stays alive and current for the rest of the process, so the test has a binary of its own.
#![cfg(feature = "gpu")]

use mempool_core::{Device, MemPool, PoolProps, Stream};

const MIB: usize = 1 << 20;

#[test]
fn a_forgotten_guard_leaves_a_live_pool_current() {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().unwrap();
    let pool = MemPool::new(&dev, &PoolProps::new()).unwrap();
    let raw = pool.as_raw();
    std::mem::forget(pool.make_current().unwrap());
    drop(pool);
    // The leaked activation keeps the pool alive and current; allocating from it works.
    let current = dev.current_pool().unwrap();
    assert_eq!(
        current.as_raw(),
        raw,
        "the forgotten activation's pool is still current"
    );
    let stream = Stream::new(&ctx).unwrap();
    let buf = current.alloc(MIB, stream.as_ref()).unwrap();
    buf.fill(7).unwrap();
    let mut host = vec![0u8; MIB];
    buf.copy_to_host(0, &mut host).unwrap();
    assert!(host.iter().all(|&b| b == 7));
    assert!(current.usage().unwrap().used_current >= MIB as u64);
    drop(buf);
    stream.synchronize().unwrap();
    drop(current);
    // A later activation ends with the leaked pool current again.
    let other = MemPool::new(&dev, &PoolProps::new()).unwrap();
    {
        let _guard = other.make_current().unwrap();
        assert_eq!(dev.current_pool().unwrap().as_raw(), other.as_raw());
    }
    assert_eq!(dev.current_pool().unwrap().as_raw(), raw);
    drop(other);
    assert!(mempool_core::take_drop_errors().is_empty());
}
