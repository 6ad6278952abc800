//! The drill across nodes (`drill::nodes`, issue 13): network namespaces on a bridge, a
//! 3-member etcd, per node a `lockd --backend etcd`, a `supervisor --lock-watchdog` and a fake
//! engine; real processes, real etcd, real namespaces. Each test prints SKIP (and appends to
//! $FAILOVER_SKIP_LOG) when this machine cannot create namespaces or has no etcd.

use std::time::{Duration, Instant};

use drill::nodes::{self, Chaos, Config, Outcome, Report};
use lockd::etcd::LeaderChange;

fn config() -> Config {
    Config {
        nodes: 3,
        ttl: Duration::from_secs(3),
        kill_time: Duration::from_millis(500),
        pause: Duration::from_millis(200),
        drift_ppm: 10_000,
        watchdog: Some(Duration::from_millis(1200)),
        lockd_env: Vec::new(),
        election: Duration::from_millis(500),
        leader_change: LeaderChange::Auto,
        keep_dir: std::env::var_os("DRILL_NODES_KEEP").is_some(),
        keep_on_violation: true,
    }
}

/// Runs the drill; None (after recording the skip) when it cannot run here.
fn drill(test: &str, cfg: Config, kinds: &[Chaos], rounds: usize) -> Option<Report> {
    let t0 = Instant::now();
    let out = nodes::run(cfg, kinds, rounds, |t| {
        eprintln!("{}", nodes::trial_line(t))
    })
    .unwrap_or_else(|e| panic!("the drill could not run: {e:#}"));
    match out {
        Outcome::Skipped(why) => {
            harness::skip::skip(test, &why);
            None
        }
        Outcome::Ran(r) => {
            eprintln!(
                "{test}: {} trials in {:.1} s, {} cascades\n{}",
                r.trials.len(),
                t0.elapsed().as_secs_f64(),
                r.cascades(),
                r.table()
            );
            Some(r)
        }
    }
}

fn violations(r: &Report) -> Vec<String> {
    r.trials
        .iter()
        .flat_map(|t| {
            t.violations
                .iter()
                .map(move |v| format!("trial {} {}: {v}", t.round, t.kind.as_str()))
        })
        .collect()
}

/// Two rounds of every kind that must fail over (engine, supervisor, lockd killed, lockd
/// frozen), of the etcd leader's kill (which must not, with `--etcd-leader-change trust`:
/// the lease survives the election) and of a paused etcd follower, the one the holder's
/// lockd streams its keepalives to (which must not either: the streams move): no violation,
/// every failover with the holder's engine dead before its key was deleted and before the
/// new grant.
#[test]
fn every_chaos_kind_across_nodes_keeps_the_invariants() {
    let _process = harness::serial();
    let kinds = [
        Chaos::EngineKill,
        Chaos::SupervisorKill,
        Chaos::LockdKill,
        Chaos::LockdStop,
        Chaos::LeaderKill,
        Chaos::FollowerPause,
    ];
    let cfg = Config {
        leader_change: LeaderChange::Trust,
        ..config()
    };
    let Some(r) = drill("across_nodes::every_chaos_kind", cfg, &kinds, 12) else {
        return;
    };
    assert_eq!(violations(&r), Vec::<String>::new());
    for t in &r.trials {
        if t.kind.fails_over() {
            let m = t.margin_ms.expect("a failover has a margin");
            assert!(m >= 0.0, "trial {}: margin {m} ms", t.round);
        } else {
            assert_eq!(t.observed.new_holder, None);
        }
    }
}

/// The holder's node cut off the bridge, 20 times: its engine is dead before etcd deletes its
/// key (the earliest any node can be granted) and before the other node's grant, in every
/// trial; the margin is reported per trial and must never be negative. The fence is sized for
/// a 500 ms kill; the supervisor fences a fake engine in a few ms, so the margin is expected
/// well above zero.
#[test]
fn partitioned_holder_is_dead_before_any_grant_in_20_trials() {
    let _process = harness::serial();
    let Some(r) = drill(
        "across_nodes::partition_20",
        config(),
        &[Chaos::Partition],
        20,
    ) else {
        return;
    };
    assert_eq!(violations(&r), Vec::<String>::new());
    let mut margins: Vec<f64> = r.trials.iter().filter_map(|t| t.margin_ms).collect();
    assert_eq!(margins.len(), 20, "every trial measured its margin");
    margins.sort_by(f64::total_cmp);
    eprintln!(
        "partition margins over 20 trials: min {:.0} ms, median {:.0} ms, max {:.0} ms",
        margins[0], margins[10], margins[19]
    );
    assert!(margins[0] >= 0.0);
    // Failover after the partition: the TTL plus etcd's expiry check, bounded loosely here
    // (the benchmark reports median and p99 against TTL + 200 ms).
    for t in &r.trials {
        let f = t.failover_ms.expect("failed over");
        assert!(f < 3_000.0 * 2.0, "trial {}: failover {f} ms", t.round);
    }
}

