//! Gangs of exclusive, connection-bound leases on the etcd backend: the session glue and the
//! waiting task. The etcd side (one transaction puts every member key, the decision "first in
//! every member's queue?") is [`crate::etcd::gang`]; docs/ETCD.md, "Gangs on etcd".
//!
//! A waiting gang sits in the session's `waiting` map under its name (so the connection's
//! close, the fence's loss and `release {resource: name}` withdraw it like a single waiting
//! acquire, through `cancel_wait`); a granted gang's members are ordinary `held` entries
//! (epoch = the gang's create revision), so `status`, `revoke`, `put_fenced`, the self-fence
//! and the end of the session treat them as any other lock. `release` of the gang's name or
//! of any member releases the gang whole, its keys deleted in one transaction.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{error_line, token, unix_ms, wait_predecessor, Ctx, Held, LocalHold, Msg, Session};
use crate::etcd::gang::{self, GangStanding};
use crate::etcd::mutex::EtcdError;
use crate::proto::{ErrorCode, Event, GangMember, NoticeKind};

/// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_GANG_FIRST_MEMBER_ONLY=1`): a gang is granted
/// when it is first in its first member's queue, whatever the others say.
fn planted_first_member_only() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("LOCKD_PLANTED_BUG_GANG_FIRST_MEMBER_ONLY").is_ok_and(|v| v == "1")
    })
}

/// A gang of this session, waiting or granted (by its name).
pub(super) struct LocalGang {
    members: Vec<String>,
    keys: Vec<String>,
    holder: String,
    granted: bool,
}

/// What a gang's task reports to its session.
pub(super) enum GangMsg {
    /// In the queues with create revision `rev`, `position` keys ahead at most.
    Queued {
        label: String,
        rev: i64,
        position: usize,
    },
    /// First in every member's queue.
    Granted { label: String, rev: i64 },
    /// `timeout_ms` passed while waiting.
    TimedOut { label: String },
}

impl Session {
    /// Whether `resource` names a gang this session waits for or holds, or one of its
    /// members (a name means one thing per connection: `release` of it is unambiguous).
    pub(super) fn gang_member_state(&self, resource: &str) -> Option<ErrorCode> {
        self.gangs
            .iter()
            .find(|(label, g)| *label == resource || g.members.iter().any(|m| m == resource))
            .map(|(_, g)| g)
            .map(|g| {
                if g.granted {
                    ErrorCode::AlreadyHeld
                } else {
                    ErrorCode::AlreadyQueued
                }
            })
    }

    /// `acquire` with `gang` (exclusive, connection-bound members).
    pub(super) async fn gang_acquire(
        &mut self,
        label: String,
        holder: String,
        members: Vec<String>,
        wait: bool,
        timeout: Option<Duration>,
    ) {
        let taken = if self.held.contains_key(&label) {
            Some(ErrorCode::AlreadyHeld)
        } else if self.waiting.contains_key(&label) {
            Some(ErrorCode::AlreadyQueued)
        } else {
            self.gang_member_state(&label)
        };
        if let Some(code) = taken {
            return self.send(error_line(
                code.as_str(),
                "this connection already holds or waits for something of that name (a gang's name and members are one namespace per connection)",
                Some(&label),
            ));
        }
        for m in &members {
            let code = if self.held.contains_key(m) {
                Some(ErrorCode::AlreadyHeld)
            } else if self.waiting.contains_key(m) {
                Some(ErrorCode::AlreadyQueued)
            } else {
                self.gang_member_state(m)
            };
            if let Some(code) = code {
                return self.send(error_line(
                    code.as_str(),
                    format!("this connection already holds or waits for {m:?}"),
                    Some(m),
                ));
            }
        }
        let Some(lease) = self.lease_or_unavailable(&label).await else {
            return;
        };
        let keys = gang::member_keys(&self.ctx.cfg.prefix, &members, lease);
        let value = format!("{holder}@{}", self.ctx.cfg.node);
        let task = tokio::spawn(gang_task(
            self.ctx.clone(),
            self.id,
            label.clone(),
            members.clone(),
            keys.clone(),
            value,
            lease,
            wait,
            timeout,
            self.tx.clone(),
        ));
        info!(session = self.id, gang = %label, holder = %holder, members = ?members, wait, timeout_ms = timeout.map(|t| t.as_millis() as u64), "gang acquire");
        self.waiting.insert(label.clone(), (holder.clone(), task));
        {
            let mut reg = self.ctx.reg();
            for m in &members {
                reg.waiters
                    .entry(m.clone())
                    .or_default()
                    .push((self.id, holder.clone()));
            }
            if let Some(si) = reg.sessions.get_mut(&self.id) {
                si.waits.push(label.clone());
            }
        }
        self.gangs.insert(
            label,
            LocalGang {
                members,
                keys,
                holder,
                granted: false,
            },
        );
    }

