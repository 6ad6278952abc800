//! The supervisor's integration tests, one binary (they were one binary per file): `cli`
//! (the binary's command line and early exits) and `fence` (fencing real process trees).
//!
//! Tests are threads of this process, and fencing kills and reaps every descendant of the
//! calling process and makes it a subreaper (process-global). So every test that starts
//! processes takes `harness::shared()`, and a fencing test takes `harness::serial()` (exclusive): no process of
//! another test exists while it fences.

// The process guards (`harness::serial()` / `harness::shared()`, one std RwLock) are held for a whole test,
// across awaits too: each `#[tokio::test]` body is driven by `block_on` on its own test thread
// and no task of any runtime takes the lock, so holding it over an await cannot deadlock.
#![allow(clippy::await_holding_lock)]

mod cli;
mod fence;

pub use harness::serial::{serial, shared};
