//! `lockd serve --backend etcd`: the same version-1 protocol to local clients, the leases
//! held in etcd (docs/ETCD.md).
//!
//! * [`fence`]: the pure self-fencing state machine (deadline = send time of the last
//!   acknowledged keepalive + TTL − margin), tested transition by transition;
//! * [`mutex`]: etcd's mutex recipe (one key per waiter under the resource's prefix, owner =
//!   lowest create revision, each waiter watches its predecessor; epoch = the lock key's
//!   create revision) and the fenced put (one transaction comparing that revision);
//! * [`server`]: the tokio driver: local connections, one etcd lease per session kept alive
//!   and fenced, one task per waiting acquire, the connection's close revoking the lease.
//!
//! Served: `hello`, `acquire` (version-1 exclusive, connection-bound; `wait` true/false),
//! `release`, `revoke` (holders on this lockd), `status`, `watch` (this lockd's changes),
//! `ping`, `anchor` (socket pairs and pidfds, as in the file backend) and the etcd-only
//! `put_fenced`, and TTL leases (kind `ttl`, [`ttl`] and `server::ttl_ops`: an etcd lease of
//! their own each, found by their id from any lockd). Refused with `error` `unsupported`
//! (naming the etcd backend): the other version-2 kinds (shared, quantity, gang, reserve) and
//! their ops; `reclaim` is refused with
//! `reclaim_refused` (a restarted lockd does not adopt the previous one's etcd leases: the
//! client reports the lease lost and its holder fences).

pub mod fence;
pub mod mutex;
pub mod server;
pub mod ttl;

use std::time::Duration;

use crate::Endpoint;
pub use fence::Margin;

/// Settings of `lockd serve --backend etcd`.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Local listeners (the same endpoints as the file backend).
    pub listen: Vec<Endpoint>,
    /// etcd client URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix of the locks (`<prefix>/<resource>/<lease>`); fenced puts go to
    /// `<prefix>.data/<key>`.
    pub prefix: String,
    /// TTL asked for each session's etcd lease (etcd may raise it to its minimum).
    pub ttl: Duration,
    /// The self-fence margin's parts.
    pub margin: Margin,
    /// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_FENCE_NO_MARGIN=1`): fence at the lease's
    /// expiry instead of `margin` before it.
    pub planted_bug_no_margin: bool,
    /// Token that `revoke` over TCP must carry.
    pub admin_token: Option<String>,
    /// Longest request line.
    pub max_line: usize,
    /// A connection that sends no request within this time is closed.
    pub idle_timeout: Duration,
    /// Bound on one etcd call.
    pub op_timeout: Duration,
    /// This lockd's name in the lock keys' values (`holder@node`).
    pub node: String,
}

/// Why `lockd serve --backend etcd` could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum EtcdServeError {
    /// No listener was given.
    #[error("no --listen endpoint")]
    NoListener,
    /// No etcd endpoint was given.
    #[error("--backend etcd needs --etcd-endpoints")]
    NoEndpoints,
    /// The margin leaves no time to renew in.
    #[error("the self-fence margin {margin:?} is not below the etcd lease TTL {ttl:?}")]
    MarginTooLarge {
        /// The margin.
        margin: Duration,
        /// The TTL.
        ttl: Duration,
    },
    /// etcd could not be reached at startup.
    #[error("cannot reach etcd at {endpoints}: {source}")]
    Connect {
        /// The endpoints tried.
        endpoints: String,
        /// Why.
        source: mutex::EtcdError,
    },
    /// A listener could not be bound.
    #[error("cannot listen on {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: std::io::Error,
    },
    /// A live lockd already serves that socket.
    #[error("{0} is in use by a running lockd")]
    SocketInUse(String),
}
