//! The wire protocol: one JSON object per line, in both directions (see `PROTOCOL.md`).
//!
//! Client → server objects carry `"op"`; server → client objects carry `"event"`.
//! Decoding never panics: every byte string maps to a [`Request`] or a [`DecodeError`]
//! (checked by the proptest in `tests/proto_proptest.rs` and the fuzz target in `fuzz/`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Protocol version announced in the `hello` event. Version 2 is version 1 plus optional
/// extensions, each announced in `hello`'s `features` ([`FEATURES`]); every version-1
/// request and event is unchanged, so version-1 clients work as before.
pub const PROTOCOL_VERSION: u32 = 2;

/// Protocol-2 extensions this lockd serves, announced in `hello` (`features`). A client uses
/// an extension only when its name is listed (see PROTOCOL.md, "Version 2").
pub const FEATURES: &[&str] = &["ttl", "shared", "quantity", "gang", "reserve"];
/// Default bound on one line (request or event), newline excluded.
pub const DEFAULT_MAX_LINE: usize = 64 * 1024;
/// Longest accepted resource or holder name, in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// A request from a client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Queue for `resource` (wait=true) or try once (wait=false → `granted` or `busy`).
    Acquire {
        /// The lock's name (one lock per name).
        resource: String,
        /// Who is asking, for status/logs (e.g. `engine-a`).
        holder: String,
        /// Queue when the resource is taken (default true).
        #[serde(default = "default_true")]
        wait: bool,
        /// Version 2 (`ttl`, `shared`, `quantity`): the kind of lease asked for. Absent: the
        /// version-1 connection-bound exclusive lease.
        #[serde(flatten)]
        ext: AcquireExt,
    },
    /// After a reconnect: take back a lease granted to a previous connection.
    Reclaim {
        /// The resource of the lease.
        resource: String,
        /// The holder name used at grant time (for logs; the token is the proof).
        holder: String,
        /// The epoch of the lease being reclaimed.
        epoch: u64,
        /// The secret token handed out with the grant.
        token: String,
    },
    /// Give up a held lease, or cancel a queued acquire: by `resource` (the leases of this
    /// connection on it) or, version 2, by `lease_id` + `token` (from any connection).
    Release {
        /// The resource to release.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resource: Option<String>,
        /// Version 2: the lease (or queued request) to end.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
        /// Version 2: the lease's token (with `lease_id`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
    },
    /// Operator action: tell the holder to fence itself and let go.
    Revoke {
        /// The resource whose lease is revoked (or, version 2, `lease_id`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resource: Option<String>,
        /// Version 2: the lease to revoke (any kind).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
        /// Free text passed on to the holder.
        #[serde(default)]
        reason: Option<String>,
        /// Required over TCP: must equal lockd's `--admin-token`.
        #[serde(default)]
        admin_token: Option<String>,
    },
    /// Ask for a `status` event.
    Status {
        /// Version 2: `false` asks for the summary: no per-session list (`session_count`
        /// instead) and no per-lease list (`lease_count`; see `leases`), which are most of the
        /// answer with thousands of sessions. Default `true`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sessions: Option<bool>,
    },
    /// Subscribe this connection to `notice` events.
    Watch,
    /// Liveness check; answered with `pong`.
    Ping,
    /// Attach an *anchor* to this session (Unix sockets only): the request line must carry
    /// exactly one file descriptor (SCM_RIGHTS), one end of a stream socket pair whose other
    /// end the holder's processes inherit. The session, and every lease it holds, lives
    /// until its connection AND all its anchors are closed: a lease is not released while
    /// any process holding the other end lives, even after the connection is gone.
    /// Answered with `anchored`.
    Anchor,
    /// Version 2 (`ttl`, `quantity`, timed `shared`): extend a lease's deadline.
    Renew {
        /// The lease.
        lease_id: u64,
        /// Its token.
        token: String,
        /// A new TTL / lease time to ask for (default: the one granted).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ttl_ms: Option<u64>,
    },
    /// Version 2 (`shared`): the exclusive holder publishes a new version of the resource.
    Commit {
        /// The exclusive lease.
        lease_id: u64,
        /// Its token.
        token: String,
    },
    /// Version 2: take up a lease from this connection after the previous one (or the
    /// client process) is gone: TTL and quantity leases, and connection-bound shared leases
    /// waiting in their reconnect window after a lockd restart.
    Resume {
        /// The lease.
        lease_id: u64,
        /// Its token.
        token: String,
    },
    /// Version 2 (`reserve`): the holder of a reserved lease starts using it: lockd no longer
    /// cancels it (answered `started`; `lease_ended` if it was cancelled already).
    Start {
        /// The reserved resource (for a gang: any member; the gang starts whole).
        resource: String,
    },
    /// Version 2: what lockd knows of a lease id (live, or ended and still remembered).
    Lease {
        /// The lease.
        lease_id: u64,
    },
    /// Version 2: the live leases of every kind, optionally of one resource or holder.
    Leases {
        /// Only this resource (or pool).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resource: Option<String>,
        /// Only this holder name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        holder: Option<String>,
    },
    /// Version 2 (`quantity`): add or change an offer of a pool (admin, like `revoke`).
    Offer {
        /// The pool (a resource name used with `quantity`).
        pool: String,
        /// The offer's name, unique in the pool.
        name: String,
        /// How much it offers.
        quantity: u32,
        /// Its attributes (requests' requirements match them).
        #[serde(default)]
        attributes: BTreeMap<String, String>,
        /// The longest lease it allows, in ms.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_lease_time_ms: Option<u64>,
        /// What it requires of requests' attributes (label-selector text).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        requirements: Option<String>,
        /// Required over TCP: lockd's `--admin-token`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        admin_token: Option<String>,
    },
    /// Version 2 (`quantity`): withdraw an offer (its leases run out; renewals refused).
    Withdraw {
        /// The pool.
        pool: String,
        /// The offer.
        name: String,
        /// Required over TCP: lockd's `--admin-token`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        admin_token: Option<String>,
    },
}

/// The version-2 fields of `acquire`. All absent: a version-1 acquire.
///
/// * `quantity` (feature `quantity`): a quantity lease from the offers of the pool named by
///   `resource`, lease time `ttl_ms` (optional), `requirements` on offers, `attributes`
///   that offers' requirements match;
/// * else `mode` (feature `shared`): a shared or exclusive lease with versions, bound to the
///   connection, or to a TTL with `ttl_ms`; `min_version` (shared only) waits for a version;
/// * else `ttl_ms` (feature `ttl`): an exclusive lease that outlives its connection and
///   ends unless renewed within `ttl_ms`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireExt {
    /// TTL (or, for quantity leases, the lease time asked for), in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Shared or exclusive (feature `shared`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Shared: wait until the resource's version is at least this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_version: Option<u64>,
    /// Quantity asked for from the pool `resource` (feature `quantity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantity: Option<u32>,
    /// Quantity: label selector (text form) the offers' attributes must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirements: Option<String>,
    /// Quantity: this request's attributes (matched by the offers' requirements).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<BTreeMap<String, String>>,
    /// Feature `gang`: the resources of an all-or-nothing gang (exclusive and bound to the
    /// connection; with `ttl_ms` TTL leases; with `mode: shared` shared leases); `resource`
    /// then names the gang in events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<Vec<String>>,
    /// Feature `gang`: give up waiting after this long (answered `cancelled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Feature `reserve` (exclusive leases and gangs): the grant is a *reservation* that
    /// lockd cancels unless the holder confirms it with `start` within this many ms (QURD's
    /// reserved → running; a client that vanishes or hangs never pins the resource).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve_ms: Option<u64>,
}

/// Most resources in one gang.
pub const MAX_GANG: usize = 64;

impl AcquireExt {
    /// The kind of lease this asks for.
    pub fn kind(&self) -> LeaseKind {
        if self.quantity.is_some() {
            LeaseKind::Quantity
        } else if self.mode.is_some() {
            LeaseKind::Shared
        } else if self.ttl_ms.is_some() {
            LeaseKind::Ttl
        } else {
            LeaseKind::Exclusive
        }
    }
}

