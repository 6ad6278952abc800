//! Decision 6: the GMS is killed and restarted EMPTY while the shadow sleeps. When the shadow
//! is granted the lock it must not wake its engine into a read-lock hang: its before-wake check
//! fails fast (Dead, exit 19, within the GMS handshake timeout), the log names the cause, and
//! the lock passes on to the next waiter.

use std::time::Duration;

use harness::{kill, wait_until, Cluster, Gmsd, GmsdSpec, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase, StateDoc};

const T: Duration = Duration::from_secs(20);
/// `--gms-handshake-timeout` of the supervisors under test.
const HANDSHAKE: Duration = Duration::from_secs(2);

#[test]
fn shadow_fails_fast_when_gms_restarted_empty_and_lock_passes_on() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut gms = Gmsd::start(GmsdSpec::new(c.dir.path().join("gms.sock")).backend("host"));
    gms.load(4);
    let committed = gms.state().expect("gmsd state");
    assert_eq!(committed["committed"], true, "{committed}");
    let sock = gms.socket().to_string_lossy().into_owned();
    let hs = format!("{}ms", HANDSHAKE.as_millis());
    let gms_flags = [
        "--gms",
        sock.as_str(),
        "--gms-handshake-timeout",
        hs.as_str(),
    ];

    let (primary, mut shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
        &SupOpts::new(1, "shadow")
            .sup(&gms_flags)
            .sup(&["--linger", "3s"]),
        T,
    );
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
    assert!(next.wait_phase(Phase::Standby, T), "{}", c.dump_logs());

    // GMS crash + restart while both sleep: it comes back empty.
    gms.kill();
    gms.restart();
    let empty = gms.state().expect("restarted gmsd state");
    assert_eq!(empty["committed"], false, "{empty}");

    let old = primary.wait_engine_pids(1, T);
    assert!(kill(old[0], Signal::SIGKILL), "{} is gone", old[0]);

    // Read the dying shadow's /state while it lingers (after its lock was closed).
    let dead_state: StateDoc = shadow
        .wait_mark(MarkKind::LockClosed, T)
        .unwrap_or_else(|| panic!("shadow did not fence{}", c.dump_logs()));
    assert_eq!(dead_state.state, Phase::Dead, "{dead_state:?}");
    let granted = dead_state.mark(MarkKind::LockGranted).expect("granted");
    let failed = dead_state
        .mark(MarkKind::GpuCheckFailed)
        .expect("gpu_check_failed mark");
    let dead_at = dead_state.entered(Phase::Dead).expect("dead transition");
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
    let dead_reason = dead_state.dead_reason.as_deref().expect("dead_reason");
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
    assert!(dead_state.entered(Phase::Active).is_none());

    assert!(
        next.wait_phase(Phase::Active, T),
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
