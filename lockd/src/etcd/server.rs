//! The tokio driver of `lockd serve --backend etcd` (see the module docs of [`super`]).
//!
//! One task per local connection owns its session: the lines it reads, its etcd lease (granted
//! at its first `acquire`, kept alive and fenced by a keepalive task), its held locks and one
//! task per waiting acquire (etcd's mutex recipe, [`super::mutex`]). Those tasks report back
//! on the session's channel. When the connection closes (and its anchors, if any, have all
//! closed) the session's etcd lease is revoked at once: every lock key of the session goes
//! with it and the next waiter, on any lockd, is granted. A shared registry holds what
//! `status`, `revoke` and `watch` need across sessions.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions};
use serde::Deserialize;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use super::fence::{Fence, FenceInput, FenceOutput, LostCause};
use super::leader_change::stale_leader_revokes;
use super::mutex::{self, EtcdError, FencedPut, Standing};
use super::{EtcdConfig, EtcdServeError};
use crate::anchor::{self, MAX_PENDING_FDS};
use crate::line::LineBuf;
use crate::proto::{
    self, Counters, ErrorCode, Event, LeaseState, Notice, NoticeKind, PeerInfo, Request,
    ResourceReport, SessionReport, StatusReport,
};
use crate::Endpoint;

mod gang_ops;
mod ttl_ops;

/// The features `hello` announces on this backend: `put_fenced`, `ttl` (TTL leases, the only
/// version-2 kind served here: [`ttl_ops`]), `gang` (gangs of exclusive connection-bound
/// leases only: [`gang_ops`]; TTL, shared and reserved gangs are refused `unsupported`),
/// and `no_reclaim`: a lease never survives its connection's break (a new connection's
/// `reclaim` is refused), so a client whose connection broke knows at once that its leases
/// are lost and fences instead of waiting out a reconnect window (`lockd::client`).
pub const ETCD_FEATURES: &[&str] = &[
    "put_fenced",
    "delete_fenced",
    crate::client::FEATURE_NO_RECLAIM,
    "ttl",
    "gang",
];

/// The features announced to a new connection: [`ETCD_FEATURES`], without `no_reclaim` under
/// the PLANTED BUG switch `LOCKD_PLANTED_BUG_ANNOUNCE_RECLAIM=1` (tests only: clients then wait
/// out their reconnect window, and only their watchdog can fence in time).
fn hello_features() -> Vec<String> {
    static PLANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let planted = *PLANTED.get_or_init(|| {
        std::env::var("LOCKD_PLANTED_BUG_ANNOUNCE_RECLAIM").is_ok_and(|v| v == "1")
    });
    ETCD_FEATURES
        .iter()
        .filter(|f| !(planted && **f == crate::client::FEATURE_NO_RECLAIM))
        .map(|f| f.to_string())
        .collect()
}
/// Events waiting for a client that does not read before it is disconnected.
const OUTBOUND_QUEUE: usize = 1024;
/// Lock keys `status` reads at most.
const STATUS_MAX_KEYS: i64 = 10_000;

/// `put_fenced`: write `key = value` in etcd only while this connection owns `resource`;
/// `delete_fenced` (no `value`): delete `key` on the same condition.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PutFenced {
    /// The resource whose lock must still be ours.
    pub resource: String,
    /// The data key (written as `<prefix>.data/<key>`).
    pub key: String,
    /// The value (None: `delete_fenced`).
    #[serde(default)]
    pub value: Option<String>,
}

