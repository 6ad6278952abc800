//! `supervisor run` command line (docs/INTERFACES.md), every flag also read from `SUPERVISOR_*`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use gms_client::checks::MinFree;

use crate::adapter::AdapterKind;
use crate::machine::Role;
use crate::restart::{RestartConfig, RestartMode};

fn dur(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 250ms, 10s, 5m)"))
}

/// `--publish-key`: 1..=256 bytes without control characters (lockd's name limit).
fn publish_key(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_control()) {
        return Err(format!(
            "{s:?}: a publish key must be 1..=256 bytes without control characters"
        ));
    }
    Ok(s.to_string())
}

/// `--lock-watchdog`: a duration of at least 10 ms (it is pinged every quarter of it).
fn watchdog_dur(s: &str) -> Result<Duration, String> {
    let d = dur(s)?;
    if d < Duration::from_millis(10) {
        return Err(format!("{s:?}: the lock watchdog needs at least 10ms"));
    }
    Ok(d)
}

/// Byte count: plain bytes (`42949672960`) or a number with a unit: decimal `K`/`KB`, `M`/`MB`,
/// `G`/`GB`, `T`/`TB` (powers of 1000) or binary `Ki`/`KiB`, `Mi`/`MiB`, `Gi`/`GiB`,
/// `Ti`/`TiB` (powers of 1024); units are case-insensitive, an optional `B` suffix is accepted.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (examples: 42949672960, 40GiB, 40G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        "ti" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))
}

