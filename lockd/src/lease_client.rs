//! An async client for the version-2 lease kinds (`ttl`, `shared`, `quantity`; see
//! PROTOCOL.md, "Version 2"), separate from the version-1 [`crate::client`] that the
//! supervisor and `lockd hold` use.
//!
//! One [`LeaseClient`] is one connection. [`LeaseClient::connect`] reads `hello` and keeps
//! its `features`; a request for a kind the server does not list is refused client-side
//! ([`LeaseError::Unsupported`]), before anything is sent. Requests are answered in order on
//! the connection; a background task routes each answer to its caller and every unsolicited
//! event (a queued acquire's later `granted`, `lease_ended`, `renewal_refused`,
//! `renewal_allowed`, `revoked`) to a [`tokio::sync::mpsc`] stream read with
//! [`LeaseClient::next_event`]. Errors from lockd keep their code ([`LeaseError::Refused`]).
//!
//! A TTL or quantity lease outlives the connection: save [`Lease::saved`] (lease id and
//! token), and a new process can [`LeaseClient::resume`] it after this one's crash.
//! [`LeaseClient::keep_renewed`] renews a lease in the background.
//!
//! Gangs of the version-2 kinds (feature `gang`): [`LeaseClient::acquire_gang`] with a
//! [`GangAcquire`] (TTL or shared, optionally timed, with a wait timeout), a [`Gang`] that
//! renews, releases ([`LeaseClient::release_gang`]) and resumes
//! ([`LeaseClient::resume_gang`]) whole by its id, and the events [`LeaseEvent::GangGranted`],
//! [`LeaseEvent::GangCancelled`] and [`LeaseEvent::MemberLost`].
//!
//! Routing rule: an event is unsolicited when it is `lease_ended`, `renewal_refused`,
//! `renewal_allowed`, `revoked`, `member_lost` or `notice`, a `granted` for a lease id this
//! connection was told was `queued`, a `gang_granted` for a gang queued on this connection,
//! a `cancelled` naming a gang queued on this connection (its timeout), a `lease_ended`
//! `unsatisfiable` that drops a queued request, or an `error` that closes the connection;
//! every other event answers the oldest request not yet answered.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::proto::{
    self, AcquireExt, AllocationReport, ErrorCode, Event, LeaseKind, LeaseReport, Mode,
    OfferReport, Request, StatusReport,
};
use crate::Endpoint;

/// Longest event line accepted (a `status` or `leases` answer can be large).
const MAX_EVENT_LINE: usize = 16 * 1024 * 1024;

/// How long [`LeaseClient::connect`] waits for the connection and `hello`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a request of a [`LeaseClient`] failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LeaseError {
    /// The endpoint could not be reached (or `hello` did not come in time).
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// The server does not serve this protocol-2 feature (not listed in `hello`).
    #[error("lockd does not serve feature {feature:?} (hello lists {served:?})")]
    Unsupported {
        /// The feature asked for (`ttl`, `shared`, `quantity`).
        feature: String,
        /// The features the server listed.
        served: Vec<String>,
    },
    /// lockd answered with an `error` event.
    #[error("lockd refused: {message} ({code})")]
    Refused {
        /// The error code as sent (`lease_ended`, `busy`, ...; see [`ErrorCode`]).
        code: String,
        /// lockd's detail.
        message: String,
    },
    /// The connection closed (or broke) before the answer came.
    #[error("connection to lockd closed: {0}")]
    Closed(String),
    /// lockd sent something this client did not expect.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl LeaseError {
    /// The lockd error code, when lockd refused.
    pub fn code(&self) -> Option<&str> {
        match self {
            LeaseError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether lockd refused with `code`.
    pub fn is(&self, code: ErrorCode) -> bool {
        self.code() == Some(code.as_str())
    }
}

/// What a process needs to take up a lease again: its id and token. Serialised as
/// `{"lease_id":N,"token":"…"}` (what `lockd acquire --save FILE` writes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLease {
    /// The lease id.
    pub lease_id: u64,
    /// Its secret token.
    pub token: String,
}

/// Anything that names a lease with its token ([`Lease`], [`SavedLease`]).
pub trait LeaseRef {
    /// The lease id.
    fn lease_id(&self) -> u64;
    /// Its token.
    fn token(&self) -> &str;
}

impl LeaseRef for SavedLease {
    fn lease_id(&self) -> u64 {
        self.lease_id
    }
    fn token(&self) -> &str {
        &self.token
    }
}

impl LeaseRef for Lease {
    fn lease_id(&self) -> u64 {
        self.lease_id
    }
    fn token(&self) -> &str {
        &self.token
    }
}

/// A granted version-2 lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// Its id (unique for the life of lockd's state file).
    pub lease_id: u64,
    /// Its secret token (proves it in renew/release/commit/resume).
    pub token: String,
    /// Its resource (or pool).
    pub resource: String,
    /// The holder name given at acquire.
    pub holder: String,
    /// Fencing epoch, strictly increasing per resource.
    pub epoch: u64,
    /// Its kind.
    pub kind: LeaseKind,
    /// Shared-kind leases: the mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Shared-kind leases: the resource's version at grant time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// Timed leases: the TTL / lease time granted, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Timed leases: the deadline (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_unix_ms: Option<u64>,
    /// Quantity leases: how much.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantity: Option<u32>,
    /// Quantity leases: from which offers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allocations: Vec<AllocationReport>,
    /// True when this came from `resume` (the same lease, taken up again).
    #[serde(default)]
    pub resumed: bool,
}

impl Lease {
    /// The `(lease id, token)` to save for [`LeaseClient::resume`].
    pub fn saved(&self) -> SavedLease {
        SavedLease {
            lease_id: self.lease_id,
            token: self.token.clone(),
        }
    }

    /// The lease of a version-2 `granted` event (None for any other event, or a version-1
    /// grant without a lease id).
    pub fn from_event(ev: &Event) -> Option<Lease> {
        let Event::Granted {
            resource,
            holder,
            epoch,
            token,
            reclaimed,
            lease,
        } = ev
        else {
            return None;
        };
        Some(Lease {
            lease_id: lease.lease_id?,
            token: token.clone(),
            resource: resource.clone(),
            holder: holder.clone(),
            epoch: *epoch,
            kind: lease.kind.unwrap_or_default(),
            mode: lease.mode,
            version: lease.version,
            ttl_ms: lease.ttl_ms,
            expires_at_unix_ms: lease.expires_at_unix_ms,
            quantity: lease.quantity,
            allocations: lease.allocations.clone().unwrap_or_default(),
            resumed: *reclaimed,
        })
    }
}

