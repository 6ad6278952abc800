//! Async GMS client (tokio): connect-and-retry (bounded), every RPC, a bounded wait on
//! every answer. The handshake waits as long as its own `timeout` (plus a small margin
//! for the answer to travel); supervisor paths always pass a finite timeout.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::time::Instant;

use crate::core::MetaEntry;
use crate::protocol::{
    AllocationInfo, GrantedLockType, LockStateInfo, Message, RequestedLockType, RuntimeEvent,
    RuntimeState,
};
use crate::wire::{FramedStream, WireError};

/// How long the answer to a timed handshake may lag behind the handshake's own timeout.
pub const HANDSHAKE_ANSWER_MARGIN: Duration = Duration::from_secs(2);

/// Client options.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Total time to keep retrying the connection (the GMS may be starting).
    pub connect_timeout: Duration,
    /// Pause between connection attempts.
    pub retry_interval: Duration,
    /// Longest wait for the answer to any RPC but a handshake.
    pub rpc_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_millis(50),
            rpc_timeout: Duration::from_secs(30),
        }
    }
}

/// Client failures; each names its cause.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No GMS answered on the socket within the connect timeout.
    #[error("cannot connect to GMS at {path} within {waited:?}: {last}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// How long we tried.
        waited: Duration,
        /// The last connect error.
        last: std::io::Error,
    },
    /// Transport or protocol failure.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The GMS closed the connection ("GMS gone").
    #[error("GMS closed the connection")]
    Closed,
    /// No answer in time.
    #[error("no answer to {what} within {after:?}")]
    Timeout {
        /// The request.
        what: &'static str,
        /// The wait.
        after: Duration,
    },
    /// The server answered error_response.
    #[error("GMS error {code}: {error}")]
    Server {
        /// Its text.
        error: String,
        /// Its code.
        code: i64,
    },
    /// The server answered with the wrong message.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What we wanted.
        expected: &'static str,
        /// What came.
        got: &'static str,
    },
    /// An export answer came without its fd.
    #[error("export_allocation_response arrived without a file descriptor")]
    MissingFd,
}

/// The answer to a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeOutcome {
    /// Lock granted.
    pub success: bool,
    /// Contents were committed when the server answered.
    pub committed: bool,
    /// Granted mode.
    pub granted: Option<GrantedLockType>,
}

/// One GMS session (one connection).
#[derive(Debug)]
pub struct GmsClient {
    /// The framed socket.
    conn: FramedStream,
    /// Timeouts.
    opts: ConnectOptions,
    /// Mode held after a successful handshake.
    granted: Option<GrantedLockType>,
}

macro_rules! expect {
    ($msg:expr, $pat:pat => $out:expr, $name:literal) => {
        match $msg {
            $pat => Ok($out),
            other => Err(ClientError::Unexpected {
                expected: $name,
                got: other.tag(),
            }),
        }
    };
}

impl GmsClient {
    /// Connects, retrying until `opts.connect_timeout` has passed.
    pub async fn connect(path: &Path, opts: ConnectOptions) -> Result<Self, ClientError> {
        let start = Instant::now();
        loop {
            let attempt =
                tokio::time::timeout(opts.connect_timeout, UnixStream::connect(path)).await;
            let err = match attempt {
                Ok(Ok(stream)) => {
                    return Ok(Self {
                        conn: FramedStream::new(stream),
                        opts,
                        granted: None,
                    })
                }
                Ok(Err(e)) => e,
                Err(_) => std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            };
            let waited = start.elapsed();
            if waited + opts.retry_interval > opts.connect_timeout {
                return Err(ClientError::Connect {
                    path: path.to_path_buf(),
                    waited,
                    last: err,
                });
            }
            tokio::time::sleep(opts.retry_interval).await;
        }
    }

    /// The mode held, if any.
    pub fn granted(&self) -> Option<GrantedLockType> {
        self.granted
    }

    async fn recv_within(
        &mut self,
        what: &'static str,
        limit: Option<Duration>,
    ) -> Result<(Message, Option<OwnedFd>), ClientError> {
        let fut = self.conn.recv();
        let got = match limit {
            Some(limit) => tokio::time::timeout(limit, fut)
                .await
                .map_err(|_| ClientError::Timeout { what, after: limit })?,
            None => fut.await,
        };
        match got? {
            None => Err(ClientError::Closed),
            Some((Message::ErrorResponse { error, code }, _)) => {
                Err(ClientError::Server { error, code })
            }
            Some(r) => Ok(r),
        }
    }

    /// Sends a request and waits (at most `rpc_timeout`) for its answer.
    pub async fn call(&mut self, req: &Message) -> Result<(Message, Option<OwnedFd>), ClientError> {
        self.conn.send(req, None).await?;
        let limit = self.opts.rpc_timeout;
        self.recv_within(req.tag(), Some(limit)).await
    }

