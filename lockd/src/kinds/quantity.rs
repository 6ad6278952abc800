//! Quantity leases over offers: a pure pool manager after HTCondor's lease manager
//! (seed `001_016212539393affe.txt`).
//!
//! No I/O, no clocks, no randomness: time comes in as [`Now`], lease ids and tokens come in
//! with each request, and every call returns what happened ([`Event`]s or a result). The
//! driver persists [`QuantityManager::records`] before it lets a grant leave lockd.
//!
//! # Model
//!
//! * An **offer** ([`OfferSpec`]) is a named quantity of the pool's resource with attributes
//!   (a string map), an optional maximum lease time, and requirements it puts on requests
//!   (a [`Selector`] over the *request's* attributes).
//! * A **request** ([`RequestSpec`]) asks for a quantity, carries its own attributes and
//!   requirements on offers, an optional lease time and what to do when it cannot be granted
//!   now ([`OnUnavailable::Wait`] or [`OnUnavailable::Fail`]).
//! * An offer **matches** a request when the request's requirements match the offer's
//!   attributes *and* the offer's requirements match the request's attributes (both ways,
//!   like HTCondor's classad matching). Matching is checked at grant time; changing an
//!   offer's attributes later does not end leases granted under the old ones.
//!
//! # Grants: all or nothing, allocation rule
//!
//! A request is granted its full quantity or nothing. The quantity comes from the matching
//! offers that have free capacity (`free = quantity − allocated`, never negative):
//!
//! 1. if one offer can cover it alone, the one with the **least** free capacity that still
//!    covers it (best fit), ties by offer name;
//! 2. otherwise as **few offers as possible**: repeatedly take the offer with the most free
//!    capacity (ties by name) whole, until the remainder fits in one offer, which is then
//!    chosen by rule 1 (best fit) and gives only the remainder.
//!
//! # Waiting: FIFO with a non-delaying pass rule
//!
//! Waiting requests are served in arrival order. A later request may be granted before an
//! earlier waiting one only from offers that **no earlier waiting request matches**: every
//! waiting request reserves the offers it matches against all requests behind it. So a
//! small later request never takes capacity a big waiting one could use (no starvation: the
//! capacity of the offers a waiting request matches only goes to requests ahead of it), but
//! it is not blocked by a waiter that could never use its offers. A cancelled waiter (see
//! [`QuantityManager::release`]) leaves the queue. A request asking for more than the total
//! capacity (free or not) of the offers it matches is refused at once
//! ([`QuantityError::Unsatisfiable`]) instead of waiting forever and reserving offers, and a
//! waiter that an offer change leaves in that state is dropped ([`Event::Unsatisfiable`]). Waiters are not persisted: they belong
//! to their connection.
//!
//! # Lease time, renewals, the maximum total lease time
//!
//! `lease time = min(every allocated offer's max lease time, the request's lease time,
//! Config::max_lease_time)`. [`QuantityManager::renew`] sets the expiry to `now + lease time`
//! by the same rule (with the offers' current maxima and optionally a new requested time),
//! but never past `first grant + Config::max_total_lease_time`, and never earlier than the
//! current expiry. A renewal is refused once the lease's expiry already reaches that limit
//! ([`QuantityError::MaxTotalLeaseTime`]), once the lease has expired
//! ([`QuantityError::Expired`]: re-request from scratch), and while the lease is chosen for
//! non-renewal after a shrink ([`QuantityError::RenewalRefused`]).
//!
//! # Offers that shrink or go away
//!
//! [`QuantityManager::upsert_offer`] may lower an offer's quantity below what is allocated
//! from it, and [`QuantityManager::remove_offer`] sets its capacity to zero (the offer is
//! forgotten once its last lease ends). Live leases are **never revoked early**; instead the
//! manager chooses leases whose renewals it refuses so that the allocations of the remaining
//! ones fit: for each over-committed offer in name order, the **newest** leases first (latest
//! first grant, then highest lease id), skipping leases already chosen for another offer,
//! until the rest fits. It reports each choice as [`Event::RenewalRefused`]; when capacity
//! comes back (the offer grows, or an older lease ends) the choice is recomputed by the same
//! rule and leases that no longer need to go are reported as [`Event::RenewalAllowed`].
//! Invariant: for every offer, the allocations of leases *not* chosen fit in its capacity, so
//! once the chosen leases run out every offer is within its new total. An over-committed
//! offer has no free capacity, so nothing new is granted from it meanwhile.
//!
//! # Resume after a client crash; tokens
//!
//! Every lease has a token given by the caller at request time (the core draws it from its
//! CSPRNG). A client that saved `(lease id, token)` can [`QuantityManager::resume`],
//! [`QuantityManager::renew`] or [`QuantityManager::release`] it from a new process; the
//! token is compared in constant time and a wrong one is refused ([`QuantityError::BadToken`]).
//!
//! # Expiry and persistence
//!
//! Leases end at their expiry: [`QuantityManager::tick`] ends every lease whose expiry is
//! `<= now` (call it first at each step, as the core does; [`QuantityManager::next_deadline`]
//! says when the next one is due). Operations at a `now` past a lease's expiry treat it as
//! expired even before `tick` ran. [`QuantityManager::records`] gives the persisted form
//! with wall-clock expiries; [`QuantityManager::restore`] rebuilds the manager at `now`: a
//! lease keeps its wall-clock expiry (never more than `max_lease_time` from `now`, so a clock
//! stepping back cannot lengthen it), a lease that expired while lockd was down ends at the
//! first `tick`, and the maximum total lease time still counts from the first grant.
//!
//! # Costs
//!
//! Leases by id and waiters by id: hash maps; expiries: an ordered set (`O(log n)` per
//! grant, renewal, end); each offer keeps its leases ordered by grant sequence (newest-first
//! choice in `O(k log n)` for the k leases chosen). Matching scans the offers (a pool has few:
//! tens, not thousands); serving the queue scans waiters in order and stops as soon as no
//! unreserved free capacity is left.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::selector::{Attributes, Selector};
use crate::core::ct_eq;

