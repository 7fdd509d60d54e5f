//! The wire format: round trips, every malformed input, and fuzzing of the decoder.

use proptest::prelude::*;

use super::codec::{body_len_bounds, encode_into, MAGIC, MAX_FRAME_LEN};
use super::messages::{MAX_BODY_LEN, MAX_ERROR_TEXT_LEN};
use super::testing::{buffer, every_message, GPU, POOL};
use super::*;
use crate::protocol;
use crate::test_util::{arb_mutation, mutate};

fn frame(message: &Message) -> Vec<u8> {
    protocol::encode(message).unwrap()
}

/// A frame with a hand-made header and body, in the version that defines the type (1 for
/// codes no version defines).
fn raw_frame(message_type: u16, body: &[u8]) -> Vec<u8> {
    let version = MessageType::from_wire(message_type).map_or(1, MessageType::version);
    raw_frame_v(version, message_type, body)
}

fn raw_frame_v(version: u16, message_type: u16, body: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&message_type.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn protocol_reason(err: ProtocolError) -> String {
    match err {
        ProtocolError::Violation { reason } => reason,
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

#[test]
fn every_message_round_trips() {
    for message in every_message() {
        let bytes = frame(&message);
        assert_eq!(protocol::decode(&bytes).unwrap(), message);
        let header = protocol::decode_header(&bytes).unwrap();
        assert_eq!(header.message_type, message.message_type());
        assert_eq!(header.body_len, bytes.len() - HEADER_LEN);
        // Appending to a buffer gives the same bytes.
        let mut out = vec![1, 2, 3];
        encode_into(&message, &mut out).unwrap();
        assert_eq!(&out[3..], &bytes[..]);
    }
}

#[test]
fn header_layout_is_as_specified() {
    let bytes = frame(&Message::Release {
        buffer_id: BufferId(0x0102_0304_0506_0708),
    });
    assert_eq!(
        bytes,
        [
            b'M', b'P', b'I', b'P', // magic
            1, 0, // version 1
            6, 0, // type Release
            8, 0, 0, 0, // body length
            8, 7, 6, 5, 4, 3, 2, 1, // buffer id, little-endian
        ]
    );
    let buffer_frame = frame(&Message::Buffer(buffer(9)));
    assert_eq!(buffer_frame.len(), HEADER_LEN + 176);
    let welcome = frame(&Message::Welcome(Welcome {
        device_uuid: GPU,
        pool_id: POOL,
    }));
    assert_eq!(&welcome[HEADER_LEN..HEADER_LEN + 16], &GPU.0);
    assert_eq!(&welcome[HEADER_LEN + 16..], &POOL.0);
}

#[test]
fn message_types_have_stable_codes_and_descriptor_counts() {
    let codes: Vec<u16> = MessageType::ALL.iter().map(|t| t.to_wire()).collect();
    assert_eq!(codes, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 32, 33, 48, 49]);
    for t in MessageType::ALL {
        assert_eq!(MessageType::from_wire(t.to_wire()), Some(t));
        let fds = match t {
            MessageType::PoolDescriptor | MessageType::VmmBuffer | MessageType::RingSetup => 1,
            MessageType::VmmChunks => MAX_VMM_CHUNKS,
            _ => 0,
        };
        assert_eq!(t.max_descriptors(), fds, "{t}");
    }
    // Every message but a `VmmChunks` carries exactly its type's count; that one, one per chunk.
    for m in every_message() {
        let want = match &m {
            Message::VmmChunks(c) => c.count(),
            other => other.message_type().max_descriptors(),
        };
        assert_eq!(m.descriptor_count(), want, "{m:?}");
    }
    // The most any message carries is what one `sendmsg` can pass.
    assert_eq!(MAX_FDS_PER_MESSAGE, mempool_socket::fdpass::SCM_MAX_FD);
    assert_eq!(MessageType::from_wire(0), None);
    assert_eq!(MessageType::from_wire(12), None);
}

#[test]
fn truncated_at_every_byte_offset() {
    for message in every_message() {
        let bytes = frame(&message);
        for len in 0..bytes.len() {
            match protocol::decode(&bytes[..len]) {
                Err(ProtocolError::Truncated { needed, got }) => {
                    assert_eq!(got, len);
                    assert!(needed > len);
                }
                other => panic!("{message:?} cut at {len}: {other:?}"),
            }
        }
    }
}

#[test]
fn trailing_garbage_is_rejected() {
    for message in every_message() {
        let mut bytes = frame(&message);
        bytes.push(0);
        assert!(
            matches!(protocol::decode(&bytes), Err(ProtocolError::TrailingBytes { len: 1 })),
            "{message:?}"
        );
        // A second frame after the first is also garbage to `decode`.
        let mut two = frame(&message);
        two.extend_from_slice(&frame(&Message::Hello));
        assert!(matches!(
            protocol::decode(&two),
            Err(ProtocolError::TrailingBytes { len }) if len == HEADER_LEN
        ));
    }
}

#[test]
fn bad_magic_is_rejected() {
    let mut bytes = frame(&Message::Hello);
    bytes[..4].copy_from_slice(b"HTTP");
    assert!(matches!(
        protocol::decode(&bytes),
        Err(ProtocolError::BadMagic { got }) if &got == b"HTTP"
    ));
}

#[test]
fn unknown_version_is_rejected() {
    for version in [0u16, 3, 0xffff] {
        let mut bytes = frame(&Message::Hello);
        bytes[4..6].copy_from_slice(&version.to_le_bytes());
        let err = protocol::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtocolError::UnsupportedVersion { got, supported: 2 } if got == version),
            "{err}"
        );
    }
}

