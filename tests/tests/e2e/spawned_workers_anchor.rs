//! Workers that closed every inherited descriptor (as Python's `spawn` start method does, which
//! `vllm serve` uses for its workers) hold neither the lock connection nor the socket anchor.
//! The supervisor pins every process of its engine's tree with a pidfd that lockd holds as a
//! *process anchor*, re-attached after a lockd restart: the lock does not move while any of
//! them lives, even with the supervisor SIGKILLed and the engine's main process dead (issue 15).

use std::time::Duration;

use harness::{kill, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};
use procfs::alive;

use crate::waits::{stays_standby, wait_reclaimed};

const T: Duration = Duration::from_secs(20);

#[test]
fn spawned_workers_without_lock_fds_keep_the_lock_through_process_anchors() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--lock-reconnect-timeout", "8s"])
            .engine(&[
                "--survive-supervisor",
                "--workers",
                "2",
                "--detach-workers",
                "--workers-close-lock-fds",
            ]),
        &SupOpts::new(1, "shadow").sup(&["--lock-reconnect-timeout", "8s"]),
        T,
    );
    let pids = primary.wait_engine_pids(3, T);
    let (engine, workers) = (pids[0], pids[1..].to_vec());
    assert_eq!(workers.len(), 2);
    // The workers really hold no lock descriptor: only sockets of their own, if any. Not
    // vacuous: each still holds the GPU claim file it inherited.
    let claim = c.claim.display().to_string();
    for w in &workers {
        let fds: Vec<String> = std::fs::read_dir(format!("/proc/{w}/fd"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|p| p.display().to_string())
            .collect();
        assert!(
            fds.contains(&claim),
            "worker {w} does not hold the GPU claim {claim}: {fds:?}"
        );
        assert!(
            !fds.iter().any(|f| f.starts_with("socket:")),
            "worker {w} still holds a socket: {fds:?}"
        );
    }
    // Pinned (the supervisor scans its tree every 100 ms). Asserted at the end, so that a
    // build without process anchors fails on what matters: the lock moving.
    // (A process started less than one scan before the supervisor dies is not pinned: the
    // documented window; the test waits for the workers to be pinned.)
    let pinned = wait_until(Duration::from_secs(3), Duration::from_millis(20), || {
        let log = primary.log_text();
        primary
            .state()
            .is_some_and(|s| s.mark(MarkKind::ProcessAnchorsAttached).is_some())
            && workers.iter().all(|w| {
                log.lines()
                    .any(|l| l.contains("pinned as lock anchors") && l.contains(&w.to_string()))
            })
    });

    // lockd restarts: the client re-attaches every process anchor before reclaiming.
    c.lockd.kill();
    c.lockd.restart();
    wait_reclaimed(&c, &primary, "engine-0", T);

    assert!(primary.proc.signal(Signal::SIGKILL));
    assert!(primary.proc.wait_exit(T).is_some());
    assert!(kill(engine, Signal::SIGKILL), "engine {engine} is gone");
    assert!(wait_until(T, Duration::from_millis(10), || !alive(engine)));
    assert!(workers.iter().all(|w| alive(*w)), "workers died too early");
    stays_standby(
        &c,
        &shadow,
        "engine-0",
        "workers without lock descriptors live",
    );

    for w in &workers {
        assert!(kill(*w, Signal::SIGKILL), "worker {w} is gone");
    }
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    assert!(pinned, "no process_anchors_attached mark");
}
