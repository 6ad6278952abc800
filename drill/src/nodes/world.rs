//! The drill's world across nodes: network namespaces on a bridge ([`harness::netns`]), a
//! 3-member etcd on the bridge's address (root namespace), and per node (namespace) a
//! `lockd serve --backend etcd`, a `supervisor run --lock-watchdog` and its fake engine. All
//! fake engines share one GPU claim file (the filesystem is shared: only the network is per
//! node), so two engines holding the "GPU" at once is seen by the engines themselves.
//! Everything is killed and deleted on drop: processes first, then the namespaces and the
//! bridge, then the directory.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use harness::etcd::Etcd;
use harness::netns::{Net, NetnsError};
use harness::proc::Proc;
use lockd::etcd::LeaderChange;
use nix::sys::signal::Signal;
use probes::{Phase, StateDoc};
use procfs::Pinned;

/// The lock resource every side uses.
pub const RESOURCE: &str = "gpu";
/// lockd's key prefix of that resource in etcd (its default `--etcd-prefix`).
pub const KEY_PREFIX: &str = "/lockd/gpu/";

/// How the world is configured.
#[derive(Debug, Clone)]
pub struct Config {
    /// Nodes (namespaces), each with lockd + supervisor + engine: 2 or more.
    pub nodes: usize,
    /// lockd `--etcd-ttl`.
    pub ttl: Duration,
    /// lockd `--etcd-kill-time`.
    pub kill_time: Duration,
    /// lockd `--etcd-pause`.
    pub pause: Duration,
    /// lockd `--etcd-drift-ppm`.
    pub drift_ppm: u32,
    /// supervisor `--lock-watchdog` (None: not passed; the planted "watchdog disabled").
    pub watchdog: Option<Duration>,
    /// Extra environment of every lockd (e.g. a planted bug's switch).
    pub lockd_env: Vec<(String, String)>,
    /// etcd `--election-timeout` (its `--heartbeat-interval` is a tenth of it).
    pub election: Duration,
    /// lockd `--etcd-leader-change`.
    pub leader_change: LeaderChange,
    /// Keep the directory (logs) after the run.
    pub keep_dir: bool,
    /// Keep it also when a trial violates an invariant (for the diagnosis); off where
    /// violations are the expected result (planted-bug tests), so they leave nothing behind.
    pub keep_on_violation: bool,
}

/// Why the world could not start: `Skip` when this machine cannot run it at all.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No namespaces or no etcd here: the caller prints SKIP with this reason.
    #[error("{0}")]
    Skip(String),
    /// Anything else.
    #[error(transparent)]
    Failed(#[from] anyhow::Error),
}

/// The binaries the world runs (next to the running executable).
#[derive(Debug, Clone)]
pub struct Bins {
    lockd: PathBuf,
    supervisor: PathBuf,
    fake_engine: PathBuf,
}

impl Bins {
    fn find() -> Result<Bins> {
        Ok(Bins {
            lockd: harness::bin("lockd")?,
            supervisor: harness::bin("supervisor")?,
            fake_engine: harness::bin("fake-engine")?,
        })
    }
}

/// One life of a node's supervisor + engine.
pub struct Side {
    /// The supervisor (`ip netns exec` execs it: this is its pid and process group).
    pub proc: Proc,
    /// Its probe server, on the node's address.
    pub probes: SocketAddr,
    /// Its engine's HTTP address (the node's address too).
    pub engine: SocketAddr,
    /// The engine's pid file.
    pub pid_file: PathBuf,
    claim: PathBuf,
}

impl Side {
    /// `/state`, None while nothing answers (bounded by the harness's HTTP timeout).
    pub fn state(&self) -> Option<StateDoc> {
        harness::supervisor::state_of(self.probes)
    }

    /// Its phase now.
    pub fn phase(&self) -> Option<Phase> {
        self.state().map(|s| s.state)
    }

