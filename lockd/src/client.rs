//! The async client library (contract: docs/CONTRACTS.md).
//!
//! One [`LockClient`] is one session: a background task owns the connection, turns server
//! events into [`LockEvent`]s, and when the connection breaks it reconnects on its own,
//! re-queues pending acquires and reclaims held leases with their secret token. A held lease
//! that cannot be reclaimed within `reconnect_timeout` is reported as [`LockEvent::Lost`].

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::line::LineBuf;
use crate::proto::{self, Event, Request};
use crate::watchdog::{Due, Watchdog};
use crate::Endpoint;

/// Longest event line the client accepts (status reports can be large).
const MAX_EVENT_LINE: usize = 4 * 1024 * 1024;

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Limit for one connection attempt.
    pub connect_timeout: Duration,
    /// How long to try to reclaim a held lease after the connection broke; keep it longer
    /// than lockd's reconnect window plus its restart time.
    pub reconnect_timeout: Duration,
    /// Name used in this client's logs.
    pub label: Option<String>,
    /// An anchor to attach to every connection of this session, first thing after connecting
    /// and again after every reconnect, before any reclaim (`unix:` endpoints only; see
    /// [`Request::Anchor`] and [`anchor_pair`]). Its peer end is what the holder's processes
    /// inherit: lockd keeps the session's leases until that end is closed everywhere.
    pub anchor: Option<Arc<OwnedFd>>,
    /// Watch lockd itself (`crate::watchdog`): ping it every quarter of this, and when
    /// nothing has come from it for this long while leases are held, report them
    /// [`LockEvent::Lost`] and start a new connection. For lockd on etcd, where a stopped
    /// lockd's leases expire and another node is granted; None (the default): off.
    pub watchdog: Option<Duration>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(2),
            reconnect_timeout: Duration::from_secs(15),
            label: None,
            anchor: None,
            watchdog: None,
        }
    }
}

/// What the owner of a [`LockClient`] is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockEvent {
    /// The acquire is queued; position 1 is next.
    Queued {
        /// Resource.
        resource: String,
        /// 1-based place in line.
        position: usize,
    },
    /// Answer to acquire(wait=false): someone else holds it.
    Busy {
        /// Resource.
        resource: String,
        /// Current holder's name.
        holder: Option<String>,
    },
    /// The lease is ours (again, when `reclaimed`).
    Granted {
        /// Resource.
        resource: String,
        /// Fencing epoch.
        epoch: u64,
        /// True after a reconnect when the same lease (same epoch) was taken back.
        reclaimed: bool,
    },
    /// An operator revoked our lease: fence yourself and let go.
    Revoked {
        /// Resource.
        resource: String,
        /// Epoch of the revoked lease.
        epoch: u64,
        /// Operator's reason.
        reason: String,
    },
    /// The connection broke; the client is reconnecting on its own.
    Disconnected {
        /// Why it broke.
        cause: String,
    },
    /// A new connection is up; waiters re-queued, held leases being reclaimed.
    Reconnected,
    /// A held lease could not be reclaimed in time, or the reclaim was refused: fence yourself.
    Lost {
        /// Resource.
        resource: String,
        /// Epoch of the lost lease.
        epoch: u64,
        /// Why.
        cause: String,
    },
    /// etcd applied a [`LockClient::put_fenced`] (`put_done`) or a
    /// [`LockClient::delete_fenced`] (`delete_done`).
    PutDone {
        /// A delete (`delete_done`), not a put.
        deleted: bool,
        /// The resource whose lease fenced the write.
        resource: String,
        /// The key as given.
        key: String,
        /// The lease's epoch the write was compared with.
        epoch: u64,
        /// etcd's revision of the write.
        revision: u64,
    },
    /// A [`LockClient::put_fenced`] was refused: `fenced` (etcd: this holder is no longer the
    /// owner), `unavailable` (etcd did not answer, or not connected), `not_holder`, ...
    PutRefused {
        /// The resource of the put.
        resource: String,
        /// The key of the put.
        key: String,
        /// lockd's error code.
        code: String,
        /// Detail.
        message: String,
    },
    /// lockd answered a request with an error.
    Error {
        /// Stable code (see PROTOCOL.md).
        code: String,
        /// Detail.
        message: String,
    },
}

/// Client failures.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection attempt failed.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// Where to.
        endpoint: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The connection attempt did not finish within `connect_timeout`.
    #[error("connecting to {endpoint} timed out after {after:?}")]
    ConnectTimeout {
        /// Where to.
        endpoint: String,
        /// The limit.
        after: Duration,
    },
    /// A name is empty, too long or contains control characters.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The client was closed (or its task ended).
    #[error("the lock client is closed")]
    Closed,
    /// An anchor was given for an endpoint that cannot carry file descriptors.
    #[error("anchors need a unix: endpoint (got {0})")]
    AnchorTransport(String),
}

/// A new anchor pair `(keep, inherit)`: two connected Unix stream sockets, both close-on-exec.
/// Pass `keep` as [`ClientOptions::anchor`]; give `inherit` (with FD_CLOEXEC cleared) to every
/// process whose death must end the lease, and close it in the holder itself.
pub fn anchor_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(std::io::Error::from)
}

