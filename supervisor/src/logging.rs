//! Logging setup shared by `supervisor run` and the drill (`supervisor-drill`).

use crate::config::LogFormat;

/// Set up tracing on stderr (`RUST_LOG` filters, default `info`). A second call does nothing.
pub fn init(format: LogFormat) {
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
