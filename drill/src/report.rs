//! Round records, per-kind statistics, the summary table and the JSON report.
//! Pure: rendering only, the caller writes the files.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::invariants::{Phases, Violation};
use crate::schedule::{FailureKind, Order};

/// What one round did and measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// 1-based round number.
    pub round: u32,
    /// The failure injected.
    pub kind: FailureKind,
    /// The engine that was Active when the failure was injected.
    pub victim_engine_id: Option<u64>,
    /// Which life (restart count) of that engine.
    #[serde(default)]
    pub victim_incarnation: Option<u32>,
    /// The engine Active at the end of the round.
    pub new_active_engine_id: Option<u64>,
    /// Which life of that engine.
    #[serde(default)]
    pub new_active_incarnation: Option<u32>,
    /// When the failure was injected, microseconds since the epoch.
    pub t_kill_unix_us: u64,
    /// Failover time by phase (a lockd crash has none: see `recovery_us`).
    pub phases: Phases,
    /// Lockd crash only: kill until the Active side held its lease again.
    pub recovery_us: Option<u64>,
    /// Lease epoch before the round.
    pub epoch_before: Option<u64>,
    /// Lease epoch of the Active side after the round.
    pub epoch_after: Option<u64>,
    /// Invariants broken in this round.
    pub violations: Vec<Violation>,
    /// Finer breakdown from the supervisors' `/state` marks, microseconds after the kill:
    /// `old.engine_exit_detected`, `old.fenced`, `old.lock_closed`, `new.lock_granted`, ...;
    /// and `watch.granted.N` / `watch.reclaimed.N`: when the drill read the Nth grant of the
    /// round from `lockd watch`.
    #[serde(default)]
    pub marks_after_kill_us: std::collections::BTreeMap<String, u64>,
    /// Things worth knowing that are not violations (setup problems, survivors).
    pub notes: Vec<String>,
    /// The fencing check at the round's new grant: how many processes of the previous
    /// holder's engine (lingering workers included) were checked when `lockd watch` reported
    /// the grant. 0 (or absent in a failover round) means the check saw nothing to check.
    #[serde(default)]
    pub fence_pids_checked: Option<usize>,
    /// Of those, how many were alive (each one is a `fenced-process-alive-at-grant`).
    #[serde(default)]
    pub fence_pids_alive: Option<usize>,
    /// Compound rounds: how the two failures were injected.
    #[serde(default)]
    pub compound: Option<CompoundRecord>,
    /// Wall time of the round, from the end of the previous one (setting up included),
    /// microseconds: where soak time goes.
    #[serde(default)]
    pub round_wall_us: Option<u64>,
}

/// How a compound round injected its two failures.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CompoundRecord {
    /// When lockd was SIGKILLed, relative to `t_kill_unix_us` (negative: before), microseconds.
    #[serde(default)]
    pub lockd_killed_rel_us: Option<i64>,
    /// When lockd's socket answered again after its restart, relative to `t_kill_unix_us`.
    #[serde(default)]
    pub lockd_back_rel_us: Option<i64>,
    /// The seeded delay before the second failure, microseconds (`lockd-crash-then-
    /// supervisor-kill`: after the reclaim was seen; `double-kill`: after the engine kill).
    #[serde(default)]
    pub delay_us: Option<u64>,
    /// `revoke-during-reconnect`: the revoke was sent before the Active side's reclaim was
    /// answered (its `lock_reclaimed` mark came after the revoke, or never).
    #[serde(default)]
    pub revoked_before_reclaim: Option<bool>,
    /// `lockd revoke` succeeded.
    #[serde(default)]
    pub revoke_ok: Option<bool>,
    /// The engine whose lease had to survive the lockd crash (reclaimed it): the Active side,
    /// or for `lockd-crash-during-wake` the waker.
    #[serde(default)]
    pub reclaimer_engine_id: Option<u64>,
    /// Its lease was reclaimed.
    #[serde(default)]
    pub reclaimed: Option<bool>,
    /// The victim's engine was started with `--worker-linger`.
    #[serde(default)]
    pub victim_workers_linger: bool,
}

impl RoundRecord {
    /// The number a round contributes to its kind's statistics: the failover time, or for a
    /// lockd crash the time to recover the lease.
    pub fn headline_us(&self) -> Option<u64> {
        if self.kind.expects_failover() {
            self.phases.total_us
        } else {
            self.recovery_us
        }
    }