    async fn call_msg(&mut self, req: Message) -> Result<Message, ClientError> {
        Ok(self.call(&req).await?.0)
    }

    /// Handshake. With `Some(timeout)` the server denies after it and we stop waiting
    /// shortly after; `None` waits forever (never used on supervisor paths).
    pub async fn handshake(
        &mut self,
        lock_type: RequestedLockType,
        timeout: Option<Duration>,
    ) -> Result<HandshakeOutcome, ClientError> {
        let timeout_ms = timeout.map(|t| t.as_millis().min(u128::from(u64::MAX)) as u64);
        self.conn
            .send(
                &Message::HandshakeRequest {
                    lock_type,
                    timeout_ms,
                },
                None,
            )
            .await?;
        let limit = timeout.map(|t| t.saturating_add(HANDSHAKE_ANSWER_MARGIN));
        let (m, _) = self.recv_within("handshake_request", limit).await?;
        let out = expect!(m, Message::HandshakeResponse { success, committed, granted_lock_type } =>
            HandshakeOutcome { success, committed, granted: granted_lock_type }, "handshake_response")?;
        if out.success {
            self.granted = out.granted;
        }
        Ok(out)
    }

    /// `get_runtime_state` (no lock needed).
    pub async fn runtime_state(&mut self) -> Result<RuntimeState, ClientError> {
        let m = self.call_msg(Message::GetRuntimeStateRequest).await?;
        expect!(m, Message::GetRuntimeStateResponse(s) => s, "get_runtime_state_response")
    }

    /// `get_event_history` (no lock needed).
    pub async fn event_history(&mut self) -> Result<Vec<RuntimeEvent>, ClientError> {
        let m = self.call_msg(Message::GetEventHistoryRequest).await?;
        expect!(m, Message::GetEventHistoryResponse { events } => events, "get_event_history_response")
    }

    /// `get_lock_state`.
    pub async fn lock_state(&mut self) -> Result<LockStateInfo, ClientError> {
        let m = self.call_msg(Message::GetLockStateRequest).await?;
        expect!(m, Message::GetLockStateResponse(s) => s, "get_lock_state_response")
    }

    /// `get_memory_layout_hash` (empty if not committed).
    pub async fn memory_layout_hash(&mut self) -> Result<String, ClientError> {
        let m = self.call_msg(Message::GetMemoryLayoutHashRequest).await?;
        expect!(m, Message::GetMemoryLayoutHashResponse { memory_layout_hash } => memory_layout_hash,
            "get_memory_layout_hash_response")
    }

    /// `get_allocation_state`.
    pub async fn allocation_count(&mut self) -> Result<u64, ClientError> {
        let m = self.call_msg(Message::GetAllocationStateRequest).await?;
        expect!(m, Message::GetAllocationStateResponse { allocation_count } => allocation_count,
            "get_allocation_state_response")
    }

    /// `allocate`.
    pub async fn allocate(&mut self, size: u64, tag: &str) -> Result<AllocationInfo, ClientError> {
        let m = self
            .call_msg(Message::AllocateRequest {
                size,
                tag: tag.to_string(),
            })
            .await?;
        expect!(m, Message::AllocateResponse { allocation_id, size, aligned_size, layout_slot } =>
            AllocationInfo { allocation_id, size, aligned_size, tag: tag.to_string(), layout_slot },
            "allocate_response")
    }

    /// `export_allocation`: the allocation and its fresh fd.
    pub async fn export(
        &mut self,
        allocation_id: &str,
    ) -> Result<(AllocationInfo, OwnedFd), ClientError> {
        let (m, fd) = self
            .call(&Message::ExportAllocationRequest {
                allocation_id: allocation_id.to_string(),
            })
            .await?;
        let info =
            expect!(m, Message::ExportAllocationResponse(a) => a, "export_allocation_response")?;
        Ok((info, fd.ok_or(ClientError::MissingFd)?))
    }

    /// `get_allocation`.
    pub async fn get_allocation(
        &mut self,
        allocation_id: &str,
    ) -> Result<AllocationInfo, ClientError> {
        let m = self
            .call_msg(Message::GetAllocationRequest {
                allocation_id: allocation_id.to_string(),
            })
            .await?;
        expect!(m, Message::GetAllocationResponse(a) => a, "get_allocation_response")
    }

    /// `list_allocations`.
    pub async fn list_allocations(
        &mut self,
        tag: Option<&str>,
    ) -> Result<Vec<AllocationInfo>, ClientError> {
        let m = self
            .call_msg(Message::ListAllocationsRequest {
                tag: tag.map(str::to_string),
            })
            .await?;
        expect!(m, Message::ListAllocationsResponse { allocations } => allocations, "list_allocations_response")
    }

