//! The GMS lock state machine, pure: no I/O, time is an input (milliseconds on any
//! monotonic clock the caller chooses).
//!
//! Semantics (gms-wire.md "Lock semantics", and Dynamo's `server/session.py`):
//! * The connection is the session; its lock lives until it disconnects or commits.
//! * State is derived: writer → `RW`; else readers → `RO`; else committed → `COMMITTED`;
//!   else layout sealed → `LAYOUT_COMMITTED`; else `EMPTY`.
//! * Writer (`rw`, `rw_data_or_rw`): granted when no writer and no reader is connected.
//!   Waiting writers block new readers (writer priority). `rw` replaces the store;
//!   `rw_data_or_rw` is granted `rw_data` over a sealed layout, else `rw`.
//! * Reader (`ro`): committed, no writer connected, no writer waiting.
//! * `rw_or_ro`: `ro` when a reader could be admitted; else `rw` when a writer could be
//!   admitted and nothing is committed; else wait. It never counts as a waiting writer.
//! * `commit` publishes and ends the writer's session; a writer that leaves without
//!   committing aborts (store cleared) unless the layout was sealed (`LAYOUT_COMMITTED`).
//! * A handshake whose timeout expires is denied.

use std::collections::{BTreeSet, VecDeque};

use serde::Serialize;

use crate::protocol::{GrantedLockType, RequestedLockType};

/// Identifies one connection (session) on the server.
pub type SessionId = u64;

/// Derived server state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ServerState {
    /// Nothing sealed, nothing committed, nobody connected.
    #[serde(rename = "EMPTY")]
    Empty,
    /// A writer is connected.
    #[serde(rename = "RW")]
    Rw,
    /// A sealed layout without published contents.
    #[serde(rename = "LAYOUT_COMMITTED")]
    LayoutCommitted,
    /// Published contents, nobody connected.
    #[serde(rename = "COMMITTED")]
    Committed,
    /// Readers are connected.
    #[serde(rename = "RO")]
    Ro,
}

impl ServerState {
    /// Wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Empty => "EMPTY",
            Self::Rw => "RW",
            Self::LayoutCommitted => "LAYOUT_COMMITTED",
            Self::Committed => "COMMITTED",
            Self::Ro => "RO",
        }
    }
}

/// A handshake waiting for its lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// Who waits.
    pub session: SessionId,
    /// What it asked for.
    pub requested: RequestedLockType,
    /// When it gives up (caller's clock, ms); None waits forever.
    pub deadline_ms: Option<u64>,
}

/// What the machine asks its owner to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Answer this handshake with success and this mode.
    Granted {
        /// The session granted.
        session: SessionId,
        /// Its mode.
        granted: GrantedLockType,
    },
    /// Answer this handshake with success=false (timeout).
    Denied {
        /// The session refused.
        session: SessionId,
    },
    /// Discard every allocation and metadata entry (replace by `rw`, or writer abort).
    ClearStore,
    /// Append to the event history.
    Event(EventKind),
}

/// Event history kinds the lock machine produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A writer was granted.
    RwConnected,
    /// A writer left without committing or sealing: its work is discarded.
    RwAborted,
    /// A writer left a sealed layout behind.
    RwDisconnected,
    /// Contents were published.
    Committed,
    /// The layout was sealed.
    LayoutCommitted,
}

impl EventKind {
    /// Wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RwConnected => "rw_connected",
            Self::RwAborted => "rw_aborted",
            Self::RwDisconnected => "rw_disconnected",
            Self::Committed => "committed",
            Self::LayoutCommitted => "layout_committed",
        }
    }
}

/// What an RPC needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Read RPCs: any granted session.
    Read,
    /// Allocate, free, metadata put/delete, commit_layout: an `rw` writer.
    Layout,
    /// Commit: `rw` or `rw_data` writer.
    Commit,
}

