//! Quantity leases over offers (feature `quantity`): a pool resource has offers (`offer`,
//! `withdraw`, or the offers file); a request for a quantity is granted all-or-nothing from
//! one or several matching offers for a lease time = min(offer, request, `--max-lease-time`),
//! renewals refused past `--max-total-lease-time` or when an offer shrank. Matching,
//! allocation, waiting order and renewal rules are
//! [`crate::kinds::quantity::QuantityManager`]'s (one per pool); this module allocates ids,
//! tokens and epochs and turns its results into durable writes and events.

use std::collections::BTreeMap;
use std::time::Duration;

use super::leases::{EndWhy, KindLease};
use super::{Core, Now, SessionId};
use crate::kinds::quantity::{
    self, OfferSpec, OfferUsage, OnUnavailable, QuantityError, QuantityManager, RequestSpec,
    Requested,
};
use crate::kinds::selector::Selector;
use crate::proto::{AcquireExt, ErrorCode, Event, LeaseKind, OfferReport, PoolReport};

/// The quantity manager's view of a step's time.
pub(super) fn qnow(now: Now) -> quantity::Now {
    quantity::Now {
        mono: now.mono,
        unix_ms: now.unix_ms,
    }
}

/// The wire form of an offer's use.
pub(super) fn offer_report(u: &OfferUsage) -> OfferReport {
    OfferReport {
        name: u.spec.name.clone(),
        quantity: u.spec.quantity,
        capacity: u.capacity,
        allocated: u.allocated,
        removed: u.removed,
        attributes: u.spec.attributes.clone(),
        max_lease_time_ms: u.spec.max_lease_time_ms,
        requirements: u.spec.requirements.to_string(),
    }
}

impl Core {
    /// The manager settings of every pool.
    pub(super) fn quantity_config(&self) -> quantity::Config {
        quantity::Config {
            max_lease_time: self.cfg.max_lease_time,
            max_total_lease_time: self.cfg.max_total_lease_time,
        }
    }

    /// `acquire` with `quantity`: from the pool named by `resource`.
    pub(super) fn quantity_acquire(
        &mut self,
        now: Now,
        s: SessionId,
        pool: String,
        holder: String,
        wait: bool,
        ext: AcquireExt,
    ) {
        if !self.pools.contains_key(&pool) {
            return self.error(
                s,
                ErrorCode::Unsatisfiable,
                format!("pool {pool:?} has no offers (add some with `lockd offer`)"),
                Some(&pool),
            );
        }
        // Checked by the decoder; parse again for the typed form.
        let requirements = match ext.requirements.as_deref().map(Selector::parse) {
            None => Selector::everything(),
            Some(Ok(sel)) => sel,
            Some(Err(e)) => {
                return self.error(
                    s,
                    ErrorCode::InvalidArgument,
                    format!("requirements: {e}"),
                    Some(&pool),
                )
            }
        };
        let (id, token) = self.register(
            s,
            KindLease {
                ttl_ms: ext.ttl_ms,
                ..KindLease::request(LeaseKind::Quantity, &pool, &holder)
            },
        );
        let spec = RequestSpec {
            holder,
            quantity: ext.quantity.unwrap_or(1),
            requirements,
            attributes: ext.attributes.unwrap_or_default(),
            lease_time: ext.ttl_ms.map(Duration::from_millis),
            on_unavailable: if wait {
                OnUnavailable::Wait
            } else {
                OnUnavailable::Fail
            },
        };
        self.note_name(&pool);
        let res = match self.pools.get_mut(&pool) {
            Some(p) => p.request(qnow(now), id, token, spec),
            None => return,
        };
        match res {
            Ok(Requested::Granted(_)) => self.quantity_granted(now, &pool, id),
            Ok(Requested::Queued { ahead }) => self.send(
                s,
                Event::Queued {
                    resource: pool,
                    position: ahead + 1,
                    lease_id: Some(id),
                },
            ),
            Err(e) => {
                self.forget(now, id, EndWhy::Released, false);
                let code = match e {
                    QuantityError::Unavailable { .. } => ErrorCode::Unavailable,
                    QuantityError::Unsatisfiable { .. } => ErrorCode::Unsatisfiable,
                    _ => ErrorCode::InvalidArgument,
                };
                self.error(s, code, e.to_string(), Some(&pool));
            }
        }
    }

