//! Issue 10, crash loop: an engine that always fails at init is restarted with a growing
//! backoff (100 ms, 200 ms, 400 ms: from the supervisor's log and its `/state` over time), and
//! the supervisor exits non-zero, with the last incarnation's exit code, after
//! `--crash-loop-limit` restarts. `/live` stays 200 while it re-arms and turns 503 only once it
//! gives up.

use std::time::{Duration, Instant};

use harness::{Cluster, SupOpts};
use probes::Phase;

const T: Duration = Duration::from_secs(20);

/// The `backoff_ms=N` values of the supervisor's "re-arming" log lines, in order.
fn backoffs(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("re-arming a new one"))
        .filter_map(|l| {
            let v = l.split("backoff_ms=").nth(1)?;
            v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .collect()
}

#[test]
fn an_engine_failing_at_init_restarts_with_backoff_then_the_supervisor_gives_up() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let t0 = Instant::now();
    let mut s = c.start(
        &SupOpts::new(1, "shadow")
            .restart("on-failure")
            .sup(&[
                "--restart-backoff",
                "100ms",
                "--restart-backoff-max",
                "400ms",
                "--crash-loop-limit",
                "3",
            ])
            .engine(&["--fail-at", "init"]),
    );
    // Sample /state and /live until the supervisor exits.
    let mut seen: Vec<(u32, Phase)> = Vec::new();
    let mut live_bad_while_rearming = Vec::new();
    let status = loop {
        if let Some(st) = s.proc.wait_exit(Duration::from_millis(5)) {
            break st;
        }
        assert!(
            t0.elapsed() < T,
            "supervisor still running{}",
            c.dump_logs()
        );
        if let Some(doc) = s.state() {
            let at = (doc.incarnation, doc.state);
            if seen.last() != Some(&at) {
                seen.push(at);
            }
            // Until the last incarnation, Dead means "re-arming": alive.
            if doc.incarnation < 3 {
                let live = s.probe("/live");
                if live.is_some() && live != Some(200) {
                    live_bad_while_rearming.push((doc.incarnation, doc.state, live));
                }
            }
        }
    };
    let took = t0.elapsed();
    let log = s.log_text();
    assert_eq!(status.code(), Some(10), "{status:?}{}", c.dump_logs());
    assert_eq!(backoffs(&log), [100, 200, 400], "{log}");
    assert!(log.contains("crash_loop_limit"), "{log}");
    assert!(
        took >= Duration::from_millis(700),
        "three backoffs (700 ms) in {took:?}"
    );
    // Incarnations 0, 1, 2 seen Dead (each for its backoff) in order.
    let dead: Vec<u32> = seen
        .iter()
        .filter(|(_, p)| *p == Phase::Dead)
        .map(|(n, _)| *n)
        .collect();
    assert!(
        dead.windows(2).all(|w| w[0] < w[1]) && [0, 1, 2].iter().all(|n| dead.contains(n)),
        "{seen:?}"
    );
    assert!(
        live_bad_while_rearming.is_empty(),
        "/live not 200 while re-arming: {live_bad_while_rearming:?}"
    );
    eprintln!("crash loop: exit 10 after {took:?}; /state sequence {seen:?}");
}
