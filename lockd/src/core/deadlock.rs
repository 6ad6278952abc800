//! Deadlock detection (issue 12 point 3): the wait-for graph of sessions, kept exactly and
//! incrementally by [`crate::kinds::waitfor::WaitForGraph`] from the exclusive lease table.
//!
//! An edge `w -> h` means session `w` waits (a single acquire, or a gang member) for a
//! resource that session `h` holds. Every step that changes a resource's holder or waiters
//! marks it *touched* (`Table::touched`); at the end of the step the edges of each touched
//! resource are recomputed (O(its waiters)) and the graph updated, which finds every new
//! cycle, of any length, in time linear in the part of the graph it reorders. A new cycle is
//! logged, counted (`counters.deadlocks`), sent to watchers as a `deadlock` notice and shown
//! in `status` while it lasts. With `--break-deadlocks` lockd revokes the youngest lease of
//! the cycle (the most recently granted of the leases the cycle waits for), reason
//! `deadlock`, counted apart (`counters.deadlock_breaks`): its holder is told to let go, as
//! with any revoke — the lease moves only once its holder's session has ended.
//!
//! Which waits are in the graph: the version-1 exclusive leases and gangs (whose holders are
//! sessions). TTL and quantity leases are not bound to a session; shared-kind leases are not
//! in the graph yet.

use super::table::LeaseState;
use super::{Core, Now};
use crate::proto::{DeadlockReport, Notice, NoticeKind};

impl Core {
    /// The wait edges resource `r` contributes now: (waiter session, holder session).
    fn edges_of(&self, r: &str) -> Vec<(u64, u64)> {
        let Some(res) = self.table.resources.get(r) else {
            return Vec::new();
        };
        let LeaseState::Held(l) = &res.lease else {
            return Vec::new();
        };
        res.waiters
            .iter()
            .filter(|w| w.session != l.session)
            .map(|w| (w.session, l.session))
            .collect()
    }

    /// End of step: bring the wait-for graph up to date with the touched resources; report
    /// (and, if configured, break) every cycle that appeared.
    pub(super) fn deadlock_pass(&mut self, now: Now) {
        if self.table.touched.is_empty() {
            return;
        }
        let touched = std::mem::take(&mut self.table.touched);
        let mut cycles = Vec::new();
        for r in touched {
            let new = self.edges_of(&r);
            let old = self.res_edges.remove(&r).unwrap_or_default();
            for e in old.iter().filter(|e| !new.contains(e)) {
                self.waitfor.remove_edge(e.0, e.1);
            }
            for e in new.iter().filter(|e| !old.contains(e)) {
                if let Some(c) = self.waitfor.add_edge(e.0, e.1) {
                    cycles.push(c);
                }
            }
            if !new.is_empty() {
                self.res_edges.insert(r, new);
            }
        }
        for c in cycles {
            self.report_deadlock(now, &c);
        }
    }

