//! [`CallbackResource`]: a resource whose allocation and free are closures.

use std::fmt;

use mempool_core::{DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::resource::{MemoryResource, ALIGNMENT};

const NAME: &str = "CallbackResource";

/// Memory handed back to a [`CallbackResource`]'s free callback: the address, the size it was allocated
/// with, and the stream the free is ordered on.
///
/// Only the resource makes one (there is no public constructor, and it is neither `Clone` nor `Copy`):
/// [`CallbackResource::deallocate`], after its caller's contract ([`MemoryResource::deallocate`]'s
/// `# Safety` 1-3), and `allocate`, to hand back at once an address its allocate callback returned
/// misaligned. Either way:
/// 1. [`ptr`](Returned::ptr) was returned by the allocate callback of the resource that calls you, for
///    [`bytes`](Returned::bytes) bytes (the resource keeps zero-byte requests to itself);
/// 2. it has not been returned since;
/// 3. every use of it is ordered before this point of [`stream`](Returned::stream).
///
/// That the free callback may then free it is what [`CallbackResource::new`]'s caller promises.
#[derive(Debug)]
pub struct Returned<'s> {
    ptr: DeviceAddr,
    bytes: usize,
    stream: StreamRef<'s>,
}

impl<'s> Returned<'s> {
    /// The address, as the allocate callback returned it (never null).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// The size the allocate callback was asked for (never 0).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The stream the free is ordered on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream
    }
}

/// A resource whose allocation and free are closures, RMM's `callback_memory_resource`: `allocate(bytes,
/// stream)` calls the allocate callback, `deallocate` calls the free callback with a [`Returned`].
/// Closures capture whatever state they need (RMM's `void*` arguments are not needed).
///
/// The resource keeps the trait's guarantees itself: 0 bytes is the null address without calling back
/// (and freeing null is a no-op); an address that is not [`ALIGNMENT`](crate::ALIGNMENT)-aligned is
/// handed straight back to the free callback and refused with [`Error::Unsupported`]; a null address for
/// a non-zero size is [`Error::OutOfMemory`]. Errors of the callbacks are returned as they are.
///
/// The constructor is `unsafe`, as [`mempool_ipc`'s `Exporter::adopt`] is: the resource cannot tell whether
/// the free callback really owns what the allocate callback returns (a safe closure could be paired with a
/// free callback of another resource), so its caller promises that pairing.
///
/// [`mempool_ipc`'s `Exporter::adopt`]: https://docs.rs/mempool-ipc
///
/// ```
/// use std::sync::Arc;
/// use mempool_core::StreamRef;
/// use mempool_rmm::resources::{CallbackResource, Returned};
/// use mempool_rmm::testing::SimResource;
/// use mempool_rmm::MemoryResource;
///
/// // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
/// let upstream = Arc::new(unsafe { SimResource::new() });
/// let (a, f) = (upstream.clone(), upstream.clone());
/// let free = move |r: Returned<'_>| {
///     // SAFETY: a `Returned` names an address this resource's allocate callback returned, hence one of
///     // `upstream.allocate(bytes)`, returned once, its uses ordered before the stream's point.
///     unsafe { f.deallocate(r.ptr(), r.bytes(), r.stream()) }
/// };
/// // SAFETY: `free` gives back to `upstream` exactly what the allocate callback took from it, with its size,
/// // once per `Returned`.
/// let mr = unsafe { CallbackResource::new(move |bytes, stream| a.allocate(bytes, stream), free) };
/// let p = mr.allocate(1000, StreamRef::LEGACY).unwrap();
/// assert_eq!(upstream.live_allocations(), 1);
/// // SAFETY: `p` came from `mr.allocate(1000, _)` and is freed once; the simulation's memory is never used.
/// unsafe { mr.deallocate(p, 1000, StreamRef::LEGACY) }.unwrap();
/// assert_eq!(upstream.live_allocations(), 0);
/// ```
pub struct CallbackResource<A, F> {
    allocate: A,
    free: F,
}

