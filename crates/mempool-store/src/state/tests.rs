//! The state machine driven with the host double and an explicit clock: create, publish,
//! attach, delete, dead clients, time-to-live, quotas, races for a name.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;
use crate::backend::{Gate, HostBackend};
use crate::error::{QuotaKind, QuotaScope};

const G: u64 = 4096;
const UID: u32 = 1000;
const DEV: DeviceUuid = DeviceUuid([1; 16]);

fn rules() -> Rules {
    Rules {
        server_uid: UID,
        access: Access { allow_uids: vec![2000] },
        quotas: Quotas::default(),
        default_ttl: None,
        max_buffer_bytes: 1 << 40,
        max_attachments_per_connection: 4096,
    }
}

fn state_with(rules: Rules) -> Store<HostBackend> {
    Store::new(HostBackend::new(2, G), rules)
}

fn state() -> Store<HostBackend> {
    state_with(rules())
}

fn live(s: &Store<HostBackend>) -> u64 {
    s.backend().live.load(Ordering::SeqCst)
}

fn create(s: &Store<HostBackend>, conn: ConnId, name: &str, size: u64, now: Instant) -> Result<Grant> {
    s.create(conn, 42, DEV, size, 0, name, "", &[], now)
}

#[test]
fn create_publish_attach_delete_detach() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let g = create(&s, 1, "w/a", 5000, now).unwrap();
    assert_eq!((g.size, g.granularity, g.device), (2 * G, G, DEV));
    assert!(g.event.is_none());
    assert_eq!(live(&s), 1);
    // Not attachable while being created, and only its creator publishes it.
    assert!(matches!(
        s.attach(2, "w/a", now),
        Err(Error::WrongState {
            state: BufferState::Creating,
            op: "attach",
            ..
        })
    ));
    assert!(matches!(s.publish(2, "w/a", None, now), Err(Error::NotCreator { .. })));
    s.publish(1, "w/a", Some(&[7; 64]), now).unwrap();
    assert!(matches!(
        s.publish(1, "w/a", None, now),
        Err(Error::WrongState {
            state: BufferState::Published,
            op: "publish",
            ..
        })
    ));
    let a = s.attach(2, "w/a", now).unwrap();
    let mut relayed = [7u8; 64];
    relayed[0] ^= 0xff;
    assert_eq!(a.event, Some(relayed), "attachers wait on the server's own event");
    assert_ne!(a.attachment, g.attachment);
    let (list, more) = s.list("", now);
    assert!(!more);
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].attachments, list[0].state, list[0].owner_pid),
        (2, BufferState::Published, 42)
    );
    // Delete: the name goes now, the memory with the last attachment.
    s.delete(2, "w/a", now).unwrap();
    assert!(matches!(s.attach(2, "w/a", now), Err(Error::UnknownName { .. })));
    assert!(s.list("", now).0.is_empty());
    assert_eq!(live(&s), 1);
    assert_eq!(s.stats().buffers, 1);
    // The name can be reused at once.
    create(&s, 2, "w/a", G, now).unwrap();
    s.detach(1, g.attachment).unwrap();
    assert_eq!(live(&s), 2);
    s.detach(2, a.attachment).unwrap();
    assert_eq!(live(&s), 1);
    assert_eq!(s.stats().freed, 1);
}

#[test]
fn detach_of_anothers_attachment_is_a_protocol_error() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let g = create(&s, 1, "x", G, now).unwrap();
    assert!(matches!(s.detach(2, g.attachment), Err(Error::Protocol { .. })));
    assert!(matches!(s.detach(1, 999), Err(Error::Protocol { .. })));
    s.detach(1, g.attachment).unwrap();
    // Detaching twice is refused too.
    assert!(matches!(s.detach(1, g.attachment), Err(Error::Protocol { .. })));
}

#[test]
fn a_creator_letting_go_unpublished_abandons_the_buffer() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let g = create(&s, 1, "gone", G, now).unwrap();
    s.detach(1, g.attachment).unwrap();
    assert!(matches!(s.attach(2, "gone", now), Err(Error::UnknownName { .. })));
    assert_eq!(live(&s), 0);
    // The abandoning is by attachment: a buffer another client made under a reused name stays.
    let g = create(&s, 1, "reused", G, now).unwrap();
    s.delete(1, "reused", now).unwrap();
    create(&s, 2, "reused", G, now).unwrap();
    s.detach(1, g.attachment).unwrap();
    assert_eq!(s.list("", now).0.len(), 1);
    assert_eq!(live(&s), 1);
}

#[test]
fn racing_creators_one_wins() {
    let now = Instant::now();
    let s = state();
    for conn in 1..=8 {
        s.connect(conn, UID).unwrap();
    }
    let wins = (1..=8).filter(|&c| create(&s, c, "race", G, now).is_ok()).count();
    assert_eq!(wins, 1);
    assert!(matches!(create(&s, 3, "race", G, now), Err(Error::NameTaken { .. })));
    assert_eq!(live(&s), 1);
}

#[test]
fn a_dead_creator_frees_its_unpublished_buffer_once_its_process_exits() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    create(&s, 1, "half", G, now).unwrap();
    create(&s, 1, "done", G, now).unwrap();
    s.publish(1, "done", None, now).unwrap();
    assert!(s.holds_anything(1));
    assert!(s.disconnect(1), "it held attachments: wait for its process");
    // The unpublished name is gone now; the published one stays.
    assert!(matches!(s.attach(2, "half", now), Err(Error::UnknownName { .. })));
    let names: Vec<String> = s.list("", now).0.into_iter().map(|b| b.name).collect();
    assert_eq!(names, ["done"]);
    assert_eq!(live(&s), 2, "the process may still map both");
    // A call on the dead connection is refused.
    assert!(s.attach(1, "done", now).is_err());
    s.process_exited(1);
    assert_eq!(live(&s), 1, "the unpublished buffer is freed");
    let a = s.attach(2, "done", now).unwrap();
    assert_eq!(s.list("", now).0[0].attachments, 1);
    // A client dying while attached: its attachment ends when its process exits.
    assert!(s.disconnect(2));
    s.process_exited(2);
    assert_eq!(s.stats().attachments, 0);
    assert_eq!(live(&s), 1, "published buffers stay until deleted");
    let _ = a;
    // process_exited on an open connection does nothing.
    s.connect(3, UID).unwrap();
    s.process_exited(3);
    assert_eq!(s.stats().connections, 1);
    // A clean disconnect holds nothing.
    assert!(!s.disconnect(3));
    assert_eq!(s.stats().connections, 0);
}