    /// One completion from the engine (as the other drill sends one to each new Active): a
    /// primary's engine that never slept takes the GPU claim at its first completion, so
    /// without it the claim would prove nothing. Whether it answered 200.
    pub fn serve_one(&self) -> bool {
        harness::http::post_json(
            &format!("http://{}/v1/completions", self.engine),
            r#"{"prompt":"hi","max_tokens":1}"#,
            Duration::from_secs(5),
        )
        .is_some_and(|r| r.status == 200)
    }

    /// The engine's processes (pid file, `/state.engine_pid` and its descendants), pinned,
    /// only those that are still this world's fake engines.
    pub fn engine_pids(&self) -> Vec<Pinned> {
        let mut pids: Vec<i32> = harness::supervisor::read_pid_file(&self.pid_file);
        if let Some(p) = self.state().and_then(|s| s.engine_pid) {
            pids.push(p as i32);
            pids.extend(procfs::tree(p as i32));
        }
        pids.sort_unstable();
        pids.dedup();
        let tag = self.claim.to_string_lossy().into_owned();
        pids.into_iter()
            .filter(|p| procfs::cmdline(*p).contains(&tag))
            .filter_map(Pinned::pin)
            .collect()
    }
}

impl Drop for Side {
    /// The container's end: the supervisor's group, then every engine process left.
    fn drop(&mut self) {
        self.proc.kill();
        let tag = self.claim.to_string_lossy().into_owned();
        for p in harness::supervisor::read_pid_file(&self.pid_file) {
            if procfs::alive(p) && procfs::cmdline(p).contains(&tag) {
                harness::kill(p, Signal::SIGKILL);
            }
        }
    }
}

/// One node: its lockd and its current side.
pub struct Node {
    /// Index (namespace `…nI`, engine id I).
    pub idx: usize,
    /// Its directory (lockd socket, pid files, logs).
    pub dir: PathBuf,
    /// Its lockd.
    pub lockd: Option<Proc>,
    /// Its supervisor + engine, while started.
    pub side: Option<Side>,
    /// Sides started so far (names logs, picks ports).
    pub lives: u32,
}

impl Node {
    /// `unix:` endpoint of its lockd.
    pub fn lockd_sock(&self) -> PathBuf {
        self.dir.join("lockd.sock")
    }
}

/// The world. Fields drop in order: sides and lockds, etcd, then the namespaces, then the
/// directory.
pub struct World {
    /// The nodes.
    pub nodes: Vec<Node>,
    /// The etcd members (root namespace, on the bridge's address).
    pub etcd: Vec<Etcd>,
    /// The namespaces and the bridge.
    pub net: Net,
    /// Configuration.
    pub cfg: Config,
    bins: Bins,
    /// The fake engines' GPU claim.
    pub claim: PathBuf,
    /// Lines of its violations file already reported.
    pub claims_seen: usize,
    /// lockd fences its holders at an etcd leader change (`--etcd-leader-change` resolved
    /// against this etcd's version): the etcd kinds may then fail over, safely.
    pub leader_change_fences: bool,
    dir: Option<tempfile::TempDir>,
}

