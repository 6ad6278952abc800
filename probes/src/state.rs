//! The `/state` document, typed both ways: the supervisor writes it, the drill, the benchmark
//! and the tests read it with the same type (docs/INTERFACES.md, "Probe endpoints").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Phase, Transition};

/// A named point on the failover path (docs/CONTRACTS.md, "supervisor `/state` marks").
/// Serialized in `snake_case`, as the keys of `/state.marks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkKind {
    /// The first lock connection is up.
    LockConnected,
    /// The engine process was spawned.
    EngineSpawned,
    /// A new grant.
    LockGranted,
    /// A grant reclaimed after a lockd restart.
    LockReclaimed,
    /// The lock connection broke.
    LockDisconnected,
    /// A new lock connection is up after a break.
    LockReconnected,
    /// Unix: the anchors went with the reclaim.
    LockAnchorReattached,
    /// Last time new engine processes were pinned as process anchors.
    ProcessAnchorsAttached,
    /// TCP only: a lock keeper holds the new connection.
    LockKeeperSpawned,
    /// The engine's pidfd reported its exit.
    EngineExitDetected,
    /// Fencing began.
    FenceStarted,
    /// No engine process left.
    Fenced,
    /// The lock connection was closed.
    LockClosed,
    /// Before-wake GPU/GMS check began.
    GpuCheckStarted,
    /// Before-wake GPU/GMS check passed.
    GpuCheckPassed,
    /// Before-wake GPU/GMS check failed.
    GpuCheckFailed,
    /// The after-reap memory check finished.
    MemoryReleaseChecked,
}

impl MarkKind {
    /// Every mark, in the order of the documentation table.
    pub const ALL: [MarkKind; 17] = [
        MarkKind::LockConnected,
        MarkKind::EngineSpawned,
        MarkKind::LockGranted,
        MarkKind::LockReclaimed,
        MarkKind::LockDisconnected,
        MarkKind::LockReconnected,
        MarkKind::LockAnchorReattached,
        MarkKind::ProcessAnchorsAttached,
        MarkKind::LockKeeperSpawned,
        MarkKind::EngineExitDetected,
        MarkKind::FenceStarted,
        MarkKind::Fenced,
        MarkKind::LockClosed,
        MarkKind::GpuCheckStarted,
        MarkKind::GpuCheckPassed,
        MarkKind::GpuCheckFailed,
        MarkKind::MemoryReleaseChecked,
    ];

    /// The `snake_case` name used in `/state.marks`.
    pub fn as_str(self) -> &'static str {
        match self {
            MarkKind::LockConnected => "lock_connected",
            MarkKind::EngineSpawned => "engine_spawned",
            MarkKind::LockGranted => "lock_granted",
            MarkKind::LockReclaimed => "lock_reclaimed",
            MarkKind::LockDisconnected => "lock_disconnected",
            MarkKind::LockReconnected => "lock_reconnected",
            MarkKind::LockAnchorReattached => "lock_anchor_reattached",
            MarkKind::ProcessAnchorsAttached => "process_anchors_attached",
            MarkKind::LockKeeperSpawned => "lock_keeper_spawned",
            MarkKind::EngineExitDetected => "engine_exit_detected",
            MarkKind::FenceStarted => "fence_started",
            MarkKind::Fenced => "fenced",
            MarkKind::LockClosed => "lock_closed",
            MarkKind::GpuCheckStarted => "gpu_check_started",
            MarkKind::GpuCheckPassed => "gpu_check_passed",
            MarkKind::GpuCheckFailed => "gpu_check_failed",
            MarkKind::MemoryReleaseChecked => "memory_release_checked",
        }
    }
}

impl std::fmt::Display for MarkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the supervisor is waiting for before it goes on (`/state.waiting`), serialized in
/// `snake_case`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitReason {
    /// `--init-min-free-memory`: the device's free memory, before the engine is spawned.
    InitMemory,
    /// lockd answered `unavailable` (lockd on etcd: etcd unreachable): the lock request is
    /// repeated with a bounded backoff.
    LockUnavailable,
}

impl WaitReason {
    /// The `snake_case` name used in `/state.waiting`.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitReason::InitMemory => "init_memory",
            WaitReason::LockUnavailable => "lock_unavailable",
        }
    }
}

/// The `/state` document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDoc {
    /// Current phase.
    pub state: Phase,
    /// `--engine-id`.
    pub engine_id: u32,
    /// `primary` or `shadow`.
    pub role: String,
    /// Lock epoch of the current grant.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// Milliseconds in the current phase.
    #[serde(default)]
    pub since_ms: u64,
    /// Pid of the engine (supervisor's PID namespace).
    #[serde(default)]
    pub engine_pid: Option<u32>,
    /// Every phase entered, oldest first.
    #[serde(default)]
    pub transitions: Vec<Transition>,
    /// Last background health check.
    #[serde(default)]
    pub healthy: bool,
    /// Whether the lock connection is up.
    #[serde(default)]
    pub lock_connected: bool,
    /// Why the supervisor went Dead.
    #[serde(default)]
    pub dead_reason: Option<String>,
    /// Which incarnation of the engine this is: 0 for the first, + 1 per restart (a re-armed
    /// engine after fencing). Absent (0) from older supervisors.
    #[serde(default)]
    pub incarnation: u32,
    /// Restarts of the engine in this supervisor's life.
    #[serde(default)]
    pub restarts: u32,
    /// Wall-clock microseconds of the last occurrence of each mark.
    #[serde(default)]
    pub marks: BTreeMap<MarkKind, i64>,
    /// What the supervisor is waiting for (in Init, before spawning the engine), or null.
    #[serde(default)]
    pub waiting: Option<WaitReason>,
    /// While `waiting`: the free device memory needed, in bytes (null when not known yet).
    #[serde(default)]
    pub waiting_need_bytes: Option<u64>,
    /// While `waiting`: the free device memory at the last sample, in bytes.
    #[serde(default)]
    pub waiting_free_bytes: Option<u64>,
    /// While `waiting`: milliseconds waited so far.
    #[serde(default)]
    pub waiting_ms: Option<u64>,
    /// While `waiting`: the wait's bound in milliseconds (`--init-memory-timeout`).
    #[serde(default)]
    pub waiting_timeout_ms: Option<u64>,
}

