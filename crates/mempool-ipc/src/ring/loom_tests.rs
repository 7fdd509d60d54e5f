//! Model checks of the rings' index and doorbell protocols with loom, which runs the producer and
//! the consumer in every interleaving and lets each relaxed or acquire load read any value the memory
//! model allows: `RUSTFLAGS="--cfg loom" cargo test -p mempool-ipc --release --lib loom`
//! (docs/testing.md, "Concurrency models and fuzzing"). Under loom the region's words are loom's atomics
//! (`region.rs`) and a futex wait returns at once (`futex.rs`), so every sleep here is a spurious
//! wake-up the protocol must survive.

use std::sync::Arc;
use std::time::Duration;

use super::{Consumer, Direction, Geometry, Producer, Region};

/// The smallest ring: 2 slots of 16 payload bytes each way.
fn region() -> Arc<Region> {
    Arc::new(Region::create(Geometry::new(2, 32).unwrap()).unwrap())
}

/// Entry `n`'s payload: `n` in every byte, `n` bytes long (1 to 16: one or two payload words).
fn entry(n: u8) -> Vec<u8> {
    vec![n; n as usize]
}

/// Bounded models: every interleaving with at most this many preemptions (context switches away
/// from a thread that could go on), which finds the usual ordering bugs and keeps each model to
/// seconds.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

#[test]
fn loom_entries_cross_a_full_ring_whole_and_in_order() {
    // Three entries through two slots: the producer finds the ring full and waits for space, the
    // consumer finds it empty and waits for entries; every entry arrives once, in order, with its
    // bytes, and neither end ever sees the other break the ring's rules.
    model(|| {
        let region = region();
        let mut tx = Producer::new(region.clone(), Direction::ToExporter);
        let producer = loom::thread::spawn(move || {
            for n in 1..=3u8 {
                while !tx.push(&entry(n * 5)).unwrap() {
                    tx.publish_and_wake();
                    if tx.sleep_begin().unwrap() {
                        tx.wait_for_space(Duration::from_millis(1)).unwrap();
                    }
                }
            }
            tx.publish_and_wake();
        });
        let mut rx = Consumer::new(region.clone(), Direction::ToExporter);
        let mut buf = vec![0u8; region.geometry().max_payload()];
        for n in 1..=3u8 {
            loop {
                if let Some(len) = rx.pop(&mut buf).unwrap() {
                    assert_eq!(&buf[..len], &entry(n * 5)[..], "entry {n}");
                    rx.publish_and_wake();
                    break;
                }
                if rx.sleep_begin().unwrap() {
                    rx.wait(Duration::from_millis(1)).unwrap();
                }
            }
        }
        producer.join().unwrap();
        assert_eq!(rx.pop(&mut buf).unwrap(), None);
    });
}

#[test]
fn loom_a_consumer_going_to_sleep_is_never_missed_by_a_publish() {
    // The doorbell: either the consumer's re-check after setting its flag sees the entry, or the
    // producer's publish sees the flag and says to wake it (and clears it). Never neither.
    model(|| {
        let region = region();
        let mut tx = Producer::new(region.clone(), Direction::ToImporter);
        let producer = loom::thread::spawn(move || {
            assert!(tx.push(&entry(3)).unwrap());
            tx.publish()
        });
        let mut rx = Consumer::new(region.clone(), Direction::ToImporter);
        let sleeps = rx.sleep_begin().unwrap();
        let woken = producer.join().unwrap();
        assert!(!sleeps || woken, "the consumer sleeps on an entry and nobody wakes it");
        let mut buf = vec![0u8; region.geometry().max_payload()];
        let len = rx.pop(&mut buf).unwrap().expect("the entry");
        assert_eq!(&buf[..len], &entry(3)[..]);
    });
}

#[test]
fn loom_a_producer_waiting_for_space_is_never_missed_by_a_consumer() {
    // The same for the other flag: a full ring, the producer about to wait for space while the
    // consumer takes an entry and gives its slot back.
    model(|| {
        let region = region();
        let mut tx = Producer::new(region.clone(), Direction::ToExporter);
        assert!(tx.push(&entry(1)).unwrap());
        assert!(tx.push(&entry(2)).unwrap());
        assert!(!tx.push(&entry(3)).unwrap(), "two slots");
        tx.publish();
        let mut rx = Consumer::new(region.clone(), Direction::ToExporter);
        let consumer = loom::thread::spawn(move || {
            let mut buf = [0u8; 16];
            let len = rx.pop(&mut buf).unwrap().expect("the first entry");
            assert_eq!(&buf[..len], &entry(1)[..]);
            rx.publish()
        });
        let sleeps = tx.sleep_begin().unwrap();
        let woken = consumer.join().unwrap();
        assert!(!sleeps || woken, "the producer waits for space and nobody wakes it");
        assert!(tx.push(&entry(3)).unwrap(), "the slot came back");
    });
}
