//! Who may use the service and how much: the access rules (same uid by default, plus an
//! allow-list), the quotas per uid and in total, and the connection limits and time limits that
//! protect the server from clients that misbehave. Plain values and arithmetic; no sockets.

use std::collections::HashMap;
use std::time::Duration;

use super::error::{Error, QuotaKind, QuotaScope, Result};

/// Who may connect: the server's own effective uid always, and the uids listed.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Access {
    /// More uids allowed besides the server's own. The socket file's mode must let them in too
    /// ([`ServerConfig::socket_mode`](super::server::ServerConfig::socket_mode)).
    pub allow_uids: Vec<u32>,
}

impl Access {
    /// Whether `uid` may connect, given the server's own uid `server_uid`.
    pub fn allows(&self, server_uid: u32, uid: u32) -> bool {
        uid == server_uid || self.allow_uids.contains(&uid)
    }

    /// `Ok` if `uid` may connect, [`Error::NotPermitted`] otherwise.
    pub fn check_connect(&self, server_uid: u32, uid: u32) -> Result<()> {
        if self.allows(server_uid, uid) {
            Ok(())
        } else {
            Err(Error::NotPermitted {
                uid,
                what: format!("connect (allowed: uid {server_uid} and {:?})", self.allow_uids),
            })
        }
    }

    /// `Ok` if `uid` may delete a buffer owned by `owner`: its owner, or the server's uid.
    pub fn check_delete(server_uid: u32, uid: u32, owner: u32, name: &str) -> Result<()> {
        if uid == owner || uid == server_uid {
            Ok(())
        } else {
            Err(Error::NotPermitted {
                uid,
                what: format!("delete buffer {name:?} of uid {owner} (only its owner or uid {server_uid} may)"),
            })
        }
    }
}

/// Limits on what the service holds; `None`: no limit.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Quotas {
    /// Bytes one uid's buffers may hold.
    pub per_uid_bytes: Option<u64>,
    /// Buffers one uid may hold.
    pub per_uid_buffers: Option<u64>,
    /// Bytes all buffers together may hold.
    pub total_bytes: Option<u64>,
    /// Buffers all together.
    pub total_buffers: Option<u64>,
}

/// Bytes and buffers in use, charged when a buffer is allocated and credited when its memory is
/// released (after delete, expiry or a dead creator, and the last attachment's end).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct Usage {
    pub(crate) bytes: u64,
    pub(crate) buffers: u64,
}

/// The service's accounting: usage per uid and in total, against the quotas.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    quotas: Quotas,
    per_uid: HashMap<u32, Usage>,
    total: Usage,
}

impl Ledger {
    pub(crate) fn new(quotas: Quotas) -> Ledger {
        Ledger {
            quotas,
            ..Ledger::default()
        }
    }

    /// Checks that `uid` may hold `buffers` more buffers of `bytes` in all; changes nothing.
    pub(crate) fn check_many(&self, uid: u32, bytes: u64, buffers: u64) -> Result<()> {
        let mine = self.per_uid.get(&uid).copied().unwrap_or_default();
        let q = self.quotas;
        let checks = [
            (
                QuotaScope::Uid(uid),
                QuotaKind::Bytes,
                q.per_uid_bytes,
                mine.bytes,
                bytes,
            ),
            (
                QuotaScope::Uid(uid),
                QuotaKind::Buffers,
                q.per_uid_buffers,
                mine.buffers,
                buffers,
            ),
            (
                QuotaScope::Total,
                QuotaKind::Bytes,
                q.total_bytes,
                self.total.bytes,
                bytes,
            ),
            (
                QuotaScope::Total,
                QuotaKind::Buffers,
                q.total_buffers,
                self.total.buffers,
                buffers,
            ),
        ];
        for (scope, kind, limit, in_use, requested) in checks {
            if let Some(limit) = limit {
                if in_use.checked_add(requested).is_none_or(|sum| sum > limit) {
                    return Err(Error::QuotaExceeded {
                        scope,
                        kind,
                        limit,
                        in_use,
                        requested,
                    });
                }
            }
        }
        Ok(())
    }

    /// Charges `buffers` buffers of `bytes` in all to `uid` and to the total (after
    /// [`Ledger::check_many`]).
    pub(crate) fn charge_many(&mut self, uid: u32, bytes: u64, buffers: u64) {
        self.charge_uid(uid, bytes, buffers);
        self.total.bytes = self.total.bytes.saturating_add(bytes);
        self.total.buffers = self.total.buffers.saturating_add(buffers);
    }

    /// Charges `uid` alone (memory charged to the total already changes hands, or gains a payer:
    /// a lingering memory is charged to each uid holding it; it may take `uid` past its quota,
    /// and then its creates are refused until it lets go).
    pub(crate) fn charge_uid(&mut self, uid: u32, bytes: u64, buffers: u64) {
        let mine = self.per_uid.entry(uid).or_default();
        mine.bytes = mine.bytes.saturating_add(bytes);
        mine.buffers = mine.buffers.saturating_add(buffers);
    }

