//! TTL leases on the etcd backend: the driver (etcd calls, tasks). The pure parts (deadline
//! arithmetic, value encoding, token check) are [`crate::etcd::ttl`]; docs/ETCD.md, "TTL
//! leases on etcd", says what differs from the file backend.
//!
//! Each TTL lease is an etcd lease of its own and one lock key attached to it. Every request
//! (`renew`, `release`, `revoke`, `resume`, `lease`) finds the lease in etcd by its id
//! (`TimeToLive` with its keys → the lock key → its value) and is answered inline, in request
//! order. A lease whose events go to a connection of this lockd has one task here (its
//! *binder*): it tells that connection `lease_ended` at the lease's deadline (re-read from the
//! key, which every `renew` on any lockd rewrites) or when the key goes (revoked or released
//! elsewhere), and stops quietly when the lease is resumed elsewhere. A waiting request has
//! one task too: it keeps its etcd lease alive and waits for its predecessor's deletion (the
//! mutex recipe), then becomes the lease's binder.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{error_line, token, unix_ms, Ctx, Session};
use crate::etcd::mutex::{self, EtcdError, Standing};
use crate::etcd::ttl::{self, TtlRefusal, TtlValue};
use crate::proto::{ErrorCode, Event, LeaseFields, LeaseKind, LeaseReport, Notice, NoticeKind};

/// Tombstones this lockd keeps (oldest forgotten first) and for how long.
const MAX_TOMBS: usize = 1000;
const TOMB_AGE: Duration = Duration::from_secs(3600);

/// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_TTL_LATE_DEADLINE=1`): the holder's deadline is
/// read after the etcd call and taken from etcd's TTL plus a second ([`ttl::planted_late_deadline`]),
/// so it lies past etcd's expiry.
fn planted_late_deadline() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LOCKD_PLANTED_BUG_TTL_LATE_DEADLINE").is_ok_and(|v| v == "1"))
}

/// The deadline of a grant or renewal whose etcd call was sent at `sent_ms` (read before it).
fn deadline_of(sent_ms: u64, ttl_ms: u64, granted_secs: i64) -> u64 {
    if planted_late_deadline() {
        ttl::planted_late_deadline(unix_ms(), granted_secs)
    } else {
        ttl::deadline(sent_ms, ttl_ms)
    }
}

/// A `notice` to this lockd's watchers of a TTL lease's change.
#[allow(clippy::too_many_arguments)]
fn notify(
    ctx: &Ctx,
    kind: NoticeKind,
    id: i64,
    resource: &str,
    holder: &str,
    epoch: u64,
    session: Option<u64>,
    reclaimed: bool,
    reason: Option<&str>,
) {
    ctx.reg().notify(Notice {
        kind,
        resource: resource.to_string(),
        holder: Some(holder.to_string()),
        epoch,
        session,
        reclaimed,
        after_revoke: false,
        reason: reason.map(str::to_string),
        at_unix_ms: unix_ms(),
        lease_id: Some(id as u64),
        lease_kind: Some(LeaseKind::Ttl),
        version: None,
    });
}

fn ended_kind(reason: &str) -> NoticeKind {
    match ttl::state_of_reason(reason) {
        "expired" => NoticeKind::Expired,
        "revoked" => NoticeKind::Revoked,
        _ => NoticeKind::Released,
    }
}

/// A request of a session of this lockd waiting for its resource.
struct Wait {
    session: u64,
    resource: String,
    task: JoinHandle<()>,
}

/// A held lease whose events go to a session of this lockd.
struct Bound {
    session: u64,
    resource: String,
    expires_at_unix_ms: u64,
    task: JoinHandle<()>,
}

struct Tomb {
    report: LeaseReport,
    at: Instant,
}

/// This lockd's TTL state: its waiting requests, its bound leases, its tombstones.
#[derive(Default)]
pub(super) struct TtlShared {
    inner: Mutex<TtlState>,
}

#[derive(Default)]
struct TtlState {
    waits: BTreeMap<i64, Wait>,
    bound: BTreeMap<i64, Bound>,
    tombs: BTreeMap<i64, Tomb>,
}

impl TtlShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, TtlState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl TtlState {
    fn tomb(&mut self, id: i64, report: LeaseReport) {
        let now = Instant::now();
        self.tombs
            .retain(|_, t| now.saturating_duration_since(t.at) < TOMB_AGE);
        while self.tombs.len() >= MAX_TOMBS {
            let oldest = self
                .tombs
                .iter()
                .min_by_key(|(_, t)| t.at)
                .map(|(id, _)| *id);
            match oldest {
                Some(o) => self.tombs.remove(&o),
                None => break,
            };
        }
        self.tombs.insert(
            id,
            Tomb {
                report,
                at: Instant::now(),
            },
        );
    }
    fn tomb_reason(&self, id: i64) -> Option<(String, String)> {
        let t = self.tombs.get(&id)?;
        Some((
            t.report.reason.clone().unwrap_or_else(|| "ended".into()),
            t.report.resource.clone().unwrap_or_default(),
        ))
    }
}

/// An ended lease's tombstone report.
#[allow(clippy::too_many_arguments)]
fn ended_report(
    id: i64,
    resource: &str,
    holder: &str,
    epoch: u64,
    ttl_ms: u64,
    granted_at_unix_ms: Option<u64>,
    reason: &str,
) -> LeaseReport {
    LeaseReport {
        lease_id: id as u64,
        state: ttl::state_of_reason(reason).into(),
        kind: Some(LeaseKind::Ttl),
        resource: Some(resource.to_string()),
        holder: Some(holder.to_string()),
        epoch: Some(epoch),
        reason: Some(reason.to_string()),
        ended_at_unix_ms: Some(unix_ms()),
        granted_at_unix_ms,
        session: None,
        renewal_refused: None,
        lease: LeaseFields {
            ttl_ms: Some(ttl_ms),
            ..LeaseFields::default()
        },
    }
}

