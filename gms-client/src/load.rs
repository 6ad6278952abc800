//! A reference writer (used by `gmsctl load`, tests and the benchmark): allocates, fills
//! the bytes with a known pattern through a read-write mapping (host backend), puts one
//! metadata entry per allocation (a vLLM-like JSON), and commits.

use std::io::Write;
use std::time::Duration;

use serde::Serialize;

use crate::backend::{Access, HostBackend};
use crate::client::{ClientError, GmsClient};
use crate::protocol::{AllocationInfo, GrantedLockType, RequestedLockType};

/// What to write.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Allocations.
    pub count: u64,
    /// Bytes each.
    pub size: u64,
    /// Their tag.
    pub tag: String,
    /// Fill the bytes with [`pattern_byte`].
    pub fill: bool,
}

/// The result printed by `gmsctl load`.
#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    /// What the handshake granted.
    pub granted: Option<GrantedLockType>,
    /// Committed (false with --no-commit or when the lock came as ro).
    pub committed: bool,
    /// Allocations written.
    pub allocations: u64,
    /// Hash the server reports after commit (via a fresh read session), if committed.
    pub memory_layout_hash: Option<String>,
}

/// Failures of the writer.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Client failure.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Lock not granted.
    #[error("lock not granted within the timeout")]
    NotGranted,
    /// Mapping failure.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

/// Byte `offset` of allocation `slot` in the test pattern.
pub fn pattern_byte(slot: u64, offset: u64) -> u8 {
    ((slot.wrapping_mul(31) + offset) % 251) as u8
}

/// Metadata key of allocation `i`.
pub fn tensor_key(i: u64) -> String {
    format!("model.layers.{i}.weight")
}

/// Allocates and fills one allocation; returns its info.
pub async fn write_one(
    c: &mut GmsClient,
    i: u64,
    spec: &LoadSpec,
) -> Result<AllocationInfo, LoadError> {
    let a = c.allocate(spec.size, &spec.tag).await?;
    if spec.fill {
        let (_, fd) = c.export(&a.allocation_id).await?;
        let mut m = HostBackend::map(&fd, a.aligned_size, Access::ReadWrite)?;
        if let Some(b) = crate::backend::Mapping::host_bytes_mut(&mut m) {
            for (off, x) in b.iter_mut().enumerate().take(spec.size as usize) {
                *x = pattern_byte(a.layout_slot, off as u64);
            }
        }
    }
    let meta = format!(
        "{{\"shape\":[{}],\"dtype\":\"uint8\",\"stride\":[1],\"slot\":{}}}",
        spec.size, a.layout_slot
    );
    c.metadata_put(&tensor_key(i), &a.allocation_id, 0, meta.as_bytes())
        .await?;
    Ok(a)
}

/// Runs the writer on an open connection.
pub async fn load(
    c: &mut GmsClient,
    lock: RequestedLockType,
    timeout: Duration,
    spec: &LoadSpec,
    hold: Duration,
    commit: bool,
) -> Result<LoadResult, LoadError> {
    let hs = c.handshake(lock, Some(timeout)).await?;
    if !hs.success {
        return Err(LoadError::NotGranted);
    }
    if hs.granted == Some(GrantedLockType::Ro) {
        return Ok(LoadResult {
            granted: hs.granted,
            committed: false,
            allocations: 0,
            memory_layout_hash: None,
        });
    }
    for i in 0..spec.count {
        write_one(c, i, spec).await?;
    }
    println!("{{\"event\":\"allocated\",\"allocations\":{}}}", spec.count);
    let _ = std::io::stdout().flush();
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    if !commit {
        return Ok(LoadResult {
            granted: hs.granted,
            committed: false,
            allocations: spec.count,
            memory_layout_hash: None,
        });
    }
    let ok = c.commit().await?;
    Ok(LoadResult {
        granted: hs.granted,
        committed: ok,
        allocations: spec.count,
        memory_layout_hash: None,
    })
}
