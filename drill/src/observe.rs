//! What the drill reads from the processes it drills: supervisors' probe endpoints (through
//! the workspace's one HTTP client, `harness::http`, on tokio's blocking pool), `lockd watch`
//! JSON lines and `lockd status` output (`lockd::proto::StatusReport`). `/state` is read as
//! the supervisor writes it: `probes::StateDoc`.

use std::net::SocketAddr;
use std::time::Duration;

use harness::http::Response;
use lockd::proto::{ResourceReport, StatusReport};
use probes::StateDoc;

/// Errors of the probe client.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// No answer in time (refused, reset, timed out).
    #[error("http {0}: no response")]
    NoResponse(String),
    /// The answer was not the expected JSON (or not a 200).
    #[error("http {0}: bad response: {1}")]
    Bad(String, String),
}

/// `GET path` on a loopback address (`harness::http::get`, run on the blocking pool).
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<Response, ObserveError> {
    let url = format!("http://{addr}{path}");
    let what = format!("GET {addr}{path}");
    tokio::task::spawn_blocking(move || harness::http::get(&url, timeout))
        .await
        .ok()
        .flatten()
        .ok_or(ObserveError::NoResponse(what))
}

/// `POST path` with a JSON body on a loopback address (`harness::http::post_json`, run on the
/// blocking pool).
pub async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<Response, ObserveError> {
    let url = format!("http://{addr}{path}");
    let what = format!("POST {addr}{path}");
    let body = body.to_string();
    tokio::task::spawn_blocking(move || harness::http::post_json(&url, &body, timeout))
        .await
        .ok()
        .flatten()
        .ok_or(ObserveError::NoResponse(what))
}

/// Fetches and parses `/state`.
pub async fn get_state(addr: SocketAddr, timeout: Duration) -> Result<StateDoc, ObserveError> {
    let r = http_get(addr, "/state", timeout).await?;
    if r.status != 200 {
        return Err(ObserveError::Bad(
            format!("GET {addr}/state"),
            format!("status {}", r.status),
        ));
    }
    StateDoc::parse(&r.body)
        .map_err(|e| ObserveError::Bad(format!("GET {addr}/state"), e.to_string()))
}

/// A lock event read from `lockd watch`, in the few shapes a JSON event may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Lowercased event name (granted, released, revoked, expired, ...).
    pub event: String,
    /// The resource.
    pub resource: Option<String>,
    /// The holder named by the event.
    pub holder: Option<String>,
    /// The epoch named by the event.
    pub epoch: Option<u64>,
    /// A reclaim of a held lease after a lockd restart.
    pub reclaimed: bool,
}

impl WatchEvent {
    /// A grant (new or reclaimed).
    pub fn is_grant(&self) -> bool {
        self.event.contains("grant")
            || self.event.contains("reclaim") && !self.event.contains("window")
    }
}

/// Parses one `lockd watch` line. Accepts `{"event": "granted", ...}`, `{"type": ...}`,
/// `{"kind": ...}` and externally tagged `{"Granted": {...}}` shapes; `None` for lines that
/// are not JSON objects.
pub fn parse_watch_line(line: &str) -> Option<WatchEvent> {
    let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
    let obj = v.as_object()?;
    let (name, body) = if let Some(n) = ["event", "type", "kind", "op"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(|x| x.as_str()))
    {
        (n.to_string(), &v)
    } else if obj.len() == 1 {
        let (k, b) = obj.iter().next()?;
        (k.clone(), b)
    } else {
        return None;
    };
    let s = |k: &str| body.get(k).and_then(|x| x.as_str()).map(str::to_string);
    let name = name.to_ascii_lowercase();
    Some(WatchEvent {
        reclaimed: body
            .get("reclaimed")
            .and_then(|x| x.as_bool())
            .unwrap_or(false)
            || name.contains("reclaim"),
        event: name,
        resource: s("resource"),
        holder: s("holder").or_else(|| s("to")),
        epoch: body.get("epoch").and_then(|x| x.as_u64()),
    })
}

/// The entry of one resource in a `lockd status` report.
pub fn resource<'a>(status: &'a StatusReport, name: &str) -> Option<&'a ResourceReport> {
    status.resources.iter().find(|r| r.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn parses_watch_lines_of_several_shapes() {
        let e = parse_watch_line(
            r#"{"event":"granted","resource":"engine","holder":"engine-1","epoch":4}"#,
        )
        .unwrap();
        assert!(e.is_grant());
        assert_eq!(
            (e.holder.as_deref(), e.epoch, e.reclaimed),
            (Some("engine-1"), Some(4), false)
        );
        let e = parse_watch_line(
            r#"{"type":"Granted","resource":"engine","holder":"a","epoch":4,"reclaimed":true}"#,
        )
        .unwrap();
        assert!(e.is_grant() && e.reclaimed);
        let e = parse_watch_line(r#"{"Granted":{"resource":"engine","holder":"a","epoch":5}}"#)
            .unwrap();
        assert_eq!((e.event.as_str(), e.epoch), ("granted", Some(5)));
        let e =
            parse_watch_line(r#"{"event":"released","resource":"engine","holder":"a","epoch":5}"#)
                .unwrap();
        assert!(!e.is_grant());
        assert!(parse_watch_line("not json").is_none());
        assert!(parse_watch_line("[1,2]").is_none());
        assert!(parse_watch_line(r#"{"a":1,"b":2}"#).is_none());
    }

    #[test]
    fn reads_lockd_status_as_lockd_writes_it() {
        let s: StatusReport = serde_json::from_str(
            r#"{"resources":[{"name":"engine","holder":"engine-0","epoch":3,"state":"held","waiters":["engine-1"]}],
                "counters":{"grants":3,"releases":2,"expirations":0,"revocations":0}}"#,
        )
        .unwrap();
        let r = resource(&s, "engine").unwrap();
        assert_eq!(
            (r.holder.as_deref(), r.epoch, r.state),
            (Some("engine-0"), 3, lockd::proto::LeaseState::Held)
        );
        assert!(resource(&s, "other").is_none());
    }

    #[tokio::test]
    async fn get_state_against_a_real_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap();
            assert!(std::str::from_utf8(&buf[..n])
                .unwrap()
                .starts_with("GET /state HTTP/1.1\r\n"));
            let body = r#"{"state":"standby","engine_id":1,"role":"shadow","transitions":[{"to":"init","at_unix_us":1},{"to":"standby","at_unix_us":9}],"marks":{"lock_connected":5}}"#;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(resp.as_bytes()).unwrap();
        });
        let d = get_state(addr, Duration::from_secs(5)).await.unwrap();
        assert_eq!(d.state, probes::Phase::Standby);
        assert_eq!(d.entered(probes::Phase::Standby), Some(9));
        assert_eq!(d.mark(probes::MarkKind::LockConnected), Some(5));
        server.join().unwrap();
        // Nobody listening: an error, not a hang.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(get_state(dead, Duration::from_secs(2)).await.is_err());
    }
}
