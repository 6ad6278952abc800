//! The pure lock state machine: sessions, resources, leases, epochs, reconnect windows.
//!
//! No I/O, no clocks, no randomness from outside: time comes in as [`Now`], tokens come
//! from a seeded CSPRNG owned by the core, and persistence is an [`Output::Persist`] request
//! that the driver completes (write + fsync) before feeding back [`Input::Persisted`].
//! Every event produced while a persist is outstanding is held back in an ordered outbox
//! until that persist is acknowledged, so no grant ever leaves lockd before it is durable.
//!
//! The core is split by concern, with one public entry point, [`Core::step`]:
//! * this module: [`Core`], [`Input`]/[`Output`], request dispatch, and the outbox that holds
//!   every event back until the state it depends on is durable;
//! * `session`: connections, anchors, and what a closing connection ends;
//! * `table`: the lease table (resources, holders, waiters, epochs; lookups by lease id and
//!   holder name in O(log n)), and [`LeaseKind`] / [`LeaseMode`];
//! * `exclusive`: the connection-bound exclusive lease (admission, grant, release, revoke,
//!   reclaim, reconnect-window expiry). Each further lease kind (TTL, shared with versions,
//!   quantity over offers) is one module next to it;
//! * `records`: the persisted form ([`PersistedState`], version [`STATE_VERSION`]), and the
//!   migration from older versions;
//! * `status`: the `status` report and the figures metrics read.

mod deadlock;
mod delta;
mod exclusive;
mod fence;
mod gang;
mod kgang;
#[cfg(test)]
mod kinds_model;
mod leases;
mod quantity;
mod records;
mod reserve;
mod session;
mod shared;
mod smallset;
mod status;
mod table;
#[cfg(test)]
mod testkit;
mod ttl;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use rand::{rngs::StdRng, RngCore, SeedableRng};

use crate::proto::{Counters, ErrorCode, Event, Notice, PeerInfo, Request};

pub use delta::{LeaseRecords, NameRecords, StateDelta};
pub use leases::KindLease;
pub use records::{
    check_state, decode_state, PersistedLease, PersistedResource, PersistedState,
    PersistedStateView, Tombstone, READABLE_STATE_VERSIONS, STATE_VERSION,
};
use session::Session;
pub use table::{LeaseKind, LeaseMode};
use table::{LeaseState, Table};

/// Identifies one connection for the life of the lockd process.
pub type SessionId = u64;

/// The time of a step, both monotonic (for deadlines) and wall-clock (for reports).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Monotonic instant: reconnect-window deadlines and handoff measurements.
    pub mono: Instant,
    /// Wall clock in ms since the Unix epoch: `granted_at` and notices, for humans.
    pub unix_ms: u64,
}

/// Core configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long a persisted lease waits for its holder to reclaim it after a restart.
    pub reconnect_window: Duration,
    /// Token that TCP sessions must present to revoke; None = revoke over TCP refused.
    pub admin_token: Option<String>,
    /// Longest TTL / lease time granted (`--max-lease-time`): the manager's term of a
    /// quantity lease's min, and the cap of TTL and timed shared leases.
    pub max_lease_time: Duration,
    /// No renewal of a quantity lease extends it past its first grant plus this
    /// (`--max-total-lease-time`).
    pub max_total_lease_time: Duration,
    /// Ended leases of the version-2 kinds remembered (by lease id) at most this many...
    pub max_tombstones: usize,
    /// ... and at most this long.
    pub tombstone_max_age: Duration,
    /// Offers from the offers file (`--offers FILE`): (pool, offer), set at startup by
    /// [`Core::new`], which keeps no copy of them once they are applied.
    pub offers: Vec<(String, crate::kinds::quantity::OfferSpec)>,
    /// Revoke the youngest lease of every wait-for cycle found (`--break-deadlocks`).
    pub break_deadlocks: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            reconnect_window: Duration::from_secs(10),
            admin_token: None,
            max_lease_time: Duration::from_secs(3600),
            max_total_lease_time: Duration::from_secs(24 * 3600),
            max_tombstones: 1_000,
            tombstone_max_age: Duration::from_secs(3600),
            offers: Vec::new(),
            break_deadlocks: false,
        }
    }
}

