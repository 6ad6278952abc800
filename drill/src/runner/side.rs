//! One side of the drill: a "container" life of `supervisor run` + its engine ([`Inc`]), how
//! it is started ([`Launch`]), observed (its `/state`, its engine's processes) and torn down.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase, StateDoc};
use tokio::sync::oneshot;

use super::kubelet::{liveness_spec, Prober};
use super::{log_command, split_command, Bins, GPU_SIM_TOTAL, RESOURCE};
use crate::invariants::Transition;
use crate::procs::{self, now_us, Pinned};
use crate::schedule::EngineConfig;
use crate::DrillArgs;

/// One run of one side's supervisor (+ engine): a "container" life.
pub(super) struct Inc {
    /// Engine id (0 or 1), fixed per side.
    pub(super) engine_id: u64,
    /// Incarnation number of this side (restarts count up), to tell lives apart.
    pub(super) n: u32,
    /// The fake-engine flags it was started with.
    pub(super) config: EngineConfig,
    /// The supervisor's pid (also its process group).
    pub(super) sup_pid: u32,
    /// Its probe server.
    pub(super) probes: SocketAddr,
    /// The engine's HTTP port (the drill sends one completion to each new Active).
    pub(super) engine_port: u16,
    /// Whether that completion was sent (once per incarnation).
    pub(super) served: bool,
    /// The engine's pid file.
    pub(super) pid_file: PathBuf,
    /// When the supervisor exited, as the drill saw it.
    pub(super) exit_rx: oneshot::Receiver<(u64, String)>,
    /// Exit time (microseconds) and status, once exited.
    pub(super) exited: Option<(u64, String)>,
    /// Its processes were killed after it exited (container teardown).
    pub(super) torn_down: bool,
    /// Engine processes (main + workers), pinned by start time.
    pub(super) engine_pids: Vec<Pinned>,
    /// The phase the pid list was last refreshed in (refreshing scans /proc: not every tick).
    pub(super) pids_refreshed_in: Option<Phase>,
    /// First time the drill saw every engine process dead.
    pub(super) engine_gone_us: Option<u64>,
    /// Last `/state` answer.
    pub(super) state: Option<StateDoc>,
    /// Its transitions on the drill's clock (kept with `state`, see [`Inc::set_state`]).
    pub(super) transitions: Vec<Transition>,
    /// Its liveness prober (kubelet emulation).
    pub(super) live: Prober,
    /// The drill SIGKILLed the supervisor: once it has exited, the container is torn down
    /// `--teardown-delay` later, not at once.
    pub(super) sigkilled_at: Option<Instant>,
    /// The same moment, wall clock (a SIGKILLed supervisor's Active state ends there, even if
    /// the drill sees its exit a few ms later).
    pub(super) sigkilled_us: Option<u64>,
}

impl Inc {
    /// (engine id, incarnation): names this life.
    pub(super) fn key(&self) -> (u64, u32) {
        (self.engine_id, self.n)
    }

    /// Its phase as last read, while its supervisor runs (`None`: exited, or no `/state` yet).
    pub(super) fn phase(&self) -> Option<Phase> {
        if self.exited.is_some() {
            return None;
        }
        self.state.as_ref().map(|s| s.state)
    }

    /// In `phase` now (see [`Inc::phase`]).
    pub(super) fn is(&self, phase: Phase) -> bool {
        self.phase() == Some(phase)
    }

