//! The memory-release wait is bounded: when the dead engine never leaves the (simulated)
//! device, the supervisor logs and counts the timeout and releases the lock anyway after
//! `--memory-release-timeout` (holding it forever would block failover for good).

use std::time::Duration;

use crate::gms_reap_common;

#[test]
fn memory_release_wait_is_bounded_and_counted() {
    gms_reap_common::in_own_process(
        "gms_reap_bounded::memory_release_wait_is_bounded_and_counted",
        scenario,
    );
}

fn scenario() {
    let timeout = Duration::from_secs(1);
    let r = gms_reap_common::run(timeout, None);
    assert_eq!(r.exit_code, 10, "{r:?}");
    let after_kill = r.waiter_granted_at - r.killed_at;
    assert!(
        after_kill >= timeout,
        "lock released before the bound: {r:?}"
    );
    assert!(
        after_kill < timeout + Duration::from_secs(5),
        "lock held past the bound: {r:?}"
    );
    assert_eq!(r.counters.reap_checks, 1, "{r:?}");
    assert_eq!(r.counters.reap_timeouts, 1, "{r:?}");
    assert_eq!(
        harness::metrics::Metrics::parse(&r.metrics)
            .series("supervisor_gpu_reap_timeouts_total{engine_id=\"0\",role=\"primary\"}"),
        1.0
    );
}
