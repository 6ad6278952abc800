//! lockd gone for longer than the client's reconnect timeout: the primary fences itself
//! (exit 15) instead of serving without a lock.

use std::time::{Duration, Instant};

use harness::{Cluster, SupOpts};
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn primary_fences_itself_when_lockd_stays_away() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--lock-reconnect-timeout", "2s"])
            .engine(&["--workers", "1"]),
    );
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let pids = primary.wait_engine_pids(2, T);
    c.lockd.kill();
    let killed = Instant::now();
    // Still Active within the reconnect timeout.
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(primary.phase(), Some(Phase::Active));
    let st = primary
        .proc
        .wait_exit(T)
        .expect("primary did not fence itself");
    assert!(
        killed.elapsed() >= Duration::from_millis(1500),
        "fenced before the reconnect timeout"
    );
    assert_eq!(st.code(), Some(15), "{st:?}{}", c.dump_logs());
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "engine not fenced: {pids:?}"
    );
    assert!(
        primary.log_text().contains("lock lost"),
        "{}",
        primary.log_text()
    );
}
