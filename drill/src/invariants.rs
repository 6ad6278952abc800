//! The invariants a round must keep, checked over what the drill recorded during the round.
//! Pure functions over plain data: the runner observes, this module judges.

use probes::Phase;
use serde::{Deserialize, Serialize};

use crate::schedule::FailureKind;

/// One entry of a supervisor's `/state` `transitions` list, on the drill's unsigned clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// The phase entered.
    pub to: Phase,
    /// When it was entered, wall clock in microseconds (comparable across processes).
    pub at_unix_us: u64,
}

impl From<&probes::Transition> for Transition {
    /// A time before the Unix epoch (a broken clock) reads as 0.
    fn from(t: &probes::Transition) -> Transition {
        Transition {
            to: t.to,
            at_unix_us: u64::try_from(t.at_unix_us).unwrap_or(0),
        }
    }
}

/// A lock grant the drill saw (from `lockd watch`), with what was alive at that moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantObs {
    /// Drill wall clock when the grant was read, microseconds.
    pub seen_at_unix_us: u64,
    /// The lease epoch lockd granted, when the event carried one.
    pub epoch: Option<u64>,
    /// The holder name lockd granted to, when the event carried one.
    pub holder: Option<String>,
    /// A reclaim of a lease after a lockd restart (keeps its epoch) rather than a new grant.
    pub reclaimed: bool,
    /// Engine id of the incarnation that held the lease before this grant (the one that
    /// must be fenced), when known.
    pub previous_engine_id: Option<u64>,
    /// Processes of that previous holder's engine found alive (not zombie, not exiting)
    /// when the grant was seen: each one is a fencing violation.
    pub previous_alive_pids: Vec<u32>,
    /// How many processes of the previous holder's engine (main, workers, lingering workers,
    /// descendants) were checked at that moment: 0 makes the check above vacuous.
    #[serde(default)]
    pub previous_checked: usize,
}

/// A line of the fake engines' `PATH.violations` file (the GPU claim found held).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimViolation {
    /// The engine that found the claim held by another engine.
    pub engine_id: Option<u64>,
    /// Its pid.
    pub pid: Option<u32>,
    /// When, microseconds.
    pub at_unix_us: Option<u64>,
    /// The raw line, kept for the report.
    pub line: String,
}

impl ClaimViolation {
    /// Parses one line of `PATH.violations`; unparsable lines are kept raw (they still count).
    pub fn parse(line: &str) -> ClaimViolation {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or(serde_json::Value::Null);
        ClaimViolation {
            engine_id: v.get("engine_id").and_then(|x| x.as_u64()),
            pid: v
                .get("pid")
                .and_then(|x| x.as_u64())
                .and_then(|p| u32::try_from(p).ok()),
            at_unix_us: v.get("at_unix_us").and_then(|x| x.as_u64()),
            line: line.trim().to_string(),
        }
    }
}

/// The time one engine incarnation spent Active, as its supervisor reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveInterval {
    /// Which engine.
    pub engine_id: u64,
    /// Which incarnation of that engine (restarts count up).
    pub incarnation: u32,
    /// Entered Active, microseconds.
    pub from_us: u64,
    /// Left Active (its next transition, or when the drill saw its engine dead);
    /// `None` while still Active.
    pub to_us: Option<u64>,
}

/// Everything recorded about one round that the invariants are judged on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RoundObs {
    /// What was injected (decides which invariants apply).
    pub kind: Option<FailureKind>,
    /// How long a failover may take, kill to new Active, microseconds.
    pub bound_us: u64,
    /// When the failure was injected, microseconds.
    pub t_kill_us: u64,
    /// The newest epoch granted before the round.
    pub epoch_before: Option<u64>,
    /// The engine that was Active when the failure was injected.
    pub victim_engine_id: Option<u64>,
    /// Grants seen from the kill to the end of the round, in order.
    pub grants: Vec<GrantObs>,
    /// New lines in the claim violations file since the round began.
    pub claim_violations: Vec<ClaimViolation>,
    /// The incarnation Active at the end of the round, if any: (engine id, incarnation,
    /// /state epoch, time it entered Active).
    pub final_active: Option<FinalActive>,
    /// Whether the final Active is the same incarnation as the victim (expected only for
    /// lockd crashes).
    pub final_is_victim: bool,
    /// Transitions any side made after the kill (a lockd crash must cause none).
    pub transitions_after_kill: Vec<(u64, Transition)>,
    /// Lockd crash: the holder after the restart equals the one before (`None`: not checked).
    pub lease_reclaimed: Option<bool>,
    /// Active intervals of every incarnation that overlapped the round.
    pub active_intervals: Vec<ActiveInterval>,
    /// Compound rounds: the engine expected to end Active (`lockd-crash-during-wake`: the
    /// waker that was granted before the lockd crash), when known.
    #[serde(default)]
    pub expected_new_engine_id: Option<u64>,
    /// `revoke-during-reconnect`: whether the revoked side's supervisor fenced itself (reached
    /// Dead or exited) by the end of the round.
    #[serde(default)]
    pub victim_fenced: Option<bool>,
}

