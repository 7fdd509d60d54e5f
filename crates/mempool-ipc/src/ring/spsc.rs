//! One single-producer single-consumer ring of a region: the [`Producer`] and [`Consumer`] ends.
//!
//! Each end keeps its own index privately and only publishes it (a `Release` store): the
//! producer its head, the consumer its tail. It never reads its own index back from the shared
//! pages, and it checks every index of the peer's it reads (`Acquire`) against what it knows:
//!
//! - the consumer refuses a head that moves backwards, lies behind its tail, or claims more
//!   entries than the ring holds (a ring that "wraps forever");
//! - the producer refuses a tail that moves backwards or runs past its head;
//! - the consumer refuses a slot whose sequence word is not the entry's index (garbage, or an
//!   entry written out of turn) or whose length is more than a slot holds.
//!
//! An end that found the ring corrupt stays broken: every later call returns the same error.
//! Entries are copied out of the shared pages before the caller sees them, so the peer cannot
//! change an entry after it was checked. Ids and other contents of a payload are the caller's to
//! check.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{RingError, RingResult};
use super::futex;
use super::layout::Direction;
use super::region::Region;
use super::sync::{fence, Ordering};

/// What both ends of a ring keep: the region, the ring, the index this end publishes with the
/// doorbell's two flags around it, and whether the ring was found corrupt. The producer and the
/// consumer differ only in which words these are and in how they check the peer's index.
#[derive(Debug)]
struct End {
    region: Arc<Region>,
    dir: Direction,
    /// The word this end publishes its index in (the producer's head, the consumer's tail).
    index_word: usize,
    /// The index last published.
    published: u64,
    /// This end's waiting flag: set before it sleeps, cleared by the peer's publish that sees it.
    own_flag: usize,
    /// The peer's waiting flag, looked at after every publish.
    peer_flag: usize,
    broken: Option<String>,
}

impl End {
    fn new(region: Arc<Region>, dir: Direction, index_word: usize, own_flag: usize, peer_flag: usize) -> End {
        End {
            region,
            dir,
            index_word,
            published: 0,
            own_flag,
            peer_flag,
            broken: None,
        }
    }

    /// Marks the ring broken for good; returns the error.
    fn corrupt(&mut self, reason: String) -> RingError {
        self.broken = Some(reason.clone());
        RingError::Corrupt {
            ring: self.dir.name(),
            reason,
        }
    }

