//! A running server over the host double: the protocol end to end with real descriptors, the
//! refusals, stale and live socket files, and clients that misbehave (garbage, oversized frames,
//! slowloris, descriptors where none belong, many idle connections, connection limits, one at a
//! time and all at once: the GPU test's attack, `tests/store_attack/`) while a well-behaved client
//! is served; afterwards the server holds no connection socket beyond its
//! listener. A dead client's holdings are reclaimed once its process (a child of this test
//! binary, killed with SIGKILL) has exited.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;

use super::*;
use crate::backend::HostBackend;
use crate::client::{Client, ClientOptions};
use crate::policy::Quotas;
use crate::protocol::messages::{HEADER_LEN, MAX_BODY_LEN};
use crate::test_util::unique_name;
use crate::types::BufferState;
use mempool_ipc::DeviceUuid;

const G: u64 = 4096;
const DEV: DeviceUuid = DeviceUuid([1; 16]);
const WAIT: Duration = Duration::from_secs(20);
const CHILD_ROLE: &str = "MEMPOOL_MEMSVC_HOST_CHILD";

fn path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{}.sock", unique_name(tag)))
}

fn quick_limits() -> Limits {
    Limits {
        max_connections: 64,
        max_connections_per_uid: 64,
        max_ended_connections_per_uid: 64,
        max_attachments_per_connection: 4096,
        handshake_timeout: Duration::from_millis(300),
        frame_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_secs(30),
        write_timeout: Duration::from_millis(500),
    }
}

fn serve(path: &Path, limits: Limits) -> (Server, Arc<AtomicU64>) {
    let backend = HostBackend::new(1, G);
    let live = backend.live.clone();
    let config = ServerConfig::new(path).limits(limits);
    (Server::serve_with(config, Box::new(backend)).unwrap(), live)
}

fn create(client: &Client, name: &str, size: u64) -> crate::error::Result<crate::client::Granted> {
    client.call_granted(&Message::Create {
        device: DEV,
        size,
        ttl_ms: 0,
        name: name.into(),
        tag: "t".into(),
        attach_uids: Vec::new(),
    })
}

fn done(client: &Client, m: Message) -> crate::error::Result<()> {
    match client.call(&m)? {
        (Message::Done, _) => Ok(()),
        (other, _) => panic!("expected Done, got {other:?}"),
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How many descriptors of this process are sockets of the server at `path` (the listener and
/// the server's side of accepted connections: `/proc/net/unix` names the address the listener
/// was bound to for both, the listener's private directory next to `path`, see `listener`).
fn server_sockets(path: &Path) -> usize {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let prefix = path
        .parent()
        .unwrap()
        .join(format!(".{}.", path.file_name().unwrap().to_str().unwrap()));
    let prefix = prefix.to_str().unwrap().to_owned();
    let inodes: std::collections::HashSet<String> = table
        .lines()
        .skip(1)
        .filter(|l| {
            l.split_whitespace()
                .nth(7)
                .is_some_and(|p| p.starts_with(&prefix) && p.ends_with(".tmp/s"))
        })
        .filter_map(|l| l.split_whitespace().nth(6).map(str::to_owned))
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?.to_owned();
            t.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_owned)
        })
        .filter(|inode| inodes.contains(inode))
        .count()
}

#[test]
fn create_publish_attach_list_delete_over_the_socket() {
    let path = path("e2e");
    let (server, live) = serve(&path, quick_limits());
    let a = Client::connect(&path).unwrap();
    let b = Client::connect(&path).unwrap();
    assert_eq!(a.server_pid(), std::process::id());
    assert_eq!(a.devices(), &[(DEV, G)]);
    let g = create(&a, "m/w", 5000).unwrap();
    assert_eq!(g.size, 2 * G);
    // The descriptor is the server's memory (a memfd of the rounded size here).
    assert_eq!(rustix::fs::fstat(&g.fd).unwrap().st_size as u64, 2 * G);
    assert!(matches!(create(&b, "m/w", G), Err(Error::NameTaken { .. })));
    assert!(matches!(
        b.call_granted(&Message::Attach { name: "m/w".into() }),
        Err(Error::WrongState {
            state: BufferState::Creating,
            ..
        })
    ));
    done(
        &a,
        Message::Publish {
            name: "m/w".into(),
            event: Some([3; 64]),
        },
    )
    .unwrap();
    let at = b.call_granted(&Message::Attach { name: "m/w".into() }).unwrap();
    assert!(at.event.is_some());
    assert_eq!(rustix::fs::fstat(&at.fd).unwrap().st_size as u64, 2 * G);
    let list = b.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].name.as_str(), list[0].tag.as_str(), list[0].attachments),
        ("m/w", "t", 2)
    );
    assert_eq!(list[0].owner_uid, rustix::process::geteuid().as_raw());
    b.delete("m/w").unwrap();
    assert!(matches!(b.delete("m/w"), Err(Error::UnknownName { .. })));
    assert!(matches!(b.delete("../x"), Err(Error::BadName { .. })));
    assert_eq!(live.load(Ordering::SeqCst), 1, "still attached");
    done(
        &a,
        Message::Detach {
            attachment: g.attachment,
        },
    )
    .unwrap();
    done(
        &b,
        Message::Detach {
            attachment: at.attachment,
        },
    )
    .unwrap();
    assert_eq!(live.load(Ordering::SeqCst), 0);
    let stats = a.stats().unwrap();
    assert_eq!((stats.buffers, stats.freed, stats.connections), (0, 1, 2));
    // A detach of an attachment this connection does not hold ends the connection.
    assert!(matches!(
        done(&a, Message::Detach { attachment: 12345 }),
        Err(Error::Protocol { .. })
    ));
    assert!(matches!(a.list(), Err(Error::PeerGone { .. })));
    assert!(b.list().is_ok());
    // Many buffers list across pages.
    for i in 0..230 {
        create(&b, &format!("p{i:03}"), G).unwrap();
    }
    let names: Vec<String> = b.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, (0..230).map(|i| format!("p{i:03}")).collect::<Vec<_>>());
    drop((a, b));
    server.shutdown();
    assert_eq!(live.load(Ordering::SeqCst), 0, "shutdown releases everything");
    assert!(!path.exists(), "shutdown removes the socket file");
}

