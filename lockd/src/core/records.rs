//! The persisted records: what the state file holds, its versions, and the migration from
//! older versions.
//!
//! Version 2 (written by this lockd) has room for every lease kind: each lease carries its
//! id, kind, mode and (for TTL leases) a wall-clock expiry; each resource a data version
//! (bumped by an exclusive holder's commit, for shared leases) and a list of further leases
//! (the kinds that allow several holders); the state keeps tombstones of ended leases with
//! their reason, and the offers of pool resources. Version 1 (lockd before issue 11) is read
//! and migrated in memory: epochs, holders, tokens and counters are kept, every held lease
//! gets a fresh lease id, and the file is rewritten as version 2 by the next persist. Any
//! other version is refused (the file is left untouched).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::table::{LeaseKind, LeaseMode, LeaseState};
use super::Core;
use crate::proto::{Counters, PeerInfo};

/// Current on-disk format version (what this lockd writes).
pub const STATE_VERSION: u32 = 2;

/// Every version this lockd reads (older ones are migrated in memory).
pub const READABLE_STATE_VERSIONS: std::ops::RangeInclusive<u32> = 1..=STATE_VERSION;

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The state file's content (version 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedState {
    /// Format version ([`STATE_VERSION`]).
    pub version: u32,
    /// Every resource ever granted: its last epoch and its holder (if held).
    pub resources: BTreeMap<String, PersistedResource>,
    /// Counters, so that they survive restarts.
    #[serde(default)]
    pub counters: Counters,
    /// The id of the last lease granted: lease ids are never reused, across restarts.
    #[serde(default)]
    pub last_lease_id: u64,
    /// Ended version-2 leases, kept for a bounded time so that their end (and its reason)
    /// can be asked for by lease id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tombstones: Vec<Tombstone>,
    /// Version-2 leases (TTL, shared, quantity) that are granted: what every kind shares
    /// (resource, holder, token, epoch, mode, TTL, bound to a connection or not), by lease id.
    /// Each kind's table keeps the rest in its own records below.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kind_leases: BTreeMap<u64, super::leases::KindLease>,
    /// TTL leases: live leases with wall-clock expiries, their tombstones, their counters.
    /// (Omitted while empty, like every section below: a version-1 workload writes what it
    /// wrote before the kinds existed.)
    #[serde(default, skip_serializing_if = "is_default")]
    pub ttl: crate::kinds::ttl::TtlRecords,
    /// Shared-kind leases: per resource, version, epoch and holders.
    #[serde(default, skip_serializing_if = "is_default")]
    pub shared: crate::kinds::shared::SharedRecords,
    /// Lifetimes of timed shared-kind leases.
    #[serde(default, skip_serializing_if = "is_default")]
    pub shared_ttl: crate::kinds::ttl::TtlRecords,
    /// Quantity pools: offers and leases, by pool name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<String, crate::kinds::quantity::QuantityRecords>,
    /// Counters per version-2 kind.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counters_by_kind: BTreeMap<LeaseKind, crate::proto::KindCounters>,
}

/// [`PersistedState`] as serialized from the core's own records ([`Core::snapshot_view`]):
/// the same fields, in the same order, skipped under the same conditions.
#[derive(Serialize)]
pub struct PersistedStateView<'a> {
    version: u32,
    resources: BTreeMap<&'a str, PersistedResource>,
    counters: Counters,
    last_lease_id: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tombstones: Vec<&'a Tombstone>,
    #[serde(skip_serializing_if = "GrantedLeases::is_empty")]
    kind_leases: GrantedLeases<'a>,
    #[serde(skip_serializing_if = "is_default")]
    ttl: crate::kinds::ttl::TtlRecords,
    #[serde(skip_serializing_if = "is_default")]
    shared: crate::kinds::shared::SharedRecords,
    #[serde(skip_serializing_if = "is_default")]
    shared_ttl: crate::kinds::ttl::TtlRecords,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pools: BTreeMap<&'a str, crate::kinds::quantity::QuantityRecords>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    counters_by_kind: &'a BTreeMap<LeaseKind, crate::proto::KindCounters>,
}

/// The granted version-2 leases of the core's registry, serialized as the map by lease id
/// of [`PersistedState::kind_leases`].
struct GrantedLeases<'a>(&'a BTreeMap<u64, super::leases::KindLease>);

impl GrantedLeases<'_> {
    fn is_empty(&self) -> bool {
        !self.0.values().any(|l| l.granted)
    }
}

