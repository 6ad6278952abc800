//! The one reader of `/proc` in this workspace (Linux).
//!
//! The supervisor (fencing, tree pins), the drill (its judge of "is the old engine still
//! there") and the end-to-end tests all ask the same questions of the kernel; they ask them
//! here, so that "alive" means one thing everywhere:
//!
//! > **alive** = the pid exists, is the same process (start time, when pinned), and is not a
//! > zombie (`Z`) or dead (`X`). A process that has begun exiting (`PF_EXITING`) is still
//! > alive: the kernel sets that flag at the start of `do_exit`, before `exit_mm` and
//! > `exit_files` release its memory and descriptors (GPU device files included), so it may
//! > still hold what a successor must not share. [`Stat::is_exiting`] tells it apart for
//! > logs and diagnostics only.
//!
//! Parsing is pure ([`parse_stat`]); the readers return `None` / skip entries for processes
//! that vanish while being read (a normal race, never an error).

use std::collections::{HashMap, HashSet};
use std::io;

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// Task flag set once a process has begun exiting (`include/linux/sched.h`).
pub const PF_EXITING: u64 = 0x4;

/// The fields of `/proc/PID/stat` this workspace uses (proc(5)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// Field 1: pid.
    pub pid: i32,
    /// Field 3: one-letter state (`R`, `S`, `D`, `T`, `Z`, `X`, ...).
    pub state: char,
    /// Field 4: parent pid.
    pub ppid: i32,
    /// Field 5: process group id.
    pub pgid: i32,
    /// Field 9: kernel task flags.
    pub flags: u64,
    /// Field 22: start time, clock ticks since boot (tells a reused pid apart).
    pub start_time: u64,
}

impl Stat {
    /// The one definition of alive (see the crate docs): not a zombie, not dead.
    pub fn is_alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }

    /// Zombie: exited, not yet reaped by its parent. Holds no memory and no files.
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z'
    }

    /// Has begun exiting (`PF_EXITING`) but may still hold memory and files. Diagnostics only.
    pub fn is_exiting(&self) -> bool {
        self.flags & PF_EXITING != 0
    }
}

/// Parses the text of `/proc/PID/stat`. The command name (field 2) may contain spaces and
/// parentheses, so the fields after it are found from the last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let pid = text[..open].trim().parse().ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): field N is f[N - 3].
    Some(Stat {
        pid,
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgid: f.get(2)?.parse().ok()?,
        flags: f.get(6)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
    })
}

/// Reads `/proc/PID/stat`; `None` when the process is gone (or unreadable).
pub fn stat(pid: i32) -> Option<Stat> {
    if pid <= 0 {
        return None;
    }
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `pid` exists and is [alive](Stat::is_alive). Prefer [`Pinned::is_alive`] for a process
/// observed earlier: a bare pid may have been reused.
pub fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| s.is_alive())
}

/// `/proc/PID/cmdline` with NULs as spaces (empty for a zombie or a vanished process).
pub fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// Every process in `/proc` (those that vanish while being read are skipped).
pub fn all() -> Vec<Stat> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(stat)
        .collect()
}

/// Descendants of `root` in `procs` (children, grandchildren, ...; `root` excluded; zombies
/// included — filter with [`Stat::is_alive`]). Pure: give it [`all`]'s snapshot.
pub fn descendants_in(root: i32, procs: &[Stat]) -> Vec<Stat> {
    let mut children: HashMap<i32, Vec<Stat>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(*p);
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for c in children.get(&p).into_iter().flatten() {
            if seen.insert(c.pid) {
                out.push(*c);
                stack.push(c.pid);
            }
        }
    }
    out
}

/// Live descendants of `root`, from a fresh full scan of `/proc`.
pub fn live_descendants(root: i32) -> Vec<Stat> {
    descendants_in(root, &all())
        .into_iter()
        .filter(Stat::is_alive)
        .collect()
}

