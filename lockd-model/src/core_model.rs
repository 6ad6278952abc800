//! lockd's pure core ([`lockd::core::Core`]) driven by the stateright model checker.
//!
//! A state of [`CoreModel`] is a [`Core`] plus the driver's view: the durable state (what the
//! last acknowledged write holds), the pending write, the clock in ms, which clients are
//! connected (under which session) and what each client was told (the leases it holds, the
//! requests it waits for). An action is one input of the driver or of a client: connect,
//! disconnect, acquire (exclusive version 1, gang of two, TTL, shared in either mode,
//! quantity from a pool of two, a TTL gang of two, a shared gang of two), release, renew, commit, reclaim after a restart, a tick of
//! a few fixed sizes, the acknowledgement of the pending write, and a crash of lockd followed
//! by a restart from the durable state (through its JSON form, as lockd reads its file).
//!
//! States are deduplicated through a canonical fingerprint (see [`CoreState`]): the JSON of
//! `core.snapshot()`, of `core.status(now, true)`, of the events held back until the pending
//! write is acknowledged (found by acknowledging it on a clone), and the driver's view.
//!
//! What the fingerprint leaves out, on purpose or because lockd does not show it: the
//! core's random-number generator (states that differ only in the tokens still to come are
//! merged; no property reads a token's value) and the internal ticket counter of the queues
//! (their order is in the status report). Everything else a later step can depend on is in it.
//!
//! **Properties** ([`CoreModel::properties`]), checked in every reachable state:
//! * *never two exclusive holders*: no two connected clients were told they hold the same
//!   exclusive lease (version 1, gang members, TTL, shared in exclusive mode), and the status
//!   never shows two live TTL leases on one resource;
//! * *no reader beside a writer*, *no quantity above capacity*: from `status`;
//! * *epochs strictly increase across restarts*: every new grant told to a client (version 1,
//!   version 2, gang member) has an epoch above every earlier one of its resource;
//! * *no grant visible before it is durable*: when a grant reaches a client, the durable
//!   state already holds its epoch and lease id;
//! * *no gang held in part*: a client that asked for a gang holds all of its members (by
//!   session, in `status`) or none; for the TTL and shared gangs, each holder name holds
//!   all or none of the gang's members in `status` (TTL leases, shared-mode leases), even
//!   after its connection is gone;
//! * *every waiter is granted or ends under a fair drain* (bounded liveness): from the state,
//!   [`CoreModel::drain`] lets every client behave fairly, [`DRAIN_ROUNDS`] rounds of
//!   (complete the pending write, every client releases everything it was told it holds,
//!   [`DRAIN_TICK_MS`] ms pass); every request waiting at the start must have been answered
//!   (granted, cancelled, refused, ended) by then, or its client gone. Reconnect windows,
//!   TTLs and gang timeouts are all shorter than the drain, so a waiter that is still waiting
//!   is a lost wakeup or a cycle, not a slow holder. Checked on every state the search
//!   reaches, so it covers every interleaving up to the depth followed by the fair suffix.
//! * *no writer overtakes a waiting shared gang* (with the TTL and shared gangs): a writer
//!   granted a member of the shared gang asked after the gang was queued (a higher lease
//!   id) only if the gang no longer waits — the fence of `lockd/src/core/fence.rs`. With
//!   the fence planted away in the core, the search finds the overtaking at depth 8 (the
//!   CI depth, 6, reaches a writer queued behind the waiting gang: `sometimes` property
//!   *a writer waits behind a waiting shared gang*);
//! * a few `sometimes` properties (a second and third epoch, a grant after a restart, a
//!   reclaim, a gang that waits and one that is granted, two leases at once) that the tests
//!   require to be reached, so that the depth is known to cover the interesting states.
//!
//! The planted bugs live in the model's driver or client ([`PlantedBug`]), never in lockd.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use lockd::core::{decode_state, Config, Core, Input, Now, Output, PersistedState};
use lockd::kinds::quantity::OfferSpec;
use lockd::proto::{AcquireExt, Event, LeaseKind, LeaseState, Mode, PeerInfo, Request};
use stateright::{Model, Property};

/// The two resources of exclusive version-1 leases, also the members of the gang.
pub const EXCL: [&str; 2] = ["x0", "x1"];
/// The gang's label (its `resource` in events).
pub const GANG: &str = "g";
/// The TTL resource.
pub const TTL_RES: &str = "t";
/// The members of the TTL gang (`gt`): TTL leases.
pub const TTL_GANG: [&str; 2] = ["t", "t1"];
/// The members of the shared gang (`gs`): shared-mode leases bound to the connection.
pub const SHARED_GANG: [&str; 2] = ["s", "s1"];
/// The shared/exclusive resource (versions, commit).
pub const SHARED_RES: &str = "s";
/// The quantity pool, with one offer of [`POOL_CAPACITY`].
pub const POOL: &str = "p";
/// Capacity of the pool's one offer.
pub const POOL_CAPACITY: u32 = 2;
/// TTL asked for by TTL and quantity acquires, in ms.
pub const LEASE_TTL_MS: u64 = 200;
/// Timeout of a waiting gang, in ms.
pub const GANG_TIMEOUT_MS: u64 = 200;
/// lockd's reconnect window after a restart, in ms.
pub const RECONNECT_WINDOW_MS: u64 = 300;
/// Rounds of the fair drain of the liveness check (one tick of [`DRAIN_TICK_MS`] each).
pub const DRAIN_ROUNDS: u32 = 20;
/// Clock step of the fair drain, in ms.
pub const DRAIN_TICK_MS: u64 = 100;

/// A bug planted in the model's driver (lockd is untouched), for the tests that show the
/// checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// The driver acknowledges a persist request before the write (`Input::Persisted` at
    /// once, the state written later by the `Ack` action): grants become visible before
    /// they are durable, and a crash in between loses them.
    AckBeforeWrite,
    /// The client builds its "gang" from two single exclusive acquires sent one after the
    /// other (what a client without gang support does): it can hold one member alone.
    TwoStepGang,
    /// The driver drops the grants that follow a handoff (epoch 2 and above): a lost wakeup,
    /// which only the liveness property sees.
    LoseHandoffGrant,
}

