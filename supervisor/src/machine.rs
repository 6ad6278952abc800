//! The supervisor's pure state machine: `step(state, event, now) -> (state, actions)`.
//!
//! No I/O and no clock reads: the driver ([`crate::driver`]) owns sockets, processes and
//! clocks, feeds [`Event`]s in, and carries out the returned [`Action`]s.
//!
//! ```text
//! Init(WaitingHealthy) --healthy--> primary: Init(TryingLock) --granted--> Active
//!                                                             --busy-----> Init(Sleeping)
//!                                   shadow:  Init(Sleeping) --slept--> Standby --granted--> Waking --woke--> Active
//! with GPU/GMS checks (`--gms`/`--gpu`): Standby --granted--> Waking(GpuCheck) --check passed--> Waking(WakeCall)
//!                                                             --check failed--> Dead (exit 19)
//! any non-Dead state --engine exited | lock lost | revoked | lock closed | SIGTERM | timeout | failed op--> Dead
//! ```
//! Dead is terminal (per incarnation of the engine: the driver runs a fresh machine for each
//! one, and `crate::restart` decides whether there is a next one). Entering Dead emits exactly
//! one [`Action::Fence`], which says whether the lease was held (then, with a device, the
//! driver waits for the memory before closing the lock). Without anchors (lockd over TCP), a
//! reconnect emits [`Action::SpawnKeeper`].

use std::time::{Duration, Instant};

use crate::process::ProcessEnd;
use probes::Phase;

/// Role of this supervisor (docs/INTERFACES.md `--role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Tries the lock before sleeping; if it is free, goes straight to Active.
    Primary,
    /// Always sleeps first, then blocks on the lock.
    Shadow,
}

impl Role {
    /// Lower-case name (labels, `/state`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Shadow => "shadow",
        }
    }
}

/// Static parameters of the machine.
#[derive(Clone, Copy, Debug)]
pub struct MachineConfig {
    /// Decides the path out of Init.
    pub role: Role,
    /// Budget for the whole of Init (health wait, lock try, first sleep).
    pub startup_timeout: Duration,
    /// Budget for Waking; past it `/live` is 503 and the machine fences.
    pub waking_timeout: Duration,
    /// GPU/GMS checks are configured (`--gms`, or `--gpu` with a driver present): a grant in
    /// Standby first runs the before-wake check ([`Action::CheckBeforeWake`]) and only wakes
    /// the engine once it passed, so that an engine never wakes into a hang (GMS restarted
    /// empty, Decision 6) or an OOM (memory still pinned, Decision 7).
    pub wake_checks: bool,
    /// The lock session carries anchors (a `unix:` lockd endpoint): lockd re-attaches them on
    /// a reconnect. Without them (TCP) a reconnect asks for a lock keeper
    /// ([`Action::SpawnKeeper`]) that holds the new connection until the engine has exited.
    pub anchored: bool,
    /// Consecutive failed health checks after which an Active engine is declared dead and
    /// fenced (`--unhealthy-after`; 0: never, kubelet's liveness probe is then the only judge).
    /// vLLM answers `/health` 503 once its EngineCore is gone but its API server may linger for
    /// seconds before exiting by itself: holding the lease that long is an outage.
    pub unhealthy_after: u32,
}

/// Sub-steps of Waking (all shown as `waking` outside; the waking budget covers both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeStep {
    /// The before-wake GPU/GMS check is running; no wake call has been made.
    GpuCheck,
    /// The wake call is in flight.
    WakeCall,
}

/// Sub-steps of Init (all shown as `init` outside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitStep {
    /// Engine spawned; waiting for its health endpoint.
    WaitingHealthy,
    /// Primary only: `acquire(wait=false)` sent, waiting for Granted or Busy.
    TryingLock,
    /// Sleep call in flight.
    Sleeping,
}

/// Why the machine went Dead; decides the exit code and how urgently the tree is killed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadReason {
    /// SIGTERM/SIGINT: a requested stop.
    Stopped,
    /// The engine process exited on its own.
    EngineExited(ProcessEnd),
    /// Init did not finish within `--startup-timeout`.
    StartupTimeout,
    /// The sleep call failed or timed out.
    SleepFailed(String),
    /// The wake call failed.
    WakeFailed(String),
    /// The before-wake GPU/GMS check failed (the cause: the check error's text). The engine
    /// was never woken.
    GpuCheckFailed(String),
    /// Waking took longer than `--waking-timeout`.
    WakingTimeout,
    /// The lock client could not reclaim the held lease in time (or the reclaim was refused).
    LockLost(String),
    /// lockd revoked the lease.
    Revoked(String),
    /// The lock client closed for good (or the lock server refused us).
    LockUnavailable(String),
    /// The lock server sent something that makes no sense in this state.
    Protocol(String),
    /// `--init-min-free-memory`: the device did not have the memory the engine needs to
    /// initialise within `--init-memory-timeout` (the text: need, free, wait). The engine was
    /// never spawned.
    InitMemoryTimeout(String),
    /// The Active engine failed this many health checks in a row (`--unhealthy-after`).
    EngineUnhealthy(u32),
}

