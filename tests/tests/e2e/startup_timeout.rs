//! An engine that does not come up within `--startup-timeout` is fenced: exit status 11.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn slow_init_past_the_startup_budget_is_fenced() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut s = c.start(
        &SupOpts::new(1, "shadow")
            .sup(&[
                "--startup-timeout",
                "1s",
                "--stop-grace",
                "300ms",
                "--linger",
                "1s",
            ])
            .engine(&["--init", "30s"]),
    );
    let pids = s.wait_engine_pids(1, T);
    // Issue 10: /startup passes once the engine is spawned (no longer after the model load)
    // and /live is 200 in Init until --startup-timeout, then 503 (the first version answered
    // 503 on both during the whole load).
    assert!(
        harness::wait_until(T, Duration::from_millis(10), || s.probe("/startup")
            == Some(200)),
        "/startup never 200 with the engine spawned{}",
        c.dump_logs()
    );
    assert!(
        harness::wait_until(T, Duration::from_millis(20), || s.probe("/live")
            == Some(503)),
        "/live never turned 503 after the startup timeout{}",
        c.dump_logs()
    );
    let st = s.proc.wait_exit(T).expect("supervisor did not exit");
    assert_eq!(st.code(), Some(11), "{st:?}{}", c.dump_logs());
    assert!(pids.iter().all(|p| !alive(*p)));
    assert!(s.log_text().contains("did not finish init in time"));
}
