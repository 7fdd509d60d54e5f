//! The bytes: frame headers, every body's layout, and the encoder and decoder.
//!
//! Everything here is a pure function over byte slices, so it can be fuzzed without sockets.

use mempool_socket::frame::{self, Reader, Writer};

use super::error::{protocol, ProtocolError, Result};
use super::ids::{BlockId, BufferId, DeviceUuid, EventHandle, MessageType, PointerDescriptor, PoolId, MAX_VMM_CHUNKS};
use super::messages::{
    BufferDescriptor, ErrorCode, ErrorMessage, Message, PoolDescriptor, Ready, ReleaseBatch, Welcome, ERROR_FIXED_LEN,
    ERROR_MAX_LEN, MAX_BODY_LEN, MAX_RELEASE_BATCH,
};
use super::vmm::{
    check_vmm_chunk_count, VmmBufferDescriptor, VmmChunksDescriptor, VMM_BUFFER_LEN, VMM_CHUNKS_FIXED_LEN,
    VMM_CHUNKS_MAX_LEN, VMM_FLAG_READY_EVENT, VMM_HANDLE_TYPE_POSIX_FD,
};

/// The four bytes every frame starts with.
pub(crate) const MAGIC: [u8; 4] = *b"MPIP";

/// The newest protocol version this crate speaks. Every frame carries the version that defines
/// its message type: the messages of version 1 travel in version-1 frames in every version, and
/// only the messages version 2 added ([`MessageType::Hello2`], [`MessageType::Welcome2`],
/// [`MessageType::ReleaseBatch`]) in version-2 frames. A version-1 peer therefore refuses a
/// version-2 `Hello2` with a clear `UnsupportedVersion` error, and a version-2 exporter answers a
/// version-1 `Hello` the version-1 way.
pub(crate) const PROTOCOL_VERSION: u16 = 2;

/// The oldest protocol version this crate speaks.
pub(crate) const MIN_PROTOCOL_VERSION: u16 = 1;

/// The length of a frame header.
pub(crate) const HEADER_LEN: usize = mempool_socket::frame::HEADER_LEN;

/// The longest frame, header included.
#[cfg(test)]
pub(crate) const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN;

/// The most file descriptors any message carries (a `VmmChunks` with the most chunks).
pub(crate) const MAX_FDS_PER_MESSAGE: usize = MAX_VMM_CHUNKS;

/// The value of the pool descriptor's handle-type field: the pool travels as a POSIX file
/// descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
pub(crate) const POOL_HANDLE_TYPE_POSIX_FD: u32 = 1;

/// Bit 0 of a buffer message's flags: the event handle is valid and the importer must wait on it.
pub(crate) const BUFFER_FLAG_READY_EVENT: u32 = 1;

/// Bit 1 of a buffer message's flags (only to an importer that negotiated
/// [`CAP_FAST_RELEASE`](super::messages::CAP_FAST_RELEASE)):
/// the importer may keep the block imported after it released the block's last buffer; the
/// exporter keeps the block allocated until this importer's connection is over.
pub(crate) const BUFFER_FLAG_KEEP_IMPORT: u32 = 2;

/// Bit 0 of a `ReleaseBatch`'s flags: the event handle is valid; the exporter orders the free or
/// reuse of every buffer in the batch after it.
pub(crate) const RELEASE_FLAG_EVENT: u32 = 1;

const UUID_LEN: usize = 16;
const WELCOME_LEN: usize = UUID_LEN + UUID_LEN;
const READY_LEN: usize = UUID_LEN;
const POOL_DESCRIPTOR_LEN: usize = UUID_LEN + 4 + 4;
const BUFFER_LEN: usize = 5 * 8 + 4 + 4 + 64 + 64;
const RELEASE_LEN: usize = 8;
const HELLO2_LEN: usize = 8;
const WELCOME2_LEN: usize = WELCOME_LEN + 8;
const RELEASE_BATCH_FIXED_LEN: usize = 4 + 4 + 64;

/// A `Buffer` frame's length, header included: the longest frame the shared-memory rings carry.
pub(crate) const BUFFER_FRAME_LEN: usize = HEADER_LEN + BUFFER_LEN;