/// An `acquire` of a version-2 kind, built with [`Acquire::ttl`], [`Acquire::shared`] or
/// [`Acquire::quantity`] and refined with the other methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquire {
    resource: String,
    holder: String,
    wait: bool,
    ext: AcquireExt,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Acquire {
    /// A TTL lease on `resource`: exclusive, outlives the connection, ends unless renewed
    /// within `ttl` (feature `ttl`).
    pub fn ttl(resource: impl Into<String>, holder: impl Into<String>, ttl: Duration) -> Acquire {
        Acquire {
            resource: resource.into(),
            holder: holder.into(),
            wait: true,
            ext: AcquireExt {
                ttl_ms: Some(ms(ttl)),
                ..AcquireExt::default()
            },
        }
    }

    /// A shared or exclusive lease with versions on `resource` (feature `shared`), bound
    /// to this connection unless [`Acquire::with_ttl`] is given.
    pub fn shared(resource: impl Into<String>, holder: impl Into<String>, mode: Mode) -> Acquire {
        Acquire {
            resource: resource.into(),
            holder: holder.into(),
            wait: true,
            ext: AcquireExt {
                mode: Some(mode),
                ..AcquireExt::default()
            },
        }
    }

    /// `quantity` of pool `pool`, from one or several of its offers (feature `quantity`).
    pub fn quantity(pool: impl Into<String>, holder: impl Into<String>, quantity: u32) -> Acquire {
        Acquire {
            resource: pool.into(),
            holder: holder.into(),
            wait: true,
            ext: AcquireExt {
                quantity: Some(quantity),
                ..AcquireExt::default()
            },
        }
    }

    /// Shared mode: wait until the resource's version is at least `v`.
    pub fn min_version(mut self, v: u64) -> Acquire {
        self.ext.min_version = Some(v);
        self
    }

    /// The TTL (shared kind: makes the lease outlive its connection; quantity: the lease
    /// time asked for).
    pub fn with_ttl(mut self, ttl: Duration) -> Acquire {
        self.ext.ttl_ms = Some(ms(ttl));
        self
    }

    /// Quantity: a label selector the offers' attributes must match.
    pub fn requirements(mut self, selector: impl Into<String>) -> Acquire {
        self.ext.requirements = Some(selector.into());
        self
    }

    /// Quantity: one attribute of this request (offers' requirements match them).
    pub fn attribute(mut self, key: impl Into<String>, value: impl Into<String>) -> Acquire {
        self.ext
            .attributes
            .get_or_insert_with(BTreeMap::new)
            .insert(key.into(), value.into());
        self
    }

    /// Do not wait: answer [`Acquired::Busy`] (or error `unavailable`) when it cannot be
    /// granted now.
    pub fn no_wait(mut self) -> Acquire {
        self.wait = false;
        self
    }

    /// The kind this asks for.
    pub fn kind(&self) -> LeaseKind {
        self.ext.kind()
    }

    fn request(&self) -> Request {
        Request::Acquire {
            resource: self.resource.clone(),
            holder: self.holder.clone(),
            wait: self.wait,
            ext: self.ext.clone(),
        }
    }
}

/// The answer to [`LeaseClient::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// Granted at once.
    Granted(Lease),
    /// Waiting in line: the grant comes later as [`LeaseEvent::Granted`] (or use
    /// [`LeaseClient::wait_granted`]). Cancel with [`LeaseClient::cancel`] (or by dropping
    /// the client).
    Queued {
        /// The id the lease will have.
        lease_id: u64,
        /// 1 = next in line.
        position: usize,
    },
    /// `no_wait` and the resource is taken (TTL and shared kinds; a pool answers error
    /// `unavailable` instead).
    Busy {
        /// The current holder's name.
        holder: Option<String>,
    },
}

/// An all-or-nothing `acquire` of several resources as one gang of the version-2 kinds
/// (feature `gang`): a TTL gang ([`GangAcquire::ttl`]: exclusive members that outlive the
/// connection) or a shared gang ([`GangAcquire::shared`]: readers, bound to the connection
/// unless [`GangAcquire::with_ttl`] is given). Every member is granted in one step or none
/// is; each member is a lease of its own (id, epoch) and the gang's id is its first
/// member's lease id. On the wire: `acquire` with `gang`, and `ttl_ms` or `mode: "shared"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangAcquire {
    label: String,
    holder: String,
    wait: bool,
    ext: AcquireExt,
}

impl GangAcquire {
    fn new(label: String, holder: String, members: Vec<String>, ext: AcquireExt) -> GangAcquire {
        GangAcquire {
            label,
            holder,
            wait: true,
            ext: AcquireExt {
                gang: Some(members),
                ..ext
            },
        }
    }

    /// A TTL gang named `label` over `members` (feature `ttl`): each member exclusive, all
    /// with one deadline, renewed whole with [`LeaseClient::renew`] of the [`Gang`].
    pub fn ttl<S: Into<String>>(
        label: impl Into<String>,
        holder: impl Into<String>,
        members: impl IntoIterator<Item = S>,
        ttl: Duration,
    ) -> GangAcquire {
        GangAcquire::new(
            label.into(),
            holder.into(),
            members.into_iter().map(Into::into).collect(),
            AcquireExt {
                ttl_ms: Some(ms(ttl)),
                ..AcquireExt::default()
            },
        )
    }

    /// A shared gang named `label` over `members` (feature `shared`): a reader of each,
    /// bound to this connection (unless [`GangAcquire::with_ttl`]). While it waits it
    /// reserves its members against writers that arrive after it (PROTOCOL.md, "Gang
    /// fairness").
    pub fn shared<S: Into<String>>(
        label: impl Into<String>,
        holder: impl Into<String>,
        members: impl IntoIterator<Item = S>,
    ) -> GangAcquire {
        GangAcquire::new(
            label.into(),
            holder.into(),
            members.into_iter().map(Into::into).collect(),
            AcquireExt {
                mode: Some(Mode::Shared),
                ..AcquireExt::default()
            },
        )
    }

    /// Shared gang: a TTL, which makes it outlive the connection (renewed whole).
    pub fn with_ttl(mut self, ttl: Duration) -> GangAcquire {
        self.ext.ttl_ms = Some(ms(ttl));
        self
    }

