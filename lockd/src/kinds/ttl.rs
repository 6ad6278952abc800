//! TTL leases: a lease that survives its connection and ends when it is not renewed in time.
//!
//! Semantics (issue 11 point 1, seed `000_8e68c6fca64f2b10`):
//!
//! * **Exclusive per resource** (by default). The seed's own manager never checks conflicts
//!   (two holders may "hold" the same resource), but every use it names (one GPU to one
//!   worker, a Chubby-style lock) wants one holder per resource, so [`TtlTable::acquire`]
//!   refuses a resource that already has a live TTL lease ([`TtlError::Busy`]). Queueing is
//!   the core's business (it retries a waiter when an [`Ended`] frees the resource). With
//!   [`TtlConfig::exclusive_per_resource`] off, the table tracks lifetimes only: the core
//!   uses that for short, background-renewed shared/exclusive leases (seed 002), whose
//!   admission [`crate::kinds::shared`] decides.
//! * **States.** A lease id is [`LeaseState::Held`] from acquire until its end; it then is
//!   [`LeaseState::Expired`] (not renewed before its deadline), [`LeaseState::Revoked`]
//!   (ended by an authority, with who and why) or [`LeaseState::Released`] (its holder gave it
//!   back). Ended leases stay queryable as tombstones for a bounded time and count
//!   ([`TtlConfig`]); past that the id is [`LeaseState::Unknown`], exactly like an id that
//!   never existed. Unlike the seed, a revoked lease is never reported as expired, and
//!   "revoked" is distinguishable from "never existed" as long as the tombstone lives.
//!   [`LeaseState::ternary`] maps Held/Expired/Revoked to the seed's +1/0/−1.
//! * **Expiry is exact.** A lease with deadline `d` is held at every `now < d` and expired at
//!   `now >= d`. Every mutating call first expires what is due at its `now` (and reports it
//!   in [`Outcome::ended`]), so a renew at or after the deadline is refused even if the
//!   driver's timer for [`TtlTable::next_deadline`] has not fired yet.
//! * **Renew** restarts the full TTL from `now` (the seed's "reset remaining to the original
//!   TTL") and is refused once the lease has ended: the holder must re-acquire from scratch
//!   and gets a new lease id.
//! * **Counters** per end reason ([`TtlCounters`]): `acquired = active + released + expired +
//!   revoked` always holds, and revocations are counted apart from expiries.
//! * **Time.** TTLs have millisecond resolution (sub-millisecond parts are dropped). Each
//!   lease has a monotonic deadline (`Instant`, what [`TtlTable::tick`] compares) and a
//!   wall-clock expiry (`expires_at_unix_ms`, what is persisted): both are computed from the
//!   same [`Now`] so they denote the same moment.
//! * **Restart clock assumption.** [`TtlTable::restore`] rebuilds each monotonic deadline from
//!   the persisted wall-clock expiry: `remaining = expires_at_unix_ms - now.unix_ms`, capped
//!   at the lease's TTL. It assumes the wall clock did not step during the downtime (NTP
//!   slews are fine). A forward step shortens leases (they end early: safe for exclusion);
//!   a backward step could only lengthen them, and the cap bounds that to at most one TTL from
//!   the restart. Tombstone ages are rebuilt the same way.
//!
//! The table is pure: no I/O, no clock, no randomness. Lease ids and tokens are inputs (the
//! core owns the id space and must never reuse an id; a reused id is refused while its lease
//! or tombstone is known). Operations are O(log n) in the number of leases and tombstones.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::core::Now;

/// Identifies one lease; allocated by the core, never reused.
pub type LeaseId = u64;

/// The longest TTL the table accepts (10 years): deadlines never overflow `Instant`. The core's
/// own `--max-lease-time` is normally far lower.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Table settings: exclusivity and the bounds of the tombstone set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlConfig {
    /// `true` (the default, TTL leases as a lock): at most one live lease per resource.
    /// `false`: the table only tracks lifetimes (the seed's own manager never checks
    /// conflicts); the core uses such a table for the TTLs of shared/exclusive leases, whose
    /// admission is [`crate::kinds::shared`]'s.
    pub exclusive_per_resource: bool,
    /// At most this many ended leases are remembered (oldest forgotten first).
    pub max_tombstones: usize,
    /// An ended lease is forgotten this long after its end.
    pub tombstone_max_age: Duration,
}

