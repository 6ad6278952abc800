//! The drill's own lockd: `lockd serve` (started, crashed, restarted on the same state file
//! and socket), `lockd watch` (the exact grant moments, each checked against the previous
//! holder's processes as it is read), and the one-shot `lockd status` / `lockd revoke`.
//!
//! The `lockd serve` command line comes from the workspace's one launcher,
//! [`harness::lockd::LockdSpec`]; the runner only calls the methods of [`LockdProc`].

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use harness::lockd::LockdSpec;
use lockd::proto::StatusReport;
use nix::sys::signal::Signal;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::{log_file, logged, RESOURCE};
use crate::invariants::GrantObs;
use crate::observe;
use crate::procs::{self, now_us, Pinned};

/// The previous lease holder's processes, checked by the watch reader at each grant.
#[derive(Default)]
pub(super) struct Fence {
    /// The engine life holding the lease (engine id, incarnation): a restarted life of the
    /// same engine is a different set of processes and must not be mixed in.
    pub(super) holder: Option<(u64, u32)>,
    /// Its engine processes.
    pub(super) pids: Vec<Pinned>,
}

/// A message from the `lockd watch` reader.
struct WatchMsg {
    /// Grant observation with the fence check done at read time.
    grant: Option<GrantObs>,
}

/// `lockd serve` and its `lockd watch`, on a unix socket in the drill's directory.
pub(super) struct LockdProc {
    /// The `lockd` binary.
    bin: PathBuf,
    /// What `lockd serve` runs: socket, state file (kept across crashes), reconnect window.
    spec: LockdSpec,
    /// The directory of process logs.
    logs: PathBuf,
    /// `lockd serve`.
    child: Option<Child>,
    /// Its pid (and process group), to SIGKILL it in a lockd-crash round.
    pid: Option<u32>,
    /// `lockd watch`, whose lines give the exact grant moments.
    watch: Option<Child>,
    /// Grants read from the watch stream, with the fence check already done.
    watch_rx: Option<mpsc::UnboundedReceiver<WatchMsg>>,
    /// The sending side every watch reader gets a clone of.
    watch_tx: Option<mpsc::UnboundedSender<WatchMsg>>,
    /// Watches of lockd lives that crashed, until they have ended.
    old_watches: Vec<Child>,
    /// The current lease holder's engine processes, shared with the watch reader.
    pub(super) fence: Arc<Mutex<Fence>>,
    /// Every process group started (serve, watch), for cleanup.
    pub(super) pgids: Vec<u32>,
}

impl LockdProc {
    /// A lockd to be started in `dir` (socket `lockd.sock`, state `lockd.state`, logs in
    /// `dir/logs`).
    pub(super) fn new(bin: PathBuf, dir: &Path, reconnect_window: Duration) -> LockdProc {
        LockdProc {
            bin,
            // The operator's LOCKD_* environment reaches the drill's lockd, as it always did.
            spec: LockdSpec::new(dir)
                .reconnect_window(reconnect_window)
                .inherit_lockd_env(),
            logs: dir.join("logs"),
            child: None,
            pid: None,
            watch: None,
            watch_rx: None,
            watch_tx: None,
            old_watches: Vec::new(),
            fence: Arc::new(Mutex::new(Fence::default())),
            pgids: Vec::new(),
        }
    }

    /// The endpoint supervisors and clients connect to (`unix:PATH`).
    pub(super) fn endpoint(&self) -> String {
        self.spec.endpoint()
    }

    pub(super) async fn start(&mut self) -> Result<()> {
        self.spawn()?;
        self.wait_ready().await
    }

