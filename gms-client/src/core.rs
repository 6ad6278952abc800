//! The whole GMS server state, pure: lock machine + allocation records + metadata +
//! layout hash + event history. Generic over the backend handle `H` (a memfd, a CUDA
//! allocation handle, or `()` in tests) so that no I/O happens here: the owner creates
//! backend memory before [`GmsCore::insert_allocation`] and releases the handles that
//! [`Outcome::released`] hands back.

use std::collections::{BTreeMap, HashMap, VecDeque};

use sha2::{Digest, Sha256};

use crate::lock::{Effect, LockError, LockMachine, Op, SessionId};
use crate::protocol::{
    AllocationInfo, GrantedLockType, LockStateInfo, RequestedLockType, RuntimeEvent, RuntimeState,
};

/// Events kept for `get_event_history` (the spec's 256).
pub const MAX_EVENTS: usize = 256;

/// Largest allocation the server accepts (1 TiB): beyond any GPU, and it keeps the
/// granularity rounding far from overflow.
pub const MAX_ALLOCATION: u64 = 1 << 40;

/// One allocation and its backend handle.
#[derive(Debug)]
pub struct AllocRecord<H> {
    /// What the wire says about it.
    pub info: AllocationInfo,
    /// The backend's memory (released when the record goes).
    pub handle: H,
}

/// One metadata entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaEntry {
    /// Allocation the tensor lives in.
    pub allocation_id: String,
    /// Offset of the tensor in it.
    pub offset_bytes: u64,
    /// Opaque value.
    pub value: Vec<u8>,
}

/// What the owner must do after a lock transition.
#[derive(Debug)]
pub struct Outcome<H> {
    /// Handshake answers: Some(mode) = granted, None = denied (timeout).
    pub answers: Vec<(SessionId, Option<GrantedLockType>)>,
    /// Backend handles to release (store cleared).
    pub released: Vec<H>,
}

impl<H> Default for Outcome<H> {
    fn default() -> Self {
        Self {
            answers: Vec::new(),
            released: Vec::new(),
        }
    }
}

/// Refusals of an RPC (the server answers `error_response`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// Lock rules.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// Unknown allocation id.
    #[error("allocation {0:?} not found")]
    NotFound(String),
    /// Bad arguments.
    #[error("bad request: {0}")]
    BadRequest(String),
}

/// Metadata references an allocation that does not exist (hash cannot be computed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metadata key {key:?} references missing allocation {allocation_id:?}")]
pub struct DanglingMetadata {
    /// The key.
    pub key: String,
    /// The missing allocation.
    pub allocation_id: String,
}

/// The memory layout hash of gms-wire.md: SHA-256 hex over, for each allocation in
/// layout_slot order with rank = its index, `rank:size:aligned_size:tag`; then for each
/// metadata key in sorted order, `key:rank_of_its_allocation:offset_bytes:` followed by
/// the raw value bytes. No separators between the pieces.
pub fn layout_hash<'a>(
    allocations: impl IntoIterator<Item = &'a AllocationInfo>,
    metadata: impl IntoIterator<Item = (&'a str, &'a MetaEntry)>,
) -> Result<String, DanglingMetadata> {
    let mut allocs: Vec<&AllocationInfo> = allocations.into_iter().collect();
    allocs.sort_by_key(|a| a.layout_slot);
    let mut h = Sha256::new();
    let mut rank_of: HashMap<&str, usize> = HashMap::with_capacity(allocs.len());
    for (rank, a) in allocs.iter().enumerate() {
        rank_of.insert(a.allocation_id.as_str(), rank);
        h.update(format!("{rank}:{}:{}:{}", a.size, a.aligned_size, a.tag).as_bytes());
    }
    let mut meta: Vec<(&str, &MetaEntry)> = metadata.into_iter().collect();
    meta.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    for (key, e) in meta {
        let rank = rank_of
            .get(e.allocation_id.as_str())
            .ok_or_else(|| DanglingMetadata {
                key: key.to_string(),
                allocation_id: e.allocation_id.clone(),
            })?;
        h.update(format!("{key}:{rank}:{}:", e.offset_bytes).as_bytes());
        h.update(&e.value);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[usize::from(b >> 4)] as char);
        s.push(D[usize::from(b & 15)] as char);
    }
    s
}