impl Default for TtlConfig {
    fn default() -> Self {
        TtlConfig {
            exclusive_per_resource: true,
            max_tombstones: 10_000,
            tombstone_max_age: Duration::from_secs(3600),
        }
    }
}

/// Why a lease ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EndReason {
    /// Its holder released it.
    Released,
    /// It was not renewed before its deadline.
    Expired,
    /// An authority ended it.
    Revoked {
        /// Who revoked (an admin name, a session, "lockd").
        by: String,
        /// Why, free text.
        why: String,
    },
}

impl fmt::Display for EndReason {
    /// `released`, `expired` or `revoked:<by>:<why>` (the wire/CLI spelling).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::Released => f.write_str("released"),
            EndReason::Expired => f.write_str("expired"),
            EndReason::Revoked { by, why } => write!(f, "revoked:{by}:{why}"),
        }
    }
}

/// The state of a lease id, as [`TtlTable::state`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Live: its holder may use and renew it.
    Held,
    /// Ended because it was not renewed in time (tombstone).
    Expired,
    /// Ended by an authority (tombstone).
    Revoked {
        /// Who revoked.
        by: String,
        /// Why.
        why: String,
    },
    /// Ended by its holder (tombstone).
    Released,
    /// Never existed, or ended longer ago than the tombstone bounds.
    Unknown,
}

impl LeaseState {
    /// The seed's ternary value: Held +1, Expired 0, Revoked −1; `None` for Released and
    /// Unknown (outside the seed's model).
    pub fn ternary(&self) -> Option<i8> {
        match self {
            LeaseState::Held => Some(1),
            LeaseState::Expired => Some(0),
            LeaseState::Revoked { .. } => Some(-1),
            LeaseState::Released | LeaseState::Unknown => None,
        }
    }

    fn from_reason(r: &EndReason) -> LeaseState {
        match r {
            EndReason::Released => LeaseState::Released,
            EndReason::Expired => LeaseState::Expired,
            EndReason::Revoked { by, why } => LeaseState::Revoked {
                by: by.clone(),
                why: why.clone(),
            },
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseState::Held => f.write_str("held"),
            LeaseState::Expired => f.write_str("expired"),
            LeaseState::Revoked { by, why } => write!(f, "revoked:{by}:{why}"),
            LeaseState::Released => f.write_str("released"),
            LeaseState::Unknown => f.write_str("unknown"),
        }
    }
}

/// A TTL acquire request; every identifier is allocated by the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TtlRequest {
    /// The new lease's id (never reused).
    pub id: LeaseId,
    /// The resource.
    pub resource: String,
    /// The holder's name.
    pub holder: String,
    /// Secret the holder presents to renew/release from another connection (opaque here).
    pub token: String,
    /// Fencing epoch from the core's per-resource counter (stored and reported, not checked).
    pub epoch: u64,
    /// The TTL (ms resolution); each renew restarts it.
    pub ttl: Duration,
}

/// Why a TTL operation was refused. Nothing changes in the table when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TtlError {
    /// The resource already has a live TTL lease.
    #[error("resource {resource:?} is held by {holder:?} (lease {lease})")]
    Busy {
        /// The resource asked for.
        resource: String,
        /// Its current holder.
        holder: String,
        /// The current lease's id.
        lease: LeaseId,
    },
    /// The id is already in use by a live lease or a tombstone.
    #[error("lease id {0} is already in use")]
    DuplicateId(LeaseId),
    /// A TTL under one millisecond.
    #[error("a TTL must be at least 1 ms")]
    ZeroTtl,
    /// A TTL over [`MAX_TTL`].
    #[error("a TTL must be at most {} s", MAX_TTL.as_secs())]
    TtlTooLong,
    /// The lease has ended: renew/release/revoke refused, re-acquire from scratch.
    #[error("lease {id} has ended ({state}): re-acquire from scratch")]
    Ended {
        /// The lease.
        id: LeaseId,
        /// How it ended.
        state: LeaseState,
    },
    /// No such lease (never existed, or its tombstone was forgotten).
    #[error("lease {0} is unknown")]
    Unknown(LeaseId),
}

/// Persisted records that cannot be restored (two leases on one resource, duplicate ids).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inconsistent TTL records: {0}")]
pub struct RestoreError(pub String);

