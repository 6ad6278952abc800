//! Shared/exclusive table tests, transition by transition, and a random-history property test
//! that is shown to fail with a planted bug.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError, TestRunner};
use std::collections::BTreeSet;

fn req(id: LeaseId, mode: Mode) -> Request {
    Request {
        id,
        resource: "w".into(),
        holder: format!("h{id}"),
        mode,
        min_version: 0,
    }
}

fn shared(id: LeaseId) -> Request {
    req(id, Mode::Shared)
}

fn excl(id: LeaseId) -> Request {
    req(id, Mode::Exclusive)
}

fn granted(a: Admission) -> Grant {
    match a {
        Admission::Granted(g) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn ids(grants: &[Grant]) -> Vec<LeaseId> {
    grants.iter().map(|g| g.id).collect()
}

#[test]
fn many_readers_share() {
    let mut t = SharedTable::new();
    let epochs: Vec<u64> = (1..=3)
        .map(|id| granted(t.acquire(shared(id)).unwrap()).epoch)
        .collect();
    assert_eq!(epochs, vec![1, 2, 3]);
    assert_eq!(t.holders("w").len(), 3);
    assert_eq!(t.version("w"), 0);
}

#[test]
fn one_writer_excludes_everyone() {
    let mut t = SharedTable::new();
    let g = granted(t.acquire(excl(1)).unwrap());
    assert_eq!((g.mode, g.epoch, g.version), (Mode::Exclusive, 1, 0));
    assert_eq!(t.acquire(excl(2)).unwrap(), Admission::Queued);
    assert_eq!(t.acquire(shared(3)).unwrap(), Admission::Queued);
    assert_eq!(t.holders("w"), vec![(1, Mode::Exclusive)]);
    let out = t.end(1).unwrap();
    assert_eq!(
        ids(&out.grants),
        vec![2],
        "FIFO: the earlier writer first, alone"
    );
    assert_eq!(out.grants[0].epoch, 2);
    let out = t.end(2).unwrap();
    assert_eq!(ids(&out.grants), vec![3]);
}

#[test]
fn writer_priority_blocks_new_readers() {
    let mut t = SharedTable::new();
    granted(t.acquire(shared(1)).unwrap());
    assert_eq!(t.acquire(excl(2)).unwrap(), Admission::Queued);
    // Held shared, but a writer waits: the new reader queues behind it.
    assert_eq!(t.acquire(shared(3)).unwrap(), Admission::Queued);
    assert_eq!(t.waiters("w").0, vec![2, 3]);
    assert_eq!(ids(&t.end(1).unwrap().grants), vec![2]);
    assert_eq!(ids(&t.end(2).unwrap().grants), vec![3]);
}

#[test]
fn readers_queued_before_a_writer_go_first_as_a_batch() {
    let mut t = SharedTable::new();
    granted(t.acquire(excl(1)).unwrap());
    for r in [shared(2), shared(3), excl(4), shared(5)] {
        assert_eq!(t.acquire(r).unwrap(), Admission::Queued);
    }
    assert_eq!(ids(&t.end(1).unwrap().grants), vec![2, 3]);
    assert!(t.end(2).unwrap().grants.is_empty());
    assert_eq!(ids(&t.end(3).unwrap().grants), vec![4]);
    assert_eq!(ids(&t.end(4).unwrap().grants), vec![5]);
}

#[test]
fn withdrawn_writer_unblocks_readers_behind_it() {
    let mut t = SharedTable::new();
    granted(t.acquire(shared(1)).unwrap());
    t.acquire(excl(2)).unwrap();
    t.acquire(shared(3)).unwrap();
    let out = t.end(2).unwrap();
    assert_eq!(
        out.ended,
        Ended::Waiter {
            id: 2,
            resource: "w".into()
        }
    );
    assert_eq!(ids(&out.grants), vec![3]);
}

#[test]
fn commit_bumps_the_version() {
    let mut t = SharedTable::new();
    granted(t.acquire(excl(1)).unwrap());
    t.acquire(shared(2)).unwrap();
    assert_eq!(t.commit(1), Ok(1));
    assert_eq!(t.commit(1), Ok(2));
    assert_eq!(t.commit(2), Err(SharedError::NotExclusive(2)), "a waiter");
    assert_eq!(t.commit(9), Err(SharedError::Unknown(9)));
    let out = t.end(1).unwrap();
    assert!(matches!(
        out.ended,
        Ended::Holder {
            commits: 2,
            version: 2,
            ..
        }
    ));
    assert_eq!(
        out.grants[0].version, 2,
        "readers see the committed version"
    );
    assert_eq!(t.commit(2), Err(SharedError::NotExclusive(2)), "a reader");
    assert_eq!(t.version("w"), 2);
}

#[test]
fn writer_killed_before_commit_leaves_the_version() {
    let mut t = SharedTable::new();
    granted(t.acquire(excl(1)).unwrap());
    t.commit(1).unwrap();
    t.end(1).unwrap();
    let g = granted(t.acquire(excl(2)).unwrap());
    assert_eq!(g.version, 1);
    // Killed (the core ends the lease the same way for every end reason).
    let out = t.end(2).unwrap();
    assert!(matches!(
        out.ended,
        Ended::Holder {
            commits: 0,
            version: 1,
            ..
        }
    ));
    assert_eq!(t.version("w"), 1);
    assert_eq!(granted(t.acquire(shared(3)).unwrap()).version, 1);
}

#[test]
fn min_version_waits_for_the_commit() {
    let mut t = SharedTable::new();
    let r = Request {
        min_version: 1,
        ..shared(1)
    };
    assert_eq!(t.acquire(r).unwrap(), Admission::Parked);
    // Parked readers do not block the writer that will produce the version.
    let w = granted(t.acquire(excl(2)).unwrap());
    assert_eq!(w.version, 0);
    assert_eq!(t.waiters("w"), (vec![], vec![1]));
    // A writer arriving later than the parked reader.
    assert_eq!(t.acquire(excl(3)).unwrap(), Admission::Queued);
    assert_eq!(t.commit(2), Ok(1));
    // Back in the FIFO at its arrival position: ahead of writer 3.
    assert_eq!(t.waiters("w"), (vec![1, 3], vec![]));
    let out = t.end(2).unwrap();
    assert_eq!(ids(&out.grants), vec![1]);
    assert_eq!(out.grants[0].version, 1);
    // Already reached: no wait.
    let r = Request {
        min_version: 1,
        ..shared(4)
    };
    assert_eq!(
        t.acquire(r).unwrap(),
        Admission::Queued,
        "writer 3 waits ahead"
    );
    assert_eq!(ids(&t.end(1).unwrap().grants), vec![3]);
    assert_eq!(ids(&t.end(3).unwrap().grants), vec![4]);
}

#[test]
fn parked_request_can_be_withdrawn() {
    let mut t = SharedTable::new();
    let r = Request {
        min_version: 5,
        ..shared(1)
    };
    assert_eq!(t.acquire(r).unwrap(), Admission::Parked);
    assert!(matches!(
        t.end(1).unwrap().ended,
        Ended::Waiter { id: 1, .. }
    ));
    assert_eq!(t.end(1), Err(SharedError::Unknown(1)));
}

#[test]
fn bad_requests_are_refused_without_change() {
    let mut t = SharedTable::new();
    granted(t.acquire(shared(1)).unwrap());
    assert_eq!(t.acquire(shared(1)), Err(SharedError::DuplicateId(1)));
    let r = Request {
        min_version: 1,
        ..excl(2)
    };
    assert_eq!(t.acquire(r), Err(SharedError::MinVersionOnExclusive));
    assert_eq!(t.holders("w"), vec![(1, Mode::Shared)]);
    assert_eq!(t.waiters("w"), (vec![], vec![]));
}

#[test]
fn restore_keeps_versions_epochs_and_holders() {
    let mut t = SharedTable::new();
    granted(t.acquire(excl(1)).unwrap());
    t.commit(1).unwrap();
    t.commit(1).unwrap();
    t.acquire(shared(2)).unwrap();
    let rec = t.snapshot();
    let json = serde_json::to_string(&rec).unwrap();
    let mut t2 = SharedTable::restore(serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(t2.version("w"), 2);
    assert_eq!(t2.epoch("w"), 1);
    assert_eq!(t2.holders("w"), vec![(1, Mode::Exclusive)]);
    assert_eq!(
        t2.waiters("w"),
        (vec![], vec![]),
        "waiters are not persisted"
    );
    assert_eq!(t2.commit(1), Ok(3), "the restored writer may still commit");
    t2.end(1).unwrap();
    let g = granted(t2.acquire(shared(3)).unwrap());
    assert_eq!((g.epoch, g.version), (2, 3), "epochs keep increasing");
}

#[test]
fn raise_epoch_only_raises() {
    let mut t = SharedTable::new();
    t.raise_epoch("w", 41);
    assert_eq!(granted(t.acquire(shared(1)).unwrap()).epoch, 42);
    t.raise_epoch("w", 10);
    assert_eq!(granted(t.acquire(shared(2)).unwrap()).epoch, 43);
    assert_eq!(t.epoch("w"), 43);
}

#[test]
fn restore_refuses_inconsistent_records() {
    let mut t = SharedTable::new();
    granted(t.acquire(excl(1)).unwrap());
    let mut rec = t.snapshot();
    let r = rec.resources.get_mut("w").unwrap();
    let mut other = r.holders[0].clone();
    other.id = 2;
    other.mode = Mode::Shared;
    r.holders.push(other);
    assert!(SharedTable::restore(rec.clone()).is_err());
    let r = rec.resources.get_mut("w").unwrap();
    r.holders.truncate(1);
    r.holders[0].epoch = 7;
    assert!(SharedTable::restore(rec.clone()).is_err());
    let r = rec.resources.get_mut("w").unwrap();
    r.holders.clear();
    r.epoch = u64::MAX;
    assert!(SharedTable::restore(rec).is_err());
}

// ---- random-history property test ----

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        res: u8,
        exclusive: bool,
        min_version: u64,
    },
    /// End a lease or withdraw a request: a live id picked by index, or (`true`) any id.
    End(bool, u8),
    /// Commit: a holder picked by index, or (`true`) any id.
    Commit(bool, u8),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..2, any::<bool>(), prop_oneof![3 => Just(0u64), 1 => 1u64..4])
            .prop_map(|(res, exclusive, mv)| Op::Acquire {
                res,
                exclusive,
                min_version: if exclusive { 0 } else { mv },
            }),
        3 => (prop::bool::weighted(0.1), any::<u8>()).prop_map(|(raw, i)| Op::End(raw, i)),
        2 => (prop::bool::weighted(0.1), any::<u8>()).prop_map(|(raw, i)| Op::Commit(raw, i)),
        1 => Just(Op::Restart),
    ]
}

