//! The memory store's client: [`Client`] (one connection, shared by clones), [`Created`] (a
//! buffer being written by its creator) and [`Attached`] (a published buffer mapped into this
//! process). Each call is one request and one reply; a refusal is returned as the server made it
//! and leaves the connection usable, anything else closes it.
//!
//! A buffer lies in one of the server's memories (physical allocations), alone or with the other
//! members of its group ([`Client::create_many`]). The client maps each memory whole, once, and
//! shares the mapping between the buffers it created or attached in it (an `Arc`; a cache of
//! `Weak`s by memory id finds it for later attaches); each buffer's address and length are its
//! own range of it. The mapping is unmapped when the last of its buffers is dropped; forgetting
//! one (`mem::forget`) leaks that buffer's share, so the memory stays mapped, never unmapped
//! under another.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mempool_core::{BufferView, Context, Device, DeviceAddr, Event, Mapping, StreamRef};

use super::connection::Connection;
use super::error::{Error, Result};
use super::gpu;
use super::names;
use super::protocol::codec;
use super::protocol::messages::{
    EventBytes, GrantEntry, Message, MAX_ATTACH_MANY, MAX_ATTACH_UIDS, MIN_VERSION, VERSION,
};
use super::types::{BufferInfo, ServerStats};
use mempool_ipc::trace::{self, Point};
use mempool_ipc::DeviceUuid;
use mempool_socket::cred;

/// How a [`Client`] connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long a reply may take (allocating a large buffer takes the server a while). Default
    /// 60 s.
    pub timeout: Duration,
    /// Server uids trusted besides this process's own effective uid (the server's uid is read
    /// with `SO_PEERCRED` when connecting). Default: none.
    pub trust_uids: Vec<u32>,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            timeout: Duration::from_secs(60),
            trust_uids: Vec::new(),
        }
    }
}

/// Options of [`Client::create`] and [`Client::create_many`] (a group's members share them).
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    tag: String,
    ttl: Option<Duration>,
    attach_uids: Vec<u32>,
}

impl CreateOptions {
    /// No tag, the server's default time-to-live, attachable by the owner's uid only.
    pub fn new() -> CreateOptions {
        CreateOptions::default()
    }

    /// The uids besides the creator's that may attach the buffer (at most
    /// [`MAX_ATTACH_UIDS`](Self::MAX_ATTACH_UIDS), given twice or not; not `u32::MAX`). By default
    /// only the creator's uid may: another uid the server lets connect gets
    /// [`Error::NotPermitted`] from `attach`. A uid listed here that keeps an attachment after
    /// the owner deleted the buffer is charged its bytes until it detaches (docs/memory-service.md,
    /// "Who pays after a delete"). The members of a group share one list. A server of protocol
    /// version 2 has no attach lists: there a non-empty one refuses the create
    /// ([`Error::InvalidArgument`]).
    pub fn attach_uids(mut self, uids: impl IntoIterator<Item = u32>) -> CreateOptions {
        self.attach_uids = uids.into_iter().collect();
        self
    }

    /// The most uids an attach list names.
    pub const MAX_ATTACH_UIDS: usize = MAX_ATTACH_UIDS;

    /// The attach list as the request carries it: each uid once, in the order given; refused
    /// ([`Error::InvalidArgument`]) if too long, holding `u32::MAX`, or not empty on a connection
    /// of protocol version 2.
    pub(crate) fn attach_list(&self, version: u16) -> Result<Vec<u32>> {
        let mut uids: Vec<u32> = Vec::with_capacity(self.attach_uids.len());
        for &uid in &self.attach_uids {
            if !uids.contains(&uid) {
                uids.push(uid);
            }
        }
        codec::check_attach_uids(&uids).map_err(Error::InvalidArgument)?;
        if version < 3 && !uids.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "an attach list ({uids:?}): the server speaks protocol version {version}, which has no attach \
                 lists (upgrade the server; there every uid it lets connect may attach every buffer)"
            )));
        }
        Ok(uids)
    }

    /// A free-form tag, at most [`MAX_TAG_LEN`](super::names::MAX_TAG_LEN) bytes, shown by `list`.
    pub fn tag(mut self, tag: impl Into<String>) -> CreateOptions {
        self.tag = tag.into();
        self
    }

    /// The buffer's time-to-live, counted from its creation; its name goes when it runs out
    /// (rounded to milliseconds; at least 1 ms).
    pub fn ttl(mut self, ttl: Duration) -> CreateOptions {
        self.ttl = Some(ttl);
        self
    }
}

