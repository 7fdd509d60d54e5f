//! The VMM additions to the wire format: the `VmmBuffer` layout, hostile bodies, and the
//! capability bit.

use super::testing::{vmm_buffer, GPU, POOL};
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
    assert_eq!(KNOWN_CAPABILITIES, CAP_FAST_RELEASE | CAP_VMM);
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
