//! GMS wire protocol: every message of `docs/GMS-WIRE.md`, encoded and decoded
//! byte for byte as Dynamo's reference encoder (msgspec) does.
//!
//! * A frame is a 4-byte big-endian length followed by a msgpack map.
//! * The map carries the message tag under `"type"`, written first; the other fields follow
//!   in the order the spec lists them; absent optionals are written as nil; bytes as bin.
//! * The decoder accepts keys in any order, ignores unknown keys, and never panics: every
//!   length is checked against the bytes that remain, nesting depth is bounded, and a frame
//!   longer than [`MAX_FRAME_LEN`] is refused before anything is allocated for it.

use std::fmt;

use rmp::Marker;
use serde::Serialize;

/// Largest frame body this crate accepts or sends (16 MiB). A list of 100,000 allocations
/// is about 15 MiB, far beyond any real model; anything longer is hostile or corrupt.
pub const MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// Receive buffer for one `recvmsg` call (the spec's 64 KiB).
pub const RECV_BUFFER_LEN: usize = 64 * 1024;

/// Deepest nesting of arrays/maps the decoder follows (the protocol needs 3).
pub const MAX_DEPTH: usize = 16;

/// Lock type a client asks for in `handshake_request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestedLockType {
    /// Exclusive writer that replaces the whole store.
    Rw,
    /// Shared reader of committed contents.
    Ro,
    /// Reader if contents are committed, writer if nothing is, else wait.
    RwOrRo,
    /// Writer; `rw_data` (bytes only) when a sealed layout exists, else `rw`.
    RwDataOrRw,
}

impl RequestedLockType {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rw => "rw",
            Self::Ro => "ro",
            Self::RwOrRo => "rw_or_ro",
            Self::RwDataOrRw => "rw_data_or_rw",
        }
    }

    /// Parses the wire spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "rw" => Self::Rw,
            "ro" => Self::Ro,
            "rw_or_ro" => Self::RwOrRo,
            "rw_data_or_rw" => Self::RwDataOrRw,
            _ => return None,
        })
    }

    /// True for the modes that count as a waiting writer (writer priority).
    pub fn is_writer(self) -> bool {
        matches!(self, Self::Rw | Self::RwDataOrRw)
    }
}

impl fmt::Display for RequestedLockType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RequestedLockType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s).ok_or_else(|| format!("unknown lock type {s:?}"))
    }
}

/// Lock type the server granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GrantedLockType {
    /// Writer that may change the layout.
    Rw,
    /// Reader.
    Ro,
    /// Writer of bytes into a sealed layout (no allocate/free/metadata changes).
    RwData,
}

impl GrantedLockType {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rw => "rw",
            Self::Ro => "ro",
            Self::RwData => "rw_data",
        }
    }

    /// Parses the wire spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "rw" => Self::Rw,
            "ro" => Self::Ro,
            "rw_data" => Self::RwData,
            _ => return None,
        })
    }

    /// True for `rw` and `rw_data`.
    pub fn is_writer(self) -> bool {
        !matches!(self, Self::Ro)
    }
}

impl fmt::Display for GrantedLockType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One allocation as `get_allocation_response` / `export_allocation_response` describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AllocationInfo {
    /// Server-chosen UUID; the handle every other RPC names.
    pub allocation_id: String,
    /// Bytes the writer asked for (part of the layout hash).
    pub size: u64,
    /// `size` rounded up to the allocation granularity (what is really backed).
    pub aligned_size: u64,
    /// Free-form grouping label (e.g. `weights`), part of the layout hash.
    pub tag: String,
    /// Position in allocation order; the layout hash orders allocations by it.
    pub layout_slot: u64,
}

/// Body of `get_lock_state_response`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LockStateInfo {
    /// Derived state: `EMPTY`, `RW`, `LAYOUT_COMMITTED`, `COMMITTED` or `RO`.
    pub state: String,
    /// A writer session is connected.
    pub has_rw_session: bool,
    /// Reader sessions connected.
    pub ro_session_count: u64,
    /// Writers queued in a handshake (they block new readers).
    pub waiting_writers: u64,
    /// Contents are published.
    pub committed: bool,
    /// Committed and no writer connected: a reader would be admitted.
    pub is_ready: bool,
    /// The allocation set is sealed.
    pub layout_committed: bool,
}

/// Body of `get_runtime_state_response`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuntimeState {
    /// Derived state, as in [`LockStateInfo::state`].
    pub state: String,
    /// A writer session is connected.
    pub has_rw_session: bool,
    /// Reader sessions connected.
    pub ro_session_count: u64,
    /// Writers queued in a handshake.
    pub waiting_writers: u64,
    /// Contents are published.
    pub committed: bool,
    /// Committed and no writer connected.
    pub is_ready: bool,
    /// Allocations currently held by the server.
    pub allocation_count: u64,
    /// Hash of the sealed layout, empty when nothing is sealed.
    pub memory_layout_hash: String,
    /// The allocation set is sealed.
    pub layout_committed: bool,
}