/// The incarnation Active at the end of a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalActive {
    /// Its engine id.
    pub engine_id: u64,
    /// Its incarnation number.
    pub incarnation: u32,
    /// The epoch its /state reports.
    pub epoch: Option<u64>,
    /// When it entered Active (its /state transition), microseconds.
    pub active_at_us: u64,
}

/// A broken invariant, as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "invariant", rename_all = "kebab-case")]
pub enum Violation {
    /// A fake engine found the exclusive GPU claim held by another engine: two engines
    /// held the resource at once.
    SplitBrainClaim {
        /// The engine that found it held.
        engine_id: Option<u64>,
        /// Its pid.
        pid: Option<u32>,
        /// The raw violations line.
        line: String,
    },
    /// The lease was granted while processes of the previous holder's engine were alive.
    FencedProcessAliveAtGrant {
        /// The epoch of the grant.
        epoch: Option<u64>,
        /// The previous holder.
        engine_id: Option<u64>,
        /// The processes found alive.
        pids: Vec<u32>,
    },
    /// No other engine became Active within the bound (or at all).
    NoNewActive {
        /// The bound, milliseconds.
        bound_ms: u64,
        /// Kill to new Active when one came late, milliseconds.
        took_ms: Option<u64>,
    },
    /// An epoch was not larger than the one before it (or a reclaim changed it).
    EpochNotIncreasing {
        /// The epoch before.
        previous: u64,
        /// The epoch seen.
        got: u64,
    },
    /// A lockd crash made something fail over or change state.
    UnexpectedFailover {
        /// What happened.
        detail: String,
    },
    /// After a lockd restart the Active side did not get its lease back.
    LeaseNotReclaimed,
    /// A compound round ended with another engine Active than the expected one (the waker
    /// granted before a lockd crash must reclaim and stay the new Active).
    WrongNewActive {
        /// The engine expected Active.
        expected: u64,
        /// The engine Active at the end (None: nobody).
        got: Option<u64>,
    },
    /// A lease revoked during lockd's reconnect window was not followed by its holder fencing
    /// itself.
    RevokedNotFenced,
    /// Two supervisors reported Active over overlapping times.
    ActiveOverlap {
        /// One engine.
        a: u64,
        /// The other.
        b: u64,
        /// How long both were Active, microseconds.
        overlap_us: u64,
    },
}

impl Violation {
    /// A short machine name for the summary.
    pub fn name(&self) -> &'static str {
        match self {
            Violation::SplitBrainClaim { .. } => "split-brain-claim",
            Violation::FencedProcessAliveAtGrant { .. } => "fenced-process-alive-at-grant",
            Violation::NoNewActive { .. } => "no-new-active",
            Violation::EpochNotIncreasing { .. } => "epoch-not-increasing",
            Violation::UnexpectedFailover { .. } => "unexpected-failover",
            Violation::LeaseNotReclaimed => "lease-not-reclaimed",
            Violation::WrongNewActive { .. } => "wrong-new-active",
            Violation::RevokedNotFenced => "revoked-not-fenced",
            Violation::ActiveOverlap { .. } => "active-overlap",
        }
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::SplitBrainClaim { engine_id, pid, .. } => write!(
                f,
                "split brain: engine {} (pid {}) found the GPU claim held by another engine",
                opt(engine_id),
                opt(pid)
            ),
            Violation::FencedProcessAliveAtGrant {
                epoch,
                engine_id,
                pids,
            } => write!(
                f,
                "lease epoch {} granted while engine {} still had live processes {:?}",
                opt(epoch),
                opt(engine_id),
                pids
            ),
            Violation::NoNewActive {
                bound_ms,
                took_ms: Some(t),
            } => {
                write!(f, "new Active after {t} ms, over the {bound_ms} ms bound")
            }
            Violation::NoNewActive {
                bound_ms,
                took_ms: None,
            } => {
                write!(f, "no new Active within {bound_ms} ms")
            }
            Violation::EpochNotIncreasing { previous, got } => {
                write!(f, "epoch {got} after {previous}: not strictly increasing")
            }
            Violation::UnexpectedFailover { detail } => {
                write!(f, "lockd crash caused a change: {detail}")
            }
            Violation::LeaseNotReclaimed => write!(
                f,
                "the lease holder did not reclaim its lease after the lockd restart"
            ),
            Violation::WrongNewActive { expected, got } => write!(
                f,
                "engine {} ended Active, expected engine {expected}",
                opt(got)
            ),
            Violation::RevokedNotFenced => write!(
                f,
                "the lease was revoked during the reconnect window but its holder did not fence itself"
            ),
            Violation::ActiveOverlap { a, b, overlap_us } => write!(
                f,
                "engines {a} and {b} were both Active for {} ms",
                overlap_us / 1000
            ),
        }
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "?".to_string(), |x| x.to_string())
}

