//! Test-only fault switches: they reintroduce known bugs so that the drill and the tests can
//! show that their checks fail when the protection is missing. The switches are compiled only
//! into debug builds (`cfg(debug_assertions)`: what `cargo test` and `cargo build` produce) or
//! with the `planted-bugs` feature; a release build (`cargo build --release`, the images) has
//! no code for them and ignores their variables ([`COMPILED`]). So the tests run the very
//! binaries every other test runs (no nested cargo build of a bugged variant), and no
//! production binary can be switched into a bug. The names of their environment variables are
//! always here, so the drill can tell the user.

#[cfg(any(debug_assertions, feature = "planted-bugs"))]
use std::time::Duration;

/// Whether this build carries the planted bugs (a debug build, or the `planted-bugs` feature).
pub const COMPILED: bool = cfg!(any(debug_assertions, feature = "planted-bugs"));

/// `SUPERVISOR_PLANTED_BUG_EARLY_RELEASE=1` (or a duration, e.g. `2s`): release the lease
/// before the engine is dead ([`planted_bug_early_release`]).
pub const EARLY_RELEASE_ENV: &str = "SUPERVISOR_PLANTED_BUG_EARLY_RELEASE";

/// `SUPERVISOR_PLANTED_BUG_NO_ANCHOR=1`: run without the lock anchor, i.e. with the behaviour
/// before issue 15 (after a lockd restart only a lock keeper that watches the engine's main
/// process holds the lease, so workers that outlive the engine are not covered).
pub const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

/// `SUPERVISOR_PLANTED_BUG_KILL_TRACKER=1`: a fence SIGKILLs Python's resource tracker with
/// the rest of the tree instead of sparing it, so that the shared memory registered with it
/// stays in /dev/shm (`process::fence`).
pub const KILL_TRACKER_ENV: &str = "SUPERVISOR_PLANTED_BUG_KILL_TRACKER";

/// Whether `var` is set to something other than empty, `0` or `false`.
fn switched_on(var: &str) -> bool {
    std::env::var(var)
        .map(|v| !matches!(v.trim(), "" | "0" | "false"))
        .unwrap_or(false)
}

/// Logs, once at start, every planted-bug switch that is set: as an error when this build
/// carries the bugs (they will act), as a warning when it does not (a release build ignores
/// them).
pub fn announce() {
    for var in [EARLY_RELEASE_ENV, NO_ANCHOR_ENV, KILL_TRACKER_ENV] {
        if !switched_on(var) {
            continue;
        }
        if COMPILED {
            tracing::error!(
                switch = var,
                "PLANTED BUG switched on: this supervisor is unsafe by design (test-only)"
            );
        } else {
            tracing::warn!(
                switch = var,
                "planted-bug switch ignored: a release build carries no planted bugs"
            );
        }
    }
}

/// Whether [`NO_ANCHOR_ENV`] is set to a true value.
#[cfg(any(debug_assertions, feature = "planted-bugs"))]
pub fn planted_bug_no_anchor() -> bool {
    switched_on(NO_ANCHOR_ENV)
}

/// Whether [`KILL_TRACKER_ENV`] is set to a true value.
#[cfg(any(debug_assertions, feature = "planted-bugs"))]
pub fn planted_bug_kill_tracker() -> bool {
    switched_on(KILL_TRACKER_ENV)
}

/// TEST-ONLY planted bug: when [`EARLY_RELEASE_ENV`] is `1` (or a duration, e.g. `2s`), the
/// supervisor calls this at the start of fencing. It releases the lease while the engine tree
/// is still alive, then waits (default 1s, standing for an engine that takes time to die)
/// before the normal fencing kills the tree. The drill must catch it: the next holder is
/// granted while the old engine's processes are alive, and a fake engine whose detached
/// workers still hold the GPU claim makes the new engine's claim fail.
#[cfg(any(debug_assertions, feature = "planted-bugs"))]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `cargo test --release` this is the proof that a release build has no planted
    /// bug; under `cargo test` that the debug binaries the drill tests run do have them.
    #[test]
    fn release_builds_carry_no_planted_bugs() {
        assert_eq!(
            COMPILED,
            cfg!(debug_assertions) || cfg!(feature = "planted-bugs")
        );
    }

    #[test]
    fn switches_read_like_booleans() {
        for (v, on) in [
            ("1", true),
            ("2s", true),
            ("", false),
            ("0", false),
            ("false", false),
        ] {
            std::env::set_var("SUPERVISOR_FAULT_TEST_SWITCH", v);
            assert_eq!(switched_on("SUPERVISOR_FAULT_TEST_SWITCH"), on, "{v:?}");
        }
        std::env::remove_var("SUPERVISOR_FAULT_TEST_SWITCH");
        assert!(!switched_on("SUPERVISOR_FAULT_TEST_SWITCH"));
    }
}
