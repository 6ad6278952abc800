//! TTL leases (kind `ttl`) on the etcd backend: the pure parts, no I/O.
//!
//! A TTL lease is an etcd lease of its own (TTL = `ttl_ms` rounded up to whole seconds) and a
//! lock key under the resource's prefix attached to it (etcd's mutex recipe, as for the
//! connection-bound leases: queue by create revision, epoch = create revision). The lease id
//! is the etcd lease id, so it names the lease on every lockd. The key's value says who holds
//! it and how to check a token, so that `renew`, `release`, `resume` and `lease` work from
//! any lockd:
//!
//! ```text
//! holder@node\n{"holder":…,"node":…,"token_sha256":…,"ttl_ms":…,"expires_at_unix_ms":…,…}
//! ```
//!
//! The first line is what version-1 paths (`busy`, `status`) show ([`display_value`]); the
//! token is stored as its SHA-256 only ([`sha256_hex`], [`token_matches`]).
//!
//! The holder's deadline is the **send time** of the etcd call that granted or renewed the
//! etcd lease plus `ttl_ms` ([`deadline`]): etcd starts the lease's TTL when it processes the
//! call, after the send, and that TTL is at least `ttl_ms` ([`etcd_ttl_secs`]), so the
//! holder's deadline is never later than etcd's expiry.

use serde::{Deserialize, Serialize};

use crate::proto::{AcquireExt, ErrorCode, LeaseKind};

/// What separates the display line from the metadata in a TTL lock key's value (holder and
/// node names never contain control characters).
const SEP: char = '\n';

/// Whether an acquire asks for a plain TTL lease (`ttl_ms`, no `mode`, no `quantity`, no
/// `gang`, no `reserve_ms`): the only version-2 acquire this backend serves.
pub fn is_plain_ttl(ext: &AcquireExt) -> bool {
    ext.ttl_ms.is_some()
        && ext.kind() == LeaseKind::Ttl
        && ext.gang.is_none()
        && ext.reserve_ms.is_none()
        && ext.timeout_ms.is_none()
}

/// The TTL asked of etcd for a lease of `ttl_ms`: rounded **up** to whole seconds, at least 1
/// (etcd raises it to its own minimum; a longer etcd TTL is the safe direction).
pub fn etcd_ttl_secs(ttl_ms: u64) -> i64 {
    let secs = ttl_ms.div_ceil(1000).max(1);
    i64::try_from(secs).unwrap_or(i64::MAX)
}

/// Whether etcd's granted TTL (seconds) covers the holder's TTL.
pub fn granted_covers(granted_secs: i64, ttl_ms: u64) -> bool {
    u64::try_from(granted_secs).is_ok_and(|s| s.saturating_mul(1000) >= ttl_ms)
}

/// The holder's deadline: the send time (Unix ms, read **before** the etcd call) + `ttl_ms`.
pub fn deadline(sent_at_unix_ms: u64, ttl_ms: u64) -> u64 {
    sent_at_unix_ms.saturating_add(ttl_ms)
}

/// The deadline under the PLANTED BUG `LOCKD_PLANTED_BUG_TTL_LATE_DEADLINE=1` (tests only):
/// read after the call and taken from etcd's TTL plus a second: later than etcd's expiry, so
/// another holder can be granted before this one is told its lease expired.
pub fn planted_late_deadline(after_call_unix_ms: u64, granted_secs: i64) -> u64 {
    let secs = u64::try_from(granted_secs.max(0)).unwrap_or(0);
    after_call_unix_ms.saturating_add(secs.saturating_mul(1000) + 1000)
}

/// A lease id of the protocol as an etcd lease id (None: not one etcd can have granted).
pub fn etcd_lease_id(lease_id: u64) -> Option<i64> {
    i64::try_from(lease_id).ok().filter(|id| *id > 0)
}

/// What a TTL lock key's value holds besides its display line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlValue {
    /// The holder's name.
    pub holder: String,
    /// The lockd that granted it (`--etcd-node`).
    pub node: String,
    /// SHA-256 of the token, hex.
    pub token_sha256: String,
    /// The TTL granted, in ms.
    pub ttl_ms: u64,
    /// The holder's current deadline (None: still waiting, or being granted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_unix_ms: Option<u64>,
    /// When it was granted (None: waiting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_at_unix_ms: Option<u64>,
    /// Where its events go: `node#session` of the connection that acquired or last resumed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<String>,
    /// Set just before the lease is ended on purpose (`released`, `revoked:…`) or when a lockd
    /// saw its deadline pass (`expired`): the key stays until etcd deletes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
}

impl TtlValue {
    /// The key's value: the display line, then the metadata.
    pub fn encode(&self) -> String {
        let meta = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        format!("{}@{}{SEP}{meta}", self.holder, self.node)
    }

