//! The protocol's additions for VMM sharing: the capabilities both sides announce in the
//! handshake, and the `VmmBuffer` message that hands over one physical allocation
//! (`cuMemCreate`) as a file descriptor.
//!
//! ```text
//! VmmBuffer body (96 bytes), one file descriptor attached (SCM_RIGHTS)
//! offset  size  field
//!      0     8  buffer id     u64, named by Release like any buffer
//!      8     8  size          u64, the allocation's size: a non-zero multiple of granularity
//!     16     8  granularity   u64, the exporter's minimum granularity: a power of two
//!     24     4  flags         u32, bit 0: the ready event is valid; other bits must be 0
//!     28     4  handle type   u32, 1: a POSIX file descriptor
//!     32    64  ready event   CUipcEventHandle, all zeros without flag bit 0
//! ```
//!
//! Capabilities are a `u64` of bits at the end of `Welcome` (what the exporter offers) and of
//! `Ready` (what the importer accepts, a subset of the offer). Unknown bits of an offer are
//! ignored, not refused: that is what lets features be added one bit at a time. Frames without
//! the field (the version-1 lengths) offer and accept nothing; no capabilities are always sent
//! that way (a field of 0 is refused, so every message has one encoding).

use std::fmt;

use super::{protocol, BufferId, EventHandle, ProtocolError, Reader, Result};

/// The features a side of a connection offers (`Welcome`) or accepts (`Ready`), one bit each.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Capabilities(pub(crate) u64);

impl Capabilities {
    /// Nothing beyond the version-1 protocol.
    pub(crate) const NONE: Capabilities = Capabilities(0);
    /// Bit 0: VMM physical allocations travel as `VmmBuffer` messages.
    pub(crate) const VMM: Capabilities = Capabilities(1);
    /// Every capability this build knows.
    pub(crate) const KNOWN: Capabilities = Capabilities(Capabilities::VMM.0);

    /// Whether every bit of `other` is set here.
    pub(crate) fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
    }

    /// The bits set in both.
    pub(crate) fn intersection(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Capabilities({:#x})", self.0)
    }
}

/// The handle-type field's value for a POSIX file descriptor
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
pub(crate) const VMM_HANDLE_TYPE_POSIX_FD: u32 = 1;

/// Bit 0 of a `VmmBuffer`'s flags: the event handle is valid and the importer must wait on it.
pub(crate) const VMM_FLAG_READY_EVENT: u32 = 1;

/// The body length of a `VmmBuffer` message.
pub(crate) const VMM_BUFFER_LEN: usize = 3 * 8 + 4 + 4 + 64;

/// A physical allocation handed to an importer; its file descriptor travels with the message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct VmmBufferDescriptor {
    /// The buffer's id; `Release` names it.
    pub(crate) buffer_id: BufferId,
    /// The allocation's size in bytes: a non-zero multiple of `granularity`.
    pub(crate) size: u64,
    /// The exporter's minimum granularity for the allocation's properties: a power of two. The
    /// importer refuses a value that is not its own device's.
    pub(crate) granularity: u64,
    /// The event to wait on before first use, recorded after the exporter's work on the memory.
    /// `None`: the exporter synchronized before sending.
    pub(crate) ready_event: Option<EventHandle>,
}

/// The checks decoding (and encoding) makes on a `VmmBuffer`.
pub(crate) fn check_vmm_buffer(b: &VmmBufferDescriptor) -> Result<()> {
    let id = b.buffer_id;
    if b.granularity == 0 || !b.granularity.is_power_of_two() {
        return Err(protocol(format!(
            "VmmBuffer {id}: granularity {} is not a power of two",
            b.granularity
        )));
    }
    if b.size == 0 {
        return Err(protocol(format!("VmmBuffer {id}: size is 0")));
    }
    if b.size % b.granularity != 0 {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} is not a multiple of the granularity {}",
            b.size, b.granularity
        )));
    }
    if usize::try_from(b.size).is_err() {
        return Err(protocol(format!(
            "VmmBuffer {id}: size {} does not fit this machine's addresses",
            b.size
        )));
    }
    Ok(())
}