/// A lease that ended: what the core persists, reports and uses to wake waiters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// The lease.
    pub id: LeaseId,
    /// Its resource (now free).
    pub resource: String,
    /// Its holder.
    pub holder: String,
    /// Its fencing epoch.
    pub epoch: u64,
    /// Why it ended.
    pub reason: EndReason,
    /// Wall-clock end time (ms since the Unix epoch).
    pub ended_at_unix_ms: u64,
}

/// A live lease as the table reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The lease.
    pub id: LeaseId,
    /// The resource it holds.
    pub resource: String,
    /// Its holder.
    pub holder: String,
    /// Its fencing epoch.
    pub epoch: u64,
    /// Its TTL (each renew restarts it).
    pub ttl: Duration,
    /// Monotonic deadline: expired at `now >= deadline`.
    pub deadline: Instant,
    /// The same deadline on the wall clock (persisted).
    pub expires_at_unix_ms: u64,
    /// Wall-clock grant time.
    pub granted_at_unix_ms: u64,
    /// Successful renewals so far.
    pub renewals: u64,
}

/// Counters per outcome; `acquired == active + released + expired + revoked`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlCounters {
    /// Leases granted.
    #[serde(default)]
    pub acquired: u64,
    /// Successful renewals.
    #[serde(default)]
    pub renewed: u64,
    /// Leases released by their holder.
    #[serde(default)]
    pub released: u64,
    /// Leases that expired.
    #[serde(default)]
    pub expired: u64,
    /// Leases revoked (kept apart from expiries).
    #[serde(default)]
    pub revoked: u64,
}

/// A live lease in the persisted state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlLeaseRecord {
    /// The lease id.
    pub id: LeaseId,
    /// Its resource.
    pub resource: String,
    /// Its holder.
    pub holder: String,
    /// Secret presented to renew/release from another connection (opaque here).
    pub token: String,
    /// Its fencing epoch.
    #[serde(default)]
    pub epoch: u64,
    /// The TTL in ms.
    pub ttl_ms: u64,
    /// Wall-clock grant time.
    pub granted_at_unix_ms: u64,
    /// Wall-clock expiry: the deadline that survives a restart.
    pub expires_at_unix_ms: u64,
    /// Renewals so far.
    #[serde(default)]
    pub renewals: u64,
}

/// An ended lease in the persisted state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlTombstoneRecord {
    /// The lease id.
    pub id: LeaseId,
    /// Its resource.
    pub resource: String,
    /// Its holder.
    pub holder: String,
    /// Its fencing epoch.
    #[serde(default)]
    pub epoch: u64,
    /// Why it ended.
    pub reason: EndReason,
    /// Wall-clock end time.
    pub ended_at_unix_ms: u64,
}

/// Everything the TTL table persists.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlRecords {
    /// Live leases.
    #[serde(default)]
    pub leases: Vec<TtlLeaseRecord>,
    /// Tombstones, oldest first.
    #[serde(default)]
    pub tombstones: Vec<TtlTombstoneRecord>,
    /// Counters.
    #[serde(default)]
    pub counters: TtlCounters,
}

/// The result of an operation plus the leases that the implicit expiry at its `now` ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome<T> {
    /// What the operation itself did (or why it was refused).
    pub result: Result<T, TtlError>,
    /// Leases that expired at this `now` before the operation ran (persist and report them).
    pub ended: Vec<Ended>,
}

#[derive(Debug, Clone)]
struct Lease {
    resource: String,
    holder: String,
    token: String,
    epoch: u64,
    ttl: Duration,
    deadline: Instant,
    expires_at_unix_ms: u64,
    granted_at_unix_ms: u64,
    renewals: u64,
}

/// The TTL lease table (pure).
#[derive(Debug, Clone)]
pub struct TtlTable {
    cfg: TtlConfig,
    leases: BTreeMap<LeaseId, Lease>,
    by_resource: BTreeSet<(String, LeaseId)>,
    by_holder: BTreeSet<(String, LeaseId)>,
    deadlines: BTreeSet<(Instant, LeaseId)>,
    tombstones: BTreeMap<LeaseId, (Ended, Instant)>,
    /// Tombstone ids in end order (front = oldest), for the count and age bounds.
    tomb_order: VecDeque<LeaseId>,
    counters: TtlCounters,
}

fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

