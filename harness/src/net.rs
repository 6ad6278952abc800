//! Loopback ports.

use std::net::SocketAddr;

/// A free TCP port on 127.0.0.1 (bind to port 0, read it, close).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// `127.0.0.1:<a free port>`.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}
