//! The `gmsd` runtime: accepts connections on a Unix socket and drives the pure
//! [`GmsCore`] with them. One task per connection; the core sits behind one mutex (every
//! critical section is short and never awaits).

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backend::{BackendError, ServerBackend};
use crate::core::{CoreError, GmsCore, Outcome};
use crate::lock::{LockError, SessionId};
use crate::protocol::{GrantedLockType, Message};
use crate::wire::{FramedStream, WireError};

/// `error_response.code` values this server sends (HTTP-like classes).
pub mod codes {
    /// Malformed or unexpected message.
    pub const BAD_REQUEST: i64 = 400;
    /// The session's lock does not allow the operation (or it has none).
    pub const FORBIDDEN: i64 = 403;
    /// Unknown allocation.
    pub const NOT_FOUND: i64 = 404;
    /// Second handshake on one session.
    pub const CONFLICT: i64 = 409;
    /// Backend failure.
    pub const INTERNAL: i64 = 500;
    /// Backend out of memory.
    pub const OUT_OF_MEMORY: i64 = 507;
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Another server answers on the socket.
    #[error("already running: a GMS server accepts connections on {0}")]
    AlreadyRunning(PathBuf),
    /// Binding failed.
    #[error("cannot bind {0}: {1}")]
    Bind(PathBuf, io::Error),
    /// Accept failed.
    #[error("accept failed: {0}")]
    Accept(io::Error),
}

/// Binds `path`: refuses when a live server answers there, unlinks a stale socket file.
pub fn bind_socket(path: &Path) -> Result<UnixListener, ServerError> {
    if path.exists() {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(ServerError::AlreadyRunning(path.to_path_buf())),
            Err(_) => {
                info!(socket = %path.display(), "removing stale socket file");
                std::fs::remove_file(path).map_err(|e| ServerError::Bind(path.to_path_buf(), e))?;
            }
        }
    }
    UnixListener::bind(path).map_err(|e| ServerError::Bind(path.to_path_buf(), e))
}

struct State<B: ServerBackend> {
    /// Lock + store.
    core: GmsCore<B::Handle>,
    /// Creates and releases memory.
    backend: B,
    /// Handshakes waiting for an answer.
    pending: HashMap<SessionId, oneshot::Sender<Option<GrantedLockType>>>,
}

struct Shared<B: ServerBackend> {
    /// Everything mutable, behind one lock so every transition is atomic.
    state: Mutex<State<B>>,
    /// Zero of the core's millisecond clock.
    start: Instant,
}

impl<B: ServerBackend> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // A poisoned mutex means a bug panicked mid-transition: the spec says internal
        // inconsistency is fatal, so exit rather than serve a possibly broken state.
        match self.state.lock() {
            Ok(g) => g,
            Err(_) => {
                tracing::error!("internal inconsistency (poisoned state); exiting");
                std::process::exit(70);
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
}

impl<B: ServerBackend> State<B> {
    /// Applies an outcome: answers handshakes, releases memory, logs the transition.
    fn dispatch(&mut self, out: Outcome<B::Handle>, before: &'static str, why: &str) {
        for (session, answer) in out.answers {
            if let Some(tx) = self.pending.remove(&session) {
                let _ = tx.send(answer);
            }
        }
        let released = out.released.len();
        for h in out.released {
            self.backend.release(h);
        }
        let after = self.core.lock().state().as_str();
        if before != after || released > 0 {
            info!(
                from = before,
                to = after,
                cause = why,
                released,
                allocations = self.core.allocation_count(),
                "gms state transition"
            );
        }
    }
}

/// Serves until `shutdown` resolves. Releases every allocation and unlinks the socket on
/// the way out.
pub async fn serve<B: ServerBackend>(
    listener: UnixListener,
    socket: PathBuf,
    backend: B,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            core: GmsCore::new(backend.granularity()),
            backend,
            pending: HashMap::new(),
        }),
        start: Instant::now(),
    });
    info!(socket = %socket.display(), "gmsd listening");
    let mut next_session: SessionId = 0;
    tokio::pin!(shutdown);
    let result = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    next_session += 1;
                    let shared = shared.clone();
                    let session = next_session;
                    tokio::spawn(async move { connection(shared, stream, session).await });
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    if matches!(
                        e.raw_os_error().map(nix::errno::Errno::from_raw),
                        Some(nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE)
                    ) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    break Err(ServerError::Accept(e));
                }
            }
        }
    };
    let _ = std::fs::remove_file(&socket);
    let mut st = shared.lock();
    let handles = st.core.drain_handles();
    for h in handles {
        st.backend.release(h);
    }
    info!("gmsd stopped");
    result
}