struct Shared {
    /// `None` once the connection failed.
    conn: Mutex<Option<Connection>>,
    /// The protocol version the connection speaks.
    version: u16,
    timeout: Duration,
    server_pid: u32,
    devices: Vec<(DeviceUuid, u64)>,
    /// The server's events opened here, by handle.
    events: gpu::OpenedEvents,
    /// This process's devices met so far, by the server's UUID.
    local: gpu::LocalDevices,
    /// The server's memories mapped here, by memory id.
    memories: gpu::MappedMemories,
}

/// The most buffers [`Client::list`] takes from a server (about ten thousand pages of the protocol's
/// largest).
pub const MAX_LIST_ENTRIES: usize = 1 << 20;

/// A connection to a memory server. Cheap to clone (clones share the connection and take turns);
/// [`Created`] and [`Attached`] buffers keep it open until they are dropped.
///
/// Calls are synchronous (one request, one reply). After the server dies, every call returns
/// [`Error::PeerGone`]; buffers already attached stay mapped and valid until dropped.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server_pid", &self.shared.server_pid)
            .finish()
    }
}

impl Client {
    /// Connects to the server at `path` with the default [`ClientOptions`].
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Client::connect_with(path, ClientOptions::default())
    }

    /// Connects to the server at `path`: checks the server's uid (`SO_PEERCRED`: this process's
    /// own or one of `trust_uids`), says Hello and reads the served devices. Hello is said in
    /// the newest protocol version; a server of version 2 refuses it, and the client connects
    /// again in version 2 ([`Client::protocol_version`] says which it got).
    ///
    /// Errors: [`Error::PeerGone`] if nobody listens there, [`Error::NotPermitted`] if the server
    /// runs as an untrusted uid or refuses this one, [`Error::Busy`] at its connection limit.
    pub fn connect_with(path: impl AsRef<Path>, options: ClientOptions) -> Result<Client> {
        let path = path.as_ref();
        let (framed, server_pid, devices) = match Client::handshake(path, &options, VERSION)? {
            Handshake::Welcome(framed, pid, devices) => (framed, pid, devices),
            Handshake::Older(why) => match Client::handshake(path, &options, MIN_VERSION)? {
                Handshake::Welcome(framed, pid, devices) => (framed, pid, devices),
                Handshake::Older(again) => {
                    return Err(Error::protocol(format!(
                        "the server refused protocol version {VERSION} ({why}) and version {MIN_VERSION} ({again})"
                    )))
                }
            },
        };
        Ok(Client {
            shared: Arc::new(Shared {
                version: framed.version().unwrap_or(MIN_VERSION),
                conn: Mutex::new(Some(framed)),
                timeout: options.timeout,
                server_pid,
                devices,
                events: gpu::OpenedEvents::default(),
                local: gpu::LocalDevices::default(),
                memories: gpu::MappedMemories::default(),
            }),
        })
    }

    /// One connection and its Hello in protocol `version`.
    fn handshake(path: &Path, options: &ClientOptions, version: u16) -> Result<Handshake> {
        let stream = UnixStream::connect(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => Error::PeerGone {
                during: "connecting (no server listens on the path)",
            },
            _ => Error::Io(e),
        })?;
        let server = cred::peer_credentials(&stream)?;
        let own = rustix::process::geteuid().as_raw();
        if server.uid != own && !options.trust_uids.contains(&server.uid) {
            return Err(Error::NotPermitted {
                uid: server.uid,
                what: format!(
                    "serve this process as its memory server (trusted: uid {own} and {:?})",
                    options.trust_uids
                ),
            });
        }
        let framed = Connection::new(stream, false, Some(version), options.timeout)?;
        // A server at its connection limit writes `Refused` and closes at once: the Hello may
        // then fail to go out, but the refusal is still there to read and says why.
        let sent = framed.send(&Message::Hello, None);
        match (framed.recv_versioned(Some(options.timeout), options.timeout), sent) {
            // An older server cannot read our frames and says so in one of its own.
            (Ok((Message::Refused(r), _, theirs)), _) if theirs < version && codec::is_protocol_refusal(&r) => {
                Ok(Handshake::Older(r.text))
            }
            (Ok((Message::Refused(r), ..)), _) => Err(codec::error_of(r)),
            (_, Err(e)) => Err(e),
            (Ok((Message::Welcome { pid, devices }, ..)), Ok(())) => Ok(Handshake::Welcome(framed, pid, devices)),
            (Ok((other, ..)), Ok(())) => Err(Error::protocol(format!("expected Welcome, got {:?}", other.kind()))),
            (Err(e), Ok(())) => Err(e),
        }
    }

    /// The protocol version the connection speaks: 3, or 2 with a server of version 2 (which has
    /// no attach lists, and whose buffers every uid it lets connect may attach).
    pub fn protocol_version(&self) -> u16 {
        self.shared.version
    }

    /// What [`Client::create`] and [`Client::create_many`] check of `options` before they send
    /// anything: the tag's length ([`Error::BadTag`]) and the attach list
    /// ([`Error::InvalidArgument`]: too long, `u32::MAX`, or not empty with a server of
    /// protocol version 2).
    pub fn check_create_options(&self, options: &CreateOptions) -> Result<()> {
        names::check_tag(&options.tag)?;
        options.attach_list(self.shared.version).map(drop)
    }

    /// The server's process id (as it announced it).
    pub fn server_pid(&self) -> u32 {
        self.shared.server_pid
    }

    /// The GPUs the server serves (UUID and VMM granularity).
    pub fn devices(&self) -> &[(DeviceUuid, u64)] {
        &self.shared.devices
    }

    fn conn(&self) -> MutexGuard<'_, Option<Connection>> {
        self.shared.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One request and its reply. A refusal is returned as its error; any other failure closes
    /// the connection.
    pub(crate) fn call(&self, request: &Message) -> Result<(Message, Vec<OwnedFd>)> {
        let mut guard = self.conn();
        let Some(framed) = guard.as_ref() else {
            return Err(Error::PeerGone {
                during: "a call on a connection an earlier failure closed",
            });
        };
        trace::mark(Point::StoreClientSent, 0);
        let result = framed
            .send(request, None)
            .and_then(|()| framed.recv(Some(self.shared.timeout), self.shared.timeout));
        trace::mark(Point::StoreClientReply, 0);
        match result {
            Ok((Message::Refused(r), _)) => Err(codec::error_of(r)),
            Ok(reply) => Ok(reply),
            Err(e) => {
                *guard = None;
                Err(e)
            }
        }
    }

    /// A call that expects `Done`.
    fn call_done(&self, request: &Message) -> Result<()> {
        match self.call(request)? {
            (Message::Done, _) => Ok(()),
            (other, _) => Err(self.unexpected("Done", &other)),
        }
    }

    fn unexpected(&self, expected: &str, got: &Message) -> Error {
        *self.conn() = None;
        Error::protocol(format!("expected {expected}, got {:?}", got.kind()))
    }

    /// A call that expects `Granted` and its descriptor.
    pub(crate) fn call_granted(&self, request: &Message) -> Result<Granted> {
        match self.call(request)? {
            (Message::Granted(entry), mut fds) => Ok(Granted {
                entry,
                fd: fds.pop().expect("the connection checked the count"),
            }),
            (other, _) => Err(self.unexpected("Granted", &other)),
        }
    }

    /// Creates a buffer of `size` bytes (rounded up to the GPU's granularity) named `name` on
    /// `device`, held by the server, and maps it here for writing. Publish it with
    /// [`Created::publish`] once written; dropping it unpublished deletes it. Only this uid, and
    /// those of `options`' attach list ([`CreateOptions::attach_uids`]), may attach it.
    ///
    /// Errors: [`Error::BadName`], [`Error::BadTag`], [`Error::InvalidArgument`] (the attach
    /// list), [`Error::NameTaken`], [`Error::QuotaExceeded`], [`Error::DeviceNotServed`],
    /// [`Error::BadSize`], [`Error::ServerGpu`], [`Error::PeerGone`].
    pub fn create(&self, name: &str, size: usize, device: Device, options: &CreateOptions) -> Result<Created> {
        names::validate_name(name)?;
        self.check_create_options(options)?;
        let attach_uids = options.attach_list(self.shared.version)?;
        let uuid = DeviceUuid(device.uuid()?.0);
        let ttl_ms = options
            .ttl
            .map_or(0, |t| t.as_millis().clamp(1, u128::from(u64::MAX)) as u64);
        let g = self.call_granted(&Message::Create {
            device: uuid,
            size: size as u64,
            ttl_ms,
            name: name.to_owned(),
            tag: options.tag.clone(),
            attach_uids,
        })?;
        // From here on the server holds the buffer for us: dropping `created` deletes it.
        let mut created = Created {
            held: Held::new(self.clone(), name, g.entry.attachment, device)?,
        };
        let mapped = self
            .shared
            .local
            .import_grants(&self.shared.memories, &[g.entry], vec![g.fd])
            .map_err(|(_, e)| e)?;
        created.held.map(&mapped[0], &g.entry);
        Ok(created)
    }

    /// Creates the buffers `members` (name and size each, sizes rounded up to the GPU's
    /// granularity) as one group: one physical allocation on the server, the members laid out
    /// back to back in it, each an ordinary named buffer for [`Created::publish`],
    /// [`Client::attach`], [`Client::delete`] and [`Client::list`], with these rules:
    ///
    /// - A member is attachable only once every member of its group is published (until then
    ///   `attach` refuses with [`Error::WrongState`], naming the group's state).
    /// - The group's memory is released only when every member is freed (deleted or expired,
    ///   and no attachment left); a deleted member's bytes are never given to another buffer.
    ///   The quota charged is the group's total, credited back with the memory.
    /// - A process that may attach one member maps the whole group's memory (the driver maps
    ///   whole allocations only): the members of a group share one access boundary.
    ///
    /// Attaching many members of one group costs one import and one mapping of the group's
    /// memory, instead of one per buffer. At most [`MAX_ATTACH_MANY`](Self::MAX_ATTACH_MANY)
    /// members, with distinct names; all or nothing: a bad or taken name, a bad size or a quota
    /// refuses the whole group. Returns one [`Created`] per member, in order.
    ///
    /// Errors: those of [`Client::create`]; [`Error::InvalidArgument`] for no members or more
    /// than `MAX_ATTACH_MANY`.
    pub fn create_many<S: AsRef<str>>(
        &self,
        members: &[(S, usize)],
        device: Device,
        options: &CreateOptions,
    ) -> Result<Vec<Created>> {
        if members.is_empty() || members.len() > MAX_ATTACH_MANY {
            return Err(Error::InvalidArgument(format!(
                "create_many of {} buffers (1 to {MAX_ATTACH_MANY})",
                members.len()
            )));
        }
        for (name, _) in members {
            names::validate_name(name.as_ref())?;
        }
        self.check_create_options(options)?;
        let attach_uids = options.attach_list(self.shared.version)?;
        let uuid = DeviceUuid(device.uuid()?.0);
        let ttl_ms = options
            .ttl
            .map_or(0, |t| t.as_millis().clamp(1, u128::from(u64::MAX)) as u64);
        let request = Message::CreateMany {
            device: uuid,
            ttl_ms,
            tag: options.tag.clone(),
            attach_uids,
            members: members
                .iter()
                .map(|(name, size)| (name.as_ref().to_owned(), *size as u64))
                .collect(),
        };
        let (grants, fds) = match self.call(&request)? {
            (Message::GrantedMany { grants }, fds) if grants.len() == members.len() => (grants, fds),
            (other, _) => return Err(self.unexpected("GrantedMany with one grant per member", &other)),
        };
        // From here on the server holds the buffers for us: dropping one deletes it.
        let mut created: Vec<Created> = Vec::with_capacity(grants.len());
        for (i, (g, (name, _))) in grants.iter().zip(members).enumerate() {
            match Held::adopt(self.clone(), name.as_ref(), g.attachment, device) {
                Ok(held) => created.push(Created { held }),
                Err(e) => {
                    // `created` drops and deletes the earlier ones; these are not held yet.
                    self.detach_all(grants[i..].iter().map(|g| g.attachment));
                    return Err(e);
                }
            }
        }
        let mapped = self
            .shared
            .local
            .import_grants(&self.shared.memories, &grants, fds)
            .map_err(|(i, e)| e.about_buffer(&created[i].held.name))?;
        for ((c, m), g) in created.iter_mut().zip(&mapped).zip(&grants) {
            c.held.map(m, g);
        }
        Ok(created)
    }

    /// Attaches the published buffer `name`: maps the server's memory into this process (no copy)
    /// and makes `stream` (a stream of the buffer's GPU, or the legacy default stream) wait for
    /// the creator's writes (no host wait). When the server reports the creator's GPU work done
    /// (its relayed event has completed), nothing is enqueued and no event is opened. Dropping
    /// the result unmaps it.
    ///
    /// Errors: [`Error::BadName`], [`Error::UnknownName`] (also for a name being deleted),
    /// [`Error::NotPermitted`] (this uid is neither the buffer's owner's nor in its attach list),
    /// [`Error::WrongState`] (still being created), [`Error::DeviceNotVisible`],
    /// [`Error::Attach`] (mapping it here, or ordering `stream` after it, failed),
    /// [`Error::PeerGone`].
    pub fn attach(&self, name: &str, stream: StreamRef<'_>) -> Result<Attached> {
        names::validate_name(name)?;
        let g = self.call_granted(&Message::Attach { name: name.to_owned() })?;
        let mut attached = self.finish_attach(&[name], &[g.entry], vec![g.fd], stream)?;
        Ok(attached.pop().expect("one grant, one buffer"))
    }

    /// Attaches every buffer of `names` ([`Client::attach`] for each), in few requests: one per
    /// [`MAX_ATTACH_MANY`](Self::MAX_ATTACH_MANY) names, each answered with all its descriptors
    /// in one message. Each memory is imported and mapped once, however many of its buffers
    /// (members of one group, [`Client::create_many`]) are named, and not at all if this client
    /// has it mapped already; the memories of one request share one address reservation per GPU
    /// (mapped back to back, access granted in one driver call). Returns one [`Attached`] per
    /// name, in order, each with its own range (dropping one unmaps its memory only if no other
    /// buffer of this client still uses it; the shared addresses are freed with the last); the
    /// same name twice is attached twice.
    ///
    /// All or nothing: on any error (a bad name, an unknown or unpublished buffer, a failed
    /// import) nothing stays attached and the error names the buffer it is about.
    ///
    /// Errors: those of [`Client::attach`].
    pub fn attach_many<S: AsRef<str>>(&self, names: &[S], stream: StreamRef<'_>) -> Result<Vec<Attached>> {
        for name in names {
            names::validate_name(name.as_ref())?;
        }
        let mut all = Vec::with_capacity(names.len());
        // On an error `all` drops: every attachment of the earlier requests ends.
        for chunk in names.chunks(Client::MAX_ATTACH_MANY) {
            let chunk: Vec<&str> = chunk.iter().map(AsRef::as_ref).collect();
            let request = Message::AttachMany {
                names: chunk.iter().map(|n| (*n).to_owned()).collect(),
            };
            let (grants, fds) = match self.call(&request)? {
                (Message::GrantedMany { grants }, fds) if grants.len() == chunk.len() => (grants, fds),
                (other, _) => return Err(self.unexpected("GrantedMany with one grant per name", &other)),
            };
            all.extend(self.finish_attach(&chunk, &grants, fds, stream)?);
        }
        Ok(all)
    }

    /// The most names one attach request carries.
    pub const MAX_ATTACH_MANY: usize = MAX_ATTACH_MANY;

    /// Tells the server to end `attachments` (best effort: on a failure the connection is closed,
    /// and the server ends them when this process exits).
    fn detach_all(&self, attachments: impl IntoIterator<Item = u64>) {
        for attachment in attachments {
            if self.call_done(&Message::Detach { attachment }).is_err() {
                return;
            }
        }
    }

    /// The client's part of an attach, for grants the server made (one per name, a descriptor
    /// each): owns every attachment at once (so that any error ends them all), checks devices and
    /// the stream, imports and maps each buffer, then makes `stream` wait on each distinct event
    /// of the grants that carry one (buffers whose creator's work may still run).
    fn finish_attach(
        &self,
        names: &[&str],
        grants: &[GrantEntry],
        fds: Vec<OwnedFd>,
        stream: StreamRef<'_>,
    ) -> Result<Vec<Attached>> {
        debug_assert_eq!(grants.len(), fds.len());
        // Each as an `Attached` from the start: dropping one (on any error below) detaches it.
        let mut held: Vec<Attached> = Vec::with_capacity(grants.len());
        for (i, (g, name)) in grants.iter().zip(names).enumerate() {
            let made = self
                .shared
                .local
                .device(g.device)
                .and_then(|device| Held::adopt(self.clone(), name, g.attachment, device));
            match made {
                Ok(h) => held.push(Attached { held: h }),
                Err(e) => {
                    // `held` drops and detaches the earlier ones; these are not held yet.
                    self.detach_all(grants[i..].iter().map(|g| g.attachment));
                    return Err(e);
                }
            }
        }
        if let Some(ctx) = stream.context() {
            if let Some(h) = held.iter().map(|a| &a.held).find(|h| h.device != ctx.device()) {
                return Err(Error::InvalidArgument(format!(
                    "buffer {:?} lives on GPU {}, the stream is of GPU {}",
                    h.name,
                    h.device.ordinal(),
                    ctx.device().ordinal()
                )));
            }
        }
        let mapped = self
            .shared
            .local
            .import_grants(&self.shared.memories, grants, fds)
            .map_err(|(i, e)| e.about_buffer(&held[i].held.name))?;
        for ((a, m), g) in held.iter_mut().zip(&mapped).zip(grants) {
            a.held.map(m, g);
        }
        trace::mark(Point::StoreClientMapped, 0);
        let mut waited: Vec<EventBytes> = Vec::new();
        for (h, g) in held.iter().map(|a| &a.held).zip(grants) {
            if let Some(handle) = g.event {
                if !waited.contains(&handle) {
                    gpu::wait_event(&self.shared.events, &h.ctx, &handle, stream)
                        .map_err(|e| e.about_buffer(&h.name))?;
                    waited.push(handle);
                }
            }
        }
        trace::mark(Point::StoreClientDone, 0);
        Ok(held)
    }

    /// Deletes the buffer `name`: its name goes at once (a later `attach` finds nothing, a
    /// `create` may reuse it); its memory is released when the last attachment lets go. Only its
    /// owner's uid (or the server's) may delete it. From then on the bytes are charged to the
    /// uids still attached, not to the owner (docs/memory-service.md, "Who pays after a delete").
    ///
    /// Errors: [`Error::BadName`], [`Error::UnknownName`], [`Error::NotPermitted`],
    /// [`Error::PeerGone`].
    pub fn delete(&self, name: &str) -> Result<()> {
        names::validate_name(name)?;
        self.call_done(&Message::Delete { name: name.to_owned() })
    }

    /// Every named buffer (being created or published), in name order.
    ///
    /// At most [`MAX_LIST_ENTRIES`]: a server that keeps saying more follow past that is taken
    /// for broken or hostile ([`Error::Protocol`]), so the pages cannot grow without bound.
    pub fn list(&self) -> Result<Vec<BufferInfo>> {
        self.list_at_most(MAX_LIST_ENTRIES)
    }

    /// [`Client::list`] with a bound of `limit` entries.
    fn list_at_most(&self, limit: usize) -> Result<Vec<BufferInfo>> {
        let mut all: Vec<BufferInfo> = Vec::new();
        let mut after = String::new();
        loop {
            match self.call(&Message::List { after: after.clone() })? {
                (Message::ListPage { more, entries }, _) => {
                    if all.len().saturating_add(entries.len()) > limit {
                        // Nothing is wrong with this connection itself: the call's reply was
                        // read whole, so later calls stay in step.
                        return Err(Error::protocol(format!(
                            "the server listed more than {limit} buffers (the most a list takes): \
                             a broken or hostile server"
                        )));
                    }
                    if let Some(last) = entries.last() {
                        if last.name <= after && !after.is_empty() {
                            return Err(self.unexpected("names in order", &Message::ListPage { more, entries }));
                        }
                        after = last.name.clone();
                    }
                    let done = !more || entries.is_empty();
                    all.extend(entries);
                    if done {
                        return Ok(all);
                    }
                }
                (other, _) => return Err(self.unexpected("ListPage", &other)),
            }
        }
    }

    /// The server's counters (a server of protocol version 2 reports no lingering buffers or
    /// bytes: 0).
    pub fn stats(&self) -> Result<ServerStats> {
        match self.call(&Message::Stats)? {
            (Message::StatsReply { numbers: n }, _) => Ok(ServerStats {
                buffers: n[0],
                bytes: n[1],
                named: n[2],
                attachments: n[3],
                connections: n[4],
                freed: n[5],
                rejected: n[6],
                lingering_buffers: n[7],
                lingering_bytes: n[8],
            }),
            (other, _) => Err(self.unexpected("StatsReply", &other)),
        }
    }
}

