//! QURD across independent lockd instances (issue 12 point 2; seed 003): reserve one
//! resource on each of N of the given lockd endpoints — all of them or none — the way
//! QURD's `qurdcli` reserves machines from per-machine `qurdd` agents, with no central
//! component.
//!
//! * **fail** semantics: one pass over the endpoints, each asked with `wait:false`; fewer
//!   than N granted → every reservation is released and the call fails at once.
//! * **wait** semantics: the endpoints are taken in one **global order** (the sorted
//!   endpoint names: every client that uses the same names for the same lockd instances
//!   uses the same order); a busy one is skipped while the ones after it can still make up
//!   the set, else waited for (`wait:true`), so a client only ever waits for an endpoint
//!   ordered after every one it holds (the strategy `lockd-model` checks: docs/qurd-model.md). A wait-for cycle would need a client holding a later
//!   endpoint while waiting for an earlier one, which the order forbids: waiting clients
//!   cannot deadlock (the classic resource-ordering argument), whatever the timeouts.
//! * Every grant is a **reservation** (`reserve_ms`, lockd's feature `reserve`): a lockd
//!   cancels it unless the client confirms it with `start` in time, so a client that
//!   vanished or hangs while holding part of a set never pins a resource (the seed's
//!   `cancel`; a client that dies outright frees its reservations at once anyway: the
//!   connection is the lock). The client sends `start` to all N only once it holds all N.
//! * A cancelled reservation, an endpoint that cannot be reached, or the loss of one while
//!   waiting makes the client release everything and retry the whole pass after a
//!   **randomised exponential backoff** (so that clients whose reservations time out
//!   together do not retry in lockstep: no livelock by synchrony), until the deadline.
//!
//! Blocking I/O, one connection per endpoint; every wait is bounded by the deadline.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::proto::{self, AcquireExt, Event, Request};
use crate::Endpoint;

/// All or nothing, now (`fail`) or by waiting in the global order (`wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Semantics {
    /// Answer at once: all N free now, or nothing.
    Fail,
    /// Wait (in the global endpoint order) until N are held, or the deadline.
    Wait,
}

/// What to reserve, where, for how long.
#[derive(Debug, Clone)]
pub struct ReserveOptions {
    /// The lockd instances (one resource each).
    pub endpoints: Vec<Endpoint>,
    /// How many of them are needed.
    pub count: usize,
    /// `fail` or `wait`.
    pub semantics: Semantics,
    /// The resource name on each lockd.
    pub resource: String,
    /// Holder name shown by each lockd.
    pub holder: String,
    /// Give up (and release everything) after this long.
    pub timeout: Duration,
    /// Each lockd cancels a reservation not `start`ed within this long.
    pub reserve_timeout: Duration,
    /// Connecting to one lockd may take this long.
    pub connect_timeout: Duration,
}

/// Why no reservation was made. Everything reserved meanwhile was released.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// Fewer endpoints than `count`, or `count` is 0.
    #[error("cannot reserve {count} of {endpoints} endpoints")]
    BadCount {
        /// Asked for.
        count: usize,
        /// Given.
        endpoints: usize,
    },
    /// `fail` semantics: not all were free now.
    #[error("only {got} of {count} could be reserved now")]
    Unavailable {
        /// Reserved (then released).
        got: usize,
        /// Needed.
        count: usize,
    },
    /// The deadline passed.
    #[error("timed out with {got} of {count} reserved")]
    TimedOut {
        /// Reserved when the deadline passed (then released).
        got: usize,
        /// Needed.
        count: usize,
    },
}

/// One open connection to a lockd, holding (or waiting for) its resource.
#[derive(Debug)]
pub struct Link {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The resource reserved there.
    pub resource: String,
    /// The epoch granted there.
    pub epoch: u64,
    conn: Conn,
}

#[derive(Debug)]
enum Conn {
    Unix(BufReader<UnixStream>),
    Tcp(BufReader<TcpStream>),
}

