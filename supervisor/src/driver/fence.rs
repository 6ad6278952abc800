//! Fencing's GPU part: after the tree was killed and reaped, wait (bounded) until the device
//! shows the dead engine's memory released, before the lock connection is closed (Decision 7).

use std::time::Duration;

use gms_client::checks::GpuChecks;
use probes::ProbeState;

use super::telemetry::sync_check_metrics;
use crate::config::RunArgs;

/// `GpuChecks::after_reap` with the pids fencing saw. A timeout is logged at error and counted,
/// and the lock is released anyway (README.md, "GPU/GMS checks"): the whole tree is provably
/// dead, so what still pins the memory is out of the supervisor's reach, and holding the lock
/// would block failover for good; the next engine's `--min-free-memory` wait gates its wake.
pub(super) async fn after_reap_check(
    checks: &GpuChecks,
    pids: &[i32],
    args: &RunArgs,
    state: &ProbeState,
) {
    let pids: Vec<u32> = pids.iter().filter_map(|p| u32::try_from(*p).ok()).collect();
    // after_reap bounds itself; the outer bound only guards against a hung device query.
    let bound = args.memory_release_timeout + Duration::from_secs(5);
    match tokio::time::timeout(bound, checks.after_reap(&pids)).await {
        Ok(Ok(rep)) => {
            tracing::info!(
                matched_by = ?rep.matched_by,
                waited_ms = rep.waited.as_millis() as u64,
                engine_processes_seen = rep.engine_processes_seen,
                free_before = ?rep.free_before,
                free_after = ?rep.free_after,
                "GPU memory check after reap passed"
            );
        }
        Ok(Err(e)) => {
            tracing::error!(cause = %e, "GPU memory of the dead engine NOT released in time; releasing the lock anyway (the next engine may OOM)");
        }
        Err(_) => {
            tracing::error!(
                bound_ms = bound.as_millis() as u64,
                "GPU memory check after reap hung; releasing the lock anyway"
            );
        }
    }
    state.mark(probes::MarkKind::MemoryReleaseChecked);
    sync_check_metrics(checks, state);
}