    /// `free_allocation`.
    pub async fn free(&mut self, allocation_id: &str) -> Result<bool, ClientError> {
        let m = self
            .call_msg(Message::FreeAllocationRequest {
                allocation_id: allocation_id.to_string(),
            })
            .await?;
        expect!(m, Message::FreeAllocationResponse { success } => success, "free_allocation_response")
    }

    /// `metadata_put`.
    pub async fn metadata_put(
        &mut self,
        key: &str,
        allocation_id: &str,
        offset_bytes: u64,
        value: &[u8],
    ) -> Result<bool, ClientError> {
        let m = self
            .call_msg(Message::MetadataPutRequest {
                key: key.to_string(),
                allocation_id: allocation_id.to_string(),
                offset_bytes,
                value: value.to_vec(),
            })
            .await?;
        expect!(m, Message::MetadataPutResponse { success } => success, "metadata_put_response")
    }

    /// `metadata_get`: None when the key is absent.
    pub async fn metadata_get(&mut self, key: &str) -> Result<Option<MetaEntry>, ClientError> {
        let m = self
            .call_msg(Message::MetadataGetRequest {
                key: key.to_string(),
            })
            .await?;
        expect!(m, Message::MetadataGetResponse { found, allocation_id, offset_bytes, value } =>
            match (found, allocation_id, offset_bytes) {
                (true, Some(allocation_id), Some(offset_bytes)) => Some(MetaEntry {
                    allocation_id,
                    offset_bytes,
                    value: value.unwrap_or_default(),
                }),
                _ => None,
            }, "metadata_get_response")
    }

    /// Many `metadata_get`s pipelined on this connection (requests written back to back,
    /// answers read in order); no fds are involved, so pipelining is safe.
    pub async fn metadata_get_many(
        &mut self,
        keys: &[String],
    ) -> Result<Vec<Option<MetaEntry>>, ClientError> {
        const WINDOW: usize = 64;
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(WINDOW) {
            let mut frames = Vec::new();
            for k in chunk {
                frames.extend(Message::MetadataGetRequest { key: k.clone() }.encode_frame());
            }
            self.conn.send_frame(&frames, None).await?;
            for _ in chunk {
                let limit = self.opts.rpc_timeout;
                let (m, _) = self
                    .recv_within("metadata_get_request", Some(limit))
                    .await?;
                out.push(expect!(m, Message::MetadataGetResponse { found, allocation_id, offset_bytes, value } =>
                    match (found, allocation_id, offset_bytes) {
                        (true, Some(allocation_id), Some(offset_bytes)) => Some(MetaEntry {
                            allocation_id,
                            offset_bytes,
                            value: value.unwrap_or_default(),
                        }),
                        _ => None,
                    }, "metadata_get_response")?);
            }
        }
        Ok(out)
    }

    /// `metadata_delete`.
    pub async fn metadata_delete(&mut self, key: &str) -> Result<bool, ClientError> {
        let m = self
            .call_msg(Message::MetadataDeleteRequest {
                key: key.to_string(),
            })
            .await?;
        expect!(m, Message::MetadataDeleteResponse { deleted } => deleted, "metadata_delete_response")
    }

    /// `metadata_list`.
    pub async fn metadata_list(&mut self, prefix: &str) -> Result<Vec<String>, ClientError> {
        let m = self
            .call_msg(Message::MetadataListRequest {
                prefix: prefix.to_string(),
            })
            .await?;
        expect!(m, Message::MetadataListResponse { keys } => keys, "metadata_list_response")
    }

    /// `commit`. The server closes the session afterwards; mappings stay valid.
    pub async fn commit(&mut self) -> Result<bool, ClientError> {
        let m = self.call_msg(Message::CommitRequest).await?;
        let ok = expect!(m, Message::CommitResponse { success } => success, "commit_response")?;
        if ok {
            self.granted = None;
        }
        Ok(ok)
    }

    /// `commit_layout`: the sealed layout's hash; the session continues as `rw_data`.
    pub async fn commit_layout(&mut self) -> Result<String, ClientError> {
        let m = self.call_msg(Message::CommitLayoutRequest).await?;
        let (hash, g) = expect!(m, Message::CommitLayoutResponse { memory_layout_hash, granted_lock_type, .. } =>
            (memory_layout_hash, granted_lock_type), "commit_layout_response")?;
        if g.is_some() {
            self.granted = g;
        }
        Ok(hash)
    }

    /// Waits (bounded) until the server closes this connection; true if it did.
    pub async fn wait_closed(&mut self, limit: Duration) -> bool {
        matches!(
            tokio::time::timeout(limit, self.conn.recv()).await,
            Ok(Ok(None)) | Ok(Err(_))
        )
    }

    /// Sends raw bytes (tests: hostile input).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.conn.send_frame(bytes, None).await.map_err(Into::into)
    }

    /// Reads the next message (tests).
    pub async fn recv_raw(&mut self, limit: Duration) -> Result<Message, ClientError> {
        Ok(self.recv_within("raw", Some(limit)).await?.0)
    }
}
