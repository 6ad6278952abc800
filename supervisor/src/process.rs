//! Engine process lifecycle: spawn (own process group, PDEATHSIG, inherited lock fd), death
//! detection through a pidfd, and fencing by death (kill the whole tree, reap everything).
//!
//! The supervisor makes itself a child subreaper ([`become_subreaper`]), so every process the
//! engine spawns, even one that called setsid() and whose parent died, is reparented to the
//! supervisor and stays findable by walking `/proc` for descendants of our pid.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

/// Errors of process management.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// `prctl(PR_SET_CHILD_SUBREAPER)` failed.
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(#[source] io::Error),
    /// The engine command could not be started.
    #[error("cannot spawn engine {cmd:?}: {source}")]
    Spawn {
        /// argv[0].
        cmd: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `pidfd_open` failed (kernel older than 5.3?).
    #[error("pidfd_open({pid}) failed: {source}")]
    Pidfd {
        /// The engine pid.
        pid: i32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Entering a new PID namespace failed (not root / no CAP_SYS_ADMIN?).
    #[error("--pid-namespace: {step} failed: {source} (needs CAP_SYS_ADMIN, e.g. root)")]
    PidNamespace {
        /// Which call failed.
        step: &'static str,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// The command line was empty.
    #[error("no engine command given (use `-- CMD [ARGS...]`)")]
    EmptyCommand,
}

/// Make this process the reaper of its orphaned descendants.
pub fn become_subreaper() -> Result<(), ProcessError> {
    // SAFETY: plain prctl with integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if r != 0 {
        return Err(ProcessError::Subreaper(io::Error::last_os_error()));
    }
    Ok(())
}

/// What to spawn.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// argv (argv[0] looked up in PATH).
    pub argv: Vec<OsString>,
    /// Extra environment variables.
    pub env: Vec<(OsString, OsString)>,
    /// Run the engine as PID 1 of a new PID namespace (needs CAP_SYS_ADMIN).
    pub pid_namespace: bool,
}

/// A running (or exited but not yet reaped) engine.
#[derive(Debug)]
pub struct Engine {
    /// Engine pid, also its process group id.
    pub pid: i32,
    /// pidfd of the engine: readable once it has exited (it stays a zombie until we reap it).
    pidfd: AsyncFd<OwnedFd>,
    /// Exit status once reaped (text, for logs and `/state`).
    pub exit_status: Option<String>,
}

/// Spawn the engine in its own process group with `PR_SET_PDEATHSIG(SIGKILL)`.
///
/// `inherit` are fds that must be inherited by the engine (the lock connection's dup): they must
/// not have FD_CLOEXEC. Must be called from a thread that lives as long as the supervisor (the
/// main thread): PDEATHSIG fires when the *thread* that forked the child exits.
pub fn spawn_engine(spec: &EngineSpec, inherit: &[RawFd]) -> Result<Engine, ProcessError> {
    let (prog, args) = spec.argv.split_first().ok_or(ProcessError::EmptyCommand)?;
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .process_group(0);
    // A pidfd on ourselves lets the child check, after setting PDEATHSIG, that we did not die
    // in between (getppid() cannot tell inside a new PID namespace: it is always 0 there).
    let me = std::process::id() as i32;
    let self_pidfd = pidfd_open(me).map_err(|source| ProcessError::Pidfd { pid: me, source })?;
    let self_raw = self_pidfd.as_raw_fd();
    let keep: Vec<RawFd> = inherit.to_vec();
    // SAFETY: the closure runs between fork and exec; it only makes async-signal-safe syscalls
    // (prctl, poll, fcntl, _exit) and touches no locks or allocations (`keep` was allocated
    // before fork and is only read).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The supervisor may have died between fork and prctl: then nobody would kill us.
            let mut p = libc::pollfd {
                fd: self_raw,
                events: libc::POLLIN,
                revents: 0,
            };
            if libc::poll(&mut p, 1, 0) != 0 {
                libc::_exit(111);
            }
            for fd in keep.iter() {
                let flags = libc::fcntl(*fd, libc::F_GETFD);
                if flags >= 0 {
                    libc::fcntl(*fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                }
            }
            Ok(())
        });
    }
    let spawned = if spec.pid_namespace {
        spawn_in_new_pid_namespace(&mut cmd)
    } else {
        cmd.spawn()
    };
    drop(self_pidfd);
    let child = spawned.map_err(|source| match source.downcast::<ProcessError>() {
        Ok(e) => e,
        Err(source) => ProcessError::Spawn {
            cmd: prog.to_string_lossy().into_owned(),
            source,
        },
    })?;
    let pid = child.id() as i32;
    // We reap through waitpid ourselves; dropping std's Child does not kill or wait.
    drop(child);
    let pidfd = pidfd_open(pid).map_err(|source| ProcessError::Pidfd { pid, source })?;
    // SAFETY: `pidfd` is an OwnedFd moved into the AsyncFd, which owns it until dropped.
    let pidfd = unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
        .map_err(|e| ProcessError::Pidfd {
            pid,
            source: e.into(),
        })?;
    Ok(Engine {
        pid,
        pidfd,
        exit_status: None,
    })
}

