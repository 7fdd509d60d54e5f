//! The bytes of the memory store's messages in each version it speaks: [`encode_as`],
//! [`decode_header`] and [`decode_body_as`], and the refusals' translation between [`Error`] and
//! the wire ([`refusal_of`], [`error_of`]).
//! Decoding checks every length against the bytes present and every field against its range, and
//! refuses trailing bytes: a hostile frame is an [`Error::Protocol`], never a panic.

use std::time::Duration;

use mempool_socket::frame;

use super::messages::{
    EventBytes, GrantEntry, Message, MessageKind, Refusal, HEADER_LEN, MAGIC, MAX_ATTACH_MANY, MAX_ATTACH_UIDS,
    MAX_BODY_LEN, MAX_DEVICES, MAX_LIST_PAGE, MIN_VERSION, STATS_NUMBERS, STATS_NUMBERS_V2, VERSION,
};
use crate::error::{Error, QuotaKind, QuotaScope, Result};
use crate::names;
use crate::types::{BufferInfo, BufferState};
use mempool_ipc::DeviceUuid;

/// A decoded header: the protocol version of the frame, the message type and the body's length.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Header {
    pub(crate) version: u16,
    pub(crate) kind: MessageKind,
    pub(crate) body_len: usize,
}

/// Checks a frame's header: magic, a version this build speaks ([`MIN_VERSION`] to [`VERSION`]),
/// a known type, a body length within the limit.
pub(crate) fn decode_header(bytes: &[u8; HEADER_LEN]) -> Result<Header> {
    let raw = frame::Header::parse(bytes).map_err(|t| Error::protocol(format!("header {t}")))?;
    if raw.magic != MAGIC {
        return Err(Error::protocol(format!(
            "bad magic {:02x?} (expected \"MPMS\": is this a memory store socket?)",
            raw.magic
        )));
    }
    let version = raw.version;
    if !(MIN_VERSION..=VERSION).contains(&version) {
        return Err(Error::protocol(format!(
            "protocol version {version}, this side speaks versions {MIN_VERSION} to {VERSION}"
        )));
    }
    let code = raw.kind;
    let kind = MessageKind::from_code(code).ok_or_else(|| Error::protocol(format!("unknown message type {code}")))?;
    let body_len = raw.body_len as usize;
    if body_len > MAX_BODY_LEN {
        return Err(Error::protocol(format!(
            "{kind:?} body of {body_len} bytes is longer than the limit of {MAX_BODY_LEN}"
        )));
    }
    Ok(Header {
        version,
        kind,
        body_len,
    })
}

/// Encodes a whole frame (header and body) in the newest version (the tests).
#[cfg(test)]
pub(crate) fn encode(message: &Message) -> Result<Vec<u8>> {
    encode_as(message, VERSION)
}

