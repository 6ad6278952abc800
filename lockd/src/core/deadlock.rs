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
//! Which waits are in the graph: the version-1 exclusive leases and gangs, and the
//! shared-kind leases. A shared-kind resource has a node too, with an edge `w -> r` from the
//! session of every request in its queue (reader or writer, connection-bound or timed: the
//! session waits either way) and `r -> h` to the session of every connection-bound holder
//! (readers, or the writer): a writer waits for every current reader, a reader behind a
//! waiting writer waits (through it) for the holders too. Requests parked for a
//! `min_version` wait for a commit, not for a holder: not in the graph. Kept incrementally,
//! per lease: every shared-kind lease noted in a step has its role in the graph (holds `r`
//! for session `h`, waits for `r` from session `w`, or none) compared at the end of the step
//! with the one the graph has ([`SharedSynced`], `GraphSync::roles`), O(log n) per changed
//! lease; only a resource whose waiters with an edge go from none to some (or back) adds
//! (removes) its `r -> h` edges, one per holding session. As for the version-1 waits, a
//! waiting session has its edge `w -> r` only while it holds something (`SharedSynced::live`;
//! a session whose count of held resources flips gets its shared waits' edges, or loses
//! them, through `GraphSync::shared_waits_of`): the readers of a mass release and the
//! writers waiting for them cost the graph nothing.
//!
//! Not in the graph, and why: **TTL leases** (and timed shared leases as holders) are bound
//! to no session — they end by themselves when not renewed, whoever renewed them, so a
//! cycle through one is not a deadlock (it resolves when the TTL runs out) and attributing
//! it to the session that acquired it would report cycles that end on their own.
//! **Quantity leases** are always timed (never bound to their connection: without `ttl_ms`
//! one gets its offers' maximum lease time, capped by `--max-lease-time`), so the same
//! holds. A **waiting shared gang** (outside the shared queues: it waits for every member to
//! let it in as a reader at once) has an edge `w -> r` for each member `r` that would not
//! let it in now (a writer holds it, or a writer that arrived before the gang waits in its
//! queue): it waits for `r`'s holders, through the queue. The oldest waiting shared gang
//! on `r` also *fences* `r` against writers that arrive after it (`fence.rs`): the fence is
//! a node of its own (`fence_node_name`), held by the gang's session, with an edge from
//! each writer it holds back — so such a writer waits for the gang while the gang and the
//! writers ahead of it do not, and a cycle through a fence is found like any other (shown
//! as `"<r> (reserved for a waiting shared gang)"`).
//!
//! **Only edges that can lie on a cycle are kept**: `w -> r` only while `w` also holds
//! something (on a cycle, every session is waited for, so holds a resource), and `r -> h`
//! only while some `w -> r` is kept (on a cycle, every resource is waited for by a session
//! of the cycle). Every cycle of the full graph is made of such edges, so the graph has the
//! same cycles, finds them at the same step and reports them alike; but a session that
//! holds nothing costs the graph nothing while it waits, and a resource whose waiters hold
//! nothing (the version-1 hand-over: clients queue again after they release) costs it
//! nothing when it changes hands. A session that starts holding something gets the edges of
//! what it already waits for; one that holds nothing any more loses them. The core keeps,
//! per resource, the holder and the edges the graph has ([`Synced`], in the table's
//! resource), and per session how many resources it holds ([`GraphSync`]).

use std::collections::BTreeMap;

use crate::kinds::waitfor::IdMap;

use super::table::LeaseState;
use super::{Core, Now, SessionId};
use crate::proto::{DeadlockReport, Notice, NoticeKind};

/// Resource node ids have this bit set; session ids never do (they count from 1).
const RESOURCE_BIT: u64 = 1 << 63;

/// What the graph holds for one resource (kept in the table's resource: no lookup of its
/// own, nothing allocated while the resource has no edge).
#[derive(Debug, Clone, Default)]
pub(super) struct Synced {
    /// Its node id while it has an edge (0: none).
    node: u64,
    /// Its holder session as of the last pass (the graph's count of what sessions hold).
    holder: Option<SessionId>,
    /// The holder the graph has an edge `r -> h` to (only while `live_in > 0`).
    edge_to: Option<SessionId>,
    /// Edges `w -> r` the graph has (waiters that hold something).
    live_in: u32,
}

