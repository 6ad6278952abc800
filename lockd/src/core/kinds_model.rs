//! Model-based property test of the core with every lease kind: random histories of
//! connects, TTL / shared / exclusive / quantity acquires, releases by resource and by id,
//! renewals, commits, revokes, offers that grow, shrink and go away, disconnects, time steps,
//! delayed persistence acknowledgements and crash-restarts from the last durable state.
//!
//! Checked after every input:
//! * **durable before visible**: a version-2 grant is sent only once a durable state covers
//!   it (its epoch and lease id; with group commit that state may already hold a later
//!   change of the same lease);
//! * **epochs** of new grants strictly increase per resource, across restarts;
//! * **TTL**: at most one live TTL lease per resource;
//! * **shared**: an exclusive holder holds alone (no reader beside a writer);
//! * **fairness of shared gangs**: no writer that arrived after a waiting shared gang holds
//!   one of its members (the fence of `core::fence`);
//! * **gangs**: a granted gang holds every member (its own leases), a waiting one none —
//!   for connection-bound exclusive gangs, TTL gangs and shared gangs (bound or timed); no
//!   member of a TTL/shared gang lives without its gang; a gang's grant is durable before
//!   it is sent and each member's epoch is above every earlier one of its resource;
//! * **quantity**: for every offer, the allocations of the leases whose renewals are not
//!   refused fit in its capacity, and a pool never allocates above what its offers had when
//!   the leases were granted (checked as: no offer's allocation exceeds the largest quantity
//!   it ever had);
//! * an acknowledged commit is never lost (across restarts too), and acknowledged versions
//!   strictly increase;
//! * nothing panics.
//!
//! Shown to catch planted bugs: a grant that is not persisted, a TTL acquire that ignores the
//! holder, shared admission that lets readers in beside a writer, a gang granted in part
//! (connection-bound, or TTL/shared: `kind_gang_partial`), a
//! wait-for graph that keeps the edge of a waiter that left.
//! * **deadlocks**: the wait-for graph says a session is deadlocked exactly when, from the
//!   lease table and the shared table, it reaches itself through "waits for a resource held
//!   by" (version-1 queues and gangs to version-1 holders; shared-kind queues to
//!   connection-bound shared-kind holders).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestRunner};

use super::{Config, Core, Input, Now, Output, PersistedState, Planted};
use crate::proto::{self, AcquireExt, Event, LeaseKind, Mode, PeerInfo, Request};

#[derive(Debug, Clone)]
enum Op {
    Connect(u64),
    Ttl(u64, u16, bool),
    Shared(u64, u8, bool, Option<u8>),
    Quantity(u64, u8, bool),
    Excl(u64, u8),
    Gang(u64, u8, bool),
    /// A gang of the version-2 kinds: client, member mask, shared (else TTL), timed (shared),
    /// with a timeout.
    KindGang(u64, u8, bool, bool, bool),
    Cross(u64, u8),
    ReleaseRes(u64, u8),
    ReleaseId(u64, u8),
    Renew(u64, u8),
    Commit(u64, u8),
    RevokeId(u8),
    Resume(u64, u8),
    Offer(u8, u8),
    Withdraw(u8),
    Disconnect(u64),
    Advance(u16),
    Ack,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let c = 1u64..5;
    let pick = any::<u8>();
    prop_oneof![
        3 => c.clone().prop_map(Op::Connect),
        4 => (c.clone(), 50u16..800, any::<bool>()).prop_map(|(c, t, w)| Op::Ttl(c, t, w)),
        5 => (c.clone(), 0u8..2, any::<bool>(), proptest::option::of(0u8..3))
            .prop_map(|(c, r, sh, mv)| Op::Shared(c, r, sh, mv)),
        4 => (c.clone(), 1u8..5, any::<bool>()).prop_map(|(c, q, w)| Op::Quantity(c, q, w)),
        2 => (c.clone(), 0u8..2).prop_map(|(c, r)| Op::Excl(c, r)),
        2 => (c.clone(), 1u8..4, any::<bool>()).prop_map(|(c, m, w)| Op::Gang(c, m, w)),
        3 => (c.clone(), 1u8..4, any::<bool>(), any::<bool>(), any::<bool>())
            .prop_map(|(c, m, sh, t, w)| Op::KindGang(c, m, sh, t, w)),
        2 => (c.clone(), 0u8..2).prop_map(|(c, r)| Op::Cross(c, r)),
        2 => (c.clone(), 0u8..6).prop_map(|(c, r)| Op::ReleaseRes(c, r)),
        3 => (c.clone(), pick).prop_map(|(c, p)| Op::ReleaseId(c, p)),
        3 => (c.clone(), pick).prop_map(|(c, p)| Op::Renew(c, p)),
        3 => (c.clone(), pick).prop_map(|(c, p)| Op::Commit(c, p)),
        1 => pick.prop_map(Op::RevokeId),
        1 => (c.clone(), pick).prop_map(|(c, p)| Op::Resume(c, p)),
        2 => (0u8..3, 0u8..5).prop_map(|(o, q)| Op::Offer(o, q)),
        1 => (0u8..3).prop_map(Op::Withdraw),
        3 => c.prop_map(Op::Disconnect),
        3 => (0u16..700).prop_map(Op::Advance),
        5 => Just(Op::Ack),
        1 => Just(Op::Restart),
    ]
}