/// Whether `fd` polls readable right now (for a pidfd: its process has exited).
fn poll_readable(fd: RawFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // SAFETY: `fd` is owned by an OwnedFd the caller holds for the duration of this call.
    let bfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::new(bfd, PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Write `line` on `s` with `fd` attached (SCM_RIGHTS) to its first byte.
async fn send_with_fd(s: &UnixStream, line: &[u8], fd: RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = loop {
        s.writable().await?;
        let iov = [std::io::IoSlice::new(line)];
        match s.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg::<()>(s.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
                .map_err(std::io::Error::from)
        }) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    // The descriptor went with the first byte; the rest (if any) is plain data.
    let mut rest = &line[sent..];
    while !rest.is_empty() {
        s.writable().await?;
        match s.try_write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Stream {
    /// Attach `anchor` to this connection: the `anchor` request with the descriptor.
    async fn send_anchor(&mut self, anchor: &OwnedFd) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => {
                let line = proto::encode_request(&Request::Anchor);
                send_with_fd(s, line.as_bytes(), anchor.as_raw_fd()).await
            }
            Stream::Tcp(_) => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "anchors need a unix: endpoint",
            )),
        }
    }
}

/// The connection, whichever transport it uses.
enum Stream {
    /// Unix stream socket (SO_PEERCRED identifies us to lockd).
    Unix(UnixStream),
    /// TCP (engines spanning nodes).
    Tcp(TcpStream),
}

impl Stream {
    /// Wait until there are bytes (or end-of-file) to read; no buffer is held meanwhile.
    async fn readable(&self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.readable().await,
            Stream::Tcp(s) => s.readable().await,
        }
    }
    /// Read what is there now (`WouldBlock` if nothing).
    fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.try_read(buf),
            Stream::Tcp(s) => s.try_read(buf),
        }
    }
    async fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.write_all(b).await,
            Stream::Tcp(s) => s.write_all(b).await,
        }
    }
    fn raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

async fn connect_once(ep: &Endpoint, timeout: Duration) -> Result<Stream, ClientError> {
    let fut = async {
        match ep {
            Endpoint::Unix(p) => UnixStream::connect(p).await.map(Stream::Unix),
            Endpoint::Tcp(hp) => {
                let s = TcpStream::connect(hp.as_str()).await?;
                let _ = s.set_nodelay(true);
                Ok(Stream::Tcp(s))
            }
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(source)) => Err(ClientError::Connect {
            endpoint: ep.to_string(),
            source,
        }),
        Err(_) => Err(ClientError::ConnectTimeout {
            endpoint: ep.to_string(),
            after: timeout,
        }),
    }
}

/// A request from the owner to the background task (each acknowledged once sent or stored).
enum Cmd {
    /// Queue for / try a resource.
    Acquire {
        /// Resource.
        resource: String,
        /// Holder name.
        holder: String,
        /// Queue (true) or try once (false).
        wait: bool,
        /// Acknowledged once written (or stored for the next connection).
        ack: oneshot::Sender<()>,
    },
    /// Give up a lease or a queued acquire.
    Release {
        /// Resource.
        resource: String,
        /// Acknowledged once written (or applied locally while disconnected).
        ack: oneshot::Sender<()>,
    },
    /// Attach one more anchor (see [`LockClient::add_process_anchor`]).
    Anchor {
        /// The pidfd.
        fd: Arc<OwnedFd>,
        /// Acknowledged once written (or stored for the next connection).
        ack: oneshot::Sender<()>,
    },
    /// `put_fenced` / `delete_fenced` (etcd backend).
    PutFenced {
        /// Resource whose lease fences the write.
        resource: String,
        /// Key (under lockd's data prefix).
        key: String,
        /// Value (None: delete).
        value: Option<String>,
    },
    /// Close for good.
    Close {
        /// Acknowledged once the connection is closed.
        ack: oneshot::Sender<()>,
    },
}

/// One session with lockd (one connection, re-established after breaks).
pub struct LockClient {
    /// Commands to the background task.
    cmds: mpsc::UnboundedSender<Cmd>,
    /// Events from the background task.
    events: mpsc::UnboundedReceiver<LockEvent>,
    /// The raw fd of the current connection (None while disconnected), for `inheritable_fd`.
    fd: Arc<Mutex<Option<RawFd>>>,
    /// The features of the last `hello` (None until the first one arrived).
    features: tokio::sync::watch::Receiver<Option<Vec<String>>>,
    /// The background task.
    task: tokio::task::JoinHandle<()>,
    /// The endpoint, for errors (anchors need `unix:`).
    endpoint: Endpoint,
}

fn check(what: &str, s: &str) -> Result<(), ClientError> {
    if s.is_empty() || s.len() > proto::MAX_NAME_LEN || s.chars().any(|c| c.is_control()) {
        return Err(ClientError::Invalid(format!(
            "{what} must be 1..={} bytes without control characters",
            proto::MAX_NAME_LEN
        )));
    }
    Ok(())
}

