//! gms-client's integration tests, one binary: each module is one behaviour (they were one
//! test binary each). Tests are threads of this process: those that start processes take
//! `common::shared()`, those whose verdict depends on timing take `common::serial()`.

mod common;

mod checks;
mod gmsd_e2e;
mod protocol_golden;
mod protocol_prop;
mod tp_deadlock;
mod verify_cli;