#[test]
fn attach_many_over_the_socket_passes_every_descriptor_and_is_all_or_nothing() {
    use crate::protocol::messages::MAX_ATTACH_MANY;
    let path = path("many");
    let backend = HostBackend::new(1, G);
    let live = backend.live.clone();
    let relays_done = backend.relays_done.clone();
    let server = Server::serve_with(ServerConfig::new(&path).limits(quick_limits()), Box::new(backend)).unwrap();
    let a = Client::connect(&path).unwrap();
    let b = Client::connect(&path).unwrap();
    let count = MAX_ATTACH_MANY;
    let names: Vec<String> = (0..count).map(|i| format!("many/{i:03}")).collect();
    for (i, name) in names.iter().enumerate() {
        // Sizes differ per buffer, so each descriptor shows which buffer it is.
        let g = create(&a, name, (i as u64 + 1) * G).unwrap();
        done(
            &a,
            Message::Publish {
                name: name.clone(),
                event: Some([1; 64]),
            },
        )
        .unwrap();
        done(
            &a,
            Message::Detach {
                attachment: g.attachment,
            },
        )
        .unwrap();
    }
    let attach_many = |c: &Client, names: Vec<String>| match c.call(&Message::AttachMany { names })? {
        (Message::GrantedMany { grants }, fds) => Ok((grants, fds)),
        (other, _) => panic!("expected GrantedMany, got {other:?}"),
    };
    // The relays are pending: every grant carries the server's event.
    let (grants, fds) = attach_many(&b, names.clone()).unwrap();
    assert_eq!((grants.len(), fds.len()), (count, count));
    for (i, (g, fd)) in grants.iter().zip(&fds).enumerate() {
        assert_eq!(g.size, (i as u64 + 1) * G, "grant {i}");
        assert_eq!(rustix::fs::fstat(fd).unwrap().st_size as u64, g.size, "descriptor {i}");
        assert!(g.event.is_some());
    }
    assert_eq!(b.stats().unwrap().attachments, count as u64);
    // All or nothing: a missing name in the middle refuses the request, names it, attaches
    // nothing, and leaves the connection usable.
    let mut with_missing = names[..10].to_vec();
    with_missing.insert(5, "many/missing".into());
    match attach_many(&b, with_missing) {
        Err(Error::UnknownName { name }) => assert_eq!(name, "many/missing"),
        other => panic!("expected UnknownName, got {other:?}"),
    }
    assert_eq!(b.stats().unwrap().attachments, count as u64);
    // Once the relays have completed, grants carry no event: attachers wait on nothing.
    relays_done.store(true, Ordering::SeqCst);
    let (ready, ready_fds) = attach_many(&b, names[..3].to_vec()).unwrap();
    assert_eq!(ready_fds.len(), 3);
    assert!(ready.iter().all(|g| g.event.is_none()));
    let single = b.call_granted(&Message::Attach { name: names[7].clone() }).unwrap();
    assert!(single.event.is_none());
    // Each attachment detaches on its own; the memory goes with the last one after delete.
    for g in grants
        .iter()
        .chain(&ready)
        .map(|g| g.attachment)
        .chain([single.attachment])
    {
        done(&b, Message::Detach { attachment: g }).unwrap();
    }
    assert_eq!(b.stats().unwrap().attachments, 0);
    for name in &names {
        b.delete(name).unwrap();
    }
    assert_eq!(live.load(Ordering::SeqCst), 0);
    // Counts the protocol does not allow (this client refuses to send them; raw frames here):
    // the server refuses and ends the connection, and serves the others.
    let hello = codec::encode(&Message::Hello).unwrap();
    let one = codec::encode(&Message::AttachMany {
        names: vec!["many/000".into()],
    })
    .unwrap();
    for count in [0u16, MAX_ATTACH_MANY as u16 + 1] {
        let s = raw_connect(&path);
        (&s).write_all(&hello).unwrap();
        let mut frame = one.clone();
        frame[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&count.to_le_bytes());
        (&s).write_all(&frame).unwrap();
        let got = read_to_close(&s);
        // The Welcome, then the refusal.
        let welcome_len = HEADER_LEN + u32::from_le_bytes(got[8..12].try_into().unwrap()) as usize;
        assert!(
            refused_with(&got[welcome_len..]).contains("entries"),
            "a count of {count}"
        );
    }
    assert!(a.list().is_ok());
    assert_eq!(live.load(Ordering::SeqCst), 0);
    drop((a, b, fds, ready_fds));
    server.shutdown();
}

#[test]
fn server_gone_is_peer_gone_and_a_restart_serves_the_path_again() {
    let path = path("gone");
    let (server, _) = serve(&path, quick_limits());
    let client = Client::connect(&path).unwrap();
    create(&client, "x", G).unwrap();
    // A second server never steals a live socket.
    match Server::serve_with(ServerConfig::new(&path), Box::new(HostBackend::new(1, G))) {
        Err(Error::SocketPath { reason, .. }) => assert!(reason.contains("listening"), "{reason}"),
        other => panic!("{other:?}"),
    }
    server.shutdown();
    assert!(matches!(client.list(), Err(Error::PeerGone { .. })));
    assert!(matches!(client.stats(), Err(Error::PeerGone { .. })));
    assert!(matches!(Client::connect(&path), Err(Error::PeerGone { .. })));
    // A crashed server leaves its socket file: a stale one, replaced by the next server.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let (server, _) = serve(&path, quick_limits());
    let client = Client::connect(&path).unwrap();
    assert!(client.list().unwrap().is_empty(), "a restarted server starts empty");
    server.shutdown();
    // Something that is not a socket is never removed.
    std::fs::write(&path, b"not a socket").unwrap();
    assert!(matches!(
        Server::serve_with(ServerConfig::new(&path), Box::new(HostBackend::new(1, G))),
        Err(Error::SocketPath { .. })
    ));
    std::fs::remove_file(&path).unwrap();
}

fn raw_connect(path: &Path) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// Reads until the server closes the connection; returns what it sent.
fn read_to_close(mut s: &UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut out);
    out
}