/// Shared or exclusive access (feature `shared`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Many readers of the current version.
    Shared,
    /// One writer; its `commit` bumps the version.
    Exclusive,
}

/// What kind of lease a lease is: which part of the core decides when it starts and ends.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LeaseKind {
    /// Version 1's lease: one holder, bound to its connection (and anchors).
    #[default]
    Exclusive,
    /// One holder, outlives its connection, ends unless renewed in time.
    Ttl,
    /// Shared/exclusive with versions (bound to the connection, or to a TTL).
    Shared,
    /// A quantity of a pool, from one or several offers, for a lease time.
    Quantity,
}

impl LeaseKind {
    /// The wire string.
    pub fn as_str(&self) -> &'static str {
        match self {
            LeaseKind::Exclusive => "exclusive",
            LeaseKind::Ttl => "ttl",
            LeaseKind::Shared => "shared",
            LeaseKind::Quantity => "quantity",
        }
    }
}

impl Request {
    /// A version-1 `acquire`.
    pub fn acquire(resource: impl Into<String>, holder: impl Into<String>, wait: bool) -> Request {
        Request::Acquire {
            resource: resource.into(),
            holder: holder.into(),
            wait,
            ext: AcquireExt::default(),
        }
    }

    /// A version-1 `release` of this connection's lease (or queued acquire) on `resource`.
    pub fn release(resource: impl Into<String>) -> Request {
        Request::Release {
            resource: Some(resource.into()),
            lease_id: None,
            token: None,
        }
    }

    /// A version-1 `revoke`.
    pub fn revoke(
        resource: impl Into<String>,
        reason: Option<String>,
        admin_token: Option<String>,
    ) -> Request {
        Request::Revoke {
            resource: Some(resource.into()),
            lease_id: None,
            reason,
            admin_token,
        }
    }
}

fn default_true() -> bool {
    true
}

/// The `op` names this protocol version knows.
pub const KNOWN_OPS: &[&str] = &[
    "acquire", "reclaim", "release", "revoke", "status", "watch", "ping", "anchor", "renew",
    "commit", "resume", "lease", "leases", "offer", "withdraw", "start",
];

/// Why a line could not be turned into a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The line is longer than the bound.
    #[error("line longer than {max} bytes")]
    TooLong {
        /// The bound that was exceeded.
        max: usize,
    },
    /// Not UTF-8, not JSON, not an object, or fields missing/mistyped.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// A well-formed object with an `op` this server does not know.
    #[error("unknown op {0:?}")]
    UnknownOp(String),
    /// Well-formed, but a value is out of range (empty/too long name, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

impl DecodeError {
    /// The error code sent in the `error` event.
    pub fn code(&self) -> ErrorCode {
        match self {
            DecodeError::TooLong { .. } => ErrorCode::LineTooLong,
            DecodeError::Malformed(_) => ErrorCode::BadRequest,
            DecodeError::UnknownOp(_) => ErrorCode::UnknownOp,
            DecodeError::Invalid(_) => ErrorCode::InvalidArgument,
        }
    }
}

/// Decode one line (without its newline). Never panics.
pub fn decode_request(line: &[u8], max: usize) -> Result<Request, DecodeError> {
    if line.len() > max {
        return Err(DecodeError::TooLong { max });
    }
    let text = std::str::from_utf8(line).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    let text = text.strip_suffix('\r').unwrap_or(text);
    // Fastest path: the compact version-1 `acquire` / `release`, by hand.
    if let Some(req) = decode_v1_fast(text) {
        validate(&req)?;
        return Ok(req);
    }
    decode_serde(text)
}

/// [`decode_request`] without the hand-parsed fast path (what the fast path must agree with).
fn decode_serde(text: &str) -> Result<Request, DecodeError> {
    // Fast path: a well-formed request parses directly; only failures are classified.
    if let Ok(req) = serde_json::from_str::<Request>(text) {
        validate(&req)?;
        return Ok(req);
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| DecodeError::Malformed("expected a JSON object".into()))?;
    let op = match obj.get("op") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(_) => return Err(DecodeError::Malformed("\"op\" must be a string".into())),
        None => return Err(DecodeError::Malformed("missing \"op\"".into())),
    };
    if !KNOWN_OPS.contains(&op.as_str()) {
        return Err(DecodeError::UnknownOp(truncate(&op, 64)));
    }
    let req: Request =
        serde_json::from_value(value).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    validate(&req)?;
    Ok(req)
}

