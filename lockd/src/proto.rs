//! The wire protocol: one JSON object per line, in both directions (see `PROTOCOL.md`).
//!
//! Client → server objects carry `"op"`; server → client objects carry `"event"`.
//! Decoding never panics: every byte string maps to a [`Request`] or a [`DecodeError`]
//! (checked by the proptest in `tests/proto_proptest.rs` and the fuzz target in `fuzz/`).

use serde::{Deserialize, Serialize};

/// Protocol version announced in the `hello` event. Version 2 is version 1 plus optional
/// extensions, each announced in `hello`'s `features` ([`FEATURES`]); every version-1
/// request and event is unchanged, so version-1 clients work as before.
pub const PROTOCOL_VERSION: u32 = 2;

/// Protocol-2 extensions this lockd serves, announced in `hello` (`features`). A client uses
/// an extension only when its name is listed: the lease kinds to come are `ttl`, `shared`
/// and `quantity` (see PROTOCOL.md, "Version 2"). None is served yet.
pub const FEATURES: &[&str] = &[];
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
    /// Give up a held lease, or cancel a queued acquire.
    Release {
        /// The resource to release.
        resource: String,
    },
    /// Operator action: tell the holder to fence itself and let go.
    Revoke {
        /// The resource whose lease is revoked.
        resource: String,
        /// Free text passed on to the holder.
        #[serde(default)]
        reason: Option<String>,
        /// Required over TCP: must equal lockd's `--admin-token`.
        #[serde(default)]
        admin_token: Option<String>,
    },
    /// Ask for a `status` event.
    Status,
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
}

fn default_true() -> bool {
    true
}

/// The `op` names this protocol version knows.
pub const KNOWN_OPS: &[&str] = &[
    "acquire", "reclaim", "release", "revoke", "status", "watch", "ping", "anchor",
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

fn validate(req: &Request) -> Result<(), DecodeError> {
    match req {
        Request::Acquire {
            resource, holder, ..
        }
        | Request::Reclaim {
            resource, holder, ..
        } => {
            check_name("resource", resource)?;
            check_name("holder", holder)
        }
        Request::Release { resource } | Request::Revoke { resource, .. } => {
            check_name("resource", resource)
        }
        Request::Status | Request::Watch | Request::Ping | Request::Anchor => Ok(()),
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
}

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
}

/// The `status` answer (printed by `lockd status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Every known resource, sorted by name.
    pub resources: Vec<ResourceReport>,
    /// Counters.
    pub counters: Counters,
    /// Connected sessions.
    #[serde(default)]
    pub sessions: Vec<SessionReport>,
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
    },
    /// Answer to release of a held lease.
    Released {
        /// Resource released.
        resource: String,
        /// Epoch of the lease that ended.
        epoch: u64,
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
    Status(StatusReport),
    /// Answer to watch; notices follow.
    Watching {},
    /// A lease change (watchers only).
    Notice(Notice),
    /// Answer to ping.
    Pong {},
    /// Answer to anchor: the session now has `anchors` open anchors.
    Anchored {
        /// Open anchors of this session, the new one included.
        anchors: u32,
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
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }
}

/// Decode one event line (client side). Never panics.
pub fn decode_event(line: &[u8]) -> Result<Event, DecodeError> {
    let text = std::str::from_utf8(line).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    serde_json::from_str(text.trim_end()).map_err(|e| DecodeError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acquire_defaults_wait_true() {
        let r = decode_request(br#"{"op":"acquire","resource":"e","holder":"a"}"#, 1024).unwrap();
        assert_eq!(
            r,
            Request::Acquire {
                resource: "e".into(),
                holder: "a".into(),
                wait: true
            }
        );
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
            };
            let json = serde_json::to_string(&report).unwrap();
            let want = format!(
                r#"{{"name":"e","holder":"a","epoch":3,"state":"{wire}","waiters":["b"],"holder_session":1,"holder_peer":null,"revoked":false,"granted_at_unix_ms":7,"reclaim_remaining_ms":null}}"#
            );
            assert_eq!(json, want);
            let back: ResourceReport = serde_json::from_str(&json).unwrap();
            assert_eq!(back.state, state);
            let status = Event::Status(StatusReport {
                resources: vec![report],
                counters: Counters::default(),
                sessions: vec![],
            })
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
            },
            Event::Watching {},
            Event::Pong {},
            Event::error(ErrorCode::NotHolder, "x", Some("r")),
            Event::Status(StatusReport {
                resources: vec![],
                counters: Counters::default(),
                sessions: vec![],
            }),
        ];
        for e in evs {
            let line = e.encode();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(decode_event(line.as_bytes()).unwrap(), e);
        }
    }

    #[test]
    fn hello_announces_version_2_and_version_1_events_are_byte_for_byte_unchanged() {
        // Version 2 without extensions: only the version number differs from version 1.
        let hello = Event::Hello {
            server: "lockd".into(),
            version: PROTOCOL_VERSION,
            session: 7,
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
        };
        assert_eq!(PROTOCOL_VERSION, 2);
        assert_eq!(
            hello.encode(),
            "{\"event\":\"hello\",\"server\":\"lockd\",\"version\":2,\"session\":7}\n"
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
                },
                r#"{"event":"granted","resource":"engine","holder":"me","epoch":5,"token":"3f0c","reclaimed":false}"#,
            ),
            (
                Event::Queued {
                    resource: "engine".into(),
                    position: 1,
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
            (Event::Pong {}, r#"{"event":"pong"}"#),
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
            Request::Acquire {
                resource: "engine".into(),
                holder: "me".into(),
                wait: true
            }
        );
    }
}
