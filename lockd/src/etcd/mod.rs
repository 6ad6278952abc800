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
//! `put_fenced`, TTL leases (kind `ttl`, [`ttl`] and `server::ttl_ops`: an etcd lease of
//! their own each, found by their id from any lockd) and gangs of exclusive connection-bound
//! leases ([`gang`] and `server::gang_ops`: one transaction puts every member key). Refused
//! with `error` `unsupported` (naming the etcd backend): the other version-2 kinds (shared,
//! quantity, TTL/shared/reserved gangs, reserve) and their ops; `reclaim` is refused with
//! `reclaim_refused` (a restarted lockd does not adopt the previous one's etcd leases: the
//! client reports the lease lost and its holder fences).

pub mod expiry;
pub mod fence;
pub mod gang;
pub mod leader_change;
pub mod members;
pub mod metrics;
pub mod mutex;
pub mod server;
pub mod ttl;

use std::time::Duration;

use crate::Endpoint;
pub use fence::Margin;
pub use leader_change::LeaderChange;

#[cfg(test)]
mod tls_tests {
    use super::check_endpoints;

    #[test]
    fn endpoints_must_all_match_the_tls_setting() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(check_endpoints(&v(&["http://a:1", "http://b:2"]), false).is_ok());
        assert!(check_endpoints(&v(&["https://a:1", "https://b:2"]), true).is_ok());
        let e = check_endpoints(&v(&["https://a:1"]), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs --etcd-ca"), "{e}");
        let e = check_endpoints(&v(&["https://a:1", "http://b:2"]), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http://b:2") && e.contains("must be https"),
            "{e}"
        );
        let e = check_endpoints(&v(&["a:1"]), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected http://"), "{e}");
    }

    #[test]
    fn a_start_failure_names_what_to_check() {
        use super::connect_hint;
        let wrong = "grpc request error: status: InvalidArgument, message: \"etcdserver: authentication failed, invalid user ID or password\"";
        assert!(connect_hint(wrong, false, true).contains("--etcd-password-file"));
        let anon = "status: InvalidArgument, message: \"etcdserver: user name is empty\"";
        assert!(connect_hint(anon, false, false).contains("give lockd --etcd-user"));
        let denied = "message: \"etcdserver: permission denied\"";
        assert!(connect_hint(denied, false, true).contains("readwrite on the key prefix"));
        let closed = "transport error";
        assert!(connect_hint(closed, true, false).contains("--etcd-cert"));
        assert_eq!(connect_hint(closed, false, false), "");
        // The password is never in a Debug rendering.
        let a = super::EtcdAuth {
            user: "lockd".into(),
            password: "s3cret".into(),
        };
        assert!(!format!("{a:?}").contains("s3cret"));
    }
}

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
    /// What a session's fence does at an etcd leader change (`--etcd-leader-change`).
    pub leader_change: LeaderChange,
    /// TLS to etcd (`https://` endpoints): None for `http://`.
    pub tls: Option<EtcdTls>,
    /// etcd user and password (etcd's `auth enable`): None without.
    pub auth: Option<EtcdAuth>,
    /// A waiter revokes its predecessor's etcd lease once it has provably expired on etcd's
    /// leader (`--etcd-enforce-expiry`, [`expiry`]).
    pub enforce_expiry: bool,
    /// `--metrics HOST:PORT`: serve [`metrics::EtcdMetrics`] at `GET /metrics`.
    pub metrics: Option<String>,
    /// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_EXPIRY_EARLY=1`): that revoke comes at
    /// the first "0 s left", up to a second early.
    pub planted_bug_expiry_early: bool,
    /// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_CREDIT_UNCONFIRMED=1`): when fencing at
    /// leader changes, credit a keepalive answer of the old term at once, without the
    /// linearizable read that proves the old leader renewed ([`fence`]).
    pub planted_bug_credit_unconfirmed: bool,
    /// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_STAY_ON_STALLED_MEMBER=1`): a keepalive
    /// stream to an etcd member that stopped answering stays there ([`members`]).
    pub planted_bug_stay_on_stalled_member: bool,
}

/// TLS to etcd: the CA that signed etcd's serving certificate and, for etcd's
/// `--client-cert-auth`, this lockd's client certificate and key (all PEM).
#[derive(Clone)]
pub struct EtcdTls {
    /// `--etcd-ca`.
    pub ca_pem: Vec<u8>,
    /// `--etcd-cert` and `--etcd-key`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

/// An etcd user (`--etcd-user`) and its password (`--etcd-password-file`). etcd-client
/// authenticates at connect and, its simple tokens expiring after `--auth-token-ttl` of
/// disuse, again when etcd refuses an expired one (`with_auto_token_refresh`).
#[derive(Clone)]
pub struct EtcdAuth {
    /// The user.
    pub user: String,
    /// The password.
    pub password: String,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .finish()
    }
}

/// What a failure to talk to etcd at start suggests checking, from etcd's message (empty, or
/// starting with "; "). A TLS handshake that etcd's `--client-cert-auth` rejects only shows as
/// a closed connection on this side.
pub fn connect_hint(message: &str, tls_without_identity: bool, auth: bool) -> &'static str {
    let m = message.to_ascii_lowercase();
    if m.contains("authentication failed") || m.contains("invalid user id or password") {
        "; etcd refused the user or password (--etcd-user, --etcd-password-file)"
    } else if m.contains("user name is empty") || (m.contains("user name not found") && !auth) {
        "; etcd has authentication enabled: give lockd --etcd-user and --etcd-password-file"
    } else if m.contains("permission denied") {
        "; the etcd user needs readwrite on the key prefix (etcdctl role grant-permission ROLE --prefix=true readwrite PREFIX, PREFIX without its trailing slash: it covers PREFIX/ and PREFIX.data/)"
    } else if tls_without_identity {
        "; if etcd runs with --client-cert-auth, give lockd --etcd-cert and --etcd-key"
    } else {
        ""
    }
}

/// Whether the endpoints and the TLS settings agree: every endpoint `https://` with TLS, every
/// one `http://` without (a mix would send the lock traffic of some members in clear).
pub fn check_endpoints(endpoints: &[String], tls: bool) -> Result<(), EtcdServeError> {
    for e in endpoints {
        let ok = if tls {
            e.starts_with("https://")
        } else {
            e.starts_with("http://")
        };
        if !ok {
            return Err(EtcdServeError::Endpoint {
                endpoint: e.clone(),
                why: if tls {
                    "--etcd-ca is set: every endpoint must be https://".into()
                } else if e.starts_with("https://") {
                    "an https:// endpoint needs --etcd-ca (the CA of etcd's certificate)".into()
                } else {
                    "expected http://HOST:PORT (or https:// with --etcd-ca)".into()
                },
            });
        }
    }
    Ok(())
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
    /// An endpoint that does not fit the TLS settings.
    #[error("--etcd-endpoints {endpoint}: {why}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// The margin leaves no time to renew in.
    #[error("the self-fence margin {margin:?} is not below the etcd lease TTL {ttl:?}")]
    MarginTooLarge {
        /// The margin.
        margin: Duration,
        /// The TTL.
        ttl: Duration,
    },
    /// etcd could not be reached at startup.
    #[error("cannot reach etcd at {endpoints}: {source}{hint}")]
    Connect {
        /// The endpoints tried.
        endpoints: String,
        /// Why.
        source: mutex::EtcdError,
        /// What to check (empty, or starting with "; ").
        hint: &'static str,
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
