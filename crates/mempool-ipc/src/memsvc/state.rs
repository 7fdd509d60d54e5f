//! The server's state machine, without sockets or threads: names, buffers, attachments per
//! connection, quotas and time-to-live, over a [`Backend`]. The server (`server`) calls it under
//! one lock; the tests (`state/tests.rs`) drive it with the host double and an explicit clock.
//!
//! A buffer's life: `create` allocates it (state Creating) and gives its creator an attachment
//! and a descriptor; `publish` (creator only) relays the creator's event and makes it attachable
//! (Published); `delete`, its time-to-live or its creator's death before publishing take its
//! name away at once (Deleting); its memory is released, and its bytes credited back to its
//! owner's quota, when its last attachment ends. A connection that ends leaves its attachments in
//! place until its process has exited ([`State::process_exited`]): until then the process may
//! still map the memory through its own imported handle, so the quota stays charged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use super::backend::{Allocation, Backend, RelayedEvent};
use super::error::{Error, Result};
use super::names;
use super::policy::{Access, Ledger, Quotas};
use super::proto::messages::{EventBytes, MAX_ATTACH_MANY, MAX_LIST_PAGE};
use super::types::{BufferInfo, BufferState, ServerStats};
use crate::wire::DeviceUuid;

/// A connection's id, chosen by the server.
pub(crate) type ConnId = u64;

/// What `create` and `attach` hand to the client. `event` is the server's event the client's
/// stream must wait on, `None` when there is nothing to wait for (a buffer being created, one
/// published without an event, or one whose relayed event has completed: the ready case).
pub(crate) struct Grant {
    pub(crate) attachment: u64,
    pub(crate) size: u64,
    pub(crate) granularity: u64,
    pub(crate) device: DeviceUuid,
    pub(crate) event: Option<EventBytes>,
    pub(crate) fd: OwnedFd,
}

/// The service's rules, fixed when the server starts.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    pub(crate) server_uid: u32,
    pub(crate) access: Access,
    pub(crate) quotas: Quotas,
    pub(crate) default_ttl: Option<Duration>,
    /// The largest buffer, after rounding.
    pub(crate) max_buffer_bytes: u64,
    /// Attachments one connection may hold at once (its creations' included).
    pub(crate) max_attachments_per_connection: usize,
}

struct Buffer {
    name: String,
    size: u64,
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
    /// Dropped last: the event, then the memory.
    event: Option<Box<dyn RelayedEvent>>,
    memory: Box<dyn Allocation>,
}

struct Conn {
    uid: u32,
    /// False once the connection ended; its attachments wait for `process_exited`.
    open: bool,
    attachments: HashSet<u64>,
}

/// The server's state. See the [module documentation](self).
pub(crate) struct State<B: Backend> {
    backend: B,
    rules: Rules,
    ledger: Ledger,
    names: BTreeMap<String, u64>,
    buffers: HashMap<u64, Buffer>,
    /// Attachment id -> (connection, buffer id).
    attachments: HashMap<u64, (ConnId, u64)>,
    conns: HashMap<ConnId, Conn>,
    next_id: u64,
    freed: u64,
    rejected: u64,
}