    /// A grant by pool `pool`: a new epoch, durable, announced.
    fn quantity_granted(&mut self, now: Now, pool: &str, id: u64) {
        let epoch = self.next_epoch(pool);
        self.mark_granted(now, id, epoch);
        if let Some(ev) = self.granted_event(id, false) {
            self.send_to_lease(id, ev);
        }
    }

    /// What pool `pool` reported besides a call's direct answer.
    fn quantity_events(&mut self, now: Now, pool: &str, events: Vec<quantity::Event>) {
        for e in events {
            match e {
                quantity::Event::Granted(v) => self.quantity_granted(now, pool, v.id),
                quantity::Event::Unsatisfiable { id, .. } => {
                    // A waiting request the shrunk offers can never grant: its session hears
                    // of it by lease id, like any other end it did not ask for.
                    self.send_to_lease(
                        id,
                        Event::LeaseEnded {
                            lease_id: id,
                            resource: pool.to_string(),
                            epoch: 0,
                            reason: "unsatisfiable".into(),
                        },
                    );
                    self.forget(now, id, EndWhy::Released, false);
                }
                quantity::Event::Expired { id, .. } => {
                    self.forget(now, id, EndWhy::Expired, true);
                }
                quantity::Event::RenewalRefused { id, offer } => {
                    self.dirty = true;
                    self.send_to_lease(
                        id,
                        Event::RenewalRefused {
                            lease_id: id,
                            resource: pool.to_string(),
                            offer,
                        },
                    );
                }
                quantity::Event::RenewalAllowed { id } => {
                    self.dirty = true;
                    self.send_to_lease(
                        id,
                        Event::RenewalAllowed {
                            lease_id: id,
                            resource: pool.to_string(),
                        },
                    );
                }
            }
        }
        self.drop_empty_pool(pool);
    }

    /// A pool without offers, leases or waiters is forgotten (its name is free again).
    fn drop_empty_pool(&mut self, pool: &str) {
        // O(1): this runs after every pool event (building the lists here made a mass
        // release quadratic).
        let empty = self.pools.get(pool).is_some_and(|p| p.is_empty());
        if empty {
            self.note_name(pool);
            self.pools.remove(pool);
            self.dirty = true;
        }
    }

