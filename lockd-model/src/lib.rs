//! Model checking of lockd with [stateright](https://docs.rs/stateright), the standard
//! explicit-state checker for Rust state machines: it explores every interleaving of the
//! actions a model allows (breadth- or depth-first, with state deduplication) and returns
//! the path to any state that breaks a property.
//!
//! * [`core_model`]: lockd's pure core ([`lockd::core::Core`]) itself, every lease kind,
//!   persistence acknowledgements, crashes and restarts, checked for safety and bounded
//!   liveness; with planted bugs in the model's driver that the checker must catch.
//! * [`qurd_model`]: the QURD protocol (independent per-resource agents, jobs that need k
//!   resources, message loss, client and resource crashes) with three strategies, answering
//!   "do all jobs complete, can they deadlock, can they livelock" as a table
//!   (`cargo run -p lockd-model --example qurd_table` writes `docs/qurd-model.md`).

pub mod core_model;
pub mod qurd_model;

use std::time::{Duration, Instant};

use stateright::{Checker, Model};

/// A path: each state with the action that leaves it (none for the last).
pub type PathOf<S, A> = Vec<(S, Option<A>)>;

/// What one bounded run of the checker found.
#[derive(Debug)]
pub struct RunReport<S, A> {
    /// States generated, repeats included.
    pub states: usize,
    /// Distinct states.
    pub unique: usize,
    /// Deepest path explored.
    pub depth: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Discoveries by property name: a counterexample for `always`, an example for
    /// `sometimes`.
    pub discoveries: Vec<(&'static str, PathOf<S, A>)>,
}

impl<S, A> RunReport<S, A> {
    /// The path found for this property, if any.
    pub fn discovery(&self, name: &str) -> Option<&[(S, Option<A>)]> {
        self.discoveries
            .iter()
            .find(|d| d.0 == name)
            .map(|d| d.1.as_slice())
    }

    /// Names of the discoveries.
    pub fn names(&self) -> Vec<&'static str> {
        self.discoveries.iter().map(|d| d.0).collect()
    }
}

/// Breadth-first search of `model` up to `depth` actions deep on `threads` threads; with
/// `until`, stop as soon as that property has a discovery.
pub fn check_bfs<M>(
    model: M,
    depth: usize,
    threads: usize,
    until: Option<&'static str>,
) -> RunReport<M::State, M::Action>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + std::fmt::Debug + std::hash::Hash + Eq + Send + Sync + 'static,
    M::Action: Clone + std::fmt::Debug + PartialEq + Send + Sync + 'static,
{
    let start = Instant::now();
    let mut builder = model.checker().threads(threads).target_max_depth(depth);
    if let Some(p) = until {
        builder = builder.finish_when(stateright::HasDiscoveries::AnyOf([p].into()));
    }
    let checker = builder.spawn_bfs().join();
    let mut discoveries: Vec<_> = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, path.into_vec()))
        .collect();
    discoveries.sort_by_key(|d| d.0);
    RunReport {
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        depth: checker.max_depth(),
        elapsed: start.elapsed(),
        discoveries,
    }
}
