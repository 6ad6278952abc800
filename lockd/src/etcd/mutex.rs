//! etcd's mutex recipe, one lock per resource, and the fenced put.
//!
//! Each waiter puts the key `<prefix>/<resource>/<lease-id in hex>` attached to its session's
//! etcd lease (if absent: a transaction on `create_revision == 0`), so the key dies with the
//! lease. The owner is the key with the lowest create revision under `<prefix>/<resource>/`;
//! every other waiter watches only the deletion of its predecessor (the key with the
//! greatest create revision below its own), then checks again: no herd. The lock key's
//! create revision is the grant's **epoch**: etcd's revisions are cluster-wide and strictly
//! increasing, so a later owner always has a greater epoch.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};

/// What can go wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The etcd client reported an error (unreachable, lease not found, ...).
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    /// An etcd call did not finish in time.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// etcd answered something the recipe does not expect.
    #[error("etcd answered unexpectedly: {0}")]
    Unexpected(String),
}

/// Bound an etcd call.
pub async fn bounded<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(EtcdError::from),
        Err(_) => Err(EtcdError::Timeout(limit)),
    }
}

/// The key range of one resource's lock: `<prefix>/<resource>/`.
pub fn resource_prefix(prefix: &str, resource: &str) -> String {
    format!("{prefix}/{resource}/")
}

/// One waiter's lock key.
pub fn lock_key(prefix: &str, resource: &str, lease: i64) -> String {
    format!("{prefix}/{resource}/{lease:016x}")
}

/// Split a lock key into (resource, lease) (None: not a lock key under `prefix`).
pub fn parse_lock_key(prefix: &str, key: &str) -> Option<(String, i64)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix('/')?;
    let (resource, lease) = rest.rsplit_once('/')?;
    if resource.is_empty() || lease.len() != 16 {
        return None;
    }
    let lease = u64::from_str_radix(lease, 16).ok()? as i64;
    Some((resource.to_string(), lease))
}

/// The data key a fenced put writes: `<prefix>.data/<key>` (outside every lock's range).
pub fn data_key(prefix: &str, key: &str) -> String {
    format!("{prefix}.data/{key}")
}

/// A lock key in etcd: what `status` shows of a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockEntry {
    /// The resource.
    pub resource: String,
    /// The owning etcd lease.
    pub lease: i64,
    /// Create revision (the epoch when it is the owner).
    pub create_revision: i64,
    /// The stored value: the holder's name and its lockd (`holder@node`).
    pub value: String,
}

/// Put our key if it is not there; its create revision.
pub async fn enqueue(
    client: &mut Client,
    limit: Duration,
    key: &str,
    value: &str,
    lease: i64,
) -> Result<i64, EtcdError> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(key, None)]);
    let resp = bounded(limit, client.txn(txn)).await?;
    if resp.succeeded() {
        let rev = resp
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| EtcdError::Unexpected("txn answer without a header".into()))?;
        return Ok(rev);
    }
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(g) = op {
            if let Some(kv) = g.kvs().first() {
                return Ok(kv.create_revision());
            }
        }
    }
    Err(EtcdError::Unexpected(format!(
        "{key}: neither created nor found"
    )))
}

/// The owner (lowest create revision) of a resource's lock, if any.
pub async fn owner(
    client: &mut Client,
    limit: Duration,
    prefix: &str,
    resource: &str,
) -> Result<Option<LockEntry>, EtcdError> {
    let opts = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1);
    let resp = bounded(
        limit,
        client.get(resource_prefix(prefix, resource), Some(opts)),
    )
    .await?;
    Ok(resp.kvs().first().and_then(|kv| entry(prefix, kv)))
}

fn entry(prefix: &str, kv: &etcd_client::KeyValue) -> Option<LockEntry> {
    let key = std::str::from_utf8(kv.key()).ok()?;
    let (resource, lease) = parse_lock_key(prefix, key)?;
    Some(LockEntry {
        resource,
        lease,
        create_revision: kv.create_revision(),
        value: String::from_utf8_lossy(kv.value()).into_owned(),
    })
}