/// A planted bug: supervisors without `--lock-watchdog`. A frozen lockd (SIGSTOP) tells its
/// holder nothing, its etcd lease expires, another node is granted while the engine lives:
/// the same checks must fail.
#[test]
fn planted_bug_without_the_watchdog_is_caught() {
    let _process = harness::serial();
    let cfg = Config {
        watchdog: None,
        // Its violations are expected: nothing to keep.
        keep_on_violation: false,
        ..config()
    };
    let Some(r) = drill(
        "across_nodes::planted_no_watchdog",
        cfg,
        &[Chaos::LockdStop],
        1,
    ) else {
        return;
    };
    let v = violations(&r);
    eprintln!("planted bug (no watchdog) caught: {v:?}");
    // The ground truth catches it: the next node's engine finds the GPU claim held.
    assert!(
        v.iter().any(|v| v.contains("GPU claim violated")),
        "a frozen lockd without the supervisor's watchdog went unnoticed: {v:?}\n{}",
        r.table()
    );
}

/// A planted bug: lockd's fence ignores its margin (`LOCKD_PLANTED_BUG_FENCE_NO_MARGIN`,
/// debug builds): the holder is told only when etcd may already expire the lease. The fake
/// engine still dies before the key goes (it dies in milliseconds), but the holder no longer
/// has its kill budget: the partition check must fail.
#[test]
fn planted_bug_fence_without_margin_is_caught_by_the_partition_check() {
    let _process = harness::serial();
    let cfg = Config {
        lockd_env: vec![("LOCKD_PLANTED_BUG_FENCE_NO_MARGIN".into(), "1".into())],
        keep_on_violation: false,
        ..config()
    };
    let Some(r) = drill(
        "across_nodes::planted_fence_no_margin",
        cfg,
        &[Chaos::Partition],
        2,
    ) else {
        return;
    };
    let v = violations(&r);
    eprintln!("planted bug (fence without margin) caught: {v:?}");
    assert!(
        v.iter()
            .any(|v| v.contains("kill budget") || v.contains("BEFORE")),
        "the partition check did not catch a fence without margin: {}",
        r.table()
    );
}

/// A 3-member etcd whose leader is SIGSTOPped (1.5 TTL) and resumed while a lease is held,
/// with lockd's default `--etcd-leader-change auto`: on an etcd with the stale-leader revoke
/// (etcd-io/etcd#15247; this machine's Debian 3.4.23) lockd fences its holders at the leader
/// change, so the lease may be lost, but only safely: the holder's engine dead with its kill
/// budget to spare before its key goes, another node taking over, no GPU-claim violation.
/// On a fixed etcd (`auto` = `trust`) nothing may move. The planted check is the ignored
/// test below: the same with `trust` on an affected etcd loses leases unsafely.
#[test]
fn paused_etcd_leader_costs_at_most_a_safe_failover() {
    let _process = harness::serial();
    let Some(r) = drill(
        "across_nodes::paused_member_auto",
        config(),
        &[Chaos::MemberPause],
        3,
    ) else {
        return;
    };
    // The kill budget is the judge's (a violation when short), which also knows when the key
    // went because the holder was gone (lockd released its lease after the engine's death:
    // then the margin is a few ms and nothing is owed). Here: never negative.
    assert_eq!(violations(&r), Vec::<String>::new());
    for t in &r.trials {
        if let Some(m) = t.margin_ms {
            assert!(m >= 0.0, "trial {}: margin {m} ms", t.round);
        }
    }
}

/// `--etcd-leader-change trust`: a 3-member etcd whose leader is SIGSTOPped (1.5 TTL) and
/// resumed while a lease is held: no loss, no second holder. Ignored in CI: on etcd < 3.4.31 / 3.5.13 (this machine has
/// Debian's 3.4.23) the resumed old leader revokes the leases it saw no renewal of, through
/// the new leader (etcd-io/etcd#15247), so the lease is lost, in some runs with the key deleted
/// before the holder's engine was dead; docs/ETCD.md ("The drill across nodes", finding 2) has
/// the evidence. Run it with `--ignored` against a fixed etcd.
#[test]
#[ignore = "etcd < 3.4.31: a resumed old leader revokes live leases (etcd-io/etcd#15247; docs/ETCD.md)"]
fn paused_etcd_leader_while_a_lease_is_held_loses_nothing() {
    let _process = harness::serial();
    let Some(r) = drill(
        "across_nodes::paused_member",
        Config {
            leader_change: LeaderChange::Trust,
            ..config()
        },
        &[Chaos::MemberPause],
        3,
    ) else {
        return;
    };
    assert_eq!(violations(&r), Vec::<String>::new());
}