/// How a Hello went: welcomed (the connection, the server's pid and devices), or refused by a
/// server of an older protocol version (its reason).
enum Handshake {
    Welcome(Connection, u32, Vec<(DeviceUuid, u64)>),
    Older(String),
}

/// A `Granted` reply with its descriptor (its grant's fields read through it).
pub(crate) struct Granted {
    pub(crate) entry: GrantEntry,
    pub(crate) fd: OwnedFd,
}

impl std::ops::Deref for Granted {
    type Target = GrantEntry;
    fn deref(&self) -> &GrantEntry {
        &self.entry
    }
}

/// What a created or attached buffer holds: the connection, the server's attachment, the mapping.
struct Held {
    client: Client,
    name: String,
    attachment: u64,
    device: Device,
    ctx: Arc<Context>,
    /// The whole memory's mapping, shared with the other buffers of this client in it; `None`
    /// until mapped, and once released.
    mapping: Option<Arc<gpu::MemoryMap>>,
    /// The buffer's range in it.
    offset: usize,
    len: usize,
    /// The creator's publish event, kept until the mapping goes.
    publish_event: Option<Event>,
    /// Whether the server still counts the attachment.
    attached: bool,
}

impl Held {
    /// Holds the server's `attachment` (detaching it if this fails).
    fn new(client: Client, name: &str, attachment: u64, device: Device) -> Result<Held> {
        match device.context() {
            Ok(ctx) => Ok(Held::with_context(client, name, attachment, device, ctx)),
            Err(e) => {
                let _ = client.call_done(&Message::Detach { attachment });
                Err(e.into())
            }
        }
    }

