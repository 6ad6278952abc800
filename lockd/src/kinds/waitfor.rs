//! The wait-for graph of lockd sessions, with exact and incremental deadlock detection
//! (issue 12 point 3; seed `000_8e68c6fca64f2b10`, whose `find_deadlocks` saw only 2-cycles,
//! pairwise in O(n²)).
//!
//! # Model
//!
//! Nodes are session ids. An edge `w → h` means session `w` waits for a resource that
//! session `h` holds. The same pair can be linked through several resources: each
//! [`WaitForGraph::add_edge`] counts one more, each [`WaitForGraph::remove_edge`] one less, and
//! the edge exists while its count is above zero. A session is a node while it has at least
//! one edge (a node left without edges is forgotten at once, so nothing leaks when the core
//! forgets to call [`WaitForGraph::remove_node`]); `remove_node` drops a session with every
//! edge in or out of it, whatever their counts.
//!
//! **Self-loops are impossible by construction**: `add_edge(w, w)` is ignored (returns `None`,
//! counts nothing) and `remove_edge(w, w)` is a no-op. A session never waits for itself in
//! lockd (a re-acquire of what it holds is the core's business, not a wait), and a one-node
//! "cycle" would make every holder look deadlocked.
//!
//! A **deadlock** is a strongly connected component (SCC) with more than one node: every
//! member waits, directly or transitively, for every other. Exactness: a session is reported
//! deadlocked if and only if it lies on a cycle of the graph, of any length (2, 3, 50, 10,000);
//! a chain, however long, is no cycle, and a session that waits *into* a cycle without being
//! on one is not deadlocked.
//!
//! Pure: no I/O, no clock, no randomness. No call panics: unknown sessions and missing edges
//! are no-ops.
//!
//! # Algorithm and cost
//!
//! The graph keeps its **condensation** (one component per SCC) in a topological order: an
//! integer key per component, every edge between two components going from a smaller key to
//! a larger one. Insertions maintain it with **Pearce–Kelly**'s dynamic topological sort
//! (D. J. Pearce, P. H. J. Kelly, "A dynamic topological sort algorithm for directed acyclic
//! graphs", ACM Journal of Experimental Algorithmics 11, 2006, article 1.7): only the
//! *affected region* between the new edge's ends is searched. Two refinements: the region is
//! searched **two ways at once**, forward and backward, one component per step each, and
//! only the side exhausted first is moved (the two-way search of Haeupler, Kavitha, Mathew,
//! Sen and Tarjan, "Incremental cycle detection, topological ordering, and strong component
//! maintenance", ACM Transactions on Algorithms 8(1), 2012); and a new edge that closes a
//! cycle **merges** the components on it into one (strong component maintenance, ibid.,
//! and Pearce's thesis), so the structure stays correct while cycles exist: a deadlock that
//! nobody breaks is simply one component.
//!
//! * **`add_edge(w, h)`**, components `W ∋ w`, `H ∋ h`. If the edge already existed (its
//!   count was above zero), or `key(W) < key(H)`, nothing moves: O(1) expected. Otherwise
//!   the affected region is the components with keys in `[key(H), key(W)]`: `F`, those `H`
//!   reaches inside it, and `B`, those that reach `W` inside it. A forward search from `H`
//!   (keys ≤ key(W)) and a backward search from `W` (keys ≥ key(H)) alternate until one
//!   is exhausted.
//!   * `F` complete first: the edge closed a cycle iff `W ∈ F`; the new SCC `S` is then the
//!     part of `F` that reaches `W` (a backward search restricted to `F`), merged into one
//!     component at `W`'s key, and `F \ S` moves, in its old relative order, to fresh keys
//!     right after it. Without a cycle, all of `F` moves right after `W`.
//!   * `B` complete first: symmetrically, a cycle iff `H ∈ B`, `S` = the part of `B` that
//!     `H` reaches, merged at `H`'s key, and `B \ S` (or all of `B`) moves right before it.
//!
//!   Why this is a topological order again: a successor of a node moved after `W` is either
//!   in `F` (moved too, order kept) or outside the window (key above `W`'s, hence above the
//!   fresh keys, which lie between `W` and its old successor key); its predecessors are in
//!   `F`, are `W`/`S`, or had smaller keys already. A successor of a member of `S` outside
//!   `S` is in `F \ S` (moved after) or beyond the window; a predecessor outside `S` that is
//!   in the window reaches `W`, so it is in `B` and not in `F` (else it would be in `S`),
//!   and stays below. The backward case is the mirror image. The random-history property
//!   test checks the order after every step.
//!
//!   **Cost**: O(min(‖F‖, ‖B‖)) for the search, where ‖X‖ counts the sessions of `X` and
//!   their edges (the two searches advance in step, one component each, so the larger side
//!   visits at most one component more than the smaller), plus the restricted search of `S` inside the
//!   exhausted side, plus O(log n) amortized per moved component for its fresh key (below).
//!   It never looks outside the affected region, and usually at a small part of it: linear in
//!   the part of the graph the insertion reorders, not in the graph. When a cycle is closed,
//!   the cycle returned is a shortest path `h →* w` inside the new component (BFS): O(size of
//!   the new deadlock). [`WaitForGraph::last_work`] reports the sessions an insertion
//!   visited.
//! * **`remove_edge(w, h)`**: a count above one is decremented, O(1). An edge between two
//!   components leaves the order valid, O(1). An edge inside a deadlock may split it:
//!   Tarjan's SCC algorithm (R. E. Tarjan, "Depth-first search and linear graph algorithms",
//!   SIAM J. Comput. 1(2), 1972), iterative, runs on that component alone, O(its members and
//!   their edges); the pieces come out in reverse topological order and are put in the
//!   component's place in the order, the first at its key and the others right after it.
//! * **`remove_node(n)`**: O(degree of `n`), plus the same Tarjan pass over `n`'s component
//!   when `n` was deadlocked.
//! * **Keys** are integers below 2^62 kept in an ordered map. A new session takes a key before
//!   every other when it enters as a waiter (nobody waits for it yet) and after every other
//!   when it enters as a holder, with a wide gap, so an edge with a new end never reorders
//!   anything; the components an insertion moves and the pieces of a split need fresh keys
//!   between two neighbours, given by the
//!   order-maintenance scheme of Bender, Cole, Demaine, Farach-Colton and Zito ("Two
//!   simplified algorithms for maintaining order in a list", ESA 2002): take the midpoint of
//!   the gap, and when there is none, relabel evenly the smallest aligned block of keys
//!   around it whose density is below `1.4^-i` (block size `2^i`): O(log n) amortized.
//! * **Queries**: [`WaitForGraph::is_deadlocked`], the counts: O(1);
//!   [`WaitForGraph::deadlocks`]: O(size of the deadlocked part), the rest of the graph is
//!   never read.
//!
//! The benchmark `lockd/benches/waitfor_bench.rs` measures it at 10,000 sessions, side by
//! side with Tarjan's algorithm run from scratch on the whole graph.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// A session id, as the core numbers its sessions.
pub type SessionId = u64;