/// Encodes a whole frame (header and body) of protocol `version` ([`MIN_VERSION`] to
/// [`VERSION`]). A message that version cannot carry is refused ([`Error::Protocol`]): an attach
/// list in version 2; a version-2 StatsReply drops the numbers version 3 added.
pub(crate) fn encode_as(message: &Message, version: u16) -> Result<Vec<u8>> {
    if !(MIN_VERSION..=VERSION).contains(&version) {
        return Err(Error::protocol(format!(
            "encoding in protocol version {version}, this side speaks versions {MIN_VERSION} to {VERSION}"
        )));
    }
    let v3 = version >= 3;
    let mut out = Vec::with_capacity(64);
    let mut w = Writer(frame::Writer::frame_into(
        &mut out,
        MAGIC,
        version,
        message.kind() as u16,
    ));
    match message {
        Message::Hello | Message::Stats | Message::Done => {}
        Message::Create {
            device,
            size,
            ttl_ms,
            name,
            tag,
            attach_uids,
        } => {
            w.bytes(&device.0);
            w.u64(*size);
            w.u64(*ttl_ms);
            w.str(name)?;
            w.str(tag)?;
            w.attach_uids(attach_uids, v3)?;
        }
        Message::Publish { name, event } => {
            w.event(event);
            w.str(name)?;
        }
        Message::Attach { name } | Message::Delete { name } => w.str(name)?,
        Message::List { after } => w.str(after)?,
        Message::AttachMany { names } => {
            check_count(names.len(), "names")?;
            w.u16(names.len() as u16);
            for name in names {
                w.str(name)?;
            }
        }
        Message::CreateMany {
            device,
            ttl_ms,
            tag,
            attach_uids,
            members,
        } => {
            check_count(members.len(), "members")?;
            w.bytes(&device.0);
            w.u64(*ttl_ms);
            w.str(tag)?;
            w.attach_uids(attach_uids, v3)?;
            w.u16(members.len() as u16);
            for (name, size) in members {
                w.u64(*size);
                w.str(name)?;
            }
        }
        Message::GrantedMany { grants } => {
            check_count(grants.len(), "grants")?;
            w.u16(grants.len() as u16);
            for g in grants {
                w.grant(g);
            }
        }
        Message::Detach { attachment } => w.u64(*attachment),
        Message::Welcome { pid, devices } => {
            if devices.len() > MAX_DEVICES {
                return Err(Error::protocol(format!(
                    "{} devices (at most {MAX_DEVICES})",
                    devices.len()
                )));
            }
            w.u32(*pid);
            w.u16(devices.len() as u16);
            for (uuid, granularity) in devices {
                w.bytes(&uuid.0);
                w.u64(*granularity);
            }
        }
        Message::Granted(g) => w.grant(g),
        Message::ListPage { more, entries } => {
            if entries.len() > MAX_LIST_PAGE {
                return Err(Error::protocol(format!(
                    "{} entries (at most {MAX_LIST_PAGE})",
                    entries.len()
                )));
            }
            w.u8(u8::from(*more));
            w.u16(entries.len() as u16);
            for e in entries {
                w.str(&e.name)?;
                w.u64(e.size);
                w.bytes(&e.device.0);
                w.str(&e.tag)?;
                w.u8(e.state.code());
                w.u32(e.owner_uid);
                w.u32(e.owner_pid as u32);
                w.u32(e.attachments);
                w.u8(u8::from(e.expires_in.is_some()));
                w.u64(
                    e.expires_in
                        .map_or(0, |d| d.as_millis().min(u128::from(u64::MAX)) as u64),
                );
            }
        }
        Message::StatsReply { numbers } => {
            let count = if v3 { STATS_NUMBERS } else { STATS_NUMBERS_V2 };
            numbers[..count].iter().for_each(|n| w.u64(*n));
        }
        Message::Refused(r) => {
            w.u16(r.code);
            w.u32(r.uid);
            w.u8(r.scope);
            w.u8(r.kind);
            w.u8(r.state);
            r.numbers.iter().for_each(|n| w.u64(*n));
            w.str(&r.name)?;
            w.str(&r.text)?;
        }
    }
    let body_len = w.0.body_len();
    if body_len > MAX_BODY_LEN {
        return Err(Error::protocol(format!(
            "{:?} body of {body_len} bytes is longer than the limit of {MAX_BODY_LEN}",
            message.kind()
        )));
    }
    w.0.end();
    Ok(out)
}

/// Decodes a body of the newest version (the tests).
#[cfg(test)]
pub(crate) fn decode_body(kind: MessageKind, body: &[u8]) -> Result<Message> {
    decode_body_as(kind, VERSION, body)
}