fn refused_with(bytes: &[u8]) -> String {
    assert!(bytes.len() >= HEADER_LEN, "the server closed without a Refused frame");
    let header = codec::decode_header(bytes[..HEADER_LEN].try_into().unwrap()).unwrap();
    match codec::decode_body_as(header.kind, header.version, &bytes[HEADER_LEN..]).unwrap() {
        Message::Refused(r) => codec::error_of(r).to_string(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_clients_are_cut_off_and_a_good_client_is_served() {
    let path = path("hostile");
    let (server, live) = serve(&path, quick_limits());
    let good = Client::connect(&path).unwrap();
    create(&good, "keep", G).unwrap();
    // The listener, and the good connection's socket with the clone that shutdown uses.
    assert_eq!(server_sockets(&path), 3);

    // Garbage instead of a header.
    let s = raw_connect(&path);
    (&s).write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("magic"));
    // The exporter's protocol on this socket.
    let s = raw_connect(&path);
    (&s).write_all(b"MPIP\x02\x00\x01\x00\x00\x00\x00\x00").unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("magic"));
    // An oversized frame.
    let s = raw_connect(&path);
    let mut h = codec::encode(&Message::Hello).unwrap();
    h[8..12].copy_from_slice(&(MAX_BODY_LEN as u32 * 4).to_le_bytes());
    (&s).write_all(&h).unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("limit"));
    // Slowloris: half a header, then nothing.
    let s = raw_connect(&path);
    (&s).write_all(&codec::encode(&Message::Hello).unwrap()[..5]).unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("timed out"));
    // Silence: no Hello within the handshake limit.
    let s = raw_connect(&path);
    assert!(refused_with(&read_to_close(&s)).contains("timed out"));
    // A server message from a client.
    let s = raw_connect(&path);
    (&s).write_all(&codec::encode(&Message::Done).unwrap()).unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("not a message"));
    // A request before Hello.
    let s = raw_connect(&path);
    (&s).write_all(&codec::encode(&Message::Stats).unwrap()).unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("Hello"));
    // Descriptors where none belong: closed, and the connection refused.
    let s = raw_connect(&path);
    let memfd = crate::test_util::memfd_with(&unique_name("stray"), b"x");
    let hello = codec::encode(&Message::Hello).unwrap();
    mempool_socket::fdpass::send_raw(
        std::os::fd::AsFd::as_fd(&s),
        &hello,
        &[std::os::fd::AsFd::as_fd(&memfd), std::os::fd::AsFd::as_fd(&memfd)],
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("descriptors"));
    // A hostile body after a good handshake.
    let s = raw_connect(&path);
    (&s).write_all(&hello).unwrap();
    let mut welcome = vec![0u8; HEADER_LEN];
    std::io::Read::read_exact(&mut &s, &mut welcome).unwrap();
    let body_len = u32::from_le_bytes(welcome[8..12].try_into().unwrap()) as usize;
    let mut body = vec![0u8; body_len];
    std::io::Read::read_exact(&mut &s, &mut body).unwrap();
    let mut attach = codec::encode(&Message::Attach { name: "ab".into() }).unwrap();
    attach[HEADER_LEN] = 0xff; // a string length past the body
    (&s).write_all(&attach).unwrap();
    assert!(refused_with(&read_to_close(&s)).contains("cut short"));
    // Many idle clients, all cut off at the handshake limit.
    let idle: Vec<UnixStream> = (0..40).map(|_| raw_connect(&path)).collect();
    assert!(good.list().is_ok(), "served while idle clients wait");
    for s in &idle {
        assert!(refused_with(&read_to_close(s)).contains("timed out"));
    }
    drop(idle);

    assert_eq!(good.list().unwrap().len(), 1);
    wait_until("the server closed every hostile connection", || {
        server_sockets(&path) == 3
    });
    assert_eq!(good.stats().unwrap().connections, 1);
    assert!(server.stats().rejected >= 49, "{:?}", server.stats());
    assert_eq!(live.load(Ordering::SeqCst), 1);
    drop(good);
    wait_until("the good client's connection is gone", || {
        server.stats().connections == 0
    });
    assert_eq!(server_sockets(&path), 1, "only the listener is left");
    server.shutdown();
}

