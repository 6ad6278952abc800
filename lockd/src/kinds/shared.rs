//! Shared/exclusive leases with versions (issue 11 point 2, seed `002_db5cd33d5bf2292e`,
//! HoloCompute's single writer / many readers).
//!
//! Semantics, per resource:
//!
//! * **Admission.** Many [`Mode::Shared`] holders, or one [`Mode::Exclusive`] holder, never
//!   both. Requests that cannot be granted at once wait in one FIFO per resource, in arrival
//!   order, and are admitted from its front: a run of shared requests at the front is granted
//!   together (a *batch*) as long as no exclusive lease is held; an exclusive request at the
//!   front is granted when the resource has no holder at all, and until then it blocks
//!   everything behind it.
//! * **Writer priority.** A new shared request is queued, not granted, while an exclusive
//!   request waits ahead of it, even if the resource is currently held shared: a stream of
//!   readers cannot starve a writer.
//! * **Starvation bound.** Admission is FIFO modulo parking: a request is never overtaken by
//!   a later request, except that a shared request waiting for `min_version` (*parked*, see
//!   below) lets later requests pass until the version is reached. Readers queued before a
//!   writer are granted before it; readers queued after a writer are granted after it. So a
//!   waiting request is granted at the latest when every lease that was held or queued before
//!   it (and conflicts with it) has ended: its wait is bounded by the sum of those leases'
//!   lengths (each bounded by its TTL or its connection). The random-history property test
//!   checks exactly this: whenever a request is granted, every request that arrived before it
//!   and still waits is parked, and a resource never has an unparked request waiting with
//!   nothing blocking it.
//! * **Gang fence.** The core may set a *fence* on a resource ([`SharedTable::set_fence`]):
//!   the lease id of a waiting shared gang's member. While it is set, no exclusive request
//!   with a larger id (one that arrived later) is granted; the gang's member is let in
//!   ahead of them with [`SharedTable::admit_gang_reader`] once no writer holds the resource
//!   and none that arrived before it waits ([`SharedTable::admits_gang_reader`]). So a
//!   writer is overtaken only by gangs that arrived before it, and a gang only by writers
//!   that arrived before it.
//! * **Versions.** Each resource has a `version` (0 initially). Only [`SharedTable::commit`]
//!   by the exclusive holder changes it, by +1, and returns the new value; a holder may
//!   commit several times. An exclusive lease that ends without a commit (released, expired,
//!   revoked, its holder killed) leaves the version as it was: the readers' snapshot is the
//!   last committed one. Every grant reports the version current at grant time (for a shared
//!   holder, the immutable snapshot it reads; it cannot change while it holds, since no
//!   writer can hold at the same time).
//! * **`min_version`.** A shared request with `min_version = v` is granted only once the
//!   resource's version is `>= v`; until then it is parked (it does not block the queue:
//!   the writer that will produce `v` must be able to get in). When a commit reaches `v` it
//!   re-enters the FIFO at its original arrival position. Parking is unbounded by design
//!   (nobody may ever commit `v`): the core bounds it with the request's timeout/cancel.
//!   `min_version` on an exclusive request is refused.
//! * **Epochs.** Every grant (shared or exclusive) gets a fencing epoch strictly greater than
//!   every earlier grant's on that resource; epochs and versions are in the records, so
//!   they stay increasing across restarts.
//!
//! Pure: no I/O, no clock. Lease ids come from the core (one id space with the other
//! kinds). How a lease ends (release, TTL expiry, revoke, connection loss) is the core's
//! business; it calls [`SharedTable::end`] for all of them. Operations are O(log n) per
//! grant in the number of holders and waiters.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Identifies one lease or request; allocated by the core, never reused.
pub type LeaseId = u64;

/// Versions and epochs stay below this (restore refuses more, [`SharedTable::raise_epoch`]
/// clamps): counting one by one never gets there, and `+ 1` can never overflow.
pub const MAX_COUNTER: u64 = u64::MAX / 2;

/// The access a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Read access to the current version; many holders at once.
    Shared,
    /// Write access; one holder, no shared holder at the same time.
    Exclusive,
}

