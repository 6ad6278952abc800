//! Gangs of the version-2 kinds (feature `gang` with `ttl_ms`, or with `mode: "shared"`):
//! one acquire for a set of resources, granted all at once or not at all, whose members are
//! ordinary version-2 leases — TTL leases (exclusive per resource, outliving the
//! connection) or shared leases (readers, bound to the connection or timed) — each with its
//! own lease id and epoch, tied together by [`KindLease::gang`]. The gang's id is its first
//! member's lease id, so `lease`, `renew`, `release` and `resume` by gang id work as for any
//! lease, and a restart rebuilds the gang from its persisted members.
//!
//! **Whole, always.** The members are granted in one step (one durable write, one
//! `gang_granted` event), renewed together by `renew {lease_id: gang id}` (one deadline for
//! all), and when one member ends — released, expired, revoked, its bound session gone, not
//! resumed after a restart — every other member ends in the same step, with the same
//! reason ([`Core::kgang_member_gone`], called by [`Core::forget`]). A member revoked by an
//! admin is named to the holder first (`member_lost`).
//!
//! **Waiting.** A TTL gang waits with one request in the TTL queue of each member; its
//! member ids come from the one lease-id counter, so the oldest waiter of all is first in
//! every queue it is in. A TTL resource whose first waiter is a gang member is granted to
//! nobody else: it stays free, reserved, until every member is free with the gang first in
//! line (as for a connection-bound gang, `gang.rs`). A shared gang waits outside the shared
//! table's queues: it is granted when every member would let it in as a reader at once (no
//! writer holds it, no writer that arrived before the gang waits for it — writer priority,
//! by arrival), checked after every step that may have changed that. A waiting shared gang
//! keeps its members from other kinds (they are in use as `shared`) and, while it is the
//! oldest waiting gang on a member, from writers that arrive after it (`fence.rs`: how it
//! cannot starve).

use std::time::{Duration, Instant};

use super::leases::{EndWhy, KindLease};
use super::{Core, Now, SessionId};
use crate::kinds::shared;
use crate::kinds::ttl::TtlError;
use crate::proto::{AcquireExt, ErrorCode, Event, GangMember, LeaseKind, Mode};

/// A gang of version-2 leases, waiting or granted.
#[derive(Debug, Clone)]
pub(super) struct KindGang {
    /// Its name (the acquire's `resource`; the first member's resource after a restart).
    pub label: String,
    /// `Ttl` or `Shared`.
    pub kind: LeaseKind,
    /// Its members' lease ids, in request order (the first is the gang's id).
    pub members: Vec<u64>,
    /// Granted (false: waiting).
    pub granted: bool,
    /// When a waiting gang gives up.
    pub deadline: Option<Instant>,
}