/// Judges one round. Every invariant that applies to the round's kind is checked; the
/// result lists each broken one.
pub fn check_round(o: &RoundObs) -> Vec<Violation> {
    let mut out = Vec::new();
    // 1. At most one engine held the exclusive resource at any instant (the fake engines'
    //    flock-based claim, not assumed).
    for c in &o.claim_violations {
        out.push(Violation::SplitBrainClaim {
            engine_id: c.engine_id,
            pid: c.pid,
            line: c.line.clone(),
        });
    }
    // 2. No process of a fenced engine alive when the next grant happened.
    for g in &o.grants {
        if !g.reclaimed && !g.previous_alive_pids.is_empty() {
            out.push(Violation::FencedProcessAliveAtGrant {
                epoch: g.epoch,
                engine_id: g.previous_engine_id,
                pids: g.previous_alive_pids.clone(),
            });
        }
    }
    // 3. Epochs strictly increasing (a reclaim keeps its epoch).
    let mut last = o.epoch_before;
    for g in &o.grants {
        let Some(e) = g.epoch else { continue };
        if let Some(prev) = last {
            let ok = if g.reclaimed { e >= prev } else { e > prev };
            if !ok {
                out.push(Violation::EpochNotIncreasing {
                    previous: prev,
                    got: e,
                });
            }
        }
        last = Some(last.map_or(e, |p| p.max(e)));
    }
    if let (Some(fa), Some(prev)) = (&o.final_active, o.epoch_before) {
        if let Some(e) = fa.epoch {
            let expect_new = o.kind.is_some_and(|k| k.expects_failover()) && !o.final_is_victim;
            if (expect_new && e <= prev) || e < prev {
                out.push(Violation::EpochNotIncreasing {
                    previous: prev,
                    got: e,
                });
            }
        }
    }
    // 4. A new Active within the bound (failover kinds), or no change at all (lockd crash).
    match o.kind {
        Some(k) if k.expects_failover() => match &o.final_active {
            Some(fa) if !o.final_is_victim => {
                let took = fa.active_at_us.saturating_sub(o.t_kill_us);
                if took > o.bound_us {
                    out.push(Violation::NoNewActive {
                        bound_ms: o.bound_us / 1000,
                        took_ms: Some(took / 1000),
                    });
                }
            }
            _ => out.push(Violation::NoNewActive {
                bound_ms: o.bound_us / 1000,
                took_ms: None,
            }),
        },
        Some(_) => {
            if !o.final_is_victim || o.final_active.is_none() {
                out.push(Violation::UnexpectedFailover {
                    detail: "the Active engine did not stay Active".into(),
                });
            }
            for (eid, t) in &o.transitions_after_kill {
                out.push(Violation::UnexpectedFailover {
                    detail: format!("engine {eid} entered {} after the lockd crash", t.to),
                });
            }
            for g in o.grants.iter().filter(|g| !g.reclaimed) {
                out.push(Violation::UnexpectedFailover {
                    detail: format!(
                        "lease granted anew (epoch {}) instead of reclaimed",
                        opt(&g.epoch)
                    ),
                });
            }
            if o.lease_reclaimed == Some(false) {
                out.push(Violation::LeaseNotReclaimed);
            }
        }
        None => {}
    }
    // 5. Supervisors never both Active.
    out.extend(active_overlaps(&o.active_intervals));
    // 6. What each compound kind expects on top of a failover (checks 1-5 apply as well).
    match o.kind {
        // The Active side must have reclaimed (before its supervisor was killed); the waker
        // granted before the lockd crash must reclaim.
        Some(FailureKind::LockdCrashThenSupervisorKill | FailureKind::LockdCrashDuringWake)
            if o.lease_reclaimed == Some(false) =>
        {
            out.push(Violation::LeaseNotReclaimed);
        }
        Some(FailureKind::RevokeDuringReconnect) if o.victim_fenced == Some(false) => {
            out.push(Violation::RevokedNotFenced);
        }
        _ => {}
    }
    if let Some(expected) = o.expected_new_engine_id {
        let got = o.final_active.as_ref().map(|f| f.engine_id);
        // A missing Active is already `no-new-active`.
        if got.is_some() && got != Some(expected) {
            out.push(Violation::WrongNewActive { expected, got });
        }
    }
    out
}