/// What the graph holds for one shared-kind resource (in [`GraphSync`], present while the
/// resource has a connection-bound holder or a waiter in the graph).
#[derive(Debug, Clone, Default)]
pub(super) struct SharedSynced {
    /// Its node id while it has an edge (0: none).
    node: u64,
    /// Connection-bound holder leases per session (a session holds `r` while it has one:
    /// counted in the sessions' holds, and `r -> h` while `live` is not empty).
    holders: BTreeMap<SessionId, u32>,
    /// Waiting leases per session.
    waits: BTreeMap<SessionId, u32>,
    /// The waiting sessions with an edge `w -> r`: those that hold something (the others
    /// cannot lie on a cycle, as for the version-1 waits).
    live: std::collections::BTreeSet<SessionId>,
}

/// What one shared-kind lease is to the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// A connection-bound holder of its resource, of this session.
    Holds(SessionId),
    /// A request of this session waiting for its resource's holders.
    Waits(SessionId),
}

/// Resources touched by a step: their names, in buffers reused from step to step (a
/// touch allocates nothing once a name of that length has been seen).
#[derive(Debug, Clone, Default)]
pub(super) struct Touched {
    names: Vec<String>,
    len: usize,
}

impl Touched {
    /// Notes `name` (a name noted twice is looked at once).
    pub fn touch(&mut self, name: &str) {
        if self.len > 0 && self.names[self.len - 1] == name {
            return;
        }
        match self.names.get_mut(self.len) {
            Some(n) => {
                n.clear();
                n.push_str(name);
            }
            None => self.names.push(name.to_string()),
        }
        self.len += 1;
    }

    /// Nothing noted.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The part of the graph's bookkeeping that is per session, and the pass's scratch buffers.
#[derive(Debug, Clone, Default)]
pub(super) struct GraphSync {
    /// Resource names by their node id in the graph.
    res_of_node: BTreeMap<u64, String>,
    /// Last resource node number handed out.
    next_res_node: u64,
    /// How many resources each session holds (sessions holding nothing are absent).
    held: IdMap<SessionId, u32>,
    /// The resources each session has an edge `w -> r` to.
    edges_of: IdMap<SessionId, Vec<String>>,
    /// Scratch: sessions whose count of held resources went to or from zero.
    flipped: Vec<SessionId>,
    /// Scratch: (touched index, session) of every queue change.
    pairs: Vec<(usize, SessionId)>,
    /// Scratch: resources outside the touched ones whose `w -> r` edges changed.
    recheck: Vec<String>,
    /// Scratch: candidate waits of a session that started holding something.
    cand: Vec<String>,
    /// Scratch: graph edits of the pass (every removal is applied before any addition, so
    /// no cycle is reported through an edge about to go).
    removals: Vec<(u64, u64)>,
    additions: Vec<(u64, u64)>,
    /// Shared-kind resources by name, as the graph has them.
    shared: BTreeMap<String, SharedSynced>,
    /// The role each shared-kind lease has in the graph, with its resource.
    roles: BTreeMap<u64, (String, Role)>,
    /// The role each shared-kind lease has on a fence node (`fence_node_name`).
    fence_roles: BTreeMap<u64, (String, Role)>,
    /// The shared-kind resources each session waits for (for the sessions whose count of
    /// held resources flips: their `w -> r` edges come or go).
    shared_waits_of: IdMap<SessionId, Vec<String>>,
    /// Shared-kind leases noted in this step (ids, maybe repeated).
    pub shared_touched: Vec<u64>,
}

/// What the graph calls the reservation a waiting shared gang holds on `r` against later
/// writers (a node of its own, so that the writers behind the fence wait for the gang's
/// session while the gang itself, and the writers ahead of it, do not). The separator is
/// a control character, which no resource name has; reports show [`FENCE_SHOWN`].
fn fence_node_name(r: &str) -> String {
    format!("{r}{FENCE_SEP}")
}

/// Ends the graph's name of a fence node.
const FENCE_SEP: char = '\u{1}';

/// How a fence node is shown in `status` and in a `deadlock` notice (after its resource).
pub(super) const FENCE_SHOWN: &str = " (reserved for a waiting shared gang)";

/// Counts one held resource more (`up`) or less for `s`; true when the count went from or
/// to zero.
fn bump(held: &mut IdMap<SessionId, u32>, s: SessionId, up: bool) -> bool {
    if up {
        let n = held.entry(s).or_insert(0);
        *n += 1;
        *n == 1
    } else {
        match held.get_mut(&s) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                held.remove(&s);
                true
            }
            None => false,
        }
    }
}