impl LockClient {
    /// Connect (one attempt bounded by `connect_timeout`) and start the session.
    pub async fn connect(
        endpoint: &Endpoint,
        opts: ClientOptions,
    ) -> Result<LockClient, ClientError> {
        if opts.anchor.is_some() && !matches!(endpoint, Endpoint::Unix(_)) {
            return Err(ClientError::AnchorTransport(endpoint.to_string()));
        }
        let mut stream = connect_once(endpoint, opts.connect_timeout).await?;
        let conn_err = |source| ClientError::Connect {
            endpoint: endpoint.to_string(),
            source,
        };
        // The anchor first, so that nothing this session is granted is ever without it.
        if let Some(a) = &opts.anchor {
            stream.send_anchor(a).await.map_err(conn_err)?;
        }
        // A request right away, so that lockd's idle timeout never closes a quiet owner.
        stream
            .write_all(proto::encode_request(&Request::Ping).as_bytes())
            .await
            .map_err(conn_err)?;
        let fd = Arc::new(Mutex::new(Some(stream.raw_fd())));
        let (features_tx, features_rx) = tokio::sync::watch::channel(None);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let watchdog = opts
            .watchdog
            .map(|limit| Watchdog::new(limit, std::time::Instant::now()));
        let task = Task {
            watchdog,
            endpoint: endpoint.clone(),
            label: opts.label.clone().unwrap_or_else(|| "lockd-client".into()),
            opts,
            events: ev_tx,
            fd: fd.clone(),
            held: BTreeMap::new(),
            waiting: BTreeMap::new(),
            lost_deadline: None,
            server_reclaims: true,
            features: features_tx,
            puts: std::collections::VecDeque::new(),
            close_ack: None,
            process_anchors: Vec::new(),
        };
        let handle = tokio::spawn(task.run(stream, cmd_rx));
        Ok(LockClient {
            cmds: cmd_tx,
            events: ev_rx,
            fd,
            features: features_rx,
            task: handle,
            endpoint: endpoint.clone(),
        })
    }

    /// A dup of the CURRENT connection's socket, without FD_CLOEXEC, for a child to inherit.
    pub fn inheritable_fd(&self) -> std::io::Result<OwnedFd> {
        let guard = self
            .fd
            .lock()
            .map_err(|_| std::io::Error::other("fd slot poisoned"))?;
        let Some(fd) = *guard else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "not connected to lockd",
            ));
        };
        // `fd` is open while the guard is held (the task closes it only under the lock);
        // F_DUPFD returns a new descriptor without FD_CLOEXEC, which we then own.
        let new = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD(3))?;
        // SAFETY: `new` is a fresh descriptor owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(new) })
    }

    /// Queue for `resource` (wait=true) or try once (wait=false → Granted or Busy).
    /// Returns once the request is sent (or stored for the next connection).
    pub async fn acquire(
        &mut self,
        resource: &str,
        holder: &str,
        wait: bool,
    ) -> Result<(), ClientError> {
        check("resource", resource)?;
        check("holder", holder)?;
        let (ack, rx) = oneshot::channel();
        self.cmds
            .send(Cmd::Acquire {
                resource: resource.into(),
                holder: holder.into(),
                wait,
                ack,
            })
            .map_err(|_| ClientError::Closed)?;
        rx.await.map_err(|_| ClientError::Closed)
    }

    /// Attach a *process anchor*: a pidfd of a process whose death must come before this
    /// session's leases may end (lockd then keeps them, even after this connection closes,
    /// until that process has exited and released its files). Re-attached by the client after
    /// every reconnect, before any reclaim, as long as the process lives. `unix:` endpoints
    /// only ([`ClientError::AnchorTransport`] otherwise).
    pub async fn add_process_anchor(&mut self, pidfd: OwnedFd) -> Result<(), ClientError> {
        if !matches!(self.endpoint, Endpoint::Unix(_)) {
            return Err(ClientError::AnchorTransport(self.endpoint.to_string()));
        }
        let (ack, rx) = oneshot::channel();
        self.cmds
            .send(Cmd::Anchor {
                fd: Arc::new(pidfd),
                ack,
            })
            .map_err(|_| ClientError::Closed)?;
        rx.await.map_err(|_| ClientError::Closed)
    }

    /// Release a held lease or cancel a queued acquire.
    pub async fn release(&mut self, resource: &str) -> Result<(), ClientError> {
        check("resource", resource)?;
        let (ack, rx) = oneshot::channel();
        self.cmds
            .send(Cmd::Release {
                resource: resource.into(),
                ack,
            })
            .map_err(|_| ClientError::Closed)?;
        rx.await.map_err(|_| ClientError::Closed)
    }

    /// The features lockd's `hello` announced (`put_fenced`, `no_reclaim` on the etcd
    /// backend), waiting for the first `hello` up to `limit`; None if none came.
    pub async fn features(&self, limit: Duration) -> Option<Vec<String>> {
        let mut rx = self.features.clone();
        let got = tokio::time::timeout(limit, rx.wait_for(|f| f.is_some())).await;
        match got {
            Ok(Ok(f)) => f.clone(),
            _ => None,
        }
    }

    /// Write `key = value` in etcd only while this session still owns `resource` (lockd's
    /// `put_fenced`, etcd backend; docs/ETCD.md). The answer comes as
    /// [`LockEvent::PutDone`] or [`LockEvent::PutRefused`] (`unavailable` at once while
    /// disconnected: the write is not kept for the next connection).
    pub async fn put_fenced(
        &mut self,
        resource: &str,
        key: &str,
        value: &str,
    ) -> Result<(), ClientError> {
        self.send_fenced(resource, key, Some(value.into()))
    }

    /// Delete `key` in etcd only while this session still owns `resource` (lockd's
    /// `delete_fenced`, etcd backend): a holder that is no longer the owner cannot remove its
    /// successor's registration. Answered like [`LockClient::put_fenced`].
    pub async fn delete_fenced(&mut self, resource: &str, key: &str) -> Result<(), ClientError> {
        self.send_fenced(resource, key, None)
    }

    fn send_fenced(
        &mut self,
        resource: &str,
        key: &str,
        value: Option<String>,
    ) -> Result<(), ClientError> {
        check("resource", resource)?;
        if key.is_empty() || key.len() > proto::MAX_NAME_LEN {
            return Err(ClientError::Invalid(format!(
                "key must be 1..={} bytes",
                proto::MAX_NAME_LEN
            )));
        }
        self.cmds
            .send(Cmd::PutFenced {
                resource: resource.into(),
                key: key.into(),
                value,
            })
            .map_err(|_| ClientError::Closed)
    }

    /// The next event; cancel-safe. None when the client is closed for good.
    pub async fn next_event(&mut self) -> Option<LockEvent> {
        self.events.recv().await
    }

    /// Close the connection (drops the lease on the server if held and not inherited).
    pub async fn close(self) {
        let (ack, rx) = oneshot::channel();
        if self.cmds.send(Cmd::Close { ack }).is_ok() {
            let _ = rx.await;
        }
        let _ = self.task.await;
    }
}

