//! Hostile clients of the memory store, all at once, written by hand over raw sockets (std and
//! rustix only; the wire bytes as `src/protocol/messages.rs` lays them out). Shared by the
//! host test (`server::tests`, over the host double, which includes this file with
//! `#[path]`) and the GPU test (`mempool-store-server/tests/store_gpu.rs`, against a `mempool-store-server` process), so that
//! the host runs exactly what the GPU machine runs.
//!
//! [`attack`] floods the server with idle connections until it turns one away at its connection
//! limit, runs the caller's well-behaved work while the flood holds every slot it got, and
//! meanwhile runs, each on a connection of its own, garbage, oversized and cut-short frames,
//! slowloris writers (a byte at a time), silent clients, descriptors where none belong (a few, a
//! near-full `SCM_RIGHTS` message, one riding on half a header), a frame of a type that carries
//! descriptors sent without them, and a client that never reads its replies. Each must end with
//! the server's refusal naming its cause (or, for the one that never reads, the connection
//! closed); one turned away `Busy` at the limit is retried until admitted. Nothing here measures
//! time: the writers' pauses only make a frame outlast the server's frame limit, and every wait
//! has a generous deadline as a safety net against hangs.

use std::io::{IoSlice, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

/// The deadline of every wait (a safety net, not a measurement).
const WAIT: Duration = Duration::from_secs(60);
/// A retry's pause after the server turned a connection away at its limit.
const RETRY: Duration = Duration::from_millis(50);
const HEADER_LEN: usize = 12;
const MAX_BODY_LEN: u32 = 64 * 1024;
/// Message types (`MessageKind`).
const HELLO: u16 = 1;
const LIST: u16 = 7;
const STATS: u16 = 8;
const WELCOME: u16 = 64;
const GRANTED: u16 = 65;
const REFUSED: u16 = 69;
const GRANTED_MANY: u16 = 70;
/// Refusal codes (`codec`).
const BUSY: u16 = 11;
const PROTOCOL: u16 = 13;
const TIMEOUT: u16 = 14;
/// Descriptors the near-full `SCM_RIGHTS` message carries (the kernel's limit is 253).
const MANY_FDS: usize = 250;

/// What to attack with.
pub(crate) struct Attack {
    /// The server's frame time limit: a slowloris writer pauses half of it between bytes, so
    /// that no frame it starts can be complete in time.
    pub(crate) frame_timeout: Duration,
    /// The server's connection limit that a uid meets first: the idle flood opens up to four
    /// times as many connections, expecting to be turned away before.
    pub(crate) max_connections: usize,
    /// Connections sending garbage, one after another.
    pub(crate) garbage: usize,
    /// The name of the memfd sent as a stray descriptor: after the attack, no process but its
    /// creator's should hold it, and that one closes it before returning.
    pub(crate) stray: String,
}

/// What the attack saw.
pub(crate) struct Report {
    /// Idle connections the server admitted before it turned one away.
    pub(crate) idle_admitted: usize,
    /// The server's reason for turning the flood away.
    pub(crate) busy_reason: String,
    /// One line per attacker: how the server ended it.
    pub(crate) outcomes: Vec<String>,
}

impl Report {
    /// The report, one line per attacker.
    pub(crate) fn summary(&self) -> String {
        format!(
            "{} idle connections admitted, then turned away: {:?}\n{}",
            self.idle_admitted,
            self.busy_reason,
            self.outcomes.join("\n")
        )
    }
}

fn frame(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut f = b"MPMS".to_vec();
    f.extend_from_slice(&2u16.to_le_bytes()); // the protocol's version
    f.extend_from_slice(&kind.to_le_bytes());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// A header claiming `body_len` bytes of a `kind` body.
fn header(kind: u16, body_len: u32) -> Vec<u8> {
    let mut f = frame(kind, &[]);
    f[8..12].copy_from_slice(&body_len.to_le_bytes());
    f
}

fn connect(path: &Path) -> Result<UnixStream, String> {
    let s = UnixStream::connect(path).map_err(|e| format!("connect to {}: {e}", path.display()))?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    Ok(s)
}

/// Sends all of `bytes` (no `SIGPIPE`); false once the server closed the connection (or a
/// write timed out: see [`never_reads`]).
fn send(s: &UnixStream, bytes: &[u8]) -> bool {
    send_fds(s, bytes, &[]).is_ok()
}

/// Sends `bytes` with `fds` riding on the first of them.
fn send_fds(s: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<()> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MANY_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(
            control.push(SendAncillaryMessage::ScmRights(fds)),
            "room for {} fds",
            fds.len()
        );
    }
    let mut sent = rustix::net::sendmsg(s, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)?;
    while sent < bytes.len() {
        sent += rustix::net::send(s, &bytes[sent..], SendFlags::NOSIGNAL)?;
    }
    Ok(())
}

/// Everything the server sends until it closes the connection (a reset after the data, which
/// the kernel reports when the server closed with bytes of ours unread, ends it too).
fn read_to_close(mut s: &UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// Reads one whole frame (or what arrives of it before the connection ends).
fn read_frame(mut s: &UnixStream) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    if s.read_exact(&mut out).is_err() {
        return out;
    }
    let len = u32::from_le_bytes(out[8..12].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len.min(MAX_BODY_LEN as usize)];
    let _ = s.read_exact(&mut body);
    out.extend_from_slice(&body);
    out
}

/// Says Hello and reads the reply: the bytes read, and whether it was a Welcome.
fn hello(s: &UnixStream) -> (Vec<u8>, bool) {
    // A connection turned away at the limit is closed at once: the Hello may not go out, but the
    // refusal is there to read.
    let _ = send(s, &frame(HELLO, &[]));
    let reply = read_frame(s);
    let welcomed =
        reply.len() >= HEADER_LEN && reply[0..4] == *b"MPMS" && u16::from_le_bytes([reply[6], reply[7]]) == WELCOME;
    (reply, welcomed)
}

/// The server's frames in `bytes`: (type, body) each.
fn frames(bytes: &[u8]) -> Result<Vec<(u16, &[u8])>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let h = bytes.get(at..at + HEADER_LEN).ok_or_else(|| {
            format!(
                "{} bytes after the last whole frame: {:02x?}",
                bytes.len() - at,
                &bytes[at..]
            )
        })?;
        if h[0..4] != *b"MPMS" {
            return Err(format!("a frame with bad magic from the server: {:02x?}", h));
        }
        let kind = u16::from_le_bytes([h[6], h[7]]);
        let len = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
        let body = bytes
            .get(at + HEADER_LEN..at + HEADER_LEN + len)
            .ok_or_else(|| format!("a type {kind} frame cut short"))?;
        out.push((kind, body));
        at += HEADER_LEN + len;
    }
    Ok(out)
}