/// Counts one lease of `s` less in `m`; true when `s` had its last one there (and is gone).
fn count_down(m: &mut BTreeMap<SessionId, u32>, s: SessionId) -> bool {
    match m.get_mut(&s) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        Some(_) => {
            m.remove(&s);
            true
        }
        None => false,
    }
}

impl Core {
    /// End of step: bring the wait-for graph up to date with the touched resources; report
    /// (and, if configured, break) every cycle that appeared.
    pub(super) fn deadlock_pass(&mut self, now: Now) {
        if self.table.touched.is_empty() && self.graph.shared_touched.is_empty() {
            return;
        }
        let mut touched = std::mem::take(&mut self.table.touched);
        let names = &mut touched.names[..touched.len];
        if names.len() > 1 {
            names.sort_unstable();
        }
        // Holders (and the count of what each session holds) and queue changes.
        let g = &mut self.graph;
        for (i, r) in names.iter().enumerate() {
            if i > 0 && names[i - 1] == *r {
                continue;
            }
            let Some(res) = self.table.resources.get_mut(r) else {
                continue;
            };
            let holder = match &res.lease {
                LeaseState::Held(l) => Some(l.session),
                _ => None,
            };
            for &(w, _) in &res.waiters.changes {
                g.pairs.push((i, w));
            }
            res.waiters.changes.clear();
            let sy = &mut res.graph;
            if sy.holder != holder {
                if let Some(p) = sy.holder {
                    if bump(&mut g.held, p, false) {
                        g.flipped.push(p);
                    }
                }
                if let Some(h) = holder {
                    if bump(&mut g.held, h, true) {
                        g.flipped.push(h);
                    }
                }
                sy.holder = holder;
            }
        }
        // Shared-kind resources: their holders count too (before the sessions whose count
        // flipped are looked at), and their edges are brought in line.
        if !self.graph.shared_touched.is_empty() {
            self.sync_shared();
        }
        // The `w -> r` edges: of every queue change, and of every session that started or
        // stopped holding something.
        let pairs = std::mem::take(&mut self.graph.pairs);
        for &(i, w) in &pairs {
            self.sync_wait(w, &names[i]);
        }
        let mut flipped = std::mem::take(&mut self.graph.flipped);
        let mut cand = std::mem::take(&mut self.graph.cand);
        for &w in &flipped {
            cand.clear();
            if self.graph.held.contains_key(&w) {
                if let Some(sess) = self.sessions.get(&w) {
                    cand.extend(sess.waits.iter().cloned());
                    for id in &sess.gangs {
                        if let Some(gang) = self.gangs.get(id).filter(|g| !g.granted) {
                            cand.extend(gang.members.iter().cloned());
                        }
                    }
                }
            } else if let Some(v) = self.graph.edges_of.get(&w) {
                cand.extend(v.iter().cloned());
            }
            for r in &cand {
                self.sync_wait(w, r);
            }
            cand.clear();
            if let Some(v) = self.graph.shared_waits_of.get(&w) {
                cand.extend(v.iter().cloned());
            }
            for r in &cand {
                self.sync_shared_wait(w, r);
            }
        }
        // The `r -> h` edges of every resource whose holder or `w -> r` edges changed.
        for (i, r) in names.iter().enumerate() {
            if i == 0 || names[i - 1] != *r {
                self.sync_hold(r);
            }
        }
        let mut recheck = std::mem::take(&mut self.graph.recheck);
        for r in &recheck {
            self.sync_hold(r);
        }
        // An edge both added and removed in this pass (a session that started waiting and
        // stopped holding in one step, say) is netted out first: the graph counts edges, and
        // applying every removal before every addition would otherwise leave it behind.
        if !self.graph.removals.is_empty() && !self.graph.additions.is_empty() {
            self.net_edits();
        }
        // Removals first, then additions (the cycles they close).
        let mut cycles = Vec::new();
        for &(a, b) in &self.graph.removals {
            self.waitfor.remove_edge(a, b);
        }
        for &(a, b) in &self.graph.additions {
            if let Some(c) = self.waitfor.add_edge(a, b) {
                cycles.push(c);
            }
        }
        self.graph.removals.clear();
        self.graph.additions.clear();
        // The buffers go back for the next step.
        let mut pairs = pairs;
        pairs.clear();
        self.graph.pairs = pairs;
        flipped.clear();
        self.graph.flipped = flipped;
        cand.clear();
        self.graph.cand = cand;
        recheck.clear();
        self.graph.recheck = recheck;
        touched.len = 0;
        self.table.touched = touched;
        for c in cycles {
            self.report_deadlock(now, &c);
        }
    }

