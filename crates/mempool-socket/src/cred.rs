//! Who is on the other end of a socket (`SO_PEERCRED`), and whether they may talk to us.
//!
//! The kernel records the peer's credentials when the connection is made; the peer cannot
//! forge them. By default only the same user may connect ([`AccessPolicy::SameUser`]); an
//! explicit allow-list of uids replaces that ([`AccessPolicy::AllowUids`]). The socket file's
//! permissions (0600 by default, see `listener`) are the first gate; this is the second, and it
//! also lets an importer check the exporter. Everything here is re-exported at the crate root.

use std::os::fd::AsFd;

use crate::error::{Error, Result};

/// The credentials of the process at the other end of a Unix socket, as the kernel recorded
/// them when it connected.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PeerCredentials {
    /// Process id; its pid may be reused after it exits, so use it for logs, not identity.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Reads the peer's credentials with `SO_PEERCRED`.
///
/// A peer in another pid namespace (a container that shares the socket but not the pid
/// namespace) is reported by the kernel with pid 0: its process cannot be named here, so the
/// exporter could not wait for it to exit before freeing what it held. This returns
/// [`Error::ForeignPidNamespace`] for it, a clean refusal.
///
/// See [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html).
///
/// ```
/// use std::os::unix::net::UnixStream;
/// use mempool_socket::{peer_credentials, AccessPolicy};
///
/// let (a, _b) = UnixStream::pair()?;
/// let creds = peer_credentials(&a)?;
/// AccessPolicy::SameUser.check(&creds)?;
/// assert!(AccessPolicy::allow_uids([creds.uid + 1]).check(&creds).is_err());
/// # Ok::<(), mempool_socket::Error>(())
/// ```
pub fn peer_credentials(socket: impl AsFd) -> Result<PeerCredentials> {
    let raw = raw_peercred(socket.as_fd())?;
    credentials_from(raw.pid, raw.uid, raw.gid)
}

/// The credentials `SO_PEERCRED` reported, or the refusal of a pid it could not name (0).
fn credentials_from(pid: i32, uid: u32, gid: u32) -> Result<PeerCredentials> {
    if pid <= 0 {
        return Err(Error::ForeignPidNamespace { uid });
    }
    Ok(PeerCredentials { pid, uid, gid })
}

/// `getsockopt(SO_PEERCRED)` into a plain `struct ucred` (rustix's `UCred` holds a non-zero pid
/// type, which a pid of 0 cannot be written into).
#[allow(unsafe_code)]
fn raw_peercred(socket: std::os::fd::BorrowedFd<'_>) -> Result<libc::ucred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `socket` is an open descriptor (borrowed for the call); `cred` is a writable
    // `struct ucred` of `len` bytes, which is what `SO_PEERCRED` writes (every bit pattern of its
    // three integers is valid), and `len` is a writable `socklen_t`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other(format!("SO_PEERCRED returned {len} bytes, expected a struct ucred")).into());
    }
    Ok(cred)
}

/// `SO_PEERPIDFD`'s value (Linux 6.5+): 77 on every architecture Rust targets but SPARC.
#[cfg(not(any(target_arch = "sparc", target_arch = "sparc64")))]
const SO_PEERPIDFD: libc::c_int = 77;
#[cfg(any(target_arch = "sparc", target_arch = "sparc64"))]
const SO_PEERPIDFD: libc::c_int = 0x56;

/// A pidfd of the process at the other end of a Unix socket, the one that connected (the process
/// `SO_PEERCRED` names), with `SO_PEERPIDFD` (Linux 6.5+): unlike `pidfd_open` of that pid it
/// cannot name another process that took the pid after the peer exited.
///
/// `Ok(None)` if the kernel does not know the option (`ENOPROTOOPT`): the caller falls back to
/// the pid. `Err` with `ESRCH` when the process is gone (the kernel's `ESRCH`, or `EINVAL`, which
/// Linux 6.5+ returns for a peer already reaped); any other error as the kernel gave it.
#[allow(unsafe_code)]
pub fn peer_pidfd(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `socket` is an open descriptor (borrowed for the call); `fd` is a writable `int`
    // of `len` bytes, which is what `SO_PEERPIDFD` writes, and `len` is a writable `socklen_t`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return match err.raw_os_error() {
            // Only a kernel without the option says ENOPROTOOPT; from Linux 6.5 on, EINVAL means
            // the peer was already reaped: gone, as ESRCH (not a reason to look it up by a pid that
            // may have been reused).
            Some(libc::ENOPROTOOPT) => Ok(None),
            Some(libc::EINVAL) => Err(std::io::Error::from_raw_os_error(libc::ESRCH)),
            _ => Err(err),
        };
    }
    if len as usize != std::mem::size_of::<libc::c_int>() || fd < 0 {
        return Err(std::io::Error::other(format!(
            "SO_PEERPIDFD returned {len} bytes and descriptor {fd}, expected an int and a descriptor"
        )));
    }
    // SAFETY: on success the kernel installed `fd` as a new descriptor of this process (a
    // pidfd) and handed it to the caller: nothing else owns or closes it.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Which peers may connect.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub enum AccessPolicy {
    /// Only processes running as this process's effective uid (the default).
    #[default]
    SameUser,
    /// Exactly these uids, and no other; this process's own uid only if listed.
    ///
    /// The socket file's mode must let those users in, too (see
    /// [`ListenerOptions::mode`](crate::ListenerOptions::mode)).
    AllowUids(Vec<u32>),
}

