//! What one trial of the drill across nodes saw, and the invariants it must keep. Pure: the
//! runner observes, this module judges.

use serde::{Deserialize, Serialize};

use super::chaos::Chaos;

/// What the runner recorded in one trial, on the wall clock (µs since the Unix epoch, the
/// supervisors' `/state` clock; every process runs on this machine).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// When the failure was injected.
    pub injected_us: u64,
    /// When every process of the holder's engine was first seen dead (polled every ms).
    pub engine_dead_us: Option<u64>,
    /// When etcd's watch reported the holder's lock key deleted: from then on anyone may be
    /// granted (the earliest possible grant on any node).
    pub key_deleted_us: Option<u64>,
    /// When another node's supervisor left Standby (its `/state` transition to Waking): its
    /// grant, as that node saw it.
    pub granted_us: Option<u64>,
    /// That node.
    pub new_holder: Option<usize>,
    /// The holder's supervisor was seen out of Active during the window (no-failover kinds).
    pub holder_left_active: bool,
    /// Lines the fake engines appended to the GPU claim's violations file since the previous
    /// trial's end (the ground truth: an engine found the claim held by another).
    pub claim_violations: Vec<String>,
    /// When the holder's supervisor left Active after the injection, and the event that made
    /// it (from its log: e.g. `Revoked("lost: … not renewed for 2270 ms …")`). Diagnostics:
    /// printed with a violation, not judged.
    #[serde(default)]
    pub holder_left: Option<(u64, String)>,
    /// When the holder node's lockd began revoking the holder's etcd lease because its session
    /// ended (connection and every anchor closed, which only the death of the holder's whole
    /// process tree does), if that revoke succeeded (from lockd's log).
    #[serde(default)]
    pub holder_released_us: Option<u64>,
}

/// One trial's result, as reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    /// Trial number (0-based).
    pub round: usize,
    /// What was injected.
    pub kind: Chaos,
    /// The node whose side was Active.
    pub holder: usize,
    /// What was seen.
    pub observed: Observed,
    /// Old engine dead → lock key deleted or new grant, whichever first (ms, signed; must
    /// never be negative). None when there was no failover.
    pub margin_ms: Option<f64>,
    /// Injection → the other node's grant (ms): the failover time.
    pub failover_ms: Option<f64>,
    /// Invariant violations (empty: the trial passed).
    pub violations: Vec<String>,
    /// What was seen that is no violation but is worth telling (e.g. a cascade: the previous
    /// trial's etcd leader change, fenced, also fenced the holder it had failed over to).
    #[serde(default)]
    pub notes: Vec<String>,
}

fn ms(later: u64, earlier: u64) -> f64 {
    (later as f64 - earlier as f64) / 1e3
}

/// What the judge holds a trial to (from the drill's settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// The kill budget lockd's fence promises the holder (`--etcd-kill-time`), ms: where a
    /// fence or the watchdog is what stops the holder (lockd killed or frozen, a partition),
    /// the engine must have been dead at least that long before anyone could be granted,
    /// since a real engine may need all of it to die (the fake one dies in milliseconds, so
    /// the margin left over is the budget that was really granted).
    pub kill_ms: f64,
    /// lockd fences its holders at an etcd leader change (`--etcd-leader-change fence`, or
    /// `auto` on an etcd with the stale-leader revoke). The etcd kinds (`leader-kill`,
    /// `member-pause`) may then cost the lease, but only as a fence does: the holder's engine
    /// dead with its kill budget to spare before anyone could be granted, and another node
    /// taking over. Without it they must not move the lease at all.
    pub leader_change_fences: bool,
    /// `T·(1 − ε)` in ms (lockd's TTL less the clock-rate bound): a leader paused at the
    /// injection renewed nothing after it, so on an etcd with the stale-leader revoke it may,
    /// resumed, revoke the lease as early as this after the injection — whenever the drill
    /// happens to resume it. Under the fence a `member-pause` holder's engine must be dead
    /// with its kill budget to spare before then.
    pub paused_view_ms: f64,
}

impl Limits {
    /// From the drill's TTL, drift bound and kill budget.
    pub fn new(ttl_ms: f64, drift_ppm: u32, kill_ms: f64, leader_change_fences: bool) -> Limits {
        Limits {
            kill_ms,
            leader_change_fences,
            paused_view_ms: ttl_ms * (1.0 - f64::from(drift_ppm) / 1e6),
        }
    }
}

