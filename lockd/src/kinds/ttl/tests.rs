//! TTL table tests: the eight tests of seed 000 rewritten against [`TtlTable`] (deadlock
//! detection is issue 12's and skipped here), plus what the seed could not do, and a
//! random-history property test.

use super::*;
use proptest::prelude::*;

const WALL0: u64 = 1_700_000_000_000;

/// A clock: `ms` milliseconds after `base` (mono) and after WALL0 (wall).
fn at(base: Instant, ms: u64) -> Now {
    Now {
        mono: base + Duration::from_millis(ms),
        unix_ms: WALL0 + ms,
    }
}

fn table() -> TtlTable {
    TtlTable::new(TtlConfig::default())
}

/// A request with epoch = id (the core's per-resource counter in real life).
fn req(id: LeaseId, resource: &str, holder: &str, token: &str, ttl: Duration) -> TtlRequest {
    TtlRequest {
        id,
        resource: resource.into(),
        holder: holder.into(),
        token: token.into(),
        epoch: id,
        ttl,
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Seed `test_acquire_held`: a fresh lease is Held (+1).
#[test]
fn acquire_is_held() {
    let b = Instant::now();
    let mut t = table();
    let info = t
        .acquire(req(1, "gpu0", "w1", "tok", secs(2)), at(b, 0))
        .result
        .unwrap();
    assert_eq!(info.deadline, b + secs(2));
    assert_eq!(info.epoch, 1);
    assert_eq!(info.expires_at_unix_ms, WALL0 + 2000);
    assert_eq!(t.state(1), LeaseState::Held);
    assert_eq!(t.state(1).ternary(), Some(1));
    assert_eq!(t.holder_of("gpu0"), Some(1));
    assert_eq!(t.token(1), Some("tok"));
}

/// Seed `test_expiry`: TTL 2 s, expired exactly at the deadline, not a millisecond before.
#[test]
fn expires_at_the_deadline() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(2)), at(b, 0));
    assert_eq!(t.next_deadline(), Some(b + secs(2)));
    assert!(t.tick(at(b, 1999)).is_empty());
    assert_eq!(t.state(1), LeaseState::Held);
    let ended = t.tick(at(b, 2000));
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].reason, EndReason::Expired);
    assert_eq!(ended[0].resource, "gpu0");
    assert_eq!(ended[0].ended_at_unix_ms, WALL0 + 2000);
    assert_eq!(t.state(1), LeaseState::Expired);
    assert_eq!(t.state(1).ternary(), Some(0));
    assert_eq!(t.next_deadline(), None);
    assert_eq!(t.holder_of("gpu0"), None);
    assert_eq!(t.counters().expired, 1);
}

/// A late tick stamps the end at the deadline, not at the tick.
#[test]
fn late_tick_stamps_the_deadline() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(2)), at(b, 0));
    let ended = t.tick(at(b, 5000));
    assert_eq!(ended[0].ended_at_unix_ms, WALL0 + 2000);
}

/// Seed `test_renew`: a renewal mid-life restarts the TTL; the lease survives past the first
/// deadline and ends at the renewed one.
#[test]
fn renew_extends() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(2)), at(b, 0));
    let info = t.renew(1, at(b, 1500)).result.unwrap();
    assert_eq!(info.deadline, b + Duration::from_millis(3500));
    assert_eq!(info.expires_at_unix_ms, WALL0 + 3500);
    assert_eq!(info.renewals, 1);
    assert!(t.tick(at(b, 3499)).is_empty());
    assert_eq!(t.state(1), LeaseState::Held);
    assert_eq!(t.tick(at(b, 3500)).len(), 1);
    assert_eq!(t.state(1), LeaseState::Expired);
    assert_eq!(t.counters().renewed, 1);
}

/// Seed `test_renew_expired_fails`: renew after expiry is refused, even when the driver has
/// not ticked yet (the renew's own `now` expires it first and reports the end).
#[test]
fn renew_after_expiry_is_refused() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(1)), at(b, 0));
    let out = t.renew(1, at(b, 1000));
    assert_eq!(
        out.result,
        Err(TtlError::Ended {
            id: 1,
            state: LeaseState::Expired
        })
    );
    assert_eq!(
        out.ended.len(),
        1,
        "the renew's implicit tick reports the expiry"
    );
    assert_eq!(t.state(1), LeaseState::Expired);
    // Still refused later, and re-acquire from scratch works with a new id.
    assert!(t.renew(1, at(b, 1001)).result.is_err());
    assert_eq!(t.counters().renewed, 0);
    let again = t.acquire(req(2, "gpu0", "w1", "", secs(1)), at(b, 1001));
    assert!(again.result.is_ok());
    // The old id is not reusable while its tombstone lives.
    let dup = t.acquire(req(1, "gpu1", "w1", "", secs(1)), at(b, 1001));
    assert_eq!(dup.result, Err(TtlError::DuplicateId(1)));
}