/// Fork `cmd` as PID 1 of a new PID namespace: `unshare(CLONE_NEWPID)` on this thread makes its
/// next child the namespace's init; `setns` back to our own namespace right after, so that
/// nothing else this thread forks lands there.
fn spawn_in_new_pid_namespace(cmd: &mut Command) -> io::Result<std::process::Child> {
    let ns_err = |step, source| io::Error::other(ProcessError::PidNamespace { step, source });
    let own = std::fs::File::open("/proc/thread-self/ns/pid")
        .map_err(|e| ns_err("open /proc/thread-self/ns/pid", e))?;
    // SAFETY: unshare with a flag; affects only this thread's children.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        return Err(ns_err("unshare(CLONE_NEWPID)", io::Error::last_os_error()));
    }
    let child = cmd.spawn();
    // SAFETY: setns on an fd we own, back to our own (ancestor) PID namespace for children.
    if unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) } != 0 {
        let e = io::Error::last_os_error();
        tracing::error!(error = %e, "cannot restore the PID namespace for children");
    }
    child
}

/// Pin every process of the engine's tree with a pidfd, for lockd's process anchors: new
/// descendants of this process (the supervisor, a child subreaper, so every engine process is
/// one) since the last call, each pidfd checked to still name a process of the tree.
#[derive(Debug, Default)]
pub struct TreePins {
    /// Pids pinned and still in the tree at the last scan.
    pinned: HashSet<i32>,
}

impl TreePins {
    /// Scan the tree; return pidfds of the processes not seen before.
    pub fn scan(&mut self) -> Vec<(i32, OwnedFd)> {
        let me = std::process::id() as i32;
        let tree: HashSet<i32> = tree_pids().into_iter().collect();
        self.pinned.retain(|p| tree.contains(p));
        let mut out = Vec::new();
        for &pid in &tree {
            if self.pinned.contains(&pid) {
                continue;
            }
            let Ok(fd) = pidfd_open(pid) else { continue };
            // The pidfd pins whatever process has this pid now: make sure it is still ours
            // (a descendant's pid may have been recycled between the listing and the open).
            let ours = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parse_stat(&s))
                .is_some_and(|p| p.ppid == me || tree.contains(&p.ppid));
            if ours {
                self.pinned.insert(pid);
                out.push((pid, fd));
            }
        }
        out
    }
}

/// `pidfd_open(2)`: a descriptor that names `pid` for as long as it is held, readable once the
/// process has exited.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: raw syscall with integer arguments; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this fd and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl Engine {
    /// Resolves once the engine process has exited (it is not reaped: its pid, and so its
    /// process group id, stay reserved until [`fence`] reaps it). Cancel-safe.
    pub async fn exited(&self) {
        loop {
            match self.pidfd.readable().await {
                Ok(mut guard) => {
                    if poll_readable(self.pidfd.get_ref().as_raw_fd()) {
                        return;
                    }
                    guard.clear_ready();
                }
                // The reactor is gone: nothing more to wait for.
                Err(_) => return std::future::pending().await,
            }
        }
    }

    /// Exit status of the exited engine without reaping it (`?` if not known).
    pub fn peek_status(&self) -> String {
        // SAFETY: zeroed siginfo is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer; WNOWAIT leaves the zombie in place.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                self.pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: waitid filled the SIGCHLD member (si_pid is 0 if nothing was waitable).
        if r != 0 || unsafe { info.si_pid() } == 0 {
            return "?".into();
        }
        // SAFETY: as above.
        let status = unsafe { info.si_status() };
        match info.si_code {
            libc::CLD_EXITED => format!("exit {status}"),
            libc::CLD_KILLED | libc::CLD_DUMPED => format!("signal {status}"),
            c => format!("code {c} status {status}"),
        }
    }

    /// Non-blocking: has the engine exited?
    pub fn has_exited(&self) -> bool {
        self.exit_status.is_some() || poll_readable(self.pidfd.get_ref().as_raw_fd())
    }
}

