//! `supervisor` binary: see the library docs and README.md.

use clap::Parser;

fn main() {
    let cli = supervisor::cli::Cli::parse();
    match supervisor::cli::main_with(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("supervisor: {e:#}");
            std::process::exit(1);
        }
    }
}