/// The compact version-1 requests, parsed by hand: an object of `"op"` (`acquire` or
/// `release`), `"resource"`, and for `acquire` `"holder"` and an optional boolean `"wait"`,
/// in any order, with JSON whitespace anywhere between tokens. serde's internally tagged
/// enum with a flattened extension buffers every field before it looks at the tag; these
/// two lines are most of what a busy lockd reads. `None` whenever the line is anything else
/// or this parser is unsure — a string with an escape or a control character, a key seen
/// twice, any other key, a value of another type — and the caller then asks serde: the two
/// never disagree (`fast_path_agrees_with_serde`, the proptest twin). Never panics.
fn decode_v1_fast(text: &str) -> Option<Request> {
    fn ws(b: &[u8], i: &mut usize) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(*i) {
            *i += 1;
        }
    }
    /// A string without escapes or control characters (else `None`: serde decides).
    fn string<'a>(text: &'a str, i: &mut usize) -> Option<&'a str> {
        let b = text.as_bytes();
        if b.get(*i) != Some(&b'"') {
            return None;
        }
        let start = *i + 1;
        let mut j = start;
        loop {
            match *b.get(j)? {
                b'"' => break,
                b'\\' | 0..=0x1f => return None,
                _ => j += 1,
            }
        }
        *i = j + 1;
        // Both ends are ASCII quotes, so this is a char boundary.
        text.get(start..j)
    }
    let b = text.as_bytes();
    let mut i = 0;
    ws(b, &mut i);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let (mut op, mut resource, mut holder, mut wait) = (None, None, None, None);
    loop {
        ws(b, &mut i);
        let key = string(text, &mut i)?;
        ws(b, &mut i);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i += 1;
        ws(b, &mut i);
        let slot = match key {
            "op" => &mut op,
            "resource" => &mut resource,
            "holder" => &mut holder,
            "wait" => {
                if wait.is_some() {
                    return None;
                }
                let rest = &b[i..];
                if rest.starts_with(b"true") {
                    wait = Some(true);
                    i += 4;
                } else if rest.starts_with(b"false") {
                    wait = Some(false);
                    i += 5;
                } else {
                    return None;
                }
                ws(b, &mut i);
                match b.get(i)? {
                    b',' => {
                        i += 1;
                        continue;
                    }
                    b'}' => {
                        i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
            _ => return None,
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(string(text, &mut i)?);
        ws(b, &mut i);
        match b.get(i)? {
            b',' => i += 1,
            b'}' => {
                i += 1;
                break;
            }
            _ => return None,
        }
    }
    ws(b, &mut i);
    if i != b.len() {
        return None;
    }
    match op? {
        "acquire" => Some(Request::Acquire {
            resource: resource?.to_string(),
            holder: holder?.to_string(),
            wait: wait.unwrap_or(true),
            ext: AcquireExt::default(),
        }),
        "release" if holder.is_none() && wait.is_none() => Some(Request::Release {
            resource: Some(resource?.to_string()),
            lease_id: None,
            token: None,
        }),
        _ => None,
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

fn check_name(what: &str, s: &str) -> Result<(), DecodeError> {
    if s.is_empty() {
        return Err(DecodeError::Invalid(format!("{what} must not be empty")));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(DecodeError::Invalid(format!(
            "{what} longer than {MAX_NAME_LEN} bytes"
        )));
    }
    if s.chars().any(|c| c.is_control()) {
        return Err(DecodeError::Invalid(format!(
            "{what} contains control characters"
        )));
    }
    Ok(())
}

/// Longest TTL / lease time accepted on the wire (one year).
pub const MAX_TTL_MS: u64 = 365 * 24 * 3600 * 1000;

fn check_ttl(ttl: Option<u64>) -> Result<(), DecodeError> {
    match ttl {
        Some(0) => Err(DecodeError::Invalid("ttl_ms must be positive".into())),
        Some(t) if t > MAX_TTL_MS => Err(DecodeError::Invalid(format!(
            "ttl_ms longer than {MAX_TTL_MS} (one year)"
        ))),
        _ => Ok(()),
    }
}

fn check_selector(text: Option<&str>) -> Result<(), DecodeError> {
    if let Some(t) = text {
        crate::kinds::selector::Selector::parse(t)
            .map_err(|e| DecodeError::Invalid(format!("requirements: {e}")))?;
    }
    Ok(())
}

fn check_attributes(attrs: Option<&BTreeMap<String, String>>) -> Result<(), DecodeError> {
    for (k, v) in attrs.into_iter().flatten() {
        check_name("attribute key", k)?;
        check_name("attribute value", v)?;
    }
    Ok(())
}

/// Exactly one of `resource` / `lease_id`; a `lease_id` of `release` needs its `token`.
fn check_target(
    resource: Option<&str>,
    lease_id: Option<u64>,
    token: Option<&str>,
    need_token: bool,
) -> Result<(), DecodeError> {
    match (resource, lease_id) {
        (Some(r), None) => check_name("resource", r),
        (None, Some(_)) if need_token && token.is_none() => {
            Err(DecodeError::Malformed("lease_id needs its token".into()))
        }
        (None, Some(_)) => Ok(()),
        (Some(_), Some(_)) => Err(DecodeError::Malformed(
            "give resource or lease_id, not both".into(),
        )),
        (None, None) => Err(DecodeError::Malformed(
            "missing field `resource` (or `lease_id`)".into(),
        )),
    }
}

fn validate(req: &Request) -> Result<(), DecodeError> {
    match req {
        Request::Acquire {
            resource,
            holder,
            ext,
            ..
        } => {
            check_name("resource", resource)?;
            check_name("holder", holder)?;
            check_ttl(ext.ttl_ms)?;
            if ext.quantity == Some(0) {
                return Err(DecodeError::Invalid("quantity must be positive".into()));
            }
            if ext.min_version.is_some() && ext.mode != Some(Mode::Shared) {
                return Err(DecodeError::Invalid(
                    "min_version applies to mode \"shared\" only".into(),
                ));
            }
            if ext.quantity.is_some() && ext.mode.is_some() {
                return Err(DecodeError::Invalid(
                    "quantity and mode do not combine (a pool has no modes)".into(),
                ));
            }
            if ext.quantity.is_none() && (ext.requirements.is_some() || ext.attributes.is_some()) {
                return Err(DecodeError::Invalid(
                    "requirements and attributes go with quantity".into(),
                ));
            }
            check_selector(ext.requirements.as_deref())?;
            check_attributes(ext.attributes.as_ref())?;
            check_ttl(ext.timeout_ms)?;
            if let Some(g) = &ext.gang {
                if ext.quantity.is_some() || ext.mode == Some(Mode::Exclusive) {
                    return Err(DecodeError::Invalid(
                        "a gang is exclusive (no mode), TTL (ttl_ms) or shared (mode \"shared\", \
                         with or without ttl_ms): no quantity, no mode \"exclusive\""
                            .into(),
                    ));
                }
                if ext.min_version.is_some() {
                    return Err(DecodeError::Invalid(
                        "min_version does not go with gang (a member waiting for a version \
                         would hold the whole gang back)"
                            .into(),
                    ));
                }
                if g.is_empty() || g.len() > MAX_GANG {
                    return Err(DecodeError::Invalid(format!(
                        "a gang has 1 to {MAX_GANG} resources"
                    )));
                }
                let mut seen = std::collections::BTreeSet::new();
                for r in g {
                    check_name("gang resource", r)?;
                    if !seen.insert(r) {
                        return Err(DecodeError::Invalid(format!("{r:?} twice in the gang")));
                    }
                }
            } else if ext.timeout_ms.is_some() {
                return Err(DecodeError::Invalid("timeout_ms goes with gang".into()));
            }
            check_ttl(ext.reserve_ms)?;
            if ext.reserve_ms.is_some() && ext.kind() != LeaseKind::Exclusive {
                return Err(DecodeError::Invalid(
                    "reserve_ms goes with exclusive connection-bound leases and gangs".into(),
                ));
            }
            Ok(())
        }
        Request::Reclaim {
            resource, holder, ..
        } => {
            check_name("resource", resource)?;
            check_name("holder", holder)
        }
        Request::Release {
            resource,
            lease_id,
            token,
        } => check_target(resource.as_deref(), *lease_id, token.as_deref(), true),
        Request::Revoke {
            resource, lease_id, ..
        } => check_target(resource.as_deref(), *lease_id, None, false),
        Request::Renew { ttl_ms, .. } => check_ttl(*ttl_ms),
        Request::Leases { resource, holder } => {
            if let Some(r) = resource {
                check_name("resource", r)?;
            }
            if let Some(h) = holder {
                check_name("holder", h)?;
            }
            Ok(())
        }
        Request::Offer {
            pool,
            name,
            attributes,
            requirements,
            max_lease_time_ms,
            ..
        } => {
            check_name("pool", pool)?;
            check_name("offer name", name)?;
            check_ttl(*max_lease_time_ms)?;
            check_selector(requirements.as_deref())?;
            check_attributes(Some(attributes))
        }
        Request::Withdraw { pool, name, .. } => {
            check_name("pool", pool)?;
            check_name("offer name", name)
        }
        Request::Start { resource } => check_name("resource", resource),
        Request::Status { .. }
        | Request::Watch
        | Request::Ping
        | Request::Anchor
        | Request::Commit { .. }
        | Request::Resume { .. }
        | Request::Lease { .. } => Ok(()),
    }
}

/// Encode a request as one line, newline included.
pub fn encode_request(req: &Request) -> String {
    let mut s = serde_json::to_string(req).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}

/// Error codes of the `error` event (stable strings; see PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON / not an object / missing or mistyped fields.
    BadRequest,
    /// Unknown `op`.
    UnknownOp,
    /// Line over the bound; the connection is closed after this event.
    LineTooLong,
    /// A name is empty, too long or has control characters.
    InvalidArgument,
    /// This connection already holds the resource.
    AlreadyHeld,
    /// This connection is already queued for the resource.
    AlreadyQueued,
    /// release: this connection neither holds nor waits for the resource.
    NotHolder,
    /// revoke: nobody holds the resource.
    NotHeld,
    /// revoke over TCP without the right admin token.
    Unauthorized,
    /// reclaim: no matching lease in a reconnect window (expired, revoked, wrong token).
    ReclaimRefused,
    /// Too many requests; the connection is closed after this event.
    RateLimited,
    /// Connected but sent no request in time; the connection is closed after this event.
    IdleTimeout,
    /// lockd is stopping.
    ShuttingDown,
    /// anchor: no file descriptor came with the request, the transport cannot carry one
    /// (TCP), or the descriptor is not a stream socket.
    AnchorRefused,
    /// Version 2: the resource is in use by a lease of another kind.
    KindMismatch,
    /// Version 2: no live lease (or waiting request) has this id.
    UnknownLease,
    /// Version 2: the token does not match the lease.
    BadToken,
    /// Version 2: the lease has ended (expired, revoked, released): re-acquire.
    LeaseEnded,
    /// Version 2: renewal refused (max total lease time reached, or an offer shrank).
    RenewalRefused,
    /// Version 2: the request cannot be granted now (`wait:false`) from the pool's offers.
    Unavailable,
    /// Version 2: the pool's matching offers can never grant this quantity.
    Unsatisfiable,
    /// Version 2: commit by a lease that is not the exclusive holder (or not a shared-kind
    /// lease), renew of a lease without a deadline, and similar mismatches.
    WrongLease,
    /// Version 2: offer/withdraw: unknown offer, or an invalid one.
    BadOffer,
}

impl ErrorCode {
    /// The wire string of this code.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownOp => "unknown_op",
            ErrorCode::LineTooLong => "line_too_long",
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::AlreadyHeld => "already_held",
            ErrorCode::AlreadyQueued => "already_queued",
            ErrorCode::NotHolder => "not_holder",
            ErrorCode::NotHeld => "not_held",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::ReclaimRefused => "reclaim_refused",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::IdleTimeout => "idle_timeout",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::AnchorRefused => "anchor_refused",
            ErrorCode::KindMismatch => "kind_mismatch",
            ErrorCode::UnknownLease => "unknown_lease",
            ErrorCode::BadToken => "bad_token",
            ErrorCode::LeaseEnded => "lease_ended",
            ErrorCode::RenewalRefused => "renewal_refused",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unsatisfiable => "unsatisfiable",
            ErrorCode::WrongLease => "wrong_lease",
            ErrorCode::BadOffer => "bad_offer",
        }
    }
}

/// What kind of lease change a `notice` (watch stream) reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoticeKind {
    /// A lease was granted (new epoch) or reclaimed (same epoch, `reclaimed: true`).
    Granted,
    /// A lease ended because its connection closed or it was released.
    Released,
    /// A persisted lease was not reclaimed within the reconnect window.
    Expired,
    /// An operator revoked a lease (it stays held until its connection closes).
    Revoked,
    /// Version 2: an exclusive holder committed a new version of a shared resource.
    Committed,
    /// Version 2: sessions wait for each other in a cycle (`reason` lists them and the
    /// resources); `session` is one of them.
    Deadlock,
}

/// One lease change, as streamed to watchers and logged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// What happened.
    pub kind: NoticeKind,
    /// Which resource.
    pub resource: String,
    /// The holder name of the lease concerned.
    pub holder: Option<String>,
    /// The lease's epoch.
    pub epoch: u64,
    /// The lockd session (connection) concerned, if one.
    #[serde(default)]
    pub session: Option<u64>,
    /// Granted: whether it was a reclaim of an existing lease.
    #[serde(default)]
    pub reclaimed: bool,
    /// Released: the lease had been revoked before (then it counts as a revocation only).
    #[serde(default)]
    pub after_revoke: bool,
    /// Revoked: the operator's reason.
    #[serde(default)]
    pub reason: Option<String>,
    /// Wall clock of the change, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// Version 2: the lease's id (absent for version-1 leases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<u64>,
    /// Version 2: the lease's kind (absent for version-1 leases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_kind: Option<LeaseKind>,
    /// Version 2: shared leases: the resource's version (after a commit, the new one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// Peer identity of a session, shown in status and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// `unix` or `tcp`.
    pub transport: String,
    /// SO_PEERCRED pid (Unix only).
    pub pid: Option<i32>,
    /// SO_PEERCRED uid (Unix only).
    pub uid: Option<u32>,
    /// SO_PEERCRED gid (Unix only).
    pub gid: Option<u32>,
    /// Remote address (TCP only).
    pub addr: Option<String>,
}