/// A Refused body's code and text (code u16, uid u32, scope, kind, state u8, 3 x u64, name, text).
fn refusal(body: &[u8]) -> Result<(u16, String), String> {
    let short = || format!("a Refused body cut short: {body:02x?}");
    let code = u16::from_le_bytes(body.get(0..2).ok_or_else(short)?.try_into().unwrap());
    let name_len = usize::from(u16::from_le_bytes(
        body.get(33..35).ok_or_else(short)?.try_into().unwrap(),
    ));
    let at = 35 + name_len;
    let text_len = usize::from(u16::from_le_bytes(
        body.get(at..at + 2).ok_or_else(short)?.try_into().unwrap(),
    ));
    let text = body.get(at + 2..at + 2 + text_len).ok_or_else(short)?;
    Ok((code, String::from_utf8_lossy(text).into_owned()))
}

/// How a connection ended: whether it was welcomed, and the server's refusal, if any.
struct Ending {
    welcomed: bool,
    refused: Option<(u16, String)>,
}

fn ending(bytes: &[u8]) -> Result<Ending, String> {
    let mut e = Ending {
        welcomed: false,
        refused: None,
    };
    for (kind, body) in frames(bytes)? {
        match kind {
            WELCOME if !e.welcomed && e.refused.is_none() => e.welcomed = true,
            REFUSED if e.refused.is_none() => e.refused = Some(refusal(body)?),
            other => return Err(format!("unexpected type {other} frame from the server")),
        }
    }
    Ok(e)
}

/// Runs `attack` on fresh connections until the server admits one (one turned away `Busy` at
/// its limit is retried), then checks that the server refused it with `code` and a text holding
/// `words`. `attack` returns the bytes it read itself.
fn until_admitted(
    path: &Path,
    what: &str,
    code: u16,
    words: &str,
    attack: impl Fn(&UnixStream) -> Vec<u8>,
) -> Result<String, String> {
    let deadline = Instant::now() + WAIT;
    let mut busy = 0;
    loop {
        let s = connect(path).map_err(|e| format!("{what}: {e}"))?;
        let mut got = attack(&s);
        got.extend(read_to_close(&s));
        let e = ending(&got).map_err(|err| format!("{what}: {err}"))?;
        match e.refused {
            Some((BUSY, reason)) if !e.welcomed => {
                busy += 1;
                if Instant::now() > deadline {
                    return Err(format!("{what}: still turned away after {busy} tries: {reason}"));
                }
                std::thread::sleep(RETRY);
            }
            Some((c, text)) if c == code && text.contains(words) => {
                return Ok(format!("{what}: refused ({text}) after {busy} connections turned away"))
            }
            other => {
                return Err(format!(
                    "{what}: expected refusal code {code} naming {words:?}, got {other:?} (welcomed: {})",
                    e.welcomed
                ))
            }
        }
    }
}