fn poll_readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && (p.revents & libc::POLLIN) != 0
}

/// A forked child that holds a duplicate of the lock connection until the engine has exited.
///
/// The engine inherits the lock connection the supervisor had when it spawned the engine.
/// After lockd restarts, the client's new connection is held by the supervisor alone; were the
/// supervisor SIGKILLed then, lockd would release the lease while the engine may still live.
/// The keeper narrows that: it is not killed by the supervisor's death (fork clears
/// PDEATHSIG) and exits only once the engine's pidfd reports its exit. With
/// `--pid-namespace` the engine's exit is only reported once every process of its namespace
/// is gone, so the gap is closed; in the default mode, processes that outlive the engine
/// (detached workers) are not covered.
#[derive(Debug)]
pub struct Keeper {
    /// Keeper pid (a child of the supervisor, killed and reaped with the tree when fencing).
    pub pid: i32,
}

/// Fork a [`Keeper`] holding `conn` (and the engine's pidfd); see there.
pub fn spawn_keeper(conn: &OwnedFd, engine: &Engine) -> io::Result<Keeper> {
    let a = conn.as_raw_fd();
    let b = engine.pidfd.get_ref().as_raw_fd();
    let (lo, hi) = (a.min(b) as libc::c_uint, a.max(b) as libc::c_uint);
    let name = b"lock-keeper\0";
    // SAFETY: fork in a multi-threaded process; the child only makes async-signal-safe
    // syscalls (sigaction via signal, prctl, close_range, poll, _exit) on data prepared before.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: child side, see above.
        unsafe {
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGCHLD, libc::SIG_DFL);
            libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0);
            if lo > 3 {
                libc::syscall(
                    libc::SYS_close_range,
                    3 as libc::c_uint,
                    lo - 1,
                    0 as libc::c_uint,
                );
            }
            if hi > lo + 1 {
                libc::syscall(libc::SYS_close_range, lo + 1, hi - 1, 0 as libc::c_uint);
            }
            libc::syscall(
                libc::SYS_close_range,
                hi + 1,
                libc::c_uint::MAX,
                0 as libc::c_uint,
            );
            let mut p = libc::pollfd {
                fd: b,
                events: libc::POLLIN,
                revents: 0,
            };
            loop {
                let r = libc::poll(&mut p, 1, -1);
                if r > 0 || (r < 0 && *libc::__errno_location() != libc::EINTR) {
                    break;
                }
            }
            libc::_exit(0);
        }
    }
    Ok(Keeper { pid })
}

/// One process seen in `/proc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    /// Pid.
    pub pid: i32,
    /// Parent pid.
    pub ppid: i32,
    /// Process group id.
    pub pgid: i32,
    /// State letter (`R`, `S`, `D`, `Z`, ...).
    pub state: char,
}

/// Parse `/proc/PID/stat` (the command name may contain spaces and parentheses).
pub fn parse_stat(s: &str) -> Option<ProcInfo> {
    let pid = s.split_whitespace().next()?.parse().ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let mut it = rest.split_whitespace();
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    let pgid = it.next()?.parse().ok()?;
    Some(ProcInfo {
        pid,
        ppid,
        pgid,
        state,
    })
}

/// Every process currently in `/proc` (processes that vanish while we read are skipped).
pub fn all_processes() -> Vec<ProcInfo> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| parse_stat(&s))
        .collect()
}

/// Descendants of `root` (children, grandchildren, ...; `root` excluded), zombies included.
pub fn descendants_of(root: i32, procs: &[ProcInfo]) -> Vec<ProcInfo> {
    let mut children: HashMap<i32, Vec<ProcInfo>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(*p);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    let mut seen = HashSet::new();
    while let Some(p) = stack.pop() {
        if let Some(cs) = children.get(&p) {
            for c in cs {
                if seen.insert(c.pid) {
                    out.push(*c);
                    stack.push(c.pid);
                }
            }
        }
    }
    out
}

