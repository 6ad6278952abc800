//! Reports: the `status` answer, and the per-resource figures metrics read.

use std::collections::BTreeMap;

use super::leases::KindLease;
use super::table::LeaseState;
use super::{Core, Now};
use crate::proto::{self, ResourceReport, SessionReport, StatusReport};

/// What a resource's version-2 leases show in `status`: the most recent grant, the holders
/// and the waiters (the first `cap` names of each, in lease id order, and how many).
#[derive(Default)]
struct KindOn<'a> {
    /// The kind of the leases (a resource has one kind at a time).
    kind: Option<proto::LeaseKind>,
    /// The granted lease with the highest epoch.
    latest: Option<&'a KindLease>,
    /// Holder names of the granted leases (at most `cap`).
    holders: Vec<&'a str>,
    /// How many granted leases.
    holder_n: usize,
    /// Holder names of the waiting requests (at most `cap`).
    waiters: Vec<&'a str>,
    /// How many waiting requests.
    waiter_n: usize,
}

impl Core {
    /// The status report as of `now`: the full one (`with_sessions`), or the summary, which
    /// lists no session and no version-2 lease and, per resource, only the first
    /// [`proto::STATUS_SUMMARY_NAMES`] waiters and holders with their counts.
    pub fn status(&self, now: Now, with_sessions: bool) -> StatusReport {
        let cap = if with_sessions {
            usize::MAX
        } else {
            proto::STATUS_SUMMARY_NAMES
        };
        // Version-2 leases by resource, in one pass (O(n log n), not O(resources × leases));
        // names past `cap` are counted, not collected. (A hash map was slower here: hashing
        // 10,000 names cost more than comparing them down this tree.)
        let mut by_res: BTreeMap<&str, KindOn<'_>> = BTreeMap::new();
        for l in self.kl.values() {
            let on = by_res.entry(l.resource.as_str()).or_default();
            on.kind = Some(l.kind);
            if l.granted {
                on.holder_n += 1;
                if on.holders.len() < cap {
                    on.holders.push(&l.holder);
                }
                if on.latest.is_none_or(|x| l.epoch >= x.epoch) {
                    on.latest = Some(l);
                }
            } else {
                on.waiter_n += 1;
                if on.waiters.len() < cap {
                    on.waiters.push(&l.holder);
                }
            }
        }
        let resources = self
            .table
            .resources
            .iter()
            .map(|(name, r)| {
                let waiters = r
                    .waiters
                    .iter()
                    .take(cap)
                    .map(|w| w.holder.clone())
                    .collect();
                let waiter_count = (!with_sessions).then_some(r.waiters.len());
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
                        waiter_count,
                        holder_count: None,
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
                        waiter_count,
                        holder_count: None,
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
                        waiter_count,
                        holder_count: None,
                    },
                }
            })
            .map(|rep| match by_res.get(rep.name.as_str()) {
                Some(on) => self.with_kind_holders(rep, on, with_sessions),
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
    fn with_kind_holders(
        &self,
        mut rep: ResourceReport,
        on: &KindOn<'_>,
        with_sessions: bool,
    ) -> ResourceReport {
        // As `kind_in_use` says, without its lookups in every kind's table for each
        // resource: the version-1 table first (held, or queued for), else the kind of the
        // resource's leases.
        if rep.state != proto::LeaseState::Free || !rep.waiters.is_empty() {
            return rep;
        }
        let kind = match on.kind {
            Some(k) if k != proto::LeaseKind::Exclusive => k,
            _ => return rep,
        };
        rep.kind = Some(kind);
        rep.waiters = on.waiters.iter().map(|h| h.to_string()).collect();
        rep.waiter_count = (!with_sessions).then_some(on.waiter_n);
        if let Some(first) = on.latest {
            rep.state = proto::LeaseState::Held;
            rep.holder = Some(first.holder.clone());
            rep.epoch = first.epoch;
            rep.granted_at_unix_ms = Some(first.granted_at_unix_ms);
            rep.holder_session = first.session;
            rep.revoked = first.revoked.is_some();
        }
        if kind != proto::LeaseKind::Ttl {
            rep.holders = on.holders.iter().map(|h| h.to_string()).collect();
            rep.holder_count = (!with_sessions).then_some(on.holder_n);
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
        assert_eq!(
            H::to(&h.req(1, Request::Ping), 1),
            vec![Event::Pong { valid_ms: None }]
        );
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
            !json.contains("kind") && !json.contains("holders") && !json.contains("_count"),
            "{json}"
        );
    }

    #[test]
    fn the_summary_lists_the_first_waiters_and_holders_and_counts_them_all() {
        let n = proto::STATUS_SUMMARY_NAMES;
        let mut h = H::new();
        // v1 "e": one holder, n + 3 waiters; ttl "t": one holder, n + 3 waiters; shared
        // "s": n + 2 readers, one writer waiting.
        let mut s = 0;
        let mut next = || {
            s += 1;
            s
        };
        for i in 0..n + 4 {
            let id = next();
            h.connect(id, "unix");
            h.req(id, acq("e", &format!("e{i}"), true));
            let id = next();
            h.connect(id, "unix");
            h.req(id, acq_ttl("t", &format!("t{i}"), 60_000, true));
        }
        for i in 0..n + 2 {
            let id = next();
            h.connect(id, "unix");
            h.req(id, acq_shared("s", &format!("r{i}"), true, None));
        }
        let id = next();
        h.connect(id, "unix");
        h.req(id, acq_shared("s", "w", false, None));
        let names = |p: &str, r: std::ops::Range<usize>| -> Vec<String> {
            r.map(|i| format!("{p}{i}")).collect()
        };
        let full = h.core.status(h.now(), true);
        let sum = h.core.status(h.now(), false);
        let res = |st: &proto::StatusReport, r: &str| {
            st.resources.iter().find(|x| x.name == r).unwrap().clone()
        };
        // Full: every name, no counts (its shape is unchanged).
        assert_eq!(res(&full, "e").waiters, names("e", 1..n + 4));
        assert_eq!(res(&full, "t").waiters, names("t", 1..n + 4));
        assert_eq!(res(&full, "s").holders, names("r", 0..n + 2));
        for r in ["e", "t", "s"] {
            let x = res(&full, r);
            assert_eq!((x.waiter_count, x.holder_count), (None, None), "{r}");
        }
        // Summary: the first n names in grant order, and how many there are.
        let (e, t, sh) = (res(&sum, "e"), res(&sum, "t"), res(&sum, "s"));
        assert_eq!(
            (e.waiters, e.waiter_count, e.holder_count),
            (names("e", 1..n + 1), Some(n + 3), None)
        );
        assert_eq!(e.holder.as_deref(), Some("e0"));
        assert_eq!(
            (t.waiters, t.waiter_count, t.holder_count),
            (names("t", 1..n + 1), Some(n + 3), None)
        );
        assert_eq!(
            (sh.holders, sh.holder_count, sh.waiters, sh.waiter_count),
            (
                names("r", 0..n),
                Some(n + 2),
                vec!["w".to_string()],
                Some(1)
            )
        );
        // Everything else is as in the full report.
        assert_eq!(sh.holder, res(&full, "s").holder);
        assert_eq!(sh.epoch, res(&full, "s").epoch);
        let json = serde_json::to_string(&res(&sum, "e")).unwrap();
        assert!(
            json.ends_with(&format!(r#""waiter_count":{}}}"#, n + 3)),
            "{json}"
        );
    }
}
