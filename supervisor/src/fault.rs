//! Test-only fault switches: they reintroduce known bugs so that the drill and the tests can
//! show that their checks fail when the protection is missing. The switches only act in a
//! supervisor built with the `planted-bug-early-release` feature (never a release build); the
//! names of their environment variables are always here, so the drill can tell the user.

#[cfg(feature = "planted-bug-early-release")]
use std::time::Duration;

/// `SUPERVISOR_PLANTED_BUG_EARLY_RELEASE=1` (or a duration, e.g. `2s`): release the lease
/// before the engine is dead ([`planted_bug_early_release`]).
pub const EARLY_RELEASE_ENV: &str = "SUPERVISOR_PLANTED_BUG_EARLY_RELEASE";

/// `SUPERVISOR_PLANTED_BUG_NO_ANCHOR=1`: run without the lock anchor, i.e. with the behaviour
/// before issue 15 (after a lockd restart only a lock keeper that watches the engine's main
/// process holds the lease, so workers that outlive the engine are not covered).
pub const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

/// Whether [`NO_ANCHOR_ENV`] is set to a true value.
#[cfg(feature = "planted-bug-early-release")]
pub fn planted_bug_no_anchor() -> bool {
    std::env::var(NO_ANCHOR_ENV)
        .map(|v| !matches!(v.trim(), "" | "0" | "false"))
        .unwrap_or(false)
}

/// TEST-ONLY planted bug: when [`EARLY_RELEASE_ENV`] is `1` (or a duration, e.g. `2s`), the
/// supervisor calls this at the start of fencing. It releases the lease while the engine tree
/// is still alive, then waits (default 1s, standing for an engine that takes time to die)
/// before the normal fencing kills the tree. The drill must catch it: the next holder is
/// granted while the old engine's processes are alive, and a fake engine whose detached
/// workers still hold the GPU claim makes the new engine's claim fail.
#[cfg(feature = "planted-bug-early-release")]
pub async fn planted_bug_early_release(lock: &mut lockd::client::LockClient, resource: &str) {
    let Ok(v) = std::env::var(EARLY_RELEASE_ENV) else {
        return;
    };
    let delay = match v.trim() {
        "" | "0" | "false" => return,
        "1" | "true" => Duration::from_secs(1),
        other => humantime::parse_duration(other).unwrap_or(Duration::from_secs(1)),
    };
    tracing::error!(
        delay_ms = delay.as_millis() as u64,
        "PLANTED BUG: releasing the lease before the engine is dead"
    );
    if let Err(e) = lock.release(resource).await {
        tracing::error!(error = %e, "PLANTED BUG: release failed");
    }
    tokio::time::sleep(delay).await;
}
