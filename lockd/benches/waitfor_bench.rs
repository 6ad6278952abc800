//! Deadlock detection benchmark (issue 12 point 3; not a test). Run with:
//!
//! ```text
//! cargo bench -p lockd --bench waitfor_bench -- [--sessions 10000] [--resources 1000]
//!     [--events 20000] [--cross 0.7] [--deadlocks 1000] [--naive-every 20] [--seed 12]
//! ```
//!
//! Drives `lockd::kinds::waitfor::WaitForGraph` with a simulated lockd: `--resources`
//! exclusive resources, `--sessions` sessions (lockd's scale scenario: one holder per
//! resource, every other session queued FIFO on a random resource; a waiter waits for the
//! holder). Then `--events` random events:
//!
//! * with probability `--cross`, a session that holds a resource and waits for none asks
//!   for another random one (hold-and-wait: the source of cycles);
//! * otherwise a random holder releases its resource (the head of the queue gets it and the
//!   other waiters now wait for the new holder), or, one time in ten, a random waiter gives
//!   up (its timeout). A session left with nothing held or awaited ends (`remove_node`) and a
//!   new session arrives and asks for a random resource, so the population stays at
//!   `--sessions`.
//!
//! Then `--deadlocks` deadlocks of 2 to 50 holders are built on purpose in that graph (each
//! holder of the ring asks for the next one's resource; 10 random events between two rings),
//! since random requests close few cycles.
//!
//! Every new wait edge is timed (`add_edge`, which also answers "does it close a cycle?").
//! When it closes one, the deadlock is broken the way `--break-deadlocks` will: revoke the
//! youngest session of the cycle (`WaitForGraph::victim`, younger = larger session id),
//! i.e. release everything it holds, until the new edge's session is in no deadlock.
//!
//! Side by side, the naive recompute: the same graph kept as plain adjacency, and Tarjan's
//! SCC algorithm from scratch over the whole graph on every `--naive-every`-th new edge
//! (and on every edge that closes a cycle), asking the same question; its verdict is checked
//! against the incremental one (the bench panics on a disagreement).
//!
//! Also: one closing edge of a 10,000-long chain (a 10,000-cycle), both ways.
//!
//! Percentiles are nearest rank (`harness::stats::percentile_of`, the workspace's one
//! definition).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use harness::stats::percentile_of;
use lockd::kinds::waitfor::WaitForGraph;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The plain graph for the naive recompute: successor → count, per session.
#[derive(Default)]
struct Naive {
    out: HashMap<u64, HashMap<u64, u64>>,
}

impl Naive {
    fn add(&mut self, w: u64, h: u64) {
        *self.out.entry(w).or_default().entry(h).or_insert(0) += 1;
        self.out.entry(h).or_default();
    }

    fn remove(&mut self, w: u64, h: u64) {
        if let Some(m) = self.out.get_mut(&w) {
            if let Some(c) = m.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    m.remove(&h);
                }
            }
        }
    }

    fn remove_node(&mut self, n: u64) {
        self.out.remove(&n);
        for m in self.out.values_mut() {
            m.remove(&n);
        }
    }

    /// Tarjan from scratch over the whole graph: are `w` and `h` in one SCC?
    fn same_scc(&self, w: u64, h: u64) -> bool {
        let ids: Vec<u64> = self.out.keys().copied().collect();
        let local: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let adj: Vec<Vec<usize>> = ids
            .iter()
            .map(|n| {
                self.out[n]
                    .keys()
                    .filter_map(|s| local.get(s).copied())
                    .collect()
            })
            .collect();
        let comp = tarjan(&adj);
        match (local.get(&w), local.get(&h)) {
            (Some(&a), Some(&b)) => comp[a] == comp[b],
            _ => false,
        }
    }
}

/// Iterative Tarjan: the component number of every node.
fn tarjan(adj: &[Vec<usize>]) -> Vec<usize> {
    const UNSEEN: usize = usize::MAX;
    let n = adj.len();
    let (mut index, mut low, mut on) = (vec![UNSEEN; n], vec![0; n], vec![false; n]);
    let mut comp = vec![UNSEEN; n];
    let (mut stack, mut call) = (Vec::new(), Vec::<(usize, usize)>::new());
    let (mut next, mut comps) = (0, 0);
    for root in 0..n {
        if index[root] != UNSEEN {
            continue;
        }
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on[root] = true;
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
                    on[w] = true;
                    call.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(p, _)) = call.last() {
                    low[p] = low[p].min(low[v]);
                }
                if low[v] == index[v] {
                    while let Some(x) = stack.pop() {
                        on[x] = false;
                        comp[x] = comps;
                        if x == v {
                            break;
                        }
                    }
                    comps += 1;
                }
            }
        }
    }
    comp
}

