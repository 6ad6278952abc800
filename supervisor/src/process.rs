//! Engine process lifecycle: spawn (own process group, PDEATHSIG, inherited lock fd), death
//! detection through a pidfd, and fencing by death (kill the whole tree, reap everything).
//!
//! The supervisor makes itself a child subreaper ([`become_subreaper`]), so every process the
//! engine spawns, even one that called setsid() and whose parent died, is reparented to the
//! supervisor and stays findable by walking `/proc` for descendants of our pid ([`procfs`]).
//!
//! System calls go through `nix`; raw `libc` is left only where nix has no wrapper
//! (`pidfd_open`, `close_range`) and in code that runs between `fork` and `exec`/`_exit`
//! (`pre_exec` closures, the lock keeper's child side), which must stay async-signal-safe.

use std::collections::HashSet;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{self, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;

/// How a process ended, as `wait` reported it. [`Display`](std::fmt::Display) gives the text
/// of logs and `/state.dead_reason` (`exit 3`, `signal 9`, `?`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEnd {
    /// It exited with this status.
    Exited(i32),
    /// It was killed by this signal number.
    Signaled(i32),
    /// Not known (not waitable yet, or a wait status that is neither of the above).
    Unknown,
}

impl From<WaitStatus> for ProcessEnd {
    fn from(w: WaitStatus) -> ProcessEnd {
        match w {
            WaitStatus::Exited(_, code) => ProcessEnd::Exited(code),
            WaitStatus::Signaled(_, sig, _) => ProcessEnd::Signaled(sig as i32),
            _ => ProcessEnd::Unknown,
        }
    }
}

