//! The registry of version-2 leases (kinds `ttl`, `shared`, `quantity`): one entry per lease
//! id, live or waiting, with what every kind shares — its resource, holder, token, epoch, the
//! session its events go to — and the operations by lease id (`release`, `revoke`, `renew`,
//! `resume`, `lease`, `leases`), which dispatch to the kind's module (`ttl.rs`, `shared.rs`,
//! `quantity.rs`), each of which drives its pure table from [`crate::kinds`].
//!
//! Ended leases are remembered as [`Tombstone`]s (bounded in count and age, persisted), so
//! `lease` tells `expired` from `revoked` from `released` from `unknown` after the end.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::records::Tombstone;
use super::{Core, Now, SessionId};
use crate::proto::{
    ErrorCode, Event, KindCounters, LeaseFields, LeaseKind, LeaseReport, Mode, Notice, NoticeKind,
};

/// One version-2 lease (or request still waiting), as the core tracks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindLease {
    /// Its kind.
    pub kind: LeaseKind,
    /// Its resource (or pool).
    pub resource: String,
    /// Holder name given at acquire.
    pub holder: String,
    /// The secret that proves it (release/renew/commit/resume by id).
    pub token: String,
    /// Fencing epoch (0 while waiting).
    pub epoch: u64,
    /// Wall-clock grant time (0 while waiting).
    pub granted_at_unix_ms: u64,
    /// Shared leases: the mode.
    #[serde(default)]
    pub mode: Option<Mode>,
    /// TTL / lease time asked for (timed kinds).
    #[serde(default)]
    pub ttl_ms: Option<u64>,
    /// Bound to its session: ends when the session ends (connection-bound shared leases).
    #[serde(default)]
    pub bound: bool,
    /// Granted (false: still waiting; waiting requests are never persisted).
    #[serde(default)]
    pub granted: bool,
    /// Bound shared leases: revoked (the lease ends when its session does).
    #[serde(default)]
    pub revoked: Option<String>,
    /// Member of the gang with this id (the gang's id is its first member's lease id):
    /// the gang's members share its token, are granted, renewed and end together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<u64>,
    /// The session its events go to (None: nobody is connected for it). Not persisted.
    #[serde(skip)]
    pub session: Option<SessionId>,
    /// Restored bound lease waiting for `resume` until this instant. Not persisted.
    #[serde(skip)]
    pub reclaim_deadline: Option<Instant>,
}

impl KindLease {
    /// A request of `kind` for `resource` by `holder`, not granted yet (no mode, no TTL,
    /// not bound to its connection: set those fields as the kind needs).
    pub(super) fn request(kind: LeaseKind, resource: &str, holder: &str) -> KindLease {
        KindLease {
            kind,
            resource: resource.to_string(),
            holder: holder.to_string(),
            token: String::new(),
            epoch: 0,
            granted_at_unix_ms: 0,
            mode: None,
            ttl_ms: None,
            bound: false,
            granted: false,
            revoked: None,
            gang: None,
            session: None,
            reclaim_deadline: None,
        }
    }
}

/// How a lease ended, for tombstones, counters, notices and `lease_ended`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EndWhy {
    /// Its holder released it (or its bound session ended).
    Released,
    /// Its deadline passed (TTL, lease time, reconnect window).
    Expired,
    /// Revoked, `by` whom, `why`.
    Revoked(String, String),
}

impl EndWhy {
    /// The wire spelling: `released`, `expired`, `revoked:<by>:<why>`.
    pub fn text(&self) -> String {
        match self {
            EndWhy::Released => "released".into(),
            EndWhy::Expired => "expired".into(),
            EndWhy::Revoked(by, why) => format!("revoked:{by}:{why}"),
        }
    }
}

