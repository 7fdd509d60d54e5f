//! The memory service's client: [`Client`] (one connection, shared by clones), [`Created`] (a
//! buffer being written by its creator) and [`Attached`] (a published buffer mapped into this
//! process). Each call is one request and one reply; a refusal is returned as the server made it
//! and leaves the connection usable, anything else closes it.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mempool_core::{BufferView, Context, Device, DeviceAddr, Event, Mapping, StreamRef};

use super::conn::Framed;
use super::error::{Error, Result};
use super::gpu;
use super::names;
use super::proto::codec;
use super::proto::messages::{EventBytes, GrantEntry, Message, MAX_ATTACH_MANY};
use super::types::{BufferInfo, ServerStats};
use crate::cred;
use crate::trace::{self, Point};
use crate::wire::DeviceUuid;

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

/// Options of [`Client::create`].
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    tag: String,
    ttl: Option<Duration>,
}

impl CreateOptions {
    /// No tag, the server's default time-to-live.
    pub fn new() -> CreateOptions {
        CreateOptions::default()
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
    conn: Mutex<Option<Framed>>,
    timeout: Duration,
    server_pid: u32,
    devices: Vec<(DeviceUuid, u64)>,
    /// The server's events opened here, by handle.
    events: gpu::OpenedEvents,
    /// This process's devices met so far, by the server's UUID.
    local: gpu::LocalDevices,
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
    /// own or one of `trust_uids`), says Hello and reads the served devices.
    ///
    /// Errors: [`Error::PeerGone`] if nobody listens there, [`Error::NotPermitted`] if the server
    /// runs as an untrusted uid or refuses this one, [`Error::Busy`] at its connection limit.
    pub fn connect_with(path: impl AsRef<Path>, options: ClientOptions) -> Result<Client> {
        let path = path.as_ref();
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
        let framed = Framed::new(stream, false, options.timeout)?;
        // A server at its connection limit writes `Refused` and closes at once: the Hello may
        // then fail to go out, but the refusal is still there to read and says why.
        let sent = framed.send(&Message::Hello, None);
        let (server_pid, devices) = match (framed.recv(Some(options.timeout), options.timeout), sent) {
            (Ok((Message::Refused(r), _)), _) => return Err(codec::error_of(r)),
            (_, Err(e)) => return Err(e),
            (Ok((Message::Welcome { pid, devices }, _)), Ok(())) => (pid, devices),
            (Ok((other, _)), Ok(())) => {
                return Err(Error::protocol(format!("expected Welcome, got {:?}", other.kind())))
            }
            (Err(e), Ok(())) => return Err(e),
        };
        Ok(Client {
            shared: Arc::new(Shared {
                conn: Mutex::new(Some(framed)),
                timeout: options.timeout,
                server_pid,
                devices,
                events: gpu::OpenedEvents::default(),
                local: gpu::LocalDevices::default(),
            }),
        })
    }

    /// The server's process id (as it announced it).
    pub fn server_pid(&self) -> u32 {
        self.shared.server_pid
    }

    /// The GPUs the server serves (UUID and VMM granularity).
    pub fn devices(&self) -> &[(DeviceUuid, u64)] {
        &self.shared.devices
    }

    fn conn(&self) -> MutexGuard<'_, Option<Framed>> {
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
        trace::mark(Point::MemsvcClientSent, 0);
        let result = framed
            .send(request, None)
            .and_then(|()| framed.recv(Some(self.shared.timeout), self.shared.timeout));
        trace::mark(Point::MemsvcClientReply, 0);
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
            (
                Message::Granted {
                    attachment,
                    size,
                    granularity,
                    device,
                    event,
                },
                mut fds,
            ) => Ok(Granted {
                attachment,
                size,
                granularity,
                device,
                event,
                fd: fds.pop().expect("the connection checked the count"),
            }),
            (other, _) => Err(self.unexpected("Granted", &other)),
        }
    }

    /// Creates a buffer of `size` bytes (rounded up to the GPU's granularity) named `name` on
    /// `device`, held by the server, and maps it here for writing. Publish it with
    /// [`Created::publish`] once written; dropping it unpublished deletes it.
    ///
    /// Errors: [`Error::BadName`], [`Error::NameTaken`], [`Error::QuotaExceeded`],
    /// [`Error::DeviceNotServed`], [`Error::BadSize`], [`Error::ServerGpu`], [`Error::PeerGone`].
    pub fn create(&self, name: &str, size: usize, device: Device, options: &CreateOptions) -> Result<Created> {
        names::validate_name(name)?;
        names::check_tag(&options.tag)?;
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
        })?;
        // From here on the server holds the buffer for us: dropping `created` deletes it.
        let mut created = Created {
            held: Held::new(self.clone(), name, g.attachment, device)?,
        };
        created.held.mapping = Some(self.shared.local.import(g.device, g.fd, g.size, g.granularity)?);
        Ok(created)
    }

    /// Attaches the published buffer `name`: maps the server's memory into this process (no copy)
    /// and makes `stream` (a stream of the buffer's GPU, or the legacy default stream) wait for
    /// the creator's writes (no host wait). When the server reports the creator's GPU work done
    /// (its relayed event has completed), nothing is enqueued and no event is opened. Dropping
    /// the result unmaps it.
    ///
    /// Errors: [`Error::BadName`], [`Error::UnknownName`] (also for a name being deleted),
    /// [`Error::WrongState`] (still being created), [`Error::DeviceNotVisible`],
    /// [`Error::Attach`] (mapping it here, or ordering `stream` after it, failed),
    /// [`Error::PeerGone`].
    pub fn attach(&self, name: &str, stream: StreamRef<'_>) -> Result<Attached> {
        names::validate_name(name)?;
        let g = self.call_granted(&Message::Attach { name: name.to_owned() })?;
        let entry = GrantEntry {
            attachment: g.attachment,
            size: g.size,
            granularity: g.granularity,
            device: g.device,
            event: g.event,
        };
        let mut attached = self.finish_attach(&[name], &[entry], vec![g.fd], stream)?;
        Ok(attached.pop().expect("one grant, one buffer"))
    }

    /// Attaches every buffer of `names` ([`Client::attach`] for each), in few requests: one per
    /// [`MAX_ATTACH_MANY`](Self::MAX_ATTACH_MANY) names, each answered with all its descriptors
    /// in one message. The buffers of one request share one address reservation per GPU (mapped
    /// back to back, access granted in one driver call). Returns one [`Attached`] per name, in
    /// order, each with its own mapping (dropping one unmaps only its own range; the shared
    /// addresses are freed with the last); the same name twice is attached twice.
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
        let imports = grants
            .iter()
            .zip(fds)
            .map(|(g, fd)| gpu::ImportGrant {
                device: g.device,
                fd,
                size: g.size,
                granularity: g.granularity,
            })
            .collect();
        let mappings = self
            .shared
            .local
            .import_many(imports)
            .map_err(|(i, e)| e.about_buffer(&held[i].held.name))?;
        for (a, mapping) in held.iter_mut().zip(mappings) {
            a.held.mapping = Some(mapping);
        }
        trace::mark(Point::MemsvcClientMapped, 0);
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
        trace::mark(Point::MemsvcClientDone, 0);
        Ok(held)
    }

    /// Deletes the buffer `name`: its name goes at once (a later `attach` finds nothing, a
    /// `create` may reuse it); its memory is released when the last attachment lets go. Only its
    /// owner's uid (or the server's) may delete it.
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

    /// The server's counters.
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
            }),
            (other, _) => Err(self.unexpected("StatsReply", &other)),
        }
    }
}

