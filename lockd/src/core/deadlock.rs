//! Deadlock detection (issue 12 point 3): the wait-for graph, kept exactly and incrementally
//! by [`crate::kinds::waitfor::WaitForGraph`] from the exclusive lease table.
//!
//! The graph is the *resource-allocation graph*: its nodes are sessions and resources (a
//! resource's node id has the top bit set), with an edge `w -> r` while session `w` waits for
//! resource `r` (a single acquire, or a gang member) and `r -> h` while session `h` holds it.
//! A cycle in it alternates sessions and resources: each session waits for a resource the
//! next one holds. Keeping the resources as nodes makes every change O(1) graph edits: a
//! hand-over moves one `r -> h` edge (with `w -> h` edges it would move one per waiter, and a
//! contended resource with 63 waiters paid 126 graph edits per hand-over). Every step that
//! changes a resource's holder or waiters marks it *touched* (`Table::touched`; its queue logs
//! who joined and left, `Waiters::changes`); at the end of the step each touched resource's
//! holder is compared with the graph's and its queue's changes are applied, O(1) per change,
//! which finds every new cycle, of any length, in time linear in the part of the graph it
//! reorders. A new cycle is
//! logged, counted (`counters.deadlocks`), sent to watchers as a `deadlock` notice and shown
//! in `status` while it lasts. With `--break-deadlocks` lockd revokes the youngest lease of
//! the cycle (the most recently granted of the leases the cycle waits for), reason
//! `deadlock`, counted apart (`counters.deadlock_breaks`): its holder is told to let go, as
//! with any revoke — the lease moves only once its holder's session has ended.
//!
//! Which waits are in the graph: the version-1 exclusive leases and gangs (whose holders are
//! sessions). TTL and quantity leases are not bound to a session; shared-kind leases are not
//! in the graph yet.

use std::collections::BTreeSet;

use super::table::LeaseState;
use super::{Core, Now};
use crate::proto::{DeadlockReport, Notice, NoticeKind};

/// Resource node ids have this bit set; session ids never do (they count from 1).
const RESOURCE_BIT: u64 = 1 << 63;

/// What the graph holds for one resource.
#[derive(Debug, Clone, Default)]
pub(super) struct Synced {
    /// Its node id.
    node: u64,
    /// The holder session the graph has an edge to.
    holder: Option<u64>,
    /// The waiting sessions the graph has edges from.
    waiters: BTreeSet<u64>,
}

impl Core {
    /// End of step: bring the wait-for graph up to date with the touched resources; report
    /// (and, if configured, break) every cycle that appeared.
    pub(super) fn deadlock_pass(&mut self, now: Now) {
        if self.table.touched.is_empty() {
            return;
        }
        let touched = std::mem::take(&mut self.table.touched);
        let mut cycles = Vec::new();
        for r in touched {
            let (holder, empty) = match self.table.resources.get(&r) {
                Some(res) => (
                    match &res.lease {
                        LeaseState::Held(l) => Some(l.session),
                        _ => None,
                    },
                    res.waiters.is_empty(),
                ),
                None => (None, true),
            };
            if holder.is_none() && empty && !self.synced.contains_key(&r) {
                continue;
            }
            let mut sy = match self.synced.remove(&r) {
                Some(sy) => sy,
                None => {
                    self.next_res_node += 1;
                    let node = RESOURCE_BIT | self.next_res_node;
                    self.res_of_node.insert(node, r.clone());
                    Synced {
                        node,
                        ..Synced::default()
                    }
                }
            };
            let rn = sy.node;
            // The waiters' changes since the last pass, in order (O(changes)). Departures
            // are applied before the holder moves: a waiter that became the holder leaves
            // `w -> r` before `r -> w` appears.
            let changes = match self.table.resources.get_mut(&r) {
                Some(res) => std::mem::take(&mut res.waiters.changes),
                None => Vec::new(),
            };
            let mut joined = Vec::new();
            for (w, join) in changes {
                if join {
                    joined.push(w);
                } else if let Some(i) = joined.iter().position(|x| *x == w) {
                    joined.remove(i);
                } else if sy.waiters.remove(&w) {
                    #[cfg(test)]
                    if self.planted.stale_wait_edges {
                        continue;
                    }
                    self.waitfor.remove_edge(w, rn);
                }
            }
            if sy.holder != holder {
                if let Some(h) = sy.holder {
                    self.waitfor.remove_edge(rn, h);
                }
                sy.holder = holder;
                if let Some(h) = holder {
                    if let Some(c) = self.waitfor.add_edge(rn, h) {
                        cycles.push(c);
                    }
                }
            }
            for w in joined {
                if sy.waiters.insert(w) {
                    if let Some(c) = self.waitfor.add_edge(w, rn) {
                        cycles.push(c);
                    }
                }
            }
            if sy.holder.is_some() || !sy.waiters.is_empty() {
                self.synced.insert(r, sy);
            } else {
                self.res_of_node.remove(&rn);
            }
        }
        for c in cycles {
            self.report_deadlock(now, &c);
        }
    }

    /// A cycle of the graph (sessions and resources alternating) as (sessions in wait order,
    /// the resource each waits for).
    fn split_cycle(&self, cycle: &[u64]) -> (Vec<u64>, Vec<String>) {
        let start = cycle
            .iter()
            .position(|n| n & RESOURCE_BIT == 0)
            .unwrap_or(0);
        let mut sessions = Vec::new();
        let mut resources = Vec::new();
        for k in 0..cycle.len() {
            let n = cycle[(start + k) % cycle.len()];
            if n & RESOURCE_BIT == 0 {
                sessions.push(n);
            } else if let Some(r) = self.res_of_node.get(&n) {
                resources.push(r.clone());
            }
        }
        (sessions, resources)
    }

    fn report_deadlock(&mut self, now: Now, cycle: &[u64]) {
        let (sessions, resources) = self.split_cycle(cycle);
        // The lease each resource of the cycle is held under (its id: larger = younger).
        let res: Vec<(String, u64)> = resources
            .iter()
            .filter_map(|r| match self.table.resources.get(r).map(|x| &x.lease) {
                Some(LeaseState::Held(l)) => Some((r.clone(), l.lease_id)),
                _ => None,
            })
            .collect();
        self.counters.deadlocks += 1;
        self.dirty = true;
        self.notice(
            Notice {
                kind: NoticeKind::Deadlock,
                resource: res.first().map(|r| r.0.clone()).unwrap_or_default(),
                holder: None,
                epoch: 0,
                session: sessions.first().copied(),
                reclaimed: false,
                after_revoke: false,
                reason: Some(format!(
                    "sessions {} wait for each other through {}",
                    sessions
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
                // A lease revoked already (by an operator, or an earlier break) is not
                // revoked again: its holder was told and the cycle ends when it lets go.
                let fresh = matches!(
                    self.table.resources.get(&r).map(|x| &x.lease),
                    Some(LeaseState::Held(l)) if l.revoked.is_none()
                );
                if fresh && self.revoke_held(now, &r, "deadlock".into()).is_some() {
                    self.counters.deadlock_breaks += 1;
                }
            }
        }
    }

    /// The deadlocks that exist now, for `status`.
    pub(super) fn deadlock_reports(&self) -> Vec<DeadlockReport> {
        if self.waitfor.deadlock_count() == 0 {
            return Vec::new();
        }
        self.waitfor
            .deadlocks()
            .into_iter()
            .map(|c| {
                let (sessions, resources) = self.split_cycle(&c);
                DeadlockReport {
                    sessions,
                    resources,
                }
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