fn histories() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..80)
}

/// What the checker knows about a waiting request.
#[derive(Debug, Clone)]
struct W {
    res: String,
    mode: Mode,
    min_version: u64,
    arrival: u64,
}

/// The reference view, built only from what the table reports.
#[derive(Debug, Default)]
struct Model {
    holders: BTreeMap<LeaseId, (String, Mode)>,
    waiting: BTreeMap<LeaseId, W>,
    version: BTreeMap<String, u64>,
    epoch: BTreeMap<String, u64>,
}

impl Model {
    fn version(&self, res: &str) -> u64 {
        self.version.get(res).copied().unwrap_or(0)
    }

    /// Applies one grant, checking it against everything the model knows.
    fn grant(&mut self, g: &Grant) -> Result<(), TestCaseError> {
        let w = self
            .waiting
            .remove(&g.id)
            .ok_or_else(|| TestCaseError::fail(format!("grant of {} not waiting", g.id)))?;
        prop_assert_eq!(&w.res, &g.resource);
        prop_assert_eq!(w.mode, g.mode);
        prop_assert_eq!(
            g.version,
            self.version(&g.resource),
            "grant reports the version"
        );
        prop_assert!(g.version >= w.min_version, "min_version violated");
        let last = self.epoch.get(&g.resource).copied().unwrap_or(0);
        prop_assert!(g.epoch > last, "epoch not increasing");
        self.epoch.insert(g.resource.clone(), g.epoch);
        let others: Vec<Mode> = self
            .holders
            .values()
            .filter(|(r, _)| *r == g.resource)
            .map(|(_, m)| *m)
            .collect();
        prop_assert!(
            !others.contains(&Mode::Exclusive),
            "granted {:?} while a writer holds {}",
            g.mode,
            g.resource
        );
        prop_assert!(
            g.mode == Mode::Shared || others.is_empty(),
            "writer granted while readers hold"
        );
        self.holders.insert(g.id, (g.resource.clone(), g.mode));
        Ok(())
    }