/// The fencing check of a failover round, for the report: (pids of the previous holder's
/// engine checked, of them alive) at the first new (not reclaimed) grant. `None` when the
/// round saw no new grant.
pub fn fence_check(grants: &[GrantObs]) -> Option<(usize, usize)> {
    grants
        .iter()
        .find(|g| !g.reclaimed)
        .map(|g| (g.previous_checked, g.previous_alive_pids.len()))
}

/// One engine life as the interval bookkeeping needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifeTransitions<'a> {
    /// Engine id.
    pub engine_id: u64,
    /// Incarnation.
    pub incarnation: u32,
    /// Its `/state` transitions.
    pub transitions: &'a [Transition],
    /// When its supervisor exited, or was SIGKILLed by the drill (ends an Active interval that
    /// has no next transition).
    pub exited_us: Option<u64>,
}

/// One engine life as the drill saw it: its transitions and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifeObs<'a> {
    /// Engine id.
    pub engine_id: u64,
    /// Incarnation.
    pub incarnation: u32,
    /// Its `/state` transitions.
    pub transitions: &'a [Transition],
    /// When the drill saw its supervisor exit.
    pub exited_us: Option<u64>,
    /// When the drill SIGKILLed its supervisor.
    pub sigkilled_us: Option<u64>,
}

/// Every transition any life made at or after `t_kill`, with its engine id.
pub fn transitions_after(lives: &[LifeObs<'_>], t_kill: u64) -> Vec<(u64, Transition)> {
    lives
        .iter()
        .flat_map(|l| {
            l.transitions
                .iter()
                .filter(move |t| t.at_unix_us >= t_kill)
                .map(move |t| (l.engine_id, t.clone()))
        })
        .collect()
}

/// The lives with the moment each one ended, for [`active_intervals`]: when its supervisor
/// exited; for a supervisor the drill SIGKILLed, the earliest of its exit, the SIGKILL and the
/// moment another life was granted the lease after `t_kill` (its Waking, or a primary's
/// Active). A lease moves only once the previous holder's connection is closed, which a
/// supervisor does only after leaving Active, or by dying: so this bounds the Active interval
/// of a supervisor the drill SIGKILLed whose last transitions it never read.
pub fn life_ends<'a>(lives: &[LifeObs<'a>], t_kill: u64) -> Vec<LifeTransitions<'a>> {
    let granted_after_kill = |me: &LifeObs<'_>| -> Option<u64> {
        lives
            .iter()
            .filter(|o| (o.engine_id, o.incarnation) != (me.engine_id, me.incarnation))
            .flat_map(|o| o.transitions.iter())
            .filter(|t| t.at_unix_us >= t_kill && matches!(t.to, Phase::Waking | Phase::Active))
            .map(|t| t.at_unix_us)
            .min()
    };
    lives
        .iter()
        .map(|l| LifeTransitions {
            engine_id: l.engine_id,
            incarnation: l.incarnation,
            transitions: l.transitions,
            exited_us: match l.sigkilled_us {
                Some(k) => [l.exited_us, Some(k), granted_after_kill(l)]
                    .into_iter()
                    .flatten()
                    .min(),
                None => l.exited_us,
            },
        })
        .collect()
}