    /// [`Held::new`] that leaves the attachment to the caller if it fails.
    fn adopt(client: Client, name: &str, attachment: u64, device: Device) -> Result<Held> {
        let ctx = device.context()?;
        Ok(Held::with_context(client, name, attachment, device, ctx))
    }

    fn with_context(client: Client, name: &str, attachment: u64, device: Device, ctx: Arc<Context>) -> Held {
        Held {
            client,
            name: name.to_owned(),
            attachment,
            device,
            ctx,
            mapping: None,
            offset: 0,
            len: 0,
            publish_event: None,
            attached: true,
        }
    }

    /// Takes its share of `mapped`, the mapping of the memory `grant` names, at the grant's
    /// range (the decoder checked that it lies inside the memory, whose size the import
    /// checked is the mapping's).
    fn map(&mut self, mapped: &Arc<gpu::MemoryMap>, grant: &GrantEntry) {
        debug_assert_eq!(mapped.mapping().len() as u64, grant.memory_size);
        self.offset = grant.offset as usize;
        self.len = grant.size as usize;
        self.mapping = Some(mapped.clone());
    }

    fn mapping(&self) -> &Mapping {
        self.mapping
            .as_ref()
            .expect("a buffer holds its mapping until released")
            .mapping()
    }

    /// A view of the buffer's own range, for host copies and fills ordered on `stream`.
    fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
        // The whole memory's view checks the access a view needs and finds its context.
        let whole = self.mapping().view(stream)?;
        let ctx = whole.context().clone();
        // SAFETY: 1. `offset..offset + len` lies inside the mapping (the decoder checked the
        // grant's range against the memory's size, which is the mapping's length), which stays
        // mapped while `self.mapping` holds its share, and `self` is borrowed for the view's
        // life; dropping a view frees nothing. 2. a mapping carries no stream order (the map and
        // access grant are synchronous). 3. as `Mapping::view`: `stream` is the caller's stream
        // of the device, or a special handle, live for `'a`. 4. the address is not null.
        #[allow(unsafe_code)]
        Ok(unsafe { BufferView::new(whole.ptr().offset(self.offset), self.len, stream, ctx) })
    }

    /// Unmaps (after the device's work), then detaches (which abandons a buffer not yet
    /// published: the server deletes it, by its attachment, never by a name someone may reuse).
    fn release(&mut self) -> Result<()> {
        let mut first: Option<Error> = None;
        if let Some(mapping) = self.mapping.take() {
            // Unmapping is not stream-ordered: wait for the work that may use the memory.
            if let Err(e) = self.ctx.synchronize() {
                first.get_or_insert(e.into());
            }
            drop(mapping);
        }
        self.publish_event = None;
        if self.attached {
            self.attached = false;
            if let Err(e) = self.client.call_done(&Message::Detach {
                attachment: self.attachment,
            }) {
                first.get_or_insert(e);
            }
        }
        match first {
            // The server is gone: it freed its side; ours is unmapped.
            None | Some(Error::PeerGone { .. }) => Ok(()),
            Some(e) => Err(e),
        }
    }

    fn drop_release(&mut self) {
        if let Err(e) = self.release() {
            crate::error::record_drop_error(Error::Io(std::io::Error::other(format!(
                "releasing memory store buffer {:?}: {e}",
                self.name
            ))));
        }
    }
}