#[test]
fn attaching_a_name_being_deleted_fails_but_holders_keep_it() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    let g = create(&s, 1, "d", G, now).unwrap();
    s.publish(1, "d", None, now).unwrap();
    s.delete(1, "d", now).unwrap();
    assert!(matches!(s.attach(1, "d", now), Err(Error::UnknownName { .. })));
    assert!(matches!(s.delete(1, "d", now), Err(Error::UnknownName { .. })));
    assert_eq!(live(&s), 1);
    s.detach(1, g.attachment).unwrap();
    assert_eq!(live(&s), 0);
}

#[test]
fn ttl_takes_the_name_away() {
    let now = Instant::now();
    let s = state_with(Rules {
        default_ttl: Some(Duration::from_secs(60)),
        ..rules()
    });
    s.connect(1, UID).unwrap();
    let g = s.create(1, 1, DEV, G, 1000, "short", "t", &[], now).unwrap();
    s.publish(1, "short", None, now).unwrap();
    s.create(1, 1, DEV, G, 0, "default", "", &[], now).unwrap();
    s.publish(1, "default", None, now).unwrap();
    let list = s.list("", now + Duration::from_millis(500)).0;
    assert_eq!(
        list.iter().find(|b| b.name == "short").unwrap().expires_in,
        Some(Duration::from_millis(500))
    );
    assert_eq!(
        list.iter().find(|b| b.name == "default").unwrap().expires_in,
        Some(Duration::from_secs(60) - Duration::from_millis(500))
    );
    s.expire(now + Duration::from_secs(1));
    assert!(matches!(
        s.attach(1, "short", now + Duration::from_secs(1)),
        Err(Error::UnknownName { .. })
    ));
    assert!(s.attach(1, "default", now + Duration::from_secs(1)).is_ok());
    // Expired but still attached (the creator): memory stays until detach.
    assert_eq!(live(&s), 2);
    s.detach(1, g.attachment).unwrap();
    assert_eq!(live(&s), 1);
    s.expire(now + Duration::from_secs(61));
    assert!(s.list("", now + Duration::from_secs(61)).0.is_empty());
}

#[test]
fn quotas_and_access() {
    let now = Instant::now();
    let s = state_with(Rules {
        quotas: Quotas {
            per_uid_bytes: Some(4 * G),
            per_uid_buffers: Some(3),
            total_bytes: Some(6 * G),
            total_buffers: None,
        },
        ..rules()
    });
    assert!(matches!(s.connect(9, 3000), Err(Error::NotPermitted { uid: 3000, .. })));
    s.connect(1, UID).unwrap();
    s.connect(2, 2000).unwrap();
    let a = create(&s, 1, "a", 3 * G, now).unwrap();
    match create(&s, 1, "b", 2 * G, now) {
        Err(Error::QuotaExceeded {
            scope: QuotaScope::Uid(UID),
            kind: QuotaKind::Bytes,
            limit,
            in_use,
            requested,
        }) => assert_eq!((limit, in_use, requested), (4 * G, 3 * G, 2 * G)),
        other => panic!("{:?}", other.map(|g| g.size)),
    }
    assert_eq!(live(&s), 1, "a refused create allocates nothing");
    create(&s, 2, "c", 3 * G, now).unwrap();
    assert!(matches!(
        create(&s, 2, "d", G, now),
        Err(Error::QuotaExceeded {
            scope: QuotaScope::Total,
            kind: QuotaKind::Bytes,
            ..
        })
    ));
    // Only the owner (or the server's uid) deletes.
    s.publish(1, "a", None, now).unwrap();
    assert!(matches!(
        s.delete(2, "a", now),
        Err(Error::NotPermitted { uid: 2000, .. })
    ));
    s.publish(2, "c", None, now).unwrap();
    s.delete(1, "c", now).unwrap(); // uid 1000 is the server's
                                    // Credit comes back only when the memory goes.
    s.delete(1, "a", now).unwrap();
    assert!(create(&s, 1, "e", 2 * G, now).is_err());
    s.detach(1, a.attachment).unwrap();
    create(&s, 1, "e", 2 * G, now).unwrap();
}

#[test]
fn bad_requests_name_their_cause() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    assert!(matches!(create(&s, 1, "../x", G, now), Err(Error::BadName { .. })));
    assert!(matches!(
        create(&s, 1, "x", 0, now),
        Err(Error::BadSize { size: 0, .. })
    ));
    assert!(matches!(create(&s, 1, "x", u64::MAX, now), Err(Error::BadSize { .. })));
    assert!(matches!(
        s.create(1, 1, DeviceUuid([9; 16]), G, 0, "x", "", &[], now),
        Err(Error::DeviceNotServed { .. })
    ));
    assert!(matches!(
        s.create(1, 1, DEV, G, 0, "x", &"t".repeat(300), &[], now),
        Err(Error::BadTag { len: 300, .. })
    ));
    assert!(matches!(s.attach(1, "nope", now), Err(Error::UnknownName { .. })));
    assert!(matches!(
        s.publish(1, "nope", None, now),
        Err(Error::UnknownName { .. })
    ));
    // The second device is served too.
    let g = s.create(1, 1, DeviceUuid([2; 16]), G, 0, "x", "", &[], now).unwrap();
    assert_eq!(g.device, DeviceUuid([2; 16]));
    // A backend failure is the server's GPU failure, and nothing is charged.
    s.backend().capacity.store(G, Ordering::SeqCst);
    assert!(matches!(create(&s, 1, "y", G, now), Err(Error::ServerGpu { .. })));
    assert_eq!(s.stats().named, 1);
}

#[test]
fn list_pages_in_name_order() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    for i in 0..250 {
        create(&s, 1, &format!("b{i:03}"), G, now).unwrap();
    }
    let (first, more) = s.list("", now);
    assert!(more);
    assert_eq!(first.len(), MAX_LIST_PAGE);
    let (second, _) = s.list(&first.last().unwrap().name, now);
    assert_eq!(second[0].name, format!("b{:03}", MAX_LIST_PAGE));
    let (last, more) = s.list("b199", now);
    assert!(!more);
    assert_eq!(last.len(), 50);
}

#[test]
fn clear_releases_everything() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    create(&s, 1, "a", G, now).unwrap();
    create(&s, 1, "b", G, now).unwrap();
    s.publish(1, "b", None, now).unwrap();
    s.clear();
    assert_eq!(live(&s), 0);
    assert_eq!(
        s.stats(),
        ServerStats {
            freed: 2,
            ..ServerStats::default()
        }
    );
}