/// Identifies a lease (and, while it waits, its request); chosen by the caller.
pub type LeaseId = u64;

/// Version of [`QuantityRecords`].
pub const RECORDS_VERSION: u32 = 1;

/// Longest configurable lease time / max total lease time: one year.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The time of a call: monotonic for deadlines, wall clock for records and reports (the
/// same shape as the core's `Now`).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Monotonic instant: expiries and the max-total limit.
    pub mono: Instant,
    /// Wall clock in ms since the Unix epoch: persisted expiries.
    pub unix_ms: u64,
}

/// Manager-wide limits (`--max-lease-time`, `--max-total-lease-time`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Upper bound of any lease time (the manager's term of the min).
    pub max_lease_time: Duration,
    /// No renewal extends a lease past its first grant plus this.
    pub max_total_lease_time: Duration,
}

/// An offer of some quantity of the pool's resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferSpec {
    /// Unique name (1–253 bytes, no whitespace or control characters).
    pub name: String,
    /// How much of the resource it offers.
    pub quantity: u32,
    /// What it is (matched by requests' requirements).
    #[serde(default)]
    pub attributes: Attributes,
    /// Longest lease it allows, in ms; `None` = no limit of its own.
    #[serde(default)]
    pub max_lease_time_ms: Option<u64>,
    /// What it requires of requests' attributes.
    #[serde(default)]
    pub requirements: Selector,
}

/// What a request does when it cannot be granted at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnavailable {
    /// Queue (see the module docs for the order).
    Wait,
    /// Fail with [`QuantityError::Unavailable`].
    Fail,
}

/// A request for a quantity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    /// Who asks (for reports and `held_by`).
    pub holder: String,
    /// How much (> 0), granted whole or not at all.
    pub quantity: u32,
    /// What it requires of offers' attributes.
    pub requirements: Selector,
    /// What it is (matched by offers' requirements).
    pub attributes: Attributes,
    /// The lease time it asks for; `None` = as long as the offers and the manager allow.
    pub lease_time: Option<Duration>,
    /// Wait or fail when it cannot be granted now.
    pub on_unavailable: OnUnavailable,
}

/// A part of a grant: this much from that offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// The offer's name.
    pub offer: String,
    /// How much of it (> 0).
    pub quantity: u32,
}

/// A lease as reported to its holder and in status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    /// The lease id.
    pub id: LeaseId,
    /// Who holds it.
    pub holder: String,
    /// The total granted (= the request's quantity).
    pub quantity: u32,
    /// Where it comes from, by offer name.
    pub allocations: Vec<Allocation>,
    /// Monotonic expiry.
    pub expires: Instant,
    /// Wall-clock expiry (ms since the Unix epoch).
    pub expires_unix_ms: u64,
    /// Wall-clock time of the first grant.
    pub first_granted_unix_ms: u64,
    /// `Some(offer)` when its renewals are refused because that offer shrank.
    pub renewal_refused: Option<String>,
}

/// How much of an offer is in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferUsage {
    /// The offer as last set.
    pub spec: OfferSpec,
    /// Its capacity now: its quantity, or 0 once removed.
    pub capacity: u64,
    /// Sum of the allocations of live leases.
    pub allocated: u64,
    /// Removed, kept only until its last lease ends.
    pub removed: bool,
}

/// What a request led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requested {
    /// Granted at once.
    Granted(LeaseView),
    /// Queued behind `ahead` earlier waiting requests.
    Queued {
        /// Waiting requests ahead of it.
        ahead: usize,
    },
}

/// Something that happened to a lease other than the direct answer to a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A waiting request was granted.
    Granted(LeaseView),
    /// A waiting request was dropped: its matching offers no longer have enough capacity in
    /// total to ever grant it (an offer shrank or went away).
    Unsatisfiable {
        /// The request's lease id.
        id: LeaseId,
        /// Its holder.
        holder: String,
    },
    /// A lease reached its expiry without renewal.
    Expired {
        /// The lease.
        id: LeaseId,
        /// Its holder.
        holder: String,
    },
    /// The lease was chosen for non-renewal so that `offer`'s allocations fit again.
    RenewalRefused {
        /// The lease.
        id: LeaseId,
        /// The over-committed offer it was chosen for.
        offer: String,
    },
    /// Capacity came back: the lease may be renewed again.
    RenewalAllowed {
        /// The lease.
        id: LeaseId,
    },
}

