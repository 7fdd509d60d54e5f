//! Host tests of the rings: the layout, both ends, the doorbell protocol, hostile peers (every
//! shared word scribbled over), and property tests of the indices against a model queue.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rustix::fs::{MemfdFlags, SealFlags};

use super::layout::{LAYOUT_VERSION, MAGIC};
use super::{Consumer, Direction, Geometry, Producer, Region, RingError};

const TO_EXP: Direction = Direction::ToExporter;

fn region(capacity: u32, slot_bytes: u32) -> Arc<Region> {
    Arc::new(Region::create(Geometry::new(capacity, slot_bytes).unwrap()).unwrap())
}

/// The same region mapped a second time, through a duplicate of its descriptor, as the peer maps it.
fn peer_of(region: &Region) -> Arc<Region> {
    let fd: OwnedFd = region.fd().try_clone_to_owned().unwrap();
    Arc::new(Region::open(fd).unwrap())
}

fn buf(r: &Region) -> Vec<u8> {
    vec![0; r.geometry().max_payload()]
}

fn pop(rx: &mut Consumer, b: &mut [u8]) -> Option<Vec<u8>> {
    rx.pop(b).unwrap().map(|n| b[..n].to_vec())
}

fn corrupt_reason(e: RingError) -> String {
    match e {
        RingError::Corrupt { reason, .. } => reason,
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn geometry_limits_are_enforced() {
    assert!(Geometry::new(256, 256).is_ok());
    assert!(Geometry::new(2, 32).is_ok());
    assert!(Geometry::new(1 << 16, 4096).is_ok());
    for (c, s) in [
        (3, 256),
        (0, 256),
        (1, 256),
        (1 << 17, 256),
        (256, 24),
        (256, 4104),
        (256, 100),
    ] {
        let e = Geometry::new(c, s).unwrap_err();
        assert!(matches!(e, RingError::Geometry { .. }), "{c} x {s}: {e}");
    }
    let g = Geometry::new(4, 64).unwrap();
    assert_eq!(g.max_payload(), 48);
    assert_eq!(g.region_bytes() % 4096, 0);
    // Slots of the two rings never overlap each other or the control words.
    let last0 = g.slot(Direction::ToImporter, 3) + g.slot_words();
    assert_eq!(last0, g.slot(Direction::ToExporter, 0));
    assert!(g.slot(Direction::ToImporter, 0) > g.producer_waiting(Direction::ToExporter));
    assert!(g.slot(Direction::ToExporter, 3) + g.slot_words() <= g.region_bytes() / 8);
}

#[test]
fn entries_cross_between_two_mappings_in_order() {
    let a = region(4, 64);
    let b = peer_of(&a);
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let mut rx = Consumer::new(b.clone(), TO_EXP);
    let mut scratch = buf(&b);
    assert_eq!(pop(&mut rx, &mut scratch), None);
    assert!(tx.push(b"").unwrap());
    assert!(tx.push(b"hello").unwrap());
    assert!(tx.push(&[7u8; 48]).unwrap());
    // Nothing is visible before the producer publishes.
    assert_eq!(pop(&mut rx, &mut scratch), None);
    assert!(!tx.publish());
    assert_eq!(pop(&mut rx, &mut scratch), Some(vec![]));
    assert_eq!(pop(&mut rx, &mut scratch), Some(b"hello".to_vec()));
    assert_eq!(pop(&mut rx, &mut scratch), Some(vec![7u8; 48]));
    assert_eq!(pop(&mut rx, &mut scratch), None);
}

#[test]
fn a_full_ring_refuses_pushes_until_the_consumer_publishes_and_wraps_around() {
    let a = region(4, 32);
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    let mut scratch = vec![0; 16];
    let mut next_out = 0u64;
    let mut next_in = 0u64;
    for _round in 0..50 {
        while tx.push(&next_in.to_le_bytes()).unwrap() {
            next_in += 1;
        }
        assert_eq!(tx.in_flight(), 4, "a full ring holds exactly its capacity");
        assert_eq!(tx.free().unwrap(), 0);
        tx.publish();
        // Popped but not published: still full for the producer.
        for _ in 0..3 {
            let got = pop(&mut rx, &mut scratch).unwrap();
            assert_eq!(got, next_out.to_le_bytes());
            next_out += 1;
        }
        assert!(!tx.push(b"x").unwrap());
        rx.publish();
        assert_eq!(tx.free().unwrap(), 3);
    }
    assert!(next_in > 4 * 30, "the indices wrapped around the ring many times");
}

#[test]
fn a_payload_larger_than_a_slot_is_refused_and_nothing_is_written() {
    let a = region(4, 64);
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let e = tx.push(&[0u8; 49]).unwrap_err();
    assert!(matches!(e, RingError::PayloadTooLarge { len: 49, max: 48 }), "{e}");
    assert_eq!(tx.in_flight(), 0);
    assert!(tx.push(&[0u8; 48]).unwrap());
}

#[test]
fn open_refuses_regions_that_are_not_ring_regions() {
    let good = region(4, 64);
    let bytes = good.geometry().region_bytes();
    // An unsealed memfd of the right length and header.
    let unsealed = rustix::fs::memfd_create("not-sealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&unsealed, bytes as u64).unwrap();
    let e = Region::open(unsealed).unwrap_err();
    assert!(
        matches!(&e, RingError::BadRegion { reason } if reason.contains("sealed")),
        "{e}"
    );

    // Sealed memfds with a scribbled header: build one like `create`, then overwrite a header word.
    let cases: [(usize, u64, &str); 6] = [
        (0, 0xdead_beef, "magic"),
        (1, LAYOUT_VERSION + 1, "layout version"),
        (2, 3, "capacity"),
        (2, u64::MAX, "capacity"),
        (3, 24, "slot size"),
        (4, 8192, "length"),
    ];
    for (word, value, what) in cases {
        let r = region(4, 64);
        r.scribble(word, value);
        let fd = r.fd().try_clone_to_owned().unwrap();
        let e = Region::open(fd).unwrap_err();
        assert!(
            matches!(&e, RingError::BadRegion { reason } if reason.contains(what)),
            "{what}: {e}"
        );
    }
    // A header that describes a larger geometry than the memfd holds.
    let r = region(4, 64);
    r.scribble(2, 1 << 16);
    let e = Region::open(r.fd().try_clone_to_owned().unwrap()).unwrap_err();
    assert!(matches!(e, RingError::BadRegion { .. }), "{e}");
    // A sealed memfd too small to hold a header.
    let tiny = rustix::fs::memfd_create("tiny", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&tiny, 64).unwrap();
    rustix::fs::fcntl_add_seals(&tiny, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).unwrap();
    assert!(matches!(Region::open(tiny).unwrap_err(), RingError::BadRegion { .. }));
    // The untouched one maps.
    assert_eq!(peer_of(&good).geometry(), good.geometry());
    assert_eq!(good.word(0).load(Ordering::Relaxed), MAGIC);
}

#[test]
fn the_peer_cannot_resize_the_region() {
    let a = region(4, 64);
    let fd = a.fd();
    assert!(rustix::fs::ftruncate(fd, 0).is_err(), "shrinking is sealed off");
    assert!(rustix::fs::ftruncate(fd, 1 << 20).is_err(), "growing is sealed off");
    assert!(
        rustix::fs::fcntl_add_seals(fd, SealFlags::FUTURE_WRITE).is_err(),
        "new seals are sealed off"
    );
}

// ---- hostile producers: what the consumer refuses ----

#[test]
fn a_head_that_moves_backwards_is_corrupt() {
    let a = region(4, 32);
    let g = a.geometry();
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    let mut scratch = vec![0; 16];
    for _ in 0..3 {
        tx.push(b"x").unwrap();
    }
    tx.publish();
    assert!(pop(&mut rx, &mut scratch).is_some());
    a.scribble(g.head(TO_EXP), 1);
    // Entries already seen are still delivered; the next read of the head finds it moved back.
    assert!(pop(&mut rx, &mut scratch).is_some());
    assert!(pop(&mut rx, &mut scratch).is_some());
    let reason = corrupt_reason(rx.pop(&mut scratch).unwrap_err());
    assert!(reason.contains("backwards"), "{reason}");
}

#[test]
fn a_head_claiming_more_entries_than_the_ring_holds_is_corrupt() {
    // The ring that "wraps forever": a head far ahead of the tail, whatever the slots say.
    for head in [5u64, 1 << 40, u64::MAX] {
        let a = region(4, 32);
        let mut rx = Consumer::new(peer_of(&a), TO_EXP);
        a.scribble(a.geometry().head(TO_EXP), head);
        let reason = corrupt_reason(rx.pop(&mut [0; 16]).unwrap_err());
        assert!(reason.contains("the ring holds 4"), "{reason}");
        // Broken for good: the same error again, even after the head is put back.
        a.scribble(a.geometry().head(TO_EXP), 0);
        assert!(matches!(rx.ready().unwrap_err(), RingError::Corrupt { .. }));
    }
}

#[test]
fn a_producer_that_keeps_wrapping_with_valid_looking_slots_is_bounded_by_the_tail() {
    // A peer that writes slots with the right sequences but moves its head by the capacity each
    // time the consumer looks: the consumer reads exactly what fits, then finds the head too far.
    let a = region(4, 32);
    let g = a.geometry();
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    let mut scratch = vec![0; 16];
    let write_slots = |from: u64, to: u64| {
        for i in from..to {
            a.scribble(g.slot(TO_EXP, i), i);
            a.scribble(g.slot(TO_EXP, i) + 1, 8);
        }
    };
    write_slots(0, 4);
    a.scribble(g.head(TO_EXP), 4);
    for _ in 0..4 {
        assert!(pop(&mut rx, &mut scratch).is_some());
    }
    // The consumer has not published its tail (0): a head of 8 claims 8 entries past the tail
    // it knows (4)... which is 4: allowed. 9 is not.
    write_slots(4, 9);
    a.scribble(g.head(TO_EXP), 9);
    let reason = corrupt_reason(rx.pop(&mut scratch).unwrap_err());
    assert!(reason.contains("claims 5 entries"), "{reason}");
}

#[test]
fn garbage_in_a_slot_is_corrupt() {
    let a = region(4, 32);
    let g = a.geometry();
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    tx.push(b"ok").unwrap();
    tx.push(b"ok").unwrap();
    tx.publish();
    // The second slot's sequence overwritten: an entry written out of turn, or garbage.
    a.scribble(g.slot(TO_EXP, 1), 0x4141_4141_4141_4141);
    let mut scratch = vec![0; 16];
    assert_eq!(pop(&mut rx, &mut scratch), Some(b"ok".to_vec()));
    let reason = corrupt_reason(rx.pop(&mut scratch).unwrap_err());
    assert!(reason.contains("holds sequence"), "{reason}");
}

#[test]
fn a_slot_length_beyond_the_slot_is_corrupt() {
    for len in [17u64, 4096, u64::MAX] {
        let a = region(4, 32);
        let g = a.geometry();
        let mut tx = Producer::new(a.clone(), TO_EXP);
        let mut rx = Consumer::new(peer_of(&a), TO_EXP);
        tx.push(b"ok").unwrap();
        tx.publish();
        a.scribble(g.slot(TO_EXP, 0) + 1, len);
        let reason = corrupt_reason(rx.pop(&mut [0; 16]).unwrap_err());
        assert!(reason.contains("bytes long"), "{reason}");
    }
}

#[test]
fn an_entry_is_copied_out_before_the_caller_sees_it() {
    let a = region(4, 32);
    let g = a.geometry();
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    tx.push(&42u64.to_le_bytes()).unwrap();
    tx.publish();
    let mut scratch = vec![0; 16];
    let n = rx.pop(&mut scratch).unwrap().unwrap();
    a.scribble(g.slot(TO_EXP, 0) + 2, 666);
    assert_eq!(&scratch[..n], &42u64.to_le_bytes());
}

// ---- hostile consumers: what the producer refuses ----

#[test]
fn a_tail_that_moves_backwards_or_past_the_head_is_corrupt() {
    let a = region(4, 32);
    let g = a.geometry();
    let mut tx = Producer::new(a.clone(), TO_EXP);
    for _ in 0..3 {
        tx.push(b"x").unwrap();
    }
    tx.publish();
    a.scribble(g.tail(TO_EXP), 4);
    let reason = corrupt_reason(tx.push(b"x").unwrap_err());
    assert!(reason.contains("past the head"), "{reason}");
    assert!(
        matches!(tx.free().unwrap_err(), RingError::Corrupt { .. }),
        "broken for good"
    );

    let b = region(4, 32);
    let mut tx = Producer::new(b.clone(), TO_EXP);
    for _ in 0..3 {
        tx.push(b"x").unwrap();
    }
    b.scribble(g.tail(TO_EXP), 2);
    assert_eq!(tx.free().unwrap(), 3);
    b.scribble(g.tail(TO_EXP), 1);
    let reason = corrupt_reason(tx.free().unwrap_err());
    assert!(reason.contains("backwards"), "{reason}");
}

#[test]
fn a_consumer_that_never_takes_anything_is_found_stalled() {
    let a = region(2, 32);
    let mut tx = Producer::new(a.clone(), TO_EXP);
    let start = Instant::now();
    let limit = Duration::from_secs(10);
    assert!(tx.push(b"1").unwrap() && tx.push(b"2").unwrap());
    tx.check_stall(start + Duration::from_secs(3600), limit).unwrap(); // not full yet: no stall
    assert!(!tx.push(b"3").unwrap());
    tx.check_stall(Instant::now(), limit).unwrap();
    let e = tx
        .check_stall(Instant::now() + Duration::from_secs(11), limit)
        .unwrap_err();
    assert!(matches!(e, RingError::Stalled { .. }) && e.is_peer_fault(), "{e}");
    // A consumer that takes something clears it.
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    tx.publish();
    assert!(rx.pop(&mut [0; 16]).unwrap().is_some());
    rx.publish();
    tx.check_stall(Instant::now() + Duration::from_secs(3600), limit)
        .unwrap();
}

#[test]
fn a_frozen_head_never_blocks_the_consumer() {
    // The producer publishes nothing more: the consumer finds the ring empty at once, and a
    // bounded wait returns at its limit.
    let a = region(4, 32);
    let mut rx = Consumer::new(peer_of(&a), TO_EXP);
    assert_eq!(rx.pop(&mut [0; 16]).unwrap(), None);
    assert!(rx.sleep_begin().unwrap());
    assert_eq!(rx.wait(Duration::from_millis(1)).unwrap(), 0);
}

#[test]
fn hostile_waiting_flags_cost_only_a_wake() {
    let a = region(4, 32);
    let g = a.geometry();
    let mut tx = Producer::new(a.clone(), TO_EXP);
    a.scribble(g.consumer_waiting(TO_EXP), u64::MAX);
    tx.push(b"x").unwrap();
    assert!(tx.publish(), "a set flag asks for a wake");
    tx.wake_consumer(); // never blocks
    assert!(!tx.publish(), "the flag was cleared by the publish that saw it");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever a peer writes to whatever shared word, neither end panics or reads outside the
    /// region: each call is Ok or a named error.
    #[test]
    fn scribbles_anywhere_are_survived(
        writes in proptest::collection::vec((0usize..400, any::<u64>(), 0u8..6), 1..40)
    ) {
        let a = region(4, 64);
        let words = a.geometry().region_bytes() / 8;
        let mut tx = Producer::new(a.clone(), TO_EXP);
        let mut rx = Consumer::new(peer_of(&a), TO_EXP);
        let mut scratch = buf(&a);
        for (at, value, op) in writes {
            // The words the rings use lie in the first 400 (4 slots of 8 words each way, after 144).
            a.scribble(at.min(words - 1), value);
            let r = match op {
                0 => tx.push(&value.to_le_bytes()).map(|_| ()),
                1 => { tx.publish(); Ok(()) }
                2 => rx.pop(&mut scratch).map(|_| ()),
                3 => { rx.publish(); Ok(()) }
                4 => rx.ready().map(|_| ()),
                _ => tx.free().map(|_| ()),
            };
            if let Err(e) = r {
                prop_assert!(e.is_peer_fault(), "{}", e);
            }
        }
    }

    /// Arbitrary interleavings of pushes, pops and publishes behave like a bounded queue: pops
    /// return what was pushed in order, a push fails exactly when `capacity` entries are
    /// unreleased, a pop finds nothing exactly when every published entry was taken.
    #[test]
    fn indices_follow_a_bounded_queue(
        capacity_log in 1u32..5,
        ops in proptest::collection::vec(0u8..4, 1..600)
    ) {
        let capacity = 1u32 << capacity_log;
        let a = region(capacity, 32);
        let mut tx = Producer::new(a.clone(), TO_EXP);
        let mut rx = Consumer::new(peer_of(&a), TO_EXP);
        let mut scratch = vec![0u8; 16];
        // What the model knows: entries pushed and unpublished, published and untaken, taken and
        // unreleased (their slots still the consumer's).
        let mut unpublished: VecDeque<u64> = VecDeque::new();
        let mut published: VecDeque<u64> = VecDeque::new();
        let mut taken = 0u64;
        let mut next = 0u64;
        for op in ops {
            match op {
                0 => {
                    let in_ring = unpublished.len() + published.len() + taken as usize;
                    let pushed = tx.push(&next.to_le_bytes()).unwrap();
                    prop_assert_eq!(pushed, in_ring < capacity as usize);
                    if pushed {
                        unpublished.push_back(next);
                        next += 1;
                    }
                }
                1 => {
                    prop_assert!(!tx.publish());
                    published.extend(unpublished.drain(..));
                }
                2 => {
                    let got = rx.pop(&mut scratch).unwrap();
                    match published.pop_front() {
                        Some(want) => {
                            prop_assert_eq!(got, Some(8));
                            prop_assert_eq!(&scratch[..8], &want.to_le_bytes());
                            taken += 1;
                        }
                        None => prop_assert_eq!(got, None),
                    }
                }
                _ => {
                    prop_assert!(!rx.publish());
                    taken = 0;
                }
            }
        }
    }
}

#[test]
fn threads_on_two_mappings_hand_over_every_entry_in_order_with_the_doorbell() {
    const N: u64 = 20_000;
    let a = region(8, 32);
    let b = peer_of(&a);
    let producer = thread::spawn(move || {
        let mut tx = Producer::new(a, TO_EXP);
        let mut i = 0u64;
        while i < N {
            if tx.push(&i.to_le_bytes()).unwrap() {
                i += 1;
                if i.is_multiple_of(3) {
                    tx.publish_and_wake();
                }
                continue;
            }
            tx.publish_and_wake();
            if tx.sleep_begin().unwrap() {
                tx.wait_for_space(Duration::from_secs(10)).unwrap();
            }
        }
        tx.publish_and_wake();
    });
    let mut rx = Consumer::new(b, TO_EXP);
    let mut scratch = vec![0u8; 16];
    let mut expect = 0u64;
    let mut sleeps = 0u64;
    while expect < N {
        match rx.pop(&mut scratch).unwrap() {
            Some(n) => {
                assert_eq!(&scratch[..n], &expect.to_le_bytes());
                expect += 1;
                if expect.is_multiple_of(5) {
                    rx.publish_and_wake();
                }
            }
            None => {
                rx.publish_and_wake();
                if rx.sleep_begin().unwrap() {
                    sleeps += 1;
                    rx.wait(Duration::from_secs(10)).unwrap();
                }
            }
        }
    }
    rx.publish_and_wake();
    producer.join().unwrap();
    assert_eq!(expect, N);
    eprintln!("consumer slept {sleeps} times");
}

#[test]
fn a_process_that_maps_the_passed_descriptor_sees_the_entries() {
    // The descriptor crosses a Unix socket as it does at the handshake; the receiver maps it.
    let (left, right) = std::os::unix::net::UnixStream::pair().unwrap();
    let a = region(4, 64);
    mempool_socket::fdpass::send_with_fds(&left, b"ring", &[a.fd().as_fd()]).unwrap();
    let mut tx = Producer::new(a.clone(), Direction::ToImporter);
    tx.push(b"buffer 1").unwrap();
    tx.publish();
    let mut bytes = [0u8; 16];
    let (n, mut fds) = mempool_socket::fdpass::recv_with_fds(&right, &mut bytes, 4).unwrap();
    assert_eq!(&bytes[..n], b"ring");
    assert_eq!(fds.len(), 1);
    let b = Arc::new(Region::open(fds.remove(0)).unwrap());
    let mut rx = Consumer::new(b, Direction::ToImporter);
    assert_eq!(pop(&mut rx, &mut [0; 48]), Some(b"buffer 1".to_vec()));
}
