//! With `--gms` and a healthy GMS (committed weights, not restarted), a failover works as
//! without it: the shadow remembers the layout at Standby, its before-wake check passes
//! (same layout), and only then is the engine woken.

use std::time::Duration;

use harness::{kill, wait_until, Cluster, Gmsd, GmsdSpec, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};

const T: Duration = Duration::from_secs(20);

#[test]
fn failover_with_gms_checks_succeeds() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let gms = Gmsd::start(GmsdSpec::new(c.dir.path().join("gms.sock")).backend("host"));
    gms.load(4);
    let sock = gms.socket().to_string_lossy().into_owned();
    let gms_flags = ["--gms", sock.as_str(), "--gms-handshake-timeout", "2s"];

    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
        &SupOpts::new(1, "shadow").sup(&gms_flags),
        T,
    );
    assert!(
        wait_until(T, Duration::from_millis(20), || shadow
            .log_text()
            .contains("remembered committed layout at standby")),
        "{}",
        c.dump_logs()
    );

    let old = primary.wait_engine_pids(1, T);
    assert!(kill(old[0], Signal::SIGKILL), "engine {} is gone", old[0]);

    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let (code, body) = shadow.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["engine_id"], 1);

    // Order: grant -> check started -> check passed -> Waking ... -> Active.
    let st = shadow.state().unwrap();
    let granted = st.mark(MarkKind::LockGranted).expect("granted");
    let started = st.mark(MarkKind::GpuCheckStarted).expect("check started");
    let passed = st.mark(MarkKind::GpuCheckPassed).expect("check passed");
    let active = st.entered(Phase::Active).expect("active transition");
    assert!(
        granted <= started && started <= passed && passed <= active,
        "granted {granted} started {started} passed {passed} active {active}"
    );
    let log = shadow.log_text();
    assert!(log.contains("gpu check before wake: ok"), "{log}");
    let metrics = shadow.metrics();
    assert_eq!(
        metrics.series("supervisor_gpu_wake_checks_total{engine_id=\"1\",role=\"shadow\"}"),
        1.0
    );
    assert_eq!(
        metrics.series("supervisor_gpu_wake_check_failures_total{engine_id=\"1\",role=\"shadow\"}"),
        0.0
    );
    // The GMS still holds the weights, and no read lock was left behind by the check.
    let gst = gms.state().unwrap();
    assert_eq!(gst["committed"], true, "{gst}");
    assert_eq!(gst["ro_session_count"], 0, "{gst}");
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    let mut primary = primary;
    let st = primary.proc.wait_exit(T).expect("old supervisor exits");
    assert_eq!(st.code(), Some(10));
}
