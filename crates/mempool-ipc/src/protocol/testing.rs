//! Fixtures of the unit tests: identities, buffer descriptors, one message of every type, and a
//! raw reader of frames for tests that play a (possibly hostile) peer on a plain socket.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{
    decode_body, decode_header, BlockId, BufferDescriptor, BufferId, DeviceUuid, ErrorCode, ErrorMessage, EventHandle,
    Message, PointerDescriptor, PoolDescriptor, PoolId, Ready, ReleaseBatch, VmmBufferDescriptor, VmmChunksDescriptor,
    Welcome, HEADER_LEN,
};

pub(crate) const GPU: DeviceUuid = DeviceUuid([
    0x5a, 0x1f, 0x32, 0x9e, 0x04, 0x71, 0x4c, 0x2b, 0x9d, 0x10, 0xee, 0x42, 0x07, 0x88, 0x3c, 0x61,
]);
pub(crate) const OTHER_GPU: DeviceUuid = DeviceUuid([0x11; 16]);
pub(crate) const POOL: PoolId = PoolId([0xab; 16]);

pub(crate) fn buffer(id: u64) -> BufferDescriptor {
    BufferDescriptor {
        buffer_id: BufferId(id),
        block_id: BlockId(id / 4),
        block_size: 1 << 21,
        offset: (id % 4) << 12,
        size: 4096,
        pointer: PointerDescriptor([id as u8; 64]),
        ready_event: Some(EventHandle([0xe0 | (id as u8 & 0xf); 64])),
        keep_import: false,
    }
}

/// A `VmmBuffer` of two 2 MiB granules.
pub(crate) fn vmm_buffer(id: u64) -> VmmBufferDescriptor {
    VmmBufferDescriptor {
        buffer_id: BufferId(id),
        size: 4 << 20,
        granularity: 2 << 20,
        ready_event: Some(EventHandle([0xd0 | (id as u8 & 0xf); 64])),
    }
}

/// A `VmmChunks` range over `count` chunks in units of 2 MiB, chunk `i` of `i % 3 + 1` units (2, 4,
/// 6, 2, 4, ... MiB): from 4 KiB into the first to 8 KiB into the last.
pub(crate) fn vmm_chunks(id: u64, count: u32) -> VmmChunksDescriptor {
    let sizes: Vec<u32> = (0..count).map(|i| i % 3 + 1).collect();
    let unit = 2u64 << 20;
    let last_start: u64 = sizes[..sizes.len() - 1].iter().map(|&s| u64::from(s) * unit).sum();
    VmmChunksDescriptor {
        buffer_id: BufferId(id),
        unit,
        granularity: 2 << 20,
        offset: 4096,
        len: last_start + 8192 - 4096,
        sizes,
        ready_event: Some(EventHandle([0xc0 | (id as u8 & 0xf); 64])),
    }
}

/// One message of every type.
pub(crate) fn every_message() -> Vec<Message> {
    vec![
        Message::Hello,
        Message::Welcome(Welcome {
            device_uuid: GPU,
            pool_id: POOL,
        }),
        Message::Ready(Ready { device_uuid: GPU }),
        Message::PoolDescriptor(PoolDescriptor { pool_id: POOL }),
        Message::Buffer(buffer(5)),
        Message::Buffer(BufferDescriptor {
            ready_event: None,
            ..buffer(6)
        }),
        Message::Release {
            buffer_id: BufferId(u64::MAX),
        },
        Message::Goodbye,
        Message::Error(ErrorMessage::new(ErrorCode::NotLeased, "no such lease: ü")),
        Message::Error(ErrorMessage::new(ErrorCode::Other(77), "")),
        Message::Buffer(BufferDescriptor {
            keep_import: true,
            ..buffer(7)
        }),
        Message::Hello2 { capabilities: u64::MAX },
        Message::RingSetup,
        Message::RingBell,
        Message::Welcome2 {
            welcome: Welcome {
                device_uuid: GPU,
                pool_id: POOL,
            },
            capabilities: 1,
        },
        Message::ReleaseBatch(ReleaseBatch {
            event: Some(EventHandle([0x5e; 64])),
            buffers: vec![BufferId(3), BufferId(9), BufferId(u64::MAX)],
        }),
        Message::ReleaseBatch(ReleaseBatch {
            event: None,
            buffers: (0..super::MAX_RELEASE_BATCH as u64).map(BufferId).collect(),
        }),
        Message::VmmBuffer(vmm_buffer(7)),
        Message::VmmChunks(vmm_chunks(12, 3)),
        Message::VmmChunks(VmmChunksDescriptor {
            ready_event: None,
            ..vmm_chunks(13, 1)
        }),
        Message::VmmBuffer(VmmBufferDescriptor {
            ready_event: None,
            ..vmm_buffer(8)
        }),
    ]
}

/// Reads one whole frame from a raw stream (blocking, with a read timeout) and decodes it.
pub(crate) fn read_frame(stream: &mut UnixStream) -> Result<Message, Box<dyn std::error::Error>> {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header)?;
    let head = decode_header(&header)?;
    let mut body = vec![0u8; head.body_len];
    stream.read_exact(&mut body)?;
    Ok(decode_body(head.message_type, &body)?)
}

/// Reads an `Error` frame and then the end of the stream: what a peer sees when this side
/// rejects it.
pub(crate) fn expect_error_then_eof(stream: &mut UnixStream) -> ErrorMessage {
    let message = read_frame(stream).expect("an Error message before the close");
    let Message::Error(e) = message else {
        panic!("expected an Error message, got {message:?}");
    };
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "bytes after the Error message: {rest:?}");
    e
}