/// An acquire request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The lease id this request becomes when granted.
    pub id: LeaseId,
    /// The resource.
    pub resource: String,
    /// Opaque holder name (for reports).
    pub holder: String,
    /// Shared or exclusive.
    pub mode: Mode,
    /// Shared only: wait until the resource's version is at least this (0 = no wait).
    pub min_version: u64,
}

/// A lease granted (at once or to a waiter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The lease.
    pub id: LeaseId,
    /// The resource.
    pub resource: String,
    /// The holder.
    pub holder: String,
    /// Its mode.
    pub mode: Mode,
    /// Fencing epoch, strictly increasing per resource.
    pub epoch: u64,
    /// The resource's version at grant time.
    pub version: u64,
}

/// What [`SharedTable::acquire`] did with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Granted at once.
    Granted(Grant),
    /// Waiting in the FIFO behind conflicting holders or requests.
    Queued,
    /// Waiting for the resource to reach `min_version`.
    Parked,
}

/// What [`SharedTable::end`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// A granted lease.
    Holder {
        /// The lease.
        id: LeaseId,
        /// Its resource.
        resource: String,
        /// Its mode.
        mode: Mode,
        /// How many commits it made (0: the version is as it was before it).
        commits: u64,
        /// The resource's version after the end (unchanged by the end itself).
        version: u64,
    },
    /// A request that was still waiting (queued or parked).
    Waiter {
        /// The request.
        id: LeaseId,
        /// Its resource.
        resource: String,
    },
}

/// The end of a lease or request and the grants it made possible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOutcome {
    /// What ended.
    pub ended: Ended,
    /// Waiters granted as a consequence, in grant order.
    pub grants: Vec<Grant>,
}

/// Why an operation was refused. Nothing changes when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedError {
    /// The id is already a holder or a waiter.
    #[error("lease id {0} is already in use")]
    DuplicateId(LeaseId),
    /// No holder or waiter has this id.
    #[error("lease {0} is unknown")]
    Unknown(LeaseId),
    /// Commit by something other than the exclusive holder.
    #[error("lease {0} does not hold the resource exclusively: commit refused")]
    NotExclusive(LeaseId),
    /// `min_version` on an exclusive request.
    #[error("min_version applies to shared requests only")]
    MinVersionOnExclusive,
    /// A gang reader let in while an exclusive lease is held.
    #[error("lease {0} holds the resource exclusively: no reader is let in")]
    WriterHolds(LeaseId),
}

/// Persisted records that cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inconsistent shared-lease records: {0}")]
pub struct RestoreError(pub String);

/// A holder in the persisted state (waiters are not persisted: they belong to connections,
/// which a restart closes; clients re-request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedHolderRecord {
    /// The lease id.
    pub id: LeaseId,
    /// The holder name.
    pub holder: String,
    /// Its mode.
    pub mode: Mode,
    /// Its fencing epoch.
    pub epoch: u64,
    /// The version it was granted at.
    pub version: u64,
    /// Commits it made.
    #[serde(default)]
    pub commits: u64,
}

/// A resource in the persisted state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedResourceRecord {
    /// Its version.
    pub version: u64,
    /// Its last granted epoch.
    pub epoch: u64,
    /// Its holders.
    #[serde(default)]
    pub holders: Vec<SharedHolderRecord>,
}

/// What changed in one resource's record since it was last taken
/// ([`SharedTable::take_changes`]): its version and epoch, and each holder that came or went
/// (as it is now, or `None`). A journal line then costs O(change), not O(holders): with
/// thousands of readers on one resource, each grant wrote them all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedChanges {
    /// The resource's version now.
    pub version: u64,
    /// Its last granted epoch now.
    pub epoch: u64,
    /// Holders changed, by lease id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub holders: BTreeMap<LeaseId, Option<SharedHolderRecord>>,
}

impl SharedResourceRecord {
    /// Apply changes taken after this record was (holders stay in id order).
    pub fn apply(&mut self, c: &SharedChanges) {
        self.version = c.version;
        self.epoch = c.epoch;
        for (id, rec) in &c.holders {
            match (self.holders.binary_search_by_key(id, |h| h.id), rec) {
                (Ok(i), Some(r)) => self.holders[i] = r.clone(),
                (Ok(i), None) => {
                    self.holders.remove(i);
                }
                (Err(i), Some(r)) => self.holders.insert(i, r.clone()),
                (Err(_), None) => {}
            }
        }
    }
}

