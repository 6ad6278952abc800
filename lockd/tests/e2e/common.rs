//! Shared helpers for lockd's integration tests: real `lockd` processes (started by
//! `harness::lockd`, the workspace's one launcher) in their own process groups, temp dirs,
//! loopback only, every wait bounded.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockd::proto::{Event, LeaseState, ResourceReport, StatusReport};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

pub use harness::lockd::Lockd;
use harness::lockd::LockdSpec;

pub const BIN: &str = env!("CARGO_BIN_EXE_lockd");

/// The process guards: `serial()` (alone) and `shared()` (with other shared tests).
pub use harness::serial::{serial, shared};

/// Poll `f` every 10 ms until it returns Some, or panic after `limit`.
pub fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A child process in its own process group; the group is SIGKILLed on drop.
pub struct Group {
    pub child: Child,
    pub pgid: i32,
}

impl Group {
    pub fn spawn(cmd: &mut Command) -> Group {
        cmd.process_group(0);
        let child = cmd.spawn().expect("spawn");
        let pgid = child.id() as i32;
        Group { child, pgid }
    }
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
    /// Signals the leader only.
    pub fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), sig);
    }
    pub fn signal_group(&self, sig: Signal) {
        let _ = killpg(Pid::from_raw(self.pgid), sig);
    }
    pub fn kill_group(&mut self) {
        self.signal_group(Signal::SIGKILL);
        let _ = self.child.wait();
    }
    /// Wait (bounded) for the leader to exit; returns its exit status.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        wait_for(limit, "process exit", || {
            self.child.try_wait().ok().flatten()
        })
    }
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.signal_group(Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// The spec of the lockd these tests run: socket `DIR/lockd.sock`, state `DIR/state.json`,
/// log `DIR/lockd.log` at level info, then `extra` flags.
pub fn spec(dir: &Path, extra: &[&str]) -> LockdSpec {
    LockdSpec::new(dir)
        .state(dir.join("state.json"))
        .log_filter("info")
        .bin(BIN)
        .args(extra.iter().copied())
}

/// Starts a lockd in `dir` (see [`spec`]) and waits until it answers.
pub fn start_lockd(dir: &Path, extra: &[&str]) -> Lockd {
    Lockd::start(spec(dir, extra))
}

/// Resource `name` of a status report; panics (showing the status) if there is no such
/// resource, so that an assertion on its fields cannot pass on a missing one.
pub fn resource<'a>(st: &'a StatusReport, name: &str) -> &'a ResourceReport {
    st.resources
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no resource {name:?} in status {st:?}"))
}

/// Decodes a line the server sent as a typed [`Event`]; panics (showing it) when it is not
/// a well-formed event of this protocol.
pub fn typed_event(v: &Value) -> Event {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("not a valid event: {v}: {e}"))
}

/// A raw line-protocol connection with bounded reads.
pub struct Conn {
    pub w: UnixStream,
    pub r: BufReader<UnixStream>,
}

