//! `gmsctl`: inspect and verify a GMS.
//!
//! * `gmsctl state --socket PATH` prints the runtime state as one JSON object.
//! * `gmsctl events --socket PATH` prints the event history as one JSON object.
//! * `gmsctl load --socket PATH [--count N --size BYTES ...]`: a writer for tests/benchmarks.
//! * `gmsctl verify --socket PATH [--timeout DUR] [--backend host|cuda] [--device N]
//!   [--expect-hash HEX]` prints a JSON verdict.
//!
//! Exit codes: 0 ok; 1 internal error; 2 bad flags; 3 GMS unreachable; 4 nothing committed;
//! 5 read lock not granted in time; 6 layout hash mismatch; 7 allocation/metadata mismatch;
//! 8 an allocation could not be imported (e.g. truncated); 9 device memory dropped while
//! importing (copied, not shared); 10 protocol error; 11 import backend unavailable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gms_client::backend::BackendKind;
use gms_client::client::{ConnectOptions, GmsClient};
use gms_client::verify::{verify, VerifyOptions};

#[derive(Debug, Parser)]
#[command(
    name = "gmsctl",
    about = "Inspect and verify a GPU Memory Service",
    after_help = "Exit codes: 0 ok; 1 internal; 2 bad flags; 3 GMS unreachable; 4 nothing committed; \
5 read lock timeout; 6 layout hash mismatch; 7 allocation/metadata mismatch; 8 import failed \
(e.g. truncated); 9 device memory dropped while importing; 10 protocol error; 11 backend unavailable."
)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print the runtime state (no lock taken) as JSON.
    State {
        /// GMS socket.
        #[arg(long, env = "GMSCTL_SOCKET")]
        socket: PathBuf,
        /// Connection timeout.
        #[arg(long, env = "GMSCTL_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Print the event history (no lock taken) as JSON.
    Events {
        /// GMS socket.
        #[arg(long, env = "GMSCTL_SOCKET")]
        socket: PathBuf,
        /// Connection timeout.
        #[arg(long, env = "GMSCTL_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Take a read lock, import every allocation, check the layout; print a JSON verdict.
    Verify {
        /// GMS socket.
        #[arg(long, env = "GMSCTL_SOCKET")]
        socket: PathBuf,
        /// Bound of the connection and of the read-lock wait.
        #[arg(long, env = "GMSCTL_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Import backend.
        #[arg(long, env = "GMSCTL_BACKEND", value_enum, default_value = "host")]
        backend: BackendKind,
        /// CUDA device (cuda backend).
        #[arg(long, env = "GMSCTL_DEVICE", default_value_t = 0)]
        device: u32,
        /// Fail unless the committed layout hash is this one.
        #[arg(long, env = "GMSCTL_EXPECT_HASH")]
        expect_hash: Option<String>,
        /// Largest device free-memory drop accepted while importing (bytes, cuda).
        #[arg(long, env = "GMSCTL_MAX_IMPORT_OVERHEAD", default_value_t = 64 << 20)]
        max_import_overhead: u64,
    },
    /// Test/bench writer: allocate COUNT allocations of SIZE bytes, fill them (host backend)
    /// with a known pattern, put one metadata entry per allocation, then commit.
    /// Prints `{"event":"allocated",...}` once the allocations exist, and the commit result.
    Load {
        /// GMS socket.
        #[arg(long, env = "GMSCTL_SOCKET")]
        socket: PathBuf,
        /// Allocations to create.
        #[arg(long, env = "GMSCTL_COUNT", default_value_t = 4)]
        count: u64,
        /// Bytes per allocation.
        #[arg(long, env = "GMSCTL_SIZE", default_value_t = 2 << 20)]
        size: u64,
        /// Allocation tag.
        #[arg(long, env = "GMSCTL_TAG", default_value = "weights")]
        tag: String,
        /// Lock to ask for (rw, rw_or_ro, rw_data_or_rw).
        #[arg(long, env = "GMSCTL_LOCK", default_value = "rw")]
        lock: gms_client::protocol::RequestedLockType,
        /// Bound of the lock wait.
        #[arg(long, env = "GMSCTL_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Pause after allocating, before committing (tests kill the writer here).
        #[arg(long, env = "GMSCTL_HOLD", default_value = "0s", value_parser = humantime::parse_duration)]
        hold: Duration,
        /// Do not fill the bytes (faster for big benchmarks).
        #[arg(long, env = "GMSCTL_NO_FILL")]
        no_fill: bool,
        /// Exit without committing (the server aborts the writer's work).
        #[arg(long, env = "GMSCTL_NO_COMMIT")]
        no_commit: bool,
    },
}

fn main() {
    let args = Args::parse();
    let code = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(args)),
        Err(e) => {
            eprintln!("gmsctl: tokio runtime: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn print_json<T: serde::Serialize>(v: &T) -> i32 {
    match serde_json::to_string(v) {
        Ok(s) => {
            println!("{s}");
            0
        }
        Err(e) => {
            eprintln!("gmsctl: json: {e}");
            1
        }
    }
}

async fn connect(socket: &std::path::Path, timeout: Duration) -> Result<GmsClient, i32> {
    let opts = ConnectOptions {
        connect_timeout: timeout,
        retry_interval: Duration::from_millis(50),
        rpc_timeout: timeout,
    };
    GmsClient::connect(socket, opts).await.map_err(|e| {
        eprintln!("gmsctl: {e}");
        3
    })
}

async fn run(args: Args) -> i32 {
    match args.cmd {
        Cmd::Load {
            socket,
            count,
            size,
            tag,
            lock,
            timeout,
            hold,
            no_fill,
            no_commit,
        } => {
            let mut c = match connect(&socket, timeout).await {
                Ok(c) => c,
                Err(code) => return code,
            };
            let spec = gms_client::load::LoadSpec {
                count,
                size,
                tag,
                fill: !no_fill,
            };
            match gms_client::load::load(&mut c, lock, timeout, &spec, hold, !no_commit).await {
                Ok(mut r) => {
                    if r.committed {
                        if let Ok(mut c2) = connect(&socket, timeout).await {
                            r.memory_layout_hash =
                                c2.runtime_state().await.ok().map(|s| s.memory_layout_hash);
                        }
                    }
                    print_json(&r)
                }
                Err(e) => {
                    eprintln!("gmsctl load: {e}");
                    1
                }
            }
        }
        Cmd::State { socket, timeout } => {
            let mut c = match connect(&socket, timeout).await {
                Ok(c) => c,
                Err(code) => return code,
            };
            match c.runtime_state().await {
                Ok(s) => print_json(&s),
                Err(e) => {
                    eprintln!("gmsctl: {e}");
                    3
                }
            }
        }
        Cmd::Events { socket, timeout } => {
            let mut c = match connect(&socket, timeout).await {
                Ok(c) => c,
                Err(code) => return code,
            };
            match c.event_history().await {
                Ok(events) => print_json(&serde_json::json!({ "events": events })),
                Err(e) => {
                    eprintln!("gmsctl: {e}");
                    3
                }
            }
        }
        Cmd::Verify {
            socket,
            timeout,
            backend,
            device,
            expect_hash,
            max_import_overhead,
        } => {
            let opts = VerifyOptions {
                timeout,
                backend,
                device,
                expect_hash,
                max_import_overhead,
            };
            let v = verify(&socket, &opts).await;
            let printed = print_json(&v);
            if let Some(reason) = &v.reason {
                eprintln!("gmsctl verify: FAILED: {reason}");
            }
            match v.failure {
                None => printed,
                Some(kind) => kind.exit_code(),
            }
        }
    }
}
