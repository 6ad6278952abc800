//! Fencing against real processes. Fencing kills and reaps every descendant of the calling
//! process, so each test here holds the binary's exclusive [`serial`] guard: no other test's
//! process exists meanwhile.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::serial;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use supervisor::process::{
    become_subreaper, fence, has_children, live_descendants, spawn_engine, tree_pids, Engine,
    EngineSpec, ProcessEnd,
};

/// A shell that starts a detached (setsid), SIGTERM-ignoring grandchild. Fencing with a grace
/// period must escalate to SIGKILL, kill both, reap everything, and leave no child at all.
#[tokio::test]
async fn fence_kills_detached_grandchildren() {
    let _guard = serial();
    let mut eng = engine_with_a_detached_grandchild("sleep 30");
    let t = Instant::now();
    while live_descendants().len() < 3 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(live_descendants().len() >= 3, "tree did not start");
    // The grandchild exists before its shell has run `trap "" TERM`: wait until the kernel
    // shows SIGTERM ignored, or a SIGTERM that arrives first kills it and nothing escalates.
    let t = Instant::now();
    while !live_descendants().iter().any(|p| ignores_sigterm(p.pid)) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the grandchild never ignored SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fast: HashSet<i32> = tree_pids().into_iter().collect();
    let full: HashSet<i32> = live_descendants().iter().map(|p| p.pid).collect();
    assert!(
        full.is_subset(&fast),
        "children lists missed {full:?} vs {fast:?}"
    );
    assert!(has_children());
    let report = fence(&mut eng, false, Duration::from_millis(300)).await;
    assert!(
        report.escalated,
        "the TERM-ignoring grandchild needed SIGKILL"
    );
    assert!(report.alive_at_start >= 3);
    assert!(live_descendants().is_empty());
    assert!(!has_children());
    assert!(report.engine_status.is_some());
    assert!(report.duration >= Duration::from_millis(250));
    assert!(eng.has_exited());
}

/// Urgent fencing of an engine that already died: its orphans are SIGKILLed at once.
#[tokio::test]
async fn urgent_fence_does_not_wait_for_the_grace_period() {
    // Fencing kills every descendant of this process: never run beside another test.
    let _guard = serial();
    let mut eng = engine_with_a_detached_grandchild("exit 0");
    eng.exited().await;
    let report = fence(&mut eng, true, Duration::from_secs(30)).await;
    assert!(report.duration < Duration::from_secs(5), "{report:?}");
    assert_eq!(report.engine_status, Some(ProcessEnd::Exited(0)));
    assert_eq!(
        report.engine_status.map(|s| s.to_string()).as_deref(),
        Some("exit 0")
    );
    assert!(!has_children());
}

/// Makes this process a subreaper, reaps earlier tests' leftovers, and starts an engine
/// `sh -c 'setsid sh -c <loop ignoring SIGTERM> & THEN'`: a detached, SIGTERM-ignoring
/// grandchild.
fn engine_with_a_detached_grandchild(then: &str) -> Engine {
    become_subreaper().unwrap();
    reap_leftovers();
    let spec = EngineSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            format!("setsid sh -c 'trap \"\" TERM; while :; do sleep 0.05; done' & {then}").into(),
        ],
        env: vec![],
        pid_namespace: false,
    };
    spawn_engine(&spec, &[]).unwrap()
}

/// Whether `pid` ignores SIGTERM, from the `SigIgn` mask in /proc/PID/status.
fn ignores_sigterm(pid: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (Signal::SIGTERM as i32 - 1)) != 0)
}

/// Reaps zombie children left by earlier tests of this binary (orphans reparented to this
/// process once it became a subreaper), so that `has_children()` speaks of this test only.
/// Called under [`serial`]: no other test has a child to wait for.
fn reap_leftovers() {
    while let Ok(st) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
        if st == WaitStatus::StillAlive {
            break;
        }
    }
    assert!(
        live_descendants().is_empty(),
        "processes of another test still run: {:?}",
        live_descendants()
    );
}