/// The server state.
#[derive(Debug)]
pub struct GmsCore<H> {
    /// Who holds which lock.
    lock: LockMachine,
    /// Allocations by layout slot (slot order = layout order).
    allocs: BTreeMap<u64, AllocRecord<H>>,
    /// allocation_id → slot.
    slot_by_id: HashMap<String, u64>,
    /// Metadata by key (sorted, as metadata_list answers).
    metadata: BTreeMap<String, MetaEntry>,
    /// Next layout slot (reset when the store is cleared).
    next_slot: u64,
    /// Hash of the sealed layout ("" when none).
    layout_hash: String,
    /// Last [`MAX_EVENTS`] events.
    events: VecDeque<RuntimeEvent>,
    /// Allocation granularity of the backend (sizes are rounded up to it).
    granularity: u64,
}

impl<H> GmsCore<H> {
    /// An EMPTY store with this backend granularity (clamped to at least 1).
    pub fn new(granularity: u64) -> Self {
        Self {
            lock: LockMachine::new(),
            allocs: BTreeMap::new(),
            slot_by_id: HashMap::new(),
            metadata: BTreeMap::new(),
            next_slot: 0,
            layout_hash: String::new(),
            events: VecDeque::with_capacity(MAX_EVENTS),
            granularity: granularity.max(1),
        }
    }

    /// The lock machine (read-only).
    pub fn lock(&self) -> &LockMachine {
        &self.lock
    }

    /// Allocations held.
    pub fn allocation_count(&self) -> u64 {
        self.allocs.len() as u64
    }

    fn push_event(&mut self, kind: &str, allocation_count: u64) {
        if self.events.len() == MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(RuntimeEvent {
            kind: kind.to_string(),
            allocation_count,
        });
    }

    fn clear_store(&mut self, out: &mut Outcome<H>) -> u64 {
        let n = self.allocs.len() as u64;
        let had = n > 0 || !self.metadata.is_empty() || !self.layout_hash.is_empty();
        out.released.extend(
            std::mem::take(&mut self.allocs)
                .into_values()
                .map(|r| r.handle),
        );
        self.slot_by_id.clear();
        self.metadata.clear();
        self.layout_hash.clear();
        self.next_slot = 0;
        if had {
            self.push_event("allocations_cleared", n);
        }
        n
    }

    fn apply(&mut self, effects: Vec<Effect>) -> Outcome<H> {
        let mut out = Outcome::default();
        for e in effects {
            match e {
                Effect::Granted { session, granted } => out.answers.push((session, Some(granted))),
                Effect::Denied { session } => out.answers.push((session, None)),
                Effect::ClearStore => {
                    self.clear_store(&mut out);
                }
                Effect::Event(kind) => {
                    let n = self.allocs.len() as u64;
                    self.push_event(kind.as_str(), n);
                }
            }
        }
        out
    }

    /// A handshake at `now_ms`.
    pub fn handshake(
        &mut self,
        session: SessionId,
        requested: RequestedLockType,
        timeout_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Outcome<H>, CoreError> {
        let fx = self
            .lock
            .handshake(session, requested, timeout_ms, now_ms)?;
        Ok(self.apply(fx))
    }

    /// Earliest handshake deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        self.lock.next_deadline()
    }

    /// Denies expired handshakes.
    pub fn expire(&mut self, now_ms: u64) -> Outcome<H> {
        let fx = self.lock.expire(now_ms);
        self.apply(fx)
    }

    /// A connection closed.
    pub fn disconnect(&mut self, session: SessionId) -> Outcome<H> {
        let fx = self.lock.disconnect(session);
        self.apply(fx)
    }