    /// One plain line for logs and non-terminal output.
    pub fn line(&self, total_rounds: u32) -> String {
        let ms = |v: Option<u64>| {
            v.map_or_else(
                || "-".to_string(),
                |u| format!("{:.0}ms", u as f64 / 1000.0),
            )
        };
        let id = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |x| x.to_string());
        let eng = |e: Option<u64>, n: Option<u32>| match n {
            Some(n) => format!("{}.{n}", id(e)),
            None => id(e),
        };
        let mut s = format!(
            "round {}/{} {:<15} ",
            self.round,
            total_rounds,
            self.kind.name()
        );
        if self.kind.expects_failover() {
            let _ = write!(
                s,
                "engine {} -> {} failover {} (detect {}, grant {}, wake {})",
                eng(self.victim_engine_id, self.victim_incarnation),
                eng(self.new_active_engine_id, self.new_active_incarnation),
                ms(self.phases.total_us),
                ms(self.phases.detect_us),
                ms(self.phases.grant_us),
                ms(self.phases.wake_us)
            );
        } else {
            let _ = write!(
                s,
                "engine {} stayed Active, lease back after {}",
                eng(self.victim_engine_id, self.victim_incarnation),
                ms(self.recovery_us)
            );
        }
        let _ = write!(
            s,
            " epoch {}->{}",
            id(self.epoch_before),
            id(self.epoch_after)
        );
        if self.violations.is_empty() {
            s.push_str(" ok");
        } else {
            let _ = write!(s, " VIOLATIONS: ");
            let v: Vec<String> = self.violations.iter().map(|v| v.to_string()).collect();
            s.push_str(&v.join("; "));
        }
        if !self.notes.is_empty() {
            let _ = write!(s, " (notes: {})", self.notes.join("; "));
        }
        s
    }
}

/// Statistics of one failure kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindSummary {
    /// The kind.
    pub kind: FailureKind,
    /// Rounds of this kind.
    pub count: usize,
    /// Rounds that produced a time (failed rounds may not).
    pub measured: usize,
    /// Median failover (or lease recovery) time, milliseconds.
    pub median_ms: Option<f64>,
    /// 99th percentile (nearest rank), milliseconds.
    pub p99_ms: Option<f64>,
    /// Maximum, milliseconds.
    pub max_ms: Option<f64>,
    /// Median of each phase, milliseconds: detect, grant, wake.
    pub median_phase_ms: [Option<f64>; 3],
    /// Invariant violations in rounds of this kind.
    pub violations: usize,
}

/// Median of a sample (mean of the two middle values for an even count).
pub fn median(v: &[u64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2] as f64
    } else {
        (s[n / 2 - 1] as f64 + s[n / 2] as f64) / 2.0
    })
}

/// Per-kind statistics, in the order of `FailureKind::EVERY`, kinds without rounds left out.
pub fn summarize(rounds: &[RoundRecord]) -> Vec<KindSummary> {
    let mut by: BTreeMap<FailureKind, Vec<&RoundRecord>> = BTreeMap::new();
    for r in rounds {
        by.entry(r.kind).or_default().push(r);
    }
    FailureKind::EVERY
        .iter()
        .filter_map(|k| by.get(k).map(|rs| (*k, rs)))
        .map(|(kind, rs)| {
            let times: Vec<u64> = rs.iter().filter_map(|r| r.headline_us()).collect();
            let ms = |u: f64| u / 1000.0;
            let phase = |f: fn(&Phases) -> Option<u64>| {
                let v: Vec<u64> = rs.iter().filter_map(|r| f(&r.phases)).collect();
                median(&v).map(ms)
            };
            KindSummary {
                kind,
                count: rs.len(),
                measured: times.len(),
                median_ms: median(&times).map(ms),
                p99_ms: harness::stats::percentile_of(&mut times.clone(), 99.0)
                    .map(|u| ms(u as f64)),
                max_ms: times.iter().max().map(|u| ms(*u as f64)),
                median_phase_ms: [
                    phase(|p| p.detect_us),
                    phase(|p| p.grant_us),
                    phase(|p| p.wake_us),
                ],
                violations: rs.iter().map(|r| r.violations.len()).sum(),
            }
        })
        .collect()
}

/// The summary table printed at the end of a drill.
pub fn summary_table(sums: &[KindSummary]) -> String {
    let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.1}"));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<32} {:>5} {:>11} {:>9} {:>9} {:>10} {:>9} {:>9} {:>10}",
        "kind",
        "count",
        "median_ms",
        "p99_ms",
        "max_ms",
        "detect_ms",
        "grant_ms",
        "wake_ms",
        "violations"
    );
    for k in sums {
        let _ = writeln!(
            s,
            "{:<32} {:>5} {:>11} {:>9} {:>9} {:>10} {:>9} {:>9} {:>10}",
            k.kind.name(),
            k.count,
            f(k.median_ms),
            f(k.p99_ms),
            f(k.max_ms),
            f(k.median_phase_ms[0]),
            f(k.median_phase_ms[1]),
            f(k.median_phase_ms[2]),
            k.violations
        );
    }
    let total: usize = sums.iter().map(|k| k.violations).sum();
    let rounds: usize = sums.iter().map(|k| k.count).sum();
    let _ = writeln!(s, "{rounds} rounds, {total} invariant violations");
    if sums.iter().any(|k| k.kind == FailureKind::LockdCrash) {
        let _ = writeln!(
            s,
            "(lockd-crash: no failover is expected; its times are kill -> lease reclaimed by the same Active side)"
        );
    }
    s
}

