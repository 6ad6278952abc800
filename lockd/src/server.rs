//! The lockd server: a single-threaded tokio driver around the pure [`Core`].
//!
//! Every socket event becomes an [`Input`]; every [`Output::Persist`] is written durably
//! (see [`StateFile::write`]) before the outputs it gates are sent. The handoff path is
//! event-driven: EOF on the holder's socket → `Disconnect` → persist → grant written to the
//! next waiter's socket, all within one wakeup of this thread.
//!
//! [`Server::run`] must be awaited on a current-thread runtime (or inside `block_on`): it
//! uses a `LocalSet`.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::anchor::{self, check_anchor, AnchorKind, MAX_PENDING_FDS};
use crate::core::{Config, Core, Input, Now, Output, SessionId};
// Session ids are lockd's own counter: no need for SipHash's flood resistance.
use crate::kinds::waitfor::IdMap;
use crate::line::LineBuf;
use crate::metrics::{self, Metrics};
use crate::persist::{PersistError, StateFile};
use crate::proto::{self, ErrorCode, Event, NoticeKind, PeerInfo};
use crate::Endpoint;

/// Everything `lockd serve` can be told.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Listeners (`unix:PATH`, `tcp:HOST:PORT`); at least one.
    pub listen: Vec<Endpoint>,
    /// The durable state file.
    pub state: PathBuf,
    /// How long a persisted holder has to reclaim its lease after a restart.
    pub reconnect_window: Duration,
    /// `HOST:PORT` for Prometheus metrics, if wanted.
    pub metrics: Option<String>,
    /// Token that TCP clients must present to revoke.
    pub admin_token: Option<String>,
    /// Longest request line accepted (bytes).
    pub max_line: usize,
    /// A connection that sends no request within this time is closed.
    pub idle_timeout: Duration,
    /// Requests per second allowed per connection (burst of the same size).
    pub rate_limit: u32,
    /// Events buffered for a connection that does not read before it is disconnected.
    pub outbound_queue: usize,
    /// A connection whose socket accepts no bytes for this long is disconnected.
    pub write_timeout: Duration,
    /// After each request, keep polling the sockets without sleeping for this long, so
    /// that the next request (typically the new holder's answer to a grant) is read
    /// without waking a sleeping thread. Zero: sleep at once. Costs at most this much
    /// CPU per request; idle lockd never spins.
    pub busy_poll: Duration,
    /// Longest TTL / lease time granted (`--max-lease-time`).
    pub max_lease_time: Duration,
    /// Quantity leases: no renewal past first grant + this (`--max-total-lease-time`).
    pub max_total_lease_time: Duration,
    /// Offers set at startup (`--offers FILE`): (pool, offer).
    pub offers: Vec<(String, crate::kinds::quantity::OfferSpec)>,
    /// Revoke the youngest lease of every wait-for cycle (`--break-deadlocks`).
    pub break_deadlocks: bool,
    /// Ended version-2 leases remembered at most this many (`--max-tombstones`) ...
    pub max_tombstones: usize,
    /// ... and at most this long (`--tombstone-age`).
    pub tombstone_max_age: Duration,
    /// Write a whole snapshot (and empty the journal) once the journal passes this many
    /// bytes (`--compact-after`; None: max(1 MiB, twice the snapshot)).
    pub compact_after: Option<u64>,
}

impl ServeConfig {
    /// Defaults for everything but listeners and state file.
    pub fn new(listen: Vec<Endpoint>, state: PathBuf) -> ServeConfig {
        ServeConfig {
            listen,
            state,
            reconnect_window: Duration::from_secs(10),
            metrics: None,
            admin_token: None,
            max_line: proto::DEFAULT_MAX_LINE,
            idle_timeout: Duration::from_secs(10),
            rate_limit: 10_000,
            outbound_queue: 1024,
            write_timeout: Duration::from_secs(5),
            busy_poll: DEFAULT_BUSY_POLL,
            max_lease_time: Config::default().max_lease_time,
            max_total_lease_time: Config::default().max_total_lease_time,
            offers: Vec::new(),
            max_tombstones: Config::default().max_tombstones,
            tombstone_max_age: Config::default().tombstone_max_age,
            compact_after: None,
            break_deadlocks: false,
        }
    }
}

/// Default [`ServeConfig::busy_poll`]: longer than one round trip to a client on another
/// CPU (measured 18–55 µs on a 2-vCPU VM), short enough that a request costs little more.
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(100);

/// Longest a state write waits for the rest of a burst of changes (see the flusher task).
const FLUSH_BURST_WAIT: Duration = Duration::from_millis(5);

/// The reaper closes ended sessions' sockets once no session has ended for this long...
const REAP_QUIET: Duration = Duration::from_millis(1);
/// ... or once the oldest has waited this long (a steady stream of closes is reaped too).
const REAP_MAX_DELAY: Duration = Duration::from_millis(200);

/// Why lockd could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The state file is locked, corrupt or unreadable, or a write failed.
    #[error(transparent)]
    State(#[from] PersistError),
    /// A live lockd answers on the Unix socket path.
    #[error("socket {0} is in use by a live lockd; refusing to start")]
    SocketInUse(PathBuf),
    /// Something that is not a socket sits at the socket path.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Binding a listener failed.
    #[error("cannot listen on {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// No listener given.
    #[error("no --listen endpoint given")]
    NoListener,
    /// The state file's lease records are inconsistent, or the offers file is refused.
    #[error("cannot restore the state: {0}")]
    Restore(String),
}

fn now() -> Now {
    let unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Now {
        mono: Instant::now(),
        unix_ms,
    }
}

/// A log line whose writing is deferred until the sockets have been served.
enum LogLine {
    /// A lease change.
    Notice {
        /// The change.
        notice: crate::proto::Notice,
        /// Holder close → grant, when this grant followed a close.
        handoff_us: Option<u64>,
        /// Peer pid of the session concerned.
        pid: Option<i32>,
        /// Peer uid of the session concerned.
        uid: Option<u32>,
    },
    /// A connection ended.
    Closed {
        /// The session.
        session: SessionId,
        /// Why.
        reason: String,
    },
}