impl Serialize for GrantedLeases<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().filter(|(_, l)| l.granted))
    }
}

impl Default for PersistedState {
    fn default() -> Self {
        PersistedState {
            version: STATE_VERSION,
            resources: BTreeMap::new(),
            counters: Counters::default(),
            last_lease_id: 0,
            tombstones: Vec::new(),
            kind_leases: BTreeMap::new(),
            ttl: Default::default(),
            shared: Default::default(),
            shared_ttl: Default::default(),
            pools: BTreeMap::new(),
            counters_by_kind: BTreeMap::new(),
        }
    }
}

/// One resource in the state file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedResource {
    /// Last epoch granted: every later grant gets a strictly greater one.
    pub epoch: u64,
    /// The exclusive holder at the time of writing; on restart it gets a reconnect window.
    pub holder: Option<PersistedLease>,
    /// Data version of a shared-kind resource (its commits), as in `shared` (for humans).
    #[serde(default)]
    pub version: u64,
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
    /// The lease's id (unique for the life of the state file, never 0).
    pub lease_id: u64,
    /// Its kind.
    #[serde(default)]
    pub kind: LeaseKind,
    /// Its mode.
    #[serde(default)]
    pub mode: LeaseMode,
    /// TTL leases: wall-clock expiry (ms since the Unix epoch), so that a restart neither
    /// extends nor shortens it. None for connection-bound leases.
    #[serde(default)]
    pub expires_at_unix_ms: Option<u64>,
    /// The gang this lease was granted with (its members share the gang's token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<u64>,
}

/// An ended lease, remembered with the reason it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// The lease's id.
    pub lease_id: u64,
    /// Its resource.
    pub resource: String,
    /// Its holder.
    pub holder: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its kind.
    #[serde(default)]
    pub kind: LeaseKind,
    /// Why it ended: `released`, `expired` or `revoked:<by whom/why>`.
    pub reason: String,
    /// When it ended (ms since the Unix epoch).
    pub ended_at_unix_ms: u64,
}

/// The state file format of lockd before issue 11 (version 1).
mod v1 {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use crate::proto::{Counters, PeerInfo};

    #[derive(Deserialize)]
    pub struct State {
        pub resources: BTreeMap<String, Resource>,
        #[serde(default)]
        pub counters: Counters,
    }

    #[derive(Deserialize)]
    pub struct Resource {
        pub epoch: u64,
        pub holder: Option<Lease>,
    }

    #[derive(Deserialize)]
    pub struct Lease {
        pub name: String,
        pub epoch: u64,
        pub token: String,
        pub granted_at_unix_ms: u64,
        #[serde(default)]
        pub peer: Option<PeerInfo>,
        #[serde(default)]
        pub revoked: bool,
    }
}

/// Just the version of a state file.
#[derive(Deserialize)]
struct Probe {
    version: u32,
}

/// Migrate a version-1 state: epochs, holders, tokens and counters kept; each held lease
/// gets a lease id (in resource-name order).
fn migrate_v1(old: v1::State) -> PersistedState {
    let mut st = PersistedState {
        counters: old.counters,
        ..PersistedState::default()
    };
    for (name, r) in old.resources {
        let holder = r.holder.map(|l| {
            st.last_lease_id += 1;
            PersistedLease {
                name: l.name,
                epoch: l.epoch,
                token: l.token,
                granted_at_unix_ms: l.granted_at_unix_ms,
                peer: l.peer,
                revoked: l.revoked,
                lease_id: st.last_lease_id,
                kind: LeaseKind::Exclusive,
                mode: LeaseMode::Exclusive,
                expires_at_unix_ms: None,
                gang: None,
            }
        });
        st.resources.insert(
            name,
            PersistedResource {
                epoch: r.epoch,
                holder,
                version: 0,
            },
        );
    }
    st
}

