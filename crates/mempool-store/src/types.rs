//! Plain values the memory store's layers share: a buffer's state, what `list` reports about a
//! buffer, and the server's counters. Imports nothing of the service.

use std::fmt;
use std::time::Duration;

use mempool_ipc::DeviceUuid;

/// Where a buffer is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum BufferState {
    /// Allocated and handed to its creator, who writes it; not yet attachable. Freed if the
    /// creator's connection ends before it publishes.
    Creating,
    /// Published: attachable by name until deleted or expired, whether its creator lives or not.
    Published,
    /// Deleted or expired: its name is gone; its memory stays until the last attachment lets go.
    Deleting,
}

impl BufferState {
    pub(crate) fn code(self) -> u8 {
        match self {
            BufferState::Creating => 0,
            BufferState::Published => 1,
            BufferState::Deleting => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<BufferState> {
        match code {
            0 => Some(BufferState::Creating),
            1 => Some(BufferState::Published),
            2 => Some(BufferState::Deleting),
            _ => None,
        }
    }
}

impl fmt::Display for BufferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufferState::Creating => "being created",
            BufferState::Published => "published",
            BufferState::Deleting => "being deleted",
        })
    }
}

/// One named buffer as [`Client::list`](super::client::Client::list) reports it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct BufferInfo {
    /// The buffer's name.
    pub name: String,
    /// Its size in bytes (rounded up to the GPU's VMM granularity).
    pub size: u64,
    /// The GPU that holds it.
    pub device: DeviceUuid,
    /// The tag given at creation (empty if none).
    pub tag: String,
    /// [`BufferState::Creating`] or [`BufferState::Published`] (deleted buffers are not listed).
    pub state: BufferState,
    /// The uid of the process that created it.
    pub owner_uid: u32,
    /// The pid of the process that created it (it may be gone).
    pub owner_pid: i32,
    /// How many attachments it has now (the creator's own mapping after publishing counts).
    pub attachments: u32,
    /// Time left before it expires, if it has a time-to-live.
    pub expires_in: Option<Duration>,
}

/// The server's counters ([`Client::stats`](super::client::Client::stats),
/// [`Server::stats`](super::server::Server::stats)).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ServerStats {
    /// Buffers holding memory: named ones (creating, including those whose memory is being
    /// allocated, or published) and deleted ones still attached.
    pub buffers: u64,
    /// The bytes of their memory (those being allocated included: their quota is reserved; a
    /// group's whole allocation while any of its members holds it).
    pub bytes: u64,
    /// Buffers with a name (creating or published).
    pub named: u64,
    /// Attachments held by connected clients (and by dead ones whose process has not exited).
    pub attachments: u64,
    /// Open client connections.
    pub connections: u64,
    /// Buffers freed so far (deleted, expired, or abandoned by a dead creator; a `create` whose
    /// allocation failed or was refused before it committed is not counted).
    pub freed: u64,
    /// Connections turned away or closed for breaking the rules (limits, garbage, timeouts).
    pub rejected: u64,
    /// Buffers without a name any more (deleted, expired, or abandoned by their creator) whose
    /// memory attachments still hold. (0 from a server of protocol version 2, which does not say.)
    pub lingering_buffers: u64,
    /// The bytes of the memories none of whose buffers has a name any more, held only by
    /// attachments: charged to the uids holding them, not to their owner (docs/memory-service.md,
    /// "Who pays after a delete"). (0 from a server of protocol version 2.)
    pub lingering_bytes: u64,
}