    /// Give up waiting after `d` (`timeout_ms`): the gang is then withdrawn whole and
    /// reported as [`LeaseEvent::GangCancelled`].
    pub fn timeout(mut self, d: Duration) -> GangAcquire {
        self.ext.timeout_ms = Some(ms(d));
        self
    }

    /// Do not wait: answer [`GangAcquired::Busy`] when some member is taken.
    pub fn no_wait(mut self) -> GangAcquire {
        self.wait = false;
        self
    }

    /// The kind of its members (`Ttl` or `Shared`).
    pub fn kind(&self) -> LeaseKind {
        if self.ext.mode == Some(Mode::Shared) {
            LeaseKind::Shared
        } else {
            LeaseKind::Ttl
        }
    }

    fn request(&self) -> Request {
        Request::Acquire {
            resource: self.label.clone(),
            holder: self.holder.clone(),
            wait: self.wait,
            ext: self.ext.clone(),
        }
    }
}

/// One member of a granted [`Gang`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GangMemberLease {
    /// The resource.
    pub resource: String,
    /// The member's own lease id.
    pub lease_id: u64,
    /// Its fencing epoch (each resource has its own sequence).
    pub epoch: u64,
    /// Shared gangs: the resource's version at the grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// A granted gang of the version-2 kinds (`gang_granted`). As a [`LeaseRef`] it names the
/// whole gang (its id and token): [`LeaseClient::renew`] renews every member,
/// [`LeaseClient::release_gang`] ends every member, [`LeaseClient::resume_gang`] takes up
/// every member after a crash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gang {
    /// The gang's id (its first member's lease id).
    pub gang_id: u64,
    /// Its token (every member's).
    pub token: String,
    /// Its name (the acquire's `resource`).
    pub label: String,
    /// The holder name.
    pub holder: String,
    /// `Ttl` or `Shared`.
    pub kind: LeaseKind,
    /// Every member, in request order.
    pub members: Vec<GangMemberLease>,
    /// Timed gangs: the deadline of every member (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_unix_ms: Option<u64>,
}

impl Gang {
    /// The `(gang id, token)` to save for [`LeaseClient::resume_gang`].
    pub fn saved(&self) -> SavedLease {
        SavedLease {
            lease_id: self.gang_id,
            token: self.token.clone(),
        }
    }

    /// The gang of a `gang_granted` event of a version-2 kind (None for any other event,
    /// or a connection-bound exclusive gang, whose members have no lease ids).
    pub fn from_event(ev: &Event) -> Option<Gang> {
        let Event::GangGranted {
            resource,
            gang_id,
            holder,
            token,
            members,
            kind,
            expires_at_unix_ms,
        } = ev
        else {
            return None;
        };
        let members = members
            .iter()
            .map(|m| {
                Some(GangMemberLease {
                    resource: m.resource.clone(),
                    lease_id: m.lease_id?,
                    epoch: m.epoch,
                    version: m.version,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Gang {
            gang_id: *gang_id,
            token: token.clone(),
            label: resource.clone(),
            holder: holder.clone(),
            kind: (*kind)?,
            members,
            expires_at_unix_ms: *expires_at_unix_ms,
        })
    }
}

impl LeaseRef for Gang {
    fn lease_id(&self) -> u64 {
        self.gang_id
    }
    fn token(&self) -> &str {
        &self.token
    }
}

/// The answer to [`LeaseClient::acquire_gang`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangAcquired {
    /// Every member granted at once.
    Granted(Gang),
    /// Waiting, whole: the grant comes later as [`LeaseEvent::GangGranted`] (or use
    /// [`LeaseClient::wait_gang_granted`]); a timeout as [`LeaseEvent::GangCancelled`].
    Queued {
        /// The id the gang will have.
        gang_id: u64,
        /// The longest line among its members' (1 = next).
        position: usize,
    },
    /// `no_wait` and a member is taken.
    Busy {
        /// A holder of a member that is taken.
        holder: Option<String>,
    },
}

/// An offer of a quantity pool, for [`LeaseClient::offer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Offer {
    /// The pool.
    pub pool: String,
    /// The offer's name, unique in the pool.
    pub name: String,
    /// How much it offers.
    pub quantity: u32,
    /// Its attributes.
    pub attributes: BTreeMap<String, String>,
    /// The longest lease it allows.
    pub max_lease_time: Option<Duration>,
    /// What it requires of requests' attributes (label selector).
    pub requirements: Option<String>,
    /// lockd's `--admin-token` (required over TCP).
    pub admin_token: Option<String>,
}

/// The answer to [`LeaseClient::offer`] and [`LeaseClient::withdraw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferChange {
    /// The offer as now set (None after a withdraw).
    pub offer: Option<OfferReport>,
    /// Leases whose renewals are now refused (the offer shrank or went away).
    pub renewal_refused: Vec<u64>,
}

/// The answer to [`LeaseClient::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A granted lease ended; its epoch.
    Released {
        /// The epoch of the lease that ended.
        epoch: u64,
    },
    /// A waiting request was withdrawn.
    Cancelled,
}

/// An event nobody asked for, read with [`LeaseClient::next_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEvent {
    /// A queued acquire was granted.
    Granted(Lease),
    /// A lease of this connection ended without its asking (`expired`,
    /// `revoked:<by>:<why>`, ...).
    Ended {
        /// The lease.
        lease_id: u64,
        /// Its resource.
        resource: String,
        /// Its epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },
    /// A quantity lease will not be renewed (its offer shrank or went away).
    RenewalRefused {
        /// The lease.
        lease_id: u64,
        /// The pool.
        resource: String,
        /// The offer that shrank.
        offer: String,
    },
    /// A quantity lease may be renewed again.
    RenewalAllowed {
        /// The lease.
        lease_id: u64,
        /// The pool.
        resource: String,
    },
    /// A connection-bound shared lease was revoked: fence yourself and release.
    Revoked {
        /// The resource.
        resource: String,
        /// The lease's epoch.
        epoch: u64,
        /// The operator's reason.
        reason: String,
    },
    /// A queued quantity request was dropped: its pool's matching offers shrank below it.
    Dropped {
        /// The request.
        lease_id: u64,
        /// lockd's message.
        message: String,
    },
    /// A [`LeaseClient::keep_renewed`] renewal failed (the keep-alive stops when the
    /// lease has ended, and keeps trying on `renewal_refused`).
    RenewFailed {
        /// The lease.
        lease_id: u64,
        /// The error code (`renewal_refused`, `lease_ended`, ...) or `closed`.
        code: String,
        /// Detail.
        message: String,
    },
    /// A queued gang was granted, every member at once.
    GangGranted(Gang),
    /// One member of a granted gang was taken away (revoked by an admin: a failed device,
    /// a drained node): fence it and reserve a replacement. A gang of the version-2 kinds
    /// ends whole right after (its members' [`LeaseEvent::Ended`] follow).
    MemberLost {
        /// The gang's id.
        gang_id: u64,
        /// The member taken away.
        resource: String,
        /// Its epoch.
        epoch: u64,
        /// Why: `revoked:<by>:<why>`, ...
        reason: String,
    },
    /// A queued gang's [`GangAcquire::timeout`] passed: withdrawn whole, nothing held.
    GangCancelled {
        /// The gang's id.
        gang_id: u64,
        /// Its name.
        label: String,
    },
    /// The connection closed; no more events follow.
    Closed {
        /// Why (lockd's error, or end of file).
        reason: String,
    },
    /// Any other event that answered no request.
    Other(Event),
}

