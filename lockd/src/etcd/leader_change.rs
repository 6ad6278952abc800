//! What a session's self-fence does when etcd's leader changes (`lockd serve
//! --etcd-leader-change auto|trust|fence`). Pure: the etcd version in, a decision out.
//!
//! On etcd < 3.4.31 / 3.5.13 a leader that was stalled (SIGSTOP, a stuck disk, a frozen VM)
//! revokes, when it resumes, the leases it saw no renewal of: its lessor proposes the
//! revocations before it learns the new term, and raft forwards them to the new leader, which
//! commits them (etcd-io/etcd#15247, fixed by etcd PR #16822, backported to 3.4 in #17465).
//! Such a revoke comes an unbounded time after the last renewal *that* member processed, so no
//! deadline computed from the current leader's acknowledgements covers it: the lock can go
//! while its holder lives. The only safe answer lockd has on those versions is to stop
//! crediting renewals once it sees a newer raft term ([`super::fence::Fence::freeze_on_term_change`]):
//! the holders are fenced at the old term's deadline, before any stale leader can revoke —
//! at the price of a failover at **every** etcd leader change (a killed leader, a rolling
//! restart), since lockd cannot tell a stalled former leader from a dead one.

/// `--etcd-leader-change`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeaderChange {
    /// `fence` on an etcd with the stale-leader revoke (or whose version cannot be read),
    /// `trust` on a fixed one. The default: safe everywhere, free on a fixed etcd.
    #[default]
    Auto,
    /// Keep crediting renewals across leader changes: the lease survives a leader's death or
    /// a rolling restart. Unsafe on an etcd with the stale-leader revoke (a resumed former
    /// leader can take the lock from a live holder).
    Trust,
    /// Fence every holder at its old term's deadline after any leader change.
    Fence,
}

impl LeaderChange {
    /// Whether a session's fence freezes at a raft term change, on an etcd of this version.
    pub fn fences(self, etcd_version: &str) -> bool {
        match self {
            LeaderChange::Trust => false,
            LeaderChange::Fence => true,
            LeaderChange::Auto => stale_leader_revokes(etcd_version) != Some(false),
        }
    }

    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaderChange::Auto => "auto",
            LeaderChange::Trust => "trust",
            LeaderChange::Fence => "fence",
        }
    }
}

impl std::str::FromStr for LeaderChange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(LeaderChange::Auto),
            "trust" => Ok(LeaderChange::Trust),
            "fence" => Ok(LeaderChange::Fence),
            other => Err(format!(
                "{other:?}: expected auto, trust or fence (docs/ETCD.md)"
            )),
        }
    }
}

/// Whether an etcd of this version (`Status.version`, e.g. `3.4.23`) lets a stalled former
/// leader revoke live leases when it resumes (etcd-io/etcd#15247). Fixed in 3.4.31 and
/// 3.5.13 (and 3.6). None: not a version.
pub fn stale_leader_revokes(version: &str) -> Option<bool> {
    let mut parts = version.trim().split(['.', '-', '+']);
    let mut num = || parts.next()?.parse::<u64>().ok();
    let (major, minor, patch) = (num()?, num()?, num()?);
    Some(match (major, minor) {
        (0..=2, _) => true,
        (3, 0..=3) => true,
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_versions_with_the_stale_leader_revoke_are_recognised() {
        for v in ["3.4.23", "3.4.30", "3.5.0", "3.5.12", "3.3.27", "2.3.8"] {
            assert_eq!(stale_leader_revokes(v), Some(true), "{v}");
        }
        for v in [
            "3.4.31",
            "3.4.39",
            "3.5.13",
            "3.5.21",
            "3.6.0",
            "3.6.4-rc.0",
            "4.0.0",
        ] {
            assert_eq!(stale_leader_revokes(v), Some(false), "{v}");
        }
        for v in ["", "3.4", "x.y.z", "3.4.x"] {
            assert_eq!(stale_leader_revokes(v), None, "{v:?}");
        }
    }

    #[test]
    fn auto_fences_on_an_affected_or_unknown_etcd_and_trusts_a_fixed_one() {
        assert!(LeaderChange::Auto.fences("3.4.23"));
        assert!(LeaderChange::Auto.fences("3.5.12"));
        assert!(LeaderChange::Auto.fences("not a version"));
        assert!(!LeaderChange::Auto.fences("3.4.31"));
        assert!(!LeaderChange::Auto.fences("3.5.13"));
        assert!(!LeaderChange::Auto.fences("3.6.0"));
        assert!(!LeaderChange::Trust.fences("3.4.23"));
        assert!(LeaderChange::Fence.fences("3.6.0"));
    }

    #[test]
    fn the_flag_parses_its_three_values_and_refuses_others() {
        for m in [LeaderChange::Auto, LeaderChange::Trust, LeaderChange::Fence] {
            assert_eq!(m.as_str().parse::<LeaderChange>(), Ok(m));
        }
        let e = "freeze".parse::<LeaderChange>().unwrap_err();
        assert!(e.contains("auto, trust or fence"), "{e}");
        assert_eq!(LeaderChange::default(), LeaderChange::Auto);
    }
}