/// Timings in ns, by kind of edge.
#[derive(Default)]
struct Samples {
    setup: Vec<u64>,
    steady: Vec<u64>,
    cycle: Vec<u64>,
    naive_setup: Vec<u64>,
    naive_steady: Vec<u64>,
    naive_cycle: Vec<u64>,
    removals: Vec<u64>,
    /// Sessions visited by the incremental searches (`last_work`), per kind.
    work_setup: Vec<u64>,
    work_steady: Vec<u64>,
    work_cycle: Vec<u64>,
}

/// The simulated lockd.
struct Sim {
    g: WaitForGraph,
    naive: Naive,
    holder: Vec<Option<u64>>,
    queue: Vec<VecDeque<u64>>,
    held: HashMap<u64, Vec<usize>>,
    waiting: HashMap<u64, usize>,
    next_session: u64,
    rng: StdRng,
    naive_every: u64,
    edges_seen: u64,
    samples: Samples,
    in_setup: bool,
    cycles: u64,
    victims: u64,
    longest_cycle: usize,
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_nanos() as u64)
}

impl Sim {
    /// A new wait edge `w → h`: timed, checked against the naive recompute when sampled,
    /// and any deadlock it closes broken.
    fn wait_edge(&mut self, w: u64, h: u64) {
        let (closed, ns) = timed(|| self.g.add_edge(w, h));
        let work = self.g.last_work() as u64;
        self.naive.add(w, h);
        self.edges_seen += 1;
        let sample_naive = closed.is_some() || self.edges_seen % self.naive_every == 0;
        if sample_naive {
            let (naive, nns) = timed(|| self.naive.same_scc(w, h));
            assert_eq!(
                naive,
                closed.is_some(),
                "naive and incremental disagree on {w} → {h}"
            );
            match (&closed, self.in_setup) {
                (Some(_), _) => self.samples.naive_cycle.push(nns),
                (None, true) => self.samples.naive_setup.push(nns),
                (None, false) => self.samples.naive_steady.push(nns),
            }
        }
        match (&closed, self.in_setup) {
            (Some(c), _) => {
                self.samples.cycle.push(ns);
                self.samples.work_cycle.push(work);
                self.cycles += 1;
                self.longest_cycle = self.longest_cycle.max(c.len());
            }
            (None, true) => {
                self.samples.setup.push(ns);
                self.samples.work_setup.push(work);
            }
            (None, false) => {
                self.samples.steady.push(ns);
                self.samples.work_steady.push(work);
            }
        }
        if closed.is_some() {
            // --break-deadlocks: revoke the youngest (largest id) until w is free.
            while let Some(cycle) = self.g.cycle_through(w) {
                let Some(v) = WaitForGraph::victim(&cycle, |n| u64::MAX - n) else {
                    break;
                };
                let held = self.held.remove(&v).unwrap_or_default();
                if held.is_empty() {
                    break;
                }
                self.victims += 1;
                for r in held {
                    self.hand_over(r);
                }
            }
        }
    }

    fn remove_edge(&mut self, w: u64, h: u64) {
        let (_, ns) = timed(|| self.g.remove_edge(w, h));
        self.samples.removals.push(ns);
        self.naive.remove(w, h);
    }

    /// `s` asks for resource `r`.
    fn acquire(&mut self, s: u64, r: usize) {
        match self.holder[r] {
            None => {
                self.holder[r] = Some(s);
                self.held.entry(s).or_default().push(r);
            }
            Some(h) if h == s => {}
            Some(h) => {
                self.queue[r].push_back(s);
                self.waiting.insert(s, r);
                self.wait_edge(s, h);
            }
        }
    }

    /// Resource `r`'s holder lets it go (already taken out of `held`): the head of the
    /// queue gets it, the other waiters now wait for the new holder.
    fn hand_over(&mut self, r: usize) {
        let Some(old) = self.holder[r].take() else {
            return;
        };
        let waiters: Vec<u64> = self.queue[r].iter().copied().collect();
        for &w in &waiters {
            self.remove_edge(w, old);
        }
        if let Some(next) = self.queue[r].pop_front() {
            self.waiting.remove(&next);
            self.holder[r] = Some(next);
            self.held.entry(next).or_default().push(r);
            for &w in waiters.iter().skip(1) {
                self.wait_edge(w, next);
            }
        }
        self.maybe_end(old);
    }

