//! The codec: every message round-trips, property tests over arbitrary messages and arbitrary
//! bytes, and hostile frames (bad magic, version, type, oversized, cut short, trailing bytes,
//! fields out of range) refused with a protocol error.

use std::time::Duration;

use proptest::prelude::*;

use super::codec::{decode, decode_body, decode_body_as, decode_header, encode, encode_as, error_of, refusal_of};
use super::messages::*;
use crate::error::{Error, QuotaKind, QuotaScope};
use crate::types::{BufferInfo, BufferState};
use mempool_ipc::DeviceUuid;

fn info(i: u32) -> BufferInfo {
    BufferInfo {
        name: format!("n{i}"),
        size: 2 << 20,
        device: DeviceUuid([i as u8; 16]),
        tag: "tag".into(),
        state: if i.is_multiple_of(2) {
            BufferState::Published
        } else {
            BufferState::Creating
        },
        owner_uid: 1000 + i,
        owner_pid: -1,
        attachments: i,
        expires_in: i.is_multiple_of(3).then(|| Duration::from_millis(u64::from(i) * 7)),
    }
}

fn grant_entry(i: u64) -> GrantEntry {
    GrantEntry {
        attachment: i,
        size: (i + 1) << 21,
        granularity: 2 << 20,
        device: DeviceUuid([i as u8; 16]),
        // Pending relays carry their event; ready ones none.
        event: i.is_multiple_of(2).then_some([i as u8; 64]),
        // Members of groups of three: this one's offset, the group's memory.
        memory: i / 3,
        offset: (i % 3) << 21,
        memory_size: (i % 3 + i + 1) << 21,
    }
}

fn samples() -> Vec<Message> {
    vec![
        Message::Hello,
        Message::Create {
            device: DeviceUuid([3; 16]),
            size: 1 << 34,
            ttl_ms: 9,
            name: "model/w.0".into(),
            tag: "é".into(),
            attach_uids: vec![1001, 0, u32::MAX - 1],
        },
        Message::Create {
            device: DeviceUuid([3; 16]),
            size: 1,
            ttl_ms: 0,
            name: "m".into(),
            tag: String::new(),
            attach_uids: Vec::new(),
        },
        Message::Publish {
            name: "a".into(),
            event: Some([5; 64]),
        },
        Message::Publish {
            name: "a".into(),
            event: None,
        },
        Message::Attach { name: "a".into() },
        Message::Detach { attachment: u64::MAX },
        Message::Delete { name: "a".into() },
        Message::List { after: String::new() },
        Message::Stats,
        Message::Welcome {
            pid: 77,
            devices: vec![(DeviceUuid([1; 16]), 2 << 20), (DeviceUuid([2; 16]), 1 << 21)],
        },
        Message::Granted(GrantEntry {
            attachment: 4,
            size: 6 << 20,
            granularity: 2 << 20,
            device: DeviceUuid([1; 16]),
            event: Some([9; 64]),
            memory: u64::MAX,
            offset: 2 << 20,
            memory_size: 8 << 20,
        }),
        Message::Done,
        Message::CreateMany {
            device: DeviceUuid([4; 16]),
            ttl_ms: 0,
            tag: "t".repeat(256),
            attach_uids: (0..MAX_ATTACH_UIDS as u32).map(|u| u * 1000).collect(),
            members: (0..MAX_ATTACH_MANY)
                .map(|i| (format!("{i:0>128}"), u64::MAX - i as u64))
                .collect(),
        },
        Message::CreateMany {
            device: DeviceUuid([4; 16]),
            ttl_ms: 5,
            tag: String::new(),
            attach_uids: Vec::new(),
            members: vec![("one".into(), 1)],
        },
        Message::AttachMany {
            names: (0..MAX_ATTACH_MANY).map(|i| format!("{i:0>128}")).collect(),
        },
        Message::AttachMany {
            names: vec!["one".into()],
        },
        Message::GrantedMany {
            grants: (0..MAX_ATTACH_MANY as u64).map(grant_entry).collect(),
        },
        Message::ListPage {
            more: true,
            entries: (0..MAX_LIST_PAGE as u32).map(info).collect(),
        },
        Message::StatsReply {
            numbers: [1, 2, 3, 4, 5, 6, 7, 8, u64::MAX],
        },
        Message::Refused(Refusal {
            code: 5,
            uid: 3,
            scope: 0,
            kind: 1,
            state: 0,
            numbers: [1, 2, 3],
            name: "x".into(),
            text: "y".into(),
        }),
    ]
}

