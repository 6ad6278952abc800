//! The driver's telemetry that is not a state transition: the container restart counter file
//! and the GPU checks' counters copied into `/metrics`.

use std::sync::atomic::Ordering;

use gms_client::checks::GpuChecks;
use probes::ProbeState;

use crate::config::RunArgs;

pub(super) fn bump_restart_counter(args: &RunArgs, state: &ProbeState) {
    let Some(path) = &args.restart_counter else {
        return;
    };
    let prev: u64 = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    state
        .metrics()
        .engine_restarts
        .store(prev, Ordering::Relaxed);
    let tmp = path.with_extension("tmp");
    let res =
        std::fs::write(&tmp, format!("{}\n", prev + 1)).and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "cannot update restart counter");
    }
}

/// Copy the GPU checks' counters into the `/metrics` registry.
pub(super) fn sync_check_metrics(checks: &GpuChecks, state: &ProbeState) {
    let c = checks.counters();
    let m = state.metrics();
    m.gpu_wake_checks.store(c.wake_checks, Ordering::Relaxed);
    m.gpu_wake_check_failures
        .store(c.wake_failures, Ordering::Relaxed);
    m.gpu_reap_checks.store(c.reap_checks, Ordering::Relaxed);
    m.gpu_reap_timeouts
        .store(c.reap_timeouts, Ordering::Relaxed);
    m.gpu_engine_processes_seen
        .store(c.engine_processes_seen, Ordering::Relaxed);
}