/// `--min-free-memory`: bytes as [`parse_bytes`] (`40GiB`), a percentage of the device's
/// total (`50%`, `12.5%`; over 0 and at most 100), or `0`/`off`/`0%` for no wait.
pub fn parse_min_free(s: &str) -> Result<MinFree, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(MinFree::Off);
    }
    if t.eq_ignore_ascii_case("auto") {
        return Ok(MinFree::Auto);
    }
    if let Some(p) = t.strip_suffix('%') {
        let pct: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a percentage (examples: 50%, 12.5%)"))?;
        if !pct.is_finite() || !(0.0..=100.0).contains(&pct) {
            return Err(format!("{s:?}: a percentage must be within 0%..100%"));
        }
        return Ok(if pct == 0.0 {
            MinFree::Off
        } else {
            MinFree::Fraction(pct / 100.0)
        });
    }
    match parse_bytes(t).map_err(|e| format!("{e}; or auto, a percentage (50%), or off"))? {
        0 => Ok(MinFree::Off),
        n => Ok(MinFree::Bytes(n)),
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `supervisor run` arguments.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Engine id: names this engine in logs, metrics, `/state` and the lock holder name.
    /// Engine 0 gets the GMS weight role `rw_or_ro`, the others `ro` (Decision 5).
    #[arg(long, env = "SUPERVISOR_ENGINE_ID")]
    pub engine_id: u32,

    /// primary: try the lock before sleeping, go straight to Active if free.
    /// shadow: sleep, then block on the lock.
    #[arg(long, env = "SUPERVISOR_ROLE", value_enum)]
    pub role: Role,

    /// lockd endpoint: unix:PATH or tcp:HOST:PORT.
    #[arg(long, env = "SUPERVISOR_LOCK")]
    pub lock: lockd::Endpoint,

    /// Lock resource name (all engines sharing the GPUs use the same one).
    #[arg(long, env = "SUPERVISOR_RESOURCE", default_value = "engine")]
    pub resource: String,

    /// Holder name sent to lockd (default `engine-<id>`).
    #[arg(long, env = "SUPERVISOR_HOLDER")]
    pub holder: Option<String>,

    /// Probe server address (HOST:PORT).
    #[arg(long, env = "SUPERVISOR_PROBES")]
    pub probes: String,

    /// Engine flavour.
    #[arg(long, env = "SUPERVISOR_ADAPTER", value_enum)]
    pub adapter: AdapterKind,

    /// Engine base URL, e.g. http://127.0.0.1:8000.
    #[arg(long, env = "SUPERVISOR_ENGINE_URL")]
    pub engine_url: String,

    /// Waking budget: past it `/live` answers 503 and the supervisor fences the engine.
    #[arg(long, env = "SUPERVISOR_WAKING_TIMEOUT", value_parser = dur, default_value = "120s")]
    pub waking_timeout: Duration,

    /// Budget for Init (engine healthy, first sleep).
    #[arg(long, env = "SUPERVISOR_STARTUP_TIMEOUT", value_parser = dur, default_value = "2h")]
    pub startup_timeout: Duration,

    /// Budget for the sleep call (and its confirmation).
    #[arg(long, env = "SUPERVISOR_SLEEP_TIMEOUT", value_parser = dur, default_value = "5m")]
    pub sleep_timeout: Duration,

    /// vLLM sleep level (1: offload weights to CPU memory, drop KV cache; 2: drop both, and
    /// every wake reloads the weights in place: `/wake_up?tags=weights`, `/collective_rpc
    /// reload_weights`, `/wake_up?tags=kv_cache`, so `--waking-timeout` must cover a weight
    /// load).
    #[arg(long, env = "SUPERVISOR_SLEEP_LEVEL", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub sleep_level: u8,

    /// SIGTERM -> SIGKILL grace period when fencing a live engine.
    #[arg(long, env = "SUPERVISOR_STOP_GRACE", value_parser = dur, default_value = "10s")]
    pub stop_grace: Duration,

    /// Background health check period once the engine is up. After a failed check the next
    /// one comes after `--startup-poll`, so that `--unhealthy-after` failures take little
    /// more than the first one.
    #[arg(long, env = "SUPERVISOR_HEALTH_INTERVAL", value_parser = dur, default_value = "250ms")]
    pub health_interval: Duration,

    /// Where each incarnation's private `TMPDIR` is made (default: the supervisor's own
    /// `TMPDIR`, else /tmp). The engine's IPC sockets and temporary files go there, and the
    /// directory is removed once its tree is dead; at start, those of a supervisor that was
    /// killed are swept.
    #[arg(long, env = "SUPERVISOR_ENGINE_TMPDIR")]
    pub engine_tmpdir: Option<PathBuf>,

    /// The shared-memory directory whose entries the engine's tree creates (Python
    /// multiprocessing's `psm_*`, semaphores `sem.*`) are removed once the tree is dead.
    #[arg(long, env = "SUPERVISOR_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,

    /// Keep what a dead engine tree leaves (no private `TMPDIR`, nothing removed from
    /// `--shm-dir`): for debugging an engine's crash.
    #[arg(long, env = "SUPERVISOR_KEEP_LEFTOVERS")]
    pub keep_leftovers: bool,

    /// Fence an Active engine after this many failed health checks in a row (0: never; the
    /// engine is then only judged by kubelet's liveness probe). vLLM answers `/health` 503 as
    /// soon as its EngineCore or a worker is gone, while its API server may take seconds to
    /// exit by itself, or never do so with a client connected: waiting for the exit holds the
    /// lease, and the shadow, that long.
    #[arg(long, env = "SUPERVISOR_UNHEALTHY_AFTER", default_value_t = 3)]
    pub unhealthy_after: u32,

    /// Health check period while waiting for the engine to come up in Init.
    #[arg(long, env = "SUPERVISOR_STARTUP_POLL", value_parser = dur, default_value = "100ms")]
    pub startup_poll: Duration,

    /// One health check's time limit. Default 1s for vllm, 25s for sglang: SGLang's `/health`
    /// generates a token unless `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`, answering
    /// after 1 s at the earliest and 503 after its own 20 s (`SGLANG_HEALTH_CHECK_TIMEOUT`).
    #[arg(
        long,
        env = "SUPERVISOR_HEALTH_TIMEOUT",
        value_parser = dur,
        default_value = "1s",
        default_value_if("adapter", "sglang", Some("25s"))
    )]
    pub health_timeout: Duration,

    /// One lockd connection attempt's time limit.
    #[arg(long, env = "SUPERVISOR_LOCK_CONNECT_TIMEOUT", value_parser = dur, default_value = "2s")]
    pub lock_connect_timeout: Duration,

    /// How long the lock client tries to reclaim a held lease after the connection broke
    /// (keep it above lockd's --reconnect-window).
    #[arg(long, env = "SUPERVISOR_LOCK_RECONNECT_TIMEOUT", value_parser = dur, default_value = "15s")]
    pub lock_reconnect_timeout: Duration,

    /// How long to keep retrying the first lockd connection at startup (lockd may start later
    /// than us in the pod).
    #[arg(long, env = "SUPERVISOR_LOCK_WAIT", value_parser = dur, default_value = "60s")]
    pub lock_wait: Duration,

    /// Watch lockd itself: ping it every quarter of DUR, and when nothing has come from it
    /// for DUR while the lease is held, treat the lease as lost and fence the engine. For
    /// lockd on etcd, where a stopped or killed lockd's etcd lease expires and another node
    /// is granted: set it to 2/3 of (etcd TTL − lockd's self-fence margin) or less
    /// (docs/ETCD.md, "The supervisor's watchdog"). Off by default (one lockd per pod: a
    /// stopped lockd grants nobody else).
    #[arg(long, env = "SUPERVISOR_LOCK_WATCHDOG", value_parser = watchdog_dur)]
    pub lock_watchdog: Option<Duration>,

    /// While Active, publish the engine's endpoint (`--publish-value`) at KEY in etcd with
    /// lockd's fenced put: etcd applies it only while this supervisor's lease still owns the
    /// lock (compared on the lock key's create revision) and keeps it on the session's etcd
    /// lease; leaving Active deletes it (a fenced delete, before the fence), and it goes with
    /// the session's etcd lease in any case (at the TTL if lockd died). Needs lockd on etcd:
    /// `--backend etcd`; refused at startup (exit 1) when lockd's `hello` does not offer `put_fenced`
    /// (docs/ETCD.md, "--publish-key").
    #[arg(long, env = "SUPERVISOR_PUBLISH_KEY", value_parser = publish_key)]
    pub publish_key: Option<String>,

    /// The value published at `--publish-key` (default: `--engine-url`).
    #[arg(long, env = "SUPERVISOR_PUBLISH_VALUE")]
    pub publish_value: Option<String>,

    /// Keep answering probes (as Dead) this long after fencing, before exiting. The lock is
    /// already released by then. Useful for debugging and tests; 0 in production.
    #[arg(long, env = "SUPERVISOR_LINGER", value_parser = dur, default_value = "0s")]
    pub linger: Duration,

    /// File counting engine starts across container restarts (on an emptyDir); feeds
    /// `supervisor_engine_restarts_total`. Without it that metric stays 0.
    #[arg(long, env = "SUPERVISOR_RESTART_COUNTER")]
    pub restart_counter: Option<PathBuf>,

    /// File keeping Dynamo's failover switch counters across restarts of the supervisor (on
    /// the shared volume; JSON `{"attempts": N, "success": N}`, Dynamo's own format, written
    /// with temp + rename): `dynamo_component_engine_failover_switch_{attempts,success}_total`
    /// carry on from it. Missing or unreadable: they start from 0 (with a warning when the
    /// file is there but corrupt). Without the flag they count this process only.
    #[arg(long, env = "SUPERVISOR_FAILOVER_COUNTERS")]
    pub failover_counters: Option<PathBuf>,

    /// Run the engine as PID 1 of a new PID namespace (needs CAP_SYS_ADMIN; see README.md):
    /// when the engine dies the kernel kills every process it started, detached or not.
    #[arg(long, env = "SUPERVISOR_PID_NAMESPACE")]
    pub pid_namespace: bool,

    /// The weights GMS socket (GPU Memory Service, host or container path). With it the
    /// supervisor remembers the committed layout at Standby and, after the lock is granted and
    /// before waking the engine, checks that the GMS still holds committed weights with that
    /// layout (a GMS restarted empty while the engine slept fails fast: exit 19). One socket:
    /// the checks API checks one GMS (TP>1: one device's weights GMS).
    #[arg(long, env = "SUPERVISOR_GMS")]
    pub gms: Option<PathBuf>,

    /// NVML device index of the engine's GPU: before waking, wait for `--min-free-memory`; after
    /// the dead engine was reaped, wait until its processes left the device and its memory came
    /// back before releasing the lock. Without a GPU driver this is logged once and skipped.
    #[arg(long, env = "SUPERVISOR_GPU")]
    pub gpu: Option<u32>,

    /// testing/drills: a simulated device in DIR instead of NVML (format in
    /// gms-client/src/simdev.rs); implies the device checks. Wins over `--gpu`.
    #[arg(long, env = "SUPERVISOR_GPU_SIM")]
    pub gpu_sim: Option<PathBuf>,

    /// Bound of the after-reap memory-release wait (and of the before-wake free-memory wait).
    /// On timeout the lock is released anyway (logged at error, counted; see README.md).
    #[arg(long, env = "SUPERVISOR_MEMORY_RELEASE_TIMEOUT", value_parser = dur, default_value = "30s")]
    pub memory_release_timeout: Duration,

    /// Free device memory the engine needs before it is woken (with `--gpu`/`--gpu-sim`):
    /// `auto`, bytes (`40GiB`, `40G`), a percentage of the device's total (`50%`), or `0`/`off`.
    /// Default `auto`: as much as the engine released when it went to sleep (measured on the
    /// device around the sleep call), which is what waking re-allocates, with or without GMS;
    /// no wait if it never slept. Also a lower bound of the after-reap target.
    #[arg(long, env = "SUPERVISOR_MIN_FREE_MEMORY", value_parser = parse_min_free, default_value = "auto")]
    pub min_free_memory: MinFree,

    /// Bound of each GMS interaction (connect included) at Standby and before waking
    /// (Decision 6: a finite read-lock wait; healthy grants take < 1 ms).
    #[arg(long, env = "SUPERVISOR_GMS_HANDSHAKE_TIMEOUT", value_parser = dur, default_value = "30s")]
    pub gms_handshake_timeout: Duration,

    /// Free device memory the engine needs to INITIALISE (with `--gpu`/`--gpu-sim`): before
    /// spawning the engine of every incarnation (the first one and each re-armed one), wait
    /// until the device has this much free: bytes (`60GiB`, `60G`), a percentage of the
    /// device's total (`85%`), or `0`/`off` (the default: no wait). vLLM refuses to start with
    /// less than total × `--gpu-memory-utilization` free; see deploy/README.md, "Sizing two
    /// engines on one GPU". Without a device (no `--gpu`, or no GPU driver) it does nothing
    /// (one warning).
    #[arg(long, env = "SUPERVISOR_INIT_MIN_FREE_MEMORY", value_parser = crate::driver::init_memory::parse_init_min_free, default_value = "off")]
    pub init_min_free_memory: MinFree,

    /// Bound of the `--init-min-free-memory` wait. On timeout the incarnation ends (Dead,
    /// reason `init_memory_timeout`, exit code 20) and counts for the restart policy, so a
    /// device that never frees reaches `--crash-loop-limit` instead of waiting for ever.
    #[arg(long, env = "SUPERVISOR_INIT_MEMORY_TIMEOUT", value_parser = dur, default_value = "10m")]
    pub init_memory_timeout: Duration,

    /// After the engine died and was fenced: `on-failure` starts a new incarnation of it as a
    /// shadow (after a backoff, up to `--crash-loop-limit`); `never` exits right after fencing
    /// (the first version's behaviour). A requested stop (SIGTERM/SIGINT) never restarts.
    #[arg(
        long,
        env = "SUPERVISOR_RESTART",
        value_enum,
        default_value = "on-failure"
    )]
    pub restart: RestartMode,

    /// First delay before a new incarnation; doubles with every restart without a reset.
    #[arg(long, env = "SUPERVISOR_RESTART_BACKOFF", value_parser = dur, default_value = "1s")]
    pub restart_backoff: Duration,

    /// Cap of the restart delay.
    #[arg(long, env = "SUPERVISOR_RESTART_BACKOFF_MAX", value_parser = dur, default_value = "30s")]
    pub restart_backoff_max: Duration,

    /// An incarnation that ran this long resets the backoff and the crash-loop count
    /// (kubelet's CrashLoopBackOff reset: 10 min).
    #[arg(long, env = "SUPERVISOR_RESTART_RESET", value_parser = dur, default_value = "10m")]
    pub restart_reset: Duration,

    /// Restarts without a reset after which the supervisor gives up and exits with the last
    /// incarnation's exit code (so that kubelet sees a truly broken container). An incarnation
    /// whose engine came up (reached Standby or Active) resets the count: its death is a
    /// failover, not a crash loop.
    #[arg(long, env = "SUPERVISOR_CRASH_LOOP_LIMIT", default_value_t = 5)]
    pub crash_loop_limit: u32,

    /// The pod router's runtime API socket (HAProxy `stats socket ... level admin`). With it
    /// the supervisor puts its engine in rotation the moment it is Active, takes it out before
    /// fencing it, and offers a shadow that can take over as a backup (see README.md, "Router").
    #[arg(long, env = "SUPERVISOR_ROUTER_SOCKET", requires = "router_server")]
    pub router_socket: Option<PathBuf>,

    /// This engine's server in the router, `BACKEND/SERVER` (e.g. `engines/engine-0`).
    #[arg(long, env = "SUPERVISOR_ROUTER_SERVER", value_parser = crate::router::ServerName::parse, requires = "router_socket")]
    pub router_server: Option<crate::router::ServerName>,

    /// Its backup twin, in rotation while this engine is a shadow that can take over. Default:
    /// `SERVER-standby` in the same backend.
    #[arg(long, env = "SUPERVISOR_ROUTER_STANDBY_SERVER", value_parser = crate::router::ServerName::parse, requires = "router_socket")]
    pub router_standby_server: Option<crate::router::ServerName>,

    /// Bound of one router push; the push that takes an Active engine out of rotation before
    /// fencing is waited for at most this long.
    #[arg(long, env = "SUPERVISOR_ROUTER_TIMEOUT", value_parser = dur, default_value = "200ms")]
    pub router_timeout: Duration,

    /// Re-send the current router state this often (a restarted router converges); 0: never.
    #[arg(long, env = "SUPERVISOR_ROUTER_RESYNC", value_parser = dur, default_value = "1s")]
    pub router_resync: Duration,

    /// Log format.
    #[arg(
        long,
        env = "SUPERVISOR_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,

    /// The engine command line.
    #[arg(last = true, required = true, num_args = 1..)]
    pub cmd: Vec<OsString>,
}

