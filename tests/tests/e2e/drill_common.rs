//! Shared by `drill_ci.rs` and `drill_compound.rs`: build the drill's binaries with nested
//! cargo builds into a target directory of their own (`target/drill-nested`, so that a
//! planted-bug build never replaces a binary in `target/<profile>/` that other tests run),
//! copied to a temporary directory; run `supervisor drill` with a private TMPDIR under a
//! bound, and reap anything left behind (the test process is a child subreaper meanwhile).
//! Callers hold [`harness::serial`]: the leftover reaper kills every child of this process.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

/// The environment switch of the planted no-anchor bug (supervisor, test-only feature).
pub const NO_ANCHOR_ENV: &str = "SUPERVISOR_PLANTED_BUG_NO_ANCHOR";

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `target/` of this test executable (`target/<profile>/deps/<test>-<hash>`).
pub fn target_root() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<exe>")
        .to_path_buf()
}

/// The nested builds' own target directory.
pub fn nested_target() -> PathBuf {
    target_root().join("drill-nested")
}

/// Builds supervisor, lockd and fake-engine (dev profile), with or without the planted bugs,
/// into [`nested_target`], and copies them into `into`.
pub fn build_bins(planted: bool, into: &Path) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.current_dir(workspace_root())
        .env("CARGO_TARGET_DIR", nested_target())
        .args([
            "build",
            "--profile",
            "dev",
            "-p",
            "supervisor",
            "-p",
            "lockd",
            "-p",
            "fake-engine",
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
    let from = nested_target().join("debug");
    for b in ["supervisor", "lockd", "fake-engine"] {
        std::fs::copy(from.join(b), into.join(b)).unwrap_or_else(|e| panic!("copying {b}: {e}"));
    }
    into.to_path_buf()
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
