//! Gangs of exclusive, connection-bound leases on the etcd backend (feature `gang`,
//! docs/ETCD.md "Gangs on etcd").
//!
//! A gang is **one etcd transaction** that puts its key in every member's lock prefix
//! (`<prefix>/<member>/<session lease in hex>`, each attached to the session's etcd lease,
//! each on `create_revision == 0`), so every member key has the same create revision `R`.
//! etcd's revisions are one total order over the whole cluster: two gangs that share members
//! are in the same order in every shared member's queue, whichever lockds put them. The gang
//! is granted when its key is the lowest create revision in **every** member's queue (one
//! consistent read of all members' queues: one transaction of range reads); otherwise it
//! waits for the deletion of its predecessor in the first member where it is not first, then
//! looks again. Epoch of every member = `R`; the gang's id is `R` too.
//!
//! Why no deadlock: a gang waits only for keys older than its own, in every member; the
//! oldest key of all is first in each of its queues and is granted once the keys ahead of it
//! (there are none) are gone, so the wait-for relation follows strictly decreasing revisions
//! and has no cycle. Why no partial hold: nothing is granted before every member says so.
//!
//! This file holds the pure parts (key layout, the decision "first in every member's
//! queue?", unit-tested without I/O) and the three etcd calls (enqueue, read, delete); the
//! session glue is `server/gang_ops.rs`.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse,
};

use super::mutex::{self, bounded, EtcdError};
use crate::proto::AcquireExt;

/// Whether an acquire asks for a gang this backend serves: `gang` with exclusive,
/// connection-bound members (no `ttl_ms`, `mode`, `quantity`, `reserve_ms`); `timeout_ms`
/// allowed. Every other gang is refused (`unsupported`) by the caller.
pub fn is_exclusive_gang(ext: &AcquireExt) -> bool {
    ext.gang.is_some()
        && ext.ttl_ms.is_none()
        && ext.mode.is_none()
        && ext.quantity.is_none()
        && ext.reserve_ms.is_none()
        && ext.min_version.is_none()
        && ext.requirements.is_none()
        && ext.attributes.is_none()
}

/// The gang's key in each member's queue, in member order (the session's lease names them,
/// as a single acquire's key: a session holds or waits for a resource once).
pub fn member_keys(prefix: &str, members: &[String], lease: i64) -> Vec<String> {
    members
        .iter()
        .map(|m| mutex::lock_key(prefix, m, lease))
        .collect()
}

/// One key in a member's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    /// The lock key.
    pub key: String,
    /// Its create revision.
    pub create_revision: i64,
    /// Its value (`holder@node`, a TTL lease's value has more after a newline).
    pub value: String,
}

/// The keys of one member's queue no younger than the gang's own (any order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberQueue {
    /// The member.
    pub resource: String,
    /// Its keys with create revision ≤ the gang's.
    pub entries: Vec<QueueEntry>,
}

/// Where a gang with create revision `R` stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangStanding {
    /// First in every member's queue: granted.
    Owner,
    /// Not first in `member` (the first such in member order).
    Behind {
        /// The first member whose queue has older keys.
        member: String,
        /// The most keys ahead of the gang in any member's queue (its `queued` position).
        position: usize,
        /// The key created just before the gang's in `member`: the one to watch.
        predecessor: String,
        /// Its create revision (a key name can be created again: see
        /// [`super::mutex::wait_deleted`]).
        predecessor_rev: i64,
        /// The value of `member`'s owner (for `busy`).
        owner_value: String,
    },
    /// The gang's key is missing from `member`: its etcd lease expired or was revoked.
    Gone {
        /// The member without the gang's key.
        member: String,
    },
}