    /// Its state for notes: `exited`, `starting` or the phase.
    pub(super) fn state_label(&self) -> &'static str {
        if self.exited.is_some() {
            return "exited";
        }
        self.state.as_ref().map_or("starting", |s| s.state.as_str())
    }

    /// A new `/state` answer.
    pub(super) fn set_state(&mut self, doc: StateDoc) {
        self.transitions = doc.transitions.iter().map(Transition::from).collect();
        self.state = Some(doc);
    }

    /// When `mark` last happened, on the drill's clock.
    pub(super) fn mark(&self, mark: MarkKind) -> Option<u64> {
        self.state
            .as_ref()?
            .mark(mark)
            .and_then(|m| u64::try_from(m).ok())
    }

    /// Its `/state` transitions (drill clock).
    pub(super) fn transitions(&self) -> &[Transition] {
        &self.transitions
    }

    /// Exited and torn down.
    pub(super) fn finished(&self) -> bool {
        self.exited.is_some() && self.torn_down
    }

    /// Pins the engine's processes not pinned yet (pid file, engine pid and descendants).
    pub(super) fn refresh_pids(&mut self) {
        let mut pids = procs::read_pid_file(&self.pid_file);
        if let Some(p) = self.state.as_ref().and_then(|s| s.engine_pid) {
            pids.push(p);
            pids.extend(procs::descendants(p));
        }
        for p in pids {
            if self.engine_pids.iter().any(|t| t.pid == p as i32) {
                continue;
            }
            if let Some(t) = Pinned::pin(p as i32) {
                self.engine_pids.push(t);
            }
        }
    }

    /// Kills everything of this container: the supervisor's group, the engine's processes
    /// and their groups (detached workers included).
    pub(super) fn teardown(&mut self) -> usize {
        let alive = self.engine_pids.iter().filter(|p| p.is_alive()).count();
        procs::kill_group(self.sup_pid);
        procs::signal_pid(self.sup_pid, Signal::SIGKILL);
        for p in &self.engine_pids {
            if p.is_alive() {
                if let Ok(g) = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(p.pid))) {
                    procs::kill_group(g.as_raw() as u32);
                }
                procs::kill(p);
            }
        }
        self.torn_down = true;
        alive
    }
}

/// What starting a side needs from the drill.
pub(super) struct Launch<'a> {
    /// The command line.
    pub(super) args: &'a DrillArgs,
    /// supervisor / fake-engine paths.
    pub(super) bins: &'a Bins,
    /// The drill's directory (pid files, logs).
    pub(super) dir: &'a Path,
    /// The fake engines' shared GPU claim file.
    pub(super) claim: &'a Path,
    /// `--gpu-sim`: the simulated device's directory.
    pub(super) gpu_sim: Option<&'a Path>,
    /// lockd's endpoint.
    pub(super) endpoint: String,
}