/// Live (non-zombie) descendants of this process.
pub fn live_descendants() -> Vec<ProcInfo> {
    let me = std::process::id() as i32;
    descendants_of(me, &all_processes())
        .into_iter()
        .filter(|p| p.state != 'Z' && p.state != 'X')
        .collect()
}

/// Pids listed in `/proc/PID/task/*/children` (None if the kernel lacks CONFIG_PROC_CHILDREN).
fn children_of(pid: i32) -> Option<Vec<i32>> {
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

/// Every descendant of this process (zombies included), cheaply: follows the
/// `/proc/PID/task/TID/children` lists from our own pid, so the cost is the size of our tree,
/// not of the machine's process table. These lists may miss a process that changes while they
/// are read, so callers never use an empty result as proof: [`has_children`] is the exact test.
/// Falls back to a full `/proc` scan without CONFIG_PROC_CHILDREN.
pub fn tree_pids() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![me];
    while let Some(p) = stack.pop() {
        match children_of(p) {
            Some(cs) => {
                for c in cs {
                    if seen.insert(c) {
                        out.push(c);
                        stack.push(c);
                    }
                }
            }
            // The process vanished (None for a pid that is not us): nothing below it.
            None if p != me => {}
            None => {
                return descendants_of(me, &all_processes())
                    .iter()
                    .map(|p| p.pid)
                    .collect()
            }
        }
    }
    out
}

/// Whether this process has any child at all (live or zombie), asked of the kernel itself. We
/// are a child subreaper, so every living descendant is a child or below one: no children
/// means no descendants, exactly.
pub fn has_children() -> bool {
    // SAFETY: zeroed siginfo is a valid out-parameter for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer; WNOWAIT|WNOHANG: reaps nothing, never blocks.
    let r = unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL,
        )
    };
    !(r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
}

/// Reap every zombie child except `keep` (the engine, whose exit the pidfd reports and whose
/// pid must stay reserved until fencing is done). Returns the reaped pids.
pub fn reap_orphans(keep: i32) -> Vec<i32> {
    let mut reaped = Vec::new();
    loop {
        // SAFETY: zeroed siginfo is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // Peek without reaping, so the engine's zombie is left alone.
        // SAFETY: valid pointer to siginfo_t.
        let r = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r != 0 {
            return reaped;
        }
        // SAFETY: waitid filled the union member for SIGCHLD.
        let pid = unsafe { info.si_pid() };
        if pid == 0 || pid == keep {
            return reaped;
        }
        let mut status = 0;
        // SAFETY: reaping a known zombie child.
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        reaped.push(pid);
    }
}

/// Reap every zombie child (engine included). Returns (pid, status text) pairs.
pub fn reap_all() -> Vec<(i32, String)> {
    let mut out = Vec::new();
    loop {
        let mut status = 0;
        // SAFETY: plain waitpid.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG | libc::__WALL) };
        if pid <= 0 {
            return out;
        }
        out.push((pid, describe_status(status)));
    }
}

/// `exit 3` / `signal 9` for a wait status.
pub fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exit {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("signal {}", libc::WTERMSIG(status))
    } else {
        format!("status {status}")
    }
}

/// What fencing did.
#[derive(Clone, Debug, Default)]
pub struct FenceReport {
    /// Wall time from the start of fencing until nothing was left.
    pub duration: Duration,
    /// Distinct processes signalled.
    pub signalled: usize,
    /// Whether SIGKILL had to be used (immediately when urgent, or after the grace period).
    pub escalated: bool,
    /// Processes reaped (engine included).
    pub reaped: usize,
    /// Engine exit status as reaped.
    pub engine_status: Option<String>,
    /// Live descendants when fencing started (with --pid-namespace and a dead engine: 0,
    /// the kernel already killed them).
    pub alive_at_start: usize,
    /// Every pid of the engine's tree seen while fencing (engine first), in the supervisor's
    /// PID namespace: the GPU memory-release check looks for them on the device.
    pub pids: Vec<i32>,
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with integer arguments; errors (ESRCH) are expected and ignored.
    unsafe { libc::kill(pid, sig) };
}

