//! Test-only fault switches (compiled only with the `planted-bug-early-release` feature, never
//! in a release build): they reintroduce known bugs so that the drill and the tests can show
//! that their checks fail when the protection is missing.

/// `SUPERVISOR_PLANTED_BUG_NO_ANCHOR=1`: run without the lock anchor, i.e. with the behaviour
/// before issue 15 (after a lockd restart only a lock keeper that watches the engine's main
/// process holds the lease, so workers that outlive the engine are not covered).
pub const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

/// Whether [`NO_ANCHOR_ENV`] is set to a true value.
pub fn planted_bug_no_anchor() -> bool {
    std::env::var(NO_ANCHOR_ENV)
        .map(|v| !matches!(v.trim(), "" | "0" | "false"))
        .unwrap_or(false)
}