    /// Credits back `buffers` buffers of `bytes` in all charged to `uid` and to the total.
    #[cfg(test)]
    pub(crate) fn credit_many(&mut self, uid: u32, bytes: u64, buffers: u64) {
        self.credit_uid(uid, bytes, buffers);
        self.credit_total(bytes, buffers);
    }

    /// Credits back what [`Ledger::charge_uid`] charged `uid`.
    pub(crate) fn credit_uid(&mut self, uid: u32, bytes: u64, buffers: u64) {
        if let Some(mine) = self.per_uid.get_mut(&uid) {
            mine.bytes = mine.bytes.saturating_sub(bytes);
            mine.buffers = mine.buffers.saturating_sub(buffers);
            if mine.buffers == 0 && mine.bytes == 0 {
                self.per_uid.remove(&uid);
            }
        }
    }

    /// Credits back the total's share of a memory released.
    pub(crate) fn credit_total(&mut self, bytes: u64, buffers: u64) {
        self.total.bytes = self.total.bytes.saturating_sub(bytes);
        self.total.buffers = self.total.buffers.saturating_sub(buffers);
    }

    /// What `uid` holds now.
    #[cfg(test)]
    pub(crate) fn usage(&self, uid: u32) -> Usage {
        self.per_uid.get(&uid).copied().unwrap_or_default()
    }

    /// What everyone holds together.
    #[cfg(test)]
    pub(crate) fn total(&self) -> Usage {
        self.total
    }
}

/// The server's protections against clients that connect and misbehave.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Limits {
    /// Open connections at most; more are answered `Busy` and closed.
    pub max_connections: usize,
    /// Open connections of one uid at most.
    pub max_connections_per_uid: usize,
    /// Ended connections of one uid whose process still runs and so still holds their
    /// attachments (reclaimed when it exits) at most; past it, that uid's new connections are
    /// answered `Busy` until one of its processes exits.
    pub max_ended_connections_per_uid: usize,
    /// Attachments one connection may hold at once, its own creations' included; past it an
    /// attach, attach_many or create is refused `Busy` (the connection stays usable).
    pub max_attachments_per_connection: usize,
    /// The client's `Hello` must arrive within this after it connects.
    pub handshake_timeout: Duration,
    /// Once a frame's first byte arrived, all of it must arrive within this (slowloris).
    pub frame_timeout: Duration,
    /// A connection that holds nothing (no attachment, no buffer being created) and sends
    /// nothing for this long is closed.
    pub idle_timeout: Duration,
    /// A reply must be written within this (a client that does not read is dropped).
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 256,
            max_connections_per_uid: 128,
            max_ended_connections_per_uid: 64,
            max_attachments_per_connection: 4096,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_is_own_uid_plus_the_list() {
        let access = Access { allow_uids: vec![7] };
        assert!(access.allows(1000, 1000));
        assert!(access.allows(1000, 7));
        assert!(!access.allows(1000, 8));
        let err = access.check_connect(1000, 8).unwrap_err();
        assert!(matches!(err, Error::NotPermitted { uid: 8, .. }), "{err}");
        assert!(Access::default().check_connect(5, 5).is_ok());
        assert!(Access::check_delete(1000, 7, 7, "a").is_ok());
        assert!(Access::check_delete(1000, 1000, 7, "a").is_ok());
        let err = Access::check_delete(1000, 8, 7, "a").unwrap_err();
        assert!(err.to_string().contains("uid 7"), "{err}");
    }

    #[test]
    fn quotas_name_the_limit_hit() {
        let mut ledger = Ledger::new(Quotas {
            per_uid_bytes: Some(100),
            per_uid_buffers: Some(2),
            total_bytes: Some(150),
            total_buffers: None,
        });
        ledger.check_many(1, 60, 1).unwrap();
        ledger.charge_many(1, 60, 1);
        match ledger.check_many(1, 50, 1) {
            Err(Error::QuotaExceeded {
                scope: QuotaScope::Uid(1),
                kind: QuotaKind::Bytes,
                limit: 100,
                in_use: 60,
                requested: 50,
            }) => {}
            other => panic!("{other:?}"),
        }
        ledger.charge_many(1, 40, 1);
        assert!(matches!(
            ledger.check_many(1, 0, 1),
            Err(Error::QuotaExceeded {
                kind: QuotaKind::Buffers,
                limit: 2,
                in_use: 2,
                ..
            })
        ));
        ledger.check_many(2, 50, 1).unwrap();
        assert!(matches!(
            ledger.check_many(2, 51, 1),
            Err(Error::QuotaExceeded {
                scope: QuotaScope::Total,
                kind: QuotaKind::Bytes,
                in_use: 100,
                ..
            })
        ));
        ledger.credit_many(1, 60, 1);
        assert_eq!(ledger.usage(1), Usage { bytes: 40, buffers: 1 });
        ledger.credit_many(1, 40, 1);
        assert_eq!(ledger.usage(1), Usage::default());
        assert_eq!(ledger.total(), Usage::default());
        // Overflow is a refusal, not a wrap.
        let ledger = Ledger::new(Quotas {
            per_uid_bytes: Some(u64::MAX),
            ..Quotas::default()
        });
        let mut ledger = ledger;
        ledger.charge_many(3, u64::MAX, 1);
        assert!(ledger.check_many(3, 1, 1).is_err());
    }
}
