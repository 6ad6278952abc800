//! The chaos kinds of the drill across nodes, and which of them must move the lease.

use serde::{Deserialize, Serialize};

/// One failure injected while a node's side is Active (the "holder").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Chaos {
    /// SIGKILL of the holder's engine main process (its workers die with it).
    EngineKill,
    /// SIGKILL of the holder's supervisor; the "container runtime" kills the engine 100 ms
    /// later.
    SupervisorKill,
    /// SIGKILL of the holder node's lockd (restarted after the failover): its etcd leases are
    /// no longer renewed, nobody tells the holder; its supervisor must fence on its own.
    LockdKill,
    /// SIGSTOP of the holder node's lockd (SIGCONT after the failover): a frozen lockd keeps
    /// its connections open and says nothing; only the supervisor's `--lock-watchdog` (and
    /// the `valid_ms` lockd vouched for) can fence in time.
    LockdStop,
    /// The holder's node is cut off the bridge (no etcd, no reset), healed after the failover.
    Partition,
    /// The etcd leader is SIGKILLed (restarted after the window): no failover may happen.
    LeaderKill,
    /// The etcd leader is SIGSTOPped for the window (then SIGCONT): no failover may happen.
    MemberPause,
    /// An etcd follower is SIGSTOPped for the window (then SIGCONT): the one the holder's
    /// lockd lists first (its keepalive streams are there and must move), or, when that one
    /// leads, another. No leader changes: no failover may happen, with or without the
    /// leader-change fence.
    FollowerPause,
}

impl Chaos {
    /// Every kind, in the default round-robin order.
    pub const ALL: [Chaos; 8] = [
        Chaos::EngineKill,
        Chaos::SupervisorKill,
        Chaos::LockdKill,
        Chaos::LockdStop,
        Chaos::Partition,
        Chaos::LeaderKill,
        Chaos::MemberPause,
        Chaos::FollowerPause,
    ];

    /// Must the lease move to another node (true), or stay with the holder (false)?
    pub fn fails_over(self) -> bool {
        !matches!(
            self,
            Chaos::LeaderKill | Chaos::MemberPause | Chaos::FollowerPause
        )
    }

    /// Does it make etcd elect a new leader (a raft term change, which lockd's
    /// `--etcd-leader-change fence` answers with a safe failover)?
    pub fn changes_leader(self) -> bool {
        matches!(self, Chaos::LeaderKill | Chaos::MemberPause)
    }

    /// Is the holder stopped by a fence (lockd's self-fence or the supervisor's watchdog)
    /// rather than by its own death? Then it must have had its kill budget.
    pub fn fenced(self) -> bool {
        matches!(self, Chaos::LockdKill | Chaos::LockdStop | Chaos::Partition)
    }

    /// Kebab-case name (flags, report).
    pub fn as_str(self) -> &'static str {
        match self {
            Chaos::EngineKill => "engine-kill",
            Chaos::SupervisorKill => "supervisor-kill",
            Chaos::LockdKill => "lockd-kill",
            Chaos::LockdStop => "lockd-stop",
            Chaos::Partition => "partition",
            Chaos::LeaderKill => "leader-kill",
            Chaos::MemberPause => "member-pause",
            Chaos::FollowerPause => "follower-pause",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_etcd_kinds_keep_the_lease() {
        let keep: Vec<_> = Chaos::ALL.iter().filter(|c| !c.fails_over()).collect();
        assert_eq!(
            keep,
            [
                &Chaos::LeaderKill,
                &Chaos::MemberPause,
                &Chaos::FollowerPause
            ]
        );
        let elect: Vec<_> = Chaos::ALL.iter().filter(|c| c.changes_leader()).collect();
        assert_eq!(elect, [&Chaos::LeaderKill, &Chaos::MemberPause]);
        for c in Chaos::ALL {
            let v = serde_json::to_value(c).unwrap();
            assert_eq!(v, c.as_str());
        }
    }
}