/// Slot of a node (a session with edges).
type Ix = u32;
/// Slot of a component (one SCC of the graph).
type Cx = u32;

/// Keys of the topological order stay below this, so that aligned blocks of up to `2^62`
/// keys never overflow.
const KEY_LIMIT: u64 = 1 << 62;
/// Gap left after the last key when a new session is appended.
const APPEND_STEP: u64 = 1 << 24;
/// `2 / T` for Bender et al.'s density threshold `T = 1.4`: a block of `2^i` keys may hold
/// `(2 / T)^i` of them before the enclosing block is relabelled instead.
const DENSITY_BASE: f64 = 2.0 / 1.4;

/// A fast hasher for the graph's integer keys (slots and session ids, both chosen by lockd,
/// never by a client): one multiply and a fold, instead of SipHash.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        let x = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

/// One session with edges.
#[derive(Debug, Clone, Default)]
struct Node {
    /// The session id.
    id: SessionId,
    /// Its component.
    comp: Cx,
    /// Sessions it waits for, with the number of resources that link them (always > 0).
    out: IdMap<Ix, u64>,
    /// Sessions that wait for it (the mirror of `out`, without counts).
    inn: IdSet<Ix>,
    /// False for a free slot.
    live: bool,
}

/// One strongly connected component.
#[derive(Debug, Clone, Default)]
struct Comp {
    /// Its position in the topological order of the condensation.
    key: u64,
    /// Its sessions (node slots).
    members: Vec<Ix>,
    /// Visit stamps of the forward and backward searches.
    fmark: u64,
    bmark: u64,
    /// False for a free slot.
    live: bool,
}

/// A depth-first search over components, stepped one component at a time.
#[derive(Debug)]
struct Search {
    stack: Vec<Cx>,
    seen: Vec<Cx>,
    /// Forward: only components with key ≤ bound; backward: key ≥ bound.
    bound: u64,
    stamp: u64,
    forward: bool,
    /// Only components whose other-side mark is this.
    within: Option<u64>,
}

impl Search {
    fn new(start: Cx, bound: u64, stamp: u64, forward: bool, within: Option<u64>) -> Self {
        Search {
            stack: vec![start],
            seen: Vec::new(),
            bound,
            stamp,
            forward,
            within,
        }
    }
}

/// A bug planted on purpose (test builds only), to show that the property test catches it.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlantedBug {
    /// Only 2-cycles are reported (the seed's pairwise detection).
    TwoCyclesOnly,
    /// `remove_edge` drops the edge at the first removal, whatever its count.
    ForgottenMultiplicity,
}

/// The wait-for graph of lockd's sessions, with its deadlocks kept up to date on every
/// change (see the module documentation for the algorithm and its cost).
#[derive(Debug, Clone, Default)]
pub struct WaitForGraph {
    /// Session id → node slot.
    index: IdMap<SessionId, Ix>,
    nodes: Vec<Node>,
    free_nodes: Vec<Ix>,
    comps: Vec<Comp>,
    free_comps: Vec<Cx>,
    /// The topological order of the condensation: key → component.
    order: BTreeMap<u64, Cx>,
    /// Components with more than one member: the deadlocks.
    cyclic: BTreeSet<Cx>,
    /// Distinct edges (pairs with a count > 0).
    edges: usize,
    /// Sum of the edges' counts.
    waits: u64,
    /// Last visit stamp handed out.
    stamp: u64,
    /// Sessions the last `add_edge` visited in its searches (see [`WaitForGraph::last_work`]).
    last_work: usize,
    #[cfg(test)]
    bug: Option<PlantedBug>,
}

