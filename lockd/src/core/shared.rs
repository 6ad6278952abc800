//! Shared/exclusive leases with versions (feature `shared`): many readers or one writer,
//! writer priority, a version per resource that only an exclusive holder's `commit` bumps,
//! `min_version` waits. Admission and versions are [`crate::kinds::shared::SharedTable`]'s.
//! A lease is bound to its connection (like a version-1 lease: it ends when the holder's
//! processes are gone) or, with `ttl_ms`, to a TTL tracked by a second
//! [`crate::kinds::ttl::TtlTable`] that checks lifetimes only (seed 002's short leases
//! renewed in the background). Either way, a writer that ends without committing leaves
//! the version as it was.

use std::time::Duration;

use super::leases::{EndWhy, KindLease};
use super::{Core, Now, SessionId};
use crate::kinds::shared::{self, Admission, Grant};
use crate::kinds::ttl::{EndReason, TtlRequest};
use crate::proto::{AcquireExt, ErrorCode, Event, LeaseKind, Mode, Notice, NoticeKind};

impl Core {
    /// `acquire` with `mode`.
    pub(super) fn shared_acquire(
        &mut self,
        now: Now,
        s: SessionId,
        resource: String,
        holder: String,
        wait: bool,
        ext: AcquireExt,
    ) {
        let mode = ext.mode.unwrap_or(Mode::Exclusive);
        let ttl_ms = ext.ttl_ms.map(|t| self.capped_ttl(t).as_millis() as u64);
        let (id, _) = self.register(
            s,
            KindLease {
                mode: Some(mode),
                ttl_ms,
                bound: ttl_ms.is_none(),
                ..KindLease::request(LeaseKind::Shared, &resource, &holder)
            },
        );
        let floor = self.epoch(&resource);
        self.note_name(&resource);
        self.shared.raise_epoch(&resource, floor);
        let req = shared::Request {
            id,
            resource: resource.clone(),
            holder,
            mode: match mode {
                Mode::Shared => shared::Mode::Shared,
                Mode::Exclusive => shared::Mode::Exclusive,
            },
            min_version: ext.min_version.unwrap_or(0),
        };
        match self.shared.acquire(req) {
            Ok(Admission::Granted(g)) => self.shared_granted(now, g),
            Ok(Admission::Queued | Admission::Parked) if !wait => {
                let holder = self
                    .shared
                    .holders(&resource)
                    .first()
                    .and_then(|(h, _)| self.kl.get(h))
                    .map(|l| l.holder.clone());
                self.shared_end(now, id, EndWhy::Released, false);
                self.send(s, Event::Busy { resource, holder });
            }
            Ok(Admission::Queued | Admission::Parked) => {
                let (queued, parked) = self.shared.waiters(&resource);
                let position = queued.iter().chain(parked.iter()).position(|x| *x == id);
                self.send(
                    s,
                    Event::Queued {
                        resource,
                        position: position.map_or(1, |p| p + 1),
                        lease_id: Some(id),
                    },
                );
            }
            Err(e) => {
                self.forget(now, id, EndWhy::Released, false);
                self.error(s, ErrorCode::WrongLease, e.to_string(), Some(&resource));
            }
        }
    }

    /// A grant by the shared table: durable, announced (a gang member by its gang's
    /// `gang_granted`), its TTL started if timed.
    pub(super) fn shared_granted(&mut self, now: Now, g: Grant) {
        self.mark_granted(now, g.id, g.epoch);
        let Some(l) = self.kl.get(&g.id).cloned() else {
            return;
        };
        if let Some(ttl) = l.ttl_ms {
            let out = self.shared_ttl.acquire(
                TtlRequest {
                    id: g.id,
                    resource: g.resource.clone(),
                    holder: g.holder.clone(),
                    token: l.token.clone(),
                    epoch: g.epoch,
                    ttl: Duration::from_millis(ttl),
                },
                now,
            );
            for e in out.ended {
                self.shared_end(now, e.id, EndWhy::Expired, true);
            }
        }
        if let Some(ev) = self.granted_event(g.id, false).filter(|_| l.gang.is_none()) {
            self.send_to_lease(g.id, ev);
        }
    }

