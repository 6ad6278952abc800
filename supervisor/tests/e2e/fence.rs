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

/// A shell that starts a detached (setsid), SIGTERM-ignoring grandchild. A stop signals the
/// shell alone; once it has exited, the grandchild is SIGKILLed at once (not after the grace
/// period: it could only delay the handover); everything is reaped and no child is left.
#[tokio::test]
async fn fence_kills_detached_grandchildren() {
    fence_detached_grandchild("sleep 30", false).await;
}

/// The same, but the engine's main process ignores SIGTERM too: everything is SIGKILLed when
/// the grace period ends.
#[tokio::test]
async fn fence_escalates_after_the_grace_when_the_main_process_ignores_sigterm() {
    fence_detached_grandchild("trap '' TERM; sleep 30", true).await;
}

async fn fence_detached_grandchild(then: &str, main_ignores_term: bool) {
    let _guard = serial();
    let mut eng = engine_with_a_detached_grandchild(then);
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
    if main_ignores_term {
        let t = Instant::now();
        while !ignores_sigterm(eng.pid) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the main process never ignored SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let report = fence(&mut eng, false, Duration::from_millis(300)).await;
    assert!(
        report.escalated,
        "the TERM-ignoring grandchild needed SIGKILL"
    );
    assert!(report.alive_at_start >= 3);
    assert!(live_descendants().is_empty());
    assert!(!has_children());
    assert!(report.engine_status.is_some());
    if main_ignores_term {
        assert!(report.duration >= Duration::from_millis(250), "{report:?}");
        assert_eq!(report.engine_status, Some(ProcessEnd::Signaled(9)));
    } else {
        assert!(report.duration < Duration::from_millis(250), "{report:?}");
        assert_eq!(report.engine_status, Some(ProcessEnd::Signaled(15)));
    }
    assert!(eng.has_exited());
}

/// A stopped main process that kills its own child and then hangs (as vLLM's API server does
/// when a client's stream can never finish): it is SIGKILLed once it has outlived its tree by
/// half a second, not at the end of the grace.
#[tokio::test]
async fn a_main_process_that_outlives_its_tree_is_killed_long_before_the_grace() {
    let _guard = serial();
    become_subreaper().unwrap();
    reap_leftovers();
    let spec = EngineSpec {
        argv: vec![
            "python3".into(),
            "-c".into(),
            "import signal, subprocess, time\nc = subprocess.Popen(['sleep', '100'])\nsignal.signal(signal.SIGTERM, lambda *_: c.kill())\nwhile True: time.sleep(1)".into(),
        ],
        env: vec![],
        pid_namespace: false,
    };
    let mut eng = spawn_engine(&spec, &[]).unwrap();
    let t = Instant::now();
    while live_descendants().len() < 2 || !term_in_mask(eng.pid, "SigCgt:") {
        assert!(t.elapsed() < Duration::from_secs(5), "tree did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = fence(&mut eng, false, Duration::from_secs(10)).await;
    assert!(report.escalated, "{report:?}");
    assert!(report.duration >= Duration::from_millis(450), "{report:?}");
    assert!(report.duration < Duration::from_secs(3), "{report:?}");
    assert_eq!(report.engine_status, Some(ProcessEnd::Signaled(9)));
    assert!(!has_children());
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

/// A real Python resource tracker (Python's `multiprocessing`, which vLLM's processes use):
/// an urgent fence spares it until the rest of the tree is dead, and it then unlinks the
/// shared memory registered with it. With the planted bug (the tracker SIGKILLed with the
/// rest), the shared memory stays behind: the check can fail.
#[tokio::test]
async fn urgent_fence_lets_pythons_resource_tracker_unlink_shared_memory() {
    let _guard = serial();
    let left = fence_a_python_tree_with_shared_memory(false).await;
    assert!(
        !left,
        "the resource tracker did not unlink the shared memory"
    );
    std::env::set_var(supervisor::fault::KILL_TRACKER_ENV, "1");
    let left = fence_a_python_tree_with_shared_memory(true).await;
    std::env::remove_var(supervisor::fault::KILL_TRACKER_ENV);
    assert!(
        left,
        "with the tracker SIGKILLed, its shared memory should stay"
    );
}

/// Start `python3` creating a named shared memory segment (which starts the resource tracker)
/// and sleeping, fence it urgently, return whether the segment is still in /dev/shm (removed
/// in any case before returning).
async fn fence_a_python_tree_with_shared_memory(planted: bool) -> bool {
    become_subreaper().unwrap();
    reap_leftovers();
    let name = format!("psm_fencetest_{}_{planted}", std::process::id());
    let path = std::path::Path::new("/dev/shm").join(&name);
    let script = format!(
        "from multiprocessing import shared_memory\nimport time\nshared_memory.SharedMemory(name='{name}', create=True, size=4096)\ntime.sleep(60)"
    );
    let spec = EngineSpec {
        argv: vec!["python3".into(), "-c".into(), script.into()],
        env: vec![],
        pid_namespace: false,
    };
    let mut eng = spawn_engine(&spec, &[]).unwrap();
    let t = Instant::now();
    let tracker = || {
        live_descendants()
            .iter()
            .any(|p| procfs::cmdline(p.pid).contains("multiprocessing.resource_tracker"))
    };
    while !(path.exists() && tracker()) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no shared memory and resource tracker"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = fence(&mut eng, true, Duration::from_secs(30)).await;
    let left = path.exists();
    let _ = std::fs::remove_file(&path);
    assert!(!has_children());
    if !planted {
        // Spared, the tracker outlived the rest of the tree.
        assert!(report.tracker_alone.is_some(), "{report:?}");
    }
    left
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
    term_in_mask(pid, "SigIgn:")
}

/// Whether SIGTERM is in the signal mask `field` (`SigIgn:`, `SigCgt:`) of /proc/PID/status.
fn term_in_mask(pid: i32, field: &str) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
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
