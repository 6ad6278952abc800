//! Top-level command line. Adding a subcommand = one variant in [`Command`] + one arm in
//! [`main_with`]. `drill` is reserved (implemented in `src/drill/` by its owner).

use clap::{Parser, Subcommand};

use crate::config::{LogFormat, RunArgs};

/// `supervisor`: GPU failover supervisor for one inference engine.
#[derive(Debug, Parser)]
#[command(name = "supervisor", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Spawn the engine and drive it through Init -> Standby -> Waking -> Active -> Dead.
    Run(Box<RunArgs>),
    /// Failover drill on this machine: its own lockd, two supervisors, two fake engines;
    /// kills the Active side N times and checks that no split brain happened (docs/DRILL.md).
    Drill(Box<crate::drill::DrillArgs>),
}

/// Set up tracing on stderr (`RUST_LOG` filters, default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => b.json().flatten_event(true).try_init(),
        LogFormat::Text => b.try_init(),
    };
}

/// Run the parsed command line; returns the process exit status.
pub fn main_with(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Run(args) => run_main(*args),
        Command::Drill(args) => crate::drill::run(*args),
    }
}

/// `supervisor run` on a runtime whose main thread runs the driver: the engine is forked from
/// the main thread, which lives as long as the process (PDEATHSIG is per forking thread).
pub fn run_main(args: RunArgs) -> anyhow::Result<i32> {
    init_logging(args.log_format);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(crate::driver::run(args))?;
    // Do not wait for stray tasks (pooled HTTP connections) on the way out.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    Ok(outcome.exit_code)
}
