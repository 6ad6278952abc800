//! NVIDIA Dynamo's shadow-engine failover series, exported beside the project's own so that
//! dashboards and alerts written for Dynamo's GMS failover work unchanged.
//!
//! Names, types, labels and semantics follow Dynamo's own exporter:
//! ai-dynamo/dynamo `lib/gpu_memory_service/failover_lock/failover_metrics.py`
//! (class `FailoverMetrics`; earlier `lib/gpu_memory_service/failover_metrics.py`), driven
//! from its shadow loop (`set_state("waking")` after the lock acquire, and
//! `record_switch_attempt()` only `if lock.was_contended`: "a bootup is not a switch"). All
//! series are prefixed `dynamo_component_engine_failover`:
//!
//! | series | type | labels | meaning |
//! |---|---|---|---|
//! | `_state` | gauge | `state` | 1 for the current state, 0 for the others (one-hot) |
//! | `_state_entered_timestamp_seconds` | gauge | | Unix time the current state was entered |
//! | `_last_state_duration_seconds` | gauge | `state` | how long the last completed stay in that state lasted (absent until the state is first left; `state="waking"` is the switch time) |
//! | `_transitions_total` | counter | `from_state`, `to_state` | state changes (absent until one happens) |
//! | `_switch_attempts_total` | counter | | failovers attempted |
//! | `_switch_success_total` | counter | | failovers that reached Active |
//!
//! Where this exporter differs from Dynamo's, and why:
//! * the `state` label ranges over this project's five phases: Dynamo's `init|standby|waking|
//!   active` plus `dead` (an incarnation fenced and re-arming: Dynamo's process simply exits);
//! * labels: the registry's constant `engine_id` and `role` (Dynamo: `engine_id`, `model`,
//!   `dynamo_component`, which an empty value makes absent in PromQL anyway; pod identity comes
//!   from scrape relabelling in both);
//! * **switch attempt** = a lock grant that starts a wake (Standby -> Waking) after the acquire
//!   had to wait in lockd's queue (lockd answered `queued`: another engine held the lock),
//!   Dynamo's "contended" acquire. A grant that came at once is a bootup, not a switch: a
//!   primary that finds the lock free goes Init -> Active, but a shadow can also reach Standby
//!   first and find it free (seen in the rendered pod's run, `deploy/pod_e2e.py`), and neither is
//!   counted, as in Dynamo. The driver reports the queueing through
//!   [`DynamoFailover::lock_queued`];
//! * **switch success** = reaching Active from a counted attempt (Waking -> Active). A wake that
//!   fails (Waking -> Dead) leaves `attempts - success` as the failed switches, as in Dynamo;
//! * the two switch counters survive restarts of the supervisor (a file on the shared volume,
//!   `--failover-counters`, written by the driver through [`DynamoFailover::on_switch`] with
//!   temp + rename, in Dynamo's own format `{"attempts": N, "success": N}`); the other series
//!   start afresh with each process, as Dynamo's do.
//!
//! Every change comes from [`crate::ProbeState::enter`], the one place every phase change
//! (including a re-armed incarnation's Dead -> Init) goes through, with the same wall-clock
//! time as `/state.transitions`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::Phase;

/// The common prefix of Dynamo's failover series.
pub const PREFIX: &str = "dynamo_component_engine_failover";

/// The switch counters, as persisted (Dynamo's file format: `{"attempts": N, "success": N}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchCounts {
    /// `..._switch_attempts_total`.
    #[serde(default)]
    pub attempts: u64,
    /// `..._switch_success_total`.
    #[serde(default)]
    pub success: u64,
}

impl SwitchCounts {
    /// Reads the persisted form: a JSON object (missing fields are 0, unknown ones ignored).
    pub fn parse(text: &str) -> Result<SwitchCounts, serde_json::Error> {
        let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)?;
        serde_json::from_value(serde_json::Value::Object(object))
    }
}

/// Labels `{state}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// Labels `{from_state, to_state}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FromTo {
    from_state: &'static str,
    to_state: &'static str,
}