#[test]
fn connection_limits_and_idle_clients() {
    let path = path("limits");
    let (server, _) = serve(
        &path,
        Limits {
            max_connections: 3,
            max_connections_per_uid: 2,
            idle_timeout: Duration::from_millis(300),
            ..quick_limits()
        },
    );
    let a = Client::connect(&path).unwrap();
    let b = Client::connect(&path).unwrap();
    match Client::connect(&path) {
        Err(Error::Busy { reason }) => assert!(reason.contains("per uid"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // A client that holds something is never closed for idleness; one that holds nothing is.
    create(&a, "held", G).unwrap();
    wait_until("the idle connection that holds nothing is closed", || {
        server.stats().connections == 1
    });
    assert!(matches!(b.list(), Err(Error::PeerGone { .. })));
    assert!(a.list().is_ok());
    let c = Client::connect(&path).unwrap();
    assert!(c.list().is_ok());
    server.shutdown();
}

/// Not a test of its own: the child process of `a_killed_clients_holdings_are_reclaimed`.
#[test]
fn host_child_role() {
    let Ok(path) = std::env::var(CHILD_ROLE) else {
        return;
    };
    let client = Client::connect(&path).unwrap();
    let g = create(&client, "child/creating", G).unwrap();
    create(&client, "child/published", G).unwrap();
    done(
        &client,
        Message::Publish {
            name: "child/published".into(),
            event: None,
        },
    )
    .unwrap();
    let _a = client
        .call_granted(&Message::Attach {
            name: "child/published".into(),
        })
        .unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let _keep = g;
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_killed_clients_holdings_are_reclaimed() {
    let path = path("killed");
    let (server, live) = serve(&path, quick_limits());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "server::tests::host_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROLE, &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    while !line.contains("READY") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended before READY");
    }
    assert_eq!(server.stats().attachments, 3);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    wait_until("the dead client's attachments are reclaimed", || {
        server.stats().attachments == 0
    });
    let observer = Client::connect(&path).unwrap();
    let names: Vec<String> = observer.list().unwrap().into_iter().map(|b| b.name).collect();
    assert_eq!(
        names,
        ["child/published"],
        "the unpublished buffer is gone, the published one stays"
    );
    assert_eq!(live.load(Ordering::SeqCst), 1);
    // A restarted client finds it by name.
    assert!(observer
        .call_granted(&Message::Attach {
            name: "child/published".into()
        })
        .is_ok());
    server.shutdown();
}

#[test]
fn quotas_and_time_to_live_over_the_socket() {
    let path = path("quota");
    let backend = HostBackend::new(1, G);
    let live = backend.live.clone();
    let config = ServerConfig::new(&path).limits(quick_limits()).quotas(Quotas {
        per_uid_buffers: Some(2),
        ..Quotas::default()
    });
    let server = Server::serve_with(config, Box::new(backend)).unwrap();
    let client = Client::connect(&path).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let a = client
        .call_granted(&Message::Create {
            device: DEV,
            size: G,
            ttl_ms: 2000,
            name: "short".into(),
            tag: String::new(),
            attach_uids: Vec::new(),
        })
        .unwrap();
    done(
        &client,
        Message::Publish {
            name: "short".into(),
            event: None,
        },
    )
    .unwrap();
    create(&client, "long", G).unwrap();
    match create(&client, "third", G) {
        Err(e @ Error::QuotaExceeded { .. }) => {
            assert!(e.is_refusal());
            let text = e.to_string();
            assert!(
                text.contains(&format!("uid {uid}")) && text.contains("limit 2"),
                "{text}"
            );
        }
        other => panic!("{:?}", other.map(|g| g.size)),
    }
    let listed = client.list().unwrap();
    assert!(listed.iter().find(|b| b.name == "short").unwrap().expires_in.is_some());
    assert!(listed.iter().find(|b| b.name == "long").unwrap().expires_in.is_none());
    // The time-to-live runs out: the name goes (the server's housekeeping or the next call).
    wait_until("the short-lived buffer expires", || {
        client.list().unwrap().iter().all(|b| b.name != "short")
    });
    assert!(matches!(
        client.call_granted(&Message::Attach { name: "short".into() }),
        Err(Error::UnknownName { .. })
    ));
    // Still charged while attached; credited once detached.
    assert!(matches!(create(&client, "third", G), Err(Error::QuotaExceeded { .. })));
    done(
        &client,
        Message::Detach {
            attachment: a.attachment,
        },
    )
    .unwrap();
    create(&client, "third", G).unwrap();
    assert_eq!(live.load(Ordering::SeqCst), 2);
    server.shutdown();
}

const PIDFD_CHILD: &str = "MEMPOOL_MEMSVC_PIDFD_CHILD";

/// How many descriptors of this process are pidfds (`anon_inode:[pidfd]`, or `pidfd:[..]` on
/// kernels with pidfs).
fn pidfds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_str().is_some_and(|t| t.contains("pidfd")))
        .count()
}