    /// Brings the edge `w -> r` in line with the table: wanted while `w` waits for `r` and
    /// holds something.
    fn sync_wait(&mut self, w: SessionId, r: &str) {
        let holding = self.graph.held.contains_key(&w);
        let edges = self.graph.edges_of.get(&w);
        if !holding && edges.is_none() {
            // Holds nothing and has no edge: nothing to look at (the usual waiter).
            return;
        }
        let have = edges.is_some_and(|v| v.iter().any(|x| x == r));
        let Some(res) = self.table.resources.get_mut(r) else {
            return;
        };
        let queued = res.waiters.contains_session(w);
        let want = holding && queued;
        if want == have {
            return;
        }
        #[cfg(test)]
        if self.planted.stale_wait_edges && holding && !queued {
            // The planted bug: a waiter that left keeps its edge.
            return;
        }
        let g = &mut self.graph;
        let sy = &mut res.graph;
        if want {
            if sy.node == 0 {
                g.next_res_node += 1;
                sy.node = RESOURCE_BIT | g.next_res_node;
                g.res_of_node.insert(sy.node, r.to_string());
            }
            g.edges_of.entry(w).or_default().push(r.to_string());
            sy.live_in += 1;
            g.additions.push((w, sy.node));
        } else {
            if let Some(v) = g.edges_of.get_mut(&w) {
                v.retain(|x| x != r);
                if v.is_empty() {
                    g.edges_of.remove(&w);
                }
            }
            sy.live_in = sy.live_in.saturating_sub(1);
            g.removals.push((w, sy.node));
        }
        g.recheck.push(r.to_string());
    }

    /// Brings the graph in line with every shared-kind lease noted in this step (and the
    /// waiting shared gangs of their resources, whose wait depends on the resource's
    /// admission): each lease's role now against the one the graph has. Edits are queued
    /// with the pass's (removals before additions).
    fn sync_shared(&mut self) {
        let mut ids = std::mem::take(&mut self.graph.shared_touched);
        ids.sort_unstable();
        ids.dedup();
        let mut gangs = Vec::new();
        for id in &ids {
            let r = match self.kl.get(id) {
                Some(l) => Some(&l.resource),
                None => self.graph.roles.get(id).map(|(r, _)| r),
            };
            if let Some(q) = r.and_then(|r| self.shared_gang_waits.get(r)) {
                gangs.extend(q.iter().copied());
            }
        }
        if !gangs.is_empty() {
            ids.extend(gangs);
            ids.sort_unstable();
            ids.dedup();
        }
        for &id in &ids {
            let new = self.shared_role(id);
            if self.graph.roles.get(&id) != new.as_ref() {
                if let Some((r, role)) = self.graph.roles.remove(&id) {
                    self.shared_edit(&r, role, false);
                }
                if let Some((r, role)) = new {
                    self.shared_edit(&r, role, true);
                    self.graph.roles.insert(id, (r, role));
                }
            }
            // Its role on its resource's fence node (a waiting shared gang's reservation).
            let new = self.fence_role(id);
            if self.graph.fence_roles.get(&id) != new.as_ref() {
                if let Some((r, role)) = self.graph.fence_roles.remove(&id) {
                    self.shared_edit(&r, role, false);
                }
                if let Some((r, role)) = new {
                    self.shared_edit(&r, role, true);
                    self.graph.fence_roles.insert(id, (r, role));
                }
            }
        }
        ids.clear();
        self.graph.shared_touched = ids;
    }

