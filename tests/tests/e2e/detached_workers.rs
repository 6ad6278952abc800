//! `--workers 2 --detach-workers`: the workers setsid() and ignore SIGTERM; the supervisor
//! (a child subreaper) still finds them, SIGKILLs them as soon as the engine's main process
//! has exited (not after the grace period: they could only delay the handover), and only then
//! releases the lock.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn detached_workers_are_killed_before_the_lock_is_released() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--stop-grace", "700ms", "--linger", "3s"])
            .engine(&["--workers", "2", "--detach-workers"]),
        &SupOpts::new(1, "shadow"),
        T,
    );
    assert_eq!(primary.completion().unwrap().0, 200);
    let old = primary.wait_engine_pids(3, T);
    assert_eq!(old.len(), 3);

    // A requested stop: SIGTERM to the engine's main process; its detached workers are left.
    let t0 = harness::unix_us();
    assert!(primary.proc.signal(Signal::SIGTERM));

    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let old_state = primary.state().expect("old supervisor lingers");
    let fenced = old_state.mark(MarkKind::Fenced).expect("fenced mark");
    let closed = old_state
        .mark(MarkKind::LockClosed)
        .expect("lock_closed mark");
    let granted = shadow
        .state()
        .unwrap()
        .mark(MarkKind::LockGranted)
        .expect("lock_granted mark");
    // The workers died to SIGKILL once the engine had exited, well before the grace period
    // (700 ms), and before the release.
    assert!(
        fenced - t0 < 600_000,
        "fenced after {} us: the stop waited for the grace?",
        fenced - t0
    );
    assert!(
        fenced <= closed && closed <= granted,
        "fenced {fenced} closed {closed} granted {granted}"
    );
    assert!(
        old.iter().all(|p| !alive(*p)),
        "old processes alive: {old:?}"
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    assert!(
        primary
            .log_text()
            .contains("engine's main process exited; killing what is left of its tree"),
        "{}",
        primary.log_text()
    );

    // Asked to stop: exit 0.
    let st = primary
        .proc
        .wait_exit(T)
        .expect("old supervisor did not exit");
    assert_eq!(st.code(), Some(0), "{st:?}");
}