impl Conn {
    pub fn connect(sock: &Path) -> std::io::Result<Conn> {
        let s = UnixStream::connect(sock)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let r = BufReader::new(s.try_clone()?);
        Ok(Conn { w: s, r })
    }
    pub fn send(&mut self, line: &str) {
        let _ = self.w.write_all(line.as_bytes());
        let _ = self.w.write_all(b"\n");
    }
    /// Next event, or None on EOF / timeout / garbage.
    pub fn recv(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => serde_json::from_str(&line).ok(),
        }
    }
    /// Skip events until one named `event` (None on EOF/timeout).
    pub fn recv_until(&mut self, event: &str) -> Option<Value> {
        loop {
            let v = self.recv()?;
            if v["event"] == event {
                return Some(v);
            }
        }
    }
    /// [`recv_until`](Self::recv_until), typed: panics if that event is not well-formed.
    pub fn event_until(&mut self, event: &str) -> Option<Event> {
        self.recv_until(event).map(|v| typed_event(&v))
    }
    /// Skip events until `granted`; its epoch. Panics on EOF/timeout (with `what`).
    pub fn granted_epoch(&mut self, what: &str) -> u64 {
        match self.event_until("granted") {
            Some(Event::Granted { epoch, .. }) => epoch,
            other => panic!("no grant for {what}: {other:?}"),
        }
    }
    /// True when the server closed the connection (EOF) within the read timeout.
    pub fn closed(&mut self) -> bool {
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match self.r.read_until(b'\n', &mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                // Closed with our requests still unread: the kernel reports a reset.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// `lockd hold` running `sh -c SCRIPT`, whose stdout goes to `out`.
pub fn hold(l: &Lockd, resource: &str, holder: &str, script: &str, extra: &[&str]) -> Group {
    let mut c = Command::new(BIN);
    c.arg("hold")
        .arg("--connect")
        .arg(l.endpoint())
        .arg("--resource")
        .arg(resource)
        .arg("--holder")
        .arg(holder)
        .args(extra)
        .arg("--")
        .arg("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(l.dir().join(format!("hold-{holder}.log")))
                .unwrap(),
        ));
    Group::spawn(&mut c)
}

/// Script that records LOCKD_EPOCH in `file` and then sleeps (as the "engine").
pub fn record_epoch_and_sleep(file: &Path) -> String {
    format!(
        "echo $LOCKD_EPOCH > {f}.tmp && mv {f}.tmp {f}; echo $$ > {f}.pid; exec sleep 300",
        f = file.display()
    )
}

/// Read an epoch file written by [`record_epoch_and_sleep`].
pub fn read_epoch(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

pub fn wait_epoch(file: &Path, limit: Duration) -> u64 {
    wait_for(limit, &format!("epoch in {}", file.display()), || {
        read_epoch(file)
    })
}

/// The pid of the child started by [`record_epoch_and_sleep`] for `file` (it writes `FILE.pid`).
pub fn wait_child_pid(file: &Path, limit: Duration) -> i32 {
    let pid_file = PathBuf::from(format!("{}.pid", file.display()));
    wait_for(limit, "child pid", || {
        std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
    })
}

/// Wait until the status shows `n` waiters for `res` (so that grant order is known).
pub fn wait_waiters(l: &Lockd, res: &str, n: usize) {
    wait_for(Duration::from_secs(10), "waiters", || {
        let st = l.try_status().ok()?;
        (st.resources.iter().find(|r| r.name == res)?.waiters.len() == n).then_some(())
    });
}

/// The usual contest of these tests: a lockd in a fresh temp dir (started with `extra`
/// flags), `lockd hold` `a` holding `engine` (its command records the epoch in `fa`, then
/// sleeps) and `lockd hold` `b` queued behind it (recording in `fb` once granted).
///
/// Destructure it with `d` first: bindings drop in reverse, so the temp dir goes last.
pub struct Contest {
    /// The temp dir of socket, state, logs and epoch files.
    pub d: tempfile::TempDir,
    /// The lockd.
    pub l: Lockd,
    /// The holder's `lockd hold`.
    pub a: Group,
    /// The waiter's `lockd hold`.
    pub b: Group,
    /// The epoch `a` was granted.
    pub ea: u64,
    /// `a`'s epoch file.
    pub fa: PathBuf,
    /// `b`'s epoch file (absent until `b` is granted).
    pub fb: PathBuf,
}

/// Sets up a [`Contest`]: returns once `a` runs with its epoch and `b` is queued.
pub fn contest(extra: &[&str]) -> Contest {
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), extra);
    let (fa, fb) = (d.path().join("a.epoch"), d.path().join("b.epoch"));
    let a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    let ea = wait_epoch(&fa, Duration::from_secs(10));
    let b = hold(&l, "engine", "b", &record_epoch_and_sleep(&fb), &[]);
    wait_waiters(&l, "engine", 1);
    Contest {
        d,
        l,
        a,
        b,
        ea,
        fa,
        fb,
    }
}

