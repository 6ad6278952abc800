//! Decision 7 on a simulated device: after the dead engine's tree is reaped, the supervisor
//! keeps the lock until the device no longer lists the engine's processes (and its memory came
//! back); only then is the next waiter granted.

use std::time::Duration;

use probes::{MarkKind, Phase};

use crate::gms_reap_common;

#[test]
fn lock_is_held_until_the_engine_leaves_the_device() {
    gms_reap_common::in_own_process(
        "gms_reap_holds_lock::lock_is_held_until_the_engine_leaves_the_device",
        scenario,
    );
}

fn scenario() {
    let hold = Duration::from_millis(1500);
    let r = gms_reap_common::run(Duration::from_secs(20), Some(hold));
    assert_eq!(r.exit_code, 10, "{r:?}");
    // While the device still listed the engine: fenced (tree dead), lock not yet closed,
    // nobody else granted.
    let st = r.state_while_waiting.as_ref().expect("state while waiting");
    assert_eq!(st.state, Phase::Dead, "{st:?}");
    assert!(st.mark(MarkKind::Fenced).is_some(), "{st:?}");
    assert!(st.mark(MarkKind::LockClosed).is_none(), "{st:?}");
    assert!(!r.granted_while_waiting, "granted while memory was pinned");
    let removed = r.removed_at.expect("removed");
    assert!(r.waiter_granted_at >= removed, "{r:?}");
    assert!(
        r.waiter_granted_at - removed < Duration::from_secs(5),
        "lock not released promptly after the memory came back: {r:?}"
    );
    assert_eq!(r.counters.reap_checks, 1, "{r:?}");
    assert_eq!(r.counters.reap_timeouts, 0, "{r:?}");
    assert_eq!(r.counters.engine_processes_seen, 1, "{r:?}");
    assert_eq!(
        harness::metrics::Metrics::parse(&r.metrics)
            .series("supervisor_gpu_engine_processes_seen_total{engine_id=\"0\",role=\"primary\"}"),
        1.0
    );
}