/// The `hello` feature of a lockd that cannot reclaim a lease after its connection broke (the
/// etcd backend: a session's etcd lease is not adopted by a new connection). A client told so
/// reports its held leases [`LockEvent::Lost`] as soon as the connection breaks, instead of
/// keeping them (and its holder's engine) through a reconnect window that cannot save them
/// while the lease may expire and be granted elsewhere (docs/ETCD.md).
pub const FEATURE_NO_RECLAIM: &str = "no_reclaim";

/// What a broken connection means for the leases held (pure; the client's task acts on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterBreak {
    /// Nothing is held: just reconnect.
    Reconnect,
    /// Try to reclaim the held leases on a new connection, until this time.
    ReclaimUntil(Instant),
    /// The server cannot reclaim: the held leases are lost now.
    LostNow,
}

/// Decide what a connection break at `now` means (pure). `server_reclaims`: the last `hello`
/// did not announce [`FEATURE_NO_RECLAIM`]; `lost_deadline`: a reclaim deadline already
/// running (a break during a reconnect keeps the first one). The watchdog's limit
/// ([`ClientOptions::watchdog`]) applies on top, connected or not.
pub fn after_break(
    now: Instant,
    holding: bool,
    server_reclaims: bool,
    reconnect_timeout: Duration,
    lost_deadline: Option<Instant>,
) -> AfterBreak {
    if !holding {
        return AfterBreak::Reconnect;
    }
    if !server_reclaims {
        return AfterBreak::LostNow;
    }
    AfterBreak::ReclaimUntil(lost_deadline.unwrap_or(now + reconnect_timeout))
}

/// A lease this client holds (or is reclaiming).
struct Held {
    /// Holder name.
    holder: String,
    /// Epoch.
    epoch: u64,
    /// Reclaim secret.
    token: String,
    /// False between a reconnect and the server's reclaim answer.
    confirmed: bool,
}

/// The background task that owns the connection.
struct Task {
    /// Where to (re)connect.
    endpoint: Endpoint,
    /// Name in logs.
    label: String,
    /// Timeouts.
    opts: ClientOptions,
    /// Events to the owner.
    events: mpsc::UnboundedSender<LockEvent>,
    /// Shared with [`LockClient::inheritable_fd`]: the current connection's fd.
    fd: Arc<Mutex<Option<RawFd>>>,
    /// Leases held (or being reclaimed), with their reclaim tokens.
    held: BTreeMap<String, Held>,
    /// Acquires sent (or to send) and not yet answered with granted/busy: resource → (holder, wait).
    waiting: BTreeMap<String, (String, bool)>,
    /// Held leases not confirmed by this deadline are lost.
    lost_deadline: Option<Instant>,
    /// The last `hello` did not announce [`FEATURE_NO_RECLAIM`].
    server_reclaims: bool,
    /// The last `hello`'s features, for [`LockClient::features`].
    features: tokio::sync::watch::Sender<Option<Vec<String>>>,
    /// `put_fenced` requests sent on this connection and not answered yet: (resource, key).
    puts: std::collections::VecDeque<(String, String)>,
    /// Set by `close()`: answered once the connection is closed.
    close_ack: Option<oneshot::Sender<()>>,
    /// Process anchors (pidfds) added with `add_process_anchor`, re-attached after every
    /// reconnect (those whose process has exited are dropped first).
    process_anchors: Vec<Arc<OwnedFd>>,
    /// Silence detector on lockd ([`ClientOptions::watchdog`]).
    watchdog: Option<Watchdog>,
}

