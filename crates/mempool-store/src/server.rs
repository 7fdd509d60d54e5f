//! The memory store's server: [`ServerConfig`] and [`Server`]. One thread accepts connections
//! (and, every 100 ms, expires buffers whose time-to-live ran out and reclaims what dead clients'
//! exited processes held); each admitted connection is served by a thread of its own, within the
//! [`Limits`]: at most so many connections (in all and per uid), and ended connections still
//! holding attachments per uid (watched through one pidfd per client process), a handshake and
//! every frame within their time limits, idle connections that hold nothing closed, descriptors
//! counted, attachments per connection capped.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::backend::Backend;
use super::connection::Connection;
use super::error::{Error, Result};
use super::gpu::GpuBackend;
use super::policy::{Access, Limits, Quotas};
use super::protocol::codec;
use super::protocol::messages::{GrantEntry, Message, MIN_VERSION};
use super::state::{ConnId, Grant, Rules, Store};
use super::types::ServerStats;
use mempool_ipc::trace::{self, Point};
use mempool_socket::cred::{self, AccessPolicy, PeerCredentials};
use mempool_socket::listener::{Listener, ListenerOptions};

/// How a [`Server`] is set up. Build with [`ServerConfig::new`] and the setters.
///
/// ```
/// use std::time::Duration;
/// use mempool_store::{Quotas, ServerConfig};
/// let config = ServerConfig::new("/tmp/mempool.sock")
///     .devices([0])
///     .quotas(Quotas { per_uid_bytes: Some(64 << 30), ..Quotas::default() })
///     .allow_uids([1001])
///     .default_ttl(Some(Duration::from_secs(3600)));
/// assert_eq!(config.path(), std::path::Path::new("/tmp/mempool.sock"));
/// ```
#[derive(Clone, Debug)]
pub struct ServerConfig {
    path: PathBuf,
    devices: Vec<usize>,
    quotas: Quotas,
    access: Access,
    limits: Limits,
    default_ttl: Option<Duration>,
    socket_mode: u32,
    max_buffer_bytes: u64,
}

impl ServerConfig {
    /// Serves on the Unix socket `path`, on GPU 0, same uid only, no quotas, no time-to-live,
    /// default [`Limits`], socket mode 0600.
    pub fn new(path: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            path: path.into(),
            devices: vec![0],
            quotas: Quotas::default(),
            access: Access::default(),
            limits: Limits::default(),
            default_ttl: None,
            socket_mode: 0o600,
            max_buffer_bytes: 1 << 46,
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GPUs (ordinals as this process sees them) the server allocates on; clients name them
    /// by UUID, so their own numbering may differ.
    pub fn devices(mut self, ordinals: impl IntoIterator<Item = usize>) -> ServerConfig {
        self.devices = ordinals.into_iter().collect();
        self
    }

    /// The quotas.
    pub fn quotas(mut self, quotas: Quotas) -> ServerConfig {
        self.quotas = quotas;
        self
    }

    /// More uids allowed to connect besides the server's own (widen
    /// [`socket_mode`](Self::socket_mode) too).
    pub fn allow_uids(mut self, uids: impl IntoIterator<Item = u32>) -> ServerConfig {
        self.access.allow_uids = uids.into_iter().collect();
        self
    }

    /// The connection limits and time limits.
    pub fn limits(mut self, limits: Limits) -> ServerConfig {
        self.limits = limits;
        self
    }

    /// The time-to-live of buffers created without one (`None`: they live until deleted).
    pub fn default_ttl(mut self, ttl: Option<Duration>) -> ServerConfig {
        self.default_ttl = ttl;
        self
    }

    /// The socket file's permission bits (default `0o600`).
    pub fn socket_mode(mut self, mode: u32) -> ServerConfig {
        self.socket_mode = mode;
        self
    }

    /// The largest buffer in bytes, after rounding (default 64 TiB).
    pub fn max_buffer_bytes(mut self, bytes: u64) -> ServerConfig {
        self.max_buffer_bytes = bytes;
        self
    }
}

type Shared = Arc<Inner>;

struct ConnEntry {
    uid: u32,
    stream: UnixStream,
    thread: Option<JoinHandle<()>>,
}

/// A client process whose ended connections still hold attachments: one pidfd per process,
/// whatever number of its connections ended (each with its uid).
struct Watched {
    pidfd: OwnedFd,
    conns: Vec<(ConnId, u32)>,
}

/// How long the accept thread waits between housekeeping rounds (and after an accept error that
/// leaves the listener readable, such as EMFILE).
const TICK: Duration = Duration::from_millis(100);

struct Inner {
    /// The state behind its lock, and the backend called with the lock released.
    store: Store<Box<dyn Backend>>,
    limits: Limits,
    stop: AtomicBool,
    conns: Mutex<HashMap<ConnId, ConnEntry>>,
    /// Ended connections that hold attachments, by their process's pid (one pidfd each).
    reaper: Mutex<HashMap<i32, Watched>>,
    next_conn: AtomicU64,
    pid: u32,
}

impl Inner {
    fn conns(&self) -> MutexGuard<'_, HashMap<ConnId, ConnEntry>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reaper(&self) -> MutexGuard<'_, HashMap<i32, Watched>> {
        self.reaper.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running memory store. See the [crate documentation](crate) and `docs/memory-store.md`.
///
/// [`Server::serve`] binds the socket and starts the threads; [`Server::shutdown`] (or dropping
/// it) stops them, closes every connection, releases every buffer the server holds and removes
/// the socket file. Clients' mappings stay valid after that (each holds its own imported handle)
/// until they drop them; their next call returns [`Error::PeerGone`].
pub struct Server {
    inner: Shared,
    path: PathBuf,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).finish()
    }
}

impl Server {
    /// Starts serving GPU memory on `config`'s devices at its socket path.
    ///
    /// A stale socket file at the path (one nobody answers on: a crashed server's) is replaced;
    /// a live one is never stolen ([`Error::SocketPath`]), nor any other kind of file.
    pub fn serve(config: ServerConfig) -> Result<Server> {
        let backend = GpuBackend::new(&config.devices)?;
        Server::serve_with(config, Box::new(backend))
    }