impl Core {
    /// The kind of lease `resource` is in use by (held or waited for), if any. A resource
    /// has one kind at a time; a free one may be used by any.
    pub(super) fn kind_in_use(&self, r: &str) -> Option<LeaseKind> {
        if let Some(res) = self.table.resources.get(r) {
            if !matches!(res.lease, super::table::LeaseState::Free) || !res.waiters.is_empty() {
                return Some(LeaseKind::Exclusive);
            }
        }
        if self.ttl.holder_of(r).is_some() || self.ttl_waiters.get(r).is_some_and(|q| !q.is_empty())
        {
            return Some(LeaseKind::Ttl);
        }
        if self.shared.in_use(r) || self.shared_gang_waits.contains_key(r) {
            return Some(LeaseKind::Shared);
        }
        if self.pools.contains_key(r) {
            return Some(LeaseKind::Quantity);
        }
        None
    }

    /// A new lease id and token for request `l` of session `s`, registered as waiting.
    pub(super) fn register(&mut self, s: SessionId, mut l: KindLease) -> (u64, String) {
        let id = self.table.new_lease_id();
        let token = self.new_token();
        l.token = token.clone();
        l.session = Some(s);
        self.kl.insert(id, l);
        // A waiting request may already create records (a shared resource's entry).
        self.note_lease(id);
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.leases.insert(id);
        }
        // The id counter moved: persisted with the next write (a waiting request alone is
        // not worth one; ids are never reused either way, as the counter only grows and
        // every granted id is written before it is sent).
        (id, token)
    }

    /// The next epoch of `resource` (one sequence per resource name, across kinds).
    pub(super) fn next_epoch(&mut self, resource: &str) -> u64 {
        let r = self.table.entry(resource);
        r.epoch += 1;
        r.epoch
    }

    pub(super) fn kind_counters(&mut self, kind: LeaseKind) -> &mut KindCounters {
        self.counters_by_kind.entry(kind).or_default()
    }

    /// Mark a registered request granted: epoch, counters, persisted, notice. The caller
    /// sends the `granted` event (it knows the kind's fields).
    pub(super) fn mark_granted(&mut self, now: Now, id: u64, epoch: u64) {
        self.note_lease(id);
        let Some(l) = self.kl.get_mut(&id) else {
            return;
        };
        l.granted = true;
        l.epoch = epoch;
        l.granted_at_unix_ms = now.unix_ms;
        let (kind, resource, holder, session, mode) = (
            l.kind,
            l.resource.clone(),
            l.holder.clone(),
            l.session,
            l.mode,
        );
        {
            let r = self.table.entry(&resource);
            r.epoch = r.epoch.max(epoch);
        }
        self.counters.grants += 1;
        self.kind_counters(kind).grants += 1;
        self.dirty = true;
        #[cfg(test)]
        if self.planted.grant_not_persisted {
            self.dirty = false;
        }
        let version = (kind == LeaseKind::Shared).then(|| self.shared.version(&resource));
        let _ = mode;
        self.notice(
            Notice {
                kind: NoticeKind::Granted,
                resource,
                holder: Some(holder),
                epoch,
                session,
                reclaimed: false,
                after_revoke: false,
                reason: None,
                at_unix_ms: now.unix_ms,
                lease_id: Some(id),
                lease_kind: Some(kind),
                version,
            },
            None,
        );
    }

    /// The `granted` event for lease `id` (reclaimed: a `resume`).
    pub(super) fn granted_event(&self, id: u64, reclaimed: bool) -> Option<Event> {
        let l = self.kl.get(&id)?;
        Some(Event::Granted {
            resource: l.resource.clone(),
            holder: l.holder.clone(),
            epoch: l.epoch,
            token: l.token.clone(),
            reclaimed,
            lease: self.lease_fields(id),
        })
    }

    /// The kind-specific fields of live lease `id`.
    pub(super) fn lease_fields(&self, id: u64) -> LeaseFields {
        let Some(l) = self.kl.get(&id) else {
            return LeaseFields::default();
        };
        let mut f = LeaseFields {
            lease_id: Some(id),
            kind: Some(l.kind),
            mode: l.mode,
            ttl_ms: l.ttl_ms,
            gang_id: l.gang,
            ..LeaseFields::default()
        };
        match l.kind {
            LeaseKind::Ttl => {
                if let Some(info) = self.ttl.get(id) {
                    f.ttl_ms = Some(info.ttl.as_millis() as u64);
                    f.expires_at_unix_ms = Some(info.expires_at_unix_ms);
                }
            }
            LeaseKind::Shared => {
                f.version = Some(self.shared.version(&l.resource));
                if let Some(info) = self.shared_ttl.get(id) {
                    f.ttl_ms = Some(info.ttl.as_millis() as u64);
                    f.expires_at_unix_ms = Some(info.expires_at_unix_ms);
                }
            }
            LeaseKind::Quantity => {
                let pool = self.pools.get(&l.resource);
                if let Some(v) = pool.and_then(|p| p.lease(id)) {
                    // The lease time granted: min(every allocated offer's maximum, the
                    // request's, --max-lease-time), the rule the pool applies.
                    let offers = v
                        .allocations
                        .iter()
                        .filter_map(|a| pool.and_then(|p| p.offer(&a.offer)))
                        .filter_map(|u| u.spec.max_lease_time_ms);
                    let max = self.cfg.max_lease_time.as_millis() as u64;
                    f.ttl_ms = offers.chain(l.ttl_ms).chain([max]).min();
                    f.expires_at_unix_ms = Some(v.expires_unix_ms);
                    f.quantity = Some(v.quantity);
                    f.allocations = Some(
                        v.allocations
                            .iter()
                            .map(|a| crate::proto::AllocationReport {
                                offer: a.offer.clone(),
                                quantity: a.quantity,
                            })
                            .collect(),
                    );
                }
            }
            LeaseKind::Exclusive => {}
        }
        f
    }

    /// Send an event to the session lease `id` is bound to, if any.
    pub(super) fn send_to_lease(&mut self, id: u64, ev: Event) {
        if let Some(s) = self.kl.get(&id).and_then(|l| l.session) {
            self.send(s, ev);
        }
    }

    /// Forget lease `id` (live or waiting) after its kind's table ended it; a granted one
    /// leaves a tombstone, counts, and is announced. `tell` sends `lease_ended` to its
    /// session (an end it did not ask for).
    /// A gang member's end ends its gang whole, with the same reason.
    pub(super) fn forget(&mut self, now: Now, id: u64, why: EndWhy, tell: bool) {
        let gone = self.kl.get(&id).filter(|l| l.gang.is_some()).cloned();
        if let Some(l) = &gone {
            self.kgang_tell_lost(l.gang.unwrap_or(id), l, &why);
        }
        self.forget_one(now, id, why.clone(), tell);
        if let Some(l) = gone {
            if let Some(gid) = l.gang {
                self.kgang_member_gone(now, gid, id, &l, &why);
            }
        }
    }

    fn forget_one(&mut self, now: Now, id: u64, why: EndWhy, tell: bool) {
        self.note_lease(id);
        let Some(l) = self.kl.remove(&id) else {
            return;
        };
        if let Some(s) = l.session {
            if let Some(sess) = self.sessions.get_mut(&s) {
                sess.leases.remove(&id);
            }
        }
        if let Some(d) = l.reclaim_deadline {
            self.kl_reclaim.remove(&(d, id));
        }
        if !l.granted {
            return;
        }
        let kind = l.kind;
        let after_revoke = l.revoked.is_some();
        let (nk, reason) = match &why {
            EndWhy::Released => {
                if !after_revoke {
                    self.counters.releases += 1;
                    self.kind_counters(kind).releases += 1;
                }
                (NoticeKind::Released, None)
            }
            EndWhy::Expired => {
                if !after_revoke {
                    self.counters.expirations += 1;
                    self.kind_counters(kind).expirations += 1;
                }
                (NoticeKind::Expired, None)
            }
            EndWhy::Revoked(..) => {
                self.counters.revocations += 1;
                self.kind_counters(kind).revocations += 1;
                (NoticeKind::Revoked, Some(why.text()))
            }
        };
        let text = match (&why, &l.revoked) {
            // A bound lease revoked earlier ends when its session does: its end says so.
            (EndWhy::Released, Some(r)) => r.clone(),
            _ => why.text(),
        };
        self.bury(Tombstone {
            lease_id: id,
            resource: l.resource.clone(),
            holder: l.holder.clone(),
            epoch: l.epoch,
            kind,
            reason: text.clone(),
            ended_at_unix_ms: now.unix_ms,
        });
        self.dirty = true;
        if tell {
            if let Some(s) = l.session {
                self.send(
                    s,
                    Event::LeaseEnded {
                        lease_id: id,
                        resource: l.resource.clone(),
                        epoch: l.epoch,
                        reason: text,
                    },
                );
            }
        }
        self.notice(
            Notice {
                kind: nk,
                resource: l.resource,
                holder: Some(l.holder),
                epoch: l.epoch,
                session: l.session,
                reclaimed: false,
                after_revoke,
                reason,
                at_unix_ms: now.unix_ms,
                lease_id: Some(id),
                lease_kind: Some(kind),
                version: None,
            },
            None,
        );
    }

    /// Remember an ended lease (bounded: oldest forgotten first).
    pub(super) fn bury(&mut self, t: Tombstone) {
        self.tomb_order.push_back(t.lease_id);
        self.notes.tombs_added.push(t.lease_id);
        self.tombs.insert(t.lease_id, t);
        while self.tombs.len() > self.cfg.max_tombstones {
            match self.tomb_order.pop_front() {
                Some(old) => {
                    if self.tombs.remove(&old).is_some() {
                        self.notes.tombs_forgotten.push(old);
                    }
                }
                None => break,
            }
        }
    }

    /// Forget tombstones older than the configured age.
    pub(super) fn prune_tombs(&mut self, now: Now) {
        let max = u64::try_from(self.cfg.tombstone_max_age.as_millis()).unwrap_or(u64::MAX);
        while let Some(id) = self.tomb_order.front().copied() {
            match self.tombs.get(&id) {
                Some(t) if now.unix_ms.saturating_sub(t.ended_at_unix_ms) < max => break,
                Some(_) => {
                    self.tombs.remove(&id);
                    self.notes.tombs_forgotten.push(id);
                    self.tomb_order.pop_front();
                    self.dirty = true;
                }
                None => {
                    self.tomb_order.pop_front();
                }
            }
        }
    }

    /// Check `token` for lease `id`; on failure answer `s` with the right error
    /// (`lease_ended` when the lease is remembered as ended, `unknown_lease`, `bad_token`).
    pub(super) fn check_lease(&mut self, s: SessionId, id: u64, token: &str) -> bool {
        match self.kl.get(&id) {
            Some(l) if super::ct_eq(&l.token, token) => true,
            Some(l) => {
                let r = l.resource.clone();
                self.error(
                    s,
                    ErrorCode::BadToken,
                    format!("lease {id}: wrong token"),
                    Some(&r),
                );
                false
            }
            None => {
                self.refuse_gone(s, id);
                false
            }
        }
    }

    /// Answer a request about a lease that is not live: ended (with its reason) or unknown.
    pub(super) fn refuse_gone(&mut self, s: SessionId, id: u64) {
        match self.tombs.get(&id) {
            Some(t) => {
                let (msg, r) = (
                    format!("lease {id} has ended ({}): acquire a new one", t.reason),
                    t.resource.clone(),
                );
                self.error(s, ErrorCode::LeaseEnded, msg, Some(&r));
            }
            None => self.error(
                s,
                ErrorCode::UnknownLease,
                format!("lease {id} is unknown (never granted, or forgotten)"),
                None,
            ),
        }
    }

    /// `release` by lease id (any connection, with the token): end it, or withdraw it.
    pub(super) fn release_lease(&mut self, now: Now, s: SessionId, id: u64, token: String) {
        if !self.check_lease(s, id, &token) {
            return;
        }
        self.end_by_id(now, s, id);
    }

    /// End (or withdraw) lease `id` at its holder's request and answer `s` (a gang member:
    /// its whole gang, answered per member).
    fn end_by_id(&mut self, now: Now, s: SessionId, id: u64) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if let Some(g) = l.gang.and_then(|g| self.kgangs.get(&g)) {
            let label = g.label.clone();
            let members: Vec<(u64, KindLease)> = g
                .members
                .iter()
                .filter_map(|m| self.kl.get(m).map(|x| (*m, x.clone())))
                .collect();
            self.kgang_end(now, l.gang.unwrap_or(id), EndWhy::Released);
            if !l.granted {
                return self.send(s, Event::Cancelled { resource: label });
            }
            for (m, x) in members {
                self.send(
                    s,
                    Event::Released {
                        resource: x.resource,
                        epoch: x.epoch,
                        lease_id: Some(m),
                    },
                );
            }
            return;
        }
        match l.kind {
            LeaseKind::Ttl => self.ttl_end(now, id, EndWhy::Released),
            LeaseKind::Shared => self.shared_end(now, id, EndWhy::Released, false),
            LeaseKind::Quantity => self.quantity_end(now, id, EndWhy::Released),
            LeaseKind::Exclusive => {}
        }
        if l.granted {
            self.send(
                s,
                Event::Released {
                    resource: l.resource,
                    epoch: l.epoch,
                    lease_id: Some(id),
                },
            );
        } else {
            self.send(
                s,
                Event::Cancelled {
                    resource: l.resource,
                },
            );
        }
    }

    /// `release` by resource of a version-2 kind: this session's leases (and requests) on it.
    pub(super) fn release_resource_of_session(&mut self, now: Now, s: SessionId, r: String) {
        let ids: Vec<u64> = self
            .sessions
            .get(&s)
            .map(|x| x.leases.iter().copied().collect())
            .unwrap_or_default();
        let mine: Vec<u64> = ids
            .into_iter()
            .filter(|id| self.kl.get(id).is_some_and(|l| l.resource == r))
            .collect();
        if mine.is_empty() {
            return self.error(
                s,
                ErrorCode::NotHolder,
                "neither held nor queued by this connection".into(),
                Some(&r),
            );
        }
        for id in mine {
            self.end_by_id(now, s, id);
        }
    }

    /// `revoke` by lease id (admin checked by the caller).
    pub(super) fn revoke_lease(&mut self, now: Now, s: SessionId, id: u64, reason: String) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return self.refuse_gone(s, id);
        };
        if !l.granted {
            return self.error(
                s,
                ErrorCode::NotHeld,
                format!("lease {id} is still waiting: nothing to revoke"),
                Some(&l.resource),
            );
        }
        let by = self.revoker(s);
        match l.kind {
            LeaseKind::Ttl => self.ttl_end(now, id, EndWhy::Revoked(by, reason.clone())),
            LeaseKind::Shared => self.shared_revoke(now, id, by, reason.clone()),
            LeaseKind::Quantity => self.quantity_end(now, id, EndWhy::Revoked(by, reason.clone())),
            LeaseKind::Exclusive => {}
        }
        self.send(
            s,
            Event::RevokeSent {
                resource: l.resource,
                epoch: l.epoch,
                holder: Some(l.holder),
            },
        );
    }

    /// `revoke` by resource of a version-2 kind: every live lease on it.
    pub(super) fn revoke_resource(&mut self, now: Now, s: SessionId, r: String, reason: String) {
        let ids: Vec<u64> = self
            .kl
            .iter()
            .filter(|(_, l)| l.resource == r && l.granted)
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return self.error(s, ErrorCode::NotHeld, "nobody holds it".into(), Some(&r));
        }
        for id in ids {
            self.revoke_lease(now, s, id, reason.clone());
        }
    }

    /// Who revokes, for the end reason: `session:N` (with its pid over Unix).
    fn revoker(&self, s: SessionId) -> String {
        match self.sessions.get(&s).and_then(|x| x.peer.pid) {
            Some(pid) => format!("session {s} (pid {pid})"),
            None => format!("session {s}"),
        }
    }

    /// `renew`: extend a timed lease.
    pub(super) fn renew(
        &mut self,
        now: Now,
        s: SessionId,
        id: u64,
        token: String,
        ttl_ms: Option<u64>,
    ) {
        if !self.check_lease(s, id, &token) {
            return;
        }
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if let Some(g) = l.gang.filter(|g| self.kgangs.contains_key(g)) {
            return self.kgang_renew(now, s, g, ttl_ms);
        }
        match l.kind {
            LeaseKind::Ttl => self.ttl_renew(now, s, id, ttl_ms),
            LeaseKind::Shared => self.shared_renew(now, s, id, ttl_ms),
            LeaseKind::Quantity => self.quantity_renew(now, s, id, ttl_ms),
            LeaseKind::Exclusive => {}
        }
    }

    /// Count a renewal (accepted or refused) and persist an accepted one.
    pub(super) fn count_renewal(&mut self, kind: LeaseKind, ok: bool) {
        let c = self.kind_counters(kind);
        if ok {
            c.renewals += 1;
        } else {
            c.renewals_refused += 1;
        }
        self.dirty = true;
    }

    /// `resume`: bind a live lease's events to this connection (after the client's crash or
    /// reconnect); a restored connection-bound shared lease is reclaimed by it.
    /// A gang member resumes its whole gang (`granted`, reclaimed, per member).
    pub(super) fn resume(&mut self, now: Now, s: SessionId, id: u64, token: String) {
        if !self.check_lease(s, id, &token) {
            return;
        }
        for m in self.gang_of(id) {
            self.resume_one(now, s, m, &token);
        }
    }

    fn resume_one(&mut self, now: Now, s: SessionId, id: u64, token: &str) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if !l.granted {
            return self.error(
                s,
                ErrorCode::WrongLease,
                format!("lease {id} is still waiting for its grant"),
                Some(&l.resource),
            );
        }
        if l.kind == LeaseKind::Quantity {
            // The pool checks expiry exactly (a lease past its end is not resumed).
            if let Err(e) = self
                .pools
                .get(&l.resource)
                .map(|p| p.resume(super::quantity::qnow(now), id, token))
                .unwrap_or(Err(crate::kinds::quantity::QuantityError::UnknownLease(id)))
            {
                return self.error(s, ErrorCode::LeaseEnded, e.to_string(), Some(&l.resource));
            }
        }
        if let Some(old) = l.session.filter(|o| *o != s) {
            if let Some(sess) = self.sessions.get_mut(&old) {
                sess.leases.remove(&id);
            }
        }
        if let Some(d) = l.reclaim_deadline {
            self.kl_reclaim.remove(&(d, id));
            self.counters.reclaims += 1;
            self.dirty = true;
        }
        if let Some(x) = self.kl.get_mut(&id) {
            x.session = Some(s);
            x.reclaim_deadline = None;
            if x.kind == LeaseKind::Shared {
                self.graph.shared_touched.push(id);
            }
        }
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.leases.insert(id);
        }
        if let Some(ev) = self.granted_event(id, true) {
            self.send(s, ev);
        }
        if let Some(reason) = l.revoked {
            self.send(
                s,
                Event::LeaseEnded {
                    lease_id: id,
                    resource: l.resource,
                    epoch: l.epoch,
                    reason,
                },
            );
        }
        let _ = now;
    }

    /// A session is gone: its waiting requests are withdrawn, its bound leases end, its
    /// timed leases live on without a session.
    pub(super) fn end_session_leases(&mut self, now: Now, ids: &super::smallset::SmallSet<u64>) {
        for id in ids {
            let Some(l) = self.kl.get(id).cloned() else {
                continue;
            };
            if !l.granted || l.bound {
                match l.kind {
                    LeaseKind::Ttl => self.ttl_end(now, *id, EndWhy::Released),
                    LeaseKind::Shared => self.shared_end(now, *id, EndWhy::Released, false),
                    LeaseKind::Quantity => self.quantity_end(now, *id, EndWhy::Released),
                    LeaseKind::Exclusive => {}
                }
            } else if let Some(x) = self.kl.get_mut(id) {
                x.session = None;
            }
        }
    }

    /// A session's connection closed but its anchors keep it: its waiting requests are
    /// withdrawn (nobody could be told of a grant); its leases stay.
    pub(super) fn withdraw_waiting(&mut self, now: Now, ids: &super::smallset::SmallSet<u64>) {
        for id in ids {
            if self.kl.get(id).is_some_and(|l| !l.granted) {
                let kind = self.kl[id].kind;
                match kind {
                    LeaseKind::Ttl => self.ttl_end(now, *id, EndWhy::Released),
                    LeaseKind::Shared => self.shared_end(now, *id, EndWhy::Released, false),
                    LeaseKind::Quantity => self.quantity_end(now, *id, EndWhy::Released),
                    LeaseKind::Exclusive => {}
                }
            }
        }
    }

    /// Deadlines of every kind are due: TTLs, lease times, reconnect windows of restored
    /// bound leases, tombstone ages.
    pub(super) fn expire_kinds(&mut self, now: Now) {
        self.ttl_tick(now);
        self.shared_tick(now);
        self.quantity_tick(now);
        while let Some(&(d, id)) = self.kl_reclaim.first() {
            if d > now.mono {
                break;
            }
            self.kl_reclaim.remove(&(d, id));
            if let Some(l) = self.kl.get_mut(&id) {
                l.reclaim_deadline = None;
            }
            self.shared_end(now, id, EndWhy::Expired, false);
        }
        if self
            .tomb_order
            .front()
            .and_then(|id| self.tombs.get(id))
            .is_some_and(|t| {
                now.unix_ms.saturating_sub(t.ended_at_unix_ms)
                    >= self.cfg.tombstone_max_age.as_millis() as u64
            })
        {
            self.prune_tombs(now);
        }
    }

    /// The earliest deadline of the version-2 kinds.
    pub(super) fn next_kind_deadline(&self) -> Option<Instant> {
        // Tombstones age out at the next step after their age: no timer of their own.
        [
            self.ttl.next_deadline(),
            self.shared_ttl.next_deadline(),
            self.pools.values().filter_map(|p| p.next_deadline()).min(),
            self.kl_reclaim.first().map(|(d, _)| *d),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The `lease` answer: live, waiting, remembered as ended, or unknown.
    pub(super) fn lease_report(&self, now: Now, id: u64) -> LeaseReport {
        if let Some(l) = self.kl.get(&id) {
            let state = if !l.granted {
                "waiting"
            } else if l.reclaim_deadline.is_some() {
                "reclaiming"
            } else {
                "held"
            };
            let renewal_refused = match l.kind {
                LeaseKind::Quantity => self
                    .pools
                    .get(&l.resource)
                    .and_then(|p| p.lease(id))
                    .and_then(|v| v.renewal_refused),
                _ => None,
            };
            let _ = now;
            return LeaseReport {
                lease_id: id,
                state: state.into(),
                kind: Some(l.kind),
                resource: Some(l.resource.clone()),
                holder: Some(l.holder.clone()),
                epoch: (l.epoch > 0).then_some(l.epoch),
                reason: l.revoked.clone(),
                ended_at_unix_ms: None,
                granted_at_unix_ms: l.granted.then_some(l.granted_at_unix_ms),
                session: l.session,
                renewal_refused,
                lease: LeaseFields {
                    // Reported once, by the report's own fields.
                    lease_id: None,
                    kind: None,
                    ..self.lease_fields(id)
                },
            };
        }
        match self.tombs.get(&id) {
            Some(t) => LeaseReport {
                lease_id: id,
                state: t.reason.split(':').next().unwrap_or("released").to_string(),
                kind: Some(t.kind),
                resource: Some(t.resource.clone()),
                holder: Some(t.holder.clone()),
                epoch: Some(t.epoch),
                reason: Some(t.reason.clone()),
                ended_at_unix_ms: Some(t.ended_at_unix_ms),
                granted_at_unix_ms: None,
                session: None,
                renewal_refused: None,
                lease: LeaseFields::default(),
            },
            None => LeaseReport::unknown(id),
        }
    }

    /// The `leases` answer: live and waiting version-2 leases, filtered.
    pub(super) fn lease_reports(
        &self,
        now: Now,
        resource: Option<&str>,
        holder: Option<&str>,
    ) -> Vec<LeaseReport> {
        self.kl
            .iter()
            .filter(|(_, l)| resource.is_none_or(|r| l.resource == r))
            .filter(|(_, l)| holder.is_none_or(|h| l.holder == h))
            .map(|(id, _)| self.lease_report(now, *id))
            .collect()
    }
}
