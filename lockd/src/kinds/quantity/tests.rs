//! Transition-by-transition tests of the quantity pool manager, and a random-history
//! property test of its invariants.

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use proptest::prelude::*;

use super::*;

const UNIX0: u64 = 1_700_000_000_000;

fn base() -> Instant {
    static B: OnceLock<Instant> = OnceLock::new();
    *B.get_or_init(Instant::now)
}

/// `ms` after the test epoch, on both clocks.
fn at(ms: u64) -> Now {
    Now {
        mono: base() + Duration::from_millis(ms),
        unix_ms: UNIX0 + ms,
    }
}

const S: u64 = 1000;

fn cfg() -> Config {
    Config {
        max_lease_time: Duration::from_secs(60),
        max_total_lease_time: Duration::from_secs(3600),
    }
}

fn mgr() -> QuantityManager {
    QuantityManager::new(cfg()).unwrap()
}

fn attrs(kv: &[(&str, &str)]) -> Attributes {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn sel(s: &str) -> Selector {
    Selector::parse(s).unwrap()
}

fn offer(name: &str, quantity: u32) -> OfferSpec {
    OfferSpec {
        name: name.into(),
        quantity,
        attributes: Attributes::new(),
        max_lease_time_ms: None,
        requirements: Selector::everything(),
    }
}

fn req(quantity: u32) -> RequestSpec {
    RequestSpec {
        holder: "h".into(),
        quantity,
        requirements: Selector::everything(),
        attributes: Attributes::new(),
        lease_time: None,
        on_unavailable: OnUnavailable::Fail,
    }
}

fn tok(id: LeaseId) -> String {
    format!("token-{id}")
}

fn grant(m: &mut QuantityManager, now: Now, id: LeaseId, spec: RequestSpec) -> LeaseView {
    match m.request(now, id, tok(id), spec).unwrap() {
        Requested::Granted(v) => v,
        other => panic!("lease {id}: {other:?}"),
    }
}

fn allocs(v: &LeaseView) -> Vec<(&str, u32)> {
    v.allocations
        .iter()
        .map(|a| (a.offer.as_str(), a.quantity))
        .collect()
}

#[test]
fn one_request_from_several_offers() {
    let mut m = mgr();
    for (n, q) in [("a", 4), ("b", 3), ("c", 2)] {
        m.upsert_offer(at(0), offer(n, q)).unwrap();
    }
    // nobody covers 6: the biggest (a) whole, then the best fit for the remaining 2 (c)
    let l1 = grant(&mut m, at(0), 1, req(6));
    assert_eq!(allocs(&l1), [("a", 4), ("c", 2)]);
    assert_eq!(l1.quantity, 6);
    assert_eq!(m.offer("a").unwrap().allocated, 4);
    // the rest (b: 3) is enough for 3, not for 4: all or nothing
    let e = m.request(at(0), 2, tok(2), req(4)).unwrap_err();
    assert_eq!(
        e,
        QuantityError::Unavailable {
            requested: 4,
            available: 3
        }
    );
    assert!(m.lease(2).is_none());
    assert_eq!(
        m.offer("b").unwrap().allocated,
        0,
        "nothing taken by a refusal"
    );
    assert_eq!(allocs(&grant(&mut m, at(0), 3, req(3))), [("b", 3)]);
    m.check_indices();
}

#[test]
fn allocation_prefers_one_offer_best_fit_then_fewest_offers() {
    let mut m = mgr();
    for (n, q) in [("a", 5), ("b", 1), ("c", 1), ("d", 4), ("e", 3)] {
        m.upsert_offer(at(0), offer(n, q)).unwrap();
    }
    // a single offer covers 3: the least free that covers it (e: 3, not d: 4 or a: 5)
    assert_eq!(allocs(&grant(&mut m, at(0), 1, req(3))), [("e", 3)]);
    // 6: a (5) + the best fit for 1, ties by name (b, not c)
    assert_eq!(
        allocs(&grant(&mut m, at(0), 2, req(6))),
        [("a", 5), ("b", 1)]
    );
    // 5 from d (4) + c (1): two offers
    assert_eq!(
        allocs(&grant(&mut m, at(0), 3, req(5))),
        [("c", 1), ("d", 4)]
    );
    m.check_indices();
}

#[test]
fn lease_time_is_the_minimum_of_offer_request_and_manager() {
    let cases: &[(Option<u64>, Option<u64>, u64)] = &[
        (Some(20), Some(30), 20), // offer's
        (Some(50), Some(10), 10), // request's
        (Some(90), Some(80), 60), // manager's (cfg: 60 s)
        (None, None, 60),
    ];
    for (i, &(offer_s, req_s, want)) in cases.iter().enumerate() {
        let mut m = mgr();
        let mut o = offer("g", 1);
        o.max_lease_time_ms = offer_s.map(|s| s * S);
        m.upsert_offer(at(0), o).unwrap();
        let mut r = req(1);
        r.lease_time = req_s.map(Duration::from_secs);
        let v = grant(&mut m, at(5 * S), 1, r);
        assert_eq!(v.expires, at(5 * S + want * S).mono, "case {i}");
        assert_eq!(v.expires_unix_ms, UNIX0 + 5 * S + want * S, "case {i}");
        assert_eq!(m.next_deadline(), Some(v.expires));
    }
    // over several offers: the smallest offer maximum counts
    let mut m = mgr();
    let mut a = offer("a", 1);
    a.max_lease_time_ms = Some(40 * S);
    let mut b = offer("b", 1);
    b.max_lease_time_ms = Some(25 * S);
    m.upsert_offer(at(0), a).unwrap();
    m.upsert_offer(at(0), b).unwrap();
    let v = grant(&mut m, at(0), 1, req(2));
    assert_eq!(v.expires, at(25 * S).mono);
    // a renewal follows the same rule
    let v = m.renew(at(10 * S), 1, &tok(1), None).unwrap();
    assert_eq!(v.expires, at(35 * S).mono);
}

#[test]
fn max_total_lease_time_refuses_renewal() {
    let mut m = QuantityManager::new(Config {
        max_lease_time: Duration::from_secs(60),
        max_total_lease_time: Duration::from_secs(100),
    })
    .unwrap();
    m.upsert_offer(at(0), offer("g", 1)).unwrap();
    assert_eq!(grant(&mut m, at(0), 1, req(1)).expires, at(60 * S).mono);
    // renewal capped at first grant + 100 s
    let v = m.renew(at(50 * S), 1, &tok(1), None).unwrap();
    assert_eq!(v.expires, at(100 * S).mono);
    assert_eq!(v.expires_unix_ms, UNIX0 + 100 * S);
    // nothing left to extend: refused, the lease keeps its expiry
    assert_eq!(
        m.renew(at(90 * S), 1, &tok(1), None),
        Err(QuantityError::MaxTotalLeaseTime(1))
    );
    assert!(m.tick(at(100 * S - 1)).is_empty());
    assert_eq!(
        m.tick(at(100 * S)),
        [Event::Expired {
            id: 1,
            holder: "h".into()
        }]
    );
    assert!(m.lease(1).is_none());
    assert_eq!(m.offer("g").unwrap().allocated, 0);
}

#[test]
fn renew_after_expiry_is_refused_and_expiry_frees_for_waiters() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("g", 2)).unwrap();
    let mut r = req(2);
    r.lease_time = Some(Duration::from_secs(10));
    grant(&mut m, at(0), 1, r);
    let mut w = req(1);
    w.on_unavailable = OnUnavailable::Wait;
    assert_eq!(
        m.request(at(S), 2, tok(2), w).unwrap(),
        Requested::Queued { ahead: 0 }
    );
    // before any tick, an op at the expiry already treats it as expired
    assert_eq!(
        m.renew(at(10 * S), 1, &tok(1), None),
        Err(QuantityError::Expired(1))
    );
    let ev = m.tick(at(10 * S));
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(matches!(&ev[0], Event::Expired { id: 1, .. }));
    assert!(matches!(&ev[1], Event::Granted(v) if v.id == 2 && v.quantity == 1));
    assert_eq!(
        m.renew(at(11 * S), 1, &tok(1), None),
        Err(QuantityError::UnknownLease(1))
    );
}