impl Launch<'_> {
    fn engine_cmd(
        &self,
        engine_id: u64,
        port: u16,
        pid_file: &Path,
        cfg: EngineConfig,
    ) -> Result<Vec<String>> {
        let subst = |s: &str| {
            s.replace("{port}", &port.to_string())
                .replace("{engine_id}", &engine_id.to_string())
                .replace("{pid_file}", &pid_file.display().to_string())
                .replace("{gpu_claim}", &self.claim.display().to_string())
        };
        if let Some(cmd) = &self.args.engine_cmd {
            return Ok(split_command(cmd)?.iter().map(|w| subst(w)).collect());
        }
        let fe = self
            .bins
            .fake_engine
            .as_ref()
            .ok_or_else(|| anyhow!("no fake-engine"))?;
        let mut v = vec![
            fe.display().to_string(),
            "--port".into(),
            port.to_string(),
            "--engine-id".into(),
            engine_id.to_string(),
            "--gpu-claim".into(),
            self.claim.display().to_string(),
            "--pid-file".into(),
            pid_file.display().to_string(),
            "--workers".into(),
            self.args.workers.to_string(),
        ];
        if self.args.adapter == "sglang" {
            // As the chart runs SGLang: its semantics (pause before release, a generating
            // /health), and a CPU copy of the weights so that a resume restores them.
            v.extend(["--personality", "sglang", "--enable-weights-cpu-backup"].map(String::from));
        }
        if cfg.detach_workers {
            v.push("--detach-workers".into());
        }
        if cfg.hung_wake {
            v.push("--wake".into());
            v.push("1h".into());
        } else if cfg.slow_wake {
            v.push("--wake".into());
            v.push(humantime::format_duration(self.args.slow_wake).to_string());
        }
        if cfg.linger_workers && !self.args.worker_linger.is_zero() {
            v.push("--worker-linger".into());
            v.push(humantime::format_duration(self.args.worker_linger).to_string());
        }
        if let Some(d) = self.gpu_sim {
            v.push("--gpu-sim".into());
            v.push(d.display().to_string());
            v.push("--gpu-sim-bytes".into());
            v.push(self.args.gpu_sim_bytes.to_string());
        }
        v.extend(self.args.engine_arg.iter().map(|a| subst(a)));
        Ok(v)
    }

    /// Starts life `n` of engine `engine_id`: `supervisor run` (wrapping the engine command)
    /// in its own process group, dying with the drill.
    pub(super) fn start(
        &self,
        engine_id: u64,
        n: u32,
        role: &str,
        cfg: EngineConfig,
    ) -> Result<Inc> {
        let probes: SocketAddr = ([127, 0, 0, 1], procs::free_port()?).into();
        let port = procs::free_port()?;
        let pid_file = self.dir.join(format!("engine-{engine_id}.{n}.pids"));
        let mut c = log_command(
            &self.bins.supervisor,
            &self.dir.join("logs"),
            &format!("engine-{engine_id}.{n}.log"),
        )?;
        c.arg("run")
            .args(["--engine-id", &engine_id.to_string(), "--role", role])
            .args(["--lock", &self.endpoint, "--resource", RESOURCE])
            .args([
                "--probes",
                &probes.to_string(),
                "--adapter",
                &self.args.adapter,
            ])
            .args([
                "--engine-url",
                &self.args.engine_url.replace("{port}", &port.to_string()),
            ])
            // The engines' private TMPDIRs in the drill's own directory: a SIGKILLed
            // supervisor's is swept by its successor, the last one with the directory.
            .arg("--engine-tmpdir")
            // Short: engines make Unix sockets there (leftovers::MAX_TMPDIR_LEN).
            .arg(self.dir.join("t"));
        // The drill emulates kubelet's container restarts itself (kubelet.rs): each side's
        // supervisor exits after fencing, as the first version did. Adapting the drill to
        // supervisors that re-arm their engine (`--restart on-failure`, the default) is later
        // work; a `--supervisor-arg --restart=...` wins.
        if !self
            .args
            .supervisor_arg
            .iter()
            .any(|a| a == "--restart" || a.starts_with("--restart="))
        {
            c.args(["--restart", "never"]);
        }
        if !self.args.supervisor_linger.is_zero() {
            c.arg("--linger")
                .arg(humantime::format_duration(self.args.supervisor_linger).to_string());
        }
        if cfg.hung_wake {
            c.arg("--waking-timeout")
                .arg(humantime::format_duration(self.args.hung_waking_timeout).to_string());
        }
        if let Some(d) = self.gpu_sim {
            // What one engine registers while it holds the GPU (main + workers), capped at
            // the device: a waker waits until the previous engine's memory is back.
            let need = self
                .args
                .gpu_sim_bytes
                .saturating_mul(u64::from(self.args.workers) + 1)
                .min(GPU_SIM_TOTAL);
            c.arg("--gpu-sim")
                .arg(d)
                .arg("--min-free-memory")
                .arg(need.to_string());
        }
        c.args(&self.args.supervisor_arg);
        c.arg("--")
            .args(self.engine_cmd(engine_id, port, &pid_file, cfg)?);
        // If the drill itself dies, its supervisors die (the drill spawns from the main thread).
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            c.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = c
            .spawn()
            .with_context(|| format!("starting supervisor for engine {engine_id}"))?;
        let sup_pid = child
            .id()
            .ok_or_else(|| anyhow!("supervisor exited at once"))?;
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let st = child.wait().await;
            let _ = tx.send((
                now_us(),
                st.map_or_else(|e| e.to_string(), |s| s.to_string()),
            ));
        });
        tracing::info!(
            engine_id,
            incarnation = n,
            role,
            ?cfg,
            sup_pid,
            "drill: side started"
        );
        Ok(Inc {
            engine_id,
            n,
            config: cfg,
            sup_pid,
            probes,
            engine_port: port,
            served: false,
            pid_file,
            exit_rx: rx,
            exited: None,
            torn_down: false,
            engine_pids: Vec::new(),
            pids_refreshed_in: None,
            engine_gone_us: None,
            state: None,
            transitions: Vec::new(),
            live: Prober::new(Instant::now(), liveness_spec(self.args)),
            sigkilled_at: None,
            sigkilled_us: None,
        })
    }
}