/// Everything the shared table persists.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedRecords {
    /// Every resource ever used, by name.
    #[serde(default)]
    pub resources: BTreeMap<String, SharedResourceRecord>,
}

fn holder_record(id: LeaseId, h: &Holder) -> SharedHolderRecord {
    SharedHolderRecord {
        id,
        holder: h.holder.clone(),
        mode: h.mode,
        epoch: h.epoch,
        version: h.version,
        commits: h.commits,
    }
}

#[derive(Debug, Clone)]
struct Holder {
    holder: String,
    mode: Mode,
    epoch: u64,
    version: u64,
    commits: u64,
}

#[derive(Debug, Clone)]
struct Waiter {
    id: LeaseId,
    holder: String,
    mode: Mode,
}

#[derive(Debug, Clone, Default)]
struct Res {
    version: u64,
    epoch: u64,
    holders: BTreeMap<LeaseId, Holder>,
    /// The exclusive holder, if any (then `holders` has exactly that one).
    exclusive: Option<LeaseId>,
    /// The FIFO, keyed by arrival sequence number.
    queue: BTreeMap<u64, Waiter>,
    /// Shared requests waiting for a version, keyed by (min_version, arrival).
    parked: BTreeMap<(u64, u64), Waiter>,
    /// Holders granted, changed or ended since the record was last taken.
    changed: BTreeSet<LeaseId>,
    /// A waiting shared gang's reservation (the core's, see [`SharedTable::set_fence`]):
    /// no exclusive request with a larger id is granted while it is set. Not persisted
    /// (waiters are not).
    fence: Option<LeaseId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Holder,
    Queued(u64),
    Parked(u64, u64),
}

/// Shared/exclusive admission for every resource (pure).
#[derive(Debug, Clone, Default)]
pub struct SharedTable {
    resources: BTreeMap<String, Res>,
    /// Where each id is: holder, queued or parked, on which resource.
    index: BTreeMap<LeaseId, (String, Place)>,
    /// Arrival counter (FIFO order across queue and parking).
    next_seq: u64,
    /// Planted bug for the property test: grant shared requests while a writer holds.
    #[cfg(test)]
    plant_overlap_bug: bool,
}

impl SharedTable {
    /// Plant the overlap bug (tests of the core's property test only).
    #[cfg(test)]
    pub(crate) fn plant_overlap_bug(&mut self) {
        self.plant_overlap_bug = true;
    }

    /// An empty table.
    pub fn new() -> SharedTable {
        SharedTable::default()
    }