impl DeadReason {
    /// Process exit status of `supervisor run` for this reason (documented in README.md).
    pub fn exit_code(&self) -> i32 {
        match self {
            DeadReason::Stopped => 0,
            DeadReason::EngineExited(_) => 10,
            DeadReason::StartupTimeout => 11,
            DeadReason::SleepFailed(_) => 12,
            DeadReason::WakeFailed(_) => 13,
            DeadReason::WakingTimeout => 14,
            DeadReason::LockLost(_) => 15,
            DeadReason::Revoked(_) => 16,
            DeadReason::LockUnavailable(_) => 17,
            DeadReason::Protocol(_) => 18,
            DeadReason::GpuCheckFailed(_) => 19,
            DeadReason::InitMemoryTimeout(_) => 20,
            DeadReason::EngineUnhealthy(_) => 21,
        }
    }

    /// Whether the tree is SIGKILLed at once instead of SIGTERM + grace: the engine is already
    /// dead (its leftovers are useless), or the lease is gone and someone else may be granted.
    pub fn urgent(&self) -> bool {
        matches!(
            self,
            DeadReason::EngineExited(_)
                | DeadReason::EngineUnhealthy(_)
                | DeadReason::LockLost(_)
                | DeadReason::Revoked(_)
        )
    }

    /// Short machine-readable name (logs, `/state.dead_reason`).
    pub fn kind(&self) -> &'static str {
        match self {
            DeadReason::Stopped => "stopped",
            DeadReason::EngineExited(_) => "engine_exited",
            DeadReason::StartupTimeout => "startup_timeout",
            DeadReason::SleepFailed(_) => "sleep_failed",
            DeadReason::WakeFailed(_) => "wake_failed",
            DeadReason::WakingTimeout => "waking_timeout",
            DeadReason::LockLost(_) => "lock_lost",
            DeadReason::Revoked(_) => "revoked",
            DeadReason::LockUnavailable(_) => "lock_unavailable",
            DeadReason::Protocol(_) => "protocol",
            DeadReason::GpuCheckFailed(_) => "gpu_check_failed",
            DeadReason::InitMemoryTimeout(_) => "init_memory_timeout",
            DeadReason::EngineUnhealthy(_) => "engine_unhealthy",
        }
    }
}

impl std::fmt::Display for DeadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeadReason::Stopped => write!(f, "stopped by signal"),
            DeadReason::EngineExited(s) => write!(f, "engine exited: {s}"),
            DeadReason::StartupTimeout => write!(f, "engine did not finish init in time"),
            DeadReason::SleepFailed(s) => write!(f, "sleep failed: {s}"),
            DeadReason::WakeFailed(s) => write!(f, "wake failed: {s}"),
            DeadReason::WakingTimeout => write!(f, "waking timeout exceeded"),
            DeadReason::LockLost(s) => write!(f, "lock lost: {s}"),
            DeadReason::Revoked(s) => write!(f, "lock revoked: {s}"),
            DeadReason::LockUnavailable(s) => write!(f, "lock unavailable: {s}"),
            DeadReason::Protocol(s) => write!(f, "lock protocol violation: {s}"),
            DeadReason::GpuCheckFailed(s) => write!(f, "GPU/GMS check before wake failed: {s}"),
            DeadReason::EngineUnhealthy(n) => {
                write!(f, "engine failed {n} health checks in a row while Active")
            }
            DeadReason::InitMemoryTimeout(s) => {
                write!(
                    f,
                    "device memory to initialise the engine not free in time: {s}"
                )
            }
        }
    }
}

/// The machine's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Engine starting; `deadline` ends the startup budget.
    Init {
        /// Where in Init we are.
        step: InitStep,
        /// End of `--startup-timeout`, measured from the start.
        deadline: Instant,
    },
    /// Asleep, queued on the lock.
    Standby,
    /// Lock granted; the before-wake check or the wake call is in flight.
    Waking {
        /// End of `--waking-timeout`, measured from the grant.
        deadline: Instant,
        /// Check first (with `--gms`/`--gpu`), then the wake call.
        step: WakeStep,
    },
    /// Serving, holding the lock.
    Active,
    /// Terminal.
    Dead(DeadReason),
}

impl State {
    /// The initial state, at `now`.
    pub fn initial(cfg: &MachineConfig, now: Instant) -> State {
        State::Init {
            step: InitStep::WaitingHealthy,
            deadline: now + cfg.startup_timeout,
        }
    }

    /// The phase shown outside.
    pub fn phase(&self) -> Phase {
        match self {
            State::Init { .. } => Phase::Init,
            State::Standby => Phase::Standby,
            State::Waking { .. } => Phase::Waking,
            State::Active => Phase::Active,
            State::Dead(_) => Phase::Dead,
        }
    }

    /// The pending timeout, if any: the driver feeds `Event::Timeout(kind)` once it passes.
    pub fn deadline(&self) -> Option<(TimeoutKind, Instant)> {
        match self {
            State::Init { deadline, .. } => Some((TimeoutKind::Startup, *deadline)),
            State::Waking { deadline, .. } => Some((TimeoutKind::Waking, *deadline)),
            _ => None,
        }
    }

    /// Whether this state is terminal.
    pub fn is_dead(&self) -> bool {
        matches!(self, State::Dead(_))
    }
}