impl Conn {
    fn open(ep: &Endpoint, timeout: Duration) -> std::io::Result<Conn> {
        Ok(match ep {
            Endpoint::Unix(p) => Conn::Unix(BufReader::new(UnixStream::connect(p)?)),
            Endpoint::Tcp(hp) => {
                let addr = std::net::ToSocketAddrs::to_socket_addrs(hp.as_str())?
                    .next()
                    .ok_or_else(|| std::io::Error::other("no address"))?;
                let s = TcpStream::connect_timeout(&addr, timeout)?;
                s.set_nodelay(true)?;
                Conn::Tcp(BufReader::new(s))
            }
        })
    }

    fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        let t = t.map(|d| d.max(Duration::from_millis(1)));
        match self {
            Conn::Unix(s) => s.get_ref().set_read_timeout(t),
            Conn::Tcp(s) => s.get_ref().set_read_timeout(t),
        }
    }

    fn send(&mut self, req: &Request) -> std::io::Result<()> {
        let line = proto::encode_request(req);
        match self {
            Conn::Unix(s) => s.get_mut().write_all(line.as_bytes()),
            Conn::Tcp(s) => s.get_mut().write_all(line.as_bytes()),
        }
    }

    /// The next event, or None at the deadline / end of file / an unreadable line.
    fn next(&mut self, deadline: Instant) -> Option<Event> {
        let left = deadline.checked_duration_since(Instant::now())?;
        self.set_timeout(Some(left)).ok()?;
        let mut line = String::new();
        let n = match self {
            Conn::Unix(s) => s.read_line(&mut line),
            Conn::Tcp(s) => s.read_line(&mut line),
        }
        .ok()?;
        if n == 0 {
            return None;
        }
        proto::decode_event(line.as_bytes()).ok()
    }

    fn raw_fd(&self) -> RawFd {
        match self {
            Conn::Unix(s) => s.get_ref().as_raw_fd(),
            Conn::Tcp(s) => s.get_ref().as_raw_fd(),
        }
    }
}

impl Link {
    /// The connection's descriptor (to let a child inherit it, or to poll it).
    pub fn raw_fd(&self) -> RawFd {
        self.conn.raw_fd()
    }

    /// Block until lockd says something about this lease (or the connection ends, or the
    /// deadline passes): `None` = the connection ended (lockd died) or the deadline passed.
    pub fn next_event(&mut self, deadline: Instant) -> Option<Event> {
        self.conn.next(deadline)
    }
}

/// Read an endpoints file: one `unix:PATH` or `tcp:HOST:PORT` per line; blank lines and
/// lines starting with `#` are ignored. Errors name the line.
pub fn endpoints_file(path: &std::path::Path) -> Result<Vec<Endpoint>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("endpoints file {}: {e}", path.display()))?;
    parse_endpoints(&text).map_err(|e| format!("endpoints file {}: {e}", path.display()))
}

/// The endpoints of an endpoints file's text.
pub fn parse_endpoints(text: &str) -> Result<Vec<Endpoint>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        out.push(
            l.parse::<Endpoint>()
                .map_err(|e| format!("line {}: {e}", n + 1))?,
        );
    }
    Ok(out)
}

/// What one endpoint answered.
enum Got {
    Granted(Link),
    Busy,
    Unreachable,
    Deadline,
}

/// Connect to `ep` and ask for `resource` (reserved for `reserve_ms`).
fn ask(ep: &Endpoint, o: &ReserveOptions, wait: bool, deadline: Instant) -> Got {
    let mut conn = match Conn::open(ep, o.connect_timeout) {
        Ok(c) => c,
        Err(_) => return Got::Unreachable,
    };
    let hello = conn.next(deadline.min(Instant::now() + o.connect_timeout));
    let Some(Event::Hello { features, .. }) = hello else {
        return Got::Unreachable;
    };
    if !features.iter().any(|f| f == "reserve") {
        return Got::Unreachable;
    }
    let req = Request::Acquire {
        resource: o.resource.clone(),
        holder: o.holder.clone(),
        wait,
        ext: AcquireExt {
            reserve_ms: Some(o.reserve_timeout.as_millis().max(1) as u64),
            ..AcquireExt::default()
        },
    };
    if conn.send(&req).is_err() {
        return Got::Unreachable;
    }
    loop {
        match conn.next(deadline) {
            Some(Event::Granted { epoch, .. }) => {
                return Got::Granted(Link {
                    endpoint: ep.clone(),
                    resource: o.resource.clone(),
                    epoch,
                    conn,
                })
            }
            Some(Event::Busy { .. }) => return Got::Busy,
            Some(Event::Queued { .. }) => continue,
            Some(_) => return Got::Unreachable,
            None if Instant::now() >= deadline => return Got::Deadline,
            None => return Got::Unreachable,
        }
    }
}

