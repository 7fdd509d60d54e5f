//! Whether an importer's process is gone, so that buffers it may still have been using can be
//! freed. Costs no descriptor while the importer is connected.
//!
//! When its handshake completes (the peer spoke a moment before, so its pid still names it; the
//! pid is `SO_PEERCRED`'s, read at accept) the process is remembered by pid and start time
//! (field 22 of `/proc/PID/stat`, in clock ticks since boot): a pid can be reused once its
//! process exits, the pair cannot in practice. When a connection ends uncleanly while the
//! importer still holds buffers, a `pidfd` is opened and the start time read again: if it still
//! matches, the pidfd names the importer's process and becomes readable when it exits (the event
//! loop polls it); if the pid is gone or now names another process, the importer is gone
//! already. One pidfd serves every connection of a process that ended so (the event loop keys
//! its watches by pid and start time), so a live process that connects and drops its
//! connections over and over costs one descriptor, not one per connection.
//!
//! Without `/proc` (or where it hides other processes) a pidfd is opened when the handshake
//! completes instead, while the peer is surely alive (one descriptor per importer, and per
//! importer still awaited after its connection ended). Without pidfds (kernels before
//! 5.3) the event loop polls: the start time if it is known, else `kill(pid, 0)`. There `ESRCH`
//! means gone, success means alive, and `EPERM` (a process is there that this one may not
//! signal) means gone if the importer ran as this process's user (its own process would be
//! signalable, so the pid has been reused), and *cannot tell* otherwise: such an importer counts
//! as alive until the exporter shuts down, when its buffers are abandoned, never freed while it
//! may use them.

use std::os::fd::OwnedFd;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags};

/// A process's identity: its pid and its start time (a pid is reused, the pair is not in
/// practice).
pub(crate) type ProcessKey = (i32, u64);

/// An importer's process, as remembered when its handshake completed.
#[derive(Debug)]
pub(crate) struct ProcessRef {
    pid: i32,
    uid: u32,
    start: Option<u64>,
    pidfd: Option<OwnedFd>,
}

/// How to learn that an importer's process is gone.
#[derive(Debug)]
pub(crate) enum Watch {
    /// It is gone already.
    Gone,
    /// Readable once it exits.
    Pidfd(OwnedFd),
    /// Ask [`ProcessRef::alive`] from time to time.
    Poll(ProcessRef),
}

/// What polling found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Liveness {
    Alive,
    Gone,
    /// `EPERM` for another user's importer without `/proc` or pidfds: counted as alive.
    CannotTell,
}

impl ProcessRef {
    /// Remembers the process `pid` (running as `uid`) that just connected.
    pub(crate) fn remember(pid: i32, uid: u32) -> ProcessRef {
        let start = start_time(pid);
        let pidfd = match start {
            Some(_) => None,
            None => Pid::from_raw(pid).and_then(|p| rustix::process::pidfd_open(p, PidfdFlags::empty()).ok()),
        };
        ProcessRef { pid, uid, start, pidfd }
    }

    /// The process's pid and start time, when the start time is known: two importers with the
    /// same key are the same process, and one watch serves both. `None` without `/proc` (then
    /// each importer has a pidfd of its own, opened when it connected).
    pub(crate) fn key(&self) -> Option<ProcessKey> {
        match (self.start, &self.pidfd) {
            (Some(start), None) => Some((self.pid, start)),
            _ => None,
        }
    }

    /// The connection ended uncleanly: how to watch for the process's end.
    pub(crate) fn watch(mut self) -> Watch {
        if let Some(fd) = self.pidfd.take() {
            return Watch::Pidfd(fd);
        }
        let Some(start) = self.start else {
            return Watch::Poll(self);
        };
        let Some(pid) = Pid::from_raw(self.pid) else {
            return Watch::Gone;
        };
        match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            // The pidfd names whatever process has the pid now: the importer only if its start
            // time is still the same (read after opening, so the pidfd cannot name a later one).
            Ok(fd) => match start_time(self.pid) {
                Some(now) if now == start => Watch::Pidfd(fd),
                _ => Watch::Gone,
            },
            Err(Errno::SRCH) => Watch::Gone,
            Err(_) => Watch::Poll(self),
        }
    }

    /// Whether the process is still there (for [`Watch::Poll`]).
    pub(crate) fn alive(&self) -> Liveness {
        if let Some(start) = self.start {
            return match start_time(self.pid) {
                Some(now) if now == start => Liveness::Alive,
                Some(_) => Liveness::Gone,
                // No such process any more (or /proc went away: then fall through to kill).
                None if proc_available() => Liveness::Gone,
                None => self.alive_by_kill(),
            };
        }
        self.alive_by_kill()
    }

    fn alive_by_kill(&self) -> Liveness {
        let Some(pid) = Pid::from_raw(self.pid) else {
            return Liveness::Gone;
        };
        match rustix::process::test_kill_process(pid) {
            Ok(()) => Liveness::Alive,
            Err(Errno::SRCH) => Liveness::Gone,
            Err(Errno::PERM) if self.uid == rustix::process::geteuid().as_raw() => Liveness::Gone,
            Err(_) => Liveness::CannotTell,
        }
    }
}

fn proc_available() -> bool {
    std::path::Path::new("/proc/self/stat").exists()
}

/// Field 22 of `/proc/PID/stat` (start time in clock ticks since boot), if readable.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// The start time in a `/proc/PID/stat` line. The command name (field 2) is in parentheses and
/// may hold spaces and parentheses itself, so fields are counted after the last `)`.
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // Fields 3.. follow; the start time is field 22.
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}
