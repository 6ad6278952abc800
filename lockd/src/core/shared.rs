//! Shared/exclusive leases with versions (feature `shared`): many readers or one writer,
//! writer priority, a version per resource that only an exclusive holder's `commit` bumps,
//! `min_version` waits. Admission and versions are [`crate::kinds::shared::SharedTable`]'s.
//! A lease is bound to its connection (like a version-1 lease: it ends when the holder's
//! processes are gone) or, with `ttl_ms`, to a TTL tracked by a second
//! [`crate::kinds::ttl::TtlTable`] that checks lifetimes only (seed 002's short leases
//! renewed in the background). Either way, a writer that ends without committing leaves
//! the version as it was.

use std::time::Duration;

use super::leases::EndWhy;
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
            LeaseKind::Shared,
            &resource,
            &holder,
            Some(mode),
            ttl_ms,
            ttl_ms.is_none(),
        );
        let floor = self.epoch(&resource);
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

    /// A grant by the shared table: durable, announced, its TTL started if timed.
    fn shared_granted(&mut self, now: Now, g: Grant) {
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
        if let Some(ev) = self.granted_event(g.id, false) {
            self.send_to_lease(g.id, ev);
        }
    }

    /// End (or withdraw) shared-kind lease `id`; the grants it makes possible follow.
    pub(super) fn shared_end(&mut self, now: Now, id: u64, why: EndWhy, tell: bool) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if self.shared_ttl.get(id).is_some() {
            let out = self.shared_ttl.release(id, now);
            for e in out.ended {
                if e.id != id {
                    self.shared_end(now, e.id, EndWhy::Expired, true);
                }
            }
        }
        let floor = self.epoch(&l.resource);
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
        if let Some(x) = self.kl.get_mut(&id) {
            x.revoked = Some(text.clone());
        }
        self.counters.revocations += 1;
        self.kind_counters(LeaseKind::Shared).revocations += 1;
        self.dirty = true;
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
        let resource = self.kl.get(&id).map(|l| l.resource.clone()).unwrap_or_default();
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
        match self.shared.commit(id) {
            Ok(version) => {
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
        if self.shared_ttl.next_deadline().is_some_and(|d| d <= now.mono) {
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
