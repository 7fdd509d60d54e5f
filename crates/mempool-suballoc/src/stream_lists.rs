//! Per-stream free lists and the events that hand their blocks to other streams.
//!
//! This is the part of RMM's `stream_ordered_memory_resource` that every engine shares; the engine
//! decides what a "list" is (a size index over the block table for the pool, a stack of addresses for a fixed-size
//! engine) and in which order to try its own list, other lists and the upstream.

use std::collections::HashMap;

use super::block_table::SizeIndex;
use crate::error::Error;
use crate::stream_order::StreamOrder;
use crate::types::EventPolicy;

/// A per-stream container of free blocks.
pub(crate) trait FreeStore: Default {
    /// Number of free blocks.
    fn blocks(&self) -> usize;
}

/// A per-stream container that can absorb another on its own (the pool's lists need the engine's
/// block table to merge, so they are moved by the engine instead).
pub(crate) trait Append: FreeStore {
    /// Moves every block of `other` into `self`.
    fn append_from(&mut self, other: &mut Self);
}

impl FreeStore for Vec<u64> {
    fn blocks(&self) -> usize {
        self.len()
    }
}

impl Append for Vec<u64> {
    fn append_from(&mut self, other: &mut Self) {
        self.append(other);
    }
}

impl FreeStore for SizeIndex {
    fn blocks(&self) -> usize {
        self.len()
    }
}

/// What a stream that takes blocks from a list must wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// Nothing: no block ever entered the list, or the host synchronized its stream since.
    Nothing,
    /// The list's event, recorded after every block now in the list entered it.
    Recorded,
    /// A block entered the list after the event was last recorded (or the record failed).
    Stale,
}

/// One stream's free list.
struct StreamEntry<O: StreamOrder, L> {
    stream: O::Stream,
    list: L,
    /// Created on first need and re-recorded after that; meaningful only when `pending` is
    /// `Recorded`.
    event: Option<O::Event>,
    pending: Pending,
    /// Under [`EventPolicy::Adaptive`]: another stream has needed this list's blocks, so frees into
    /// it record the event (as under [`EventPolicy::RecordOnFree`]).
    shared: bool,
}

/// The free lists of every stream an engine has seen, with the rule for moving blocks between them.
///
/// The rule: a block in stream `A`'s list may be given to work on `A` at once; to work on `B` only
/// after [`order_after`](Self::order_after) made `B` wait on `A`'s event. Every way into a list
/// ([`entered`](Self::entered)) invalidates the event, so the event `B` waits on always postdates
/// every block in the list, including blocks that reached `A` from a third stream through a merge.
///
/// Under [`EventPolicy::RecordOnFree`] every record and wait is issued on the stream of the call in
/// progress (records right after a block enters that stream's list, waits by the stream taking a
/// block); a list whose record failed is handed over after a host synchronize of its stream
/// instead. [`EventPolicy::Adaptive`] records only into lists that were handed over before, and
/// hands over a list without a fresh event after a host synchronize. Only
/// [`EventPolicy::RecordOnDemand`] records on a stream the engine stored earlier.
pub(crate) struct StreamLists<O: StreamOrder, L> {
    /// Invariant: `index[&entries[i].stream] == i` for every `i`, and streams are distinct.
    entries: Vec<StreamEntry<O, L>>,
    index: HashMap<O::Stream, usize>,
    /// The entry found by the last [`find`](Self::find): most calls come from the same stream.
    last: usize,
    policy: EventPolicy,
}

impl<O: StreamOrder, L: FreeStore> StreamLists<O, L> {
    pub(crate) fn new(policy: EventPolicy) -> Self {
        Self {
            entries: Vec::new(),
            index: HashMap::new(),
            last: 0,
            policy,
        }
    }

    /// The position of `stream`'s list, creating an empty one on first sight.
    #[inline]
    pub(crate) fn find(&mut self, stream: O::Stream) -> usize {
        if let Some(e) = self.entries.get(self.last) {
            if e.stream == stream {
                return self.last;
            }
        }
        self.find_slow(stream)
    }