/// A TTL lease as found in etcd.
struct Found {
    id: i64,
    key: String,
    resource: String,
    rev: i64,
    mod_rev: i64,
    value: TtlValue,
    owner: bool,
}

impl Found {
    fn report(&self, session: Option<u64>, now_ms: u64) -> LeaseReport {
        let ended = if self.owner {
            self.value.end_reason(now_ms)
        } else {
            self.value.ended.clone()
        };
        let state = match (&ended, self.owner) {
            (Some(r), _) => ttl::state_of_reason(r),
            (None, true) => "held",
            (None, false) => "waiting",
        };
        LeaseReport {
            lease_id: self.id as u64,
            state: state.into(),
            kind: Some(LeaseKind::Ttl),
            resource: Some(self.resource.clone()),
            holder: Some(self.value.holder.clone()),
            epoch: self.owner.then_some(self.rev as u64),
            reason: ended,
            ended_at_unix_ms: None,
            granted_at_unix_ms: self.value.granted_at_unix_ms,
            session,
            renewal_refused: None,
            lease: LeaseFields {
                ttl_ms: Some(self.value.ttl_ms),
                expires_at_unix_ms: if self.owner {
                    self.value.expires_at_unix_ms
                } else {
                    None
                },
                ..LeaseFields::default()
            },
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> TtlRefusal {
    TtlRefusal::Unavailable(e.to_string())
}

/// Find lease `lease_id` (a local tombstone first, then etcd).
async fn lookup(ctx: &Ctx, lease_id: u64) -> Result<Found, TtlRefusal> {
    let Some(id) = ttl::etcd_lease_id(lease_id) else {
        return Err(TtlRefusal::UnknownLease(lease_id));
    };
    if let Some((reason, _)) = ctx.ttl.lock().tomb_reason(id) {
        return Err(TtlRefusal::Ended {
            id: lease_id,
            reason,
        });
    }
    let limit = ctx.cfg.op_timeout;
    let mut client = ctx.client.clone();
    let ttl_resp = mutex::bounded(
        limit,
        client.lease_time_to_live(id, Some(LeaseTimeToLiveOptions::new().with_keys())),
    )
    .await
    .map_err(unavailable)?;
    if ttl_resp.ttl() < 0 {
        return Err(TtlRefusal::UnknownLease(lease_id));
    }
    let lock = ttl_resp.keys().iter().find_map(|k| {
        let k = std::str::from_utf8(k).ok()?;
        mutex::parse_lock_key(&ctx.cfg.prefix, k).map(|(r, _)| (k.to_string(), r))
    });
    let Some((key, resource)) = lock else {
        return Err(TtlRefusal::WrongLease(format!(
            "lease {lease_id} is not a TTL lease (an etcd lease of a lockd session, without a TTL lock key)"
        )));
    };
    let got = mutex::bounded(limit, client.get(key.as_str(), None))
        .await
        .map_err(unavailable)?;
    let Some(kv) = got.kvs().first() else {
        return Err(TtlRefusal::UnknownLease(lease_id));
    };
    let Some(value) = TtlValue::decode(&String::from_utf8_lossy(kv.value())) else {
        return Err(TtlRefusal::WrongLease(format!(
            "lease {lease_id} is a connection-bound lease (version 1), not a TTL lease: it ends with its connection, not by lease_id"
        )));
    };
    let (rev, mod_rev) = (kv.create_revision(), kv.mod_revision());
    let owner = match mutex::standing(&mut client, limit, &ctx.cfg.prefix, &resource, rev).await {
        Ok(Standing::Owner) => true,
        Ok(Standing::Behind { .. }) => false,
        Err(e) => return Err(unavailable(e)),
    };
    Ok(Found {
        id,
        key,
        resource,
        rev,
        mod_rev,
        value,
        owner,
    })
}

/// Put `value` on `key` (attached to `lease`) only if the key's mod revision is still
/// `mod_rev`: false if somebody wrote it (or it went) meanwhile.
async fn put_if(
    ctx: &Ctx,
    key: &str,
    mod_rev: i64,
    value: &TtlValue,
    lease: i64,
) -> Result<bool, EtcdError> {
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, mod_rev)])
        .and_then([TxnOp::put(
            key,
            value.encode(),
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let mut client = ctx.client.clone();
    let r = mutex::bounded(ctx.cfg.op_timeout, client.txn(txn)).await?;
    Ok(r.succeeded())
}

fn spawn_revoke(ctx: std::sync::Arc<Ctx>, id: i64, why: &'static str) {
    tokio::spawn(async move {
        let mut client = ctx.client.clone();
        for attempt in 0..5u32 {
            match mutex::bounded(ctx.cfg.op_timeout, client.lease_revoke(id)).await {
                Ok(_) => {
                    ctx.live_leases().remove(&id);
                    info!(lease = id, why, "ttl: etcd lease revoked");
                    return;
                }
                Err(e) => {
                    warn!(lease = id, attempt, error = %e, why, "ttl: cannot revoke the etcd lease; retrying");
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
            }
        }
    });
}

fn lease_not_found(e: &EtcdError) -> bool {
    matches!(
        e,
        EtcdError::Client(etcd_client::Error::LeaseKeepAliveError(_))
    )
}

/// One keepalive of etcd lease `id` (etcd-client sends it and reads its answer when it
/// opens the stream): Ok(true) renewed, Ok(false) when etcd no longer has the lease (TTL ≤ 0),
/// Err when etcd did not answer.
async fn keep_alive_once(ctx: &Ctx, id: i64) -> Result<bool, EtcdError> {
    let mut client = ctx.client.clone();
    match mutex::bounded(ctx.cfg.op_timeout, client.lease_keep_alive(id)).await {
        Ok((_keeper, _stream)) => Ok(true),
        Err(e) if lease_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

#[allow(clippy::too_many_arguments)]
fn granted_line(
    resource: &str,
    holder: &str,
    epoch: u64,
    token: &str,
    reclaimed: bool,
    id: i64,
    ttl_ms: u64,
    expires_at: u64,
) -> String {
    Event::Granted {
        resource: resource.to_string(),
        holder: holder.to_string(),
        epoch,
        token: token.to_string(),
        reclaimed,
        lease: LeaseFields {
            lease_id: Some(id as u64),
            kind: Some(LeaseKind::Ttl),
            ttl_ms: Some(ttl_ms),
            expires_at_unix_ms: Some(expires_at),
            ..LeaseFields::default()
        },
    }
    .encode()
}

fn lease_ended_line(id: i64, resource: &str, epoch: u64, reason: &str) -> String {
    Event::LeaseEnded {
        lease_id: id as u64,
        resource: resource.to_string(),
        epoch,
        reason: reason.to_string(),
    }
    .encode()
}

/// What a binder needs to know of its lease.
struct BindSpec {
    id: i64,
    key: String,
    resource: String,
    holder: String,
    epoch: u64,
    ttl_ms: u64,
    granted_at_unix_ms: Option<u64>,
    me: String,
    session: u64,
    out: mpsc::Sender<String>,
}

/// End of a bound lease seen by its binder: tombstone, tell the session (unless released).
fn binder_ended(ctx: &Ctx, b: &BindSpec, reason: &str) {
    {
        let mut st = ctx.ttl.lock();
        if st.bound.get(&b.id).is_some_and(|x| x.session == b.session) {
            st.bound.remove(&b.id);
        }
        st.tomb(
            b.id,
            ended_report(
                b.id,
                &b.resource,
                &b.holder,
                b.epoch,
                b.ttl_ms,
                b.granted_at_unix_ms,
                reason,
            ),
        );
    }
    info!(lease = b.id, resource = %b.resource, holder = %b.holder, epoch = b.epoch, session = b.session, reason, "ttl lease ended");
    notify(
        ctx,
        ended_kind(reason),
        b.id,
        &b.resource,
        &b.holder,
        b.epoch,
        Some(b.session),
        false,
        Some(reason),
    );
    if reason != "released" {
        let _ = b
            .out
            .try_send(lease_ended_line(b.id, &b.resource, b.epoch, reason));
    }
}

fn binder_unbound(ctx: &Ctx, b: &BindSpec, why: &str) {
    let mut st = ctx.ttl.lock();
    if st.bound.get(&b.id).is_some_and(|x| x.session == b.session) {
        st.bound.remove(&b.id);
    }
    info!(lease = b.id, resource = %b.resource, session = b.session, why, "ttl lease no longer bound here");
}

/// Millis until `at` (Unix ms).
fn until(at: u64) -> Duration {
    Duration::from_millis(at.saturating_sub(unix_ms()))
}

/// The deadline passed: tell the bound session at once (no etcd round trip first), then
/// record it in etcd (best effort, only over the value this binder last saw: a renewal that
/// raced in keeps its write, and the holder was told early, the safe direction).
async fn binder_expired(ctx: &Ctx, b: &BindSpec, known: Option<(i64, TtlValue)>) {
    binder_ended(ctx, b, "expired");
    if let Some((mod_rev, v)) = known {
        let ended = TtlValue {
            ended: Some("expired".into()),
            ..v
        };
        match put_if(ctx, &b.key, mod_rev, &ended, b.id).await {
            Ok(true) => {}
            Ok(false) => info!(
                lease = b.id,
                "ttl: the key changed at the deadline; not marked expired"
            ),
            Err(e) => warn!(lease = b.id, error = %e, "ttl: cannot mark the lease expired in etcd"),
        }
    }
}

/// What a binder does with a value it read or was sent: None to go on.
enum Seen {
    Ended(String),
    Unbound,
}

fn seen_value(b: &BindSpec, v: &TtlValue, expires_at: &mut u64) -> Option<Seen> {
    if v.bound.as_deref() != Some(b.me.as_str()) {
        return Some(Seen::Unbound);
    }
    if let Some(r) = &v.ended {
        return Some(Seen::Ended(r.clone()));
    }
    if let Some(d) = v.expires_at_unix_ms {
        *expires_at = (*expires_at).max(d);
    }
    None
}

/// The binder: tell the bound session when the lease ends; see the module docs.
async fn binder(ctx: std::sync::Arc<Ctx>, b: BindSpec, mut expires_at: u64) {
    let limit = ctx.cfg.op_timeout;
    let mut client = ctx.client.clone();
    let mut known: Option<(i64, TtlValue)> = None;
    let deleted_reason = |prev: Option<TtlValue>, expires_at: u64| match prev.and_then(|v| v.ended)
    {
        Some(r) => r,
        None if unix_ms() >= expires_at => "expired".to_string(),
        None => "revoked:etcd:the lease's etcd lease ended".to_string(),
    };
    loop {
        if unix_ms() >= expires_at {
            return binder_expired(&ctx, &b, known).await;
        }
        let opts = WatchOptions::new().with_prev_key();
        let opened = tokio::select! {
            r = mutex::bounded(limit, client.watch(b.key.as_str(), Some(opts))) => r.ok(),
            _ = tokio::time::sleep(until(expires_at)) => continue,
        };
        let Some(mut stream) = opened else {
            tokio::time::sleep(Duration::from_millis(50).min(until(expires_at))).await;
            continue;
        };
        // Where the key stands now (a change before the watch began is seen here).
        let now_kv = tokio::select! {
            r = mutex::bounded(limit, client.get(b.key.as_str(), None)) => r,
            _ = tokio::time::sleep(until(expires_at)) => continue,
        };
        match now_kv {
            Ok(r) => match r.kvs().first() {
                None => {
                    let prev = known.map(|(_, v)| v);
                    return binder_ended(&ctx, &b, &deleted_reason(prev, expires_at));
                }
                Some(kv) => {
                    if let Some(v) = TtlValue::decode(&String::from_utf8_lossy(kv.value())) {
                        match seen_value(&b, &v, &mut expires_at) {
                            Some(Seen::Unbound) => {
                                return binder_unbound(&ctx, &b, "resumed elsewhere")
                            }
                            Some(Seen::Ended(r)) => return binder_ended(&ctx, &b, &r),
                            None => known = Some((kv.mod_revision(), v)),
                        }
                    }
                }
            },
            Err(e) => {
                warn!(lease = b.id, error = %e, "ttl: cannot read the lease's key");
                tokio::time::sleep(Duration::from_millis(100).min(until(expires_at))).await;
                continue;
            }
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(until(expires_at)) => {
                    return binder_expired(&ctx, &b, known).await;
                }
                m = stream.message() => match m {
                    Ok(Some(resp)) => {
                        for ev in resp.events() {
                            match ev.event_type() {
                                EventType::Put => {
                                    let Some(kv) = ev.kv() else { continue };
                                    let Some(v) = TtlValue::decode(&String::from_utf8_lossy(kv.value())) else { continue };
                                    match seen_value(&b, &v, &mut expires_at) {
                                        Some(Seen::Unbound) => return binder_unbound(&ctx, &b, "resumed elsewhere"),
                                        Some(Seen::Ended(r)) => return binder_ended(&ctx, &b, &r),
                                        None => known = Some((kv.mod_revision(), v)),
                                    }
                                }
                                EventType::Delete => {
                                    let prev = ev
                                        .prev_kv()
                                        .and_then(|kv| TtlValue::decode(&String::from_utf8_lossy(kv.value())))
                                        .or(known.map(|(_, v)| v));
                                    return binder_ended(&ctx, &b, &deleted_reason(prev, expires_at));
                                }
                            }
                        }
                        if resp.canceled() {
                            break;
                        }
                    }
                    Ok(None) | Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50).min(until(expires_at))).await;
                        break;
                    }
                }
            }
        }
    }
}

/// A waiting request's task: keep its etcd lease alive, wait for its turn, then take the lock
/// (one keepalive: the deadline starts at its send time) and become the lease's binder.
#[allow(clippy::too_many_arguments)]
async fn wait_task(
    ctx: std::sync::Arc<Ctx>,
    b: BindSpec,
    rev: i64,
    mut value: TtlValue,
    token: String,
    etcd_ttl_secs: i64,
) {
    let limit = ctx.cfg.op_timeout;
    let mut client = ctx.client.clone();
    let every = Duration::from_millis(u64::try_from(etcd_ttl_secs.max(1)).unwrap_or(1) * 1000 / 3)
        .max(Duration::from_millis(300));
    let keeper = {
        let ctx = ctx.clone();
        let id = b.id;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match keep_alive_once(&ctx, id).await {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        warn!(lease = id, error = %e, "ttl: waiting request's keepalive failed")
                    }
                }
            }
        })
    };
    let mut backoff = Duration::from_millis(20);
    let outcome: Result<(), String> = loop {
        match mutex::standing(&mut client, limit, &ctx.cfg.prefix, &b.resource, rev).await {
            Ok(Standing::Owner) => break Ok(()),
            Ok(Standing::Behind {
                predecessor,
                predecessor_rev,
                ..
            }) => {
                match mutex::wait_deleted(&mut client, limit, &predecessor, predecessor_rev).await {
                    Ok(_) => backoff = Duration::from_millis(20),
                    Err(e) => {
                        warn!(lease = b.id, error = %e, "ttl: waiting: etcd error; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
            Err(e) => {
                let gone = matches!(
                    mutex::bounded(limit, client.get(b.key.as_str(), None)).await,
                    Ok(r) if r.kvs().is_empty()
                );
                if gone {
                    break Err(format!("its key is gone: {e}"));
                }
                warn!(lease = b.id, error = %e, "ttl: waiting: etcd error; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    };
    keeper.abort();
    let granted = match outcome {
        Ok(()) => {
            let sent = unix_ms();
            match keep_alive_once(&ctx, b.id).await {
                Ok(true) => {
                    let expires_at = deadline_of(sent, b.ttl_ms, etcd_ttl_secs);
                    value.expires_at_unix_ms = Some(expires_at);
                    value.granted_at_unix_ms = Some(unix_ms());
                    // Nobody writes a waiting key but this lockd, or a revoke marking it ended.
                    match put_if(&ctx, &b.key, rev, &value, b.id).await {
                        Ok(true) => Ok(expires_at),
                        Ok(false) => Err("revoked while it was being granted".to_string()),
                        Err(e) => Err(format!("etcd did not take the grant: {e}")),
                    }
                }
                Ok(false) => Err("its etcd lease ended".to_string()),
                Err(e) => Err(format!("etcd did not answer the grant's keepalive: {e}")),
            }
        }
        Err(e) => Err(e),
    };
    match granted {
        Ok(expires_at) => {
            let line = {
                let mut st = ctx.ttl.lock();
                let Some(w) = st.waits.remove(&b.id) else {
                    // Cancelled meanwhile: whoever cancelled revokes the lease.
                    return;
                };
                // Held now: it outlives this lockd (not revoked at its stop).
                ctx.live_leases().remove(&b.id);
                st.bound.insert(
                    b.id,
                    Bound {
                        session: b.session,
                        resource: b.resource.clone(),
                        expires_at_unix_ms: expires_at,
                        task: w.task,
                    },
                );
                granted_line(
                    &b.resource,
                    &b.holder,
                    rev as u64,
                    &token,
                    false,
                    b.id,
                    b.ttl_ms,
                    expires_at,
                )
            };
            info!(lease = b.id, resource = %b.resource, holder = %b.holder, epoch = rev, session = b.session, expires_at_unix_ms = expires_at, "ttl lease granted (was waiting)");
            let _ = b.out.try_send(line);
            notify(
                &ctx,
                NoticeKind::Granted,
                b.id,
                &b.resource,
                &b.holder,
                rev as u64,
                Some(b.session),
                false,
                None,
            );
            let b = BindSpec {
                epoch: rev as u64,
                granted_at_unix_ms: value.granted_at_unix_ms,
                ..b
            };
            binder(ctx, b, expires_at).await
        }
        Err(why) => {
            let mine = ctx.ttl.lock().waits.remove(&b.id).is_some();
            if mine {
                warn!(lease = b.id, resource = %b.resource, why = %why, "ttl: waiting request ended");
                spawn_revoke(ctx.clone(), b.id, "waiting request ended");
                let _ = b.out.try_send(lease_ended_line(
                    b.id,
                    &b.resource,
                    0,
                    &format!("revoked:etcd:{why}"),
                ));
            }
        }
    }
}

impl Session {
    fn ttl_refused(&mut self, r: TtlRefusal, resource: Option<&str>) {
        self.send(error_line(r.code().as_str(), r.to_string(), resource));
    }

    fn me(&self) -> String {
        ttl::binding(&self.ctx.cfg.node, self.id)
    }

    /// Bind lease `f` (held) to this session: a binder task here; a binder elsewhere stops
    /// when it sees the new binding.
    fn ttl_bind(&mut self, f: &Found, expires_at: u64) {
        let spec = BindSpec {
            id: f.id,
            key: f.key.clone(),
            resource: f.resource.clone(),
            holder: f.value.holder.clone(),
            epoch: f.rev as u64,
            ttl_ms: f.value.ttl_ms,
            granted_at_unix_ms: f.value.granted_at_unix_ms,
            me: self.me(),
            session: self.id,
            out: self.out.clone(),
        };
        let mut st = self.ctx.ttl.lock();
        if let Some(old) = st.bound.remove(&f.id) {
            old.task.abort();
        }
        let task = tokio::spawn(binder(self.ctx.clone(), spec, expires_at));
        st.bound.insert(
            f.id,
            Bound {
                session: self.id,
                resource: f.resource.clone(),
                expires_at_unix_ms: expires_at,
                task,
            },
        );
    }

    /// `acquire` with `ttl_ms`: an etcd lease of its own, then the mutex recipe. Answered
    /// inline (granted, queued or busy); a queued request's grant comes from its task.
    pub(super) async fn ttl_acquire(
        &mut self,
        resource: String,
        holder: String,
        wait: bool,
        ttl_ms: u64,
    ) {
        let dup = self
            .ctx
            .ttl
            .lock()
            .waits
            .values()
            .any(|w| w.session == self.id && w.resource == resource);
        if dup {
            return self.send(error_line(
                ErrorCode::AlreadyQueued.as_str(),
                "this connection waits for it",
                Some(&resource),
            ));
        }
        let limit = self.op_timeout();
        let secs = ttl::etcd_ttl_secs(ttl_ms);
        let mut client = self.ctx.client.clone();
        let sent = unix_ms();
        let g = match mutex::bounded(limit, client.lease_grant(secs, None)).await {
            Ok(g) => g,
            Err(e) => {
                warn!(session = self.id, resource = %resource, error = %e, "ttl: cannot get an etcd lease");
                return self.send(error_line(
                    ErrorCode::Unavailable.as_str(),
                    format!("etcd backend: cannot get an etcd lease for the TTL lease: {e}"),
                    Some(&resource),
                ));
            }
        };
        let id = g.id();
        if !ttl::granted_covers(g.ttl(), ttl_ms) {
            spawn_revoke(self.ctx.clone(), id, "etcd granted a TTL below ttl_ms");
            return self.send(error_line(
                ErrorCode::Unavailable.as_str(),
                format!(
                    "etcd granted a TTL of {} s for ttl_ms {ttl_ms}: refused",
                    g.ttl()
                ),
                Some(&resource),
            ));
        }
        let tok = token();
        let expires_at = deadline_of(sent, ttl_ms, g.ttl());
        let mut value = TtlValue {
            holder: holder.clone(),
            node: self.ctx.cfg.node.clone(),
            token_sha256: ttl::sha256_hex(tok.as_bytes()),
            ttl_ms,
            expires_at_unix_ms: None,
            granted_at_unix_ms: None,
            bound: Some(self.me()),
            ended: None,
        };
        let key = mutex::lock_key(&self.ctx.cfg.prefix, &resource, id);
        let fail = |s: &mut Session, e: EtcdError| {
            warn!(session = s.id, resource = %resource, lease = id, error = %e, "ttl: acquire failed");
            spawn_revoke(s.ctx.clone(), id, "acquire failed");
            s.send(error_line(
                ErrorCode::Unavailable.as_str(),
                format!("etcd backend: {e}"),
                Some(&resource),
            ));
        };
        let rev = match mutex::enqueue(&mut client, limit, &key, &value.encode(), id).await {
            Ok(r) => r,
            Err(e) => return fail(self, e),
        };
        let standing =
            match mutex::standing(&mut client, limit, &self.ctx.cfg.prefix, &resource, rev).await {
                Ok(s) => s,
                Err(e) => return fail(self, e),
            };
        match standing {
            Standing::Owner => {
                value.expires_at_unix_ms = Some(expires_at);
                value.granted_at_unix_ms = Some(unix_ms());
                match put_if(&self.ctx, &key, rev, &value, id).await {
                    Ok(true) => {}
                    Ok(false) => {
                        return fail(
                            self,
                            EtcdError::Unexpected("the lock key changed while granting".into()),
                        )
                    }
                    Err(e) => return fail(self, e),
                }
                let f = Found {
                    id,
                    key,
                    resource: resource.clone(),
                    rev,
                    mod_rev: 0,
                    value,
                    owner: true,
                };
                self.ttl_bind(&f, expires_at);
                info!(session = self.id, lease = id, resource = %resource, holder = %holder, epoch = rev, ttl_ms, etcd_ttl_secs = g.ttl(), expires_at_unix_ms = expires_at, "ttl lease granted");
                notify(
                    &self.ctx,
                    NoticeKind::Granted,
                    id,
                    &resource,
                    &holder,
                    rev as u64,
                    Some(self.id),
                    false,
                    None,
                );
                self.send(granted_line(
                    &resource, &holder, rev as u64, &tok, false, id, ttl_ms, expires_at,
                ));
            }
            Standing::Behind {
                ahead, owner_value, ..
            } => {
                if !wait {
                    spawn_revoke(self.ctx.clone(), id, "try-once acquire found it busy");
                    return self.send(
                        Event::Busy {
                            resource,
                            holder: Some(ttl::display_value(&owner_value).to_string()),
                        }
                        .encode(),
                    );
                }
                self.send(
                    Event::Queued {
                        resource: resource.clone(),
                        position: usize::try_from(ahead).unwrap_or(usize::MAX),
                        lease_id: Some(id as u64),
                    }
                    .encode(),
                );
                info!(session = self.id, lease = id, resource = %resource, holder = %holder, position = ahead, "ttl request queued");
                let spec = BindSpec {
                    id,
                    key,
                    resource: resource.clone(),
                    holder,
                    epoch: 0,
                    ttl_ms,
                    granted_at_unix_ms: None,
                    me: self.me(),
                    session: self.id,
                    out: self.out.clone(),
                };
                // A waiting request goes with this lockd: revoked at its stop.
                self.ctx.live_leases().insert(id);
                let mut st = self.ctx.ttl.lock();
                let task =
                    tokio::spawn(wait_task(self.ctx.clone(), spec, rev, value, tok, g.ttl()));
                st.waits.insert(
                    id,
                    Wait {
                        session: self.id,
                        resource,
                        task,
                    },
                );
            }
        }
    }

    /// The connection closed: its waiting TTL requests are withdrawn (their etcd leases
    /// revoked); its held TTL leases live on, no longer bound here.
    pub(super) fn ttl_session_gone(&mut self) {
        let mut st = self.ctx.ttl.lock();
        let waits: Vec<i64> = st
            .waits
            .iter()
            .filter(|(_, w)| w.session == self.id)
            .map(|(id, _)| *id)
            .collect();
        for id in waits {
            if let Some(w) = st.waits.remove(&id) {
                w.task.abort();
                info!(session = self.id, lease = id, resource = %w.resource, "ttl request withdrawn (connection closed)");
                spawn_revoke(self.ctx.clone(), id, "waiting request's connection closed");
            }
        }
        let bound: Vec<i64> = st
            .bound
            .iter()
            .filter(|(_, b)| b.session == self.id)
            .map(|(id, _)| *id)
            .collect();
        for id in bound {
            if let Some(b) = st.bound.remove(&id) {
                b.task.abort();
                info!(session = self.id, lease = id, resource = %b.resource, "ttl lease unbound (connection closed; the lease lives on)");
            }
        }
    }

    /// `release` by resource: this connection's TTL requests and bound TTL leases on it (one
    /// answer each). False when there were none.
    pub(super) async fn ttl_release_resource(&mut self, resource: &str) -> bool {
        let (waits, held): (Vec<i64>, Vec<i64>) = {
            let st = self.ctx.ttl.lock();
            (
                st.waits
                    .iter()
                    .filter(|(_, w)| w.session == self.id && w.resource == resource)
                    .map(|(id, _)| *id)
                    .collect(),
                st.bound
                    .iter()
                    .filter(|(_, b)| b.session == self.id && b.resource == resource)
                    .map(|(id, _)| *id)
                    .collect(),
            )
        };
        for id in &waits {
            let w = self.ctx.ttl.lock().waits.remove(id);
            if let Some(w) = w {
                w.task.abort();
                spawn_revoke(self.ctx.clone(), *id, "waiting request cancelled");
                info!(
                    session = self.id,
                    lease = id,
                    resource,
                    "ttl request cancelled"
                );
                self.send(
                    Event::Cancelled {
                        resource: resource.to_string(),
                    }
                    .encode(),
                );
            }
        }
        for id in &held {
            match lookup(&self.ctx, *id as u64).await {
                Ok(f) => self.ttl_end_found(f, "released".into()).await,
                Err(r) => self.ttl_refused(r, Some(resource)),
            }
        }
        !(waits.is_empty() && held.is_empty())
    }

    /// Mark `f` ended with `reason` in etcd, then revoke its etcd lease (its key goes, the
    /// next waiter on any lockd is granted). Answers `released` (reason `released`); the
    /// caller of a revoke answers `revoke_sent`. Tells a session of this lockd bound to it
    /// `lease_ended` (not for `released`).
    async fn ttl_end_found(&mut self, f: Found, reason: String) {
        let bound = self.ctx.ttl.lock().bound.remove(&f.id);
        if let Some(b) = &bound {
            b.task.abort();
        }
        let ended = TtlValue {
            ended: Some(reason.clone()),
            ..f.value.clone()
        };
        // Best effort: a binder on another lockd reads the reason from it.
        if let Err(e) = put_if(&self.ctx, &f.key, f.mod_rev, &ended, f.id).await {
            warn!(lease = f.id, error = %e, "ttl: cannot record the end reason in etcd");
        }
        let mut client = self.ctx.client.clone();
        let revoked = mutex::bounded(self.op_timeout(), client.lease_revoke(f.id)).await;
        if let Err(e) = &revoked {
            warn!(lease = f.id, error = %e, "ttl: cannot revoke the etcd lease now; retrying in the background");
            spawn_revoke(self.ctx.clone(), f.id, "lease ended");
        }
        let epoch = f.rev as u64;
        self.ctx.ttl.lock().tomb(
            f.id,
            ended_report(
                f.id,
                &f.resource,
                &f.value.holder,
                epoch,
                f.value.ttl_ms,
                f.value.granted_at_unix_ms,
                &reason,
            ),
        );
        info!(session = self.id, lease = f.id, resource = %f.resource, holder = %f.value.holder, epoch, reason = %reason, "ttl lease ended");
        notify(
            &self.ctx,
            ended_kind(&reason),
            f.id,
            &f.resource,
            &f.value.holder,
            epoch,
            bound.as_ref().map(|b| b.session),
            false,
            Some(&reason),
        );
        if let Some(b) = bound {
            if reason != "released" {
                let line = lease_ended_line(f.id, &f.resource, epoch, &reason);
                if b.session == self.id {
                    self.send(line);
                } else if let Some(si) = self.ctx.reg().sessions.get(&b.session) {
                    let _ = si.out.try_send(line);
                }
            }
        }
        if reason == "released" {
            self.send(
                Event::Released {
                    resource: f.resource.clone(),
                    epoch,
                    lease_id: Some(f.id as u64),
                }
                .encode(),
            );
        }
    }

    /// `release` by `lease_id` + `token`.
    pub(super) async fn ttl_release(&mut self, lease_id: u64, tok: &str) {
        let f = match lookup(&self.ctx, lease_id).await {
            Ok(f) => f,
            Err(r) => return self.ttl_refused(r, None),
        };
        if !ttl::token_matches(&f.value.token_sha256, tok) {
            return self.ttl_refused(TtlRefusal::BadToken(lease_id), Some(&f.resource));
        }
        if !f.owner {
            // A waiting request: withdrawn.
            if let Some(w) = self.ctx.ttl.lock().waits.remove(&f.id) {
                w.task.abort();
            }
            spawn_revoke(self.ctx.clone(), f.id, "waiting request released");
            info!(session = self.id, lease = f.id, resource = %f.resource, "ttl request cancelled by lease_id");
            return self.send(
                Event::Cancelled {
                    resource: f.resource,
                }
                .encode(),
            );
        }
        if let Some(reason) = f.value.end_reason(unix_ms()) {
            return self.ttl_refused(
                TtlRefusal::Ended {
                    id: lease_id,
                    reason,
                },
                Some(&f.resource),
            );
        }
        self.ttl_end_found(f, "released".into()).await
    }

    /// `revoke` by `lease_id`.
    pub(super) async fn ttl_revoke(
        &mut self,
        lease_id: u64,
        reason: Option<String>,
        admin_token: Option<String>,
    ) {
        if self.is_tcp()
            && (self.ctx.cfg.admin_token.is_none() || admin_token != self.ctx.cfg.admin_token)
        {
            return self.send(error_line(
                ErrorCode::Unauthorized.as_str(),
                "revoke over TCP needs lockd's --admin-token",
                None,
            ));
        }
        let f = match lookup(&self.ctx, lease_id).await {
            Ok(f) => f,
            Err(r) => return self.ttl_refused(r, None),
        };
        let pid = self
            .ctx
            .reg()
            .sessions
            .get(&self.id)
            .and_then(|s| s.peer.pid)
            .map(|p| p.to_string())
            .unwrap_or_else(|| "?".into());
        let why = reason.unwrap_or_else(|| "revoked by operator".into());
        let full = format!(
            "revoked:session {} (pid {pid}) at {}:{why}",
            self.id, self.ctx.cfg.node
        );
        let (resource, holder, epoch) = (f.resource.clone(), f.value.holder.clone(), f.rev as u64);
        if !f.owner {
            let w = self.ctx.ttl.lock().waits.remove(&f.id);
            if let Some(w) = w {
                w.task.abort();
                let line = lease_ended_line(f.id, &resource, 0, &full);
                if let Some(si) = self.ctx.reg().sessions.get(&w.session) {
                    let _ = si.out.try_send(line);
                }
            } else {
                let ended = TtlValue {
                    ended: Some(full.clone()),
                    ..f.value.clone()
                };
                let _ = put_if(&self.ctx, &f.key, f.mod_rev, &ended, f.id).await;
            }
            spawn_revoke(self.ctx.clone(), f.id, "waiting request revoked");
            info!(session = self.id, lease = f.id, resource = %resource, reason = %full, "ttl request revoked while waiting");
            return self.send(
                Event::RevokeSent {
                    resource,
                    epoch: 0,
                    holder: Some(holder),
                }
                .encode(),
            );
        }
        if let Some(reason) = f.value.end_reason(unix_ms()) {
            return self.ttl_refused(
                TtlRefusal::Ended {
                    id: lease_id,
                    reason,
                },
                Some(&resource),
            );
        }
        self.ttl_end_found(f, full).await;
        self.send(
            Event::RevokeSent {
                resource,
                epoch,
                holder: Some(holder),
            }
            .encode(),
        );
    }

    /// `renew`: one keepalive of the lease's etcd lease; the new deadline = its send time +
    /// ttl_ms, written to the key (binders on any lockd read it).
    pub(super) async fn ttl_renew(&mut self, lease_id: u64, tok: &str, ttl_ms: Option<u64>) {
        let f = match lookup(&self.ctx, lease_id).await {
            Ok(f) => f,
            Err(r) => return self.ttl_refused(r, None),
        };
        if let Err(r) = ttl::check(lease_id, &f.value, tok, unix_ms()) {
            return self.ttl_refused(r, Some(&f.resource));
        }
        if !f.owner || f.value.expires_at_unix_ms.is_none() {
            return self.ttl_refused(
                TtlRefusal::WrongLease(format!(
                    "lease {lease_id} is still waiting: nothing to renew"
                )),
                Some(&f.resource),
            );
        }
        if ttl_ms.is_some() {
            return self.ttl_refused(
                TtlRefusal::WrongLease(
                    "a TTL lease renews with the TTL it was granted (leave out ttl_ms)".into(),
                ),
                Some(&f.resource),
            );
        }
        let sent = unix_ms();
        if f.value.expires_at_unix_ms.is_some_and(|d| sent >= d) {
            // The deadline passed since the lookup: expired, and no keepalive is sent.
            return self.ttl_refused(
                TtlRefusal::Ended {
                    id: lease_id,
                    reason: "expired".into(),
                },
                Some(&f.resource),
            );
        }
        match keep_alive_once(&self.ctx, f.id).await {
            Ok(true) => {}
            Ok(false) => {
                info!(session = self.id, lease = f.id, resource = %f.resource, "ttl renew: etcd no longer has the lease");
                return self.ttl_refused(
                    TtlRefusal::Ended {
                        id: lease_id,
                        reason: "expired".into(),
                    },
                    Some(&f.resource),
                );
            }
            Err(e) => return self.ttl_refused(unavailable(e), Some(&f.resource)),
        }
        let expires_at = deadline_of(sent, f.value.ttl_ms, ttl::etcd_ttl_secs(f.value.ttl_ms));
        let newer = TtlValue {
            expires_at_unix_ms: Some(expires_at.max(f.value.expires_at_unix_ms.unwrap_or(0))),
            ..f.value.clone()
        };
        match put_if(&self.ctx, &f.key, f.mod_rev, &newer, f.id).await {
            Ok(true) => {}
            Ok(false) => {
                // Written meanwhile: ended (by a binder at the deadline, a revoke) or renewed.
                match lookup(&self.ctx, lease_id).await {
                    Ok(g) => {
                        if let Some(reason) = g.value.end_reason(unix_ms()) {
                            return self.ttl_refused(
                                TtlRefusal::Ended {
                                    id: lease_id,
                                    reason,
                                },
                                Some(&f.resource),
                            );
                        }
                        if !put_if(&self.ctx, &g.key, g.mod_rev, &newer, g.id)
                            .await
                            .unwrap_or(false)
                        {
                            return self.ttl_refused(
                                unavailable("the lease's key kept changing; renew again"),
                                Some(&f.resource),
                            );
                        }
                    }
                    Err(r) => return self.ttl_refused(r, Some(&f.resource)),
                }
            }
            Err(e) => return self.ttl_refused(unavailable(e), Some(&f.resource)),
        }
        if let Some(b) = self.ctx.ttl.lock().bound.get_mut(&f.id) {
            b.expires_at_unix_ms = expires_at;
        }
        info!(session = self.id, lease = f.id, resource = %f.resource, expires_at_unix_ms = expires_at, "ttl lease renewed");
        self.send(
            Event::Renewed {
                lease_id,
                resource: f.resource,
                expires_at_unix_ms: expires_at,
            }
            .encode(),
        );
    }

    /// `resume`: the lease's events now come to this connection (on this lockd).
    pub(super) async fn ttl_resume(&mut self, lease_id: u64, tok: &str) {
        let f = match lookup(&self.ctx, lease_id).await {
            Ok(f) => f,
            Err(r) => return self.ttl_refused(r, None),
        };
        if let Err(r) = ttl::check(lease_id, &f.value, tok, unix_ms()) {
            return self.ttl_refused(r, Some(&f.resource));
        }
        let Some(expires_at) = f.value.expires_at_unix_ms.filter(|_| f.owner) else {
            return self.ttl_refused(
                TtlRefusal::WrongLease(format!(
                    "lease {lease_id} is still waiting: resume takes up held leases"
                )),
                Some(&f.resource),
            );
        };
        let rebound = TtlValue {
            bound: Some(self.me()),
            ..f.value.clone()
        };
        match put_if(&self.ctx, &f.key, f.mod_rev, &rebound, f.id).await {
            Ok(true) => {}
            Ok(false) => {
                return self.ttl_refused(
                    unavailable("the lease changed while resuming; resume again"),
                    Some(&f.resource),
                )
            }
            Err(e) => return self.ttl_refused(unavailable(e), Some(&f.resource)),
        }
        let f = Found {
            value: rebound,
            ..f
        };
        self.ttl_bind(&f, expires_at);
        info!(session = self.id, lease = f.id, resource = %f.resource, epoch = f.rev, "ttl lease resumed");
        notify(
            &self.ctx,
            NoticeKind::Granted,
            f.id,
            &f.resource,
            &f.value.holder,
            f.rev as u64,
            Some(self.id),
            true,
            None,
        );
        self.send(granted_line(
            &f.resource,
            &f.value.holder,
            f.rev as u64,
            tok,
            true,
            f.id,
            f.value.ttl_ms,
            expires_at,
        ));
    }

    /// `lease`: this lockd's tombstone, else etcd's view, else `unknown`.
    pub(super) async fn ttl_lease(&mut self, lease_id: u64) {
        if let Some(id) = ttl::etcd_lease_id(lease_id) {
            let tomb = self.ctx.ttl.lock().tombs.get(&id).map(|t| t.report.clone());
            if let Some(r) = tomb {
                return self.send(Event::Lease(Box::new(r)).encode());
            }
        }
        match lookup(&self.ctx, lease_id).await {
            Ok(f) => {
                let session = self.ctx.ttl.lock().bound.get(&f.id).map(|b| b.session);
                let r = f.report(session, unix_ms());
                self.send(Event::Lease(Box::new(r)).encode())
            }
            Err(TtlRefusal::UnknownLease(_)) => {
                self.send(Event::Lease(Box::new(LeaseReport::unknown(lease_id))).encode())
            }
            Err(r) => self.ttl_refused(r, None),
        }
    }

    /// `leases`: every live TTL lease and waiting request in etcd (under this prefix).
    pub(super) async fn ttl_leases(&mut self, resource: Option<String>, holder: Option<String>) {
        let mut client = self.ctx.client.clone();
        let all = match mutex::all_locks(
            &mut client,
            self.op_timeout(),
            &self.ctx.cfg.prefix,
            super::STATUS_MAX_KEYS,
        )
        .await
        {
            Ok(a) => a,
            Err(e) => return self.ttl_refused(unavailable(e), None),
        };
        let now = unix_ms();
        let mut out = Vec::new();
        let mut first_of: Option<String> = None;
        for e in all {
            let owner = first_of.as_deref() != Some(e.resource.as_str());
            first_of = Some(e.resource.clone());
            let Some(value) = TtlValue::decode(&e.value) else {
                continue;
            };
            if resource.as_ref().is_some_and(|r| *r != e.resource)
                || holder.as_ref().is_some_and(|h| *h != value.holder)
            {
                continue;
            }
            let f = Found {
                id: e.lease,
                key: String::new(),
                resource: e.resource.clone(),
                rev: e.create_revision,
                mod_rev: 0,
                value,
                owner,
            };
            let session = self.ctx.ttl.lock().bound.get(&f.id).map(|b| b.session);
            let r = f.report(session, now);
            if r.reason.is_none() {
                out.push(r);
            }
        }
        self.send(Event::Leases { leases: out }.encode());
    }
}
