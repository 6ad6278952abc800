//! `lockd`: the lock daemon (`serve`) and its command-line clients.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::anyhow;
use clap::{Parser, Subcommand, ValueEnum};
use lockd::client::{ClientOptions, LockClient, LockEvent};
use lockd::proto::{self, Request};
use lockd::server::{ServeConfig, Server};
use lockd::Endpoint;

const EXIT_CODES: &str = "\
Exit codes:
  0    success (serve: clean stop on SIGTERM/SIGINT)
  1    error: lockd refused the request (renew of an ended lease, wrong token, ...), or serve
       could not start / had to stop (reason on stderr)
  2    bad command line
  69   could not connect to lockd (or the connection broke)
  75   hold, acquire: --timeout passed before the grant; acquire --no-wait: busy / unavailable;
       reserve: not all N could be reserved (fail: now; wait: within --timeout)
  126  hold: CMD could not be executed
  127  hold: CMD not found
  N    hold, reserve: CMD's own exit status (128+SIG when CMD was killed by signal SIG)";

const EXIT_ERROR: u8 = 1;
const EXIT_UNAVAILABLE: u8 = 69;
const EXIT_TIMEOUT: u8 = 75;

#[derive(Parser)]
#[command(name = "lockd", version, about = "Connection-as-lock daemon with durable state, a reconnect window and fencing epochs", after_help = EXIT_CODES)]
struct Cli {
    /// Log format (logs go to stderr).
    #[arg(
        long,
        env = "LOCKD_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once per process: the size of `serve`'s flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Serve until SIGTERM/SIGINT.
    #[command(after_help = EXIT_CODES)]
    Serve(ServeArgs),
    /// Reserve the resource on N of several independent lockd instances, all or nothing
    /// (QURD), run CMD with all N, watch them while it runs; exit 75 when they could not be had.
    #[command(after_help = EXIT_CODES)]
    Reserve(ReserveArgs),
    /// Print holders, epochs, states, waiters and counters as one JSON object.
    #[command(after_help = EXIT_CODES)]
    Status {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
        /// Leave out the per-session list (prints `session_count` instead).
        #[arg(long, env = "LOCKD_STATUS_NO_SESSIONS", value_parser = clap::builder::BoolishValueParser::new())]
        no_sessions: bool,
    },
    /// Print the live version-2 leases (and waiting requests), one JSON object per line.
    #[command(after_help = EXIT_CODES)]
    Leases {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
        /// Only this resource (or pool).
        #[arg(long, env = "LOCKD_LEASES_RESOURCE")]
        resource: Option<String>,
        /// Only this holder name.
        #[arg(long, env = "LOCKD_LEASES_HOLDER")]
        holder: Option<String>,
    },
    /// Print what lockd knows of one lease id (live, ended with its reason, or unknown).
    #[command(after_help = EXIT_CODES)]
    Lease {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
        /// The lease id.
        #[arg(env = "LOCKD_LEASE_ID")]
        id: u64,
    },
    /// Add or change an offer of a quantity pool.
    #[command(after_help = EXIT_CODES)]
    Offer(OfferArgs),
    /// Withdraw an offer of a quantity pool (its leases run out; renewals are refused).
    #[command(after_help = EXIT_CODES)]
    Withdraw {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
        /// The pool.
        #[arg(long, env = "LOCKD_POOL")]
        pool: String,
        /// The offer's name.
        #[arg(long, env = "LOCKD_OFFER_NAME")]
        name: String,
        /// Required over TCP: lockd's --admin-token.
        #[arg(long, env = "LOCKD_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: Option<String>,
    },
    /// Acquire a lease that outlives this command (TTL, timed shared/exclusive, quantity),
    /// print the grant as JSON and optionally save (lease id, token) to a file.
    #[command(after_help = EXIT_CODES)]
    Acquire(AcquireArgs),
    /// Renew a TTL, timed shared or quantity lease; prints its new deadline.
    #[command(after_help = EXIT_CODES)]
    Renew {
        #[command(flatten)]
        lease: LeaseArgs,
        /// Ask for a new TTL / lease time (default: the one granted).
        #[arg(long, env = "LOCKD_TTL", value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
    },
    /// Release a lease (or withdraw a waiting request) by lease id and token.
    #[command(after_help = EXIT_CODES)]
    Release {
        #[command(flatten)]
        lease: LeaseArgs,
    },
    /// Like flock(1): wait for the lock, then run CMD holding it (CMD inherits the connection).
    #[command(after_help = EXIT_CODES)]
    Hold(HoldArgs),
    /// Tell the holder of RESOURCE to fence itself; the lease stays until its connection closes.
    #[command(after_help = EXIT_CODES)]
    Revoke {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
        /// The resource whose lease is revoked.
        #[arg(long, env = "LOCKD_REVOKE_RESOURCE")]
        resource: String,
        /// Passed on to the holder.
        #[arg(
            long,
            env = "LOCKD_REVOKE_REASON",
            default_value = "revoked by operator"
        )]
        reason: String,
        /// Required over TCP: lockd's --admin-token.
        #[arg(long, env = "LOCKD_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: Option<String>,
    },
    /// Print grants, releases, expirations and revocations as JSON lines until interrupted.
    #[command(after_help = EXIT_CODES)]
    Watch {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Listener (repeatable): unix:PATH (socket mode 0660) or tcp:HOST:PORT.
    #[arg(long, env = "LOCKD_LISTEN", value_delimiter = ',', required = true)]
    listen: Vec<Endpoint>,
    /// Durable state file (a STATE.lock beside it keeps a second lockd away); file backend only.
    #[arg(long, env = "LOCKD_STATE", required_unless_present = "etcd_endpoints")]
    state: Option<PathBuf>,
    /// After a restart, how long a persisted holder has to reclaim its lease.
    #[arg(long, env = "LOCKD_RECONNECT_WINDOW", default_value = "10s", value_parser = humantime::parse_duration)]
    reconnect_window: Duration,
    /// Serve Prometheus metrics on HOST:PORT (GET /metrics).
    #[arg(long, env = "LOCKD_METRICS")]
    metrics: Option<String>,
    /// Token that `revoke` over TCP must carry (revoke over TCP is refused without it).
    #[arg(long, env = "LOCKD_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Longest request line in bytes; longer lines get an error and a disconnect.
    #[arg(long, env = "LOCKD_MAX_LINE", default_value_t = proto::DEFAULT_MAX_LINE)]
    max_line: usize,
    /// A connection that sends no request within this time is closed.
    #[arg(long, env = "LOCKD_IDLE_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    idle_timeout: Duration,
    /// Requests per second per connection before it is disconnected as a flood.
    #[arg(long, env = "LOCKD_RATE_LIMIT", default_value_t = 10_000)]
    rate_limit: u32,
    /// Events buffered for a connection that does not read before it is disconnected.
    #[arg(long, env = "LOCKD_OUTBOUND_QUEUE", default_value_t = 1024)]
    outbound_queue: usize,
    /// A connection whose socket accepts no bytes for this long is disconnected.
    #[arg(long, env = "LOCKD_WRITE_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    write_timeout: Duration,
    /// After each request keep polling the sockets this long without sleeping, so that a
    /// client's next request is read without a thread wakeup (0 = off). Costs at most this
    /// much CPU per request; an idle lockd never spins.
    #[arg(long, env = "LOCKD_BUSY_POLL", default_value = "100us", value_parser = humantime::parse_duration)]
    busy_poll: Duration,
    /// Longest TTL / lease time granted to TTL, timed shared and quantity leases (what a
    /// request asks for beyond it is cut to it).
    #[arg(long, env = "LOCKD_MAX_LEASE_TIME", default_value = "1h", value_parser = humantime::parse_duration)]
    max_lease_time: Duration,
    /// Quantity leases: renewals never extend a lease past its first grant plus this.
    #[arg(long, env = "LOCKD_MAX_TOTAL_LEASE_TIME", default_value = "24h", value_parser = humantime::parse_duration)]
    max_total_lease_time: Duration,
    /// Revoke the youngest lease of every wait-for cycle of sessions (reason `deadlock`).
    #[arg(long, env = "LOCKD_BREAK_DEADLOCKS", value_parser = clap::builder::BoolishValueParser::new())]
    break_deadlocks: bool,
    /// Ended version-2 leases remembered (queryable by `lease`) at most this many; each is
    /// part of every snapshot of the state, so keep it modest.
    #[arg(long, env = "LOCKD_MAX_TOMBSTONES", default_value_t = 1000)]
    max_tombstones: usize,
    /// ... and at most this long.
    #[arg(long, env = "LOCKD_TOMBSTONE_AGE", default_value = "1h", value_parser = humantime::parse_duration)]
    tombstone_age: Duration,
    /// Write a whole state snapshot (and empty the journal `STATE.journal`) once the journal
    /// passes this many bytes (default: max(1 MiB, twice the snapshot)).
    #[arg(long, env = "LOCKD_COMPACT_AFTER")]
    compact_after: Option<u64>,
    /// Offers of quantity pools to set at startup (JSON, see PROTOCOL.md "Offers file").
    #[arg(long, env = "LOCKD_OFFERS")]
    offers: Option<PathBuf>,
    #[command(flatten)]
    etcd: EtcdArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// The state file (`--state`): one lockd per pod or node.
    File,
    /// Leases held in etcd (docs/ETCD.md): lockds on many nodes, one lock space.
    Etcd,
}