/// One session as shown in status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionReport {
    /// Session id (unique for the life of this lockd process).
    pub id: u64,
    /// Who is on the other end.
    #[serde(flatten)]
    pub peer: PeerInfo,
    /// Resources held by this session.
    pub holds: Vec<String>,
    /// Resources this session is queued for.
    pub waits: Vec<String>,
    /// Whether the session receives notices.
    pub watching: bool,
    /// Whether its connection is still open (false: kept alive by its anchors only).
    #[serde(default = "default_true")]
    pub connected: bool,
    /// Anchors attached and still open.
    #[serde(default)]
    pub anchors: u32,
}

/// The state of a resource's lease as shown in status (`"state"` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Nobody holds it: the next acquire is granted at once.
    Free,
    /// A session holds the lease.
    Held,
    /// A lease from before a restart, waiting for its holder to reclaim it.
    Reclaiming,
}

impl LeaseState {
    /// The wire string of this state (`free`, `held` or `reclaiming`).
    pub fn as_str(&self) -> &'static str {
        match self {
            LeaseState::Free => "free",
            LeaseState::Held => "held",
            LeaseState::Reclaiming => "reclaiming",
        }
    }
}

impl std::fmt::Display for LeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One resource as shown in status (fields required by docs/INTERFACES.md first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceReport {
    /// Resource name.
    pub name: String,
    /// Holder name of the current (or reclaiming) lease.
    pub holder: Option<String>,
    /// Epoch of the current lease, or the last granted one when free (0: never granted).
    pub epoch: u64,
    /// `free`, `held` or `reclaiming`.
    pub state: LeaseState,
    /// Waiter holder names in grant order.
    pub waiters: Vec<String>,
    /// The session holding the lease (absent while reclaiming or free).
    #[serde(default)]
    pub holder_session: Option<u64>,
    /// Peer identity of the holder's connection.
    #[serde(default)]
    pub holder_peer: Option<PeerInfo>,
    /// Whether the current lease has been revoked (still held until its connection closes).
    #[serde(default)]
    pub revoked: bool,
    /// When the current lease was granted (ms since the Unix epoch).
    #[serde(default)]
    pub granted_at_unix_ms: Option<u64>,
    /// Reclaiming: milliseconds left in the reconnect window.
    #[serde(default)]
    pub reclaim_remaining_ms: Option<u64>,
    /// Version 2: the kind of the leases on it, when not `exclusive` (version 1's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<LeaseKind>,
    /// Version 2: every holder name, when the kind allows several (shared, quantity); in
    /// the summary, the first few (see `holder_count`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<String>,
    /// Summary only (`"sessions":false`): how many waiters there are; `waiters` then lists
    /// the first few in grant order (at most `STATUS_SUMMARY_NAMES`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiter_count: Option<usize>,
    /// Summary only, kinds that list `holders`: how many holders there are; `holders` then
    /// lists the first few.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_count: Option<usize>,
}

/// Names of waiters (and of holders) a resource lists in the `status` summary
/// (`"sessions":false`); `waiter_count` and `holder_count` say how many there are.
pub const STATUS_SUMMARY_NAMES: usize = 4;

/// Lease-end counters and grant counters since this state file was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// New leases granted (new epochs).
    pub grants: u64,
    /// Leases ended by connection close or explicit release.
    pub releases: u64,
    /// Persisted leases not reclaimed within the reconnect window.
    pub expirations: u64,
    /// Leases revoked by an operator.
    pub revocations: u64,
    /// Leases taken back after a reconnect (same epoch).
    #[serde(default)]
    pub reclaims: u64,
    /// Version 2: wait-for cycles found (omitted while 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deadlocks: u64,
    /// Version 2: leases lockd revoked to break a deadlock (`--break-deadlocks`; also counted
    /// in `revocations`; omitted while 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deadlock_breaks: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A wait-for cycle, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadlockReport {
    /// The sessions, each waiting for a resource the next one holds (the last for the
    /// first's).
    pub sessions: Vec<u64>,
    /// The resources they wait for, in the same order.
    pub resources: Vec<String>,
}

