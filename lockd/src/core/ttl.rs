//! TTL leases (feature `ttl`): exclusive per resource, outliving their connection, ending
//! when not renewed in time. Admission, expiry, tombstones and counters are
//! [`crate::kinds::ttl::TtlTable`]'s; this module queues waiters (FIFO per resource, in
//! lease-id order), allocates ids, tokens and epochs, and turns the table's results into
//! durable writes and events.

use std::time::Duration;

use super::leases::EndWhy;
use super::{Core, Now, SessionId};
use crate::kinds::ttl::{EndReason, Ended, TtlError, TtlRequest};
use crate::proto::{AcquireExt, ErrorCode, Event, LeaseKind};

impl Core {
    /// The TTL granted for a request: what it asked for, capped by `--max-lease-time`.
    pub(super) fn capped_ttl(&self, ttl_ms: u64) -> Duration {
        Duration::from_millis(ttl_ms).min(self.cfg.max_lease_time)
    }

    /// `acquire` with `ttl_ms` (and no `mode`/`quantity`).
    pub(super) fn ttl_acquire(
        &mut self,
        now: Now,
        s: SessionId,
        resource: String,
        holder: String,
        wait: bool,
        ext: AcquireExt,
    ) {
        let ttl = self.capped_ttl(ext.ttl_ms.unwrap_or(1));
        let ttl_ms = ttl.as_millis() as u64;
        let free = self.ttl.holder_of(&resource).is_none()
            && self.ttl_waiters.get(&resource).is_none_or(|q| q.is_empty());
        if free {
            let (id, _) = self.register(s, LeaseKind::Ttl, &resource, &holder, None, Some(ttl_ms), false);
            self.ttl_grant(now, id);
        } else if !wait {
            let holder = self
                .ttl
                .holder_of(&resource)
                .and_then(|id| self.kl.get(&id))
                .map(|l| l.holder.clone());
            self.send(s, Event::Busy { resource, holder });
        } else {
            let (id, _) = self.register(s, LeaseKind::Ttl, &resource, &holder, None, Some(ttl_ms), false);
            let q = self.ttl_waiters.entry(resource.clone()).or_default();
            q.insert(id);
            let position = q.len();
            self.send(
                s,
                Event::Queued {
                    resource,
                    position,
                    lease_id: Some(id),
                },
            );
        }
    }

    /// Grant registered request `id` (its resource has no live TTL lease).
    fn ttl_grant(&mut self, now: Now, id: u64) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        let epoch = self.next_epoch(&l.resource);
        let out = self.ttl.acquire(
            TtlRequest {
                id,
                resource: l.resource.clone(),
                holder: l.holder.clone(),
                token: l.token.clone(),
                epoch,
                ttl: Duration::from_millis(l.ttl_ms.unwrap_or(1)),
            },
            now,
        );
        for e in out.ended {
            self.ttl_ended(now, e);
        }
        match out.result {
            Ok(_) => {
                self.mark_granted(now, id, epoch);
                if let Some(ev) = self.granted_event(id, false) {
                    self.send_to_lease(id, ev);
                }
            }
            Err(e) => {
                // Cannot happen (the resource was checked free, ids are fresh): refuse
                // loudly rather than lose the request silently.
                if let Some(s) = l.session {
                    self.error(s, ErrorCode::WrongLease, e.to_string(), Some(&l.resource));
                }
                self.forget(now, id, EndWhy::Released, false);
            }
        }
    }

    /// Grant the first waiter of `resource` if no TTL lease holds it.
    fn ttl_grant_next(&mut self, now: Now, resource: &str) {
        if self.ttl.holder_of(resource).is_some() {
            return;
        }
        let next = self.ttl_waiters.get_mut(resource).and_then(|q| q.pop_first());
        if self.ttl_waiters.get(resource).is_some_and(|q| q.is_empty()) {
            self.ttl_waiters.remove(resource);
        }
        if let Some(id) = next {
            self.ttl_grant(now, id);
        }
    }

    /// The table ended a lease by itself (its TTL ran out).
    fn ttl_ended(&mut self, now: Now, e: Ended) {
        let why = match e.reason {
            EndReason::Released => EndWhy::Released,
            EndReason::Expired => EndWhy::Expired,
            EndReason::Revoked { by, why } => EndWhy::Revoked(by, why),
        };
        self.forget(now, e.id, why, true);
        self.ttl_grant_next(now, &e.resource);
    }

    /// End (release, revoke) or withdraw TTL lease `id`.
    pub(super) fn ttl_end(&mut self, now: Now, id: u64, why: EndWhy) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        if !l.granted {
            if let Some(q) = self.ttl_waiters.get_mut(&l.resource) {
                q.remove(&id);
                if q.is_empty() {
                    self.ttl_waiters.remove(&l.resource);
                }
            }
            self.forget(now, id, EndWhy::Released, false);
            return;
        }
        let out = match &why {
            EndWhy::Revoked(by, reason) => self.ttl.revoke(id, by, reason, now),
            _ => self.ttl.release(id, now),
        };
        let tell = !matches!(why, EndWhy::Released);
        let mut ended_here = false;
        for e in out.ended {
            ended_here |= e.id == id;
            self.ttl_ended(now, e);
        }
        if !ended_here {
            self.forget(now, id, why, tell);
        }
        self.ttl_grant_next(now, &l.resource);
    }

    /// `renew` of a TTL lease: the full TTL again from now; refused once it has ended.
    pub(super) fn ttl_renew(&mut self, now: Now, s: SessionId, id: u64, ttl_ms: Option<u64>) {
        let resource = self.kl.get(&id).map(|l| l.resource.clone()).unwrap_or_default();
        if ttl_ms.is_some() {
            return self.error(
                s,
                ErrorCode::WrongLease,
                "a TTL lease renews with the TTL it was granted (leave out ttl_ms)".into(),
                Some(&resource),
            );
        }
        let out = self.ttl.renew(id, now);
        for e in out.ended {
            self.ttl_ended(now, e);
        }
        match out.result {
            Ok(info) => {
                self.count_renewal(LeaseKind::Ttl, true);
                self.send(
                    s,
                    Event::Renewed {
                        lease_id: id,
                        resource,
                        expires_at_unix_ms: info.expires_at_unix_ms,
                    },
                );
            }
            Err(TtlError::Ended { state, .. }) => {
                self.count_renewal(LeaseKind::Ttl, false);
                self.error(
                    s,
                    ErrorCode::LeaseEnded,
                    format!("lease {id} has ended ({state}): acquire a new one"),
                    Some(&resource),
                );
            }
            Err(e) => {
                self.count_renewal(LeaseKind::Ttl, false);
                self.error(s, ErrorCode::LeaseEnded, e.to_string(), Some(&resource));
            }
        }
    }

    /// TTLs that ran out.
    pub(super) fn ttl_tick(&mut self, now: Now) {
        if self.ttl.next_deadline().is_some_and(|d| d <= now.mono) {
            for e in self.ttl.tick(now) {
                self.ttl_ended(now, e);
            }
        }
    }
}
