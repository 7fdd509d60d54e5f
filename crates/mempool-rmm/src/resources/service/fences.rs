//! What a [`ServiceResource`](super::resource::ServiceResource) waits for before it unmaps memory of a tag:
//! the frees still in flight. A free on stream `S` returns a block while work queued on `S` before the free
//! may still use it (the stream contract), so before a chunk of the tag is unmapped (sleep, the watermark's
//! reclaim, `trim`, the resource's drop) that work must be done. [`Fences`] keeps, per tag, an event for
//! each stream that freed into it, re-recorded at each free on that stream: waiting for them all
//! (host-synchronizing the events) waits for every use of every block freed into the tag, and for nothing
//! else: not the other tags' work, not the rest of the context's.
//!
//! The same wait stands in for the engine's `synchronize` of a stored stream ([`RegionStreams`]), which
//! `CudaStreams` does as a wait for the whole context.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use mempool_core::{Context, Event, EventFlags, StreamRef};
use mempool_suballoc::{self as suballoc, StreamOrder};

use crate::resources::suballoc::{CudaStreams, StreamKey};

/// `CU_STREAM_LEGACY`: the legacy default stream, like the handle 0.
const STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's own default stream.
const STREAM_PER_THREAD: usize = 0x2;

/// Events kept for reuse after a wait, at most (creating an event is a driver call).
const SPARE_MAX: usize = 16;

/// Streams tracked before completed events are dropped from the table (then twice the number left).
const PRUNE_FROM: usize = 32;

