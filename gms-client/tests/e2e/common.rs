//! Shared helpers for the process-level tests: real `gmsd` (started by `harness::gmsd`, the
//! workspace's one launcher) and `gmsctl` binaries, each in its own process group, killed
//! (SIGKILL to the group) and reaped on drop; temp dirs; every wait bounded.
#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gms_client::client::{ConnectOptions, GmsClient};
use gms_client::protocol::RequestedLockType;
use harness::gmsd::GmsdSpec;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

pub const GMSD: &str = env!("CARGO_BIN_EXE_gmsd");
pub const GMSCTL: &str = env!("CARGO_BIN_EXE_gmsctl");

/// The process guards: `serial()` (alone) and `shared()` (with other shared tests).
pub use harness::serial::{serial, shared};

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
        let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }
    pub fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), sig);
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

/// A running gmsd on a socket in a temp dir: the harness' [`harness::gmsd::Gmsd`] (log next
/// to the socket, `RUST_LOG=debug`) plus its socket path as a field.
pub struct Gmsd {
    pub socket: PathBuf,
    pub inner: harness::gmsd::Gmsd,
}

impl Gmsd {
    pub fn start(dir: &Path, name: &str) -> Gmsd {
        Self::start_at(&dir.join(name))
    }

    pub fn start_at(socket: &Path) -> Gmsd {
        let inner = harness::gmsd::Gmsd::start(GmsdSpec::new(socket).bin(GMSD).log_filter("debug"));
        Gmsd {
            socket: socket.to_path_buf(),
            inner,
        }
    }

    pub fn kill9(&mut self) {
        self.inner.kill();
    }
}

impl Deref for Gmsd {
    type Target = harness::gmsd::Gmsd;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl DerefMut for Gmsd {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
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

/// A client holding the read lock: connected to `socket`, RO handshake (5 s) asserted to
/// succeed.
pub async fn reader(socket: &Path) -> GmsClient {
    let mut r = client(socket).await;
    let hs = r
        .handshake(RequestedLockType::Ro, Some(Duration::from_secs(5)))
        .await
        .expect("RO handshake");
    assert!(hs.success, "RO handshake refused: {hs:?}");
    r
}

/// A [`reader`] holding the read lock and a writer (RW handshake, 30 s) queued behind it:
/// returns once the server counts the waiting writer (bounded, 10 s), with the reader and
/// the writer's task (which yields the writer's client).
pub async fn reader_and_waiting_writer(
    socket: &Path,
) -> (GmsClient, tokio::task::JoinHandle<GmsClient>) {
    let mut r = reader(socket).await;
    let mut w = client(socket).await;
    let writer = tokio::spawn(async move {
        let _ = w
            .handshake(RequestedLockType::Rw, Some(Duration::from_secs(30)))
            .await;
        w
    });
    let end = Instant::now() + Duration::from_secs(10);
    while r.lock_state().await.unwrap().waiting_writers != 1 {
        assert!(
            Instant::now() < end,
            "the writer was never counted as waiting"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (r, writer)
}

/// Runs gmsctl with args; returns (exit code, stdout, stderr). Bounded by 60 s.
pub fn gmsctl(args: &[&str]) -> (i32, String, String) {
    let mut p = Proc::spawn(
        Command::new(GMSCTL)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    // Read while it runs (a full pipe would block it), then reap with a bound.
    use std::io::Read;
    let mut out = String::new();
    let mut err = String::new();
    let mut so = p.child.stdout.take();
    let mut se = p.child.stderr.take();
    let t = std::thread::spawn(move || {
        let mut e = String::new();
        if let Some(s) = se.as_mut() {
            let _ = s.read_to_string(&mut e);
        }
        e
    });
    if let Some(s) = so.as_mut() {
        let _ = s.read_to_string(&mut out);
    }
    let status = p
        .wait_timeout(Duration::from_secs(60))
        .expect("gmsctl did not finish within 60s");
    if let Ok(e) = t.join() {
        err = e;
    }
    (status.code().unwrap_or(-1), out, err)
}
