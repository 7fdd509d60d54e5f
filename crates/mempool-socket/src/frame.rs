//! The framing both of mempool's socket protocols share (mempool-ipc's exporter protocol, magic
//! `MPIP`, and mempool-store's, magic `MPMS`), and the bounds-checked cursor their codecs read and
//! write bodies with. Each protocol keeps its own messages and its own checks of what a header's
//! fields may be; this layer only knows the layout:
//!
//! ```text
//! offset 0   4 bytes  magic (the protocol's)
//! offset 4   u16      protocol version
//! offset 6   u16      message type
//! offset 8   u32      body length in bytes
//! offset 12           the body
//! ```
//!
//! All integers are little-endian. A [`Reader`] never reads past its bytes: every read returns
//! [`Truncated`] instead, which each protocol turns into its own error. Bytes from a peer are
//! hostile input: the header's body length is a claim to check against the protocol's limit before
//! anything is allocated for it, and a body is decoded only once it is whole.
//!
//! ```
//! use mempool_socket::frame::{self, Header, Reader, Writer};
//!
//! let mut bytes = Vec::new();
//! let mut w = Writer::frame_into(&mut bytes, *b"TEST", 1, 7);
//! w.u32(42);
//! w.bytes(b"hi");
//! w.end();
//! let header = Header::parse(&bytes).unwrap();
//! assert_eq!((header.magic, header.version, header.kind, header.body_len), (*b"TEST", 1, 7, 6));
//! let mut r = Reader::new(&bytes[frame::HEADER_LEN..]);
//! assert_eq!(r.u32(), Ok(42));
//! assert_eq!(r.take(2), Ok(&b"hi"[..]));
//! assert!(r.u8().is_err()); // past the end: an error, never a panic
//! ```

/// The length of a frame's header.
pub const HEADER_LEN: usize = 12;

/// A header's fields as they arrived, not yet checked against a protocol.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Header {
    /// The protocol's magic bytes.
    pub magic: [u8; 4],
    /// The protocol version the frame is in.
    pub version: u16,
    /// The message type's code.
    pub kind: u16,
    /// The body's length, as the sender claims it.
    pub body_len: u32,
}

impl Header {
    /// Reads the header at the start of `bytes` (which may go on past it).
    pub fn parse(bytes: &[u8]) -> Result<Header, Truncated> {
        let mut r = Reader::new(bytes);
        Ok(Header {
            magic: r.array()?,
            version: r.u16()?,
            kind: r.u16()?,
            body_len: r.u32()?,
        })
    }
}

/// A read past the end of the bytes: `wanted` bytes at offset `at` of `len`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Truncated {
    /// Where the read started.
    pub at: usize,
    /// How many bytes it wanted.
    pub wanted: usize,
    /// How many bytes there were in all.
    pub len: usize,
}

impl Truncated {
    /// How many bytes in all the read needed.
    pub fn needed(&self) -> usize {
        self.at.saturating_add(self.wanted)
    }

    /// How many bytes were left where the read started.
    pub fn left(&self) -> usize {
        self.len.saturating_sub(self.at)
    }
}

impl std::fmt::Display for Truncated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cut short: {} bytes needed, {} left", self.wanted, self.left())
    }
}

impl std::error::Error for Truncated {}

/// A cursor over a byte slice whose reads fail (never panic) past the end.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    /// How many bytes are left to read.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Truncated> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(Truncated {
                at: self.pos,
                wanted: n,
                len: self.bytes.len(),
            });
        };
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// The next byte.
    pub fn u8(&mut self) -> Result<u8, Truncated> {
        Ok(self.array::<1>()?[0])
    }

    /// The next little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, Truncated> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// The next little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, Truncated> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// The next little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, Truncated> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

/// Appends little-endian fields to a buffer; [`Writer::frame_into`] starts a frame whose header's
/// body length [`Writer::end`] fills in.
#[derive(Debug)]
pub struct Writer<'a> {
    out: &'a mut Vec<u8>,
    /// Where the frame's header starts, for a writer made by `frame_into`.
    header_at: Option<usize>,
}

impl<'a> Writer<'a> {
    /// A writer appending fields to `out`, without a header.
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        Writer { out, header_at: None }
    }

    /// A frame of `magic`, `version` and `kind` appended to `out`; [`Writer::end`] fills in the
    /// body length.
    pub fn frame_into(out: &'a mut Vec<u8>, magic: [u8; 4], version: u16, kind: u16) -> Self {
        let mut w = Writer::new(out);
        w.header_at = Some(w.out.len());
        w.bytes(&magic);
        w.u16(version);
        w.u16(kind);
        w.u32(0);
        w
    }

    /// The body's length so far (of a frame; else everything written).
    pub fn body_len(&self) -> usize {
        let start = self.header_at.map_or(0, |at| at + HEADER_LEN);
        self.out.len() - start
    }

    /// Fills in the header's body length (of a frame; else nothing to do).
    pub fn end(mut self) {
        self.patch_len();
    }

    fn patch_len(&mut self) {
        if let Some(at) = self.header_at {
            let len = self.body_len();
            // A protocol bounds its bodies far below 4 GiB; a longer one would be a bug here.
            let len = u32::try_from(len).expect("a frame body longer than 4 GiB");
            self.out[at + 8..at + HEADER_LEN].copy_from_slice(&len.to_le_bytes());
        }
    }

    /// Appends a byte.
    pub fn u8(&mut self, v: u8) {
        self.out.push(v);
    }

    /// Appends a little-endian `u16`.
    pub fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }

    /// Appends a little-endian `u32`.
    pub fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }

    /// Appends a little-endian `u64`.
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    /// Appends bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_never_pass_the_end() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u16(), Ok(0x0201));
        assert_eq!(
            r.u16(),
            Err(Truncated {
                at: 2,
                wanted: 2,
                len: 3
            })
        );
        assert_eq!(r.remaining(), 1);
        assert!(r.take(usize::MAX).is_err());
        assert_eq!(r.u8(), Ok(3));
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn a_frame_appended_to_a_buffer_gets_its_length() {
        let mut out = vec![9u8];
        let mut w = Writer::frame_into(&mut out, *b"ABCD", 3, 5);
        w.u64(1);
        w.end();
        assert_eq!(out.len(), 1 + HEADER_LEN + 8);
        let h = Header::parse(&out[1..]).unwrap();
        assert_eq!(
            h,
            Header {
                magic: *b"ABCD",
                version: 3,
                kind: 5,
                body_len: 8
            }
        );
        assert!(Header::parse(&out[1..HEADER_LEN]).is_err());
    }
}
