//! `gmsctl verify`: proves that the committed weights in a GMS are importable.
//!
//! Steps (each failure has its own [`FailureKind`] and exit code):
//! 1. connect (bounded) and read the runtime state: nothing committed → fail at once;
//! 2. take a read lock with a finite timeout;
//! 3. list allocations and every metadata entry; counts must agree, every metadata entry
//!    must point inside an existing allocation;
//! 4. recompute the layout hash on the client from allocations + metadata and compare it
//!    with the server's (and with `--expect-hash` when given);
//! 5. export every allocation and import it through the memory backend (host: mmap of the
//!    memfd, whose size must cover aligned_size; cuda: VMM import + read-only map); the
//!    export's size/aligned_size/tag/layout_slot must equal the listing's;
//! 6. on cuda: free device memory must not drop by more than the mapping overhead while
//!    everything is imported (the memory is shared, not copied).

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::backend::{open_client_backend, Access, BackendError, BackendKind};
use crate::client::{ClientError, ConnectOptions, GmsClient};
use crate::core::{layout_hash, MetaEntry};
use crate::protocol::RequestedLockType;

/// Options of `gmsctl verify`.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Bound of the connection attempts and of the read-lock wait.
    pub timeout: Duration,
    /// Import backend.
    pub backend: BackendKind,
    /// CUDA device (cuda backend).
    pub device: u32,
    /// Hash the caller expects (e.g. remembered before a restart); mismatch = stale layout.
    pub expect_hash: Option<String>,
    /// Largest drop of device free memory accepted while importing (cuda).
    pub max_import_overhead: u64,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            backend: BackendKind::Host,
            device: 0,
            expect_hash: None,
            max_import_overhead: 64 << 20,
        }
    }
}

/// Why verification failed (and the process exit code for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// No GMS answered / it closed the connection. Exit 3.
    Unreachable,
    /// Nothing committed. Exit 4.
    NotCommitted,
    /// Read lock not granted within the timeout. Exit 5.
    LockTimeout,
    /// Recomputed (or expected) layout hash differs from the server's. Exit 6.
    HashMismatch,
    /// Counts, sizes, tags, slots or metadata targets disagree. Exit 7.
    AllocationMismatch,
    /// An allocation could not be imported (e.g. truncated). Exit 8.
    ImportFailed,
    /// Device free memory dropped by more than the mapping overhead (copied, not shared). Exit 9.
    MemoryCopied,
    /// The server answered something unexpected. Exit 10.
    Protocol,
    /// The import backend is unavailable (e.g. no CUDA driver). Exit 11.
    BackendUnavailable,
}

impl FailureKind {
    /// Process exit code (documented in README and `gmsctl --help`).
    pub fn exit_code(self) -> i32 {
        match self {
            Self::Unreachable => 3,
            Self::NotCommitted => 4,
            Self::LockTimeout => 5,
            Self::HashMismatch => 6,
            Self::AllocationMismatch => 7,
            Self::ImportFailed => 8,
            Self::MemoryCopied => 9,
            Self::Protocol => 10,
            Self::BackendUnavailable => 11,
        }
    }
}

/// The JSON verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Everything checked out.
    pub ok: bool,
    /// Failure class.
    pub failure: Option<FailureKind>,
    /// Human-readable reason.
    pub reason: Option<String>,
    /// Import backend used.
    pub backend: BackendKind,
    /// Server state before the lock was taken.
    pub state: Option<String>,
    /// Allocations verified.
    pub allocations: u64,
    /// Sum of aligned sizes imported.
    pub total_bytes: u64,
    /// Metadata entries checked.
    pub metadata_entries: usize,
    /// Hash the server reports.
    pub server_hash: Option<String>,
    /// Hash recomputed here.
    pub computed_hash: Option<String>,
    /// Device free memory before importing (cuda).
    pub free_before: Option<u64>,
    /// Device free memory with everything imported (cuda).
    pub free_after: Option<u64>,
    /// Wall time.
    pub elapsed_ms: f64,
}

struct Fail(FailureKind, String);

fn client_fail(e: ClientError) -> Fail {
    match e {
        ClientError::Connect { .. } | ClientError::Closed => {
            Fail(FailureKind::Unreachable, e.to_string())
        }
        ClientError::Wire(crate::wire::WireError::Io(_) | crate::wire::WireError::Closed) => {
            Fail(FailureKind::Unreachable, e.to_string())
        }
        ClientError::Timeout { .. } => Fail(FailureKind::LockTimeout, e.to_string()),
        _ => Fail(FailureKind::Protocol, e.to_string()),
    }
}

/// Runs the verification; never panics, always returns a verdict.
pub async fn verify(socket: &Path, opts: &VerifyOptions) -> Verdict {
    let start = Instant::now();
    let mut v = Verdict {
        ok: false,
        failure: None,
        reason: None,
        backend: opts.backend,
        state: None,
        allocations: 0,
        total_bytes: 0,
        metadata_entries: 0,
        server_hash: None,
        computed_hash: None,
        free_before: None,
        free_after: None,
        elapsed_ms: 0.0,
    };
    let r = run(socket, opts, &mut v).await;
    v.elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    match r {
        Ok(()) => v.ok = true,
        Err(Fail(kind, reason)) => {
            v.failure = Some(kind);
            v.reason = Some(reason);
        }
    }
    v
}

