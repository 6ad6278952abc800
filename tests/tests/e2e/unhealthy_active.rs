//! An Active engine whose health check fails: `/live` and `/ready` turn 503 (kubelet acts on
//! them); the supervisor itself stays Active and keeps the lock.

use std::time::Duration;

use harness::{wait_until, Cluster, SupOpts};
use probes::Phase;

const T: Duration = Duration::from_secs(20);

#[test]
fn failing_health_turns_live_and_ready_503() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let p = c.start(&SupOpts::new(0, "primary").engine(&["--fail-at", "serve"]));
    assert!(p.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert_eq!(p.probe("/ready"), Some(200));
    // First serve takes the claim and arms the failure: /health answers 503 from now on.
    assert_eq!(p.completion().unwrap().0, 200);
    assert!(
        wait_until(T, Duration::from_millis(20), || p.probe("/live")
            == Some(503)),
        "{}",
        c.dump_logs()
    );
    assert_eq!(p.probe("/ready"), Some(503));
    assert_eq!(p.probe("/startup"), Some(200));
    assert_eq!(p.phase(), Some(Phase::Active));
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-0"));
    let m = p.metrics();
    assert_eq!(
        m.series("supervisor_engine_healthy{engine_id=\"0\",role=\"primary\"}"),
        0.0
    );
}
