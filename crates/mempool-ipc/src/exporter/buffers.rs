//! Shared buffers on the exporter's side: [`ExportedBuffer`], and how buffers are made
//! ([`alloc`], [`adopt`]) and sent to importers ([`share`]). The public methods of
//! [`Exporter`](crate::Exporter) call these.

use std::fmt;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use mempool_core::{memory, BufferView, DeviceAddr, StreamRef};

use super::state::{BlockRecord, FreeFn, Freer, Inner, Shared, State};
use crate::error::{record_drop_error, Error, Result};
use crate::lease::{ImporterId, LeaseError};
use crate::protocol::{BlockId, BufferDescriptor, BufferId, EventHandle, Message, PointerDescriptor, CAP_FAST_RELEASE};
use crate::trace::{self, Point};

/// A buffer the exporter can share, ordered on a stream like a
/// [`PoolBuffer`](mempool_core::PoolBuffer). Made by [`Exporter::alloc`](crate::Exporter::alloc)
/// and [`Exporter::adopt`](crate::Exporter::adopt).
///
/// Dropping it is the exporter's own release: the memory is freed on its stream at once if no
/// importer holds it, otherwise after the last importer releases it (on the exporter's internal
/// stream, ordered after the work queued on this buffer's stream before the drop).
pub struct ExportedBuffer<'s> {
    inner: Arc<Inner>,
    id: BufferId,
    /// The range; empty once the owner's release was handed to the exporter (by `release` or drop).
    view: BufferView<'s>,
}

impl fmt::Debug for ExportedBuffer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedBuffer")
            .field("id", &self.id)
            .field("view", &self.view)
            .finish()
    }
}

impl<'s> std::ops::Deref for ExportedBuffer<'s> {
    type Target = BufferView<'s>;

    /// The buffer's range: address, size, stream, context, host copies and fills.
    fn deref(&self) -> &BufferView<'s> {
        &self.view
    }
}

impl<'s> ExportedBuffer<'s> {
    /// The buffer's id (what importers release).
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The importers holding the buffer now, in id order.
    pub fn holders(&self) -> Vec<ImporterId> {
        self.inner.lock().leases.holders(self.id).collect()
    }

    /// Waits until no importer holds the buffer (each released it, said `Goodbye` or died).
    /// Work queued on the buffer's stream after this returns runs after their work on it: a
    /// version-1 importer synchronizes before it releases, a dead importer's process is gone,
    /// and for an importer on the fast release path (which releases before its GPU work is done)
    /// this makes the buffer's stream wait on its release event. Host reads that synchronize
    /// the stream (`copy_to_host`) see their writes. [`Error::WaitTimeout`] after `timeout`.
    pub fn wait_released(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start + timeout;
        // First a spin (`Exporter::set_wait_spin`) on a slot of this wait's own: a release that
        // comes within it costs no wake-up, and other buffers' releases do not disturb it.
        let spin_until = start + self.inner.wait_spin().min(timeout);
        let mut state = self.inner.lock();
        while state.leases.holders(self.id).next().is_some() {
            let id = self.id;
            if Instant::now() >= deadline {
                return Err(Error::WaitTimeout {
                    what: format!("importers to release buffer {id}"),
                });
            }
            let slot = state.release_waiters.register(id);
            drop(state);
            // Signalled or not, the lease table says whether the buffer is released.
            let _ = slot.wait(spin_until, deadline);
            state = self.inner.lock();
            // Still registered if nobody signalled it (a signal takes the slot out first).
            state.release_waiters.cancel(&slot);
        }
        trace::mark(Point::ExporterWoke, self.id.0);
        let waits = state
            .leases
            .get(self.id)
            .map(|s| s.release_waits.clone())
            .unwrap_or_default();
        drop(state);
        for event in &waits {
            self.view.stream().wait(event)?;
        }
        trace::mark(Point::ExporterWaitDone, self.id.0);
        Ok(())
    }

    /// Lets go of the buffer (what dropping does) and reports errors instead of recording them.
    pub fn release(mut self) -> Result<()> {
        self.release_once()
    }

    /// Hands the owner's release to the exporter once (the view is empty afterwards); the exporter frees
    /// the memory when the last holder lets go.
    fn release_once(&mut self) -> Result<()> {
        let (inner, id) = (&self.inner, self.id);
        self.view.release_with(|_, _, stream| inner.release_owner(id, stream))
    }
}

impl Drop for ExportedBuffer<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release_once() {
            record_drop_error(e);
        }
    }
}

/// [`Exporter::alloc`](crate::Exporter::alloc).
pub(super) fn alloc<'s>(inner: &Arc<Inner>, bytes: usize, stream: StreamRef<'s>) -> Result<ExportedBuffer<'s>> {
    if bytes == 0 {
        return Err(mempool_core::Error::InvalidArgument("a shared buffer cannot be empty".into()).into());
    }
    let ptr = inner.source.pool().allocate(bytes, stream)?;
    let mut state = inner.lock();
    let block_base = ptr.as_raw();
    let id = BlockId(state.next_block);
    state.next_block += 1;
    state.blocks.insert(
        block_base,
        BlockRecord {
            id,
            size: bytes as u64,
            pointer: None,
            live: 1,
        },
    );
    // SAFETY: (1) `ptr..ptr+bytes` was just allocated from the exporter's pool, in `inner.ctx`, and
    // nothing else holds it; (2) `Freer::Pool` frees it to that pool, where it came from; (3) the
    // allocation is ordered on `stream`.
    #[allow(unsafe_code)]
    unsafe {
        register(inner, state, ptr, bytes, block_base, Freer::Pool, stream)
    }
}

