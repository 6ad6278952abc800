//! The supervisor's metrics: a `prometheus-client` [`Registry`] whose every series carries the
//! `engine_id` and `role` labels, rendered in the OpenMetrics text format.
//!
//! The exposed series names are the ones the dashboards query (`deploy/dashboards`); they are
//! spelled out in full here (counters with their `_total`, which `prometheus-client` appends
//! itself, so it is stripped before registering).
//!
//! The same registry also carries NVIDIA Dynamo's failover series
//! (`dynamo_component_engine_failover_*`, [`crate::dynamo`]), so that dashboards written for
//! Dynamo's shadow-engine failover work unchanged.

use std::borrow::Cow;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram;
use prometheus_client::registry::{Metric, Registry};

use crate::dynamo::DynamoFailover;
use crate::{unix_us_now, Phase, Status};

/// `Content-Type` of [`Metrics::render`]'s output (OpenMetrics text, as `prometheus-client`
/// encodes it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Histogram bucket upper bounds in seconds (failover work spans ms to minutes).
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The outcomes of an `--init-min-free-memory` wait (`supervisor_init_memory_waits_total`):
/// the memory was free at once, came free while waiting, never came free in time, or the
/// supervisor was asked to stop.
pub const INIT_MEMORY_OUTCOMES: [&str; 4] = ["ready", "freed", "timeout", "stopped"];

/// A fixed-bucket histogram of durations (seconds), registered in a [`Metrics`] registry.
#[derive(Debug)]
pub struct Histogram {
    /// The registered histogram (shares its buckets with the registry's copy).
    inner: histogram::Histogram,
    /// Observations so far (the registry's histogram does not tell).
    count: AtomicU64,
}

impl Histogram {
    fn new() -> Histogram {
        Histogram {
            inner: histogram::Histogram::new(BUCKETS),
            count: AtomicU64::new(0),
        }
    }

    /// Record one observation.
    pub fn observe(&self, d: Duration) {
        self.inner.observe(d.as_secs_f64());
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Number of observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// A registered counter that reads and writes as the `AtomicU64` holding its value
/// (`fetch_add` to count, `store` to copy a count kept elsewhere).
#[derive(Debug, Clone, Default)]
pub struct AtomicCounter(Counter<u64, AtomicU64>);

impl Deref for AtomicCounter {
    type Target = AtomicU64;
    fn deref(&self) -> &AtomicU64 {
        self.0.inner()
    }
}

/// A registered gauge that reads and writes as the `AtomicU64` holding its value.
#[derive(Debug, Clone, Default)]
pub struct AtomicGauge(Gauge<u64, AtomicU64>);

impl Deref for AtomicGauge {
    type Target = AtomicU64;
    fn deref(&self) -> &AtomicU64 {
        self.0.inner()
    }
}

/// Labels of `supervisor_state`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    /// The phase ([`Phase::as_str`]).
    state: &'static str,
}

/// Labels of `supervisor_transitions_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToLabels {
    /// The phase entered ([`Phase::as_str`]).
    to: &'static str,
}

/// Labels of `supervisor_restarts_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    /// Why the previous incarnation ended (the supervisor's `DeadReason` kind).
    reason: String,
}

/// Labels of `supervisor_init_memory_waits_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    /// How the wait ended: `ready`, `freed`, `timeout`, `stopped`.
    outcome: &'static str,
}