/// Something that happened, fed to [`Core::step`].
#[derive(Debug, Clone)]
pub enum Input {
    /// A connection was accepted.
    Connect {
        /// Its new session id.
        session: SessionId,
        /// Who connected.
        peer: PeerInfo,
    },
    /// A decoded request arrived on a session.
    Request {
        /// The sender.
        session: SessionId,
        /// The request.
        req: Request,
    },
    /// The connection closed (EOF, error, or closed by lockd). A session with open anchors
    /// lives on without its connection (its leases stay held, its queued acquires are
    /// withdrawn) until its last anchor closes.
    Disconnect {
        /// The session whose connection closed.
        session: SessionId,
    },
    /// One of the session's anchors (see [`Request::Anchor`]) reached end-of-file: every
    /// process holding its other end has closed it (or died).
    AnchorClosed {
        /// The session the anchor was attached to.
        session: SessionId,
    },
    /// Time passed (the driver calls this at [`Core::next_deadline`]).
    Tick,
    /// The driver durably wrote the state requested with this sequence number.
    Persisted {
        /// The acknowledged [`Output::Persist`] sequence number.
        seq: u64,
    },
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Write one event to a session.
    Send {
        /// Destination.
        session: SessionId,
        /// The event.
        event: Event,
    },
    /// Durably write the state ([`Core::snapshot`], taken at any time from now on: a later
    /// snapshot covers this request too), then feed `Input::Persisted { seq }` with the
    /// highest `seq` that the written snapshot covers. The snapshot is not built here: a
    /// driver that coalesces many requests into one write (group commit) builds it once.
    Persist {
        /// Sequence number to acknowledge.
        seq: u64,
    },
    /// A lease change, for logs and metrics (watchers get their own `Send`s).
    Notice {
        /// What changed.
        notice: Notice,
        /// For grants that follow a holder's connection close: when it closed (handoff time).
        handoff_from: Option<Instant>,
    },
}