    /// A session with nothing held or awaited ends; a new one arrives.
    fn maybe_end(&mut self, s: u64) {
        let holds = self.held.get(&s).is_some_and(|v| !v.is_empty());
        if holds || self.waiting.contains_key(&s) {
            return;
        }
        self.held.remove(&s);
        let (_, ns) = timed(|| self.g.remove_node(s));
        self.samples.removals.push(ns);
        self.naive.remove_node(s);
        let fresh = self.next_session;
        self.next_session += 1;
        let r = self.rng.gen_range(0..self.holder.len());
        self.acquire(fresh, r);
    }

    /// A deadlock of `len` holders built on purpose: each asks for a resource of the next,
    /// the last for one of the first's (the last edge closes the cycle, unless the graph
    /// closed one earlier on the way).
    fn plant_cycle(&mut self, len: usize) {
        let mut ring: Vec<(u64, usize)> = Vec::new();
        for _ in 0..len * 20 {
            if ring.len() == len {
                break;
            }
            let r = self.rng.gen_range(0..self.holder.len());
            if let Some(h) = self.holder[r] {
                if !self.waiting.contains_key(&h) && ring.iter().all(|&(x, _)| x != h) {
                    ring.push((h, r));
                }
            }
        }
        for i in 0..ring.len() {
            let (h, _) = ring[i];
            let (next, r) = ring[(i + 1) % ring.len()];
            // Still holding and not waiting (an earlier victim may have lost everything).
            if self.holder[r] == Some(next) && !self.waiting.contains_key(&h) {
                self.acquire(h, r);
            }
        }
    }

    fn event(&mut self, cross: f64) {
        let resources = self.holder.len();
        let r = self.rng.gen_range(0..resources);
        if self.rng.gen_bool(cross) {
            // Hold-and-wait: the holder of r asks for another resource.
            if let Some(h) = self.holder[r] {
                if !self.waiting.contains_key(&h) {
                    let other = self.rng.gen_range(0..resources);
                    if other != r {
                        self.acquire(h, other);
                    }
                }
            }
        } else if self.rng.gen_ratio(1, 10) {
            // A waiter of r gives up.
            if self.queue[r].is_empty() {
                return;
            }
            let k = self.rng.gen_range(0..self.queue[r].len());
            let Some(w) = self.queue[r].remove(k) else {
                return;
            };
            self.waiting.remove(&w);
            if let Some(h) = self.holder[r] {
                self.remove_edge(w, h);
            }
            self.maybe_end(w);
        } else if let Some(h) = self.holder[r] {
            // The holder of r is done with it.
            if let Some(v) = self.held.get_mut(&h) {
                v.retain(|&x| x != r);
            }
            self.hand_over(r);
        }
    }
}

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `median p99 max` in µs of `v` (nearest rank), or dashes.
fn stats(v: &mut [u64]) -> String {
    let us = |x: Option<u64>| x.map_or("-".to_string(), |ns| format!("{:.2}", ns as f64 / 1e3));
    format!(
        "{:>7} {:>9} {:>9} {:>9}",
        v.len(),
        us(percentile_of(v, 50.0)),
        us(percentile_of(v, 99.0)),
        us(percentile_of(v, 100.0))
    )
}

fn ratio(inc: &mut [u64], naive: &mut [u64]) -> String {
    match (percentile_of(inc, 50.0), percentile_of(naive, 50.0)) {
        (Some(a), Some(b)) if a > 0 => format!("{:.0}x", b as f64 / a as f64),
        _ => "-".into(),
    }
}