    /// End (or withdraw) shared-kind lease `id`; the grants it makes possible follow.
    pub(super) fn shared_end(&mut self, now: Now, id: u64, why: EndWhy, tell: bool) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if self.shared_ttl.get(id).is_some() {
            self.note_lease(id);
            let out = self.shared_ttl.release(id, now);
            for e in out.ended {
                if e.id != id {
                    self.shared_end(now, e.id, EndWhy::Expired, true);
                }
            }
        }
        let floor = self.epoch(&l.resource);
        self.note_name(&l.resource);
        self.shared.raise_epoch(&l.resource, floor);
        let outcome = self.shared.end(id);
        self.forget(now, id, why, tell);
        if let Ok(o) = outcome {
            for g in o.grants {
                self.shared_granted(now, g);
            }
        }
    }

    /// `revoke` of a shared-kind lease: a timed one ends at once; a connection-bound one
    /// is marked revoked and its holder told (it fences itself and lets go; the lease ends
    /// when its session does, as a version-1 lease).
    pub(super) fn shared_revoke(&mut self, now: Now, id: u64, by: String, reason: String) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if !l.bound {
            return self.shared_end(now, id, EndWhy::Revoked(by, reason), true);
        }
        if l.revoked.is_some() {
            return;
        }
        let text = EndWhy::Revoked(by, reason.clone()).text();
        self.note_lease(id);
        if let Some(x) = self.kl.get_mut(&id) {
            x.revoked = Some(text.clone());
        }
        self.counters.revocations += 1;
        self.kind_counters(LeaseKind::Shared).revocations += 1;
        self.dirty = true;
        if let Some(gang_id) = l.gang {
            // A member of a bound shared gang: named to the holder, which fences it (the
            // gang ends whole when its session does).
            self.send_to_lease(
                id,
                Event::MemberLost {
                    gang_id,
                    resource: l.resource.clone(),
                    epoch: l.epoch,
                    reason: text.clone(),
                },
            );
        }
        self.send_to_lease(
            id,
            Event::Revoked {
                resource: l.resource.clone(),
                epoch: l.epoch,
                reason,
            },
        );
        self.notice(
            Notice {
                kind: NoticeKind::Revoked,
                resource: l.resource,
                holder: Some(l.holder),
                epoch: l.epoch,
                session: l.session,
                reclaimed: false,
                after_revoke: false,
                reason: Some(text),
                at_unix_ms: now.unix_ms,
                lease_id: Some(id),
                lease_kind: Some(LeaseKind::Shared),
                version: None,
            },
            None,
        );
    }

    /// `renew` of a timed shared-kind lease.
    pub(super) fn shared_renew(&mut self, now: Now, s: SessionId, id: u64, ttl_ms: Option<u64>) {
        let resource = self
            .kl
            .get(&id)
            .map(|l| l.resource.clone())
            .unwrap_or_default();
        if self.kl.get(&id).is_some_and(|l| l.bound) {
            return self.error(
                s,
                ErrorCode::WrongLease,
                format!("lease {id} is bound to its connection and has no deadline to renew"),
                Some(&resource),
            );
        }
        if ttl_ms.is_some() {
            return self.error(
                s,
                ErrorCode::WrongLease,
                "a shared lease renews with the TTL it was granted (leave out ttl_ms)".into(),
                Some(&resource),
            );
        }
        self.note_lease(id);
        let out = self.shared_ttl.renew(id, now);
        for e in out.ended {
            self.shared_end(now, e.id, EndWhy::Expired, true);
        }
        match out.result {
            Ok(info) => {
                self.count_renewal(LeaseKind::Shared, true);
                self.send(
                    s,
                    Event::Renewed {
                        lease_id: id,
                        resource,
                        expires_at_unix_ms: info.expires_at_unix_ms,
                    },
                );
            }
            Err(e) => {
                self.count_renewal(LeaseKind::Shared, false);
                self.error(s, ErrorCode::LeaseEnded, e.to_string(), Some(&resource));
            }
        }
    }

    /// `commit`: the exclusive holder publishes a new version (durable before answered).
    pub(super) fn commit(&mut self, now: Now, s: SessionId, id: u64, token: String) {
        if !self.check_lease(s, id, &token) {
            return;
        }
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if l.kind != LeaseKind::Shared || !l.granted {
            return self.error(
                s,
                ErrorCode::WrongLease,
                format!(
                    "lease {id} is a {} lease{}: only an exclusive holder of a shared-kind \
                     resource commits",
                    l.kind.as_str(),
                    if l.granted { "" } else { " still waiting" }
                ),
                Some(&l.resource),
            );
        }
        self.note_lease(id);
        self.table.note(&l.resource);
        match self.shared.commit(id) {
            Ok(version) => {
                // Requests parked for this version are queued now: the wait-for graph
                // looks at the queue again.
                let (queued, _) = self.shared.waiters(&l.resource);
                self.graph.shared_touched.extend(queued);
                self.kind_counters(LeaseKind::Shared).commits += 1;
                self.dirty = true;
                self.send(
                    s,
                    Event::Committed {
                        lease_id: id,
                        resource: l.resource.clone(),
                        version,
                    },
                );
                self.notice(
                    Notice {
                        kind: NoticeKind::Committed,
                        resource: l.resource,
                        holder: Some(l.holder),
                        epoch: l.epoch,
                        session: l.session,
                        reclaimed: false,
                        after_revoke: false,
                        reason: None,
                        at_unix_ms: now.unix_ms,
                        lease_id: Some(id),
                        lease_kind: Some(LeaseKind::Shared),
                        version: Some(version),
                    },
                    None,
                );
                // Readers parked on min_version re-entered the queue: they are admitted
                // when this writer's lease ends (the table's pump), not before.
            }
            Err(e) => self.error(s, ErrorCode::WrongLease, e.to_string(), Some(&l.resource)),
        }
    }

    /// Timed shared-kind leases whose TTL ran out.
    pub(super) fn shared_tick(&mut self, now: Now) {
        if self
            .shared_ttl
            .next_deadline()
            .is_some_and(|d| d <= now.mono)
        {
            for e in self.shared_ttl.tick(now) {
                let why = match e.reason {
                    EndReason::Expired => EndWhy::Expired,
                    EndReason::Released => EndWhy::Released,
                    EndReason::Revoked { by, why } => EndWhy::Revoked(by, why),
                };
                self.shared_end(now, e.id, why, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Shared/exclusive leases with versions, through the core (seed 002).
    use crate::core::testkit::*;
    use crate::proto::{LeaseKind, Mode};

    fn commit(g: &G) -> Request {
        Request::Commit {
            lease_id: g.id,
            token: g.token.clone(),
        }
    }

    #[test]
    fn many_readers_one_writer_with_writer_priority() {
        let mut h = H::new();
        for s in 1..=5 {
            h.connect(s, "unix");
        }
        let r1 = H::g(&h.req(1, acq_shared("w", "r1", true, None)), 1).unwrap();
        let r2 = H::g(&h.req(2, acq_shared("w", "r2", true, None)), 2).unwrap();
        assert_eq!(
            (r1.lease.mode, r1.lease.version),
            (Some(Mode::Shared), Some(0))
        );
        assert!(r2.epoch > r1.epoch);
        // A writer waits for the readers...
        let out = h.req(3, acq_shared("w", "wr", false, None));
        assert!(matches!(
            &H::to(&out, 3)[..],
            [Event::Queued {
                lease_id: Some(_),
                ..
            }]
        ));
        // ... and a reader arriving after it waits behind it (writer priority).
        let out = h.req(4, acq_shared("w", "r3", true, None));
        assert!(H::g(&out, 4).is_none());
        h.step(Input::Disconnect { session: 1 });
        let out = h.step(Input::Disconnect { session: 2 });
        let w = H::g(&out, 3).unwrap();
        assert!(H::g(&out, 4).is_none(), "no reader beside the writer");
        assert_eq!(w.lease.mode, Some(Mode::Exclusive));
        // The writer commits: version 1; it ends; the reader sees version 1.
        let out = h.req(3, commit(&w));
        assert!(matches!(
            &H::to(&out, 3)[..],
            [Event::Committed { version: 1, .. }]
        ));
        let out = h.req(3, Request::release("w"));
        let r3 = H::g(&out, 4).unwrap();
        assert_eq!(r3.lease.version, Some(1));
        assert_eq!(h.st().counters_by_kind[&LeaseKind::Shared].commits, 1);
    }

    #[test]
    fn a_writer_that_dies_before_committing_leaves_the_version() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        let w = H::g(&h.req(1, acq_shared("m", "w1", false, None)), 1).unwrap();
        h.req(1, commit(&w));
        h.step(Input::Disconnect { session: 1 });
        let w2 = H::g(&h.req(2, acq_shared("m", "w2", false, None)), 2).unwrap();
        assert_eq!(w2.lease.version, Some(1));
        h.step(Input::Disconnect { session: 2 }); // killed before its commit
        let r = H::g(&h.req(3, acq_shared("m", "r", true, None)), 3).unwrap();
        assert_eq!(r.lease.version, Some(1));
        assert!(r.epoch > w2.epoch);
    }

    #[test]
    fn min_version_waits_for_the_commit_that_reaches_it() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        let out = h.req(1, acq_shared("m", "r", true, Some(2)));
        assert!(H::g(&out, 1).is_none());
        let w = H::g(&h.req(2, acq_shared("m", "w", false, None)), 2).unwrap();
        h.req(2, commit(&w));
        assert!(
            H::g(&h.req(2, commit(&w)), 1).is_none(),
            "not beside the writer"
        );
        let r = H::g(&h.req(2, Request::release("m")), 1).unwrap();
        assert_eq!(r.lease.version, Some(2));
        // Only the exclusive holder commits.
        let out = h.req(1, commit(&r));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("wrong_lease"));
    }

    #[test]
    fn revoking_a_connection_bound_lease_tells_the_holder_and_ends_with_its_session() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        let w = H::g(&h.req(1, acq_shared("m", "w", false, None)), 1).unwrap();
        h.req(2, acq_shared("m", "r", true, None));
        let out = h.req(
            3,
            Request::Revoke {
                resource: None,
                lease_id: Some(w.id),
                reason: Some("ops".into()),
                admin_token: None,
            },
        );
        assert!(matches!(&H::to(&out, 1)[..], [Event::Revoked { .. }]));
        assert!(H::g(&out, 2).is_none(), "held until the holder is gone");
        let out = h.step(Input::Disconnect { session: 1 });
        assert!(H::g(&out, 2).is_some());
        assert!(h.lease(3, w.id).state.starts_with("revoked"));
        let c = h.st().counters_by_kind[&LeaseKind::Shared];
        assert_eq!((c.revocations, c.releases), (1, 0));
    }

    #[test]
    fn a_timed_shared_lease_expires_unless_renewed() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        let mut req = acq_shared("m", "w", false, None);
        if let Request::Acquire { ext, .. } = &mut req {
            ext.ttl_ms = Some(100);
        }
        let w = H::g(&h.req(1, req), 1).unwrap();
        assert_eq!(w.lease.expires_at_unix_ms, Some(100));
        h.req(2, acq_shared("m", "r", true, None));
        h.ms = 50;
        let out = h.req(
            1,
            Request::Renew {
                lease_id: w.id,
                token: w.token.clone(),
                ttl_ms: None,
            },
        );
        assert!(matches!(
            &H::to(&out, 1)[..],
            [Event::Renewed {
                expires_at_unix_ms: 150,
                ..
            }]
        ));
        h.ms = 150;
        let out = h.step(Input::Tick);
        assert!(
            matches!(&H::to(&out, 1)[..], [Event::LeaseEnded { reason, .. }] if reason == "expired")
        );
        assert!(H::g(&out, 2).is_some());
    }

    #[test]
    fn after_a_restart_a_bound_lease_waits_to_be_resumed_and_versions_and_epochs_go_on() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        let w = H::g(&h.req(1, acq_shared("m", "w", false, None)), 1).unwrap();
        h.req(1, commit(&w));
        let st = h.persisted.clone().unwrap();
        let mut h = H::restart_at(st.clone(), 10);
        h.connect(3, "unix");
        h.connect(4, "unix");
        assert_eq!(h.lease(3, w.id).state, "reclaiming");
        assert!(H::g(&h.req(4, acq_shared("m", "r", true, None)), 4).is_none());
        let back = H::g(
            &h.req(
                3,
                Request::Resume {
                    lease_id: w.id,
                    token: w.token.clone(),
                },
            ),
            3,
        )
        .unwrap();
        assert!(back.reclaimed);
        assert_eq!((back.epoch, back.lease.version), (w.epoch, Some(1)));
        let r = H::g(&h.step(Input::Disconnect { session: 3 }), 4).unwrap();
        assert_eq!(r.lease.version, Some(1));
        assert!(r.epoch > w.epoch);
        // Not resumed within the window: it ends as expired.
        let mut h = H::restart_at(st, 10);
        h.connect(4, "unix");
        h.req(4, acq_shared("m", "r", true, None));
        h.ms = 10 + W;
        let r = H::g(&h.step(Input::Tick), 4).unwrap();
        assert_eq!(r.lease.version, Some(1));
        assert_eq!(h.lease(4, w.id).state, "expired");
    }
}