/// Which actions the checker explores, and how far.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Number of clients (each connects, disconnects and reconnects under a new session).
    pub clients: u8,
    /// Version-1 exclusive acquires of the first `exclusive` of `x0`, `x1`, their release,
    /// and their reclaim after a restart.
    pub exclusive: u8,
    /// The gang `{x0, x1}` (wait, with a timeout), released whole.
    pub gang: bool,
    /// TTL acquires of `t`, renew, release by id.
    pub ttl: bool,
    /// Shared/exclusive acquires of `s`, commit, release by id.
    pub shared: bool,
    /// Quantity acquires of 1 or 2 from the pool `p`, renew, release by id.
    pub quantity: bool,
    /// The TTL gang `gt` = `{t, t1}` and the shared gang `gs` = `{s, s1}` (wait, with a
    /// timeout), renewed and released by a member's id. With `shared`, the single shared
    /// acquires of `s` are writers only (the gangs are the readers).
    pub kind_gangs: bool,
    /// Clock steps the checker may take, in ms.
    pub ticks: Vec<u64>,
    /// No tick takes the clock past this (bounds the state space).
    pub max_ms: u64,
    /// Most lockd crashes on one path.
    pub max_restarts: u8,
    /// Most (re)connections of one client on one path.
    pub max_connects: u64,
    /// Check the liveness property (the fair drain on every state; costs time).
    pub liveness: bool,
    /// A bug planted in the driver or the client.
    pub bug: Option<PlantedBug>,
}

impl CoreConfig {
    /// Two clients (connected at the start), nothing enabled, ticks of 150 ms up to 600 ms,
    /// one restart, one reconnection per client.
    pub fn base() -> CoreConfig {
        CoreConfig {
            clients: 2,
            exclusive: 0,
            gang: false,
            ttl: false,
            shared: false,
            quantity: false,
            kind_gangs: false,
            ticks: vec![150],
            max_ms: 600,
            max_restarts: 1,
            max_connects: 2,
            liveness: true,
            bug: None,
        }
    }
}

/// The bounded configurations checked in CI: (name, configuration, depth). Each explores
/// the kinds it names with two clients (three in one) through every interleaving up to
/// `depth` actions. The tests add `LOCKD_MODEL_EXTRA_DEPTH` (default 0) to each depth for a
/// deeper run outside CI.
pub fn ci_configs() -> Vec<(&'static str, CoreConfig, usize)> {
    let exclusive = CoreConfig {
        exclusive: 1,
        max_ms: 450,
        ..CoreConfig::base()
    };
    let gang = CoreConfig {
        exclusive: 1,
        gang: true,
        max_restarts: 0,
        ..CoreConfig::base()
    };
    let ttl = CoreConfig {
        ttl: true,
        ..CoreConfig::base()
    };
    let shared = CoreConfig {
        shared: true,
        ..CoreConfig::base()
    };
    let quantity = CoreConfig {
        quantity: true,
        ..CoreConfig::base()
    };
    let kind_gangs = CoreConfig {
        kind_gangs: true,
        shared: true,
        ..CoreConfig::base()
    };
    let three = CoreConfig {
        clients: 3,
        exclusive: 1,
        max_restarts: 0,
        max_connects: 1,
        max_ms: 150,
        ..CoreConfig::base()
    };
    vec![
        ("exclusive+crash+reclaim", exclusive, 9),
        ("exclusive, 3 clients", three, 10),
        ("gang+exclusive", gang, 8),
        ("ttl+crash", ttl, 9),
        ("shared+crash", shared, 7),
        ("quantity+crash", quantity, 7),
        ("ttl gang+shared gang+writer+crash", kind_gangs, 6),
    ]
}

/// One action of the checker. Clients are numbered from 0.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// Client connects (new session).
    Connect(u8),
    /// Client's connection closes.
    Disconnect(u8),
    /// Exclusive version-1 acquire (wait) of `EXCL[i]`.
    Exclusive(u8, u8),
    /// Gang `{x0, x1}`, wait with a timeout (or, with [`PlantedBug::TwoStepGang`], two single
    /// acquires).
    Gang(u8),
    /// TTL acquire of `t` (wait).
    Ttl(u8),
    /// Shared-kind acquire of `s` (wait): `true` = exclusive mode.
    Shared(u8, bool),
    /// Quantity acquire of this much from `p` (wait).
    Quantity(u8, u32),
    /// The TTL gang (`false`) or the shared gang (`true`), wait with a timeout (or, with
    /// [`PlantedBug::TwoStepGang`], two single acquires).
    KindGang(u8, bool),
    /// Version-1 release of `EXCL[i]`.
    ReleaseExclusive(u8, u8),
    /// Release the gang whole (id + token).
    ReleaseGang(u8),
    /// Release a version-2 lease by id + token.
    ReleaseLease(u8, u64),
    /// Renew a TTL or quantity lease.
    Renew(u8, u64),
    /// Commit a shared lease held in exclusive mode.
    Commit(u8, u64),
    /// Reclaim, after a restart, an exclusive lease told before the crash.
    Reclaim(u8, u8),
    /// Time passes by this many ms (`Input::Tick`).
    Tick(u64),
    /// The pending write completes (durable), then `Input::Persisted`.
    Ack,
    /// lockd crashes and restarts from the durable state.
    Crash,
}

/// A lease a client was told it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Told {
    /// Resource (or pool).
    pub resource: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its token.
    pub token: String,
    /// Its kind.
    pub kind: LeaseKind,
    /// Shared kind: its mode.
    pub mode: Option<Mode>,
}

/// A gang a client asked for: its members, and once granted its id and token.
pub type GangView = (Vec<String>, Option<(u64, String)>);

