//! Prometheus text-format metrics (hand-rolled: a handful of counters and histograms does not
//! justify a registry dependency).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::{Phase, Status};

/// Histogram bucket upper bounds in seconds (failover work spans ms to minutes).
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A fixed-bucket histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    /// (per-bucket counts, not cumulative; sum of observations in seconds; count).
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    /// Record one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.is_empty() {
            g.0 = vec![0; BUCKETS.len()];
        }
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            g.0[i] += 1;
        }
        g.1 += secs;
        g.2 += 1;
    }

    /// Number of observations so far.
    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).2
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0u64;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += g.0.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", g.2);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", g.1);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", g.2);
    }
}

/// All supervisor metrics; labels `engine_id` and `role` on every series.
#[derive(Debug)]
pub struct Metrics {
    /// Pre-rendered `engine_id="..",role=".."` label pair.
    labels: String,
    /// Transitions into each phase (indexed by [`Phase::index`]).
    transitions: [AtomicU64; 5],
    /// Time spent in Waking (the engine's part of a failover).
    pub waking_seconds: Histogram,
    /// Time from lock grant to Active (waking plus supervisor overhead).
    pub grant_to_active_seconds: Histogram,
    /// Time to kill and reap the engine's whole process tree.
    pub fencing_seconds: Histogram,
    /// Engine restarts: starts recorded in `--restart-counter` before this one (0 without it).
    pub engine_restarts: AtomicU64,
    /// Failed background health checks.
    pub health_check_failures: AtomicU64,
    /// Lock connection breaks seen (reconnects attempted by the client).
    pub lock_disconnects: AtomicU64,
    /// Lock epoch of the current grant (0 = none).
    pub lock_epoch: AtomicU64,
    /// Before-wake GPU/GMS checks run (`--gms`/`--gpu`): how often a wake was gated.
    pub gpu_wake_checks: AtomicU64,
    /// Before-wake checks that failed (each kept an engine from waking into a hang or OOM).
    pub gpu_wake_check_failures: AtomicU64,
    /// After-reap memory-release checks run.
    pub gpu_reap_checks: AtomicU64,
    /// After-reap checks that timed out (memory still pinned when the lock was released).
    pub gpu_reap_timeouts: AtomicU64,
    /// Dead engines' processes still listed on the device when the reap check started.
    pub gpu_engine_processes_seen: AtomicU64,
}

impl Metrics {
    /// New registry for one engine.
    pub fn new(engine_id: u32, role: &str) -> Metrics {
        let role: String = role
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        Metrics {
            labels: format!("engine_id=\"{engine_id}\",role=\"{role}\""),
            transitions: Default::default(),
            waking_seconds: Histogram::default(),
            grant_to_active_seconds: Histogram::default(),
            fencing_seconds: Histogram::default(),
            engine_restarts: AtomicU64::new(0),
            health_check_failures: AtomicU64::new(0),
            lock_disconnects: AtomicU64::new(0),
            lock_epoch: AtomicU64::new(0),
            gpu_wake_checks: AtomicU64::new(0),
            gpu_wake_check_failures: AtomicU64::new(0),
            gpu_reap_checks: AtomicU64::new(0),
            gpu_reap_timeouts: AtomicU64::new(0),
            gpu_engine_processes_seen: AtomicU64::new(0),
        }
    }