/// Waits (5 s) until `engine` is held again after a lockd restart (the holder reclaimed);
/// the status that shows it.
pub fn wait_reclaimed(l: &Lockd) -> StatusReport {
    wait_for(Duration::from_secs(5), "the holder's reclaim", || {
        let st = l.status();
        (resource(&st, "engine").state == LeaseState::Held).then_some(st)
    })
}

/// SIGKILLs only the `lockd hold` process of `hold` (not its group: its command `child_pid`
/// lives on), then checks that `engine` stays with `a` while the child lives, not granted to
/// `b` (epoch file `fb`), and passes to `b` with an epoch above `ea` once the child is
/// killed.
pub fn lock_follows_the_child(l: &Lockd, hold: &mut Group, child_pid: i32, ea: u64, fb: &Path) {
    let _ = kill(Pid::from_raw(hold.pid()), Signal::SIGKILL);
    hold.wait_exit(Duration::from_secs(5));
    assert!(pid_alive(child_pid), "the child must still run");
    std::thread::sleep(Duration::from_millis(500));
    let st = l.status();
    assert_eq!(
        resource(&st, "engine").holder.as_deref(),
        Some("a"),
        "lock must stay with the child: {st:?}"
    );
    assert_eq!(read_epoch(fb), None, "granted while the child lives");

    let _ = kill(Pid::from_raw(child_pid), Signal::SIGKILL);
    let eb = wait_epoch(fb, Duration::from_secs(10));
    assert!(eb > ea, "epoch {eb} not above {ea}");
}

/// `lockd revoke --connect ENDPOINT --resource RESOURCE ARGS...` (run it with
/// [`OutputWithin::output_within`]).
pub fn revoke_cmd(endpoint: &str, resource: &str, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["revoke", "--connect", endpoint, "--resource", resource])
        .args(args);
    c
}

/// The process exists and is not a zombie (the workspace's one definition, `procfs::alive`).
pub fn pid_alive(pid: i32) -> bool {
    procfs::alive(pid)
}