#[test]
fn every_type_travels_in_the_version_that_defines_it_and_only_there() {
    for message in every_message() {
        let bytes = frame(&message);
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        assert_eq!(version, message.message_type().version(), "{message:?}");
        // Version-1 messages keep version-1 frames, so a version-1 peer reads them.
        let expected = match message.message_type() {
            MessageType::Hello2
            | MessageType::Welcome2
            | MessageType::ReleaseBatch
            | MessageType::VmmBuffer
            | MessageType::VmmChunks
            | MessageType::RingSetup
            | MessageType::RingBell => 2,
            _ => 1,
        };
        assert_eq!(version, expected, "{message:?}");
        let mut other = bytes.clone();
        other[4..6].copy_from_slice(&(3 - version).to_le_bytes());
        assert!(
            matches!(protocol::decode(&other), Err(ProtocolError::UnknownMessageType { .. })),
            "{message:?} in a version-{} frame was accepted",
            3 - version
        );
    }
}

#[test]
fn release_batch_fields_are_validated() {
    let good = frame(&Message::ReleaseBatch(ReleaseBatch {
        event: Some(EventHandle([7; 64])),
        buffers: vec![BufferId(1), BufferId(2)],
    }));
    assert!(protocol::decode(&good).is_ok());
    // The count must match the ids that follow.
    let mut count = good.clone();
    count[HEADER_LEN] = 3;
    assert!(protocol_reason(protocol::decode(&count).unwrap_err()).contains("count"));
    // Unknown flag bits.
    let mut flags = good.clone();
    flags[HEADER_LEN + 4] |= 2;
    assert!(protocol_reason(protocol::decode(&flags).unwrap_err()).contains("flag"));
    // Event bytes without the flag.
    let mut stray = frame(&Message::ReleaseBatch(ReleaseBatch {
        event: None,
        buffers: vec![BufferId(1)],
    }));
    stray[HEADER_LEN + 8 + 5] = 1;
    assert!(protocol_reason(protocol::decode(&stray).unwrap_err()).contains("event"));
    // An empty batch and one above the limit cannot even be encoded, nor decoded.
    for n in [0, MAX_RELEASE_BATCH + 1] {
        let batch = Message::ReleaseBatch(ReleaseBatch {
            event: None,
            buffers: (0..n as u64).map(BufferId).collect(),
        });
        assert!(protocol::encode(&batch).is_err(), "{n} buffers");
        let mut body = (n as u32).to_le_bytes().to_vec();
        body.extend_from_slice(&[0; 68]);
        body.extend(std::iter::repeat_n(0u8, 8 * n));
        assert!(protocol::decode(&raw_frame(MessageType::ReleaseBatch.to_wire(), &body)).is_err());
    }
}

