//! Which failure each round injects, and how each engine must be configured so that the
//! round can inject it. Pure: no I/O, no clock; the seed is an input.

use std::fmt;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// One way of killing the Active side. The order of `ALL` is the round-robin order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureKind {
    /// SIGKILL of the Active engine's main process; its workers die with it.
    EngineKill,
    /// SIGKILL of the Active supervisor; the container runtime then kills what is left.
    SupervisorKill,
    /// The Active engine runs detached workers (setsid, ignore SIGTERM); its main
    /// process is SIGKILLed and the workers stay behind holding the GPU.
    DetachedWorker,
    /// The standby that will be granted next hangs in wake-up (`--wake 1h`); it must be
    /// fenced after its waking timeout and the other side must take over.
    HungWake,
    /// lockd is SIGKILLed while a side is Active and restarted on the same state file:
    /// the Active side must reclaim its lease; no failover may happen.
    LockdCrash,
    /// `lockd revoke` of the Active side's lease: it must fence itself.
    Revoke,
    /// Compound: lockd is SIGKILLed and restarted, the Active side reclaims its lease, then
    /// (0-50 ms later) the Active supervisor is SIGKILLed. Its engine's workers linger after
    /// the engine (`--worker-linger`): the lease must not move while any of them lives.
    LockdCrashThenSupervisorKill,
    /// Compound: lockd is SIGKILLed and restarted, and the lease is revoked while it is still
    /// waiting to be reclaimed. The old Active must learn it is revoked and fence itself.
    RevokeDuringReconnect,
    /// Compound: the Active engine is SIGKILLed; as soon as the standby is granted (Waking,
    /// its engine slow to wake), lockd is SIGKILLed and restarted. The waker must reclaim
    /// and become Active.
    LockdCrashDuringWake,
    /// Compound: the Active engine's main process is SIGKILLed and, 0-5 ms later, its
    /// supervisor (while it fences).
    DoubleKill,
    /// SIGKILL of the first child of the Active engine's main process (vLLM: its
    /// `VLLM::EngineCore`; fake-engine: its first worker). The main process lives on and
    /// reports the engine dead on `/health`, then exits by itself seconds later.
    EngineChildKill,
    /// SIGKILL of a leaf of the Active engine's tree (vLLM: a `VLLM::Worker`; fake-engine:
    /// its last worker).
    WorkerKill,
    /// SIGTERM of the Active supervisor (a rollout, a node drain, kubelet stopping the
    /// container): it stops its engine (main process first) and exits 0.
    Stop,
}

impl FailureKind {
    /// The six single-failure kinds, in round-robin order (what `--kinds all` means).
    pub const ALL: [FailureKind; 6] = [
        FailureKind::EngineKill,
        FailureKind::SupervisorKill,
        FailureKind::DetachedWorker,
        FailureKind::HungWake,
        FailureKind::LockdCrash,
        FailureKind::Revoke,
    ];

    /// The compound kinds (`--kinds compound`), in round-robin order.
    pub const COMPOUND: [FailureKind; 4] = [
        FailureKind::LockdCrashThenSupervisorKill,
        FailureKind::RevokeDuringReconnect,
        FailureKind::LockdCrashDuringWake,
        FailureKind::DoubleKill,
    ];

    /// How a real engine's life ends (`--kinds engine-ends`): a SIGKILL of its main process,
    /// of its first child, of a leaf of its tree, and a stop of its supervisor.
    pub const ENGINE_ENDS: [FailureKind; 4] = [
        FailureKind::EngineKill,
        FailureKind::EngineChildKill,
        FailureKind::WorkerKill,
        FailureKind::Stop,
    ];

    /// Every kind the drill knows: [`Self::ALL`], [`Self::COMPOUND`], then the engine-tree
    /// kills not in `ALL` (summary order).
    pub const EVERY: [FailureKind; 13] = [
        FailureKind::EngineKill,
        FailureKind::SupervisorKill,
        FailureKind::DetachedWorker,
        FailureKind::HungWake,
        FailureKind::LockdCrash,
        FailureKind::Revoke,
        FailureKind::LockdCrashThenSupervisorKill,
        FailureKind::RevokeDuringReconnect,
        FailureKind::LockdCrashDuringWake,
        FailureKind::DoubleKill,
        FailureKind::EngineChildKill,
        FailureKind::WorkerKill,
        FailureKind::Stop,
    ];