/// The TCP port lockd logged for its `tcp:` listener (panics if not logged within 10 s).
pub fn tcp_port(l: &Lockd) -> u16 {
    l.logged_tcp_port(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no tcp listener in the log:\n{}", l.log_text()))
}

/// A raw TCP line connection (bounded reads).
pub struct TcpConn {
    pub w: std::net::TcpStream,
    pub r: BufReader<std::net::TcpStream>,
}

impl TcpConn {
    pub fn connect(port: u16) -> TcpConn {
        let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        TcpConn {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }
    pub fn send(&mut self, line: &str) {
        self.w.write_all(format!("{line}\n").as_bytes()).unwrap();
    }
    pub fn recv_until(&mut self, event: &str) -> Option<Value> {
        loop {
            let mut line = String::new();
            if self.r.read_line(&mut line).ok()? == 0 {
                return None;
            }
            let v: Value = serde_json::from_str(&line).ok()?;
            if v["event"] == event || v["event"] == "error" {
                return Some(v);
            }
        }
    }
    /// [`recv_until`](Self::recv_until), typed: panics if that event is not well-formed.
    pub fn event_until(&mut self, event: &str) -> Option<Event> {
        self.recv_until(event).map(|v| typed_event(&v))
    }
}

pub use harness::metrics::{scrape, Metrics};

/// A loopback port free at the time of the call (the harness's).
pub use harness::free_port;

#[test]
fn metrics_parser_reads_both_exposition_formats() {
    let prom = "# HELP lockd_grants_total Grants.\n# TYPE lockd_grants_total counter\nlockd_grants_total 2\nlockd_waiters{resource=\"engine\"} 1\nlockd_handoff_seconds_bucket{le=\"+Inf\"} 1\n";
    let om = "# TYPE lockd_grants counter\nlockd_grants_total 2\nlockd_waiters{resource=\"engine\",x=\"a\\\"b\"} 1.0\nlockd_handoff_seconds_bucket{le=\"+Inf\"} 1 # {trace_id=\"x\"} 0.5\n# EOF\n";
    for page in [prom, om] {
        let m = Metrics::parse(page);
        assert_eq!(m.samples.len(), 3, "{page}");
        assert_eq!(m.value("lockd_grants_total", &[]), 2.0);
        assert_eq!(m.value("lockd_waiters", &[("resource", "engine")]), 1.0);
        assert_eq!(
            m.value("lockd_handoff_seconds_bucket", &[("le", "+Inf")]),
            1.0
        );
        assert_eq!(m.get("lockd_waiters", &[("resource", "other")]), None);
    }
    assert_eq!(
        Metrics::parse(om).samples[1]
            .labels
            .get("x")
            .map(String::as_str),
        Some("a\"b")
    );
}

/// Bound on one short-lived command of these tests (`lockd hold`, `status`, `revoke`, a
/// lockd expected to refuse to start).
pub const CMD_LIMIT: Duration = Duration::from_secs(30);

/// [`Command::output`] with a bound: stdin null, stdout and stderr captured, in its own
/// process group; the group is SIGKILLed once the command has exited (leftovers) or when it
/// runs past `limit` (then this panics: a test must not hang).
pub trait OutputWithin {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<std::process::Output>;
}

impl OutputWithin for Command {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<std::process::Output> {
        use std::io::Read;
        self.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = self.spawn()?;
        let pgid = Pid::from_raw(child.id() as i32);
        let reader = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = reader(Box::new(child.stdout.take().expect("piped stdout")));
        let err = reader(Box::new(child.stderr.take().expect("piped stderr")));
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if Instant::now() >= end {
                let _ = killpg(pgid, Signal::SIGKILL);
                let _ = child.wait();
                panic!("{self:?} did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = killpg(pgid, Signal::SIGKILL);
        Ok(std::process::Output {
            status,
            stdout: out.join().unwrap_or_default(),
            stderr: err.join().unwrap_or_default(),
        })
    }
}

/// Milliseconds since the Unix epoch, now (the clock lockd's deadlines are given in).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Bound on one reply of lockd in the raw protocol-2 tests.
pub const REPLY: Duration = Duration::from_secs(5);

/// A raw protocol-2 connection: JSON lines over the Unix socket, no client library; every
/// read is bounded. `connect` reads the `hello`.
pub struct Raw {
    w: UnixStream,
    r: BufReader<UnixStream>,
    /// Bytes of a line not yet complete when a read timed out.
    partial: Vec<u8>,
    /// The `hello` event.
    pub hello: Value,
    /// The `hello` line, as sent (newline removed).
    pub hello_line: String,
    /// This connection's session id (from `hello`).
    pub session: u64,
}

impl Raw {
    /// Connects, reads `hello` (panics if none within [`REPLY`]).
    pub fn connect(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock).unwrap_or_else(|e| panic!("connect {sock:?}: {e}"));
        let r = BufReader::new(s.try_clone().expect("clone socket"));
        let mut c = Raw {
            w: s,
            r,
            partial: Vec::new(),
            hello: Value::Null,
            hello_line: String::new(),
            session: 0,
        };
        let line = c.next_line(REPLY).expect("hello");
        let hello: Value = serde_json::from_str(&line).expect("hello is JSON");
        c.hello_line = line;
        assert_eq!(hello["event"], "hello", "first line: {hello}");
        c.session = hello["session"].as_u64().expect("hello session");
        c.hello = hello;
        c
    }

    /// Sends one JSON request (a newline is added).
    pub fn send(&mut self, req: &Value) {
        self.send_line(&req.to_string());
    }

    /// Sends one raw line (a newline is added).
    pub fn send_line(&mut self, line: &str) {
        let _ = self.w.write_all(format!("{line}\n").as_bytes());
    }

    /// The next line as sent (newline removed), or None on EOF or after `limit`.
    pub fn next_line(&mut self, limit: Duration) -> Option<String> {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.r.get_ref().set_read_timeout(Some(left)).ok()?;
            match self.r.read_until(b'\n', &mut self.partial) {
                Ok(0) => return None,
                Ok(_) if self.partial.ends_with(b"\n") => {
                    let line = String::from_utf8_lossy(&self.partial)
                        .trim_end()
                        .to_string();
                    self.partial.clear();
                    return Some(line);
                }
                Ok(_) => return None,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return None,
            }
        }
    }

    /// The next event, or None on EOF or after `limit` (panics on a line that is not JSON).
    pub fn next(&mut self, limit: Duration) -> Option<Value> {
        let line = self.next_line(limit)?;
        Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}")))
    }

    /// Skips events until one named `event` arrives; panics (showing what came) after
    /// `limit`, or when an `error` event comes first.
    pub fn until(&mut self, event: &str, limit: Duration) -> Value {
        let end = Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.next(left) {
                Some(v) if v["event"] == event => return v,
                Some(v) if v["event"] == "error" && event != "error" => {
                    panic!("error while waiting for {event}: {v} (after {seen:?})")
                }
                Some(v) => seen.push(v),
                None => panic!("no {event} within {limit:?} (got {seen:?})"),
            }
        }
    }

    /// Sends `req` and returns the reply `event` (see [`until`](Self::until)).
    pub fn rpc(&mut self, req: Value, event: &str) -> Value {
        self.send(&req);
        self.until(event, REPLY)
    }

    /// Sends `req` and expects an `error` with `code`; returns the error event.
    pub fn rpc_err(&mut self, req: Value, code: &str) -> Value {
        self.send(&req);
        let e = self.until("error", REPLY);
        assert_eq!(e["code"], code, "expected error {code} for {req}: {e}");
        e
    }

    /// `lease {lease_id}`: the report.
    pub fn lease(&mut self, id: u64) -> Value {
        self.rpc(serde_json::json!({"op":"lease","lease_id":id}), "lease")
    }

    /// `status` (full, or without sessions).
    pub fn status(&mut self, sessions: bool) -> Value {
        self.rpc(
            serde_json::json!({"op":"status","sessions":sessions}),
            "status",
        )
    }

    /// Asserts that no event arrives within `d` (e.g. a waiter not granted yet).
    pub fn quiet(&mut self, d: Duration, what: &str) {
        if let Some(v) = self.next(d) {
            panic!("{what}: unexpected event {v}");
        }
    }
}