    /// The role shared-kind lease `id` should have in the graph now.
    fn shared_role(&self, id: u64) -> Option<(String, Role)> {
        let l = self.kl.get(&id)?;
        let s = l.session.filter(|_| l.reclaim_deadline.is_none())?;
        let r = &l.resource;
        let role = if l.granted {
            (l.bound && self.shared.is_holder(id)).then_some(Role::Holds(s))
        } else if self.shared.is_queued(id) {
            Some(Role::Waits(s))
        } else {
            // A waiting shared gang's member: waits while its resource admits no reader.
            let gang_waits = self
                .shared_gang_waits
                .get(r)
                .is_some_and(|q| q.contains(&id));
            (gang_waits && !self.shared.admits_gang_reader(r, id)).then_some(Role::Waits(s))
        };
        role.map(|x| (r.clone(), x))
    }

    /// The role shared-kind lease `id` should have on the *fence* node of its resource
    /// (`fence_node_name`): the oldest waiting shared gang's member there holds it, and
    /// every exclusive request queued after that member waits for it (`shared_fence`).
    fn fence_role(&self, id: u64) -> Option<(String, Role)> {
        let l = self.kl.get(&id).filter(|l| !l.granted)?;
        let s = l.session.filter(|_| l.reclaim_deadline.is_none())?;
        let r = &l.resource;
        let fence = self
            .shared_gang_waits
            .get(r)
            .and_then(|q| q.first().copied())?;
        #[cfg(test)]
        if self.planted.shared_gang_unfenced {
            return None;
        }
        let role = if fence == id {
            Some(Role::Holds(s))
        } else {
            let writer = l.mode == Some(crate::proto::Mode::Exclusive);
            (writer && fence < id && self.shared.is_queued(id)).then_some(Role::Waits(s))
        };
        role.map(|x| (fence_node_name(r), x))
    }

    /// Adds (or removes) one lease's role on `r` to the graph's counts and edges.
    fn shared_edit(&mut self, r: &str, role: Role, add: bool) {
        #[cfg(test)]
        if self.planted.stale_wait_edges && !add && matches!(role, Role::Waits(_)) {
            // The planted bug: a waiter that left keeps its edge.
            return;
        }
        let g = &mut self.graph;
        let sy = g.shared.entry(r.to_string()).or_default();
        // A session that starts or stops waiting for `r`: its edge is decided below.
        let mut wait_changed = None;
        match (role, add) {
            (Role::Holds(h), true) => {
                let n = sy.holders.entry(h).or_insert(0);
                *n += 1;
                if *n == 1 {
                    if bump(&mut g.held, h, true) {
                        g.flipped.push(h);
                    }
                    if !sy.live.is_empty() {
                        g.additions.push((sy.node, h));
                    }
                }
            }
            (Role::Holds(h), false) => {
                if count_down(&mut sy.holders, h) {
                    if bump(&mut g.held, h, false) {
                        g.flipped.push(h);
                    }
                    if !sy.live.is_empty() {
                        g.removals.push((sy.node, h));
                    }
                }
            }
            (Role::Waits(w), true) => {
                let n = sy.waits.entry(w).or_insert(0);
                *n += 1;
                if *n == 1 {
                    g.shared_waits_of.entry(w).or_default().push(r.to_string());
                    wait_changed = Some(w);
                }
            }
            (Role::Waits(w), false) => {
                if count_down(&mut sy.waits, w) {
                    if let Some(v) = g.shared_waits_of.get_mut(&w) {
                        v.retain(|x| x != r);
                        if v.is_empty() {
                            g.shared_waits_of.remove(&w);
                        }
                    }
                    wait_changed = Some(w);
                }
            }
        }
        if let Some(w) = wait_changed {
            self.sync_shared_wait(w, r);
        }
        let g = &mut self.graph;
        if let Some(sy) = g.shared.get(r) {
            if sy.waits.is_empty() && sy.holders.is_empty() {
                g.shared.remove(r);
            }
        }
    }