/// Resource names by index: two TTL ones, two shared-kind ones, the pool, two exclusive ones.
const SHARED: [&str; 2] = ["s0", "s1"];
const EXCL: [&str; 2] = ["x0", "x1"];
const ALL: [&str; 6] = ["t", "s0", "p", "x0", "x1", "t1"];
/// The members of TTL gangs (`t` also takes single TTL acquires).
const TTLS: [&str; 2] = ["t", "t1"];

struct Model {
    core: Core,
    planted: Planted,
    plant_overlap: bool,
    base: Instant,
    ms: u64,
    durable: PersistedState,
    unwritten: Option<(u64, PersistedState)>,
    /// The state as the journal has it: the last whole snapshot written plus every delta
    /// since (None after a start: the first write is a whole snapshot).
    journaled: Option<PersistedState>,
    connected: BTreeSet<u64>,
    generation: BTreeMap<u64, u64>,
    /// Every version-2 grant seen: lease id -> (token, resource).
    grants: BTreeMap<u64, (String, String)>,
    last_epoch: BTreeMap<String, u64>,
    /// Largest quantity each offer ever had.
    offer_max: BTreeMap<String, u32>,
    versions: BTreeMap<String, u64>,
    steps: u64,
    /// Held version-2 leases the invariants looked at (summed over steps).
    held_seen: u64,
    /// Deadlocked sessions the graph check confirmed (summed over steps).
    deadlock_checks: u64,
    /// Grants of TTL / shared gangs seen, by kind (TTL, shared).
    kind_gangs: (u64, u64),
    /// Deadlocked sessions the graph check confirmed that wait in a shared-kind queue.
    shared_cycles: u64,
}

fn peer() -> PeerInfo {
    PeerInfo {
        transport: "unix".into(),
        pid: Some(1),
        ..PeerInfo::default()
    }
}

fn cfg() -> Config {
    Config {
        reconnect_window: Duration::from_millis(500),
        max_lease_time: Duration::from_millis(1000),
        max_total_lease_time: Duration::from_millis(2500),
        ..Config::default()
    }
}

impl Model {
    fn new(planted: Planted, plant_overlap: bool) -> Model {
        let base = Instant::now();
        let mut m = Model {
            core: Core::new(
                cfg(),
                PersistedState::default(),
                Now {
                    mono: base,
                    unix_ms: 0,
                },
                1,
            )
            .expect("empty state"),
            planted,
            plant_overlap,
            base,
            ms: 0,
            durable: PersistedState::default(),
            unwritten: None,
            journaled: None,
            connected: BTreeSet::new(),
            generation: BTreeMap::new(),
            grants: BTreeMap::new(),
            last_epoch: BTreeMap::new(),
            offer_max: BTreeMap::new(),
            versions: BTreeMap::new(),
            steps: 0,
            held_seen: 0,
            deadlock_checks: 0,
            kind_gangs: (0, 0),
            shared_cycles: 0,
        };
        m.plant();
        m
    }

    fn plant(&mut self) {
        self.core.planted = self.planted;
        if self.plant_overlap {
            self.core.shared.plant_overlap_bug();
        }
    }

    fn now(&self) -> Now {
        Now {
            mono: self.base + Duration::from_millis(self.ms),
            unix_ms: self.ms,
        }
    }

    fn sid(&self, c: u64) -> u64 {
        c * 1000 + self.generation.get(&c).copied().unwrap_or(0)
    }

    /// The `pick`-th lease id granted so far (in id order), with its token and resource.
    fn pick(&self, p: u8) -> Option<(u64, String, String)> {
        if self.grants.is_empty() {
            return None;
        }
        let i = usize::from(p) % self.grants.len();
        self.grants
            .iter()
            .nth(i)
            .map(|(id, (t, r))| (*id, t.clone(), r.clone()))
    }