/// The `lease_id` of a `granted`/`queued` event (panics when absent).
pub fn lease_id(v: &Value) -> u64 {
    v["lease_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no lease_id in {v}"))
}

/// The `token` of a `granted` event (panics when absent).
pub fn token(v: &Value) -> String {
    v["token"]
        .as_str()
        .unwrap_or_else(|| panic!("no token in {v}"))
        .to_string()
}

/// A field that must be an unsigned integer (panics, showing the event, otherwise).
pub fn u64_of(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer {field} in {v}"))
}

/// Environment of [`raw_child_client`]: the socket to connect to.
const CHILD_SOCK: &str = "LOCKD_E2E_CHILD_SOCK";
/// Environment of [`raw_child_client`]: the requests to send, one JSON object per line.
const CHILD_REQS: &str = "LOCKD_E2E_CHILD_REQS";

/// Not a test of its own: the body of a client *process* for the tests that SIGKILL a
/// client (a writer dying before its commit, a quantity client crashing). Run by
/// [`ChildClient::spawn`] as this test binary filtered to this test, it connects to
/// `$LOCKD_E2E_CHILD_SOCK`, sends the lines of `$LOCKD_E2E_CHILD_REQS`, prints every line
/// lockd sends on stdout, and lives until killed (at most 120 s). Without the variables it
/// returns at once.
#[test]
fn raw_child_client() {
    let (Ok(sock), Ok(reqs)) = (std::env::var(CHILD_SOCK), std::env::var(CHILD_REQS)) else {
        return;
    };
    let s = UnixStream::connect(&sock).expect("child: connect");
    let mut w = s.try_clone().expect("child: clone");
    for line in reqs.lines() {
        w.write_all(format!("{line}\n").as_bytes())
            .expect("child: send");
    }
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let mut r = BufReader::new(s);
    let mut out = std::io::stdout();
    loop {
        let mut line = String::new();
        match r.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let _ = out.write_all(line.as_bytes());
                let _ = out.flush();
            }
        }
    }
}