    /// End (release, revoke) or withdraw quantity lease `id`.
    pub(super) fn quantity_end(&mut self, now: Now, id: u64, why: EndWhy) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        self.note_name(&l.resource);
        let events = match self.pools.get_mut(&l.resource) {
            Some(p) => p.release(qnow(now), id, &l.token).unwrap_or_default(),
            None => Vec::new(),
        };
        let tell = !matches!(why, EndWhy::Released);
        self.forget(now, id, why, tell);
        self.quantity_events(now, &l.resource, events);
    }

    /// `renew` of a quantity lease (optionally asking for a new lease time).
    pub(super) fn quantity_renew(&mut self, now: Now, s: SessionId, id: u64, ttl_ms: Option<u64>) {
        let Some(l) = self.kl.get(&id).cloned() else {
            return;
        };
        self.note_name(&l.resource);
        let res = match self.pools.get_mut(&l.resource) {
            Some(p) => p.renew(qnow(now), id, &l.token, ttl_ms.map(Duration::from_millis)),
            None => Err(QuantityError::UnknownLease(id)),
        };
        match res {
            Ok(v) => {
                self.count_renewal(LeaseKind::Quantity, true);
                self.send(
                    s,
                    Event::Renewed {
                        lease_id: id,
                        resource: l.resource,
                        expires_at_unix_ms: v.expires_unix_ms,
                    },
                );
            }
            Err(e) => {
                self.count_renewal(LeaseKind::Quantity, false);
                let code = match e {
                    QuantityError::RenewalRefused { .. } | QuantityError::MaxTotalLeaseTime(_) => {
                        ErrorCode::RenewalRefused
                    }
                    QuantityError::Expired(_) | QuantityError::UnknownLease(_) => {
                        ErrorCode::LeaseEnded
                    }
                    _ => ErrorCode::WrongLease,
                };
                self.error(s, code, e.to_string(), Some(&l.resource));
            }
        }
    }

    /// Lease times that ran out, in every pool.
    pub(super) fn quantity_tick(&mut self, now: Now) {
        let due: Vec<String> = self
            .pools
            .iter()
            .filter(|(_, p)| p.next_deadline().is_some_and(|d| d <= now.mono))
            .map(|(n, _)| n.clone())
            .collect();
        for pool in due {
            self.note_name(&pool);
            let events = match self.pools.get_mut(&pool) {
                Some(p) => p.tick(qnow(now)),
                None => continue,
            };
            self.quantity_events(now, &pool, events);
        }
    }

    /// Set an offer (from the wire or the offers file); returns the leases whose renewals
    /// are now refused, or why it was refused.
    pub(super) fn set_offer(
        &mut self,
        now: Now,
        pool: &str,
        spec: OfferSpec,
    ) -> Result<Vec<u64>, String> {
        if let Some(k) = self.kind_in_use(pool).filter(|k| *k != LeaseKind::Quantity) {
            return Err(format!("{pool:?} is in use as a {} lease", k.as_str()));
        }
        if !self.pools.contains_key(pool) {
            let m = QuantityManager::new(self.quantity_config()).map_err(|e| e.to_string())?;
            self.note_name(pool);
            self.pools.insert(pool.to_string(), m);
        }
        self.note_name(pool);
        let res = match self.pools.get_mut(pool) {
            Some(p) => p.upsert_offer(qnow(now), spec),
            None => return Err("no pool".into()),
        };
        match res {
            Ok(events) => {
                self.dirty = true;
                let refused = refused_ids(&events);
                self.quantity_events(now, pool, events);
                Ok(refused)
            }
            Err(e) => {
                self.drop_empty_pool(pool);
                Err(e.to_string())
            }
        }
    }

    /// `offer`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn offer(
        &mut self,
        now: Now,
        s: SessionId,
        pool: String,
        name: String,
        quantity: u32,
        attributes: BTreeMap<String, String>,
        max_lease_time_ms: Option<u64>,
        requirements: Option<String>,
    ) {
        let requirements = match requirements.as_deref().map(Selector::parse) {
            None => Selector::everything(),
            Some(Ok(sel)) => sel,
            Some(Err(e)) => {
                return self.error(
                    s,
                    ErrorCode::BadOffer,
                    format!("requirements: {e}"),
                    Some(&pool),
                )
            }
        };
        let spec = OfferSpec {
            name: name.clone(),
            quantity,
            attributes,
            max_lease_time_ms,
            requirements,
        };
        match self.set_offer(now, &pool, spec) {
            Ok(renewal_refused) => {
                let offer = self
                    .pools
                    .get(&pool)
                    .and_then(|p| p.offer(&name))
                    .map(|u| offer_report(&u));
                if let Some(offer) = offer {
                    self.send(
                        s,
                        Event::Offered {
                            pool,
                            offer: Box::new(offer),
                            renewal_refused,
                        },
                    );
                }
            }
            Err(e) => {
                let code = if e.contains("in use as a") {
                    ErrorCode::KindMismatch
                } else {
                    ErrorCode::BadOffer
                };
                self.error(s, code, e, Some(&pool));
            }
        }
    }

    /// `withdraw`: the offer's capacity goes to 0; its leases run out (renewals refused).
    pub(super) fn withdraw(&mut self, now: Now, s: SessionId, pool: String, name: String) {
        self.note_name(&pool);
        let res = match self.pools.get_mut(&pool) {
            Some(p) => p.remove_offer(&name),
            None => Err(QuantityError::UnknownOffer(name.clone())),
        };
        match res {
            Ok(events) => {
                self.dirty = true;
                let renewal_refused = refused_ids(&events);
                self.quantity_events(now, &pool, events);
                self.send(
                    s,
                    Event::Withdrawn {
                        pool,
                        name,
                        renewal_refused,
                    },
                );
            }
            Err(e) => self.error(s, ErrorCode::BadOffer, e.to_string(), Some(&pool)),
        }
    }

    /// Every pool, for `status`.
    pub(super) fn pool_reports(&self) -> Vec<PoolReport> {
        self.pools
            .iter()
            .map(|(name, p)| PoolReport {
                name: name.clone(),
                offers: p.offers().iter().map(offer_report).collect(),
                leases: p.lease_count(),
                waiting: p.waiting_count(),
            })
            .collect()
    }
}

