//! Gangs (feature `gang`): one acquire for a set of named resources, granted all at once or
//! not at all, so that a session never holds part of a gang (no hold-and-wait inside one
//! lockd). Members are ordinary exclusive, connection-bound leases (each with its own epoch,
//! persisted and reclaimed like any other) that share the gang's token and are granted and
//! released together. (Gangs of TTL or shared leases: `kgang.rs`.)
//!
//! **Order and fairness.** Every waiter of every resource gets a ticket from one counter
//! (`Table::next_ticket`); a waiting gang holds the same ticket in the queue of each of its
//! members. A resource whose first waiter is a gang is not granted to anyone else while it
//! waits: it stays free, *reserved* for the gang, until every member is free with the gang
//! first in line, and then all are granted in one step (one durable write). So the oldest
//! waiter of all is first in every queue it is in and is granted as soon as the leases held
//! when it arrived have ended: a gang waits at most for the holders it found, never for
//! acquires that came after it (a stream of single acquires cannot starve it), and waiting
//! gangs cannot deadlock each other. The price: a reserved resource stays idle while its gang
//! waits for its other members.
//!
//! `wait:false` answers `busy` at once unless every member is free with nobody waiting;
//! `timeout_ms` withdraws a waiting gang after that long (`cancelled`).

use std::time::{Duration, Instant};

use super::table::{LeaseState, Waiter};
use super::{Core, Now, SessionId};
use crate::proto::{ErrorCode, Event, GangMember, LeaseKind};

/// A gang, waiting or granted.
#[derive(Debug, Clone)]
pub(super) struct Gang {
    /// Its name (the acquire's `resource`).
    pub label: String,
    /// The holder name.
    pub holder: String,
    /// The session that asked.
    pub session: SessionId,
    /// Its resources, in request order.
    pub members: Vec<String>,
    /// The secret shared by its members.
    pub token: String,
    /// Granted (false: waiting).
    pub granted: bool,
    /// When a waiting gang gives up.
    pub deadline: Option<Instant>,
    /// Feature `reserve`: the grant is a reservation for this many ms.
    pub reserve_ms: Option<u64>,
}

