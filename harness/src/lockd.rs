//! The one way to start `lockd serve` in this workspace's tests, benchmarks and the drill.
//!
//! * [`LockdSpec`]: what to start (state dir, socket, optional TCP listener, reconnect window,
//!   metrics address, log format, extra flags). [`LockdSpec::command`] turns it into a
//!   [`std::process::Command`] any caller can run (the async drill wraps it in
//!   `tokio::process::Command::from`).
//! * [`wait_ready`]: the readiness probe (a `status` round trip on the socket).
//! * [`Lockd`]: a synchronous owner for tests and benches: its own process group, a log file
//!   kept across restarts, SIGKILLed and reaped on drop; start / restart / kill, typed
//!   [`status`](Lockd::status), [`holder`](Lockd::holder), [`revoke`](Lockd::revoke),
//!   [`log_text`](Lockd::log_text).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ::lockd::proto::{decode_event, encode_request, Event, Request, StatusReport};
use nix::sys::signal::Signal;

use crate::bins::{bin, HarnessError};
use crate::proc::Proc;

/// Why a lockd could not be started or asked something.
#[derive(Debug, thiserror::Error)]
pub enum LockdError {
    /// A workspace binary is missing from the target dir ([`crate::bins::bin`]).
    #[error(transparent)]
    Bin(#[from] HarnessError),
    /// lockd exited while we waited for it to answer.
    #[error("lockd exited at start ({status}); log:\n{log}")]
    Exited {
        /// Its exit status.
        status: ExitStatus,
        /// Its log so far.
        log: String,
    },
    /// lockd did not answer `status` in time.
    #[error("lockd on {socket} did not answer within {timeout:?} (last error: {last})")]
    NotReady {
        /// The socket asked.
        socket: PathBuf,
        /// The bound.
        timeout: Duration,
        /// The last failure seen.
        last: String,
    },
    /// lockd answered something that is not the expected event.
    #[error("unexpected answer from lockd: {0}")]
    Protocol(String),
    /// I/O failure (spawn, connect, read).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// `--log-format` of `lockd serve`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (lockd's default).
    Text,
    /// One JSON object per line.
    Json,
}

/// What `lockd serve` to start. Socket and state file default to `DIR/lockd.sock` and
/// `DIR/lockd.state`; the owner [`Lockd`] logs to `DIR/lockd.log`.
#[derive(Clone, Debug)]
pub struct LockdSpec {
    dir: PathBuf,
    socket: PathBuf,
    state: PathBuf,
    tcp: Vec<String>,
    reconnect_window: Option<Duration>,
    metrics: Option<String>,
    log_format: Option<LogFormat>,
    log_filter: Option<String>,
    extra: Vec<OsString>,
    bin: Option<PathBuf>,
    inherit_env: bool,
    env: Vec<(OsString, OsString)>,
}

impl LockdSpec {
    /// A lockd whose socket, state file and log live in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> LockdSpec {
        let dir = dir.into();
        LockdSpec {
            socket: dir.join("lockd.sock"),
            state: dir.join("lockd.state"),
            dir,
            tcp: Vec::new(),
            reconnect_window: None,
            metrics: None,
            log_format: None,
            log_filter: None,
            extra: Vec::new(),
            bin: None,
            inherit_env: false,
            env: Vec::new(),
        }
    }

    /// Set this variable in lockd's environment (after the `LOCKD_*` clean-up), e.g. a
    /// test-only planted-bug switch.
    pub fn env(mut self, k: impl Into<OsString>, v: impl Into<OsString>) -> LockdSpec {
        self.env.push((k.into(), v.into()));
        self
    }

    /// Listen on this Unix socket (default `DIR/lockd.sock`).
    pub fn socket(mut self, path: impl Into<PathBuf>) -> LockdSpec {
        self.socket = path.into();
        self
    }

    /// Keep state in this file (default `DIR/lockd.state`).
    pub fn state(mut self, path: impl Into<PathBuf>) -> LockdSpec {
        self.state = path.into();
        self
    }

    /// Also listen on TCP `HOST:PORT` (port 0: an ephemeral port, see
    /// [`Lockd::logged_tcp_port`]).
    pub fn tcp(mut self, addr: impl Into<String>) -> LockdSpec {
        self.tcp.push(addr.into());
        self
    }

    /// `--reconnect-window` (lockd's default when unset: 10 s).
    pub fn reconnect_window(mut self, d: Duration) -> LockdSpec {
        self.reconnect_window = Some(d);
        self
    }

    /// `--metrics HOST:PORT` (Prometheus `/metrics`).
    pub fn metrics(mut self, addr: impl Into<String>) -> LockdSpec {
        self.metrics = Some(addr.into());
        self
    }

