//! The supervisor's integration tests, one binary (they were one binary per file): `cli`
//! (the binary's command line and early exits) and `fence` (fencing real process trees).
//!
//! Tests are threads of this process, and fencing kills and reaps every descendant of the
//! calling process and makes it a subreaper (process-global). So every test that starts
//! processes takes [`shared`], and a fencing test takes [`serial`] (exclusive): no process of
//! another test exists while it fences.

// The process guards (`serial()` / `shared()`) are std RwLock guards held for a whole test,
// across awaits too: each `#[tokio::test]` body is driven by `block_on` on its own test thread
// and no task of any runtime takes the lock, so holding it over an await cannot deadlock.
#![allow(clippy::await_holding_lock)]

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

mod cli;
mod fence;

static PROCESS: RwLock<()> = RwLock::new(());

/// Exclusive use of the test process (fencing tests). Survives poisoning.
pub fn serial() -> RwLockWriteGuard<'static, ()> {
    PROCESS.write().unwrap_or_else(|e| e.into_inner())
}

/// Shared use of the test process: tests that start processes, never beside a [`serial`] one.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    PROCESS.read().unwrap_or_else(|e| e.into_inner())
}
