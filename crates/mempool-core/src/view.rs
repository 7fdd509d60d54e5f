//! [`BufferView`]: a live device range ordered on a stream, in a context, with the accessors, host
//! copies, range checks and the one release helper that every owning buffer type shares.

use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory;
use crate::stream::{KeptStream, StreamRef};
use crate::types::DeviceAddr;

/// A live device range ordered on a stream, in a context: what every owning buffer type embeds
/// ([`crate::PoolBuffer`] here; the containers and shared buffers of mempool-rmm and mempool-ipc).
///
/// The view gives safe access to the range (its address, length, stream and context; host copies and
/// fills ordered on the stream, with range checks) but does not own the memory: the owner decides how it
/// is freed, and does so through [`BufferView::release_with`], which hands the address out exactly once.
/// Dropping a view frees nothing. An owner usually dereferences to its view, the way a `Vec` does to a
/// slice:
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{Device, MemPool, PoolProps, Stream};
/// let dev = Device::get(0)?;
/// let pool = MemPool::new(&dev, &PoolProps::new())?;
/// let stream = Stream::new(&dev.context()?)?;
/// let buf = pool.alloc(16, stream.as_ref())?; // a PoolBuffer, which derefs to its BufferView
/// buf.fill(0)?;
/// buf.copy_from_host(4, &[1, 2, 3, 4])?;
/// assert_eq!(buf.to_host()?[..8], [0, 0, 0, 0, 1, 2, 3, 4]);
/// assert!(buf.check_range(12, 8).is_err()); // 12..20 is outside 16 bytes
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct BufferView<'s> {
    // Invariants (`new`'s contract): `addr..addr+len` is live memory, reachable from `ctx` by unified
    // addressing, until the owner releases it through `release_with` (which empties the view); work on it
    // is ordered on `stream`, a stream of `ctx` (or a special handle); a null `addr` has `len == 0`. The
    // stream is kept as given, with the thread that gave it when it is the per-thread default stream: on
    // any other thread the view orders its work on the legacy stream (`KeptStream::here`).
    addr: DeviceAddr,
    len: usize,
    stream: KeptStream<'s>,
    ctx: Arc<Context>,
}

impl<'s> BufferView<'s> {
    /// A view of `len` bytes at `addr`, ordered on `stream`. The view's context, bound for its copies
    /// and fills, is the stream's when the stream knows it ([`StreamRef::context`]), else `ctx`.
    ///
    /// # Safety
    /// 1. `addr..addr+len` is memory the driver reaches by unified addressing (device memory of any
    ///    device of this process, an imported or peer allocation, pinned or managed host memory) that
    ///    stays allocated while the view, or the owner that embeds it, can reach it: nothing frees it
    ///    except the owner, through [`BufferView::release_with`] (or after [`BufferView::take`]).
    /// 2. Work on the range is ordered on `stream`: work queued on `stream` from now on may use it (it
    ///    was allocated on `stream`, or the caller ordered its allocation and all other work on it
    ///    before this point of `stream`).
    /// 3. A `stream` that carries no context is a stream of `ctx` or a special handle
    ///    ([`StreamRef::LEGACY`], [`StreamRef::PER_THREAD`]); every `StreamRef` is live for `'s`.
    /// 4. A null `addr` comes with `len == 0` (the empty view, which has nothing to free).
    ///
    /// The per-thread default stream ([`StreamRef::PER_THREAD`]) is the calling thread's: used from
    /// another thread (the view's copies and fills, [`BufferView::stream`], the free an owner makes
    /// through [`BufferView::release_with`]), the view orders its work on the legacy default stream,
    /// which waits for the work queued so far on the creating thread's per-thread stream ([`KeptStream`]).
    #[allow(unsafe_code)]
    pub unsafe fn new(addr: DeviceAddr, len: usize, stream: StreamRef<'s>, ctx: Arc<Context>) -> Self {
        let ctx = stream.context().cloned().unwrap_or(ctx);
        BufferView {
            addr,
            len,
            stream: stream.kept(),
            ctx,
        }
    }

    /// The device address (null for an empty view, and once released).
    pub fn ptr(&self) -> DeviceAddr {
        self.addr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream work on the range is ordered on, as the calling thread names it: the stream given, or
    /// for the per-thread default stream of another thread than the one that made the view, the legacy
    /// default stream (see [`BufferView::new`]).
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream.here()
    }