/// Which budget ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutKind {
    /// `--startup-timeout` (Init).
    Startup,
    /// `--waking-timeout` (Waking).
    Waking,
}

/// Something that happened, as seen by the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The engine's health endpoint answered 200.
    EngineHealthy,
    /// The engine's health check failed `failures` times in a row (sent at each failure).
    EngineUnhealthy {
        /// Consecutive failures so far.
        failures: u32,
    },
    /// lockd granted the lease (`reclaimed`: a held lease re-granted after a reconnect).
    LockGranted {
        /// Fencing epoch of the grant.
        epoch: u64,
        /// Re-grant of a lease we already held.
        reclaimed: bool,
    },
    /// Answer to `acquire(wait=false)`: someone else holds it.
    LockBusy,
    /// The lock connection broke; the client is reconnecting.
    LockDisconnected,
    /// The lock connection is back.
    LockReconnected,
    /// The sleep call succeeded and the engine confirmed it sleeps.
    Slept,
    /// The wake call succeeded and the engine confirmed it is awake.
    Woke,
    /// The sleep call failed or timed out.
    SleepFailed(String),
    /// The wake call failed.
    WakeFailed(String),
    /// The before-wake GPU/GMS check passed (GMS committed with the Standby layout, device
    /// memory free): the engine may be woken.
    WakeCheckPassed,
    /// The before-wake GPU/GMS check failed; `cause` names why (the check error's text).
    WakeCheckFailed {
        /// The check error's Display.
        cause: String,
    },
    /// The engine process exited (how it ended).
    EngineExited(ProcessEnd),
    /// The held lease could not be reclaimed.
    LockLost(String),
    /// lockd revoked the lease.
    Revoked(String),
    /// The lock client is closed for good.
    LockClosed(String),
    /// lockd answered an error (fatal while we wait for a lock answer: the answer never comes).
    LockError(String),
    /// lockd answered `unavailable` (lockd on etcd: etcd did not answer, or the waiting
    /// session's etcd lease was lost): the request is gone, but asking again later may work.
    LockUnavailable(String),
    /// A budget ran out (ignored unless it is the current state's and has really passed).
    Timeout(TimeoutKind),
    /// SIGTERM or SIGINT.
    Terminate,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `acquire(resource, holder, wait=false)`.
    TryLock,
    /// `acquire(resource, holder, wait=true)`.
    WaitLock,
    /// Start the adapter's sleep sequence.
    Sleep,
    /// Start the adapter's wake sequence.
    Wake,
    /// Remember the GMS's committed layout (`GpuChecks::at_standby`); informational, its
    /// result is not an event (the before-wake check compares against it).
    RememberLayout,
    /// Run the before-wake GPU/GMS check (`GpuChecks::before_wake`); its outcome comes back
    /// as [`Event::WakeCheckPassed`] / [`Event::WakeCheckFailed`].
    CheckBeforeWake,
    /// Remember the lock epoch (exposed on `/state`).
    SetEpoch(u64),
    /// lockd could not serve the lock request for now (`unavailable`): send it again
    /// (`acquire(wait)`) after the driver's bounded backoff ([`lock_retry_delay`]).
    RetryLock {
        /// `wait=true` (Standby) or try-once (the primary's Init).
        wait: bool,
    },
    /// Hand the new lock connection (after a reconnect) to a lock keeper that lives until the
    /// engine has exited (no anchors: lockd over TCP; see `process::Keeper`).
    SpawnKeeper,
    /// Kill and reap the whole engine tree, then close the lock connection.
    Fence {
        /// Why.
        reason: DeadReason,
        /// The lease was held when the engine died (granted in this incarnation, not lost or
        /// revoked): with a device, the lock is closed only once its memory is seen released.
        lease_held: bool,
    },
}

/// Whether a machine dying in `state` for `reason` still holds the lease.
fn lease_held(state: &State, reason: &DeadReason) -> bool {
    matches!(state, State::Waking { .. } | State::Active)
        && !matches!(reason, DeadReason::LockLost(_) | DeadReason::Revoked(_))
}

fn dead_from(state: &State, reason: DeadReason) -> (State, Vec<Action>) {
    let lease_held = lease_held(state, &reason);
    (
        State::Dead(reason.clone()),
        vec![Action::Fence { reason, lease_held }],
    )
}