    /// The name used on the command line, in logs and in the report.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::EngineKill => "engine-kill",
            FailureKind::SupervisorKill => "supervisor-kill",
            FailureKind::DetachedWorker => "detached-worker",
            FailureKind::HungWake => "hung-wake",
            FailureKind::LockdCrash => "lockd-crash",
            FailureKind::Revoke => "revoke",
            FailureKind::LockdCrashThenSupervisorKill => "lockd-crash-then-supervisor-kill",
            FailureKind::RevokeDuringReconnect => "revoke-during-reconnect",
            FailureKind::LockdCrashDuringWake => "lockd-crash-during-wake",
            FailureKind::DoubleKill => "double-kill",
            FailureKind::EngineChildKill => "engine-child-kill",
            FailureKind::WorkerKill => "worker-kill",
            FailureKind::Stop => "stop",
        }
    }

    /// Whether the kind injects two failures (the `compound` set).
    pub fn is_compound(self) -> bool {
        Self::COMPOUND.contains(&self)
    }

    /// Whether the kind SIGKILLs and restarts lockd.
    pub fn crashes_lockd(self) -> bool {
        matches!(
            self,
            FailureKind::LockdCrash
                | FailureKind::LockdCrashThenSupervisorKill
                | FailureKind::RevokeDuringReconnect
                | FailureKind::LockdCrashDuringWake
        )
    }

    /// Whether the round must end with another engine Active (every kind but a lockd crash).
    pub fn expects_failover(self) -> bool {
        self != FailureKind::LockdCrash
    }

    /// Whether the kind needs fake-engine flags (so it cannot drill a real engine command).
    pub fn needs_fake_engine(self) -> bool {
        matches!(
            self,
            FailureKind::DetachedWorker | FailureKind::HungWake | FailureKind::LockdCrashDuringWake
        )
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown failure kind on the command line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown failure kind {0:?} (expected one of engine-kill, supervisor-kill, detached-worker, hung-wake, lockd-crash, revoke, lockd-crash-then-supervisor-kill, revoke-during-reconnect, lockd-crash-during-wake, double-kill, engine-child-kill, worker-kill, stop, all, compound, engine-ends)")]
pub struct UnknownKind(pub String);

impl FromStr for FailureKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FailureKind::EVERY
            .into_iter()
            .find(|k| k.name() == s.trim())
            .ok_or_else(|| UnknownKind(s.to_string()))
    }
}

/// Parses `--kinds`: comma-separated names, `all` (the six single-failure kinds) or
/// `compound` (the four compound kinds); keeps the first occurrence of each kind in the order
/// given (that is the round-robin order).
pub fn parse_kinds(list: &[String]) -> Result<Vec<FailureKind>, UnknownKind> {
    let mut out: Vec<FailureKind> = Vec::new();
    for item in list.iter().flat_map(|s| s.split(',')) {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let set: &[FailureKind] = match item {
            "all" => &FailureKind::ALL,
            "compound" => &FailureKind::COMPOUND,
            "engine-ends" => &FailureKind::ENGINE_ENDS,
            _ => &[],
        };
        if !set.is_empty() {
            for k in set {
                if !out.contains(k) {
                    out.push(*k);
                }
            }
            continue;
        }
        let k: FailureKind = item.parse()?;
        if !out.contains(&k) {
            out.push(k);
        }
    }
    if out.is_empty() {
        out.extend(FailureKind::ALL);
    }
    Ok(out)
}

/// How the rounds pick their kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// The kinds in turn, in the order of `--kinds`.
    RoundRobin,
    /// Uniformly at random from `--kinds`, from a seeded generator (the seed is printed).
    Random,
}

/// The kind of every round, decided up front so that engines can be configured ahead.
pub fn schedule(
    kinds: &[FailureKind],
    order: Order,
    iterations: usize,
    seed: u64,
) -> Vec<FailureKind> {
    if kinds.is_empty() {
        return Vec::new();
    }
    match order {
        Order::RoundRobin => (0..iterations).map(|i| kinds[i % kinds.len()]).collect(),
        Order::Random => {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..iterations)
                .map(|_| kinds[rng.gen_range(0..kinds.len())])
                .collect()
        }
    }
}

