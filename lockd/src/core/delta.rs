//! Incremental persistence: what changed since the last durable write, as one
//! [`StateDelta`] (a line of the journal beside the state file, `PROTOCOL.md` "State file").
//!
//! The core notes, as it goes, every name whose records a step changes ([`Table::note`] for
//! the lease table, [`Core::note_name`] for the kinds' tables), every version-2 lease it
//! grants, changes or ends ([`Core::note_lease`]), and the tombstones it adds and forgets.
//! [`Core::take_delta`] turns the notes into a delta holding, for each noted name, all its
//! records as they are now (or their absence), the noted leases by id (or their absence),
//! the tombstones added and forgotten, and the small counters and the last lease id whole.
//! Applying the deltas in order to the state they follow ([`StateDelta::apply`]) gives
//! exactly [`Core::snapshot`]: the property tests check that at every write of random
//! histories.
//!
//! [`Table::note`]: super::table::Table::note

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::leases::KindLease;
use super::records::{PersistedResource, PersistedState, Tombstone, STATE_VERSION};
use super::table::LeaseKind;
use super::Core;
use crate::kinds::quantity::{PoolChanges, QuantityRecords};
use crate::kinds::shared::{SharedChanges, SharedResourceRecord};
use crate::kinds::ttl::{TtlCounters, TtlLeaseRecord};
use crate::proto::{Counters, KindCounters};

/// Every record of one name (resource or pool) as it is now; all `None`: it has none left.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NameRecords {
    /// Its entry in `resources` (epoch, connection-bound holder, data version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<PersistedResource>,
    /// Its entry in `shared.resources`, whole (written by a lockd before shared changes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedResourceRecord>,
    /// Or what changed in that entry (created if absent): its version and epoch, and the
    /// holders that came, changed or went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_changes: Option<SharedChanges>,
    /// Its entry in `pools` (the whole pool: offers and leases), when the pool is new since
    /// the last write (or was written whole by a lockd before pool changes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<QuantityRecords>,
    /// Or what changed in that entry: the offers and leases changed, each as it is now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_changes: Option<PoolChanges>,
}

/// Every record of one version-2 lease id as it is now; all `None`: it has ended (or was
/// never granted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecords {
    /// Its entry in `kind_leases`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<KindLease>,
    /// Its entry in `ttl.leases`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<TtlLeaseRecord>,
    /// Its entry in `shared_ttl.leases`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_ttl: Option<TtlLeaseRecord>,
}

/// What changed in the persisted state since the last write: one journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDelta {
    /// Format version of the records ([`STATE_VERSION`]).
    pub version: u32,
    /// Journal number: set by the driver (1, 2, 3, … after each snapshot's stamp); the core
    /// leaves it 0.
    #[serde(default)]
    pub n: u64,
    /// Changed names, with all their records now.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub names: BTreeMap<String, NameRecords>,
    /// Changed version-2 leases by id, with all their records now.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leases: BTreeMap<u64, LeaseRecords>,
    /// Tombstones forgotten (they were in the state this delta follows).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tombs_forgotten: Vec<u64>,
    /// Tombstones added, oldest first (appended after the remaining ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tombs_added: Vec<Tombstone>,
    /// Counters, whole.
    pub counters: Counters,
    /// The last lease id handed out.
    pub last_lease_id: u64,
    /// Counters per kind, whole.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counters_by_kind: BTreeMap<LeaseKind, KindCounters>,
    /// The TTL table's counters (left out while zero, as a version-1 workload has them: read
    /// back as zero all the same).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ttl_counters: TtlCounters,
    /// The timed shared leases' counters (likewise).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_ttl_counters: TtlCounters,
}

/// Counters still at zero (their default, which an absent field reads back as).
fn is_zero(c: &TtlCounters) -> bool {
    *c == TtlCounters::default()
}