    fn step(&mut self, i: Input) -> Result<(), TestCaseError> {
        let outs = self.core.step(self.now(), i);
        for o in outs {
            match o {
                Output::Persist { seq } => {
                    let snap = self.core.snapshot();
                    // The driver writes whole snapshots from the borrowed view: same bytes.
                    let view = serde_json::to_string(&self.core.snapshot_view());
                    let whole = serde_json::to_string(&snap);
                    prop_assert!(
                        view.is_ok() && view.as_ref().ok() == whole.as_ref().ok(),
                        "the snapshot view serializes unlike the snapshot:\n{view:?}\n{whole:?}"
                    );
                    // Now and then the driver writes a whole snapshot instead (compaction,
                    // a large change): the notes are dropped and the journal starts over.
                    if self.steps % 7 == 3 {
                        self.journaled = None;
                    }
                    check_delta(&mut self.core, &mut self.journaled, &snap)?;
                    self.unwritten = Some((seq, snap));
                }
                Output::Send { session, event } => self.check_send(session, event)?,
                Output::Notice { .. } => {}
            }
        }
        self.steps += 1;
        self.check_state()
    }

    fn check_send(&mut self, s: u64, ev: Event) -> Result<(), TestCaseError> {
        if !self.connected.contains(&s) {
            return Ok(());
        }
        if let Event::Granted {
            resource,
            epoch,
            token,
            reclaimed,
            lease,
            ..
        } = ev
        {
            let Some(id) = lease.lease_id else {
                return Ok(()); // version-1 grants: the other model test's business
            };
            // Group commit: the written state may already hold a later change (the lease
            // released again); it must cover the grant: its epoch and its lease id.
            let durable = self.durable.resources.get(&resource).map_or(0, |r| r.epoch);
            prop_assert!(
                durable >= epoch && self.durable.last_lease_id >= id,
                "lease {id} ({resource}@{epoch}) sent before it was durable"
            );
            if !reclaimed {
                let last = self.last_epoch.get(&resource).copied().unwrap_or(0);
                prop_assert!(epoch > last, "{resource}: epoch {epoch} after {last}");
                self.last_epoch.insert(resource.clone(), epoch);
            }
            self.grants.insert(id, (token, resource));
        } else if let Event::GangGranted {
            gang_id,
            token,
            members,
            kind,
            ..
        } = ev
        {
            match kind {
                Some(LeaseKind::Ttl) => self.kind_gangs.0 += 1,
                Some(LeaseKind::Shared) => self.kind_gangs.1 += 1,
                _ => {}
            }
            for m in members {
                let Some(id) = m.lease_id else {
                    continue; // a connection-bound exclusive gang: version 1's leases
                };
                let durable = self
                    .durable
                    .resources
                    .get(&m.resource)
                    .map_or(0, |r| r.epoch);
                prop_assert!(
                    durable >= m.epoch && self.durable.last_lease_id >= id,
                    "gang {gang_id} member {id} ({}@{}) sent before it was durable",
                    m.resource,
                    m.epoch
                );
                let last = self.last_epoch.get(&m.resource).copied().unwrap_or(0);
                prop_assert!(
                    m.epoch > last,
                    "{}: epoch {} after {last}",
                    m.resource,
                    m.epoch
                );
                self.last_epoch.insert(m.resource.clone(), m.epoch);
                self.grants.insert(id, (token.clone(), m.resource));
            }
        } else if let Event::Committed {
            resource, version, ..
        } = ev
        {
            let was = self.versions.insert(resource.clone(), version).unwrap_or(0);
            // Greater, not +1: a commit whose answer went to a closed connection is untold.
            prop_assert!(version > was, "{resource}: commit to {version} after {was}");
        }
        Ok(())
    }

