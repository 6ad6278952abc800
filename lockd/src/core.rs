//! The pure lock state machine: sessions, resources, leases, epochs, reconnect windows.
//!
//! No I/O, no clocks, no randomness from outside: time comes in as [`Now`], tokens come
//! from a seeded CSPRNG owned by the core, and persistence is an [`Output::Persist`] request
//! that the driver completes (write + fsync) before feeding back [`Input::Persisted`].
//! Every event produced while a persist is outstanding is held back in an ordered outbox
//! until that persist is acknowledged, so no grant ever leaves lockd before it is durable.
//!
//! Growth points (shared/exclusive modes, TTL leases, multi-resource acquisition, an etcd
//! backend) land here: a lease's shape is [`Lease`], admission is [`Core::acquire`], and the
//! persisted form is [`PersistedState`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use rand::{rngs::StdRng, RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::proto::{
    self, Counters, ErrorCode, Event, Notice, NoticeKind, PeerInfo, Request, ResourceReport,
    SessionReport, StatusReport,
};

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

/// Current on-disk format version.
pub const STATE_VERSION: u32 = 1;

/// The state file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedState {
    /// Format version ([`STATE_VERSION`]); other versions are refused.
    pub version: u32,
    /// Every resource ever granted: its last epoch and its holder (if held).
    pub resources: BTreeMap<String, PersistedResource>,
    /// Counters, so that they survive restarts.
    #[serde(default)]
    pub counters: Counters,
}

impl Default for PersistedState {
    fn default() -> Self {
        PersistedState {
            version: STATE_VERSION,
            resources: BTreeMap::new(),
            counters: Counters::default(),
        }
    }
}

/// One resource in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedResource {
    /// Last epoch granted: every later grant gets a strictly greater one.
    pub epoch: u64,
    /// The holder at the time of writing; on restart it gets a reconnect window.
    pub holder: Option<PersistedLease>,
}

/// A lease in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedLease {
    /// Holder name given at acquire.
    pub name: String,
    /// The lease's fencing epoch.
    pub epoch: u64,
    /// Secret the holder presents to reclaim after a reconnect.
    pub token: String,
    /// Wall-clock grant time (ms since the Unix epoch).
    pub granted_at_unix_ms: u64,
    /// Peer of the holder's connection at grant time (for humans).
    #[serde(default)]
    pub peer: Option<PeerInfo>,
    /// Revoked leases are never handed back by reclaim.
    #[serde(default)]
    pub revoked: bool,
}

/// A live lease, held by a connected session.
#[derive(Debug, Clone)]
struct Lease {
    /// The holding connection.
    session: SessionId,
    /// Holder name given at acquire.
    holder: String,
    /// Fencing epoch.
    epoch: u64,
    /// Reclaim secret.
    token: String,
    /// Wall-clock grant time.
    granted_at_unix_ms: u64,
    /// Revoke reason once revoked (lease stays until its connection closes).
    revoked: Option<String>,
}

/// Who holds a resource.
#[derive(Debug, Clone)]
enum LeaseState {
    /// Nobody: the next acquire is granted at once.
    Free,
    /// A connected session.
    Held(Lease),
    /// A lease from before a restart, waiting for its holder to reclaim it until `deadline`.
    Reclaiming {
        /// The persisted lease.
        lease: PersistedLease,
        /// End of the reconnect window.
        deadline: Instant,
    },
}

/// One queued acquire.
#[derive(Debug, Clone)]
struct Waiter {
    /// The waiting connection.
    session: SessionId,
    /// Holder name to use once granted.
    holder: String,
}

/// One lock.
#[derive(Debug, Clone)]
struct Resource {
    /// Last epoch granted (persisted).
    epoch: u64,
    /// Current holder.
    lease: LeaseState,
    /// FIFO of acquires.
    waiters: VecDeque<Waiter>,
}

/// One connection.
#[derive(Debug, Clone)]
struct Session {
    /// Who is connected (SO_PEERCRED / address).
    peer: PeerInfo,
    /// Resources it holds.
    holds: BTreeSet<String>,
    /// Resources it waits for.
    waits: BTreeSet<String>,
    /// Receives notices.
    watching: bool,
    /// Its connection is open (false: kept alive by anchors only).
    connected: bool,
    /// Open anchors.
    anchors: u32,
}

/// The state machine.
pub struct Core {
    /// Configuration.
    cfg: Config,
    /// Token source (seeded by the driver from the OS; tests seed it deterministically).
    rng: StdRng,
    /// Connected sessions.
    sessions: BTreeMap<SessionId, Session>,
    /// Known resources.
    resources: BTreeMap<String, Resource>,
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
    /// Sessions that asked to `watch` (so a notice costs O(watchers), not O(sessions)).
    watchers: BTreeSet<SessionId>,
    /// Whether a resource may still be `Reclaiming` (only ever entered at startup): while
    /// false, deadlines cost nothing per step instead of a walk over every resource.
    may_reclaim: bool,
}

impl Core {
    /// Build from the persisted state read at startup. Every persisted holder gets a
    /// reconnect window starting `now`.
    pub fn new(cfg: Config, state: PersistedState, now: Now, seed: u64) -> Core {
        let mut resources = BTreeMap::new();
        for (name, r) in state.resources {
            let lease = match r.holder {
                Some(l) => LeaseState::Reclaiming {
                    lease: l,
                    deadline: now.mono + cfg.reconnect_window,
                },
                None => LeaseState::Free,
            };
            resources.insert(
                name,
                Resource {
                    epoch: r.epoch,
                    lease,
                    waiters: VecDeque::new(),
                },
            );
        }
        let may_reclaim = resources
            .values()
            .any(|r: &Resource| matches!(r.lease, LeaseState::Reclaiming { .. }));
        Core {
            watchers: BTreeSet::new(),
            may_reclaim,
            cfg,
            rng: StdRng::seed_from_u64(seed),
            sessions: BTreeMap::new(),
            resources,
            counters: state.counters,
            seq_requested: 0,
            seq_done: 0,
            outbox: VecDeque::new(),
            pending: Vec::new(),
            dirty: false,
        }
    }