    /// `--log-format`.
    pub fn log_format(mut self, f: LogFormat) -> LockdSpec {
        self.log_format = Some(f);
        self
    }

    /// `LOCKD_LOG` (a tracing filter such as `info` or `lockd=debug`).
    pub fn log_filter(mut self, filter: impl Into<String>) -> LockdSpec {
        self.log_filter = Some(filter.into());
        self
    }

    /// One more `lockd serve` flag, appended after the ones above.
    pub fn arg(mut self, a: impl Into<OsString>) -> LockdSpec {
        self.extra.push(a.into());
        self
    }

    /// More `lockd serve` flags, appended after the ones above.
    pub fn args<I, S>(mut self, args: I) -> LockdSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// Keep the caller's `LOCKD_*` environment variables in [`command`](Self::command)
    /// (default: removed, the spec is the whole configuration). For the drill, whose lockd
    /// an operator may configure through them.
    pub fn inherit_lockd_env(mut self) -> LockdSpec {
        self.inherit_env = true;
        self
    }

    /// The `lockd` binary [`Lockd`] runs (default: `lockd` next to the running executable,
    /// `target/<profile>/lockd`).
    pub fn bin(mut self, path: impl Into<PathBuf>) -> LockdSpec {
        self.bin = Some(path.into());
        self
    }

    /// The directory of socket, state and log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The Unix socket.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The state file.
    pub fn state_path(&self) -> &Path {
        &self.state
    }

    /// `unix:SOCKET`, the endpoint clients connect to.
    pub fn endpoint(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    /// The command line `BIN serve --listen unix:SOCKET [--listen tcp:ADDR]... --state STATE
    /// [--reconnect-window W] [--metrics ADDR] [--log-format F] EXTRA...`.
    ///
    /// Every `LOCKD_*` variable of the caller's environment is removed (the spec is the whole
    /// configuration) unless [`inherit_lockd_env`](Self::inherit_lockd_env), then `LOCKD_LOG`
    /// is set if [`log_filter`](Self::log_filter) was given. The reconnect window is written
    /// in whole milliseconds, or in nanoseconds when it is not a whole number of them.
    /// Stdio and the process group are left to the caller.
    pub fn command(&self, bin: &Path) -> Command {
        let mut c = Command::new(bin);
        if !self.inherit_env {
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("LOCKD_") {
                    c.env_remove(k);
                }
            }
        }
        if let Some(f) = self.log_format {
            c.arg("--log-format").arg(match f {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            });
        }
        c.arg("serve").arg("--listen").arg(self.endpoint());
        for t in &self.tcp {
            c.arg("--listen").arg(format!("tcp:{t}"));
        }
        c.arg("--state").arg(&self.state);
        if let Some(w) = self.reconnect_window {
            let w = if w.subsec_nanos() % 1_000_000 == 0 {
                format!("{}ms", w.as_millis())
            } else {
                format!("{}ns", w.as_nanos())
            };
            c.arg("--reconnect-window").arg(w);
        }
        if let Some(m) = &self.metrics {
            c.arg("--metrics").arg(m);
        }
        c.args(&self.extra);
        if let Some(f) = &self.log_filter {
            c.env("LOCKD_LOG", f);
        }
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }
}

/// The raw `status` event line of the lockd on `socket` (one round trip, bounded by `timeout`).
pub fn status_line(socket: &Path, timeout: Duration) -> Result<String, LockdError> {
    let s = UnixStream::connect(socket)?;
    let t = Some(timeout.max(Duration::from_millis(1)));
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)?;
    let mut w = s.try_clone()?;
    w.write_all(encode_request(&Request::Status { sessions: None }).as_bytes())?;
    let mut r = BufReader::new(s);
    let end = Instant::now() + timeout;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err(LockdError::Protocol(
                "connection closed before status".into(),
            ));
        }
        match decode_event(line.as_bytes()) {
            Ok(Event::Status(_)) => return Ok(line),
            Ok(Event::Error { code, message, .. }) => {
                return Err(LockdError::Protocol(format!("{code}: {message}")))
            }
            Ok(_) => {}
            Err(e) => return Err(LockdError::Protocol(format!("{e}: {line:?}"))),
        }
        if Instant::now() > end {
            return Err(LockdError::Protocol("no status event in time".into()));
        }
    }
}

/// The typed `status` of the lockd on `socket` (one round trip, bounded by `timeout`).
pub fn status_at(socket: &Path, timeout: Duration) -> Result<StatusReport, LockdError> {
    let line = status_line(socket, timeout)?;
    match decode_event(line.as_bytes()) {
        Ok(Event::Status(r)) => Ok(*r),
        other => Err(LockdError::Protocol(format!("{other:?}"))),
    }
}