impl WaitForGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Plants a bug (test builds only).
    #[cfg(test)]
    pub(crate) fn plant_bug(&mut self, bug: PlantedBug) {
        self.bug = Some(bug);
    }

    #[cfg(test)]
    fn planted(&self, bug: PlantedBug) -> bool {
        self.bug == Some(bug)
    }

    /// Whether `remove_edge` forgets the multiplicity (the planted bug; never outside tests).
    fn forgets_multiplicity(&self) -> bool {
        #[cfg(test)]
        return self.planted(PlantedBug::ForgottenMultiplicity);
        #[cfg(not(test))]
        false
    }

    /// Number of sessions in the graph (those with at least one edge).
    pub fn node_count(&self) -> usize {
        self.index.len()
    }

    /// Number of distinct edges `w → h` (pairs linked through at least one resource).
    pub fn edge_count(&self) -> usize {
        self.edges
    }

    /// Number of waits: the sum of the edges' counts (one per resource linking a pair).
    pub fn wait_count(&self) -> u64 {
        self.waits
    }

    /// Number of current deadlocks (strongly connected components with more than one
    /// session). O(number of deadlocks).
    pub fn deadlock_count(&self) -> usize {
        self.cyclic.iter().filter(|&&c| self.reported(c)).count()
    }

    /// Number of sessions in some deadlock. O(number of deadlocks).
    pub fn deadlocked_session_count(&self) -> usize {
        self.cyclic
            .iter()
            .filter(|&&c| self.reported(c))
            .map(|&c| self.comps[c as usize].members.len())
            .sum()
    }

    /// How many sessions the last [`WaitForGraph::add_edge`] visited in its forward and
    /// backward searches (the size of its affected region, counted once per search; 0 when
    /// the order needed no change). A diagnostic for benchmarks: the work of an insertion
    /// is proportional to this and to these sessions' edges, whatever the size of the graph.
    pub fn last_work(&self) -> usize {
        self.last_work
    }

    /// Whether session `n` is in the graph (has at least one edge).
    pub fn contains(&self, n: SessionId) -> bool {
        self.index.contains_key(&n)
    }

    /// Whether session `n` lies on a cycle of waits (false for an unknown session). O(1).
    pub fn is_deadlocked(&self, n: SessionId) -> bool {
        match self.index.get(&n) {
            Some(&i) => {
                let c = self.nodes[i as usize].comp;
                self.cyclic.contains(&c) && self.reported(c)
            }
            None => false,
        }
    }

    /// Whether deadlock `c` is reported (always, unless the 2-cycles-only bug is planted).
    fn reported(&self, c: Cx) -> bool {
        #[cfg(test)]
        if self.planted(PlantedBug::TwoCyclesOnly) {
            return self.comps[c as usize].members.len() == 2;
        }
        let _ = c;
        true
    }

    /// Records one more wait of `w` for `h` (one more resource that `w` waits for and `h`
    /// holds). Returns the cycle this edge closed, if any: `Some` exactly when the edge is
    /// new (its count went from 0 to 1) and lies on a cycle, i.e. when `h` now reaches `w`.
    /// The cycle is simple and in wait order, starting `[w, h, …]`: each session waits for
    /// the next, the last waits for `w`. It is a shortest such cycle through the new edge.
    /// The edge may also close a cycle inside an existing deadlock (a second cycle through
    /// sessions already deadlocked): that one is returned too.
    ///
    /// `w == h` is ignored (`None`): self-loops are impossible by construction.
    pub fn add_edge(&mut self, w: SessionId, h: SessionId) -> Option<Vec<SessionId>> {
        self.last_work = 0;
        if w == h {
            return None;
        }
        // A new waiter goes first in the order, a new holder last: an edge with a new end
        // never reorders anything.
        let wi = self.node_or_insert(w, true);
        let hi = self.node_or_insert(h, false);
        self.waits = self.waits.saturating_add(1);
        let count = self.nodes[wi as usize].out.entry(hi).or_insert(0);
        *count = count.saturating_add(1);
        if *count > 1 {
            return None;
        }
        self.nodes[hi as usize].inn.insert(wi);
        self.edges += 1;

        let cw = self.nodes[wi as usize].comp;
        let ch = self.nodes[hi as usize].comp;
        if cw == ch {
            // A chord inside an existing deadlock: the components do not change.
            return self.reported(cw).then(|| self.cycle_through_edge(wi, hi));
        }
        let (upper, lower) = (self.comps[cw as usize].key, self.comps[ch as usize].key);
        if upper < lower {
            return None;
        }

        // The affected region is [key(H), key(W)]: search it two ways at once, forward
        // from H and backward from W, until one side is exhausted.
        self.stamp += 1;
        let stamp = self.stamp;
        let mut fwd = Search::new(ch, upper, stamp, true, None);
        let mut bwd = Search::new(cw, lower, stamp, false, None);
        self.mark(ch, stamp, true);
        self.mark(cw, stamp, false);
        let mut buf = Vec::new();
        let forward_done = loop {
            if !self.step(&mut fwd, &mut buf) {
                break true;
            }
            if !self.step(&mut bwd, &mut buf) {
                break false;
            }
        };
        let mut work: usize = fwd
            .seen
            .iter()
            .chain(bwd.seen.iter())
            .map(|&c| self.comps[c as usize].members.len())
            .sum();

        let merged = if forward_done {
            // F is complete. A cycle iff W ∈ F; then S = the part of F that reaches W.
            let mut f = fwd.seen;
            let closed = self.comps[cw as usize].fmark == stamp;
            let s_parts = if closed {
                self.stamp += 1;
                let within = self.run(Search::new(cw, lower, self.stamp, false, Some(stamp)));
                work += within.len();
                let s2 = self.stamp;
                f.retain(|&c| self.comps[c as usize].bmark != s2);
                within
            } else {
                Vec::new()
            };
            // S (merged) keeps W's key; F \ S moves right after it, in its old order.
            self.sort_by_key(&mut f);
            for &c in f.iter().chain(s_parts.iter()) {
                let k = self.comps[c as usize].key;
                self.order.remove(&k);
            }
            let merged = (!s_parts.is_empty()).then(|| {
                let m = self.merge(&s_parts);
                self.set_key_unmapped(m, upper);
                m
            });
            let mut prev = upper;
            for c in f {
                self.insert_after(prev, c);
                prev = self.comps[c as usize].key;
            }
            merged
        } else {
            // B is complete. A cycle iff H ∈ B; then S = the part of B that H reaches.
            let mut b = bwd.seen;
            let closed = self.comps[ch as usize].bmark == stamp;
            let s_parts = if closed {
                self.stamp += 1;
                let within = self.run(Search::new(ch, upper, self.stamp, true, Some(stamp)));
                work += within.len();
                let s2 = self.stamp;
                b.retain(|&c| self.comps[c as usize].fmark != s2);
                within
            } else {
                Vec::new()
            };
            // S (merged) keeps H's key; B \ S moves right before it, in its old order.
            self.sort_by_key(&mut b);
            for &c in b.iter().chain(s_parts.iter()) {
                let k = self.comps[c as usize].key;
                self.order.remove(&k);
            }
            let merged = (!s_parts.is_empty()).then(|| {
                let m = self.merge(&s_parts);
                self.set_key_unmapped(m, lower);
                m
            });
            // S (or H, unmoved when no cycle) has key `lower`.
            let mut next = lower;
            for c in b.into_iter().rev() {
                self.insert_before(next, c);
                next = self.comps[c as usize].key;
            }
            merged
        };
        self.last_work = work;
        let s = merged?;
        self.note_size(s);
        if !self.reported(s) {
            return None;
        }
        Some(self.cycle_through_edge(wi, hi))
    }

    /// Records one wait of `w` for `h` less. Returns true when the edge is gone (its count
    /// reached 0; a deadlock through it may be broken), false otherwise (the pair is still
    /// linked through another resource, or there was no such edge: a no-op).
    pub fn remove_edge(&mut self, w: SessionId, h: SessionId) -> bool {
        let (Some(&wi), Some(&hi)) = (self.index.get(&w), self.index.get(&h)) else {
            return false;
        };
        let forget = self.forgets_multiplicity();
        let Some(count) = self.nodes[wi as usize].out.get_mut(&hi) else {
            return false;
        };
        if *count > 1 && !forget {
            *count -= 1;
            self.waits = self.waits.saturating_sub(1);
            return false;
        }
        let count = *count;
        self.waits = self.waits.saturating_sub(count);
        self.nodes[wi as usize].out.remove(&hi);
        self.nodes[hi as usize].inn.remove(&wi);
        self.edges = self.edges.saturating_sub(1);
        let c = self.nodes[wi as usize].comp;
        if c == self.nodes[hi as usize].comp {
            self.resplit(c);
        }
        self.drop_if_isolated(wi);
        self.drop_if_isolated(hi);
        true
    }

    /// Drops session `n` (it ended) with every edge in or out of it. Returns false for an
    /// unknown session (a no-op).
    pub fn remove_node(&mut self, n: SessionId) -> bool {
        let Some(&ni) = self.index.get(&n) else {
            return false;
        };
        let out = std::mem::take(&mut self.nodes[ni as usize].out);
        let inn = std::mem::take(&mut self.nodes[ni as usize].inn);
        let mut neighbours = Vec::with_capacity(out.len() + inn.len());
        for (s, count) in out {
            self.nodes[s as usize].inn.remove(&ni);
            self.edges = self.edges.saturating_sub(1);
            self.waits = self.waits.saturating_sub(count);
            neighbours.push(s);
        }
        for p in inn {
            if let Some(count) = self.nodes[p as usize].out.remove(&ni) {
                self.edges = self.edges.saturating_sub(1);
                self.waits = self.waits.saturating_sub(count);
            }
            neighbours.push(p);
        }
        let c = self.nodes[ni as usize].comp;
        self.comps[c as usize].members.retain(|&m| m != ni);
        if self.comps[c as usize].members.is_empty() {
            self.free_comp(c);
        } else {
            self.resplit(c);
        }
        self.free_node(ni);
        for m in neighbours {
            self.drop_if_isolated(m);
        }
        true
    }

    /// Every current deadlock (SCC with more than one session), each listed once per member
    /// in a cycle order: it starts at its smallest session id with a shortest cycle through
    /// it, in wait order (each waits for the next, the last of the cycle waits for the
    /// first). When the deadlock is a simple cycle (the usual case: every member waits for
    /// exactly one other member), the whole list is that cycle. Otherwise the remaining members follow, each waited for by some session listed
    /// before it. Sorted by first session. Cost: the size of the deadlocked part.
    pub fn deadlocks(&self) -> Vec<Vec<SessionId>> {
        let mut all: Vec<Vec<SessionId>> = self
            .cyclic
            .iter()
            .filter(|&&c| self.reported(c))
            .map(|&c| self.listing(c))
            .collect();
        all.sort_unstable();
        all
    }

    /// The deadlock of session `n` listed as in [`WaitForGraph::deadlocks`], or `None` when
    /// `n` is not deadlocked.
    pub fn deadlock_of(&self, n: SessionId) -> Option<Vec<SessionId>> {
        if !self.is_deadlocked(n) {
            return None;
        }
        let i = *self.index.get(&n)?;
        Some(self.listing(self.nodes[i as usize].comp))
    }

    /// A shortest cycle of waits through session `n`, in wait order starting with `n`, or
    /// `None` when `n` is not deadlocked.
    pub fn cycle_through(&self, n: SessionId) -> Option<Vec<SessionId>> {
        if !self.is_deadlocked(n) {
            return None;
        }
        let i = *self.index.get(&n)?;
        Some(self.ids(&self.shortest_cycle(i)))
    }

    /// The session of `cycle` to sacrifice to break it: the youngest, i.e. the one with the
    /// smallest `age` (any measure the caller likes where larger means older, e.g. the time
    /// since its lease was granted, or `u64::MAX - lease_id`); ties go to the largest
    /// session id (the later session). `None` for an empty slice.
    pub fn victim(cycle: &[SessionId], age: impl Fn(SessionId) -> u64) -> Option<SessionId> {
        cycle
            .iter()
            .copied()
            .min_by(|&a, &b| age(a).cmp(&age(b)).then(b.cmp(&a)))
    }

    // ----- internals -----

    fn ids(&self, nodes: &[Ix]) -> Vec<SessionId> {
        nodes.iter().map(|&i| self.nodes[i as usize].id).collect()
    }

    /// The node of session `id`, created if needed, alone in a new component, first in the
    /// order if `first`, else last.
    fn node_or_insert(&mut self, id: SessionId, first: bool) -> Ix {
        if let Some(&i) = self.index.get(&id) {
            return i;
        }
        // A free slot keeps its (empty) edge maps and a free component its member list:
        // node churn allocates nothing once the graph has been this large.
        let i = match self.free_nodes.pop() {
            Some(i) => {
                let n = &mut self.nodes[i as usize];
                n.id = id;
                n.comp = 0;
                n.live = true;
                i
            }
            None => {
                self.nodes.push(Node {
                    id,
                    comp: 0,
                    out: IdMap::default(),
                    inn: IdSet::default(),
                    live: true,
                });
                (self.nodes.len() - 1) as Ix
            }
        };
        self.index.insert(id, i);
        let c = self.new_comp_of(i);
        if first {
            self.prepend(c);
        } else {
            self.append(c);
        }
        i
    }

    /// Gives component `c` (not in the order) a key after every other.
    fn append(&mut self, c: Cx) {
        match self.order.last_key_value().map(|(&k, _)| k) {
            None => self.set_key(c, KEY_LIMIT / 2),
            Some(last) if last < KEY_LIMIT - APPEND_STEP => self.set_key(c, last + APPEND_STEP),
            Some(last) => self.insert_after(last, c),
        }
    }

    /// Gives component `c` (not in the order) a key before every other.
    fn prepend(&mut self, c: Cx) {
        match self.order.first_key_value().map(|(&k, &d)| (k, d)) {
            None => self.set_key(c, KEY_LIMIT / 2),
            Some((first, _)) if first >= APPEND_STEP => self.set_key(c, first - APPEND_STEP),
            Some((first, _)) if first >= 1 => self.set_key(c, first / 2),
            Some((first, d)) => {
                // Key 0 is taken: put `c` right after it, then swap the two.
                self.insert_after(first, c);
                let k = self.comps[c as usize].key;
                let k0 = self.comps[d as usize].key;
                self.set_key_unmapped(c, k0);
                self.set_key_unmapped(d, k);
            }
        }
    }

    /// A new component of node `i` alone (not yet in the order), reusing a free slot's
    /// member list.
    fn new_comp_of(&mut self, i: Ix) -> Cx {
        let c = match self.free_comps.pop() {
            Some(c) => {
                let comp = &mut self.comps[c as usize];
                comp.key = 0;
                comp.members.clear();
                comp.members.push(i);
                comp.fmark = 0;
                comp.bmark = 0;
                comp.live = true;
                c
            }
            None => {
                self.comps.push(Comp {
                    key: 0,
                    members: vec![i],
                    fmark: 0,
                    bmark: 0,
                    live: true,
                });
                (self.comps.len() - 1) as Cx
            }
        };
        self.nodes[i as usize].comp = c;
        c
    }

    /// A new component of `members` (not yet in the order), their `comp` set.
    fn new_comp(&mut self, members: Vec<Ix>) -> Cx {
        let comp = Comp {
            key: 0,
            members,
            fmark: 0,
            bmark: 0,
            live: true,
        };
        let c = match self.free_comps.pop() {
            Some(c) => {
                self.comps[c as usize] = comp;
                c
            }
            None => {
                self.comps.push(comp);
                (self.comps.len() - 1) as Cx
            }
        };
        for k in 0..self.comps[c as usize].members.len() {
            let m = self.comps[c as usize].members[k];
            self.nodes[m as usize].comp = c;
        }
        c
    }

    fn free_comp(&mut self, c: Cx) {
        let comp = &mut self.comps[c as usize];
        if self.order.get(&comp.key) == Some(&c) {
            self.order.remove(&comp.key);
        }
        comp.live = false;
        comp.members.clear();
        self.cyclic.remove(&c);
        self.free_comps.push(c);
    }

    fn free_node(&mut self, i: Ix) {
        let node = &mut self.nodes[i as usize];
        self.index.remove(&node.id);
        node.live = false;
        node.out.clear();
        node.inn.clear();
        self.free_nodes.push(i);
    }

    /// Forgets node `i` if it has no edge left (it is then alone in its component).
    fn drop_if_isolated(&mut self, i: Ix) {
        let node = &self.nodes[i as usize];
        if !node.live || !node.out.is_empty() || !node.inn.is_empty() {
            return;
        }
        let c = node.comp;
        self.comps[c as usize].members.retain(|&m| m != i);
        if self.comps[c as usize].members.is_empty() {
            self.free_comp(c);
        } else {
            self.note_size(c);
        }
        self.free_node(i);
    }

    /// Keeps `cyclic` in step with the size of component `c`.
    fn note_size(&mut self, c: Cx) {
        if self.comps[c as usize].members.len() > 1 {
            self.cyclic.insert(c);
        } else {
            self.cyclic.remove(&c);
        }
    }

    fn set_key(&mut self, c: Cx, key: u64) {
        let old = self.comps[c as usize].key;
        if self.order.get(&old) == Some(&c) {
            self.order.remove(&old);
        }
        self.set_key_unmapped(c, key);
    }

    /// Sets `c`'s key, whose old key is already out of the order map.
    fn set_key_unmapped(&mut self, c: Cx, key: u64) {
        self.comps[c as usize].key = key;
        self.order.insert(key, c);
    }

    fn sort_by_key(&self, cs: &mut [Cx]) {
        cs.sort_unstable_by_key(|&c| self.comps[c as usize].key);
    }

    /// One step of a depth-first search over components: pops one and pushes its
    /// unvisited neighbours inside the window (and inside the other side's `within` marks,
    /// if any). False when the search is exhausted.
    fn step(&mut self, st: &mut Search, buf: &mut Vec<Cx>) -> bool {
        let Some(c) = st.stack.pop() else {
            return false;
        };
        st.seen.push(c);
        for k in 0..self.comps[c as usize].members.len() {
            let m = self.comps[c as usize].members[k] as usize;
            let node = &self.nodes[m];
            buf.clear();
            if st.forward {
                buf.extend(node.out.keys().map(|&s| self.nodes[s as usize].comp));
            } else {
                buf.extend(node.inn.iter().map(|&p| self.nodes[p as usize].comp));
            }
            for &d in buf.iter() {
                let comp = &self.comps[d as usize];
                let (marked, inside, other) = if st.forward {
                    (comp.fmark == st.stamp, comp.key <= st.bound, comp.bmark)
                } else {
                    (comp.bmark == st.stamp, comp.key >= st.bound, comp.fmark)
                };
                let allowed = st.within.is_none_or(|w| other == w);
                if d != c && !marked && inside && allowed {
                    self.mark(d, st.stamp, st.forward);
                    st.stack.push(d);
                }
            }
        }
        true
    }

    /// Runs a search to the end; returns the components visited.
    fn run(&mut self, mut st: Search) -> Vec<Cx> {
        if let Some(&start) = st.stack.first() {
            self.mark(start, st.stamp, st.forward);
        }
        let mut buf = Vec::new();
        while self.step(&mut st, &mut buf) {}
        st.seen
    }

    fn mark(&mut self, c: Cx, stamp: u64, forward: bool) {
        let comp = &mut self.comps[c as usize];
        if forward {
            comp.fmark = stamp;
        } else {
            comp.bmark = stamp;
        }
    }

    /// Merges `cs` (the new SCC, non-empty) into its largest component and returns it; the
    /// others are freed. Keys are the caller's business.
    fn merge(&mut self, cs: &[Cx]) -> Cx {
        let Some(&big) = cs
            .iter()
            .max_by_key(|&&c| self.comps[c as usize].members.len())
        else {
            return 0;
        };
        for &c in cs {
            if c == big {
                continue;
            }
            let members = std::mem::take(&mut self.comps[c as usize].members);
            for &m in &members {
                self.nodes[m as usize].comp = big;
            }
            self.comps[big as usize].members.extend(members);
            // Its key is already out of the order map.
            self.comps[c as usize].live = false;
            self.cyclic.remove(&c);
            self.free_comps.push(c);
        }
        big
    }

    /// Recomputes the SCCs inside component `c` (after one of its edges or members went
    /// away) with Tarjan's algorithm, and puts the pieces in its place in the order.
    fn resplit(&mut self, c: Cx) {
        let members = self.comps[c as usize].members.clone();
        if members.len() <= 1 {
            self.note_size(c);
            return;
        }
        let local: IdMap<Ix, usize> = members.iter().enumerate().map(|(k, &m)| (m, k)).collect();
        let adj: Vec<Vec<usize>> = members
            .iter()
            .map(|&m| {
                self.nodes[m as usize]
                    .out
                    .keys()
                    .filter_map(|s| local.get(s).copied())
                    .collect()
            })
            .collect();
        let mut pieces = tarjan(&adj);
        if pieces.len() == 1 {
            self.note_size(c);
            return;
        }
        // Tarjan emits sinks first: reverse for the topological order.
        pieces.reverse();
        let mut key = self.comps[c as usize].key;
        for (p, piece) in pieces.into_iter().enumerate() {
            let piece: Vec<Ix> = piece.into_iter().map(|k| members[k]).collect();
            if p == 0 {
                for &m in &piece {
                    self.nodes[m as usize].comp = c;
                }
                self.comps[c as usize].members = piece;
                self.note_size(c);
            } else {
                let d = self.new_comp(piece);
                self.insert_after(key, d);
                key = self.comps[d as usize].key;
                self.note_size(d);
            }
        }
    }

    /// Gives component `c` (not in the order) a key right after `after` (a key in the
    /// order), relabelling a block of keys if there is no room (Bender et al. 2002).
    fn insert_after(&mut self, after: u64, c: Cx) {
        let next = self
            .order
            .range(after.saturating_add(1)..)
            .next()
            .map_or(KEY_LIMIT, |(&k, _)| k);
        if next - after >= 2 {
            self.set_key(c, after + (next - after) / 2);
            return;
        }
        let mut i: i32 = 1;
        loop {
            let size = 1u64 << i;
            let lo = after & !(size - 1);
            let hi = lo + (size - 1);
            let capacity = DENSITY_BASE.powi(i);
            let limit = capacity as usize + 2;
            let count = self.order.range(lo..=hi).take(limit).count() + 1;
            if (count as f64) <= capacity || i >= 62 {
                // Relabel the block evenly, `c` right after `after`.
                let mut block: Vec<Cx> = Vec::with_capacity(count);
                for (&k, &d) in self.order.range(lo..=hi) {
                    block.push(d);
                    if k == after {
                        block.push(c);
                    }
                }
                let gap = size / block.len() as u64;
                for &d in &block {
                    let old = self.comps[d as usize].key;
                    if d != c && self.order.get(&old) == Some(&d) {
                        self.order.remove(&old);
                    }
                }
                for (j, &d) in block.iter().enumerate() {
                    self.set_key_unmapped(d, lo + j as u64 * gap);
                }
                return;
            }
            i += 1;
        }
    }

    /// Gives component `c` (not in the order) a key right before `before` (a key in the
    /// order).
    fn insert_before(&mut self, before: u64, c: Cx) {
        match self.order.range(..before).next_back().map(|(&k, _)| k) {
            Some(prev) => self.insert_after(prev, c),
            None => self.prepend(c),
        }
    }

    /// A shortest path `h →* w` inside their (common) component, as the cycle
    /// `[w, h, …, x]` closed by the edge `w → h`.
    fn cycle_through_edge(&self, wi: Ix, hi: Ix) -> Vec<SessionId> {
        let path = self.shortest_path(hi, wi);
        let mut cycle = Vec::with_capacity(path.len());
        cycle.push(wi);
        cycle.extend(path.iter().take(path.len().saturating_sub(1)));
        self.ids(&cycle)
    }

    /// A shortest path from `from` to `to` (`from != to`) over edges inside `from`'s
    /// component; `[from]` if there is none (cannot happen inside an SCC).
    fn shortest_path(&self, from: Ix, to: Ix) -> Vec<Ix> {
        let c = self.nodes[from as usize].comp;
        let mut parent: IdMap<Ix, Ix> = IdMap::default();
        parent.insert(from, from);
        let mut queue = VecDeque::from([from]);
        while let Some(v) = queue.pop_front() {
            for &s in self.nodes[v as usize].out.keys() {
                if self.nodes[s as usize].comp != c || parent.contains_key(&s) {
                    continue;
                }
                parent.insert(s, v);
                if s == to {
                    let mut path = vec![to];
                    let mut x = to;
                    while x != from {
                        x = parent[&x];
                        path.push(x);
                    }
                    path.reverse();
                    return path;
                }
                queue.push_back(s);
            }
        }
        vec![from]
    }

    /// A shortest cycle through `start` inside its component, in wait order from `start`.
    fn shortest_cycle(&self, start: Ix) -> Vec<Ix> {
        let c = self.nodes[start as usize].comp;
        let mut parent: IdMap<Ix, Ix> = IdMap::default();
        parent.insert(start, start);
        let mut queue = VecDeque::from([start]);
        while let Some(v) = queue.pop_front() {
            for &s in self.nodes[v as usize].out.keys() {
                if self.nodes[s as usize].comp != c {
                    continue;
                }
                if s == start {
                    let mut path = vec![v];
                    let mut x = v;
                    while x != start {
                        x = parent[&x];
                        path.push(x);
                    }
                    path.reverse();
                    return path;
                }
                if parent.contains_key(&s) {
                    continue;
                }
                parent.insert(s, v);
                queue.push_back(s);
            }
        }
        vec![start]
    }

    /// Component `c` listed as documented in [`WaitForGraph::deadlocks`].
    fn listing(&self, c: Cx) -> Vec<SessionId> {
        let members = &self.comps[c as usize].members;
        let Some(&start) = members.iter().min_by_key(|&&m| self.nodes[m as usize].id) else {
            return Vec::new();
        };
        let mut list = self.shortest_cycle(start);
        let mut seen: IdSet<Ix> = list.iter().copied().collect();
        let mut q = 0;
        while q < list.len() && list.len() < members.len() {
            let v = list[q];
            q += 1;
            let mut next: Vec<Ix> = self.nodes[v as usize]
                .out
                .keys()
                .copied()
                .filter(|&s| self.nodes[s as usize].comp == c && !seen.contains(&s))
                .collect();
            next.sort_unstable_by_key(|&s| self.nodes[s as usize].id);
            for s in next {
                seen.insert(s);
                list.push(s);
            }
        }
        self.ids(&list)
    }

    /// Checks the internal invariants (test builds only): slots, membership, the order map,
    /// a topological order of the condensation, counts, no isolated node.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut edges = 0usize;
        let mut waits = 0u64;
        for (&id, &i) in &self.index {
            let node = &self.nodes[i as usize];
            if !node.live || node.id != id {
                return Err(format!("index entry {id} → slot {i} is not that live node"));
            }
            if node.out.is_empty() && node.inn.is_empty() {
                return Err(format!("session {id} has no edge but is kept"));
            }
            let comp = &self.comps[node.comp as usize];
            if !comp.live || !comp.members.contains(&i) {
                return Err(format!("session {id} is not a member of its component"));
            }
            for (&s, &count) in &node.out {
                if count == 0 || !self.nodes[s as usize].inn.contains(&i) {
                    return Err(format!("edge {id} → slot {s}: count 0 or no mirror"));
                }
                edges += 1;
                waits += count;
                let cs = &self.comps[self.nodes[s as usize].comp as usize];
                if node.comp != self.nodes[s as usize].comp && comp.key >= cs.key {
                    return Err(format!(
                        "edge {id} → {} goes backwards in the order ({} ≥ {})",
                        self.nodes[s as usize].id, comp.key, cs.key
                    ));
                }
            }
            for &p in &node.inn {
                if !self.nodes[p as usize].out.contains_key(&i) {
                    return Err(format!("in-edge of {id} from slot {p} has no out-edge"));
                }
            }
        }
        if edges != self.edges || waits != self.waits {
            return Err(format!(
                "counts: edges {} (kept {}), waits {waits} (kept {})",
                edges, self.edges, self.waits
            ));
        }
        let live: Vec<Cx> = (0..self.comps.len() as Cx)
            .filter(|&c| self.comps[c as usize].live)
            .collect();
        if live.len() != self.order.len() {
            return Err(format!(
                "{} live components, {} keys",
                live.len(),
                self.order.len()
            ));
        }
        for &c in &live {
            let comp = &self.comps[c as usize];
            if self.order.get(&comp.key) != Some(&c) || comp.key >= KEY_LIMIT {
                return Err(format!("component {c}: key {} not mapped to it", comp.key));
            }
            if comp.members.is_empty() {
                return Err(format!("component {c} is empty"));
            }
            for &m in &comp.members {
                if !self.nodes[m as usize].live || self.nodes[m as usize].comp != c {
                    return Err(format!("component {c}: member slot {m} points elsewhere"));
                }
            }
            if (comp.members.len() > 1) != self.cyclic.contains(&c) {
                return Err(format!("component {c}: cyclic set out of step"));
            }
        }
        let members: usize = live
            .iter()
            .map(|&c| self.comps[c as usize].members.len())
            .sum();
        if members != self.index.len() {
            return Err(format!("{members} members, {} sessions", self.index.len()));
        }
        Ok(())
    }
}

/// Tarjan's strongly connected components of the graph `0..adj.len()` (iterative, so a long
/// chain cannot overflow the stack). Components come out in reverse topological order (a
/// component is emitted after every component it reaches).
fn tarjan(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    const UNSEEN: usize = usize::MAX;
    let n = adj.len();
    let mut index = vec![UNSEEN; n];
    let mut low = vec![0usize; n];
    let mut on_stack = vec![false; n];
    let mut stack: Vec<usize> = Vec::new();
    let mut call: Vec<(usize, usize)> = Vec::new();
    let mut out = Vec::new();
    let mut next = 0usize;
    for root in 0..n {
        if index[root] != UNSEEN {
            continue;
        }
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on_stack[root] = true;
        call.push((root, 0));
        while let Some(top) = call.last_mut() {
            let v = top.0;
            if let Some(&w) = adj[v].get(top.1) {
                top.1 += 1;
                if index[w] == UNSEEN {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    call.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(p, _)) = call.last() {
                    low[p] = low[p].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut comp = Vec::new();
                    while let Some(x) = stack.pop() {
                        on_stack[x] = false;
                        comp.push(x);
                        if x == v {
                            break;
                        }
                    }
                    out.push(comp);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