fn error(code: i64, error: impl ToString) -> Message {
    Message::ErrorResponse {
        error: error.to_string(),
        code,
    }
}

fn core_error(e: CoreError) -> Message {
    let code = match &e {
        CoreError::Lock(LockError::AlreadyHandshaken) => codes::CONFLICT,
        CoreError::Lock(_) => codes::FORBIDDEN,
        CoreError::NotFound(_) => codes::NOT_FOUND,
        CoreError::BadRequest(_) => codes::BAD_REQUEST,
    };
    error(code, e)
}

fn backend_error(e: BackendError) -> Message {
    let code = match e {
        BackendError::OutOfMemory(_) => codes::OUT_OF_MEMORY,
        _ => codes::INTERNAL,
    };
    error(code, e)
}

fn new_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// What the request loop does after answering.
enum Next {
    Continue,
    Close,
}

/// Ends a session in the core when its task ends, however it ends (a panic included), so
/// that no lock or waiter outlives its connection.
struct SessionGuard<B: ServerBackend> {
    /// The server state.
    shared: Arc<Shared<B>>,
    /// The session to end.
    session: SessionId,
}

impl<B: ServerBackend> Drop for SessionGuard<B> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.pending.remove(&self.session);
        let before = st.core.lock().state().as_str();
        let out = st.core.disconnect(self.session);
        st.dispatch(out, before, "disconnect");
        debug!(session = self.session, "connection closed");
    }
}

async fn connection<B: ServerBackend>(
    shared: Arc<Shared<B>>,
    stream: UnixStream,
    session: SessionId,
) {
    let _guard = SessionGuard {
        shared: shared.clone(),
        session,
    };
    let mut conn = FramedStream::new(stream);
    debug!(session, "connection opened");
    if let Err(e) = request_loop(&shared, &mut conn, session).await {
        debug!(session, error = %e, "connection ended with error");
    }
}