    /// The earliest reconnect-window deadline, if any: call `step(Tick)` then.
    pub fn next_deadline(&self) -> Option<Instant> {
        if !self.may_reclaim {
            return None;
        }
        self.resources
            .values()
            .filter_map(|r| match &r.lease {
                LeaseState::Reclaiming { deadline, .. } => Some(*deadline),
                _ => None,
            })
            .min()
    }

    /// Counters so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The session holding `resource`, if a connected one does.
    pub fn holder_session(&self, resource: &str) -> Option<SessionId> {
        match self.resources.get(resource).map(|r| &r.lease) {
            Some(LeaseState::Held(l)) => Some(l.session),
            _ => None,
        }
    }

    /// Last epoch granted for `resource` (0 if never).
    pub fn epoch(&self, resource: &str) -> u64 {
        self.resources.get(resource).map_or(0, |r| r.epoch)
    }

    /// Number of waiters per resource (metrics).
    pub fn waiters(&self) -> Vec<(String, usize, bool)> {
        self.resources
            .iter()
            .map(|(n, r)| {
                (
                    n.clone(),
                    r.waiters.len(),
                    !matches!(r.lease, LeaseState::Free),
                )
            })
            .collect()
    }

    /// Number of connected sessions (metrics).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Apply one input. Returns what the driver must do, in order.
    pub fn step(&mut self, now: Now, input: Input) -> Vec<Output> {
        self.dirty = false;
        self.expire(now);
        match input {
            Input::Connect { session, peer } => {
                self.sessions.insert(
                    session,
                    Session {
                        peer,
                        holds: BTreeSet::new(),
                        waits: BTreeSet::new(),
                        watching: false,
                        connected: true,
                        anchors: 0,
                    },
                );
                self.send(
                    session,
                    Event::Hello {
                        server: "lockd".into(),
                        version: crate::proto::PROTOCOL_VERSION,
                        session,
                    },
                );
            }
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
        if self.may_reclaim {
            self.may_reclaim = self
                .resources
                .values()
                .any(|r| matches!(r.lease, LeaseState::Reclaiming { .. }));
        }
        let mut out = Vec::new();
        if self.dirty {
            self.seq_requested += 1;
            out.push(Output::Persist {
                seq: self.seq_requested,
            });
        }
        let tag = self.seq_requested;
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

    /// The full persisted form of the current state.
    pub fn snapshot(&self) -> PersistedState {
        let resources = self
            .resources
            .iter()
            .map(|(name, r)| {
                let holder = match &r.lease {
                    LeaseState::Free => None,
                    LeaseState::Held(l) => Some(PersistedLease {
                        name: l.holder.clone(),
                        epoch: l.epoch,
                        token: l.token.clone(),
                        granted_at_unix_ms: l.granted_at_unix_ms,
                        peer: self.sessions.get(&l.session).map(|s| s.peer.clone()),
                        revoked: l.revoked.is_some(),
                    }),
                    LeaseState::Reclaiming { lease, .. } => Some(lease.clone()),
                };
                (
                    name.clone(),
                    PersistedResource {
                        epoch: r.epoch,
                        holder,
                    },
                )
            })
            .collect();
        PersistedState {
            version: STATE_VERSION,
            resources,
            counters: self.counters,
        }
    }

    /// The status report as of `now`.
    pub fn status(&self, now: Now) -> StatusReport {
        let resources = self
            .resources
            .iter()
            .map(|(name, r)| {
                let waiters = r.waiters.iter().map(|w| w.holder.clone()).collect();
                match &r.lease {
                    LeaseState::Free => ResourceReport {
                        name: name.clone(),
                        holder: None,
                        epoch: r.epoch,
                        state: proto::LeaseState::Free,
                        waiters,
                        holder_session: None,
                        holder_peer: None,
                        revoked: false,
                        granted_at_unix_ms: None,
                        reclaim_remaining_ms: None,
                    },
                    LeaseState::Held(l) => ResourceReport {
                        name: name.clone(),
                        holder: Some(l.holder.clone()),
                        epoch: l.epoch,
                        state: proto::LeaseState::Held,
                        waiters,
                        holder_session: Some(l.session),
                        holder_peer: self.sessions.get(&l.session).map(|s| s.peer.clone()),
                        revoked: l.revoked.is_some(),
                        granted_at_unix_ms: Some(l.granted_at_unix_ms),
                        reclaim_remaining_ms: None,
                    },
                    LeaseState::Reclaiming { lease, deadline } => ResourceReport {
                        name: name.clone(),
                        holder: Some(lease.name.clone()),
                        epoch: lease.epoch,
                        state: proto::LeaseState::Reclaiming,
                        waiters,
                        holder_session: None,
                        holder_peer: lease.peer.clone(),
                        revoked: lease.revoked,
                        granted_at_unix_ms: Some(lease.granted_at_unix_ms),
                        reclaim_remaining_ms: Some(
                            deadline.saturating_duration_since(now.mono).as_millis() as u64,
                        ),
                    },
                }
            })
            .collect();
        let sessions = self
            .sessions
            .iter()
            .map(|(id, s)| SessionReport {
                id: *id,
                peer: s.peer.clone(),
                holds: s.holds.iter().cloned().collect(),
                waits: s.waits.iter().cloned().collect(),
                watching: s.watching,
                connected: s.connected,
                anchors: s.anchors,
            })
            .collect();
        StatusReport {
            resources,
            counters: self.counters,
            sessions,
        }
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
        let watchers: Vec<SessionId> = self
            .watchers
            .iter()
            .filter(|id| self.sessions.get(id).is_some_and(|s| s.watching))
            .copied()
            .collect();
        for w in watchers {
            self.send(w, Event::Notice(notice.clone()));
        }
        self.pending.push(Output::Notice {
            notice,
            handoff_from,
        });
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
            } => self.acquire(now, s, resource, holder, wait),
            Request::Reclaim {
                resource,
                holder: _,
                epoch,
                token,
            } => self.reclaim(now, s, resource, epoch, token),
            Request::Release { resource } => self.release(now, s, resource),
            Request::Revoke {
                resource,
                reason,
                admin_token,
            } => self.revoke(now, s, resource, reason.unwrap_or_default(), admin_token),
            Request::Status => {
                let st = self.status(now);
                self.send(s, Event::Status(st));
            }
            Request::Watch => {
                if let Some(sess) = self.sessions.get_mut(&s) {
                    sess.watching = true;
                    self.watchers.insert(s);
                }
                self.send(s, Event::Watching {});
            }
            Request::Ping => self.send(s, Event::Pong {}),
            Request::Anchor => {
                // The driver feeds this only with a valid descriptor attached and watched.
                let anchors = match self.sessions.get_mut(&s) {
                    Some(sess) => {
                        sess.anchors += 1;
                        sess.anchors
                    }
                    None => return,
                };
                self.send(s, Event::Anchored { anchors });
            }
        }
    }