/// The transition function. Pure: same inputs, same outputs.
pub fn step(
    state: &State,
    event: &Event,
    now: Instant,
    cfg: &MachineConfig,
) -> (State, Vec<Action>) {
    use Event as E;
    if state.is_dead() {
        return (state.clone(), Vec::new());
    }
    // Events that end every live state the same way.
    match event {
        E::EngineExited(s) => return dead_from(state, DeadReason::EngineExited(*s)),
        E::LockLost(s) => return dead_from(state, DeadReason::LockLost(s.clone())),
        E::Revoked(s) => return dead_from(state, DeadReason::Revoked(s.clone())),
        E::LockClosed(s) => return dead_from(state, DeadReason::LockUnavailable(s.clone())),
        E::Terminate => return dead_from(state, DeadReason::Stopped),
        E::Timeout(kind) => {
            return match state.deadline() {
                Some((k, at)) if k == *kind && now >= at => dead_from(
                    state,
                    match k {
                        TimeoutKind::Startup => DeadReason::StartupTimeout,
                        TimeoutKind::Waking => DeadReason::WakingTimeout,
                    },
                ),
                // Stale or early: nothing happens.
                _ => (state.clone(), Vec::new()),
            };
        }
        _ => {}
    }
    let same = || (state.clone(), Vec::new());
    // Without anchors, every reconnect hands the new connection to a lock keeper.
    let keeper = || {
        if cfg.anchored {
            Vec::new()
        } else {
            vec![Action::SpawnKeeper]
        }
    };
    if *event == E::LockReconnected
        && !matches!(
            state,
            State::Init {
                step: InitStep::TryingLock,
                ..
            }
        )
    {
        return (state.clone(), keeper());
    }
    match (state, event) {
        (State::Init { step, deadline }, ev) => {
            let deadline = *deadline;
            let init = |step| State::Init { step, deadline };
            match (step, ev) {
                (InitStep::WaitingHealthy, E::EngineHealthy) => match cfg.role {
                    Role::Primary => (init(InitStep::TryingLock), vec![Action::TryLock]),
                    Role::Shadow => (init(InitStep::Sleeping), vec![Action::Sleep]),
                },
                (InitStep::TryingLock, E::LockGranted { epoch, .. }) => {
                    (State::Active, vec![Action::SetEpoch(*epoch)])
                }
                (InitStep::TryingLock, E::LockBusy) => {
                    (init(InitStep::Sleeping), vec![Action::Sleep])
                }
                // A try-once request may be lost with the connection: ask again.
                (InitStep::TryingLock, E::LockReconnected) => {
                    let mut a = keeper();
                    a.push(Action::TryLock);
                    (init(*step), a)
                }
                (InitStep::TryingLock, E::LockUnavailable(_)) => {
                    (init(*step), vec![Action::RetryLock { wait: false }])
                }
                (InitStep::TryingLock, E::LockError(s)) => {
                    dead_from(state, DeadReason::Protocol(s.clone()))
                }
                (InitStep::Sleeping, E::Slept) => {
                    let mut a = vec![Action::WaitLock];
                    if cfg.wake_checks {
                        a.push(Action::RememberLayout);
                    }
                    (State::Standby, a)
                }
                (InitStep::Sleeping, E::SleepFailed(s)) => {
                    dead_from(state, DeadReason::SleepFailed(s.clone()))
                }
                // A grant we did not ask for: the lock server and we disagree; fail safe.
                (InitStep::WaitingHealthy | InitStep::Sleeping, E::LockGranted { epoch, .. }) => {
                    dead_from(
                        state,
                        DeadReason::Protocol(format!(
                            "unrequested grant (epoch {epoch}) during init"
                        )),
                    )
                }
                _ => same(),
            }
        }
        (State::Standby, E::LockGranted { epoch, .. }) => {
            let deadline = now + cfg.waking_timeout;
            if cfg.wake_checks {
                (
                    State::Waking {
                        deadline,
                        step: WakeStep::GpuCheck,
                    },
                    vec![Action::SetEpoch(*epoch), Action::CheckBeforeWake],
                )
            } else {
                (
                    State::Waking {
                        deadline,
                        step: WakeStep::WakeCall,
                    },
                    vec![Action::SetEpoch(*epoch), Action::Wake],
                )
            }
        }
        // etcd unreachable (lockd on etcd): keep the engine asleep and ask again later.
        (State::Standby, E::LockUnavailable(_)) => {
            (State::Standby, vec![Action::RetryLock { wait: true }])
        }
        (State::Standby, E::LockError(s)) => dead_from(state, DeadReason::Protocol(s.clone())),
        (
            State::Waking {
                deadline,
                step: WakeStep::GpuCheck,
            },
            E::WakeCheckPassed,
        ) => (
            State::Waking {
                deadline: *deadline,
                step: WakeStep::WakeCall,
            },
            vec![Action::Wake],
        ),
        (
            State::Waking {
                step: WakeStep::GpuCheck,
                ..
            },
            E::WakeCheckFailed { cause },
        ) => dead_from(state, DeadReason::GpuCheckFailed(cause.clone())),
        // Only a wake call can confirm or fail a wake (none is in flight during the check).
        (
            State::Waking {
                step: WakeStep::WakeCall,
                ..
            },
            E::Woke,
        ) => (State::Active, Vec::new()),
        (
            State::Waking {
                step: WakeStep::WakeCall,
                ..
            },
            E::WakeFailed(s),
        ) => dead_from(state, DeadReason::WakeFailed(s.clone())),
        (State::Active, E::EngineUnhealthy { failures })
            if cfg.unhealthy_after > 0 && *failures >= cfg.unhealthy_after =>
        {
            dead_from(state, DeadReason::EngineUnhealthy(*failures))
        }
        // Re-grant after a lockd restart (reconnect window): keep going, note the epoch.
        (State::Waking { .. } | State::Active, E::LockGranted { epoch, .. }) => {
            (state.clone(), vec![Action::SetEpoch(*epoch)])
        }
        _ => same(),
    }
}