    fn parked(&self, w: &W) -> bool {
        w.min_version > self.version(&w.res)
    }

    /// The starvation bound: nobody granted in this step overtook an earlier unparked
    /// waiter, and no unparked waiter is left waiting with nothing blocking it.
    fn check_fairness(&self, granted: &[(LeaseId, u64, String)]) -> Result<(), TestCaseError> {
        for (id, arrival, res) in granted {
            for (wid, w) in &self.waiting {
                prop_assert!(
                    !(w.res == *res && w.arrival < *arrival && !self.parked(w)),
                    "{} overtook earlier waiter {}",
                    id,
                    wid
                );
            }
        }
        for res in self.version.keys() {
            let first = self
                .waiting
                .values()
                .filter(|w| w.res == *res && !self.parked(w))
                .min_by_key(|w| w.arrival);
            if let Some(w) = first {
                let modes: Vec<Mode> = self
                    .holders
                    .values()
                    .filter(|(r, _)| r == res)
                    .map(|(_, m)| *m)
                    .collect();
                let blocked = match w.mode {
                    Mode::Shared => modes.contains(&Mode::Exclusive),
                    Mode::Exclusive => !modes.is_empty(),
                };
                prop_assert!(
                    blocked,
                    "a waiter on {} waits with nothing blocking it",
                    res
                );
            }
        }
        Ok(())
    }
}