    fn acquire(&mut self, now: Now, s: SessionId, resource: String, holder: String, wait: bool) {
        let res = self
            .resources
            .entry(resource.clone())
            .or_insert_with(|| Resource {
                epoch: 0,
                lease: LeaseState::Free,
                waiters: VecDeque::new(),
            });
        if matches!(&res.lease, LeaseState::Held(l) if l.session == s) {
            return self.error(
                s,
                ErrorCode::AlreadyHeld,
                "this connection holds it".into(),
                Some(&resource),
            );
        }
        if res.waiters.iter().any(|w| w.session == s) {
            return self.error(
                s,
                ErrorCode::AlreadyQueued,
                "already queued".into(),
                Some(&resource),
            );
        }
        if matches!(res.lease, LeaseState::Free) && res.waiters.is_empty() {
            self.grant(now, &resource, s, holder, None);
        } else if !wait {
            let holder = match &res.lease {
                LeaseState::Held(l) => Some(l.holder.clone()),
                LeaseState::Reclaiming { lease, .. } => Some(lease.name.clone()),
                LeaseState::Free => None,
            };
            self.send(s, Event::Busy { resource, holder });
        } else {
            res.waiters.push_back(Waiter { session: s, holder });
            let position = res.waiters.len();
            if let Some(sess) = self.sessions.get_mut(&s) {
                sess.waits.insert(resource.clone());
            }
            self.send(s, Event::Queued { resource, position });
        }
    }