#[test]
fn a_shrinking_offer_refuses_the_newest_leases_renewals() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("g", 10)).unwrap();
    grant(&mut m, at(0), 1, req(4));
    grant(&mut m, at(1), 2, req(3));
    grant(&mut m, at(2), 3, req(3));
    // 10 allocated, 7 left: the newest (3) goes, 7 fit
    let ev = m.upsert_offer(at(5 * S), offer("g", 7)).unwrap();
    assert_eq!(
        ev,
        [Event::RenewalRefused {
            id: 3,
            offer: "g".into()
        }]
    );
    assert_eq!(m.lease(3).unwrap().renewal_refused.as_deref(), Some("g"));
    assert_eq!(
        m.renew(at(6 * S), 3, &tok(3), None),
        Err(QuantityError::RenewalRefused {
            id: 3,
            offer: "g".into()
        })
    );
    // the others renew; the refused lease is not revoked early
    m.renew(at(6 * S), 1, &tok(1), None).unwrap();
    m.renew(at(6 * S), 2, &tok(2), None).unwrap();
    assert!(m.lease(3).is_some());
    // nothing new is granted while over-committed
    assert!(matches!(
        m.request(at(6 * S), 4, tok(4), req(1)),
        Err(QuantityError::Unavailable { .. })
    ));
    m.check_indices();
    // 5 left: 2 (3) goes too; shrinking further never un-chooses 3
    let ev = m.upsert_offer(at(7 * S), offer("g", 5)).unwrap();
    assert_eq!(
        ev,
        [Event::RenewalRefused {
            id: 2,
            offer: "g".into()
        }]
    );
    // the oldest ends: 2 alone (3) fits in 5 again, 3 does not fit beside it
    let ev = m.release(at(8 * S), 1, &tok(1)).unwrap();
    assert_eq!(ev, [Event::RenewalAllowed { id: 2 }]);
    m.renew(at(8 * S), 2, &tok(2), None).unwrap();
    // 3 runs out at its own expiry (60 s after its grant); then the totals fit
    let ev = m.tick(at(2 + 60 * S));
    assert!(matches!(&ev[..], [Event::Expired { id: 3, .. }]), "{ev:?}");
    let g = m.offer("g").unwrap();
    assert!(g.allocated <= g.capacity, "{g:?}");
    m.check_indices();
}

