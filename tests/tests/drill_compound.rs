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
//! Binaries are built and used as in `drill_ci.rs` (nested `cargo build --profile dev` into
//! this test's target directory, copied to a temporary directory, the shipped build restored
//! last); the helpers below follow that file.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One drill (and one nested cargo build) at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The environment switch of the planted no-anchor bug (supervisor, test-only feature).
const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `target/` of this test executable (`target/<profile>/deps/drill_compound-<hash>`).
fn target_root() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<exe>")
        .to_path_buf()
}

/// Builds supervisor, lockd and fake-engine (dev profile), with or without the planted bugs,
/// and copies them into `into`.
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
    code: i32,
    stdout: String,
    stderr: String,
    report: serde_json::Value,
}

impl DrillRun {
    fn ctx(&self) -> String {
        format!("stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr)
    }

    fn rounds(&self) -> &Vec<serde_json::Value> {
        self.report["rounds"].as_array().expect("rounds")
    }

    fn violation_names(&self) -> Vec<String> {
        self.rounds()
            .iter()
            .flat_map(|x| x["violations"].as_array().unwrap().iter())
            .map(|v| v["invariant"].as_str().unwrap_or_default().to_string())
            .collect()
    }
}

/// Runs `supervisor drill` from `bins` with a private TMPDIR, bounded by `limit`; checks that
/// it removed its directory and left no process behind (the busy loops of `--load` included).
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
        .env_remove(NO_ANCHOR_ENV)
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting supervisor drill");
    let pid = child.id();
    let pipe = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            r.read_to_string(&mut s).ok();
            s
        })
    };
    let out_thread = pipe(Box::new(child.stdout.take().unwrap()));
    let err_thread = pipe(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
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

/// Kills and reaps every child of this process; returns those that were not zombies.
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(false, dir.path());
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(false, dir.path());
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(false, dir.path());
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let bins = build_bins(true, dir.path());
    // Put the shipped build back into target/ (the copy above keeps the planted one).
    let restore = tempfile::tempdir().unwrap();
    build_bins(false, restore.path());
    let sup = std::fs::read(bins.join("supervisor")).expect("reading supervisor");
    if !sup
        .windows(NO_ANCHOR_ENV.len())
        .any(|w| w == NO_ANCHOR_ENV.as_bytes())
    {
        failover_tests::skip(
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