impl Core {
    /// `acquire` with `gang` and `ttl_ms` or `mode: "shared"` (checked by the decoder).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kgang_acquire(
        &mut self,
        now: Now,
        s: SessionId,
        label: String,
        holder: String,
        members: Vec<String>,
        wait: bool,
        ext: AcquireExt,
    ) {
        let kind = if ext.mode == Some(Mode::Shared) {
            LeaseKind::Shared
        } else {
            LeaseKind::Ttl
        };
        let mine: Vec<u64> = self
            .sessions
            .get(&s)
            .map(|x| x.leases.iter().copied().collect())
            .unwrap_or_default();
        for m in &members {
            if let Some(k) = self.kind_in_use(m).filter(|k| *k != kind) {
                return self.error(
                    s,
                    ErrorCode::KindMismatch,
                    format!(
                        "{m:?} is in use as a {} lease, not {}",
                        k.as_str(),
                        kind.as_str()
                    ),
                    Some(m),
                );
            }
            if let Some(l) = mine
                .iter()
                .filter_map(|id| self.kl.get(id))
                .find(|l| l.resource == *m)
            {
                return self.error(
                    s,
                    if l.granted {
                        ErrorCode::AlreadyHeld
                    } else {
                        ErrorCode::AlreadyQueued
                    },
                    format!("this connection already holds or waits for {m:?}"),
                    Some(m),
                );
            }
        }
        let free = members.iter().all(|m| self.kgang_member_free(kind, m));
        if !free && !wait {
            let busy = members
                .iter()
                .find(|m| !self.kgang_member_free(kind, m))
                .and_then(|m| self.kind_holder_name(m));
            return self.send(
                s,
                Event::Busy {
                    resource: label,
                    holder: busy,
                },
            );
        }
        let ttl_ms = ext.ttl_ms.map(|t| self.capped_ttl(t).as_millis() as u64);
        let mut ids = Vec::with_capacity(members.len());
        let mut token = String::new();
        for m in &members {
            let (id, t) = self.register(
                s,
                KindLease {
                    mode: (kind == LeaseKind::Shared).then_some(Mode::Shared),
                    ttl_ms,
                    bound: ttl_ms.is_none(),
                    ..KindLease::request(kind, m, &holder)
                },
            );
            if ids.is_empty() {
                token = t;
            }
            ids.push(id);
        }
        let gid = ids[0];
        for id in &ids {
            if let Some(l) = self.kl.get_mut(id) {
                l.gang = Some(gid);
                l.token.clone_from(&token);
            }
        }
        let deadline = ext
            .timeout_ms
            .filter(|_| !free)
            .map(|t| now.mono + Duration::from_millis(t));
        self.kgangs.insert(
            gid,
            KindGang {
                label: label.clone(),
                kind,
                members: ids.clone(),
                granted: false,
                deadline,
            },
        );
        if free {
            return self.kgang_grant(now, gid);
        }
        let mut position = 1;
        for (m, id) in members.iter().zip(&ids) {
            let q = match kind {
                LeaseKind::Ttl => self.ttl_waiters.entry(m.clone()).or_default(),
                _ => self.shared_gang_waits.entry(m.clone()).or_default(),
            };
            q.insert(*id);
            position = position.max(q.len());
        }
        if kind == LeaseKind::Shared {
            // Its members are reserved against later writers (see `shared_fence`).
            for m in &members {
                self.shared_fence(now, m);
            }
        }
        if let Some(d) = deadline {
            self.gang_deadlines.insert((d, gid));
        }
        self.send(
            s,
            Event::Queued {
                resource: label,
                position,
                lease_id: Some(gid),
            },
        );
        // A TTL member may be free already: reserved for this gang now that it is queued.
        if kind == LeaseKind::Ttl {
            for m in &members {
                self.ttl_grant_next(now, m);
            }
        }
    }

    /// Whether a new request of a `kind` gang for `m` could be granted now, with nobody
    /// ahead of it.
    fn kgang_member_free(&self, kind: LeaseKind, m: &str) -> bool {
        match kind {
            LeaseKind::Ttl => {
                self.ttl.holder_of(m).is_none()
                    && self.ttl_waiters.get(m).is_none_or(|q| q.is_empty())
            }
            // Another waiting shared gang is no obstacle: gangs of readers do not conflict.
            _ => {
                self.kind_in_use(m).is_none_or(|k| k == LeaseKind::Shared)
                    && self.shared.admits_reader(m)
            }
        }
    }

    /// The holder name of some live version-2 lease on `m` (for `busy`).
    fn kind_holder_name(&self, m: &str) -> Option<String> {
        let id = self
            .ttl
            .holder_of(m)
            .or_else(|| self.shared.holders(m).first().map(|(id, _)| *id))?;
        self.kl.get(&id).map(|l| l.holder.clone())
    }

    /// Grant waiting TTL gang `gid` if every member is free with it first in line.
    pub(super) fn kgang_try_ttl(&mut self, now: Now, gid: u64) {
        let Some(g) = self.kgangs.get(&gid).filter(|g| !g.granted) else {
            return;
        };
        let members: Vec<(u64, String)> = g
            .members
            .iter()
            .filter_map(|id| self.kl.get(id).map(|l| (*id, l.resource.clone())))
            .collect();
        let free_first = |c: &Core, id: u64, r: &str| {
            c.ttl.holder_of(r).is_none()
                && c.ttl_waiters.get(r).and_then(|q| q.first()) == Some(&id)
        };
        #[cfg(test)]
        if self.planted.kind_gang_partial {
            // The planted bug: grant the members that are free, without waiting for the rest.
            for (id, r) in &members {
                if free_first(self, *id, r) {
                    self.ttl_unqueue(r, *id);
                    self.ttl_grant(now, *id);
                }
            }
            if let Some(g) = self.kgangs.get_mut(&gid) {
                g.granted = true;
            }
            return;
        }
        if members.iter().all(|(id, r)| free_first(self, *id, r)) {
            for (id, r) in &members {
                self.ttl_unqueue(r, *id);
            }
            self.kgang_grant(now, gid);
        }
    }

    /// Waiting shared gangs whose members all admit a reader now are granted (in id order:
    /// the oldest first). Called once per step.
    pub(super) fn kgang_pass(&mut self, now: Now) {
        if self.shared_gang_waits.is_empty() {
            return;
        }
        // The waiting shared gangs, from their members' queues (not every gang).
        let mut waiting: Vec<u64> = self
            .shared_gang_waits
            .values()
            .flatten()
            .filter_map(|id| self.kl.get(id).and_then(|l| l.gang))
            .collect();
        waiting.sort_unstable();
        waiting.dedup();
        for gid in waiting {
            let Some(g) = self.kgangs.get(&gid).filter(|g| !g.granted) else {
                continue;
            };
            let members: Vec<(u64, String)> = g
                .members
                .iter()
                .filter_map(|id| self.kl.get(id).map(|l| (*id, l.resource.clone())))
                .collect();
            // On each member, no writer holds and no writer that arrived before the gang
            // waits (later writers are held back by the fence: `shared_fence`).
            let ready = |c: &Core, id: u64, r: &str| {
                c.kind_in_use(r) == Some(LeaseKind::Shared) && c.shared.admits_gang_reader(r, id)
            };
            #[cfg(test)]
            if self.planted.kind_gang_partial {
                let some: Vec<u64> = members
                    .iter()
                    .filter(|(id, r)| ready(self, *id, r))
                    .map(|(id, _)| *id)
                    .collect();
                if !some.is_empty() {
                    for id in some {
                        self.kgang_grant_shared_member(now, id);
                    }
                    if let Some(g) = self.kgangs.get_mut(&gid) {
                        g.granted = true;
                    }
                }
                continue;
            }
            if members.iter().all(|(id, r)| ready(self, *id, r)) {
                self.kgang_grant(now, gid);
            }
        }
    }

    /// Remove `id` from the TTL queue of `r`.
    fn ttl_unqueue(&mut self, r: &str, id: u64) {
        if let Some(q) = self.ttl_waiters.get_mut(r) {
            q.remove(&id);
            if q.is_empty() {
                self.ttl_waiters.remove(r);
            }
        }
    }

    /// Remove waiting shared member `id` from the gang queue of `r` (its reservation goes
    /// to the next waiting gang there, if any: writers it held back may be granted).
    fn shared_unqueue(&mut self, now: Now, r: &str, id: u64) {
        if let Some(q) = self.shared_gang_waits.get_mut(r) {
            q.remove(&id);
            if q.is_empty() {
                self.shared_gang_waits.remove(r);
            }
            self.shared_fence(now, r);
        }
    }

    /// Admit waiting shared member `id` into the shared table (granted at once when the
    /// caller checked that its resource admits a reader).
    fn kgang_grant_shared_member(&mut self, now: Now, id: u64) -> bool {
        let Some(l) = self.kl.get(&id).cloned() else {
            return false;
        };
        let floor = self.epoch(&l.resource);
        self.note_name(&l.resource);
        self.shared.raise_epoch(&l.resource, floor);
        let req = shared::Request {
            id,
            resource: l.resource.clone(),
            holder: l.holder.clone(),
            mode: shared::Mode::Shared,
            min_version: 0,
        };
        // Let in ahead of the writers its fence held back (they arrived after it), then
        // out of the gang queue: lifting the fence then grants nobody beside this reader.
        let granted = self.shared.admit_gang_reader(req);
        self.shared_unqueue(now, &l.resource, id);
        match granted {
            Ok(g) => {
                self.shared_granted(now, g);
                true
            }
            Err(_) => false,
        }
    }

    /// Grant every member of gang `gid` (all out of their queues, all free) in one step.
    fn kgang_grant(&mut self, now: Now, gid: u64) {
        let Some(g) = self.kgangs.get_mut(&gid) else {
            return;
        };
        g.granted = true;
        let g = g.clone();
        if let Some(d) = g.deadline {
            self.gang_deadlines.remove(&(d, gid));
        }
        let mut ok = true;
        for id in &g.members {
            ok &= match g.kind {
                LeaseKind::Ttl => self.ttl_grant(now, *id),
                _ => self.kgang_grant_shared_member(now, *id),
            };
        }
        let Some(first) = self.kl.get(&gid).cloned() else {
            return;
        };
        if !ok {
            // Cannot happen (every member was checked free in this step): end whatever was
            // granted rather than leave a gang in part.
            if let Some(s) = first.session {
                self.error(
                    s,
                    ErrorCode::WrongLease,
                    format!("gang {gid}: a member could not be granted"),
                    Some(&g.label),
                );
            }
            return self.kgang_end(now, gid, EndWhy::Released);
        }
        let members: Vec<GangMember> = g
            .members
            .iter()
            .filter_map(|id| {
                let l = self.kl.get(id)?;
                Some(GangMember {
                    resource: l.resource.clone(),
                    epoch: l.epoch,
                    version: (g.kind == LeaseKind::Shared)
                        .then(|| self.shared.version(&l.resource)),
                    lease_id: Some(*id),
                })
            })
            .collect();
        let expires = self.lease_fields(gid).expires_at_unix_ms;
        if let Some(s) = first.session {
            self.send(
                s,
                Event::GangGranted {
                    resource: g.label,
                    gang_id: gid,
                    holder: first.holder,
                    token: first.token,
                    members,
                    kind: Some(g.kind),
                    expires_at_unix_ms: expires,
                },
            );
        }
    }

    /// End gang `gid` whole (each member as its kind ends it, `why` for all).
    pub(super) fn kgang_end(&mut self, now: Now, gid: u64, why: EndWhy) {
        let Some(first) = self
            .kgangs
            .get(&gid)
            .and_then(|g| g.members.first().copied())
        else {
            return;
        };
        // The first member's end ends the others (`kgang_member_gone`).
        self.kgang_end_member(now, first, why);
        if let Some(g) = self.kgangs.remove(&gid) {
            // Its first member was gone already (cannot happen): end the rest directly.
            for id in g.members {
                self.kgang_end_member(now, id, EndWhy::Released);
            }
        }
    }

    /// End (or withdraw) one member lease as its kind does.
    fn kgang_end_member(&mut self, now: Now, id: u64, why: EndWhy) {
        let Some(l) = self.kl.get(&id) else {
            return;
        };
        let tell = l.granted && !matches!(why, EndWhy::Released);
        match l.kind {
            LeaseKind::Ttl => self.ttl_end(now, id, why),
            _ => self.shared_end(now, id, why, tell),
        }
    }

    /// Member `gone` of gang `gid` ended (`forget` calls this): the gang ends whole, with the
    /// same reason (a revoked member was named to the holder first: `kgang_tell_lost`).
    pub(super) fn kgang_member_gone(
        &mut self,
        now: Now,
        gid: u64,
        gone_id: u64,
        gone: &KindLease,
        why: &EndWhy,
    ) {
        let Some(g) = self.kgangs.remove(&gid) else {
            return;
        };
        if let Some(d) = g.deadline {
            self.gang_deadlines.remove(&(d, gid));
        }
        if !gone.granted && gone.kind == LeaseKind::Shared {
            self.shared_unqueue(now, &gone.resource, gone_id);
        }
        for id in g.members {
            let Some(l) = self.kl.get(&id) else {
                continue;
            };
            let r = l.resource.clone();
            if !l.granted && l.kind == LeaseKind::Shared {
                self.shared_unqueue(now, &r, id);
            }
            self.kgang_end_member(now, id, why.clone());
            if g.kind == LeaseKind::Ttl {
                // What was reserved for the gang goes to the next in line.
                self.ttl_grant_next(now, &r);
            }
        }
        if g.kind == LeaseKind::Ttl {
            self.ttl_grant_next(now, &gone.resource);
        }
    }

    /// Member `gone` of granted gang `gid` is revoked: named to the holder before it ends.
    pub(super) fn kgang_tell_lost(&mut self, gid: u64, gone: &KindLease, why: &EndWhy) {
        let granted = self.kgangs.get(&gid).is_some_and(|g| g.granted);
        if let (true, EndWhy::Revoked(..), Some(s)) = (granted, why, gone.session) {
            self.send(
                s,
                Event::MemberLost {
                    gang_id: gid,
                    resource: gone.resource.clone(),
                    epoch: gone.epoch,
                    reason: why.text(),
                },
            );
        }
    }

    /// A waiting gang's timeout passed: it gives up (`cancelled`).
    pub(super) fn kgang_cancel(&mut self, now: Now, gid: u64) {
        let Some(g) = self.kgangs.get(&gid) else {
            return;
        };
        let label = g.label.clone();
        if let Some(s) = self.kl.get(&gid).and_then(|l| l.session) {
            self.send(s, Event::Cancelled { resource: label });
        }
        self.kgang_end(now, gid, EndWhy::Released);
    }

    /// The member ids of the gang lease `id` is in (just `id` when in none).
    pub(super) fn gang_of(&self, id: u64) -> Vec<u64> {
        self.kl
            .get(&id)
            .and_then(|l| l.gang)
            .and_then(|g| self.kgangs.get(&g))
            .map_or_else(|| vec![id], |g| g.members.clone())
    }

    /// `renew` by the id of a member of a timed gang: every member gets the full TTL again
    /// from the same instant (one deadline), or, if one has ended, the gang ends whole and
    /// the renewal is refused.
    pub(super) fn kgang_renew(&mut self, now: Now, s: SessionId, gid: u64, ttl_ms: Option<u64>) {
        let Some(g) = self.kgangs.get(&gid).cloned() else {
            return;
        };
        let bound = self.kl.get(&gid).is_some_and(|l| l.bound);
        if bound || ttl_ms.is_some() {
            return self.error(
                s,
                ErrorCode::WrongLease,
                if bound {
                    format!("gang {gid} is bound to its connection and has no deadline to renew")
                } else {
                    "a gang renews with the TTL it was granted (leave out ttl_ms)".into()
                },
                Some(&g.label),
            );
        }
        let mut ended = Vec::new();
        let mut expires = None;
        let mut refused = None;
        for id in &g.members {
            self.note_lease(*id);
            let table = match g.kind {
                LeaseKind::Ttl => &mut self.ttl,
                _ => &mut self.shared_ttl,
            };
            let out = table.renew(*id, now);
            ended.extend(out.ended);
            match out.result {
                Ok(info) => expires = Some(info.expires_at_unix_ms),
                Err(TtlError::Ended { state, .. }) => {
                    refused.get_or_insert(format!("gang {gid} has ended ({state})"));
                }
                Err(e) => {
                    refused.get_or_insert(e.to_string());
                }
            }
        }
        for e in ended {
            match g.kind {
                LeaseKind::Ttl => self.ttl_ended(now, e),
                _ => self.shared_end(now, e.id, EndWhy::Expired, true),
            }
        }
        match (refused, expires) {
            (None, Some(at)) => {
                self.count_renewal(g.kind, true);
                self.send(
                    s,
                    Event::Renewed {
                        lease_id: gid,
                        resource: g.label,
                        expires_at_unix_ms: at,
                    },
                );
            }
            (why, _) => {
                // A member that ended makes the gang end whole (its end reached `forget`);
                // one still live (cannot happen: one deadline for all) is ended too.
                if self.kgangs.contains_key(&gid) {
                    self.kgang_end(now, gid, EndWhy::Expired);
                }
                self.count_renewal(g.kind, false);
                self.error(
                    s,
                    ErrorCode::LeaseEnded,
                    format!(
                        "{}: acquire a new one",
                        why.unwrap_or_else(|| format!("gang {gid} has ended"))
                    ),
                    Some(&g.label),
                );
            }
        }
    }

    /// After a restore: the gangs of the persisted members (granted, whole: they were
    /// written in one step and end in one step).
    pub(super) fn kgang_restore(&mut self) {
        let mut gangs: std::collections::BTreeMap<u64, KindGang> = Default::default();
        for (id, l) in &self.kl {
            if let Some(gid) = l.gang {
                let g = gangs.entry(gid).or_insert_with(|| KindGang {
                    label: l.resource.clone(),
                    kind: l.kind,
                    members: Vec::new(),
                    granted: true,
                    deadline: None,
                });
                g.members.push(*id);
            }
        }
        self.kgangs = gangs;
    }
}