    /// Drop a waiting gang's local registrations (its task ended or was aborted).
    fn gang_unregister_wait(&mut self, label: &str, g: &LocalGang) {
        let mut reg = self.ctx.reg();
        for m in &g.members {
            if let Some(w) = reg.waiters.get_mut(m) {
                w.retain(|(s, _)| *s != self.id);
                if w.is_empty() {
                    reg.waiters.remove(m);
                }
            }
        }
        if let Some(si) = reg.sessions.get_mut(&self.id) {
            si.waits.retain(|x| x != label);
        }
    }

    /// `cancel_wait` of a waiting gang (its keys deleted in one transaction): true if `label`
    /// named one.
    pub(super) fn gang_cancel_wait(&mut self, label: &str) -> bool {
        if self.gangs.get(label).is_none_or(|g| g.granted) {
            return false;
        }
        let Some(g) = self.gangs.remove(label) else {
            return false;
        };
        if let Some((_holder, task)) = self.waiting.remove(label) {
            task.abort();
        }
        spawn_delete_all(self.ctx.clone(), g.keys.clone());
        self.gang_unregister_wait(label, &g);
        info!(session = self.id, gang = %label, "gang wait withdrawn; its keys deleted");
        true
    }

    /// `release` of a granted gang by its name or any member's: every member released (one
    /// transaction deletes the keys), `released` per member. False: no granted gang there.
    pub(super) fn gang_release(&mut self, resource: &str) -> bool {
        let label = match self.gangs.get(resource) {
            Some(g) if g.granted => resource.to_string(),
            Some(_) => return false,
            None => match self
                .gangs
                .iter()
                .find(|(_, g)| g.granted && g.members.iter().any(|m| m == resource))
            {
                Some((l, _)) => l.clone(),
                None => return false,
            },
        };
        let Some(g) = self.gangs.remove(&label) else {
            return false;
        };
        spawn_delete_all(self.ctx.clone(), g.keys.clone());
        info!(session = self.id, gang = %label, members = ?g.members, "gang released");
        for m in &g.members {
            if let Some(h) = self.held.remove(m) {
                self.forget_hold(m, &h, "gang released");
                self.send(
                    Event::Released {
                        resource: m.clone(),
                        epoch: h.epoch,
                        lease_id: None,
                    }
                    .encode(),
                );
            }
        }
        true
    }

    /// A report of a gang's task.
    pub(super) fn on_gang_msg(&mut self, m: GangMsg) {
        match m {
            GangMsg::Queued {
                label,
                rev,
                position,
            } => {
                if self.gangs.get(&label).is_some_and(|g| !g.granted) {
                    self.send(
                        Event::Queued {
                            resource: label,
                            position,
                            lease_id: Some(rev as u64),
                        }
                        .encode(),
                    );
                }
            }
            GangMsg::TimedOut { label } => {
                if self.gang_cancel_wait(&label) {
                    info!(session = self.id, gang = %label, "gang wait timed out");
                    self.send(Event::Cancelled { resource: label }.encode());
                }
            }
            GangMsg::Granted { label, rev } => self.gang_granted(label, rev),
        }
    }

    fn gang_granted(&mut self, label: String, rev: i64) {
        let waiting = self.gangs.get(&label).is_some_and(|g| !g.granted)
            && self.waiting.remove(&label).is_some();
        let Some(g) = self.gangs.get(&label).filter(|_| waiting) else {
            // Withdrawn while the grant was in flight: cancel_wait deleted the keys.
            return;
        };
        let (members, keys, holder) = (g.members.clone(), g.keys.clone(), g.holder.clone());
        let g = LocalGang {
            members: members.clone(),
            keys: keys.clone(),
            holder: holder.clone(),
            granted: true,
        };
        self.gang_unregister_wait(&label, &g);
        self.gangs.insert(label.clone(), g);
        let epoch = rev as u64;
        let now_ms = unix_ms();
        let lease = self.lease.as_ref().map(|l| l.id).unwrap_or(0);
        {
            let mut reg = self.ctx.reg();
            for m in &members {
                reg.holds.insert(
                    m.clone(),
                    LocalHold {
                        session: self.id,
                        holder: holder.clone(),
                        epoch,
                        granted_at_unix_ms: now_ms,
                        revoked: false,
                    },
                );
            }
            reg.counters.grants += 1;
            self.ctx.metrics.grants.inc();
            if let Some(si) = reg.sessions.get_mut(&self.id) {
                si.holds.extend(members.iter().cloned());
            }
        }
        for (m, key) in members.iter().zip(keys) {
            self.held.insert(
                m.clone(),
                Held {
                    key,
                    lease,
                    epoch,
                    holder: holder.clone(),
                    lost: false,
                },
            );
            self.ctx
                .notice(NoticeKind::Granted, m, &holder, epoch, self.id);
        }
        info!(session = self.id, gang = %label, holder = %holder, epoch, members = ?members, "gang granted");
        self.send(
            Event::GangGranted {
                resource: label,
                gang_id: epoch,
                holder,
                token: token(),
                members: members
                    .into_iter()
                    .map(|resource| GangMember {
                        resource,
                        epoch,
                        version: None,
                        lease_id: None,
                    })
                    .collect(),
                kind: None,
                expires_at_unix_ms: None,
            }
            .encode(),
        );
    }
}

