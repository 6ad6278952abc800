//! Reservations (feature `reserve`, QURD's `reserved` state): an exclusive lease or a gang
//! granted with `reserve_ms` is *reserved* until its holder confirms it with `start`; lockd
//! cancels it when the confirmation does not come in time, so a client that vanished or hangs
//! between reserving and running its job never pins a resource (the seed's `cancel`). A
//! client must not use a reserved resource before `started`: a `start` after the
//! cancellation is refused, so a client that wakes up late learns it lost the resource.
//!
//! Reservations live in memory only: after a lockd restart a reserved lease that is reclaimed
//! is an ordinary lease (its holder reconnected, so it is not gone).

use std::time::{Duration, Instant};

use super::table::LeaseState;
use super::{Core, Now, SessionId};
use crate::proto::{ErrorCode, Event};

impl Core {
    /// Make the lease just granted on `resource` a reservation for `ms`.
    pub(super) fn reserve(&mut self, now: Now, resource: &str, ms: Option<u64>) {
        let Some(ms) = ms else {
            return;
        };
        let epoch = match self.table.resources.get(resource).map(|r| &r.lease) {
            Some(LeaseState::Held(l)) => l.epoch,
            _ => return,
        };
        let d = now.mono + Duration::from_millis(ms);
        if let Some((old, _)) = self.reservations.insert(resource.to_string(), (d, epoch)) {
            self.reservation_deadlines
                .remove(&(old, resource.to_string()));
        }
        self.reservation_deadlines.insert((d, resource.to_string()));
    }

    /// The lease of `resource` ended: forget its reservation.
    pub(super) fn unreserve(&mut self, resource: &str) {
        if let Some((d, _)) = self.reservations.remove(resource) {
            self.reservation_deadlines
                .remove(&(d, resource.to_string()));
        }
    }

    /// `start`: confirm the reservation of `resource` (a gang: every member).
    pub(super) fn start(&mut self, s: SessionId, resource: String) {
        let (epoch, gang) = match self.table.resources.get(&resource).map(|r| &r.lease) {
            Some(LeaseState::Held(l)) if l.session == s => (l.epoch, l.gang),
            _ => {
                return self.error(
                    s,
                    ErrorCode::NotHolder,
                    "this connection does not hold it (cancelled, or never reserved): do not \
                     start"
                        .into(),
                    Some(&resource),
                )
            }
        };
        let members = match gang.and_then(|g| self.gangs.get(&g)) {
            Some(g) => g.members.clone(),
            None => vec![resource.clone()],
        };
        for m in members {
            self.unreserve(&m);
            let e = match self.table.resources.get(&m).map(|r| &r.lease) {
                Some(LeaseState::Held(l)) => l.epoch,
                _ => epoch,
            };
            self.send(
                s,
                Event::Started {
                    resource: m,
                    epoch: e,
                },
            );
        }
    }

    /// Reservations not confirmed in time are cancelled (the lease ends, as expired).
    pub(super) fn reservation_tick(&mut self, now: Now) {
        while let Some((d, r)) = self.reservation_deadlines.first().cloned() {
            if d > now.mono {
                break;
            }
            self.reservation_deadlines.remove(&(d, r.clone()));
            let Some((_, epoch)) = self.reservations.remove(&r) else {
                continue;
            };
            let lease = match self.table.resources.get(&r).map(|x| &x.lease) {
                Some(LeaseState::Held(l)) if l.epoch == epoch => l.clone(),
                _ => continue,
            };
            let tell = |c: &mut Core, res: &str, epoch: u64, id: u64| {
                c.send(
                    lease.session,
                    Event::LeaseEnded {
                        lease_id: id,
                        resource: res.to_string(),
                        epoch,
                        reason: "reservation_timeout".into(),
                    },
                );
            };
            if let Some(g) = lease.gang.filter(|g| self.gangs.contains_key(g)) {
                let members = self.gangs[&g].members.clone();
                for m in &members {
                    if let Some(LeaseState::Held(l)) =
                        self.table.resources.get(m).map(|x| x.lease.clone())
                    {
                        tell(self, m, l.epoch, l.lease_id);
                    }
                }
                self.gang_end(now, g, None);
            } else {
                tell(self, &r, lease.epoch, lease.lease_id);
                self.end_lease(now, &r);
                self.grant_next(now, &r, Some(now.mono));
            }
            self.counters.expirations += 1;
        }
    }

    /// The earliest reservation deadline.
    pub(super) fn next_reservation_deadline(&self) -> Option<Instant> {
        self.reservation_deadlines.first().map(|(d, _)| *d)
    }
}

#[cfg(test)]
mod tests {
    //! Reservations: confirmed in time, or cancelled and handed on.
    use crate::core::testkit::*;

    fn reserve(r: &str, h: &str, ms: u64) -> Request {
        Request::Acquire {
            resource: r.into(),
            holder: h.into(),
            wait: true,
            ext: proto::AcquireExt {
                reserve_ms: Some(ms),
                ..Default::default()
            },
        }
    }

    fn start(r: &str) -> Request {
        Request::Start { resource: r.into() }
    }

    #[test]
    fn a_reservation_not_started_in_time_is_cancelled_and_handed_on() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        assert_eq!(
            H::granted(&h.req(1, reserve("node", "job1", 500)), 1)
                .unwrap()
                .0,
            1
        );
        h.req(2, reserve("node", "job2", 500));
        h.ms = 499;
        assert!(H::granted(&h.step(Input::Tick), 2).is_none());
        h.ms = 500;
        let out = h.step(Input::Tick);
        assert!(
            matches!(&H::to(&out, 1)[..], [Event::LeaseEnded { reason, .. }] if reason == "reservation_timeout")
        );
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        // The late client's start is refused: it must not run its job.
        assert_eq!(
            H::err_code(&h.req(1, start("node")), 1).as_deref(),
            Some("not_holder")
        );
        // The new holder starts in time: nothing is cancelled any more.
        assert_eq!(
            H::to(&h.req(2, start("node")), 2),
            vec![Event::Started {
                resource: "node".into(),
                epoch: 2
            }]
        );
        h.ms = 5000;
        assert!(h.step(Input::Tick).is_empty());
        assert_eq!(h.core.holder_session("node"), Some(2));
        assert_eq!(h.core.counters().expirations, 1);
    }

    #[test]
    fn a_reserved_gang_starts_whole_or_is_cancelled_whole() {
        let mut h = H::new();
        h.connect(1, "unix");
        let g = Request::Acquire {
            resource: "g".into(),
            holder: "job".into(),
            wait: true,
            ext: proto::AcquireExt {
                gang: Some(vec!["a".into(), "b".into()]),
                reserve_ms: Some(100),
                ..Default::default()
            },
        };
        h.req(1, g.clone());
        let out = h.req(1, start("b"));
        assert_eq!(H::to(&out, 1).len(), 2, "both members started: {out:?}");
        h.ms = 1000;
        assert!(h.step(Input::Tick).is_empty());
        h.req(1, Request::release("a"));
        h.req(1, g);
        h.ms = 1100;
        let out = h.step(Input::Tick);
        assert_eq!(H::to(&out, 1).len(), 2, "both members cancelled: {out:?}");
        assert!(h.core.holder_session("a").is_none() && h.core.holder_session("b").is_none());
    }
}
