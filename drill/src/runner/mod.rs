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
mod round;
mod side;

use lock_daemon::LockdProc;
use side::{Inc, Launch};

use crate::invariants::GrantObs;
use crate::observe;
use crate::procs::{self, now_us, Pinned};
use crate::report::{self, Report, RoundRecord};
use crate::schedule::{self, EngineConfig, FailureKind, Order};
use crate::{
    DrillArgs, EXIT_DRILL_ERROR, EXIT_OK, EXIT_VIOLATION, PLANTED_BUG_ENV, PLANTED_NO_ANCHOR_ENV,
};
use probes::{Phase, StateDoc};

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
    logged(Command::new(program), logs, log)
}

/// `c` in its own process group, stdin null, stdout and stderr appended to `logs/log`,
/// killed when dropped.
fn logged(mut c: Command, logs: &Path, log: &str) -> Result<Command> {
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

/// What the drill learnt about the lease from `lockd watch` and `/state`.
#[derive(Default)]
struct LeaseLog {
    /// Newest epoch seen (grants and /state), for the strictly-increasing check.
    last_epoch: Option<u64>,
    /// Grants seen since the current round began.
    grants: Vec<GrantObs>,
    /// A new grant (epoch, holder) whose engine life is not identified yet.
    pending_grant: Option<(Option<u64>, Option<String>)>,
    /// Holder names learnt from grants, to engine ids.
    holder_names: HashMap<String, u64>,
}

/// Finished rounds and the drill's timeline, for the summary and the report.
struct Tally {
    /// Every finished round.
    records: Vec<RoundRecord>,
    /// Wall-clock start, for the report.
    started_us: u64,
    /// Why the drill stopped early, if it did.
    aborted: Option<String>,
    /// When the first round began (rounds per minute).
    rounds_started: Option<Instant>,
    /// When the last round ended.
    rounds_ended: Option<Instant>,
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
    /// What the drill learnt about the lease (grants, epochs, holder names).
    lease: LeaseLog,
    /// Finished rounds and the drill's timeline.
    tally: Tally,
    /// Where the drill is (decides how a restarted side is configured).
    stage: Stage,
    /// The progress bar on a terminal.
    progress: Option<indicatif::ProgressBar>,
    /// The planted-bug switch is set in our environment (reported, warned about).
    planted: bool,
    /// Things seen during the current round that are worth a note in its record.
    round_notes: Vec<String>,
    /// `--load` busy loops.
    load: Vec<Child>,
    /// `--gpu-sim`: the simulated device's directory.
    gpu_sim: Option<PathBuf>,
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
            lease: LeaseLog::default(),
            tally: Tally {
                records: Vec::new(),
                started_us: now_us(),
                aborted: None,
                rounds_started: None,
                rounds_ended: None,
            },
            retired: Vec::new(),
            next_n: [0, 0],
            all_pids: Vec::new(),
            sup_pgids: Vec::new(),
            stage: Stage::Between(0),
            progress,
            planted,
            round_notes: Vec::new(),
            load: Vec::new(),
            gpu_sim: None,
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
                self.lease.last_epoch = Some(self.lease.last_epoch.map_or(e, |l| l.max(e)));
            }
            if !g.reclaimed {
                self.lease.pending_grant = Some((g.epoch, g.holder.clone()));
            }
            self.lease.grants.push(g);
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
                        // fake-engine marks a completion served from weights that were never
                        // restored (a level-2 wake without the reload, an SGLang resume
                        // without a CPU backup): the wake "worked" but the answers are wrong.
                        if v.get("garbage").and_then(|g| g.as_bool()) == Some(true) {
                            self.round_notes.push(format!(
                                "engine {eid}.{n} served a completion from garbage weights"
                            ));
                        }
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
        let Some((epoch, holder)) = self.lease.pending_grant.clone() else {
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
            .and_then(|h| self.lease.holder_names.get(h).copied());
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
                self.lease.holder_names.insert(h, inc.engine_id);
            }
            if let Ok(mut f) = self.lockd.fence.lock() {
                f.holder = Some(inc.key());
                f.pids = inc.engine_pids.clone();
            }
            self.lease.pending_grant = None;
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
        self.tally.rounds_started = Some(Instant::now());
        let mut last_end = Instant::now();
        for r in 0..self.sched.len() {
            self.stage = Stage::Between(r);
            if let Err(e) = self.prepare(r).await {
                self.tally.aborted = Some(format!("before round {}: {e:#}", r + 1));
                return Err(e);
            }
            self.stage = Stage::InRound(r);
            let mut rec = self.round(r).await?;
            rec.round_wall_us = Some(last_end.elapsed().as_micros() as u64);
            last_end = Instant::now();
            self.tally.rounds_ended = Some(last_end);
            let line = rec.line(self.args.iterations);
            self.say(&line);
            if let Some(pb) = &self.progress {
                pb.inc(1);
                let v: usize = self
                    .tally
                    .records
                    .iter()
                    .map(|r| r.violations.len())
                    .sum::<usize>()
                    + rec.violations.len();
                pb.set_message(format!("{v} violations"));
            }
            let violated = !rec.violations.is_empty();
            self.tally.records.push(rec);
            if violated && self.args.stop_on_violation {
                self.tally.aborted = Some(format!(
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
                if self.tally.aborted.is_none() {
                    self.tally.aborted = Some(format!("{e:#}"));
                }
                None
            }
            Err(code) => {
                eprintln!(
                    "supervisor drill: interrupted after {} rounds; cleaned up",
                    self.tally.records.len()
                );
                self.tally.aborted = Some("interrupted".into());
                Some(code)
            }
        };
        let summary = report::summarize(&self.tally.records);
        let total: usize = self.tally.records.iter().map(|r| r.violations.len()).sum();
        let code = if total > 0 {
            EXIT_VIOLATION
        } else if let Some(c) = interrupted {
            c
        } else if self.tally.aborted.is_some() {
            EXIT_DRILL_ERROR
        } else {
            EXIT_OK
        };
        print!("{}", report::summary_table(&summary));
        let rpm = match (self.tally.rounds_started, self.tally.rounds_ended) {
            (Some(a), Some(b)) => {
                report::rounds_per_minute(self.tally.records.len(), (b - a).as_micros() as u64)
            }
            _ => None,
        };
        if let (Some(rpm), Some(a), Some(b)) =
            (rpm, self.tally.rounds_started, self.tally.rounds_ended)
        {
            println!(
                "{} rounds in {:.1}s: {rpm:.1} rounds/min (load {}, reconnect window {})",
                self.tally.records.len(),
                (b - a).as_secs_f64(),
                self.args.load,
                humantime::format_duration(self.args.reconnect_window)
            );
        }
        for r in self
            .tally
            .records
            .iter()
            .filter(|r| !r.violations.is_empty())
        {
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
            completed_rounds: self.tally.records.len() as u32,
            kinds: self.kinds.clone(),
            order: self.args.order,
            seed: self.seed,
            engine,
            adapter: self.args.adapter.clone(),
            failover_bound_ms: self.args.failover_bound.as_millis() as u64,
            planted_bug: self.planted,
            started_unix_us: self.tally.started_us,
            finished_unix_us: now_us(),
            summary: summary.clone(),
            total_violations: total,
            aborted: self.tally.aborted.clone(),
            exit_code: code,
            rounds: self.tally.records.clone(),
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
            let title = format!("supervisor drill, {} rounds", self.tally.records.len());
            match super::svg::render(&self.tally.records, &summary, &title) {
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

impl Drill {
    /// Reaps the engine processes of earlier rounds that are zombies (orphans re-parented to
    /// this subreaper) and forgets those that are gone, so that neither zombies nor this list
    /// grow with the number of rounds.
    fn reap_finished(&mut self) {
        for p in &self.all_pids {
            procs::reap_if_zombie(p);
        }
        self.all_pids.retain(|p| p.stat().is_some());
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