/// All supervisor metrics; labels `engine_id` and `role` on every series.
#[derive(Debug)]
pub struct Metrics {
    /// Everything below, registered; `engine_id` and `role` are its constant labels.
    registry: Registry,
    /// Serialises renders (each sets the status gauges, then encodes).
    render_lock: Mutex<()>,
    /// 1 for the current phase, 0 for the others (set from [`Status`] at render time).
    state: Family<StateLabels, Gauge>,
    /// Transitions into each phase.
    transitions: Family<ToLabels, Counter>,
    /// Engine incarnations started after a dead one, by why the dead one ended.
    restarts: Family<ReasonLabels, Counter>,
    /// Time spent in Waking (the engine's part of a failover).
    pub waking_seconds: Histogram,
    /// Time from lock grant to Active (waking plus supervisor overhead).
    pub grant_to_active_seconds: Histogram,
    /// Time to kill and reap the engine's whole process tree.
    pub fencing_seconds: Histogram,
    /// Engine restarts: starts recorded in `--restart-counter` before this one (0 without it).
    pub engine_restarts: AtomicCounter,
    /// Failed background health checks.
    pub health_check_failures: AtomicCounter,
    /// Lock connection breaks seen (reconnects attempted by the client).
    pub lock_disconnects: AtomicCounter,
    /// Lock epoch of the current grant (0 = none).
    pub lock_epoch: AtomicGauge,
    /// Last background health check result (set from [`Status`] at render time).
    engine_healthy: Gauge,
    /// Before-wake GPU/GMS checks run (`--gms`/`--gpu`): how often a wake was gated.
    pub gpu_wake_checks: AtomicCounter,
    /// Before-wake checks that failed (each kept an engine from waking into a hang or OOM).
    pub gpu_wake_check_failures: AtomicCounter,
    /// After-reap memory-release checks run.
    pub gpu_reap_checks: AtomicCounter,
    /// After-reap checks that timed out (memory still pinned when the lock was released).
    pub gpu_reap_timeouts: AtomicCounter,
    /// Dead engines' processes still listed on the device when the reap check started.
    pub gpu_engine_processes_seen: AtomicCounter,
    /// Lock connection up (set from [`Status`] at render time).
    lock_connected: Gauge,
    /// Router pushes (HAProxy runtime API, `--router-socket`) sent.
    pub router_pushes: AtomicCounter,
    /// Router pushes that failed (socket unreachable, timeout, error answer).
    pub router_push_failures: AtomicCounter,
    /// Dynamo's failover series (`dynamo_component_engine_failover_*`), driven by
    /// [`Metrics::entered`].
    pub dynamo: DynamoFailover,
    /// `--init-min-free-memory` waits before an engine spawn, by outcome.
    init_memory_waits: Family<OutcomeLabels, Counter>,
    /// Time those waits took.
    pub init_memory_wait_seconds: Histogram,
}

/// Register `metric`; `help` as documented (`prometheus-client` adds the final full stop).
fn register(registry: &mut Registry, name: &str, help: &str, metric: impl Metric) {
    registry.register(name, help.strip_suffix('.').unwrap_or(help), metric);
}