/// Says Hello; if welcomed, runs `then`. The bytes read either way.
fn after_hello(s: &UnixStream, then: impl FnOnce(&UnixStream)) -> Vec<u8> {
    let (got, welcomed) = hello(s);
    if welcomed {
        then(s);
    }
    got
}

/// Writes `bytes` one at a time, `gap` apart, until the server closes the connection.
fn trickle(s: &UnixStream, bytes: &[u8], gap: Duration) {
    for b in bytes {
        if !send(s, std::slice::from_ref(b)) {
            return;
        }
        std::thread::sleep(gap);
    }
}

/// Deterministic noise (a linear congruential generator), starting with a byte no magic has.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    let mut out = vec![0u8];
    while out.len() < len {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.push((seed >> 33) as u8);
    }
    out
}

/// A client that says Hello and then sends requests without ever reading a reply: the server's
/// replies fill the socket, its write limit runs out and it closes the connection, which this
/// side sees as its own write failing (not timing out: its limit is the long [`WAIT`]).
fn never_reads(path: &Path) -> Result<String, String> {
    let deadline = Instant::now() + WAIT;
    let mut busy = 0;
    loop {
        let s = connect(path)?;
        let (got, welcomed) = hello(&s);
        if !welcomed {
            match ending(&got)?.refused {
                Some((BUSY, _)) if Instant::now() < deadline => {
                    busy += 1;
                    std::thread::sleep(RETRY);
                    continue;
                }
                other => return Err(format!("never-reads: not welcomed: {other:?}")),
            }
        }
        let stats = frame(STATS, &[]);
        let mut sent = 0u64;
        loop {
            match send_fds(&s, &stats, &[]) {
                Ok(()) => sent += 1,
                Err(e) if e == rustix::io::Errno::PIPE || e == rustix::io::Errno::CONNRESET => {
                    return Ok(format!(
                        "never-reads: closed by the server after {sent} requests ({e}), after {busy} connections turned away"
                    ))
                }
                Err(e) => {
                    return Err(format!(
                        "never-reads: the server did not close a client that never reads: after {sent} requests, {e}"
                    ))
                }
            }
        }
    }
}

/// Opens idle connections (each says Hello and then nothing) until the server turns one away:
/// the admitted ones, and the reason it gave.
fn flood(path: &Path, attempts: usize) -> Result<(Vec<UnixStream>, String), String> {
    let mut held = Vec::new();
    for _ in 0..attempts {
        let s = connect(path)?;
        let (got, welcomed) = hello(&s);
        if welcomed {
            held.push(s);
            continue;
        }
        let mut got = got;
        got.extend(read_to_close(&s));
        return match ending(&got)?.refused {
            Some((BUSY, reason)) => Ok((held, reason)),
            other => Err(format!(
                "idle flood: connection {} was not welcomed, and not turned away Busy: {other:?}",
                held.len() + 1
            )),
        };
    }
    Err(format!(
        "idle flood: {attempts} idle connections admitted, none turned away (the limit is {})",
        attempts / 4
    ))
}