/// First delay before asking lockd again after `unavailable`.
pub const LOCK_RETRY_MIN: Duration = Duration::from_millis(200);
/// Longest delay between two such requests.
pub const LOCK_RETRY_MAX: Duration = Duration::from_secs(5);

/// The delay before the `attempt`-th (0-based) repeat of a lock request lockd answered
/// `unavailable`: 200 ms doubling up to 5 s (pure; the driver counts the attempts and resets
/// the count once lockd queued or granted the request).
pub fn lock_retry_delay(attempt: u32) -> Duration {
    LOCK_RETRY_MIN
        .saturating_mul(1u32 << attempt.min(16))
        .min(LOCK_RETRY_MAX)
}

/// Convenience wrapper holding the state and config.
#[derive(Clone, Debug)]
pub struct Machine {
    /// Static parameters.
    pub cfg: MachineConfig,
    /// Current state.
    pub state: State,
}

impl Machine {
    /// New machine in Init, started at `now`.
    pub fn new(cfg: MachineConfig, now: Instant) -> Machine {
        Machine {
            state: State::initial(&cfg, now),
            cfg,
        }
    }

    /// Apply one event; returns the actions.
    pub fn feed(&mut self, event: &Event, now: Instant) -> Vec<Action> {
        let (next, actions) = step(&self.state, event, now, &self.cfg);
        self.state = next;
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(role: Role) -> MachineConfig {
        cfg_checks(role, false)
    }

    fn cfg_checks(role: Role, wake_checks: bool) -> MachineConfig {
        MachineConfig {
            role,
            startup_timeout: Duration::from_secs(60),
            waking_timeout: Duration::from_secs(2),
            wake_checks,
            anchored: true,
            unhealthy_after: 3,
        }
    }

    fn all_events() -> Vec<Event> {
        vec![
            Event::EngineHealthy,
            Event::EngineUnhealthy { failures: 1 },
            Event::EngineUnhealthy { failures: 3 },
            Event::LockGranted {
                epoch: 4,
                reclaimed: false,
            },
            Event::LockGranted {
                epoch: 4,
                reclaimed: true,
            },
            Event::LockBusy,
            Event::LockDisconnected,
            Event::LockReconnected,
            Event::Slept,
            Event::Woke,
            Event::SleepFailed("x".into()),
            Event::WakeFailed("x".into()),
            Event::WakeCheckPassed,
            Event::WakeCheckFailed {
                cause: "GMS holds no committed weights".into(),
            },
            Event::EngineExited(ProcessEnd::Signaled(9)),
            Event::LockLost("gone".into()),
            Event::Revoked("ops".into()),
            Event::LockClosed("closed".into()),
            Event::LockError("bad".into()),
            Event::LockUnavailable("etcd down".into()),
            Event::Timeout(TimeoutKind::Startup),
            Event::Timeout(TimeoutKind::Waking),
            Event::Terminate,
        ]
    }

    fn all_states(t0: Instant) -> Vec<State> {
        let d = t0 + Duration::from_secs(60);
        vec![
            State::Init {
                step: InitStep::WaitingHealthy,
                deadline: d,
            },
            State::Init {
                step: InitStep::TryingLock,
                deadline: d,
            },
            State::Init {
                step: InitStep::Sleeping,
                deadline: d,
            },
            State::Standby,
            State::Waking {
                deadline: t0 + Duration::from_secs(2),
                step: WakeStep::GpuCheck,
            },
            State::Waking {
                deadline: t0 + Duration::from_secs(2),
                step: WakeStep::WakeCall,
            },
            State::Active,
            State::Dead(DeadReason::Stopped),
        ]
    }

    /// The expected outcome of every event in every state, written out as a table
    /// (independently of `step`'s structure), for both roles and both sides of each deadline.
    fn expected(
        c: &MachineConfig,
        s: &State,
        e: &Event,
        now: Instant,
        t0: Instant,
    ) -> (State, Vec<Action>) {
        use Event as E;
        use InitStep::*;
        let role = c.role;
        let d = t0 + Duration::from_secs(60);
        let keep = (s.clone(), vec![]);
        // The lease is held in Waking and Active, unless it was just lost or revoked.
        let held_in_state = matches!(s, State::Waking { .. } | State::Active);
        let die = |r: DeadReason| {
            let lease_held =
                held_in_state && !matches!(r, DeadReason::LockLost(_) | DeadReason::Revoked(_));
            (
                State::Dead(r.clone()),
                vec![Action::Fence {
                    reason: r,
                    lease_held,
                }],
            )
        };
        if let State::Dead(_) = s {
            return keep;
        }
        let keeper = if c.anchored {
            vec![]
        } else {
            vec![Action::SpawnKeeper]
        };
        match e {
            E::EngineExited(x) => return die(DeadReason::EngineExited(*x)),
            E::LockLost(x) => return die(DeadReason::LockLost(x.clone())),
            E::Revoked(x) => return die(DeadReason::Revoked(x.clone())),
            E::LockClosed(x) => return die(DeadReason::LockUnavailable(x.clone())),
            E::Terminate => return die(DeadReason::Stopped),
            _ => {}
        }
        match s {
            State::Init { step, .. } => match (step, e) {
                (_, E::Timeout(TimeoutKind::Startup)) if now >= d => {
                    die(DeadReason::StartupTimeout)
                }
                (WaitingHealthy, E::EngineHealthy) if role == Role::Primary => (
                    State::Init {
                        step: TryingLock,
                        deadline: d,
                    },
                    vec![Action::TryLock],
                ),
                (WaitingHealthy, E::EngineHealthy) => (
                    State::Init {
                        step: Sleeping,
                        deadline: d,
                    },
                    vec![Action::Sleep],
                ),
                (WaitingHealthy | Sleeping, E::LockGranted { epoch, .. }) => die(
                    DeadReason::Protocol(format!("unrequested grant (epoch {epoch}) during init")),
                ),
                (TryingLock, E::LockGranted { epoch, .. }) => {
                    (State::Active, vec![Action::SetEpoch(*epoch)])
                }
                (TryingLock, E::LockBusy) => (
                    State::Init {
                        step: Sleeping,
                        deadline: d,
                    },
                    vec![Action::Sleep],
                ),
                (TryingLock, E::LockReconnected) => {
                    let mut a = keeper.clone();
                    a.push(Action::TryLock);
                    (s.clone(), a)
                }
                (_, E::LockReconnected) => (s.clone(), keeper),
                (TryingLock, E::LockError(x)) => die(DeadReason::Protocol(x.clone())),
                (TryingLock, E::LockUnavailable(_)) => {
                    (s.clone(), vec![Action::RetryLock { wait: false }])
                }
                (Sleeping, E::Slept) if c.wake_checks => (
                    State::Standby,
                    vec![Action::WaitLock, Action::RememberLayout],
                ),
                (Sleeping, E::Slept) => (State::Standby, vec![Action::WaitLock]),
                (Sleeping, E::SleepFailed(x)) => die(DeadReason::SleepFailed(x.clone())),
                _ => keep,
            },
            State::Standby => match e {
                E::LockGranted { epoch, .. } if c.wake_checks => (
                    State::Waking {
                        deadline: now + c.waking_timeout,
                        step: WakeStep::GpuCheck,
                    },
                    vec![Action::SetEpoch(*epoch), Action::CheckBeforeWake],
                ),
                E::LockGranted { epoch, .. } => (
                    State::Waking {
                        deadline: now + c.waking_timeout,
                        step: WakeStep::WakeCall,
                    },
                    vec![Action::SetEpoch(*epoch), Action::Wake],
                ),
                E::LockError(x) => die(DeadReason::Protocol(x.clone())),
                E::LockUnavailable(_) => (s.clone(), vec![Action::RetryLock { wait: true }]),
                E::LockReconnected => (s.clone(), keeper),
                _ => keep,
            },
            State::Waking {
                deadline,
                step: WakeStep::GpuCheck,
            } => match e {
                E::WakeCheckPassed => (
                    State::Waking {
                        deadline: *deadline,
                        step: WakeStep::WakeCall,
                    },
                    vec![Action::Wake],
                ),
                E::WakeCheckFailed { cause } => die(DeadReason::GpuCheckFailed(cause.clone())),
                E::Timeout(TimeoutKind::Waking) if now >= *deadline => {
                    die(DeadReason::WakingTimeout)
                }
                E::LockGranted { epoch, .. } => (s.clone(), vec![Action::SetEpoch(*epoch)]),
                E::LockReconnected => (s.clone(), keeper),
                // No wake call is in flight: Woke / WakeFailed cannot be ours.
                _ => keep,
            },
            State::Waking {
                deadline,
                step: WakeStep::WakeCall,
            } => match e {
                E::Woke => (State::Active, vec![]),
                E::WakeFailed(x) => die(DeadReason::WakeFailed(x.clone())),
                E::Timeout(TimeoutKind::Waking) if now >= *deadline => {
                    die(DeadReason::WakingTimeout)
                }
                E::LockGranted { epoch, .. } => (s.clone(), vec![Action::SetEpoch(*epoch)]),
                E::LockReconnected => (s.clone(), keeper),
                // A stale check result after the wake call started changes nothing.
                _ => keep,
            },
            State::Active => match e {
                E::EngineUnhealthy { failures } if *failures >= 3 => {
                    die(DeadReason::EngineUnhealthy(*failures))
                }
                E::LockGranted { epoch, .. } => (s.clone(), vec![Action::SetEpoch(*epoch)]),
                E::LockReconnected => (s.clone(), keeper),
                _ => keep,
            },
            State::Dead(_) => keep,
        }
    }

    #[test]
    fn lock_retry_backoff_doubles_and_is_bounded() {
        let ms: Vec<u128> = (0..8).map(|a| lock_retry_delay(a).as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(lock_retry_delay(u32::MAX), LOCK_RETRY_MAX);
    }

    #[test]
    fn a_standby_answered_unavailable_stays_asleep_and_asks_again() {
        let t0 = Instant::now();
        let c = cfg(Role::Shadow);
        let (s, a) = step(
            &State::Standby,
            &Event::LockUnavailable("etcd backend: cannot get an etcd lease".into()),
            t0,
            &c,
        );
        assert_eq!(s, State::Standby);
        assert_eq!(a, vec![Action::RetryLock { wait: true }]);
        // Then granted as usual.
        let (s, _) = step(
            &s,
            &Event::LockGranted {
                epoch: 9,
                reclaimed: false,
            },
            t0,
            &c,
        );
        assert!(matches!(s, State::Waking { .. }), "{s:?}");
    }

    /// Every event in every state, for both roles, before and after every deadline.
    #[test]
    fn every_event_in_every_state() {
        let t0 = Instant::now();
        let times = [
            t0,
            t0 + Duration::from_secs(3),
            t0 + Duration::from_secs(61),
        ];
        let mut checked = 0;
        for (role, checks, anchored) in [Role::Primary, Role::Shadow]
            .into_iter()
            .flat_map(|r| [(r, false), (r, true)])
            .flat_map(|(r, c)| [(r, c, false), (r, c, true)])
        {
            {
                let c = MachineConfig {
                    anchored,
                    ..cfg_checks(role, checks)
                };
                for s in all_states(t0) {
                    for e in all_events() {
                        for now in times {
                            let got = step(&s, &e, now, &c);
                            let want = expected(&c, &s, &e, now, t0);
                            assert_eq!(
                                got,
                                want,
                                "role={role:?} checks={checks} anchored={anchored} state={s:?} event={e:?} now=+{:?}",
                                now - t0
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 2 * 2 * 8 * 23 * 3);
    }

    #[test]
    fn dead_is_terminal_and_fences_once() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg(Role::Shadow), t0);
        let a = m.feed(&Event::EngineExited(ProcessEnd::Exited(1)), t0);
        assert_eq!(
            a,
            vec![Action::Fence {
                reason: DeadReason::EngineExited(ProcessEnd::Exited(1)),
                lease_held: false
            }]
        );
        for e in all_events() {
            assert!(m.feed(&e, t0 + Duration::from_secs(100)).is_empty());
            assert_eq!(m.state.phase(), Phase::Dead);
        }
    }

    #[test]
    fn shadow_happy_path() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg(Role::Shadow), t0);
        assert_eq!(m.state.phase(), Phase::Init);
        assert_eq!(m.feed(&Event::EngineHealthy, t0), vec![Action::Sleep]);
        assert_eq!(m.state.phase(), Phase::Init);
        assert_eq!(m.feed(&Event::Slept, t0), vec![Action::WaitLock]);
        assert_eq!(m.state.phase(), Phase::Standby);
        assert_eq!(m.state.deadline(), None);
        let g = Event::LockGranted {
            epoch: 9,
            reclaimed: false,
        };
        let t1 = t0 + Duration::from_secs(500);
        assert_eq!(m.feed(&g, t1), vec![Action::SetEpoch(9), Action::Wake]);
        assert_eq!(
            m.state.deadline(),
            Some((TimeoutKind::Waking, t1 + Duration::from_secs(2)))
        );
        // An early waking timeout is ignored, a late one kills.
        assert!(m.feed(&Event::Timeout(TimeoutKind::Waking), t1).is_empty());
        assert_eq!(m.feed(&Event::Woke, t1), vec![]);
        assert_eq!(m.state, State::Active);
        // Active has no deadline, a stale waking timeout does nothing.
        assert!(m
            .feed(
                &Event::Timeout(TimeoutKind::Waking),
                t1 + Duration::from_secs(9)
            )
            .is_empty());
        assert_eq!(m.state, State::Active);
    }

    #[test]
    fn primary_free_lock_goes_straight_to_active() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg(Role::Primary), t0);
        assert_eq!(m.feed(&Event::EngineHealthy, t0), vec![Action::TryLock]);
        let g = Event::LockGranted {
            epoch: 1,
            reclaimed: false,
        };
        assert_eq!(m.feed(&g, t0), vec![Action::SetEpoch(1)]);
        assert_eq!(m.state, State::Active);
    }

    #[test]
    fn primary_busy_lock_behaves_as_shadow() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg(Role::Primary), t0);
        m.feed(&Event::EngineHealthy, t0);
        assert_eq!(m.feed(&Event::LockBusy, t0), vec![Action::Sleep]);
        assert_eq!(m.feed(&Event::Slept, t0), vec![Action::WaitLock]);
        assert_eq!(m.state, State::Standby);
    }

    #[test]
    fn hung_wake_times_out() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg(Role::Shadow), t0);
        m.feed(&Event::EngineHealthy, t0);
        m.feed(&Event::Slept, t0);
        m.feed(
            &Event::LockGranted {
                epoch: 2,
                reclaimed: false,
            },
            t0,
        );
        let a = m.feed(
            &Event::Timeout(TimeoutKind::Waking),
            t0 + Duration::from_secs(2),
        );
        assert_eq!(
            a,
            vec![Action::Fence {
                reason: DeadReason::WakingTimeout,
                lease_held: true
            }]
        );
        assert_eq!(DeadReason::WakingTimeout.exit_code(), 14);
    }

    #[test]
    fn exit_codes_are_distinct_and_only_stop_is_zero() {
        let reasons = [
            DeadReason::Stopped,
            DeadReason::EngineExited(ProcessEnd::Unknown),
            DeadReason::StartupTimeout,
            DeadReason::SleepFailed(String::new()),
            DeadReason::WakeFailed(String::new()),
            DeadReason::WakingTimeout,
            DeadReason::LockLost(String::new()),
            DeadReason::Revoked(String::new()),
            DeadReason::LockUnavailable(String::new()),
            DeadReason::Protocol(String::new()),
            DeadReason::GpuCheckFailed(String::new()),
            DeadReason::InitMemoryTimeout(String::new()),
            DeadReason::EngineUnhealthy(3),
        ];
        let mut codes: Vec<i32> = reasons.iter().map(|r| r.exit_code()).collect();
        assert_eq!(codes.iter().filter(|c| **c == 0).count(), 1);
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), reasons.len());
    }

    /// An Active engine is fenced after `unhealthy_after` failed checks in a row, holding the
    /// lease (the memory wait applies), urgently; fewer, or any number outside Active, or the
    /// rule turned off (0), change nothing.
    #[test]
    fn unhealthy_active_is_fenced_after_the_threshold() {
        let t0 = Instant::now();
        let c = cfg(Role::Primary);
        let bad = |n| Event::EngineUnhealthy { failures: n };
        assert_eq!(
            step(&State::Active, &bad(2), t0, &c),
            (State::Active, vec![])
        );
        let (s, a) = step(&State::Active, &bad(3), t0, &c);
        assert_eq!(s, State::Dead(DeadReason::EngineUnhealthy(3)));
        assert_eq!(
            a,
            vec![Action::Fence {
                reason: DeadReason::EngineUnhealthy(3),
                lease_held: true
            }]
        );
        assert!(DeadReason::EngineUnhealthy(3).urgent());
        assert_eq!(DeadReason::EngineUnhealthy(3).exit_code(), 21);
        for s in [State::Standby, State::initial(&c, t0)] {
            assert_eq!(step(&s, &bad(9), t0, &c), (s.clone(), vec![]));
        }
        let off = MachineConfig {
            unhealthy_after: 0,
            ..c
        };
        assert_eq!(
            step(&State::Active, &bad(99), t0, &off),
            (State::Active, vec![])
        );
    }

    /// With checks: Standby remembers the layout; a grant checks first and wakes only after
    /// the check passed; the waking budget covers check + wake.
    #[test]
    fn checked_wake_path() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg_checks(Role::Shadow, true), t0);
        assert_eq!(m.feed(&Event::EngineHealthy, t0), vec![Action::Sleep]);
        assert_eq!(
            m.feed(&Event::Slept, t0),
            vec![Action::WaitLock, Action::RememberLayout]
        );
        let g = Event::LockGranted {
            epoch: 3,
            reclaimed: false,
        };
        assert_eq!(
            m.feed(&g, t0),
            vec![Action::SetEpoch(3), Action::CheckBeforeWake]
        );
        assert_eq!(m.state.phase(), Phase::Waking);
        // A Woke before any wake call is not ours.
        assert!(m.feed(&Event::Woke, t0).is_empty());
        assert_eq!(m.feed(&Event::WakeCheckPassed, t0), vec![Action::Wake]);
        // The deadline is still the one set at the grant.
        assert_eq!(
            m.state.deadline(),
            Some((TimeoutKind::Waking, t0 + Duration::from_secs(2)))
        );
        // A second check result changes nothing once the wake call runs.
        assert!(m
            .feed(
                &Event::WakeCheckFailed {
                    cause: "late".into()
                },
                t0
            )
            .is_empty());
        assert_eq!(m.feed(&Event::Woke, t0), vec![]);
        assert_eq!(m.state, State::Active);
    }

    #[test]
    fn failed_check_is_dead_with_its_cause_and_exit_19() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg_checks(Role::Primary, true), t0);
        m.feed(&Event::EngineHealthy, t0);
        m.feed(&Event::LockBusy, t0);
        m.feed(&Event::Slept, t0);
        m.feed(
            &Event::LockGranted {
                epoch: 5,
                reclaimed: false,
            },
            t0,
        );
        let cause = "GMS holds no committed weights (state EMPTY)".to_string();
        let a = m.feed(
            &Event::WakeCheckFailed {
                cause: cause.clone(),
            },
            t0,
        );
        let r = DeadReason::GpuCheckFailed(cause.clone());
        assert_eq!(
            a,
            vec![Action::Fence {
                reason: r.clone(),
                lease_held: true
            }]
        );
        assert_eq!(r.exit_code(), 19);
        assert!(!r.urgent());
        assert!(r.to_string().contains(&cause));
    }

    /// A primary that finds the lock free goes straight to Active: no check (nothing was
    /// slept, the engine already holds its weights and memory).
    #[test]
    fn primary_free_lock_skips_checks() {
        let t0 = Instant::now();
        let mut m = Machine::new(cfg_checks(Role::Primary, true), t0);
        assert_eq!(m.feed(&Event::EngineHealthy, t0), vec![Action::TryLock]);
        let g = Event::LockGranted {
            epoch: 1,
            reclaimed: false,
        };
        assert_eq!(m.feed(&g, t0), vec![Action::SetEpoch(1)]);
        assert_eq!(m.state, State::Active);
    }
}
