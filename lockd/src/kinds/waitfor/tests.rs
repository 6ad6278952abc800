//! Wait-for graph tests, transition by transition, and a random-history property test
//! against a from-scratch Tarjan oracle that is shown to fail with planted bugs.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError, TestRunner};
use std::collections::BTreeMap;

/// The deadlocks as sets of members (order-free), for comparisons.
fn components(g: &WaitForGraph) -> BTreeSet<BTreeSet<u64>> {
    g.deadlocks()
        .into_iter()
        .map(|d| d.into_iter().collect())
        .collect()
}

fn set(ids: &[u64]) -> BTreeSet<u64> {
    ids.iter().copied().collect()
}

/// Whether `cycle` is a simple cycle of `edges` in wait order.
fn is_cycle_of(cycle: &[u64], has_edge: impl Fn(u64, u64) -> bool) -> bool {
    let distinct: BTreeSet<u64> = cycle.iter().copied().collect();
    cycle.len() >= 2
        && distinct.len() == cycle.len()
        && (0..cycle.len()).all(|i| has_edge(cycle[i], cycle[(i + 1) % cycle.len()]))
}

fn graph_edge(g: &WaitForGraph) -> impl Fn(u64, u64) -> bool + '_ {
    move |a, b| {
        let (Some(&ai), Some(&bi)) = (g.index.get(&a), g.index.get(&b)) else {
            return false;
        };
        g.nodes[ai as usize].out.contains_key(&bi)
    }
}

#[test]
fn the_seeds_two_cycle() {
    // Seed 000: A holds "B" and waits for "A", held by B; B waits for "B", held by A.
    let mut g = WaitForGraph::new();
    assert_eq!(g.add_edge(1, 2), None);
    assert!(!g.is_deadlocked(1));
    assert_eq!(g.add_edge(2, 1), Some(vec![2, 1]));
    assert!(g.is_deadlocked(1) && g.is_deadlocked(2));
    assert_eq!(g.deadlocks(), vec![vec![1, 2]]);
    assert_eq!(g.deadlock_count(), 1);
    assert_eq!((g.node_count(), g.edge_count(), g.wait_count()), (2, 2, 2));
    g.check_invariants().unwrap();
}

#[test]
fn a_three_cycle_is_found_exactly() {
    let mut g = WaitForGraph::new();
    assert_eq!(g.add_edge(1, 2), None);
    assert_eq!(g.add_edge(2, 3), None);
    // 4 waits into the future cycle, 3 also waits for 5: neither 4 nor 5 will be on it.
    assert_eq!(g.add_edge(4, 1), None);
    assert_eq!(g.add_edge(3, 5), None);
    assert_eq!(g.add_edge(3, 1), Some(vec![3, 1, 2]));
    assert_eq!(g.deadlocks(), vec![vec![1, 2, 3]]);
    for n in [1, 2, 3] {
        assert!(g.is_deadlocked(n), "{n}");
        assert_eq!(g.cycle_through(n).map(|c| c.len()), Some(3));
    }
    for n in [4, 5, 99] {
        assert!(!g.is_deadlocked(n), "{n}");
        assert_eq!(g.deadlock_of(n), None);
    }
    assert_eq!(g.deadlocked_session_count(), 3);
    g.check_invariants().unwrap();
}

#[test]
fn a_fifty_cycle_is_found_exactly_in_wait_order() {
    let mut g = WaitForGraph::new();
    for i in 0..49 {
        assert_eq!(g.add_edge(i, i + 1), None, "chain edge {i}");
    }
    assert_eq!(g.deadlock_count(), 0);
    let expected: Vec<u64> = std::iter::once(49).chain(0..49).collect();
    assert_eq!(g.add_edge(49, 0), Some(expected));
    assert_eq!(g.deadlocks(), vec![(0..50).collect::<Vec<u64>>()]);
    assert_eq!(g.deadlocked_session_count(), 50);
    g.check_invariants().unwrap();
}