/// The fake-engine flags one engine incarnation is started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EngineConfig {
    /// `--detach-workers`: needed by the incarnation that will be Active in a
    /// detached-worker round (its workers are what the supervisor must fence).
    pub detach_workers: bool,
    /// `--wake 1h` plus a short supervisor `--waking-timeout`: the standby of a hung-wake
    /// round, which must be granted, hang, and be fenced.
    pub hung_wake: bool,
    /// `--worker-linger`: the Active of a compound round (its workers outlive the engine's
    /// main process for a while, as tensor-parallel workers tearing down CUDA do).
    #[serde(default)]
    pub linger_workers: bool,
    /// `--wake 300ms`: the standby of a lockd-crash-during-wake round (a window in Waking
    /// for the lockd crash).
    #[serde(default)]
    pub slow_wake: bool,
}

/// The configuration for an incarnation that will be Active from round `from` on: it is the
/// victim of the first round at or after `from` that is not a lockd crash (lockd crashes
/// leave the Active side in place).
pub fn active_config(sched: &[FailureKind], from: usize) -> EngineConfig {
    let victim_kind = sched
        .iter()
        .skip(from)
        .find(|k| **k != FailureKind::LockdCrash);
    EngineConfig {
        detach_workers: victim_kind == Some(&FailureKind::DetachedWorker),
        hung_wake: false,
        linger_workers: victim_kind.is_some_and(|k| k.is_compound()),
        slow_wake: false,
    }
}

/// The configuration the standby must have when round `round` starts. It hangs if the
/// round is a hung wake; it stays standby through lockd crashes; otherwise it becomes the
/// Active of round `round + 1`.
pub fn standby_config(sched: &[FailureKind], round: usize) -> EngineConfig {
    let mut r = round;
    while r < sched.len() && sched[r] == FailureKind::LockdCrash {
        r += 1;
    }
    match sched.get(r) {
        None => EngineConfig::default(),
        Some(FailureKind::HungWake) => EngineConfig {
            hung_wake: true,
            ..EngineConfig::default()
        },
        // The slow waker becomes the Active of the next round: it needs that round's flags too.
        Some(FailureKind::LockdCrashDuringWake) => EngineConfig {
            slow_wake: true,
            ..active_config(sched, r + 1)
        },
        Some(_) => active_config(sched, r + 1),
    }
}

