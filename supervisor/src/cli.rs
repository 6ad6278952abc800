//! Top-level command line. Adding a subcommand = one variant in [`Command`] + one arm in
//! [`main_with`]. `drill` is the drill's binary, `supervisor-drill` (the `drill/` crate), run
//! git-style: `supervisor drill ARGS...` execs `supervisor-drill ARGS...`, so the production
//! binary links none of the drill's code.

use clap::{Parser, Subcommand};

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::config::RunArgs;

/// The drill's executable, looked up next to this one, then on `$PATH`.
pub const DRILL_BIN: &str = "supervisor-drill";

/// Exit code of `supervisor drill` when `supervisor-drill` cannot be found (or executed); the
/// shell's "command not found". Every other code is the drill's own (docs/DRILL.md).
pub const EXIT_DRILL_NOT_FOUND: i32 = 127;

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
    /// Runs `supervisor-drill ARGS...` (next to this executable, or on $PATH); `supervisor
    /// drill --help` shows its flags.
    #[command(disable_help_flag = true)]
    Drill {
        /// Everything after `drill`, passed on to `supervisor-drill` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<OsString>,
    },
}

/// Run the parsed command line; returns the process exit status.
pub fn main_with(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Run(args) => run_main(*args),
        Command::Drill { args } => Ok(exec_drill(&args)),
    }
}

/// Where `supervisor drill` looks for [`DRILL_BIN`], in order: next to this executable, then
/// each `$PATH` directory.
pub fn drill_candidates(exe: Option<&Path>, path: Option<&std::ffi::OsStr>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = exe
        .and_then(Path::parent)
        .map(|d| d.join(DRILL_BIN))
        .into_iter()
        .collect();
    for d in std::env::split_paths(path.unwrap_or_default()) {
        let p = d.join(DRILL_BIN);
        if !d.as_os_str().is_empty() && !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// `supervisor drill ARGS...`: replaces this process with `supervisor-drill ARGS...` (exit
/// codes and signals are the drill's). Returns only when it could not: then the error is on
/// stderr and the result is [`EXIT_DRILL_NOT_FOUND`].
pub fn exec_drill(args: &[OsString]) -> i32 {
    let exe = std::env::current_exe().ok();
    let path = std::env::var_os("PATH");
    let candidates = drill_candidates(exe.as_deref(), path.as_deref());
    let Some(bin) = candidates.iter().find(|p| p.is_file()) else {
        let looked = candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        eprintln!(
            "supervisor: `{DRILL_BIN}` not found (looked in: {}); build it (cargo build -p supervisor-drill) or put it next to supervisor or on $PATH",
            if looked.is_empty() { "nowhere: no executable path and no $PATH" } else { &looked }
        );
        return EXIT_DRILL_NOT_FOUND;
    };
    let err = std::process::Command::new(bin).args(args).exec();
    eprintln!("supervisor: cannot execute {}: {err}", bin.display());
    EXIT_DRILL_NOT_FOUND
}

/// `supervisor run` on a runtime whose main thread runs the driver: the engine is forked from
/// the main thread, which lives as long as the process (PDEATHSIG is per forking thread).
pub fn run_main(args: RunArgs) -> anyhow::Result<i32> {
    crate::logging::init(args.log_format);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(crate::driver::run(args))?;
    // Do not wait for stray tasks (pooled HTTP connections) on the way out.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    Ok(outcome.exit_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drill_is_looked_for_next_to_us_then_on_path() {
        let c = drill_candidates(
            Some(Path::new("/opt/x/supervisor")),
            Some(std::ffi::OsStr::new("/usr/bin::/bin:/usr/bin")),
        );
        assert_eq!(
            c,
            [
                PathBuf::from("/opt/x/supervisor-drill"),
                PathBuf::from("/usr/bin/supervisor-drill"),
                PathBuf::from("/bin/supervisor-drill"),
            ]
        );
        assert!(drill_candidates(None, None).is_empty());
    }

    #[test]
    fn drill_arguments_pass_through_unparsed() {
        let cli = Cli::try_parse_from([
            "supervisor",
            "drill",
            "--help",
            "--iterations",
            "3",
            "--engine-arg=--wake=1s",
        ])
        .expect("parses");
        match cli.command {
            Command::Drill { args } => assert_eq!(
                args,
                ["--help", "--iterations", "3", "--engine-arg=--wake=1s"]
                    .map(OsString::from)
                    .to_vec()
            ),
            other => panic!("not drill: {other:?}"),
        }
    }
}
