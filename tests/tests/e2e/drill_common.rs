//! Shared by `drill_ci.rs` and `drill_compound.rs`: run `supervisor drill` (the workspace's
//! debug binaries, which carry the test-only planted bugs behind their environment switches)
//! with a private TMPDIR under a bound, and reap anything left behind (the test process is a
//! child subreaper meanwhile).
//! Callers hold [`harness::serial`]: the leftover reaper kills every child of this process.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

/// The environment switch of the planted no-anchor bug (supervisor, test-only feature).
pub const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

/// The directory of the workspace's debug binaries (`target/<profile>/`), where
/// `cargo test --workspace` built `supervisor`, `supervisor-drill`, `lockd` and `fake-engine`.
/// The planted bugs are compiled into these debug builds and switched on only by their
/// environment variables (`supervisor::fault`), so no nested cargo build is needed.
pub fn bins() -> PathBuf {
    for b in ["supervisor", "supervisor-drill", "lockd", "fake-engine"] {
        harness::must_bin(b);
    }
    harness::must_bin("supervisor")
        .parent()
        .expect("a binary has a directory")
        .to_path_buf()
}

/// What one `supervisor drill` run produced.
pub struct DrillRun {
    /// Its exit code (0 ok, 1 violation, 2 could not run).
    pub code: i32,
    /// Round lines, summary table (shown when an assertion fails).
    pub stdout: String,
    /// Its diagnostics (shown when an assertion fails).
    pub stderr: String,
    /// The `--report` JSON.
    pub report: serde_json::Value,
}

impl DrillRun {
    pub fn ctx(&self) -> String {
        format!("stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr)
    }

    pub fn rounds(&self) -> &Vec<serde_json::Value> {
        self.report["rounds"].as_array().expect("rounds")
    }

    pub fn violation_names(&self) -> Vec<String> {
        self.rounds()
            .iter()
            .flat_map(|x| x["violations"].as_array().unwrap().iter())
            .map(|v| v["invariant"].as_str().unwrap_or_default().to_string())
            .collect()
    }
}

/// Runs `supervisor drill` from `bins` with a private TMPDIR, bounded by `limit`; checks that
/// it removed its directory and left no process behind (the busy loops of `--load` included).
pub fn drill(bins: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> DrillRun {
    let tmp = tempfile::tempdir().expect("tempdir");
    let drill_tmp = tmp.path().join("tmp");
    std::fs::create_dir(&drill_tmp).unwrap();
    let report = tmp.path().join("report.json");
    nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
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
            harness::kill(pid as i32, Signal::SIGTERM);
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
    nix::sys::prctl::set_child_subreaper(false).expect("clear PR_SET_CHILD_SUBREAPER");
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
pub fn reap_leftovers() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut found = Vec::new();
    for p in procfs::all().into_iter().filter(|p| p.ppid == me) {
        if p.is_alive() {
            found.push(p.pid);
        }
        harness::kill(p.pid, Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(p.pid), None);
    }
    found
}