/// Not a test of its own: the body of `ended_connections_share_one_pidfd_and_are_capped_per_uid`,
/// run in a child process of its own so that no other test's server holds pidfds while it counts.
#[test]
fn pidfd_child_role() {
    let Ok(path) = std::env::var(PIDFD_CHILD) else {
        return;
    };
    let path = PathBuf::from(path);
    const CAP: usize = 5;
    assert_eq!(pidfds(), 0, "no pidfd before the server starts");
    let (server, _) = serve(
        &path,
        Limits {
            max_ended_connections_per_uid: CAP,
            ..quick_limits()
        },
    );
    let owner = Client::connect(&path).unwrap();
    let g = create(&owner, "ended/b", G).unwrap();
    done(
        &owner,
        Message::Publish {
            name: "ended/b".into(),
            event: None,
        },
    )
    .unwrap();
    drop(g.fd);
    let ended = |server: &Server| -> usize { server.inner.reaper().values().map(|w| w.conns.len()).sum() };
    // The owner's live connection holds the one pidfd its connection thread keeps.
    wait_until("the owner's connection holds its pidfd", || pidfds() == 1);
    // A client that attaches and closes without detaching, CAP times: every ended connection keeps
    // its attachment (this process still runs), all under this process's one pidfd.
    for round in 1..=CAP {
        let c = Client::connect(&path).unwrap();
        let at = c.call_granted(&Message::Attach { name: "ended/b".into() }).unwrap();
        drop(at.fd);
        drop(c);
        wait_until("the server saw the connection end", || ended(&server) == round);
        assert_eq!(
            pidfds(),
            2,
            "the owner's connection's pidfd plus one for this process's {round} ended connections"
        );
        assert_eq!(server.inner.reaper().len(), 1, "one watch per process");
    }
    assert_eq!(server.stats().attachments, 1 + CAP as u64);
    // Past the cap, this uid's new connections are refused, naming the cause.
    match Client::connect(&path) {
        Err(Error::Busy { reason }) => assert!(
            reason.contains(&format!("{CAP} ended connections")) && reason.contains("limit per uid is 5"),
            "{reason}"
        ),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert_eq!(pidfds(), 2, "a refused connection leaves no pidfd");
    // The well-behaved live connection is still served.
    assert_eq!(owner.list().unwrap().len(), 1);
    let again = owner.call_granted(&Message::Attach { name: "ended/b".into() }).unwrap();
    done(
        &owner,
        Message::Detach {
            attachment: again.attachment,
        },
    )
    .unwrap();
    drop(owner);
    wait_until("the owner's connection ended", || server.stats().connections == 0);
    server.shutdown();
    assert_eq!(pidfds(), 0, "shutdown closes the watch");
    println!("PIDFD CHILD PASSED");
}

#[test]
fn ended_connections_share_one_pidfd_and_are_capped_per_uid() {
    let path = path("pidfd");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "server::tests::pidfd_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PIDFD_CHILD, &path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("PIDFD CHILD PASSED"),
        "the child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

#[test]
fn attachments_per_connection_are_capped_and_the_connection_stays_usable() {
    let path = path("attcap");
    let (server, _) = serve(
        &path,
        Limits {
            max_attachments_per_connection: 3,
            ..quick_limits()
        },
    );
    let owner = Client::connect(&path).unwrap();
    for name in ["cap/a", "cap/b"] {
        let g = create(&owner, name, G).unwrap();
        done(
            &owner,
            Message::Publish {
                name: name.into(),
                event: None,
            },
        )
        .unwrap();
        done(
            &owner,
            Message::Detach {
                attachment: g.attachment,
            },
        )
        .unwrap();
    }
    let c = Client::connect(&path).unwrap();
    let attach = |name: &str| c.call_granted(&Message::Attach { name: name.into() });
    let attach_many = |names: &[&str]| -> crate::error::Result<Vec<GrantEntry>> {
        match c.call(&Message::AttachMany {
            names: names.iter().map(|n| n.to_string()).collect(),
        })? {
            (Message::GrantedMany { grants }, _) => Ok(grants),
            (other, _) => panic!("expected GrantedMany, got {other:?}"),
        }
    };
    let busy_with = |r: crate::error::Result<()>, held: usize, more: usize| match r {
        Err(Error::Busy { reason }) => assert!(
            reason.contains(&format!("holds {held} attachments and asked for {more} more"))
                && reason.contains("limit of 3 per connection"),
            "{reason}"
        ),
        other => panic!("expected Busy, got {other:?}"),
    };
    let first = attach("cap/a").unwrap();
    attach("cap/a").unwrap();
    attach("cap/b").unwrap();
    assert_eq!(server.stats().attachments, 3);
    busy_with(attach("cap/b").map(drop), 3, 1);
    busy_with(attach_many(&["cap/a"]).map(drop), 3, 1);
    busy_with(create(&c, "cap/c", G).map(drop), 3, 1);
    assert_eq!(server.stats().attachments, 3, "refusals grant nothing");
    // The connection stays usable: detach one, and one more fits, but not two (all or nothing).
    done(
        &c,
        Message::Detach {
            attachment: first.attachment,
        },
    )
    .unwrap();
    busy_with(attach_many(&["cap/a", "cap/b"]).map(drop), 2, 2);
    assert_eq!(
        server.stats().attachments,
        2,
        "a refused attach_many grants none of its names"
    );
    assert_eq!(attach_many(&["cap/b"]).unwrap().len(), 1);
    assert_eq!(server.stats().attachments, 3);
    assert_eq!(c.list().unwrap().len(), 2);
    server.shutdown();
}

#[test]
fn a_large_allocation_does_not_hold_up_other_clients() {
    let path = path("held");
    let backend = HostBackend::new(1, G);
    let handle = backend.clone();
    let server = Server::serve_with(ServerConfig::new(&path).limits(quick_limits()), Box::new(backend)).unwrap();
    // Replies the server holds back would time out (the test then fails) rather than hang.
    let options = ClientOptions {
        timeout: WAIT,
        ..ClientOptions::default()
    };
    let a = Client::connect_with(&path, options.clone()).unwrap();
    let b = Client::connect_with(&path, options).unwrap();
    create(&b, "held/ready", G).unwrap();
    done(
        &b,
        Message::Publish {
            name: "held/ready".into(),
            event: None,
        },
    )
    .unwrap();
    let gate = handle.block_next();
    let creator = std::thread::spawn(move || {
        let g = create(&a, "held/big", 8 * G);
        (a, g)
    });
    gate.entered.wait();
    // a's allocation is inside the backend: b is served meanwhile. The gate opens whatever these
    // checks find (a failure must not leave the server's shutdown waiting on a's thread).
    let checks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let at = b
            .call_granted(&Message::Attach {
                name: "held/ready".into(),
            })
            .unwrap();
        assert_eq!(rustix::fs::fstat(&at.fd).unwrap().st_size as u64, G);
        let list = b.list().unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(
            (list[0].name.as_str(), list[0].state, list[0].attachments),
            ("held/big", BufferState::Creating, 0)
        );
        assert!(matches!(create(&b, "held/big", G), Err(Error::NameTaken { .. })));
    }));
    gate.release.wait();
    if let Err(panic) = checks {
        std::panic::resume_unwind(panic);
    }
    let (a, g) = creator.join().unwrap();
    let g = g.unwrap();
    assert_eq!(rustix::fs::fstat(&g.fd).unwrap().st_size as u64, 8 * G);
    assert_eq!(handle.live.load(Ordering::SeqCst), 2);
    assert_eq!(b.list().unwrap()[0].attachments, 1);
    drop((a, b));
    server.shutdown();
    assert_eq!(handle.live.load(Ordering::SeqCst), 0);
}

/// The hostile clients the GPU test (`mempool-store-server/tests/store_gpu.rs`) also runs, against `mempool-store-server`.
#[path = "../../tests/store_attack/mod.rs"]
mod attack;

/// How many descriptors of this process are the memfd named `name`.
fn memfds_named(name: &str) -> usize {
    let target = format!("/memfd:{name} (deleted)");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_str() == Some(target.as_str()))
        .count()
}

/// A well-behaved client's round over the host double: creates a buffer (a size the granularity
/// rounds up), writes it through its descriptor, publishes it, attaches it and reads the bytes
/// back through the attachment's own descriptor, deletes it and ends both attachments; each step
/// must succeed.
fn good_round(client: &Client, round: usize) {
    let name = format!("good/{round}");
    let step = |what: &str, e: Error| -> ! { panic!("good client, round {round}: {what}: {e}") };
    let created = create(client, &name, 3 * G - 1).unwrap_or_else(|e| step("create", e));
    assert_eq!(created.size, 3 * G, "rounded up to the granularity");
    let bytes: Vec<u8> = (0..3 * G as usize).map(|i| (i / 7 + round) as u8).collect();
    assert_eq!(rustix::io::pwrite(&created.fd, &bytes, 0).unwrap(), bytes.len());
    done(
        client,
        Message::Publish {
            name: name.clone(),
            event: Some([round as u8; 64]),
        },
    )
    .unwrap_or_else(|e| step("publish", e));
    let attached = client
        .call_granted(&Message::Attach { name: name.clone() })
        .unwrap_or_else(|e| step("attach", e));
    let mut back = vec![0u8; bytes.len()];
    assert_eq!(rustix::io::pread(&attached.fd, &mut back, 0).unwrap(), back.len());
    assert!(
        back == bytes,
        "good client, round {round}: the attachment reads other bytes"
    );
    client.delete(&name).unwrap_or_else(|e| step("delete", e));
    for attachment in [created.attachment, attached.attachment] {
        done(client, Message::Detach { attachment }).unwrap_or_else(|e| step("detach", e));
    }
}

