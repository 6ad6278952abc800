//! Shared by `gms_reap_holds_lock.rs` and `gms_reap_bounded.rs`: `supervisor run` driven
//! in-process (`supervisor::driver::run_with_checks`) with GPU checks on a SIMULATED device
//! whose process list the test controls, a real lockd (embedded, on its own thread), a real
//! fake-engine process, and a second lock client queued behind it.
//!
//! In-process because a simulated device can only be injected through the library. The
//! in-process supervisor makes its process a child subreaper, installs SIGTERM/SIGINT/SIGCHLD
//! handlers, reaps every child and, when fencing, kills every descendant of its process: so
//! each such test runs in a child process of its own ([`in_own_process`]: this test binary
//! again, filtered to that one test), never in the process of the other tests. lockd and the
//! waiting client are threads, not child processes, for the same reason.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use gms_client::checks::{
    CheckCounters, ChecksConfig, Device, GpuChecks, PidNamespace, SimulatedDevice,
};
use harness::supervisor::{get, state_of};
use harness::{free_port, kill, must_bin, Proc};
use lockd::client::{ClientOptions, LockClient, LockEvent};
use lockd::Endpoint;
use nix::sys::signal::Signal;
use probes::{Phase, StateDoc};

/// Bytes the simulated engine process uses on the device.
pub const ENGINE_BYTES: u64 = 20 << 30;

/// What happened.
#[derive(Debug)]
pub struct Run {
    /// `supervisor run`'s exit code.
    pub exit_code: i32,
    /// When the engine was SIGKILLed.
    pub killed_at: Instant,
    /// When the test removed the engine's process from the simulated device (if it did).
    pub removed_at: Option<Instant>,
    /// When the second client was granted the lock.
    pub waiter_granted_at: Instant,
    /// `/state` read while the supervisor still waited on the device (if the test removed
    /// the process later).
    pub state_while_waiting: Option<StateDoc>,
    /// Whether the waiter had been granted while the supervisor still waited.
    pub granted_while_waiting: bool,
    /// `/metrics` read during `--linger` (after the lock was closed).
    pub metrics: String,
    /// The checks' counters at the end.
    pub counters: CheckCounters,
}

fn state(probes: SocketAddr) -> Option<StateDoc> {
    state_of(probes)
}

/// Environment variable naming the one test a child test process runs for real.
const CHILD_ENV: &str = "FAILOVER_E2E_OWN_PROCESS";

/// Runs `body`, the body of the test `test` (its libtest name, `module::function`), in a child
/// process of its own: this test binary again, filtered to exactly that test, with
/// [`CHILD_ENV`] naming it. In that child, `body` runs; here, the child's exit status is the
/// verdict (bounded by two minutes; its output is shown on failure).
pub fn in_own_process(test: &str, body: impl FnOnce()) {
    if std::env::var(CHILD_ENV).as_deref() == Ok(test) {
        body();
        return;
    }
    let _g = harness::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, test);
    let mut child = Proc::spawn(test, cmd, dir.path().join("child.log"));
    let status = child.wait_exit(Duration::from_secs(120));
    let out = child.log_text();
    let status = status.unwrap_or_else(|| panic!("{test} ran past 2 min in its process:\n{out}"));
    assert!(
        status.success(),
        "{test} failed in its own process ({status}):\n{out}"
    );
    // Not vacuous: the filter matched the test, and it ran.
    assert!(
        out.contains("test result: ok. 1 passed"),
        "{test} did not run in its own process:\n{out}"
    );
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

async fn poll_until(
    timeout: Duration,
    f: impl Fn() -> Option<StateDoc> + Send + Clone + 'static,
    pred: impl Fn(&StateDoc) -> bool,
) -> Option<StateDoc> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = blocking(f.clone()).await {
            if pred(&v) {
                return Some(v);
            }
        }
        if Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Run the scenario: primary goes Active (lock free), its engine shows up on the simulated