/// What one client knows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ClientView {
    /// Connections opened so far (the session id is `c * 1000 + connects`).
    pub connects: u64,
    /// Connected now.
    pub connected: bool,
    /// Exclusive version-1 leases it was told it holds (resource -> epoch, token).
    pub exclusive: BTreeMap<String, (u64, String)>,
    /// The gang it asked for: members, and once granted its id and token.
    pub gang: Option<GangView>,
    /// Version-2 leases it was told it holds, by lease id.
    pub leases: BTreeMap<u64, Told>,
    /// Requests sent and not answered by a grant or an end yet: key (resource, pool or
    /// gang label) -> (ms when sent, lease id once queued).
    pub waiting: BTreeMap<String, (u64, Option<u64>)>,
    /// Exclusive leases it held when lockd crashed (reclaimable): resource -> epoch, token.
    pub lost: BTreeMap<String, (u64, String)>,
}

/// A state: the core and the driver's view, with its fingerprint.
#[derive(Clone)]
pub struct CoreState {
    /// The lock core.
    pub core: Core,
    /// Clock, ms since the start.
    pub ms: u64,
    /// The state of the last completed write.
    pub durable: PersistedState,
    /// The write requested and not yet completed: (seq, snapshot).
    pub unwritten: Option<(u64, PersistedState)>,
    /// Persist requests acknowledged before their write (planted bug only).
    pub acked_early: Option<u64>,
    /// The clients.
    pub clients: Vec<ClientView>,
    /// Largest epoch told per resource (new grants, not reclaims), across restarts.
    pub max_epoch: BTreeMap<String, u64>,
    /// Crashes so far.
    pub restarts: u8,
    /// First grant sent before it was durable (the event's description).
    pub early_grant: Option<String>,
    /// First writer granted a member of the shared gang while that gang, queued before the
    /// writer asked (a lower lease id), still waited (gang fairness: the fence).
    pub overtaken: Option<String>,
    /// Writers granted while the shared gang waited, having asked before it (the fairness
    /// check is not vacuous: a gang does wait with writers around it).
    pub writers_beside_waiting_gang: u32,
    /// First grant whose epoch was not above every earlier one of its resource.
    pub epoch_regress: Option<String>,
    /// Grants seen (a sanity figure: the checks must not be vacuous).
    pub grants: u32,
    /// Reclaims seen after a restart.
    pub reclaims: u32,
    /// New grants told after a restart.
    pub grants_after_restart: u32,
    /// Canonical fingerprint: equality and hashing go through it.
    fp: String,
}

impl fmt::Debug for CoreState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoreState")
            .field("ms", &self.ms)
            .field("clients", &self.clients)
            .field("unwritten", &self.unwritten.as_ref().map(|u| u.0))
            .field("max_epoch", &self.max_epoch)
            .field("early_grant", &self.early_grant)
            .field("epoch_regress", &self.epoch_regress)
            .field("overtaken", &self.overtaken)
            .finish()
    }
}

impl PartialEq for CoreState {
    fn eq(&self, o: &Self) -> bool {
        self.fp == o.fp
    }
}
impl Eq for CoreState {}
impl Hash for CoreState {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.fp.hash(h);
    }
}

/// The model: a configuration and the instant the clock counts from.
pub struct CoreModel {
    /// What is explored.
    pub cfg: CoreConfig,
    base: Instant,
}

fn peer() -> PeerInfo {
    PeerInfo {
        transport: "unix".into(),
        pid: Some(1),
        ..PeerInfo::default()
    }
}

fn sid(c: u8, connects: u64) -> u64 {
    u64::from(c) * 1000 + connects
}

impl CoreModel {
    /// A model of this configuration.
    pub fn new(cfg: CoreConfig) -> CoreModel {
        CoreModel {
            cfg,
            base: Instant::now(),
        }
    }

    /// lockd's configuration in the model: short windows, one offer of 2 in pool `p`.
    pub fn lockd_config(&self) -> Config {
        Config {
            reconnect_window: Duration::from_millis(RECONNECT_WINDOW_MS),
            max_lease_time: Duration::from_millis(1000),
            max_total_lease_time: Duration::from_millis(5000),
            offers: if self.cfg.quantity {
                vec![(
                    POOL.to_string(),
                    OfferSpec {
                        name: "o0".into(),
                        quantity: POOL_CAPACITY,
                        attributes: Default::default(),
                        max_lease_time_ms: None,
                        requirements: Default::default(),
                    },
                )]
            } else {
                Vec::new()
            },
            ..Config::default()
        }
    }

    fn now(&self, ms: u64) -> Now {
        Now {
            mono: self.base + Duration::from_millis(ms),
            unix_ms: ms,
        }
    }

    /// The initial state: an empty lockd (offers applied and written), nobody connected.
    /// `None` when lockd refuses its own configuration (a model error, reported by the
    /// tests as "no initial state").
    pub fn initial(&self) -> Option<CoreState> {
        let core = Core::new(
            self.lockd_config(),
            PersistedState::default(),
            self.now(0),
            1,
        )
        .ok()?;
        let mut s = CoreState {
            durable: core.snapshot(),
            core,
            ms: 0,
            unwritten: None,
            acked_early: None,
            clients: vec![ClientView::default(); usize::from(self.cfg.clients)],
            max_epoch: BTreeMap::new(),
            restarts: 0,
            early_grant: None,
            epoch_regress: None,
            overtaken: None,
            writers_beside_waiting_gang: 0,
            grants: 0,
            reclaims: 0,
            grants_after_restart: 0,
            fp: String::new(),
        };
        // The offers file makes the first step persist: complete it.
        self.input(&mut s, Input::Tick);
        self.ack(&mut s);
        // Every client starts connected (they may disconnect and come back).
        for c in 0..self.cfg.clients {
            self.apply(&mut s, &Action::Connect(c));
        }
        self.fingerprint(&mut s);
        Some(s)
    }

    /// Feed one input and carry out the outputs (the driver).
    fn input(&self, s: &mut CoreState, i: Input) {
        let outs = s.core.step(self.now(s.ms), i);
        self.outputs(s, outs);
    }

