//! The drill's command line (`supervisor-drill --help`, also `supervisor drill --help`): the
//! flags only; [`crate::run`] and the runner act on them.

use std::path::PathBuf;
use std::time::Duration;

use crate::schedule::Order;

/// `supervisor drill` / `supervisor-drill` flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "supervisor-drill",
    version,
    about = "Failover drill on this machine: its own lockd, two supervisors, two fake engines; \
             kills the Active side N times and checks that no split brain happened \
             (docs/DRILL.md). Also run as `supervisor drill`."
)]
pub struct DrillArgs {
    /// Rounds to run (each injects one failure).
    #[arg(long, env = "SUPERVISOR_DRILL_ITERATIONS", default_value_t = 20)]
    pub iterations: u32,

    /// Write the JSON report here.
    #[arg(long, env = "SUPERVISOR_DRILL_REPORT")]
    pub report: Option<PathBuf>,

    /// Write an SVG histogram of failover times (with the per-phase breakdown) here.
    #[arg(long, env = "SUPERVISOR_DRILL_SVG")]
    pub svg: Option<PathBuf>,

    /// Seed of the random order (printed; default: from the clock).
    #[arg(long, env = "SUPERVISOR_DRILL_SEED")]
    pub seed: Option<u64>,

    /// Failure kinds, comma-separated: engine-kill, supervisor-kill, detached-worker,
    /// hung-wake, lockd-crash, revoke (`all`: these six), lockd-crash-then-supervisor-kill,
    /// revoke-during-reconnect, lockd-crash-during-wake, double-kill (`compound`: these four);
    /// engine-child-kill (vLLM's EngineCore), worker-kill (a vLLM Worker), stop (SIGTERM of the
    /// Active supervisor) (`engine-ends`: these three and engine-kill).
    #[arg(
        long,
        env = "SUPERVISOR_DRILL_KINDS",
        value_delimiter = ',',
        default_value = "all"
    )]
    pub kinds: Vec<String>,

    /// How rounds pick their kind.
    #[arg(
        long,
        env = "SUPERVISOR_DRILL_ORDER",
        value_enum,
        default_value = "round-robin"
    )]
    pub order: Order,

    /// A failover (kill to new Active) longer than this is a violation. Hung-wake rounds get
    /// the hung waker's waking timeout on top.
    #[arg(long, env = "SUPERVISOR_DRILL_FAILOVER_BOUND", value_parser = humantime::parse_duration, default_value = "10s")]
    pub failover_bound: Duration,

    /// Drill a real engine instead of fake-engine: one command line (split like a shell
    /// would, quotes allowed), with `{port}`, `{engine_id}`, `{pid_file}` and `{gpu_claim}`
    /// replaced per engine. Kinds needing fake-engine flags (detached-worker, hung-wake)
    /// are not available then.
    #[arg(long, env = "SUPERVISOR_DRILL_ENGINE_CMD")]
    pub engine_cmd: Option<String>,

    /// The adapter the supervisors drive the engine with.
    #[arg(long, env = "SUPERVISOR_DRILL_ADAPTER", default_value = "vllm", value_parser = ["vllm", "sglang"])]
    pub adapter: String,

    /// The engine URL given to the supervisors (`{port}` replaced).
    #[arg(
        long,
        env = "SUPERVISOR_DRILL_ENGINE_URL",
        default_value = "http://127.0.0.1:{port}"
    )]
    pub engine_url: String,

    /// Worker processes per fake engine (tensor-parallel workers).
    #[arg(long, env = "SUPERVISOR_DRILL_WORKERS", default_value_t = 2)]
    pub workers: u32,

    /// The short `--waking-timeout` given to the hung waker of a hung-wake round.
    #[arg(long, env = "SUPERVISOR_DRILL_HUNG_WAKING_TIMEOUT", value_parser = humantime::parse_duration, default_value = "2s")]
    pub hung_waking_timeout: Duration,

    /// lockd's `--reconnect-window` (how long a lease survives a lockd restart).
    #[arg(long, env = "SUPERVISOR_DRILL_RECONNECT_WINDOW", value_parser = humantime::parse_duration, default_value = "3s")]
    pub reconnect_window: Duration,

    /// How long a side may take to start (reach Standby or Active) before the drill gives up.
    #[arg(long, env = "SUPERVISOR_DRILL_STARTUP_TIMEOUT", value_parser = humantime::parse_duration, default_value = "60s")]
    pub startup_timeout: Duration,

    /// Kubelet emulation: liveness probe period.
    #[arg(long, env = "SUPERVISOR_DRILL_LIVENESS_PERIOD", value_parser = humantime::parse_duration, default_value = "250ms")]
    pub liveness_period: Duration,

    /// Kubelet emulation: consecutive /live failures before the side is killed (SIGTERM).
    #[arg(long, env = "SUPERVISOR_DRILL_LIVENESS_FAILURES", default_value_t = 3)]
    pub liveness_failures: u32,

    /// Kubelet emulation: SIGTERM to SIGKILL grace period.
    #[arg(long, env = "SUPERVISOR_DRILL_TERMINATION_GRACE", value_parser = humantime::parse_duration, default_value = "5s")]
    pub termination_grace: Duration,

    /// `supervisor run --linger`: how long a fenced supervisor keeps answering probes (as
    /// Dead) before exiting, so the drill reads its Dead transition. Not on the failover
    /// path: the lease is released before the linger, but every failover round waits for it
    /// (the victim's exit), so it is most of a round's time: 150ms is 30 polls at the default
    /// `--poll-interval`. `0s` to leave the flag out.
    #[arg(long, env = "SUPERVISOR_DRILL_SUPERVISOR_LINGER", value_parser = humantime::parse_duration, default_value = "150ms")]
    pub supervisor_linger: Duration,

    /// Extra argument for every fake-engine (repeatable), e.g. `--engine-arg=--wake=200ms`.
    #[arg(long, env = "SUPERVISOR_DRILL_ENGINE_ARG", allow_hyphen_values = true)]
    pub engine_arg: Vec<String>,

    /// Extra argument for every `supervisor run` (repeatable), placed before `--`.
    #[arg(
        long,
        env = "SUPERVISOR_DRILL_SUPERVISOR_ARG",
        allow_hyphen_values = true
    )]
    pub supervisor_arg: Vec<String>,

    /// The supervisor binary to drill (default: `supervisor` next to this executable, then
    /// $PATH).
    #[arg(long, env = "SUPERVISOR_DRILL_SUPERVISOR_BIN")]
    pub supervisor_bin: Option<PathBuf>,

    /// The lockd binary (default: `lockd` next to this executable, then $PATH).
    #[arg(long, env = "SUPERVISOR_DRILL_LOCKD_BIN")]
    pub lockd_bin: Option<PathBuf>,

    /// The fake-engine binary (default: `fake-engine` next to this executable, then $PATH).
    #[arg(long, env = "SUPERVISOR_DRILL_FAKE_ENGINE_BIN")]
    pub fake_engine_bin: Option<PathBuf>,

    /// Keep the temporary directory (process logs, lockd state) instead of removing it.
    #[arg(long, env = "SUPERVISOR_DRILL_KEEP_DIR")]
    pub keep_dir: bool,

    /// Run no drill: re-render `--svg` (and print the summary table) from an existing JSON
    /// report written by `--report`.
    #[arg(long, env = "SUPERVISOR_DRILL_FROM_REPORT")]
    pub from_report: Option<PathBuf>,

    /// Plain line per round even on a terminal (no progress bar).
    #[arg(long, env = "SUPERVISOR_DRILL_PLAIN")]
    pub plain: bool,

    /// Stop after the first round with a violation (default: keep going).
    #[arg(long, env = "SUPERVISOR_DRILL_STOP_ON_VIOLATION")]
    pub stop_on_violation: bool,

    /// Run N CPU-bound busy loops (`sh -c 'while :; do :; done'`, each its own process group)
    /// beside the drill for its whole duration: failover under CPU pressure.
    #[arg(long, env = "SUPERVISOR_DRILL_LOAD", default_value_t = 0)]
    pub load: u32,

    /// fake-engine `--worker-linger` for the Active engine of a compound round: its workers
    /// outlive the engine's main process by this long (CUDA teardown). Other rounds' engines
    /// get none. `0s` to turn it off.
    #[arg(long, env = "SUPERVISOR_DRILL_WORKER_LINGER", value_parser = humantime::parse_duration, default_value = "300ms")]
    pub worker_linger: Duration,

    /// fake-engine `--wake` for the waker of a lockd-crash-during-wake round: the window in
    /// Waking in which lockd is crashed.
    #[arg(long, env = "SUPERVISOR_DRILL_SLOW_WAKE", value_parser = humantime::parse_duration, default_value = "300ms")]
    pub slow_wake: Duration,

    /// GPU checks on a simulated device: the drill creates `DIR/gpu-sim` (total 80 GiB) and
    /// passes `--gpu-sim` to the supervisors (with `--min-free-memory` = what one engine
    /// registers) and to fake-engine, which registers its processes there as vLLM uses
    /// device memory: allocated at load, freed on sleep, allocated again on wake
    /// (`--gpu-sim-bytes` each).
    #[arg(long, env = "SUPERVISOR_DRILL_GPU_SIM")]
    pub gpu_sim: bool,

    /// Bytes each fake-engine process registers on the simulated device (`--gpu-sim`).
    #[arg(long, env = "SUPERVISOR_DRILL_GPU_SIM_BYTES", default_value_t = 20 << 30)]
    pub gpu_sim_bytes: u64,

    /// Kubelet emulation: how long after a supervisor the drill SIGKILLed has died the rest of
    /// its container is killed (the container runtime is not instant: it sees PID 1's exit,
    /// then kills the cgroup). Until then the engine's processes that outlive their
    /// supervisor (lingering workers) live on.
    #[arg(long, env = "SUPERVISOR_DRILL_TEARDOWN_DELAY", value_parser = humantime::parse_duration, default_value = "100ms")]
    pub teardown_delay: Duration,

    /// How often the drill polls the supervisors while a round runs.
    #[arg(long, env = "SUPERVISOR_DRILL_POLL_INTERVAL", value_parser = humantime::parse_duration, default_value = "5ms")]
    pub poll_interval: Duration,
}