/// Seed `test_revoke`, corrected: a revoked lease is Revoked (−1), not Expired, with who and
/// why; the revocation counter counts it, the expiry counter does not.
#[test]
fn revoke_is_revoked_with_counter() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(10)), at(b, 0));
    let e = t
        .revoke(1, "admin", "wrong CUDA", at(b, 100))
        .result
        .unwrap();
    assert_eq!(e.reason.to_string(), "revoked:admin:wrong CUDA");
    assert_eq!(
        t.state(1),
        LeaseState::Revoked {
            by: "admin".into(),
            why: "wrong CUDA".into()
        }
    );
    assert_eq!(t.state(1).ternary(), Some(-1));
    let c = t.counters();
    assert_eq!((c.revoked, c.expired, c.released), (1, 0, 0));
    assert_eq!(t.active_count(), 0);
    assert_eq!(t.holder_of("gpu0"), None);
    assert_eq!(
        t.next_deadline(),
        None,
        "a revoked lease never expires later"
    );
    assert!(t.tick(at(b, 20_000)).is_empty());
    assert_eq!(t.counters().expired, 0);
    // Revoking again or renewing: refused with the state.
    assert!(matches!(
        t.revoke(1, "admin", "again", at(b, 200)).result,
        Err(TtlError::Ended { id: 1, .. })
    ));
    assert_eq!(t.counters().revoked, 1);
}

/// Seed `test_held_by`: a worker with 2 of 3 leases.
#[test]
fn held_by_lists_the_holders_leases() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(5)), at(b, 0));
    t.acquire(req(2, "gpu1", "w2", "", secs(5)), at(b, 0));
    t.acquire(req(3, "gpu2", "w1", "", secs(5)), at(b, 0));
    assert_eq!(t.held_by("w1"), vec![1, 3]);
    assert_eq!(t.held_by("w2"), vec![2]);
    assert!(t.held_by("w").is_empty());
    assert!(t.held_by("w10").is_empty());
    t.release(3, at(b, 1));
    assert_eq!(t.held_by("w1"), vec![1]);
}

/// Seed `test_active_count`: after a TTL-1 lease expires, one lease remains active.
#[test]
fn active_count_drops_on_expiry() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(1)), at(b, 0));
    t.acquire(req(2, "gpu1", "w2", "", secs(5)), at(b, 0));
    assert_eq!(t.active_count(), 2);
    t.tick(at(b, 1000));
    assert_eq!(t.active_count(), 1);
}

// Seed `test_deadlock_detection` is issue 12's (wait-for graph over all kinds): skipped here.

/// Exclusive per resource: a second acquire is refused with the holder, nothing changes.
#[test]
fn second_acquire_is_busy() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(5)), at(b, 0));
    let r = t
        .acquire(req(2, "gpu0", "w2", "", secs(5)), at(b, 1))
        .result;
    assert_eq!(
        r,
        Err(TtlError::Busy {
            resource: "gpu0".into(),
            holder: "w1".into(),
            lease: 1
        })
    );
    assert_eq!(t.state(2), LeaseState::Unknown);
    assert_eq!(t.counters().acquired, 1);
    assert_eq!(
        t.acquire(
            req(3, "gpu1", "w", "", Duration::from_micros(999)),
            at(b, 1)
        )
        .result,
        Err(TtlError::ZeroTtl)
    );
    assert_eq!(
        t.acquire(req(4, "gpu1", "w", "", Duration::MAX), at(b, 1))
            .result,
        Err(TtlError::TtlTooLong)
    );
}