impl TtlTable {
    /// An empty table.
    pub fn new(cfg: TtlConfig) -> TtlTable {
        TtlTable {
            cfg,
            leases: BTreeMap::new(),
            by_resource: BTreeSet::new(),
            by_holder: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            tombstones: BTreeMap::new(),
            tomb_order: VecDeque::new(),
            counters: TtlCounters::default(),
        }
    }

    /// Grants the request's resource to its holder for its TTL, or refuses it
    /// ([`TtlError::Busy`] if the resource has a live lease).
    pub fn acquire(&mut self, req: TtlRequest, now: Now) -> Outcome<LeaseInfo> {
        let ended = self.tick(now);
        let result = self.acquire_inner(req, now);
        Outcome { result, ended }
    }

    fn acquire_inner(&mut self, req: TtlRequest, now: Now) -> Result<LeaseInfo, TtlError> {
        let TtlRequest {
            id,
            resource,
            holder,
            token,
            epoch,
            ttl,
        } = req;
        let ms = ttl_ms(ttl);
        if ms == 0 {
            return Err(TtlError::ZeroTtl);
        }
        if ttl > MAX_TTL {
            return Err(TtlError::TtlTooLong);
        }
        if self.leases.contains_key(&id) || self.tombstones.contains_key(&id) {
            return Err(TtlError::DuplicateId(id));
        }
        if let Some(lease) = self
            .holder_of(&resource)
            .filter(|_| self.cfg.exclusive_per_resource)
        {
            return Err(TtlError::Busy {
                resource,
                holder: self.leases[&lease].holder.clone(),
                lease,
            });
        }
        let ttl = Duration::from_millis(ms);
        let lease = Lease {
            resource,
            holder,
            token,
            epoch,
            ttl,
            deadline: now.mono + ttl,
            expires_at_unix_ms: now.unix_ms.saturating_add(ms),
            granted_at_unix_ms: now.unix_ms,
            renewals: 0,
        };
        self.insert(id, lease);
        self.counters.acquired += 1;
        Ok(self.get(id).unwrap())
    }

    fn insert(&mut self, id: LeaseId, lease: Lease) {
        self.by_resource.insert((lease.resource.clone(), id));
        self.by_holder.insert((lease.holder.clone(), id));
        self.deadlines.insert((lease.deadline, id));
        self.leases.insert(id, lease);
    }

    /// Restarts the lease's full TTL from `now`; refused once it has ended.
    pub fn renew(&mut self, id: LeaseId, now: Now) -> Outcome<LeaseInfo> {
        let ended = self.tick(now);
        let result = match self.leases.get_mut(&id) {
            None => Err(self.not_live(id)),
            Some(l) => {
                self.deadlines.remove(&(l.deadline, id));
                l.deadline = now.mono + l.ttl;
                l.expires_at_unix_ms = now.unix_ms.saturating_add(ttl_ms(l.ttl));
                l.renewals += 1;
                self.deadlines.insert((l.deadline, id));
                self.counters.renewed += 1;
                Ok(self.get(id).unwrap())
            }
        };
        Outcome { result, ended }
    }

    /// The holder gives the lease back.
    pub fn release(&mut self, id: LeaseId, now: Now) -> Outcome<Ended> {
        let ended = self.tick(now);
        let result = self.end(id, EndReason::Released, now);
        Outcome { result, ended }
    }

    /// An authority ends the lease: `revoked:<by>:<why>`.
    pub fn revoke(&mut self, id: LeaseId, by: &str, why: &str, now: Now) -> Outcome<Ended> {
        let ended = self.tick(now);
        let reason = EndReason::Revoked {
            by: by.to_string(),
            why: why.to_string(),
        };
        let result = self.end(id, reason, now);
        Outcome { result, ended }
    }

    fn not_live(&self, id: LeaseId) -> TtlError {
        match self.state(id) {
            LeaseState::Unknown => TtlError::Unknown(id),
            state => TtlError::Ended { id, state },
        }
    }

    fn end(&mut self, id: LeaseId, reason: EndReason, now: Now) -> Result<Ended, TtlError> {
        let Some(l) = self.leases.remove(&id) else {
            return Err(self.not_live(id));
        };
        self.by_resource.remove(&(l.resource.clone(), id));
        self.by_holder.remove(&(l.holder.clone(), id));
        self.deadlines.remove(&(l.deadline, id));
        match reason {
            EndReason::Released => self.counters.released += 1,
            EndReason::Expired => self.counters.expired += 1,
            EndReason::Revoked { .. } => self.counters.revoked += 1,
        }
        let e = Ended {
            id,
            resource: l.resource,
            holder: l.holder,
            epoch: l.epoch,
            reason,
            ended_at_unix_ms: now.unix_ms,
        };
        self.bury(e.clone(), now.mono);
        Ok(e)
    }

