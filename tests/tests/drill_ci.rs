//! The failover drill in CI, as real processes (`supervisor drill` starting its own lockd, two
//! supervisors and two fake engines):
//! * a short drill covering every failure kind passes with zero violations and exit 0;
//! * with the test-only planted bug (the supervisor releases its lease before its engine is
//!   dead), the drill reports violations and exits 1.
//!
//! The binaries are built by a nested `cargo build --profile dev` into this test's target
//! directory: once as shipped, once with the `planted-bug-early-release` feature. Each build is
//! copied to its own temporary directory before use, and the shipped build is restored last,
//! so `target/debug/supervisor` never keeps the planted bug (and `--release` builds never see
//! it). The drills run one at a time (they measure timings); this process is a child
//! subreaper while they run, so any process a drill leaves behind re-parents here and fails
//! the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One drill (and one nested cargo build) at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Every failure kind the drill knows.
const KINDS: [&str; 6] = [
    "engine-kill",
    "supervisor-kill",
    "detached-worker",
    "hung-wake",
    "lockd-crash",
    "revoke",
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `target/` of this test executable (`target/<profile>/deps/drill_ci-<hash>`).
fn target_root() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<exe>")
        .to_path_buf()
}

/// Builds supervisor, lockd and fake-engine (dev profile), with or without the planted bug,
/// and copies them into `into`. Returns the directory holding the three binaries.
fn build_bins(planted: bool, into: &Path) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.current_dir(workspace_root())
        .env("CARGO_TARGET_DIR", target_root())
        .args([
            "build",
            "--profile",
            "dev",
            "-p",
            "supervisor",
            "-p",
            "lockd",
            "-p",
            "failover-tests",
            "--bin",
            "supervisor",
            "--bin",
            "lockd",
            "--bin",
            "fake-engine",
        ]);
    if planted {
        c.args(["--features", "supervisor/planted-bug-early-release"]);
    }
    let out = c.output().expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let from = target_root().join("debug");
    for b in ["supervisor", "lockd", "fake-engine"] {
        std::fs::copy(from.join(b), into.join(b)).unwrap_or_else(|e| panic!("copying {b}: {e}"));
    }
    into.to_path_buf()
}

/// What one `supervisor drill` run produced.
struct DrillRun {
    /// Its exit code (0 ok, 1 violation, 2 could not run).
    code: i32,
    /// Round lines, summary table (shown when an assertion fails).
    stdout: String,
    /// Its diagnostics (shown when an assertion fails).
    stderr: String,
    /// The `--report` JSON.
    report: serde_json::Value,
}

/// Runs `supervisor drill` from `bins` with a private TMPDIR, bounded by `limit`; checks that
/// it removed its directory and left no process behind.
fn drill(bins: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> DrillRun {
    let tmp = tempfile::tempdir().expect("tempdir");
    let drill_tmp = tmp.path().join("tmp");
    std::fs::create_dir(&drill_tmp).unwrap();
    let report = tmp.path().join("report.json");
    // SAFETY: prctl with integer arguments.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let mut child = Command::new(bins.join("supervisor"))
        .arg("drill")
        .args(args)
        .arg("--report")
        .arg(&report)
        .env("TMPDIR", &drill_tmp)
        .env_remove("SUPERVISOR_PLANTED_BUG_EARLY_RELEASE")
        .env_remove("SUPERVISOR_PLANTED_BUG_NO_ANCHOR")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting supervisor drill");
    let pid = child.id();
    let out_thread = {
        let mut so = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut so, &mut s).ok();
            s
        })
    };
    let err_thread = {
        let mut se = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut se, &mut s).ok();
            s
        })
    };
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            // Let the drill clean up after itself, then make sure.
            // SAFETY: kill with integer arguments.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_thread.join().unwrap_or_default();
    let stderr = err_thread.join().unwrap_or_default();
    // Anything the drill left behind has re-parented to this subreaper.
    let leftovers = reap_leftovers();
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
    let Some(status) = status else {
        panic!("drill ran past {limit:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    };
    assert!(
        leftovers.is_empty(),
        "the drill left processes behind: {leftovers:?}\n{stdout}\n{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&drill_tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "the drill did not remove its directory: {left:?}"
    );
    let text = std::fs::read_to_string(&report)
        .unwrap_or_else(|e| panic!("no report ({e})\n{stdout}\n{stderr}"));
    DrillRun {
        code: status.code().unwrap_or(-1),
        report: serde_json::from_str(&text).expect("report is JSON"),
        stdout,
        stderr,
    }
}

/// Kills and reaps every child of this process that is not a thread of ours; returns them.
fn reap_leftovers() -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(me) {
            if f.first() != Some(&"Z") {
                found.push(pid);
            }
            // SAFETY: kill / waitpid with integer arguments on our own child.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
                libc::waitpid(pid as i32, std::ptr::null_mut(), 0);
            }
        }
    }
    found
}

#[test]
fn short_drill_covers_every_kind_with_zero_violations() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(false, dir.path());
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(true, dir.path());
    // Put the shipped build back into target/ (the copy above keeps the planted one).
    let restore = tempfile::tempdir().unwrap();
    build_bins(false, restore.path());
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
    // The same switch without the planted build changes nothing: the shipped supervisor
    // ignores the variable.
    let clean = drill(
        restore.path(),
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
    assert_eq!(
        clean.code, 0,
        "stdout:\n{}\nstderr:\n{}",
        clean.stdout, clean.stderr
    );
    assert_eq!(clean.report["total_violations"], 0);
}

#[test]
fn engine_cmd_drills_the_given_command_line() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(false, dir.path());
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