/// How the fences name a stream.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum FenceKey {
    /// The legacy default stream (handle 0, or `CU_STREAM_LEGACY`): it lives as long as its context, so
    /// it is recorded when the fences are waited for rather than at each free (no driver call per free,
    /// the common case of PyTorch's and Python's default stream). An event on the legacy stream also
    /// stands for the work queued before it on the context's blocking streams (those made without
    /// `NON_BLOCKING`), so that wait may cover more than the frees, never less.
    Legacy,
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`) of one thread: the handle names the calling
    /// thread's own stream, so the thread is part of the name.
    PerThread(ThreadId),
    /// Any other stream, by its handle. A handle is not reused while the stream it named has work left:
    /// the driver releases a destroyed stream's resources once its work is done (`cuStreamDestroy`), so
    /// re-recording the event of a reused handle loses nothing.
    Handle(usize),
}

impl FenceKey {
    /// The key of the stream with raw handle `raw`, freeing on the calling thread.
    pub(crate) fn of(raw: usize) -> FenceKey {
        match raw {
            0 | STREAM_LEGACY => FenceKey::Legacy,
            STREAM_PER_THREAD => FenceKey::PerThread(std::thread::current().id()),
            h => FenceKey::Handle(h),
        }
    }
}

#[derive(Default)]
struct FenceState {
    /// Per stream that freed since the last wait, an event recorded at its latest free.
    events: HashMap<FenceKey, Event>,
    /// The legacy default stream freed since the last wait (recorded at the wait).
    legacy: bool,
    /// A free whose event could not be made or recorded: only a wait for the whole context covers it.
    unknown: bool,
    /// Events of an earlier wait, complete, for reuse.
    spare: Vec<Event>,
    /// Table size at which completed events are pruned.
    prune_at: usize,
}

impl FenceState {
    fn is_clear(&self) -> bool {
        self.events.is_empty() && !self.legacy && !self.unknown
    }

    /// Drops the events that are complete (to the spare list): what they stand for is done. Errors count as
    /// not complete.
    fn prune(&mut self) {
        let done: Vec<FenceKey> = self
            .events
            .iter()
            .filter(|(_, e)| matches!(e.is_complete(), Ok(true)))
            .map(|(k, _)| *k)
            .collect();
        for k in done {
            if let Some(e) = self.events.remove(&k) {
                if self.spare.len() < SPARE_MAX {
                    self.spare.push(e);
                }
            }
        }
        self.prune_at = PRUNE_FROM.max(2 * self.events.len());
    }
}

/// The frees in flight of one tag: see the module's documentation.
pub(crate) struct Fences {
    ctx: Arc<Context>,
    state: Mutex<FenceState>,
}

impl std::fmt::Debug for Fences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("Fences")
            .field("streams", &st.events.len())
            .field("legacy", &st.legacy)
            .field("unknown", &st.unknown)
            .finish()
    }
}

impl Fences {
    /// No free in flight; events are made in `ctx`.
    pub(crate) fn new(ctx: &Arc<Context>) -> Fences {
        Fences {
            ctx: ctx.clone(),
            state: Mutex::new(FenceState {
                prune_at: PRUNE_FROM,
                ..FenceState::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A free on `stream` (of the fences' context, or a special handle): from now until the next
    /// [`wait`](Self::wait), the wait covers the work queued on `stream` so far. Never fails: a stream
    /// whose event cannot be recorded makes the next wait one for the whole context.
    pub(crate) fn freed_on(&self, stream: StreamRef<'_>) {
        let key = FenceKey::of(stream.as_raw() as usize);
        let mut st = self.lock();
        if key == FenceKey::Legacy {
            st.legacy = true;
            return;
        }
        if let Some(e) = st.events.get(&key) {
            if e.record(stream).is_err() {
                st.unknown = true;
            }
            return;
        }
        if st.events.len() >= st.prune_at {
            st.prune();
        }
        let event = match st.spare.pop() {
            Some(e) => Ok(e),
            None => Event::new(&self.ctx, EventFlags::DISABLE_TIMING),
        };
        match event.and_then(|e| e.record(stream).map(|()| e)) {
            Ok(e) => {
                st.events.insert(key, e);
            }
            Err(_) => st.unknown = true,
        }
    }

    /// Blocks until every free recorded since the last wait is ordered after its stream's earlier work
    /// (that work is done), then forgets them. On an error nothing is forgotten (the next wait waits again).
    ///
    /// An event that cannot be waited for (one recorded while its stream was being captured into a graph,
    /// an error left by earlier work) and a free whose event could not be recorded are covered by a wait
    /// for the whole context instead (`cuCtxSynchronize`): the one context-wide wait left, kept because
    /// nothing narrower is known to cover that work.
    pub(crate) fn wait(&self) -> mempool_core::Result<()> {
        let mut st = self.lock();
        if st.is_clear() {
            return Ok(());
        }
        if st.legacy {
            // The legacy stream lives as long as the context: recording on it now covers every free on it.
            let legacy = StreamRef::LEGACY.in_context(&self.ctx);
            let event = match st.spare.pop() {
                Some(e) => Ok(e),
                None => Event::new(&self.ctx, EventFlags::DISABLE_TIMING),
            };
            match event.and_then(|e| e.record(legacy).map(|()| e)) {
                Ok(e) => {
                    st.events.insert(FenceKey::Legacy, e);
                }
                Err(_) => st.unknown = true,
            }
            st.legacy = false;
        }
        let mut whole = st.unknown;
        if !whole {
            whole = st.events.values().any(|e| e.synchronize().is_err());
        }
        if whole {
            self.ctx.synchronize()?;
        }
        let FenceState { events, spare, .. } = &mut *st;
        for (_, e) in events.drain() {
            if spare.len() < SPARE_MAX {
                spare.push(e);
            }
        }
        st.unknown = false;
        st.prune_at = PRUNE_FROM;
        Ok(())
    }
}

/// The stream ordering of a tag's engine: `CudaStreams`' events for its hand-offs between streams, and the
/// tag's [`Fences`] where the engine would block on a stream it stored (`synchronize`), which
/// `CudaStreams` does as a wait for the whole context.
#[derive(Debug)]
pub(crate) struct RegionStreams {
    inner: CudaStreams,
    fences: Arc<Fences>,
}

impl RegionStreams {
    pub(crate) fn new(ctx: &Arc<Context>, fences: Arc<Fences>) -> RegionStreams {
        RegionStreams {
            inner: CudaStreams::new(ctx),
            fences,
        }
    }
}

impl StreamOrder for RegionStreams {
    type Stream = StreamKey;
    type Event = Event;

    fn create_event(&self) -> Result<Event, suballoc::Error> {
        self.inner.create_event()
    }

    fn record(&self, event: &mut Event, stream: StreamKey) -> Result<(), suballoc::Error> {
        self.inner.record(event, stream)
    }

    fn wait(&self, stream: StreamKey, event: &Event) -> Result<(), suballoc::Error> {
        self.inner.wait(stream, event)
    }

    /// Waits for the tag's fences, not for `stream` (which may have been destroyed since the engine stored
    /// it) nor for the whole context. The engine blocks here before it hands a block of `stream`'s free
    /// list to another stream, and before it forgets its blocks (its release, on drop); what it needs is
    /// that no work still uses those blocks. Every block in a free list of the tag's engine is address
    /// space no one used (the region's one segment, or what is left of it after a split) or was freed
    /// into the tag by `deallocate`, which marks the free in the fences first: once they are waited for,
    /// every use of every free block of the tag is done.
    fn synchronize(&self, _stream: StreamKey) -> Result<(), suballoc::Error> {
        self.fences.wait().map_err(|e| suballoc::Error::Stream {
            op: "synchronize",
            source: Box::new(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_handles_have_keys_of_their_own() {
        assert_eq!(FenceKey::of(0), FenceKey::Legacy);
        assert_eq!(FenceKey::of(STREAM_LEGACY), FenceKey::Legacy);
        assert_eq!(FenceKey::of(StreamRef::LEGACY.as_raw() as usize), FenceKey::Legacy);
        let here = FenceKey::of(StreamRef::PER_THREAD.as_raw() as usize);
        assert_eq!(here, FenceKey::PerThread(std::thread::current().id()));
        let there = std::thread::spawn(|| FenceKey::of(STREAM_PER_THREAD)).join().unwrap();
        assert_ne!(here, there, "each thread's per-thread stream is a stream of its own");
        assert_eq!(FenceKey::of(0x5555_0000), FenceKey::Handle(0x5555_0000));
    }
}