#[test]
fn a_removed_offer_refuses_every_renewal_and_goes_with_its_last_lease() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("a", 2)).unwrap();
    m.upsert_offer(at(0), offer("b", 2)).unwrap();
    grant(&mut m, at(0), 1, req(3)); // a 2 + b 1
    grant(&mut m, at(1), 2, req(1)); // b 1
    let ev = m.remove_offer("b").unwrap();
    assert_eq!(
        ev,
        [
            Event::RenewalRefused {
                id: 1,
                offer: "b".into()
            },
            Event::RenewalRefused {
                id: 2,
                offer: "b".into()
            }
        ]
    );
    assert!(m.offer("b").unwrap().removed);
    m.release(at(2), 1, &tok(1)).unwrap();
    m.release(at(3), 2, &tok(2)).unwrap();
    assert!(m.offer("b").is_none(), "forgotten with its last lease");
    assert_eq!(
        m.remove_offer("b"),
        Err(QuantityError::UnknownOffer("b".into()))
    );
}

#[test]
fn a_lease_over_two_offers_is_chosen_once() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("a", 3)).unwrap();
    m.upsert_offer(at(0), offer("b", 3)).unwrap();
    grant(&mut m, at(0), 1, req(2)); // b (best fit, tie by name: a) -> a 2
    grant(&mut m, at(1), 2, req(4)); // b 3 + a 1
    assert_eq!(allocs(&m.lease(2).unwrap()), [("a", 1), ("b", 3)]);
    // both shrink by one: choosing 2 for a also fixes b
    let mut ev = m.upsert_offer(at(2), offer("a", 2)).unwrap();
    ev.extend(m.upsert_offer(at(2), offer("b", 2)).unwrap());
    assert_eq!(
        ev,
        [Event::RenewalRefused {
            id: 2,
            offer: "a".into()
        }]
    );
    m.check_indices();
}

#[test]
fn requirements_match_both_ways() {
    let mut m = mgr();
    let mut a = offer("a", 4);
    a.attributes = attrs(&[("gpu", "h100"), ("mem", "80")]);
    a.requirements = sel("tier in (prod)");
    let mut b = offer("b", 4);
    b.attributes = attrs(&[("gpu", "a100"), ("mem", "40")]);
    m.upsert_offer(at(0), a).unwrap();
    m.upsert_offer(at(0), b).unwrap();

    // wants h100 but is not prod: a refuses it, b does not have h100
    let mut r = req(1);
    r.requirements = sel("gpu in (h100)");
    r.attributes = attrs(&[("tier", "dev")]);
    assert!(matches!(
        m.request(at(0), 1, tok(1), r.clone()),
        Err(QuantityError::Unavailable { available: 0, .. })
    ));
    // prod: a accepts it
    r.attributes = attrs(&[("tier", "prod")]);
    assert_eq!(allocs(&grant(&mut m, at(0), 2, r)), [("a", 1)]);
    // no requirements, no attributes: only b (a requires tier=prod)
    assert_eq!(allocs(&grant(&mut m, at(0), 3, req(4))), [("b", 4)]);
    // Gt on an offer attribute
    let mut r = req(1);
    r.requirements = sel("mem>50");
    r.attributes = attrs(&[("tier", "prod")]);
    assert_eq!(allocs(&grant(&mut m, at(0), 4, r)), [("a", 1)]);
}

