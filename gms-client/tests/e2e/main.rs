//! gms-client's integration tests, one binary: each module is one behaviour (they were one
//! test binary each). Tests are threads of this process: those that start processes take
//! `common::shared()`, those whose verdict depends on timing take `common::serial()`.

// The process guards (`harness::serial()` / `harness::shared()`, one std RwLock) are held for a whole test,
// across awaits too: each `#[tokio::test]` body is driven by `block_on` on its own test thread
// and no task of any runtime takes the lock, so holding it over an await cannot deadlock.
#![allow(clippy::await_holding_lock)]

mod common;

mod checks;
mod gmsd_e2e;
mod protocol_golden;
mod protocol_prop;
mod tp_deadlock;
mod verify_cli;
