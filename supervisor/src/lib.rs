//! `supervisor`: wraps one inference engine and drives it through
//! Init -> Standby -> Waking -> Active -> Dead (see README.md).
//!
//! Library + thin binary, so that the drill (`supervisor-drill`, the `drill/` crate) and the
//! tests can reuse the pieces:
//! * [`machine`]: the pure state machine,
//! * [`driver`]: `supervisor run` (sockets, processes, timers, signals),
//! * [`process`]: spawning, death detection and fencing of the engine's process tree,
//! * [`publish`]: the pure `--publish-key` publisher (fenced puts while Active),
//! * [`restart`]: the pure restart policy (backoff, crash-loop limit),
//! * [`adapter`]: vLLM / SGLang HTTP calls,
//! * [`config`]: the `run` command line,
//! * [`cli`]: the top-level command line (`supervisor drill` execs `supervisor-drill`),
//! * [`logging`]: tracing setup,
//! * [`fault`]: the test-only planted bugs (debug builds, or the `planted-bugs` feature).

pub mod adapter;
pub mod cli;
pub mod config;
pub mod driver;
pub mod fault;
pub mod leftovers;
pub mod logging;
pub mod machine;
pub mod process;
pub mod publish;
pub mod restart;
pub mod router;
