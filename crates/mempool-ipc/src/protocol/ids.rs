//! The protocol's names for things: GPUs ([`DeviceUuid`]), pools ([`PoolId`]), buffers
//! ([`BufferId`]), blocks ([`BlockId`]), exported pointers ([`PointerDescriptor`]), interprocess
//! events ([`EventHandle`]) and message types ([`MessageType`]). Plain values; this module
//! imports nothing of the crate.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The UUID of a GPU (`cuDeviceGetUuid`): the same physical GPU has the same UUID in every
/// process, whatever its ordinal there.
///
/// Displayed the way `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeviceUuid(pub [u8; 16]);

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The identity of an exported pool, chosen by the exporter; never all zeros.
///
/// It lets an importer tell pools apart (and tell a restarted exporter from the one it knew).
/// It is not a secret and grants nothing: the socket is the gate.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId(pub [u8; 16]);

impl PoolId {
    /// A fresh id, unique on this host with overwhelming likelihood: the process id, the time
    /// and a per-process counter.
    pub fn generate() -> PoolId {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let pid = std::process::id() as u64;
        let hi = pid << 32 | (count & 0xffff_ffff);
        // The top bit keeps the id away from all zeros even if everything else is zero.
        let lo = nanos | 1 << 63;
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&hi.to_le_bytes());
        bytes[8..].copy_from_slice(&lo.to_le_bytes());
        PoolId(bytes)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolId({self})")
    }
}

/// The exporter's name for a shared buffer; unique per exporter.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BufferId(pub u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

impl From<u64> for BufferId {
    fn from(id: u64) -> Self {
        BufferId(id)
    }
}

/// The exporter's name for an exported block (one allocation from the pool that buffers may
/// be suballocated from); unique per exporter.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u64);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block#{}", self.0)
    }
}

impl From<u64> for BlockId {
    fn from(id: u64) -> Self {
        BlockId(id)
    }
}

/// The 64 opaque bytes `cuMemPoolExportPointer` writes for an allocation
/// (`CUmemPoolPtrExportData`); `cuMemPoolImportPointer` turns them back into a pointer in a
/// process that imported the pool.
///
/// They are not a capability: whoever holds the pool's file descriptor could guess them.
/// The socket, which hands out the pool, is the gate.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PointerDescriptor(pub(crate) [u8; 64]);

/// An interprocess event handle (`CUipcEventHandle`, from `cuIpcGetEventHandle`): the importer
/// opens it with `cuIpcOpenEventHandle` and makes its stream wait on it before first use.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct EventHandle(pub(crate) [u8; 64]);

/// The most chunks, and so file descriptors, one `VmmChunks` message carries: what one `sendmsg`
/// can carry on Linux (`SCM_MAX_FD`). A longer range is shared in several parts (or with larger
/// chunks).
pub const MAX_VMM_CHUNKS: usize = 253;