#[test]
fn a_completed_relay_is_granted_without_an_event() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    create(&s, 1, "r/pending", G, now).unwrap();
    s.publish(1, "r/pending", Some(&[3; 64]), now).unwrap();
    create(&s, 1, "r/none", G, now).unwrap();
    s.publish(1, "r/none", None, now).unwrap();
    // The creator's work may still run: the attacher is given the server's event to wait on.
    let mut relayed = [3u8; 64];
    relayed[0] ^= 0xff;
    assert_eq!(s.attach(2, "r/pending", now).unwrap().event, Some(relayed));
    assert_eq!(s.attach(2, "r/pending", now).unwrap().event, Some(relayed));
    // Published without an event: nothing to wait for.
    assert_eq!(s.attach(2, "r/none", now).unwrap().event, None);
    // The backend's query says the relay completed: from now on no event is handed out.
    s.backend().relays_done.store(true, Ordering::SeqCst);
    assert_eq!(s.attach(2, "r/pending", now).unwrap().event, None);
    // Seen complete once, it stays ready (the event is not recorded again for this buffer).
    s.backend().relays_done.store(false, Ordering::SeqCst);
    assert_eq!(s.attach(2, "r/pending", now).unwrap().event, None);
    // A buffer published after that is pending again until its own query says done.
    create(&s, 1, "r/later", G, now).unwrap();
    s.publish(1, "r/later", Some(&[4; 64]), now).unwrap();
    assert!(s.attach_many(2, &["r/later".into()], now).unwrap()[0].event.is_some());
    s.backend().relays_done.store(true, Ordering::SeqCst);
    let both = s.attach_many(2, &["r/later".into(), "r/pending".into()], now).unwrap();
    assert!(both.iter().all(|g| g.event.is_none()));
}

#[test]
fn attach_many_is_all_or_nothing() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    for name in ["m/a", "m/b", "m/c"] {
        create(&s, 1, name, G, now).unwrap();
        s.publish(1, name, Some(&[1; 64]), now).unwrap();
    }
    create(&s, 1, "m/creating", G, now).unwrap();
    let attachments = |s: &Store<HostBackend>| s.stats().attachments;
    let before = attachments(&s);
    // Every refusal names its buffer; nothing stays attached.
    let names = |v: &[&str]| v.iter().map(|n| (*n).to_owned()).collect::<Vec<String>>();
    match s.attach_many(2, &names(&["m/a", "m/missing", "m/b"]), now) {
        Err(Error::UnknownName { name }) => assert_eq!(name, "m/missing"),
        Err(other) => panic!("expected UnknownName, got {other:?}"),
        Ok(_) => panic!("attach_many of a missing name succeeded"),
    }
    assert_eq!(attachments(&s), before);
    match s.attach_many(2, &names(&["m/a", "m/b", "m/creating"]), now) {
        Err(Error::WrongState { name, op: "attach", .. }) => assert_eq!(name, "m/creating"),
        Err(other) => panic!("expected WrongState, got {other:?}"),
        Ok(_) => panic!("attach_many of a buffer being created succeeded"),
    }
    assert_eq!(attachments(&s), before);
    // A bad name is refused before anything is attached.
    match s.attach_many(2, &names(&["m/a", "bad name!"]), now) {
        Err(Error::BadName { name, .. }) => assert_eq!(name, "bad name!"),
        Err(other) => panic!("expected BadName, got {other:?}"),
        Ok(_) => panic!("attach_many of a bad name succeeded"),
    }
    assert_eq!(attachments(&s), before);
    // Counts out of range break the protocol.
    assert!(matches!(s.attach_many(2, &[], now), Err(Error::Protocol { .. })));
    let too_many: Vec<String> = (0..=MAX_ATTACH_MANY).map(|_| "m/a".to_owned()).collect();
    assert!(matches!(s.attach_many(2, &too_many, now), Err(Error::Protocol { .. })));
    assert_eq!(attachments(&s), before);
    // Success: one attachment per name, in order (a name twice: attached twice), each its own.
    let grants = s.attach_many(2, &names(&["m/c", "m/a", "m/a"]), now).unwrap();
    assert_eq!(grants.len(), 3);
    assert_eq!(attachments(&s), before + 3);
    let ids: HashSet<u64> = grants.iter().map(|g| g.attachment).collect();
    assert_eq!(ids.len(), 3);
    let (list, _) = s.list("", now);
    let count = |n: &str| list.iter().find(|i| i.name == n).unwrap().attachments;
    assert_eq!((count("m/a"), count("m/b"), count("m/c")), (3, 1, 2));
    // Each detaches on its own.
    s.detach(2, grants[1].attachment).unwrap();
    assert_eq!(attachments(&s), before + 2);
    s.delete(2, "m/a", now).unwrap();
    assert_eq!(live(&s), 4, "m/a is still attached");
    s.detach(2, grants[2].attachment).unwrap();
    s.disconnect(1);
    s.process_exited(1);
    assert_eq!(live(&s), 2, "m/a's last attachment and m/creating's creator are gone");
}

#[test]
fn a_buffers_attachment_count_never_wraps() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let g = create(&s, 1, "w/full", G, now).unwrap();
    s.publish(1, "w/full", None, now).unwrap();
    let id = s.with(|s| s.names["w/full"]);
    // As if 2^32 - 1 attachments were live (the creator's one among them).
    s.with(|s| s.buffers.get_mut(&id).unwrap().attachments = u32::MAX);
    match s.attach(2, "w/full", now) {
        Err(Error::Busy { reason }) => assert!(reason.contains("the most one buffer can count"), "{reason}"),
        Err(other) => panic!("expected Busy, got {other:?}"),
        Ok(_) => panic!("expected Busy, got a grant"),
    }
    assert!(matches!(
        s.attach_many(2, &["w/full".to_owned()], now),
        Err(Error::Busy { .. })
    ));
    assert_eq!(
        s.with(|s| s.buffers[&id].attachments),
        u32::MAX,
        "a refusal counts nothing"
    );
    // The count goes down normally and the buffer stays.
    s.detach(1, g.attachment).unwrap();
    assert_eq!(s.with(|s| s.buffers[&id].attachments), u32::MAX - 1);
    assert!(s.attach(2, "w/full", now).is_ok());
    assert_eq!(live(&s), 1);
}