    fn check_state(&mut self) -> Result<(), TestCaseError> {
        let st = self.core.status(self.now(), true);
        let mut ttl_holders: BTreeMap<String, usize> = BTreeMap::new();
        let mut shared: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let mut alloc: BTreeMap<String, u64> = BTreeMap::new();
        for l in st.leases.iter().filter(|l| l.state == "held") {
            let r = l.resource.clone().unwrap_or_default();
            match l.kind {
                Some(LeaseKind::Ttl) => *ttl_holders.entry(r).or_default() += 1,
                Some(LeaseKind::Shared) => {
                    let e = shared.entry(r).or_default();
                    match l.lease.mode {
                        Some(Mode::Exclusive) => e.0 += 1,
                        _ => e.1 += 1,
                    }
                }
                Some(LeaseKind::Quantity) if l.renewal_refused.is_none() => {
                    for a in l.lease.allocations.iter().flatten() {
                        *alloc.entry(a.offer.clone()).or_default() += u64::from(a.quantity);
                    }
                }
                _ => {}
            }
        }
        self.held_seen += st.leases.iter().filter(|l| l.state == "held").count() as u64;
        for (r, n) in ttl_holders {
            prop_assert!(n <= 1, "{r}: {n} live TTL leases");
        }
        for (r, (w, readers)) in shared {
            prop_assert!(
                w == 0 || (w == 1 && readers == 0),
                "{r}: {w} writers beside {readers} readers"
            );
        }
        for pool in &st.pools {
            for o in &pool.offers {
                let used = alloc.get(&o.name).copied().unwrap_or(0);
                prop_assert!(
                    used <= o.capacity,
                    "offer {}: {used} allocated to renewable leases, capacity {}",
                    o.name,
                    o.capacity
                );
                let max = self.offer_max.get(&o.name).copied().unwrap_or(0);
                prop_assert!(
                    o.allocated <= u64::from(max),
                    "offer {} over-allocated",
                    o.name
                );
            }
        }
        // The wait-for graph agrees with a from-scratch look at the table: a session is
        // deadlocked iff it reaches itself through "waits for a resource held by".
        let mut edges: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
        for res in self.core.table.resources.values() {
            if let super::table::LeaseState::Held(l) = &res.lease {
                for w in res.waiters.iter() {
                    if w.session != l.session {
                        edges.entry(w.session).or_default().insert(l.session);
                    }
                }
            }
        }
        // Shared-kind resources: the session of every queued request waits for the session
        // of every connection-bound holder (itself included: a reader that queues for a
        // write of what it reads waits for itself).
        let mut shared_waiters = BTreeSet::new();
        for r in SHARED {
            let holders: Vec<u64> = self
                .core
                .shared
                .holders(r)
                .iter()
                .filter_map(|(id, _)| self.core.kl.get(id))
                .filter(|l| l.bound && l.reclaim_deadline.is_none())
                .filter_map(|l| l.session)
                .collect();
            // Waiting shared gangs: on a member where a writer holds, or one that arrived
            // before the gang waits.
            let gang_waits: Vec<u64> = self
                .core
                .shared_gang_waits
                .get(r)
                .into_iter()
                .flatten()
                .copied()
                .filter(|id| !self.core.shared.admits_gang_reader(r, *id))
                .collect();
            // The oldest waiting gang's fence: every writer queued after it waits for it
            // (none when the fence is planted away: the fairness check must catch that).
            let fence = self
                .core
                .shared_gang_waits
                .get(r)
                .filter(|_| !self.core.planted.shared_gang_unfenced)
                .and_then(|q| q.first())
                .and_then(|id| self.core.kl.get(id).map(|l| (*id, l.session)));
            if let Some((f, Some(gs))) = fence {
                for id in self.core.shared.waiters(r).0 {
                    let Some(l) = self.core.kl.get(&id) else {
                        continue;
                    };
                    if id > f && l.mode == Some(Mode::Exclusive) {
                        if let Some(w) = l.session {
                            edges.entry(w).or_default().insert(gs);
                        }
                    }
                }
            }
            for id in self.core.shared.waiters(r).0.into_iter().chain(gang_waits) {
                if let Some(w) = self.core.kl.get(&id).and_then(|l| l.session) {
                    edges.entry(w).or_default().extend(holders.iter().copied());
                    if !holders.is_empty() {
                        shared_waiters.insert(w);
                    }
                }
            }
        }
        for &s in edges.keys() {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<u64> = edges[&s].iter().copied().collect();
            let mut cyclic = false;
            while let Some(n) = stack.pop() {
                if n == s {
                    cyclic = true;
                    break;
                }
                if seen.insert(n) {
                    stack.extend(edges.get(&n).into_iter().flatten().copied());
                }
            }
            prop_assert_eq!(
                self.core.waitfor.is_deadlocked(s),
                cyclic,
                "session {} deadlocked per the graph vs the table",
                s
            );
            self.deadlock_checks += u64::from(cyclic);
            self.shared_cycles += u64::from(cyclic && shared_waiters.contains(&s));
        }
        // Fairness of shared gangs: no writer that arrived after a waiting shared gang
        // holds one of its members (the fence, `core::fence`).
        for r in SHARED {
            if let Some(f) = self.core.shared_gang_waits.get(r).and_then(|q| q.first()) {
                for (id, mode) in self.core.shared.holders(r) {
                    prop_assert!(
                        !(mode == crate::kinds::shared::Mode::Exclusive && id > *f),
                        "writer {id} on {r} granted ahead of the waiting shared gang member {f}"
                    );
                }
            }
        }
        // No gang is held in part: a granted gang holds every member, with its own leases.
        for (id, g) in &self.core.gangs {
            if g.granted {
                for m in &g.members {
                    let ok = matches!(
                        self.core.table.resources.get(m).map(|r| &r.lease),
                        Some(super::table::LeaseState::Held(l)) if l.gang == Some(*id) && l.session == g.session
                    );
                    prop_assert!(ok, "gang {id} granted without its member {m}");
                }
            } else {
                for m in &g.members {
                    let held = matches!(
                        self.core.table.resources.get(m).map(|r| &r.lease),
                        Some(super::table::LeaseState::Held(l)) if l.gang == Some(*id)
                    );
                    prop_assert!(!held, "waiting gang {id} holds {m} in part");
                }
            }
        }
        // Gangs of the version-2 kinds: a granted one holds every member (each a live
        // lease of its kind), a waiting one none, and no member lives without its gang.
        for (id, g) in &self.core.kgangs {
            for m in &g.members {
                let l = self.core.kl.get(m);
                let held = l.is_some_and(|l| l.granted)
                    && match g.kind {
                        // (The planted TTL bug grants in the registry only.)
                        LeaseKind::Ttl => {
                            self.planted.ttl_ignores_holder || self.core.ttl.get(*m).is_some()
                        }
                        _ => self.core.shared.is_holder(*m),
                    };
                if g.granted {
                    prop_assert!(held, "gang {id} granted without its member {m}");
                } else {
                    prop_assert!(!held, "waiting gang {id} holds {m} in part");
                }
            }
        }
        for (id, l) in &self.core.kl {
            if let Some(g) = l.gang {
                prop_assert!(
                    self.core
                        .kgangs
                        .get(&g)
                        .is_some_and(|x| x.members.contains(id)),
                    "gang member {id} lives without its gang {g}"
                );
            }
        }
        for r in SHARED {
            let v = self.core.shared.version(r);
            let told = self.versions.get(r).copied().unwrap_or(0);
            prop_assert!(
                v >= told,
                "{r}: version {v} below the acknowledged commit {told}"
            );
        }
        // Last (after the invariants, which the planted bugs must trip): each resource shows the kind `kind_in_use` says, and the summary shows what the
        // full report shows, its name lists cut to their first names and counted.
        let sum = self.core.status(self.now(), false);
        prop_assert_eq!(sum.resources.len(), st.resources.len());
        let cap = proto::STATUS_SUMMARY_NAMES;
        for (f, s) in st.resources.iter().zip(&sum.resources) {
            let want = self
                .core
                .kind_in_use(&f.name)
                .filter(|k| *k != LeaseKind::Exclusive);
            let p = self.core.planted;
            let planted = p.grant_not_persisted
                || p.ttl_ignores_holder
                || p.gang_partial
                || p.kind_gang_partial
                || p.stale_wait_edges;
            if planted {
                // A planted bug leaves the kinds' tables inconsistent on purpose.
            } else if f.kind.is_some() {
                prop_assert_eq!(f.kind, want, "{}", f.name);
            } else if want.is_some() {
                // In use without a lease (a pool's offers alone): shown free.
                prop_assert!(
                    f.state == proto::LeaseState::Free && f.waiters.is_empty(),
                    "{}: {:?}",
                    f.name,
                    f
                );
            }
            let mut cut = f.clone();
            cut.waiters.truncate(cap);
            cut.holders.truncate(cap);
            cut.waiter_count = Some(f.waiters.len());
            cut.holder_count =
                (f.kind.is_some() && f.kind != Some(LeaseKind::Ttl)).then_some(f.holders.len());
            prop_assert_eq!(&cut, s);
        }
        Ok(())
    }