#[test]
fn version_2_types_in_a_version_1_frame_are_unknown_to_a_version_1_reader() {
    // What an old exporter sees of `Hello2` is its version: refused with UnsupportedVersion
    // (checked before the type). A new reader refuses a v2 code in a v1 frame as unknown.
    let err = protocol::decode(&raw_frame_v(1, MessageType::Hello2.to_wire(), &[0; 8])).unwrap_err();
    assert!(matches!(err, ProtocolError::UnknownMessageType { got: 9 }), "{err}");
}

#[test]
fn unknown_message_type_is_rejected() {
    for code in [0u16, 12, 0x100, 0xffff] {
        let err = protocol::decode(&raw_frame(code, &[])).unwrap_err();
        assert!(
            matches!(err, ProtocolError::UnknownMessageType { got } if got == code),
            "{err}"
        );
    }
}

#[test]
fn oversized_length_is_rejected_from_the_header_alone() {
    for len in [MAX_BODY_LEN as u32 + 1, u32::MAX] {
        let mut header = frame(&Message::Error(ErrorMessage::new(ErrorCode::Internal, "")));
        header[8..12].copy_from_slice(&len.to_le_bytes());
        // Only the header: the receiver must refuse before reading (or allocating) the body.
        let err = protocol::decode_header(&header[..HEADER_LEN]).unwrap_err();
        assert!(
            matches!(err, ProtocolError::MessageTooLarge { len: l, max } if l == len as usize && max == MAX_BODY_LEN),
            "{err}"
        );
    }
}

#[test]
fn body_length_must_fit_the_type() {
    // Every fixed-size message with one byte more and one byte less.
    for message in every_message() {
        let t = message.message_type();
        let (min, max) = body_len_bounds(t);
        let body = &frame(&message)[HEADER_LEN..];
        let mut longer = body.to_vec();
        longer.push(0);
        let shorter = &body[..body.len().saturating_sub(1)];
        for candidate in [&longer[..], shorter] {
            if candidate.len() >= min && candidate.len() <= max {
                continue;
            }
            let err = protocol::decode(&raw_frame(t.to_wire(), candidate)).unwrap_err();
            assert!(
                matches!(err, ProtocolError::BodyLength { message, got, .. } if message == t && got == candidate.len()),
                "{t} with {} bytes: {err}",
                candidate.len()
            );
        }
    }
}

#[test]
fn error_text_length_must_match_the_body() {
    let good = frame(&Message::Error(ErrorMessage::new(ErrorCode::Protocol, "abc")));
    // Claim 4 bytes of text where the body holds 3, then 2.
    for claimed in [4u16, 2] {
        let mut bytes = good.clone();
        bytes[HEADER_LEN + 4..HEADER_LEN + 6].copy_from_slice(&claimed.to_le_bytes());
        assert!(protocol_reason(protocol::decode(&bytes).unwrap_err()).contains("text length"));
    }
}

#[test]
fn error_text_must_be_utf8() {
    let mut body = ErrorCode::Protocol.to_wire().to_le_bytes().to_vec();
    body.extend_from_slice(&2u16.to_le_bytes());
    body.extend_from_slice(&[0xc3, 0x28]);
    let err = protocol::decode(&raw_frame(MessageType::Error.to_wire(), &body)).unwrap_err();
    assert!(protocol_reason(err).contains("UTF-8"));
}

#[test]
fn error_text_is_bounded() {
    // The constructor cuts long text at a character boundary...
    let long = "é".repeat(MAX_ERROR_TEXT_LEN);
    let cut = ErrorMessage::new(ErrorCode::Internal, long);
    assert_eq!(cut.text.len(), MAX_ERROR_TEXT_LEN);
    assert!(protocol::decode(&frame(&Message::Error(cut.clone()))).is_ok());
    // ...and encoding refuses text built around it.
    let too_long = ErrorMessage {
        text: "x".repeat(MAX_ERROR_TEXT_LEN + 1),
        ..cut
    };
    assert!(matches!(
        protocol::encode(&Message::Error(too_long)),
        Err(ProtocolError::MessageTooLarge { .. })
    ));
}