/// A client process (this test binary running [`raw_child_client`]) that sends requests
/// and prints lockd's lines; killed with its process group on drop.
pub struct ChildClient {
    /// The process (its own group).
    pub group: Group,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildClient {
    /// Starts the child: it connects to `sock` and sends `reqs`.
    pub fn spawn(sock: &Path, reqs: &[Value]) -> ChildClient {
        let exe = std::env::current_exe().expect("current exe");
        let mut c = Command::new(exe);
        c.args([
            "common::raw_child_client",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_SOCK, sock)
        .env(
            CHILD_REQS,
            reqs.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        let mut group = Group::spawn(&mut c);
        let out = group.child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildClient { group, lines }
    }

    /// The next event lockd sent the child that is named `event`; panics after `limit`.
    pub fn until(&self, event: &str, limit: Duration) -> Value {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("child: no {event} within {limit:?}"));
            // The test harness prints its own lines too: only JSON objects are lockd's.
            if !line.starts_with('{') {
                continue;
            }
            let v: Value = serde_json::from_str(&line).expect("child line");
            if v["event"] == event {
                return v;
            }
            assert_ne!(v["event"], "error", "child got an error: {v}");
        }
    }

    /// SIGKILLs the child's process group and reaps it.
    pub fn kill(&mut self) {
        self.group.kill_group();
    }
}

/// A `lockd serve` for the protocol-2 tests, started from [`spec`] in its own process group
/// (SIGKILLed on drop), logging to `DIR/lockd.log`. Readiness is a `ping` answered over a
/// raw connection, not the typed `status` of [`Lockd`] (see [`Lockd2::start`]).
pub struct Lockd2 {
    spec: LockdSpec,
    proc: Option<Group>,
}

impl Lockd2 {
    /// Starts lockd in `dir` with `extra` flags and waits (10 s) until it answers `ping`.
    /// [`Lockd::start`]/[`Lockd::restart`] wait for a *typed* `status`, which does not
    /// decode while a version-2 lease is live (the duplicate keys of `LeaseReport`, a core
    /// bug reported by `kinds_compat::typed_status_and_lease_reports_decode`), so they
    /// would wait until every lease has ended.
    pub fn start(dir: &Path, extra: &[&str]) -> Lockd2 {
        let mut l = Lockd2 {
            spec: spec(dir, extra),
            proc: None,
        };
        l.restart();
        l
    }

    /// SIGKILLs the running lockd (if any), starts a new one on the same socket and state
    /// file and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("lockd log");
        let mut c = self.spec.command(Path::new(BIN));
        c.stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        let mut g = Group::spawn(&mut c);
        let sock = self.socket().to_path_buf();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(s) = UnixStream::connect(&sock) {
                s.set_read_timeout(Some(Duration::from_secs(2))).ok();
                let mut w = s.try_clone().expect("clone");
                let _ = w.write_all(b"{\"op\":\"ping\"}\n");
                let mut r = BufReader::new(s);
                let mut ok = false;
                for _ in 0..2 {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    ok |= line.contains("\"pong\"");
                }
                if ok {
                    break;
                }
            }
            assert!(
                g.alive(),
                "lockd exited at start:\n{}",
                std::fs::read_to_string(self.log_path()).unwrap_or_default()
            );
            assert!(
                Instant::now() < end,
                "lockd not ready in 10 s:\n{}",
                std::fs::read_to_string(self.log_path()).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        self.proc = Some(g);
    }

    /// SIGKILLs lockd's process group and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut g) = self.proc.take() {
            g.kill_group();
        }
    }

    /// lockd's pid.
    pub fn pid(&self) -> Option<i32> {
        self.proc.as_ref().map(Group::pid)
    }

    /// The Unix socket.
    pub fn socket(&self) -> &Path {
        self.spec.socket_path()
    }

    /// The log file (appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.spec.dir().join("lockd.log")
    }

    /// A new raw connection.
    pub fn raw(&self) -> Raw {
        Raw::connect(self.socket())
    }
}