#[cfg(test)]
mod tests {
    //! TTL and shared gangs: whole at grant, renewal, expiry, release, revoke and restart.
    use crate::core::testkit::*;
    use crate::proto::{LeaseKind, Mode};

    fn kgang(label: &str, h: &str, members: &[&str], ttl: Option<u64>, shared: bool) -> Request {
        Request::Acquire {
            resource: label.into(),
            holder: h.into(),
            wait: true,
            ext: proto::AcquireExt {
                gang: Some(members.iter().map(|m| m.to_string()).collect()),
                ttl_ms: ttl,
                mode: shared.then_some(Mode::Shared),
                ..Default::default()
            },
        }
    }

    /// The gang granted to `s`: (gang id, token, [(resource, epoch, version)], expiry).
    #[allow(clippy::type_complexity)]
    fn granted(
        out: &[Output],
        s: SessionId,
    ) -> Option<(u64, String, Vec<(String, u64, Option<u64>)>, Option<u64>)> {
        H::to(out, s).into_iter().find_map(|e| match e {
            Event::GangGranted {
                gang_id,
                token,
                members,
                expires_at_unix_ms,
                ..
            } => Some((
                gang_id,
                token,
                members
                    .into_iter()
                    .map(|m| (m.resource, m.epoch, m.version))
                    .collect(),
                expires_at_unix_ms,
            )),
            _ => None,
        })
    }

