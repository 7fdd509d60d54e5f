//! The memory store's messages. One request at a time: the client sends a request and reads
//! one reply (a `Refused` for any refusal) before it sends the next.
//!
//! ```text
//! frame: header (12 bytes) + body (at most MAX_BODY_LEN bytes)
//! offset size field
//!      0    4 magic     "MPMS"
//!      4    2 version   u16 little-endian, 3 (or 2: see below)
//!      6    2 type      u16, a MessageKind
//!      8    4 body len  u32
//! strings: u16 length + UTF-8 bytes; GPU UUIDs: 16 bytes; event handles: 64 bytes
//! ```
//!
//! | type | message | direction | body | descriptors |
//! |---|---|---|---|---|
//! | 1 | Hello | client | empty | 0 |
//! | 2 | Create | client | uuid, size u64, ttl_ms u64 (0: none), name, tag, attach list (v3) | 0 |
//! | 3 | Publish | client | has_event u8, event 64, name | 0 |
//! | 4 | Attach | client | name | 0 |
//! | 5 | Detach | client | attachment u64 | 0 |
//! | 6 | Delete | client | name | 0 |
//! | 7 | List | client | after (a name, or empty to start) | 0 |
//! | 8 | Stats | client | empty | 0 |
//! | 9 | AttachMany | client | count u16 (1..=MAX_ATTACH_MANY), count x name | 0 |
//! | 10 | CreateMany | client | uuid, ttl_ms u64, tag, attach list (v3), count u16 (1..=MAX_ATTACH_MANY), count x (size u64, name) | 0 |
//! | 64 | Welcome | server | pid u32, count u16, count x (uuid, granularity u64) | 0 |
//! | 65 | Granted | server | a grant: attachment u64, size u64, granularity u64, uuid, has_event u8, event 64, memory u64, offset u64, memory_size u64 | 1 |
//! | 66 | Done | server | empty | 0 |
//! | 67 | ListPage | server | more u8, count u16, entries | 0 |
//! | 68 | StatsReply | server | 9 x u64 (v2: the first 7) | 0 |
//! | 69 | Refused | server | code u16, uid u32, scope u8, kind u8, state u8, 3 x u64, name, text | 0 |
//! | 70 | GrantedMany | server | count u16 (1..=MAX_ATTACH_MANY), count x (a grant) | count |
//!
//! A grant names the memory its buffer lies in: `memory` is the server's id of the physical
//! allocation (assigned per allocation, never reused while the server runs), `offset` the
//! buffer's place in it and `memory_size` its whole size. A buffer made by Create is alone in its
//! memory (offset 0, `memory_size` its size); the members of a CreateMany share one. The
//! descriptor is always the whole memory's: an importer maps all of it (the driver maps whole
//! allocations only) and finds the buffer at its offset. The decoder checks that the size,
//! offset and memory size are multiples of the granularity, the size non-zero, and
//! `offset + size <= memory_size`.
//!
//! A Granted's event is absent when there is nothing to wait for: the buffer was published
//! without one, or the server's relay of the creator's event has completed (the creator's GPU
//! work is done; the attacher then enqueues no wait and opens no event). A GrantedMany's
//! descriptors travel in one `SCM_RIGHTS` message (at most `MAX_ATTACH_MANY`, under the
//! kernel's `SCM_MAX_FD`), in the order of its entries. CreateMany is answered by a GrantedMany
//! with one grant per member, in order.
//!
//! Versions: this build speaks 3 and 2. A connection speaks the version of its Hello's frame:
//! the server answers in it, and every later frame of the connection is of that version, except
//! Refused, whose body is the same in every version and which is accepted in any (a server
//! refuses a connection before it read a Hello in a version-2 frame, which every client reads).
//! Version 3 added the attach list to Create and CreateMany (count u16, at most
//! `MAX_ATTACH_UIDS`, then count x uid u32: the uids besides the owner's that may attach the
//! buffers; no uid twice, none `u32::MAX`) and two numbers to StatsReply (the buffers deleted but
//! still attached, and the bytes of memories no name holds any more). A version-2 Create or
//! CreateMany has no attach list: its buffers are attachable by their owner's uid only. A client
//! that says Hello in version 3 to a server of version 2 is refused (Protocol, in a version-2
//! frame) and connects again in version 2.