/// A request on its way to the connection task, with where its answer goes.
struct Cmd {
    line: String,
    reply: Reply,
}

/// Where the answer of one request goes.
enum Reply {
    /// One event answers it.
    One(oneshot::Sender<Result<Event, LeaseError>>),
    /// One event answers it, a gang's `acquire` (a `queued` answer makes the gang's later
    /// `gang_granted` or timeout `cancelled` unsolicited).
    Gang(oneshot::Sender<Result<Event, LeaseError>>),
    /// It was sent followed by a `ping`: every answer up to the `pong` is its (for requests
    /// answered with several events, like `release` by resource).
    UntilPong(Vec<Event>, oneshot::Sender<Result<Vec<Event>, LeaseError>>),
}

impl Reply {
    fn fail(self, e: LeaseError) {
        match self {
            Reply::One(tx) | Reply::Gang(tx) => {
                let _ = tx.send(Err(e));
            }
            Reply::UntilPong(_, tx) => {
                let _ = tx.send(Err(e));
            }
        }
    }
}

/// What the connection task and the keep-alive tasks share: where requests and events go.
#[derive(Clone)]
struct Link {
    cmds: mpsc::UnboundedSender<Cmd>,
    events: mpsc::UnboundedSender<LeaseEvent>,
}

impl Link {
    async fn call(&self, req: &Request) -> Result<Event, LeaseError> {
        self.call_as(req, Reply::One).await
    }

    /// [`Link::call`] with the kind of reply it is (`Reply::One` or `Reply::Gang`).
    async fn call_as(
        &self,
        req: &Request,
        kind: fn(oneshot::Sender<Result<Event, LeaseError>>) -> Reply,
    ) -> Result<Event, LeaseError> {
        let (tx, rx) = oneshot::channel();
        self.cmds
            .send(Cmd {
                line: proto::encode_request(req),
                reply: kind(tx),
            })
            .map_err(|_| LeaseError::Closed("client stopped".into()))?;
        let ev = rx
            .await
            .map_err(|_| LeaseError::Closed("client stopped".into()))??;
        match ev {
            Event::Error { code, message, .. } => Err(LeaseError::Refused { code, message }),
            ev => Ok(ev),
        }
    }

    /// Send `req` and a `ping`; every answer before the `pong`.
    async fn call_all(&self, req: &Request) -> Result<Vec<Event>, LeaseError> {
        let (tx, rx) = oneshot::channel();
        let mut line = proto::encode_request(req);
        line.push_str(&proto::encode_request(&Request::Ping));
        self.cmds
            .send(Cmd {
                line,
                reply: Reply::UntilPong(Vec::new(), tx),
            })
            .map_err(|_| LeaseError::Closed("client stopped".into()))?;
        rx.await
            .map_err(|_| LeaseError::Closed("client stopped".into()))?
    }
}

/// A connection to lockd for the version-2 lease kinds. Dropping it closes the connection:
/// connection-bound leases end, waiting requests are withdrawn, TTL and quantity leases live
/// on (resume them with their [`SavedLease`]).
pub struct LeaseClient {
    link: Link,
    events: mpsc::UnboundedReceiver<LeaseEvent>,
    stash: VecDeque<LeaseEvent>,
    features: Vec<String>,
    session: u64,
    version: u32,
    task: JoinHandle<()>,
}

impl Drop for LeaseClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

async fn open(ep: &Endpoint) -> std::io::Result<(Reader, Writer)> {
    match ep {
        Endpoint::Unix(p) => {
            let s = tokio::net::UnixStream::connect(p).await?;
            let (r, w) = s.into_split();
            Ok((Box::new(r), Box::new(w)))
        }
        Endpoint::Tcp(hp) => {
            let s = tokio::net::TcpStream::connect(hp.as_str()).await?;
            let _ = s.set_nodelay(true);
            let (r, w) = s.into_split();
            Ok((Box::new(r), Box::new(w)))
        }
    }
}

/// Reads lines (bounded) and forwards them; ends with an `Err` on EOF or failure.
async fn read_lines(r: Reader, tx: mpsc::UnboundedSender<Result<Vec<u8>, String>>) {
    let mut r = BufReader::new(r);
    loop {
        let mut line = Vec::new();
        loop {
            let buf = match r.fill_buf().await {
                Ok(b) => b,
                Err(e) => {
                    let _ = tx.send(Err(format!("read: {e}")));
                    return;
                }
            };
            if buf.is_empty() {
                let _ = tx.send(Err("end of file".into()));
                return;
            }
            let (take, done) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            line.extend_from_slice(&buf[..take]);
            r.consume(take);
            if line.len() > MAX_EVENT_LINE + 1 {
                let _ = tx.send(Err(format!("event line over {MAX_EVENT_LINE} bytes")));
                return;
            }
            if done {
                break;
            }
        }
        if tx.send(Ok(line)).is_err() {
            return;
        }
    }
}

/// Error codes after which lockd closes the connection.
const FATAL: &[&str] = &[
    "line_too_long",
    "rate_limited",
    "idle_timeout",
    "shutting_down",
];

/// The connection task: writes requests, routes what comes back.
struct Conn {
    w: Writer,
    pending: VecDeque<Reply>,
    queued: BTreeSet<u64>,
    /// Gangs queued on this connection: gang id -> name (a `cancelled` naming it is the
    /// gang's timeout).
    queued_gangs: BTreeMap<u64, String>,
    events: mpsc::UnboundedSender<LeaseEvent>,
}