impl RunArgs {
    /// Where the engine's private `TMPDIR`s go (`--engine-tmpdir`, else the supervisor's).
    pub fn engine_tmpdir_base(&self) -> PathBuf {
        self.engine_tmpdir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
    }

    /// Holder name sent to lockd.
    pub fn holder_name(&self) -> String {
        self.holder
            .clone()
            .unwrap_or_else(|| format!("engine-{}", self.engine_id))
    }

    /// Whether any GPU/GMS check was asked for (`--gms`, `--gpu` or `--gpu-sim`).
    pub fn gpu_checks_requested(&self) -> bool {
        self.gms.is_some() || self.gpu.is_some() || self.gpu_sim.is_some()
    }

    /// The restart policy's parameters for these flags.
    pub fn restart_config(&self) -> RestartConfig {
        RestartConfig {
            mode: self.restart,
            backoff: self.restart_backoff,
            backoff_max: self.restart_backoff_max.max(self.restart_backoff),
            reset_after: self.restart_reset,
            crash_loop_limit: self.crash_loop_limit,
        }
    }

    /// The router push configuration (None without `--router-socket`).
    pub fn router_config(&self) -> Option<crate::driver::RouterConfig> {
        let socket = self.router_socket.clone()?;
        let serving = self.router_server.clone()?;
        let standby = self
            .router_standby_server
            .clone()
            .unwrap_or_else(|| serving.standby_twin());
        Some(crate::driver::RouterConfig {
            socket,
            servers: crate::router::Servers { serving, standby },
            timeout: self.router_timeout,
            resync: self.router_resync,
        })
    }

