//! The VMM additions to the wire format: the `VmmBuffer` layout, hostile bodies, and the
//! capability bit.

use super::messages::MAX_BODY_LEN;
use super::testing::{vmm_buffer, vmm_chunks, GPU, POOL};
use super::*;

fn reason(frame: &[u8]) -> String {
    match decode(frame) {
        Err(ProtocolError::Violation { reason }) => reason,
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

/// The frame of `vmm_buffer(5)` with `bytes` written at body offset `at`.
fn patched(at: usize, bytes: &[u8]) -> Vec<u8> {
    let mut frame = encode(&Message::VmmBuffer(vmm_buffer(5))).unwrap();
    frame[HEADER_LEN + at..HEADER_LEN + at + bytes.len()].copy_from_slice(bytes);
    frame
}

#[test]
fn hostile_vmm_buffers_are_refused_with_exact_reasons() {
    let cases: [(usize, Vec<u8>, &str); 8] = [
        (8, 0u64.to_le_bytes().to_vec(), "VmmBuffer #5: size is 0"),
        (
            8,
            (5u64 << 20).to_le_bytes().to_vec(),
            "VmmBuffer #5: size 5242880 is not a multiple of the granularity 2097152",
        ),
        (
            16,
            0u64.to_le_bytes().to_vec(),
            "VmmBuffer #5: granularity 0 is not a power of two",
        ),
        (
            16,
            (3u64 << 20).to_le_bytes().to_vec(),
            "VmmBuffer #5: granularity 3145728 is not a power of two",
        ),
        (24, 3u32.to_le_bytes().to_vec(), "VmmBuffer: unknown flag bits 0x3"),
        (
            28,
            2u32.to_le_bytes().to_vec(),
            "VmmBuffer: handle type 2 is not supported (only 1, a POSIX file descriptor)",
        ),
        (
            28,
            0u32.to_le_bytes().to_vec(),
            "VmmBuffer: handle type 0 is not supported (only 1, a POSIX file descriptor)",
        ),
        (
            24,
            0u32.to_le_bytes().to_vec(),
            "VmmBuffer: event handle bytes without the ready-event flag",
        ),
    ];
    for (at, bytes, want) in cases {
        assert_eq!(reason(&patched(at, &bytes)), want);
    }
    // Encoding refuses the same descriptors.
    let bad = VmmBufferDescriptor {
        size: 1 << 20,
        ..vmm_buffer(5)
    };
    assert!(matches!(
        encode(&Message::VmmBuffer(bad)),
        Err(ProtocolError::Violation { .. })
    ));
}

#[test]
fn vmm_buffer_body_length_is_exact() {
    let frame = encode(&Message::VmmBuffer(vmm_buffer(5))).unwrap();
    let mut long = frame.clone();
    long.push(0);
    long[8..12].copy_from_slice(&97u32.to_le_bytes());
    assert_eq!(
        decode(&long),
        Err(ProtocolError::BodyLength {
            message: MessageType::VmmBuffer,
            min: 96,
            max: 96,
            got: 97
        })
    );
    let mut short = frame[..frame.len() - 1].to_vec();
    short[8..12].copy_from_slice(&95u32.to_le_bytes());
    assert!(matches!(decode(&short), Err(ProtocolError::BodyLength { got: 95, .. })));
}

#[test]
fn vmm_buffer_layout_is_as_specified_in_a_version_2_frame() {
    let vmm = encode(&Message::VmmBuffer(vmm_buffer(3))).unwrap();
    assert_eq!(vmm.len(), HEADER_LEN + 96);
    assert_eq!(&vmm[4..6], &2u16.to_le_bytes(), "version 2");
    assert_eq!(&vmm[6..8], &32u16.to_le_bytes(), "type VmmBuffer");
    assert_eq!(&vmm[HEADER_LEN..HEADER_LEN + 8], &3u64.to_le_bytes(), "buffer id");
    assert_eq!(
        &vmm[HEADER_LEN + 8..HEADER_LEN + 16],
        &(4u64 << 20).to_le_bytes(),
        "size"
    );
    assert_eq!(
        &vmm[HEADER_LEN + 16..HEADER_LEN + 24],
        &(2u64 << 20).to_le_bytes(),
        "granularity"
    );
    assert_eq!(
        &vmm[HEADER_LEN + 24..HEADER_LEN + 32],
        &[1, 0, 0, 0, 1, 0, 0, 0],
        "flags, handle type"
    );
    assert_eq!(&vmm[HEADER_LEN + 32..], &[0xd3; 64], "ready event");
    // The same body in a version-1 frame is a type version 1 does not define.
    let mut v1 = vmm.clone();
    v1[4..6].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(decode(&v1), Err(ProtocolError::UnknownMessageType { got: 32 }));
}

#[test]
fn the_vmm_capability_is_bit_1_of_hello2_and_welcome2_and_version_1_frames_keep_their_lengths() {
    assert_eq!(CAP_VMM, 2);
    assert_eq!(
        KNOWN_CAPABILITIES,
        CAP_FAST_RELEASE | CAP_VMM | CAP_VMM_CHUNKS | crate::protocol::CAP_RING
    );
    assert_eq!(crate::protocol::CAP_RING, 8);
    assert_eq!(CAP_FAST_RELEASE & CAP_VMM, 0);
    let hello = encode(&Message::Hello2 { capabilities: CAP_VMM }).unwrap();
    assert_eq!(&hello[HEADER_LEN..], &2u64.to_le_bytes());
    let welcome = Message::Welcome2 {
        welcome: Welcome {
            device_uuid: GPU,
            pool_id: POOL,
        },
        capabilities: CAP_VMM | CAP_FAST_RELEASE,
    };
    let bytes = encode(&welcome).unwrap();
    assert_eq!(&bytes[HEADER_LEN + 32..], &3u64.to_le_bytes());
    assert_eq!(decode(&bytes).unwrap(), welcome);
    // Welcome and Ready have exactly their version-1 bodies: an old importer reads them.
    let ready = encode(&Message::Ready(Ready { device_uuid: GPU })).unwrap();
    assert_eq!(ready.len(), HEADER_LEN + 16);
    let mut longer = ready.clone();
    longer.extend_from_slice(&CAP_VMM.to_le_bytes());
    longer[8..12].copy_from_slice(&24u32.to_le_bytes());
    assert!(matches!(
        decode(&longer),
        Err(ProtocolError::BodyLength {
            message: MessageType::Ready,
            got: 24,
            ..
        })
    ));
}

/// The frame of `vmm_chunks(5, 3)` (chunks of 1, 2 and 3 units of 2 MiB) with each `bytes` written
/// at its body offset `at`.
fn chunks_patched_all(patches: &[(usize, &[u8])]) -> Vec<u8> {
    let mut frame = encode(&Message::VmmChunks(vmm_chunks(5, 3))).unwrap();
    for (at, bytes) in patches {
        frame[HEADER_LEN + at..HEADER_LEN + at + bytes.len()].copy_from_slice(bytes);
    }
    frame
}

fn chunks_patched(at: usize, bytes: &[u8]) -> Vec<u8> {
    chunks_patched_all(&[(at, bytes)])
}

/// `body` in a `VmmChunks` frame whose header says its length.
fn chunks_frame(body: &[u8]) -> Vec<u8> {
    let mut frame = encode(&Message::VmmChunks(vmm_chunks(5, 3))).unwrap();
    frame.truncate(HEADER_LEN);
    frame[8..12].copy_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

#[test]
fn vmm_chunks_layout_is_as_specified_in_a_version_2_frame() {
    let frame = encode(&Message::VmmChunks(vmm_chunks(3, 3))).unwrap();
    assert_eq!(frame.len(), HEADER_LEN + 120 + 3 * 4);
    assert_eq!(&frame[4..6], &2u16.to_le_bytes(), "version 2");
    assert_eq!(&frame[6..8], &33u16.to_le_bytes(), "type VmmChunks");
    assert_eq!(&frame[8..12], &132u32.to_le_bytes(), "body length");
    let body = &frame[HEADER_LEN..];
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap());
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap());
    assert_eq!(u64_at(0), 3, "buffer id");
    assert_eq!(u64_at(8), 2 << 20, "unit");
    assert_eq!(u64_at(16), 2 << 20, "granularity");
    assert_eq!(u64_at(24), 4096, "offset");
    // From 4 KiB into chunk 0 to 8 KiB into chunk 2, which starts at 2 + 4 MiB.
    assert_eq!(u64_at(32), (6 << 20) + 4096, "length");
    assert_eq!(u32_at(40), 3, "count");
    assert_eq!(u32_at(44), 1, "flags: ready event");
    assert_eq!(u32_at(48), 1, "handle type: POSIX file descriptor");
    assert_eq!(u32_at(52), 0, "reserved");
    assert_eq!(&body[56..120], &[0xc3; 64], "ready event");
    assert_eq!((u32_at(120), u32_at(124), u32_at(128)), (1, 2, 3), "sizes in units");
    let decoded = decode(&frame).unwrap();
    assert_eq!(decoded, Message::VmmChunks(vmm_chunks(3, 3)));
    let Message::VmmChunks(d) = decoded else { unreachable!() };
    assert_eq!(
        (0..3).map(|i| d.chunk_bytes(i)).collect::<Vec<_>>(),
        vec![2 << 20, 4 << 20, 6 << 20]
    );
    assert_eq!(d.mapped_len(), 12 << 20);
    // A version-1 frame does not define the type.
    let mut v1 = frame.clone();
    v1[4..6].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(decode(&v1), Err(ProtocolError::UnknownMessageType { got: 33 }));
}

#[test]
fn vmm_chunks_body_length_is_exactly_the_count_it_declares() {
    let body = encode(&Message::VmmChunks(vmm_chunks(5, 3))).unwrap()[HEADER_LEN..].to_vec();
    // Outside what any count allows: refused from the header.
    let mut sizeless = body.clone();
    sizeless.truncate(120);
    assert_eq!(
        decode(&chunks_frame(&sizeless)),
        Err(ProtocolError::BodyLength {
            message: MessageType::VmmChunks,
            min: 124,
            max: 1132,
            got: 120
        })
    );
    let mut longest = body.clone();
    longest.resize(1133, 0);
    assert_eq!(
        decode(&chunks_frame(&longest)),
        Err(ProtocolError::MessageTooLarge { len: 1133, max: 1132 })
    );
    // Inside the bounds but not the count's: a size more, a size less, a stray byte.
    for (len, want) in [
        (
            136,
            "VmmChunks #5: count field says 3 chunks, the body holds 16 bytes of sizes",
        ),
        (
            128,
            "VmmChunks #5: count field says 3 chunks, the body holds 8 bytes of sizes",
        ),
        (
            133,
            "VmmChunks #5: count field says 3 chunks, the body holds 13 bytes of sizes",
        ),
    ] {
        let mut other = body.clone();
        other.resize(len, 1);
        assert_eq!(reason(&chunks_frame(&other)), want, "{len} bytes");
    }
    // The longest body, the most chunks, is the longest body of any message.
    let most = encode(&Message::VmmChunks(vmm_chunks(8, 253))).unwrap();
    assert_eq!(most.len() - HEADER_LEN, 1132);
    assert_eq!(MAX_BODY_LEN, 1132);
}

#[test]
fn hostile_vmm_chunks_are_refused_with_exact_reasons() {
    const MIB2: u64 = 2 << 20;
    let cases: Vec<(Vec<u8>, &str)> = vec![
        // count: none, too many for one message, more or fewer than the sizes the body holds
        (
            chunks_patched(40, &0u32.to_le_bytes()),
            "VmmChunks #5: 0 chunks (allowed: 1 to 253)",
        ),
        (
            chunks_patched(40, &254u32.to_le_bytes()),
            "VmmChunks #5: 254 chunks (allowed: 1 to 253)",
        ),
        (
            chunks_patched(40, &u32::MAX.to_le_bytes()),
            "VmmChunks #5: 4294967295 chunks (allowed: 1 to 253)",
        ),
        (
            chunks_patched(40, &4u32.to_le_bytes()),
            "VmmChunks #5: count field says 4 chunks, the body holds 12 bytes of sizes",
        ),
        (
            chunks_patched(40, &2u32.to_le_bytes()),
            "VmmChunks #5: count field says 2 chunks, the body holds 12 bytes of sizes",
        ),
        // unit and granularity
        (
            chunks_patched(8, &0u64.to_le_bytes()),
            "VmmChunks #5: unit 0 is not a non-zero multiple of the granularity 2097152",
        ),
        (
            chunks_patched(8, &(3u64 << 20).to_le_bytes()),
            "VmmChunks #5: unit 3145728 is not a non-zero multiple of the granularity 2097152",
        ),
        (
            chunks_patched(16, &(3u64 << 20).to_le_bytes()),
            "VmmChunks #5: granularity 3145728 is not a power of two",
        ),
        (
            chunks_patched(16, &0u64.to_le_bytes()),
            "VmmChunks #5: granularity 0 is not a power of two",
        ),
        // sizes: none may be 0; their sum must fit (past u64, and past i64 though inside u64)
        (
            chunks_patched(124, &0u32.to_le_bytes()),
            "VmmChunks #5: chunk 1 has a size of 0 units",
        ),
        (
            chunks_patched(120, &0u32.to_le_bytes()),
            "VmmChunks #5: chunk 0 has a size of 0 units",
        ),
        (
            chunks_patched(8, &(MIB2 << 42).to_le_bytes()),
            "VmmChunks #5: 3 chunks of 6 units of 9223372036854775808 bytes in all do not fit this machine's addresses",
        ),
        (
            chunks_patched_all(&[
                (8, &(1u64 << 62).to_le_bytes()),
                (120, &1u32.to_le_bytes()),
                (124, &1u32.to_le_bytes()),
                (128, &1u32.to_le_bytes()),
            ]),
            "VmmChunks #5: 3 chunks of 3 units of 4611686018427387904 bytes in all do not fit this machine's addresses",
        ),
        (
            chunks_patched_all(&[(120, &u32::MAX.to_le_bytes()), (124, &u32::MAX.to_le_bytes()), (128, &u32::MAX.to_le_bytes())]),
            // 3 * (2^32 - 1) units of 2 MiB: about 2^54 bytes, inside u64 and i64; the range ends in
            // chunk 0, before the last.
            "VmmChunks #5: the range ends at byte 6299648, before the last of its 3 chunks (which starts at byte 18014398505287680)",
        ),
        // the range against the sizes: a larger first chunk leaves the range short of the last
        (
            chunks_patched(120, &4u32.to_le_bytes()),
            "VmmChunks #5: the range ends at byte 6299648, before the last of its 3 chunks (which starts at byte 12582912)",
        ),
        // offset and length out of range, overflowing
        (
            chunks_patched(24, &MIB2.to_le_bytes()),
            "VmmChunks #5: offset 2097152 is not inside the first chunk of 2097152 bytes",
        ),
        (
            chunks_patched(24, &u64::MAX.to_le_bytes()),
            "VmmChunks #5: offset 18446744073709551615 is not inside the first chunk of 2097152 bytes",
        ),
        (chunks_patched(32, &0u64.to_le_bytes()), "VmmChunks #5: length is 0"),
        (
            chunks_patched(32, &(6 * MIB2).to_le_bytes()),
            "VmmChunks #5: 12582912 bytes at offset 4096 run past the 3 chunks of 12582912 bytes in all",
        ),
        (
            chunks_patched(32, &u64::MAX.to_le_bytes()),
            "VmmChunks #5: 18446744073709551615 bytes at offset 4096 run past the 3 chunks of 12582912 bytes in all",
        ),
        // a smaller last chunk: the same range now runs past it
        (
            chunks_patched_all(&[(124, &1u32.to_le_bytes()), (128, &1u32.to_le_bytes())]),
            "VmmChunks #5: 6295552 bytes at offset 4096 run past the 3 chunks of 6291456 bytes in all",
        ),
        // flags, handle type, reserved, event bytes
        (chunks_patched(44, &2u32.to_le_bytes()), "VmmChunks: unknown flag bits 0x2"),
        (
            chunks_patched(48, &2u32.to_le_bytes()),
            "VmmChunks: handle type 2 is not supported (only 1, a POSIX file descriptor)",
        ),
        (
            chunks_patched(52, &1u32.to_le_bytes()),
            "VmmChunks: reserved field is 0x1, must be 0",
        ),
        (
            chunks_patched(44, &0u32.to_le_bytes()),
            "VmmChunks: event handle bytes without the ready-event flag",
        ),
    ];
    for (frame, want) in cases {
        assert_eq!(reason(&frame), want);
    }
    // Encoding refuses the same descriptors.
    for bad in [
        VmmChunksDescriptor {
            sizes: Vec::new(),
            ..vmm_chunks(5, 3)
        },
        VmmChunksDescriptor {
            sizes: vec![1; 254],
            ..vmm_chunks(5, 3)
        },
        VmmChunksDescriptor {
            sizes: vec![1, 0, 3],
            ..vmm_chunks(5, 3)
        },
        VmmChunksDescriptor {
            offset: 2 << 20,
            ..vmm_chunks(5, 3)
        },
        VmmChunksDescriptor {
            len: 2 << 20,
            ..vmm_chunks(5, 3)
        },
        VmmChunksDescriptor {
            unit: 1 << 20,
            ..vmm_chunks(5, 3)
        },
    ] {
        assert!(
            matches!(
                encode(&Message::VmmChunks(bad.clone())),
                Err(ProtocolError::Violation { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn the_vmm_chunks_capability_is_bit_2_and_ranges_over_chunks_of_any_sizes_are_accepted() {
    assert_eq!(CAP_VMM_CHUNKS, 4);
    assert_eq!(CAP_VMM_CHUNKS & (CAP_VMM | CAP_FAST_RELEASE), 0);
    let round_trip = |d: &VmmChunksDescriptor| {
        let frame = encode(&Message::VmmChunks(d.clone())).unwrap();
        assert_eq!(frame.len(), HEADER_LEN + 120 + 4 * d.count());
        assert_eq!(decode(&frame).unwrap(), Message::VmmChunks(d.clone()));
        assert_eq!(Message::VmmChunks(d.clone()).descriptor_count(), d.count());
    };
    // The whole of 253 chunks of 1 to 3 units, from the first byte to the last.
    let most = vmm_chunks(8, 253);
    round_trip(&VmmChunksDescriptor {
        offset: 0,
        len: most.mapped_len(),
        ..most
    });
    // The last byte of one chunk.
    round_trip(&VmmChunksDescriptor {
        offset: (2 << 20) - 1,
        len: 1,
        ..vmm_chunks(9, 1)
    });
    // A service resource's mappings: 1, 32 and 8 chunks of 2 MiB, in units of 2 MiB; and the same
    // in units of 4 MiB (any unit the sizes are whole numbers of).
    round_trip(&VmmChunksDescriptor {
        unit: 2 << 20,
        offset: 1 << 20,
        len: (1 << 20) + (64 << 20) + 1,
        sizes: vec![1, 32, 8],
        ..vmm_chunks(10, 3)
    });
    round_trip(&VmmChunksDescriptor {
        unit: 4 << 20,
        offset: (4 << 20) - 1,
        len: 2,
        sizes: vec![1, 16],
        ..vmm_chunks(11, 2)
    });
    // The largest sizes a u32 says, in the smallest unit.
    round_trip(&VmmChunksDescriptor {
        offset: 0,
        len: (u64::from(u32::MAX) << 21) + 1,
        sizes: vec![u32::MAX, u32::MAX],
        ..vmm_chunks(12, 2)
    });
}
