//! The server's state machine, without sockets: names, buffers, attachments per connection,
//! quotas and time-to-live ([`State`]), and [`Service`], which keeps it behind one lock beside a
//! [`Backend`]. The server (`server`) calls the service; the tests (`state/tests.rs`) drive it
//! with the host double and an explicit clock.
//!
//! No GPU call runs under the lock. `create` reserves the name and the owner's quota under it
//! (a buffer in state Creating with no memory yet, which `list` shows as being created, `attach`
//! refuses and a racing `create` of its name finds taken), allocates and exports with it
//! released, and retakes it to commit, or to roll back the reservation if the allocation failed,
//! the connection ended or the buffer was deleted meanwhile. `publish` relays the creator's
//! event, and `attach` queries the relayed event and exports the memory, the same way between a
//! step that checks (and, for `attach`, counts the attachment) and one that commits. Buffers
//! freed under the lock are dropped, their memory released, after it is released.
//!
//! Groups: `create_many` makes several named buffers, its members, in one physical allocation
//! (each member's size rounded up to the granularity, laid out back to back); a plain `create`
//! makes a group of one. Each member is an ordinary buffer for `publish`, `attach`, `delete` and
//! `list`, except that a member is attachable only once every member of its group is published,
//! and that the group's memory is released, and its bytes credited back, only when its last
//! member is freed (a freed member's range is never given to another buffer). Every grant names
//! its group's memory id (the group's id: never reused while the server runs), the member's
//! offset in it and the memory's size; its descriptor is the whole memory's.
//!
//! A buffer's life: `create` allocates it (state Creating) and gives its creator an attachment
//! and a descriptor; `publish` (creator only) relays the creator's event and makes it attachable
//! (Published); `delete`, its time-to-live or its creator's death before publishing take its
//! name away at once (Deleting); its memory is released, and its bytes credited back to its
//! owner's quota, when its last attachment ends. A connection that ends leaves its attachments in
//! place until its process has exited ([`State::process_exited`]): until then the process may
//! still map the memory through its own imported handle, so the quota stays charged.
//!
//! Who may attach: a group's owner's uid, and the uids of its attach list (given at creation;
//! empty by default). Who pays: a group's memory is charged to its owner while any of its
//! members has a name; once none has (deleted, expired, abandoned) and attachments still hold
//! the memory, the charge moves to the uids holding them, each charged the whole memory (each
//! alone keeps it alive) until its last attachment of it ends, and the total counts the memory
//! once. So no attacher can pin its owner's quota: the owner stops paying when it deletes, unless
//! it holds the memory itself, and a holder stops paying when it lets go.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::backend::{Allocation, Backend, RelayedEvent};
use super::error::{Error, Result};
use super::names;
use super::policy::{Access, Ledger, Quotas};
use super::protocol::codec::{self, OP_ATTACH_GROUP_LOST, OP_ATTACH_GROUP_UNPUBLISHED, OP_FINISH_CREATE};
use super::protocol::messages::{EventBytes, MAX_ATTACH_MANY, MAX_LIST_PAGE};
use super::types::{BufferInfo, BufferState, ServerStats};
use mempool_ipc::DeviceUuid;

/// A connection's id, chosen by the server.
pub(crate) type ConnId = u64;

/// What `create` and `attach` hand to the client. `event` is the server's event the client's
/// stream must wait on, `None` when there is nothing to wait for (a buffer being created, one
/// published without an event, or one whose relayed event has completed: the ready case).
pub(crate) struct Grant {
    pub(crate) attachment: u64,
    /// The buffer's size.
    pub(crate) size: u64,
    pub(crate) granularity: u64,
    pub(crate) device: DeviceUuid,
    pub(crate) event: Option<EventBytes>,
    /// The id of the memory the buffer lies in (its group's).
    pub(crate) memory: u64,
    /// The buffer's offset in that memory.
    pub(crate) offset: u64,
    /// The memory's whole size.
    pub(crate) memory_size: u64,
    /// A descriptor of the whole memory.
    pub(crate) fd: OwnedFd,
}

/// The service's rules, fixed when the server starts.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    pub(crate) server_uid: u32,
    pub(crate) access: Access,
    pub(crate) quotas: Quotas,
    pub(crate) default_ttl: Option<Duration>,
    /// The largest buffer, after rounding (and the largest group, all its members together).
    pub(crate) max_buffer_bytes: u64,
    /// Attachments one connection may hold at once (its creations' included).
    pub(crate) max_attachments_per_connection: usize,
}

struct Buffer {
    name: String,
    size: u64,
    /// Its group (the id of the memory it lies in) and its offset there.
    group: u64,
    offset: u64,
    device: usize,
    tag: String,
    owner_uid: u32,
    owner_pid: i32,
    creator: ConnId,
    state: BufferState,
    expires_at: Option<Instant>,
    attachments: u32,
    /// Whether `event` was seen complete (then attachers wait on nothing; it stays complete).
    ready: bool,
    /// Dropped last: the event, then the memory. `attach` clones them to query and export with
    /// the lock released.
    event: Option<Arc<dyn RelayedEvent>>,
    /// `None` while the memory is being allocated (state Creating, no attachments: reserved by
    /// [`State::begin_create_many`]). The group's: every member holds it, so the memory is
    /// released with the last member.
    memory: Option<Arc<dyn Allocation>>,
}

