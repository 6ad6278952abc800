//! A running `lockd serve` on a Unix socket in a test dir, with the API the end-to-end tests
//! used before `harness::lockd` (B2's launcher) existed. To be reconciled with it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use lockd::proto::StatusReport;
use nix::sys::signal::Signal;

use crate::bins::must_bin;
use crate::proc::Proc;
use crate::wait::wait_until;

/// A running lockd on a Unix socket in the test dir.
#[derive(Debug)]
pub struct Lockd {
    /// The process (None while stopped).
    pub proc: Option<Proc>,
    /// `unix:PATH`.
    pub endpoint: String,
    /// Directory for socket, state and logs.
    dir: PathBuf,
    /// `--reconnect-window`.
    reconnect_window: String,
    /// Starts so far (names the log files).
    starts: u32,
}

impl Lockd {
    /// Start lockd in `dir` with the given reconnect window (e.g. `2s`).
    pub fn start(dir: &Path, reconnect_window: &str) -> Lockd {
        let mut l = Lockd {
            proc: None,
            endpoint: format!("unix:{}", dir.join("lockd.sock").display()),
            dir: dir.to_path_buf(),
            reconnect_window: reconnect_window.to_string(),
            starts: 0,
        };
        l.restart();
        l
    }

    /// (Re)start after a stop; waits until `lockd status` answers (panics if it does not
    /// within 10 s).
    pub fn restart(&mut self) {
        self.starts += 1;
        let mut cmd = Command::new(must_bin("lockd"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(&self.endpoint)
            .arg("--state")
            .arg(self.dir.join("lockd.state"))
            .arg("--reconnect-window")
            .arg(&self.reconnect_window);
        let log = self.dir.join(format!("lockd.{}.log", self.starts));
        self.proc = Some(Proc::spawn("lockd", cmd, log));
        let ok = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.status().is_some()
        });
        assert!(ok, "lockd did not come up: {}", self.log_text());
    }

    /// SIGKILL lockd and reap it (panics if it does not die within 5 s).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(Signal::SIGKILL);
            assert!(
                p.wait_exit(Duration::from_secs(5)).is_some(),
                "lockd did not die"
            );
        }
    }

    /// `lockd status`, typed (None if it does not answer). Panics if it answers something
    /// that is not a status report (a broken contract).
    pub fn status(&self) -> Option<StatusReport> {
        let out = Command::new(must_bin("lockd"))
            .args(["status", "--connect", &self.endpoint])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        Some(serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "lockd status is not a StatusReport ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        }))
    }

    /// Holder of `resource` per `lockd status` (None if free, unknown, or no answer).
    pub fn holder(&self, resource: &str) -> Option<String> {
        self.status()?
            .resources
            .into_iter()
            .find(|r| r.name == resource)
            .and_then(|r| r.holder)
    }

    /// `lockd revoke`; returns whether it succeeded.
    pub fn revoke(&self, resource: &str, reason: &str) -> bool {
        Command::new(must_bin("lockd"))
            .args([
                "revoke",
                "--connect",
                &self.endpoint,
                "--resource",
                resource,
                "--reason",
                reason,
            ])
            .stdin(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Current log.
    pub fn log_text(&self) -> String {
        self.proc.as_ref().map(|p| p.log_text()).unwrap_or_default()
    }
}
