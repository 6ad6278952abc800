//! The driver: owns the lock connection, the engine process, the probe server, timers and
//! signals; turns what happens into [`Event`]s for the pure machine and carries out its
//! [`Action`]s. Ends with fencing: kill and reap the whole tree, THEN close the lock connection.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gms_client::checks::{CheckError, GpuChecks, WakeReport};

use probes::{Phase, ProbeState, Status};
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;

use crate::adapter::{AdapterError, EngineClient};
use crate::config::RunArgs;
use crate::machine::{Action, DeadReason, Event, Machine, MachineConfig, Role, State};
use crate::process::{self, EngineSpec};
use crate::publish;
use lockd::client::LockEvent;

mod fence;
pub mod init_memory;
mod router;
mod sources;
mod telemetry;

pub use router::RouterConfig;
use router::RouterLink;

use crate::restart::{Decision, RestartPolicy};
use fence::after_reap_check;
use sources::{anchor_for, connect_lock, lock_event, pin_tree, spawn_health, PIN_INTERVAL};
use telemetry::{bump_restart_counter, persist_failover_counters, sync_check_metrics};

/// Errors that stop `supervisor run` before the state machine is running.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad engine URL.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// Subreaper / spawn / pidfd failure.
    #[error(transparent)]
    Process(#[from] process::ProcessError),
    /// The probe address could not be bound.
    #[error("cannot listen on probes address {addr}: {source}")]
    Probes {
        /// `--probes`.
        addr: String,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Signal handler installation failed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    /// `--publish-key` with a lockd that does not offer `put_fenced` (not the etcd backend).
    #[error("--publish-key {key:?} needs lockd's fenced put (lockd serve --backend etcd); lockd at {lock} does not offer it (hello features: {features:?})")]
    PublishUnsupported {
        /// `--publish-key`.
        key: String,
        /// `--lock`.
        lock: String,
        /// What lockd's `hello` listed.
        features: Vec<String>,
    },
    /// `inheritable_fd()` failed.
    #[error("cannot duplicate the lock connection for the engine: {0}")]
    LockFd(#[source] std::io::Error),
}

/// How `supervisor run` ended.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Why the last incarnation went Dead.
    pub reason: DeadReason,
    /// Process exit status (see README.md).
    pub exit_code: i32,
}

/// Which adapter call is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Sleep,
    Wake,
}

/// Build the engine's environment: who it is and its GMS weight-loading role (Decision 5, as
/// `gms_client::checks::weight_loading_env` defines it: ENGINE_ID, ENGINE_ROLE, GMS_LOCK_TYPE,
/// DYN_GMS_FAILOVER_PRIMARY_ENGINE_ID), plus the inherited lock fd (informational: the engine
/// must simply keep it open, which it does by not touching it).
fn engine_env(args: &RunArgs, lock_fd: i32, anchor_fd: Option<i32>) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = gms_client::checks::weight_loading_env(args.engine_id)
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    env.push(("LOCKD_FD".into(), lock_fd.to_string().into()));
    env.push(("LOCKD_RESOURCE".into(), args.resource.clone().into()));
    if let Some(fd) = anchor_fd {
        env.push(("LOCKD_ANCHOR_FD".into(), fd.to_string().into()));
    }
    env
}

/// The GPU/GMS checks for `--gms` / `--gpu` (None when neither is given, or when only `--gpu`
/// is given and no GPU driver is present: the checks module has logged that once, and the
/// supervisor then behaves exactly as without the flags).
async fn build_checks(args: &RunArgs) -> Option<Arc<GpuChecks>> {
    if !args.gpu_checks_requested() {
        return None;
    }
    let cfg = args.checks_config();
    // NVML init loads a library and may take a while on a real GPU: keep it off the reactor.
    let checks = tokio::task::spawn_blocking(move || GpuChecks::new(cfg))
        .await
        .ok()?;
    if args.gms.is_none() && !checks.device_checks_enabled() {
        return None;
    }
    Some(Arc::new(checks))
}

/// `supervisor run`. Returns once the engine is dead and fenced and the lock connection closed.
pub async fn run(args: RunArgs) -> Result<RunOutcome, RunError> {
    let checks = build_checks(&args).await;
    run_with_checks(args, checks).await
}

/// The POSIX signals the supervisor handles, installed once and shared by every incarnation.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    chld: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, RunError> {
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(RunError::Signals)?,
            int: signal(SignalKind::interrupt()).map_err(RunError::Signals)?,
            chld: signal(SignalKind::child()).map_err(RunError::Signals)?,
        })
    }
}

/// Which incarnation of the engine is being run.
#[derive(Clone, Copy, Debug)]
struct Incarnation {
    /// 0 for the first, + 1 per restart (`/state.incarnation`).
    n: u32,
    /// `--role` for the first; always `shadow` for a re-armed one (a re-armed engine never
    /// takes the primary's path: it sleeps, then queues on the lock).
    role: Role,
    /// When it began (before its lock connection): the policy's run time is measured from it.
    started: Instant,
}