/// [`Exporter::adopt`](crate::Exporter::adopt).
///
/// # Safety
/// [`Exporter::adopt`](crate::Exporter::adopt)'s contract, which its caller keeps:
/// 1. `ptr..ptr+len` is memory the caller owns and hands over: from now on nothing uses or frees it
///    except through the returned buffer and through `free`.
/// 2. Work on it is ordered on `stream`.
/// 3. `free(ptr, len, s)`, called once, returns exactly this memory to its owner, ordered on `s`.
#[allow(unsafe_code)]
pub(super) unsafe fn adopt<'s, F, E>(
    inner: &Arc<Inner>,
    ptr: DeviceAddr,
    len: usize,
    stream: StreamRef<'s>,
    free: F,
) -> Result<ExportedBuffer<'s>>
where
    F: FnOnce(DeviceAddr, usize, StreamRef<'_>) -> std::result::Result<(), E> + Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    let not_shareable = |reason: String| Error::NotShareable {
        ptr: ptr.as_raw(),
        len,
        reason,
    };
    if ptr.is_null() || len == 0 {
        return Err(not_shareable(
            "a shared buffer needs an address and at least one byte".into(),
        ));
    }
    let end = ptr
        .as_raw()
        .checked_add(len as u64)
        .ok_or_else(|| not_shareable("the range overflows".into()))?;
    let known = {
        let state = inner.lock();
        find_block(&state, ptr.as_raw(), end)
    };
    let (base, size) = match known {
        Some(block) => block,
        None => {
            let (base, size) = memory::address_range(&inner.ctx, ptr)
                .map_err(|e| not_shareable(format!("the driver does not know the address: {e}")))?;
            let owner = memory::pool_of(base)?;
            if owner != inner.source.pool().as_raw() {
                return Err(not_shareable(
                    "the allocation that contains it does not come from the exporter's pool".into(),
                ));
            }
            if end > base.as_raw() + size as u64 {
                return Err(not_shareable(format!(
                    "it runs past the end of its allocation ({base} + {size} bytes)"
                )));
            }
            (base.as_raw(), size as u64)
        }
    };
    let free: FreeFn = Box::new(move |ptr, len, stream| {
        free(ptr, len, stream).map_err(|e| Error::Free {
            buffer: BufferId(0),
            source: Box::new(e),
        })
    });
    let mut state = inner.lock();
    // Another thread may have registered (or retired) the block meanwhile.
    match state.blocks.get_mut(&base) {
        Some(block) if block.size == size => block.live += 1,
        Some(_) => {
            return Err(not_shareable(
                "its allocation changed while it was being looked up; retry".into(),
            ))
        }
        None => {
            let id = BlockId(state.next_block);
            state.next_block += 1;
            state.blocks.insert(
                base,
                BlockRecord {
                    id,
                    size,
                    pointer: None,
                    live: 1,
                },
            );
        }
    }
    // SAFETY: (1) the range lies in a live allocation of the exporter's pool (checked above, through the
    // driver), in `inner.ctx`, and this function's caller handed it over (its point 1); (2) `free` returns
    // exactly it (its point 3); (3) work on it is ordered on `stream` (its point 2).
    #[allow(unsafe_code)]
    unsafe {
        register(inner, state, ptr, len, base, Freer::Custom(free), stream)
    }
}

/// Records a buffer in a block already recorded, for [`alloc`] and [`adopt`]; or, for
/// `Exporter::alloc_vmm`, a mapped VMM allocation (no block: `block_base` is its address, which no
/// pool block has).
///
/// # Safety
/// The returned buffer reads and writes `ptr..ptr+len` from safe code, here and in importers, and
/// `free` runs once, after the last holder let go:
/// 1. `ptr..ptr+len` is live device memory in `inner.ctx` (of the exporter's pool, in the block at
///    `block_base`, or a VMM mapping with read-write access for the device) that nothing else uses
///    or frees from now on, except through the returned buffer and `free`.
/// 2. `free` frees exactly that memory: `Freer::Pool` only for memory allocated from the exporter's
///    pool; a `Freer::Custom` closure returns it to its owner.
/// 3. Work on it is ordered on `stream`; a stream that carries no context is one of the exporter's
///    context.
#[allow(unsafe_code)]
pub(super) unsafe fn register<'s>(
    inner: &Arc<Inner>,
    mut state: MutexGuard<'_, State>,
    ptr: DeviceAddr,
    len: usize,
    block_base: u64,
    free: Freer,
    stream: StreamRef<'s>,
) -> Result<ExportedBuffer<'s>> {
    let id = BufferId(state.next_buffer);
    state.next_buffer += 1;
    state.leases.insert(
        id,
        Shared {
            ptr,
            len,
            block_base,
            free: Some(free),
            events: Vec::new(),
            last_use: None,
            release_waits: Vec::new(),
        },
    )?;
    // SAFETY: `ptr..ptr+len` is live memory in `inner.ctx` that nothing else uses (this function's
    // point 1); the lease table now holds it, and the exporter frees it (`free`, point 2) only after
    // this buffer's release (`release_once`) and the last importer's, so it stays allocated while the
    // view can reach it; work on it is ordered on `stream` (point 3).
    #[allow(unsafe_code)]
    let view = unsafe { BufferView::new(ptr, len, stream, inner.ctx.clone()) };
    Ok(ExportedBuffer {
        inner: inner.clone(),
        id,
        view,
    })
}

