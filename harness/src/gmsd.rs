//! The one way to start `gmsd` (the GPU Memory Service server) in tests.
//!
//! * [`GmsdSpec`]: socket, backend, log filter, extra flags; [`GmsdSpec::command`] gives a
//!   [`std::process::Command`].
//! * [`wait_ready`]: the readiness probe (the socket accepts a connection).
//! * [`Gmsd`]: a synchronous owner: own process group, log next to the socket (appended across
//!   restarts), SIGKILLed and reaped on drop; [`state`](Gmsd::state) and
//!   [`load`](Gmsd::load) through the real `gmsctl`.

use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::bins::{bin, HarnessError};
use crate::proc::Proc;

/// Why a gmsd could not be started.
#[derive(Debug, thiserror::Error)]
pub enum GmsdError {
    /// A workspace binary is missing from the target dir ([`crate::bins::bin`]).
    #[error(transparent)]
    Bin(#[from] HarnessError),
    /// gmsd exited while we waited for its socket.
    #[error("gmsd exited at start ({status}); log:\n{log}")]
    Exited {
        /// Its exit status.
        status: ExitStatus,
        /// Its log so far.
        log: String,
    },
    /// The socket did not accept a connection in time.
    #[error("gmsd on {socket} did not accept a connection within {timeout:?}")]
    NotReady {
        /// The socket.
        socket: PathBuf,
        /// The bound.
        timeout: Duration,
    },
    /// I/O failure (spawn).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What `gmsd` to start.
#[derive(Clone, Debug)]
pub struct GmsdSpec {
    socket: PathBuf,
    backend: Option<String>,
    log_filter: Option<String>,
    extra: Vec<OsString>,
    bin: Option<PathBuf>,
}

impl GmsdSpec {
    /// A gmsd serving on `socket` (its log goes to the same path with extension `log`).
    pub fn new(socket: impl Into<PathBuf>) -> GmsdSpec {
        GmsdSpec {
            socket: socket.into(),
            backend: None,
            log_filter: None,
            extra: Vec::new(),
            bin: None,
        }
    }

    /// `--backend` (`host`: memfd, no GPU; `cuda`). gmsd's default when unset: `host`.
    pub fn backend(mut self, b: impl Into<String>) -> GmsdSpec {
        self.backend = Some(b.into());
        self
    }

    /// `RUST_LOG` for gmsd (e.g. `debug`).
    pub fn log_filter(mut self, f: impl Into<String>) -> GmsdSpec {
        self.log_filter = Some(f.into());
        self
    }

    /// More gmsd flags.
    pub fn args<I, S>(mut self, args: I) -> GmsdSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// The `gmsd` binary [`Gmsd`] runs (default: next to the running executable); `gmsctl` is
    /// looked for next to it.
    pub fn bin(mut self, path: impl Into<PathBuf>) -> GmsdSpec {
        self.bin = Some(path.into());
        self
    }

    /// The socket.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// `BIN --socket SOCKET [--backend B] EXTRA...`, with every `GMSD_*` variable of the
    /// caller's environment removed and `RUST_LOG` set if a filter was given. Stdio and the
    /// process group are left to the caller.
    pub fn command(&self, bin: &Path) -> Command {
        let mut c = Command::new(bin);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("GMSD_") {
                c.env_remove(k);
            }
        }
        c.arg("--socket").arg(&self.socket);
        if let Some(b) = &self.backend {
            c.arg("--backend").arg(b);
        }
        c.args(&self.extra);
        if let Some(f) = &self.log_filter {
            c.env("RUST_LOG", f);
        }
        c
    }
}

/// Readiness probe: polls every 10 ms until `socket` accepts a connection, or `timeout`.
pub fn wait_ready(socket: &Path, timeout: Duration) -> Result<(), GmsdError> {
    wait_ready_or(socket, timeout, || None)
}

fn wait_ready_or(
    socket: &Path,
    timeout: Duration,
    mut exited: impl FnMut() -> Option<GmsdError>,
) -> Result<(), GmsdError> {
    let end = Instant::now() + timeout;
    loop {
        if UnixStream::connect(socket).is_ok() {
            return Ok(());
        }
        if let Some(e) = exited() {
            return Err(e);
        }
        if Instant::now() >= end {
            return Err(GmsdError::NotReady {
                socket: socket.to_path_buf(),
                timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A `gmsd` owned by a test: own process group, log at `SOCKET.log` (extension replaced),
/// SIGKILLed and reaped on drop. gmsd keeps nothing across restarts.
#[derive(Debug)]
pub struct Gmsd {
    spec: GmsdSpec,
    bin: PathBuf,
    log: PathBuf,
    /// The running (or exited, not yet restarted) gmsd.
    proc: Option<Proc>,
}

impl Gmsd {
    /// Starts `spec` and waits until its socket accepts connections; panics (with the log)
    /// otherwise.
    pub fn start(spec: GmsdSpec) -> Gmsd {
        Gmsd::try_start(spec).unwrap_or_else(|e| panic!("cannot start gmsd: {e}"))
    }

    /// [`start`](Self::start) returning the error.
    pub fn try_start(spec: GmsdSpec) -> Result<Gmsd, GmsdError> {
        let bin = match &spec.bin {
            Some(b) => b.clone(),
            None => bin("gmsd")?,
        };
        let mut g = Gmsd {
            log: spec.socket.with_extension("log"),
            spec,
            bin,
            proc: None,
        };
        g.try_restart()?;
        Ok(g)
    }

    /// (Re)starts gmsd (killing the running one first) and waits for its socket; panics
    /// otherwise.
    pub fn restart(&mut self) {
        if let Err(e) = self.try_restart() {
            panic!("cannot restart gmsd: {e}");
        }
    }

    /// [`restart`](Self::restart) returning the error.
    pub fn try_restart(&mut self) -> Result<(), GmsdError> {
        self.kill();
        let c = self.spec.command(&self.bin);
        let proc = Proc::try_spawn_appending("gmsd", c, self.log.clone())?;
        let proc = self.proc.insert(proc);
        let log = self.log.clone();
        wait_ready_or(&self.spec.socket, Duration::from_secs(10), || {
            proc.wait_exit(Duration::ZERO)
                .map(|status| GmsdError::Exited {
                    status,
                    log: std::fs::read_to_string(&log).unwrap_or_default(),
                })
        })
    }

    /// SIGKILLs gmsd's process group and reaps it (its socket file is left behind, as after a
    /// crash).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Sends `sig` to gmsd (not its group); false if it is not running.
    pub fn signal(&self, sig: Signal) -> bool {
        self.proc.as_ref().is_some_and(|p| p.signal(sig))
    }

    /// Waits up to `timeout` for gmsd to exit; its status once it has.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.proc.as_mut()?.wait_exit(timeout)
    }

    /// Pid (also the process group id) of the running gmsd.
    pub fn pid(&self) -> Option<i32> {
        self.proc
            .as_ref()
            .filter(|p| p.exit_status().is_none())
            .map(Proc::pid)
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.spec.socket
    }

    /// Its log (every start).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn gmsctl(&self) -> PathBuf {
        self.bin.with_file_name("gmsctl")
    }

    /// `gmsctl state` as JSON (`None` if it does not answer within 1 s).
    pub fn state(&self) -> Option<serde_json::Value> {
        let out = Command::new(self.gmsctl())
            .arg("state")
            .arg("--socket")
            .arg(&self.spec.socket)
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

    /// Loads and commits `count` allocations of 2 MiB with `gmsctl load` (a real writer);
    /// panics with gmsctl's output if it fails.
    pub fn load(&self, count: u32) {
        let out = Command::new(self.gmsctl())
            .arg("load")
            .arg("--socket")
            .arg(&self.spec.socket)
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
}

impl Drop for Gmsd {
    fn drop(&mut self) {
        self.kill();
    }
}