/// A buffer this process created and is writing, not yet attachable by others
/// ([`Client::create`]). Write it through [`Created::view`] or its address, then
/// [`Created::publish`] it; dropping it unpublished unmaps it and deletes it (so does this
/// process's death: the server frees it once the process has exited).
pub struct Created {
    held: Held,
}

/// A published buffer mapped into this process ([`Client::attach`], [`Created::publish`]).
///
/// The bytes are the server's memory: every attacher sees the same. Dropping it waits for the
/// device (unmapping is not stream-ordered), unmaps, releases this process's handle and tells
/// the server; after the server died only the local part happens, and the mapping stays valid
/// until then.
pub struct Attached {
    held: Held,
}

macro_rules! buffer_accessors {
    ($t:ty) => {
        impl $t {
            /// The buffer's name.
            pub fn name(&self) -> &str {
                &self.held.name
            }

            /// The buffer's first address in this process.
            pub fn ptr(&self) -> DeviceAddr {
                self.held.mapping().addr().offset(self.held.offset)
            }

            /// The buffer's size in bytes, a multiple of the granularity.
            pub fn len(&self) -> usize {
                self.held.len
            }

            /// The buffer's offset in [`mapping`](Self::mapping): 0 for a buffer alone in its
            /// memory, its place in its group's memory for a member of a group.
            pub fn offset(&self) -> usize {
                self.held.offset
            }

            /// Never true: a buffer has at least one granule.
            pub fn is_empty(&self) -> bool {
                false
            }

            /// The GPU the memory is on (this process's numbering).
            pub fn device(&self) -> Device {
                self.held.device
            }

            /// The mapping of the whole memory the buffer lies in (physical allocation,
            /// reservation, access): the buffer's alone, or its group's, shared with the other
            /// members this client holds; the buffer is [`offset`](Self::offset) bytes into it.
            pub fn mapping(&self) -> &Mapping {
                self.held.mapping()
            }

            /// A view of the buffer's own bytes for host copies and fills ordered on `stream` (of
            /// the buffer's GPU); it borrows `self`, so it cannot outlive the mapping.
            pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
                self.held.view(stream)
            }

            /// The server's id of this process's attachment.
            pub fn attachment(&self) -> u64 {
                self.held.attachment
            }
        }

        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($t))
                    .field("name", &self.held.name)
                    .field("attachment", &self.held.attachment)
                    .field("mapped", &self.held.mapping.is_some())
                    .finish()
            }
        }
    };
}

