//! lockd restarted while the primary is Active: the primary keeps serving through the
//! reconnect window and never leaves Active.

use std::time::{Duration, Instant};

use failover_tests::{wait_until, Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn primary_stays_active_across_a_lockd_restart() {
    let mut c = Cluster::new("3s");
    let primary = c.start(&SupOpts::new(0, "primary").sup(&["--lock-reconnect-timeout", "8s"]));
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow").sup(&["--lock-reconnect-timeout", "8s"]));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    let epoch = primary.state().unwrap()["epoch"].as_u64().unwrap();

    c.lockd.kill();
    std::thread::sleep(Duration::from_millis(500));
    c.lockd.restart();

    // Watch both for 5 s (past the 3 s reconnect window): the primary never leaves Active
    // and stays ready; the shadow stays in Standby.
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        assert_eq!(
            primary.phase().as_deref(),
            Some("active"),
            "{}",
            c.dump_logs()
        );
        assert_eq!(primary.probe("/ready"), Some(200));
        assert_eq!(
            shadow.phase().as_deref(),
            Some("standby"),
            "{}",
            c.dump_logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = primary.state().unwrap();
    assert_eq!(st["transitions"].as_array().unwrap().len(), 2, "{st}");
    assert!(
        st["marks"]["lock_reclaimed"].as_i64().is_some(),
        "no reclaim recorded: {st}"
    );
    assert_eq!(st["epoch"].as_u64(), Some(epoch), "reclaim keeps the epoch");
    assert!(wait_until(T, Duration::from_millis(50), || c
        .lockd
        .holder("engine")
        .as_deref()
        == Some("engine-0")));
    assert!(primary
        .log_text()
        .contains("lock connection re-established"));
}