/// Refusals.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// The session holds no lock (no handshake, or it failed).
    #[error("no lock held by this session")]
    NoLock,
    /// The session's lock does not allow the operation.
    #[error("operation needs {needed} but the session holds {held}")]
    NotAllowed {
        /// What was needed.
        needed: &'static str,
        /// What is held.
        held: GrantedLockType,
    },
    /// The session already holds a lock or waits for one.
    #[error("session already has a handshake")]
    AlreadyHandshaken,
}

/// A consistent view for `get_lock_state` / `get_runtime_state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LockSnapshot {
    /// Derived state.
    pub state: ServerState,
    /// A writer is connected.
    pub has_rw_session: bool,
    /// Readers connected.
    pub ro_session_count: u64,
    /// Writers waiting (they block readers).
    pub waiting_writers: u64,
    /// Contents published.
    pub committed: bool,
    /// Committed and no writer.
    pub is_ready: bool,
    /// Layout sealed (implied by committed).
    pub layout_committed: bool,
}

/// The machine.
#[derive(Debug, Clone, Default)]
pub struct LockMachine {
    /// The connected writer and its mode (`rw` or `rw_data`).
    writer: Option<(SessionId, GrantedLockType)>,
    /// Connected readers.
    readers: BTreeSet<SessionId>,
    /// Contents published (readers may be admitted).
    committed: bool,
    /// Allocation set sealed (survives its writer; `rw_data_or_rw` writes bytes only).
    layout_committed: bool,
    /// Handshakes waiting, in arrival order.
    waiters: VecDeque<Waiter>,
}

impl LockMachine {
    /// A fresh, EMPTY machine.
    pub fn new() -> Self {
        Self::default()
    }

    /// Derived state.
    pub fn state(&self) -> ServerState {
        if self.writer.is_some() {
            ServerState::Rw
        } else if !self.readers.is_empty() {
            ServerState::Ro
        } else if self.committed {
            ServerState::Committed
        } else if self.layout_committed {
            ServerState::LayoutCommitted
        } else {
            ServerState::Empty
        }
    }

    /// Contents published.
    pub fn committed(&self) -> bool {
        self.committed
    }

    /// Layout sealed (or committed).
    pub fn layout_committed(&self) -> bool {
        self.layout_committed || self.committed
    }

    /// Writers in the queue.
    pub fn waiting_writers(&self) -> usize {
        self.waiters
            .iter()
            .filter(|w| w.requested.is_writer())
            .count()
    }

    /// The waiting handshakes.
    pub fn waiters(&self) -> impl Iterator<Item = &Waiter> {
        self.waiters.iter()
    }

    /// Snapshot for the state RPCs.
    pub fn snapshot(&self) -> LockSnapshot {
        let has_rw = self.writer.is_some();
        LockSnapshot {
            state: self.state(),
            has_rw_session: has_rw,
            ro_session_count: self.readers.len() as u64,
            waiting_writers: self.waiting_writers() as u64,
            committed: self.committed,
            is_ready: self.committed && !has_rw,
            layout_committed: self.layout_committed(),
        }
    }

    /// The session's granted mode, if any.
    pub fn mode_of(&self, session: SessionId) -> Option<GrantedLockType> {
        match self.writer {
            Some((s, m)) if s == session => Some(m),
            _ if self.readers.contains(&session) => Some(GrantedLockType::Ro),
            _ => None,
        }
    }

    /// Checks that `session` may perform `op`; returns its mode.
    pub fn check(&self, session: SessionId, op: Op) -> Result<GrantedLockType, LockError> {
        let held = self.mode_of(session).ok_or(LockError::NoLock)?;
        let ok = match op {
            Op::Read => true,
            Op::Layout => held == GrantedLockType::Rw,
            Op::Commit => held.is_writer(),
        };
        if ok {
            Ok(held)
        } else {
            Err(LockError::NotAllowed {
                needed: match op {
                    Op::Read => "any lock",
                    Op::Layout => "an rw lock",
                    Op::Commit => "a writer lock",
                },
                held,
            })
        }
    }

    fn can_grant_rw(&self) -> bool {
        self.writer.is_none() && self.readers.is_empty()
    }

