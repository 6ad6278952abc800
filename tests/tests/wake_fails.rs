//! A failed wake call (engine answers 500) is Dead at once: no retry, the engine is fenced,
//! exit status 13, and the lock goes back to lockd.

use std::time::Duration;

use failover_tests::{alive, wait_until, Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn failed_wake_is_dead_fenced_exit_13() {
    let mut c = Cluster::new("2s");
    let primary = c.start(&SupOpts::new(0, "primary"));
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let mut shadow =
        c.start(&SupOpts::new(1, "shadow").engine(&["--fail-at", "wake", "--workers", "1"]));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    let pids = shadow.wait_engine_pids(2, T);
    primary.proc.signal(libc::SIGTERM);
    let st = shadow.proc.wait_exit(T).expect("shadow did not exit");
    assert_eq!(st.code(), Some(13), "{st:?}{}", c.dump_logs());
    let log = shadow.log_text();
    assert_eq!(
        log.matches("fake_engine: injected failure at wake").count(),
        1,
        "retried? {log}"
    );
    assert!(log.contains("wake call failed"), "{log}");
    assert!(pids.iter().all(|p| !alive(*p)));
    assert!(wait_until(T, Duration::from_millis(50), || c
        .lockd
        .status()
        .is_some_and(|s| s["resources"][0]["holder"].is_null())));
}