impl<B: Backend> State<B> {
    pub(crate) fn new(backend: B, rules: Rules) -> State<B> {
        State {
            backend,
            ledger: Ledger::new(rules.quotas),
            rules,
            names: BTreeMap::new(),
            buffers: HashMap::new(),
            attachments: HashMap::new(),
            conns: HashMap::new(),
            next_id: 1,
            freed: 0,
            rejected: 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn backend(&self) -> &B {
        &self.backend
    }

    /// The served devices (UUID, granularity).
    pub(crate) fn devices(&self) -> Vec<(DeviceUuid, u64)> {
        self.backend.devices().to_vec()
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

    /// `create`: allocates a buffer in state Creating and gives the creator an attachment.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        &mut self,
        conn: ConnId,
        pid: i32,
        device: DeviceUuid,
        size: u64,
        ttl_ms: u64,
        name: &str,
        tag: &str,
        now: Instant,
    ) -> Result<Grant> {
        self.expire(now);
        let uid = self.conn(conn)?.uid;
        self.room_for(conn, 1)?;
        names::validate_name(name)?;
        names::check_tag(tag)?;
        let index = self
            .backend
            .devices()
            .iter()
            .position(|(uuid, _)| *uuid == device)
            .ok_or_else(|| Error::DeviceNotServed {
                device: device.to_string(),
            })?;
        let granularity = self.backend.devices()[index].1;
        if size == 0 {
            return Err(Error::BadSize {
                size,
                reason: "a buffer cannot be empty".into(),
            });
        }
        let rounded = size
            .checked_next_multiple_of(granularity)
            .filter(|&r| r <= self.rules.max_buffer_bytes)
            .ok_or_else(|| Error::BadSize {
                size,
                reason: format!(
                    "rounded up to the granularity of {granularity} bytes it passes the largest buffer, {} bytes",
                    self.rules.max_buffer_bytes
                ),
            })?;
        if self.names.contains_key(name) {
            return Err(Error::NameTaken { name: name.to_owned() });
        }
        self.ledger.check(uid, rounded)?;
        let memory = self.backend.allocate(index, rounded)?;
        let fd = memory.export_fd()?;
        let ttl = if ttl_ms > 0 {
            Some(Duration::from_millis(ttl_ms))
        } else {
            self.rules.default_ttl
        };
        let id = self.fresh_id();
        let attachment = self.fresh_id();
        self.ledger.charge(uid, rounded);
        self.names.insert(name.to_owned(), id);
        self.buffers.insert(
            id,
            Buffer {
                name: name.to_owned(),
                size: rounded,
                device: index,
                tag: tag.to_owned(),
                owner_uid: uid,
                owner_pid: pid,
                creator: conn,
                state: BufferState::Creating,
                expires_at: ttl.and_then(|t| now.checked_add(t)),
                attachments: 1,
                ready: false,
                event: None,
                memory,
            },
        );
        self.attachments.insert(attachment, (conn, id));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.attachments.insert(attachment);
        }
        Ok(Grant {
            attachment,
            size: rounded,
            granularity,
            device,
            event: None,
            fd,
        })
    }

    fn named(&self, name: &str) -> Result<u64> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownName { name: name.to_owned() })
    }

    /// `publish`: the creator's buffer becomes attachable, ordered after the creator's event.
    pub(crate) fn publish(&mut self, conn: ConnId, name: &str, event: Option<&EventBytes>, now: Instant) -> Result<()> {
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
        let relayed = match event {
            Some(e) => Some(self.backend.relay_event(buffer.device, e)?),
            None => None,
        };
        let buffer = self.buffers.get_mut(&id).expect("named buffers exist");
        buffer.event = relayed;
        buffer.state = BufferState::Published;
        Ok(())
    }

    /// `attach`: a new attachment of a published buffer. The grant carries the server's event
    /// while the creator's work may still run, and none once a query of it says it is done.
    pub(crate) fn attach(&mut self, conn: ConnId, name: &str, now: Instant) -> Result<Grant> {
        self.expire(now);
        self.room_for(conn, 1)?;
        self.attach_one(conn, name)
    }

    /// `attach_many`: attaches every name of `names` (at most [`MAX_ATTACH_MANY`]), in order,
    /// all or none: on the first refusal the attachments made so far end and the error (which
    /// names the buffer) is returned.
    pub(crate) fn attach_many(&mut self, conn: ConnId, names: &[String], now: Instant) -> Result<Vec<Grant>> {
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
        let mut grants: Vec<Grant> = Vec::with_capacity(names.len());
        for name in names {
            match self.attach_one(conn, name) {
                Ok(g) => grants.push(g),
                Err(e) => {
                    for g in grants {
                        self.end_attachment(g.attachment);
                    }
                    return Err(e);
                }
            }
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

    fn attach_one(&mut self, conn: ConnId, name: &str) -> Result<Grant> {
        names::validate_name(name)?;
        let id = self.named(name)?;
        let buffer = self.buffers.get_mut(&id).expect("named buffers exist");
        if buffer.state != BufferState::Published {
            return Err(Error::WrongState {
                name: name.to_owned(),
                state: buffer.state,
                op: "attach",
            });
        }
        let Some(count) = buffer.attachments.checked_add(1) else {
            return Err(Error::Busy {
                reason: format!(
                    "buffer {name:?} has {} attachments, the most one buffer can count",
                    u32::MAX
                ),
            });
        };
        // A failed query counts as not done: the attacher then waits on the event, which is
        // always correct, only slower.
        if !buffer.ready {
            buffer.ready = buffer.event.as_ref().is_none_or(|e| e.is_done().unwrap_or(false));
        }
        let fd = buffer.memory.export_fd().map_err(|e| match e {
            Error::ServerGpu { message } => Error::ServerGpu {
                message: format!("exporting buffer {name:?}: {message}"),
            },
            other => Error::ServerGpu {
                message: format!("exporting buffer {name:?}: {other}"),
            },
        })?;
        let (uuid, granularity) = self.backend.devices()[buffer.device];
        let event = if buffer.ready {
            None
        } else {
            buffer.event.as_ref().map(|e| e.handle())
        };
        buffer.attachments = count;
        let attachment = self.fresh_id();
        self.attachments.insert(attachment, (conn, id));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.attachments.insert(attachment);
        }
        Ok(Grant {
            attachment,
            size: self.buffers[&id].size,
            granularity,
            device: uuid,
            event,
            fd,
        })
    }

    /// `detach`: ends one of the connection's attachments. The creator detaching a buffer it has
    /// not published abandons it: its name goes and its memory is freed.
    pub(crate) fn detach(&mut self, conn: ConnId, attachment: u64) -> Result<()> {
        self.conn(conn)?;
        match self.attachments.get(&attachment) {
            Some(&(owner, _)) if owner == conn => {}
            _ => {
                return Err(Error::protocol(format!(
                    "attachment {attachment} is not held by this connection"
                )))
            }
        }
        self.end_attachment(attachment);
        Ok(())
    }

    fn end_attachment(&mut self, attachment: u64) {
        let Some((conn, id)) = self.attachments.remove(&attachment) else {
            return;
        };
        if let Some(c) = self.conns.get_mut(&conn) {
            c.attachments.remove(&attachment);
        }
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return;
        };
        buffer.attachments -= 1;
        if buffer.attachments == 0 {
            match buffer.state {
                BufferState::Deleting => self.free(id),
                // Only its creator attaches a buffer being created: it let go without publishing.
                BufferState::Creating => self.unname(id),
                BufferState::Published => {}
            }
        }
    }

    fn free(&mut self, id: u64) {
        if let Some(buffer) = self.buffers.remove(&id) {
            self.ledger.credit(buffer.owner_uid, buffer.size);
            self.freed += 1;
            drop(buffer); // the event, then the memory
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
        buffer.state = BufferState::Deleting;
        if buffer.attachments == 0 {
            self.free(id);
        }
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

    /// Takes away the names of buffers whose time-to-live ran out by `now`.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .buffers
            .iter()
            .filter(|(_, b)| b.state != BufferState::Deleting && b.expires_at.is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
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
                device: self.backend.devices()[b.device].0,
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

    /// The counters.
    pub(crate) fn stats(&self) -> ServerStats {
        ServerStats {
            buffers: self.buffers.len() as u64,
            bytes: self.buffers.values().map(|b| b.size).sum(),
            named: self.names.len() as u64,
            attachments: self.attachments.len() as u64,
            connections: self.conns.values().filter(|c| c.open).count() as u64,
            freed: self.freed,
            rejected: self.rejected,
        }
    }

    /// Releases everything (server shutdown): every buffer is freed whatever holds it (clients
    /// keep their own imported handles, so their mappings stay valid).
    pub(crate) fn clear(&mut self) {
        self.names.clear();
        self.attachments.clear();
        self.conns.clear();
        let ids: Vec<u64> = self.buffers.keys().copied().collect();
        for id in ids {
            self.free(id);
        }
    }
}

#[cfg(test)]
mod tests;
