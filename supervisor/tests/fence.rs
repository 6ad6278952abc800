//! Fencing against real processes, in its own test process (fencing kills and reaps every
//! descendant of the calling process, so it must not share a process with other tests).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use supervisor::process::{
    become_subreaper, fence, has_children, live_descendants, spawn_engine, tree_pids, EngineSpec,
    ProcessEnd,
};

/// A shell that starts a detached (setsid), SIGTERM-ignoring grandchild. Fencing with a grace
/// period must escalate to SIGKILL, kill both, reap everything, and leave no child at all.
#[tokio::test]
async fn fence_kills_detached_grandchildren() {
    let _guard = SERIAL.lock().await;
    become_subreaper().unwrap();
    let spec = EngineSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "setsid sh -c 'trap \"\" TERM; while :; do sleep 0.05; done' & sleep 30".into(),
        ],
        env: vec![],
        pid_namespace: false,
    };
    let mut eng = spawn_engine(&spec, &[]).unwrap();
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
    // Fencing kills every descendant of this process: never run beside the other test.
    let _guard = SERIAL.lock().await;
    become_subreaper().unwrap();
    let spec = EngineSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "setsid sh -c 'trap \"\" TERM; while :; do sleep 0.05; done' & exit 0".into(),
        ],
        env: vec![],
        pid_namespace: false,
    };
    let mut eng = spawn_engine(&spec, &[]).unwrap();
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

/// Whether `pid` ignores SIGTERM, from the `SigIgn` mask in /proc/PID/status.
fn ignores_sigterm(pid: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGTERM - 1)) != 0)
}

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