/// The buffers made in one allocation (one for a plain `create`).
struct Group {
    /// The memory's size: its members', each rounded, together.
    size: u64,
    owner_uid: u32,
    /// How many members it was made with (the buffers charged to the owner's quota).
    count: usize,
    /// Members not yet freed: the group goes, and its quota is credited, when none are left.
    live: usize,
    /// Members published.
    published: usize,
    /// Whether a member lost its name before it was published (the group then never becomes
    /// attachable).
    lost: bool,
    /// The uids besides the owner's that may attach its members (sorted, each once, not the
    /// owner's).
    attach_uids: Vec<u32>,
    /// Members with a name (being created or published).
    named: usize,
    /// Attachments of its members, per uid that holds any.
    holders: HashMap<u32, u32>,
    /// Whether its charge moved from its owner to its holders: no member has a name, and
    /// attachments still hold the memory. Each uid in `holders` is then charged `size` bytes
    /// and `count` buffers.
    lingering: bool,
}

impl Group {
    fn may_attach(&self, uid: u32) -> bool {
        uid == self.owner_uid || self.attach_uids.binary_search(&uid).is_ok()
    }
}

/// An attachment: the connection holding it, its buffer, and the uid charged for it if its
/// memory lingers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Hold {
    conn: ConnId,
    buffer: u64,
    uid: u32,
}

struct Conn {
    uid: u32,
    /// False once the connection ended; its attachments wait for `process_exited`.
    open: bool,
    attachments: HashSet<u64>,
}

/// A group [`State::begin_create_many`] reserved: its names and its owner's quota are held
/// until [`State::finish_create`] or [`State::abort_create`].
pub(crate) struct Reserved {
    group: u64,
    index: usize,
    /// The memory's size, all members together.
    size: u64,
    /// The members in order: id, name, offset, size.
    members: Vec<(u64, String, u64, u64)>,
}

/// An attachment [`State::begin_attach`] counted (the buffer cannot be freed under it), still
/// without its descriptor, which is exported with the lock released.
pub(crate) struct Pending {
    attachment: u64,
    buffer: u64,
    name: String,
    size: u64,
    device: DeviceUuid,
    granularity: u64,
    group: u64,
    offset: u64,
    memory_size: u64,
    memory: Arc<dyn Allocation>,
    /// The relayed event, unless it was seen complete before.
    event: Option<Arc<dyn RelayedEvent>>,
}

/// A [`Pending`] attachment after the steps run with the lock released: whether its event is
/// complete and its descriptor.
pub(crate) struct Exported {
    pending: Pending,
    done: bool,
    fd: Result<OwnedFd>,
}

/// The server's state. See the [module documentation](self).
pub(crate) struct State {
    devices: Vec<(DeviceUuid, u64)>,
    rules: Rules,
    ledger: Ledger,
    names: BTreeMap<String, u64>,
    buffers: HashMap<u64, Buffer>,
    /// Groups by id (their memory's id).
    groups: HashMap<u64, Group>,
    /// Attachment id -> who holds which buffer.
    attachments: HashMap<u64, Hold>,
    conns: HashMap<ConnId, Conn>,
    next_id: u64,
    freed: u64,
    rejected: u64,
    /// Buffers freed under the lock, dropped (their memory released) once [`Service`] released it.
    dead: Vec<Buffer>,
    /// The deadlines of named buffers with a time-to-live, earliest first: (deadline, buffer id).
    /// An entry goes when its buffer loses its name, however it loses it, so [`State::expire`]
    /// looks only at the deadlines that came and the first one that has not.
    deadlines: BTreeSet<(Instant, u64)>,
    /// Buffers [`State::expire`] looked at so far (what expiry costs; the tests read it).
    expiry_visits: u64,
}

impl State {
    pub(crate) fn new(devices: Vec<(DeviceUuid, u64)>, rules: Rules) -> State {
        State {
            devices,
            ledger: Ledger::new(rules.quotas),
            rules,
            names: BTreeMap::new(),
            buffers: HashMap::new(),
            groups: HashMap::new(),
            attachments: HashMap::new(),
            conns: HashMap::new(),
            next_id: 1,
            freed: 0,
            rejected: 0,
            dead: Vec::new(),
            deadlines: BTreeSet::new(),
            expiry_visits: 0,
        }
    }

    /// The served devices (UUID, granularity).
    pub(crate) fn devices(&self) -> Vec<(DeviceUuid, u64)> {
        self.devices.clone()
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Admits a connection of `uid` (the access rules), under the id `conn`.
    pub(crate) fn connect(&mut self, conn: ConnId, uid: u32) -> Result<()> {
        self.rules.access.check_connect(self.rules.server_uid, uid)?;
        self.conns.insert(
            conn,
            Conn {
                uid,
                open: true,
                attachments: HashSet::new(),
            },
        );
        Ok(())
    }

    fn conn(&self, conn: ConnId) -> Result<&Conn> {
        self.conns
            .get(&conn)
            .filter(|c| c.open)
            .ok_or_else(|| Error::protocol(format!("connection {conn} is not open")))
    }

    /// Counts a connection turned away or closed for breaking the rules.
    pub(crate) fn count_rejected(&mut self) {
        self.rejected += 1;
    }

    /// Whether the connection holds anything (then it is never closed for idleness).
    pub(crate) fn holds_anything(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| !c.attachments.is_empty())
    }