impl std::fmt::Display for ProcessEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessEnd::Exited(c) => write!(f, "exit {c}"),
            ProcessEnd::Signaled(s) => write!(f, "signal {s}"),
            ProcessEnd::Unknown => f.write_str("?"),
        }
    }
}

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
    nix::sys::prctl::set_child_subreaper(true).map_err(|e| ProcessError::Subreaper(e.into()))
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
    /// How it ended, once reaped.
    pub exit_status: Option<ProcessEnd>,
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
    // Affects only this thread's children.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID)
        .map_err(|e| ns_err("unshare(CLONE_NEWPID)", e.into()))?;
    let child = cmd.spawn();
    // Back to our own (ancestor) PID namespace for children.
    if let Err(e) = nix::sched::setns(&own, nix::sched::CloneFlags::CLONE_NEWPID) {
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
        let tree: HashSet<i32> = procfs::tree(me).into_iter().collect();
        self.pinned.retain(|p| tree.contains(p));
        let mut out = Vec::new();
        for &pid in &tree {
            if self.pinned.contains(&pid) {
                continue;
            }
            let Ok(fd) = pidfd_open(pid) else { continue };
            // The pidfd pins whatever process has this pid now: make sure it is still ours
            // (a descendant's pid may have been recycled between the listing and the open).
            let ours = procfs::stat(pid).is_some_and(|p| p.ppid == me || tree.contains(&p.ppid));
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
    // libc: nix 0.29 has no pidfd_open wrapper.
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

    /// How the exited engine ended, without reaping it ([`ProcessEnd::Unknown`] if not known).
    pub fn peek_status(&self) -> ProcessEnd {
        // WNOWAIT leaves the zombie in place.
        match waitid(
            Id::Pid(Pid::from_raw(self.pid)),
            WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
        ) {
            Ok(w) => w.into(),
            Err(_) => ProcessEnd::Unknown,
        }
    }

    /// Non-blocking: has the engine exited?
    pub fn has_exited(&self) -> bool {
        self.exit_status.is_some() || poll_readable(self.pidfd.get_ref().as_raw_fd())
    }
}

fn poll_readable(fd: RawFd) -> bool {
    // SAFETY: `fd` is open for the duration of this call (callers own it).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    matches!(nix::poll::poll(&mut p, PollTimeout::ZERO), Ok(n) if n > 0)
        && p[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLIN))
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
    // libc, not nix: the child side runs between fork and _exit and must stay
    // async-signal-safe (as in a pre_exec closure); close_range has no nix wrapper.
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

/// Live (non-zombie) descendants of this process ([`procfs::live_descendants`]).
pub fn live_descendants() -> Vec<procfs::Stat> {
    procfs::live_descendants(std::process::id() as i32)
}

/// Every descendant of this process (zombies included), cheaply ([`procfs::tree`]: follows
/// the `/proc/PID/task/TID/children` lists, so the cost is the size of our tree). These lists
/// may miss a process that changes while they are read, so callers never use an empty result
/// as proof: [`has_children`] is the exact test.
pub fn tree_pids() -> Vec<i32> {
    procfs::tree(std::process::id() as i32)
}

/// Whether this process has any child at all (live or zombie), asked of the kernel itself. We
/// are a child subreaper, so every living descendant is a child or below one: no children
/// means no descendants, exactly.
pub fn has_children() -> bool {
    // WNOWAIT|WNOHANG: reaps nothing, never blocks.
    waitid(
        Id::All,
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT | WaitPidFlag::__WALL,
    ) != Err(Errno::ECHILD)
}

/// Reap every zombie child except `keep` (the engine, whose exit the pidfd reports and whose
/// pid must stay reserved until fencing is done). Returns the reaped pids.
pub fn reap_orphans(keep: i32) -> Vec<i32> {
    let mut reaped = Vec::new();
    loop {
        // Peek without reaping, so the engine's zombie is left alone.
        let Ok(w) = waitid(
            Id::All,
            WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
        ) else {
            return reaped;
        };
        let Some(pid) = w.pid().map(Pid::as_raw) else {
            return reaped;
        };
        if pid == keep {
            return reaped;
        }
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        reaped.push(pid);
    }
}

/// Reap every zombie child (engine included). Returns how each one ended.
pub fn reap_all() -> Vec<(i32, ProcessEnd)> {
    let mut out = Vec::new();
    loop {
        match waitpid(
            Pid::from_raw(-1),
            Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
        ) {
            Ok(w) => match w.pid() {
                Some(pid) => out.push((pid.as_raw(), w.into())),
                None => return out,
            },
            Err(_) => return out,
        }
    }
}

/// How a process ended, from a raw wait status (`exit 3` / `signal 9` when displayed).
pub fn describe_status(status: i32) -> ProcessEnd {
    WaitStatus::from_raw(Pid::from_raw(0), status).map_or(ProcessEnd::Unknown, Into::into)
}

/// What fencing did.
#[derive(Clone, Debug, Default)]
pub struct FenceReport {
    /// Wall time from the start of fencing until nothing was left.
    pub duration: Duration,
    /// Distinct processes signalled.
    pub signalled: usize,
    /// Whether SIGKILL had to be used (immediately when urgent, on what is left of the tree
    /// once a stopped engine's main process exited, or after the grace period).
    pub escalated: bool,
    /// Processes reaped (engine included).
    pub reaped: usize,
    /// How the engine ended, as reaped.
    pub engine_status: Option<ProcessEnd>,
    /// Live descendants when fencing started (with --pid-namespace and a dead engine: 0,
    /// the kernel already killed them).
    pub alive_at_start: usize,
    /// Every pid of the engine's tree seen while fencing (engine first), in the supervisor's
    /// PID namespace: the GPU memory-release check looks for them on the device.
    pub pids: Vec<i32>,
    /// When the engine's main process was reaped, from the start of fencing (None: it had
    /// been reaped before).
    pub engine_exited_after: Option<Duration>,
    /// How long a Python resource tracker outlived the rest of the tree while it cleaned up
    /// (None: the tree had none).
    pub tracker_alone: Option<Duration>,
}

fn signal(pid: i32, sig: Signal) {
    // Errors (ESRCH) are expected and ignored.
    let _ = signal::kill(Pid::from_raw(pid), sig);
}

/// How long a stopped engine's main process may outlive the rest of its tree (trackers
/// aside) before it is SIGKILLed. vLLM's API server kills its EngineCore and workers itself
/// when stopped, then may wait for ever for a client whose stream its dead EngineCore will
/// never finish; it has nothing left to serve or drain (a drain keeps the EngineCore alive).
const MAIN_ALONE_GRACE: Duration = Duration::from_millis(500);

/// How long a fence waits for a Python resource tracker to clean up and exit by itself once
/// every other process of the tree is gone.
const TRACKER_GRACE: Duration = Duration::from_secs(1);

/// Whether `pid` is Python multiprocessing's resource tracker (Lib/multiprocessing/
/// resource_tracker.py, started as `python -c 'from multiprocessing.resource_tracker import
/// main;main(FD)'`): it holds no device memory and cleans up what the tree registered with it.
fn is_resource_tracker(pid: i32) -> bool {
    is_resource_tracker_cmdline(&procfs::cmdline(pid))
}

fn is_resource_tracker_cmdline(cmdline: &str) -> bool {
    cmdline.contains("from multiprocessing.resource_tracker import main")
}

/// Which processes a fence signals, and with what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// SIGTERM to the engine's main process alone, until it exits or the grace ends. vLLM's
    /// API server shuts its EngineCore and workers down itself and answers or aborts the
    /// requests it has open; signalled together with them, it instead waits for client
    /// connections that its dead EngineCore can never finish, until the SIGKILL at the grace.
    Main,
    /// SIGKILL to the process group and every descendant.
    Kill,
}