/// The I/O side of the state machine.
struct Driver {
    /// The pure state machine.
    core: Core,
    /// Where durable state goes.
    state: StateFile,
    /// Outbound paths of connected sessions (dropping one closes that connection).
    sessions: IdMap<SessionId, Outbound>,
    /// Peer pid and uid per session, for the log lines of its lease changes (not the whole
    /// identity: the core has it, and this is one more entry per connection).
    peers: IdMap<SessionId, (Option<i32>, Option<u32>)>,
    /// Measurements for `/metrics`.
    metrics: Metrics,
    /// Wakes the window timer when deadlines may have changed.
    timer: Rc<Notify>,
    /// Events of the current step, concatenated per session (sent at the step's end).
    out_batch: Vec<(SessionId, String)>,
    /// The deadline the timer task sleeps until (as of its last look), so that a step
    /// that leaves the earliest deadline unchanged does not wake it.
    armed: Option<Instant>,
    /// Log lines waiting for the logger task.
    deferred: Vec<LogLine>,
    /// Wakes the logger task.
    log_notify: Rc<Notify>,
    /// Highest persist sequence number the core asked for (group commit: every request up
    /// to it is covered by the next write, of one snapshot taken when that write starts).
    persist_requested: u64,
    /// Highest persist sequence number written durably and acknowledged to the core.
    persist_written: u64,
    /// Wakes the flusher task when `persist_requested` moves past `persist_written`.
    flush: Rc<Notify>,
    /// Set when a state write failed: nothing more is granted, lockd stops.
    fatal: Option<PersistError>,
    /// Wakes `run` when `fatal` is set.
    fatal_notify: Rc<Notify>,
    /// Busy-poll window after a request (zero: off).
    busy_poll: Duration,
    /// The spinner task polls without sleeping until this instant.
    spin_until: Instant,
    /// Wakes the spinner task.
    spin: Rc<Notify>,
    /// Sockets of ended sessions, closed by the reaper task once a burst of closes is over
    /// (closing a Unix socket and taking it out of epoll is ~5 us of kernel time, off the
    /// path from a holder's death to its successor's grant).
    graves: Vec<Box<dyn std::any::Any>>,
    /// When the oldest of `graves` was buried.
    graves_since: Option<Instant>,
    /// Wakes the reaper task.
    reap: Rc<Notify>,
}

impl Driver {
    fn feed(&mut self, input: Input) {
        if self.fatal.is_some() {
            return;
        }
        let outs = self.core.step(now(), input);
        // Sessions being granted something go first (their events keep their order): the
        // new holder is woken before the bookkeeping answers to others.
        let granted: Vec<SessionId> = outs
            .iter()
            .filter_map(|o| match o {
                Output::Send {
                    session,
                    event: Event::Granted { .. },
                } => Some(*session),
                _ => None,
            })
            .collect();
        // Their batches go first, in order of appearance, then everyone else's: the outputs
        // are taken in one pass, in place (no partition into two more vectors of outputs).
        let mut firsts = 0;
        for o in outs {
            match o {
                Output::Persist { seq } => {
                    // Group commit: the flusher task writes the latest state once every
                    // ready connection has been served (one snapshot, built then, for all
                    // the requests so far); the core holds back every event until the
                    // write that covers it is acknowledged.
                    self.persist_requested = self.persist_requested.max(seq);
                    self.flush.notify_one();
                }
                Output::Send { session, event } => {
                    // Batch this step's events per session: one socket write each.
                    let line = event.encode();
                    match self.out_batch.iter_mut().find(|(s, _)| *s == session) {
                        Some((_, l)) => l.push_str(&line),
                        None if granted.contains(&session) => {
                            self.out_batch.insert(firsts, (session, line));
                            firsts += 1;
                        }
                        None => self.out_batch.push((session, line)),
                    }
                }
                Output::Notice {
                    notice,
                    handoff_from,
                } => {
                    let handoff_us = handoff_from.map(|t| {
                        let d = t.elapsed();
                        self.metrics.handoff.observe(d);
                        d.as_micros() as u64
                    });
                    if !tracing::enabled!(tracing::Level::INFO) {
                        // Nobody reads the line: skip the logger task's wakeup too.
                        continue;
                    }
                    let (pid, uid) = notice
                        .session
                        .and_then(|s| self.peers.get(&s))
                        .copied()
                        .unwrap_or_default();
                    // Logged by the logger task, after the new holder's socket write.
                    self.deferred.push(LogLine::Notice {
                        notice,
                        handoff_us,
                        pid,
                        uid,
                    });
                    self.log_notify.notify_one();
                }
            }
        }
        // In output order: the new holders' events first.
        let mut batch = std::mem::take(&mut self.out_batch);
        for (session, line) in batch.drain(..) {
            self.deliver(session, line);
        }
        self.out_batch = batch;
        // Wake the timer task only when the earliest deadline moved (not on every step).
        if self.core.next_deadline() != self.armed {
            self.timer.notify_one();
        }
    }

    /// A request was read: keep polling without sleeping for the busy-poll window.
    fn busy_poll_after_request(&mut self) {
        if self.busy_poll.is_zero() {
            return;
        }
        let now = Instant::now();
        if now < self.spin_until {
            // Read while spinning: the wakeup it saved is what the window is for.
            self.metrics.busy_poll_hits.inc();
        }
        self.spin_until = now + self.busy_poll;
        self.spin.notify_one();
    }

    /// Queue a log line for the logger task (keeps log I/O off the handoff path).
    fn log_later(&mut self, line: LogLine) {
        if !tracing::enabled!(tracing::Level::INFO) {
            return;
        }
        self.deferred.push(line);
        self.log_notify.notify_one();
    }