/// One entry of `get_event_history_response`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuntimeEvent {
    /// `rw_connected`, `rw_aborted`, `rw_disconnected`, `allocations_cleared`, `committed`,
    /// `layout_committed`, `allocation_oom`.
    pub kind: String,
    /// Allocation count that goes with the event (cleared count for `allocations_cleared`).
    pub allocation_count: u64,
}

/// Every message of the protocol. Field order in each variant is the wire order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Opens a session: asks for a lock, optionally bounded in time.
    HandshakeRequest {
        /// Requested mode.
        lock_type: RequestedLockType,
        /// Milliseconds to wait; None waits forever.
        timeout_ms: Option<u64>,
    },
    /// Answer to the handshake.
    HandshakeResponse {
        /// The lock was granted.
        success: bool,
        /// Contents were committed at that moment.
        committed: bool,
        /// Granted mode, None on failure.
        granted_lock_type: Option<GrantedLockType>,
    },
    /// Publishes the contents and ends the writer's session.
    CommitRequest,
    /// Answer to commit.
    CommitResponse {
        /// The commit took effect.
        success: bool,
    },
    /// Seals the allocation set (layout) without publishing contents.
    CommitLayoutRequest,
    /// Answer to commit_layout.
    CommitLayoutResponse {
        /// The layout was sealed.
        success: bool,
        /// Hash of the sealed layout.
        memory_layout_hash: String,
        /// The session's mode from now on (`rw_data`).
        granted_lock_type: Option<GrantedLockType>,
    },
    /// Asks for the lock state.
    GetLockStateRequest,
    /// Lock state.
    GetLockStateResponse(LockStateInfo),
    /// Asks for the committed layout hash.
    GetMemoryLayoutHashRequest,
    /// Committed layout hash (empty if not committed).
    GetMemoryLayoutHashResponse {
        /// SHA-256 hex, or empty.
        memory_layout_hash: String,
    },
    /// Asks for the allocation count.
    GetAllocationStateRequest,
    /// Allocation count.
    GetAllocationStateResponse {
        /// Allocations held.
        allocation_count: u64,
    },
    /// Creates an allocation.
    AllocateRequest {
        /// Bytes wanted.
        size: u64,
        /// Label (default `default`).
        tag: String,
    },
    /// The new allocation.
    AllocateResponse {
        /// Its UUID.
        allocation_id: String,
        /// Bytes asked for.
        size: u64,
        /// Bytes backed.
        aligned_size: u64,
        /// Its slot in allocation order.
        layout_slot: u64,
    },
    /// Asks for a shareable fd of an allocation.
    ExportAllocationRequest {
        /// Which allocation.
        allocation_id: String,
    },
    /// The allocation; its fd travels with this frame (SCM_RIGHTS).
    ExportAllocationResponse(AllocationInfo),
    /// Describes one allocation.
    GetAllocationRequest {
        /// Which allocation.
        allocation_id: String,
    },
    /// One allocation.
    GetAllocationResponse(AllocationInfo),
    /// Lists allocations, optionally one tag only.
    ListAllocationsRequest {
        /// Tag filter.
        tag: Option<String>,
    },
    /// The allocations (each encoded as a tagged `get_allocation_response` body).
    ListAllocationsResponse {
        /// In layout-slot order.
        allocations: Vec<AllocationInfo>,
    },
    /// Frees one allocation.
    FreeAllocationRequest {
        /// Which allocation.
        allocation_id: String,
    },
    /// Answer to free.
    FreeAllocationResponse {
        /// It existed and was freed.
        success: bool,
    },
    /// Stores one metadata entry.
    MetadataPutRequest {
        /// Tensor name.
        key: String,
        /// Allocation the tensor lives in.
        allocation_id: String,
        /// Offset of the tensor in the allocation.
        offset_bytes: u64,
        /// Opaque bytes (shape/dtype/stride JSON for vLLM).
        value: Vec<u8>,
    },
    /// Answer to metadata put.
    MetadataPutResponse {
        /// Stored.
        success: bool,
    },
    /// Reads one metadata entry.
    MetadataGetRequest {
        /// Tensor name.
        key: String,
    },
    /// One metadata entry (the optionals are nil when not found).
    MetadataGetResponse {
        /// The key exists.
        found: bool,
        /// Its allocation.
        allocation_id: Option<String>,
        /// Its offset.
        offset_bytes: Option<u64>,
        /// Its value.
        value: Option<Vec<u8>>,
    },
    /// Deletes one metadata entry.
    MetadataDeleteRequest {
        /// Tensor name.
        key: String,
    },
    /// Answer to delete.
    MetadataDeleteResponse {
        /// The key existed.
        deleted: bool,
    },
    /// Lists metadata keys by prefix.
    MetadataListRequest {
        /// Prefix ("" for all).
        prefix: String,
    },
    /// Sorted keys.
    MetadataListResponse {
        /// Keys with the prefix, sorted.
        keys: Vec<String>,
    },
    /// Diagnostics, no lock needed.
    GetRuntimeStateRequest,
    /// Runtime state.
    GetRuntimeStateResponse(RuntimeState),
    /// Diagnostics, no lock needed.
    GetEventHistoryRequest,
    /// Last 256 events.
    GetEventHistoryResponse {
        /// Oldest first.
        events: Vec<RuntimeEvent>,
    },
    /// Any failure.
    ErrorResponse {
        /// Human-readable cause.
        error: String,
        /// Numeric class (see `server::codes`).
        code: i64,
    },
}