impl Core {
    /// `acquire` with `gang`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gang_acquire(
        &mut self,
        now: Now,
        s: SessionId,
        label: String,
        holder: String,
        members: Vec<String>,
        wait: bool,
        timeout: Option<Duration>,
        reserve_ms: Option<u64>,
    ) {
        for m in &members {
            if let Some(k) = self.kind_in_use(m).filter(|k| *k != LeaseKind::Exclusive) {
                return self.error(
                    s,
                    ErrorCode::KindMismatch,
                    format!("{m:?} is in use as a {} lease, not exclusive", k.as_str()),
                    Some(m),
                );
            }
            let res = self.table.entry(m);
            let mine = matches!(&res.lease, LeaseState::Held(l) if l.session == s);
            if mine || res.waiters.contains_session(s) {
                return self.error(
                    s,
                    if mine {
                        ErrorCode::AlreadyHeld
                    } else {
                        ErrorCode::AlreadyQueued
                    },
                    format!("this connection already holds or waits for {m:?}"),
                    Some(m),
                );
            }
        }
        let free = members.iter().all(|m| {
            self.table
                .resources
                .get(m)
                .is_some_and(|r| matches!(r.lease, LeaseState::Free) && r.waiters.is_empty())
        });
        if !free && !wait {
            let busy = members.iter().find_map(|m| {
                let r = self.table.resources.get(m)?;
                (!matches!(r.lease, LeaseState::Free) || !r.waiters.is_empty())
                    .then(|| r.lease.holder_name().map(str::to_string))
            });
            return self.send(
                s,
                Event::Busy {
                    resource: label,
                    holder: busy.flatten(),
                },
            );
        }
        let id = self.table.new_lease_id();
        let token = self.new_token();
        let deadline = timeout.map(|t| now.mono + t);
        self.gangs.insert(
            id,
            Gang {
                label: label.clone(),
                holder: holder.clone(),
                session: s,
                members: members.clone(),
                token,
                granted: false,
                deadline,
                reserve_ms,
            },
        );
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.gangs.insert(id);
        }
        if free {
            return self.gang_grant(now, id, None);
        }
        let t = self.table.next_ticket();
        let mut position = 0;
        for m in &members {
            self.table.touch(m);
            let res = self.table.entry(m);
            position = position.max(res.waiters.push(
                t,
                Waiter {
                    session: s,
                    holder: holder.clone(),
                    gang: Some(id),
                    reserve_ms: None,
                },
            ));
        }
        if let Some(d) = deadline {
            self.gang_deadlines.insert((d, id));
        }
        self.send(
            s,
            Event::Queued {
                resource: label,
                position,
                lease_id: Some(id),
            },
        );
        // A member may be free already, reserved for this gang now that it is queued.
        for m in &members {
            self.grant_next(now, m, None);
        }
    }

    /// Grant waiting gang `id` if every member is free with it first in line.
    pub(super) fn try_gang(&mut self, now: Now, id: u64, handoff_from: Option<Instant>) {
        let Some(g) = self.gangs.get(&id) else {
            return;
        };
        #[cfg(test)]
        if self.planted.gang_partial {
            let g = g.clone();
            for m in &g.members {
                let free_first = self.table.resources.get(m).is_some_and(|r| {
                    matches!(r.lease, LeaseState::Free)
                        && r.waiters.front().is_some_and(|w| w.gang == Some(id))
                });
                if free_first {
                    if let Some(r) = self.table.get_noted(m) {
                        r.waiters.pop_front();
                    }
                    self.grant_lease(now, m, g.session, &g.holder, &g.token, Some(id));
                }
            }
            if let Some(x) = self.gangs.get_mut(&id) {
                x.granted = true;
            }
            return;
        }
        let ready = g.members.iter().all(|m| {
            self.table.resources.get(m).is_some_and(|r| {
                matches!(r.lease, LeaseState::Free)
                    && r.waiters.front().is_some_and(|w| w.gang == Some(id))
            })
        });
        if ready {
            for m in g.members.clone() {
                if let Some(r) = self.table.get_noted(&m) {
                    r.waiters.pop_front();
                }
            }
            self.gang_grant(now, id, handoff_from);
        }
    }

    /// Grant every member of gang `id` (all free, out of their queues) in one step.
    fn gang_grant(&mut self, now: Now, id: u64, handoff_from: Option<Instant>) {
        let Some(g) = self.gangs.get_mut(&id) else {
            return;
        };
        g.granted = true;
        let g = g.clone();
        if let Some(d) = g.deadline {
            self.gang_deadlines.remove(&(d, id));
        }
        let mut members = Vec::with_capacity(g.members.len());
        for m in &g.members {
            if let Some(epoch) = self.grant_lease(now, m, g.session, &g.holder, &g.token, Some(id))
            {
                members.push(GangMember {
                    resource: m.clone(),
                    epoch,
                    version: None,
                    lease_id: None,
                });
                self.reserve(now, m, g.reserve_ms);
                self.granted_notice(now, m, g.session, g.holder.clone(), epoch, handoff_from);
            }
        }
        self.kind_counters(LeaseKind::Exclusive).grants += 1;
        self.send(
            g.session,
            Event::GangGranted {
                resource: g.label,
                gang_id: id,
                holder: g.holder,
                token: g.token,
                members,
                kind: None,
                expires_at_unix_ms: None,
            },
        );
    }

    /// End gang `id`: a granted one releases every member still held (and grants what
    /// waits for them); a waiting one leaves every queue. Answers `s` if given.
    pub(super) fn gang_end(&mut self, now: Now, id: u64, answer: Option<SessionId>) {
        let Some(g) = self.gangs.remove(&id) else {
            return;
        };
        if let Some(sess) = self.sessions.get_mut(&g.session) {
            sess.gangs.remove(&id);
        }
        if let Some(d) = g.deadline {
            self.gang_deadlines.remove(&(d, id));
        }
        if g.granted {
            for m in &g.members {
                let ours = matches!(
                    self.table.resources.get(m).map(|r| &r.lease),
                    Some(LeaseState::Held(l)) if l.gang == Some(id)
                );
                if ours {
                    if let (Some(epoch), Some(s)) = (self.end_lease(now, m), answer) {
                        self.send(
                            s,
                            Event::Released {
                                resource: m.clone(),
                                epoch,
                                lease_id: None,
                            },
                        );
                    }
                }
            }
        } else {
            for m in &g.members {
                if let Some(r) = self.table.get_noted(m) {
                    r.waiters.remove_session(g.session);
                }
                self.table.touch(m);
            }
            if let Some(s) = answer {
                self.send(s, Event::Cancelled { resource: g.label });
            }
        }
        // What was held or reserved for the gang goes to the next in line.
        for m in &g.members {
            self.grant_next(now, m, Some(now.mono));
        }
    }

    /// The gang of lease `id` (a gang id), for `release`/`revoke` by id; checks the token.
    pub(super) fn gang_release(&mut self, now: Now, s: SessionId, id: u64, token: &str) {
        let ok = self
            .gangs
            .get(&id)
            .is_some_and(|g| super::ct_eq(&g.token, token));
        if !ok {
            return self.error(
                s,
                ErrorCode::BadToken,
                format!("gang {id}: wrong token"),
                None,
            );
        }
        self.gang_end(now, id, Some(s));
    }

    /// Waiting gangs whose timeout passed give up.
    pub(super) fn gang_tick(&mut self, now: Now) {
        while let Some(&(d, id)) = self.gang_deadlines.first() {
            if d > now.mono {
                break;
            }
            self.gang_deadlines.remove(&(d, id));
            if self.kgangs.contains_key(&id) {
                self.kgang_cancel(now, id);
                continue;
            }
            let s = self.gangs.get(&id).map(|g| g.session);
            self.gang_end(now, id, s);
        }
    }

    /// The earliest gang timeout.
    pub(super) fn next_gang_deadline(&self) -> Option<Instant> {
        self.gang_deadlines.first().map(|(d, _)| *d)
    }
}