    /// Write every queued log line.
    fn write_logs(&mut self) {
        for line in std::mem::take(&mut self.deferred) {
            match line {
                LogLine::Notice {
                    notice,
                    handoff_us,
                    pid,
                    uid,
                } => {
                    let what = match notice.kind {
                        NoticeKind::Granted if notice.reclaimed => "lease reclaimed",
                        NoticeKind::Granted => "lease granted",
                        NoticeKind::Released => "lease released",
                        NoticeKind::Expired => "lease expired",
                        NoticeKind::Revoked => "lease revoked",
                        NoticeKind::Committed => "version committed",
                        NoticeKind::Deadlock => "deadlock",
                    };
                    info!(
                        resource = %notice.resource,
                        holder = notice.holder.as_deref().unwrap_or(""),
                        epoch = notice.epoch,
                        session = notice.session,
                        pid,
                        uid,
                        handoff_us,
                        after_revoke = notice.after_revoke,
                        reason = notice.reason.as_deref(),
                        lease_id = notice.lease_id,
                        kind = notice.lease_kind.map(|k| k.as_str()),
                        version = notice.version,
                        "{what}"
                    );
                }
                LogLine::Closed { session, reason } => {
                    info!(session, reason = %reason, "session closed");
                }
            }
        }
    }

    /// Durably write the current state if the core asked for a write since the last one,
    /// and acknowledge every request up to the latest to the core (group commit: however
    /// many requests came since the last write, one journal line (or snapshot), one write,
    /// one fsync).
    fn flush_now(&mut self) {
        if self.persist_requested <= self.persist_written || self.fatal.is_some() {
            return;
        }
        // The core's state now covers every request made so far.
        let seq = self.persist_requested;
        let t = Instant::now();
        // Everything the core changed since the last write: one journal line. The first
        // write of this process, one whose change is as big as the state (a mass hand-over),
        // and one whose line would bring the journal to its compaction bound write the
        // whole state instead (and empty the journal).
        let appended = if self.state.wants_snapshot() || self.core.change_is_large() {
            Ok(false)
        } else {
            let mut delta = self.core.take_delta();
            self.state.append(&mut delta)
        };
        let r = if let Ok(false) = appended {
            let (compaction, journal_bytes) = (self.state.journal_open(), self.state.journal_len());
            let r = self.write_snapshot();
            if r.is_ok() {
                if compaction {
                    info!(journal_bytes, "journal compacted into a state snapshot");
                } else {
                    debug!("state snapshot written (first write since start)");
                }
            }
            r
        } else {
            appended.map(|_| ())
        };
        match r {
            Ok(()) => {
                self.metrics.persist.observe(t.elapsed());
                self.persist_written = seq;
                self.feed(Input::Persisted { seq });
            }
            Err(e) => {
                error!(error = %e, "state write failed; granting nothing more and stopping");
                self.fatal = Some(e);
                self.fatal_notify.notify_one();
            }
        }
    }

    /// A clean stop leaves one whole snapshot and an empty journal (what an operator reads,
    /// and what a lockd from before the journal can start from).
    fn snapshot_on_stop(&mut self) {
        if self.fatal.is_some() || !self.state.journal_open() || self.state.journal_len() == 0 {
            return;
        }
        match self.write_snapshot() {
            Ok(()) => info!("journal compacted into a state snapshot at stop"),
            Err(e) => warn!(error = %e, "state snapshot at stop failed; the journal stays"),
        }
    }

    /// Write the core's whole state (which covers, and so replaces, what was noted for the
    /// journal) and count it.
    fn write_snapshot(&mut self) -> Result<(), PersistError> {
        self.core.drop_delta();
        self.state.write(&self.core.snapshot_view())?;
        self.metrics.snapshots.inc();
        Ok(())
    }

    /// Keep an ended session's socket (both halves) for the reaper task to close.
    fn bury(&mut self, socket: Box<dyn std::any::Any>) {
        if self.graves.is_empty() {
            self.graves_since = Some(Instant::now());
            self.reap.notify_one();
        }
        self.graves.push(socket);
    }

    /// Close every buried socket now.
    fn reap_now(&mut self) {
        self.graves_since = None;
        self.graves.clear();
    }

    fn send(&mut self, session: SessionId, event: &Event) {
        self.deliver(session, event.encode());
    }

    /// Hand encoded event lines to a session's socket (or its queue).
    fn deliver(&mut self, session: SessionId, mut line: String) {
        let Some(out) = self.sessions.get(&session) else {
            return;
        };
        // Fast path: nothing queued or being written for this session, so the event goes
        // straight to its socket from here (no hop through the session's task). Whatever
        // the socket does not take at once is queued, in order, for the session's task.
        if !out.conn.busy().get() && out.conn.queue().is_empty() {
            match out.conn.try_write(line.as_bytes()) {
                Ok(n) if n == line.len() => return,
                Ok(n) => {
                    line.drain(..n);
                }
                // WouldBlock, or an error that the session's task will meet and report.
                Err(_) => {}
            }
        }
        if !out.conn.queue().push(line) {
            warn!(
                session,
                "client does not read its events; disconnecting it (slow consumer)"
            );
            self.sessions.remove(&session);
        }
    }
}

type Shared = Rc<RefCell<Driver>>;

/// How the driver reaches one session's socket: what it shares with the session's task.
struct Outbound {
    conn: Rc<dyn ConnOut>,
}

/// The driver's side of a connection (its task holds the same [`ConnShared`]).
trait ConnOut {
    /// Events the socket did not take at once, written by the session's task (bounded:
    /// `--outbound-queue`; full = slow consumer).
    fn queue(&self) -> &OutQueue;
    /// Set while the session's task holds bytes it has not finished writing; the driver
    /// then queues instead of writing, so events keep their order.
    fn busy(&self) -> &Cell<bool>;
    /// Non-blocking write to the session's socket.
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize>;
}

/// What a connection's task and the driver share, in one allocation per connection (it was
/// four: the queue, the busy flag, the write half and a closure around it).
struct ConnShared<W> {
    /// See [`ConnOut::queue`].
    queue: OutQueue,
    /// See [`ConnOut::busy`].
    busy: Cell<bool>,
    /// The write half of the socket.
    w: W,
}