    /// The error of a ring found corrupt before, again.
    fn check_broken(&self) -> RingResult<()> {
        match &self.broken {
            Some(reason) => Err(RingError::Corrupt {
                ring: self.dir.name(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Publishes `index` (one `Release` store, only when it moved) and returns whether the peer is
    /// asleep waiting for it, clearing the peer's flag when it is, so one publish wakes one sleep.
    fn publish(&mut self, index: u64) -> bool {
        if index != self.published {
            self.region.word(self.index_word).store(index, Ordering::Release);
            self.published = index;
        }
        // Pairs with the fence in `sleep_announce` of the peer: either the peer sees the new index
        // when it re-checks, or this sees its flag. Looked at before it is cleared, so a publish
        // while the peer is awake writes nothing to the peer's line.
        fence(Ordering::SeqCst);
        let flag = self.region.flag(self.peer_flag);
        flag.load(Ordering::SeqCst) != 0 && flag.swap(0, Ordering::SeqCst) != 0
    }

    /// Wakes the peer sleeping on its flag (a futex wake; never blocks).
    fn wake_peer(&self) {
        futex::wake(self.region.flag(self.peer_flag));
    }

    /// Sets this end's waiting flag; the caller re-checks the ring after it.
    fn sleep_announce(&self) {
        self.region.flag(self.own_flag).store(1, Ordering::SeqCst);
        // Pairs with the fence in the peer's `publish`.
        fence(Ordering::SeqCst);
    }

    /// Clears this end's waiting flag (after a sleep, or one not needed after all).
    fn sleep_end(&self) {
        // Looked at first: a clear flag stays unwritten, so the peer's reads of it (at each
        // publish) keep their copy of the line.
        let flag = self.region.flag(self.own_flag);
        if flag.load(Ordering::Relaxed) != 0 {
            flag.store(0, Ordering::SeqCst);
        }
    }

    /// Sleeps on this end's flag until the peer wakes it or `timeout` passes, then clears it.
    fn sleep(&self, timeout: Duration) {
        futex::wait(self.region.flag(self.own_flag), 1, timeout);
        self.sleep_end();
    }
}

/// The producing end of one ring: writes entries and publishes them.
#[derive(Debug)]
pub struct Producer {
    end: End,
    /// The next entry's index (published as the head by [`Producer::publish`]).
    head: u64,
    /// The consumer's tail, as last read and checked.
    seen_tail: u64,
    /// Since when a push found the ring full, none succeeding since.
    full_since: Option<Instant>,
}

/// The consuming end of one ring: reads entries and publishes that their slots are free.
#[derive(Debug)]
pub struct Consumer {
    end: End,
    /// The next entry's index (published as the tail by [`Consumer::publish`]).
    tail: u64,
    /// The producer's head, as last read and checked.
    seen_head: u64,
}

impl Producer {
    /// The producing end of `dir`'s ring of `region`. One process holds it, once: two producers
    /// of one ring would overwrite each other's entries.
    pub fn new(region: Arc<Region>, dir: Direction) -> Producer {
        let g = region.geometry();
        let (head, own, peer) = (g.head(dir), g.producer_waiting(dir), g.consumer_waiting(dir));
        Producer {
            end: End::new(region, dir, head, own, peer),
            head: 0,
            seen_tail: 0,
            full_since: None,
        }
    }

    /// Reads and checks the consumer's tail; returns the free slots.
    fn refresh(&mut self) -> RingResult<u64> {
        self.end.check_broken()?;
        let g = self.end.region.geometry();
        let tail = self.end.region.word(g.tail(self.end.dir)).load(Ordering::Acquire);
        if tail < self.seen_tail {
            return Err(self
                .end
                .corrupt(format!("the tail moved backwards from {} to {tail}", self.seen_tail)));
        }
        if tail > self.head {
            return Err(self
                .end
                .corrupt(format!("the tail {tail} is past the head {}", self.head)));
        }
        self.seen_tail = tail;
        // `tail >= seen_tail >= head - capacity`: at most `capacity` entries are in the ring.
        Ok(u64::from(g.capacity()) - (self.head - tail))
    }

    /// Slots free for [`push`](Self::push) now (reads the consumer's tail).
    pub fn free(&mut self) -> RingResult<u64> {
        self.refresh()
    }

    /// Entries written and not yet taken by the consumer, as far as this end knows.
    pub fn in_flight(&self) -> u64 {
        self.head - self.seen_tail
    }

    /// Writes one entry; `Ok(false)` when the ring is full (nothing written). The consumer sees
    /// it after the next [`publish`](Self::publish).
    ///
    /// Errors: [`RingError::PayloadTooLarge`] (nothing written); [`RingError::Corrupt`] when
    /// the consumer's tail breaks the rules.
    pub fn push(&mut self, payload: &[u8]) -> RingResult<bool> {
        let g = self.end.region.geometry();
        if payload.len() > g.max_payload() {
            return Err(RingError::PayloadTooLarge {
                len: payload.len(),
                max: g.max_payload(),
            });
        }
        if self.refresh()? == 0 {
            self.full_since.get_or_insert_with(Instant::now);
            return Ok(false);
        }
        let slot = g.slot(self.end.dir, self.head);
        let region = &self.end.region;
        region.word(slot).store(self.head, Ordering::Relaxed);
        region.word(slot + 1).store(payload.len() as u64, Ordering::Relaxed);
        for (i, chunk) in payload.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            region
                .word(slot + 2 + i)
                .store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        self.head += 1;
        self.full_since = None;
        Ok(true)
    }

    /// Makes the entries written so far visible to the consumer (one `Release` store of the
    /// head), and returns whether the consumer is asleep waiting for them: then wake it
    /// ([`wake_consumer`](Self::wake_consumer), or however the connection rings). Clears the
    /// consumer's waiting flag when it returns `true`, so one publish wakes one sleep.
    pub fn publish(&mut self) -> bool {
        self.end.publish(self.head)
    }

    /// Wakes the consumer sleeping in [`Consumer::wait`] (a futex wake; never blocks).
    pub fn wake_consumer(&self) {
        self.end.wake_peer();
    }

    /// Publishes, and wakes the consumer if it sleeps.
    pub fn publish_and_wake(&mut self) {
        if self.publish() {
            self.wake_consumer();
        }
    }

    /// Announces that this end is about to wait for space; returns `Ok(true)` if the ring is
    /// still full after that (wait with [`wait_for_space`](Self::wait_for_space)), `Ok(false)`
    /// if space appeared meanwhile (the flag is cleared again).
    pub fn sleep_begin(&mut self) -> RingResult<bool> {
        self.end.sleep_announce();
        if self.refresh()? > 0 {
            self.end.sleep_end();
            return Ok(false);
        }
        Ok(true)
    }

    /// Sleeps until the consumer frees a slot and wakes this end, or `timeout` passes (after
    /// [`sleep_begin`](Self::sleep_begin) returned `true`). Returns the free slots.
    pub fn wait_for_space(&mut self, timeout: Duration) -> RingResult<u64> {
        self.end.sleep(timeout);
        self.refresh()
    }

    /// Fails with [`RingError::Stalled`] when pushes have found the ring full, none succeeding,
    /// for longer than `limit` (the consumer stopped taking entries). Counts from the first push
    /// that found it full.
    pub fn check_stall(&mut self, now: Instant, limit: Duration) -> RingResult<()> {
        if let Some(since) = self.full_since {
            if self.refresh()? > 0 {
                self.full_since = None;
                return Ok(());
            }
            let waited = now.saturating_duration_since(since);
            if waited > limit {
                return Err(RingError::Stalled {
                    ring: self.end.dir.name(),
                    waited,
                    limit,
                });
            }
        }
        Ok(())
    }
}

impl Consumer {
    /// The consuming end of `dir`'s ring of `region`. One process holds it, once.
    pub fn new(region: Arc<Region>, dir: Direction) -> Consumer {
        let g = region.geometry();
        let (tail, own, peer) = (g.tail(dir), g.consumer_waiting(dir), g.producer_waiting(dir));
        Consumer {
            end: End::new(region, dir, tail, own, peer),
            tail: 0,
            seen_head: 0,
        }
    }

    /// Reads and checks the producer's head; returns the entries ready.
    fn refresh(&mut self) -> RingResult<u64> {
        self.end.check_broken()?;
        let g = self.end.region.geometry();
        let head = self.end.region.word(g.head(self.end.dir)).load(Ordering::Acquire);
        if head < self.seen_head {
            return Err(self
                .end
                .corrupt(format!("the head moved backwards from {} to {head}", self.seen_head)));
        }
        if head - self.tail > u64::from(g.capacity()) {
            return Err(self.end.corrupt(format!(
                "the head {head} claims {} entries past the tail {}; the ring holds {}",
                head - self.tail,
                self.tail,
                g.capacity()
            )));
        }
        self.seen_head = head;
        Ok(head - self.tail)
    }

    /// The region (for tests that write it as a hostile peer would).
    #[cfg(test)]
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.end.region
    }

    /// Entries ready to [`pop`](Self::pop) (reads the producer's head).
    pub fn ready(&mut self) -> RingResult<u64> {
        self.refresh()
    }

    /// Copies the next entry into `buf` (at least [`Geometry::max_payload`](super::Geometry::max_payload)
    /// bytes) and returns its length, or `None` when the ring is empty. Its slot is given back to
    /// the producer at the next [`publish`](Self::publish).
    ///
    /// Errors: [`RingError::Corrupt`] when the producer's head or the slot breaks the rules.
    /// Panics if `buf` is shorter than a slot's payload.
    pub fn pop(&mut self, buf: &mut [u8]) -> RingResult<Option<usize>> {
        let g = self.end.region.geometry();
        assert!(
            buf.len() >= g.max_payload(),
            "pop into {} bytes, a slot holds {}",
            buf.len(),
            g.max_payload()
        );
        // Read the head only when the entries seen are used up: one `Acquire` per batch.
        if self.seen_head == self.tail && self.refresh()? == 0 {
            return Ok(None);
        }
        self.end.check_broken()?;
        let slot = g.slot(self.end.dir, self.tail);
        let seq = self.end.region.word(slot).load(Ordering::Relaxed);
        if seq != self.tail {
            return Err(self
                .end
                .corrupt(format!("the slot of entry {} holds sequence {seq}", self.tail)));
        }
        let len = self.end.region.word(slot + 1).load(Ordering::Relaxed);
        if len > g.max_payload() as u64 {
            return Err(self.end.corrupt(format!(
                "entry {} is {len} bytes long; a slot holds {}",
                self.tail,
                g.max_payload()
            )));
        }
        let len = len as usize;
        for (i, chunk) in buf[..len].chunks_mut(8).enumerate() {
            let word = self.end.region.word(slot + 2 + i).load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
        self.tail += 1;
        Ok(Some(len))
    }

    /// Gives the slots of the entries popped so far back to the producer (one `Release` store of
    /// the tail), and returns whether the producer is asleep waiting for space: then wake it
    /// ([`wake_producer`](Self::wake_producer)). Clears the producer's flag when it returns `true`.
    pub fn publish(&mut self) -> bool {
        self.end.publish(self.tail)
    }

    /// Wakes the producer sleeping in [`Producer::wait_for_space`] (a futex wake; never blocks).
    pub fn wake_producer(&self) {
        self.end.wake_peer();
    }

    /// Publishes, and wakes the producer if it sleeps.
    pub fn publish_and_wake(&mut self) {
        if self.publish() {
            self.wake_producer();
        }
    }

    /// Announces that this end is about to sleep waiting for entries (sets its waiting flag, so
    /// the producer's next [`Producer::publish`] says to wake it); returns `Ok(true)` if the ring
    /// is still empty after that (sleep: [`wait`](Self::wait), or the connection's own doorbell),
    /// `Ok(false)` if entries arrived meanwhile (the flag is cleared again).
    pub fn sleep_begin(&mut self) -> RingResult<bool> {
        self.end.sleep_announce();
        if self.refresh()? > 0 {
            self.end.sleep_end();
            return Ok(false);
        }
        Ok(true)
    }

    /// Clears this end's waiting flag (after a sleep that ended some other way).
    pub fn sleep_end(&self) {
        self.end.sleep_end();
    }

    /// Sleeps until the producer publishes and wakes this end, or `timeout` passes (after
    /// [`sleep_begin`](Self::sleep_begin) returned `true`). Returns the entries ready.
    pub fn wait(&mut self, timeout: Duration) -> RingResult<u64> {
        self.end.sleep(timeout);
        self.refresh()
    }
}