/// How a connected phase ended.
enum Flow {
    /// The owner closed the client.
    Closed,
    /// The connection broke (cause for the owner and the logs).
    Broken(String),
}

impl Task {
    fn emit(&self, ev: LockEvent) {
        let _ = self.events.send(ev);
    }

    fn set_fd(&self, fd: Option<RawFd>) {
        if let Ok(mut g) = self.fd.lock() {
            *g = fd;
        }
    }

    /// Drop the stream while holding the fd lock, so that `inheritable_fd` never dups a
    /// closed (or reused) descriptor.
    fn drop_stream(&self, s: Stream) {
        match self.fd.lock() {
            Ok(mut g) => {
                *g = None;
                drop(s);
            }
            Err(_) => drop(s),
        }
    }

    async fn run(mut self, first: Stream, mut cmds: mpsc::UnboundedReceiver<Cmd>) {
        let mut stream = first;
        loop {
            let flow = self.connected(&mut stream, &mut cmds).await;
            self.drop_stream(stream);
            let cause = match flow {
                Flow::Closed => {
                    if let Some(a) = self.close_ack.take() {
                        let _ = a.send(());
                    }
                    return;
                }
                Flow::Broken(c) => c,
            };
            warn!(client = %self.label, cause = %cause, held = self.held.len(), waiting = self.waiting.len(),
                "connection to lockd broke; reconnecting");
            self.emit(LockEvent::Disconnected {
                cause: cause.clone(),
            });
            // Puts in flight have no answer coming: refused as `unavailable` (not retried).
            while let Some((resource, key)) = self.puts.pop_front() {
                self.emit(LockEvent::PutRefused {
                    resource,
                    key,
                    code: "unavailable".into(),
                    message: format!("connection to lockd broke: {cause}"),
                });
            }
            for h in self.held.values_mut() {
                h.confirmed = false;
            }
            match after_break(
                Instant::now(),
                !self.held.is_empty(),
                self.server_reclaims,
                self.opts.reconnect_timeout,
                self.lost_deadline,
            ) {
                AfterBreak::Reconnect => {}
                AfterBreak::ReclaimUntil(t) => self.lost_deadline = Some(t),
                AfterBreak::LostNow => self.lose_unconfirmed(&format!(
                    "{cause}; this lockd cannot reclaim a lease after a disconnect (its hello says {FEATURE_NO_RECLAIM}: etcd backend)"
                )),
            }
            match self.reconnect(&mut cmds).await {
                Some(s) => stream = s,
                None => {
                    if let Some(a) = self.close_ack.take() {
                        let _ = a.send(());
                    }
                    return;
                }
            }
        }
    }

    /// Remember a process anchor for the next reconnects, dropping those whose process has
    /// exited (an engine that keeps starting short-lived helpers must not grow the list).
    fn keep_process_anchor(&mut self, fd: Arc<OwnedFd>) {
        self.process_anchors
            .retain(|a| !poll_readable(a.as_raw_fd()));
        self.process_anchors.push(fd);
    }

    /// When the watchdog gives up the leases held (None: off, or nothing held).
    fn silent_at(&self) -> Option<Instant> {
        self.watchdog
            .as_ref()
            .filter(|_| !self.held.is_empty())
            .map(|w| Instant::from_std(w.silent_at()))
    }

    /// Nothing came from lockd for the watchdog's limit: every lease held is lost. The cause.
    fn lose_all_silent(&mut self) -> String {
        let Some(w) = self.watchdog.as_mut() else {
            return String::new();
        };
        let cause = format!("no sign of life from lockd for {:?} (watchdog)", w.limit());
        w.rearm(std::time::Instant::now());
        for h in self.held.values_mut() {
            h.confirmed = false;
        }
        self.lose_unconfirmed(&cause);
        cause
    }