    /// Admits a request: granted at once, queued, or parked for `min_version`.
    pub fn acquire(&mut self, req: Request) -> Result<Admission, SharedError> {
        if self.index.contains_key(&req.id) {
            return Err(SharedError::DuplicateId(req.id));
        }
        if req.mode == Mode::Exclusive && req.min_version > 0 {
            return Err(SharedError::MinVersionOnExclusive);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let res = self.resources.entry(req.resource.clone()).or_default();
        let w = Waiter {
            id: req.id,
            holder: req.holder,
            mode: req.mode,
        };
        if req.min_version > res.version {
            res.parked.insert((req.min_version, seq), w);
            self.index
                .insert(req.id, (req.resource, Place::Parked(req.min_version, seq)));
            return Ok(Admission::Parked);
        }
        res.queue.insert(seq, w);
        self.index
            .insert(req.id, (req.resource.clone(), Place::Queued(seq)));
        // Only the new request can be granted: everything ahead of it was already blocked.
        let mut grants = self.pump(&req.resource);
        // The planted bug (tests only) grants readers beside a writer, waiters included: the
        // property test must see that, not this assertion.
        #[cfg(test)]
        let planted = self.plant_overlap_bug;
        #[cfg(not(test))]
        let planted = false;
        Ok(match grants.pop() {
            Some(g) => {
                debug_assert!(planted || (g.id == req.id && grants.is_empty()));
                Admission::Granted(g)
            }
            None => Admission::Queued,
        })
    }

    /// Grants from the front of the resource's FIFO while possible.
    fn pump(&mut self, resource: &str) -> Vec<Grant> {
        #[cfg(test)]
        let bug = self.plant_overlap_bug;
        #[cfg(not(test))]
        let bug = false;
        let Some(res) = self.resources.get_mut(resource) else {
            return Vec::new();
        };
        let mut grants = Vec::new();
        while let Some(entry) = res.queue.first_entry() {
            let ok = match entry.get().mode {
                Mode::Shared => res.exclusive.is_none() || bug,
                Mode::Exclusive => {
                    res.holders.is_empty() && res.fence.is_none_or(|f| entry.get().id < f)
                }
            };
            if !ok {
                break;
            }
            let w = entry.remove();
            res.epoch += 1;
            res.changed.insert(w.id);
            res.holders.insert(
                w.id,
                Holder {
                    holder: w.holder.clone(),
                    mode: w.mode,
                    epoch: res.epoch,
                    version: res.version,
                    commits: 0,
                },
            );
            if w.mode == Mode::Exclusive {
                res.exclusive = Some(w.id);
            }
            self.index
                .insert(w.id, (resource.to_string(), Place::Holder));
            grants.push(Grant {
                id: w.id,
                resource: resource.to_string(),
                holder: w.holder,
                mode: w.mode,
                epoch: res.epoch,
                version: res.version,
            });
            if w.mode == Mode::Exclusive {
                break;
            }
        }
        grants
    }

    /// The exclusive holder `id` commits: the version goes up by one (returned). Parked
    /// shared requests whose `min_version` is now reached re-enter the FIFO (they are granted
    /// once the writer's lease ends).
    pub fn commit(&mut self, id: LeaseId) -> Result<u64, SharedError> {
        let Some((resource, place)) = self.index.get(&id).cloned() else {
            return Err(SharedError::Unknown(id));
        };
        let res = self.resources.get_mut(&resource).unwrap();
        if place != Place::Holder || res.exclusive != Some(id) {
            return Err(SharedError::NotExclusive(id));
        }
        res.version += 1;
        res.holders.get_mut(&id).unwrap().commits += 1;
        res.changed.insert(id);
        let version = res.version;
        let rest = res.parked.split_off(&(version + 1, 0));
        let ready = std::mem::replace(&mut res.parked, rest);
        for ((_, seq), w) in ready {
            self.index
                .insert(w.id, (resource.clone(), Place::Queued(seq)));
            res.queue.insert(seq, w);
        }
        Ok(version)
    }

    /// Ends a lease (however it ended) or withdraws a waiting request; returns what ended and
    /// the waiters granted as a consequence.
    pub fn end(&mut self, id: LeaseId) -> Result<EndOutcome, SharedError> {
        let Some((resource, place)) = self.index.remove(&id) else {
            return Err(SharedError::Unknown(id));
        };
        let res = self.resources.get_mut(&resource).unwrap();
        let ended = match place {
            Place::Holder => {
                let h = res.holders.remove(&id).unwrap();
                res.changed.insert(id);
                if res.exclusive == Some(id) {
                    res.exclusive = None;
                }
                Ended::Holder {
                    id,
                    resource: resource.clone(),
                    mode: h.mode,
                    commits: h.commits,
                    version: res.version,
                }
            }
            Place::Queued(seq) => {
                res.queue.remove(&seq);
                Ended::Waiter {
                    id,
                    resource: resource.clone(),
                }
            }
            Place::Parked(v, seq) => {
                res.parked.remove(&(v, seq));
                Ended::Waiter {
                    id,
                    resource: resource.clone(),
                }
            }
        };
        // A departing holder or a withdrawn exclusive waiter at the front may unblock the
        // queue; pumping is a no-op otherwise.
        let grants = self.pump(&resource);
        Ok(EndOutcome { ended, grants })
    }

    /// Whether `resource` has a holder or a waiting request.
    pub fn in_use(&self, resource: &str) -> bool {
        self.resources
            .get(resource)
            .is_some_and(|r| !r.holders.is_empty() || !r.queue.is_empty() || !r.parked.is_empty())
    }

    /// Whether a new shared request on `resource` would be granted at once: no exclusive
    /// holder and nobody waiting in its queue (writer priority: a waiting writer blocks it).
    pub fn admits_reader(&self, resource: &str) -> bool {
        self.resources
            .get(resource)
            .is_none_or(|r| r.exclusive.is_none() && r.queue.is_empty())
    }

    /// Sets (or lifts) the reservation of a waiting shared gang on `resource`: while
    /// `fence` is `Some(f)`, an exclusive request with an id above `f` (one that arrived
    /// after the gang's member `f`) is not granted; it stays queued and blocks the queue
    /// behind it, as any waiting writer does. Returns the grants that lifting (or raising)
    /// the fence makes possible.
    pub fn set_fence(&mut self, resource: &str, fence: Option<LeaseId>) -> Vec<Grant> {
        let Some(res) = self.resources.get_mut(resource) else {
            if fence.is_some() {
                self.resources
                    .entry(resource.to_string())
                    .or_default()
                    .fence = fence;
            }
            return Vec::new();
        };
        if res.fence == fence {
            return Vec::new();
        }
        res.fence = fence;
        self.pump(resource)
    }

    /// The fence set on `resource` ([`SharedTable::set_fence`]), if any.
    pub fn fence(&self, resource: &str) -> Option<LeaseId> {
        self.resources.get(resource).and_then(|r| r.fence)
    }

    /// Whether a gang reader with id `id` (a member that arrived as `id`) could be let in on
    /// `resource` now: no exclusive holder, and no exclusive request that arrived before it
    /// waits in the queue (writer priority, by arrival).
    pub fn admits_gang_reader(&self, resource: &str, id: LeaseId) -> bool {
        self.resources.get(resource).is_none_or(|r| {
            r.exclusive.is_none()
                && !r
                    .queue
                    .values()
                    .any(|w| w.mode == Mode::Exclusive && w.id < id)
        })
    }

    /// Lets a shared gang's member in as a reader at once, ahead of the requests queued
    /// after it arrived (the caller checked [`SharedTable::admits_gang_reader`]). Refused
    /// while an exclusive lease is held.
    pub fn admit_gang_reader(&mut self, req: Request) -> Result<Grant, SharedError> {
        if self.index.contains_key(&req.id) {
            return Err(SharedError::DuplicateId(req.id));
        }
        let res = self.resources.entry(req.resource.clone()).or_default();
        if let Some(x) = res.exclusive {
            return Err(SharedError::WriterHolds(x));
        }
        res.epoch += 1;
        res.changed.insert(req.id);
        res.holders.insert(
            req.id,
            Holder {
                holder: req.holder.clone(),
                mode: Mode::Shared,
                epoch: res.epoch,
                version: res.version,
                commits: 0,
            },
        );
        self.index
            .insert(req.id, (req.resource.clone(), Place::Holder));
        Ok(Grant {
            id: req.id,
            resource: req.resource,
            holder: req.holder,
            mode: Mode::Shared,
            epoch: res.epoch,
            version: res.version,
        })
    }

    /// The resource's version (0 if never used).
    pub fn version(&self, resource: &str) -> u64 {
        self.resources.get(resource).map_or(0, |r| r.version)
    }

    /// The resource's last granted epoch (0 if never).
    pub fn epoch(&self, resource: &str) -> u64 {
        self.resources.get(resource).map_or(0, |r| r.epoch)
    }

    /// Makes every later grant on `resource` get an epoch `> floor` (no-op if already so).
    /// The table allocates shared/exclusive epochs itself (a release can grant a whole batch
    /// of readers at once); the core calls this to keep one increasing epoch sequence per
    /// resource name, e.g. with the epoch of a state file migrated from version 1.
    pub fn raise_epoch(&mut self, resource: &str, floor: u64) {
        let res = self.resources.entry(resource.to_string()).or_default();
        res.epoch = res.epoch.max(floor.min(MAX_COUNTER));
    }

    /// The resource's holders, by id, with their mode.
    pub fn holders(&self, resource: &str) -> Vec<(LeaseId, Mode)> {
        self.resources.get(resource).map_or(Vec::new(), |r| {
            r.holders.iter().map(|(id, h)| (*id, h.mode)).collect()
        })
    }

    /// The resource's waiters: (queued in FIFO order, parked in arrival order).
    pub fn waiters(&self, resource: &str) -> (Vec<LeaseId>, Vec<LeaseId>) {
        let Some(r) = self.resources.get(resource) else {
            return (Vec::new(), Vec::new());
        };
        let queued = r.queue.values().map(|w| w.id).collect();
        let mut parked: Vec<(u64, LeaseId)> =
            r.parked.iter().map(|((_, s), w)| (*s, w.id)).collect();
        parked.sort();
        (queued, parked.into_iter().map(|(_, id)| id).collect())
    }

    /// Whether `id` waits in its resource's queue (not parked for a version).
    pub fn is_queued(&self, id: LeaseId) -> bool {
        matches!(self.index.get(&id), Some((_, Place::Queued(_))))
    }

    /// Whether `id` holds a lease (as opposed to waiting or unknown).
    pub fn is_holder(&self, id: LeaseId) -> bool {
        matches!(self.index.get(&id), Some((_, Place::Holder)))
    }

    /// Everything to persist (holders, versions, epochs; not waiters).
    pub fn snapshot(&self) -> SharedRecords {
        SharedRecords {
            resources: self
                .resources
                .iter()
                .map(|(name, r)| (name.clone(), Self::res_record(r)))
                .collect(),
        }
    }

    /// The persisted record of one resource, if the table knows it (for incremental
    /// writes: what [`SharedTable::snapshot`] holds for that name).
    pub fn record(&self, name: &str) -> Option<SharedResourceRecord> {
        self.resources.get(name).map(Self::res_record)
    }

    /// What changed in `name`'s record since it was last taken, and forget it (None: the
    /// table does not know `name`).
    pub fn take_changes(&mut self, name: &str) -> Option<SharedChanges> {
        let r = self.resources.get_mut(name)?;
        let changed = std::mem::take(&mut r.changed);
        Some(SharedChanges {
            version: r.version,
            epoch: r.epoch,
            holders: changed
                .into_iter()
                .map(|id| (id, r.holders.get(&id).map(|h| holder_record(id, h))))
                .collect(),
        })
    }

    /// Forget what changed (the whole records were just written).
    pub fn forget_changes(&mut self) {
        for r in self.resources.values_mut() {
            r.changed.clear();
        }
    }

    fn res_record(r: &Res) -> SharedResourceRecord {
        let holders = r
            .holders
            .iter()
            .map(|(id, h)| holder_record(*id, h))
            .collect();
        SharedResourceRecord {
            version: r.version,
            epoch: r.epoch,
            holders,
        }
    }

    /// Rebuilds the table after a restart: versions, epochs and holders as persisted, no
    /// waiters. The core decides what happens to the restored holders (reconnect window,
    /// TTL) and ends them through [`SharedTable::end`].
    pub fn restore(records: SharedRecords) -> Result<SharedTable, RestoreError> {
        let mut t = SharedTable::new();
        for (name, r) in records.resources {
            if r.version > MAX_COUNTER || r.epoch > MAX_COUNTER {
                return Err(RestoreError(format!(
                    "{name:?}: version or epoch out of range"
                )));
            }
            let mut res = Res {
                version: r.version,
                epoch: r.epoch,
                ..Res::default()
            };
            for h in r.holders {
                if t.index.contains_key(&h.id) {
                    return Err(RestoreError(format!("lease id {} twice", h.id)));
                }
                if h.epoch > r.epoch || h.version > r.version {
                    return Err(RestoreError(format!(
                        "lease {} on {name:?} is ahead of its resource's epoch/version",
                        h.id
                    )));
                }
                if h.mode == Mode::Exclusive {
                    res.exclusive = Some(h.id);
                }
                res.holders.insert(
                    h.id,
                    Holder {
                        holder: h.holder,
                        mode: h.mode,
                        epoch: h.epoch,
                        version: h.version,
                        commits: h.commits,
                    },
                );
                t.index.insert(h.id, (name.clone(), Place::Holder));
            }
            if res.exclusive.is_some() && res.holders.len() > 1 {
                return Err(RestoreError(format!(
                    "{name:?} has an exclusive holder and other holders"
                )));
            }
            t.resources.insert(name, res);
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests;