impl World {
    /// Namespaces, etcd, and every node's lockd (started and answering); no sides yet.
    pub fn start(cfg: Config) -> Result<World, StartError> {
        let bins = Bins::find()?;
        if harness::etcd::binary().is_none() {
            return Err(StartError::Skip(
                "no etcd binary (apt-get install etcd-server; .ci/run installs it)".into(),
            ));
        }
        if cfg.nodes < 2 {
            return Err(anyhow!("at least 2 nodes").into());
        }
        let net = Net::create(cfg.nodes).map_err(|e| match e {
            NetnsError::Unsupported(why) => StartError::Skip(why),
            e => StartError::Failed(e.into()),
        })?;
        let dir = tempfile::Builder::new()
            .prefix("drill-nodes-")
            .tempdir()
            .context("temp dir")?;
        let (el, hb) = (
            cfg.election.as_millis().to_string(),
            (cfg.election.as_millis() / 10).max(1).to_string(),
        );
        let tuning = ["--election-timeout", &el, "--heartbeat-interval", &hb];
        let etcd = Etcd::start_cluster_on(dir.path(), 3, net.host_addr, &tuning)
            .ok_or_else(|| anyhow!("etcd vanished"))?;
        let claim = dir.path().join("gpu.claim");
        // What lockd's `auto` resolves to on this etcd (lockd reads the same version from
        // etcd's Status at start).
        let etcd_version = harness::etcd::version().unwrap_or_default();
        let leader_change_fences = cfg.leader_change.fences(&etcd_version);
        let mut w = World {
            leader_change_fences,
            nodes: Vec::new(),
            etcd,
            net,
            cfg,
            bins,
            claim,
            claims_seen: 0,
            dir: Some(dir),
        };
        for i in 0..w.cfg.nodes {
            let d = w.path().join(format!("node{i}"));
            std::fs::create_dir_all(&d).map_err(anyhow::Error::from)?;
            w.nodes.push(Node {
                idx: i,
                dir: d,
                lockd: None,
                side: None,
                lives: 0,
            });
            w.start_lockd(i)?;
        }
        Ok(w)
    }