/// A `ReleaseBatch` frame's length, header included, before its ids (8 bytes each).
pub(crate) const RELEASE_BATCH_FRAME_FIXED_LEN: usize = HEADER_LEN + RELEASE_BATCH_FIXED_LEN;

/// The smallest and the largest body a message of type `t` may have.
pub(crate) fn body_len_bounds(t: MessageType) -> (usize, usize) {
    let exact = |n| (n, n);
    match t {
        MessageType::Hello | MessageType::Goodbye | MessageType::RingSetup | MessageType::RingBell => exact(0),
        MessageType::Welcome => exact(WELCOME_LEN),
        MessageType::Ready => exact(READY_LEN),
        MessageType::PoolDescriptor => exact(POOL_DESCRIPTOR_LEN),
        MessageType::Buffer => exact(BUFFER_LEN),
        MessageType::Release => exact(RELEASE_LEN),
        MessageType::Error => (ERROR_FIXED_LEN, ERROR_MAX_LEN),
        MessageType::Hello2 => exact(HELLO2_LEN),
        MessageType::Welcome2 => exact(WELCOME2_LEN),
        MessageType::ReleaseBatch => (
            RELEASE_BATCH_FIXED_LEN + 8,
            RELEASE_BATCH_FIXED_LEN + 8 * MAX_RELEASE_BATCH,
        ),
        MessageType::VmmBuffer => exact(VMM_BUFFER_LEN),
        // The body says how many sizes follow; the decoder holds it to exactly that.
        MessageType::VmmChunks => (VMM_CHUNKS_FIXED_LEN + 4, VMM_CHUNKS_MAX_LEN),
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Header {
    /// The frame's protocol version (the one its message type is defined in).
    pub(crate) version: u16,
    /// The message type.
    pub(crate) message_type: MessageType,
    /// The body's length, already checked against what the type allows.
    pub(crate) body_len: usize,
}

/// Decodes and checks the header at the start of `bytes` (which may go on past it).
pub(crate) fn decode_header(bytes: &[u8]) -> Result<Header> {
    let Some(header) = bytes.get(..HEADER_LEN) else {
        return Err(ProtocolError::Truncated {
            needed: HEADER_LEN,
            got: bytes.len(),
        });
    };
    let raw = frame::Header::parse(header)?;
    let magic = raw.magic;
    if magic != MAGIC {
        return Err(ProtocolError::BadMagic { got: magic });
    }
    let version = raw.version;
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
        return Err(ProtocolError::UnsupportedVersion {
            got: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let code = raw.kind;
    // A type is known only in the frames of the version that defines it.
    let message_type = MessageType::from_wire(code)
        .filter(|t| t.version() == version)
        .ok_or(ProtocolError::UnknownMessageType { got: code })?;
    let body_len = raw.body_len as usize;
    if body_len > MAX_BODY_LEN {
        return Err(ProtocolError::MessageTooLarge {
            len: body_len,
            max: MAX_BODY_LEN,
        });
    }
    let (min, max) = body_len_bounds(message_type);
    if body_len < min || body_len > max {
        return Err(ProtocolError::BodyLength {
            message: message_type,
            min,
            max,
            got: body_len,
        });
    }
    Ok(Header {
        version,
        message_type,
        body_len,
    })
}

/// Decodes the body of a message of type `message_type`; `body` must be exactly the body.
pub(crate) fn decode_body(message_type: MessageType, body: &[u8]) -> Result<Message> {
    let (min, max) = body_len_bounds(message_type);
    if body.len() < min || body.len() > max {
        return Err(ProtocolError::BodyLength {
            message: message_type,
            min,
            max,
            got: body.len(),
        });
    }
    let mut r = Reader::new(body);
    let message = match message_type {
        MessageType::Hello => Message::Hello,
        MessageType::Goodbye => Message::Goodbye,
        MessageType::RingSetup => Message::RingSetup,
        MessageType::RingBell => Message::RingBell,
        MessageType::Welcome => Message::Welcome(Welcome {
            device_uuid: DeviceUuid(r.array()?),
            pool_id: PoolId(r.array()?),
        }),
        MessageType::Ready => Message::Ready(Ready {
            device_uuid: DeviceUuid(r.array()?),
        }),
        MessageType::PoolDescriptor => {
            let pool_id = PoolId(r.array()?);
            let handle_type = r.u32()?;
            if handle_type != POOL_HANDLE_TYPE_POSIX_FD {
                return Err(protocol(format!(
                    "pool handle type {handle_type} is not supported (only {POOL_HANDLE_TYPE_POSIX_FD}, a POSIX file descriptor)"
                )));
            }
            check_reserved(r.u32()?, "PoolDescriptor")?;
            Message::PoolDescriptor(PoolDescriptor { pool_id })
        }
        MessageType::Buffer => {
            let buffer_id = BufferId(r.u64()?);
            let block_id = BlockId(r.u64()?);
            let block_size = r.u64()?;
            let offset = r.u64()?;
            let size = r.u64()?;
            let flags = r.u32()?;
            check_reserved(r.u32()?, "Buffer")?;
            let pointer = PointerDescriptor(r.array()?);
            let event = r.array::<64>()?;
            if flags & !(BUFFER_FLAG_READY_EVENT | BUFFER_FLAG_KEEP_IMPORT) != 0 {
                return Err(protocol(format!("Buffer: unknown flag bits {flags:#x}")));
            }
            let ready_event = if flags & BUFFER_FLAG_READY_EVENT != 0 {
                Some(EventHandle(event))
            } else if event != [0; 64] {
                return Err(protocol("Buffer: event handle bytes without the ready-event flag"));
            } else {
                None
            };
            Message::Buffer(BufferDescriptor {
                buffer_id,
                block_id,
                block_size,
                offset,
                size,
                pointer,
                ready_event,
                keep_import: flags & BUFFER_FLAG_KEEP_IMPORT != 0,
            })
        }
        MessageType::Release => Message::Release {
            buffer_id: BufferId(r.u64()?),
        },
        MessageType::Hello2 => Message::Hello2 { capabilities: r.u64()? },
        MessageType::VmmBuffer => Message::VmmBuffer(decode_vmm_buffer(&mut r)?),
        MessageType::VmmChunks => Message::VmmChunks(decode_vmm_chunks(&mut r)?),
        MessageType::Welcome2 => Message::Welcome2 {
            welcome: Welcome {
                device_uuid: DeviceUuid(r.array()?),
                pool_id: PoolId(r.array()?),
            },
            capabilities: r.u64()?,
        },
        MessageType::ReleaseBatch => {
            let count = r.u32()? as usize;
            let flags = r.u32()?;
            let event = r.array::<64>()?;
            if flags & !RELEASE_FLAG_EVENT != 0 {
                return Err(protocol(format!("ReleaseBatch: unknown flag bits {flags:#x}")));
            }
            let event = if flags & RELEASE_FLAG_EVENT != 0 {
                Some(EventHandle(event))
            } else if event != [0; 64] {
                return Err(protocol("ReleaseBatch: event handle bytes without the event flag"));
            } else {
                None
            };
            if count.checked_mul(8) != Some(r.remaining()) {
                return Err(protocol(format!(
                    "ReleaseBatch: count field says {count} buffers, the body holds {} bytes of ids",
                    r.remaining()
                )));
            }
            let mut buffers = Vec::with_capacity(count);
            for _ in 0..count {
                buffers.push(BufferId(r.u64()?));
            }
            Message::ReleaseBatch(ReleaseBatch { event, buffers })
        }
        MessageType::Error => {
            let code = ErrorCode::from_wire(r.u32()?);
            let text_len = r.u16()? as usize;
            if text_len != r.remaining() {
                return Err(protocol(format!(
                    "Error: text length field says {text_len} bytes, the body holds {}",
                    r.remaining()
                )));
            }
            let text = std::str::from_utf8(r.take(text_len)?).map_err(|_| protocol("Error: text is not UTF-8"))?;
            Message::Error(ErrorMessage {
                code,
                text: text.to_owned(),
            })
        }
    };
    if r.remaining() != 0 {
        return Err(ProtocolError::TrailingBytes { len: r.remaining() });
    }
    message.validate()?;
    Ok(message)
}

fn check_reserved(value: u32, message: &str) -> Result<()> {
    if value != 0 {
        return Err(protocol(format!("{message}: reserved field is {value:#x}, must be 0")));
    }
    Ok(())
}

/// Decodes exactly one frame: `frame` must hold a whole frame and nothing after it.
pub(crate) fn decode(frame: &[u8]) -> Result<Message> {
    let header = decode_header(frame)?;
    let total = HEADER_LEN + header.body_len;
    if frame.len() < total {
        return Err(ProtocolError::Truncated {
            needed: total,
            got: frame.len(),
        });
    }
    if frame.len() > total {
        return Err(ProtocolError::TrailingBytes {
            len: frame.len() - total,
        });
    }
    decode_body(header.message_type, &frame[HEADER_LEN..])
}

/// Encodes `message` as one frame, after checking it with [`Message::validate`].
pub(crate) fn encode(message: &Message) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(HEADER_LEN + 64);
    encode_into(message, &mut out)?;
    Ok(out)
}

/// Appends the frame of `message` to `out`, after checking it with [`Message::validate`];
/// on error `out` is unchanged.
pub(crate) fn encode_into(message: &Message, out: &mut Vec<u8>) -> Result<()> {
    message.validate()?;
    let mut w = Writer::frame_into(
        out,
        MAGIC,
        message.message_type().version(),
        message.message_type().to_wire(),
    );
    match message {
        Message::Hello | Message::Goodbye | Message::RingSetup | Message::RingBell => {}
        Message::Welcome(welcome) => {
            w.bytes(&welcome.device_uuid.0);
            w.bytes(&welcome.pool_id.0);
        }
        Message::Ready(r) => w.bytes(&r.device_uuid.0),
        Message::PoolDescriptor(p) => {
            w.bytes(&p.pool_id.0);
            w.bytes(&POOL_HANDLE_TYPE_POSIX_FD.to_le_bytes());
            w.bytes(&0u32.to_le_bytes());
        }
        Message::Buffer(b) => {
            for field in [b.buffer_id.0, b.block_id.0, b.block_size, b.offset, b.size] {
                w.bytes(&field.to_le_bytes());
            }
            let mut flags = if b.ready_event.is_some() {
                BUFFER_FLAG_READY_EVENT
            } else {
                0
            };
            if b.keep_import {
                flags |= BUFFER_FLAG_KEEP_IMPORT;
            }
            w.bytes(&flags.to_le_bytes());
            w.bytes(&0u32.to_le_bytes());
            w.bytes(&b.pointer.0);
            w.bytes(&b.ready_event.map_or([0; 64], |e| e.0));
        }
        Message::Release { buffer_id } => w.bytes(&buffer_id.0.to_le_bytes()),
        Message::Hello2 { capabilities } => w.bytes(&capabilities.to_le_bytes()),
        Message::VmmBuffer(b) => encode_vmm_buffer(b, &mut w),
        Message::VmmChunks(c) => encode_vmm_chunks(c, &mut w),
        Message::Welcome2 { welcome, capabilities } => {
            w.bytes(&welcome.device_uuid.0);
            w.bytes(&welcome.pool_id.0);
            w.bytes(&capabilities.to_le_bytes());
        }
        Message::ReleaseBatch(b) => {
            // `validate` bounded the count.
            w.bytes(&(b.buffers.len() as u32).to_le_bytes());
            let flags = if b.event.is_some() { RELEASE_FLAG_EVENT } else { 0 };
            w.bytes(&flags.to_le_bytes());
            w.bytes(&b.event.map_or([0; 64], |e| e.0));
            for id in &b.buffers {
                w.bytes(&id.0.to_le_bytes());
            }
        }
        Message::Error(e) => {
            w.bytes(&e.code.to_wire().to_le_bytes());
            // `validate` bounded the text, so the length fits in u16.
            w.bytes(&(e.text.len() as u16).to_le_bytes());
            w.bytes(e.text.as_bytes());
        }
    }
    debug_assert!(w.body_len() <= MAX_BODY_LEN);
    w.end();
    Ok(())
}

/// Decodes a `VmmBuffer` body from `r` (its length already checked).
fn decode_vmm_buffer(r: &mut Reader<'_>) -> Result<VmmBufferDescriptor> {
    let buffer_id = BufferId(r.u64()?);
    let size = r.u64()?;
    let granularity = r.u64()?;
    let flags = r.u32()?;
    let handle_type = r.u32()?;
    let event = r.array::<64>()?;
    let ready_event = vmm_ready_event("VmmBuffer", flags, handle_type, event)?;
    Ok(VmmBufferDescriptor {
        buffer_id,
        size,
        granularity,
        ready_event,
    })
}

/// Appends a `VmmBuffer` body to `w`.
fn encode_vmm_buffer(b: &VmmBufferDescriptor, w: &mut Writer<'_>) {
    for field in [b.buffer_id.0, b.size, b.granularity] {
        w.bytes(&field.to_le_bytes());
    }
    let flags = if b.ready_event.is_some() {
        VMM_FLAG_READY_EVENT
    } else {
        0
    };
    w.bytes(&flags.to_le_bytes());
    w.bytes(&VMM_HANDLE_TYPE_POSIX_FD.to_le_bytes());
    w.bytes(&b.ready_event.map_or([0; 64], |e| e.0));
}

/// The ready event of a VMM message: present with flag bit 0, else all zeros.
fn vmm_ready_event(message: &str, flags: u32, handle_type: u32, event: [u8; 64]) -> Result<Option<EventHandle>> {
    if flags & !VMM_FLAG_READY_EVENT != 0 {
        return Err(protocol(format!("{message}: unknown flag bits {flags:#x}")));
    }
    if handle_type != VMM_HANDLE_TYPE_POSIX_FD {
        return Err(protocol(format!(
            "{message}: handle type {handle_type} is not supported (only {VMM_HANDLE_TYPE_POSIX_FD}, a POSIX file descriptor)"
        )));
    }
    if flags & VMM_FLAG_READY_EVENT != 0 {
        Ok(Some(EventHandle(event)))
    } else if event != [0; 64] {
        Err(protocol(format!(
            "{message}: event handle bytes without the ready-event flag"
        )))
    } else {
        Ok(None)
    }
}

/// Decodes a `VmmChunks` body from `r` (its length checked against the type's bounds; here against
/// the count it declares; `validate` checks the rest).
fn decode_vmm_chunks(r: &mut Reader<'_>) -> Result<VmmChunksDescriptor> {
    let buffer_id = BufferId(r.u64()?);
    let unit = r.u64()?;
    let granularity = r.u64()?;
    let offset = r.u64()?;
    let len = r.u64()?;
    let count = r.u32()? as usize;
    let flags = r.u32()?;
    let handle_type = r.u32()?;
    check_reserved(r.u32()?, "VmmChunks")?;
    let event = r.array::<64>()?;
    let ready_event = vmm_ready_event("VmmChunks", flags, handle_type, event)?;
    check_vmm_chunk_count(buffer_id, count)?;
    if count * 4 != r.remaining() {
        return Err(protocol(format!(
            "VmmChunks {buffer_id}: count field says {count} chunks, the body holds {} bytes of sizes",
            r.remaining()
        )));
    }
    let mut sizes = Vec::with_capacity(count);
    for _ in 0..count {
        sizes.push(r.u32()?);
    }
    Ok(VmmChunksDescriptor {
        buffer_id,
        unit,
        granularity,
        offset,
        len,
        sizes,
        ready_event,
    })
}

/// Appends a `VmmChunks` body to `w` (`validate` bounded the count).
fn encode_vmm_chunks(c: &VmmChunksDescriptor, w: &mut Writer<'_>) {
    for field in [c.buffer_id.0, c.unit, c.granularity, c.offset, c.len] {
        w.bytes(&field.to_le_bytes());
    }
    w.bytes(&(c.count() as u32).to_le_bytes());
    let flags = if c.ready_event.is_some() {
        VMM_FLAG_READY_EVENT
    } else {
        0
    };
    w.bytes(&flags.to_le_bytes());
    w.bytes(&VMM_HANDLE_TYPE_POSIX_FD.to_le_bytes());
    w.bytes(&0u32.to_le_bytes());
    w.bytes(&c.ready_event.map_or([0; 64], |e| e.0));
    for size in &c.sizes {
        w.bytes(&size.to_le_bytes());
    }
}