impl Conn {
    async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        mut lines: mpsc::UnboundedReceiver<Result<Vec<u8>, String>>,
        reader: JoinHandle<()>,
    ) {
        let why = loop {
            tokio::select! {
                c = cmds.recv() => match c {
                    Some(c) => {
                        if let Err(e) = self.w.write_all(c.line.as_bytes()).await {
                            c.reply.fail(LeaseError::Closed(format!("write: {e}")));
                            break format!("write: {e}");
                        }
                        self.pending.push_back(c.reply);
                    }
                    None => break "client dropped".to_string(),
                },
                l = lines.recv() => match l {
                    Some(Ok(line)) => {
                        if let Some(why) = self.on_line(&line) {
                            break why;
                        }
                    }
                    Some(Err(why)) => break why,
                    None => break "reader stopped".to_string(),
                },
            }
        };
        reader.abort();
        for p in self.pending.drain(..) {
            p.fail(LeaseError::Closed(why.clone()));
        }
        let _ = self.events.send(LeaseEvent::Closed { reason: why });
    }

    fn emit(&self, ev: LeaseEvent) {
        let _ = self.events.send(ev);
    }

    /// Route one line; Some(reason) when the connection is done.
    fn on_line(&mut self, line: &[u8]) -> Option<String> {
        let ev = match decode(line) {
            Ok(ev) => ev,
            Err(e) => {
                // Not an event of this protocol (a newer lockd?): it may have been an
                // answer, after which routing cannot be trusted.
                return Some(format!(
                    "undecodable line from lockd ({e}): {}",
                    String::from_utf8_lossy(line).trim_end()
                ));
            }
        };
        match ev {
            Event::LeaseEnded {
                lease_id,
                resource,
                epoch,
                reason,
            } => {
                if self.queued.remove(&lease_id) {
                    // A queued request ends before its grant only when lockd drops it (a
                    // quantity request whose offers shrank below it: `unsatisfiable`).
                    self.emit(LeaseEvent::Dropped {
                        lease_id,
                        message: format!("request on {resource:?} dropped: {reason}"),
                    });
                } else {
                    self.emit(LeaseEvent::Ended {
                        lease_id,
                        resource,
                        epoch,
                        reason,
                    });
                }
            }
            Event::RenewalRefused {
                lease_id,
                resource,
                offer,
            } => self.emit(LeaseEvent::RenewalRefused {
                lease_id,
                resource,
                offer,
            }),
            Event::RenewalAllowed { lease_id, resource } => {
                self.emit(LeaseEvent::RenewalAllowed { lease_id, resource })
            }
            Event::Revoked {
                resource,
                epoch,
                reason,
            } => self.emit(LeaseEvent::Revoked {
                resource,
                epoch,
                reason,
            }),
            ev @ Event::Notice(_) => self.emit(LeaseEvent::Other(ev)),
            Event::MemberLost {
                gang_id,
                resource,
                epoch,
                reason,
            } => self.emit(LeaseEvent::MemberLost {
                gang_id,
                resource,
                epoch,
                reason,
            }),
            ev @ Event::GangGranted { .. }
                if matches!(&ev, Event::GangGranted { gang_id, .. }
                    if self.queued_gangs.contains_key(gang_id)) =>
            {
                if let Event::GangGranted { gang_id, .. } = &ev {
                    self.queued_gangs.remove(gang_id);
                    self.queued.remove(gang_id);
                }
                match Gang::from_event(&ev) {
                    Some(g) => self.emit(LeaseEvent::GangGranted(g)),
                    None => self.emit(LeaseEvent::Other(ev)),
                }
            }
            Event::Cancelled { resource } if self.queued_gangs.values().any(|l| *l == resource) => {
                // The timeout of a gang queued here (the oldest of that name first).
                let gid = self
                    .queued_gangs
                    .iter()
                    .find(|(_, l)| **l == resource)
                    .map(|(id, _)| *id)
                    .unwrap_or_default();
                self.queued_gangs.remove(&gid);
                self.queued.remove(&gid);
                self.emit(LeaseEvent::GangCancelled {
                    gang_id: gid,
                    label: resource,
                });
            }
            ev @ Event::Granted { .. }
                if matches!(&ev, Event::Granted { lease, reclaimed: false, .. }
                    if lease.lease_id.is_some_and(|id| self.queued.contains(&id))) =>
            {
                match Lease::from_event(&ev) {
                    Some(l) => {
                        self.queued.remove(&l.lease_id);
                        self.emit(LeaseEvent::Granted(l));
                    }
                    None => self.emit(LeaseEvent::Other(ev)),
                }
            }
            Event::Error { code, message, .. } if FATAL.contains(&code.as_str()) => {
                let why = format!("lockd closed the connection: {message} ({code})");
                for p in self.pending.drain(..) {
                    p.fail(LeaseError::Refused {
                        code: code.clone(),
                        message: message.clone(),
                    });
                }
                return Some(why);
            }
            ev => {
                if let Event::Queued {
                    lease_id: Some(id), ..
                } = &ev
                {
                    self.queued.insert(*id);
                }
                match self.pending.pop_front() {
                    Some(Reply::One(tx)) => {
                        let _ = tx.send(Ok(ev));
                    }
                    Some(Reply::Gang(tx)) => {
                        if let Event::Queued {
                            lease_id: Some(id),
                            resource,
                            ..
                        } = &ev
                        {
                            self.queued_gangs.insert(*id, resource.clone());
                        }
                        let _ = tx.send(Ok(ev));
                    }
                    Some(Reply::UntilPong(all, tx)) if matches!(ev, Event::Pong { .. }) => {
                        let _ = tx.send(Ok(all));
                    }
                    Some(Reply::UntilPong(mut all, tx)) => {
                        all.push(ev);
                        self.pending.push_front(Reply::UntilPong(all, tx));
                    }
                    None => self.emit(LeaseEvent::Other(ev)),
                }
            }
        }
        None
    }
}

/// Decode an event line.
fn decode(line: &[u8]) -> Result<Event, proto::DecodeError> {
    proto::decode_event(line)
}

fn unexpected(what: &str, ev: &Event) -> LeaseError {
    LeaseError::Protocol(format!("expected {what}, got {}", ev.encode().trim_end()))
}

