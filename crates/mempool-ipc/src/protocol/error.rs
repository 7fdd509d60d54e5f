//! [`ProtocolError`]: what decoding (and the checks before encoding) reports.

use super::ids::MessageType;

/// What the functions of the wire modules return: a [`ProtocolError`] names what broke the rules.
pub(crate) type Result<T, E = ProtocolError> = std::result::Result<T, E>;

/// A frame or message that breaks the rules of the protocol: what decoding reports (and the
/// checks made before encoding, and a connection whose peer stopped inside a frame).
///
/// The crate's [`Error`](crate::Error) wraps it as `Error::Protocol`, with the same message.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A field breaks its rule (reserved bits, flags, sizes, offsets, UTF-8, all-zero ids), or
    /// the peer broke a rule that no more specific variant describes.
    #[error("protocol violation: {reason}")]
    Violation {
        /// What the peer did wrong.
        reason: String,
    },

    /// A frame did not start with the protocol's magic bytes: the peer does not speak this protocol.
    #[error("bad magic {got:02x?}: the peer does not speak the mempool IPC protocol")]
    BadMagic {
        /// The four bytes found where the magic should be.
        got: [u8; 4],
    },

    /// The peer speaks another version of the protocol.
    #[error("unsupported protocol version {got} (this side speaks version {supported})")]
    UnsupportedVersion {
        /// The version in the peer's frame.
        got: u16,
        /// The version this side speaks.
        supported: u16,
    },

    /// A frame carried a message type this version does not define.
    #[error("unknown message type {got}")]
    UnknownMessageType {
        /// The type code found in the frame header.
        got: u16,
    },

    /// A frame announced a body larger than any message may be.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// Input ended before the message did (in a byte slice, or the peer closed mid-message).
    #[error("truncated message: needed {needed} bytes, got {got}")]
    Truncated {
        /// How many bytes the message needs (as far as known when it ended).
        needed: usize,
        /// How many bytes there were.
        got: usize,
    },

    /// A frame's body length does not fit its message type.
    #[error("{message} message with a body of {got} bytes (allowed: {})", allowed_len(*.min, *.max))]
    BodyLength {
        /// The message type.
        message: MessageType,
        /// The smallest body the type allows.
        min: usize,
        /// The largest body the type allows.
        max: usize,
        /// The body length found.
        got: usize,
    },

    /// Bytes followed the end of a complete frame in a slice that should hold exactly one.
    #[error("{len} trailing bytes after a complete message")]
    TrailingBytes {
        /// How many bytes were left over.
        len: usize,
    },
}

fn allowed_len(min: usize, max: usize) -> String {
    if min == max {
        format!("exactly {min}")
    } else {
        format!("{min} to {max}")
    }
}

/// A read past the end of a frame's bytes (mempool-socket's shared `frame::Reader`).
impl From<mempool_socket::frame::Truncated> for ProtocolError {
    fn from(t: mempool_socket::frame::Truncated) -> Self {
        ProtocolError::Truncated {
            needed: t.needed(),
            got: t.len,
        }
    }
}

/// A [`ProtocolError::Violation`] with this reason.
pub(crate) fn protocol(reason: impl Into<String>) -> ProtocolError {
    ProtocolError::Violation { reason: reason.into() }
}