#[test]
fn attachments_per_connection_are_capped() {
    let now = Instant::now();
    let s = state_with(Rules {
        max_attachments_per_connection: 2,
        ..rules()
    });
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    create(&s, 1, "w/a", G, now).unwrap();
    s.publish(1, "w/a", None, now).unwrap();
    create(&s, 1, "w/b", G, now).unwrap();
    s.publish(1, "w/b", None, now).unwrap();
    // The creator holds two (its creations'): a third create or attach is refused.
    assert!(matches!(create(&s, 1, "w/c", G, now), Err(Error::Busy { .. })));
    assert!(matches!(s.attach(1, "w/a", now), Err(Error::Busy { .. })));
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match s.attach_many(2, &names(&["w/a", "w/b", "w/a"]), now) {
        Err(Error::Busy { reason }) => assert!(
            reason.contains("holds 0 attachments and asked for 3 more, past the limit of 2"),
            "{reason}"
        ),
        Err(other) => panic!("expected Busy, got {other:?}"),
        Ok(_) => panic!("expected Busy, got grants"),
    }
    assert_eq!(s.stats().attachments, 2, "all or nothing");
    assert_eq!(s.attach_many(2, &names(&["w/a", "w/b"]), now).unwrap().len(), 2);
    assert_eq!(s.stats().attachments, 4);
}

/// Starts `create(conn, name, size)` on a thread whose allocation stops at a gate of the host
/// backend, and returns once the allocation is inside the backend (past the reservation).
fn create_held(
    s: &Arc<Store<HostBackend>>,
    conn: ConnId,
    name: &str,
    size: u64,
    now: Instant,
) -> (Arc<Gate>, std::thread::JoinHandle<Result<Grant>>) {
    let gate = s.backend().block_next();
    let (s2, name) = (s.clone(), name.to_owned());
    let thread = std::thread::spawn(move || create(&s2, conn, &name, size, now));
    gate.entered.wait();
    (gate, thread)
}

#[test]
fn an_allocation_runs_with_the_lock_released_and_its_name_and_quota_reserved() {
    let now = Instant::now();
    let s = Arc::new(state_with(Rules {
        quotas: Quotas {
            per_uid_bytes: Some(8 * G),
            ..Quotas::default()
        },
        ..rules()
    }));
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    create(&s, 2, "w/ready", G, now).unwrap();
    s.publish(2, "w/ready", None, now).unwrap();
    let (gate, creator) = create_held(&s, 1, "w/big", 4 * G, now);
    // The allocation is inside the backend now, and the lock is free: another client is served.
    assert!(!s.is_locked(), "the lock is held across the allocation");
    let other = s.attach(2, "w/ready", now).unwrap();
    let (list, _) = s.list("", now);
    let big = list
        .iter()
        .find(|b| b.name == "w/big")
        .expect("a reserved buffer is listed");
    assert_eq!(
        (big.state, big.attachments, big.size),
        (BufferState::Creating, 0, 4 * G)
    );
    // Its name is taken, it cannot be attached, and its bytes count against the quota.
    assert!(matches!(create(&s, 2, "w/big", G, now), Err(Error::NameTaken { .. })));
    assert!(matches!(
        s.attach(2, "w/big", now),
        Err(Error::WrongState {
            state: BufferState::Creating,
            ..
        })
    ));
    match create(&s, 2, "w/over", 4 * G, now) {
        Err(Error::QuotaExceeded { in_use, .. }) => assert_eq!(in_use, 5 * G),
        other => panic!("expected QuotaExceeded, got {:?}", other.map(|g| g.size)),
    }
    assert_eq!(live(&s), 1, "only w/ready is allocated yet");
    gate.release.wait();
    let g = creator.join().unwrap().unwrap();
    assert_eq!((g.size, g.event), (4 * G, None));
    assert_eq!(live(&s), 2);
    let (list, _) = s.list("", now);
    assert_eq!(list.iter().find(|b| b.name == "w/big").unwrap().attachments, 1);
    s.publish(1, "w/big", None, now).unwrap();
    s.attach(2, "w/big", now).unwrap();
    s.detach(2, other.attachment).unwrap();
}

#[test]
fn a_failed_allocation_rolls_back_its_name_and_quota() {
    let now = Instant::now();
    let s = Arc::new(state_with(Rules {
        quotas: Quotas {
            per_uid_bytes: Some(4 * G),
            per_uid_buffers: Some(1),
            ..Quotas::default()
        },
        ..rules()
    }));
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let (gate, creator) = create_held(&s, 1, "w/fail", 4 * G, now);
    assert!(matches!(create(&s, 2, "w/fail", G, now), Err(Error::NameTaken { .. })));
    assert_eq!(s.stats().buffers, 1, "the reservation is a buffer");
    // The GPU is full by the time the allocation runs.
    s.backend().capacity.store(G, Ordering::SeqCst);
    gate.release.wait();
    assert!(matches!(creator.join().unwrap(), Err(Error::ServerGpu { .. })));
    let stats = s.stats();
    assert_eq!((stats.buffers, stats.bytes, stats.named, stats.freed), (0, 0, 0, 0));
    assert_eq!(s.list("", now).0.len(), 0);
    // The name and the whole quota (bytes and the one buffer) are free again.
    s.backend().capacity.store(u64::MAX, Ordering::SeqCst);
    create(&s, 2, "w/fail", 4 * G, now).unwrap();
    assert_eq!(live(&s), 1);
}

#[test]
fn a_reservation_deleted_or_disconnected_while_allocating_is_refused_and_freed() {
    let now = Instant::now();
    let s = Arc::new(state());
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    // Deleted by another client of its uid while its memory is allocated: the name goes at once.
    let (gate, creator) = create_held(&s, 1, "w/del", 2 * G, now);
    s.delete(2, "w/del", now).unwrap();
    assert_eq!(s.list("", now).0.len(), 0);
    gate.release.wait();
    match creator.join().unwrap() {
        Err(Error::WrongState {
            state: BufferState::Deleting,
            ..
        }) => {}
        other => panic!("expected WrongState, got {:?}", other.map(|g| g.size)),
    }
    assert_eq!(live(&s), 0, "its memory is released");
    assert_eq!((s.stats().buffers, s.stats().bytes), (0, 0));
    // Its creator's connection ended meanwhile: the reservation goes and so does the memory.
    let (gate, creator) = create_held(&s, 1, "w/gone", 2 * G, now);
    assert!(!s.disconnect(1), "a reservation is no attachment");
    gate.release.wait();
    assert!(matches!(creator.join().unwrap(), Err(Error::Protocol { .. })));
    assert_eq!(live(&s), 0);
    assert_eq!((s.stats().buffers, s.stats().bytes, s.stats().named), (0, 0, 0));
    create(&s, 2, "w/gone", G, now).unwrap();
}

fn members(list: &[(&str, u64)]) -> Vec<(String, u64)> {
    list.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect()
}

fn create_group(s: &Store<HostBackend>, conn: ConnId, list: &[(&str, u64)], now: Instant) -> Result<Vec<Grant>> {
    s.create_many(conn, 42, DEV, 0, "group", &[], &members(list), now)
}

fn bytes_of(s: &Store<HostBackend>) -> u64 {
    s.backend().live_bytes.load(Ordering::SeqCst)
}