    fn outputs(&self, s: &mut CoreState, outs: Vec<Output>) {
        for o in outs {
            match o {
                Output::Persist { seq } => {
                    s.unwritten = Some((seq, s.core.snapshot()));
                    if self.cfg.bug == Some(PlantedBug::AckBeforeWrite) {
                        // The bug: the acknowledgement does not wait for the write.
                        s.acked_early = Some(seq);
                        let more = s.core.step(self.now(s.ms), Input::Persisted { seq });
                        self.outputs(s, more);
                    }
                }
                Output::Send {
                    event: Event::Granted { epoch, .. },
                    ..
                } if epoch >= 2 && self.cfg.bug == Some(PlantedBug::LoseHandoffGrant) => {}
                Output::Send { session, event } => self.deliver(s, session, event),
                Output::Notice { .. } => {}
            }
        }
    }

    /// The pending write completes: the state becomes durable, then lockd is told.
    fn ack(&self, s: &mut CoreState) {
        if let Some((seq, st)) = s.unwritten.take() {
            s.durable = st;
            if s.acked_early.take() != Some(seq) {
                self.input(s, Input::Persisted { seq });
            }
        }
    }

    /// A grant reaches a client: check it is durable and its epoch is new.
    fn check_grant(s: &mut CoreState, resource: &str, epoch: u64, id: Option<u64>, new: bool) {
        s.grants += 1;
        let durable = s.durable.resources.get(resource).map_or(0, |r| r.epoch);
        let id_ok = id.is_none_or(|id| s.durable.last_lease_id >= id);
        if (durable < epoch || !id_ok) && s.early_grant.is_none() {
            s.early_grant = Some(format!(
                "{resource}@{epoch} (lease {id:?}) sent while the durable state has epoch {durable}, last lease id {}",
                s.durable.last_lease_id
            ));
        }
        if new && s.restarts > 0 {
            s.grants_after_restart += 1;
        }
        if new {
            let last = s.max_epoch.get(resource).copied().unwrap_or(0);
            if epoch <= last && s.epoch_regress.is_none() {
                s.epoch_regress = Some(format!("{resource}: epoch {epoch} told after {last}"));
            }
            s.max_epoch.insert(resource.to_string(), epoch.max(last));
        }
    }

    /// An event reaches session `session` (ignored when that connection is gone).
    /// A writer granted `resource` (lease `id`): no shared gang over it that was queued
    /// before the writer asked may still wait (the gang's member on `resource` has the gang
    /// id plus its index; lease ids are handed out in arrival order).
    fn check_fence(s: &mut CoreState, resource: &str, id: Option<u64>) {
        let (Some(id), Some(i)) = (id, SHARED_GANG.iter().position(|m| *m == resource)) else {
            return;
        };
        for (c, cv) in s.clients.iter().enumerate() {
            if let Some((_, Some(gid))) = cv.waiting.get("gs") {
                if id > gid + i as u64 {
                    if s.overtaken.is_none() {
                        s.overtaken = Some(format!(
                            "writer {id} granted {resource} while client {c}'s shared gang \
                             {gid}, queued before it, waits"
                        ));
                    }
                } else {
                    s.writers_beside_waiting_gang += 1;
                }
            }
        }
    }

    fn deliver(&self, s: &mut CoreState, session: u64, ev: Event) {
        let c = usize::try_from(session / 1000).unwrap_or(usize::MAX);
        let Some(cv) = s.clients.get(c) else { return };
        if !cv.connected || cv.connects != session % 1000 {
            return;
        }
        match ev {
            Event::Granted {
                resource,
                epoch,
                token,
                reclaimed,
                lease,
                ..
            } => {
                Self::check_grant(s, &resource, epoch, lease.lease_id, !reclaimed);
                if lease.mode == Some(Mode::Exclusive) && !reclaimed {
                    Self::check_fence(s, &resource, lease.lease_id);
                }
                if reclaimed {
                    s.reclaims += 1;
                }
                let cv = &mut s.clients[c];
                cv.waiting.remove(&resource);
                cv.lost.remove(&resource);
                match lease.lease_id {
                    None => {
                        cv.exclusive.insert(resource, (epoch, token));
                    }
                    Some(id) => {
                        cv.leases.insert(
                            id,
                            Told {
                                resource,
                                epoch,
                                token,
                                kind: lease.kind.unwrap_or_default(),
                                mode: lease.mode,
                            },
                        );
                    }
                }
            }
            Event::GangGranted {
                resource,
                token,
                members,
                kind: Some(kind),
                ..
            } => {
                // A TTL or shared gang: each member is a version-2 lease of its own.
                for m in &members {
                    Self::check_grant(s, &m.resource, m.epoch, m.lease_id, true);
                }
                let cv = &mut s.clients[c];
                cv.waiting.remove(&resource);
                for m in members {
                    if let Some(id) = m.lease_id {
                        let mode = (kind == LeaseKind::Shared).then_some(Mode::Shared);
                        let t = Told {
                            resource: m.resource,
                            epoch: m.epoch,
                            token: token.clone(),
                            kind,
                            mode,
                        };
                        cv.leases.insert(id, t);
                    }
                }
            }
            Event::GangGranted {
                resource,
                gang_id,
                token,
                members,
                ..
            } => {
                for m in &members {
                    Self::check_grant(s, &m.resource, m.epoch, Some(gang_id), true);
                }
                let cv = &mut s.clients[c];
                cv.waiting.remove(&resource);
                if let Some((_, g)) = cv.gang.as_mut() {
                    *g = Some((gang_id, token.clone()));
                }
                for m in members {
                    cv.exclusive.insert(m.resource, (m.epoch, token.clone()));
                }
            }
            Event::Queued {
                resource, lease_id, ..
            } => {
                if let Some(w) = s.clients[c].waiting.get_mut(&resource) {
                    w.1 = lease_id;
                }
            }
            Event::Busy { resource, .. }
            | Event::Cancelled { resource }
            | Event::Error {
                resource: Some(resource),
                ..
            } => {
                let cv = &mut s.clients[c];
                cv.waiting.remove(&resource);
                if resource == GANG {
                    cv.gang = None;
                }
            }
            Event::Released {
                resource, lease_id, ..
            } => {
                let cv = &mut s.clients[c];
                match lease_id {
                    Some(id) => {
                        cv.leases.remove(&id);
                    }
                    None => {
                        cv.exclusive.remove(&resource);
                    }
                }
            }
            Event::LeaseEnded { lease_id, .. } => {
                let cv = &mut s.clients[c];
                cv.leases.remove(&lease_id);
                cv.waiting.retain(|_, w| w.1 != Some(lease_id));
            }
            Event::Revoked { resource, .. } => {
                s.clients[c].exclusive.remove(&resource);
            }
            _ => {}
        }
    }

