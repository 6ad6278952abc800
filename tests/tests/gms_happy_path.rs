//! With `--gms` and a healthy GMS (committed weights, not restarted), a failover works as
//! without it: the shadow remembers the layout at Standby, its before-wake check passes
//! (same layout), and only then is the engine woken.

use std::time::Duration;

use failover_tests::{get, wait_until, Cluster, Gmsd, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn failover_with_gms_checks_succeeds() {
    let mut c = Cluster::new("2s");
    let gms = Gmsd::start(c.dir.path());
    gms.load(4);
    let sock = gms.socket.to_string_lossy().into_owned();
    let gms_flags = ["--gms", sock.as_str(), "--gms-handshake-timeout", "2s"];

    let primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
    );
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow").sup(&gms_flags));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    assert!(
        wait_until(T, Duration::from_millis(20), || shadow
            .log_text()
            .contains("remembered committed layout at standby")),
        "{}",
        c.dump_logs()
    );

    let old = primary.wait_engine_pids(1, T);
    // SAFETY: kill(2) on the engine pid we just read.
    unsafe { libc::kill(old[0], libc::SIGKILL) };

    assert!(
        shadow.wait_phase("active", T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let (code, body) = shadow.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["engine_id"], 1);

    // Order: grant -> check started -> check passed -> Waking ... -> Active.
    let st = shadow.state().unwrap();
    let m = &st["marks"];
    let granted = m["lock_granted"].as_i64().expect("granted");
    let started = m["gpu_check_started"].as_i64().expect("check started");
    let passed = m["gpu_check_passed"].as_i64().expect("check passed");
    let active = failover_tests::transition_at(&st, "active").unwrap();
    assert!(
        granted <= started && started <= passed && passed <= active,
        "granted {granted} started {started} passed {passed} active {active}"
    );
    let log = shadow.log_text();
    assert!(log.contains("gpu check before wake: ok"), "{log}");
    let metrics = get(shadow.probes, "/metrics").unwrap().1;
    assert!(
        metrics.contains("supervisor_gpu_wake_checks_total{engine_id=\"1\",role=\"shadow\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "supervisor_gpu_wake_check_failures_total{engine_id=\"1\",role=\"shadow\"} 0"
        ),
        "{metrics}"
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