#[test]
fn create_many_lays_members_out_in_one_allocation() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    let grants = create_group(&s, 1, &[("g/a", 5000), ("g/b", G), ("g/c", 1)], now).unwrap();
    assert_eq!(live(&s), 1, "one allocation for the whole group");
    assert_eq!(bytes_of(&s), 4 * G);
    let placed: Vec<(u64, u64, u64)> = grants.iter().map(|g| (g.offset, g.size, g.memory_size)).collect();
    assert_eq!(placed, vec![(0, 2 * G, 4 * G), (2 * G, G, 4 * G), (3 * G, G, 4 * G)]);
    assert!(grants
        .iter()
        .all(|g| g.memory == grants[0].memory && g.granularity == G && g.device == DEV));
    let ids: HashSet<u64> = grants.iter().map(|g| g.attachment).collect();
    assert_eq!(ids.len(), 3, "an attachment per member");
    // A plain create is a group of one, in a memory of its own with a fresh id.
    let single = create(&s, 1, "g/single", G, now).unwrap();
    assert_eq!((single.offset, single.memory_size), (0, G));
    assert_ne!(single.memory, grants[0].memory);
    // Each member is an ordinary named buffer.
    let (list, _) = s.list("", now);
    let names: Vec<&str> = list.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["g/a", "g/b", "g/c", "g/single"]);
    assert_eq!(list[0].size, 2 * G);
    assert_eq!(list[0].tag, "group");
    let stats = s.stats();
    assert_eq!(
        (stats.buffers, stats.named, stats.bytes, stats.attachments),
        (4, 4, 5 * G, 4)
    );
}

#[test]
fn create_many_is_all_or_nothing() {
    let now = Instant::now();
    let s = state_with(Rules {
        quotas: Quotas {
            per_uid_bytes: Some(10 * G),
            per_uid_buffers: Some(5),
            ..Quotas::default()
        },
        max_buffer_bytes: 12 * G,
        ..rules()
    });
    s.connect(1, UID).unwrap();
    create(&s, 1, "taken", G, now).unwrap();
    let before = (s.stats(), live(&s));
    let refused = |list: &[(&str, u64)]| create_group(&s, 1, list, now).err().expect("refused");
    // A taken name, a name twice, a bad name, a bad size: the whole group is refused.
    assert!(matches!(refused(&[("a", G), ("taken", G)]), Error::NameTaken { name } if name == "taken"));
    assert!(matches!(refused(&[("a", G), ("b", G), ("a", G)]), Error::NameTaken { name } if name == "a"));
    assert!(matches!(refused(&[("a", G), ("bad name!", G)]), Error::BadName { .. }));
    assert!(matches!(refused(&[("a", G), ("b", 0)]), Error::BadSize { size: 0, .. }));
    assert!(matches!(refused(&[("a", 13 * G)]), Error::BadSize { .. }));
    // Each member fits the largest buffer, the group does not.
    match refused(&[("a", 6 * G), ("b", 6 * G), ("c", G)]) {
        Error::BadSize { reason, .. } => assert!(reason.contains("group"), "{reason}"),
        other => panic!("expected BadSize, got {other:?}"),
    }
    // Quotas: the group's total bytes, and a buffer per member.
    match refused(&[("a", 5 * G), ("b", 5 * G)]) {
        Error::QuotaExceeded {
            kind: QuotaKind::Bytes,
            in_use,
            requested,
            ..
        } => assert_eq!((in_use, requested), (G, 10 * G)),
        other => panic!("expected a bytes quota, got {other:?}"),
    }
    match refused(&[("a", G), ("b", G), ("c", G), ("d", G), ("e", G)]) {
        Error::QuotaExceeded {
            kind: QuotaKind::Buffers,
            in_use,
            requested,
            ..
        } => assert_eq!((in_use, requested), (1, 5)),
        other => panic!("expected a buffers quota, got {other:?}"),
    }
    // Counts out of range break the protocol.
    assert!(matches!(refused(&[]), Error::Protocol { .. }));
    let too_many: Vec<(String, u64)> = (0..=MAX_ATTACH_MANY).map(|i| (format!("n{i}"), 1)).collect();
    assert!(matches!(
        s.create_many(1, 42, DEV, 0, "", &[], &too_many, now),
        Err(Error::Protocol { .. })
    ));
    // Nothing was reserved or allocated by any refusal.
    assert_eq!((s.stats(), live(&s)), before);
    assert!(matches!(s.attach(1, "a", now), Err(Error::UnknownName { .. })));
    // A failed allocation rolls every member back.
    s.backend().capacity.store(2 * G, Ordering::SeqCst);
    assert!(matches!(refused(&[("a", G), ("b", G)]), Error::ServerGpu { .. }));
    assert_eq!((s.stats(), live(&s)), before);
    s.backend().capacity.store(u64::MAX, Ordering::SeqCst);
    // Within the quotas: charged the group's total.
    let grants = create_group(&s, 1, &[("a", 4 * G), ("b", 4 * G)], now).unwrap();
    assert_eq!(grants.len(), 2);
    assert!(matches!(
        create(&s, 1, "c", 2 * G, now),
        Err(Error::QuotaExceeded {
            kind: QuotaKind::Bytes,
            in_use,
            ..
        }) if in_use == 9 * G
    ));
}

#[test]
fn a_member_is_attachable_once_its_whole_group_is_published() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    create_group(&s, 1, &[("p/a", G), ("p/b", G), ("p/c", G)], now).unwrap();
    s.publish(1, "p/a", Some(&[1; 64]), now).unwrap();
    s.publish(1, "p/b", None, now).unwrap();
    // p/a is published, its group is not: refused with the group's state.
    for name in ["p/a", "p/b"] {
        match s.attach(2, name, now) {
            Err(Error::WrongState { name: n, state, op }) => {
                assert_eq!(
                    (n.as_str(), state, op),
                    (name, BufferState::Creating, OP_ATTACH_GROUP_UNPUBLISHED)
                );
            }
            other => panic!("expected WrongState, got {:?}", other.map(|g| g.attachment)),
        }
    }
    let names = |v: &[&str]| v.iter().map(|n| (*n).to_owned()).collect::<Vec<String>>();
    assert!(matches!(
        s.attach_many(2, &names(&["p/a", "p/b"]), now),
        Err(Error::WrongState { .. })
    ));
    assert_eq!(s.stats().attachments, 3, "only the creator's");
    s.publish(1, "p/c", Some(&[3; 64]), now).unwrap();
    let grants = s.attach_many(2, &names(&["p/a", "p/b", "p/c"]), now).unwrap();
    assert!(grants.iter().all(|g| g.memory == grants[0].memory));
    let offsets: Vec<u64> = grants.iter().map(|g| g.offset).collect();
    assert_eq!(offsets, [0, G, 2 * G]);
    // Each member keeps its own event: p/b was published without one.
    assert!(grants[0].event.is_some() && grants[1].event.is_none() && grants[2].event.is_some());
    let single = s.attach(2, "p/b", now).unwrap();
    assert_eq!(
        (single.memory, single.offset, single.memory_size),
        (grants[0].memory, G, 3 * G)
    );
    // A member deleted after being published leaves the others attachable.
    s.delete(1, "p/a", now).unwrap();
    s.attach(2, "p/c", now).unwrap();
}