impl LeaseClient {
    /// Connect (within [`CONNECT_TIMEOUT`]), read `hello`, keep its `features`.
    pub async fn connect(ep: &Endpoint) -> Result<LeaseClient, LeaseError> {
        let fail = |reason: String| LeaseError::Connect {
            endpoint: ep.to_string(),
            reason,
        };
        let (r, w) = tokio::time::timeout(CONNECT_TIMEOUT, open(ep))
            .await
            .map_err(|_| fail("timed out".into()))?
            .map_err(|e| fail(e.to_string()))?;
        let (ltx, mut lrx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_lines(r, ltx));
        let first = match tokio::time::timeout(CONNECT_TIMEOUT, lrx.recv()).await {
            Ok(Some(Ok(l))) => l,
            Ok(Some(Err(e))) => {
                reader.abort();
                return Err(fail(format!("no hello: {e}")));
            }
            Ok(None) | Err(_) => {
                reader.abort();
                return Err(fail("no hello in time".into()));
            }
        };
        let (session, version, features) = match decode(&first) {
            Ok(Event::Hello {
                session,
                version,
                features,
                ..
            }) => (session, version, features),
            _ => {
                reader.abort();
                return Err(LeaseError::Protocol(format!(
                    "expected hello, got {}",
                    String::from_utf8_lossy(&first).trim_end()
                )));
            }
        };
        let (ctx, crx) = mpsc::unbounded_channel();
        let (etx, erx) = mpsc::unbounded_channel();
        let conn = Conn {
            w,
            pending: VecDeque::new(),
            queued: BTreeSet::new(),
            queued_gangs: BTreeMap::new(),
            events: etx.clone(),
        };
        let task = tokio::spawn(conn.run(crx, lrx, reader));
        let c = LeaseClient {
            link: Link {
                cmds: ctx,
                events: etx,
            },
            events: erx,
            stash: VecDeque::new(),
            features,
            session,
            version,
            task,
        };
        // A first request right away: lockd closes connections silent for --idle-timeout.
        c.ping().await?;
        Ok(c)
    }

    /// The features `hello` listed.
    pub fn features(&self) -> &[String] {
        &self.features
    }

    /// This connection's lockd session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The protocol version `hello` announced.
    pub fn protocol_version(&self) -> u32 {
        self.version
    }

    fn require(&self, feature: &str) -> Result<(), LeaseError> {
        if self.features.iter().any(|f| f == feature) {
            Ok(())
        } else {
            Err(LeaseError::Unsupported {
                feature: feature.into(),
                served: self.features.clone(),
            })
        }
    }

    /// Any version-2 feature (for the ops every kind shares).
    fn require_any(&self) -> Result<(), LeaseError> {
        if ["ttl", "shared", "quantity"]
            .iter()
            .any(|f| self.features.iter().any(|x| x == f))
        {
            Ok(())
        } else {
            self.require("ttl")
        }
    }

    /// `ping` → `pong`.
    pub async fn ping(&self) -> Result<(), LeaseError> {
        match self.link.call(&Request::Ping).await? {
            Event::Pong { .. } => Ok(()),
            ev => Err(unexpected("pong", &ev)),
        }
    }

    /// `acquire` of a version-2 kind. Refused with [`LeaseError::Unsupported`] (nothing
    /// sent) when `hello` did not list the kind's feature.
    pub async fn acquire(&self, a: &Acquire) -> Result<Acquired, LeaseError> {
        match a.kind() {
            LeaseKind::Ttl => self.require("ttl")?,
            LeaseKind::Shared => self.require("shared")?,
            LeaseKind::Quantity => self.require("quantity")?,
            LeaseKind::Exclusive => {
                return Err(LeaseError::Protocol(
                    "a version-1 acquire: use lockd::client".into(),
                ))
            }
        }
        let ev = self.link.call(&a.request()).await?;
        match &ev {
            Event::Granted { .. } => Lease::from_event(&ev)
                .map(Acquired::Granted)
                .ok_or_else(|| unexpected("a version-2 grant", &ev)),
            Event::Queued {
                lease_id: Some(id),
                position,
                ..
            } => Ok(Acquired::Queued {
                lease_id: *id,
                position: *position,
            }),
            Event::Busy { holder, .. } => Ok(Acquired::Busy {
                holder: holder.clone(),
            }),
            _ => Err(unexpected("granted, queued or busy", &ev)),
        }
    }

    /// `acquire` of a gang of the version-2 kinds ([`GangAcquire`]): granted whole, queued
    /// whole, or busy. Refused with [`LeaseError::Unsupported`] (nothing sent) when `hello`
    /// did not list `gang` and the members' kind.
    pub async fn acquire_gang(&self, a: &GangAcquire) -> Result<GangAcquired, LeaseError> {
        self.require("gang")?;
        match a.kind() {
            LeaseKind::Shared => self.require("shared")?,
            _ => self.require("ttl")?,
        }
        let ev = self.link.call_as(&a.request(), Reply::Gang).await?;
        match &ev {
            Event::GangGranted { .. } => Gang::from_event(&ev)
                .map(GangAcquired::Granted)
                .ok_or_else(|| unexpected("a version-2 gang grant", &ev)),
            Event::Queued {
                lease_id: Some(id),
                position,
                ..
            } => Ok(GangAcquired::Queued {
                gang_id: *id,
                position: *position,
            }),
            Event::Busy { holder, .. } => Ok(GangAcquired::Busy {
                holder: holder.clone(),
            }),
            _ => Err(unexpected("gang_granted, queued or busy", &ev)),
        }
    }

    /// `release` of a whole gang by its id and token (any connection): one [`Ended`] per
    /// member (lockd answers each).
    pub async fn release_gang(&self, g: &impl LeaseRef) -> Result<Vec<Ended>, LeaseError> {
        self.require("gang")?;
        let evs = self
            .link
            .call_all(&Request::Release {
                resource: None,
                lease_id: Some(g.lease_id()),
                token: Some(g.token().to_string()),
            })
            .await?;
        evs.into_iter()
            .map(|ev| match ev {
                Event::Released { epoch, .. } => Ok(Ended::Released { epoch }),
                Event::Cancelled { .. } => Ok(Ended::Cancelled),
                Event::Error { code, message, .. } => Err(LeaseError::Refused { code, message }),
                ev => Err(unexpected("released", &ev)),
            })
            .collect()
    }