/// The state machine. `Clone` so that a model checker can branch it.
#[derive(Clone)]
pub struct Core {
    /// Configuration.
    cfg: Config,
    /// Token source (seeded by the driver from the OS; tests seed it deterministically).
    rng: StdRng,
    /// Connected sessions (and sessions alive through their anchors). Boxed: ids come in
    /// ascending order, which leaves a B-tree's leaves half full, and a session is 200 bytes
    /// (10,000 sessions took 3.8 MiB inline, 2.3 MiB boxed).
    sessions: BTreeMap<SessionId, Box<Session>>,
    /// Sessions that watch (so that a notice costs O(watchers), not O(sessions)).
    watchers: BTreeSet<SessionId>,
    /// The lease table.
    table: Table,
    /// Tombstones of ended version-2 leases, by id (persisted, bounded).
    tombs: BTreeMap<u64, Tombstone>,
    /// Tombstone ids in end order (front = oldest).
    tomb_order: VecDeque<u64>,
    /// Version-2 leases and waiting requests, by lease id.
    kl: BTreeMap<u64, leases::KindLease>,
    /// Restored connection-bound version-2 leases waiting to be resumed: (deadline, id).
    kl_reclaim: BTreeSet<(Instant, u64)>,
    /// TTL leases.
    ttl: crate::kinds::ttl::TtlTable,
    /// Waiting TTL requests per resource (lease ids: their order is the arrival order).
    ttl_waiters: BTreeMap<String, BTreeSet<u64>>,
    /// Shared/exclusive admission with versions.
    shared: crate::kinds::shared::SharedTable,
    /// Lifetimes of timed shared-kind leases.
    shared_ttl: crate::kinds::ttl::TtlTable,
    /// Quantity pools by name.
    pools: BTreeMap<String, crate::kinds::quantity::QuantityManager>,
    /// Reserved leases waiting for `start`: resource -> (deadline, epoch).
    reservations: BTreeMap<String, (Instant, u64)>,
    /// Their deadlines.
    reservation_deadlines: BTreeSet<(Instant, String)>,
    /// The wait-for graph of sessions (exclusive leases and gangs).
    waitfor: crate::kinds::waitfor::WaitForGraph,
    /// The graph's per-session bookkeeping (what each resource has in the graph is kept
    /// in the table).
    graph: deadlock::GraphSync,
    /// Gangs granted or waiting, by gang id.
    gangs: BTreeMap<u64, gang::Gang>,
    /// Deadlines of waiting gangs with a timeout (of every kind): (deadline, gang id).
    gang_deadlines: BTreeSet<(Instant, u64)>,
    /// Gangs of the version-2 kinds (TTL, shared), granted or waiting, by gang id.
    kgangs: BTreeMap<u64, kgang::KindGang>,
    /// Members of waiting shared gangs per resource (lease ids: arrival order).
    shared_gang_waits: BTreeMap<String, BTreeSet<u64>>,
    /// Counters per version-2 kind (persisted).
    counters_by_kind: BTreeMap<LeaseKind, crate::proto::KindCounters>,
    /// Planted bugs, for the property test's proof that it catches them.
    #[cfg(test)]
    planted: Planted,
    /// What the restore could not apply (offers-file entries), for the driver to log.
    boot_warnings: Vec<String>,
    /// The restore changed the state (leases expired while lockd was down, offers from
    /// the offers file): the first step persists.
    boot_dirty: bool,
    /// Counters (persisted).
    counters: Counters,
    /// Highest persist sequence number requested.
    seq_requested: u64,
    /// Highest persist sequence number acknowledged.
    seq_done: u64,
    /// Outputs waiting for a persist acknowledgement, tagged with the seq they wait for.
    outbox: VecDeque<(u64, Output)>,
    /// Outputs produced by the current step.
    pending: Vec<Output>,
    /// Whether the current step changed persisted state.
    dirty: bool,
    /// What changed since the last incremental write ([`Core::take_delta`]).
    notes: delta::Notes,
}

