//! Process bookkeeping for the drill: liveness as the kernel sees it (/proc), pid reuse
//! protection, descendants, signals, free loopback ports.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use nix::sys::signal::{self, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// The fields of /proc/PID/stat the drill needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// One-letter state (R, S, D, Z, X, ...).
    pub state: char,
    /// Parent pid (descendant walks).
    pub ppid: u32,
    /// Kernel task flags (PF_EXITING tells a process in the middle of exiting).
    pub flags: u64,
    /// Start time in clock ticks since boot (tells a reused pid apart).
    pub start_time: u64,
}

/// Task flag set once a process has begun exiting (its files are being or were closed).
const PF_EXITING: u64 = 0x4;

/// Parses the text of /proc/PID/stat (the command name may contain spaces and parens).
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state(3) ppid(4) pgrp(5) session(6) tty(7) tpgid(8) flags(9) ...
    // starttime(22). Index = field number - 3.
    Some(ProcStat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        flags: f.get(6)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
    })
}

/// Reads /proc/PID/stat; `None` when the process is gone.
pub fn stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// A process the drill watches, pinned to its start time so a reused pid is not mistaken
/// for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrackedPid {
    /// The pid.
    pub pid: u32,
    /// Its start time, clock ticks since boot.
    pub start_time: u64,
}

impl TrackedPid {
    /// Pins `pid` now; `None` if it is already gone.
    pub fn pin(pid: u32) -> Option<TrackedPid> {
        stat(pid).map(|s| TrackedPid {
            pid,
            start_time: s.start_time,
        })
    }

    /// Alive: the same process exists, is not a zombie and has not begun exiting. A zombie
    /// or exiting process holds no files any more (the GPU claim and lock fds are closed).
    pub fn is_alive(&self) -> bool {
        match stat(self.pid) {
            Some(s) if s.start_time == self.start_time => {
                !matches!(s.state, 'Z' | 'X' | 'x') && s.flags & PF_EXITING == 0
            }
            _ => false,
        }
    }

    /// Reaps it if it is a zombie child of ours (orphans re-parent to the drill, which is a
    /// child subreaper). Never called on pids tokio manages.
    pub fn reap_if_zombie(&self) {
        if let Some(s) = stat(self.pid) {
            if s.start_time == self.start_time && s.state == 'Z' && s.ppid == std::process::id() {
                let _ = waitpid(Pid::from_raw(self.pid as i32), Some(WaitPidFlag::WNOHANG));
            }
        }
    }

    /// SIGKILL, if it is still the same process.
    pub fn kill(&self) {
        if let Some(s) = stat(self.pid) {
            if s.start_time == self.start_time {
                let _ = signal::kill(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
            }
        }
    }
}

/// The pids in a `--pid-file` (one per line; junk ignored).
pub fn read_pid_file(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|p| *p > 1)
        .collect()
}

/// Every live descendant of `root` (children, their children, ...), from /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(s) = stat(pid) {
                children.entry(s.ppid).or_default().push(pid);
            }
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for c in children.get(&p).into_iter().flatten() {
            if seen.insert(*c) {
                out.push(*c);
                stack.push(*c);
            }
        }
    }
    out
}

/// Makes this process adopt orphaned descendants (a detached worker whose supervisor was
/// killed re-parents here, so the drill can still find, kill and reap it).
pub fn become_subreaper() -> nix::Result<()> {
    nix::sys::prctl::set_child_subreaper(true)
}

/// SIGKILL to a whole process group (never our own).
pub fn kill_group(pgid: u32) {
    if pgid > 1 && pgid != nix::unistd::getpgrp().as_raw() as u32 {
        let _ = signal::killpg(Pid::from_raw(pgid as i32), Signal::SIGKILL);
    }
}

/// A signal to one pid.
pub fn signal_pid(pid: u32, sig: Signal) {
    if pid > 1 {
        let _ = signal::kill(Pid::from_raw(pid as i32), sig);
    }
}

/// A loopback TCP port free right now (the kernel picks it; a tiny race remains until the
/// child binds it, and callers use fresh ports for every process they start).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(l.local_addr()?.port())
}

/// Wall clock, microseconds since the Unix epoch (the same clock as the supervisors'
/// `at_unix_us`).
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let line = "1234 (my (odd) cmd) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 50 18446744073709551615";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.state, 'S');
        assert_eq!(s.ppid, 1);
        assert_eq!(s.flags, 4194560);
        assert_eq!(s.start_time, 98765);
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S 1").is_none());
    }

    #[test]
    fn tracks_a_real_child_through_death_and_reaping() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let t = TrackedPid::pin(child.id()).unwrap();
        assert!(t.is_alive());
        assert!(descendants(std::process::id()).contains(&child.id()));
        t.kill();
        // Unreaped, it is a zombie: dead for the drill.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while t.is_alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!t.is_alive());
        let _ = child.wait();
        assert!(stat(t.pid).is_none_or(|s| s.start_time != t.start_time));
        // A different start time is never the same process.
        let me = TrackedPid::pin(std::process::id()).unwrap();
        assert!(me.is_alive());
        let fake = TrackedPid {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!fake.is_alive());
    }

    #[test]
    fn pid_files_ignore_junk() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pids");
        std::fs::write(&p, "100\n\nabc\n 200 \n1\n").unwrap();
        assert_eq!(read_pid_file(&p), vec![100, 200]);
        assert!(read_pid_file(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn free_ports_are_bindable() {
        let p = free_port().unwrap();
        assert!(p > 0);
        std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
    }
}
