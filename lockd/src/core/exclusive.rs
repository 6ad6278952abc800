//! The exclusive, connection-bound lease (protocol version 1's lease): admission, grant,
//! release, revoke, reclaim after a restart, and the end of reconnect windows.
//!
//! One holder at a time, first come first served; the lease lives as long as its session
//! (its connection, or its anchors). Every grant takes a new epoch and a new lease id.

use std::time::Instant;

use super::table::{Lease, LeaseKind, LeaseMode, LeaseState, Waiter};
use super::{ct_eq, Core, Now, SessionId};
use crate::proto::{ErrorCode, Event, LeaseFields, Notice, NoticeKind};

impl Core {
    /// `acquire`: granted at once if free and nobody waits, else queued (or `busy`).
    pub(super) fn acquire(
        &mut self,
        now: Now,
        s: SessionId,
        resource: String,
        holder: String,
        wait: bool,
        reserve_ms: Option<u64>,
    ) {
        let res = self.table.entry(&resource);
        if matches!(&res.lease, LeaseState::Held(l) if l.session == s) {
            return self.error(
                s,
                ErrorCode::AlreadyHeld,
                "this connection holds it".into(),
                Some(&resource),
            );
        }
        if res.waiters.contains_session(s) {
            return self.error(
                s,
                ErrorCode::AlreadyQueued,
                "already queued".into(),
                Some(&resource),
            );
        }
        if matches!(res.lease, LeaseState::Free) && res.waiters.is_empty() {
            self.grant(now, &resource, s, holder, None);
            self.reserve(now, &resource, reserve_ms);
        } else if !wait {
            let holder = res.lease.holder_name().map(str::to_string);
            self.send(s, Event::Busy { resource, holder });
        } else {
            let t = self.table.next_ticket();
            let Some(res) = self.table.get_noted(&resource) else {
                return;
            };
            let position = res.waiters.push(
                t,
                Waiter {
                    session: s,
                    holder,
                    gang: None,
                    reserve_ms,
                },
            );
            self.table.touch(&resource);
            if let Some(sess) = self.sessions.get_mut(&s) {
                sess.waits.insert(resource.clone());
            }
            self.send(
                s,
                Event::Queued {
                    resource,
                    position,
                    lease_id: None,
                },
            );
        }
    }

    /// Grant `resource` to session `s`: a new epoch, lease id and token; persisted before sent.
    pub(super) fn grant(
        &mut self,
        now: Now,
        resource: &str,
        s: SessionId,
        holder: String,
        handoff_from: Option<Instant>,
    ) {
        let token = self.new_token();
        if let Some(epoch) = self.grant_lease(now, resource, s, &holder, &token, None) {
            self.send(
                s,
                Event::Granted {
                    resource: resource.into(),
                    holder: holder.clone(),
                    epoch,
                    token,
                    reclaimed: false,
                    lease: LeaseFields::default(),
                },
            );
            self.granted_notice(now, resource, s, holder, epoch, handoff_from);
        }
    }