#[test]
fn a_group_that_lost_an_unpublished_member_never_becomes_attachable() {
    let now = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let grants = create_group(&s, 1, &[("l/a", G), ("l/b", G)], now).unwrap();
    s.publish(1, "l/a", None, now).unwrap();
    // The creator lets l/b go unpublished: it is abandoned, the group incomplete for good.
    s.detach(1, grants[1].attachment).unwrap();
    assert!(matches!(s.attach(2, "l/b", now), Err(Error::UnknownName { .. })));
    match s.attach(2, "l/a", now) {
        Err(Error::WrongState { state, op, .. }) => {
            assert_eq!((state, op), (BufferState::Deleting, OP_ATTACH_GROUP_LOST));
        }
        other => panic!("expected WrongState, got {:?}", other.map(|g| g.attachment)),
    }
    assert_eq!(live(&s), 1, "l/a still holds the memory");
    s.delete(1, "l/a", now).unwrap();
    s.detach(1, grants[0].attachment).unwrap();
    assert_eq!(live(&s), 0);
    assert_eq!(
        s.stats(),
        ServerStats {
            freed: 2,
            connections: 2,
            ..ServerStats::default()
        }
    );
}

#[test]
fn a_groups_memory_goes_with_its_last_member_and_is_never_reused_meanwhile() {
    let now = Instant::now();
    let s = state_with(Rules {
        quotas: Quotas {
            per_uid_bytes: Some(4 * G),
            ..Quotas::default()
        },
        ..rules()
    });
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let grants = create_group(&s, 1, &[("t/a", G), ("t/b", G), ("t/c", G)], now).unwrap();
    for name in ["t/a", "t/b", "t/c"] {
        s.publish(1, name, None, now).unwrap();
    }
    let attached = s.attach(2, "t/b", now).unwrap();
    for g in &grants {
        s.detach(1, g.attachment).unwrap();
    }
    // Delete two members, one of them still attached: the memory stays whole, its bytes
    // charged, and a new buffer gets memory of its own, not a freed member's range.
    s.delete(1, "t/a", now).unwrap();
    s.delete(1, "t/b", now).unwrap();
    assert_eq!((live(&s), bytes_of(&s)), (1, 3 * G));
    assert_eq!(s.stats().bytes, 3 * G);
    let other = create(&s, 1, "t/new", G, now).unwrap();
    assert_ne!(other.memory, grants[0].memory);
    assert_eq!((other.offset, other.memory_size), (0, G));
    assert_eq!((live(&s), bytes_of(&s)), (2, 4 * G));
    assert!(matches!(
        create(&s, 1, "t/more", G, now),
        Err(Error::QuotaExceeded { in_use, .. }) if in_use == 4 * G
    ));
    // The last name goes; the attachment still holds the memory.
    s.delete(1, "t/c", now).unwrap();
    assert_eq!((live(&s), bytes_of(&s)), (2, 4 * G));
    s.detach(2, attached.attachment).unwrap();
    assert_eq!((live(&s), bytes_of(&s)), (1, G), "freed with its last member");
    assert_eq!(s.stats().bytes, G);
    create(&s, 1, "t/more", 3 * G, now).unwrap();
}

#[test]
fn a_reservation_member_deleted_while_allocating_refuses_the_group() {
    let now = Instant::now();
    let s = Arc::new(state());
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let gate = s.backend().block_next();
    let creator = {
        let s = s.clone();
        std::thread::spawn(move || create_group(&s, 1, &[("r/a", G), ("r/b", G)], now).map(|g| g.len()))
    };
    gate.entered.wait();
    // Reserved: listed as being created, taken for a racing create.
    assert!(matches!(create(&s, 2, "r/b", G, now), Err(Error::NameTaken { .. })));
    s.delete(2, "r/b", now).unwrap();
    gate.release.wait();
    match creator.join().unwrap() {
        Err(Error::WrongState { name, state, .. }) => {
            assert_eq!((name.as_str(), state), ("r/b", BufferState::Deleting))
        }
        other => panic!("expected WrongState, got {other:?}"),
    }
    assert_eq!(live(&s), 0);
    let stats = s.stats();
    assert_eq!(
        (stats.buffers, stats.named, stats.bytes, stats.attachments),
        (0, 0, 0, 0)
    );
    // Both names are free again, and the quota was credited.
    create_group(&s, 2, &[("r/a", G), ("r/b", G)], now).unwrap();
}

fn named(s: &Store<HostBackend>, now: Instant) -> Vec<String> {
    s.list("", now).0.into_iter().map(|b| b.name).collect()
}