/// Decodes a `VmmBuffer` body from `r` (its length already checked).
pub(super) fn decode_vmm_buffer(r: &mut Reader<'_>) -> Result<VmmBufferDescriptor> {
    let buffer_id = BufferId(r.u64()?);
    let size = r.u64()?;
    let granularity = r.u64()?;
    let flags = r.u32()?;
    let handle_type = r.u32()?;
    let event = r.array::<64>()?;
    if flags & !VMM_FLAG_READY_EVENT != 0 {
        return Err(protocol(format!("VmmBuffer: unknown flag bits {flags:#x}")));
    }
    if handle_type != VMM_HANDLE_TYPE_POSIX_FD {
        return Err(protocol(format!(
            "VmmBuffer: handle type {handle_type} is not supported (only {VMM_HANDLE_TYPE_POSIX_FD}, a POSIX file descriptor)"
        )));
    }
    let ready_event = if flags & VMM_FLAG_READY_EVENT != 0 {
        Some(EventHandle(event))
    } else if event != [0; 64] {
        return Err(protocol("VmmBuffer: event handle bytes without the ready-event flag"));
    } else {
        None
    };
    Ok(VmmBufferDescriptor {
        buffer_id,
        size,
        granularity,
        ready_event,
    })
}

/// Appends a `VmmBuffer` body to `out`.
pub(super) fn encode_vmm_buffer(b: &VmmBufferDescriptor, out: &mut Vec<u8>) {
    for field in [b.buffer_id.0, b.size, b.granularity] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    let flags = if b.ready_event.is_some() {
        VMM_FLAG_READY_EVENT
    } else {
        0
    };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&VMM_HANDLE_TYPE_POSIX_FD.to_le_bytes());
    out.extend_from_slice(&b.ready_event.map_or([0; 64], |e| e.0));
}

/// Appends the capabilities field: nothing for none, so that such a frame is a version-1 frame.
pub(super) fn encode_capabilities(c: Capabilities, out: &mut Vec<u8>) {
    if c != Capabilities::NONE {
        out.extend_from_slice(&c.0.to_le_bytes());
    }
}

/// Reads the capabilities at the end of a `Welcome` or `Ready` body of `len` bytes, whose
/// version-1 length is `short` (no capabilities) and whose full length is `short + 8`.
pub(super) fn decode_capabilities(r: &mut Reader<'_>, message: &str, short: usize, len: usize) -> Result<Capabilities> {
    if len == short {
        Ok(Capabilities::NONE)
    } else if len == short + 8 {
        match r.u64()? {
            0 => Err(ProtocolError::Violation {
                reason: format!("{message}: a capabilities field of 0 (no capabilities are sent as no field)"),
            }),
            bits => Ok(Capabilities(bits)),
        }
    } else {
        Err(ProtocolError::Violation {
            reason: format!(
                "{message}: a body of {len} bytes (allowed: {short}, or {} with capabilities)",
                short + 8
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{vmm_buffer, GPU, POOL};
    use super::super::{decode, encode, Message, MessageType, Ready, Welcome, HEADER_LEN};
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
            (16, 0u64.to_le_bytes().to_vec(), "VmmBuffer #5: granularity 0 is not a power of two"),
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
            (24, 0u32.to_le_bytes().to_vec(), "VmmBuffer: event handle bytes without the ready-event flag"),
        ];
        for (at, bytes, want) in cases {
            assert_eq!(reason(&patched(at, &bytes)), want);
        }
        // Encoding refuses the same descriptors.
        let bad = VmmBufferDescriptor {
            size: 1 << 20,
            ..vmm_buffer(5)
        };
        assert!(matches!(encode(&Message::VmmBuffer(bad)), Err(ProtocolError::Violation { .. })));
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
            capabilities: Capabilities(1 << 63 | 1),
        });
        assert_eq!(decode(&encode(&offer).unwrap()).unwrap(), offer);
        assert!(Capabilities(1 << 63 | 1).contains(Capabilities::VMM));
        assert_eq!(
            Capabilities(1 << 63 | 1).intersection(Capabilities::KNOWN),
            Capabilities::VMM
        );
    }
}