/// `--backend etcd` (docs/ETCD.md).
#[derive(clap::Args)]
struct EtcdArgs {
    /// Where leases are held: `file` (--state) or `etcd` (--etcd-endpoints).
    #[arg(long, env = "LOCKD_BACKEND", value_enum, default_value = "file")]
    backend: BackendArg,
    /// etcd client URLs, comma-separated (http://HOST:PORT).
    #[arg(long, env = "LOCKD_ETCD_ENDPOINTS", value_delimiter = ',')]
    etcd_endpoints: Vec<String>,
    /// TTL of each session's etcd lease (whole seconds; etcd may raise it to its minimum).
    #[arg(long, env = "LOCKD_ETCD_TTL", default_value = "5s", value_parser = humantime::parse_duration)]
    etcd_ttl: Duration,
    /// Key prefix of the locks: `PREFIX/RESOURCE/LEASE`; fenced puts go to `PREFIX.data/KEY`.
    #[arg(long, env = "LOCKD_ETCD_PREFIX", default_value = "/lockd")]
    etcd_prefix: String,
    /// Self-fence margin: the holder's kill-and-reap time after `revoked` (lost).
    #[arg(long, env = "LOCKD_ETCD_KILL_TIME", default_value = "500ms", value_parser = humantime::parse_duration)]
    etcd_kill_time: Duration,
    /// Self-fence margin: lockd's own scheduling pause allowance.
    #[arg(long, env = "LOCKD_ETCD_PAUSE", default_value = "100ms", value_parser = humantime::parse_duration)]
    etcd_pause: Duration,
    /// Self-fence margin: clock-rate difference bound between lockd and etcd, in ppm of the TTL.
    #[arg(long, env = "LOCKD_ETCD_DRIFT_PPM", default_value_t = 10_000)]
    etcd_drift_ppm: u32,
    /// Bound on one etcd call.
    #[arg(long, env = "LOCKD_ETCD_OP_TIMEOUT", default_value = "1s", value_parser = humantime::parse_duration)]
    etcd_op_timeout: Duration,
    /// This lockd's name in lock keys' values (`holder@NODE`); default: hostname.
    #[arg(long, env = "LOCKD_ETCD_NODE")]
    etcd_node: Option<String>,
    /// At an etcd leader change: `trust` keeps the leases (unsafe on etcd < 3.4.31 / 3.5.13,
    /// whose stalled former leader can revoke them), `fence` fences every holder at its old
    /// term's deadline, `auto` (default) fences on such an etcd and trusts a fixed one.
    #[arg(long, env = "LOCKD_ETCD_LEADER_CHANGE", default_value = "auto")]
    etcd_leader_change: lockd::etcd::LeaderChange,
    /// A waiter revokes its predecessor's etcd lease once it has provably expired on etcd's
    /// leader (two "0 s left" answers a second apart in one raft term), instead of waiting up
    /// to 500 ms for etcd's own expiry check (docs/ETCD.md).
    #[arg(long, env = "LOCKD_ETCD_ENFORCE_EXPIRY", default_value_t = true, action = clap::ArgAction::Set)]
    etcd_enforce_expiry: bool,
    /// TLS to etcd: the CA (PEM) of etcd's serving certificate; the endpoints are then
    /// https://.
    #[arg(long, env = "LOCKD_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// TLS to etcd: this lockd's client certificate (PEM), for etcd's --client-cert-auth.
    #[arg(long, env = "LOCKD_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// TLS to etcd: the client certificate's private key (PEM).
    #[arg(long, env = "LOCKD_ETCD_KEY", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication enabled (`etcdctl auth enable`); its role
    /// needs readwrite on the key prefix. The password comes from --etcd-password-file.
    #[arg(long, env = "LOCKD_ETCD_USER", requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password (its first line). A file, not a flag: command
    /// lines are readable by every process in /proc.
    #[arg(long, env = "LOCKD_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
}