#[test]
fn fifo_with_the_non_delaying_pass_rule() {
    let mut m = mgr();
    let mut a = offer("a", 4);
    a.attributes = attrs(&[("zone", "x")]);
    let mut b = offer("b", 2);
    b.attributes = attrs(&[("zone", "y")]);
    m.upsert_offer(at(0), a).unwrap();
    m.upsert_offer(at(0), b).unwrap();
    let mut in_x = req(2);
    in_x.requirements = sel("zone=x");
    grant(&mut m, at(0), 1, in_x.clone()); // a: 2 free left
    let mut big = in_x.clone();
    big.quantity = 3;
    big.on_unavailable = OnUnavailable::Wait;
    assert_eq!(
        m.request(at(1), 2, tok(2), big).unwrap(),
        Requested::Queued { ahead: 0 }
    );
    // a small later request for zone x fits in a's 2 free, but a is reserved by 2
    let mut small = in_x.clone();
    small.quantity = 1;
    small.on_unavailable = OnUnavailable::Wait;
    assert_eq!(
        m.request(at(2), 3, tok(3), small.clone()).unwrap(),
        Requested::Queued { ahead: 1 }
    );
    small.on_unavailable = OnUnavailable::Fail;
    assert_eq!(
        m.request(at(2), 9, tok(9), small),
        Err(QuantityError::Unavailable {
            requested: 1,
            available: 0
        })
    );
    // a request any zone serves passes: b is not matched by any waiter
    let any = grant(&mut m, at(3), 4, req(1));
    assert_eq!(allocs(&any), [("b", 1)]);
    assert_eq!(m.waiting(), [2, 3]);
    // a frees: 2 first (3 of 4), then 3 (the last 1)
    let ev = m.release(at(4), 1, &tok(1)).unwrap();
    let granted: Vec<(LeaseId, Vec<(&str, u32)>)> = ev
        .iter()
        .map(|e| match e {
            Event::Granted(v) => (v.id, allocs(v)),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(granted, [(2, vec![("a", 3)]), (3, vec![("a", 1)])]);
    assert!(m.waiting().is_empty());
    m.check_indices();
}

#[test]
fn cancelling_a_waiter_lets_the_next_pass() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("a", 2)).unwrap();
    grant(&mut m, at(0), 1, req(1));
    let mut big = req(2);
    big.on_unavailable = OnUnavailable::Wait;
    m.request(at(1), 2, tok(2), big).unwrap();
    let mut small = req(1);
    small.on_unavailable = OnUnavailable::Wait;
    m.request(at(2), 3, tok(3), small).unwrap();
    assert_eq!(m.release(at(3), 2, "bad"), Err(QuantityError::BadToken(2)));
    let ev = m.release(at(3), 2, &tok(2)).unwrap();
    assert!(matches!(&ev[..], [Event::Granted(v)] if v.id == 3));
}

#[test]
fn a_request_no_capacity_could_satisfy_does_not_wait() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("a", 2)).unwrap();
    m.upsert_offer(at(0), offer("b", 2)).unwrap();
    let mut r = req(5);
    r.on_unavailable = OnUnavailable::Wait;
    assert_eq!(
        m.request(at(0), 1, tok(1), r.clone()),
        Err(QuantityError::Unsatisfiable {
            requested: 5,
            capacity: 4
        })
    );
    grant(&mut m, at(0), 2, req(1));
    r.quantity = 4;
    assert_eq!(
        m.request(at(0), 3, tok(3), r).unwrap(),
        Requested::Queued { ahead: 0 }
    );
    // b goes away: 4 can never be granted from a (2) alone; the waiter is dropped
    let ev = m.remove_offer("b").unwrap();
    assert!(
        ev.contains(&Event::Unsatisfiable {
            id: 3,
            holder: "h".into()
        }),
        "{ev:?}"
    );
    assert!(m.waiting().is_empty());
    m.check_indices();
}