/// Attacks the server at `path` (see the module documentation) and runs `during_full` while the
/// idle flood holds every connection it was admitted (the server at its limit); afterwards waits
/// for each attacker's connection to be ended by the server. Panics naming every attacker that
/// did not end as it should; returns what it saw.
pub(crate) fn attack(path: &Path, a: &Attack, during_full: impl FnOnce()) -> Report {
    let gap = (a.frame_timeout / 2).max(Duration::from_millis(1));
    let stray_fd = rustix::fs::memfd_create(a.stray.as_str(), rustix::fs::MemfdFlags::CLOEXEC).expect("a memfd");
    let stray = stray_fd.as_fd();
    let hello_frame = frame(HELLO, &[]);
    type Job<'a> = Box<dyn FnOnce() -> Result<String, String> + Send + 'a>;
    let jobs: Vec<Job<'_>> = vec![
        Box::new(|| {
            (0..a.garbage)
                .map(|i| {
                    let bytes: Vec<u8> = if i % 2 == 0 {
                        b"GET / HTTP/1.1\r\nHost: store\r\n\r\n".to_vec()
                    } else {
                        noise(4096, i as u64)
                    };
                    until_admitted(path, "garbage", PROTOCOL, "magic", |s| {
                        send(s, &bytes);
                        Vec::new()
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| format!("{} x {}", v.len(), v.last().map_or("", String::as_str)))
        }),
        Box::new(|| {
            until_admitted(path, "oversized header", PROTOCOL, "limit", |s| {
                send(s, &header(HELLO, u32::MAX));
                Vec::new()
            })
        }),
        Box::new(|| {
            until_admitted(path, "header one byte larger than the limit", PROTOCOL, "limit", |s| {
                after_hello(s, |s| {
                    send(s, &header(LIST, MAX_BODY_LEN + 1));
                })
            })
        }),
        Box::new(|| {
            until_admitted(
                path,
                "a body of the largest size cut short",
                TIMEOUT,
                "reading a frame",
                |s| {
                    after_hello(s, |s| {
                        let mut f = header(LIST, MAX_BODY_LEN);
                        f.extend_from_slice(&[0u8; 100]);
                        send(s, &f);
                    })
                },
            )
        }),
        Box::new(|| {
            until_admitted(path, "slowloris Hello", TIMEOUT, "waiting for Hello", |s| {
                trickle(s, &hello_frame, gap);
                Vec::new()
            })
        }),
        Box::new(|| {
            until_admitted(path, "slowloris request", TIMEOUT, "reading a frame", |s| {
                after_hello(s, |s| trickle(s, &frame(LIST, &[0, 0]), gap))
            })
        }),
        Box::new(|| until_admitted(path, "silent", TIMEOUT, "waiting for Hello", |_| Vec::new())),
        Box::new(|| {
            until_admitted(path, "Hello with 2 descriptors", PROTOCOL, "descriptors", |s| {
                let _ = send_fds(s, &hello_frame, &[stray, stray]);
                Vec::new()
            })
        }),
        Box::new(|| {
            until_admitted(path, "Hello with 250 descriptors", PROTOCOL, "descriptors", |s| {
                let _ = send_fds(s, &hello_frame, &[stray; MANY_FDS]);
                Vec::new()
            })
        }),
        Box::new(|| {
            until_admitted(
                path,
                "a descriptor on half a header, then silence",
                TIMEOUT,
                "waiting for Hello",
                |s| {
                    let _ = send_fds(s, &hello_frame[..5], &[stray]);
                    Vec::new()
                },
            )
        }),
        Box::new(|| {
            until_admitted(path, "a request with a descriptor", PROTOCOL, "descriptors", |s| {
                after_hello(s, |s| {
                    let _ = send_fds(s, &frame(STATS, &[]), &[stray]);
                })
            })
        }),
        Box::new(|| {
            until_admitted(
                path,
                "GrantedMany (128 descriptors claimed) without descriptors",
                PROTOCOL,
                "not a message this side receives",
                |s| {
                    after_hello(s, |s| {
                        let mut body = 128u16.to_le_bytes().to_vec();
                        body.resize(2 + 128 * 129, 0);
                        send(s, &frame(GRANTED_MANY, &body));
                    })
                },
            )
        }),
        Box::new(|| {
            until_admitted(
                path,
                "Granted (1 descriptor claimed) without it, before Hello",
                PROTOCOL,
                "not a message this side receives",
                |s| {
                    send(s, &frame(GRANTED, &[0u8; 129]));
                    Vec::new()
                },
            )
        }),
        Box::new(|| never_reads(path)),
    ];
    let (flooded, mut outcomes, failures) = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs.into_iter().map(|job| scope.spawn(job)).collect();
        let flooded = flood(path, 4 * a.max_connections);
        if let Ok((held, _)) = &flooded {
            during_full();
            // The server ends each admitted idle connection at its idle limit.
            for (i, s) in held.iter().enumerate() {
                let got = read_to_close(s);
                match ending(&got).map(|e| e.refused) {
                    Ok(Some((TIMEOUT, text))) if text.contains("idle") => {}
                    other => panic!("idle connection {i}: expected the idle limit's refusal, got {other:?}"),
                }
            }
        }
        let mut outcomes = Vec::new();
        let mut failures = Vec::new();
        for h in handles {
            match h.join() {
                Ok(Ok(line)) => outcomes.push(line),
                Ok(Err(line)) => failures.push(line),
                Err(_) => failures.push("an attacker panicked (see its message above)".to_owned()),
            }
        }
        (flooded, outcomes, failures)
    });
    let (idle_admitted, busy_reason) = match flooded {
        Ok((held, reason)) => (held.len(), reason),
        Err(e) => panic!(
            "{e}\nthe other attackers:\n{}\n{}",
            outcomes.join("\n"),
            failures.join("\n")
        ),
    };
    assert!(
        failures.is_empty(),
        "attackers that did not end as they should:\n{}\nthe others:\n{}",
        failures.join("\n"),
        outcomes.join("\n")
    );
    assert!(
        idle_admitted >= 1 && busy_reason.contains("limit"),
        "{idle_admitted} idle connections admitted, then {busy_reason:?}"
    );
    outcomes.sort();
    Report {
        idle_admitted,
        busy_reason,
        outcomes,
    }
}
