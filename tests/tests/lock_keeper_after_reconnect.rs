//! After lockd restarts, the supervisor's new lock connection is not held by the (already
//! running) engine. A lock keeper (a forked child holding the new connection until the engine
//! has exited) keeps a supervisor crash from releasing the lock while the engine lives. The
//! engine here clears its PDEATHSIG (`--survive-supervisor`) so that it outlives the
//! supervisor: without the keeper, the shadow would be granted at once and its wake would find
//! the GPU claim held (a recorded split brain).

use std::time::{Duration, Instant};

use failover_tests::{alive, wait_until, Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn keeper_holds_the_reconnected_lock_until_the_engine_dies() {
    let mut c = Cluster::new("2s");
    let mut primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--lock-reconnect-timeout", "8s"])
            .engine(&["--survive-supervisor"]),
    );
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow").sup(&["--lock-reconnect-timeout", "8s"]));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    assert_eq!(primary.completion().unwrap().0, 200);
    let engine = primary.wait_engine_pids(1, T)[0];

    c.lockd.kill();
    c.lockd.restart();
    assert!(
        wait_until(T, Duration::from_millis(20), || {
            primary
                .state()
                .is_some_and(|s| s["marks"]["lock_reclaimed"].is_i64())
                && c.lockd.holder("engine").as_deref() == Some("engine-0")
        }),
        "no reclaim{}",
        c.dump_logs()
    );
    let marks = &primary.state().unwrap()["marks"];
    assert!(marks["lock_keeper_spawned"].is_i64(), "no keeper: {marks}");
    assert_eq!(primary.phase().as_deref(), Some("active"));

    primary.proc.signal(libc::SIGKILL);
    assert!(primary.proc.wait_exit(T).is_some());
    assert!(
        alive(engine),
        "the engine was meant to outlive its supervisor"
    );
    let end = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < end {
        assert_eq!(
            shadow.phase().as_deref(),
            Some("standby"),
            "lock released while the engine lives{}",
            c.dump_logs()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-0"));

    // SAFETY: kill(2) on the engine pid from its pid file.
    unsafe { libc::kill(engine, libc::SIGKILL) };
    assert!(shadow.wait_phase("active", T), "{}", c.dump_logs());
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}
