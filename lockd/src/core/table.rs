//! The lease table: resources, their holders, their waiters and their epochs, with the
//! indexes that find a lease by its id or by its holder's name in O(log n).
//!
//! Every lease kind stores its leases here. A lease's kind ([`LeaseKind`]) says which
//! module owns its life cycle (today only [`LeaseKind::Exclusive`], in `exclusive.rs`); the
//! kinds to come (TTL, shared with versions, quantity over offers) each add one variant and
//! one module next to it. Every change of a resource's holder goes through
//! [`Table::set_lease`] so that the indexes never drift from the table.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::records::PersistedLease;
use super::SessionId;

pub use crate::proto::LeaseKind;

/// Who may hold a resource alongside whom.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LeaseMode {
    /// Nobody else (today's only mode).
    #[default]
    Exclusive,
}

/// A live lease, held by a session (connected, or alive through its anchors).
#[derive(Debug, Clone)]
pub(super) struct Lease {
    /// Unique for the life of the state file; never reused.
    pub lease_id: u64,
    /// Its kind.
    pub kind: LeaseKind,
    /// Its mode.
    pub mode: LeaseMode,
    /// The holding session.
    pub session: SessionId,
    /// Holder name given at acquire.
    pub holder: String,
    /// Fencing epoch.
    pub epoch: u64,
    /// Reclaim secret.
    pub token: String,
    /// Wall-clock grant time.
    pub granted_at_unix_ms: u64,
    /// Revoke reason once revoked (the lease stays until its connection closes).
    pub revoked: Option<String>,
    /// The gang this lease is a member of (granted and released together), if any.
    pub gang: Option<u64>,
}

/// Who holds a resource.
#[derive(Debug, Clone)]
pub(super) enum LeaseState {
    /// Nobody: the next acquire is granted at once.
    Free,
    /// A session.
    Held(Lease),
    /// A lease from before a restart, waiting for its holder to reclaim it until `deadline`.
    Reclaiming {
        /// The persisted lease.
        lease: PersistedLease,
        /// End of the reconnect window.
        deadline: Instant,
    },
}

impl LeaseState {
    /// (lease id, holder name) of the lease, if any.
    fn ident(&self) -> Option<(u64, &str)> {
        match self {
            LeaseState::Free => None,
            LeaseState::Held(l) => Some((l.lease_id, &l.holder)),
            LeaseState::Reclaiming { lease, .. } => Some((lease.lease_id, &lease.name)),
        }
    }

    /// The holder's name, held or reclaiming.
    pub fn holder_name(&self) -> Option<&str> {
        self.ident().map(|(_, h)| h)
    }
}

/// One queued acquire.
#[derive(Debug, Clone)]
pub(super) struct Waiter {
    /// The waiting session.
    pub session: SessionId,
    /// Holder name to use once granted.
    pub holder: String,
    /// The gang this acquire belongs to (it waits with one ticket on every member).
    pub gang: Option<u64>,
    /// Feature `reserve`: the grant is a reservation for this many ms.
    pub reserve_ms: Option<u64>,
}

/// A resource's FIFO of acquires, with O(log n) removal of any session's entry (a waiter
/// that disconnects or cancels leaves from the middle). Tickets come from one counter for
/// every resource ([`Table::next_ticket`]): a gang waits with the same ticket on each of its
/// members, so the oldest waiter of all is first in every queue it is in.
#[derive(Debug, Clone, Default)]
pub(super) struct Waiters {
    /// Waiters by ticket.
    queue: BTreeMap<u64, Waiter>,
    /// Ticket of each waiting session (a session waits at most once per resource).
    by_session: BTreeMap<SessionId, u64>,
    /// Sessions that joined (`true`) or left (`false`) since the wait-for graph last looked
    /// (drained by the core at the end of each step: O(changes), not O(waiters)).
    pub changes: Vec<(SessionId, bool)>,
}

impl Waiters {
    /// Queue `w` with ticket `t` (from [`Table::next_ticket`], so larger than every ticket
    /// queued before); returns its 1-based position.
    pub fn push(&mut self, t: u64, w: Waiter) -> usize {
        self.changes.push((w.session, true));
        self.by_session.insert(w.session, t);
        self.queue.insert(t, w);
        self.queue.len()
    }

    /// The first waiter.
    pub fn front(&self) -> Option<&Waiter> {
        self.queue.first_key_value().map(|(_, w)| w)
    }