/// A live id by index, or any small id (possibly unknown) when `raw` or nothing is live.
fn pick(raw: bool, i: u8, live: &[LeaseId]) -> LeaseId {
    if raw || live.is_empty() {
        LeaseId::from(i % 32)
    } else {
        live[usize::from(i) % live.len()]
    }
}

/// Runs one history against the table (with the planted bug if asked) and checks it.
fn check_history(ops: &[Op], plant_bug: bool) -> Result<(), TestCaseError> {
    let mut t = SharedTable::new();
    t.plant_overlap_bug = plant_bug;
    let mut m = Model::default();
    for r in ["r0", "r1"] {
        m.version.insert(r.into(), 0);
    }
    let mut arrivals: BTreeMap<LeaseId, u64> = BTreeMap::new();
    let mut next_id: LeaseId = 0;
    for op in ops {
        let versions_before = m.version.clone();
        let mut grants = Vec::new();
        let mut committed: Option<String> = None;
        match op {
            Op::Acquire {
                res,
                exclusive,
                min_version,
            } => {
                next_id += 1;
                let mode = if *exclusive {
                    Mode::Exclusive
                } else {
                    Mode::Shared
                };
                let res = format!("r{res}");
                arrivals.insert(next_id, next_id);
                m.waiting.insert(
                    next_id,
                    W {
                        res: res.clone(),
                        mode,
                        min_version: *min_version,
                        arrival: next_id,
                    },
                );
                let a = t
                    .acquire(Request {
                        id: next_id,
                        resource: res.clone(),
                        holder: "h".into(),
                        mode,
                        min_version: *min_version,
                    })
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let parked = *min_version > m.version(&res);
                match a {
                    Admission::Granted(g) => grants.push(g),
                    Admission::Parked => prop_assert!(parked),
                    Admission::Queued => prop_assert!(!parked),
                }
            }
            Op::End(raw, i) => {
                let live: Vec<LeaseId> =
                    m.holders.keys().chain(m.waiting.keys()).copied().collect();
                let id = pick(*raw, *i, &live);
                let known = m.holders.contains_key(&id) || m.waiting.contains_key(&id);
                match t.end(id) {
                    Ok(out) => {
                        prop_assert!(known);
                        match out.ended {
                            Ended::Holder {
                                version, resource, ..
                            } => {
                                prop_assert!(m.holders.remove(&id).is_some());
                                prop_assert_eq!(
                                    version,
                                    m.version(&resource),
                                    "end moved the version"
                                );
                            }
                            Ended::Waiter { .. } => {
                                prop_assert!(m.waiting.remove(&id).is_some());
                            }
                        }
                        grants = out.grants;
                    }
                    Err(_) => prop_assert!(!known),
                }
            }
            Op::Commit(raw, i) => {
                let live: Vec<LeaseId> = m.holders.keys().copied().collect();
                let id = pick(*raw, *i, &live);
                let writer = match m.holders.get(&id) {
                    Some((res, Mode::Exclusive)) => Some(res.clone()),
                    _ => None,
                };
                match (t.commit(id), writer) {
                    (Ok(v), Some(res)) => {
                        prop_assert_eq!(v, m.version(&res) + 1);
                        m.version.insert(res.clone(), v);
                        committed = Some(res);
                    }
                    (Err(_), None) => {}
                    (r, w) => prop_assert!(false, "commit {:?} by writer {:?}", r, w),
                }
            }
            Op::Restart => {
                let json = serde_json::to_string(&t.snapshot()).unwrap();
                t = SharedTable::restore(serde_json::from_str(&json).unwrap())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                t.plant_overlap_bug = plant_bug;
                // Waiters belong to connections that a restart closes.
                m.waiting.clear();
            }
        }
        let mut granted = Vec::new();
        for g in &grants {
            m.grant(g)?;
            granted.push((g.id, arrivals[&g.id], g.resource.clone()));
        }
        m.check_fairness(&granted)?;
        // Versions only grow, only by commits, by exactly one; the table agrees.
        for (res, v) in &m.version {
            let before = versions_before[res];
            if committed.as_deref() == Some(res.as_str()) {
                prop_assert_eq!(*v, before + 1);
            } else {
                prop_assert_eq!(*v, before, "version moved without a commit");
            }
            prop_assert_eq!(t.version(res), *v);
            prop_assert_eq!(t.epoch(res), m.epoch.get(res).copied().unwrap_or(0));
            let hs: Vec<(LeaseId, Mode)> = m
                .holders
                .iter()
                .filter(|(_, (r, _))| r == res)
                .map(|(id, (_, mo))| (*id, *mo))
                .collect();
            prop_assert_eq!(t.holders(res), hs);
        }
        let waiting: BTreeSet<LeaseId> = m.waiting.keys().copied().collect();
        let mut in_table = BTreeSet::new();
        for res in m.version.keys() {
            let (q, p) = t.waiters(res);
            in_table.extend(q);
            in_table.extend(p);
        }
        prop_assert_eq!(in_table, waiting);
        // Parked exactly when the version is below the request's min_version.
        for res in m.version.keys() {
            let parked: BTreeSet<LeaseId> = t.waiters(res).1.into_iter().collect();
            let expect: BTreeSet<LeaseId> = m
                .waiting
                .iter()
                .filter(|(_, w)| w.res == *res && m.parked(w))
                .map(|(id, _)| *id)
                .collect();
            prop_assert_eq!(parked, expect, "parked set on {}", res);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Readers and a writer never overlap, versions only grow and only by commits,
    /// `min_version` is respected, epochs increase, and no waiter is overtaken or left
    /// waiting beyond the documented bound.
    #[test]
    fn random_histories_respect_the_invariants(ops in histories()) {
        check_history(&ops, false)?;
    }
}

/// The property test catches a planted bug (shared requests granted while a writer holds):
/// the same checker, over random histories, must find a failing one.
#[test]
fn property_test_catches_the_planted_overlap_bug() {
    let mut runner = TestRunner::new(PtConfig {
        cases: 400,
        failure_persistence: None,
        ..PtConfig::default()
    });
    let result = runner.run(&histories(), |ops| check_history(&ops, true));
    let err = result.expect_err("the planted bug went unnoticed");
    let msg = err.to_string();
    assert!(
        msg.contains("while a writer holds"),
        "unexpected failure: {msg}"
    );
}