    /// The context the memory belongs to (bound for every call the view makes).
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Checks that `offset..offset+len` lies inside the view: [`Error::InvalidArgument`] naming the range
    /// and the view's size otherwise (an overflowing range included).
    pub fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        check_range(offset, len, self.len)
    }

    /// Copies `src` to `offset..offset+src.len()` of the range, ordered on the stream, and waits for the
    /// copy. An empty `src` (in range) is a no-op.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `offset..offset+src.len()` lies inside the view (checked), which is live memory of `ctx`
        // ordered on `stream` (`new`'s contract; `s` is ordered after it); `copy_to_device` waits for the copy.
        #[allow(unsafe_code)]
        let copy = |s| unsafe { memory::copy_to_device(&self.ctx, self.addr.offset(offset), src, s) };
        self.stream.order_here(|| Ok(self.ctx.clone()), copy)
    }

    /// Copies `offset..offset+dst.len()` of the range into `dst`, ordered on the stream, and waits for the
    /// copy. An empty `dst` (in range) is a no-op.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `copy_from_host`; `dst` is exclusively borrowed and `copy_to_host` waits.
        #[allow(unsafe_code)]
        let copy = |s| unsafe { memory::copy_to_host(&self.ctx, dst, self.addr.offset(offset), s) };
        self.stream.order_here(|| Ok(self.ctx.clone()), copy)
    }

    /// The whole range, copied to the host (waits for the copy).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// Fills the range with `value`, ordered on the stream (does not wait). An empty view is a no-op.
    pub fn fill(&self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the whole view is live memory of `ctx`, written in `stream`'s order (`new`'s contract; `s`
        // is ordered after it).
        #[allow(unsafe_code)]
        let fill = |s| unsafe { memory::fill_async(&self.ctx, self.addr, value, self.len, s) };
        self.stream.order_here(|| Ok(self.ctx.clone()), fill)
    }

    /// Sets the length (for an owner that resizes within its allocation, like a vector's size within
    /// its capacity).
    ///
    /// # Safety
    /// 1. `addr..addr+len` lies inside the memory the owner holds, as `new`'s point 1 requires of the
    ///    whole view.
    /// 2. If the view's address is null, `len` is 0.
    #[allow(unsafe_code)]
    pub unsafe fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Hands the address and length out without freeing, leaving the view empty (null, 0 bytes): the
    /// caller now owns the memory (for an owner's `into_raw`). A second call returns the null address.
    pub fn take(&mut self) -> (DeviceAddr, usize) {
        let addr = std::mem::replace(&mut self.addr, DeviceAddr::NULL);
        (addr, std::mem::take(&mut self.len))
    }

    /// The one way an owner frees the view's memory: hands the address, length and stream to `free`
    /// exactly once and leaves the view empty
    /// (null, 0 bytes), so that a second call, or the owner's `Drop` calling it again, finds nothing to
    /// free and returns `Ok(())` without calling `free`. An empty view (null address) never calls
    /// `free`.
    ///
    /// No context is bound for `free`: an owner whose free is a driver call binds [`context`](Self::context)
    /// itself (resources bind their own). The view is empty afterwards whatever the outcome: if `free`
    /// fails, the memory is leaked rather than risking a second free.
    ///
    /// The stream handed to `free` is the view's, or, on another thread than the one that made a view of
    /// the per-thread default stream, one ordered after it ([`KeptStream::order_here`]: the legacy stream,
    /// after a synchronize of the context if that thread has ended; a failed synchronize leaks the memory
    /// and returns its error).
    pub fn release_with<E: From<Error>>(
        &mut self,
        free: impl FnOnce(DeviceAddr, usize, StreamRef<'s>) -> Result<(), E>,
    ) -> Result<(), E> {
        let (addr, len) = self.take();
        if addr.is_null() {
            return Ok(());
        }
        let ctx = &self.ctx;
        self.stream.order_here(|| Ok(ctx.clone()), |s| free(addr, len, s))
    }
}

