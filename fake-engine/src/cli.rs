//! The command line (every flag also from a `FAKE_ENGINE_*` variable).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

fn dur(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

/// Stage at which to fail on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FailAt {
    /// Exit with status 3 after the init delay, before serving.
    Init,
    /// Answer `/sleep` with 500 (the engine stays up: the supervisor must fence it).
    Sleep,
    /// Answer `/wake_up` with 500.
    Wake,
    /// Once awake (or after the first completion if never slept): `/health` 503, completions 500.
    Serve,
}

/// Which engine's semantics the fake follows where vLLM and SGLang differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Personality {
    /// vLLM: `/health` answers at once; `/sleep` pauses scheduling, so requests reaching a
    /// sleeping engine wait for the wake.
    Vllm,
    /// SGLang: `/health` generates one token (unless `--health-generation false`); releasing
    /// memory does not pause scheduling (`/pause_generation` does), and a request that reaches
    /// the scheduler while memory is released crashes the server.
    Sglang,
}

fn flag_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (true/false/1/0)")),
    }
}

/// Fake vLLM engine.
#[derive(Debug, Parser)]
#[command(name = "fake-engine")]
pub struct Args {
    /// HTTP port.
    #[arg(long, env = "FAKE_ENGINE_PORT")]
    pub port: u16,
    /// HTTP bind address.
    #[arg(long, env = "FAKE_ENGINE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Model load time (no HTTP answer meanwhile).
    #[arg(long, env = "FAKE_ENGINE_INIT", value_parser = dur, default_value = "0s")]
    pub init: Duration,
    /// Time a sleep call takes.
    #[arg(long, env = "FAKE_ENGINE_SLEEP", value_parser = dur, default_value = "0s")]
    pub sleep: Duration,
    /// Time a wake call takes (`1h` simulates a hung wake).
    #[arg(long, env = "FAKE_ENGINE_WAKE", value_parser = dur, default_value = "0s")]
    pub wake: Duration,
    /// Fail on purpose at this stage.
    #[arg(long, env = "FAKE_ENGINE_FAIL_AT", value_enum)]
    pub fail_at: Option<FailAt>,
    /// Worker processes (tensor-parallel workers); they die with the engine.
    #[arg(long, env = "FAKE_ENGINE_WORKERS", default_value_t = 0)]
    pub workers: u32,
    /// Workers setsid(), ignore SIGTERM and outlive the engine (vllm-project/vllm#55510).
    #[arg(long, env = "FAKE_ENGINE_DETACH_WORKERS")]
    pub detach_workers: bool,
    /// Workers close the lock descriptors the engine inherited (`LOCKD_FD`,
    /// `LOCKD_ANCHOR_FD`), as Python's `spawn` start method does.
    #[arg(long, env = "FAKE_ENGINE_WORKERS_CLOSE_LOCK_FDS")]
    pub workers_close_lock_fds: bool,
    /// Engine id named in completions and logs (the supervisor sets ENGINE_ID).
    #[arg(long, env = "ENGINE_ID", default_value_t = 0)]
    pub engine_id: u32,
    /// Exclusive "GPU memory" claim file (see module docs).
    #[arg(long, env = "FAKE_ENGINE_GPU_CLAIM")]
    pub gpu_claim: Option<PathBuf>,
    /// Clear the parent-death signal the supervisor set: models an engine that outlives its
    /// supervisor (for tests of what holds the lock then).
    #[arg(long, env = "FAKE_ENGINE_SURVIVE_SUPERVISOR")]
    pub survive_supervisor: bool,
    /// Write the engine's and its workers' pids here (one per line) once spawned.
    #[arg(long, env = "FAKE_ENGINE_PID_FILE")]
    pub pid_file: Option<PathBuf>,
    /// Non-detached workers outlive the engine's main process by this long (they notice its
    /// exit and linger, holding every inherited fd, then exit). 0: they die with it.
    #[arg(long, env = "FAKE_ENGINE_WORKER_LINGER", value_parser = dur, default_value = "0s")]
    pub worker_linger: Duration,
    /// What vLLM does when its EngineCore or a worker dies (measured with vLLM 0.32's CPU
    /// build, tests/real-vllm/README.md): `/health` answers 503 and completions 500 at once,
    /// and the API server exits with status 0 this long after. A worker's death is seen
    /// within 50 ms. `0s`: exit at once.
    #[arg(long, env = "FAKE_ENGINE_WORKER_DEATH_EXIT", value_parser = dur, default_value = "2s")]
    pub worker_death_exit: Duration,
    /// Simulated GPU directory (`gms_client::simdev` format): register the engine's processes
    /// there while the GPU claim is held.
    #[arg(long, env = "FAKE_ENGINE_GPU_SIM")]
    pub gpu_sim: Option<PathBuf>,
    /// Bytes each process registers on the simulated GPU.
    #[arg(long, env = "FAKE_ENGINE_GPU_SIM_BYTES", default_value_t = 20 << 30)]
    pub gpu_sim_bytes: u64,
    /// Whose semantics to follow where vLLM and SGLang differ (health, sleeping requests).
    #[arg(
        long,
        env = "FAKE_ENGINE_PERSONALITY",
        value_enum,
        default_value = "vllm"
    )]
    pub personality: Personality,
    /// Time one completion spends generating (it is "in flight" meanwhile: `/sleep?mode=abort`
    /// and `/pause_generation` abort it, SGLang's release asserts there is none).
    #[arg(long, env = "FAKE_ENGINE_COMPLETION_TIME", value_parser = dur, default_value = "0s")]
    pub completion_time: Duration,
    /// Time `POST /collective_rpc {"method":"reload_weights"}` takes (a weight load).
    #[arg(long, env = "FAKE_ENGINE_RELOAD", value_parser = dur, default_value = "0s")]
    pub reload: Duration,
    /// SGLang's `--enable-weights-cpu-backup`: released weights are backed up in host memory
    /// and restored on resume. Without it resumed weights are undefined (garbage completions).
    #[arg(long)]
    pub enable_weights_cpu_backup: bool,
    /// SGLang personality: whether `/health` generates a token (SGLang's
    /// `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`, default true): it then answers after 1 s at
    /// the earliest, and after `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) with 503 while paused.
    #[arg(long, env = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", action = clap::ArgAction::Set, value_parser = flag_bool, default_value = "true")]
    pub health_generation: bool,
    /// SGLang personality: the generating health check's own limit (SGLang's
    /// `SGLANG_HEALTH_CHECK_TIMEOUT`, seconds).
    #[arg(long, env = "SGLANG_HEALTH_CHECK_TIMEOUT", default_value_t = 20)]
    pub health_check_timeout_secs: u64,
}