impl<W: SharedWrite> ConnOut for ConnShared<W> {
    fn queue(&self) -> &OutQueue {
        &self.queue
    }
    fn busy(&self) -> &Cell<bool> {
        &self.busy
    }
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        self.w.try_write(buf)
    }
}

/// Events waiting for a session's task to write them: a bounded FIFO that allocates
/// nothing while empty (most sessions, most of the time), unlike a channel's first block.
/// Its one reader, the session's task, waits for it through a waker slot (no waiter node in
/// the task's future, as a `Notify` would need).
struct OutQueue {
    /// The lines, oldest first.
    lines: RefCell<std::collections::VecDeque<String>>,
    /// Most lines held (`--outbound-queue`; beyond: slow consumer).
    cap: usize,
    /// The session's task, while it waits (a line was queued, or the driver let it go).
    waker: Cell<Option<std::task::Waker>>,
    /// Set when the driver dropped the session's [`Outbound`].
    closed: Cell<bool>,
}

impl OutQueue {
    fn new(cap: usize) -> OutQueue {
        OutQueue {
            lines: RefCell::new(std::collections::VecDeque::new()),
            cap: cap.max(1),
            waker: Cell::new(None),
            closed: Cell::new(false),
        }
    }

    fn is_empty(&self) -> bool {
        self.lines.borrow().is_empty()
    }

    /// Wake the session's task if it waits.
    fn wake(&self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// Queue a line; false (nothing queued) when the queue is full.
    fn push(&self, line: String) -> bool {
        let mut q = self.lines.borrow_mut();
        if q.len() >= self.cap {
            return false;
        }
        q.push_back(line);
        drop(q);
        self.wake();
        true
    }

    fn try_pop(&self) -> Option<String> {
        let mut q = self.lines.borrow_mut();
        let l = q.pop_front();
        if q.is_empty() && q.capacity() > 0 {
            // Idle sessions hold no queue memory.
            *q = std::collections::VecDeque::new();
        }
        l
    }

    /// The next line, waiting for one; `None` once the driver let the session go (lines
    /// queued before that are still returned first).
    fn pop(&self) -> impl Future<Output = Option<String>> + '_ {
        std::future::poll_fn(move |cx| {
            if let Some(l) = self.try_pop() {
                return std::task::Poll::Ready(Some(l));
            }
            if self.closed.get() {
                return std::task::Poll::Ready(None);
            }
            let w = match self.waker.take() {
                Some(w) if w.will_wake(cx.waker()) => w,
                _ => cx.waker().clone(),
            };
            self.waker.set(Some(w));
            std::task::Poll::Pending
        })
    }
}

impl Drop for Outbound {
    fn drop(&mut self) {
        let q = self.conn.queue();
        q.closed.set(true);
        q.wake();
    }
}

/// The write half of a connection, shared by its task and the driver's fast path.
trait SharedWrite: 'static {
    /// Write what the socket takes now (`WouldBlock` if nothing).
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize>;
    /// Wait until the socket may take bytes.
    fn writable(&self) -> impl Future<Output = std::io::Result<()>> + '_;
}

impl SharedWrite for tokio::net::unix::OwnedWriteHalf {
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        tokio::net::unix::OwnedWriteHalf::try_write(self, buf)
    }
    fn writable(&self) -> impl Future<Output = std::io::Result<()>> + '_ {
        tokio::net::unix::OwnedWriteHalf::writable(self)
    }
}

impl SharedWrite for tokio::net::tcp::OwnedWriteHalf {
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        tokio::net::tcp::OwnedWriteHalf::try_write(self, buf)
    }
    fn writable(&self) -> impl Future<Output = std::io::Result<()>> + '_ {
        tokio::net::tcp::OwnedWriteHalf::writable(self)
    }
}