impl Core {
    /// Build from the persisted state read at startup. Every persisted holder gets a
    /// reconnect window starting `now`; TTL and quantity leases keep their wall-clock
    /// deadlines (those that passed while lockd was down end at once, as expired). Fails
    /// when the records of a lease kind are inconsistent (a corrupt state file).
    pub fn new(cfg: Config, state: PersistedState, now: Now, seed: u64) -> Result<Core, String> {
        let mut table = Table::default();
        table.last_lease_id = state.last_lease_id;
        for (name, r) in state.resources {
            let lease = match r.holder {
                Some(l) => LeaseState::Reclaiming {
                    lease: l,
                    deadline: now.mono + cfg.reconnect_window,
                },
                None => LeaseState::Free,
            };
            table.load(name, r.epoch, lease);
        }
        // The core keeps the tombstones of every kind (`tombs`, persisted once); the TTL
        // tables keep none of their own, so that nothing is written twice.
        let ttl_cfg = |exclusive_per_resource| crate::kinds::ttl::TtlConfig {
            exclusive_per_resource,
            max_tombstones: 0,
            tombstone_max_age: cfg.tombstone_max_age,
        };
        let (ttl, ttl_ended) = crate::kinds::ttl::TtlTable::restore(ttl_cfg(true), state.ttl, now)
            .map_err(|e| e.to_string())?;
        let (shared_ttl, shared_ended) =
            crate::kinds::ttl::TtlTable::restore(ttl_cfg(false), state.shared_ttl, now)
                .map_err(|e| e.to_string())?;
        let shared =
            crate::kinds::shared::SharedTable::restore(state.shared).map_err(|e| e.to_string())?;
        let qcfg = crate::kinds::quantity::Config {
            max_lease_time: cfg.max_lease_time,
            max_total_lease_time: cfg.max_total_lease_time,
        };
        let mut pools = BTreeMap::new();
        let mut pool_events = Vec::new();
        for (name, rec) in state.pools {
            let (m, ev) =
                crate::kinds::quantity::QuantityManager::restore(qcfg, rec, quantity::qnow(now))
                    .map_err(|e| format!("pool {name:?}: {e}"))?;
            pool_events.push((name.clone(), ev));
            pools.insert(name, m);
        }
        let mut kl = BTreeMap::new();
        let mut kl_reclaim = BTreeSet::new();
        for (id, mut l) in state.kind_leases {
            if id > table.last_lease_id {
                return Err(format!("lease id {id} above the last lease id"));
            }
            l.granted = true;
            l.session = None;
            if l.bound {
                let d = now.mono + cfg.reconnect_window;
                l.reclaim_deadline = Some(d);
                kl_reclaim.insert((d, id));
            }
            kl.insert(id, l);
        }
        let mut tomb_order: Vec<(u64, u64)> = state
            .tombstones
            .iter()
            .map(|t| (t.ended_at_unix_ms, t.lease_id))
            .collect();
        tomb_order.sort_unstable();
        let mut core = Core {
            tombs: state
                .tombstones
                .into_iter()
                .map(|t| (t.lease_id, t))
                .collect(),
            tomb_order: tomb_order.into_iter().map(|(_, id)| id).collect(),
            kl,
            kl_reclaim,
            ttl,
            ttl_waiters: BTreeMap::new(),
            shared,
            shared_ttl,
            pools,
            counters_by_kind: state.counters_by_kind,
            gangs: BTreeMap::new(),
            gang_deadlines: BTreeSet::new(),
            kgangs: BTreeMap::new(),
            shared_gang_waits: BTreeMap::new(),
            waitfor: crate::kinds::waitfor::WaitForGraph::new(),
            graph: deadlock::GraphSync::default(),
            reservations: BTreeMap::new(),
            reservation_deadlines: BTreeSet::new(),
            boot_dirty: false,
            boot_warnings: Vec::new(),
            #[cfg(test)]
            planted: Planted::default(),
            cfg,
            rng: StdRng::seed_from_u64(seed),
            sessions: BTreeMap::new(),
            watchers: BTreeSet::new(),
            table,
            counters: state.counters,
            seq_requested: 0,
            seq_done: 0,
            outbox: VecDeque::new(),
            pending: Vec::new(),
            dirty: false,
            notes: delta::Notes::default(),
        };
        core.kgang_restore();
        // What ended while lockd was down ends now (tombstones, counters, grants to
        // nobody: waiters are not persisted), and the offers file is applied.
        for e in ttl_ended {
            core.forget(now, e.id, leases::EndWhy::Expired, false);
        }
        for e in shared_ended {
            core.shared_end(now, e.id, leases::EndWhy::Expired, false);
        }
        for (pool, ev) in pool_events {
            for e in ev {
                if let crate::kinds::quantity::Event::Expired { id, .. } = e {
                    core.forget(now, id, leases::EndWhy::Expired, false);
                }
            }
            let _ = pool;
        }
        // Applied, the offers live in their pools only: no copy of the file is kept.
        for (pool, spec) in std::mem::take(&mut core.cfg.offers) {
            // A pool name the state already uses for another kind (its offers were withdrawn
            // and a lease of another kind took the name before a crash) must not keep lockd
            // down: the offer is skipped, and the driver logs why.
            let name = spec.name.clone();
            if let Err(e) = core.set_offer(now, &pool, spec) {
                core.boot_warnings.push(format!(
                    "offers file: pool {pool:?} offer {name:?} not set: {e}"
                ));
            }
        }
        core.boot_dirty = core.dirty;
        core.dirty = false;
        Ok(core)
    }

