//! Issue 10 item 8, Dynamo's failover series over real supervisors: a failover (the Active
//! engine SIGKILLed, the shadow takes over) counts one switch attempt and one success on the
//! shadow only, with the switch time as `last_state_duration_seconds{state="waking"}` and the
//! entry times of `/state`; the old supervisor re-arms (one-hot follows it through
//! dead -> init -> standby). Then the supervisor that switched is RESTARTED (SIGTERM, exit 0; a
//! new process on the same `--failover-counters` file): its switch counters carry over while
//! its state starts afresh (one-hot on standby, only this process's transitions), and the next
//! failover adds to them.

use std::path::Path;
use std::time::Duration;

use harness::metrics::Metrics;
use harness::{kill, wait_until, Cluster, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::dynamo::{SwitchCounts, PREFIX};
use probes::{Phase, StateDoc};

const T: Duration = Duration::from_secs(20);

fn name(s: &str) -> String {
    format!("{PREFIX}_{s}")
}

/// The states whose one-hot gauge is not 0 (exactly `[(state, 1.0)]` when it is right).
fn one_hot(m: &Metrics) -> Vec<(&'static str, f64)> {
    Phase::ALL
        .iter()
        .map(|p| {
            (
                p.as_str(),
                m.value(&name("state"), &[("state", p.as_str())]),
            )
        })
        .filter(|(_, v)| *v != 0.0)
        .collect()
}

fn switches(m: &Metrics) -> (f64, f64) {
    (
        m.value(&name("switch_attempts_total"), &[]),
        m.value(&name("switch_success_total"), &[]),
    )
}

fn transitions(m: &Metrics, from: &str, to: &str) -> f64 {
    m.get(
        &name("transitions_total"),
        &[("from_state", from), ("to_state", to)],
    )
    .unwrap_or(0.0)
}

/// Every `transitions_total` sample as (from, to, count), sorted.
fn all_transitions(m: &Metrics) -> Vec<(String, String, f64)> {
    let mut v: Vec<_> = m
        .samples
        .iter()
        .filter(|s| s.name == name("transitions_total"))
        .map(|s| {
            (
                s.labels["from_state"].clone(),
                s.labels["to_state"].clone(),
                s.value,
            )
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

/// Scrapes `sup` until `f` holds (bounded); returns the last page.
fn wait_metrics(sup: &Sup, what: &str, f: impl Fn(&Metrics) -> bool) -> Metrics {
    let mut last = None;
    let ok = wait_until(T, Duration::from_millis(10), || {
        let m = sup.metrics();
        let done = f(&m);
        last = Some(m);
        done
    });
    let m = last.expect("scraped at least once");
    assert!(ok, "{what} never held in\n{}", m.text);
    m
}

/// Waits until `sup`'s `/state` satisfies `f`; returns that document.
fn wait_state(sup: &Sup, f: impl Fn(&StateDoc) -> bool) -> Option<StateDoc> {
    let mut found = None;
    wait_until(T, Duration::from_millis(10), || {
        found = sup.state().filter(&f);
        found.is_some()
    });
    found
}

/// Waits until the counters file holds `want`.
fn wait_file(path: &Path, want: SwitchCounts) {
    let mut seen = None;
    let ok = wait_until(T, Duration::from_millis(10), || {
        seen = std::fs::read_to_string(path).ok();
        seen.as_deref().and_then(|t| SwitchCounts::parse(t).ok()) == Some(want)
    });
    assert!(ok, "{} holds {seen:?}, want {want:?}", path.display());
}

#[test]
fn switch_counters_survive_a_supervisor_restart_and_state_starts_afresh() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let f0 = c.dir.path().join("engine-0.failover");
    let f1 = c.dir.path().join("engine-1.failover");
    let opts = |id, role, file: &Path| {
        SupOpts::new(id, role)
            .restart("on-failure")
            .sup(&["--restart-backoff", "200ms", "--stop-grace", "1s"])
            .sup(&["--failover-counters", file.to_str().unwrap()])
    };
    let (mut a, mut b) = c.start_pair(&opts(0, "primary", &f0), &opts(1, "shadow", &f1), T);

    // The bootup is not a switch: the primary went Init -> Active without a wake.
    let m = wait_metrics(&a, "primary one-hot active", |m| {
        one_hot(m) == [("active", 1.0)]
    });
    assert_eq!(switches(&m), (0.0, 0.0));
    assert_eq!(transitions(&m, "init", "active"), 1.0, "{}", m.text);
    let m = wait_metrics(&b, "shadow one-hot standby", |m| {
        one_hot(m) == [("standby", 1.0)]
    });
    assert_eq!(switches(&m), (0.0, 0.0));
    assert!(!f0.exists() && !f1.exists(), "no switch, nothing written");

    // Failover 1: engine 0 SIGKILLed, engine 1 takes over.
    let a0 = a.wait_engine_pids(1, T);
    assert!(kill(a0[0], Signal::SIGKILL));
    assert!(
        b.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let m = wait_metrics(&b, "one switch on engine 1", |m| {
        switches(m) == (1.0, 1.0) && one_hot(m) == [("active", 1.0)]
    });
    let doc = b.state().unwrap();
    let waking = doc.entered(Phase::Waking).expect("waking entered");
    let active = doc.entered(Phase::Active).expect("active entered");
    // The same wall-clock times as `/state.transitions`, to the microsecond.
    assert_eq!(
        m.value(&name("state_entered_timestamp_seconds"), &[]),
        active as f64 / 1e6
    );
    let switch_time = m.value(&name("last_state_duration_seconds"), &[("state", "waking")]);
    assert_eq!(switch_time, (active - waking) as f64 / 1e6);
    assert!(switch_time > 0.0 && switch_time < 5.0, "{switch_time}");
    assert_eq!(
        all_transitions(&m),
        [
            ("init".into(), "standby".into(), 1.0),
            ("standby".into(), "waking".into(), 1.0),
            ("waking".into(), "active".into(), 1.0),
        ]
    );
    for s in m.samples.iter().filter(|s| s.name.starts_with(PREFIX)) {
        assert_eq!(
            s.labels.get("engine_id").map(String::as_str),
            Some("1"),
            "{s:?}"
        );
    }
    wait_file(
        &f1,
        SwitchCounts {
            attempts: 1,
            success: 1,
        },
    );

    // The old supervisor re-arms: one-hot through dead -> init -> standby, no switch of its own.
    assert!(
        wait_state(&a, |s| s.incarnation == 1 && s.state == Phase::Standby).is_some(),
        "engine 0 did not re-arm{}",
        c.dump_logs()
    );
    let m = wait_metrics(&a, "re-armed one-hot standby", |m| {
        one_hot(m) == [("standby", 1.0)]
    });
    assert_eq!(switches(&m), (0.0, 0.0));
    for (from, to) in [("active", "dead"), ("dead", "init"), ("init", "standby")] {
        assert_eq!(transitions(&m, from, to), 1.0, "{from}->{to}\n{}", m.text);
    }
    let dead = m.value(&name("last_state_duration_seconds"), &[("state", "dead")]);
    assert!(dead >= 0.2, "dead for {dead} s, backoff 200 ms");
    assert!(!f0.exists(), "engine 0 never switched");

    // The supervisor that switched is restarted: SIGTERM (exit 0, the lock goes to engine 0,
    // whose re-armed shadow takes over: its own first switch).
    assert!(b.proc.signal(Signal::SIGTERM));
    let st = b.proc.wait_exit(T).expect("supervisor 1 did not stop");
    assert_eq!(st.code(), Some(0), "{st:?}");
    assert!(
        a.wait_phase(Phase::Active, T),
        "re-armed engine 0 did not take over{}",
        c.dump_logs()
    );
    wait_metrics(&a, "one switch on engine 0", |m| switches(m) == (1.0, 1.0));
    wait_file(
        &f0,
        SwitchCounts {
            attempts: 1,
            success: 1,
        },
    );

    // A new process for engine 1 on the same counters file.
    let mut b2 = c.start(&opts(1, "shadow", &f1));
    assert!(
        b2.wait_phase(Phase::Standby, T),
        "restarted engine 1 not Standby{}",
        c.dump_logs()
    );
    let m = wait_metrics(&b2, "restarted one-hot standby", |m| {
        one_hot(m) == [("standby", 1.0)]
    });
    assert_eq!(switches(&m), (1.0, 1.0), "carried over\n{}", m.text);
    assert_eq!(
        all_transitions(&m),
        [("init".into(), "standby".into(), 1.0)],
        "this process's transitions only"
    );
    assert_eq!(
        m.get(&name("last_state_duration_seconds"), &[("state", "waking")]),
        None,
        "no wake in this process yet"
    );

    // Failover 2 onto the restarted engine 1: its counters go on from the carried-over ones.
    let a1 = a.wait_engine_pids(1, T);
    assert!(kill(a1[0], Signal::SIGKILL));
    assert!(
        b2.wait_phase(Phase::Active, T),
        "restarted engine 1 did not take over{}",
        c.dump_logs()
    );
    let m = wait_metrics(&b2, "second switch on engine 1", |m| {
        switches(m) == (2.0, 2.0) && one_hot(m) == [("active", 1.0)]
    });
    assert_eq!(transitions(&m, "standby", "waking"), 1.0);
    wait_file(
        &f1,
        SwitchCounts {
            attempts: 2,
            success: 2,
        },
    );
    let (code, body) = b2.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)), "{body}");
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());

    for s in [&mut a, &mut b2] {
        let _ = s.proc.signal(Signal::SIGTERM);
        let st = s.proc.wait_exit(T).expect("supervisor did not stop");
        assert_eq!(st.code(), Some(0), "{st:?}");
    }
}