    /// Count a transition into `to`.
    pub fn transition(&self, to: Phase) {
        self.transitions[to.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Transitions into `to` so far.
    pub fn transitions_into(&self, to: Phase) -> u64 {
        self.transitions[to.index()].load(Ordering::Relaxed)
    }

    /// Render everything in Prometheus text format (0.0.4).
    pub fn render(&self, status: &Status) -> String {
        let l = &self.labels;
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP supervisor_state Current lifecycle phase (1 for the current one).\n# TYPE supervisor_state gauge"
        );
        for p in Phase::ALL {
            let v = u8::from(p == status.phase);
            let _ = writeln!(out, "supervisor_state{{{l},state=\"{p}\"}} {v}");
        }
        let _ = writeln!(
            out,
            "# HELP supervisor_transitions_total Transitions into each phase.\n# TYPE supervisor_transitions_total counter"
        );
        for p in Phase::ALL {
            let v = self.transitions_into(p);
            let _ = writeln!(out, "supervisor_transitions_total{{{l},to=\"{p}\"}} {v}");
        }
        self.waking_seconds.render(
            &mut out,
            "supervisor_waking_seconds",
            "Time spent in Waking.",
            l,
        );
        self.grant_to_active_seconds.render(
            &mut out,
            "supervisor_grant_to_active_seconds",
            "Time from lock grant to Active.",
            l,
        );
        self.fencing_seconds.render(
            &mut out,
            "supervisor_fencing_seconds",
            "Time to kill and reap the engine's process tree.",
            l,
        );
        let gauges: [(&str, &str, &str, u64); 10] = [
            (
                "supervisor_engine_restarts_total",
                "counter",
                "Engine starts before this one (from --restart-counter).",
                self.engine_restarts.load(Ordering::Relaxed),
            ),
            (
                "supervisor_health_check_failures_total",
                "counter",
                "Failed background health checks.",
                self.health_check_failures.load(Ordering::Relaxed),
            ),
            (
                "supervisor_lock_disconnects_total",
                "counter",
                "Lock connection breaks.",
                self.lock_disconnects.load(Ordering::Relaxed),
            ),
            (
                "supervisor_lock_epoch",
                "gauge",
                "Epoch of the current lock grant (0 = none).",
                self.lock_epoch.load(Ordering::Relaxed),
            ),
            (
                "supervisor_engine_healthy",
                "gauge",
                "Last background health check result.",
                u64::from(status.engine_healthy),
            ),
            (
                "supervisor_gpu_wake_checks_total",
                "counter",
                "Before-wake GPU/GMS checks run.",
                self.gpu_wake_checks.load(Ordering::Relaxed),
            ),
            (
                "supervisor_gpu_wake_check_failures_total",
                "counter",
                "Before-wake GPU/GMS checks failed (engine not woken).",
                self.gpu_wake_check_failures.load(Ordering::Relaxed),
            ),
            (
                "supervisor_gpu_reap_checks_total",
                "counter",
                "After-reap GPU memory-release checks run.",
                self.gpu_reap_checks.load(Ordering::Relaxed),
            ),
            (
                "supervisor_gpu_reap_timeouts_total",
                "counter",
                "After-reap checks timed out (lock released with memory still pinned).",
                self.gpu_reap_timeouts.load(Ordering::Relaxed),
            ),
            (
                "supervisor_gpu_engine_processes_seen_total",
                "counter",
                "Dead engines' processes still on the device when the reap check started.",
                self.gpu_engine_processes_seen.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{l}}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP supervisor_lock_connected Lock connection up.\n# TYPE supervisor_lock_connected gauge\nsupervisor_lock_connected{{{l}}} {}",
            u8::from(status.lock_connected)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labelled_series() {
        let m = Metrics::new(1, "shadow");
        m.transition(Phase::Standby);
        m.waking_seconds.observe(Duration::from_millis(30));
        let mut st = Status::new(1, "shadow");
        st.phase = Phase::Standby;
        let text = m.render(&st);
        assert!(
            text.contains("supervisor_state{engine_id=\"1\",role=\"shadow\",state=\"standby\"} 1")
        );
        assert!(
            text.contains("supervisor_state{engine_id=\"1\",role=\"shadow\",state=\"active\"} 0")
        );
        assert!(text.contains(
            "supervisor_transitions_total{engine_id=\"1\",role=\"shadow\",to=\"standby\"} 1"
        ));
        assert!(text.contains(
            "supervisor_waking_seconds_bucket{engine_id=\"1\",role=\"shadow\",le=\"0.05\"} 1"
        ));
        assert!(text.contains(
            "supervisor_waking_seconds_bucket{engine_id=\"1\",role=\"shadow\",le=\"0.025\"} 0"
        ));
        assert!(text.contains("supervisor_waking_seconds_count{engine_id=\"1\",role=\"shadow\"} 1"));
        assert!(
            text.contains("supervisor_engine_restarts_total{engine_id=\"1\",role=\"shadow\"} 0")
        );
    }

    #[test]
    fn role_label_is_sanitised() {
        let m = Metrics::new(0, "pri\"mary\n");
        let st = Status::new(0, "x");
        assert!(m.render(&st).contains("role=\"primary\""));
    }
}
