//! Hung wake (`--wake 1h`, `--waking-timeout 2s`): `/live` stays 200 while waking, turns 503
//! after the timeout, and the supervisor fences the engine and exits (status 14).

use std::time::Duration;

use harness::{unix_us, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn hung_wake_turns_live_503_and_fences() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (primary, mut shadow) = c.start_pair(
        &SupOpts::new(0, "primary"),
        &SupOpts::new(1, "shadow")
            .sup(&["--waking-timeout", "2s", "--linger", "3s"])
            .engine(&["--wake", "1h", "--workers", "1"]),
        T,
    );
    let pids = shadow.wait_engine_pids(2, T);

    // Make the shadow take over: stop the primary.
    assert!(primary.proc.signal(Signal::SIGTERM));
    assert!(shadow.wait_phase(Phase::Waking, T), "{}", c.dump_logs());
    let waking_at = shadow
        .state()
        .and_then(|s| s.entered(Phase::Waking))
        .expect("waking transition");
    assert_eq!(
        shadow.probe("/live"),
        Some(200),
        "live while waking within budget"
    );
    assert_eq!(shadow.probe("/ready"), Some(503));

    assert!(
        wait_until(Duration::from_secs(6), Duration::from_millis(20), || shadow
            .probe("/live")
            == Some(503)),
        "/live never turned 503{}",
        c.dump_logs()
    );
    // Wall clock of the first 503 seen vs the recorded entry into Waking: not before the budget.
    let live_503_at = unix_us();
    assert!(
        live_503_at - waking_at >= 1_990_000,
        "503 only {} us into the wake",
        live_503_at - waking_at
    );
    assert!(shadow.wait_phase(Phase::Dead, T));
    assert_eq!(
        shadow.state().unwrap().dead_reason.as_deref(),
        Some("waking timeout exceeded")
    );

    let st = shadow.proc.wait_exit(T).expect("supervisor did not exit");
    assert_eq!(st.code(), Some(14), "{st:?}");
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "engine not fenced: {pids:?}"
    );
    assert!(shadow.log_text().contains("waking timeout exceeded"));
}