#[test]
fn resume_after_the_clients_crash_and_wrong_token_refused() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("g", 3)).unwrap();
    let granted = grant(&mut m, at(0), 7, req(2));
    // the client saved (7, token) to disk and crashed; a new process picks it up
    let saved = serde_json::to_string(&(7u64, tok(7))).unwrap();
    let (id, token): (LeaseId, String) = serde_json::from_str(&saved).unwrap();
    assert_eq!(m.resume(at(5 * S), id, &token).unwrap(), granted);
    let renewed = m.renew(at(5 * S), id, &token, None).unwrap();
    assert_eq!(renewed.expires, at(65 * S).mono);
    for bad in ["", "token-8", "token-77", "TOKEN-7"] {
        assert_eq!(
            m.resume(at(5 * S), id, bad),
            Err(QuantityError::BadToken(7))
        );
        assert_eq!(
            m.renew(at(5 * S), id, bad, None),
            Err(QuantityError::BadToken(7))
        );
        assert_eq!(
            m.release(at(5 * S), id, bad),
            Err(QuantityError::BadToken(7))
        );
    }
    assert_eq!(
        m.lease(7).unwrap().expires,
        renewed.expires,
        "bad tokens changed nothing"
    );
    assert_eq!(
        m.resume(at(5 * S), 8, &token),
        Err(QuantityError::UnknownLease(8))
    );
    assert_eq!(
        m.resume(at(65 * S), id, &token),
        Err(QuantityError::Expired(7))
    );
    m.release(at(6 * S), id, &token).unwrap();
    assert_eq!(
        m.resume(at(6 * S), id, &token),
        Err(QuantityError::UnknownLease(7))
    );
}

#[test]
fn restore_from_records_keeps_expiries() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("a", 4)).unwrap();
    let mut b = offer("b", 4);
    b.attributes = attrs(&[("gpu", "h100")]);
    b.requirements = sel("!batch");
    m.upsert_offer(at(0), b).unwrap();
    let mut r = req(6);
    r.lease_time = Some(Duration::from_secs(30));
    r.holder = "engine-0".into();
    grant(&mut m, at(0), 1, r);
    m.renew(at(10 * S), 1, &tok(1), None).unwrap(); // expires at 40 s
    let mut short = req(1);
    short.lease_time = Some(Duration::from_secs(5));
    grant(&mut m, at(0), 2, short); // expires at 5 s
    let recs = m.records();
    let json = serde_json::to_string(&recs).unwrap();
    let recs: QuantityRecords = serde_json::from_str(&json).unwrap();
    assert_eq!(recs, m.records());

    // lockd comes back 20 s later (wall clock), with a new monotonic clock
    let later = Instant::now() + Duration::from_secs(1000);
    let now = Now {
        mono: later,
        unix_ms: UNIX0 + 20 * S,
    };
    let (mut r2, ev) = QuantityManager::restore(cfg(), recs, now).unwrap();
    assert!(ev.is_empty());
    let l1 = r2.lease(1).unwrap();
    assert_eq!(l1.expires_unix_ms, UNIX0 + 40 * S, "same wall-clock expiry");
    assert_eq!(
        l1.expires,
        later + Duration::from_secs(20),
        "no time gained or lost"
    );
    assert_eq!(l1.holder, "engine-0");
    assert_eq!(l1.first_granted_unix_ms, UNIX0);
    assert_eq!(
        r2.offer("a").unwrap().allocated + r2.offer("b").unwrap().allocated,
        7
    );
    assert_eq!(r2.offer("b").unwrap().spec.requirements, sel("!batch"));
    // lease 2 expired while lockd was down: it ends at the first tick
    let ev = r2.tick(now);
    assert!(matches!(&ev[..], [Event::Expired { id: 2, .. }]), "{ev:?}");
    assert!(r2
        .tick(Now {
            mono: later + Duration::from_millis(20 * S - 1),
            unix_ms: 0
        })
        .is_empty());
    assert_eq!(r2.resume(now, 1, &tok(1)).unwrap().id, 1);
    let ev = r2.tick(Now {
        mono: later + Duration::from_secs(20),
        unix_ms: UNIX0 + 40 * S,
    });
    assert!(matches!(&ev[..], [Event::Expired { id: 1, .. }]), "{ev:?}");
    r2.check_indices();
}

#[test]
fn restore_keeps_the_max_total_and_the_shrink_choices() {
    let c = Config {
        max_lease_time: Duration::from_secs(60),
        max_total_lease_time: Duration::from_secs(100),
    };
    let mut m = QuantityManager::new(c).unwrap();
    m.upsert_offer(at(0), offer("g", 4)).unwrap();
    grant(&mut m, at(0), 1, req(2));
    grant(&mut m, at(1), 2, req(2));
    m.upsert_offer(at(2), offer("g", 3)).unwrap();
    let recs = m.records();
    let now = Now {
        mono: Instant::now(),
        unix_ms: UNIX0 + 50 * S,
    };
    let (mut r, ev) = QuantityManager::restore(c, recs, now).unwrap();
    assert_eq!(
        ev,
        [Event::RenewalRefused {
            id: 2,
            offer: "g".into()
        }]
    );
    // 10 s left of lease 1; a renewal stops at first grant + 100 s (50 s from now)
    let v = r.renew(now, 1, &tok(1), None).unwrap();
    assert_eq!(v.expires, now.mono + Duration::from_secs(50));
    assert_eq!(v.expires_unix_ms, UNIX0 + 100 * S);
    // a lease on an offer missing from the records keeps running on a removed placeholder
    let mut recs = r.records();
    recs.offers.clear();
    let (r3, ev) = QuantityManager::restore(c, recs, now).unwrap();
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(r3.offer("g").unwrap().removed);
    r3.check_indices();
}

