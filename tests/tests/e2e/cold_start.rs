//! Cold start of a primary and a shadow: primary Active with `/ready` 200; shadow Standby with
//! `/live` 200 and `/ready` 503.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use probes::Phase;

const T: Duration = Duration::from_secs(20);

#[test]
fn cold_start_primary_active_shadow_standby() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let primary = c.start(&SupOpts::new(0, "primary").engine(&["--workers", "1"]));
    assert!(
        primary.wait_phase(Phase::Active, T),
        "primary not active{}",
        c.dump_logs()
    );
    let shadow = c.start(&SupOpts::new(1, "shadow").engine(&["--workers", "1"]));
    assert!(
        shadow.wait_phase(Phase::Standby, T),
        "shadow not standby{}",
        c.dump_logs()
    );

    assert_eq!(primary.probe("/startup"), Some(200));
    assert_eq!(primary.probe("/live"), Some(200));
    assert_eq!(primary.probe("/ready"), Some(200));
    assert_eq!(shadow.probe("/startup"), Some(200));
    assert_eq!(shadow.probe("/live"), Some(200));
    assert_eq!(shadow.probe("/ready"), Some(503));

    // The primary went straight to Active (no sleep/wake cycle) and holds the lock.
    let st = primary.state().unwrap();
    let path: Vec<Phase> = st.phases().collect();
    assert_eq!(path, [Phase::Init, Phase::Active]);
    assert!(st.epoch.is_some(), "epoch missing: {st:?}");
    assert_eq!(st.role, "primary");
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-0"));

    // The primary's engine serves; the shadow's engine sleeps.
    let (code, body) = primary.completion().unwrap();
    assert_eq!(code, 200);
    assert_eq!(body["engine_id"], 0);
    // Asleep, vLLM holds a request until the wake (scheduling paused,
    // docs/features/sleep_mode.md): no answer within the client's timeout, while the engine
    // itself answers and says it sleeps.
    assert_eq!(shadow.completion(), None, "asleep: a completion waits");
    let (code, body) = harness::supervisor::get(shadow.engine, "/is_sleeping").unwrap();
    assert_eq!((code, body.contains("true")), (200, true), "{body}");

    // Metrics carry the labels.
    let m = shadow.metrics();
    assert_eq!(
        m.series("supervisor_state{engine_id=\"1\",role=\"shadow\",state=\"standby\"}"),
        1.0
    );
    assert!(c.violations().is_empty());
}