/// When the holder's kill budget started: when its supervisor left Active after the
/// injection (the fence's `revoked`, or its own watchdog), or, if that is unknown or later,
/// when its engine was seen dead. The budget is what the fence promises from the moment the
/// holder is told (lockd's margin covers its own lateness before that, `--etcd-pause`);
/// counting from the death would charge the kill itself (and the reaping, slow on a loaded
/// machine) against it.
fn told(o: &Observed, dead_us: u64) -> u64 {
    o.holder_left
        .as_ref()
        .map(|h| h.0)
        .filter(|t| *t >= o.injected_us)
        .map_or(dead_us, |t| t.min(dead_us))
}

/// Slack (µs) between the engine's death as the poller saw it and lockd's view of it: lockd
/// sees the anchors close at the processes' exit, the poller (1 ms, a zombie counts as alive)
/// a little after.
const DEATH_SLACK_US: u64 = 50_000;

/// Whether the holder's key went because the holder itself was gone: lockd revoked its lease
/// at the end of its session, begun no earlier than the engine's death (within the slack) and
/// no later than the first possible grant `g`. No kill budget is owed then: a slower engine
/// would have held its session, and so its key, until its own death.
fn released_after_death(o: &Observed, dead_us: u64, g: u64) -> bool {
    o.holder_released_us
        .is_some_and(|r| r + DEATH_SLACK_US >= dead_us && r <= g)
}