    /// `resume` of a whole gang by its id and token (after the process that held it
    /// crashed, or lockd restarted): every member's lease, taken up on this connection.
    pub async fn resume_gang(&self, saved: &impl LeaseRef) -> Result<Vec<Lease>, LeaseError> {
        self.require("gang")?;
        let evs = self
            .link
            .call_all(&Request::Resume {
                lease_id: saved.lease_id(),
                token: saved.token().to_string(),
            })
            .await?;
        evs.iter()
            .map(|ev| match ev {
                Event::Error { code, message, .. } => Err(LeaseError::Refused {
                    code: code.clone(),
                    message: message.clone(),
                }),
                ev => Lease::from_event(ev).ok_or_else(|| unexpected("granted", ev)),
            })
            .collect()
    }

    /// Wait for the grant of queued gang `gang_id`; other events meanwhile stay for
    /// [`LeaseClient::next_event`]. Fails when the gang's timeout passes
    /// (`cancelled`) or the connection closes. Bound it with a timeout.
    pub async fn wait_gang_granted(&mut self, gang_id: u64) -> Result<Gang, LeaseError> {
        let mine = |e: &LeaseEvent| match e {
            LeaseEvent::GangGranted(g) => g.gang_id == gang_id,
            LeaseEvent::GangCancelled { gang_id: id, .. } => *id == gang_id,
            _ => false,
        };
        let mut ev = self
            .stash
            .iter()
            .position(mine)
            .and_then(|i| self.stash.remove(i));
        loop {
            let e = match ev.take() {
                Some(e) => e,
                None => self
                    .events
                    .recv()
                    .await
                    .ok_or_else(|| LeaseError::Closed("client stopped".into()))?,
            };
            match e {
                LeaseEvent::GangGranted(g) if g.gang_id == gang_id => return Ok(g),
                LeaseEvent::GangCancelled { gang_id: id, label } if id == gang_id => {
                    return Err(LeaseError::Refused {
                        code: "cancelled".into(),
                        message: format!("gang {label:?} ({id}) gave up waiting: its timeout"),
                    })
                }
                LeaseEvent::Closed { reason } => {
                    self.stash.push_back(LeaseEvent::Closed {
                        reason: reason.clone(),
                    });
                    return Err(LeaseError::Closed(reason));
                }
                other => self.stash.push_back(other),
            }
        }
    }

    /// `renew`: a new deadline (ms since the Unix epoch). `ttl`: ask for a new TTL / lease
    /// time (default: the one granted).
    pub async fn renew(&self, l: &impl LeaseRef, ttl: Option<Duration>) -> Result<u64, LeaseError> {
        self.require_any()?;
        renew_on(&self.link, l.lease_id(), l.token(), ttl).await
    }

    /// `release` by lease id: ends a lease, or withdraws a waiting request (needs its
    /// token: use [`LeaseClient::cancel`] for a request queued on this connection).
    pub async fn release(&self, l: &impl LeaseRef) -> Result<Ended, LeaseError> {
        self.require_any()?;
        let ev = self
            .link
            .call(&Request::Release {
                resource: None,
                lease_id: Some(l.lease_id()),
                token: Some(l.token().to_string()),
            })
            .await?;
        match ev {
            Event::Released { epoch, .. } => Ok(Ended::Released { epoch }),
            Event::Cancelled { .. } => Ok(Ended::Cancelled),
            ev => Err(unexpected("released or cancelled", &ev)),
        }
    }

    /// End every lease and withdraw every waiting request of this connection on `resource`
    /// (`release` by resource: the way to cancel a queued request, whose token is not
    /// known before its grant); one [`Ended`] each.
    pub async fn cancel(&self, resource: &str) -> Result<Vec<Ended>, LeaseError> {
        let evs = self.link.call_all(&Request::release(resource)).await?;
        let mut out = Vec::new();
        for ev in evs {
            match ev {
                Event::Released { epoch, .. } => out.push(Ended::Released { epoch }),
                Event::Cancelled { .. } => out.push(Ended::Cancelled),
                Event::Error { code, message, .. } => {
                    return Err(LeaseError::Refused { code, message })
                }
                ev => return Err(unexpected("released or cancelled", &ev)),
            }
        }
        Ok(out)
    }

    /// `commit` (shared kind, exclusive holder): the resource's new version, durable.
    pub async fn commit(&self, l: &impl LeaseRef) -> Result<u64, LeaseError> {
        self.require("shared")?;
        let ev = self
            .link
            .call(&Request::Commit {
                lease_id: l.lease_id(),
                token: l.token().to_string(),
            })
            .await?;
        match ev {
            Event::Committed { version, .. } => Ok(version),
            ev => Err(unexpected("committed", &ev)),
        }
    }

    /// `resume`: take up a live lease on this connection (after the process that held it
    /// crashed); its later events come here. A lease that was revoked is resumed and then
    /// reported ended ([`LeaseEvent::Ended`]).
    pub async fn resume(&self, saved: &impl LeaseRef) -> Result<Lease, LeaseError> {
        self.require_any()?;
        let ev = self
            .link
            .call(&Request::Resume {
                lease_id: saved.lease_id(),
                token: saved.token().to_string(),
            })
            .await?;
        Lease::from_event(&ev).ok_or_else(|| unexpected("granted", &ev))
    }

    /// `lease`: what lockd knows of `lease_id` (state `unknown` if nothing).
    pub async fn lease(&self, lease_id: u64) -> Result<LeaseReport, LeaseError> {
        self.require_any()?;
        match self.link.call(&Request::Lease { lease_id }).await? {
            Event::Lease(r) => Ok(*r),
            ev => Err(unexpected("lease", &ev)),
        }
    }

    /// `leases`: live leases and waiting requests, optionally of one resource / holder.
    pub async fn leases(
        &self,
        resource: Option<&str>,
        holder: Option<&str>,
    ) -> Result<Vec<LeaseReport>, LeaseError> {
        self.require_any()?;
        let req = Request::Leases {
            resource: resource.map(str::to_string),
            holder: holder.map(str::to_string),
        };
        match self.link.call(&req).await? {
            Event::Leases { leases } => Ok(leases),
            ev => Err(unexpected("leases", &ev)),
        }
    }

    /// `offer`: add or change an offer of a quantity pool.
    pub async fn offer(&self, o: &Offer) -> Result<OfferChange, LeaseError> {
        self.require("quantity")?;
        let req = Request::Offer {
            pool: o.pool.clone(),
            name: o.name.clone(),
            quantity: o.quantity,
            attributes: o.attributes.clone(),
            max_lease_time_ms: o.max_lease_time.map(ms),
            requirements: o.requirements.clone(),
            admin_token: o.admin_token.clone(),
        };
        match self.link.call(&req).await? {
            Event::Offered {
                offer,
                renewal_refused,
                ..
            } => Ok(OfferChange {
                offer: Some(*offer),
                renewal_refused,
            }),
            ev => Err(unexpected("offered", &ev)),
        }
    }