/// A `put_fenced` line, if this is one (the op is not part of the file backend's protocol).
fn decode_put_fenced(line: &[u8]) -> Option<Result<PutFenced, String>> {
    #[derive(Deserialize)]
    struct Op {
        op: String,
    }
    let op: Op = serde_json::from_slice(line).ok()?;
    if op.op != "put_fenced" && op.op != "delete_fenced" {
        return None;
    }
    let delete = op.op == "delete_fenced";
    Some(
        serde_json::from_slice::<PutFenced>(line)
            .map_err(|e| e.to_string())
            .and_then(|p| {
                if p.value.is_none() != delete {
                    return Err(if delete {
                        "delete_fenced takes no value".to_string()
                    } else {
                        "put_fenced needs a value".to_string()
                    });
                }
                for (what, s) in [("resource", &p.resource), ("key", &p.key)] {
                    if s.is_empty()
                        || s.len() > proto::MAX_NAME_LEN
                        || s.chars().any(|c| c.is_control())
                    {
                        return Err(format!(
                            "{what} must be 1..={} bytes without control characters",
                            proto::MAX_NAME_LEN
                        ));
                    }
                }
                Ok(p)
            }),
    )
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn error_line(code: &str, message: impl Into<String>, resource: Option<&str>) -> String {
    Event::Error {
        code: code.to_string(),
        message: message.into(),
        resource: resource.map(str::to_string),
    }
    .encode()
}

/// What the registry knows of one session.
struct SessionInfo {
    peer: PeerInfo,
    out: mpsc::Sender<String>,
    holds: Vec<String>,
    waits: Vec<String>,
    watching: bool,
    connected: bool,
    anchors: u32,
}

/// A lock held by a session of this lockd.
#[derive(Clone)]
struct LocalHold {
    session: u64,
    holder: String,
    epoch: u64,
    granted_at_unix_ms: u64,
    revoked: bool,
}

/// Shared across sessions: status, revoke, watch.
#[derive(Default)]
struct Registry {
    next_session: u64,
    sessions: BTreeMap<u64, SessionInfo>,
    holds: BTreeMap<String, LocalHold>,
    /// Local waiters per resource, in arrival order: (session, holder).
    waiters: BTreeMap<String, Vec<(u64, String)>>,
    counters: Counters,
}

impl Registry {
    fn notify(&self, n: Notice) {
        let line = Event::Notice(n).encode();
        for s in self.sessions.values().filter(|s| s.watching) {
            let _ = s.out.try_send(line.clone());
        }
    }
}

struct Ctx {
    cfg: EtcdConfig,
    /// `--metrics`.
    metrics: Arc<super::metrics::EtcdMetrics>,
    /// `--etcd-leader-change` resolved against etcd's version: a session's fence stops
    /// crediting renewals at a raft term change ([`Fence::freeze_on_term_change`]).
    freeze_on_term_change: bool,
    client: Client,
    /// One client per etcd endpoint, for the keepalive streams and the fence's reads.
    members: Arc<super::members::Members>,
    reg: Mutex<Registry>,
    /// etcd leases granted and not yet revoked (revoked at shutdown).
    live: Mutex<std::collections::BTreeSet<i64>>,
    /// TTL leases: this lockd's waiting requests, bound leases and tombstones.
    ttl: ttl_ops::TtlShared,
}

impl Ctx {
    fn live_leases(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<i64>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn reg(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A panic while holding the lock cannot leave it half-updated in a way that matters
        // more than stopping: keep serving with what is there.
        self.reg.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn notice(&self, kind: NoticeKind, resource: &str, holder: &str, epoch: u64, session: u64) {
        self.notice_with(kind, resource, holder, epoch, session, false, None);
    }
    #[allow(clippy::too_many_arguments)]
    fn notice_with(
        &self,
        kind: NoticeKind,
        resource: &str,
        holder: &str,
        epoch: u64,
        session: u64,
        after_revoke: bool,
        reason: Option<String>,
    ) {
        self.reg().notify(Notice {
            kind,
            resource: resource.to_string(),
            holder: Some(holder.to_string()),
            epoch,
            session: Some(session),
            reclaimed: false,
            after_revoke,
            reason,
            at_unix_ms: unix_ms(),
            lease_id: None,
            lease_kind: None,
            version: None,
        });
    }
}

/// The bound server.
pub struct EtcdServer {
    ctx: Arc<Ctx>,
    unix: Vec<(UnixListener, std::path::PathBuf)>,
    tcp: Vec<TcpListener>,
    metrics: Option<TcpListener>,
}

fn bind_unix(path: &std::path::Path) -> Result<UnixListener, EtcdServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let endpoint = format!("unix:{}", path.display());
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if !md.file_type().is_socket() {
            return Err(EtcdServeError::Bind {
                endpoint,
                source: std::io::Error::other("exists and is not a socket"),
            });
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(EtcdServeError::SocketInUse(endpoint)),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                info!(path = %path.display(), "removing stale socket");
                let _ = std::fs::remove_file(path);
            }
            Err(source) => return Err(EtcdServeError::Bind { endpoint, source }),
        }
    }
    let l = UnixListener::bind(path).map_err(|source| EtcdServeError::Bind {
        endpoint: endpoint.clone(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|source| EtcdServeError::Bind { endpoint, source })?;
    Ok(l)
}

impl EtcdServer {
    /// Check the settings, connect to etcd (bounded) and bind every listener.
    pub async fn bind(cfg: EtcdConfig) -> Result<EtcdServer, EtcdServeError> {
        if cfg.listen.is_empty() {
            return Err(EtcdServeError::NoListener);
        }
        if cfg.endpoints.is_empty() {
            return Err(EtcdServeError::NoEndpoints);
        }
        let margin = cfg.margin.of(cfg.ttl);
        if margin >= cfg.ttl {
            return Err(EtcdServeError::MarginTooLarge {
                margin,
                ttl: cfg.ttl,
            });
        }
        super::check_endpoints(&cfg.endpoints, cfg.tls.is_some())?;
        let tls_without_identity = cfg.tls.as_ref().is_some_and(|t| t.identity.is_none());
        let connect_error = |source: EtcdError| {
            let hint = super::connect_hint(
                &source.to_string(),
                tls_without_identity,
                cfg.auth.is_some(),
            );
            EtcdServeError::Connect {
                endpoints: cfg.endpoints.join(","),
                source,
                hint,
            }
        };
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(cfg.op_timeout)
            .with_keep_alive(Duration::from_secs(1), cfg.op_timeout)
            // A member cut off from its cluster answers nothing rather than stale data.
            .with_require_leader(true);
        if let Some(tls) = &cfg.tls {
            // etcd-client's TlsOptions is tonic's ClientTlsConfig (rustls): the server's
            // certificate must chain to this CA and name the endpoint's host (DNS or IP SAN).
            let mut t = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(&tls.ca_pem));
            if let Some((cert, key)) = &tls.identity {
                t = t.identity(etcd_client::Identity::from_pem(cert, key));
            }
            opts = opts.with_tls(t);
        }
        if let Some(a) = &cfg.auth {
            // etcd-client authenticates at connect; an expired simple token (etcd's
            // --auth-token-ttl of disuse) is renewed and the refused call retried.
            opts = opts
                .with_user(a.user.clone(), a.password.clone())
                .with_auto_token_refresh(true);
        }
        let members = Arc::new(super::members::Members::new(
            cfg.endpoints.clone(),
            opts.clone(),
            cfg.op_timeout,
            probe_key(&cfg.prefix),
        ));
        let mut client = mutex::bounded(
            cfg.op_timeout,
            Client::connect(cfg.endpoints.clone(), Some(opts)),
        )
        .await
        .map_err(connect_error)?;
        // One round trip, so that a wrong endpoint fails here and not at the first acquire.
        let status = mutex::bounded(cfg.op_timeout, client.status())
            .await
            .map_err(connect_error)?;
        // And one read under the prefix (linearizable, as the fence's confirming reads), so
        // that missing credentials or permissions fail here too (etcd's Status needs none).
        mutex::bounded(
            cfg.op_timeout,
            client.get(
                probe_key(&cfg.prefix),
                Some(etcd_client::GetOptions::new().with_count_only()),
            ),
        )
        .await
        .map_err(connect_error)?;
        let etcd_version = status.version().to_string();
        let mut unix = Vec::new();
        let mut tcp = Vec::new();
        for ep in &cfg.listen {
            match ep {
                Endpoint::Unix(p) => unix.push((bind_unix(p)?, p.clone())),
                Endpoint::Tcp(hp) => {
                    let l = TcpListener::bind(hp.as_str()).await.map_err(|source| {
                        EtcdServeError::Bind {
                            endpoint: ep.to_string(),
                            source,
                        }
                    })?;
                    tcp.push(l);
                }
            }
        }
        let metrics = match &cfg.metrics {
            None => None,
            Some(addr) => Some(TcpListener::bind(addr.as_str()).await.map_err(|source| {
                EtcdServeError::Bind {
                    endpoint: format!("--metrics {addr}"),
                    source,
                }
            })?),
        };
        let endpoints = cfg.endpoints.join(",");
        info!(endpoints = %endpoints, etcd_user = ?cfg.auth.as_ref().map(|a| a.user.as_str()), prefix = %cfg.prefix, ttl = ?cfg.ttl, margin = ?margin,
            metrics = ?cfg.metrics,
            enforce_expiry = cfg.enforce_expiry, tls = cfg.tls.is_some(), client_certificate = cfg.tls.as_ref().is_some_and(|t| t.identity.is_some()),
            planted_bug_no_margin = cfg.planted_bug_no_margin, "lockd serving with the etcd backend");
        if cfg.planted_bug_expiry_early {
            warn!("PLANTED BUG: a waiter revokes its predecessor's etcd lease at the first \"0 s left\", up to a second before it expires");
        }
        if cfg.planted_bug_no_margin {
            warn!("PLANTED BUG: the self-fence ignores its margin (holders are told only at the lease's expiry)");
        }
        if cfg.planted_bug_credit_unconfirmed {
            warn!("PLANTED BUG: at leader changes the self-fence credits keepalive answers of the old term without a confirming read");
        }
        if cfg.planted_bug_stay_on_stalled_member {
            warn!("PLANTED BUG: a keepalive stream stays on an etcd member that stopped answering");
        }
        let freeze = cfg.leader_change.fences(&etcd_version);
        match stale_leader_revokes(&etcd_version) {
            Some(true) if freeze => {
                warn!(etcd_version = %etcd_version, leader_change = cfg.leader_change.as_str(),
                "this etcd lets a stalled former leader revoke live leases when it resumes \
                 (etcd-io/etcd#15247, fixed in 3.4.31 and 3.5.13): every etcd leader change \
                 fences the holders at their old term's deadline (safe; a failover per leader \
                 change). Upgrade etcd to keep leases across leader changes (docs/ETCD.md)")
            }
            Some(true) => {
                warn!(etcd_version = %etcd_version, leader_change = cfg.leader_change.as_str(),
                "this etcd lets a stalled former leader revoke live leases when it resumes \
                 (etcd-io/etcd#15247, fixed in 3.4.31 and 3.5.13) and --etcd-leader-change trust \
                 keeps crediting renewals across leader changes: a lock can then go while its \
                 holder lives (docs/ETCD.md)")
            }
            Some(false) => {}
            None => warn!(etcd_version = %etcd_version, "cannot read etcd's version"),
        }
        info!(etcd_version = %etcd_version, leader_change = cfg.leader_change.as_str(),
            fence_on_leader_change = freeze, "etcd leader changes");
        if !hello_features()
            .iter()
            .any(|f| f == crate::client::FEATURE_NO_RECLAIM)
        {
            warn!("PLANTED BUG: hello does not announce no_reclaim (clients wait out their reconnect window)");
        }
        Ok(EtcdServer {
            ctx: Arc::new(Ctx {
                metrics: Arc::new(super::metrics::EtcdMetrics::new()),
                cfg,
                freeze_on_term_change: freeze,
                client,
                members,
                reg: Mutex::new(Registry::default()),
                live: Mutex::new(std::collections::BTreeSet::new()),
                ttl: ttl_ops::TtlShared::default(),
            }),
            unix,
            tcp,
            metrics,
        })
    }

    /// Serve until `shutdown` resolves; then every session's etcd lease is revoked.
    pub async fn run(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), EtcdServeError> {
        let Some(listener) = self.metrics.take() else {
            return self.run_inner(shutdown).await;
        };
        // The metrics server spawns its connections locally; it ends with the LocalSet.
        let local = tokio::task::LocalSet::new();
        let m = self.ctx.metrics.clone();
        local.spawn_local(crate::metrics::serve(
            listener,
            move || m.render(),
            crate::metrics::HttpLimits::default(),
            std::future::pending(),
        ));
        local.run_until(self.run_inner(shutdown)).await
    }

    async fn run_inner(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), EtcdServeError> {
        let mut tasks: Vec<JoinHandle<()>> = Vec::new();
        let mut conns: Vec<JoinHandle<()>> = Vec::new();
        let paths: Vec<std::path::PathBuf> = self.unix.iter().map(|(_, p)| p.clone()).collect();
        let (conn_tx, mut conn_rx) = mpsc::unbounded_channel::<JoinHandle<()>>();
        for (l, _) in self.unix {
            let ctx = self.ctx.clone();
            let ctx_tx = conn_tx.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    match l.accept().await {
                        Ok((s, _)) => {
                            let peer = unix_peer(&s);
                            let (r, w) = s.into_split();
                            let h = tokio::spawn(session(
                                ctx.clone(),
                                Reader::Unix(r),
                                Writer::Unix(w),
                                peer,
                            ));
                            let _ = ctx_tx.send(h);
                        }
                        Err(e) => {
                            error!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }));
        }
        for l in self.tcp {
            let ctx = self.ctx.clone();
            let ctx_tx = conn_tx.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    match l.accept().await {
                        Ok((s, addr)) => {
                            let _ = s.set_nodelay(true);
                            let peer = PeerInfo {
                                transport: "tcp".into(),
                                addr: Some(addr.to_string()),
                                ..PeerInfo::default()
                            };
                            let (r, w) = s.into_split();
                            let h = tokio::spawn(session(
                                ctx.clone(),
                                Reader::Tcp(r),
                                Writer::Tcp(w),
                                peer,
                            ));
                            let _ = ctx_tx.send(h);
                        }
                        Err(e) => {
                            error!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }));
        }
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(h) = conn_rx.recv() => {
                    conns.retain(|c| !c.is_finished());
                    conns.push(h);
                }
            }
        }
        // Holders first: each is told `revoked` (lost) and given the margin's pause + kill
        // time to fence and close (its session then revokes its own lease); only then is
        // every remaining lease revoked. Revoking at once would let another node grant while
        // a holder still runs.
        let grace = self.ctx.cfg.margin.pause + self.ctx.cfg.margin.kill;
        let told = {
            let reg = self.ctx.reg();
            let mut n = 0;
            for (r, h) in &reg.holds {
                if let Some(si) = reg.sessions.get(&h.session) {
                    let _ = si.out.try_send(
                        Event::Revoked {
                            resource: r.clone(),
                            epoch: h.epoch,
                            reason: "lost: lockd is stopping".into(),
                        }
                        .encode(),
                    );
                    n += 1;
                }
            }
            n
        };
        if told > 0 {
            info!(holders = told, grace = ?grace, "stopping: holders told to fence; waiting for them to close");
            let end = tokio::time::Instant::now() + grace;
            while tokio::time::Instant::now() < end && !self.ctx.reg().holds.is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        info!("stopping: revoking every session's etcd lease");
        for t in tasks {
            t.abort();
        }
        for c in &conns {
            c.abort();
        }
        // Sessions aborted mid-way: revoke what the registry does not know was revoked.
        let leases: Vec<i64> = std::mem::take(&mut *self.ctx.live_leases())
            .into_iter()
            .collect();
        let mut client = self.ctx.client.clone();
        for id in leases {
            if let Err(e) = mutex::bounded(self.ctx.cfg.op_timeout, client.lease_revoke(id)).await {
                warn!(lease = format_args!("{id:016x}"), error = %e, "cannot revoke at stop; it expires with its TTL");
            }
        }
        for p in paths {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }
}