    fn grant(
        &mut self,
        now: Now,
        resource: &str,
        s: SessionId,
        holder: String,
        handoff_from: Option<Instant>,
    ) {
        let token = self.new_token();
        let Some(res) = self.resources.get_mut(resource) else {
            return;
        };
        res.epoch += 1;
        let epoch = res.epoch;
        res.lease = LeaseState::Held(Lease {
            session: s,
            holder: holder.clone(),
            epoch,
            token: token.clone(),
            granted_at_unix_ms: now.unix_ms,
            revoked: None,
        });
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.waits.remove(resource);
            sess.holds.insert(resource.to_string());
        }
        self.counters.grants += 1;
        self.dirty = true;
        self.send(
            s,
            Event::Granted {
                resource: resource.into(),
                holder: holder.clone(),
                epoch,
                token,
                reclaimed: false,
            },
        );
        self.notice(
            Notice {
                kind: NoticeKind::Granted,
                resource: resource.into(),
                holder: Some(holder),
                epoch,
                session: Some(s),
                reclaimed: false,
                after_revoke: false,
                reason: None,
                at_unix_ms: now.unix_ms,
            },
            handoff_from,
        );
    }

    /// Grant to the first waiter if the resource is free.
    fn grant_next(&mut self, now: Now, resource: &str, handoff_from: Option<Instant>) {
        let Some(res) = self.resources.get_mut(resource) else {
            return;
        };
        if !matches!(res.lease, LeaseState::Free) {
            return;
        }
        if let Some(w) = res.waiters.pop_front() {
            self.grant(now, resource, w.session, w.holder, handoff_from);
        }
    }

    /// End the live lease of `resource` (release or connection close).
    fn end_lease(&mut self, now: Now, resource: &str) -> Option<u64> {
        let res = self.resources.get_mut(resource)?;
        let LeaseState::Held(l) = std::mem::replace(&mut res.lease, LeaseState::Free) else {
            return None;
        };
        if let Some(sess) = self.sessions.get_mut(&l.session) {
            sess.holds.remove(resource);
        }
        if l.revoked.is_none() {
            self.counters.releases += 1;
        }
        self.dirty = true;
        self.notice(
            Notice {
                kind: NoticeKind::Released,
                resource: resource.into(),
                holder: Some(l.holder),
                epoch: l.epoch,
                session: Some(l.session),
                reclaimed: false,
                after_revoke: l.revoked.is_some(),
                reason: None,
                at_unix_ms: now.unix_ms,
            },
            None,
        );
        Some(l.epoch)
    }

    fn release(&mut self, now: Now, s: SessionId, resource: String) {
        if self.holder_session(&resource) == Some(s) {
            if let Some(epoch) = self.end_lease(now, &resource) {
                self.send(
                    s,
                    Event::Released {
                        resource: resource.clone(),
                        epoch,
                    },
                );
            }
            self.grant_next(now, &resource, Some(now.mono));
            return;
        }
        let queued = self
            .resources
            .get_mut(&resource)
            .and_then(|r| {
                let i = r.waiters.iter().position(|w| w.session == s)?;
                r.waiters.remove(i)
            })
            .is_some();
        if queued {
            if let Some(sess) = self.sessions.get_mut(&s) {
                sess.waits.remove(&resource);
            }
            self.send(s, Event::Cancelled { resource });
        } else {
            self.error(
                s,
                ErrorCode::NotHolder,
                "neither held nor queued by this connection".into(),
                Some(&resource),
            );
        }
    }

    fn disconnect(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.get_mut(&s) else {
            return;
        };
        if sess.anchors > 0 {
            // Anchored: the holder's processes live on. Keep its leases; withdraw what it
            // waits for (nobody could be told of a grant) and stop its notices.
            sess.connected = false;
            sess.watching = false;
            self.watchers.remove(&s);
            let waits = std::mem::take(&mut sess.waits);
            for r in &waits {
                if let Some(res) = self.resources.get_mut(r) {
                    res.waiters.retain(|w| w.session != s);
                }
            }
            return;
        }
        self.end_session(now, s);
    }

    fn anchor_closed(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.get_mut(&s) else {
            return;
        };
        sess.anchors = sess.anchors.saturating_sub(1);
        if sess.anchors == 0 && !sess.connected {
            self.end_session(now, s);
        }
    }

    /// The session is gone for good: withdraw its acquires, end its leases, grant the next.
    fn end_session(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.remove(&s) else {
            return;
        };
        self.watchers.remove(&s);
        for r in &sess.waits {
            if let Some(res) = self.resources.get_mut(r) {
                res.waiters.retain(|w| w.session != s);
            }
        }
        for r in &sess.holds {
            self.end_lease(now, r);
            self.grant_next(now, r, Some(now.mono));
        }
    }

    fn reclaim(&mut self, now: Now, s: SessionId, resource: String, epoch: u64, token: String) {
        let refuse = |why: &str| format!("cannot reclaim epoch {epoch}: {why}");
        let Some(res) = self.resources.get_mut(&resource) else {
            return self.error(
                s,
                ErrorCode::ReclaimRefused,
                refuse("unknown resource"),
                Some(&resource),
            );
        };
        let msg = match &res.lease {
            LeaseState::Reclaiming { lease, .. }
                if lease.epoch == epoch && ct_eq(&lease.token, &token) =>
            {
                None
            }
            LeaseState::Reclaiming { .. } => Some("epoch or token does not match"),
            LeaseState::Held(l) if l.session == s => {
                return self.error(
                    s,
                    ErrorCode::AlreadyHeld,
                    "this connection holds it".into(),
                    Some(&resource),
                );
            }
            LeaseState::Held(_) => Some("the resource is held by another lease"),
            LeaseState::Free => Some("no lease is waiting to be reclaimed (expired or released)"),
        };
        if let Some(m) = msg {
            return self.error(s, ErrorCode::ReclaimRefused, refuse(m), Some(&resource));
        }
        let LeaseState::Reclaiming { lease, .. } =
            std::mem::replace(&mut res.lease, LeaseState::Free)
        else {
            return;
        };
        // A lease revoked while it waited in the reconnect window comes back revoked: its
        // holder (which may still run an engine) learns it right after the grant and must
        // fence itself; the lease moves only once its session is gone.
        let revoked = lease
            .revoked
            .then(|| "revoked while lockd was restarting".to_string());
        res.lease = LeaseState::Held(Lease {
            session: s,
            holder: lease.name.clone(),
            epoch: lease.epoch,
            token: lease.token.clone(),
            granted_at_unix_ms: lease.granted_at_unix_ms,
            revoked: revoked.clone(),
        });
        // A session that also queued for it (re-queued before reclaiming) is no waiter now.
        res.waiters.retain(|w| w.session != s);
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.waits.remove(&resource);
            sess.holds.insert(resource.clone());
        }
        self.counters.reclaims += 1;
        self.dirty = true;
        self.send(
            s,
            Event::Granted {
                resource: resource.clone(),
                holder: lease.name.clone(),
                epoch,
                token: lease.token,
                reclaimed: true,
            },
        );
        if let Some(reason) = revoked {
            self.send(
                s,
                Event::Revoked {
                    resource: resource.clone(),
                    epoch,
                    reason,
                },
            );
        }
        self.notice(
            Notice {
                kind: NoticeKind::Granted,
                resource,
                holder: Some(lease.name),
                epoch,
                session: Some(s),
                reclaimed: true,
                after_revoke: false,
                reason: None,
                at_unix_ms: now.unix_ms,
            },
            None,
        );
    }

    fn revoke(
        &mut self,
        now: Now,
        s: SessionId,
        resource: String,
        reason: String,
        admin: Option<String>,
    ) {
        let tcp = self
            .sessions
            .get(&s)
            .is_some_and(|x| x.peer.transport == "tcp");
        if tcp {
            let ok = match (&self.cfg.admin_token, &admin) {
                (Some(want), Some(got)) => ct_eq(want, got),
                _ => false,
            };
            if !ok {
                return self.error(
                    s,
                    ErrorCode::Unauthorized,
                    "revoke over TCP needs lockd's --admin-token".into(),
                    Some(&resource),
                );
            }
        }
        let Some(res) = self.resources.get_mut(&resource) else {
            return self.error(
                s,
                ErrorCode::NotHeld,
                "nobody holds it".into(),
                Some(&resource),
            );
        };
        let mk = |holder: &str, epoch: u64, session: Option<SessionId>| Notice {
            kind: NoticeKind::Revoked,
            resource: resource.clone(),
            holder: Some(holder.to_string()),
            epoch,
            session,
            reclaimed: false,
            after_revoke: false,
            reason: Some(reason.clone()),
            at_unix_ms: now.unix_ms,
        };
        match &mut res.lease {
            LeaseState::Free => {
                self.error(
                    s,
                    ErrorCode::NotHeld,
                    "nobody holds it".into(),
                    Some(&resource),
                );
            }
            LeaseState::Held(l) => {
                let first = l.revoked.is_none();
                l.revoked = Some(reason.clone());
                let (holder, epoch, hs) = (l.holder.clone(), l.epoch, l.session);
                if first {
                    self.counters.revocations += 1;
                    self.dirty = true;
                    let n = mk(&holder, epoch, Some(hs));
                    self.notice(n, None);
                }
                self.send(
                    hs,
                    Event::Revoked {
                        resource: resource.clone(),
                        epoch,
                        reason: reason.clone(),
                    },
                );
                self.send(
                    s,
                    Event::RevokeSent {
                        resource,
                        epoch,
                        holder: Some(holder),
                    },
                );
            }
            LeaseState::Reclaiming { lease, .. } => {
                // Nothing is known of the holder but that it may still run: the lease keeps
                // waiting. Reclaimed, it comes back revoked (the holder fences itself);
                // unclaimed, it ends with the window. Never granted to another before then.
                let (holder, epoch, was) = (lease.name.clone(), lease.epoch, lease.revoked);
                lease.revoked = true;
                if !was {
                    self.counters.revocations += 1;
                    self.dirty = true;
                    let n = mk(&holder, epoch, None);
                    self.notice(n, None);
                }
                self.send(
                    s,
                    Event::RevokeSent {
                        resource: resource.clone(),
                        epoch,
                        holder: Some(holder),
                    },
                );
            }
        }
    }

    /// End reconnect windows whose deadline has passed.
    fn expire(&mut self, now: Now) {
        if !self.may_reclaim {
            return;
        }
        let due: Vec<String> = self
            .resources
            .iter()
            .filter(|(_, r)| matches!(&r.lease, LeaseState::Reclaiming { deadline, .. } if *deadline <= now.mono))
            .map(|(n, _)| n.clone())
            .collect();
        for name in due {
            let Some(res) = self.resources.get_mut(&name) else {
                continue;
            };
            let LeaseState::Reclaiming { lease, .. } =
                std::mem::replace(&mut res.lease, LeaseState::Free)
            else {
                continue;
            };
            if !lease.revoked {
                self.counters.expirations += 1;
            }
            self.dirty = true;
            self.notice(
                Notice {
                    kind: NoticeKind::Expired,
                    resource: name.clone(),
                    holder: Some(lease.name),
                    epoch: lease.epoch,
                    session: None,
                    reclaimed: false,
                    after_revoke: lease.revoked,
                    reason: None,
                    at_unix_ms: now.unix_ms,
                },
                None,
            );
            self.grant_next(now, &name, None);
        }
    }
}

