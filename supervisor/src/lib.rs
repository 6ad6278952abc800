//! `supervisor`: wraps one inference engine and drives it through
//! Init -> Standby -> Waking -> Active -> Dead (see README.md).
//!
//! Library + thin binary, so that `supervisor drill` (and tests) can reuse the pieces:
//! * [`machine`]: the pure state machine,
//! * [`driver`]: `supervisor run` (sockets, processes, timers, signals),
//! * [`process`]: spawning, death detection and fencing of the engine's process tree,
//! * [`adapter`]: vLLM / SGLang HTTP calls,
//! * [`config`]: the `run` command line,
//! * [`drill`]: `supervisor drill`, the failover drill (its own lockd, two supervisors, fake engines),
//! * [`cli`]: the top-level command line and logging setup.

pub mod adapter;
pub mod cli;
pub mod config;
pub mod drill;
pub mod driver;
#[cfg(feature = "planted-bug-early-release")]
pub mod fault;
pub mod machine;
pub mod process;