use mempool_ipc::DeviceUuid;

use super::super::types::BufferInfo;

/// The protocol's magic bytes.
pub(crate) const MAGIC: [u8; 4] = *b"MPMS";
/// The newest version this build speaks (and the one its client says Hello in).
pub(crate) const VERSION: u16 = 3;
/// The oldest version this build speaks: a connection whose Hello came in a frame of this version
/// speaks it, and frames sent before the peer's version is known (a refusal at accept) are of it.
pub(crate) const MIN_VERSION: u16 = 2;
/// The most uids one attach list names (besides the owner's, always allowed).
pub(crate) const MAX_ATTACH_UIDS: usize = 64;
/// The numbers of a StatsReply (version 2 carries the first [`STATS_NUMBERS_V2`]).
pub(crate) const STATS_NUMBERS: usize = 9;
/// The numbers of a version-2 StatsReply.
pub(crate) const STATS_NUMBERS_V2: usize = 7;
/// Header length.
pub(crate) const HEADER_LEN: usize = mempool_socket::frame::HEADER_LEN;
/// The longest body: 64 KiB.
pub(crate) const MAX_BODY_LEN: usize = 64 * 1024;
/// The most devices a Welcome names.
pub(crate) const MAX_DEVICES: usize = 64;
/// The most entries one ListPage carries (each at most 16+8+128+256+... bytes: 100 fit 64 KiB).
pub(crate) const MAX_LIST_PAGE: usize = 100;
/// The most names one AttachMany or CreateMany carries (and descriptors one GrantedMany): its
/// names (at most 130 bytes each, 138 with a CreateMany's size) and its entries (129 bytes each)
/// fit a body; its descriptors fit one `SCM_RIGHTS` message (`SCM_MAX_FD`, 253).
pub(crate) const MAX_ATTACH_MANY: usize = 128;
const _: () = assert!(MAX_ATTACH_MANY <= mempool_socket::fdpass::SCM_MAX_FD);
/// An interprocess event handle.
pub(crate) type EventBytes = [u8; 64];

/// A message's type code.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum MessageKind {
    Hello = 1,
    Create = 2,
    Publish = 3,
    Attach = 4,
    Detach = 5,
    Delete = 6,
    List = 7,
    Stats = 8,
    AttachMany = 9,
    CreateMany = 10,
    Welcome = 64,
    Granted = 65,
    Done = 66,
    ListPage = 67,
    StatsReply = 68,
    Refused = 69,
    GrantedMany = 70,
}

impl MessageKind {
    pub(crate) fn from_code(code: u16) -> Option<MessageKind> {
        use MessageKind::*;
        Some(match code {
            1 => Hello,
            2 => Create,
            3 => Publish,
            4 => Attach,
            5 => Detach,
            6 => Delete,
            7 => List,
            8 => Stats,
            9 => AttachMany,
            10 => CreateMany,
            64 => Welcome,
            65 => Granted,
            66 => Done,
            67 => ListPage,
            68 => StatsReply,
            69 => Refused,
            70 => GrantedMany,
            _ => return None,
        })
    }

    /// The most descriptors a message of this type carries (its body says how many exactly:
    /// [`Message::fd_count`]).
    pub(crate) fn max_fds(self) -> usize {
        match self {
            MessageKind::Granted => 1,
            MessageKind::GrantedMany => MAX_ATTACH_MANY,
            _ => 0,
        }
    }

    /// Whether the client sends it (else the server does).
    pub(crate) fn is_from_client(self) -> bool {
        (self as u16) < 64
    }
}