    #[cold]
    fn find_slow(&mut self, stream: O::Stream) -> usize {
        let i = *self.index.entry(stream).or_insert_with(|| {
            self.entries.push(StreamEntry {
                stream,
                list: L::default(),
                event: None,
                pending: Pending::Nothing,
                shared: false,
            });
            self.entries.len() - 1
        });
        self.last = i;
        i
    }

    /// The stream of list `i`.
    #[inline]
    pub(crate) fn stream(&self, i: usize) -> O::Stream {
        self.entries[i].stream
    }

    /// Number of lists (streams seen).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    pub(crate) fn list(&self, i: usize) -> &L {
        &self.entries[i].list
    }

    #[inline]
    pub(crate) fn list_mut(&mut self, i: usize) -> &mut L {
        &mut self.entries[i].list
    }

    /// Every stream with its list.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (O::Stream, &L)> + '_ {
        self.entries.iter().map(|e| (e.stream, &e.list))
    }

    /// Total free blocks over all lists.
    pub(crate) fn blocks(&self) -> usize {
        self.entries.iter().map(|e| e.list.blocks()).sum()
    }

    /// To be called after blocks entered list `i` (a free, a merge, fresh upstream memory), while
    /// serving a call on list `i`'s stream. Under [`EventPolicy::RecordOnFree`] (and
    /// [`EventPolicy::Adaptive`], once the list was handed over) re-records the list's event now; a
    /// failed record is not reported here: the list stays stale and the next
    /// [`order_after`](Self::order_after) synchronizes its stream instead.
    #[inline]
    pub(crate) fn entered(&mut self, order: &O, i: usize) {
        let e = &mut self.entries[i];
        e.pending = Pending::Stale;
        let record = match self.policy {
            EventPolicy::RecordOnFree => true,
            EventPolicy::Adaptive => e.shared,
            EventPolicy::RecordOnDemand => false,
        };
        if record && self.record(order, i).is_ok() {
            self.entries[i].pending = Pending::Recorded;
        }
    }

    /// Records list `i`'s event on its stream.
    fn record(&mut self, order: &O, i: usize) -> Result<(), Error> {
        let e = &mut self.entries[i];
        if e.event.is_none() {
            e.event = Some(order.create_event()?);
        }
        match &mut e.event {
            Some(ev) => order.record(ev, e.stream),
            None => Ok(()),
        }
    }

    /// Makes `waiter` (the stream of the call in progress) wait for every block in list `i`, so
    /// that they may be handed to it.
    pub(crate) fn order_after(&mut self, order: &O, waiter: O::Stream, i: usize) -> Result<(), Error> {
        match self.entries[i].pending {
            Pending::Nothing => return Ok(()),
            Pending::Recorded => {}
            Pending::Stale => match self.policy {
                EventPolicy::RecordOnDemand => {
                    self.record(order, i)?;
                    self.entries[i].pending = Pending::Recorded;
                }
                EventPolicy::RecordOnFree | EventPolicy::Adaptive => {
                    // Recording on a stored stream is what these policies promise never to do.
                    order.synchronize(self.entries[i].stream)?;
                    let e = &mut self.entries[i];
                    e.pending = Pending::Nothing;
                    e.shared = true;
                    return Ok(());
                }
            },
        }
        match &self.entries[i].event {
            Some(ev) => order.wait(waiter, ev),
            None => Ok(()),
        }
    }

    /// Blocks the host until every stream seen has completed its work.
    pub(crate) fn synchronize_all(&self, order: &O) -> Result<(), Error> {
        self.entries.iter().try_for_each(|e| order.synchronize(e.stream))
    }

    /// Forgets every list and event.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.index.clear();
        self.last = 0;
    }
}

impl<O: StreamOrder, L: Append> StreamLists<O, L> {
    /// Moves list `src` into list `dst` after ordering `dst`'s stream after it.
    pub(crate) fn merge_into(&mut self, order: &O, dst: usize, src: usize) -> Result<(), Error> {
        debug_assert_ne!(dst, src);
        let waiter = self.entries[dst].stream;
        self.order_after(order, waiter, src)?;
        let mut moved = std::mem::take(&mut self.entries[src].list);
        self.entries[dst].list.append_from(&mut moved);
        self.entered(order, dst);
        Ok(())
    }
}