/// With exclusivity off the table tracks lifetimes only: several leases on one resource.
#[test]
fn non_exclusive_table_tracks_lifetimes_only() {
    let b = Instant::now();
    let mut t = TtlTable::new(TtlConfig {
        exclusive_per_resource: false,
        ..TtlConfig::default()
    });
    t.acquire(req(1, "weights", "r1", "", secs(1)), at(b, 0));
    t.acquire(req(2, "weights", "r2", "", secs(2)), at(b, 0));
    assert_eq!(t.leases_on("weights").collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(t.tick(at(b, 1000)).len(), 1);
    assert_eq!(t.leases_on("weights").collect::<Vec<_>>(), vec![2]);
    let (t2, _) = TtlTable::restore(t.cfg, t.snapshot(), at(b, 1000)).unwrap();
    assert_eq!(t2.holder_of("weights"), Some(2));
}

/// Revoked, expired and released stay distinguishable after the lease is gone, and from an
/// id that never existed; so are their reasons in the tombstones.
#[test]
fn ended_states_stay_distinguishable() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "a", "w", "", secs(1)), at(b, 0));
    t.acquire(req(2, "b", "w", "", secs(10)), at(b, 0));
    t.acquire(req(3, "c", "w", "", secs(10)), at(b, 0));
    t.revoke(2, "ops", "drain", at(b, 10));
    t.release(3, at(b, 20));
    t.tick(at(b, 5000));
    assert_eq!(t.state(1), LeaseState::Expired);
    assert!(matches!(t.state(2), LeaseState::Revoked { .. }));
    assert_eq!(t.state(3), LeaseState::Released);
    assert_eq!(t.state(4), LeaseState::Unknown);
    assert_eq!(t.renew(4, at(b, 5000)).result, Err(TtlError::Unknown(4)));
    assert_eq!(
        t.tombstone(2).unwrap().reason.to_string(),
        "revoked:ops:drain"
    );
    let c = t.counters();
    assert_eq!((c.acquired, c.expired, c.revoked, c.released), (3, 1, 1, 1));
}

/// Tombstones are bounded in count (oldest forgotten first) and in age.
#[test]
fn tombstones_are_bounded() {
    let b = Instant::now();
    let mut t = TtlTable::new(TtlConfig {
        max_tombstones: 2,
        tombstone_max_age: secs(60),
        ..TtlConfig::default()
    });
    for id in 1..=3 {
        t.acquire(req(id, &format!("r{id}"), "w", "", secs(10)), at(b, id));
        t.release(id, at(b, 10 + id));
    }
    assert_eq!(t.tombstone_count(), 2);
    assert_eq!(t.state(1), LeaseState::Unknown, "oldest forgotten");
    assert_eq!(t.state(2), LeaseState::Released);
    // Age: ended at 12 and 13 ms; forgotten at 60.012 s / 60.013 s.
    t.tick(at(b, 60_011));
    assert_eq!(t.tombstone_count(), 2);
    t.tick(at(b, 60_012));
    assert_eq!(t.state(2), LeaseState::Unknown);
    assert_eq!(t.state(3), LeaseState::Released);
    t.tick(at(b, 60_013));
    assert_eq!(t.tombstone_count(), 0);
    // Counters are not tombstones: they keep everything.
    assert_eq!(t.counters().released, 3);
}

/// lockd restarted mid-TTL keeps the deadline: a lease acquired at wall T with TTL 10 s,
/// restored at T+4 s with a fresh monotonic clock, is held until exactly T+10 s.
#[test]
fn restore_keeps_deadlines() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "tok", secs(10)), at(b, 0));
    t.acquire(req(2, "gpu1", "w2", "", secs(3)), at(b, 0));
    t.acquire(req(3, "gpu2", "w3", "", secs(10)), at(b, 0));
    t.revoke(3, "ops", "x", at(b, 100));
    let rec = t.snapshot();
    let json = serde_json::to_string(&rec).unwrap();
    let rec: TtlRecords = serde_json::from_str(&json).unwrap();
    // The new process: another monotonic base, wall clock 4 s later.
    let b2 = Instant::now() + secs(1000);
    let now2 = Now {
        mono: b2,
        unix_ms: WALL0 + 4000,
    };
    let (mut t2, ended) = TtlTable::restore(TtlConfig::default(), rec, now2).unwrap();
    // Lease 2 (expiry T+3 s) passed during the downtime: expired, stamped at its expiry.
    assert_eq!(ended.len(), 1);
    assert_eq!((ended[0].id, ended[0].ended_at_unix_ms), (2, WALL0 + 3000));
    assert_eq!(t2.state(2), LeaseState::Expired);
    assert!(matches!(t2.state(3), LeaseState::Revoked { .. }));
    let info = t2.get(1).unwrap();
    assert_eq!(info.deadline, b2 + secs(6), "no time gained, none lost");
    assert_eq!(info.expires_at_unix_ms, WALL0 + 10_000);
    assert_eq!(t2.token(1), Some("tok"));
    assert_eq!(t2.get(1).unwrap().epoch, 1);
    assert_eq!(t2.tombstone(3).unwrap().epoch, 3);
    let wall2 = |ms: u64| Now {
        mono: b2 + Duration::from_millis(ms - 4000),
        unix_ms: WALL0 + ms,
    };
    assert!(t2.tick(wall2(9999)).is_empty());
    assert_eq!(t2.tick(wall2(10_000)).len(), 1);
    let c = t2.counters();
    assert_eq!((c.acquired, c.expired, c.revoked), (3, 2, 1));
}