    fn compute_hash(&self) -> Result<String, CoreError> {
        layout_hash(
            self.allocs.values().map(|r| &r.info),
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)),
        )
        .map_err(|e| CoreError::BadRequest(e.to_string()))
    }

    /// Commit: computes the hash, publishes, ends the writer's session.
    pub fn commit(&mut self, session: SessionId) -> Result<(String, Outcome<H>), CoreError> {
        self.lock.check(session, Op::Commit)?;
        let hash = self.compute_hash()?;
        self.layout_hash = hash.clone();
        let fx = self.lock.commit(session)?;
        Ok((hash, self.apply(fx)))
    }

    /// Seals the layout; the session continues as `rw_data`.
    pub fn commit_layout(
        &mut self,
        session: SessionId,
    ) -> Result<(String, GrantedLockType), CoreError> {
        self.lock.check(session, Op::Layout)?;
        let hash = self.compute_hash()?;
        self.layout_hash = hash.clone();
        let fx = self.lock.commit_layout(session)?;
        self.apply(fx);
        Ok((hash, GrantedLockType::RwData))
    }

    /// Validates an allocate request; returns the aligned size to create.
    pub fn check_allocate(&self, session: SessionId, size: u64) -> Result<u64, CoreError> {
        self.lock.check(session, Op::Layout)?;
        if size == 0 || size > MAX_ALLOCATION {
            return Err(CoreError::BadRequest(format!(
                "size {size} out of range (1..={MAX_ALLOCATION})"
            )));
        }
        Ok(size.div_ceil(self.granularity) * self.granularity)
    }

    /// Records an allocation the owner has created.
    pub fn insert_allocation(
        &mut self,
        allocation_id: String,
        size: u64,
        aligned_size: u64,
        tag: String,
        handle: H,
    ) -> AllocationInfo {
        let slot = self.next_slot;
        self.next_slot += 1;
        let info = AllocationInfo {
            allocation_id: allocation_id.clone(),
            size,
            aligned_size,
            tag,
            layout_slot: slot,
        };
        self.slot_by_id.insert(allocation_id, slot);
        self.allocs.insert(
            slot,
            AllocRecord {
                info: info.clone(),
                handle,
            },
        );
        info
    }

    /// Records an allocation failure (backend out of memory).
    pub fn record_oom(&mut self) {
        let n = self.allocs.len() as u64;
        self.push_event("allocation_oom", n);
    }

    /// Frees one allocation (and the metadata that points into it).
    pub fn free(&mut self, session: SessionId, id: &str) -> Result<Option<H>, CoreError> {
        self.lock.check(session, Op::Layout)?;
        let Some(slot) = self.slot_by_id.remove(id) else {
            return Ok(None);
        };
        self.metadata.retain(|_, e| e.allocation_id != id);
        Ok(self.allocs.remove(&slot).map(|r| r.handle))
    }

    /// One allocation (read RPCs and export).
    pub fn get(&self, session: SessionId, id: &str) -> Result<&AllocRecord<H>, CoreError> {
        self.lock.check(session, Op::Read)?;
        self.slot_by_id
            .get(id)
            .and_then(|s| self.allocs.get(s))
            .ok_or_else(|| CoreError::NotFound(id.to_string()))
    }

    /// Allocations in layout order, optionally one tag.
    pub fn list(
        &self,
        session: SessionId,
        tag: Option<&str>,
    ) -> Result<Vec<AllocationInfo>, CoreError> {
        self.lock.check(session, Op::Read)?;
        Ok(self
            .allocs
            .values()
            .filter(|r| tag.is_none_or(|t| r.info.tag == t))
            .map(|r| r.info.clone())
            .collect())
    }

    /// Stores a metadata entry (the allocation must exist, the offset lie inside it).
    pub fn metadata_put(
        &mut self,
        session: SessionId,
        key: String,
        allocation_id: String,
        offset_bytes: u64,
        value: Vec<u8>,
    ) -> Result<(), CoreError> {
        self.lock.check(session, Op::Layout)?;
        let rec = self
            .slot_by_id
            .get(&allocation_id)
            .and_then(|s| self.allocs.get(s))
            .ok_or_else(|| CoreError::NotFound(allocation_id.clone()))?;
        if offset_bytes >= rec.info.aligned_size {
            return Err(CoreError::BadRequest(format!(
                "offset_bytes {offset_bytes} out of range for allocation {allocation_id} \
                 (aligned_size={})",
                rec.info.aligned_size
            )));
        }
        self.metadata.insert(
            key,
            MetaEntry {
                allocation_id,
                offset_bytes,
                value,
            },
        );
        Ok(())
    }

    /// One metadata entry.
    pub fn metadata_get(
        &self,
        session: SessionId,
        key: &str,
    ) -> Result<Option<&MetaEntry>, CoreError> {
        self.lock.check(session, Op::Read)?;
        Ok(self.metadata.get(key))
    }

    /// Deletes a metadata entry.
    pub fn metadata_delete(&mut self, session: SessionId, key: &str) -> Result<bool, CoreError> {
        self.lock.check(session, Op::Layout)?;
        Ok(self.metadata.remove(key).is_some())
    }

    /// Sorted keys with `prefix`.
    pub fn metadata_list(
        &self,
        session: SessionId,
        prefix: &str,
    ) -> Result<Vec<String>, CoreError> {
        self.lock.check(session, Op::Read)?;
        Ok(self
            .metadata
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect())
    }

    /// `get_memory_layout_hash`: the committed hash, empty when not committed.
    pub fn committed_hash(&self, session: SessionId) -> Result<String, CoreError> {
        self.lock.check(session, Op::Read)?;
        Ok(if self.lock.committed() {
            self.layout_hash.clone()
        } else {
            String::new()
        })
    }

    /// `get_allocation_state`.
    pub fn allocation_state(&self, session: SessionId) -> Result<u64, CoreError> {
        self.lock.check(session, Op::Read)?;
        Ok(self.allocation_count())
    }

    /// `get_lock_state` body.
    pub fn lock_state(&self, session: SessionId) -> Result<LockStateInfo, CoreError> {
        self.lock.check(session, Op::Read)?;
        let s = self.lock.snapshot();
        Ok(LockStateInfo {
            state: s.state.as_str().to_string(),
            has_rw_session: s.has_rw_session,
            ro_session_count: s.ro_session_count,
            waiting_writers: s.waiting_writers,
            committed: s.committed,
            is_ready: s.is_ready,
            layout_committed: s.layout_committed,
        })
    }

    /// `get_runtime_state` body (no lock needed).
    pub fn runtime_state(&self) -> RuntimeState {
        let s = self.lock.snapshot();
        RuntimeState {
            state: s.state.as_str().to_string(),
            has_rw_session: s.has_rw_session,
            ro_session_count: s.ro_session_count,
            waiting_writers: s.waiting_writers,
            committed: s.committed,
            is_ready: s.is_ready,
            allocation_count: self.allocation_count(),
            memory_layout_hash: if s.layout_committed {
                self.layout_hash.clone()
            } else {
                String::new()
            },
            layout_committed: s.layout_committed,
        }
    }

    /// `get_event_history` body (no lock needed).
    pub fn events(&self) -> Vec<RuntimeEvent> {
        self.events.iter().cloned().collect()
    }

    /// Every handle, for shutdown.
    pub fn drain_handles(&mut self) -> Vec<H> {
        self.slot_by_id.clear();
        self.metadata.clear();
        std::mem::take(&mut self.allocs)
            .into_values()
            .map(|r| r.handle)
            .collect()
    }

    /// The event kinds of the history (tests).
    pub fn event_kinds(&self) -> Vec<String> {
        self.events.iter().map(|e| e.kind.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RequestedLockType as R;

    const G2M: u64 = 2 << 20;

    fn writer(core: &mut GmsCore<u32>, s: SessionId) {
        let out = core.handshake(s, R::Rw, None, 0).unwrap();
        assert_eq!(out.answers, vec![(s, Some(GrantedLockType::Rw))]);
    }

    fn alloc(core: &mut GmsCore<u32>, s: SessionId, id: &str, size: u64, h: u32) -> AllocationInfo {
        let aligned = core.check_allocate(s, size).unwrap();
        core.insert_allocation(id.into(), size, aligned, "weights".into(), h)
    }

    #[test]
    fn hash_matches_spec_text() {
        // Independent computation of the spec's text, fed to sha256 in one piece.
        let a0 = AllocationInfo {
            allocation_id: "b".into(),
            size: 10,
            aligned_size: 2097152,
            tag: "weights".into(),
            layout_slot: 1,
        };
        let a1 = AllocationInfo {
            allocation_id: "a".into(),
            size: 5,
            aligned_size: 2097152,
            tag: "default".into(),
            layout_slot: 0,
        };
        let m1 = MetaEntry {
            allocation_id: "b".into(),
            offset_bytes: 7,
            value: vec![0xff, 0x00],
        };
        let m2 = MetaEntry {
            allocation_id: "a".into(),
            offset_bytes: 0,
            value: b"{}".to_vec(),
        };
        let got = layout_hash([&a0, &a1], [("z.w", &m1), ("a.w", &m2)]).unwrap();
        let mut text = Vec::new();
        text.extend_from_slice(b"0:5:2097152:default1:10:2097152:weights");
        text.extend_from_slice(b"a.w:0:0:{}");
        text.extend_from_slice(b"z.w:1:7:");
        text.extend_from_slice(&[0xff, 0x00]);
        assert_eq!(got, hex(&Sha256::digest(&text)));
        assert_eq!(got.len(), 64);
        // Empty layout: sha256 of nothing.
        assert_eq!(
            layout_hash([], []).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        // Dangling metadata is an error, not a panic.
        let bad = MetaEntry {
            allocation_id: "nope".into(),
            offset_bytes: 0,
            value: vec![],
        };
        assert!(layout_hash([&a0], [("k", &bad)]).is_err());
    }

    #[test]
    fn allocate_rounds_to_granularity_and_slots_increase() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        let a = alloc(&mut core, 1, "a", 1, 10);
        let b = alloc(&mut core, 1, "b", G2M + 1, 11);
        assert_eq!((a.aligned_size, a.layout_slot), (G2M, 0));
        assert_eq!((b.aligned_size, b.layout_slot), (2 * G2M, 1));
        assert!(core.check_allocate(1, 0).is_err());
        assert!(core.check_allocate(1, MAX_ALLOCATION + 1).is_err());
    }

    #[test]
    fn commit_sets_hash_and_event_history() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        let a = alloc(&mut core, 1, "a", 100, 1);
        core.metadata_put(1, "t".into(), a.allocation_id.clone(), 8, b"v".to_vec())
            .unwrap();
        assert_eq!(core.committed_hash(1).unwrap(), "");
        let (hash, out) = core.commit(1).unwrap();
        assert!(out.answers.is_empty());
        assert_eq!(core.runtime_state().memory_layout_hash, hash);
        assert_eq!(core.runtime_state().state, "COMMITTED");
        assert_eq!(core.event_kinds(), vec!["rw_connected", "committed"]);
        // A reader sees the committed hash.
        core.handshake(2, R::Ro, None, 0).unwrap();
        assert_eq!(core.committed_hash(2).unwrap(), hash);
        assert_eq!(core.list(2, None).unwrap().len(), 1);
        assert_eq!(core.list(2, Some("other")).unwrap().len(), 0);
        assert!(core.free(2, "a").is_err());
    }

    #[test]
    fn abort_releases_handles_and_records_events() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        alloc(&mut core, 1, "a", 100, 7);
        alloc(&mut core, 1, "b", 100, 8);
        let out = core.disconnect(1);
        assert_eq!(out.released, vec![7, 8]);
        assert_eq!(core.allocation_count(), 0);
        assert_eq!(core.runtime_state().state, "EMPTY");
        assert_eq!(
            core.event_kinds(),
            vec!["rw_connected", "rw_aborted", "allocations_cleared"]
        );
        assert_eq!(core.events()[2].allocation_count, 2);
    }

    #[test]
    fn rw_replaces_committed_store() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        alloc(&mut core, 1, "a", 100, 7);
        core.commit(1).unwrap();
        let out = core.handshake(2, R::Rw, None, 0).unwrap();
        assert_eq!(out.released, vec![7]);
        assert_eq!(core.runtime_state().memory_layout_hash, "");
        // Slots restart after a clear.
        assert_eq!(alloc(&mut core, 2, "b", 1, 9).layout_slot, 0);
    }

    #[test]
    fn metadata_rules() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        let a = alloc(&mut core, 1, "a", 100, 7);
        assert!(matches!(
            core.metadata_put(1, "k".into(), "missing".into(), 0, vec![]),
            Err(CoreError::NotFound(_))
        ));
        assert!(matches!(
            core.metadata_put(1, "k".into(), a.allocation_id.clone(), G2M, vec![]),
            Err(CoreError::BadRequest(_))
        ));
        core.metadata_put(1, "b.k".into(), "a".into(), 0, vec![1])
            .unwrap();
        core.metadata_put(1, "a.k".into(), "a".into(), 1, vec![2])
            .unwrap();
        core.metadata_put(1, "c".into(), "a".into(), 2, vec![3])
            .unwrap();
        assert_eq!(core.metadata_list(1, "").unwrap(), vec!["a.k", "b.k", "c"]);
        assert_eq!(core.metadata_list(1, "b").unwrap(), vec!["b.k"]);
        assert_eq!(core.metadata_get(1, "c").unwrap().unwrap().value, vec![3]);
        assert!(core.metadata_delete(1, "c").unwrap());
        assert!(!core.metadata_delete(1, "c").unwrap());
        // Freeing the allocation drops its metadata.
        assert_eq!(core.free(1, "a").unwrap(), Some(7));
        assert!(core.metadata_list(1, "").unwrap().is_empty());
        assert_eq!(core.free(1, "a").unwrap(), None);
    }

    #[test]
    fn layout_commit_survives_writer() {
        let mut core = GmsCore::<u32>::new(G2M);
        writer(&mut core, 1);
        alloc(&mut core, 1, "a", 100, 7);
        let (hash, mode) = core.commit_layout(1).unwrap();
        assert_eq!(mode, GrantedLockType::RwData);
        assert!(core.check_allocate(1, 5).is_err());
        let out = core.disconnect(1);
        assert!(out.released.is_empty());
        let rs = core.runtime_state();
        assert_eq!(rs.state, "LAYOUT_COMMITTED");
        assert_eq!(rs.memory_layout_hash, hash);
        assert_eq!(
            core.event_kinds(),
            vec!["rw_connected", "layout_committed", "rw_disconnected"]
        );
    }

    #[test]
    fn event_history_is_bounded() {
        let mut core = GmsCore::<u32>::new(G2M);
        for s in 0..300u64 {
            writer(&mut core, s);
            core.disconnect(s);
        }
        assert_eq!(core.events().len(), MAX_EVENTS);
        assert_eq!(core.events().last().unwrap().kind, "rw_aborted");
    }

    #[test]
    fn no_lock_no_reads() {
        let core = GmsCore::<u32>::new(G2M);
        assert!(matches!(
            core.list(9, None),
            Err(CoreError::Lock(LockError::NoLock))
        ));
        // Diagnostics need no lock.
        assert_eq!(core.runtime_state().state, "EMPTY");
    }
}
