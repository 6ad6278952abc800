//! One `supervisor run` wrapping a fake engine: how to start it ([`SupOpts`]) and the running
//! pair ([`Sup`]): its probes, its typed `/state`, the engine's pids and HTTP API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use probes::{MarkKind, Phase, StateDoc};

use crate::proc::Proc;
use crate::wait::wait_until;

/// The timeout of every HTTP call the harness makes to a supervisor or an engine.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// `--restart` (default `never`: the supervisor exits right after fencing, which most
    /// tests assert through its exit status; a test opts into re-arming with
    /// [`SupOpts::restart`]).
    pub restart: &'static str,
    /// Fixed (probes, engine) addresses instead of fresh free ones (e.g. a router configured
    /// before the supervisors start).
    pub addrs: Option<(SocketAddr, SocketAddr)>,
    /// `--lock` endpoint instead of the cluster's own lockd (e.g. one of several etcd-backed
    /// lockds standing for nodes).
    pub lock: Option<String>,
    /// A real engine instead of fake-engine: its command (given the engine port) and the
    /// environment it needs (set on the supervisor, which the engine inherits).
    pub real_engine: Option<RealEngine>,
}

/// A real engine's command line for a given port, and its environment.
#[derive(Clone, Debug)]
pub struct RealEngine {
    /// argv, given the port the engine must serve on.
    pub argv: fn(&crate::vllm::RealVllm, u16) -> Vec<std::ffi::OsString>,
    /// The prepared engine.
    pub vllm: crate::vllm::RealVllm,
    /// Environment.
    pub env: Vec<(&'static str, &'static str)>,
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
            restart: "never",
            addrs: None,
            lock: None,
            real_engine: None,
        }
    }

    /// Run this real vLLM instead of fake-engine.
    pub fn real_vllm(mut self, vllm: &crate::vllm::RealVllm) -> SupOpts {
        self.real_engine = Some(RealEngine {
            argv: crate::vllm::RealVllm::argv,
            vllm: vllm.clone(),
            env: crate::vllm::RealVllm::env(),
        });
        self
    }

    /// Connect to this lockd endpoint (`unix:PATH` / `tcp:HOST:PORT`) instead of the
    /// cluster's.
    pub fn lock(mut self, endpoint: impl Into<String>) -> SupOpts {
        self.lock = Some(endpoint.into());
        self
    }

    /// Use these probe and engine addresses.
    pub fn addrs(mut self, probes: SocketAddr, engine: SocketAddr) -> SupOpts {
        self.addrs = Some((probes, engine));
        self
    }

    /// `--restart MODE` (`on-failure` re-arms the engine after fencing).
    pub fn restart(mut self, mode: &'static str) -> SupOpts {
        self.restart = mode;
        self
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

    /// Use another adapter (`sglang`).
    pub fn adapter(mut self, adapter: &'static str) -> SupOpts {
        self.adapter = adapter;
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

/// GET `path` on `addr` with [`HTTP_TIMEOUT`]: (status, body), `None` if nothing answers.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    crate::http::get(&format!("http://{addr}{path}"), HTTP_TIMEOUT).map(|r| (r.status, r.body))
}

/// `/state` of the supervisor whose probe server is `addr`, typed; `None` if nothing answers.
/// Panics if it answers something that is not a `/state` document (a broken contract).
pub fn state_of(addr: SocketAddr) -> Option<StateDoc> {
    let (code, body) = get(addr, "/state")?;
    assert_eq!(code, 200, "/state answered {code}: {body}");
    Some(
        StateDoc::parse(&body).unwrap_or_else(|e| panic!("/state is not a StateDoc ({e}): {body}")),
    )
}

impl Sup {
    /// GET a probe; status code or None when nothing answers.
    pub fn probe(&self, path: &str) -> Option<u16> {
        get(self.probes, path).map(|x| x.0)
    }

    /// GET `/metrics`; panics if nothing answers.
    pub fn metrics(&self) -> crate::metrics::Metrics {
        crate::metrics::scrape(self.probes.port())
    }

    /// `/state`, typed (None while nothing answers).
    pub fn state(&self) -> Option<StateDoc> {
        state_of(self.probes)
    }

    /// The current phase (`/state.state`).
    pub fn phase(&self) -> Option<Phase> {
        self.state().map(|s| s.state)
    }

    /// Wait until `/state.state == phase`.
    pub fn wait_phase(&self, phase: Phase, timeout: Duration) -> bool {
        wait_until(timeout, Duration::from_millis(10), || {
            self.phase() == Some(phase)
        })
    }

    /// Wait until `/state` has `mark`; returns the document then (None on timeout).
    pub fn wait_mark(&self, mark: MarkKind, timeout: Duration) -> Option<StateDoc> {
        let mut found = None;
        wait_until(timeout, Duration::from_millis(10), || {
            found = self.state().filter(|s| s.mark(mark).is_some());
            found.is_some()
        });
        found
    }

    /// Pids in the engine's pid file (engine first, then workers).
    pub fn engine_pids(&self) -> Vec<i32> {
        read_pid_file(&self.pid_file)
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

    /// POST a completion to the engine directly: (status, body JSON; `Null` if not JSON).
    /// Panics on a completion marked `"garbage": true` (served from weights never restored).
    pub fn completion(&self) -> Option<(u16, serde_json::Value)> {
        crate::http::post_json(
            &format!("http://{}/v1/completions", self.engine),
            r#"{"prompt":"hi","max_tokens":1}"#,
            HTTP_TIMEOUT,
        )
        .map(|r| {
            let body: serde_json::Value =
                serde_json::from_str(&r.body).unwrap_or(serde_json::Value::Null);
            // fake-engine marks completions served from weights that were never restored
            // (a level-2 wake without the reload, an SGLang resume without a CPU backup):
            // whatever the test checks next, that is a failed wake.
            assert_ne!(
                body.get("garbage"),
                Some(&serde_json::Value::Bool(true)),
                "the engine served garbage weights: {body}"
            );
            (r.status, body)
        })
    }

    /// Supervisor + engine log.
    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

/// The pids in a fake engine's pid file (one per line; empty if absent).
pub fn read_pid_file(path: &std::path::Path) -> Vec<i32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}