/// Sessions 0..n all waiting for a hub first: new waiters go first in the order, so session
/// `i` ends up *after* session `i + 1`, and every chain edge `i → i + 1` added next
/// contradicts the order and makes it reorder.
fn against_the_order(n: u64, hub: u64) -> WaitForGraph {
    let mut g = WaitForGraph::new();
    for i in 0..n {
        assert_eq!(g.add_edge(i, hub), None);
    }
    let mut work = 0;
    for i in 0..n - 1 {
        assert_eq!(g.add_edge(i, i + 1), None, "chain edge {i}");
        work += g.last_work();
    }
    assert!(
        work >= n as usize,
        "the chain edges reordered (visited {work})"
    );
    g.check_invariants().unwrap();
    g
}

#[test]
fn a_fifty_cycle_inserted_against_the_order_is_found() {
    let mut g = against_the_order(50, 1_000);
    assert_eq!(g.deadlock_count(), 0);
    let cycle = g
        .add_edge(49, 0)
        .expect("the closing edge closes the 50-cycle");
    let expected: Vec<u64> = std::iter::once(49).chain(0..49).collect();
    assert_eq!(cycle, expected);
    assert!(is_cycle_of(&cycle, graph_edge(&g)));
    // The hub that every member waits for is not on the cycle.
    assert_eq!(
        components(&g),
        BTreeSet::from([(0..50).collect::<BTreeSet<u64>>()])
    );
    assert!(!g.is_deadlocked(1_000));
    g.check_invariants().unwrap();
}

#[test]
fn a_chain_of_ten_thousand_is_no_cycle_until_closed() {
    let n = 10_000u64;
    let mut g = WaitForGraph::new();
    for i in 0..n - 1 {
        assert_eq!(g.add_edge(i, i + 1), None);
    }
    assert_eq!(g.deadlock_count(), 0);
    assert!(g.deadlocks().is_empty());
    assert!(!g.is_deadlocked(0) && !g.is_deadlocked(n - 1));
    assert_eq!(
        (g.node_count(), g.edge_count()),
        (n as usize, (n - 1) as usize)
    );
    g.check_invariants().unwrap();

    let cycle = g
        .add_edge(n - 1, 0)
        .expect("closing the chain closes one cycle");
    let expected: Vec<u64> = std::iter::once(n - 1).chain(0..n - 1).collect();
    assert_eq!(cycle, expected);
    let all = g.deadlocks();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0], (0..n).collect::<Vec<u64>>());
    g.check_invariants().unwrap();

    // Breaking it in the middle leaves a chain again: 10,000 pieces put back in the order.
    assert!(g.remove_edge(5_000, 5_001));
    assert_eq!(g.deadlock_count(), 0);
    assert!(!g.is_deadlocked(5_000));
    g.check_invariants().unwrap();
    // And it still sees the next cycle exactly.
    assert_eq!(
        g.add_edge(5_001, 4_999),
        None,
        "4,999 does not reach 5,001 any more"
    );
    let c = g.add_edge(5_000, 4_999).expect("5,000 ⇄ 4,999");
    assert_eq!(c, vec![5_000, 4_999]);
    g.check_invariants().unwrap();
}

#[test]
fn a_chain_inserted_against_the_order_is_reordered_not_a_cycle() {
    // Every chain edge contradicts the order: the reordering must not invent a cycle.
    let n = 2_000u64;
    let mut g = against_the_order(n, 1_000_000);
    assert_eq!(g.deadlock_count(), 0);
    assert_eq!(g.add_edge(n - 1, 0).map(|c| c.len()), Some(n as usize));
    g.check_invariants().unwrap();
}