/// Where the exporter is in the lifecycle.
#[derive(Debug, Clone, Copy)]
struct Current {
    /// The state entered last.
    phase: Phase,
    /// When, in microseconds since the Unix epoch.
    at_unix_us: i64,
    /// A counted switch attempt has not yet reached Active (nor failed).
    switching: bool,
    /// The pending lock acquire had to wait in lockd's queue (a contended acquire).
    queued: bool,
}

/// Called with the new counts after every change of the switch counters (the driver persists
/// them).
pub type SwitchSink = Box<dyn Fn(SwitchCounts) + Send + Sync>;

/// Dynamo's failover series for one engine (see the module documentation).
pub struct DynamoFailover {
    state: Family<StateLabel, Gauge>,
    state_entered: Gauge<f64, AtomicU64>,
    last_state_duration: Family<StateLabel, Gauge<f64, AtomicU64>>,
    transitions: Family<FromTo, Counter>,
    switch_attempts: Counter<u64, AtomicU64>,
    switch_success: Counter<u64, AtomicU64>,
    /// Serialises a transition's several updates (so that a scrape never sees two states at 1
    /// for longer than the render lock allows) and holds the current state.
    current: Mutex<Current>,
    /// Where changed switch counts go (set once by the driver).
    sink: OnceLock<SwitchSink>,
}

impl std::fmt::Debug for DynamoFailover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoFailover")
            .field("current", &self.current)
            .field("switch", &self.switch_counts())
            .field("sink", &self.sink.get().is_some())
            .finish()
    }
}

/// Seconds since the Unix epoch from microseconds.
fn secs(us: i64) -> f64 {
    us as f64 / 1e6
}

impl DynamoFailover {
    /// The series registered in `registry` (whose constant labels they carry), in `phase`
    /// since `at_unix_us`.
    pub(crate) fn new(registry: &mut Registry, phase: Phase, at_unix_us: i64) -> DynamoFailover {
        let d = DynamoFailover {
            state: Family::default(),
            state_entered: Gauge::default(),
            last_state_duration: Family::default(),
            transitions: Family::default(),
            switch_attempts: Counter::default(),
            switch_success: Counter::default(),
            current: Mutex::new(Current {
                phase,
                at_unix_us,
                switching: false,
                queued: false,
            }),
            sink: OnceLock::new(),
        };
        // The one-hot gauge and the switch counters are exported from the first scrape
        // (zeros, not absent), as Dynamo's are.
        for p in Phase::ALL {
            d.state
                .get_or_create(&StateLabel { state: p.as_str() })
                .set(i64::from(p == phase));
        }
        d.state_entered.set(secs(at_unix_us));
        // The exposed names, spelled out in full (deploy/check_dashboard.py looks for them in
        // the sources); `prometheus-client` appends `_total` to counters itself.
        let counter = |exposed: &'static str| exposed.strip_suffix("_total").unwrap_or(exposed);
        registry.register(
            "dynamo_component_engine_failover_state",
            "Current failover state, 1-hot over the state label (init|standby|waking|active|dead)",
            d.state.clone(),
        );
        registry.register(
            "dynamo_component_engine_failover_state_entered_timestamp_seconds",
            "Unix time the engine entered its current failover state",
            d.state_entered.clone(),
        );
        registry.register(
            "dynamo_component_engine_failover_last_state_duration_seconds",
            "Duration of the most recent completed occupancy of each state ({state=waking} is the switch time)",
            d.last_state_duration.clone(),
        );
        registry.register(
            counter("dynamo_component_engine_failover_transitions_total"),
            "Failover state transitions, by from_state/to_state",
            d.transitions.clone(),
        );
        registry.register(
            counter("dynamo_component_engine_failover_switch_attempts_total"),
            "Failover promotions attempted (contended lock grants that start a wake: Standby -> Waking); persisted",
            d.switch_attempts.clone(),
        );
        registry.register(
            counter("dynamo_component_engine_failover_switch_success_total"),
            "Failover promotions that completed and began serving (Waking -> Active); persisted",
            d.switch_success.clone(),
        );
        d
    }