#[test]
fn hostile_clients_all_at_once_leave_the_server_at_its_baseline_and_a_good_client_is_served() {
    let path = path("attack");
    let limits = Limits {
        max_connections: 40,
        max_connections_per_uid: 24,
        idle_timeout: Duration::from_secs(1),
        ..quick_limits()
    };
    let (server, live) = serve(&path, limits);
    let good = Client::connect(&path).unwrap();
    // Held throughout: the good connection is never idle-closed, and its memory must survive.
    let keep = create(&good, "good/keep", G).unwrap();
    done(
        &good,
        Message::Publish {
            name: "good/keep".into(),
            event: None,
        },
    )
    .unwrap();
    good_round(&good, 0);
    // The baseline: the listener, and the good connection's socket with its clone.
    let sockets = server_sockets(&path);
    assert_eq!(sockets, 3);
    let stray = unique_name("stray");
    let plan = attack::Attack {
        frame_timeout: limits.frame_timeout,
        max_connections: limits.max_connections_per_uid,
        garbage: 20,
        stray: stray.clone(),
    };
    let mut round = 1;
    for wave in 0..2 {
        let report = attack::attack(&path, &plan, || {
            // The server at its connection limit, every attacker at work.
            for _ in 0..3 {
                good_round(&good, round);
                round += 1;
            }
        });
        println!("wave {wave}: {}", report.summary());
        assert!(
            report.idle_admitted < limits.max_connections_per_uid,
            "the good connection holds one of the uid's slots: {}",
            report.summary()
        );
        good_round(&good, round);
        round += 1;
        wait_until("the server closed every attacker's connection", || {
            server_sockets(&path) == sockets
        });
        assert_eq!(memfds_named(&stray), 0, "the stray descriptors were all closed");
        assert_eq!(live.load(Ordering::SeqCst), 1, "only the kept buffer holds memory");
    }
    let stats = good.stats().unwrap();
    assert_eq!(
        (stats.connections, stats.buffers, stats.named, stats.attachments),
        (1, 1, 1, 1),
        "{stats:?}"
    );
    assert!(stats.rejected >= 2 * 34, "every attacker was counted: {stats:?}");
    // A new client is served, and the kept buffer reads as written.
    let fresh = Client::connect(&path).unwrap();
    good_round(&fresh, round);
    assert_eq!(
        fresh
            .call_granted(&Message::Attach {
                name: "good/keep".into()
            })
            .unwrap()
            .size,
        G
    );
    drop((fresh, keep));
    server.shutdown();
    assert_eq!(live.load(Ordering::SeqCst), 0);
}

#[test]
fn a_group_over_the_socket_shares_one_memory_and_a_descriptor_of_it_per_grant() {
    use crate::protocol::codec::OP_ATTACH_GROUP_UNPUBLISHED;
    use crate::protocol::messages::GrantEntry;
    let path = path("group");
    let (server, live) = serve(&path, quick_limits());
    let a = Client::connect(&path).unwrap();
    let b = Client::connect(&path).unwrap();
    let many = |c: &Client, m: Message| match c.call(&m)? {
        (Message::GrantedMany { grants }, fds) => Ok((grants, fds)),
        (other, _) => panic!("expected GrantedMany, got {other:?}"),
    };
    let create_many = |c: &Client, members: &[(&str, u64)]| {
        many(
            c,
            Message::CreateMany {
                device: DEV,
                ttl_ms: 0,
                tag: "grp".into(),
                attach_uids: Vec::new(),
                members: members.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect(),
            },
        )
    };
    create(&a, "grp/taken", G).unwrap();
    // All or nothing, and the connection stays usable.
    match create_many(&a, &[("grp/a", G), ("grp/taken", G)]) {
        Err(Error::NameTaken { name }) => assert_eq!(name, "grp/taken"),
        other => panic!("expected NameTaken, got {:?}", other.map(|(g, _)| g)),
    }
    assert_eq!(live.load(Ordering::SeqCst), 1);
    let (grants, fds) = create_many(&a, &[("grp/a", 3000), ("grp/b", 2 * G), ("grp/c", G)]).unwrap();
    assert_eq!(live.load(Ordering::SeqCst), 2, "one allocation for the group");
    let placed: Vec<(u64, u64, u64)> = grants.iter().map(|g| (g.offset, g.size, g.memory_size)).collect();
    assert_eq!(placed, [(0, G, 4 * G), (G, 2 * G, 4 * G), (3 * G, G, 4 * G)]);
    // One descriptor per grant, each of the whole memory (the same memfd).
    let inode = |fd: &OwnedFd| {
        let st = rustix::fs::fstat(fd).unwrap();
        (st.st_ino, st.st_size as u64)
    };
    assert_eq!(fds.len(), 3);
    assert!(fds.iter().all(|fd| inode(fd) == (inode(&fds[0]).0, 4 * G)));
    // Not attachable until every member is published.
    for name in ["grp/a", "grp/b"] {
        done(
            &a,
            Message::Publish {
                name: name.into(),
                event: None,
            },
        )
        .unwrap();
    }
    match b.call_granted(&Message::Attach { name: "grp/a".into() }) {
        Err(Error::WrongState { state, op, .. }) => {
            assert_eq!((state, op), (BufferState::Creating, OP_ATTACH_GROUP_UNPUBLISHED));
        }
        other => panic!("expected WrongState, got {:?}", other.map(|g| g.entry)),
    }
    done(
        &a,
        Message::Publish {
            name: "grp/c".into(),
            event: None,
        },
    )
    .unwrap();
    let (attached, attached_fds) = many(
        &b,
        Message::AttachMany {
            names: vec!["grp/c".into(), "grp/a".into()],
        },
    )
    .unwrap();
    let memory = grants[0].memory;
    let at: Vec<(u64, u64, u64)> = attached.iter().map(|g| (g.memory, g.offset, g.size)).collect();
    assert_eq!(at, [(memory, 3 * G, G), (memory, 0, G)]);
    assert!(attached_fds.iter().all(|fd| inode(fd) == inode(&fds[0])));
    let single = b.call_granted(&Message::Attach { name: "grp/b".into() }).unwrap();
    let GrantEntry {
        memory: m,
        offset,
        memory_size,
        ..
    } = single.entry;
    assert_eq!((m, offset, memory_size), (memory, G, 4 * G));
    assert_eq!(inode(&single.fd), inode(&fds[0]));
    // The creator lets go and deletes every member: the memory stays while b holds any.
    for g in &grants {
        done(
            &a,
            Message::Detach {
                attachment: g.attachment,
            },
        )
        .unwrap();
    }
    for name in ["grp/a", "grp/b", "grp/c"] {
        a.delete(name).unwrap();
    }
    drop((fds, attached_fds));
    done(
        &b,
        Message::Detach {
            attachment: attached[0].attachment,
        },
    )
    .unwrap();
    done(
        &b,
        Message::Detach {
            attachment: attached[1].attachment,
        },
    )
    .unwrap();
    assert_eq!(live.load(Ordering::SeqCst), 2, "grp/b is still attached");
    done(
        &b,
        Message::Detach {
            attachment: single.attachment,
        },
    )
    .unwrap();
    wait_until("the group's memory is released", || live.load(Ordering::SeqCst) == 1);
    drop((a, b));
    server.shutdown();
}