/// Python resource trackers among the tree's processes, and since when they alone are left.
#[derive(Debug, Default)]
struct Trackers {
    seen: bool,
    alone_since: Option<Instant>,
}

impl Trackers {
    /// Split `tree` into (resource trackers, the rest), noting when the rest is all dead.
    fn split(&mut self, tree: &[i32]) -> (Vec<i32>, Vec<i32>) {
        let (trackers, rest): (Vec<i32>, Vec<i32>) =
            tree.iter().partition(|p| is_resource_tracker(**p));
        self.seen |= !trackers.is_empty();
        if self.alone_since.is_none() && !rest.iter().any(|p| procfs::alive(*p)) {
            self.alone_since = Some(Instant::now());
        }
        (trackers, rest)
    }

    /// Whether a tracker is still spared a SIGKILL: while other processes of the tree live
    /// (it cleans up only once every process holding its pipe is gone), then for at most
    /// [`TRACKER_GRACE`].
    fn spare(&self) -> bool {
        #[cfg(any(debug_assertions, feature = "planted-bugs"))]
        if crate::fault::planted_bug_kill_tracker() {
            return false;
        }
        self.alone_since.is_none_or(|t| t.elapsed() < TRACKER_GRACE)
    }
}

/// Whether a stopped engine's main process has outlived the rest of its tree (Python's
/// resource trackers aside) by [`MAIN_ALONE_GRACE`]. Only a tree that had other processes when
/// the fence began qualifies: a single-process engine may drain as long as the grace allows.
#[derive(Debug)]
struct MainAlone {
    main: i32,
    had_others: bool,
    since: Option<Instant>,
}

impl MainAlone {
    fn new(main: i32, tree: &[i32]) -> MainAlone {
        MainAlone {
            main,
            had_others: Self::others_alive(main, tree),
            since: None,
        }
    }

    fn others_alive(main: i32, tree: &[i32]) -> bool {
        tree.iter()
            .any(|p| *p != main && procfs::alive(*p) && !is_resource_tracker(*p))
    }

    fn overdue(&mut self, tree: &[i32], now: Instant) -> bool {
        if !self.had_others || Self::others_alive(self.main, tree) {
            self.since = None;
            return false;
        }
        now.duration_since(*self.since.get_or_insert(now)) >= MAIN_ALONE_GRACE
    }
}

/// One round of signals for `stage`. Python's resource trackers are spared a SIGKILL while
/// [`Trackers::spare`] says so (a tracker ignores SIGTERM and unlinks the shared memory and
/// semaphores registered with it at end-of-file of its pipe; a SIGKILL would leave them in
/// /dev/shm), and the process group, which holds them, is then not signalled.
fn send(
    stage: Stage,
    engine: &Engine,
    tree: &[i32],
    trackers: &mut Trackers,
    signalled: &mut HashSet<(i32, Signal)>,
) {
    match stage {
        Stage::Main => {
            if engine.exit_status.is_none() && signalled.insert((engine.pid, Signal::SIGTERM)) {
                signal(engine.pid, Signal::SIGTERM);
            }
        }
        Stage::Kill => {
            let (spared, rest) = trackers.split(tree);
            let spare = trackers.spare() && !spared.is_empty();
            // The group id stays reserved while the engine is unreaped; once reaped, a
            // recycled pid could name someone else's group, so the group is only signalled
            // before that.
            if !spare && engine.exit_status.is_none() {
                signalled.insert((-engine.pid, Signal::SIGKILL));
                let _ = signal::killpg(Pid::from_raw(engine.pid), Signal::SIGKILL);
            }
            let targets = if spare { &rest[..] } else { tree };
            for p in targets {
                signalled.insert((*p, Signal::SIGKILL));
                signal(*p, Signal::SIGKILL);
            }
        }
    }
}