/// Every tag, in the spec's order (used by tests and the fuzz target).
pub const ALL_TAGS: &[&str] = &[
    "handshake_request",
    "handshake_response",
    "commit_request",
    "commit_response",
    "commit_layout_request",
    "commit_layout_response",
    "get_lock_state_request",
    "get_lock_state_response",
    "get_memory_layout_hash_request",
    "get_memory_layout_hash_response",
    "get_allocation_state_request",
    "get_allocation_state_response",
    "allocate_request",
    "allocate_response",
    "export_allocation_request",
    "export_allocation_response",
    "get_allocation_request",
    "get_allocation_response",
    "list_allocations_request",
    "list_allocations_response",
    "free_allocation_request",
    "free_allocation_response",
    "metadata_put_request",
    "metadata_put_response",
    "metadata_get_request",
    "metadata_get_response",
    "metadata_delete_request",
    "metadata_delete_response",
    "metadata_list_request",
    "metadata_list_response",
    "get_runtime_state_request",
    "get_runtime_state_response",
    "get_event_history_request",
    "get_event_history_response",
    "error_response",
];

impl Message {
    /// The wire tag.
    pub fn tag(&self) -> &'static str {
        use Message::*;
        match self {
            HandshakeRequest { .. } => "handshake_request",
            HandshakeResponse { .. } => "handshake_response",
            CommitRequest => "commit_request",
            CommitResponse { .. } => "commit_response",
            CommitLayoutRequest => "commit_layout_request",
            CommitLayoutResponse { .. } => "commit_layout_response",
            GetLockStateRequest => "get_lock_state_request",
            GetLockStateResponse(_) => "get_lock_state_response",
            GetMemoryLayoutHashRequest => "get_memory_layout_hash_request",
            GetMemoryLayoutHashResponse { .. } => "get_memory_layout_hash_response",
            GetAllocationStateRequest => "get_allocation_state_request",
            GetAllocationStateResponse { .. } => "get_allocation_state_response",
            AllocateRequest { .. } => "allocate_request",
            AllocateResponse { .. } => "allocate_response",
            ExportAllocationRequest { .. } => "export_allocation_request",
            ExportAllocationResponse(_) => "export_allocation_response",
            GetAllocationRequest { .. } => "get_allocation_request",
            GetAllocationResponse(_) => "get_allocation_response",
            ListAllocationsRequest { .. } => "list_allocations_request",
            ListAllocationsResponse { .. } => "list_allocations_response",
            FreeAllocationRequest { .. } => "free_allocation_request",
            FreeAllocationResponse { .. } => "free_allocation_response",
            MetadataPutRequest { .. } => "metadata_put_request",
            MetadataPutResponse { .. } => "metadata_put_response",
            MetadataGetRequest { .. } => "metadata_get_request",
            MetadataGetResponse { .. } => "metadata_get_response",
            MetadataDeleteRequest { .. } => "metadata_delete_request",
            MetadataDeleteResponse { .. } => "metadata_delete_response",
            MetadataListRequest { .. } => "metadata_list_request",
            MetadataListResponse { .. } => "metadata_list_response",
            GetRuntimeStateRequest => "get_runtime_state_request",
            GetRuntimeStateResponse(_) => "get_runtime_state_response",
            GetEventHistoryRequest => "get_event_history_request",
            GetEventHistoryResponse { .. } => "get_event_history_response",
            ErrorResponse { .. } => "error_response",
        }
    }

    /// True for the one message that carries a file descriptor.
    pub fn carries_fd(&self) -> bool {
        matches!(self, Message::ExportAllocationResponse(_))
    }

    /// Encodes the msgpack body (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc(Vec::with_capacity(64));
        self.encode_into(&mut e);
        e.0
    }

    /// Encodes a whole frame: 4-byte big-endian length, then the body.
    pub fn encode_frame(&self) -> Vec<u8> {
        let mut e = Enc(vec![0, 0, 0, 0]);
        self.encode_into(&mut e);
        let len = (e.0.len() - 4) as u32;
        e.0[..4].copy_from_slice(&len.to_be_bytes());
        e.0
    }

    fn encode_into(&self, e: &mut Enc) {
        use Message::*;
        let tag = self.tag();
        match self {
            CommitRequest
            | CommitLayoutRequest
            | GetLockStateRequest
            | GetMemoryLayoutHashRequest
            | GetAllocationStateRequest
            | GetRuntimeStateRequest
            | GetEventHistoryRequest => e.head(tag, 0),
            HandshakeRequest {
                lock_type,
                timeout_ms,
            } => {
                e.head(tag, 2);
                e.kv_str("lock_type", lock_type.as_str());
                e.str("timeout_ms");
                e.opt_u64(*timeout_ms);
            }
            HandshakeResponse {
                success,
                committed,
                granted_lock_type,
            } => {
                e.head(tag, 3);
                e.kv_bool("success", *success);
                e.kv_bool("committed", *committed);
                e.str("granted_lock_type");
                e.opt_str(granted_lock_type.map(|g| g.as_str()));
            }
            CommitResponse { success }
            | FreeAllocationResponse { success }
            | MetadataPutResponse { success } => {
                e.head(tag, 1);
                e.kv_bool("success", *success);
            }
            CommitLayoutResponse {
                success,
                memory_layout_hash,
                granted_lock_type,
            } => {
                e.head(tag, 3);
                e.kv_bool("success", *success);
                e.kv_str("memory_layout_hash", memory_layout_hash);
                e.str("granted_lock_type");
                e.opt_str(granted_lock_type.map(|g| g.as_str()));
            }
            GetLockStateResponse(s) => {
                e.head(tag, 7);
                e.kv_str("state", &s.state);
                e.kv_bool("has_rw_session", s.has_rw_session);
                e.kv_u64("ro_session_count", s.ro_session_count);
                e.kv_u64("waiting_writers", s.waiting_writers);
                e.kv_bool("committed", s.committed);
                e.kv_bool("is_ready", s.is_ready);
                e.kv_bool("layout_committed", s.layout_committed);
            }
            GetMemoryLayoutHashResponse { memory_layout_hash } => {
                e.head(tag, 1);
                e.kv_str("memory_layout_hash", memory_layout_hash);
            }
            GetAllocationStateResponse { allocation_count } => {
                e.head(tag, 1);
                e.kv_u64("allocation_count", *allocation_count);
            }
            AllocateRequest { size, tag: t } => {
                e.head(tag, 2);
                e.kv_u64("size", *size);
                e.kv_str("tag", t);
            }
            AllocateResponse {
                allocation_id,
                size,
                aligned_size,
                layout_slot,
            } => {
                e.head(tag, 4);
                e.kv_str("allocation_id", allocation_id);
                e.kv_u64("size", *size);
                e.kv_u64("aligned_size", *aligned_size);
                e.kv_u64("layout_slot", *layout_slot);
            }
            ExportAllocationRequest { allocation_id }
            | GetAllocationRequest { allocation_id }
            | FreeAllocationRequest { allocation_id } => {
                e.head(tag, 1);
                e.kv_str("allocation_id", allocation_id);
            }
            ExportAllocationResponse(a) | GetAllocationResponse(a) => e.allocation(tag, a),
            ListAllocationsRequest { tag: t } => {
                e.head(tag, 1);
                e.str("tag");
                e.opt_str(t.as_deref());
            }
            ListAllocationsResponse { allocations } => {
                e.head(tag, 1);
                e.str("allocations");
                e.array_len(allocations.len());
                for a in allocations {
                    e.allocation("get_allocation_response", a);
                }
            }
            MetadataPutRequest {
                key,
                allocation_id,
                offset_bytes,
                value,
            } => {
                e.head(tag, 4);
                e.kv_str("key", key);
                e.kv_str("allocation_id", allocation_id);
                e.kv_u64("offset_bytes", *offset_bytes);
                e.str("value");
                e.bin(value);
            }
            MetadataGetRequest { key } | MetadataDeleteRequest { key } => {
                e.head(tag, 1);
                e.kv_str("key", key);
            }
            MetadataGetResponse {
                found,
                allocation_id,
                offset_bytes,
                value,
            } => {
                e.head(tag, 4);
                e.kv_bool("found", *found);
                e.str("allocation_id");
                e.opt_str(allocation_id.as_deref());
                e.str("offset_bytes");
                e.opt_u64(*offset_bytes);
                e.str("value");
                match value {
                    Some(v) => e.bin(v),
                    None => e.nil(),
                }
            }
            MetadataDeleteResponse { deleted } => {
                e.head(tag, 1);
                e.kv_bool("deleted", *deleted);
            }
            MetadataListRequest { prefix } => {
                e.head(tag, 1);
                e.kv_str("prefix", prefix);
            }
            MetadataListResponse { keys } => {
                e.head(tag, 1);
                e.str("keys");
                e.array_len(keys.len());
                for k in keys {
                    e.str(k);
                }
            }
            GetRuntimeStateResponse(s) => {
                e.head(tag, 9);
                e.kv_str("state", &s.state);
                e.kv_bool("has_rw_session", s.has_rw_session);
                e.kv_u64("ro_session_count", s.ro_session_count);
                e.kv_u64("waiting_writers", s.waiting_writers);
                e.kv_bool("committed", s.committed);
                e.kv_bool("is_ready", s.is_ready);
                e.kv_u64("allocation_count", s.allocation_count);
                e.kv_str("memory_layout_hash", &s.memory_layout_hash);
                e.kv_bool("layout_committed", s.layout_committed);
            }
            GetEventHistoryResponse { events } => {
                e.head(tag, 1);
                e.str("events");
                e.array_len(events.len());
                for ev in events {
                    e.map_len(2);
                    e.kv_str("kind", &ev.kind);
                    e.kv_u64("allocation_count", ev.allocation_count);
                }
            }
            ErrorResponse { error, code } => {
                e.head(tag, 2);
                e.kv_str("error", error);
                e.str("code");
                e.i64(*code);
            }
        }
    }

    /// Decodes a msgpack body (without the length prefix).
    pub fn decode(body: &[u8]) -> Result<Message, DecodeError> {
        if body.len() > MAX_FRAME_LEN {
            return Err(DecodeError::TooLong(body.len()));
        }
        let mut r = Reader { buf: body, pos: 0 };
        let v = r.value(0)?;
        if r.pos != body.len() {
            return Err(DecodeError::TrailingBytes(body.len() - r.pos));
        }
        Self::from_value(&v)
    }

    fn from_value(v: &Value<'_>) -> Result<Message, DecodeError> {
        use Message::*;
        let f = Fields::of(v)?;
        let tag = f.req_str("type")?;
        Ok(match tag {
            "handshake_request" => {
                let lt = f.req_str("lock_type")?;
                HandshakeRequest {
                    lock_type: RequestedLockType::parse(lt)
                        .ok_or_else(|| DecodeError::BadValue("lock_type", lt.to_string()))?,
                    timeout_ms: f.opt_u64("timeout_ms")?,
                }
            }
            "handshake_response" => HandshakeResponse {
                success: f.req_bool("success")?,
                committed: f.req_bool("committed")?,
                granted_lock_type: f.opt_granted("granted_lock_type")?,
            },
            "commit_request" => CommitRequest,
            "commit_response" => CommitResponse {
                success: f.req_bool("success")?,
            },
            "commit_layout_request" => CommitLayoutRequest,
            "commit_layout_response" => CommitLayoutResponse {
                success: f.req_bool("success")?,
                memory_layout_hash: f.opt_str("memory_layout_hash")?.unwrap_or("").to_string(),
                granted_lock_type: f.opt_granted("granted_lock_type")?,
            },
            "get_lock_state_request" => GetLockStateRequest,
            "get_lock_state_response" => GetLockStateResponse(LockStateInfo {
                state: f.req_str("state")?.to_string(),
                has_rw_session: f.req_bool("has_rw_session")?,
                ro_session_count: f.req_u64("ro_session_count")?,
                waiting_writers: f.req_u64("waiting_writers")?,
                committed: f.req_bool("committed")?,
                is_ready: f.req_bool("is_ready")?,
                layout_committed: f.opt_bool("layout_committed")?.unwrap_or(false),
            }),
            "get_memory_layout_hash_request" => GetMemoryLayoutHashRequest,
            "get_memory_layout_hash_response" => GetMemoryLayoutHashResponse {
                memory_layout_hash: f.req_str("memory_layout_hash")?.to_string(),
            },
            "get_allocation_state_request" => GetAllocationStateRequest,
            "get_allocation_state_response" => GetAllocationStateResponse {
                allocation_count: f.req_u64("allocation_count")?,
            },
            "allocate_request" => AllocateRequest {
                size: f.req_u64("size")?,
                tag: f.opt_str("tag")?.unwrap_or("default").to_string(),
            },
            "allocate_response" => AllocateResponse {
                allocation_id: f.req_str("allocation_id")?.to_string(),
                size: f.req_u64("size")?,
                aligned_size: f.req_u64("aligned_size")?,
                layout_slot: f.opt_u64("layout_slot")?.unwrap_or(0),
            },
            "export_allocation_request" => ExportAllocationRequest {
                allocation_id: f.req_str("allocation_id")?.to_string(),
            },
            "export_allocation_response" => ExportAllocationResponse(f.allocation()?),
            "get_allocation_request" => GetAllocationRequest {
                allocation_id: f.req_str("allocation_id")?.to_string(),
            },
            "get_allocation_response" => GetAllocationResponse(f.allocation()?),
            "list_allocations_request" => ListAllocationsRequest {
                tag: f.opt_str("tag")?.map(str::to_string),
            },
            "list_allocations_response" => {
                let items = f.opt_array("allocations")?.unwrap_or(&[]);
                let mut allocations = Vec::with_capacity(items.len());
                for item in items {
                    allocations.push(Fields::of(item)?.allocation()?);
                }
                ListAllocationsResponse { allocations }
            }
            "free_allocation_request" => FreeAllocationRequest {
                allocation_id: f.req_str("allocation_id")?.to_string(),
            },
            "free_allocation_response" => FreeAllocationResponse {
                success: f.req_bool("success")?,
            },
            "metadata_put_request" => MetadataPutRequest {
                key: f.req_str("key")?.to_string(),
                allocation_id: f.req_str("allocation_id")?.to_string(),
                offset_bytes: f.req_u64("offset_bytes")?,
                value: f.req_bin("value")?.to_vec(),
            },
            "metadata_put_response" => MetadataPutResponse {
                success: f.req_bool("success")?,
            },
            "metadata_get_request" => MetadataGetRequest {
                key: f.req_str("key")?.to_string(),
            },
            "metadata_get_response" => MetadataGetResponse {
                found: f.req_bool("found")?,
                allocation_id: f.opt_str("allocation_id")?.map(str::to_string),
                offset_bytes: f.opt_u64("offset_bytes")?,
                value: f.opt_bin("value")?.map(<[u8]>::to_vec),
            },
            "metadata_delete_request" => MetadataDeleteRequest {
                key: f.req_str("key")?.to_string(),
            },
            "metadata_delete_response" => MetadataDeleteResponse {
                deleted: f.req_bool("deleted")?,
            },
            "metadata_list_request" => MetadataListRequest {
                prefix: f.opt_str("prefix")?.unwrap_or("").to_string(),
            },
            "metadata_list_response" => {
                let items = f.opt_array("keys")?.unwrap_or(&[]);
                let mut keys = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        Value::Str(s) => keys.push((*s).to_string()),
                        _ => return Err(DecodeError::WrongType("keys[]")),
                    }
                }
                MetadataListResponse { keys }
            }
            "get_runtime_state_request" => GetRuntimeStateRequest,
            "get_runtime_state_response" => GetRuntimeStateResponse(RuntimeState {
                state: f.req_str("state")?.to_string(),
                has_rw_session: f.req_bool("has_rw_session")?,
                ro_session_count: f.req_u64("ro_session_count")?,
                waiting_writers: f.req_u64("waiting_writers")?,
                committed: f.req_bool("committed")?,
                is_ready: f.req_bool("is_ready")?,
                allocation_count: f.req_u64("allocation_count")?,
                memory_layout_hash: f.opt_str("memory_layout_hash")?.unwrap_or("").to_string(),
                layout_committed: f.opt_bool("layout_committed")?.unwrap_or(false),
            }),
            "get_event_history_request" => GetEventHistoryRequest,
            "get_event_history_response" => {
                let items = f.opt_array("events")?.unwrap_or(&[]);
                let mut events = Vec::with_capacity(items.len());
                for item in items {
                    let ef = Fields::of(item)?;
                    events.push(RuntimeEvent {
                        kind: ef.req_str("kind")?.to_string(),
                        allocation_count: ef.opt_u64("allocation_count")?.unwrap_or(0),
                    });
                }
                GetEventHistoryResponse { events }
            }
            "error_response" => ErrorResponse {
                error: f.req_str("error")?.to_string(),
                code: f.opt_i64("code")?.unwrap_or(0),
            },
            other => return Err(DecodeError::UnknownType(truncate(other))),
        })
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