/// Decode state file bytes of any readable version into the current form. Returns the
/// state and the version the file had; the error says what is wrong (the caller refuses to
/// start and leaves the file untouched).
pub fn decode_state(bytes: &[u8]) -> Result<(PersistedState, u32), String> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err("empty file".into());
    }
    let probe: Probe =
        serde_json::from_slice(bytes).map_err(|e| format!("not a lockd state: {e}"))?;
    let st = match probe.version {
        1 => migrate_v1(
            serde_json::from_slice(bytes).map_err(|e| format!("not a lockd state: {e}"))?,
        ),
        STATE_VERSION => {
            serde_json::from_slice(bytes).map_err(|e| format!("not a lockd state: {e}"))?
        }
        v => {
            let (lo, hi) = (
                READABLE_STATE_VERSIONS.start(),
                READABLE_STATE_VERSIONS.end(),
            );
            return Err(if v > *hi {
                format!(
                    "version {v} (this lockd reads versions {lo} to {hi}; \
                     the file was written by a newer lockd)"
                )
            } else {
                format!("version {v} (this lockd reads versions {lo} to {hi})")
            });
        }
    };
    validate(&st)?;
    Ok((st, probe.version))
}

/// Consistency checks of a state (as [`decode_state`] does them): lease ids unique, within
/// the last lease id; holder epochs within their resource's.
pub fn check_state(st: &PersistedState) -> Result<(), String> {
    validate(st)
}

/// Consistency checks of a decoded state.
fn validate(st: &PersistedState) -> Result<(), String> {
    let mut ids = std::collections::BTreeSet::new();
    for (name, r) in &st.resources {
        if let Some(h) = &r.holder {
            if h.epoch > r.epoch || h.epoch == 0 {
                return Err(format!(
                    "resource {name:?}: holder epoch {} inconsistent with epoch {}",
                    h.epoch, r.epoch
                ));
            }
            if h.lease_id == 0 || h.lease_id > st.last_lease_id || !ids.insert(h.lease_id) {
                return Err(format!(
                    "resource {name:?}: lease id {} is 0, repeated or above the last lease id {}",
                    h.lease_id, st.last_lease_id
                ));
            }
        }
    }
    for (id, l) in &st.kind_leases {
        if *id == 0 || *id > st.last_lease_id || !ids.insert(*id) {
            return Err(format!(
                "version-2 lease id {id} is 0, repeated or above the last lease id {}",
                st.last_lease_id
            ));
        }
        // A gang is written whole: its id is its first member, of the same kind and token.
        if let Some(g) = l.gang {
            let first = st.kind_leases.get(&g);
            if g > *id
                || !first
                    .is_some_and(|f| f.gang == Some(g) && f.kind == l.kind && f.token == l.token)
            {
                return Err(format!("version-2 lease {id}: gang {g} is not whole"));
            }
        }
    }
    Ok(())
}

impl Core {
    /// The persisted form of one resource of the lease table.
    pub(super) fn persisted_resource(
        &self,
        name: &str,
        r: &super::table::Resource,
    ) -> PersistedResource {
        let holder = match &r.lease {
            LeaseState::Free => None,
            LeaseState::Held(l) => Some(PersistedLease {
                name: l.holder.clone(),
                epoch: l.epoch,
                token: l.token.clone(),
                granted_at_unix_ms: l.granted_at_unix_ms,
                peer: self.sessions.get(&l.session).map(|s| s.peer.clone()),
                revoked: l.revoked.is_some(),
                lease_id: l.lease_id,
                kind: l.kind,
                mode: l.mode,
                expires_at_unix_ms: None,
                gang: l.gang,
            }),
            LeaseState::Reclaiming { lease, .. } => Some(lease.clone()),
        };
        PersistedResource {
            epoch: r.epoch,
            holder,
            version: self.shared.version(name),
        }
    }