/// The seeded delay (microseconds) between the two failures of a compound round: for
/// `lockd-crash-then-supervisor-kill` 0-50 ms after the reclaim, for `double-kill` 0-5 ms
/// after the engine kill, 0 for the others. Reproducible from (seed, round).
pub fn compound_delay_us(kind: FailureKind, seed: u64, round: usize) -> u64 {
    let max_us = match kind {
        FailureKind::LockdCrashThenSupervisorKill => 50_000,
        FailureKind::DoubleKill => 5_000,
        _ => return 0,
    };
    let mut rng = StdRng::seed_from_u64(seed ^ (round as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    rng.gen_range(0..=max_us)
}

#[cfg(test)]
mod tests {
    use super::*;
    use FailureKind::*;

    #[test]
    fn kinds_parse_all_and_lists_in_given_order() {
        assert_eq!(
            parse_kinds(&["all".into()]).unwrap(),
            FailureKind::ALL.to_vec()
        );
        assert_eq!(
            parse_kinds(&["revoke,engine-kill".into(), "revoke".into()]).unwrap(),
            vec![Revoke, EngineKill]
        );
        assert_eq!(parse_kinds(&[]).unwrap(), FailureKind::ALL.to_vec());
        assert_eq!(
            parse_kinds(&["engine-kill,nope".into()]),
            Err(UnknownKind("nope".into()))
        );
        for k in FailureKind::ALL {
            assert_eq!(k.name().parse::<FailureKind>().unwrap(), k);
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.name())
            );
        }
    }

    #[test]
    fn round_robin_cycles_through_the_kinds() {
        let s = schedule(&[EngineKill, Revoke, HungWake], Order::RoundRobin, 7, 99);
        assert_eq!(
            s,
            vec![EngineKill, Revoke, HungWake, EngineKill, Revoke, HungWake, EngineKill]
        );
    }

    #[test]
    fn random_order_is_reproducible_from_the_seed() {
        let a = schedule(&FailureKind::ALL, Order::Random, 200, 42);
        let b = schedule(&FailureKind::ALL, Order::Random, 200, 42);
        let c = schedule(&FailureKind::ALL, Order::Random, 200, 43);
        assert_eq!(a, b);
        assert_ne!(a, c);
        for k in FailureKind::ALL {
            assert!(a.contains(&k), "200 random rounds should hit {k}");
        }
        assert!(schedule(&[], Order::Random, 5, 1).is_empty());
    }

    #[test]
    fn active_config_looks_past_lockd_crashes() {
        let s = [LockdCrash, LockdCrash, DetachedWorker, EngineKill];
        assert!(active_config(&s, 0).detach_workers);
        assert!(!active_config(&s, 3).detach_workers);
        assert!(!active_config(&s, 4).detach_workers);
        assert!(!active_config(&s, 0).hung_wake);
    }

    #[test]
    fn standby_config_hangs_only_for_hung_wake_rounds() {
        let s = [EngineKill, HungWake, LockdCrash, DetachedWorker, Revoke];
        // Standby of round 0 becomes Active of round 1 (hung wake: victim is an engine kill).
        assert_eq!(standby_config(&s, 0), EngineConfig::default());
        // Standby of round 1 is the hung waker.
        assert!(standby_config(&s, 1).hung_wake);
        // Standby of round 2 (a lockd crash) stays standby into round 3, becomes Active for
        // round 4 (revoke): plain config.
        assert_eq!(standby_config(&s, 2), EngineConfig::default());
        // Standby of a round before a detached-worker round must detach its workers.
        let s2 = [Revoke, DetachedWorker];
        assert!(standby_config(&s2, 0).detach_workers);
        assert_eq!(standby_config(&s2, 5), EngineConfig::default());
    }

    #[test]
    fn compound_kinds_parse_by_name_and_alias_and_all_stays_six() {
        assert_eq!(
            parse_kinds(&["compound".into()]).unwrap(),
            FailureKind::COMPOUND.to_vec()
        );
        assert_eq!(parse_kinds(&["all".into()]).unwrap().len(), 6);
        assert_eq!(
            parse_kinds(&["engine-ends".into()]).unwrap(),
            FailureKind::ENGINE_ENDS.to_vec()
        );
        assert_eq!(
            "worker-kill".parse::<FailureKind>(),
            Ok(FailureKind::WorkerKill)
        );
        assert_eq!(
            parse_kinds(&["double-kill,all,compound".into()])
                .unwrap()
                .len(),
            10
        );
        for k in FailureKind::EVERY {
            assert_eq!(k.name().parse::<FailureKind>().unwrap(), k);
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.name())
            );
            assert_eq!(
                k.is_compound(),
                !FailureKind::ALL.contains(&k) && !FailureKind::ENGINE_ENDS.contains(&k)
            );
            assert!(k.expects_failover() || k == LockdCrash);
        }
        assert!(LockdCrashDuringWake.needs_fake_engine());
        assert!(!LockdCrashThenSupervisorKill.needs_fake_engine());
        assert!(RevokeDuringReconnect.crashes_lockd() && !DoubleKill.crashes_lockd());
    }

    #[test]
    fn compound_victims_linger_and_the_waker_wakes_slowly() {
        let s = [
            EngineKill,
            LockdCrashThenSupervisorKill,
            LockdCrashDuringWake,
            DoubleKill,
        ];
        // Active for round 0 (engine-kill): plain. Standby of round 0 is the Active of round 1.
        assert_eq!(active_config(&s, 0), EngineConfig::default());
        assert!(standby_config(&s, 0).linger_workers);
        // Active of round 2 (lockd-crash-during-wake) is its victim: lingers.
        assert!(active_config(&s, 2).linger_workers);
        // The standby of round 2 wakes slowly and is the Active (victim) of round 3.
        let w = standby_config(&s, 2);
        assert!(w.slow_wake && w.linger_workers && !w.hung_wake);
        // A lockd crash in between is skipped.
        let s2 = [LockdCrash, DoubleKill];
        assert!(active_config(&s2, 0).linger_workers);
    }

    #[test]
    fn compound_delays_are_seeded_and_bounded() {
        for r in 0..200 {
            let a = compound_delay_us(LockdCrashThenSupervisorKill, 7, r);
            assert!(a <= 50_000);
            assert_eq!(a, compound_delay_us(LockdCrashThenSupervisorKill, 7, r));
            assert!(compound_delay_us(DoubleKill, 7, r) <= 5_000);
            assert_eq!(compound_delay_us(EngineKill, 7, r), 0);
        }
        let v: Vec<u64> = (0..50)
            .map(|r| compound_delay_us(LockdCrashThenSupervisorKill, 1, r))
            .collect();
        assert!(v.iter().any(|d| *d < 25_000) && v.iter().any(|d| *d >= 25_000));
    }
}