    /// Record entering `to` at `at_unix_us` (from [`crate::ProbeState::enter`]). Re-entering
    /// the current state only moves its entry time, as in Dynamo.
    pub fn entered(&self, to: Phase, at_unix_us: i64) {
        let changed = {
            let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
            let from = cur.phase;
            let mut changed = false;
            if from != to {
                let stay = (at_unix_us - cur.at_unix_us).max(0);
                self.last_state_duration
                    .get_or_create(&StateLabel {
                        state: from.as_str(),
                    })
                    .set(secs(stay));
                self.transitions
                    .get_or_create(&FromTo {
                        from_state: from.as_str(),
                        to_state: to.as_str(),
                    })
                    .inc();
                self.state
                    .get_or_create(&StateLabel {
                        state: from.as_str(),
                    })
                    .set(0);
                match (from, to) {
                    (Phase::Standby, Phase::Waking) if cur.queued => {
                        self.switch_attempts.inc();
                        cur.switching = true;
                        changed = true;
                    }
                    (Phase::Waking, Phase::Active) if cur.switching => {
                        self.switch_success.inc();
                        cur.switching = false;
                        changed = true;
                    }
                    _ => cur.switching = false,
                }
                // A grant consumes the queueing; a new incarnation starts without one.
                if matches!(
                    to,
                    Phase::Waking | Phase::Active | Phase::Init | Phase::Dead
                ) {
                    cur.queued = false;
                }
            }
            self.state
                .get_or_create(&StateLabel { state: to.as_str() })
                .set(1);
            self.state_entered.set(secs(at_unix_us));
            cur.phase = to;
            cur.at_unix_us = at_unix_us;
            changed
        };
        if changed {
            if let Some(sink) = self.sink.get() {
                sink(self.switch_counts());
            }
        }
    }

    /// The lock acquire now pending had to wait in lockd's queue (the lock client's `Queued`
    /// event): the grant that ends it, if it starts a wake, is a switch attempt.
    pub fn lock_queued(&self) {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .queued = true;
    }

    /// The switch counters now.
    pub fn switch_counts(&self) -> SwitchCounts {
        SwitchCounts {
            attempts: self.switch_attempts.get(),
            success: self.switch_success.get(),
        }
    }

    /// Carry the switch counters over from an earlier process (the persisted counts). Meant
    /// for startup, before any switch; later counts add to these.
    pub fn restore(&self, counts: SwitchCounts) {
        self.switch_attempts
            .inner()
            .store(counts.attempts, Ordering::Relaxed);
        self.switch_success
            .inner()
            .store(counts.success, Ordering::Relaxed);
    }