/// A wall clock stepped backward during the downtime gives at most one TTL from the restart.
#[test]
fn restore_caps_remaining_at_the_ttl() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(10)), at(b, 0));
    let now2 = Now {
        mono: b,
        unix_ms: WALL0 - 3_600_000,
    };
    let (t2, _) = TtlTable::restore(TtlConfig::default(), t.snapshot(), now2).unwrap();
    assert_eq!(t2.get(1).unwrap().deadline, b + secs(10));
}

/// Inconsistent records are refused with an error, never a panic.
#[test]
fn restore_refuses_inconsistent_records() {
    let b = Instant::now();
    let mut t = table();
    t.acquire(req(1, "gpu0", "w1", "", secs(10)), at(b, 0));
    let mut rec = t.snapshot();
    let mut dup = rec.leases[0].clone();
    dup.id = 2;
    rec.leases.push(dup);
    assert!(TtlTable::restore(TtlConfig::default(), rec.clone(), at(b, 0)).is_err());
    rec.leases[1].resource = "gpu1".into();
    rec.leases[1].ttl_ms = 0;
    assert!(TtlTable::restore(TtlConfig::default(), rec.clone(), at(b, 0)).is_err());
    rec.leases[1].ttl_ms = u64::MAX;
    rec.leases[1].expires_at_unix_ms = u64::MAX;
    assert!(TtlTable::restore(TtlConfig::default(), rec, at(b, 0)).is_err());
}

// ---- property test over random histories ----

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        res: u8,
        holder: u8,
        ttl_ms: u64,
    },
    Renew(u8),
    Release(u8),
    Revoke(u8),
    /// Move the clock; with `true` the driver ticks, else the next call expires implicitly.
    Advance(u64, bool),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..3, 1u64..3000).prop_map(|(res, holder, ttl_ms)| Op::Acquire { res, holder, ttl_ms }),
        3 => any::<u8>().prop_map(Op::Renew),
        1 => any::<u8>().prop_map(Op::Release),
        1 => any::<u8>().prop_map(Op::Revoke),
        3 => (0u64..2000, any::<bool>()).prop_map(|(ms, tick)| Op::Advance(ms, tick)),
        1 => Just(Op::Restart),
    ]
}