    fn renew(id: u64, token: &str) -> Request {
        Request::Renew {
            lease_id: id,
            token: token.into(),
            ttl_ms: None,
        }
    }

    fn ended(out: &[Output], s: SessionId) -> Vec<(String, String)> {
        H::to(out, s)
            .into_iter()
            .filter_map(|e| match e {
                Event::LeaseEnded {
                    resource, reason, ..
                } => Some((resource, reason)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_ttl_gang_is_granted_whole_renewed_whole_and_expires_whole() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.ms = 100;
        let out = h.req(1, kgang("tp", "eng", &["a", "b", "c"], Some(1000), false));
        let (gid, token, m, exp) = granted(&out, 1).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(exp, Some(1100));
        assert!(
            H::to(&out, 1).len() == 1,
            "one gang_granted, no granted per member"
        );
        // Durable before visible: every member and its deadline are in the written state.
        let st = h.persisted.clone().unwrap();
        assert_eq!(
            st.kind_leases
                .values()
                .filter(|l| l.gang == Some(gid))
                .count(),
            3
        );
        assert_eq!(st.ttl.leases.len(), 3);
        // The gang outlives its connection.
        h.step(Input::Disconnect { session: 1 });
        h.connect(2, "unix");
        assert_eq!(h.lease(2, gid).state, "held");
        h.ms = 900;
        let out = h.req(2, renew(gid, &token));
        assert_eq!(
            H::to(&out, 2),
            vec![Event::Renewed {
                lease_id: gid,
                resource: "tp".into(),
                expires_at_unix_ms: 1900
            }]
        );
        for id in gid..gid + 3 {
            let r = h.lease(2, id);
            assert_eq!(r.lease.expires_at_unix_ms, Some(1900));
            assert_eq!(r.lease.gang_id, Some(gid), "every member names its gang");
        }
        h.ms = 1900;
        h.step(Input::Tick);
        for id in gid..gid + 3 {
            let r = h.lease(2, id);
            assert_eq!(
                (r.state.as_str(), r.reason.as_deref()),
                ("expired", Some("expired"))
            );
        }
        let out = h.req(2, renew(gid, &token));
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("lease_ended"));
    }

    #[test]
    fn a_waiting_ttl_gang_reserves_freed_members_and_is_never_held_in_part() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        let single = H::g(&h.req(2, acq_ttl("b", "x", 500, true)), 2).unwrap();
        let out = h.req(1, kgang("tp", "eng", &["a", "b"], Some(1000), false));
        assert!(matches!(
            &H::to(&out, 1)[..],
            [Event::Queued {
                lease_id: Some(_),
                ..
            }]
        ));
        assert!(h.core.ttl.holder_of("a").is_none(), "a is not held in part");
        // `a` is reserved: a later TTL acquire queues behind the gang.
        let out = h.req(3, acq_ttl("a", "late", 500, true));
        assert!(matches!(&H::to(&out, 3)[..], [Event::Queued { .. }]));
        // b's lease expires: the gang gets both in one step, the late one waits.
        h.ms = 500;
        let out = h.step(Input::Tick);
        let (gid, token, m, _) = granted(&out, 1).unwrap();
        assert_eq!(m.len(), 2);
        assert!(H::g(&out, 3).is_none());
        let _ = single;
        // Released by gang id (any connection, with the token): every member, then the
        // late one gets `a`.
        let out = h.req(
            2,
            Request::Release {
                resource: None,
                lease_id: Some(gid),
                token: Some(token),
            },
        );
        let released = H::to(&out, 2)
            .into_iter()
            .filter(|e| matches!(e, Event::Released { .. }))
            .count();
        assert_eq!(released, 2);
        assert!(H::g(&out, 3).is_some());
        assert_eq!(h.lease(2, gid).state, "released");
        assert_eq!(h.lease(2, gid + 1).state, "released");
    }

    #[test]
    fn revoking_one_member_names_it_and_ends_the_gang_whole() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(9, "unix");
        let (gid, _, _, _) = granted(
            &h.req(1, kgang("tp", "eng", &["a", "b"], Some(1000), false)),
            1,
        )
        .unwrap();
        let out = h.req(
            9,
            Request::Revoke {
                resource: None,
                lease_id: Some(gid + 1),
                reason: Some("gpu failed".into()),
                admin_token: None,
            },
        );
        let ev = H::to(&out, 1);
        assert!(
            matches!(&ev[0], Event::MemberLost { gang_id, resource, reason, .. }
                if *gang_id == gid && resource == "b" && reason.ends_with("gpu failed")),
            "{ev:?}"
        );
        let e = ended(&out, 1);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e.iter().all(|(_, r)| r.starts_with("revoked:")));
        assert!(h.lease(9, gid).state == "revoked");
        let c = h.st().counters_by_kind[&LeaseKind::Ttl];
        assert_eq!(c.revocations, 2);
    }

    #[test]
    fn a_ttl_gang_stays_whole_across_a_restart_with_its_deadline() {
        let mut h = H::new();
        h.connect(1, "unix");
        let (gid, token, _, exp) = granted(
            &h.req(1, kgang("tp", "eng", &["a", "b"], Some(1000), false)),
            1,
        )
        .unwrap();
        let st = h.persisted.clone().unwrap();
        let mut h = H::with_state(st, None);
        h.connect(2, "unix");
        assert_eq!(h.lease(2, gid).lease.expires_at_unix_ms, exp);
        assert_eq!(h.lease(2, gid + 1).state, "held");
        h.ms = 500;
        let out = h.req(2, renew(gid, &token));
        assert!(matches!(
            &H::to(&out, 2)[..],
            [Event::Renewed {
                expires_at_unix_ms: 1500,
                ..
            }]
        ));
        // One member released by its resource ends the gang whole.
        h.connect(3, "unix");
        let out = h.req(
            3,
            Request::Release {
                resource: None,
                lease_id: Some(gid + 1),
                token: Some(token),
            },
        );
        assert_eq!(H::to(&out, 3).len(), 2);
        assert_eq!(h.lease(3, gid).state, "released");
        assert!(h.core.kgangs.is_empty());
    }

    #[test]
    fn a_shared_gang_waits_for_the_writer_ahead_and_reports_each_version() {
        let mut h = H::new();
        for s in 1..=4 {
            h.connect(s, "unix");
        }
        // A reader on `a`, a writer waiting for `a`: writer priority blocks new readers.
        h.req(2, acq_shared("a", "r", true, None));
        h.req(3, acq_shared("a", "w", false, None));
        let out = h.req(1, kgang("tp", "eng", &["a", "b"], None, true));
        assert!(matches!(&H::to(&out, 1)[..], [Event::Queued { .. }]));
        assert!(
            h.core.shared.holders("b").is_empty(),
            "b is not held in part"
        );
        // The reader leaves: the writer goes first, the gang still waits.
        let out = h.step(Input::Disconnect { session: 2 });
        assert!(granted(&out, 1).is_none());
        let w = H::g(&out, 3).unwrap();
        h.req(
            3,
            Request::Commit {
                lease_id: w.id,
                token: w.token.clone(),
            },
        );
        // The writer leaves: the gang gets both, with a's new version.
        let out = h.step(Input::Disconnect { session: 3 });
        let (gid, _, m, exp) = granted(&out, 1).unwrap();
        assert_eq!(exp, None);
        assert_eq!(
            m.iter()
                .map(|(r, _, v)| (r.as_str(), *v))
                .collect::<Vec<_>>(),
            vec![("a", Some(1)), ("b", Some(0))]
        );
        // Readers beside the gang are fine; a writer waits for the whole gang.
        let out = h.req(4, acq_shared("b", "r2", true, None));
        assert!(H::g(&out, 4).is_some());
        // The gang is bound to its connection: it ends whole with it.
        let out = h.step(Input::Disconnect { session: 1 });
        let _ = out;
        assert_eq!(h.lease(4, gid).state, "released");
        assert_eq!(h.lease(4, gid + 1).state, "released");
    }

    #[test]
    fn a_timed_shared_gang_renews_whole_and_kinds_do_not_mix() {
        let mut h = H::new();
        h.connect(1, "unix");
        let (gid, token, _, exp) = granted(
            &h.req(1, kgang("rd", "eng", &["a", "b"], Some(1000), true)),
            1,
        )
        .unwrap();
        assert_eq!(exp, Some(1000));
        h.ms = 600;
        let out = h.req(1, renew(gid, &token));
        assert!(matches!(
            &H::to(&out, 1)[..],
            [Event::Renewed {
                expires_at_unix_ms: 1600,
                ..
            }]
        ));
        h.ms = 1600;
        let out = h.step(Input::Tick);
        assert_eq!(ended(&out, 1).len(), 2);
        // A TTL gang over a shared resource is refused whole.
        h.req(1, acq_shared("s", "r", true, None));
        let out = h.req(1, kgang("t", "eng", &["x", "s"], Some(1000), false));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("kind_mismatch"));
        assert!(h.core.ttl.holder_of("x").is_none());
    }

    #[test]
    fn a_bound_shared_gang_is_resumed_whole_after_a_restart_or_ends_whole() {
        let mut h = H::new();
        h.connect(1, "unix");
        let (gid, token, _, _) =
            granted(&h.req(1, kgang("rd", "eng", &["a", "b"], None, true)), 1).unwrap();
        let st = h.persisted.clone().unwrap();
        // Resumed by the gang id: every member, reclaimed.
        let mut h2 = H::with_state(st.clone(), None);
        h2.connect(2, "unix");
        let out = h2.req(
            2,
            Request::Resume {
                lease_id: gid,
                token: token.clone(),
            },
        );
        let back: Vec<bool> = H::to(&out, 2)
            .into_iter()
            .filter_map(|e| match e {
                Event::Granted { reclaimed, .. } => Some(reclaimed),
                _ => None,
            })
            .collect();
        assert_eq!(back, vec![true, true]);
        h2.ms = W;
        h2.step(Input::Tick);
        assert_eq!(h2.lease(2, gid + 1).state, "held");
        // Not resumed within the window: it ends whole.
        let mut h3 = H::with_state(st, None);
        h3.connect(2, "unix");
        h3.ms = W;
        h3.step(Input::Tick);
        assert_eq!(h3.lease(2, gid).state, "expired");
        assert_eq!(h3.lease(2, gid + 1).state, "expired");
        assert!(h3.core.kgangs.is_empty());
    }

    #[test]
    fn a_waiting_gang_times_out_and_hands_its_reservations_on() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(2, acq_ttl("b", "x", 5000, true));
        let mut req = kgang("g", "eng", &["a", "b"], Some(1000), false);
        if let Request::Acquire { ext, .. } = &mut req {
            ext.timeout_ms = Some(100);
        }
        h.req(1, req);
        h.req(3, acq_ttl("a", "y", 1000, true));
        assert!(h.core.ttl.holder_of("a").is_none());
        h.ms = 100;
        let out = h.step(Input::Tick);
        assert!(H::to(&out, 1).contains(&Event::Cancelled {
            resource: "g".into()
        }));
        assert!(H::g(&out, 3).is_some(), "the reserved member goes on");
        assert!(h.core.kgangs.is_empty() && h.core.kl.len() == 2);
    }
}
