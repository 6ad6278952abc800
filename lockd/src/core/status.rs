//! Reports: the `status` answer, and the per-resource figures metrics read.

use std::collections::BTreeMap;

use super::leases::KindLease;
use super::table::LeaseState;
use super::{Core, Now};
use crate::proto::{self, ResourceReport, SessionReport, StatusReport};

impl Core {
    /// The status report as of `now`.
    pub fn status(&self, now: Now, with_sessions: bool) -> StatusReport {
        // Version-2 leases by resource, in one pass (O(n log n), not O(resources × leases)).
        let mut by_res: BTreeMap<&str, Vec<&KindLease>> = BTreeMap::new();
        for l in self.kl.values() {
            by_res.entry(l.resource.as_str()).or_default().push(l);
        }
        let resources = self
            .table
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
                        kind: None,
                        holders: Vec::new(),
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
                        kind: None,
                        holders: Vec::new(),
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
                        kind: None,
                        holders: Vec::new(),
                    },
                }
            })
            .map(|rep| match by_res.get(rep.name.as_str()) {
                Some(on) => self.with_kind_holders(rep, on),
                None => rep,
            })
            .collect();
        let sessions = if !with_sessions {
            Vec::new()
        } else {
            self.session_reports()
        };
        StatusReport {
            resources,
            counters: self.counters,
            sessions,
            session_count: (!with_sessions).then_some(self.sessions.len()),
            leases: if with_sessions {
                self.lease_reports(now, None, None)
            } else {
                Vec::new()
            },
            lease_count: (!with_sessions).then_some(self.kl.len()),
            pools: self.pool_reports(),
            deadlocks: self.deadlock_reports(),
            counters_by_kind: self.counters_by_kind.clone(),
        }
    }

    /// A resource used by a version-2 kind shows that kind's holders and waiters (the
    /// exclusive table sees it free).
    fn with_kind_holders(&self, mut rep: ResourceReport, on: &[&KindLease]) -> ResourceReport {
        let kind = match self.kind_in_use(&rep.name) {
            Some(k) if k != proto::LeaseKind::Exclusive => k,
            _ => return rep,
        };
        rep.kind = Some(kind);
        let held: Vec<&&KindLease> = on.iter().filter(|l| l.granted).collect();
        rep.waiters = on
            .iter()
            .filter(|l| !l.granted)
            .map(|l| l.holder.clone())
            .collect();
        if let Some(first) = held.iter().max_by_key(|l| l.epoch) {
            rep.state = proto::LeaseState::Held;
            rep.holder = Some(first.holder.clone());
            rep.epoch = first.epoch;
            rep.granted_at_unix_ms = Some(first.granted_at_unix_ms);
            rep.holder_session = first.session;
            rep.revoked = first.revoked.is_some();
        }
        if kind != proto::LeaseKind::Ttl {
            rep.holders = held.iter().map(|l| l.holder.clone()).collect();
        }
        rep
    }

    fn session_reports(&self) -> Vec<SessionReport> {
        self.sessions
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
            .collect()
    }

    /// Number of waiters per resource and whether it is held (metrics), every kind.
    pub fn waiters(&self) -> Vec<(String, usize, bool)> {
        let mut kinds: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
        for l in self.kl.values() {
            let e = kinds.entry(l.resource.as_str()).or_default();
            if l.granted {
                e.1 = true;
            } else {
                e.0 += 1;
            }
        }
        self.table
            .resources
            .iter()
            .map(|(n, r)| {
                let (kw, kh) = kinds.get(n.as_str()).copied().unwrap_or_default();
                (
                    n.clone(),
                    r.waiters.len() + kw,
                    !matches!(r.lease, LeaseState::Free) || kh,
                )
            })
            .collect()
    }

    /// Number of connected sessions (metrics).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }
}

#[cfg(test)]
mod tests {
    //! Transition-by-transition tests of reports.
    use crate::core::testkit::*;

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
        let out = h.req(1, Request::Status { sessions: None });
        let Event::Status(st) = &H::to(&out, 1)[0] else {
            panic!()
        };
        assert_eq!(st.resources[0].holder_peer.as_ref().unwrap().pid, Some(7));
        assert_eq!(st.sessions[0].holds, vec!["e".to_string()]);
        assert_eq!(st.counters.grants, 1);
        assert!(h.step(Input::Disconnect { session: 42 }).is_empty());
    }

    #[test]
    fn resources_of_version_2_kinds_show_their_holders_and_waiters() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq_ttl("t", "a", 1000, true));
        h.req(2, acq_ttl("t", "b", 1000, true));
        h.req(1, acq_shared("s", "r1", true, None));
        h.req(3, acq_shared("s", "r2", true, None));
        let st = h.st();
        let t = st.resources.iter().find(|r| r.name == "t").unwrap();
        assert_eq!(
            (t.state, t.holder.as_deref(), t.kind, t.waiters.clone()),
            (
                proto::LeaseState::Held,
                Some("a"),
                Some(proto::LeaseKind::Ttl),
                vec!["b".to_string()]
            )
        );
        let s = st.resources.iter().find(|r| r.name == "s").unwrap();
        assert_eq!(s.holders, vec!["r1".to_string(), "r2".to_string()]);
        assert_eq!(st.leases.len(), 4);
        // Version-1 resources keep their exact version-1 shape.
        h.req(3, acq("x", "v1", true));
        let json = serde_json::to_string(h.st().resources.iter().find(|r| r.name == "x").unwrap())
            .unwrap();
        assert!(
            !json.contains("kind") && !json.contains("holders"),
            "{json}"
        );
    }
}