/// The read half of a connection: bytes, and (Unix sockets) file descriptors passed with them.
///
/// Readiness and reading are separate so that a connection waits for bytes without holding a
/// read buffer: the buffer is only offered once the socket is readable (see
/// [`LineBuf::read_with`]).
trait ConnRead: 'static {
    /// Wait until the socket may have bytes (or end-of-file) to read.
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + '_;
    /// Read what is there now into `buf` (`WouldBlock` if nothing); descriptors that came
    /// with the bytes (SCM_RIGHTS) go to `fds`.
    fn try_read_fds(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> std::io::Result<usize>;
    /// Read bytes into `buf`, waiting for them; descriptors go to `fds`.
    #[cfg_attr(not(test), allow(dead_code))]
    async fn read_fds(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> std::io::Result<usize> {
        loop {
            self.readable().await?;
            match self.try_read_fds(buf, fds) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }
    /// Whether this transport can carry descriptors (anchors).
    const CARRIES_FDS: bool;
    /// The transport's name (as in a peer's identity).
    const TRANSPORT: &'static str;
}

impl ConnRead for tokio::net::tcp::OwnedReadHalf {
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + '_ {
        // The socket's own reader slot (this task is its one reader), not a waiter node in
        // every connection's future as `readable()` has.
        let s: &tokio::net::TcpStream = self.as_ref();
        std::future::poll_fn(move |cx| s.poll_read_ready(cx))
    }
    fn try_read_fds(
        &mut self,
        buf: &mut [u8],
        _fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> std::io::Result<usize> {
        self.try_read(buf)
    }
    const CARRIES_FDS: bool = false;
    const TRANSPORT: &'static str = "tcp";
}

impl ConnRead for tokio::net::unix::OwnedReadHalf {
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + '_ {
        // As for TCP: the socket's reader slot, no waiter node.
        let s: &tokio::net::UnixStream = self.as_ref();
        std::future::poll_fn(move |cx| s.poll_read_ready(cx))
    }
    fn try_read_fds(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let s: &tokio::net::UnixStream = self.as_ref();
        s.try_io(tokio::io::Interest::READABLE, || {
            anchor::recv_with_fds(s.as_raw_fd(), &mut *buf, fds)
        })
    }
    const CARRIES_FDS: bool = true;
    const TRANSPORT: &'static str = "unix";
}

/// Watch an anchor until it closes, then tell the core.
async fn watch_anchor(d: Shared, session: SessionId, kind: AnchorKind, fd: std::os::fd::OwnedFd) {
    let why = anchor::closed(kind, fd).await;
    info!(session, kind = ?kind, reason = %why, "anchor closed");
    d.borrow_mut().feed(Input::AnchorClosed { session });
}

/// Write all of `buf` to a shared write half.
async fn write_all_shared<W: SharedWrite>(w: &W, buf: &[u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match w.try_write(&buf[off..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => w.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Write all of `buf`: straight away when the socket takes it (no allocation), else waiting
/// for room for at most `limit`. The wait is boxed: its futures (the socket's readiness and a
/// timer) are not part of every connection's task, most of which never wait to write.
async fn write_all_bounded<W: SharedWrite>(
    w: &W,
    buf: &[u8],
    limit: Duration,
) -> Result<std::io::Result<()>, tokio::time::error::Elapsed> {
    let mut off = 0;
    while off < buf.len() {
        match w.try_write(&buf[off..]) {
            Ok(0) => return Ok(Err(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Box::pin(tokio::time::timeout(
                    limit,
                    write_all_shared(w, &buf[off..]),
                ))
                .await;
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(()))
}

/// A connection's idle timer until its first request: boxed, and freed at that request.
type IdleTimer = Option<std::pin::Pin<Box<tokio::time::Sleep>>>;

/// Completes when the idle timer fires; never once it was freed.
async fn idle_fired(idle: &mut IdleTimer) {
    match idle {
        Some(t) => t.as_mut().await,
        None => std::future::pending().await,
    }
}

/// A lockd whose state file is locked and listeners are bound, ready to [`Server::run`].
pub struct Server {
    /// Configuration.
    cfg: ServeConfig,
    /// The driver (core + state file).
    driver: Shared,
    /// Bound Unix listeners and their paths (removed on clean shutdown).
    unix: Vec<(UnixListener, PathBuf)>,
    /// Bound TCP listeners.
    tcp: Vec<TcpListener>,
    /// Bound metrics listener.
    metrics: Option<TcpListener>,
}

fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if !md.file_type().is_socket() {
            return Err(ServeError::NotASocket(path.to_path_buf()));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(ServeError::SocketInUse(path.to_path_buf())),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                info!(path = %path.display(), "removing stale socket");
                let _ = std::fs::remove_file(path);
            }
            Err(e) => {
                return Err(ServeError::Bind {
                    endpoint: format!("unix:{}", path.display()),
                    source: e,
                })
            }
        }
    }
    let l = UnixListener::bind(path).map_err(|e| ServeError::Bind {
        endpoint: format!("unix:{}", path.display()),
        source: e,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|e| {
        ServeError::Bind {
            endpoint: format!("unix:{}", path.display()),
            source: e,
        }
    })?;
    Ok(l)
}

impl Server {
    /// Lock and read the state file, then bind every listener. Fails fast with a clear
    /// error (second lockd, live socket, corrupt state, bad address).
    pub async fn bind(mut cfg: ServeConfig) -> Result<Server, ServeError> {
        if cfg.listen.is_empty() {
            return Err(ServeError::NoListener);
        }
        let (mut state_file, state) = StateFile::open(&cfg.state)?;
        state_file.set_compact_after(cfg.compact_after);
        let held: Vec<String> = state
            .resources
            .iter()
            .filter(|(_, r)| r.holder.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        let mut unix = Vec::new();
        let mut tcp = Vec::new();
        for ep in &cfg.listen {
            match ep {
                Endpoint::Unix(p) => unix.push((bind_unix(p)?, p.clone())),
                Endpoint::Tcp(hp) => {
                    let l = TcpListener::bind(hp.as_str())
                        .await
                        .map_err(|e| ServeError::Bind {
                            endpoint: ep.to_string(),
                            source: e,
                        })?;
                    tcp.push(l);
                }
            }
        }
        let metrics = match &cfg.metrics {
            Some(hp) => {
                Some(
                    TcpListener::bind(hp.as_str())
                        .await
                        .map_err(|e| ServeError::Bind {
                            endpoint: format!("metrics {hp}"),
                            source: e,
                        })?,
                )
            }
            None => None,
        };
        let seed = rand::random::<u64>();
        let core = Core::new(
            Config {
                reconnect_window: cfg.reconnect_window,
                admin_token: cfg.admin_token.clone(),
                max_lease_time: cfg.max_lease_time,
                max_total_lease_time: cfg.max_total_lease_time,
                // Moved, not copied: once applied, the offers live in the core's pools only.
                offers: std::mem::take(&mut cfg.offers),
                max_tombstones: cfg.max_tombstones,
                tombstone_max_age: cfg.tombstone_max_age,
                break_deadlocks: cfg.break_deadlocks,
            },
            state,
            now(),
            seed,
        )
        .map_err(ServeError::Restore)?;
        for w in core.boot_warnings() {
            tracing::warn!("{w}");
        }
        if !held.is_empty() {
            info!(resources = ?held, window_ms = cfg.reconnect_window.as_millis() as u64,
                "persisted holders found: reconnect window open, granting nothing for them until it ends");
        }
        let driver = Rc::new(RefCell::new(Driver {
            core,
            state: state_file,
            sessions: IdMap::default(),
            peers: IdMap::default(),
            metrics: Metrics::default(),
            timer: Rc::new(Notify::new()),
            out_batch: Vec::new(),
            armed: None,
            fatal: None,
            fatal_notify: Rc::new(Notify::new()),
            persist_requested: 0,
            persist_written: 0,
            deferred: Vec::new(),
            log_notify: Rc::new(Notify::new()),
            flush: Rc::new(Notify::new()),
            busy_poll: cfg.busy_poll,
            spin_until: Instant::now(),
            spin: Rc::new(Notify::new()),
            graves: Vec::new(),
            graves_since: None,
            reap: Rc::new(Notify::new()),
        }));
        Ok(Server {
            cfg,
            driver,
            unix,
            tcp,
            metrics,
        })
    }

    /// Local address of the first TCP listener (tests bind port 0).
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.tcp.first().and_then(|l| l.local_addr().ok())
    }

    /// Serve until `shutdown` completes (Ok) or a state write fails (Err).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let local = tokio::task::LocalSet::new();
        let Server {
            cfg,
            driver,
            unix,
            tcp,
            metrics,
        } = self;
        let paths: Vec<PathBuf> = unix.iter().map(|(_, p)| p.clone()).collect();
        let limits = Rc::new(cfg.clone());
        let metrics_stop = Rc::new(Notify::new());
        let result = local
            .run_until(async move {
                let next_id = Rc::new(std::cell::Cell::new(1u64));
                for (l, path) in unix {
                    let (d, lim, ids) = (driver.clone(), limits.clone(), next_id.clone());
                    info!(endpoint = %format!("unix:{}", path.display()), "listening");
                    tokio::task::spawn_local(async move {
                        loop {
                            match l.accept().await {
                                Ok((s, _)) => {
                                    let cred = s.peer_cred().ok();
                                    let peer = PeerInfo {
                                        transport: "unix".into(),
                                        pid: cred.and_then(|c| c.pid()),
                                        uid: cred.map(|c| c.uid()),
                                        gid: cred.map(|c| c.gid()),
                                        addr: None,
                                    };
                                    let id = ids.get();
                                    ids.set(id + 1);
                                    let (r, w) = s.into_split();
                                    tokio::task::spawn_local(conn(d.clone(), lim.clone(), id, peer, r, w));
                                }
                                Err(e) => {
                                    warn!(error = %e, "accept failed");
                                    // Out of descriptors: close the dead sessions' now.
                                    d.borrow_mut().reap_now();
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                            }
                        }
                    });
                }
                for l in tcp {
                    let (d, lim, ids) = (driver.clone(), limits.clone(), next_id.clone());
                    info!(endpoint = %format!("tcp:{}", l.local_addr().map(|a| a.to_string()).unwrap_or_default()), "listening");
                    tokio::task::spawn_local(async move {
                        loop {
                            match l.accept().await {
                                Ok((s, addr)) => {
                                    let _ = s.set_nodelay(true);
                                    let peer = PeerInfo {
                                        transport: "tcp".into(),
                                        addr: Some(addr.to_string()),
                                        ..PeerInfo::default()
                                    };
                                    let id = ids.get();
                                    ids.set(id + 1);
                                    let (r, w) = s.into_split();
                                    tokio::task::spawn_local(conn(d.clone(), lim.clone(), id, peer, r, w));
                                }
                                Err(e) => {
                                    warn!(error = %e, "accept failed");
                                    // Out of descriptors: close the dead sessions' now.
                                    d.borrow_mut().reap_now();
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                            }
                        }
                    });
                }
                if let Some(ml) = metrics {
                    info!(addr = %ml.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics listening");
                    let (md, stop) = (driver.clone(), metrics_stop.clone());
                    let render = move || {
                        let drv = md.borrow();
                        metrics::render(
                            &drv.metrics,
                            &drv.core.counters(),
                            &drv.core.waiters(),
                            drv.core.session_count(),
                        )
                    };
                    tokio::task::spawn_local(metrics::serve(
                        ml,
                        render,
                        metrics::HttpLimits::default(),
                        async move { stop.notified().await },
                    ));
                }
                let (timer, fatal) = {
                    let d = driver.borrow();
                    (d.timer.clone(), d.fatal_notify.clone())
                };
                let (fd, flush) = (driver.clone(), driver.borrow().flush.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        flush.notified().await;
                        // A burst of changes as big as the state (a mass release): let the
                        // rest of the burst be read before writing (each yield lets every
                        // ready connection run), so that one snapshot covers it rather than
                        // one per batch of ready sockets. Bounded: FLUSH_BURST_WAIT at most.
                        let woke = Instant::now();
                        while fd.borrow().core.change_is_large() && woke.elapsed() < FLUSH_BURST_WAIT {
                            let before = fd.borrow().persist_requested;
                            tokio::task::yield_now().await;
                            if fd.borrow().persist_requested == before {
                                break;
                            }
                        }
                        fd.borrow_mut().flush_now();
                        // Let the writers woken by that write (the new holder's first) run,
                        // then free the replaced state file and create the next temp file.
                        tokio::task::yield_now().await;
                        fd.borrow_mut().state.prepare();
                    }
                });
                let (rd, reap) = (driver.clone(), driver.borrow().reap.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        reap.notified().await;
                        // Wait until no session has ended for a tick (a mass release is a
                        // burst of closes: the grants it leads to go out first), at most
                        // REAP_MAX_DELAY after the oldest grave, then close them all.
                        loop {
                            let before = rd.borrow().graves.len();
                            tokio::time::sleep(REAP_QUIET).await;
                            let d = rd.borrow();
                            let oldest = d.graves_since.map_or(Duration::ZERO, |t| t.elapsed());
                            if d.graves.len() == before || oldest >= REAP_MAX_DELAY {
                                break;
                            }
                        }
                        rd.borrow_mut().reap_now();
                    }
                });
                let (sd, spin) = (driver.clone(), driver.borrow().spin.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        spin.notified().await;
                        let start = Instant::now();
                        // Each yield makes the runtime poll epoll with a zero timeout
                        // instead of sleeping in it; other tasks run in between.
                        while Instant::now() < sd.borrow().spin_until {
                            tokio::task::yield_now().await;
                        }
                        sd.borrow().metrics.busy_poll.inc_by(start.elapsed().as_secs_f64());
                    }
                });
                let (ld, logs) = (driver.clone(), driver.borrow().log_notify.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        logs.notified().await;
                        // Let the tasks woken meanwhile (the new holder's writer) go first.
                        tokio::task::yield_now().await;
                        ld.borrow_mut().write_logs();
                    }
                });
                let td = driver.clone();
                tokio::task::spawn_local(async move {
                    loop {
                        let next = {
                            let mut d = td.borrow_mut();
                            let next = d.core.next_deadline();
                            d.armed = next;
                            next
                        };
                        match next {
                            Some(at) => tokio::select! {
                                _ = tokio::time::sleep_until(at.into()) => td.borrow_mut().feed(Input::Tick),
                                _ = timer.notified() => {}
                            },
                            None => timer.notified().await,
                        }
                    }
                });
                let result = tokio::select! {
                    _ = shutdown => {
                        info!("shutting down");
                        let mut d = driver.borrow_mut();
                        d.snapshot_on_stop();
                        let ids: Vec<SessionId> = d.sessions.keys().copied().collect();
                        for s in ids {
                            d.send(s, &Event::error(ErrorCode::ShuttingDown, "lockd is stopping", None));
                        }
                        Ok(())
                    }
                    _ = fatal.notified() => {
                        let e = driver.borrow_mut().fatal.take();
                        match e {
                            Some(e) => Err(ServeError::State(e)),
                            None => Ok(()),
                        }
                    }
                };
                // The metrics server stops accepting; a scrape in flight gets its answer.
                metrics_stop.notify_one();
                result
            })
            .await;
        // Let writers flush the shutdown notice (and the logger its lines) briefly, then drop
        // every task (closing sockets).
        local
            .run_until(tokio::time::sleep(Duration::from_millis(20)))
            .await;
        drop(local);
        for p in paths {
            let _ = std::fs::remove_file(&p);
        }
        info!("stopped");
        result
    }
}