/// Why a call was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// A configuration limit is zero or above [`MAX_DURATION`].
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// A malformed offer.
    #[error("invalid offer {name:?}: {why}")]
    InvalidOffer {
        /// Its name.
        name: String,
        /// What is wrong.
        why: &'static str,
    },
    /// No offer by that name.
    #[error("unknown offer {0:?}")]
    UnknownOffer(String),
    /// A malformed request.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The id is already a lease or a waiting request.
    #[error("lease id {0} is already in use")]
    DuplicateId(LeaseId),
    /// `fail` mode and the request cannot be granted whole now.
    #[error("cannot grant {requested} now: {available} free in matching offers")]
    Unavailable {
        /// The quantity asked for.
        requested: u32,
        /// Free capacity in matching offers not reserved by earlier waiters.
        available: u64,
    },
    /// `wait` mode, but the matching offers' total capacity is below the quantity: waiting
    /// could never end.
    #[error("cannot ever grant {requested}: matching offers total {capacity}")]
    Unsatisfiable {
        /// The quantity asked for.
        requested: u32,
        /// Total capacity (allocated or not) of the matching offers.
        capacity: u64,
    },
    /// No lease or waiting request with that id (never existed, or ended).
    #[error("unknown lease {0}")]
    UnknownLease(LeaseId),
    /// The token does not match.
    #[error("lease {0}: wrong token")]
    BadToken(LeaseId),
    /// The lease has reached its expiry.
    #[error("lease {0} has expired")]
    Expired(LeaseId),
    /// The request is still waiting (only `release` applies to it).
    #[error("lease {0} is still waiting for a grant")]
    Waiting(LeaseId),
    /// Chosen for non-renewal after `offer` shrank.
    #[error("lease {id}: renewal refused: offer {offer:?} shrank below its allocations")]
    RenewalRefused {
        /// The lease.
        id: LeaseId,
        /// The offer it was chosen for.
        offer: String,
    },
    /// Its expiry already reaches first grant + max total lease time.
    #[error("lease {0}: renewal refused: maximum total lease time reached")]
    MaxTotalLeaseTime(LeaseId),
    /// Records that cannot describe a valid state.
    #[error("corrupt quantity records: {0}")]
    Corrupt(String),
}

/// The persisted form of an offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferRecord {
    /// The offer as last set.
    pub spec: OfferSpec,
    /// Removed but still allocated.
    #[serde(default)]
    pub removed: bool,
}

/// The persisted form of a lease (wall-clock times).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The lease id.
    pub id: LeaseId,
    /// Its token (the state file is private to lockd).
    pub token: String,
    /// Its holder.
    pub holder: String,
    /// Where it comes from.
    pub allocations: Vec<Allocation>,
    /// The request's requirements on offers.
    #[serde(default)]
    pub requirements: Selector,
    /// The request's attributes.
    #[serde(default)]
    pub attributes: Attributes,
    /// The lease time the request asked for, in ms.
    #[serde(default)]
    pub lease_time_ms: Option<u64>,
    /// Grant sequence (newest-first order of the shrink rule).
    pub seq: u64,
    /// Wall-clock first grant.
    pub first_granted_unix_ms: u64,
    /// Wall-clock expiry.
    pub expires_unix_ms: u64,
}

/// What changed in a pool's records since they were last taken ([`QuantityManager::take_changes`]):
/// each changed offer and lease as it is now, or `None` when it is gone. Applied to the
/// records taken before ([`QuantityRecords::apply`]) it gives [`QuantityManager::records`]:
/// a journal line costs O(change), not O(pool).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolChanges {
    /// Changed offers by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub offers: BTreeMap<String, Option<OfferRecord>>,
    /// Changed leases by id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leases: BTreeMap<LeaseId, Option<LeaseRecord>>,
}

/// Everything the quantity kind persists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantityRecords {
    /// [`RECORDS_VERSION`].
    pub version: u32,
    /// Offers by name order.
    pub offers: Vec<OfferRecord>,
    /// Leases by id order.
    pub leases: Vec<LeaseRecord>,
}

#[derive(Debug, Clone)]
struct Offer {
    spec: OfferSpec,
    removed: bool,
    allocated: u64,
    /// Live leases from this offer, by (grant seq, id): last = newest.
    leases: BTreeSet<(u64, LeaseId)>,
}

impl Offer {
    fn capacity(&self) -> u64 {
        if self.removed {
            0
        } else {
            u64::from(self.spec.quantity)
        }
    }
    fn free(&self) -> u64 {
        self.capacity().saturating_sub(self.allocated)
    }
    fn matches(&self, req: &RequestSpec) -> bool {
        !self.removed
            && req.requirements.matches(&self.spec.attributes)
            && self.spec.requirements.matches(&req.attributes)
    }
}

#[derive(Debug, Clone)]
struct Lease {
    token: String,
    spec: RequestSpec,
    allocations: Vec<Allocation>,
    seq: u64,
    first_granted_unix_ms: u64,
    renew_until: Instant,
    expires: Instant,
    expires_unix_ms: u64,
}

impl QuantityRecords {
    /// Apply changes taken after these records were (offers stay in name order, leases in
    /// id order).
    pub fn apply(&mut self, c: &PoolChanges) {
        for (name, rec) in &c.offers {
            let at = self
                .offers
                .binary_search_by(|o| o.spec.name.as_str().cmp(name.as_str()));
            match (at, rec) {
                (Ok(i), Some(r)) => self.offers[i] = r.clone(),
                (Ok(i), None) => {
                    self.offers.remove(i);
                }
                (Err(i), Some(r)) => self.offers.insert(i, r.clone()),
                (Err(_), None) => {}
            }
        }
        for (id, rec) in &c.leases {
            match (self.leases.binary_search_by_key(id, |l| l.id), rec) {
                (Ok(i), Some(r)) => self.leases[i] = r.clone(),
                (Ok(i), None) => {
                    self.leases.remove(i);
                }
                (Err(i), Some(r)) => self.leases.insert(i, r.clone()),
                (Err(_), None) => {}
            }
        }
    }
}