    /// Where to send the counts after each change (once; later calls are ignored and return
    /// false).
    pub fn on_switch(&self, sink: SwitchSink) -> bool {
        self.sink.set(sink).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use harness::metrics::{samples, Metrics as Page};

    use crate::{Metrics, Phase, ProbeState, Status};

    use super::*;

    const L: &str = "engine_id=\"1\",role=\"shadow\"";
    /// An arbitrary wall-clock origin (µs), so that every expected value is exact.
    const T0: i64 = 1_764_000_000_000_000;

    fn page(m: &Metrics) -> Page {
        Page::parse(&m.render(&Status::new(1, "shadow")))
    }

    fn state(p: &Page, s: &str) -> f64 {
        p.series(&format!("{PREFIX}_state{{{L},state=\"{s}\"}}"))
    }

    fn one_hot(p: &Page) -> Vec<(&'static str, f64)> {
        Phase::ALL
            .iter()
            .map(|s| (s.as_str(), state(p, s.as_str())))
            .filter(|(_, v)| *v != 0.0)
            .collect()
    }

    fn last(p: &Page, s: &str) -> Option<f64> {
        p.get(
            &format!("{PREFIX}_last_state_duration_seconds"),
            &[("state", s)],
        )
    }

    fn tr(p: &Page, from: &str, to: &str) -> Option<f64> {
        p.get(
            &format!("{PREFIX}_transitions_total"),
            &[("from_state", from), ("to_state", to)],
        )
    }

    fn switches(p: &Page) -> (f64, f64) {
        (
            p.series(&format!("{PREFIX}_switch_attempts_total{{{L}}}")),
            p.series(&format!("{PREFIX}_switch_success_total{{{L}}}")),
        )
    }

    fn entered_at(p: &Page) -> f64 {
        p.series(&format!("{PREFIX}_state_entered_timestamp_seconds{{{L}}}"))
    }

    #[test]
    fn a_fresh_engine_exports_zeros_and_no_history() {
        let m = Metrics::in_phase(1, "shadow", Phase::Init, T0);
        let p = page(&m);
        assert_eq!(one_hot(&p), [("init", 1.0)]);
        for s in Phase::ALL {
            assert_eq!(last(&p, s.as_str()), None, "{s}");
        }
        assert!(p
            .samples
            .iter()
            .all(|s| s.name != format!("{PREFIX}_transitions_total")));
        assert_eq!(switches(&p), (0.0, 0.0));
        assert_eq!(entered_at(&p), 1_764_000_000.0);
        // Dynamo's types, for dashboards that use rate()/increase() on the counters.
        let text = &p.text;
        for (family, ty) in [
            ("state", "gauge"),
            ("state_entered_timestamp_seconds", "gauge"),
            ("last_state_duration_seconds", "gauge"),
            ("transitions", "counter"),
            ("switch_attempts", "counter"),
            ("switch_success", "counter"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {PREFIX}_{family} {ty}\n")),
                "{family} {ty} in\n{text}"
            );
        }
    }

    /// A shadow through a failover, a failed switch, a re-arm and a second failover, with
    /// exact times: every series after every transition.
    #[test]
    fn series_follow_a_sequence_of_transitions() {
        let m = Metrics::in_phase(1, "shadow", Phase::Init, T0);
        let ms = |n: i64| T0 + n * 1000;

        // Init -> Standby after 5 s of model load.
        m.entered(Phase::Standby, ms(5_000));
        let p = page(&m);
        assert_eq!(one_hot(&p), [("standby", 1.0)]);
        assert_eq!(last(&p, "init"), Some(5.0));
        assert_eq!(tr(&p, "init", "standby"), Some(1.0));
        assert_eq!(switches(&p), (0.0, 0.0));
        assert_eq!(entered_at(&p), 1_764_000_005.0);

        // Queued behind the Active engine, granted 10 s later: Standby -> Waking is a switch
        // attempt.
        m.dynamo.lock_queued();
        m.entered(Phase::Waking, ms(15_000));
        let p = page(&m);
        assert_eq!(one_hot(&p), [("waking", 1.0)]);
        assert_eq!(last(&p, "standby"), Some(10.0));
        assert_eq!(switches(&p), (1.0, 0.0));

        // Woken in 4 ms: success, and the switch time is last_state_duration{waking}.
        m.entered(Phase::Active, ms(15_004));
        let p = page(&m);
        assert_eq!(one_hot(&p), [("active", 1.0)]);
        assert!((last(&p, "waking").unwrap() - 0.004).abs() < 1e-9);
        assert_eq!(tr(&p, "waking", "active"), Some(1.0));
        assert_eq!(switches(&p), (1.0, 1.0));
        assert_eq!(entered_at(&p), 1_764_000_015.004);

        // Killed after 60 s Active, re-armed (Dead -> Init), back to Standby.
        m.entered(Phase::Dead, ms(75_004));
        m.entered(Phase::Init, ms(75_204));
        m.entered(Phase::Standby, ms(78_204));
        let p = page(&m);
        assert_eq!(one_hot(&p), [("standby", 1.0)]);
        assert_eq!(last(&p, "active"), Some(60.0));
        assert_eq!(last(&p, "dead"), Some(0.2));
        // The latest stay in Init (3 s), not the first (5 s).
        assert_eq!(last(&p, "init"), Some(3.0));
        assert_eq!(tr(&p, "active", "dead"), Some(1.0));
        assert_eq!(tr(&p, "dead", "init"), Some(1.0));
        assert_eq!(tr(&p, "init", "standby"), Some(2.0));
        assert_eq!(switches(&p), (1.0, 1.0));

        // A grant whose wake fails: an attempt without a success.
        m.dynamo.lock_queued();
        m.entered(Phase::Waking, ms(80_000));
        m.entered(Phase::Dead, ms(81_000));
        let p = page(&m);
        assert_eq!(switches(&p), (2.0, 1.0));
        assert_eq!(tr(&p, "waking", "dead"), Some(1.0));
        assert_eq!(last(&p, "waking"), Some(1.0));

        // Re-armed again, then a successful takeover.
        for (ph, t) in [
            (Phase::Init, 82_000),
            (Phase::Standby, 83_000),
            (Phase::Waking, 90_000),
            (Phase::Active, 90_010),
        ] {
            if ph == Phase::Waking {
                m.dynamo.lock_queued();
            }
            m.entered(ph, ms(t));
        }
        let p = page(&m);
        assert_eq!(one_hot(&p), [("active", 1.0)]);
        assert_eq!(switches(&p), (3.0, 2.0));
        assert_eq!(tr(&p, "standby", "waking"), Some(3.0));
        assert_eq!(tr(&p, "waking", "active"), Some(2.0));
        assert_eq!(tr(&p, "init", "standby"), Some(3.0));
        // Exactly the twelve transitions that happened, summed over their label pairs.
        let total: f64 = samples(&p.text)
            .iter()
            .filter(|s| s.name == format!("{PREFIX}_transitions_total"))
            .map(|s| s.value)
            .sum();
        assert_eq!(total, 12.0);
        // The project's own counter saw the same entries.
        assert_eq!(m.transitions_into(Phase::Active), 2);
        assert_eq!(m.transitions_into(Phase::Init), 2);
    }

    #[test]
    fn a_bootup_is_not_a_switch() {
        // A primary: Init -> Active (the lock was free), then its engine dies: no switch.
        let m = Metrics::in_phase(1, "shadow", Phase::Init, T0);
        m.entered(Phase::Active, T0 + 1);
        m.entered(Phase::Dead, T0 + 2);
        m.entered(Phase::Init, T0 + 3);
        // A shadow that finds the lock free at Standby (granted at once, never queued): its
        // wake is a bootup too.
        m.entered(Phase::Standby, T0 + 4);
        m.entered(Phase::Waking, T0 + 5);
        m.entered(Phase::Active, T0 + 6);
        let p = page(&m);
        assert_eq!(switches(&p), (0.0, 0.0));
        assert_eq!(tr(&p, "init", "active"), Some(1.0));
        assert_eq!(tr(&p, "standby", "waking"), Some(1.0));
        assert_eq!(last(&p, "waking"), Some(1e-6));
        // A queueing noted in one incarnation does not count in the next one.
        m.dynamo.lock_queued();
        m.entered(Phase::Dead, T0 + 7);
        m.entered(Phase::Init, T0 + 8);
        m.entered(Phase::Standby, T0 + 9);
        m.entered(Phase::Waking, T0 + 10);
        m.entered(Phase::Active, T0 + 11);
        assert_eq!(switches(&page(&m)), (0.0, 0.0));
        // Queued in Standby: counted; the next grant needs a queueing of its own.
        m.entered(Phase::Dead, T0 + 12);
        m.entered(Phase::Init, T0 + 13);
        m.entered(Phase::Standby, T0 + 14);
        m.dynamo.lock_queued();
        m.entered(Phase::Waking, T0 + 15);
        m.entered(Phase::Active, T0 + 16);
        m.entered(Phase::Dead, T0 + 17);
        m.entered(Phase::Init, T0 + 18);
        m.entered(Phase::Standby, T0 + 19);
        m.entered(Phase::Waking, T0 + 20);
        m.entered(Phase::Active, T0 + 21);
        assert_eq!(switches(&page(&m)), (1.0, 1.0));
    }

    #[test]
    fn re_entering_a_state_moves_its_time_only() {
        let m = Metrics::in_phase(1, "shadow", Phase::Init, T0);
        m.entered(Phase::Init, T0 + 2_000_000);
        let p = page(&m);
        assert_eq!(one_hot(&p), [("init", 1.0)]);
        assert_eq!(entered_at(&p), 1_764_000_002.0);
        assert_eq!(last(&p, "init"), None);
        assert_eq!(tr(&p, "init", "init"), None);
    }

    #[test]
    fn restored_counts_carry_on_and_every_change_reaches_the_sink() {
        let m = Metrics::in_phase(1, "shadow", Phase::Standby, T0);
        m.dynamo.restore(SwitchCounts {
            attempts: 7,
            success: 5,
        });
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        assert!(m
            .dynamo
            .on_switch(Box::new(move |c| s.lock().unwrap().push(c))));
        assert!(!m.dynamo.on_switch(Box::new(|_| {})), "set once");
        assert_eq!(switches(&page(&m)), (7.0, 5.0));
        m.dynamo.lock_queued();
        m.entered(Phase::Waking, T0 + 1);
        m.entered(Phase::Active, T0 + 2);
        m.entered(Phase::Dead, T0 + 3);
        assert_eq!(switches(&page(&m)), (8.0, 6.0));
        assert_eq!(
            *seen.lock().unwrap(),
            [
                SwitchCounts {
                    attempts: 8,
                    success: 5
                },
                SwitchCounts {
                    attempts: 8,
                    success: 6
                }
            ]
        );
        assert_eq!(m.dynamo.switch_counts().attempts, 8);
    }

    #[test]
    fn the_file_format_is_dynamos() {
        let c = SwitchCounts::parse(r#"{"attempts": 3, "success": 2}"#).unwrap();
        assert_eq!(
            c,
            SwitchCounts {
                attempts: 3,
                success: 2
            }
        );
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"attempts":3,"success":2}"#
        );
        assert!(SwitchCounts::parse(r#"{"attempts": -1}"#).is_err());
        assert!(SwitchCounts::parse("3").is_err());
        assert!(SwitchCounts::parse("[3, 2]").is_err());
        assert_eq!(
            SwitchCounts::parse(r#"{"success": 1, "model": "x"}"#).unwrap(),
            SwitchCounts {
                attempts: 0,
                success: 1
            }
        );
    }

    /// Through the probe state, as the driver does: the same wall-clock time as `/state`.
    #[test]
    fn probe_state_enter_drives_the_series_with_the_state_doc_times() {
        let st = ProbeState::new(Status::new(1, "shadow"));
        st.enter(Phase::Standby, None);
        st.metrics().dynamo.lock_queued();
        let w = st.enter(Phase::Waking, None);
        let a = st.enter(Phase::Active, None);
        let status = st.read().clone();
        let p = Page::parse(&st.metrics().render(&status));
        assert_eq!(one_hot(&p), [("active", 1.0)]);
        assert_eq!(entered_at(&p), a as f64 / 1e6);
        assert_eq!(last(&p, "waking"), Some((a - w) as f64 / 1e6));
        assert_eq!(switches(&p), (1.0, 1.0));
        let doc = status.state_doc(std::time::Instant::now());
        assert_eq!(doc.entered(Phase::Active), Some(a));
        // Init's stay is measured from the Status's own first transition.
        let init_at = doc.transitions[0].at_unix_us;
        let s = doc.entered(Phase::Standby).unwrap();
        assert_eq!(last(&p, "init"), Some((s - init_at) as f64 / 1e6));
    }
}