/// Decodes a body of the type and protocol version its header named.
pub(crate) fn decode_body_as(kind: MessageKind, version: u16, body: &[u8]) -> Result<Message> {
    if !(MIN_VERSION..=VERSION).contains(&version) {
        return Err(Error::protocol(format!(
            "decoding protocol version {version}, this side speaks versions {MIN_VERSION} to {VERSION}"
        )));
    }
    let v3 = version >= 3;
    let mut r = Reader {
        inner: frame::Reader::new(body),
        kind,
    };
    let message = match kind {
        MessageKind::Hello => Message::Hello,
        MessageKind::Stats => Message::Stats,
        MessageKind::Done => Message::Done,
        MessageKind::Create => Message::Create {
            device: DeviceUuid(r.array()?),
            size: r.u64()?,
            ttl_ms: r.u64()?,
            name: r.str()?,
            tag: r.str()?,
            attach_uids: if v3 { r.attach_uids()? } else { Vec::new() },
        },
        MessageKind::Publish => {
            let event = r.event()?;
            Message::Publish { name: r.str()?, event }
        }
        MessageKind::Attach => Message::Attach { name: r.str()? },
        MessageKind::Delete => Message::Delete { name: r.str()? },
        MessageKind::List => Message::List { after: r.str()? },
        MessageKind::Detach => Message::Detach { attachment: r.u64()? },
        MessageKind::AttachMany => {
            let count = r.count()?;
            let mut names = Vec::with_capacity(count);
            for _ in 0..count {
                names.push(r.str()?);
            }
            Message::AttachMany { names }
        }
        MessageKind::CreateMany => {
            let device = DeviceUuid(r.array()?);
            let ttl_ms = r.u64()?;
            let tag = r.str()?;
            let attach_uids = if v3 { r.attach_uids()? } else { Vec::new() };
            let count = r.count()?;
            let mut members = Vec::with_capacity(count);
            for _ in 0..count {
                let size = r.u64()?;
                members.push((r.str()?, size));
            }
            Message::CreateMany {
                device,
                ttl_ms,
                tag,
                attach_uids,
                members,
            }
        }
        MessageKind::GrantedMany => {
            let count = r.count()?;
            let mut grants = Vec::with_capacity(count);
            for _ in 0..count {
                grants.push(r.grant()?);
            }
            Message::GrantedMany { grants }
        }
        MessageKind::Welcome => {
            let pid = r.u32()?;
            let count = usize::from(r.u16()?);
            if count > MAX_DEVICES {
                return Err(r.error(format!("{count} devices (at most {MAX_DEVICES})")));
            }
            let mut devices = Vec::with_capacity(count);
            for _ in 0..count {
                let uuid = DeviceUuid(r.array()?);
                let granularity = r.u64()?;
                if granularity == 0 || !granularity.is_power_of_two() {
                    return Err(r.error(format!("granularity {granularity} is not a power of two")));
                }
                devices.push((uuid, granularity));
            }
            Message::Welcome { pid, devices }
        }
        MessageKind::Granted => Message::Granted(r.grant()?),
        MessageKind::ListPage => {
            let more = r.flag()?;
            let count = usize::from(r.u16()?);
            if count > MAX_LIST_PAGE {
                return Err(r.error(format!("{count} entries (at most {MAX_LIST_PAGE})")));
            }
            let mut entries = Vec::with_capacity(count);
            for _ in 0..count {
                let name = r.str()?;
                let size = r.u64()?;
                let device = DeviceUuid(r.array()?);
                let tag = r.str()?;
                let code = r.u8()?;
                let state = BufferState::from_code(code).ok_or_else(|| r.error(format!("unknown state {code}")))?;
                let owner_uid = r.u32()?;
                let owner_pid = r.u32()? as i32;
                let attachments = r.u32()?;
                let has_expiry = r.flag()?;
                let ms = r.u64()?;
                if !has_expiry && ms != 0 {
                    // One encoding per message, as for an absent event.
                    return Err(r.error(format!("an entry without an expiry says {ms} ms (must be 0)")));
                }
                entries.push(BufferInfo {
                    name,
                    size,
                    device,
                    tag,
                    state,
                    owner_uid,
                    owner_pid,
                    attachments,
                    expires_in: has_expiry.then(|| Duration::from_millis(ms)),
                });
            }
            Message::ListPage { more, entries }
        }
        MessageKind::StatsReply => {
            let count = if v3 { STATS_NUMBERS } else { STATS_NUMBERS_V2 };
            let mut numbers = [0u64; STATS_NUMBERS];
            for n in &mut numbers[..count] {
                *n = r.u64()?;
            }
            Message::StatsReply { numbers }
        }
        MessageKind::Refused => Message::Refused(Refusal {
            code: r.u16()?,
            uid: r.u32()?,
            scope: r.u8()?,
            kind: r.u8()?,
            state: r.u8()?,
            numbers: [r.u64()?, r.u64()?, r.u64()?],
            name: r.str()?,
            text: r.str()?,
        }),
    };
    if r.inner.remaining() != 0 {
        return Err(r.error(format!("{} bytes after the end of the message", r.inner.remaining())));
    }
    Ok(message)
}