/// Offers and leases changed since the records were last taken.
#[derive(Debug, Clone, Default)]
struct Changed {
    /// Everything: the manager is new since then (its records were never taken).
    all: bool,
    offers: BTreeSet<String>,
    leases: BTreeSet<LeaseId>,
}

#[derive(Debug, Clone)]
struct Waiter {
    id: LeaseId,
    token: String,
    spec: RequestSpec,
}

/// The pool manager of one quantity resource.
#[derive(Debug, Clone)]
pub struct QuantityManager {
    cfg: Config,
    offers: BTreeMap<String, Offer>,
    leases: HashMap<LeaseId, Lease>,
    expiries: BTreeSet<(Instant, LeaseId)>,
    /// Waiting requests by arrival sequence.
    waiters: BTreeMap<u64, Waiter>,
    waiter_seq: HashMap<LeaseId, u64>,
    /// Offer name → number of waiting requests that match it (reserved against newcomers).
    reserved: HashMap<String, usize>,
    /// Leases whose renewals are refused → the offer they were chosen for.
    refused: BTreeMap<LeaseId, String>,
    next_seq: u64,
    next_wait: u64,
    /// What changed since the records were last taken (for journal lines).
    changed: Changed,
}

fn offer_record(o: &Offer) -> OfferRecord {
    OfferRecord {
        spec: o.spec.clone(),
        removed: o.removed,
    }
}