    /// `withdraw`: remove an offer (its leases run out; their renewals are refused).
    pub async fn withdraw(
        &self,
        pool: &str,
        name: &str,
        admin_token: Option<&str>,
    ) -> Result<OfferChange, LeaseError> {
        self.require("quantity")?;
        let req = Request::Withdraw {
            pool: pool.into(),
            name: name.into(),
            admin_token: admin_token.map(str::to_string),
        };
        match self.link.call(&req).await? {
            Event::Withdrawn {
                renewal_refused, ..
            } => Ok(OfferChange {
                offer: None,
                renewal_refused,
            }),
            ev => Err(unexpected("withdrawn", &ev)),
        }
    }

    /// `status` (`sessions: false` leaves out the per-session list).
    pub async fn status(&self, sessions: bool) -> Result<StatusReport, LeaseError> {
        let req = Request::Status {
            sessions: (!sessions).then_some(false),
        };
        match self.link.call(&req).await? {
            Event::Status(s) => Ok(*s),
            ev => Err(unexpected("status", &ev)),
        }
    }

    /// The next unsolicited event (None once the connection task is gone and every event
    /// was read; a [`LeaseEvent::Closed`] comes first).
    pub async fn next_event(&mut self) -> Option<LeaseEvent> {
        if let Some(e) = self.stash.pop_front() {
            return Some(e);
        }
        self.events.recv().await
    }

    /// Wait for the grant of queued request `lease_id`; other events meanwhile stay for
    /// [`LeaseClient::next_event`]. Fails when the request ends without a grant (dropped,
    /// or the connection closed). Bound it with a timeout.
    pub async fn wait_granted(&mut self, lease_id: u64) -> Result<Lease, LeaseError> {
        if let Some(i) = self
            .stash
            .iter()
            .position(|e| matches!(e, LeaseEvent::Granted(l) if l.lease_id == lease_id))
        {
            if let Some(LeaseEvent::Granted(l)) = self.stash.remove(i) {
                return Ok(l);
            }
        }
        loop {
            let ev = self
                .events
                .recv()
                .await
                .ok_or_else(|| LeaseError::Closed("client stopped".into()))?;
            match ev {
                LeaseEvent::Granted(l) if l.lease_id == lease_id => return Ok(l),
                LeaseEvent::Dropped {
                    lease_id: id,
                    message,
                } if id == lease_id => {
                    return Err(LeaseError::Refused {
                        code: ErrorCode::Unsatisfiable.as_str().into(),
                        message,
                    })
                }
                LeaseEvent::Closed { reason } => {
                    self.stash.push_back(LeaseEvent::Closed {
                        reason: reason.clone(),
                    });
                    return Err(LeaseError::Closed(reason));
                }
                other => self.stash.push_back(other),
            }
        }
    }

    /// Renew `l` every `every` in the background until the returned handle is dropped (or
    /// [`KeepAlive::stop`]ped). A failed renewal is reported on the event stream as
    /// [`LeaseEvent::RenewFailed`]; the keep-alive stops once the lease has ended (or is
    /// unknown, or the connection closed) and keeps trying after `renewal_refused` (capacity
    /// may come back: [`LeaseEvent::RenewalAllowed`]).
    pub fn keep_renewed(&self, l: &impl LeaseRef, every: Duration) -> KeepAlive {
        let link = self.link.clone();
        let (id, token) = (l.lease_id(), l.token().to_string());
        let (tx, rx) = watch::channel(None);
        let every = every.max(Duration::from_millis(1));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match renew_on(&link, id, &token, None).await {
                    Ok(at) => {
                        let _ = tx.send(Some(at));
                    }
                    Err(e) => {
                        let (code, stop) = match &e {
                            LeaseError::Refused { code, .. } => {
                                (code.clone(), code != ErrorCode::RenewalRefused.as_str())
                            }
                            _ => ("closed".to_string(), true),
                        };
                        let _ = link.events.send(LeaseEvent::RenewFailed {
                            lease_id: id,
                            code,
                            message: e.to_string(),
                        });
                        if stop {
                            return;
                        }
                    }
                }
            }
        });
        KeepAlive { task, expires: rx }
    }
}

async fn renew_on(
    link: &Link,
    lease_id: u64,
    token: &str,
    ttl: Option<Duration>,
) -> Result<u64, LeaseError> {
    let ev = link
        .call(&Request::Renew {
            lease_id,
            token: token.to_string(),
            ttl_ms: ttl.map(ms),
        })
        .await?;
    match ev {
        Event::Renewed {
            expires_at_unix_ms, ..
        } => Ok(expires_at_unix_ms),
        ev => Err(unexpected("renewed", &ev)),
    }
}

/// A background renewal started by [`LeaseClient::keep_renewed`]; dropping it stops it.
pub struct KeepAlive {
    task: JoinHandle<()>,
    expires: watch::Receiver<Option<u64>>,
}

impl KeepAlive {
    /// The deadline set by the last accepted renewal (None before the first).
    pub fn expires_at_unix_ms(&self) -> Option<u64> {
        *self.expires.borrow()
    }

    /// Whether it still runs (false once the lease ended or the connection closed).
    pub fn running(&self) -> bool {
        !self.task.is_finished()
    }

    /// Stop renewing.
    pub fn stop(self) {}
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_lease_wire_form() {
        let s = SavedLease {
            lease_id: 7,
            token: "ab".into(),
        };
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            r#"{"lease_id":7,"token":"ab"}"#
        );
    }

    #[test]
    fn acquire_builders_ask_for_their_kind() {
        let d = Duration::from_millis(250);
        assert_eq!(Acquire::ttl("r", "h", d).kind(), LeaseKind::Ttl);
        assert_eq!(
            Acquire::shared("r", "h", Mode::Shared).with_ttl(d).kind(),
            LeaseKind::Shared
        );
        assert_eq!(
            Acquire::quantity("p", "h", 2).with_ttl(d).kind(),
            LeaseKind::Quantity
        );
        // Sub-millisecond TTLs are not sent as 0 (refused by lockd).
        assert_eq!(
            Acquire::ttl("r", "h", Duration::from_micros(10)).ext.ttl_ms,
            Some(1)
        );
    }
}
