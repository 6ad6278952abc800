//! The one HTTP client of tests, benchmarks and the drill: `ureq` over plain HTTP on
//! loopback, every call bounded by a timeout, any status returned as a value (not an error).

use std::time::Duration;

/// A response: status code and body text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The body, as text (lossy UTF-8).
    pub body: String,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        // A redirect is an answer (kubelet counts 3xx as success); nothing here redirects.
        .max_redirects(0)
        .build()
        .into()
}

/// GET `url`; `None` if no complete response came within `timeout` (refused, reset, timed
/// out, body cut short).
pub fn get(url: &str, timeout: Duration) -> Option<Response> {
    let mut r = agent(timeout).get(url).call().ok()?;
    let status = r.status().as_u16();
    // A body cut short (the server died mid-answer) is no answer.
    let body = String::from_utf8_lossy(&r.body_mut().read_to_vec().ok()?).into_owned();
    Some(Response { status, body })
}

/// POST `body` (as `application/json`) to `url`; `None` if no complete response came within
/// `timeout`.
pub fn post_json(url: &str, body: &str, timeout: Duration) -> Option<Response> {
    let mut r = agent(timeout)
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .ok()?;
    let status = r.status().as_u16();
    // A body cut short (the server died mid-answer) is no answer.
    let body = String::from_utf8_lossy(&r.body_mut().read_to_vec().ok()?).into_owned();
    Some(Response { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn reads_status_and_body_and_times_out_on_silence() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\n\r\nasleep")
                .unwrap();
            // A second connection that never answers.
            let (_silent, _) = l.accept().unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let r = get(
            &format!("http://127.0.0.1:{port}/ready"),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body, "aslee");
        let t0 = std::time::Instant::now();
        assert_eq!(
            get(
                &format!("http://127.0.0.1:{port}/x"),
                Duration::from_millis(100)
            ),
            None
        );
        assert!(t0.elapsed() < Duration::from_millis(450));
        t.join().unwrap();
    }
}