impl StateDoc {
    /// Parses a `/state` body.
    pub fn parse(body: &str) -> Result<StateDoc, serde_json::Error> {
        serde_json::from_str(body)
    }

    /// The wall-clock time of `mark`, if it happened.
    pub fn mark(&self, mark: MarkKind) -> Option<i64> {
        self.marks.get(&mark).copied()
    }

    /// The wall-clock time `phase` was last entered.
    pub fn entered(&self, phase: Phase) -> Option<i64> {
        self.transitions
            .iter()
            .rev()
            .find(|t| t.to == phase)
            .map(|t| t.at_unix_us)
    }

    /// Every phase entered, in order.
    pub fn phases(&self) -> impl Iterator<Item = Phase> + '_ {
        self.transitions.iter().map(|t| t.to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ProbeState, Status};
    use std::time::Instant;

    #[test]
    fn marks_serialize_as_their_documented_names() {
        for m in MarkKind::ALL {
            let s = serde_json::to_string(&m).unwrap();
            assert_eq!(s, format!("\"{}\"", m.as_str()));
            let back: MarkKind = serde_json::from_str(&s).unwrap();
            assert_eq!(back, m);
        }
    }

    #[test]
    fn the_document_round_trips_and_reads_back_typed() {
        let st = ProbeState::new(Status::new(2, "primary"));
        st.mark(MarkKind::LockConnected);
        st.enter(Phase::Standby, None);
        st.mark(MarkKind::LockGranted);
        st.enter(Phase::Waking, None);
        st.enter(Phase::Active, None);
        let doc = st.read().state_doc(Instant::now());
        let body = serde_json::to_string(&doc).unwrap();
        let back = StateDoc::parse(&body).unwrap();
        assert_eq!(back, doc);
        assert_eq!(back.state, Phase::Active);
        assert_eq!(
            back.phases().collect::<Vec<_>>(),
            [Phase::Init, Phase::Standby, Phase::Waking, Phase::Active]
        );
        assert!(back.mark(MarkKind::LockGranted).is_some());
        assert!(back.mark(MarkKind::Fenced).is_none());
        assert!(back.entered(Phase::Active) >= back.entered(Phase::Waking));
    }

    #[test]
    fn the_waiting_reason_reads_back_typed_and_defaults_to_none() {
        let st = ProbeState::new(Status::new(1, "shadow"));
        let doc = st.read().state_doc(Instant::now());
        assert_eq!(doc.waiting, None);
        let v = serde_json::to_value(&doc).unwrap();
        assert!(v["waiting"].is_null(), "{v}");
        let now = Instant::now();
        st.write().waiting = Some(crate::Waiting {
            reason: WaitReason::InitMemory,
            since: now,
            timeout: std::time::Duration::from_secs(600),
            need_bytes: Some(60 << 30),
            free_bytes: Some(20 << 30),
        });
        let doc = st
            .read()
            .state_doc(now + std::time::Duration::from_millis(1500));
        let v = serde_json::to_value(&doc).unwrap();
        assert_eq!(v["waiting"], "init_memory", "{v}");
        assert_eq!(v["waiting_need_bytes"], 60u64 << 30);
        assert_eq!(v["waiting_free_bytes"], 20u64 << 30);
        assert_eq!(v["waiting_ms"], 1500);
        assert_eq!(v["waiting_timeout_ms"], 600_000);
        let back = StateDoc::parse(&v.to_string()).unwrap();
        assert_eq!(back, doc);
        assert_eq!(back.waiting, Some(WaitReason::InitMemory));
        // Older supervisors: absent fields read as "not waiting".
        let old = StateDoc::parse(r#"{"state":"init","engine_id":1,"role":"x"}"#).unwrap();
        assert_eq!(
            (old.waiting, old.waiting_need_bytes, old.waiting_ms),
            (None, None, None)
        );
        assert!(
            StateDoc::parse(r#"{"state":"init","engine_id":1,"role":"x","waiting":"nap"}"#)
                .is_err()
        );
    }

    #[test]
    fn unknown_phases_and_marks_are_errors_not_defaults() {
        assert!(StateDoc::parse(r#"{"state":"sleeping","engine_id":1,"role":"x"}"#).is_err());
        assert!(StateDoc::parse(
            r#"{"state":"dead","engine_id":1,"role":"x","marks":{"teleported":1}}"#
        )
        .is_err());
        assert!(StateDoc::parse("{").is_err());
    }
}