#[test]
fn expiry_takes_exactly_the_names_whose_deadline_came() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let s = state();
    s.connect(1, UID).unwrap();
    s.connect(2, UID).unwrap();
    let ttl = |conn, name: &str, ttl_ms| s.create(conn, 42, DEV, G, ttl_ms, name, "", &[], t0).unwrap();
    ttl(1, "e/10", 10);
    ttl(1, "e/20a", 20);
    ttl(1, "e/20b", 20);
    ttl(1, "e/none", 0);
    // A group's members share their deadline.
    s.create_many(1, 42, DEV, 30, "", &[], &members(&[("e/g1", G), ("e/g2", G)]), t0)
        .unwrap();
    // Deleted before its deadline, its name reused at once with a later one: the old deadline
    // must not take the new buffer's name, the new one must.
    ttl(1, "e/reused", 15);
    s.delete(1, "e/reused", t0).unwrap();
    ttl(2, "e/reused", 50);
    // One attached by another connection when it expires: the name goes, the memory stays.
    ttl(1, "e/held", 25);
    s.publish(1, "e/held", None, t0).unwrap();
    let held = s.attach(2, "e/held", t0).unwrap();
    let all = ["e/10", "e/20a", "e/20b", "e/g1", "e/g2", "e/held", "e/none", "e/reused"];
    s.expire(t0 + ms(9));
    assert_eq!(named(&s, t0 + ms(9)), all);
    // A deadline is due at its instant, not a moment later.
    s.expire(t0 + ms(10));
    assert_eq!(named(&s, t0 + ms(10)), all[1..]);
    s.expire(t0 + ms(19));
    assert_eq!(named(&s, t0 + ms(19)), all[1..]);
    s.expire(t0 + ms(20));
    assert_eq!(named(&s, t0 + ms(20)), ["e/g1", "e/g2", "e/held", "e/none", "e/reused"]);
    // (The reused name's old deadline, 15 ms, passed: the new buffer kept its name.)
    s.expire(t0 + ms(25));
    assert_eq!(named(&s, t0 + ms(25)), ["e/g1", "e/g2", "e/none", "e/reused"]);
    assert!(matches!(
        s.attach(2, "e/held", t0 + ms(25)),
        Err(Error::UnknownName { .. })
    ));
    s.detach(2, held.attachment).unwrap();
    s.expire(t0 + ms(30));
    assert_eq!(named(&s, t0 + ms(30)), ["e/none", "e/reused"]);
    s.expire(t0 + ms(49));
    assert_eq!(named(&s, t0 + ms(49)), ["e/none", "e/reused"]);
    s.expire(t0 + ms(50));
    assert_eq!(named(&s, t0 + ms(50)), ["e/none"]);
    // Every request expires first: a request at a later instant sees the names gone.
    let late = ttl(1, "e/late", 5);
    assert!(matches!(
        s.attach(2, "e/late", t0 + ms(5)),
        Err(Error::UnknownName { .. })
    ));
    s.detach(1, late.attachment).unwrap();
    assert_eq!(s.with(|st| st.deadlines_held()), 0, "no deadline outlives its buffer");
}

#[test]
fn expiry_visits_only_the_buffers_it_expires() {
    let t0 = Instant::now();
    let s = state();
    s.connect(1, UID).unwrap();
    const MANY: u64 = 2000;
    for i in 0..MANY {
        // Half with a distant deadline, half with none.
        let ttl_ms = if i % 2 == 0 { 3_600_000 } else { 0 };
        s.create(1, 42, DEV, G, ttl_ms, &format!("v/{i:05}"), "", &[], t0)
            .unwrap();
    }
    s.create(1, 42, DEV, G, 10, "v/soon", "", &[], t0).unwrap();
    let visits = || s.with(|st| st.expiry_visits());
    let start = visits();
    // A hundred requests with nothing due: each looks at one deadline at most, not every buffer.
    for i in 0..100 {
        assert!(matches!(
            s.attach(1, "v/missing", t0 + Duration::from_millis(i % 10)),
            Err(Error::UnknownName { .. })
        ));
    }
    let idle = visits() - start;
    assert!(
        idle <= 100,
        "100 requests with nothing due looked at {idle} buffers (of {MANY})"
    );
    // One due: it is looked at, and the next deadline, an hour away, is.
    let start = visits();
    s.expire(t0 + Duration::from_millis(10));
    assert_eq!(s.stats().named, MANY);
    let due = visits() - start;
    assert!(due <= 3, "expiring one buffer looked at {due} buffers (of {MANY})");
    // An hour on, the thousand with a deadline expire, and only they are looked at.
    let start = visits();
    s.expire(t0 + Duration::from_secs(3600));
    let hour = visits() - start;
    assert_eq!(s.stats().named, MANY / 2);
    assert!(
        hour <= MANY / 2 + 1,
        "expiring {} buffers looked at {hour} buffers",
        MANY / 2
    );
}

const OWNER: u32 = 2000;
const OTHER: u32 = 3000;
const THIRD: u32 = 4000;

/// The server runs as `UID`; `OWNER`, `OTHER` and `THIRD` are in its allow-list.
fn shared_rules(quotas: Quotas) -> Rules {
    Rules {
        access: Access {
            allow_uids: vec![OWNER, OTHER, THIRD],
        },
        quotas,
        ..rules()
    }
}

fn names_of(list: &[&str]) -> Vec<String> {
    list.iter().map(|n| (*n).to_owned()).collect()
}

fn create_for(s: &Store<HostBackend>, conn: ConnId, name: &str, size: u64, uids: &[u32], now: Instant) -> Grant {
    let g = s.create(conn, 42, DEV, size, 0, name, "", uids, now).unwrap();
    s.publish(conn, name, None, now).unwrap();
    g
}

fn usage(s: &Store<HostBackend>, uid: u32) -> (u64, u64) {
    let u = s.with(|st| st.usage(uid));
    (u.bytes, u.buffers)
}

fn not_permitted(result: Result<impl Sized>, uid: u32, name: &str) {
    match result {
        Err(Error::NotPermitted { uid: u, what }) => {
            assert_eq!(u, uid);
            assert!(what.contains(&format!("attach buffer {name:?}")), "{what}");
            assert!(what.contains("attach list"), "{what}");
        }
        Err(other) => panic!("expected NotPermitted for uid {uid} attaching {name}, got {other}"),
        Ok(_) => panic!("uid {uid} attached {name}"),
    }
}

#[test]
fn another_uid_cannot_attach_by_default_but_can_when_listed() {
    let now = Instant::now();
    let s = state_with(shared_rules(Quotas::default()));
    s.connect(1, OWNER).unwrap();
    s.connect(2, OTHER).unwrap();
    s.connect(3, THIRD).unwrap();
    s.connect(4, OWNER).unwrap();
    s.connect(5, UID).unwrap();
    create_for(&s, 1, "p/mine", G, &[], now);
    // Every uid the server lets connect sees it listed, but only its owner's uid attaches it:
    // not another uid of the allow-list, nor the server's own.
    assert_eq!(named(&s, now), ["p/mine"]);
    not_permitted(s.attach(2, "p/mine", now), OTHER, "p/mine");
    not_permitted(s.attach(5, "p/mine", now), UID, "p/mine");
    s.attach(4, "p/mine", now).unwrap();
    // Listed: that uid attaches, and only it.
    create_for(&s, 1, "p/listed", G, &[OTHER], now);
    s.attach(2, "p/listed", now).unwrap();
    not_permitted(s.attach(3, "p/listed", now), THIRD, "p/listed");
    // attach_many is all or nothing: a name it may not attach refuses the whole request.
    let before = s.stats().attachments;
    not_permitted(
        s.attach_many(2, &names_of(&["p/listed", "p/mine"]), now),
        OTHER,
        "p/mine",
    );
    assert_eq!(s.stats().attachments, before, "nothing stays attached");
    // A group's members share one list; its owner's uid in the list changes nothing.
    s.create_many(
        1,
        42,
        DEV,
        0,
        "",
        &[THIRD, OWNER],
        &members(&[("p/g1", G), ("p/g2", G)]),
        now,
    )
    .unwrap();
    for name in ["p/g1", "p/g2"] {
        s.publish(1, name, None, now).unwrap();
    }
    assert_eq!(s.attach_many(3, &names_of(&["p/g1", "p/g2"]), now).unwrap().len(), 2);
    not_permitted(s.attach(2, "p/g2", now), OTHER, "p/g2");
    s.attach(4, "p/g1", now).unwrap();
    // A list the decoder would refuse is refused here too (the state trusts no caller).
    for bad in [&[u32::MAX][..], &[OTHER, THIRD, OTHER]] {
        assert!(matches!(
            s.create(1, 42, DEV, G, 0, "p/bad", "", bad, now),
            Err(Error::Protocol { .. })
        ));
    }
    let long: Vec<u32> = (0..=crate::protocol::messages::MAX_ATTACH_UIDS as u32).collect();
    assert!(matches!(
        s.create(1, 42, DEV, G, 0, "p/bad", "", &long, now),
        Err(Error::Protocol { .. })
    ));
    assert!(!named(&s, now).contains(&"p/bad".to_owned()));
}

