//! `fake-engine`: a stand-in for a vLLM server (docs/INTERFACES.md), for tests, the benchmark and
//! the drill.
//!
//! Speaks vLLM's `/health`, `/sleep?level=N&mode=M`, `/wake_up[?tags=]`, `/collective_rpc`,
//! `/is_sleeping`, `/v1/completions` and SGLang's `/pause_generation`, `/continue_generation`,
//! `/release_memory_occupation`, `/resume_memory_occupation`, with their documented semantics
//! kept strictly (see [`server`]): a sleeping engine holds requests until the wake, a plain wake
//! after level 2 serves completions marked `"garbage": true`, SGLang's release with a request in
//! flight crashes the engine. `--personality sglang` adds SGLang's generating `/health`.
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
//!
//! Modules: [`cli`] (flags), [`worker`] (worker processes), [`claim`] (the GPU claim),
//! [`gpu_sim`] (the simulated device), [`server`] (the HTTP API).

mod claim;
mod cli;
mod gpu_sim;
mod server;
mod worker;

use std::time::Duration;

use clap::Parser;

use cli::{Args, FailAt};

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(worker::WORKER_ARG) {
        let parent = argv.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
        let detach = argv.get(3).map(String::as_str) == Some("1");
        let linger = argv
            .get(5)
            .and_then(|s| s.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        worker::worker_main(parent, detach, linger);
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
        nix::sys::prctl::set_pdeathsig(None)?;
    }
    // One open file description for the whole engine, inherited by every worker.
    let claim = match &args.gpu_claim {
        Some(p) => Some(claim::Claim::open(p, args.engine_id)?),
        None => None,
    };

    // Workers are spawned from the main thread before any runtime exists (PDEATHSIG is tied
    // to the forking thread).
    let me = std::process::id();
    let mut pids = vec![me];
    pids.extend(worker::spawn_workers(&args, me)?);
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
        gpu_sim::register(dir, &pids, args.gpu_sim_bytes);
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
    rt.block_on(server::serve(server::Engine::new(args, claim, pids)))
}