/// A refusal as it travels: the code names the [`Error`](super::super::error::Error) variant,
/// the other fields are that variant's (unused ones zero or empty).
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub(crate) struct Refusal {
    pub(crate) code: u16,
    pub(crate) uid: u32,
    /// 0: a uid's quota, 1: the total.
    pub(crate) scope: u8,
    /// 0: bytes, 1: buffers; for WrongState, the operation (see `codec`).
    pub(crate) kind: u8,
    /// A buffer state's code.
    pub(crate) state: u8,
    pub(crate) numbers: [u64; 3],
    pub(crate) name: String,
    pub(crate) text: String,
}

/// A message of the memory store.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum Message {
    Hello,
    Create {
        device: DeviceUuid,
        size: u64,
        ttl_ms: u64,
        name: String,
        tag: String,
        /// Uids besides the owner's that may attach it (version 3; empty in version 2).
        attach_uids: Vec<u32>,
    },
    Publish {
        name: String,
        event: Option<EventBytes>,
    },
    Attach {
        name: String,
    },
    Detach {
        attachment: u64,
    },
    Delete {
        name: String,
    },
    List {
        after: String,
    },
    Stats,
    /// Attaches every name, all or none.
    AttachMany {
        names: Vec<String>,
    },
    /// Creates the buffers `members` (name, size each) in one allocation, all or none.
    CreateMany {
        device: DeviceUuid,
        ttl_ms: u64,
        tag: String,
        /// Uids besides the owner's that may attach its members (version 3; empty in version 2).
        attach_uids: Vec<u32>,
        members: Vec<(String, u64)>,
    },
    Welcome {
        pid: u32,
        devices: Vec<(DeviceUuid, u64)>,
    },
    /// The reply to Create and Attach; the memory's descriptor travels with it.
    Granted(GrantEntry),
    Done,
    ListPage {
        more: bool,
        entries: Vec<BufferInfo>,
    },
    /// The counters, in the order of [`ServerStats`](super::super::types::ServerStats)'s fields
    /// (a version-2 reply carries the first 7; the others decode as 0).
    StatsReply {
        numbers: [u64; STATS_NUMBERS],
    },
    Refused(Refusal),
    /// The reply to AttachMany and CreateMany: one grant per name, in order; a descriptor each.
    GrantedMany {
        grants: Vec<GrantEntry>,
    },
}

/// One grant: a Granted's body, an entry of a GrantedMany.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct GrantEntry {
    pub(crate) attachment: u64,
    /// The buffer's size.
    pub(crate) size: u64,
    pub(crate) granularity: u64,
    pub(crate) device: DeviceUuid,
    pub(crate) event: Option<EventBytes>,
    /// The server's id of the memory (physical allocation) the buffer lies in.
    pub(crate) memory: u64,
    /// The buffer's offset in that memory.
    pub(crate) offset: u64,
    /// The memory's whole size (what the descriptor's importer maps).
    pub(crate) memory_size: u64,
}

impl Message {
    pub(crate) fn kind(&self) -> MessageKind {
        match self {
            Message::Hello => MessageKind::Hello,
            Message::Create { .. } => MessageKind::Create,
            Message::Publish { .. } => MessageKind::Publish,
            Message::Attach { .. } => MessageKind::Attach,
            Message::Detach { .. } => MessageKind::Detach,
            Message::Delete { .. } => MessageKind::Delete,
            Message::List { .. } => MessageKind::List,
            Message::Stats => MessageKind::Stats,
            Message::AttachMany { .. } => MessageKind::AttachMany,
            Message::CreateMany { .. } => MessageKind::CreateMany,
            Message::Welcome { .. } => MessageKind::Welcome,
            Message::Granted(_) => MessageKind::Granted,
            Message::Done => MessageKind::Done,
            Message::ListPage { .. } => MessageKind::ListPage,
            Message::StatsReply { .. } => MessageKind::StatsReply,
            Message::Refused(_) => MessageKind::Refused,
            Message::GrantedMany { .. } => MessageKind::GrantedMany,
        }
    }

    /// How many descriptors this message carries.
    pub(crate) fn fd_count(&self) -> usize {
        match self {
            Message::Granted(_) => 1,
            Message::GrantedMany { grants } => grants.len(),
            _ => 0,
        }
    }
}