#[test]
fn unknown_error_codes_reach_the_user() {
    let message = Message::Error(ErrorMessage::new(ErrorCode::Other(4242), "from the future"));
    assert_eq!(protocol::decode(&frame(&message)).unwrap(), message);
    for code in 1..=9 {
        assert_eq!(ErrorCode::from_wire(code).to_wire(), code);
        assert!(!matches!(ErrorCode::from_wire(code), ErrorCode::Other(_)));
    }
}

/// The offset of a field in a `Buffer` frame.
const BUFFER_FLAGS: usize = HEADER_LEN + 40;
const BUFFER_RESERVED: usize = HEADER_LEN + 44;
const BUFFER_EVENT: usize = HEADER_LEN + 48 + 64;

#[test]
fn buffer_fields_are_validated() {
    let base = buffer(1);
    let bad = [
        ("block size is 0", BufferDescriptor { block_size: 0, ..base }),
        ("size is 0", BufferDescriptor { size: 0, ..base }),
        (
            "do not fit",
            BufferDescriptor {
                offset: base.block_size - base.size + 1,
                ..base
            },
        ),
        (
            "do not fit",
            BufferDescriptor {
                offset: u64::MAX,
                size: 2,
                block_size: u64::MAX,
                ..base
            },
        ),
    ];
    for (reason, descriptor) in bad {
        let message = Message::Buffer(descriptor);
        // Refused when encoding...
        assert!(protocol_reason(protocol::encode(&message).unwrap_err()).contains(reason));
        // ...and when decoding what a hostile peer built by hand.
        let mut bytes = frame(&Message::Buffer(base));
        let body = &mut bytes[HEADER_LEN..];
        body[16..24].copy_from_slice(&descriptor.block_size.to_le_bytes());
        body[24..32].copy_from_slice(&descriptor.offset.to_le_bytes());
        body[32..40].copy_from_slice(&descriptor.size.to_le_bytes());
        assert!(protocol_reason(protocol::decode(&bytes).unwrap_err()).contains(reason));
    }
    // The largest buffer that fits exactly is fine.
    let edge = BufferDescriptor {
        offset: u64::MAX - 1,
        size: 1,
        block_size: u64::MAX,
        ..base
    };
    assert!(protocol::decode(&frame(&Message::Buffer(edge))).is_ok());
}

#[test]
fn buffer_flags_and_reserved_bits_are_validated() {
    let good = frame(&Message::Buffer(buffer(1)));
    let mut unknown_flag = good.clone();
    unknown_flag[BUFFER_FLAGS] |= 4;
    assert!(protocol_reason(protocol::decode(&unknown_flag).unwrap_err()).contains("flag"));

    let mut reserved = good.clone();
    reserved[BUFFER_RESERVED + 3] = 1;
    assert!(protocol_reason(protocol::decode(&reserved).unwrap_err()).contains("reserved"));

    // No ready-event flag, yet event bytes.
    let mut stray_event = frame(&Message::Buffer(BufferDescriptor {
        ready_event: None,
        ..buffer(1)
    }));
    stray_event[BUFFER_EVENT + 10] = 1;
    assert!(protocol_reason(protocol::decode(&stray_event).unwrap_err()).contains("event"));
}

#[test]
fn pool_descriptor_fields_are_validated() {
    let good = frame(&Message::PoolDescriptor(PoolDescriptor { pool_id: POOL }));
    let mut handle_type = good.clone();
    handle_type[HEADER_LEN + 16] = 8; // CU_MEM_HANDLE_TYPE_FABRIC: not over this socket.
    assert!(protocol_reason(protocol::decode(&handle_type).unwrap_err()).contains("handle type"));
    let mut reserved = good;
    reserved[HEADER_LEN + 20] = 1;
    assert!(protocol_reason(protocol::decode(&reserved).unwrap_err()).contains("reserved"));
}

