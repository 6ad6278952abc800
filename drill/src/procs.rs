//! Process bookkeeping for the drill: liveness as the kernel sees it (`procfs`: the
//! workspace's one definition of alive, in which a process that has begun exiting is still
//! alive), pid reuse protection (`procfs::Pinned`), descendants, signals, free loopback ports.

use std::path::Path;

use nix::sys::signal::{self, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
pub use procfs::Pinned;

/// Reaps `p` if it is a zombie child of ours (orphans re-parent to the drill, which is a
/// child subreaper). Never called on pids tokio manages.
pub fn reap_if_zombie(p: &Pinned) {
    if p.stat()
        .is_some_and(|s| s.is_zombie() && s.ppid == std::process::id() as i32)
    {
        let _ = waitpid(Pid::from_raw(p.pid), Some(WaitPidFlag::WNOHANG));
    }
}

/// SIGKILL to `p`, if it is still the same process.
pub fn kill(p: &Pinned) {
    p.signal(Signal::SIGKILL);
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

/// Every descendant of `root` (children, their children, ...; zombies included), from /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    procfs::descendants_in(root as i32, &procfs::all())
        .iter()
        .filter_map(|s| u32::try_from(s.pid).ok())
        .collect()
}

/// Whether `pid` is Python multiprocessing's resource tracker (not an engine process).
fn is_resource_tracker(pid: u32) -> bool {
    procfs::cmdline(pid as i32).contains("multiprocessing.resource_tracker")
}

/// The first live child of the engine's main process `engine` (vLLM: its EngineCore;
/// fake-engine: its first worker), Python's resource tracker left out.
pub fn engine_child(engine: u32) -> Option<u32> {
    let mut kids: Vec<u32> = procfs::children(engine as i32)?
        .into_iter()
        .filter_map(|p| u32::try_from(p).ok())
        .filter(|p| !is_resource_tracker(*p) && procfs::alive(*p as i32))
        .collect();
    kids.sort_unstable();
    kids.first().copied()
}

/// The newest live leaf of the engine's tree (vLLM: a Worker under its EngineCore;
/// fake-engine: its last worker), Python's resource tracker left out.
pub fn engine_leaf(engine: u32) -> Option<u32> {
    let all = procfs::all();
    let tree = procfs::descendants_in(engine as i32, &all);
    tree.iter()
        .filter(|p| p.is_alive() && !tree.iter().any(|c| c.ppid == p.pid))
        .filter_map(|p| u32::try_from(p.pid).ok())
        .filter(|p| !is_resource_tracker(*p))
        .max()
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
    fn tracks_a_real_child_through_death_and_reaping() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let t = Pinned::pin(child.id() as i32).unwrap();
        assert!(t.is_alive());
        assert!(descendants(std::process::id()).contains(&child.id()));
        kill(&t);
        // Unreaped, it is a zombie: dead for the drill.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while t.is_alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!t.is_alive());
        // Not reaped by reap_if_zombie here: `child` is std's to wait for.
        let _ = child.wait();
        assert_eq!(t.stat(), None);
        // A different start time is never the same process.
        let me = Pinned::pin(std::process::id() as i32).unwrap();
        assert!(me.is_alive());
        let fake = Pinned {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!fake.is_alive());
    }

    #[test]
    fn orphaned_zombies_of_ours_are_reaped() {
        // sh forks a sleeper and exits: as a subreaper, this process adopts the sleeper.
        become_subreaper().unwrap();
        let out = std::process::Command::new("sh")
            .args(["-c", "sleep 0.2 & echo $!"])
            .output()
            .unwrap();
        let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let t = Pinned::pin(pid).expect("the sleeper runs");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while t.stat().is_some() {
            assert!(std::time::Instant::now() < deadline, "orphan never reaped");
            reap_if_zombie(&t);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
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