    /// `create_many`, first step: checks the request (all or nothing: any bad or taken name, bad
    /// size or quota refuses the whole group) and reserves the names and the owner's quota (the
    /// group's total bytes, a buffer per member) for a group of buffers in state Creating
    /// without memory (no attachment yet).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin_create_many(
        &mut self,
        conn: ConnId,
        pid: i32,
        device: DeviceUuid,
        ttl_ms: u64,
        tag: &str,
        attach_uids: &[u32],
        members: &[(String, u64)],
        now: Instant,
    ) -> Result<Reserved> {
        self.expire(now);
        let uid = self.conn(conn)?.uid;
        // The decoder checked the list already; the state trusts no caller.
        codec::check_attach_uids(attach_uids).map_err(Error::protocol)?;
        let mut attach_uids: Vec<u32> = attach_uids.iter().copied().filter(|&u| u != uid).collect();
        attach_uids.sort_unstable();
        if members.is_empty() || members.len() > MAX_ATTACH_MANY {
            return Err(Error::protocol(format!(
                "create_many of {} buffers (1 to {MAX_ATTACH_MANY})",
                members.len()
            )));
        }
        self.room_for(conn, members.len())?;
        for (name, _) in members {
            names::validate_name(name)?;
        }
        names::check_tag(tag)?;
        let index = self
            .devices
            .iter()
            .position(|(uuid, _)| *uuid == device)
            .ok_or_else(|| Error::DeviceNotServed {
                device: device.to_string(),
            })?;
        let granularity = self.devices[index].1;
        let max = self.rules.max_buffer_bytes;
        let mut total: u64 = 0;
        let mut laid_out = Vec::with_capacity(members.len());
        for (name, size) in members {
            if *size == 0 {
                return Err(Error::BadSize {
                    size: *size,
                    reason: format!("buffer {name:?} cannot be empty"),
                });
            }
            let rounded = size
                .checked_next_multiple_of(granularity)
                .filter(|&r| r <= max)
                .ok_or_else(|| Error::BadSize {
                    size: *size,
                    reason: format!(
                        "buffer {name:?} rounded up to the granularity of {granularity} bytes passes the largest \
                         buffer, {max} bytes"
                    ),
                })?;
            let offset = total;
            total = total
                .checked_add(rounded)
                .filter(|&t| t <= max)
                .ok_or_else(|| Error::BadSize {
                    size: *size,
                    reason: format!(
                        "buffer {name:?} takes its group past the largest allocation, {max} bytes (the members of \
                     a group are allocated together)"
                    ),
                })?;
            laid_out.push((name, offset, rounded));
        }
        for (i, (name, _)) in members.iter().enumerate() {
            if self.names.contains_key(name) || members[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::NameTaken { name: name.clone() });
            }
        }
        self.ledger.check_many(uid, total, members.len() as u64)?;
        let ttl = if ttl_ms > 0 {
            Some(Duration::from_millis(ttl_ms))
        } else {
            self.rules.default_ttl
        };
        let group = self.fresh_id();
        self.ledger.charge_many(uid, total, members.len() as u64);
        self.groups.insert(
            group,
            Group {
                size: total,
                owner_uid: uid,
                count: members.len(),
                live: members.len(),
                published: 0,
                lost: false,
                attach_uids,
                named: members.len(),
                holders: HashMap::new(),
                lingering: false,
            },
        );
        let mut reserved = Reserved {
            group,
            index,
            size: total,
            members: Vec::with_capacity(members.len()),
        };
        let expires_at = ttl.and_then(|t| now.checked_add(t));
        for (name, offset, rounded) in laid_out {
            let id = self.fresh_id();
            self.names.insert(name.clone(), id);
            if let Some(deadline) = expires_at {
                self.deadlines.insert((deadline, id));
            }
            self.buffers.insert(
                id,
                Buffer {
                    name: name.clone(),
                    size: rounded,
                    group,
                    offset,
                    device: index,
                    tag: tag.to_owned(),
                    owner_uid: uid,
                    owner_pid: pid,
                    creator: conn,
                    state: BufferState::Creating,
                    expires_at,
                    attachments: 0,
                    ready: false,
                    event: None,
                    memory: None,
                },
            );
            reserved.members.push((id, name.clone(), offset, rounded));
        }
        Ok(reserved)
    }

    /// `create` and `create_many`, last step: the reserved buffers get their memory and their
    /// creator an attachment each (with a descriptor of `fds`, one per member). Refused, the
    /// reservation rolled back, if the connection ended meanwhile; if a member lost its name
    /// meanwhile (deleted, expired: a reservation holds no attachment, so it was freed at once),
    /// refused as being deleted, the other members rolled back.
    pub(crate) fn finish_create(
        &mut self,
        conn: ConnId,
        reserved: &Reserved,
        memory: &Arc<dyn Allocation>,
        fds: Vec<OwnedFd>,
    ) -> Result<Vec<Grant>> {
        debug_assert_eq!(fds.len(), reserved.members.len());
        if let Err(e) = self.conn(conn) {
            self.abort_create(reserved);
            return Err(e);
        }
        let lost = reserved.members.iter().find(|(id, ..)| {
            !self
                .buffers
                .get(id)
                .is_some_and(|b| b.memory.is_none() && b.state == BufferState::Creating)
        });
        if let Some((_, name, ..)) = lost {
            let name = name.clone();
            self.abort_create(reserved);
            return Err(Error::WrongState {
                name,
                state: BufferState::Deleting,
                op: OP_FINISH_CREATE,
            });
        }
        let (device, granularity) = self.devices[reserved.index];
        let uid = self.conn(conn)?.uid;
        let mut grants = Vec::with_capacity(fds.len());
        for ((id, _, offset, size), fd) in reserved.members.iter().zip(fds) {
            let buffer = self.buffers.get_mut(id).expect("checked above");
            buffer.memory = Some(memory.clone());
            buffer.attachments = 1;
            let attachment = self.fresh_id();
            self.hold(attachment, conn, *id, uid, reserved.group);
            grants.push(Grant {
                attachment,
                size: *size,
                granularity,
                device,
                event: None,
                memory: reserved.group,
                offset: *offset,
                memory_size: reserved.size,
                fd,
            });
        }
        Ok(grants)
    }

    /// `create` failed (or its connection ended) between the steps: the reservation's names and
    /// quota go back, unless [`State::finish_create`] committed it or they were freed already.
    pub(crate) fn abort_create(&mut self, reserved: &Reserved) {
        for (id, ..) in &reserved.members {
            if self.buffers.get(id).is_some_and(|b| b.memory.is_none()) {
                self.unname(*id);
            }
        }
    }

    fn named(&self, name: &str) -> Result<u64> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownName { name: name.to_owned() })
    }

    /// `publish`, first step: checks that `conn` created the buffer `name` and it is being
    /// created; returns its id and device index (for the relay of the creator's event).
    pub(crate) fn begin_publish(&mut self, conn: ConnId, name: &str, now: Instant) -> Result<(u64, usize)> {
        self.expire(now);
        self.conn(conn)?;
        names::validate_name(name)?;
        let id = self.named(name)?;
        let buffer = &self.buffers[&id];
        if buffer.state != BufferState::Creating {
            return Err(Error::WrongState {
                name: name.to_owned(),
                state: buffer.state,
                op: "publish",
            });
        }
        if buffer.creator != conn {
            return Err(Error::NotCreator { name: name.to_owned() });
        }
        Ok((id, buffer.device))
    }

    /// `publish`, last step: the buffer `id` (named `name`) becomes attachable, ordered after
    /// `relayed` (the creator's event relayed, if it sent one). Refused if it lost its name
    /// meanwhile (deleted or expired while the event was relayed).
    pub(crate) fn finish_publish(
        &mut self,
        conn: ConnId,
        id: u64,
        name: &str,
        relayed: Option<&Arc<dyn RelayedEvent>>,
    ) -> Result<()> {
        self.conn(conn)?;
        let buffer = match self.buffers.get_mut(&id) {
            Some(b) if b.state == BufferState::Creating => b,
            other => {
                return Err(Error::WrongState {
                    name: name.to_owned(),
                    state: other.map_or(BufferState::Deleting, |b| b.state),
                    op: "publish",
                })
            }
        };
        buffer.event = relayed.cloned();
        buffer.state = BufferState::Published;
        let group = buffer.group;
        if let Some(g) = self.groups.get_mut(&group) {
            g.published += 1;
        }
        Ok(())
    }

    /// `attach`, first step: a new attachment of a published buffer, counted now; its
    /// descriptor and the query of its event come with the lock released.
    pub(crate) fn begin_attach(&mut self, conn: ConnId, name: &str, now: Instant) -> Result<Pending> {
        self.expire(now);
        self.room_for(conn, 1)?;
        self.attach_one(conn, name)
    }

    /// `attach_many`, first step: attaches every name of `names` (at most [`MAX_ATTACH_MANY`]),
    /// in order, all or none: on the first refusal the attachments made so far end and the
    /// error (which names the buffer) is returned.
    pub(crate) fn begin_attach_many(&mut self, conn: ConnId, names: &[String], now: Instant) -> Result<Vec<Pending>> {
        self.expire(now);
        self.conn(conn)?;
        if names.is_empty() || names.len() > MAX_ATTACH_MANY {
            return Err(Error::protocol(format!(
                "attach_many of {} names (1 to {MAX_ATTACH_MANY})",
                names.len()
            )));
        }
        for name in names {
            names::validate_name(name)?;
        }
        self.room_for(conn, names.len())?;
        let mut pending: Vec<Pending> = Vec::with_capacity(names.len());
        for name in names {
            match self.attach_one(conn, name) {
                Ok(p) => pending.push(p),
                Err(e) => {
                    for p in pending {
                        self.end_attachment(p.attachment);
                    }
                    return Err(e);
                }
            }
        }
        Ok(pending)
    }

    /// `attach` and `attach_many`, last step: the grants, with the server's event while the
    /// creator's work may still run and none once a query of it said it is done. All or none: if
    /// an export failed, or an attachment ended meanwhile (the server shutting down), every
    /// attachment of `exported` ends and the first error is returned.
    pub(crate) fn finish_attach(&mut self, conn: ConnId, exported: Vec<Exported>) -> Result<Vec<Grant>> {
        let mut failure = None;
        for e in &exported {
            let held = self.holds(e.pending.attachment, conn, e.pending.buffer);
            let problem = match &e.fd {
                Err(err) => Some(export_error(&e.pending.name, err)),
                Ok(_) if !held => Some(Error::Busy {
                    reason: format!(
                        "the attachment of buffer {:?} ended while it was granted (the server is shutting down)",
                        e.pending.name
                    ),
                }),
                Ok(_) => None,
            };
            if failure.is_none() {
                failure = problem;
            }
        }
        if let Some(err) = failure {
            for e in exported {
                if self.holds(e.pending.attachment, conn, e.pending.buffer) {
                    self.end_attachment(e.pending.attachment);
                }
            }
            return Err(err);
        }
        let mut grants = Vec::with_capacity(exported.len());
        for Exported { pending: p, done, fd } in exported {
            if done {
                if let Some(buffer) = self.buffers.get_mut(&p.buffer) {
                    buffer.ready = true;
                }
            }
            grants.push(Grant {
                attachment: p.attachment,
                size: p.size,
                granularity: p.granularity,
                device: p.device,
                event: if done {
                    None
                } else {
                    p.event.as_ref().map(|e| e.handle())
                },
                memory: p.group,
                offset: p.offset,
                memory_size: p.memory_size,
                fd: fd.expect("checked above"),
            });
        }
        Ok(grants)
    }

    /// Whether the open connection `conn` may take `more` attachments within
    /// `max_attachments_per_connection` (a `Busy` refusal with the numbers if not).
    fn room_for(&self, conn: ConnId, more: usize) -> Result<()> {
        let held = self.conn(conn)?.attachments.len();
        let limit = self.rules.max_attachments_per_connection;
        if held.saturating_add(more) > limit {
            return Err(Error::Busy {
                reason: format!(
                    "this connection holds {held} attachments and asked for {more} more, past the limit of \
                     {limit} per connection (detach some first)"
                ),
            });
        }
        Ok(())
    }

    fn attach_one(&mut self, conn: ConnId, name: &str) -> Result<Pending> {
        names::validate_name(name)?;
        let uid = self.conn(conn)?.uid;
        let id = self.named(name)?;
        let buffer = self.buffers.get_mut(&id).expect("named buffers exist");
        let group = self
            .groups
            .get(&buffer.group)
            .expect("a buffer's group lives while it does");
        if !group.may_attach(uid) {
            return Err(Error::NotPermitted {
                uid,
                what: format!(
                    "attach buffer {name:?} of uid {} (its attach list: uid {} and {:?}; its owner widens it at \
                     creation)",
                    group.owner_uid, group.owner_uid, group.attach_uids
                ),
            });
        }
        // Only a committed buffer is published (its creator publishes after `finish_create`).
        let memory = match (&buffer.memory, buffer.state) {
            (Some(memory), BufferState::Published) => memory.clone(),
            (_, state) => {
                return Err(Error::WrongState {
                    name: name.to_owned(),
                    state,
                    op: "attach",
                })
            }
        };
        let group = self
            .groups
            .get(&buffer.group)
            .expect("a buffer's group lives while it does");
        if group.published < group.count {
            let (state, op) = if group.lost {
                (BufferState::Deleting, OP_ATTACH_GROUP_LOST)
            } else {
                (BufferState::Creating, OP_ATTACH_GROUP_UNPUBLISHED)
            };
            return Err(Error::WrongState {
                name: name.to_owned(),
                state,
                op,
            });
        }
        let (memory_id, memory_size) = (buffer.group, group.size);
        let Some(count) = buffer.attachments.checked_add(1) else {
            return Err(Error::Busy {
                reason: format!(
                    "buffer {name:?} has {} attachments, the most one buffer can count",
                    u32::MAX
                ),
            });
        };
        let (device, granularity) = self.devices[buffer.device];
        let event = if buffer.ready { None } else { buffer.event.clone() };
        buffer.attachments = count;
        let (size, offset) = (buffer.size, buffer.offset);
        let attachment = self.fresh_id();
        self.hold(attachment, conn, id, uid, memory_id);
        Ok(Pending {
            attachment,
            buffer: id,
            name: name.to_owned(),
            size,
            device,
            granularity,
            group: memory_id,
            offset,
            memory_size,
            memory,
            event,
        })
    }

    /// `detach`: ends one of the connection's attachments. The creator detaching a buffer it has
    /// not published abandons it: its name goes and its memory is freed.
    pub(crate) fn detach(&mut self, conn: ConnId, attachment: u64) -> Result<()> {
        self.conn(conn)?;
        match self.attachments.get(&attachment) {
            Some(hold) if hold.conn == conn => {}
            _ => {
                return Err(Error::protocol(format!(
                    "attachment {attachment} is not held by this connection"
                )))
            }
        }
        self.end_attachment(attachment);
        Ok(())
    }

    /// Records the attachment `attachment` of buffer `id` (of group `group`) held by `conn` of
    /// `uid`.
    fn hold(&mut self, attachment: u64, conn: ConnId, id: u64, uid: u32, group: u64) {
        self.attachments.insert(attachment, Hold { conn, buffer: id, uid });
        if let Some(c) = self.conns.get_mut(&conn) {
            c.attachments.insert(attachment);
        }
        if let Some(g) = self.groups.get_mut(&group) {
            *g.holders.entry(uid).or_insert(0) += 1;
        }
    }

    /// Whether `conn` holds `attachment`, of buffer `id`.
    fn holds(&self, attachment: u64, conn: ConnId, id: u64) -> bool {
        self.attachments
            .get(&attachment)
            .is_some_and(|h| h.conn == conn && h.buffer == id)
    }

    fn end_attachment(&mut self, attachment: u64) {
        let Some(Hold { conn, buffer: id, uid }) = self.attachments.remove(&attachment) else {
            return;
        };
        if let Some(c) = self.conns.get_mut(&conn) {
            c.attachments.remove(&attachment);
        }
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return;
        };
        buffer.attachments -= 1;
        // Its uid's last attachment of a lingering memory: that uid stops paying for it.
        if let Some(group) = self.groups.get_mut(&buffer.group) {
            if let Some(n) = group.holders.get_mut(&uid) {
                *n -= 1;
                if *n == 0 {
                    group.holders.remove(&uid);
                    if group.lingering {
                        self.ledger.credit_uid(uid, group.size, group.count as u64);
                    }
                }
            }
        }
        let buffer = self.buffers.get_mut(&id).expect("looked up above");
        if buffer.attachments == 0 {
            match buffer.state {
                BufferState::Deleting => self.free(id),
                // Only its creator attaches a buffer being created: it let go without publishing.
                BufferState::Creating => self.unname(id),
                BufferState::Published => {}
            }
        }
    }

    /// Removes the buffer `id`; the last member of its group takes the group with it and credits
    /// whoever pays for it (its owner, or the holders of a lingering memory: none but at
    /// [`State::clear`]). Its memory (the group's) is released when [`Service`] drops the last
    /// member holding it after releasing the lock. A reservation whose allocation never came is
    /// not counted as freed.
    fn free(&mut self, id: u64) {
        if let Some(buffer) = self.buffers.remove(&id) {
            if buffer.memory.is_some() {
                self.freed += 1;
            }
            if let Some(group) = self.groups.get_mut(&buffer.group) {
                group.live -= 1;
                if group.live == 0 {
                    let group = self.groups.remove(&buffer.group).expect("looked up above");
                    let (size, count) = (group.size, group.count as u64);
                    if group.lingering {
                        for &uid in group.holders.keys() {
                            self.ledger.credit_uid(uid, size, count);
                        }
                    } else {
                        self.ledger.credit_uid(group.owner_uid, size, count);
                    }
                    self.ledger.credit_total(size, count);
                }
            }
            self.dead.push(buffer);
        }
    }

    /// The last name of group `group` went while attachments still hold its memory: its owner
    /// stops paying for it and each uid holding it starts (see the [module documentation](self)).
    fn linger(&mut self, group: u64) {
        let Some(g) = self.groups.get_mut(&group) else {
            return;
        };
        if g.lingering || g.named > 0 {
            return;
        }
        g.lingering = true;
        let (size, count) = (g.size, g.count as u64);
        self.ledger.credit_uid(g.owner_uid, size, count);
        for &uid in g.holders.keys() {
            self.ledger.charge_uid(uid, size, count);
        }
    }

    /// Takes a buffer's name away (delete, expiry, a dead creator); frees it if unattached.
    fn unname(&mut self, id: u64) {
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return;
        };
        if buffer.state == BufferState::Deleting {
            return;
        }
        self.names.remove(&buffer.name);
        if let Some(deadline) = buffer.expires_at {
            self.deadlines.remove(&(deadline, id));
        }
        if let Some(group) = self.groups.get_mut(&buffer.group) {
            group.named -= 1;
            if buffer.state == BufferState::Creating {
                group.lost = true;
            }
        }
        buffer.state = BufferState::Deleting;
        let group = buffer.group;
        if buffer.attachments == 0 {
            self.free(id);
        }
        self.linger(group);
    }

    /// `delete`: the name disappears now; the memory goes with the last attachment.
    pub(crate) fn delete(&mut self, conn: ConnId, name: &str, now: Instant) -> Result<()> {
        self.expire(now);
        let uid = self.conn(conn)?.uid;
        names::validate_name(name)?;
        let id = self.named(name)?;
        let owner = self.buffers[&id].owner_uid;
        Access::check_delete(self.rules.server_uid, uid, owner, name)?;
        self.unname(id);
        Ok(())
    }

    /// Takes away the names of buffers whose time-to-live ran out by `now` (a deadline is due at
    /// its instant). Costs O(log n) per buffer expired, and one look at the first deadline not
    /// due: the deadlines are kept in order (the `deadlines` index), not found by a scan.
    pub(crate) fn expire(&mut self, now: Instant) {
        while let Some(&(deadline, id)) = self.deadlines.first() {
            self.expiry_visits += 1;
            if deadline > now {
                break;
            }
            // `unname` takes the entry out (every buffer with an entry is named, with this deadline).
            debug_assert!(self
                .buffers
                .get(&id)
                .is_some_and(|b| b.state != BufferState::Deleting && b.expires_at == Some(deadline)));
            self.deadlines.pop_first();
            self.unname(id);
        }
    }

    /// The connection ended: the buffers it was creating lose their names now; its attachments
    /// stay until [`State::process_exited`]. Returns whether it holds attachments (whether the
    /// server must wait for its process).
    pub(crate) fn disconnect(&mut self, conn: ConnId) -> bool {
        let creating: Vec<u64> = self
            .buffers
            .iter()
            .filter(|(_, b)| b.creator == conn && b.state == BufferState::Creating)
            .map(|(id, _)| *id)
            .collect();
        for id in creating {
            self.unname(id);
        }
        match self.conns.get_mut(&conn) {
            Some(c) if !c.attachments.is_empty() => {
                c.open = false;
                true
            }
            Some(_) => {
                self.conns.remove(&conn);
                false
            }
            None => false,
        }
    }

    /// The process of an ended connection exited: its attachments end (its mappings died with it).
    pub(crate) fn process_exited(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get(&conn) {
            if c.open {
                return;
            }
            let held: Vec<u64> = c.attachments.iter().copied().collect();
            for attachment in held {
                self.end_attachment(attachment);
            }
            self.conns.remove(&conn);
        }
    }

    /// One page of `list`: named buffers after `after` in name order, and whether more follow.
    pub(crate) fn list(&mut self, after: &str, now: Instant) -> (Vec<BufferInfo>, bool) {
        self.expire(now);
        let mut entries = Vec::new();
        let mut more = false;
        let range = self
            .names
            .range::<str, _>((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded));
        for (_, id) in range {
            if entries.len() == MAX_LIST_PAGE {
                more = true;
                break;
            }
            let b = &self.buffers[id];
            entries.push(BufferInfo {
                name: b.name.clone(),
                size: b.size,
                device: self.devices[b.device].0,
                tag: b.tag.clone(),
                state: b.state,
                owner_uid: b.owner_uid,
                owner_pid: b.owner_pid,
                attachments: b.attachments,
                expires_in: b.expires_at.map(|t| t.saturating_duration_since(now)),
            });
        }
        (entries, more)
    }

    /// Buffers [`State::expire`] looked at so far.
    #[cfg(test)]
    pub(crate) fn expiry_visits(&self) -> u64 {
        self.expiry_visits
    }

    /// What `uid` is charged now.
    #[cfg(test)]
    pub(crate) fn usage(&self, uid: u32) -> crate::policy::Usage {
        self.ledger.usage(uid)
    }

    /// What everyone is charged together.
    #[cfg(test)]
    pub(crate) fn total_usage(&self) -> crate::policy::Usage {
        self.ledger.total()
    }

    /// The attach list of the named buffer `name` (its group's, besides its owner's uid).
    #[cfg(test)]
    pub(crate) fn attach_uids_of(&self, name: &str) -> Option<Vec<u32>> {
        let id = self.names.get(name)?;
        Some(self.groups[&self.buffers[id].group].attach_uids.clone())
    }

    /// How many deadlines the index holds.
    #[cfg(test)]
    pub(crate) fn deadlines_held(&self) -> usize {
        self.deadlines.len()
    }

    /// The counters.
    pub(crate) fn stats(&self) -> ServerStats {
        ServerStats {
            buffers: self.buffers.len() as u64,
            bytes: self.groups.values().map(|g| g.size).sum(),
            named: self.names.len() as u64,
            attachments: self.attachments.len() as u64,
            connections: self.conns.values().filter(|c| c.open).count() as u64,
            freed: self.freed,
            rejected: self.rejected,
            lingering_buffers: self
                .buffers
                .values()
                .filter(|b| b.state == BufferState::Deleting)
                .count() as u64,
            lingering_bytes: self.groups.values().filter(|g| g.lingering).map(|g| g.size).sum(),
        }
    }

    /// Releases everything (server shutdown): every buffer is freed whatever holds it (clients
    /// keep their own imported handles, so their mappings stay valid).
    pub(crate) fn clear(&mut self) {
        self.names.clear();
        self.deadlines.clear();
        self.attachments.clear();
        self.conns.clear();
        let ids: Vec<u64> = self.buffers.keys().copied().collect();
        for id in ids {
            self.free(id);
        }
    }
}