    /// Make session `s` the holder of free `resource` (a new epoch and lease id), durable
    /// with the next write; returns the epoch. The caller tells the holder.
    pub(super) fn grant_lease(
        &mut self,
        now: Now,
        resource: &str,
        s: SessionId,
        holder: &str,
        token: &str,
        gang: Option<u64>,
    ) -> Option<u64> {
        let res = self.table.get_noted(resource)?;
        res.epoch += 1;
        let epoch = res.epoch;
        let lease_id = self.table.new_lease_id();
        self.table.set_lease(
            resource,
            LeaseState::Held(Lease {
                lease_id,
                kind: LeaseKind::Exclusive,
                mode: LeaseMode::Exclusive,
                session: s,
                holder: holder.to_string(),
                epoch,
                token: token.to_string(),
                granted_at_unix_ms: now.unix_ms,
                revoked: None,
                gang,
            }),
        );
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.waits.remove(resource);
            sess.holds.insert(resource.to_string());
        }
        self.counters.grants += 1;
        self.dirty = true;
        Some(epoch)
    }

    /// The `granted` notice of an exclusive lease.
    pub(super) fn granted_notice(
        &mut self,
        now: Now,
        resource: &str,
        s: SessionId,
        holder: String,
        epoch: u64,
        handoff_from: Option<Instant>,
    ) {
        self.notice(
            Notice {
                kind: NoticeKind::Granted,
                resource: resource.into(),
                holder: Some(holder),
                epoch,
                session: Some(s),
                reclaimed: false,
                after_revoke: false,
                reason: None,
                at_unix_ms: now.unix_ms,
                lease_id: None,
                lease_kind: None,
                version: None,
            },
            handoff_from,
        );
    }

    /// Grant to the first waiter if the resource is free. A gang first in line is granted
    /// only with all its members; until then the resource stays free, reserved for it (later
    /// acquires queue behind it: a stream of small acquires cannot starve a gang).
    pub(super) fn grant_next(&mut self, now: Now, resource: &str, handoff_from: Option<Instant>) {
        let Some(res) = self.table.get_noted(resource) else {
            return;
        };
        if !matches!(res.lease, LeaseState::Free) {
            return;
        }
        match res.waiters.front().map(|w| w.gang) {
            None => {}
            Some(Some(gang)) => self.try_gang(now, gang, handoff_from),
            Some(None) => {
                if let Some(w) = res.waiters.pop_front() {
                    self.grant(now, resource, w.session, w.holder, handoff_from);
                    self.reserve(now, resource, w.reserve_ms);
                }
            }
        }
    }

    /// End the live lease of `resource` (release or connection close).
    pub(super) fn end_lease(&mut self, now: Now, resource: &str) -> Option<u64> {
        if !matches!(
            self.table.resources.get(resource)?.lease,
            LeaseState::Held(_)
        ) {
            return None;
        }
        let LeaseState::Held(l) = self.table.set_lease(resource, LeaseState::Free)? else {
            return None;
        };
        self.unreserve(resource);
        if let Some(sess) = self.sessions.get_mut(&l.session) {
            sess.holds.remove(resource);
        }
        if l.revoked.is_none() {
            self.counters.releases += 1;
        }
        self.dirty = true;
        self.notice(
            Notice {
                kind: NoticeKind::Released,
                resource: resource.into(),
                holder: Some(l.holder),
                epoch: l.epoch,
                session: Some(l.session),
                reclaimed: false,
                after_revoke: l.revoked.is_some(),
                reason: None,
                at_unix_ms: now.unix_ms,
                lease_id: None,
                lease_kind: None,
                version: None,
            },
            None,
        );
        Some(l.epoch)
    }

    /// `release`: end the held lease (and grant the next waiter) or withdraw a queued acquire.
    pub(super) fn release(&mut self, now: Now, s: SessionId, resource: String) {
        // One look at the resource: held by this session (and as a member of which gang)?
        let held = match self.table.resources.get(&resource).map(|r| &r.lease) {
            Some(LeaseState::Held(l)) if l.session == s => Some(l.gang),
            _ => None,
        };
        // A gang is released whole: releasing one member releases every member.
        if let Some(g) = held.flatten().filter(|g| self.gangs.contains_key(g)) {
            return self.gang_end(now, g, Some(s));
        }
        // A waiting gang of this session, by its name (no gang at all: nothing to look for).
        if !self.gangs.is_empty() {
            let waiting = self.sessions.get(&s).and_then(|x| {
                x.gangs.iter().copied().find(|g| {
                    self.gangs
                        .get(g)
                        .is_some_and(|g| !g.granted && g.label == resource)
                })
            });
            if let Some(g) = waiting {
                return self.gang_end(now, g, Some(s));
            }
        }
        if held.is_some() {
            if let Some(epoch) = self.end_lease(now, &resource) {
                self.send(
                    s,
                    Event::Released {
                        resource: resource.clone(),
                        epoch,
                        lease_id: None,
                    },
                );
            }
            self.grant_next(now, &resource, Some(now.mono));
            return;
        }
        let queued = self
            .table
            .resources
            .get_mut(&resource)
            .and_then(|r| r.waiters.remove_session(s))
            .is_some();
        self.table.touch(&resource);
        if queued {
            if let Some(sess) = self.sessions.get_mut(&s) {
                sess.waits.remove(&resource);
            }
            self.send(s, Event::Cancelled { resource });
        } else {
            self.error(
                s,
                ErrorCode::NotHolder,
                "neither held nor queued by this connection".into(),
                Some(&resource),
            );
        }
    }

    /// `reclaim`: hand a lease waiting in its reconnect window back to its holder (same epoch).
    pub(super) fn reclaim(
        &mut self,
        now: Now,
        s: SessionId,
        resource: String,
        epoch: u64,
        token: String,
    ) {
        let refuse = |why: &str| format!("cannot reclaim epoch {epoch}: {why}");
        // A gang of this connection waits for it: taking the member alone would leave the
        // gang waiting on its own session (found by the model checker, lockd-model).
        let gang_waits = self
            .table
            .resources
            .get(&resource)
            .is_some_and(|r| r.waiters.iter().any(|w| w.session == s && w.gang.is_some()));
        if gang_waits {
            return self.error(
                s,
                ErrorCode::AlreadyQueued,
                "a gang of this connection waits for it: cancel the gang first".into(),
                Some(&resource),
            );
        }
        let Some(res) = self.table.resources.get(&resource) else {
            return self.error(
                s,
                ErrorCode::ReclaimRefused,
                refuse("unknown resource"),
                Some(&resource),
            );
        };
        let msg = match &res.lease {
            LeaseState::Reclaiming { lease, .. }
                if lease.epoch == epoch && ct_eq(&lease.token, &token) =>
            {
                None
            }
            LeaseState::Reclaiming { .. } => Some("epoch or token does not match"),
            LeaseState::Held(l) if l.session == s => {
                return self.error(
                    s,
                    ErrorCode::AlreadyHeld,
                    "this connection holds it".into(),
                    Some(&resource),
                );
            }
            LeaseState::Held(_) => Some("the resource is held by another lease"),
            LeaseState::Free => Some("no lease is waiting to be reclaimed (expired or released)"),
        };
        if let Some(m) = msg {
            return self.error(s, ErrorCode::ReclaimRefused, refuse(m), Some(&resource));
        }
        let Some(LeaseState::Reclaiming { lease, .. }) =
            self.table.set_lease(&resource, LeaseState::Free)
        else {
            return;
        };
        // A lease revoked while it waited in the reconnect window comes back revoked: its
        // holder (which may still run an engine) learns it right after the grant and must
        // fence itself; the lease moves only once its session is gone.
        let revoked = lease
            .revoked
            .then(|| "revoked while lockd was restarting".to_string());
        self.table.set_lease(
            &resource,
            LeaseState::Held(Lease {
                lease_id: lease.lease_id,
                kind: lease.kind,
                mode: lease.mode,
                session: s,
                holder: lease.name.clone(),
                epoch: lease.epoch,
                token: lease.token.clone(),
                granted_at_unix_ms: lease.granted_at_unix_ms,
                revoked: revoked.clone(),
                gang: lease.gang,
            }),
        );
        // A session that also queued for it (re-queued before reclaiming) is no waiter now.
        if let Some(res) = self.table.get_noted(&resource) {
            res.waiters.remove_session(s);
        }
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.waits.remove(&resource);
            sess.holds.insert(resource.clone());
        }
        self.counters.reclaims += 1;
        self.dirty = true;
        self.send(
            s,
            Event::Granted {
                resource: resource.clone(),
                holder: lease.name.clone(),
                epoch,
                token: lease.token,
                reclaimed: true,
                lease: LeaseFields::default(),
            },
        );
        if let Some(reason) = revoked {
            self.send(
                s,
                Event::Revoked {
                    resource: resource.clone(),
                    epoch,
                    reason,
                },
            );
        }
        self.notice(
            Notice {
                kind: NoticeKind::Granted,
                resource,
                holder: Some(lease.name),
                epoch,
                session: Some(s),
                reclaimed: true,
                after_revoke: false,
                reason: None,
                at_unix_ms: now.unix_ms,
                lease_id: None,
                lease_kind: None,
                version: None,
            },
            None,
        );
    }

    /// `revoke`: mark the lease revoked and tell its holder; it ends only when its session does.
    pub(super) fn revoke(&mut self, now: Now, s: SessionId, resource: String, reason: String) {
        let Some(res) = self.table.get_noted(&resource) else {
            return self.error(
                s,
                ErrorCode::NotHeld,
                "nobody holds it".into(),
                Some(&resource),
            );
        };
        let mk = |holder: &str, epoch: u64, session: Option<SessionId>| Notice {
            kind: NoticeKind::Revoked,
            resource: resource.clone(),
            holder: Some(holder.to_string()),
            epoch,
            session,
            reclaimed: false,
            after_revoke: false,
            reason: Some(reason.clone()),
            at_unix_ms: now.unix_ms,
            lease_id: None,
            lease_kind: None,
            version: None,
        };
        match &mut res.lease {
            LeaseState::Free => {
                self.error(
                    s,
                    ErrorCode::NotHeld,
                    "nobody holds it".into(),
                    Some(&resource),
                );
            }
            LeaseState::Held(_) => {
                if let Some((holder, epoch)) = self.revoke_held(now, &resource, reason) {
                    self.send(
                        s,
                        Event::RevokeSent {
                            resource,
                            epoch,
                            holder: Some(holder),
                        },
                    );
                }
            }
            LeaseState::Reclaiming { lease, .. } => {
                // Nothing is known of the holder but that it may still run: the lease keeps
                // waiting. Reclaimed, it comes back revoked (the holder fences itself);
                // unclaimed, it ends with the window. Never granted to another before then.
                let (holder, epoch, was) = (lease.name.clone(), lease.epoch, lease.revoked);
                lease.revoked = true;
                if !was {
                    self.counters.revocations += 1;
                    self.dirty = true;
                    let n = mk(&holder, epoch, None);
                    self.notice(n, None);
                }
                self.send(
                    s,
                    Event::RevokeSent {
                        resource: resource.clone(),
                        epoch,
                        holder: Some(holder),
                    },
                );
            }
        }
    }

    /// Mark the held lease of `resource` revoked (counted and announced the first time) and
    /// tell its holder to fence itself and let go; it moves only once the holder's session
    /// ends. Returns (holder, epoch), or None if nobody holds it. The operator's `revoke`
    /// and the deadlock breaker both come here.
    pub(super) fn revoke_held(
        &mut self,
        now: Now,
        resource: &str,
        reason: String,
    ) -> Option<(String, u64)> {
        let LeaseState::Held(l) = &mut self.table.get_noted(resource)?.lease else {
            return None;
        };
        let first = l.revoked.is_none();
        l.revoked = Some(reason.clone());
        let (holder, epoch, hs, gang) = (l.holder.clone(), l.epoch, l.session, l.gang);
        if first {
            self.counters.revocations += 1;
            self.dirty = true;
            self.notice(
                Notice {
                    kind: NoticeKind::Revoked,
                    resource: resource.to_string(),
                    holder: Some(holder.clone()),
                    epoch,
                    session: Some(hs),
                    reclaimed: false,
                    after_revoke: false,
                    reason: Some(reason.clone()),
                    at_unix_ms: now.unix_ms,
                    lease_id: None,
                    lease_kind: None,
                    version: None,
                },
                None,
            );
        }
        if let Some(gang_id) = gang {
            // A member of a gang: named to the holder, which fences it and may reserve a
            // replacement (the gang's other members stay held).
            self.send(
                hs,
                Event::MemberLost {
                    gang_id,
                    resource: resource.to_string(),
                    epoch,
                    reason: reason.clone(),
                },
            );
        }
        self.send(
            hs,
            Event::Revoked {
                resource: resource.to_string(),
                epoch,
                reason,
            },
        );
        Some((holder, epoch))
    }

    /// End reconnect windows whose deadline has passed.
    pub(super) fn expire(&mut self, now: Now) {
        for name in self.table.due(now.mono) {
            let Some(LeaseState::Reclaiming { lease, .. }) =
                self.table.set_lease(&name, LeaseState::Free)
            else {
                continue;
            };
            if !lease.revoked {
                self.counters.expirations += 1;
            }
            self.dirty = true;
            self.notice(
                Notice {
                    kind: NoticeKind::Expired,
                    resource: name.clone(),
                    holder: Some(lease.name),
                    epoch: lease.epoch,
                    session: None,
                    reclaimed: false,
                    after_revoke: lease.revoked,
                    reason: None,
                    at_unix_ms: now.unix_ms,
                    lease_id: None,
                    lease_kind: None,
                    version: None,
                },
                None,
            );
            self.grant_next(now, &name, None);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Transition-by-transition tests of the exclusive lease.
    use crate::core::testkit::*;

    #[test]
    fn queue_positions_busy_and_duplicates() {
        let mut h = H::new();
        for s in 1..=4 {
            h.connect(s, "unix");
        }
        let out = h.req(1, acq("e", "a", true));
        assert_eq!(H::granted(&out, 1).unwrap().0, 1);
        let out = h.req(2, acq("e", "b", true));
        assert_eq!(
            H::to(&out, 2),
            vec![Event::Queued {
                resource: "e".into(),
                position: 1,
                lease_id: None,
            }]
        );
        let out = h.req(3, acq("e", "c", true));
        assert_eq!(
            H::to(&out, 3),
            vec![Event::Queued {
                resource: "e".into(),
                position: 2,
                lease_id: None,
            }]
        );
        let out = h.req(4, acq("e", "d", false));
        assert_eq!(
            H::to(&out, 4),
            vec![Event::Busy {
                resource: "e".into(),
                holder: Some("a".into())
            }]
        );
        assert_eq!(
            H::err_code(&h.req(1, acq("e", "a", true)), 1).as_deref(),
            Some("already_held")
        );
        assert_eq!(
            H::err_code(&h.req(2, acq("e", "b", true)), 2).as_deref(),
            Some("already_queued")
        );
        let r = h.res("e");
        assert_eq!(
            (r.state, r.holder.as_deref(), r.epoch),
            (proto::LeaseState::Held, Some("a"), 1)
        );
        assert_eq!(r.waiters, vec!["b".to_string(), "c".to_string()]);
        // Busy and queue changes are not persisted; only the grant was.
        assert_eq!(h.persists, 1);
    }

    #[test]
    fn holder_disconnect_releases_and_grants_next_with_higher_epoch() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        h.ms = 5;
        let out = h.step(Input::Disconnect { session: 1 });
        let (epoch, _, reclaimed) = H::granted(&out, 2).unwrap();
        assert_eq!((epoch, reclaimed), (2, false));
        let handoff = out.iter().find_map(|o| match o {
            Output::Notice {
                notice,
                handoff_from,
            } if notice.kind == NoticeKind::Granted => Some(*handoff_from),
            _ => None,
        });
        assert_eq!(handoff, Some(Some(h.base + Duration::from_millis(5))));
        let c = h.core.counters();
        assert_eq!(
            (c.grants, c.releases, c.expirations, c.revocations),
            (2, 1, 0, 0)
        );
        assert_eq!(
            h.persisted.as_ref().unwrap().resources["e"]
                .holder
                .as_ref()
                .unwrap()
                .name,
            "b"
        );
    }

    #[test]
    fn explicit_release_cancel_and_not_holder() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        assert_eq!(
            H::to(&h.req(2, Request::release("e")), 2),
            vec![Event::Cancelled {
                resource: "e".into()
            }]
        );
        assert!(h.res("e").waiters.is_empty());
        assert_eq!(
            H::err_code(&h.req(3, Request::release("e")), 3).as_deref(),
            Some("not_holder")
        );
        h.req(3, acq("e", "c", true));
        let out = h.req(1, Request::release("e"));
        assert_eq!(
            H::to(&out, 1),
            vec![Event::Released {
                resource: "e".into(),
                epoch: 1,
                lease_id: None,
            }]
        );
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert_eq!(h.core.counters().releases, 1);
    }

    #[test]
    fn independent_resources_do_not_interfere() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        assert_eq!(H::granted(&h.req(1, acq("x", "a", true)), 1).unwrap().0, 1);
        assert_eq!(H::granted(&h.req(2, acq("y", "b", true)), 2).unwrap().0, 1);
        assert_eq!(H::granted(&h.req(1, acq("y2", "a", true)), 1).unwrap().0, 1);
    }

    #[test]
    fn restart_opens_a_window_then_reclaim_returns_the_same_epoch() {
        let (mut h, token) = restarted();
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
        assert_eq!(
            h.core.next_deadline(),
            Some(h.base + Duration::from_millis(W))
        );
        h.connect(2, "unix");
        h.connect(3, "unix");
        assert_eq!(
            H::to(&h.req(3, acq("e", "b", true)), 3),
            vec![Event::Queued {
                resource: "e".into(),
                position: 1,
                lease_id: None,
            }]
        );
        assert_eq!(H::to(&h.req(3, acq("e", "b", false)), 3).len(), 1);
        h.ms = 400;
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token: token.clone(),
            },
        );
        assert_eq!(H::granted(&out, 2), Some((1, token, true)));
        assert!(H::to(&out, 3).is_empty());
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        assert_eq!(h.core.next_deadline(), None);
        let c = h.core.counters();
        assert_eq!((c.grants, c.reclaims, c.expirations), (1, 1, 0));
        h.ms = 5000;
        assert!(
            h.step(Input::Tick).is_empty(),
            "nothing expires once reclaimed"
        );
    }

    #[test]
    fn reclaim_by_a_queued_session_takes_it_out_of_the_queue() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(2, acq("e", "a", true));
        h.req(3, acq("e", "b", true));
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(H::granted(&out, 2).map(|g| g.0), Some(1));
        assert_eq!(h.res("e").waiters, vec!["b".to_string()]);
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(
            H::granted(&out, 3).unwrap().0,
            2,
            "the other waiter is next, not the holder"
        );
    }

    #[test]
    fn reclaim_with_wrong_token_or_epoch_is_refused() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        let bad = [
            ("e", 1, "nope".to_string()),
            ("e", 2, token.clone()),
            ("zz", 1, token.clone()),
        ];
        for (r, epoch, t) in bad {
            let out = h.req(
                2,
                Request::Reclaim {
                    resource: r.into(),
                    holder: "a".into(),
                    epoch,
                    token: t,
                },
            );
            assert_eq!(H::err_code(&out, 2).as_deref(), Some("reclaim_refused"));
        }
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
    }

    #[test]
    fn window_expiry_counts_expired_and_grants_the_next_waiter_a_new_epoch() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        h.ms = W - 1;
        assert!(h.step(Input::Tick).is_empty());
        h.ms = W;
        let out = h.step(Input::Tick);
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert!(out.iter().any(|o| matches!(o, Output::Notice { notice, .. } if notice.kind == NoticeKind::Expired && notice.epoch == 1)));
        let c = h.core.counters();
        assert_eq!((c.expirations, c.releases, c.grants), (1, 0, 2));
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("reclaim_refused"));
    }

    #[test]
    fn expiry_without_waiters_frees_and_first_acquirer_wins() {
        let (mut h, _) = restarted();
        h.ms = W + 10;
        h.step(Input::Tick);
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
        h.connect(5, "unix");
        assert_eq!(H::granted(&h.req(5, acq("e", "z", true)), 5).unwrap().0, 2);
    }

    #[test]
    fn revoke_tells_the_holder_and_keeps_the_lease_until_close() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        let out = h.req(3, Request::revoke("e", Some("drain".into()), None));
        assert_eq!(
            H::to(&out, 1),
            vec![Event::Revoked {
                resource: "e".into(),
                epoch: 1,
                reason: "drain".into()
            }]
        );
        assert_eq!(
            H::to(&out, 3),
            vec![Event::RevokeSent {
                resource: "e".into(),
                epoch: 1,
                holder: Some("a".into())
            }]
        );
        assert!(H::granted(&out, 2).is_none());
        let r = h.res("e");
        assert_eq!((r.state, r.revoked), (proto::LeaseState::Held, true));
        // Revoking again re-notifies but does not count twice.
        h.req(3, Request::revoke("e", None, None));
        assert_eq!(h.core.counters().revocations, 1);
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases), (1, 0));
    }

    #[test]
    fn revoke_over_tcp_needs_the_admin_token() {
        let mut h = H::with_state(PersistedState::default(), Some("s3cret"));
        h.connect(1, "unix");
        h.connect(2, "tcp");
        h.req(1, acq("e", "a", true));
        for tok in [None, Some("wrong".to_string())] {
            let out = h.req(2, Request::revoke("e", None, tok));
            assert_eq!(H::err_code(&out, 2).as_deref(), Some("unauthorized"));
            assert!(H::to(&out, 1).is_empty());
        }
        let out = h.req(2, Request::revoke("e", None, Some("s3cret".into())));
        assert!(matches!(H::to(&out, 2)[0], Event::RevokeSent { .. }));
        // Without a configured token, TCP revoke is always refused.
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "tcp");
        h.req(1, acq("e", "a", true));
        let out = h.req(2, Request::revoke("e", None, Some(String::new())));
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("unauthorized"));
    }

    #[test]
    fn revoke_of_free_is_not_held_and_of_reclaiming_waits_for_the_holder() {
        let mut h = H::new();
        h.connect(1, "unix");
        let out = h.req(1, Request::revoke("e", None, None));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("not_held"));
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        let out = h.req(2, Request::revoke("e", None, None));
        // The holder may still run: nobody else is granted while the window is open.
        assert_eq!(H::granted(&out, 3), None, "{out:?}");
        assert!(matches!(
            H::to(&out, 2)[..],
            [Event::RevokeSent { epoch: 1, .. }]
        ));
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
        assert!(h.res("e").revoked);
        assert_eq!(h.core.counters().revocations, 1);
        // A second revoke is not counted again.
        h.req(2, Request::revoke("e", None, None));
        assert_eq!(h.core.counters().revocations, 1);
        // The holder comes back: it gets its lease, and at once the revocation.
        h.connect(4, "unix");
        let out = h.req(
            4,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        let ev = H::to(&out, 4);
        assert!(
            matches!(
                &ev[..],
                [
                    Event::Granted {
                        epoch: 1,
                        reclaimed: true,
                        ..
                    },
                    Event::Revoked { epoch: 1, .. }
                ]
            ),
            "{ev:?}"
        );
        assert_eq!(H::granted(&out, 3), None);
        // It fences itself and goes: only now is the waiter granted, with a new epoch.
        let out = h.step(Input::Disconnect { session: 4 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases, c.expirations), (1, 0, 0));
    }

    #[test]
    fn a_revoked_lease_comes_back_revoked_after_restart_or_ends_with_the_window() {
        let revoked_state = || {
            let mut h = H::new();
            h.connect(1, "unix");
            let (_, token, _) = H::granted(&h.req(1, acq("e", "a", true)), 1).unwrap();
            h.req(1, Request::revoke("e", None, None));
            let st = h.persisted.clone().unwrap();
            assert!(st.resources["e"].holder.as_ref().unwrap().revoked);
            (st, token)
        };
        // Reclaimed: granted and revoked at once.
        let (st, token) = revoked_state();
        let mut h = H::with_state(st, None);
        h.connect(2, "unix");
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert!(matches!(
            &H::to(&out, 2)[..],
            [
                Event::Granted {
                    reclaimed: true,
                    ..
                },
                Event::Revoked { .. }
            ]
        ));
        assert!(h.res("e").revoked);
        // Not reclaimed: it ends with the window, and its expiry is not counted again.
        let (st, _) = revoked_state();
        let mut h = H::with_state(st, None);
        h.ms = W;
        h.step(Input::Tick);
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.expirations), (1, 0));
    }
}