async fn request_loop<B: ServerBackend>(
    shared: &Shared<B>,
    conn: &mut FramedStream,
    session: SessionId,
) -> Result<(), WireError> {
    let mut granted: Option<GrantedLockType> = None;
    loop {
        let msg = match conn.recv().await {
            Ok(Some((m, _fd))) => m, // clients send no fds; any received are closed
            Ok(None) => return Ok(()),
            Err(WireError::Decode(e)) => {
                conn.send(&error(codes::BAD_REQUEST, e), None).await?;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        match handle(shared, conn, session, &mut granted, msg).await? {
            Next::Continue => {}
            Next::Close => return Ok(()),
        }
    }
}

async fn handle<B: ServerBackend>(
    shared: &Shared<B>,
    conn: &mut FramedStream,
    session: SessionId,
    granted: &mut Option<GrantedLockType>,
    msg: Message,
) -> Result<Next, WireError> {
    use Message as M;
    // Diagnostics: answered at any time, never take a lock.
    match &msg {
        M::GetRuntimeStateRequest => {
            let rs = shared.lock().core.runtime_state();
            conn.send(&M::GetRuntimeStateResponse(rs), None).await?;
            return Ok(Next::Continue);
        }
        M::GetEventHistoryRequest => {
            let events = shared.lock().core.events();
            conn.send(&M::GetEventHistoryResponse { events }, None)
                .await?;
            return Ok(Next::Continue);
        }
        M::HandshakeRequest {
            lock_type,
            timeout_ms,
        } => {
            return handshake(shared, conn, session, granted, *lock_type, *timeout_ms).await;
        }
        _ => {}
    }
    if granted.is_none() {
        // As Dynamo's server: anything but a handshake first is refused and closed.
        conn.send(
            &error(codes::BAD_REQUEST, "expected handshake_request"),
            None,
        )
        .await?;
        return Ok(Next::Close);
    }
    let reply: Result<(Message, Option<std::os::fd::OwnedFd>, Next), Message> = {
        let mut st = shared.lock();
        let st = &mut *st;
        match msg {
            M::CommitRequest => {
                let before = st.core.lock().state().as_str();
                match st.core.commit(session) {
                    Ok((hash, out)) => {
                        st.dispatch(out, before, "commit");
                        info!(session, hash = %hash, "committed");
                        // The commit ends the writer's session: answer, then close.
                        Ok((M::CommitResponse { success: true }, None, Next::Close))
                    }
                    Err(e) => Err(core_error(e)),
                }
            }
            M::CommitLayoutRequest => {
                let before = st.core.lock().state().as_str();
                match st.core.commit_layout(session) {
                    Ok((hash, mode)) => {
                        st.dispatch(Outcome::default(), before, "commit_layout");
                        *granted = Some(mode);
                        info!(session, hash = %hash, "layout committed");
                        Ok((
                            M::CommitLayoutResponse {
                                success: true,
                                memory_layout_hash: hash,
                                granted_lock_type: Some(mode),
                            },
                            None,
                            Next::Continue,
                        ))
                    }
                    Err(e) => Err(core_error(e)),
                }
            }
            M::GetLockStateRequest => st
                .core
                .lock_state(session)
                .map(|s| (M::GetLockStateResponse(s), None, Next::Continue))
                .map_err(core_error),
            M::GetMemoryLayoutHashRequest => st
                .core
                .committed_hash(session)
                .map(|h| {
                    (
                        M::GetMemoryLayoutHashResponse {
                            memory_layout_hash: h,
                        },
                        None,
                        Next::Continue,
                    )
                })
                .map_err(core_error),
            M::GetAllocationStateRequest => st
                .core
                .allocation_state(session)
                .map(|n| {
                    (
                        M::GetAllocationStateResponse {
                            allocation_count: n,
                        },
                        None,
                        Next::Continue,
                    )
                })
                .map_err(core_error),
            M::AllocateRequest { size, tag } => match st.core.check_allocate(session, size) {
                Err(e) => Err(core_error(e)),
                Ok(aligned) => match st.backend.create(aligned) {
                    Err(e) => {
                        if matches!(e, BackendError::OutOfMemory(_)) {
                            st.core.record_oom();
                        }
                        warn!(session, size, error = %e, "allocation failed");
                        Err(backend_error(e))
                    }
                    Ok(h) => {
                        let info = st.core.insert_allocation(new_uuid(), size, aligned, tag, h);
                        Ok((
                            M::AllocateResponse {
                                allocation_id: info.allocation_id,
                                size: info.size,
                                aligned_size: info.aligned_size,
                                layout_slot: info.layout_slot,
                            },
                            None,
                            Next::Continue,
                        ))
                    }
                },
            },
            M::ExportAllocationRequest { allocation_id } => {
                match st.core.get(session, &allocation_id) {
                    Err(e) => Err(core_error(e)),
                    Ok(rec) => {
                        let read_only = *granted == Some(GrantedLockType::Ro);
                        match st.backend.export(&rec.handle, read_only) {
                            Ok(fd) => Ok((
                                M::ExportAllocationResponse(rec.info.clone()),
                                Some(fd),
                                Next::Continue,
                            )),
                            Err(e) => Err(backend_error(e)),
                        }
                    }
                }
            }
            M::GetAllocationRequest { allocation_id } => st
                .core
                .get(session, &allocation_id)
                .map(|r| {
                    (
                        M::GetAllocationResponse(r.info.clone()),
                        None,
                        Next::Continue,
                    )
                })
                .map_err(core_error),
            M::ListAllocationsRequest { tag } => st
                .core
                .list(session, tag.as_deref())
                .map(|allocations| {
                    (
                        M::ListAllocationsResponse { allocations },
                        None,
                        Next::Continue,
                    )
                })
                .map_err(core_error),
            M::FreeAllocationRequest { allocation_id } => {
                match st.core.free(session, &allocation_id) {
                    Ok(h) => {
                        let success = h.is_some();
                        if let Some(h) = h {
                            st.backend.release(h);
                        }
                        Ok((M::FreeAllocationResponse { success }, None, Next::Continue))
                    }
                    Err(e) => Err(core_error(e)),
                }
            }
            M::MetadataPutRequest {
                key,
                allocation_id,
                offset_bytes,
                value,
            } => st
                .core
                .metadata_put(session, key, allocation_id, offset_bytes, value)
                .map(|()| {
                    (
                        M::MetadataPutResponse { success: true },
                        None,
                        Next::Continue,
                    )
                })
                .map_err(core_error),
            M::MetadataGetRequest { key } => st
                .core
                .metadata_get(session, &key)
                .map(|e| {
                    let reply = match e {
                        Some(e) => M::MetadataGetResponse {
                            found: true,
                            allocation_id: Some(e.allocation_id.clone()),
                            offset_bytes: Some(e.offset_bytes),
                            value: Some(e.value.clone()),
                        },
                        None => M::MetadataGetResponse {
                            found: false,
                            allocation_id: None,
                            offset_bytes: None,
                            value: None,
                        },
                    };
                    (reply, None, Next::Continue)
                })
                .map_err(core_error),
            M::MetadataDeleteRequest { key } => st
                .core
                .metadata_delete(session, &key)
                .map(|deleted| (M::MetadataDeleteResponse { deleted }, None, Next::Continue))
                .map_err(core_error),
            M::MetadataListRequest { prefix } => st
                .core
                .metadata_list(session, &prefix)
                .map(|keys| (M::MetadataListResponse { keys }, None, Next::Continue))
                .map_err(core_error),
            other => Err(error(
                codes::BAD_REQUEST,
                format!("unexpected message {}", other.tag()),
            )),
        }
    };
    match reply {
        Ok((m, fd, next)) => {
            conn.send(&m, fd.as_ref().map(|f| f.as_fd())).await?;
            Ok(next)
        }
        Err(m) => {
            conn.send(&m, None).await?;
            Ok(Next::Continue)
        }
    }
}

async fn handshake<B: ServerBackend>(
    shared: &Shared<B>,
    conn: &mut FramedStream,
    session: SessionId,
    granted: &mut Option<GrantedLockType>,
    lock_type: crate::protocol::RequestedLockType,
    timeout_ms: Option<u64>,
) -> Result<Next, WireError> {
    let (tx, mut rx) = oneshot::channel();
    let (deadline_ms, refused) = {
        let mut st = shared.lock();
        let now = shared.now_ms();
        st.pending.insert(session, tx);
        let before = st.core.lock().state().as_str();
        let refused = match st.core.handshake(session, lock_type, timeout_ms, now) {
            Ok(out) => {
                st.dispatch(out, before, "handshake");
                None
            }
            Err(e) => {
                st.pending.remove(&session);
                Some(core_error(e))
            }
        };
        (timeout_ms.map(|t| now.saturating_add(t)), refused)
    };
    if let Some(reply) = refused {
        conn.send(&reply, None).await?;
        return Ok(Next::Continue);
    }
    debug!(session, %lock_type, ?timeout_ms, "handshake");
    // Far-future stand-in when there is no deadline (the branch is disabled then).
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let mut sleep_at = deadline_ms
        .and_then(|d| shared.start.checked_add(Duration::from_millis(d)))
        .map(|t| t.min(far))
        .unwrap_or(far);
    let answer = loop {
        tokio::select! {
            r = &mut rx => break r.ok().flatten(),
            _ = tokio::time::sleep_until(sleep_at), if deadline_ms.is_some() => {
                let mut st = shared.lock();
                let before = st.core.lock().state().as_str();
                let out = st.core.expire(shared.now_ms());
                st.dispatch(out, before, "handshake timeout");
                // Normally our own answer is in rx now; re-check shortly otherwise.
                sleep_at = Instant::now() + Duration::from_millis(1);
            }
            r = conn.fill() => {
                // Bytes are kept for after the grant; EOF or error = the waiter left.
                match r {
                    Ok(0) | Err(_) => return Ok(Next::Close),
                    Ok(_) => {}
                }
            }
        }
    };
    let committed = shared.lock().core.lock().committed();
    match answer {
        Some(mode) => {
            *granted = Some(mode);
            info!(session, %lock_type, granted = %mode, "lock granted");
            conn.send(
                &Message::HandshakeResponse {
                    success: true,
                    committed,
                    granted_lock_type: Some(mode),
                },
                None,
            )
            .await?;
            Ok(Next::Continue)
        }
        None => {
            info!(session, %lock_type, ?timeout_ms, "handshake timed out");
            conn.send(
                &Message::HandshakeResponse {
                    success: false,
                    committed,
                    granted_lock_type: None,
                },
                None,
            )
            .await?;
            Ok(Next::Close)
        }
    }
}
