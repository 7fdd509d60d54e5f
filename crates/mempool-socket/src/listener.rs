//! A listening Unix socket (the exporter's, the memory store's server's): a socket file that is never reachable with wider
//! permissions than asked for, and peers checked before a byte is read from them.
//!
//! Binding a Unix socket creates its file with the process umask, and changing the mode
//! afterwards leaves a window in which other users could connect. Changing the umask around
//! `bind` is no answer either: it is process-wide, so other threads would create files with
//! it. Instead [`Listener::bind`]:
//!
//! 1. creates a private directory (mode 0700) next to the target path;
//! 2. binds the socket inside it and sets the socket file's mode (0600 by default) there,
//!    where no other user can reach it;
//! 3. renames it onto the target path with `RENAME_NOREPLACE` (or a hard link where the file
//!    system lacks that), so an existing file is never clobbered;
//! 4. removes the private directory.
//!
//! A file already at the target path is removed first only if it is a socket and nobody
//! answers on it (a stale socket of a dead exporter); a live socket or any other kind of file
//! is an error. When the [`Listener`] is dropped it removes its socket file, if the path still
//! names that file.
//!
//! [`ListenerOptions`] (the mode, who may connect, whether a stale socket is replaced, the time
//! limits of accepted connections) is public, as a field of mempool-ipc's `ExporterOptions`; the
//! tests (`listener/tests.rs`) check every case above on real files.

use std::fs;
use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{RenameFlags, CWD};
use rustix::io::Errno;

use crate::cred::{AccessPolicy, PeerCredentials};
use crate::error::{Error, Result};

/// The time limits of a connection (between an exporter and an importer).
///
/// A peer that connects and says nothing costs the other side one `handshake_timeout`; one that
/// starts a frame and stalls, or stops reading, costs one `io_timeout`. Waiting for the next
/// message after the handshake has no limit (an idle importer is legitimate).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ConnectionOptions {
    /// How long a frame may take to arrive once its first byte has, and how long a send may
    /// wait for room in the socket. Default: 10 s.
    pub io_timeout: Duration,
    /// How long the whole handshake may take, from accept (or connect) to the pool
    /// descriptor. Default: 5 s.
    pub handshake_timeout: Duration,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        ConnectionOptions {
            io_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// How the exporter's listening socket is made and who may connect to it.
///
/// The socket file never exists with wider permissions than `mode`: it is bound in a private
/// directory (0700) next to the path, given its mode there and moved into place without
/// replacing anything. A file already at the path is removed only if it is a socket that
/// nobody answers on (a crashed exporter's), and only with `replace_stale`; a live socket or
/// any other file is an error. Every accepted connection is checked against `policy`
/// (`SO_PEERCRED`) before a byte is read from it.
#[derive(Clone, Debug)]
pub struct ListenerOptions {
    /// The socket file's permission bits; only `0o777` bits are allowed. Default `0o600`:
    /// only the owner can connect. Widen it (`0o660` and a shared group, say) together with an
    /// [`AccessPolicy::AllowUids`] to let other users in.
    pub mode: u32,
    /// Who may connect, checked with `SO_PEERCRED` on every accepted connection.
    pub policy: AccessPolicy,
    /// Whether a stale socket file (one nobody answers on) at the path is replaced.
    /// Default `true`.
    pub replace_stale: bool,
    /// The time limits of accepted connections.
    pub connection: ConnectionOptions,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        ListenerOptions {
            mode: 0o600,
            policy: AccessPolicy::SameUser,
            replace_stale: true,
            connection: ConnectionOptions::default(),
        }
    }
}

/// A listening Unix socket that checks its peers. See the [module documentation](self).
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file we created, so that drop removes only our file.
    file_id: (u64, u64),
    policy: AccessPolicy,
    connection: ConnectionOptions,
}

impl Listener {
    /// Binds at `path` with the default options: mode 0600, same user only.
    pub fn bind(path: impl AsRef<Path>) -> Result<Listener> {
        Listener::bind_with(path, ListenerOptions::default())
    }

    /// Binds at `path` with `options`.
    pub fn bind_with(path: impl AsRef<Path>, options: ListenerOptions) -> Result<Listener> {
        let path = path.as_ref();
        let path_error = |reason| Error::SocketPath {
            path: path.to_owned(),
            reason,
        };
        if options.mode & !0o777 != 0 {
            return Err(path_error("mode may only hold permission bits (0o777)"));
        }
        let name = path.file_name().ok_or_else(|| path_error("the path names no file"))?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };

