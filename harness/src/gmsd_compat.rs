//! A running `gmsd --backend host` (GPU Memory Service without a GPU) on a Unix socket in a
//! test dir, for the supervisor's `--gms` checks, with the API the end-to-end tests used
//! before `harness::gmsd` (B2's launcher) existed. To be reconciled with it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::bins::must_bin;
use crate::proc::Proc;
use crate::wait::wait_until;

/// A running gmsd.
#[derive(Debug)]
pub struct Gmsd {
    /// The process (None while stopped).
    pub proc: Option<Proc>,
    /// Its socket.
    pub socket: PathBuf,
    /// Directory for the socket and logs.
    dir: PathBuf,
    /// Starts so far (names the log files).
    starts: u32,
}

impl Gmsd {
    /// Start an empty gmsd in `dir`; waits until `gmsctl state` answers.
    pub fn start(dir: &Path) -> Gmsd {
        let mut g = Gmsd {
            proc: None,
            socket: dir.join("gms.sock"),
            dir: dir.to_path_buf(),
            starts: 0,
        };
        g.restart();
        g
    }

    /// (Re)start (empty: gmsd keeps nothing across restarts); waits until it answers.
    pub fn restart(&mut self) {
        self.starts += 1;
        let mut cmd = Command::new(must_bin("gmsd"));
        cmd.arg("--socket")
            .arg(&self.socket)
            .args(["--backend", "host"]);
        for (k, _) in std::env::vars() {
            if k.starts_with("GMSD_") {
                cmd.env_remove(k);
            }
        }
        let log = self.dir.join(format!("gmsd.{}.log", self.starts));
        self.proc = Some(Proc::spawn("gmsd", cmd, log));
        let up = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.state().is_some()
        });
        assert!(up, "gmsd did not come up: {}", self.log_text());
    }

    /// SIGKILL and reap it (its socket file is left behind, as after a crash); panics if it
    /// does not die within 10 s.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(Signal::SIGKILL);
            assert!(
                p.wait_exit(Duration::from_secs(10)).is_some(),
                "gmsd did not die"
            );
        }
    }

    /// `gmsctl state` as JSON (None if it does not answer).
    pub fn state(&self) -> Option<serde_json::Value> {
        let out = Command::new(must_bin("gmsctl"))
            .arg("state")
            .arg("--socket")
            .arg(&self.socket)
            .args(["--timeout", "1s"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Load and commit `count` allocations of 2 MiB with `gmsctl load` (a real writer).
    pub fn load(&self, count: u32) {
        let out = Command::new(must_bin("gmsctl"))
            .arg("load")
            .arg("--socket")
            .arg(&self.socket)
            .args(["--count", &count.to_string(), "--size", "2097152"])
            .stdin(Stdio::null())
            .output()
            .expect("run gmsctl load");
        assert!(
            out.status.success(),
            "gmsctl load failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Current log.
    pub fn log_text(&self) -> String {
        self.proc.as_ref().map(|p| p.log_text()).unwrap_or_default()
    }
}
