use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::ReleaseBatcher;
use crate::protocol::{BufferId, MAX_RELEASE_BATCH};

const MS: Duration = Duration::from_millis(1);

#[test]
fn a_batch_is_full_at_its_count_and_due_after_its_delay() {
    let t0 = Instant::now();
    let mut b = ReleaseBatcher::new(3, 2 * MS);
    assert!(b.is_empty() && b.deadline().is_none() && !b.due(t0 + Duration::from_secs(9)));
    // Nothing was sent yet: the first release goes at once (Nagle), and counts as a send.
    assert!(b.push(BufferId(0), t0));
    assert_eq!(b.take(t0), vec![BufferId(0)]);
    assert!(!b.push(BufferId(1), t0));
    assert_eq!(b.deadline(), Some(t0 + 2 * MS));
    assert!(!b.due(t0 + MS) && b.due(t0 + 2 * MS));
    // A later release does not move the deadline: the oldest one sets it.
    assert!(!b.push(BufferId(2), t0 + MS));
    assert_eq!(b.deadline(), Some(t0 + 2 * MS));
    assert!(b.push(BufferId(3), t0 + MS), "the third release fills a batch of 3");
    assert_eq!(b.take(t0 + MS), vec![BufferId(1), BufferId(2), BufferId(3)]);
    assert!(b.is_empty() && b.deadline().is_none());
    // Within the delay of that send, the next release starts a batch with its own clock.
    assert!(!b.push(BufferId(4), t0 + 2 * MS));
    assert_eq!(b.deadline(), Some(t0 + 4 * MS));
    assert_eq!(b.take(t0 + 4 * MS), vec![BufferId(4)]);
    // Long after the last send, an isolated release goes at once again.
    assert!(b.push(BufferId(5), t0 + 10 * MS));
    assert_eq!(b.take(t0 + 10 * MS), vec![BufferId(5)]);
}

#[test]
fn a_release_joins_a_pending_batch_even_when_the_link_was_idle() {
    let t0 = Instant::now();
    let mut b = ReleaseBatcher::new(8, 2 * MS);
    b.push(BufferId(1), t0);
    // Not taken yet: the second release waits with the first, whatever the time.
    assert!(!b.push(BufferId(2), t0 + 5 * MS));
    assert_eq!(b.take(t0 + 5 * MS), vec![BufferId(1), BufferId(2)]);
}

#[test]
fn counts_are_clamped_to_what_one_message_carries() {
    assert_eq!(ReleaseBatcher::new(0, MS).max_count(), 1);
    assert_eq!(ReleaseBatcher::new(1000, MS).max_count(), MAX_RELEASE_BATCH);
    let mut one = ReleaseBatcher::new(1, MS);
    assert!(one.push(BufferId(9), Instant::now()), "a batch of one is full at once");
}

proptest! {
    /// Whatever the order of pushes and takes: every release comes out exactly once, in order,
    /// no batch exceeds the count, and nothing waits past its deadline unnoticed.
    #[test]
    fn every_release_goes_out_once_in_order(
        max in 1usize..80,
        ops in proptest::collection::vec(any::<bool>(), 0..300),
    ) {
        let t0 = Instant::now();
        let mut b = ReleaseBatcher::new(max, 5 * MS);
        let mut out = Vec::new();
        let mut next = 0u64;
        let mut last_sent: Option<Instant> = None;
        for (i, push) in ops.into_iter().enumerate() {
            let now = t0 + MS * i as u32;
            if push {
                let idle = b.is_empty() && last_sent.is_none_or(|s| now - s >= b.max_delay());
                let send = b.push(BufferId(next), now);
                next += 1;
                prop_assert_eq!(send, idle || b.len() >= b.max_count());
                if send {
                    last_sent = Some(now);
                    let batch = b.take(now);
                    prop_assert!(batch.len() <= b.max_count());
                    out.extend(batch);
                }
            } else if b.due(now) || i % 7 == 0 {
                if !b.is_empty() {
                    last_sent = Some(now);
                }
                let batch = b.take(now);
                prop_assert!(batch.len() <= b.max_count());
                out.extend(batch);
            }
            if let Some(deadline) = b.deadline() {
                prop_assert!(deadline <= now + b.max_delay());
            }
        }
        while !b.is_empty() {
            out.extend(b.take(t0));
        }
        prop_assert_eq!(out, (0..next).map(BufferId).collect::<Vec<_>>());
    }
}
