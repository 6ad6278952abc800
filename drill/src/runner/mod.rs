//! The orchestration of a drill: processes, rounds, observation, kubelet emulation, cleanup.
//! Judging is done by [`super::invariants`]; numbers and output by [`super::report`].

use std::collections::HashMap;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};

mod kubelet;
mod lock_daemon;
mod side;

use lock_daemon::LockdProc;
use side::{Inc, Launch};

use crate::invariants::{self, ClaimViolation, FinalActive, GrantObs, LifeTransitions, RoundObs};
use crate::observe;
use crate::procs::{self, now_us, Pinned};
use crate::report::{self, CompoundRecord, Report, RoundRecord};
use crate::schedule::{self, EngineConfig, FailureKind, Order};
use crate::{
    DrillArgs, EXIT_DRILL_ERROR, EXIT_OK, EXIT_VIOLATION, PLANTED_BUG_ENV, PLANTED_NO_ANCHOR_ENV,
};
use probes::{MarkKind, Phase, StateDoc};

/// The lock resource the drilled supervisors share.
const RESOURCE: &str = "engine";
/// Polling period of the fast waits inside compound rounds (reclaim seen, standby Waking).
const FAST_POLL: Duration = Duration::from_millis(1);
/// One probe request's time limit.
const HTTP_TIMEOUT: Duration = Duration::from_millis(500);
/// Total memory of the simulated device of `--gpu-sim`: 80 GiB.
const GPU_SIM_TOTAL: u64 = 80 << 30;

/// The append-mode log file `logs/name`, as stdout and stderr of a child.
fn log_file(logs: &Path, name: &str) -> Result<(Stdio, Stdio)> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(logs.join(name))?;
    let g = f.try_clone()?;
    Ok((Stdio::from(f), Stdio::from(g)))
}

/// A command in its own process group, logging to `logs/log`, killed when dropped.
fn log_command(program: &Path, logs: &Path, log: &str) -> Result<Command> {
    let mut c = Command::new(program);
    let (out, err) = log_file(logs, log)?;
    c.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true);
    Ok(c)
}

/// Entry point used by [`super::run`]: never panics on outside input; returns the exit code.
pub(super) async fn run(args: DrillArgs) -> i32 {
    let mut drill = match Drill::new(args) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("supervisor drill: {e:#}");
            return EXIT_DRILL_ERROR;
        }
    };
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let outcome: std::result::Result<Result<()>, i32> = {
        let fut = drill.execute();
        tokio::pin!(fut);
        tokio::select! {
            r = &mut fut => Ok(r),
            _ = async { match sigint.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => Err(130),
            _ = async { match sigterm.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => Err(143),
        }
    };
    drill.cleanup().await;
    drill.finish(outcome)
}

/// The three binaries a drill runs.
#[derive(Debug, Clone)]
struct Bins {
    /// `supervisor` (normally next to this executable).
    supervisor: PathBuf,
    /// `lockd`.
    lockd: PathBuf,
    /// `fake-engine`, unless a real engine command is drilled.
    fake_engine: Option<PathBuf>,
}

fn find_bin(explicit: Option<&PathBuf>, name: &str) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.clone())
        } else {
            Err(anyhow!("{} does not exist", p.display()))
        };
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
        // `cargo test` binaries live in target/<profile>/deps: look one level up too.
        if let Some(up) = dir.parent() {
            let p = up.join(name);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(anyhow!(
        "cannot find `{name}` next to this executable or on $PATH (build it, or pass --{name}-bin)"
    ))
}

/// Splits a command line like a POSIX shell would for words and quotes (no expansions).
pub(super) fn split_command(s: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(x) => cur.push(x),
                        None => bail!("unterminated ' in {s:?}"),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(x) => cur.push(x),
                            None => bail!("trailing \\ in {s:?}"),
                        },
                        Some(x) => cur.push(x),
                        None => bail!("unterminated \" in {s:?}"),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(x) => cur.push(x),
                    None => bail!("trailing \\ in {s:?}"),
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// Where the drill is, for the restart policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Before round `r` (or setting up for it).
    Between(usize),
    /// Inside round `r`.
    InRound(usize),
    /// Shutting down: no restarts.
    Stopping,
}

/// One drill: its settings, its processes and what it has seen so far.
struct Drill {
    /// The command line.
    args: DrillArgs,
    /// supervisor / lockd / fake-engine paths.
    bins: Bins,
    /// The kinds drilled (after `--engine-cmd` filtering), for the report.
    kinds: Vec<FailureKind>,
    /// Seed of the random order (printed, in the report).
    seed: u64,
    /// The kind of every round, decided up front so engines can be configured ahead.
    sched: Vec<FailureKind>,
    /// The temporary directory (socket, state file, claim file, pid files, logs).
    dir: PathBuf,
    /// The fake engines' shared GPU claim file (`.violations` next to it).
    claim: PathBuf,
    /// The drill's lockd (serve + watch).
    lockd: LockdProc,
    /// The running life of engine 0 and engine 1 ("containers").
    sides: [Option<Inc>; 2],
    /// Lives that ended (kept for the round's analysis and for cleanup).
    retired: Vec<Inc>,
    /// Next incarnation number of each engine.
    next_n: [u32; 2],
    /// Every engine process ever tracked, for cleanup.
    all_pids: Vec<Pinned>,
    /// Every process group started (supervisors, lockd, watch), for cleanup.
    sup_pgids: Vec<u32>,
    /// Where the drill is (decides how a restarted side is configured).
    stage: Stage,
    /// Newest epoch seen (grants and /state), for the strictly-increasing check.
    last_epoch: Option<u64>,
    /// Grants seen since the current round began.
    grants: Vec<GrantObs>,
    /// A new grant (epoch, holder) whose engine life is not identified yet.
    pending_grant: Option<(Option<u64>, Option<String>)>,
    /// Holder names learnt from grants, to engine ids.
    holder_names: HashMap<String, u64>,
    /// Every finished round.
    records: Vec<RoundRecord>,
    /// The progress bar on a terminal.
    progress: Option<indicatif::ProgressBar>,
    /// The planted-bug switch is set in our environment (reported, warned about).
    planted: bool,
    /// Wall-clock start, for the report.
    started_us: u64,
    /// Why the drill stopped early, if it did.
    aborted: Option<String>,
    /// Things seen during the current round that are worth a note in its record.
    round_notes: Vec<String>,
    /// `--load` busy loops.
    load: Vec<Child>,
    /// `--gpu-sim`: the simulated device's directory.
    gpu_sim: Option<PathBuf>,
    /// When the first round began (rounds per minute).
    rounds_started: Option<Instant>,
    /// When the last round ended.
    rounds_ended: Option<Instant>,
}