impl StateDelta {
    /// Whether the delta changes no record (counters aside).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
            && self.leases.is_empty()
            && self.tombs_added.is_empty()
            && self.tombs_forgotten.is_empty()
    }

    /// Apply to the state this delta follows. Fails (the journal is corrupt) on a version
    /// this lockd does not write; the records themselves are taken as they are.
    pub fn apply(&self, st: &mut PersistedState) -> Result<(), String> {
        if self.version != STATE_VERSION {
            return Err(format!(
                "journal line of version {} (this lockd writes version {STATE_VERSION})",
                self.version
            ));
        }
        for (name, r) in &self.names {
            set(&mut st.resources, name, &r.resource);
            match &r.shared_changes {
                Some(c) => st
                    .shared
                    .resources
                    .entry(name.clone())
                    .or_default()
                    .apply(c),
                None => set(&mut st.shared.resources, name, &r.shared),
            }
            match &r.pool_changes {
                Some(c) => match st.pools.get_mut(name) {
                    Some(p) => p.apply(c),
                    None => {
                        return Err(format!(
                            "journal line changes pool {name:?}, absent from the state it follows"
                        ))
                    }
                },
                None => set(&mut st.pools, name, &r.pool),
            }
        }
        for (id, r) in &self.leases {
            match &r.lease {
                Some(l) => {
                    st.kind_leases.insert(*id, l.clone());
                }
                None => {
                    st.kind_leases.remove(id);
                }
            }
            set_by_id(&mut st.ttl.leases, *id, &r.ttl);
            set_by_id(&mut st.shared_ttl.leases, *id, &r.shared_ttl);
        }
        if !self.tombs_forgotten.is_empty() {
            let gone: BTreeSet<u64> = self.tombs_forgotten.iter().copied().collect();
            st.tombstones.retain(|t| !gone.contains(&t.lease_id));
        }
        st.tombstones.extend(self.tombs_added.iter().cloned());
        st.counters = self.counters;
        st.last_lease_id = self.last_lease_id;
        st.counters_by_kind = self.counters_by_kind.clone();
        st.ttl.counters = self.ttl_counters;
        st.shared_ttl.counters = self.shared_ttl_counters;
        Ok(())
    }
}

fn set<T: Clone>(map: &mut BTreeMap<String, T>, name: &str, v: &Option<T>) {
    match v {
        Some(v) => {
            if let Some(x) = map.get_mut(name) {
                *x = v.clone();
            } else {
                map.insert(name.to_string(), v.clone());
            }
        }
        None => {
            map.remove(name);
        }
    }
}

/// `leases` is sorted by id (as the TTL table writes it).
fn set_by_id(leases: &mut Vec<TtlLeaseRecord>, id: u64, v: &Option<TtlLeaseRecord>) {
    match (leases.binary_search_by_key(&id, |r| r.id), v) {
        (Ok(i), Some(v)) => leases[i] = v.clone(),
        (Ok(i), None) => {
            leases.remove(i);
        }
        (Err(i), Some(v)) => leases.insert(i, v.clone()),
        (Err(_), None) => {}
    }
}

/// Fewest changes [`Core::change_is_large`] calls large.
pub const LARGE_CHANGE: usize = 256;

/// What the core noted since the last [`Core::take_delta`].
#[derive(Debug, Clone, Default)]
pub(super) struct Notes {
    /// Names whose records of the kinds' tables (shared, pools) may have changed.
    pub names: BTreeSet<String>,
    /// Version-2 leases granted, changed or ended.
    pub leases: BTreeSet<u64>,
    /// Tombstones added, in order.
    pub tombs_added: Vec<u64>,
    /// Tombstones forgotten.
    pub tombs_forgotten: Vec<u64>,
}

impl Core {
    /// Note that the records of `name` (resource or pool) changed.
    pub(super) fn note_name(&mut self, name: &str) {
        if !self.notes.names.contains(name) {
            self.notes.names.insert(name.to_string());
        }
    }