    fn can_grant_ro(&self) -> bool {
        self.committed && self.writer.is_none() && self.waiting_writers() == 0
    }

    /// What `requested` would be granted now, if anything.
    fn grantable(&self, requested: RequestedLockType) -> Option<GrantedLockType> {
        match requested {
            RequestedLockType::Rw => self.can_grant_rw().then_some(GrantedLockType::Rw),
            RequestedLockType::RwDataOrRw => self.can_grant_rw().then(|| {
                if self.layout_committed() {
                    GrantedLockType::RwData
                } else {
                    GrantedLockType::Rw
                }
            }),
            RequestedLockType::Ro => self.can_grant_ro().then_some(GrantedLockType::Ro),
            RequestedLockType::RwOrRo => {
                if self.can_grant_ro() {
                    Some(GrantedLockType::Ro)
                } else if self.can_grant_rw() && !self.committed {
                    Some(GrantedLockType::Rw)
                } else {
                    None
                }
            }
        }
    }

    fn apply_grant(&mut self, session: SessionId, granted: GrantedLockType, out: &mut Vec<Effect>) {
        match granted {
            GrantedLockType::Ro => {
                self.readers.insert(session);
            }
            GrantedLockType::Rw => {
                // "replace": the whole store goes, sealed layout included.
                out.push(Effect::ClearStore);
                self.committed = false;
                self.layout_committed = false;
                self.writer = Some((session, granted));
                out.push(Effect::Event(EventKind::RwConnected));
            }
            GrantedLockType::RwData => {
                // A new writer invalidates published contents but keeps the pages.
                self.committed = false;
                self.layout_committed = true;
                self.writer = Some((session, granted));
                out.push(Effect::Event(EventKind::RwConnected));
            }
        }
        out.push(Effect::Granted { session, granted });
    }

    /// Grants every waiter that can be granted, in arrival order, until nothing changes.
    fn promote(&mut self, out: &mut Vec<Effect>) {
        loop {
            let pick = self
                .waiters
                .iter()
                .enumerate()
                .find_map(|(i, w)| self.grantable_for_waiter(w).map(|g| (i, g)));
            let Some((i, granted)) = pick else { return };
            let Some(w) = self.waiters.remove(i) else {
                return;
            };
            self.apply_grant(w.session, granted, out);
        }
    }

    fn grantable_for_waiter(&self, w: &Waiter) -> Option<GrantedLockType> {
        // A waiting writer must not be blocked by its own entry in waiting_writers: the
        // writer condition never looks at waiting writers, so grantable() is exact.
        self.grantable(w.requested)
    }

