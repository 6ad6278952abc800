//! Primary's engine SIGKILLed -> shadow Active; the old supervisor exits non-zero; no process
//! of the old engine is alive when the shadow's lock is granted.

use std::time::Duration;

use harness::{kill, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn engine_sigkill_fails_over_after_the_old_tree_is_dead() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--linger", "3s"])
            .engine(&["--workers", "2"]),
        &SupOpts::new(1, "shadow").engine(&["--workers", "2"]),
        T,
    );
    // The active engine takes its GPU claim on first serve.
    assert_eq!(primary.completion().unwrap().0, 200);
    let old = primary.wait_engine_pids(3, T);
    assert_eq!(old.len(), 3);

    assert!(kill(old[0], Signal::SIGKILL), "engine {} is gone", old[0]);

    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    assert_eq!(shadow.probe("/ready"), Some(200));
    let (code, body) = shadow.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["engine_id"], 1);

    // Ordering, from wall-clock marks: the old tree was gone and its lock connection closed
    // before the shadow's grant.
    let old_state = primary.state().expect("old supervisor lingers with /state");
    assert_eq!(old_state.state, Phase::Dead);
    let fenced = old_state.mark(MarkKind::Fenced).expect("fenced mark");
    let closed = old_state
        .mark(MarkKind::LockClosed)
        .expect("lock_closed mark");
    let new_state = shadow.state().unwrap();
    let granted = new_state
        .mark(MarkKind::LockGranted)
        .expect("lock_granted mark");
    assert!(
        fenced <= closed && closed <= granted,
        "fenced {fenced} closed {closed} granted {granted}"
    );
    assert!(new_state.entered(Phase::Waking).expect("waking transition") >= granted);
    // The GPU claim (held by every old process) was free at wake: no split brain.
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    assert!(old.iter().all(|p| !alive(*p)), "old engine processes alive");

    let st = primary
        .proc
        .wait_exit(T)
        .expect("old supervisor did not exit");
    assert_eq!(st.code(), Some(10), "exit status {st:?}");
    assert!(wait_until(T, Duration::from_millis(50), || c
        .lockd
        .holder("engine")
        .as_deref()
        == Some("engine-1")));
}