#[test]
fn the_search_stops_at_the_smaller_side() {
    // H = 0 heads a chain of 1,000 inside the window, W = 5,000 has no waiter inside it:
    // the backward side is exhausted at once and only W moves.
    let mut g = WaitForGraph::new();
    for i in 0..1_000 {
        g.add_edge(i, i + 1);
    }
    g.add_edge(4_000, 5_000);
    assert_eq!(g.add_edge(5_000, 0), None);
    assert!(g.last_work() <= 4, "visited {}", g.last_work());
    g.check_invariants().unwrap();
    // The mirror image: W = 2,000 is waited for by a chain of 1,000 inside the window, H =
    // 3,000 waits for nobody: the forward side is exhausted at once.
    let mut g = WaitForGraph::new();
    g.add_edge(3_000, 3_001);
    for i in 0..1_000 {
        g.add_edge(1_000 + i, 1_000 + i + 1);
    }
    g.add_edge(2_000, 2_001);
    assert_eq!(g.add_edge(2_000, 3_000), None, "3,000 does not reach 2,000");
    g.check_invariants().unwrap();
    let mut g2 = g.clone();
    // Closing cycles from both sides: through the small side, then through the big one.
    assert_eq!(g.add_edge(3_000, 2_000).map(|c| c.len()), Some(2));
    g.check_invariants().unwrap();
    assert_eq!(g2.add_edge(2_001, 1_000).map(|c| c.len()), Some(1_002));
    g2.check_invariants().unwrap();
    assert_eq!(g2.deadlocked_session_count(), 1_002);
}

#[test]
fn removing_an_edge_breaks_the_cycle() {
    let mut g = WaitForGraph::new();
    g.add_edge(1, 2);
    g.add_edge(2, 3);
    assert!(g.add_edge(3, 1).is_some());
    assert!(g.remove_edge(2, 3));
    assert!(g.deadlocks().is_empty());
    assert!(!g.is_deadlocked(1) && !g.is_deadlocked(2) && !g.is_deadlocked(3));
    // 3 → 1 → 2 stays; nothing else.
    assert_eq!((g.node_count(), g.edge_count()), (3, 2));
    g.check_invariants().unwrap();
    // Waiting again re-closes it.
    assert_eq!(g.add_edge(2, 3), Some(vec![2, 3, 1]));
    // Ending a member (its session closed) breaks it too, and drops its edges.
    assert!(g.remove_node(3));
    assert!(g.deadlocks().is_empty());
    assert_eq!((g.node_count(), g.edge_count()), (2, 1));
    g.check_invariants().unwrap();
}

#[test]
fn two_disjoint_cycles_are_two_deadlocks() {
    let mut g = WaitForGraph::new();
    g.add_edge(1, 2);
    g.add_edge(2, 3);
    assert!(g.add_edge(3, 1).is_some());
    g.add_edge(10, 11);
    assert_eq!(g.add_edge(11, 10), Some(vec![11, 10]));
    // A bridge one way between them joins nothing.
    assert_eq!(g.add_edge(3, 10), None);
    assert_eq!(
        components(&g),
        BTreeSet::from([set(&[1, 2, 3]), set(&[10, 11])])
    );
    assert_eq!(g.deadlock_count(), 2);
    assert!(g.remove_edge(10, 11));
    assert_eq!(components(&g), BTreeSet::from([set(&[1, 2, 3])]));
    // 10 → 1 closes 10 → 1 → 2 → 3 → 10 (11 still waits for 10 but is on no cycle).
    assert_eq!(g.add_edge(10, 1), Some(vec![10, 1, 2, 3]));
    assert_eq!(components(&g), BTreeSet::from([set(&[1, 2, 3, 10])]));
    g.check_invariants().unwrap();
}