    fn req(&mut self, c: u64, req: Request) -> Result<(), TestCaseError> {
        let s = self.sid(c);
        if !self.connected.contains(&s) {
            return Ok(());
        }
        self.step(Input::Request { session: s, req })
    }

    fn run(&mut self, op: Op) -> Result<(), TestCaseError> {
        let acquire = |r: &str, h: u64, wait: bool, ext: AcquireExt| Request::Acquire {
            resource: r.into(),
            holder: format!("h{h}"),
            wait,
            ext,
        };
        match op {
            Op::Connect(c) => {
                if !self.connected.contains(&self.sid(c)) {
                    *self.generation.entry(c).or_insert(0) += 1;
                    let s = self.sid(c);
                    self.connected.insert(s);
                    self.step(Input::Connect {
                        session: s,
                        peer: peer(),
                    })?;
                }
            }
            Op::Ttl(c, t, w) => {
                let ext = AcquireExt {
                    ttl_ms: Some(u64::from(t)),
                    ..AcquireExt::default()
                };
                self.req(c, acquire("t", c, w, ext))?;
            }
            Op::Shared(c, r, sh, mv) => {
                let ext = AcquireExt {
                    mode: Some(if sh { Mode::Shared } else { Mode::Exclusive }),
                    min_version: if sh { mv.map(u64::from) } else { None },
                    ttl_ms: (r == 1).then_some(300),
                    ..AcquireExt::default()
                };
                self.req(c, acquire(SHARED[usize::from(r)], c, true, ext))?;
            }
            Op::Quantity(c, q, w) => {
                let ext = AcquireExt {
                    quantity: Some(u32::from(q)),
                    ttl_ms: Some(400),
                    ..AcquireExt::default()
                };
                self.req(c, acquire("p", c, w, ext))?;
            }
            Op::Excl(c, r) => self.req(
                c,
                Request::acquire(EXCL[usize::from(r)], format!("h{c}"), true),
            )?,
            Op::Cross(c, r) => {
                // Hold one, then wait for the other: two clients doing it the other way
                // round deadlock.
                let (a, b) = (EXCL[usize::from(r)], EXCL[1 - usize::from(r)]);
                self.req(c, Request::acquire(a, format!("h{c}"), true))?;
                self.req(c, Request::acquire(b, format!("h{c}"), true))?;
            }
            Op::Gang(c, mask, w) => {
                let ext = AcquireExt {
                    gang: Some(masked(&EXCL, mask)),
                    timeout_ms: w.then_some(600),
                    ..AcquireExt::default()
                };
                self.req(c, acquire("g", c, true, ext))?;
            }
            Op::KindGang(c, mask, sh, timed, w) => {
                let names = if sh { SHARED } else { TTLS };
                let ext = AcquireExt {
                    gang: Some(masked(&names, mask)),
                    mode: sh.then_some(Mode::Shared),
                    ttl_ms: (!sh || timed).then_some(350),
                    timeout_ms: w.then_some(600),
                    ..AcquireExt::default()
                };
                self.req(c, acquire(if sh { "gs" } else { "gt" }, c, true, ext))?;
            }
            Op::ReleaseRes(c, r) => self.req(c, Request::release(ALL[usize::from(r)]))?,
            Op::ReleaseId(c, p) => {
                if let Some((id, token, _)) = self.pick(p) {
                    self.req(
                        c,
                        Request::Release {
                            resource: None,
                            lease_id: Some(id),
                            token: Some(token),
                        },
                    )?;
                }
            }
            Op::Renew(c, p) => {
                if let Some((id, token, _)) = self.pick(p) {
                    self.req(
                        c,
                        Request::Renew {
                            lease_id: id,
                            token,
                            ttl_ms: None,
                        },
                    )?;
                }
            }
            Op::Commit(c, p) => {
                if let Some((id, token, _)) = self.pick(p) {
                    self.req(
                        c,
                        Request::Commit {
                            lease_id: id,
                            token,
                        },
                    )?;
                }
            }
            Op::Resume(c, p) => {
                if let Some((id, token, _)) = self.pick(p) {
                    self.req(
                        c,
                        Request::Resume {
                            lease_id: id,
                            token,
                        },
                    )?;
                }
            }
            Op::RevokeId(p) => {
                if let Some((id, _, _)) = self.pick(p) {
                    let c = *self.generation.keys().next().unwrap_or(&1);
                    self.req(
                        c,
                        Request::Revoke {
                            resource: None,
                            lease_id: Some(id),
                            reason: Some("model".into()),
                            admin_token: None,
                        },
                    )?;
                }
            }
            Op::Offer(o, q) => {
                let name = format!("o{o}");
                let c = *self.generation.keys().next().unwrap_or(&1);
                if self.connected.contains(&self.sid(c)) {
                    let max = self.offer_max.entry(name.clone()).or_default();
                    *max = (*max).max(u32::from(q));
                }
                self.req(
                    c,
                    Request::Offer {
                        pool: "p".into(),
                        name,
                        quantity: u32::from(q),
                        attributes: BTreeMap::new(),
                        max_lease_time_ms: None,
                        requirements: None,
                        admin_token: None,
                    },
                )?;
            }
            Op::Withdraw(o) => {
                let c = *self.generation.keys().next().unwrap_or(&1);
                self.req(
                    c,
                    Request::Withdraw {
                        pool: "p".into(),
                        name: format!("o{o}"),
                        admin_token: None,
                    },
                )?;
            }
            Op::Disconnect(c) => {
                let s = self.sid(c);
                if self.connected.remove(&s) {
                    self.step(Input::Disconnect { session: s })?;
                }
            }
            Op::Advance(ms) => {
                self.ms += u64::from(ms);
                self.step(Input::Tick)?;
            }
            Op::Ack => {
                if let Some((seq, state)) = self.unwritten.take() {
                    self.durable = state;
                    self.step(Input::Persisted { seq })?;
                }
            }
            Op::Restart => {
                // The written state must always be readable: round-trip it through JSON.
                let bytes = serde_json::to_vec(&self.durable).map_err(|e| {
                    TestCaseError::fail(format!("durable state does not serialize: {e}"))
                })?;
                let (st, _) = super::decode_state(&bytes)
                    .map_err(|e| TestCaseError::fail(format!("durable state refused: {e}")))?;
                self.core = Core::new(cfg(), st, self.now(), self.ms)
                    .map_err(|e| TestCaseError::fail(format!("restore refused: {e}")))?;
                self.plant();
                self.unwritten = None;
                self.journaled = None;
                self.connected.clear();
            }
        }
        Ok(())
    }
}