    /// Note that version-2 lease `id` was granted, changed or ended (call it while the
    /// registry still has it: its resource is noted too).
    pub(super) fn note_lease(&mut self, id: u64) {
        self.notes.leases.insert(id);
        if let Some((r, kind)) = self.kl.get(&id).map(|l| (l.resource.clone(), l.kind)) {
            if kind == crate::proto::LeaseKind::Shared {
                // Its role in the wait-for graph may change: the graph looks at it.
                self.graph.shared_touched.push(id);
            }
            self.note_name(&r);
        }
    }

    /// Forget what was noted (the driver writes a whole snapshot instead of a delta).
    pub fn drop_delta(&mut self) {
        self.notes = Notes::default();
        self.table.noted.clear();
        for p in self.pools.values_mut() {
            p.forget_changes();
        }
        self.shared.forget_changes();
    }

    /// Whether the changes noted since the last write touch so much of the state (at least
    /// half of its records, and at least [`LARGE_CHANGE`] of them: a mass hand-over) that a
    /// whole snapshot costs no more than the delta would: the driver writes the snapshot.
    pub fn change_is_large(&self) -> bool {
        // Estimates, in records: a name noted twice or a lease ended (an empty entry) counts
        // as much as a full record, and waiting requests count as records of the state.
        let change = self.table.noted.len()
            + self.notes.names.len()
            + self.notes.leases.len()
            + self.notes.tombs_added.len().min(self.cfg.max_tombstones);
        if change < LARGE_CHANGE {
            return false;
        }
        let records = self.table.resources.len()
            + self.kl.len()
            + self.pools.values().map(|p| p.lease_count()).sum::<usize>()
            + self.tombs.len();
        2 * change >= records
    }

    /// What changed since the last call (or since the core was built): apply it to the
    /// state last written to get [`Core::snapshot`]. Clears the notes. The driver calls it
    /// for every journal line; a write of the whole snapshot calls [`Core::drop_delta`].
    pub fn take_delta(&mut self) -> StateDelta {
        let notes = std::mem::take(&mut self.notes);
        let mut names: BTreeSet<String> = std::mem::take(&mut self.table.noted);
        names.extend(notes.names);
        let names = names
            .into_iter()
            .map(|name| {
                let rec = NameRecords {
                    resource: self
                        .table
                        .resources
                        .get(&name)
                        .map(|r| self.persisted_resource(&name, r)),
                    shared: None,
                    shared_changes: self.shared.take_changes(&name),
                    pool: None,
                    pool_changes: None,
                };
                // A pool: what changed in it (all of it when it is new since the last write).
                let rec = match self.pools.get_mut(&name) {
                    Some(p) => match p.take_changes() {
                        Some(c) => NameRecords {
                            pool_changes: Some(c),
                            ..rec
                        },
                        None => NameRecords {
                            pool: Some(p.records()),
                            ..rec
                        },
                    },
                    None => rec,
                };
                (name, rec)
            })
            .collect();
        let leases = notes
            .leases
            .into_iter()
            .map(|id| {
                let rec = LeaseRecords {
                    lease: self.kl.get(&id).filter(|l| l.granted).cloned(),
                    ttl: self.ttl.record(id),
                    shared_ttl: self.shared_ttl.record(id),
                };
                (id, rec)
            })
            .collect();
        let added: BTreeSet<u64> = notes.tombs_added.iter().copied().collect();
        let tombs_forgotten = notes
            .tombs_forgotten
            .into_iter()
            .filter(|id| !added.contains(id))
            .collect();
        let tombs_added = notes
            .tombs_added
            .iter()
            .filter_map(|id| self.tombs.get(id).cloned())
            .collect();
        StateDelta {
            version: STATE_VERSION,
            n: 0,
            names,
            leases,
            tombs_forgotten,
            tombs_added,
            counters: self.counters,
            last_lease_id: self.table.last_lease_id,
            counters_by_kind: self.counters_by_kind.clone(),
            ttl_counters: self.ttl.counters(),
            shared_ttl_counters: self.shared_ttl.counters(),
        }
    }
}