buffer_accessors!(Created);
buffer_accessors!(Attached);

impl Created {
    /// Publishes the buffer: records an interprocess event on `stream` (after the writes queued
    /// on it) and hands it to the server, which orders every later attacher after it; the buffer
    /// becomes attachable by name and stays so until deleted or expired, whether this process
    /// lives or not. Returns this process's mapping as an [`Attached`].
    ///
    /// On error the buffer stays unpublished and is deleted when `self` drops (it is returned
    /// in no case: the error says why).
    pub fn publish(self, stream: StreamRef<'_>) -> Result<Attached> {
        self.try_publish(stream).map_err(|(e, _unpublished)| e)
    }

    /// [`Created::publish`], handing the buffer back on error, still mapped and unpublished, with
    /// the error (for callers whose views of the memory may outlive the call, such as the Python
    /// binding's DLPack tensors: the mapping must stay until they are gone).
    #[allow(clippy::result_large_err)]
    pub fn try_publish(mut self, stream: StreamRef<'_>) -> std::result::Result<Attached, (Error, Created)> {
        let (event, handle) = match gpu::record_event(&self.held.ctx, stream) {
            Ok(recorded) => recorded,
            Err(e) => return Err((e, self)),
        };
        if let Err(e) = self.held.client.call_done(&Message::Publish {
            name: self.held.name.clone(),
            event: Some(handle),
        }) {
            return Err((e, self));
        }
        self.held.publish_event = Some(event);
        // `self` is dropped after this with a husk that holds nothing (not attached, not mapped).
        let husk = Held {
            client: self.held.client.clone(),
            name: self.held.name.clone(),
            attachment: self.held.attachment,
            device: self.held.device,
            ctx: self.held.ctx.clone(),
            mapping: None,
            offset: 0,
            len: 0,
            publish_event: None,
            attached: false,
        };
        let held = std::mem::replace(&mut self.held, husk);
        Ok(Attached { held })
    }

    /// Unmaps and deletes the unpublished buffer (what dropping does), reporting errors.
    pub fn discard(mut self) -> Result<()> {
        self.held.release()
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        self.held.drop_release();
    }
}

impl Attached {
    /// Unmaps and detaches (what dropping does), reporting errors instead of recording them.
    pub fn release(mut self) -> Result<()> {
        self.held.release()
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.held.drop_release();
    }
}

// The Python binding shares these across threads.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Client>();
    send_sync::<Created>();
    send_sync::<Attached>();
};

#[cfg(test)]
mod tests;