#[test]
fn all_zero_identities_are_rejected() {
    let nil_uuid = Message::Welcome(Welcome {
        device_uuid: DeviceUuid([0; 16]),
        pool_id: POOL,
    });
    let nil_pool = Message::PoolDescriptor(PoolDescriptor {
        pool_id: PoolId([0; 16]),
    });
    let nil_ready = Message::Ready(Ready {
        device_uuid: DeviceUuid([0; 16]),
    });
    for message in [nil_uuid, nil_pool, nil_ready] {
        assert!(protocol_reason(protocol::encode(&message).unwrap_err()).contains("all zeros"));
    }
    // What a hostile peer could send: valid frames with an identity zeroed.
    let welcome = Message::Welcome(Welcome {
        device_uuid: GPU,
        pool_id: POOL,
    });
    let cases = [
        (welcome.clone(), 0..16),
        (welcome, 16..32),
        (Message::Ready(Ready { device_uuid: GPU }), 0..16),
        (Message::PoolDescriptor(PoolDescriptor { pool_id: POOL }), 0..16),
    ];
    for (message, field) in cases {
        let mut bytes = frame(&message);
        bytes[HEADER_LEN + field.start..HEADER_LEN + field.end].fill(0);
        let err = protocol::decode(&bytes).unwrap_err();
        assert!(protocol_reason(err).contains("all zeros"), "{message:?}");
    }
}

#[test]
fn identities_display_readably() {
    assert_eq!(GPU.to_string(), "GPU-5a1f329e-0471-4c2b-9d10-ee4207883c61");
    assert_ne!(PoolId::generate(), PoolId::generate());
    assert_ne!(PoolId::generate().0, [0; 16]);
}