#[test]
fn every_message_round_trips() {
    for m in samples() {
        let frame = encode(&m).unwrap();
        assert!(frame.len() - HEADER_LEN <= MAX_BODY_LEN, "{:?}", m.kind());
        assert_eq!(decode(&frame).unwrap(), m);
    }
}

#[test]
fn the_longest_list_page_fits() {
    let big = |i: u32| BufferInfo {
        name: format!("{i:0>128}"),
        tag: "t".repeat(256),
        ..info(i)
    };
    let m = Message::ListPage {
        more: false,
        entries: (0..MAX_LIST_PAGE as u32).map(big).collect(),
    };
    assert_eq!(decode(&encode(&m).unwrap()).unwrap(), m);
}

fn protocol(result: crate::error::Result<Message>) -> String {
    match result {
        Err(Error::Protocol { reason }) => reason,
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

#[test]
fn hostile_headers_are_refused() {
    let frame = encode(&Message::Hello).unwrap();
    let header = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
        let mut h: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
        f(&mut h);
        decode_header(&h).map(|_| Message::Done)
    };
    assert!(protocol(header(&|h| h[0] = b'X')).contains("magic"));
    assert!(protocol(header(&|h| h[..4].copy_from_slice(b"MPIP"))).contains("magic"));
    assert!(protocol(header(&|h| h[4] = 1)).contains("version 1, this side speaks versions 2 to 3"));
    assert!(protocol(header(&|h| h[4] = 4)).contains("version 4"));
    assert!(protocol(header(&|h| h[5] = 1)).contains("version 259"));
    for version in [2u8, 3] {
        assert_eq!(
            decode_header(&{
                let mut h: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
                h[4] = version;
                h
            })
            .unwrap()
            .version,
            u16::from(version)
        );
    }
    assert!(protocol(header(&|h| h[6] = 200)).contains("unknown message type 200"));
    assert!(protocol(header(
        &|h| h[8..12].copy_from_slice(&(MAX_BODY_LEN as u32 + 1).to_le_bytes())
    ))
    .contains("limit"));
    assert!(protocol(header(&|h| h[8..12].copy_from_slice(&u32::MAX.to_le_bytes()))).contains("limit"));
    assert!(protocol(decode(&frame[..5])).contains("header"));
}

#[test]
fn hostile_bodies_are_refused() {
    for m in samples() {
        let frame = encode(&m).unwrap();
        let body = &frame[HEADER_LEN..];
        // Every truncation is refused (or, for an empty body, there is none).
        for cut in 0..body.len() {
            protocol(decode_body(m.kind(), &body[..cut]));
        }
        // Trailing bytes are refused.
        let mut long = body.to_vec();
        long.push(0);
        assert!(protocol(decode_body(m.kind(), &long)).contains("after the end"));
    }
    // A string that is not UTF-8.
    let mut body = encode(&Message::Attach { name: "ab".into() }).unwrap()[HEADER_LEN..].to_vec();
    body[2] = 0xff;
    assert!(protocol(decode_body(MessageKind::Attach, &body)).contains("UTF-8"));
    // A string length past the body.
    let body = [0xff, 0xff, b'a'];
    assert!(protocol(decode_body(MessageKind::Attach, &body)).contains("cut short"));
    // A flag that is not 0 or 1, and an absent event that is not zeros.
    let mut body = encode(&Message::Publish {
        name: "a".into(),
        event: None,
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    body[0] = 2;
    assert!(protocol(decode_body(MessageKind::Publish, &body)).contains("flag"));
    body[0] = 0;
    body[5] = 1;
    assert!(protocol(decode_body(MessageKind::Publish, &body)).contains("zeros"));
}

#[test]
fn a_list_entry_without_an_expiry_must_say_zero_milliseconds() {
    // Found by the fuzz tests: the decoder ignored the milliseconds of an entry whose expiry flag
    // was clear, so two encodings decoded to the same entry (as an absent event must be zeros, an
    // absent expiry must be 0).
    let page = Message::ListPage {
        more: false,
        entries: vec![BufferInfo {
            expires_in: None,
            ..info(1)
        }],
    };
    let mut body = encode(&page).unwrap()[HEADER_LEN..].to_vec();
    assert_eq!(decode_body(MessageKind::ListPage, &body).unwrap(), page);
    let ms = body.len() - 8;
    assert_eq!(body[ms - 1], 0, "the expiry flag, clear");
    body[ms] = 1;
    let reason = protocol(decode_body(MessageKind::ListPage, &body));
    assert!(reason.contains("expiry") && reason.contains("1 ms"), "{reason}");
}

#[test]
fn hostile_grants_are_refused() {
    let placed = |size: u64, granularity: u64, offset: u64, memory_size: u64| {
        let m = Message::Granted(GrantEntry {
            attachment: 1,
            size,
            granularity,
            device: DeviceUuid([1; 16]),
            event: None,
            memory: 1,
            offset,
            memory_size,
        });
        decode(&encode(&m).unwrap())
    };
    let granted = |size: u64, granularity: u64| placed(size, granularity, 0, size);
    assert!(granted(4096, 4096).is_ok());
    assert!(protocol(granted(4096, 3000)).contains("power of two"));
    assert!(protocol(granted(4096, 0)).contains("power of two"));
    assert!(protocol(granted(0, 4096)).contains("multiple"));
    assert!(protocol(granted(6000, 4096)).contains("multiple"));
    assert!(protocol(granted(1 << 63, 4096)).contains("addresses"));
    // A member of a group: its range inside the memory, everything granular.
    assert!(placed(4096, 4096, 8192, 3 * 4096).is_ok());
    assert!(placed(4096, 4096, 0, 4096).is_ok());
    assert!(protocol(placed(4096, 4096, 100, 3 * 4096)).contains("offset 100"));
    assert!(protocol(placed(4096, 4096, 4096, 5000)).contains("memory size 5000"));
    assert!(protocol(placed(4096, 4096, 0, 0)).contains("memory size 0"));
    assert!(protocol(placed(4096, 4096, 0, 1 << 63)).contains("addresses"));
    assert!(protocol(placed(4096, 4096, 8192, 8192)).contains("passes the end"));
    assert!(protocol(placed(8192, 4096, 0, 4096)).contains("passes the end"));
    assert!(protocol(placed(4096, 4096, u64::MAX - 4095, 8192)).contains("passes the end"));
    // Counts past the limits.
    let mut w = encode(&Message::Welcome {
        pid: 1,
        devices: vec![],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    w[4..6].copy_from_slice(&(MAX_DEVICES as u16 + 1).to_le_bytes());
    assert!(protocol(decode_body(MessageKind::Welcome, &w)).contains("devices"));
    let mut l = encode(&Message::ListPage {
        more: false,
        entries: vec![],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    l[1..3].copy_from_slice(&(MAX_LIST_PAGE as u16 + 1).to_le_bytes());
    assert!(protocol(decode_body(MessageKind::ListPage, &l)).contains("entries"));
    // Encoding refuses what decoding would.
    assert!(encode(&Message::ListPage {
        more: false,
        entries: (0..101).map(info).collect()
    })
    .is_err());
    assert!(encode(&Message::Attach {
        name: "a".repeat(70_000)
    })
    .is_err());
}

#[test]
fn attach_many_counts_and_grants_are_checked() {
    // Counts of 0 and past the limit: neither encoded nor decoded.
    for count in [0, MAX_ATTACH_MANY + 1] {
        let names = Message::AttachMany {
            names: (0..count).map(|i| format!("n{i}")).collect(),
        };
        assert!(protocol(encode(&names).map(|_| Message::Done)).contains("names in one message"));
        let grants = Message::GrantedMany {
            grants: (0..count as u64).map(grant_entry).collect(),
        };
        assert!(protocol(encode(&grants).map(|_| Message::Done)).contains("grants in one message"));
    }
    let one = encode(&Message::AttachMany {
        names: vec!["a".into()],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    for count in [0u16, MAX_ATTACH_MANY as u16 + 1, u16::MAX] {
        let mut body = one.clone();
        body[0..2].copy_from_slice(&count.to_le_bytes());
        assert!(protocol(decode_body(MessageKind::AttachMany, &body)).contains("entries"));
    }
    // A count that claims more names than follow.
    let mut body = one.clone();
    body[0..2].copy_from_slice(&2u16.to_le_bytes());
    assert!(protocol(decode_body(MessageKind::AttachMany, &body)).contains("cut short"));
    let many = encode(&Message::GrantedMany {
        grants: vec![grant_entry(1)],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    for count in [0u16, MAX_ATTACH_MANY as u16 + 1] {
        let mut body = many.clone();
        body[0..2].copy_from_slice(&count.to_le_bytes());
        assert!(protocol(decode_body(MessageKind::GrantedMany, &body)).contains("entries"));
    }
    // Every entry gets a Granted's descriptor checks.
    let bad = GrantEntry {
        size: 6000,
        granularity: 4096,
        ..grant_entry(3)
    };
    let frame = encode(&Message::GrantedMany {
        grants: vec![grant_entry(1), bad],
    })
    .unwrap();
    assert!(protocol(decode(&frame)).contains("multiple"));
    // CreateMany: counts of 0 and past the limit, a count claiming more members than follow,
    // trailing bytes.
    for count in [0, MAX_ATTACH_MANY + 1] {
        let create = Message::CreateMany {
            device: DeviceUuid([1; 16]),
            ttl_ms: 0,
            tag: String::new(),
            attach_uids: Vec::new(),
            members: (0..count).map(|i| (format!("n{i}"), 4096)).collect(),
        };
        assert!(protocol(encode(&create).map(|_| Message::Done)).contains("members in one message"));
    }
    let one = encode(&Message::CreateMany {
        device: DeviceUuid([1; 16]),
        ttl_ms: 0,
        tag: String::new(),
        attach_uids: Vec::new(),
        members: vec![("a".into(), 4096)],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    // uuid 16, ttl 8, tag 2, an empty attach list 2: the count at 28.
    for count in [0u16, MAX_ATTACH_MANY as u16 + 1, u16::MAX] {
        let mut body = one.clone();
        body[28..30].copy_from_slice(&count.to_le_bytes());
        assert!(protocol(decode_body(MessageKind::CreateMany, &body)).contains("entries"));
    }
    let mut body = one.clone();
    body[28..30].copy_from_slice(&2u16.to_le_bytes());
    assert!(protocol(decode_body(MessageKind::CreateMany, &body)).contains("cut short"));
    let mut body = one.clone();
    body.push(0);
    assert!(protocol(decode_body(MessageKind::CreateMany, &body)).contains("after the end"));
    // Descriptors: a GrantedMany carries one per entry, other messages none or one.
    assert_eq!(MessageKind::GrantedMany.max_fds(), MAX_ATTACH_MANY);
    assert_eq!(MessageKind::AttachMany.max_fds(), 0);
    let m = Message::GrantedMany {
        grants: (0..5).map(grant_entry).collect(),
    };
    assert_eq!(m.fd_count(), 5);
}

#[test]
fn refusals_travel_as_the_same_error() {
    let errors = vec![
        Error::NameTaken { name: "a".into() },
        Error::UnknownName { name: "b".into() },
        Error::BadName {
            name: "/x".into(),
            rule: "a name must not start with '/'",
        },
        Error::BadTag { len: 300, max: 256 },
        Error::QuotaExceeded {
            scope: QuotaScope::Uid(7),
            kind: QuotaKind::Bytes,
            limit: 1,
            in_use: 2,
            requested: 3,
        },
        Error::QuotaExceeded {
            scope: QuotaScope::Total,
            kind: QuotaKind::Buffers,
            limit: 4,
            in_use: 4,
            requested: 1,
        },
        Error::NotPermitted {
            uid: 9,
            what: "delete".into(),
        },
        Error::WrongState {
            name: "c".into(),
            state: BufferState::Creating,
            op: "attach",
        },
        Error::WrongState {
            name: "c".into(),
            state: BufferState::Published,
            op: "publish",
        },
        Error::WrongState {
            name: "g/a".into(),
            state: BufferState::Creating,
            op: crate::protocol::codec::OP_ATTACH_GROUP_UNPUBLISHED,
        },
        Error::WrongState {
            name: "g/a".into(),
            state: BufferState::Deleting,
            op: crate::protocol::codec::OP_ATTACH_GROUP_LOST,
        },
        Error::WrongState {
            name: "g/b".into(),
            state: BufferState::Deleting,
            op: crate::protocol::codec::OP_FINISH_CREATE,
        },
        Error::NotCreator { name: "d".into() },
        Error::BadSize {
            size: 0,
            reason: "empty".into(),
        },
        Error::DeviceNotServed { device: "GPU-1".into() },
        Error::Busy { reason: "full".into() },
        Error::ServerGpu {
            message: "out of memory".into(),
        },
    ];
    for e in errors {
        let wire = refusal_of(&e);
        let back = decode(&encode(&Message::Refused(wire.clone())).unwrap()).unwrap();
        assert_eq!(back, Message::Refused(wire.clone()));
        assert_eq!(error_of(wire).to_string(), e.to_string());
    }
    // Other errors travel as the server's failure, with their message.
    let e = error_of(refusal_of(&Error::InvalidArgument("z".into())));
    assert!(
        matches!(&e, Error::ServerGpu { message } if message.contains('z')),
        "{e}"
    );
    // An unknown code is a protocol error, not a panic.
    assert!(matches!(
        error_of(Refusal {
            code: 999,
            ..Refusal::default()
        }),
        Error::Protocol { .. }
    ));
    // Long names and texts are cut to fit.
    let long = refusal_of(&Error::UnknownName {
        name: "é".repeat(1000)
    });
    assert!(long.name.len() <= 512);
    assert!(encode(&Message::Refused(long)).is_ok());
}

fn arb_string(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..max)
        .prop_map(|c| c.into_iter().collect::<String>())
        .prop_filter("fits a string field", |s| s.len() <= 400)
}

fn arb_event() -> impl Strategy<Value = Option<EventBytes>> {
    proptest::option::of(proptest::collection::vec(any::<u8>(), 64).prop_map(|v| <[u8; 64]>::try_from(v).unwrap()))
}

/// An attach list: distinct uids, none `u32::MAX`.
fn arb_uids() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::btree_set(0..u32::MAX, 0..MAX_ATTACH_UIDS).prop_map(|s| s.into_iter().collect())
}

/// `m` as version 2 carries it: no attach list, the first 7 counters.
fn as_v2(m: Message) -> Message {
    match m {
        Message::Create {
            device,
            size,
            ttl_ms,
            name,
            tag,
            ..
        } => Message::Create {
            device,
            size,
            ttl_ms,
            name,
            tag,
            attach_uids: Vec::new(),
        },
        Message::CreateMany {
            device,
            ttl_ms,
            tag,
            members,
            ..
        } => Message::CreateMany {
            device,
            ttl_ms,
            tag,
            attach_uids: Vec::new(),
            members,
        },
        Message::StatsReply { mut numbers } => {
            numbers[STATS_NUMBERS_V2..].fill(0);
            Message::StatsReply { numbers }
        }
        other => other,
    }
}

fn arb_message() -> impl Strategy<Value = Message> {
    let welcome = (
        any::<u32>(),
        proptest::collection::vec((any::<[u8; 16]>(), 0u32..64), 0..=MAX_DEVICES),
    )
        .prop_map(|(pid, devices)| Message::Welcome {
            pid,
            devices: devices
                .into_iter()
                .map(|(uuid, shift)| (DeviceUuid(uuid), 1u64 << shift))
                .collect(),
        });
    prop_oneof![
        welcome,
        Just(Message::Hello),
        Just(Message::Stats),
        Just(Message::Done),
        (
            any::<[u8; 16]>(),
            any::<u64>(),
            any::<u64>(),
            arb_string(40),
            arb_string(40),
            arb_uids()
        )
            .prop_map(|(d, size, ttl_ms, name, tag, attach_uids)| Message::Create {
                device: DeviceUuid(d),
                size,
                ttl_ms,
                name,
                tag,
                attach_uids
            }),
        (arb_string(40), arb_event()).prop_map(|(name, event)| Message::Publish { name, event }),
        arb_string(40).prop_map(|name| Message::Attach { name }),
        arb_string(40).prop_map(|name| Message::Delete { name }),
        arb_string(40).prop_map(|after| Message::List { after }),
        any::<u64>().prop_map(|attachment| Message::Detach { attachment }),
        (
            any::<u64>(),
            0u32..40,
            12u32..30,
            any::<[u8; 16]>(),
            arb_event(),
            (any::<u64>(), 0u32..40, 0u32..40)
        )
            .prop_map(|(a, units, shift, d, event, (memory, before, after))| {
                let granularity = 1u64 << shift;
                Message::Granted(GrantEntry {
                    attachment: a,
                    size: u64::from(units + 1) * granularity,
                    granularity,
                    device: DeviceUuid(d),
                    event,
                    memory,
                    offset: u64::from(before) * granularity,
                    memory_size: u64::from(before + units + 1 + after) * granularity,
                })
            }),
        (
            any::<[u8; 16]>(),
            any::<u64>(),
            arb_string(40),
            arb_uids(),
            proptest::collection::vec((arb_string(40), any::<u64>()), 1..10)
        )
            .prop_map(|(d, ttl_ms, tag, attach_uids, members)| Message::CreateMany {
                device: DeviceUuid(d),
                ttl_ms,
                tag,
                attach_uids,
                members
            }),
        proptest::collection::vec(arb_string(40), 1..10).prop_map(|names| Message::AttachMany { names }),
        proptest::collection::vec(
            (any::<u64>(), 0u32..40, 12u32..30, any::<[u8; 16]>(), arb_event()),
            1..10
        )
        .prop_map(|entries| Message::GrantedMany {
            grants: entries
                .into_iter()
                .map(|(a, units, shift, d, event)| GrantEntry {
                    attachment: a,
                    size: u64::from(units + 1) << shift,
                    granularity: 1 << shift,
                    device: DeviceUuid(d),
                    event,
                    memory: a ^ 1,
                    offset: 0,
                    memory_size: u64::from(units + 1) << shift,
                })
                .collect()
        }),
        (any::<bool>(), proptest::collection::vec(any::<u32>(), 0..20)).prop_map(|(more, ids)| Message::ListPage {
            more,
            entries: ids.into_iter().map(info).collect()
        }),
        any::<[u64; STATS_NUMBERS]>().prop_map(|numbers| Message::StatsReply { numbers }),
        (
            any::<u16>(),
            any::<u32>(),
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
            any::<[u64; 3]>(),
            arb_string(30),
            arb_string(30)
        )
            .prop_map(
                |(code, uid, scope, kind, state, numbers, name, text)| Message::Refused(Refusal {
                    code,
                    uid,
                    scope,
                    kind,
                    state,
                    numbers,
                    name,
                    text
                })
            ),
    ]
}

proptest! {
    #[test]
    fn arbitrary_messages_round_trip(m in arb_message()) {
        let frame = encode(&m).unwrap();
        prop_assert_eq!(decode(&frame).unwrap(), m);
    }

    #[test]
    fn arbitrary_messages_round_trip_in_version_2(m in arb_message()) {
        let m = as_v2(m);
        let frame = encode_as(&m, MIN_VERSION).unwrap();
        prop_assert_eq!(decode_header(frame[..HEADER_LEN].try_into().unwrap()).unwrap().version, MIN_VERSION);
        prop_assert_eq!(decode(&frame).unwrap(), m);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        kind in 0u16..80,
        version in MIN_VERSION..=VERSION,
        body in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        if let Some(kind) = MessageKind::from_code(kind) {
            // Whatever it decodes to encodes back to the same bytes, in the same version.
            if let Ok(m) = decode_body_as(kind, version, &body) {
                prop_assert_eq!(&encode_as(&m, version).unwrap()[HEADER_LEN..], &body[..]);
            }
        }
    }

    #[test]
    fn flipped_bytes_never_panic(m in arb_message(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut frame = encode(&m).unwrap();
        let i = at.index(frame.len());
        frame[i] ^= 1 << bit;
        let _ = decode(&frame);
    }
}

#[test]
fn version_2_carries_no_attach_list_and_seven_counters() {
    for m in samples() {
        let v2 = as_v2(m.clone());
        let frame = encode_as(&v2, MIN_VERSION).unwrap();
        assert_eq!(u16::from_le_bytes([frame[4], frame[5]]), MIN_VERSION);
        assert_eq!(decode(&frame).unwrap(), v2);
        // A message that needs version 3 is refused in version 2, naming why.
        if v2 != m {
            if let Message::StatsReply { .. } = m {
                // The new counters are dropped: a version-2 client does not know them.
                assert_eq!(encode_as(&m, MIN_VERSION).unwrap(), frame);
            } else {
                let err = protocol(encode_as(&m, MIN_VERSION).map(|_| Message::Done));
                assert!(err.contains("attach list") && err.contains("version 2"), "{err}");
            }
        }
    }
    // Version 2's bodies, byte for byte: a Create ends with its tag, a StatsReply is 7 numbers.
    let create = Message::Create {
        device: DeviceUuid([1; 16]),
        size: 4096,
        ttl_ms: 0,
        name: "a".into(),
        tag: "t".into(),
        attach_uids: Vec::new(),
    };
    assert_eq!(
        encode_as(&create, MIN_VERSION).unwrap().len(),
        HEADER_LEN + 16 + 8 + 8 + 3 + 3
    );
    assert_eq!(encode(&create).unwrap().len(), HEADER_LEN + 16 + 8 + 8 + 3 + 3 + 2);
    let stats = Message::StatsReply {
        numbers: [7; STATS_NUMBERS],
    };
    assert_eq!(encode_as(&stats, MIN_VERSION).unwrap().len(), HEADER_LEN + 7 * 8);
    // A body of one version is not read as the other's.
    let v2 = &encode_as(&create, MIN_VERSION).unwrap()[HEADER_LEN..];
    assert!(protocol(decode_body_as(MessageKind::Create, VERSION, v2)).contains("cut short"));
    let v3 = &encode(&create).unwrap()[HEADER_LEN..];
    assert!(protocol(decode_body_as(MessageKind::Create, MIN_VERSION, v3)).contains("after the end"));
    // Neither side encodes or decodes a version it does not speak.
    for version in [0, 1, VERSION + 1] {
        assert!(protocol(encode_as(&Message::Hello, version).map(|_| Message::Done)).contains("speaks versions"));
        assert!(protocol(decode_body_as(MessageKind::Hello, version, &[])).contains("speaks versions"));
    }
}

#[test]
fn hostile_attach_lists_are_refused() {
    let create = |uids: Vec<u32>| Message::Create {
        device: DeviceUuid([1; 16]),
        size: 4096,
        ttl_ms: 0,
        name: "a".into(),
        tag: String::new(),
        attach_uids: uids,
    };
    // The encoder refuses what the decoder would.
    let too_long: Vec<u32> = (0..=MAX_ATTACH_UIDS as u32).collect();
    assert!(protocol(encode(&create(too_long)).map(|_| Message::Done)).contains("at most 64"));
    assert!(protocol(encode(&create(vec![5, 6, 5])).map(|_| Message::Done)).contains("uid 5 twice"));
    assert!(protocol(encode(&create(vec![u32::MAX])).map(|_| Message::Done)).contains("no uid"));
    // The decoder: uuid 16, size 8, ttl 8, name 3, tag 2, then the list's count and uids.
    let body = encode(&create(vec![7, 8])).unwrap()[HEADER_LEN..].to_vec();
    let at = 16 + 8 + 8 + 3 + 2;
    assert_eq!(&body[at..], &[2, 0, 7, 0, 0, 0, 8, 0, 0, 0]);
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = body.clone();
        f(&mut b);
        decode_body(MessageKind::Create, &b)
    };
    assert!(protocol(with(&|b| b[at..at + 2].copy_from_slice(&65u16.to_le_bytes()))).contains("at most 64"));
    assert!(protocol(with(&|b| b[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes()))).contains("at most 64"));
    assert!(protocol(with(&|b| b[at..at + 2].copy_from_slice(&3u16.to_le_bytes()))).contains("cut short"));
    assert!(protocol(with(&|b| b[at + 6..at + 10].copy_from_slice(&7u32.to_le_bytes()))).contains("uid 7 twice"));
    assert!(protocol(with(&|b| b[at + 2..at + 6].copy_from_slice(&u32::MAX.to_le_bytes()))).contains("no uid"));
    assert!(protocol(with(&|b| b.push(0))).contains("after the end"));
    // The same in a CreateMany: uuid 16, ttl 8, tag 2, then the list.
    let many = encode(&Message::CreateMany {
        device: DeviceUuid([1; 16]),
        ttl_ms: 0,
        tag: String::new(),
        attach_uids: vec![9, 9 + 1],
        members: vec![("a".into(), 4096)],
    })
    .unwrap()[HEADER_LEN..]
        .to_vec();
    let mut b = many.clone();
    b[26 + 6..26 + 10].copy_from_slice(&9u32.to_le_bytes());
    assert!(protocol(decode_body(MessageKind::CreateMany, &b)).contains("uid 9 twice"));
    let mut b = many;
    b[26..28].copy_from_slice(&(MAX_ATTACH_UIDS as u16 + 1).to_le_bytes());
    assert!(protocol(decode_body(MessageKind::CreateMany, &b)).contains("at most 64"));
}

/// The most one frame may make a decoder allocate, whatever its length and count fields claim:
/// twice the longest frame (its strings are shorter than the frame; the vectors a count reserves
/// hold at most `MAX_ATTACH_MANY` grants or `MAX_LIST_PAGE` entries).
const DECODE_ALLOCATION_BUDGET: usize = 2 * (HEADER_LEN + MAX_BODY_LEN);

/// Every decoder on `bytes` (as a frame, its header, and as the body of every type), and the
/// translation of a decoded refusal into an error: none panics (proptest reports a panic as a
/// failure), none allocates more than the budget, and whatever is accepted is the one encoding of
/// what it decoded to.
fn decode_everything(bytes: &[u8]) -> Result<(), TestCaseError> {
    use crate::test_util::allocated_by;
    if let Some(header) = bytes.get(..HEADER_LEN) {
        let header: &[u8; HEADER_LEN] = header.try_into().unwrap();
        let (decoded, allocated) = allocated_by(|| decode_header(header));
        prop_assert!(
            allocated <= DECODE_ALLOCATION_BUDGET,
            "decode_header allocated {allocated} bytes"
        );
        if let Ok(h) = decoded {
            prop_assert!(h.body_len <= MAX_BODY_LEN);
        }
    }
    let (decoded, allocated) = allocated_by(|| decode(bytes));
    prop_assert!(
        allocated <= DECODE_ALLOCATION_BUDGET,
        "decode allocated {allocated} bytes"
    );
    if let Ok(m) = decoded {
        // Re-encoded in the frame's own version (a connection speaks version 2 or 3).
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        prop_assert_eq!(&encode_as(&m, version).unwrap(), bytes);
    }
    let body = bytes.get(HEADER_LEN..).unwrap_or(bytes);
    for kind in (0..=80).filter_map(MessageKind::from_code) {
        let (decoded, allocated) = allocated_by(|| decode_body(kind, body));
        prop_assert!(
            allocated <= DECODE_ALLOCATION_BUDGET,
            "decode_body({kind:?}) of {} bytes allocated {allocated} bytes",
            body.len()
        );
        if let Ok(m) = decoded {
            prop_assert_eq!(&encode(&m).unwrap()[HEADER_LEN..], body);
            if let Message::Refused(r) = m {
                // A refusal from a hostile server becomes an error without a panic.
                let _ = error_of(r).to_string();
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Fuzzing every decoder with arbitrary bytes, raw or behind a valid header of any type.
    #[test]
    fn fuzz_store_decoders_with_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..1200),
        code in 0u16..80,
    ) {
        decode_everything(&bytes)?;
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&VERSION.to_le_bytes());
        frame.extend_from_slice(&code.to_le_bytes());
        frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        frame.extend_from_slice(&bytes);
        decode_everything(&frame)?;
    }

    /// Fuzzing every decoder with valid frames (which first round-trip, within the budget) damaged
    /// by up to four mutations: flipped, cut, extended, inserted and removed bytes, and header fields
    /// overwritten.
    #[test]
    fn fuzz_store_decoders_with_mutated_valid_frames(
        m in arb_message(),
        mutations in proptest::collection::vec(crate::test_util::arb_mutation(), 1..=4),
    ) {
        let mut bytes = encode(&m).unwrap();
        let (decoded, allocated) = crate::test_util::allocated_by(|| decode(&bytes));
        prop_assert_eq!(decoded.unwrap(), m);
        prop_assert!(allocated <= DECODE_ALLOCATION_BUDGET, "decode allocated {allocated} bytes");
        for mutation in &mutations {
            crate::test_util::mutate(&mut bytes, mutation);
            decode_everything(&bytes)?;
        }
    }
}

#[test]
fn fuzz_store_decoders_with_the_largest_frames_mutated() {
    // The samples hold the largest messages (a full list page, 128 names of 128 bytes, 128 grants):
    // each damaged a few hundred ways, deterministically.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = proptest::collection::vec(crate::test_util::arb_mutation(), 1..=3);
    for m in samples() {
        let frame = encode(&m).unwrap();
        let (decoded, allocated) = crate::test_util::allocated_by(|| decode(&frame));
        assert_eq!(decoded.unwrap(), m);
        assert!(allocated <= DECODE_ALLOCATION_BUDGET, "{m:?}: {allocated} bytes");
        for _ in 0..200 {
            let mutations = proptest::strategy::ValueTree::current(&strategy.new_tree(&mut runner).unwrap());
            let mut bytes = frame.clone();
            for mutation in &mutations {
                crate::test_util::mutate(&mut bytes, mutation);
            }
            decode_everything(&bytes).unwrap_or_else(|e| panic!("{m:?} after {mutations:?}: {e}"));
        }
    }
}
