//! lockd: a lock daemon where the connection is the lock.
//!
//! * [`proto`]: the line-delimited JSON wire protocol (see `PROTOCOL.md`).
//! * [`core`]: the pure state machine (sessions, resources, leases, epochs); no I/O.
//! * [`persist`]: the durable state file (tmp + fsync + rename + fsync dir) and its lock file.
//! * [`etcd`]: `lockd serve --backend etcd` (leases held in etcd, self-fencing, fenced puts).
//! * [`server`]: the tokio driver that feeds sockets, timers and persistence into the core.
//! * [`client`]: the async client library used by the supervisor and `lockd hold`.
//! * [`lease_client`]: the async client for the version-2 lease kinds (TTL, shared, quantity).

mod anchor;
pub mod client;
pub mod core;
pub mod etcd;
pub mod kinds;
pub mod lease_client;
pub mod line;
pub mod metrics;
pub mod offers_file;
pub mod persist;
pub mod proto;
pub mod reserve;
pub mod reserve_cmd;
pub mod server;
pub mod text_pages;
pub mod watchdog;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Where a lockd listens / where a client connects: `unix:/path` or `tcp:host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A Unix stream socket path (the default transport: the pod's shared emptyDir).
    Unix(PathBuf),
    /// A TCP `host:port` (for engines that span nodes).
    Tcp(String),
}

/// Why an endpoint string could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointParseError {
    /// The text starts with neither `unix:` nor `tcp:`.
    #[error("endpoint {0:?} must start with unix: or tcp:")]
    Scheme(String),
    /// The part after the scheme is empty or malformed.
    #[error("endpoint {0:?}: {1}")]
    Invalid(String, &'static str),
}

impl FromStr for Endpoint {
    type Err = EndpointParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(EndpointParseError::Invalid(s.into(), "empty socket path"));
            }
            Ok(Endpoint::Unix(PathBuf::from(p)))
        } else if let Some(hp) = s.strip_prefix("tcp:") {
            match hp.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
                    Ok(Endpoint::Tcp(hp.to_string()))
                }
                _ => Err(EndpointParseError::Invalid(
                    s.into(),
                    "expected tcp:HOST:PORT",
                )),
            }
        } else {
            Err(EndpointParseError::Scheme(s.into()))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips() {
        for s in [
            "unix:/tmp/x.sock",
            "tcp:127.0.0.1:7000",
            "tcp:[::1]:80",
            "tcp:lockd:1",
        ] {
            let e: Endpoint = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        assert_eq!(
            "unix:/a".parse::<Endpoint>().unwrap(),
            Endpoint::Unix(PathBuf::from("/a"))
        );
    }

    #[test]
    fn endpoint_rejects_bad_text() {
        for s in [
            "",
            "/tmp/x",
            "unix:",
            "tcp:",
            "tcp:host",
            "tcp::80",
            "tcp:h:notaport",
            "http://x",
        ] {
            assert!(s.parse::<Endpoint>().is_err(), "{s} parsed");
        }
    }
}