    /// Take the first waiter.
    pub fn pop_front(&mut self) -> Option<Waiter> {
        let (_, w) = self.queue.pop_first()?;
        self.by_session.remove(&w.session);
        self.changes.push((w.session, false));
        Some(w)
    }

    /// Take `s`'s entry out of the queue, wherever it is.
    pub fn remove_session(&mut self, s: SessionId) -> Option<Waiter> {
        let t = self.by_session.remove(&s)?;
        self.changes.push((s, false));
        self.queue.remove(&t)
    }

    /// Whether `s` waits here.
    pub fn contains_session(&self, s: SessionId) -> bool {
        self.by_session.contains_key(&s)
    }

    /// Number of waiters.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// No waiter.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Waiters in grant order.
    pub fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.queue.values()
    }
}

/// One resource.
#[derive(Debug, Clone)]
pub(super) struct Resource {
    /// Last epoch granted (persisted).
    pub epoch: u64,
    /// Current holder. Change it only through [`Table::set_lease`].
    pub lease: LeaseState,
    /// Acquires waiting for it.
    pub waiters: Waiters,
    /// What the wait-for graph has of it.
    pub graph: super::deadlock::Synced,
}

impl Resource {
    fn new(epoch: u64) -> Resource {
        Resource {
            epoch,
            lease: LeaseState::Free,
            waiters: Waiters::default(),
            graph: Default::default(),
        }
    }
}

/// Every resource, and the indexes over their leases.
#[derive(Debug, Clone, Default)]
pub(super) struct Table {
    /// Known resources by name.
    pub resources: BTreeMap<String, Resource>,
    /// The id of the last lease granted (persisted, so ids are never reused).
    pub last_lease_id: u64,
    /// Last waiter ticket handed out (one counter for every resource; not persisted:
    /// waiters are not).
    tickets: u64,
    /// Resource of each lease (held or reclaiming), by lease id.
    by_lease: BTreeMap<u64, String>,
    /// Resources each holder name holds (held or reclaiming).
    by_holder: BTreeMap<String, BTreeSet<String>>,
    /// Reconnect-window deadlines of reclaiming leases: (deadline, resource).
    deadlines: BTreeSet<(Instant, String)>,
    /// Resources whose holder or waiters changed since the core last looked (the wait-for
    /// graph is updated from them at the end of each step).
    pub touched: super::deadlock::Touched,
    /// Resources whose persisted record (epoch, holder) may have changed since the last
    /// incremental write (`Core::take_delta` takes them).
    pub noted: BTreeSet<String>,
}

impl Table {
    /// Note that the persisted record of `name` changed (or may have).
    pub fn note(&mut self, name: &str) {
        if !self.noted.contains(name) {
            self.noted.insert(name.to_string());
        }
    }

    /// The resource, for a change of its persisted record (noted).
    pub fn get_noted(&mut self, name: &str) -> Option<&mut Resource> {
        self.note(name);
        self.resources.get_mut(name)
    }

    /// The resource, created free (epoch 0) if unknown (noted: the caller may change it).
    pub fn entry(&mut self, name: &str) -> &mut Resource {
        self.note(name);
        if !self.resources.contains_key(name) {
            self.resources.insert(name.to_string(), Resource::new(0));
        }
        // Just inserted if it was missing.
        self.resources
            .get_mut(name)
            .unwrap_or_else(|| unreachable!("inserted above"))
    }

    /// Add a resource as loaded from the state file.
    pub fn load(&mut self, name: String, epoch: u64, lease: LeaseState) {
        self.resources.insert(name.clone(), Resource::new(epoch));
        self.set_lease(&name, lease);
    }

    /// Note that the waiters of `name` changed.
    pub fn touch(&mut self, name: &str) {
        self.touched.touch(name);
    }

    /// A fresh waiter ticket, larger than every one before.
    pub fn next_ticket(&mut self) -> u64 {
        self.tickets += 1;
        self.tickets
    }

    /// A fresh lease id.
    pub fn new_lease_id(&mut self) -> u64 {
        self.last_lease_id += 1;
        self.last_lease_id
    }