/// Rounds per minute over a wall time (None for no time).
pub fn rounds_per_minute(rounds: usize, elapsed_us: u64) -> Option<f64> {
    (elapsed_us > 0).then(|| rounds as f64 * 60e6 / elapsed_us as f64)
}

/// The JSON report (`--report`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Bumped when the layout changes incompatibly.
    pub report_version: u32,
    /// Rounds asked for.
    pub iterations: u32,
    /// Rounds completed (fewer when interrupted or aborted).
    pub completed_rounds: u32,
    /// The kinds drilled.
    pub kinds: Vec<FailureKind>,
    /// How rounds picked their kind.
    pub order: Order,
    /// The seed of the random order (reproduces the schedule).
    pub seed: u64,
    /// The engine drilled: "fake-engine" or the --engine-cmd.
    pub engine: String,
    /// The adapter the supervisors used.
    pub adapter: String,
    /// Failover bound, milliseconds.
    pub failover_bound_ms: u64,
    /// True when the test-only early-release bug was switched on.
    pub planted_bug: bool,
    /// Wall-clock start, microseconds.
    pub started_unix_us: u64,
    /// Wall-clock end, microseconds.
    pub finished_unix_us: u64,
    /// Per-kind statistics.
    pub summary: Vec<KindSummary>,
    /// Total invariant violations.
    pub total_violations: usize,
    /// Why the drill stopped early, if it did.
    pub aborted: Option<String>,
    /// The process exit code.
    pub exit_code: i32,
    /// Every round.
    pub rounds: Vec<RoundRecord>,
    /// `--load`: CPU-bound busy loops run beside the drill.
    #[serde(default)]
    pub load: u32,
    /// `--worker-linger` given to the victims of compound rounds, milliseconds.
    #[serde(default)]
    pub worker_linger_ms: u64,
    /// lockd's `--reconnect-window`, milliseconds.
    #[serde(default)]
    pub reconnect_window_ms: u64,
    /// `--gpu-sim`: the supervisors ran their GPU checks on a simulated device.
    #[serde(default)]
    pub gpu_sim: bool,
    /// `--stop-on-violation`.
    #[serde(default)]
    pub stop_on_violation: bool,
    /// Completed rounds per minute of wall time (setup and teardown of the drill excluded).
    #[serde(default)]
    pub rounds_per_minute: Option<f64>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rec(
        round: u32,
        kind: FailureKind,
        total_ms: u64,
        violations: usize,
    ) -> RoundRecord {
        let t = total_ms * 1000;
        RoundRecord {
            round,
            kind,
            victim_engine_id: Some(0),
            victim_incarnation: Some(2),
            new_active_engine_id: Some(1),
            new_active_incarnation: None,
            t_kill_unix_us: 1,
            phases: if kind.expects_failover() {
                Phases {
                    detect_us: Some(t / 10),
                    grant_us: Some(t / 5),
                    wake_us: Some(t - t / 10 - t / 5),
                    total_us: Some(t),
                }
            } else {
                Phases::default()
            },
            recovery_us: if kind.expects_failover() {
                None
            } else {
                Some(t)
            },
            epoch_before: Some(1),
            epoch_after: Some(2),
            violations: (0..violations)
                .map(|_| Violation::LeaseNotReclaimed)
                .collect(),
            marks_after_kill_us: Default::default(),
            notes: vec![],
            fence_pids_checked: None,
            fence_pids_alive: None,
            compound: None,
            round_wall_us: None,
        }
    }

    #[test]
    fn median_and_nearest_rank_percentile() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[5]), Some(5.0));
        assert_eq!(median(&[4, 1, 3, 2]), Some(2.5));
        let v: Vec<u64> = (1..=100).collect();
        // The report's p99 is harness::stats' nearest rank: the drill's own definition before
        // it moved there gave these same values.
        let p = |v: &[u64], q| harness::stats::percentile_of(&mut v.to_vec(), q);
        assert_eq!(p(&v, 99.0), Some(99));
        assert_eq!(p(&v, 100.0), Some(100));
        assert_eq!(p(&[7, 3], 99.0), Some(7));
        assert_eq!(p(&[7], 0.0), Some(7));
        assert_eq!(p(&[], 50.0), None);
    }

    #[test]
    fn summary_groups_by_kind_and_counts_violations() {
        let rounds = vec![
            rec(1, FailureKind::EngineKill, 100, 0),
            rec(2, FailureKind::Revoke, 300, 1),
            rec(3, FailureKind::EngineKill, 200, 0),
            rec(4, FailureKind::LockdCrash, 50, 0),
        ];
        let s = summarize(&rounds);
        assert_eq!(
            s.iter().map(|k| k.kind).collect::<Vec<_>>(),
            vec![
                FailureKind::EngineKill,
                FailureKind::LockdCrash,
                FailureKind::Revoke
            ]
        );
        assert_eq!(s[0].count, 2);
        assert_eq!(s[0].median_ms, Some(150.0));
        assert_eq!(s[0].p99_ms, Some(200.0));
        assert_eq!(s[0].max_ms, Some(200.0));
        assert_eq!(s[0].median_phase_ms[0], Some(15.0));
        assert_eq!(s[1].median_ms, Some(50.0));
        assert_eq!(s[1].median_phase_ms, [None, None, None]);
        assert_eq!(s[2].violations, 1);
        let table = summary_table(&s);
        assert!(table.contains("engine-kill"), "{table}");
        assert!(
            table.contains("4 rounds, 1 invariant violations"),
            "{table}"
        );
        assert!(table.lines().nth(1).unwrap().contains("150.0"), "{table}");
    }

    #[test]
    fn round_lines_name_violations() {
        let ok = rec(1, FailureKind::EngineKill, 120, 0).line(10);
        assert!(ok.starts_with("round 1/10 engine-kill"), "{ok}");
        assert!(
            ok.contains("engine 0.2 -> 1 failover 120ms") && ok.ends_with(" ok"),
            "{ok}"
        );
        let mut noted = rec(3, FailureKind::Revoke, 10, 0);
        noted.notes.push("something odd".into());
        assert!(
            noted.line(10).ends_with("ok (notes: something odd)"),
            "{}",
            noted.line(10)
        );
        let bad = rec(2, FailureKind::LockdCrash, 40, 1).line(10);
        assert!(
            bad.contains("stayed Active") && bad.contains("VIOLATIONS"),
            "{bad}"
        );
    }

    #[test]
    fn report_round_trips_through_json() {
        let rounds = vec![rec(1, FailureKind::HungWake, 2500, 0)];
        let r = Report {
            report_version: 1,
            iterations: 1,
            completed_rounds: 1,
            kinds: vec![FailureKind::HungWake],
            order: Order::Random,
            seed: 7,
            engine: "fake-engine".into(),
            adapter: "vllm".into(),
            failover_bound_ms: 10_000,
            planted_bug: false,
            started_unix_us: 1,
            finished_unix_us: 2,
            summary: summarize(&rounds),
            total_violations: 0,
            aborted: None,
            exit_code: 0,
            rounds,
            load: 3,
            worker_linger_ms: 300,
            reconnect_window_ms: 1000,
            gpu_sim: false,
            stop_on_violation: false,
            rounds_per_minute: Some(120.0),
        };
        let s = serde_json::to_string_pretty(&r).unwrap();
        assert!(s.contains("\"kind\": \"hung-wake\""), "{s}");
        assert!(s.contains("\"order\": \"random\""), "{s}");
        let back: Report = serde_json::from_str(&s).unwrap();
        assert_eq!(back, r);
        // A report written before the compound kinds (no new fields) still reads.
        let mut v: serde_json::Value = serde_json::from_str(&s).unwrap();
        for k in [
            "load",
            "worker_linger_ms",
            "reconnect_window_ms",
            "gpu_sim",
            "stop_on_violation",
            "rounds_per_minute",
        ] {
            v.as_object_mut().unwrap().remove(k);
        }
        v["rounds"][0].as_object_mut().unwrap().remove("compound");
        let old: Report = serde_json::from_value(v).unwrap();
        assert_eq!(old.load, 0);
        assert_eq!(rounds_per_minute(30, 60_000_000), Some(30.0));
        assert_eq!(rounds_per_minute(3, 0), None);
    }

    #[test]
    fn compound_kinds_are_summarized() {
        let rounds = vec![
            rec(1, FailureKind::DoubleKill, 10, 0),
            rec(2, FailureKind::LockdCrashThenSupervisorKill, 30, 2),
        ];
        let s = summarize(&rounds);
        assert_eq!(
            s.iter().map(|k| k.kind).collect::<Vec<_>>(),
            vec![
                FailureKind::LockdCrashThenSupervisorKill,
                FailureKind::DoubleKill
            ]
        );
        let t = summary_table(&s);
        assert!(t.contains("lockd-crash-then-supervisor-kill"), "{t}");
        assert!(t.contains("2 rounds, 2 invariant violations"), "{t}");
    }
}
