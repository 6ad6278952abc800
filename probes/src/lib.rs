//! Kubernetes probes for `supervisor run`: `/startup`, `/live`, `/ready`, `/state`, `/metrics`.
//!
//! Probes answer from state held in memory ([`ProbeState`]) and never call into the engine: the
//! supervisor's driver polls the engine's health in the background and writes the result here,
//! so a probe costs one read lock and stays fast while the engine (or the machine) is loaded.
//!
//! * [`verdict`] holds the pure decision functions (phase + health + clock -> 200/503),
//! * [`metrics`] the Prometheus text rendering ([`dynamo`]: Dynamo's failover series in it),
//! * [`server`] the hyper HTTP/1 server.

pub mod dynamo;
pub mod metrics;
pub mod server;
pub mod state;
pub mod verdict;

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use metrics::Metrics;
pub use server::{serve, ProbeError};
pub use state::{MarkKind, StateDoc, WaitReason};
pub use verdict::{live, ready, startup, ProbeView};

/// The externally visible lifecycle phase of the engine (docs/INTERFACES.md: `/state.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Engine loading (model load, graph capture), or being put to sleep for the first time.
    Init,
    /// Engine initialised and asleep; waiting for the lock.
    Standby,
    /// Lock granted; the engine is being woken up.
    Waking,
    /// Engine awake, holding the lock, serving.
    Active,
    /// Terminal for one incarnation: the engine is dead or being fenced; then either the
    /// supervisor exits or a new incarnation starts in Init (`/state.incarnation` + 1).
    Dead,
}

impl Phase {
    /// Every phase, in lifecycle order (for exhaustive tests and metric rendering).
    pub const ALL: [Phase; 5] = [
        Phase::Init,
        Phase::Standby,
        Phase::Waking,
        Phase::Active,
        Phase::Dead,
    ];

    /// Lower-case name, as in `/state` and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Init => "init",
            Phase::Standby => "standby",
            Phase::Waking => "waking",
            Phase::Active => "active",
            Phase::Dead => "dead",
        }
    }

    /// Index into [`Phase::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entered phase, with a wall-clock time so that drills can compare across processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// The phase entered.
    pub to: Phase,
    /// Wall-clock time of entry, microseconds since the Unix epoch.
    pub at_unix_us: i64,
}

/// A named point in time on the failover path, for the `/state` breakdown (drills and the
/// benchmark compute "death detected -> tree reaped -> lock granted -> woken" from these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    /// What happened.
    pub what: MarkKind,
    /// Wall-clock time, microseconds since the Unix epoch.
    pub at_unix_us: i64,
}

/// A wait before the supervisor goes on (`/state.waiting` and its details).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// What for.
    pub reason: WaitReason,
    /// When it began (monotonic, for `waiting_ms`).
    pub since: Instant,
    /// Its bound.
    pub timeout: std::time::Duration,
    /// Free device memory needed (bytes), once known.
    pub need_bytes: Option<u64>,
    /// Free device memory at the last sample (bytes).
    pub free_bytes: Option<u64>,
}

/// Everything the probes answer from. Written by the supervisor's driver, read by handlers.
#[derive(Clone, Debug)]
pub struct Status {
    /// Engine id from `--engine-id` (a label on every metric, a field of `/state`).
    pub engine_id: u32,
    /// `primary` or `shadow` (label and `/state` field).
    pub role: String,
    /// Current phase.
    pub phase: Phase,
    /// When the current phase was entered (monotonic, for `since_ms`).
    pub phase_since: Instant,
    /// Result of the last background health check; meaningful in Active.
    pub engine_healthy: bool,
    /// End of the waking budget while Waking: `/live` turns 503 once it has passed.
    pub waking_deadline: Option<Instant>,
    /// Lock epoch of the current grant (the engine cannot receive it in its environment
    /// because it is already running when the grant arrives, so it is exposed here).
    pub epoch: Option<u64>,
    /// Pid of the engine process (in the supervisor's PID namespace).
    pub engine_pid: Option<u32>,
    /// Every phase entered, oldest first.
    pub transitions: Vec<Transition>,
    /// Named points in time (see [`Mark`]).
    pub marks: Vec<Mark>,
    /// Whether the lock connection is currently up (false between Disconnected and Reconnected).
    pub lock_connected: bool,
    /// Why the supervisor went Dead (exit reason), once it has.
    pub dead_reason: Option<String>,
    /// Which incarnation of the engine this is (0 for the first; +1 per restart).
    pub incarnation: u32,
    /// Restarts of the engine in this supervisor's life.
    pub restarts: u32,
    /// The supervisor is up (first engine spawned, or the bounded `--init-min-free-memory`
    /// wait before it has begun): `/startup` 200 from then on.
    pub started: bool,
    /// In Init: when the current incarnation's `--startup-timeout` runs out.
    pub startup_deadline: Option<Instant>,
    /// The supervisor gave up (no new incarnation follows): `/live` 503 in Dead.
    pub gave_up: bool,
    /// A bounded wait in Init before the engine is spawned (`--init-min-free-memory`).
    pub waiting: Option<Waiting>,
}

