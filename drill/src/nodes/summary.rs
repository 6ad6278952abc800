//! The report of a drill across nodes: every trial, and per kind the failover times and the
//! fence margins (median, p99 by nearest rank, the harness's one percentile definition).

use serde::{Deserialize, Serialize};

use super::chaos::Chaos;
use super::judge::Trial;

/// Per-kind figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindSummary {
    /// The kind.
    pub kind: Chaos,
    /// Trials run.
    pub trials: usize,
    /// Trials with at least one violation.
    pub failed: usize,
    /// Failover (injection → other node's grant), ms: median, p99, max.
    pub failover_ms: Option<[f64; 3]>,
    /// Fence margin (old engine dead → first possible grant), ms: min, median, max.
    pub margin_ms: Option<[f64; 3]>,
}

/// The whole report (`--report FILE` writes it as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// etcd lease TTL of the lockds, ms.
    pub ttl_ms: u64,
    /// Every trial.
    pub trials: Vec<Trial>,
    /// Per kind, in [`Chaos::ALL`] order.
    pub kinds: Vec<KindSummary>,
}

impl Report {
    /// Builds the per-kind summaries.
    pub fn new(ttl_ms: u64, trials: Vec<Trial>) -> Report {
        let kinds = Chaos::ALL
            .iter()
            .filter_map(|k| summarize(*k, &trials))
            .collect();
        Report {
            ttl_ms,
            trials,
            kinds,
        }
    }

    /// Violations over all trials.
    pub fn violations(&self) -> usize {
        self.trials.iter().map(|t| t.violations.len()).sum()
    }

    /// Trials that began with a cascade (see [`Trial::notes`]).
    pub fn cascades(&self) -> usize {
        self.trials
            .iter()
            .filter(|t| t.notes.iter().any(|n| n.starts_with("cascade")))
            .count()
    }

    /// The table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<16} {:>6} {:>6}  {:>26}  {:>28}\n",
            "kind", "trials", "failed", "failover ms (med/p99/max)", "margin ms (min/med/max)"
        );
        let f = |v: Option<[f64; 3]>| {
            v.map_or("-".to_string(), |[a, b, c]| {
                format!("{a:.0} / {b:.0} / {c:.0}")
            })
        };
        for k in &self.kinds {
            s.push_str(&format!(
                "{:<16} {:>6} {:>6}  {:>26}  {:>28}\n",
                k.kind.as_str(),
                k.trials,
                k.failed,
                f(k.failover_ms),
                f(k.margin_ms)
            ));
        }
        s
    }
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn summarize(kind: Chaos, trials: &[Trial]) -> Option<KindSummary> {
    let mine: Vec<&Trial> = trials.iter().filter(|t| t.kind == kind).collect();
    if mine.is_empty() {
        return None;
    }
    let fo = sorted(mine.iter().filter_map(|t| t.failover_ms).collect());
    let mg = sorted(mine.iter().filter_map(|t| t.margin_ms).collect());
    let p = |v: &[f64], q: f64| harness::stats::percentile(v, q);
    Some(KindSummary {
        kind,
        trials: mine.len(),
        failed: mine.iter().filter(|t| !t.violations.is_empty()).count(),
        failover_ms: (!fo.is_empty())
            .then(|| [p(&fo, 50.0), p(&fo, 99.0), fo.last().copied()])
            .and_then(|[a, b, c]| Some([a?, b?, c?])),
        margin_ms: (!mg.is_empty())
            .then(|| [mg.first().copied(), p(&mg, 50.0), mg.last().copied()])
            .and_then(|[a, b, c]| Some([a?, b?, c?])),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::judge::{judge, Limits, Observed};

    #[test]
    fn per_kind_figures_from_the_trials() {
        let t = |round, dead: u64, grant: u64| {
            judge(
                round,
                Chaos::Partition,
                0,
                Observed {
                    injected_us: 0,
                    engine_dead_us: Some(dead),
                    granted_us: Some(grant),
                    ..Observed::default()
                },
                &Limits::new(2000.0, 10_000, 500.0, false),
            )
        };
        let r = Report::new(
            2000,
            vec![t(0, 1_000_000, 2_000_000), t(1, 1_000_000, 2_500_000)],
        );
        assert_eq!(r.kinds.len(), 1);
        let k = &r.kinds[0];
        assert_eq!(k.failover_ms, Some([2000.0, 2500.0, 2500.0]));
        assert_eq!(k.margin_ms, Some([1000.0, 1000.0, 1500.0]));
        assert_eq!(r.violations(), 0);
        assert!(r.table().contains("partition"));
    }
}
