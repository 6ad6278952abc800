//! The memory-release wait is bounded: when the dead engine never leaves the (simulated)
//! device, the supervisor logs and counts the timeout and releases the lock anyway after
//! `--memory-release-timeout` (holding it forever would block failover for good).

mod gms_reap_common;

use std::time::Duration;

#[test]
fn memory_release_wait_is_bounded_and_counted() {
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
    assert!(
        r.metrics
            .contains("supervisor_gpu_reap_timeouts_total{engine_id=\"0\",role=\"primary\"} 1"),
        "{}",
        r.metrics
    );
}