/// The `status` answer (printed by `lockd status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Every known resource, sorted by name.
    pub resources: Vec<ResourceReport>,
    /// Counters.
    pub counters: Counters,
    /// Connected sessions (omitted when the request said `"sessions":false`).
    #[serde(default)]
    pub sessions: Vec<SessionReport>,
    /// Version 2: how many sessions there are (always given when `sessions` is omitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_count: Option<usize>,
    /// Version 2: live leases of the kinds `ttl`, `shared` and `quantity`, and their
    /// waiting requests (omitted when there are none, and in the summary).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<LeaseReport>,
    /// Version 2, summary (`"sessions":false`): how many version-2 leases and waiting
    /// requests there are (the list is `leases`' business).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_count: Option<usize>,
    /// Version 2: quantity pools (omitted when there are none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolReport>,
    /// Version 2: the wait-for cycles that exist now (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deadlocks: Vec<DeadlockReport>,
    /// Version 2: counters of each lease kind other than `exclusive` that has been used.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counters_by_kind: BTreeMap<LeaseKind, KindCounters>,
}

/// Counters of one lease kind (persisted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindCounters {
    /// Leases granted.
    pub grants: u64,
    /// Leases released by their holder (or their connection's close).
    pub releases: u64,
    /// Leases that ran out (TTL, lease time, reconnect window).
    pub expirations: u64,
    /// Leases revoked (by an operator, or lockd), counted apart from expirations.
    pub revocations: u64,
    /// Renewals accepted.
    pub renewals: u64,
    /// Renewals refused (ended lease, max total lease time, shrunk offer).
    pub renewals_refused: u64,
    /// Commits (shared leases: new versions).
    pub commits: u64,
}

/// The version-2 fields of `granted` (and of lease reports). All absent for a
/// version-1 lease, so version-1 replies are unchanged byte for byte.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseFields {
    /// The lease's id (unique for the life of the state file, never reused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<u64>,
    /// Its kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<LeaseKind>,
    /// Shared leases: the mode granted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Shared leases: the resource's version at grant time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// TTL, timed shared and quantity leases: the TTL / lease time in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// TTL, timed shared and quantity leases: the deadline (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_unix_ms: Option<u64>,
    /// Quantity leases: how much.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantity: Option<u32>,
    /// Quantity leases: from which offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations: Option<Vec<AllocationReport>>,
    /// Members of a TTL or shared gang: the gang's id (its first member's lease id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_id: Option<u64>,
}

/// One resource of a granted gang.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GangMember {
    /// The resource.
    pub resource: String,
    /// Its fencing epoch (each resource has its own sequence).
    pub epoch: u64,
    /// Shared gangs: the resource's version at the grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// Gangs of the version-2 kinds: the member's own lease id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<u64>,
}

/// A part of a quantity lease: this much from that offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationReport {
    /// The offer.
    pub offer: String,
    /// How much of it.
    pub quantity: u32,
}

/// One lease (or waiting request, or remembered end) as `lease`, `leases` and `status`
/// report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseReport {
    /// The lease id.
    pub lease_id: u64,
    /// `held`, `waiting`, `reclaiming` (restored, waiting to be resumed), `expired`,
    /// `revoked`, `released`, or `unknown` (never existed, or forgotten).
    pub state: String,
    /// Its kind (absent for `unknown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<LeaseKind>,
    /// Its resource (or pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Its holder name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Its fencing epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Ended leases: why (`released`, `expired`, `revoked:<by>:<why>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Ended leases: when (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_unix_ms: Option<u64>,
    /// When it was granted (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_at_unix_ms: Option<u64>,
    /// The session it is bound to (events go there), if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// Quantity leases: the offer whose shrinking refuses its renewals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal_refused: Option<String>,
    /// Kind-specific fields.
    #[serde(flatten)]
    pub lease: LeaseFields,
}

impl LeaseReport {
    /// The report of an id lockd does not know (never existed, or forgotten).
    pub fn unknown(lease_id: u64) -> LeaseReport {
        LeaseReport {
            lease_id,
            state: "unknown".into(),
            kind: None,
            resource: None,
            holder: None,
            epoch: None,
            reason: None,
            ended_at_unix_ms: None,
            granted_at_unix_ms: None,
            session: None,
            renewal_refused: None,
            lease: LeaseFields::default(),
        }
    }
}

/// One offer of a pool, as set and as used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferReport {
    /// The offer's name.
    pub name: String,
    /// The quantity offered.
    pub quantity: u32,
    /// Its capacity now (its quantity, or 0 once withdrawn).
    pub capacity: u64,
    /// Allocated to live leases.
    pub allocated: u64,
    /// Withdrawn, kept until its last lease ends.
    #[serde(default)]
    pub removed: bool,
    /// Its attributes.
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    /// Longest lease it allows, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lease_time_ms: Option<u64>,
    /// What it requires of requests (label-selector text; empty: anything).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub requirements: String,
}

/// A pool of quantity leases, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolReport {
    /// The pool's name.
    pub name: String,
    /// Its offers.
    pub offers: Vec<OfferReport>,
    /// Live leases.
    pub leases: usize,
    /// Requests waiting.
    pub waiting: usize,
}

