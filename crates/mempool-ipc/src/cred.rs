//! Who is on the other end of a socket (`SO_PEERCRED`), and whether they may talk to us.
//!
//! The kernel records the peer's credentials when the connection is made; the peer cannot
//! forge them. By default only the same user may connect ([`AccessPolicy::SameUser`]); an
//! explicit allow-list of uids replaces that ([`AccessPolicy::AllowUids`]). The socket file's
//! permissions (0600 by default, see [`Listener`](crate::Listener)) are the first gate; this is
//! the second, and it also lets an importer check the exporter.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use mempool_ipc::cred::{peer_credentials, AccessPolicy};
//!
//! let (a, _b) = UnixStream::pair()?;
//! let creds = peer_credentials(&a)?;
//! AccessPolicy::SameUser.check(&creds)?;
//! assert!(AccessPolicy::allow_uids([creds.uid + 1]).check(&creds).is_err());
//! # Ok::<(), mempool_ipc::Error>(())
//! ```

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
/// Known limit: for a peer in another pid namespace the kernel reports pid 0, which rustix
/// 1.1's `UCred` (a non-zero `Pid`) cannot represent; such peers (containers that share the
/// socket but not the pid namespace) are not supported until that is fixed upstream or this
/// call moves to a raw `getsockopt`.
///
/// See [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html).
pub fn peer_credentials(socket: impl AsFd) -> Result<PeerCredentials> {
    let ucred = rustix::net::sockopt::socket_peercred(socket)?;
    Ok(PeerCredentials {
        pid: ucred.pid.as_raw_nonzero().get(),
        uid: ucred.uid.as_raw(),
        gid: ucred.gid.as_raw(),
    })
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
    /// [`ListenerOptions::mode`](crate::listener::ListenerOptions::mode)).
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