/// Pids listed in `/proc/PID/task/*/children`; `None` if the kernel lacks
/// `CONFIG_PROC_CHILDREN` (or the process is gone). These lists may miss a process that
/// changes while they are read: never use an empty result as proof of no children.
pub fn children(pid: i32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut out = Vec::new();
    let mut any = false;
    for t in tasks.filter_map(|e| e.ok()) {
        match std::fs::read_to_string(t.path().join("children")) {
            Ok(text) => {
                any = true;
                out.extend(
                    text.split_whitespace()
                        .filter_map(|x| x.parse::<i32>().ok()),
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && !any => return None,
            Err(_) => {}
        }
    }
    Some(out)
}

/// Every descendant of `root` (zombies included), following the `children` lists: the cost
/// is the size of the tree, not of the machine's process table. Falls back to a full scan
/// without `CONFIG_PROC_CHILDREN`. May miss a process forked while it reads.
pub fn tree(root: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        match children(p) {
            Some(cs) => {
                for c in cs {
                    if seen.insert(c) {
                        out.push(c);
                        stack.push(c);
                    }
                }
            }
            None if p == root => {
                return descendants_in(root, &all()).iter().map(|s| s.pid).collect();
            }
            None => {}
        }
    }
    out
}

/// A process observed once, pinned to its start time so that a reused pid is never mistaken
/// for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pinned {
    /// The pid.
    pub pid: i32,
    /// Its start time, clock ticks since boot.
    pub start_time: u64,
}

impl Pinned {
    /// Pins `pid` now; `None` if it is already gone.
    pub fn pin(pid: i32) -> Option<Pinned> {
        stat(pid).map(|s| Pinned {
            pid,
            start_time: s.start_time,
        })
    }

    /// Its current stat, if the pid still names the same process.
    pub fn stat(&self) -> Option<Stat> {
        stat(self.pid).filter(|s| s.start_time == self.start_time)
    }

    /// The same process exists and is [alive](Stat::is_alive).
    pub fn is_alive(&self) -> bool {
        self.stat().is_some_and(|s| s.is_alive())
    }

    /// Sends `sig` if the pid still names the same process (false otherwise or on error).
    pub fn signal(&self, sig: Signal) -> bool {
        self.stat().is_some() && signal::kill(Pid::from_raw(self.pid), sig).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let line = "4242 (we ird) (x)) S 17 4242 4242 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 3 0 98765 1000 50";
        let s = parse_stat(line).expect("parses");
        assert_eq!(s.pid, 4242);
        assert_eq!(s.state, 'S');
        assert_eq!(s.ppid, 17);
        assert_eq!(s.pgid, 4242);
        assert_eq!(s.flags, 4194560);
        assert_eq!(s.start_time, 98765);
        assert!(s.is_alive());
        assert!(!s.is_exiting());
    }

    #[test]
    fn junk_and_truncated_lines_are_none() {
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("12 (x) S 1 1"), None);
        assert_eq!(
            parse_stat("abc (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 0 0 1 0 5"),
            None
        );
    }

    #[test]
    fn zombies_are_not_alive_but_exiting_processes_are() {
        let base = parse_stat("7 (z) Z 1 7 7 0 -1 4 0 0 0 0 0 0 0 0 20 0 1 0 5").unwrap();
        assert!(base.is_zombie() && !base.is_alive());
        let exiting = Stat {
            state: 'D',
            flags: PF_EXITING,
            ..base
        };
        assert!(exiting.is_alive() && exiting.is_exiting());
    }

    #[test]
    fn descendants_walk_the_tree_not_siblings() {
        let mk = |pid, ppid| Stat {
            pid,
            ppid,
            state: 'S',
            pgid: pid,
            flags: 0,
            start_time: 1,
        };
        let procs = [mk(10, 1), mk(11, 10), mk(12, 11), mk(13, 1), mk(14, 10)];
        let mut d: Vec<i32> = descendants_in(10, &procs).iter().map(|s| s.pid).collect();
        d.sort();
        assert_eq!(d, vec![11, 12, 14]);
    }

    #[test]
    fn a_real_child_is_pinned_alive_then_zombie_then_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as i32;
        let pinned = Pinned::pin(pid).expect("pin a running child");
        assert!(pinned.is_alive());
        assert!(tree(std::process::id() as i32).contains(&pid));
        assert!(pinned.signal(Signal::SIGKILL));
        // Not reaped yet: a zombie, hence not alive.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while pinned.is_alive() {
            assert!(
                std::time::Instant::now() < deadline,
                "SIGKILLed child still alive"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(pinned.stat().is_some_and(|s| s.is_zombie()));
        child.wait().unwrap();
        assert_eq!(pinned.stat(), None);
        assert!(
            !pinned.signal(Signal::SIGKILL),
            "a reaped pid is never signalled"
        );
    }
}