/// A `Granted` reply with its descriptor.
pub(crate) struct Granted {
    pub(crate) attachment: u64,
    pub(crate) size: u64,
    pub(crate) granularity: u64,
    pub(crate) device: DeviceUuid,
    pub(crate) event: Option<EventBytes>,
    pub(crate) fd: OwnedFd,
}

/// What a created or attached buffer holds: the connection, the server's attachment, the mapping.
struct Held {
    client: Client,
    name: String,
    attachment: u64,
    device: Device,
    ctx: Arc<Context>,
    /// `None` until mapped, and once released.
    mapping: Option<Mapping>,
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
            publish_event: None,
            attached: true,
        }
    }

    fn mapping(&self) -> &Mapping {
        self.mapping
            .as_ref()
            .expect("a buffer holds its mapping until released")
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
            crate::error::record_drop_error(crate::error::Error::Io(std::io::Error::other(format!(
                "releasing memory service buffer {:?}: {e}",
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

            /// The first mapped address in this process.
            pub fn ptr(&self) -> DeviceAddr {
                self.held.mapping().addr()
            }

            /// The size in bytes: the whole allocation, a multiple of the granularity.
            pub fn len(&self) -> usize {
                self.held.mapping().len()
            }

            /// Never true: a buffer has at least one granule.
            pub fn is_empty(&self) -> bool {
                false
            }

            /// The GPU the memory is on (this process's numbering).
            pub fn device(&self) -> Device {
                self.held.device
            }

            /// The mapping (physical allocation, reservation, access).
            pub fn mapping(&self) -> &Mapping {
                self.held.mapping()
            }

            /// A view for host copies and fills ordered on `stream` (of the buffer's GPU); it
            /// borrows `self`, so it cannot outlive the mapping.
            pub fn view<'a>(&'a self, stream: StreamRef<'a>) -> Result<BufferView<'a>> {
                Ok(self.held.mapping().view(stream)?)
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
