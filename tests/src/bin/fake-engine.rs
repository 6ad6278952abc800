//! `fake-engine`: a stand-in for a vLLM server (docs/INTERFACES.md), for tests, the benchmark and
//! the drill.
//!
//! Speaks `/health`, `/sleep?level=N`, `/wake_up`, `/is_sleeping`, `/v1/completions` (and the
//! SGLang aliases `/release_memory_occupation`, `/resume_memory_occupation`).
//!
//! `--gpu-claim PATH` models exclusive GPU memory (docs/CONTRACTS.md): the file is opened once at
//! start (one open file description, inherited by every worker); on wake (or on first serve if
//! the engine never slept) the engine takes `flock(LOCK_EX|LOCK_NB)` on it. The claim lives
//! until the last process of the engine has died. A claim already held by another engine is a
//! split brain: a JSON line goes to `PATH.violations`, the log says so, `/wake_up` answers 500.
//!
//! `--worker-linger DUR` models tensor-parallel workers whose exit (CUDA context teardown)
//! finishes after their parent is gone: a (non-detached) worker notices its parent's exit
//! through a pidfd instead of dying with it, keeps every inherited fd (the GPU claim, lock
//! fds) for DUR, then exits. A SIGKILL still kills it at once.
//!
//! `--gpu-sim DIR` registers the engine's processes on a simulated device
//! (`gms_client::simdev`, the supervisor's `--gpu-sim`) as vLLM uses device memory:
//! `--gpu-sim-bytes` each, allocated at load, released on sleep (weights offloaded, KV cache
//! dropped), allocated again on wake. An entry counts only while its process lives, so a
//! lingering worker keeps its memory there.
//!
//! `--workers-close-lock-fds` makes workers close the descriptors the supervisor handed the
//! engine (`LOCKD_FD`, `LOCKD_ANCHOR_FD`), as workers started with Python's `spawn` method
//! (which closes every inherited descriptor) do: lockd can only know them through the
//! supervisor's process anchors (pidfds).

use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

fn dur(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

/// Stage at which to fail on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FailAt {
    /// Exit with status 3 after the init delay, before serving.
    Init,
    /// Answer `/sleep` with 500 (the engine stays up: the supervisor must fence it).
    Sleep,
    /// Answer `/wake_up` with 500.
    Wake,
    /// Once awake (or after the first completion if never slept): `/health` 503, completions 500.
    Serve,
}

/// Fake vLLM engine.
#[derive(Debug, Parser)]
#[command(name = "fake-engine")]
struct Args {
    /// HTTP port.
    #[arg(long, env = "FAKE_ENGINE_PORT")]
    port: u16,
    /// HTTP bind address.
    #[arg(long, env = "FAKE_ENGINE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Model load time (no HTTP answer meanwhile).
    #[arg(long, env = "FAKE_ENGINE_INIT", value_parser = dur, default_value = "0s")]
    init: Duration,
    /// Time a sleep call takes.
    #[arg(long, env = "FAKE_ENGINE_SLEEP", value_parser = dur, default_value = "0s")]
    sleep: Duration,
    /// Time a wake call takes (`1h` simulates a hung wake).
    #[arg(long, env = "FAKE_ENGINE_WAKE", value_parser = dur, default_value = "0s")]
    wake: Duration,
    /// Fail on purpose at this stage.
    #[arg(long, env = "FAKE_ENGINE_FAIL_AT", value_enum)]
    fail_at: Option<FailAt>,
    /// Worker processes (tensor-parallel workers); they die with the engine.
    #[arg(long, env = "FAKE_ENGINE_WORKERS", default_value_t = 0)]
    workers: u32,
    /// Workers setsid(), ignore SIGTERM and outlive the engine (vllm-project/vllm#55510).
    #[arg(long, env = "FAKE_ENGINE_DETACH_WORKERS")]
    detach_workers: bool,
    /// Workers close the lock descriptors the engine inherited (`LOCKD_FD`,
    /// `LOCKD_ANCHOR_FD`), as Python's `spawn` start method does.
    #[arg(long, env = "FAKE_ENGINE_WORKERS_CLOSE_LOCK_FDS")]
    workers_close_lock_fds: bool,
    /// Engine id named in completions and logs (the supervisor sets ENGINE_ID).
    #[arg(long, env = "ENGINE_ID", default_value_t = 0)]
    engine_id: u32,
    /// Exclusive "GPU memory" claim file (see module docs).
    #[arg(long, env = "FAKE_ENGINE_GPU_CLAIM")]
    gpu_claim: Option<PathBuf>,
    /// Clear the parent-death signal the supervisor set: models an engine that outlives its
    /// supervisor (for tests of what holds the lock then).
    #[arg(long, env = "FAKE_ENGINE_SURVIVE_SUPERVISOR")]
    survive_supervisor: bool,
    /// Write the engine's and its workers' pids here (one per line) once spawned.
    #[arg(long, env = "FAKE_ENGINE_PID_FILE")]
    pid_file: Option<PathBuf>,
    /// Non-detached workers outlive the engine's main process by this long (they notice its
    /// exit and linger, holding every inherited fd, then exit). 0: they die with it.
    #[arg(long, env = "FAKE_ENGINE_WORKER_LINGER", value_parser = dur, default_value = "0s")]
    worker_linger: Duration,
    /// Simulated GPU directory (`gms_client::simdev` format): register the engine's processes
    /// there while the GPU claim is held.
    #[arg(long, env = "FAKE_ENGINE_GPU_SIM")]
    gpu_sim: Option<PathBuf>,
    /// Bytes each process registers on the simulated GPU.
    #[arg(long, env = "FAKE_ENGINE_GPU_SIM_BYTES", default_value_t = 20 << 30)]
    gpu_sim_bytes: u64,
}

