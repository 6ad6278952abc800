//! One test's world: a temp dir, a lockd, supervisors with fake engines sharing one GPU claim
//! file; everything is killed on drop (engine pids from the pid files too, since detached
//! workers live in their own sessions).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use probes::Phase;

use crate::bins::must_bin;
use crate::lockd::{Lockd, LockdSpec};
use crate::net::free_addr;
use crate::proc::{kill, Proc};
use crate::supervisor::{read_pid_file, Sup, SupOpts};

/// One test's world: a temp dir, a lockd, supervisors; kills everything on drop.
#[derive(Debug)]
pub struct Cluster {
    /// Temp dir for sockets, state, pid files and logs (removed on drop; failing assertions
    /// print the logs through `dump_logs`).
    pub dir: tempfile::TempDir,
    /// The lock daemon.
    pub lockd: Lockd,
    /// The GPU claim file shared by all fake engines.
    pub claim: PathBuf,
    /// Every pid file ever handed to an engine (for cleanup).
    pid_files: Vec<PathBuf>,
    /// Starts so far (names files).
    n: u32,
}

impl Cluster {
    /// New world with a lockd (socket, state and log `lockd.log` in the temp dir) using
    /// `reconnect_window`.
    pub fn new(reconnect_window: Duration) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("failover-test-")
            .tempdir()
            .expect("tempdir");
        let lockd = Lockd::start(LockdSpec::new(dir.path()).reconnect_window(reconnect_window));
        let claim = dir.path().join("gpu.claim");
        Cluster {
            dir,
            lockd,
            claim,
            pid_files: Vec::new(),
            n: 0,
        }
    }

    /// Path of the violations file fake engines write on split brain.
    pub fn violations_file(&self) -> PathBuf {
        let mut p = self.claim.clone().into_os_string();
        p.push(".violations");
        PathBuf::from(p)
    }

    /// Split-brain reports so far (empty string if none).
    pub fn violations(&self) -> String {
        std::fs::read_to_string(self.violations_file()).unwrap_or_default()
    }

    /// Start a supervisor wrapping a fake engine.
    pub fn start(&mut self, o: &SupOpts) -> Sup {
        self.n += 1;
        let (probes, engine) = o.addrs.unwrap_or_else(|| (free_addr(), free_addr()));
        let pid_file = self
            .dir
            .path()
            .join(format!("engine-{}.{}.pids", o.engine_id, self.n));
        self.pid_files.push(pid_file.clone());
        let mut cmd = Command::new(must_bin("supervisor"));
        cmd.arg("run")
            .args(["--engine-id", &o.engine_id.to_string()])
            .args(["--role", o.role])
            .args([
                "--lock",
                &o.lock.clone().unwrap_or_else(|| self.lockd.endpoint()),
            ])
            .args(["--probes", &probes.to_string()])
            .args(["--adapter", o.adapter])
            .args(["--engine-url", &format!("http://{engine}")])
            .args(["--health-interval", "200ms", "--startup-poll", "20ms"])
            .args(["--restart", o.restart])
            .args(&o.sup_args)
            .arg("--");
        if let Some(real) = &o.real_engine {
            cmd.args((real.argv)(&real.vllm, engine.port()))
                .envs(real.env.iter().copied());
        } else {
            cmd.arg(must_bin("fake-engine"))
                .args(["--port", &engine.port().to_string()])
                .arg("--gpu-claim")
                .arg(&self.claim)
                .arg("--pid-file")
                .arg(&pid_file)
                .args(&o.engine_args);
        }
        // Keep the environment of the test runner from configuring the supervisor (except
        // the test-only planted-bug switches, which only a planted build reads).
        for (k, _) in std::env::vars() {
            let planted = k.starts_with("SUPERVISOR_PLANTED_BUG_");
            if (k.starts_with("SUPERVISOR_") && !planted)
                || k.starts_with("FAKE_ENGINE_")
                || k == "ENGINE_ID"
            {
                cmd.env_remove(k);
            }
        }
        let log = self
            .dir
            .path()
            .join(format!("supervisor-{}.{}.log", o.engine_id, self.n));
        let proc = Proc::spawn(&format!("supervisor-{}", o.engine_id), cmd, log);
        Sup {
            proc,
            probes,
            engine,
            pid_file,
            engine_id: o.engine_id,
        }
    }

    /// Starts a supervisor with `primary` and waits until it is Active, then one with `shadow`
    /// and waits until it is Standby, each bounded by `limit`; panics with every log
    /// otherwise.
    pub fn start_pair(
        &mut self,
        primary: &SupOpts,
        shadow: &SupOpts,
        limit: Duration,
    ) -> (Sup, Sup) {
        let p = self.start(primary);
        assert!(
            p.wait_phase(Phase::Active, limit),
            "primary not Active{}",
            self.dump_logs()
        );
        let s = self.start(shadow);
        assert!(
            s.wait_phase(Phase::Standby, limit),
            "shadow not Standby{}",
            self.dump_logs()
        );
        (p, s)
    }

    /// Every engine pid (from all pid files) still alive and still one of this cluster's
    /// engine processes (their command lines name this cluster's claim file), so that a
    /// recycled pid is never killed.
    pub fn live_engine_pids(&self) -> Vec<i32> {
        let tag = self.claim.to_string_lossy().into_owned();
        self.pid_files
            .iter()
            .flat_map(|f| read_pid_file(f))
            .filter(|p| {
                let cl = procfs::cmdline(*p);
                procfs::alive(*p) && cl.contains("fake-engine") && cl.contains(&tag)
            })
            .collect()
    }

    /// Every log in the test dir, for the message of a failing assertion.
    pub fn dump_logs(&self) -> String {
        let mut out = String::new();
        if let Ok(rd) = std::fs::read_dir(self.dir.path()) {
            let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            paths.sort();
            for p in paths {
                if p.extension().is_some_and(|e| e == "log") {
                    out.push_str(&format!(
                        "\n===== {} =====\n{}",
                        p.display(),
                        std::fs::read_to_string(&p).unwrap_or_default()
                    ));
                }
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Engines and workers (detached ones live in their own sessions): SIGKILL by pid,
        // only if the pid still names a fake-engine process.
        let mut seen = HashSet::new();
        for _ in 0..3 {
            for p in self.live_engine_pids() {
                if seen.insert(p) || procfs::alive(p) {
                    kill(p, Signal::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.lockd.kill();
    }
}