/// The names whose bit is set in `mask` (a gang's members).
fn masked(names: &[&str], mask: u8) -> Vec<String> {
    names
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, r)| r.to_string())
        .collect()
}

/// At a write: the delta the core hands over, through its journal line (serialized and read
/// back), applied to the state last written must give the core's whole snapshot. The first
/// write after a start writes the whole snapshot (and drops the notes), as the driver does.
pub(crate) fn check_delta(
    core: &mut Core,
    journaled: &mut Option<PersistedState>,
    snap: &PersistedState,
) -> Result<(), TestCaseError> {
    if journaled.is_none() {
        core.drop_delta();
    }
    let delta = core.take_delta();
    // As written to disk: the fields that are not persisted (sessions) are dropped.
    let snap: PersistedState = serde_json::to_vec(snap)
        .and_then(|b| serde_json::from_slice(&b))
        .map_err(|e| TestCaseError::fail(format!("snapshot does not round-trip: {e}")))?;
    let Some(st) = journaled.as_mut() else {
        *journaled = Some(snap);
        return Ok(());
    };
    let line = serde_json::to_string(&delta)
        .map_err(|e| TestCaseError::fail(format!("delta does not serialize: {e}")))?;
    let back: super::StateDelta = serde_json::from_str(&line)
        .map_err(|e| TestCaseError::fail(format!("journal line refused: {e}: {line}")))?;
    back.apply(st)
        .map_err(|e| TestCaseError::fail(format!("delta refused: {e}")))?;
    if *st != snap {
        let (a, b) = (
            serde_json::to_value(&*st).unwrap_or_default(),
            serde_json::to_value(&snap).unwrap_or_default(),
        );
        let diff: Vec<String> = match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => b
                .iter()
                .filter(|(k, v)| a.get(*k) != Some(*v))
                .map(|(k, v)| format!("{k}: journal {:?} vs snapshot {v}", a.get(k)))
                .chain(
                    a.keys()
                        .filter(|k| !b.contains_key(*k))
                        .map(|k| format!("{k}: only in the journal")),
                )
                .collect(),
            _ => vec![],
        };
        return Err(TestCaseError::fail(format!(
            "snapshot + journal differs from the core's state: {diff:?} (delta {line})"
        )));
    }
    Ok(())
}