/// Decodes a whole frame (tests and the property tests).
#[cfg(test)]
pub(crate) fn decode(frame: &[u8]) -> Result<Message> {
    let header: &[u8; HEADER_LEN] = frame
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| Error::protocol(format!("a frame of {} bytes has no whole header", frame.len())))?;
    let h = decode_header(header)?;
    let body = &frame[HEADER_LEN..];
    if body.len() != h.body_len {
        return Err(Error::protocol(format!(
            "{:?}: the header says {} body bytes, {} follow",
            h.kind,
            h.body_len,
            body.len()
        )));
    }
    decode_body_as(h.kind, h.version, body)
}

// Refusal codes.
const NAME_TAKEN: u16 = 1;
const UNKNOWN_NAME: u16 = 2;
const BAD_NAME: u16 = 3;
const BAD_TAG: u16 = 4;
const QUOTA: u16 = 5;
const NOT_PERMITTED: u16 = 6;
const WRONG_STATE: u16 = 7;
const NOT_CREATOR: u16 = 8;
const BAD_SIZE: u16 = 9;
const DEVICE_NOT_SERVED: u16 = 10;
const BUSY: u16 = 11;
const SERVER_GPU: u16 = 12;
const PROTOCOL: u16 = 13;
const TIMEOUT: u16 = 14;

/// The operations a WrongState refusal names, by their code in `kind`.
const OPS: [&str; 7] = [
    "publish",
    "attach",
    "delete",
    "detach",
    OP_ATTACH_GROUP_UNPUBLISHED,
    OP_ATTACH_GROUP_LOST,
    OP_FINISH_CREATE,
];

/// The operation of a WrongState refusal to attach a member of a group not wholly published
/// (its state is the group's: being created).
pub(crate) const OP_ATTACH_GROUP_UNPUBLISHED: &str =
    "attach it before every member of its group is published (a member of a group is attachable \
     once all of them are)";
/// The operation of a WrongState refusal to attach a member of a group one of whose members was
/// deleted (or abandoned) before it was published: the group never becomes attachable.
pub(crate) const OP_ATTACH_GROUP_LOST: &str =
    "attach it: a member of its group was deleted before it was published, so the group never \
     becomes attachable";
/// The operation of a WrongState refusal of a create whose buffer lost its name meanwhile.
pub(crate) const OP_FINISH_CREATE: &str =
    "finish creating it (it was deleted or expired while its memory was allocated)";