/// A connection that speaks protocol `version` from its Hello on, as a client of that version
/// does (a version-2 client is one built before version 3).
fn speak(path: &Path, version: u16) -> Connection {
    let framed = Connection::new(raw_connect(path), false, Some(version), WAIT).unwrap();
    framed.send(&Message::Hello, None).unwrap();
    match framed.recv_versioned(Some(WAIT), WAIT).unwrap() {
        (Message::Welcome { devices, .. }, _, v) => assert_eq!((devices, v), (vec![(DEV, G)], version)),
        (other, ..) => panic!("expected Welcome, got {other:?}"),
    }
    framed
}

fn ask(framed: &Connection, m: &Message) -> (Message, Vec<OwnedFd>) {
    framed.send(m, None).unwrap();
    framed.recv(Some(WAIT), WAIT).unwrap()
}

/// The attach list the server holds for the buffer `name`.
fn attach_list(server: &Server, name: &str) -> Option<Vec<u32>> {
    server.inner.store.with(|s| s.attach_uids_of(name))
}

#[test]
fn a_version_2_client_is_served_as_version_2_served_it() {
    use crate::protocol::messages::{MIN_VERSION, STATS_NUMBERS_V2};
    let path = path("v2");
    let (server, live) = serve(&path, quick_limits());
    let old = speak(&path, MIN_VERSION);
    let create = Message::Create {
        device: DEV,
        size: G,
        ttl_ms: 0,
        name: "v2/a".into(),
        tag: String::new(),
        attach_uids: Vec::new(),
    };
    let (granted, fds) = ask(&old, &create);
    assert!(matches!(granted, Message::Granted(_)), "{granted:?}");
    assert_eq!(rustix::fs::fstat(&fds[0]).unwrap().st_size as u64, G);
    // Its buffers get the default attach list: their owner's uid only.
    assert_eq!(attach_list(&server, "v2/a"), Some(Vec::new()));
    let (done, _) = ask(
        &old,
        &Message::Publish {
            name: "v2/a".into(),
            event: None,
        },
    );
    assert_eq!(done, Message::Done);
    // A refusal, in its version.
    let (refused, _) = ask(&old, &create);
    match refused {
        Message::Refused(r) => assert!(matches!(codec::error_of(r), Error::NameTaken { .. })),
        other => panic!("expected Refused, got {other:?}"),
    }
    // Its counters: the seven version 2 has (its frame has no room for more).
    match ask(&old, &Message::Stats).0 {
        Message::StatsReply { numbers } => {
            assert_eq!(numbers[..3], [1, G, 1]);
            assert!(numbers[STATS_NUMBERS_V2..].iter().all(|&n| n == 0));
        }
        other => panic!("expected StatsReply, got {other:?}"),
    }
    // A client of version 3 attaches what a client of version 2 made, and the other way round.
    let new = Client::connect(&path).unwrap();
    assert_eq!(new.protocol_version(), crate::protocol::messages::VERSION);
    new.call_granted(&Message::Attach { name: "v2/a".into() }).unwrap();
    create_for(&new, "v3/b", &[]);
    assert!(matches!(
        ask(&old, &Message::Attach { name: "v3/b".into() }).0,
        Message::Granted(_)
    ));
    // A frame of another version than the Hello's ends the connection, with the cause.
    let wrong = codec::encode_as(&Message::Stats, crate::protocol::messages::VERSION).unwrap();
    old.stream().write_all(&wrong).unwrap();
    let got = read_to_close(old.stream());
    assert_eq!(
        u16::from_le_bytes([got[4], got[5]]),
        MIN_VERSION,
        "refused in its version"
    );
    assert!(refused_with(&got).contains("of protocol version 3 on a connection of version 2"));
    drop((old, new));
    server.shutdown();
    assert_eq!(live.load(Ordering::SeqCst), 0);
}

fn create_for(client: &Client, name: &str, uids: &[u32]) -> crate::client::Granted {
    let g = client
        .call_granted(&Message::Create {
            device: DEV,
            size: G,
            ttl_ms: 0,
            name: name.into(),
            tag: String::new(),
            attach_uids: uids.to_vec(),
        })
        .unwrap();
    done(
        client,
        Message::Publish {
            name: name.into(),
            event: None,
        },
    )
    .unwrap();
    g
}

