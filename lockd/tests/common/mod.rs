//! Shared helpers for lockd's integration tests: real `lockd` processes in their own
//! process groups, temp dirs, loopback only, every wait bounded.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_lockd");

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
    pub fn signal_group(&self, sig: i32) {
        // SAFETY: kill(2) on a process group we created.
        unsafe { libc::kill(-self.pgid, sig) };
    }
    pub fn kill_group(&mut self) {
        self.signal_group(libc::SIGKILL);
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
        self.signal_group(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A lockd process on a temp dir's socket and state file.
pub struct Lockd {
    pub dir: PathBuf,
    pub sock: PathBuf,
    pub state: PathBuf,
    pub extra: Vec<String>,
    pub proc: Option<Group>,
}

impl Lockd {
    pub fn start(dir: &Path, extra: &[&str]) -> Lockd {
        let mut l = Lockd {
            dir: dir.to_path_buf(),
            sock: dir.join("lockd.sock"),
            state: dir.join("state.json"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            proc: None,
        };
        l.restart();
        l
    }

    pub fn endpoint(&self) -> String {
        format!("unix:{}", self.sock.display())
    }

    /// Command line of this lockd (for tests that expect it to fail).
    pub fn command(&self) -> Command {
        let mut c = Command::new(BIN);
        c.arg("serve")
            .arg("--listen")
            .arg(self.endpoint())
            .arg("--state")
            .arg(&self.state)
            .args(&self.extra)
            .env("LOCKD_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.join("lockd.log"))
                    .unwrap(),
            ));
        c
    }

    /// (Re)start on the same socket and state file; waits until it answers.
    pub fn restart(&mut self) {
        let g = Group::spawn(&mut self.command());
        self.proc = Some(g);
        let sock = self.sock.clone();
        let p = self.proc.as_mut().unwrap();
        wait_for(Duration::from_secs(20), "lockd to listen", || {
            if let Ok(Some(st)) = p.child.try_wait() {
                panic!("lockd exited early: {st}");
            }
            status_at(&sock).ok()
        });
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill_group();
        }
    }

    pub fn status(&self) -> Value {
        status_at(&self.sock).expect("status")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("lockd.log")).unwrap_or_default()
    }
}

/// One `status` round trip over the socket.
pub fn status_at(sock: &Path) -> std::io::Result<Value> {
    let mut c = Conn::connect(sock)?;
    c.send(r#"{"op":"status"}"#);
    c.recv_until("status")
        .ok_or_else(|| std::io::Error::other("no status"))
}

/// Resource `name` from a status object.
pub fn resource(st: &Value, name: &str) -> Value {
    st["resources"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["name"] == name).cloned())
        .unwrap_or(Value::Null)
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
                .open(l.dir.join(format!("hold-{holder}.log")))
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

/// Wait until the status shows `waiters` for `res` (so that grant order is known).
pub fn wait_waiters(l: &Lockd, res: &str, n: usize) {
    wait_for(Duration::from_secs(10), "waiters", || {
        let st = status_at(&l.sock).ok()?;
        (resource(&st, res)["waiters"].as_array()?.len() == n).then_some(())
    });
}

pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// The TCP port lockd logged for its `tcp:` listener.
pub fn tcp_port(l: &Lockd) -> u16 {
    wait_for(
        std::time::Duration::from_secs(10),
        "tcp listener in log",
        || {
            let log = l.log();
            let i = log.rfind("endpoint=tcp:")?;
            let rest = &log[i + "endpoint=tcp:".len()..];
            let addr: String = rest
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '\u{1b}')
                .collect();
            addr.rsplit(':').next()?.parse().ok()
        },
    )
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
}

/// GET lockd's `/metrics` on loopback `port` (the raw HTTP response).
pub fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A loopback port free at the time of the call.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