#[derive(clap::Args)]
struct OfferArgs {
    /// unix:PATH or tcp:HOST:PORT
    #[arg(long, env = "LOCKD_CONNECT")]
    connect: Endpoint,
    /// The pool (a resource name used with `acquire --quantity`).
    #[arg(long, env = "LOCKD_POOL")]
    pool: String,
    /// The offer's name, unique in the pool.
    #[arg(long, env = "LOCKD_OFFER_NAME")]
    name: String,
    /// How much it offers.
    #[arg(long, env = "LOCKD_OFFER_QUANTITY")]
    quantity: u32,
    /// An attribute KEY=VALUE (repeatable; the env var takes a comma-separated list).
    #[arg(long = "attr", env = "LOCKD_OFFER_ATTRS", value_delimiter = ',', value_parser = parse_attr)]
    attrs: Vec<(String, String)>,
    /// The longest lease it allows.
    #[arg(long, env = "LOCKD_OFFER_MAX_LEASE_TIME", value_parser = humantime::parse_duration)]
    max_lease_time: Option<Duration>,
    /// What it requires of requests' attributes (label selector, e.g. `team in (a,b)`).
    #[arg(long, env = "LOCKD_OFFER_REQUIREMENTS")]
    requirements: Option<String>,
    /// Required over TCP: lockd's --admin-token.
    #[arg(long, env = "LOCKD_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("kind").required(true).multiple(true).args(["mode", "quantity", "ttl"])))]
struct AcquireArgs {
    /// unix:PATH or tcp:HOST:PORT
    #[arg(long, env = "LOCKD_CONNECT")]
    connect: Endpoint,
    /// The resource (or, with --quantity, the pool).
    #[arg(long, env = "LOCKD_ACQUIRE_RESOURCE")]
    resource: String,
    /// Holder name shown in status and leases.
    #[arg(long, env = "LOCKD_HOLDER")]
    holder: String,
    /// TTL lease (alone), or the TTL of a shared/exclusive lease, or a quantity lease's
    /// lease time.
    #[arg(long, env = "LOCKD_TTL", value_parser = humantime::parse_duration)]
    ttl: Option<Duration>,
    /// Shared/exclusive lease with versions (needs --ttl here: a connection-bound one would
    /// end when this command exits).
    #[arg(
        long,
        env = "LOCKD_MODE",
        value_enum,
        conflicts_with = "quantity",
        requires = "ttl"
    )]
    mode: Option<ModeArg>,
    /// Shared mode: wait until the resource's version is at least V.
    #[arg(long, env = "LOCKD_MIN_VERSION", requires = "mode")]
    min_version: Option<u64>,
    /// Quantity lease: this much of the pool RESOURCE.
    #[arg(long, env = "LOCKD_QUANTITY")]
    quantity: Option<u32>,
    /// Quantity: label selector the offers' attributes must match (e.g. `model in (h100)`).
    #[arg(long, env = "LOCKD_REQUIREMENTS", requires = "quantity")]
    requirements: Option<String>,
    /// Quantity: an attribute KEY=VALUE of this request (repeatable; the env var takes a
    /// comma-separated list).
    #[arg(long = "attr", env = "LOCKD_ATTRS", value_delimiter = ',', value_parser = parse_attr, requires = "quantity")]
    attrs: Vec<(String, String)>,
    /// Do not wait: exit 75 when the resource is taken (or the pool cannot grant it now).
    #[arg(long, env = "LOCKD_NO_WAIT", value_parser = clap::builder::BoolishValueParser::new())]
    no_wait: bool,
    /// Give up (exit 75) if not granted within this time.
    #[arg(long, env = "LOCKD_ACQUIRE_TIMEOUT", value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Write {"lease_id":N,"token":"…"} to FILE (mode 0600) for renew/release --saved.
    #[arg(long, env = "LOCKD_SAVE")]
    save: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Shared,
    Exclusive,
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["saved", "lease_id"])))]
struct LeaseArgs {
    /// unix:PATH or tcp:HOST:PORT
    #[arg(long, env = "LOCKD_CONNECT")]
    connect: Endpoint,
    /// A file written by `acquire --save`.
    #[arg(long, env = "LOCKD_SAVED", conflicts_with_all = ["lease_id", "token"])]
    saved: Option<PathBuf>,
    /// The lease id (with --token).
    #[arg(long, env = "LOCKD_LEASE_ID", requires = "token")]
    lease_id: Option<u64>,
    /// The lease's token (with --lease-id).
    #[arg(
        long,
        env = "LOCKD_TOKEN",
        hide_env_values = true,
        requires = "lease_id"
    )]
    token: Option<String>,
}

