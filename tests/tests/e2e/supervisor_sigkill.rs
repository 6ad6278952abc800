//! Primary's supervisor SIGKILLed -> its engine and workers die (PDEATHSIG); the shadow takes
//! over only after they are gone (the lock connection is shared with the engine's processes).

use std::time::Duration;

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn supervisor_sigkill_kills_engine_and_shadow_waits_for_it() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").engine(&["--workers", "2"]),
        &SupOpts::new(1, "shadow").engine(&["--workers", "2"]),
        T,
    );
    assert_eq!(primary.completion().unwrap().0, 200);
    let old = primary.wait_engine_pids(3, T);
    assert_eq!(old.len(), 3);

    assert!(primary.proc.signal(Signal::SIGKILL));
    assert!(primary.proc.wait_exit(T).is_some());

    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    // Every old process is dead, and the shadow's wake found the GPU claim free: had any old
    // process still been alive at grant time, its inherited claim would have made the wake
    // fail with a recorded violation.
    assert!(
        old.iter().all(|p| !alive(*p)),
        "old engine processes alive: {old:?}"
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    let (code, body) = shadow.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)));
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-1"));
}
