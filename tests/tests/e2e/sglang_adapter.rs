//! `--adapter sglang`: the shadow sleeps through `/release_memory_occupation` and wakes through
//! `/resume_memory_occupation` (the fake engine serves both), and takes over on failover.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;

const T: Duration = Duration::from_secs(20);

#[test]
fn sglang_shadow_sleeps_and_takes_over() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").adapter("sglang"),
        &SupOpts::new(1, "shadow").adapter("sglang"),
        T,
    );
    // Asleep: the engine refuses completions.
    assert_eq!(shadow.completion().unwrap().0, 503);

    assert!(primary.proc.signal(Signal::SIGTERM));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert_eq!(shadow.probe("/ready"), Some(200));
    let (code, body) = shadow.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)));
    assert!(c.violations().is_empty());
}