    /// The `gms_client::checks` configuration for these flags.
    pub fn checks_config(&self) -> gms_client::checks::ChecksConfig {
        gms_client::checks::ChecksConfig {
            gms_socket: self.gms.clone(),
            gpu: self.gpu,
            gpu_sim: self.gpu_sim.clone(),
            memory_release_timeout: self.memory_release_timeout,
            min_free_memory: self.min_free_memory,
            handshake_timeout: self.gms_handshake_timeout,
            ..gms_client::checks::ChecksConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_min_free, RunArgs};
    use clap::Parser;
    use gms_client::checks::MinFree;
    use std::time::Duration;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        run: RunArgs,
    }

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec![
            "supervisor",
            "--engine-id",
            "0",
            "--role",
            "shadow",
            "--lock",
            "unix:/tmp/x.sock",
            "--probes",
            "127.0.0.1:1",
            "--engine-url",
            "http://127.0.0.1:2",
        ];
        argv.extend_from_slice(extra);
        argv.extend_from_slice(&["--", "engine"]);
        Wrap::try_parse_from(argv).expect("parses").run
    }

    /// SGLang's `/health` generates a token (1 s at the earliest): its default is longer.
    #[test]
    fn health_timeout_default_follows_the_adapter() {
        let t = |a: &[&str]| run_args(a).health_timeout;
        assert_eq!(t(&["--adapter", "vllm"]), Duration::from_secs(1));
        assert_eq!(t(&["--adapter", "sglang"]), Duration::from_secs(25));
        assert_eq!(
            t(&["--adapter", "sglang", "--health-timeout", "2s"]),
            Duration::from_secs(2)
        );
        assert_eq!(
            t(&["--health-timeout", "3s", "--adapter", "vllm"]),
            Duration::from_secs(3)
        );
        // Kubelet-run containers configure the supervisor through the environment.
        std::env::set_var("SUPERVISOR_ADAPTER", "sglang");
        let from_env = t(&[]);
        std::env::remove_var("SUPERVISOR_ADAPTER");
        assert_eq!(from_env, Duration::from_secs(25));
    }

    #[test]
    fn lock_watchdog_is_off_by_default_and_refuses_a_useless_limit() {
        assert_eq!(run_args(&["--adapter", "vllm"]).lock_watchdog, None);
        assert_eq!(
            run_args(&["--adapter", "vllm", "--lock-watchdog", "2900ms"]).lock_watchdog,
            Some(Duration::from_millis(2900))
        );
        let mut argv = vec![
            "supervisor",
            "--engine-id",
            "0",
            "--role",
            "shadow",
            "--adapter",
            "vllm",
        ];
        argv.extend_from_slice(&["--lock", "unix:/tmp/x.sock", "--probes", "127.0.0.1:1"]);
        argv.extend_from_slice(&[
            "--engine-url",
            "http://127.0.0.1:2",
            "--lock-watchdog",
            "0s",
        ]);
        argv.extend_from_slice(&["--", "engine"]);
        let e = Wrap::try_parse_from(argv).expect_err("0s refused");
        assert!(e.to_string().contains("at least 10ms"), "{e}");
    }

    #[test]
    fn min_free_memory_forms() {
        assert_eq!(parse_min_free("50%"), Ok(MinFree::Fraction(0.5)));
        assert_eq!(parse_min_free(" Auto "), Ok(MinFree::Auto));
        assert_eq!(parse_min_free(" 12.5 %"), Ok(MinFree::Fraction(0.125)));
        assert_eq!(parse_min_free("100%"), Ok(MinFree::Fraction(1.0)));
        assert_eq!(parse_min_free("0%"), Ok(MinFree::Off));
        assert_eq!(parse_min_free("0"), Ok(MinFree::Off));
        assert_eq!(parse_min_free("OFF"), Ok(MinFree::Off));
        assert_eq!(parse_min_free("40GiB"), Ok(MinFree::Bytes(40 << 30)));
        assert_eq!(
            parse_min_free("42949672960"),
            Ok(MinFree::Bytes(42_949_672_960))
        );
        assert!(parse_min_free("150%").is_err());
        assert!(parse_min_free("-1%").is_err());
        assert!(parse_min_free("NaN%").is_err());
        assert!(parse_min_free("half").is_err());
        assert!(parse_min_free("").is_err());
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("42949672960"), Ok(42_949_672_960));
        assert_eq!(parse_bytes("40GiB"), Ok(40 << 30));
        assert_eq!(parse_bytes("40gi"), Ok(40 << 30));
        assert_eq!(parse_bytes("40G"), Ok(40_000_000_000));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1KB"), Ok(1000));
        assert_eq!(parse_bytes("7b"), Ok(7));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("1.5GiB").is_err());
        assert!(parse_bytes("10 parsecs").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }
}
