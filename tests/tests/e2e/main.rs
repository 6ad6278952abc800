//! The end-to-end tests: real `lockd`, `supervisor`, `fake-engine` (and `gmsd`) processes on
//! 127.0.0.1, started through the `harness` crate. One test binary, one module per behaviour.
//!
//! Binaries are found next to this test executable (`target/<profile>/`): build them first
//! (`cargo build --workspace --bins`; `cargo test --workspace` builds them too).
//!
//! The tests are threads of one process. Every test that starts processes takes
//! [`harness::serial`] first, so they run one at a time (they measure time, the machine has
//! two cores, and some act on every child of this process); pure tests run in parallel.
//!
//! Process-global state and who touches it:
//! * child subreaper: `drill_common::drill` sets it for the drill's run and clears it after
//!   (under the serial guard); the in-process supervisor of `gms_reap_common` sets it too, and
//!   installs SIGTERM/SIGINT/SIGCHLD handlers and reaps every child: it runs in a child
//!   process of its own (`gms_reap_common::in_own_process`), never in this one;
//! * environment variables and the working directory: no test changes them (children get
//!   their environment per `Command`).

mod adapter_sequences;
mod cold_start;
mod crash_loop;
mod detached_workers;
mod detached_workers_outlive_supervisor;
mod drill_ci;
mod drill_common;
mod drill_compound;
mod dynamo_metrics;
mod engine_fails;
mod engine_sigkill_failover;
mod etcd_lockd_killed;
mod etcd_publish_key;
mod etcd_standby_unavailable;
mod gms_happy_path;
mod gms_reap_bounded;
mod gms_reap_common;
mod gms_reap_holds_lock;
mod gms_restart_shadow;
mod gpu_sim_waker_waits;
mod hung_wake;
mod init_memory;
mod kubelet_pod;
mod kubelet_replay;
mod lock_keeper_after_reconnect;
mod lockd_gone;
mod lockd_restart;
mod lockd_stopped_watchdog;
mod pid_namespace;
mod rearm;
mod revoke;
mod router_push;
mod sglang_adapter;
mod spawned_workers_anchor;
mod startup_timeout;
mod supervisor_sigkill;
mod unhealthy_active;
mod waits;
mod wake_fails;