/// The error of a failed export of buffer `name`'s memory (a copy: the export's own stays with
/// its attachment until [`State::finish_attach`] drops it).
fn export_error(name: &str, err: &Error) -> Error {
    match err {
        Error::ServerGpu { message } => Error::ServerGpu {
            message: format!("exporting buffer {name:?}: {message}"),
        },
        other => Error::ServerGpu {
            message: format!("exporting buffer {name:?}: {other}"),
        },
    }
}

/// The [`State`] behind its lock, with the [`Backend`] beside it, used outside the lock. See the
/// [module documentation](self): `create`, `publish`, `attach` and `attach_many` run their GPU
/// calls with the lock released; everything else runs under it.
pub(crate) struct Store<B: Backend> {
    state: Mutex<State>,
    backend: B,
}

/// Rolls back what a [`Service`] call reserved if it does not reach its last step (a panic in
/// the backend): a reservation of `create`, or the attachments `attach` counted.
struct Undo<'a, B: Backend> {
    store: &'a Store<B>,
    reserved: Option<&'a Reserved>,
    attachments: Vec<u64>,
}

impl<B: Backend> Undo<'_, B> {
    fn disarm(mut self) {
        self.reserved = None;
        self.attachments.clear();
    }
}

impl<B: Backend> Drop for Undo<'_, B> {
    fn drop(&mut self) {
        if self.reserved.is_none() && self.attachments.is_empty() {
            return;
        }
        self.store.with(|s| {
            if let Some(r) = self.reserved {
                s.abort_create(r);
            }
            for &a in &self.attachments {
                s.end_attachment(a);
            }
        });
    }
}