#[test]
fn corrupt_records_are_refused_not_panicked_on() {
    let mut m = mgr();
    m.upsert_offer(at(0), offer("g", 4)).unwrap();
    grant(&mut m, at(0), 1, req(2));
    let good = m.records();
    let mut bad = good.clone();
    bad.version = 99;
    let mut dup = good.clone();
    dup.leases.push(dup.leases[0].clone());
    let mut zero = good.clone();
    zero.leases[0].allocations[0].quantity = 0;
    let mut twice = good.clone();
    let a = twice.leases[0].allocations[0].clone();
    twice.leases[0].allocations.push(a);
    let mut none = good.clone();
    none.leases[0].allocations.clear();
    for (what, r) in [
        ("version", bad),
        ("dup", dup),
        ("zero", zero),
        ("twice", twice),
        ("none", none),
    ] {
        assert!(
            matches!(
                QuantityManager::restore(cfg(), r, at(0)),
                Err(QuantityError::Corrupt(_))
            ),
            "{what}"
        );
    }
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let mut m = mgr();
    assert!(matches!(
        QuantityManager::new(Config {
            max_lease_time: Duration::ZERO,
            max_total_lease_time: Duration::from_secs(1)
        }),
        Err(QuantityError::Config(_))
    ));
    for name in ["", "a b", "x\n"] {
        assert!(matches!(
            m.upsert_offer(at(0), offer(name, 1)),
            Err(QuantityError::InvalidOffer { .. })
        ));
    }
    let mut o = offer("g", 1);
    o.max_lease_time_ms = Some(0);
    assert!(m.upsert_offer(at(0), o).is_err());
    m.upsert_offer(at(0), offer("g", 1)).unwrap();
    assert!(matches!(
        m.request(at(0), 1, tok(1), req(0)),
        Err(QuantityError::InvalidRequest(_))
    ));
    let mut r = req(1);
    r.lease_time = Some(Duration::ZERO);
    assert!(m.request(at(0), 1, tok(1), r).is_err());
    assert!(m.request(at(0), 1, String::new(), req(1)).is_err());
    grant(&mut m, at(0), 1, req(1));
    assert_eq!(
        m.request(at(0), 1, tok(1), req(1)),
        Err(QuantityError::DuplicateId(1))
    );
    assert_eq!(
        m.renew(at(0), 1, &tok(1), Some(Duration::ZERO)),
        Err(QuantityError::InvalidRequest("lease time must be > 0"))
    );
    let mut w = req(1);
    w.on_unavailable = OnUnavailable::Wait;
    m.request(at(0), 2, tok(2), w).unwrap();
    assert_eq!(m.resume(at(0), 2, &tok(2)), Err(QuantityError::Waiting(2)));
    assert_eq!(m.resume(at(0), 2, "x"), Err(QuantityError::BadToken(2)));
}

// ----- random histories ---------------------------------------------------------------------

const OFFER_ATTRS: &[&[(&str, &str)]] = &[
    &[("gpu", "h100"), ("mem", "80")],
    &[("gpu", "a100"), ("mem", "40")],
    &[("gpu", "h100"), ("mem", "40"), ("spot", "1")],
];
const OFFER_REQS: &[&str] = &["", "tier in (prod)", "!batch"];
const REQ_REQS: &[&str] = &["", "gpu in (h100)", "mem>50", "!spot"];
const REQ_ATTRS: &[&[(&str, &str)]] = &[&[], &[("tier", "prod")], &[("batch", "1")]];

#[derive(Debug, Clone)]
enum Op {
    Upsert {
        o: usize,
        q: u32,
        attrs: usize,
        reqs: usize,
        max_s: Option<u64>,
    },
    Remove(usize),
    Request {
        q: u32,
        reqs: usize,
        attrs: usize,
        lt_s: Option<u64>,
        wait: bool,
    },
    Renew(usize),
    Release(usize),
    BadToken(usize),
    Advance(u64),
    /// lockd restarts: records -> JSON -> restore at the same instant (waiters are lost).
    Restart,
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..3usize, 0..8u32, 0..3usize, 0..3usize, prop::option::of(1..90u64)).prop_map(
            |(o, q, attrs, reqs, max_s)| Op::Upsert {
                o,
                q,
                attrs,
                reqs,
                max_s
            }
        ),
        1 => (0..3usize).prop_map(Op::Remove),
        1 => (1..7u32, 0..4usize, 0..3usize, prop::option::of(1..90u64), any::<bool>()).prop_map(
            |(q, reqs, attrs, lt_s, wait)| Op::Request {
                q,
                reqs,
                attrs,
                lt_s,
                wait
            }
        ),
        2 => (0..8usize).prop_map(Op::Renew),
        1 => (0..8usize).prop_map(Op::Release),
        1 => (0..8usize).prop_map(Op::BadToken),
        1 => (0..40_000u64).prop_map(Op::Advance),
        1 => Just(Op::Restart),
    ]
}