/// A shadow that finds the lock free when it reaches Standby (no engine serving yet, lockd
/// grants at once) wakes and serves: a bootup, not a switch, as in Dynamo (which counts
/// contended acquires only). The transition series still show the wake.
#[test]
fn an_uncontended_grant_is_not_a_switch() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let f = c.dir.path().join("engine-1.failover");
    let mut s =
        c.start(&SupOpts::new(1, "shadow").sup(&["--failover-counters", f.to_str().unwrap()]));
    assert!(
        s.wait_phase(Phase::Active, T),
        "lone shadow not Active{}",
        c.dump_logs()
    );
    let m = wait_metrics(&s, "one-hot active", |m| one_hot(m) == [("active", 1.0)]);
    assert_eq!(switches(&m), (0.0, 0.0), "{}", m.text);
    assert_eq!(
        all_transitions(&m),
        [
            ("init".into(), "standby".into(), 1.0),
            ("standby".into(), "waking".into(), 1.0),
            ("waking".into(), "active".into(), 1.0),
        ]
    );
    assert!(m
        .get(&name("last_state_duration_seconds"), &[("state", "waking")])
        .is_some());
    assert!(!f.exists(), "nothing to persist");
    assert!(s.proc.signal(Signal::SIGTERM));
    assert_eq!(s.proc.wait_exit(T).and_then(|st| st.code()), Some(0));
}
