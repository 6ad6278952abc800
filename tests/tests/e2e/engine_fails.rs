//! Engine fails during init or during sleep: Dead, fenced, non-zero exit, a clear log line.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn engine_failing_in_init_ends_dead_with_exit_10() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut s = c.start(&SupOpts::new(1, "shadow").engine(&[
        "--fail-at",
        "init",
        "--init",
        "200ms",
        "--workers",
        "1",
    ]));
    let st = s.proc.wait_exit(T).expect("supervisor did not exit");
    assert_eq!(st.code(), Some(10), "{st:?}{}", c.dump_logs());
    let log = s.log_text();
    assert!(log.contains("injected failure at init"), "{log}");
    assert!(
        log.contains("engine exited") && log.contains("exit 3"),
        "{log}"
    );
    assert!(log.contains("no engine process left"), "{log}");
    // The pid file (written before the load) names the engine and its worker: both dead.
    let pids = s.wait_engine_pids(2, Duration::ZERO);
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "engine not fenced: {pids:?}"
    );
}

#[test]
fn engine_failing_in_sleep_is_fenced_with_exit_12() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut s = c.start(
        &SupOpts::new(1, "shadow")
            .sup(&["--stop-grace", "2s"])
            .engine(&["--fail-at", "sleep", "--workers", "2"]),
    );
    let pids = s.wait_engine_pids(3, T);
    assert_eq!(pids.len(), 3);
    let st = s.proc.wait_exit(T).expect("supervisor did not exit");
    assert_eq!(st.code(), Some(12), "{st:?}{}", c.dump_logs());
    let log = s.log_text();
    assert!(
        log.contains("sleep call failed") && log.contains("injected failure at sleep"),
        "{log}"
    );
    // The engine was alive (it answered 500) and had to be killed: nothing is left.
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "engine not fenced: {pids:?}"
    );
    assert!(log.contains("no engine process left"), "{log}");
}