/// Simple token bucket: `rate` requests per second, burst `rate`.
struct Bucket {
    /// Tokens available.
    tokens: f64,
    /// Refill per second and capacity.
    rate: f64,
    /// Last refill.
    at: Instant,
}

impl Bucket {
    fn take(&mut self) -> bool {
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.at).as_secs_f64() * self.rate).min(self.rate);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Register a new connection with the driver (its outbound path; its session in the core,
/// greeted with `hello`) and return its task. The setup runs here rather than in the task, so
/// that what only the setup needs (the peer's identity) is not carried in every task's future.
fn conn<R, W>(
    d: Shared,
    lim: Rc<ServeConfig>,
    id: SessionId,
    peer: PeerInfo,
    r: R,
    w: W,
) -> impl Future<Output = ()> + 'static
where
    R: ConnRead,
    W: SharedWrite,
{
    let c = Rc::new(ConnShared {
        queue: OutQueue::new(lim.outbound_queue),
        busy: Cell::new(false),
        w,
    });
    let out = Outbound { conn: c.clone() };
    info!(session = id, transport = %peer.transport, pid = peer.pid, uid = peer.uid, gid = peer.gid,
        addr = peer.addr.as_deref(), "session connected");
    {
        let mut drv = d.borrow_mut();
        drv.metrics.connections.inc();
        drv.sessions.insert(id, out);
        drv.peers.insert(id, (peer.pid, peer.uid));
        drv.feed(Input::Connect { session: id, peer });
    }
    conn_task(d, lim, id, r, c)
}

/// A connection's task: reads its requests, writes what its queue holds, ends it.
///
/// Its future is what every connection costs, whatever it does: it keeps inline only what
/// it needs all the time (read readiness and the queue's wakeup, both polled without a waiter
/// node of their own); the idle timer and the wait of a write the socket did not take at
/// once are boxed, and the timer is freed at the first request.
async fn conn_task<R, W>(
    d: Shared,
    lim: Rc<ServeConfig>,
    id: SessionId,
    mut r: R,
    c: Rc<ConnShared<W>>,
) where
    R: ConnRead,
    W: SharedWrite,
{
    // No read buffer up front: the line buffer is offered to the socket only once it is
    // readable, and grows (and shrinks back) with what the peer sends.
    let mut lb = LineBuf::new(lim.max_line);
    let mut fds: Vec<std::os::fd::OwnedFd> = Vec::new();
    // Boxed and freed at the first request: most connections live long past it.
    let mut idle: IdleTimer = Some(Box::pin(tokio::time::sleep(lim.idle_timeout)));
    let rate = f64::from(lim.rate_limit.max(1));
    let mut bucket = Bucket {
        tokens: rate,
        rate,
        at: Instant::now(),
    };
    let reason: String = 'outer: loop {
        tokio::select! {
            m = c.queue.pop() => match m {
                Some(mut line) => {
                    // The driver must not write past these bytes until they are out.
                    c.busy.set(true);
                    // Coalesce whatever else is queued for this session into one write.
                    while line.len() < 64 * 1024 {
                        match c.queue.try_pop() {
                            Some(more) => line.push_str(&more),
                            None => break,
                        }
                    }
                    let r = write_all_bounded(&c.w, line.as_bytes(), lim.write_timeout).await;
                    c.busy.set(false);
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => break format!("write failed: {e}"),
                        Err(_) => {
                            warn!(session = id, "client does not read its events; disconnecting it (write timeout)");
                            break "write timeout (slow consumer)".into();
                        }
                    }
                }
                None => break "closed by lockd (slow consumer)".into(),
            },
            ready = r.readable() => {
                if let Err(e) = ready {
                    break format!("read failed: {e}");
                }
                match lb.read_with(|room| r.try_read_fds(room, &mut fds)) {
                    Ok(0) => break "eof".into(),
                    Ok(_) => {}
                    // Spurious readiness: wait again.
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => break format!("read failed: {e}"),
                }
                if fds.len() > MAX_PENDING_FDS {
                    warn!(session = id, received = fds.len(), "descriptors without anchor requests; dropping the excess");
                    fds.truncate(MAX_PENDING_FDS);
                }
                d.borrow_mut().busy_poll_after_request();
                while let Some(item) = lb.next_line() {
                    let line = match item {
                        Ok(l) => l,
                        Err(e) => {
                            d.borrow().metrics.bad_requests.inc();
                            warn!(session = id, max = e.max, "line too long; disconnecting");
                            let ev = Event::error(ErrorCode::LineTooLong, e.to_string(), None).encode();
                            c.busy.set(true); // closing: the driver writes nothing more here
                            let _ = write_all_bounded(&c.w, ev.as_bytes(), lim.write_timeout).await;
                            break 'outer "line too long".into();
                        }
                    };
                    if line.iter().all(|b| b.is_ascii_whitespace()) {
                        continue;
                    }
                    // The first request frees the idle timer.
                    idle = None;
                    if !bucket.take() {
                        d.borrow().metrics.bad_requests.inc();
                        warn!(session = id, rate = lim.rate_limit, "request flood; disconnecting");
                        let ev = Event::error(ErrorCode::RateLimited, format!("more than {} requests/s", lim.rate_limit), None).encode();
                        c.busy.set(true); // closing: the driver writes nothing more here
                        let _ = write_all_bounded(&c.w, ev.as_bytes(), lim.write_timeout).await;
                        break 'outer "rate limited".into();
                    }
                    match proto::decode_request(&line, lim.max_line) {
                        Ok(proto::Request::Anchor) => {
                            let fd = if R::CARRIES_FDS {
                                if fds.is_empty() {
                                    Err("no file descriptor came with the anchor request (send it with SCM_RIGHTS)".to_string())
                                } else {
                                    let fd = fds.remove(0);
                                    check_anchor(&fd).map(|k| (k, fd))
                                }
                            } else {
                                Err(format!("anchors need a unix socket, not {}", R::TRANSPORT))
                            };
                            match fd {
                                Ok((kind, fd)) => {
                                    info!(session = id, kind = ?kind, "anchor attached");
                                    tokio::task::spawn_local(watch_anchor(d.clone(), id, kind, fd));
                                    d.borrow_mut().feed(Input::Request { session: id, req: proto::Request::Anchor });
                                }
                                Err(why) => {
                                    let mut drv = d.borrow_mut();
                                    drv.metrics.bad_requests.inc();
                                    warn!(session = id, error = %why, "anchor refused");
                                    drv.send(id, &Event::error(ErrorCode::AnchorRefused, why, None));
                                }
                            }
                        }
                        Ok(req) => {
                            debug!(session = id, ?req, "request");
                            d.borrow_mut().feed(Input::Request { session: id, req });
                        }
                        Err(e) => {
                            let mut drv = d.borrow_mut();
                            drv.metrics.bad_requests.inc();
                            warn!(session = id, code = e.code().as_str(), error = %e, "bad request");
                            drv.send(id, &Event::error(e.code(), e.to_string(), None));
                        }
                    }
                }
            }
            _ = idle_fired(&mut idle), if idle.is_some() => {
                warn!(session = id, "no request within the idle timeout; disconnecting");
                let ev = Event::error(ErrorCode::IdleTimeout, format!("no request within {:?}", lim.idle_timeout), None).encode();
                c.busy.set(true); // closing: the driver writes nothing more here
                let _ = write_all_bounded(&c.w, ev.as_bytes(), lim.write_timeout).await;
                break "idle timeout".into();
            }
        }
    };
    {
        let mut drv = d.borrow_mut();
        drv.sessions.remove(&id);
        drv.feed(Input::Disconnect { session: id });
        drv.peers.remove(&id);
        drv.log_later(LogLine::Closed {
            session: id,
            reason,
        });
        drv.bury(Box::new((r, c)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, OwnedFd};

    /// Most bytes a connection task's future may take in a debug build (400 now; 1,160
    /// with the idle timer, a waiting write with its timer, the peer's identity and a
    /// waiter node for readiness and for the queue's wakeup, all inline).
    const CONN_FUTURE_MAX: usize = 512;

    #[test]
    fn the_driver_reaches_a_connection_through_one_shared_allocation() {
        // One (fat) pointer per session in the driver's map, to one allocation shared with
        // the task: not a queue, a flag, a write half and a closure allocated apart.
        assert_eq!(
            std::mem::size_of::<Outbound>(),
            2 * std::mem::size_of::<usize>()
        );
    }

    #[tokio::test]
    async fn a_connection_task_keeps_what_it_rarely_needs_out_of_its_future() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ServeConfig::new(
            vec![Endpoint::Unix(dir.path().join("lockd.sock"))],
            dir.path().join("state.json"),
        );
        let server = Server::bind(cfg).await.unwrap();
        let lim = Rc::new(server.cfg.clone());
        let (_a, b) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = b.into_split();
        let unix = conn(
            server.driver.clone(),
            lim.clone(),
            1,
            PeerInfo::default(),
            r,
            w,
        );
        let (_l, t) = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let c = tokio::net::TcpStream::connect(l.local_addr().unwrap());
            let (c, a) = tokio::join!(c, l.accept());
            (a.unwrap().0, c.unwrap())
        };
        let (r, w) = t.into_split();
        let tcp = conn(server.driver.clone(), lim, 2, PeerInfo::default(), r, w);
        let (su, st) = (std::mem::size_of_val(&unix), std::mem::size_of_val(&tcp));
        eprintln!("connection task future: unix {su} bytes, tcp {st} bytes");
        assert!(
            su <= CONN_FUTURE_MAX && st <= CONN_FUTURE_MAX,
            "unix {su}, tcp {st} > {CONN_FUTURE_MAX} bytes"
        );
    }

    #[tokio::test]
    async fn every_descriptor_of_a_read_is_owned_even_past_the_anchor_limit() {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (mut r, _w) = b.into_split();
        let file = OwnedFd::from(tempfile::tempfile().unwrap());
        let many = vec![file.as_raw_fd(); 64];
        let sent = sendmsg::<()>(
            a.as_raw_fd(),
            &[std::io::IoSlice::new(b"{}\n")],
            &[ControlMessage::ScmRights(&many)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(sent, 3);
        let mut buf = [0u8; 64];
        let mut fds = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), r.read_fds(&mut buf, &mut fds))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 3);
        assert_eq!(fds.len(), many.len(), "every received descriptor is owned");
        let ino = |fd: &OwnedFd| nix::sys::stat::fstat(fd.as_raw_fd()).unwrap().st_ino;
        assert!(fds.iter().all(|fd| ino(fd) == ino(&file)));
    }
}