fn unix_peer(s: &tokio::net::UnixStream) -> PeerInfo {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let mut p = PeerInfo {
        transport: "unix".into(),
        ..PeerInfo::default()
    };
    if let Ok(c) = getsockopt(s, PeerCredentials) {
        p.pid = Some(c.pid());
        p.uid = Some(c.uid());
        p.gid = Some(c.gid());
    }
    p
}

/// The read half of a connection.
enum Reader {
    Unix(tokio::net::unix::OwnedReadHalf),
    Tcp(tokio::net::tcp::OwnedReadHalf),
}

impl Reader {
    /// Read into `lb` (descriptors that come along into `fds`); 0 at end-of-file.
    async fn read(&mut self, lb: &mut LineBuf, fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
        loop {
            let r = match self {
                Reader::Tcp(r) => {
                    r.readable().await?;
                    lb.read_with(|room| r.try_read(room))
                }
                Reader::Unix(r) => {
                    r.readable().await?;
                    let s: &tokio::net::UnixStream = r.as_ref();
                    lb.read_with(|room| {
                        s.try_io(tokio::io::Interest::READABLE, || {
                            anchor::recv_with_fds(s.as_raw_fd(), room, fds)
                        })
                    })
                }
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }
}

/// The write half of a connection.
enum Writer {
    Unix(tokio::net::unix::OwnedWriteHalf),
    Tcp(tokio::net::tcp::OwnedWriteHalf),
}

impl Writer {
    async fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        match self {
            Writer::Unix(w) => w.write_all(b).await,
            Writer::Tcp(w) => w.write_all(b).await,
        }
    }
}

/// What a session's helper tasks tell it.
enum Msg {
    /// An acquire task: our key is the owner.
    Granted {
        resource: String,
        key: String,
        epoch: u64,
    },
    /// An acquire task: waiting behind `ahead` keys.
    Queued { resource: String, position: usize },
    /// An acquire task (wait=false): somebody else owns it (its key's value).
    Busy { resource: String, holder: String },
    /// The keepalive task: the lease must be treated as lost (holders told now).
    Lost { cause: String },
    /// The keepalive task: the fence of this etcd lease froze at an etcd leader change
    /// (`--etcd-leader-change fence`): it will be lost at its old term's deadline.
    Frozen { lease: i64 },
    /// An anchor closed.
    AnchorClosed { why: String },
    /// A gang's task ([`gang_ops`]).
    Gang(gang_ops::GangMsg),
}

/// The session's etcd lease.
struct SessionLease {
    id: i64,
    keeper: JoinHandle<()>,
    /// The fence's deadline as of its last renewal (set by the keepalive task).
    deadline: tokio::sync::watch::Receiver<Option<Instant>>,
}

struct Held {
    key: String,
    /// The etcd lease the key was put with (kept after a loss: a stale holder's fenced put is
    /// then refused by etcd itself).
    lease: i64,
    epoch: u64,
    holder: String,
    lost: bool,
}

struct Session {
    ctx: Arc<Ctx>,
    id: u64,
    out: mpsc::Sender<String>,
    tx: mpsc::UnboundedSender<Msg>,
    lease: Option<SessionLease>,
    held: BTreeMap<String, Held>,
    waiting: BTreeMap<String, (String, JoinHandle<()>)>,
    /// Background deletions of this session's lock keys (a release, a cancelled wait), by
    /// key: an acquire of the same key (keys are named after the session's lease) waits for
    /// them before it puts the key again, so that a late deletion can neither remove the new
    /// key nor leave the old one to be taken for it.
    deleting: BTreeMap<String, Vec<Deletion>>,
    anchors: u32,
    pending_fds: Vec<OwnedFd>,
    connected: bool,
    /// Set when the client cannot keep up: the connection is closed.
    slow: bool,
    /// Gangs, waiting or granted, by name ([`gang_ops`]).
    gangs: gang_ops::Gangs,
}

async fn session(ctx: Arc<Ctx>, mut reader: Reader, mut writer: Writer, peer: PeerInfo) {
    /// Counts the session in `lockd_etcd_sessions` for as long as it runs.
    struct Open(prometheus_client::metrics::gauge::Gauge);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    ctx.metrics.sessions.inc();
    let _open = Open(ctx.metrics.sessions.clone());
    let (out, mut out_rx) = mpsc::channel::<String>(OUTBOUND_QUEUE);
    let (tx, mut rx) = mpsc::unbounded_channel::<Msg>();
    let id = {
        let mut reg = ctx.reg();
        reg.next_session += 1;
        let id = reg.next_session;
        reg.sessions.insert(
            id,
            SessionInfo {
                peer: peer.clone(),
                out: out.clone(),
                holds: Vec::new(),
                waits: Vec::new(),
                watching: false,
                connected: true,
                anchors: 0,
            },
        );
        id
    };
    info!(session = id, transport = %peer.transport, pid = ?peer.pid, addr = ?peer.addr, "session opened");
    let writer_task = tokio::spawn(async move {
        while let Some(line) = out_rx.recv().await {
            if writer.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    let mut s = Session {
        ctx: ctx.clone(),
        id,
        out,
        tx,
        lease: None,
        held: BTreeMap::new(),
        waiting: BTreeMap::new(),
        deleting: BTreeMap::new(),
        anchors: 0,
        pending_fds: Vec::new(),
        connected: true,
        slow: false,
        gangs: gang_ops::Gangs::new(),
    };
    s.send(
        Event::Hello {
            server: "lockd".into(),
            version: proto::PROTOCOL_VERSION,
            session: id,
            features: hello_features(),
        }
        .encode(),
    );
    let mut lb = LineBuf::new(ctx.cfg.max_line);
    let idle = tokio::time::sleep(ctx.cfg.idle_timeout);
    tokio::pin!(idle);
    let mut any_request = false;
    let close_why: String = loop {
        if s.slow {
            break "slow consumer".into();
        }
        if !s.connected && s.anchors == 0 {
            break "connection and anchors closed".into();
        }
        tokio::select! {
            r = reader.read(&mut lb, &mut s.pending_fds), if s.connected => {
                match r {
                    Ok(0) => { s.disconnected("eof").await; continue; }
                    Err(e) => { s.disconnected(&format!("read failed: {e}")).await; continue; }
                    Ok(_) => {}
                }
                if s.pending_fds.len() > MAX_PENDING_FDS {
                    warn!(session = id, received = s.pending_fds.len(), "descriptors without anchor requests; dropping the excess");
                    s.pending_fds.truncate(MAX_PENDING_FDS);
                }
                let mut close = None;
                while let Some(item) = lb.next_line() {
                    match item {
                        Ok(line) => {
                            if line.iter().all(|b| b.is_ascii_whitespace()) {
                                continue;
                            }
                            any_request = true;
                            s.on_line(&line).await;
                        }
                        Err(e) => {
                            s.send(error_line(ErrorCode::LineTooLong.as_str(), e.to_string(), None));
                            close = Some("line too long");
                            break;
                        }
                    }
                }
                if let Some(why) = close {
                    s.disconnected(why).await;
                }
            }
            Some(m) = rx.recv() => s.on_msg(m).await,
            _ = &mut idle, if !any_request && s.connected => {
                s.send(error_line(ErrorCode::IdleTimeout.as_str(), "no request within the idle timeout", None));
                s.disconnected("idle timeout").await;
            }
        }
    };
    s.end(&close_why).await;
    drop(s);
    // The writer drains what is queued, then ends (every sender is gone).
    let _ = tokio::time::timeout(Duration::from_secs(1), writer_task).await;
}

impl Session {
    fn send(&mut self, line: String) {
        if !self.connected {
            return;
        }
        match self.out.try_send(line) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                warn!(
                    session = self.id,
                    "slow consumer: outbound queue full; closing"
                );
                self.slow = true;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => self.slow = true,
        }
    }

    fn op_timeout(&self) -> Duration {
        self.ctx.cfg.op_timeout
    }

    /// The connection closed (the session lives on while anchors are open).
    async fn disconnected(&mut self, why: &str) {
        if !self.connected {
            return;
        }
        self.connected = false;
        info!(
            session = self.id,
            why,
            anchors = self.anchors,
            held = self.held.len(),
            "connection closed"
        );
        if let Some(si) = self.ctx.reg().sessions.get_mut(&self.id) {
            si.connected = false;
        }
        // Queued acquires are withdrawn (nobody is left to be told of a grant).
        let waits: Vec<String> = self.waiting.keys().cloned().collect();
        for r in waits {
            self.cancel_wait(&r);
        }
        // TTL requests too; held TTL leases live on, unbound.
        self.ttl_session_gone();
    }

    /// The session ends: revoke its etcd lease at once (every key of the session goes).
    async fn end(&mut self, why: &str) {
        self.ttl_session_gone();
        let waits: Vec<String> = self.waiting.keys().cloned().collect();
        for r in waits {
            self.cancel_wait(&r);
        }
        if let Some(l) = self.lease.take() {
            l.keeper.abort();
            let t0 = Instant::now();
            let mut client = self.ctx.client.clone();
            let mut ok = false;
            for attempt in 0..3 {
                match mutex::bounded(self.op_timeout(), client.lease_revoke(l.id)).await {
                    Ok(_) => {
                        ok = true;
                        break;
                    }
                    Err(e) => {
                        warn!(session = self.id, lease = format_args!("{:016x}", l.id), attempt, error = %e, "cannot revoke the etcd lease");
                    }
                }
            }
            if ok {
                self.ctx.live_leases().remove(&l.id);
            }
            info!(
                session = self.id,
                lease = format_args!("{:016x}", l.id),
                revoked = ok,
                took_us = t0.elapsed().as_micros() as u64,
                "session's etcd lease revoked"
            );
        }
        let held = std::mem::take(&mut self.held);
        for (r, h) in held {
            self.forget_hold(&r, &h, "session ended");
        }
        self.ctx.reg().sessions.remove(&self.id);
        info!(session = self.id, why, "session closed");
    }

    fn forget_hold(&self, resource: &str, h: &Held, why: &str) {
        let after_revoke = {
            let mut reg = self.ctx.reg();
            // Only this session's entry: after a loss, another session of this lockd may
            // hold the resource already.
            let mine = reg
                .holds
                .get(resource)
                .is_some_and(|w| w.session == self.id);
            let was = if mine {
                reg.holds.remove(resource)
            } else {
                None
            };
            let after_revoke = was.as_ref().is_some_and(|w| w.revoked);
            if after_revoke {
                // Counted once, as a revocation.
            } else {
                reg.counters.releases += 1;
            }
            if let Some(si) = reg.sessions.get_mut(&self.id) {
                si.holds.retain(|x| x != resource);
            }
            after_revoke
        };
        info!(session = self.id, resource, epoch = h.epoch, holder = %h.holder, why, "lock released");
        self.ctx.notice_with(
            NoticeKind::Released,
            resource,
            &h.holder,
            h.epoch,
            self.id,
            after_revoke,
            None,
        );
    }

    fn cancel_wait(&mut self, resource: &str) {
        if self.gang_cancel_wait(resource) {
            return;
        }
        if let Some((_holder, task)) = self.waiting.remove(resource) {
            task.abort();
            if let Some(l) = &self.lease {
                // The key may have been put already: delete it (idempotent).
                let key = mutex::lock_key(&self.ctx.cfg.prefix, resource, l.id);
                self.delete_in_background(key);
            }
        }
        let mut reg = self.ctx.reg();
        if let Some(w) = reg.waiters.get_mut(resource) {
            w.retain(|(s, _)| *s != self.id);
            if w.is_empty() {
                reg.waiters.remove(resource);
            }
        }
        if let Some(si) = reg.sessions.get_mut(&self.id) {
            si.waits.retain(|x| x != resource);
        }
    }

    async fn on_line(&mut self, line: &[u8]) {
        let req = match proto::decode_request(line, self.ctx.cfg.max_line) {
            Ok(r) => r,
            Err(proto::DecodeError::UnknownOp(op))
                if op == "put_fenced" || op == "delete_fenced" =>
            {
                match decode_put_fenced(line) {
                    Some(Ok(p)) => return self.put_fenced(p).await,
                    Some(Err(e)) => {
                        return self.send(error_line(ErrorCode::BadRequest.as_str(), e, None))
                    }
                    None => {
                        return self.send(error_line(
                            ErrorCode::BadRequest.as_str(),
                            "malformed put_fenced",
                            None,
                        ))
                    }
                }
            }
            Err(e) => return self.send(error_line(e.code().as_str(), e.to_string(), None)),
        };
        match req {
            Request::Ping => {
                // What the fence vouches for: a holder's watchdog gives up no later than this
                // after the pong arrives (docs/ETCD.md, "The supervisor's watchdog").
                let valid_ms = self.lease.as_ref().and_then(|l| *l.deadline.borrow()).map(|d| {
                    u64::try_from(d.saturating_duration_since(Instant::now()).as_millis())
                        .unwrap_or(u64::MAX)
                });
                self.send(Event::Pong { valid_ms }.encode())
            }
            Request::Acquire {
                resource,
                holder,
                wait,
                ext,
            } => {
                if super::ttl::is_plain_ttl(&ext) {
                    let ttl_ms = ext.ttl_ms.unwrap_or(1);
                    return self.ttl_acquire(resource, holder, wait, ttl_ms).await;
                }
                if super::gang::is_exclusive_gang(&ext) {
                    let members = ext.gang.unwrap_or_default();
                    let timeout = ext.timeout_ms.map(Duration::from_millis);
                    return self
                        .gang_acquire(resource, holder, members, wait, timeout)
                        .await;
                }
                if ext != proto::AcquireExt::default() {
                    return self.send(unsupported(&refused_kind(&ext), Some(&resource)));
                }
                self.acquire(resource, holder, wait).await
            }
            Request::Release {
                resource: Some(resource),
                lease_id: None,
                token: None,
            } => {
                if self.gang_release(&resource) {
                    return;
                }
                if !self.held.contains_key(&resource)
                    && !self.waiting.contains_key(&resource)
                    && self.ttl_release_resource(&resource).await
                {
                    return;
                }
                self.release(&resource)
            }
            Request::Release {
                lease_id: Some(id),
                token: Some(token),
                ..
            } => self.ttl_release(id, &token).await,
            Request::Release { .. } => {
                self.send(unsupported("release by lease_id", None));
            }
            Request::Reclaim { resource, .. } => self.send(error_line(
                ErrorCode::ReclaimRefused.as_str(),
                "etcd backend: a lease is bound to its lockd session's etcd lease and cannot be reclaimed on a new connection",
                Some(&resource),
            )),
            Request::Revoke {
                resource: Some(resource),
                lease_id: None,
                reason,
                admin_token,
            } => self.revoke(&resource, reason, admin_token).await,
            Request::Revoke {
                lease_id: Some(id),
                reason,
                admin_token,
                ..
            } => self.ttl_revoke(id, reason, admin_token).await,
            Request::Revoke { .. } => self.send(unsupported("revoke by lease_id", None)),
            Request::Status { .. } => self.status().await,
            Request::Watch => {
                if let Some(si) = self.ctx.reg().sessions.get_mut(&self.id) {
                    si.watching = true;
                }
                self.send(Event::Watching {}.encode());
            }
            Request::Anchor => self.anchor(),
            Request::Renew {
                lease_id,
                token,
                ttl_ms,
            } => self.ttl_renew(lease_id, &token, ttl_ms).await,
            Request::Resume { lease_id, token } => self.ttl_resume(lease_id, &token).await,
            Request::Lease { lease_id } => self.ttl_lease(lease_id).await,
            Request::Leases { resource, holder } => self.ttl_leases(resource, holder).await,
            Request::Commit { .. }
            | Request::Start { .. }
            | Request::Offer { .. }
            | Request::Withdraw { .. } => self.send(unsupported(
                "the version-2 lease ops of the shared, quantity and reserve kinds (commit, start, offer, withdraw)",
                None,
            )),
        }
    }

    fn is_tcp(&self) -> bool {
        self.ctx
            .reg()
            .sessions
            .get(&self.id)
            .is_some_and(|s| s.peer.transport == "tcp")
    }

    fn anchor(&mut self) {
        let fd = if self.is_tcp() {
            Err("anchors need a unix socket, not tcp".to_string())
        } else if self.pending_fds.is_empty() {
            Err(
                "no file descriptor came with the anchor request (send it with SCM_RIGHTS)"
                    .to_string(),
            )
        } else {
            let fd = self.pending_fds.remove(0);
            anchor::check_anchor(&fd).map(|k| (k, fd))
        };
        match fd {
            Ok((kind, fd)) => {
                self.anchors += 1;
                if let Some(si) = self.ctx.reg().sessions.get_mut(&self.id) {
                    si.anchors = self.anchors;
                }
                info!(session = self.id, kind = ?kind, anchors = self.anchors, "anchor attached");
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let why = anchor::closed(kind, fd).await;
                    let _ = tx.send(Msg::AnchorClosed { why });
                });
                self.send(
                    Event::Anchored {
                        anchors: self.anchors,
                    }
                    .encode(),
                );
            }
            Err(why) => {
                warn!(session = self.id, error = %why, "anchor refused");
                self.send(error_line(ErrorCode::AnchorRefused.as_str(), why, None));
            }
        }
    }

    /// The session's etcd lease, granted (and its keepalive started) at first use.
    /// [`Self::ensure_lease`], or `unavailable` answered for `name` (None then).
    async fn lease_or_unavailable(&mut self, name: &str) -> Option<i64> {
        match self.ensure_lease().await {
            Ok(l) => Some(l),
            Err(e) => {
                warn!(session = self.id, name = %name, error = %e, "cannot get an etcd lease");
                self.send(error_line(
                    ErrorCode::Unavailable.as_str(),
                    format!("etcd backend: cannot get an etcd lease: {e}"),
                    Some(name),
                ));
                None
            }
        }
    }

    async fn ensure_lease(&mut self) -> Result<i64, EtcdError> {
        if let Some(l) = &self.lease {
            return Ok(l.id);
        }
        let ttl_secs = self.ctx.cfg.ttl.as_secs_f64().ceil().max(1.0) as i64;
        let mut client = self.ctx.client.clone();
        let sent_at = Instant::now();
        let g = mutex::bounded(self.op_timeout(), client.lease_grant(ttl_secs, None)).await?;
        let id = g.id();
        let grant_term = g.header().map(|h| h.raft_term()).unwrap_or(0);
        self.ctx.live_leases().insert(id);
        info!(
            session = self.id,
            lease = format_args!("{id:016x}"),
            ttl_secs = g.ttl(),
            "etcd lease granted"
        );
        let (deadline_tx, deadline) = tokio::sync::watch::channel(None);
        let keeper = tokio::spawn(keep_alive(
            self.ctx.clone(),
            self.id,
            id,
            sent_at,
            g.ttl(),
            grant_term,
            self.tx.clone(),
            deadline_tx,
        ));
        self.lease = Some(SessionLease {
            id,
            keeper,
            deadline,
        });
        Ok(id)
    }

    async fn acquire(&mut self, resource: String, holder: String, wait: bool) {
        if let Some(code) = self.gang_member_state(&resource) {
            return self.send(error_line(
                code.as_str(),
                "this connection's gang holds or waits for it",
                Some(&resource),
            ));
        }
        if self.held.contains_key(&resource) {
            return self.send(error_line(
                ErrorCode::AlreadyHeld.as_str(),
                "this connection holds it",
                Some(&resource),
            ));
        }
        if self.waiting.contains_key(&resource) {
            return self.send(error_line(
                ErrorCode::AlreadyQueued.as_str(),
                "this connection waits for it",
                Some(&resource),
            ));
        }
        let Some(lease) = self.lease_or_unavailable(&resource).await else {
            return;
        };
        let key = mutex::lock_key(&self.ctx.cfg.prefix, &resource, lease);
        let value = format!("{holder}@{}", self.ctx.cfg.node);
        // Clones: an acquire cancelled before they end leaves them for the next one.
        let deleting = self.deleting.get(&key).cloned().unwrap_or_default();
        let task = tokio::spawn(acquire_task(
            self.ctx.clone(),
            self.id,
            resource.clone(),
            key,
            value,
            lease,
            wait,
            deleting,
            self.tx.clone(),
        ));
        self.waiting
            .insert(resource.clone(), (holder.clone(), task));
        let mut reg = self.ctx.reg();
        reg.waiters
            .entry(resource.clone())
            .or_default()
            .push((self.id, holder));
        if let Some(si) = reg.sessions.get_mut(&self.id) {
            si.waits.push(resource);
        }
    }

    /// Delete one of this session's lock keys in the background, remembered in `deleting`.
    fn delete_in_background(&mut self, key: String) {
        let done = spawn_delete(self.ctx.clone(), key.clone());
        // Forget the deletions that succeeded (one that gave up stays: the key may be there).
        self.deleting.retain(|_, v| {
            v.retain(|d| *d.borrow() != Some(true));
            !v.is_empty()
        });
        self.deleting.entry(key).or_default().push(done);
    }

    fn release(&mut self, resource: &str) {
        if let Some(h) = self.held.remove(resource) {
            self.delete_in_background(h.key.clone());
            self.forget_hold(resource, &h, "released");
            self.send(
                Event::Released {
                    resource: resource.to_string(),
                    epoch: h.epoch,
                    lease_id: None,
                }
                .encode(),
            );
        } else if self.waiting.contains_key(resource) {
            self.cancel_wait(resource);
            self.send(
                Event::Cancelled {
                    resource: resource.to_string(),
                }
                .encode(),
            );
        } else {
            self.send(error_line(
                ErrorCode::NotHolder.as_str(),
                "this connection neither holds nor waits for it",
                Some(resource),
            ));
        }
    }

    async fn revoke(&mut self, resource: &str, reason: Option<String>, token: Option<String>) {
        if self.is_tcp()
            && (self.ctx.cfg.admin_token.is_none() || token != self.ctx.cfg.admin_token)
        {
            return self.send(error_line(
                ErrorCode::Unauthorized.as_str(),
                "revoke over TCP needs lockd's --admin-token",
                Some(resource),
            ));
        }
        let reason = reason.unwrap_or_else(|| "revoked by operator".into());
        let found = {
            let mut reg = self.ctx.reg();
            let hold = reg.holds.get_mut(resource).map(|h| {
                let first = !h.revoked;
                h.revoked = true;
                (h.clone(), first)
            });
            if let Some((h, first)) = &hold {
                if *first {
                    reg.counters.revocations += 1;
                }
                if let Some(si) = reg.sessions.get(&h.session) {
                    let _ = si.out.try_send(
                        Event::Revoked {
                            resource: resource.to_string(),
                            epoch: h.epoch,
                            reason: reason.clone(),
                        }
                        .encode(),
                    );
                }
            }
            hold
        };
        match found {
            Some((h, _)) => {
                info!(session = self.id, resource, epoch = h.epoch, holder = %h.holder, reason = %reason, "lock revoked");
                self.ctx.notice_with(
                    NoticeKind::Revoked,
                    resource,
                    &h.holder,
                    h.epoch,
                    h.session,
                    false,
                    Some(reason),
                );
                self.send(
                    Event::RevokeSent {
                        resource: resource.to_string(),
                        epoch: h.epoch,
                        holder: Some(h.holder),
                    }
                    .encode(),
                );
            }
            None => {
                let mut client = self.ctx.client.clone();
                let remote = mutex::owner(
                    &mut client,
                    self.op_timeout(),
                    &self.ctx.cfg.prefix,
                    resource,
                )
                .await;
                let msg = match remote {
                    Ok(Some(o)) => format!(
                        "held by {} through another lockd (epoch {}); the etcd backend revokes only holders connected to this lockd",
                        super::ttl::display_value(&o.value), o.create_revision
                    ),
                    Ok(None) => "nobody holds it".to_string(),
                    Err(e) => format!("no holder on this lockd (etcd not asked: {e})"),
                };
                self.send(error_line(ErrorCode::NotHeld.as_str(), msg, Some(resource)));
            }
        }
    }

    async fn status(&mut self) {
        let mut client = self.ctx.client.clone();
        let etcd = mutex::all_locks(
            &mut client,
            self.op_timeout(),
            &self.ctx.cfg.prefix,
            STATUS_MAX_KEYS,
        )
        .await;
        let report = {
            let reg = self.ctx.reg();
            let mut res: BTreeMap<String, ResourceReport> = BTreeMap::new();
            let blank = |name: &str| ResourceReport {
                name: name.to_string(),
                holder: None,
                epoch: 0,
                state: LeaseState::Free,
                waiters: Vec::new(),
                holder_session: None,
                holder_peer: None,
                revoked: false,
                granted_at_unix_ms: None,
                reclaim_remaining_ms: None,
                kind: None,
                holders: Vec::new(),
                waiter_count: None,
                holder_count: None,
            };
            match &etcd {
                Ok(entries) => {
                    for e in entries {
                        let r = res
                            .entry(e.resource.clone())
                            .or_insert_with(|| blank(&e.resource));
                        if r.holder.is_none() {
                            r.holder = Some(super::ttl::display_value(&e.value).to_string());
                            r.epoch = e.create_revision as u64;
                            r.state = LeaseState::Held;
                        } else {
                            r.waiters
                                .push(super::ttl::display_value(&e.value).to_string());
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "status: cannot read the locks from etcd; local view only")
                }
            }
            for (name, h) in &reg.holds {
                let r = res.entry(name.clone()).or_insert_with(|| blank(name));
                r.holder = Some(h.holder.clone());
                r.epoch = h.epoch;
                r.state = LeaseState::Held;
                r.holder_session = Some(h.session);
                r.holder_peer = reg.sessions.get(&h.session).map(|s| s.peer.clone());
                r.revoked = h.revoked;
                r.granted_at_unix_ms = Some(h.granted_at_unix_ms);
            }
            if etcd.is_err() {
                for (name, w) in &reg.waiters {
                    let r = res.entry(name.clone()).or_insert_with(|| blank(name));
                    r.waiters = w.iter().map(|(_, h)| h.clone()).collect();
                }
            }
            let sessions = reg
                .sessions
                .iter()
                .map(|(id, s)| SessionReport {
                    id: *id,
                    peer: s.peer.clone(),
                    holds: s.holds.clone(),
                    waits: s.waits.clone(),
                    watching: s.watching,
                    connected: s.connected,
                    anchors: s.anchors,
                })
                .collect();
            StatusReport {
                resources: res.into_values().collect(),
                counters: reg.counters,
                sessions,
                session_count: None,
                leases: Vec::new(),
                lease_count: None,
                pools: Vec::new(),
                deadlocks: Vec::new(),
                counters_by_kind: BTreeMap::new(),
            }
        };
        self.send(Event::Status(Box::new(report)).encode());
    }

    async fn put_fenced(&mut self, p: PutFenced) {
        let Some(h) = self.held.get(&p.resource) else {
            return self.send(error_line(
                ErrorCode::NotHolder.as_str(),
                "put_fenced/delete_fenced needs the lock on the resource, held by this connection",
                Some(&p.resource),
            ));
        };
        let (key, epoch, lease) = (h.key.clone(), h.epoch, h.lease);
        let data_key = mutex::data_key(&self.ctx.cfg.prefix, &p.key);
        let mut client = self.ctx.client.clone();
        let r = match &p.value {
            Some(v) => {
                mutex::put_fenced(
                    &mut client,
                    self.op_timeout(),
                    &key,
                    epoch as i64,
                    &data_key,
                    v,
                    lease,
                )
                .await
            }
            None => {
                mutex::delete_fenced(
                    &mut client,
                    self.op_timeout(),
                    &key,
                    epoch as i64,
                    &data_key,
                )
                .await
            }
        };
        let (what, done) = match p.value {
            Some(_) => ("put", "put_done"),
            None => ("delete", "delete_done"),
        };
        match r {
            Ok(FencedPut::Written { revision }) => {
                info!(session = self.id, resource = %p.resource, epoch, key = %data_key, revision, what, "fenced {what} applied");
                self.send(
                    serde_json::json!({
                        "event": done, "resource": p.resource, "key": p.key,
                        "epoch": epoch, "revision": revision,
                    })
                    .to_string()
                        + "\n",
                );
            }
            Ok(FencedPut::Stale { current }) => {
                warn!(session = self.id, resource = %p.resource, epoch, current, "fenced put refused: stale epoch");
                self.send(error_line(
                    "fenced",
                    format!(
                        "etcd refused the write: the lock key's create revision is {current}, not this lease's epoch {epoch} (0: the key is gone)"
                    ),
                    Some(&p.resource),
                ));
            }
            Err(e) => self.send(error_line(
                ErrorCode::Unavailable.as_str(),
                format!("etcd backend: {e}"),
                Some(&p.resource),
            )),
        }
    }

    async fn on_msg(&mut self, m: Msg) {
        match m {
            Msg::Granted {
                resource,
                key,
                epoch,
            } => {
                let Some((holder, _task)) = self.waiting.remove(&resource) else {
                    // Cancelled while the grant was in flight.
                    self.delete_in_background(key);
                    return;
                };
                let now_ms = unix_ms();
                {
                    let mut reg = self.ctx.reg();
                    if let Some(w) = reg.waiters.get_mut(&resource) {
                        w.retain(|(s, _)| *s != self.id);
                        if w.is_empty() {
                            reg.waiters.remove(&resource);
                        }
                    }
                    reg.holds.insert(
                        resource.clone(),
                        LocalHold {
                            session: self.id,
                            holder: holder.clone(),
                            epoch,
                            granted_at_unix_ms: now_ms,
                            revoked: false,
                        },
                    );
                    reg.counters.grants += 1;
                    self.ctx.metrics.grants.inc();
                    if let Some(si) = reg.sessions.get_mut(&self.id) {
                        si.waits.retain(|x| *x != resource);
                        si.holds.push(resource.clone());
                    }
                }
                info!(session = self.id, resource = %resource, holder = %holder, epoch, key = %key, "lock granted");
                let lease = self.lease.as_ref().map(|l| l.id).unwrap_or(0);
                self.held.insert(
                    resource.clone(),
                    Held {
                        key,
                        lease,
                        epoch,
                        holder: holder.clone(),
                        lost: false,
                    },
                );
                self.ctx
                    .notice(NoticeKind::Granted, &resource, &holder, epoch, self.id);
                self.send(
                    Event::Granted {
                        resource,
                        holder,
                        epoch,
                        token: token(),
                        reclaimed: false,
                        lease: proto::LeaseFields::default(),
                    }
                    .encode(),
                );
            }
            Msg::Queued { resource, position } => {
                if self.waiting.contains_key(&resource) {
                    self.send(
                        Event::Queued {
                            resource,
                            position,
                            lease_id: None,
                        }
                        .encode(),
                    );
                }
            }
            Msg::Busy { resource, holder } => {
                if self.waiting.contains_key(&resource) {
                    self.cancel_wait(&resource);
                    self.send(
                        Event::Busy {
                            resource,
                            holder: Some(holder),
                        }
                        .encode(),
                    );
                }
            }
            Msg::Lost { cause } => self.lost(&cause),
            Msg::Frozen { lease } => self.frozen(lease),
            Msg::Gang(m) => self.on_gang_msg(m),
            Msg::AnchorClosed { why } => {
                self.anchors = self.anchors.saturating_sub(1);
                if let Some(si) = self.ctx.reg().sessions.get_mut(&self.id) {
                    si.anchors = self.anchors;
                }
                info!(session = self.id, why = %why, anchors = self.anchors, "anchor closed");
            }
        }
    }

    /// The lease's fence froze at an etcd leader change. A session that holds something
    /// keeps it until the old term's deadline (its holders are then told, as by any fence).
    /// One that holds nothing drops the lease now, revoked at once (nobody to kill), and its
    /// waiters are told `unavailable` to acquire again on a new lease of the new term:
    /// otherwise a waiter granted on the frozen lease would be fenced right after, a second
    /// failover for one leader change (seen in the drill across nodes under CPU load).
    fn frozen(&mut self, lease: i64) {
        if self.lease.as_ref().map(|l| l.id) != Some(lease)
            || !self.held.is_empty()
            || !self.gangs.is_empty()
        {
            return;
        }
        let Some(l) = self.lease.take() else { return };
        l.keeper.abort();
        info!(session = self.id, lease = %format!("{lease:016x}"), waiting = self.waiting.len(),
            "etcd's leader changed and this session holds nothing: its etcd lease is dropped now; its waiters acquire again on a new one");
        // Nobody holds anything to kill: at once. The waiting keys go with it.
        revoke_after(self.ctx.clone(), l.id, Duration::ZERO);
        let waits: Vec<String> = self.waiting.keys().cloned().collect();
        for r in waits {
            self.cancel_wait(&r);
            self.send(error_line(
                ErrorCode::Unavailable.as_str(),
                "etcd backend: etcd's leader changed while waiting (lockd fences at leader changes on this etcd, docs/ETCD.md); acquire again".to_string(),
                Some(&r),
            ));
        }
    }

    /// The fence fired: tell every holder `revoked` (reason `lost:…`) and drop the lease (a
    /// later acquire gets a new one). Waiters are told `unavailable`: their keys went with
    /// the lease.
    fn lost(&mut self, cause: &str) {
        self.ctx.metrics.self_fences.inc();
        let reason = format!("lost: {cause}");
        error!(session = self.id, held = self.held.len(), waiting = self.waiting.len(), reason = %reason,
            connected = self.connected, "etcd lease not renewed in time: telling the holders to fence");
        if let Some(l) = self.lease.take() {
            l.keeper.abort();
            // Best effort: it may be gone already; if etcd is back, it ends — but not before
            // the holders told now can be dead (pause + kill, as at shutdown): revoking at once
            // would let another node be granted while they may still run.
            let wait = self.ctx.cfg.margin.pause + self.ctx.cfg.margin.kill;
            revoke_after(self.ctx.clone(), l.id, wait);
        }
        let mut lines = Vec::new();
        for (r, h) in self.held.iter_mut() {
            if h.lost {
                continue;
            }
            h.lost = true;
            lines.push(
                Event::Revoked {
                    resource: r.clone(),
                    epoch: h.epoch,
                    reason: reason.clone(),
                }
                .encode(),
            );
            let mut reg = self.ctx.reg();
            if let Some(lh) = reg.holds.get_mut(r).filter(|lh| lh.session == self.id) {
                if !lh.revoked {
                    lh.revoked = true;
                    reg.counters.revocations += 1;
                }
            }
        }
        for l in lines {
            self.send(l);
        }
        let waits: Vec<String> = self.waiting.keys().cloned().collect();
        for r in waits {
            self.cancel_wait(&r);
            self.send(error_line(
                ErrorCode::Unavailable.as_str(),
                format!("etcd backend: the session's etcd lease was lost while waiting ({cause}); acquire again"),
                Some(&r),
            ));
        }
    }
}

/// What an acquire with version-2 fields asks for, as the refusal names it.
fn refused_kind(ext: &proto::AcquireExt) -> String {
    let kind = ext.kind().as_str();
    let shape = if ext.gang.is_some() && ext.reserve_ms.is_some() {
        format!("a reserved (reserve_ms) gang of {kind} leases")
    } else if ext.gang.is_some() {
        format!("a gang of {kind} leases")
    } else if ext.reserve_ms.is_some() {
        format!("a reserved {kind} lease")
    } else if ext.ttl_ms.is_some() && ext.quantity.is_none() && ext.mode.is_none() {
        "a TTL (ttl_ms) lease".to_string()
    } else {
        format!("a {kind} lease")
    };
    format!("acquire of {shape} (lease kind {kind:?})")
}

fn unsupported(what: &str, resource: Option<&str>) -> String {
    error_line(
        "unsupported",
        format!("{what}: not served by the etcd backend (lockd serve --backend etcd serves connection-bound exclusive leases only; see docs/ETCD.md)"),
        resource,
    )
}

fn token() -> String {
    use rand::Rng;
    let v: u128 = rand::thread_rng().gen();
    format!("{v:032x}")
}

/// A background deletion's outcome: `None` while it runs, then whether the key is known
/// deleted.
type Deletion = tokio::sync::watch::Receiver<Option<bool>>;

/// Delete a key in the background, retrying while etcd is unreachable (bounded: the key goes
/// with its lease anyway).
fn spawn_delete(ctx: Arc<Ctx>, key: String) -> Deletion {
    let (done_tx, done) = tokio::sync::watch::channel(None);
    tokio::spawn(async move {
        let mut client = ctx.client.clone();
        let mut deleted = false;
        for attempt in 0..10u32 {
            match mutex::delete(&mut client, ctx.cfg.op_timeout, &key).await {
                Ok(()) => {
                    deleted = true;
                    break;
                }
                Err(e) => {
                    warn!(key = %key, attempt, error = %e, "cannot delete the lock key; retrying");
                    tokio::time::sleep(Duration::from_millis(100 << attempt.min(4))).await;
                }
            }
        }
        done_tx.send_replace(Some(deleted));
    });
    done
}

/// Waits for the predecessor's key to be deleted ([`mutex::wait_deleted`]) while, with
/// `--etcd-enforce-expiry`, revoking its etcd lease once that has provably expired on etcd's
/// leader ([`super::expiry`]): the deletion then follows at once, not at etcd's next 500 ms
/// expiry check.
async fn wait_predecessor(
    ctx: &Arc<Ctx>,
    client: &mut Client,
    predecessor: &str,
    predecessor_rev: i64,
) -> Result<bool, EtcdError> {
    let limit = ctx.cfg.op_timeout;
    let lease = mutex::parse_lock_key(&ctx.cfg.prefix, predecessor).map(|(_, l)| l);
    let Some(lease) = lease.filter(|_| ctx.cfg.enforce_expiry) else {
        return mutex::wait_deleted(client, limit, predecessor, predecessor_rev).await;
    };
    let cfg = super::expiry::EnforceCfg {
        limit,
        fine: Duration::from_millis(50),
        slack: Duration::from_millis(20),
        planted_early: ctx.cfg.planted_bug_expiry_early,
    };
    let enforce = super::expiry::enforce(
        ctx.client.clone(),
        cfg,
        lease,
        predecessor.to_string(),
        ctx.metrics.expiry_revokes.clone(),
    );
    tokio::pin!(enforce);
    let wait = mutex::wait_deleted(client, limit, predecessor, predecessor_rev);
    tokio::pin!(wait);
    let mut enforcing = true;
    loop {
        tokio::select! {
            r = &mut wait => return r,
            () = &mut enforce, if enforcing => enforcing = false,
        }
    }
}

/// etcd's mutex recipe for one acquire; never gives up on etcd errors (the session cancels
/// it, or its fence fires), reports the outcome on `tx`. `deleting`: the session's background
/// deletions of this same key (an earlier hold or wait on the resource), awaited first: a
/// deletion landing after the put would remove the new key (the holder would hold nothing),
/// and the old key, still there, must not be taken for this acquire's (its create revision is
/// the old epoch, and it is about to go). If one of them gave up, the key is deleted here.
#[allow(clippy::too_many_arguments)]
async fn acquire_task(
    ctx: Arc<Ctx>,
    session: u64,
    resource: String,
    key: String,
    value: String,
    lease: i64,
    wait: bool,
    deleting: Vec<Deletion>,
    tx: mpsc::UnboundedSender<Msg>,
) {
    let limit = ctx.cfg.op_timeout;
    let prefix = ctx.cfg.prefix.clone();
    let mut client = ctx.client.clone();
    let mut backoff = Duration::from_millis(20);
    let mut my_rev = None;
    let mut queued = false;
    let mut stale_key = false;
    for mut d in deleting {
        // Err: the deletion task is gone without an outcome.
        let deleted = d.wait_for(Option::is_some).await.map(|v| *v == Some(true));
        if !matches!(deleted, Ok(true)) {
            stale_key = true;
        }
    }
    loop {
        let step: Result<Option<Msg>, EtcdError> = async {
            let rev = match my_rev {
                Some(r) => r,
                None => {
                    if stale_key {
                        mutex::delete(&mut client, limit, &key).await?;
                        stale_key = false;
                    }
                    let r = mutex::enqueue(&mut client, limit, &key, &value, lease).await?;
                    my_rev = Some(r);
                    r
                }
            };
            match mutex::standing(&mut client, limit, &prefix, &resource, rev).await? {
                Standing::Owner => Ok(Some(Msg::Granted {
                    resource: resource.clone(),
                    key: key.clone(),
                    epoch: rev as u64,
                })),
                Standing::Behind {
                    ahead,
                    predecessor,
                    predecessor_rev,
                    owner_value,
                } => {
                    if !wait {
                        mutex::delete(&mut client, limit, &key).await?;
                        return Ok(Some(Msg::Busy {
                            resource: resource.clone(),
                            holder: super::ttl::display_value(&owner_value).to_string(),
                        }));
                    }
                    if !queued {
                        queued = true;
                        let _ = tx.send(Msg::Queued {
                            resource: resource.clone(),
                            position: usize::try_from(ahead).unwrap_or(usize::MAX),
                        });
                    }
                    debug!(session, resource = %resource, predecessor = %predecessor, "waiting for the predecessor's deletion");
                    if wait_predecessor(&ctx, &mut client, &predecessor, predecessor_rev).await? {
                        Ok(None)
                    } else {
                        // The watch ended without the deletion: look again, after a pause.
                        Err(EtcdError::Unexpected(format!(
                            "the watch on {predecessor} ended"
                        )))
                    }
                }
            }
        }
        .await;
        match step {
            Ok(Some(m)) => {
                let _ = tx.send(m);
                return;
            }
            Ok(None) => backoff = Duration::from_millis(20),
            Err(e) => {
                ctx.metrics.etcd_errors.inc();
                warn!(session, resource = %resource, error = %e, "acquire: etcd error; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Tell the session, once, that its lease's fence froze ([`Msg::Frozen`]).
fn tell_frozen(fence: &Fence, told: &mut bool, tx: &mpsc::UnboundedSender<Msg>, lease: i64) {
    if fence.frozen() && !*told {
        *told = true;
        let _ = tx.send(Msg::Frozen { lease });
    }
}

/// Revoke a session's etcd lease `wait` from now, in the background (best effort: it may be
/// gone already); forgotten from the live set once etcd confirms.
fn revoke_after(ctx: Arc<Ctx>, lease: i64, wait: Duration) {
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        let mut c = ctx.client.clone();
        if mutex::bounded(ctx.cfg.op_timeout, c.lease_revoke(lease))
            .await
            .is_ok()
        {
            ctx.live_leases().remove(&lease);
        }
    });
}

/// A linearizable read in flight for [`FenceInput::Confirmed`]: (`acks_before`, the raft
/// term in its header, None if it failed).
type ConfirmRead = std::pin::Pin<Box<dyn std::future::Future<Output = (u64, Option<u64>)> + Send>>;

/// The key lockd reads (never writes) to confirm a raft term and, at start, its credentials:
/// under the prefix, so that the role that lets lockd lock lets it read this too.
fn probe_key(prefix: &str) -> String {
    format!("{prefix}.term-probe")
}

/// Issue the read that confirms the keepalive answers held before `acks_before`
/// ([`Fence::freeze_on_term_change`]): a linearizable (etcd-client's default, not
/// `with_serializable`) count-only get of one key. etcd serves it only through a leader that
/// has committed an entry of its own term and confirmed its leadership with a quorum (etcd
/// v3.4 raft: ReadIndex is postponed until the first commit in the term, etcd PR #14258), and
/// fills the header's `raft_term` after applying up to that entry
/// (server/etcdserver/api/v3rpc/key.go `Range`: `hdr.fill` after `kv.Range`; `raft_term` is
/// the last applied entry's term, server.go `apply` → `setTerm`). So the old term here proves
/// the renewals answered before the read were processed by the old term's leader.
fn confirm_read(ctx: &Arc<Ctx>, mut client: Client, acks_before: u64) -> ConfirmRead {
    let key = probe_key(&ctx.cfg.prefix);
    let limit = ctx.cfg.op_timeout;
    Box::pin(async move {
        let opts = etcd_client::GetOptions::new().with_count_only();
        let term = mutex::bounded(limit, client.get(key, Some(opts)))
            .await
            .ok()
            .and_then(|r| r.header().map(|h| h.raft_term()));
        (acks_before, term)
    })
}

/// The keepalive stream on `member` is silent or cannot be opened: prefer another member
/// (waiting at most `limit` for one to answer, and never past the fence's `deadline`: the
/// caller must be back to tell its holders in time), counted when the preference moves.
async fn move_off(ctx: &Arc<Ctx>, member: usize, limit: Duration, deadline: tokio::time::Instant) {
    let moved = tokio::select! {
        to = ctx.members.move_from(member, limit) => to.is_some_and(|to| to != member),
        _ = tokio::time::sleep_until(deadline) => false,
    };
    if moved {
        ctx.metrics.member_moves.inc();
    }
}

/// Keep the session's lease alive and run its fence; on loss, tell the session and stop.
#[allow(clippy::too_many_arguments)]
async fn keep_alive(
    ctx: Arc<Ctx>,
    session: u64,
    lease: i64,
    granted_sent_at: Instant,
    ttl_secs: i64,
    grant_term: u64,
    tx: mpsc::UnboundedSender<Msg>,
    deadline_tx: tokio::sync::watch::Sender<Option<Instant>>,
) {
    let mut fence = Fence::new(ctx.cfg.margin);
    if ctx.cfg.planted_bug_no_margin {
        fence = fence.planted_bug_no_margin();
    }
    if ctx.freeze_on_term_change {
        fence = fence.freeze_on_term_change();
        if ctx.cfg.planted_bug_credit_unconfirmed {
            fence = fence.planted_bug_credit_unconfirmed();
        }
    }
    let ttl = Duration::from_secs(u64::try_from(ttl_secs.max(1)).unwrap_or(1));
    let margin = if ctx.cfg.planted_bug_no_margin {
        Duration::ZERO
    } else {
        ctx.cfg.margin.of(ttl)
    };
    // Renew three times per (TTL − margin): two lost keepalives in a row still leave time.
    let every = (ttl.saturating_sub(margin) / 3).max(Duration::from_millis(20));
    let lease_hex = format!("{lease:016x}");
    let report = |out: Option<FenceOutput>| -> Option<String> {
        match out? {
            FenceOutput::Renewed { deadline } => {
                deadline_tx.send_replace(Some(deadline));
                debug!(session, lease = %lease_hex, deadline_in_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64, "fence: renewed");
                None
            }
            FenceOutput::Lost { cause } => {
                let c = match cause {
                    LostCause::DeadlinePassed {
                        since_last_ack,
                        deadline,
                    } => format!(
                        "etcd lease {lease_hex} not renewed for {} ms (deadline = last acknowledged keepalive's send + TTL {} s - margin {} ms; passed {} ms ago)",
                        since_last_ack.as_millis(),
                        ttl.as_secs(),
                        margin.as_millis(),
                        Instant::now().saturating_duration_since(deadline).as_millis()
                    ),
                    LostCause::EtcdExpired => {
                        format!("etcd says lease {lease_hex} has expired or was revoked")
                    }
                };
                warn!(session, lease = %lease_hex, cause = %c, "fence: lost");
                Some(c)
            }
        }
    };
    let now = Instant::now();
    if grant_term != 0 {
        fence.step(now, FenceInput::Term { term: grant_term });
    }
    if let Some(c) = report(fence.step(
        now,
        FenceInput::Granted {
            sent_at: granted_sent_at,
            ttl_secs,
        },
    )) {
        let _ = tx.send(Msg::Lost { cause: c });
        return;
    }
    // A silent stream moves to another member (unless there is none, or the planted bug).
    let moves = ctx.members.len() > 1 && !ctx.cfg.planted_bug_stay_on_stalled_member;
    let stall = super::members::stall_after(every);
    // The raft term of the last keepalive answer (None: none yet). A change means a new etcd
    // leader; on etcd < 3.4.31 the former one, if it was stalled rather than dead, may still
    // revoke this lease when it resumes (etcd-io/etcd#15247): logged, so that a loss can be
    // told apart afterwards.
    let mut last_term: Option<u64> = None;
    // With the fence at leader changes: the linearizable read that confirms the answers held
    // so far (`Fence::needs_confirmation`), resolving to (`acks_before`, its raft term).
    let mut confirm: Option<ConfirmRead> = None;
    // Whether the session was told its fence froze (once).
    let mut told_frozen = false;
    loop {
        // (Re)open the keepalive stream, watching the deadline meanwhile.
        let deadline = fence
            .deadline()
            .map(tokio::time::Instant::from_std)
            .unwrap_or_else(tokio::time::Instant::now);
        // The stream's etcd member ([`super::members`]): the preferred one.
        let member = ctx.members.preferred();
        // On a member client: a member that cannot open the stream within the stall bound
        // is passed over like a silent one.
        let open_limit = if moves { stall } else { ctx.cfg.op_timeout };
        let open = async {
            let mut c = ctx.members.client(member).await?;
            let ks = mutex::bounded(open_limit, c.lease_keep_alive(lease)).await?;
            Ok::<_, EtcdError>((c, ks))
        };
        let opened = tokio::select! {
            r = open => Some(r),
            _ = tokio::time::sleep_until(deadline) => None,
        };
        let (client, mut keeper, mut stream) = match opened {
            None => {
                if let Some(c) = report(fence.step(Instant::now(), FenceInput::Tick)) {
                    let _ = tx.send(Msg::Lost { cause: c });
                    return;
                }
                continue;
            }
            Some(Err(e)) => {
                debug!(session, lease = %lease_hex, member = ctx.members.endpoint(member), error = %e, "cannot open the keepalive stream; retrying");
                if moves {
                    move_off(&ctx, member, every, deadline).await;
                }
                let wake = tokio::time::Instant::now() + Duration::from_millis(50);
                tokio::time::sleep_until(wake.min(deadline)).await;
                if let Some(c) = report(fence.step(Instant::now(), FenceInput::Tick)) {
                    let _ = tx.send(Msg::Lost { cause: c });
                    return;
                }
                continue;
            }
            Some(Ok((c, (keeper, stream)))) => (c, keeper, stream),
        };
        fence.step(Instant::now(), FenceInput::StreamReset);
        // Send times of this stream's unanswered keepalives (etcd answers them in order).
        let mut unanswered: std::collections::VecDeque<Instant> = std::collections::VecDeque::new();
        // Opening the stream sends one keepalive whose answer etcd-client consumes (never
        // credited: its send time is unknown here); the first credited one goes now, then
        // every `every`.
        let mut next_send = tokio::time::Instant::now();
        loop {
            let deadline = fence
                .deadline()
                .map(tokio::time::Instant::from_std)
                .unwrap_or_else(tokio::time::Instant::now);
            // When the oldest unanswered keepalive has waited `stall` (far off without one).
            let stalled_at = unanswered.front().map_or(deadline + ttl, |s| {
                tokio::time::Instant::from_std(*s + stall)
            });
            tokio::select! {
                _ = tokio::time::sleep_until(stalled_at), if moves && !unanswered.is_empty() => {
                    info!(session, lease = %lease_hex, member = ctx.members.endpoint(member), unanswered = unanswered.len(),
                        stall_ms = stall.as_millis() as u64,
                        "keepalive stream silent: moving it to another etcd member");
                    move_off(&ctx, member, every, deadline).await;
                    // A confirming read on the silent member may hang as long: the next
                    // answer on the new stream issues another.
                    confirm = None;
                    break;
                }
                _ = tokio::time::sleep_until(next_send) => {
                    next_send += every;
                    match tokio::time::timeout(every, keeper.keep_alive()).await {
                        Ok(Ok(())) => {
                            unanswered.push_back(Instant::now());
                            if let Some(c) = report(fence.step(Instant::now(), FenceInput::Sent)) {
                                let _ = tx.send(Msg::Lost { cause: c });
                                return;
                            }
                        }
                        _ => {
                            debug!(session, lease = %lease_hex, "keepalive could not be sent; reopening the stream");
                            break;
                        }
                    }
                }
                m = stream.message() => match m {
                    Ok(Some(resp)) => {
                        if let Some(sent) = unanswered.pop_front() {
                            ctx.metrics.observe_rtt(sent.elapsed());
                        }
                        let (member, term) = resp
                            .header()
                            .map(|h| (h.member_id(), h.raft_term()))
                            .unwrap_or((0, 0));
                        debug!(session, lease = %lease_hex, member = format_args!("{member:016x}"), term, ttl_secs = resp.ttl(), "keepalive answered");
                        if term != 0 {
                            if let Some(old) = last_term.filter(|old| *old != term) {
                                ctx.metrics.term_changes.inc();
                                info!(session, lease = %lease_hex, from_term = old, to_term = term,
                                    member = format_args!("{member:016x}"),
                                    "etcd's raft term changed while the lease is kept alive (a new etcd leader)");
                            }
                            last_term = Some(term);
                            if let Some(c) = report(fence.step(Instant::now(), FenceInput::Term { term })) {
                                let _ = tx.send(Msg::Lost { cause: c });
                                return;
                            }
                            tell_frozen(&fence, &mut told_frozen, &tx, lease);
                        }
                        if let Some(c) = report(fence.step(Instant::now(), FenceInput::Acked { ttl_secs: resp.ttl() })) {
                            let _ = tx.send(Msg::Lost { cause: c });
                            return;
                        }
                        if confirm.is_none() && fence.needs_confirmation() {
                            confirm = Some(confirm_read(&ctx, client.clone(), fence.acks_seen()));
                        }
                    }
                    Ok(None) | Err(_) => {
                        debug!(session, lease = %lease_hex, "keepalive stream ended; reopening");
                        break;
                    }
                },
                read = async { confirm.as_mut().expect("guarded by is_some").await }, if confirm.is_some() => {
                    confirm = None;
                    let (acks_before, term) = read;
                    // A failed read confirms nothing: the next answer issues another.
                    if let Some(term) = term.filter(|t| *t != 0) {
                        if last_term.is_some_and(|old| term > old) {
                            info!(session, lease = %lease_hex, from_term = ?last_term, to_term = term,
                                "etcd's raft term changed (seen by the read confirming the keepalive answers): they are not credited");
                        }
                        debug!(session, lease = %lease_hex, term, acks_before, "keepalive answers confirmed by a linearizable read");
                        if let Some(c) = report(fence.step(Instant::now(), FenceInput::Confirmed { term, acks_before })) {
                            let _ = tx.send(Msg::Lost { cause: c });
                            return;
                        }
                        tell_frozen(&fence, &mut told_frozen, &tx, lease);
                        if fence.needs_confirmation() {
                            confirm = Some(confirm_read(&ctx, client.clone(), fence.acks_seen()));
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    if let Some(c) = report(fence.step(Instant::now(), FenceInput::Tick)) {
                        let _ = tx.send(Msg::Lost { cause: c });
                        return;
                    }
                }
            }
        }
        if let Some(c) = report(fence.step(Instant::now(), FenceInput::StreamReset)) {
            let _ = tx.send(Msg::Lost { cause: c });
            return;
        }
        let wake = tokio::time::Instant::now() + Duration::from_millis(50);
        let deadline = fence
            .deadline()
            .map(tokio::time::Instant::from_std)
            .unwrap_or_else(tokio::time::Instant::now);
        tokio::time::sleep_until(wake.min(deadline)).await;
        if let Some(c) = report(fence.step(Instant::now(), FenceInput::Tick)) {
            let _ = tx.send(Msg::Lost { cause: c });
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_fenced_lines_are_recognised_and_checked() {
        let ok = br#"{"op":"put_fenced","resource":"engine","key":"svc/engine","value":"10.0.0.1:8000"}"#;
        assert_eq!(
            decode_put_fenced(ok),
            Some(Ok(PutFenced {
                resource: "engine".into(),
                key: "svc/engine".into(),
                value: Some("10.0.0.1:8000".into())
            }))
        );
        assert_eq!(
            decode_put_fenced(br#"{"op":"delete_fenced","resource":"engine","key":"svc/engine"}"#),
            Some(Ok(PutFenced {
                resource: "engine".into(),
                key: "svc/engine".into(),
                value: None
            }))
        );
        assert!(matches!(
            decode_put_fenced(br#"{"op":"delete_fenced","resource":"r","key":"k","value":"v"}"#),
            Some(Err(_))
        ));
        assert!(matches!(
            decode_put_fenced(br#"{"op":"put_fenced","resource":"r","key":"k"}"#),
            Some(Err(_))
        ));
        assert_eq!(decode_put_fenced(br#"{"op":"ping"}"#), None);
        assert_eq!(decode_put_fenced(b"not json"), None);
        assert!(matches!(
            decode_put_fenced(br#"{"op":"put_fenced","resource":"","key":"k","value":"v"}"#),
            Some(Err(_))
        ));
        assert!(matches!(
            decode_put_fenced(br#"{"op":"put_fenced","resource":"r"}"#),
            Some(Err(_))
        ));
    }
}
