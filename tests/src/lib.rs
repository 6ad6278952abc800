//! End-to-end harness: starts real `lockd`, `supervisor` and `fake-engine` processes on
//! 127.0.0.1 with random ports in a temp dir, and kills every process group it started when
//! dropped (engine pids from the pid files too, since detached workers live in their own
//! sessions).
//!
//! Binaries are found next to the test executable (`target/<profile>/<name>`): run the tests
//! with `cargo test --workspace` so that cargo builds them first.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Harness errors (setup problems; test assertions panic instead).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A binary is missing from the target dir.
    #[error("binary {0} not found: build the workspace first (run `cargo test --workspace`, which builds every workspace binary before running tests)")]
    MissingBinary(PathBuf),
    /// I/O failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Path of a workspace binary, `target/<profile>/<name>`, located from the running test
/// executable (`target/<profile>/deps/<test>-<hash>`) or a binary in `target/<profile>/`.
pub fn bin(name: &str) -> Result<PathBuf, HarnessError> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(name);
    if p.is_file() {
        Ok(p)
    } else {
        Err(HarnessError::MissingBinary(p))
    }
}

/// Like [`bin`] but panics with the helpful message (for tests).
pub fn must_bin(name: &str) -> PathBuf {
    match bin(name) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}

/// A free TCP port on 127.0.0.1 (bind to port 0, read it, close).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Environment variable naming a file where [`skip`] appends one line per skipped test
/// (`.ci/run` sets it and prints the list and the count at the end).
pub const SKIP_LOG_ENV: &str = "FAILOVER_SKIP_LOG";

/// Record that `test` did not run (all or part of it) for `reason`: prints `SKIP: test:
/// reason` on stderr and appends it to the file named by [`SKIP_LOG_ENV`], if set, so that a
/// skip is counted instead of passing silently.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIP: {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV) {
        use std::io::Write;
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = appended {
            eprintln!("cannot record the skip in {}: {e}", path.to_string_lossy());
        }
    }
}

/// Poll `f` every `every` until it returns true or `timeout` passes. Returns the last result.
pub fn wait_until(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Minimal HTTP/1.1 client (one request per connection, `Connection: close`), bounded by
/// `timeout`. Returns (status, body).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad status line"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    Ok((code, body))
}

/// GET with a 2 s limit; None if no answer.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http(addr, "GET", path, "", Duration::from_secs(2)).ok()
}

/// Is `pid` a live (non-zombie) process?
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => match s
            .rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
        {
            Some(st) => st != "Z" && st != "X",
            None => false,
        },
        Err(_) => false,
    }
}