/// Judges one trial against `limits` ([`Limits`]).
pub fn judge(round: usize, kind: Chaos, holder: usize, o: Observed, limits: &Limits) -> Trial {
    let Limits {
        kill_ms,
        leader_change_fences,
        paused_view_ms,
    } = *limits;
    let mut v: Vec<String> = o
        .claim_violations
        .iter()
        .map(|l| format!("GPU claim violated (two engines at once): {l}"))
        .collect();
    let first_grant = match (o.key_deleted_us, o.granted_us) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let margin_ms = match (first_grant, o.engine_dead_us) {
        (Some(g), Some(d)) => Some(ms(g, d)),
        _ => None,
    };
    let failover_ms = o.granted_us.map(|g| ms(g, o.injected_us));
    let lost = first_grant.is_some() || o.holder_left_active || o.engine_dead_us.is_some();
    let fenced_by_leader_change = kind.changes_leader() && leader_change_fences && lost;
    if kind.fails_over() || fenced_by_leader_change {
        match (o.engine_dead_us, first_grant) {
            (None, Some(_)) => v.push(
                "another node could be granted while the holder's engine was alive (never seen dead)"
                    .into(),
            ),
            (None, None) => v.push("the holder's engine was never seen dead".into()),
            (Some(_), None) => v.push("no other node was granted within the bound".into()),
            (Some(_), Some(_)) if o.granted_us.is_none() => v.push(
                "the holder's key went but no other node took over within the bound".into(),
            ),
            (Some(d), Some(g)) if g < d => v.push(format!(
                "another node could be granted {:.1} ms BEFORE the holder's engine was dead",
                ms(d, g)
            )),
            (Some(d), Some(g))
                if (kind.fenced() || fenced_by_leader_change)
                    && ms(g, told(&o, d)) < kill_ms
                    && !released_after_death(&o, d, g) =>
            {
                v.push(format!(
                "the holder was told to fence only {:.1} ms before anyone could be granted (its engine dead {:.1} ms before), less than its kill budget {kill_ms:.0} ms",
                ms(g, told(&o, d)),
                ms(g, d)
            ))
            }
            _ => {}
        }
        // The paused leader's own view of the lease: it saw no renewal after the injection,
        // so the fence must not have credited one (e.g. a renewal a new leader processed that
        // came back labelled with the old term).
        if let (Chaos::MemberPause, true, Some(d)) =
            (kind, fenced_by_leader_change, o.engine_dead_us)
        {
            let spare = paused_view_ms - ms(told(&o, d), o.injected_us);
            if spare < kill_ms {
                v.push(format!(
                    "the holder was told to fence only {spare:.1} ms before the paused leader could revoke the lease ({paused_view_ms:.0} ms after the pause, whenever it resumes), less than its kill budget {kill_ms:.0} ms"
                ));
            }
        }
    } else {
        if let Some(g) = o.granted_us {
            v.push(format!(
                "the lease moved to node {:?} {:.0} ms after the injection",
                o.new_holder,
                ms(g, o.injected_us)
            ));
        }
        if let Some(k) = o.key_deleted_us {
            v.push(format!(
                "the holder's lock key was deleted {:.0} ms after the injection (lease lost)",
                ms(k, o.injected_us)
            ));
        }
        if o.holder_left_active {
            v.push("the holder left Active".into());
        }
        match (o.engine_dead_us, first_grant) {
            (Some(d), Some(g)) if g < d => v.push(format!(
                "another node could be granted {:.1} ms BEFORE the holder's engine was dead",
                ms(d, g)
            )),
            (Some(_), _) => v.push("the holder's engine died".into()),
            (None, Some(_)) => {
                v.push("another node was granted while the holder's engine was alive".into())
            }
            (None, None) => {}
        }
    }
    Trial {
        round,
        kind,
        holder,
        observed: o,
        margin_ms,
        failover_ms,
        violations: v,
        notes: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TTL 3 s, drift 1 %, kill budget 500 ms: a paused leader may revoke 2,970 ms in.
    fn limits(fences: bool) -> Limits {
        Limits::new(3000.0, 10_000, 500.0, fences)
    }

    fn failover(dead: u64, deleted: u64, granted: u64) -> Observed {
        Observed {
            injected_us: 1_000_000,
            engine_dead_us: Some(dead),
            key_deleted_us: Some(deleted),
            granted_us: Some(granted),
            new_holder: Some(1),
            ..Observed::default()
        }
    }

    #[test]
    fn a_grant_after_the_engines_death_passes_with_its_margin() {
        let t = judge(
            0,
            Chaos::Partition,
            0,
            failover(2_000_000, 3_200_000, 3_250_000),
            &limits(false),
        );
        assert!(t.violations.is_empty(), "{:?}", t.violations);
        assert_eq!(t.margin_ms, Some(1200.0));
        assert_eq!(t.failover_ms, Some(2250.0));
    }

    #[test]
    fn a_key_deleted_before_the_engines_death_is_a_violation_even_if_the_grant_is_later() {
        let t = judge(
            0,
            Chaos::Partition,
            0,
            failover(3_300_000, 3_200_000, 3_400_000),
            &limits(false),
        );
        assert_eq!(t.margin_ms, Some(-100.0));
        assert_eq!(t.violations.len(), 1, "{:?}", t.violations);
        assert!(t.violations[0].contains("BEFORE"));
    }

    #[test]
    fn a_fenced_holder_dead_with_less_than_its_kill_budget_to_spare_is_a_violation() {
        let o = failover(3_000_000, 3_150_000, 3_200_000);
        let t = judge(0, Chaos::Partition, 0, o.clone(), &limits(false));
        assert_eq!(t.violations.len(), 1, "{:?}", t.violations);
        assert!(t.violations[0].contains("kill budget"));
        // An engine that died by itself releases its lease after its death: no budget owed.
        assert!(judge(0, Chaos::EngineKill, 0, o, &limits(false))
            .violations
            .is_empty());
    }

    #[test]
    fn the_kill_budget_counts_from_when_the_holder_was_told() {
        // Told at 2.3 s, engine seen dead only at 2.99 s (a slow reap), key gone at 3.0 s:
        // 700 ms from the telling, the budget was there.
        let mut o = failover(2_990_000, 3_000_000, 3_050_000);
        o.holder_left = Some((2_300_000, "Revoked(\"lost: …\")".into()));
        let t = judge(0, Chaos::Partition, 0, o.clone(), &limits(false));
        assert!(t.violations.is_empty(), "{:?}", t.violations);
        // Without the telling's time the death counts: 10 ms, caught.
        o.holder_left = None;
        let t = judge(0, Chaos::Partition, 0, o.clone(), &limits(false));
        assert!(
            t.violations[0].contains("kill budget"),
            "{:?}",
            t.violations
        );
        // Told late (2.9 s, 100 ms before the key went): caught, whatever the death.
        o.holder_left = Some((2_900_000, "Revoked(\"lost: …\")".into()));
        o.engine_dead_us = Some(2_900_500);
        let t = judge(0, Chaos::Partition, 0, o, &limits(false));
        assert!(t.violations[0].contains("told"), "{:?}", t.violations);
    }

    #[test]
    fn missing_death_or_grant_and_claim_lines_are_violations() {
        let mut o = failover(0, 0, 0);
        o.engine_dead_us = None;
        o.claim_violations = vec!["{}".into()];
        let t = judge(0, Chaos::EngineKill, 0, o, &limits(false));
        assert_eq!(t.violations.len(), 2, "{:?}", t.violations);
        let mut o = failover(2, 0, 0);
        o.key_deleted_us = None;
        o.granted_us = None;
        let t = judge(0, Chaos::LockdKill, 0, o, &limits(false));
        assert!(t.violations[0].contains("no other node"));
    }

    /// CI's trial (session 13): the fence and the supervisor's own watchdog fired together,
    /// the engine died at once, and lockd revoked the lease as the session ended, 5 ms later:
    /// no kill budget is owed to a holder that is gone. Anything else short of it still is.
    #[test]
    fn a_release_after_the_holders_death_owes_no_kill_budget() {
        let mut o = failover(2_966_000, 2_971_000, 4_865_000);
        o.holder_left = Some((2_966_000, "LockLost(\"no sign of life…\")".into()));
        let short = |o: &Observed| {
            judge(0, Chaos::MemberPause, 0, o.clone(), &limits(true))
                .violations
                .iter()
                .any(|v| v.contains("kill budget"))
        };
        assert!(short(&o), "without lockd's release it is short");
        o.holder_released_us = Some(2_966_900);
        assert!(!short(&o), "released after the death, before the deletion");
        assert!(judge(0, Chaos::MemberPause, 0, o.clone(), &limits(true))
            .violations
            .is_empty());
        // Released well before the engine was seen dead, or only after the key went: the key
        // did not go because the holder was gone.
        o.holder_released_us = Some(2_900_000);
        assert!(short(&o));
        o.holder_released_us = Some(2_972_000);
        assert!(short(&o));
    }

    #[test]
    fn an_etcd_failure_must_not_move_or_lose_the_lease() {
        let quiet = Observed {
            injected_us: 5,
            ..Observed::default()
        };
        assert!(
            judge(0, Chaos::MemberPause, 0, quiet.clone(), &limits(false))
                .violations
                .is_empty()
        );
        let mut moved = quiet;
        moved.granted_us = Some(10);
        moved.key_deleted_us = Some(9);
        moved.holder_left_active = true;
        let t = judge(0, Chaos::LeaderKill, 0, moved.clone(), &limits(false));
        assert_eq!(t.violations.len(), 4, "{:?}", t.violations);
        assert_eq!(t.margin_ms, None);
        // A paused follower elects nobody: the leader-change fence excuses nothing.
        let t = judge(0, Chaos::FollowerPause, 0, moved, &limits(true));
        assert_eq!(t.violations.len(), 4, "{:?}", t.violations);
    }

    #[test]
    fn with_fence_on_leader_change_an_etcd_kind_may_fail_over_but_only_safely() {
        // Fenced at the old term's deadline: engine dead 2.3 s in, key deleted 0.7 s later.
        let safe = failover(3_300_000, 4_000_000, 4_050_000);
        assert!(judge(0, Chaos::LeaderKill, 0, safe.clone(), &limits(true))
            .violations
            .is_empty());
        // The same without the fence is a lost lease.
        assert!(!judge(0, Chaos::LeaderKill, 0, safe, &limits(false))
            .violations
            .is_empty());
        // Fenced, but the key went before the engine's kill budget was spent: caught.
        let short = failover(3_300_000, 3_500_000, 3_550_000);
        let t = judge(0, Chaos::MemberPause, 0, short, &limits(true));
        assert_eq!(t.violations.len(), 1, "{:?}", t.violations);
        assert!(
            t.violations[0].contains("kill budget"),
            "{:?}",
            t.violations
        );
        // Key deleted before the engine died (the stale leader's revoke): caught.
        let unsafe_ = failover(3_300_000, 3_200_000, 3_250_000);
        let t = judge(0, Chaos::MemberPause, 0, unsafe_, &limits(true));
        assert!(
            t.violations.iter().any(|v| v.contains("BEFORE")),
            "{:?}",
            t.violations
        );
        // Fenced from a renewal the paused leader never saw: dead 2.6 s in, so only 370 ms
        // before the paused leader could revoke. Its own revoke came late this time (the key
        // went at lockd's release, 700 ms after the death); caught all the same.
        let late = failover(3_600_000, 4_300_000, 4_350_000);
        let t = judge(0, Chaos::MemberPause, 0, late.clone(), &limits(true));
        assert_eq!(t.violations.len(), 1, "{:?}", t.violations);
        assert!(
            t.violations[0].contains("paused leader"),
            "{:?}",
            t.violations
        );
        // A killed leader revokes nothing: no such bound.
        assert!(judge(0, Chaos::LeaderKill, 0, late, &limits(true))
            .violations
            .is_empty());
        // Nothing happened: fine in both modes.
        let quiet = Observed {
            injected_us: 1_000_000,
            ..Observed::default()
        };
        assert!(judge(0, Chaos::MemberPause, 0, quiet, &limits(true))
            .violations
            .is_empty());
    }
}