impl Drill {
    fn new(args: DrillArgs) -> Result<Drill> {
        let kinds = schedule::parse_kinds(&args.kinds)?;
        if args.engine_cmd.is_some() {
            if let Some(k) = kinds.iter().find(|k| k.needs_fake_engine()) {
                if args
                    .kinds
                    .iter()
                    .any(|s| s.split(',').any(|x| x.trim() == k.name()))
                {
                    bail!("--kinds {k} needs fake-engine flags and cannot drill --engine-cmd");
                }
            }
        }
        let kinds: Vec<FailureKind> = if args.engine_cmd.is_some() {
            kinds
                .into_iter()
                .filter(|k| !k.needs_fake_engine())
                .collect()
        } else {
            kinds
        };
        if kinds.is_empty() {
            bail!("no failure kind left to drill");
        }
        let seed = args
            .seed
            .unwrap_or_else(|| now_us() ^ (u64::from(std::process::id()) << 32));
        let sched = schedule::schedule(&kinds, args.order, args.iterations as usize, seed);
        let supervisor = find_bin(args.supervisor_bin.as_ref(), "supervisor")?;
        let bins = Bins {
            supervisor,
            lockd: find_bin(args.lockd_bin.as_ref(), "lockd")?,
            fake_engine: if args.engine_cmd.is_some() {
                None
            } else {
                Some(find_bin(args.fake_engine_bin.as_ref(), "fake-engine")?)
            },
        };
        if let Some(cmd) = &args.engine_cmd {
            if split_command(cmd)?.is_empty() {
                bail!("--engine-cmd is empty");
            }
        }
        // Unix socket paths are limited to ~108 bytes: keep the directory short.
        let base = std::env::temp_dir();
        let base = if base.as_os_str().len() > 60 {
            PathBuf::from("/tmp")
        } else {
            base
        };
        let dir = base.join(format!(
            "supervisor-drill-{}-{:x}",
            std::process::id(),
            now_us() & 0xffffff
        ));
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        if let Err(e) = procs::become_subreaper() {
            eprintln!("supervisor drill: cannot become a child subreaper ({e}); orphans may escape cleanup");
        }
        let planted = [PLANTED_BUG_ENV, PLANTED_NO_ANCHOR_ENV]
            .iter()
            .any(|k| std::env::var(k).is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false")));
        let progress = if !args.plain && std::io::stderr().is_terminal() {
            let pb = indicatif::ProgressBar::new(u64::from(args.iterations));
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}",
            ) {
                pb.set_style(style);
            }
            // Keeps the spinner and clock moving through long rounds (hung wakes).
            pb.enable_steady_tick(Duration::from_millis(200));
            Some(pb)
        } else {
            None
        };
        Ok(Drill {
            lockd: LockdProc::new(bins.lockd.clone(), &dir, args.reconnect_window),
            claim: dir.join("gpu.claim"),
            dir,
            args,
            bins,
            kinds,
            seed,
            sched,
            sides: [None, None],
            retired: Vec::new(),
            next_n: [0, 0],
            all_pids: Vec::new(),
            sup_pgids: Vec::new(),
            stage: Stage::Between(0),
            last_epoch: None,
            grants: Vec::new(),
            pending_grant: None,
            holder_names: HashMap::new(),
            records: Vec::new(),
            progress,
            planted,
            started_us: now_us(),
            aborted: None,
            round_notes: Vec::new(),
            load: Vec::new(),
            gpu_sim: None,
            rounds_started: None,
            rounds_ended: None,
        })
    }

    fn say(&self, line: &str) {
        match &self.progress {
            Some(pb) => pb.println(line),
            None => println!("{line}"),
        }
    }

    // ---------------------------------------------------------------- processes

    /// `--load N`: N CPU-bound busy loops, each in its own process group (killed with the
    /// drill's other groups at every exit path; PDEATHSIG if the drill itself dies).
    fn start_load(&mut self) -> Result<()> {
        for i in 0..self.args.load {
            let mut c = Command::new("sh");
            c.args(["-c", "while :; do :; done"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .kill_on_drop(true);
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                c.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = c
                .spawn()
                .with_context(|| format!("starting load loop {i}"))?;
            if let Some(p) = child.id() {
                self.sup_pgids.push(p);
            }
            self.load.push(child);
        }
        Ok(())
    }

    /// `--gpu-sim`: the simulated device's directory with its total.
    fn setup_gpu_sim(&mut self) -> Result<()> {
        if !self.args.gpu_sim {
            return Ok(());
        }
        let d = self.dir.join("gpu-sim");
        gms_client::simdev::set_total(&d, GPU_SIM_TOTAL)
            .with_context(|| format!("creating {}", d.display()))?;
        self.gpu_sim = Some(d);
        Ok(())
    }

    /// Polls one side's `/state` every [`FAST_POLL`] until `pred` holds (true) or the
    /// deadline passes (false). Only that side is polled: used between the two failures of
    /// a compound round, where a full tick would add its latency to the window.
    async fn poll_side_until(
        &mut self,
        side: usize,
        deadline: Instant,
        pred: impl Fn(&StateDoc) -> bool,
    ) -> bool {
        loop {
            let addr = self.sides[side]
                .as_ref()
                .filter(|i| i.exited.is_none())
                .map(|i| i.probes);
            if let Some(doc) = poll_state(addr).await {
                let ok = pred(&doc);
                if let Some(i) = self.sides[side].as_mut() {
                    i.set_state(doc);
                }
                if ok {
                    return true;
                }
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(FAST_POLL).await;
        }
    }

    fn start_side(&mut self, side: usize, role: &str, cfg: EngineConfig) -> Result<()> {
        let n = self.next_n[side];
        self.next_n[side] += 1;
        let launch = Launch {
            args: &self.args,
            bins: &self.bins,
            dir: &self.dir,
            claim: &self.claim,
            gpu_sim: self.gpu_sim.as_deref(),
            endpoint: self.lockd.endpoint(),
        };
        let inc = launch.start(side as u64, n, role, cfg)?;
        self.sup_pgids.push(inc.sup_pid);
        self.sides[side] = Some(inc);
        Ok(())
    }

    /// The configuration a side restarted now gets (see schedule.rs).
    fn restart_config(&self, side: usize) -> EngineConfig {
        match self.stage {
            Stage::InRound(r) => {
                let other_hangs = self.sides[1 - side]
                    .as_ref()
                    .is_some_and(|o| o.config.hung_wake && !o.finished());
                if self.sched.get(r) == Some(&FailureKind::HungWake) && other_hangs {
                    schedule::active_config(&self.sched, r + 1)
                } else {
                    schedule::standby_config(&self.sched, r + 1)
                }
            }
            Stage::Between(r) => schedule::standby_config(&self.sched, r),
            Stage::Stopping => EngineConfig::default(),
        }
    }

    // ---------------------------------------------------------------- observation

    async fn tick(&mut self) {
        // 0. A watch that ended while lockd runs (it could not connect) is started again.
        if self.stage != Stage::Stopping && self.lockd.watch_needs_restart() {
            self.round_notes
                .push("lockd watch ended while lockd ran; restarted".into());
            if let Err(e) = self.lockd.start_watch() {
                self.say(&format!("drill: cannot restart lockd watch: {e:#}"));
            }
        }
        // 1. Lock events.
        for g in self.lockd.take_grants() {
            if let Some(e) = g.epoch {
                self.last_epoch = Some(self.last_epoch.map_or(e, |l| l.max(e)));
            }
            if !g.reclaimed {
                self.pending_grant = Some((g.epoch, g.holder.clone()));
            }
            self.grants.push(g);
        }
        // 2. Supervisor states.
        let a0 = self.sides[0]
            .as_ref()
            .filter(|i| i.exited.is_none())
            .map(|i| i.probes);
        let a1 = self.sides[1]
            .as_ref()
            .filter(|i| i.exited.is_none())
            .map(|i| i.probes);
        let (s0, s1) = tokio::join!(poll_state(a0), poll_state(a1));
        for (side, s) in [(0usize, s0), (1usize, s1)] {
            if let (Some(inc), Some(s)) = (self.sides[side].as_mut(), s) {
                inc.set_state(s);
            }
        }
        // 3. Exits, engine pids, engine death.
        let now = now_us();
        for side in 0..2 {
            let Some(inc) = self.sides[side].as_mut() else {
                continue;
            };
            if inc.exited.is_none() {
                if let Ok(x) = inc.exit_rx.try_recv() {
                    tracing::info!(engine_id = inc.engine_id, incarnation = inc.n, status = %x.1, "drill: supervisor exited");
                    inc.exited = Some(x);
                }
            }
            let st = inc.phase();
            if matches!(st, Some(Phase::Standby | Phase::Waking | Phase::Active))
                && inc.pids_refreshed_in != st
            {
                inc.pids_refreshed_in = st;
                let before = inc.engine_pids.len();
                inc.refresh_pids();
                if inc.engine_pids.len() != before {
                    for p in &inc.engine_pids[before..] {
                        self.all_pids.push(*p);
                    }
                }
            }
            for p in &inc.engine_pids {
                procs::reap_if_zombie(p);
            }
            if inc.engine_gone_us.is_none()
                && !inc.engine_pids.is_empty()
                && inc.engine_pids.iter().all(|p| !p.is_alive())
            {
                inc.engine_gone_us = Some(now);
            }
        }
        for inc in self.retired.iter_mut() {
            if inc.engine_gone_us.is_none()
                && !inc.engine_pids.is_empty()
                && inc.engine_pids.iter().all(|p| !p.is_alive())
            {
                inc.engine_gone_us = Some(now);
            }
        }
        // 4. A new Active serves one completion (a fake engine takes its GPU claim on wake, or
        //    on first serve when it never slept, as the primary).
        if self.args.engine_cmd.is_none() {
            for side in 0..2 {
                let Some(inc) = self.sides[side].as_mut() else {
                    continue;
                };
                if inc.served || !inc.is(Phase::Active) {
                    continue;
                }
                inc.served = true;
                let addr: SocketAddr = ([127, 0, 0, 1], inc.engine_port).into();
                let body = r#"{"model":"drill","prompt":"drill","max_tokens":1}"#;
                let (eid, n) = (inc.engine_id, inc.n);
                match observe::http_post_json(addr, "/v1/completions", body, HTTP_TIMEOUT).await {
                    Ok(harness::http::Response { status: 200, body }) => {
                        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                        if v.get("engine_id")
                            .and_then(|x| x.as_u64())
                            .is_some_and(|x| x != eid)
                        {
                            self.round_notes.push(format!(
                                "engine {eid}.{n} answered a completion as engine {}",
                                v["engine_id"]
                            ));
                        }
                    }
                    Ok(harness::http::Response { status, body }) => self.round_notes.push(format!(
                        "engine {eid}.{n} is Active but its completion failed ({status}): {}",
                        body.chars().take(200).collect::<String>()
                    )),
                    Err(e) => self.round_notes.push(format!(
                        "engine {eid}.{n} is Active but its completion failed: {e}"
                    )),
                }
            }
        }
        // 5. Who holds the lease now (for the fence check of the next grant).
        self.identify_holder();
        // 6. Kubelet: liveness probes, container teardown and restarts.
        self.kubelet().await;
    }

    fn identify_holder(&mut self) {
        let Some((epoch, holder)) = self.pending_grant.clone() else {
            // Keep the fence's pid list current for the known holder.
            let key = self.lockd.fence.lock().ok().and_then(|f| f.holder);
            if let Some(key) = key {
                if let Some(inc) = self.sides.iter().flatten().find(|i| i.key() == key) {
                    if let Ok(mut f) = self.lockd.fence.lock() {
                        for p in &inc.engine_pids {
                            if !f.pids.contains(p) {
                                f.pids.push(*p);
                            }
                        }
                    }
                }
            }
            return;
        };
        let by_name = holder
            .as_ref()
            .and_then(|h| self.holder_names.get(h).copied());
        // The life whose /state reports the granted epoch (even if it already died: its
        // processes are what the next grant must find dead); without an epoch, the one of the
        // named engine now waking or active.
        let found = self
            .sides
            .iter()
            .flatten()
            .chain(self.retired.iter())
            .find(|i| match epoch {
                Some(e) => {
                    i.state.as_ref().is_some_and(|s| s.epoch == Some(e))
                        && by_name.is_none_or(|eid| i.engine_id == eid)
                }
                None => {
                    matches!(i.phase(), Some(Phase::Waking | Phase::Active))
                        && by_name.is_none_or(|eid| i.engine_id == eid)
                }
            });
        if let Some(inc) = found {
            if let Some(h) = holder {
                self.holder_names.insert(h, inc.engine_id);
            }
            if let Ok(mut f) = self.lockd.fence.lock() {
                f.holder = Some(inc.key());
                f.pids = inc.engine_pids.clone();
            }
            self.pending_grant = None;
        }
    }

    async fn wait_until(&mut self, timeout: Duration, pred: impl Fn(&Drill) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.tick().await;
            if pred(self) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(self.args.poll_interval).await;
        }
    }

    fn side_in(&self, phase: Phase) -> Option<usize> {
        (0..2).find(|s| self.sides[*s].as_ref().is_some_and(|i| i.is(phase)))
    }

    fn steady(&self) -> Option<(usize, usize)> {
        let a = self.side_in(Phase::Active)?;
        let b = 1 - a;
        self.sides[b].as_ref()?.is(Phase::Standby).then_some((a, b))
    }

    fn find_inc(&self, key: (u64, u32)) -> Option<&Inc> {
        self.sides
            .iter()
            .flatten()
            .chain(self.retired.iter())
            .find(|i| i.key() == key)
    }

    fn claim_lines(&self) -> Vec<String> {
        let mut p = self.claim.clone().into_os_string();
        p.push(".violations");
        std::fs::read_to_string(PathBuf::from(p))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    }

    // ---------------------------------------------------------------- the drill

    async fn execute(&mut self) -> Result<()> {
        eprintln!(
            "supervisor drill: {} rounds, kinds {}, order {}, seed {}, dir {}",
            self.args.iterations,
            self.kinds
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .join(","),
            match self.args.order {
                Order::RoundRobin => "round-robin",
                Order::Random => "random",
            },
            self.seed,
            self.dir.display()
        );
        if self.planted {
            eprintln!("supervisor drill: {PLANTED_BUG_ENV} or {PLANTED_NO_ANCHOR_ENV} is set: supervisors built with the planted bugs release the lease too early");
        }
        self.start_load()?;
        self.setup_gpu_sim()?;
        self.lockd.start().await?;
        self.lockd.start_watch()?;
        self.stage = Stage::Between(0);
        self.start_side(0, "primary", schedule::active_config(&self.sched, 0))?;
        let t = self.args.startup_timeout;
        if !self
            .wait_until(t, |d| {
                d.sides[0].as_ref().is_some_and(|i| i.is(Phase::Active))
            })
            .await
        {
            bail!(
                "engine 0 did not become Active within {t:?} (logs in {})",
                self.dir.join("logs").display()
            );
        }
        self.start_side(1, "shadow", schedule::standby_config(&self.sched, 0))?;
        if !self.wait_until(t, |d| d.steady().is_some()).await {
            bail!(
                "engine 1 did not reach Standby within {t:?} (logs in {})",
                self.dir.join("logs").display()
            );
        }
        self.rounds_started = Some(Instant::now());
        let mut last_end = Instant::now();
        for r in 0..self.sched.len() {
            self.stage = Stage::Between(r);
            if let Err(e) = self.prepare(r).await {
                self.aborted = Some(format!("before round {}: {e:#}", r + 1));
                return Err(e);
            }
            self.stage = Stage::InRound(r);
            let mut rec = self.round(r).await?;
            rec.round_wall_us = Some(last_end.elapsed().as_micros() as u64);
            last_end = Instant::now();
            self.rounds_ended = Some(last_end);
            let line = rec.line(self.args.iterations);
            self.say(&line);
            if let Some(pb) = &self.progress {
                pb.inc(1);
                let v: usize = self
                    .records
                    .iter()
                    .map(|r| r.violations.len())
                    .sum::<usize>()
                    + rec.violations.len();
                pb.set_message(format!("{v} violations"));
            }
            let violated = !rec.violations.is_empty();
            self.records.push(rec);
            if violated && self.args.stop_on_violation {
                self.aborted = Some(format!(
                    "stopped after the violation in round {} (--stop-on-violation)",
                    r + 1
                ));
                break;
            }
        }
        Ok(())
    }

    /// Brings the drill to one Active + one Standby configured for round `r`.
    async fn prepare(&mut self, r: usize) -> Result<()> {
        let t = self.args.startup_timeout;
        if !self.wait_until(t, |d| d.steady().is_some()).await {
            self.say("drill: no steady Active + Standby; restarting both sides");
            self.reset().await?;
        }
        let want = schedule::standby_config(&self.sched, r);
        let Some((_, b)) = self.steady() else {
            bail!("lost the steady state")
        };
        if self.sides[b].as_ref().is_some_and(|i| i.config != want) {
            if let Some(i) = self.sides[b].as_mut() {
                procs::signal_pid(i.sup_pid, Signal::SIGTERM);
            }
            let old = self.sides[b].as_ref().map(Inc::key);
            let ok = self
                .wait_until(t, |d| {
                    d.steady().is_some_and(|(_, s)| {
                        d.sides[s]
                            .as_ref()
                            .is_some_and(|i| Some(i.key()) != old && i.config == want)
                    })
                })
                .await;
            if !ok {
                bail!("could not restart the standby with {want:?} within {t:?}");
            }
        }
        Ok(())
    }

    /// Last resort when the sides are stuck: kill both, restart primary + shadow.
    async fn reset(&mut self) -> Result<()> {
        let saved = self.stage;
        self.stage = Stage::Stopping;
        for side in 0..2 {
            if let Some(mut i) = self.sides[side].take() {
                i.teardown();
                self.retired.push(i);
            }
        }
        self.stage = saved;
        let r = match saved {
            Stage::Between(r) => r,
            Stage::InRound(r) => r + 1,
            Stage::Stopping => 0,
        };
        let t = self.args.startup_timeout;
        self.start_side(0, "primary", schedule::active_config(&self.sched, r))?;
        if !self
            .wait_until(t, |d| d.side_in(Phase::Active).is_some())
            .await
        {
            bail!("after a reset no engine became Active within {t:?}");
        }
        let free = (0..2).find(|s| self.sides[*s].is_none());
        if let Some(s) = free {
            self.start_side(s, "shadow", schedule::standby_config(&self.sched, r))?;
        }
        if !self.wait_until(t, |d| d.steady().is_some()).await {
            bail!("after a reset the sides did not reach Active + Standby within {t:?}");
        }
        Ok(())
    }

    async fn round(&mut self, r: usize) -> Result<RoundRecord> {
        let kind = self.sched[r];
        let (a, b) = self
            .steady()
            .ok_or_else(|| anyhow!("not steady at round start"))?;
        let mut notes = Vec::new();
        let victim_key = self.sides[a]
            .as_ref()
            .map(Inc::key)
            .ok_or_else(|| anyhow!("no active"))?;
        let taker_key = self.sides[b].as_ref().map(Inc::key);
        let victim_cfg = self.sides[a].as_ref().map(|i| i.config).unwrap_or_default();
        if kind == FailureKind::DetachedWorker && !victim_cfg.detach_workers {
            notes.push("setup: the Active engine runs without --detach-workers".to_string());
        }
        // Refresh the victim's pids (and the fence) right before the kill.
        if let Some(i) = self.sides[a].as_mut() {
            let before = i.engine_pids.len();
            i.refresh_pids();
            self.all_pids
                .extend(i.engine_pids[before..].iter().copied());
        }
        self.identify_holder();
        let epoch_before = self
            .last_epoch
            .or_else(|| self.sides[a].as_ref().and_then(|i| i.state.as_ref()?.epoch));
        let claim_before = self.claim_lines().len();
        self.grants.clear();
        self.round_notes.clear();
        self.retired.retain(|i| !i.finished() || i.exited.is_none());
        let victim_pid = self.sides[a].as_ref().and_then(|i| {
            i.state
                .as_ref()
                .and_then(|s| s.engine_pid)
                .or_else(|| procs::read_pid_file(&i.pid_file).first().copied())
        });
        let mut bound = self.args.failover_bound;
        if kind == FailureKind::HungWake {
            bound += self.args.hung_waking_timeout;
        }
        let holder_before = if kind == FailureKind::LockdCrash {
            self.lockd
                .status()
                .await
                .ok()
                .and_then(|s| observe::resource(&s, RESOURCE).cloned())
        } else {
            None
        };

        // ---- inject
        let mut t_kill = now_us();
        let mut kill_at = Instant::now();
        let mut comp: Option<CompoundRecord> = kind.is_compound().then(|| CompoundRecord {
            victim_workers_linger: victim_cfg.linger_workers && !self.args.worker_linger.is_zero(),
            ..CompoundRecord::default()
        });
        let mut lockd_killed_us: Option<u64> = None;
        let mut lockd_back_us: Option<u64> = None;
        let mut expected_new_engine_id = None;
        let mut compound_reclaimed: Option<bool> = None;
        let kill_engine = |notes: &mut Vec<String>| -> Result<()> {
            match victim_pid {
                Some(p) => {
                    procs::signal_pid(p, Signal::SIGKILL);
                    Ok(())
                }
                None => {
                    notes.push("the Active engine's pid is unknown".into());
                    bail!("round {}: the Active engine's pid is unknown", r + 1)
                }
            }
        };
        match kind {
            FailureKind::EngineKill | FailureKind::DetachedWorker | FailureKind::HungWake => {
                kill_engine(&mut notes)?;
            }
            FailureKind::SupervisorKill => self.sigkill_supervisor(a),
            FailureKind::Revoke => {
                if let Err(e) = self.lockd.revoke(Duration::from_secs(5), false).await {
                    notes.push(e);
                }
            }
            FailureKind::LockdCrash => {
                self.lockd.crash().await?;
            }
            FailureKind::LockdCrashThenSupervisorKill => {
                // 1. lockd crash and restart; 2. the Active side reclaims its lease (its
                //    supervisor's `lock_reclaimed` mark); 3. 0-50 ms later its supervisor dies.
                lockd_killed_us = Some(now_us());
                self.lockd.crash().await?;
                lockd_back_us = Some(now_us());
                let since = lockd_killed_us.unwrap_or(0);
                let deadline =
                    Instant::now() + self.args.reconnect_window + self.args.failover_bound;
                let reclaimed = self
                    .poll_side_until(a, deadline, |d| {
                        d.mark(MarkKind::LockReclaimed)
                            .is_some_and(|m| u64::try_from(m).is_ok_and(|m| m >= since))
                    })
                    .await;
                compound_reclaimed = Some(reclaimed);
                if !reclaimed {
                    notes.push("the Active side did not reclaim its lease; its supervisor was killed anyway".into());
                }
                let delay = schedule::compound_delay_us(kind, self.seed, r);
                std::thread::sleep(Duration::from_micros(delay));
                t_kill = now_us();
                kill_at = Instant::now();
                self.sigkill_supervisor(a);
                if let Some(c) = comp.as_mut() {
                    c.delay_us = Some(delay);
                    c.reclaimer_engine_id = Some(victim_key.0);
                    c.reclaimed = Some(reclaimed);
                }
            }
            FailureKind::RevokeDuringReconnect => {
                // lockd crash; the revoke goes out as soon as the restarted lockd's socket is
                // there, while the Active side's lease still waits to be reclaimed (its
                // client reconnects with a 10 ms, 20 ms, ... backoff).
                lockd_killed_us = Some(now_us());
                self.lockd.kill().await;
                self.lockd.spawn()?;
                self.lockd.wait_socket_accepts(Duration::from_secs(10));
                lockd_back_us = Some(now_us());
                self.lockd.start_watch()?;
                t_kill = now_us();
                kill_at = Instant::now();
                let res = self.lockd.revoke(Duration::from_secs(2), true).await;
                if let Err(e) = &res {
                    notes.push(e.clone());
                }
                self.lockd
                    .wait_ready()
                    .await
                    .context("restarting lockd after the crash")?;
                if let Some(c) = comp.as_mut() {
                    c.revoke_ok = Some(res.is_ok());
                    c.reclaimer_engine_id = Some(victim_key.0);
                }
            }
            FailureKind::LockdCrashDuringWake => {
                // The engine dies; as soon as the standby is granted (Waking; its engine
                // wakes slowly) lockd crashes. The waker must reclaim and become Active.
                if !self.sides[b].as_ref().is_some_and(|i| i.config.slow_wake) {
                    notes.push("setup: the standby runs without a slow wake".to_string());
                }
                kill_engine(&mut notes)?;
                let waking = self
                    .poll_side_until(b, kill_at + bound, |d| {
                        matches!(d.state, Phase::Waking | Phase::Active | Phase::Dead)
                    })
                    .await;
                let is_waking = self.sides[b].as_ref().is_some_and(|i| i.is(Phase::Waking));
                let st = self.sides[b].as_ref().map_or("gone", |i| i.state_label());
                if !waking || !is_waking {
                    notes.push(format!(
                        "the standby was {st}, not Waking, when lockd was crashed"
                    ));
                }
                lockd_killed_us = Some(now_us());
                self.lockd.crash().await?;
                lockd_back_us = Some(now_us());
                expected_new_engine_id = taker_key.map(|k| k.0);
                if let Some(c) = comp.as_mut() {
                    c.reclaimer_engine_id = expected_new_engine_id;
                }
            }
            FailureKind::DoubleKill => {
                kill_engine(&mut notes)?;
                let delay = schedule::compound_delay_us(kind, self.seed, r);
                std::thread::sleep(Duration::from_micros(delay));
                self.sigkill_supervisor(a);
                if let Some(c) = comp.as_mut() {
                    c.delay_us = Some(delay);
                }
            }
        }
        if let Some(c) = comp.as_mut() {
            let rel = |t: Option<u64>| t.map(|t| t as i64 - t_kill as i64);
            c.lockd_killed_rel_us = rel(lockd_killed_us);
            c.lockd_back_rel_us = rel(lockd_back_us);
        }

        // ---- observe
        let mut recovery_us = None;
        let mut lease_reclaimed = compound_reclaimed;
        let mut victim_self_exit = true;
        if kind == FailureKind::LockdCrash {
            // Nothing may change until the reconnect window is over (a lease not reclaimed by
            // then goes to a waiter): watch until just past it.
            let settle = self.args.reconnect_window + Duration::from_millis(250);
            let deadline = kill_at + self.args.reconnect_window + self.args.failover_bound;
            let want = holder_before.as_ref().and_then(|h| h.holder.clone());
            loop {
                self.tick().await;
                if recovery_us.is_none() {
                    if let Ok(s) = self.lockd.status().await {
                        if let Some(res) = observe::resource(&s, RESOURCE) {
                            if res.state == "held" && res.holder == want && want.is_some() {
                                recovery_us = Some(now_us() - t_kill);
                                lease_reclaimed = Some(true);
                            }
                        }
                    }
                }
                if recovery_us.is_some() && kill_at.elapsed() >= settle {
                    break;
                }
                if Instant::now() > deadline {
                    lease_reclaimed = Some(recovery_us.is_some());
                    break;
                }
                tokio::time::sleep(self.args.poll_interval).await;
            }
        } else {
            let mut deadline = kill_at + bound + Duration::from_secs(2);
            if lockd_killed_us.is_some() {
                deadline += self.args.reconnect_window;
            }
            loop {
                self.tick().await;
                let done_active = self.final_active(victim_key, t_kill).is_some();
                let victim_done = self.find_inc(victim_key).is_none_or(|i| i.finished());
                let hung_done = kind != FailureKind::HungWake
                    || taker_key
                        .and_then(|k| self.find_inc(k))
                        .is_none_or(|i| i.finished());
                // The waker of a lockd-crash-during-wake round may become Active before its
                // client reconnects (backoff up to 250 ms): wait for its reclaim too.
                let reclaim_done = kind != FailureKind::LockdCrashDuringWake
                    || self.grants.iter().any(|g| g.reclaimed)
                    || taker_key.and_then(|k| self.find_inc(k)).is_some_and(|i| {
                        i.mark(MarkKind::LockReclaimed)
                            .is_some_and(|m| m >= lockd_killed_us.unwrap_or(u64::MAX))
                    });
                if done_active && victim_done && hung_done && reclaim_done {
                    break;
                }
                if Instant::now() > deadline {
                    if !victim_done {
                        victim_self_exit = false;
                        notes.push("the victim's supervisor had not exited by the deadline; killed (container teardown)".into());
                    }
                    break;
                }
                tokio::time::sleep(self.args.poll_interval).await;
            }
            // Whatever is left of the victim (and of a hung waker) is torn down so the drill
            // can go on; the invariants below were judged on what happened before.
            for key in [
                Some(victim_key),
                if kind == FailureKind::HungWake {
                    taker_key
                } else {
                    None
                },
            ]
            .into_iter()
            .flatten()
            {
                if let Some(side) =
                    (0..2).find(|s| self.sides[*s].as_ref().is_some_and(|i| i.key() == key))
                {
                    if let Some(i) = self.sides[side].as_mut() {
                        if i.exited.is_none() {
                            i.teardown();
                        }
                    }
                }
            }
        }
        self.tick().await;

        // ---- judge
        notes.append(&mut self.round_notes);
        let claims: Vec<ClaimViolation> = self
            .claim_lines()
            .iter()
            .skip(claim_before)
            .map(|l| ClaimViolation::parse(l))
            .collect();
        let final_inc = if kind == FailureKind::LockdCrash {
            self.find_inc(victim_key)
                .filter(|i| i.is(Phase::Active))
                .map(Inc::key)
        } else {
            self.final_active(victim_key, t_kill)
        };
        let final_active = final_inc.and_then(|k| self.find_inc(k)).and_then(|i| {
            let at = invariants::first_after(
                i.transitions(),
                Phase::Active,
                if i.key() == victim_key { 0 } else { t_kill },
            )?
            .at_unix_us;
            Some(FinalActive {
                engine_id: i.engine_id,
                incarnation: i.n,
                epoch: i.state.as_ref().and_then(|s| s.epoch),
                active_at_us: at,
            })
        });
        let mut grants = self.grants.clone();
        grants.sort_by_key(|g| g.seen_at_unix_us);
        // Fallback when lockd watch saw no grant: the new Active's Waking transition.
        if kind.expects_failover() && !grants.iter().any(|g| !g.reclaimed) {
            if let Some(fa) = &final_active {
                notes.push("lockd watch reported no grant; fencing checked at the new Active's /state instead".into());
                let alive = self.find_inc(victim_key).map_or_else(Vec::new, |i| {
                    i.engine_pids
                        .iter()
                        .filter(|p| p.is_alive())
                        .map(|p| p.pid as u32)
                        .collect()
                });
                // Placed at the grant's time (the new life's Waking, or its Active), so that a
                // later reclaim of the same lease (lockd crashed during the wake) comes after
                // it in the epoch check.
                let granted_at = final_inc
                    .and_then(|k| self.find_inc(k))
                    .and_then(|i| invariants::first_after(i.transitions(), Phase::Waking, t_kill))
                    .map_or(fa.active_at_us, |t| t.at_unix_us);
                grants.push(GrantObs {
                    seen_at_unix_us: granted_at,
                    epoch: fa.epoch,
                    holder: None,
                    reclaimed: false,
                    previous_engine_id: Some(victim_key.0),
                    previous_alive_pids: alive,
                    previous_checked: self.find_inc(victim_key).map_or(0, |i| i.engine_pids.len()),
                });
                grants.sort_by_key(|g| g.seen_at_unix_us);
            }
        }
        let mut transitions_after_kill = Vec::new();
        let mut lives = Vec::new();
        let all_lives: Vec<&Inc> = self
            .sides
            .iter()
            .flatten()
            .chain(self.retired.iter())
            .collect();
        // When another life was granted the lease after the kill (its Waking, or a primary's
        // Active). A lease moves only once the previous holder's connection is closed, which a
        // supervisor does only after leaving Active, or by dying: so this bounds the Active
        // interval of a supervisor the drill SIGKILLed whose last transitions it never read.
        let granted_after_kill = |me: (u64, u32)| -> Option<u64> {
            all_lives
                .iter()
                .filter(|o| o.key() != me)
                .flat_map(|o| o.transitions().iter())
                .filter(|t| t.at_unix_us >= t_kill && matches!(t.to, Phase::Waking | Phase::Active))
                .map(|t| t.at_unix_us)
                .min()
        };
        for i in &all_lives {
            for t in i.transitions().iter().filter(|t| t.at_unix_us >= t_kill) {
                transitions_after_kill.push((i.engine_id, t.clone()));
            }
            lives.push(LifeTransitions {
                engine_id: i.engine_id,
                incarnation: i.n,
                transitions: i.transitions(),
                exited_us: match (i.exited.as_ref().map(|x| x.0), i.sigkilled_us) {
                    (x, Some(k)) => [x, Some(k), granted_after_kill(i.key())]
                        .into_iter()
                        .flatten()
                        .min(),
                    (x, None) => x,
                },
            });
        }
        let intervals = invariants::active_intervals(&lives, t_kill);
        // Compound rounds: what the lockd crash had to leave in place, and whether the
        // revoked side fenced itself.
        let victim = self.find_inc(victim_key);
        let reclaim_mark = |inc: Option<&Inc>| -> Option<u64> {
            let since = lockd_killed_us?;
            inc?.mark(MarkKind::LockReclaimed).filter(|m| *m >= since)
        };
        if kind == FailureKind::LockdCrashDuringWake {
            let waker = taker_key.and_then(|k| self.find_inc(k));
            let by_watch = grants.iter().any(|g| g.reclaimed);
            let ok = reclaim_mark(waker).is_some() || by_watch;
            lease_reclaimed = Some(ok);
            if let Some(c) = comp.as_mut() {
                c.reclaimed = Some(ok);
            }
        }
        let mut victim_fenced = None;
        if kind == FailureKind::RevokeDuringReconnect {
            let dead = victim.is_some_and(|v| {
                invariants::first_after(v.transitions(), Phase::Dead, t_kill).is_some()
            });
            victim_fenced =
                Some(dead || victim_self_exit && victim.is_some_and(|v| v.exited.is_some()));
            let mark = reclaim_mark(victim);
            if let Some(c) = comp.as_mut() {
                c.reclaimed = Some(mark.is_some());
                c.revoked_before_reclaim = Some(mark.is_none_or(|m| m >= t_kill));
            }
        }
        let fence = invariants::fence_check(&grants);
        let obs = RoundObs {
            kind: Some(kind),
            bound_us: bound.as_micros() as u64,
            t_kill_us: t_kill,
            epoch_before,
            victim_engine_id: Some(victim_key.0),
            grants,
            claim_violations: claims,
            final_is_victim: final_inc == Some(victim_key),
            final_active: final_active.clone(),
            transitions_after_kill,
            lease_reclaimed,
            active_intervals: intervals,
            expected_new_engine_id,
            victim_fenced,
        };
        let violations = invariants::check_round(&obs);

        // ---- measure
        let t_old_dead = victim.and_then(|v| {
            // Its Dead transition; a SIGKILLed supervisor has none: then the moment its exit
            // was seen (the container is gone: the runtime kills the rest), which the drill
            // sees at once, unlike the engine's death, which it polls.
            invariants::first_after(v.transitions(), Phase::Dead, t_kill)
                .map(|t| t.at_unix_us)
                .or(v.exited.as_ref().map(|x| x.0))
                .or(v.engine_gone_us)
        });
        let (t_grant, t_active) = match (&final_active, final_inc.and_then(|k| self.find_inc(k))) {
            (Some(fa), Some(i)) if kind.expects_failover() => (
                invariants::waking_before(i.transitions(), fa.active_at_us),
                Some(fa.active_at_us),
            ),
            _ => (None, None),
        };
        let phases = if kind.expects_failover() {
            invariants::phases(t_kill, t_old_dead, t_grant, t_active)
        } else {
            invariants::Phases::default()
        };
        if let Some(v) = victim {
            if kind == FailureKind::SupervisorKill {
                if let (Some(g), Some(x)) = (v.engine_gone_us, v.exited.as_ref()) {
                    if g > x.0 + 50_000 {
                        notes.push(format!(
                            "engine outlived its supervisor by {} ms",
                            (g - x.0) / 1000
                        ));
                    }
                }
            }
        }
        let mut marks_after_kill_us = std::collections::BTreeMap::new();
        let mut add_marks = |prefix: &str, inc: Option<&Inc>| {
            for (k, v) in inc
                .and_then(|i| i.state.as_ref())
                .map(|s| &s.marks)
                .into_iter()
                .flatten()
            {
                if let Ok(v) = u64::try_from(*v) {
                    if v >= t_kill {
                        marks_after_kill_us.insert(format!("{prefix}.{}", k.as_str()), v - t_kill);
                    }
                }
            }
        };
        add_marks("old", victim);
        if final_inc != Some(victim_key) {
            add_marks("new", final_inc.and_then(|k| self.find_inc(k)));
        }
        // When the drill read each grant from `lockd watch` (lockd's side of the hand-over,
        // to tell a slow grant from a slow client): `watch.granted.1`, `watch.granted.2`, ...
        for (i, g) in self
            .grants
            .iter()
            .filter(|g| g.seen_at_unix_us >= t_kill)
            .enumerate()
        {
            let what = if g.reclaimed { "reclaimed" } else { "granted" };
            marks_after_kill_us.insert(
                format!("watch.{what}.{}", i + 1),
                g.seen_at_unix_us - t_kill,
            );
        }
        if kind == FailureKind::LockdCrash && lease_reclaimed == Some(true) {
            // The supervisor's own reclaim time beats polling `lockd status`.
            if let Some(t) = marks_after_kill_us.get("old.lock_reclaimed") {
                recovery_us = Some(*t);
            }
        }
        if let Some(g) = victim.and_then(|v| v.engine_gone_us) {
            // When the drill (polling) first saw every process of the old engine dead.
            if g >= t_kill {
                marks_after_kill_us.insert("drill.old_engine_gone".into(), g - t_kill);
            }
        }
        if kind.expects_failover() && fence.is_none_or(|(n, _)| n == 0) {
            notes.push("no process of the old engine was checked at the grant".into());
        }
        let epoch_after = final_active
            .as_ref()
            .and_then(|f| f.epoch)
            .or(self.last_epoch);
        if let Some(e) = epoch_after {
            self.last_epoch = Some(self.last_epoch.map_or(e, |l| l.max(e)));
        }
        Ok(RoundRecord {
            round: r as u32 + 1,
            kind,
            victim_engine_id: Some(victim_key.0),
            victim_incarnation: Some(victim_key.1),
            new_active_engine_id: final_active.as_ref().map(|f| f.engine_id),
            new_active_incarnation: final_active.as_ref().map(|f| f.incarnation),
            t_kill_unix_us: t_kill,
            phases,
            recovery_us,
            epoch_before,
            epoch_after,
            violations,
            marks_after_kill_us,
            notes,
            fence_pids_checked: fence.map(|f| f.0),
            fence_pids_alive: fence.map(|f| f.1),
            compound: comp,
            round_wall_us: None,
        })
    }

    /// SIGKILL of a side's supervisor (its container is torn down `--teardown-delay` after it
    /// died).
    fn sigkill_supervisor(&mut self, side: usize) {
        if let Some(i) = self.sides[side].as_mut() {
            i.sigkilled_at = Some(Instant::now());
            i.sigkilled_us = Some(now_us());
            procs::signal_pid(i.sup_pid, Signal::SIGKILL);
        }
    }

    /// The first incarnation other than the victim that entered Active after the kill.
    fn final_active(&self, victim: (u64, u32), t_kill: u64) -> Option<(u64, u32)> {
        self.sides
            .iter()
            .flatten()
            .filter(|i| i.key() != victim && i.is(Phase::Active))
            .filter_map(|i| {
                invariants::first_after(i.transitions(), Phase::Active, t_kill)
                    .map(|t| (t.at_unix_us, i.key()))
            })
            .min()
            .map(|(_, k)| k)
    }

    // ---------------------------------------------------------------- the end

    async fn cleanup(&mut self) {
        self.stage = Stage::Stopping;
        if let Some(pb) = &self.progress {
            pb.finish_and_clear();
        }
        for side in 0..2 {
            if let Some(mut i) = self.sides[side].take() {
                i.teardown();
                self.retired.push(i);
            }
        }
        for i in &mut self.retired {
            i.teardown();
        }
        for g in self.sup_pgids.iter().chain(&self.lockd.pgids) {
            procs::kill_group(*g);
        }
        for p in &self.all_pids {
            procs::kill(p);
        }
        self.lockd.shutdown().await;
        for mut l in self.load.drain(..) {
            let _ = l.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(2), l.wait()).await;
        }
        // Anything still descending from us (orphans re-parented to this subreaper).
        for _ in 0..50 {
            let left: Vec<u32> = procs::descendants(std::process::id())
                .into_iter()
                .filter(|p| Pinned::pin(*p as i32).is_some_and(|t| t.is_alive()))
                .collect();
            if left.is_empty() {
                break;
            }
            for p in left {
                procs::signal_pid(p, Signal::SIGKILL);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for p in &self.all_pids {
            procs::reap_if_zombie(p);
        }
        // Nothing left to kill: Drop must not signal recycled pids or groups.
        self.sup_pgids.clear();
        self.lockd.pgids.clear();
        self.all_pids.clear();
        if self.args.keep_dir {
            eprintln!("supervisor drill: kept {}", self.dir.display());
        } else if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!(
                "supervisor drill: could not remove {}: {e}",
                self.dir.display()
            );
        }
    }

    fn finish(&mut self, outcome: std::result::Result<Result<()>, i32>) -> i32 {
        let interrupted = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => {
                eprintln!("supervisor drill: {e:#}");
                if self.aborted.is_none() {
                    self.aborted = Some(format!("{e:#}"));
                }
                None
            }
            Err(code) => {
                eprintln!(
                    "supervisor drill: interrupted after {} rounds; cleaned up",
                    self.records.len()
                );
                self.aborted = Some("interrupted".into());
                Some(code)
            }
        };
        let summary = report::summarize(&self.records);
        let total: usize = self.records.iter().map(|r| r.violations.len()).sum();
        let code = if total > 0 {
            EXIT_VIOLATION
        } else if let Some(c) = interrupted {
            c
        } else if self.aborted.is_some() {
            EXIT_DRILL_ERROR
        } else {
            EXIT_OK
        };
        print!("{}", report::summary_table(&summary));
        let rpm = match (self.rounds_started, self.rounds_ended) {
            (Some(a), Some(b)) => {
                report::rounds_per_minute(self.records.len(), (b - a).as_micros() as u64)
            }
            _ => None,
        };
        if let (Some(rpm), Some(a), Some(b)) = (rpm, self.rounds_started, self.rounds_ended) {
            println!(
                "{} rounds in {:.1}s: {rpm:.1} rounds/min (load {}, reconnect window {})",
                self.records.len(),
                (b - a).as_secs_f64(),
                self.args.load,
                humantime::format_duration(self.args.reconnect_window)
            );
        }
        for r in self.records.iter().filter(|r| !r.violations.is_empty()) {
            for v in &r.violations {
                println!("violation in round {} ({}): {v}", r.round, r.kind);
            }
        }
        let engine = self
            .args
            .engine_cmd
            .clone()
            .unwrap_or_else(|| "fake-engine".into());
        let rep = Report {
            report_version: 1,
            iterations: self.args.iterations,
            completed_rounds: self.records.len() as u32,
            kinds: self.kinds.clone(),
            order: self.args.order,
            seed: self.seed,
            engine,
            adapter: self.args.adapter.clone(),
            failover_bound_ms: self.args.failover_bound.as_millis() as u64,
            planted_bug: self.planted,
            started_unix_us: self.started_us,
            finished_unix_us: now_us(),
            summary: summary.clone(),
            total_violations: total,
            aborted: self.aborted.clone(),
            exit_code: code,
            rounds: self.records.clone(),
            load: self.args.load,
            worker_linger_ms: self.args.worker_linger.as_millis() as u64,
            reconnect_window_ms: self.args.reconnect_window.as_millis() as u64,
            gpu_sim: self.gpu_sim.is_some(),
            stop_on_violation: self.args.stop_on_violation,
            rounds_per_minute: rpm,
        };
        if let Some(p) = &self.args.report {
            match serde_json::to_string_pretty(&rep) {
                Ok(s) => {
                    if let Err(e) = std::fs::write(p, s + "\n") {
                        eprintln!("supervisor drill: writing {}: {e}", p.display());
                    }
                }
                Err(e) => eprintln!("supervisor drill: report: {e}"),
            }
        }
        if let Some(p) = &self.args.svg {
            let title = format!("supervisor drill, {} rounds", self.records.len());
            match super::svg::render(&self.records, &summary, &title) {
                Ok(s) => {
                    if let Err(e) = std::fs::write(p, s) {
                        eprintln!("supervisor drill: writing {}: {e}", p.display());
                    }
                }
                Err(e) => eprintln!("supervisor drill: {e}"),
            }
        }
        if self.args.order == Order::Random {
            println!(
                "seed {} (rerun with --order random --seed {})",
                self.seed, self.seed
            );
        }
        println!("exit code {code}");
        code
    }
}

impl Drop for Drill {
    /// Last line of defence (a panic): kill every process group and tracked pid.
    fn drop(&mut self) {
        for g in self.sup_pgids.iter().chain(&self.lockd.pgids) {
            procs::kill_group(*g);
        }
        for p in &self.all_pids {
            procs::kill(p);
        }
    }
}

async fn poll_state(addr: Option<SocketAddr>) -> Option<StateDoc> {
    observe::get_state(addr?, HTTP_TIMEOUT).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_split_like_a_shell() {
        assert_eq!(
            split_command(r#"vllm serve "my model" --port {port} --x='a b' c\ d"#).unwrap(),
            vec!["vllm", "serve", "my model", "--port", "{port}", "--x=a b", "c d"]
        );
        assert_eq!(split_command("  ").unwrap(), Vec::<String>::new());
        assert_eq!(split_command("''").unwrap(), vec![String::new()]);
        assert!(split_command("'open").is_err());
        assert!(split_command("\"open").is_err());
        assert!(split_command("end\\").is_err());
    }
}