/// `offset..offset+len` inside `size` bytes, or [`Error::InvalidArgument`] naming the range and the size.
pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        Some(end) => Err(Error::InvalidArgument(format!(
            "the range {offset}..{end} ({len} bytes) does not fit a buffer of {size} bytes"
        ))),
        None => Err(Error::InvalidArgument(format!(
            "the range of {len} bytes at offset {offset} overflows (the buffer holds {size} bytes)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn ranges_inside_pass_and_outside_name_range_and_size() {
        assert_eq!(check_range(0, 16, 16), Ok(()));
        assert_eq!(check_range(16, 0, 16), Ok(()));
        assert_eq!(check_range(0, 0, 0), Ok(()));
        assert_eq!(
            check_range(12, 8, 16).unwrap_err().to_string(),
            "invalid argument: the range 12..20 (8 bytes) does not fit a buffer of 16 bytes"
        );
        assert_eq!(
            check_range(17, 0, 16).unwrap_err().to_string(),
            "invalid argument: the range 17..17 (0 bytes) does not fit a buffer of 16 bytes"
        );
        assert_eq!(
            check_range(usize::MAX, 2, 16).unwrap_err().to_string(),
            format!(
                "invalid argument: the range of 2 bytes at offset {} overflows (the buffer holds 16 bytes)",
                usize::MAX
            )
        );
    }

    /// A view of a made-up address: nothing here reaches the memory (range checks and refused copies
    /// fail before any driver call; the release is handed to a closure that only records it).
    fn fake_view(len: usize) -> BufferView<'static> {
        // SAFETY: the address is never dereferenced: the tests below only check ranges, make copies that
        // the range check refuses, and release through closures that do not touch the memory.
        #[allow(unsafe_code)]
        unsafe {
            BufferView::new(
                DeviceAddr(0x7000_0000),
                len,
                StreamRef::LEGACY,
                Context::unretained_for_tests(0),
            )
        }
    }

    #[test]
    fn accessors_and_refused_copies() {
        let view = fake_view(64);
        assert_eq!(view.ptr(), DeviceAddr(0x7000_0000));
        assert_eq!((view.len(), view.is_empty()), (64, false));
        assert_eq!(view.stream(), StreamRef::LEGACY);
        assert_eq!(view.context().device().ordinal(), 0);
        assert_eq!(view.check_range(60, 4), Ok(()));
        let e = view.copy_from_host(60, &[0; 8]).unwrap_err();
        assert_eq!(
            e,
            Error::InvalidArgument("the range 60..68 (8 bytes) does not fit a buffer of 64 bytes".into())
        );
        let mut big = [0u8; 65];
        assert!(matches!(view.copy_to_host(0, &mut big), Err(Error::InvalidArgument(_))));
        // Empty copies inside the range are no-ops that never reach the driver.
        assert_eq!(view.copy_from_host(64, &[]), Ok(()));
        assert_eq!(view.copy_to_host(0, &mut []), Ok(()));
    }

    #[test]
    fn release_hands_the_address_out_once() {
        let mut view = fake_view(64);
        let calls = Cell::new(0);
        let free = |addr: DeviceAddr, len: usize, stream: StreamRef<'_>| -> Result<()> {
            assert_eq!((addr, len, stream), (DeviceAddr(0x7000_0000), 64, StreamRef::LEGACY));
            calls.set(calls.get() + 1);
            Ok(())
        };
        // Binding the unretained context fails without a driver (`free` is not called then) and succeeds
        // where none is current; either way the view is empty afterwards and `free` ran at most once.
        let first = view.release_with(free);
        assert!(view.ptr().is_null() && view.is_empty());
        assert_eq!(calls.get(), if first.is_ok() { 1 } else { 0 });
        assert_eq!(view.release_with(free), Ok(()));
        assert!(calls.get() <= 1);
        let mut view = fake_view(8);
        assert_eq!(view.take(), (DeviceAddr(0x7000_0000), 8));
        assert_eq!(view.take(), (DeviceAddr::NULL, 0));
        assert_eq!(view.release_with(free), Ok(()));
        assert!(calls.get() <= 1);
    }

    #[test]
    fn set_len_changes_the_checked_size() {
        let mut view = fake_view(64);
        // SAFETY: 32 bytes lie inside the 64 the (made-up) owner holds.
        #[allow(unsafe_code)]
        unsafe {
            view.set_len(32)
        };
        assert_eq!(view.len(), 32);
        assert!(view.check_range(0, 33).is_err());
    }

    #[test]
    fn a_per_thread_view_released_on_another_thread_frees_on_the_legacy_stream() {
        let ctx = Context::unretained_for_tests(0);
        let view = |stream: StreamRef<'static>| {
            // SAFETY: a made-up range, never touched: released through closures that only look at it.
            #[allow(unsafe_code)]
            unsafe {
                BufferView::new(DeviceAddr(0x7000_0000), 64, stream, ctx.clone())
            }
        };
        let freed_on = |mut v: BufferView<'static>| {
            let mut seen = None;
            let _ = v.release_with(|_, _, s| -> Result<()> {
                seen = Some(s);
                Ok(())
            });
            seen.unwrap()
        };
        let here = view(StreamRef::PER_THREAD);
        assert_eq!(here.stream(), StreamRef::PER_THREAD);
        assert_eq!(
            freed_on(here),
            StreamRef::PER_THREAD,
            "freed by the thread that made it"
        );
        let moved = view(StreamRef::PER_THREAD);
        let legacy = view(StreamRef::LEGACY);
        let (on_other, stream_there, legacy_there) = std::thread::spawn(move || {
            let s = moved.stream();
            (freed_on(moved), s, freed_on(legacy))
        })
        .join()
        .unwrap();
        assert!(
            stream_there.is_legacy() && on_other.is_legacy(),
            "{stream_there:?} {on_other:?}"
        );
        assert_eq!(legacy_there, StreamRef::LEGACY);
    }
}