    /// Replace the lease of `name` (which must exist), keeping the indexes; returns the
    /// previous one (None if the resource is unknown).
    pub fn set_lease(&mut self, name: &str, new: LeaseState) -> Option<LeaseState> {
        self.note(name);
        let res = self.resources.get_mut(name)?;
        self.touched.touch(name);
        let old = std::mem::replace(&mut res.lease, new);
        if let Some((id, holder)) = old.ident() {
            self.by_lease.remove(&id);
            if let Some(set) = self.by_holder.get_mut(holder) {
                set.remove(name);
                if set.is_empty() {
                    self.by_holder.remove(holder);
                }
            }
        }
        if let LeaseState::Reclaiming { deadline, .. } = &old {
            self.deadlines.remove(&(*deadline, name.to_string()));
        }
        let res = self.resources.get(name)?;
        if let Some((id, holder)) = res.lease.ident() {
            self.by_lease.insert(id, name.to_string());
            self.by_holder
                .entry(holder.to_string())
                .or_default()
                .insert(name.to_string());
        }
        if let LeaseState::Reclaiming { deadline, .. } = &res.lease {
            self.deadlines.insert((*deadline, name.to_string()));
        }
        Some(old)
    }

    /// The earliest reconnect-window deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Resources whose reconnect window ends at or before `now`, earliest first.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.deadlines
            .iter()
            .take_while(|(d, _)| *d <= now)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// The resource whose lease has this id.
    pub fn resource_of_lease(&self, lease_id: u64) -> Option<&str> {
        self.by_lease.get(&lease_id).map(String::as_str)
    }

    /// Resources held (or being reclaimed) under this holder name, sorted.
    pub fn held_by(&self, holder: &str) -> impl Iterator<Item = &str> {
        self.by_holder
            .get(holder)
            .into_iter()
            .flat_map(|s| s.iter().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: SessionId) -> Waiter {
        Waiter {
            session: s,
            holder: format!("h{s}"),
            gang: None,
            reserve_ms: None,
        }
    }

    #[test]
    fn waiters_keep_fifo_order_and_remove_from_the_middle() {
        let mut q = Waiters::default();
        assert_eq!(q.push(1, w(1)), 1);
        assert_eq!(q.push(2, w(2)), 2);
        assert_eq!(q.push(3, w(3)), 3);
        assert!(q.contains_session(2));
        assert_eq!(q.remove_session(2).unwrap().session, 2);
        assert!(q.remove_session(2).is_none());
        assert!(!q.contains_session(2));
        assert_eq!(q.push(4, w(2)), 3);
        let order: Vec<_> = q.iter().map(|x| x.session).collect();
        assert_eq!(order, vec![1, 3, 2]);
        assert_eq!(q.pop_front().unwrap().session, 1);
        assert_eq!(q.len(), 2);
        assert!(!q.contains_session(1));
    }

    #[test]
    fn indexes_follow_every_lease_change() {
        let mut t = Table::default();
        let lease = |id, holder: &str| {
            LeaseState::Held(Lease {
                lease_id: id,
                kind: LeaseKind::Exclusive,
                mode: LeaseMode::Exclusive,
                session: 1,
                holder: holder.into(),
                epoch: 1,
                token: "t".into(),
                granted_at_unix_ms: 0,
                revoked: None,
                gang: None,
            })
        };
        t.entry("x");
        t.entry("y");
        t.set_lease("x", lease(1, "a"));
        t.set_lease("y", lease(2, "a"));
        assert_eq!(t.held_by("a").collect::<Vec<_>>(), vec!["x", "y"]);
        assert_eq!(t.resource_of_lease(2), Some("y"));
        t.set_lease("x", lease(3, "b"));
        assert_eq!(t.held_by("a").collect::<Vec<_>>(), vec!["y"]);
        assert_eq!(t.held_by("b").collect::<Vec<_>>(), vec!["x"]);
        assert_eq!(t.resource_of_lease(1), None);
        t.set_lease("y", LeaseState::Free);
        assert_eq!(t.held_by("a").count(), 0);
        assert_eq!(t.resource_of_lease(2), None);
        assert!(t.set_lease("zz", LeaseState::Free).is_none());
        let now = Instant::now();
        t.set_lease(
            "y",
            LeaseState::Reclaiming {
                lease: PersistedLease {
                    name: "c".into(),
                    epoch: 1,
                    token: "t".into(),
                    granted_at_unix_ms: 0,
                    peer: None,
                    revoked: false,
                    lease_id: 4,
                    kind: LeaseKind::Exclusive,
                    mode: LeaseMode::Exclusive,
                    expires_at_unix_ms: None,
                    gang: None,
                },
                deadline: now,
            },
        );
        assert_eq!(t.next_deadline(), Some(now));
        assert_eq!(t.due(now), vec!["y".to_string()]);
        assert_eq!(t.resource_of_lease(4), Some("y"));
        t.set_lease("y", LeaseState::Free);
        assert_eq!(t.next_deadline(), None);
    }
}