/// Delete a gang's keys in one transaction in the background, retrying while etcd is
/// unreachable (bounded: the keys go with the session's lease anyway).
fn spawn_delete_all(ctx: Arc<Ctx>, keys: Vec<String>) {
    tokio::spawn(async move {
        let mut client = ctx.client.clone();
        for attempt in 0..10u32 {
            match gang::delete_all(&mut client, ctx.cfg.op_timeout, &keys).await {
                Ok(()) => return,
                Err(e) => {
                    warn!(keys = ?keys, attempt, error = %e, "cannot delete the gang's keys; retrying");
                    tokio::time::sleep(Duration::from_millis(100 << attempt.min(4))).await;
                }
            }
        }
    });
}

/// One gang's acquire: enqueue (one transaction), then look at every member's queue until
/// first in all of them, waiting for the predecessor's deletion in the first member where it
/// is not. Retries etcd errors (the session cancels it, or its fence fires); reports on `tx`.
#[allow(clippy::too_many_arguments)]
async fn gang_task(
    ctx: Arc<Ctx>,
    session: u64,
    label: String,
    members: Vec<String>,
    keys: Vec<String>,
    value: String,
    lease: i64,
    wait: bool,
    timeout: Option<Duration>,
    tx: mpsc::UnboundedSender<Msg>,
) {
    let run = gang_wait(
        &ctx, session, &label, &members, &keys, &value, lease, wait, &tx,
    );
    let msg = match timeout {
        None => run.await,
        Some(t) => match tokio::time::timeout(t, run).await {
            Ok(m) => m,
            Err(_) => {
                // Delete the keys before telling the session (which deletes them again, in
                // the background): a request after `cancelled` finds them gone.
                let mut client = ctx.client.clone();
                if let Err(e) = gang::delete_all(&mut client, ctx.cfg.op_timeout, &keys).await {
                    warn!(session, gang = %label, error = %e, "cannot delete the timed-out gang's keys");
                }
                Msg::Gang(GangMsg::TimedOut {
                    label: label.clone(),
                })
            }
        },
    };
    let _ = tx.send(msg);
}

#[allow(clippy::too_many_arguments)]
async fn gang_wait(
    ctx: &Arc<Ctx>,
    session: u64,
    label: &str,
    members: &[String],
    keys: &[String],
    value: &str,
    lease: i64,
    wait: bool,
    tx: &mpsc::UnboundedSender<Msg>,
) -> Msg {
    let limit = ctx.cfg.op_timeout;
    let prefix = ctx.cfg.prefix.clone();
    let mut client = ctx.client.clone();
    let mut backoff = Duration::from_millis(20);
    let mut my_rev = None;
    let mut queued = false;
    loop {
        let step: Result<Option<Msg>, EtcdError> = async {
            let rev = match my_rev {
                Some(r) => r,
                None => {
                    let r = gang::enqueue(&mut client, limit, keys, value, lease).await?;
                    info!(session, gang = %label, rev = r, "gang keys put in one transaction");
                    my_rev = Some(r);
                    r
                }
            };
            let queues = gang::read_queues(&mut client, limit, &prefix, members, rev).await?;
            match gang::standing(rev, &queues, planted_first_member_only()) {
                GangStanding::Owner => Ok(Some(Msg::Gang(GangMsg::Granted {
                    label: label.to_string(),
                    rev,
                }))),
                GangStanding::Gone { member } => Err(EtcdError::Unexpected(format!(
                    "the gang's key in {member:?} (create revision {rev}) is gone: its etcd lease expired or was revoked"
                ))),
                GangStanding::Behind {
                    member,
                    position,
                    predecessor,
                    predecessor_rev,
                    owner_value,
                } => {
                    if !wait {
                        gang::delete_all(&mut client, limit, keys).await?;
                        info!(session, gang = %label, member = %member, "gang busy (wait:false); its keys deleted");
                        return Ok(Some(Msg::Busy {
                            resource: label.to_string(),
                            holder: crate::etcd::ttl::display_value(&owner_value).to_string(),
                        }));
                    }
                    if !queued {
                        queued = true;
                        info!(session, gang = %label, rev, position, first_blocked = %member, "gang queued");
                        let _ = tx.send(Msg::Gang(GangMsg::Queued {
                            label: label.to_string(),
                            rev,
                            position,
                        }));
                    }
                    debug!(session, gang = %label, member = %member, predecessor = %predecessor, "gang waiting for the predecessor's deletion");
                    if wait_predecessor(ctx, &mut client, &predecessor, predecessor_rev).await? {
                        Ok(None)
                    } else {
                        Err(EtcdError::Unexpected(format!(
                            "the watch on {predecessor} ended"
                        )))
                    }
                }
            }
        }
        .await;
        match step {
            Ok(Some(m)) => return m,
            Ok(None) => backoff = Duration::from_millis(20),
            Err(e) => {
                warn!(session, gang = %label, error = %e, "gang acquire: etcd error; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// The gangs of one session.
pub(super) type Gangs = BTreeMap<String, LocalGang>;