impl AccessPolicy {
    /// An allow-list of uids.
    pub fn allow_uids(uids: impl IntoIterator<Item = u32>) -> AccessPolicy {
        AccessPolicy::AllowUids(uids.into_iter().collect())
    }

    /// Whether a peer running as `uid` may connect.
    pub fn allows(&self, uid: u32) -> bool {
        match self {
            AccessPolicy::SameUser => uid == rustix::process::geteuid().as_raw(),
            AccessPolicy::AllowUids(uids) => uids.contains(&uid),
        }
    }

    /// `Ok` if the peer may connect, [`Error::PeerCredentials`] otherwise.
    pub fn check(&self, peer: &PeerCredentials) -> Result<()> {
        if self.allows(peer.uid) {
            Ok(())
        } else {
            Err(Error::PeerCredentials {
                uid: peer.uid,
                pid: peer.pid,
            })
        }
    }

    /// Reads the credentials of the peer of `socket` and checks them.
    pub fn check_socket(&self, socket: impl AsFd) -> Result<PeerCredentials> {
        let peer = peer_credentials(socket)?;
        self.check(&peer)?;
        Ok(peer)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    fn own_uid() -> u32 {
        rustix::process::geteuid().as_raw()
    }

    #[test]
    fn credentials_of_a_socket_pair_are_our_own() {
        let (a, _b) = UnixStream::pair().unwrap();
        let creds = peer_credentials(&a).unwrap();
        assert_eq!(creds.uid, own_uid());
        assert_eq!(creds.gid, rustix::process::getegid().as_raw());
        assert_eq!(creds.pid, std::process::id() as i32);
    }

    /// The pid a pidfd refers to, from `/proc/self/fdinfo`.
    fn pid_of_pidfd(fd: &std::os::fd::OwnedFd) -> i32 {
        use std::os::fd::AsRawFd;
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("Pid:"))
            .expect("a pidfd's fdinfo has a Pid line")
            .trim()
            .parse()
            .unwrap()
    }

    /// Whether this kernel is at least `major.minor`.
    fn kernel_at_least(major: u32, minor: u32) -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut parts = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
    }

    #[test]
    fn peer_pidfd_names_the_connecting_process() {
        use std::os::fd::AsFd;
        let (a, _b) = UnixStream::pair().unwrap();
        match peer_pidfd(a.as_fd()).unwrap() {
            Some(fd) => assert_eq!(pid_of_pidfd(&fd), std::process::id() as i32),
            None => assert!(!kernel_at_least(6, 5), "Linux 6.5 and later know SO_PEERPIDFD"),
        }
    }

    #[test]
    fn policy_accepts_own_uid_and_rejects_outside_the_allow_list() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(AccessPolicy::SameUser.check_socket(&a).unwrap().uid, own_uid());
        assert!(AccessPolicy::allow_uids([own_uid(), 12345]).check_socket(&a).is_ok());
        let err = AccessPolicy::allow_uids([own_uid().wrapping_add(1)])
            .check_socket(&a)
            .unwrap_err();
        assert!(
            matches!(err, Error::PeerCredentials { uid, pid } if uid == own_uid() && pid == std::process::id() as i32),
            "{err}"
        );
        // An empty allow-list allows nobody, not even this user.
        assert!(!AccessPolicy::allow_uids([]).allows(own_uid()));
        assert!(!AccessPolicy::SameUser.allows(own_uid().wrapping_add(1)));
    }

    #[test]
    fn a_peer_in_another_pid_namespace_is_refused_by_name() {
        // What SO_PEERCRED reports for such a peer: pid 0.
        let err = credentials_from(0, 1000, 1000).unwrap_err();
        assert!(matches!(err, Error::ForeignPidNamespace { uid: 1000 }), "{err}");
        assert!(err.to_string().contains("another pid namespace"), "{err}");
        assert_eq!(
            credentials_from(42, 1, 2).unwrap(),
            PeerCredentials {
                pid: 42,
                uid: 1,
                gid: 2
            }
        );
    }
}