    /// A handshake arrives at `now_ms`. Grants at once, denies at once (timeout 0), or queues.
    pub fn handshake(
        &mut self,
        session: SessionId,
        requested: RequestedLockType,
        timeout_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Vec<Effect>, LockError> {
        if self.mode_of(session).is_some() || self.waiters.iter().any(|w| w.session == session) {
            return Err(LockError::AlreadyHandshaken);
        }
        let mut out = Vec::new();
        // Arrival-order fairness: a new reader does not jump a queued writer (writer
        // priority is inside can_grant_ro), and a new writer only gets in when free.
        if let Some(granted) = self.grantable(requested) {
            self.apply_grant(session, granted, &mut out);
            return Ok(out);
        }
        if timeout_ms == Some(0) {
            out.push(Effect::Denied { session });
            return Ok(out);
        }
        self.waiters.push_back(Waiter {
            session,
            requested,
            deadline_ms: timeout_ms.map(|t| now_ms.saturating_add(t)),
        });
        Ok(out)
    }

    /// Earliest waiter deadline, for the owner's timer.
    pub fn next_deadline(&self) -> Option<u64> {
        self.waiters.iter().filter_map(|w| w.deadline_ms).min()
    }

    /// Denies every waiter whose deadline is at or before `now_ms`. A writer leaving the
    /// queue may admit readers, so grants can follow.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].deadline_ms.is_some_and(|d| d <= now_ms) {
                if let Some(w) = self.waiters.remove(i) {
                    out.push(Effect::Denied { session: w.session });
                }
            } else {
                i += 1;
            }
        }
        if !out.is_empty() {
            self.promote(&mut out);
        }
        out
    }

    /// The session's connection closed (at any point: waiting, holding, or after commit).
    pub fn disconnect(&mut self, session: SessionId) -> Vec<Effect> {
        let mut out = Vec::new();
        let before = self.waiters.len();
        self.waiters.retain(|w| w.session != session);
        let mut changed = self.waiters.len() != before;
        if self.readers.remove(&session) {
            changed = true;
        }
        if matches!(self.writer, Some((s, _)) if s == session) {
            self.writer = None;
            changed = true;
            if self.layout_committed {
                out.push(Effect::Event(EventKind::RwDisconnected));
            } else {
                out.push(Effect::Event(EventKind::RwAborted));
                out.push(Effect::ClearStore);
            }
        }
        if changed {
            self.promote(&mut out);
        }
        out
    }

    /// The writer commits: contents published, its session ends (the owner closes it).
    pub fn commit(&mut self, session: SessionId) -> Result<Vec<Effect>, LockError> {
        self.check(session, Op::Commit)?;
        let mut out = vec![Effect::Event(EventKind::Committed)];
        self.committed = true;
        self.layout_committed = true;
        self.writer = None;
        self.promote(&mut out);
        Ok(out)
    }

    /// The writer seals the layout; it stays connected as `rw_data`.
    pub fn commit_layout(&mut self, session: SessionId) -> Result<Vec<Effect>, LockError> {
        self.check(session, Op::Layout)?;
        self.layout_committed = true;
        self.writer = Some((session, GrantedLockType::RwData));
        Ok(vec![Effect::Event(EventKind::LayoutCommitted)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GrantedLockType as G;
    use RequestedLockType as R;

    fn granted(s: SessionId, g: G) -> Effect {
        Effect::Granted {
            session: s,
            granted: g,
        }
    }

    fn rw_grant(s: SessionId) -> Vec<Effect> {
        vec![
            Effect::ClearStore,
            Effect::Event(EventKind::RwConnected),
            granted(s, G::Rw),
        ]
    }

    #[test]
    fn empty_rw_grants_and_clears() {
        let mut m = LockMachine::new();
        assert_eq!(m.state(), ServerState::Empty);
        assert_eq!(m.handshake(1, R::Rw, None, 0).unwrap(), rw_grant(1));
        assert_eq!(m.state(), ServerState::Rw);
        assert!(m.snapshot().has_rw_session);
        assert!(!m.snapshot().is_ready);
    }

    #[test]
    fn ro_on_empty_waits_then_times_out() {
        let mut m = LockMachine::new();
        assert!(m.handshake(1, R::Ro, Some(100), 0).unwrap().is_empty());
        assert_eq!(m.next_deadline(), Some(100));
        assert!(m.expire(99).is_empty());
        assert_eq!(m.expire(100), vec![Effect::Denied { session: 1 }]);
        assert_eq!(m.waiters().count(), 0);
        assert_eq!(m.state(), ServerState::Empty);
    }

    #[test]
    fn zero_timeout_denies_at_once() {
        let mut m = LockMachine::new();
        assert_eq!(
            m.handshake(1, R::Ro, Some(0), 5).unwrap(),
            vec![Effect::Denied { session: 1 }]
        );
    }

    #[test]
    fn commit_publishes_and_admits_waiting_reader() {
        let mut m = LockMachine::new();
        m.handshake(1, R::RwOrRo, None, 0).unwrap();
        assert_eq!(m.mode_of(1), Some(G::Rw));
        // Second rw_or_ro waits (writer connected, nothing committed), not as a writer.
        assert!(m.handshake(2, R::RwOrRo, None, 0).unwrap().is_empty());
        assert_eq!(m.snapshot().waiting_writers, 0);
        let fx = m.commit(1).unwrap();
        assert_eq!(
            fx,
            vec![Effect::Event(EventKind::Committed), granted(2, G::Ro)]
        );
        assert_eq!(m.state(), ServerState::Ro);
        assert!(m.committed());
        assert!(m.snapshot().is_ready);
        // The committed writer's session is over: its disconnect changes nothing.
        assert!(m.disconnect(1).is_empty());
        assert_eq!(m.disconnect(2), vec![]);
        assert_eq!(m.state(), ServerState::Committed);
    }

    #[test]
    fn rw_or_ro_on_committed_gets_ro() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        assert_eq!(
            m.handshake(2, R::RwOrRo, None, 0).unwrap(),
            vec![granted(2, G::Ro)]
        );
    }

    #[test]
    fn uncommitted_writer_disconnect_aborts() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.handshake(2, R::RwOrRo, None, 0).unwrap();
        let fx = m.disconnect(1);
        assert_eq!(
            fx,
            vec![
                Effect::Event(EventKind::RwAborted),
                Effect::ClearStore,
                // The next rw_or_ro gets rw (nothing committed).
                Effect::ClearStore,
                Effect::Event(EventKind::RwConnected),
                granted(2, G::Rw),
            ]
        );
        assert_eq!(m.state(), ServerState::Rw);
    }

    #[test]
    fn abort_with_nobody_waiting_leaves_empty() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.disconnect(1);
        assert_eq!(m.state(), ServerState::Empty);
        assert!(!m.committed());
    }

    #[test]
    fn writer_priority_blocks_new_readers() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        assert_eq!(
            m.handshake(2, R::Ro, None, 0).unwrap(),
            vec![granted(2, G::Ro)]
        );
        // A writer queues behind the reader...
        assert!(m.handshake(3, R::Rw, None, 0).unwrap().is_empty());
        assert_eq!(m.snapshot().waiting_writers, 1);
        // ...and a new reader is not admitted although contents are committed.
        assert!(m.handshake(4, R::Ro, Some(50), 0).unwrap().is_empty());
        assert!(m.handshake(5, R::RwOrRo, None, 0).unwrap().is_empty());
        // The reader leaves: the writer gets in (replace), readers keep waiting.
        let fx = m.disconnect(2);
        assert_eq!(fx, rw_grant(3));
        assert!(!m.committed());
        // The waiting ro times out.
        assert_eq!(m.expire(50), vec![Effect::Denied { session: 4 }]);
        // Writer commits: the rw_or_ro waiter is admitted as reader.
        assert_eq!(
            m.commit(3).unwrap(),
            vec![Effect::Event(EventKind::Committed), granted(5, G::Ro)]
        );
    }

    #[test]
    fn waiting_writer_timeout_releases_readers() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        m.handshake(2, R::Ro, None, 0).unwrap();
        m.handshake(3, R::Rw, Some(10), 0).unwrap();
        m.handshake(4, R::Ro, None, 0).unwrap();
        assert_eq!(
            m.expire(10),
            vec![Effect::Denied { session: 3 }, granted(4, G::Ro)]
        );
        assert_eq!(m.snapshot().ro_session_count, 2);
    }

    #[test]
    fn waiting_writer_disconnect_releases_readers() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        m.handshake(2, R::Ro, None, 0).unwrap();
        m.handshake(3, R::Rw, None, 0).unwrap();
        m.handshake(4, R::Ro, None, 0).unwrap();
        assert_eq!(m.disconnect(3), vec![granted(4, G::Ro)]);
    }

    #[test]
    fn commit_layout_then_disconnect_leaves_layout_committed() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        assert_eq!(
            m.commit_layout(1).unwrap(),
            vec![Effect::Event(EventKind::LayoutCommitted)]
        );
        assert_eq!(m.mode_of(1), Some(G::RwData));
        // rw_data may commit but not change the layout.
        assert!(m.check(1, Op::Commit).is_ok());
        assert!(matches!(
            m.check(1, Op::Layout),
            Err(LockError::NotAllowed { .. })
        ));
        assert_eq!(
            m.disconnect(1),
            vec![Effect::Event(EventKind::RwDisconnected)]
        );
        assert_eq!(m.state(), ServerState::LayoutCommitted);
        assert!(m.snapshot().layout_committed);
        assert!(!m.snapshot().committed);
        // rw_data_or_rw over the sealed layout: rw_data, no store clear.
        assert_eq!(
            m.handshake(2, R::RwDataOrRw, None, 0).unwrap(),
            vec![Effect::Event(EventKind::RwConnected), granted(2, G::RwData)]
        );
        m.commit(2).unwrap();
        assert_eq!(m.state(), ServerState::Committed);
    }

    #[test]
    fn rw_data_or_rw_on_empty_is_rw() {
        let mut m = LockMachine::new();
        assert_eq!(m.handshake(1, R::RwDataOrRw, None, 0).unwrap(), rw_grant(1));
    }

    #[test]
    fn rw_data_or_rw_on_committed_is_rw_data_and_unpublishes() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        let fx = m.handshake(2, R::RwDataOrRw, None, 0).unwrap();
        assert_eq!(
            fx,
            vec![Effect::Event(EventKind::RwConnected), granted(2, G::RwData)]
        );
        assert!(!m.committed());
        // rw_data leaving without commit: layout stays, contents unpublished.
        m.disconnect(2);
        assert_eq!(m.state(), ServerState::LayoutCommitted);
    }

    #[test]
    fn rw_on_committed_replaces() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit(1).unwrap();
        assert_eq!(m.handshake(2, R::Rw, None, 0).unwrap(), rw_grant(2));
        assert!(!m.snapshot().layout_committed);
    }

    #[test]
    fn rw_or_ro_waits_while_layout_committed_writer_active() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.commit_layout(1).unwrap();
        assert!(m.handshake(2, R::RwOrRo, Some(5), 0).unwrap().is_empty());
        assert_eq!(m.expire(5), vec![Effect::Denied { session: 2 }]);
    }

    #[test]
    fn permissions() {
        let mut m = LockMachine::new();
        assert_eq!(m.check(1, Op::Read), Err(LockError::NoLock));
        m.handshake(1, R::Rw, None, 0).unwrap();
        assert_eq!(m.check(1, Op::Layout), Ok(G::Rw));
        m.commit(1).unwrap();
        m.handshake(2, R::Ro, None, 0).unwrap();
        assert_eq!(m.check(2, Op::Read), Ok(G::Ro));
        assert!(m.check(2, Op::Layout).is_err());
        assert!(m.commit(2).is_err());
        assert!(m.commit_layout(2).is_err());
        assert_eq!(
            m.handshake(2, R::Ro, None, 0),
            Err(LockError::AlreadyHandshaken)
        );
    }

    #[test]
    fn second_writer_waits_for_first() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        assert!(m.handshake(2, R::Rw, None, 0).unwrap().is_empty());
        assert_eq!(m.snapshot().waiting_writers, 1);
        assert_eq!(
            m.disconnect(1),
            vec![
                Effect::Event(EventKind::RwAborted),
                Effect::ClearStore,
                Effect::ClearStore,
                Effect::Event(EventKind::RwConnected),
                granted(2, G::Rw)
            ]
        );
    }

    #[test]
    fn several_readers_admitted_together() {
        let mut m = LockMachine::new();
        m.handshake(1, R::Rw, None, 0).unwrap();
        m.handshake(2, R::Ro, None, 0).unwrap();
        m.handshake(3, R::Ro, None, 0).unwrap();
        assert_eq!(
            m.commit(1).unwrap(),
            vec![
                Effect::Event(EventKind::Committed),
                granted(2, G::Ro),
                granted(3, G::Ro)
            ]
        );
        m.disconnect(2);
        assert_eq!(m.state(), ServerState::Ro);
        m.disconnect(3);
        assert_eq!(m.state(), ServerState::Committed);
    }
}