impl Status {
    /// Fresh status in Init, entered now.
    pub fn new(engine_id: u32, role: impl Into<String>) -> Status {
        Status {
            engine_id,
            role: role.into(),
            phase: Phase::Init,
            phase_since: Instant::now(),
            engine_healthy: false,
            waking_deadline: None,
            epoch: None,
            engine_pid: None,
            transitions: vec![Transition {
                to: Phase::Init,
                at_unix_us: unix_us_now(),
            }],
            marks: Vec::new(),
            lock_connected: false,
            dead_reason: None,
            incarnation: 0,
            restarts: 0,
            started: false,
            startup_deadline: None,
            gave_up: false,
            waiting: None,
        }
    }

    /// The inputs of the pure probe verdicts.
    pub fn view(&self) -> ProbeView {
        ProbeView {
            phase: self.phase,
            engine_healthy: self.engine_healthy,
            waking_deadline: self.waking_deadline,
            started: self.started,
            startup_deadline: self.startup_deadline,
            gave_up: self.gave_up,
        }
    }

    /// The `/state` document (last occurrence of each mark).
    pub fn state_doc(&self, now: Instant) -> StateDoc {
        StateDoc {
            state: self.phase,
            engine_id: self.engine_id,
            role: self.role.clone(),
            epoch: self.epoch,
            since_ms: now.saturating_duration_since(self.phase_since).as_millis() as u64,
            engine_pid: self.engine_pid,
            transitions: self.transitions.clone(),
            healthy: self.engine_healthy,
            lock_connected: self.lock_connected,
            dead_reason: self.dead_reason.clone(),
            incarnation: self.incarnation,
            restarts: self.restarts,
            marks: self.marks.iter().map(|m| (m.what, m.at_unix_us)).collect(),
            waiting: self.waiting.map(|w| w.reason),
            waiting_need_bytes: self.waiting.and_then(|w| w.need_bytes),
            waiting_free_bytes: self.waiting.and_then(|w| w.free_bytes),
            waiting_ms: self
                .waiting
                .map(|w| now.saturating_duration_since(w.since).as_millis() as u64),
            waiting_timeout_ms: self.waiting.map(|w| w.timeout.as_millis() as u64),
        }
    }
}

/// Shared handle on the probe state and metrics (cheap to clone).
#[derive(Clone, Debug)]
pub struct ProbeState {
    /// The status, behind a std RwLock that is never held across an await.
    status: Arc<RwLock<Status>>,
    /// Counters and histograms rendered at `/metrics`.
    metrics: Arc<Metrics>,
}

impl ProbeState {
    /// New shared state for one engine.
    pub fn new(status: Status) -> ProbeState {
        let since = status
            .transitions
            .last()
            .map_or_else(unix_us_now, |t| t.at_unix_us);
        let metrics = Arc::new(Metrics::in_phase(
            status.engine_id,
            &status.role,
            status.phase,
            since,
        ));
        ProbeState {
            status: Arc::new(RwLock::new(status)),
            metrics,
        }
    }

    /// Read access (a poisoned lock is recovered: the data is plain values).
    pub fn read(&self) -> RwLockReadGuard<'_, Status> {
        self.status.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Write access.
    pub fn write(&self) -> RwLockWriteGuard<'_, Status> {
        self.status.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Record a named point in time (see [`Mark`]).
    pub fn mark(&self, what: MarkKind) {
        let at = unix_us_now();
        self.write().marks.push(Mark {
            what,
            at_unix_us: at,
        });
    }

    /// Enter `phase` now: records the transition (wall clock), resets `since`, counts it
    /// (the project's metrics and Dynamo's failover series, with the same wall-clock time).
    /// Returns the wall-clock timestamp recorded.
    pub fn enter(&self, phase: Phase, waking_deadline: Option<Instant>) -> i64 {
        let at = unix_us_now();
        {
            let mut s = self.write();
            s.phase = phase;
            s.phase_since = Instant::now();
            s.waking_deadline = waking_deadline;
            s.transitions.push(Transition {
                to: phase,
                at_unix_us: at,
            });
        }
        self.metrics.entered(phase, at);
        at
    }
}

/// Wall-clock now in microseconds since the Unix epoch (0 if the clock is before 1970).
pub fn unix_us_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_json_has_interface_fields() {
        let st = ProbeState::new(Status::new(3, "shadow"));
        st.enter(Phase::Standby, None);
        st.write().epoch = Some(7);
        st.mark(MarkKind::LockConnected);
        let v = serde_json::to_value(st.read().state_doc(Instant::now())).unwrap();
        assert!(v["marks"]["lock_connected"].is_i64(), "{v}");
        assert!(v["dead_reason"].is_null(), "{v}");
        assert_eq!(v["lock_connected"], false);
        assert_eq!(v["healthy"], false);
        assert_eq!(v["state"], "standby");
        assert_eq!(v["incarnation"], 0);
        assert_eq!(v["restarts"], 0);
        assert_eq!(v["engine_id"], 3);
        assert_eq!(v["role"], "shadow");
        assert_eq!(v["epoch"], 7);
        assert!(v["since_ms"].is_u64());
        assert!(v["engine_pid"].is_null());
        let tr = v["transitions"].as_array().unwrap();
        assert_eq!(tr.len(), 2);
        assert_eq!(tr[0]["to"], "init");
        assert_eq!(tr[1]["to"], "standby");
        assert!(tr[1]["at_unix_us"].as_i64().unwrap() >= tr[0]["at_unix_us"].as_i64().unwrap());
    }

    #[test]
    fn phase_index_matches_all() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(p.index(), i);
        }
    }
}