    /// Fingerprint: the core's durable form and report, the events it holds back, and the
    /// driver's view (clock, durable state, clients).
    fn fingerprint(&self, s: &mut CoreState) {
        let now = self.now(s.ms);
        let held_back = match &s.unwritten {
            Some((seq, _)) => {
                let mut probe = s.core.clone();
                format!("{:?}", probe.step(now, Input::Persisted { seq: *seq }))
            }
            None => String::new(),
        };
        s.fp = format!(
            "{}|{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{:?}|{}",
            s.ms,
            serde_json::to_string(&s.core.snapshot()).unwrap_or_default(),
            serde_json::to_string(&s.core.status(now, true)).unwrap_or_default(),
            held_back,
            s.unwritten.as_ref().map(|u| u.0),
            s.acked_early,
            s.clients,
            s.max_epoch,
            serde_json::to_string(&s.durable).unwrap_or_default(),
            s.early_grant,
            s.epoch_regress,
            s.restarts,
        );
        if let Some(o) = &s.overtaken {
            s.fp.push('|');
            s.fp.push_str(o);
        }
    }

    fn request(&self, s: &mut CoreState, c: u8, key: Option<&str>, req: Request) {
        let cv = &mut s.clients[usize::from(c)];
        if let Some(k) = key {
            cv.waiting.insert(k.to_string(), (s.ms, None));
        }
        let session = sid(c, cv.connects);
        self.input(s, Input::Request { session, req });
    }

    fn acquire(r: &str, c: u8, ext: AcquireExt) -> Request {
        Request::Acquire {
            resource: r.into(),
            holder: format!("h{c}"),
            wait: true,
            ext,
        }
    }

    /// Apply one action (no fingerprint). `false`: the action does not apply here.
    fn apply(&self, s: &mut CoreState, a: &Action) -> bool {
        match *a {
            Action::Connect(c) => {
                let cv = &mut s.clients[usize::from(c)];
                cv.connects += 1;
                cv.connected = true;
                let session = sid(c, cv.connects);
                self.input(
                    s,
                    Input::Connect {
                        session,
                        peer: peer(),
                    },
                );
            }
            Action::Disconnect(c) => {
                let cv = &mut s.clients[usize::from(c)];
                let session = sid(c, cv.connects);
                let lost = std::mem::take(&mut cv.lost);
                *cv = ClientView {
                    connects: cv.connects,
                    lost,
                    ..ClientView::default()
                };
                self.input(s, Input::Disconnect { session });
            }
            Action::Exclusive(c, i) => {
                let r = EXCL[usize::from(i)];
                self.request(s, c, Some(r), Request::acquire(r, format!("h{c}"), true));
            }
            Action::Gang(c) => {
                let members: Vec<String> = EXCL.iter().map(|m| m.to_string()).collect();
                s.clients[usize::from(c)].gang = Some((members.clone(), None));
                if self.cfg.bug == Some(PlantedBug::TwoStepGang) {
                    // The bug: a "gang" of two single acquires, one after the other.
                    for m in EXCL {
                        self.request(s, c, Some(m), Request::acquire(m, format!("h{c}"), true));
                    }
                } else {
                    let ext = AcquireExt {
                        gang: Some(members),
                        timeout_ms: Some(GANG_TIMEOUT_MS),
                        ..AcquireExt::default()
                    };
                    self.request(s, c, Some(GANG), Self::acquire(GANG, c, ext));
                }
            }
            Action::Ttl(c) => {
                let ext = AcquireExt {
                    ttl_ms: Some(LEASE_TTL_MS),
                    ..AcquireExt::default()
                };
                self.request(s, c, Some(TTL_RES), Self::acquire(TTL_RES, c, ext));
            }
            Action::Shared(c, exclusive) => {
                let ext = AcquireExt {
                    mode: Some(if exclusive {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    }),
                    ..AcquireExt::default()
                };
                self.request(s, c, Some(SHARED_RES), Self::acquire(SHARED_RES, c, ext));
            }
            Action::Quantity(c, q) => {
                let ext = AcquireExt {
                    quantity: Some(q),
                    ttl_ms: Some(LEASE_TTL_MS),
                    ..AcquireExt::default()
                };
                self.request(s, c, Some(POOL), Self::acquire(POOL, c, ext));
            }
            Action::KindGang(c, shared) => {
                let (label, members) = if shared {
                    ("gs", SHARED_GANG)
                } else {
                    ("gt", TTL_GANG)
                };
                let ext = AcquireExt {
                    ttl_ms: (!shared).then_some(LEASE_TTL_MS),
                    mode: shared.then_some(Mode::Shared),
                    ..AcquireExt::default()
                };
                if self.cfg.bug == Some(PlantedBug::TwoStepGang) {
                    // The bug: a "gang" of two single acquires, one after the other.
                    for m in members {
                        self.request(s, c, Some(m), Self::acquire(m, c, ext.clone()));
                    }
                } else {
                    let ext = AcquireExt {
                        gang: Some(members.iter().map(|m| m.to_string()).collect()),
                        timeout_ms: Some(GANG_TIMEOUT_MS),
                        ..ext
                    };
                    self.request(s, c, Some(label), Self::acquire(label, c, ext));
                }
            }
            Action::ReleaseExclusive(c, i) => {
                let r = EXCL[usize::from(i)];
                // The client lets go as it asks (it must not count on the lease any more).
                s.clients[usize::from(c)].exclusive.remove(r);
                self.request(s, c, None, Request::release(r));
            }
            Action::ReleaseGang(c) => {
                let cv = &mut s.clients[usize::from(c)];
                let Some((members, Some((id, token)))) = cv.gang.take() else {
                    return false;
                };
                for m in &members {
                    cv.exclusive.remove(m);
                }
                let req = Request::Release {
                    resource: None,
                    lease_id: Some(id),
                    token: Some(token),
                };
                self.request(s, c, None, req);
            }
            Action::ReleaseLease(c, id) => {
                let Some(t) = s.clients[usize::from(c)].leases.remove(&id) else {
                    return false;
                };
                let req = Request::Release {
                    resource: None,
                    lease_id: Some(id),
                    token: Some(t.token),
                };
                self.request(s, c, None, req);
            }
            Action::Renew(c, id) => {
                let Some(t) = s.clients[usize::from(c)].leases.get(&id).cloned() else {
                    return false;
                };
                let req = Request::Renew {
                    lease_id: id,
                    token: t.token,
                    ttl_ms: None,
                };
                self.request(s, c, None, req);
            }
            Action::Commit(c, id) => {
                let Some(t) = s.clients[usize::from(c)].leases.get(&id).cloned() else {
                    return false;
                };
                let req = Request::Commit {
                    lease_id: id,
                    token: t.token,
                };
                self.request(s, c, None, req);
            }
            Action::Reclaim(c, i) => {
                let r = EXCL[usize::from(i)];
                let cv = &mut s.clients[usize::from(c)];
                let Some((epoch, token)) = cv.lost.remove(r) else {
                    return false;
                };
                cv.waiting.insert(r.to_string(), (s.ms, None));
                let req = Request::Reclaim {
                    resource: r.into(),
                    holder: format!("h{c}"),
                    epoch,
                    token,
                };
                self.request(s, c, None, req);
            }
            Action::Tick(d) => {
                s.ms += d;
                self.input(s, Input::Tick);
            }
            Action::Ack => self.ack(s),
            Action::Crash => {
                let Ok(bytes) = serde_json::to_vec(&s.durable) else {
                    return false;
                };
                let Ok((st, _)) = decode_state(&bytes) else {
                    return false;
                };
                let Ok(core) = Core::new(self.lockd_config(), st, self.now(s.ms), s.ms + 7) else {
                    return false;
                };
                s.core = core;
                s.unwritten = None;
                s.acked_early = None;
                s.restarts += 1;
                for cv in &mut s.clients {
                    let mut lost = std::mem::take(&mut cv.exclusive);
                    if let Some((members, _)) = &cv.gang {
                        // Gang members are reclaimed with the gang; not modelled.
                        for m in members {
                            lost.remove(m);
                        }
                    }
                    *cv = ClientView {
                        connects: cv.connects,
                        lost,
                        ..ClientView::default()
                    };
                }
                // A restored state may persist at its first step (expired leases, offers).
                self.input(s, Input::Tick);
            }
        }
        true
    }