/// The name to register a counter under: `prometheus-client` appends `_total` itself.
fn counter_name(exposed: &'static str) -> &'static str {
    exposed.strip_suffix("_total").unwrap_or(exposed)
}

impl Metrics {
    /// New registry for one engine, in Init since now.
    pub fn new(engine_id: u32, role: &str) -> Metrics {
        Metrics::in_phase(engine_id, role, Phase::Init, unix_us_now())
    }

    /// New registry for one engine that has been in `phase` since `at_unix_us` (the start of
    /// Dynamo's state series).
    pub fn in_phase(engine_id: u32, role: &str, phase: Phase, at_unix_us: i64) -> Metrics {
        let role: String = role
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        let mut registry = Registry::with_labels(
            [
                (
                    Cow::Borrowed("engine_id"),
                    Cow::Owned(engine_id.to_string()),
                ),
                (Cow::Borrowed("role"), Cow::Owned(role)),
            ]
            .into_iter(),
        );
        let dynamo = DynamoFailover::new(&mut registry, phase, at_unix_us);
        let m = Metrics {
            registry: Registry::default(),
            render_lock: Mutex::new(()),
            state: Family::default(),
            transitions: Family::default(),
            restarts: Family::default(),
            waking_seconds: Histogram::new(),
            grant_to_active_seconds: Histogram::new(),
            fencing_seconds: Histogram::new(),
            engine_restarts: AtomicCounter::default(),
            health_check_failures: AtomicCounter::default(),
            lock_disconnects: AtomicCounter::default(),
            lock_epoch: AtomicGauge::default(),
            engine_healthy: Gauge::default(),
            gpu_wake_checks: AtomicCounter::default(),
            gpu_wake_check_failures: AtomicCounter::default(),
            gpu_reap_checks: AtomicCounter::default(),
            gpu_reap_timeouts: AtomicCounter::default(),
            gpu_engine_processes_seen: AtomicCounter::default(),
            lock_connected: Gauge::default(),
            router_pushes: AtomicCounter::default(),
            router_push_failures: AtomicCounter::default(),
            dynamo,
            init_memory_waits: Family::default(),
            init_memory_wait_seconds: Histogram::new(),
        };
        // Every phase has its series from the start (0 until it happens).
        for p in Phase::ALL {
            drop(m.state.get_or_create(&StateLabels { state: p.as_str() }));
            drop(m.transitions.get_or_create(&ToLabels { to: p.as_str() }));
        }
        register(
            &mut registry,
            "supervisor_state",
            "Current lifecycle phase (1 for the current one).",
            m.state.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_transitions_total"),
            "Transitions into each phase.",
            m.transitions.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_restarts_total"),
            "Engine incarnations started after a dead one, by why it ended.",
            m.restarts.clone(),
        );
        register(
            &mut registry,
            "supervisor_waking_seconds",
            "Time spent in Waking.",
            m.waking_seconds.inner.clone(),
        );
        register(
            &mut registry,
            "supervisor_grant_to_active_seconds",
            "Time from lock grant to Active.",
            m.grant_to_active_seconds.inner.clone(),
        );
        register(
            &mut registry,
            "supervisor_fencing_seconds",
            "Time to kill and reap the engine's process tree.",
            m.fencing_seconds.inner.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_engine_restarts_total"),
            "Engine starts before this one (from --restart-counter).",
            m.engine_restarts.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_health_check_failures_total"),
            "Failed background health checks.",
            m.health_check_failures.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_lock_disconnects_total"),
            "Lock connection breaks.",
            m.lock_disconnects.0.clone(),
        );
        register(
            &mut registry,
            "supervisor_lock_epoch",
            "Epoch of the current lock grant (0 = none).",
            m.lock_epoch.0.clone(),
        );
        register(
            &mut registry,
            "supervisor_engine_healthy",
            "Last background health check result.",
            m.engine_healthy.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_gpu_wake_checks_total"),
            "Before-wake GPU/GMS checks run.",
            m.gpu_wake_checks.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_gpu_wake_check_failures_total"),
            "Before-wake GPU/GMS checks failed (engine not woken).",
            m.gpu_wake_check_failures.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_gpu_reap_checks_total"),
            "After-reap GPU memory-release checks run.",
            m.gpu_reap_checks.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_gpu_reap_timeouts_total"),
            "After-reap checks timed out (lock released with memory still pinned).",
            m.gpu_reap_timeouts.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_gpu_engine_processes_seen_total"),
            "Dead engines' processes still on the device when the reap check started.",
            m.gpu_engine_processes_seen.0.clone(),
        );
        register(
            &mut registry,
            "supervisor_lock_connected",
            "Lock connection up.",
            m.lock_connected.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_router_pushes_total"),
            "State pushes to the router's runtime API (--router-socket).",
            m.router_pushes.0.clone(),
        );
        register(
            &mut registry,
            counter_name("supervisor_router_push_failures_total"),
            "Router pushes that failed (unreachable, timed out, or refused).",
            m.router_push_failures.0.clone(),
        );
        for outcome in INIT_MEMORY_OUTCOMES {
            drop(
                m.init_memory_waits
                    .get_or_create(&OutcomeLabels { outcome }),
            );
        }
        register(
            &mut registry,
            counter_name("supervisor_init_memory_waits_total"),
            "Waits for the device memory an engine needs to initialise (--init-min-free-memory), by outcome.",
            m.init_memory_waits.clone(),
        );
        register(
            &mut registry,
            "supervisor_init_memory_wait_seconds",
            "Time spent waiting for the device memory an engine needs to initialise.",
            m.init_memory_wait_seconds.inner.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Record entering `to` at `at_unix_us` (wall clock, as in `/state.transitions`): the
    /// project's transition counter and Dynamo's series.
    pub fn entered(&self, to: Phase, at_unix_us: i64) {
        self.transition(to);
        self.dynamo.entered(to, at_unix_us);
    }

    /// Count one `--init-min-free-memory` wait that ended with `outcome` (one of
    /// [`INIT_MEMORY_OUTCOMES`]) after `waited`.
    pub fn init_memory_wait(&self, outcome: &'static str, waited: Duration) {
        self.init_memory_waits
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        self.init_memory_wait_seconds.observe(waited);
    }

    /// `--init-min-free-memory` waits that ended with `outcome` so far.
    pub fn init_memory_waits_for(&self, outcome: &'static str) -> u64 {
        self.init_memory_waits
            .get(&OutcomeLabels { outcome })
            .map_or(0, |c| c.get())
    }

    /// Count a transition into `to` (the project's counter only).
    pub fn transition(&self, to: Phase) {
        self.transitions
            .get_or_create(&ToLabels { to: to.as_str() })
            .inc();
    }

    /// Count a restart of the engine (a new incarnation) after one that ended for `reason`.
    pub fn restart(&self, reason: &str) {
        self.restarts
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Restarts counted for `reason` so far.
    pub fn restarts_for(&self, reason: &str) -> u64 {
        self.restarts
            .get(&ReasonLabels {
                reason: reason.to_string(),
            })
            .map_or(0, |c| c.get())
    }

    /// Transitions into `to` so far.
    pub fn transitions_into(&self, to: Phase) -> u64 {
        self.transitions
            .get(&ToLabels { to: to.as_str() })
            .map_or(0, |c| c.get())
    }

    /// Render everything in the OpenMetrics text format ([`CONTENT_TYPE`]), taking the phase,
    /// health and lock-connection gauges from `status`.
    pub fn render(&self, status: &Status) -> String {
        let _serial = self.render_lock.lock().unwrap_or_else(|e| e.into_inner());
        for p in Phase::ALL {
            self.state
                .get_or_create(&StateLabels { state: p.as_str() })
                .set(i64::from(p == status.phase));
        }
        self.engine_healthy.set(i64::from(status.engine_healthy));
        self.lock_connected.set(i64::from(status.lock_connected));
        let mut out = String::with_capacity(8192);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            // Only a gauge at u64::MAX fails to encode; serve what was rendered.
            tracing::warn!(error = %e, "metrics encoding failed part-way");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The workspace's one exposition reader.
    use harness::metrics::{samples, series as value};

    /// Metric family names declared by `# TYPE` lines, with their types.
    fn types(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (n, t) = l.split_once(' ').unwrap();
                (n.to_string(), t.to_string())
            })
            .collect()
    }

    const L: &str = "engine_id=\"1\",role=\"shadow\"";

    #[test]
    fn renders_labelled_series() {
        let m = Metrics::new(1, "shadow");
        m.transition(Phase::Standby);
        m.waking_seconds.observe(Duration::from_millis(30));
        let mut st = Status::new(1, "shadow");
        st.phase = Phase::Standby;
        let text = m.render(&st);
        assert_eq!(
            value(&text, &format!("supervisor_state{{{L},state=\"standby\"}}")),
            1.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_state{{{L},state=\"active\"}}")),
            0.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_transitions_total{{{L},to=\"standby\"}}")
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_transitions_total{{{L},to=\"active\"}}")
            ),
            0.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_waking_seconds_bucket{{{L},le=\"0.05\"}}")
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_waking_seconds_bucket{{{L},le=\"0.025\"}}")
            ),
            0.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_waking_seconds_bucket{{{L},le=\"+Inf\"}}")
            ),
            1.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_waking_seconds_count{{{L}}}")),
            1.0
        );
        assert!(
            (value(&text, &format!("supervisor_waking_seconds_sum{{{L}}}")) - 0.03).abs() < 1e-9
        );
        assert_eq!(
            value(&text, &format!("supervisor_engine_restarts_total{{{L}}}")),
            0.0
        );
        // The strings the end-to-end tests look for, verbatim.
        assert!(text.contains(&format!("supervisor_state{{{L},state=\"standby\"}} 1\n")));
        assert!(text.contains(&format!("supervisor_gpu_wake_checks_total{{{L}}} 0\n")));
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn every_documented_series_is_rendered() {
        let m = Metrics::new(3, "primary");
        let text = m.render(&Status::new(3, "primary"));
        let names: Vec<String> = samples(&text).into_iter().map(|s| s.name).collect();
        for n in [
            "supervisor_state",
            "supervisor_transitions_total",
            "supervisor_waking_seconds_bucket",
            "supervisor_waking_seconds_sum",
            "supervisor_waking_seconds_count",
            "supervisor_grant_to_active_seconds_bucket",
            "supervisor_grant_to_active_seconds_count",
            "supervisor_fencing_seconds_bucket",
            "supervisor_fencing_seconds_count",
            "supervisor_engine_restarts_total",
            "supervisor_health_check_failures_total",
            "supervisor_lock_disconnects_total",
            "supervisor_lock_epoch",
            "supervisor_engine_healthy",
            "supervisor_gpu_wake_checks_total",
            "supervisor_gpu_wake_check_failures_total",
            "supervisor_gpu_reap_checks_total",
            "supervisor_gpu_reap_timeouts_total",
            "supervisor_gpu_engine_processes_seen_total",
            "supervisor_lock_connected",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} missing in\n{text}");
        }
        // Every sample carries both constant labels.
        let all = samples(&text);
        assert!(all.len() > 40, "{text}");
        for s in &all {
            assert_eq!(
                s.labels.get("engine_id").map(String::as_str),
                Some("3"),
                "{s:?}"
            );
            assert_eq!(
                s.labels.get("role").map(String::as_str),
                Some("primary"),
                "{s:?}"
            );
        }
        let t = types(&text);
        assert!(
            t.contains(&("supervisor_transitions".into(), "counter".into())),
            "{t:?}"
        );
        assert!(
            t.contains(&("supervisor_lock_epoch".into(), "gauge".into())),
            "{t:?}"
        );
        assert!(
            t.contains(&("supervisor_fencing_seconds".into(), "histogram".into())),
            "{t:?}"
        );
    }

    #[test]
    fn counters_count_and_gauges_follow_status() {
        let m = Metrics::new(0, "primary");
        m.health_check_failures.fetch_add(2, Ordering::Relaxed);
        m.health_check_failures.fetch_add(1, Ordering::Relaxed);
        m.engine_restarts.store(7, Ordering::Relaxed);
        m.lock_epoch.store(42, Ordering::Relaxed);
        m.transition(Phase::Active);
        m.transition(Phase::Active);
        assert_eq!(m.transitions_into(Phase::Active), 2);
        assert_eq!(m.transitions_into(Phase::Init), 0);
        let mut st = Status::new(0, "primary");
        st.engine_healthy = true;
        st.lock_connected = true;
        st.phase = Phase::Active;
        let text = m.render(&st);
        let l = "engine_id=\"0\",role=\"primary\"";
        assert_eq!(
            value(
                &text,
                &format!("supervisor_health_check_failures_total{{{l}}}")
            ),
            3.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_engine_restarts_total{{{l}}}")),
            7.0
        );
        assert_eq!(value(&text, &format!("supervisor_lock_epoch{{{l}}}")), 42.0);
        assert_eq!(
            value(&text, &format!("supervisor_engine_healthy{{{l}}}")),
            1.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_lock_connected{{{l}}}")),
            1.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_transitions_total{{{l},to=\"active\"}}")
            ),
            2.0
        );
        m.restart("engine_exited");
        m.restart("engine_exited");
        m.restart("startup_timeout");
        assert_eq!(m.restarts_for("engine_exited"), 2);
        assert_eq!(m.restarts_for("revoked"), 0);
        let text = m.render(&st);
        assert_eq!(
            value(
                &text,
                &format!("supervisor_restarts_total{{{l},reason=\"engine_exited\"}}")
            ),
            2.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_restarts_total{{{l},reason=\"startup_timeout\"}}")
            ),
            1.0
        );
        st.engine_healthy = false;
        st.phase = Phase::Dead;
        let text = m.render(&st);
        assert_eq!(
            value(&text, &format!("supervisor_engine_healthy{{{l}}}")),
            0.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_state{{{l},state=\"active\"}}")),
            0.0
        );
        assert_eq!(
            value(&text, &format!("supervisor_state{{{l},state=\"dead\"}}")),
            1.0
        );
    }

    #[test]
    fn histograms_bucket_cumulatively() {
        let m = Metrics::new(0, "primary");
        for ms in [0, 3, 3, 700, 400_000] {
            m.fencing_seconds.observe(Duration::from_millis(ms));
        }
        assert_eq!(m.fencing_seconds.count(), 5);
        let text = m.render(&Status::new(0, "primary"));
        let l = "engine_id=\"0\",role=\"primary\"";
        let bucket = |le: &str| {
            value(
                &text,
                &format!("supervisor_fencing_seconds_bucket{{{l},le=\"{le}\"}}"),
            )
        };
        assert_eq!(bucket("0.001"), 1.0);
        assert_eq!(bucket("0.0025"), 1.0);
        assert_eq!(bucket("0.005"), 3.0);
        assert_eq!(bucket("0.5"), 3.0);
        assert_eq!(bucket("1.0"), 4.0);
        assert_eq!(bucket("300.0"), 4.0);
        assert_eq!(bucket("+Inf"), 5.0);
        assert_eq!(
            value(&text, &format!("supervisor_fencing_seconds_count{{{l}}}")),
            5.0
        );
        // One bucket line per bound plus +Inf.
        let n = samples(&text)
            .iter()
            .filter(|s| s.name == "supervisor_fencing_seconds_bucket")
            .count();
        assert_eq!(n, BUCKETS.len() + 1);
    }

    #[test]
    fn role_label_is_sanitised() {
        let m = Metrics::new(0, "pri\"mary\n");
        let st = Status::new(0, "x");
        assert!(m.render(&st).contains("role=\"primary\""));
    }

    #[test]
    fn init_memory_waits_are_counted_by_outcome_with_their_duration() {
        let m = Metrics::new(1, "shadow");
        let st = Status::new(1, "shadow");
        let text = m.render(&st);
        // Every outcome has its series from the start.
        for o in INIT_MEMORY_OUTCOMES {
            assert_eq!(
                value(
                    &text,
                    &format!("supervisor_init_memory_waits_total{{{L},outcome=\"{o}\"}}")
                ),
                0.0
            );
        }
        m.init_memory_wait("freed", Duration::from_millis(1500));
        m.init_memory_wait("timeout", Duration::from_secs(600));
        m.init_memory_wait("timeout", Duration::from_secs(600));
        assert_eq!(m.init_memory_waits_for("timeout"), 2);
        assert_eq!(m.init_memory_waits_for("ready"), 0);
        let text = m.render(&st);
        let count = |o: &str| {
            value(
                &text,
                &format!("supervisor_init_memory_waits_total{{{L},outcome=\"{o}\"}}"),
            )
        };
        assert_eq!(
            (
                count("ready"),
                count("freed"),
                count("timeout"),
                count("stopped")
            ),
            (0.0, 1.0, 2.0, 0.0)
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_init_memory_wait_seconds_count{{{L}}}")
            ),
            3.0
        );
        assert_eq!(
            value(
                &text,
                &format!("supervisor_init_memory_wait_seconds_bucket{{{L},le=\"2.5\"}}")
            ),
            1.0
        );
        assert!(types(&text).contains(&("supervisor_init_memory_waits".into(), "counter".into())));
    }
}