/// The wire form of a refusal or of the reason a connection is closed.
pub(crate) fn refusal_of(err: &Error) -> Refusal {
    let mut r = Refusal::default();
    match err {
        Error::NameTaken { name } => (r.code, r.name) = (NAME_TAKEN, name.clone()),
        Error::UnknownName { name } => (r.code, r.name) = (UNKNOWN_NAME, name.clone()),
        Error::BadName { name, .. } => (r.code, r.name) = (BAD_NAME, name.clone()),
        Error::BadTag { len, max } => (r.code, r.numbers) = (BAD_TAG, [*len as u64, *max as u64, 0]),
        Error::QuotaExceeded {
            scope,
            kind,
            limit,
            in_use,
            requested,
        } => {
            r.code = QUOTA;
            match scope {
                QuotaScope::Uid(uid) => r.uid = *uid,
                QuotaScope::Total => r.scope = 1,
            }
            r.kind = u8::from(*kind == QuotaKind::Buffers);
            r.numbers = [*limit, *in_use, *requested];
        }
        Error::NotPermitted { uid, what } => (r.code, r.uid, r.text) = (NOT_PERMITTED, *uid, what.clone()),
        Error::WrongState { name, state, op } => {
            r.code = WRONG_STATE;
            r.name = name.clone();
            r.state = state.code();
            r.kind = OPS.iter().position(|o| o == op).unwrap_or(0) as u8;
        }
        Error::NotCreator { name } => (r.code, r.name) = (NOT_CREATOR, name.clone()),
        Error::BadSize { size, reason } => (r.code, r.numbers[0], r.text) = (BAD_SIZE, *size, reason.clone()),
        Error::DeviceNotServed { device } => (r.code, r.text) = (DEVICE_NOT_SERVED, device.clone()),
        Error::Busy { reason } => (r.code, r.text) = (BUSY, reason.clone()),
        Error::Timeout { during } => (r.code, r.text) = (TIMEOUT, (*during).to_owned()),
        Error::Protocol { reason } => (r.code, r.text) = (PROTOCOL, reason.clone()),
        Error::ServerGpu { message } => (r.code, r.text) = (SERVER_GPU, message.clone()),
        other => (r.code, r.text) = (SERVER_GPU, other.to_string()),
    }
    // Bounded so that any refusal encodes: a name is at most 128 bytes once validated, but a
    // refused one may be longer (up to what a string field holds); texts are the server's own.
    truncate(&mut r.name, 512);
    truncate(&mut r.text, 1024);
    r
}

fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// Whether `r` refuses a message as breaking the protocol (what a server of an older version says
/// to a Hello of a newer one).
pub(crate) fn is_protocol_refusal(r: &Refusal) -> bool {
    r.code == PROTOCOL
}

/// The error a refusal from the server stands for.
pub(crate) fn error_of(r: Refusal) -> Error {
    match r.code {
        NAME_TAKEN => Error::NameTaken { name: r.name },
        UNKNOWN_NAME => Error::UnknownName { name: r.name },
        BAD_NAME => {
            let rule = match names::check_name_bytes(r.name.as_bytes()) {
                Err(Error::BadName { rule, .. }) => rule,
                _ => "refused by the server's naming rule",
            };
            Error::BadName { name: r.name, rule }
        }
        BAD_TAG => Error::BadTag {
            len: r.numbers[0] as usize,
            max: r.numbers[1] as usize,
        },
        QUOTA => Error::QuotaExceeded {
            scope: if r.scope == 1 {
                QuotaScope::Total
            } else {
                QuotaScope::Uid(r.uid)
            },
            kind: if r.kind == 1 {
                QuotaKind::Buffers
            } else {
                QuotaKind::Bytes
            },
            limit: r.numbers[0],
            in_use: r.numbers[1],
            requested: r.numbers[2],
        },
        NOT_PERMITTED => Error::NotPermitted {
            uid: r.uid,
            what: r.text,
        },
        WRONG_STATE => match BufferState::from_code(r.state) {
            Some(state) => Error::WrongState {
                name: r.name,
                state,
                op: OPS.get(usize::from(r.kind)).copied().unwrap_or("do that"),
            },
            None => Error::protocol(format!("a WrongState refusal with unknown state {}", r.state)),
        },
        NOT_CREATOR => Error::NotCreator { name: r.name },
        BAD_SIZE => Error::BadSize {
            size: r.numbers[0],
            reason: r.text,
        },
        DEVICE_NOT_SERVED => Error::DeviceNotServed { device: r.text },
        BUSY => Error::Busy { reason: r.text },
        SERVER_GPU => Error::ServerGpu { message: r.text },
        PROTOCOL => Error::protocol(format!("the server refused our message: {}", r.text)),
        TIMEOUT => Error::protocol(format!("the server timed out waiting for us: {}", r.text)),
        code => Error::protocol(format!("a refusal with unknown code {code}: {}", r.text)),
    }
}