    /// Every waiter is granted or ends within [`DRAIN_ROUNDS`] ticks once every client
    /// behaves fairly: the pending write completes each round, every client releases what it
    /// holds, and time advances by [`DRAIN_TICK_MS`]. Returns the waiters left, if any.
    pub fn drain(&self, s: &CoreState) -> Vec<(u8, String)> {
        let mut d = s.clone();
        let initial: BTreeSet<(u8, String)> = (0u8..)
            .zip(&d.clients)
            .filter(|(_, cv)| cv.connected)
            .flat_map(|(c, cv)| cv.waiting.keys().map(move |k| (c, k.clone())))
            .collect();
        let mut left = initial.clone();
        for _ in 0..DRAIN_ROUNDS {
            if left.is_empty() {
                break;
            }
            self.ack(&mut d);
            for c in 0..self.cfg.clients {
                let cv = &d.clients[usize::from(c)];
                if !cv.connected {
                    continue;
                }
                let mut acts = Vec::new();
                if matches!(cv.gang, Some((_, Some(_)))) {
                    acts.push(Action::ReleaseGang(c));
                }
                let gang_members: Vec<String> = match &cv.gang {
                    Some((members, Some(_))) => members.clone(),
                    _ => Vec::new(),
                };
                for (i, r) in (0u8..).zip(EXCL) {
                    if cv.exclusive.contains_key(r) && !gang_members.iter().any(|m| m == r) {
                        acts.push(Action::ReleaseExclusive(c, i));
                    }
                }
                acts.extend(cv.leases.keys().map(|id| Action::ReleaseLease(c, *id)));
                for a in acts {
                    self.apply(&mut d, &a);
                }
            }
            self.ack(&mut d);
            left.retain(|(c, k)| {
                let cv = &d.clients[usize::from(*c)];
                cv.connected && cv.waiting.contains_key(k)
            });
            d.ms += DRAIN_TICK_MS;
            self.input(&mut d, Input::Tick);
        }
        left.into_iter().collect()
    }

    /// Resources whose status shows more exclusive holders than allowed, or a reader beside
    /// a writer, or a pool above capacity; and exclusive leases two connected clients were
    /// told they hold. Empty = fine. Split by property in [`CoreModel::properties`].
    pub fn exclusive_violations(&self, s: &CoreState) -> Vec<String> {
        let mut v = Vec::new();
        let mut told: BTreeMap<&str, u8> = BTreeMap::new();
        for (c, cv) in (0u8..).zip(&s.clients) {
            if !cv.connected {
                continue;
            }
            for r in cv.exclusive.keys() {
                if let Some(o) = told.insert(r, c) {
                    v.push(format!("{r}: clients {o} and {c} both told they hold it"));
                }
            }
            for t in cv.leases.values() {
                let exclusive = t.kind == LeaseKind::Ttl
                    || (t.kind == LeaseKind::Shared && t.mode == Some(Mode::Exclusive));
                if exclusive {
                    if let Some(o) = told.insert(&t.resource, c) {
                        v.push(format!(
                            "{}: clients {o} and {c} both told they hold it",
                            t.resource
                        ));
                    }
                }
            }
        }
        // The full report: the summary (`false`) lists no version-2 lease.
        let st = s.core.status(self.now(s.ms), true);
        let mut ttl: BTreeMap<&str, usize> = BTreeMap::new();
        for l in st.leases.iter().filter(|l| l.state == "held") {
            if l.kind == Some(LeaseKind::Ttl) {
                *ttl.entry(l.resource.as_deref().unwrap_or("")).or_default() += 1;
            }
        }
        v.extend(
            ttl.into_iter()
                .filter(|(_, n)| *n > 1)
                .map(|(r, n)| format!("{r}: {n} live TTL leases")),
        );
        v
    }