/// Hidden worker entry point:
/// `fake-engine __worker <parent-pid> <detach 0|1> <claim-path|-> [<linger-ms>]`.
fn worker_main(parent: i32, detach: bool, linger: Duration) -> ! {
    if std::env::var_os(WORKER_CLOSE_ENV).is_some() {
        for var in ["LOCKD_FD", "LOCKD_ANCHOR_FD"] {
            if let Some(fd) = std::env::var(var).ok().and_then(|v| v.parse::<i32>().ok()) {
                // SAFETY: closing a descriptor number this process inherited and never uses.
                unsafe { libc::close(fd) };
            }
        }
    }
    // SAFETY: plain libc calls in a single-threaded process.
    unsafe {
        if detach {
            libc::setsid();
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
        } else if linger.is_zero() {
            // Die with the engine, as vLLM's workers do.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            if libc::getppid() != parent {
                libc::_exit(0);
            }
        } else {
            // Outlive the engine by `linger` (CUDA teardown after the parent is gone).
            wait_for_parent_exit(parent);
            std::thread::sleep(linger);
            libc::_exit(0);
        }
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Blocks until `parent` has exited: a pidfd on it (readable once it exits), or, where
/// pidfds are missing, polling getppid() every millisecond.
fn wait_for_parent_exit(parent: i32) {
    // SAFETY: plain syscalls on integers and an fd we own.
    unsafe {
        let fd = libc::syscall(libc::SYS_pidfd_open, parent, 0) as i32;
        // Opened after the parent may have died: then getppid() already differs.
        if fd >= 0 && libc::getppid() == parent {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            while libc::poll(&mut p, 1, -1) < 0 {}
            libc::close(fd);
            return;
        }
        if fd >= 0 {
            libc::close(fd);
        }
        while libc::getppid() == parent {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Register `pids` with `bytes` each on the simulated GPU in `dir`.
fn gpu_sim_register(dir: &std::path::Path, pids: &[u32], bytes: u64) {
    for p in pids {
        if let Err(e) = gms_client::simdev::register(dir, *p, bytes) {
            tracing::warn!(pid = p, error = %e, "gpu-sim: cannot register");
        }
    }
    tracing::info!(pids = ?pids, bytes, "gpu-sim: allocated");
}

/// Set in a worker's environment by `--workers-close-lock-fds`.
const WORKER_CLOSE_ENV: &str = "FAKE_ENGINE_WORKER_CLOSES_LOCK_FDS";

/// Mutable engine state.
#[derive(Debug, Default)]
struct EngState {
    /// Weights offloaded / KV cache dropped.
    sleeping: bool,
    /// Slept at least once (then the claim is taken on wake, not on first serve).
    ever_slept: bool,
    /// Holds the GPU claim.
    claimed: bool,
    /// `--fail-at serve` has kicked in.
    failing: bool,
}

/// The engine, shared by all HTTP handlers.
struct Engine {
    /// Configuration (delays, failure injection, id).
    args: Args,
    /// The GPU claim file: one open file description shared with every worker, so the flock
    /// lives until the last engine process dies.
    claim: Option<File>,
    /// Sleep/claim state.
    state: Mutex<EngState>,
    /// The engine's pid and its workers' (registered on the simulated GPU with the claim).
    pids: Vec<u32>,
}

fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

impl Engine {
    /// Take the GPU claim. Err(message) on split brain.
    fn claim(&self) -> Result<(), String> {
        self.flock_claim()
    }

    /// Allocate device memory on the simulated GPU (load, wake): every process of the engine.
    fn gpu_alloc(&self) {
        if let Some(dir) = &self.args.gpu_sim {
            gpu_sim_register(dir, &self.pids, self.args.gpu_sim_bytes);
        }
    }

    /// Release it (sleep).
    fn gpu_free(&self) {
        if let Some(dir) = &self.args.gpu_sim {
            for p in &self.pids {
                if let Err(e) = gms_client::simdev::unregister(dir, *p) {
                    tracing::warn!(pid = p, error = %e, "gpu-sim: cannot unregister");
                }
            }
            tracing::info!(engine_id = self.args.engine_id, "gpu-sim: released");
        }
    }

    fn flock_claim(&self) -> Result<(), String> {
        let Some(f) = &self.claim else { return Ok(()) };
        // SAFETY: flock on an fd we own.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            tracing::info!(engine_id = self.args.engine_id, "gpu claim taken");
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        let path = self.args.gpu_claim.clone().unwrap_or_default();
        let line = serde_json::json!({
            "violation": "gpu-claim-held",
            "engine_id": self.args.engine_id,
            "pid": std::process::id(),
            "at_unix_us": unix_us(),
        });
        let mut vpath = path.clone().into_os_string();
        vpath.push(".violations");
        if let Ok(mut vf) = OpenOptions::new().create(true).append(true).open(&vpath) {
            let _ = writeln!(vf, "{line}");
        }
        tracing::error!(
            engine_id = self.args.engine_id,
            claim = %path.display(),
            error = %err,
            "SPLIT BRAIN: gpu claim already held by another engine"
        );
        Err(format!("gpu claim held by another engine: {err}"))
    }

    fn unclaim(&self) {
        if let Some(f) = &self.claim {
            // SAFETY: flock on an fd we own.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, EngState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn reply(code: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn do_sleep(e: &Engine) -> Response<Full<Bytes>> {
    tokio::time::sleep(e.args.sleep).await;
    if e.args.fail_at == Some(FailAt::Sleep) {
        tracing::error!(engine_id = e.args.engine_id, "injected failure at sleep");
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"injected failure at sleep"}"#.into(),
        );
    }
    let was_claimed = {
        let mut s = e.st();
        s.sleeping = true;
        s.ever_slept = true;
        std::mem::replace(&mut s.claimed, false)
    };
    if was_claimed {
        e.unclaim();
    }
    e.gpu_free();
    tracing::info!(engine_id = e.args.engine_id, "sleeping");
    reply(StatusCode::OK, "{}".into())
}

async fn do_wake(e: &Engine) -> Response<Full<Bytes>> {
    tokio::time::sleep(e.args.wake).await;
    if e.args.fail_at == Some(FailAt::Wake) {
        tracing::error!(engine_id = e.args.engine_id, "injected failure at wake");
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"injected failure at wake"}"#.into(),
        );
    }
    let already = e.st().claimed;
    if !already {
        if let Err(msg) = e.claim() {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({ "error": msg }).to_string(),
            );
        }
    }
    if e.st().sleeping {
        e.gpu_alloc();
    }
    let mut s = e.st();
    s.claimed = true;
    s.sleeping = false;
    if e.args.fail_at == Some(FailAt::Serve) {
        s.failing = true;
    }
    tracing::info!(engine_id = e.args.engine_id, "awake");
    reply(StatusCode::OK, "{}".into())
}

async fn handle(e: Arc<Engine>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => {
            if e.st().failing {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    r#"{"error":"engine dead"}"#.into(),
                )
            } else {
                reply(StatusCode::OK, "{}".into())
            }
        }
        (Method::GET, "/is_sleeping") => {
            let s = e.st().sleeping;
            reply(
                StatusCode::OK,
                serde_json::json!({ "is_sleeping": s }).to_string(),
            )
        }
        (Method::POST, "/sleep") | (Method::POST, "/release_memory_occupation") => {
            do_sleep(&e).await
        }
        (Method::POST, "/wake_up") | (Method::POST, "/resume_memory_occupation") => {
            do_wake(&e).await
        }
        (Method::POST, "/v1/completions") => {
            let (sleeping, claimed, ever_slept, failing) = {
                let s = e.st();
                (s.sleeping, s.claimed, s.ever_slept, s.failing)
            };
            if sleeping {
                return reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    r#"{"error":"sleeping"}"#.into(),
                );
            }
            if failing {
                return reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    r#"{"error":"injected failure at serve"}"#.into(),
                );
            }
            if !claimed && !ever_slept {
                if let Err(msg) = e.claim() {
                    return reply(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        serde_json::json!({ "error": msg }).to_string(),
                    );
                }
                let mut s = e.st();
                s.claimed = true;
                if e.args.fail_at == Some(FailAt::Serve) {
                    s.failing = true;
                }
            }
            let id = e.args.engine_id;
            reply(
                StatusCode::OK,
                serde_json::json!({
                    "id": format!("cmpl-fake-{id}"),
                    "object": "text_completion",
                    "engine_id": id,
                    "pid": std::process::id(),
                    "choices": [{"index": 0, "text": format!("served by engine {id}"), "finish_reason": "stop"}],
                })
                .to_string(),
            )
        }
        _ => reply(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    }
}

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("__worker") {
        let parent = argv.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
        let detach = argv.get(3).map(String::as_str) == Some("1");
        let linger = argv
            .get(5)
            .and_then(|s| s.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        worker_main(parent, detach, linger);
    }
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();

    if args.survive_supervisor {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) };
    }
    // One open file description for the whole engine, inherited by every worker.
    let claim = match &args.gpu_claim {
        Some(p) => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)?;
            // SAFETY: fcntl on an fd we own: let exec'd workers inherit it.
            unsafe {
                let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFD);
                libc::fcntl(f.as_raw_fd(), libc::F_SETFD, fl & !libc::FD_CLOEXEC);
            }
            Some(f)
        }
        None => None,
    };

    // Workers are spawned from the main thread before any runtime exists (PDEATHSIG is tied
    // to the forking thread).
    let me = std::process::id();
    let exe = std::env::current_exe()?;
    let mut pids = vec![me];
    for _ in 0..args.workers {
        let child = Command::new(&exe)
            .arg("__worker")
            .arg(me.to_string())
            .arg(if args.detach_workers { "1" } else { "0" })
            // Informational: lets cleanup code recognise whose worker this is.
            .arg(
                args.gpu_claim
                    .as_deref()
                    .unwrap_or(std::path::Path::new("-")),
            )
            .arg(args.worker_linger.as_millis().to_string())
            .envs(
                args.workers_close_lock_fds
                    .then_some((WORKER_CLOSE_ENV, "1")),
            )
            .stdin(Stdio::null())
            .arg0("fake-engine-worker")
            .spawn()?;
        pids.push(child.id());
    }
    if let Some(p) = &args.pid_file {
        let tmp = p.with_extension("tmp");
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, p)?;
    }
    tracing::info!(
        engine_id = args.engine_id,
        pid = me,
        workers = ?&pids[1..],
        detach = args.detach_workers,
        worker_linger_ms = args.worker_linger.as_millis() as u64,
        "fake-engine loading"
    );
    std::thread::sleep(args.init);
    // The model is loaded: its memory is allocated (released again on sleep).
    if let Some(dir) = &args.gpu_sim {
        gpu_sim_register(dir, &pids, args.gpu_sim_bytes);
    }
    if args.fail_at == Some(FailAt::Init) {
        tracing::error!(
            engine_id = args.engine_id,
            "injected failure at init; exiting"
        );
        std::process::exit(3);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
        tracing::info!(
            engine_id = args.engine_id,
            port = args.port,
            "fake-engine serving"
        );
        let engine = Arc::new(Engine {
            args,
            claim,
            state: Mutex::new(EngState::default()),
            pids,
        });
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let e = engine.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let e = e.clone();
                    async move { Ok::<_, Infallible>(handle(e, req).await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}