#[test]
fn parallel_edges_count_and_the_cycle_lasts_until_the_last_one_goes() {
    let mut g = WaitForGraph::new();
    // 1 waits for two resources held by 2.
    assert_eq!(g.add_edge(1, 2), None);
    assert_eq!(g.add_edge(1, 2), None);
    assert_eq!(g.add_edge(2, 3), None);
    assert_eq!(g.add_edge(3, 1), Some(vec![3, 1, 2]));
    // A parallel edge on the cycle closes nothing new.
    assert_eq!(g.add_edge(2, 3), None);
    assert_eq!((g.edge_count(), g.wait_count()), (3, 5));
    assert!(!g.remove_edge(1, 2), "one resource still links 1 to 2");
    assert!(g.is_deadlocked(1));
    assert_eq!(g.deadlocks(), vec![vec![1, 2, 3]]);
    assert!(g.remove_edge(1, 2));
    assert!(!g.is_deadlocked(1));
    assert!(g.deadlocks().is_empty());
    assert_eq!((g.edge_count(), g.wait_count()), (2, 3));
    g.check_invariants().unwrap();
}

#[test]
fn self_loops_are_ignored_and_unknown_things_are_no_ops() {
    let mut g = WaitForGraph::new();
    assert_eq!(g.add_edge(5, 5), None);
    assert_eq!((g.node_count(), g.edge_count(), g.wait_count()), (0, 0, 0));
    assert!(!g.is_deadlocked(5));
    assert!(!g.remove_edge(5, 5));
    assert!(!g.remove_edge(1, 2));
    assert!(!g.remove_node(7));
    g.add_edge(1, 2);
    assert!(!g.remove_edge(2, 1), "the reverse edge does not exist");
    assert!(!g.remove_edge(1, 3));
    assert_eq!(g.edge_count(), 1);
    assert!(g.remove_edge(1, 2));
    assert!(!g.remove_edge(1, 2), "already gone");
    // A session without edges is forgotten.
    assert_eq!(g.node_count(), 0);
    assert!(!g.contains(1));
    g.check_invariants().unwrap();
}

#[test]
fn a_figure_eight_splits_when_its_hub_edge_goes() {
    // 1 ⇄ 2 and 2 ⇄ 3: one deadlock of three, not a simple cycle.
    let mut g = WaitForGraph::new();
    g.add_edge(1, 2);
    assert!(g.add_edge(2, 1).is_some());
    g.add_edge(2, 3);
    assert_eq!(g.add_edge(3, 2), Some(vec![3, 2]));
    let all = g.deadlocks();
    assert_eq!(all.len(), 1);
    // Listed from its smallest member with a shortest cycle through it, then the rest.
    assert_eq!(all[0], vec![1, 2, 3]);
    assert!(g.remove_edge(1, 2));
    assert_eq!(g.deadlocks(), vec![vec![2, 3]]);
    assert!(!g.is_deadlocked(1));
    g.check_invariants().unwrap();
    // Removing the hub session ends everything.
    assert!(g.remove_node(2));
    assert!(g.deadlocks().is_empty());
    assert_eq!(g.node_count(), 0);
    g.check_invariants().unwrap();
}

#[test]
fn a_chord_inside_a_deadlock_returns_its_own_cycle() {
    let mut g = WaitForGraph::new();
    for i in 0..5 {
        g.add_edge(i, (i + 1) % 5);
    }
    assert_eq!(g.deadlock_count(), 1);
    assert_eq!(g.add_edge(3, 1), Some(vec![3, 1, 2]));
    assert_eq!(g.deadlock_count(), 1);
    // Removing a cycle edge keeps the deadlock alive through the chord: 1 → 2 → 3 → 1.
    assert!(g.remove_edge(4, 0));
    assert_eq!(components(&g), BTreeSet::from([set(&[1, 2, 3])]));
    g.check_invariants().unwrap();
}

#[test]
fn the_victim_is_the_youngest() {
    let birth = |n: u64| [0u64, 50, 70, 20, 70][n as usize % 5];
    // age = now − birth, now = 100.
    let age = |n: u64| 100 - birth(n);
    assert_eq!(WaitForGraph::victim(&[1, 3, 0], age), Some(1));
    // A tie (2 and 4 born together) goes to the later session.
    assert_eq!(WaitForGraph::victim(&[2, 4, 3], age), Some(4));
    assert_eq!(WaitForGraph::victim(&[], age), None);
    // With a graph's own cycle.
    let mut g = WaitForGraph::new();
    g.add_edge(0, 3);
    let cycle = g.add_edge(3, 0).unwrap();
    assert_eq!(WaitForGraph::victim(&cycle, age), Some(3));
}