/// Readiness probe: polls `status` on `socket` every 5 ms until lockd answers (its first
/// status), or fails after `timeout` with the last error.
pub fn wait_ready(socket: &Path, timeout: Duration) -> Result<StatusReport, LockdError> {
    wait_ready_or(socket, timeout, || None)
}

/// [`wait_ready`] that also stops early when `exited` reports the process gone.
fn wait_ready_or(
    socket: &Path,
    timeout: Duration,
    mut exited: impl FnMut() -> Option<LockdError>,
) -> Result<StatusReport, LockdError> {
    let end = Instant::now() + timeout;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let last = match status_at(socket, left.min(Duration::from_secs(2))) {
            Ok(r) => return Ok(r),
            Err(e) => e,
        };
        if let Some(e) = exited() {
            return Err(e);
        }
        if Instant::now() >= end {
            return Err(LockdError::NotReady {
                socket: socket.to_path_buf(),
                timeout,
                last: last.to_string(),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How long [`Lockd::start`] / [`Lockd::restart`] wait for lockd to answer.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A `lockd serve` owned by a test or bench: in its own process group, logging (stdout and
/// stderr, appended across restarts) to `DIR/lockd.log`, SIGKILLed and reaped on drop.
#[derive(Debug)]
pub struct Lockd {
    spec: LockdSpec,
    bin: PathBuf,
    log: PathBuf,
    /// The running (or exited, not yet restarted) `lockd serve`.
    proc: Option<Proc>,
    /// Length of the log when the current process started.
    log_start: u64,
    _tmp: Option<tempfile::TempDir>,
}

impl Lockd {
    /// Starts `spec` and waits until it answers `status`; panics (with its log) otherwise.
    pub fn start(spec: LockdSpec) -> Lockd {
        Lockd::try_start(spec).unwrap_or_else(|e| panic!("cannot start lockd: {e}"))
    }

    /// Starts a lockd in a fresh temporary directory of its own (removed on drop), configured
    /// by `f`.
    pub fn start_temp(f: impl FnOnce(LockdSpec) -> LockdSpec) -> Lockd {
        let tmp = tempfile::Builder::new()
            .prefix("lockd-")
            .tempdir()
            .expect("temp dir");
        let mut l = Lockd::start(f(LockdSpec::new(tmp.path())));
        l._tmp = Some(tmp);
        l
    }

    /// [`start`](Self::start) returning the error instead of panicking.
    pub fn try_start(spec: LockdSpec) -> Result<Lockd, LockdError> {
        let bin = match &spec.bin {
            Some(b) => b.clone(),
            None => bin("lockd")?,
        };
        let mut l = Lockd {
            log: spec.dir.join("lockd.log"),
            spec,
            bin,
            proc: None,
            log_start: 0,
            _tmp: None,
        };
        l.try_restart()?;
        Ok(l)
    }

    /// This lockd's command line, stdio to its log (for tests that expect it to fail, or
    /// that start a second one on the same files).
    pub fn command(&self) -> Command {
        let mut c = self.spec.command(&self.bin);
        c.stdin(Stdio::null());
        if let Ok(f) = self.open_log() {
            if let Ok(f2) = f.try_clone() {
                c.stdout(f).stderr(f2);
            }
        }
        c
    }

    fn open_log(&self) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
    }

    /// (Re)starts lockd on the same socket and state file (killing the running one first, if
    /// any) and waits until it answers; panics (with the log) otherwise.
    pub fn restart(&mut self) {
        if let Err(e) = self.try_restart() {
            panic!("cannot restart lockd: {e}");
        }
    }

    /// [`restart`](Self::restart) returning the error instead of panicking.
    pub fn try_restart(&mut self) -> Result<(), LockdError> {
        self.kill();
        self.log_start = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        let proc = Proc::try_spawn_appending("lockd", self.command(), self.log.clone())?;
        let proc = self.proc.insert(proc);
        let socket = self.spec.socket.clone();
        let log = self.log.clone();
        wait_ready_or(&socket, READY_TIMEOUT, || {
            proc.wait_exit(Duration::ZERO)
                .map(|status| LockdError::Exited {
                    status,
                    log: std::fs::read_to_string(&log).unwrap_or_default(),
                })
        })
        .map(|_| ())
        .map_err(|e| match e {
            LockdError::NotReady { .. } => LockdError::Protocol(format!(
                "{e}; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )),
            e => e,
        })
    }

    /// SIGKILLs lockd's process group and reaps it (no-op when not running).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Sends `sig` to the lockd process (not its group); false if it is not running.
    pub fn signal(&self, sig: Signal) -> bool {
        self.proc.as_ref().is_some_and(|p| p.signal(sig))
    }

    /// Waits up to `timeout` for lockd to exit; its status once it has (kept: later calls
    /// return it again), `None` on timeout or when never started.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.proc.as_mut()?.wait_exit(timeout)
    }

    /// Is the lockd process running (started, not exited)?
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| !p.exited())
    }

    /// Pid (also the process group id) of the running lockd.
    pub fn pid(&self) -> Option<i32> {
        self.proc
            .as_ref()
            .filter(|p| p.exit_status().is_none())
            .map(Proc::pid)
    }

    /// The spec it runs.
    pub fn spec(&self) -> &LockdSpec {
        &self.spec
    }

    /// The binary it runs.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// `unix:SOCKET`.
    pub fn endpoint(&self) -> String {
        self.spec.endpoint()
    }

    /// Its Unix socket.
    pub fn socket(&self) -> &Path {
        &self.spec.socket
    }

    /// Its state file.
    pub fn state_path(&self) -> &Path {
        &self.spec.state
    }

    /// Directory of socket, state and log.
    pub fn dir(&self) -> &Path {
        &self.spec.dir
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The whole log, every start included.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log of the current (last) start only.
    pub fn log_since_start(&self) -> String {
        let all = std::fs::read(&self.log).unwrap_or_default();
        let from = (self.log_start as usize).min(all.len());
        String::from_utf8_lossy(&all[from..]).into_owned()
    }

    /// Typed `status` (5 s bound), or the error.
    pub fn try_status(&self) -> Result<StatusReport, LockdError> {
        status_at(&self.spec.socket, Duration::from_secs(5))
    }

    /// Typed `status`; panics (with the log) if lockd does not answer.
    pub fn status(&self) -> StatusReport {
        self.try_status()
            .unwrap_or_else(|e| panic!("lockd status: {e}; log:\n{}", self.log_text()))
    }

    /// Holder of `resource`, `None` if it is free, unknown, or lockd does not answer.
    pub fn holder(&self, resource: &str) -> Option<String> {
        self.try_status()
            .ok()?
            .resources
            .into_iter()
            .find(|r| r.name == resource)?
            .holder
    }

    /// `lockd revoke --resource RESOURCE --reason REASON` (the operator's CLI); whether it
    /// succeeded.
    pub fn revoke(&self, resource: &str, reason: &str) -> bool {
        Command::new(&self.bin)
            .args(["revoke", "--connect", &self.endpoint()])
            .args(["--resource", resource, "--reason", reason])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// The port of the `tcp:` listener as lockd logged it in its current start (for
    /// `tcp:127.0.0.1:0`), waiting up to `timeout` for the line.
    pub fn logged_tcp_port(&self, timeout: Duration) -> Option<u16> {
        let end = Instant::now() + timeout;
        loop {
            let log = self.log_since_start();
            let port = log.rfind("endpoint=tcp:").and_then(|i| {
                let rest = &log[i + "endpoint=tcp:".len()..];
                let addr: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '\u{1b}' && *c != '"')
                    .collect();
                addr.rsplit(':').next()?.parse().ok()
            });
            if port.is_some() || Instant::now() >= end {
                return port;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Lockd {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_has_every_configured_flag_in_order() {
        let spec = LockdSpec::new("/d")
            .tcp("127.0.0.1:0")
            .reconnect_window(Duration::from_millis(1500))
            .metrics("127.0.0.1:9")
            .log_format(LogFormat::Json)
            .log_filter("debug")
            .args(["--busy-poll", "0"]);
        let c = spec.command(Path::new("/bin/lockd"));
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--log-format",
                "json",
                "serve",
                "--listen",
                "unix:/d/lockd.sock",
                "--listen",
                "tcp:127.0.0.1:0",
                "--state",
                "/d/lockd.state",
                "--reconnect-window",
                "1500ms",
                "--metrics",
                "127.0.0.1:9",
                "--busy-poll",
                "0"
            ]
        );
        let log = c
            .get_envs()
            .find(|(k, _)| *k == "LOCKD_LOG")
            .and_then(|(_, v)| v);
        assert_eq!(log, Some(std::ffi::OsStr::new("debug")));
        assert_eq!(spec.endpoint(), "unix:/d/lockd.sock");
    }

    #[test]
    fn sub_millisecond_reconnect_windows_are_not_truncated() {
        let c = LockdSpec::new("/d")
            .reconnect_window(Duration::from_micros(2500))
            .command(Path::new("/bin/lockd"));
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args[args.len() - 2..], ["--reconnect-window", "2500000ns"]);
    }

    #[test]
    fn status_of_nothing_is_an_error_and_wait_ready_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("none.sock");
        assert!(status_at(&sock, Duration::from_millis(100)).is_err());
        let t = Instant::now();
        let e = wait_ready(&sock, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, LockdError::NotReady { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