async fn run(socket: &Path, opts: &VerifyOptions, v: &mut Verdict) -> Result<(), Fail> {
    let copts = ConnectOptions {
        connect_timeout: opts.timeout,
        retry_interval: Duration::from_millis(50),
        rpc_timeout: opts.timeout.max(Duration::from_secs(5)),
    };
    let mut c = GmsClient::connect(socket, copts)
        .await
        .map_err(client_fail)?;
    let rs = c.runtime_state().await.map_err(client_fail)?;
    v.state = Some(rs.state.clone());
    if !rs.committed {
        return Err(Fail(
            FailureKind::NotCommitted,
            format!(
                "nothing committed (state {}, {} allocations)",
                rs.state, rs.allocation_count
            ),
        ));
    }
    let hs = c
        .handshake(RequestedLockType::Ro, Some(opts.timeout))
        .await
        .map_err(client_fail)?;
    if !hs.success {
        return Err(if hs.committed {
            Fail(
                FailureKind::LockTimeout,
                format!("read lock not granted within {:?}", opts.timeout),
            )
        } else {
            Fail(
                FailureKind::NotCommitted,
                "contents no longer committed".into(),
            )
        });
    }
    let server_hash = c.memory_layout_hash().await.map_err(client_fail)?;
    v.server_hash = Some(server_hash.clone());
    if server_hash.is_empty() {
        return Err(Fail(
            FailureKind::NotCommitted,
            "server reports no committed layout hash".into(),
        ));
    }
    let count = c.allocation_count().await.map_err(client_fail)?;
    let allocs = c.list_allocations(None).await.map_err(client_fail)?;
    if allocs.len() as u64 != count {
        return Err(Fail(
            FailureKind::AllocationMismatch,
            format!(
                "server counts {count} allocations but lists {}",
                allocs.len()
            ),
        ));
    }
    let keys = c.metadata_list("").await.map_err(client_fail)?;
    let entries = c.metadata_get_many(&keys).await.map_err(client_fail)?;
    let mut meta: Vec<(&str, MetaEntry)> = Vec::with_capacity(keys.len());
    for (k, e) in keys.iter().zip(entries) {
        let e = e.ok_or_else(|| {
            Fail(
                FailureKind::Protocol,
                format!("metadata key {k:?} listed but not found"),
            )
        })?;
        let Some(a) = allocs.iter().find(|a| a.allocation_id == e.allocation_id) else {
            return Err(Fail(
                FailureKind::AllocationMismatch,
                format!(
                    "metadata {k:?} points at missing allocation {}",
                    e.allocation_id
                ),
            ));
        };
        if e.offset_bytes >= a.aligned_size {
            return Err(Fail(
                FailureKind::AllocationMismatch,
                format!(
                    "metadata {k:?} offset {} outside allocation {} ({} bytes)",
                    e.offset_bytes, a.allocation_id, a.aligned_size
                ),
            ));
        }
        meta.push((k.as_str(), e));
    }
    v.metadata_entries = meta.len();
    let computed = layout_hash(allocs.iter(), meta.iter().map(|(k, e)| (*k, e)))
        .map_err(|e| Fail(FailureKind::AllocationMismatch, e.to_string()))?;
    v.computed_hash = Some(computed.clone());
    if computed != server_hash {
        return Err(Fail(
            FailureKind::HashMismatch,
            format!("layout hash mismatch: server {server_hash}, recomputed from allocations and metadata {computed}"),
        ));
    }
    if let Some(exp) = &opts.expect_hash {
        if *exp != server_hash {
            return Err(Fail(
                FailureKind::HashMismatch,
                format!("layout changed: expected hash {exp}, server has {server_hash}"),
            ));
        }
    }
    let backend = open_client_backend(opts.backend, opts.device).map_err(|e| {
        Fail(
            FailureKind::BackendUnavailable,
            format!("{:?} backend: {e}", opts.backend),
        )
    })?;
    let mem_err = |e: BackendError| Fail(FailureKind::BackendUnavailable, e.to_string());
    let before = backend.mem_info().map_err(mem_err)?;
    v.free_before = before.map(|m| m.free);
    let mut mappings = Vec::with_capacity(allocs.len());
    for a in &allocs {
        if a.aligned_size < a.size {
            return Err(Fail(
                FailureKind::AllocationMismatch,
                format!(
                    "allocation {}: aligned_size {} < size {}",
                    a.allocation_id, a.aligned_size, a.size
                ),
            ));
        }
        let (info, fd) = c.export(&a.allocation_id).await.map_err(client_fail)?;
        if info != *a {
            return Err(Fail(
                FailureKind::AllocationMismatch,
                format!(
                    "allocation {}: export says {info:?}, listing says {a:?}",
                    a.allocation_id
                ),
            ));
        }
        let m = backend
            .import(fd, a.aligned_size, Access::ReadOnly)
            .map_err(|e| {
                Fail(
                    FailureKind::ImportFailed,
                    format!(
                        "allocation {} (slot {}, tag {}): {e}",
                        a.allocation_id, a.layout_slot, a.tag
                    ),
                )
            })?;
        if m.len() != a.aligned_size {
            return Err(Fail(
                FailureKind::ImportFailed,
                format!(
                    "allocation {}: mapped {} bytes, expected {}",
                    a.allocation_id,
                    m.len(),
                    a.aligned_size
                ),
            ));
        }
        v.total_bytes += a.aligned_size;
        mappings.push(m);
    }
    v.allocations = allocs.len() as u64;
    let after = backend.mem_info().map_err(mem_err)?;
    v.free_after = after.map(|m| m.free);
    if let (Some(b), Some(a)) = (before, after) {
        let drop = b.free.saturating_sub(a.free);
        if drop > opts.max_import_overhead {
            return Err(Fail(
                FailureKind::MemoryCopied,
                format!(
                    "device free memory dropped by {drop} bytes while importing {} bytes (limit {}): memory was not shared",
                    v.total_bytes, opts.max_import_overhead
                ),
            ));
        }
    }
    drop(mappings);
    Ok(())
}