    /// A TTL lock key's value (None: a connection-bound lease's plain `holder@node`, or junk).
    pub fn decode(value: &str) -> Option<TtlValue> {
        let (_, meta) = value.split_once(SEP)?;
        serde_json::from_str(meta).ok()
    }

    /// How the lease stands at `now_ms` by its value: None while it lives.
    pub fn end_reason(&self, now_ms: u64) -> Option<String> {
        if let Some(r) = &self.ended {
            return Some(r.clone());
        }
        match self.expires_at_unix_ms {
            Some(d) if now_ms >= d => Some("expired".into()),
            _ => None,
        }
    }
}

/// What version-1 paths show of a lock key's value: its first line (`holder@node`).
pub fn display_value(value: &str) -> &str {
    value.split_once(SEP).map(|(d, _)| d).unwrap_or(value)
}

/// The binding tag of a session of a lockd: `node#session`.
pub fn binding(node: &str, session: u64) -> String {
    format!("{node}#{session}")
}

/// The `state` of an ended lease's report, from its reason.
pub fn state_of_reason(reason: &str) -> &'static str {
    if reason == "expired" {
        "expired"
    } else if reason.starts_with("revoked") {
        "revoked"
    } else {
        "released"
    }
}

/// Why a TTL request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TtlRefusal {
    /// No such lease in etcd and no tombstone on this lockd.
    #[error("lease {0} is not known (never granted, or ended and not remembered by this lockd)")]
    UnknownLease(u64),
    /// The token does not match.
    #[error("the token does not match lease {0}")]
    BadToken(u64),
    /// The lease has ended.
    #[error("lease {id} has ended ({reason}): acquire a new one")]
    Ended {
        /// The lease.
        id: u64,
        /// Why.
        reason: String,
    },
    /// Not a TTL lease, or not in a state where this applies.
    #[error("{0}")]
    WrongLease(String),
    /// etcd did not answer.
    #[error("etcd backend: {0}")]
    Unavailable(String),
}

impl TtlRefusal {
    /// The error code on the wire.
    pub fn code(&self) -> ErrorCode {
        match self {
            TtlRefusal::UnknownLease(_) => ErrorCode::UnknownLease,
            TtlRefusal::BadToken(_) => ErrorCode::BadToken,
            TtlRefusal::Ended { .. } => ErrorCode::LeaseEnded,
            TtlRefusal::WrongLease(_) => ErrorCode::WrongLease,
            TtlRefusal::Unavailable(_) => ErrorCode::Unavailable,
        }
    }
}

/// Check `token` against a value; then whether the lease still lives at `now_ms`.
pub fn check(id: u64, v: &TtlValue, token: &str, now_ms: u64) -> Result<(), TtlRefusal> {
    if !token_matches(&v.token_sha256, token) {
        return Err(TtlRefusal::BadToken(id));
    }
    match v.end_reason(now_ms) {
        Some(reason) => Err(TtlRefusal::Ended { id, reason }),
        None => Ok(()),
    }
}

