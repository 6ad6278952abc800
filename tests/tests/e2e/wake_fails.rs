//! A failed wake call (engine answers 500) is Dead at once: no retry, the engine is fenced,
//! exit status 13, and the lock goes back to lockd.

use std::time::Duration;

use harness::{wait_until, Cluster, SupOpts};
use lockd::proto::LeaseState;
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn failed_wake_is_dead_fenced_exit_13() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let primary = c.start(&SupOpts::new(0, "primary"));
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let mut shadow =
        c.start(&SupOpts::new(1, "shadow").engine(&["--fail-at", "wake", "--workers", "1"]));
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    let pids = shadow.wait_engine_pids(2, T);
    assert!(primary.proc.signal(Signal::SIGTERM));
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
    // Back to lockd: the resource is listed, free, with no holder (neither the shadow nor
    // the stopped primary).
    assert!(
        wait_until(T, Duration::from_millis(50), || c
            .lockd
            .try_status()
            .is_ok_and(|s| s.resources.iter().any(|r| r.name == "engine"
                && r.state == LeaseState::Free
                && r.holder.is_none()))),
        "lock not released: {:?}{}",
        c.lockd.try_status(),
        c.dump_logs()
    );
}