    /// SIGKILLs lockd and reaps it.
    pub(super) async fn kill(&mut self) {
        if let Some(p) = self.pid {
            procs::signal_pid(p, Signal::SIGKILL);
        }
        if let Some(mut l) = self.child.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), l.wait()).await;
        }
    }

    /// A lockd crash: SIGKILL, restart on the same state file and socket, new watch. The
    /// watch connects as soon as the socket accepts, before the supervisors' clients (which
    /// back off 10 ms, 20 ms, ...) reclaim, so that it sees their reclaims.
    pub(super) async fn crash(&mut self) -> Result<()> {
        self.kill().await;
        self.spawn()?;
        self.wait_socket_accepts(Duration::from_secs(10));
        self.start_watch()?;
        self.wait_ready()
            .await
            .context("restarting lockd after the crash")
    }

    /// Waits (busy, 200 us steps: this is the window a compound round injects into) until
    /// lockd's socket accepts connections. A stale socket file of a killed lockd refuses them.
    pub(super) fn wait_socket_accepts(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if std::os::unix::net::UnixStream::connect(self.spec.socket_path()).is_ok() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Starts `lockd serve --listen unix:SOCK --state STATE --reconnect-window W` (its own
    /// process group, logging to `logs/lockd.log`, killed on drop) without waiting for it.
    pub(super) fn spawn(&mut self) -> Result<()> {
        let mut c = logged(
            Command::from(self.spec.command(&self.bin)),
            &self.logs,
            "lockd.log",
        )?;
        let child = c.spawn().context("starting lockd")?;
        self.pid = child.id();
        if let Some(p) = child.id() {
            self.pgids.push(p);
        }
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the lockd just spawned answers `lockd status`.
    pub(super) async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(ch) = self.child.as_mut() {
                if let Ok(Some(st)) = ch.try_wait() {
                    bail!(
                        "lockd exited at start ({st}); see {}",
                        self.logs.join("lockd.log").display()
                    );
                }
            }
            if self.spec.socket_path().exists() && self.status().await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("lockd did not answer within 10s");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn cmd(&self, args: &[&str], timeout: Duration) -> Result<(bool, String)> {
        let mut c = Command::new(&self.bin);
        c.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let out = tokio::time::timeout(timeout, c.output())
            .await
            .map_err(|_| anyhow!("lockd {} timed out", args.first().copied().unwrap_or("")))??;
        let mut text = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            text.push_str(&String::from_utf8_lossy(&out.stderr));
        }
        Ok((out.status.success(), text))
    }

    pub(super) async fn status(&self) -> Result<StatusReport> {
        let ep = self.endpoint();
        let (ok, text) = self
            .cmd(&["status", "--connect", &ep], Duration::from_secs(3))
            .await?;
        if !ok {
            bail!("lockd status failed: {}", text.trim());
        }
        Ok(serde_json::from_str(text.trim())?)
    }

    pub(super) fn start_watch(&mut self) -> Result<()> {
        // The previous watch ends by itself once its lockd died; its reader still delivers
        // what it printed before (a grant right before a lockd crash), in order.
        self.old_watches
            .retain_mut(|w| matches!(w.try_wait(), Ok(None)));
        if let Some(w) = self.watch.take() {
            self.old_watches.push(w);
        }
        let mut c = Command::new(&self.bin);
        let (_, err) = log_file(&self.logs, "lockd-watch.log")?;
        c.arg("watch")
            .arg("--connect")
            .arg(self.endpoint())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true);
        let mut child = c.spawn().context("starting lockd watch")?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("no stdout from lockd watch"))?;
        let tx = match &self.watch_tx {
            Some(tx) => tx.clone(),
            None => {
                let (tx, rx) = mpsc::unbounded_channel();
                self.watch_rx = Some(rx);
                self.watch_tx = Some(tx.clone());
                tx
            }
        };
        let fence = Arc::clone(&self.fence);
        let log = self.logs.join("lockd-watch.events");
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            let mut logf = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .ok();
            while let Ok(Some(line)) = lines.next_line().await {
                let seen = now_us();
                let Some(ev) = observe::parse_watch_line(&line) else {
                    continue;
                };
                let grant = (ev.is_grant() && ev.resource.as_deref().is_none_or(|r| r == RESOURCE))
                    .then(|| {
                        // The fencing check, as close to the grant as the drill can see it.
                        let (engine_id, checked, alive) = match fence.lock() {
                            Ok(f) if !ev.reclaimed => (
                                f.holder.map(|h| h.0),
                                f.pids.len(),
                                f.pids
                                    .iter()
                                    .filter(|p| p.is_alive())
                                    .map(|p| p.pid as u32)
                                    .collect(),
                            ),
                            Ok(f) => (f.holder.map(|h| h.0), 0, Vec::new()),
                            Err(_) => (None, 0, Vec::new()),
                        };
                        GrantObs {
                            seen_at_unix_us: seen,
                            epoch: ev.epoch,
                            holder: ev.holder.clone(),
                            reclaimed: ev.reclaimed,
                            previous_engine_id: engine_id,
                            previous_alive_pids: alive,
                            previous_checked: checked,
                        }
                    });
                if let Some(f) = logf.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(f, "{seen} {line}");
                }
                if tx.send(WatchMsg { grant }).is_err() {
                    break;
                }
            }
        });
        if let Some(p) = child.id() {
            self.pgids.push(p);
        }
        self.watch = Some(child);
        Ok(())
    }

    /// `lockd revoke` of the resource; with `retry`, tried again every 2 ms until it succeeds
    /// or `timeout` passes (lockd just restarted: its socket may not accept yet).
    pub(super) async fn revoke(
        &self,
        timeout: Duration,
        retry: bool,
    ) -> std::result::Result<(), String> {
        let ep = self.endpoint();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let err = match self
                .cmd(
                    &[
                        "revoke",
                        "--connect",
                        &ep,
                        "--resource",
                        RESOURCE,
                        "--reason",
                        "supervisor drill",
                    ],
                    left.max(Duration::from_millis(100)),
                )
                .await
            {
                Ok((true, _)) => return Ok(()),
                Ok((false, t)) => format!("lockd revoke failed: {}", t.trim()),
                Err(e) => format!("lockd revoke: {e:#}"),
            };
            if !retry || Instant::now() >= deadline {
                return Err(err);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// lockd runs but its watch ended (it could not connect): the watch must be started again.
    pub(super) fn watch_needs_restart(&mut self) -> bool {
        let lockd_up = self
            .child
            .as_mut()
            .is_some_and(|l| matches!(l.try_wait(), Ok(None)));
        let watch_dead = self
            .watch
            .as_mut()
            .is_some_and(|w| !matches!(w.try_wait(), Ok(None)));
        lockd_up && watch_dead
    }

    /// The grants the watch readers delivered since the last call, in order.
    pub(super) fn take_grants(&mut self) -> Vec<GrantObs> {
        let mut out = Vec::new();
        if let Some(rx) = self.watch_rx.as_mut() {
            while let Ok(m) = rx.try_recv() {
                out.extend(m.grant);
            }
        }
        out
    }

    /// Ends the watches and lockd (each wait bounded).
    pub(super) async fn shutdown(&mut self) {
        for mut w in self
            .watch
            .take()
            .into_iter()
            .chain(self.old_watches.drain(..))
        {
            let _ = w.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(2), w.wait()).await;
        }
        if let Some(mut l) = self.child.take() {
            let _ = l.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(2), l.wait()).await;
        }
    }
}