/// device, a second client queues, the engine is SIGKILLed; after `remove_after` (if Some) the
/// engine's process leaves the device. `memory_release_timeout` bounds the supervisor's wait.
pub fn run(memory_release_timeout: Duration, remove_after: Option<Duration>) -> Run {
    let dir = tempfile::Builder::new()
        .prefix("gms-reap-")
        .tempdir()
        .expect("tempdir");
    let endpoint: Endpoint = format!("unix:{}", dir.path().join("lockd.sock").display())
        .parse()
        .expect("endpoint");

    // lockd, embedded on its own thread (its run future is !Send).
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let ep = endpoint.clone();
    let state_path = dir.path().join("lockd.state");
    let lockd = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let srv =
                lockd::server::Server::bind(lockd::server::ServeConfig::new(vec![ep], state_path))
                    .await
                    .expect("lockd bind");
            let _ = srv
                .run(async move {
                    let _ = stop_rx.await;
                })
                .await;
        });
    });

    let probes: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let engine_port = free_port();
    let pid_file = dir.path().join("engine.pids");
    let claim = dir.path().join("gpu.claim");
    let mrt = format!("{}ms", memory_release_timeout.as_millis());
    let cli = supervisor::cli::Cli::try_parse_from([
        "supervisor".to_string(),
        "run".into(),
        "--engine-id".into(),
        "0".into(),
        "--role".into(),
        "primary".into(),
        "--lock".into(),
        endpoint.to_string(),
        "--probes".into(),
        probes.to_string(),
        "--adapter".into(),
        "vllm".into(),
        "--engine-url".into(),
        format!("http://127.0.0.1:{engine_port}"),
        "--health-interval".into(),
        "200ms".into(),
        "--startup-poll".into(),
        "20ms".into(),
        "--gpu".into(),
        "0".into(),
        "--memory-release-timeout".into(),
        mrt,
        "--linger".into(),
        "2s".into(),
        // The scenario ends with the supervisor's exit after fencing (issue 10's default
        // re-arms the engine instead).
        "--restart".into(),
        "never".into(),
        "--".into(),
        must_bin("fake-engine").to_string_lossy().into_owned(),
        "--port".into(),
        engine_port.to_string(),
        "--gpu-claim".into(),
        claim.to_string_lossy().into_owned(),
        "--pid-file".into(),
        pid_file.to_string_lossy().into_owned(),
    ])
    .expect("supervisor flags");
    let supervisor::cli::Command::Run(args) = cli.command else {
        panic!("not a run command");
    };

    let sim = Arc::new(SimulatedDevice::new(80 << 30));
    let cfg = ChecksConfig {
        gpu: Some(0),
        memory_release_timeout,
        poll_interval: Duration::from_millis(20),
        // The supervisor's pids are what the simulated device lists.
        pid_namespace: PidNamespace::Host,
        ..ChecksConfig::default()
    };
    let dev: Arc<dyn Device> = sim.clone();
    let checks = Arc::new(GpuChecks::with_device(cfg, Some(dev)));

    // The next waiter: a plain lock client on its own thread.
    let (queued_tx, queued_rx) = mpsc::channel::<()>();
    let (granted_tx, granted_rx) = mpsc::channel::<Instant>();
    let (start_waiter_tx, start_waiter_rx) = mpsc::channel::<()>();
    let ep = endpoint.clone();
    let waiter = std::thread::spawn(move || {
        if start_waiter_rx.recv().is_err() {
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let mut c = LockClient::connect(&ep, ClientOptions::default())
                .await
                .expect("waiter connects");
            c.acquire("engine", "engine-1", true)
                .await
                .expect("waiter acquires");
            let end = tokio::time::Instant::now() + Duration::from_secs(60);
            while let Ok(Some(ev)) = tokio::time::timeout_at(end, c.next_event()).await {
                match ev {
                    LockEvent::Queued { .. } => {
                        let _ = queued_tx.send(());
                    }
                    LockEvent::Granted { .. } => {
                        let _ = granted_tx.send(Instant::now());
                        break;
                    }
                    _ => {}
                }
            }
            c.close().await;
        });
    });

    // The driver forks the engine from this thread (current-thread runtime): PDEATHSIG is
    // tied to the forking thread, which lives until the test ends.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let sim2 = sim.clone();
    let scenario = async move {
        let st = poll_until(
            Duration::from_secs(20),
            move || state(probes),
            |v| v.state == Phase::Active,
        )
        .await
        .expect("primary reached Active");
        let pid = st.engine_pid.expect("engine_pid");
        sim2.add_process(pid, ENGINE_BYTES);
        start_waiter_tx.send(()).expect("start waiter");
        blocking(move || queued_rx.recv_timeout(Duration::from_secs(10)))
            .await
            .expect("waiter queued");
        let killed_at = Instant::now();
        assert!(kill(pid as i32, Signal::SIGKILL), "engine {pid} is gone");
        let mut removed_at = None;
        let mut state_while_waiting = None;
        let mut granted_while_waiting = false;
        if let Some(d) = remove_after {
            tokio::time::sleep(d).await;
            state_while_waiting = blocking(move || state(probes)).await;
            granted_while_waiting = granted_rx.try_recv().is_ok();
            removed_at = Some(Instant::now());
            sim2.remove_process(pid);
        }
        let granted_at = blocking(move || granted_rx.recv_timeout(Duration::from_secs(30)))
            .await
            .expect("waiter granted");
        // During --linger the probe server still answers.
        let metrics = blocking(move || get(probes, "/metrics").map(|x| x.1))
            .await
            .expect("/metrics answers during --linger");
        (
            killed_at,
            removed_at,
            granted_at,
            state_while_waiting,
            granted_while_waiting,
            metrics,
        )
    };
    let driver = supervisor::driver::run_with_checks(*args, Some(checks.clone()));
    let (outcome, (killed_at, removed_at, granted_at, state_while_waiting, gww, metrics)) =
        rt.block_on(async { tokio::join!(driver, scenario) });
    let outcome = outcome.expect("supervisor run");
    let _ = stop_tx.send(());
    let _ = lockd.join();
    let _ = waiter.join();
    Run {
        exit_code: outcome.exit_code,
        killed_at,
        removed_at,
        waiter_granted_at: granted_at,
        state_while_waiting,
        granted_while_waiting: gww,
        metrics,
        counters: checks.counters(),
    }
}
