//! `supervisor-drill` binary (also run as `supervisor drill`): see the library docs and
//! docs/DRILL.md.

use clap::Parser;

fn main() {
    let args = drill::DrillArgs::parse();
    match drill::run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("supervisor drill: {e:#}");
            std::process::exit(drill::EXIT_DRILL_ERROR);
        }
    }
}
