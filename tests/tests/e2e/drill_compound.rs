//! The compound failure kinds of the drill in CI (issue 15, split brain after a lockd restart),
//! as real processes (`supervisor drill` starting its own lockd, two supervisors and two fake
//! engines whose workers linger after the engine):
//! * `lockd-crash-then-supervisor-kill`, 20 rounds beside 3 CPU busy loops: every round a
//!   failover with a larger epoch, zero violations, and in every round the old engine's
//!   processes (lingering workers included) were checked at the grant and all dead;
//! * the same kind with `--gpu-sim`: the waker's GPU check runs before every wake, and either
//!   waits for the lingering memory or finds the grant came after the workers' death;
//! * the planted-bug build with `SUPERVISOR_PLANTED_BUG_NO_ANCHOR=1` (the design before the
//!   anchor): the drill catches the split brain and exits 1;
//! * one round of each other compound kind: zero violations.
//!
//! Binaries are built and used as in `drill_ci.rs` (nested `cargo build --profile dev` into a
//! target directory of their own, copied to a temporary directory); both use the helpers of
//! `drill_common`.

use std::time::{Duration, Instant};

use crate::drill_common::*;

/// Every round a failover to another engine life with a larger epoch, no violation, and a
/// fencing check at the grant that looked at the old engine's processes (main + 2 workers,
/// which linger) and found them all dead.
fn assert_clean_failovers(r: &DrillRun, rounds: usize) {
    let ctx = r.ctx();
    assert_eq!(r.code, 0, "{ctx}");
    assert_eq!(r.report["total_violations"], 0, "{ctx}");
    assert_eq!(r.report["completed_rounds"], rounds as u64, "{ctx}");
    assert_eq!(r.rounds().len(), rounds, "{ctx}");
    let mut last_epoch = 0;
    for x in r.rounds() {
        let n = &x["round"];
        assert!(x["violations"].as_array().unwrap().is_empty(), "{ctx}");
        assert_ne!(
            (&x["new_active_engine_id"], &x["new_active_incarnation"]),
            (&x["victim_engine_id"], &x["victim_incarnation"]),
            "round {n}: no failover\n{ctx}"
        );
        let epoch = x["epoch_after"].as_u64().expect("epoch_after");
        assert!(epoch > last_epoch, "round {n}: epoch {epoch}\n{ctx}");
        last_epoch = epoch;
        let checked = x["fence_pids_checked"].as_u64().unwrap_or(0);
        assert!(
            checked >= 3,
            "round {n}: {checked} old-engine pids checked at the grant\n{ctx}"
        );
        assert_eq!(
            x["fence_pids_alive"].as_u64(),
            Some(0),
            "round {n}: old-engine processes alive at the grant\n{ctx}"
        );
        assert_eq!(
            x["compound"]["victim_workers_linger"], true,
            "round {n}: the victim's workers did not linger\n{ctx}"
        );
    }
}

#[test]
fn lockd_crash_then_supervisor_kill_under_load_keeps_the_lease_until_workers_die() {
    let _g = harness::serial();
    let bins = bins();
    let t0 = Instant::now();
    let r = drill(
        &bins,
        &[
            "--kinds",
            "lockd-crash-then-supervisor-kill",
            "--iterations",
            "20",
            "--load",
            "3",
            "--worker-linger",
            "300ms",
            "--reconnect-window",
            "1s",
            "--plain",
        ],
        &[],
        Duration::from_secs(150),
    );
    eprintln!(
        "20 rounds with --load 3 in {:.1}s ({:?} rounds/min)",
        t0.elapsed().as_secs_f64(),
        r.report["rounds_per_minute"]
    );
    assert_clean_failovers(&r, 20);
    let ctx = r.ctx();
    assert_eq!(r.report["load"], 3, "{ctx}");
    assert_eq!(r.report["worker_linger_ms"], 300, "{ctx}");
    assert!(r.report["rounds_per_minute"].as_f64().is_some(), "{ctx}");
    assert!(r.stdout.contains("rounds/min (load 3"), "{ctx}");
    for x in r.rounds() {
        // The Active side had its lease back before its supervisor was killed.
        assert_eq!(x["compound"]["reclaimed"], true, "{ctx}");
        let d = x["compound"]["delay_us"].as_u64().expect("delay_us");
        assert!(d <= 50_000, "{ctx}");
        assert!(
            x["compound"]["lockd_killed_rel_us"]
                .as_i64()
                .is_some_and(|v| v < 0),
            "{ctx}"
        );
    }
}