fn main() {
    let sessions = arg("--sessions", 10_000.0) as u64;
    let resources = (arg("--resources", 1_000.0) as usize).max(2);
    let events = arg("--events", 20_000.0) as u64;
    let cross = arg("--cross", 0.7).clamp(0.0, 1.0);
    let naive_every = (arg("--naive-every", 20.0) as u64).max(1);
    let seed = arg("--seed", 12.0) as u64;
    let planted = arg("--deadlocks", 1_000.0) as u64;

    let mut sim = Sim {
        g: WaitForGraph::new(),
        naive: Naive::default(),
        holder: vec![None; resources],
        queue: vec![VecDeque::new(); resources],
        held: HashMap::new(),
        waiting: HashMap::new(),
        next_session: sessions,
        rng: StdRng::seed_from_u64(seed),
        naive_every,
        edges_seen: 0,
        samples: Samples::default(),
        in_setup: true,
        cycles: 0,
        victims: 0,
        longest_cycle: 0,
    };
    // lockd's scale scenario: one holder per resource, every other session queued.
    for s in 0..sessions {
        let r = if (s as usize) < resources {
            s as usize
        } else {
            sim.rng.gen_range(0..resources)
        };
        sim.acquire(s, r);
    }
    let after_setup = (sim.g.node_count(), sim.g.edge_count());
    sim.in_setup = false;
    let t = Instant::now();
    for _ in 0..events {
        sim.event(cross);
    }
    let steady_s = t.elapsed().as_secs_f64();
    let steady_cycles = sim.cycles;
    // Deadlocks of 2..=50 holders built on purpose, in the same graph, with the same churn
    // between them.
    for k in 0..planted {
        let len = 2 + (k as usize * 7) % 49;
        sim.plant_cycle(len);
        for _ in 0..10 {
            sim.event(cross);
        }
    }
    let s = &mut sim.samples;

    println!(
        "\nwait-for graph: {sessions} sessions, {resources} resources (scale scenario: {} nodes, \
         {} edges after setup), then {events} events ({:.0}% hold-and-wait requests), seed {seed}",
        after_setup.0,
        after_setup.1,
        cross * 100.0
    );
    println!(
        "then {planted} deadlocks of 2..=50 holders built on purpose (10 events between them)\n\
         at the end: {} nodes, {} edges, {} deadlocks; {} cycles closed ({} during the random \
         events; longest {}), {} victims revoked; random events took {:.2} s",
        sim.g.node_count(),
        sim.g.edge_count(),
        sim.g.deadlock_count(),
        sim.cycles,
        steady_cycles,
        sim.longest_cycle,
        sim.victims,
        steady_s
    );
    println!("cost per new wait edge, µs (nearest-rank percentiles; naive = Tarjan from scratch on the whole graph, every {naive_every}th edge and every cycle-closing edge)\n");
    println!(
        "| new wait edge | incremental: n | median | p99 | max | naive: n | median | p99 | max | median ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let row = |name: &str, inc: &mut Vec<u64>, naive: &mut Vec<u64>| {
        let r = ratio(inc, naive);
        let cells = |x: String| x.split_whitespace().collect::<Vec<_>>().join(" | ");
        println!(
            "| {name} | {} | {} | {r} |",
            cells(stats(inc)),
            cells(stats(naive))
        );
    };
    row(
        "no cycle, setup (waiters queue)",
        &mut s.setup,
        &mut s.naive_setup,
    );
    row("no cycle, steady state", &mut s.steady, &mut s.naive_steady);
    row("closes a cycle", &mut s.cycle, &mut s.naive_cycle);
    println!(
        "| removal (edge or session, incl. splits) | {} | - | - | - | - | - |",
        stats(&mut s.removals)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" | ")
    );

    println!("\nsessions visited per new wait edge by the incremental searches (its affected region; the naive recompute visits all {} sessions and {} edges every time)\n", sim.g.node_count(), sim.g.edge_count());
    println!("| new wait edge | n | median | p99 | max | zero (no reordering) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, v) in [
        ("no cycle, setup", &mut s.work_setup),
        ("no cycle, steady state", &mut s.work_steady),
        ("closes a cycle", &mut s.work_cycle),
    ] {
        let zero = v.iter().filter(|&&x| x == 0).count();
        let n = v.len();
        let [p50, p99, max] = [50.0, 99.0, 100.0]
            .map(|p| percentile_of(v, p).map_or("-".into(), |x: u64| x.to_string()));
        println!(
            "| {name} | {n} | {p50} | {p99} | {max} | {:.1}% |",
            100.0 * zero as f64 / n.max(1) as f64
        );
    }

    // One 10,000-cycle: the chain, then its closing edge, both ways.
    let n = 10_000u64;
    let mut g = WaitForGraph::new();
    let mut naive = Naive::default();
    for i in 0..n - 1 {
        g.add_edge(i, i + 1);
        naive.add(i, i + 1);
    }
    let (c, inc_ns) = timed(|| g.add_edge(n - 1, 0));
    naive.add(n - 1, 0);
    let (nv, naive_ns) = timed(|| naive.same_scc(n - 1, 0));
    assert!(nv && c.as_ref().is_some_and(|c| c.len() == n as usize));
    println!(
        "\nclosing a chain of {n} into one {n}-cycle: incremental {:.0} µs (whole chain is the \
         affected region; includes listing the cycle), naive {:.0} µs",
        inc_ns as f64 / 1e3,
        naive_ns as f64 / 1e3
    );
}
