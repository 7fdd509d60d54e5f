//! The VMM additions to the wire format: hostile `VmmBuffer` bodies and the capabilities field.

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
fn capabilities_are_optional_and_never_zero_on_the_wire() {
    // Version-1 frames (no field) decode as no capabilities.
    let ready = encode(&Message::Ready(Ready {
        device_uuid: GPU,
        capabilities: Capabilities::NONE,
    }))
    .unwrap();
    assert_eq!(ready.len(), HEADER_LEN + 16);
    // A field of 0 is refused: no capabilities are sent as no field.
    let mut zero = ready.clone();
    zero.extend_from_slice(&[0; 8]);
    zero[8..12].copy_from_slice(&24u32.to_le_bytes());
    assert_eq!(
        reason(&zero),
        "Ready: a capabilities field of 0 (no capabilities are sent as no field)"
    );
    // A length between the two forms is refused.
    let mut odd = ready.clone();
    odd.extend_from_slice(&[1; 4]);
    odd[8..12].copy_from_slice(&20u32.to_le_bytes());
    assert_eq!(
        reason(&odd),
        "Ready: a body of 20 bytes (allowed: 16, or 24 with capabilities)"
    );
    // Bits this build does not know survive decoding (the handshake decides what they mean).
    let offer = Message::Welcome(Welcome {
        device_uuid: GPU,
        pool_id: POOL,
        capabilities: Capabilities(1 << 63 | 1 << 1),
    });
    assert_eq!(decode(&encode(&offer).unwrap()).unwrap(), offer);
    assert!(Capabilities(1 << 63 | 1 << 1).contains(Capabilities::VMM));
    assert_eq!(
        Capabilities(1 << 63 | 1 << 1).intersection(Capabilities::KNOWN),
        Capabilities::VMM
    );
}
