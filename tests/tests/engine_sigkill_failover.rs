//! Primary's engine SIGKILLed -> shadow Active; the old supervisor exits non-zero; no process
//! of the old engine is alive when the shadow's lock is granted.

use std::time::Duration;

use failover_tests::{alive, transition_at, wait_until, Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn engine_sigkill_fails_over_after_the_old_tree_is_dead() {
    let mut c = Cluster::new("2s");
    let mut primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--linger", "3s"])
            .engine(&["--workers", "2"]),
    );
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow").engine(&["--workers", "2"]));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    // The active engine takes its GPU claim on first serve.
    assert_eq!(primary.completion().unwrap().0, 200);
    let old = primary.wait_engine_pids(3, T);
    assert_eq!(old.len(), 3);

    // SAFETY: kill(2) on the engine pid we just read.
    unsafe { libc::kill(old[0], libc::SIGKILL) };

    assert!(
        shadow.wait_phase("active", T),
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
    assert_eq!(old_state["state"], "dead");
    let fenced = old_state["marks"]["fenced"].as_i64().unwrap();
    let closed = old_state["marks"]["lock_closed"].as_i64().unwrap();
    let new_state = shadow.state().unwrap();
    let granted = new_state["marks"]["lock_granted"].as_i64().unwrap();
    assert!(
        fenced <= closed && closed <= granted,
        "fenced {fenced} closed {closed} granted {granted}"
    );
    assert!(transition_at(&new_state, "waking").unwrap() >= granted);
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