/// What is wrong with an attach list, if anything: more than [`MAX_ATTACH_UIDS`] uids, a uid
/// twice, or `u32::MAX` (no uid: `(uid_t)-1` is what `setuid` and `chown` take for "unchanged").
pub(crate) fn check_attach_uids(uids: &[u32]) -> std::result::Result<(), String> {
    if uids.len() > MAX_ATTACH_UIDS {
        return Err(format!(
            "an attach list of {} uids (at most {MAX_ATTACH_UIDS})",
            uids.len()
        ));
    }
    for (i, &uid) in uids.iter().enumerate() {
        if uid == u32::MAX {
            return Err(format!("uid {uid} in an attach list is no uid ((uid_t)-1)"));
        }
        if uids[..i].contains(&uid) {
            return Err(format!("uid {uid} twice in an attach list"));
        }
    }
    Ok(())
}

/// Refuses a count of names or grants outside `1..=MAX_ATTACH_MANY`.
fn check_count(count: usize, what: &str) -> Result<()> {
    if count == 0 || count > MAX_ATTACH_MANY {
        return Err(Error::protocol(format!(
            "{count} {what} in one message (1 to {MAX_ATTACH_MANY})"
        )));
    }
    Ok(())
}

/// mempool-socket's frame writer, with this protocol's compound fields.
struct Writer<'a>(frame::Writer<'a>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.u8(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.u16(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.u32(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.u64(v);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.bytes(b);
    }
    fn str(&mut self, s: &str) -> Result<()> {
        let len = u16::try_from(s.len())
            .map_err(|_| Error::protocol(format!("a string of {} bytes is longer than 65535", s.len())))?;
        self.u16(len);
        self.bytes(s.as_bytes());
        Ok(())
    }
    /// An attach list: version 3's count and uids; version 2 has none (refused if not empty).
    fn attach_uids(&mut self, uids: &[u32], v3: bool) -> Result<()> {
        if !v3 {
            return if uids.is_empty() {
                Ok(())
            } else {
                Err(Error::protocol(format!(
                    "an attach list ({uids:?}) in protocol version 2, which has none (its buffers are attachable \
                     by their owner's uid only)"
                )))
            };
        }
        check_attach_uids(uids).map_err(Error::protocol)?;
        self.u16(uids.len() as u16);
        uids.iter().for_each(|&uid| self.u32(uid));
        Ok(())
    }
    fn event(&mut self, event: &Option<EventBytes>) {
        self.u8(u8::from(event.is_some()));
        self.bytes(&event.unwrap_or([0; 64]));
    }
    fn grant(&mut self, g: &GrantEntry) {
        self.u64(g.attachment);
        self.u64(g.size);
        self.u64(g.granularity);
        self.bytes(&g.device.0);
        self.event(&g.event);
        self.u64(g.memory);
        self.u64(g.offset);
        self.u64(g.memory_size);
    }
}

/// mempool-socket's bounds-checked frame reader, whose errors name the message, with this
/// protocol's compound fields.
struct Reader<'a> {
    inner: frame::Reader<'a>,
    kind: MessageKind,
}

