//! File descriptors over Unix stream sockets (`SCM_RIGHTS`).
//!
//! One call sends some bytes and up to [`SCM_MAX_FD`] descriptors in one `sendmsg`; the kernel
//! attaches the descriptors to the first byte. One call receives with `recvmsg`, with room for
//! [`SCM_MAX_FD`] descriptors so that it can always count what arrived:
//!
//! - received descriptors are close-on-exec from the moment they exist (`MSG_CMSG_CLOEXEC`),
//!   so a concurrent `fork` + `exec` elsewhere in the process cannot leak them;
//! - they arrive as [`OwnedFd`]s: whatever the caller does not keep is closed when dropped;
//! - more descriptors than the caller allows: all of them are closed and the call fails with
//!   [`Error::DescriptorCount`].
//!
//! [`frame_io`](crate::frame_io), the socket I/O of both protocols' connections, uses the raw calls
//! [`send_raw`] and [`recv_raw`] with [`FdTally`]'s count; [`send_with_fds`] and [`recv_with_fds`]
//! apply the policy above (the tests' senders and receivers).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};

/// The most descriptors one `sendmsg` can carry on Linux (`SCM_MAX_FD`).
pub const SCM_MAX_FD: usize = 253;

const CONTROL_SPACE: usize = rustix::cmsg_space!(ScmRights(SCM_MAX_FD));

/// Sends `bytes` with `fds` attached, in one `sendmsg` (`MSG_NOSIGNAL`: a closed peer is
/// [`Error::Closed`], not `SIGPIPE`). Returns how many bytes went out, which on a stream socket
/// may be fewer than `bytes.len()`; the descriptors went with the first of them.
///
/// The descriptors are borrowed: the peer receives duplicates, the caller keeps its own.
/// Blocks if the socket is blocking and its buffer is full.
///
/// See [sendmsg(2)](https://man7.org/linux/man-pages/man2/sendmsg.2.html) and
/// [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html).
pub fn send_with_fds(socket: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<usize> {
    check_send(bytes, fds)?;
    retry_intr(|| send_raw(socket.as_fd(), bytes, fds, SendFlags::empty())).map_err(Error::from)
}

/// Receives up to `buf.len()` bytes and the descriptors that came with them, in one `recvmsg`.
///
/// Returns the number of bytes (0: the peer closed the connection) and the descriptors, at
/// most `max_fds` of them; they are close-on-exec. If more arrived, all are closed and the call
/// fails with [`Error::DescriptorCount`]. Blocks if the socket is blocking and nothing is there.
///
/// See [recvmsg(2)](https://man7.org/linux/man-pages/man2/recvmsg.2.html).
pub fn recv_with_fds(socket: impl AsFd, buf: &mut [u8], max_fds: usize) -> Result<(usize, Vec<OwnedFd>)> {
    let received = retry_intr(|| recv_raw(socket.as_fd(), buf, RecvFlags::empty()))?;
    received.into_checked(max_fds, 0)
}

/// Checks what [`send_with_fds`] is given: at most [`SCM_MAX_FD`] descriptors, and a byte to carry them.
pub fn check_send(bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > SCM_MAX_FD {
        return Err(Error::DescriptorCount {
            expected: SCM_MAX_FD,
            got: fds.len(),
        });
    }
    if bytes.is_empty() && !fds.is_empty() {
        // A stream socket sends nothing for zero bytes, so the descriptors would not go.
        return Err(Error::Violation {
            reason: "descriptors must travel with at least one byte".into(),
        });
    }
    Ok(())
}

/// Runs `f` again while it fails with `EINTR`.
pub fn retry_intr<T>(mut f: impl FnMut() -> rustix::io::Result<T>) -> rustix::io::Result<T> {
    loop {
        match f() {
            Err(Errno::INTR) => continue,
            other => return other,
        }
    }
}

/// One `sendmsg`; `flags` gets `MSG_NOSIGNAL` added. At most [`SCM_MAX_FD`] descriptors, and
/// some bytes for them to ride on (the connection sends whole frames; the tests' callers run
/// `check_send`).
pub fn send_raw(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); CONTROL_SPACE];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        // `check_send` bounded the count, and the buffer has room for that many.
        return Err(Errno::NOBUFS);
    }
    sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        flags | SendFlags::NOSIGNAL,
    )
}