fn lease_record(id: LeaseId, l: &Lease) -> LeaseRecord {
    LeaseRecord {
        id,
        token: l.token.clone(),
        holder: l.spec.holder.clone(),
        allocations: l.allocations.clone(),
        requirements: l.spec.requirements.clone(),
        attributes: l.spec.attributes.clone(),
        lease_time_ms: l.spec.lease_time.map(ms),
        seq: l.seq,
        first_granted_unix_ms: l.first_granted_unix_ms,
        expires_unix_ms: l.expires_unix_ms,
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn check_duration(d: Duration, what: &'static str) -> Result<(), QuantityError> {
    if d.is_zero() || d > MAX_DURATION {
        Err(QuantityError::Config(what))
    } else {
        Ok(())
    }
}

fn check_offer(spec: &OfferSpec) -> Result<(), QuantityError> {
    let bad = |why| {
        Err(QuantityError::InvalidOffer {
            name: spec.name.clone(),
            why,
        })
    };
    if spec.name.is_empty() || spec.name.len() > 253 {
        return bad("name must be 1-253 bytes");
    }
    if spec
        .name
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return bad("name must not contain whitespace or control characters");
    }
    if spec.max_lease_time_ms == Some(0) {
        return bad("max lease time must be > 0");
    }
    Ok(())
}

impl QuantityManager {
    /// An empty manager; both limits must be in `(0, MAX_DURATION]`.
    pub fn new(cfg: Config) -> Result<QuantityManager, QuantityError> {
        check_duration(cfg.max_lease_time, "max lease time must be in (0, 1 year]")?;
        check_duration(
            cfg.max_total_lease_time,
            "max total lease time must be in (0, 1 year]",
        )?;
        Ok(QuantityManager {
            cfg,
            offers: BTreeMap::new(),
            leases: HashMap::new(),
            expiries: BTreeSet::new(),
            waiters: BTreeMap::new(),
            waiter_seq: HashMap::new(),
            reserved: HashMap::new(),
            refused: BTreeMap::new(),
            next_seq: 1,
            next_wait: 1,
            changed: Changed {
                all: true,
                ..Changed::default()
            },
        })
    }

    /// The limits in force.
    pub fn config(&self) -> Config {
        self.cfg
    }

    // ----- offers -------------------------------------------------------------------------

    /// Adds an offer or replaces the one with the same name (a removed one comes back).
    /// Growth may grant waiting requests; shrinking below the allocations chooses leases
    /// for non-renewal (module docs).
    pub fn upsert_offer(&mut self, now: Now, spec: OfferSpec) -> Result<Vec<Event>, QuantityError> {
        check_offer(&spec)?;
        let name = spec.name.clone();
        self.changed.offers.insert(name.clone());
        match self.offers.get_mut(&name) {
            Some(o) => {
                o.spec = spec;
                o.removed = false;
            }
            None => {
                self.offers.insert(
                    name.clone(),
                    Offer {
                        spec,
                        removed: false,
                        allocated: 0,
                        leases: BTreeSet::new(),
                    },
                );
            }
        }
        self.recount_reserved(&name);
        let mut out = Vec::new();
        self.recompute_refusals(&mut out);
        self.drop_unsatisfiable(&mut out);
        self.serve_queue(now, &mut out);
        Ok(out)
    }

    /// Withdraws an offer: its capacity becomes 0, its leases run to their expiry without
    /// renewal, and it is forgotten when the last one ends.
    pub fn remove_offer(&mut self, name: &str) -> Result<Vec<Event>, QuantityError> {
        let o = self
            .offers
            .get_mut(name)
            .ok_or_else(|| QuantityError::UnknownOffer(name.to_string()))?;
        o.removed = true;
        self.changed.offers.insert(name.to_string());
        if o.leases.is_empty() {
            self.offers.remove(name);
        }
        self.reserved.remove(name);
        let mut out = Vec::new();
        self.recompute_refusals(&mut out);
        self.drop_unsatisfiable(&mut out);
        Ok(out)
    }

    /// An offer's usage, if it exists (removed offers are listed until their last lease ends).
    pub fn offer(&self, name: &str) -> Option<OfferUsage> {
        self.offers.get(name).map(|o| OfferUsage {
            spec: o.spec.clone(),
            capacity: o.capacity(),
            allocated: o.allocated,
            removed: o.removed,
        })
    }

    /// Every offer's usage, by name.
    pub fn offers(&self) -> Vec<OfferUsage> {
        self.offers.keys().filter_map(|n| self.offer(n)).collect()
    }

    // ----- requests -----------------------------------------------------------------------

    /// Asks for `spec.quantity` under lease id `id` with `token`: granted whole at once,
    /// queued, or refused (`fail` mode, bad input, id in use).
    pub fn request(
        &mut self,
        now: Now,
        id: LeaseId,
        token: String,
        spec: RequestSpec,
    ) -> Result<Requested, QuantityError> {
        if spec.quantity == 0 {
            return Err(QuantityError::InvalidRequest("quantity must be > 0"));
        }
        if spec.lease_time.is_some_and(|d| d.is_zero()) {
            return Err(QuantityError::InvalidRequest("lease time must be > 0"));
        }
        if token.is_empty() {
            return Err(QuantityError::InvalidRequest("token must not be empty"));
        }
        if self.leases.contains_key(&id) || self.waiter_seq.contains_key(&id) {
            return Err(QuantityError::DuplicateId(id));
        }
        let reserved = &self.reserved;
        let blocked = |name: &str| reserved.get(name).is_some_and(|n| *n > 0);
        if let Some(allocs) = self.allocate(&spec, &blocked) {
            return Ok(Requested::Granted(self.grant(now, id, token, spec, allocs)));
        }
        match spec.on_unavailable {
            OnUnavailable::Fail => {
                let available = self
                    .offers
                    .values()
                    .filter(|o| o.matches(&spec) && !blocked(&o.spec.name))
                    .map(Offer::free)
                    .sum();
                Err(QuantityError::Unavailable {
                    requested: spec.quantity,
                    available,
                })
            }
            OnUnavailable::Wait => {
                let capacity = self.matching_capacity(&spec);
                if capacity < u64::from(spec.quantity) {
                    return Err(QuantityError::Unsatisfiable {
                        requested: spec.quantity,
                        capacity,
                    });
                }
                let ahead = self.waiters.len();
                for (name, o) in &self.offers {
                    if o.matches(&spec) {
                        *self.reserved.entry(name.clone()).or_default() += 1;
                    }
                }
                let seq = self.next_wait;
                self.next_wait += 1;
                self.waiter_seq.insert(id, seq);
                self.waiters.insert(seq, Waiter { id, token, spec });
                Ok(Requested::Queued { ahead })
            }
        }
    }

    /// Renews a lease (module docs for the rule and the refusals); returns its new state.
    /// `lease_time`: a new requested lease time, or `None` for the one of the request.
    pub fn renew(
        &mut self,
        now: Now,
        id: LeaseId,
        token: &str,
        lease_time: Option<Duration>,
    ) -> Result<LeaseView, QuantityError> {
        if lease_time.is_some_and(|d| d.is_zero()) {
            return Err(QuantityError::InvalidRequest("lease time must be > 0"));
        }
        self.check_live(now, id, token)?;
        if let Some(offer) = self.refused.get(&id) {
            return Err(QuantityError::RenewalRefused {
                id,
                offer: offer.clone(),
            });
        }
        let lease = &self.leases[&id];
        if lease.expires >= lease.renew_until {
            return Err(QuantityError::MaxTotalLeaseTime(id));
        }
        let lt = self.lease_time(
            lease_time.or(lease.spec.lease_time),
            lease.allocations.iter().map(|a| a.offer.as_str()),
        );
        let target = (now.mono + lt).min(lease.renew_until).max(lease.expires);
        let lease = self.leases.get_mut(&id).expect("checked live");
        self.changed.leases.insert(id);
        self.expiries.remove(&(lease.expires, id));
        lease.expires = target;
        lease.expires_unix_ms = now
            .unix_ms
            .saturating_add(ms(target.saturating_duration_since(now.mono)));
        self.expiries.insert((target, id));
        Ok(self.view(id))
    }

    /// Ends a lease, or cancels a waiting request, before its time. May grant waiters.
    pub fn release(
        &mut self,
        now: Now,
        id: LeaseId,
        token: &str,
    ) -> Result<Vec<Event>, QuantityError> {
        let mut out = Vec::new();
        if let Some(seq) = self.waiter_seq.get(&id).copied() {
            if !ct_eq(&self.waiters[&seq].token, token) {
                return Err(QuantityError::BadToken(id));
            }
            self.remove_waiter(seq);
        } else {
            let lease = self
                .leases
                .get(&id)
                .ok_or(QuantityError::UnknownLease(id))?;
            if !ct_eq(&lease.token, token) {
                return Err(QuantityError::BadToken(id));
            }
            self.end_lease(id);
            self.recompute_refusals(&mut out);
        }
        self.serve_queue(now, &mut out);
        Ok(out)
    }

    /// Picks a lease up again from its saved `(id, token)`, e.g. after the client crashed.
    pub fn resume(&self, now: Now, id: LeaseId, token: &str) -> Result<LeaseView, QuantityError> {
        if let Some(seq) = self.waiter_seq.get(&id) {
            return Err(if ct_eq(&self.waiters[seq].token, token) {
                QuantityError::Waiting(id)
            } else {
                QuantityError::BadToken(id)
            });
        }
        self.check_live(now, id, token)?;
        Ok(self.view(id))
    }

    /// Ends every lease whose expiry is `<= now` and serves the queue.
    pub fn tick(&mut self, now: Now) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(&(at, id)) = self.expiries.first() {
            if at > now.mono {
                break;
            }
            let lease = self.end_lease(id);
            out.push(Event::Expired {
                id,
                holder: lease.spec.holder,
            });
        }
        if !out.is_empty() {
            self.recompute_refusals(&mut out);
            self.serve_queue(now, &mut out);
        }
        out
    }

    /// No offer, no lease, no waiting request: the pool can be forgotten (O(1)).
    pub fn is_empty(&self) -> bool {
        self.offers.is_empty() && self.leases.is_empty() && self.waiters.is_empty()
    }

    /// Number of live leases (O(1)).
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// Number of waiting requests (O(1)).
    pub fn waiting_count(&self) -> usize {
        self.waiters.len()
    }

    /// When the next lease expires, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.expiries.first().map(|(at, _)| *at)
    }

    /// A live lease's state (no token needed: status).
    pub fn lease(&self, id: LeaseId) -> Option<LeaseView> {
        self.leases.contains_key(&id).then(|| self.view(id))
    }

    /// Every live lease, by id.
    pub fn leases(&self) -> Vec<LeaseView> {
        let mut ids: Vec<LeaseId> = self.leases.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(|id| self.view(id)).collect()
    }

    /// Ids of the waiting requests, in queue order.
    pub fn waiting(&self) -> Vec<LeaseId> {
        self.waiters.values().map(|w| w.id).collect()
    }

    // ----- persistence --------------------------------------------------------------------

    /// The persisted form of the whole state (offers and leases; not the queue).
    pub fn records(&self) -> QuantityRecords {
        let mut leases: Vec<LeaseRecord> = self
            .leases
            .iter()
            .map(|(id, l)| lease_record(*id, l))
            .collect();
        leases.sort_by_key(|l| l.id);
        QuantityRecords {
            version: RECORDS_VERSION,
            offers: self.offers.values().map(offer_record).collect(),
            leases,
        }
    }

    /// What changed since the records (or changes) were last taken, and forget it. `None`:
    /// the manager is new since then, take its whole [`QuantityManager::records`].
    pub fn take_changes(&mut self) -> Option<PoolChanges> {
        let c = std::mem::take(&mut self.changed);
        if c.all {
            return None;
        }
        Some(PoolChanges {
            offers: c
                .offers
                .into_iter()
                .map(|n| {
                    let r = self.offers.get(&n).map(offer_record);
                    (n, r)
                })
                .collect(),
            leases: c
                .leases
                .into_iter()
                .map(|id| (id, self.leases.get(&id).map(|l| lease_record(id, l))))
                .collect(),
        })
    }

    /// Forget what changed (the whole records were just written).
    pub fn forget_changes(&mut self) {
        self.changed = Changed::default();
    }

    /// Rebuilds a manager from records at `now` (module docs for the time rules). Leases of
    /// an offer missing from the records keep running on a removed placeholder of it. The
    /// events are the non-renewal choices of the restored state.
    pub fn restore(
        cfg: Config,
        records: QuantityRecords,
        now: Now,
    ) -> Result<(QuantityManager, Vec<Event>), QuantityError> {
        if records.version != RECORDS_VERSION {
            return Err(QuantityError::Corrupt(format!(
                "version {} (expected {RECORDS_VERSION})",
                records.version
            )));
        }
        let mut m = QuantityManager::new(cfg)?;
        for r in records.offers {
            check_offer(&r.spec).map_err(|e| QuantityError::Corrupt(e.to_string()))?;
            let name = r.spec.name.clone();
            let o = Offer {
                spec: r.spec,
                removed: r.removed,
                allocated: 0,
                leases: BTreeSet::new(),
            };
            if m.offers.insert(name.clone(), o).is_some() {
                return Err(QuantityError::Corrupt(format!("offer {name:?} twice")));
            }
        }
        for r in records.leases {
            let total: u64 = r.allocations.iter().map(|a| u64::from(a.quantity)).sum();
            let quantity = u32::try_from(total)
                .ok()
                .filter(|q| *q > 0 && r.allocations.iter().all(|a| a.quantity > 0))
                .ok_or_else(|| {
                    QuantityError::Corrupt(format!("lease {}: bad allocations", r.id))
                })?;
            if m.leases.contains_key(&r.id) {
                return Err(QuantityError::Corrupt(format!("lease {} twice", r.id)));
            }
            let names: BTreeSet<&str> = r.allocations.iter().map(|a| a.offer.as_str()).collect();
            if names.len() != r.allocations.len() {
                return Err(QuantityError::Corrupt(format!(
                    "lease {}: offer allocated twice",
                    r.id
                )));
            }
            let remaining = Duration::from_millis(r.expires_unix_ms.saturating_sub(now.unix_ms))
                .min(cfg.max_lease_time);
            let until_ms = r
                .first_granted_unix_ms
                .saturating_add(ms(cfg.max_total_lease_time))
                .saturating_sub(now.unix_ms);
            let until = Duration::from_millis(until_ms).min(cfg.max_total_lease_time);
            let expires = now.mono + remaining;
            for a in &r.allocations {
                let o = m.offers.entry(a.offer.clone()).or_insert_with(|| Offer {
                    spec: OfferSpec {
                        name: a.offer.clone(),
                        quantity: 0,
                        attributes: Attributes::new(),
                        max_lease_time_ms: None,
                        requirements: Selector::everything(),
                    },
                    removed: true,
                    allocated: 0,
                    leases: BTreeSet::new(),
                });
                o.allocated += u64::from(a.quantity);
                o.leases.insert((r.seq, r.id));
            }
            m.next_seq = m.next_seq.max(r.seq.saturating_add(1));
            m.expiries.insert((expires, r.id));
            m.leases.insert(
                r.id,
                Lease {
                    token: r.token,
                    spec: RequestSpec {
                        holder: r.holder,
                        quantity,
                        requirements: r.requirements,
                        attributes: r.attributes,
                        lease_time: r.lease_time_ms.map(Duration::from_millis),
                        on_unavailable: OnUnavailable::Wait,
                    },
                    allocations: r.allocations,
                    seq: r.seq,
                    first_granted_unix_ms: r.first_granted_unix_ms,
                    renew_until: now.mono + until,
                    expires,
                    expires_unix_ms: now.unix_ms.saturating_add(ms(remaining)),
                },
            );
        }
        m.offers.retain(|_, o| !(o.removed && o.leases.is_empty()));
        let mut out = Vec::new();
        m.recompute_refusals(&mut out);
        Ok((m, out))
    }

    // ----- internals ----------------------------------------------------------------------

    fn check_live(&self, now: Now, id: LeaseId, token: &str) -> Result<(), QuantityError> {
        let lease = self
            .leases
            .get(&id)
            .ok_or(QuantityError::UnknownLease(id))?;
        if !ct_eq(&lease.token, token) {
            return Err(QuantityError::BadToken(id));
        }
        if lease.expires <= now.mono {
            return Err(QuantityError::Expired(id));
        }
        Ok(())
    }

    /// min(offers' max, requested, manager's max).
    fn lease_time<'a>(
        &self,
        requested: Option<Duration>,
        offers: impl Iterator<Item = &'a str>,
    ) -> Duration {
        let mut lt = self.cfg.max_lease_time;
        if let Some(r) = requested {
            lt = lt.min(r);
        }
        for name in offers {
            if let Some(m) = self.offers.get(name).and_then(|o| o.spec.max_lease_time_ms) {
                lt = lt.min(Duration::from_millis(m));
            }
        }
        lt
    }

    /// The allocation rule of the module docs over matching, unblocked offers.
    fn allocate(
        &self,
        spec: &RequestSpec,
        blocked: &dyn Fn(&str) -> bool,
    ) -> Option<Vec<Allocation>> {
        let mut cands: Vec<(u64, &str)> = self
            .offers
            .values()
            .filter(|o| o.free() > 0 && !blocked(&o.spec.name) && o.matches(spec))
            .map(|o| (o.free(), o.spec.name.as_str()))
            .collect();
        let mut rem = u64::from(spec.quantity);
        if cands.iter().map(|c| c.0).sum::<u64>() < rem {
            return None;
        }
        // most free first, ties by name
        cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        let mut allocs = Vec::new();
        let mut i = 0;
        while rem > 0 {
            // best fit among the rest: least free that covers rem, ties by name
            let fit = cands[i..]
                .iter()
                .filter(|c| c.0 >= rem)
                .min_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(b.1)));
            let (take, name) = match fit {
                Some(&(_, name)) => (rem, name),
                None => (cands[i].0, cands[i].1),
            };
            i += 1;
            allocs.push(Allocation {
                offer: name.to_string(),
                quantity: u32::try_from(take).ok()?,
            });
            rem -= take;
        }
        allocs.sort_by(|a, b| a.offer.cmp(&b.offer));
        Some(allocs)
    }

    fn grant(
        &mut self,
        now: Now,
        id: LeaseId,
        token: String,
        spec: RequestSpec,
        allocations: Vec<Allocation>,
    ) -> LeaseView {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.changed.leases.insert(id);
        for a in &allocations {
            if let Some(o) = self.offers.get_mut(&a.offer) {
                o.allocated += u64::from(a.quantity);
                o.leases.insert((seq, id));
            }
        }
        let lt = self.lease_time(
            spec.lease_time,
            allocations.iter().map(|a| a.offer.as_str()),
        );
        let renew_until = now.mono + self.cfg.max_total_lease_time;
        let expires = (now.mono + lt).min(renew_until);
        self.expiries.insert((expires, id));
        self.leases.insert(
            id,
            Lease {
                token,
                spec,
                allocations,
                seq,
                first_granted_unix_ms: now.unix_ms,
                renew_until,
                expires,
                expires_unix_ms: now
                    .unix_ms
                    .saturating_add(ms(expires.saturating_duration_since(now.mono))),
            },
        );
        self.view(id)
    }

    fn end_lease(&mut self, id: LeaseId) -> Lease {
        let lease = self.leases.remove(&id).expect("end_lease on a live lease");
        self.changed.leases.insert(id);
        self.expiries.remove(&(lease.expires, id));
        self.refused.remove(&id);
        for a in &lease.allocations {
            if let Some(o) = self.offers.get_mut(&a.offer) {
                o.allocated -= u64::from(a.quantity);
                o.leases.remove(&(lease.seq, id));
                if o.removed && o.leases.is_empty() {
                    self.offers.remove(&a.offer);
                    self.changed.offers.insert(a.offer.clone());
                }
            }
        }
        lease
    }

    fn view(&self, id: LeaseId) -> LeaseView {
        let l = &self.leases[&id];
        LeaseView {
            id,
            holder: l.spec.holder.clone(),
            quantity: l.spec.quantity,
            allocations: l.allocations.clone(),
            expires: l.expires,
            expires_unix_ms: l.expires_unix_ms,
            first_granted_unix_ms: l.first_granted_unix_ms,
            renewal_refused: self.refused.get(&id).cloned(),
        }
    }

    fn remove_waiter(&mut self, seq: u64) -> Option<Waiter> {
        let w = self.waiters.remove(&seq)?;
        self.waiter_seq.remove(&w.id);
        for (name, o) in &self.offers {
            if o.matches(&w.spec) {
                if let Some(n) = self.reserved.get_mut(name) {
                    *n -= 1;
                    if *n == 0 {
                        self.reserved.remove(name);
                    }
                }
            }
        }
        Some(w)
    }

    /// Total capacity of the offers matching `spec`.
    fn matching_capacity(&self, spec: &RequestSpec) -> u64 {
        self.offers
            .values()
            .filter(|o| o.matches(spec))
            .map(Offer::capacity)
            .sum()
    }

    /// Drops the waiters that no capacity could ever satisfy (after an offer change).
    fn drop_unsatisfiable(&mut self, out: &mut Vec<Event>) {
        let dead: Vec<u64> = self
            .waiters
            .iter()
            .filter(|(_, w)| self.matching_capacity(&w.spec) < u64::from(w.spec.quantity))
            .map(|(seq, _)| *seq)
            .collect();
        for seq in dead {
            if let Some(w) = self.remove_waiter(seq) {
                out.push(Event::Unsatisfiable {
                    id: w.id,
                    holder: w.spec.holder,
                });
            }
        }
    }

    fn recount_reserved(&mut self, name: &str) {
        let Some(o) = self.offers.get(name) else {
            self.reserved.remove(name);
            return;
        };
        let n = self.waiters.values().filter(|w| o.matches(&w.spec)).count();
        if n == 0 {
            self.reserved.remove(name);
        } else {
            self.reserved.insert(name.to_string(), n);
        }
    }

    /// Grants waiting requests in order under the pass rule (module docs).
    fn serve_queue(&mut self, now: Now, out: &mut Vec<Event>) {
        let mut blocked: BTreeSet<String> = BTreeSet::new();
        let mut open_free: u64 = self.offers.values().map(Offer::free).sum();
        let mut cursor = 0u64;
        while open_free > 0 {
            let Some((&seq, w)) = self.waiters.range(cursor..).next() else {
                break;
            };
            cursor = seq + 1;
            let allocs = self.allocate(&w.spec, &|n| blocked.contains(n));
            match allocs {
                Some(allocs) => {
                    let w = self.remove_waiter(seq).expect("waiter present");
                    open_free -= allocs.iter().map(|a| u64::from(a.quantity)).sum::<u64>();
                    let view = self.grant(now, w.id, w.token, w.spec, allocs);
                    out.push(Event::Granted(view));
                }
                None => {
                    for (name, o) in &self.offers {
                        if o.matches(&w.spec) && blocked.insert(name.clone()) {
                            open_free -= o.free();
                        }
                    }
                }
            }
        }
    }

    /// Recomputes which leases are refused renewal (module docs) and reports the changes.
    fn recompute_refusals(&mut self, out: &mut Vec<Event>) {
        let mut chosen: BTreeMap<LeaseId, String> = BTreeMap::new();
        for (name, o) in &self.offers {
            if o.allocated <= o.capacity() {
                continue;
            }
            let alloc_of = |id: &LeaseId| -> u64 {
                self.leases[id]
                    .allocations
                    .iter()
                    .find(|a| &a.offer == name)
                    .map_or(0, |a| u64::from(a.quantity))
            };
            let mut kept = o.allocated
                - o.leases
                    .iter()
                    .filter(|(_, id)| chosen.contains_key(id))
                    .map(|(_, id)| alloc_of(id))
                    .sum::<u64>();
            for (_, id) in o.leases.iter().rev() {
                if kept <= o.capacity() {
                    break;
                }
                if chosen.contains_key(id) {
                    continue;
                }
                kept -= alloc_of(id);
                chosen.insert(*id, name.clone());
            }
        }
        for id in self.refused.keys() {
            if !chosen.contains_key(id) {
                out.push(Event::RenewalAllowed { id: *id });
            }
        }
        for (id, offer) in &chosen {
            if !self.refused.contains_key(id) {
                out.push(Event::RenewalRefused {
                    id: *id,
                    offer: offer.clone(),
                });
            }
        }
        self.refused = chosen;
    }

    /// Test hook: checks every index against the leases (panics on a broken invariant).
    #[cfg(test)]
    fn check_indices(&self) {
        for (name, o) in &self.offers {
            let mut sum = 0u64;
            let mut kept = 0u64;
            for (_, id) in &o.leases {
                let q = self.leases[id]
                    .allocations
                    .iter()
                    .find(|a| &a.offer == name)
                    .map(|a| u64::from(a.quantity))
                    .unwrap();
                sum += q;
                if !self.refused.contains_key(id) {
                    kept += q;
                }
            }
            assert_eq!(sum, o.allocated, "offer {name} allocated index");
            assert!(
                kept <= o.capacity(),
                "offer {name}: kept {kept} > capacity {}",
                o.capacity()
            );
        }
        assert_eq!(self.expiries.len(), self.leases.len());
        for (id, l) in &self.leases {
            assert!(self.expiries.contains(&(l.expires, *id)));
            let total: u64 = l.allocations.iter().map(|a| u64::from(a.quantity)).sum();
            assert_eq!(
                total,
                u64::from(l.spec.quantity),
                "lease {id} all-or-nothing"
            );
        }
        assert_eq!(self.waiters.len(), self.waiter_seq.len());
    }
}

#[cfg(test)]
mod tests;
