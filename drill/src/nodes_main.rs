//! `supervisor-drill-nodes`: the failover drill across "nodes" (network namespaces on a
//! bridge, a 3-member etcd, a lockd + supervisor + fake engine per node). See
//! `drill::nodes` and docs/ETCD.md ("The drill across nodes").
//!
//! Exit codes: 0 every trial kept the invariants; 1 at least one violation; 2 the drill could
//! not run (bad flags, setup failed); 3 skipped: this machine cannot create network namespaces
//! or has no etcd (the reason is printed).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use drill::nodes::{self, Chaos, Config, Outcome};

/// The failover drill across nodes (network namespaces, etcd backend).
#[derive(Debug, Parser)]
#[command(name = "supervisor-drill-nodes", version)]
struct Args {
    /// Trials to run (the kinds round-robin).
    #[arg(long, default_value_t = 14)]
    rounds: usize,
    /// Chaos kinds, comma-separated (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    kinds: Vec<Chaos>,
    /// Nodes (namespaces), each with lockd + supervisor + engine.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// lockd `--etcd-ttl`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
    ttl: Duration,
    /// lockd `--etcd-kill-time`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "500ms")]
    kill_time: Duration,
    /// lockd `--etcd-pause`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "200ms")]
    pause: Duration,
    /// lockd `--etcd-drift-ppm`.
    #[arg(long, default_value_t = 10_000)]
    drift_ppm: u32,
    /// supervisor `--lock-watchdog` (at most 2/3 of TTL − margin); `0` leaves it off (a
    /// planted bug: nothing fences the engine of a frozen lockd).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1200ms")]
    watchdog: Duration,
    /// etcd `--election-timeout` (heartbeat: a tenth). A leader's loss leaves the leases
    /// unrenewed for about this plus the keepalive period: the fence deadline (TTL − margin)
    /// must exceed it, or an etcd failure costs the lease.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "500ms")]
    election: Duration,
    /// lockd `--etcd-leader-change`: `trust` keeps the lease across etcd leader changes (the
    /// etcd kinds must then not move it), `fence` fences the holders at every leader change
    /// (the etcd kinds may then fail over, but only safely), `auto` (lockd's default) is
    /// `fence` on an etcd with the stale-leader revoke (etcd-io/etcd#15247, < 3.4.31 / 3.5.13).
    #[arg(long, default_value = "auto")]
    leader_change: lockd::etcd::LeaderChange,
    /// Write the report (every trial, per-kind figures) as JSON here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// An environment variable for every lockd, `KEY=VALUE` (repeatable): the test-only
    /// planted bugs, e.g. `LOCKD_PLANTED_BUG_FENCE_NO_MARGIN=1`.
    #[arg(long, value_parser = parse_env)]
    lockd_env: Vec<(String, String)>,
    /// Keep the drill's directory (logs of every process).
    #[arg(long)]
    keep: bool,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s}: not KEY=VALUE"))
}

fn main() {
    let args = Args::parse();
    match run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("supervisor-drill-nodes: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run(a: Args) -> anyhow::Result<i32> {
    let kinds = if a.kinds.is_empty() {
        Chaos::ALL.to_vec()
    } else {
        a.kinds
    };
    let cfg = Config {
        nodes: a.nodes,
        ttl: a.ttl,
        kill_time: a.kill_time,
        pause: a.pause,
        drift_ppm: a.drift_ppm,
        watchdog: (!a.watchdog.is_zero()).then_some(a.watchdog),
        lockd_env: a.lockd_env,
        election: a.election,
        leader_change: a.leader_change,
        keep_dir: a.keep,
        keep_on_violation: true,
    };
    let out = nodes::run(cfg, &kinds, a.rounds, |t| {
        println!("{}", nodes::trial_line(t))
    })?;
    let rep = match out {
        Outcome::Skipped(why) => {
            eprintln!("SKIP: supervisor-drill-nodes: {why}");
            return Ok(3);
        }
        Outcome::Ran(r) => r,
    };
    print!("{}", rep.table());
    if let Some(p) = &a.report {
        std::fs::write(p, serde_json::to_string_pretty(&rep)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    let v = rep.violations();
    println!(
        "{} trials, {v} violations, {} cascades (a leader change's fence moving the lease twice)",
        rep.trials.len(),
        rep.cascades()
    );
    Ok(if v == 0 { 0 } else { 1 })
}
