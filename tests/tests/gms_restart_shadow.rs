//! Decision 6: the GMS is killed and restarted EMPTY while the shadow sleeps. When the shadow
//! is granted the lock it must not wake its engine into a read-lock hang: its before-wake check
//! fails fast (Dead, exit 19, within the GMS handshake timeout), the log names the cause, and
//! the lock passes on to the next waiter.

use std::time::Duration;

use failover_tests::{wait_until, Cluster, Gmsd, SupOpts};

const T: Duration = Duration::from_secs(20);
/// `--gms-handshake-timeout` of the supervisors under test.
const HANDSHAKE: Duration = Duration::from_secs(2);

#[test]
fn shadow_fails_fast_when_gms_restarted_empty_and_lock_passes_on() {
    let mut c = Cluster::new("2s");
    let mut gms = Gmsd::start(c.dir.path());
    gms.load(4);
    let committed = gms.state().expect("gmsd state");
    assert_eq!(committed["committed"], true, "{committed}");
    let sock = gms.socket.to_string_lossy().into_owned();
    let hs = format!("{}ms", HANDSHAKE.as_millis());
    let gms_flags = [
        "--gms",
        sock.as_str(),
        "--gms-handshake-timeout",
        hs.as_str(),
    ];

    let primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
    );
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let mut shadow = c.start(
        &SupOpts::new(1, "shadow")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
    );
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    // The shadow remembered the committed layout at Standby.
    assert!(
        wait_until(T, Duration::from_millis(20), || shadow
            .log_text()
            .contains("remembered committed layout at standby")),
        "{}",
        c.dump_logs()
    );
    // A next waiter without GMS checks (queued behind the shadow).
    let next = c.start(&SupOpts::new(2, "shadow"));
    assert!(next.wait_phase("standby", T), "{}", c.dump_logs());

    // GMS crash + restart while both sleep: it comes back empty.
    gms.kill();
    gms.restart();
    let empty = gms.state().expect("restarted gmsd state");
    assert_eq!(empty["committed"], false, "{empty}");

    let old = primary.wait_engine_pids(1, T);
    // SAFETY: kill(2) on the engine pid we just read.
    unsafe { libc::kill(old[0], libc::SIGKILL) };

    // Read the dying shadow's /state while it lingers (after its lock was closed).
    let mut dead_state = serde_json::Value::Null;
    assert!(
        wait_until(T, Duration::from_millis(10), || {
            dead_state = shadow.state().unwrap_or_default();
            dead_state["marks"]["lock_closed"].is_i64()
        }),
        "shadow did not fence{}",
        c.dump_logs()
    );
    assert_eq!(dead_state["state"], "dead", "{dead_state}");
    let granted = dead_state["marks"]["lock_granted"]
        .as_i64()
        .expect("granted");
    let failed = dead_state["marks"]["gpu_check_failed"]
        .as_i64()
        .expect("gpu_check_failed mark");
    let dead_at = dead_transition_at(&dead_state);
    assert!(
        failed >= granted && dead_at >= failed,
        "granted {granted} failed {failed} dead {dead_at}"
    );
    // Fail fast: from the grant to Dead within the handshake timeout (no read-lock hang).
    eprintln!(
        "grant -> check failed {} us, grant -> dead {} us",
        failed - granted,
        dead_at - granted
    );
    assert!(
        dead_at - granted < HANDSHAKE.as_micros() as i64,
        "grant -> dead took {} us{}",
        dead_at - granted,
        c.dump_logs()
    );
    let dead_reason = dead_state["dead_reason"].as_str().unwrap_or_default();
    assert!(
        dead_reason.contains("no committed weights"),
        "{dead_reason}"
    );
    let st = shadow
        .proc
        .wait_exit(T)
        .unwrap_or_else(|| panic!("shadow did not exit{}", c.dump_logs()));
    assert_eq!(st.code(), Some(19), "exit status {st:?}{}", c.dump_logs());

    let log = shadow.log_text();
    assert!(
        log.contains("GMS holds no committed weights"),
        "cause not logged:\n{log}"
    );
    // Never woken: no wake call was made, no Active.
    assert!(!log.contains("waking engine"), "engine was woken:\n{log}");
    assert!(failover_tests::transition_at(&dead_state, "active").is_none());

    assert!(
        next.wait_phase("active", T),
        "the lock did not pass on to the next waiter{}",
        c.dump_logs()
    );
    assert!(wait_until(T, Duration::from_millis(50), || c
        .lockd
        .holder("engine")
        .as_deref()
        == Some("engine-2")));
    let (code, body) = next.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["engine_id"], 2);
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}

/// Wall-clock time of the transition into Dead.
fn dead_transition_at(state: &serde_json::Value) -> i64 {
    failover_tests::transition_at(state, "dead").expect("dead transition")
}