impl<B: Backend> Store<B> {
    pub(crate) fn new(backend: B, rules: Rules) -> Store<B> {
        let devices = backend.devices().to_vec();
        Store {
            state: Mutex::new(State::new(devices, rules)),
            backend,
        }
    }

    #[cfg(test)]
    pub(crate) fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether another thread holds the state's lock now.
    #[cfg(test)]
    pub(crate) fn is_locked(&self) -> bool {
        matches!(self.state.try_lock(), Err(std::sync::TryLockError::WouldBlock))
    }

    /// Runs `f` on the state under the lock (taken over a poisoned lock: every step leaves the
    /// state consistent); the buffers it freed are dropped, their memory released, after the
    /// lock is released.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let out = f(&mut state);
        let dead = std::mem::take(&mut state.dead);
        drop(state);
        drop(dead);
        out
    }

    /// `create`: [`Service::create_many`] of one buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        &self,
        conn: ConnId,
        pid: i32,
        device: DeviceUuid,
        size: u64,
        ttl_ms: u64,
        name: &str,
        tag: &str,
        attach_uids: &[u32],
        now: Instant,
    ) -> Result<Grant> {
        let mut grants = self.create_many(
            conn,
            pid,
            device,
            ttl_ms,
            tag,
            attach_uids,
            &[(name.to_owned(), size)],
            now,
        )?;
        Ok(grants.pop().expect("one grant per member"))
    }

    /// `create_many`: reserves the names and quota ([`State::begin_create_many`]), allocates the
    /// group's memory and takes a descriptor per member with the lock released, and commits
    /// ([`State::finish_create`]) or rolls back.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_many(
        &self,
        conn: ConnId,
        pid: i32,
        device: DeviceUuid,
        ttl_ms: u64,
        tag: &str,
        attach_uids: &[u32],
        members: &[(String, u64)],
        now: Instant,
    ) -> Result<Vec<Grant>> {
        let reserved = self.with(|s| s.begin_create_many(conn, pid, device, ttl_ms, tag, attach_uids, members, now))?;
        let undo = Undo {
            store: self,
            reserved: Some(&reserved),
            attachments: Vec::new(),
        };
        let made = self
            .backend
            .allocate(reserved.index, reserved.size)
            .map(Arc::<dyn Allocation>::from)
            .and_then(|memory| {
                let fds = (0..reserved.members.len())
                    .map(|_| memory.export_fd())
                    .collect::<Result<Vec<OwnedFd>>>()?;
                Ok((memory, fds))
            });
        undo.disarm();
        // On a refusal the memory is dropped, released, here, after the lock.
        match made {
            Ok((memory, fds)) => self.with(|s| s.finish_create(conn, &reserved, &memory, fds)),
            Err(e) => {
                self.with(|s| s.abort_create(&reserved));
                Err(e)
            }
        }
    }

    /// `publish`: checks ([`State::begin_publish`]), relays the creator's event with the lock
    /// released, and commits ([`State::finish_publish`]).
    pub(crate) fn publish(&self, conn: ConnId, name: &str, event: Option<&EventBytes>, now: Instant) -> Result<()> {
        let (id, index) = self.with(|s| s.begin_publish(conn, name, now))?;
        let relayed: Option<Arc<dyn RelayedEvent>> = match event {
            Some(e) => Some(Arc::from(self.backend.relay_event(index, e)?)),
            None => None,
        };
        // On a refusal the relayed event is dropped here, after the lock.
        self.with(|s| s.finish_publish(conn, id, name, relayed.as_ref()))
    }

    /// `attach`: a new attachment of a published buffer ([`State::begin_attach`], the export
    /// with the lock released, [`State::finish_attach`]).
    pub(crate) fn attach(&self, conn: ConnId, name: &str, now: Instant) -> Result<Grant> {
        let pending = self.with(|s| s.begin_attach(conn, name, now))?;
        let mut grants = self.grant(conn, vec![pending])?;
        Ok(grants.pop().expect("one grant per attachment"))
    }

    /// `attach_many`: every name of `names`, all or none ([`State::begin_attach_many`]).
    pub(crate) fn attach_many(&self, conn: ConnId, names: &[String], now: Instant) -> Result<Vec<Grant>> {
        let pending = self.with(|s| s.begin_attach_many(conn, names, now))?;
        self.grant(conn, pending)
    }

    /// Queries the events and exports the memory of counted attachments with the lock released
    /// (a failed query counts as not done: the attacher then waits on the event, which is always
    /// correct, only slower), then grants them or ends them all.
    fn grant(&self, conn: ConnId, pending: Vec<Pending>) -> Result<Vec<Grant>> {
        let undo = Undo {
            store: self,
            reserved: None,
            attachments: pending.iter().map(|p| p.attachment).collect(),
        };
        let exported: Vec<Exported> = pending
            .into_iter()
            .map(|p| {
                let done = p.event.as_ref().is_none_or(|e| e.is_done().unwrap_or(false));
                let fd = p.memory.export_fd();
                Exported { pending: p, done, fd }
            })
            .collect();
        undo.disarm();
        self.with(|s| s.finish_attach(conn, exported))
    }

    /// See [`State::connect`].
    pub(crate) fn connect(&self, conn: ConnId, uid: u32) -> Result<()> {
        self.with(|s| s.connect(conn, uid))
    }

    /// See [`State::count_rejected`].
    pub(crate) fn count_rejected(&self) {
        self.with(State::count_rejected)
    }

    /// See [`State::holds_anything`].
    pub(crate) fn holds_anything(&self, conn: ConnId) -> bool {
        self.with(|s| s.holds_anything(conn))
    }

    /// See [`State::detach`].
    pub(crate) fn detach(&self, conn: ConnId, attachment: u64) -> Result<()> {
        self.with(|s| s.detach(conn, attachment))
    }

    /// See [`State::delete`].
    pub(crate) fn delete(&self, conn: ConnId, name: &str, now: Instant) -> Result<()> {
        self.with(|s| s.delete(conn, name, now))
    }

    /// See [`State::expire`].
    pub(crate) fn expire(&self, now: Instant) {
        self.with(|s| s.expire(now))
    }

    /// See [`State::disconnect`].
    pub(crate) fn disconnect(&self, conn: ConnId) -> bool {
        self.with(|s| s.disconnect(conn))
    }

    /// See [`State::process_exited`].
    pub(crate) fn process_exited(&self, conn: ConnId) {
        self.with(|s| s.process_exited(conn))
    }

    /// See [`State::list`].
    pub(crate) fn list(&self, after: &str, now: Instant) -> (Vec<BufferInfo>, bool) {
        self.with(|s| s.list(after, now))
    }

    /// See [`State::stats`].
    pub(crate) fn stats(&self) -> ServerStats {
        self.with(|s| s.stats())
    }

    /// See [`State::clear`].
    pub(crate) fn clear(&self) {
        self.with(State::clear)
    }

    /// See [`State::devices`].
    pub(crate) fn devices(&self) -> Vec<(DeviceUuid, u64)> {
        self.with(|s| s.devices())
    }
}

#[cfg(test)]
mod tests;