/// The type of a message, as the frame header names it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u16)]
pub enum MessageType {
    /// Importer -> exporter: opens the conversation.
    Hello = 1,
    /// Exporter -> importer: the GPU and the pool.
    Welcome = 2,
    /// Importer -> exporter: the importer sees the GPU.
    Ready = 3,
    /// Exporter -> importer: the pool's file descriptor (one descriptor attached).
    PoolDescriptor = 4,
    /// Exporter -> importer: a shared buffer.
    Buffer = 5,
    /// Importer -> exporter: the importer is done with a buffer.
    Release = 6,
    /// Either way: the sender is done and closes the connection.
    Goodbye = 7,
    /// Either way: something went wrong; the sender closes the connection.
    Error = 8,
    /// Importer -> exporter (version 2): opens the conversation with the capabilities it asks for.
    Hello2 = 9,
    /// Exporter -> importer (version 2): the GPU, the pool and the capabilities granted.
    Welcome2 = 10,
    /// Importer -> exporter (version 2, with the fast release capability): several releases,
    /// ordered by one interprocess event.
    ReleaseBatch = 11,
    /// Exporter -> importer (version 2, only to an importer granted the capability `CAP_VMM`): a
    /// VMM physical allocation (one descriptor attached). Codes 32 to 47 are kept for VMM messages.
    VmmBuffer = 32,
    /// Exporter -> importer (version 2, only to an importer granted the capability
    /// `CAP_VMM_CHUNKS`): a range over several VMM physical allocations, each of the size the body
    /// gives it, mapped back to back (one descriptor per chunk attached, as many as the body's count
    /// says).
    VmmChunks = 33,
    /// Exporter -> importer (version 2, only to an importer granted the capability `CAP_RING`),
    /// right after `PoolDescriptor`: the connection's shared-memory rings (one descriptor
    /// attached: the sealed memfd, see `mempool_ipc::ring`). Codes 48 to 63 are kept for ring
    /// messages.
    RingSetup = 48,
    /// Importer -> exporter (version 2, `CAP_RING`): the importer published releases in its ring
    /// while the exporter's waiting flag was set: the exporter's doorbell.
    RingBell = 49,
}

impl MessageType {
    /// Every message type, in wire order.
    pub(crate) const ALL: [MessageType; 15] = [
        MessageType::Hello,
        MessageType::Welcome,
        MessageType::Ready,
        MessageType::PoolDescriptor,
        MessageType::Buffer,
        MessageType::Release,
        MessageType::Goodbye,
        MessageType::Error,
        MessageType::Hello2,
        MessageType::Welcome2,
        MessageType::ReleaseBatch,
        MessageType::VmmBuffer,
        MessageType::VmmChunks,
        MessageType::RingSetup,
        MessageType::RingBell,
    ];

    /// The type with this wire code, if the protocol defines one.
    pub fn from_wire(code: u16) -> Option<MessageType> {
        MessageType::ALL.into_iter().find(|t| t.to_wire() == code)
    }

    /// This type's wire code.
    pub fn to_wire(self) -> u16 {
        self as u16
    }

    /// The type's name, as the specification spells it.
    pub fn name(self) -> &'static str {
        match self {
            MessageType::Hello => "Hello",
            MessageType::Welcome => "Welcome",
            MessageType::Ready => "Ready",
            MessageType::PoolDescriptor => "PoolDescriptor",
            MessageType::Buffer => "Buffer",
            MessageType::Release => "Release",
            MessageType::Goodbye => "Goodbye",
            MessageType::Error => "Error",
            MessageType::Hello2 => "Hello2",
            MessageType::Welcome2 => "Welcome2",
            MessageType::ReleaseBatch => "ReleaseBatch",
            MessageType::VmmBuffer => "VmmBuffer",
            MessageType::VmmChunks => "VmmChunks",
            MessageType::RingSetup => "RingSetup",
            MessageType::RingBell => "RingBell",
        }
    }

    /// The protocol version that defines this type: frames of this type carry it, and a frame
    /// of this type with another version is refused.
    pub(crate) fn version(self) -> u16 {
        match self {
            MessageType::Hello2
            | MessageType::Welcome2
            | MessageType::ReleaseBatch
            | MessageType::VmmBuffer
            | MessageType::VmmChunks
            | MessageType::RingSetup
            | MessageType::RingBell => 2,
            _ => 1,
        }
    }

    /// The most file descriptors a message of this type carries: exactly that many for every type
    /// but `VmmChunks`, whose body says how many (1 to this bound; [`Message::descriptor_count`]
    /// gives a decoded message's exact count).
    ///
    /// [`Message::descriptor_count`]: super::messages::Message::descriptor_count
    pub(crate) fn max_descriptors(self) -> usize {
        match self {
            MessageType::PoolDescriptor | MessageType::VmmBuffer | MessageType::RingSetup => 1,
            MessageType::VmmChunks => MAX_VMM_CHUNKS,
            _ => 0,
        }
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