/// Fence by death: signal the engine's process group and every descendant of this process
/// (SIGTERM, then SIGKILL once `grace` has passed; SIGKILL at once when `urgent`), reap every
/// zombie, and repeat until the kernel says we have no child left (we are a child subreaper, so
/// that means no descendant is left anywhere). Only after this returns may the lock connection
/// be closed. Never gives up: a process stuck in uninterruptible sleep still holds the GPU, so
/// the lock must stay held (a warning is logged every second).
pub async fn fence(engine: &mut Engine, urgent: bool, grace: Duration) -> FenceReport {
    let start = Instant::now();
    let mut report = FenceReport::default();
    let mut sig = if urgent { libc::SIGKILL } else { libc::SIGTERM };
    report.escalated = urgent;
    let kill_at = start + grace;
    let mut signalled: HashSet<(i32, i32)> = HashSet::new();
    let mut last_warn = start;
    let mut tree = tree_pids();
    report.alive_at_start = tree.iter().filter(|p| is_live(**p)).count();
    let mut seen: Vec<i32> = vec![engine.pid];
    loop {
        for p in &tree {
            if !seen.contains(p) {
                seen.push(*p);
            }
        }
        // The group id stays reserved while the engine is unreaped; once reaped, a recycled
        // pid could name someone else's group, so the group is only signalled before that.
        if engine.exit_status.is_none() && signalled.insert((-engine.pid, sig)) {
            // SAFETY: killpg with integer arguments.
            unsafe { libc::killpg(engine.pid, sig) };
        }
        for p in &tree {
            if signalled.insert((*p, sig)) || sig == libc::SIGKILL {
                signal(*p, sig);
            }
        }
        for (pid, st) in reap_all() {
            report.reaped += 1;
            if pid == engine.pid {
                engine.exit_status = Some(st);
            }
        }
        if !has_children() {
            break;
        }
        let now = Instant::now();
        if sig == libc::SIGTERM && now >= kill_at {
            tracing::warn!(
                remaining = tree.len(),
                grace_ms = grace.as_millis() as u64,
                "engine tree still alive after grace period; sending SIGKILL"
            );
            sig = libc::SIGKILL;
            report.escalated = true;
        } else if now.duration_since(last_warn) >= Duration::from_secs(1) {
            last_warn = now;
            tracing::warn!(pids = ?tree, "still waiting for engine processes to die");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        tree = tree_pids();
    }
    report.signalled = signalled
        .iter()
        .map(|(p, _)| *p)
        .collect::<HashSet<_>>()
        .len();
    report.duration = start.elapsed();
    report.engine_status = engine.exit_status.clone();
    report.pids = seen;
    report
}

/// Is `pid` alive and not a zombie?
fn is_live(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| parse_stat(&s))
        .is_some_and(|p| p.state != 'Z' && p.state != 'X')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let p = parse_stat("1234 (a b) c)) S 77 1234 1234 0 -1 4194560 ...").unwrap();
        assert_eq!(
            p,
            ProcInfo {
                pid: 1234,
                ppid: 77,
                pgid: 1234,
                state: 'S'
            }
        );
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn tree_pins_pin_each_new_descendant_once() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as i32;
        let mut pins = TreePins::default();
        let first = pins.scan();
        let mine: Vec<&(i32, OwnedFd)> = first.iter().filter(|(p, _)| *p == pid).collect();
        assert_eq!(
            mine.len(),
            1,
            "pinned once: {:?}",
            first.iter().map(|x| x.0).collect::<Vec<_>>()
        );
        // The pidfd names that process: not readable while it lives.
        assert!(!poll_readable(mine[0].1.as_raw_fd()));
        assert!(pins.scan().iter().all(|(p, _)| *p != pid), "pinned twice");
        child.kill().expect("kill");
        child.wait().expect("reap");
        assert!(poll_readable(mine[0].1.as_raw_fd()), "exit reported");
        assert!(pins.scan().iter().all(|(p, _)| *p != pid));
        assert!(!pins.pinned.contains(&pid), "forgotten once gone");
    }

    #[test]
    fn descendants_walks_the_tree() {
        let p = |pid, ppid| ProcInfo {
            pid,
            ppid,
            pgid: pid,
            state: 'S',
        };
        let procs = vec![p(1, 0), p(10, 1), p(11, 10), p(12, 11), p(20, 1), p(13, 10)];
        let mut d: Vec<i32> = descendants_of(10, &procs).iter().map(|x| x.pid).collect();
        d.sort();
        assert_eq!(d, vec![11, 12, 13]);
    }
}
