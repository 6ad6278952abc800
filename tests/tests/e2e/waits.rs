//! Waits shared by the anchor tests (`lock_keeper_after_reconnect`, `spawned_workers_anchor`):
//! the reclaim after a lockd restart, and "the lock does not move" for a while.

use std::time::Duration;

use harness::{holds_for, wait_until, Cluster, Sup};
use probes::{MarkKind, Phase, StateDoc};

/// Waits (up to `timeout`) until `sup` has reclaimed its lease after a lockd restart (its
/// `lock_reclaimed` mark) and lockd names `holder` again; panics with the logs otherwise.
/// Returns `sup`'s `/state` at that point.
pub fn wait_reclaimed(c: &Cluster, sup: &Sup, holder: &str, timeout: Duration) -> StateDoc {
    let mut doc = None;
    let ok = wait_until(timeout, Duration::from_millis(20), || {
        doc = sup
            .state()
            .filter(|s| s.mark(MarkKind::LockReclaimed).is_some());
        doc.is_some() && c.lockd.holder("engine").as_deref() == Some(holder)
    });
    assert!(ok, "no reclaim by {holder}{}", c.dump_logs());
    doc.expect("reclaimed state")
}

/// Asserts, sampling for one second, that `shadow` stays in Standby (the lock did not move
/// while `what`), and then that lockd still names `holder`.
pub fn stays_standby(c: &Cluster, shadow: &Sup, holder: &str, what: &str) {
    holds_for(
        Duration::from_millis(1000),
        Duration::from_millis(30),
        &format!("the shadow stays in Standby while {what}"),
        || match shadow.phase() {
            Some(Phase::Standby) => Ok(()),
            other => Err(format!("lock released: shadow {other:?}{}", c.dump_logs())),
        },
    );
    assert_eq!(
        c.lockd.holder("engine").as_deref(),
        Some(holder),
        "lock moved while {what}{}",
        c.dump_logs()
    );
}