    /// [`Server::serve`] over any backend (the tests' host double).
    pub(crate) fn serve_with(config: ServerConfig, backend: Box<dyn Backend>) -> Result<Server> {
        let l = &config.limits;
        if l.max_connections == 0
            || l.max_connections_per_uid == 0
            || l.max_ended_connections_per_uid == 0
            || l.max_attachments_per_connection == 0
        {
            return Err(Error::InvalidArgument(
                "connection, ended-connection and attachment limits must be at least 1".into(),
            ));
        }
        let server_uid = rustix::process::geteuid().as_raw();
        let mut uids = vec![server_uid];
        uids.extend(&config.access.allow_uids);
        let listener = Listener::bind_with(
            &config.path,
            ListenerOptions {
                mode: config.socket_mode,
                policy: AccessPolicy::AllowUids(uids),
                replace_stale: true,
                ..ListenerOptions::default()
            },
        )
        .map_err(|e| match e {
            mempool_socket::Error::SocketPath { path, reason } => Error::SocketPath {
                path: path.display().to_string(),
                reason,
            },
            other => other.into(),
        })?;
        listener.set_nonblocking()?;
        let rules = Rules {
            server_uid,
            access: config.access.clone(),
            quotas: config.quotas,
            default_ttl: config.default_ttl,
            max_buffer_bytes: config.max_buffer_bytes,
            max_attachments_per_connection: config.limits.max_attachments_per_connection,
        };
        let inner = Arc::new(Inner {
            store: Store::new(backend, rules),
            limits: config.limits,
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
            reaper: Mutex::default(),
            next_conn: AtomicU64::new(1),
            pid: std::process::id(),
        });
        let for_thread = inner.clone();
        let accept = std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || accept_loop(&for_thread, listener))?;
        Ok(Server {
            inner,
            path: config.path,
            accept: Some(accept),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The counters now.
    pub fn stats(&self) -> ServerStats {
        self.inner.store.stats()
    }

    /// Stops serving: closes every connection, releases every buffer, removes the socket file.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let threads: Vec<JoinHandle<()>> = {
            let mut conns = self.inner.conns();
            conns
                .values_mut()
                .filter_map(|c| {
                    Connection::shutdown(&c.stream);
                    c.thread.take()
                })
                .collect()
        };
        for t in threads {
            let _ = t.join();
        }
        self.inner.reaper().clear();
        self.inner.store.clear();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(inner: &Shared, listener: Listener) {
    while !inner.stop.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let tick = Timespec {
            tv_sec: 0,
            tv_nsec: TICK.as_nanos() as i64,
        };
        let ready = rustix::event::poll(&mut fds, Some(&tick)).unwrap_or(0);
        housekeeping(inner);
        if ready == 0 {
            continue;
        }
        // Until WouldBlock: none waits.
        loop {
            match listener.accept_stream() {
                Ok(stream) => admit(inner, stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                // EMFILE, ENFILE, ENOBUFS, ...: the connection stays queued and the listener
                // readable, so polling again at once would spin; wait a tick (housekeeping may
                // free descriptors meanwhile) and retry.
                Err(_) => {
                    std::thread::sleep(TICK);
                    break;
                }
            }
        }
    }
    // The listener drops here: the socket file goes.
}

/// Expires buffers; ends the attachments of ended connections whose process exited.
fn housekeeping(inner: &Shared) {
    inner.store.expire(Instant::now());
    let exited: Vec<ConnId> = {
        let mut reaper = inner.reaper();
        let mut exited = Vec::new();
        reaper.retain(|_, watched| {
            let gone = has_exited(&watched.pidfd);
            if gone {
                exited.extend(watched.conns.iter().map(|&(conn, _)| conn));
            }
            !gone
        });
        exited
    };
    if !exited.is_empty() {
        inner.store.with(|state| {
            for conn in exited {
                state.process_exited(conn);
            }
        });
    }
}

/// Whether the process of `pidfd` has exited (a pidfd polls readable then).
fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
    matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

/// Puts the ended connection `conn` (of `uid`, whose process is `pid`, watched by `pidfd`), which
/// still holds attachments, under its process's single watch: a live process already watched
/// under `pid` is this process (a pid is reused only after its process exited), so `pidfd`
/// closes; a watch whose process exited is reclaimed and replaced.
fn watch_ended(inner: &Shared, conn: ConnId, uid: u32, pid: i32, pidfd: Option<OwnedFd>) {
    let pidfd = match pidfd {
        Some(fd) if !has_exited(&fd) => fd,
        // Gone already: nothing it holds can outlive it.
        _ => {
            inner.store.process_exited(conn);
            return;
        }
    };
    let replaced = {
        let mut reaper = inner.reaper();
        match reaper.get_mut(&pid) {
            Some(watched) if !has_exited(&watched.pidfd) => {
                // Closed before the connection shows as watched.
                drop(pidfd);
                watched.conns.push((conn, uid));
                None
            }
            _ => reaper.insert(
                pid,
                Watched {
                    pidfd,
                    conns: vec![(conn, uid)],
                },
            ),
        }
    };
    if let Some(old) = replaced {
        inner.store.with(|state| {
            for (conn, _) in old.conns {
                state.process_exited(conn);
            }
        });
    }
}

/// Refuses a connection with `err` (best effort: a short frame into an empty socket buffer), in a
/// frame of protocol `version` (the connection's, or before its Hello the oldest, which every
/// client reads).
fn refuse(stream: &UnixStream, err: &Error, version: u16) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    if let Ok(frame) = codec::encode_as(&Message::Refused(codec::refusal_of(err)), version) {
        let _ = rustix::net::send(
            stream.as_fd(),
            &frame,
            rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT,
        );
    }
}

fn admit(inner: &Shared, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let refused = |err: Error| {
        refuse(&stream, &err, MIN_VERSION);
        inner.store.count_rejected();
    };
    let creds = match cred::peer_credentials(&stream) {
        Ok(c) => c,
        Err(mempool_socket::Error::ForeignPidNamespace { uid }) => {
            return refused(Error::NotPermitted {
                uid,
                what: "connect from another pid namespace (SO_PEERCRED reports pid 0, so the server could \
                       not tell when the process exits and reclaim what it holds)"
                    .into(),
            })
        }
        Err(e) => return refused(e.into()),
    };
    {
        let conns = inner.conns();
        let limits = inner.limits;
        if conns.len() >= limits.max_connections {
            return refused(Error::Busy {
                reason: format!("it has {} connections, its limit", limits.max_connections),
            });
        }
        let mine = conns.values().filter(|c| c.uid == creds.uid).count();
        if mine >= limits.max_connections_per_uid {
            return refused(Error::Busy {
                reason: format!("uid {} has {mine} connections, the limit per uid", creds.uid),
            });
        }
    }
    {
        let ended: usize = inner
            .reaper()
            .values()
            .map(|w| w.conns.iter().filter(|&&(_, uid)| uid == creds.uid).count())
            .sum();
        let limit = inner.limits.max_ended_connections_per_uid;
        if ended >= limit {
            return refused(Error::Busy {
                reason: format!(
                    "uid {} has {ended} ended connections whose processes still run and hold their \
                     attachments, the limit per uid is {limit} (detach before closing, or end those processes)",
                    creds.uid
                ),
            });
        }
    }
    let conn = inner.next_conn.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = inner.store.connect(conn, creds.uid) {
        return refused(e);
    }
    let pidfd = client_pidfd(&stream, creds.pid);
    let (clone, framed) = match stream
        .try_clone()
        .map_err(Error::from)
        .and_then(|c| Ok((c, Connection::new(stream, true, None, inner.limits.write_timeout)?)))
    {
        Ok(pair) => pair,
        Err(_) => {
            inner.store.disconnect(conn);
            return;
        }
    };
    let mut conns = inner.conns();
    let for_thread = inner.clone();
    let thread = std::thread::Builder::new()
        .name(format!("store-conn-{conn}"))
        .spawn(move || serve_connection(&for_thread, conn, framed, creds, pidfd));
    match thread {
        Ok(thread) => {
            conns.insert(
                conn,
                ConnEntry {
                    uid: creds.uid,
                    stream: clone,
                    thread: Some(thread),
                },
            );
        }
        Err(_) => {
            drop(conns);
            refuse(
                &clone,
                &Error::Busy {
                    reason: "it could not start a thread".into(),
                },
                MIN_VERSION,
            );
            inner.store.disconnect(conn);
        }
    }
}

/// The identity of the client process of `stream`, fixed now (its pid may be reused after it
/// exits): the kernel's pidfd of the process that connected (`SO_PEERPIDFD`), or on a kernel
/// without it (before Linux 6.5) a pidfd of `pid` (`SO_PEERCRED`'s), which names another process
/// if the client exited and its pid was reused since it connected. `None`: already gone, so
/// nothing it holds can outlive it.
fn client_pidfd(stream: &UnixStream, pid: i32) -> Option<OwnedFd> {
    match cred::peer_pidfd(stream.as_fd()) {
        Ok(Some(pidfd)) => Some(pidfd),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
        // No SO_PEERPIDFD here, or it failed otherwise (EMFILE...): the pid, as before it.
        Ok(None) | Err(_) => rustix::process::Pid::from_raw(pid)
            .ok_or(rustix::io::Errno::SRCH)
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()))
            .ok(),
    }
}

