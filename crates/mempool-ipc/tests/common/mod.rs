//! Helpers shared by the integration tests. Each test binary uses a different subset.
#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mempool_ipc::wire::{
    self, BlockId, BufferDescriptor, BufferId, DeviceUuid, ErrorCode, ErrorMessage, EventHandle, Message,
    PointerDescriptor, PoolDescriptor, PoolId, Ready, Welcome,
};
use mempool_ipc::ConnectionConfig;

/// Short limits: a stalled peer costs a test 200 ms.
pub fn short_config() -> ConnectionConfig {
    ConnectionConfig {
        io_timeout: Duration::from_millis(200),
        handshake_timeout: Duration::from_millis(200),
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A name no other test (or test process) uses.
pub fn unique_name(tag: &str) -> String {
    format!(
        "mempool-ipc-test-{}-{}-{tag}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

/// A memfd named `name` holding `contents`: the stand-in for a pool's file descriptor.
pub fn memfd_with(name: &str, contents: &[u8]) -> OwnedFd {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut file = File::from(fd);
    file.write_all(contents).unwrap();
    OwnedFd::from(file)
}

/// Everything readable through `fd`, from the start.
pub fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut file = File::from(fd);
    file.seek(SeekFrom::Start(0)).unwrap();
    let mut out = Vec::new();
    file.read_to_end(&mut out).unwrap();
    out
}

/// How many descriptors of this process refer to the memfd named `name`. Other tests run in
/// parallel threads, so the tests count their own memfds by name, not all descriptors.
pub fn open_fds_named(name: &str) -> usize {
    let needle = format!("memfd:{name} ");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with(&format!("/{needle}")))
        .count()
}

/// Whether `fd` has `FD_CLOEXEC`.
pub fn is_cloexec(fd: impl AsFd) -> bool {
    rustix::io::fcntl_getfd(fd)
        .unwrap()
        .contains(rustix::io::FdFlags::CLOEXEC)
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub const GPU: DeviceUuid = DeviceUuid([
    0x5a, 0x1f, 0x32, 0x9e, 0x04, 0x71, 0x4c, 0x2b, 0x9d, 0x10, 0xee, 0x42, 0x07, 0x88, 0x3c, 0x61,
]);
pub const OTHER_GPU: DeviceUuid = DeviceUuid([0x11; 16]);
pub const POOL: PoolId = PoolId([0xab; 16]);

pub fn buffer(id: u64) -> BufferDescriptor {
    BufferDescriptor {
        buffer_id: BufferId(id),
        block_id: BlockId(id / 4),
        block_size: 1 << 21,
        offset: (id % 4) << 12,
        size: 4096,
        pointer: PointerDescriptor([id as u8; 64]),
        ready_event: Some(EventHandle([0xe0 | (id as u8 & 0xf); 64])),
    }
}

/// One message of every type.
pub fn every_message() -> Vec<Message> {
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
    ]
}

/// Reads one whole frame from a raw stream (blocking, with a read timeout) and decodes it.
pub fn read_frame(stream: &mut UnixStream) -> mempool_ipc::Result<Message> {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut header = [0u8; wire::HEADER_LEN];
    stream.read_exact(&mut header)?;
    let head = wire::decode_header(&header)?;
    let mut body = vec![0u8; head.body_len];
    stream.read_exact(&mut body)?;
    Ok(wire::decode_body(head.message_type, &body)?)
}

/// Reads an `Error` frame and then the end of the stream: what a peer sees when this side
/// rejects it.
pub fn expect_error_then_eof(stream: &mut UnixStream) -> ErrorMessage {
    let message = read_frame(stream).expect("an Error message before the close");
    let Message::Error(e) = message else {
        panic!("expected an Error message, got {message:?}");
    };
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "bytes after the Error message: {rest:?}");
    e
}
