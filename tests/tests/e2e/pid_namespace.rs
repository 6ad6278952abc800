//! `--pid-namespace`: the engine is PID 1 of its own PID namespace, so the kernel kills every
//! process it started (detached or not) the moment it dies. Needs CAP_SYS_ADMIN (CI runs as
//! root); without it the test checks that the supervisor refuses cleanly instead.

use std::time::Duration;

use harness::{kill, wait_until, Cluster, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

fn can_unshare_pid() -> bool {
    nix::unistd::geteuid().is_root()
}

fn engine_tree(c: &Cluster, s: &Sup) -> Vec<i32> {
    let mut tree = Vec::new();
    wait_until(T, Duration::from_millis(20), || {
        tree = procfs::live_descendants(s.proc.pid())
            .iter()
            .map(|p| p.pid)
            .collect();
        tree.len() >= 3
    });
    assert!(
        tree.len() >= 3,
        "engine + 2 workers expected, got {tree:?}{}",
        c.dump_logs()
    );
    tree
}

#[test]
fn engine_death_takes_detached_workers_with_it() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let opts = SupOpts::new(0, "primary")
        .sup(&["--pid-namespace", "--linger", "3s"])
        .engine(&["--workers", "2", "--detach-workers"]);
    let mut primary = c.start(&opts);
    if !can_unshare_pid() {
        let st = primary.proc.wait_exit(T).expect("must refuse");
        assert_eq!(st.code(), Some(1));
        assert!(primary.log_text().contains("CAP_SYS_ADMIN"));
        harness::skip(
            "pid_namespace::engine_death_takes_detached_workers_with_it",
            "not root: checked the refusal only, not the namespace's behaviour",
        );
        return;
    }
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow"));
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    assert_eq!(primary.completion().unwrap().0, 200);
    let tree = engine_tree(&c, &primary);
    let engine = primary.state().unwrap().engine_pid.expect("engine_pid") as i32;
    // Inside its namespace the engine is PID 1.
    assert_eq!(primary.completion().unwrap().1["pid"], 1);

    assert!(kill(engine, Signal::SIGKILL), "{} is gone", engine);
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(tree.iter().all(|p| !alive(*p)), "left alive: {tree:?}");
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    // The kernel had already killed the detached workers when the supervisor saw the exit.
    let log = primary.log_text();
    assert!(log.contains("alive_at_start=0"), "{log}");
    assert_eq!(primary.proc.wait_exit(T).and_then(|s| s.code()), Some(10));
}

#[test]
fn supervisor_sigkill_takes_detached_workers_with_it() {
    let _g = harness::serial();
    if !can_unshare_pid() {
        harness::skip(
            "pid_namespace::supervisor_sigkill_takes_detached_workers_with_it",
            "needs root (CAP_SYS_ADMIN) for --pid-namespace",
        );
        return;
    }
    let mut c = Cluster::new(Duration::from_secs(2));
    let primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--pid-namespace"])
            .engine(&["--workers", "2", "--detach-workers"]),
    );
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow"));
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    assert_eq!(primary.completion().unwrap().0, 200);
    let tree = engine_tree(&c, &primary);

    // Without a PID namespace, detached workers would survive this (and keep the lock: safe
    // but stuck). With it, PDEATHSIG kills the engine and the kernel kills the rest.
    assert!(primary.proc.signal(Signal::SIGKILL));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(tree.iter().all(|p| !alive(*p)), "left alive: {tree:?}");
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}