/// What every incarnation shares with the supervisor around it.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    args: &'a RunArgs,
    /// GPU/GMS checks (None: none asked for).
    checks: Option<&'a Arc<GpuChecks>>,
    engine_client: &'a EngineClient,
    probe_state: &'a ProbeState,
    /// The restart policy (read-only here: whether a Dead state is the last one).
    policy: &'a RestartPolicy,
    /// The router push (None without `--router-socket`).
    router: Option<&'a RouterLink>,
}

/// How one incarnation ended.
#[derive(Debug)]
struct IncarnationEnd {
    /// Why it went Dead.
    reason: DeadReason,
    /// Whether its engine came up (reached Standby or Active).
    came_up: bool,
    /// Whether an engine was spawned (and fenced): only then does the last one linger.
    spawned: bool,
}

/// [`run`] with given GPU/GMS checks (None: no checks), so that tests can pass checks on a
/// simulated device (`GpuChecks::with_device`). The flags `--gms`/`--gpu`/... are not read
/// here: `checks` replaces them.
///
/// Runs incarnations of the engine in a loop: each one connects to lockd afresh, spawns its
/// engine, drives the machine to Dead and fences (every fencing invariant holds per
/// incarnation: its lock connection closes only after its tree is reaped). Then the pure
/// restart policy ([`crate::restart`]) decides: a new incarnation as a shadow after a backoff
/// (probes keep being served, `/state` shows Dead, then Init of the next incarnation), or exit.
pub async fn run_with_checks(
    args: RunArgs,
    checks: Option<Arc<GpuChecks>>,
) -> Result<RunOutcome, RunError> {
    crate::fault::announce();
    let adapter = args.adapter.build(args.sleep_level);
    let engine_client = EngineClient::new(&args.engine_url, adapter)?;
    process::become_subreaper()?;

    let probe_state = ProbeState::new(Status::new(args.engine_id, args.role.as_str()));
    // `/live` in Init: 200 until --startup-timeout, counted from now for the first incarnation
    // (reaching lockd and spawning are part of the start); refined once the engine is spawned.
    probe_state.write().startup_deadline = Some(Instant::now() + args.startup_timeout);
    bump_restart_counter(&args, &probe_state);
    persist_failover_counters(&args, &probe_state);
    let listener = tokio::net::TcpListener::bind(&args.probes)
        .await
        .map_err(|source| RunError::Probes {
            addr: args.probes.clone(),
            source,
        })?;
    let (probe_stop_tx, probe_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let probe_task = tokio::spawn(probes::serve(listener, probe_state.clone(), async move {
        let _ = probe_stop_rx.await;
    }));

    let mut signals = Signals::install()?;
    let restart = args.restart_config();

    tracing::info!(
        engine_id = args.engine_id,
        role = args.role.as_str(),
        lock = %args.lock,
        resource = %args.resource,
        probes = %args.probes,
        restart = restart.mode.as_str(),
        crash_loop_limit = restart.crash_loop_limit,
        "supervisor starting"
    );
    init_memory::announce(&args, checks.as_ref());
    for note in crate::adapter::command_notes(
        args.adapter,
        &args.cmd,
        std::env::var("VLLM_SERVER_DEV_MODE").ok().as_deref(),
        args.stop_grace,
    ) {
        tracing::warn!("{note}");
    }
    if !args.keep_leftovers {
        let r = crate::leftovers::sweep_stale(
            &args.engine_tmpdir_base(),
            &args.shm_dir,
            args.engine_id,
        );
        if r != crate::leftovers::Removed::default() {
            tracing::info!(
                shm_files = r.shm_files,
                shm_bytes = r.shm_bytes,
                tmpdirs = r.tmpdirs,
                "removed the leftovers of a previous supervisor's engine"
            );
        }
    }

    // The pod router (HAProxy runtime API): out of rotation until a phase says otherwise.
    let router = args.router_config().map(|c| {
        tracing::info!(socket = %c.socket.display(), serving = %c.servers.serving, standby = %c.servers.standby, "router push on");
        RouterLink::spawn(c, probe_state.clone())
    });
    if let Some(r) = &router {
        r.set(crate::router::Target::Out);
    }

    let mut policy = RestartPolicy::new(restart);
    let mut inc = Incarnation {
        n: 0,
        role: args.role,
        started: Instant::now(),
    };
    loop {
        let ctx = Ctx {
            args: &args,
            checks: checks.as_ref(),
            engine_client: &engine_client,
            probe_state: &probe_state,
            policy: &policy,
            router: router.as_ref(),
        };
        let end = run_incarnation(ctx, inc, &mut signals).await?;
        let ran = inc.started.elapsed();
        let run = crate::restart::Run {
            ran,
            came_up: end.came_up,
        };
        match policy.decide(&end.reason, run) {
            Decision::GiveUp { exit_code, why } => {
                probe_state.write().gave_up = true;
                tracing::info!(
                    incarnation = inc.n,
                    restarts = policy.total(),
                    why = why.as_str(),
                    reason = %end.reason,
                    "not restarting the engine"
                );
                if let Some(r) = &router {
                    // Leave the router with this engine out of rotation.
                    r.set_and_wait(crate::router::Target::Out, args.router_timeout)
                        .await;
                }
                if end.spawned {
                    linger_and_stop(&args, probe_stop_tx, probe_task).await;
                } else {
                    stop_probes(probe_stop_tx, probe_task).await;
                }
                tracing::info!(exit_code, reason = %end.reason, "supervisor exiting");
                return Ok(RunOutcome {
                    exit_code,
                    reason: end.reason,
                });
            }
            Decision::Restart { after } => {
                probe_state.metrics().restart(end.reason.kind());
                tracing::warn!(
                    incarnation = inc.n,
                    ran_ms = ran.as_millis() as u64,
                    reason = %end.reason,
                    backoff_ms = after.as_millis() as u64,
                    consecutive = policy.consecutive(),
                    limit = restart.crash_loop_limit,
                    "engine incarnation over; re-arming a new one as a shadow after the backoff"
                );
                let stopped = tokio::select! {
                    _ = tokio::time::sleep(after) => false,
                    _ = signals.term.recv() => { tracing::info!("SIGTERM received during the restart backoff"); true }
                    _ = signals.int.recv() => { tracing::info!("SIGINT received during the restart backoff"); true }
                };
                if stopped {
                    if let Some(r) = &router {
                        r.set_and_wait(crate::router::Target::Out, args.router_timeout)
                            .await;
                    }
                    probe_state.write().gave_up = true;
                    stop_probes(probe_stop_tx, probe_task).await;
                    tracing::info!(exit_code = 0, "supervisor exiting");
                    return Ok(RunOutcome {
                        exit_code: DeadReason::Stopped.exit_code(),
                        reason: DeadReason::Stopped,
                    });
                }
                inc = Incarnation {
                    n: inc.n + 1,
                    role: Role::Shadow,
                    started: Instant::now(),
                };
                rearm(&args, inc, policy.total(), &probe_state);
            }
        }
    }
}

/// `/state` and the metrics for incarnation `inc` (Dead -> Init): a fresh epoch, pid and
/// marks (`transitions` keeps the whole history), the shadow role.
fn rearm(args: &RunArgs, inc: Incarnation, restarts: u32, state: &ProbeState) {
    {
        let mut s = state.write();
        s.incarnation = inc.n;
        s.restarts = restarts;
        s.role = inc.role.as_str().to_string();
        s.epoch = None;
        s.engine_pid = None;
        s.engine_healthy = false;
        s.dead_reason = None;
        s.marks.clear();
        s.gave_up = false;
        s.waiting = None;
        // Refined once the engine is spawned (the machine's own Init deadline).
        s.startup_deadline = Some(inc.started + args.startup_timeout);
    }
    state.metrics().lock_epoch.store(0, Ordering::Relaxed);
    let at = state.enter(Phase::Init, None);
    tracing::info!(
        engine_id = args.engine_id,
        role = inc.role.as_str(),
        incarnation = inc.n,
        restarts,
        from = "dead",
        to = "init",
        at_unix_us = at,
        "transition"
    );
}

/// One incarnation: a fresh lock connection and anchor, the engine spawned, the machine driven
/// to Dead, then fencing: kill and reap the whole tree, THEN close the lock connection.
async fn run_incarnation(
    ctx: Ctx<'_>,
    inc: Incarnation,
    signals: &mut Signals,
) -> Result<IncarnationEnd, RunError> {
    let Ctx {
        args,
        checks,
        engine_client,
        probe_state,
        policy,
        router,
    } = ctx;
    // 1. The lock connection first, so that the engine can inherit it, with the anchor
    //    attached (lockd then holds the lease until every holder of the anchor's peer is gone).
    let anchor = anchor_for(args);
    let (anchor_keep, anchor_inherit) = match anchor {
        Some((k, i)) => (Some(Arc::new(k)), Some(i)),
        None => (None, None),
    };
    let anchored = anchor_keep.is_some();
    let mut lock = tokio::select! {
        r = connect_lock(args, anchor_keep) => match r {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "lockd unreachable");
                let reason = DeadReason::LockUnavailable(e);
                return Ok(end_without_engine(probe_state, policy, inc.started, reason));
            }
        },
        _ = signals.term.recv() => {
            return Ok(end_without_engine(probe_state, policy, inc.started, DeadReason::Stopped));
        }
        _ = signals.int.recv() => {
            return Ok(end_without_engine(probe_state, policy, inc.started, DeadReason::Stopped));
        }
    };
    probe_state.write().lock_connected = true;
    probe_state.mark(probes::MarkKind::LockConnected);
    if let Some(key) = &args.publish_key {
        let features = lock
            .features(args.lock_connect_timeout)
            .await
            .unwrap_or_default();
        if !features.iter().any(|f| f == "put_fenced") {
            lock.close().await;
            return Err(RunError::PublishUnsupported {
                key: key.clone(),
                lock: args.lock.to_string(),
                features,
            });
        }
    }

    // 1b. `--init-min-free-memory`: the engine is spawned only once the device has the memory
    //     it needs to initialise (bounded; no lease is held, only the connection).
    match init_memory::wait_for_init_memory(args, inc.n, checks, probe_state, signals).await {
        init_memory::Gate::Spawn => {}
        init_memory::Gate::Stopped => {
            lock.close().await;
            probe_state.write().lock_connected = false;
            return Ok(end_without_engine(
                probe_state,
                policy,
                inc.started,
                DeadReason::Stopped,
            ));
        }
        init_memory::Gate::TimedOut(reason) => {
            lock.close().await;
            probe_state.write().lock_connected = false;
            return Ok(end_without_engine(probe_state, policy, inc.started, reason));
        }
    }

    // 2. Spawn the engine with an inheritable dup of the lock connection (on this, the main,
    //    thread: PDEATHSIG is tied to the forking thread).
    let lock_fd = lock.inheritable_fd().map_err(RunError::LockFd)?;
    let anchor_fd = anchor_inherit.as_ref().map(|f| f.as_raw_fd());
    let mut leftovers = (!args.keep_leftovers).then(|| {
        crate::leftovers::Leftovers::prepare(
            Some(&args.engine_tmpdir_base()),
            &args.shm_dir,
            args.engine_id,
            inc.n,
        )
    });
    let mut env = engine_env(args, lock_fd.as_raw_fd(), anchor_fd);
    if let Some(dir) = leftovers.as_ref().and_then(|l| l.tmpdir()) {
        env.push(("TMPDIR".into(), dir.as_os_str().to_owned()));
    }
    let spec = EngineSpec {
        argv: args.cmd.clone(),
        env,
        pid_namespace: args.pid_namespace,
    };
    let mut inherit = vec![lock_fd.as_raw_fd()];
    inherit.extend(anchor_fd);
    let mut engine = match process::spawn_engine(&spec, &inherit) {
        Ok(e) => e,
        Err(e) => {
            lock.close().await;
            return Err(e.into());
        }
    };
    drop(lock_fd);
    // Only the engine's tree may hold the anchor's inherited end: its EOF at lockd is the
    // proof that the tree is gone.
    drop(anchor_inherit);
    probe_state.write().engine_pid = Some(engine.pid as u32);
    probe_state.mark(probes::MarkKind::EngineSpawned);
    tracing::info!(pid = engine.pid, cmd = ?args.cmd, "engine spawned");

    let (health_task, mut health_rx) =
        spawn_health(engine_client.clone(), probe_state.clone(), args);
    let mcfg = MachineConfig {
        role: inc.role,
        startup_timeout: args.startup_timeout,
        waking_timeout: args.waking_timeout,
        wake_checks: checks.is_some(),
        anchored,
        unhealthy_after: args.unhealthy_after,
    };
    let mut machine = Machine::new(mcfg, Instant::now());
    {
        // The supervisor is up (`/startup` 200 from now on); `/live` bounds Init by this
        // incarnation's startup budget.
        let mut s = probe_state.write();
        s.started = true;
        s.startup_deadline = machine.state.deadline().map(|(_, at)| at);
    }
    let mut op: Option<(Op, JoinHandle<Result<(), AdapterError>>)> = None;
    let mut granted_at: Option<Instant> = None;
    let mut waking_at: Option<Instant> = None;
    let mut engine_gone = false;
    // The engine came up (reached Standby or Active): its end is a failover, not a crash loop.
    let mut came_up = false;
    let holder = args.holder_name();
    // Holds the current lock connection after a reconnect (see process::Keeper).
    let mut keeper: Option<process::Keeper> = None;
    // Process anchors: every process of the engine's tree, pinned by a pidfd that lockd holds
    // (covers workers that closed the inherited anchor, e.g. Python's `spawn`).
    let mut pins = process::TreePins::default();
    let mut pin_tick = tokio::time::interval(PIN_INTERVAL);
    pin_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if anchored {
        pin_tree(&mut pins, &mut lock, probe_state).await;
    }
    // Events produced while carrying out actions (e.g. a failed acquire), handled first.
    let mut pending: VecDeque<Event> = VecDeque::new();
    // `GpuChecks::at_standby` running in the background (the before-wake check awaits it).
    let mut standby_check: Option<JoinHandle<()>> = None;
    // `GpuChecks::before_wake` in flight (its result becomes WakeCheckPassed/Failed).
    let mut wake_check: Option<JoinHandle<Result<WakeReport, CheckError>>> = None;
    // `--publish-key`: the pure publisher and its input from the last select, if any.
    let mut publ = publish::State::Off;
    let mut pub_in: Option<publish::Input> = None;
    // A lock request lockd answered `unavailable`, to send again at this time (wait flag),
    // and how many times in a row that happened (the backoff's exponent).
    let mut lock_retry: Option<(Instant, bool)> = None;
    let mut lock_retries: u32 = 0;

    let (reason, lease_held) = 'main: loop {
        if let Some(i) = pub_in.take() {
            publish_step(&mut publ, &i, &mut lock, args, inc).await;
        }
        let deadline = machine.state.deadline();
        let pub_wakeup = publ.wakeup();
        let event = if let Some(ev) = pending.pop_front() {
            Some(ev)
        } else {
            tokio::select! {
            biased;
            _ = engine.exited(), if !engine_gone => {
                engine_gone = true;
                probe_state.mark(probes::MarkKind::EngineExitDetected);
                let st = engine.peek_status();
                tracing::warn!(pid = engine.pid, status = %st, "engine exited");
                Some(Event::EngineExited(st))
            }
            _ = async {
                match lock_retry {
                    Some((at, _)) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => {
                let wait = lock_retry.take().is_some_and(|(_, w)| w);
                tracing::info!(wait, attempt = lock_retries, "asking lockd for the lock again");
                if let Err(e) = lock.acquire(&args.resource, &holder, wait).await {
                    tracing::error!(error = %e, wait, "acquire failed");
                    Some(Event::LockClosed(format!("acquire failed: {e}")))
                } else {
                    None
                }
            }
            ev = lock.next_event() => match ev {
                Some(ev @ (LockEvent::Queued { .. } | LockEvent::Granted { .. } | LockEvent::Busy { .. })) => {
                    // lockd serves the request again: the backoff starts over.
                    if lock_retries > 0 {
                        tracing::info!(after_retries = lock_retries, "lockd serves the lock request again");
                        lock_retries = 0;
                        let mut st = probe_state.write();
                        if st.waiting.is_some_and(|w| w.reason == probes::WaitReason::LockUnavailable) {
                            st.waiting = None;
                        }
                    }
                    lock_event(ev, probe_state)
                }
                Some(LockEvent::PutDone { deleted: false, resource, key, epoch, revision }) => {
                    tracing::info!(%resource, %key, epoch, revision, "published (fenced put applied by etcd)");
                    pub_in = Some(publish::Input::Done { epoch, revision });
                    None
                }
                Some(LockEvent::PutDone { deleted: true, resource, key, epoch, revision }) => {
                    tracing::info!(%resource, %key, epoch, revision, "publication deleted (fenced delete applied by etcd)");
                    None
                }
                Some(LockEvent::PutRefused { resource, key, code, message }) => {
                    tracing::warn!(%resource, %key, %code, %message, "fenced put refused");
                    pub_in = Some(publish::Input::Failed { code });
                    None
                }
                Some(ev) => lock_event(ev, probe_state),
                None => Some(Event::LockClosed("lock client closed".into())),
            },
            _ = async {
                match pub_wakeup {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => {
                pub_in = Some(publish::Input::Tick);
                None
            }
            _ = signals.term.recv() => { tracing::info!("SIGTERM received"); Some(Event::Terminate) }
            _ = signals.int.recv() => { tracing::info!("SIGINT received"); Some(Event::Terminate) }
            _ = pin_tick.tick(), if (anchored || leftovers.is_some()) && !engine_gone => {
                if anchored {
                    pin_tree(&mut pins, &mut lock, probe_state).await;
                }
                let now = Instant::now();
                if let Some(l) = leftovers.as_mut().filter(|l| l.scan_due(now)) {
                    l.scan(&process::tree_pids(), now);
                }
                None
            }
            _ = signals.chld.recv() => {
                for pid in process::reap_orphans(engine.pid) {
                    tracing::info!(pid, "reaped orphaned engine descendant");
                }
                None
            }
            r = async { (&mut op.as_mut().expect("guarded").1).await }, if op.is_some() => {
                let (kind, _) = op.take().expect("guarded");
                let r = r.unwrap_or_else(|e| Err(AdapterError::Http {
                    method: hyper::Method::POST,
                    path: "-".into(),
                    message: format!("adapter task failed: {e}"),
                }));
                match (kind, r) {
                    (Op::Sleep, Ok(())) => Some(Event::Slept),
                    (Op::Wake, Ok(())) => Some(Event::Woke),
                    (Op::Sleep, Err(e)) => { tracing::error!(error = %e, "sleep call failed"); Some(Event::SleepFailed(e.to_string())) }
                    (Op::Wake, Err(e)) => { tracing::error!(error = %e, "wake call failed"); Some(Event::WakeFailed(e.to_string())) }
                }
            }
            r = async { wake_check.as_mut().expect("guarded").await }, if wake_check.is_some() => {
                wake_check = None;
                if let Some(c) = checks {
                    sync_check_metrics(c, probe_state);
                }
                // The check has logged what it saw (and, on failure, its cause) already.
                match r {
                    Ok(Ok(_)) => {
                        probe_state.mark(probes::MarkKind::GpuCheckPassed);
                        Some(Event::WakeCheckPassed)
                    }
                    Ok(Err(e)) => {
                        probe_state.mark(probes::MarkKind::GpuCheckFailed);
                        Some(Event::WakeCheckFailed { cause: e.to_string() })
                    }
                    Err(e) => {
                        probe_state.mark(probes::MarkKind::GpuCheckFailed);
                        Some(Event::WakeCheckFailed { cause: format!("check task failed: {e}") })
                    }
                }
            }
            _ = async {
                match deadline {
                    Some((_, at)) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => deadline.map(|(k, _)| Event::Timeout(k)),
            changed = health_rx.changed() => match changed {
                Ok(()) => {
                    let h = *health_rx.borrow_and_update();
                    if h.healthy {
                        Some(Event::EngineHealthy)
                    } else if h.failures > 0 {
                        tracing::warn!(failures = h.failures, "engine health check failed");
                        Some(Event::EngineUnhealthy { failures: h.failures })
                    } else {
                        None
                    }
                }
                _ => None,
            },
            }
        };
        let Some(event) = event else { continue };
        if event == Event::LockReconnected && anchored {
            // The client attached the anchor to the new connection before reclaiming: the
            // reclaimed lease stays bound to every process of the engine's tree.
            probe_state.mark(probes::MarkKind::LockAnchorReattached);
        }
        let before = machine.state.phase();
        let now = Instant::now();
        let actions = machine.feed(&event, now);
        let after = machine.state.phase();
        if matches!(after, Phase::Standby | Phase::Active) {
            came_up = true;
        }
        if before != after {
            let waking_deadline = match &machine.state {
                State::Waking { deadline, .. } => Some(*deadline),
                _ => None,
            };
            if let State::Dead(r) = &machine.state {
                // `/live` in Dead: 200 while a new incarnation will follow, 503 once the
                // supervisor is giving up (it exits after fencing).
                let run = crate::restart::Run {
                    ran: now.saturating_duration_since(inc.started),
                    came_up,
                };
                let gave_up = policy.would_give_up(r, run);
                probe_state.write().gave_up = gave_up;
            }
            if after == Phase::Active {
                // The wake was just confirmed by the engine (or, for a primary that never
                // slept, its health check just passed): it is healthy now.
                probe_state.write().engine_healthy = true;
            }
            let at = probe_state.enter(after, waking_deadline);
            let m = probe_state.metrics();
            match after {
                Phase::Waking => waking_at = Some(now),
                Phase::Active => {
                    if let Some(w) = waking_at {
                        m.waking_seconds.observe(now - w);
                    }
                    if let Some(g) = granted_at {
                        m.grant_to_active_seconds.observe(now - g);
                    }
                }
                _ => {}
            }
            if let Some(r) = router {
                let target = crate::router::Target::for_phase(after);
                if before == Phase::Active {
                    // Out of rotation BEFORE it is fenced (bounded: a router that does not
                    // answer must not hold up the failover; its checks remain the backstop).
                    if !r.set_and_wait(target, args.router_timeout).await {
                        tracing::warn!("router did not confirm taking the engine out of rotation; fencing anyway");
                    }
                } else {
                    r.set(target);
                }
            }
            tracing::info!(
                engine_id = args.engine_id,
                role = inc.role.as_str(),
                incarnation = inc.n,
                from = before.as_str(),
                to = after.as_str(),
                event = ?event,
                at_unix_us = at,
                "transition"
            );
            if before == Phase::Active {
                publish_step(&mut publ, &publish::Input::LeftActive, &mut lock, args, inc).await;
            }
        }
        if after == Phase::Active {
            // Entering Active, or a re-grant while Active (a no-op for the same epoch).
            let epoch = actions
                .iter()
                .rev()
                .find_map(|a| match a {
                    Action::SetEpoch(e) => Some(*e),
                    _ => None,
                })
                .or(probe_state.read().epoch);
            if let Some(epoch) = epoch {
                publish_step(
                    &mut publ,
                    &publish::Input::Active { epoch },
                    &mut lock,
                    args,
                    inc,
                )
                .await;
            }
        }
        for action in actions {
            match action {
                Action::TryLock | Action::WaitLock => {
                    let wait = action == Action::WaitLock;
                    if let Err(e) = lock.acquire(&args.resource, &holder, wait).await {
                        tracing::error!(error = %e, wait, "acquire failed");
                        pending.push_back(Event::LockClosed(format!("acquire failed: {e}")));
                    }
                }
                Action::Sleep => {
                    let c = engine_client.clone();
                    let t = args.sleep_timeout;
                    let gpu = checks.cloned();
                    tracing::info!("putting engine to sleep");
                    op = Some((
                        Op::Sleep,
                        tokio::spawn(async move {
                            // What the engine releases by sleeping is what its wake will need
                            // back (`--min-free-memory auto`): sample the device around it.
                            let before = gpu.as_ref().and_then(|g| g.free_memory_now());
                            c.sleep(t).await?;
                            if let Some(g) = gpu {
                                g.note_sleep(before, g.free_memory_now());
                            }
                            Ok(())
                        }),
                    ));
                }
                Action::Wake => {
                    let c = engine_client.clone();
                    // The machine enforces the waking budget; this bound only frees the task.
                    let t = args.waking_timeout + Duration::from_secs(1);
                    tracing::info!("waking engine");
                    op = Some((Op::Wake, tokio::spawn(async move { c.wake(t).await })));
                }
                Action::RememberLayout => {
                    if let Some(c) = checks.cloned() {
                        standby_check = Some(tokio::spawn(async move {
                            // Informational: before_wake checks "committed" without it.
                            if let Err(e) = c.at_standby().await {
                                tracing::warn!(cause = %e, "gms check at standby: no committed layout remembered; before wake only \"committed\" is checked");
                            }
                        }));
                    }
                }
                Action::CheckBeforeWake => {
                    if let Some(c) = checks.cloned() {
                        let standby = standby_check.take();
                        probe_state.mark(probes::MarkKind::GpuCheckStarted);
                        tracing::info!("lock granted: checking GMS/GPU before waking the engine");
                        wake_check = Some(tokio::spawn(async move {
                            // A grant right after Standby: let the layout snapshot finish
                            // (bounded by the handshake timeout) so that it is compared.
                            if let Some(h) = standby {
                                let _ = h.await;
                            }
                            c.before_wake().await
                        }));
                    } else {
                        // Unreachable by construction (the machine asks only with checks).
                        pending.push_back(Event::WakeCheckPassed);
                    }
                }
                Action::SetEpoch(e) => {
                    if granted_at.is_none() {
                        granted_at = Some(now);
                    }
                    probe_state.write().epoch = Some(e);
                    probe_state.metrics().lock_epoch.store(e, Ordering::Relaxed);
                }
                Action::RetryLock { wait } => {
                    let delay = crate::machine::lock_retry_delay(lock_retries);
                    lock_retries = lock_retries.saturating_add(1);
                    lock_retry = Some((now + delay, wait));
                    {
                        let mut st = probe_state.write();
                        let since = st
                            .waiting
                            .filter(|w| w.reason == probes::WaitReason::LockUnavailable)
                            .map_or(now, |w| w.since);
                        st.waiting = Some(probes::Waiting {
                            reason: probes::WaitReason::LockUnavailable,
                            since,
                            timeout: delay,
                            need_bytes: None,
                            free_bytes: None,
                        });
                    }
                    tracing::warn!(
                        wait,
                        attempt = lock_retries,
                        delay_ms = delay.as_millis() as u64,
                        "lockd answered unavailable; the lock request is repeated after a backoff"
                    );
                }
                Action::SpawnKeeper => {
                    // The engine holds a duplicate of the old connection only: hand the new
                    // one to a keeper that lives until the engine has exited.
                    match lock
                        .inheritable_fd()
                        .and_then(|fd| process::spawn_keeper(&fd, &engine))
                    {
                        Ok(k) => {
                            tracing::info!(
                                pid = k.pid,
                                "lock keeper holds the new lock connection"
                            );
                            probe_state.mark(probes::MarkKind::LockKeeperSpawned);
                            if let Some(old) = keeper.replace(k) {
                                // Our own child; reaped on SIGCHLD.
                                let _ = nix::sys::signal::kill(
                                    nix::unistd::Pid::from_raw(old.pid),
                                    nix::sys::signal::Signal::SIGKILL,
                                );
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "cannot start a lock keeper; a supervisor crash now releases the lock before the engine is dead")
                        }
                    }
                }
                Action::Fence { reason, lease_held } => break 'main (reason, lease_held),
            }
        }
    };

    // 3. Fence: stop talking to the engine, kill and reap the whole tree, THEN close the lock.
    probe_state.write().dead_reason = Some(reason.to_string());
    if let Some((_, h)) = op.take() {
        h.abort();
    }
    if let Some(h) = standby_check.take() {
        h.abort();
    }
    if let Some(h) = wake_check.take() {
        h.abort();
    }
    health_task.abort();
    probe_state.write().engine_healthy = false;
    tracing::warn!(reason = %reason, urgent = reason.urgent(), "fencing engine");
    probe_state.mark(probes::MarkKind::FenceStarted);
    // PLANTED BUG hook for the drill (test-only, absent from release builds): see
    // crate::fault::planted_bug_early_release. Compiles to nothing in a release build.
    #[cfg(any(debug_assertions, feature = "planted-bugs"))]
    crate::fault::planted_bug_early_release(&mut lock, &args.resource).await;
    if let Some(l) = leftovers.as_mut() {
        // The last look at what the tree maps, while (some of) it still lives.
        l.scan(&process::tree_pids(), Instant::now());
    }
    let report = process::fence(&mut engine, reason.urgent(), args.stop_grace).await;
    if let Some(k) = keeper.take() {
        // The keeper exits once the engine has (it polls its pid); reaped on SIGCHLD.
        tracing::debug!(pid = k.pid, "lock keeper left to exit with the engine");
    }
    probe_state.mark(probes::MarkKind::Fenced);
    probe_state
        .metrics()
        .fencing_seconds
        .observe(report.duration);
    tracing::info!(
        duration_ms = report.duration.as_secs_f64() * 1000.0,
        engine_exited_ms = report.engine_exited_after.map(|d| d.as_secs_f64() * 1000.0),
        tracker_alone_ms = report.tracker_alone.map(|d| d.as_secs_f64() * 1000.0),
        signalled = report.signalled,
        reaped = report.reaped,
        escalated = report.escalated,
        alive_at_start = report.alive_at_start,
        engine_status = %report.engine_status.unwrap_or(process::ProcessEnd::Unknown),
        "engine tree fenced: no engine process left"
    );
    if let Some(l) = leftovers.take() {
        let r = l.remove();
        tracing::info!(
            shm_files = r.shm_files,
            shm_bytes = r.shm_bytes,
            tmpdirs = r.tmpdirs,
            "removed the dead engine tree's leftovers"
        );
    }
    // 4. GPU memory: the tree is dead and reaped; if we held the lock, wait (bounded) until the
    //    device shows the engine's memory released BEFORE letting the lock go (Decision 7).
    if let Some(c) = checks {
        if lease_held {
            after_reap_check(c, &report.pids, args, probe_state).await;
        }
    }
    lock.close().await;
    probe_state.write().lock_connected = false;
    probe_state.mark(probes::MarkKind::LockClosed);
    tracing::info!("lock connection closed");
    Ok(IncarnationEnd {
        reason,
        came_up,
        spawned: true,
    })
}

/// One step of the `--publish-key` publisher (nothing without the flag): the transition's
/// log line and its actions.
async fn publish_step(
    publ: &mut publish::State,
    input: &publish::Input,
    lock: &mut lockd::client::LockClient,
    args: &RunArgs,
    inc: Incarnation,
) {
    let Some(key) = &args.publish_key else {
        return;
    };
    let (next, actions) = publish::step(publ, input, Instant::now());
    if next != *publ {
        tracing::info!(
            engine_id = args.engine_id,
            incarnation = inc.n,
            key = %key,
            from = publ.name(),
            to = next.name(),
            input = ?input,
            "publish transition"
        );
    }
    *publ = next;
    for a in actions {
        match a {
            publish::Action::Put { epoch } => {
                let value = args.publish_value.as_deref().unwrap_or(&args.engine_url);
                tracing::info!(key = %key, value, epoch, "publishing the Active endpoint (fenced put)");
                if let Err(e) = lock.put_fenced(&args.resource, key, value).await {
                    tracing::error!(error = %e, "cannot send the fenced put");
                }
            }
            publish::Action::Withdraw { was_published } => {
                // Before the fence: the key no longer names an engine that is being stopped.
                // Fenced (a stale holder cannot delete its successor's value); whatever
                // happens to it, the key also goes with the session's etcd lease when the
                // fence closes the lock connection.
                tracing::info!(key = %key, was_published, "left Active: deleting the published endpoint (fenced delete)");
                if was_published {
                    if let Err(e) = lock.delete_fenced(&args.resource, key).await {
                        tracing::warn!(error = %e, "cannot send the fenced delete; the key goes with the session's etcd lease");
                    }
                }
            }
        }
    }
}

async fn linger_and_stop(
    args: &RunArgs,
    stop: tokio::sync::oneshot::Sender<()>,
    task: JoinHandle<Result<(), probes::ProbeError>>,
) {
    if !args.linger.is_zero() {
        tokio::time::sleep(args.linger).await;
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
}

async fn stop_probes(
    stop: tokio::sync::oneshot::Sender<()>,
    task: JoinHandle<Result<(), probes::ProbeError>>,
) {
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
}

/// An incarnation that ended before its engine was spawned (lockd unreachable, or a stop).
fn end_without_engine(
    state: &ProbeState,
    policy: &RestartPolicy,
    started: Instant,
    reason: DeadReason,
) -> IncarnationEnd {
    {
        let mut s = state.write();
        s.dead_reason = Some(reason.to_string());
        s.gave_up = policy.would_give_up(
            &reason,
            crate::restart::Run::failed_after(started.elapsed()),
        );
    }
    state.enter(Phase::Dead, None);
    tracing::info!(from = "init", to = "dead", reason = %reason, "transition");
    IncarnationEnd {
        reason,
        came_up: false,
        spawned: false,
    }
}