/// Every lock key under `prefix` (at most `max`), by resource then create revision.
pub async fn all_locks(
    client: &mut Client,
    limit: Duration,
    prefix: &str,
    max: i64,
) -> Result<Vec<LockEntry>, EtcdError> {
    let opts = GetOptions::new().with_prefix().with_limit(max);
    let resp = bounded(limit, client.get(format!("{prefix}/"), Some(opts))).await?;
    let mut v: Vec<LockEntry> = resp
        .kvs()
        .iter()
        .filter_map(|kv| entry(prefix, kv))
        .collect();
    v.sort_by(|a, b| {
        (a.resource.as_str(), a.create_revision).cmp(&(b.resource.as_str(), b.create_revision))
    });
    Ok(v)
}

/// Where a waiter stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Our key is the oldest: the lock is ours.
    Owner,
    /// Keys older than ours: `ahead` of them; the closest is `predecessor`.
    Behind {
        /// How many keys are older than ours.
        ahead: i64,
        /// The key created just before ours.
        predecessor: String,
        /// Its create revision: the same key name can be created again (a session that
        /// releases and acquires again puts the same key), so "still there" means "still
        /// there with this create revision".
        predecessor_rev: i64,
        /// The owner's value (holder@node), for `busy`.
        owner_value: String,
    },
}

/// Where the key with create revision `my_rev` stands in `resource`'s line: one range read
/// of the resource's keys (in create order, ours and the older ones). Our own key must be in
/// that read: a key whose lease expired or was revoked while we waited (etcd deleted it) has
/// no standing at all, and "nothing older than mine" must not make it the owner (the drill
/// across nodes saw two lockds grant at once that way); that is an error, and the session's
/// fence reports its lost lease.
pub async fn standing(
    client: &mut Client,
    limit: Duration,
    prefix: &str,
    resource: &str,
    my_rev: i64,
) -> Result<Standing, EtcdError> {
    let opts = GetOptions::new()
        .with_prefix()
        .with_max_create_revision(my_rev)
        .with_sort(SortTarget::Create, SortOrder::Ascend);
    let resp = bounded(
        limit,
        client.get(resource_prefix(prefix, resource), Some(opts)),
    )
    .await?;
    if !resp.kvs().iter().any(|kv| kv.create_revision() == my_rev) {
        return Err(EtcdError::Unexpected(format!(
            "our lock key (create revision {my_rev}) is gone: its etcd lease expired or was revoked"
        )));
    }
    // The filter is applied by etcd, but count on what came back, not on `count` (etcd
    // counts the range before filtering).
    let older: Vec<&etcd_client::KeyValue> = resp
        .kvs()
        .iter()
        .filter(|kv| kv.create_revision() < my_rev)
        .collect();
    let (Some(first), Some(pred)) = (older.first(), older.last()) else {
        return Ok(Standing::Owner);
    };
    Ok(Standing::Behind {
        ahead: older.len() as i64,
        predecessor: String::from_utf8_lossy(pred.key()).into_owned(),
        predecessor_rev: pred.create_revision(),
        owner_value: String::from_utf8_lossy(first.value()).into_owned(),
    })
}

/// Wait until `key`, created at `create_rev`, is deleted: watch it from now, and once etcd
/// confirms the watch, check the key still exists **with that create revision** (a deletion
/// before the watch began is then seen by the read, one after it by the watch: none is
/// missed). The revision matters: a session that releases and acquires again puts the same
/// key name, and a deletion followed by that re-creation before the watch began would look
/// like "still there" — the waiter would then wait behind a key that is now queued behind it
/// (found by the etcd bench's 64-client throughput phase: every client stalled). Watching "from now" keeps the watcher in etcd's synced set;
/// a watch from a past revision starts unsynced and etcd delivers its events only at its next
/// catch-up round (every 100 ms), which is what the handoff's tail was made of. Returns true
/// when the key is gone, false when the watch ended without seeing that (etcd cancelled it);
/// the caller checks its standing again either way.
pub async fn wait_deleted(
    client: &mut Client,
    limit: Duration,
    key: &str,
    create_rev: i64,
) -> Result<bool, EtcdError> {
    let opts = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
    let mut stream = bounded(limit, client.watch(key, Some(opts))).await?;
    let deleted = |resp: &etcd_client::WatchResponse| {
        resp.events()
            .iter()
            .any(|e| e.event_type() == EventType::Delete)
    };
    // The watch's `created` answer first (bounded).
    loop {
        let Some(resp) = bounded(limit, stream.message()).await? else {
            return Ok(false);
        };
        if deleted(&resp) {
            return Ok(true);
        }
        if resp.canceled() {
            return Ok(false);
        }
        if resp.created() {
            break;
        }
    }
    let now = bounded(limit, client.get(key, None)).await?;
    if !now
        .kvs()
        .iter()
        .any(|kv| kv.create_revision() == create_rev || planted_wait_by_name())
    {
        return Ok(true);
    }
    loop {
        match stream.message().await? {
            None => return Ok(false),
            Some(resp) if deleted(&resp) => return Ok(true),
            Some(resp) if resp.canceled() => return Ok(false),
            Some(_) => {}
        }
    }
}

/// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_WAIT_BY_NAME=1`): [`wait_deleted`] takes any
/// key of that name for the predecessor, as it did before the create revision was checked.
fn planted_wait_by_name() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LOCKD_PLANTED_BUG_WAIT_BY_NAME").is_ok_and(|v| v == "1"))
}

/// Delete one key (a released lock, a cancelled wait).
pub async fn delete(client: &mut Client, limit: Duration, key: &str) -> Result<(), EtcdError> {
    bounded(limit, client.delete(key, None)).await.map(|_| ())
}

/// The outcome of a fenced put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FencedPut {
    /// Written at this store revision.
    Written {
        /// The revision of the write.
        revision: i64,
    },
    /// The lock key no longer has this create revision: the caller is not the owner any
    /// more (`current`: the create revision now there, 0 if the key is gone).
    Stale {
        /// The lock key's current create revision (0: gone).
        current: i64,
    },
}

/// Write `data_key = value` (attached to `lease`, so it dies with the session) only if the
/// lock key still has create revision `epoch`: one etcd transaction.
pub async fn put_fenced(
    client: &mut Client,
    limit: Duration,
    lock_key: &str,
    epoch: i64,
    data_key: &str,
    value: &str,
    lease: i64,
) -> Result<FencedPut, EtcdError> {
    let txn = Txn::new()
        .when([Compare::create_revision(lock_key, CompareOp::Equal, epoch)])
        .and_then([TxnOp::put(
            data_key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(lock_key, None)]);
    fenced_outcome(bounded(limit, client.txn(txn)).await?)
}

/// Delete `data_key` only while `lock_key`'s create revision is still `epoch` (the fenced
/// put's counterpart: a stale holder cannot delete its successor's registration).
pub async fn delete_fenced(
    client: &mut Client,
    limit: Duration,
    lock_key: &str,
    epoch: i64,
    data_key: &str,
) -> Result<FencedPut, EtcdError> {
    let txn = Txn::new()
        .when([Compare::create_revision(lock_key, CompareOp::Equal, epoch)])
        .and_then([TxnOp::delete(data_key, None)])
        .or_else([TxnOp::get(lock_key, None)]);
    fenced_outcome(bounded(limit, client.txn(txn)).await?)
}

fn fenced_outcome(resp: etcd_client::TxnResponse) -> Result<FencedPut, EtcdError> {
    if resp.succeeded() {
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        return Ok(FencedPut::Written { revision });
    }
    let mut current = 0;
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(g) = op {
            if let Some(kv) = g.kvs().first() {
                current = kv.create_revision();
            }
        }
    }
    Ok(FencedPut::Stale { current })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_round_trip() {
        let k = lock_key("/lockd", "engine", 0x694d_7f3a_1b2c);
        assert_eq!(k, "/lockd/engine/0000694d7f3a1b2c");
        assert_eq!(
            parse_lock_key("/lockd", &k),
            Some(("engine".to_string(), 0x694d_7f3a_1b2c))
        );
        // A resource with a slash: the lease is the last component.
        let k = lock_key("/lockd", "a/b", 7);
        assert_eq!(parse_lock_key("/lockd", &k), Some(("a/b".to_string(), 7)));
        assert_eq!(parse_lock_key("/lockd", "/lockd/engine/xyz"), None);
        assert_eq!(
            parse_lock_key("/lockd", "/other/engine/0000000000000007"),
            None
        );
        assert_eq!(parse_lock_key("/lockd", "/lockd//0000000000000007"), None);
    }

    #[test]
    fn data_keys_are_outside_every_lock_range() {
        let d = data_key("/lockd", "svc/engine");
        assert_eq!(d, "/lockd.data/svc/engine");
        assert!(!d.starts_with("/lockd/"));
    }
}