/// Whether `token` hashes to `stored` (compared without an early exit).
pub fn token_matches(stored: &str, token: &str) -> bool {
    let h = sha256_hex(token.as_bytes());
    h.len() == stored.len()
        && h.bytes()
            .zip(stored.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// SHA-256 of `data`, lower-case hex (the `sha2` crate, already the workspace's hash).
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    use std::fmt::Write;
    sha2::Sha256::digest(data)
        .iter()
        .fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_matches_the_fips_vectors() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        // 1,000,000 × 'a' (several blocks).
        assert_eq!(
            sha256_hex(&vec![b'a'; 1_000_000]),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    #[test]
    fn etcd_ttl_is_rounded_up_to_whole_seconds() {
        assert_eq!(etcd_ttl_secs(1), 1);
        assert_eq!(etcd_ttl_secs(999), 1);
        assert_eq!(etcd_ttl_secs(1000), 1);
        assert_eq!(etcd_ttl_secs(1001), 2);
        assert_eq!(etcd_ttl_secs(1500), 2);
        assert_eq!(etcd_ttl_secs(31_536_000_000), 31_536_000);
        assert_eq!(etcd_ttl_secs(u64::MAX), 18_446_744_073_709_552);
        for ms in [1, 500, 1000, 1001, 2999, 3000, 45_678] {
            assert!(granted_covers(etcd_ttl_secs(ms), ms), "{ms}");
        }
        assert!(!granted_covers(1, 1001));
        assert!(!granted_covers(-1, 1));
        assert!(granted_covers(2, 2000));
    }

    #[test]
    fn the_deadline_is_the_send_time_plus_the_ttl_never_past_etcds_expiry() {
        assert_eq!(deadline(10_000, 1500), 11_500);
        assert_eq!(deadline(u64::MAX - 1, 1500), u64::MAX);
        // etcd's expiry is at least send + granted TTL (it starts the TTL after the send).
        for (sent, ttl) in [(0u64, 1u64), (123, 999), (5, 1001), (7, 60_000)] {
            let etcd_expiry_at_the_earliest = sent + etcd_ttl_secs(ttl) as u64 * 1000;
            assert!(deadline(sent, ttl) <= etcd_expiry_at_the_earliest);
        }
        // The planted bug's deadline is past etcd's expiry (that is the point of it).
        assert!(planted_late_deadline(10_000, 2) > 10_000 + 2000);
    }

    #[test]
    fn plain_ttl_requests_are_recognised() {
        let ttl = AcquireExt {
            ttl_ms: Some(1000),
            ..AcquireExt::default()
        };
        assert!(is_plain_ttl(&ttl));
        assert!(!is_plain_ttl(&AcquireExt::default()));
        assert!(!is_plain_ttl(&AcquireExt {
            mode: Some(crate::proto::Mode::Exclusive),
            ..ttl.clone()
        }));
        assert!(!is_plain_ttl(&AcquireExt {
            quantity: Some(2),
            ..ttl.clone()
        }));
        assert!(!is_plain_ttl(&AcquireExt {
            gang: Some(vec!["a".into(), "b".into()]),
            ..ttl.clone()
        }));
        assert!(!is_plain_ttl(&AcquireExt {
            reserve_ms: Some(10),
            ..ttl
        }));
    }

    #[test]
    fn lease_ids_map_to_etcd_ids() {
        assert_eq!(etcd_lease_id(7), Some(7));
        assert_eq!(etcd_lease_id(0), None);
        assert_eq!(etcd_lease_id(u64::MAX), None);
        assert_eq!(etcd_lease_id(i64::MAX as u64), Some(i64::MAX));
    }

    fn value() -> TtlValue {
        TtlValue {
            holder: "worker-1".into(),
            node: "A".into(),
            token_sha256: sha256_hex(b"secret"),
            ttl_ms: 1500,
            expires_at_unix_ms: Some(11_500),
            granted_at_unix_ms: Some(10_000),
            bound: Some(binding("A", 3)),
            ended: None,
        }
    }

    #[test]
    fn values_round_trip_and_show_holder_at_node() {
        let v = value();
        let s = v.encode();
        assert!(s.starts_with("worker-1@A\n"), "{s}");
        assert!(
            !s.contains("secret"),
            "the token is not stored in clear: {s}"
        );
        assert_eq!(TtlValue::decode(&s), Some(v));
        assert_eq!(display_value(&s), "worker-1@A");
        // A connection-bound lease's value is not a TTL value and shows as it is.
        assert_eq!(TtlValue::decode("engine-a@A"), None);
        assert_eq!(display_value("engine-a@A"), "engine-a@A");
        assert_eq!(TtlValue::decode("x@A\nnot json"), None);
        assert_eq!(TtlValue::decode(""), None);
    }

    #[test]
    fn tokens_and_deadlines_are_checked() {
        let v = value();
        assert_eq!(check(9, &v, "secret", 11_499), Ok(()));
        assert_eq!(check(9, &v, "wrong", 11_499), Err(TtlRefusal::BadToken(9)));
        assert_eq!(check(9, &v, "", 0), Err(TtlRefusal::BadToken(9)));
        // Exact: held before the deadline, expired from it on.
        assert_eq!(
            check(9, &v, "secret", 11_500),
            Err(TtlRefusal::Ended {
                id: 9,
                reason: "expired".into()
            })
        );
        let revoked = TtlValue {
            ended: Some("revoked:session 4 (pid 1) at B:drain".into()),
            ..value()
        };
        let e = check(9, &revoked, "secret", 0).unwrap_err();
        assert_eq!(e.code(), ErrorCode::LeaseEnded);
        assert!(e.to_string().contains("revoked:session 4"), "{e}");
        // A request still waiting has no deadline: it does not expire by its value.
        let waiting = TtlValue {
            expires_at_unix_ms: None,
            ..value()
        };
        assert_eq!(waiting.end_reason(u64::MAX), None);
        assert!(!token_matches("short", "secret"));
    }

    #[test]
    fn states_follow_the_reasons() {
        assert_eq!(state_of_reason("expired"), "expired");
        assert_eq!(state_of_reason("revoked:session 1 (pid 2):x"), "revoked");
        assert_eq!(state_of_reason("released"), "released");
        assert_eq!(TtlRefusal::UnknownLease(1).code(), ErrorCode::UnknownLease);
        assert_eq!(
            TtlRefusal::WrongLease("x".into()).code(),
            ErrorCode::WrongLease
        );
    }
}