/// What one `recvmsg` brought, before any policy on the number of descriptors.
#[derive(Debug)]
pub struct RawReceived {
    /// The bytes received (0: the peer closed the connection).
    pub bytes: usize,
    /// Every descriptor that came with them, close-on-exec.
    pub fds: Vec<OwnedFd>,
    /// The kernel had to drop control data (it closed the descriptors that did not fit).
    pub control_truncated: bool,
}

impl RawReceived {
    /// Applies the limit: `already` descriptors were received earlier for the same message,
    /// at most `max_fds` may arrive in all. On error, every descriptor of this call is closed
    /// (dropped); the caller drops the earlier ones.
    pub fn into_checked(self, max_fds: usize, already: usize) -> Result<(usize, Vec<OwnedFd>)> {
        let total = already + self.fds.len();
        if self.control_truncated {
            return Err(Error::DescriptorCount {
                expected: max_fds,
                // The kernel closed the ones that did not fit: more than we could count.
                got: total.max(max_fds) + 1,
            });
        }
        if total > max_fds {
            return Err(Error::DescriptorCount {
                expected: max_fds,
                got: total,
            });
        }
        Ok((self.bytes, self.fds))
    }
}

/// The descriptors that arrived while one frame was read, counted exactly against what the
/// frame's type carries.
///
/// The type is known only once the frame's header is in, but descriptors ride on its first byte:
/// until then at most `MAX_FDS_PER_MESSAGE` are kept and any more are closed at once (still
/// counted), so a hostile peer cannot make the reader hold more than that; the error then names
/// the number the message type carries ("expected 0" for a message that carries none).
#[derive(Debug, Default)]
pub struct FdTally {
    kept: Vec<OwnedFd>,
    count: usize,
    /// The kernel dropped control data: more arrived than could be counted.
    truncated: bool,
}

impl FdTally {
    /// Adds what one `recvmsg` brought; keeps at most `limit` in all, closes the rest.
    pub fn add(&mut self, received: Vec<OwnedFd>, control_truncated: bool, limit: usize) {
        self.count += received.len();
        self.truncated |= control_truncated;
        for fd in received {
            if self.kept.len() < limit {
                self.kept.push(fd);
            }
        }
    }

    /// How many arrived so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Checks the count against `expected`, the number the message type carries: more is an
    /// error at any time, fewer once the frame is `complete`.
    pub fn check(&self, expected: usize, complete: bool) -> Result<()> {
        let got = if self.truncated {
            self.count.max(SCM_MAX_FD) + 1
        } else {
            self.count
        };
        if got > expected || (complete && got != expected) {
            return Err(Error::DescriptorCount { expected, got });
        }
        Ok(())
    }

    /// The descriptors, once [`FdTally::check`] passed on the complete frame.
    pub fn take(&mut self) -> Vec<OwnedFd> {
        self.count = 0;
        std::mem::take(&mut self.kept)
    }
}

/// One `recvmsg` with `MSG_CMSG_CLOEXEC` added to `flags`; collects every descriptor.
pub fn recv_raw(socket: BorrowedFd<'_>, buf: &mut [u8], flags: RecvFlags) -> rustix::io::Result<RawReceived> {
    let mut space = [MaybeUninit::<u8>::uninit(); CONTROL_SPACE];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg(socket, &mut iov, &mut control, flags | RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    Ok(RawReceived {
        bytes: msg.bytes,
        fds,
        control_truncated: msg.flags.contains(ReturnFlags::CTRUNC),
    })
}

#[cfg(test)]
mod tests;