/// The Active intervals of the given lives that had not ended before `since_us`, sorted by
/// start, duplicates removed. An interval ends at the life's next transition, or when its
/// supervisor exited (a SIGKILLed supervisor reports no transition), or is open.
pub fn active_intervals(lives: &[LifeTransitions<'_>], since_us: u64) -> Vec<ActiveInterval> {
    let mut out = Vec::new();
    for l in lives {
        let ts = l.transitions;
        for (idx, t) in ts.iter().enumerate().filter(|(_, t)| t.to == Phase::Active) {
            let to_us = ts.get(idx + 1).map(|n| n.at_unix_us).or(l.exited_us);
            if to_us.is_none_or(|e| e >= since_us) {
                out.push(ActiveInterval {
                    engine_id: l.engine_id,
                    incarnation: l.incarnation,
                    from_us: t.at_unix_us,
                    to_us,
                });
            }
        }
    }
    out.sort_by_key(|iv| (iv.from_us, iv.engine_id, iv.incarnation));
    out.dedup();
    out
}

/// Pairs of different engines whose Active intervals overlap.
pub fn active_overlaps(iv: &[ActiveInterval]) -> Vec<Violation> {
    let mut out = Vec::new();
    for (i, a) in iv.iter().enumerate() {
        for b in &iv[i + 1..] {
            if a.engine_id == b.engine_id && a.incarnation == b.incarnation {
                continue;
            }
            let start = a.from_us.max(b.from_us);
            let end = match (a.to_us, b.to_us) {
                (Some(x), Some(y)) => x.min(y),
                (Some(x), None) | (None, Some(x)) => x,
                (None, None) => u64::MAX,
            };
            if end > start {
                out.push(Violation::ActiveOverlap {
                    a: a.engine_id,
                    b: b.engine_id,
                    overlap_us: if end == u64::MAX { 0 } else { end - start },
                });
            }
        }
    }
    out
}

/// Failover time split by phase, microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Phases {
    /// Kill until the old side was seen dead (its supervisor's Dead transition, or the
    /// drill seeing its processes gone when the supervisor itself was killed).
    pub detect_us: Option<u64>,
    /// Old side dead until the new Active's lease was granted (it entered Waking).
    pub grant_us: Option<u64>,
    /// Grant until the new side was Active (engine woken and ready).
    pub wake_us: Option<u64>,
    /// Kill until the new Active.
    pub total_us: Option<u64>,
}

/// Splits a failover into phases from the four instants (any may be unknown).
pub fn phases(
    t_kill: u64,
    t_old_dead: Option<u64>,
    t_grant: Option<u64>,
    t_active: Option<u64>,
) -> Phases {
    let d = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Phases {
        detect_us: d(Some(t_kill), t_old_dead),
        grant_us: d(t_old_dead, t_grant),
        wake_us: d(t_grant, t_active),
        total_us: d(Some(t_kill), t_active),
    }
}

/// The instant a side entered `phase` at or after `after_us` (first such transition).
pub fn first_after(ts: &[Transition], phase: Phase, after_us: u64) -> Option<&Transition> {
    ts.iter()
        .find(|t| t.to == phase && t.at_unix_us >= after_us)
}

