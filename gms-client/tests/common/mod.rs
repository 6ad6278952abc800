//! Shared helpers for the process-level tests: real `gmsd` / `gmsctl` binaries, each in its
//! own process group, killed (SIGKILL to the group) and reaped on drop; temp dirs; every
//! wait bounded.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gms_client::client::{ConnectOptions, GmsClient};

pub const GMSD: &str = env!("CARGO_BIN_EXE_gmsd");
pub const GMSCTL: &str = env!("CARGO_BIN_EXE_gmsctl");

/// A child in its own process group; the group is SIGKILLed on drop.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        cmd.process_group(0);
        Proc {
            child: cmd.spawn().expect("spawn"),
        }
    }
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
    pub fn kill9(&mut self) {
        // SAFETY: signalling our own child's process group.
        unsafe {
            libc::kill(-self.pid(), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }
    /// Waits (bounded) for exit; None on timeout.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
    }
}

/// A running gmsd on a socket in a temp dir.
pub struct Gmsd {
    pub proc: Proc,
    pub socket: PathBuf,
}

impl Gmsd {
    pub fn start(dir: &Path, name: &str) -> Gmsd {
        let socket = dir.join(name);
        Self::start_at(&socket)
    }

    pub fn start_at(socket: &Path) -> Gmsd {
        // Logs next to the socket (inside the test's temp dir) for post-mortems.
        let log = std::fs::File::create(socket.with_extension("log")).expect("log file");
        let proc = Proc::spawn(
            Command::new(GMSD)
                .arg("--socket")
                .arg(socket)
                .env("RUST_LOG", "debug")
                .stdout(Stdio::null())
                .stderr(log),
        );
        let g = Gmsd {
            proc,
            socket: socket.to_path_buf(),
        };
        wait_until(Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(&g.socket).is_ok()
        });
        g
    }

    pub fn kill9(&mut self) {
        self.proc.kill9();
    }
}

/// Polls `f` every 10 ms until true; panics after `limit`.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "condition not met within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn opts() -> ConnectOptions {
    ConnectOptions {
        connect_timeout: Duration::from_secs(5),
        retry_interval: Duration::from_millis(20),
        rpc_timeout: Duration::from_secs(10),
    }
}

pub async fn client(socket: &Path) -> GmsClient {
    GmsClient::connect(socket, opts()).await.expect("connect")
}

/// Runs gmsctl with args; returns (exit code, stdout, stderr). Bounded by 60 s.
pub fn gmsctl(args: &[&str]) -> (i32, String, String) {
    let mut p = Proc::spawn(
        Command::new(GMSCTL)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let status = p
        .wait_timeout(Duration::from_secs(60))
        .expect("gmsctl did not finish within 60s");
    use std::io::Read;
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut s) = p.child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = p.child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    (status.code().unwrap_or(-1), out, err)
}