    /// Shared resources with a writer beside anyone else (status).
    pub fn shared_violations(&self, s: &CoreState) -> Vec<String> {
        // The full report: the summary (`false`) lists no version-2 lease.
        let st = s.core.status(self.now(s.ms), true);
        let mut by: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for l in st.leases.iter().filter(|l| l.state == "held") {
            if l.kind == Some(LeaseKind::Shared) {
                let e = by.entry(l.resource.as_deref().unwrap_or("")).or_default();
                match l.lease.mode {
                    Some(Mode::Exclusive) => e.0 += 1,
                    _ => e.1 += 1,
                }
            }
        }
        by.into_iter()
            .filter(|(_, (w, r))| *w > 1 || (*w == 1 && *r > 0))
            .map(|(res, (w, r))| format!("{res}: {w} writers beside {r} readers"))
            .collect()
    }

    /// Offers allocated above capacity, counted by the pool and from the held leases.
    pub fn quantity_violations(&self, s: &CoreState) -> Vec<String> {
        // The full report: the summary (`false`) lists no version-2 lease.
        let st = s.core.status(self.now(s.ms), true);
        let mut alloc: BTreeMap<String, u64> = BTreeMap::new();
        for l in st.leases.iter().filter(|l| l.state == "held") {
            if l.kind == Some(LeaseKind::Quantity) {
                for a in l.lease.allocations.iter().flatten() {
                    *alloc.entry(a.offer.clone()).or_default() += u64::from(a.quantity);
                }
            }
        }
        let mut v = Vec::new();
        for o in st.pools.iter().flat_map(|p| &p.offers) {
            let used = alloc.get(&o.name).copied().unwrap_or(0);
            if used > o.capacity || o.allocated > o.capacity {
                v.push(format!(
                    "offer {}: {used} held ({} allocated), capacity {}",
                    o.name, o.allocated, o.capacity
                ));
            }
        }
        v
    }

    /// Connected clients that hold part of the gang they asked for (status: the members
    /// held by their session).
    pub fn partial_gangs(&self, s: &CoreState) -> Vec<String> {
        // The full report: the summary (`false`) lists no version-2 lease.
        let st = s.core.status(self.now(s.ms), true);
        let mut v = Vec::new();
        for (c, cv) in (0u8..).zip(&s.clients) {
            let Some((members, _)) = cv.gang.as_ref().filter(|_| cv.connected) else {
                continue;
            };
            let me = sid(c, cv.connects);
            let held = members
                .iter()
                .filter(|m| {
                    st.resources.iter().any(|r| {
                        &r.name == *m && r.state == LeaseState::Held && r.holder_session == Some(me)
                    })
                })
                .count();
            if held != 0 && held != members.len() {
                v.push(format!(
                    "client {c} holds {held} of its gang's {} members",
                    members.len()
                ));
            }
        }
        if self.cfg.kind_gangs {
            // TTL and shared gangs (status): what each holder name holds of the TTL gang's
            // members, and of the shared gang's in shared mode (the single shared acquires
            // are writers), connected or not (a TTL gang outlives its connection).
            for c in 0..self.cfg.clients {
                let name = format!("h{c}");
                for (kind, members) in
                    [(LeaseKind::Ttl, TTL_GANG), (LeaseKind::Shared, SHARED_GANG)]
                {
                    let held = st
                        .leases
                        .iter()
                        .filter(|l| {
                            l.state == "held"
                                && l.kind == Some(kind)
                                && l.holder.as_deref() == Some(name.as_str())
                                && members.contains(&l.resource.as_deref().unwrap_or(""))
                                && (kind == LeaseKind::Ttl || l.lease.mode == Some(Mode::Shared))
                        })
                        .count();
                    if held != 0 && held != members.len() {
                        v.push(format!(
                            "client {c} holds {held} of its {} gang's {} members",
                            kind.as_str(),
                            members.len()
                        ));
                    }
                }
            }
        }
        v
    }

    /// Whether a client was told it holds the whole TTL gang (`shared`: the shared gang).
    pub fn kind_gang_told(s: &CoreState, shared: bool) -> bool {
        let (kind, members) = if shared {
            (LeaseKind::Shared, SHARED_GANG)
        } else {
            (LeaseKind::Ttl, TTL_GANG)
        };
        s.clients.iter().any(|c| {
            members.iter().all(|m| {
                c.leases.values().any(|t| {
                    t.resource == *m && t.kind == kind && (!shared || t.mode == Some(Mode::Shared))
                })
            })
        })
    }

    /// Human-readable path: one line per action with what the clients hold after it.
    pub fn describe_path(&self, path: &[(CoreState, Option<Action>)]) -> String {
        let mut out = String::new();
        for (i, (_, a)) in path.iter().enumerate() {
            if let Some(a) = a {
                out.push_str(&format!("{i:2}. {a:?}\n"));
            }
        }
        if let Some((last, _)) = path.last() {
            out.push_str(&format!("final: {last:?}\n"));
        }
        out
    }
}

impl Model for CoreModel {
    type State = CoreState;
    type Action = Action;

    fn init_states(&self) -> Vec<CoreState> {
        self.initial().into_iter().collect()
    }