/// [`Exporter::share`](crate::Exporter::share).
pub(super) fn share(inner: &Inner, buffer: &ExportedBuffer<'_>, to: &[ImporterId]) -> Result<()> {
    if to.is_empty() {
        return Ok(());
    }
    let reactor = inner.reactor()?;
    let event = inner.take_event()?;
    event.event.record(buffer.view.stream())?;
    let handle = event.handle;
    let mut state = inner.lock();
    if let Some(importer) = to.iter().find(|i| !state.importers.contains_key(i)) {
        state.idle_events.push(event);
        return Err(Error::UnknownImporter { importer: *importer });
    }
    if let Err(e) = state.grant_all(buffer.id, to) {
        state.idle_events.push(event);
        return Err(e);
    }
    let descriptor = match describe(inner, &mut state, buffer, handle) {
        Ok(descriptor) => descriptor,
        Err(e) => {
            for importer in to {
                let _ = state.leases.revoke(buffer.id, *importer);
            }
            state.idle_events.push(event);
            return Err(e);
        }
    };
    // Importers on the fast release path may keep the block of a suballocated buffer imported:
    // the exporter then keeps the block allocated until they are gone (recorded before the
    // message that allows it goes out).
    let mut keepers = Vec::new();
    if let Some(shared) = state.leases.get_mut(buffer.id) {
        shared.events.push(event);
        if shared.suballocated() {
            let base = shared.block_base;
            for importer in to {
                let fast = state
                    .importers
                    .get(importer)
                    .is_some_and(|p| p.capabilities & CAP_FAST_RELEASE != 0);
                if fast {
                    state.pins.keep(base, *importer);
                    keepers.push(*importer);
                }
            }
        }
    }
    drop(state);

    // Queued, not sent: the serving thread sends each importer's frames as its socket takes
    // them, so an importer that does not read delays nobody else.
    let plain = Message::Buffer(descriptor);
    let kept = Message::Buffer(BufferDescriptor {
        keep_import: true,
        ..descriptor
    });
    let mut first_error = None;
    for importer in to {
        let message = if keepers.contains(importer) { &kept } else { &plain };
        trace::mark(Point::ExporterShared, buffer.id.0);
        if let Err(e) = reactor.send(*importer, message, Some(buffer.id)) {
            // The owner still holds the buffer, so revoking frees nothing. The serving thread
            // may have counted the importer out already (NotLeased): nothing to undo.
            let _ = inner.lock().leases.revoke(buffer.id, *importer);
            first_error.get_or_insert(Error::Share {
                buffer: buffer.id,
                importer: *importer,
                source: Box::new(e),
            });
        }
    }
    if first_error.is_some() {
        // A share undone took holders away: a thread waiting for this buffer's release may be done.
        inner.notify_all_waiters();
    } else {
        inner.notify();
    }
    first_error.map_or(Ok(()), Err)
}

/// The `Buffer` message for `buffer`, exporting its block's pointer on first use.
fn describe(
    inner: &Inner,
    state: &mut State,
    buffer: &ExportedBuffer<'_>,
    event: EventHandle,
) -> Result<BufferDescriptor> {
    let base = state
        .leases
        .get(buffer.id)
        .map(|s| s.block_base)
        .ok_or(LeaseError::UnknownBuffer { buffer: buffer.id })?;
    let block = state
        .blocks
        .get_mut(&base)
        .ok_or(LeaseError::UnknownBuffer { buffer: buffer.id })?;
    let pointer = match block.pointer {
        Some(pointer) => pointer,
        None => {
            let data = inner.source.pool().export_pointer(DeviceAddr(base))?;
            let pointer = PointerDescriptor(data.0);
            block.pointer = Some(pointer);
            pointer
        }
    };
    Ok(BufferDescriptor {
        buffer_id: buffer.id,
        block_id: block.id,
        block_size: block.size,
        offset: buffer.view.ptr().as_raw() - base,
        size: buffer.view.len() as u64,
        pointer,
        ready_event: Some(event),
        keep_import: false,
    })
}

/// The known block that contains `start..end`, as (base, size).
fn find_block(state: &State, start: u64, end: u64) -> Option<(u64, u64)> {
    let (&base, block) = state.blocks.range(..=start).next_back()?;
    (end <= base + block.size).then_some((base, block.size))
}