    /// Cancels every removal against an addition of the same edge in this pass (edges are
    /// counted: what is left is the pass's net change, in the order the lists had).
    fn net_edits(&mut self) {
        let g = &mut self.graph;
        let mut net: BTreeMap<(u64, u64), i64> = BTreeMap::new();
        for e in &g.removals {
            *net.entry(*e).or_default() -= 1;
        }
        for e in &g.additions {
            *net.entry(*e).or_default() += 1;
        }
        g.removals.retain(|e| match net.get_mut(e) {
            Some(n) if *n < 0 => {
                *n += 1;
                true
            }
            _ => false,
        });
        g.additions.retain(|e| match net.get_mut(e) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        });
    }

    /// Brings the edge `w -> r` of shared-kind resource `r` in line: wanted while `w` waits
    /// for `r` and holds something (after `w` started or stopped waiting for `r`, or its
    /// count of held resources flipped in this pass). The resource's node lives while some
    /// waiter has an edge, and its `r -> h` edges with it.
    fn sync_shared_wait(&mut self, w: SessionId, r: &str) {
        let g = &mut self.graph;
        let holding = g.held.contains_key(&w);
        let Some(sy) = g.shared.get_mut(r) else {
            return;
        };
        let want = holding && sy.waits.contains_key(&w);
        if want == sy.live.contains(&w) {
            return;
        }
        if want {
            if sy.node == 0 {
                g.next_res_node += 1;
                sy.node = RESOURCE_BIT | g.next_res_node;
                g.res_of_node.insert(sy.node, r.to_string());
            }
            g.additions.push((w, sy.node));
            sy.live.insert(w);
            if sy.live.len() == 1 {
                g.additions.extend(sy.holders.keys().map(|h| (sy.node, *h)));
            }
        } else {
            g.removals.push((w, sy.node));
            sy.live.remove(&w);
            if sy.live.is_empty() {
                g.removals.extend(sy.holders.keys().map(|h| (sy.node, *h)));
                g.res_of_node.remove(&sy.node);
                sy.node = 0;
            }
        }
    }

    /// The youngest connection-bound holder lease of shared-kind resource `r` (the highest
    /// lease id), for a deadlock report.
    fn shared_youngest(&self, r: &str) -> Option<u64> {
        self.shared
            .holders(r)
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| self.kl.get(id).is_some_and(|l| l.bound))
            .max()
    }

    /// Brings the edge `r -> h` in line with the table: wanted while `r` has a holder and a
    /// kept `w -> r` edge. Forgets `r`'s node once it has no edge.
    fn sync_hold(&mut self, r: &str) {
        let Some(res) = self.table.resources.get_mut(r) else {
            return;
        };
        let g = &mut self.graph;
        let sy = &mut res.graph;
        let want = if sy.live_in > 0 { sy.holder } else { None };
        if sy.edge_to != want {
            if let Some(h) = sy.edge_to {
                g.removals.push((sy.node, h));
            }
            if let Some(h) = want {
                if sy.node == 0 {
                    g.next_res_node += 1;
                    sy.node = RESOURCE_BIT | g.next_res_node;
                    g.res_of_node.insert(sy.node, r.to_string());
                }
                g.additions.push((sy.node, h));
            }
            sy.edge_to = want;
        }
        if sy.node != 0 && sy.live_in == 0 && sy.edge_to.is_none() {
            g.res_of_node.remove(&sy.node);
            sy.node = 0;
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
            } else if let Some(r) = self.graph.res_of_node.get(&n) {
                resources.push(match r.strip_suffix(FENCE_SEP) {
                    Some(base) => format!("{base}{FENCE_SHOWN}"),
                    None => r.clone(),
                });
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
                _ => self.shared_youngest(r).map(|id| (r.clone(), id)),
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
            if let Some((r, id)) = res.iter().max_by_key(|x| x.1).cloned() {
                if let Some(l) = self.kl.get(&id).filter(|l| l.resource == r) {
                    // A connection-bound shared-kind lease: marked revoked, its holder told.
                    if l.revoked.is_none() {
                        self.shared_revoke(now, id, "lockd".into(), "deadlock".into());
                        self.counters.deadlock_breaks += 1;
                    }
                    return;
                }
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
    fn waiters_that_hold_nothing_cost_the_graph_nothing() {
        let mut h = H::new();
        for s in 1..=64 {
            h.connect(s, "unix");
            h.req(s, acq("r", &format!("c{s}"), true));
        }
        // The version-1 hand-over: the holder releases and queues again.
        for round in 0..200u64 {
            let s = round % 64 + 1;
            h.req(s, Request::release("r"));
            h.req(s, acq("r", &format!("c{s}"), true));
            assert_eq!(h.core.waitfor.node_count(), 0, "round {round}");
        }
        assert!(h.core.graph.res_of_node.is_empty());
        assert!(h.core.graph.edges_of.is_empty());
    }

    #[test]
    fn shared_waiters_that_hold_nothing_cost_the_graph_nothing() {
        // The mass hand-over of shared readers: nine readers per resource, a writer waiting
        // for each; nobody waits while holding something, so no edge at any point.
        let mut h = H::new();
        let mut s = 0;
        for r in 0..4 {
            for _ in 0..9 {
                s += 1;
                h.connect(s, "unix");
                h.req(
                    s,
                    acq_shared(&format!("s{r}"), &format!("r{s}"), true, None),
                );
            }
        }
        for r in 0..4 {
            s += 1;
            h.connect(s, "unix");
            h.req(
                s,
                acq_shared(&format!("s{r}"), &format!("w{s}"), false, None),
            );
        }
        assert_eq!(h.core.waitfor.edge_count(), 0);
        for reader in 1..=36 {
            h.step(Input::Disconnect { session: reader });
            assert_eq!(h.core.waitfor.edge_count(), 0, "after reader {reader}");
        }
        // A writer that holds something and waits does get its edges: w37 (granted s0)
        // now waits for s1, held by w38.
        h.req(37, acq_shared("s1", "w37", false, None));
        assert_eq!(h.core.waitfor.edge_count(), 2, "37 -> s1 -> 38");
        assert!(h.core.graph.shared_waits_of.contains_key(&37));
    }

    #[test]
    fn a_waiter_that_starts_holding_gets_its_edges() {
        // 1 waits for r2 while holding nothing (no edge); when it is granted r3, for which
        // 2 waits, its wait for r2 (held by 2) closes the cycle 1 -> r2 -> 2 -> r3 -> 1.
        let mut h = H::new();
        h.connect(1000, "unix");
        h.req(1000, Request::Watch);
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(3, acq("r3", "three", true));
        h.req(2, acq("r2", "two", true));
        h.req(1, acq("r3", "one", true));
        h.req(1, acq("r2", "one", true));
        let out = h.req(2, acq("r3", "two", true));
        assert!(deadlock_notices(&out).is_empty());
        let out = h.req(3, Request::release("r3"));
        assert!(H::granted(&out, 1).is_some());
        assert_eq!(deadlock_notices(&out).len(), 1, "{out:?}");
        assert!(h.core.waitfor.is_deadlocked(1) && h.core.waitfor.is_deadlocked(2));
        // 1 lets r3 go: 2 gets it, 1 holds nothing, and its edges are gone.
        let out = h.req(1, Request::release("r3"));
        assert!(H::granted(&out, 2).is_some());
        assert!(h.st().deadlocks.is_empty());
        assert!(!h.core.graph.edges_of.contains_key(&1));
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

    /// Session 1 holds `x`, 3 holds `y` (version 1), 2 reads `s` (shared kind, bound); then
    /// 1 waits to write `s` (for the reader 2), 2 waits for `y` (3) and, if `close`, 3 waits
    /// for `x` (1): a 3-cycle through a shared and two exclusive leases.
    fn mixed_ring(h: &mut H, close: bool) -> Vec<Output> {
        h.connect(1000, "unix");
        h.req(1000, Request::Watch);
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("x", "h1", true));
        h.req(3, acq("y", "h3", true));
        assert!(H::g(&h.req(2, acq_shared("s", "h2", true, None)), 2).is_some());
        let out = h.req(1, acq_shared("s", "h1", false, None));
        assert!(matches!(&H::to(&out, 1)[..], [Event::Queued { .. }]));
        let out = h.req(2, acq("y", "h2", true));
        if !close {
            return out;
        }
        h.req(3, acq("x", "h3", true))
    }

    #[test]
    fn a_three_cycle_through_shared_and_exclusive_leases_is_found_and_broken() {
        let mut h = H::with_cfg(PersistedState::default(), None, 0, |c| {
            c.break_deadlocks = true
        });
        let out = mixed_ring(&mut h, true);
        let n = deadlock_notices(&out);
        assert_eq!(n.len(), 1, "{out:?}");
        assert!(["x", "y", "s"].iter().all(|r| n[0].contains(r)), "{}", n[0]);
        // The youngest lease the cycle waits for is the reader's (lease 3): revoked, its
        // holder told; the cycle lasts until it lets go.
        assert!(
            H::to(&out, 2)
                .iter()
                .any(|e| matches!(e, Event::Revoked { resource, reason, .. }
                if resource == "s" && reason == "deadlock")),
            "{out:?}"
        );
        let st = h.st();
        let mut sessions = st.deadlocks[0].sessions.clone();
        sessions.sort_unstable();
        assert_eq!(sessions, vec![1, 2, 3]);
        assert_eq!((st.counters.deadlocks, st.counters.deadlock_breaks), (1, 1));
        let out = h.req(2, Request::release("s"));
        assert!(H::g(&out, 1).is_some(), "the writer gets s");
        assert!(h.st().deadlocks.is_empty());
    }

    #[test]
    fn readers_and_writers_in_a_chain_are_no_cycle_and_a_stale_shared_edge_would_be() {
        // The same waits without the closing one: a chain, no deadlock.
        let mut h = H::new();
        mixed_ring(&mut h, false);
        assert!(h.st().deadlocks.is_empty());
        // The writer gives up on `s`; then 3 waits for `x`: still no cycle (1 waits for
        // nothing). With the planted bug (the writer's edge to `s` kept), the graph
        // reports the cycle that no longer exists.
        for planted in [false, true] {
            let mut h = H::new();
            h.core.planted.stale_wait_edges = planted;
            mixed_ring(&mut h, false);
            let out = h.req(1, Request::release("s"));
            assert!(
                matches!(&H::to(&out, 1)[..], [Event::Cancelled { .. }]),
                "{out:?}"
            );
            h.req(3, acq("x", "h3", true));
            assert_eq!(!h.st().deadlocks.is_empty(), planted);
        }
    }

    #[test]
    fn a_reader_that_queues_to_write_what_it_reads_waits_for_itself() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, acq_shared("s", "h1", true, None));
        h.req(1, acq_shared("s", "h1", false, None));
        assert_eq!(h.st().deadlocks.len(), 1);
        // A timed reader is no holder of the graph: a writer waiting for it is no cycle.
        let mut h = H::new();
        h.connect(1, "unix");
        let mut timed = acq_shared("s", "h1", true, None);
        if let Request::Acquire { ext, .. } = &mut timed {
            ext.ttl_ms = Some(1000);
        }
        h.req(1, timed);
        h.req(1, acq_shared("s", "h1", false, None));
        assert!(h.st().deadlocks.is_empty());
    }

    #[test]
    fn a_waiting_shared_gang_waits_for_the_writer_of_a_member() {
        let mut h = H::new();
        for s in 1..=2 {
            h.connect(s, "unix");
        }
        h.req(1, acq("x", "h1", true));
        assert!(H::g(&h.req(2, acq_shared("s", "h2", false, None)), 2).is_some());
        let gang = Request::Acquire {
            resource: "rd".into(),
            holder: "h1".into(),
            wait: true,
            ext: proto::AcquireExt {
                gang: Some(vec!["s".into(), "s1".into()]),
                mode: Some(proto::Mode::Shared),
                ..Default::default()
            },
        };
        let out = h.req(1, gang);
        assert!(matches!(&H::to(&out, 1)[..], [Event::Queued { .. }]));
        assert!(h.st().deadlocks.is_empty());
        // The writer of `s` now waits for `x`, held by the gang's session: a 2-cycle.
        h.req(2, acq("x", "h2", true));
        let st = h.st();
        assert_eq!(st.deadlocks.len(), 1, "{:?}", st.deadlocks);
        assert!(st.deadlocks[0].resources.contains(&"s".to_string()));
        // The gang gives up (its connection's release of a member): no cycle.
        h.req(1, Request::release("s1"));
        assert!(h.st().deadlocks.is_empty());
    }
}