#[test]
fn gpu_sim_waker_checks_memory_before_every_wake() {
    let _g = harness::serial();
    let bins = bins();
    let r = drill(
        &bins,
        &[
            "--kinds",
            "lockd-crash-then-supervisor-kill",
            "--iterations",
            "4",
            "--gpu-sim",
            "--worker-linger",
            "300ms",
            "--reconnect-window",
            "1s",
            "--plain",
        ],
        &[],
        Duration::from_secs(90),
    );
    assert_clean_failovers(&r, 4);
    let ctx = r.ctx();
    assert_eq!(r.report["gpu_sim"], true, "{ctx}");
    let (mut waited, mut dead_at_grant) = (0, 0);
    for x in r.rounds() {
        let m = &x["marks_after_kill_us"];
        let started = m["new.gpu_check_started"].as_u64();
        let passed = m["new.gpu_check_passed"].as_u64();
        let (Some(s), Some(p)) = (started, passed) else {
            panic!(
                "round {}: no gpu_check_started/passed marks\n{ctx}",
                x["round"]
            );
        };
        assert!(p >= s, "{ctx}");
        // The old engine's lingering workers still registered their memory when the check
        // began: then it had to wait for them (a 300 ms linger, or the container teardown).
        if p - s >= 5_000 {
            waited += 1;
        }
        if x["fence_pids_alive"].as_u64() == Some(0) {
            dead_at_grant += 1;
        }
    }
    eprintln!(
        "gpu-sim: the wake waited for lingering memory in {waited} of 4 rounds; the grant came after the old workers' death in {dead_at_grant} of 4"
    );
    assert!(waited > 0 || dead_at_grant == 4, "{ctx}");
}

#[test]
fn other_compound_kinds_one_round_each() {
    let _g = harness::serial();
    let bins = bins();
    let r = drill(
        &bins,
        &[
            "--kinds",
            "revoke-during-reconnect,lockd-crash-during-wake,double-kill",
            "--iterations",
            "3",
            "--reconnect-window",
            "1s",
            "--plain",
        ],
        &[],
        Duration::from_secs(90),
    );
    assert_clean_failovers(&r, 3);
    let ctx = r.ctx();
    let kinds: Vec<&str> = r
        .rounds()
        .iter()
        .filter_map(|x| x["kind"].as_str())
        .collect();
    assert_eq!(
        kinds,
        vec![
            "revoke-during-reconnect",
            "lockd-crash-during-wake",
            "double-kill"
        ],
        "{ctx}"
    );
    // The revoke hit a lease restored from lockd's state file; the old side fenced itself.
    assert_eq!(r.rounds()[0]["compound"]["revoke_ok"], true, "{ctx}");
    // The waker granted before the lockd crash reclaimed its lease and is the new Active.
    let w = &r.rounds()[1];
    assert_eq!(w["compound"]["reclaimed"], true, "{ctx}");
    assert_eq!(
        w["new_active_engine_id"], w["compound"]["reclaimer_engine_id"],
        "{ctx}"
    );
}

#[test]
fn planted_no_anchor_bug_is_caught() {
    let _g = harness::serial();
    let bins = bins();
    let sup = std::fs::read(bins.join("supervisor")).expect("reading supervisor");
    if !sup
        .windows(NO_ANCHOR_ENV.len())
        .any(|w| w == NO_ANCHOR_ENV.as_bytes())
    {
        harness::skip(
            "drill_compound::planted",
            &format!("the supervisor has no {NO_ANCHOR_ENV} switch"),
        );
        return;
    }
    let r = drill(
        &bins,
        &[
            "--kinds",
            "lockd-crash-then-supervisor-kill",
            "--iterations",
            "3",
            "--worker-linger",
            "300ms",
            "--reconnect-window",
            "1s",
            "--plain",
        ],
        &[(NO_ANCHOR_ENV, "1")],
        Duration::from_secs(90),
    );
    let ctx = r.ctx();
    assert_eq!(r.code, 1, "the planted bug must fail the drill\n{ctx}");
    assert_eq!(r.report["planted_bug"], true, "{ctx}");
    let names = r.violation_names();
    assert!(
        names
            .iter()
            .any(|n| n == "fenced-process-alive-at-grant" || n == "split-brain-claim"),
        "{names:?}\n{ctx}"
    );
    // Not vacuous: the rounds that caught it checked the old engine's processes.
    assert!(
        r.rounds()
            .iter()
            .any(|x| x["fence_pids_alive"].as_u64().is_some_and(|a| a > 0)
                || !x["violations"].as_array().unwrap().is_empty()),
        "{ctx}"
    );
}