fn parse_attr(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum SemanticsArg {
    Fail,
    Wait,
}

#[derive(Clone, Copy, ValueEnum)]
enum OnLossArg {
    Terminate,
    Replace,
}

#[derive(clap::Args)]
struct ReserveArgs {
    /// The independent lockd instances (one resource each), comma-separated or repeated.
    #[arg(
        long,
        env = "LOCKD_ENDPOINTS",
        value_delimiter = ',',
        required_unless_present = "endpoints_file"
    )]
    endpoints: Vec<Endpoint>,
    /// A file listing more endpoints, one per line (blank lines and `#` comments ignored).
    #[arg(long, env = "LOCKD_ENDPOINTS_FILE")]
    endpoints_file: Option<PathBuf>,
    /// How many of them CMD needs.
    #[arg(long, env = "LOCKD_COUNT")]
    count: usize,
    /// fail: all now or nothing; wait: queue in the global endpoint order until --timeout.
    #[arg(long, env = "LOCKD_SEMANTICS", value_enum)]
    semantics: SemanticsArg,
    /// The resource name on each lockd.
    #[arg(long, env = "LOCKD_RESERVE_RESOURCE", default_value = "node")]
    resource: String,
    /// Holder name shown by each lockd.
    #[arg(long, env = "LOCKD_HOLDER", default_value = "reserve")]
    holder: String,
    /// Give up (exit 75) when not all are reserved within this time.
    #[arg(long, env = "LOCKD_RESERVE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Each lockd cancels a reservation not confirmed within this time (QURD's cancel of a
    /// reservation left `reserved`): a client that hangs never pins a resource.
    #[arg(long, env = "LOCKD_RESERVED_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    reserved_timeout: Duration,
    /// One connection attempt's limit.
    #[arg(long, env = "LOCKD_CONNECT_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// When a held resource is lost while CMD runs: SIGTERM to CMD, or reserve a
    /// replacement among the other endpoints and tell CMD with SIGUSR1.
    #[arg(long, env = "LOCKD_ON_LOSS", value_enum, default_value = "terminate")]
    on_loss: OnLossArg,
    /// Where CMD finds the current reservation (JSON); default a file in $TMPDIR.
    #[arg(long, env = "LOCKD_RESERVATION_FILE")]
    reservation_file: Option<PathBuf>,
    /// The command to run with all of them.
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

#[derive(clap::Args)]
struct HoldArgs {
    /// unix:PATH or tcp:HOST:PORT
    #[arg(long, env = "LOCKD_CONNECT")]
    connect: Endpoint,
    /// The lock to take.
    #[arg(long, env = "LOCKD_HOLD_RESOURCE")]
    resource: String,
    /// Holder name shown in status.
    #[arg(long, env = "LOCKD_HOLDER")]
    holder: String,
    /// Give up (exit 75) if not granted within this time.
    #[arg(long, env = "LOCKD_HOLD_TIMEOUT", value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// One connection attempt's limit.
    #[arg(long, env = "LOCKD_CONNECT_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// If lockd restarts, how long to try to reclaim the lease before terminating CMD.
    #[arg(long, env = "LOCKD_RECONNECT_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    reconnect_timeout: Duration,
    /// The command to run while holding the lock.
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

fn init_logs(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LOCKD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().flatten_event(true).init(),
        LogFormat::Text => b.init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockd: cannot start runtime: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    match cli.cmd {
        Cmd::Serve(a) => {
            init_logs(cli.log_format, "info");
            rt.block_on(serve(a))
        }
        Cmd::Status {
            connect,
            no_sessions,
        } => {
            init_logs(cli.log_format, "warn");
            report(status(&connect, no_sessions))
        }
        Cmd::Leases {
            connect,
            resource,
            holder,
        } => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::leases(&connect, resource, holder)))
        }
        Cmd::Lease { connect, id } => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::lease(&connect, id)))
        }
        Cmd::Offer(a) => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::offer(a)))
        }
        Cmd::Withdraw {
            connect,
            pool,
            name,
            admin_token,
        } => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::withdraw(&connect, &pool, &name, admin_token)))
        }
        Cmd::Acquire(a) => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::acquire(a)))
        }
        Cmd::Renew { lease, ttl } => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::renew(lease, ttl)))
        }
        Cmd::Release { lease } => {
            init_logs(cli.log_format, "warn");
            report(rt.block_on(kinds::release(lease)))
        }
        Cmd::Reserve(a) => {
            init_logs(cli.log_format, "error");
            reserve(a)
        }
        Cmd::Hold(a) => {
            // hold reports on stderr itself; library warnings would repeat it.
            init_logs(cli.log_format, "error");
            rt.block_on(hold(a))
        }
        Cmd::Revoke {
            connect,
            resource,
            reason,
            admin_token,
        } => {
            init_logs(cli.log_format, "warn");
            report(revoke(&connect, resource, reason, admin_token))
        }
        Cmd::Watch { connect } => {
            init_logs(cli.log_format, "warn");
            report(watch(&connect))
        }
    }
}

/// `lockd reserve`: all-or-nothing reservation across independent lockd instances.
fn reserve(a: ReserveArgs) -> ExitCode {
    use lockd::reserve::{ReserveError, ReserveOptions, Semantics};
    use lockd::reserve_cmd::{run, OnLoss, RunError};
    let file = a.reservation_file.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("lockd-reserve-{}.json", std::process::id()))
    });
    let mut endpoints = a.endpoints;
    if let Some(f) = &a.endpoints_file {
        match lockd::reserve::endpoints_file(f) {
            Ok(more) => endpoints.extend(more),
            Err(e) => {
                eprintln!("lockd reserve: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let o = ReserveOptions {
        endpoints,
        count: a.count,
        semantics: match a.semantics {
            SemanticsArg::Fail => Semantics::Fail,
            SemanticsArg::Wait => Semantics::Wait,
        },
        resource: a.resource,
        holder: a.holder,
        timeout: a.timeout,
        reserve_timeout: a.reserved_timeout,
        connect_timeout: a.connect_timeout,
    };
    let on_loss = match a.on_loss {
        OnLossArg::Terminate => OnLoss::Terminate,
        OnLossArg::Replace => OnLoss::Replace,
    };
    let r = run(o, on_loss, &a.cmd, &file);
    if a.reservation_file.is_none() {
        let _ = std::fs::remove_file(&file);
    }
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("lockd reserve: {e}");
            ExitCode::from(match e {
                RunError::Reserve(ReserveError::BadCount { .. }) => 2,
                RunError::Reserve(_) => EXIT_TIMEOUT,
                RunError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    127
                }
                RunError::Spawn { .. } => 126,
                RunError::Local(_) => EXIT_ERROR,
            })
        }
    }
}