    /// What [`Core::snapshot`] serializes to, borrowed from the core where the core keeps
    /// the records as written (the version-2 leases, the tombstones): a whole-state write
    /// serializes from the view, without cloning the state first and freeing the clone
    /// after (two thirds of a snapshot's cost at 10,000 leases). Same bytes as the
    /// snapshot's, checked at every write of the kinds model.
    pub fn snapshot_view(&self) -> PersistedStateView<'_> {
        PersistedStateView {
            version: STATE_VERSION,
            resources: self
                .table
                .resources
                .iter()
                .map(|(name, r)| (name.as_str(), self.persisted_resource(name, r)))
                .collect(),
            counters: self.counters,
            last_lease_id: self.table.last_lease_id,
            tombstones: self
                .tomb_order
                .iter()
                .filter_map(|id| self.tombs.get(id))
                .collect(),
            kind_leases: GrantedLeases(&self.kl),
            ttl: self.ttl.snapshot(),
            shared: self.shared.snapshot(),
            shared_ttl: self.shared_ttl.snapshot(),
            pools: self
                .pools
                .iter()
                .map(|(n, p)| (n.as_str(), p.records()))
                .collect(),
            counters_by_kind: &self.counters_by_kind,
        }
    }

    /// The full persisted form of the current state (always the current version).
    pub fn snapshot(&self) -> PersistedState {
        let resources = self
            .table
            .resources
            .iter()
            .map(|(name, r)| (name.clone(), self.persisted_resource(name, r)))
            .collect();
        PersistedState {
            version: STATE_VERSION,
            resources,
            counters: self.counters,
            last_lease_id: self.table.last_lease_id,
            tombstones: self
                .tomb_order
                .iter()
                .filter_map(|id| self.tombs.get(id).cloned())
                .collect(),
            kind_leases: self
                .kl
                .iter()
                .filter(|(_, l)| l.granted)
                .map(|(id, l)| (*id, l.clone()))
                .collect(),
            ttl: self.ttl.snapshot(),
            shared: self.shared.snapshot(),
            shared_ttl: self.shared_ttl.snapshot(),
            pools: self
                .pools
                .iter()
                .map(|(n, p)| (n.clone(), p.records()))
                .collect(),
            counters_by_kind: self.counters_by_kind.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_state, LeaseKind, LeaseMode, STATE_VERSION};

    /// Written by lockd before issue 11 (see tests/fixtures/gen-state-v1.py).
    const FIXTURE_V1: &[u8] = include_bytes!("../../tests/fixtures/state-v1.json");

    #[test]
    fn a_version_1_file_is_migrated_keeping_epochs_holders_tokens_and_counters() {
        let (st, from) = decode_state(FIXTURE_V1).unwrap();
        assert_eq!((from, st.version), (1, STATE_VERSION));
        let e = &st.resources["engine"];
        let h = e.holder.as_ref().unwrap();
        assert_eq!((e.epoch, h.epoch, h.name.as_str()), (3, 3, "engine-a"));
        assert_eq!(h.token, "969a748ba65aad13af08833c93dd3e94");
        assert_eq!(
            (h.kind, h.mode, h.revoked),
            (LeaseKind::Exclusive, LeaseMode::Exclusive, false)
        );
        let g = &st.resources["gpu-pool"];
        assert_eq!((g.epoch, g.holder.is_none()), (1, true));
        let w = st.resources["weights"].holder.as_ref().unwrap();
        assert!(w.revoked);
        // Lease ids: fresh, distinct, within the last id.
        assert_ne!(h.lease_id, w.lease_id);
        assert_eq!(st.last_lease_id, 2);
        assert_eq!(
            (
                st.counters.grants,
                st.counters.releases,
                st.counters.revocations
            ),
            (5, 3, 1)
        );
        // The migrated state written back is version 2 and reads back identical.
        let bytes = serde_json::to_vec(&st).unwrap();
        assert!(String::from_utf8_lossy(&bytes).starts_with(r#"{"version":2,"#));
        assert_eq!(decode_state(&bytes).unwrap(), (st, 2));
    }

    #[test]
    fn unknown_versions_and_inconsistent_files_are_refused() {
        for (bad, why) in [
            (&br#"{"version":3,"resources":{}}"#[..], "newer lockd"),
            (br#"{"version":0,"resources":{}}"#, "version 0"),
            (br#"{"resources":{}}"#, "not a lockd state"),
            (br#"{"version":2,"resources":{"r":{"epoch":1,"holder":{"name":"a","epoch":1,"token":"t","granted_at_unix_ms":0}}}}"#, "not a lockd state"),
            (br#"{"version":2,"resources":{"r":{"epoch":1,"holder":{"name":"a","epoch":1,"token":"t","granted_at_unix_ms":0,"lease_id":5}}},"last_lease_id":4}"#, "lease id 5"),
            (br#"{"version":2,"resources":{"r":{"epoch":1,"holder":{"name":"a","epoch":1,"token":"t","granted_at_unix_ms":0,"lease_id":1,"kind":"warp"}}},"last_lease_id":4}"#, "not a lockd state"),
            (br#"{"version":1,"resources":{"r":{"epoch":1,"holder":{"name":"a","epoch":5,"token":"t","granted_at_unix_ms":0}}}}"#, "inconsistent"),
        ] {
            let e = decode_state(bad).unwrap_err();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(bad));
        }
    }

    use crate::core::testkit::*;

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
                holder: None,
                ..Default::default()
            }
        );
        assert_eq!(h.res("e").state, proto::LeaseState::Free);
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
}