/// What the model knows about one lease id.
#[derive(Debug, Clone, PartialEq)]
enum M {
    Held {
        res: String,
        holder: String,
        deadline_ms: u64,
        ttl_ms: u64,
    },
    Ended(LeaseState),
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// States agree with a reference model, at most one live lease per resource, counters add
    /// up, no renew ever succeeds after an end, and a restart changes nothing observable
    /// (the restart here keeps the wall/mono offset: the clock assumption holds).
    #[test]
    fn random_histories_stay_consistent(
        ops in proptest::collection::vec(op(), 1..60),
        exclusive in any::<bool>(),
    ) {
        let b = Instant::now();
        let mut t = TtlTable::new(TtlConfig {
            exclusive_per_resource: exclusive,
            max_tombstones: 1000,
            tombstone_max_age: secs(3600),
        });
        let mut now_ms = 0u64;
        let mut next_id: LeaseId = 0;
        let mut model: BTreeMap<LeaseId, M> = BTreeMap::new();
        let expire = |model: &mut BTreeMap<LeaseId, M>, now_ms: u64| {
            for m in model.values_mut() {
                if let M::Held { deadline_ms, .. } = m {
                    if *deadline_ms <= now_ms { *m = M::Ended(LeaseState::Expired); }
                }
            }
        };
        for op in ops {
            // Advance moves the clock first; only calls into the table expire anything.
            let calls_table = match op {
                Op::Advance(ms, tick) => {
                    now_ms += ms;
                    tick
                }
                _ => true,
            };
            let now = at(b, now_ms);
            let before = model.clone();
            if calls_table {
                expire(&mut model, now_ms);
            }
            let newly: BTreeSet<LeaseId> = model.iter()
                .filter(|(id, m)| matches!(m, M::Ended(_)) && !matches!(before[id], M::Ended(_)))
                .map(|(id, _)| *id).collect();
            let ended: Vec<Ended> = match op {
                Op::Acquire { res, holder, ttl_ms } => {
                    next_id += 1;
                    let (res, holder) = (format!("r{res}"), format!("h{holder}"));
                    let busy = exclusive && model.values().any(|m| matches!(m, M::Held { res: r, .. } if *r == res));
                    let out = t.acquire(req(next_id, &res, &holder, "", Duration::from_millis(ttl_ms)), now);
                    prop_assert_eq!(out.result.is_ok(), !busy);
                    if !busy {
                        model.insert(next_id, M::Held { res, holder, deadline_ms: now_ms + ttl_ms, ttl_ms });
                    }
                    out.ended
                }
                Op::Renew(id) => {
                    let id = LeaseId::from(id) % (next_id + 2);
                    let out = t.renew(id, now);
                    match model.get_mut(&id) {
                        Some(M::Held { deadline_ms, ttl_ms, .. }) => {
                            prop_assert!(out.result.is_ok());
                            *deadline_ms = now_ms + *ttl_ms;
                        }
                        _ => prop_assert!(out.result.is_err(), "renew after end succeeded"),
                    }
                    out.ended
                }
                Op::Release(id) | Op::Revoke(id) => {
                    let id = LeaseId::from(id) % (next_id + 2);
                    let revoke = matches!(op, Op::Revoke(_));
                    let out = if revoke { t.revoke(id, "ops", "why", now) } else { t.release(id, now) };
                    if matches!(model.get(&id), Some(M::Held { .. })) {
                        prop_assert!(out.result.is_ok());
                        let st = if revoke {
                            LeaseState::Revoked { by: "ops".into(), why: "why".into() }
                        } else { LeaseState::Released };
                        model.insert(id, M::Ended(st));
                    } else {
                        prop_assert!(out.result.is_err());
                    }
                    out.ended
                }
                Op::Advance(_, false) => Vec::new(),
                Op::Advance(_, true) => t.tick(now),
                Op::Restart => {
                    let rec: TtlRecords = serde_json::from_str(&serde_json::to_string(&t.snapshot()).unwrap()).unwrap();
                    let (t2, ended) = TtlTable::restore(t.cfg, rec, now).unwrap();
                    t = t2;
                    ended
                }
            };
            let got: BTreeSet<LeaseId> = ended.iter().map(|e| e.id).collect();
            prop_assert_eq!(got, newly);
            // States agree with the model.
            for (id, m) in &model {
                match m {
                    M::Held { res, holder, deadline_ms, .. } => {
                        prop_assert_eq!(t.state(*id), LeaseState::Held);
                        let info = t.get(*id).unwrap();
                        prop_assert_eq!(&info.resource, res);
                        prop_assert_eq!(&info.holder, holder);
                        prop_assert_eq!(info.deadline, b + Duration::from_millis(*deadline_ms));
                        prop_assert!(t.held_by(holder).contains(id));
                        prop_assert!(t.leases_on(res).any(|l| l == *id));
                    }
                    M::Ended(st) => prop_assert_eq!(&t.state(*id), st),
                }
            }
            let live = model.values().filter(|m| matches!(m, M::Held { .. })).count();
            for r in 0..3 {
                let res = format!("r{r}");
                let n = model.values().filter(|m| matches!(m, M::Held { res: x, .. } if *x == res)).count();
                prop_assert_eq!(t.leases_on(&res).count(), n);
                prop_assert!(!exclusive || n <= 1, "two live leases on {}", res);
            }
            prop_assert_eq!(t.active_count(), live);
            let c = t.counters();
            prop_assert_eq!(c.acquired, c.released + c.expired + c.revoked + live as u64);
            let count = |f: fn(&LeaseState) -> bool| model.values().filter(|m| matches!(m, M::Ended(s) if f(s))).count() as u64;
            prop_assert_eq!(c.expired, count(|s| *s == LeaseState::Expired));
            prop_assert_eq!(c.released, count(|s| *s == LeaseState::Released));
            prop_assert_eq!(c.revoked, count(|s| matches!(s, LeaseState::Revoked { .. })));
            let min = model.values().filter_map(|m| match m { M::Held { deadline_ms, .. } => Some(*deadline_ms), _ => None }).min();
            prop_assert_eq!(t.next_deadline(), min.map(|d| b + Duration::from_millis(d)));
        }
    }
}