impl<'a> Reader<'a> {
    fn error(&self, what: String) -> Error {
        Error::protocol(format!("{:?}: {what}", self.kind))
    }
    fn cut_short(&self, t: frame::Truncated) -> Error {
        self.error(t.to_string())
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        self.inner.take(n).map_err(|t| self.cut_short(t))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.inner.array().map_err(|t| self.cut_short(t))
    }
    fn u8(&mut self) -> Result<u8> {
        self.inner.u8().map_err(|t| self.cut_short(t))
    }
    fn u16(&mut self) -> Result<u16> {
        self.inner.u16().map_err(|t| self.cut_short(t))
    }
    fn u32(&mut self) -> Result<u32> {
        self.inner.u32().map_err(|t| self.cut_short(t))
    }
    fn u64(&mut self) -> Result<u64> {
        self.inner.u64().map_err(|t| self.cut_short(t))
    }
    fn flag(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.error(format!("a flag byte of {v} (must be 0 or 1)"))),
        }
    }
    fn str(&mut self) -> Result<String> {
        let len = usize::from(self.u16()?);
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.error("a string is not UTF-8".into()))
    }
    fn event(&mut self) -> Result<Option<EventBytes>> {
        let has = self.flag()?;
        let event: EventBytes = self.array()?;
        if !has && event != [0; 64] {
            return Err(self.error("an absent event handle must be all zeros".into()));
        }
        Ok(has.then_some(event))
    }
    /// An attach list (version 3): a count within `0..=MAX_ATTACH_UIDS` and as many distinct
    /// uids, none of them `u32::MAX`.
    fn attach_uids(&mut self) -> Result<Vec<u32>> {
        let count = usize::from(self.u16()?);
        if count > MAX_ATTACH_UIDS {
            return Err(self.error(format!("an attach list of {count} uids (at most {MAX_ATTACH_UIDS})")));
        }
        let mut uids = Vec::with_capacity(count);
        for _ in 0..count {
            uids.push(self.u32()?);
        }
        check_attach_uids(&uids).map_err(|why| self.error(why))?;
        Ok(uids)
    }
    /// A count of names or grants, within `1..=MAX_ATTACH_MANY`.
    fn count(&mut self) -> Result<usize> {
        let count = usize::from(self.u16()?);
        if count == 0 || count > MAX_ATTACH_MANY {
            return Err(self.error(format!("{count} entries (1 to {MAX_ATTACH_MANY})")));
        }
        Ok(count)
    }
    /// A grant, with the descriptor checks of wire/vmm.rs: what the client maps relies on them.
    fn grant(&mut self) -> Result<GrantEntry> {
        let attachment = self.u64()?;
        let size = self.u64()?;
        let granularity = self.u64()?;
        let device = DeviceUuid(self.array()?);
        let event = self.event()?;
        let memory = self.u64()?;
        let offset = self.u64()?;
        let memory_size = self.u64()?;
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(self.error(format!("granularity {granularity} is not a power of two")));
        }
        if size == 0 || !size.is_multiple_of(granularity) {
            return Err(self.error(format!(
                "size {size} is not a non-zero multiple of the granularity {granularity}"
            )));
        }
        if !offset.is_multiple_of(granularity) {
            return Err(self.error(format!(
                "offset {offset} is not a multiple of the granularity {granularity}"
            )));
        }
        if memory_size == 0 || !memory_size.is_multiple_of(granularity) {
            return Err(self.error(format!(
                "memory size {memory_size} is not a non-zero multiple of the granularity {granularity}"
            )));
        }
        if usize::try_from(memory_size).is_err() || memory_size > i64::MAX as u64 {
            return Err(self.error(format!(
                "memory size {memory_size} does not fit this machine's addresses"
            )));
        }
        if offset.checked_add(size).is_none_or(|end| end > memory_size) {
            return Err(self.error(format!(
                "a buffer of {size} bytes at offset {offset} passes the end of its memory of {memory_size} bytes"
            )));
        }
        Ok(GrantEntry {
            attachment,
            size,
            granularity,
            device,
            event,
            memory,
            offset,
            memory_size,
        })
    }
}