        clear_stale(path, options.replace_stale)?;

        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let private_dir = parent.join(format!(
            ".{}.{}.{}.tmp",
            name.to_string_lossy(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        // The umask can only take bits away from 0700.
        fs::DirBuilder::new().mode(0o700).create(&private_dir)?;
        let private_sock = private_dir.join("s");
        let bound = (|| {
            let listener = UnixListener::bind(&private_sock)?;
            fs::set_permissions(&private_sock, fs::Permissions::from_mode(options.mode))?;
            move_no_replace(&private_sock, path)?;
            Ok::<_, Error>(listener)
        })();
        let _ = fs::remove_file(&private_sock);
        let _ = fs::remove_dir(&private_dir);
        let listener = bound?;
        let meta = fs::symlink_metadata(path)?;
        Ok(Listener {
            listener,
            path: path.to_owned(),
            file_id: (meta.dev(), meta.ino()),
            policy: options.policy,
            connection: options.connection,
        })
    }

    /// The socket file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for a connection and checks the peer against the access policy: a peer it refuses
    /// is returned with [`Error::PeerCredentials`] (or [`Error::ForeignPidNamespace`]), for the
    /// caller to tell it why in its protocol; keep accepting after it.
    pub fn accept(&self) -> Result<(UnixStream, PeerCredentials), Refused> {
        let (stream, _addr) = self.listener.accept().map_err(|e| Refused::without_stream(e.into()))?;
        let peer = match crate::cred::peer_credentials(&stream) {
            Ok(peer) => peer,
            Err(error) => {
                return Err(Refused {
                    stream: Some(stream),
                    error,
                })
            }
        };
        match self.policy.check(&peer) {
            Ok(()) => Ok((stream, peer)),
            Err(error) => Err(Refused {
                stream: Some(stream),
                error,
            }),
        }
    }

    /// Like [`Listener::accept`], but fails with [`Error::Timeout`] if nobody connects within
    /// `timeout`. (If several threads accept on one listener, one of them may still block.)
    pub fn accept_timeout(&self, timeout: Duration) -> Result<(UnixStream, PeerCredentials), Refused> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let timed_out = || Refused::without_stream(Error::Timeout { during: "accept" });
            if left.is_zero() {
                return Err(timed_out());
            }
            let left = Timespec::try_from(left).map_err(|_| timed_out())?;
            let mut fds = [PollFd::new(&self.listener, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&left)) {
                Ok(0) | Err(Errno::INTR) => continue,
                Ok(_) => return self.accept(),
                Err(errno) => return Err(Refused::without_stream(errno.into())),
            }
        }
    }

    /// Accepts one waiting connection without checking it (the exporter's event loop checks
    /// it, [`Listener::policy`]); `WouldBlock` once none waits, after [`Listener::set_nonblocking`].
    pub fn accept_stream(&self) -> std::io::Result<UnixStream> {
        self.listener.accept().map(|(stream, _)| stream)
    }

    /// Makes [`Listener::accept_stream`] return at once when no connection waits.
    pub fn set_nonblocking(&self) -> Result<()> {
        Ok(self.listener.set_nonblocking(true)?)
    }

    /// Who may connect.
    pub fn policy(&self) -> &AccessPolicy {
        &self.policy
    }

    /// The time limits of accepted connections.
    pub fn connection_options(&self) -> ConnectionOptions {
        self.connection
    }
}

/// A connection [`Listener::accept`] did not admit, or a failure to accept one.
#[derive(Debug)]
pub struct Refused {
    /// The refused peer's connection, to tell it why before closing it (none if accepting failed).
    pub stream: Option<UnixStream>,
    /// Why.
    pub error: Error,
}

impl Refused {
    fn without_stream(error: Error) -> Refused {
        Refused { stream: None, error }
    }
}

impl From<Refused> for Error {
    fn from(refused: Refused) -> Error {
        refused.error
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Only if the path still names our socket: another exporter may have replaced it.
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.file_id {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// Makes room at `path`: nothing there is fine; a socket nobody answers on is removed (if
/// allowed); anything else is an error.
fn clear_stale(path: &Path, replace_stale: bool) -> Result<()> {
    let path_error = |reason| Error::SocketPath {
        path: path.to_owned(),
        reason,
    };
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if !meta.file_type().is_socket() {
        return Err(path_error("a file that is not a socket is in the way"));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(path_error("another process is listening on it")),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            if !replace_stale {
                return Err(path_error("a stale socket is in the way"));
            }
            match fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// Moves `from` to `to`, failing if `to` exists.
fn move_no_replace(from: &Path, to: &Path) -> Result<()> {
    let exists = || Error::SocketPath {
        path: to.to_owned(),
        reason: "a file appeared at the path while binding",
    };
    match rustix::fs::renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(Errno::EXIST) => Err(exists()),
        // Some file systems lack RENAME_NOREPLACE; a hard link also refuses to replace.
        Err(Errno::INVAL) | Err(Errno::NOSYS) | Err(Errno::OPNOTSUPP) => match fs::hard_link(from, to) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(exists()),
            Err(e) => Err(e.into()),
        },
        Err(errno) => Err(errno.into()),
    }
}

#[cfg(test)]
mod tests;