/// Constant-time string comparison for secrets.
fn ct_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    //! Transition-by-transition tests of the pure core.
    use super::*;

    const W: u64 = 1000; // reconnect window in ms

    struct H {
        core: Core,
        base: Instant,
        ms: u64,
        /// Last state the driver was asked to persist.
        persisted: Option<PersistedState>,
        /// Number of persists requested.
        persists: usize,
    }

    fn peer(t: &str) -> PeerInfo {
        PeerInfo {
            transport: t.into(),
            pid: Some(7),
            uid: Some(0),
            gid: Some(0),
            addr: None,
        }
    }

    fn acq(r: &str, h: &str, wait: bool) -> Request {
        Request::Acquire {
            resource: r.into(),
            holder: h.into(),
            wait,
        }
    }

    impl H {
        fn with_state(st: PersistedState, admin: Option<&str>) -> H {
            let base = Instant::now();
            let cfg = Config {
                reconnect_window: Duration::from_millis(W),
                admin_token: admin.map(str::to_string),
            };
            let core = Core::new(
                cfg,
                st,
                Now {
                    mono: base,
                    unix_ms: 0,
                },
                42,
            );
            H {
                core,
                base,
                ms: 0,
                persisted: None,
                persists: 0,
            }
        }
        fn new() -> H {
            H::with_state(PersistedState::default(), None)
        }
        fn now(&self) -> Now {
            Now {
                mono: self.base + Duration::from_millis(self.ms),
                unix_ms: self.ms,
            }
        }
        /// Step without acknowledging persists.
        fn raw(&mut self, i: Input) -> Vec<Output> {
            let n = self.now();
            self.core.step(n, i)
        }
        /// Step like the driver: complete every persist, return everything else in order.
        fn step(&mut self, i: Input) -> Vec<Output> {
            let mut out = Vec::new();
            let mut q = vec![i];
            while let Some(i) = q.pop() {
                for o in self.raw(i) {
                    match o {
                        Output::Persist { seq } => {
                            self.persisted = Some(self.core.snapshot());
                            self.persists += 1;
                            q.push(Input::Persisted { seq });
                        }
                        o => out.push(o),
                    }
                }
            }
            out
        }
        fn connect(&mut self, s: SessionId, transport: &str) {
            let out = self.step(Input::Connect {
                session: s,
                peer: peer(transport),
            });
            assert_eq!(
                out,
                vec![Output::Send {
                    session: s,
                    event: Event::Hello {
                        server: "lockd".into(),
                        version: 1,
                        session: s
                    }
                }]
            );
        }
        fn req(&mut self, s: SessionId, r: Request) -> Vec<Output> {
            self.step(Input::Request { session: s, req: r })
        }
        /// Events sent to `s` among outputs.
        fn to(out: &[Output], s: SessionId) -> Vec<Event> {
            out.iter()
                .filter_map(|o| match o {
                    Output::Send { session, event } if *session == s => Some(event.clone()),
                    _ => None,
                })
                .collect()
        }
        fn granted(out: &[Output], s: SessionId) -> Option<(u64, String, bool)> {
            H::to(out, s).into_iter().find_map(|e| match e {
                Event::Granted {
                    epoch,
                    token,
                    reclaimed,
                    ..
                } => Some((epoch, token, reclaimed)),
                _ => None,
            })
        }
        fn err_code(out: &[Output], s: SessionId) -> Option<String> {
            H::to(out, s).into_iter().find_map(|e| match e {
                Event::Error { code, .. } => Some(code),
                _ => None,
            })
        }
        fn res(&self, r: &str) -> ResourceReport {
            let st = self.core.status(self.now());
            st.resources.into_iter().find(|x| x.name == r).unwrap()
        }
    }

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

    impl H {
        fn connect_raw_queued(&mut self, s: SessionId) {
            let out = self.raw(Input::Connect {
                session: s,
                peer: peer("unix"),
            });
            assert!(
                out.is_empty(),
                "hello must wait behind the outstanding persist: {out:?}"
            );
        }
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
    fn queue_positions_busy_and_duplicates() {
        let mut h = H::new();
        for s in 1..=4 {
            h.connect(s, "unix");
        }
        let out = h.req(1, acq("e", "a", true));
        assert_eq!(H::granted(&out, 1).unwrap().0, 1);
        let out = h.req(2, acq("e", "b", true));
        assert_eq!(
            H::to(&out, 2),
            vec![Event::Queued {
                resource: "e".into(),
                position: 1
            }]
        );
        let out = h.req(3, acq("e", "c", true));
        assert_eq!(
            H::to(&out, 3),
            vec![Event::Queued {
                resource: "e".into(),
                position: 2
            }]
        );
        let out = h.req(4, acq("e", "d", false));
        assert_eq!(
            H::to(&out, 4),
            vec![Event::Busy {
                resource: "e".into(),
                holder: Some("a".into())
            }]
        );
        assert_eq!(
            H::err_code(&h.req(1, acq("e", "a", true)), 1).as_deref(),
            Some("already_held")
        );
        assert_eq!(
            H::err_code(&h.req(2, acq("e", "b", true)), 2).as_deref(),
            Some("already_queued")
        );
        let r = h.res("e");
        assert_eq!(
            (r.state, r.holder.as_deref(), r.epoch),
            (proto::LeaseState::Held, Some("a"), 1)
        );
        assert_eq!(r.waiters, vec!["b".to_string(), "c".to_string()]);
        // Busy and queue changes are not persisted; only the grant was.
        assert_eq!(h.persists, 1);
    }

    #[test]
    fn holder_disconnect_releases_and_grants_next_with_higher_epoch() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        h.ms = 5;
        let out = h.step(Input::Disconnect { session: 1 });
        let (epoch, _, reclaimed) = H::granted(&out, 2).unwrap();
        assert_eq!((epoch, reclaimed), (2, false));
        let handoff = out.iter().find_map(|o| match o {
            Output::Notice {
                notice,
                handoff_from,
            } if notice.kind == NoticeKind::Granted => Some(*handoff_from),
            _ => None,
        });
        assert_eq!(handoff, Some(Some(h.base + Duration::from_millis(5))));
        let c = h.core.counters();
        assert_eq!(
            (c.grants, c.releases, c.expirations, c.revocations),
            (2, 1, 0, 0)
        );
        assert_eq!(
            h.persisted.as_ref().unwrap().resources["e"]
                .holder
                .as_ref()
                .unwrap()
                .name,
            "b"
        );
    }

    #[test]
    fn last_holder_leaving_persists_a_free_resource_keeping_the_epoch() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, acq("e", "a", true));
        h.step(Input::Disconnect { session: 1 });
        let st = h.persisted.clone().unwrap();
        assert_eq!(
            st.resources["e"],
            PersistedResource {
                epoch: 1,
                holder: None
            }
        );
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
    }

    #[test]
    fn explicit_release_cancel_and_not_holder() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        assert_eq!(
            H::to(
                &h.req(
                    2,
                    Request::Release {
                        resource: "e".into()
                    }
                ),
                2
            ),
            vec![Event::Cancelled {
                resource: "e".into()
            }]
        );
        assert!(h.res("e").waiters.is_empty());
        assert_eq!(
            H::err_code(
                &h.req(
                    3,
                    Request::Release {
                        resource: "e".into()
                    }
                ),
                3
            )
            .as_deref(),
            Some("not_holder")
        );
        h.req(3, acq("e", "c", true));
        let out = h.req(
            1,
            Request::Release {
                resource: "e".into(),
            },
        );
        assert_eq!(
            H::to(&out, 1),
            vec![Event::Released {
                resource: "e".into(),
                epoch: 1
            }]
        );
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert_eq!(h.core.counters().releases, 1);
    }

    #[test]
    fn waiter_disconnect_leaves_the_queue() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        h.req(3, acq("e", "c", true));
        h.step(Input::Disconnect { session: 2 });
        assert_eq!(h.res("e").waiters, vec!["c".to_string()]);
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert!(H::to(&out, 2).is_empty());
    }

    #[test]
    fn independent_resources_do_not_interfere() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "unix");
        assert_eq!(H::granted(&h.req(1, acq("x", "a", true)), 1).unwrap().0, 1);
        assert_eq!(H::granted(&h.req(2, acq("y", "b", true)), 2).unwrap().0, 1);
        assert_eq!(H::granted(&h.req(1, acq("y2", "a", true)), 1).unwrap().0, 1);
    }

    fn restarted() -> (H, String) {
        let mut h = H::new();
        h.connect(1, "unix");
        let (_, token, _) = H::granted(&h.req(1, acq("e", "a", true)), 1).unwrap();
        let st = h.persisted.clone().unwrap();
        (H::with_state(st, None), token)
    }

    #[test]
    fn restart_opens_a_window_then_reclaim_returns_the_same_epoch() {
        let (mut h, token) = restarted();
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
        assert_eq!(
            h.core.next_deadline(),
            Some(h.base + Duration::from_millis(W))
        );
        h.connect(2, "unix");
        h.connect(3, "unix");
        assert_eq!(
            H::to(&h.req(3, acq("e", "b", true)), 3),
            vec![Event::Queued {
                resource: "e".into(),
                position: 1
            }]
        );
        assert_eq!(H::to(&h.req(3, acq("e", "b", false)), 3).len(), 1);
        h.ms = 400;
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token: token.clone(),
            },
        );
        assert_eq!(H::granted(&out, 2), Some((1, token, true)));
        assert!(H::to(&out, 3).is_empty());
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        assert_eq!(h.core.next_deadline(), None);
        let c = h.core.counters();
        assert_eq!((c.grants, c.reclaims, c.expirations), (1, 1, 0));
        h.ms = 5000;
        assert!(
            h.step(Input::Tick).is_empty(),
            "nothing expires once reclaimed"
        );
    }

    #[test]
    fn reclaim_by_a_queued_session_takes_it_out_of_the_queue() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(2, acq("e", "a", true));
        h.req(3, acq("e", "b", true));
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(H::granted(&out, 2).map(|g| g.0), Some(1));
        assert_eq!(h.res("e").waiters, vec!["b".to_string()]);
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(
            H::granted(&out, 3).unwrap().0,
            2,
            "the other waiter is next, not the holder"
        );
    }

    #[test]
    fn reclaim_with_wrong_token_or_epoch_is_refused() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        let bad = [
            ("e", 1, "nope".to_string()),
            ("e", 2, token.clone()),
            ("zz", 1, token.clone()),
        ];
        for (r, epoch, t) in bad {
            let out = h.req(
                2,
                Request::Reclaim {
                    resource: r.into(),
                    holder: "a".into(),
                    epoch,
                    token: t,
                },
            );
            assert_eq!(H::err_code(&out, 2).as_deref(), Some("reclaim_refused"));
        }
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
    }

    #[test]
    fn window_expiry_counts_expired_and_grants_the_next_waiter_a_new_epoch() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        h.ms = W - 1;
        assert!(h.step(Input::Tick).is_empty());
        h.ms = W;
        let out = h.step(Input::Tick);
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert!(out.iter().any(|o| matches!(o, Output::Notice { notice, .. } if notice.kind == NoticeKind::Expired && notice.epoch == 1)));
        let c = h.core.counters();
        assert_eq!((c.expirations, c.releases, c.grants), (1, 0, 2));
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("reclaim_refused"));
    }

    #[test]
    fn expiry_without_waiters_frees_and_first_acquirer_wins() {
        let (mut h, _) = restarted();
        h.ms = W + 10;
        h.step(Input::Tick);
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
        h.connect(5, "unix");
        assert_eq!(H::granted(&h.req(5, acq("e", "z", true)), 5).unwrap().0, 2);
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
    fn revoke_tells_the_holder_and_keeps_the_lease_until_close() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        let out = h.req(
            3,
            Request::Revoke {
                resource: "e".into(),
                reason: Some("drain".into()),
                admin_token: None,
            },
        );
        assert_eq!(
            H::to(&out, 1),
            vec![Event::Revoked {
                resource: "e".into(),
                epoch: 1,
                reason: "drain".into()
            }]
        );
        assert_eq!(
            H::to(&out, 3),
            vec![Event::RevokeSent {
                resource: "e".into(),
                epoch: 1,
                holder: Some("a".into())
            }]
        );
        assert!(H::granted(&out, 2).is_none());
        let r = h.res("e");
        assert_eq!((r.state, r.revoked), (proto::LeaseState::Held, true));
        // Revoking again re-notifies but does not count twice.
        h.req(
            3,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: None,
            },
        );
        assert_eq!(h.core.counters().revocations, 1);
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases), (1, 0));
    }

    #[test]
    fn revoke_over_tcp_needs_the_admin_token() {
        let mut h = H::with_state(PersistedState::default(), Some("s3cret"));
        h.connect(1, "unix");
        h.connect(2, "tcp");
        h.req(1, acq("e", "a", true));
        for tok in [None, Some("wrong".to_string())] {
            let out = h.req(
                2,
                Request::Revoke {
                    resource: "e".into(),
                    reason: None,
                    admin_token: tok,
                },
            );
            assert_eq!(H::err_code(&out, 2).as_deref(), Some("unauthorized"));
            assert!(H::to(&out, 1).is_empty());
        }
        let out = h.req(
            2,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: Some("s3cret".into()),
            },
        );
        assert!(matches!(H::to(&out, 2)[0], Event::RevokeSent { .. }));
        // Without a configured token, TCP revoke is always refused.
        let mut h = H::new();
        h.connect(1, "unix");
        h.connect(2, "tcp");
        h.req(1, acq("e", "a", true));
        let out = h.req(
            2,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: Some(String::new()),
            },
        );
        assert_eq!(H::err_code(&out, 2).as_deref(), Some("unauthorized"));
    }

    #[test]
    fn revoke_of_free_is_not_held_and_of_reclaiming_waits_for_the_holder() {
        let mut h = H::new();
        h.connect(1, "unix");
        let out = h.req(
            1,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: None,
            },
        );
        assert_eq!(H::err_code(&out, 1).as_deref(), Some("not_held"));
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        let out = h.req(
            2,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: None,
            },
        );
        // The holder may still run: nobody else is granted while the window is open.
        assert_eq!(H::granted(&out, 3), None, "{out:?}");
        assert!(matches!(
            H::to(&out, 2)[..],
            [Event::RevokeSent { epoch: 1, .. }]
        ));
        assert_eq!(h.res("e").state, proto::LeaseState::Reclaiming);
        assert!(h.res("e").revoked);
        assert_eq!(h.core.counters().revocations, 1);
        // A second revoke is not counted again.
        h.req(
            2,
            Request::Revoke {
                resource: "e".into(),
                reason: None,
                admin_token: None,
            },
        );
        assert_eq!(h.core.counters().revocations, 1);
        // The holder comes back: it gets its lease, and at once the revocation.
        h.connect(4, "unix");
        let out = h.req(
            4,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        let ev = H::to(&out, 4);
        assert!(
            matches!(
                &ev[..],
                [
                    Event::Granted {
                        epoch: 1,
                        reclaimed: true,
                        ..
                    },
                    Event::Revoked { epoch: 1, .. }
                ]
            ),
            "{ev:?}"
        );
        assert_eq!(H::granted(&out, 3), None);
        // It fences itself and goes: only now is the waiter granted, with a new epoch.
        let out = h.step(Input::Disconnect { session: 4 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases, c.expirations), (1, 0, 0));
    }

    #[test]
    fn a_revoked_lease_comes_back_revoked_after_restart_or_ends_with_the_window() {
        let revoked_state = || {
            let mut h = H::new();
            h.connect(1, "unix");
            let (_, token, _) = H::granted(&h.req(1, acq("e", "a", true)), 1).unwrap();
            h.req(
                1,
                Request::Revoke {
                    resource: "e".into(),
                    reason: None,
                    admin_token: None,
                },
            );
            let st = h.persisted.clone().unwrap();
            assert!(st.resources["e"].holder.as_ref().unwrap().revoked);
            (st, token)
        };
        // Reclaimed: granted and revoked at once.
        let (st, token) = revoked_state();
        let mut h = H::with_state(st, None);
        h.connect(2, "unix");
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert!(matches!(
            &H::to(&out, 2)[..],
            [
                Event::Granted {
                    reclaimed: true,
                    ..
                },
                Event::Revoked { .. }
            ]
        ));
        assert!(h.res("e").revoked);
        // Not reclaimed: it ends with the window, and its expiry is not counted again.
        let (st, _) = revoked_state();
        let mut h = H::with_state(st, None);
        h.ms = W;
        h.step(Input::Tick);
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.expirations), (1, 0));
    }

    fn session(h: &H, id: SessionId) -> Option<SessionReport> {
        h.core
            .status(h.now())
            .sessions
            .into_iter()
            .find(|x| x.id == id)
    }

    #[test]
    fn an_anchored_lease_outlives_its_connection_until_the_anchor_closes() {
        let mut h = H::new();
        h.connect(1, "unix");
        assert_eq!(
            H::to(&h.req(1, Request::Anchor), 1),
            vec![Event::Anchored { anchors: 1 }]
        );
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("e", "b", true));
        // The holder's supervisor dies: its engine's processes still hold the anchor.
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 2), None, "{out:?}");
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        let s1 = session(&h, 1).unwrap();
        assert!(!s1.connected);
        assert_eq!(s1.anchors, 1);
        assert_eq!(s1.holds, vec!["e".to_string()]);
        // The last process holding the anchor dies.
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        assert!(session(&h, 1).is_none());
        assert_eq!(h.core.counters().releases, 1);
        // The handoff is measured from the anchor's close.
        assert!(out.iter().any(|o| matches!(o, Output::Notice { handoff_from: Some(_), notice } if notice.kind == NoticeKind::Granted)));
    }

    #[test]
    fn every_anchor_must_close_and_a_closed_anchor_alone_ends_nothing() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, Request::Anchor);
        assert_eq!(
            H::to(&h.req(1, Request::Anchor), 1),
            vec![Event::Anchored { anchors: 2 }]
        );
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("e", "b", true));
        // An anchor closing while the connection is open changes nothing.
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2), None);
        assert_eq!(session(&h, 1).unwrap().anchors, 1);
        h.step(Input::Disconnect { session: 1 });
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        // Without anchors a disconnect releases at once (the connection is the lock).
        h.connect(3, "unix");
        h.req(3, acq("e", "c", true));
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 3);
        // A stray AnchorClosed for an unknown session is ignored.
        assert!(h.step(Input::AnchorClosed { session: 99 }).is_empty());
    }

    #[test]
    fn a_disconnected_anchored_session_withdraws_its_waits_and_hears_nothing() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, Request::Anchor);
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("f", "b", true));
        h.req(1, acq("f", "a", true));
        h.req(1, Request::Watch);
        h.step(Input::Disconnect { session: 1 });
        assert!(session(&h, 1).unwrap().waits.is_empty());
        assert!(h.res("f").waiters.is_empty());
        // A revoke of its lease is sent nowhere, and the lease stays until the anchor closes.
        h.connect(3, "unix");
        let out = h.req(
            3,
            Request::Revoke {
                resource: "e".into(),
                reason: Some("ops".into()),
                admin_token: None,
            },
        );
        assert!(H::to(&out, 1).is_empty(), "{out:?}");
        assert!(matches!(H::to(&out, 3)[..], [Event::RevokeSent { .. }]));
        // Releasing f frees it: session 1 does not get it.
        let out = h.req(
            2,
            Request::Release {
                resource: "f".into(),
            },
        );
        assert!(H::to(&out, 1).is_empty());
        assert_eq!(h.res("f").state, proto::LeaseState::Free);
        // Requests "from" it are ignored (no connection can carry them).
        assert!(h.req(1, Request::Ping).is_empty());
        h.req(3, acq("e", "c", true));
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases), (1, 1));
    }

    #[test]
    fn a_reclaim_on_an_anchored_connection_is_anchored() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.req(2, Request::Anchor);
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(
            H::granted(&out, 2),
            Some((1, H::granted(&out, 2).unwrap().1, true))
        );
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(H::granted(&out, 3), None);
        let out = h.step(Input::AnchorClosed { session: 2 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
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
    fn epochs_stay_monotonic_across_many_restarts() {
        let mut st = PersistedState::default();
        let mut last = 0;
        for _ in 0..20 {
            let mut h = H::with_state(st.clone(), None);
            h.ms = W;
            h.step(Input::Tick);
            h.connect(1, "unix");
            let (epoch, _, _) = H::granted(&h.req(1, acq("e", "a", true)), 1).unwrap();
            assert!(epoch > last, "{epoch} after {last}");
            last = epoch;
            st = h.persisted.clone().unwrap();
        }
    }

    #[test]
    fn status_ping_and_unknown_sessions() {
        let mut h = H::new();
        assert!(
            h.req(77, Request::Ping).is_empty(),
            "requests of unknown sessions are dropped"
        );
        h.connect(1, "unix");
        assert_eq!(H::to(&h.req(1, Request::Ping), 1), vec![Event::Pong {}]);
        h.req(1, acq("e", "a", true));
        let out = h.req(1, Request::Status);
        let Event::Status(st) = &H::to(&out, 1)[0] else {
            panic!()
        };
        assert_eq!(st.resources[0].holder_peer.as_ref().unwrap().pid, Some(7));
        assert_eq!(st.sessions[0].holds, vec!["e".to_string()]);
        assert_eq!(st.counters.grants, 1);
        assert!(h.step(Input::Disconnect { session: 42 }).is_empty());
    }
}