/// Decide from the members' queues (read in one snapshot) whether the gang whose keys have
/// create revision `rev` owns every member. `first_member_only` is the PLANTED BUG
/// (`LOCKD_PLANTED_BUG_GANG_FIRST_MEMBER_ONLY=1`, tests only): look at the first member's
/// queue only, so a gang first there but behind elsewhere is wrongly granted.
pub fn standing(rev: i64, queues: &[MemberQueue], first_member_only: bool) -> GangStanding {
    let looked: &[MemberQueue] = if first_member_only {
        &queues[..queues.len().min(1)]
    } else {
        queues
    };
    let mut first_behind: Option<(&MemberQueue, Vec<&QueueEntry>)> = None;
    let mut position = 0;
    for q in looked {
        if !q.entries.iter().any(|e| e.create_revision == rev) {
            return GangStanding::Gone {
                member: q.resource.clone(),
            };
        }
        let mut older: Vec<&QueueEntry> = q
            .entries
            .iter()
            .filter(|e| e.create_revision < rev)
            .collect();
        if older.is_empty() {
            continue;
        }
        older.sort_by_key(|e| e.create_revision);
        position = position.max(older.len());
        if first_behind.is_none() {
            first_behind = Some((q, older));
        }
    }
    match first_behind {
        None => GangStanding::Owner,
        Some((q, older)) => {
            let (first, pred) = (older[0], older[older.len() - 1]);
            GangStanding::Behind {
                member: q.resource.clone(),
                position,
                predecessor: pred.key.clone(),
                predecessor_rev: pred.create_revision,
                owner_value: first.value.clone(),
            }
        }
    }
}

/// Put the gang's keys (one per member, attached to `lease`) in one transaction, each only if
/// absent; their common create revision. A retry after an answer that was lost finds every
/// key present with one create revision and returns it.
pub async fn enqueue(
    client: &mut Client,
    limit: Duration,
    keys: &[String],
    value: &str,
    lease: i64,
) -> Result<i64, EtcdError> {
    let when: Vec<Compare> = keys
        .iter()
        .map(|k| Compare::create_revision(k.as_str(), CompareOp::Equal, 0))
        .collect();
    let puts: Vec<TxnOp> = keys
        .iter()
        .map(|k| TxnOp::put(k.as_str(), value, Some(PutOptions::new().with_lease(lease))))
        .collect();
    let gets: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(k.as_str(), None)).collect();
    let txn = Txn::new().when(when).and_then(puts).or_else(gets);
    let resp = bounded(limit, client.txn(txn)).await?;
    if resp.succeeded() {
        return resp
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| EtcdError::Unexpected("txn answer without a header".into()));
    }
    let mut revs = Vec::new();
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(g) = op {
            revs.push(g.kvs().first().map(|kv| kv.create_revision()));
        }
    }
    existing_revision(&revs).ok_or_else(|| {
        EtcdError::Unexpected(format!(
            "the gang's keys are partly in etcd already (create revisions {revs:?}): not put"
        ))
    })
}

/// The common create revision when every key exists with one (None otherwise).
pub fn existing_revision(revs: &[Option<i64>]) -> Option<i64> {
    let first = (*revs.first()?)?;
    revs.iter().all(|r| *r == Some(first)).then_some(first)
}

/// Every member's queue up to revision `rev` (create order), in one consistent snapshot: one
/// transaction of range reads.
pub async fn read_queues(
    client: &mut Client,
    limit: Duration,
    prefix: &str,
    members: &[String],
    rev: i64,
) -> Result<Vec<MemberQueue>, EtcdError> {
    let gets: Vec<TxnOp> = members
        .iter()
        .map(|m| {
            TxnOp::get(
                mutex::resource_prefix(prefix, m),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_max_create_revision(rev)
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            )
        })
        .collect();
    let resp = bounded(limit, client.txn(Txn::new().and_then(gets))).await?;
    let ranges: Vec<_> = resp
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        })
        .collect();
    if ranges.len() != members.len() {
        return Err(EtcdError::Unexpected(format!(
            "{} range answers for {} members",
            ranges.len(),
            members.len()
        )));
    }
    Ok(members
        .iter()
        .zip(ranges)
        .map(|(m, g)| MemberQueue {
            resource: m.clone(),
            entries: g
                .kvs()
                .iter()
                .map(|kv| QueueEntry {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    create_revision: kv.create_revision(),
                    value: String::from_utf8_lossy(kv.value()).into_owned(),
                })
                .collect(),
        })
        .collect())
}