fn arb_message() -> impl Strategy<Value = Message> {
    let uuid = any::<[u8; 16]>()
        .prop_filter("not nil", |b| *b != [0; 16])
        .prop_map(DeviceUuid);
    let pool = any::<[u8; 16]>()
        .prop_filter("not nil", |b| *b != [0; 16])
        .prop_map(PoolId);
    let buffer = (
        any::<u64>(),
        any::<u64>(),
        1..=u64::MAX,
        any::<u64>(),
        any::<u64>(),
        any::<[u8; 64]>(),
        proptest::option::of(any::<[u8; 64]>()),
        any::<bool>(),
    )
        .prop_map(|(id, block, block_size, a, b, pointer, event, keep_import)| {
            // Pick an offset and size that fit in the block.
            let offset = a % block_size;
            let size = 1 + b % (block_size - offset);
            BufferDescriptor {
                buffer_id: BufferId(id),
                block_id: BlockId(block),
                block_size,
                offset,
                size,
                pointer: PointerDescriptor(pointer),
                ready_event: event.map(EventHandle),
                keep_import,
            }
        });
    let batch = (
        proptest::option::of(any::<[u8; 64]>()),
        proptest::collection::vec(any::<u64>(), 1..=MAX_RELEASE_BATCH),
    )
        .prop_map(|(event, ids)| {
            Message::ReleaseBatch(ReleaseBatch {
                event: event.map(EventHandle),
                buffers: ids.into_iter().map(BufferId).collect(),
            })
        });
    // Ranges over 1 to 253 chunks of any sizes (in units of a multiple of a power-of-two
    // granularity), starting in the first and ending in the last.
    let chunks = (
        any::<u64>(),
        0u32..=5,
        1u64..=8,
        proptest::collection::vec(1u32..=1 << 20, 1..=MAX_VMM_CHUNKS),
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(any::<[u8; 64]>()),
    )
        .prop_map(|(id, g, m, sizes, a, b, event)| {
            let granularity = 1u64 << (16 + g);
            let unit = granularity * m;
            let total: u64 = sizes.iter().map(|&s| u64::from(s) * unit).sum();
            let first = u64::from(sizes[0]) * unit;
            let last_start = total - u64::from(sizes[sizes.len() - 1]) * unit;
            let offset = a % first;
            let lo = offset.max(last_start);
            let end = lo + 1 + b % (total - lo);
            Message::VmmChunks(VmmChunksDescriptor {
                buffer_id: BufferId(id),
                unit,
                granularity,
                offset,
                len: end - offset,
                sizes,
                ready_event: event.map(EventHandle),
            })
        });
    let vmm = (
        any::<u64>(),
        0u32..=30,
        1u64..=1 << 20,
        proptest::option::of(any::<[u8; 64]>()),
    )
        .prop_map(|(id, g, units, event)| {
            Message::VmmBuffer(VmmBufferDescriptor {
                buffer_id: BufferId(id),
                size: units << g,
                granularity: 1 << g,
                ready_event: event.map(EventHandle),
            })
        });
    prop_oneof![
        chunks,
        vmm,
        Just(Message::RingSetup),
        Just(Message::RingBell),
        Just(Message::Hello),
        Just(Message::Goodbye),
        (uuid.clone(), pool.clone())
            .prop_map(|(device_uuid, pool_id)| Message::Welcome(Welcome { device_uuid, pool_id })),
        uuid.clone()
            .prop_map(|device_uuid| Message::Ready(Ready { device_uuid })),
        pool.clone()
            .prop_map(|pool_id| Message::PoolDescriptor(PoolDescriptor { pool_id })),
        buffer.prop_map(Message::Buffer),
        any::<u64>().prop_map(|id| Message::Release {
            buffer_id: BufferId(id)
        }),
        any::<u64>().prop_map(|capabilities| Message::Hello2 { capabilities }),
        (uuid.clone(), pool.clone(), any::<u64>()).prop_map(|(device_uuid, pool_id, capabilities)| Message::Welcome2 {
            welcome: Welcome { device_uuid, pool_id },
            capabilities
        }),
        batch,
        (any::<u32>(), ".{0,300}")
            .prop_map(|(code, text)| Message::Error(ErrorMessage::new(ErrorCode::from_wire(code), text))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Arbitrary bytes never make the decoder panic; whatever it accepts re-encodes to exactly
    /// the same bytes (there is one encoding of each message).
    #[test]
    fn decode_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = protocol::decode_header(&bytes);
        if let Ok(message) = protocol::decode(&bytes) {
            prop_assert_eq!(protocol::encode(&message).unwrap(), bytes);
        }
    }

    /// Arbitrary bodies behind a valid header, for every type: no panic, and acceptance only
    /// of the one encoding.
    #[test]
    fn decode_arbitrary_bodies(
        t in proptest::sample::select(MessageType::ALL.to_vec()),
        body in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let bytes = raw_frame(t.to_wire(), &body);
        if let Ok(message) = protocol::decode(&bytes) {
            prop_assert_eq!(message.message_type(), t);
            prop_assert_eq!(protocol::encode(&message).unwrap(), bytes);
        }
    }

    /// Valid messages round-trip.
    #[test]
    fn valid_messages_round_trip(message in arb_message()) {
        let bytes = protocol::encode(&message).unwrap();
        prop_assert!(bytes.len() <= MAX_FRAME_LEN);
        prop_assert_eq!(protocol::decode(&bytes).unwrap(), message);
    }

    /// Valid frames with bytes flipped, cut or extended: no panic; if accepted, canonical.
    #[test]
    fn mutated_frames(
        message in arb_message(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = protocol::encode(&message).unwrap();
        for (at, xor) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= xor;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        if let Ok(decoded) = protocol::decode(&bytes) {
            prop_assert_eq!(protocol::encode(&decoded).unwrap(), bytes);
        }
    }
}

/// The most one frame may make a decoder allocate, whatever its length and count fields claim:
/// twice the longest frame (the largest allocations are a `VmmChunks`'s sizes and an `Error`'s
/// text, each shorter than the frame, and the text of an error).
const DECODE_ALLOCATION_BUDGET: usize = 2 * MAX_FRAME_LEN;

/// Every decoder on `bytes` (as a frame, as a header, and as the body of every type): none panics
/// (proptest reports a panic as a failure), none allocates more than the budget, and whatever is
/// accepted is the one encoding of what it decoded to.
fn decode_everything(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (header, allocated) = crate::test_util::allocated_by(|| protocol::decode_header(bytes));
    prop_assert!(
        allocated <= DECODE_ALLOCATION_BUDGET,
        "decode_header allocated {allocated} bytes"
    );
    if let Ok(header) = header {
        prop_assert!(header.body_len <= MAX_BODY_LEN);
    }
    let (frame, allocated) = crate::test_util::allocated_by(|| protocol::decode(bytes));
    prop_assert!(
        allocated <= DECODE_ALLOCATION_BUDGET,
        "decode allocated {allocated} bytes"
    );
    if let Ok(message) = frame {
        prop_assert_eq!(&protocol::encode(&message).unwrap(), bytes);
    }
    let body = bytes.get(HEADER_LEN..).unwrap_or(bytes);
    for t in MessageType::ALL {
        let (decoded, allocated) = crate::test_util::allocated_by(|| protocol::decode_body(t, body));
        prop_assert!(
            allocated <= DECODE_ALLOCATION_BUDGET,
            "decode_body({t:?}) of {} bytes allocated {allocated} bytes",
            body.len()
        );
        if let Ok(message) = decoded {
            prop_assert_eq!(message.message_type(), t);
            prop_assert_eq!(&protocol::encode(&message).unwrap()[HEADER_LEN..], body);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Fuzzing every decoder with arbitrary bytes, raw or behind a valid header.
    #[test]
    fn fuzz_wire_decoders_with_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..1400),
        t in proptest::sample::select(MessageType::ALL.to_vec()),
    ) {
        decode_everything(&bytes)?;
        let len = bytes.len().min(MAX_BODY_LEN);
        decode_everything(&raw_frame(t.to_wire(), &bytes[..len]))?;
    }

    /// Fuzzing every decoder with valid frames (which first round-trip, within the budget) damaged
    /// by up to four mutations: flipped, cut, extended, inserted and removed bytes, and header fields
    /// overwritten.
    #[test]
    fn fuzz_wire_decoders_with_mutated_valid_frames(
        message in arb_message(),
        mutations in proptest::collection::vec(arb_mutation(), 1..=4),
    ) {
        let mut bytes = protocol::encode(&message).unwrap();
        let (decoded, allocated) = crate::test_util::allocated_by(|| protocol::decode(&bytes));
        prop_assert_eq!(decoded.unwrap(), message);
        prop_assert!(allocated <= DECODE_ALLOCATION_BUDGET, "decode allocated {allocated} bytes");
        for m in &mutations {
            mutate(&mut bytes, m);
            decode_everything(&bytes)?;
        }
    }
}

#[test]
fn the_allocation_budget_catches_a_decoder_that_trusts_a_length() {
    // What the fuzz tests would see of a decoder that reserved what a length field claims before
    // checking it against the bytes present (a `ReleaseBatch` claiming 2^20 ids).
    let (_, allocated) = crate::test_util::allocated_by(|| Vec::<BufferId>::with_capacity(1 << 20));
    assert!(allocated > DECODE_ALLOCATION_BUDGET, "{allocated}");
    // A decode that allocates (an error's text) is counted, within the budget.
    let bytes = frame(&Message::Error(ErrorMessage::new(
        ErrorCode::Other(1),
        "x".repeat(1000),
    )));
    let (decoded, allocated) = crate::test_util::allocated_by(|| protocol::decode(&bytes));
    assert!(decoded.is_ok());
    assert!((1000..=DECODE_ALLOCATION_BUDGET).contains(&allocated), "{allocated}");
}

/// The module documentation's example (a doctest until the module became private): a message
/// encodes to one frame and decodes back.
#[test]
fn encode_then_decode() -> Result<(), ProtocolError> {
    let frame = protocol::encode(&Message::Release { buffer_id: 7.into() })?;
    assert_eq!(protocol::decode(&frame)?, Message::Release { buffer_id: 7.into() });
    Ok(())
}
