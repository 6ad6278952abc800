//! lockd's integration tests, one binary: each module is one behaviour (they were one test
//! binary each). Tests are threads of this process: tests that start processes take
//! `common::shared()`; those that measure time or CPU, or hold descriptors a concurrently
//! spawned process must not inherit, take `common::serial()` (exclusive).

// The process guards (`harness::serial()` / `harness::shared()`, one std RwLock) are held for a whole test,
// across awaits too: each `#[tokio::test]` body is driven by `block_on` on its own test thread
// and no task of any runtime takes the lock, so holding it over an await cannot deadlock.
#![allow(clippy::await_holding_lock)]

mod common;

mod anchor;
mod bad_input_flood;
mod bad_input_malformed;
mod bad_input_oversized;
mod bad_input_silent;
mod busy_poll;
mod chaos_kill_lockd;
mod cli_kinds;
mod client_library;
mod client_tcp_reclaim;
mod core_model_proptest;
mod corrupt_state;
mod dead_sockets_reaped;
mod deadlock;
mod etcd_auth;
mod etcd_backend;
mod etcd_gang;
mod etcd_member_stall;
mod etcd_metrics;
mod etcd_tls;
mod etcd_ttl;
mod group_commit;
mod hold_child_outlives_hold;
mod hold_child_outlives_hold_after_restart;
mod hold_exit_codes;
mod holder_pgroup_sigkill;
mod journal;
mod json_logs;
mod kinds_compat;
mod kinds_gang;
mod kinds_quantity;
mod kinds_shared;
mod kinds_ttl;
mod lease_client;
mod lease_client_gang;
mod metrics_and_shutdown;
mod proto_proptest;
mod reserve_qurd;
mod restart_both_crash;
mod restart_holder_dead;
mod restart_holder_healthy;
mod restart_holder_hung;
mod revoke;
mod second_lockd_refuses;
mod state_migration;
mod status_watch_format;