fn serve_connection(
    inner: &Shared,
    conn: ConnId,
    mut framed: Connection,
    creds: PeerCredentials,
    pidfd: Option<OwnedFd>,
) {
    let outcome = converse(inner, conn, &mut framed, &creds);
    if let Err(e) = outcome {
        if !matches!(e, Error::PeerGone { .. }) {
            if !inner.stop.load(Ordering::SeqCst) {
                inner.store.count_rejected();
            }
            refuse(framed.stream(), &e, framed.version().unwrap_or(MIN_VERSION));
        }
    }
    let holds = inner.store.disconnect(conn);
    if holds {
        watch_ended(inner, conn, creds.uid, creds.pid, pidfd);
    }
    // Dropping the entry also drops its JoinHandle (detaching this thread) unless `stop` took it.
    inner.conns().remove(&conn);
}

/// Serves one connection: the Hello (whose frame's version the connection speaks from then on:
/// a client of version 2 is served as version 2 served it), then requests until it ends.
fn converse(inner: &Shared, conn: ConnId, framed: &mut Connection, creds: &PeerCredentials) -> Result<()> {
    let limits = inner.limits;
    match framed.recv_versioned(Some(limits.handshake_timeout), limits.frame_timeout) {
        Ok((Message::Hello, _, version)) => framed.set_version(version),
        Ok((other, ..)) => return Err(Error::protocol(format!("expected Hello, got {:?}", other.kind()))),
        Err(Error::Timeout { .. }) => {
            return Err(Error::Timeout {
                during: "waiting for Hello",
            })
        }
        Err(e) => return Err(e),
    }
    let devices = inner.store.devices();
    framed.send(
        &Message::Welcome {
            pid: inner.pid,
            devices,
        },
        None,
    )?;
    loop {
        if inner.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let first = if inner.store.holds_anything(conn) {
            None
        } else {
            Some(limits.idle_timeout)
        };
        let (request, _) = match framed.recv(first, limits.frame_timeout) {
            Ok(r) => r,
            Err(Error::Timeout {
                during: "waiting for a frame",
            }) => {
                return Err(Error::Timeout {
                    during: "an idle connection that holds nothing",
                })
            }
            Err(e) => return Err(e),
        };
        trace::mark(Point::StoreServerRead, 0);
        let now = Instant::now();
        let reply: Result<(Message, Vec<OwnedFd>)> = match request {
            Message::Create {
                device,
                size,
                ttl_ms,
                name,
                tag,
                attach_uids,
            } => inner
                .store
                .create(conn, creds.pid, device, size, ttl_ms, &name, &tag, &attach_uids, now)
                .map(granted),
            Message::CreateMany {
                device,
                ttl_ms,
                tag,
                attach_uids,
                members,
            } => inner
                .store
                .create_many(conn, creds.pid, device, ttl_ms, &tag, &attach_uids, &members, now)
                .map(granted_many),
            Message::Publish { name, event } => inner
                .store
                .publish(conn, &name, event.as_ref(), now)
                .map(|()| (Message::Done, Vec::new())),
            Message::Attach { name } => inner.store.attach(conn, &name, now).map(granted),
            Message::AttachMany { names } => inner.store.attach_many(conn, &names, now).map(granted_many),
            Message::Detach { attachment } => inner
                .store
                .detach(conn, attachment)
                .map(|()| (Message::Done, Vec::new())),
            Message::Delete { name } => inner
                .store
                .delete(conn, &name, now)
                .map(|()| (Message::Done, Vec::new())),
            Message::List { after } => {
                let (entries, more) = inner.store.list(&after, now);
                Ok((Message::ListPage { more, entries }, Vec::new()))
            }
            Message::Stats => {
                let s = inner.store.stats();
                Ok((
                    Message::StatsReply {
                        numbers: [
                            s.buffers,
                            s.bytes,
                            s.named,
                            s.attachments,
                            s.connections,
                            s.freed,
                            s.rejected,
                            s.lingering_buffers,
                            s.lingering_bytes,
                        ],
                    },
                    Vec::new(),
                ))
            }
            other => Err(Error::protocol(format!("{:?} after the handshake", other.kind()))),
        };
        trace::mark(Point::StoreServerReplied, 0);
        match reply {
            Ok((message, fds)) => {
                let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                framed.send_fds(&message, &fds)?
            }
            // A message that breaks the protocol (a detach of an attachment it does not hold)
            // ends the connection; anything else the state machine says is a refusal, a
            // failure of the server's GPU included (`ServerGpu`).
            Err(e @ Error::Protocol { .. }) => return Err(e),
            Err(e) => framed.send(&Message::Refused(codec::refusal_of(&e)), None)?,
        }
        trace::mark(Point::StoreServerSent, 0);
    }
}

/// A grant's wire form and its descriptor.
fn entry(g: Grant) -> (GrantEntry, OwnedFd) {
    (
        GrantEntry {
            attachment: g.attachment,
            size: g.size,
            granularity: g.granularity,
            device: g.device,
            event: g.event,
            memory: g.memory,
            offset: g.offset,
            memory_size: g.memory_size,
        },
        g.fd,
    )
}

fn granted(g: Grant) -> (Message, Vec<OwnedFd>) {
    let (e, fd) = entry(g);
    (Message::Granted(e), vec![fd])
}

fn granted_many(grants: Vec<Grant>) -> (Message, Vec<OwnedFd>) {
    let (entries, fds) = grants.into_iter().map(entry).unzip();
    (Message::GrantedMany { grants: entries }, fds)
}

#[cfg(test)]
mod tests;
