//! Worker processes (tensor-parallel workers): the engine re-executes itself as
//! `fake-engine __worker <parent-pid> <detach 0|1> <claim-path|-> [<linger-ms>]`.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::unistd::{getppid, setsid, Pid};

use crate::cli::Args;

/// argv[1] of a worker.
pub const WORKER_ARG: &str = "__worker";

/// Set in a worker's environment by `--workers-close-lock-fds`.
const WORKER_CLOSE_ENV: &str = "FAKE_ENGINE_WORKER_CLOSES_LOCK_FDS";

/// Spawns `args.workers` workers of the engine `me`; returns their pids.
pub fn spawn_workers(args: &Args, me: u32) -> std::io::Result<Vec<u32>> {
    let exe = std::env::current_exe()?;
    let mut pids = Vec::new();
    for _ in 0..args.workers {
        let child = Command::new(&exe)
            .arg(WORKER_ARG)
            .arg(me.to_string())
            .arg(if args.detach_workers { "1" } else { "0" })
            // Informational: lets cleanup code recognise whose worker this is.
            .arg(args.gpu_claim.as_deref().unwrap_or(Path::new("-")))
            .arg(args.worker_linger.as_millis().to_string())
            .envs(
                args.workers_close_lock_fds
                    .then_some((WORKER_CLOSE_ENV, "1")),
            )
            .stdin(Stdio::null())
            .arg0("fake-engine-worker")
            .spawn()?;
        pids.push(child.id());
    }
    Ok(pids)
}

/// The worker: detached (own session, ignores SIGTERM), dying with the engine (PDEATHSIG),
/// or lingering `linger` after the engine's exit. Never returns.
pub fn worker_main(parent: i32, detach: bool, linger: Duration) -> ! {
    if std::env::var_os(WORKER_CLOSE_ENV).is_some() {
        for var in ["LOCKD_FD", "LOCKD_ANCHOR_FD"] {
            if let Some(fd) = std::env::var(var).ok().and_then(|v| v.parse::<i32>().ok()) {
                // A descriptor number this process inherited and never uses.
                let _ = nix::unistd::close(fd);
            }
        }
    }
    let parent = Pid::from_raw(parent);
    if detach {
        let _ = setsid();
        // SAFETY: SIG_IGN installs no handler code; single-threaded at this point.
        let _ = unsafe { signal(Signal::SIGTERM, SigHandler::SigIgn) };
    } else if linger.is_zero() {
        // Die with the engine, as vLLM's workers do.
        let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
        if getppid() != parent {
            exit_now();
        }
    } else {
        // Outlive the engine by `linger` (CUDA teardown after the parent is gone).
        wait_for_parent_exit(parent);
        std::thread::sleep(linger);
        exit_now();
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// `_exit(0)`: no destructors, no atexit handlers (the engine's inherited state untouched).
fn exit_now() -> ! {
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(0) }
}

/// Blocks until `parent` has exited: a pidfd on it (readable once it exits), or, where
/// pidfds are missing, polling getppid() every millisecond.
fn wait_for_parent_exit(parent: Pid) {
    // SAFETY: pidfd_open(2) with integer arguments; it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, parent.as_raw(), 0) } as i32;
    if fd >= 0 {
        // SAFETY: the descriptor was just returned to us and nothing else owns it.
        let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // Opened after the parent may have died: then getppid() already differs.
        if getppid() == parent {
            let b: BorrowedFd<'_> = owned.as_fd();
            let mut fds = [PollFd::new(b, PollFlags::POLLIN)];
            while poll(&mut fds, PollTimeout::NONE).is_err() {}
            return;
        }
    }
    while getppid() == parent {
        std::thread::sleep(Duration::from_millis(1));
    }
}