#[test]
fn create_carries_its_attach_list_and_hostile_lists_are_refused() {
    let path = path("attachlist");
    let (server, _) = serve(&path, quick_limits());
    let client = Client::connect(&path).unwrap();
    let own = rustix::process::geteuid().as_raw();
    create_for(&client, "l/default", &[]);
    create_for(&client, "l/wide", &[7, own, 8]);
    assert_eq!(attach_list(&server, "l/default"), Some(Vec::new()));
    assert_eq!(
        attach_list(&server, "l/wide"),
        Some(vec![7, 8]),
        "its owner's uid is implied"
    );
    let (grants, _) = match client
        .call(&Message::CreateMany {
            device: DEV,
            ttl_ms: 0,
            tag: String::new(),
            attach_uids: vec![9],
            members: vec![("l/g1".into(), G), ("l/g2".into(), G)],
        })
        .unwrap()
    {
        (Message::GrantedMany { grants }, fds) => (grants, fds),
        (other, _) => panic!("expected GrantedMany, got {other:?}"),
    };
    assert_eq!(grants.len(), 2);
    assert_eq!(attach_list(&server, "l/g1"), Some(vec![9]));
    assert_eq!(attach_list(&server, "l/g2"), Some(vec![9]));
    // Lists this client refuses to send, as raw frames: the server refuses them too, naming why,
    // and ends the connection.
    let valid = codec::encode(&Message::Create {
        device: DEV,
        size: G,
        ttl_ms: 0,
        name: "l/bad".into(),
        tag: String::new(),
        attach_uids: vec![5, 6],
    })
    .unwrap();
    let at = HEADER_LEN + 16 + 8 + 8 + 2 + "l/bad".len() + 2;
    assert_eq!(&valid[at..], &[2, 0, 5, 0, 0, 0, 6, 0, 0, 0]);
    let hello = codec::encode(&Message::Hello).unwrap();
    let patched = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut frame = valid.clone();
        f(&mut frame);
        frame
    };
    let cases: [(Vec<u8>, &str); 3] = [
        (
            patched(&|f| f[at + 6..at + 10].copy_from_slice(&5u32.to_le_bytes())),
            "uid 5 twice",
        ),
        (
            patched(&|f| f[at + 2..at + 6].copy_from_slice(&u32::MAX.to_le_bytes())),
            "no uid",
        ),
        (
            {
                let mut f = valid[..at].to_vec();
                f.extend_from_slice(&65u16.to_le_bytes());
                f.extend((0..65u32).flat_map(u32::to_le_bytes));
                let len = (f.len() - HEADER_LEN) as u32;
                f[8..12].copy_from_slice(&len.to_le_bytes());
                f
            },
            "at most 64",
        ),
    ];
    for (frame, why) in cases {
        let s = raw_connect(&path);
        (&s).write_all(&hello).unwrap();
        (&s).write_all(&frame).unwrap();
        let got = read_to_close(&s);
        let welcome_len = HEADER_LEN + u32::from_le_bytes(got[8..12].try_into().unwrap()) as usize;
        let refusal = refused_with(&got[welcome_len..]);
        assert!(refusal.contains(why), "{refusal}");
    }
    assert_eq!(attach_list(&server, "l/bad"), None, "nothing was created");
    assert!(client.list().is_ok());
    drop(client);
    server.shutdown();
}

/// A server of protocol version 2, as one built before version 3 behaves: a frame of any other
/// version is refused (Protocol, in a version-2 frame) and the connection closed; a version-2
/// Hello is welcomed and a Stats answered with its seven numbers. `first` refuses every Hello
/// of the first connection with it instead (a server at its connection limit). Returns the path
/// and how many connections it accepted.
fn version_2_server(first: Option<Error>) -> (PathBuf, Arc<AtomicU64>, std::thread::JoinHandle<()>) {
    use crate::protocol::messages::MIN_VERSION;
    let path = path("oldserver");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let count = accepted.clone();
    let thread = std::thread::spawn(move || {
        let mut first = first;
        while let Ok((stream, _)) = listener.accept() {
            count.fetch_add(1, Ordering::SeqCst);
            let mut framed = Connection::new(stream, true, None, WAIT).unwrap();
            if let Some(err) = first.take() {
                framed.send(&Message::Refused(codec::refusal_of(&err)), None).unwrap();
                continue;
            }
            let mut header = [0u8; HEADER_LEN];
            std::io::Read::read_exact(&mut framed.stream(), &mut header).unwrap();
            let version = u16::from_le_bytes([header[4], header[5]]);
            if version != MIN_VERSION {
                // What version 2's decode_header said.
                let err = Error::protocol(format!("protocol version {version}, this side speaks version 2"));
                framed.send(&Message::Refused(codec::refusal_of(&err)), None).unwrap();
                continue;
            }
            framed.set_version(MIN_VERSION);
            framed
                .send(
                    &Message::Welcome {
                        pid: 4242,
                        devices: vec![(DEV, G)],
                    },
                    None,
                )
                .unwrap();
            while let Ok((Message::Stats, _)) = framed.recv(Some(WAIT), WAIT) {
                let numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9];
                if framed.send(&Message::StatsReply { numbers }, None).is_err() {
                    break;
                }
            }
            return;
        }
    });
    (path, accepted, thread)
}

#[test]
fn a_client_falls_back_to_version_2_with_a_version_2_server() {
    use crate::client::CreateOptions;
    use crate::protocol::messages::MIN_VERSION;
    let (path, accepted, thread) = version_2_server(None);
    let client = Client::connect(&path).unwrap();
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "refused in version 3, welcomed in version 2"
    );
    assert_eq!(client.protocol_version(), MIN_VERSION);
    assert_eq!(client.server_pid(), 4242);
    // Version 2's seven counters; the two it does not have are 0.
    let stats = client.stats().unwrap();
    assert_eq!((stats.buffers, stats.rejected), (1, 7));
    assert_eq!((stats.lingering_buffers, stats.lingering_bytes), (0, 0));
    // An attach list cannot travel in version 2: refused here, before anything is sent.
    match CreateOptions::new()
        .attach_uids([5])
        .attach_list(client.protocol_version())
    {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("protocol version 2"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(
        CreateOptions::new().attach_list(client.protocol_version()).unwrap(),
        Vec::<u32>::new()
    );
    drop(client);
    thread.join().unwrap();
    let _ = std::fs::remove_file(&path);
    // Any other refusal of a version-2 server is returned as it is, without a second try.
    let (path, accepted, thread) = version_2_server(Some(Error::Busy {
        reason: "it has 1 connections, its limit".into(),
    }));
    match Client::connect(&path) {
        Err(Error::Busy { reason }) => assert!(reason.contains("its limit"), "{reason}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    // (The thread waits for the next connection: give it one that says Hello in version 2.)
    drop(speak(&path, MIN_VERSION));
    thread.join().unwrap();
    let _ = std::fs::remove_file(&path);
}