/// A command-line failure: (exit code, reason printed on stderr).
struct Fail(u8, anyhow::Error);

fn report(r: std::result::Result<(), Fail>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(code, e)) => {
            eprintln!("lockd: {e:#}");
            ExitCode::from(code)
        }
    }
}

async fn serve(a: ServeArgs) -> ExitCode {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            eprintln!("lockd: cannot install signal handlers");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    if a.etcd.backend == BackendArg::Etcd {
        return serve_etcd(a, shutdown).await;
    }
    let Some(state) = a.state else {
        eprintln!("lockd: --state is required with --backend file");
        return ExitCode::from(2);
    };
    let cfg = ServeConfig {
        listen: a.listen,
        state,
        reconnect_window: a.reconnect_window,
        metrics: a.metrics,
        admin_token: a.admin_token,
        max_line: a.max_line,
        idle_timeout: a.idle_timeout,
        rate_limit: a.rate_limit,
        outbound_queue: a.outbound_queue,
        write_timeout: a.write_timeout,
        busy_poll: a.busy_poll,
        max_lease_time: a.max_lease_time,
        max_total_lease_time: a.max_total_lease_time,
        max_tombstones: a.max_tombstones,
        break_deadlocks: a.break_deadlocks,
        tombstone_max_age: a.tombstone_age,
        compact_after: a.compact_after,
        offers: match a.offers.as_deref().map(lockd::offers_file::load) {
            None => Vec::new(),
            Some(Ok(o)) => o,
            Some(Err(e)) => {
                eprintln!("lockd: {e}");
                return ExitCode::from(EXIT_ERROR);
            }
        },
    };
    let server = match Server::bind(cfg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockd: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    match server.run(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockd: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

async fn serve_etcd(a: ServeArgs, shutdown: impl std::future::Future<Output = ()>) -> ExitCode {
    use lockd::etcd::{server::EtcdServer, EtcdConfig, Margin};
    if a.offers.is_some() {
        eprintln!("lockd: warning: --offers is not served by --backend etcd; ignored");
    }
    let e = a.etcd;
    let read = |what: &str, p: &PathBuf| {
        std::fs::read(p).map_err(|err| format!("{what} {}: {err}", p.display()))
    };
    let tls: Result<Option<lockd::etcd::EtcdTls>, String> =
        match (&e.etcd_ca, &e.etcd_cert, &e.etcd_key) {
            (None, _, _) => Ok(None),
            (Some(ca), cert, key) => (|| {
                let ca_pem = read("--etcd-ca", ca)?;
                let identity = match (cert, key) {
                    (Some(c), Some(k)) => Some((read("--etcd-cert", c)?, read("--etcd-key", k)?)),
                    _ => None,
                };
                Ok(Some(lockd::etcd::EtcdTls { ca_pem, identity }))
            })(),
        };
    let tls = match tls {
        Ok(t) => t,
        Err(msg) => {
            eprintln!("lockd: {msg}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let auth = match (e.etcd_user, &e.etcd_password_file) {
        (Some(user), Some(p)) => match std::fs::read_to_string(p) {
            Ok(text) => {
                let password = text.lines().next().unwrap_or("").to_string();
                if password.is_empty() {
                    eprintln!("lockd: --etcd-password-file {}: empty", p.display());
                    return ExitCode::from(EXIT_ERROR);
                }
                Some(lockd::etcd::EtcdAuth { user, password })
            }
            Err(err) => {
                eprintln!("lockd: --etcd-password-file {}: {err}", p.display());
                return ExitCode::from(EXIT_ERROR);
            }
        },
        _ => None,
    };
    let node = e.etcd_node.unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "lockd".into())
    });
    let cfg = EtcdConfig {
        listen: a.listen,
        endpoints: e.etcd_endpoints,
        prefix: e.etcd_prefix.trim_end_matches('/').to_string(),
        ttl: e.etcd_ttl,
        margin: Margin {
            drift_ppm: e.etcd_drift_ppm,
            pause: e.etcd_pause,
            kill: e.etcd_kill_time,
        },
        planted_bug_no_margin: std::env::var("LOCKD_PLANTED_BUG_FENCE_NO_MARGIN")
            .is_ok_and(|v| v == "1"),
        admin_token: a.admin_token,
        max_line: a.max_line,
        idle_timeout: a.idle_timeout,
        op_timeout: e.etcd_op_timeout,
        node,
        leader_change: e.etcd_leader_change,
        tls,
        auth,
        enforce_expiry: e.etcd_enforce_expiry,
        metrics: a.metrics,
        planted_bug_expiry_early: std::env::var("LOCKD_PLANTED_BUG_EXPIRY_EARLY")
            .is_ok_and(|v| v == "1"),
        planted_bug_credit_unconfirmed: std::env::var("LOCKD_PLANTED_BUG_CREDIT_UNCONFIRMED")
            .is_ok_and(|v| v == "1"),
        planted_bug_stay_on_stalled_member: std::env::var(
            "LOCKD_PLANTED_BUG_STAY_ON_STALLED_MEMBER",
        )
        .is_ok_and(|v| v == "1"),
    };
    let server = match EtcdServer::bind(cfg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockd: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    match server.run(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockd: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Reader and writer halves of a blocking connection.
type SyncConn = (BufReader<Box<dyn Read>>, Box<dyn Write>);

/// A blocking connection for the one-shot commands.
fn connect_sync(ep: &Endpoint) -> std::result::Result<SyncConn, Fail> {
    let unavailable =
        |e: std::io::Error| Fail(EXIT_UNAVAILABLE, anyhow!("cannot connect to {ep}: {e}"));
    match ep {
        Endpoint::Unix(p) => {
            let s = std::os::unix::net::UnixStream::connect(p).map_err(unavailable)?;
            let w = s.try_clone().map_err(unavailable)?;
            Ok((BufReader::new(Box::new(s)), Box::new(w)))
        }
        Endpoint::Tcp(hp) => {
            let s = std::net::TcpStream::connect(hp.as_str()).map_err(unavailable)?;
            let _ = s.set_nodelay(true);
            let w = s.try_clone().map_err(unavailable)?;
            Ok((BufReader::new(Box::new(s)), Box::new(w)))
        }
    }
}

fn read_event(
    r: &mut BufReader<Box<dyn Read>>,
) -> std::result::Result<Option<serde_json::Value>, Fail> {
    let mut line = String::new();
    let n = r
        .read_line(&mut line)
        .map_err(|e| Fail(EXIT_ERROR, anyhow!("reading from lockd: {e}")))?;
    if n == 0 {
        return Ok(None);
    }
    serde_json::from_str(&line)
        .map(Some)
        .map_err(|e| Fail(EXIT_ERROR, anyhow!("bad line from lockd: {e}")))
}

fn err_of(v: &serde_json::Value) -> Option<Fail> {
    (v["event"] == "error").then(|| {
        Fail(
            EXIT_ERROR,
            anyhow!(
                "lockd refused: {} ({})",
                v["message"].as_str().unwrap_or(""),
                v["code"].as_str().unwrap_or("")
            ),
        )
    })
}

/// Send one request and return the first event that is not `hello`.
fn one_shot(ep: &Endpoint, req: &Request) -> std::result::Result<serde_json::Value, Fail> {
    let (mut r, mut w) = connect_sync(ep)?;
    w.write_all(proto::encode_request(req).as_bytes())
        .map_err(|e| Fail(EXIT_UNAVAILABLE, anyhow!("writing to lockd: {e}")))?;
    loop {
        match read_event(&mut r)? {
            None => return Err(Fail(EXIT_ERROR, anyhow!("lockd closed the connection"))),
            Some(v) if v["event"] == "hello" => continue,
            Some(v) => return Ok(v),
        }
    }
}

/// One line on stdout; a closed stdout (`| head`) is not an error of lockd's.
fn print_line(v: &impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}").and_then(|_| out.flush());
}

fn status(ep: &Endpoint, no_sessions: bool) -> std::result::Result<(), Fail> {
    let mut v = one_shot(
        ep,
        &Request::Status {
            sessions: no_sessions.then_some(false),
        },
    )?;
    if let Some(f) = err_of(&v) {
        return Err(f);
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("event");
    }
    print_line(&v);
    Ok(())
}

fn revoke(
    ep: &Endpoint,
    resource: String,
    reason: String,
    admin_token: Option<String>,
) -> std::result::Result<(), Fail> {
    let v = one_shot(ep, &Request::revoke(resource, Some(reason), admin_token))?;
    if let Some(f) = err_of(&v) {
        return Err(f);
    }
    print_line(&v);
    Ok(())
}

fn watch(ep: &Endpoint) -> std::result::Result<(), Fail> {
    let (mut r, mut w) = connect_sync(ep)?;
    w.write_all(proto::encode_request(&Request::Watch).as_bytes())
        .map_err(|e| Fail(EXIT_UNAVAILABLE, anyhow!("writing to lockd: {e}")))?;
    let stdout = std::io::stdout();
    loop {
        let Some(mut v) = read_event(&mut r)? else {
            return Err(Fail(EXIT_ERROR, anyhow!("lockd closed the connection")));
        };
        if let Some(f) = err_of(&v) {
            return Err(f);
        }
        if v["event"] != "notice" {
            continue;
        }
        if let Some(o) = v.as_object_mut() {
            if let Some(kind) = o.remove("kind") {
                o.insert("event".into(), kind);
            }
        }
        let mut out = stdout.lock();
        if writeln!(out, "{v}").and_then(|_| out.flush()).is_err() {
            return Ok(());
        }
    }
}

/// `name` if it contains a `/`, else the first executable `DIR/name` in `$PATH` (or `name`
/// unchanged when there is none: spawning it then fails with 127).
fn resolve_in_path(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    if name.contains('/') {
        return PathBuf::from(name);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let cand = dir.join(name);
        if let Ok(md) = std::fs::metadata(&cand) {
            if md.is_file() && md.permissions().mode() & 0o111 != 0 {
                return cand;
            }
        }
    }
    PathBuf::from(name)
}

/// CMD runs and `hold` only waits: drop the page mappings of the code it ran so far
/// (lockd::text_pages), so that if it is killed while holding, its connection closes (and the
/// next waiter is granted) without first unmapping ~1,100 pages of text. Not at once after
/// the spawn: on a hand-over that work would compete for the CPU with CMD's start; not while
/// queued: the pages of the grant's path would then be faulted back in on the hand-over.
const SLIM_AFTER: Duration = Duration::from_millis(3);

fn slim() {
    if let Err(e) = lockd::text_pages::unmap_own_text() {
        tracing::debug!(error = %e, "could not drop the text mappings");
    }
}

async fn hold(a: HoldArgs) -> ExitCode {
    match hold_inner(a).await {
        Ok(code) => ExitCode::from(code),
        Err(Fail(code, e)) => {
            eprintln!("lockd hold: {e:#}");
            ExitCode::from(code)
        }
    }
}

async fn hold_inner(a: HoldArgs) -> std::result::Result<u8, Fail> {
    // Over a Unix socket, CMD's processes also inherit an anchor: after a lockd restart the
    // reclaimed lease then stays held until CMD and everything it started are gone, even if
    // `lockd hold` itself is killed (the new connection is held by `hold` alone).
    let (anchor_keep, anchor_inherit) = match &a.connect {
        lockd::Endpoint::Unix(_) => {
            let (k, i) = lockd::client::anchor_pair()
                .map_err(|e| Fail(EXIT_ERROR, anyhow!("anchor socket pair: {e}")))?;
            // The inherited end must survive exec: a duplicate without FD_CLOEXEC.
            let raw = nix::fcntl::fcntl(i.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD(3))
                .map_err(|e| Fail(EXIT_ERROR, anyhow!("anchor dup: {e}")))?;
            // SAFETY: F_DUPFD just returned this descriptor; nobody else owns it.
            let inherit = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
            (Some(std::sync::Arc::new(k)), Some(inherit))
        }
        lockd::Endpoint::Tcp(_) => (None, None),
    };
    let opts = ClientOptions {
        connect_timeout: a.connect_timeout,
        reconnect_timeout: a.reconnect_timeout,
        label: Some(format!("hold:{}", a.holder)),
        anchor: anchor_keep,
        watchdog: None,
    };
    // Resolve CMD in PATH now, not on the handoff's critical path after the grant.
    let program = resolve_in_path(&a.cmd[0]);
    // Set up SIGCHLD handling now, not on the handoff's critical path at spawn time.
    let _sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child());
    let mut c = LockClient::connect(&a.connect, opts)
        .await
        .map_err(|e| Fail(EXIT_UNAVAILABLE, e.into()))?;
    c.acquire(&a.resource, &a.holder, true)
        .await
        .map_err(|e| Fail(EXIT_UNAVAILABLE, e.into()))?;
    let deadline = a.timeout.map(|t| tokio::time::Instant::now() + t);
    let epoch = loop {
        tokio::select! {
            ev = c.next_event() => match ev {
                Some(LockEvent::Granted { resource, epoch, .. }) if resource == a.resource => break epoch,
                Some(LockEvent::Error { code, message }) => {
                    return Err(Fail(EXIT_ERROR, anyhow!("lockd refused: {message} ({code})")));
                }
                Some(_) => {}
                None => return Err(Fail(EXIT_UNAVAILABLE, anyhow!("lock client closed"))),
            },
            _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                eprintln!("lockd hold: timed out after {} waiting for {}", humantime::format_duration(a.timeout.unwrap_or_default()), a.resource);
                return Ok(EXIT_TIMEOUT);
            }
        }
    };
    let fd = c
        .inheritable_fd()
        .map_err(|e| Fail(EXIT_ERROR, anyhow!("dup of the lock connection: {e}")))?;
    let mut cmd = tokio::process::Command::new(&program);
    cmd.arg0(&a.cmd[0])
        .args(&a.cmd[1..])
        .env("LOCKD_EPOCH", epoch.to_string())
        .env("LOCKD_RESOURCE", &a.resource)
        .env("LOCKD_FD", fd.as_raw_fd().to_string());
    if let Some(i) = &anchor_inherit {
        cmd.env("LOCKD_ANCHOR_FD", i.as_raw_fd().to_string());
    }
    let mut child = match cmd.spawn() {
        Ok(ch) => ch,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return Err(Fail(code, anyhow!("cannot run {}: {e}", a.cmd[0])));
        }
    };
    drop(fd);
    drop(anchor_inherit);
    let pid = child.id().map(|p| p as i32);
    let term_child = |why: &str| {
        eprintln!("lockd hold: {why}; sending SIGTERM to {}", a.cmd[0]);
        if let Some(p) = pid {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    };
    let mut events_open = true;
    // From here on `hold` only waits: see `slim`.
    let slim_timer = tokio::time::sleep(SLIM_AFTER);
    tokio::pin!(slim_timer);
    let mut slimmed = false;
    loop {
        tokio::select! {
            _ = &mut slim_timer, if !slimmed => {
                slimmed = true;
                slim();
            }
            st = child.wait() => {
                let st = st.map_err(|e| Fail(EXIT_ERROR, anyhow!("waiting for {}: {e}", a.cmd[0])))?;
                use std::os::unix::process::ExitStatusExt;
                let code = st.code().map(|c| c as u8).or_else(|| st.signal().map(|s| 128u8.wrapping_add(s as u8))).unwrap_or(1);
                return Ok(code);
            }
            ev = c.next_event(), if events_open => match ev {
                Some(LockEvent::Revoked { reason, .. }) => term_child(&format!("lease revoked ({reason})")),
                Some(LockEvent::Lost { cause, .. }) => term_child(&format!("lease lost ({cause})")),
                Some(LockEvent::Disconnected { cause }) => eprintln!("lockd hold: connection to lockd broke ({cause}); reclaiming"),
                Some(LockEvent::Granted { reclaimed: true, epoch, .. }) => eprintln!("lockd hold: lease reclaimed (epoch {epoch})"),
                Some(_) => {}
                None => events_open = false,
            },
        }
    }
}

/// The commands of the version-2 lease kinds, on [`lockd::lease_client`].
mod kinds {
    use std::io::Write;
    use std::path::Path;
    use std::time::Duration;

    use anyhow::anyhow;
    use lockd::lease_client::{
        Acquire, Acquired, Ended, LeaseClient, LeaseError, Offer, SavedLease,
    };
    use lockd::proto::{ErrorCode, Mode};
    use lockd::Endpoint;
    use serde_json::json;

    use super::{
        AcquireArgs, Fail, LeaseArgs, ModeArg, OfferArgs, EXIT_ERROR, EXIT_TIMEOUT,
        EXIT_UNAVAILABLE,
    };

    type Res = std::result::Result<(), Fail>;

    /// Exit code of a client error: 69 lockd unreachable, 75 busy/unavailable (try again
    /// later), 1 refused.
    fn fail(e: LeaseError) -> Fail {
        let code = match &e {
            LeaseError::Connect { .. } | LeaseError::Closed(_) => EXIT_UNAVAILABLE,
            e if e.is(ErrorCode::Unavailable) => EXIT_TIMEOUT,
            _ => EXIT_ERROR,
        };
        Fail(code, e.into())
    }

    fn print(v: &impl serde::Serialize) -> Res {
        let line = serde_json::to_string(v).map_err(|e| Fail(EXIT_ERROR, e.into()))?;
        let mut out = std::io::stdout().lock();
        // A closed stdout (`| head`) is not lockd's failure.
        let _ = writeln!(out, "{line}").and_then(|_| out.flush());
        Ok(())
    }

    async fn connect(ep: &Endpoint) -> Result<LeaseClient, Fail> {
        LeaseClient::connect(ep).await.map_err(fail)
    }

    pub async fn leases(ep: &Endpoint, resource: Option<String>, holder: Option<String>) -> Res {
        let c = connect(ep).await?;
        let ls = c
            .leases(resource.as_deref(), holder.as_deref())
            .await
            .map_err(fail)?;
        for l in &ls {
            print(l)?;
        }
        Ok(())
    }

    pub async fn lease(ep: &Endpoint, id: u64) -> Res {
        let c = connect(ep).await?;
        print(&c.lease(id).await.map_err(fail)?)
    }

    pub async fn offer(a: OfferArgs) -> Res {
        let c = connect(&a.connect).await?;
        let ch = c
            .offer(&Offer {
                pool: a.pool.clone(),
                name: a.name,
                quantity: a.quantity,
                attributes: a.attrs.into_iter().collect(),
                max_lease_time: a.max_lease_time,
                requirements: a.requirements,
                admin_token: a.admin_token,
            })
            .await
            .map_err(fail)?;
        print(&json!({"pool": a.pool, "offer": ch.offer, "renewal_refused": ch.renewal_refused}))
    }

    pub async fn withdraw(
        ep: &Endpoint,
        pool: &str,
        name: &str,
        admin_token: Option<String>,
    ) -> Res {
        let c = connect(ep).await?;
        let ch = c
            .withdraw(pool, name, admin_token.as_deref())
            .await
            .map_err(fail)?;
        print(&json!({"pool": pool, "name": name, "renewal_refused": ch.renewal_refused}))
    }

    /// Write the saved lease, readable by its owner only.
    fn save(path: &Path, s: &SavedLease) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let text = serde_json::to_string(s).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    }

    pub async fn acquire(a: AcquireArgs) -> Res {
        let req = match (a.quantity, a.mode, a.ttl) {
            (Some(q), _, ttl) => {
                let mut r = Acquire::quantity(&a.resource, &a.holder, q);
                if let Some(t) = ttl {
                    r = r.with_ttl(t);
                }
                if let Some(sel) = &a.requirements {
                    r = r.requirements(sel);
                }
                for (k, v) in &a.attrs {
                    r = r.attribute(k, v);
                }
                r
            }
            (None, Some(m), Some(t)) => {
                let mode = match m {
                    ModeArg::Shared => Mode::Shared,
                    ModeArg::Exclusive => Mode::Exclusive,
                };
                let mut r = Acquire::shared(&a.resource, &a.holder, mode).with_ttl(t);
                if let Some(v) = a.min_version {
                    r = r.min_version(v);
                }
                r
            }
            (None, None, Some(t)) => Acquire::ttl(&a.resource, &a.holder, t),
            // clap requires one of them, and --ttl with --mode.
            _ => {
                return Err(Fail(
                    2,
                    anyhow!("give --ttl, --mode with --ttl, or --quantity"),
                ))
            }
        };
        let req = if a.no_wait { req.no_wait() } else { req };
        let mut c = connect(&a.connect).await?;
        let deadline = a.timeout.map(|t| tokio::time::Instant::now() + t);
        let timed_out = || {
            Fail(
                EXIT_TIMEOUT,
                anyhow!(
                    "timed out after {} waiting for {}",
                    humantime::format_duration(a.timeout.unwrap_or_default()),
                    a.resource
                ),
            )
        };
        let within = |d: Option<tokio::time::Instant>| async move {
            match d {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let answer = tokio::select! {
            r = c.acquire(&req) => r.map_err(fail)?,
            _ = within(deadline) => return Err(timed_out()),
        };
        let lease = match answer {
            Acquired::Granted(l) => l,
            Acquired::Busy { holder } => {
                return Err(Fail(
                    EXIT_TIMEOUT,
                    anyhow!(
                        "{} is busy (held by {})",
                        a.resource,
                        holder.as_deref().unwrap_or("?")
                    ),
                ))
            }
            Acquired::Queued { lease_id, .. } => {
                // Leaving (timeout) closes the connection, which withdraws the request.
                tokio::select! {
                    r = c.wait_granted(lease_id) => r.map_err(fail)?,
                    _ = within(deadline) => return Err(timed_out()),
                }
            }
        };
        if let Some(path) = &a.save {
            if let Err(e) = save(path, &lease.saved()) {
                // Nobody could renew or release it: give it back rather than leave it.
                let _ = tokio::time::timeout(Duration::from_secs(5), c.release(&lease)).await;
                return Err(Fail(
                    EXIT_ERROR,
                    anyhow!(
                        "cannot save the lease to {}: {e} (released it)",
                        path.display()
                    ),
                ));
            }
        }
        print(&lease)
    }

    fn saved_of(a: &LeaseArgs) -> Result<SavedLease, Fail> {
        match (&a.saved, a.lease_id, &a.token) {
            (Some(p), _, _) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| Fail(EXIT_ERROR, anyhow!("reading {}: {e}", p.display())))?;
                serde_json::from_str(&text).map_err(|e| {
                    Fail(
                        EXIT_ERROR,
                        anyhow!("{} is not a saved lease: {e}", p.display()),
                    )
                })
            }
            (None, Some(lease_id), Some(token)) => Ok(SavedLease {
                lease_id,
                token: token.clone(),
            }),
            _ => Err(Fail(
                2,
                anyhow!("give --saved FILE or --lease-id N --token T"),
            )),
        }
    }

    pub async fn renew(a: LeaseArgs, ttl: Option<Duration>) -> Res {
        let s = saved_of(&a)?;
        let c = connect(&a.connect).await?;
        let at = c.renew(&s, ttl).await.map_err(fail)?;
        print(&json!({"lease_id": s.lease_id, "expires_at_unix_ms": at}))
    }

    pub async fn release(a: LeaseArgs) -> Res {
        let s = saved_of(&a)?;
        let c = connect(&a.connect).await?;
        match c.release(&s).await.map_err(fail)? {
            Ended::Released { epoch } => {
                print(&json!({"lease_id": s.lease_id, "state": "released", "epoch": epoch}))
            }
            Ended::Cancelled => print(&json!({"lease_id": s.lease_id, "state": "cancelled"})),
        }
    }
}