/// Confirm every reservation (`start`); false if one was cancelled or lost meanwhile.
fn start_all(links: &mut [Link], deadline: Instant) -> bool {
    links.iter_mut().all(|l| {
        let req = Request::Start {
            resource: l.resource.clone(),
        };
        l.conn.send(&req).is_ok() && matches!(l.conn.next(deadline), Some(Event::Started { .. }))
    })
}

/// Reserve `count` of the endpoints, all or nothing. On success every reservation is
/// confirmed (`start`ed) and held by the returned links: drop them (or let the process
/// that inherited them die) to release.
pub fn reserve(o: &ReserveOptions) -> Result<Vec<Link>, ReserveError> {
    if o.count == 0 || o.count > o.endpoints.len() {
        return Err(ReserveError::BadCount {
            count: o.count,
            endpoints: o.endpoints.len(),
        });
    }
    let deadline = Instant::now() + o.timeout;
    let mut order = o.endpoints.clone();
    order.sort_by_key(|e| e.to_string());
    order.dedup();
    let mut backoff = Duration::from_millis(20);
    let mut rng = rand::thread_rng();
    loop {
        let mut held: Vec<Link> = Vec::new();
        let mut lost = false;
        for (i, ep) in order.iter().enumerate() {
            if held.len() == o.count {
                break;
            }
            // Wait semantics wait for this endpoint only when the ones after it could not
            // make up the set; otherwise a busy one is skipped (still in the global order:
            // a client only ever waits for an endpoint after every one it holds).
            let after = order.len() - i - 1;
            let wait = o.semantics == Semantics::Wait && after < o.count - held.len();
            match ask(ep, o, wait, deadline) {
                Got::Granted(l) => held.push(l),
                Got::Busy | Got::Unreachable => {}
                Got::Deadline => {
                    lost = true;
                    break;
                }
            }
        }
        let got = held.len();
        if got == o.count && start_all(&mut held, deadline) {
            return Ok(held);
        }
        drop(held); // closing the connections releases every reservation
        if o.semantics == Semantics::Fail {
            return Err(ReserveError::Unavailable {
                got,
                count: o.count,
            });
        }
        let now = Instant::now();
        if lost || now >= deadline {
            return Err(ReserveError::TimedOut {
                got,
                count: o.count,
            });
        }
        // Randomised exponential backoff before the next pass.
        let pause = rng.gen_range(backoff / 2..=backoff);
        std::thread::sleep(pause.min(deadline - now));
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_files_skip_comments_and_name_the_bad_line() {
        let e = parse_endpoints("# agents\nunix:/run/a.sock\n\n  tcp:node-b:7070  \n").unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].to_string(), "tcp:node-b:7070");
        let err = parse_endpoints("unix:/a\nnode-c\n").unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
    }

    #[test]
    fn a_count_above_the_endpoints_is_refused_before_any_connection() {
        let o = ReserveOptions {
            endpoints: vec![Endpoint::Unix("/nonexistent".into())],
            count: 2,
            semantics: Semantics::Wait,
            resource: "node".into(),
            holder: "t".into(),
            timeout: Duration::from_millis(10),
            reserve_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(10),
        };
        assert!(matches!(
            reserve(&o),
            Err(ReserveError::BadCount {
                count: 2,
                endpoints: 1
            })
        ));
    }
}
