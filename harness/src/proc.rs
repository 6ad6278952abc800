//! A child process in its own process group, with its output in a log file, killed (the
//! whole group) and reaped on drop.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// A started process in its own process group, with stdout+stderr in a log file. Dropping
/// it SIGKILLs the group and reaps the process.
#[derive(Debug)]
pub struct Proc {
    /// What it is (for messages).
    pub name: String,
    /// The child handle (for wait).
    child: Child,
    /// Its log file.
    pub log: PathBuf,
    /// Exit status once collected.
    status: Option<ExitStatus>,
}

impl Proc {
    /// Spawn `cmd` in a new process group, logging to `log` (created anew); panics if it
    /// cannot start.
    pub fn spawn(name: &str, cmd: Command, log: PathBuf) -> Proc {
        Proc::start(name, cmd, log, false).unwrap_or_else(|e| panic!("cannot spawn {name}: {e}"))
    }

    /// Spawn `cmd` in a new process group, appending to `log` (a daemon's log kept across
    /// its restarts); the error if the log cannot be opened or the process cannot start.
    pub fn try_spawn_appending(name: &str, cmd: Command, log: PathBuf) -> std::io::Result<Proc> {
        Proc::start(name, cmd, log, true)
    }

    fn start(name: &str, mut cmd: Command, log: PathBuf, append: bool) -> std::io::Result<Proc> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&log)?;
        let f2 = f.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(f))
            .stderr(Stdio::from(f2))
            .process_group(0);
        let child = cmd.spawn()?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
            status: None,
        })
    }

    /// Pid (also the process group id).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Send `sig` to the process only (not to its group); false if it is already reaped.
    pub fn signal(&self, sig: Signal) -> bool {
        self.status.is_none() && signal::kill(Pid::from_raw(self.pid()), sig).is_ok()
    }

    /// Send `sig` to its whole process group; false if the group is gone.
    pub fn signal_group(&self, sig: Signal) -> bool {
        signal::killpg(Pid::from_raw(self.pid()), sig).is_ok()
    }

    /// Wait for exit up to `timeout`; the status once it has exited.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.status.is_some() {
            return self.status;
        }
        let end = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.status = Some(st);
                return self.status;
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its exit status if it has been collected (by [`wait_exit`](Self::wait_exit),
    /// [`exited`](Self::exited) or [`kill`](Self::kill)); does not poll.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.status
    }

    /// Has it exited (non-blocking)?
    pub fn exited(&mut self) -> bool {
        self.wait_exit(Duration::ZERO).is_some()
    }

    /// SIGKILL the process group and the process, and reap it.
    pub fn kill(&mut self) {
        if self.status.is_none() {
            let _ = signal::killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
            let _ = signal::kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
            self.status = self.child.wait().ok();
        }
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Send `sig` to `pid` (a pid this test read from a pid file or `/state`); false if it is
/// gone. Prefer [`procfs::Pinned::signal`] where the pid may have been reused.
pub fn kill(pid: i32, sig: Signal) -> bool {
    pid > 0 && signal::kill(Pid::from_raw(pid), sig).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_kills_the_whole_group_and_logs_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo started; sleep 30 & echo $! > child.pid; wait"])
            .current_dir(dir.path());
        let p = Proc::spawn("sh", cmd, dir.path().join("sh.log"));
        let pidfile = dir.path().join("child.pid");
        assert!(crate::wait_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            || std::fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
        ));
        let child: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(procfs::alive(child));
        assert!(crate::wait_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            || p.log_text().contains("started")
        ));
        let sh = p.pid();
        drop(p);
        assert!(!procfs::alive(sh), "the process was reaped");
        assert!(
            crate::wait_until(Duration::from_secs(5), Duration::from_millis(5), || {
                !procfs::alive(child)
            }),
            "the group's other member was killed"
        );
    }

    #[test]
    fn wait_exit_reports_the_status_and_signal_after_reap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exit 7"]);
        let mut p = Proc::spawn("sh", cmd, dir.path().join("sh.log"));
        let st = p.wait_exit(Duration::from_secs(10)).expect("exits");
        assert_eq!(st.code(), Some(7));
        assert!(p.exited());
        assert!(!p.signal(Signal::SIGTERM));
    }
}
