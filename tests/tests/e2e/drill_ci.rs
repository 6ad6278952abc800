//! The failover drill in CI, as real processes (`supervisor drill` starting its own lockd, two
//! supervisors and two fake engines):
//! * a short drill covering every failure kind passes with zero violations and exit 0;
//! * with the test-only planted bug (the supervisor releases its lease before its engine is
//!   dead), the drill reports violations and exits 1.
//!
//! The drills run the workspace's debug binaries (`target/debug/`, built by `cargo test
//! --workspace`). Debug builds carry the planted bugs, switched on only by their environment
//! variables; release builds carry none (`supervisor::fault`, checked by
//! `release_builds_carry_no_planted_bugs` under `cargo test --release`). The drills run one at
//! a time (they measure timings; `harness::serial`); this process is a child subreaper while
//! they run, so any process a drill leaves behind re-parents here and fails the test.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::drill_common::*;

/// Every failure kind the drill knows.
const KINDS: [&str; 6] = [
    "engine-kill",
    "supervisor-kill",
    "detached-worker",
    "hung-wake",
    "lockd-crash",
    "revoke",
];

/// How a real engine's life ends, with fake-engine modelling vLLM: a dead first child or
/// leaf makes `/health` 503 (the supervisor fences after `--unhealthy-after` failed checks, well
/// before fake-engine's own exit 2 s later); a stop hands over without waiting for the grace.
#[test]
fn engine_ends_fail_over_quickly_with_zero_violations() {
    let _g = harness::serial();
    let bins = bins();
    let r = drill(
        &bins,
        &["--iterations", "8", "--kinds", "engine-ends", "--plain"],
        &[],
        Duration::from_secs(120),
    );
    let ctx = format!("stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert_eq!(r.code, 0, "{ctx}");
    assert_eq!(r.report["total_violations"], 0, "{ctx}");
    assert_eq!(r.report["completed_rounds"], 8, "{ctx}");
    let summary = r.report["summary"].as_array().expect("summary");
    for (k, bound_ms) in [
        ("engine-kill", 1000.0),
        ("engine-child-kill", 1500.0),
        ("worker-kill", 1500.0),
        // The stop grace is 10 s: a stop that waited for it would show here.
        ("stop", 1000.0),
    ] {
        let s = summary
            .iter()
            .find(|s| s["kind"] == k)
            .unwrap_or_else(|| panic!("no {k}\n{ctx}"));
        assert_eq!(s["count"], 2, "{k}\n{ctx}");
        let max = s["max_ms"].as_f64().expect("max_ms");
        assert!(max > 0.0 && max < bound_ms, "{k}: max {max} ms\n{ctx}");
    }
}

#[test]
fn short_drill_covers_every_kind_with_zero_violations() {
    let _g = harness::serial();
    let bins = bins();
    let r = drill(
        &bins,
        &[
            "--iterations",
            "10",
            "--kinds",
            "all",
            "--order",
            "round-robin",
            "--reconnect-window",
            "1s",
            "--hung-waking-timeout",
            "1s",
            "--failover-bound",
            "10s",
            "--plain",
        ],
        &[],
        Duration::from_secs(120),
    );
    let ctx = format!("stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert_eq!(r.code, 0, "{ctx}");
    assert_eq!(r.report["total_violations"], 0, "{ctx}");
    assert_eq!(r.report["completed_rounds"], 10, "{ctx}");
    assert_eq!(r.report["planted_bug"], false);
    assert!(r.report["aborted"].is_null(), "{ctx}");
    let rounds = r.report["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 10);
    for k in KINDS {
        assert!(rounds.iter().any(|x| x["kind"] == k), "no {k} round\n{ctx}");
        let s = r.report["summary"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["kind"] == k)
            .unwrap();
        assert!(
            s["median_ms"].as_f64().is_some_and(|m| m > 0.0),
            "{k}: no median\n{ctx}"
        );
    }
    let mut last_epoch = 0;
    for x in rounds {
        assert!(x["violations"].as_array().unwrap().is_empty(), "{ctx}");
        let epoch = x["epoch_after"].as_u64().expect("epoch_after");
        if x["kind"] == "lockd-crash" {
            // No failover: the same engine life stays Active with the same epoch.
            assert_eq!(x["new_active_engine_id"], x["victim_engine_id"], "{ctx}");
            assert_eq!(
                x["new_active_incarnation"], x["victim_incarnation"],
                "{ctx}"
            );
            assert_eq!(epoch, last_epoch, "{ctx}");
            assert!(x["recovery_us"].as_u64().is_some(), "{ctx}");
        } else {
            // Another engine life took over, with a larger epoch, within the bound.
            assert_ne!(
                (&x["new_active_engine_id"], &x["new_active_incarnation"]),
                (&x["victim_engine_id"], &x["victim_incarnation"]),
                "{ctx}"
            );
            assert!(epoch > last_epoch, "{ctx}");
            let total = x["phases"]["total_us"].as_u64().expect("total_us");
            assert!(total > 0 && total < 12_000_000, "{ctx}");
            for p in ["detect_us", "grant_us", "wake_us"] {
                assert!(x["phases"][p].as_u64().is_some(), "{p} missing\n{ctx}");
            }
        }
        last_epoch = epoch;
    }
    // The plain per-round lines and the summary table are on stdout.
    assert_eq!(
        r.stdout.lines().filter(|l| l.starts_with("round ")).count(),
        10,
        "{ctx}"
    );
    assert!(
        r.stdout.contains("10 rounds, 0 invariant violations"),
        "{ctx}"
    );
}

#[test]
fn planted_early_release_bug_is_caught() {
    let _g = harness::serial();
    let bins = bins();
    let r = drill(
        &bins,
        &[
            "--iterations",
            "2",
            "--kinds",
            "detached-worker,revoke",
            "--plain",
        ],
        &[("SUPERVISOR_PLANTED_BUG_EARLY_RELEASE", "1")],
        Duration::from_secs(90),
    );
    let ctx = format!("stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert_eq!(r.code, 1, "the planted bug must fail the drill\n{ctx}");
    assert_eq!(r.report["planted_bug"], true, "{ctx}");
    assert!(r.report["total_violations"].as_u64().unwrap() > 0, "{ctx}");
    let names: Vec<String> = r.report["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|x| x["violations"].as_array().unwrap().iter())
        .map(|v| v["invariant"].as_str().unwrap_or_default().to_string())
        .collect();
    // Both detectors fire: the old engine's processes were alive at the grant, and the new
    // engine found the GPU claim still held (the fake engines' flock, not an assumption).
    assert!(
        names.iter().any(|n| n == "fenced-process-alive-at-grant"),
        "{names:?}\n{ctx}"
    );
    assert!(
        names.iter().any(|n| n == "split-brain-claim"),
        "{names:?}\n{ctx}"
    );
    assert!(r.stdout.contains("violation in round 1"), "{ctx}");
}

#[test]
fn engine_cmd_drills_the_given_command_line() {
    let _g = harness::serial();
    let bins = bins();
    // The fake engine given as a command line, as a real engine would be: placeholders are
    // filled per engine; the kinds needing fake-engine flags are left out of `all`.
    let cmd = format!(
        "'{}' --port {{port}} --engine-id {{engine_id}} --gpu-claim {{gpu_claim}} --pid-file {{pid_file}} --workers 1",
        bins.join("fake-engine").display()
    );
    let r = drill(
        &bins,
        &[
            "--iterations",
            "4",
            "--engine-cmd",
            &cmd,
            "--adapter",
            "vllm",
            "--reconnect-window",
            "1s",
            "--plain",
        ],
        &[],
        Duration::from_secs(90),
    );
    let ctx = format!("stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert_eq!(r.code, 0, "{ctx}");
    assert_eq!(r.report["engine"].as_str(), Some(cmd.as_str()));
    let kinds: Vec<&str> = r.report["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|k| k.as_str())
        .collect();
    assert_eq!(
        kinds,
        vec!["engine-kill", "supervisor-kill", "lockd-crash", "revoke"],
        "{ctx}"
    );
    assert_eq!(r.report["completed_rounds"], 4, "{ctx}");
    assert_eq!(r.report["total_violations"], 0, "{ctx}");
    // Asking for a kind that needs fake-engine flags with --engine-cmd is refused (exit 2).
    let mut refused = Command::new(bins.join("supervisor"))
        .args([
            "drill",
            "--iterations",
            "1",
            "--kinds",
            "hung-wake",
            "--engine-cmd",
            &cmd,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let st = refused.wait().unwrap();
    assert_eq!(st.code(), Some(2));
}