/// Delete every key of a gang in one transaction (a release, a cancelled or busy wait).
pub async fn delete_all(
    client: &mut Client,
    limit: Duration,
    keys: &[String],
) -> Result<(), EtcdError> {
    let dels: Vec<TxnOp> = keys
        .iter()
        .map(|k| TxnOp::delete(k.as_str(), None))
        .collect();
    bounded(limit, client.txn(Txn::new().and_then(dels)))
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(resource: &str, entries: &[(i64, &str)]) -> MemberQueue {
        MemberQueue {
            resource: resource.into(),
            entries: entries
                .iter()
                .map(|(rev, v)| QueueEntry {
                    key: format!("/l/{resource}/{rev:016x}"),
                    create_revision: *rev,
                    value: v.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn keys_name_each_member_with_the_session_lease() {
        let k = member_keys("/lockd", &["a".into(), "gpu/0".into()], 0x2a);
        assert_eq!(
            k,
            vec!["/lockd/a/000000000000002a", "/lockd/gpu/0/000000000000002a"]
        );
        for (key, m) in k.iter().zip(["a", "gpu/0"]) {
            assert_eq!(
                mutex::parse_lock_key("/lockd", key),
                Some((m.to_string(), 0x2a))
            );
        }
    }

    #[test]
    fn owner_only_when_first_in_every_member() {
        // Alone everywhere.
        let qs = [q("a", &[(10, "g")]), q("b", &[(10, "g")])];
        assert_eq!(standing(10, &qs, false), GangStanding::Owner);
        // Order of entries within a queue does not matter.
        let qs = [
            q("a", &[(10, "g"), (7, "x@A"), (3, "o@B")]),
            q("b", &[(10, "g")]),
        ];
        assert_eq!(
            standing(10, &qs, false),
            GangStanding::Behind {
                member: "a".into(),
                position: 2,
                predecessor: "/l/a/0000000000000007".into(),
                predecessor_rev: 7,
                owner_value: "o@B".into(),
            }
        );
    }

    #[test]
    fn first_in_the_first_member_only_is_not_owner() {
        let qs = [
            q("a", &[(10, "g")]),
            q("b", &[(4, "single@B"), (10, "g")]),
            q("c", &[(2, "c1"), (5, "c2"), (8, "c3"), (10, "g")]),
        ];
        assert_eq!(
            standing(10, &qs, false),
            GangStanding::Behind {
                member: "b".into(),
                position: 3,
                predecessor: "/l/b/0000000000000004".into(),
                predecessor_rev: 4,
                owner_value: "single@B".into(),
            }
        );
        // The planted bug grants it.
        assert_eq!(standing(10, &qs, true), GangStanding::Owner);
    }

    #[test]
    fn a_missing_key_is_never_owner() {
        // The lease expired while waiting: nothing older, but our key is gone in b.
        let qs = [q("a", &[(10, "g")]), q("b", &[])];
        assert_eq!(
            standing(10, &qs, false),
            GangStanding::Gone { member: "b".into() }
        );
        let qs = [q("a", &[(3, "x"), (10, "g")]), q("b", &[(3, "x")])];
        assert_eq!(
            standing(10, &qs, false),
            GangStanding::Gone { member: "b".into() }
        );
    }

    #[test]
    fn two_gangs_in_opposite_member_order_wait_one_way_only() {
        // {x,y} at revision 20 and {y,x} at 21: whatever the member order, 20 is first in
        // both, 21 behind in both, waiting on 20's key in its first member (y).
        let g20 = [q("x", &[(20, "g20")]), q("y", &[(20, "g20")])];
        let g21 = [
            q("y", &[(20, "g20"), (21, "g21")]),
            q("x", &[(20, "g20"), (21, "g21")]),
        ];
        assert_eq!(standing(20, &g20, false), GangStanding::Owner);
        assert!(matches!(
            standing(21, &g21, false),
            GangStanding::Behind { member, position: 1, .. } if member == "y"
        ));
    }

    #[test]
    fn existing_keys_must_share_one_revision() {
        assert_eq!(existing_revision(&[Some(5), Some(5)]), Some(5));
        assert_eq!(existing_revision(&[Some(5), None]), None);
        assert_eq!(existing_revision(&[Some(5), Some(6)]), None);
        assert_eq!(existing_revision(&[None, None]), None);
        assert_eq!(existing_revision(&[]), None);
    }

    #[test]
    fn only_connection_bound_exclusive_gangs_are_served() {
        let g = |f: fn(&mut AcquireExt)| {
            let mut e = AcquireExt {
                gang: Some(vec!["a".into(), "b".into()]),
                ..AcquireExt::default()
            };
            f(&mut e);
            is_exclusive_gang(&e)
        };
        assert!(g(|_| {}));
        assert!(g(|e| e.timeout_ms = Some(100)));
        assert!(!g(|e| e.ttl_ms = Some(1000)));
        assert!(!g(|e| e.mode = Some(crate::proto::Mode::Shared)));
        assert!(!g(|e| e.reserve_ms = Some(1000)));
        assert!(!g(|e| e.quantity = Some(1)));
        assert!(!is_exclusive_gang(&AcquireExt::default()));
    }
}
