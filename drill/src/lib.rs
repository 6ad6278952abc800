//! `supervisor drill` (the `supervisor-drill` binary; `supervisor drill ARGS...` execs it):
//! a self-contained failover drill on this machine.
//!
//! It starts its own `lockd serve`, two `supervisor run` (engine 0 primary, engine 1 shadow)
//! each wrapping a `fake-engine --gpu-claim` (or `--engine-cmd`), all in a temporary
//! directory and on loopback, then runs N rounds. Each round kills the Active side in one
//! of the [`schedule::FailureKind`] ways and checks the invariants ([`invariants`]):
//! at most one engine held the GPU claim at any instant, a new Active within the bound, no
//! process of the fenced engine alive when the next lease was granted, epochs strictly
//! increasing; and for a lockd crash, no failover at all. Dead sides are restarted as
//! shadows, as kubelet would. See docs/DRILL.md.
//!
//! Exit codes: 0 every round ran and no invariant was violated; 1 at least one invariant
//! violation; 2 the drill could not run or had to stop early (bad flags, missing binaries,
//! the setup never reached one Active + one Standby); 130 / 143 interrupted by SIGINT /
//! SIGTERM (everything is still cleaned up and the report covers the rounds done).
//!
//! Modules: [`flags`] (the command line), [`schedule`] (which kind each round, engine configs
//! ahead of time), [`invariants`] (pure checks and interval bookkeeping), [`report`]
//! (statistics, table, JSON), [`svg`] (picture), [`procs`] and [`observe`] (the I/O the runner
//! uses), `runner` (the orchestration: lockd, sides, kubelet emulation, rounds).
//!
//! [`nodes`] is the other drill, across "nodes" (`supervisor-drill-nodes`: network
//! namespaces, a 3-member etcd, lockd's etcd backend; docs/ETCD.md).

pub mod flags;
pub mod invariants;
pub mod nodes;
pub mod observe;
pub mod procs;
pub mod report;
mod runner;
pub mod schedule;
pub mod svg;

use std::time::Duration;

pub use flags::DrillArgs;

/// Exit code: every round ran, no invariant violated.
pub const EXIT_OK: i32 = 0;
/// Exit code: at least one invariant was violated.
pub const EXIT_VIOLATION: i32 = 1;
/// Exit code: the drill could not run or stopped early without a violation.
pub const EXIT_DRILL_ERROR: i32 = 2;

/// The environment variable that switches on the test-only planted bug in debug-built
/// supervisors (or release builds with the `planted-bugs` feature): release the lease before
/// the engine is dead (`supervisor::fault`). The drill passes its environment on to the supervisors it starts.
pub const PLANTED_BUG_ENV: &str = supervisor::fault::EARLY_RELEASE_ENV;

/// The environment variable of the second planted bug (same builds): the supervisor runs
/// without the lock anchor, as before issue 15. Compound rounds must catch it.
pub const PLANTED_NO_ANCHOR_ENV: &str = supervisor::fault::NO_ANCHOR_ENV;

/// Runs the drill on its own tokio runtime; returns the process exit code (see the module
/// docs). Errors are reported on stderr and mapped to [`EXIT_DRILL_ERROR`]. `RUST_LOG` turns
/// on the drill's own structured logs (stderr).
pub fn run(args: DrillArgs) -> anyhow::Result<i32> {
    if let Some(p) = &args.from_report {
        return Ok(rerender(p, args.svg.as_deref()));
    }
    if std::env::var_os("RUST_LOG").is_some() {
        supervisor::logging::init(supervisor::config::LogFormat::Text);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let code = rt.block_on(runner::run(args));
    rt.shutdown_timeout(Duration::from_millis(200));
    Ok(code)
}

/// `--from-report`: summary table and SVG from a saved report.
fn rerender(report: &std::path::Path, svg_out: Option<&std::path::Path>) -> i32 {
    let text = match std::fs::read_to_string(report) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("supervisor drill: reading {}: {e}", report.display());
            return EXIT_DRILL_ERROR;
        }
    };
    let rep: report::Report = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "supervisor drill: {} is not a drill report: {e}",
                report.display()
            );
            return EXIT_DRILL_ERROR;
        }
    };
    let summary = report::summarize(&rep.rounds);
    print!("{}", report::summary_table(&summary));
    if let Some(out) = svg_out {
        let title = format!("supervisor drill, {} rounds", rep.rounds.len());
        let written = svg::render(&rep.rounds, &summary, &title)
            .map_err(|e| e.to_string())
            .and_then(|s| std::fs::write(out, s).map_err(|e| e.to_string()));
        if let Err(e) = written {
            eprintln!("supervisor drill: writing {}: {e}", out.display());
            return EXIT_DRILL_ERROR;
        }
    }
    rep.exit_code
}