#[test]
fn order_keys_survive_relabelling() {
    // Many splits in one place exhaust the midpoints and force block relabelling; the order
    // must stay topological throughout.
    let mut g = WaitForGraph::new();
    for round in 0..40u64 {
        let base = round * 100;
        for i in 0..30 {
            g.add_edge(base + i, base + (i + 1) % 30);
        }
        // One wait towards the previous round's ring, so rounds are ordered.
        if round > 0 {
            g.add_edge(base, base - 100);
        }
        assert!(g.remove_edge(base + 29, base));
        g.check_invariants().unwrap();
    }
    assert_eq!(g.deadlock_count(), 0);
}

/// The planted multiplicity bug, transition by transition: the deadlock that still exists
/// through the second resource is lost (what the oracle comparison sees).
#[test]
fn a_forgotten_multiplicity_loses_a_live_deadlock() {
    for bug in [None, Some(PlantedBug::ForgottenMultiplicity)] {
        let mut g = WaitForGraph::new();
        if let Some(bug) = bug {
            g.plant_bug(bug);
        }
        g.add_edge(1, 2);
        g.add_edge(1, 2);
        g.add_edge(2, 1);
        g.remove_edge(1, 2);
        // 1 still waits for 2 through the second resource.
        assert_eq!(g.is_deadlocked(1), bug.is_none(), "{bug:?}");
    }
}

#[test]
fn insertions_at_one_place_relabel_and_keep_the_order() {
    // 500 keys inserted one after the other between two neighbours 2^24 apart: the
    // midpoints run out after ~24 and blocks get relabelled, many times.
    let mut g = WaitForGraph::new();
    g.add_edge(1, 2);
    let (c1, c2) = (
        g.nodes[g.index[&1] as usize].comp,
        g.nodes[g.index[&2] as usize].comp,
    );
    let mut prev = g.comps[c1 as usize].key;
    let mut expected = vec![c1];
    for _ in 0..500 {
        let c = g.new_comp(Vec::new());
        g.insert_after(prev, c);
        prev = g.comps[c as usize].key;
        expected.push(c);
    }
    expected.push(c2);
    let order: Vec<Cx> = g.order.values().copied().collect();
    assert_eq!(order, expected);
    for (&k, &c) in &g.order {
        assert_eq!(g.comps[c as usize].key, k);
        assert!(k < KEY_LIMIT);
    }
}

#[test]
fn new_waiters_go_first_even_from_key_zero() {
    // Prepending down to key 0, then past it (relabel and swap).
    let mut g = WaitForGraph::new();
    g.add_edge(1, 2);
    let (c1, c2) = (
        g.nodes[g.index[&1] as usize].comp,
        g.nodes[g.index[&2] as usize].comp,
    );
    g.set_key(c1, 0);
    let mut expected = vec![c1, c2];
    for _ in 0..300 {
        let c = g.new_comp(Vec::new());
        g.prepend(c);
        expected.insert(0, c);
    }
    let order: Vec<Cx> = g.order.values().copied().collect();
    assert_eq!(order, expected);
    for (&k, &c) in &g.order {
        assert_eq!(g.comps[c as usize].key, k);
    }
    // Through the API: a new waiter of an old holder, and a new holder of an old waiter,
    // never reorder (the invariants check the order).
    let mut g = WaitForGraph::new();
    for i in 0..100 {
        assert_eq!(g.add_edge(1_000 + i, i % 7), None);
        assert_eq!(g.add_edge(i % 5, 2_000 + i), None);
    }
    g.check_invariants().unwrap();
}

// ----- property test against a from-scratch oracle -----