/// The test's own view: the offers as last set, every request's spec.
#[derive(Default)]
struct Model {
    offers: BTreeMap<String, OfferSpec>,
    requests: HashMap<LeaseId, RequestSpec>,
}

impl Model {
    /// A grant is whole, from distinct live offers that match it both ways, none overfull.
    fn check_grant(&self, m: &QuantityManager, v: &LeaseView) {
        let spec = &self.requests[&v.id];
        let total: u64 = v.allocations.iter().map(|a| u64::from(a.quantity)).sum();
        assert_eq!(total, u64::from(spec.quantity), "all or nothing: {v:?}");
        assert_eq!(v.quantity, spec.quantity);
        let mut seen = std::collections::BTreeSet::new();
        for a in &v.allocations {
            assert!(a.quantity > 0 && seen.insert(&a.offer), "{v:?}");
            let o = self
                .offers
                .get(&a.offer)
                .unwrap_or_else(|| panic!("grant from a removed/unknown offer: {v:?}"));
            assert!(
                spec.requirements.matches(&o.attributes),
                "request does not match offer {}: {v:?}",
                o.name
            );
            assert!(
                o.requirements.matches(&spec.attributes),
                "offer {} does not match request: {v:?}",
                o.name
            );
            let u = m.offer(&a.offer).unwrap();
            assert!(u.allocated <= u.capacity, "over-allocated at grant: {u:?}");
        }
    }
}