/// Why a body could not be decoded. Never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The body ended inside a value.
    #[error("truncated msgpack body")]
    Truncated,
    /// Bytes after the top-level map.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// A frame over [`MAX_FRAME_LEN`].
    #[error("frame of {0} bytes exceeds the limit")]
    TooLong(usize),
    /// Nested deeper than [`MAX_DEPTH`].
    #[error("msgpack nested too deeply")]
    TooDeep,
    /// A marker the protocol never uses (reserved 0xc1).
    #[error("invalid msgpack marker 0x{0:02x}")]
    BadMarker(u8),
    /// A str that is not UTF-8.
    #[error("string is not UTF-8")]
    BadUtf8,
    /// The top-level value (or a list element) is not a map.
    #[error("message is not a map")]
    NotAMap,
    /// A required field is missing or nil.
    #[error("missing field {0:?}")]
    MissingField(&'static str),
    /// A field has the wrong msgpack type.
    #[error("field {0:?} has the wrong type")]
    WrongType(&'static str),
    /// A field has a value outside its domain.
    #[error("field {0:?} has an invalid value {1:?}")]
    BadValue(&'static str, String),
    /// The `type` tag names no known message.
    #[error("unknown message type {0:?}")]
    UnknownType(String),
}

// ---------------------------------------------------------------------------------------
// Encoder

struct Enc(Vec<u8>);

/// Writes into a Vec cannot fail; rmp still returns a Result, which is checked in debug.
fn ok<T, E: fmt::Debug>(r: Result<T, E>) {
    debug_assert!(r.is_ok(), "msgpack write into a Vec failed: {:?}", r.err());
}

impl Enc {
    fn head(&mut self, tag: &str, fields: u32) {
        ok(rmp::encode::write_map_len(&mut self.0, fields + 1));
        self.kv_str("type", tag);
    }
    fn map_len(&mut self, n: u32) {
        ok(rmp::encode::write_map_len(&mut self.0, n));
    }
    fn array_len(&mut self, n: usize) {
        ok(rmp::encode::write_array_len(&mut self.0, n as u32));
    }
    fn str(&mut self, s: &str) {
        ok(rmp::encode::write_str(&mut self.0, s));
    }
    fn nil(&mut self) {
        ok(rmp::encode::write_nil(&mut self.0));
    }
    fn bin(&mut self, b: &[u8]) {
        ok(rmp::encode::write_bin(&mut self.0, b));
    }
    fn u64(&mut self, v: u64) {
        ok(rmp::encode::write_uint(&mut self.0, v));
    }
    fn i64(&mut self, v: i64) {
        ok(rmp::encode::write_sint(&mut self.0, v));
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.u64(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
    fn kv_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.str(v);
    }
    fn kv_bool(&mut self, k: &str, v: bool) {
        self.str(k);
        ok(rmp::encode::write_bool(&mut self.0, v));
    }
    fn kv_u64(&mut self, k: &str, v: u64) {
        self.str(k);
        self.u64(v);
    }
    fn allocation(&mut self, tag: &str, a: &AllocationInfo) {
        self.head(tag, 5);
        self.kv_str("allocation_id", &a.allocation_id);
        self.kv_u64("size", a.size);
        self.kv_u64("aligned_size", a.aligned_size);
        self.kv_str("tag", &a.tag);
        self.kv_u64("layout_slot", a.layout_slot);
    }
}

// ---------------------------------------------------------------------------------------
// Decoder: a bounded msgpack reader over a slice, borrowing strings and bins.

/// A decoded msgpack value (borrowing from the frame).
#[derive(Debug, Clone, PartialEq)]
enum Value<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float,
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    Ext,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        let s = self.take(n)?;
        Ok(s.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn str(&mut self, n: usize) -> Result<Value<'a>, DecodeError> {
        let s = self.take(n)?;
        std::str::from_utf8(s)
            .map(Value::Str)
            .map_err(|_| DecodeError::BadUtf8)
    }
    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        // Every element takes at least one byte: a count beyond the remaining bytes is a lie.
        if n > self.remaining() {
            return Err(DecodeError::Truncated);
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(v))
    }
    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        if n.saturating_mul(2) > self.remaining() {
            return Err(DecodeError::Truncated);
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let val = self.value(depth + 1)?;
            v.push((k, val));
        }
        Ok(Value::Map(v))
    }
    fn value(&mut self, depth: usize) -> Result<Value<'a>, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let b = self.u8()?;
        Ok(match Marker::from_u8(b) {
            Marker::FixPos(v) => Value::UInt(u64::from(v)),
            Marker::FixNeg(v) => Value::Int(i64::from(v)),
            Marker::Null => Value::Nil,
            Marker::True => Value::Bool(true),
            Marker::False => Value::Bool(false),
            Marker::U8 => Value::UInt(self.be(1)?),
            Marker::U16 => Value::UInt(self.be(2)?),
            Marker::U32 => Value::UInt(self.be(4)?),
            Marker::U64 => Value::UInt(self.be(8)?),
            Marker::I8 => Value::Int(i64::from(self.be(1)? as u8 as i8)),
            Marker::I16 => Value::Int(i64::from(self.be(2)? as u16 as i16)),
            Marker::I32 => Value::Int(i64::from(self.be(4)? as u32 as i32)),
            Marker::I64 => Value::Int(self.be(8)? as i64),
            Marker::F32 => {
                self.take(4)?;
                Value::Float
            }
            Marker::F64 => {
                self.take(8)?;
                Value::Float
            }
            Marker::FixStr(n) => self.str(usize::from(n))?,
            Marker::Str8 => {
                let n = self.be(1)? as usize;
                self.str(n)?
            }
            Marker::Str16 => {
                let n = self.be(2)? as usize;
                self.str(n)?
            }
            Marker::Str32 => {
                let n = self.be(4)? as usize;
                self.str(n)?
            }
            Marker::Bin8 => {
                let n = self.be(1)? as usize;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.be(2)? as usize;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.be(4)? as usize;
                Value::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => self.array(usize::from(n), depth)?,
            Marker::Array16 => {
                let n = self.be(2)? as usize;
                self.array(n, depth)?
            }
            Marker::Array32 => {
                let n = self.be(4)? as usize;
                self.array(n, depth)?
            }
            Marker::FixMap(n) => self.map(usize::from(n), depth)?,
            Marker::Map16 => {
                let n = self.be(2)? as usize;
                self.map(n, depth)?
            }
            Marker::Map32 => {
                let n = self.be(4)? as usize;
                self.map(n, depth)?
            }
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.be(1)? as usize;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.be(2)? as usize;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.be(4)? as usize;
                self.ext(n)?
            }
            Marker::Reserved => return Err(DecodeError::BadMarker(b)),
        })
    }
    fn ext(&mut self, n: usize) -> Result<Value<'a>, DecodeError> {
        self.take(1)?; // ext type byte
        self.take(n)?;
        Ok(Value::Ext)
    }
}

