//! lockd stopped (SIGSTOP: a frozen host, a paused container) while the primary is Active:
//! with `--lock-watchdog`, the primary fences its engine once lockd has been silent for the
//! watchdog's limit (what keeps it safe when lockd runs on etcd, whose lease then expires),
//! well before its reconnect timeout, which a stopped lockd would never trigger.

use std::time::{Duration, Instant};

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn primary_fences_itself_when_lockd_is_silent_for_the_watchdog() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&[
                "--lock-watchdog",
                "600ms",
                "--lock-reconnect-timeout",
                "30s",
            ])
            .engine(&["--workers", "1"]),
    );
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let pids = primary.wait_engine_pids(2, T);
    // Answered pings: still Active after several limits.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(primary.phase(), Some(Phase::Active), "{}", c.dump_logs());
    c.lockd.signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    let st = primary.proc.wait_exit(T);
    let took = stopped.elapsed();
    c.lockd.signal(Signal::SIGCONT);
    eprintln!("primary fenced {took:?} after lockd stopped (watchdog 600ms)");
    let st = st.unwrap_or_else(|| panic!("primary did not fence itself{}", c.dump_logs()));
    assert_eq!(st.code(), Some(15), "{st:?}{}", c.dump_logs());
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "engine not fenced: {pids:?}"
    );
    // Silent for the limit (600 ms, last heard up to a ping period before the stop), then
    // the fence: far below the 30 s reconnect timeout.
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(5),
        "fenced {took:?} after lockd stopped"
    );
    assert!(
        primary.log_text().contains("watchdog"),
        "{}",
        primary.log_text()
    );
}
