//! An Active engine whose health check fails: `/live` and `/ready` turn 503 at once; after
//! `--unhealthy-after` failures in a row the supervisor fences the engine (exit 21) and the
//! shadow takes over. With `--unhealthy-after 0` it stays Active and keeps the lock, and only
//! kubelet (through `/live`) acts.

use std::time::Duration;

use harness::{wait_until, Cluster, SupOpts};
use probes::{MarkKind, Phase};

const T: Duration = Duration::from_secs(20);

#[test]
fn failing_health_fences_the_active_engine_and_the_shadow_takes_over() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut p, s) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--linger", "3s"])
            .engine(&["--fail-at", "serve"]),
        &SupOpts::new(1, "shadow"),
        T,
    );
    // First serve takes the claim and arms the failure: /health answers 503 from now on.
    assert_eq!(p.completion().unwrap().0, 200);
    assert!(s.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let st = p.state().expect("the old supervisor lingers");
    assert_eq!(st.state, Phase::Dead);
    assert!(
        st.dead_reason
            .as_deref()
            .is_some_and(|r| r.contains("health checks in a row")),
        "{st:?}"
    );
    let closed = st.mark(MarkKind::LockClosed).expect("lock closed");
    let granted = s.state().unwrap().mark(MarkKind::LockGranted).unwrap();
    assert!(closed <= granted, "closed {closed} granted {granted}");
    assert_eq!(p.proc.wait_exit(T).and_then(|x| x.code()), Some(21));
    assert!(c.violations().is_empty(), "{}", c.violations());
}

#[test]
fn with_unhealthy_after_0_failing_health_turns_live_and_ready_503_only() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let p = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--unhealthy-after", "0"])
            .engine(&["--fail-at", "serve"]),
    );
    assert!(p.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert_eq!(p.probe("/ready"), Some(200));
    assert_eq!(p.completion().unwrap().0, 200);
    assert!(
        wait_until(T, Duration::from_millis(20), || p.probe("/live")
            == Some(503)),
        "{}",
        c.dump_logs()
    );
    assert_eq!(p.probe("/ready"), Some(503));
    assert_eq!(p.probe("/startup"), Some(200));
    // Well past three failed checks (200 ms apart), still Active and holding the lock.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(p.phase(), Some(Phase::Active));
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-0"));
    let m = p.metrics();
    assert_eq!(
        m.series("supervisor_engine_healthy{engine_id=\"0\",role=\"primary\"}"),
        0.0
    );
}