/// Field lookup over one map: string keys only, other keys ignored, last duplicate wins.
struct Fields<'v, 'a> {
    entries: Vec<(&'a str, &'v Value<'a>)>,
}

impl<'v, 'a> Fields<'v, 'a> {
    fn of(v: &'v Value<'a>) -> Result<Self, DecodeError> {
        match v {
            Value::Map(m) => Ok(Fields {
                entries: m
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Value::Str(k) => Some((*k, v)),
                        _ => None,
                    })
                    .collect(),
            }),
            _ => Err(DecodeError::NotAMap),
        }
    }
    /// The field's value; nil counts as absent.
    fn get(&self, name: &str) -> Option<&'v Value<'a>> {
        self.entries
            .iter()
            .rev()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
            .filter(|v| !matches!(v, Value::Nil))
    }
    fn opt_str(&self, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn req_str(&self, name: &'static str) -> Result<&'a str, DecodeError> {
        self.opt_str(name)?.ok_or(DecodeError::MissingField(name))
    }
    fn opt_bool(&self, name: &'static str) -> Result<Option<bool>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn req_bool(&self, name: &'static str) -> Result<bool, DecodeError> {
        self.opt_bool(name)?.ok_or(DecodeError::MissingField(name))
    }
    fn opt_u64(&self, name: &'static str) -> Result<Option<u64>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::UInt(v)) => Ok(Some(*v)),
            Some(Value::Int(v)) => Err(DecodeError::BadValue(name, v.to_string())),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn req_u64(&self, name: &'static str) -> Result<u64, DecodeError> {
        self.opt_u64(name)?.ok_or(DecodeError::MissingField(name))
    }
    fn opt_i64(&self, name: &'static str) -> Result<Option<i64>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Int(v)) => Ok(Some(*v)),
            Some(Value::UInt(v)) => i64::try_from(*v)
                .map(Some)
                .map_err(|_| DecodeError::BadValue(name, v.to_string())),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn opt_bin(&self, name: &'static str) -> Result<Option<&'a [u8]>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bin(b)) => Ok(Some(b)),
            // msgspec decodes bytes from str too; accept it, the bytes are the same.
            Some(Value::Str(s)) => Ok(Some(s.as_bytes())),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn req_bin(&self, name: &'static str) -> Result<&'a [u8], DecodeError> {
        self.opt_bin(name)?.ok_or(DecodeError::MissingField(name))
    }
    fn opt_array(&self, name: &'static str) -> Result<Option<&'v [Value<'a>]>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a.as_slice())),
            Some(_) => Err(DecodeError::WrongType(name)),
        }
    }
    fn opt_granted(&self, name: &'static str) -> Result<Option<GrantedLockType>, DecodeError> {
        match self.opt_str(name)? {
            None => Ok(None),
            Some(s) => GrantedLockType::parse(s)
                .map(Some)
                .ok_or_else(|| DecodeError::BadValue(name, truncate(s))),
        }
    }
    fn allocation(&self) -> Result<AllocationInfo, DecodeError> {
        Ok(AllocationInfo {
            allocation_id: self.req_str("allocation_id")?.to_string(),
            size: self.req_u64("size")?,
            aligned_size: self.req_u64("aligned_size")?,
            tag: self.opt_str("tag")?.unwrap_or("default").to_string(),
            layout_slot: self.opt_u64("layout_slot")?.unwrap_or(0),
        })
    }
}

/// Parses a frame header; refuses lengths over [`MAX_FRAME_LEN`].
pub fn frame_len(header: [u8; 4]) -> Result<usize, DecodeError> {
    let n = u32::from_be_bytes(header) as usize;
    if n > MAX_FRAME_LEN {
        return Err(DecodeError::TooLong(n));
    }
    Ok(n)
}

/// Decodes every complete frame at the start of `buf`; returns the messages (or the first
/// error) and how many bytes they used. A test and fuzz helper for the framing layer.
pub fn decode_frames(buf: &[u8]) -> (Vec<Result<Message, DecodeError>>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while buf.len() - pos >= 4 {
        let header = [buf[pos], buf[pos + 1], buf[pos + 2], buf[pos + 3]];
        let n = match frame_len(header) {
            Ok(n) => n,
            Err(e) => {
                out.push(Err(e));
                return (out, pos);
            }
        };
        if buf.len() - pos - 4 < n {
            break;
        }
        out.push(Message::decode(&buf[pos + 4..pos + 4 + n]));
        pos += 4 + n;
    }
    (out, pos)
}
