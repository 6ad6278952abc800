//! The engine's processes on a simulated device (`gms_client::simdev`): registered with their
//! bytes while the model is loaded / awake, unregistered on sleep.

use std::path::Path;

/// Register `pids` with `bytes` each on the simulated GPU in `dir`.
pub fn register(dir: &Path, pids: &[u32], bytes: u64) {
    for p in pids {
        if let Err(e) = gms_client::simdev::register(dir, *p, bytes) {
            tracing::warn!(target: "fake_engine", pid = p, error = %e, "gpu-sim: cannot register");
        }
    }
    tracing::info!(target: "fake_engine", pids = ?pids, bytes, "gpu-sim: allocated");
}

/// Unregister `pids` (their memory is released).
pub fn unregister(dir: &Path, pids: &[u32]) {
    for p in pids {
        if let Err(e) = gms_client::simdev::unregister(dir, *p) {
            tracing::warn!(target: "fake_engine", pid = p, error = %e, "gpu-sim: cannot unregister");
        }
    }
}
