//! What the drill reads from the processes it drills: supervisors' probe endpoints (a tiny
//! HTTP/1.1 client over loopback), `lockd watch` JSON lines and `lockd status` output.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::invariants::Transition;

/// Errors of the probe client.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// Connecting, writing or reading failed.
    #[error("http {0}: {1}")]
    Io(String, std::io::Error),
    /// No full answer in time.
    #[error("http {0}: timed out")]
    Timeout(String),
    /// The answer was not HTTP or not the expected JSON.
    #[error("http {0}: bad response: {1}")]
    Bad(String, String),
}

/// `GET path` on a loopback address; returns the status code and the body.
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ObserveError> {
    http_request(addr, "GET", path, None, timeout).await
}

/// One HTTP/1.1 request (`Connection: close`); a body is sent as JSON.
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ObserveError> {
    let what = format!("{method} {addr}{path}");
    let fut = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| ObserveError::Io(what.clone(), e))?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n"
        );
        if let Some(b) = body {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            ));
        } else {
            req.push_str("\r\n");
        }
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| ObserveError::Io(what.clone(), e))?;
        let mut buf = Vec::with_capacity(4096);
        s.read_to_end(&mut buf)
            .await
            .map_err(|e| ObserveError::Io(what.clone(), e))?;
        parse_response(&buf).map_err(|m| ObserveError::Bad(what.clone(), m))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(ObserveError::Timeout(what)),
    }
}

/// Parses a whole HTTP/1.x response (content-length, chunked or read-to-close bodies).
pub fn parse_response(buf: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = find(buf, b"\r\n\r\n").ok_or("no end of headers")?;
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| "headers not utf-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split_whitespace();
    if !parts.next().unwrap_or_default().starts_with("HTTP/1.") {
        return Err(format!("not an HTTP status line: {status_line:?}"));
    }
    let code: u16 = parts
        .next()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut chunked = false;
    let mut len: Option<usize> = None;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        } else if k == "content-length" {
            len = v.parse().ok();
        }
    }
    let body = &buf[end + 4..];
    if chunked {
        return dechunk(body).map(|b| (code, b));
    }
    Ok((
        code,
        match len {
            Some(n) if n <= body.len() => body[..n].to_vec(),
            Some(_) => return Err("body shorter than content-length".into()),
            None => body.to_vec(),
        },
    ))
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = find(b, b"\r\n").ok_or("truncated chunk size")?;
        let size_text = std::str::from_utf8(&b[..eol]).map_err(|_| "bad chunk size")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// A supervisor's `GET /state` document (docs/INTERFACES.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StateDoc {
    /// init | standby | waking | active | dead.
    pub state: String,
    /// The engine id it supervises.
    #[serde(default)]
    pub engine_id: Option<u64>,
    /// Its lease epoch while it holds one.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// The engine's main pid, while it runs.
    #[serde(default)]
    pub engine_pid: Option<u32>,
    /// Every state entered, with wall-clock microseconds.
    #[serde(default)]
    pub transitions: Vec<Transition>,
    /// Named points in time on the failover path (`engine_exit_detected`, `fenced`,
    /// `lock_closed`, `lock_granted`, `lock_reclaimed`, ...), wall-clock microseconds; an
    /// extension of this supervisor's `/state`, absent elsewhere.
    #[serde(default)]
    pub marks: std::collections::BTreeMap<String, i64>,
}

/// Fetches and parses `/state`.
pub async fn get_state(addr: SocketAddr, timeout: Duration) -> Result<StateDoc, ObserveError> {
    let (code, body) = http_get(addr, "/state", timeout).await?;
    if code != 200 {
        return Err(ObserveError::Bad(
            format!("GET {addr}/state"),
            format!("status {code}"),
        ));
    }
    serde_json::from_slice(&body)
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

/// One resource of `lockd status`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ResourceStatus {
    /// Resource name.
    pub name: String,
    /// Current holder.
    #[serde(default)]
    pub holder: Option<String>,
    /// Current epoch.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// free | held | reclaiming.
    #[serde(default)]
    pub state: Option<String>,
}

/// `lockd status` output.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LockdStatus {
    /// Every resource lockd knows.
    #[serde(default)]
    pub resources: Vec<ResourceStatus>,
}

impl LockdStatus {
    /// The entry of one resource.
    pub fn resource(&self, name: &str) -> Option<&ResourceStatus> {
        self.resources.iter().find(|r| r.name == name)
    }
}

#[cfg(test)]
mod tests {
    use crate::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let r = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(parse_response(r).unwrap(), (200, b"hello".to_vec()));
        let r = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (503, b"abcde".to_vec()));
        let r = b"HTTP/1.0 200 OK\r\n\r\nall of it";
        assert_eq!(parse_response(r).unwrap(), (200, b"all of it".to_vec()));
        assert!(parse_response(b"garbage").is_err());
        assert!(parse_response(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
    }

    #[test]
    fn parses_state_documents() {
        let d: StateDoc = serde_json::from_str(
            r#"{"state":"active","engine_id":1,"role":"shadow","epoch":7,"since_ms":3,"engine_pid":42,
                "transitions":[{"to":"init","at_unix_us":1},{"to":"active","at_unix_us":9}]}"#,
        )
        .unwrap();
        assert_eq!(d.state, "active");
        assert_eq!(d.epoch, Some(7));
        assert_eq!(d.engine_pid, Some(42));
        assert_eq!(d.transitions[1].at_unix_us, 9);
        assert!(d.marks.is_empty());
        let d: StateDoc =
            serde_json::from_str(r#"{"state":"dead","marks":{"fenced":5,"lock_closed":7}}"#)
                .unwrap();
        assert_eq!(d.marks.get("lock_closed"), Some(&7));
        let d: StateDoc =
            serde_json::from_str(r#"{"state":"init","epoch":null,"engine_pid":null}"#).unwrap();
        assert_eq!(d.epoch, None);
        assert!(d.transitions.is_empty());
    }

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
    fn parses_lockd_status() {
        let s: LockdStatus = serde_json::from_str(
            r#"{"resources":[{"name":"engine","holder":"engine-0","epoch":3,"state":"held","waiters":["engine-1"]}],
                "counters":{"grants":3,"releases":2,"expirations":0,"revocations":0}}"#,
        )
        .unwrap();
        let r = s.resource("engine").unwrap();
        assert_eq!(
            (r.holder.as_deref(), r.epoch, r.state.as_deref()),
            (Some("engine-0"), Some(3), Some("held"))
        );
        assert!(s.resource("other").is_none());
    }

    #[tokio::test]
    async fn http_get_against_a_real_socket() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(std::str::from_utf8(&buf[..n])
                .unwrap()
                .starts_with("GET /state HTTP/1.1\r\n"));
            let body = r#"{"state":"standby","transitions":[]}"#;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(resp.as_bytes()).await.unwrap();
        });
        let d = get_state(addr, Duration::from_secs(5)).await.unwrap();
        assert_eq!(d.state, "standby");
        server.await.unwrap();
        // Nobody listening: an error, not a hang.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(get_state(dead, Duration::from_secs(2)).await.is_err());
    }
}
