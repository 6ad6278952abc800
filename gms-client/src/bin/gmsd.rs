//! `gmsd --socket PATH [--backend host|cuda] [--device N]`: a GMS server.
//!
//! Exit status: 0 after SIGTERM/SIGINT (clean stop); 1 when it cannot start (a live
//! server on the socket, bind failure, no CUDA driver for `--backend cuda`, bad flags: 2).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use gms_client::backend::{cuda, BackendKind, HostBackend};
use gms_client::server;

#[derive(Debug, Parser)]
#[command(
    name = "gmsd",
    about = "GPU Memory Service server (host or CUDA backend)"
)]
struct Args {
    /// Unix socket to serve on.
    #[arg(long, env = "GMSD_SOCKET")]
    socket: PathBuf,
    /// Memory backend: `host` (memfd, no GPU needed) or `cuda` (CUDA VMM).
    #[arg(long, env = "GMSD_BACKEND", value_enum, default_value = "host")]
    backend: BackendKind,
    /// CUDA device ordinal (cuda backend).
    #[arg(long, env = "GMSD_DEVICE", default_value_t = 0)]
    device: u32,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers we can still serve; we just never stop cleanly.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("gmsd: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let listener = server::bind_socket(&args.socket)?;
        match args.backend {
            BackendKind::Host => {
                server::serve(
                    listener,
                    args.socket.clone(),
                    HostBackend,
                    shutdown_signal(),
                )
                .await?
            }
            BackendKind::Cuda => {
                let backend = cuda::CudaServer::new(args.device).inspect_err(|_| {
                    let _ = std::fs::remove_file(&args.socket);
                })?;
                server::serve(listener, args.socket.clone(), backend, shutdown_signal()).await?
            }
        }
        Ok(())
    })
}
