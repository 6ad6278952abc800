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
  1    error: lockd refused the request, or serve could not start / had to stop (reason on stderr)
  2    bad command line
  69   could not connect to lockd
  75   hold: --timeout passed before the lock was granted
  126  hold: CMD could not be executed
  127  hold: CMD not found
  N    hold: CMD's own exit status (128+SIG when CMD was killed by signal SIG)";

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

#[derive(Subcommand)]
enum Cmd {
    /// Serve until SIGTERM/SIGINT.
    #[command(after_help = EXIT_CODES)]
    Serve(ServeArgs),
    /// Print holders, epochs, states, waiters and counters as one JSON object.
    #[command(after_help = EXIT_CODES)]
    Status {
        /// unix:PATH or tcp:HOST:PORT
        #[arg(long, env = "LOCKD_CONNECT")]
        connect: Endpoint,
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
    /// Durable state file (a STATE.lock beside it keeps a second lockd away).
    #[arg(long, env = "LOCKD_STATE")]
    state: PathBuf,
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
    /// Offers of quantity pools to set at startup (JSON, see PROTOCOL.md "Offers file").
    #[arg(long, env = "LOCKD_OFFERS")]
    offers: Option<PathBuf>,
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
        Cmd::Status { connect } => {
            init_logs(cli.log_format, "warn");
            report(status(&connect))
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
    let cfg = ServeConfig {
        listen: a.listen,
        state: a.state,
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
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
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

fn status(ep: &Endpoint) -> std::result::Result<(), Fail> {
    let mut v = one_shot(ep, &Request::Status { sessions: None })?;
    if let Some(f) = err_of(&v) {
        return Err(f);
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("event");
    }
    println!("{v}");
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
    println!("{v}");
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
    loop {
        tokio::select! {
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