fn run_histories(cases: u32, planted: Planted, overlap: bool) -> Result<u64, String> {
    let config = PtConfig {
        cases,
        failure_persistence: None,
        ..PtConfig::default()
    };
    // A planted bug must be caught every time: those runs use a fixed seed (the clean run
    // explores new histories on every CI run). Any planted bug, not a list of them: the list
    // once missed `shared_gang_unfenced`, whose test then failed now and then (under load in
    // session 11, in a clean-clone CI run in session 12) when its random histories missed the
    // bug.
    let planted_any = planted != Planted::default() || overlap;
    let mut runner = if planted_any {
        TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::deterministic_rng(
                proptest::test_runner::RngAlgorithm::ChaCha,
            ),
        )
    } else {
        TestRunner::new(config)
    };
    let steps = std::sync::atomic::AtomicU64::new(0);
    let grants = std::sync::atomic::AtomicU64::new(0);
    let held = std::sync::atomic::AtomicU64::new(0);
    let cycles = std::sync::atomic::AtomicU64::new(0);
    let shared_cycles = std::sync::atomic::AtomicU64::new(0);
    let kind_gangs = std::sync::Mutex::new((0u64, 0u64));
    runner
        .run(&proptest::collection::vec(op(), 1..150), |ops| {
            let mut m = Model::new(planted, overlap);
            for o in ops {
                m.run(o)?;
            }
            steps.fetch_add(m.steps, std::sync::atomic::Ordering::Relaxed);
            grants.fetch_add(m.grants.len() as u64, std::sync::atomic::Ordering::Relaxed);
            held.fetch_add(m.held_seen, std::sync::atomic::Ordering::Relaxed);
            cycles.fetch_add(m.deadlock_checks, std::sync::atomic::Ordering::Relaxed);
            shared_cycles.fetch_add(m.shared_cycles, std::sync::atomic::Ordering::Relaxed);
            if let Ok(mut k) = kind_gangs.lock() {
                k.0 += m.kind_gangs.0;
                k.1 += m.kind_gangs.1;
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    let g = grants.into_inner();
    // An assertion over nothing proves nothing: the histories must grant leases.
    if g < u64::from(cases) {
        return Err(format!("only {g} version-2 grants in {cases} histories"));
    }
    let h = held.into_inner();
    let clean = !(planted.grant_not_persisted
        || planted.ttl_ignores_holder
        || planted.gang_partial
        || planted.kind_gang_partial
        || planted.shared_gang_unfenced);
    if cycles.into_inner() == 0 && clean && !overlap {
        return Err("no history reached a deadlock: the graph check is vacuous".into());
    }
    let sc = shared_cycles.into_inner();
    if sc == 0 && clean && !overlap {
        return Err("no history reached a deadlock through a shared-kind queue".into());
    }
    let (kt, ks) = kind_gangs.into_inner().unwrap_or_default();
    if clean && !overlap && (kt < u64::from(cases) / 10 || ks < u64::from(cases) / 10) {
        return Err(format!(
            "only {kt} TTL and {ks} shared gangs granted in {cases} histories: the gang \
             checks are nearly vacuous"
        ));
    }
    if h < 10 * u64::from(cases) {
        return Err(format!(
            "the invariants saw only {h} held leases in {cases} histories"
        ));
    }
    Ok(steps.into_inner())
}

#[test]
fn every_kind_keeps_its_invariants_under_random_histories() {
    let steps = run_histories(500, Planted::default(), false).unwrap();
    assert!(steps > 8_000, "{steps} steps");
}

#[test]
fn the_model_catches_a_grant_sent_before_it_is_durable() {
    let p = Planted {
        grant_not_persisted: true,
        ..Planted::default()
    };
    let e = run_histories(300, p, false).unwrap_err();
    assert!(e.contains("before it was durable"), "{e}");
}

#[test]
fn the_model_catches_two_ttl_holders() {
    let p = Planted {
        ttl_ignores_holder: true,
        ..Planted::default()
    };
    let e = run_histories(300, p, false).unwrap_err();
    assert!(e.contains("live TTL leases"), "{e}");
}

#[test]
fn the_model_catches_readers_beside_a_writer() {
    let e = run_histories(300, Planted::default(), true).unwrap_err();
    assert!(e.contains("writers beside"), "{e}");
}

#[test]
fn the_model_catches_a_gang_held_in_part() {
    let p = Planted {
        gang_partial: true,
        ..Planted::default()
    };
    let e = run_histories(300, p, false).unwrap_err();
    assert!(e.contains("without its member"), "{e}");
}

#[test]
fn the_model_catches_a_ttl_or_shared_gang_held_in_part() {
    let p = Planted {
        kind_gang_partial: true,
        ..Planted::default()
    };
    let e = run_histories(300, p, false).unwrap_err();
    assert!(e.contains("without its member"), "{e}");
}

#[test]
fn the_model_catches_a_stale_edge_in_the_wait_for_graph() {
    let p = Planted {
        stale_wait_edges: true,
        ..Planted::default()
    };
    let e = run_histories(600, p, false).unwrap_err();
    assert!(e.contains("deadlocked per the graph vs the table"), "{e}");
}

#[test]
fn the_model_catches_a_writer_granted_ahead_of_a_waiting_shared_gang() {
    let p = Planted {
        shared_gang_unfenced: true,
        ..Planted::default()
    };
    let e = run_histories(600, p, false).unwrap_err();
    assert!(e.contains("ahead of the waiting shared gang"), "{e}");
}

#[test]
fn status_summary_leaves_sessions_out() {
    let m = Model::new(Planted::default(), false);
    let st = m.core.status(m.now(), false);
    assert_eq!((st.sessions.len(), st.session_count), (0, Some(0)));
    assert_eq!((st.leases.len(), st.lease_count), (0, Some(0)));
    let _ = proto::PROTOCOL_VERSION;
}