    /// For each consecutive pair of a cycle, the resource the first waits for and the second
    /// holds (with the holder's lease id).
    fn cycle_resources(&self, cycle: &[u64]) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (i, w) in cycle.iter().enumerate() {
            let h = cycle[(i + 1) % cycle.len()];
            let Some(ws) = self.sessions.get(w) else {
                continue;
            };
            let found = ws
                .waits
                .iter()
                .find_map(|r| match self.table.resources.get(r) {
                    Some(res) => match &res.lease {
                        LeaseState::Held(l) if l.session == h => Some((r.clone(), l.lease_id)),
                        _ => None,
                    },
                    None => None,
                });
            if let Some(f) = found {
                out.push(f);
            }
        }
        out
    }

    fn report_deadlock(&mut self, now: Now, cycle: &[u64]) {
        let res = self.cycle_resources(cycle);
        self.counters.deadlocks += 1;
        self.dirty = true;
        self.notice(
            Notice {
                kind: NoticeKind::Deadlock,
                resource: res.first().map(|r| r.0.clone()).unwrap_or_default(),
                holder: None,
                epoch: 0,
                session: cycle.first().copied(),
                reclaimed: false,
                after_revoke: false,
                reason: Some(format!(
                    "sessions {} wait for each other through {}",
                    cycle
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(" -> "),
                    res.iter()
                        .map(|r| r.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                at_unix_ms: now.unix_ms,
                lease_id: None,
                lease_kind: None,
                version: None,
            },
            None,
        );
        if self.cfg.break_deadlocks {
            // The youngest lease the cycle waits for: the highest lease id.
            if let Some((r, _)) = res.iter().max_by_key(|x| x.1).cloned() {
                let before = self.counters.revocations;
                self.revoke_as_lockd(now, r, "deadlock".into());
                if self.counters.revocations > before {
                    self.counters.deadlock_breaks += 1;
                }
            }
        }
    }

    /// lockd itself revokes the lease of `resource` (to break a deadlock): marked revoked,
    /// its holder told to fence itself and let go; it moves when the holder's session ends.
    fn revoke_as_lockd(&mut self, now: Now, resource: String, reason: String) {
        let Some(res) = self.table.resources.get_mut(&resource) else {
            return;
        };
        let LeaseState::Held(l) = &mut res.lease else {
            return;
        };
        if l.revoked.is_some() {
            return;
        }
        l.revoked = Some(reason.clone());
        let (holder, epoch, hs) = (l.holder.clone(), l.epoch, l.session);
        self.counters.revocations += 1;
        self.dirty = true;
        self.notice(
            Notice {
                kind: NoticeKind::Revoked,
                resource: resource.clone(),
                holder: Some(holder),
                epoch,
                session: Some(hs),
                reclaimed: false,
                after_revoke: false,
                reason: Some(reason.clone()),
                at_unix_ms: now.unix_ms,
                lease_id: None,
                lease_kind: None,
                version: None,
            },
            None,
        );
        self.send(
            hs,
            crate::proto::Event::Revoked {
                resource,
                epoch,
                reason,
            },
        );
    }

    /// The deadlocks that exist now, for `status`.
    pub(super) fn deadlock_reports(&self) -> Vec<DeadlockReport> {
        if self.waitfor.deadlock_count() == 0 {
            return Vec::new();
        }
        self.waitfor
            .deadlocks()
            .into_iter()
            .map(|c| DeadlockReport {
                resources: self.cycle_resources(&c).into_iter().map(|r| r.0).collect(),
                sessions: c,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! Deadlocks: cycles of any length found exactly, reported, and broken when asked.
    use crate::core::testkit::*;

    /// Sessions 1..=n each hold resource r{i}, then each waits for the next one's resource;
    /// `close` makes the last wait for the first's (a cycle), else the chain stays open.
    fn ring(h: &mut H, n: u64, close: bool) -> Vec<Output> {
        h.connect(1000, "unix");
        h.req(1000, Request::Watch);
        for i in 1..=n {
            h.connect(i, "unix");
            h.req(i, acq(&format!("r{i}"), &format!("h{i}"), true));
        }
        let mut last = Vec::new();
        for i in 1..=n {
            let next = if i == n { 1 } else { i + 1 };
            if i == n && !close {
                break;
            }
            last = h.req(i, acq(&format!("r{next}"), &format!("h{i}"), true));
        }
        last
    }

    fn deadlock_notices(out: &[Output]) -> Vec<String> {
        H::to(out, 1000)
            .into_iter()
            .filter_map(|e| match e {
                Event::Notice(n) if n.kind == NoticeKind::Deadlock => n.reason,
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_seeds_two_cycle_is_found_and_reported() {
        let mut h = H::new();
        let out = ring(&mut h, 2, true);
        let n = deadlock_notices(&out);
        assert_eq!(n.len(), 1, "{out:?}");
        assert!(n[0].contains("r1") && n[0].contains("r2"), "{}", n[0]);
        let st = h.st();
        assert_eq!(st.deadlocks.len(), 1);
        let mut s = st.deadlocks[0].sessions.clone();
        s.sort_unstable();
        assert_eq!(s, vec![1, 2]);
        assert_eq!(st.counters.deadlocks, 1);
        // A waiter gives up: the cycle is gone.
        h.req(2, Request::release("r1"));
        assert!(h.st().deadlocks.is_empty());
    }

    #[test]
    fn three_and_fifty_cycles_are_found_exactly_and_a_long_chain_is_no_cycle() {
        for n in [3u64, 50] {
            let mut h = H::new();
            let out = ring(&mut h, n, true);
            assert_eq!(deadlock_notices(&out).len(), 1, "n={n}");
            let st = h.st();
            assert_eq!(st.deadlocks.len(), 1);
            assert_eq!(st.deadlocks[0].sessions.len(), n as usize);
            assert_eq!(st.deadlocks[0].resources.len(), n as usize);
        }
        let mut h = H::new();
        let out = ring(&mut h, 500, false);
        assert!(deadlock_notices(&out).is_empty());
        assert!(h.st().deadlocks.is_empty());
        assert_eq!(h.st().counters.deadlocks, 0);
    }

    #[test]
    fn gangs_are_in_the_graph_too() {
        let mut h = H::new();
        h.connect(1000, "unix");
        h.req(1000, Request::Watch);
        h.connect(1, "unix");
        h.connect(2, "unix");
        h.req(1, acq("a", "one", true));
        h.req(2, acq("b", "two", true));
        let gang = Request::Acquire {
            resource: "g".into(),
            holder: "two".into(),
            wait: true,
            ext: proto::AcquireExt {
                gang: Some(vec!["a".into(), "c".into()]),
                ..Default::default()
            },
        };
        h.req(2, gang);
        let out = h.req(1, acq("b", "one", true));
        assert_eq!(deadlock_notices(&out).len(), 1);
    }

    #[test]
    fn break_deadlocks_revokes_the_youngest_lease_of_the_cycle() {
        let mut h = H::with_cfg(PersistedState::default(), None, 0, |c| {
            c.break_deadlocks = true
        });
        let out = ring(&mut h, 3, true);
        // The youngest lease the cycle waits for is r3's (granted last), held by session 3.
        assert!(
            H::to(&out, 3).iter().any(|e| matches!(e, Event::Revoked { resource, reason, .. } if resource == "r3" && reason == "deadlock")),
            "{out:?}"
        );
        let c = h.st().counters;
        assert_eq!((c.deadlocks, c.deadlock_breaks, c.revocations), (1, 1, 1));
        // The lease moves once its holder lets go: then nobody waits in a cycle.
        let out = h.step(Input::Disconnect { session: 3 });
        assert!(H::granted(&out, 2).is_some());
        assert!(h.st().deadlocks.is_empty());
    }
}