#[cfg(test)]
mod tests {
    //! Gangs: all or nothing, reservation for the oldest waiter, no starvation.
    use crate::core::testkit::*;

    fn gang(label: &str, h: &str, members: &[&str], wait: bool) -> Request {
        Request::Acquire {
            resource: label.into(),
            holder: h.into(),
            wait,
            ext: proto::AcquireExt {
                gang: Some(members.iter().map(|m| m.to_string()).collect()),
                ..Default::default()
            },
        }
    }

    /// The members of the gang granted to `s` among outputs: (gang id, [(resource, epoch)]).
    fn gang_granted(out: &[Output], s: SessionId) -> Option<(u64, Vec<(String, u64)>)> {
        H::to(out, s).into_iter().find_map(|e| match e {
            Event::GangGranted {
                gang_id, members, ..
            } => Some((
                gang_id,
                members.into_iter().map(|m| (m.resource, m.epoch)).collect(),
            )),
            _ => None,
        })
    }

    fn holder(h: &H, r: &str) -> Option<SessionId> {
        h.core.holder_session(r)
    }

    #[test]
    fn a_free_gang_is_granted_at_once_each_member_with_its_own_epoch() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(2, acq("b", "x", true));
        h.req(2, Request::release("b"));
        let out = h.req(1, gang("tp", "eng", &["a", "b", "c"], true));
        let (_, m) = gang_granted(&out, 1).unwrap();
        assert_eq!(m, vec![("a".into(), 1), ("b".into(), 2), ("c".into(), 1)]);
        // One durable write for the whole gang, before the event.
        assert_eq!(
            h.persisted.as_ref().unwrap().resources["c"]
                .holder
                .as_ref()
                .unwrap()
                .gang,
            Some(gang_granted(&out, 1).unwrap().0)
        );
        // Releasing one member releases the gang whole.
        let out = h.req(1, Request::release("b"));
        let released: Vec<String> = H::to(&out, 1)
            .into_iter()
            .filter_map(|e| match e {
                Event::Released { resource, .. } => Some(resource),
                _ => None,
            })
            .collect();
        assert_eq!(released, vec!["a", "b", "c"]);
        assert!(["a", "b", "c"].iter().all(|r| holder(&h, r).is_none()));
    }

    #[test]
    fn nothing_is_held_in_part_and_freed_members_are_reserved_for_the_waiting_gang() {
        let mut h = H::new();
        for s in 1..=4 {
            h.connect(s, "unix");
        }
        h.req(2, acq("b", "single", true));
        let out = h.req(1, gang("tp", "eng", &["a", "b"], true));
        assert!(matches!(
            &H::to(&out, 1)[..],
            [Event::Queued {
                lease_id: Some(_),
                ..
            }]
        ));
        assert_eq!(holder(&h, "a"), None, "a is not held in part");
        // `a` is free but reserved: a later single acquire queues behind the gang.
        let out = h.req(3, acq("a", "late", true));
        assert!(matches!(&H::to(&out, 3)[..], [Event::Queued { .. }]));
        let out = h.req(4, acq("a", "late2", false));
        assert!(matches!(&H::to(&out, 4)[..], [Event::Busy { .. }]));
        // b's holder leaves: the gang gets both in one step.
        let out = h.step(Input::Disconnect { session: 2 });
        let (_, m) = gang_granted(&out, 1).unwrap();
        assert_eq!(m.len(), 2);
        assert!(H::granted(&out, 3).is_none());
        // The gang ends: the single behind it gets `a`.
        let out = h.step(Input::Disconnect { session: 1 });
        assert!(H::granted(&out, 3).is_some());
    }

    #[test]
    fn fail_semantics_answer_busy_at_once_and_leave_nothing_behind() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(2, acq("c", "x", true));
        let out = h.req(1, gang("tp", "eng", &["a", "b", "c"], false));
        assert!(matches!(&H::to(&out, 1)[..], [Event::Busy { holder: Some(x), .. }] if x == "x"));
        assert!(h.core.gangs.is_empty());
        assert!(h.res("a").waiters.is_empty() && holder(&h, "a").is_none());
    }

    #[test]
    fn overlapping_gangs_cannot_deadlock_the_oldest_goes_first() {
        let mut h = H::new();
        for s in 1..=4 {
            h.connect(s, "unix");
        }
        h.req(3, acq("a", "s", true));
        h.req(4, acq("c", "s", true));
        // G1 wants {a,b}, G2 wants {b,c}: b is free, reserved for the older G1.
        h.req(1, gang("g1", "one", &["a", "b"], true));
        h.req(2, gang("g2", "two", &["c", "b"], true));
        assert_eq!(holder(&h, "b"), None);
        // c frees first: G2 still waits (b is reserved for G1), c stays reserved for G2.
        let out = h.step(Input::Disconnect { session: 4 });
        assert!(gang_granted(&out, 2).is_none());
        let out = h.step(Input::Disconnect { session: 3 });
        assert!(gang_granted(&out, 1).is_some());
        let out = h.req(1, Request::release("a"));
        assert!(gang_granted(&out, 2).is_some(), "then the younger gang");
    }

    #[test]
    fn a_gang_behind_a_stream_of_single_acquires_waits_only_for_the_holders_it_found() {
        let mut h = H::new();
        let members = ["r0", "r1", "r2", "r3"];
        // Four single holders, each replaced by a new single as soon as it leaves: a stream.
        let mut next = 10;
        for (i, r) in members.iter().enumerate() {
            h.connect(100 + i as u64, "unix");
            h.req(100 + i as u64, acq(r, "s", true));
        }
        h.connect(1, "unix");
        h.req(1, gang("g", "gang", &members, true));
        let mut granted_after = None;
        for round in 0..8 {
            // New singles keep arriving for every member ...
            for r in members {
                h.connect(next, "unix");
                h.req(next, acq(r, "s", true));
                next += 1;
            }
            // ... and the holders leave one by one.
            let holders: Vec<SessionId> = members.iter().filter_map(|r| holder(&h, r)).collect();
            for s in holders {
                if s == 1 {
                    continue;
                }
                let out = h.step(Input::Disconnect { session: s });
                if gang_granted(&out, 1).is_some() {
                    granted_after = Some(round);
                }
            }
            if granted_after.is_some() {
                break;
            }
        }
        // The bound: the gang is granted once the four holders it found have left, in the
        // first round; none of the singles that came after it went first.
        assert_eq!(granted_after, Some(0));
        assert!(members.iter().all(|r| holder(&h, r) == Some(1)));
    }

    #[test]
    fn a_waiting_gang_that_leaves_or_times_out_hands_its_reservations_on() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(2, acq("b", "x", true));
        let mut req = gang("g", "eng", &["a", "b"], true);
        if let Request::Acquire { ext, .. } = &mut req {
            ext.timeout_ms = Some(100);
        }
        h.req(1, req);
        h.req(3, acq("a", "y", true));
        assert_eq!(holder(&h, "a"), None);
        h.ms = 100;
        let out = h.step(Input::Tick);
        assert!(H::to(&out, 1).contains(&Event::Cancelled {
            resource: "g".into()
        }));
        assert!(
            H::granted(&out, 3).is_some(),
            "the reserved member goes to the next waiter"
        );
        // Same when the waiting gang's connection closes.
        h.connect(4, "unix");
        h.req(4, gang("g2", "eng", &["b", "c"], true));
        h.connect(5, "unix");
        h.req(5, acq("c", "z", true));
        assert_eq!(holder(&h, "c"), None);
        let out = h.step(Input::Disconnect { session: 4 });
        assert!(H::granted(&out, 5).is_some());
    }

    #[test]
    fn a_member_of_a_waiting_gang_is_not_reclaimed_alone() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(3, acq("b", "x", true));
        // Session 2 waits for a gang {e, b}, then tries to reclaim e alone.
        h.req(2, gang("g", "a", &["e", "b"], true));
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("already_queued"));
        assert!(holder(&h, "e").is_none());
    }

    #[test]
    fn a_revoked_member_is_named_to_the_holder_and_the_others_stay_held() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(9, "unix");
        let (id, _) =
            gang_granted(&h.req(1, gang("tp", "eng", &["a", "b", "c"], true)), 1).unwrap();
        let out = h.req(
            9,
            Request::Revoke {
                resource: Some("b".into()),
                lease_id: None,
                reason: Some("gpu failed".into()),
                admin_token: None,
            },
        );
        let ev = H::to(&out, 1);
        assert_eq!(
            ev[0],
            Event::MemberLost {
                gang_id: id,
                resource: "b".into(),
                epoch: 1,
                reason: "gpu failed".into()
            }
        );
        assert!(matches!(&ev[1], Event::Revoked { resource, .. } if resource == "b"));
        // Nothing moves until the holder lets go (as for any revoke): the gang stays whole,
        // and the holder can reserve a replacement meanwhile.
        assert!(["a", "b", "c"].iter().all(|r| holder(&h, r) == Some(1)));
        assert!(H::granted(&h.req(1, acq("d", "eng", false)), 1).is_some());
    }

    #[test]
    fn release_by_gang_id_needs_its_token_and_kinds_do_not_mix() {
        let mut h = H::new();
        h.connect(1, "unix");
        let out = h.req(1, gang("g", "eng", &["a", "b"], true));
        let (id, _) = gang_granted(&out, 1).unwrap();
        let token = H::to(&out, 1)
            .into_iter()
            .find_map(|e| match e {
                Event::GangGranted { token, .. } => Some(token),
                _ => None,
            })
            .unwrap();
        let rel = |t: &str| Request::Release {
            resource: None,
            lease_id: Some(id),
            token: Some(t.into()),
        };
        assert_eq!(
            H::err_code(&h.req(1, rel("bad")), 1).as_deref(),
            Some("bad_token")
        );
        let out = h.req(1, rel(&token));
        assert_eq!(H::to(&out, 1).len(), 2);
        h.req(1, acq_ttl("t", "x", 1000, true));
        let out = h.req(1, gang("g", "eng", &["a", "t"], true));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("kind_mismatch"));
        assert!(holder(&h, "a").is_none());
    }
}
