//! `--adapter sglang`: the shadow sleeps through `/release_memory_occupation` and wakes through
//! `/resume_memory_occupation` (the fake engine serves both), and takes over on failover.

use std::time::Duration;

use failover_tests::{Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn sglang_shadow_sleeps_and_takes_over() {
    let mut c = Cluster::new("2s");
    let mut p = SupOpts::new(0, "primary");
    p.adapter = "sglang";
    let primary = c.start(&p);
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let mut s = SupOpts::new(1, "shadow");
    s.adapter = "sglang";
    let shadow = c.start(&s);
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    // Asleep: the engine refuses completions.
    assert_eq!(shadow.completion().unwrap().0, 503);

    primary.proc.signal(libc::SIGTERM);
    assert!(shadow.wait_phase("active", T), "{}", c.dump_logs());
    assert_eq!(shadow.probe("/ready"), Some(200));
    let (code, body) = shadow.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)));
    assert!(c.violations().is_empty());
}