    /// The world's directory.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/"), |d| d.path())
    }

    /// etcd client URLs, comma-separated.
    pub fn etcd_urls(&self) -> String {
        let v: Vec<&str> = self.etcd.iter().map(|e| e.client_url.as_str()).collect();
        v.join(",")
    }

    /// The etcd member node `i`'s lockd lists first (its keepalive streams' member until one
    /// stops answering), as a node lists its nearest member first: node `i` starts at member
    /// `i + 1` (member 0 usually wins the first election, so node 0, the first holder, starts
    /// on a follower and a `follower-pause` has its streams to move).
    pub fn first_endpoint_of(&self, i: usize) -> usize {
        (i + 1) % self.etcd.len().max(1)
    }

    /// Node `i`'s lockd's `--etcd-endpoints`: every member, from its first one on.
    fn etcd_urls_of(&self, i: usize) -> String {
        let n = self.etcd.len();
        let v: Vec<&str> = (0..n)
            .map(|k| {
                self.etcd[(self.first_endpoint_of(i) + k) % n]
                    .client_url
                    .as_str()
            })
            .collect();
        v.join(",")
    }

    /// The node's address on the bridge.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        self.net.nodes[i].addr
    }

    /// (Re)starts node `i`'s lockd in its namespace and waits (20 s) until it answers.
    pub fn start_lockd(&mut self, i: usize) -> Result<()> {
        if let Some(mut p) = self.nodes[i].lockd.take() {
            p.kill();
        }
        let sock = self.nodes[i].lockd_sock();
        let _ = std::fs::remove_file(&sock);
        let mut c = self.net.command_in(i, &self.bins.lockd);
        c.args(["serve", "--backend", "etcd", "--etcd-endpoints"])
            .arg(self.etcd_urls_of(i))
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .args(["--etcd-node", &format!("n{i}")])
            .arg("--etcd-ttl")
            .arg(fmt(self.cfg.ttl))
            .arg("--etcd-kill-time")
            .arg(fmt(self.cfg.kill_time))
            .arg("--etcd-pause")
            .arg(fmt(self.cfg.pause))
            .args(["--etcd-drift-ppm", &self.cfg.drift_ppm.to_string()])
            .args(["--etcd-leader-change", self.cfg.leader_change.as_str()]);
        for (k, _) in std::env::vars() {
            if k.starts_with("LOCKD_") {
                c.env_remove(k);
            }
        }
        c.env("LOCKD_LOG", "info");
        for (k, v) in &self.cfg.lockd_env {
            c.env(k, v);
        }
        let log = self.nodes[i].dir.join("lockd.log");
        let p = Proc::try_spawn_appending(&format!("lockd-n{i}"), c, log)?;
        self.nodes[i].lockd = Some(p);
        harness::lockd::wait_ready(&sock, Duration::from_secs(20)).map_err(|e| {
            anyhow!(
                "lockd on node {i} not ready: {e}\n{}",
                self.log_tail(&self.nodes[i].dir.join("lockd.log"))
            )
        })?;
        Ok(())
    }

    /// Starts a new life of node `i`'s side (`primary` or `shadow`); does not wait.
    pub fn start_side(&mut self, i: usize, role: &str) -> Result<()> {
        self.nodes[i].side = None;
        self.nodes[i].lives += 1;
        let n = self.nodes[i].lives;
        let node = &self.nodes[i];
        let probes = SocketAddr::from((self.addr(i), 9100 + n as u16));
        let engine = SocketAddr::from((self.addr(i), 8100 + n as u16));
        let pid_file = node.dir.join(format!("engine.{n}.pids"));
        let mut c = self.net.command_in(i, &self.bins.supervisor);
        c.arg("run")
            .args(["--engine-id", &i.to_string(), "--role", role])
            .arg("--lock")
            .arg(format!("unix:{}", node.lockd_sock().display()))
            .args(["--resource", RESOURCE])
            .args(["--probes", &probes.to_string(), "--adapter", "vllm"])
            .args(["--engine-url", &format!("http://{engine}")])
            .args(["--health-interval", "200ms", "--startup-poll", "20ms"])
            .args(["--restart", "never"])
            .arg("--engine-tmpdir")
            .arg(node.dir.join("t"));
        if let Some(w) = self.cfg.watchdog {
            c.arg("--lock-watchdog").arg(fmt(w));
        }
        c.arg("--")
            .arg(&self.bins.fake_engine)
            .args(["--host", &engine.ip().to_string()])
            .args(["--port", &engine.port().to_string()])
            .args(["--engine-id", &i.to_string()])
            .arg("--gpu-claim")
            .arg(&self.claim)
            .arg("--pid-file")
            .arg(&pid_file);
        for (k, _) in std::env::vars() {
            let planted = k.starts_with("SUPERVISOR_PLANTED_BUG_");
            if (k.starts_with("SUPERVISOR_") && !planted)
                || k.starts_with("FAKE_ENGINE_")
                || k.starts_with("LOCKD_")
                || k == "ENGINE_ID"
            {
                c.env_remove(k);
            }
        }
        let log = node.dir.join(format!("supervisor.{n}.log"));
        let proc = Proc::try_spawn_appending(&format!("supervisor-n{i}.{n}"), c, log)?;
        self.nodes[i].side = Some(Side {
            proc,
            probes,
            engine,
            pid_file,
            claim: self.claim.clone(),
        });
        Ok(())
    }

    /// Node 0 primary (Active), every other node shadow (Standby), each bounded by `limit`.
    pub fn bring_up(&mut self, limit: Duration) -> Result<()> {
        self.start_side(0, "primary")?;
        self.wait_phase(0, Phase::Active, limit)?;
        for i in 1..self.nodes.len() {
            self.start_side(i, "shadow")?;
        }
        for i in 1..self.nodes.len() {
            self.wait_phase(i, Phase::Standby, limit)?;
        }
        Ok(())
    }

    /// Waits until node `i`'s side is in `phase`.
    pub fn wait_phase(&self, i: usize, phase: Phase, limit: Duration) -> Result<()> {
        let side = self.nodes[i]
            .side
            .as_ref()
            .ok_or_else(|| anyhow!("node {i} has no side"))?;
        if harness::wait_until(limit, Duration::from_millis(20), || {
            side.phase() == Some(phase)
        }) {
            return Ok(());
        }
        bail!(
            "node {i} not {} within {limit:?} (now {:?})\n{}",
            phase.as_str(),
            side.phase(),
            self.log_tail(&side.proc.log)
        )
    }

    /// Until `limit`: exactly one side Active and at least one other Standby; the Active
    /// node. Sides that exited (fenced) or never came up are restarted as shadows.
    pub fn wait_steady(&mut self, limit: Duration) -> Result<usize> {
        let end = std::time::Instant::now() + limit;
        loop {
            let mut active = Vec::new();
            let mut standby = 0;
            for i in 0..self.nodes.len() {
                let exited = match self.nodes[i].side.as_mut() {
                    None => true,
                    Some(s) => s.proc.exited(),
                };
                if exited {
                    self.start_side(i, "shadow")?;
                    continue;
                }
                match self.nodes[i].side.as_ref().and_then(Side::phase) {
                    Some(Phase::Active) => active.push(i),
                    Some(Phase::Standby) => standby += 1,
                    _ => {}
                }
            }
            if active.len() == 1 && standby >= 1 {
                return Ok(active[0]);
            }
            if std::time::Instant::now() >= end {
                bail!(
                    "no steady state (one Active, one Standby) within {limit:?}: active {active:?}, standby {standby}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every etcd member is healthy again (bounded).
    pub fn wait_etcd_healthy(&self, limit: Duration) -> bool {
        harness::wait_until(limit, Duration::from_millis(100), || {
            self.etcd.iter().all(Etcd::healthy)
        })
    }

    /// The GPU claim's violations file so far (lines).
    pub fn claim_violations(&self) -> Vec<String> {
        let mut p = self.claim.clone().into_os_string();
        p.push(".violations");
        std::fs::read_to_string(PathBuf::from(p))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `etcdctl` against this world's etcd (None without etcdctl).
    pub fn etcdctl(&self) -> Option<Command> {
        self.etcdctl_at(&self.etcd_urls())
    }

    /// Each member's client URL.
    pub fn etcd_url_list(&self) -> Vec<String> {
        self.etcd.iter().map(|e| e.client_url.clone()).collect()
    }

    /// `etcdctl` against these endpoints only.
    pub fn etcdctl_at(&self, endpoints: &str) -> Option<Command> {
        let mut c = Command::new(harness::etcd::etcdctl()?);
        c.env("ETCDCTL_API", "3")
            .args(["--endpoints", endpoints, "--command-timeout", "3s"]);
        Some(c)
    }

    /// The lock's owner key now (lowest create revision under [`KEY_PREFIX`]).
    pub fn owner_key(&self) -> Option<String> {
        let out = self
            .etcdctl()?
            .args(["get", "--prefix", KEY_PREFIX, "--keys-only"])
            .args(["--sort-by=CREATE", "--order=ASCEND", "--limit=1"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| !l.trim().is_empty())
            .map(str::to_string)
    }

    /// The last lines of a log.
    pub fn log_tail(&self, p: &Path) -> String {
        let t = std::fs::read_to_string(p).unwrap_or_default();
        let lines: Vec<&str> = t.lines().collect();
        let from = lines.len().saturating_sub(30);
        format!("--- {} ---\n{}", p.display(), lines[from..].join("\n"))
    }

    /// The tails of every node's logs (for an error).
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for n in &self.nodes {
            s.push_str(&self.log_tail(&n.dir.join("lockd.log")));
            s.push('\n');
            if let Some(side) = &n.side {
                s.push_str(&self.log_tail(&side.proc.log));
                s.push('\n');
            }
        }
        s
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Sides and lockds before the namespaces they run in.
        for n in &mut self.nodes {
            n.side = None;
            if let Some(mut p) = n.lockd.take() {
                p.kill();
            }
        }
        for e in &mut self.etcd {
            e.resume();
            e.kill();
        }
        if self.cfg.keep_dir {
            if let Some(d) = self.dir.take() {
                eprintln!("drill across nodes: kept {}", d.keep().display());
            }
        }
    }
}

/// A duration as lockd and the supervisor parse it (`1500ms`).
pub fn fmt(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}