    fn bury(&mut self, e: Ended, at: Instant) {
        let id = e.id;
        self.tombstones.insert(id, (e, at));
        self.tomb_order.push_back(id);
        while self.tomb_order.len() > self.cfg.max_tombstones {
            let old = self.tomb_order.pop_front().unwrap();
            self.tombstones.remove(&old);
        }
    }

    fn prune_tombstones(&mut self, now: Instant) {
        while let Some(&id) = self.tomb_order.front() {
            let at = self.tombstones[&id].1;
            if now.saturating_duration_since(at) < self.cfg.tombstone_max_age {
                break;
            }
            self.tomb_order.pop_front();
            self.tombstones.remove(&id);
        }
    }

    /// Expires every lease whose deadline is `<= now.mono` (and forgets tombstones older than
    /// the bound). Returns the leases that ended, in deadline order.
    pub fn tick(&mut self, now: Now) -> Vec<Ended> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now.mono {
                break;
            }
            // Ended at its deadline, not at the (possibly late) tick.
            let late = now.mono.saturating_duration_since(deadline);
            let at = Now {
                mono: deadline,
                unix_ms: now.unix_ms.saturating_sub(ttl_ms(late)),
            };
            out.push(self.end(id, EndReason::Expired, at).unwrap());
        }
        self.prune_tombstones(now.mono);
        out
    }

    /// The earliest lease deadline: the driver calls [`TtlTable::tick`] then.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(d, _)| d)
    }

    /// The state of `id` as of the last call (the driver ticks at [`TtlTable::next_deadline`]).
    pub fn state(&self, id: LeaseId) -> LeaseState {
        if self.leases.contains_key(&id) {
            LeaseState::Held
        } else if let Some((e, _)) = self.tombstones.get(&id) {
            LeaseState::from_reason(&e.reason)
        } else {
            LeaseState::Unknown
        }
    }

    /// The end record of an ended lease still remembered.
    pub fn tombstone(&self, id: LeaseId) -> Option<&Ended> {
        self.tombstones.get(&id).map(|(e, _)| e)
    }

    /// A live lease.
    pub fn get(&self, id: LeaseId) -> Option<LeaseInfo> {
        self.leases.get(&id).map(|l| LeaseInfo {
            id,
            resource: l.resource.clone(),
            holder: l.holder.clone(),
            epoch: l.epoch,
            ttl: l.ttl,
            deadline: l.deadline,
            expires_at_unix_ms: l.expires_at_unix_ms,
            granted_at_unix_ms: l.granted_at_unix_ms,
            renewals: l.renewals,
        })
    }

    /// The live lease's token (the core compares it in constant time).
    pub fn token(&self, id: LeaseId) -> Option<&str> {
        self.leases.get(&id).map(|l| l.token.as_str())
    }

    /// The live lease on `resource` (the smallest id if the table is not exclusive).
    pub fn holder_of(&self, resource: &str) -> Option<LeaseId> {
        self.leases_on(resource).next()
    }

    /// The live leases on `resource`, by id.
    pub fn leases_on(&self, resource: &str) -> impl Iterator<Item = LeaseId> + '_ {
        self.by_resource
            .range((resource.to_string(), 0)..=(resource.to_string(), LeaseId::MAX))
            .map(|(_, id)| *id)
    }

    /// The live leases of `holder`, by id.
    pub fn held_by(&self, holder: &str) -> Vec<LeaseId> {
        self.by_holder
            .range((holder.to_string(), 0)..=(holder.to_string(), LeaseId::MAX))
            .map(|(_, id)| *id)
            .collect()
    }

    /// Number of live leases.
    pub fn active_count(&self) -> usize {
        self.leases.len()
    }

    /// Number of remembered tombstones.
    pub fn tombstone_count(&self) -> usize {
        self.tombstones.len()
    }

    /// The counters.
    pub fn counters(&self) -> TtlCounters {
        self.counters
    }

    /// All live leases, by id.
    pub fn leases(&self) -> impl Iterator<Item = LeaseInfo> + '_ {
        self.leases.keys().map(|&id| self.get(id).unwrap())
    }

    /// The persisted record of one live lease (for incremental writes).
    pub fn record(&self, id: LeaseId) -> Option<TtlLeaseRecord> {
        self.leases.get(&id).map(|l| TtlLeaseRecord {
            id,
            resource: l.resource.clone(),
            holder: l.holder.clone(),
            token: l.token.clone(),
            epoch: l.epoch,
            ttl_ms: ttl_ms(l.ttl),
            granted_at_unix_ms: l.granted_at_unix_ms,
            expires_at_unix_ms: l.expires_at_unix_ms,
            renewals: l.renewals,
        })
    }

    /// Everything to persist.
    pub fn snapshot(&self) -> TtlRecords {
        TtlRecords {
            leases: self
                .leases
                .keys()
                .map(|&id| self.record(id).unwrap())
                .collect(),
            tombstones: self
                .tomb_order
                .iter()
                .map(|id| {
                    let e = &self.tombstones[id].0;
                    TtlTombstoneRecord {
                        id: e.id,
                        resource: e.resource.clone(),
                        holder: e.holder.clone(),
                        epoch: e.epoch,
                        reason: e.reason.clone(),
                        ended_at_unix_ms: e.ended_at_unix_ms,
                    }
                })
                .collect(),
            counters: self.counters,
        }
    }

    /// Rebuilds a table after a restart (see the module docs for the clock assumption).
    /// Leases whose wall-clock expiry has passed end as expired at once (returned, in
    /// expiry order); no lease gets more than `min(expires_at - now, ttl)`.
    pub fn restore(
        cfg: TtlConfig,
        records: TtlRecords,
        now: Now,
    ) -> Result<(TtlTable, Vec<Ended>), RestoreError> {
        let mut t = TtlTable::new(cfg);
        t.counters = records.counters;
        let mut tombs = records.tombstones;
        tombs.sort_by_key(|r| r.ended_at_unix_ms);
        for r in tombs {
            if t.tombstones.contains_key(&r.id) {
                return Err(RestoreError(format!("tombstone {} twice", r.id)));
            }
            let age = Duration::from_millis(now.unix_ms.saturating_sub(r.ended_at_unix_ms));
            let at = now.mono.checked_sub(age).unwrap_or(now.mono);
            let e = Ended {
                id: r.id,
                resource: r.resource,
                holder: r.holder,
                epoch: r.epoch,
                reason: r.reason,
                ended_at_unix_ms: r.ended_at_unix_ms,
            };
            t.bury(e, at);
        }
        let mut due = Vec::new();
        for r in records.leases {
            if t.leases.contains_key(&r.id) || t.tombstones.contains_key(&r.id) {
                return Err(RestoreError(format!("lease id {} twice", r.id)));
            }
            if let Some(other) = t
                .holder_of(&r.resource)
                .filter(|_| cfg.exclusive_per_resource)
            {
                return Err(RestoreError(format!(
                    "resource {:?} held by leases {other} and {}",
                    r.resource, r.id
                )));
            }
            if r.ttl_ms == 0 || r.ttl_ms > ttl_ms(MAX_TTL) {
                return Err(RestoreError(format!(
                    "lease {} has a TTL out of range",
                    r.id
                )));
            }
            let remaining = r
                .expires_at_unix_ms
                .saturating_sub(now.unix_ms)
                .min(r.ttl_ms);
            let lease = Lease {
                resource: r.resource,
                holder: r.holder,
                token: r.token,
                epoch: r.epoch,
                ttl: Duration::from_millis(r.ttl_ms),
                deadline: now.mono + Duration::from_millis(remaining),
                expires_at_unix_ms: now.unix_ms.saturating_add(remaining),
                granted_at_unix_ms: r.granted_at_unix_ms,
                renewals: r.renewals,
            };
            if remaining == 0 {
                due.push((r.expires_at_unix_ms, r.id));
            }
            t.insert(r.id, lease);
        }
        // Leases already past their wall-clock expiry end now, stamped with that expiry.
        due.sort();
        let mut ended = Vec::new();
        for (exp, id) in due {
            let at = Now {
                mono: now.mono,
                unix_ms: exp.min(now.unix_ms),
            };
            ended.push(t.end(id, EndReason::Expired, at).unwrap());
        }
        t.prune_tombstones(now.mono);
        Ok((t, ended))
    }
}

#[cfg(test)]
mod tests;