impl<A, F> CallbackResource<A, F>
where
    A: Fn(usize, StreamRef<'_>) -> Result<DeviceAddr> + Send + Sync,
    F: for<'s> Fn(Returned<'s>) -> Result<()> + Send + Sync,
{
    /// A resource that allocates with `allocate` and frees with `free`.
    ///
    /// # Safety
    /// 1. `free`, given a [`Returned`] (an address `allocate` returned for `bytes`, handed back once, its
    ///    uses ordered before the stream's point), returns exactly that memory to whoever `allocate` took it
    ///    from, and touches nothing else.
    /// 2. `allocate` keeps [`MemoryResource`]'s guarantees 1 and 2: what it returns is null only for 0
    ///    bytes, aligned to [`crate::ALIGNMENT`], memory the driver reaches by unified addressing, and it
    ///    stays allocated, used by nothing else, until `free` is called with it.
    #[allow(unsafe_code)]
    pub unsafe fn new(allocate: A, free: F) -> CallbackResource<A, F> {
        CallbackResource { allocate, free }
    }
}

impl<A, F> fmt::Debug for CallbackResource<A, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME).finish_non_exhaustive()
    }
}

// SAFETY: `CallbackResource::new` is `unsafe`, and its caller promised that `allocate` returns memory meeting the trait's guarantees 1 and 2 and that `free` returns exactly it; `is_equal` is the default identity.
#[allow(unsafe_code)]
unsafe impl<A, F> MemoryResource for CallbackResource<A, F>
where
    A: Fn(usize, StreamRef<'_>) -> Result<DeviceAddr> + Send + Sync,
    F: for<'s> Fn(Returned<'s>) -> Result<()> + Send + Sync,
{
    fn allocate(&self, bytes: usize, stream: StreamRef<'_>) -> Result<DeviceAddr> {
        if bytes == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let ptr = (self.allocate)(bytes, stream)?;
        if ptr.is_null() {
            return Err(Error::OutOfMemory {
                resource: NAME,
                requested: bytes,
            });
        }
        if ptr.0 % ALIGNMENT != 0 {
            // Handed back at once: it came from the allocate callback for `bytes`, was never handed out or
            // used, and nothing is queued on `stream` that names it; the free callback gets it once.
            let _ = (self.free)(Returned { ptr, bytes, stream });
            return Err(Error::Unsupported {
                resource: NAME,
                reason: format!(
                    "the allocate callback returned {ptr} for {bytes} bytes, which is not aligned to \
                     {ALIGNMENT} bytes"
                ),
            });
        }
        Ok(ptr)
    }

    #[allow(unsafe_code)]
    unsafe fn deallocate(&self, ptr: DeviceAddr, bytes: usize, stream: StreamRef<'_>) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        // The caller's obligations 1-3 are what a `Returned` stands for: `ptr` (not null, so not from a
        // zero-byte request) came from this resource's `allocate(bytes, _)`, which handed out only what the
        // allocate callback returned for `bytes`; it is returned once; its uses are ordered before this
        // point of `stream`.
        (self.free)(Returned { ptr, bytes, stream })
    }

    fn name(&self) -> &'static str {
        NAME
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::adaptors::StatisticsAdaptor;
    use crate::testing::SimResource;

    const S: StreamRef<'static> = StreamRef::LEGACY;

    /// A callback resource over a simulated upstream, counting the callbacks' calls.
    fn over_sim(upstream: Arc<SimResource>, calls: Arc<AtomicUsize>) -> impl MemoryResource {
        let (a, f, c) = (upstream.clone(), upstream, calls);
        let alloc = move |bytes: usize, stream: StreamRef<'_>| {
            c.fetch_add(1, Ordering::SeqCst);
            a.allocate(bytes, stream)
        };
        // SAFETY: a `Returned` names an address this resource's allocate callback returned, hence one of
        // `upstream.allocate(bytes)`, handed back once.
        let free = move |r: Returned<'_>| unsafe { f.deallocate(r.ptr(), r.bytes(), r.stream()) };
        // SAFETY: `free` gives back to `upstream` exactly what `alloc` took from it, with its size.
        unsafe { CallbackResource::new(alloc, free) }
    }

    #[test]
    fn allocation_and_free_go_through_the_callbacks() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let upstream = Arc::new(unsafe { SimResource::new() });
        let calls = Arc::new(AtomicUsize::new(0));
        let mr = over_sim(upstream.clone(), calls.clone());
        assert_eq!(mr.name(), "CallbackResource");
        let ps: Vec<_> = (1..=10).map(|i| (mr.allocate(i * 100, S).unwrap(), i * 100)).collect();
        assert_eq!(upstream.live_allocations(), 10);
        assert_eq!(calls.load(Ordering::SeqCst), 10);
        for (p, n) in ps {
            assert_eq!(p.0 % 256, 0);
            // SAFETY: `p` came from `mr.allocate(n, S)` above and is freed once.
            unsafe { mr.deallocate(p, n, S) }.unwrap();
        }
        assert_eq!(upstream.live_allocations(), 0);
    }

    #[test]
    fn zero_bytes_and_null_never_reach_the_callbacks() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let upstream = Arc::new(unsafe { SimResource::new() });
        let calls = Arc::new(AtomicUsize::new(0));
        let mr = over_sim(upstream.clone(), calls.clone());
        assert_eq!(mr.allocate(0, S).unwrap(), DeviceAddr::NULL);
        // SAFETY: null is a no-op by the trait's contract.
        unsafe { mr.deallocate(DeviceAddr::NULL, 0, S) }.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert_eq!(upstream.total_allocations(), 0);
    }

    #[test]
    fn the_callbacks_errors_come_back_as_they_are() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let upstream = Arc::new(unsafe { SimResource::with_capacity(1024) });
        let mr = over_sim(upstream.clone(), Arc::new(AtomicUsize::new(0)));
        let e = mr.allocate(4096, S).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        // A mismatched free reaches the upstream, which refuses it without touching anything.
        let p = mr.allocate(512, S).unwrap();
        // SAFETY: deliberately the wrong size: SimResource checks every free against what it handed out and
        // refuses a mismatch; its addresses are never dereferenced.
        let e = unsafe { mr.deallocate(p, 256, S) }.unwrap_err();
        assert!(matches!(e, Error::InvalidDeallocation { .. }), "{e}");
        // SAFETY: `p` came from `mr.allocate(512, S)` and is freed once (the refused call freed nothing).
        unsafe { mr.deallocate(p, 512, S) }.unwrap();
        assert_eq!(upstream.live_allocations(), 0);
    }

    #[test]
    fn misaligned_and_null_results_are_refused_and_returned() {
        let returned = Arc::new(Mutex::new(Vec::new()));
        let r2 = returned.clone();
        // SAFETY: the addresses are made up and never touched; `free` only records what it is handed.
        let mr = unsafe {
            CallbackResource::new(
                |bytes, _| {
                    Ok(if bytes == 100 {
                        DeviceAddr(0x1010)
                    } else {
                        DeviceAddr::NULL
                    })
                },
                move |r: Returned<'_>| {
                    r2.lock().unwrap().push((r.ptr(), r.bytes()));
                    Ok(())
                },
            )
        };
        let e = mr.allocate(100, S).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported { resource: "CallbackResource", reason } if reason.contains("0x1010")),
            "{e}"
        );
        assert_eq!(
            *returned.lock().unwrap(),
            vec![(DeviceAddr(0x1010), 100)],
            "handed back once"
        );
        assert_eq!(
            mr.allocate(7, S).unwrap_err(),
            Error::OutOfMemory {
                resource: "CallbackResource",
                requested: 7
            }
        );
    }

    #[test]
    fn composes_under_adaptors_and_behind_an_arc() {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let upstream = Arc::new(unsafe { SimResource::new() });
        let stats = StatisticsAdaptor::new(over_sim(upstream.clone(), Arc::new(AtomicUsize::new(0))));
        let shared: crate::resource::SharedResource = Arc::new(stats);
        let p = shared.allocate(300, S).unwrap();
        assert_eq!(upstream.live_allocations(), 1);
        // SAFETY: `p` came from `shared.allocate(300, S)` and is freed once.
        unsafe { shared.deallocate(p, 300, S) }.unwrap();
        assert_eq!(upstream.live_allocations(), 0);
        assert!(format!("{shared:?}").contains("CallbackResource"));
    }
}