    fn lose_unconfirmed(&mut self, cause: &str) {
        let lost: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| !h.confirmed)
            .map(|(r, _)| r.clone())
            .collect();
        for r in lost {
            if let Some(h) = self.held.remove(&r) {
                warn!(client = %self.label, resource = %r, epoch = h.epoch, cause, "lease lost");
                self.emit(LockEvent::Lost {
                    resource: r,
                    epoch: h.epoch,
                    cause: cause.to_string(),
                });
            }
        }
        self.lost_deadline = None;
    }

    /// Reconnect with backoff; None when the owner closed the client meanwhile.
    async fn reconnect(&mut self, cmds: &mut mpsc::UnboundedReceiver<Cmd>) -> Option<Stream> {
        let mut backoff = Duration::from_millis(10);
        loop {
            let ep = self.endpoint.clone();
            let attempt = connect_once(&ep, self.opts.connect_timeout);
            tokio::pin!(attempt);
            let deadline = self.lost_deadline;
            let silent = self.silent_at();
            let res = tokio::select! {
                r = &mut attempt => Some(r),
                c = cmds.recv() => {
                    if !self.offline_cmd(c) {
                        return None;
                    }
                    None
                }
                _ = sleep_opt(deadline) => {
                    let t = self.opts.reconnect_timeout;
                    self.lose_unconfirmed(&format!("could not reconnect to lockd within {t:?}"));
                    None
                }
                _ = sleep_opt(silent) => {
                    let _ = self.lose_all_silent();
                    None
                }
            };
            match res {
                Some(Ok(mut s)) => {
                    // The anchors before the reclaims: a reclaimed lease is anchored at once.
                    // Process anchors whose process has exited have nothing left to hold.
                    self.process_anchors
                        .retain(|a| !poll_readable(a.as_raw_fd()));
                    let anchors: Vec<Arc<OwnedFd>> = self
                        .opts
                        .anchor
                        .iter()
                        .chain(self.process_anchors.iter())
                        .cloned()
                        .collect();
                    let mut sent = Ok(());
                    for a in &anchors {
                        sent = s.send_anchor(a).await;
                        if sent.is_err() {
                            break;
                        }
                    }
                    if let Err(e) = sent {
                        debug!(client = %self.label, error = %e, "cannot attach the anchors; retrying");
                        drop(s);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(250));
                        continue;
                    }
                    self.set_fd(Some(s.raw_fd()));
                    info!(client = %self.label, endpoint = %self.endpoint, "reconnected to lockd");
                    self.emit(LockEvent::Reconnected);
                    let mut out = proto::encode_request(&Request::Ping);
                    for (r, h) in &self.held {
                        out.push_str(&proto::encode_request(&Request::Reclaim {
                            resource: r.clone(),
                            holder: h.holder.clone(),
                            epoch: h.epoch,
                            token: h.token.clone(),
                        }));
                    }
                    for (r, (holder, wait)) in &self.waiting {
                        out.push_str(&proto::encode_request(&Request::acquire(
                            r.clone(),
                            holder.clone(),
                            *wait,
                        )));
                    }
                    if s.write_all(out.as_bytes()).await.is_ok() {
                        return Some(s);
                    }
                    self.drop_stream(s);
                }
                Some(Err(e)) => {
                    debug!(client = %self.label, error = %e, "reconnect attempt failed");
                    // Not past the reclaim deadline or the watchdog's limit: those are acted
                    // on by the select above, on time.
                    let mut until = Instant::now() + backoff;
                    for t in [self.lost_deadline, self.silent_at()].into_iter().flatten() {
                        until = until.min(t);
                    }
                    let sleep = tokio::time::sleep_until(until);
                    tokio::pin!(sleep);
                    loop {
                        tokio::select! {
                            _ = &mut sleep => break,
                            c = cmds.recv() => if !self.offline_cmd(c) { return None },
                        }
                    }
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                }
                None => {}
            }
        }
    }

    /// A command while disconnected; false when the client must stop.
    fn offline_cmd(&mut self, c: Option<Cmd>) -> bool {
        match c {
            None => false,
            Some(Cmd::Close { ack }) => {
                self.close_ack = Some(ack);
                false
            }
            Some(Cmd::Acquire {
                resource,
                holder,
                wait,
                ack,
            }) => {
                self.waiting.insert(resource, (holder, wait));
                let _ = ack.send(());
                true
            }
            Some(Cmd::Release { resource, ack }) => {
                self.held.remove(&resource);
                self.waiting.remove(&resource);
                if self.held.values().all(|h| h.confirmed) {
                    self.lost_deadline = None;
                }
                let _ = ack.send(());
                true
            }
            Some(Cmd::PutFenced { resource, key, .. }) => {
                self.emit(LockEvent::PutRefused {
                    resource,
                    key,
                    code: "unavailable".into(),
                    message: "not connected to lockd".into(),
                });
                true
            }
            Some(Cmd::Anchor { fd, ack }) => {
                // Attached with the others on the next connection.
                self.keep_process_anchor(fd);
                let _ = ack.send(());
                true
            }
        }
    }

    async fn connected(&mut self, s: &mut Stream, cmds: &mut mpsc::UnboundedReceiver<Cmd>) -> Flow {
        // Reads go straight into the line buffer, which grows for a long event (a big
        // `status`) and is let go once its lines are taken: no 16 KiB buffer per client.
        let mut lb = LineBuf::new(MAX_EVENT_LINE);
        loop {
            let deadline = self.lost_deadline;
            let watch = self
                .watchdog
                .as_ref()
                .map(|w| Instant::from_std(w.next_wakeup()));
            tokio::select! {
                r = s.readable() => {
                    if let Err(e) = r {
                        return Flow::Broken(format!("read failed: {e}"));
                    }
                    match lb.read_with(|room| s.try_read(room)) {
                        Ok(0) => return Flow::Broken("lockd closed the connection".into()),
                        Ok(_) => {}
                        // Spurious readiness: wait again.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(e) => return Flow::Broken(format!("read failed: {e}")),
                    }
                    if let Some(w) = self.watchdog.as_mut() {
                        w.heard(std::time::Instant::now());
                    }
                    while let Some(item) = lb.next_line() {
                        match item {
                            Ok(line) => self.on_line(&line),
                            Err(e) => return Flow::Broken(format!("event {e}")),
                        }
                    }
                }
                _ = sleep_opt(watch) => {
                    let due = self.watchdog.as_mut().and_then(|w| w.poll(std::time::Instant::now()));
                    match due {
                        Some(Due::Ping) => {
                            let ping = proto::encode_request(&Request::Ping);
                            if let Err(e) = s.write_all(ping.as_bytes()).await {
                                return Flow::Broken(format!("write failed: {e}"));
                            }
                        }
                        Some(Due::Silent) if !self.held.is_empty() => {
                            // A new session: lockd ends this one (and whatever it still
                            // holds) once it reads again.
                            return Flow::Broken(self.lose_all_silent());
                        }
                        Some(Due::Silent) => {
                            if let Some(w) = self.watchdog.as_mut() {
                                w.rearm(std::time::Instant::now());
                            }
                        }
                        None => {}
                    }
                }
                c = cmds.recv() => {
                    let line = match c {
                        None => return Flow::Closed,
                        Some(Cmd::Close { ack }) => {
                            self.close_ack = Some(ack);
                            return Flow::Closed;
                        }
                        Some(Cmd::Acquire { resource, holder, wait, ack }) => {
                            let l = proto::encode_request(&Request::acquire(
                                resource.clone(), holder.clone(), wait,
                            ));
                            self.waiting.insert(resource, (holder, wait));
                            let _ = ack.send(());
                            l
                        }
                        Some(Cmd::Release { resource, ack }) => {
                            self.held.remove(&resource);
                            self.waiting.remove(&resource);
                            if self.held.values().all(|h| h.confirmed) {
                                self.lost_deadline = None;
                            }
                            let _ = ack.send(());
                            proto::encode_request(&Request::release(resource))
                        }
                        Some(Cmd::PutFenced { resource, key, value }) => {
                            let l = match value {
                                Some(value) => serde_json::json!({
                                    "op": "put_fenced", "resource": resource, "key": key, "value": value,
                                }),
                                None => serde_json::json!({
                                    "op": "delete_fenced", "resource": resource, "key": key,
                                }),
                            };
                            self.puts.push_back((resource, key));
                            format!("{l}\n")
                        }
                        Some(Cmd::Anchor { fd, ack }) => {
                            let r = s.send_anchor(&fd).await;
                            self.keep_process_anchor(fd);
                            let _ = ack.send(());
                            if let Err(e) = r {
                                return Flow::Broken(format!("write failed: {e}"));
                            }
                            continue;
                        }
                    };
                    if let Err(e) = s.write_all(line.as_bytes()).await {
                        return Flow::Broken(format!("write failed: {e}"));
                    }
                }
                _ = sleep_opt(deadline) => {
                    let t = self.opts.reconnect_timeout;
                    self.lose_unconfirmed(&format!("lease not reclaimed within {t:?}"));
                }
            }
        }
    }

    /// A `put_done` line (not part of the version-1 protocol: the etcd backend's), answering
    /// the oldest put in flight. False when the line is not one.
    fn on_put_done(&mut self, line: &[u8]) -> bool {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else {
            return false;
        };
        let deleted = v["event"] == "delete_done";
        if v["event"] != "put_done" && !deleted {
            return false;
        }
        let (resource, key) = self.puts.pop_front().unwrap_or_default();
        let s = |f: &str, d: String| v[f].as_str().map(str::to_string).unwrap_or(d);
        self.emit(LockEvent::PutDone {
            deleted,
            resource: s("resource", resource),
            key: s("key", key),
            epoch: v["epoch"].as_u64().unwrap_or(0),
            revision: v["revision"].as_u64().unwrap_or(0),
        });
        true
    }

    /// Whether an error answers the oldest put in flight (then taken off the list): its codes
    /// (`fenced`, `unavailable`), or a generic refusal naming its resource (or none).
    fn put_answered(&mut self, code: &str, resource: Option<&str>) -> Option<(String, String)> {
        let (r, _) = self.puts.front()?;
        let generic = matches!(
            code,
            "not_holder" | "bad_request" | "unknown_op" | "unsupported"
        ) && resource.is_none_or(|x| x == r);
        if matches!(code, "fenced" | "unavailable") || generic {
            return self.puts.pop_front();
        }
        None
    }

    fn on_line(&mut self, line: &[u8]) {
        let ev = match proto::decode_event(line) {
            Ok(ev) => ev,
            Err(e) => {
                if self.on_put_done(line) {
                    return;
                }
                warn!(client = %self.label, error = %e, "undecodable event from lockd; ignored");
                return;
            }
        };
        match ev {
            Event::Queued {
                resource, position, ..
            } => self.emit(LockEvent::Queued { resource, position }),
            Event::Busy { resource, holder } => {
                self.waiting.remove(&resource);
                self.emit(LockEvent::Busy { resource, holder });
            }
            Event::Granted {
                resource,
                holder,
                epoch,
                token,
                reclaimed,
                ..
            } => {
                // A grant the owner no longer wants (released/cancelled while the answer was in
                // flight): lockd processes our release right after it, so drop it silently.
                let wanted = if reclaimed {
                    self.held.get(&resource).is_some_and(|h| h.epoch == epoch)
                } else {
                    self.waiting.remove(&resource).is_some()
                };
                if !wanted {
                    debug!(client = %self.label, resource = %resource, epoch, "stale grant ignored");
                    return;
                }
                self.held.insert(
                    resource.clone(),
                    Held {
                        holder,
                        epoch,
                        token,
                        confirmed: true,
                    },
                );
                if self.held.values().all(|h| h.confirmed) {
                    self.lost_deadline = None;
                }
                info!(client = %self.label, resource = %resource, epoch, reclaimed, "lease granted");
                self.emit(LockEvent::Granted {
                    resource,
                    epoch,
                    reclaimed,
                });
            }
            Event::Revoked {
                resource,
                epoch,
                reason,
            } => {
                warn!(client = %self.label, resource = %resource, epoch, reason = %reason, "lease revoked");
                self.emit(LockEvent::Revoked {
                    resource,
                    epoch,
                    reason,
                });
            }
            Event::Error {
                code,
                message,
                resource,
            } => {
                if let Some((resource, key)) = self.put_answered(&code, resource.as_deref()) {
                    self.emit(LockEvent::PutRefused {
                        resource,
                        key,
                        code,
                        message,
                    });
                    return;
                }
                // lockd on etcd dropped this acquire (etcd unreachable, or the waiting
                // session's etcd lease was lost): it is no longer queued, so it is not sent
                // again on the next connection (the owner asks again if it wants).
                if code == "unavailable" {
                    if let Some(r) = resource.as_deref() {
                        self.waiting.remove(r);
                    }
                }
                if code == "reclaim_refused" {
                    if let Some(h) = resource.as_ref().and_then(|r| self.held.remove(r)) {
                        let resource = resource.unwrap_or_default();
                        warn!(client = %self.label, resource = %resource, epoch = h.epoch, cause = %message, "lease lost");
                        if self.held.values().all(|h| h.confirmed) {
                            self.lost_deadline = None;
                        }
                        self.emit(LockEvent::Lost {
                            resource,
                            epoch: h.epoch,
                            cause: message,
                        });
                        return;
                    }
                }
                self.emit(LockEvent::Error { code, message });
            }
            Event::Anchored { anchors } => {
                debug!(client = %self.label, anchors, "anchor attached");
            }
            Event::Hello { features, .. } => {
                self.server_reclaims = !features.iter().any(|f| f == FEATURE_NO_RECLAIM);
                self.features.send_replace(Some(features));
            }
            Event::Released { .. }
            | Event::Cancelled { .. }
            | Event::RevokeSent { .. }
            | Event::Status(_)
            | Event::Watching {}
            | Event::Notice(_)
            | Event::Pong { valid_ms: None } => {}
            Event::Pong { valid_ms: Some(v) } => {
                if let Some(w) = self.watchdog.as_mut() {
                    w.vouch(std::time::Instant::now(), Duration::from_millis(v));
                }
            }
            // Version-2 events answer version-2 requests, which this client does not send.
            _ => {}
        }
    }
}

async fn sleep_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_break_with_nothing_held_only_reconnects() {
        let t0 = Instant::now();
        for reclaims in [true, false] {
            assert_eq!(
                after_break(t0, false, reclaims, 15 * S, None),
                AfterBreak::Reconnect
            );
        }
    }

    #[test]
    fn a_reclaiming_server_gets_the_reconnect_window_counted_from_the_first_break() {
        let t0 = Instant::now();
        assert_eq!(
            after_break(t0, true, true, 15 * S, None),
            AfterBreak::ReclaimUntil(t0 + 15 * S)
        );
        // A second break during the reconnect does not extend the window.
        assert_eq!(
            after_break(t0 + 3 * S, true, true, 15 * S, Some(t0 + 15 * S)),
            AfterBreak::ReclaimUntil(t0 + 15 * S)
        );
    }

    #[test]
    fn a_server_that_cannot_reclaim_loses_the_held_leases_at_once() {
        let t0 = Instant::now();
        assert_eq!(
            after_break(t0, true, false, 15 * S, None),
            AfterBreak::LostNow
        );
        assert_eq!(
            after_break(t0, true, false, 15 * S, Some(t0 + 15 * S)),
            AfterBreak::LostNow
        );
    }
}