fn run_history(ops: Vec<Op>) {
    let mut m = mgr();
    let mut model = Model::default();
    let mut t = 0u64;
    let mut next_id: LeaseId = 1;
    for op in ops {
        let now = at(t);
        for e in m.tick(now) {
            if let Event::Granted(v) = e {
                model.check_grant(&m, &v);
            }
        }
        let mut events = Vec::new();
        match op {
            Op::Upsert {
                o,
                q,
                attrs: ai,
                reqs,
                max_s,
            } => {
                let spec = OfferSpec {
                    name: format!("o{o}"),
                    quantity: q,
                    attributes: attrs(OFFER_ATTRS[ai]),
                    max_lease_time_ms: max_s.map(|s| s * S),
                    requirements: sel(OFFER_REQS[reqs]),
                };
                model.offers.insert(spec.name.clone(), spec.clone());
                events.extend(m.upsert_offer(now, spec).unwrap());
            }
            Op::Remove(o) => {
                let name = format!("o{o}");
                model.offers.remove(&name);
                if let Ok(ev) = m.remove_offer(&name) {
                    events.extend(ev);
                }
            }
            Op::Request {
                q,
                reqs,
                attrs: ai,
                lt_s,
                wait,
            } => {
                let id = next_id;
                next_id += 1;
                let spec = RequestSpec {
                    holder: format!("h{id}"),
                    quantity: q,
                    requirements: sel(REQ_REQS[reqs]),
                    attributes: attrs(REQ_ATTRS[ai]),
                    lease_time: lt_s.map(Duration::from_secs),
                    on_unavailable: if wait {
                        OnUnavailable::Wait
                    } else {
                        OnUnavailable::Fail
                    },
                };
                model.requests.insert(id, spec.clone());
                let before: Vec<u64> = m.offers().iter().map(|u| u.allocated).collect();
                match m.request(now, id, tok(id), spec) {
                    Ok(Requested::Granted(v)) => model.check_grant(&m, &v),
                    Ok(Requested::Queued { .. }) => {
                        assert!(wait);
                        assert!(m.lease(id).is_none());
                        assert_eq!(m.waiting().last(), Some(&id));
                    }
                    Err(QuantityError::Unsatisfiable { .. }) => {
                        assert!(wait);
                        assert!(m.lease(id).is_none() && !m.waiting().contains(&id));
                    }
                    Err(QuantityError::Unavailable { .. }) => {
                        assert!(!wait);
                        assert!(m.lease(id).is_none(), "nothing granted");
                        let after: Vec<u64> = m.offers().iter().map(|u| u.allocated).collect();
                        assert_eq!(before, after, "a refusal took nothing");
                    }
                    Err(e) => panic!("request {id}: {e}"),
                }
            }
            Op::Renew(k) | Op::Release(k) | Op::BadToken(k) => {
                let live = m.leases();
                let waiting = m.waiting();
                let ids: Vec<LeaseId> = live.iter().map(|v| v.id).chain(waiting).collect();
                if ids.is_empty() {
                    continue;
                }
                let id = ids[k % ids.len()];
                match op {
                    Op::Renew(_) => match m.renew(now, id, &tok(id), None) {
                        Ok(v) => assert!(v.renewal_refused.is_none()),
                        Err(QuantityError::RenewalRefused { .. }) => {
                            assert!(m.lease(id).unwrap().renewal_refused.is_some())
                        }
                        Err(QuantityError::MaxTotalLeaseTime(_))
                        | Err(QuantityError::UnknownLease(_)) => {}
                        Err(e) => panic!("renew {id}: {e}"),
                    },
                    Op::Release(_) => events.extend(m.release(now, id, &tok(id)).unwrap()),
                    _ => {
                        let before = m.lease(id);
                        assert_eq!(
                            m.release(now, id, "forged"),
                            Err(QuantityError::BadToken(id))
                        );
                        assert_eq!(m.lease(id), before);
                    }
                }
            }
            Op::Advance(ms) => t += ms,
            Op::Restart => {
                let json = serde_json::to_string(&m.records()).unwrap();
                let recs: QuantityRecords = serde_json::from_str(&json).unwrap();
                let (m2, ev) = QuantityManager::restore(cfg(), recs, now).unwrap();
                assert_eq!(
                    m2.leases(),
                    m.leases(),
                    "leases survive a restart unchanged"
                );
                assert_eq!(m2.offers(), m.offers());
                let refused: Vec<Event> = m
                    .leases()
                    .into_iter()
                    .filter_map(|v| {
                        v.renewal_refused
                            .map(|offer| Event::RenewalRefused { id: v.id, offer })
                    })
                    .collect();
                assert_eq!(ev, refused, "the same non-renewal choices");
                m = m2;
            }
        }
        for e in &events {
            if let Event::Granted(v) = e {
                model.check_grant(&m, v);
            }
        }
        m.check_indices();
    }
    // Epilogue: keep renewing every lease not refused; the refused ones run out within one
    // max lease time, after which every offer is within its capacity.
    for _ in 0..7 {
        t += 10 * S;
        let now = at(t);
        for e in m.tick(now) {
            if let Event::Granted(v) = e {
                model.check_grant(&m, &v);
            }
        }
        for v in m.leases() {
            if v.renewal_refused.is_none() {
                let _ = m.renew(now, v.id, &tok(v.id), None);
            }
        }
        m.check_indices();
    }
    for u in m.offers() {
        assert!(
            u.allocated <= u.capacity,
            "over-allocated after non-renewals: {u:?}"
        );
    }
    assert!(m.leases().iter().all(|v| v.renewal_refused.is_none()));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn random_histories_keep_the_invariants(ops in prop::collection::vec(arb_op(), 1..60)) {
        run_history(ops);
    }
}

#[test]
fn a_journal_line_of_a_big_pool_carries_only_what_changed() {
    let mut m = mgr();
    for i in 0..1000 {
        m.upsert_offer(at(0), offer(&format!("o{i:04}"), 1))
            .unwrap();
    }
    for id in 1..=1000 {
        grant(&mut m, at(0), id, req(1));
    }
    // New since the records were last taken: the whole records.
    assert!(m.take_changes().is_none());
    let mut written = m.records();
    let whole = serde_json::to_vec(&written).unwrap().len();
    // One renewal, one release, one offer withdrawn: three records, not 2,000.
    m.renew(at(10), 7, &tok(7), None).unwrap();
    m.release(at(10), 8, &tok(8)).unwrap();
    m.remove_offer("o0999").unwrap();
    let c = m.take_changes().expect("changes, not the whole pool");
    assert_eq!(c.leases.keys().copied().collect::<Vec<_>>(), [7, 8]);
    assert!(c.leases[&8].is_none(), "the released lease is gone");
    assert_eq!(c.offers.keys().collect::<Vec<_>>(), ["o0999"]);
    let line = serde_json::to_vec(&c).unwrap().len();
    assert!(
        line * 100 < whole,
        "a change of 3 records took {line} bytes (the pool: {whole})"
    );
    // Applied to the records written before, they give the records now.
    written.apply(&c);
    assert_eq!(written, m.records());
    // Taken: nothing left to take.
    assert_eq!(m.take_changes(), Some(PoolChanges::default()));
}
