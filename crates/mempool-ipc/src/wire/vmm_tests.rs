//! The VMM additions to the wire format: the `VmmBuffer` layout, hostile bodies, and the
//! capability bit.

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
    assert_eq!(KNOWN_CAPABILITIES, CAP_FAST_RELEASE | CAP_VMM | CAP_VMM_CHUNKS);
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

/// The frame of `vmm_chunks(5, 3)` with `bytes` written at body offset `at`.
fn chunks_patched(at: usize, bytes: &[u8]) -> Vec<u8> {
    let mut frame = encode(&Message::VmmChunks(vmm_chunks(5, 3))).unwrap();
    frame[HEADER_LEN + at..HEADER_LEN + at + bytes.len()].copy_from_slice(bytes);
    frame
}

#[test]
fn vmm_chunks_layout_is_as_specified_in_a_version_2_frame() {
    let frame = encode(&Message::VmmChunks(vmm_chunks(3, 3))).unwrap();
    assert_eq!(frame.len(), HEADER_LEN + 120);
    assert_eq!(&frame[4..6], &2u16.to_le_bytes(), "version 2");
    assert_eq!(&frame[6..8], &33u16.to_le_bytes(), "type VmmChunks");
    let body = &frame[HEADER_LEN..];
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap());
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap());
    assert_eq!(u64_at(0), 3, "buffer id");
    assert_eq!(u64_at(8), 2 << 20, "chunk size");
    assert_eq!(u64_at(16), 2 << 20, "granularity");
    assert_eq!(u64_at(24), 4096, "offset");
    assert_eq!(u64_at(32), (4 << 20) + 4096, "length");
    assert_eq!(u32_at(40), 3, "count");
    assert_eq!(u32_at(44), 1, "flags: ready event");
    assert_eq!(u32_at(48), 1, "handle type: POSIX file descriptor");
    assert_eq!(u32_at(52), 0, "reserved");
    assert_eq!(&body[56..], &[0xc3; 64], "ready event");
    assert_eq!(decode(&frame).unwrap(), Message::VmmChunks(vmm_chunks(3, 3)));
    // A version-1 frame does not define the type.
    let mut v1 = frame.clone();
    v1[4..6].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(decode(&v1), Err(ProtocolError::UnknownMessageType { got: 33 }));
    // The body length is exact.
    let mut long = frame.clone();
    long.push(0);
    long[8..12].copy_from_slice(&121u32.to_le_bytes());
    assert!(matches!(
        decode(&long),
        Err(ProtocolError::BodyLength {
            message: MessageType::VmmChunks,
            min: 120,
            max: 120,
            got: 121
        })
    ));
}

#[test]
fn hostile_vmm_chunks_are_refused_with_exact_reasons() {
    const MIB2: u64 = 2 << 20;
    let cases: Vec<(usize, Vec<u8>, &str)> = vec![
        // count: none, too many for one message, and more than the range reaches
        (
            40,
            0u32.to_le_bytes().to_vec(),
            "VmmChunks #5: 0 chunks (allowed: 1 to 253)",
        ),
        (
            40,
            254u32.to_le_bytes().to_vec(),
            "VmmChunks #5: 254 chunks (allowed: 1 to 253)",
        ),
        (
            40,
            u32::MAX.to_le_bytes().to_vec(),
            "VmmChunks #5: 4294967295 chunks (allowed: 1 to 253)",
        ),
        (
            40,
            4u32.to_le_bytes().to_vec(),
            "VmmChunks #5: the range ends at byte 4202496, before the last of its 4 chunks of 2097152 bytes",
        ),
        // count mismatch the other way: fewer chunks than the range covers
        (
            40,
            2u32.to_le_bytes().to_vec(),
            "VmmChunks #5: 4198400 bytes at offset 4096 run past the 2 chunks of 2097152 bytes",
        ),
        // chunk size and granularity
        (
            8,
            0u64.to_le_bytes().to_vec(),
            "VmmChunks #5: chunk size 0 is not a non-zero multiple of the granularity 2097152",
        ),
        (
            8,
            (3u64 << 20).to_le_bytes().to_vec(),
            "VmmChunks #5: chunk size 3145728 is not a non-zero multiple of the granularity 2097152",
        ),
        (
            16,
            (3u64 << 20).to_le_bytes().to_vec(),
            "VmmChunks #5: granularity 3145728 is not a power of two",
        ),
        (
            8,
            (MIB2 << 42).to_le_bytes().to_vec(),
            "VmmChunks #5: 3 chunks of 9223372036854775808 bytes do not fit this machine's addresses",
        ),
        // offset and length out of range, overflowing
        (
            24,
            MIB2.to_le_bytes().to_vec(),
            "VmmChunks #5: offset 2097152 is not inside the first chunk of 2097152 bytes",
        ),
        (
            24,
            u64::MAX.to_le_bytes().to_vec(),
            "VmmChunks #5: offset 18446744073709551615 is not inside the first chunk of 2097152 bytes",
        ),
        (32, 0u64.to_le_bytes().to_vec(), "VmmChunks #5: length is 0"),
        (
            32,
            (3 * MIB2).to_le_bytes().to_vec(),
            "VmmChunks #5: 6291456 bytes at offset 4096 run past the 3 chunks of 2097152 bytes",
        ),
        (
            32,
            u64::MAX.to_le_bytes().to_vec(),
            "VmmChunks #5: 18446744073709551615 bytes at offset 4096 run past the 3 chunks of 2097152 bytes",
        ),
        // flags, handle type, reserved, event bytes
        (44, 2u32.to_le_bytes().to_vec(), "VmmChunks: unknown flag bits 0x2"),
        (
            48,
            2u32.to_le_bytes().to_vec(),
            "VmmChunks: handle type 2 is not supported (only 1, a POSIX file descriptor)",
        ),
        (
            52,
            1u32.to_le_bytes().to_vec(),
            "VmmChunks: reserved field is 0x1, must be 0",
        ),
        (
            44,
            0u32.to_le_bytes().to_vec(),
            "VmmChunks: event handle bytes without the ready-event flag",
        ),
    ];
    for (at, bytes, want) in cases {
        assert_eq!(reason(&chunks_patched(at, &bytes)), want, "bytes at {at}");
    }
    // Encoding refuses the same descriptors.
    for bad in [
        VmmChunksDescriptor {
            count: 0,
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
    ] {
        assert!(matches!(
            encode(&Message::VmmChunks(bad)),
            Err(ProtocolError::Violation { .. })
        ));
    }
}

#[test]
fn the_vmm_chunks_capability_is_bit_2_and_a_range_ending_exactly_at_its_last_chunk_is_accepted() {
    assert_eq!(CAP_VMM_CHUNKS, 4);
    assert_eq!(CAP_VMM_CHUNKS & (CAP_VMM | CAP_FAST_RELEASE), 0);
    // The whole of 253 chunks, from the first byte to the last.
    let full = VmmChunksDescriptor {
        offset: 0,
        len: 253 * (2 << 20),
        ..vmm_chunks(8, 253)
    };
    let frame = encode(&Message::VmmChunks(full)).unwrap();
    assert_eq!(decode(&frame).unwrap(), Message::VmmChunks(full));
    assert_eq!(Message::VmmChunks(full).descriptor_count(), 253);
    // The last byte of one chunk.
    let last = VmmChunksDescriptor {
        offset: (2 << 20) - 1,
        len: 1,
        ..vmm_chunks(9, 1)
    };
    assert_eq!(
        decode(&encode(&Message::VmmChunks(last)).unwrap()).unwrap(),
        Message::VmmChunks(last)
    );
}