#[derive(Debug, Clone)]
enum Op {
    Add(u64, u64),
    Remove(u64, u64),
    RemoveNode(u64),
}

fn op(n: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..n, 0..n).prop_map(|(a, b)| Op::Add(a, b)),
        3 => (0..n, 0..n).prop_map(|(a, b)| Op::Remove(a, b)),
        1 => (0..n).prop_map(Op::RemoveNode),
    ]
}

fn history() -> impl Strategy<Value = Vec<Op>> {
    prop_oneof![
        prop::collection::vec(op(5), 0..120),
        prop::collection::vec(op(12), 0..250),
        prop::collection::vec(op(30), 0..400),
    ]
}

/// The reference: a multigraph of counts, and its SCCs by a recursive textbook Tarjan run
/// from scratch (written independently of the module's iterative one).
#[derive(Default)]
struct Model {
    counts: BTreeMap<(u64, u64), u64>,
}

impl Model {
    fn nodes(&self) -> BTreeSet<u64> {
        self.counts.keys().flat_map(|&(a, b)| [a, b]).collect()
    }

    fn succ(&self, a: u64) -> impl Iterator<Item = u64> + '_ {
        self.counts
            .range((a, 0)..=(a, u64::MAX))
            .map(|(&(_, b), _)| b)
    }

    fn sccs(&self) -> Vec<BTreeSet<u64>> {
        struct St {
            next: usize,
            index: BTreeMap<u64, usize>,
            low: BTreeMap<u64, usize>,
            stack: Vec<u64>,
            on: BTreeSet<u64>,
            out: Vec<BTreeSet<u64>>,
        }
        fn visit(m: &Model, v: u64, st: &mut St) {
            st.index.insert(v, st.next);
            st.low.insert(v, st.next);
            st.next += 1;
            st.stack.push(v);
            st.on.insert(v);
            for w in m.succ(v).collect::<Vec<_>>() {
                if !st.index.contains_key(&w) {
                    visit(m, w, st);
                    let lw = st.low[&w];
                    let lv = st.low.get_mut(&v).unwrap();
                    *lv = (*lv).min(lw);
                } else if st.on.contains(&w) {
                    let iw = st.index[&w];
                    let lv = st.low.get_mut(&v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if st.low[&v] == st.index[&v] {
                let mut comp = BTreeSet::new();
                while let Some(x) = st.stack.pop() {
                    st.on.remove(&x);
                    comp.insert(x);
                    if x == v {
                        break;
                    }
                }
                st.out.push(comp);
            }
        }
        let mut st = St {
            next: 0,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on: BTreeSet::new(),
            out: Vec::new(),
        };
        for v in self.nodes() {
            if !st.index.contains_key(&v) {
                visit(self, v, &mut st);
            }
        }
        st.out
    }

    fn deadlocks(&self) -> BTreeSet<BTreeSet<u64>> {
        self.sccs().into_iter().filter(|c| c.len() > 1).collect()
    }
}

/// Checks one listing of `deadlocks()`: every member once, a simple cycle first, then each
/// further member waited for by an earlier one.
fn check_listing(list: &[u64], m: &Model) -> Result<(), TestCaseError> {
    let edge = |a: u64, b: u64| m.counts.contains_key(&(a, b));
    let k = (2..=list.len())
        .find(|&k| edge(list[k - 1], list[0]) && (1..k).all(|i| edge(list[i - 1], list[i])))
        .ok_or_else(|| TestCaseError::fail(format!("{list:?} does not start with a cycle")))?;
    for j in k..list.len() {
        prop_assert!(
            list[..j].iter().any(|&p| edge(p, list[j])),
            "{list:?}: {} is waited for by nobody listed before it",
            list[j]
        );
    }
    Ok(())
}

fn check_history(ops: &[Op], bug: Option<PlantedBug>) -> Result<(), TestCaseError> {
    let mut g = WaitForGraph::new();
    if let Some(bug) = bug {
        g.plant_bug(bug);
    }
    let mut m = Model::default();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Add(w, h) => {
                let got = g.add_edge(w, h);
                let new = w != h && !m.counts.contains_key(&(w, h));
                if w != h {
                    *m.counts.entry((w, h)).or_insert(0) += 1;
                }
                let on_cycle = new && m.sccs().iter().any(|c| c.contains(&w) && c.contains(&h));
                match got {
                    Some(cycle) => {
                        prop_assert!(on_cycle, "step {step}: {w} → {h} reported a cycle");
                        prop_assert_eq!(&cycle[..2], &[w, h][..]);
                        prop_assert!(
                            is_cycle_of(&cycle, |a, b| m.counts.contains_key(&(a, b))),
                            "step {step}: {:?} is not a cycle",
                            cycle
                        );
                    }
                    None => prop_assert!(
                        !on_cycle,
                        "step {step}: {w} → {h} closed a cycle that was not reported"
                    ),
                }
            }
            Op::Remove(w, h) => {
                let gone = g.remove_edge(w, h);
                let expect_gone = match m.counts.get_mut(&(w, h)) {
                    Some(c) if *c > 1 => {
                        *c -= 1;
                        false
                    }
                    Some(_) => {
                        m.counts.remove(&(w, h));
                        true
                    }
                    None => false,
                };
                prop_assert_eq!(gone, expect_gone, "step {}: remove {} → {}", step, w, h);
            }
            Op::RemoveNode(n) => {
                let known = m.nodes().contains(&n);
                prop_assert_eq!(g.remove_node(n), known, "step {}: remove node {}", step, n);
                m.counts.retain(|&(a, b), _| a != n && b != n);
            }
        }
        let want = m.deadlocks();
        let got = components(&g);
        prop_assert_eq!(&got, &want, "step {}: deadlocked components differ", step);
        for list in g.deadlocks() {
            check_listing(&list, &m)?;
        }
        let deadlocked: BTreeSet<u64> = want.iter().flatten().copied().collect();
        for n in 0..31 {
            prop_assert_eq!(
                g.is_deadlocked(n),
                deadlocked.contains(&n),
                "step {}: {}",
                step,
                n
            );
        }
        prop_assert_eq!(g.node_count(), m.nodes().len(), "step {}: nodes", step);
        prop_assert_eq!(g.edge_count(), m.counts.len(), "step {}: edges", step);
        prop_assert_eq!(
            g.wait_count(),
            m.counts.values().sum::<u64>(),
            "step {}: waits",
            step
        );
        prop_assert_eq!(g.deadlock_count(), want.len());
        if let Err(e) = g.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step}: {e}")));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(PtConfig { cases: 256, ..PtConfig::default() })]

    #[test]
    fn random_histories_match_the_oracle(ops in history()) {
        check_history(&ops, None)?;
    }
}

fn run_with_bug(bug: PlantedBug) -> String {
    let mut runner = TestRunner::new(PtConfig {
        cases: 400,
        failure_persistence: None,
        ..PtConfig::default()
    });
    let result = runner.run(&history(), |ops| check_history(&ops, Some(bug)));
    let msg = result
        .expect_err("the planted bug went unnoticed")
        .to_string();
    eprintln!("{bug:?} caught: {msg}");
    msg
}

/// Reporting only 2-cycles (the seed's pairwise detection) is caught.
#[test]
fn property_test_catches_two_cycles_only() {
    let msg = run_with_bug(PlantedBug::TwoCyclesOnly);
    assert!(
        msg.contains("was not reported") || msg.contains("components differ"),
        "{msg}"
    );
}

/// Forgetting the multiplicity of parallel edges is caught.
#[test]
fn property_test_catches_a_forgotten_multiplicity() {
    let msg = run_with_bug(PlantedBug::ForgottenMultiplicity);
    assert!(
        msg.contains("remove") || msg.contains("differ") || msg.contains("edges"),
        "{msg}"
    );
}
