//! A streamed completion read as raw bytes off the socket, so that the test sees exactly how
//! it ended: closed by the engine (`data: [DONE]`), or cut.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::vllm::MODEL_NAME;

/// A stream being read in the background.
pub struct Open {
    text: Arc<Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

/// How a stream ended.
#[derive(Debug)]
pub struct End {
    /// `data: [DONE]` arrived: the engine closed the stream.
    pub done: bool,
    /// SSE events received.
    pub events: usize,
    /// The last event (truncated).
    pub last: String,
    /// The connection ended (closed by the server, or cut) within the wait.
    pub ended: bool,
}

/// POST a streamed completion of `max_tokens` and return once its first event has arrived.
pub fn open(engine: SocketAddr, prompt: &str, max_tokens: u32) -> Result<Open, String> {
    let body = serde_json::json!({
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "stream": true, "ignore_eos": true,
    })
    .to_string();
    let mut s =
        TcpStream::connect_timeout(&engine, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {engine}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let text = Arc::new(Mutex::new(String::new()));
    let t2 = text.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            t2.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let first = harness::wait_until(Duration::from_secs(30), Duration::from_millis(5), || {
        text.lock().unwrap().contains("data: {")
    });
    if !first {
        return Err(format!("no event within 30 s: {}", text.lock().unwrap()));
    }
    Ok(Open { text, reader })
}

impl Open {
    /// Wait (bounded) for the stream to end; how it ended.
    pub fn finish(self, timeout: Duration) -> End {
        let ended = harness::wait_until(timeout, Duration::from_millis(10), || {
            self.reader.is_finished()
        });
        let text = self.text.lock().unwrap().clone();
        let events: Vec<&str> = text.split("data: ").skip(1).collect();
        End {
            done: text.contains("data: [DONE]"),
            events: events.len(),
            ended,
            last: events
                .last()
                .map(|e| e.chars().take(300).collect())
                .unwrap_or_default(),
        }
    }
}