#[test]
fn after_the_owner_deletes_the_uids_still_attached_pay_not_the_owner() {
    let now = Instant::now();
    let s = state_with(shared_rules(Quotas {
        per_uid_bytes: Some(4 * G),
        per_uid_buffers: Some(2),
        ..Quotas::default()
    }));
    s.connect(1, OWNER).unwrap();
    s.connect(2, OTHER).unwrap();
    s.connect(3, THIRD).unwrap();
    let mine = create_for(&s, 1, "q/w", 4 * G, &[OTHER, THIRD], now);
    s.detach(1, mine.attachment).unwrap();
    let a = s.attach(2, "q/w", now).unwrap();
    let b = s.attach(3, "q/w", now).unwrap();
    assert_eq!(
        usage(&s, OWNER),
        (4 * G, 1),
        "the owner pays while the buffer has its name"
    );
    assert_eq!((usage(&s, OTHER), usage(&s, THIRD)), ((0, 0), (0, 0)));
    s.delete(1, "q/w", now).unwrap();
    // The owner's quota is free at once: another uid's attachment does not pin it.
    assert_eq!(usage(&s, OWNER), (0, 0));
    let next = create_for(&s, 1, "q/next", 4 * G, &[], now);
    // Each uid still attached pays the whole memory (each alone keeps it alive); the total
    // counts it once.
    assert_eq!((usage(&s, OTHER), usage(&s, THIRD)), ((4 * G, 1), (4 * G, 1)));
    assert_eq!(s.with(|st| st.total_usage()).bytes, 8 * G);
    match create(&s, 2, "q/other", G, now) {
        Err(Error::QuotaExceeded {
            scope: QuotaScope::Uid(OTHER),
            kind: QuotaKind::Bytes,
            in_use,
            ..
        }) => assert_eq!(in_use, 4 * G),
        other => panic!(
            "expected OTHER's quota to count the memory it keeps, got {:?}",
            other.map(|g| g.size)
        ),
    }
    // The deleted buffer's bytes show in the stats until the last holder lets go.
    let st = s.stats();
    assert_eq!((st.lingering_buffers, st.lingering_bytes, st.bytes), (1, 4 * G, 8 * G));
    s.detach(2, a.attachment).unwrap();
    assert_eq!((usage(&s, OTHER), usage(&s, THIRD)), ((0, 0), (4 * G, 1)));
    create(&s, 2, "q/other", G, now).unwrap();
    // A holder whose process exits stops paying too; the memory goes with it.
    assert!(s.disconnect(3));
    assert_eq!(usage(&s, THIRD), (4 * G, 1));
    s.process_exited(3);
    assert_eq!(usage(&s, THIRD), (0, 0));
    let st = s.stats();
    assert_eq!((st.lingering_buffers, st.lingering_bytes), (0, 0));
    assert_eq!(live(&s), 2, "q/next and q/other");
    assert_eq!(s.with(|st| st.total_usage()).bytes, 5 * G);
    let _ = (next, b);
}

#[test]
fn the_owner_pays_while_it_holds_the_memory_or_any_member_keeps_a_name() {
    let now = Instant::now();
    let s = state_with(shared_rules(Quotas::default()));
    s.connect(1, OWNER).unwrap();
    s.connect(2, OTHER).unwrap();
    // The owner still attached after its delete: it keeps paying, beside the other holder.
    let mine = create_for(&s, 1, "r/held", 2 * G, &[OTHER], now);
    let theirs = s.attach(2, "r/held", now).unwrap();
    s.delete(1, "r/held", now).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((2 * G, 1), (2 * G, 1)));
    s.detach(1, mine.attachment).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((0, 0), (2 * G, 1)));
    s.detach(2, theirs.attachment).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((0, 0), (0, 0)));
    // A group: while any member keeps its name the owner pays the whole memory; with the last
    // name gone the holders of any member pay it (every member counted, as the owner was).
    let grants = s
        .create_many(
            1,
            42,
            DEV,
            0,
            "",
            &[OTHER],
            &members(&[("r/a", G), ("r/b", G), ("r/c", G)]),
            now,
        )
        .unwrap();
    for (g, name) in grants.iter().zip(["r/a", "r/b", "r/c"]) {
        s.publish(1, name, None, now).unwrap();
        s.detach(1, g.attachment).unwrap();
    }
    let held = s.attach(2, "r/b", now).unwrap();
    s.delete(1, "r/a", now).unwrap();
    s.delete(1, "r/b", now).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((3 * G, 3), (0, 0)));
    assert_eq!((s.stats().lingering_buffers, s.stats().lingering_bytes), (1, 0));
    // Expiry or delete, the last name going moves the charge.
    s.delete(1, "r/c", now).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((0, 0), (3 * G, 3)));
    assert_eq!((s.stats().lingering_buffers, s.stats().lingering_bytes), (1, 3 * G));
    s.detach(2, held.attachment).unwrap();
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((0, 0), (0, 0)));
    assert_eq!(s.with(|st| st.total_usage()).bytes, 0);
    // Expiry moves it the same way.
    s.create(1, 42, DEV, G, 10, "r/ttl", "", &[OTHER], now).unwrap();
    s.publish(1, "r/ttl", None, now).unwrap();
    let held = s.attach(2, "r/ttl", now).unwrap();
    s.disconnect(1);
    s.process_exited(1);
    s.expire(now + Duration::from_millis(10));
    assert_eq!((usage(&s, OWNER), usage(&s, OTHER)), ((0, 0), (G, 1)));
    s.detach(2, held.attachment).unwrap();
    assert_eq!(live(&s), 0);
    assert_eq!(s.with(|st| st.total_usage()), crate::policy::Usage::default());
}