/// An event from the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// First line on every connection.
    Hello {
        /// Always `lockd`.
        server: String,
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// This connection's session id.
        session: u64,
        /// Protocol-2 extensions served ([`FEATURES`]); omitted on the wire when empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        features: Vec<String>,
    },
    /// The acquire is queued; `position` 1 is next in line.
    Queued {
        /// Resource queued for.
        resource: String,
        /// 1-based place in the queue.
        position: usize,
        /// Version 2: the id the lease will have (cancel with `release` by `lease_id`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
    },
    /// Answer to acquire(wait=false) when the resource is taken.
    Busy {
        /// Resource asked for.
        resource: String,
        /// Current (or reclaiming) holder's name.
        holder: Option<String>,
    },
    /// The lease is yours.
    Granted {
        /// Resource granted.
        resource: String,
        /// The holder name of the lease.
        holder: String,
        /// Fencing epoch, strictly greater than any earlier one (same as before if reclaimed).
        epoch: u64,
        /// Secret for `reclaim` after a reconnect. Keep it private.
        token: String,
        /// True when this is a reclaim of an earlier lease.
        reclaimed: bool,
        /// Version 2: what kind of lease, its id, deadline, version, allocations.
        #[serde(flatten)]
        lease: LeaseFields,
    },
    /// Answer to release of a held lease.
    Released {
        /// Resource released.
        resource: String,
        /// Epoch of the lease that ended.
        epoch: u64,
        /// Version 2: the lease that ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
    },
    /// Answer to release of a queued (not yet granted) acquire.
    Cancelled {
        /// Resource no longer waited for.
        resource: String,
    },
    /// Your lease was revoked: fence yourself and let go (close or release).
    Revoked {
        /// Resource revoked.
        resource: String,
        /// Epoch of the revoked lease.
        epoch: u64,
        /// Operator's reason.
        reason: String,
    },
    /// Answer to a successful revoke request.
    RevokeSent {
        /// Resource revoked.
        resource: String,
        /// Epoch of the revoked lease.
        epoch: u64,
        /// Holder that was told.
        holder: Option<String>,
    },
    /// Answer to status.
    Status(Box<StatusReport>),
    /// Answer to watch; notices follow.
    Watching {},
    /// A lease change (watchers only).
    Notice(Notice),
    /// Answer to ping.
    Pong {
        /// On the etcd backend, once the session has an etcd lease: for how many more
        /// milliseconds lockd vouches for it (its self-fence deadline minus now). A holder's
        /// watchdog gives up no later than that after this answer arrived (`docs/ETCD.md`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        valid_ms: Option<u64>,
    },
    /// Answer to anchor: the session now has `anchors` open anchors.
    Anchored {
        /// Open anchors of this session, the new one included.
        anchors: u32,
    },
    /// Version 2 (`reserve`): answer to `start`: the reservation is confirmed.
    Started {
        /// The resource (each member of a gang is answered).
        resource: String,
        /// Its epoch.
        epoch: u64,
    },
    /// Version 2 (`gang`): every resource of the gang is yours, atomically.
    GangGranted {
        /// The gang's name (the acquire's `resource`).
        resource: String,
        /// The gang's id (release it whole with `release {lease_id, token}`).
        gang_id: u64,
        /// The holder name.
        holder: String,
        /// The gang's token (also each member's reclaim token).
        token: String,
        /// Each member: its resource and its own epoch.
        members: Vec<GangMember>,
        /// `ttl` (a TTL gang), `shared` (a shared gang); absent for a connection-bound
        /// exclusive gang.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<LeaseKind>,
        /// Timed gangs: the deadline of every member (ms since the Unix epoch).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at_unix_ms: Option<u64>,
    },
    /// Version 2 (`gang`): one member of a granted gang was taken away (revoked by an
    /// admin, or its lease ended by itself): fence it and reserve a replacement. A gang of
    /// the version-2 kinds ends whole right after (its members' `lease_ended` follow); a
    /// connection-bound exclusive gang keeps its other members.
    MemberLost {
        /// The gang's id.
        gang_id: u64,
        /// The member taken away.
        resource: String,
        /// Its epoch.
        epoch: u64,
        /// Why: `revoked:<by>:<why>`, `expired`, ...
        reason: String,
    },
    /// Version 2: answer to `renew`.
    Renewed {
        /// The lease.
        lease_id: u64,
        /// Its resource (or pool).
        resource: String,
        /// Its new deadline (ms since the Unix epoch).
        expires_at_unix_ms: u64,
    },
    /// Version 2: answer to `commit`: the resource's new version (durable).
    Committed {
        /// The lease.
        lease_id: u64,
        /// Its resource.
        resource: String,
        /// The new version.
        version: u64,
    },
    /// Version 2: a lease of this connection (or resumed by it) ended without its asking:
    /// its TTL ran out, it was revoked, or (shared) its reconnect window ended.
    LeaseEnded {
        /// The lease.
        lease_id: u64,
        /// Its resource (or pool).
        resource: String,
        /// Its epoch.
        epoch: u64,
        /// `expired`, `revoked:<by>:<why>`, `released`.
        reason: String,
    },
    /// Version 2: answer to `lease`.
    Lease(Box<LeaseReport>),
    /// Version 2: answer to `leases`.
    Leases {
        /// Live leases (and waiting requests), by lease id.
        leases: Vec<LeaseReport>,
    },
    /// Version 2: answer to `offer`.
    Offered {
        /// The pool.
        pool: String,
        /// The offer as now set.
        offer: Box<OfferReport>,
        /// Leases whose renewals are now refused (the offer shrank below its allocations).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        renewal_refused: Vec<u64>,
    },
    /// Version 2: answer to `withdraw`.
    Withdrawn {
        /// The pool.
        pool: String,
        /// The offer.
        name: String,
        /// Leases whose renewals are now refused (they run out on their own).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        renewal_refused: Vec<u64>,
    },
    /// Version 2: your quantity lease will not be renewed: `offer` shrank or went away.
    /// Finish before `expires_at_unix_ms`.
    RenewalRefused {
        /// The lease.
        lease_id: u64,
        /// Its pool.
        resource: String,
        /// The offer that shrank.
        offer: String,
    },
    /// Version 2: capacity came back; your quantity lease may be renewed again.
    RenewalAllowed {
        /// The lease.
        lease_id: u64,
        /// Its pool.
        resource: String,
    },
    /// Something went wrong with a request (or the connection is about to be closed).
    Error {
        /// Stable code, see [`ErrorCode`].
        code: String,
        /// Human-readable detail.
        message: String,
        /// The resource concerned, when there is one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resource: Option<String>,
    },
}

impl Event {
    /// An `error` event.
    pub fn error(code: ErrorCode, message: impl Into<String>, resource: Option<&str>) -> Event {
        Event::Error {
            code: code.as_str().to_string(),
            message: message.into(),
            resource: resource.map(str::to_string),
        }
    }

    /// Encode as one line, newline included.
    pub fn encode(&self) -> String {
        self.encode_v1_fast().unwrap_or_else(|| self.encode_serde())
    }

    /// [`Event::encode`] through serde alone (what the fast path must match byte for byte).
    fn encode_serde(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }

    /// The events of a version-1 hand-over (`granted`, `queued`, `released` without any
    /// version-2 field), written by hand, byte for byte as serde writes them
    /// (`fast_encoding_is_serdes_byte_for_byte`); `None` for every other event.
    fn encode_v1_fast(&self) -> Option<String> {
        let mut s = String::with_capacity(160);
        match self {
            Event::Granted {
                resource,
                holder,
                epoch,
                token,
                reclaimed,
                lease,
            } if lease.is_v1() => {
                s.push_str("{\"event\":\"granted\",\"resource\":");
                push_json_str(&mut s, resource);
                s.push_str(",\"holder\":");
                push_json_str(&mut s, holder);
                s.push_str(",\"epoch\":");
                push_u64(&mut s, *epoch);
                s.push_str(",\"token\":");
                push_json_str(&mut s, token);
                s.push_str(if *reclaimed {
                    ",\"reclaimed\":true}"
                } else {
                    ",\"reclaimed\":false}"
                });
            }
            Event::Queued {
                resource,
                position,
                lease_id: None,
            } => {
                s.push_str("{\"event\":\"queued\",\"resource\":");
                push_json_str(&mut s, resource);
                s.push_str(",\"position\":");
                push_u64(&mut s, *position as u64);
                s.push('}');
            }
            Event::Released {
                resource,
                epoch,
                lease_id: None,
            } => {
                s.push_str("{\"event\":\"released\",\"resource\":");
                push_json_str(&mut s, resource);
                s.push_str(",\"epoch\":");
                push_u64(&mut s, *epoch);
                s.push('}');
            }
            _ => return None,
        }
        s.push('\n');
        Some(s)
    }
}

impl LeaseFields {
    /// No version-2 field: a version-1 lease.
    fn is_v1(&self) -> bool {
        let LeaseFields {
            lease_id,
            kind,
            mode,
            version,
            ttl_ms,
            expires_at_unix_ms,
            quantity,
            allocations,
            gang_id,
        } = self;
        gang_id.is_none()
            && lease_id.is_none()
            && kind.is_none()
            && mode.is_none()
            && version.is_none()
            && ttl_ms.is_none()
            && expires_at_unix_ms.is_none()
            && quantity.is_none()
            && allocations.is_none()
    }
}

/// Appends `n` in decimal, as serde_json writes it (through `itoa`, as serde_json does).
fn push_u64(s: &mut String, n: u64) {
    s.push_str(itoa::Buffer::new().format(n));
}

/// Appends `v` as a JSON string, escaped as serde_json escapes it: `"` and `\`, the
/// control characters below 0x20 (`\b \t \n \f \r` by name, the others as `\u00XX`),
/// nothing else.
fn push_json_str(s: &mut String, v: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    s.push('"');
    if !v.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        // The usual name or token: nothing to escape.
        s.push_str(v);
        s.push('"');
        return;
    }
    let mut start = 0;
    for (i, b) in v.bytes().enumerate() {
        let esc: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x09 => "\\t",
            0x0a => "\\n",
            0x0c => "\\f",
            0x0d => "\\r",
            0..=0x1f => "",
            _ => continue,
        };
        s.push_str(&v[start..i]);
        if esc.is_empty() {
            s.push_str("\\u00");
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        } else {
            s.push_str(esc);
        }
        start = i + 1;
    }
    s.push_str(&v[start..]);
    s.push('"');
}