    /// The earliest deadline (reconnect windows, TTLs, lease times), if any: call
    /// `step(Tick)` then.
    pub fn next_deadline(&self) -> Option<Instant> {
        [
            self.table.next_deadline(),
            self.next_kind_deadline(),
            self.next_gang_deadline(),
            self.next_reservation_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// What the restore could not apply (offers-file entries that conflict with the state),
    /// for the driver to log once at start.
    pub fn boot_warnings(&self) -> &[String] {
        &self.boot_warnings
    }

    /// Counters so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The session holding `resource`, if a connected one does.
    pub fn holder_session(&self, resource: &str) -> Option<SessionId> {
        match self.table.resources.get(resource).map(|r| &r.lease) {
            Some(LeaseState::Held(l)) => Some(l.session),
            _ => None,
        }
    }

    /// Last epoch granted for `resource` (0 if never).
    pub fn epoch(&self, resource: &str) -> u64 {
        self.table.resources.get(resource).map_or(0, |r| r.epoch)
    }

    /// Resources whose lease (held, or waiting to be reclaimed) is in this holder's name,
    /// sorted (O(log n) to find).
    pub fn held_by(&self, holder: &str) -> Vec<String> {
        self.table.held_by(holder).map(str::to_string).collect()
    }

    /// The resource and epoch of the live (held or reclaiming) lease with this id.
    pub fn lease(&self, lease_id: u64) -> Option<(String, u64)> {
        let name = self.table.resource_of_lease(lease_id)?;
        let epoch = match &self.table.resources.get(name)?.lease {
            LeaseState::Held(l) => l.epoch,
            LeaseState::Reclaiming { lease, .. } => lease.epoch,
            LeaseState::Free => return None,
        };
        Some((name.to_string(), epoch))
    }

    /// Apply one input. Returns what the driver must do, in order.
    pub fn step(&mut self, now: Now, input: Input) -> Vec<Output> {
        self.dirty = std::mem::take(&mut self.boot_dirty);
        self.expire(now);
        self.expire_kinds(now);
        self.gang_tick(now);
        self.reservation_tick(now);
        match input {
            Input::Connect { session, peer } => self.connect(session, peer),
            Input::Request { session, req } => {
                if self.sessions.get(&session).is_some_and(|s| s.connected) {
                    self.request(now, session, req);
                }
            }
            Input::Disconnect { session } => self.disconnect(now, session),
            Input::AnchorClosed { session } => self.anchor_closed(now, session),
            Input::Tick => {}
            Input::Persisted { seq } => {
                if seq <= self.seq_requested && seq > self.seq_done {
                    self.seq_done = seq;
                }
            }
        }
        self.kgang_pass(now);
        self.deadlock_pass(now);
        let mut out = Vec::new();
        if self.dirty {
            self.seq_requested += 1;
            out.push(Output::Persist {
                seq: self.seq_requested,
            });
        }
        let tag = self.seq_requested;
        if out.is_empty() && self.outbox.is_empty() && tag <= self.seq_done {
            // Nothing waits for a write: this step's outputs go out as they are, without a
            // trip through the outbox.
            return std::mem::take(&mut self.pending);
        }
        for o in self.pending.drain(..) {
            self.outbox.push_back((tag, o));
        }
        while self
            .outbox
            .front()
            .is_some_and(|(t, _)| *t <= self.seq_done)
        {
            if let Some((_, o)) = self.outbox.pop_front() {
                out.push(o);
            }
        }
        out
    }

    fn send(&mut self, session: SessionId, event: Event) {
        // A session kept alive by its anchors has no connection to write to.
        if self.sessions.get(&session).is_some_and(|s| !s.connected) {
            return;
        }
        self.pending.push(Output::Send { session, event });
    }

    fn error(&mut self, session: SessionId, code: ErrorCode, msg: String, resource: Option<&str>) {
        self.send(session, Event::error(code, msg, resource));
    }

    fn notice(&mut self, notice: Notice, handoff_from: Option<Instant>) {
        let watchers: Vec<SessionId> = self.watchers.iter().copied().collect();
        for w in watchers {
            self.send(w, Event::Notice(notice.clone()));
        }
        self.pending.push(Output::Notice {
            notice,
            handoff_from,
        });
    }

    /// Over TCP, admin requests (revoke, offer, withdraw) need lockd's `--admin-token`.
    fn admin_ok(&self, s: SessionId, admin: Option<&str>) -> bool {
        let tcp = self
            .sessions
            .get(&s)
            .is_some_and(|x| x.peer.transport == "tcp");
        !tcp || matches!((&self.cfg.admin_token, admin), (Some(want), Some(got)) if ct_eq(want, got))
    }

    fn new_token(&mut self) -> String {
        let mut b = [0u8; 16];
        self.rng.fill_bytes(&mut b);
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut t = String::with_capacity(32);
        for x in b {
            t.push(char::from(HEX[usize::from(x >> 4)]));
            t.push(char::from(HEX[usize::from(x & 15)]));
        }
        t
    }

    fn request(&mut self, now: Now, s: SessionId, req: Request) {
        match req {
            Request::Acquire {
                resource,
                holder,
                wait,
                ext,
            } if ext.gang.is_some() && ext.kind() != LeaseKind::Exclusive => {
                let members = ext.gang.clone().unwrap_or_default();
                self.kgang_acquire(now, s, resource, holder, members, wait, ext)
            }
            Request::Acquire {
                resource,
                holder,
                wait,
                ext,
            } if ext.gang.is_some() => {
                let members = ext.gang.unwrap_or_default();
                let timeout = ext.timeout_ms.map(Duration::from_millis);
                self.gang_acquire(
                    now,
                    s,
                    resource,
                    holder,
                    members,
                    wait,
                    timeout,
                    ext.reserve_ms,
                )
            }
            Request::Acquire {
                resource,
                holder,
                wait,
                ext,
            } => {
                let kind = ext.kind();
                if let Some(other) = self.kind_in_use(&resource).filter(|k| *k != kind) {
                    return self.error(
                        s,
                        ErrorCode::KindMismatch,
                        format!(
                            "{resource:?} is in use as a {} lease, not {}",
                            other.as_str(),
                            kind.as_str()
                        ),
                        Some(&resource),
                    );
                }
                match kind {
                    LeaseKind::Exclusive => {
                        self.acquire(now, s, resource, holder, wait, ext.reserve_ms)
                    }
                    LeaseKind::Ttl => self.ttl_acquire(now, s, resource, holder, wait, ext),
                    LeaseKind::Shared => self.shared_acquire(now, s, resource, holder, wait, ext),
                    LeaseKind::Quantity => {
                        self.quantity_acquire(now, s, resource, holder, wait, ext)
                    }
                }
            }
            Request::Reclaim {
                resource,
                holder: _,
                epoch,
                token,
            } => self.reclaim(now, s, resource, epoch, token),
            Request::Release {
                resource: Some(resource),
                ..
            } => match self.kind_in_use(&resource) {
                Some(LeaseKind::Exclusive) | None => self.release(now, s, resource),
                Some(_) => self.release_resource_of_session(now, s, resource),
            },
            Request::Release {
                lease_id: Some(id),
                token,
                ..
            } if self.gangs.contains_key(&id) => {
                self.gang_release(now, s, id, &token.unwrap_or_default())
            }
            Request::Release {
                lease_id: Some(id),
                token,
                ..
            } => self.release_lease(now, s, id, token.unwrap_or_default()),
            Request::Release { .. } => {}
            Request::Revoke {
                resource,
                lease_id,
                reason,
                admin_token,
            } => {
                if !self.admin_ok(s, admin_token.as_deref()) {
                    let what = resource.as_deref();
                    return self.error(
                        s,
                        ErrorCode::Unauthorized,
                        "revoke over TCP needs lockd's --admin-token".into(),
                        what,
                    );
                }
                let reason = reason.unwrap_or_default();
                match (resource, lease_id) {
                    (_, Some(id)) => self.revoke_lease(now, s, id, reason),
                    (Some(r), None) => match self.kind_in_use(&r) {
                        Some(LeaseKind::Exclusive) | None => self.revoke(now, s, r, reason),
                        Some(_) => self.revoke_resource(now, s, r, reason),
                    },
                    (None, None) => {}
                }
            }
            Request::Status { sessions } => {
                let st = self.status(now, sessions.unwrap_or(true));
                self.send(s, Event::Status(Box::new(st)));
            }
            Request::Renew {
                lease_id,
                token,
                ttl_ms,
            } => self.renew(now, s, lease_id, token, ttl_ms),
            Request::Commit { lease_id, token } => self.commit(now, s, lease_id, token),
            Request::Resume { lease_id, token } => self.resume(now, s, lease_id, token),
            Request::Lease { lease_id } => {
                let r = self.lease_report(now, lease_id);
                self.send(s, Event::Lease(Box::new(r)));
            }
            Request::Leases { resource, holder } => {
                let leases = self.lease_reports(now, resource.as_deref(), holder.as_deref());
                self.send(s, Event::Leases { leases });
            }
            Request::Offer {
                pool,
                name,
                quantity,
                attributes,
                max_lease_time_ms,
                requirements,
                admin_token,
            } => {
                if !self.admin_ok(s, admin_token.as_deref()) {
                    return self.error(
                        s,
                        ErrorCode::Unauthorized,
                        "offer over TCP needs lockd's --admin-token".into(),
                        Some(&pool),
                    );
                }
                self.offer(
                    now,
                    s,
                    pool,
                    name,
                    quantity,
                    attributes,
                    max_lease_time_ms,
                    requirements,
                )
            }
            Request::Withdraw {
                pool,
                name,
                admin_token,
            } => {
                if !self.admin_ok(s, admin_token.as_deref()) {
                    return self.error(
                        s,
                        ErrorCode::Unauthorized,
                        "withdraw over TCP needs lockd's --admin-token".into(),
                        Some(&pool),
                    );
                }
                self.withdraw(now, s, pool, name)
            }
            Request::Watch => self.watch(s),
            Request::Ping => self.send(s, Event::Pong { valid_ms: None }),
            Request::Anchor => self.anchor(s),
            Request::Start { resource } => self.start(s, resource),
        }
    }
}

/// Bugs the property test of the kinds must catch (`core::kinds_model`).
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Planted {
    /// A version-2 grant does not ask for a durable write (sent before it is durable).
    pub grant_not_persisted: bool,
    /// A TTL acquire is granted even when the resource has a live TTL lease.
    pub ttl_ignores_holder: bool,
    /// A waiting gang is granted the members that are free, without waiting for the rest.
    pub gang_partial: bool,
    /// The same for gangs of the version-2 kinds (TTL, shared).
    pub kind_gang_partial: bool,
    /// The wait-for graph forgets to drop the edge of a waiter that left.
    pub stale_wait_edges: bool,
    /// A waiting shared gang reserves nothing: later writers on its members go first.
    pub shared_gang_unfenced: bool,
}

/// Constant-time string comparison for secrets (reclaim tokens, admin tokens, lease tokens
/// of every kind); the length is not secret.
pub(crate) fn ct_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    //! Transition-by-transition tests of step and the outbox.
    use crate::core::testkit::*;

    #[test]
    fn grant_is_withheld_until_persisted() {
        let mut h = H::new();
        h.connect(1, "unix");
        let out = h.raw(Input::Request {
            session: 1,
            req: acq("e", "a", true),
        });
        assert_eq!(
            out.len(),
            1,
            "only the persist request leaves before the write: {out:?}"
        );
        let Output::Persist { seq } = &out[0] else {
            panic!("{out:?}")
        };
        let state = h.core.snapshot();
        assert_eq!(state.resources["e"].epoch, 1);
        assert_eq!(state.resources["e"].holder.as_ref().unwrap().name, "a");
        // Other inputs before the ack stay behind the grant.
        h.connect_raw_queued(2);
        let out2 = h.raw(Input::Persisted { seq: *seq });
        assert!(
            matches!(
                &out2[0],
                Output::Send {
                    session: 1,
                    event: Event::Granted {
                        epoch: 1,
                        reclaimed: false,
                        ..
                    }
                }
            ),
            "{out2:?}"
        );
        assert!(out2.iter().any(|o| matches!(
            o,
            Output::Send {
                session: 2,
                event: Event::Hello { .. }
            }
        )));
    }

    #[test]
    fn stale_or_future_persist_acks_are_ignored() {
        let mut h = H::new();
        h.connect(1, "unix");
        let out = h.raw(Input::Request {
            session: 1,
            req: acq("e", "a", true),
        });
        let Output::Persist { seq, .. } = out[0].clone() else {
            panic!()
        };
        assert!(h.raw(Input::Persisted { seq: seq + 5 }).is_empty());
        assert!(h.raw(Input::Persisted { seq: 0 }).is_empty());
        assert!(!h.raw(Input::Persisted { seq }).is_empty());
    }

    #[test]
    fn any_input_applies_due_expiry_first() {
        let (mut h, _) = restarted();
        h.ms = W;
        let out = h.step(Input::Connect {
            session: 2,
            peer: peer("unix"),
        });
        assert!(
            matches!(&out[0], Output::Notice { notice, .. } if notice.kind == NoticeKind::Expired)
        );
        assert_eq!(H::granted(&h.req(2, acq("e", "b", true)), 2).unwrap().0, 2);
    }

    #[test]
    fn watchers_get_notices_in_order() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(9, "unix");
        assert_eq!(
            H::to(&h.req(9, Request::Watch), 9),
            vec![Event::Watching {}]
        );
        h.req(1, acq("e", "a", true));
        let out = h.step(Input::Disconnect { session: 1 });
        let kinds: Vec<NoticeKind> = H::to(&out, 9)
            .into_iter()
            .filter_map(|e| match e {
                Event::Notice(n) => Some(n.kind),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, vec![NoticeKind::Released]);
    }

    #[test]
    fn leases_are_found_by_id_and_by_holder_name_across_a_restart() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(1, acq("x", "a", true));
        h.req(1, acq("y", "a", true));
        h.req(2, acq("z", "b", true));
        assert_eq!(h.core.held_by("a"), vec!["x".to_string(), "y".to_string()]);
        assert_eq!(h.core.held_by("b"), vec!["z".to_string()]);
        assert!(h.core.held_by("nobody").is_empty());
        assert_eq!(h.core.lease(2), Some(("y".to_string(), 1)));
        let st = h.persisted.clone().unwrap();
        assert_eq!(st.last_lease_id, 3);
        assert_eq!(st.resources["z"].holder.as_ref().unwrap().lease_id, 3);
        // After a restart the leases wait in their window under the same ids and names.
        let mut h = H::with_state(st, None);
        assert_eq!(h.core.lease(3), Some(("z".to_string(), 1)));
        assert_eq!(h.core.held_by("a").len(), 2);
        h.ms = W;
        h.step(Input::Tick);
        assert_eq!(h.core.lease(3), None);
        assert!(h.core.held_by("a").is_empty());
        // Ids are never reused.
        h.connect(3, "unix");
        h.req(3, acq("x", "c", true));
        assert_eq!(h.core.lease(4), Some(("x".to_string(), 2)));
        assert_eq!(h.core.lease(1), None);
    }
}