/// Fence by death. A stop (`urgent` false): SIGTERM to the engine's main process first; once
/// it has exited, SIGKILL to what is left of the tree; SIGKILL to everything once `grace` has
/// passed. Urgent: SIGKILL to the process group and every descendant of this process at once.
/// Reaps every zombie and repeats until the kernel says we have no child left (we are a child
/// subreaper, so that means no descendant is left anywhere). Only after this returns may the
/// lock connection be closed. Never gives up: a process stuck in uninterruptible sleep still
/// holds the GPU, so the lock must stay held (a warning is logged every second).
pub async fn fence(engine: &mut Engine, urgent: bool, grace: Duration) -> FenceReport {
    let start = Instant::now();
    let mut report = FenceReport {
        escalated: urgent,
        ..FenceReport::default()
    };
    let mut stage = if urgent || engine.has_exited() {
        Stage::Kill
    } else {
        Stage::Main
    };
    let kill_at = start + grace;
    let mut signalled: HashSet<(i32, Signal)> = HashSet::new();
    let mut trackers = Trackers::default();
    let mut last_warn = start;
    let mut tree = tree_pids();
    report.alive_at_start = tree.iter().filter(|p| procfs::alive(**p)).count();
    let mut seen: Vec<i32> = vec![engine.pid];
    let mut main_alone = MainAlone::new(engine.pid, &tree);
    loop {
        for p in &tree {
            if !seen.contains(p) {
                seen.push(*p);
            }
        }
        send(stage, engine, &tree, &mut trackers, &mut signalled);
        for (pid, st) in reap_all() {
            report.reaped += 1;
            if pid == engine.pid {
                engine.exit_status = Some(st);
                report.engine_exited_after = Some(start.elapsed());
            }
        }
        if !has_children() {
            break;
        }
        // Descendants forked since the last look are signalled in the next round.
        tree = tree_pids();
        let now = Instant::now();
        if stage == Stage::Main && engine.exit_status.is_some() {
            // The main process has shut down (and its own children, if it takes care of
            // them): what is left is a straggler that can only delay the handover, e.g. a
            // detached worker that ignores SIGTERM and would cost the whole grace.
            stage = Stage::Kill;
            report.escalated = true;
            tracing::info!(pids = ?tree, "engine's main process exited; killing what is left of its tree");
            continue;
        }
        if stage == Stage::Main && main_alone.overdue(&tree, now) {
            tracing::warn!(
                after_ms = MAIN_ALONE_GRACE.as_millis() as u64,
                "the engine's main process outlived the rest of its tree; killing it"
            );
            stage = Stage::Kill;
            report.escalated = true;
            continue;
        }
        if stage == Stage::Main && now >= kill_at {
            tracing::warn!(
                remaining = tree.len(),
                grace_ms = grace.as_millis() as u64,
                "engine still alive after grace period; sending SIGKILL"
            );
            stage = Stage::Kill;
            report.escalated = true;
        } else if now.duration_since(last_warn) >= Duration::from_secs(1) {
            last_warn = now;
            tracing::warn!(pids = ?tree, main_first = stage == Stage::Main, "still waiting for engine processes to die");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    report.signalled = signalled
        .iter()
        .map(|(p, _)| *p)
        .collect::<HashSet<_>>()
        .len();
    report.duration = start.elapsed();
    report.tracker_alone = trackers
        .alone_since
        .filter(|_| trackers.seen)
        .map(|t| t.elapsed());
    report.engine_status = engine.exit_status;
    report.pids = seen;
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_ends_read_as_before() {
        assert_eq!(ProcessEnd::Exited(3).to_string(), "exit 3");
        assert_eq!(ProcessEnd::Signaled(9).to_string(), "signal 9");
        assert_eq!(ProcessEnd::Unknown.to_string(), "?");
        // Raw wait statuses: exit 3 is 3 << 8, SIGKILL is 9.
        assert_eq!(describe_status(3 << 8), ProcessEnd::Exited(3));
        assert_eq!(describe_status(9), ProcessEnd::Signaled(9));
    }

    #[test]
    fn resource_trackers_are_recognised_by_their_command_line() {
        assert!(is_resource_tracker_cmdline(
            "/venv/bin/python -B -c from multiprocessing.resource_tracker import main;main(32)"
        ));
        assert!(!is_resource_tracker_cmdline("VLLM::EngineCore"));
        assert!(!is_resource_tracker_cmdline(""));
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
}