/// The Waking transition that led to the Active transition at `active_at` (the last Waking
/// before it).
pub fn waking_before(ts: &[Transition], active_at: u64) -> Option<u64> {
    ts.iter()
        .filter(|t| t.to == Phase::Waking && t.at_unix_us <= active_at)
        .map(|t| t.at_unix_us)
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(to: &str, at: u64) -> Transition {
        Transition {
            to: serde_json::from_value(serde_json::Value::String(to.into())).expect("a phase"),
            at_unix_us: at,
        }
    }

    fn grant(epoch: u64, alive: Vec<u32>) -> GrantObs {
        GrantObs {
            seen_at_unix_us: 0,
            epoch: Some(epoch),
            holder: Some("engine-1".into()),
            reclaimed: false,
            previous_engine_id: Some(0),
            previous_checked: 3,
            previous_alive_pids: alive,
        }
    }

    fn good_failover() -> RoundObs {
        RoundObs {
            kind: Some(FailureKind::EngineKill),
            bound_us: 5_000_000,
            t_kill_us: 1_000_000,
            epoch_before: Some(3),
            victim_engine_id: Some(0),
            grants: vec![grant(4, vec![])],
            final_active: Some(FinalActive {
                engine_id: 1,
                incarnation: 0,
                epoch: Some(4),
                active_at_us: 1_400_000,
            }),
            active_intervals: vec![
                ActiveInterval {
                    engine_id: 0,
                    incarnation: 0,
                    from_us: 10,
                    to_us: Some(1_050_000),
                },
                ActiveInterval {
                    engine_id: 1,
                    incarnation: 0,
                    from_us: 1_400_000,
                    to_us: None,
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn clean_failover_has_no_violation() {
        assert_eq!(check_round(&good_failover()), vec![]);
    }

    #[test]
    fn claim_violation_is_split_brain() {
        let mut o = good_failover();
        o.claim_violations.push(ClaimViolation::parse(
            r#"{"violation":"gpu-claim-held","engine_id":1,"pid":77,"at_unix_us":5}"#,
        ));
        o.claim_violations.push(ClaimViolation::parse("garbage"));
        let v = check_round(&o);
        assert_eq!(v.len(), 2);
        assert!(matches!(
            v[0],
            Violation::SplitBrainClaim {
                engine_id: Some(1),
                pid: Some(77),
                ..
            }
        ));
        assert!(matches!(
            v[1],
            Violation::SplitBrainClaim {
                engine_id: None,
                ..
            }
        ));
    }

    #[test]
    fn live_process_of_previous_holder_at_grant_is_a_violation() {
        let mut o = good_failover();
        o.grants = vec![grant(4, vec![123, 124])];
        let v = check_round(&o);
        assert_eq!(
            v,
            vec![Violation::FencedProcessAliveAtGrant {
                epoch: Some(4),
                engine_id: Some(0),
                pids: vec![123, 124]
            }]
        );
    }

    #[test]
    fn epochs_must_strictly_increase() {
        let mut o = good_failover();
        o.grants = vec![grant(3, vec![])];
        o.final_active.as_mut().unwrap().epoch = Some(3);
        let v = check_round(&o);
        assert!(
            v.contains(&Violation::EpochNotIncreasing {
                previous: 3,
                got: 3
            }),
            "{v:?}"
        );
        // Two grants in one round (hung wake): second must exceed the first.
        let mut o = good_failover();
        o.grants = vec![grant(5, vec![]), grant(5, vec![])];
        o.final_active.as_mut().unwrap().epoch = Some(5);
        assert_eq!(
            check_round(&o),
            vec![Violation::EpochNotIncreasing {
                previous: 5,
                got: 5
            }]
        );
        // A reclaim may keep the epoch.
        let mut o = good_failover();
        let mut g = grant(3, vec![]);
        g.reclaimed = true;
        o.grants = vec![g, grant(4, vec![])];
        assert_eq!(check_round(&o), vec![]);
    }

    #[test]
    fn missing_or_late_active_is_reported() {
        let mut o = good_failover();
        o.final_active = None;
        assert_eq!(
            check_round(&o),
            vec![Violation::NoNewActive {
                bound_ms: 5000,
                took_ms: None
            }]
        );
        let mut o = good_failover();
        o.final_active.as_mut().unwrap().active_at_us = 7_000_000;
        assert_eq!(
            check_round(&o),
            vec![Violation::NoNewActive {
                bound_ms: 5000,
                took_ms: Some(6000)
            }]
        );
        // The victim coming back does not count as a failover.
        let mut o = good_failover();
        o.final_is_victim = true;
        assert!(check_round(&o).iter().any(|v| v.name() == "no-new-active"));
    }

    #[test]
    fn lockd_crash_must_change_nothing() {
        let mut o = RoundObs {
            kind: Some(FailureKind::LockdCrash),
            bound_us: 1,
            epoch_before: Some(4),
            final_active: Some(FinalActive {
                engine_id: 0,
                incarnation: 2,
                epoch: Some(4),
                active_at_us: 10,
            }),
            final_is_victim: true,
            lease_reclaimed: Some(true),
            grants: vec![GrantObs {
                reclaimed: true,
                ..grant(4, vec![])
            }],
            ..Default::default()
        };
        assert_eq!(check_round(&o), vec![]);
        o.transitions_after_kill.push((1, t("waking", 20)));
        o.lease_reclaimed = Some(false);
        o.grants.push(grant(5, vec![]));
        let names: Vec<_> = check_round(&o).iter().map(|v| v.name()).collect();
        assert_eq!(
            names,
            vec![
                "unexpected-failover",
                "unexpected-failover",
                "lease-not-reclaimed"
            ]
        );
        o.final_is_victim = false;
        assert!(check_round(&o).len() >= 4);
    }

    #[test]
    fn overlapping_active_intervals_are_reported() {
        let a = ActiveInterval {
            engine_id: 0,
            incarnation: 0,
            from_us: 0,
            to_us: Some(100),
        };
        let b = ActiveInterval {
            engine_id: 1,
            incarnation: 0,
            from_us: 60,
            to_us: None,
        };
        assert_eq!(
            active_overlaps(&[a.clone(), b.clone()]),
            vec![Violation::ActiveOverlap {
                a: 0,
                b: 1,
                overlap_us: 40
            }]
        );
        let c = ActiveInterval { from_us: 100, ..b };
        assert!(active_overlaps(&[a, c]).is_empty());
    }

    #[test]
    fn phases_split_the_failover() {
        let p = phases(1000, Some(1500), Some(1600), Some(2600));
        assert_eq!(p.detect_us, Some(500));
        assert_eq!(p.grant_us, Some(100));
        assert_eq!(p.wake_us, Some(1000));
        assert_eq!(p.total_us, Some(1600));
        let p = phases(1000, None, Some(1600), None);
        assert_eq!(p.detect_us, None);
        assert_eq!(p.grant_us, None);
        assert_eq!(p.total_us, None);
    }

    #[test]
    fn transition_lookups() {
        let ts = vec![
            t("standby", 5),
            t("waking", 10),
            t("dead", 12),
            t("waking", 20),
            t("active", 30),
        ];
        assert_eq!(first_after(&ts, Phase::Waking, 11).unwrap().at_unix_us, 20);
        assert!(first_after(&ts, Phase::Active, 31).is_none());
        assert_eq!(waking_before(&ts, 30), Some(20));
        assert_eq!(waking_before(&ts, 9), None);
    }

    fn compound(kind: FailureKind) -> RoundObs {
        RoundObs {
            kind: Some(kind),
            ..good_failover()
        }
    }

    #[test]
    fn lockd_crash_then_supervisor_kill() {
        // Reclaimed, then a clean failover: no violation.
        let mut o = compound(FailureKind::LockdCrashThenSupervisorKill);
        let mut rc = grant(3, vec![]);
        rc.reclaimed = true;
        o.grants.insert(0, rc);
        o.lease_reclaimed = Some(true);
        assert_eq!(check_round(&o), vec![]);
        // The split brain of issue 15: a lingering worker of the old engine alive at the
        // grant, the GPU claim found held by the new engine.
        let mut bad = o.clone();
        bad.grants[1].previous_alive_pids = vec![4242];
        bad.claim_violations.push(ClaimViolation::parse(
            r#"{"engine_id":1,"pid":9,"at_unix_us":2}"#,
        ));
        let names: Vec<_> = check_round(&bad).iter().map(|v| v.name()).collect();
        assert_eq!(
            names,
            vec!["split-brain-claim", "fenced-process-alive-at-grant"]
        );
        // No reclaim before the supervisor kill.
        let mut nr = o.clone();
        nr.lease_reclaimed = Some(false);
        assert_eq!(check_round(&nr), vec![Violation::LeaseNotReclaimed]);
        // Still a failover kind: the victim staying Active is no failover.
        let mut stay = o;
        stay.final_is_victim = true;
        assert!(check_round(&stay)
            .iter()
            .any(|v| v.name() == "no-new-active"));
    }

    #[test]
    fn revoke_during_reconnect() {
        let mut o = compound(FailureKind::RevokeDuringReconnect);
        o.victim_fenced = Some(true);
        assert_eq!(check_round(&o), vec![]);
        o.victim_fenced = Some(false);
        o.final_active = None;
        assert_eq!(
            check_round(&o).iter().map(|v| v.name()).collect::<Vec<_>>(),
            vec!["no-new-active", "revoked-not-fenced"]
        );
        // A reclaim answered before the revoke keeps the epoch; the new grant must exceed it.
        let mut o = compound(FailureKind::RevokeDuringReconnect);
        let mut rc = grant(3, vec![]);
        rc.reclaimed = true;
        o.grants = vec![rc, grant(3, vec![])];
        assert!(check_round(&o)
            .iter()
            .any(|v| v.name() == "epoch-not-increasing"));
    }

    #[test]
    fn lockd_crash_during_wake() {
        // Granted (epoch 4), lockd crashed, the waker reclaimed epoch 4 and became Active.
        let mut o = compound(FailureKind::LockdCrashDuringWake);
        let mut rc = grant(4, vec![]);
        rc.reclaimed = true;
        o.grants.push(rc);
        o.lease_reclaimed = Some(true);
        o.expected_new_engine_id = Some(1);
        assert_eq!(check_round(&o), vec![]);
        // A reclaim may not lower the epoch.
        let mut low = o.clone();
        low.grants[1].epoch = Some(2);
        assert!(check_round(&low)
            .iter()
            .any(|v| v.name() == "epoch-not-increasing"));
        // The waker lost its lease and someone else ended Active.
        let mut lost = o;
        lost.lease_reclaimed = Some(false);
        lost.final_active.as_mut().unwrap().engine_id = 0;
        lost.final_active.as_mut().unwrap().incarnation = 1;
        assert_eq!(
            check_round(&lost),
            vec![
                Violation::LeaseNotReclaimed,
                Violation::WrongNewActive {
                    expected: 1,
                    got: Some(0)
                }
            ]
        );
    }

    #[test]
    fn double_kill() {
        let o = compound(FailureKind::DoubleKill);
        assert_eq!(check_round(&o), vec![]);
        // Both supervisors Active at once (the killed one never reported leaving Active: its
        // interval ends when it exited).
        let mut ov = o;
        ov.active_intervals[0].to_us = Some(1_500_000);
        assert_eq!(
            check_round(&ov),
            vec![Violation::ActiveOverlap {
                a: 0,
                b: 1,
                overlap_us: 100_000
            }]
        );
    }

    #[test]
    fn fence_check_reports_the_first_new_grant() {
        let mut rc = grant(3, vec![]);
        rc.reclaimed = true;
        rc.previous_checked = 0;
        assert_eq!(fence_check(&[rc.clone()]), None);
        assert_eq!(fence_check(&[rc, grant(4, vec![7])]), Some((3, 1)));
        assert_eq!(fence_check(&[]), None);
    }

    #[test]
    fn active_intervals_end_at_the_next_transition_or_exit() {
        let a = [t("standby", 1), t("active", 10), t("dead", 50)];
        let b = [t("standby", 2), t("waking", 55), t("active", 60)];
        let c = [t("active", 5)];
        let lives = [
            LifeTransitions {
                engine_id: 0,
                incarnation: 0,
                transitions: &a,
                exited_us: Some(70),
            },
            LifeTransitions {
                engine_id: 1,
                incarnation: 0,
                transitions: &b,
                exited_us: None,
            },
            LifeTransitions {
                engine_id: 0,
                incarnation: 1,
                transitions: &c,
                exited_us: Some(8),
            },
        ];
        let iv = active_intervals(&lives, 20);
        assert_eq!(
            iv,
            vec![
                ActiveInterval {
                    engine_id: 0,
                    incarnation: 0,
                    from_us: 10,
                    to_us: Some(50)
                },
                ActiveInterval {
                    engine_id: 1,
                    incarnation: 0,
                    from_us: 60,
                    to_us: None
                },
            ]
        );
        assert!(active_overlaps(&iv).is_empty());
        // A killed supervisor (no Dead transition) is Active until it exited.
        let d = [t("active", 10)];
        let lives = [LifeTransitions {
            engine_id: 0,
            incarnation: 0,
            transitions: &d,
            exited_us: Some(65),
        }];
        assert_eq!(active_intervals(&lives, 20)[0].to_us, Some(65));
    }

    #[test]
    fn a_sigkilled_life_ends_at_the_next_grant_and_overlaps_nobody() {
        // Engine 0 was Active, its supervisor SIGKILLed at 100 (its Dead never read); engine 1
        // was granted (Waking) at 150, Active at 160; the drill saw 0's exit at 400.
        let a = [t("standby", 1), t("active", 10)];
        let b = [t("standby", 2), t("waking", 150), t("active", 160)];
        let seen = [
            LifeObs {
                engine_id: 0,
                incarnation: 0,
                transitions: &a,
                exited_us: Some(400),
                sigkilled_us: Some(100),
            },
            LifeObs {
                engine_id: 1,
                incarnation: 0,
                transitions: &b,
                exited_us: None,
                sigkilled_us: None,
            },
        ];
        let lives = life_ends(&seen, 90);
        assert_eq!(lives[0].exited_us, Some(100));
        assert_eq!(lives[1].exited_us, None);
        let iv = active_intervals(&lives, 90);
        assert_eq!(iv.len(), 2);
        assert!(active_overlaps(&iv).is_empty());
        // Without the SIGKILL bound, the exit seen late would make them overlap.
        let late = [
            LifeObs {
                sigkilled_us: None,
                ..seen[0].clone()
            },
            seen[1].clone(),
        ];
        let iv = active_intervals(&life_ends(&late, 90), 90);
        assert_eq!(active_overlaps(&iv).len(), 1);
        // A SIGKILLed life is bounded by another life's grant even before its own SIGKILL.
        let early = [
            LifeObs {
                sigkilled_us: Some(500),
                exited_us: None,
                ..seen[0].clone()
            },
            seen[1].clone(),
        ];
        assert_eq!(life_ends(&early, 90)[0].exited_us, Some(150));
        let moves = transitions_after(&seen, 90);
        assert_eq!(
            moves.iter().map(|(e, t)| (*e, t.to)).collect::<Vec<_>>(),
            [(1, Phase::Waking), (1, Phase::Active)]
        );
    }
}