    fn actions(&self, s: &CoreState, acts: &mut Vec<Action>) {
        let cfg = &self.cfg;
        for (c, cv) in (0u8..).zip(&s.clients) {
            if !cv.connected {
                if cv.connects < cfg.max_connects {
                    acts.push(Action::Connect(c));
                }
                continue;
            }
            acts.push(Action::Disconnect(c));
            let waits = |k: &str| cv.waiting.contains_key(k);
            {
                for (i, r) in (0u8..).zip(EXCL).take(usize::from(cfg.exclusive)) {
                    let held = cv.exclusive.contains_key(r);
                    let in_gang = cv.gang.is_some();
                    let gang_granted = matches!(cv.gang, Some((_, Some(_))));
                    if !held && !waits(r) && !in_gang {
                        acts.push(Action::Exclusive(c, i));
                    }
                    if held && !gang_granted {
                        acts.push(Action::ReleaseExclusive(c, i));
                    }
                    // A client reclaims what it held before the crash, not in the middle
                    // of asking for a gang (lockd would let it hold a member outside it).
                    if cv.lost.contains_key(r) && !held && !waits(r) && !in_gang {
                        acts.push(Action::Reclaim(c, i));
                    }
                }
            }
            if cfg.gang {
                let busy = EXCL
                    .iter()
                    .any(|r| cv.exclusive.contains_key(*r) || waits(r));
                if cv.gang.is_none() && !busy {
                    acts.push(Action::Gang(c));
                }
                if matches!(cv.gang, Some((_, Some(_)))) {
                    acts.push(Action::ReleaseGang(c));
                }
            }
            let has = |k: &str| cv.leases.values().any(|t| t.resource == k);
            if cfg.ttl && !has(TTL_RES) && !waits(TTL_RES) {
                acts.push(Action::Ttl(c));
            }
            if cfg.shared && !has(SHARED_RES) && !waits(SHARED_RES) {
                if !cfg.kind_gangs {
                    acts.push(Action::Shared(c, false));
                }
                acts.push(Action::Shared(c, true));
            }
            if cfg.kind_gangs {
                for (shared, label, members) in [(false, "gt", TTL_GANG), (true, "gs", SHARED_GANG)]
                {
                    if !waits(label) && !members.iter().any(|m| has(m) || waits(m)) {
                        acts.push(Action::KindGang(c, shared));
                    }
                }
            }
            if cfg.quantity && !has(POOL) && !waits(POOL) {
                acts.push(Action::Quantity(c, 1));
                acts.push(Action::Quantity(c, 2));
            }
            for (id, t) in &cv.leases {
                acts.push(Action::ReleaseLease(c, *id));
                match t.kind {
                    LeaseKind::Ttl | LeaseKind::Quantity => acts.push(Action::Renew(c, *id)),
                    LeaseKind::Shared if t.mode == Some(Mode::Exclusive) => {
                        acts.push(Action::Commit(c, *id))
                    }
                    _ => {}
                }
            }
        }
        for d in &cfg.ticks {
            if s.ms + d <= cfg.max_ms {
                acts.push(Action::Tick(*d));
            }
        }
        if s.unwritten.is_some() {
            acts.push(Action::Ack);
        }
        if s.restarts < cfg.max_restarts {
            acts.push(Action::Crash);
        }
    }

    fn next_state(&self, last: &CoreState, a: Action) -> Option<CoreState> {
        let mut s = last.clone();
        if !self.apply(&mut s, &a) {
            return None;
        }
        self.fingerprint(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = vec![
            Property::always("never two exclusive holders", |m: &Self, s: &CoreState| {
                m.exclusive_violations(s).is_empty()
            }),
            Property::always("no reader beside a writer", |m: &Self, s: &CoreState| {
                m.shared_violations(s).is_empty()
            }),
            Property::always("no quantity above capacity", |m: &Self, s: &CoreState| {
                m.quantity_violations(s).is_empty()
            }),
            Property::always(
                "epochs strictly increase across restarts",
                |_: &Self, s: &CoreState| s.epoch_regress.is_none(),
            ),
            Property::always(
                "no grant visible before it is durable",
                |_: &Self, s: &CoreState| s.early_grant.is_none(),
            ),
            Property::always("no gang held in part", |m: &Self, s: &CoreState| {
                m.partial_gangs(s).is_empty()
            }),
            Property::sometimes("a grant is told", |_: &Self, s: &CoreState| s.grants > 0),
            Property::sometimes("a second epoch is told", |_: &Self, s: &CoreState| {
                s.max_epoch.values().any(|e| *e >= 2)
            }),
            Property::sometimes("a third epoch is told", |_: &Self, s: &CoreState| {
                s.max_epoch.values().any(|e| *e >= 3)
            }),
            Property::sometimes(
                "a grant is told after a restart",
                |_: &Self, s: &CoreState| s.grants_after_restart > 0,
            ),
            Property::sometimes(
                "a lease is reclaimed after a restart",
                |_: &Self, s: &CoreState| s.reclaims > 0,
            ),
            Property::sometimes("a gang is granted", |_: &Self, s: &CoreState| {
                s.clients
                    .iter()
                    .any(|c| matches!(c.gang, Some((_, Some(_)))))
            }),
            Property::sometimes("a TTL gang is granted", |_: &Self, s: &CoreState| {
                Self::kind_gang_told(s, false)
            }),
            Property::sometimes("a shared gang is granted", |_: &Self, s: &CoreState| {
                Self::kind_gang_told(s, true)
            }),
            Property::sometimes("a gang waits", |_: &Self, s: &CoreState| {
                s.clients.iter().any(|c| c.waiting.contains_key(GANG))
            }),
            Property::sometimes("two leases are held at once", |_: &Self, s: &CoreState| {
                s.clients
                    .iter()
                    .filter(|c| !c.leases.is_empty() || !c.exclusive.is_empty())
                    .count()
                    >= 2
            }),
        ];
        if self.cfg.kind_gangs {
            p.push(Property::always(
                "no writer overtakes a waiting shared gang",
                |_: &Self, s: &CoreState| s.overtaken.is_none(),
            ));
            p.push(Property::sometimes(
                "a writer waits behind a waiting shared gang",
                |_: &Self, s: &CoreState| {
                    let gangs: Vec<u64> = s
                        .clients
                        .iter()
                        .filter_map(|c| c.waiting.get("gs").and_then(|w| w.1))
                        .collect();
                    s.clients.iter().any(|c| {
                        c.waiting
                            .get(SHARED_RES)
                            .and_then(|w| w.1)
                            .is_some_and(|id| gangs.iter().any(|g| id > *g))
                    })
                },
            ));
        }
        if self.cfg.liveness {
            p.push(Property::always(
                "every waiter is granted or ends under a fair drain",
                |m: &Self, s: &CoreState| m.drain(s).is_empty(),
            ));
        }
        p
    }
}