/// Command line of `pid` (NUL separators replaced by spaces), empty if gone.
pub fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Live (non-zombie) descendants of `root`, found by walking `/proc` (pids as seen here, also
/// for processes inside a child PID namespace).
pub fn descendants(root: i32) -> Vec<i32> {
    let mut parent = std::collections::HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.filter_map(|e| e.ok()) {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            let mut it = rest.split_whitespace();
            let state = it.next().unwrap_or("X");
            if let Some(ppid) = it.next().and_then(|p| p.parse::<i32>().ok()) {
                if state != "Z" && state != "X" {
                    parent.insert(pid, ppid);
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (c, pp) in &parent {
            if *pp == p && !out.contains(c) {
                out.push(*c);
                frontier.push(*c);
            }
        }
    }
    out
}

/// Wall clock in microseconds since the Unix epoch.
pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

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
    /// Spawn `cmd` in a new process group, logging to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Proc {
        let f = std::fs::File::create(&log).expect("create log file");
        let f2 = f.try_clone().expect("dup log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(f))
            .stderr(Stdio::from(f2))
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {name}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            log,
            status: None,
        }
    }

    /// Pid (also the process group id).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Send `sig` to the process only.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with integers.
        unsafe { libc::kill(self.pid(), sig) };
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

    /// Has it exited (non-blocking)?
    pub fn exited(&mut self) -> bool {
        self.wait_exit(Duration::ZERO).is_some()
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            // SAFETY: killpg/kill with integers; ESRCH is fine.
            unsafe {
                libc::killpg(self.pid(), libc::SIGKILL);
                libc::kill(self.pid(), libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

/// A running lockd on a Unix socket in the test dir.
#[derive(Debug)]
pub struct Lockd {
    /// The process (None while stopped).
    pub proc: Option<Proc>,
    /// `unix:PATH`.
    pub endpoint: String,
    /// Directory for socket, state and logs.
    dir: PathBuf,
    /// `--reconnect-window`.
    reconnect_window: String,
    /// Starts so far (names the log files).
    starts: u32,
}

impl Lockd {
    /// Start lockd in `dir` with the given reconnect window (e.g. `2s`).
    pub fn start(dir: &Path, reconnect_window: &str) -> Lockd {
        let mut l = Lockd {
            proc: None,
            endpoint: format!("unix:{}", dir.join("lockd.sock").display()),
            dir: dir.to_path_buf(),
            reconnect_window: reconnect_window.to_string(),
            starts: 0,
        };
        l.restart();
        l
    }

    /// (Re)start after a stop; waits until `lockd status` answers.
    pub fn restart(&mut self) {
        self.starts += 1;
        let mut cmd = Command::new(must_bin("lockd"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(&self.endpoint)
            .arg("--state")
            .arg(self.dir.join("lockd.state"))
            .arg("--reconnect-window")
            .arg(&self.reconnect_window);
        let log = self.dir.join(format!("lockd.{}.log", self.starts));
        self.proc = Some(Proc::spawn("lockd", cmd, log));
        let ok = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.status().is_some()
        });
        assert!(ok, "lockd did not come up: {}", self.log_text());
    }

    /// SIGKILL lockd and reap it.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGKILL);
            assert!(
                p.wait_exit(Duration::from_secs(5)).is_some(),
                "lockd did not die"
            );
        }
    }

    /// `lockd status` as JSON (None if it does not answer).
    pub fn status(&self) -> Option<serde_json::Value> {
        let out = Command::new(must_bin("lockd"))
            .args(["status", "--connect", &self.endpoint])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Holder of `resource` per `lockd status`.
    pub fn holder(&self, resource: &str) -> Option<String> {
        let v = self.status()?;
        v["resources"]
            .as_array()?
            .iter()
            .find(|r| r["name"] == resource)
            .and_then(|r| r["holder"].as_str().map(str::to_string))
    }

    /// `lockd revoke`; returns whether it succeeded.
    pub fn revoke(&self, resource: &str, reason: &str) -> bool {
        Command::new(must_bin("lockd"))
            .args([
                "revoke",
                "--connect",
                &self.endpoint,
                "--resource",
                resource,
                "--reason",
                reason,
            ])
            .stdin(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Current log.
    pub fn log_text(&self) -> String {
        self.proc.as_ref().map(|p| p.log_text()).unwrap_or_default()
    }
}

/// How to start one supervisor + fake engine.
#[derive(Clone, Debug)]
pub struct SupOpts {
    /// `--engine-id`.
    pub engine_id: u32,
    /// `primary` or `shadow`.
    pub role: &'static str,
    /// Extra `supervisor run` flags.
    pub sup_args: Vec<String>,
    /// Extra `fake-engine` flags.
    pub engine_args: Vec<String>,
    /// Adapter (`vllm` / `sglang`).
    pub adapter: &'static str,
}

impl SupOpts {
    /// Defaults for `engine_id` / `role`.
    pub fn new(engine_id: u32, role: &'static str) -> SupOpts {
        SupOpts {
            engine_id,
            role,
            sup_args: Vec::new(),
            engine_args: Vec::new(),
            adapter: "vllm",
        }
    }

    /// Add supervisor flags.
    pub fn sup(mut self, a: &[&str]) -> SupOpts {
        self.sup_args.extend(a.iter().map(|s| s.to_string()));
        self
    }

    /// Add fake-engine flags.
    pub fn engine(mut self, a: &[&str]) -> SupOpts {
        self.engine_args.extend(a.iter().map(|s| s.to_string()));
        self
    }
}

/// A running supervisor (its engine is its child).
#[derive(Debug)]
pub struct Sup {
    /// The supervisor process.
    pub proc: Proc,
    /// Probe address.
    pub probes: SocketAddr,
    /// Engine HTTP address.
    pub engine: SocketAddr,
    /// Pid file written by the fake engine.
    pub pid_file: PathBuf,
    /// Engine id.
    pub engine_id: u32,
}

impl Sup {
    /// GET a probe; status code or None when nothing answers.
    pub fn probe(&self, path: &str) -> Option<u16> {
        get(self.probes, path).map(|x| x.0)
    }

    /// `/state` as JSON.
    pub fn state(&self) -> Option<serde_json::Value> {
        get(self.probes, "/state").and_then(|(_, b)| serde_json::from_str(&b).ok())
    }

    /// The `state` field of `/state`.
    pub fn phase(&self) -> Option<String> {
        self.state()
            .and_then(|v| v["state"].as_str().map(str::to_string))
    }

    /// Wait until `/state.state == phase`.
    pub fn wait_phase(&self, phase: &str, timeout: Duration) -> bool {
        wait_until(timeout, Duration::from_millis(10), || {
            self.phase().as_deref() == Some(phase)
        })
    }

    /// Pids in the engine's pid file (engine first, then workers).
    pub fn engine_pids(&self) -> Vec<i32> {
        std::fs::read_to_string(&self.pid_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Wait for the pid file to list `n` pids; panics if it does not within `timeout`.
    pub fn wait_engine_pids(&self, n: usize, timeout: Duration) -> Vec<i32> {
        let mut pids = Vec::new();
        let found = wait_until(timeout, Duration::from_millis(10), || {
            pids = self.engine_pids();
            pids.len() >= n
        });
        // Fail loudly: callers assert things over this list, which must not be vacuous.
        assert!(
            found,
            "wanted {n} engine pids within {timeout:?}, found {}: {pids:?}",
            pids.len()
        );
        pids
    }

    /// POST a completion to the engine directly: (status, body JSON).
    pub fn completion(&self) -> Option<(u16, serde_json::Value)> {
        http(
            self.engine,
            "POST",
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":1}"#,
            Duration::from_secs(2),
        )
        .ok()
        .map(|(c, b)| {
            (
                c,
                serde_json::from_str(&b).unwrap_or(serde_json::Value::Null),
            )
        })
    }

    /// Supervisor + engine log.
    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }

    /// Wall-clock time (unix us) of the first transition into `phase`, from `/state`.
    pub fn transition_at(&self, phase: &str) -> Option<i64> {
        transition_at(&self.state()?, phase)
    }
}

/// First transition into `phase` in a `/state` document.
pub fn transition_at(state: &serde_json::Value, phase: &str) -> Option<i64> {
    state["transitions"]
        .as_array()?
        .iter()
        .find(|t| t["to"] == phase)
        .and_then(|t| t["at_unix_us"].as_i64())
}

/// One test's world: a temp dir, a lockd, supervisors; kills everything on drop.
#[derive(Debug)]
pub struct Cluster {
    /// Temp dir for sockets, state, pid files and logs (removed on drop; failing assertions
    /// print the logs through `dump_logs`).
    pub dir: tempfile::TempDir,
    /// The lock daemon.
    pub lockd: Lockd,
    /// The GPU claim file shared by all fake engines.
    pub claim: PathBuf,
    /// Every pid file ever handed to an engine (for cleanup).
    pid_files: Vec<PathBuf>,
    /// Starts so far (names files).
    n: u32,
}

impl Cluster {
    /// New world with a lockd using `reconnect_window`.
    pub fn new(reconnect_window: &str) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("failover-test-")
            .tempdir()
            .expect("tempdir");
        let lockd = Lockd::start(dir.path(), reconnect_window);
        let claim = dir.path().join("gpu.claim");
        Cluster {
            dir,
            lockd,
            claim,
            pid_files: Vec::new(),
            n: 0,
        }
    }

    /// Path of the violations file fake engines write on split brain.
    pub fn violations_file(&self) -> PathBuf {
        let mut p = self.claim.clone().into_os_string();
        p.push(".violations");
        PathBuf::from(p)
    }

    /// Split-brain reports so far (empty string if none).
    pub fn violations(&self) -> String {
        std::fs::read_to_string(self.violations_file()).unwrap_or_default()
    }

    /// Start a supervisor wrapping a fake engine.
    pub fn start(&mut self, o: &SupOpts) -> Sup {
        self.n += 1;
        let probes: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let engine: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let pid_file = self
            .dir
            .path()
            .join(format!("engine-{}.{}.pids", o.engine_id, self.n));
        self.pid_files.push(pid_file.clone());
        let mut cmd = Command::new(must_bin("supervisor"));
        cmd.arg("run")
            .args(["--engine-id", &o.engine_id.to_string()])
            .args(["--role", o.role])
            .args(["--lock", &self.lockd.endpoint])
            .args(["--probes", &probes.to_string()])
            .args(["--adapter", o.adapter])
            .args(["--engine-url", &format!("http://{engine}")])
            .args(["--health-interval", "200ms", "--startup-poll", "20ms"])
            .args(&o.sup_args)
            .arg("--")
            .arg(must_bin("fake-engine"))
            .args(["--port", &engine.port().to_string()])
            .arg("--gpu-claim")
            .arg(&self.claim)
            .arg("--pid-file")
            .arg(&pid_file)
            .args(&o.engine_args);
        // Keep the environment of the test runner from configuring the supervisor (except
        // the test-only planted-bug switches, which only a planted build reads).
        for (k, _) in std::env::vars() {
            let planted = k.starts_with("SUPERVISOR_PLANTED_BUG_");
            if (k.starts_with("SUPERVISOR_") && !planted)
                || k.starts_with("FAKE_ENGINE_")
                || k == "ENGINE_ID"
            {
                cmd.env_remove(k);
            }
        }
        let log = self
            .dir
            .path()
            .join(format!("supervisor-{}.{}.log", o.engine_id, self.n));
        let proc = Proc::spawn(&format!("supervisor-{}", o.engine_id), cmd, log);
        Sup {
            proc,
            probes,
            engine,
            pid_file,
            engine_id: o.engine_id,
        }
    }

    /// Every engine pid (from all pid files) still alive and still one of this cluster's
    /// engine processes (their command lines name this cluster's claim file), so that a
    /// recycled pid is never killed.
    pub fn live_engine_pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        let tag = self.claim.to_string_lossy().into_owned();
        for f in &self.pid_files {
            for l in std::fs::read_to_string(f).unwrap_or_default().lines() {
                if let Ok(p) = l.trim().parse::<i32>() {
                    let cl = cmdline(p);
                    if alive(p) && cl.contains("fake-engine") && cl.contains(&tag) {
                        out.push(p);
                    }
                }
            }
        }
        out
    }

    /// Print every log in the test dir (call before failing assertions for context).
    pub fn dump_logs(&self) -> String {
        let mut out = String::new();
        if let Ok(rd) = std::fs::read_dir(self.dir.path()) {
            let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            paths.sort();
            for p in paths {
                if p.extension().is_some_and(|e| e == "log") {
                    out.push_str(&format!(
                        "\n===== {} =====\n{}",
                        p.display(),
                        std::fs::read_to_string(&p).unwrap_or_default()
                    ));
                }
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Engines and workers (detached ones live in their own sessions): SIGKILL by pid,
        // only if the pid still names a fake-engine process.
        let mut seen = HashSet::new();
        for _ in 0..3 {
            for p in self.live_engine_pids() {
                if seen.insert(p) || alive(p) {
                    // SAFETY: kill(2) with integers.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.lockd.kill();
    }
}

/// A running `gmsd --backend host` (GPU Memory Service without a GPU) on a Unix socket in a
/// test dir, for the supervisor's `--gms` checks.
#[derive(Debug)]
pub struct Gmsd {
    /// The process (None while stopped).
    pub proc: Option<Proc>,
    /// Its socket.
    pub socket: PathBuf,
    /// Directory for the socket and logs.
    dir: PathBuf,
    /// Starts so far (names the log files).
    starts: u32,
}

impl Gmsd {
    /// Start an empty gmsd in `dir`; waits until `gmsctl state` answers.
    pub fn start(dir: &Path) -> Gmsd {
        let mut g = Gmsd {
            proc: None,
            socket: dir.join("gms.sock"),
            dir: dir.to_path_buf(),
            starts: 0,
        };
        g.restart();
        g
    }

    /// (Re)start (empty: gmsd keeps nothing across restarts); waits until it answers.
    pub fn restart(&mut self) {
        self.starts += 1;
        let mut cmd = Command::new(must_bin("gmsd"));
        cmd.arg("--socket")
            .arg(&self.socket)
            .args(["--backend", "host"]);
        for (k, _) in std::env::vars() {
            if k.starts_with("GMSD_") {
                cmd.env_remove(k);
            }
        }
        let log = self.dir.join(format!("gmsd.{}.log", self.starts));
        self.proc = Some(Proc::spawn("gmsd", cmd, log));
        let up = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.state().is_some()
        });
        assert!(up, "gmsd did not come up: {}", self.log_text());
    }

    /// SIGKILL and reap it (its socket file is left behind, as after a crash).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGKILL);
            let _ = p.wait_exit(Duration::from_secs(10));
        }
    }

    /// `gmsctl state` as JSON (None if it does not answer).
    pub fn state(&self) -> Option<serde_json::Value> {
        let out = Command::new(must_bin("gmsctl"))
            .arg("state")
            .arg("--socket")
            .arg(&self.socket)
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

    /// Load and commit `count` allocations of 2 MiB with `gmsctl load` (a real writer).
    pub fn load(&self, count: u32) {
        let out = Command::new(must_bin("gmsctl"))
            .arg("load")
            .arg("--socket")
            .arg(&self.socket)
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

    /// Current log.
    pub fn log_text(&self) -> String {
        self.proc.as_ref().map(|p| p.log_text()).unwrap_or_default()
    }
}