/// Decode one event line (client side). Never panics.
pub fn decode_event(line: &[u8]) -> Result<Event, DecodeError> {
    let text = std::str::from_utf8(line).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    serde_json::from_str(text.trim_end()).map_err(|e| DecodeError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines the fast-path test feeds both parsers: well-formed compact requests in
    /// every key order and spacing, and near misses of every kind.
    fn fast_path_lines() -> Vec<String> {
        let names = [
            r#""gpu0""#,
            r#""engine-a""#,
            r#""é日本""#,
            r#""a b""#,
            r#""""#,
            r#""q\"uote""#,
            r#""back\\slash""#,
            r#""\u0067pu""#,
            r#""tab	raw""#,
            r#""nl\n""#,
            "\"\u{7f}del\"",
            r#"5"#,
            r#"null"#,
            r#"["x"]"#,
            r#""unterminated"#,
        ];
        let ops = [
            r#""acquire""#,
            r#""release""#,
            r#""ACQUIRE""#,
            r#""acquire ""#,
            r#""renew""#,
            r#"1"#,
            r#""rel\u0065ase""#,
        ];
        let waits = ["true", "false", "1", r#""true""#, "null", "tru", "falsey"];
        let extras = [
            r#""ttl_ms":5"#,
            r#""gang":["a","b"]"#,
            r#""lease_id":3"#,
            r#""token":"t""#,
            r#""x":1"#,
            r#""op":"acquire""#,
            r#""resource":"dup""#,
            r#""wait":true"#,
        ];
        let spaces = ["", " ", "\t", " \n ", "\r\n"];
        let mut lines = Vec::new();
        // Every op x name x key order, compact and spaced.
        for (oi, op) in ops.iter().enumerate() {
            for (ni, name) in names.iter().enumerate() {
                let sp = spaces[(oi + ni) % spaces.len()];
                let holder = names[(ni + 1) % names.len()];
                let kv = |k: &str, v: &str| format!("{sp}\"{k}\"{sp}:{sp}{v}{sp}");
                let orders: [Vec<String>; 4] = [
                    vec![kv("op", op), kv("resource", name), kv("holder", holder)],
                    vec![kv("resource", name), kv("op", op), kv("holder", holder)],
                    vec![kv("holder", holder), kv("resource", name), kv("op", op)],
                    vec![kv("op", op), kv("resource", name)],
                ];
                for o in orders {
                    lines.push(format!("{{{}}}", o.join(",")));
                    lines.push(format!("{sp}{{{}}}{sp}", o.join(",")));
                }
                for w in waits {
                    lines.push(format!(
                        "{{{},{},{},{}}}",
                        kv("op", op),
                        kv("resource", name),
                        kv("wait", w),
                        kv("holder", holder)
                    ));
                }
            }
        }
        // Well-formed lines of both ops, in every key order, spacing and `wait`.
        let good_names = ["gpu0", "engine-a", "é日本", "a b", "x/y.z:1", ""];
        for (ni, n) in good_names.iter().enumerate() {
            for sp in spaces {
                let h = good_names[(ni + 2) % good_names.len()];
                let (r, hk) = (
                    format!("{sp}\"resource\"{sp}:{sp}\"{n}\""),
                    format!("\"holder\":{sp}\"{h}\""),
                );
                for w in ["", ",\"wait\":true", ",\"wait\" : false"] {
                    lines.push(format!("{{\"op\":\"acquire\",{r},{hk}{w}}}"));
                    lines.push(format!("{{{r},{sp}\"op\":\"acquire\"{w},{hk}{sp}}}"));
                    lines.push(format!("{sp}{{{hk},{r}{w},\"op\"{sp}:{sp}\"acquire\"}}"));
                }
                lines.push(format!("{{\"op\":\"release\",{r}}}"));
                lines.push(format!("{{{r}{sp},{sp}\"op\":\"release\"{sp}}}{sp}"));
            }
        }
        // Extra fields anywhere, on both ops.
        for op in ["acquire", "release"] {
            for e in extras {
                for pos in 0..4 {
                    let mut kvs = vec![
                        format!(r#""op":"{op}""#),
                        r#""resource":"r""#.to_string(),
                        r#""holder":"h""#.to_string(),
                    ];
                    kvs.insert(pos.min(kvs.len()), e.to_string());
                    lines.push(format!("{{{}}}", kvs.join(",")));
                    kvs.remove(2.min(kvs.len() - 1));
                    lines.push(format!("{{{}}}", kvs.join(",")));
                }
            }
        }
        // Broken syntax around a good line: every prefix, and stray bytes.
        let good = r#"{"op":"acquire","resource":"gpu0","holder":"a","wait":false}"#;
        for k in 0..good.len() {
            lines.push(good[..k].to_string());
            let mut m = good.to_string();
            m.insert(k, ',');
            lines.push(m);
        }
        for tail in ["}", "x", ",", " {}", "\u{0}", "\u{a0}"] {
            lines.push(format!("{good}{tail}"));
            lines.push(format!(r#"{{"op":"release","resource":"r"}}{tail}"#));
        }
        for odd in [
            "{}",
            "[]",
            "null",
            r#"{"op":"release"}"#,
            r#"{"op":"acquire","resource":"r"}"#,
            r#"{"op":"release","resource":"r",}"#,
            r#"{,"op":"release","resource":"r"}"#,
            r#"{"op":"release" "resource":"r"}"#,
            r#"{"op":"release","resource":"r"}}"#,
            r#"{"op""release","resource":"r"}"#,
            r#"{'op':'release','resource':'r'}"#,
            r#"{"\u006fp":"release","resource":"r"}"#,
            r#"{"op":"release","resource":"r","holder":"h"}"#,
            r#"{"op":"release","resource":"r","wait":true}"#,
        ] {
            lines.push(odd.to_string());
        }
        lines
    }

    #[test]
    fn fast_encoding_is_serdes_byte_for_byte() {
        let mut names: Vec<String> = [
            "gpu0",
            "",
            "a\"b",
            "back\\slash",
            "/slash/",
            "é日本",
            "\u{7f}del",
            "\u{2028}",
            "emoji 🦀",
            "tab\tnl\ncr\rff\u{c}bs\u{8}",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // Every control character, and each next to ordinary text.
        for c in 0u8..0x20 {
            names.push(char::from(c).to_string());
            names.push(format!("x{}y", char::from(c)));
        }
        let mut n = 0;
        for (i, r) in names.iter().enumerate() {
            let h = &names[(i * 7 + 3) % names.len()];
            for num in [0u64, 1, 9, 10, 42, 1_000_000, u64::MAX] {
                let evs = [
                    Event::Granted {
                        resource: r.clone(),
                        holder: h.clone(),
                        epoch: num,
                        token: h.clone(),
                        reclaimed: num % 2 == 1,
                        lease: LeaseFields::default(),
                    },
                    Event::Queued {
                        resource: r.clone(),
                        position: num as usize,
                        lease_id: None,
                    },
                    Event::Released {
                        resource: r.clone(),
                        epoch: num,
                        lease_id: None,
                    },
                ];
                for ev in evs {
                    assert!(ev.encode_v1_fast().is_some());
                    assert_eq!(ev.encode(), ev.encode_serde(), "{ev:?}");
                    n += 1;
                }
            }
        }
        assert!(n > 700, "{n}");
        // Anything version 2 is left to serde.
        let v2 = [
            Event::Granted {
                resource: "r".into(),
                holder: "h".into(),
                epoch: 1,
                token: "t".into(),
                reclaimed: false,
                lease: LeaseFields {
                    lease_id: Some(3),
                    ..LeaseFields::default()
                },
            },
            Event::Queued {
                resource: "r".into(),
                position: 1,
                lease_id: Some(3),
            },
            Event::Released {
                resource: "r".into(),
                epoch: 1,
                lease_id: Some(3),
            },
            Event::Cancelled {
                resource: "r".into(),
            },
        ];
        for ev in v2 {
            assert!(ev.encode_v1_fast().is_none());
            assert_eq!(ev.encode(), ev.encode_serde());
        }
    }

    #[test]
    fn fast_path_agrees_with_serde() {
        let lines = fast_path_lines();
        assert!(lines.len() >= 1_700, "{} lines", lines.len());
        let mut fast = 0;
        for l in &lines {
            if let Some(r) = decode_v1_fast(l) {
                fast += 1;
                let s = serde_json::from_str::<Request>(l);
                assert_eq!(
                    s.as_ref().ok(),
                    Some(&r),
                    "fast path disagrees on {l:?}: {s:?}"
                );
            }
            // The whole decoder (fast path, then serde) answers as serde alone does.
            assert_eq!(
                decode_request(l.as_bytes(), 64 * 1024),
                decode_serde(l.strip_suffix('\r').unwrap_or(l)),
                "{l:?}"
            );
        }
        // Not vacuous: the fast path took a good share of the lines, and refused others.
        assert!(
            fast > 200 && fast < lines.len() / 2,
            "{fast} of {}",
            lines.len()
        );
    }

    #[test]
    fn acquire_defaults_wait_true() {
        let r = decode_request(br#"{"op":"acquire","resource":"e","holder":"a"}"#, 1024).unwrap();
        assert_eq!(r, Request::acquire("e", "a", true));
    }

    #[test]
    fn classifies_errors() {
        let max = 64;
        assert_eq!(
            decode_request(b"nope", max).unwrap_err().code(),
            ErrorCode::BadRequest
        );
        assert_eq!(
            decode_request(b"[1]", max).unwrap_err().code(),
            ErrorCode::BadRequest
        );
        assert_eq!(
            decode_request(b"{}", max).unwrap_err().code(),
            ErrorCode::BadRequest
        );
        assert_eq!(
            decode_request(br#"{"op":"fly"}"#, max).unwrap_err().code(),
            ErrorCode::UnknownOp
        );
        assert_eq!(
            decode_request(br#"{"op":"release"}"#, max)
                .unwrap_err()
                .code(),
            ErrorCode::BadRequest
        );
        assert_eq!(
            decode_request(br#"{"op":"release","resource":""}"#, max)
                .unwrap_err()
                .code(),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            decode_request(&[b' '; 65], max).unwrap_err().code(),
            ErrorCode::LineTooLong
        );
        assert_eq!(
            decode_request(&[0xff, 0xfe], max).unwrap_err().code(),
            ErrorCode::BadRequest
        );
    }

    /// The `"state"` field of a status resource is the same bytes as when it was a string.
    #[test]
    fn lease_state_wire_format_unchanged() {
        for (state, wire) in [
            (LeaseState::Free, "free"),
            (LeaseState::Held, "held"),
            (LeaseState::Reclaiming, "reclaiming"),
        ] {
            assert_eq!(state.as_str(), wire);
            assert_eq!(state.to_string(), wire);
            let report = ResourceReport {
                name: "e".into(),
                holder: Some("a".into()),
                epoch: 3,
                state,
                waiters: vec!["b".into()],
                holder_session: Some(1),
                holder_peer: None,
                revoked: false,
                granted_at_unix_ms: Some(7),
                reclaim_remaining_ms: None,
                kind: None,
                holders: vec![],
                waiter_count: None,
                holder_count: None,
            };
            let json = serde_json::to_string(&report).unwrap();
            let want = format!(
                r#"{{"name":"e","holder":"a","epoch":3,"state":"{wire}","waiters":["b"],"holder_session":1,"holder_peer":null,"revoked":false,"granted_at_unix_ms":7,"reclaim_remaining_ms":null}}"#
            );
            assert_eq!(json, want);
            let back: ResourceReport = serde_json::from_str(&json).unwrap();
            assert_eq!(back.state, state);
            let status = Event::Status(Box::new(StatusReport {
                resources: vec![report],
                counters: Counters::default(),
                sessions: vec![],
                session_count: None,
                leases: vec![],
                pools: vec![],
                counters_by_kind: BTreeMap::new(),
                deadlocks: vec![],
                lease_count: None,
            }))
            .encode();
            assert!(status.contains(&format!(r#""state":"{wire}""#)), "{status}");
            assert_eq!(decode_event(status.as_bytes()).unwrap().encode(), status);
        }
        assert!(serde_json::from_str::<LeaseState>(r#""Held""#).is_err());
        assert!(serde_json::from_str::<LeaseState>(r#""busy""#).is_err());
    }

    #[test]
    fn events_round_trip() {
        let evs = vec![
            Event::Hello {
                server: "lockd".into(),
                version: 1,
                session: 3,
                features: vec![],
            },
            Event::Hello {
                server: "lockd".into(),
                version: PROTOCOL_VERSION,
                session: 3,
                features: vec!["ttl".into()],
            },
            Event::Granted {
                resource: "r".into(),
                holder: "h".into(),
                epoch: 9,
                token: "t".into(),
                reclaimed: false,
                lease: LeaseFields::default(),
            },
            Event::Watching {},
            Event::Pong { valid_ms: None },
            Event::Pong {
                valid_ms: Some(2900),
            },
            Event::error(ErrorCode::NotHolder, "x", Some("r")),
            Event::Status(Box::new(StatusReport {
                resources: vec![],
                counters: Counters::default(),
                sessions: vec![],
                session_count: None,
                leases: vec![],
                pools: vec![],
                counters_by_kind: BTreeMap::new(),
                deadlocks: vec![],
                lease_count: None,
            })),
        ];
        for e in evs {
            let line = e.encode();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(decode_event(line.as_bytes()).unwrap(), e);
        }
    }

    #[test]
    fn hello_announces_version_2_and_version_1_events_are_byte_for_byte_unchanged() {
        // Version 2: the version number and the features differ from version 1.
        let hello = Event::Hello {
            server: "lockd".into(),
            version: PROTOCOL_VERSION,
            session: 7,
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
        };
        assert_eq!(PROTOCOL_VERSION, 2);
        assert_eq!(
            hello.encode(),
            "{\"event\":\"hello\",\"server\":\"lockd\",\"version\":2,\"session\":7,\
             \"features\":[\"ttl\",\"shared\",\"quantity\",\"gang\",\"reserve\"]}\n"
        );
        // A version-1 hello (no `features`) still decodes.
        assert!(matches!(
            decode_event(br#"{"event":"hello","server":"lockd","version":1,"session":7}"#),
            Ok(Event::Hello { version: 1, ref features, .. }) if features.is_empty()
        ));
        // The version-1 events, exactly as PROTOCOL.md shows them.
        let golden: Vec<(Event, &str)> = vec![
            (
                Event::Granted {
                    resource: "engine".into(),
                    holder: "me".into(),
                    epoch: 5,
                    token: "3f0c".into(),
                    reclaimed: false,
                    lease: LeaseFields::default(),
                },
                r#"{"event":"granted","resource":"engine","holder":"me","epoch":5,"token":"3f0c","reclaimed":false}"#,
            ),
            (
                Event::Queued {
                    resource: "engine".into(),
                    position: 1,
                    lease_id: None,
                },
                r#"{"event":"queued","resource":"engine","position":1}"#,
            ),
            (
                Event::Busy {
                    resource: "engine".into(),
                    holder: None,
                },
                r#"{"event":"busy","resource":"engine","holder":null}"#,
            ),
            (
                Event::Released {
                    resource: "engine".into(),
                    epoch: 5,
                    lease_id: None,
                },
                r#"{"event":"released","resource":"engine","epoch":5}"#,
            ),
            (
                Event::Revoked {
                    resource: "engine".into(),
                    epoch: 5,
                    reason: "drain".into(),
                },
                r#"{"event":"revoked","resource":"engine","epoch":5,"reason":"drain"}"#,
            ),
            (Event::Pong { valid_ms: None }, r#"{"event":"pong"}"#),
            (
                Event::Pong {
                    valid_ms: Some(2900),
                },
                r#"{"event":"pong","valid_ms":2900}"#,
            ),
            (
                Event::error(ErrorCode::NotHolder, "x", Some("engine")),
                r#"{"event":"error","code":"not_holder","message":"x","resource":"engine"}"#,
            ),
        ];
        for (ev, line) in golden {
            assert_eq!(ev.encode(), format!("{line}\n"));
        }
        // Version-1 requests decode as before.
        assert_eq!(
            decode_request(
                br#"{"op":"acquire","resource":"engine","holder":"me"}"#,
                DEFAULT_MAX_LINE
            )
            .unwrap(),
            Request::acquire("engine", "me", true)
        );
    }
}
