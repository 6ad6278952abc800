//! Real processes for the workspace's tests, benchmarks and the drill.
//!
//! * [`bins`]: where the workspace's binaries are (next to the running executable),
//! * [`proc`]: a child process in its own process group, killed on drop, with a log file,
//! * [`supervisor`]: one `supervisor run` + fake engine ([`SupOpts`], [`Sup`]),
//! * [`cluster`]: one test's world (temp dir, lockd, supervisors; [`Cluster`]),
//! * [`lockd`], [`gmsd`]: THE `lockd serve` / `gmsd` launchers (spec -> `Command` for sync
//!   and async callers such as the drill, readiness, a sync owner [`Lockd`] / [`Gmsd`]),
//! * [`etcd`]: a real etcd (one member or a cluster, on loopback or a bridge) and a proxy that
//!   can black-hole it, [`netns`]: network namespaces as nodes on a bridge (partition, heal),
//! * [`kubelet`]: a pure model of kubelet's prober worker (the kubelet replay and the drill),
//! * [`mod@serial`]: the process guards of a test binary: [`serial()`] (alone) and
//!   [`shared()`] (beside other shared tests),
//! * [`mod@skip`]: recorded skips (`FAILOVER_SKIP_LOG`),
//! * [`vllm`]: a real vLLM (CPU build) prepared by `tests/real-vllm/setup`, its process tree,
//!   exit times through pidfds,
//! * [`wait`]: bounded polling, [`net`]: free loopback ports, [`clock`]: wall-clock µs,
//! * [`stats`]: the one percentile definition (nearest rank) every report uses,
//! * [`http`]: the one HTTP client (ureq; loopback, plain HTTP, bounded by a timeout).
//!
//! Process questions (alive, descendants, command lines) go to the `procfs` crate.

pub mod bins;
pub mod clock;
pub mod cluster;
pub mod etcd;
pub mod gmsd;
pub mod haproxy;
pub mod http;
pub mod kubelet;
pub mod lockd;
pub mod metrics;
pub mod net;
pub mod netns;
pub mod proc;
pub mod serial;
pub mod skip;
pub mod stats;
pub mod supervisor;
pub mod vllm;
pub mod wait;

pub use bins::{bin, must_bin, HarnessError};
pub use clock::unix_us;
pub use cluster::Cluster;
pub use gmsd::{Gmsd, GmsdSpec};
pub use lockd::{Lockd, LockdSpec};
pub use net::{free_addr, free_port};
pub use proc::{kill, Proc};
pub use serial::{serial, shared};
pub use skip::{skip, SKIP_LOG_ENV};
pub use supervisor::{Sup, SupOpts};
pub use wait::{holds_for, wait_until};