fn refused_ids(events: &[quantity::Event]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            quantity::Event::RenewalRefused { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! Quantity leases over offers, through the core (seed 001).
    use crate::core::testkit::*;
    use crate::proto::LeaseKind;

    #[test]
    fn one_request_from_several_offers_with_the_minimum_lease_time() {
        let mut h = H::with_cfg(PersistedState::default(), None, 0, |c| {
            c.max_lease_time = Duration::from_millis(5000)
        });
        h.connect(1, "unix");
        h.connect(2, "unix");
        let out = h.req(1, offer("gpus", "a", 4, Some(3000)));
        assert!(matches!(&H::to(&out, 1)[..], [Event::Offered { .. }]));
        h.req(1, offer("gpus", "b", 4, None));
        let g = H::g(&h.req(2, acq_q("gpus", "eng", 6, Some(4000), true)), 2).unwrap();
        let allocs = g.lease.allocations.clone().unwrap();
        assert_eq!(allocs.iter().map(|a| a.quantity).sum::<u32>(), 6);
        assert_eq!(allocs.len(), 2);
        // min(offer a 3000, request 4000, manager 5000) = 3000.
        assert_eq!(g.lease.expires_at_unix_ms, Some(3000));
        assert_eq!(g.lease.kind, Some(LeaseKind::Quantity));
        // Not enough left: fail at once, or wait.
        let out = h.req(2, acq_q("gpus", "x", 3, None, false));
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("unavailable"));
        let out = h.req(2, acq_q("gpus", "x", 9, None, true));
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("unsatisfiable"));
        h.connect(3, "unix");
        let out = h.req(3, acq_q("gpus", "y", 3, None, true));
        assert!(matches!(
            &H::to(&out, 3)[..],
            [Event::Queued {
                lease_id: Some(_),
                ..
            }]
        ));
        let out = h.req(
            2,
            Request::Release {
                resource: None,
                lease_id: Some(g.id),
                token: Some(g.token.clone()),
            },
        );
        assert!(
            H::g(&out, 3).is_some(),
            "the waiter is granted when capacity returns"
        );
    }

    #[test]
    fn a_shrinking_offer_refuses_the_newest_leases_renewals() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, offer("p", "a", 4, None));
        let old = H::g(&h.req(1, acq_q("p", "old", 2, Some(1000), true)), 1).unwrap();
        h.ms = 10;
        let new = H::g(&h.req(1, acq_q("p", "new", 2, Some(1000), true)), 1).unwrap();
        let out = h.req(1, offer("p", "a", 2, None));
        let ev = H::to(&out, 1);
        assert!(
            ev.iter().any(
                |e| matches!(e, Event::RenewalRefused { lease_id, .. } if *lease_id == new.id)
            ),
            "{ev:?}"
        );
        assert!(ev.iter().any(|e| matches!(e, Event::Offered { renewal_refused, .. } if renewal_refused == &vec![new.id])));
        let renew = |g: &G| Request::Renew {
            lease_id: g.id,
            token: g.token.clone(),
            ttl_ms: None,
        };
        assert_eq!(
            H::err_code(&h.req(1, renew(&new)), 1).as_deref(),
            Some("renewal_refused")
        );
        assert!(matches!(
            &H::to(&h.req(1, renew(&old)), 1)[..],
            [Event::Renewed { .. }]
        ));
        assert_eq!(h.lease(1, new.id).renewal_refused.as_deref(), Some("a"));
    }

    #[test]
    fn max_total_lease_time_refuses_renewal() {
        let mut h = H::with_cfg(PersistedState::default(), None, 0, |c| {
            c.max_total_lease_time = Duration::from_millis(1500)
        });
        h.connect(1, "unix");
        h.req(1, offer("p", "a", 1, None));
        let g = H::g(&h.req(1, acq_q("p", "w", 1, Some(1000), true)), 1).unwrap();
        let renew = Request::Renew {
            lease_id: g.id,
            token: g.token.clone(),
            ttl_ms: None,
        };
        h.ms = 900;
        let out = h.req(1, renew.clone());
        assert!(matches!(
            &H::to(&out, 1)[..],
            [Event::Renewed {
                expires_at_unix_ms: 1500,
                ..
            }]
        ));
        h.ms = 1000;
        assert_eq!(
            H::err_code(&h.req(1, renew), 1).as_deref(),
            Some("renewal_refused")
        );
    }

    #[test]
    fn requirements_match_both_ways() {
        let mut h = H::new();
        h.connect(1, "unix");
        let mut o = offer("p", "h100", 2, None);
        if let Request::Offer {
            attributes,
            requirements,
            ..
        } = &mut o
        {
            attributes.insert("model".into(), "h100".into());
            *requirements = Some("team in (infer)".into());
        }
        h.req(1, o);
        let mut o = offer("p", "a100", 2, None);
        if let Request::Offer { attributes, .. } = &mut o {
            attributes.insert("model".into(), "a100".into());
        }
        h.req(1, o);
        let ask = |model: &str, team: Option<&str>| {
            let mut r = acq_q("p", "w", 1, None, false);
            if let Request::Acquire { ext, .. } = &mut r {
                ext.requirements = Some(format!("model={model}"));
                ext.attributes = team.map(|t| [("team".to_string(), t.to_string())].into());
            }
            r
        };
        let g = H::g(&h.req(1, ask("h100", Some("infer"))), 1).unwrap();
        assert_eq!(g.lease.allocations.unwrap()[0].offer, "h100");
        // The h100 offer requires team=infer of the request: refused to others.
        let out = h.req(1, ask("h100", Some("train")));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("unavailable"));
        let g = H::g(&h.req(1, ask("a100", None)), 1).unwrap();
        assert_eq!(g.lease.allocations.unwrap()[0].offer, "a100");
    }

    #[test]
    fn a_lease_is_resumed_after_the_clients_crash_and_survives_a_lockd_restart() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, offer("p", "a", 2, None));
        let g = H::g(&h.req(1, acq_q("p", "w", 2, Some(10_000), true)), 1).unwrap();
        h.step(Input::Disconnect { session: 1 });
        let st = h.persisted.clone().unwrap();
        let mut h = H::restart_at(st, 500);
        h.connect(2, "unix");
        let back = H::g(
            &h.req(
                2,
                Request::Resume {
                    lease_id: g.id,
                    token: g.token.clone(),
                },
            ),
            2,
        )
        .unwrap();
        assert_eq!(
            (back.epoch, back.lease.expires_at_unix_ms),
            (g.epoch, Some(10_000))
        );
        let out = h.req(
            2,
            Request::Resume {
                lease_id: g.id,
                token: "forged".into(),
            },
        );
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("bad_token"));
        let st = h.st();
        assert_eq!(st.pools[0].offers[0].allocated, 2);
        // Withdrawing the offer refuses the lease's renewals; it runs out at its deadline.
        let out = h.req(
            2,
            Request::Withdraw {
                pool: "p".into(),
                name: "a".into(),
                admin_token: None,
            },
        );
        assert!(H::to(&out, 2).iter().any(|e| matches!(e, Event::Withdrawn { renewal_refused, .. } if renewal_refused == &vec![g.id])));
        h.ms = 10_000;
        let out = h.step(Input::Tick);
        assert!(
            matches!(&H::to(&out, 2)[..], [Event::LeaseEnded { reason, .. }] if reason == "expired")
        );
        assert!(
            h.st().pools.is_empty(),
            "a pool with nothing left is forgotten"
        );
    }

    #[test]
    fn offers_over_tcp_need_the_admin_token() {
        let mut h = H::with_state(PersistedState::default(), Some("s3cret"));
        h.connect(1, "tcp");
        let out = h.req(1, offer("p", "a", 1, None));
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("unauthorized"));
        let mut o = offer("p", "a", 1, None);
        if let Request::Offer { admin_token, .. } = &mut o {
            *admin_token = Some("s3cret".into());
        }
        assert!(matches!(
            &H::to(&h.req(1, o), 1)[..],
            [Event::Offered { .. }]
        ));
    }

    #[test]
    fn the_offers_file_is_applied_and_no_copy_of_it_is_kept() {
        let offers = crate::offers_file::parse(
            r#"{"gpus":[{"name":"a","quantity":2,"attributes":{"m":"h100"}},{"name":"b","quantity":1}]}"#,
        )
        .unwrap();
        let cfg = crate::core::Config {
            offers,
            ..Default::default()
        };
        let mut now = H::new().now();
        now.unix_ms = 1;
        let core = crate::core::Core::new(cfg, PersistedState::default(), now, 1).unwrap();
        assert!(core.cfg.offers.is_empty(), "the core keeps the pools only");
        let pools = core.status(now, false).pools;
        assert_eq!(pools.len(), 1);
        let names: Vec<&str> = pools[0].offers.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }
}
